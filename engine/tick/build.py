"""Building what an engine serves with: the model on its device (dummy weights or a checkpoint), the
scheduler's limits in ticks, and the warm-up that measures the first costs and captures the graphs.

Called once, by `Engine.__init__`. Knows the model, its dtypes and its device; knows nothing of sessions.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.config.dtype_policy import DtypePolicy, dtype_policy
from engine.config.engine_config import EngineConfig
from engine.config.presets import load_preset
from engine.config.stage_config import ModelConfig
from engine.config.windows import talker_window, with_windows
from engine.model.pipeline import Pipeline
from engine.model.weights import load_checkpoint, model_config
from engine.sizing.info import check_memory
from engine.text.tokens import Tokens
from engine.tick.graph import pow2_at_least
from engine.tick.runner import Runner
from engine.tick.scheduler import Limits, Scheduler

log = logging.getLogger("chorus.engine")


@dataclass(frozen=True)
class Model:
    cfg: ModelConfig  # the release's (or the preset's) configuration, with the engine's context windows
    device: torch.device
    dtypes: DtypePolicy
    tokens: Tokens
    pipeline: Pipeline  # every stage, `num_slots` rows of state each, ready for inference


def build_model(cfg: EngineConfig, clock: Callable[[], float]) -> Model:
    release = model_config(load_preset(cfg.preset), cfg.checkpoint, cfg.tokenizer, cfg.speaker)
    model_cfg = with_windows(
        release, talker_window(release, cfg.talker_window, cfg.capacity_mode), cfg.thinker_window
    )
    device = torch.device(cfg.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cpu":
        torch.set_num_threads(cfg.threads)
    tokens = Tokens(model_cfg.tokens)
    dtypes = dtype_policy(cfg.dtype, device.type, cfg.capacity_mode)
    if cfg.checkpoint:
        check_memory(model_cfg, dtypes, cfg.num_slots, device)
    t0 = clock()
    with torch.device(device):
        pipeline = Pipeline(model_cfg, cfg.num_slots, tokens, dtypes)
    if cfg.checkpoint:
        load_checkpoint(pipeline, cfg.checkpoint)
    pipeline.eval().requires_grad_(False)  # inference only
    pipeline.prepare()
    log.info(
        "model %s ready on %s in %.1f s (%d slots, dtypes %s)",
        cfg.preset,
        device,
        clock() - t0,
        cfg.num_slots,
        dtypes,
    )
    return Model(model_cfg, device, dtypes, tokens, pipeline)


def limits(cfg: EngineConfig, model_cfg: ModelConfig) -> Limits:
    """The scheduler's bounds, its times in ticks of the model's frame."""
    tick_ms = model_cfg.clock.frame_ms

    def ticks(seconds: float) -> int:
        return max(1, round(seconds * 1000 / tick_ms))

    return Limits(
        max_call_tokens=cfg.max_call_tokens,
        tool_timeout_s=cfg.tool_timeout_s,
        prefill_chunk=cfg.prefill_chunk,
        result_chunk=1 if cfg.cadence_locked_tools else cfg.prefill_chunk,
        max_chunk=model_cfg.thinker.attention_window,
        admission_ticks=ticks(cfg.admission_s),
        replay_ticks=ticks(cfg.replay_s),
        result_ticks=ticks(cfg.result_s),
        catch_up_in_turns=cfg.echo,
        **({"reserve_frames": 1, "spare_ticks": 10**9} if cfg.fixed_buffers else {}),
    )


def warm_up(model: Model, runner: Runner, scheduler: Scheduler, clock: Callable[[], float]) -> None:
    """Run the live step and each bucket of tool-call steps once on the scratch rows (capturing their graphs
    on CUDA) so that the cost model starts from measurements, capture the other slack buckets' graphs on
    CUDA and time each on the device (CUDA events); then fresh state."""
    p, device = model.pipeline, model.device
    S = p.num_slots
    idle = torch.zeros(S, dtype=torch.bool, device=device)
    minus = torch.full((S,), -1, dtype=torch.long, device=device)
    with torch.inference_mode():
        for _ in range(2):
            p.live_step(torch.zeros(S, model.cfg.clock.input_samples, device=device), idle, minus, minus)
        b = 1
        while b <= pow2_at_least(S):
            step = runner.slack[("call", b, 1)]  # padding rows only: no slot's state changes
            step()
            t = clock()
            step()
            if device.type == "cuda":
                torch.cuda.synchronize()
            scheduler.costs.observe("call", b, 1, (clock() - t) * 1e3)
            b *= 2
        if runner.step.captured:  # every other slack bucket captured now, not in a tick
            t = clock()
            n = runner.prepare_slack(scheduler.limits.max_chunk)
            log.info("captured %d slack-work graphs in %.1f s", n, clock() - t)
            # each bucket's device time once, so that no piece starts in a tick on a guess
            for key, ms in runner.time_slack(scheduler.limits.max_chunk):
                scheduler.costs.observe(*key, ms)
    p.prepare()
