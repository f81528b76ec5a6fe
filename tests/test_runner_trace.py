"""The CPU live step as one traced graph (engine/tick/runner.py `traced_live_step`) is the eager live step,
bit for bit: the same tokens and audio of the live rows and the same state of every slot, step after step,
through slot resets, a prompt state loaded into another slot, slots going inactive and back, and rows
replaying held audio. Tiny preset, seeded dummy weights: two pipelines built from the same seed, one stepped
eagerly and one through the trace."""

from __future__ import annotations

import torch

from engine.config.presets import load_preset
from engine.model.pipeline import PROMPT_STAGES, Pipeline
from engine.text.tokens import Tokens
from engine.tick.runner import traced_live_step

CFG = load_preset("tiny")
TOK = Tokens(CFG.tokens)
S = 8


def build() -> Pipeline:
    torch.manual_seed(0)
    p = Pipeline(CFG, S, Tokens(CFG.tokens)).eval().requires_grad_(False)
    p.prepare()
    return p


def test_the_traced_live_step_is_the_eager_one_through_resets_loads_and_masks():
    eager, traced = build(), build()
    n = CFG.clock.input_samples
    inputs = (
        torch.zeros(S, n),
        torch.ones(S, dtype=torch.bool),
        torch.full((S,), -1, dtype=torch.long),
        torch.full((S,), -1, dtype=torch.long),
        torch.zeros(S, dtype=torch.bool),
    )
    step = traced_live_step(traced, inputs)
    assert bool(inputs[1].all())  # tracing restored the inputs it was given
    gen = torch.Generator().manual_seed(1)
    steps = 0
    with torch.inference_mode():
        for i in range(10):
            if i == 3:  # two slots freed and reused
                mask = torch.zeros(S, dtype=torch.bool)
                mask[[2, 6]] = True
                eager.reset(mask)
                traced.reset(mask)
            if i == 5:  # a prompt's state shared into another slot
                eager.load_slot(5, eager.save_slot(0, PROMPT_STAGES))
                traced.load_slot(5, traced.save_slot(0, PROMPT_STAGES))
            audio = 0.1 * torch.randn(S, n, generator=gen)
            active = torch.ones(S, dtype=torch.bool)
            active[3] = i % 2 == 0  # a slot paused every other step
            quiet = torch.zeros(S, dtype=torch.bool)
            quiet[4] = i in (6, 7)  # a slot replaying held audio
            force_text = torch.full((S,), -1, dtype=torch.long)
            force_text[1] = TOK.bos if i == 2 else -1  # a forced turn start
            args = (audio, active, force_text, inputs[3], quiet)
            want, got = eager.live_step(*args), step(*args)
            # what the engine reads: the live rows' tokens and audio (a row that is not live is computed and
            # thrown away), and every slot's state
            assert torch.equal(want.text[active], got.text[active]), i
            assert torch.equal(want.func[active], got.func[active]), i
            assert torch.equal(want.audio[active], got.audio[active]), i
            for name, tensors in eager.slot_state().items():
                theirs = traced.slot_state()[name]
                assert tensors.keys() == theirs.keys(), name
                for key, t in tensors.items():  # the slots' rows (past them: the thinker's scratch row)
                    assert torch.equal(t[:S], theirs[key][:S]), (i, name, key)
            steps += 1
    assert steps == 10
