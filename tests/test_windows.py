"""Context windows as settings, and the capacity mode: the talker's KV rings and the thinker's attention
window shrink as asked, `engine info` sizes what the engine allocates, and an engine with short
windows still talks."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from agent.settings import AgentSettings
from engine.api import AudioFrame
from engine.config.dtype_policy import dtype_policy
from engine.config.presets import load_preset
from engine.config.windows import CAPACITY_TALKER_WINDOW, talker_window, with_windows
from engine.model.pipeline import build_stages
from engine.sizing.info import report
from engine.text.tokens import Tokens
from engine.tick.engine import Engine, EngineConfig
from engine_support import drain
from envsettings import SettingsError


def test_windows_shrink_the_rings_and_info_sizes_them_as_built():
    tiny = load_preset("tiny")
    short = with_windows(tiny, talker=64, thinker=32)
    assert (short.talker.sliding_window, short.talker.attention_window) == (64, 64)
    assert short.thinker.attention_window == 32
    assert with_windows(tiny) is tiny  # nothing asked: the release's windows
    with torch.device("meta"):
        stages = build_stages(short, 2, Tokens(short.tokens).pad, dtype_policy("fp32"))
    perception, thinker, talker, codec = stages
    assert {t.shape[3] for t in talker.slot_state().values() if t.dim() == 5} == {
        64
    }  # [slots, streams, heads, ring, d]
    assert {t.shape[2] for t in thinker.slot_state().values() if t.dim() == 4} == {32}
    allocated = sum(t.numel() * t.element_size() for stage in stages for t in stage.slot_state().values())
    r = report(short, 0.0, "fp32")
    assert allocated == 2 * r["state_bytes_per_session"] + r["state_bytes_fixed"]
    assert report(tiny, 0.0, "fp32")["state_bytes_per_session"] > r["state_bytes_per_session"]


def test_capacity_mode_at_the_release_shape_fits_more_sessions():
    full = load_preset("nemotron-voicechat-11b")
    release, capacity = report(full, 141.0), report(with_windows(full, CAPACITY_TALKER_WINDOW), 141.0)
    print("sessions that fit in 141 GB:", release["sessions_fit"], "->", capacity["sessions_fit"])
    talker = capacity["state_bytes_detail"]["talker"] / release["state_bytes_detail"]["talker"]
    assert talker == pytest.approx(CAPACITY_TALKER_WINDOW / 7500, rel=0.1)
    assert capacity["sessions_fit"] > 3 * release["sessions_fit"]


def test_capacity_mode_never_lengthens_a_window():
    tiny = load_preset("tiny")  # its talker ring (512) is shorter than the capacity window already
    assert talker_window(tiny, None, capacity=True) == 512
    assert talker_window(load_preset("nemotron-voicechat-11b"), None, capacity=True) == CAPACITY_TALKER_WINDOW
    assert (
        talker_window(tiny, 100, capacity=True) == 100 and talker_window(tiny, None, capacity=False) is None
    )


def test_a_window_below_the_talkers_warm_up_is_refused():
    with pytest.raises(ValueError, match="warm-up"):
        with_windows(load_preset("tiny"), talker=3)
    with pytest.raises(ValueError):
        EngineConfig(talker_window=1)


def test_an_engine_with_short_windows_talks_past_them():
    """Forty ticks of caller audio through an engine whose rings hold 40 (talker) and 24 (thinker) positions:
    every tick one frame of audio, finite, past the point where the rings wrap."""
    with Engine(
        EngineConfig(preset="tiny", num_slots=2, talker_window=40, thinker_window=24, start=False)
    ) as e:
        assert e.model_cfg.talker.attention_window == 40 and e.model_cfg.thinker.attention_window == 24
        h = e.open_session("You are a concierge.", [])
        frames: list[AudioFrame] = []
        for k in range(120):
            h.push_audio(np.zeros(1280, np.float32))
            e.run_tick(k, e.clock() + 60.0)  # all paused work (the prompt) completes within each tick
            frames += [item for item in drain(h) if isinstance(item, AudioFrame)]
            if len(frames) >= 60:
                break
        assert len(frames) >= 60
        assert all(f.samples.shape == (1764,) and np.isfinite(f.samples).all() for f in frames)


def test_the_worker_settings_carry_the_windows(monkeypatch):
    monkeypatch.setenv("CHORUS_CAPACITY_MODE", "true")
    monkeypatch.setenv("CHORUS_THINKER_WINDOW", "4096")
    s = AgentSettings.from_env(dotenv=False)
    assert s.capacity_mode and s.thinker_window == 4096 and s.talker_window is None
    monkeypatch.setenv("CHORUS_TALKER_WINDOW", "1")
    with pytest.raises(SettingsError, match="CHORUS_TALKER_WINDOW=1: must be a whole number of positions"):
        AgentSettings.from_env(dotenv=False)
