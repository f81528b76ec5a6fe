"""The live form's write of one key and one value entry per row into a pair of KV rings: row i writes its
key and value, cast to the rings' dtype, at ring entry `entry[i]`, where `exec_mask[i]` is set; a row outside
the mask keeps its ring as it is (engine/model/slot_state.py, `ring_write`).

Knows tensors only. `ring_write_kv` dispatches to the Triton kernel (`ring_write_kv_triton`, one launch for
both rings) on CUDA and to the plain-torch `ring_write_kv_ref` (a gather, a select and a scatter per ring,
with a cast where the dtypes differ) elsewhere. The kernel reads the mask and the entries on the device: a
fixed grid of one program per row, of which those of an unmasked row return at once; no host sync, so it
captures into the step's CUDA graph.
"""

from __future__ import annotations

import torch

from engine.kernels._triton import FUSED, on_device, tl, to_bf16_rtne, triton
from engine.kernels._triton import jit as _jit


def _ring_write_ref(
    cache: torch.Tensor, index: torch.Tensor, value: torch.Tensor, mask: torch.Tensor
) -> None:
    value = value[:, :, None] if value.dtype == cache.dtype else value[:, :, None].to(cache.dtype)
    cache.scatter_(2, index, torch.where(mask.view(-1, 1, 1, 1), value, cache.gather(2, index)))


def ring_write_kv_ref(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    entry: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    exec_mask: torch.Tensor,
) -> None:
    """k_cache[i, :, entry[i]] = k[i] and v_cache[i, :, entry[i]] = v[i] (in the caches' dtype) for every row
    i where exec_mask[i], in place; other rows keep their rings.

    Shapes (R = rows): k_cache, v_cache [R, H, N, D]; entry [R] int64 in [0, N); k, v [R, H, D];
    exec_mask [R] bool.
    """
    r, h, _, d = k_cache.shape
    index = entry.view(r, 1, 1, 1).expand(r, h, 1, d)
    _ring_write_ref(k_cache, index, k, exec_mask)
    _ring_write_ref(v_cache, index, v, exec_mask)


@_jit
def _ring_write_kv_kernel(
    kc_ptr,
    vc_ptr,
    k_ptr,
    v_ptr,
    entry_ptr,
    mask_ptr,
    heads,
    dim,
    s_kc_r,
    s_kc_h,
    s_kc_n,
    s_kc_d,
    s_vc_r,
    s_vc_h,
    s_vc_n,
    s_vc_d,
    s_k_r,
    s_k_h,
    s_k_d,
    s_v_r,
    s_v_h,
    s_v_d,
    TO_BF16: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # One program per row: its H x D key and value, each stored at its ring entry.
    row = tl.program_id(0)
    if tl.load(mask_ptr + row) == 0:  # outside the mask: its rings are neither read nor written
        return
    row64 = row.to(tl.int64)
    e = tl.load(entry_ptr + row).to(tl.int64)
    hh = tl.arange(0, BLOCK_H)[:, None]
    dd = tl.arange(0, BLOCK_D)[None, :]
    inside = (hh < heads) & (dd < dim)
    k = tl.load(k_ptr + row64 * s_k_r + hh * s_k_h + dd * s_k_d, mask=inside)
    v = tl.load(v_ptr + row64 * s_v_r + hh * s_v_h + dd * s_v_d, mask=inside)
    kc = kc_ptr + row64 * s_kc_r + e * s_kc_n + hh * s_kc_h + dd * s_kc_d
    vc = vc_ptr + row64 * s_vc_r + e * s_vc_n + hh * s_vc_h + dd * s_vc_d
    if TO_BF16:
        tl.store(kc, to_bf16_rtne(k), mask=inside)
        tl.store(vc, to_bf16_rtne(v), mask=inside)
    else:
        tl.store(kc, k.to(kc_ptr.dtype.element_ty), mask=inside)
        tl.store(vc, v.to(vc_ptr.dtype.element_ty), mask=inside)


def _check(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    entry: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    exec_mask: torch.Tensor,
) -> None:
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError(
            f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} must be alike [R, H, N, D]"
        )
    r, h, _, d = k_cache.shape
    if k.shape != (r, h, d) or v.shape != (r, h, d):
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must be [{r}, {h}, {d}]")
    if entry.shape != (r,) or entry.dtype not in (torch.int32, torch.int64):
        got = f"{entry.dtype} {tuple(entry.shape)}"
        raise ValueError(f"entry must be an integer tensor of shape [{r}], got {got}")
    if exec_mask.shape != (r,) or exec_mask.dtype != torch.bool:
        got = f"{exec_mask.dtype} {tuple(exec_mask.shape)}"
        raise ValueError(f"exec_mask must be a bool tensor of shape [{r}], got {got}")


def ring_write_kv_triton(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    entry: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    exec_mask: torch.Tensor,
) -> None:
    """Triton version of `ring_write_kv_ref`: same contract, both rings in one launch (any strides)."""
    if triton is None:
        raise RuntimeError("Triton is not installed; use ring_write_kv_ref")
    _check(k_cache, v_cache, entry, k, v, exec_mask)
    if k.dtype != v.dtype or k_cache.dtype != v_cache.dtype:
        raise ValueError(f"k and v ({k.dtype}, {v.dtype}) and their rings must agree in dtype")
    r, h, _, d = k_cache.shape
    if r == 0:
        return
    with on_device(k_cache):
        _ring_write_kv_kernel[(r,)](
            k_cache,
            v_cache,
            k,
            v,
            entry,
            exec_mask,
            h,
            d,
            *k_cache.stride(),
            *v_cache.stride(),
            *k.stride(),
            *v.stride(),
            TO_BF16=k_cache.dtype == torch.bfloat16 and k.dtype == torch.float32,
            BLOCK_H=triton.next_power_of_2(h),
            BLOCK_D=triton.next_power_of_2(d),
            num_warps=4,
        )


def ring_write_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    entry: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    exec_mask: torch.Tensor,
) -> None:
    """Dispatch: the Triton kernel on CUDA, the reference elsewhere. Same contract as the reference."""
    if FUSED and k_cache.is_cuda:
        ring_write_kv_triton(k_cache, v_cache, entry, k, v, exec_mask)
    elif k_cache.is_meta:  # the operator count (benchmarks/step_ops.py): one in-place launch, one write
        k_cache[:0].copy_(k[:0, :, None])
    else:
        ring_write_kv_ref(k_cache, v_cache, entry, k, v, exec_mask)
