"""Tests for ``ppcompile.runtime.fused_copy``: the one-launch row copier against the per-tensor torch ops,
bit for bit.

On CPU the Triton kernel runs under Triton's interpreter (``TRITON_INTERPRET=1``, set before a copier is
made): slow, so the tensors stay tiny. Destinations start filled with all-one bits (a NaN for every float
dtype) so that a missed padding row or a write beyond the bucket shows. The GPU tests (marked ``gpu``) run
the compiled kernel through its direct launcher and count launches with ``torch.profiler``.
"""

from __future__ import annotations

import hashlib
import re
import sys
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ppcompile import envs
from ppcompile.runtime import fused_copy_codegen as codegen
from ppcompile.runtime.fused_copy import (
    INT_TYPES,
    CopyMismatchError,
    RowCopier,
    TorchRowCopier,
    make_row_copier,
    working_or_torch,
)

Call = tuple[Sequence[torch.Tensor], Sequence[int], Sequence[int]]

DTYPES = [torch.bool, torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64, torch.float16,
          torch.bfloat16, torch.float32, torch.float64, torch.float8_e4m3fn, torch.float8_e5m2,
          torch.complex64]


def bits(t: torch.Tensor) -> torch.Tensor:
    """``t``'s raw bits (a view as the integer type of its element size)."""
    return t.view(INT_TYPES[t.dtype.itemsize])


def filled(t: torch.Tensor) -> torch.Tensor:
    """``t`` with every bit set: a NaN for floats, so a missed padding row or a stray write shows."""
    bits(t).fill_(-1)
    return t


def random_bits(shape: Sequence[int], dtype: torch.dtype, device: str = "cpu") -> torch.Tensor:
    """Random raw bits of ``dtype`` (NaNs with payloads included); bools 0 or 1."""
    if dtype is torch.bool:
        return torch.randint(0, 2, tuple(shape), device=device).bool()
    int_t = INT_TYPES[dtype.itemsize]
    hi = 2 ** (8 * dtype.itemsize - 2)
    return torch.randint(-hi, hi, tuple(shape), dtype=int_t, device=device).mul_(2).add_(
        torch.randint(0, 2, tuple(shape), dtype=int_t, device=device)).view(dtype)


def compare(make_dsts: Callable[[], list[torch.Tensor]], dims: Sequence[int | None], calls: Sequence[Call],
            kernel: str = "triton") -> RowCopier:
    """Runs ``calls`` through a ``kernel`` copier and a torch copier on identical buffers; asserts the buffers
    agree bit for bit after every call, padding zero and rows beyond the bucket untouched."""
    fast = make_row_copier(make_dsts(), dims, kernel=kernel)
    ref = make_row_copier(make_dsts(), dims, kernel="torch")
    assert fast.kernel == "triton" and ref.kernel == "torch"
    for srcs, ns, bs in calls:
        before = [bits(t).clone() for t in fast.dsts]
        fast(srcs, ns, bs)
        ref(srcs, ns, bs)
        for i, (got, want, d) in enumerate(zip(fast.dsts, ref.dsts, dims)):
            where = f"tensor {i} ({got.dtype}, shape {list(got.shape)}), n={ns[i]}, b={bs[i]}"
            assert torch.equal(bits(got), bits(want)), where
            if d is not None:
                n, b, rows = ns[i], bs[i], got.shape[d]
                assert not bits(got.narrow(d, n, b - n)).any(), where
                assert torch.equal(bits(got).narrow(d, b, rows - b), before[i].narrow(d, b, rows - b)), where
    return fast


def token_calls(
    shape: Sequence[int], dim: int, dtype: torch.dtype, pairs: Sequence[tuple[int, int]]
) -> list[Call]:
    calls: list[Call] = []
    for n, b in pairs:
        s = list(shape)
        s[dim] = n
        calls.append(([random_bits(s, dtype)], [n], [b]))
    return calls


# ----------------------------------------------------------------------------------- choosing a kernel
def test_auto_picks_torch_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the interpreter is a test aid, never picked by auto
    copier = make_row_copier([torch.zeros(8, 4)], [0])
    assert copier.kernel == "torch" and copier.launch_path == "torch"
    assert copier.launches_per_call == 2 and copier.compiles == 0


def test_unknown_kernel_and_bad_dims_raise() -> None:
    with pytest.raises(ValueError, match="kernel='cuda'"):
        make_row_copier([torch.zeros(4)], [0], kernel="cuda")
    with pytest.raises(ValueError, match=r"buffer 0 .* has no dim 2"):
        make_row_copier([torch.zeros(4, 2)], [2])
    with pytest.raises(ValueError, match="2 buffers but 1 token dims"):
        make_row_copier([torch.zeros(4), torch.zeros(4)], [0])


def test_triton_without_triton_raises_and_auto_falls_back(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "triton", None)  # import triton -> ImportError
    with pytest.raises(RuntimeError, match="triton is not importable"):
        make_row_copier([torch.zeros(4)], [0], kernel="triton")
    assert make_row_copier([torch.zeros(4)], [0], kernel="auto").kernel == "torch"


def test_triton_on_cpu_needs_the_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("triton")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        make_row_copier([torch.zeros(4)], [0], kernel="triton")


def test_triton_refuses_what_it_cannot_copy(interpret: None) -> None:
    with pytest.raises(RuntimeError, match="complex128 has 16-byte elements"):
        make_row_copier([torch.zeros(4, dtype=torch.complex128)], [0], kernel="triton")
    with pytest.raises(RuntimeError, match="sharing memory"):
        make_row_copier([torch.zeros(4, 1).expand(4, 3)], [0], kernel="triton")


def test_torch_path_copies_rows_and_zeroes_padding() -> None:
    dst = filled(torch.empty(8, 3))
    copier = make_row_copier([dst], [0], kernel="torch")
    src = torch.randn(2, 3)
    copier([src], [2], [5])
    assert torch.equal(dst[:2], src) and not dst[2:5].any() and dst[5:].isnan().all()


# ----------------------------------------------------------------------------------- the kernel, interpreted
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_dtype_bit_for_bit(interpret: None, dtype: torch.dtype) -> None:
    calls = token_calls((8, 3), 0, dtype, [(3, 5), (0, 5), (1, 8), (7, 8), (8, 8)])
    compare(lambda: [filled(torch.empty(8, 3, dtype=dtype))], [0], calls)


def test_strided_sources(interpret: None) -> None:
    """Column slices, transposes, expanded dims and an unaligned slice, all in one copier."""
    B, H = 8, 4

    def dsts() -> list[torch.Tensor]:
        return [filled(torch.empty(B, H)) for _ in range(4)]

    calls: list[Call] = []
    for n, b in [(5, 6), (1, 8), (0, 2), (8, 8)]:
        wide = torch.randn(n, 3 * H)
        srcs = [wide[:, H:2 * H],  # a column slice of a wider buffer
                torch.randn(H, n).t(),  # transposed
                torch.randn(1, H).expand(n, H),  # stride 0 along the token dim
                torch.randn(n * H + 1)[1:].view(n, H)]  # 4 bytes past an aligned address
        calls.append((srcs, [n] * 4, [b] * 4))
    copier = compare(dsts, [0] * 4, calls)
    assert copier.compiles <= 2


def test_permuted_destinations_and_token_dims_not_leading(interpret: None) -> None:
    B = 6

    def dsts() -> list[torch.Tensor]:
        return [filled(torch.empty(3, B, 5)).permute(1, 0, 2),  # [B, 3, 5], token dim 0, not outermost
                filled(torch.empty(4, B)),  # token dim 1
                filled(torch.empty(2, 3, B, 2, dtype=torch.float16)),  # rank 4, token dim 2
                filled(torch.empty(B, 2)).t()]  # [2, B] with token dim 1 innermost... in a transposed buffer

    calls: list[Call] = []
    for n, b in [(4, 5), (2, 6), (6, 6), (1, 2)]:
        srcs = [torch.randn(n, 3, 5), torch.randn(4, n), random_bits((2, 3, n, 2), torch.float16),
                torch.randn(2, n)]
        calls.append((srcs, [n] * 4, [b] * 4))
    compare(dsts, [0, 1, 2, 1], calls)


def test_mixed_dtypes_ranks_and_full_copies_in_one_launch(interpret: None) -> None:
    B = 5

    def dsts() -> list[torch.Tensor]:
        return [filled(torch.empty(B, 3, dtype=torch.bfloat16)), filled(torch.empty(B, dtype=torch.int64)),
                filled(torch.empty((), dtype=torch.float32)), filled(torch.empty(2, 2, dtype=torch.int8)),
                filled(torch.empty(B, 2, 2, dtype=torch.bool)), filled(torch.empty(0, 3))]

    calls: list[Call] = []
    for n, b in [(3, 4), (5, 5), (0, 1)]:
        srcs = [random_bits((n, 3), torch.bfloat16), torch.arange(n), torch.tensor(float("nan")),
                random_bits((2, 2), torch.int8), random_bits((n, 2, 2), torch.bool), torch.empty(0, 3)]
        calls.append((srcs, [n, n, 0, 0, n, 0], [b, b, 0, 0, b, 0]))
    copier = compare(dsts, [0, 0, None, None, 0, None], calls)
    assert copier.launches_per_call == 1 and copier.launch_path == "interpreter"
    assert copier.source.count("if ") == 5  # one block per non-empty tensor


def test_one_kernel_while_the_layout_holds(interpret: None) -> None:
    """Token counts change every call; the kernel is generated once (a token dim of n <= 1 and an empty
    source say nothing about the layout)."""
    dst = filled(torch.empty(16, 4))
    copier = make_row_copier([dst], [0], kernel="triton")
    for n in [3, 1, 0, 16, 9, 2]:
        src = torch.randn(4, n).t() if n == 1 else torch.randn(n, 4)  # n == 1: odd strides, same copy
        copier([src], [n], [16])
        assert torch.equal(dst[:n], src)
    assert copier.compiles == 1


def test_strides_that_follow_n_become_arguments(interpret: None) -> None:
    """A [3, n] source (token dim 1) has a stride of n: after one change, the kernel reads strides per
    call instead of being rebuilt for every n."""
    calls = token_calls((3, 16), 1, torch.float32, [(4, 4), (5, 8), (9, 16), (2, 2)])
    copier = compare(lambda: [filled(torch.empty(3, 16))], [1], calls)
    assert copier.compiles == 2 and "st0_0: tl.int64" in copier.source


def test_a_source_that_is_its_own_destination(interpret: None) -> None:
    """An out-variant op that wrote into the bridge's first rows: the copy reads what it writes."""
    dst = filled(torch.empty(8, 2))
    copier = make_row_copier([dst], [0], kernel="triton")
    dst[:3] = torch.randn(3, 2)
    before = dst[:3].clone()
    copier([dst[:3]], [3], [6])
    assert torch.equal(dst[:3], before) and not dst[3:6].any()


def test_inference_buffers(interpret: None) -> None:
    with torch.inference_mode():
        dst = filled(torch.empty(4, 2))
        copier = make_row_copier([dst], [0], kernel="triton")
        copier([torch.ones(2, 2)], [2], [3])
    assert dst[:2].eq(1).all() and not dst[2:3].any()


def test_the_interpreter_setting_is_the_one_the_copier_was_made_with(
    interpret: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    copier = make_row_copier([torch.zeros(7, 13)], [0], kernel="triton")
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET changed"):
        copier([torch.ones(2, 13)], [2], [3])


# ----------------------------------------------------------------------------------- validation
@pytest.mark.parametrize("warm", [False, True], ids=["slow path", "generated checks"])
@pytest.mark.parametrize("kernel", ["torch", "triton"])
def test_bad_calls_name_the_source_and_write_nothing(interpret: None, kernel: str, warm: bool) -> None:
    dsts = [filled(torch.empty(8, 4)), filled(torch.empty(8, dtype=torch.int64))]
    copier = make_row_copier(dsts, [0, 0], kernel=kernel)
    good = [torch.randn(3, 4), torch.arange(3)]
    if warm:
        copier(good, [3, 3], [4, 4])
    snapshot = [bits(d).clone() for d in dsts]
    bad_calls: list[tuple[Call, str]] = [
        (([good[0], good[1].double()], [3, 3], [4, 4]), r"source 1: expected dtype torch.int64, got torch.f"),
        (([torch.randn(3, 5), good[1]], [3, 3], [4, 4]), r"source 0: expected shape \[3, 4\] .*got \[3, 5\]"),
        (([good[0], good[1]], [3, 2], [4, 4]), r"source 1: expected shape \[2\] .*got \[3\]"),
        (([good[0], good[1]], [3, 3], [2, 4]), r"source 0: n=3, b=2: need 0 <= n <= b <= 8"),
        (([good[0], good[1]], [3, 3], [4, 9]), r"source 1: n=3, b=9: need 0 <= n <= b <= 8"),
        (([good[0]], [3], [4]), r"binds 2 buffers; got 1 sources"),
    ]
    for (srcs, ns, bs), message in bad_calls:
        with pytest.raises(CopyMismatchError, match=message):
            copier(srcs, ns, bs)
        assert all(torch.equal(bits(d), s) for d, s in zip(dsts, snapshot))
    copier(good, [3, 3], [8, 8])  # still usable
    assert torch.equal(dsts[0][:3], good[0]) and not dsts[1][3:].any()


# ----------------------------------------------------------------------------------- generated code
def test_host_code_passes_what_the_kernel_takes_in_its_order() -> None:
    """Direct launches pass raw pointers by position: the host's argument list must follow the kernel's
    parameters exactly (checked here without a GPU, with a fake launcher)."""
    plans = [codegen.plan_tensor(0, (8, 4), (4, 1), 0, 2, (4, 1), True),
             codegen.plan_tensor(1, (2, 2), (2, 1), None, 4, (2, 1), True),
             codegen.plan_tensor(2, (3, 8), (8, 1), 1, 8, None, False),
             codegen.plan_tensor(3, (0, 5), (5, 1), 0, 4, (5, 1), True)]
    kernel = codegen.kernel_source(plans)
    signature = re.search(r"def \w+\((.*)\):", kernel)
    assert signature is not None
    params = [p.split(":")[0].strip() for p in signature.group(1).split(",")]
    assert params == ["d0", "s0", "n0", "b0", "d1", "s1", "d2", "s2", "n2", "b2", "st2_0", "st2_1"]
    launched: list[tuple[Any, ...]] = []
    names: dict[str, Any] = {"run": lambda *a: launched.append(a), "stream": lambda dev: 7, "FN": "fn",
                             "META": "meta", "DEV": -1, "D0": 100, "D1": 101, "D2": 102, "D3": 103}
    for i, dt in enumerate([torch.bfloat16, torch.float32, torch.int64, torch.float32]):
        names[f"dtype_{i}"] = dt
    scope = dict(names)
    exec(codegen.host_source(plans, direct=True, checked=True, guard_device=False), scope)
    srcs = [torch.zeros(5, 4, dtype=torch.bfloat16), torch.zeros(2, 2), torch.zeros(3, 5, dtype=torch.int64),
            torch.zeros(0, 5)]
    scope["row_copy"](srcs, [5, 0, 5, 0], [6, 0, 7, 0])
    (args,) = launched
    grid = -(-6 * 4 // plans[0].block) + -(-7 * 3 // plans[2].block) + 1
    assert args[:9] == (grid, 1, 1, 7, "fn", "meta", None, None, None)
    assert args[9:] == (100, srcs[0].data_ptr(), 5, 6, 101, srcs[1].data_ptr(), 102, srcs[2].data_ptr(), 5, 7,
                        5, 1)


def test_kernel_compiles_for_a_gpu_and_vectorizes(interpret: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """The generated source through Triton's real compiler (sm_90 PTX, no GPU needed): a [n, 4096] bf16
    copy moves 16 bytes per load and store."""
    triton = pytest.importorskip("triton")
    monkeypatch.delenv("TRITON_INTERPRET")
    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "1")  # Triton 3.9 warns when unset (no floats here)
    try:
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
    except ImportError as e:
        pytest.skip(f"this Triton has no ASTSource/GPUTarget: {e}")
    plans = [codegen.plan_tensor(0, (64, 4096), (4096, 1), 0, 2, (4096, 1), True),
             codegen.plan_tensor(1, (3,), (1,), None, 8, (1,), True),
             codegen.plan_tensor(2, (4, 64), (64, 1), 1, 4, None, False)]
    kernel = codegen.load_kernel(codegen.kernel_source(plans), envs.cache_dir(), interpret=False)
    signature = {"d0": "*i16", "s0": "*i16", "n0": "i32", "b0": "i32", "d1": "*i64", "s1": "*i64",
                 "d2": "*i32", "s2": "*i32", "n2": "i32", "b2": "i32", "st2_0": "i64", "st2_1": "i64"}
    aligned = {(i,): [["tt.divisibility", 16]] for i in (0, 1, 4, 5, 6)}
    try:
        compiled = triton.compile(ASTSource(kernel, signature, {}, aligned), target=GPUTarget("cuda", 90, 32),
                                  options={"num_warps": 4})
    except Exception as e:  # no CUDA backend in this Triton build
        if "backend" in str(e).lower() or "ptxas" in str(e).lower():
            pytest.skip(f"cannot compile for CUDA here: {e}")
        raise
    ptx = compiled.asm["ptx"]
    assert "ld.global.v4.b32" in ptx and "st.global.v4.b32" in ptx


# ----------------------------------------------------------------------------------- property
@st.composite
def _cases(draw: Any) -> tuple[list[int], list[int], int, int, list[tuple[int, int]], bool]:
    rank = draw(st.integers(1, 4))
    shape = [draw(st.integers(1, 3)) for _ in range(rank)]
    dim = draw(st.integers(0, rank - 1))
    shape[dim] = draw(st.integers(1, 6))
    order = draw(st.permutations(range(rank)))  # the buffer's memory order
    pairs = []
    for _ in range(draw(st.integers(1, 3))):
        b = draw(st.integers(0, shape[dim]))
        pairs.append((draw(st.integers(0, b)), b))
    return shape, list(order), dim, draw(st.sampled_from([1, 2, 4, 8])), pairs, draw(st.booleans())


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=_cases())
def test_property_matches_torch(interpret: None, case: tuple[Any, ...]) -> None:
    shape, order, dim, itemsize, pairs, transposed_src = case
    dtype = {1: torch.uint8, 2: torch.bfloat16, 4: torch.float32, 8: torch.int64}[itemsize]

    def dsts() -> list[torch.Tensor]:
        physical = filled(torch.empty([shape[d] for d in order], dtype=dtype))
        return [physical.permute([order.index(d) for d in range(len(shape))])]

    calls: list[Call] = []
    for n, b in pairs:
        s = list(shape)
        s[dim] = n
        src = random_bits(s[::-1], dtype).permute(*reversed(range(len(s)))) if transposed_src \
            else random_bits(s, dtype)
        calls.append(([src], [n], [b]))
    compare(dsts, [dim], calls)


# ----------------------------------------------------------------------------------- on a GPU
Tensors = list[torch.Tensor]


def _gpu_case(B: int = 64) -> tuple[Callable[[], Tensors], list[int], Callable[[int], Tensors]]:
    def dsts() -> list[torch.Tensor]:
        return [filled(torch.empty(B, 256, dtype=torch.bfloat16, device="cuda")),
                filled(torch.empty(B, dtype=torch.int64, device="cuda")),
                filled(torch.empty(3, B, device="cuda")),  # token dim 1: its source's stride follows n
                filled(torch.empty(8, B, 16, dtype=torch.float16, device="cuda")).permute(1, 0, 2),
                filled(torch.empty(B, 5, dtype=torch.float8_e4m3fn, device="cuda"))]

    def srcs(n: int) -> list[torch.Tensor]:
        wide = random_bits((n, 3 * 256), torch.bfloat16, "cuda")
        return [wide[:, 256:512], torch.arange(n, device="cuda"), random_bits((3, n), torch.float32, "cuda"),
                random_bits((16, 8, n), torch.float16, "cuda").permute(2, 1, 0),
                random_bits((n * 5 + 1,), torch.float8_e4m3fn, "cuda")[1:].view(n, 5)]

    return dsts, [0, 0, 1, 0, 0], srcs


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_kernel_matches_torch_bit_for_bit() -> None:
    pytest.importorskip("triton")
    dsts, dims, srcs = _gpu_case()
    calls: list[Call] = [(srcs(n), [n] * 5, [b] * 5)
                         for n, b in [(33, 40), (1, 8), (0, 16), (63, 64), (64, 64), (17, 17), (5, 64)]]
    copier = compare(dsts, dims, calls, kernel="auto")
    assert copier.launch_path in ("direct", "dispatch")
    assert copier.compiles <= 3  # the first layouts; the [3, n] source's strides; the unaligned fp8 source
    torch.cuda.synchronize()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_one_launch_per_call() -> None:
    pytest.importorskip("triton")
    dsts, dims, srcs = _gpu_case()
    fused = make_row_copier(dsts(), dims)
    per_op = make_row_copier(dsts(), dims, kernel="torch")
    calls = [(srcs(n), [n] * 5, [64] * 5) for n in (9, 30, 41)]
    for c in calls:  # warm up: compiles, layouts seen
        fused(*c)
    compiles = fused.compiles

    def kernels(copier: RowCopier) -> list[str]:
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for c in calls:
                copier(*c)
            torch.cuda.synchronize()
        return [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]

    names = kernels(fused)
    assert len(names) == len(calls) and all(codegen.KERNEL_NAME in name for name in names), names
    assert fused.compiles == compiles
    assert len(kernels(per_op)) == len(calls) * per_op.launches_per_call == len(calls) * 10


class _BrokenCopier(TorchRowCopier):
    """A copier whose kernel cannot be built: every call raises, as a failed Triton launcher build does."""

    kernel = "triton"

    def __call__(self, srcs: Any, ns: Any, bs: Any) -> None:
        raise RuntimeError("failed to build the launcher: Python.h not found")


def test_a_copier_that_fails_its_first_call_falls_back_to_torch_ops(caplog: pytest.LogCaptureFixture) -> None:
    buf = torch.zeros(8, 4)
    broken = _BrokenCopier(make_row_copier([buf], [0], kernel="torch").buffers)
    chosen = working_or_torch(broken)
    assert isinstance(chosen, TorchRowCopier) and chosen is not broken and chosen.dsts[0] is buf
    assert "failed its first call" in caplog.text and "Python.h" in caplog.text
    src = torch.randn(3, 4)
    chosen([src], [3], [5])
    assert torch.equal(buf[:3], src) and not buf[3:].any()
    working = make_row_copier([buf], [0], kernel="torch")
    assert working_or_torch(working) is working


# ----------------------------------------------------------------------------------- the kernel files
def _unique_source(tag: int) -> str:
    """A kernel source no other test loads (the loaded kernels are kept process-wide, by source)."""
    width = 97 + tag  # baked into the source (the token dim's size is not)
    return codegen.kernel_source([codegen.plan_tensor(0, (5, width), (width, 1), 0, 4, (width, 1), False)])


def test_a_kernel_file_found_with_other_code_is_rewritten_not_run(interpret: None, tmp_path: Any) -> None:
    source = _unique_source(0)
    digest = hashlib.sha256(source.encode()).hexdigest()[:24]
    planted = tmp_path / "fused_copy" / f"{codegen.KERNEL_NAME}_{digest}.py"  # where it would be written
    planted.parent.mkdir(mode=0o700)
    planted.write_text("raise RuntimeError('a planted file ran')\n")
    assert callable(codegen.load_kernel(source, str(tmp_path), interpret=True))
    assert planted.read_text() == source


def test_a_kernel_folder_others_may_write_is_not_used(interpret: None, tmp_path: Any,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    folder = tmp_path / "shared" / "fused_copy"
    folder.mkdir(parents=True)
    folder.chmod(0o777)
    with caplog.at_level("WARNING", logger=codegen.__name__):
        kernel = codegen.load_kernel(_unique_source(2), str(tmp_path / "shared"), interpret=True)
    assert callable(kernel)
    assert list(folder.iterdir()) == []  # nothing written or run there
    assert f"{folder} may be written by other users" in caplog.text
