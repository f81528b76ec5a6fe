"""Benchmarks beside the code: `python -m engine.bench thinker|pipeline`, and the engine demo.

Each warms up first, reports p50/p99 milliseconds against the 80 ms tick, and prints one JSON object as
its last line. Dummy weights: the timing of a dummy model of a shape is the timing of the real one.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from engine.config import PRESETS, ModelConfig, load_preset

TICK_MS = 80.0


def _device(name: str | None) -> torch.device:
    if name:
        return torch.device(name)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _percentiles(ms: list[float]) -> dict[str, float]:
    t = torch.tensor(ms)
    return {
        "p50": round(t.quantile(0.5).item(), 3),
        "p99": round(t.quantile(0.99).item(), 3),
        "max": round(t.max().item(), 3),
    }


def _build_thinker(cfg: ModelConfig, slots: int, device: torch.device):
    from engine.model.thinker import Thinker

    dtype = torch.float32 if device.type == "cpu" else getattr(torch, cfg.thinker_dtype)
    with torch.device(device):
        th = Thinker(cfg.thinker, slots, pad_id=12, dtype=dtype)
    th.init_dummy(cfg.seed)
    return th.eval()


def bench_thinker(
    cfg: ModelConfig, batch_sizes: list[int], steps: int, warmup: int, device: torch.device
) -> dict:
    """Dense live steps of the thinker alone at each batch size."""
    results = {}
    for b in batch_sizes:
        th = _build_thinker(cfg, b, device)
        slots = torch.arange(b, device=device)
        audio = torch.randn(b, cfg.thinker.hidden_size, device=device, dtype=th.dtype)
        ms = []
        for i in range(warmup + steps):
            _sync(device)
            t0 = time.perf_counter()
            th.step(audio, slots, dense=True)
            _sync(device)
            if i >= warmup:
                ms.append((time.perf_counter() - t0) * 1e3)
        results[b] = _percentiles(ms)
        print(
            f"thinker  slots={b:<3d} p50 {results[b]['p50']:7.2f} ms  p99 {results[b]['p99']:7.2f} ms",
            flush=True,
        )
    return results


def demo(preset: str, slots: int, steps: int, device_name: str | None) -> int:
    """The engine demo (`make run`): step the model for `slots` slots and print per-step figures."""
    cfg = load_preset(preset)
    device = _device(device_name)
    torch.set_num_threads(min(2, torch.get_num_threads()))
    print(f"Chorus engine demo: preset {preset}, {slots} slots, {steps} steps on {device} (dummy weights)")
    th = _build_thinker(cfg, slots, device)
    all_slots = torch.arange(slots, device=device)
    gen = torch.Generator(device=device).manual_seed(cfg.seed)
    ms, text_tokens = [], []
    for i in range(steps):
        audio = torch.randn(slots, cfg.thinker.hidden_size, device=device, generator=gen, dtype=th.dtype)
        _sync(device)
        t0 = time.perf_counter()
        out = th.step(audio, all_slots, dense=True)
        _sync(device)
        ms.append((time.perf_counter() - t0) * 1e3)
        text_tokens.append(out.text_token)
        if (i + 1) % 50 == 0:
            recent = _percentiles(ms[-50:])
            print(
                f"  step {i + 1:5d}/{steps}: p50 {recent['p50']:.2f} ms, p99 {recent['p99']:.2f} ms",
                flush=True,
            )
    stats = _percentiles(ms[5:] if len(ms) > 10 else ms)
    distinct = len(torch.unique(torch.stack(text_tokens)))
    summary = {
        "preset": preset,
        "device": str(device),
        "slots": slots,
        "steps": steps,
        "thinker_step_ms_p50": stats["p50"],
        "thinker_step_ms_p99": stats["p99"],
        "tick_budget_ms": TICK_MS,
        "distinct_text_tokens": distinct,
    }
    print(
        f"thinker step for {slots} slots: p50 {stats['p50']:.2f} ms, p99 {stats['p99']:.2f} ms (tick: 80 ms)"
    )
    print(json.dumps(summary))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m engine.bench", description=__doc__)
    parser.add_argument("what", choices=["thinker"])
    parser.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    parser.add_argument("--slots", default="1,16,64", help="comma-separated batch sizes")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    device = _device(args.device)
    cfg = load_preset(args.preset)
    sizes = [int(s) for s in args.slots.split(",")]
    with torch.inference_mode():
        res = bench_thinker(cfg, sizes, args.steps, args.warmup, device)
    out = {
        "bench": args.what,
        "preset": args.preset,
        "device": str(device),
        "threads": args.threads,
        **{f"step_ms_p50_{b}": r["p50"] for b, r in res.items()},
        **{f"step_ms_p99_{b}": r["p99"] for b, r in res.items()},
    }
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
