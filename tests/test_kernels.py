"""Kernel == reference, for outputs and for the mutated slot state; reference == a naive per-row loop.

The Triton kernels run on CPU tensors under the Triton interpreter. The interpreter must be chosen before
Triton decorates any kernel, so it is switched on here, before the kernel modules are imported.
"""

import os

os.environ["TRITON_INTERPRET"] = "1"

import json  # noqa: E402
import math  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from engine.kernels.causal_conv1d_update import (  # noqa: E402
    causal_conv1d_update,
    causal_conv1d_update_ref,
    causal_conv1d_update_triton,
)
from engine.kernels.reset_rows import reset_rows, reset_rows_ref, reset_rows_triton  # noqa: E402
from engine.kernels.selective_state_update import (  # noqa: E402
    selective_state_update,
    selective_state_update_ref,
    selective_state_update_triton,
)
from engine.model.slot_state import live_rows  # noqa: E402
from engine_support import run_compiled  # noqa: E402

# Per-dtype tolerances, |got - want| <= atol + rtol * |want|.
# fp32: both sides compute in fp32 and differ only in summation order.
# bf16 SSM output: both compute in fp32 and round to bf16, so they differ by at most one bf16 ulp (2^-7
# relative) where the fp32 values straddle a rounding boundary.
# bf16 conv output: the reference multiplies and sums in bf16, the kernel in fp32, so a few bf16 ulps.
# Mutated state is fp32 for the SSM (fp32 tolerance in every case) and must be bit-identical for the conv
# (it only moves values).
TOL = {
    "fp32": (1e-5, 1e-5),
    "ssm_bf16_out": (1e-2, 1e-2),
    "conv_bf16_out": (3e-2, 3e-2),
}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _close(name: str, got: torch.Tensor, want: torch.Tensor, tol: tuple[float, float]) -> None:
    """Print the max and mean absolute difference, then assert elementwise closeness."""
    diff = (got.double() - want.double()).abs()
    atol, rtol = tol
    scale = want.double().abs().max().item()
    mean = diff.mean().item()
    print(f"{name}: max abs diff {diff.max().item():.3e}, mean abs diff {mean:.3e}, max |want| {scale:.3e}")
    assert got.shape == want.shape and got.dtype == want.dtype
    bound = atol + rtol * want.double().abs()
    worst = (diff - bound).max().item()
    assert worst <= 0, f"{name}: exceeds atol={atol}, rtol={rtol} by {worst:.3e}"


def _equal(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
    diff = (got.double() - want.double()).abs()
    print(f"{name}: max abs diff {diff.max().item():.3e}, mean abs diff {diff.mean().item():.3e}")
    assert torch.equal(got, want), f"{name}: not bit-identical"


def _slot_indices(gen: torch.Generator, slots: int, real: int, pad: int, use_slot0: bool) -> torch.Tensor:
    """A random batch of `real` distinct slots and `pad` padding rows (-1), shuffled together.

    With `use_slot0`, slot 0 (where a padding row's index clamps to) belongs to a real row; otherwise it is
    not in the batch at all.
    """
    pool = torch.randperm(slots - 1, generator=gen)[: real - int(use_slot0)] + 1
    if use_slot0:
        pool = torch.cat([pool, torch.zeros(1, dtype=torch.long)])
    rows = torch.cat([pool, torch.full((pad,), -1, dtype=torch.long)])
    return rows[torch.randperm(rows.numel(), generator=gen)]


def _untouched(slots: int, idx: torch.Tensor) -> torch.Tensor:
    mask = torch.ones(slots, dtype=torch.bool)
    mask[idx[idx >= 0]] = False
    return mask


# Index patterns: (slots, real rows, padding rows, slot 0 taken by a real row)
INDEX_CASES = {
    "pad-clamps-onto-real-slot": (9, 4, 2, True),
    "pad-slot0-absent": (9, 4, 3, False),
    "no-padding": (6, 6, 0, True),
    "all-padding": (5, 0, 3, False),
}


# ---------------------------------------------------------------- selective state update


def _ssm_inputs(gen: torch.Generator, slots: int, b: int, dtype: torch.dtype, h=4, p=12, n=24, g=2):
    """Random SSM inputs at small, deliberately non-power-of-two sizes (p and n exercise the masks)."""

    def r(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen)

    state = r(slots, h, p, n)
    x = r(b, h, p).to(dtype)
    dt = r(b, h) * 2 - 1
    dt[0::3, 0] = 25.0  # past softplus's threshold: identity
    dt[1::3, -1] = -25.0  # softplus ~ 1e-11: needs an accurate log1p
    dt = dt.to(dtype)
    A = (-torch.rand(h, generator=gen) * 3 - 0.1).to(dtype)
    B = r(b, g, n).to(dtype)
    C = r(b, g, n).to(dtype)
    D = r(h).to(dtype)
    dt_bias = r(h).to(dtype)
    return state, x, dt, A, B, C, D, dt_bias


def _naive_ssm(state, x, dt, A, B, C, D, dt_bias, idx, dt_min, dt_max):
    """The recurrence written out one row and one head at a time, in float64."""
    b, h, p = x.shape
    heads_per_group = h // B.shape[1]
    new_state = state.clone()
    y = torch.zeros(b, h, p, dtype=torch.float64)
    for i in range(b):
        slot = int(idx[i])
        if slot < 0:
            continue
        for k in range(h):
            v = float(dt[i, k]) + float(dt_bias[k])
            v = v if v > 20 else math.log1p(math.exp(v))
            v = min(max(v, dt_min), dt_max)
            grp = k // heads_per_group
            xs = x[i, k].double()
            s = state[slot, k].double() * math.exp(v * float(A[k])) + v * xs[:, None] * B[i, grp].double()
            y[i, k] = s @ C[i, grp].double() + float(D[k]) * xs
            new_state[slot, k] = s.to(state.dtype)
    return y.to(x.dtype), new_state


@pytest.mark.parametrize("clamp", [(0.0, float("inf")), (0.05, 0.6)], ids=["no-clamp", "clamp"])
@pytest.mark.parametrize("case", list(INDEX_CASES))
def test_selective_state_update_reference_matches_naive_loop(case: str, clamp: tuple[float, float]) -> None:
    slots, real, pad, use0 = INDEX_CASES[case]
    gen = torch.Generator().manual_seed(1)
    idx = _slot_indices(gen, slots, real, pad, use0)
    state, *args = _ssm_inputs(gen, slots, idx.numel(), torch.float32)
    want_y, want_state = _naive_ssm(state, *args, idx, *clamp)
    got_state = state.clone()
    got_y = selective_state_update_ref(got_state, *args, idx, *clamp)
    _close("ref vs naive: y", got_y, want_y, TOL["fp32"])
    _close("ref vs naive: state", got_state, want_state, TOL["fp32"])
    assert torch.equal(got_state[_untouched(slots, idx)], state[_untouched(slots, idx)])


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("case", list(INDEX_CASES))
def test_selective_state_update_triton_matches_reference(case: str, dtype: str) -> None:
    slots, real, pad, use0 = INDEX_CASES[case]
    gen = torch.Generator().manual_seed(2)
    idx = _slot_indices(gen, slots, real, pad, use0)
    state, *args = _ssm_inputs(gen, slots, idx.numel(), DTYPES[dtype])
    for dt_min, dt_max in [(0.0, float("inf")), (0.05, 0.6)]:
        ref_state, tri_state = state.clone(), state.clone()
        want = selective_state_update_ref(ref_state, *args, idx, dt_min, dt_max)
        got = selective_state_update_triton(tri_state, *args, idx, dt_min, dt_max)
        _close(f"ssm {dtype} y", got, want, TOL["fp32" if dtype == "fp32" else "ssm_bf16_out"])
        _close(f"ssm {dtype} state", tri_state, ref_state, TOL["fp32"])
        assert torch.all(got[idx < 0] == 0), "padding rows must give zeros"
        untouched = _untouched(slots, idx)
        assert torch.equal(tri_state[untouched], state[untouched]), "a slot outside the batch changed"


def test_selective_state_update_triton_on_strided_state_and_int32_indices() -> None:
    """State as a view into a larger per-layer buffer (non-contiguous slot stride), indices as int32."""
    gen = torch.Generator().manual_seed(3)
    idx = _slot_indices(gen, 7, 3, 2, True)
    state, *args = _ssm_inputs(gen, 7, idx.numel(), torch.float32)
    buffer = torch.randn(7, 2, *state.shape[1:], generator=gen)
    buffer[:, 1] = state
    view = buffer[:, 1]
    before = buffer.clone()
    ref_state = state.clone()
    want = selective_state_update_ref(ref_state, *args, idx)
    got = selective_state_update_triton(view, *args, idx.to(torch.int32))
    _close("ssm strided y", got, want, TOL["fp32"])
    _close("ssm strided state", view, ref_state, TOL["fp32"])
    assert torch.equal(buffer[:, 0], before[:, 0]), "the other layer's state changed"


# ---------------------------------------------------------------- causal conv1d update


def _conv_inputs(gen: torch.Generator, slots: int, b: int, dtype: torch.dtype, d: int, width: int):
    def r(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen)

    conv_state = r(slots, d, width - 1).to(dtype)
    x = r(b, d).to(dtype)
    weight = (r(d, width) / math.sqrt(width)).to(dtype)
    bias = r(d).to(dtype)
    return x, conv_state, weight, bias


def _naive_conv(x, conv_state, weight, bias, idx, silu):
    """One row at a time, the window written out explicitly, in float64 on the state-dtype window."""
    b, d = x.shape
    new_state = conv_state.clone()
    out = torch.zeros(b, d, dtype=torch.float64)
    for i in range(b):
        slot = int(idx[i])
        if slot < 0:
            continue
        window = list(conv_state[slot].unbind(-1)) + [x[i].to(conv_state.dtype)]
        acc = sum(col.double() * weight[:, j].double() for j, col in enumerate(window))
        if bias is not None:
            acc = acc + bias.double()
        out[i] = acc * torch.sigmoid(acc) if silu else acc
        new_state[slot] = torch.stack(window[1:], dim=-1)
    return out.to(x.dtype), new_state


CONV_SHAPES = {"d40-w4": (40, 4), "d300-w4": (300, 4), "d40-w2": (40, 2)}


@pytest.mark.parametrize("silu", [True, False], ids=["silu", "linear"])
@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize("shape", list(CONV_SHAPES))
@pytest.mark.parametrize("case", ["pad-clamps-onto-real-slot", "pad-slot0-absent"])
def test_causal_conv1d_update_reference_matches_naive_loop(
    case: str, shape: str, with_bias: bool, silu: bool
) -> None:
    slots, real, pad, use0 = INDEX_CASES[case]
    gen = torch.Generator().manual_seed(4)
    idx = _slot_indices(gen, slots, real, pad, use0)
    x, conv_state, weight, bias = _conv_inputs(gen, slots, idx.numel(), torch.float32, *CONV_SHAPES[shape])
    bias = bias if with_bias else None
    want_out, want_state = _naive_conv(x, conv_state, weight, bias, idx, silu)
    got_state = conv_state.clone()
    got = causal_conv1d_update_ref(x, got_state, weight, bias, idx, silu)
    _close("ref vs naive: out", got, want_out, TOL["fp32"])
    _equal("ref vs naive: state", got_state, want_state)


@pytest.mark.parametrize("silu", [True, False], ids=["silu", "linear"])
@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize("shape", list(CONV_SHAPES))
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_causal_conv1d_update_triton_matches_reference(
    dtype: str, shape: str, with_bias: bool, silu: bool
) -> None:
    gen = torch.Generator().manual_seed(5)
    for case in INDEX_CASES:
        slots, real, pad, use0 = INDEX_CASES[case]
        idx = _slot_indices(gen, slots, real, pad, use0)
        x, conv_state, weight, bias = _conv_inputs(
            gen, slots, idx.numel(), DTYPES[dtype], *CONV_SHAPES[shape]
        )
        bias = bias if with_bias else None
        ref_state, tri_state = conv_state.clone(), conv_state.clone()
        want = causal_conv1d_update_ref(x, ref_state, weight, bias, idx, silu)
        got = causal_conv1d_update_triton(x, tri_state, weight, bias, idx, silu)
        _close(f"conv {dtype} {case} out", got, want, TOL["fp32" if dtype == "fp32" else "conv_bf16_out"])
        _equal(f"conv {dtype} {case} state", tri_state, ref_state)
        assert torch.all(got[idx < 0] == 0), "padding rows must give zeros"
        untouched = _untouched(slots, idx)
        assert torch.equal(tri_state[untouched], conv_state[untouched]), "a slot outside the batch changed"
        if dtype == "bf16":
            # The kernel accumulates in fp32: within one bf16 rounding of the float64 result.
            exact, _ = _naive_conv(x, conv_state, weight, bias, idx, silu)
            _close(f"conv bf16 {case} out vs float64", got, exact, (1e-2, 2**-7))


def test_causal_conv1d_update_triton_on_strided_state_and_int32_indices() -> None:
    gen = torch.Generator().manual_seed(6)
    idx = _slot_indices(gen, 6, 4, 1, True)
    x, conv_state, weight, bias = _conv_inputs(gen, 6, idx.numel(), torch.float32, 40, 4)
    view = conv_state.transpose(1, 2).contiguous().transpose(1, 2)  # channels not innermost
    ref_state = conv_state.clone()
    want = causal_conv1d_update_ref(x, ref_state, weight, bias, idx)
    got = causal_conv1d_update_triton(x, view, weight, bias, idx.to(torch.int32))
    _close("conv strided out", got, want, TOL["fp32"])
    _equal("conv strided state", view, ref_state)


def test_successive_steps_roll_the_window() -> None:
    """Four single steps through the kernel leave the last three inputs in the slot, oldest first."""
    idx = torch.tensor([2, -1])
    conv_state = torch.zeros(3, 5, 3)
    weight = torch.ones(5, 4)
    inputs = [torch.full((2, 5), float(k + 1)) for k in range(4)]
    outs = [causal_conv1d_update_triton(x, conv_state, weight, None, idx, silu=False) for x in inputs]
    assert torch.equal(conv_state[2], torch.tensor([2.0, 3.0, 4.0]).expand(5, 3))
    assert torch.equal(conv_state[:2], torch.zeros(2, 5, 3))
    assert [o[0, 0].item() for o in outs] == [1.0, 3.0, 6.0, 10.0]
    assert all(torch.equal(o[1], torch.zeros(5)) for o in outs)


# ---------------------------------------------------------------- the live batch (row i on slot i)

# Active rows of successive live ticks over a batch of six: mixed, all live, none live, mixed again.
LIVE_TICKS = [
    [True, False, True, True, False, True],
    [True] * 6,
    [False] * 6,
    [False, True, False, True, True, False],
]


def _live_untouched(active: torch.Tensor, rows: int) -> torch.Tensor:
    """The state rows a live step must leave bit-identical: rows outside the exec mask and every row past the
    batch (the thinker's scratch row)."""
    return torch.cat([~active, torch.ones(rows - active.numel(), dtype=torch.bool)])


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_selective_state_update_triton_matches_reference_on_the_live_batch(dtype: str) -> None:
    """The live step's SSM (its exec mask as indices, `live_rows`) through the Triton kernel (interpreted),
    tick after tick on its own state: outputs and state equal the reference's, rows outside the mask give
    zeros, those rows and the scratch row stay put."""
    gen = torch.Generator().manual_seed(13)
    b = len(LIVE_TICKS[0])
    state, *_ = _ssm_inputs(gen, b + 1, b, DTYPES[dtype])
    ref_state, tri_state = state.clone(), state.clone()
    for tick, (live, clamp) in enumerate(zip(LIVE_TICKS, [(0.0, float("inf")), (0.05, 0.6)] * 2)):
        active = torch.tensor(live)
        _, *args = _ssm_inputs(gen, 1, b, DTYPES[dtype])
        before, ref_before = tri_state.clone(), ref_state.clone()
        want = selective_state_update_ref(ref_state, *args, live_rows(active), *clamp)
        got = selective_state_update_triton(tri_state, *args, live_rows(active), *clamp)
        _close(
            f"live ssm {dtype} tick {tick} y", got, want, TOL["fp32" if dtype == "fp32" else "ssm_bf16_out"]
        )
        _close(f"live ssm {dtype} tick {tick} state", tri_state, ref_state, TOL["fp32"])
        assert torch.all(got[~active] == 0), "rows outside the mask must give zeros"
        untouched = _live_untouched(active, state.shape[0])
        assert torch.equal(tri_state[untouched], before[untouched]), "a masked-off or scratch row changed"
        assert torch.equal(ref_state[untouched], ref_before[untouched]), "the reference changed such a row"
        # every active row's state moved (the kernel did run for it)
        assert all(not torch.equal(tri_state[i], before[i]) for i in torch.nonzero(active).flatten())


@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize("shape", ["d40-w4", "d40-w2"])
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_causal_conv1d_update_triton_matches_reference_on_the_live_batch(
    dtype: str, shape: str, with_bias: bool
) -> None:
    """The live step's conv through the Triton kernel (interpreted), tick after tick on its own state: outputs
    equal the reference's, the windows are bit-identical, masked-off and scratch rows stay put."""
    gen = torch.Generator().manual_seed(14)
    b = len(LIVE_TICKS[0])
    _, conv_state, weight, bias = _conv_inputs(gen, b + 1, b, DTYPES[dtype], *CONV_SHAPES[shape])
    bias = bias if with_bias else None
    ref_state, tri_state = conv_state.clone(), conv_state.clone()
    for tick, (live, silu) in enumerate(zip(LIVE_TICKS, [True, False] * 2)):
        active = torch.tensor(live)
        x = torch.randn(b, CONV_SHAPES[shape][0], generator=gen).to(DTYPES[dtype])
        before = tri_state.clone()
        want = causal_conv1d_update_ref(x, ref_state, weight, bias, live_rows(active), silu)
        got = causal_conv1d_update_triton(x, tri_state, weight, bias, live_rows(active), silu)
        _close(
            f"live conv {dtype} tick {tick} out",
            got,
            want,
            TOL["fp32" if dtype == "fp32" else "conv_bf16_out"],
        )
        _equal(f"live conv {dtype} tick {tick} state", tri_state, ref_state)
        assert torch.all(got[~active] == 0), "rows outside the mask must give zeros"
        untouched = _live_untouched(active, conv_state.shape[0])
        assert torch.equal(tri_state[untouched], before[untouched]), "a masked-off or scratch row changed"
        # an active row's window moved left by one and took this tick's input as its newest column
        rows = torch.nonzero(active).flatten()
        assert torch.equal(tri_state[rows, :, :-1], before[rows, :, 1:])
        assert torch.equal(tri_state[rows, :, -1], x[rows].to(tri_state.dtype))


def test_padding_on_a_scratch_row_writes_the_real_slots_as_padding_by_minus_one():
    """The thinker's slot-index form sends padding rows to its scratch row (a repeated index) instead of -1:
    the real rows' outputs and every real slot's state are the same either way."""
    g = torch.Generator().manual_seed(12)
    S, b = 6, 4
    general = torch.tensor([3, -1, 0, -1])
    scratch = torch.where(general >= 0, general, S - 1)  # row S-1 is the scratch row
    real = general >= 0
    state, *args = _ssm_inputs(g, S, b, torch.float32)
    s1, s2 = state.clone(), state.clone()
    y1 = selective_state_update_ref(s1, *args, general)
    y2 = selective_state_update_ref(s2, *args, scratch)
    assert torch.equal(y1[real], y2[real])
    assert torch.equal(s1[: S - 1], s2[: S - 1]) and not torch.equal(s1[general[real]], state[general[real]])
    x, conv, w, _ = _conv_inputs(g, S, b, torch.float32, 7, 4)
    c1, c2 = conv.clone(), conv.clone()
    o1 = causal_conv1d_update_ref(x, c1, w, None, general)
    o2 = causal_conv1d_update_ref(x, c2, w, None, scratch)
    assert torch.equal(o1[real], o2[real]) and torch.equal(c1[: S - 1], c2[: S - 1])


# ---------------------------------------------------------------- resetting slots' rows


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("head", [True, False], ids=["warm-up head", "zeros"])
def test_reset_rows_triton_matches_reference_and_touches_the_masked_slots_alone(
    dtype: str, head: bool
) -> None:
    """Rings [S, A, R, D] (R not a multiple of the kernel's block, rows past one block), slot rows in a larger
    buffer (a slot stride beyond the row): the masked slots become the fresh row, a template in their first
    entries and zeros after, bit for bit as the reference makes them; every other element is untouched."""
    gen = torch.Generator().manual_seed(15)
    S, A, R, D, H = 5, 3, 700, 8, 37
    buffer = torch.randn(S, 2, A, R, D, generator=gen).to(DTYPES[dtype])
    template = torch.randn(A, H, D, generator=gen).to(DTYPES[dtype]) if head else None
    mask = torch.tensor([False, True, False, True, True])
    want = buffer.clone()
    reset_rows_ref(want[:, 0], mask, template)
    got = buffer.clone()
    reset_rows_triton(got[:, 0], mask, template)  # rows contiguous, slot stride 2 rows
    _equal(f"reset rows {dtype} head={head}", got, want)
    assert torch.equal(got[~mask], buffer[~mask]) and torch.equal(got[:, 1], buffer[:, 1])
    fresh = torch.zeros(A, R, D, dtype=DTYPES[dtype])
    if head:
        fresh[:, :H] = template
    assert all(torch.equal(got[i, 0], fresh) for i in torch.nonzero(mask).flatten())


def test_reset_rows_zeroes_any_slot_first_buffer_and_no_mask_changes_nothing() -> None:
    """Without a template the row is flat: an int64 counter and a 3-d state; an all-false mask is a no-op."""
    counters = torch.arange(12).view(4, 3)
    conv = torch.randn(4, 6, 3)
    for fn in (reset_rows_ref, reset_rows_triton, reset_rows):
        c, v = counters.clone(), conv.clone()
        fn(c, torch.tensor([True, False, False, True]))
        fn(v, torch.zeros(4, dtype=torch.bool))
        assert torch.equal(c, torch.tensor([[0, 0, 0], [3, 4, 5], [6, 7, 8], [0, 0, 0]])), fn.__name__
        assert torch.equal(v, conv), fn.__name__


# ---------------------------------------------------------------- dispatch


def test_dispatchers_on_cpu_compute_the_step() -> None:
    """Off CUDA the two dispatchers must still compute the step, for a gathered batch and for the live one:
    outputs and mutated state against the float64 per-row loops, padding or masked-off rows zero, other slots
    bit-identical."""
    gen = torch.Generator().manual_seed(7)
    active = torch.tensor(LIVE_TICKS[0])
    for name, slots, idx in [
        ("indexed", 9, _slot_indices(gen, 9, 4, 2, True)),
        ("live", active.numel() + 1, live_rows(active)),
    ]:
        untouched = _untouched(slots, idx)
        state, *args = _ssm_inputs(gen, slots, idx.numel(), torch.float32)
        want_y, want_state = _naive_ssm(state, *args, idx, 0.0, float("inf"))
        got_state = state.clone()
        got_y = selective_state_update(got_state, *args, idx)
        _close(f"{name} ssm dispatch y", got_y, want_y, TOL["fp32"])
        _close(f"{name} ssm dispatch state", got_state, want_state, TOL["fp32"])
        assert torch.all(got_y[idx < 0] == 0)
        assert torch.equal(got_state[untouched], state[untouched])

        x, conv_state, weight, bias = _conv_inputs(gen, slots, idx.numel(), torch.float32, 40, 4)
        want_out, want_state = _naive_conv(x, conv_state, weight, bias, idx, True)
        got_state = conv_state.clone()
        got_out = causal_conv1d_update(x, got_state, weight, bias, idx)
        _close(f"{name} conv dispatch out", got_out, want_out, TOL["fp32"])
        _equal(f"{name} conv dispatch state", got_state, want_state)
        assert torch.all(got_out[idx < 0] == 0)
        assert torch.equal(got_state[untouched], conv_state[untouched])


def test_kernel_modules_import_and_fall_back_without_triton() -> None:
    """With Triton unimportable, both modules import and the dispatchers run the references."""
    script = """
import sys
sys.modules["triton"] = None
import torch
from engine.kernels.selective_state_update import selective_state_update, selective_state_update_ref
from engine.kernels.causal_conv1d_update import causal_conv1d_update, causal_conv1d_update_ref
idx = torch.tensor([1, -1])
s1, s2 = torch.randn(3, 2, 4, 8), None
s2 = s1.clone()
args = (torch.randn(2, 2, 4), torch.randn(2, 2), -torch.rand(2), torch.randn(2, 1, 8), torch.randn(2, 1, 8),
        torch.randn(2), torch.randn(2))
assert torch.equal(selective_state_update(s1, *args, idx), selective_state_update_ref(s2, *args, idx))
c1 = torch.randn(3, 6, 3); c2 = c1.clone(); x = torch.randn(2, 6); w = torch.randn(6, 4)
assert torch.equal(causal_conv1d_update(x, c1, w, None, idx), causal_conv1d_update_ref(x, c2, w, None, idx))
print("ok")
"""
    assert run_compiled(script).strip() == "ok"


# ---------------------------------------------------------------- CUDA, real model sizes

# Runs in a fresh interpreter without TRITON_INTERPRET so the kernels are compiled for the device.
CUDA_CHECK = """
import json, torch
from engine.kernels.selective_state_update import selective_state_update, selective_state_update_ref
from engine.kernels.causal_conv1d_update import causal_conv1d_update, causal_conv1d_update_ref
from engine.kernels.reset_rows import reset_rows, reset_rows_ref
from engine.model.slot_state import live_rows

dev = "cuda"
g = torch.Generator(device=dev).manual_seed(0)
S, rows = 64, 64
idx = torch.randperm(S, generator=g, device=dev)
idx[torch.tensor([5, 17, 40], device=dev)] = -1  # padding rows; slot 0 is still in the batch
untouched = torch.ones(S, dtype=torch.bool, device=dev)
untouched[idx[idx >= 0]] = False
# The live batch: row i is slot i, three rows inactive, one scratch row past the batch.
active = torch.ones(S, dtype=torch.bool, device=dev)
active[torch.tensor([3, 17, 40], device=dev)] = False
live = live_rows(active)
live_untouched = torch.cat([~active, torch.ones(1, dtype=torch.bool, device=dev)])


def r(*shape):
    return torch.randn(*shape, generator=g, device=dev)


# (atol, rtol) for the output and, for the SSM, the fp32 state. On the GPU exp/log are hardware
# approximations and multiply-adds fuse, hence looser fp32 bounds than in the interpreter.
TOL = {
    "ssm_fp32": ((1e-3, 1e-4), (1e-4, 1e-4)),
    "ssm_bf16": ((1e-2, 2**-7), (1e-4, 1e-4)),
    "conv_fp32": ((1e-5, 1e-5), None),
    "conv_bf16": ((3e-2, 3e-2), None),
}


def diffs(prefix, got, want, tol):
    d = (got.double() - want.double()).abs()
    excess = (d - tol[0] - tol[1] * want.double().abs()).max().item()
    return {f"{prefix}_max": d.max().item(), f"{prefix}_mean": d.mean().item(), f"{prefix}_excess": excess}


result = {}
for name, dtype in [("fp32", torch.float32), ("bf16", torch.bfloat16)]:
    h, p, n, grp = 128, 80, 128, 8
    state = r(S, h, p, n)
    A = -torch.rand(h, generator=g, device=dev) * 8
    args = [r(rows, h, p), r(rows, h) - 2, A, r(rows, grp, n), r(rows, grp, n), r(h), r(h)]
    args = [t.to(dtype) for t in args]
    a, b = state.clone(), state.clone()
    want = selective_state_update_ref(a, *args, idx, 0.0, 100.0)
    got = selective_state_update(b, *args, idx, 0.0, 100.0)
    result[f"ssm_{name}"] = dict(
        **diffs("y", got, want, TOL[f"ssm_{name}"][0]),
        **diffs("state", b, a, TOL[f"ssm_{name}"][1]),
        pad_zero=bool((got[idx < 0] == 0).all()),
        untouched=bool(torch.equal(b[untouched], state[untouched])),
    )
    live_state = r(S + 1, h, p, n)
    a, b = live_state.clone(), live_state.clone()
    want = selective_state_update_ref(a, *args, live, 0.0, 100.0)
    got = selective_state_update(b, *args, live, 0.0, 100.0)
    result[f"ssm_live_{name}"] = dict(
        **diffs("y", got, want, TOL[f"ssm_{name}"][0]),
        **diffs("state", b, a, TOL[f"ssm_{name}"][1]),
        pad_zero=bool((got[~active] == 0).all()),
        untouched=bool(torch.equal(b[live_untouched], live_state[live_untouched])),
    )
    d, w = 12288, 4
    conv_state = r(S, d, w - 1).to(dtype)
    x, weight, bias = r(rows, d).to(dtype), (r(d, w) / 2).to(dtype), r(d).to(dtype)
    a, b = conv_state.clone(), conv_state.clone()
    want = causal_conv1d_update_ref(x, a, weight, bias, idx, True)
    got = causal_conv1d_update(x, b, weight, bias, idx, True)
    result[f"conv_{name}"] = dict(
        **diffs("y", got, want, TOL[f"conv_{name}"][0]),
        state_equal=bool(torch.equal(a, b)),
        pad_zero=bool((got[idx < 0] == 0).all()),
        untouched=bool(torch.equal(b[untouched], conv_state[untouched])),
    )
    live_conv = r(S + 1, d, w - 1).to(dtype)
    a, b = live_conv.clone(), live_conv.clone()
    want = causal_conv1d_update_ref(x, a, weight, bias, live, True)
    got = causal_conv1d_update(x, b, weight, bias, live, True)
    result[f"conv_live_{name}"] = dict(
        **diffs("y", got, want, TOL[f"conv_{name}"][0]),
        state_equal=bool(torch.equal(a, b)),
        pad_zero=bool((got[~active] == 0).all()),
        untouched=bool(torch.equal(b[live_untouched], live_conv[live_untouched])),
    )
    ring, warm = r(S, 4, 7500, 128).to(dtype), r(4, 37, 128).to(dtype)  # a talker ring, its warm-up
    a, b = ring.clone(), ring.clone()
    reset_rows_ref(a, ~active, warm)
    reset_rows(b, ~active, warm)
    result[f"reset_{name}"] = dict(
        y_excess=0.0,
        state_equal=bool(torch.equal(a, b)),
        pad_zero=bool((b[~active][:, :, 37:] == 0).all()),
        untouched=bool(torch.equal(b[active], ring[active])),
    )
print(json.dumps(result))
"""


@pytest.mark.gpu
def test_triton_matches_reference_on_cuda_at_model_sizes() -> None:
    """Compiled kernels at model sizes: 128 heads x 80, d_state 128, 8 groups; conv 12288 x 4; 64 rows;
    a gathered batch and the live one (its exec mask as indices); resetting slots' rows of a talker ring."""
    result = json.loads(run_compiled(CUDA_CHECK).strip().splitlines()[-1])
    for name, r in result.items():
        print(name, r)
        assert r["pad_zero"] and r["untouched"], name
        assert r["y_excess"] <= 0, name
        assert r.get("state_excess", 0) <= 0 and r.get("state_equal", True), name
