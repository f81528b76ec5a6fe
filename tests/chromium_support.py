"""Headless Chromium (Debian's `chromium` package) driven over the DevTools protocol, for the
page's browser test.

A plain module beside the tests. Streamlit draws its page from a websocket after load, so `--dump-dom` sees an
empty shell; instead the test opens the page, waits for what it expects to be on screen (an event, bounded by
a timeout only against a hang) and reads the rendered text and a screenshot. Needs only `websockets`, which
Streamlit itself depends on.
"""

from __future__ import annotations

import base64
import contextlib
import itertools
import json
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest
from websockets.sync.client import connect

_DEVTOOLS = re.compile(r"DevTools listening on (ws://\S+)")


def chromium_path() -> str:
    """The browser, or skip (fail under CI=true, where `.ci/run` installs it)."""
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    if path is None:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail("CI=true but chromium is missing: .ci/run must install it")
        pytest.skip("no chromium (Debian: apt-get install chromium)")
    return path


class Browser:
    """One headless Chromium with one page."""

    def __init__(
        self, width: int = 1400, height: int = 1600, timeout: float = 120.0, flags: list[str] | None = None
    ) -> None:
        """`flags` replace the headless defaults (DevTools, the profile and the blank page
        are always added)."""
        self._profile = tempfile.mkdtemp(prefix="chorus-chromium-")  # removed by close()
        flags = flags or [
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-dev-shm-usage",
            "--no-first-run",
            f"--window-size={width},{height}",
        ]
        args = [
            chromium_path(),
            *flags,
            "--remote-debugging-port=0",
            "--remote-debugging-address=127.0.0.1",
            f"--user-data-dir={self._profile}",
            "about:blank",
        ]
        self._log = Path(self._profile) / "stderr.log"  # a file, not a pipe: a full pipe would stall it
        with self._log.open("w") as log:
            # its own process group: closing it ends its helper processes too, which write into the profile
            self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=log, start_new_session=True)
        self._ids = itertools.count(1)
        self._open = contextlib.ExitStack()
        try:
            browser_ws = self._devtools_url(timeout)
            http = browser_ws.replace("ws://", "http://").split("/devtools/")[0]
            pages = json.loads(urllib.request.urlopen(f"{http}/json/list", timeout=10).read())
            page = next(p for p in pages if p.get("type") == "page")
            self.ws = self._open.enter_context(
                connect(page["webSocketDebuggerUrl"], max_size=64 * 2**20, open_timeout=timeout)
            )
        except BaseException:
            self.close()
            raise

    def _devtools_url(self, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if m := _DEVTOOLS.search(self._log.read_text(errors="replace")):
                return m.group(1)
            if self.proc.poll() is not None:
                raise RuntimeError(f"chromium exited with {self.proc.returncode} before opening DevTools")
            time.sleep(0.1)
        raise TimeoutError("chromium did not open DevTools")

    def call(self, method: str, **params) -> dict:
        msg_id = next(self._ids)
        self.ws.send(json.dumps({"id": msg_id, "method": method, "params": params}))
        while True:
            reply = json.loads(self.ws.recv(timeout=120))
            if reply.get("id") == msg_id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply.get("result", {})

    def open(self, url: str) -> None:
        self.call("Page.enable")
        self.call("Page.navigate", url=url)

    def evaluate(self, expression: str):
        result = self.call("Runtime.evaluate", expression=expression, returnByValue=True)
        return result.get("result", {}).get("value")

    def wait_for(self, expression: str, what: str, timeout: float = 180.0):
        """The first truthy value of `expression`, polled; `timeout` only bounds a wait that would hang."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            value = self.evaluate(expression)
            if value:
                return value
            time.sleep(0.25)
        raise AssertionError(f"timed out waiting for {what}")

    def screenshot(self, path: Path) -> Path:
        data = self.call("Page.captureScreenshot", format="png", captureBeyondViewport=False)["data"]
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(base64.b64decode(data))
        return path

    def close(self) -> None:
        self._open.close()
        for sig in (signal.SIGTERM, signal.SIGKILL):  # the browser and every helper process it started
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, sig)
            try:
                self.proc.wait(timeout=10)
                break
            except subprocess.TimeoutExpired:
                continue
        # a helper that outlived the group's signal may still write a file into the profile: retry,
        # then leave it
        for _ in range(20):
            shutil.rmtree(self._profile, ignore_errors=True)
            if not Path(self._profile).exists():
                break
            time.sleep(0.25)

    def __enter__(self) -> Browser:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
