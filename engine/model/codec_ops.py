"""The codec's iSTFT head as plain tensor maths: magnitude/phase -> windowed frames -> overlap-add.

Knows the release's head (bounded magnitude, cos/sin phase, irfft, clamp to the window, Hann window, hop,
window-envelope normalisation) and its streaming geometry; knows nothing of modules, weights or slots.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

MAX_MAGNITUDE = 100.0  # NeMo's Latent2Wav bounds magnitudes at `max_mag = 100.0` (not configurable there)


def cached_columns(n_fft: int, hop: int) -> int:
    """Spectrum columns the streaming iSTFT keeps from the previous frame (the release: 4)."""
    return 2 * math.ceil(((n_fft - hop) // 2) / hop)


def output_offset(n_fft: int, hop: int) -> int:
    """Index, in the overlap-add of (cached + new) columns, of the first sample a frame emits.

    The streaming decode trims `(n_fft - hop) // 2` samples (the centred iSTFT) plus half the cached
    columns' worth of samples; everything before belongs to the previous frame.
    """
    return (n_fft - hop) // 2 + cached_columns(n_fft, hop) // 2 * hop


def irfft_matrix(n_fft: int) -> torch.Tensor:
    """[n_fft, 2 * bins]: `matrix @ cat([re, im])` equals `torch.fft.irfft(re + i*im, n_fft)` per column.

    The imaginary parts of the DC and Nyquist bins are ignored, as irfft does.
    """
    bins = n_fft // 2 + 1
    k = torch.arange(bins, dtype=torch.float64)[:, None]
    n = torch.arange(n_fft, dtype=torch.float64)[None, :]
    angle = 2 * math.pi * k * n / n_fft
    weight = torch.full((bins, 1), 2.0, dtype=torch.float64)
    weight[0] = 1.0
    if n_fft % 2 == 0:
        weight[-1] = 1.0
    cos = weight * torch.cos(angle) / n_fft
    sin = -weight * torch.sin(angle) / n_fft
    sin[0] = 0.0
    if n_fft % 2 == 0:
        sin[-1] = 0.0
    return torch.cat([cos, sin], 0).t().float().contiguous()


def frame_envelope(n_fft: int, hop: int, frame_samples: int) -> torch.Tensor:
    """[frame_samples]: the squared-window envelope a streaming frame divides by, as the release computes it.

    The release normalises each frame's overlap-add of (cached + new) columns by the overlap-add of the
    squared Hann window over the same columns, then trims; this is that envelope over the emitted span.
    """
    columns = frame_samples // hop + cached_columns(n_fft, hop)
    window_sq = torch.hann_window(n_fft, dtype=torch.float64).square()
    envelope = F.fold(
        window_sq[:, None].expand(n_fft, columns)[None],
        output_size=(1, (columns - 1) * hop + n_fft),
        kernel_size=(1, n_fft),
        stride=(1, hop),
    ).reshape(-1)
    start = output_offset(n_fft, hop)
    return envelope[start : start + frame_samples].float()


def spectrum_frames(x: torch.Tensor, matrix: torch.Tensor, window: torch.Tensor) -> torch.Tensor:
    """Windowed time frames of the head's output, channel-major.

    x [2 * bins, B, L] (magnitude logits, then phases); matrix from `irfft_matrix`; window [n_fft] (Hann).
    Returns [n_fft, B, L]: irfft of `mag * exp(i * phase)` per column, clamped to +-window, times the
    window, where `mag = 100 * exp(-softplus(log(100) - logit))`, i.e. `100 * sigmoid(logit - log(100))`.
    """
    bins, b, length = x.shape[0] // 2, x.shape[1], x.shape[2]
    logit, phase = x[:bins], x[bins:]
    unit = torch.sigmoid(logit - math.log(MAX_MAGNITUDE))  # mag / 100; the 100 goes into the matrix
    spec = x.new_empty(2 * bins, b, length)
    torch.mul(unit, torch.cos(phase), out=spec[:bins])
    torch.mul(unit, torch.sin(phase), out=spec[bins:])
    frames = ((matrix * MAX_MAGNITUDE) @ spec.view(2 * bins, b * length)).view(-1, b, length)
    w = window[:, None, None]
    return torch.clamp(frames, -w, w).mul_(w)


def overlap_add(frames: torch.Tensor, hop: int) -> torch.Tensor:
    """Frames [n_fft, B, M] at stride `hop` (n_fft % hop == 0) -> summed signal [B, (M - 1) * hop + n_fft]."""
    n_fft, b, m = frames.shape
    r = n_fft // hop
    out = frames.new_zeros(hop, b, m + r - 1)
    for i in range(r):
        out[:, :, i : i + m] += frames[i * hop : (i + 1) * hop]
    return out.permute(1, 2, 0).reshape(b, -1)
