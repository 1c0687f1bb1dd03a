"""The command-line interface, ``python -m ppcompile <command>``: one module per command (``demo``,
``dump``, ``report``, ``plan``, ``bench``), each with ``add_arguments(parser)`` and ``run(args) -> int``,
and ``main.py``, which lists them.

The CLI sits above the rest of the package: it drives the backend, the models, the pipeline, the planner
and the debug tools; nothing outside ``ppcompile.cli`` (but ``ppcompile.__main__``) imports it.
"""
