"""Sizing of a preset under a dtype policy: parameters per stage, weight bytes per dtype, per-session state,
sessions per GPU.

The stages are built as the pipeline builds them (`build_stages`), on the `meta` device, so the full 11B
preset is sized in a second with no memory. State is what each stage allocates as per-slot state: by the slot
contract (engine/model/slot_state.py) its `slot_state()` buffers are slot-first, so one row of each is a
session's, and the scratch rows (the thinker's one) are fixed. Knows the stages and their state contract;
knows nothing of sessions or time.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.config.dtype_policy import DtypePolicy, DtypePolicyName, dtype_policy
from engine.config.stage_config import ModelConfig
from engine.model.checkpoint import CheckpointError
from engine.model.pipeline import STAGES, build_stages

# Memory kept free for activations, CUDA graphs and the allocator, beyond weights and state.
WORKSPACE_GB = 4.0  # GiB kept free on a GPU for the allocator's workspace
GB = 10**9  # --gpu-mem-gb is in GB, as GPU makers state memory


@dataclass
class Component:
    name: str
    params: dict[str, int]  # sub-part -> parameter count (checkpoint tensors: parameters, persistent buffers)
    weight_bytes: dict[str, int]  # dtype name -> bytes of those tensors held in it
    state_bytes_per_session: int
    state_bytes_fixed: int = 0  # per-slot state not tied to a session (the thinker's scratch row)
    derived_bytes: int = 0  # other buffers: tables and fused copies rebuilt from the weights, constants
    notes: list[str] = field(default_factory=list)

    @property
    def total(self) -> int:
        return sum(self.params.values())


def components(cfg: ModelConfig, dtypes: DtypePolicy) -> list[Component]:
    """One Component per stage, sized from a meta-device build at one slot: by the slot contract every state
    buffer is slot-first, so a row of each is what a session (or a scratch row) costs."""
    with torch.device("meta"):
        stages = build_stages(cfg, 1, 0, dtypes)
    out = []
    for name, stage in zip(STAGES, stages, strict=True):
        stage.check_slot_state()
        parts: dict[str, int] = {}
        weight_bytes: dict[str, int] = {}
        for key, t in stage.state_dict().items():
            part = key.split(".")[0] if "." in key else "(own)"
            parts[part] = parts.get(part, 0) + t.numel()
            dt = str(t.dtype).removeprefix("torch.")
            weight_bytes[dt] = weight_bytes.get(dt, 0) + t.nbytes
        per = stage.slot_bytes()
        state = {id(t) for t in stage.slot_state().values()}
        saved = stage.state_dict(keep_vars=True)
        derived = sum(t.nbytes for n, t in stage.named_buffers() if n not in saved and id(t) not in state)
        out.append(Component(name, parts, weight_bytes, per, per * stage.scratch_rows, derived))
    return out


def needed_bytes(
    cfg: ModelConfig, dtypes: DtypePolicy, num_slots: int, workspace: bool = True
) -> tuple[int, dict[str, int]]:
    """Device memory the model needs with `num_slots` slots: weights, derived buffers, per-slot state and
    (on a GPU) the workspace. Returns (total, parts)."""
    comps = components(cfg, dtypes)
    parts = {
        "weights": sum(sum(c.weight_bytes.values()) for c in comps),
        "derived buffers": sum(c.derived_bytes + c.state_bytes_fixed for c in comps),
        f"state of {num_slots} slots": num_slots * sum(c.state_bytes_per_session for c in comps),
    }
    if workspace:
        parts["workspace"] = int(WORKSPACE_GB * 2**30)
    return sum(parts.values()), parts


def check_memory(
    cfg: ModelConfig, dtypes: DtypePolicy, num_slots: int, device: torch.device, free_bytes: int | None = None
) -> int:
    """CheckpointError when `device` has less free memory than the model with `num_slots` slots needs (the
    sizing of `python -m engine info`). Returns the bytes needed."""
    need, parts = needed_bytes(cfg, dtypes, num_slots, workspace=device.type == "cuda")
    if free_bytes is None:
        if device.type == "cuda":
            free_bytes = torch.cuda.mem_get_info(device)[0]
        elif device.type == "cpu":
            import psutil

            free_bytes = psutil.virtual_memory().available
        else:
            return need
    if need > free_bytes:
        detail = ", ".join(f"{k} {v / 2**30:.1f} GiB" for k, v in parts.items())
        raise CheckpointError(
            f"not enough memory on {device}: the {cfg.name} preset with {num_slots} slots needs "
            f"{need / 2**30:.1f} GiB ({detail}), {free_bytes / 2**30:.1f} GiB is free; use fewer slots or a "
            f"larger device (python -m engine info --preset {cfg.name})"
        )
    return need


# Release tensors that inference never loads (so no module of ours holds them): counted for reference.
NOT_LOADED = "the codec's encoder (~0.092 B) and the RNNT user-transcript branch (~0.009 B)"


def report(cfg: ModelConfig, gpu_mem_gb: float, dtypes: DtypePolicyName | DtypePolicy = "gpu") -> dict:
    """The sizing of `cfg` on a GPU with `gpu_mem_gb` GB (10**9 bytes, as GPU makers state it: an H200 has
    141 GB, 131.3 GiB) under the dtype policy (default: the GPU's)."""
    policy = dtype_policy(dtypes, "cuda")
    comps = components(cfg, policy)
    weight_bytes: dict[str, int] = {}
    for c in comps:
        for key, n in c.weight_bytes.items():
            weight_bytes[key] = weight_bytes.get(key, 0) + n
    state = sum(c.state_bytes_per_session for c in comps)
    fixed = sum(c.state_bytes_fixed + c.derived_bytes for c in comps)
    weights = sum(weight_bytes.values())
    free = gpu_mem_gb * GB - weights - fixed - WORKSPACE_GB * 2**30
    return {
        "preset": cfg.name,
        "dtype_policy": policy.model_dump(),
        "params_total": sum(c.total for c in comps),
        "params": {c.name: c.total for c in comps},
        "params_detail": {c.name: c.params for c in comps},
        "weight_bytes": weight_bytes,
        "state_bytes_per_session": state,
        "state_bytes_detail": {c.name: c.state_bytes_per_session for c in comps},
        "state_bytes_fixed": sum(c.state_bytes_fixed for c in comps),
        "derived_bytes": {c.name: c.derived_bytes for c in comps},
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
    print(
        f"preset {r['preset']}: {_human(r['params_total'])} parameters (checkpoint tensors the engine loads; "
        f"not loaded: {NOT_LOADED})"
    )
    for name, parts in r["params_detail"].items():
        print(f"  {name:<12} {_human(sum(parts.values())):>10}")
        for part, n in parts.items():
            print(f"    {part:<22} {n:>15,d}")
    policy = r["dtype_policy"]
    print(
        f"dtype policy {policy['name']}: " + ", ".join(f"{k} {v}" for k, v in policy.items() if k != "name")
    )
    for dtype, b in r["weight_bytes"].items():
        print(f"weights in {dtype}: {b / 2**30:.2f} GiB")
    derived = r["derived_bytes"]
    print(
        f"derived buffers (fused weights, tables, constants): {sum(derived.values()) / 2**30:.2f} GiB "
        f"({', '.join(f'{k} {v / 2**20:.0f} MiB' for k, v in derived.items())})"
    )
    print(
        f"state per session: {r['state_bytes_per_session'] / 2**20:.2f} MiB "
        f"(plus {r['state_bytes_fixed'] / 2**20:.2f} MiB for the scratch row)"
    )
    for name, b in r["state_bytes_detail"].items():
        print(f"  {name:<12} {b / 2**20:10.2f} MiB")
    print(
        f"sessions that fit in {r['gpu_mem_gb']:g} GB (keeping {r['workspace_gb']:g} GiB workspace): "
        f"{r['sessions_fit']}"
    )
