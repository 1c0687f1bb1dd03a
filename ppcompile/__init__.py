"""ppcompile: a ``torch.compile`` backend (``pp_breakable``) that graphs the prefill forward of one
pipeline-parallel stage, breaking at attention and padding live batches to captured token buckets."""

from __future__ import annotations

from ppcompile.config import PPBreakableConfig
from ppcompile.counters import counters
from ppcompile.proxy import PPProxyTensors

__all__ = ["PPBreakableConfig", "PPProxyTensors", "counters"]
__version__ = "0.1.0"
