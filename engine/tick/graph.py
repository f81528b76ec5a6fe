"""The live step as one CUDA graph, the slack work as one graph per bucket, and the audit that says whether a
step can be captured at all.

`StepGraph` wraps a step function over static input tensors (the runner's device buffers, filled in place
before each call). On CUDA it warms the step up on a side stream, captures it once as a CUDA graph and
replays it: one launch per live step instead of thousands. Elsewhere, or with capture off, it calls the same
function eagerly on the same buffers; both return the same outputs. Warm-up runs with every slot inactive,
which leaves every slot's state as it was (the thinker's scratch row aside): `audit_step` checks that too.

`StepGraphs` holds the slack work's steps (tool-call tokens, prefill chunks, replay) the same way, one
`StepGraph` per bucket: rows padded to a power of two, a chunk's positions split into powers of two
(`pow2_at_least`, `pow2_pieces`), each captured on first use into one memory pool that the buckets share.

`audit_step` runs a step once under a dispatch mode and lists what would break a capture, on any device:
host syncs (`.item()`, `nonzero`, boolean-mask indexing: data-dependent shapes), tensors made from Python
data (a host-to-device copy mid-capture), copies between devices, and state tensors that were reallocated
instead of updated in place. Its operator count is the eager step's launch count, near enough.
Knows torch only.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

log = logging.getLogger("chorus.graph")

# Operators that read device data on the host (a sync) or make shapes depend on it.
HOST_SYNC_OPS = frozenset(
    {
        "aten._local_scalar_dense",  # .item(), int(t), bool(t)
        "aten.nonzero",
        "aten.nonzero_static",
        "aten.masked_select",
        "aten.unique",
        "aten._unique",
        "aten._unique2",
        "aten.unique_consecutive",
        "aten.unique_dim",
        "aten.equal",
        "aten.is_nonzero",
        "aten.allclose",
    }
)
FROM_PYTHON_OPS = frozenset({"aten.lift_fresh", "aten.lift_fresh_copy", "aten.lift"})  # torch.tensor(data)
_INDEX_OPS = frozenset({"aten.index", "aten.index_put_", "aten.index_put", "aten._index_put_impl_"})


@dataclass
class StepAudit:
    """What one step did, as far as capturing it goes."""

    ops: int = 0  # operators dispatched: about the kernels an eager step launches
    by_op: Counter = field(default_factory=Counter)
    problems: list[str] = field(default_factory=list)  # empty: nothing found that a capture would refuse

    @property
    def capturable(self) -> bool:
        return not self.problems


class _Audit(TorchDispatchMode):
    def __init__(self, report: StepAudit) -> None:
        super().__init__()
        self.report = report

    def _flag(self, what: str) -> None:
        if what not in self.report.problems:
            self.report.problems.append(what)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = str(func.overloadpacket)
        self.report.ops += 1
        self.report.by_op[name] += 1
        if name in HOST_SYNC_OPS:
            self._flag(f"{name}: reads device data on the host")
        elif (
            name == "aten.repeat_interleave"
            and "output_size" not in kwargs
            and any(isinstance(a, torch.Tensor) and a.dim() > 0 for a in args[1:2])
        ):  # repeats given as a tensor: the output's size is read from the device
            self._flag(f"{name} with tensor repeats: reads device data on the host")
        elif name in FROM_PYTHON_OPS and args and isinstance(args[0], torch.Tensor) and args[0].dim() > 0:
            # (a 0-d one is a wrapped Python scalar, as in `x[i] = 0`: a kernel argument, not a copy)
            self._flag(f"{name}: a tensor made from Python data (a host-to-device copy)")
        elif name in _INDEX_OPS and len(args) > 1:
            indices = args[1] if isinstance(args[1], list | tuple) else [args[1]]
            if any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices):
                self._flag(f"{name} with a boolean mask: its shape depends on the data")
        elif name in ("aten.copy_", "aten._to_copy"):
            src = args[1] if name == "aten.copy_" and len(args) > 1 else args[0]
            dst_device = args[0].device if name == "aten.copy_" else kwargs.get("device", src.device)
            if (
                isinstance(src, torch.Tensor)
                and dst_device is not None
                and torch.device(dst_device) != src.device
            ):
                self._flag(f"{name} from {src.device} to {dst_device}: a transfer inside the step")
        return func(*args, **kwargs)


def audit_step(
    fn: Callable[..., Any],
    args: Sequence[Any],
    state: Callable[[], Sequence[torch.Tensor]] = tuple,
) -> StepAudit:
    """Run `fn(*args)` once (it does its work: use scratch state or a step you mean to take) and report what
    would stop it from being captured as a CUDA graph. `state()` lists the state tensors as the step's owner
    holds them, before and after: each must be the same memory, updated in place."""
    report = StepAudit()
    before = [(t.data_ptr(), tuple(t.shape), t.dtype) for t in state()]
    with _Audit(report):
        fn(*args)
    after = [(t.data_ptr(), tuple(t.shape), t.dtype) for t in state()]
    moved = len(after) != len(before) or sum(1 for a, b in zip(after, before, strict=True) if a != b)
    if moved:
        report.problems.append(f"{moved} state tensors were reallocated instead of updated in place")
    return report


class StepGraph:
    """`fn(*inputs)` over fixed input tensors, captured as a CUDA graph on CUDA when `capture` is on, eager
    otherwise. Call it after filling the inputs in place; passing tensors copies them in (their shapes, dtypes
    and devices must match the static ones). The outputs are the graph's own buffers: read them before the
    next call. `prepare_warmup(inputs)` puts the inputs in a state whose step changes nothing (every slot
    inactive); it runs before the warm-up and the capture."""

    def __init__(
        self,
        fn: Callable[..., Any],
        inputs: Sequence[torch.Tensor],
        *,
        capture: bool = True,
        warmup: int = 3,
        prepare_warmup: Callable[[Sequence[torch.Tensor]], None] | None = None,
        pool: Any = None,
        name: str = "live step",
    ) -> None:
        self.fn = fn
        self.inputs = tuple(inputs)
        self._spec = [(tuple(t.shape), t.dtype, t.device) for t in self.inputs]
        devices = {t.device.type for t in self.inputs}
        self.captured = bool(capture) and devices == {"cuda"} and torch.cuda.is_available()
        self.graph: torch.cuda.CUDAGraph | None = None
        self.outputs: Any = None
        self.replays = 0
        self.pool, self.name = pool, name
        if self.captured:
            self._capture(warmup, prepare_warmup)

    def _capture(self, warmup: int, prepare: Callable[[Sequence[torch.Tensor]], None] | None) -> None:
        saved = [t.clone() for t in self.inputs]
        if prepare is not None:
            prepare(self.inputs)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side), torch.inference_mode():
            for _ in range(
                max(1, warmup)
            ):  # lazy inits, cuBLAS workspaces, Triton autotuning: before capture
                self.fn(*self.inputs)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool), torch.inference_mode():
            self.outputs = self.fn(*self.inputs)
        self.graph = graph
        for t, s in zip(self.inputs, saved, strict=True):
            t.copy_(s)
        log.info("%s captured as a CUDA graph (%d inputs)", self.name, len(self.inputs))

    def __call__(self, *inputs: torch.Tensor) -> Any:
        if inputs:
            if len(inputs) != len(self.inputs):
                raise ValueError(f"step graph: {len(inputs)} inputs given, it takes {len(self.inputs)}")
            for i, (t, static, (shape, dtype, device)) in enumerate(
                zip(inputs, self.inputs, self._spec, strict=True)
            ):
                if (tuple(t.shape), t.dtype, t.device) != (shape, dtype, device):
                    raise ValueError(
                        f"step graph: input {i} is {tuple(t.shape)} {t.dtype} on {t.device}, "
                        f"the step was made for {shape} {dtype} on {device}"
                    )
                if t is not static:
                    static.copy_(t)
        if self.graph is None:
            return self.fn(*self.inputs)
        self.graph.replay()
        self.replays += 1
        return self.outputs


def pow2_at_least(n: int) -> int:
    """The smallest power of two >= n (n >= 1): a batch of n rows runs in that bucket, padded."""
    if n < 1:
        raise ValueError(f"a bucket holds at least one row, got {n}")
    return 1 << (n - 1).bit_length()


def pow2_pieces(n: int) -> list[int]:
    """n as a sum of distinct powers of two, largest first (11 -> [8, 2, 1]): a chunk of n positions runs as
    those pieces, each a bucket of its own."""
    if n < 1:
        raise ValueError(f"a chunk holds at least one position, got {n}")
    return [1 << b for b in range(n.bit_length() - 1, -1, -1) if n >> b & 1]


class StepGraphs:
    """One `StepGraph` per bucket key, made on first use by `make(key) -> (fn, inputs, prepare_warmup)`.

    On CUDA (with `capture`) the buckets' graphs share one memory pool: slack work runs one piece at a time
    and its outputs are read before the next, so one bucket's scratch memory serves them all. Elsewhere each
    bucket is its step called eagerly over its own static inputs."""

    def __init__(
        self,
        make: Callable[[Any], tuple[Callable[..., Any], Sequence[torch.Tensor], Callable | None]],
        *,
        capture: bool = True,
        warmup: int = 2,
    ) -> None:
        self.make, self.capture, self.warmup = make, capture, warmup
        self.graphs: dict[Any, StepGraph] = {}
        self._pool = None

    def __getitem__(self, key: Any) -> StepGraph:
        graph = self.graphs.get(key)
        if graph is None:
            with torch.inference_mode(False):  # static inputs the runner fills in place, in any mode
                fn, inputs, prepare = self.make(key)
            if self.capture and self._pool is None and {t.device.type for t in inputs} == {"cuda"}:
                self._pool = torch.cuda.graph_pool_handle()
            graph = StepGraph(
                fn,
                inputs,
                capture=self.capture,
                warmup=self.warmup,
                prepare_warmup=prepare,
                pool=self._pool,
                name=f"slack step {key}",
            )
            self.graphs[key] = graph
        return graph

    @property
    def captured(self) -> int:
        return sum(g.captured for g in self.graphs.values())
