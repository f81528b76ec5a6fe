"""The live step as one CUDA graph (engine/tick/graph.py): the capture audit on any device, and the wrapper's
outputs.

On CPU the wrapper runs the step eagerly over its static buffers; these tests prove that plumbing changes
nothing, and that the step has none of what a capture refuses (host syncs, data-dependent shapes, tensors made
from Python data, reallocated state). With a CUDA device the same equality test compares the captured graph
with eager steps.
"""

from __future__ import annotations

import pytest
import torch

from engine.config.dtype_policy import dtype_policy
from engine.config.presets import load_preset
from engine.model.pipeline import Pipeline, all_inactive, live_inputs
from engine.text.tokens import Tokens
from engine.tick.graph import StepGraph, audit_step

CFG = load_preset("tiny")
S = 4
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def pipeline(device: str = "cpu", policy: str = "fp32") -> Pipeline:
    with torch.device(device):
        p = Pipeline(CFG, S, Tokens(CFG.tokens), dtype_policy(policy)).eval()
    p.prepare()
    return p


def inputs(device: str = "cpu") -> tuple[torch.Tensor, ...]:
    return live_inputs(CFG, S, device, active=False)


def state_of(p: Pipeline) -> list[torch.Tensor]:
    return [t for ts in p.slot_state().values() for t in ts.values()]


def fill(step: int, args: tuple[torch.Tensor, ...], gen: torch.Generator) -> None:
    """Inputs of a busy tick: speech-like noise, some slots idle, some quiet, some forced tokens."""
    audio, active, force_text, force_func, quiet = args
    audio.copy_(0.1 * torch.randn(audio.shape, generator=gen))
    active.copy_(torch.rand(S, generator=gen) < 0.8)
    quiet.copy_(torch.rand(S, generator=gen) < 0.2)
    force_text.fill_(-1)
    force_func.fill_(-1)
    if step % 5 == 1:
        force_text[0] = 7  # a forced text token on one slot


@pytest.mark.parametrize("policy", ["fp32", "gpu"])
def test_the_live_step_has_nothing_a_cuda_graph_capture_refuses(policy):
    p = pipeline(policy=policy)
    args = inputs()
    args[1].fill_(True)
    args[4][1] = True  # a replaying row: the quiet path too
    report = audit_step(p.live_step, args, lambda: state_of(p))
    print(policy, report.ops, "operators per live step;", report.by_op.most_common(8))
    assert report.capturable, report.problems
    assert report.ops > 100  # it really ran the step


def test_the_audit_finds_what_would_break_a_capture():
    state = torch.zeros(4)

    def bad(x: torch.Tensor, mask: torch.Tensor) -> None:
        nonlocal state
        if x.sum().item() > 0:  # a host sync
            pass
        x[mask]  # a boolean mask: a data-dependent shape
        torch.tensor([1.0, 2.0]) + x[:2]  # a tensor made from Python data
        state = state + 1  # reallocated instead of updated in place

    x = torch.ones(4)
    report = audit_step(bad, (x, x > 0), lambda: [state])
    text = " | ".join(report.problems)
    print(text)
    assert not report.capturable
    assert "_local_scalar_dense" in text and "boolean mask" in text and "Python data" in text
    assert "reallocated" in text


def test_a_step_with_every_slot_inactive_changes_no_slots_state():
    """What the graph's warm-up relies on: it steps with every slot inactive before the capture."""
    p = pipeline()
    gen = torch.Generator().manual_seed(3)
    args = inputs()
    for step in range(4):  # some history in every stage first
        fill(step, args, gen)
        args[1].fill_(True)
        p.live_step(*args)
    before = [t.clone() for t in state_of(p)]
    args[1].fill_(False)
    args[4].fill_(False)
    p.live_step(*args)
    changed = []
    for i, (t, b) in enumerate(zip(state_of(p), before, strict=True)):
        rows = S if t.shape[0] == S + 1 else t.shape[0]  # the thinker's extra row is its scratch row
        if not torch.equal(t[:rows], b[:rows]):
            changed.append((i, tuple(t.shape)))
    assert changed == []


@pytest.mark.parametrize("device", DEVICES)
def test_the_graphed_step_gives_the_outputs_of_eager_steps(device):
    """Twelve busy ticks through `StepGraph` (captured on CUDA, eager on CPU) and through `live_step`
    directly, on two pipelines with the same seeded weights: the same tokens and audio, bit for bit, and the
    same state."""
    graphed, eager = pipeline(device), pipeline(device)
    static = inputs(device)
    step = StepGraph(graphed.live_step, static, capture=True, prepare_warmup=all_inactive)
    assert step.captured == (device == "cuda")
    gen = torch.Generator().manual_seed(11)
    host = inputs()
    for t in range(12):
        fill(t, host, gen)
        for s, h in zip(static, host, strict=True):
            s.copy_(h)
        a = step()
        b = eager.live_step(*(h.to(device) for h in host))
        assert torch.equal(a.text, b.text) and torch.equal(a.func, b.func), t
        assert torch.equal(a.audio, b.audio), (t, (a.audio - b.audio).abs().max().item())
    for x, y in zip(state_of(graphed), state_of(eager), strict=True):
        assert torch.equal(x, y)


def test_the_step_refuses_inputs_of_another_shape():
    p = pipeline()
    static = inputs()
    step = StepGraph(p.live_step, static, capture=False)
    wrong = inputs()
    with pytest.raises(ValueError, match="input 0 is"):
        step(torch.zeros(S + 1, CFG.clock.input_samples), *wrong[1:])
    with pytest.raises(ValueError, match="2 inputs given"):
        step(*wrong[:2])
    out = step(*wrong)  # the same shapes: copied into the static buffers
    assert out.audio.shape == (S, CFG.clock.output_samples)
