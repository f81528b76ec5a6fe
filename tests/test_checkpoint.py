"""Real-release loading: the NeMo config.json checked against the preset, the whole 11B name list and shapes
routed on the meta device from a sparse file, the tokenizer and speaker settings, and every bad checkpoint
failing with a message that names the problem."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.config.dtype_policy import DTYPE_POLICIES
from engine.config.presets import load_preset
from engine.model import weights
from engine.model.checkpoint import CheckpointError, write_header_only
from engine.model.pipeline import Pipeline, build_stages
from engine.model.release_config import check_release_config, release_config
from engine.model.weights import Progress, load_checkpoint, model_config, targets
from engine.sizing.info import check_memory
from engine.text.tokens import Tokens

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = Path(__file__).parent / "fixtures"
TINY = load_preset("tiny")
TOKENIZER = TINY.tokens.tokenizer


@pytest.fixture(scope="module")
def release() -> dict[str, torch.Tensor]:
    return load_file(FIXTURES / "model" / "model.safetensors")


def save(folder: Path, tensors: dict[str, torch.Tensor], config: dict | None = None) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(config or release_config(TINY)))
    return folder


def pipeline(cfg=TINY) -> Pipeline:
    return Pipeline(cfg, 2, Tokens(cfg.tokens))


# ---------------------------------------------------------------------- config.json


def test_nemo_s_own_config_of_the_tiny_model_fits_the_tiny_preset():
    """The config NemotronVoiceChat was built from for the whole-model fixture (meta.json), read
    as a release."""
    raw = json.loads((FIXTURES / "model" / "meta.json").read_text())["nemo_config"]
    derived = check_release_config(raw, TINY)
    assert derived["perception.num_layers"] == 2 and derived["talker.num_layers"] == 2
    assert derived["codec.channels"] == (16, 8, 4) and derived["codec.upsample"] == (9, 7, 7)
    assert derived["talker.layer_types"] == TINY.talker.layer_types
    with pytest.raises(CheckpointError, match="perception.num_layers: release 2, preset 24"):
        check_release_config(raw, load_preset("nemotron-voicechat-11b"))


def test_contradictory_or_unknown_config_values_are_named():
    raw = release_config(TINY)
    stt = raw["model"]["stt"]["model"]
    stt["perception"]["encoder"]["n_heads"] = 8
    stt["base_model_name"] = "model"
    raw["model"]["speech_generation"]["model"]["codec_config"]["num_quantizers"] = 8
    with pytest.raises(CheckpointError) as e:
        check_release_config(raw, TINY)
    msg = str(e.value)
    print(msg)
    assert "perception.num_heads: release 8, preset 4" in msg
    assert "base_model_name = 'model'" in msg
    assert "talker.num_codebooks = 31 contradicts codec.num_codebooks = 8" in msg


# ---------------------------------------------------------------------- the 11B release, lazily


def _release_11b(folder: Path) -> tuple[SimpleNamespace, dict]:
    """The 11B stages on the meta device and a sparse model.safetensors with every release name: the stages'
    own name tables, the second speaker, and the release tensors inference leaves alone (the codec's encoder
    and training statistics, the prompt projection, the EOS head, 15 RNNT tensors). Real shapes for all the
    tensors Chorus reads; the unread ones keep their names with placeholder shapes."""
    cfg = model_config(load_preset("nemotron-voicechat-11b"))
    with torch.device("meta"):
        stages = build_stages(cfg, 1, 0, DTYPE_POLICIES["fp32"])
    p = SimpleNamespace(**dict(zip(("perception", "thinker", "talker", "codec"), stages, strict=True)))
    shapes = {}
    for name, (_, t) in targets(p).items():
        shape = (1, *t.shape) if name.startswith(weights.SPEAKER_PREFIX) else tuple(t.shape)
        shapes[name] = (shape, t.dtype)
    tiny = load_file(FIXTURES / "model" / "model.safetensors")
    for name, t in tiny.items():
        if name not in shapes and weights.is_ignored(name):
            shapes[name] = (tuple(t.shape), torch.float32)
    shapes["tts_model.audio_prompt_latents.Bella"] = ((1, 37, 1152), torch.float32)
    for i in range(15):
        part = "rnnt_decoder.prediction" if i < 7 else "rnnt_joint.joint_net"
        shapes[f"stt_model.{part}.{i}.weight"] = ((8, 8), torch.float32)
    size = write_header_only(folder / "model.safetensors", shapes)
    (folder / "config.json").write_text(json.dumps(release_config(cfg)))
    return p, {"cfg": cfg, "shapes": shapes, "size": size}


def test_the_whole_11b_release_lands_where_it_belongs_on_the_meta_device(tmp_path):
    p, r = _release_11b(tmp_path)
    assert r["size"] > 40 * 2**30 and (tmp_path / "model.safetensors").stat().st_blocks * 512 < 2**20
    cfg = model_config(load_preset("nemotron-voicechat-11b"), checkpoint=tmp_path)
    assert cfg == r["cfg"]
    report = load_checkpoint(p, tmp_path)
    names = set(r["shapes"])
    print(
        f"{len(names)} tensors, {len(report.consumed)} read, {len(report.ignored)} unused, "
        f"{r['size'] / 2**30:.1f} GiB"
    )
    assert report.consumed | report.ignored == names and not report.consumed & report.ignored
    assert all(weights.is_ignored(n) or n.startswith(weights.SPEAKER_PREFIX) for n in report.ignored)
    assert report.speakers == ["Aria", "Bella"]
    # each release name lands on our tensor of the same name, less the stage prefix
    prefixes = {
        "thinker": "stt_model.",
        "perception": "stt_model.perception.",
        "talker": "tts_model.tts_model.",
        "codec": "tts_model.audio_codec.",
    }
    for rel, ours in report.placed.items():
        stage, local = ours.split(".", 1)
        assert rel == prefixes[stage] + local or rel.startswith("tts_model.") and stage == "talker", (
            rel,
            ours,
        )
    assert (
        report.placed["stt_model.llm.layers.55.mixer.down_proj.weight"]
        == "thinker.llm.layers.55.mixer.down_proj.weight"
    )
    assert report.placed["tts_model.audio_prompt_latents.Aria"] == "talker.speaker_latent"

    def numel(shape) -> int:
        return shape.numel() if hasattr(shape, "numel") else torch.Size(shape).numel()

    read = sum(numel(r["shapes"][n][0]) for n in report.consumed)
    assert 10.9e9 < read < 11.1e9, read


def test_not_enough_device_memory_says_how_much_is_needed():
    cfg = load_preset("nemotron-voicechat-11b")
    with pytest.raises(CheckpointError, match=r"needs \d+\.\d GiB .*weights .*8\.0 GiB is free"):
        check_memory(cfg, DTYPE_POLICIES["gpu"], 64, torch.device("cuda"), free_bytes=8 * 2**30)
    need = check_memory(cfg, DTYPE_POLICIES["gpu"], 16, torch.device("cuda"), free_bytes=141 * 10**9)
    assert 20 * 2**30 < need < 141 * 10**9


# ---------------------------------------------------------------------- clear failures


def test_a_truncated_file_is_named(release, tmp_path):
    folder = save(tmp_path, release)
    f = folder / "model.safetensors"
    size = f.stat().st_size
    with open(f, "r+b") as fh:
        fh.truncate(size - 4096)
    with pytest.raises(CheckpointError, match="truncated.*download it again"):
        load_checkpoint(pipeline(), folder)


def test_a_tensor_of_the_wrong_shape_is_named_with_both_shapes(release, tmp_path):
    name = "stt_model.llm.layers.0.mixer.in_proj.weight"
    bad = dict(release, **{name: release[name][:-1]})
    with pytest.raises(
        CheckpointError, match=r"in_proj.weight \[\d+, 128\] \(the thinker expects \[\d+, 128\]\)"
    ):
        load_checkpoint(pipeline(), save(tmp_path, bad))


def test_missing_and_unexpected_keys_are_named(release, tmp_path):
    broken = {k: v for k, v in release.items() if k != "tts_model.tts_model.embed_code.weight"}
    broken["stt_model.rnnt_joint.pred.weight"] = torch.zeros(2)  # known and unused: no complaint
    broken["tts_model.tts_model.mystery"] = torch.zeros(2)
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(pipeline(), save(tmp_path, broken))
    msg = str(e.value)
    assert "missing 1 tensors the talker needs: tts_model.tts_model.embed_code.weight" in msg
    assert "tensors no stage knows: tts_model.tts_model.mystery" in msg and "rnnt" not in msg


def test_missing_files_are_named(tmp_path):
    with pytest.raises(CheckpointError, match="no model.safetensors"):
        load_checkpoint(pipeline(), tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(CheckpointError, match="no config.json"):
        model_config(TINY, checkpoint=tmp_path)
    with pytest.raises(CheckpointError, match="no tokenizer.json"):
        model_config(TINY, tokenizer=tmp_path)


def test_a_tokenizer_without_a_special_token_is_named(tmp_path):
    text = Path(TOKENIZER).read_text().replace('"<SPECIAL_12>"', '"<SPECIAL_12b>"')
    (tmp_path / "tokenizer.json").write_text(text)
    with pytest.raises(CheckpointError, match=r"special token '<SPECIAL_12>' \(pad\) is not in"):
        model_config(TINY, tokenizer=tmp_path)


# ---------------------------------------------------------------------- tokenizer, speaker, progress


def test_tokenizer_derived_talker_tensors_match_the_checkpoint(release, tmp_path, caplog):
    cfg = model_config(TINY, checkpoint=save(tmp_path, release), tokenizer=TOKENIZER)
    assert cfg.talker.char_vocab_size == 256  # the tiny tokenizer's single-character tokens
    p = pipeline(cfg)
    with caplog.at_level("WARNING", logger="chorus.weights"):
        load_checkpoint(p, tmp_path)
    assert "subword flags differ" not in caplog.text
    for name in weights.TOKENIZER_DERIVED:
        ours = p.talker.state_dict()[name.removeprefix("tts_model.tts_model.")]
        assert torch.equal(ours, release[name]), name
    # a tokenizer with fewer characters than the checkpoint's char embedding has rows (here: the talker's
    # embedding as a 255-character tokenizer sizes it): named, with both shapes
    p.talker.embed_subword.embed_tokens = torch.nn.Embedding(256, 128)
    expected = r"embed_subword.embed_tokens.weight \[257, 128\] \(the talker expects \[256, 128\]\)"
    with pytest.raises(CheckpointError, match=expected):
        weights.plan(p, {k: tuple(v.shape) for k, v in release.items()})


def test_the_speaker_is_a_setting_and_the_names_come_from_the_checkpoint(release, tmp_path):
    folder = save(tmp_path, release)
    cfg = model_config(TINY, checkpoint=folder, speaker="Bella")
    p = pipeline(cfg)
    load_checkpoint(p, folder)
    assert torch.equal(p.talker.speaker_latent, release["tts_model.audio_prompt_latents.Bella"][0])
    p = pipeline(model_config(TINY, speaker="Nobody"))
    with pytest.raises(
        CheckpointError, match="speaker 'Nobody' is not in the checkpoint; it has Aria, Bella"
    ):
        load_checkpoint(p, folder)


def test_the_engine_takes_checkpoint_tokenizer_and_speaker(release, tmp_path):
    from engine.tick.engine import Engine, EngineConfig

    folder = save(tmp_path / "release", release)
    tok = tmp_path / "nano"  # the tokenizer download: a folder with tokenizer.json
    tok.mkdir()
    (tok / "tokenizer.json").write_text(Path(TOKENIZER).read_text())
    config = EngineConfig(
        preset="tiny", num_slots=2, checkpoint=str(folder), tokenizer=str(tok), speaker="Bella", start=False
    )
    with Engine(config) as e:
        assert e.model_cfg.tokens.tokenizer == str(tok / "tokenizer.json")
        latent = release["tts_model.audio_prompt_latents.Bella"][0]
        assert torch.equal(e.pipeline.talker.speaker_latent, latent)


def test_loading_casts_in_chunks_to_each_stage_s_dtype(release, tmp_path, monkeypatch):
    folder = save(tmp_path, release)
    monkeypatch.setattr(weights, "CHUNK_BYTES", 4096)
    p = Pipeline(TINY, 2, Tokens(TINY.tokens), DTYPE_POLICIES["gpu"])
    load_checkpoint(p, folder)
    name = "stt_model.embed_tokens.weight"  # 256 KiB in the file: 64 chunks
    assert p.thinker.embed_tokens.weight.dtype == torch.bfloat16
    assert torch.equal(p.thinker.embed_tokens.weight, release[name].to(torch.bfloat16))


def test_progress_shows_tensors_bytes_rate_and_time_left():
    class Tty:
        def __init__(self) -> None:
            self.text = ""

        def isatty(self) -> bool:
            return True

        def write(self, s: str) -> None:
            self.text += s

        def flush(self) -> None:
            pass

    now = [0.0]
    out = Tty()
    pr = Progress(4, 4 * 2**30, stream=out, clock=lambda: now[0])
    now[0] = 2.0
    pr.advance(1, 2**30)
    assert out.text == "\rloading weights: 1/4 tensors, 1.00/4.00 GiB, 512 MiB/s, 6 s left"
    now[0] = 8.0
    pr.advance(3, 3 * 2**30)
    pr.finish()
    assert out.text.endswith("4/4 tensors, 4.00/4.00 GiB, 512 MiB/s, 0 s left\n")


@pytest.mark.slow
def test_peak_resident_memory_of_a_1gb_load_stays_below_one_and_a_half_times_its_size(tmp_path):
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "load_checkpoint.py"), "--out", str(tmp_path)],
        check=True,
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    r = json.loads(out.stdout.strip().splitlines()[-1])
    print(r)
    assert r["checkpoint_bytes"] > 0.9e9
    # the model and its loading (the interpreter's fixed 0.3-0.5 GB left out): never two copies of the weights
    assert r["peak_rss_during_load_bytes"] - r["rss_interpreter_bytes"] < 1.5 * r["checkpoint_bytes"]
    assert r["added_by_loading_bytes"] < 0.25 * r["checkpoint_bytes"]  # a chunk or so, not a copy
