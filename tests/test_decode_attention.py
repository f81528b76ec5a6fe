"""Decode attention: the Triton kernel (interpreted on CPU) == the masked reference, it reads nothing past a
row's length, and the talker's step gives the same hidden states, caches and codes through either.

The interpreter must be chosen before Triton decorates any kernel, so it is switched on before the kernel
module is imported.
"""

import os

os.environ["TRITON_INTERPRET"] = "1"

import json  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

import engine.model.talker as talker_module  # noqa: E402
import engine.model.talker_backbone as talker_backbone_module  # noqa: E402
import engine.model.thinker as thinker_module  # noqa: E402
import engine.model.thinker_attention as thinker_attention_module  # noqa: E402
from engine.config.presets import load_preset  # noqa: E402
from engine.kernels.decode_attention import (  # noqa: E402
    decode_attention,
    decode_attention_ref,
    decode_attention_triton,
)
from engine_support import run_compiled  # noqa: E402
from fixture_weights import stage_weights  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
FIXTURES = REPO / "tests" / "fixtures" / "talker"
TOKENIZER = str(REPO / "engine" / "config" / "assets" / "tiny_tokenizer.json")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}

# |got - want| <= atol + rtol * |want|, per comparison.
# kernel vs reference, fp32: both compute in fp32 and differ in summation order only.
# kernel vs reference, bf16: the reference rounds every score and probability to bf16 (a score of ~3 moves by
#   up to 0.012, its probability by ~1%); the kernel keeps them fp32. Measured max 7.8e-3 on these inputs.
# kernel vs float64 maths on the same (cache-dtype) inputs: fp32 up to summation order; bf16 the single
#   rounding of the output, under one bf16 ulp (2^-7 relative): the interpreter casts fp32 to bf16 by
#   truncation (a GPU rounds to nearest, half an ulp).
TOL = {
    "ref_fp32": (1e-5, 1e-5),
    "ref_bf16": (2e-2, 2e-2),
    "exact_fp32": (1e-5, 1e-5),
    "exact_bf16": (1e-5, 2**-7),
}


def _close(name: str, got: torch.Tensor, want: torch.Tensor, tol: tuple[float, float]) -> None:
    """Print the max and mean absolute difference, then assert elementwise closeness."""
    diff = (got.double() - want.double()).abs()
    atol, rtol = tol
    print(f"{name}: max abs diff {diff.max().item():.3e}, mean abs diff {diff.mean().item():.3e}")
    assert got.shape == want.shape
    worst = (diff - atol - rtol * want.double().abs()).max().item()
    assert worst <= 0, f"{name}: exceeds atol={atol}, rtol={rtol} by {worst:.3e}"


def _inputs(gen: torch.Generator, dtype: torch.dtype, g: int, ring: int, lengths: list[int], hk=2, d=24):
    """Random q and caches; d = 24 is not a power of two (exercises the head-dim mask)."""
    r = len(lengths)
    q = torch.randn(r, hk, g, d, generator=gen).to(dtype)
    k = (torch.randn(r, hk, ring, d, generator=gen) * 1.5).to(dtype)
    v = torch.randn(r, hk, ring, d, generator=gen).to(dtype)
    return q, k, v, torch.tensor(lengths)


def _exact(q, k, v, lengths, scale):
    """The same attention in float64 over each row's first `length` entries, on the cache-dtype values."""
    out = torch.empty(q.shape, dtype=torch.float64)
    for i, n in enumerate(lengths.tolist()):
        qi, ki, vi = q[i].to(k.dtype).double(), k[i, :, :n].double(), v[i, :, :n].double()
        out[i] = torch.softmax(qi @ ki.transpose(1, 2) * scale, dim=-1) @ vi
    return out


# Ring 100 is no multiple of any block (64 for g = 1, 32 for g = 2, 16 for g = 4); the lengths are 1, the
# full ring, and values on either side of block and split edges.
RING = 100
LENGTHS = [1, RING, 37, 64, 65, 99]


@pytest.mark.parametrize("splits", [1, 3], ids=["one-pass", "split-3"])
@pytest.mark.parametrize("g", [1, 2, 4])
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_kernel_matches_reference_over_ragged_lengths(dtype: str, g: int, splits: int) -> None:
    gen = torch.Generator().manual_seed(100 * g + splits)
    q, k, v, lengths = _inputs(gen, DTYPES[dtype], g, RING, LENGTHS)
    scale = q.shape[-1] ** -0.5
    got = decode_attention_triton(q, k, v, lengths, scale, splits=splits)
    want = decode_attention_ref(q, k, v, lengths, scale)
    assert got.dtype == want.dtype == DTYPES[dtype]
    _close(f"{dtype} g={g} splits={splits} vs reference", got, want, TOL[f"ref_{dtype}"])
    _close(
        f"{dtype} g={g} splits={splits} vs float64",
        got,
        _exact(q, k, v, lengths, scale),
        TOL[f"exact_{dtype}"],
    )
    # one entry: the softmax is exactly 1, so both give that entry's value, bit for bit
    assert torch.equal(got[0], v[0, :, :1].expand(-1, g, -1))
    assert torch.equal(got[0], want[0])


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_kernel_reads_nothing_past_a_rows_length(dtype: str) -> None:
    """Entries past each row's length set to NaN and inf: the output is bit-identical and finite (the
    reference, which reads the whole ring, would give NaN)."""
    gen = torch.Generator().manual_seed(7)
    q, k, v, lengths = _inputs(gen, DTYPES[dtype], 2, RING, LENGTHS)
    scale = q.shape[-1] ** -0.5
    past = torch.arange(RING)[None, None, :, None] >= lengths[:, None, None, None]
    k_bad = torch.where(past, float("nan"), k)
    v_bad = torch.where(past, float("inf"), v)
    for splits in (1, 3):
        clean = decode_attention_triton(q, k, v, lengths, scale, splits=splits)
        got = decode_attention_triton(q, k_bad, v_bad, lengths, scale, splits=splits)
        assert torch.isfinite(got).all(), f"splits={splits}: an entry past a length was read"
        assert torch.equal(got, clean), f"splits={splits}"
    assert torch.isnan(decode_attention_ref(q, k_bad, v_bad, lengths, scale)[1:]).any()


def test_kernel_takes_strided_inputs_and_the_device_default_split() -> None:
    """A transposed-view query (the talker's `.view` of a projection) and caches sliced from wider rings."""
    gen = torch.Generator().manual_seed(8)
    r, hk, g, d, ring = 3, 2, 2, 16, 40
    q = torch.randn(r, g, hk, d, generator=gen).transpose(1, 2)
    k = torch.randn(r, hk, ring + 5, d, generator=gen)[:, :, :ring]
    v = torch.randn(r, hk, ring + 5, d, generator=gen)[:, :, 5:]
    lengths = torch.tensor([40, 1, 17], dtype=torch.int32)
    got = decode_attention_triton(q, k, v, lengths, 0.3)
    _close("strided", got, decode_attention_ref(q, k, v, lengths.long(), 0.3), TOL["ref_fp32"])


@pytest.mark.parametrize("splits", [1, 3], ids=["one-pass", "split-3"])
def test_kernel_reads_cache_rows_through_a_row_index(splits: int) -> None:
    """A gathered batch (the thinker's slack steps): query row i reads cache row rows[i] of a larger cache,
    rows repeated and out of order, with no gathered copy. Equals the kernel and the reference on the
    gathered caches; the other cache rows are NaN, so a read of the wrong row would show."""
    gen = torch.Generator().manual_seed(9)
    q, k, v, lengths = _inputs(gen, torch.float32, 2, RING, LENGTHS)
    rows = torch.tensor([4, 0, 6, 2, 6, 1])
    k[4], v[4], lengths[4] = k[2], v[2], lengths[2]  # cache row 6 read twice: the same data both times
    big_k = torch.full((8, *k.shape[1:]), float("nan"))
    big_v = torch.full((8, *v.shape[1:]), float("nan"))
    big_k[rows], big_v[rows] = k, v
    scale = q.shape[-1] ** -0.5
    got = decode_attention_triton(q, big_k, big_v, lengths, scale, splits=splits, rows=rows)
    assert torch.equal(got, decode_attention_triton(q, k, v, lengths, scale, splits=splits))
    _close("rows", got, decode_attention_ref(q, big_k, big_v, lengths, scale, rows), TOL["ref_fp32"])
    with pytest.raises(ValueError, match="rows must be int64"):
        decode_attention_triton(q, big_k, big_v, lengths, scale, rows=rows.int())


def test_dispatch_on_cpu_is_the_reference() -> None:
    gen = torch.Generator().manual_seed(9)
    q, k, v, lengths = _inputs(gen, torch.float32, 2, RING, LENGTHS)
    assert torch.equal(decode_attention(q, k, v, lengths, 0.2), decode_attention_ref(q, k, v, lengths, 0.2))


def test_module_imports_and_falls_back_without_triton() -> None:
    script = """
import sys
sys.modules["triton"] = None
import torch
from engine.kernels.decode_attention import decode_attention, decode_attention_ref
q, k, v = torch.randn(2, 1, 2, 8), torch.randn(2, 1, 10, 8), torch.randn(2, 1, 10, 8)
n = torch.tensor([3, 10])
assert torch.equal(decode_attention(q, k, v, n, 0.5), decode_attention_ref(q, k, v, n, 0.5))
print("ok")
"""
    assert run_compiled(script).strip() == "ok"


# ---------------------------------------------------------------- the talker through the kernel

TINY = load_preset("tiny").talker.model_copy(update={"gumbel": False, "noise_scale": 0.0})


@pytest.fixture(scope="module")
def release() -> dict[str, torch.Tensor]:
    return stage_weights("talker")


def _talker(release, kv_dtype: torch.dtype) -> talker_module.Talker:
    talker = talker_module.Talker(TINY, TOKENIZER, 4, torch.float32, kv_dtype)
    talker_module.load_release_weights(talker, release)
    return talker


@pytest.mark.parametrize("kv", list(DTYPES))
def test_talker_backbone_through_the_kernel_matches_the_masked_reference(release, kv, monkeypatch) -> None:
    """Random rings, positions giving lengths from the warm-up to both full rings (256 sliding, 512 global),
    ragged activity: the backbone's hidden states and every KV ring and position, ref path vs kernel path."""
    gen = torch.Generator().manual_seed(10)
    ref, tri = _talker(release, DTYPES[kv]), _talker(release, DTYPES[kv])
    with torch.inference_mode():
        for i in range(len(ref.backbone.rings)):
            for cache, theirs in zip(ref.backbone.caches(i), tri.backbone.caches(i), strict=True):
                cache.copy_(torch.randn(cache.shape, generator=gen))
                theirs.copy_(cache)
        pos = torch.tensor([37, 200, 254, 700])  # one stream per slot
    actives = [[True, True, True, True], [True, False, True, True], [False, True, True, False]]
    for frame, live in enumerate(actives):
        x = torch.randn(4, TINY.hidden_size, generator=gen)
        active = torch.tensor(live)
        with torch.inference_mode():
            want = ref.backbone.step(x, pos, active)
            monkeypatch.setattr(talker_backbone_module, "decode_attention", decode_attention_triton)
            got = tri.backbone.step(x, pos, active)
            monkeypatch.undo()
        pos = pos + active.long()
        tol = TOL[f"ref_{kv}"] if kv == "fp32" else (5e-2, 5e-2)  # hidden states after two bf16-KV layers
        _close(f"talker kv {kv} frame {frame} hidden", got, want, tol)
    theirs = tri.slot_state()
    for name, buf in ref.slot_state().items():
        if name in ("backbone.k_cache0", "backbone.v_cache0"):  # layer 0's ring is written before attention
            assert torch.equal(theirs[name], buf), name
        elif name.startswith("backbone."):
            _close(f"talker kv {kv} {name}", theirs[name], buf, TOL[f"ref_{kv}"])


def test_talker_codes_through_the_kernel_equal_nemo(release, monkeypatch) -> None:
    """The first frames of the NeMo parity case (deterministic sampling) with attention through the kernel:
    codes identical to NeMo's, as the reference path's are (tests/test_talker.py)."""
    cases = load_file(str(FIXTURES / "cases.safetensors"))
    frames = 6
    talker = talker_module.Talker(TINY, TOKENIZER, 3)
    talker_module.load_release_weights(talker, release)
    monkeypatch.setattr(talker_backbone_module, "decode_attention", decode_attention_triton)
    active = torch.ones(3, dtype=torch.bool)
    codes = torch.stack([talker.step(cases["text"][:, f].contiguous(), active) for f in range(frames)], 1)
    same = (codes == cases["codes"][:, :frames]).float().mean().item()
    print(f"codes identical to NeMo over {frames} frames: {same:.3f}")
    assert torch.equal(codes, cases["codes"][:, :frames])


@pytest.mark.parametrize("kv", list(DTYPES))
def test_thinker_steps_through_the_kernel_match_the_masked_reference(kv, monkeypatch) -> None:
    """The thinker's attention layers through the kernel: a small thinker (window 48) with rings filled to
    ragged depths (a fresh row, partly filled rows, a wrapped one), the live batch (an exec mask) and a
    gathered slack batch with a padding row: logits and every KV ring, kernel path vs reference path."""
    cfg = load_preset("tiny").thinker.model_copy(update={"attention_window": 48})
    gen = torch.Generator().manual_seed(12)
    ref = thinker_module.Thinker(cfg, 4, pad_id=0, kv_dtype=DTYPES[kv])
    ref.init_dummy(3)
    tri = thinker_module.Thinker(cfg, 4, pad_id=0, kv_dtype=DTYPES[kv])
    tri.load_state_dict(ref.state_dict())
    with torch.inference_mode():
        for t in ref.slot_state().values():
            if t.is_floating_point():
                t.copy_(torch.randn(t.shape, generator=gen).to(t.dtype))
        ref.pos.copy_(torch.tensor([0, 5, 47, 130, 9]))  # the last is the scratch row
        theirs = tri.slot_state()
        for name, t in ref.slot_state().items():
            theirs[name].copy_(t)
    batches = [  # (rows, live): an exec mask over the four slots, or the slots of a slack batch
        (torch.tensor([True, True, True, True]), True),
        (torch.tensor([2, -1, 0]), False),
        (torch.tensor([True, True, False, True]), True),
    ]
    for i, (rows, live) in enumerate(batches):
        audio = torch.randn(len(rows), cfg.hidden_size, generator=gen)
        with torch.inference_mode():
            want = (ref.step if live else ref.step_rows)(audio, rows)
            monkeypatch.setattr(thinker_attention_module, "decode_attention", decode_attention_triton)
            got = (tri.step if live else tri.step_rows)(audio, rows)
            monkeypatch.undo()
        tol = TOL["ref_fp32"] if kv == "fp32" else (5e-2, 5e-2)
        _close(f"thinker kv {kv} batch {i} text logits", got.text_logits, want.text_logits, tol)
        _close(f"thinker kv {kv} batch {i} function logits", got.func_logits, want.func_logits, tol)
    theirs = tri.slot_state()
    for name, t in ref.slot_state().items():
        _close(f"thinker kv {kv} {name}", theirs[name][:4].float(), t[:4].float(), TOL[f"ref_{kv}"])


# ---------------------------------------------------------------- CUDA, the talker's 11B shape

# Runs in a fresh interpreter without TRITON_INTERPRET so the kernels are compiled for the device.
CUDA_CHECK = """
import json, torch
from engine.kernels.decode_attention import decode_attention, decode_attention_ref

dev = "cuda"
gen = torch.Generator(device=dev).manual_seed(0)
r, hk, ring, d = 64, 16, 7500, 72
# On the GPU exp is a hardware approximation and multiply-adds fuse: looser fp32 bounds than interpreted.
TOL = {"fp32": (1e-4, 1e-4), "bf16": (2e-2, 2e-2)}
result = {}
for name, dtype in [("fp32", torch.float32), ("bf16", torch.bfloat16)]:
    for g in (1, 4):
        q = torch.randn(r, hk, g, d, generator=gen, device=dev).to(dtype)
        k = (torch.randn(r, hk, ring, d, generator=gen, device=dev) * 1.5).to(dtype)
        v = torch.randn(r, hk, ring, d, generator=gen, device=dev).to(dtype)
        lengths = torch.randint(1, ring + 1, (r,), generator=gen, device=dev)
        lengths[0], lengths[1] = 1, ring
        scale = d**-0.5
        atol, rtol = TOL[name]

        def excess(got, want):
            diff = (got.double() - want.double()).abs()
            return diff.max().item(), (diff - atol - rtol * want.double().abs()).max().item()

        eager = decode_attention(q, k, v, lengths, scale)
        max_diff, eager_excess = excess(eager, decode_attention_ref(q, k, v, lengths, scale))
        # captured with one set of lengths, replayed with another: the loop bound is read on the device
        static = lengths.clone()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            decode_attention(q, k, v, static, scale)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = decode_attention(q, k, v, static, scale)
        new = torch.randint(1, ring + 1, (r,), generator=gen, device=dev)
        static.copy_(new)
        graph.replay()
        torch.cuda.synchronize()
        _, replay_excess = excess(out, decode_attention_ref(q, k, v, new, scale))
        result[f"{name}_g{g}"] = dict(
            max_diff=max_diff,
            eager_excess=eager_excess,
            replay_excess=replay_excess,
            replay_equals_eager=bool(torch.equal(out, decode_attention(q, k, v, new, scale))),
            # one position: the output is that position's value within a few units in the last place (on the
            # GPU the score's multiply fuses into the max's subtraction: exp gives 1 within an ulp)
            length1_ulps=(
                (eager[0].float() - v[0, :, :1].expand(-1, g, -1).float()).abs()
                / (v[0, :, :1].float().abs().clamp_min(1e-6) * torch.finfo(dtype).eps)
            ).max().item(),
        )
print(json.dumps(result))
"""


@pytest.mark.gpu
def test_kernel_matches_reference_and_replays_in_a_cuda_graph_at_the_talker_shape() -> None:
    """Compiled kernel at 64 rows x 16 KV heads x 7500 x 72, g 1 and 4, fp32 and bf16; then captured in a
    CUDA graph and replayed after the lengths changed."""
    result = json.loads(run_compiled(CUDA_CHECK).strip().splitlines()[-1])
    for name, r in result.items():
        print(name, r)
        assert r["eager_excess"] <= 0 and r["replay_excess"] <= 0, name
        assert r["replay_equals_eager"] and r["length1_ulps"] <= 8, name
