"""What the compile side calls to be observed: pass dumps, runnable graph files, progress on long work,
and the hooks through which ``ppcompile.debug`` hears that a stage was built or a capture run started.

Low in the package on purpose: ``passes/`` and ``backends/`` import it; it imports neither, nor
``debug/``, which sits on top and registers its hooks (``hooks.py``).
"""
