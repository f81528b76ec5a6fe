"""The versions of the rtc SDK and of livekit-agents that Chorus's patches are written against are named once
(agent/audio_in/__init__.py): constraints.txt pins those, and they are the ones installed. Bumping either
fails here until the patches have been read against the new version and the names moved with it."""

from __future__ import annotations

import re
from importlib.metadata import version
from pathlib import Path

import agent.audio_in as audio_in

ROOT = Path(__file__).resolve().parent.parent


def pinned(package: str) -> str | None:
    found = re.search(rf"^{re.escape(package)}==([^\s;]+)", (ROOT / "constraints.txt").read_text(), re.M)
    return found.group(1) if found else None


def test_the_patches_versions_are_the_pinned_and_installed_ones():
    named = {"livekit": audio_in.LIVEKIT, "livekit-agents": audio_in.LIVEKIT_AGENTS}
    assert {p: pinned(p) for p in named} == named
    assert {p: version(p) for p in named} == named
