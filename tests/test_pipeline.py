"""The full live step at the tiny preset: 64 slots for one minute of caller speech (the test WAVs), and the
slack-work entry points (tool-call tokens, result and prompt prefill, replay) on the same model."""

import wave
from pathlib import Path

import numpy as np
import pytest
import torch

from engine.config import load_preset
from engine.model.pipeline import Pipeline
from engine.tokens import Tokens

DATA = Path(__file__).resolve().parent.parent / "prompts" / "callers"
CFG = load_preset("tiny")
S = 64


def speech() -> np.ndarray:
    clips = []
    for path in sorted(DATA.glob("*.wav")):
        with wave.open(str(path)) as w:
            assert (w.getframerate(), w.getnchannels(), w.getsampwidth()) == (16_000, 1, 2)
            clips.append(
                np.frombuffer(w.readframes(w.getnframes()), dtype=np.int16).astype(np.float32) / 32768
            )
    return np.concatenate(clips)


@pytest.fixture(scope="module")
def pipeline() -> Pipeline:
    p = Pipeline(CFG, S, Tokens(CFG.tokens))
    p.eval()
    p.prepare()
    return p


def test_sixty_four_slots_for_a_minute_of_speech(pipeline):
    audio = speech()
    n_in, n_out = CFG.clock.input_samples, CFG.clock.output_samples
    ticks = 750  # 60 s
    active = torch.ones(S, dtype=torch.bool)
    minus = torch.full((S,), -1, dtype=torch.long)
    offsets = (np.arange(S) * 7919) % (audio.size - n_in)  # every slot at another place in the speech
    energy = np.zeros(S)
    text = set()
    for k in range(ticks):
        idx = (offsets[:, None] + k * n_in + np.arange(n_in)[None]) % audio.size
        out = pipeline.live_step(torch.from_numpy(audio[idx]), active, minus, minus)
        assert out.audio.shape == (S, n_out) and out.audio.dtype == torch.float32
        assert out.text.shape == out.func.shape == (S,)
        assert torch.isfinite(out.audio).all(), f"non-finite audio at tick {k}"
        energy += out.audio.square().mean(-1).numpy()
        text.update(out.text.tolist())
    assert (energy > 0).all()  # every slot produced sound (dummy weights: noise)
    assert all(0 <= t < CFG.thinker.vocab_size for t in text)
    assert int(pipeline.thinker.pos[:S].min()) == ticks


def test_nonfinite_caller_samples_are_replaced_and_counted(pipeline):
    pipeline.reset(torch.ones(S, dtype=torch.bool))
    audio = torch.zeros(S, CFG.clock.input_samples)
    audio[3, :10] = float("nan")
    audio[5, 100] = float("inf")
    active = torch.ones(S, dtype=torch.bool)
    minus = torch.full((S,), -1, dtype=torch.long)
    out = pipeline.live_step(audio, active, minus, minus)
    assert torch.isfinite(out.audio).all()
    counts = pipeline.perception.nonfinite_samples
    assert counts[3] == 10 and counts[5] == 1 and counts.sum() == 11
    with pytest.raises(ValueError, match="1280"):
        pipeline.live_step(torch.zeros(S, 1000), active, minus, minus)


def test_slack_work_touches_only_its_own_slots(pipeline):
    pipeline.reset(torch.ones(S, dtype=torch.bool))
    th = pipeline.thinker
    before = [t.clone() for t in th.slot_state()]
    slots = torch.tensor([2, 9])
    ids = torch.tensor(Tokens(CFG.tokens).encode("<TOOL_RESPONSE>[1]</TOOL_RESPONSE>"))[None].repeat(2, 1)
    pipeline.prefill_result(slots, ids)
    func = pipeline.call_step(slots, torch.tensor([-1, 20]))
    assert func[1] == 20  # forced
    pipeline.prefill_prompt(slots, ids)
    changed = {
        int(i) for i in range(S) if any(not torch.equal(a[i], b[i]) for a, b in zip(before, th.slot_state()))
    }
    assert changed == {2, 9}
    assert th.pos[2] == th.pos[9] == 2 * ids.shape[1] + 1


def test_every_entry_point_runs_with_the_thinker_in_bfloat16():
    """The 11B preset runs its thinker in bfloat16 on the GPU; here the same dtype runs on CPU through every
    entry point, so a dtype mismatch between stages (the Mamba gated norm once returned float32 into a
    bfloat16 projection) fails in the suite instead of on the first GPU step. Accuracy against float32 is
    not asserted here: dummy weights give near-uniform logits."""
    S4 = 4
    p = Pipeline(CFG, S4, Tokens(CFG.tokens), thinker_dtype=torch.bfloat16).eval()
    p.prepare()
    assert p.thinker.embed_tokens.weight.dtype == torch.bfloat16
    audio = torch.from_numpy(speech()[: S4 * 1280].reshape(S4, 1280).copy())
    active, minus = torch.ones(S4, dtype=torch.bool), torch.full((S4,), -1)
    slots = torch.tensor([1, 3])
    with torch.inference_mode():
        for _ in range(3):
            out = p.live_step(audio, active, minus, minus)
        assert out.audio.dtype == torch.float32 and out.audio.shape == (S4, 1764)
        assert torch.isfinite(out.audio).all() and out.text.shape == out.func.shape == (S4,)
        func = p.call_step(slots, torch.tensor([-1, -1]))
        assert func.shape == (2,) and func.dtype == torch.int64
        p.prefill_prompt(slots, torch.randint(0, 100, (2, 16)))
        p.prefill_result(slots, torch.randint(0, 100, (2, 16)))
        p.replay_step(audio, active, slots)
        out = p.live_step(audio, active, minus, minus)
    assert torch.isfinite(out.audio).all()
    state = [b for n, b in p.thinker.named_buffers() if "ssm" in n]
    assert state and all(b.dtype == torch.float32 for b in state)  # the SSM state stays float32
