"""Sessions per GPU with the attention KV in fixed per-slot rings (what the engine does) against
block-allocated (paged) KV, for the full 11B preset; no GPU, no weights, a few seconds.

Each slot of the engine reserves its whole context window up front: the thinker's attention ring
(`cfg.thinker.attention_window` positions) and the talker's rings (`TalkerBackbone.rings`: `sliding_window`
for the sliding layers, `attention_window` for the global ones). A paged layout would hold only the blocks of
positions a session has filled. Both stages with attention write one position per frame (12.5 per second at
80 ms, 750 per minute); the talker's rings also start with `warmup_positions` warm-up positions written at
reset. So a call of m minutes fills min(R, 750 m) positions of a thinker ring of R and min(R, warm-up + 750 m)
of a talker ring; a paged layout holds that rounded up to whole blocks (`--block`, default 16 positions).

The stages are built on the `meta` device as `engine info` builds them (engine/sizing/info.py: `report` gives
the weights, derived buffers, the thinker's scratch row and the ring figure). Per-position KV bytes come from
the KV buffers themselves, at one and at two slots, so the figures follow the code. A session's state splits
into a fixed part (Mamba SSM and conv states, perception's 70-frame attention cache, codec state, counters)
and the KV that grows with filled positions. Two settings: the release's windows with dtype policy "gpu", and
the capacity mode (policy "capacity", talker window `CAPACITY_TALKER_WINDOW`). The paged figures count every
session at the same call length, one position per frame (system prompt and tool positions, which fill the
thinker's ring sooner, are left out) and no block tables (both in paging's favour). A paged pool cannot
preempt a live call, so the script also gives the sessions a pool admits if it is sized for every call
reaching its full window. `--gpu-mem-gb` is in GB (10**9 bytes), as engine/sizing/info.py counts it, keeping
its `WORKSPACE_GB`. The last stdout line is one JSON object.

    python benchmarks/kv_layout.py [--gpu-mem-gb 141] [--block 16] [--minutes 1 2 3 5 10 20 30]
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass

import torch

from engine.config.dtype_policy import DtypePolicy, dtype_policy
from engine.config.presets import load_preset
from engine.config.stage_config import ModelConfig
from engine.config.windows import CAPACITY_TALKER_WINDOW, talker_window, with_windows
from engine.model.pipeline import STAGES, build_stages
from engine.sizing.info import GB, WORKSPACE_GB, report

PRESET = "nemotron-voicechat-11b"
MINUTES = (1, 2, 3, 5, 10, 20, 30)
MIB = 2**20


@dataclass
class Ring:
    """The KV rings of one stage that share a size: per session, bytes per filled position."""

    stage: str
    kind: str  # "attention" (thinker), "sliding" / "global" (talker)
    positions: int  # ring size
    layers: int
    bytes_per_position: int  # K and V of all `layers`, one session
    warmup: int  # positions written at reset

    def filled(self, minutes: float, per_minute: float) -> int:
        return min(self.positions, self.warmup + math.ceil(per_minute * minutes))

    def full_after_minutes(self, per_minute: float) -> float:
        return (self.positions - self.warmup) / per_minute


def _kv_buffers(stages) -> list[tuple[str, str, int, torch.Tensor, torch.Tensor]]:
    """(stage, kind, ring size, K buffer, V buffer) of every layer whose KV grows with positions."""
    _, thinker, talker, _ = stages
    out = []
    for block in thinker.llm.layers:
        if block.kind == "*":
            m = block.mixer
            out.append(("thinker", "attention", m.window, m.k_cache, m.v_cache))
    for i, ring in enumerate(talker.backbone.rings):
        kind = talker.cfg.layer_types[i]
        out.append(("talker", kind, ring, *talker.backbone.caches(i)))
    for _, _, ring, k, v in out:  # whatever the layout, one dimension is the ring's positions
        assert ring in k.shape and ring in v.shape, (tuple(k.shape), ring)
    return out


def rings(cfg: ModelConfig, policy: DtypePolicy) -> list[Ring]:
    """The growing KV per stage and ring size, measured as the difference between one and two slots."""
    with torch.device("meta"):
        one = build_stages(cfg, 1, 0, policy)
        two = build_stages(cfg, 2, 0, policy)
    groups: dict[tuple[str, str, int], Ring] = {}
    for (stage, kind, ring, k1, v1), (_, _, _, k2, v2) in zip(
        _kv_buffers(one), _kv_buffers(two), strict=True
    ):
        per_session = (k2.nbytes + v2.nbytes) - (k1.nbytes + v1.nbytes)
        assert per_session % ring == 0, (stage, ring, per_session)
        warm = cfg.talker.warmup_positions if stage == "talker" else 0
        g = groups.setdefault((stage, kind, ring), Ring(stage, kind, ring, 0, 0, warm))
        g.layers += 1
        g.bytes_per_position += per_session // ring
    return list(groups.values())


def setting(name: str, cfg: ModelConfig, policy_name: str, args, per_minute: float) -> dict:
    policy = dtype_policy(policy_name, "cuda")
    r = report(cfg, args.gpu_mem_gb, policy)
    rs = rings(cfg, policy)
    weights = sum(r["weight_bytes"].values())
    fixed_device = r["state_bytes_fixed"] + sum(r["derived_bytes"].values())
    free = int(args.gpu_mem_gb * GB - weights - fixed_device - WORKSPACE_GB * 2**30)
    per_session = r["state_bytes_per_session"]
    assert free // per_session == r["sessions_fit"], (free, per_session, r["sessions_fit"])

    kv_full = {s: sum(g.bytes_per_position * g.positions for g in rs if g.stage == s) for s in STAGES}
    kv_per_pos = {s: sum(g.bytes_per_position for g in rs if g.stage == s) for s in STAGES}
    fixed = {s: r["state_bytes_detail"][s] - kv_full[s] for s in STAGES}
    fixed_total = sum(fixed.values())

    def paged_bytes(minutes: float | None) -> int:
        """One session's state when paged, `minutes` into its call (None: every ring full)."""
        kv = 0
        for g in rs:
            filled = g.positions if minutes is None else g.filled(minutes, per_minute)
            kv += math.ceil(filled / args.block) * args.block * g.bytes_per_position
        return fixed_total + kv

    worst = paged_bytes(None)
    worst_sessions = max(0, free // worst)
    paged = []
    for m in args.minutes:
        b = paged_bytes(m)
        n = max(0, free // b)
        paged.append(
            {
                "minutes": m,
                "bytes_per_session": b,
                "kv_bytes_per_session": b - fixed_total,
                "sessions": n,
                "sessions_over_ring": round(n / r["sessions_fit"], 2),
                "calls_short_of_memory_if_all_reach_full_window": max(0, n - worst_sessions),
            }
        )
    return {
        "setting": name,
        "dtype_policy": policy.name,
        "thinker_window": cfg.thinker.attention_window,
        "talker_sliding_window": cfg.talker.sliding_window,
        "talker_global_window": cfg.talker.attention_window,
        "talker_warmup_positions": cfg.talker.warmup_positions,
        "weight_bytes": weights,
        "device_fixed_bytes": fixed_device,  # derived buffers and the thinker's scratch row
        "workspace_bytes": int(WORKSPACE_GB * 2**30),
        "free_for_sessions_bytes": free,
        "state_bytes_per_session": per_session,
        "fixed_bytes_per_session": fixed,
        "fixed_bytes_per_session_total": fixed_total,
        "kv_bytes_per_session_full": kv_full,
        "kv_bytes_per_session_full_total": sum(kv_full.values()),
        "kv_bytes_per_position": kv_per_pos,
        "kv_bytes_per_minute": {s: int(v * per_minute) for s, v in kv_per_pos.items()},
        "rings": [
            {
                "stage": g.stage,
                "kind": g.kind,
                "positions": g.positions,
                "layers": g.layers,
                "bytes_per_position": g.bytes_per_position,
                "warmup_positions": g.warmup,
                "full_after_minutes": round(g.full_after_minutes(per_minute), 2),
            }
            for g in rs
        ],
        "sessions_ring": r["sessions_fit"],
        "sessions_paged_worst_case": worst_sessions,
        "paged_worst_case_bytes_per_session": worst,
        "paged": paged,
    }


def print_setting(s: dict, block: int) -> None:
    print(
        f"\n== {s['setting']}: dtype policy {s['dtype_policy']}, thinker window {s['thinker_window']}, "
        f"talker windows {s['talker_sliding_window']} sliding / {s['talker_global_window']} global "
        f"(+{s['talker_warmup_positions']} warm-up positions at reset)"
    )
    print(
        f"weights {s['weight_bytes'] / 2**30:.2f} GiB, derived buffers + scratch row "
        f"{s['device_fixed_bytes'] / 2**30:.2f} GiB, workspace {s['workspace_bytes'] / 2**30:.0f} GiB: "
        f"{s['free_for_sessions_bytes'] / 2**30:.2f} GiB left for sessions"
    )
    print("KV rings (per session):")
    for g in s["rings"]:
        print(
            f"  {g['stage']:<8} {g['kind']:<9} {g['layers']:>2} layers x {g['positions']:>5} positions, "
            f"{g['bytes_per_position'] / 1024:7.1f} KiB/position, "
            f"full after {g['full_after_minutes']:.2f} min"
        )
    print("state per session, fixed vs KV growing with filled positions:")
    print(f"  {'stage':<12} {'fixed MiB':>10} {'KV full MiB':>12} {'KV MiB/min':>11}")
    for st in s["fixed_bytes_per_session"]:
        print(
            f"  {st:<12} {s['fixed_bytes_per_session'][st] / MIB:10.2f} "
            f"{s['kv_bytes_per_session_full'][st] / MIB:12.2f} {s['kv_bytes_per_minute'][st] / MIB:11.2f}"
        )
    total = s["state_bytes_per_session"]
    print(
        f"  {'total':<12} {s['fixed_bytes_per_session_total'] / MIB:10.2f} "
        f"{s['kv_bytes_per_session_full_total'] / MIB:12.2f}   "
        f"(ring slot {total / MIB:.2f} MiB, {s['kv_bytes_per_session_full_total'] / total:.1%} of it KV)"
    )
    print(f"ring layout: {s['sessions_ring']} sessions")
    print(
        f"paged layout, pool sized for every call reaching its full window ({block}-position blocks): "
        f"{s['sessions_paged_worst_case']} sessions"
    )
    print(f"paged layout, every session at the same call length ({block}-position blocks):")
    print(
        f"  {'minutes':>7} {'MiB/session':>12} {'sessions':>9} {'x ring':>7} {'short if all run to full':>25}"
    )
    for p in s["paged"]:
        print(
            f"  {p['minutes']:>7g} {p['bytes_per_session'] / MIB:12.2f} {p['sessions']:>9} "
            f"{p['sessions_over_ring']:>7.2f} {p['calls_short_of_memory_if_all_reach_full_window']:>25}"
        )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--gpu-mem-gb",
        type=float,
        default=141.0,
        help="GPU memory to size for, in GB (10**9 bytes; H200: 141, H100: 80)",
    )
    ap.add_argument("--block", type=int, default=16, help="positions per KV block of the paged layout")
    ap.add_argument(
        "--minutes", type=float, nargs="+", default=list(MINUTES), help="call lengths for the paged layout"
    )
    args = ap.parse_args()
    if args.block < 1:
        ap.error("--block: must be at least 1")
    args.minutes = [int(m) if float(m).is_integer() else m for m in args.minutes]

    release = load_preset(PRESET)
    per_minute = 60_000 / release.clock.frame_ms  # one position per frame in every stage with attention
    capacity = with_windows(release, talker_window(release, None, capacity=True))
    settings = [
        setting("release", release, "gpu", args, per_minute),
        setting("capacity", capacity, "capacity", args, per_minute),
    ]
    print(
        f"{PRESET} on {args.gpu_mem_gb:g} GB (10**9 bytes), "
        f"{per_minute:g} positions per minute ({release.clock.frame_ms} ms frames); capacity talker window "
        f"{CAPACITY_TALKER_WINDOW}"
    )
    for s in settings:
        print_setting(s, args.block)
    print("\nsummary (sessions that fit):")
    heads = ["ring", "paged full"] + [f"paged {m:g} min" for m in args.minutes]
    print(f"  {'':<9}" + "".join(f"{h:>14}" for h in heads))
    for s in settings:
        row = [s["sessions_ring"], s["sessions_paged_worst_case"]] + [p["sessions"] for p in s["paged"]]
        print(f"  {s['setting']:<9}" + "".join(f"{v:>14}" for v in row))
    print(
        json.dumps(
            {
                "bench": "kv_layout",
                "preset": PRESET,
                "gpu_mem_gb": args.gpu_mem_gb,
                "workspace_gb": WORKSPACE_GB,
                "block_positions": args.block,
                "positions_per_minute": per_minute,
                "minutes": args.minutes,
                "capacity_talker_window": CAPACITY_TALKER_WINDOW,
                "settings": {s["setting"]: s for s in settings},
            }
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
