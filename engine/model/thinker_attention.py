"""The thinker's attention layer: grouped-query attention without positional encoding over a per-slot ring KV
cache, one position per row (the live form and the slot-index form) or a chunk of positions (prefill).

Knows its ring and the slot contract's two forms (engine/model/slot_state.py); knows nothing of the other
layers, tokens or time.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.config.stage_config import ThinkerConfig
from engine.kernels.decode_attention import decode_attention
from engine.model.joint import JointParams
from engine.model.slot_state import register_slot_state, ring_write

RING_SLICE = 1024  # ring entries a prefill's attention holds at once (per row and KV head)


class Attention(JointParams):
    """Grouped-query attention without positional encoding, over a per-slot ring KV cache of `window` entries.
    q, k and v are one projection (`JointParams`: the checkpoint's three tensors, rows of one).

    With no RoPE the order of cached entries is irrelevant, so position p lives at ring index p % window
    and a conversation never reaches a context limit: it attends to its last `window` positions.
    """

    def __init__(
        self, cfg: ThinkerConfig, state_rows: int, dtype: torch.dtype, kv_dtype: torch.dtype | None = None
    ) -> None:
        super().__init__()
        self.nq, self.nkv, self.d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.window = cfg.attention_window
        self.scale = self.d**-0.5
        self.q_proj = nn.Linear(cfg.hidden_size, self.nq * self.d, bias=False, dtype=dtype)
        self.k_proj = nn.Linear(cfg.hidden_size, self.nkv * self.d, bias=False, dtype=dtype)
        self.v_proj = nn.Linear(cfg.hidden_size, self.nkv * self.d, bias=False, dtype=dtype)
        self.o_proj = nn.Linear(self.nq * self.d, cfg.hidden_size, bias=False, dtype=dtype)
        self.join_params({"qkv": ("q_proj.weight", "k_proj.weight", "v_proj.weight")})
        self.split = (self.nq * self.d, self.nkv * self.d, self.nkv * self.d)
        shape = (state_rows, self.nkv, self.window, self.d)
        kv_dtype = kv_dtype or dtype
        register_slot_state(self, "k_cache", torch.zeros(shape, dtype=kv_dtype))
        register_slot_state(self, "v_cache", torch.zeros(shape, dtype=kv_dtype))

    def _qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [b, hidden] -> q [b, kv, g, d], k and v [b, kv, d], in the cache's dtype (in which attention
        runs; the casts are no-ops when it is x's)."""
        b, kv = x.shape[0], self.k_cache.dtype
        q, k, v = F.linear(x, self.joint("qkv")).split(self.split, dim=-1)
        q = q.view(b, self.nkv, self.nq // self.nkv, self.d).to(kv)
        return q, k.view(b, self.nkv, self.d).to(kv), v.view(b, self.nkv, self.d).to(kv)

    def _out(self, o: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return self.o_proj(o.reshape(x.shape[0], self.nq * self.d).to(x.dtype))

    def step(self, x: torch.Tensor, pos: torch.Tensor, exec_mask: torch.Tensor) -> torch.Tensor:
        """The live form: x [S, hidden], row i on slot i; pos [S] each row's position. Rows outside exec_mask
        [S] keep their ring (`ring_write`)."""
        s = x.shape[0]
        q, k, v = self._qkv(x)
        kc, vc = self.k_cache[:s], self.v_cache[:s]
        ring_write(kc, vc, pos % self.window, k, v, exec_mask)
        # the ring's first min(pos + 1, window) entries hold this row's positions: on CUDA the kernel reads
        # only those, elsewhere the masked reference over the whole ring
        return self._out(decode_attention(q, kc, vc, (pos + 1).clamp_max(self.window), self.scale), x)

    def step_rows(self, x: torch.Tensor, rows: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """The slot-index form: x [b, hidden]; rows [b] the state row of each (padding: the scratch row); pos
        [b] the position of this token. The kernel reads the rows' rings through `rows`, with no copy."""
        q, k, v = self._qkv(x)
        ring = pos % self.window
        self.k_cache[rows, :, ring] = k
        self.v_cache[rows, :, ring] = v
        lengths = (pos + 1).clamp_max(self.window)
        return self._out(decode_attention(q, self.k_cache, self.v_cache, lengths, self.scale, rows=rows), x)

    def prefill(self, x: torch.Tensor, rows: torch.Tensor, pos0: torch.Tensor) -> torch.Tensor:
        """x [b, T, hidden] (T <= window) at positions pos0[b] .. pos0 + T - 1; rows distinct.

        Attention runs flash-style: over the ring in slices of `RING_SLICE` entries, then the chunk's own
        keys, with an online softmax in float32. A forward holds one slice of the rows' rings and its scores
        at a time, never the gathered rings or a [T, window] score matrix per head (gigabytes at 11B)."""
        b, T, _ = x.shape
        g, W = self.nq // self.nkv, self.window
        kv = self.k_cache.dtype  # as in `step`: attention in the cache's dtype, the new keys as it holds them
        q, k, v = F.linear(x, self.joint("qkv")).split(self.split, dim=-1)
        q = q.view(b, T, self.nkv, g, self.d).permute(0, 2, 3, 1, 4).to(kv)  # [b, kv, g, T, d]
        k = k.view(b, T, self.nkv, self.d).transpose(1, 2).to(kv)  # [b, kv, T, d]
        v = v.view(b, T, self.nkv, self.d).transpose(1, 2).to(kv)
        t = torch.arange(T, device=x.device)
        query_pos = pos0[:, None] + t  # [b, T]
        m = torch.full((b, self.nkv, g, T, 1), -torch.inf, device=x.device)
        l_sum = torch.zeros(b, self.nkv, g, T, 1, device=x.device)
        acc = torch.zeros(b, self.nkv, g, T, self.d, device=x.device)

        def attend(keys: torch.Tensor, values: torch.Tensor, visible: torch.Tensor) -> None:
            nonlocal m, l_sum, acc
            s = torch.matmul(q, keys[:, :, None].transpose(-1, -2)).float() * self.scale  # [b, kv, g, T, n]
            s = s.masked_fill(~visible[:, None, None], -torch.inf)
            m_new = torch.maximum(m, s.amax(-1, keepdim=True))
            base = torch.where(m_new == -torch.inf, 0.0, m_new)  # nothing visible yet: no NaN from inf - inf
            p = torch.exp(s - base)
            alpha = torch.exp(m - base)
            l_sum = l_sum * alpha + p.sum(-1, keepdim=True)
            acc = acc * alpha + torch.matmul(p.to(values.dtype), values[:, :, None]).float()
            m = m_new

        for j0 in range(0, W, RING_SLICE):
            j = torch.arange(j0, min(j0 + RING_SLICE, W), device=x.device)
            # position held by ring entry j before this chunk, and whether query t may see it
            held = pos0[:, None] - 1 - torch.remainder(pos0[:, None] - 1 - j, W)  # [b, n]
            see = (held[:, None, :] >= 0) & (held[:, None, :] > query_pos[:, :, None] - W)  # [b, T, n]
            ring = slice(j0, j0 + j.numel())
            attend(
                self.k_cache[:, :, ring].index_select(0, rows),
                self.v_cache[:, :, ring].index_select(0, rows),
                see,
            )
        attend(k, v, (t[None, :, None] >= t[None, None, :]).expand(b, T, T))  # the chunk itself, causal
        out = (acc / l_sum).to(v.dtype)
        write = torch.remainder(query_pos, W)  # [b, T]
        self.k_cache[rows[:, None], :, write] = k.transpose(1, 2)
        self.v_cache[rows[:, None], :, write] = v.transpose(1, 2)
        return self.o_proj(out.permute(0, 3, 1, 2, 4).reshape(b, T, self.nq * self.d).to(x.dtype))
