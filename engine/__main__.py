"""`python -m engine info`: size a preset (parameters, weight and state bytes, sessions per GPU, and with
`--slots` the predicted peak memory). Knows the presets and the sizing (engine/sizing/info.py,
engine/memory.py); builds no engine. The engine's benchmarks and demo are under benchmarks/
(docs/benchmarks.md)."""

from __future__ import annotations

import argparse
import json
import sys

from engine.config.presets import PRESETS, load_preset
from engine.config.windows import add_window_arguments, windows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m engine", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    info = sub.add_parser("info", help="parameters, weight and state bytes, sessions per GPU")
    info.add_argument("--preset", default="nemotron-voicechat-11b", choices=sorted(PRESETS))
    info.add_argument(
        "--gpu-mem-gb",
        type=float,
        default=141.0,
        help="GPU memory to size for, in GB (10**9 bytes; H200: 141, H100: 80)",
    )
    info.add_argument(
        "--slots",
        type=int,
        default=None,
        help="also predict the peak device memory with this many slots (traced on the meta device: seconds)",
    )
    add_window_arguments(info)
    args = parser.parse_args(argv)

    from engine.sizing.info import print_report, report

    policy = "capacity" if args.capacity else "gpu"  # the GPU's policies ("auto" on CUDA)
    cfg = windows(load_preset(args.preset), args)
    r = report(cfg, args.gpu_mem_gb, policy)
    print_report(r)
    if args.slots:
        from engine.memory import peak_report, print_peak

        r["peak"] = peak_report(cfg, r, args.slots)
        print_peak(r["peak"])
    print(json.dumps(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
