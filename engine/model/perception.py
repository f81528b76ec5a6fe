"""Perception: 80 ms of 16 kHz audio per slot -> one audio embedding per slot (log-mel, streaming
FastConformer, proj).

Knows the mel front end, the per-slot streaming state and the release names under `stt_model.perception.`;
it knows nothing of tokens, the thinker or time beyond "one frame per call".

Streaming contract: NeMo 3.0.0's `cache_aware_stream_step` driven by its cache-manager geometry, as the
deployed duplex path (vllm-omni's NemotronVoiceChat thinker) drives it;
scripts/fixtures/make_perception_fixtures.py freezes that reference. Mel column c is the STFT frame centred on
sample 160c of the stream after pre-emphasis, `torch.stft(center=True, pad_mode="constant")`: at the stream's
start the centred padding is zeros (NeMo 3.0.0 pads with zeros, not by reflection). Frame 0 feeds column 0
alone; frame k >= 1 feeds columns 8k-7 .. 8k after a 9-column cache (zero columns where the stream has none)
and keeps the last of 3 subsampled outputs. The encoder thus runs 7 columns behind the audio: column 8k needs
samples up to 1280k + 256, which frame k has delivered, so every column is computed once from real samples and
the centred padding never reaches the live edge of the stream. (NeMo's other streaming front end,
`CacheFeatureBufferer`, recomputes each chunk from 160 + 1280 samples and lets the chunk's edge columns see
zero padding; the duplex path does not use it.) The kept output sees only the last 15 of the 17 columns, so
per slot we keep 7 mel columns, 1377 samples, the keys/values of the last 70 frames and the last 8 conv inputs
per layer. (Caching each subsampling stage's rows instead of 7 columns measured slower on CPU: more, smaller
convolutions.)
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from engine.config.stage_config import PerceptionConfig
from engine.model.conformer import ConformerEncoder
from engine.model.slot_state import SlotState, keep_rows, live_rows, register_slot_state, ring_write

_MASKED = -10000.0  # NeMo's score for a hidden key; exp underflows to exactly 0 in fp32

RELEASE_PREFIX = "stt_model.perception."
# Release tensors under the prefix that inference does not need (none are known for this stage).
IGNORED_RELEASE_NAMES: frozenset[str] = frozenset()
# Front-end buffers are fixed functions of the config: a release copy must match ours (else the config is
# wrong).
_FRONT_END_BUFFERS = ("preprocessor.featurizer.window", "preprocessor.featurizer.fb")


def slaney_mel_filterbank(sample_rate: int, n_fft: int, n_mels: int) -> torch.Tensor:
    """librosa.filters.mel(sr, n_fft, n_mels, fmin=0, fmax=sr/2, htk=False, norm="slaney"):
    [n_mels, n_fft//2+1]."""
    f_sp, min_log_hz, min_log_mel, logstep = 200.0 / 3, 1000.0, 15.0, math.log(6.4) / 27.0

    def hz_to_mel(f: float) -> float:
        return f / f_sp if f < min_log_hz else min_log_mel + math.log(f / min_log_hz) / logstep

    mels = torch.linspace(hz_to_mel(0.0), hz_to_mel(sample_rate / 2), n_mels + 2, dtype=torch.float64)
    mel_f = torch.where(
        mels >= min_log_mel, min_log_hz * torch.exp(logstep * (mels - min_log_mel)), f_sp * mels
    )
    fft_f = torch.arange(n_fft // 2 + 1, dtype=torch.float64) * (sample_rate / n_fft)
    fdiff = mel_f.diff()
    ramps = mel_f[:, None] - fft_f[None, :]
    lower = -ramps[:-2] / fdiff[:-1, None]
    upper = ramps[2:] / fdiff[1:, None]
    # librosa stores the triangles in float32, then scales them in float64
    weights = torch.clamp(torch.minimum(lower, upper), min=0.0).to(torch.float32).to(torch.float64)
    return (weights * (2.0 / (mel_f[2:] - mel_f[:-2]))[:, None]).to(torch.float32)


class _Featurizer(nn.Module):
    """Holds NeMo's `FilterbankFeatures` buffers under their release names."""

    def __init__(self, cfg: PerceptionConfig, sample_rate: int) -> None:
        super().__init__()
        self.register_buffer("window", torch.hann_window(cfg.win_length, periodic=False))
        self.register_buffer("fb", slaney_mel_filterbank(sample_rate, cfg.n_fft, cfg.n_mels)[None])


class MelFrontEnd(nn.Module):
    """Pre-emphasised samples -> log-mel columns (power spectrum, Slaney mel, log(x + guard), no
    normalisation)."""

    def __init__(self, cfg: PerceptionConfig, sample_rate: int = 16_000) -> None:
        super().__init__()
        self.n_fft, self.hop, self.guard = cfg.n_fft, cfg.hop_length, cfg.log_zero_guard
        self.featurizer = _Featurizer(cfg, sample_rate)

    def forward(self, emph: torch.Tensor, columns: int) -> torch.Tensor:
        """emph [B, L] -> [B, columns, n_mels]; column i is the n_fft frame starting at sample i * hop."""
        frames = emph.unfold(-1, self.n_fft, self.hop)[:, :columns]
        pad = (self.n_fft - self.featurizer.window.shape[0]) // 2
        window = F.pad(self.featurizer.window, (pad, self.n_fft - self.featurizer.window.shape[0] - pad))
        power = torch.view_as_real(torch.fft.rfft(frames * window, dim=-1)).square().sum(-1)
        return torch.log(power @ self.featurizer.fb[0].T + self.guard)


class Perception(SlotState, nn.Module):
    """Mel front end + cache-aware streaming FastConformer + projection, with per-slot streaming state.

    `dtype`: the encoder's and the projection's weights and activations, and the conv caches; `kv_dtype`
    (default `dtype`): the attention caches, in which attention runs. The mel front end, its audio and mel
    tails and the attention softmax are float32 whatever the dtypes; the embeddings come out in `dtype`.
    """

    def __init__(
        self,
        cfg: PerceptionConfig,
        out_dim: int,
        num_slots: int,
        dtype: torch.dtype = torch.float32,
        kv_dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        if cfg.att_context_right != 0:
            raise NotImplementedError("att_context_right: only 0 (fully causal attention) is implemented")
        self.cfg, self.num_slots = cfg, num_slots
        self.frame_samples = cfg.chunk_mel * cfg.hop_length
        self.preprocessor = MelFrontEnd(cfg)
        self.encoder = ConformerEncoder(
            n_mels=cfg.n_mels,
            d_model=cfg.d_model,
            num_layers=cfg.num_layers,
            num_heads=cfg.num_heads,
            d_ff=cfg.d_model * cfg.ff_expansion,
            kernel=cfg.conv_kernel,
            subsampling_factor=cfg.subsampling_factor,
            subsampling_channels=cfg.subsampling_channels,
            left_context=cfg.att_context_left,
        )
        self.proj = nn.Linear(cfg.d_model, out_dim)
        self.encoder.to(dtype)
        self.proj.to(dtype)
        self.dtype = dtype
        rf = self.encoder.pre_encode.receptive_field
        if cfg.subsampling_factor != cfg.chunk_mel:
            raise ValueError(
                f"chunk_mel: {cfg.chunk_mel} columns per frame must equal subsampling_factor "
                f"({cfg.subsampling_factor}) for one encoder frame per call"
            )
        if (
            cfg.pre_encode_cache + cfg.chunk_mel < rf
            or cfg.drop_extra_pre_encoded
            != _outputs(cfg.pre_encode_cache + cfg.chunk_mel, self.encoder.pre_encode.num_stages) - 1
        ):
            raise NotImplementedError(
                "pre_encode_cache/drop_extra_pre_encoded: only geometries that keep the last subsampled "
                f"output of a window covering its {rf}-column receptive field are implemented"
            )
        # samples before frame k that columns 8k-7 .. 8k need, plus one for pre-emphasis
        self.audio_tail_len = (cfg.chunk_mel - 1) * cfg.hop_length + cfg.n_fft // 2 + 1
        if cfg.n_fft // 2 > self.frame_samples:
            raise ValueError("n_fft: half a window must fit in one frame")
        d_k, w = cfg.d_model // cfg.num_heads, cfg.att_context_left
        layers, s = cfg.num_layers, num_slots
        self.mel_tail_len = rf - cfg.chunk_mel
        state = {
            "audio_tail": torch.zeros(s, self.audio_tail_len),
            "mel_tail": torch.zeros(s, self.mel_tail_len, cfg.n_mels),
        }
        for i in range(layers):
            state[f"k_cache{i}"] = torch.zeros(s, cfg.num_heads, w, d_k, dtype=kv_dtype or dtype)
            state[f"v_cache{i}"] = torch.zeros(s, cfg.num_heads, w, d_k, dtype=kv_dtype or dtype)
            state[f"conv_cache{i}"] = torch.zeros(s, cfg.d_model, cfg.conv_kernel - 1, dtype=dtype)
        state["frames"] = torch.zeros(s, dtype=torch.int64)
        state["nonfinite_samples"] = torch.zeros(s, dtype=torch.int64)
        for name, value in state.items():
            register_slot_state(self, name, value)
        # constants of the attention ring, indexed by frame % w (dist) and min(frame, w) (hidden): ring entry
        # r holds frame t - dist[r]; entries before the stream's first frame get NeMo's -10000 score
        t = torch.arange(w + 1)[:, None]
        ring_dist = torch.remainder(t - 1 - torch.arange(w), w) + 1
        ring_hidden = F.pad(torch.where(ring_dist > t, _MASKED, 0.0), (1, 0))[:, None]  # current frame first
        self.register_buffer("ring_dist", ring_dist[:w], persistent=False)
        self.register_buffer("ring_hidden", ring_hidden, persistent=False)

    # ------------------------------------------------------------------ streaming
    @torch.inference_mode()
    def step(self, audio: torch.Tensor, exec_mask: torch.Tensor) -> torch.Tensor:
        """audio [num_slots, 1280] float (one 80 ms frame per slot), exec_mask [num_slots] bool
        -> [num_slots, out_dim].

        Every row is computed; only the rows in `exec_mask` advance their state. Non-finite samples count
        into `nonfinite_samples` (executed rows) and are replaced by 0.
        """
        s, n = self.num_slots, self.frame_samples
        if audio.shape != (s, n) or not audio.is_floating_point():
            raise ValueError(
                f"audio: expected a float tensor of shape [{s}, {n}], got {audio.dtype} {list(audio.shape)}"
            )
        self.check_mask(exec_mask, "exec_mask")
        raw = audio.to(self.audio_tail.dtype)
        audio = torch.nan_to_num(raw, nan=0.0, posinf=0.0, neginf=0.0)
        keep_rows(self.nonfinite_samples, self.nonfinite_samples + (audio != raw).sum(-1), exec_mask)

        first = self.frames == 0
        seg = torch.cat([self.audio_tail, audio[:, : self.cfg.n_fft // 2]], dim=-1)
        new_mel = self.preprocessor(seg[:, 1:] - self.cfg.preemph * seg[:, :-1], self.cfg.chunk_mel)
        window = torch.cat([self.mel_tail, new_mel], dim=1)
        # frame 0 is column 0 alone: the columns before the stream are zero, for this frame and the next
        early = torch.arange(window.shape[1], device=window.device) < window.shape[1] - 1
        window = window.masked_fill(first[:, None, None] & early[None, :, None], 0.0)
        x = self.encoder.pre_encode(window.to(self.dtype), first)[:, 0]

        w = self.cfg.att_context_left
        slot_in_ring = torch.remainder(self.frames, w)
        dist = self.ring_dist[slot_in_ring]
        hidden = self.ring_hidden[self.frames.clamp(max=w)]
        live = live_rows(exec_mask)  # the executed rows as the conv kernel's row indices
        for i, layer in enumerate(self.encoder.layers):
            kc, vc, cc = (getattr(self, f"{kind}_cache{i}") for kind in ("k", "v", "conv"))
            # the layer moves the executed rows' conv cache on; their key and value are committed here
            # (after the layer has read the ring): ring write at frame % w
            x, k, v = layer.step(x, self.encoder.pe, kc, vc, cc, dist, hidden, live)
            ring_write(kc, vc, slot_in_ring, k, v, exec_mask)
        out = self.proj(x)

        tail = torch.cat([self.audio_tail, audio], dim=-1)[:, -self.audio_tail_len :]
        keep_rows(self.audio_tail, tail, exec_mask)
        keep_rows(self.mel_tail, window[:, -self.mel_tail_len :], exec_mask)
        keep_rows(self.frames, self.frames + 1, exec_mask)
        return out

    @torch.inference_mode()
    def reset(self, mask: torch.Tensor) -> None:
        """Return the slots where mask [num_slots] bool is set to the fresh state (counters included)."""
        self.check_mask(mask)
        for buf in self.slot_state().values():
            buf.masked_fill_(mask.view(-1, *([1] * (buf.dim() - 1))), 0)

    # ------------------------------------------------------------------ whole utterance
    @torch.inference_mode()
    def log_mel(self, audio: torch.Tensor) -> torch.Tensor:
        """audio [B, N] -> [B, 8 (T - 1) + 1, n_mels], T = N // 1280: the mel columns 0 .. 8(T-1) the encoder
        consumes.

        Trailing samples short of a whole frame are ignored; non-finite samples become 0 (not counted).
        """
        if audio.dim() != 2 or not audio.is_floating_point():
            raise ValueError(
                f"audio: expected a float tensor of shape [B, N], got {audio.dtype} {list(audio.shape)}"
            )
        cfg, t = self.cfg, audio.shape[1] // self.frame_samples
        audio = audio[:, : t * self.frame_samples].to(self.audio_tail.dtype)
        seg = F.pad(audio.masked_fill(~torch.isfinite(audio), 0.0), (self.audio_tail_len, 0))
        mel = self.preprocessor(seg[:, 1:] - cfg.preemph * seg[:, :-1], cfg.chunk_mel * t)
        return mel[:, cfg.chunk_mel - 1 :]  # the first chunk_mel - 1 columns lie before the stream

    @torch.inference_mode()
    def encode_offline(self, audio: torch.Tensor) -> torch.Tensor:
        """audio [B, N] -> [B, N // 1280, out_dim]: what `step` yields frame by frame from a fresh slot.

        Trailing samples short of a whole frame are ignored; non-finite samples become 0 (not counted).
        """
        mel = self.log_mel(audio)
        if mel.shape[1] == 0:
            return mel.new_zeros(mel.shape[0], 0, self.proj.out_features)
        # columns -14 .. 8(T-1): columns before the stream are zero (frame 0 zeroes them, frame 1 sees them)
        pre = self.encoder.pre_encode
        mel = F.pad(mel, (0, 0, pre.receptive_field - 1, 0)).to(self.dtype)
        first = torch.ones(mel.shape[0], dtype=torch.bool, device=mel.device)
        x = pre(mel)
        x = torch.cat([pre(mel[:, : pre.receptive_field], first), x[:, 1:]], dim=1)
        return self.proj(self.encoder.forward_offline(x))


def _outputs(columns: int, stages: int) -> int:
    """Subsampled frames NeMo's causal dw_striding makes from `columns` mel columns (pad 2 + 1, k 3, s 2)."""
    for _ in range(stages):
        columns = (columns + 3 - 3) // 2 + 1
    return columns


# ---------------------------------------------------------------------- release weights
def release_names(module: Perception) -> dict[str, str]:
    """Our state_dict name -> the release checkpoint's name (the prefix is the whole table)."""
    return {name: RELEASE_PREFIX + name for name in module.state_dict()}


def load_release_weights(module: Perception, tensors: dict[str, torch.Tensor]) -> set[str]:
    """Copy the `stt_model.perception.*` tensors of a release state dict into `module`.

    Returns the release names consumed (plus those of IGNORED_RELEASE_NAMES present). Raises ValueError
    naming every tensor of the prefix that is missing, has the wrong shape, is unknown, or (front-end
    buffers) differs from what the config computes.
    """
    ours = module.state_dict()
    names = release_names(module)
    missing = [rel for rel in names.values() if rel not in tensors]
    wrong = [
        f"{rel} {list(tensors[rel].shape)} (expected {list(ours[name].shape)})"
        for name, rel in names.items()
        if rel in tensors and tensors[rel].shape != ours[name].shape
    ]
    known = set(names.values()) | IGNORED_RELEASE_NAMES
    unknown = [n for n in tensors if n.startswith(RELEASE_PREFIX) and n not in known]
    problems = [f"missing: {', '.join(missing)}"] if missing else []
    problems += [f"wrong shape: {', '.join(wrong)}"] if wrong else []
    problems += (
        [f"unknown (add to IGNORED_RELEASE_NAMES if not needed): {', '.join(unknown)}"] if unknown else []
    )
    if problems:
        raise ValueError("perception release weights: " + "; ".join(problems))
    for name in _FRONT_END_BUFFERS:
        theirs = tensors[RELEASE_PREFIX + name].to(ours[name].device, ours[name].dtype)
        if not torch.allclose(theirs, ours[name], rtol=1e-4, atol=1e-6):
            diff = (theirs - ours[name]).abs().max()
            raise ValueError(
                f"perception release weights: {RELEASE_PREFIX + name} differs from the configured front end "
                f"(max abs diff {float(diff):.3g}); check n_fft / win_length / n_mels"
            )
    with torch.no_grad():
        for name, rel in names.items():
            ours[name].copy_(tensors[rel])
    return set(names.values()) | (IGNORED_RELEASE_NAMES & tensors.keys())
