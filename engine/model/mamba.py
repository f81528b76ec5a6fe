"""Mamba2 mixer of the NemotronH thinker, with per-slot conv and SSM state.

A single-token step (through the kernels in `engine.kernels`) and a chunked multi-token forward (the SSD
scan) for prefill; both read and write the same per-slot state rows. Knows tensors and slots, not time.
Maths and tensor names follow transformers' `nemotron_h` (in_proj split z | xBC | dt, group-wise gated
RMSNorm applied after the SSM, gate before the norm).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from engine.config.stage_config import ThinkerConfig
from engine.kernels.causal_conv1d_update import causal_conv1d_update
from engine.kernels.reset_rows import reset_rows
from engine.kernels.rms_norm import gated_rms_norm
from engine.kernels.selective_state_update import selective_state_update
from engine.model.slot_state import register_slot_state


class GatedRMSNorm(nn.Module):
    """RMSNorm over groups of channels of `x * silu(gate)` (NemotronH's `mixer.norm`)."""

    def __init__(self, size: int, group_size: int, eps: float, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype))  # the mixer's dtype, as in transformers
        self.group_size = group_size
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        # the gate's SiLU and product, the norm in fp32 and the weight: one kernel on CUDA
        return gated_rms_norm(x, gate, self.weight, self.group_size, self.eps)


class Mamba2Mixer(nn.Module):
    """Mamba2 selective-state-space mixer. State rows: conv `[rows, conv_dim, k-1]`, SSM `[rows, h, p, n]`
    fp32."""

    def __init__(self, cfg: ThinkerConfig, state_rows: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.cfg = cfg
        h, p, n = cfg.mamba_num_heads, cfg.mamba_head_dim, cfg.ssm_state_size
        self.in_proj = nn.Linear(cfg.hidden_size, cfg.in_proj_dim, bias=False, dtype=dtype)
        self.conv1d = nn.Conv1d(
            cfg.conv_dim, cfg.conv_dim, cfg.conv_kernel, groups=cfg.conv_dim, bias=True, dtype=dtype
        )
        self.dt_bias = nn.Parameter(torch.empty(h))
        self.A_log = nn.Parameter(torch.empty(h))
        self.norm = GatedRMSNorm(cfg.d_inner, cfg.d_inner // cfg.n_groups, cfg.norm_eps, dtype)
        self.D = nn.Parameter(torch.empty(h))
        self._xbc_sizes = [cfg.d_inner, cfg.n_groups * n, cfg.n_groups * n]
        self.out_proj = nn.Linear(cfg.d_inner, cfg.hidden_size, bias=False, dtype=dtype)
        conv = torch.zeros(state_rows, cfg.conv_dim, cfg.conv_kernel - 1, dtype=dtype)
        register_slot_state(self, "conv_state", conv)
        register_slot_state(self, "ssm_state", torch.zeros(state_rows, h, p, n, dtype=torch.float32))

    @torch.no_grad()
    def init_dummy(self, gen: torch.Generator, std: float, out_std: float) -> None:
        """Seeded initialisation in the style of Mamba2's own (dt log-uniform, A = -[1..h])."""
        cfg = self.cfg
        _normal(self.in_proj.weight, std, gen)
        _normal(self.out_proj.weight, out_std, gen)
        bound = 1 / math.sqrt(cfg.conv_kernel)
        _uniform(self.conv1d.weight, -bound, bound, gen)
        _uniform(self.conv1d.bias, -bound, bound, gen)
        u = torch.rand(self.dt_bias.shape, generator=gen, device=gen.device)
        dt = torch.exp(
            u * (math.log(cfg.time_step_max) - math.log(cfg.time_step_min)) + math.log(cfg.time_step_min)
        )
        dt = dt.clamp(min=cfg.time_step_floor)
        self.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))  # inverse softplus
        self.A_log.copy_(torch.log(torch.arange(1, cfg.mamba_num_heads + 1, dtype=torch.float32)))
        self.D.fill_(1.0)
        self.norm.weight.fill_(1.0)

    def reset(self, rows: torch.Tensor) -> None:
        """Zero the state of the given rows (a bool mask over state rows)."""
        reset_rows(self.conv_state, rows)
        reset_rows(self.ssm_state, rows)

    def _split(self, zxbcdt: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        cfg = self.cfg
        return zxbcdt.split([cfg.d_inner, cfg.conv_dim, cfg.mamba_num_heads], dim=-1)

    def step(self, x: torch.Tensor, state_indices: torch.Tensor) -> torch.Tensor:
        """One token per row. x [b, hidden]; state_indices [b] the state row of each batch row, -1 for a row
        that neither reads nor writes state (the live batch: `slot_state.live_rows(exec_mask)`)."""
        cfg = self.cfg
        b = x.shape[0]
        z, xbc, dt = self._split(self.in_proj(x))
        w = self.conv1d.weight[:, 0]
        xbc = causal_conv1d_update(xbc, self.conv_state, w, self.conv1d.bias, state_indices)
        xs, B, C = xbc.split(self._xbc_sizes, dim=-1)
        # dt is clamped below at `time_step_limit_min` on both paths (0: not at all, as vLLM serves the
        # release; see ThinkerConfig), so a prefill leaves exactly the state of the same positions stepped.
        y = selective_state_update(
            self.ssm_state,
            xs.view(b, cfg.mamba_num_heads, cfg.mamba_head_dim),
            dt,
            self.A_log,  # A = -exp(A_log), taken in the kernel on CUDA
            B.view(b, cfg.n_groups, cfg.ssm_state_size),
            C.view(b, cfg.n_groups, cfg.ssm_state_size),
            self.D,
            self.dt_bias,
            state_indices,
            dt_min=cfg.time_step_limit_min,
            a_log=True,
        )
        return self.out_proj(self.norm(y.reshape(b, cfg.d_inner), z))

    def prefill(self, x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """T tokens per row in one chunked forward. x [b, T, hidden]; rows [b] distinct state rows."""
        cfg = self.cfg
        b, T, _ = x.shape
        k = cfg.conv_kernel
        z, xbc, dt = self._split(self.in_proj(x))
        window = torch.cat([self.conv_state.index_select(0, rows), xbc.transpose(1, 2)], dim=-1)
        self.conv_state.index_copy_(0, rows, window[:, :, -(k - 1) :])
        xbc = F.silu(F.conv1d(window, self.conv1d.weight, self.conv1d.bias, groups=cfg.conv_dim)).transpose(
            1, 2
        )
        xs, B, C = xbc.split(self._xbc_sizes, dim=-1)
        y, final = ssd_chunk_scan(
            xs.reshape(b, T, cfg.mamba_num_heads, cfg.mamba_head_dim),
            dt,
            -torch.exp(self.A_log.float()),
            B.reshape(b, T, cfg.n_groups, cfg.ssm_state_size),
            C.reshape(b, T, cfg.n_groups, cfg.ssm_state_size),
            self.D,
            self.dt_bias,
            self.ssm_state.index_select(0, rows),
            cfg.mamba_chunk_size,
            dt_min=cfg.time_step_limit_min,
        )
        self.ssm_state.index_copy_(0, rows, final)
        return self.out_proj(self.norm(y.reshape(b, T, cfg.d_inner).to(x.dtype), z))


def _segsum(x: torch.Tensor) -> torch.Tensor:
    """Stable segment sums: out[..., i, j] = sum(x[..., j+1 : i+1]) for j <= i, -inf above the diagonal."""
    L = x.shape[-1]
    x = x[..., None].expand(*x.shape, L)
    x = x.masked_fill(~torch.tril(torch.ones(L, L, dtype=torch.bool, device=x.device), -1), 0)
    out = torch.cumsum(x, dim=-2)
    return out.masked_fill(~torch.tril(torch.ones(L, L, dtype=torch.bool, device=x.device)), -torch.inf)


def ssd_chunk_scan(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
    dt_bias: torch.Tensor,
    initial_state: torch.Tensor,
    chunk_size: int,
    dt_min: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mamba2's SSD scan over a sequence in chunks (fp32).

    x [b, T, h, p]; dt [b, T, h] (raw); A, D, dt_bias [h]; B, C [b, T, g, n]; initial_state [b, h, p, n].
    Returns y [b, T, h, p] fp32 and the final state [b, h, p, n] fp32.
    """
    b, T, h, p = x.shape
    g = B.shape[2]
    dt = F.softplus(dt.float() + dt_bias.float()).clamp(min=dt_min)
    x = x.float()
    B = B.float().repeat_interleave(h // g, dim=2)
    C = C.float().repeat_interleave(h // g, dim=2)
    pad = (chunk_size - T % chunk_size) % chunk_size
    y_skip = D.float()[:, None] * x

    def chunks(t: torch.Tensor) -> torch.Tensor:
        t = F.pad(t, (0, 0) * (t.dim() - 2) + (0, pad))
        return t.reshape(b, -1, chunk_size, *t.shape[2:])

    xdt = chunks(x * dt[..., None])
    Adt = chunks(A.float() * dt).permute(0, 3, 1, 2)  # [b, h, c, l]
    B, C = chunks(B), chunks(C)
    A_cum = torch.cumsum(Adt, dim=-1)
    L = torch.exp(_segsum(Adt))
    y_diag = torch.einsum("bclhn,bcshn,bhcls,bcshp->bclhp", C, B, L, xdt)
    decay = torch.exp(A_cum[..., -1:] - A_cum)
    states = torch.einsum("bclhn,bhcl,bclhp->bchpn", B, decay, xdt)
    states = torch.cat([initial_state.float()[:, None], states], dim=1)
    decay_chunk = torch.exp(_segsum(F.pad(A_cum[..., -1], (1, 0))))
    new_states = torch.einsum("bhzc,bchpn->bzhpn", decay_chunk, states)
    states, final = new_states[:, :-1], new_states[:, -1]
    y_off = torch.einsum("bclhn,bchpn,bhcl->bclhp", C, states, torch.exp(A_cum))
    y = (y_diag + y_off).reshape(b, -1, h, p)[:, :T] + y_skip
    return y, final


# Dummy weights: on CPU drawn in float32 and rounded to the tensor's dtype; elsewhere drawn in place, with no
# float32 copy of the largest tensors (4.7 GB for the 11B thinker's embedding) on the device.
def _normal(t: torch.Tensor, std: float, gen: torch.Generator) -> None:
    if t.device.type != "cpu":
        t.normal_(0.0, std, generator=gen)
        return
    t.copy_(torch.randn(t.shape, generator=gen, device=gen.device, dtype=torch.float32) * std)


def _uniform(t: torch.Tensor, lo: float, hi: float, gen: torch.Generator) -> None:
    if t.device.type != "cpu":
        t.uniform_(lo, hi, generator=gen)
        return
    t.copy_(torch.rand(t.shape, generator=gen, device=gen.device, dtype=torch.float32) * (hi - lo) + lo)
