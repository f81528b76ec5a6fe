"""The monitoring page in a real browser: a short simulation serves its engine's snapshot, `python -m ui`
serves the page, and headless Chromium (Debian's package; `.ci/run` installs it) renders it. The rendered page
must show the simulation's live session count; the screenshot is kept in out/monitor/ as the test's artifact.

Every wait is for an event (a line printed, a snapshot with every room in it, the figure on screen), bounded
by a timeout only against a hang: the machine may be busy."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from chromium_support import Browser, chromium_path
from engine.api import EngineSnapshot
from testkit.worker import free_port
from wait_support import wait_until

ROOT = Path(__file__).resolve().parent.parent
ARTIFACT = ROOT / "out" / "monitor" / "monitor.png"
ROOMS = 4
HANG_S = 300.0  # no wait below may take longer (a 2-core machine shared with other jobs)

METRICS_JS = """(() => {
  const m = [...document.querySelectorAll('[data-testid="stMetric"]')].map(e => e.innerText.split('\\n')
      .map(s => s.trim()).filter(Boolean));
  return m.some(t => t[0] === 'Live sessions') ? m : null;
})()"""


UPDATED_JS = "(document.body.innerText.match(/Updated \\d\\d:\\d\\d:\\d\\d/) || [null])[0]"


def read_snapshot(url: str) -> EngineSnapshot | None:
    try:
        return EngineSnapshot.model_validate_json(urllib.request.urlopen(url, timeout=5).read())
    except OSError:
        return None


def start_ui(env: dict[str, str], log: Path) -> tuple[subprocess.Popen, str]:
    """`python -m ui` on a free port with `env`, its output into `log`; the process and its page's URL."""
    port = free_port()
    with log.open("w") as out:
        ui = subprocess.Popen(
            [sys.executable, "-m", "ui", "--port", str(port)],
            cwd=ROOT,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    return ui, f"http://127.0.0.1:{port}/"


def wait_for_page(ui: subprocess.Popen, page: str, log: Path) -> None:
    """Until the Streamlit server at `page` answers its health check (its log shown if it exits first)."""

    def healthy() -> bool:
        assert ui.poll() is None, log.read_text()
        try:
            return urllib.request.urlopen(page + "_stcore/health", timeout=5).status == 200
        except OSError:
            return False

    wait_until(healthy, "the Streamlit server", HANG_S, every=0.25)


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)  # the simulation writes its figures and exits; Streamlit exits
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.mark.slow
def test_the_page_shows_a_running_simulation_in_chromium(tmp_path):
    chromium_path()  # skip (or fail under CI) before starting anything
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CHORUS_", "DATABASE_URL"))}
    sim_log = tmp_path / "simulate.log"
    with sim_log.open("w") as log:
        sim = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "agent",
                "simulate",
                "--rooms",
                str(ROOMS),
                "--tool-rooms",
                "2",
                "--seconds",
                "600",
                "--metrics-port",
                "0",
                "--out",
                str(tmp_path / "sim"),
            ],
            cwd=ROOT,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    ui = None
    try:

        def snapshot_url() -> str | None:
            for line in sim_log.read_text().splitlines():
                if line.startswith("engine snapshot at "):
                    return line.split()[3].rstrip(";")
            assert sim.poll() is None, f"the simulation exited early:\n{sim_log.read_text()[-2000:]}"
            return None

        url = wait_until(snapshot_url, "the simulation's snapshot URL", HANG_S, every=0.25)
        wait_until(
            lambda: (s := read_snapshot(url)) and len(s.sessions) == ROOMS,
            f"{ROOMS} rooms in the engine",
            HANG_S,
            every=0.25,
        )

        ui_env = env | {"CHORUS_MONITOR_URLS": url, "CHORUS_DATA_DIR": str(tmp_path / "sim" / "data")}
        ui, page = start_ui(ui_env, tmp_path / "ui.log")

        wait_for_page(ui, page, tmp_path / "ui.log")

        with Browser(height=2200) as browser:
            browser.open(page)
            shown = browser.wait_for(METRICS_JS, "the page's figures", timeout=HANG_S)
            figures = {m[0]: m[1] for m in shown if len(m) >= 2}
            snap = read_snapshot(url)
            assert snap is not None and len(snap.sessions) == ROOMS  # every room still in its call
            assert figures["Live sessions"] == f"{ROOMS} / {snap.num_slots}"
            browser.wait_for(
                "document.querySelectorAll('[data-testid=\"stDataFrame\"]').length >= 1", "the sessions table"
            )
            browser.screenshot(ARTIFACT)
            # the figures refresh by themselves (a fragment with run_every): the page's clock line moves on
            updated = browser.wait_for(UPDATED_JS, "the page's update line")
            browser.wait_for(
                f"(() => {{ const u = {UPDATED_JS}; return u && u !== {updated!r}; }})()", "a refresh"
            )
        assert ARTIFACT.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    finally:
        if ui is not None:
            stop(ui)
        stop(sim)


BODY_JS = "document.body.innerText"
SECRETS = ("mysql", "admin", "db.internal", "DATABASE_URL", "settings")  # of the refused setting's error


@pytest.mark.slow
def test_without_the_token_the_browser_shows_the_refusal_and_nothing_else(tmp_path):
    """The page served as an operator runs it, with a token and a refused setting: a visitor without the token
    sees the refusal and not the setting's error (which names the database); the token's holder sees it."""
    chromium_path()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CHORUS_", "DATABASE_URL"))}
    env |= {
        "CHORUS_MONITOR_TOKEN": "s3cret-token",
        "DATABASE_URL": "mysql://admin:hunter22@db.internal/hotel",
        "CHORUS_DATA_DIR": str(tmp_path),
    }
    ui, page = start_ui(env, tmp_path / "ui.log")
    try:
        wait_for_page(ui, page, tmp_path / "ui.log")
        with Browser() as browser:
            for visit in (page, page + "?token=wrong-token"):
                browser.open(visit)
                text = browser.wait_for(  # the page's answer: its refusal, or what it should not show
                    f"(() => {{ const t = {BODY_JS}; return location.href === {visit!r} && "
                    "/Refused|refused/.test(t) ? t : null; })()",
                    "the page's answer",
                    timeout=HANG_S,
                )
                assert "Refused: this page needs its access token" in text
                assert [w for w in SECRETS if w in text] == []
            browser.open(page + "?token=s3cret-token")
            shown = browser.wait_for(
                f"(() => {{ const t = {BODY_JS}; return t.includes('DATABASE_URL') ? t : null; }})()",
                "the settings error, for the token's holder",
                timeout=HANG_S,
            )
            assert "mysql://admin:***@db.internal/hotel" in shown and "hunter22" not in shown
    finally:
        stop(ui)
