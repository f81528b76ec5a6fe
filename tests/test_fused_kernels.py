"""The live step's small fused kernels: the thinker MLP's relu^2 (engine/kernels/relu_square.py), the
conformer's attention weights (scaled_softmax.py) and the codec's channel LayerNorm (channel_norm.py).
Each: kernel == reference (bit for bit where the kernel only rounds, else within one rounding), reference ==
the maths written out, and the CPU dispatch runs the reference itself.

The Triton kernels run on CPU tensors under the Triton interpreter, switched on before they are decorated.
"""

import os

os.environ["TRITON_INTERPRET"] = "1"

import json  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from engine.kernels.channel_norm import channel_norm, channel_norm_ref, channel_norm_triton  # noqa: E402
from engine.kernels.relu_square import relu_square, relu_square_ref, relu_square_triton  # noqa: E402
from engine.kernels.scaled_softmax import (  # noqa: E402
    scaled_softmax,
    scaled_softmax_ref,
    scaled_softmax_triton,
)
from engine_support import run_compiled  # noqa: E402

DT = {"fp32": torch.float32, "bf16": torch.bfloat16}


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_relu_square_kernel_is_the_reference_bit_for_bit(dtype):
    x = (torch.randn(7, 300, generator=torch.Generator().manual_seed(0)) * 4).to(DT[dtype])
    want = relu_square_ref(x)
    assert torch.equal(want, torch.where(x > 0, x * x, torch.zeros_like(x)))
    got = relu_square_triton(x)
    assert got.dtype == x.dtype and torch.equal(got, want)
    assert torch.equal(relu_square(x), want)


@pytest.mark.parametrize("scores_dtype,out_dtype", [("fp32", "fp32"), ("bf16", "bf16"), ("fp32", "bf16")])
def test_scaled_softmax_kernel_matches_the_reference(scores_dtype, out_dtype):
    g = torch.Generator().manual_seed(1)
    b, h, n = 3, 4, 11  # 11: the block is wider than the row
    scores = (torch.randn(b, h, n, generator=g) * 8).to(DT[scores_dtype])
    bias = torch.where(torch.rand(b, 1, n, generator=g) < 0.3, -10000.0, 0.0)
    bias[:, :, 0] = 0.0  # the current frame is always visible
    want = scaled_softmax_ref(scores.clone(), 8.0, bias, DT[out_dtype])
    maths = torch.softmax(scores.double() / 8.0 + bias.double(), dim=-1)
    assert want.dtype == DT[out_dtype]
    ulp = 2**-7 if out_dtype == "bf16" else 1e-6
    assert ((want.double() - maths).abs() <= ulp).all()
    got = scaled_softmax_triton(scores, 8.0, bias, DT[out_dtype])
    assert got.dtype == want.dtype and ((got.double() - want.double()).abs() <= ulp).all()
    assert (got[bias.expand(b, h, n) < 0] == 0).all()  # hidden keys get exactly no weight
    assert torch.equal(scaled_softmax(scores.clone(), 8.0, bias, DT[out_dtype]), want)


def test_channel_norm_kernel_matches_the_reference_and_layer_norm():
    g = torch.Generator().manual_seed(2)
    c, b, n = 20, 3, 5  # 20 channels: the block is wider than the column
    y = torch.randn(c, b, n, generator=g) * 3 + 1
    w, bias = torch.randn(c, generator=g), torch.randn(c, generator=g)
    want = channel_norm_ref(y.clone(), w, bias, 1e-6)
    ln = F.layer_norm(y.permute(1, 2, 0), (c,), w, bias, 1e-6).permute(2, 0, 1)
    torch.testing.assert_close(want, ln, rtol=1e-5, atol=1e-5)
    got = channel_norm_triton(y, w, bias, 1e-6)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(channel_norm(y.clone(), w, bias, 1e-6), want)
    # a column's output depends on its own channels alone
    y2 = y.clone()
    y2[:, 1, 2] *= 5
    other = channel_norm_triton(y2, w, bias, 1e-6)
    keep = torch.ones(b, n, dtype=torch.bool)
    keep[1, 2] = False
    assert torch.equal(other[:, keep], got[:, keep])


def test_kernels_refuse_what_they_do_not_take():
    with pytest.raises(ValueError, match="contiguous"):
        relu_square_triton(torch.randn(4, 6).t())
    with pytest.raises(ValueError, match="bias"):
        scaled_softmax_triton(torch.randn(2, 3, 5), 1.0, torch.zeros(2, 3, 5), torch.float32)
    with pytest.raises(ValueError, match="weight and bias"):
        channel_norm_triton(torch.randn(4, 2, 3), torch.ones(3), torch.zeros(4), 1e-6)


def test_meta_counts_one_kernel_each():
    from benchmarks.step_ops import _WorkCounter

    x = torch.empty(4, 2, 8, device="meta")
    w = torch.empty(4, device="meta")
    counter = _WorkCounter()
    with torch.inference_mode(), counter:
        relu_square(x)
        s = scaled_softmax(x, 2.0, x[:, :1], torch.bfloat16)
        channel_norm(x, w, w, 1e-6)
    assert sum(counter.by_op.values()) == 3 and s.dtype == torch.bfloat16


CUDA_CHECK = """
import json, torch
from engine.kernels.channel_norm import channel_norm, channel_norm_ref
from engine.kernels.relu_square import relu_square, relu_square_ref
from engine.kernels.scaled_softmax import scaled_softmax, scaled_softmax_ref

g = torch.Generator(device="cuda").manual_seed(0)
out = {}
x = torch.randn(64, 21504, generator=g, device="cuda").bfloat16()  # the thinker MLP's width
out["relu_square"] = bool(torch.equal(relu_square(x), relu_square_ref(x)))
s = torch.randn(64, 8, 71, generator=g, device="cuda").bfloat16() * 8  # 64 slots, 8 heads, 1 + 70 keys
bias = torch.where(torch.rand(64, 1, 71, generator=g, device="cuda") < 0.3, -10000.0, 0.0)
a, b = scaled_softmax(s, 8.0, bias, torch.bfloat16), scaled_softmax_ref(s.clone(), 8.0, bias, torch.bfloat16)
out["softmax"] = float((a.double() - b.double()).abs().max())
y = torch.randn(512, 64, 2, generator=g, device="cuda")  # codec channels x slots x frames
w, c = torch.randn(2, 512, generator=g, device="cuda")
a, b = channel_norm(y, w, c, 1e-6), channel_norm_ref(y.clone(), w, c, 1e-6)
out["channel_norm"] = float((a - b).abs().max())
print(json.dumps(out))
"""


@pytest.mark.gpu
def test_kernels_match_the_references_on_cuda_at_model_sizes():
    result = json.loads(run_compiled(CUDA_CHECK).strip().splitlines()[-1])
    assert result["relu_square"] and result["softmax"] <= 2**-7 and result["channel_norm"] <= 1e-4, result


def test_ssm_update_takes_a_log_as_the_checkpoint_stores_it():
    from engine.kernels.selective_state_update import (
        selective_state_update_ref,
        selective_state_update_triton,
    )

    g = torch.Generator().manual_seed(3)
    b, h, p, n, gr = 3, 4, 8, 16, 2
    a_log = torch.randn(h, generator=g) * 0.5
    args = [torch.randn(b, h, p, generator=g), torch.randn(b, h, generator=g)]
    bc = [torch.randn(b, gr, n, generator=g), torch.randn(b, gr, n, generator=g)]
    rest = [torch.randn(h, generator=g), torch.randn(h, generator=g), torch.tensor([2, -1, 0])]
    state = torch.randn(4, h, p, n, generator=g)
    want_state = state.clone()
    want = selective_state_update_ref(want_state, *args, -torch.exp(a_log), *bc, *rest)
    for update in (selective_state_update_ref, selective_state_update_triton):
        got_state = state.clone()
        got = update(got_state, *args, a_log, *bc, *rest, a_log=True)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got_state, want_state, rtol=1e-5, atol=1e-5)
    got_state = state.clone()
    assert torch.equal(selective_state_update_ref(got_state, *args, a_log, *bc, *rest, a_log=True), want)


@pytest.mark.parametrize(("setting", "fused"), [(None, True), ("1", True), ("0", False)])
def test_the_fused_kernels_can_be_turned_off_for_a_suspect_device(setting, fused):
    """CHORUS_FUSED_KERNELS=0 keeps the fused chains on their torch references on CUDA too (Triton is
    installed here, so the default is on)."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "CHORUS_FUSED_KERNELS"}
    if setting is not None:
        env["CHORUS_FUSED_KERNELS"] = setting
    got = subprocess.run(
        [sys.executable, "-c", "from engine.kernels._triton import FUSED; print(FUSED)"],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    assert got == str(fused)
