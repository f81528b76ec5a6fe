"""`python -m benchmarks.profile_step`: one live step looked at closely, eager and as a captured graph.

For the live step of a preset at N slots (every slot active) it reports: the operators the step dispatches
and whether anything in it would stop a CUDA graph capture (engine/tick/graph.py's audit); on CUDA, under the
profiler, the kernels one eager step launches, the GPU-busy time against the wall time of an eager step and
of a graph replay, and the peak device memory against the prediction of `engine info --slots`
(engine/memory.py). Last line: one JSON object. Knows the pipeline and torch's profiler; nothing of
sessions.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from engine.config.dtype_policy import DTYPE_POLICIES, dtype_policy
from engine.config.presets import PRESETS, load_preset
from engine.config.windows import add_window_arguments, windows
from engine.process.malloc import tune_malloc


def _busy_ms(prof) -> tuple[int, float]:
    """(kernels launched, GPU-busy ms) from a profile: the union of the device kernels' intervals."""
    spans = []
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.elapsed_us() > 0:
            spans.append((e.time_range.start, e.time_range.end))
    spans.sort()
    busy, end = 0.0, -1.0
    for a, b in spans:
        if a > end:
            busy += b - a
            end = b
        elif b > end:
            busy += b - end
            end = b
    return len(spans), busy / 1e3


def _timed(fn, device: torch.device, n: int) -> list[float]:
    ms = []
    for _ in range(n):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        ms.append((time.perf_counter() - t0) * 1e3)
    return sorted(ms)


def profile(preset: str, slots: int, device: torch.device, dtype: str, steps: int = 20, args=None) -> dict:
    from engine.memory import predict_peak_bytes
    from engine.model.pipeline import Pipeline, all_inactive, live_inputs
    from engine.text.tokens import Tokens
    from engine.tick.graph import StepGraph, audit_step

    cfg = load_preset(preset) if args is None else windows(load_preset(preset), args)
    dtypes = dtype_policy(dtype, device.type, bool(args is not None and args.capacity))
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    with torch.device(device):
        p = Pipeline(cfg, slots, Tokens(cfg.tokens), dtypes).eval()
    p.prepare()
    static = live_inputs(cfg, slots, device)
    out: dict = {
        "bench": "profile_step",
        "preset": preset,
        "slots": slots,
        "device": str(device),
        "dtype": dtypes.name,
    }
    for _ in range(3):  # warm-up: lazy initialisation, autotuning
        p.live_step(*static)

    def state_tensors() -> list[torch.Tensor]:
        return [t for ts in p.slot_state().values() for t in ts.values()]

    audit = audit_step(p.live_step, static, state_tensors)
    out["operators_per_step"] = audit.ops
    out["capture_problems"] = audit.problems
    eager = _timed(lambda: p.live_step(*static), device, steps)
    out["eager_ms_p50"] = round(eager[len(eager) // 2], 3)
    if device.type != "cuda":
        print(
            f"{slots} slots on {device}: {audit.ops} operators per live step, eager {out['eager_ms_p50']} ms "
            f"p50; capture problems: {audit.problems or 'none'}"
        )
        return out
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        p.live_step(*static)
        torch.cuda.synchronize(device)
        wall = (time.perf_counter() - t0) * 1e3
    out["eager_kernels"], out["eager_busy_ms"] = _busy_ms(prof)
    out["eager_wall_ms_profiled"] = round(wall, 3)
    step = StepGraph(p.live_step, static, prepare_warmup=all_inactive)
    graphed = _timed(step, device, steps)
    out["graph_ms_p50"] = round(graphed[len(graphed) // 2], 3)
    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        step()
        torch.cuda.synchronize(device)
        wall = (time.perf_counter() - t0) * 1e3
    out["graph_kernels"], out["graph_busy_ms"] = _busy_ms(prof)
    out["graph_wall_ms_profiled"] = round(wall, 3)
    peak = torch.cuda.max_memory_allocated(device)
    predicted, parts = predict_peak_bytes(cfg, dtypes, slots, live_only=True)
    out["peak_gb"] = round(peak / 2**30, 3)
    out["predicted_gb"] = round(predicted / 2**30, 3)  # weights, state and the live step's transient
    out["predicted_parts_gb"] = {k: round(v / 2**30, 3) for k, v in parts.items()}
    out["peak_over_predicted"] = round(peak / predicted, 4)
    out["top_kernels"] = [
        (e.key, round(e.device_time_total / 1e3, 3))
        for e in sorted(prof.key_averages(), key=lambda e: -e.device_time_total)[:8]
    ]
    print(
        f"{slots} slots: eager {out['eager_ms_p50']} ms ({out['eager_kernels']} kernels, GPU busy "
        f"{out['eager_busy_ms']:.1f} ms); "
        f"graph {out['graph_ms_p50']} ms (busy {out['graph_busy_ms']:.1f} ms); "
        f"peak {out['peak_gb']} GiB, predicted {out['predicted_gb']} GiB"
    )
    return out


def main(argv: list[str] | None = None) -> int:
    tune_malloc()  # the allocator the engine runs with
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.profile_step", description=__doc__.splitlines()[0]
    )
    ap.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    ap.add_argument("--slots", type=int, default=64)
    ap.add_argument("--device", default=None)
    ap.add_argument("--dtype", default="auto", choices=["auto", *DTYPE_POLICIES])
    ap.add_argument("--steps", type=int, default=20)
    add_window_arguments(ap)
    args = ap.parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    with torch.inference_mode():
        out = profile(args.preset, args.slots, device, args.dtype, args.steps, args)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
