"""The talker's backbone: a Gemma3 stack over per-slot ring KV caches (a sliding or a full ring per layer),
one position per row of the live batch, and the causal pass that fills the speaker warm-up's KV templates.

Knows its layers, RoPE and rings, and the slot contract's live form (engine/model/slot_state.py); knows
nothing of text, codes, sampling, sessions or time.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from engine.config.stage_config import TalkerConfig
from engine.kernels.add_rms_norm import add_rms_norm
from engine.kernels.decode_attention import decode_attention
from engine.kernels.qk_norm_rope import qk_norm_rope
from engine.kernels.reset_rows import reset_rows
from engine.model.joint import JointParams
from engine.model.slot_state import register_slot_state, ring_write
from engine.model.talker_heads import (
    GatedMLP,
    GemmaRMSNorm,
    apply_rope,
    rope_cos_sin,
    rope_inv_freq,
    rotate_half_tables,
)


class Attention(JointParams):
    """One layer's attention projections and q/k norms; q, k and v are one projection (`JointParams`: the
    checkpoint's three tensors, rows of one)."""

    def __init__(self, cfg: TalkerConfig) -> None:
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.q_proj = nn.Linear(h, cfg.num_heads * d, bias=False)
        self.k_proj = nn.Linear(h, cfg.num_kv_heads * d, bias=False)
        self.v_proj = nn.Linear(h, cfg.num_kv_heads * d, bias=False)
        self.o_proj = nn.Linear(cfg.num_heads * d, h, bias=False)
        self.q_norm = GemmaRMSNorm(d, cfg.rms_eps)
        self.k_norm = GemmaRMSNorm(d, cfg.rms_eps)
        self.split = (cfg.num_heads * d, cfg.num_kv_heads * d, cfg.num_kv_heads * d)
        self.join_params({"qkv": ("q_proj.weight", "k_proj.weight", "v_proj.weight")})

    def project(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        return F.linear(x, self.joint("qkv")).split(self.split, dim=-1)


class Layer(nn.Module):
    def __init__(self, cfg: TalkerConfig) -> None:
        super().__init__()
        h = cfg.hidden_size
        self.self_attn = Attention(cfg)
        self.mlp = GatedMLP(h, cfg.intermediate_size)
        self.input_layernorm = GemmaRMSNorm(h, cfg.rms_eps)
        self.post_attention_layernorm = GemmaRMSNorm(h, cfg.rms_eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(h, cfg.rms_eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(h, cfg.rms_eps)


class TalkerBackbone(nn.Module):
    """`tts_model.tts_model.backbone`: the layers and the final norm, in `dtype`, with each layer's per-slot
    KV ring `[num_slots, streams, kv_heads, ring, head_dim]` in `kv_dtype` and its warm-up template
    `[streams, kv_heads, warmup_positions, head_dim]` (one for every slot, not per-slot state)."""

    def __init__(
        self, cfg: TalkerConfig, num_slots: int, streams: int, dtype: torch.dtype, kv_dtype: torch.dtype
    ) -> None:
        super().__init__()
        self.cfg = cfg
        self.layers = nn.ModuleList(Layer(cfg) for _ in range(cfg.num_layers))
        self.norm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_eps)
        self.to(dtype)  # the weights (and their fused copies) only: the buffers below keep their dtypes

        def buf(name: str, t: Tensor) -> None:
            self.register_buffer(name, t, persistent=False)

        self.rings = [cfg.sliding_window if t == "sliding" else cfg.attention_window for t in cfg.layer_types]
        kv, hd, w = cfg.num_kv_heads, cfg.head_dim, cfg.warmup_positions
        for i, ring in enumerate(self.rings):
            register_slot_state(
                self, f"k_cache{i}", torch.zeros(num_slots, streams, kv, ring, hd, dtype=kv_dtype)
            )
            register_slot_state(
                self, f"v_cache{i}", torch.zeros(num_slots, streams, kv, ring, hd, dtype=kv_dtype)
            )
            buf(f"warm_k{i}", torch.zeros(streams, kv, w, hd, dtype=kv_dtype))
            buf(f"warm_v{i}", torch.zeros(streams, kv, w, hd, dtype=kv_dtype))
        for t in set(cfg.layer_types):
            theta = cfg.rope_local_theta if t == "sliding" else cfg.rope_theta
            buf(f"inv_freq_{t}", rope_inv_freq(hd, theta))
        perm, sign = rotate_half_tables(hd)
        buf("rope_perm", perm)
        buf("rope_sign", sign)

    def caches(self, i: int) -> tuple[Tensor, Tensor]:
        return getattr(self, f"k_cache{i}"), getattr(self, f"v_cache{i}")

    def reset(self, mask: Tensor) -> None:
        """The rings of the masked slots ([num_slots] bool) as a fresh slot's: the warm-up, then zeros. No
        host sync, and on CUDA only the masked slots' rings are written (`reset_rows`)."""
        for i in range(len(self.rings)):
            for kind, cache in zip(("k", "v"), self.caches(i), strict=True):
                warm = getattr(self, f"warm_{kind}{i}")
                reset_rows(cache.flatten(1, 2), mask, warm.flatten(0, 1))

    def prefill_warmup(self, x: Tensor) -> None:
        """Causal multi-position pass over `x` `[S, T, h]` (T <= every ring) into the warm-up KV templates."""
        cfg = self.cfg
        s, t, _ = x.shape
        hq, hk, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        pos = torch.arange(t, device=x.device)
        causal = pos[None, :] <= pos[:, None]
        kvd = self.warm_k0.dtype
        for i, layer in enumerate(self.layers):
            a = layer.self_attn
            cos, sin = rope_cos_sin(pos, getattr(self, f"inv_freq_{cfg.layer_types[i]}"))
            q, k, v = a.project(layer.input_layernorm(x))
            # attention in the KV dtype, as the step runs it over these cached entries
            q = apply_rope(a.q_norm(q.reshape(s, t, hq, d)).transpose(1, 2), cos, sin).to(kvd)
            k = apply_rope(a.k_norm(k.reshape(s, t, hk, d)).transpose(1, 2), cos, sin).to(kvd)
            v = v.reshape(s, t, hk, d).transpose(1, 2).to(kvd)
            getattr(self, f"warm_k{i}").copy_(k)
            getattr(self, f"warm_v{i}").copy_(v)
            kk = k.repeat_interleave(hq // hk, dim=1)
            vv = v.repeat_interleave(hq // hk, dim=1)
            sc = torch.matmul(q, kk.transpose(2, 3)).float() * cfg.query_pre_attn_scalar**-0.5
            p = torch.softmax(sc.masked_fill(~causal, float("-inf")), dim=-1).to(kvd)
            o = torch.matmul(p, vv).transpose(1, 2).reshape(s, t, hq * d).to(x.dtype)
            x = x + layer.post_attention_layernorm(a.o_proj(o))
            x = x + layer.post_feedforward_layernorm(layer.mlp(layer.pre_feedforward_layernorm(x)))

    def step(self, x: Tensor, pos: Tensor, exec_rows: Tensor) -> Tensor:
        """The live form, one position per row: x [r, h] (r = slots x streams, slot-major), pos [r] each row's
        position, exec_rows [r] bool. Rows outside exec_rows keep their rings (`ring_write`). Returns the
        final hidden [r, h]; positions are the caller's to advance."""
        cfg = self.cfg
        r = x.shape[0]
        hq, hk, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        rope = {}
        for t in set(cfg.layer_types):
            cos, sin = rope_cos_sin(pos, getattr(self, f"inv_freq_{t}"))
            rope[t] = cos[:, None, :], (sin * self.rope_sign)[:, None, :]
        scale = cfg.query_pre_attn_scalar**-0.5
        # per ring size: the ring index written this step and how many entries hold a position (incl. it)
        entry = {ring: pos % ring for ring in set(self.rings)}
        filled = {ring: (pos + 1).clamp_max(ring) for ring in set(self.rings)}
        eps = self.norm.eps
        # each residual join and the norm after it (the next layer's input norm, or the final one) run as one
        # kernel on CUDA (add_rms_norm)
        h = self.layers[0].input_layernorm(x)
        for i, layer in enumerate(self.layers):
            a, ring = layer.self_attn, self.rings[i]
            cos, sin = rope[cfg.layer_types[i]]
            q, k, v = a.project(h)
            # queries and keys normed and rotated as one tensor, in one kernel on CUDA
            qk = qk_norm_rope(
                q.reshape(r, hq, d),
                k.reshape(r, hk, d),
                a.q_norm.scale,
                a.k_norm.scale,
                a.q_norm.eps,
                cos,
                sin,
                self.rope_perm,
            )
            q, k = qk[:, :hq], qk[:, hq:]
            v = v.reshape(r, hk, d)
            kc, vc = (c.view(r, hk, ring, d) for c in self.caches(i))
            # attention runs in the KV dtype: no copy of the ring in another dtype (no-ops when they agree)
            ring_write(kc, vc, entry[ring], k, v, exec_rows)
            # the queries rounded to the ring's dtype and the output cast back to x's inside decode_attention
            qg = q.view(r, hk, hq // hk, d)
            o = decode_attention(qg, kc, vc, filled[ring], scale, out_dtype=x.dtype).view(r, hq * d)
            post, pre = layer.post_attention_layernorm, layer.pre_feedforward_layernorm
            x, h = add_rms_norm(x, a.o_proj(o), post.scale, pre.scale, eps)
            after = self.layers[i + 1].input_layernorm if i + 1 < len(self.layers) else self.norm
            x, h = add_rms_norm(x, layer.mlp(h), layer.post_feedforward_layernorm.scale, after.scale, eps)
        return h
