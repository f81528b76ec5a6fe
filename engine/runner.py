"""Executes the scheduler's plans on the model: numpy in, one batched call, numpy out.

Inputs are copied into device buffers allocated once; the live step runs over them (one CUDA graph on CUDA,
engine/graph.py) and makes exactly one host transfer back (text, function tokens and audio of every slot
together). Knows the pipeline and the plan types.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import torch

from engine.graph import StepGraph
from engine.model.pipeline import PROMPT_STAGES, Pipeline, all_inactive
from engine.scheduler import LivePlan, LiveResult, ToolResult, ToolWork


class Runner:
    def __init__(
        self, pipeline: Pipeline, device: torch.device, prompt_cache_size: int = 8, *, capture: bool = True
    ) -> None:
        self.p = pipeline
        self.device = device
        S = pipeline.num_slots
        n_in = pipeline.cfg.clock.input_samples
        self.audio = torch.zeros(S, n_in, device=device)
        self.active = torch.zeros(S, dtype=torch.bool, device=device)
        self.force_text = torch.full((S,), -1, dtype=torch.long, device=device)
        self.force_func = torch.full((S,), -1, dtype=torch.long, device=device)
        self.reset_mask = torch.zeros(S, dtype=torch.bool, device=device)
        self.quiet = torch.zeros(S, dtype=torch.bool, device=device)
        self.prompts: OrderedDict[int, dict] = OrderedDict()  # prompt key -> the slot state a prompt sets
        self.prompt_cache_size = prompt_cache_size
        n_out = pipeline.cfg.clock.output_samples
        self._out = torch.empty(S, 2 + n_out, dtype=torch.float32)  # one host buffer for all outputs
        if device.type == "cuda":
            self._out = self._out.pin_memory()
        # the live step over the buffers above: one CUDA graph on CUDA (with `capture`), eager elsewhere
        self.step = StepGraph(
            pipeline.live_step,
            (self.audio, self.active, self.force_text, self.force_func, self.quiet),
            capture=capture,
            prepare_warmup=all_inactive,
        )

    def live(self, plan: LivePlan) -> LiveResult:
        if plan.reset.any():
            self.reset_mask.copy_(torch.from_numpy(plan.reset))
            self.p.reset(self.reset_mask)
        for slot, key in plan.restore:
            self.p.load_slot(slot, self.prompts[key])
            self.prompts.move_to_end(key)
        self.audio.copy_(torch.from_numpy(plan.audio))
        self.active.copy_(torch.from_numpy(plan.live))
        self.force_text.copy_(torch.from_numpy(plan.force_text))
        self.force_func.copy_(torch.from_numpy(plan.force_func))
        self.quiet.copy_(torch.from_numpy(plan.quiet))
        out = self.step()
        # token ids are far below 2**24, so they travel exactly as float32 beside the audio
        self._out[:, 0].copy_(out.text)
        self._out[:, 1].copy_(out.func)
        self._out[:, 2:].copy_(out.audio)
        host = self._out.numpy().copy()
        return LiveResult(host[:, 0].astype(np.int64), host[:, 1].astype(np.int64), host[:, 2:])

    def save_prompt(self, slot: int, key: int) -> list[int]:
        """Keep the state of a slot that just prefilled a prompt; returns the keys evicted for room."""
        self.prompts[key] = self.p.save_slot(slot, PROMPT_STAGES)
        evicted = []
        while len(self.prompts) > self.prompt_cache_size:
            evicted.append(self.prompts.popitem(last=False)[0])
        return evicted

    def tool(self, work: ToolWork) -> ToolResult:
        slots = torch.from_numpy(work.slots).to(self.device)
        if work.kind == "call":
            forced = torch.from_numpy(work.tokens[:, 0]).to(self.device)
            func = self.p.call_step(slots, forced)
            # slack work, not the live step: the host needs the tokens to decide each session's phase
            return ToolResult(func=func.cpu().numpy())
        if work.kind == "result":
            self.p.prefill_result(slots, torch.from_numpy(work.tokens).to(self.device))
        elif work.kind == "prompt":
            self.p.prefill_prompt(slots, torch.from_numpy(work.tokens).to(self.device))
        else:
            self.audio.copy_(torch.from_numpy(work.audio))
            self.active.copy_(torch.from_numpy(work.active))
            self.p.replay_step(self.audio, self.active, slots)
        return ToolResult()
