"""ppcompile: a ``torch.compile`` backend (``pp_breakable``) that graphs the prefill forward of one
pipeline-parallel stage, breaking at attention and padding live batches to captured token buckets."""

from __future__ import annotations

import logging

from ppcompile import envs
from ppcompile.analysis.op_matching import register_attention_op
from ppcompile.analysis.token_locality import register_token_local_op
from ppcompile.backends.bound_options import backend_with_options, register_backend_with_options
from ppcompile.backends.pp_breakable import pp_breakable, runtimes_of, stage_runtimes
from ppcompile.backends.warm_cache import clear_warm_cache, warm_cache_dir
from ppcompile.backends.warm_start import WarmStage, warm_compile
from ppcompile.capturable import Metadata, Rows, declare_capturable
from ppcompile.config import PPBreakableConfig
from ppcompile.counters import counters
from ppcompile.debug import DEBUG_HOOKS
from ppcompile.observe.hooks import observe_stages
from ppcompile.passes.check_padding_safety import PaddingSafetyError
from ppcompile.planning.planner import plan_buckets
from ppcompile.planning.traffic import TokenHistogram, token_histogram
from ppcompile.proxy import PPProxyTensors
from ppcompile.runtime.contract_check import CapturableContractError, check_capturable
from ppcompile.runtime.executors import ReplayAddressError
from ppcompile.runtime.fences import fence_outputs
from ppcompile.runtime.group_agreement import GroupCaptureError, GroupDivergenceError
from ppcompile.runtime.stage_runtime import ConcurrentCallError
from ppcompile.runtime.stale_outputs import StaleOutputError
from ppcompile.runtime.validation import InputMismatchError
from ppcompile.torch_internals import register_backend
from ppcompile.tracing.layer_regions import layer_region_plans, trace_layers_once
from ppcompile.tracing.marks import TokenMarking, mark_first_call, mark_token_dynamic
from ppcompile.tracing.regions import eager_region, opaque_library_mixers, opaque_module, token_local

__all__ = [
    "CapturableContractError",
    "ConcurrentCallError",
    "GroupCaptureError",
    "GroupDivergenceError",
    "InputMismatchError",
    "Metadata",
    "PPBreakableConfig",
    "PPProxyTensors",
    "PaddingSafetyError",
    "ReplayAddressError",
    "Rows",
    "StaleOutputError",
    "TokenHistogram",
    "TokenMarking",
    "WarmStage",
    "backend_with_options",
    "check_capturable",
    "clear_warm_cache",
    "counters",
    "declare_capturable",
    "eager_region",
    "fence_outputs",
    "layer_region_plans",
    "mark_first_call",
    "mark_token_dynamic",
    "opaque_library_mixers",
    "opaque_module",
    "plan_buckets",
    "pp_breakable",
    "register_attention_op",
    "register_backend_with_options",
    "register_token_local_op",
    "runtimes_of",
    "stage_runtimes",
    "token_histogram",
    "token_local",
    "trace_layers_once",
    "warm_cache_dir",
    "warm_compile",
]
__version__ = "0.1.0"

BACKEND_NAME = "pp_breakable"


def _configure_logging() -> None:
    """``PPCOMPILE_LOG_LEVEL`` sets the level of the ``ppcompile`` logger and, when the application
    configured no handler for it, attaches one to stderr so the asked-for messages show (and stops them
    propagating, so a root handler configured later does not print each line twice)."""
    level = envs.log_level()
    if not level:
        return
    logger = logging.getLogger("ppcompile")
    logger.setLevel(level.upper())
    if not logger.hasHandlers():
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
        logger.addHandler(handler)
        logger.propagate = False


def _register_backend() -> None:
    """Registers the backend by name unless the entry point mechanism will (or did).

    Dynamo's entry-point discovery imports this package and then registers the backend itself; doing
    it here as well would raise "duplicate name". So register only when discovery has not seen us.
    """
    register_backend(pp_breakable, BACKEND_NAME)


_configure_logging()
_register_backend()
observe_stages(DEBUG_HOOKS)  # the debug tools observe from above (observe/hooks.py)
