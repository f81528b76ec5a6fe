"""RVQ-VAE codec decoder: one frame of RVQ codes per slot -> 1764 samples at 22.05 kHz, streamed per slot.

Sum of the selected codebook centroids -> causal ConvNeXt decoder (channel-major: [C, slots, time]) -> iSTFT
head, with each slot's causal-conv inputs and iSTFT overlap kept in preallocated buffers. Reproduces the
release's streaming decode (NeMo `RVQVAEModel.decode` with a per-session `CausalConv1dCache`, as vllm-omni's
duplex path runs it): that is NeMo's offline decode delayed by `output_delay` samples (8). Knows tensors and
the release's tensor names; knows nothing of the talker, the clock or slot lifetimes. The ConvNeXt decoder may
run in a narrower dtype (`Codec(dtype=...)`); the codebooks, the iSTFT head and its overlap state are float32
only.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import nn

from engine.config.stage_config import CodecConfig
from engine.kernels.channel_norm import channel_norm
from engine.model import codec_ops
from engine.model.slot_state import SlotState, keep_rows, register_slot_state

PREFIX = "tts_model.audio_codec."
# Release tensors decoding never reads: the waveform encoder (only needed to make codes from audio) and
# the quantiser's running variances (training statistics).
IGNORED_PREFIXES = ("encoder.", "prvq._variance_list.")


class _Codebooks(nn.Module):
    """`prvq`: one [codebook_size, latent_dim] centroid table per RVQ level; decode = sum of the picks."""

    def __init__(self, cfg: CodecConfig):
        super().__init__()
        depth = cfg.num_codebooks
        self.mus_list = nn.ParameterList(
            nn.Parameter(
                F.normalize(torch.randn(cfg.codebook_size, cfg.latent_dim), dim=1) * ((depth - i) / depth),
                requires_grad=False,
            )
            for i in range(depth)
        )

    def forward(self, codes: torch.Tensor) -> torch.Tensor:
        """codes [..., num_codebooks] int64 -> latent [..., latent_dim]: per row, the sum over levels in
        order."""
        depth, size = len(self.mus_list), self.mus_list[0].shape[0]
        table = torch.stack(tuple(self.mus_list)).view(depth * size, -1)
        offsets = torch.arange(0, depth * size, size, device=codes.device)
        rows = (codes + offsets).view(-1, depth)
        return F.embedding_bag(rows, table, mode="sum").view(*codes.shape[:-1], table.shape[1])


class _Upsample(nn.Module):
    """ConvTranspose1d with kernel == stride and no bias: a Linear to `stride` output columns per input."""

    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.stride = stride
        # [cin, cout, stride], the release's layout and initialisation.
        self.weight = nn.Parameter(
            nn.ConvTranspose1d(cin, cout, stride, stride=stride, bias=False).weight.detach()
        )

    def forward(self, rows: torch.Tensor, b: int) -> torch.Tensor:
        """rows [B * L, cin] (any strides) -> channel-major [cout, B, L * stride]."""
        cin, cout, k = self.weight.shape
        y = rows @ self.weight.view(cin, cout * k)
        return y.view(b, -1, cout, k).permute(2, 0, 1, 3).reshape(cout, b, -1).contiguous()


class _ConvNeXt(nn.Module):
    """Causal depthwise conv -> LayerNorm over channels -> pointwise x4 -> GELU -> pointwise, plus residual.

    Parameters keep the release's shapes (`dwconv` [C, 1, K], `pwconv*` [out, in, 1]). Activations are
    channel-major [C, B, L]: the depthwise conv runs over (left context ++ input) along the contiguous
    time axis, and each pointwise conv is one matrix product over all slots and columns.
    """

    def __init__(self, dim: int, hidden: int, kernel: int, eps: float):
        super().__init__()
        self.kernel = kernel
        self.dwconv = nn.Conv1d(dim, dim, kernel, groups=dim)
        self.norm = nn.LayerNorm(dim, eps=eps)
        self.pwconv1 = nn.Conv1d(dim, hidden, 1)
        self.pwconv2 = nn.Conv1d(hidden, dim, 1)

    def forward(self, x: torch.Tensor, context: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [C, B, L], context [C, B, K - 1] (the last K - 1 inputs) -> (y [C, B, L], new context)."""
        c, b, length = x.shape
        padded = torch.cat([context, x], dim=2)
        # Depthwise over time: [C, B, K - 1 + L] is a one-image, C-channel [B, K - 1 + L] picture.
        y = F.conv2d(padded[None], self.dwconv.weight[:, :, None, :], self.dwconv.bias, groups=c)[0]
        # the channel statistics in float32 whatever the dtype, then the affine: one kernel on CUDA
        y = channel_norm(y, self.norm.weight, self.norm.bias, self.norm.eps)
        h = torch.addmm(self.pwconv1.bias[:, None], self.pwconv1.weight[:, :, 0], y.view(c, b * length))
        h = F.gelu(h)
        out = torch.addmm(x.view(c, b * length), self.pwconv2.weight[:, :, 0], h)
        out += self.pwconv2.bias[:, None]
        return out.view(c, b, length), padded[:, :, length:]


class _Head(nn.Module):
    """Conv1d(C -> n_fft + 2, no bias) to magnitude logits and phases."""

    def __init__(self, dim: int, out: int):
        super().__init__()
        self.weight = nn.Parameter(nn.Conv1d(dim, out, 1, bias=False).weight.detach())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[C, B, L] (any float dtype) -> [n_fft + 2, B, L] in the head's dtype."""
        c, b, length = x.shape
        return (self.weight[:, :, 0] @ x.reshape(c, b * length).to(self.weight.dtype)).view(-1, b, length)


class _Decoder(nn.Module):
    """`decoder.layers`: per stage an upsampler then `blocks_per_stage` ConvNeXt blocks; then the head."""

    def __init__(self, cfg: CodecConfig):
        super().__init__()
        layers: list[nn.Module] = []
        cin = cfg.latent_dim
        for dim, stride in zip(cfg.channels, cfg.upsample, strict=True):
            layers.append(_Upsample(cin, dim, stride))
            for _ in range(cfg.blocks_per_stage):
                layers.append(_ConvNeXt(dim, dim * cfg.mlp_ratio, cfg.block_kernel, cfg.norm_eps))
            cin = dim
        layers.append(_Head(cin, cfg.n_fft + 2))
        self.layers = nn.ModuleList(layers)

    def blocks(self) -> list[_ConvNeXt]:
        return [m for m in self.layers if isinstance(m, _ConvNeXt)]

    def forward(
        self, z: torch.Tensor, contexts: list[torch.Tensor]
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """z [B, T, latent_dim], contexts [C, B, K - 1] per block
        -> ([n_fft + 2, B, T * columns], contexts)."""
        b = z.shape[0]
        x = z.reshape(-1, z.shape[-1])
        new: list[torch.Tensor] = []
        for layer in self.layers:
            if isinstance(layer, _Upsample):
                x = layer(x if x.dim() == 2 else x.view(x.shape[0], -1).t(), b)
            elif isinstance(layer, _ConvNeXt):
                x, ctx = layer(x, contexts[len(new)])
                new.append(ctx)
            else:
                x = layer(x)
        return x, new


class Codec(SlotState, nn.Module):
    """Streaming RVQ-VAE decoder over `num_slots` slots; `state_dict()` names are the release's (less PREFIX).

    `dtype`: the upsamplers' and ConvNeXt blocks' weights, activations and causal-conv contexts.
    """

    def __init__(self, cfg: CodecConfig, num_slots: int, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.cfg = cfg
        self.num_slots = num_slots
        self.dtype = dtype
        self.prvq = _Codebooks(cfg)
        self.decoder = _Decoder(cfg)
        for layer in self.decoder.layers:
            if not isinstance(layer, _Head):
                layer.to(dtype)
        hop, n_fft = cfg.hop_length, cfg.n_fft
        self.frame_samples = cfg.samples_per_frame
        self.cached_columns = codec_ops.cached_columns(n_fft, hop)
        self.output_offset = codec_ops.output_offset(n_fft, hop)
        # Constants of the iSTFT head, and per-slot streaming state: each block's last K - 1 inputs
        # [num_slots, C, K - 1] and the iSTFT's last P windowed frames [num_slots, n_fft, P]. Values are set
        # by `init_buffers`.
        self.register_buffer("_irfft", torch.empty(n_fft, n_fft + 2), persistent=False)
        self.register_buffer("_window", torch.empty(n_fft), persistent=False)
        self.register_buffer("_inv_envelope", torch.empty(self.frame_samples), persistent=False)
        self._state_names: list[str] = []
        for i, block in enumerate(self.decoder.blocks()):
            dim = block.dwconv.weight.shape[0]
            self._add_state(f"_context{i}", (num_slots, dim, cfg.block_kernel - 1), dtype)
        self._add_state("_tail", (num_slots, n_fft, self.cached_columns), torch.float32)
        self.requires_grad_(False)
        self.init_buffers()

    @torch.no_grad()
    def init_buffers(self) -> None:
        """Compute the iSTFT constants and zero every slot's state (again after `to_empty`, say)."""
        hop, n_fft = self.cfg.hop_length, self.cfg.n_fft
        self._irfft.copy_(codec_ops.irfft_matrix(n_fft))
        self._window.copy_(torch.hann_window(n_fft))
        self._inv_envelope.copy_(1.0 / codec_ops.frame_envelope(n_fft, hop, self.frame_samples))
        for state in self._states():
            state.zero_()

    def _add_state(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        register_slot_state(self, name, torch.empty(shape, dtype=dtype))
        self._state_names.append(name)

    @property
    def output_delay(self) -> int:
        """Samples by which this (streaming) output lags NeMo's offline decode of the same codes."""
        return self.cached_columns // 2 * self.cfg.hop_length

    def _states(self) -> list[torch.Tensor]:
        """The slot state in the decoder's order: each block's conv context, then the iSTFT overlap."""
        return [getattr(self, n) for n in self._state_names]

    def _run(
        self, codes: torch.Tensor, states: list[torch.Tensor]
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """codes [B, T, Q] (valid), states as `_states()` for B rows -> (wav [B, T * 1764], new states).

        The decoder works channel-major ([C, B, time]); states are slot-first, so they go in and come out
        as transposed views.
        """
        b, t, _ = codes.shape
        states = [s.transpose(0, 1) for s in states]
        x, contexts = self.decoder(self.prvq(codes).to(self.dtype), states[:-1])
        frames = codec_ops.spectrum_frames(x, self._irfft, self._window)
        frames = torch.cat([states[-1], frames], dim=2)
        signal = codec_ops.overlap_add(frames, self.cfg.hop_length)
        n = t * self.frame_samples
        start = self.output_offset
        wav = signal[:, start : start + n].view(b, t, self.frame_samples) * self._inv_envelope
        new = [*contexts, frames[:, :, frames.shape[2] - self.cached_columns :]]
        return wav.view(b, n), [s.transpose(0, 1) for s in new]

    def _check_codes(self, codes: torch.Tensor, shape: tuple[int | str, ...]) -> None:
        """Dtype, shape (str entries are free dimensions) and device; and that the iSTFT head is fp32."""
        head = self.decoder.layers[-1].weight.dtype
        if self._tail.dtype != torch.float32 or head != torch.float32:
            raise RuntimeError(
                f"codec: the iSTFT head and its state run in float32 only, not {self._tail.dtype} (low "
                "precision ruins the audio); choose the decoder's dtype with Codec(dtype=...)"
            )
        want = f"an int64 tensor of shape ({', '.join(map(str, shape))})"
        ok = isinstance(codes, torch.Tensor) and codes.dtype == torch.long and codes.dim() == len(shape)
        if not ok or any(isinstance(n, int) and n != m for n, m in zip(shape, codes.shape, strict=True)):
            raise ValueError(f"codes: expected {want}, got {_describe(codes)}")
        if codes.device != self._tail.device:
            raise ValueError(f"codes: expected device {self._tail.device}, got {codes.device}")

    def _check_range(self, codes: torch.Tensor, rows: torch.Tensor | None = None) -> None:
        """Every code of the `rows` (BoolTensor over dim 0; None: all) in [0, codebook_size). A host sync."""
        bad = (codes < 0) | (codes >= self.cfg.codebook_size)
        if rows is not None:
            bad &= rows.view(-1, *([1] * (codes.dim() - 1)))
        if bool(bad.any()):
            raise ValueError(
                f"codes: values must lie in [0, {self.cfg.codebook_size}); got {int(bad.sum())} outside "
                f"(min {int(codes[bad].min())}, max {int(codes[bad].max())})"
            )

    @torch.inference_mode()
    def step(self, codes: torch.Tensor, exec_mask: torch.Tensor, *, check_range: bool = True) -> torch.Tensor:
        """Decode one frame for every slot.

        codes LongTensor [num_slots, num_codebooks]; exec_mask BoolTensor [num_slots]. Returns
        [num_slots, 1764] fp32; rows not executed are computed (fixed shapes) but return zeros and leave their
        state untouched, and their codes may hold anything. Out-of-range codes of an active row raise
        ValueError; that check reads values (a host sync), so a captured step passes `check_range=False`.
        """
        s, q = self.num_slots, self.cfg.num_codebooks
        self.check_mask(exec_mask, "exec_mask")
        self._check_codes(codes, (s, q))
        if check_range:
            self._check_range(codes, exec_mask)
        codes = torch.where(exec_mask[:, None], codes, 0)
        wav, new = self._run(codes[:, None], self._states())
        for state, value in zip(self._states(), new, strict=True):
            keep_rows(state, value, exec_mask)
        return torch.where(exec_mask[:, None], wav, 0.0)

    @torch.inference_mode()
    def reset(self, mask: torch.Tensor) -> None:
        """Return the masked slots (BoolTensor [num_slots]) to the fresh state; others are untouched."""
        self.check_mask(mask)
        for state in self._states():
            state.masked_fill_(mask.view(-1, 1, 1), 0.0)

    @torch.inference_mode()
    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        """Offline decode with no state: codes LongTensor [B, T, num_codebooks] -> [B, T * 1764].

        Equals stepping a fresh slot through the T frames and concatenating the outputs.
        """
        self._check_codes(codes, ("B", "T", self.cfg.num_codebooks))
        self._check_range(codes)
        b, t, _ = codes.shape
        if b * t == 0:
            return self._tail.new_zeros(b, t * self.frame_samples)
        states = [s.new_zeros((b, *s.shape[1:])) for s in self._states()]
        return self._run(codes, states)[0]


def _describe(x: object) -> str:
    if isinstance(x, torch.Tensor):
        return f"{x.dtype} tensor of shape {tuple(x.shape)}"
    return type(x).__name__


def ignored_release_names(tensors: Mapping[str, torch.Tensor]) -> set[str]:
    """The codec tensors of a release checkpoint that decoding deliberately does not use."""
    return {k for k in tensors if k.startswith(PREFIX) and k[len(PREFIX) :].startswith(IGNORED_PREFIXES)}


@torch.no_grad()
def load_release_weights(module: Codec, tensors: Mapping[str, torch.Tensor]) -> set[str]:
    """Copy `tts_model.audio_codec.*` release tensors into `module`; returns the names consumed.

    Our names are the release's with PREFIX stripped (`decoder.layers.{i}.*`, `prvq.mus_list.{i}`); the
    names in IGNORED_PREFIXES are left out on purpose. Raises ValueError naming every missing tensor,
    wrong shape, or codec tensor that is neither ours nor ignored. Also sets the constants and fresh state
    (`Codec.init_buffers`), so a module built on the meta device and moved with `to_empty` is ready.
    """
    own = module.state_dict(keep_vars=True)
    ignored = ignored_release_names(tensors)
    unknown = sorted(
        k for k in tensors if k.startswith(PREFIX) and k not in ignored and k[len(PREFIX) :] not in own
    )
    missing = sorted(PREFIX + k for k in own if PREFIX + k not in tensors)
    wrong = sorted(
        f"{PREFIX + k} {tuple(tensors[PREFIX + k].shape)} (expected {tuple(p.shape)})"
        for k, p in own.items()
        if PREFIX + k in tensors and tensors[PREFIX + k].shape != p.shape
    )
    if unknown or missing or wrong:
        raise ValueError(f"codec weights: missing {missing}; wrong shape {wrong}; unknown {unknown}")
    for k, p in own.items():
        p.copy_(tensors[PREFIX + k].to(dtype=p.dtype))
    module.init_buffers()
    return {PREFIX + k for k in own}
