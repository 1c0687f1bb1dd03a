"""A stage written out as lowering would emit it, for runtime tests without Dynamo: ``graph (x @ w) |
break (cumsum over tokens, bridged) | graph (* 2)``, token count ``s0``, buckets 4, 8, 16."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import sympy
import torch

from ppcompile.config import PPBreakableConfig
from ppcompile.records import Segment, StaticBuffer
from ppcompile.runtime.buckets import make_bucket_plan
from ppcompile.runtime.compiled_stage import CompiledStage
from ppcompile.runtime.program import BreakStep, CopyPoint, GraphStep, OutputRing, Program, Ref
from ppcompile.runtime.stage_runtime import StageRuntime
from ppcompile.runtime.static_buffers import BufferPlan, TensorLayout
from ppcompile.runtime.validation import InputSpec
from ppcompile.symbolic import SizeFn

__all__ = ["CAP", "H", "call", "eager", "hand_made"]

H, CAP = 4, 16
S0 = sympy.Symbol("s0", integer=True, positive=True)
TOKENS, WIDTH, ONE = SizeFn(S0), SizeFn(sympy.Integer(H)), SizeFn(sympy.Integer(1))
ROWS = ((0, TOKENS),)  # dim 0 scales with the token count
CPU = torch.device("cpu")
LAYOUT = TensorLayout((TOKENS, WIDTH), (WIDTH, ONE), torch.float32, CPU)


def _matmul(x: torch.Tensor, w: torch.Tensor) -> Sequence[torch.Tensor]:
    return (x @ w,)


def _cumsum(h: torch.Tensor) -> Sequence[torch.Tensor]:
    return (h.cumsum(0),)


def _double(c: torch.Tensor) -> Sequence[torch.Tensor]:
    return (c * 2,)


def hand_made(mode: str = "emulate", bridge: bool = True, output_slots: int = 1,
              **options: Any) -> tuple[CompiledStage, PPBreakableConfig]:
    """Slots: 0 x (live input), 1 w (module state), 2 x @ w, 3 its cumsum (bridged), 4 the output.
    ``bridge=False``: the break's copy point is left out (a lowering bug); ``output_slots`` > 1: the
    output is copied into a ring of that many slots."""
    config = PPBreakableConfig.from_options({"graph_mode": mode, "capture_sizes": [4, 8, CAP],
                                             "output_slots": output_slots, **options})
    graph_0, brk, graph_2 = Segment("g0", "graph", 1), Segment("b1", "break", 1), Segment("g2", "graph", 1)
    sized = {"out_sizes": ((TOKENS, WIDTH),), "out_layouts": (LAYOUT,)}
    buffers = {
        0: BufferPlan(0, StaticBuffer("x", "input", (CAP, H), torch.float32, CPU, (0,)), "input 'x'", ROWS),
        3: BufferPlan(3, StaticBuffer("b1", "bridge", (CAP, H), torch.float32, CPU, (0,)),
                      "the output 0 of break segment b1", ROWS),
    }
    copies = CopyPoint(1, 1, (3,), (3,)) if bridge else None
    program = Program(
        num_slots=5, num_inputs=2,
        steps=(
            GraphStep(0, graph_0, _matmul, (Ref(slot=0), Ref(slot=1)), (2,), live_views=(2,), **sized),
            BreakStep(1, brk, _cumsum, (Ref(slot=2),), (3,), copies=copies, **sized),
            GraphStep(2, graph_2, _double, (Ref(slot=3),), (4,), live_views=(4,), **sized),
        ),
        outputs=(Ref(slot=4),),
        token_dims={slot: ROWS for slot in (0, 2, 3, 4)},
        buffers=buffers,
        copy_in=CopyPoint(0, None, (0,), (0,)),
        input_layouts={0: ("x", LAYOUT)},
        output_ring=OutputRing(output_slots, (4,), (LAYOUT,)) if output_slots > 1 else None,
    )
    compiled = CompiledStage(
        name="hand_made", graph_mode=mode, program=program, plan=make_bucket_plan(config),
        segments=(graph_0, brk, graph_2), layer_ids=(), token_symbol=S0, token_input=(0, 0),
        symbol_slots=(), state_slots=(1,), scalar_slots=(), tensor_slots=(0,),
        input_specs=(InputSpec(0, "x", torch.float32, CPU, 2, ((1, H),), ((0, TOKENS),)),),
        live_checks=(), eager_reason=None,
    )
    return compiled, config


def eager(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return (x @ w).cumsum(0) * 2


def call(runtime: StageRuntime, n: int, w: torch.Tensor, seed: int) -> tuple[Any, torch.Tensor]:
    x = torch.randn(n, H, generator=torch.Generator().manual_seed(seed))
    return runtime(x, w)[0], eager(x, w)


