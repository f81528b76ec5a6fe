"""The talker (EAR-TTS): per slot and frame, the thinker's text token and the previous frame's 31 codes ->
a Gemma3 step over a per-slot ring KV cache (engine/model/talker_backbone.py) -> 31 new RVQ codes by
iterative MoG unmasking.

Knows the release's tensor names (prefix `tts_model.tts_model.`), the speaker warm-up and the sampling
schedule; knows nothing about audio, the thinker's internals, sessions or the clock.
"""

from __future__ import annotations

import logging
import re

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from engine.config.stage_config import TalkerConfig
from engine.kernels.add_rms_norm import add_rms_norm
from engine.model.joint import JointParams
from engine.model.slot_state import SlotState, keep_rows, register_slot_state
from engine.model.talker_backbone import TalkerBackbone
from engine.model.talker_heads import (
    CharAwareSubwordEncoder,
    GatedProjectedSumRMSNorm,
    GemmaRMSNorm,
    MoGHead,
    gumbel_from_uniform,
    normal_from_uniform,
    row_keys,
    token_chars_and_flags,
    top_p_filter,
    uniform_noise,
    unmasking_schedule,
)

log = logging.getLogger(__name__)

PREFIX = "tts_model.tts_model."
# Release names outside PREFIX that the talker reads, by our buffer name ({speaker}: TalkerConfig.speaker).
EXTRA_NAMES = {
    "speaker_latent": "tts_model.audio_prompt_latents.{speaker}",
    "silence_codes": "tts_model.codec_silence_tokens",
    "control_codes": "tts_model._control_codes",
}
# Release names inference does not need: the training-time prompt projection, the EOS-prediction head
# (its flag never stops the duplex loop) and the other speakers' latents.
IGNORED = (
    re.compile(re.escape(PREFIX) + r"audio_prompt_projection_W"),
    re.compile(re.escape(PREFIX) + r"lm_head\.weight"),
    re.compile(r"tts_model\.audio_prompt_latents\..+"),
)


class Talker(SlotState, JointParams):
    """EAR-TTS over `num_slots` slots; `step` advances every slot by one frame (inactive rows keep state).

    With `cfg.use_cfg` each slot has a second, unconditional stream: its state holds both streams
    (`[num_slots, 2, ...]`), and the backbone runs `2 * num_slots` rows, slot-major (slot i's conditional
    stream in row 2i, its unconditional one in row 2i + 1). Derived tensors (subword table, codebooks, norm
    scales, warm-up KV) are rebuilt by `refresh()`, which `load_release_weights` calls; call it yourself after
    changing weights any other way. Projections read together (q/k/v, gate/up, the MoG head's three) are
    views of one tensor each (`JointParams`): no copy to rebuild.

    `dtype`: the backbone's and the MoG head's MLP stack's weights and activations; `kv_dtype` (default
    `dtype`): the KV rings, in which attention runs (queries rounded to it, scores and softmax float32).
    Inputs (code embeddings, fusion, the subword table) and sampling (component logits, means, RVQ
    quantisation) are float32 whatever the dtypes: they decide discrete codes.
    """

    def __init__(
        self,
        cfg: TalkerConfig,
        tokenizer_path: str | None,
        num_slots: int,
        dtype: torch.dtype = torch.float32,
        kv_dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.cfg, self.num_slots, self.dtype = cfg, num_slots, dtype
        h, q, v, d = cfg.hidden_size, cfg.num_codebooks, cfg.codebook_size, cfg.latent_dim
        w, streams = cfg.warmup_positions, 2 if cfg.use_cfg else 1
        self.streams = streams
        self.backbone = TalkerBackbone(cfg, num_slots, streams, dtype, kv_dtype or dtype)
        self.bos_emb = nn.Parameter(torch.randn(h))
        self.null_emb = nn.Parameter(torch.randn(h))
        self.register_buffer("rvq_embs", torch.randn(q, v, d) * d**-0.5)
        self.embed_code = nn.Linear(d, h, bias=False)
        self.embed_subword = CharAwareSubwordEncoder(cfg, h)
        self.gated_fusion_audio_text = GatedProjectedSumRMSNorm(h, q, cfg.rms_eps)
        self.mog_head = MoGHead(cfg)
        self.mog_head.mlp_stack.to(dtype)
        # the MoG head's three projections of the final hidden as one (`JointParams`)
        self.join_params(
            {"head": tuple(f"mog_head.{p}.weight" for p in ("proj_logits", "proj_else", "proj_logs"))}
        )
        for mod in self.modules():  # `1 + w` of every norm stays float32: the norms compute in float32
            if isinstance(mod, GemmaRMSNorm):
                mod.scale = mod.scale.float()
        self.schedule = unmasking_schedule(q, cfg.num_iterations, cfg.schedule_exponent)
        self._read_tokenizer(tokenizer_path)

        def buf(name: str, t: Tensor) -> None:
            self.register_buffer(name, t, persistent=False)

        buf("speaker_latent", torch.randn(w, h) * 0.5)
        buf("silence_codes", torch.zeros(q, dtype=torch.long))
        buf("control_codes", torch.tensor([v + 2, v + 1, v]))
        buf("subword_table", torch.zeros(cfg.vocab_size, h))
        buf("rvq_padded", torch.zeros(q, v + 1, d))
        buf("rvq_sq", torch.zeros(q, v))
        buf("rvq_neg2t", torch.zeros(q, d, v))
        # per-slot state beside the backbone's KV rings: positions per stream, the codes fed back, the
        # sampling seed and the frame counter that key each slot's noise
        register_slot_state(self, "pos", torch.zeros(num_slots, streams, dtype=torch.long))
        register_slot_state(self, "prev_codes", torch.full((num_slots, q), v, dtype=torch.long))
        register_slot_state(self, "seeds", torch.zeros(num_slots, dtype=torch.long))
        register_slot_state(self, "frames", torch.zeros(num_slots, dtype=torch.long))
        if self.rvq_embs.device.type != "meta":
            self.refresh()
            self.reset(torch.ones(num_slots, dtype=torch.bool))

    # ------------------------------------------------------------------ setup

    def _read_tokenizer(self, path: str | None) -> None:
        cfg = self.cfg
        self._token_chars: list[list[int]] | None = None
        self.eos_id = self.pad_id = -1  # resolved by string below; -1 matches no token
        if path is None:
            return
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(path)
        vocab = tok.get_vocab(with_added_tokens=True)
        absent = [s for s in (cfg.bos_token, cfg.eos_token, cfg.pad_token) if s not in vocab]
        if absent:
            raise ValueError(f"tokenizer: special token(s) {', '.join(map(repr, absent))} not in {path!r}")
        self.eos_id = vocab[cfg.eos_token]
        self.pad_id = vocab[cfg.pad_token]
        if len(vocab) != cfg.vocab_size:
            # e.g. a full-size model with dummy weights and the tiny tokenizer: ids it lacks get no characters
            log.warning("talker: tokenizer has %d tokens, vocab_size is %d", len(vocab), cfg.vocab_size)
        chars, cont, special, n_chars = token_chars_and_flags(
            vocab, cfg.vocab_size, cfg.bos_token, cfg.eos_token
        )
        if n_chars != cfg.char_vocab_size:
            raise ValueError(
                f"char_vocab_size: the tokenizer has {n_chars} single-character tokens, config says "
                f"{cfg.char_vocab_size}"
            )
        self._token_chars = chars
        flags = self.embed_subword
        flags.subword_flag_emb.is_continuation.copy_(torch.tensor(cont))
        flags.bos_eos_emb.special_flags.copy_(torch.tensor(special))

    @torch.no_grad()
    def refresh(self) -> None:
        """Rebuild every derived tensor from the weights: subword table, padded codebooks, norm scales
        and the speaker warm-up KV (identical for every slot, so computed once)."""
        if self._token_chars is None:
            raise ValueError(
                "tokenizer: need the thinker's tokenizer (vocab_size entries) to build the subword table"
            )
        cfg = self.cfg
        for mod in self.modules():
            if isinstance(mod, GemmaRMSNorm):
                mod.fuse()
        self.embed_subword.table(self._token_chars, out=self.subword_table)
        self.rvq_padded.zero_()
        self.rvq_padded[:, : cfg.codebook_size].copy_(self.rvq_embs)
        self.rvq_sq.copy_(self.rvq_embs.pow(2).sum(-1))
        self.rvq_neg2t.copy_(-2 * self.rvq_embs.transpose(1, 2))
        self._build_warmup()

    def _build_warmup(self) -> None:
        """The 37-position speaker prompt (NeMo `set_init_inputs(speaker_name=...)`): latent rows, then the
        BOS position carrying the silence codes + `bos_emb`; text PAD... `</s>`, visible on the last two."""
        cfg, w = self.cfg, self.cfg.warmup_positions
        sil = self.rvq_padded[torch.arange(cfg.num_codebooks), self.silence_codes]
        acc = torch.zeros_like(sil[0])
        for e in sil:  # sequential, as NeMo's depthsum
            acc = acc + e
        audio = torch.cat([self.speaker_latent[: w - 1], (self.embed_code(acc) + self.bos_emb)[None]])
        ids = torch.full((w,), self.pad_id, dtype=torch.long, device=audio.device)
        ids[-1] = self.eos_id
        sub = self.embed_subword
        flags = sub.subword_flag_emb.cont_emb.weight[sub.subword_flag_emb.is_continuation[ids]]
        fl = sub.bos_eos_emb.special_flags
        flags = (
            flags
            + sub.bos_eos_emb.special_emb.weight[fl[torch.where(ids >= fl.numel() - 1, fl.numel() - 1, ids)]]
        )
        cond = torch.where(
            (torch.arange(w, device=ids.device) >= w - 2)[:, None], self.subword_table[ids], flags
        )
        conds = [cond] + ([self.null_emb.expand(w, -1)] if cfg.use_cfg else [])
        x = torch.stack([self.gated_fusion_audio_text(audio, c) for c in conds])  # [streams, w, h]
        self.backbone.prefill_warmup(x.to(self.dtype))

    # ------------------------------------------------------------------ per-slot state

    def _rows(self, per_slot: Tensor) -> Tensor:
        """A per-slot tensor [num_slots, ...] repeated for each stream: [num_slots * streams, ...],
        slot-major."""
        return per_slot.repeat_interleave(self.streams, dim=0) if self.streams > 1 else per_slot

    @torch.inference_mode()
    def reset(self, mask: Tensor) -> None:
        """Return the masked slots to the fresh state: speaker warm-up done, the rest of the rings zero, frame
        counter and sampling seed 0 (a fresh talker's; `set_seed` gives other seeds). No host sync."""
        self.check_mask(mask)
        self.backbone.reset(mask)
        self.pos.masked_fill_(mask[:, None], self.cfg.warmup_positions)
        self.prev_codes.masked_fill_(mask[:, None], self.cfg.codebook_size)
        self.frames.masked_fill_(mask, 0)
        self.seeds.masked_fill_(mask, 0)

    @torch.inference_mode()
    def set_seed(self, slot_seeds: Tensor) -> None:
        """Per-slot sampling seeds (int64); a slot's noise is a hash of (seed, its frame counter, stream)."""
        if slot_seeds.shape != (self.num_slots,) or slot_seeds.dtype != torch.long:
            raise ValueError(
                f"slot_seeds: expected LongTensor[{self.num_slots}], got {slot_seeds.dtype} "
                f"{tuple(slot_seeds.shape)}"
            )
        self.seeds.copy_(slot_seeds)

    # ------------------------------------------------------------------ the step

    @torch.inference_mode()
    def step(self, text: Tensor, exec_mask: Tensor) -> Tensor:
        """One frame for every slot: `text` LongTensor[num_slots] (this frame's thinker token), `exec_mask`
        BoolTensor[num_slots] -> codes LongTensor[num_slots, num_codebooks] in [0, codebook_size)."""
        n, cfg = self.num_slots, self.cfg
        if text.shape != (n,) or text.dtype != torch.long:
            raise ValueError(f"text: expected LongTensor[{n}], got {text.dtype} {tuple(text.shape)}")
        self.check_mask(exec_mask, "exec_mask")
        ids = text.clamp(0, cfg.vocab_size - 1)
        prev = torch.where((text == self.eos_id)[:, None], self.silence_codes, self.prev_codes)
        levels = torch.arange(cfg.num_codebooks, device=text.device)
        code_emb = self.embed_code(self.rvq_padded[levels, prev].sum(1))
        cond = self.subword_table[ids]
        if cfg.use_cfg:
            code_emb = self._rows(code_emb)
            cond = torch.stack([cond, self.null_emb.expand(n, -1)], dim=1).view(2 * n, -1)
        x = self.gated_fusion_audio_text(code_emb, cond)
        rows = self._rows(exec_mask)
        pos = self.pos.view(-1)
        hidden = self.backbone.step(x.to(self.dtype), pos, rows)
        keep_rows(pos, pos + 1, rows)
        codes = self._sample(hidden)
        keep_rows(self.prev_codes, codes, exec_mask)
        keep_rows(self.frames, self.frames + 1, exec_mask)
        return codes

    def _sample(self, hidden: Tensor) -> Tensor:
        """Iterative unmasking: per working pass the MoG head predicts the residual latent of the still
        masked levels; greedy residual quantisation fixes the next `k` levels."""
        cfg, n = self.cfg, self.num_slots
        m = self.mog_head
        nc, rank, dl = cfg.mog_components, cfg.mog_rank, cfg.latent_dim
        work = [k for k in self.schedule if k > 0]
        if cfg.gumbel or cfg.noise_scale > 0:
            # one hash over every noise this frame needs: per pass nc Gumbel + 2 * latent uniforms
            width = nc + 2 * dl
            stream = torch.arange(len(work) * width, device=hidden.device).view(len(work), width)
            u = uniform_noise(row_keys(self.seeds, self.frames), stream)  # [n, passes, width]
            gumbel = gumbel_from_uniform(u[..., :nc])
            normal = normal_from_uniform(u[..., nc : nc + dl], u[..., nc + dl :])
        mus = m.proj_mus.weight.view(nc, rank, -1)
        sq, neg2t, embs = self.rvq_sq.unbind(0), self.rvq_neg2t.unbind(0), self.rvq_embs.unbind(0)
        acc = hidden.new_zeros(n, dl, dtype=torch.float32)
        codes: list[Tensor] = []
        level = 0
        for p, k in enumerate(work):
            if p == 0:
                e = hidden
            else:
                e = self.embed_code(acc)
                e = self._rows(e) + hidden
            x = self._mlp_stack(e.to(self.dtype)).float()  # sampling is float32 whatever the stack's dtype
            if cfg.use_cfg:
                xc, xu = x.view(n, 2, -1).unbind(1)
                x = xc + cfg.cfg_scale * (xc - xu)
            y = F.linear(x, self.joint("head"))
            logits, mu_res, logs = y[:, :nc], y[:, nc : nc + dl], y[:, nc + dl :]
            if cfg.gumbel:
                if cfg.top_p < 1.0:
                    logits = top_p_filter(logits, cfg.top_p)
                comp = (F.log_softmax(logits, -1) + gumbel[:, p]).argmax(-1)
            else:
                comp = F.log_softmax(logits, -1).argmax(-1)
            mu = (mus[comp] * x[:, None, :]).sum(-1)  # [n, rank]: only the picked component's rows
            mu = torch.bmm(m.low_mat[comp], mu.unsqueeze(2)).squeeze(2)  # [n, latent]
            std = torch.exp(logs.clamp_min(cfg.log_std_min))
            z = mu * std + mu_res
            if cfg.noise_scale > 0:
                z = z + std * normal[:, p] * cfg.noise_scale
            last_pass = p == len(work) - 1
            for lv in range(level, level + k):
                # argmin ||z - e||^2 = argmin (||e||^2 - 2 z.e), NeMo's form (-2 E^T is exact)
                c = torch.addmm(sq[lv], z, neg2t[lv]).argmin(-1)
                codes.append(c)
                if lv == level + k - 1 and last_pass:
                    break
                e_l = F.embedding(c, embs[lv])
                if lv < level + k - 1:
                    z = z - e_l
                if not last_pass:
                    acc = acc + e_l
            level += k
        return torch.stack(codes, 1)

    def _mlp_stack(self, x: Tensor) -> Tensor:
        """`mog_head.mlp_stack(x)`, each residual join and the norm after it (the next layer's pre-norm, or
        the stack's final norm) in one kernel on CUDA (add_rms_norm)."""
        *layers, final = self.mog_head.mlp_stack
        if not layers:
            return final(x)
        h = layers[0].pre_norm(x)
        for i, layer in enumerate(layers):
            after = layers[i + 1].pre_norm if i + 1 < len(layers) else final
            x, h = add_rms_norm(x, layer.mlp(h), layer.post_norm.scale, after.scale, after.eps)
        return h

    # ------------------------------------------------------------------ weights

    def release_names(self) -> dict[str, Tensor]:
        """Release name -> our tensor, for every tensor the talker reads from a checkpoint."""
        names = {PREFIX + k: t for k, t in self.state_dict(keep_vars=True).items()}
        for ours, theirs in EXTRA_NAMES.items():
            names[theirs.format(speaker=self.cfg.speaker)] = getattr(self, ours)
        return names


def load_release_weights(module: Talker, tensors: dict[str, Tensor]) -> set[str]:
    """Copy the release's talker tensors into `module` by name; returns every name consumed (loaded or
    explicitly ignored). Raises naming each missing, misshapen or unknown tensor under the prefix."""
    names = module.release_names()
    latent_name = EXTRA_NAMES["speaker_latent"].format(speaker=module.cfg.speaker)
    errors, consumed = [], set()
    for name, ours in names.items():
        if name not in tensors:
            errors.append(f"{name}: missing")
            continue
        src = tensors[name]
        want = (1, *ours.shape) if name == latent_name else tuple(ours.shape)
        if tuple(src.shape) != want:
            errors.append(f"{name}: shape {tuple(src.shape)}, expected {want}")
            continue
        consumed.add(name)
    for name in tensors:
        if name in names:
            continue
        if any(p.fullmatch(name) for p in IGNORED):
            consumed.add(name)
        elif name.startswith(PREFIX):
            errors.append(f"{name}: unknown talker tensor")
    if errors:
        raise ValueError("talker weights: " + "; ".join(errors))
    control = tensors[EXTRA_NAMES["control_codes"]]
    pad = module.cfg.codebook_size
    if int(control[2]) != pad:
        raise ValueError(
            f"tts_model._control_codes: speech pad id {int(control[2])}, expected {pad} (masked code)"
        )
    with torch.no_grad():
        for name, ours in names.items():
            ours.copy_(tensors[name].reshape(ours.shape).to(ours.dtype))
    module.refresh()
    module.reset(torch.ones(module.num_slots, dtype=torch.bool, device=module.pos.device))
    return consumed
