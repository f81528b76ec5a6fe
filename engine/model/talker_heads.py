"""Building blocks of the talker around its backbone: character-aware subword encoder, gated fusion,
MoG head, the unmasking schedule and the counter-based per-slot noise.

Module and parameter names follow NeMo's `ear_tts_model` so the release checkpoint loads by name.
Knows nothing about slots, caches or the clock; `engine/model/talker.py` assembles these.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from engine.config.stage_config import TalkerConfig
from engine.kernels.gelu_mul import gelu_mul
from engine.model.joint import JointParams

_MASK32 = 0xFFFFFFFF


class GemmaRMSNorm(nn.Module):
    """Gemma RMSNorm: `x / rms(x) * (1 + w)`, computed in fp32."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))
        # `1 + weight` in fp32, rebuilt by `fuse()` whenever the weights change
        self.register_buffer("scale", torch.ones(dim), persistent=False)

    @torch.no_grad()
    def fuse(self) -> None:
        self.scale.copy_(1.0 + self.weight.float())

    def forward(self, x: Tensor) -> Tensor:
        if x.dtype == torch.float32:
            return F.rms_norm(x, (x.shape[-1],), self.scale, self.eps)
        return F.rms_norm(x.float(), (x.shape[-1],), self.scale, self.eps).type_as(x)


class GatedMLP(JointParams):
    """`down(gelu_tanh(gate(x)) * up(x))`, no bias; gate and up are one projection (`JointParams`)."""

    def __init__(self, hidden: int, inner: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inner, bias=False)
        self.up_proj = nn.Linear(hidden, inner, bias=False)
        self.down_proj = nn.Linear(inner, hidden, bias=False)
        self.join_params({"gate_up": ("gate_proj.weight", "up_proj.weight")})

    def forward(self, x: Tensor) -> Tensor:
        # the GELU and the product: one kernel on CUDA
        return self.down_proj(gelu_mul(F.linear(x, self.joint("gate_up"))))


def rope_inv_freq(head_dim: int, theta: float, device: torch.device | str | None = None) -> Tensor:
    """transformers' default RoPE inverse frequencies `[head_dim / 2]` (fp32)."""
    exponent = torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim
    return 1.0 / (theta**exponent)


def rope_cos_sin(pos: Tensor, inv_freq: Tensor) -> tuple[Tensor, Tensor]:
    """cos/sin `[..., head_dim]` for integer positions `pos`, computed as transformers does (fp32)."""
    freqs = pos.float().unsqueeze(-1) * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate-half RoPE; `cos`/`sin` broadcast against `x` (`[..., head_dim]`)."""
    half = x.shape[-1] // 2
    rot = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rot * sin


def rotate_half_tables(head_dim: int) -> tuple[Tensor, Tensor]:
    """(permutation, sign) with `x[..., perm] * sign == rotate_half(x)` exactly."""
    half = head_dim // 2
    perm = torch.cat([torch.arange(half, head_dim), torch.arange(half)])
    return perm, torch.cat([-torch.ones(half), torch.ones(half)])


def apply_rope_fast(x: Tensor, cos: Tensor, signed_sin: Tensor, perm: Tensor) -> Tensor:
    """`apply_rope` with the rotation as one gather; `signed_sin = sign * sin` (exact, a sign flip)."""
    return x * cos + x.index_select(-1, perm) * signed_sin


# ---------------------------------------------------------------- character-aware subword encoder


class _CharAttention(nn.Module):
    def __init__(self, cfg: TalkerConfig) -> None:
        super().__init__()
        h, d = cfg.char_hidden_size, cfg.char_head_dim
        self.q_proj = nn.Linear(h, cfg.char_heads * d, bias=False)
        self.k_proj = nn.Linear(h, cfg.char_kv_heads * d, bias=False)
        self.v_proj = nn.Linear(h, cfg.char_kv_heads * d, bias=False)
        self.o_proj = nn.Linear(cfg.char_heads * d, h, bias=False)


class _CharLayer(nn.Module):
    def __init__(self, cfg: TalkerConfig) -> None:
        super().__init__()
        h = cfg.char_hidden_size
        self.self_attn = _CharAttention(cfg)
        self.pre_self_attn_layernorm = GemmaRMSNorm(h, cfg.rms_eps)
        self.post_self_attn_layernorm = GemmaRMSNorm(h, cfg.rms_eps)
        self.mlp = GatedMLP(h, cfg.char_intermediate_size)
        self.pre_feedforward_layernorm = GemmaRMSNorm(h, cfg.rms_eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(h, cfg.rms_eps)


class _CharStack(nn.Module):
    def __init__(self, cfg: TalkerConfig) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_CharLayer(cfg) for _ in range(cfg.char_layers))
        self.norm = GemmaRMSNorm(cfg.char_hidden_size, cfg.rms_eps)


class _CharBackbone(nn.Module):
    def __init__(self, cfg: TalkerConfig) -> None:
        super().__init__()
        self.encoder = _CharStack(cfg)


class _FlagEmbedding(nn.Module):
    """Subword-continuation flag (0 word start, 1 continuation) per token id; the last row is padding."""

    def __init__(self, vocab_size: int, dim: int) -> None:
        super().__init__()
        self.register_buffer("pad_tensor", torch.tensor(vocab_size, dtype=torch.long))
        self.register_buffer("is_continuation", torch.zeros(vocab_size + 1, dtype=torch.long))
        self.cont_emb = nn.Embedding(2, dim)


class _BosEosEmbedding(nn.Module):
    """BOS (1) / EOS (2) / other (0) flag per token id. NeMo's table covers ids below the largest id only."""

    def __init__(self, vocab_size: int, dim: int) -> None:
        super().__init__()
        self.register_buffer("pad_tensor", torch.tensor(vocab_size - 1, dtype=torch.long))
        self.register_buffer("special_flags", torch.zeros(vocab_size, dtype=torch.long))
        self.special_emb = nn.Embedding(3, dim)


class CharAwareSubwordEncoder(nn.Module):
    """A token id -> the mean over its characters of a bidirectional char encoder -> Linear, plus the
    continuation-flag and BOS/EOS embeddings. It depends on the token id only, so the talker evaluates it
    once per vocabulary entry (`table`) instead of every frame."""

    def __init__(self, cfg: TalkerConfig, out_size: int) -> None:
        super().__init__()
        self.cfg = cfg
        self.backbone = _CharBackbone(cfg)
        c = cfg.char_vocab_size
        self.embed_tokens = nn.Embedding(c + 1, cfg.char_hidden_size, padding_idx=c)
        self.proj_embedding = nn.Linear(cfg.char_hidden_size, out_size, bias=False)
        self.subword_flag_emb = _FlagEmbedding(cfg.vocab_size, cfg.char_hidden_size)
        self.bos_eos_emb = _BosEosEmbedding(cfg.vocab_size, cfg.char_hidden_size)

    def encode_chars(self, chars: Tensor) -> Tensor:
        """`chars` `[n, L]` char ids (all valid, same length) -> pooled subword embedding `[n, out]`."""
        cfg = self.cfg
        x = self.embed_tokens(chars)
        x = x * torch.tensor(cfg.char_hidden_size**0.5, dtype=x.dtype)
        n, length, _ = x.shape
        inv_freq = rope_inv_freq(cfg.char_head_dim, cfg.char_rope_theta, x.device)
        cos, sin = rope_cos_sin(torch.arange(length, device=x.device), inv_freq)
        d, hq, hk = cfg.char_head_dim, cfg.char_heads, cfg.char_kv_heads
        for layer in self.backbone.encoder.layers:
            a = layer.self_attn
            h = layer.pre_self_attn_layernorm(x)
            q = apply_rope(a.q_proj(h).view(n, length, hq, d).transpose(1, 2), cos, sin)
            k = apply_rope(a.k_proj(h).view(n, length, hk, d).transpose(1, 2), cos, sin)
            v = a.v_proj(h).view(n, length, hk, d).transpose(1, 2)
            k = k.repeat_interleave(hq // hk, dim=1)
            v = v.repeat_interleave(hq // hk, dim=1)
            s = torch.matmul(q, k.transpose(2, 3)) * cfg.char_query_pre_attn_scalar**-0.5
            s = torch.tanh(s / cfg.char_softcap) * cfg.char_softcap
            p = torch.softmax(s, dim=-1, dtype=torch.float32).to(q.dtype)
            o = torch.matmul(p, v).transpose(1, 2).reshape(n, length, hq * d)
            x = x + layer.post_self_attn_layernorm(a.o_proj(o))
            x = x + layer.post_feedforward_layernorm(layer.mlp(layer.pre_feedforward_layernorm(x)))
        x = self.backbone.encoder.norm(x)
        return self.proj_embedding(x.sum(1) / length)

    @torch.no_grad()
    def table(self, token_chars: list[list[int]], out: Tensor | None = None) -> Tensor:
        """`[vocab, out]`: the conditioning vector of every token id (tokens grouped by length, no padding),
        written into `out` when given. Works in chunks of rows: no temporary as large as the table."""
        vocab = len(token_chars)
        w = self.proj_embedding.weight
        if out is None:
            out = torch.empty(vocab, w.shape[0], dtype=w.dtype, device=w.device)
        out.zero_()
        by_len: dict[int, list[int]] = {}
        for tid, chars in enumerate(token_chars):
            if chars:
                by_len.setdefault(len(chars), []).append(tid)
        for _, ids in sorted(by_len.items()):
            for i in range(0, len(ids), 4096):
                chunk = ids[i : i + 4096]
                chars = torch.tensor([token_chars[t] for t in chunk], dtype=torch.long, device=w.device)
                out[torch.tensor(chunk, device=w.device)] = self.encode_chars(chars)
        cont = self.subword_flag_emb.is_continuation
        flags = self.bos_eos_emb.special_flags
        for first in range(0, vocab, 16384):
            ids = torch.arange(first, min(vocab, first + 16384), device=w.device)
            part = out[first : first + ids.numel()]
            part += self.subword_flag_emb.cont_emb.weight[cont[ids.clamp_max(cont.numel() - 1)]]
            safe = torch.where(ids >= flags.numel() - 1, flags.numel() - 1, ids)
            part += self.bos_eos_emb.special_emb.weight[flags[safe]]
        return out


def token_chars_and_flags(
    vocab: dict[str, int], vocab_size: int, bos: str, eos: str
) -> tuple[list[list[int]], list[int], list[int], int]:
    """NeMo's `build_vocabs` and flag tables from a token -> id map (added tokens included).

    The character vocabulary is the single-character tokens ordered by id; a token maps to the ids of
    those of its characters that are in it (others are dropped, as NeMo does). Returns (chars per id,
    continuation flags `[vocab + 1]`, BOS/EOS flags `[vocab]`, number of characters).
    """
    singles = sorted((i, s) for s, i in vocab.items() if len(s) == 1)
    char_id = {s: n for n, (_, s) in enumerate(singles)}
    by_id = {i: s for s, i in vocab.items()}
    chars = [[char_id[c] for c in by_id.get(t, "") if c in char_id] for t in range(vocab_size)]
    cont = [0 if by_id.get(t, "<").startswith(("Ġ", "▁", "<")) else 1 for t in range(vocab_size)] + [0]
    special = [
        1 if by_id.get(t) == bos else 2 if by_id.get(t) == eos else 0 for t in range(vocab_size - 1)
    ] + [0]
    return chars, cont, special, len(singles)


# ---------------------------------------------------------------- fusion and MoG head


# The divisor of the summed code embeddings, whatever the codebook count. NeMo 3.0.0's `RVQEARTTSModel` builds
# `GatedProjectedSumRMSNorm(hidden, hidden, hidden, num_quantizers)`: the count lands in the `final_norm`
# position (truthy: the norm is on) and `num_codebooks` keeps its default of 31. The release was trained
# through that code, so the sum is divided by 31 at any count (at the release's 31 the two agree).
NEMO_AUDIO_DIVISOR = 31


class GatedProjectedSumRMSNorm(nn.Module):
    """`GemmaRMSNorm(sig(r) * (sig(g) * audio_proj(a / 31) + (1 - sig(g)) * text_proj(c)))` (31:
    NEMO_AUDIO_DIVISOR, not the codebook count)."""

    def __init__(self, hidden: int, num_codebooks: int, eps: float) -> None:
        super().__init__()
        self.num_codebooks = num_codebooks
        self.divisor = NEMO_AUDIO_DIVISOR
        self.audio_proj = nn.Linear(hidden, hidden)
        self.text_proj = nn.Linear(hidden, hidden)
        self.gate = nn.Parameter(torch.zeros(hidden))
        self.residual_scale = nn.Parameter(torch.tensor(0.5))
        self.final_norm = GemmaRMSNorm(hidden, eps)

    def forward(self, audio: Tensor, text: Tensor) -> Tensor:
        a = self.audio_proj(audio / self.divisor)
        c = self.text_proj(text)
        g = torch.sigmoid(self.gate)
        h = torch.sigmoid(self.residual_scale) * (g * a + (1 - g) * c)
        return self.final_norm(h)


class MLPLayer(nn.Module):
    def __init__(self, hidden: int, inner: int, eps: float) -> None:
        super().__init__()
        self.pre_norm = GemmaRMSNorm(hidden, eps)
        self.mlp = GatedMLP(hidden, inner)
        self.post_norm = GemmaRMSNorm(hidden, eps)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.post_norm(self.mlp(self.pre_norm(x)))


class MoGHead(nn.Module):
    """Mixture-of-Gaussians head: residual MLP stack -> component logits; the picked component's mean
    (low-rank `low_mat[k] @ proj_mus[k] x`, scaled by `exp(log_std)`) plus `proj_else x`."""

    def __init__(self, cfg: TalkerConfig) -> None:
        super().__init__()
        h, n, r = cfg.hidden_size, cfg.mog_components, cfg.mog_rank
        self.cfg = cfg
        self.mlp_stack = nn.Sequential(
            *[MLPLayer(h, cfg.mog_intermediate_size, cfg.rms_eps) for _ in range(cfg.mog_layers)],
            GemmaRMSNorm(h, cfg.rms_eps),
        )
        self.proj_logits = nn.Linear(h, n, bias=False)
        self.proj_mus = nn.Linear(h, n * r, bias=False)
        self.proj_logs = nn.Linear(h, 1, bias=False)
        self.proj_else = nn.Linear(h, cfg.latent_dim, bias=False)
        self.low_mat = nn.Parameter(torch.randn(n, cfg.latent_dim, r) * r**-0.5)


def top_p_filter(logits: Tensor, top_p: float) -> Tensor:
    """transformers' `TopPLogitsWarper`: drop the low tail whose mass is at most `1 - top_p` (keep >= 1)."""
    sorted_logits, idx = torch.sort(logits, descending=False)
    remove = sorted_logits.softmax(dim=-1).cumsum(dim=-1) <= (1 - top_p)
    remove[..., -1:] = False
    return logits.masked_fill(remove.scatter(-1, idx, remove), float("-inf"))


def unmasking_schedule(num_levels: int, num_iterations: int, exponent: float) -> list[int]:
    """Levels newly unmasked per iteration: `ceil(31 * (1 - r^e)^(1/e))` differences (NeMo's
    generate_step)."""
    rates = torch.linspace(0.0, 1.0, num_iterations + 1, device="cpu")[:-1]  # host ints, even under meta
    masking = (1 - rates.pow(exponent)).pow(1 / exponent)
    n = torch.ceil(masking * num_levels).long()
    ks = n - torch.cat([n[1:], n.new_zeros(1)])
    return [int(k) for k in ks]


# ---------------------------------------------------------------- counter-based noise


def _mix32(x: Tensor) -> Tensor:
    """A 32-bit avalanche hash (lowbias32) on int64 tensors holding values in [0, 2^32)."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _MASK32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _MASK32
    return x ^ (x >> 16)


def row_keys(seed: Tensor, counter: Tensor) -> Tensor:
    """A 32-bit key per row from its (seed, counter) pair, int64 `[B]`."""
    h = _mix32((seed & _MASK32) ^ 0x9E3779B9)
    h = _mix32(h ^ ((seed >> 32) & _MASK32))
    return _mix32(h ^ (counter & _MASK32))


def uniform_noise(keys: Tensor, stream: Tensor) -> Tensor:
    """Uniform (0, 1) fp32 `[B, *stream.shape]` from a hash of (row key `[B]`, stream id < 2^32).

    Pure function of its inputs: a row's noise never depends on other rows or on a global generator.
    """
    h = _mix32(keys.view((-1,) + (1,) * stream.dim()) ^ stream)
    return ((h >> 8).float() + 0.5) * (1.0 / (1 << 24))


def gumbel_from_uniform(u: Tensor) -> Tensor:
    return -torch.log(-torch.log(u))


def normal_from_uniform(u1: Tensor, u2: Tensor) -> Tensor:
    """Box-Muller: two independent uniforms -> one standard normal."""
    return torch.sqrt(-2.0 * torch.log(u1)) * torch.cos((2 * math.pi) * u2)
