"""Every stage follows one slot-state contract (engine/model/slot_state.py), checked the same way for all
four: named slot-first buffers, a reset slot equals a fresh one, a saved slot loaded elsewhere continues
exactly as the original, loading touches that slot alone, a saved dict of another layout is refused by name,
rows outside `exec_mask` keep their state bit for bit, and the bytes `engine info` counts per session are the
bytes the built stages hold and the bytes the config's dimensions call for. The pipeline shares a prompt
through the same calls.

Tiny preset, seeded dummy weights (the contract is about state, not what the weights say), float32 and the
GPU's dtype policy.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from engine.config.dtype_policy import DtypePolicy, dtype_policy
from engine.config.presets import load_preset
from engine.config.stage_config import ModelConfig
from engine.model.pipeline import DTYPES, PROMPT_STAGES, STAGES, Pipeline
from engine.sizing.info import report
from engine.text.tokens import Tokens

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
        force = torch.full((S,), -1, dtype=torch.long)
        out = p.thinker.step(emb, mask, force, force)
        return torch.cat([out.text_logits, out.func_logits], -1)

    def talker(gen: torch.Generator, mask: torch.Tensor) -> torch.Tensor:
        text = torch.randint(0, tok.vocab_size, (1,), generator=gen).expand(S).contiguous()
        return p.talker.step(text, mask)

    def codec(gen: torch.Generator, mask: torch.Tensor) -> torch.Tensor:
        codes = torch.randint(0, CFG.codec.codebook_size, (1, CFG.codec.num_codebooks), generator=gen)
        return p.codec.step(codes.expand(S, -1).contiguous(), mask)

    return {"perception": perception, "thinker": thinker, "talker": talker, "codec": codec}[name]


def rows(stage, slot: int) -> dict[str, torch.Tensor]:
    return {name: t[slot].clone() for name, t in stage.slot_state().items()}


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)


@pytest.fixture(scope="module", params=POLICIES)
def policy(request) -> str:
    return request.param


@pytest.mark.parametrize("name", STAGES)
def test_state_is_slot_first(name, policy):
    stage = getattr(build(policy), name)
    stage.check_slot_state()
    state = stage.slot_state()
    assert state, name
    buffers = dict(stage.named_buffers())
    for key, t in state.items():
        assert t.shape[0] == S + stage.scratch_rows, key
        assert buffers[key] is t, key  # named as `named_buffers` names it
        assert key not in stage.state_dict(), key  # slot state never reaches a checkpoint


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
    for key, x in rows(stage_b, 2).items():
        torch.testing.assert_close(x, rows(stage_a, 0)[key], rtol=0, atol=1e-5)
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


@pytest.mark.parametrize("name", STAGES)
def test_loading_a_slot_changes_that_slot_alone_in_every_buffer(name):
    """Every buffer of slot 1 is given other values through `load_slot`: saving each slot again, slot 1's dict
    has the new values under every name and the other slots' dicts are what they were."""
    stage = getattr(build("fp32"), name)
    before = [stage.save_slot(s) for s in range(S)]
    changed = {
        key: (~v if v.dtype == torch.bool else v + 3).to(v.dtype)  # +3: not a no-op even in bf16
        for key, v in before[1].items()
    }
    stage.load_slot(1, changed)
    after = [stage.save_slot(s) for s in range(S)]
    assert same(after[1], changed) and not same(after[1], before[1])
    assert all(not torch.equal(after[1][key], before[1][key]) for key in changed)
    assert same(after[0], before[0]) and same(after[2], before[2])


def test_loading_a_slot_from_another_stage_layout_is_refused_by_name():
    p = build("fp32")
    saved = p.codec.save_slot(0)
    with pytest.raises(ValueError, match="not this stage's"):
        p.talker.load_slot(1, saved)
    saved = p.talker.save_slot(0)
    ring = "backbone.k_cache0"
    wrong = {**saved, ring: saved[ring][..., :-1]}
    del wrong["frames"]
    with pytest.raises(ValueError, match=r"missing \['frames'\].*backbone\.k_cache0") as err:
        p.talker.load_slot(1, wrong)
    assert "unknown []" in str(err.value)
    with pytest.raises(ValueError, match="unknown \\['extra'\\]"):
        p.talker.load_slot(1, {**saved, "extra": saved["frames"]})
    with pytest.raises(ValueError, match="slot: expected 0..2"):
        p.codec.save_slot(S)


def state_bytes_from_dimensions(cfg: ModelConfig, policy: DtypePolicy) -> dict[str, int]:
    """The bytes of one session's state per stage, from the config's dimensions and the policy's dtypes alone
    (the layouts the stages' docstrings state), not from any built stage."""
    size = {
        name: DTYPES[getattr(policy, name)].itemsize for name in DtypePolicy.model_fields if name != "name"
    }
    f32, i64 = 4, 8
    pc = cfg.perception
    # NeMo's dw_striding: log2(factor) stages of kernel 3, stride 2 -> receptive field in mel columns
    stages = pc.subsampling_factor.bit_length() - 1
    receptive = 1 + 2 * (2**stages - 1)
    audio_tail = (pc.chunk_mel - 1) * pc.hop_length + pc.n_fft // 2 + 1
    perception = (
        f32 * (audio_tail + (receptive - pc.chunk_mel) * pc.n_mels)
        + pc.num_layers * 2 * pc.att_context_left * pc.d_model * size["perception_kv"]
        + pc.num_layers * pc.d_model * (pc.conv_kernel - 1) * size["perception"]
        + 2 * i64  # frames, nonfinite_samples
    )
    th = cfg.thinker
    mamba = th.layer_pattern.count("M")
    attention = th.layer_pattern.count("*")
    thinker = (
        3 * i64  # position, previous text and function tokens
        + mamba * th.conv_dim * (th.conv_kernel - 1) * size["thinker"]
        + mamba * th.mamba_num_heads * th.mamba_head_dim * th.ssm_state_size * f32
        + attention * 2 * th.num_key_value_heads * th.attention_window * th.head_dim * size["thinker_kv"]
    )
    tk = cfg.talker
    streams = 2 if tk.use_cfg else 1
    rings = sum(tk.sliding_window if t == "sliding" else tk.attention_window for t in tk.layer_types)
    talker = (
        streams * 2 * tk.num_kv_heads * rings * tk.head_dim * size["talker_kv"]
        + i64 * (streams + tk.num_codebooks + 2)  # positions per stream, codes fed back, seed, frame counter
    )
    cc = cfg.codec
    kept = 2 * -(-((cc.n_fft - cc.hop_length) // 2) // cc.hop_length)  # iSTFT columns carried over
    codec = (
        sum(cc.blocks_per_stage * dim * (cc.block_kernel - 1) for dim in cc.channels) * size["codec"]
        + cc.n_fft * kept * f32
    )
    return {"perception": perception, "thinker": thinker, "talker": talker, "codec": codec}


@pytest.mark.parametrize("policy", ["fp32", "gpu", "capacity"])
def test_engine_info_counts_the_bytes_the_dimensions_call_for(policy):
    """`engine info`'s bytes per session, stage by stage, against the count from the config's dimensions; the
    thinker's scratch row is one more session's worth."""
    r = report(CFG, 80.0, policy)
    want = state_bytes_from_dimensions(CFG, dtype_policy(policy, "cuda"))
    assert r["state_bytes_detail"] == want
    assert r["state_bytes_fixed"] == want["thinker"]


def held_tensors(module: torch.nn.Module) -> dict[int, torch.Tensor]:
    """Every tensor a module tree holds, by storage: parameters, buffers and plain tensor attributes (alone or
    in lists, tuples and dicts), whatever the stage lists as its slot state."""
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
    return {
        name: sum(t.untyped_storage().nbytes() for t in held_tensors(getattr(p, name)).values())
        for name in STAGES
    }


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
    # the state the steps left: as close as the outputs (a batched op may round a row's last bit differently
    # by where the row lies, on some CPUs)
    for name in ("perception", "thinker", "talker"):
        got, want = rows(getattr(p, name), 2), rows(getattr(p, name), 0)
        assert got.keys() == want.keys(), name
        for key in got:
            diff = (got[key].double() - want[key].double()).abs().max().item() if got[key].numel() else 0.0
            print(f"{name}.{key}: max difference {diff:.2e}")
            torch.testing.assert_close(got[key], want[key], rtol=0, atol=1e-5, msg=f"{name}.{key}")
