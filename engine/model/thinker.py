"""The thinker: a NemotronH hybrid backbone (Mamba2 / attention / MLP blocks) with a text and a function head.

Steps a batch of slots one frame at a time, or prefills many positions per slot in one chunked forward;
all per-slot state (Mamba conv and SSM state, a bounded ring KV cache per attention layer, positions,
previous tokens) is preallocated as `[num_slots + 1, ...]` buffers, the extra row being the scratch row
that padding rows write to. Knows tensors and slot indices; knows nothing of time, sessions or tokenizers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from engine.config import ThinkerConfig
from engine.kernels.decode_attention import decode_attention
from engine.model.mamba import Mamba2Mixer, _normal
from engine.model.slot_state import SlotState


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * h).to(x.dtype)


class MLP(nn.Module):
    """Squared-ReLU MLP, no gate, no bias."""

    def __init__(self, cfg: ThinkerConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False, dtype=dtype)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(torch.relu(self.up_proj(x)).square())


RING_SLICE = 1024  # ring entries a prefill's attention holds at once (per row and KV head)


class Attention(nn.Module):
    """Grouped-query attention without positional encoding, over a per-slot ring KV cache of `window` entries.

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
        shape = (state_rows, self.nkv, self.window, self.d)
        kv_dtype = kv_dtype or dtype
        self.register_buffer("k_cache", torch.zeros(shape, dtype=kv_dtype), persistent=False)
        self.register_buffer("v_cache", torch.zeros(shape, dtype=kv_dtype), persistent=False)

    def step(self, x: torch.Tensor, rows: torch.Tensor, pos: torch.Tensor, dense: bool) -> torch.Tensor:
        """x [b, hidden]; rows [b]; pos [b] position of this token. dense: rows[i] is i or the scratch row."""
        b = x.shape[0]
        g = self.nq // self.nkv
        kv = self.k_cache.dtype  # attention runs in the cache's dtype (casts are no-ops when it is x's)
        q = self.q_proj(x).view(b, self.nkv, g, self.d).to(kv)
        ring = pos % self.window
        self.k_cache[rows, :, ring] = self.k_proj(x).view(b, self.nkv, self.d).to(kv)
        self.v_cache[rows, :, ring] = self.v_proj(x).view(b, self.nkv, self.d).to(kv)
        # the ring's first min(pos + 1, window) entries hold this row's positions: on CUDA the kernel reads
        # only those (a gathered batch through its row index, with no copy of the rings), elsewhere the masked
        # reference over the whole ring
        lengths = (pos + 1).clamp_max(self.window)
        if dense:
            out = decode_attention(q, self.k_cache[:b], self.v_cache[:b], lengths, self.scale)
        else:
            out = decode_attention(q, self.k_cache, self.v_cache, lengths, self.scale, rows=rows)
        return self.o_proj(out.reshape(b, self.nq * self.d).to(x.dtype))

    def prefill(self, x: torch.Tensor, rows: torch.Tensor, pos0: torch.Tensor) -> torch.Tensor:
        """x [b, T, hidden] (T <= window) at positions pos0[b] .. pos0 + T - 1; rows distinct.

        Attention runs flash-style: over the ring in slices of `RING_SLICE` entries, then the chunk's own
        keys, with an online softmax in float32. A forward holds one slice of the rows' rings and its scores
        at a time, never the gathered rings or a [T, window] score matrix per head (gigabytes at 11B)."""
        b, T, _ = x.shape
        g, W = self.nq // self.nkv, self.window
        kv = self.k_cache.dtype  # as in `step`: attention in the cache's dtype, the new keys as it holds them
        q = self.q_proj(x).view(b, T, self.nkv, g, self.d).permute(0, 2, 3, 1, 4).to(kv)  # [b, kv, g, T, d]
        k = self.k_proj(x).view(b, T, self.nkv, self.d).transpose(1, 2).to(kv)  # [b, kv, T, d]
        v = self.v_proj(x).view(b, T, self.nkv, self.d).transpose(1, 2).to(kv)
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


class Block(nn.Module):
    """Pre-norm residual block around one mixer (`M` Mamba2, `*` attention, `-` MLP)."""

    def __init__(
        self, kind: str, cfg: ThinkerConfig, state_rows: int, dtype: torch.dtype, kv_dtype: torch.dtype
    ) -> None:
        super().__init__()
        self.kind = kind
        self.norm = RMSNorm(cfg.hidden_size, cfg.norm_eps, dtype)
        if kind == "M":
            self.mixer: nn.Module = Mamba2Mixer(cfg, state_rows, dtype)
        elif kind == "*":
            self.mixer = Attention(cfg, state_rows, dtype, kv_dtype)
        else:
            self.mixer = MLP(cfg, dtype)

    def step(self, h: torch.Tensor, rows: torch.Tensor, pos: torch.Tensor, dense: bool) -> torch.Tensor:
        x = self.norm(h)
        if self.kind == "M":
            return h + self.mixer.step(x, rows, rows < rows.shape[0] if dense else None)
        if self.kind == "*":
            return h + self.mixer.step(x, rows, pos, dense)
        return h + self.mixer(x)

    def prefill(self, h: torch.Tensor, rows: torch.Tensor, pos0: torch.Tensor) -> torch.Tensor:
        x = self.norm(h)
        if self.kind == "M":
            return h + self.mixer.prefill(x, rows)
        if self.kind == "*":
            return h + self.mixer.prefill(x, rows, pos0)
        return h + self.mixer(x)


class Backbone(nn.Module):
    """`stt_model.llm`: the blocks and the final norm."""

    def __init__(
        self, cfg: ThinkerConfig, state_rows: int, dtype: torch.dtype, kv_dtype: torch.dtype
    ) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Block(k, cfg, state_rows, dtype, kv_dtype) for k in cfg.layer_pattern)
        self.norm_f = RMSNorm(cfg.hidden_size, cfg.norm_eps, dtype)


@dataclass
class ThinkerOutput:
    """One step's result per batch row."""

    hidden: torch.Tensor  # [b, hidden] final hidden (after norm_f)
    text_logits: torch.Tensor  # [b, vocab] fp32
    func_logits: torch.Tensor  # [b, vocab] fp32
    text_token: torch.Tensor  # [b] int64, greedy unless forced
    func_token: torch.Tensor  # [b] int64, greedy unless forced


class Thinker(SlotState, nn.Module):
    """NemotronH thinker with per-slot state. Module names follow the release's `stt_model.*` tensors.

    `dtype`: weights, activations and the Mamba conv state; `kv_dtype` (default `dtype`): the attention
    KV rings. The SSM state is float32 and the logits come out float32 whatever the dtypes.

    Follows the slot contract (engine/model/slot_state.py) with one scratch row after the slots: the rows
    of a batch that are padding (slot -1) are computed there, so any batch size runs at fixed shapes.
    """

    scratch_rows = 1

    def __init__(
        self,
        cfg: ThinkerConfig,
        num_slots: int,
        pad_id: int,
        dtype: torch.dtype = torch.float32,
        kv_dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.cfg, self.num_slots, self.pad_id, self.dtype = cfg, num_slots, pad_id, dtype
        rows = num_slots + 1  # the last row is scratch for padding rows
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype)
        self.llm = Backbone(cfg, rows, dtype, kv_dtype or dtype)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False, dtype=dtype)
        self.function_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False, dtype=dtype)
        self.register_buffer("pos", torch.zeros(rows, dtype=torch.long), persistent=False)
        self.register_buffer("prev_text", torch.full((rows,), pad_id, dtype=torch.long), persistent=False)
        self.register_buffer("prev_func", torch.full((rows,), pad_id, dtype=torch.long), persistent=False)

    # -- set-up ---------------------------------------------------------------------------------------

    @torch.no_grad()
    def init_dummy(self, seed: int) -> None:
        """Seeded random weights, scaled so activations stay O(1) through every layer."""
        gen = torch.Generator(device=self.embed_tokens.weight.device).manual_seed(seed)
        std = self.cfg.init_std
        out_std = std / math.sqrt(2 * self.cfg.num_layers)
        _normal(self.embed_tokens.weight, 1.0, gen)
        _normal(self.lm_head.weight, std, gen)
        _normal(self.function_head.weight, std, gen)
        for block in self.llm.layers:
            block.norm.weight.fill_(1.0)
            m = block.mixer
            if block.kind == "M":
                m.init_dummy(gen, std, out_std)
            elif block.kind == "*":
                for lin in (m.q_proj, m.k_proj, m.v_proj):
                    _normal(lin.weight, std, gen)
                _normal(m.o_proj.weight, out_std, gen)
            else:
                _normal(m.up_proj.weight, std, gen)
                _normal(m.down_proj.weight, out_std, gen)
        self.llm.norm_f.weight.fill_(1.0)

    def reset(self, mask: torch.Tensor) -> None:
        """Return the masked slots ([num_slots] bool) to the state of a fresh pool."""
        self._check(mask, (self.num_slots,), torch.bool, "mask")
        rows = torch.cat([mask, mask.new_zeros(1)])
        for block in self.llm.layers:
            if block.kind == "M":
                block.mixer.reset(rows)
            elif block.kind == "*":
                block.mixer.k_cache.masked_fill_(rows[:, None, None, None], 0)
                block.mixer.v_cache.masked_fill_(rows[:, None, None, None], 0)
        self.pos.masked_fill_(rows, 0)
        self.prev_text.masked_fill_(rows, self.pad_id)
        self.prev_func.masked_fill_(rows, self.pad_id)

    def slot_state(self) -> list[torch.Tensor]:
        """Every per-slot state buffer (first dimension: slots + the scratch row)."""
        out = [self.pos, self.prev_text, self.prev_func]
        for block in self.llm.layers:
            m = block.mixer
            if block.kind == "M":
                out += [m.conv_state, m.ssm_state]
            elif block.kind == "*":
                out += [m.k_cache, m.v_cache]
        return out

    # -- maths ----------------------------------------------------------------------------------------

    def embed(self, audio: torch.Tensor, text: torch.Tensor, func: torch.Tensor) -> torch.Tensor:
        """Additive input fusion `wt * E(text) + wa * audio + wf * E(func)` (any leading shape)."""
        c = self.cfg
        e = self.embed_tokens
        return c.text_weight * e(text) + c.audio_weight * audio.to(self.dtype) + c.function_weight * e(func)

    def heads(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.lm_head(hidden).float(), self.function_head(hidden).float()

    def step_embeds(self, x: torch.Tensor, slots: torch.Tensor, dense: bool = False) -> torch.Tensor:
        """One position per row from fused inputs x [b, hidden]; advances each slot. Returns the final hidden."""
        rows = self._rows(slots)
        pos = self.pos.index_select(0, rows)
        h = x
        for block in self.llm.layers:
            h = block.step(h, rows, pos, dense)
        self.pos.index_copy_(0, rows, pos + 1)
        return self.llm.norm_f(h)

    def prefill_embeds(self, x: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """T positions per row in one chunked forward (T <= attention window); slots must be distinct
        (padding rows excepted). x [b, T, hidden] -> final hidden [b, T, hidden]."""
        T = x.shape[1]
        if not 1 <= T <= self.cfg.attention_window:
            raise ValueError(f"prefill: chunk of {T} positions; expected 1..{self.cfg.attention_window}")
        rows = self._rows(slots)
        pos0 = self.pos.index_select(0, rows)
        h = x
        for block in self.llm.layers:
            h = block.prefill(h, rows, pos0)
        self.pos.index_copy_(0, rows, pos0 + T)
        return self.llm.norm_f(h)

    # -- the public step ------------------------------------------------------------------------------

    @torch.inference_mode()
    def step(
        self,
        audio: torch.Tensor,
        slots: torch.Tensor,
        force_text: torch.Tensor | None = None,
        force_func: torch.Tensor | None = None,
        dense: bool = False,
    ) -> ThinkerOutput:
        """One frame for a batch of slots.

        audio [b, hidden] (this frame's audio embedding); slots [b] int64, the slot of each row or -1 for a
        padding row (computed, state untouched). The tokens fed are each slot's previous outputs. force_text
        / force_func [b] int64: a token >= 0 replaces that row's greedy output (teacher forcing), -1 keeps it.
        dense=True promises b == num_slots and slots[i] in {i, -1} (the live batch, the contract's
        `exec_mask` form: slots = where(exec_mask, arange, -1)), which skips gathers.
        """
        b = slots.shape[0]
        self._check(slots, (b,), torch.long, "slots")
        self._check(audio, (b, self.cfg.hidden_size), None, "audio")
        if dense and b != self.num_slots:
            raise ValueError(f"slots: a dense step takes all {self.num_slots} slots, got {b} rows")
        rows = self._rows(slots)
        x = self.embed(audio, self.prev_text.index_select(0, rows), self.prev_func.index_select(0, rows))
        hidden = self.step_embeds(x, slots, dense)
        text_logits, func_logits = self.heads(hidden)
        text = text_logits.argmax(-1)
        func = func_logits.argmax(-1)
        if force_text is not None:
            self._check(force_text, (b,), torch.long, "force_text")
            text = torch.where(force_text >= 0, force_text, text)
        if force_func is not None:
            self._check(force_func, (b,), torch.long, "force_func")
            func = torch.where(force_func >= 0, force_func, func)
        self.prev_text.index_copy_(0, rows, text)
        self.prev_func.index_copy_(0, rows, func)
        return ThinkerOutput(hidden, text_logits, func_logits, text, func)

    def prefill_tokens(
        self, slots: torch.Tensor, audio: torch.Tensor, text: torch.Tensor, func: torch.Tensor
    ) -> None:
        """T positions per row in one forward, as if the slot had heard `audio` [b, T, hidden] and said
        `text` / `func` [b, T] int64 (forced tokens): each position is fed the tokens of the one before (the
        slot's previous tokens for the first), and the last ones become the slot's previous tokens."""
        rows = self._rows(slots)
        fed_text = torch.cat([self.prev_text.index_select(0, rows)[:, None], text[:, :-1]], dim=1)
        fed_func = torch.cat([self.prev_func.index_select(0, rows)[:, None], func[:, :-1]], dim=1)
        self.prefill_embeds(self.embed(audio, fed_text, fed_func), slots)
        self.prev_text.index_copy_(0, rows, text[:, -1])
        self.prev_func.index_copy_(0, rows, func[:, -1])

    def set_func(self, slots: torch.Tensor, func: torch.Tensor) -> None:
        """Replace the function token each slot of `slots` [b] (-1: padding) is fed next with `func` [b]."""
        self.prev_func.index_copy_(0, self._rows(slots), func)

    def _rows(self, slots: torch.Tensor) -> torch.Tensor:
        return torch.where(slots >= 0, slots, self.num_slots)

    @staticmethod
    def _check(t: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype | None, name: str) -> None:
        if (
            not isinstance(t, torch.Tensor)
            or tuple(t.shape) != shape
            or (dtype is not None and t.dtype != dtype)
        ):
            got = f"{tuple(t.shape)} {t.dtype}" if isinstance(t, torch.Tensor) else type(t).__name__
            want = f"{shape} {dtype}" if dtype is not None else f"{shape} floating"
            raise ValueError(f"{name}: expected shape {want}, got {got}")
        if dtype is None and not t.is_floating_point():
            raise ValueError(f"{name}: expected a floating-point tensor of shape {shape}, got {t.dtype}")


# Release tensor name -> our parameter name: strip the prefix; everything else is named alike.
RELEASE_PREFIX = "stt_model."


def load_release_weights(thinker: Thinker, tensors: dict[str, torch.Tensor]) -> set[str]:
    """Copy the release's `stt_model.{llm,embed_tokens,lm_head,function_head}.*` tensors into the thinker.

    Returns the names consumed; raises ValueError naming any missing tensor or shape mismatch.
    """
    ours = thinker.state_dict()
    consumed: set[str] = set()
    missing = []
    with torch.no_grad():
        for name, param in ours.items():
            key = RELEASE_PREFIX + name
            if key not in tensors:
                missing.append(key)
                continue
            src = tensors[key]
            if tuple(src.shape) != tuple(param.shape):
                raise ValueError(
                    f"{key}: checkpoint shape {tuple(src.shape)}, model expects {tuple(param.shape)}"
                )
            param.copy_(src.to(param.dtype))
            consumed.add(key)
    if missing:
        raise ValueError(f"checkpoint lacks {len(missing)} thinker tensors, e.g. {missing[:3]}")
    return consumed
