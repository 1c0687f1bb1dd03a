"""The entries on Dynamo's frames, on the installed torch."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from ppcompile.torch_internals.frames import compile_again, compiling_code, watch_compiles

pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def _recording_backend(seen: list[Any]) -> Callable[..., Any]:
    def backend(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        seen.append(compiling_code())
        return gm.forward

    return backend


def test_compiling_code_is_the_frame_being_compiled_and_none_outside() -> None:
    def double(x: torch.Tensor) -> torch.Tensor:
        return x * 2

    seen: list[Any] = []
    torch.compile(double, backend=_recording_backend(seen))(torch.randn(3))
    assert seen == [double.__code__]
    assert compiling_code() is None


def test_watch_compiles_sees_a_failed_compile_end_and_compile_again_undoes_the_skip() -> None:
    starts: list[str] = []
    ends: list[str] = []
    failed: list[bool] = []
    watch_compiles(starts.append, lambda compile_id, raised: (ends.append(compile_id), failed.append(raised)))
    seen: list[Any] = []

    def stage(x: torch.Tensor, fail: bool) -> torch.Tensor:
        if fail:
            raise ValueError("a bad input")
        return x + 1

    compiled = torch.compile(stage, backend=_recording_backend(seen))
    compiled(torch.randn(3), False)
    with pytest.raises(ValueError, match="a bad input"):
        compiled(torch.randn(3), True)  # its recompile raises: Dynamo runs stage uncompiled from now on
    assert starts[:2] == ends[:2] == ["0/0", "0/1"] and len(seen) == 1
    assert failed[:2] == [False, True]  # the recompile's end sees its error in flight
    compiled(torch.randn(3), False)
    assert len(seen) == 1 and ends[-1] == "0/1"  # skipped: no compile, not even a cache lookup
    compile_again(stage.__code__)
    with pytest.raises(ValueError, match="a bad input"):
        compiled(torch.randn(3), True)
    assert ends[-1] == "0/2" and failed[-1]  # looked up and compiled again
