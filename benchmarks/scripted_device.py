"""A device double: a GPU as the tick's host sees it, on a simulated clock, with scripted costs.

A piece of work handed to the device returns at once (a launch); the device runs the pieces one after the
other, each for its scripted cost, and the host pays for them only when it reads something back: the live
step's copy to the host, a tool-call step's tokens, the tick's fence. This is what makes a GPU's slack work
run into the next live step, and what a CPU engine (every piece synchronous) never shows.

`ScriptedRunner` stands where `engine.tick.runner.Runner` stands, with the same interface and the same split
of work into buckets (rows padded to a power of two, a prefill in groups of rows and power-of-two pieces of
positions); the scheduler and the tick (`engine.tick.ticker.Ticker`) are the real ones
(benchmarks/scripted_serve.py drives them). Costs come from a JSON file (benchmarks/device_costs/h100.json:
`derive_costs` below says how they were derived); `side_scale` multiplies every side piece's cost.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from engine.tick.buckets import MAX_PREFILL_ROWS, MAX_REPLAY_FRAMES, prefill_pieces, work_buckets
from engine.tick.graph import pow2_at_least
from engine.tick.plan import LivePlan, LiveResult, ToolResult, ToolWork
from engine.tick.prompt_cache import PromptCache

COSTS_DIR = Path(__file__).parent / "device_costs"


class SimClock:
    """Seconds on a simulated clock: moves only when told (the host's work, a wait for the device)."""

    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, s: float) -> None:
        self.now += s

    def until(self, t: float) -> None:
        self.now = max(self.now, t)


@dataclass
class DeviceCosts:
    """Milliseconds per piece on the device, by bucket key `kind/rows x positions`, and the live step's at
    1 and at `slots` slots (a graph computes every row: its cost depends on the slots, not on who is live)."""

    slots: int
    live_ms: dict[int, float]
    buckets: dict[str, float]
    launch_ms: float = 0.05  # host time to hand the device one piece
    restore_ms: float = 0.06  # device time to load one slot's cached prompt state
    source: str = ""
    derivation: dict = field(default_factory=dict)

    @classmethod
    def load(cls, path: str | Path) -> DeviceCosts:
        raw = json.loads(Path(path).read_text())
        return cls(
            slots=int(raw["slots"]),
            live_ms={int(k): float(v) for k, v in raw["live_ms"].items()},
            buckets={k: float(v) for k, v in raw["buckets"].items()},
            launch_ms=float(raw.get("launch_ms", 0.05)),
            restore_ms=float(raw.get("restore_ms", 0.06)),
            source=raw.get("source", ""),
            derivation=raw.get("derivation", {}),
        )

    def live(self, slots: int) -> float:
        """The live step at `slots` slots: linear between the measured sizes."""
        (a, ma), (b, mb) = sorted(self.live_ms.items())[0], sorted(self.live_ms.items())[-1]
        return ma + (mb - ma) * (slots - a) / max(1, b - a)

    def side(self, kind: str, rows: int, positions: int) -> float:
        return self.buckets[bucket_key(kind, rows, positions)]


def bucket_key(kind: str, rows: int, positions: int) -> str:
    return f"{kind}/{rows}x{positions}"


def derive_costs(
    live_1: float = 19.6,
    live_64: float = 46.4,
    shares: dict[str, float] | None = None,
    slots: int = 64,
    max_chunk: int = 512,
    weights_gb: float = 23.0,
    ridge_tokens: int = 150,
) -> dict:
    """The H100's costs per bucket, derived from the step's per-stage figures (docs/verification.md, "The
    GPU check": the graphed step 19.6 ms at 1 slot, 46.4 ms at 64; eager at 1 slot perception 15.4, thinker
    15.3, talker 16.6, codec 2.4 ms).

    A stage's share of the graphed step is its share of the eager one. The graphed step is `fixed + per_row x
    rows` (19.6 at 1 row, 46.4 at 64: 19.18 + 0.425 per row); a stage costs its share of both. The thinker's
    fixed part at 1 row (6.0 ms) is its weights read once (about 18 GB of the 23 GB of bf16 weights at 3.35
    TB/s is 5.4 ms): it is memory-bound. A side piece is then:
    - call, b rows: one thinker step over b rows: thinker share x (fixed + per_row x b);
    - replay, b rows x k frames: perception and the thinker over the b rows replayed (the rows' state
      gathered into a batch of b), k times (each frame's step reads the weights again);
    - result and prompt, b rows x t positions in one forward: the thinker's fixed part, scaled up once the
      b x t positions pass the point where its matrix products stop being memory-bound (`ridge_tokens`,
      about half the H100's bf16 FLOP-per-byte ratio of 295), plus the thinker's per-row part for each row.
    """
    shares = shares or {"perception": 15.4, "thinker": 15.3, "talker": 16.6, "codec": 2.4}
    total = sum(shares.values())
    share = {k: v / total for k, v in shares.items()}
    per_row = (live_64 - live_1) / 63
    fixed = live_1 - per_row

    def stage(name: str, rows: int) -> float:
        return share[name] * (fixed + per_row * rows)

    buckets: dict[str, float] = {}
    most = pow2_at_least(slots)
    row_sizes = [1 << i for i in range(most.bit_length())]
    for r in row_sizes:
        buckets[bucket_key("call", r, 1)] = stage("thinker", r)
        for i in range(MAX_REPLAY_FRAMES.bit_length()):  # k frames a row: k frame-steps, in order
            one = stage("perception", r) + stage("thinker", r)
            buckets[bucket_key("replay", r, 1 << i)] = (1 << i) * one
    for r in row_sizes:
        if r > MAX_PREFILL_ROWS:
            break
        longest = max(prefill_pieces(max_chunk, r))
        for i in range(longest.bit_length()):
            t = 1 << i
            cost = share["thinker"] * fixed * max(1.0, r * t / ridge_tokens) + share["thinker"] * per_row * r
            for kind in ("result", "prompt"):
                buckets[bucket_key(kind, r, t)] = cost
    return {
        "source": "H100 80GB HBM3, dummy weights at the 11B shape, capacity mode (docs/verification.md)",
        "slots": slots,
        "live_ms": {"1": live_1, str(slots): live_64},
        "launch_ms": 0.05,
        "restore_ms": round(0.19e9 / 3.35e12 * 1e3, 3),  # one slot's state (0.19 GB) at 3.35 TB/s
        "derivation": {
            "stage_shares": {k: round(v, 4) for k, v in share.items()},
            "step_fixed_ms": round(fixed, 3),
            "step_per_row_ms": round(per_row, 4),
            "weights_gb": weights_gb,
            "ridge_tokens": ridge_tokens,
            "how": derive_costs.__doc__.split("\n\n", 1)[1].strip(),
        },
        "buckets": {k: round(v, 3) for k, v in buckets.items()},
    }


class ScriptedDevice:
    """One in-order queue of work on a simulated clock: `launch` queues a piece (the host pays `launch_ms`),
    `read` waits for everything queued (a copy to the host). Keeps every piece's start and end, the way CUDA
    events would."""

    def __init__(self, clock: SimClock, launch_ms: float) -> None:
        self.clock = clock
        self.launch_s = launch_ms / 1000
        self.free_at = 0.0  # when the work queued so far ends
        self.busy_s = 0.0

    def launch(self, ms: float) -> tuple[float, float]:
        """Queue `ms` of device work; returns its (start, end) on the simulated clock."""
        self.clock.advance(self.launch_s)
        start = max(self.clock.now, self.free_at)
        self.free_at = start + ms / 1000
        self.busy_s += ms / 1000
        return start, self.free_at

    def read(self) -> None:
        """The host waits for everything queued (a read back)."""
        self.clock.until(self.free_at)


class ScriptedRunner:
    """`engine.tick.runner.Runner`'s interface over a `ScriptedDevice`: the live step and every side piece
    queued at their scripted costs; the live step's outputs (and a call step's tokens) are read back. The
    live step's text is PAD and its function token the forced one (PAD where none), a call step's function
    token the forced one: the workload forces its calls, as the serving benchmark does."""

    asynchronous = True  # pieces return before the device has run them

    def __init__(
        self, costs: DeviceCosts, clock: SimClock, pad: int, slots: int, side_scale: float = 1.0
    ) -> None:
        self.costs, self.clock, self.pad, self.S = costs, clock, pad, slots
        self.side_scale = side_scale
        self.device = ScriptedDevice(clock, costs.launch_ms)
        self.prompts = PromptCache(8)
        self.out_samples = 1764
        self._audio = np.zeros((slots, self.out_samples), np.float32)
        self.live_ms = costs.live(slots)
        self.live_device_ms = 0.0
        self._pieces: list[tuple[tuple[str, int, int], float, float]] = []  # each bucket step since the fence

    def live(self, plan: LivePlan) -> LiveResult:
        start = max(self.clock(), self.device.free_at)
        if plan.restore:
            self.device.launch(self.costs.restore_ms * len(plan.restore))
        _, end = self.device.launch(self.live_ms)
        self.live_device_ms = (end - start) * 1e3
        self.device.read()  # the one copy of the step's outputs to the host
        func = np.where(plan.force_func >= 0, plan.force_func, self.pad)
        return LiveResult(np.full(self.S, self.pad, np.int64), func.astype(np.int64), self._audio)

    def _side(self, kind: str, rows: int, positions: int) -> None:
        start, end = self.device.launch(self.side_scale * self.costs.side(kind, rows, positions))
        self._pieces.append(((kind, rows, positions), start, end))

    def fence(self) -> list[tuple[tuple[str, int, int], float]]:
        """The host waits for the device; each bucket step's device time since the last fence."""
        self.device.read()
        ms = [(key, (end - start) * 1e3) for key, start, end in self._pieces]
        self._pieces.clear()
        return ms

    def time_slack(self) -> list[tuple[tuple[str, int, int], float]]:
        """Every bucket run once and timed, as at the engine's warm-up."""
        timed = []
        for key in self.costs.buckets:
            kind, shape = key.split("/")
            rows, positions = (int(x) for x in shape.split("x"))
            start, end = self.device.launch(self.side_scale * self.costs.side(kind, rows, positions))
            self.device.read()
            timed.append(((kind, rows, positions), (end - start) * 1e3))
        return timed

    def tool(self, work: ToolWork) -> ToolResult:
        positions = work.positions
        for key in work_buckets(work.kind, len(work.slots), positions):
            self._side(*key)
        if work.kind == "call":
            self.device.read()  # the host needs the tokens
            forced = work.tokens[:, 0]
            return ToolResult(func=np.where(forced >= 0, forced, self.pad).astype(np.int64))
        return ToolResult()

    def save_prompt(self, slot: int, key: int) -> None:
        self.prompts.save(key, {})


def main() -> None:
    """Write benchmarks/device_costs/h100.json from the figures in `derive_costs`."""
    COSTS_DIR.mkdir(exist_ok=True)
    path = COSTS_DIR / "h100.json"
    path.write_text(json.dumps(derive_costs(), indent=1) + "\n")
    print(path)


if __name__ == "__main__":
    main()
