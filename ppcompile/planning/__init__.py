"""Bucket planning from live traffic.

- ``traffic``: the token counts a stage served (``TokenHistogram``), recorded by the runtime at no cost
  worth measuring.
- ``planner``: ``plan_buckets``, which picks the capture ladder that a histogram pays for best.

The drivers that measure a device (``cli/gain_probe.py``) and print a plan (``cli/plan.py``) sit in
``cli/``. This ``__init__`` imports nothing: the runtime imports ``planning.traffic`` alone.
"""
