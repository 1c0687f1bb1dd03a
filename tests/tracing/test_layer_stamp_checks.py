"""``layer_stamp_checks``: how a layer's arguments are laid out for its stamped op, and when two layers
may share one trace (their ops recorded on meta tensors agree but for custom-op constants)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from ppcompile.tracing.layer_stamp_checks import (
    Substitution,
    compare_layers,
    decode_arguments,
    encode_arguments,
)


@torch.library.custom_op("ppcompile_test::shifted", mutates_args=())
def shifted(x: torch.Tensor, layer: int) -> torch.Tensor:
    return x + layer


@shifted.register_fake
def _(x: torch.Tensor, layer: int) -> torch.Tensor:
    return torch.empty_like(x)


@torch.library.custom_op("ppcompile_test::rows", mutates_args=())
def rows(x: torch.Tensor, n: int) -> torch.Tensor:
    return x[:n].clone()


@rows.register_fake
def _(x: torch.Tensor, n: int) -> torch.Tensor:
    return x.new_empty(n, x.shape[1])


SIZE_RUNS = [0]  # how often counted's size function ran


@torch.library.custom_op("ppcompile_test::counted", mutates_args=())
def counted(x: torch.Tensor) -> torch.Tensor:
    return x.clone()


@counted.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    SIZE_RUNS[0] += 1
    return torch.empty_like(x)


class Layer(nn.Module):
    def __init__(self, index: int, kind: str = "custom") -> None:
        super().__init__()
        self.index, self.kind = index, kind
        self.w = nn.Parameter(torch.randn(4, 4), requires_grad=False)

    def forward(self, x: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
        y = x @ self.w
        if self.kind == "custom":
            return torch.ops.ppcompile_test.shifted(y, self.index)
        if self.kind == "torch":
            return y * self.index
        if self.kind == "branch":
            return y.relu() if self.index % 2 else y
        if self.kind == "rows":  # a custom op whose output size is the constant it takes
            return torch.ops.ppcompile_test.rows(y, self.index) + 1
        if self.kind == "resize":  # sizes changed in place, then read
            y.unsqueeze_(0)
            return y.reshape(y.shape[1], -1) * 2
        if self.kind == "counted":
            return torch.ops.ppcompile_test.counted(y)
        if self.kind == "host":
            return y * float(y.sum())  # reads a value: meta tensors have none
        x.add_(1.0)
        return y


def _compare(a: nn.Module, b: nn.Module, layout: str = "T") -> tuple[Substitution, ...] | str:
    return compare_layers(a, b, layout, [torch.randn(3, 4)], ("layers.0", "layers.1"))


def test_arguments_round_trip_through_their_layout() -> None:
    t, u, v = torch.randn(2), torch.randn(3), torch.randn(4)
    layout, tensors = encode_arguments((t, None, (u, 2)), {"bias": v, "gain": 0.5, "flag": True}) or ("", [])
    assert layout == "T|=None|(T,=2)|bias:T|gain:=0.5|flag:=True"
    assert tensors == [t, u, v]
    args, kwargs = decode_arguments(layout, tensors)
    assert args[0] is t and args[1] is None and args[2][0] is u and args[2][1] == 2
    assert kwargs["bias"] is v and kwargs == {"bias": v, "gain": 0.5, "flag": True}


@pytest.mark.parametrize("n", [1, 3, 15])
def test_positional_tensors_are_laid_out_as_the_stamped_forward_assumes(n: int) -> None:
    # The stamped forward skips encode_arguments for positional tensors and uses this layout.
    tensors = [torch.randn(2) for _ in range(n)]
    assert encode_arguments(tuple(tensors), {}) == ("|".join(["T"] * n), tensors)


@pytest.mark.parametrize("value", ["text", {"a": 1}, [torch.randn(2), [torch.randn(2)]], object()])
def test_arguments_it_cannot_lay_out_are_refused(value: Any) -> None:
    assert encode_arguments((torch.randn(2), value), {}) is None


def test_a_per_layer_constant_a_custom_op_takes_is_substituted() -> None:
    subs = _compare(Layer(3), Layer(7))
    assert subs == (Substitution("ppcompile_test::shifted", 0, 1, "layer", 3, 7),)
    assert _compare(Layer(3), Layer(3)) == ()


@pytest.mark.parametrize(("kind", "why"), [
    ("torch", "its call of aten::mul.Tensor differs from layers.0's in argument 1 (6 vs 3)"),
    ("branch", "it runs 1 ops, layers.0 2"),
    ("host", "layers.0 cannot run on fake tensors (DataDependentOutputException"),  # meta, then fake
    ("writes", "writes its input 0 in place"),
])
def test_what_keeps_a_layer_from_sharing_a_trace(kind: str, why: str) -> None:
    got = _compare(Layer(3, kind), Layer(6, kind))
    assert isinstance(got, str) and why in got, got


def test_weights_must_match_in_shape_and_strides() -> None:
    """A stamped layer's weights replace the exemplar's in compiled code that assumes their layout."""
    a, b, c = Layer(3), Layer(3), Layer(3)
    b.w = nn.Parameter(torch.randn(4, 4).t(), requires_grad=False)  # the same shape, other strides
    assert _compare(a, b) == "its weight 'w' is [4, 4] (strides [1, 4], torch.float32, cpu), layers.0's " \
        "[4, 4] (strides [4, 1], torch.float32, cpu)"
    c.register_buffer("extra", torch.zeros(2))
    assert _compare(a, c) == "its weight 'extra' is [2] (strides [1], torch.float32, cpu), layers.0's missing"


def test_a_custom_op_whose_sizes_follow_its_constant_is_refused() -> None:
    """A stamped layer is the exemplar's ops with the constants substituted; the exemplar's sizes would
    stay in the copy."""
    assert _compare(Layer(3, "rows"), Layer(2, "rows")) == \
        "its call of ppcompile_test::rows returns [2, 4], layers.0's [3, 4]"


def test_a_later_layer_replays_the_exemplars_ops_without_running_them() -> None:
    exemplar = Layer(0, "counted")
    SIZE_RUNS[0] = 0
    for _ in range(3):
        assert _compare(exemplar, Layer(0, "counted")) == ()
    assert SIZE_RUNS[0] == 1  # the exemplar's run, recorded once


def test_ops_that_change_sizes_in_place_run_in_a_replay() -> None:
    """Replayed without running, ``unsqueeze_`` would leave the layer's sizes behind the exemplar's."""
    exemplar = Layer(0, "resize")
    assert _compare(exemplar, Layer(0, "resize")) == ()
    assert _compare(exemplar, Layer(0, "resize")) == ()
