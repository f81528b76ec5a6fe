"""Peak resident memory while streaming a ~1 GB release-format checkpoint into the pipeline on the CPU.

A mid-size preset (the tiny one with a 131072-token, 640-wide thinker: ~1.0 GB of fp32 weights) is written in
release names by one process (its own dummy weights, one tensor at a time), then a fresh process builds the
pipeline, resets its peak-RSS mark (/proc/self/clear_refs 5, Linux) and loads the file. The model itself is
1x the checkpoint; what loading adds on top is the figure. `peak_over_checkpoint` leaves out the interpreter's
own resident memory (Python, torch and Chorus imported, 0.3-0.5 GB depending on the machine), which does not
grow with the checkpoint. The last stdout line is one JSON object.

    python benchmarks/load_checkpoint.py [--out /tmp/chorus-load-bench]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

OVERRIDES = {"thinker": {"hidden_size": 640, "vocab_size": 131_072, "intermediate_size": 2048}}


def build(num_slots: int = 2):
    from engine.config.presets import load_preset
    from engine.model.pipeline import Pipeline
    from engine.text.tokens import Tokens

    base = load_preset("tiny")
    cfg = load_preset("tiny", thinker={**base.thinker.model_dump(), **OVERRIDES["thinker"]})
    return cfg, Pipeline(cfg, num_slots, Tokens(cfg.tokens))


def write(folder: Path) -> int:
    """The pipeline's own weights in release names, streamed one tensor at a time; returns the file size."""
    from engine.model.checkpoint import write_header_only
    from engine.model.release_config import CONFIG_FILE, release_config
    from engine.model.weights import targets

    cfg, p = build()
    table = targets(p)
    shapes = {}
    for name, (_, t) in table.items():
        shape = (1, *t.shape) if name.startswith("tts_model.audio_prompt_latents.") else tuple(t.shape)
        shapes[name] = (shape, t.dtype)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "model.safetensors"
    size = write_header_only(path, shapes)
    data_start = size - sum(t.numel() * t.element_size() for _, t in table.values())
    with open(path, "r+b") as f:
        f.seek(data_start)
        for _, t in table.values():
            f.write(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    (folder / CONFIG_FILE).write_text(json.dumps(release_config(cfg)))
    return size


def _status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def measure(folder: Path) -> dict:
    import gc

    import engine.model.pipeline  # noqa: F401 (the interpreter's own memory: torch and Chorus imported)
    from engine.model.weights import load_checkpoint

    gc.collect()
    interpreter = _status("VmRSS")
    _, p = build()

    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # the build's freed temporaries go back to the system first
    Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM: the peak from here on
    before = _status("VmRSS")
    t0 = time.perf_counter()
    report = load_checkpoint(p, folder)
    seconds = time.perf_counter() - t0
    peak = _status("VmHWM")
    size = (folder / "model.safetensors").stat().st_size
    return {
        "checkpoint_bytes": size,
        "tensors": len(report.consumed),
        "rss_interpreter_bytes": interpreter,  # Python, torch and Chorus imported, no model yet
        "rss_before_load_bytes": before,
        "peak_rss_during_load_bytes": peak,
        "added_by_loading_bytes": peak - before,
        # the model and its loading, the interpreter's fixed cost left out: 1x is the model itself
        "peak_over_checkpoint": round((peak - interpreter) / size, 3),
        "peak_with_interpreter_over_checkpoint": round(peak / size, 3),
        "load_s": round(seconds, 2),
        "rate_mib_s": round(size / 2**20 / seconds, 1),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default="/tmp/chorus-load-bench")
    ap.add_argument("--step", choices=["all", "write", "measure"], default="all")
    args = ap.parse_args()
    folder = Path(args.out)
    if args.step == "write":
        print(json.dumps({"written_bytes": write(folder)}))
        return 0
    if args.step == "measure":
        print(json.dumps(measure(folder)))
        return 0
    for step in ("write", "measure"):  # separate processes: the writer's memory is not the loader's
        out = subprocess.run(
            [sys.executable, __file__, "--out", str(folder), "--step", step],
            check=True,
            capture_output=True,
            text=True,
        )
    result = json.loads(out.stdout.strip().splitlines()[-1])
    for k, v in result.items():
        print(f"{k:>28}: {v:,}" if isinstance(v, int) else f"{k:>28}: {v}")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
