"""The thinker: a NemotronH hybrid backbone (Mamba2 / attention / MLP blocks) with a text and a function head.

Steps the live batch (or, for slack work, a batch of slot indices) one frame at a time, or prefills many
positions per slot in one chunked forward; all per-slot state (Mamba conv and SSM state, a ring KV cache per
attention layer, positions, previous tokens) is `[num_slots + 1, ...]` buffers, the extra row the scratch row
of padding rows. Knows tensors and slot indices; knows nothing of time, sessions or tokenizers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from engine.config.stage_config import ThinkerConfig
from engine.kernels.relu_square import relu_square
from engine.kernels.reset_rows import reset_rows
from engine.kernels.rms_norm import residual_rms_norm, rms_norm
from engine.model.joint import JointParams
from engine.model.mamba import Mamba2Mixer, _normal
from engine.model.slot_state import SlotState, keep_rows, live_rows, register_slot_state
from engine.model.thinker_attention import Attention


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # `weight * (h * rsqrt(mean(h^2) + eps))` in fp32, back in x's dtype: one kernel on CUDA
        return rms_norm(x, self.weight, self.eps)


class MLP(nn.Module):
    """Squared-ReLU MLP, no gate, no bias."""

    def __init__(self, cfg: ThinkerConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False, dtype=dtype)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(relu_square(self.up_proj(x)))


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

    def mix(
        self, x: torch.Tensor, pos: torch.Tensor, exec_mask: torch.Tensor, live: torch.Tensor
    ) -> torch.Tensor:
        """The live form's mixer on the normed input x, before the residual join (the caller joins it with
        the next norm: `residual_rms_norm`); `live` is `exec_mask` as the kernels' slot indices
        (`live_rows`)."""
        if self.kind == "M":
            return self.mixer.step(x, live)
        if self.kind == "*":
            return self.mixer.step(x, pos, exec_mask)
        return self.mixer(x)

    def step_rows(self, h: torch.Tensor, rows: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        x = self.norm(h)
        if self.kind == "M":
            return h + self.mixer.step(x, rows)
        if self.kind == "*":
            return h + self.mixer.step_rows(x, rows, pos)
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


class Thinker(SlotState, JointParams):
    """NemotronH thinker with per-slot state. Module names follow the release's `stt_model.*` tensors.

    `dtype`: weights, activations and the Mamba conv state; `kv_dtype` (default `dtype`): the attention
    KV rings. The SSM state is float32 and the logits come out float32 whatever the dtypes.

    Follows the slot contract (engine/model/slot_state.py): `step` is the live form, `step_rows` the
    slot-index form of slack work, with one scratch row after the slots where the padding rows of such a
    batch (slot -1) are computed, so any batch size runs at fixed shapes.
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
        # both heads as one projection over the final hidden (`JointParams`: the checkpoint's two tensors,
        # rows of one)
        self.join_params({"heads": ("lm_head.weight", "function_head.weight")})
        register_slot_state(self, "pos", torch.zeros(rows, dtype=torch.long))
        register_slot_state(self, "prev_text", torch.full((rows,), pad_id, dtype=torch.long))
        register_slot_state(self, "prev_func", torch.full((rows,), pad_id, dtype=torch.long))

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
        self.check_mask(mask)
        rows = torch.cat([mask, mask.new_zeros(1)])
        for block in self.llm.layers:
            if block.kind == "M":
                block.mixer.reset(rows)
            elif block.kind == "*":
                reset_rows(block.mixer.k_cache, rows)
                reset_rows(block.mixer.v_cache, rows)
        self.pos.masked_fill_(rows, 0)
        self.prev_text.masked_fill_(rows, self.pad_id)
        self.prev_func.masked_fill_(rows, self.pad_id)

    # -- maths ----------------------------------------------------------------------------------------

    def embed(self, audio: torch.Tensor, text: torch.Tensor, func: torch.Tensor) -> torch.Tensor:
        """Additive input fusion `wt * E(text) + wa * audio + wf * E(func)` (any leading shape)."""
        c = self.cfg
        e = self.embed_tokens
        return c.text_weight * e(text) + c.audio_weight * audio.to(self.dtype) + c.function_weight * e(func)

    def heads(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(text logits, function logits) [..., vocab] fp32: one matmul over both heads' rows."""
        logits = F.linear(hidden, self.joint("heads")).float()
        return logits.split(self.cfg.vocab_size, dim=-1)

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

    # -- the live form --------------------------------------------------------------------------------

    @torch.inference_mode()
    def step(
        self,
        audio: torch.Tensor,
        exec_mask: torch.Tensor,
        force_text: torch.Tensor | None = None,
        force_func: torch.Tensor | None = None,
    ) -> ThinkerOutput:
        """One frame for every slot, row i on slot i.

        audio [num_slots, hidden] (this frame's audio embedding); exec_mask [num_slots] bool: every row is
        computed, only the masked rows advance their state. The tokens fed are each slot's previous outputs.
        force_text / force_func [num_slots] int64: a token >= 0 replaces that row's greedy output (teacher
        forcing), -1 keeps it.
        """
        s = self.num_slots
        self.check_mask(exec_mask, "exec_mask")
        self._check(audio, (s, self.cfg.hidden_size), None, "audio")
        pos = self.pos[:s]
        live = live_rows(exec_mask)
        h = self.embed(audio, self.prev_text[:s], self.prev_func[:s])
        layers = self.llm.layers
        x = layers[0].norm(h)
        # each residual join and the norm after it (the next block's, or the final one) run as one kernel
        # on CUDA (residual_rms_norm); the residual stream h moves on in place
        for i, block in enumerate(layers):
            after = layers[i + 1].norm if i + 1 < len(layers) else self.llm.norm_f
            h, x = residual_rms_norm(h, block.mix(x, pos, exec_mask, live), after.weight, after.eps)
        keep_rows(pos, pos + 1, exec_mask)
        out = self._tokens(x, force_text, force_func)
        keep_rows(self.prev_text[:s], out.text_token, exec_mask)
        keep_rows(self.prev_func[:s], out.func_token, exec_mask)
        return out

    def set_func(self, exec_mask: torch.Tensor, func: torch.Tensor) -> None:
        """Replace the function token the masked slots are fed next with `func` [num_slots]."""
        keep_rows(self.prev_func[: self.num_slots], func, exec_mask)

    def _tokens(
        self, hidden: torch.Tensor, force_text: torch.Tensor | None, force_func: torch.Tensor | None
    ) -> ThinkerOutput:
        b = hidden.shape[0]
        text_logits, func_logits = self.heads(hidden)
        text = text_logits.argmax(-1)
        func = func_logits.argmax(-1)
        if force_text is not None:
            self._check(force_text, (b,), torch.long, "force_text")
            text = torch.where(force_text >= 0, force_text, text)
        if force_func is not None:
            self._check(force_func, (b,), torch.long, "force_func")
            func = torch.where(force_func >= 0, force_func, func)
        return ThinkerOutput(hidden, text_logits, func_logits, text, func)

    # -- the slot-index form: slack work only (tool-call tokens, replay, prefill) ---------------------

    @torch.inference_mode()
    def step_rows(
        self,
        audio: torch.Tensor,
        slots: torch.Tensor,
        force_text: torch.Tensor | None = None,
        force_func: torch.Tensor | None = None,
    ) -> ThinkerOutput:
        """One frame for a batch of slots: audio [b, hidden]; slots [b] int64, the slot of each row or -1 for
        a padding row (computed on the scratch row, no slot's state touched). Tokens and forcing as `step`."""
        b = slots.shape[0]
        self._check(slots, (b,), torch.long, "slots")
        self._check(audio, (b, self.cfg.hidden_size), None, "audio")
        rows = self._rows(slots)
        x = self.embed(audio, self.prev_text.index_select(0, rows), self.prev_func.index_select(0, rows))
        out = self._tokens(self.step_rows_embeds(x, slots), force_text, force_func)
        self.prev_text.index_copy_(0, rows, out.text_token)
        self.prev_func.index_copy_(0, rows, out.func_token)
        return out

    def step_rows_embeds(self, x: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """`step_rows` from fused inputs x [b, hidden]: one position per row. Returns the final hidden."""
        rows = self._rows(slots)
        pos = self.pos.index_select(0, rows)
        h = x
        for block in self.llm.layers:
            h = block.step_rows(h, rows, pos)
        self.pos.index_copy_(0, rows, pos + 1)
        return self.llm.norm_f(h)

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

    def set_func_rows(self, slots: torch.Tensor, func: torch.Tensor) -> None:
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
