"""The live step's joins and joint projections: the conformer's residual join with the LayerNorm after it
(engine/kernels/add_layer_norm.py), the thinker's with its RMSNorm (rms_norm.py, `residual_rms_norm`), the
talker's gated GELU (gelu_mul.py), decode attention handing its output out in the caller's dtype, and the
parameters a step reads as one matrix (engine/model/joint.py). Each kernel: kernel == reference (bit for bit
where the kernel only rounds, else within one rounding), reference == the maths written out, the CPU dispatch
runs the reference itself, and the meta device counts one operator.

The Triton kernels run on CPU tensors under the Triton interpreter, switched on before they are decorated.
"""

import os

os.environ["TRITON_INTERPRET"] = "1"

import json  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from engine.kernels.add_layer_norm import add_layer_norm, add_layer_norm_ref, add_layer_norm_triton  # noqa: E402
from engine.kernels.decode_attention import (  # noqa: E402
    decode_attention,
    decode_attention_ref,
    decode_attention_triton,
)
from engine.kernels.gelu_mul import gelu_mul, gelu_mul_ref, gelu_mul_triton  # noqa: E402
from engine.kernels.rms_norm import (  # noqa: E402
    residual_rms_norm,
    residual_rms_norm_ref,
    residual_rms_norm_triton,
    rms_norm_ref,
)
from engine_support import run_compiled  # noqa: E402

DT = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _ulps(got: torch.Tensor, want: torch.Tensor) -> float:
    """The largest difference in units of the output dtype's rounding at each value's size."""
    eps = torch.finfo(want.dtype).eps
    scale = want.double().abs().clamp_min(1.0)
    return float(((got.double() - want.double()).abs() / (scale * eps)).max())


@pytest.mark.parametrize("alpha", [1.0, 0.5])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_add_layer_norm_kernel_matches_the_reference(dtype, alpha):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(5, 300, generator=g) * 3).to(DT[dtype])  # 300: the block is wider than the row
    y = (torch.randn(5, 300, generator=g) * 2 + 1).to(DT[dtype])
    w, b = (torch.randn(300, generator=g).to(DT[dtype]) for _ in range(2))
    s, out = add_layer_norm_ref(x, y, alpha, w, b, 1e-5)
    assert torch.equal(s, torch.add(x, y, alpha=alpha))
    assert torch.equal(out, F.layer_norm(s, (300,), w, b, 1e-5))
    ks, kout = add_layer_norm_triton(x, y, alpha, w, b, 1e-5)
    print(f"{dtype} alpha {alpha}: norm off by {_ulps(kout, out):.2f} ulps")
    assert ks.dtype == kout.dtype == x.dtype
    assert torch.equal(ks, s)  # the residual is rounded as torch rounds it
    assert _ulps(kout, out) <= (1.0 if dtype == "bf16" else 64.0)
    ds, dout = add_layer_norm(x, y, alpha, w, b, 1e-5)
    assert torch.equal(ds, s) and torch.equal(dout, out)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_residual_rms_norm_kernel_matches_the_reference(dtype):
    g = torch.Generator().manual_seed(1)
    h = (torch.randn(4, 200, generator=g) * 2).to(DT[dtype])
    y = (torch.randn(4, 200, generator=g) * 5).to(DT[dtype])
    w = (torch.rand(200, generator=g) + 0.5).to(DT[dtype])
    s, out = residual_rms_norm_ref(h.clone(), y, w, 1e-5)
    assert torch.equal(s, h + y) and torch.equal(out, rms_norm_ref(h + y, w, 1e-5))
    stream = h.clone()
    ks, kout = residual_rms_norm_triton(stream, y, w, 1e-5)
    print(f"{dtype}: norm off by {_ulps(kout, out):.2f} ulps")
    assert ks is stream and torch.equal(ks, s)  # the sum is written over the residual stream
    assert _ulps(kout, out) <= (1.0 if dtype == "bf16" else 64.0)
    stream = h.clone()
    ds, dout = residual_rms_norm(stream, y, w, 1e-5)
    assert ds is stream and torch.equal(ds, s) and torch.equal(dout, out)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_gelu_mul_kernel_matches_the_reference(dtype):
    g = torch.Generator().manual_seed(2)
    gu = (torch.randn(3, 2 * 1100, generator=g) * 4).to(DT[dtype])  # 1100: two blocks, the last partial
    want = gelu_mul_ref(gu)
    assert torch.equal(want, F.gelu(gu[:, :1100], approximate="tanh") * gu[:, 1100:])
    got = gelu_mul_triton(gu)
    print(f"{dtype}: off by {_ulps(got, want):.2f} ulps")
    assert got.shape == (3, 1100) and got.dtype == gu.dtype
    assert _ulps(got, want) <= (2.0 if dtype == "bf16" else 64.0)
    assert torch.equal(gelu_mul(gu), want)


@pytest.mark.parametrize("splits", [1, 3])
def test_decode_attention_hands_a_bf16_rings_output_out_in_fp32(splits):
    g = torch.Generator().manual_seed(3)
    r, hk, gq, n, d = 3, 2, 2, 40, 16
    q = torch.randn(r, hk, gq, d, generator=g)
    kc, vc = (torch.randn(r, hk, n, d, generator=g).bfloat16() for _ in range(2))
    lengths = torch.tensor([1, 17, 40])
    want = decode_attention_ref(q, kc, vc, lengths, 0.25, out_dtype=torch.float32)
    assert torch.equal(want, decode_attention_ref(q, kc, vc, lengths, 0.25).float())
    got = decode_attention_triton(q, kc, vc, lengths, 0.25, splits=splits, out_dtype=torch.float32)
    assert got.dtype == torch.float32
    assert torch.equal(got, got.bfloat16().float())  # rounded to the ring's dtype first, as the reference
    assert float((got - want).abs().max()) <= 2**-6
    assert torch.equal(decode_attention(q, kc, vc, lengths, 0.25, out_dtype=torch.float32), want)


def test_the_fused_kernels_count_one_operator_each_on_meta():
    from benchmarks.step_ops import _WorkCounter

    x = torch.empty(4, 8, device="meta")
    xb = torch.empty(4, 8, device="meta", dtype=torch.bfloat16)
    w = torch.empty(8, device="meta")
    kc = torch.empty(4, 2, 5, 4, device="meta", dtype=torch.bfloat16)
    lengths = torch.empty(4, device="meta", dtype=torch.long)
    counter = _WorkCounter()
    with torch.inference_mode(), counter:
        s, out = add_layer_norm(x, x, 0.5, w, w, 1e-5)
        s2, out2 = residual_rms_norm(xb, xb, w, 1e-5)
        y = gelu_mul(x)
        o = decode_attention(x.view(4, 2, 1, 4), kc, kc, lengths, 1.0, out_dtype=torch.float32)
    assert sum(counter.by_op.values()) == 4, counter.by_op
    assert s.shape == out.shape == (4, 8) and s2.dtype == out2.dtype == torch.bfloat16
    assert y.shape == (4, 4) and o.dtype == torch.float32


def test_joint_parameters_are_views_of_one_tensor_that_loads_and_moves_whole():
    from engine.model.conformer import RelPositionAttention

    att = RelPositionAttention(16, 2)
    names = ("linear_q.weight", "linear_k.weight", "linear_v.weight")
    qkv = att.joint("qkv")
    # one storage: the checkpoint's three tensors are rows of the joint one, no second copy
    assert qkv.shape == (48, 16)
    assert {att.get_parameter(n).untyped_storage().data_ptr() for n in names} == {
        qkv.untyped_storage().data_ptr()
    }
    assert set(att.state_dict()) >= set(names) and "qkv" not in "".join(att.state_dict())
    # loading by the checkpoint's names (in place) writes the joint tensor
    new = {n: torch.randn(16, 16) for n in names}
    att.load_state_dict({**att.state_dict(), **new})
    assert torch.equal(att.joint("qkv"), torch.cat([new[n] for n in names]))
    # moving or casting the module joins them again
    att.to(torch.bfloat16)
    joint = att.joint("qkv")
    assert joint.dtype == torch.bfloat16 and torch.equal(joint, torch.cat([new[n] for n in names]).bfloat16())
    assert att.linear_k.weight.untyped_storage().data_ptr() == joint.untyped_storage().data_ptr()
    att.pos_bias_v.data.fill_(3.0)  # a view: the joint biases see it
    assert torch.equal(att.joint("uv")[2:], torch.full((2, 8), 3.0, dtype=torch.bfloat16))


CUDA_CHECK = """
import json, torch
from engine.kernels.add_layer_norm import add_layer_norm, add_layer_norm_ref
from engine.kernels.gelu_mul import gelu_mul, gelu_mul_ref
from engine.kernels.rms_norm import residual_rms_norm, residual_rms_norm_ref

g = torch.Generator(device="cuda").manual_seed(0)
out = {}
x, y = (torch.randn(64, 1024, generator=g, device="cuda").bfloat16() for _ in range(2))  # the conformer's
w, b = (torch.randn(1024, generator=g, device="cuda").bfloat16() for _ in range(2))
(s, o), (rs, ro) = add_layer_norm(x, y, 0.5, w, b, 1e-5), add_layer_norm_ref(x, y, 0.5, w, b, 1e-5)
out["add_layer_norm"] = [bool(torch.equal(s, rs)), float((o.float() - ro.float()).abs().max())]
h, y = (torch.randn(64, 4480, generator=g, device="cuda").bfloat16() for _ in range(2))  # the thinker's
w = torch.rand(4480, generator=g, device="cuda").bfloat16() + 0.5
(s, o), (rs, ro) = residual_rms_norm(h.clone(), y, w, 1e-5), residual_rms_norm_ref(h.clone(), y, w, 1e-5)
out["residual_rms_norm"] = [bool(torch.equal(s, rs)), float((o.float() - ro.float()).abs().max())]
gu = torch.randn(64, 9216, generator=g, device="cuda") * 3  # the talker's gate/up
out["gelu_mul"] = float((gelu_mul(gu) - gelu_mul_ref(gu)).abs().max())
print(json.dumps(out))
"""


@pytest.mark.gpu
def test_the_fused_joins_match_their_references_on_cuda_at_model_sizes():
    result = json.loads(run_compiled(CUDA_CHECK).strip().splitlines()[-1])
    print(result)
    assert result["add_layer_norm"][0] and result["add_layer_norm"][1] <= 0.07, result
    assert result["residual_rms_norm"][0] and result["residual_rms_norm"][1] <= 0.07, result
    assert result["gelu_mul"] <= 1e-4, result
