"""Context windows as settings: the talker's KV rings and the thinker's attention window, and
the capacity mode.

The presets carry the release's windows; `with_windows` shortens (or lengthens) them for a run, and
`engine info`, the benches and the engine all size and build from the result.
"""

from __future__ import annotations

from engine.config.stage_config import ModelConfig

# The capacity mode: a talker window of 1,000 positions (80 s of agent speech at 12.5 Hz) in every talker
# layer instead of the release's 7,500 (sliding) and 8,192 (global), and (on CUDA, dtype "auto") the talker's
# KV in bf16 (DTYPE_POLICIES["capacity"]): about a fifteenth of the talker's KV per session. The talker's
# replies stay conditioned on its last 80 s of speech only: a documented departure from the release, to
# serve more rooms.
CAPACITY_TALKER_WINDOW = 1000


def with_windows(cfg: ModelConfig, talker: int | None = None, thinker: int | None = None) -> ModelConfig:
    """`cfg` with the talker's KV rings (sliding and global layers alike) at most `talker` positions and the
    thinker's attention window at `thinker`; None keeps the preset's (the release's) windows."""
    tk, th = cfg.talker, cfg.thinker
    if talker is not None:
        if talker < tk.warmup_positions:
            raise ValueError(
                f"talker window: {talker} positions; it must hold the {tk.warmup_positions} warm-up positions"
            )
        tk = tk.model_copy(
            update={"sliding_window": min(tk.sliding_window, talker), "attention_window": talker}
        )
    if thinker is not None:
        if thinker < 1:
            raise ValueError(f"thinker window: {thinker} positions; it must be at least 1")
        th = th.model_copy(update={"attention_window": thinker})
    if tk is cfg.talker and th is cfg.thinker:
        return cfg
    return ModelConfig.model_validate(
        {**cfg.model_dump(), "talker": tk.model_dump(), "thinker": th.model_dump()}
    )


def add_window_arguments(parser) -> None:
    """`--talker-window N`, `--thinker-window N` and `--capacity` for the command lines that size or build a
    model (`windows(cfg, args)` applies them)."""
    parser.add_argument(
        "--talker-window", type=int, default=None, help="talker KV ring positions (default: the release's)"
    )
    parser.add_argument(
        "--thinker-window", type=int, default=None, help="thinker attention window (default: the release's)"
    )
    parser.add_argument(
        "--capacity",
        action="store_true",
        help=f"capacity mode: talker window {CAPACITY_TALKER_WINDOW} unless given",
    )


def talker_window(cfg: ModelConfig, window: int | None, capacity: bool) -> int | None:
    """The talker window asked for: `window` when given, else in capacity mode CAPACITY_TALKER_WINDOW (never
    longer than the preset's own), else None (the preset's)."""
    if window is not None or not capacity:
        return window
    return min(CAPACITY_TALKER_WINDOW, cfg.talker.attention_window)


def windows(cfg: ModelConfig, args) -> ModelConfig:
    return with_windows(cfg, talker_window(cfg, args.talker_window, args.capacity), args.thinker_window)
