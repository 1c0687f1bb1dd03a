"""Inductor's CPU vector-ISA probe, carried from the process that stored kernels to one that loads them.

Before Inductor builds or loads a C++ kernel it picks the CPU's vector ISA (``cpu_vec_isa``): for each
ISA the CPU's flags name, it compiles a probe library and loads it in a child Python, once per process.
A restart that only loads stored kernels would pay that for an answer the storing process already had.
:func:`probed_vec_isas` takes the storing process's answer with the toolchain it holds for (compiler,
torch, machine); :func:`adopt_vec_isas` makes it this process's answer when the toolchain and the
CPU's candidate ISAs are the same here, and otherwise leaves the probe to run as usual. Adopting skips
each ISA's own probe; Inductor's AVX-512 ISAs then still probe the features they build with (bf16, VNNI,
AMX) where the CPU reports them, as they do after their own probe.
"""

from __future__ import annotations

import dataclasses
import os
import platform
from typing import Any

import torch

from ppcompile.torch_internals.lookup import attr, lookup

__all__ = ["ProbedVecIsas", "adopt_vec_isas", "probed_vec_isas"]

_WHY = "to reuse Inductor's CPU vector-ISA probe on a warm restart"


@dataclasses.dataclass(frozen=True)
class ProbedVecIsas:
    """The ISAs whose probe built and loaded, in Inductor's order of preference, and the toolchain
    they were probed with."""

    toolchain: str
    isas: tuple[str, ...]


def _valid_list() -> Any:
    """Inductor's per-process, memoised list of the ISAs that passed the probe."""
    return lookup("torch._inductor.cpu_vec_isa", "valid_vec_isa_list", _WHY)


def _probe_is_inductors() -> bool:
    """Inductor decides by probing: the user has not set the answer (``cpp.vec_isa_ok``), and the
    build is not fbcode's (which trusts every ISA)."""
    config = lookup("torch._inductor", "config", _WHY)
    return attr(config, "cpp.vec_isa_ok", "torch._inductor.config", _WHY) is None and not config.is_fbcode()


def _toolchain() -> str:
    """What a probe's result depends on besides the CPU: the compiler's version, torch's version and
    libraries, the machine."""
    fingerprint = lookup("torch._inductor.cpu_vec_isa", "_get_isa_dry_compile_fingerprint", _WHY)
    torch_libs = os.path.join(os.path.dirname(torch.__file__), "lib")
    return f"{fingerprint('')}|{torch_libs}|{platform.machine()}"


def _probed_yet(valid_list: Any) -> bool:
    return bool(valid_list.cache_info().currsize)


def probed_vec_isas() -> ProbedVecIsas | None:
    """This process's probe answer; ``None`` when it has not probed (no C++ kernel built or loaded yet)
    or did not decide by probing."""
    valid_list = _valid_list()
    if not _probed_yet(valid_list) or not _probe_is_inductors():
        return None
    return ProbedVecIsas(_toolchain(), tuple(str(isa) for isa in valid_list()))


def adopt_vec_isas(probed: ProbedVecIsas | None) -> bool:
    """Make ``probed`` this process's answer, with no probe, when it holds here: this process has not
    probed, Inductor would probe, the toolchain is the same, and the ISAs this CPU's flags name are
    exactly ``probed.isas``. False otherwise: then the probe runs when a kernel first needs it."""
    valid_list = _valid_list()
    if probed is None or _probed_yet(valid_list) or not _probe_is_inductors():
        return False
    if _toolchain() != probed.toolchain:
        return False
    config = lookup("torch._inductor", "config", _WHY)
    with config.patch({"cpp.vec_isa_ok": True}):  # every ISA the flags name counts as probed
        candidates = tuple(str(isa) for isa in attr(valid_list, "__wrapped__", "valid_vec_isa_list", _WHY)())
        if candidates != probed.isas:
            return False
        valid_list()  # memoised for the process: the list a probe here would give
    return True
