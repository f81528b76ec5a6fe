"""The engine's benchmarks: `python -m benchmarks.engine_bench thinker|pipeline|serve`.

Each warms up first, reports p50/p99 milliseconds against the 80 ms tick, and prints one JSON object as
its last line. Dummy weights: the timing of a dummy model of a shape is the timing of the real one. Knows
the pipeline's stages and the engine (serve: benchmarks/engine_serve.py); nothing of LiveKit.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from benchmarks.engine_serve import add_arguments, main_serve
from engine.config.dtype_policy import DTYPE_POLICIES, DtypePolicy, dtype_policy
from engine.config.presets import PRESETS, load_preset
from engine.config.stage_config import ModelConfig
from engine.config.windows import add_window_arguments, windows
from engine.process.malloc import tune_malloc

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


def _build_thinker(cfg: ModelConfig, slots: int, device: torch.device, dtypes: DtypePolicy):
    from engine.model.pipeline import DTYPES
    from engine.model.thinker import Thinker

    with torch.device(device):
        th = Thinker(
            cfg.thinker, slots, pad_id=12, dtype=DTYPES[dtypes.thinker], kv_dtype=DTYPES[dtypes.thinker_kv]
        )
    th.init_dummy(cfg.seed)
    return th.eval()


def bench_thinker(
    cfg: ModelConfig,
    batch_sizes: list[int],
    steps: int,
    warmup: int,
    device: torch.device,
    dtypes: DtypePolicy = DTYPE_POLICIES["fp32"],
) -> dict:
    """Live steps of the thinker alone at each batch size, every slot executed."""
    results = {}
    for b in batch_sizes:
        th = _build_thinker(cfg, b, device, dtypes)
        active = torch.ones(b, dtype=torch.bool, device=device)
        audio = torch.randn(b, cfg.thinker.hidden_size, device=device, dtype=th.dtype)
        ms = []
        for i in range(warmup + steps):
            _sync(device)
            t0 = time.perf_counter()
            th.step(audio, active)
            _sync(device)
            if i >= warmup:
                ms.append((time.perf_counter() - t0) * 1e3)
        results[b] = _percentiles(ms)
        print(
            f"thinker  slots={b:<3d} p50 {results[b]['p50']:7.2f} ms  p99 {results[b]['p99']:7.2f} ms",
            flush=True,
        )
    return results


def bench_pipeline(args) -> int:
    """Per-stage p50/p99 of the live step at each batch size (all rows active)."""
    from engine.model.pipeline import Pipeline
    from engine.text.tokens import Tokens

    cfg = windows(load_preset(args.preset), args)
    device = _device(args.device)
    dtypes = dtype_policy(args.dtype, device.type, args.capacity)
    sizes = [int(s) for s in args.slots.split(",")]
    out = {
        "bench": "pipeline",
        "talker_window": cfg.talker.attention_window,
        "preset": args.preset,
        "device": str(device),
        "threads": args.threads,
        "dtype": dtypes.name,
    }
    rng = torch.Generator().manual_seed(0)
    for b in sizes:
        try:
            with torch.device(device):
                p = Pipeline(cfg, b, Tokens(cfg.tokens), dtypes)
        except torch.OutOfMemoryError:
            out[f"oom_{b}"] = True
            print(f"slots={b:<3d} out of device memory building the pipeline", flush=True)
            _free(device)
            continue
        p.eval()
        p.prepare()
        active = torch.ones(b, dtype=torch.bool, device=device)
        minus = torch.full((b,), -1, dtype=torch.long, device=device)
        stages = {"perception": [], "thinker": [], "talker": [], "codec": [], "total": []}
        with torch.inference_mode():
            for i in range(args.warmup + args.steps):
                audio = (0.1 * torch.randn(b, cfg.clock.input_samples, generator=rng)).to(device)
                t = [time.perf_counter()]
                emb = p.perception.step(audio, active)
                _sync(device)
                t.append(time.perf_counter())
                o = p.thinker.step(emb, active, minus, minus)
                _sync(device)
                t.append(time.perf_counter())
                codes = p.talker.step(o.text_token, active)
                _sync(device)
                t.append(time.perf_counter())
                p.codec.step(codes, active)
                _sync(device)
                t.append(time.perf_counter())
                if i >= args.warmup:
                    for name, a, z in zip(stages, t, t[1:]):
                        stages[name].append((z - a) * 1e3)
                    stages["total"].append((t[-1] - t[0]) * 1e3)
        line = []
        for name, ms in stages.items():
            st = _percentiles(ms)
            out[f"{name}_ms_p50_{b}"], out[f"{name}_ms_p99_{b}"] = st["p50"], st["p99"]
            line.append(f"{name} {st['p50']:.2f}/{st['p99']:.2f}")
        if device.type == "cuda" and args.graph:
            st = _percentiles(_graphed_step_ms(p, b, device, args.warmup, args.steps))
            out[f"graph_ms_p50_{b}"], out[f"graph_ms_p99_{b}"] = st["p50"], st["p99"]
            line.append(f"graphed step {st['p50']:.2f}/{st['p99']:.2f}")
        if device.type == "cuda":
            from engine.memory import predict_peak_bytes

            out[f"peak_gb_{b}"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 3)
            out[f"predicted_gb_{b}"] = round(predict_peak_bytes(cfg, dtypes, b, live_only=True)[0] / 2**30, 3)
            line.append(f"peak {out[f'peak_gb_{b}']} GiB (predicted {out[f'predicted_gb_{b}']})")
        print(f"slots={b:<3d} p50/p99 ms: " + ", ".join(line), flush=True)
        del p
        _free(device)
    print(json.dumps(out))
    return 0


def _free(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def _graphed_step_ms(p, b: int, device: torch.device, warmup: int, steps: int) -> list[float]:
    """The whole live step as one captured CUDA graph (engine/tick/graph.py), replayed: wall ms per step."""
    from engine.model.pipeline import all_inactive, live_inputs
    from engine.tick.graph import StepGraph

    static = live_inputs(p.cfg, b, device)
    step = StepGraph(p.live_step, static, prepare_warmup=all_inactive)
    ms = []
    for i in range(warmup + steps):
        static[0].normal_(0.0, 0.1)
        _sync(device)
        t0 = time.perf_counter()
        step()
        _sync(device)
        if i >= warmup:
            ms.append((time.perf_counter() - t0) * 1e3)
    return ms


def main(argv: list[str] | None = None) -> int:
    tune_malloc()  # the allocator the engine runs with, for the stages measured without an engine too
    parser = argparse.ArgumentParser(prog="python -m benchmarks.engine_bench", description=__doc__)
    parser.add_argument("what", choices=["thinker", "pipeline", "serve"])
    parser.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    parser.add_argument("--slots", default="1,16,64", help="comma-separated batch sizes")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument(
        "--threads", type=int, default=1, help="CPU intra-op threads (the engine's default: 1)"
    )
    parser.add_argument("--device", default=None)
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", *DTYPE_POLICIES],
        help="dtype policy of the thinker and pipeline benches (auto: gpu on CUDA)",
    )
    parser.add_argument(
        "--no-graph", dest="graph", action="store_false", help="pipeline: skip the captured-graph timing"
    )
    add_arguments(parser)
    add_window_arguments(parser)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.what == "serve":
        return main_serve(args)
    if args.what == "pipeline":
        return bench_pipeline(args)
    device = _device(args.device)
    dtypes = dtype_policy(args.dtype, device.type, args.capacity)
    cfg = load_preset(args.preset)
    sizes = [int(s) for s in args.slots.split(",")]
    with torch.inference_mode():
        res = bench_thinker(cfg, sizes, args.steps, args.warmup, device, dtypes)
    out = {
        "bench": args.what,
        "preset": args.preset,
        "device": str(device),
        "threads": args.threads,
        "dtype": dtypes.name,
        **{f"step_ms_p50_{b}": r["p50"] for b, r in res.items()},
        **{f"step_ms_p99_{b}": r["p99"] for b, r in res.items()},
    }
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
