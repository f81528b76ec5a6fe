"""The thinker's RMSNorm kernels (engine/kernels/rms_norm.py): kernel == reference within one rounding of the
output dtype, reference == the model's maths written out (NemotronH's norms), dispatch on the CPU the
reference itself.

The Triton kernels run on CPU tensors under the Triton interpreter, switched on before they are decorated.
"""

import os

os.environ["TRITON_INTERPRET"] = "1"

import json  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from engine.kernels.rms_norm import (  # noqa: E402
    gated_rms_norm,
    gated_rms_norm_ref,
    gated_rms_norm_triton,
    rms_norm,
    rms_norm_ref,
    rms_norm_triton,
)
from engine_support import run_compiled  # noqa: E402

DT = {"fp32": torch.float32, "bf16": torch.bfloat16}
# one rounding of the output: fp32 differs in the order of the sum of squares, bf16 by at most one ulp
TOL = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (2**-7, 2**-7)}


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype
    atol, rtol = TOL[want.dtype]
    diff = (got.double() - want.double()).abs()
    assert (diff <= atol + rtol * want.double().abs()).all(), float(diff.max())


def _naive_norm(x, w, eps):
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (w.float() * h).to(x.dtype)


def _naive_gated(x, gate, w, group, eps):
    h = x.float() * (gate.float() * torch.sigmoid(gate.float()))
    g = h.view(*h.shape[:-1], -1, group)
    g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + eps)
    return w * g.view(h.shape).to(x.dtype)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_rms_norm_kernel_and_reference_match_the_maths(dtype):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(5, 3, 40, generator=g) * 3).to(DT[dtype])  # 40: the block is wider than the row
    w = (1 + 0.1 * torch.randn(40, generator=g)).to(DT[dtype])
    want = rms_norm_ref(x, w, 1e-5)
    _close(want, _naive_norm(x, w, 1e-5))
    _close(rms_norm_triton(x, w, 1e-5), want)
    assert torch.equal(rms_norm(x, w, 1e-5), want)  # the CPU runs the reference


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_gated_rms_norm_kernel_and_reference_match_the_maths(dtype):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(6, 48, generator=g).to(DT[dtype])
    gate = (2 * torch.randn(6, 48, generator=g)).to(DT[dtype])
    w = (1 + 0.1 * torch.randn(48, generator=g)).to(DT[dtype])
    want = gated_rms_norm_ref(x, gate, w, 12, 1e-5)  # four groups of 12 channels per row
    _close(want, _naive_gated(x, gate, w, 12, 1e-5))
    _close(gated_rms_norm_triton(x, gate, w, 12, 1e-5), want)
    assert torch.equal(gated_rms_norm(x, gate, w, 12, 1e-5), want)
    # each group is normed alone: scaling one group's input leaves the others' output as it was
    x2 = x.clone()
    x2[:, :12] *= 4
    other = gated_rms_norm_triton(x2, gate, w, 12, 1e-5)
    assert torch.equal(other[:, 12:], gated_rms_norm_triton(x, gate, w, 12, 1e-5)[:, 12:])


def test_kernels_refuse_what_does_not_fit():
    x = torch.randn(4, 48)
    with pytest.raises(ValueError, match="weight"):
        rms_norm_triton(x, torch.ones(40), 1e-5)
    with pytest.raises(ValueError, match="group"):
        gated_rms_norm_triton(x, x, torch.ones(48), 10, 1e-5)
    with pytest.raises(ValueError, match="gate"):
        gated_rms_norm_triton(x, x[:, :24], torch.ones(48), 12, 1e-5)


def test_meta_counts_one_kernel_each():
    from benchmarks.step_ops import _WorkCounter

    x = torch.empty(4, 48, dtype=torch.bfloat16, device="meta")
    w = torch.empty(48, dtype=torch.bfloat16, device="meta")
    counter = _WorkCounter()
    with torch.inference_mode(), counter:
        a = rms_norm(x, w, 1e-5)
        b = gated_rms_norm(x, x, w, 12, 1e-5)
    assert sum(counter.by_op.values()) == 2
    assert a.dtype == b.dtype == torch.bfloat16 and a.shape == b.shape == x.shape


CUDA_CHECK = """
import json, torch
from engine.kernels.rms_norm import gated_rms_norm, gated_rms_norm_ref, rms_norm, rms_norm_ref

g = torch.Generator(device="cuda").manual_seed(0)
out = {}
# the 11B thinker's sizes: hidden 4480, d_inner 10240 in 8 groups
x = torch.randn(64, 4480, generator=g, device="cuda").bfloat16()
w = (1 + 0.1 * torch.randn(4480, generator=g, device="cuda")).bfloat16()
a, b = rms_norm(x, w, 1e-5), rms_norm_ref(x, w, 1e-5)
out["norm"] = float(((a.double() - b.double()).abs() - 2**-7 * (1 + b.double().abs())).max())
y = torch.randn(64, 10240, generator=g, device="cuda").bfloat16()
z = torch.randn(64, 10240, generator=g, device="cuda").bfloat16()
w = (1 + 0.1 * torch.randn(10240, generator=g, device="cuda")).bfloat16()
a, b = gated_rms_norm(y, z, w, 1280, 1e-5), gated_rms_norm_ref(y, z, w, 1280, 1e-5)
out["gated"] = float(((a.double() - b.double()).abs() - 2**-7 * (1 + b.double().abs())).max())
print(json.dumps(out))
"""


@pytest.mark.gpu
def test_kernels_match_the_references_on_cuda_at_model_sizes():
    result = json.loads(run_compiled(CUDA_CHECK).strip().splitlines()[-1])
    assert result["norm"] <= 0 and result["gated"] <= 0, result


def test_reference_is_torch_rms_norm_bit_for_bit():
    # the block norm's reference is one fused operator in fp32, as the thinker ran it before the kernel
    x = torch.randn(3, 64).bfloat16()
    w = torch.randn(64).bfloat16()
    want = F.rms_norm(x.float(), (64,), w.float(), 1e-6).to(torch.bfloat16)
    assert torch.equal(rms_norm_ref(x, w, 1e-6), want)
