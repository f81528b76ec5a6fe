"""`python -m benchmarks.step_ops`: the operators that launch work in one live step, a CPU proxy for the
kernels the step launches on a GPU.

The pipeline is built on the `meta` device (shapes only: the 11B shape at 64 slots needs no memory) in the
policy a GPU serves with, and one live step runs under a dispatch mode that counts the aten operators it
reaches. The rule: an operator counts once unless it launches no work, that is unless its result is a view
of an input (view, slice, select, transpose, expand, split, ...) or the input itself (a `to` or `reshape`
that changes nothing). A composite operator the dispatcher sees whole (linear, rms_norm, layer_norm) counts
once, as it is one kernel (or one GEMM with its epilogue) on the GPU; a Triton kernel counts once, as the
output it allocates on meta (an in-place one, the KV ring write, as one empty write on meta). `--top N` lists
the N most frequent operators, `--where` the lines of engine/ that launch them (where the operators to fuse
are). Last line: one JSON object.
Knows the pipeline and the dispatcher; nothing of sessions.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from engine.config.dtype_policy import DTYPE_POLICIES, dtype_policy
from engine.config.presets import PRESETS, load_preset

DEFAULT_PRESET = "nemotron-voicechat-11b"


def _storage(t: object) -> int | None:
    return t.untyped_storage()._cdata if isinstance(t, torch.Tensor) else None


_ENGINE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "engine") + os.sep


def _engine_line() -> str:
    """The innermost caller in engine/ outside its kernels' dispatch: `path:line (function)`."""
    frame = sys._getframe(2)
    while frame is not None:
        path = frame.f_code.co_filename
        if path.startswith(_ENGINE) and os.sep + "kernels" + os.sep not in path:
            return f"{path.removeprefix(_ENGINE)}:{frame.f_lineno} ({frame.f_code.co_name})"
        frame = frame.f_back
    return "(outside engine/)"


class _WorkCounter(TorchDispatchMode):
    """Counts the operators that launch work, by name (and by the engine line that launched them, with
    `where`)."""

    def __init__(self, where: bool = False) -> None:
        super().__init__()
        self.by_op: Counter = Counter()
        self.by_line: Counter | None = Counter() if where else None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        returns = func._schema.returns
        alias = returns[0].alias_info if returns else None
        if alias is None or not alias.is_write:  # in-place and out= operators always write
            first = out[0] if isinstance(out, list | tuple) and out else out
            inputs = {_storage(a) for a in (*args, *kwargs.values())} - {None}
            if _storage(first) in inputs:
                return out  # a view of an input, or the input itself: no kernel
        self.by_op[str(func.overloadpacket)] += 1
        if self.by_line is not None:
            self.by_line[_engine_line()] += 1
        return out


def count_step_ops(
    preset: str = DEFAULT_PRESET, slots: int = 64, dtype: str = "capacity", where: bool = False
) -> Counter:
    """The work operators of one live step of `preset` at `slots` slots, every slot active, by name (`where`:
    by the engine line that launched them)."""
    from engine.model.pipeline import Pipeline, live_inputs
    from engine.text.tokens import Tokens

    cfg = load_preset(preset)
    dtypes = dtype_policy(dtype, "cuda", dtype == "capacity")
    with torch.device("meta"):
        p = Pipeline(cfg, slots, Tokens(cfg.tokens), dtypes).eval()
    static = live_inputs(cfg, slots, "meta")
    counter = _WorkCounter(where)
    with torch.inference_mode(), counter:
        p.live_step(*static)
    return counter.by_line if where else counter.by_op


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.step_ops", description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default=DEFAULT_PRESET, choices=sorted(PRESETS))
    ap.add_argument("--slots", type=int, default=64)
    ap.add_argument("--dtype", default="capacity", choices=sorted(DTYPE_POLICIES))
    ap.add_argument("--top", type=int, default=12, help="list the N most frequent operators (default 12)")
    ap.add_argument("--where", action="store_true", help="also list the engine lines that launch them")
    args = ap.parse_args(argv)
    by_op = count_step_ops(args.preset, args.slots, args.dtype)
    total = sum(by_op.values())
    print(f"{args.preset} at {args.slots} slots ({args.dtype}): {total} work operators per live step")
    for name, n in by_op.most_common(args.top):
        print(f"  {n:6d}  {name}")
    if args.where:
        print("by line:")
        for line, n in count_step_ops(args.preset, args.slots, args.dtype, where=True).most_common():
            print(f"  {n:6d}  {line}")
    out = {
        "bench": "step_ops",
        "preset": args.preset,
        "slots": args.slots,
        "dtype": args.dtype,
        "work_ops": total,
        "top_ops": dict(by_op.most_common(args.top)),
    }
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
