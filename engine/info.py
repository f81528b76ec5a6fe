"""Sizing of a preset: parameters per component, weight bytes per dtype, per-session state, sessions per GPU.

Every module is built on the `meta` device, so the full 11B preset is sized in a second with no memory.
Knows the model's modules and their buffers; knows nothing of sessions or time.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field

import torch
from torch import nn

from engine.config import ModelConfig

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Memory kept free for activations, CUDA graphs and the allocator, beyond weights and state.
WORKSPACE_GB = 4.0


@dataclass
class Component:
    name: str
    params: dict[str, int]  # sub-part -> parameter count
    weight_dtype: torch.dtype
    state_bytes_per_session: int
    notes: list[str] = field(default_factory=list)

    @property
    def total(self) -> int:
        return sum(self.params.values())


def _state_bytes(module: nn.Module, rows: int) -> int:
    """Bytes of the per-slot buffers (first dimension == rows) for one slot."""
    total = 0
    for buf in module.buffers():
        if buf.dim() >= 1 and buf.shape[0] == rows:
            total += buf[0].numel() * buf.element_size()
    return total


def _thinker(cfg: ModelConfig) -> Component:
    from engine.model.thinker import Thinker

    dtype = DTYPES[cfg.thinker_dtype]
    with torch.device("meta"):
        th = Thinker(cfg.thinker, num_slots=1, pad_id=0, dtype=dtype)
    count = lambda m: sum(t.numel() for t in m.state_dict().values())  # noqa: E731
    return Component(
        "thinker",
        {
            "llm": count(th.llm),
            "embed_tokens": count(th.embed_tokens),
            "lm_head": count(th.lm_head),
            "function_head": count(th.function_head),
        },
        dtype,
        _state_bytes(th, rows=2),
    )


def _optional(cfg: ModelConfig, name: str, module: str, cls: str, build) -> Component | None:
    """A voice stage, if its module exists in this build."""
    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError:
        return None
    with torch.device("meta"):
        m = build(getattr(mod, cls), cfg)
    parts: dict[str, int] = {}
    for key, t in m.state_dict().items():  # checkpoint tensors: parameters and persistent buffers
        part = key.split(".")[0] if "." in key else "(own)"
        parts[part] = parts.get(part, 0) + t.numel()
    return Component(name, parts, torch.float32, _state_bytes(m, rows=1))


# Release tensors that inference never loads (so no module of ours holds them): counted for reference.
NOT_LOADED = "the codec's encoder (~0.092 B) and the RNNT user-transcript branch (~0.009 B)"


def components(cfg: ModelConfig) -> list[Component]:
    out = [_thinker(cfg)]
    voice = [
        (
            "perception",
            "engine.model.perception",
            "Perception",
            lambda C, c: C(c.perception, c.thinker.hidden_size, 1),
        ),
        ("talker", "engine.model.talker", "Talker", lambda C, c: C(c.talker, c.tokens.tokenizer, 1)),
        ("codec", "engine.model.codec", "Codec", lambda C, c: C(c.codec, 1)),
    ]
    for name, module, cls, build in voice:
        comp = _optional(cfg, name, module, cls, build)
        if comp is not None:
            out.append(comp)
    return out


def report(cfg: ModelConfig, gpu_mem_gb: float) -> dict:
    comps = components(cfg)
    weight_bytes: dict[str, int] = {}
    for c in comps:
        key = str(c.weight_dtype).removeprefix("torch.")
        weight_bytes[key] = (
            weight_bytes.get(key, 0) + c.total * torch.tensor([], dtype=c.weight_dtype).element_size()
        )
    state = sum(c.state_bytes_per_session for c in comps)
    weights = sum(weight_bytes.values())
    free = gpu_mem_gb * 2**30 - weights - WORKSPACE_GB * 2**30
    return {
        "preset": cfg.name,
        "params_total": sum(c.total for c in comps),
        "params": {c.name: c.total for c in comps},
        "params_detail": {c.name: c.params for c in comps},
        "weight_bytes": weight_bytes,
        "state_bytes_per_session": state,
        "state_bytes_detail": {c.name: c.state_bytes_per_session for c in comps},
        "gpu_mem_gb": gpu_mem_gb,
        "workspace_gb": WORKSPACE_GB,
        "sessions_fit": max(0, int(free // state)) if state else None,
    }


def _human(n: float, unit: str = "") -> str:
    for suffix in ("", "K", "M", "G", "T"):
        if abs(n) < 1000:
            return f"{n:.3g} {suffix}{unit}".strip()
        n /= 1000
    return f"{n:.3g} P{unit}"


def print_report(r: dict) -> None:
    print(f"preset {r['preset']}: {_human(r['params_total'])} parameters (checkpoint tensors the engine loads; "
          f"not loaded: {NOT_LOADED})")  # fmt: skip
    for name, parts in r["params_detail"].items():
        print(f"  {name:<12} {_human(sum(parts.values())):>10}")
        for part, n in parts.items():
            print(f"    {part:<22} {n:>15,d}")
    for dtype, b in r["weight_bytes"].items():
        print(f"weights in {dtype}: {b / 2**30:.2f} GiB")
    print(f"state per session: {r['state_bytes_per_session'] / 2**20:.2f} MiB")
    for name, b in r["state_bytes_detail"].items():
        print(f"  {name:<12} {b / 2**20:10.2f} MiB")
    print(
        f"sessions that fit in {r['gpu_mem_gb']:g} GB (keeping {r['workspace_gb']:g} GiB workspace): {r['sessions_fit']}"
    )
