"""The talker's fused query/key norm and rotation (engine/kernels/qk_norm_rope.py): kernel == reference in
fp32, reference == the talker's own modules (GemmaRMSNorm, then rotate-half RoPE as transformers applies it).

The Triton kernel runs on CPU tensors under the Triton interpreter, switched on before it is decorated.
"""

import os

os.environ["TRITON_INTERPRET"] = "1"

import json  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from engine.kernels.qk_norm_rope import qk_norm_rope, qk_norm_rope_ref, qk_norm_rope_triton  # noqa: E402
from engine.model.talker_heads import (  # noqa: E402
    GemmaRMSNorm,
    apply_rope,
    rope_cos_sin,
    rope_inv_freq,
    rotate_half_tables,
)
from engine_support import run_compiled  # noqa: E402

R, HQ, HK, D = 5, 4, 2, 24  # 24: the block is wider than a head


def _case(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(R, (HQ + 2 * HK) * D, generator=g) * 2
    q = qkv[:, : HQ * D].reshape(R, HQ, D)  # strided views of one projection, as the talker splits it
    k = qkv[:, HQ * D : (HQ + HK) * D].reshape(R, HK, D)
    qn, kn = GemmaRMSNorm(D), GemmaRMSNorm(D)
    with torch.no_grad():
        qn.weight.copy_(0.1 * torch.randn(D, generator=g))
        kn.weight.copy_(0.1 * torch.randn(D, generator=g))
        qn.fuse()
        kn.fuse()
    pos = torch.tensor([0, 3, 17, 250, 1])
    cos, sin = rope_cos_sin(pos, rope_inv_freq(D, 10000.0))
    perm, sign = rotate_half_tables(D)
    return q, k, qn, kn, cos, sin, perm, sign


def test_reference_is_the_talker_modules_and_the_kernel_matches_it():
    q, k, qn, kn, cos, sin, perm, sign = _case()
    want = torch.cat(
        [apply_rope(qn(q).transpose(0, 1), cos, sin), apply_rope(kn(k).transpose(0, 1), cos, sin)]
    ).transpose(0, 1)
    args = (q, k, qn.scale, kn.scale, qn.eps, cos[:, None], (sin * sign)[:, None], perm)
    ref = qk_norm_rope_ref(*args)
    torch.testing.assert_close(ref, want, rtol=1e-6, atol=1e-6)
    got = qk_norm_rope_triton(*args)
    assert got.shape == (R, HQ + HK, D) and got.dtype == torch.float32
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    assert torch.equal(qk_norm_rope(*args), ref)  # the CPU runs the reference
    # a row's output depends on its own heads alone
    q2 = q.clone()
    q2[2] *= 3
    other = qk_norm_rope_triton(q2, *args[1:])
    assert torch.equal(other[[0, 1, 3, 4]], got[[0, 1, 3, 4]])


def test_kernel_refuses_what_it_does_not_take():
    q, k, qn, kn, cos, sin, perm, sign = _case(1)
    args = [q, k, qn.scale, kn.scale, qn.eps, cos[:, None], (sin * sign)[:, None], perm]
    with pytest.raises(ValueError, match="must be"):
        qk_norm_rope_triton(q, k[:, :, :-2], *args[2:])
    with pytest.raises(ValueError, match="fp32"):
        qk_norm_rope_triton(q.double(), k.double(), *args[2:])


CUDA_CHECK = """
import json, torch
from engine.kernels.qk_norm_rope import qk_norm_rope, qk_norm_rope_ref
from engine.model.talker_heads import rope_cos_sin, rope_inv_freq, rotate_half_tables

g = torch.Generator(device="cuda").manual_seed(0)
r, hq, hk, d = 128, 8, 4, 256  # 64 slots x 2 streams at the talker's head sizes
qkv = torch.randn(r, (hq + 2 * hk) * d, generator=g, device="cuda")
q, k = qkv[:, : hq * d].reshape(r, hq, d), qkv[:, hq * d : (hq + hk) * d].reshape(r, hk, d)
qs, ks = 1 + 0.1 * torch.randn(2, d, generator=g, device="cuda")
cos, sin = rope_cos_sin(torch.arange(r, device="cuda") * 7, rope_inv_freq(d, 10000.0, "cuda"))
perm, sign = (t.cuda() for t in rotate_half_tables(d))
args = (q, k, qs, ks, 1e-6, cos[:, None], (sin * sign)[:, None], perm)
a, b = qk_norm_rope(*args), qk_norm_rope_ref(*args)
print(json.dumps({"max_abs": float((a - b).abs().max())}))
"""


@pytest.mark.gpu
def test_kernel_matches_the_reference_on_cuda_at_model_sizes():
    result = json.loads(run_compiled(CUDA_CHECK).strip().splitlines()[-1])
    assert result["max_abs"] <= 1e-4, result


def test_add_rms_norm_is_the_talker_join_and_the_kernel_matches_it():
    from engine.kernels.add_rms_norm import add_rms_norm, add_rms_norm_ref, add_rms_norm_triton

    g = torch.Generator().manual_seed(4)
    r, d = 5, 40  # 40: the block is wider than the row
    x, y = torch.randn(r, d, generator=g), torch.randn(r, d, generator=g) * 3
    post, nxt = GemmaRMSNorm(d), GemmaRMSNorm(d)
    with torch.no_grad():
        post.weight.copy_(0.1 * torch.randn(d, generator=g))
        nxt.weight.copy_(0.1 * torch.randn(d, generator=g))
        post.fuse()
        nxt.fuse()
    want_s = x + post(y)
    want = nxt(want_s)
    s, out = add_rms_norm_ref(x, y, post.scale, nxt.scale, post.eps)
    assert torch.equal(s, want_s) and torch.equal(out, want)  # the talker's modules, bit for bit
    got_s, got = add_rms_norm_triton(x, y, post.scale, nxt.scale, post.eps)
    torch.testing.assert_close(got_s, want_s, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    s, out = add_rms_norm(x, y, post.scale, nxt.scale, post.eps)
    assert torch.equal(s, want_s) and torch.equal(out, want)  # the CPU runs the reference
    with pytest.raises(ValueError, match="must be"):
        add_rms_norm_triton(x, y[:, :-1], post.scale, nxt.scale, post.eps)
