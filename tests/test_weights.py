"""A release-format checkpoint (the stages' reference fixtures merged into one file) loads by name, every
tensor accounted for; bad checkpoints fail with a message that names the problem."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from engine.config.presets import load_preset
from engine.model.pipeline import Pipeline
from engine.model.release_config import release_config
from engine.model.weights import CheckpointError, load_into, read_tensors
from engine.text.tokens import Tokens
from engine.tick.engine import Engine, EngineConfig

FIXTURES = Path(__file__).parent / "fixtures"
CFG = load_preset("tiny")


@pytest.fixture(scope="module")
def release() -> dict[str, torch.Tensor]:
    return read_tensors(FIXTURES / "model")


def pipeline() -> Pipeline:
    return Pipeline(CFG, 2, Tokens(CFG.tokens))


def test_every_tensor_of_a_release_file_is_accounted_for(release):
    p = pipeline()
    consumed = load_into(p, release)
    ignored = set(release) - consumed
    assert all(
        k.startswith(("tts_model.audio_codec.encoder.", "tts_model.audio_codec.prvq._variance"))
        or "audio_prompt" in k
        or k.endswith("lm_head.weight")
        for k in ignored
    ), sorted(ignored)[:5]
    w = release["stt_model.llm.layers.0.mixer.in_proj.weight"].float()
    assert torch.equal(p.thinker.llm.layers[0].mixer.in_proj.weight, w)


def test_missing_and_unknown_tensors_are_named(release):
    broken = dict(release)
    del broken["stt_model.lm_head.weight"]
    with pytest.raises(CheckpointError, match="thinker.*stt_model.lm_head.weight"):
        load_into(pipeline(), broken)
    extra = dict(release, **{"stt_model.mystery.weight": torch.zeros(2)})
    with pytest.raises(CheckpointError, match="stt_model.mystery.weight"):
        load_into(pipeline(), extra)
    rnnt = dict(release, **{"stt_model.rnnt_joint.pred.weight": torch.zeros(2)})
    load_into(pipeline(), rnnt)  # the transcript branch is known and unused


def test_engine_loads_a_checkpoint_folder(release, tmp_path):
    save_file({k: v.contiguous() for k, v in release.items()}, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(release_config(CFG)))
    assert set(read_tensors(tmp_path)) == set(release)
    with Engine(EngineConfig(preset="tiny", num_slots=2, checkpoint=str(tmp_path), start=False)) as e:
        w = e.pipeline.talker.embed_code.weight
        assert torch.equal(w, release["tts_model.tts_model.embed_code.weight"].float())
        h = e.open_session("Hello.", [])
        h.push_audio(torch.zeros(2560).numpy())
        for k in range(3):
            e.run_tick(k, 1e12)
        assert h.phase == "live"


def test_a_missing_or_unreadable_checkpoint_says_so(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        EngineConfig(checkpoint=str(tmp_path / "nope"))
    with pytest.raises(CheckpointError, match="no model.safetensors"):
        read_tensors(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(CheckpointError, match="cannot read"):
        read_tensors(tmp_path)


def test_the_whole_model_nemo_builds_loads_into_every_stage():
    """tests/fixtures/model: NemotronVoiceChat's own state dict (scripts/fixtures/make_model_fixtures.py),
    every tensor consumed or explicitly ignored, and each stage's tensors loaded into that stage."""
    whole = read_tensors(FIXTURES / "model")
    p = pipeline()
    consumed = load_into(p, whole)  # raises on any tensor no stage knows
    assert "stt_model.llm.layers.0.mixer.in_proj.weight" in consumed
    assert "tts_model.audio_codec.prvq.mus_list.0" in consumed
    w = whole["tts_model.tts_model.embed_code.weight"].float()
    assert torch.equal(p.talker.embed_code.weight, w)
