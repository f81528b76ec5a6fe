"""Reset of the masked slots' rows of a slot-first state buffer: each masked slot's row becomes a fresh one
(an optional template in the first entries along its ring axis, zeros elsewhere); no other slot's row is
touched.

Knows tensors only. `reset_rows` dispatches to the Triton kernel (`reset_rows_triton`) on CUDA and to the
plain-torch `reset_rows_ref` elsewhere. The kernel reads the mask on the device: a fixed grid of (slot, split)
programs, of which those of an unmasked slot return at once, so a reset writes the reset slots' bytes only,
with no host sync and no pass over the other slots' rows (gigabytes of KV rings at the release windows).
"""

from __future__ import annotations

import torch

from engine.kernels._triton import jit as _jit
from engine.kernels._triton import on_device, tl, triton


def reset_rows_ref(state: torch.Tensor, mask: torch.Tensor, head: torch.Tensor | None = None) -> None:
    """state[i] = a fresh row for every slot i where mask[i], in place.

    Shapes (S = slots): state [S, ...]; mask [S] bool; head None (the fresh row is zeros) or [A, H, D] in
    state's dtype with state [S, A, R, D] and H <= R (the fresh row is head in its first H entries along R,
    zeros after).
    """
    state.masked_fill_(mask.view(-1, *([1] * (state.dim() - 1))), 0)
    if head is not None:
        first = state[:, :, : head.shape[1]]
        torch.where(mask.view(-1, 1, 1, 1), head, first, out=first)


@_jit
def _reset_rows_kernel(
    state_ptr,
    head_ptr,
    mask_ptr,
    row,
    inner,
    ring,
    head_len,
    chunk,
    stride_slot,
    HAS_HEAD: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # One program per (slot, split); split s writes elements [s * chunk, (s + 1) * chunk) of the slot's row.
    slot = tl.program_id(0)
    split = tl.program_id(1)
    if tl.load(mask_ptr + slot) == 0:  # not reset: no access to its row at all
        return
    base = state_ptr + slot.to(tl.int64) * stride_slot
    start = split.to(tl.int64) * chunk
    for off in range(0, chunk, BLOCK):
        offs = start + off + tl.arange(0, BLOCK)
        inside = offs < row
        if HAS_HEAD:
            d = offs % inner
            r = (offs // inner) % ring
            a = offs // (inner * ring)
            in_head = inside & (r < head_len)
            val = tl.load(head_ptr + (a * head_len + r) * inner + d, mask=in_head, other=0.0)
        else:
            val = tl.zeros([BLOCK], dtype=state_ptr.dtype.element_ty)
        tl.store(base + offs, val.to(state_ptr.dtype.element_ty), mask=inside)


def reset_rows_triton(state: torch.Tensor, mask: torch.Tensor, head: torch.Tensor | None = None) -> None:
    """Triton version of `reset_rows_ref`: same contract, one program per (slot, split of its row).

    Shapes as the reference's; each slot's row of `state` must be contiguous (any slot stride), `head`
    contiguous. A slot outside the mask is neither read nor written.
    """
    if triton is None:
        raise RuntimeError("Triton is not installed; use reset_rows_ref")
    s = state.shape[0]
    if mask.shape != (s,) or mask.dtype != torch.bool:
        raise ValueError(f"mask must be a bool tensor of shape [{s}], got {mask.dtype} {tuple(mask.shape)}")
    if not state[0].is_contiguous():
        raise ValueError("state: each slot's row must be contiguous")
    row = state[0].numel()
    if head is not None:
        if state.dim() != 4 or head.dim() != 3 or head.shape[0] != state.shape[1]:
            raise ValueError(
                f"head {tuple(head.shape)} must be [A, H, D] for state [S, A, R, D] {tuple(state.shape)}"
            )
        if head.shape[1] > state.shape[2] or head.shape[2] != state.shape[3] or head.dtype != state.dtype:
            raise ValueError(f"head {tuple(head.shape)} {head.dtype} does not fit state {tuple(state.shape)}")
        head = head.contiguous()
        inner, ring, head_len = state.shape[3], state.shape[2], head.shape[1]
    else:
        inner, ring, head_len = 1, 1, 0
    if s == 0 or row == 0:
        return
    block = 1024
    splits = min(triton.cdiv(row, block), 64)
    chunk = triton.cdiv(triton.cdiv(row, splits), block) * block
    with on_device(state):
        _reset_rows_kernel[(s, splits)](
            state,
            head if head is not None else state,  # not read without a head
            mask,
            row,
            inner,
            ring,
            head_len,
            chunk,
            state.stride(0),
            HAS_HEAD=head is not None,
            BLOCK=block,
            num_warps=4,
        )


def reset_rows(state: torch.Tensor, mask: torch.Tensor, head: torch.Tensor | None = None) -> None:
    """Dispatch: the Triton kernel on CUDA, the reference elsewhere. Same contract as the reference."""
    if triton is not None and state.is_cuda:
        reset_rows_triton(state, mask, head)
    elif not state.is_meta:
        reset_rows_ref(state, mask, head)
