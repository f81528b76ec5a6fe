"""Settings from the environment and `.env`: the commands refuse a bad value in one line before anything
starts, `.env` is read from the working directory (the environment wins over it), and LiveKit's own
LIVEKIT_AGENT_NAME wins over CHORUS_AGENT_NAME."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from agent.settings import DEFAULT_AGENT_NAME, AgentSettings
from envsettings import SettingsError
from tools.settings import StoreSettings

ROOT = Path(__file__).resolve().parent.parent
SIMULATE = ["agent", "simulate", "--seconds", "1"]


def clean_env(**values: str) -> dict[str, str]:
    """This process's environment without any Chorus or LiveKit setting, plus `values`."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("CHORUS_", "LIVEKIT_")) and k != "DATABASE_URL"
    }
    return {**env, "PYTHONPATH": str(ROOT), **values}


def run(args: list[str], cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=120
    )


@pytest.fixture
def no_settings(tmp_path, monkeypatch):
    """No Chorus or LiveKit variable in the environment, and a working directory without `.env`."""
    for name in list(os.environ):
        if name.startswith(("CHORUS_", "LIVEKIT_")) or name == "DATABASE_URL":
            monkeypatch.delenv(name)
    monkeypatch.chdir(tmp_path)
    return tmp_path


# --- the commands -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "command, name, value, allowed",
    [
        (SIMULATE, "CHORUS_SLOTS", "0", "a whole number from 1 to 4096"),
        (SIMULATE, "CHORUS_SLOTS", "sixty", "a whole number from 1 to 4096"),
        (SIMULATE, "CHORUS_DB_POOL_SIZE", "0", "a whole number from 1 to 1024"),
        (SIMULATE, "CHORUS_PRESET", "huge", "one of nemotron-voicechat-11b, tiny"),
        (["agent", "token", "--room", "lobby"], "CHORUS_SLOTS", "sixty", "a whole number from 1 to 4096"),
        (["tools", "audit"], "CHORUS_DB_POOL_SIZE", "0", "a whole number from 1 to 1024"),
        (["tools", "audit"], "DATABASE_URL", "mysql://hotel@db/hotel", "a postgresql:// URL"),
    ],
)
def test_a_bad_setting_is_one_line_and_exit_2_before_anything_starts(tmp_path, command, name, value, allowed):
    out, data = tmp_path / "sim", tmp_path / "data"
    args = [*command, "--out", str(out)] if command == SIMULATE else command
    proc = run(args, tmp_path, clean_env(**{name: value, "CHORUS_DATA_DIR": str(data)}))
    print(proc.stdout, proc.stderr)
    assert proc.returncode == 2
    assert len(proc.stderr.strip().splitlines()) == 1
    assert f"{name}={value}: must be {allowed}" in proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr
    assert not out.exists() and not data.exists()  # no room, no database


def test_dotenv_in_the_working_directory_is_read_and_the_environment_wins(tmp_path):
    from livekit import api

    (tmp_path / ".env").write_text(
        "LIVEKIT_API_KEY=dotenv-key\n"
        f"LIVEKIT_API_SECRET={'s' * 40}\n"
        "LIVEKIT_AGENT_NAME=from-dotenv\n"
        "CHORUS_SLOTS=0\n"  # refused, were the environment not to win
        "UNRELATED_VARIABLE=1\n"
    )
    env = clean_env(LIVEKIT_AGENT_NAME="from-env", CHORUS_SLOTS="4")
    proc = run(["agent", "token", "--room", "lobby"], tmp_path, env)
    assert proc.returncode == 0, proc.stderr
    claims = api.TokenVerifier("dotenv-key", "s" * 40).verify(proc.stdout.strip())
    assert [a.agent_name for a in claims.room_config.agents] == ["from-env"]


def test_dotenv_is_not_searched_for_above_the_working_directory(tmp_path):
    (tmp_path / ".env").write_text("CHORUS_DB_POOL_SIZE=0\n")
    below = tmp_path / "below"
    below.mkdir()
    env = clean_env(CHORUS_DATA_DIR=str(tmp_path / "data"))
    assert run(["tools", "audit"], tmp_path, env).returncode == 2
    proc = run(["tools", "audit"], below, env)
    assert proc.returncode == 0, proc.stderr


# --- the settings themselves ---------------------------------------------------------------------------


def test_livekit_agent_name_wins_over_chorus_agent_name(no_settings, monkeypatch):
    assert AgentSettings.from_env().agent_name == DEFAULT_AGENT_NAME
    monkeypatch.setenv("CHORUS_AGENT_NAME", "chorus-desk")
    assert AgentSettings.from_env().agent_name == "chorus-desk"
    monkeypatch.setenv("LIVEKIT_AGENT_NAME", "livekit-desk")
    assert AgentSettings.from_env().agent_name == "livekit-desk"


@pytest.mark.parametrize(
    "name, value, allowed",
    [
        ("CHORUS_SLOTS", "1.5", "a whole number from 1 to 4096"),
        ("CHORUS_HTTP_PORT", "0", "a port number, 1 to 65535"),
        ("CHORUS_METRICS_PORT", "65536", "a port number, 1 to 65535"),
        ("CHORUS_PROMETHEUS_PORT", "metrics", "a port number, 1 to 65535"),
        ("CHORUS_CHECKPOINT", "/no/such/model", "an existing file or folder"),
        ("CHORUS_DB_WAIT_S", "0", "a number of seconds above 0, at most 600"),
        ("CHORUS_DB_WAIT_S", "inf", "a number of seconds above 0, at most 600"),
        (
            "CHORUS_DB_SCHEMA",
            "Hotel-1",
            "a lower-case SQL identifier (a-z, 0-9, _; not starting with a digit)",
        ),
    ],
)
def test_a_bad_value_names_the_variable_the_value_and_what_is_allowed(
    no_settings, monkeypatch, name, value, allowed
):
    monkeypatch.setenv(name, value)
    with pytest.raises(SettingsError) as err:
        AgentSettings.from_env()  # the agent's variables
        StoreSettings.from_env()  # the store's
    assert str(err.value) == f"{name}={value}: must be {allowed}"


def test_a_refused_database_url_does_not_repeat_its_password(no_settings, monkeypatch):
    monkeypatch.setenv("DATABASE_URL", "mysql://hotel:hunter2@db/hotel")
    with pytest.raises(SettingsError) as err:
        StoreSettings.from_env()
    assert str(err.value) == (
        "DATABASE_URL=mysql://hotel:***@db/hotel: "
        "must be a postgresql:// URL (empty: SQLite under CHORUS_DATA_DIR)"
    )


def test_empty_values_mean_the_defaults(no_settings, monkeypatch):
    for name in ("CHORUS_SLOTS", "CHORUS_PRESET", "CHORUS_HTTP_PORT", "CHORUS_DB_POOL_SIZE", "DATABASE_URL"):
        monkeypatch.setenv(name, " ")
    agent, store = AgentSettings.from_env(), StoreSettings.from_env()
    assert (agent.slots, agent.preset, agent.http_port) == (64, "tiny", None)
    assert (store.pool_size, store.database_url, store.describe()) == (
        8,
        None,
        "sqlite at data/hotel.sqlite3",
    )


def test_good_values_are_read_with_their_types(no_settings, monkeypatch):
    monkeypatch.setenv("CHORUS_SLOTS", "12")
    monkeypatch.setenv("CHORUS_HTTP_PORT", "8081")
    monkeypatch.setenv("DATABASE_URL", "postgresql://hotel:pw@db:5432/hotel")
    monkeypatch.setenv("CHORUS_DB_SCHEMA", "larkspur")
    monkeypatch.setenv("CHORUS_DB_WAIT_S", "0.5")
    agent, store = AgentSettings.from_env(), StoreSettings.from_env()
    assert (agent.slots, agent.http_port) == (12, 8081)
    assert (store.schema, store.wait_s, store.describe()) == ("larkspur", 0.5, "postgresql")
    assert "pw" not in repr(store)


def test_settings_made_in_code_do_not_read_the_environment(no_settings, monkeypatch):
    monkeypatch.setenv("CHORUS_PRESET", "huge")
    monkeypatch.setenv("DATABASE_URL", "postgresql://db/hotel")
    (no_settings / ".env").write_text("CHORUS_SLOTS=0\n")
    assert AgentSettings(slots=2, http_port=0).preset == "tiny"  # port 0 in code: any free port
    assert StoreSettings(data_dir=no_settings).database_url is None


def test_the_example_env_file_names_every_variable_and_its_values_are_accepted(no_settings):
    example = (ROOT / ".env.example").read_text()
    named = set(re.findall(r"^([A-Z_]+)=", example, flags=re.M))
    variables = set()
    for cls in (AgentSettings, StoreSettings):
        for field in cls.model_fields.values():
            alias = field.validation_alias
            variables |= {alias} if isinstance(alias, str) else set(alias.choices)
    assert variables <= named, f"not in .env.example: {sorted(variables - named)}"
    (no_settings / ".env").write_text(example)
    assert AgentSettings.from_env().preset == "tiny" and StoreSettings.from_env().pool_size == 8
