"""Cache-aware causal FastConformer: x8 depthwise-striding subsampling and relative-position conformer layers.

Knows tensors and the encoder's maths, one frame at a time (`step`, caches passed in) or a whole utterance
(`forward_offline`), both computing the same causal function. It knows nothing of audio, mel or slots;
submodule names equal NeMo's `ConformerEncoder` so release tensors load by name.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from engine.kernels.add_layer_norm import add_layer_norm
from engine.kernels.causal_conv1d_update import causal_conv1d_update
from engine.kernels.scaled_softmax import scaled_softmax
from engine.model.joint import JointParams

_MASKED = -10000.0  # NeMo's fill for masked attention scores (exp underflows to exactly 0 in fp32)


class Subsampling(nn.Module):
    """`dw_striding` with causal padding: conv 3x3/2 (1 -> C), then (depthwise 3x3/2, pointwise 1x1) x (n-1).

    Frequency is padded causally (left 2, right 1) as NeMo's `CausalConv2D` does. Time is convolved
    without padding: a window of `receptive_field + 8 (t - 1)` mel columns gives t frames, each equal to
    the last output NeMo keeps from its 9 cached + 8 new columns.
    """

    def __init__(self, n_mels: int, channels: int, d_model: int, factor: int) -> None:
        super().__init__()
        self.num_stages = int(math.log2(factor))
        layers: list[nn.Module] = [nn.Conv2d(1, channels, 3, 2), nn.ReLU()]
        for _ in range(self.num_stages - 1):
            layers += [nn.Conv2d(channels, channels, 3, 2, groups=channels), nn.Conv2d(channels, channels, 1)]
            layers.append(nn.ReLU())
        self.conv = nn.Sequential(*layers)
        # After the first stage, padding frequency by 2 on both sides inside the conv equals NeMo's causal
        # (2, 1) on every column NeMo makes; it adds a trailing column wherever the width is odd, which never
        # reaches a kept output as long as no stage sees it next to an even number of real columns.
        freq = width = n_mels // 2 + 1  # the first stage pads exactly (left 2, right 1)
        self._pad_in_conv = True
        for _ in range(self.num_stages - 1):
            if width > freq and freq % 2 == 0:
                self._pad_in_conv = False
            freq, width = (freq + 3 - 3) // 2 + 1, (width + 4 - 3) // 2 + 1
        self.freq = freq
        self.out = nn.Linear(channels * freq, d_model)
        self.receptive_field = 1 + 2 * (2**self.num_stages - 1)

    def forward(self, mel: torch.Tensor, first: torch.Tensor | None = None) -> torch.Tensor:
        """mel [B, L, n_mels] -> [B, (L - receptive_field) // 8 + 1, d_model].

        `first` [B] bool marks rows whose (single-output) window is a stream's frame 0: NeMo feeds that
        frame column 0 alone and pads every strided conv's input with zeros, so the two rows before the
        last of each stage's input are zeroed (the caller zeroes every mel column but the last).
        """
        x = mel[:, None]
        keep = None if first is None else ~first[:, None, None, None]
        for i in range(self.num_stages):
            conv = self.conv[0] if i == 0 else self.conv[3 * i - 1]
            if keep is not None and i > 0:
                t = x.shape[2]
                x[:, :, t - 3 : t - 1].mul_(keep)
            if i > 0 and self._pad_in_conv:  # see __init__; (mkldnn's padded 1-channel conv is slow)
                x = F.conv2d(x, conv.weight, conv.bias, stride=2, padding=(0, 2), groups=conv.groups)
            else:
                x = F.conv2d(F.pad(x, (2, 1)), conv.weight, conv.bias, stride=2, groups=conv.groups)
            if i > 0:
                x = F.conv2d(x, self.conv[3 * i].weight, self.conv[3 * i].bias)
            x = torch.relu_(x)
        b, c, t, _ = x.shape
        return self.out(x[..., : self.freq].transpose(1, 2).reshape(b, t, c * self.freq))


class FeedForward(nn.Module):
    def __init__(self, d_model: int, d_ff: int) -> None:
        super().__init__()
        self.linear1 = nn.Linear(d_model, d_ff, bias=False)
        self.linear2 = nn.Linear(d_ff, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear2(F.silu(self.linear1(x)))


class ConvModule(nn.Module):
    """pointwise (d -> 2d) -> GLU -> causal depthwise conv -> LayerNorm -> Swish -> pointwise (d -> d)."""

    def __init__(self, d_model: int, kernel: int) -> None:
        super().__init__()
        self.pointwise_conv1 = nn.Conv1d(d_model, 2 * d_model, 1, bias=False)
        self.depthwise_conv = nn.Conv1d(d_model, d_model, kernel, groups=d_model, bias=False)
        self.batch_norm = nn.LayerNorm(d_model)  # NeMo's name; conv_norm_type="layer_norm"
        self.pointwise_conv2 = nn.Conv1d(d_model, d_model, 1, bias=False)

    def _glu(self, x: torch.Tensor) -> torch.Tensor:
        return F.glu(F.linear(x, self.pointwise_conv1.weight[:, :, 0]), dim=-1)

    def _tail(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(F.silu(self.batch_norm(x)), self.pointwise_conv2.weight[:, :, 0])

    def forward_offline(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, T, d]; zero history before the first frame."""
        g = self._glu(x).transpose(1, 2)
        k = self.depthwise_conv.kernel_size[0]
        y = F.conv1d(F.pad(g, (k - 1, 0)), self.depthwise_conv.weight, groups=g.shape[1])
        return self._tail(y.transpose(1, 2))

    def step(self, x: torch.Tensor, cache: torch.Tensor, live: torch.Tensor) -> torch.Tensor:
        """x [B, d], cache [B, d, k - 1] (the last k - 1 GLU outputs, oldest first) -> y [B, d]. The rows
        `live` [B] names (`slot_state.live_rows`; -1: a row that keeps its cache, its y zeros) take the new
        GLU output into their cache, in the depthwise conv's one kernel on CUDA."""
        w = self.depthwise_conv.weight[:, 0, :]
        return self._tail(causal_conv1d_update(self._glu(x), cache, w, None, live, silu=False))


class RelPositionAttention(JointParams):
    """Transformer-XL relative-position multi-head attention with a limited left context, no bias.

    The step reads q, k and v as one projection and both position biases as one tensor (`JointParams`)."""

    def __init__(self, d_model: int, num_heads: int) -> None:
        super().__init__()
        self.h, self.d_k = num_heads, d_model // num_heads
        self.linear_q = nn.Linear(d_model, d_model, bias=False)
        self.linear_k = nn.Linear(d_model, d_model, bias=False)
        self.linear_v = nn.Linear(d_model, d_model, bias=False)
        self.linear_out = nn.Linear(d_model, d_model, bias=False)
        self.linear_pos = nn.Linear(d_model, d_model, bias=False)
        self.pos_bias_u = nn.Parameter(torch.zeros(num_heads, self.d_k))
        self.pos_bias_v = nn.Parameter(torch.zeros(num_heads, self.d_k))
        self.join_params(
            {
                "qkv": ("linear_q.weight", "linear_k.weight", "linear_v.weight"),
                "uv": ("pos_bias_u", "pos_bias_v"),
            }
        )

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        return x.unflatten(-1, (self.h, self.d_k))

    def forward_offline(self, x: torch.Tensor, pe: torch.Tensor) -> torch.Tensor:
        """x [B, T, d]; pe [W + 1, d] for distances 0..W; key j is visible to query i iff 0 <= i - j <= W."""
        b, t, _ = x.shape
        window = pe.shape[0] - 1
        q = self._heads(self.linear_q(x)).transpose(1, 2)  # [B, H, T, dk]
        k = self._heads(self.linear_k(x)).transpose(1, 2)
        v = self._heads(self.linear_v(x)).transpose(1, 2)
        p = self._heads(self.linear_pos(pe)).permute(1, 2, 0)  # [H, dk, W + 1]
        ac = (q + self.pos_bias_u[:, None]) @ k.transpose(-1, -2)  # [B, H, T, T]
        bd_all = (q + self.pos_bias_v[:, None]) @ p  # [B, H, T, W + 1]
        pos = torch.arange(t, device=x.device)
        rel = pos[:, None] - pos[None, :]
        hidden = (rel < 0) | (rel > window)
        bd = bd_all.gather(-1, rel.clamp(0, window).expand(b, self.h, t, t))
        scores = ((ac + bd) / math.sqrt(self.d_k)).masked_fill(hidden, _MASKED)
        attn = torch.softmax(scores, dim=-1)  # the diagonal is always visible: hidden keys weigh exactly 0
        return self.linear_out((attn @ v).transpose(1, 2).reshape(b, t, -1))

    def step(
        self, x: Tensor, pe: Tensor, k_cache: Tensor, v_cache: Tensor, dist: Tensor, hidden: Tensor
    ) -> tuple[Tensor, Tensor, Tensor]:
        """One query per row against its ring of W cached keys plus itself.

        x [B, d]; pe [W + 1, d]; k_cache/v_cache [B, H, W, dk] (ring, any order); dist [B, W] int64 distance
        of each ring entry to the current frame (1..W); hidden [B, 1, 1 + W] additive score bias for the
        current frame (first, 0) and the ring entries: -10000 (NeMo's fill) where an entry holds no frame,
        else 0. Returns (out [B, d], k [B, H, dk], v [B, H, dk]) - k, v in the caches' dtype: the caller
        writes them into the ring.
        """
        b, w, dk = x.shape[0], k_cache.shape[2], self.d_k
        bh = b * self.h
        q, k, v = (self._heads(y) for y in F.linear(x, self.joint("qkv")).chunk(3, dim=-1))
        p = self._heads(self.linear_pos(pe)).permute(1, 2, 0)  # [H, dk, W + 1]
        qu, qv = q + self.joint("uv").view(2, 1, self.h, dk)  # q + pos_bias_u, q + pos_bias_v: one add
        bd_all = (qv.transpose(0, 1) @ p).transpose(0, 1)  # [B, H, W + 1]
        bd_ring = bd_all.gather(-1, dist[:, None, :].expand(-1, self.h, -1))
        # attention runs in the caches' dtype (every cast a no-op when it is x's), the current frame's key and
        # value as the ring will hold them; scores and softmax in float32
        kv = k_cache.dtype
        k, v, qu = k.to(kv), v.to(kv), qu.to(kv)
        ring = torch.baddbmm(bd_ring.view(bh, w, 1).to(kv), k_cache.view(bh, w, dk), qu.view(bh, dk, 1))
        cur = (qu * k).sum(-1, keepdim=True) + bd_all[..., :1]
        scores = torch.cat([cur, ring.view(b, self.h, w)], dim=-1)  # the current frame first
        # hidden keys get exactly 0 weight (the current frame is always visible), as after NeMo's masked_fill
        attn = scaled_softmax(scores, math.sqrt(dk), hidden, kv)  # one kernel on CUDA
        out = torch.baddbmm(
            (attn[..., :1] * v).view(bh, 1, dk), attn[..., 1:].reshape(bh, 1, w), v_cache.view(bh, w, dk)
        )
        return self.linear_out(out.view(b, -1).to(x.dtype)), k, v


class ConformerLayer(nn.Module):
    """Macaron conformer block: x + FF/2, + MHSA, + conv, + FF/2, LayerNorm."""

    def __init__(self, d_model: int, d_ff: int, num_heads: int, kernel: int) -> None:
        super().__init__()
        self.norm_feed_forward1 = nn.LayerNorm(d_model)
        self.feed_forward1 = FeedForward(d_model, d_ff)
        self.norm_conv = nn.LayerNorm(d_model)
        self.conv = ConvModule(d_model, kernel)
        self.norm_self_att = nn.LayerNorm(d_model)
        self.self_attn = RelPositionAttention(d_model, num_heads)
        self.norm_feed_forward2 = nn.LayerNorm(d_model)
        self.feed_forward2 = FeedForward(d_model, d_ff)
        self.norm_out = nn.LayerNorm(d_model)

    def forward_offline(self, x: torch.Tensor, pe: torch.Tensor) -> torch.Tensor:
        x = torch.add(x, self.feed_forward1(self.norm_feed_forward1(x)), alpha=0.5)
        x = x + self.self_attn.forward_offline(self.norm_self_att(x), pe)
        x = x + self.conv.forward_offline(self.norm_conv(x))
        x = torch.add(x, self.feed_forward2(self.norm_feed_forward2(x)), alpha=0.5)
        return self.norm_out(x)

    def step(
        self,
        x: Tensor,
        pe: Tensor,
        k_cache: Tensor,
        v_cache: Tensor,
        conv_cache: Tensor,
        dist: Tensor,
        hidden: Tensor,
        live: Tensor,
    ) -> tuple[Tensor, Tensor, Tensor]:
        """One frame x [B, d] -> (y [B, d], new key [B, H, dk], new value [B, H, dk]).

        `hidden` is the additive score bias of RelPositionAttention.step; `live` [B] the rows that move on
        (`slot_state.live_rows`). The attention caches are read, never written: the caller commits the key
        and value for the rows it keeps; the conv cache of the `live` rows moves on here.
        """
        # each residual join and the norm after it run as one kernel on CUDA (add_layer_norm)
        x, h = _join(x, self.feed_forward1(self.norm_feed_forward1(x)), 0.5, self.norm_self_att)
        a, k, v = self.self_attn.step(h, pe, k_cache, v_cache, dist, hidden)
        x, h = _join(x, a, 1.0, self.norm_conv)
        x, h = _join(x, self.conv.step(h, conv_cache, live), 1.0, self.norm_feed_forward2)
        return _join(x, self.feed_forward2(h), 0.5, self.norm_out)[1], k, v


def _join(x: Tensor, y: Tensor, alpha: float, norm: nn.LayerNorm) -> tuple[Tensor, Tensor]:
    """(`x + alpha * y`, `norm` of it): a residual join and the LayerNorm after it."""
    return add_layer_norm(x, y, alpha, norm.weight, norm.bias, norm.eps)


def relative_positions(window: int, d_model: int) -> torch.Tensor:
    """NeMo's sinusoidal table for relative distances 0..window: [window + 1, d_model]."""
    pos = torch.arange(window + 1, dtype=torch.float32)[:, None]
    div = torch.exp(torch.arange(0, d_model, 2, dtype=torch.float32) * -(math.log(10000.0) / d_model))
    pe = torch.zeros(window + 1, d_model)
    pe[:, 0::2] = torch.sin(pos * div)
    pe[:, 1::2] = torch.cos(pos * div)
    return pe


class ConformerEncoder(nn.Module):
    """Subsampling + conformer layers (no xscaling, untied relative-position biases per layer)."""

    def __init__(
        self,
        n_mels: int,
        d_model: int,
        num_layers: int,
        num_heads: int,
        d_ff: int,
        kernel: int,
        subsampling_factor: int,
        subsampling_channels: int,
        left_context: int,
    ) -> None:
        super().__init__()
        self.pre_encode = Subsampling(n_mels, subsampling_channels, d_model, subsampling_factor)
        self.layers = nn.ModuleList(
            ConformerLayer(d_model, d_ff, num_heads, kernel) for _ in range(num_layers)
        )
        self.register_buffer("pe", relative_positions(left_context, d_model), persistent=False)

    def forward_offline(self, x: torch.Tensor) -> torch.Tensor:
        """Subsampled frames x [B, T, d] -> encoded [B, T, d]."""
        for layer in self.layers:
            x = layer.forward_offline(x, self.pe)
        return x
