"""The full model step: perception -> thinker -> talker -> codec for every slot at once, plus the thinker-only
work the engine does in the slack (tool-call tokens, prompt and result prefill, replay of held audio).

1280 samples in -> text token, function token, 1764 samples out, per slot. Forced tokens (teacher forcing of
either channel, per slot) are inputs of every step. Each stage runs in the dtypes of a `DtypePolicy` and casts
what it receives to its own dtype. Knows the stages and slot rows; knows nothing of time.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from engine.config.dtype_policy import DTYPE_POLICIES, DtypePolicy
from engine.config.stage_config import ModelConfig
from engine.model.codec import Codec
from engine.model.perception import Perception
from engine.model.perception_rows import PerceptionRows
from engine.model.slot_state import SlotState
from engine.model.talker import Talker
from engine.model.thinker import Thinker
from engine.text.tokens import Tokens

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
STAGES = ("perception", "thinker", "talker", "codec")
# the stages a system prompt's prefill changes (the others stay fresh until the slot goes live): what a
# shared prompt's saved state needs to hold
PROMPT_STAGES = ("thinker",)


def build_stages(
    cfg: ModelConfig, num_slots: int, pad_id: int, dtypes: DtypePolicy
) -> tuple[Perception, Thinker, Talker, Codec]:
    """The four stages with their per-slot state for `num_slots` slots, in the policy's dtypes (weights
    undrawn for the thinker: see `Thinker.init_dummy`). Also what `engine info` sizes, on the meta device."""
    d = {name: DTYPES[getattr(dtypes, name)] for name in DtypePolicy.model_fields if name != "name"}
    perception = Perception(
        cfg.perception, cfg.thinker.hidden_size, num_slots, d["perception"], d["perception_kv"]
    )
    thinker = Thinker(cfg.thinker, num_slots, pad_id=pad_id, dtype=d["thinker"], kv_dtype=d["thinker_kv"])
    talker = Talker(cfg.talker, cfg.tokens.tokenizer, num_slots, d["talker"], d["talker_kv"])
    codec = Codec(cfg.codec, num_slots, d["codec"])
    return perception, thinker, talker, codec


def live_inputs(cfg: ModelConfig, slots: int, device, *, active: bool = True) -> tuple[torch.Tensor, ...]:
    """Buffers for `Pipeline.live_step`: silent audio, every slot `active` (or none), no forced tokens (-1),
    no replaying rows; for benchmarks and the step graph (the runner keeps its own)."""
    return (
        torch.zeros(slots, cfg.clock.input_samples, device=device),
        torch.full((slots,), active, dtype=torch.bool, device=device),
        torch.full((slots,), -1, dtype=torch.long, device=device),
        torch.full((slots,), -1, dtype=torch.long, device=device),
        torch.zeros(slots, dtype=torch.bool, device=device),
    )


def all_inactive(inputs: tuple[torch.Tensor, ...]) -> None:
    """`live_step` inputs (as `live_inputs` orders them) made a step that changes no slot's state: no slot
    active, none replaying. The step graph warms up and captures on such a step."""
    inputs[1].zero_()
    inputs[4].zero_()


@dataclass
class LiveOutput:
    text: torch.Tensor  # [S] int64
    func: torch.Tensor  # [S] int64
    audio: torch.Tensor  # [S, 1764] float32


class Pipeline(nn.Module):
    """All four stages over `num_slots` slots, with their per-slot state preallocated, in the dtypes of
    `dtypes` (default: float32 everywhere)."""

    def __init__(self, cfg: ModelConfig, num_slots: int, tokens: Tokens, dtypes: DtypePolicy | None = None):
        super().__init__()
        if tokens.vocab_size > cfg.thinker.vocab_size:
            raise ValueError(
                f"tokens.tokenizer: {tokens.vocab_size} tokens "
                f"but thinker.vocab_size is {cfg.thinker.vocab_size}"
            )
        self.cfg, self.num_slots, self.tok = cfg, num_slots, tokens
        self.dtypes = dtypes or DTYPE_POLICIES["fp32"]
        torch.manual_seed(cfg.seed)  # the stages' own initialisers draw from it: dummy weights are seeded
        self.perception, self.thinker, self.talker, self.codec = build_stages(
            cfg, num_slots, tokens.pad, self.dtypes
        )
        if self.thinker.embed_tokens.weight.device.type != "meta":  # meta: shapes only (memory planning)
            self.thinker.init_dummy(cfg.seed)
        H = cfg.thinker.hidden_size
        self.register_buffer("silence", torch.zeros(H, dtype=self.thinker.dtype), persistent=False)
        self._replay_rows: dict[int, PerceptionRows] = {}  # replay's perception, by rows (made on first use)

    @torch.inference_mode()
    def prepare(self) -> None:
        """After weights are in place: fresh state everywhere and the embedding of silent caller audio.

        Positions the model spends on tool I/O carry silent user audio (MODEL_SPEC 3); its embedding is taken
        once from a fresh encoder fed a few silent frames, so tool work never touches a slot's encoder state.
        """
        every = torch.ones(self.num_slots, dtype=torch.bool, device=self.silence.device)
        self.reset(every)
        zeros = torch.zeros(self.num_slots, self.cfg.clock.input_samples, device=self.silence.device)
        for _ in range(4):
            emb = self.perception.step(zeros, every)
        self.silence.copy_(emb[0].to(self.silence.dtype))
        self.reset(every)

    def stages(self) -> dict[str, SlotState]:
        return {name: getattr(self, name) for name in STAGES}

    def slot_state(self) -> dict[str, dict[str, torch.Tensor]]:
        """Every stage's per-slot state buffers by name, by stage: all the memory a slot costs beyond the
        weights."""
        return {name: stage.slot_state() for name, stage in self.stages().items()}

    @torch.inference_mode()
    def reset(self, mask: torch.Tensor) -> None:
        for stage in self.stages().values():
            stage.reset(mask)

    @torch.inference_mode()
    def save_slot(self, slot: int, stages: tuple[str, ...] = STAGES) -> dict[str, dict[str, torch.Tensor]]:
        """A copy of one slot's state in the named stages (default: all), for `load_slot`."""
        return {name: getattr(self, name).save_slot(slot) for name in stages}

    @torch.inference_mode()
    def load_slot(self, slot: int, saved: dict[str, dict[str, torch.Tensor]]) -> None:
        """Give `slot` the state `save_slot` copied, in the stages it copied; the others keep theirs."""
        for name, state in saved.items():
            getattr(self, name).load_slot(slot, state)

    # -- the live step ---------------------------------------------------------------------------------

    @torch.inference_mode()
    def live_step(
        self,
        audio: torch.Tensor,
        active: torch.Tensor,
        force_text: torch.Tensor,
        force_func: torch.Tensor,
        quiet: torch.Tensor | None = None,
    ) -> LiveOutput:
        """audio [S, 1280] float32; active [S] bool; force_* [S] int64 (-1: the model's own token).

        quiet [S] bool marks rows replaying held caller audio: both agent channels are forced silent (PAD),
        except that a predicted end of tool response is kept (a control token, not speech)."""
        emb = self.perception.step(audio, active)
        if quiet is not None:
            pad = self.tok.pad
            force_text = torch.where(quiet, pad, force_text)
            force_func = torch.where(quiet, pad, force_func)
        out = self.thinker.step(emb, active, force_text, force_func)
        if quiet is not None:
            kept = quiet & (out.func_logits.argmax(-1) == self.tok.response_end)
            out.func_token = torch.where(kept, self.tok.response_end, out.func_token)
            self.thinker.set_func(active, out.func_token)
        # replaying rows say nothing: the talker and codec move on only for rows whose audio is heard, so a
        # frame replayed here leaves the same state as one replayed in the slack
        speaking = active if quiet is None else active & ~quiet
        codes = self.talker.step(out.text_token, speaking)
        pcm = self.codec.step(codes, speaking, check_range=False)  # the talker only emits valid codes
        return LiveOutput(out.text_token, out.func_token, pcm)

    # -- slack work (thinker only, on the paused slots' rows) -----------------------------------------

    def _pad(self, b: int, device) -> torch.Tensor:
        return torch.full((b,), self.tok.pad, dtype=torch.long, device=device)

    @torch.inference_mode()
    def call_step(self, slots: torch.Tensor, force_func: torch.Tensor) -> torch.Tensor:
        """One tool-call position per slot: silent audio, text forced to PAD. Returns the function tokens."""
        b = slots.shape[0]
        audio = self.silence.expand(b, -1)
        return self.thinker.step_rows(audio, slots, self._pad(b, slots.device), force_func).func_token

    @torch.inference_mode()
    def prefill_result(self, slots: torch.Tensor, ids: torch.Tensor) -> None:
        """Force `ids` [b, T] onto the function channel (text PAD, silent audio), T positions in one
        forward."""
        b, T = ids.shape
        self.thinker.prefill_tokens(
            slots, self.silence.expand(b, T, -1), torch.full_like(ids, self.tok.pad), ids
        )

    @torch.inference_mode()
    def prefill_prompt(self, slots: torch.Tensor, ids: torch.Tensor) -> None:
        """System prompt ids [b, T] on the audio channel (E(token)), text and function channels PAD."""
        th = self.thinker
        pad = torch.full_like(ids, self.tok.pad)
        th.prefill_tokens(slots, th.embed_tokens(ids), pad, pad)

    @torch.inference_mode()
    def replay_step(self, audio: torch.Tensor, active: torch.Tensor, rows: torch.Tensor) -> None:
        """Held caller audio for the `active` rows, agent channels forced silent (a predicted end of tool
        response is kept: it is a control token, not speech).

        audio [S, samples], active [S] bool; rows [b]: distinct slots, the replaying ones and others as
        padding (not `active`: their state stays). Perception and the thinker run over these b rows alone
        (`PerceptionRows`), so a piece's work scales with the rows it replays, not with the slots."""
        self.replay_frames(audio.unsqueeze(0), active.unsqueeze(0), rows)

    @torch.inference_mode()
    def replay_frames(self, audio: torch.Tensor, active: torch.Tensor, rows: torch.Tensor) -> None:
        """`replay_step` k times in one piece: audio [k, S, samples], active [k, S] bool (frame j of a row
        replayed where active[j] is set; a row with fewer frames held is inactive on the last ones). The
        rows' perception state is gathered once for the k frames; the result is k `replay_step`s'."""
        k = audio.shape[0]
        view = self._replay_rows.get(rows.shape[0])
        if view is None:
            view = self._replay_rows[rows.shape[0]] = PerceptionRows(self.perception, rows.shape[0])
        live = active.index_select(1, rows)
        emb = view.steps(audio.index_select(1, rows), live, rows)
        pad = self._pad(rows.shape[0], rows.device)
        end = self.tok.response_end
        for j in range(k):
            slots = torch.where(live[j], rows, -1)  # -1: padding, computed on the thinker's scratch row
            out = self.thinker.step_rows(emb[j], slots, pad, pad)
            self.thinker.set_func_rows(slots, torch.where(out.func_logits.argmax(-1) == end, end, pad))
