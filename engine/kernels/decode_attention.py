"""Single-query (decode) attention over per-row KV rings, reading only the entries each row holds.

Knows tensors only. `decode_attention` dispatches to the Triton kernel (`decode_attention_triton`) on CUDA
and to the plain-torch `decode_attention_ref` elsewhere. Triton is imported guarded, so this module imports
(and the reference runs) where Triton is missing. The kernel is flash-decoding: a fixed grid of (row, KV head,
split) programs, each looping over its share of the ring up to the row's own length (read on the device), with
an online softmax in float32; with more than one split a second kernel merges the partial results. No host
syncs and a grid that depends on shapes only, so it can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch

from engine.kernels._triton import jit as _jit
from engine.kernels._triton import on_device, tl, to_bf16_rtne, triton


def decode_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    lengths: torch.Tensor,
    scale: float,
    rows: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Masked attention of one query position per row over the whole ring.

    Shapes (r = rows, hk = KV heads, g = query heads per KV head, n = ring size, d = head dim):
      q [r, hk, g, d], any float dtype (rounded to the cache dtype)
      k_cache, v_cache [r, hk, n, d], one dtype
      lengths [r] int, entries 0..lengths[i]-1 of row i's ring are attended, 1 <= lengths[i] <= n
      rows [r] int64 or None: query row i reads cache row rows[i] (the caches may then have any number of
        rows); None: cache row i
    Returns [r, hk, g, d] in v_cache's dtype, then cast to `out_dtype` where one is given. Scores are a
    matmul in the cache dtype, scaled and soft-maxed in float32; the probabilities are rounded to the cache
    dtype for the value matmul.
    """
    if rows is not None:
        k_cache, v_cache = k_cache.index_select(0, rows), v_cache.index_select(0, rows)
    ring = k_cache.shape[2]
    hidden = (torch.arange(ring, device=k_cache.device) >= lengths[:, None])[:, None, None, :]
    sc = torch.matmul(q.to(k_cache.dtype), k_cache.transpose(2, 3)).float() * scale  # [r, hk, g, n]
    sc = sc.masked_fill(hidden, float("-inf"))
    out = torch.matmul(torch.softmax(sc, dim=-1).to(v_cache.dtype), v_cache)
    return out if out_dtype is None else out.to(out_dtype)


@_jit
def _decode_attention_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    len_ptr,
    rows_ptr,
    out_ptr,
    part_m_ptr,
    part_l_ptr,
    part_acc_ptr,
    group,
    dim,
    ring,
    chunk,
    scale,
    stride_q_r,
    stride_q_h,
    stride_q_g,
    stride_q_d,
    stride_k_r,
    stride_k_h,
    stride_k_n,
    stride_k_d,
    stride_v_r,
    stride_v_h,
    stride_v_n,
    stride_v_d,
    stride_len_r,
    stride_o_r,
    stride_o_h,
    stride_o_g,
    stride_o_d,
    BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    SPLITS: tl.constexpr,
    HAS_ROWS: tl.constexpr,
    KV_BF16: tl.constexpr,
    ROUND_V: tl.constexpr,
):
    # One program per (row, KV head, split); split s covers ring entries [s * chunk, (s + 1) * chunk).
    # With HAS_ROWS, query row `row` reads the caches' row rows_ptr[row].
    row = tl.program_id(0)
    head = tl.program_id(1)
    split = tl.program_id(2)
    heads = tl.num_programs(1)
    offs_g = tl.arange(0, BLOCK_G)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    mask_g = offs_g < group
    mask_d = offs_d < dim

    length = tl.minimum(tl.load(len_ptr + row * stride_len_r).to(tl.int32), ring)
    start = split * chunk
    end = tl.minimum(start + chunk, length)

    q_ptrs = (
        q_ptr
        + row.to(tl.int64) * stride_q_r
        + head * stride_q_h
        + offs_g[:, None] * stride_q_g
        + offs_d[None, :] * stride_q_d
    )
    q = tl.load(q_ptrs, mask=mask_g[:, None] & mask_d[None, :], other=0.0)
    # rounded to the cache dtype to nearest even, as the reference's `to` (the interpreter's cast truncates)
    if KV_BF16:
        q = to_bf16_rtne(q.to(tl.float32)).to(tl.float32)
    else:
        q = q.to(k_ptr.dtype.element_ty).to(tl.float32)
    if HAS_ROWS:  # noqa: SIM108 (a compile-time branch)
        kv_row = tl.load(rows_ptr + row).to(tl.int64)
    else:
        kv_row = row.to(tl.int64)
    k_base = k_ptr + kv_row * stride_k_r + head.to(tl.int64) * stride_k_h
    v_base = v_ptr + kv_row * stride_v_r + head.to(tl.int64) * stride_v_h

    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    # The loop bound is this row's length: entries past it are never loaded.
    for n0 in range(start, end, BLOCK_N):
        offs = n0 + offs_n
        mask_n = offs < end
        mask_kv = mask_n[:, None] & mask_d[None, :]
        k = tl.load(
            k_base + offs[:, None] * stride_k_n + offs_d[None, :] * stride_k_d, mask=mask_kv, other=0.0
        )
        s = tl.sum(q[:, None, :] * k.to(tl.float32)[None, :, :], axis=2) * scale  # [BLOCK_G, BLOCK_N]
        s = tl.where(mask_n[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        v = tl.load(
            v_base + offs[:, None] * stride_v_n + offs_d[None, :] * stride_v_d, mask=mask_kv, other=0.0
        )
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v.to(tl.float32)[None, :, :], axis=1)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        m_i = m_new

    if SPLITS == 1:
        out_ptrs = (
            out_ptr
            + row.to(tl.int64) * stride_o_r
            + head * stride_o_h
            + offs_g[:, None] * stride_o_g
            + offs_d[None, :] * stride_o_d
        )
        out = acc / l_i[:, None]
        if ROUND_V:  # a bf16 ring's output, rounded as the reference's and handed out in fp32
            out = to_bf16_rtne(out).to(tl.float32)
        tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=mask_g[:, None] & mask_d[None, :])
    else:
        # Partials, contiguous [r, hk, SPLITS, BLOCK_G] (m, l) and [r, hk, SPLITS, BLOCK_G, BLOCK_D] (acc);
        # an empty split leaves m = -inf, l = 0, acc = 0, which the merge weighs as nothing.
        part = (row.to(tl.int64) * heads + head) * SPLITS + split
        tl.store(part_m_ptr + part * BLOCK_G + offs_g, m_i)
        tl.store(part_l_ptr + part * BLOCK_G + offs_g, l_i)
        acc_ptrs = part_acc_ptr + part * BLOCK_G * BLOCK_D + offs_g[:, None] * BLOCK_D + offs_d[None, :]
        tl.store(acc_ptrs, acc)


@_jit
def _decode_attention_merge_kernel(
    part_m_ptr,
    part_l_ptr,
    part_acc_ptr,
    out_ptr,
    group,
    dim,
    stride_o_r,
    stride_o_h,
    stride_o_g,
    stride_o_d,
    SPLITS: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_D: tl.constexpr,
    ROUND_V: tl.constexpr,
):
    # One program per (row, KV head): rescale each split's partial sums to the common maximum and add them.
    row = tl.program_id(0)
    head = tl.program_id(1)
    heads = tl.num_programs(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    mask_s = offs_s < SPLITS
    base = (row.to(tl.int64) * heads + head) * SPLITS
    ml_offs = (base + offs_s[:, None]) * BLOCK_G + offs_g[None, :]  # [BLOCK_S, BLOCK_G]
    m = tl.load(part_m_ptr + ml_offs, mask=mask_s[:, None], other=float("-inf"))
    l_part = tl.load(part_l_ptr + ml_offs, mask=mask_s[:, None], other=0.0)
    acc_offs = ml_offs[:, :, None] * BLOCK_D + offs_d[None, None, :]  # [BLOCK_S, BLOCK_G, BLOCK_D]
    acc = tl.load(part_acc_ptr + acc_offs, mask=mask_s[:, None, None], other=0.0)
    m_max = tl.max(m, axis=0)  # [BLOCK_G]
    w = tl.exp(m - m_max[None, :])  # an empty split: exp(-inf) = 0
    l_sum = tl.sum(w * l_part, axis=0)
    out = tl.sum(w[:, :, None] * acc, axis=0) / l_sum[:, None]
    out_ptrs = (
        out_ptr
        + row.to(tl.int64) * stride_o_r
        + head * stride_o_h
        + offs_g[:, None] * stride_o_g
        + offs_d[None, :] * stride_o_d
    )
    mask = (offs_g < group)[:, None] & (offs_d < dim)[None, :]
    if ROUND_V:
        out = to_bf16_rtne(out).to(tl.float32)
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=mask)


def _num_splits(rows: int, heads: int, ring: int, block_n: int, device: torch.device) -> int:
    """Splits of the ring per (row, head): enough programs to fill the device, each split at least four
    blocks long. Depends on shapes and the device only, so a captured graph keeps its grid."""
    if device.type == "cuda":
        programs = 8 * torch.cuda.get_device_properties(device).multi_processor_count
    else:
        programs = 1
    want = triton.cdiv(programs, rows * heads)
    return max(1, min(want, triton.cdiv(ring, 4 * block_n)))


def decode_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    lengths: torch.Tensor,
    scale: float,
    splits: int | None = None,
    rows: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Triton version of `decode_attention_ref`: same contract, cost proportional to each row's length.

    Shapes (r = rows, hk = KV heads, g = query heads per KV head, n = ring size, d = head dim):
      q [r, hk, g, d] fp32 or bf16 (any strides), rounded to the cache dtype
      k_cache, v_cache [r, hk, n, d] fp32 or bf16, one dtype (any strides); with `rows`, [R, hk, n, d]
      lengths [r] int32 or int64 on q's device, 1 <= lengths[i] <= n (clamped to n on the device)
      splits: ring splits per (row, head), None for the device's default; 1 runs a single kernel
      rows [r] int64 on q's device or None: query row i reads cache row rows[i] (0 <= rows[i] < R), with no
        gathered copy of the caches
    out_dtype: None for v_cache's dtype; fp32 for a bf16 ring rounds to bf16 first, as the reference does
    Returns [r, hk, g, d] in out_dtype. Dot products, softmax and the weighted sum are float32 (the
    reference rounds scores and probabilities to the cache dtype). Only entries 0..lengths[i]-1 are read.
    """
    if triton is None:
        raise RuntimeError("Triton is not installed; use decode_attention_ref")
    r, hk, g, d = q.shape
    if rows is not None and (rows.shape != (r,) or rows.dtype != torch.int64):
        raise ValueError(f"rows must be int64 [{r}], got {rows.dtype} {tuple(rows.shape)}")
    cache_rows = k_cache.shape[0] if rows is not None else r
    if (
        k_cache.dim() != 4
        or k_cache.shape[0] != cache_rows
        or k_cache.shape[1] != hk
        or k_cache.shape[3] != d
    ):
        raise ValueError(f"k_cache {tuple(k_cache.shape)} does not match q {tuple(q.shape)}")
    if v_cache.shape != k_cache.shape or v_cache.dtype != k_cache.dtype:
        raise ValueError(f"v_cache {v_cache.dtype} {tuple(v_cache.shape)} must match k_cache")
    if lengths.shape != (r,) or lengths.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"lengths must be int32/int64 [{r}], got {lengths.dtype} {tuple(lengths.shape)}")
    out_dtype = out_dtype or v_cache.dtype
    round_v = v_cache.dtype == torch.bfloat16 and out_dtype == torch.float32
    ring = k_cache.shape[2]
    out = torch.empty(r, hk, g, d, dtype=out_dtype, device=q.device)
    if out.numel() == 0:
        return out
    block_g = triton.next_power_of_2(g)
    block_d = triton.next_power_of_2(d)
    block_n = max(16, 64 // block_g)
    if splits is None:
        splits = _num_splits(r, hk, ring, block_n, q.device)
    chunk = triton.cdiv(triton.cdiv(ring, splits), block_n) * block_n
    splits = triton.cdiv(ring, chunk)  # no split starts past the ring
    if splits > 1:
        part_m = torch.empty(r, hk, splits, block_g, dtype=torch.float32, device=q.device)
        part_l = torch.empty_like(part_m)
        part_acc = torch.empty(r, hk, splits, block_g, block_d, dtype=torch.float32, device=q.device)
    else:
        part_m = part_l = part_acc = out  # not written
    with on_device(q):
        _decode_attention_kernel[(r, hk, splits)](
            q,
            k_cache,
            v_cache,
            lengths,
            lengths if rows is None else rows,  # not read without rows
            out,
            part_m,
            part_l,
            part_acc,
            g,
            d,
            ring,
            chunk,
            float(scale),
            *q.stride(),
            *k_cache.stride(),
            *v_cache.stride(),
            lengths.stride(0),
            *out.stride(),
            BLOCK_G=block_g,
            BLOCK_N=block_n,
            BLOCK_D=block_d,
            SPLITS=splits,
            HAS_ROWS=rows is not None,
            KV_BF16=k_cache.dtype == torch.bfloat16,
            ROUND_V=round_v,
            num_warps=4,
        )
        if splits > 1:
            _decode_attention_merge_kernel[(r, hk)](
                part_m,
                part_l,
                part_acc,
                out,
                g,
                d,
                *out.stride(),
                SPLITS=splits,
                BLOCK_S=triton.next_power_of_2(splits),
                BLOCK_G=block_g,
                BLOCK_D=block_d,
                ROUND_V=round_v,
                num_warps=4,
            )
    return out


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    lengths: torch.Tensor,
    scale: float,
    rows: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Dispatch: the Triton kernel on CUDA, the reference elsewhere. Same contract as the reference. On the
    meta device (memory planning, engine/memory.py) the kernel's output alone, as the kernel allocates
    it."""
    if triton is not None and q.is_cuda:
        return decode_attention_triton(q, k_cache, v_cache, lengths, scale, rows=rows, out_dtype=out_dtype)
    if q.is_meta:
        return torch.empty(q.shape, dtype=out_dtype or v_cache.dtype, device=q.device)
    return decode_attention_ref(q, k_cache, v_cache, lengths, scale, rows, out_dtype)
