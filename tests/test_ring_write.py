"""The live form's KV ring write (engine/kernels/ring_write.py): kernel == reference == a naive per-row loop,
for every written entry and for every entry a masked-off row must keep, at the strides and dtypes the
stages pass (a talker's split key, a cast from fp32 to a bf16 ring).

The Triton kernel runs on CPU tensors under the Triton interpreter, switched on before it is decorated.
"""

import os

os.environ["TRITON_INTERPRET"] = "1"

import json  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from engine.kernels.ring_write import (  # noqa: E402
    ring_write_kv,
    ring_write_kv_ref,
    ring_write_kv_triton,
)
from engine_support import run_compiled  # noqa: E402

R, H, N, D = 6, 3, 5, 12  # odd heads and head size: the kernel's blocks are wider than the row


def _case(value_dtype: torch.dtype, cache_dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    kc = torch.randn(R, H, N, D, generator=g).to(cache_dtype)
    vc = torch.randn(R, H, N, D, generator=g).to(cache_dtype)
    # k and v as strided views of one projection, as the talker splits them
    qkv = torch.randn(R, 2 * H + 1, D, generator=g).to(value_dtype)
    k, v = qkv[:, 1 : H + 1], qkv[:, H + 1 :]
    entry = torch.tensor([0, 4, 2, 2, 1, 3])
    mask = torch.tensor([True, False, True, True, False, True])
    return kc, vc, entry, k, v, mask


def _naive(kc, vc, entry, k, v, mask):
    kc, vc = kc.clone(), vc.clone()
    for i in range(R):
        if mask[i]:
            kc[i, :, int(entry[i])] = k[i].to(kc.dtype)
            vc[i, :, int(entry[i])] = v[i].to(vc.dtype)
    return kc, vc


@pytest.mark.parametrize(
    "value_dtype,cache_dtype",
    [(torch.float32, torch.float32), (torch.float32, torch.bfloat16), (torch.bfloat16, torch.bfloat16)],
)
def test_reference_and_kernel_write_the_masked_rows_entry_alone(value_dtype, cache_dtype):
    kc, vc, entry, k, v, mask = _case(value_dtype, cache_dtype)
    want_k, want_v = _naive(kc, vc, entry, k, v, mask)
    assert not torch.equal(want_k, kc)  # the case writes something
    for write in (ring_write_kv_ref, ring_write_kv_triton):
        got_k, got_v = kc.clone(), vc.clone()
        write(got_k, got_v, entry, k, v, mask)
        assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v), write.__name__
        # the rows outside the mask keep every entry, bit for bit
        assert torch.equal(got_k[~mask], kc[~mask]) and torch.equal(got_v[~mask], vc[~mask])


def test_dispatch_on_cpu_runs_the_reference_and_no_mask_changes_nothing():
    kc, vc, entry, k, v, mask = _case(torch.float32, torch.bfloat16, seed=1)
    want_k, want_v = _naive(kc, vc, entry, k, v, mask)
    got_k, got_v = kc.clone(), vc.clone()
    ring_write_kv(got_k, got_v, entry, k, v, mask)
    assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v)
    none = torch.zeros(R, dtype=torch.bool)
    for write in (ring_write_kv_ref, ring_write_kv_triton):
        got_k, got_v = kc.clone(), vc.clone()
        write(got_k, got_v, entry, k, v, none)
        assert torch.equal(got_k, kc) and torch.equal(got_v, vc)


def test_kernel_refuses_shapes_that_do_not_match():
    kc, vc, entry, k, v, mask = _case(torch.float32, torch.float32)
    with pytest.raises(ValueError, match="k "):
        ring_write_kv_triton(kc, vc, entry, k[:, :2], v, mask)
    with pytest.raises(ValueError, match="entry"):
        ring_write_kv_triton(kc, vc, entry.float(), k, v, mask)
    with pytest.raises(ValueError, match="exec_mask"):
        ring_write_kv_triton(kc, vc, entry, k, v, mask.long())
    with pytest.raises(ValueError, match="v_cache"):
        ring_write_kv_triton(kc, vc[:, :, :2], entry, k, v, mask)


def test_meta_counts_one_write_per_pair_of_rings():
    from benchmarks.step_ops import _WorkCounter

    kc, vc, entry, k, v, mask = (t.to("meta") for t in _case(torch.float32, torch.bfloat16))
    counter = _WorkCounter()
    with torch.inference_mode(), counter:
        ring_write_kv(kc, vc, entry, k, v, mask)
    assert sum(counter.by_op.values()) == 1


CUDA_CHECK = """
import json, torch
from engine.kernels.ring_write import ring_write_kv, ring_write_kv_ref

dev = "cuda"
g = torch.Generator(device=dev).manual_seed(0)
out = {}
# the talker's rings (64 slots x 2 streams, fp32 keys into bf16 rings) and the thinker's (bf16)
for name, (r, h, n, d, vd, cd) in {
    "talker": (128, 4, 512, 256, torch.float32, torch.bfloat16),
    "thinker": (64, 8, 4096, 128, torch.bfloat16, torch.bfloat16),
}.items():
    kc = torch.randn(r, h, n, d, generator=g, device=dev).to(cd)
    vc = torch.randn(r, h, n, d, generator=g, device=dev).to(cd)
    kv = torch.randn(r, 2 * h, d, generator=g, device=dev).to(vd)
    k, v = kv[:, :h], kv[:, h:]
    entry = torch.randint(0, n, (r,), generator=g, device=dev)
    mask = torch.rand(r, generator=g, device=dev) < 0.7
    want_k, want_v = kc.clone(), vc.clone()
    ring_write_kv_ref(want_k, want_v, entry, k, v, mask)
    ring_write_kv(kc, vc, entry, k, v, mask)
    torch.cuda.synchronize()
    out[name] = bool(torch.equal(kc, want_k) and torch.equal(vc, want_v))
print(json.dumps(out))
"""


@pytest.mark.gpu
def test_kernel_matches_reference_on_cuda_at_model_sizes():
    result = json.loads(run_compiled(CUDA_CHECK).strip().splitlines()[-1])
    assert result == {"talker": True, "thinker": True}
