"""Decode attention: the masked reference (reads the whole ring) against the Triton kernel (reads each row's
filled length), at a few filled lengths and one ragged batch, on whatever device is present.

The reference's cost is the ring's whatever the lengths; the kernel's should follow them. On CPU the kernel
runs in the Triton interpreter (slow, small defaults: a smoke run); the figures that matter are the GPU's:

    python benchmarks/decode_attention.py --device cuda --ring 7500 --rows 64 [--dtype bf16]

Warm-up first, then `--repeats` timings of `--iters` back-to-back calls each; per-call p50/p99 in ms, and
for the kernel the bytes of K and V it has to read per call. The last stdout line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time


def _parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default=None, help="cuda or cpu (default: cuda when present)")
    ap.add_argument("--ring", type=int, default=None, help="ring size (default 7500 on cuda, 128 on cpu)")
    ap.add_argument("--rows", type=int, default=None, help="batch rows (default 64 on cuda, 2 on cpu)")
    ap.add_argument("--kv-heads", type=int, default=None, help="KV heads (default 16 on cuda, 2 on cpu)")
    ap.add_argument("--group", type=int, default=1, help="query heads per KV head (the talker's: 1)")
    ap.add_argument("--head-dim", type=int, default=72)
    ap.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    ap.add_argument("--fractions", default="0.01,0.1,0.5,1", help="filled lengths as fractions of the ring")
    ap.add_argument("--iters", type=int, default=None, help="calls per timing (default 50 cuda, 2 cpu)")
    ap.add_argument("--repeats", type=int, default=None, help="timings per case (default 20 cuda, 3 cpu)")
    return ap.parse_args()


def main() -> None:
    args = _parse()
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    cuda = device.startswith("cuda")
    if not cuda:
        # The interpreter must be chosen before Triton decorates the kernel, i.e. before the import below.
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from engine.kernels.decode_attention import decode_attention_ref, decode_attention_triton

    ring = args.ring or (7500 if cuda else 128)
    rows = args.rows or (64 if cuda else 2)
    hk = args.kv_heads or (16 if cuda else 2)
    iters = args.iters or (50 if cuda else 2)
    repeats = args.repeats or (20 if cuda else 3)
    g, d = args.group, args.head_dim
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    gen = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(rows, hk, g, d, generator=gen, device=device).to(dtype)
    k = torch.randn(rows, hk, ring, d, generator=gen, device=device).to(dtype)
    v = torch.randn(rows, hk, ring, d, generator=gen, device=device).to(dtype)
    scale = d**-0.5

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    def timed(fn) -> dict[str, float]:
        for _ in range(3):
            fn()
        sync()
        per_call = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            for _ in range(iters):
                fn()
            sync()
            per_call.append((time.perf_counter() - t0) / iters * 1e3)
        per_call.sort()
        p99 = per_call[min(len(per_call) - 1, round(0.99 * (len(per_call) - 1)))]
        return {"p50_ms": statistics.median(per_call), "p99_ms": p99}

    cases = {f"len={max(1, round(float(f) * ring))}": None for f in args.fractions.split(",")}
    cases["ragged"] = None
    results = {}
    for name in cases:
        if name == "ragged":
            lengths = torch.randint(1, ring + 1, (rows,), generator=gen, device=device)
        else:
            lengths = torch.full((rows,), int(name.split("=")[1]), device=device)
        ref = timed(lambda lengths=lengths: decode_attention_ref(q, k, v, lengths, scale))
        tri = timed(lambda lengths=lengths: decode_attention_triton(q, k, v, lengths, scale))
        filled = int(lengths.sum())  # outside the timed calls
        kv_bytes = 2 * filled * hk * d * k.element_size()
        diff = (
            decode_attention_triton(q, k, v, lengths, scale).double()
            - decode_attention_ref(q, k, v, lengths, scale)
        ).abs()
        results[name] = {
            "ref": ref,
            "kernel": tri,
            "speedup_p50": ref["p50_ms"] / tri["p50_ms"],
            "kernel_kv_bytes": kv_bytes,
            "kernel_gb_per_s": kv_bytes / (tri["p50_ms"] * 1e-3) / 1e9,
            "max_abs_diff": diff.max().item(),
        }
        print(
            f"{name:>10}: ref p50 {ref['p50_ms']:.3f} ms, kernel p50 {tri['p50_ms']:.3f} ms "
            f"(p99 {tri['p99_ms']:.3f}), x{results[name]['speedup_p50']:.2f}, "
            f"{results[name]['kernel_gb_per_s']:.1f} GB/s of K/V, "
            f"max diff {results[name]['max_abs_diff']:.2e}"
        )
    summary = {
        "bench": "decode_attention",
        "device": torch.cuda.get_device_name(device) if cuda else "cpu (Triton interpreter)",
        "shape": {"rows": rows, "kv_heads": hk, "group": g, "ring": ring, "head_dim": d, "dtype": args.dtype},
        "iters": iters,
        "repeats": repeats,
        "cases": results,
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
