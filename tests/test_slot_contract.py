"""Every stage follows one slot-state contract (engine/model/slot_state.py), checked the same way for all four:
slot-first buffers, a reset slot equals a fresh one, a saved slot loaded elsewhere continues exactly as the
original, rows outside `exec_mask` keep their state bit for bit, and the bytes `engine info` counts are the
bytes the built stages hold. The pipeline shares a prompt through the same calls.

Tiny preset, seeded dummy weights (the contract is about state, not what the weights say), float32 and the
GPU's dtype policy.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from engine.dtype_policy import dtype_policy
from engine.info import report
from engine.model.pipeline import PROMPT_STAGES, STAGES, Pipeline
from engine.presets import load_preset
from engine.tokens import Tokens

CFG = load_preset("tiny")
S = 3
POLICIES = ["fp32", "gpu-policy"]


def build(policy: str) -> Pipeline:
    p = Pipeline(CFG, S, Tokens(CFG.tokens), dtype_policy(policy.removesuffix("-policy"))).eval()
    p.prepare()
    return p


def driver(p: Pipeline, name: str) -> Callable[[torch.Generator, torch.Tensor], torch.Tensor]:
    """One step of stage `name` with random inputs for every slot, executing the rows of `mask`; returns
    its output. The same generator state gives the same inputs in every row that asks for them."""
    tok = p.tok

    def perception(gen: torch.Generator, mask: torch.Tensor) -> torch.Tensor:
        audio = 0.1 * torch.randn(1, CFG.clock.input_samples, generator=gen).expand(S, -1).contiguous()
        return p.perception.step(audio, mask)

    def thinker(gen: torch.Generator, mask: torch.Tensor) -> torch.Tensor:
        emb = torch.randn(1, CFG.thinker.hidden_size, generator=gen).expand(S, -1).contiguous()
        slots = torch.where(mask, torch.arange(S), -1)
        force = torch.full((S,), -1, dtype=torch.long)
        out = p.thinker.step(emb, slots, force, force, dense=True)
        return torch.cat([out.text_logits, out.func_logits], -1)

    def talker(gen: torch.Generator, mask: torch.Tensor) -> torch.Tensor:
        text = torch.randint(0, tok.vocab_size, (1,), generator=gen).expand(S).contiguous()
        return p.talker.step(text, mask)

    def codec(gen: torch.Generator, mask: torch.Tensor) -> torch.Tensor:
        codes = torch.randint(0, CFG.codec.codebook_size, (1, CFG.codec.num_codebooks), generator=gen)
        return p.codec.step(codes.expand(S, -1).contiguous(), mask)

    return {"perception": perception, "thinker": thinker, "talker": talker, "codec": codec}[name]


def rows(stage, slot: int) -> list[torch.Tensor]:
    return [t[slot].clone() for t in stage.slot_state()]


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


@pytest.fixture(scope="module", params=POLICIES)
def policy(request) -> str:
    return request.param


@pytest.mark.parametrize("name", STAGES)
def test_state_is_slot_first(name, policy):
    stage = getattr(build(policy), name)
    stage.check_slot_state()
    assert stage.slot_state(), name
    for t in stage.slot_state():
        assert t.shape[0] == S + stage.scratch_rows


@pytest.mark.parametrize("name", STAGES)
def test_a_reset_slot_equals_a_fresh_one_and_leaves_the_others(name, policy):
    p, fresh = build(policy), build(policy)
    stage, step = getattr(p, name), driver(p, name)
    gen = torch.Generator().manual_seed(1)
    every = torch.ones(S, dtype=torch.bool)
    with torch.inference_mode():
        for _ in range(5):
            step(gen, every)
        before = rows(stage, 1)
        assert not same(rows(stage, 0), rows(getattr(fresh, name), 0)), "the steps changed nothing"
        stage.reset(torch.tensor([True, False, True]))
    for slot in (0, 2):
        assert same(rows(stage, slot), rows(getattr(fresh, name), slot)), slot
    assert same(rows(stage, 1), before)


@pytest.mark.parametrize("name", STAGES)
def test_a_saved_slot_loaded_elsewhere_continues_as_the_original(name, policy):
    """Slot 0 of pipeline A runs 4 steps and is saved. Pipeline B, with a history of its own, loads it into
    its slots 0 and 2. Then A and B get the same inputs: B's slot 0 gives A's slot 0 outputs and state bit
    for bit; B's slot 2 gives them to float rounding (a row elsewhere in the batch: the codec's vectorised
    convolutions round rows 0 and 2 differently by ~1e-7 even from a fresh start)."""
    a, b = build(policy), build(policy)
    stage_a, stage_b = getattr(a, name), getattr(b, name)
    step_a, step_b = driver(a, name), driver(b, name)
    every = torch.ones(S, dtype=torch.bool)
    with torch.inference_mode():
        gen = torch.Generator().manual_seed(2)
        for _ in range(4):
            step_a(gen, torch.tensor([True, True, False]))
        for _ in range(3):
            step_b(gen, every)  # B's own history
        saved = stage_a.save_slot(0)
        stage_b.load_slot(0, saved)
        stage_b.load_slot(2, saved)
        assert same(rows(stage_b, 2), rows(stage_a, 0))
        for i in range(4):
            out_a = step_a(torch.Generator().manual_seed(10 + i), every)
            out_b = step_b(torch.Generator().manual_seed(10 + i), every)
            assert torch.equal(out_b[0], out_a[0]), i
            torch.testing.assert_close(out_b[2], out_a[0], rtol=0, atol=1e-6)
    assert same(rows(stage_b, 0), rows(stage_a, 0))
    for x, y in zip(rows(stage_b, 2), rows(stage_a, 0), strict=True):
        torch.testing.assert_close(x, y, rtol=0, atol=1e-5)
    assert not same(saved, rows(stage_a, 0))  # the saved copy is a copy: the slot moved on


@pytest.mark.parametrize("name", STAGES)
def test_rows_outside_the_exec_mask_keep_their_state(name, policy):
    p = build(policy)
    stage, step = getattr(p, name), driver(p, name)
    gen = torch.Generator().manual_seed(3)
    with torch.inference_mode():
        for _ in range(3):
            step(gen, torch.ones(S, dtype=torch.bool))
        before = [rows(stage, s) for s in range(S)]
        step(gen, torch.tensor([True, False, True]))
    assert same(rows(stage, 1), before[1])
    assert not same(rows(stage, 0), before[0])


def test_loading_a_slot_from_another_stage_layout_is_refused():
    p = build("fp32")
    saved = p.codec.save_slot(0)
    with pytest.raises(ValueError, match="not this stage's"):
        p.talker.load_slot(1, saved)
    with pytest.raises(ValueError, match="slot: expected 0..2"):
        p.codec.save_slot(S)


def held_tensors(module: torch.nn.Module) -> dict[int, torch.Tensor]:
    """Every tensor a module tree holds, by storage: parameters, buffers and plain tensor attributes (alone or in
    lists, tuples and dicts), whatever the stage lists as its slot state."""
    found: dict[int, torch.Tensor] = {}

    def add(value) -> None:
        if isinstance(value, torch.Tensor):
            found.setdefault(value.untyped_storage().data_ptr(), value)
        elif isinstance(value, list | tuple):
            for v in value:
                add(v)
        elif isinstance(value, dict):
            for v in value.values():
                add(v)

    for m in module.modules():
        for group in (m._parameters, m._buffers, vars(m)):
            for v in group.values():
                add(v)
    return found


def stage_bytes(p: Pipeline) -> dict[str, int]:
    return {name: sum(t.untyped_storage().nbytes() for t in held_tensors(getattr(p, name)).values())
            for name in STAGES}  # fmt: skip


@pytest.mark.parametrize("policy", ["fp32", "gpu", "capacity"])
def test_engine_info_counts_the_bytes_a_slot_adds(policy):
    """`engine info`'s per-session bytes are what one more slot costs: the memory every tensor of each built
    stage holds (counted by storage, not from the stages' own list of slot state), between 1 and 4 slots
    (on CPU the capacity policy is asked for by name). A per-slot buffer a stage left out of its slot state
    would show here."""
    r = report(CFG, 80.0, policy)
    one, four = (
        stage_bytes(Pipeline(CFG, n, Tokens(CFG.tokens), dtype_policy(policy, "cuda"))) for n in (1, 4)
    )
    assert {name: four[name] - one[name] for name in STAGES} == {
        name: 3 * r["state_bytes_detail"][name] for name in STAGES
    }


def test_a_shared_prompt_is_saved_and_loaded_through_the_pipeline():
    """The engine's prompt sharing: prefill a prompt in slot 0, save the stages a prompt changes, load them
    into slot 2 (fresh), and both slots then run the same live steps to the same outputs."""
    p = build("fp32")
    ids = torch.randint(0, p.tok.vocab_size, (1, 12), generator=torch.Generator().manual_seed(4))
    with torch.inference_mode():
        p.prefill_prompt(torch.tensor([0]), ids)
        saved = p.save_slot(0, PROMPT_STAGES)
        assert set(saved) == set(PROMPT_STAGES)
        p.load_slot(2, saved)
        gen = torch.Generator().manual_seed(5)
        minus = torch.full((S,), -1, dtype=torch.long)
        for _ in range(3):
            audio = 0.1 * torch.randn(1, CFG.clock.input_samples, generator=gen).expand(S, -1).contiguous()
            out = p.live_step(audio, torch.ones(S, dtype=torch.bool), minus, minus)
            assert out.text[0] == out.text[2] and out.func[0] == out.func[2]
            torch.testing.assert_close(out.audio[2], out.audio[0], rtol=0, atol=1e-6)  # as above: the codec
    for name in ("perception", "thinker", "talker"):
        assert same(rows(getattr(p, name), 2), rows(getattr(p, name), 0)), name
