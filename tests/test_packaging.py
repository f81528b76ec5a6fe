"""What `pip install` makes of the project. The wheel ships every first-party package the shipped code imports
(pyproject's `packages.find`), checked from the source alone. The declared dependencies (pyproject.toml, with
the dev extra) and the lock (constraints.txt) resolve from PyPI for every supported Python and for a platform
without triton wheels, as wheels only: what `make` installs on a Linux host (PyPI's torch there is the CUDA
build) and on a Mac. Those need PyPI: skipped when it cannot be reached. Nothing is installed (`pip install
--dry-run`); this machine's pip configuration is ignored.

pip's --platform and --python-version pick wheels for the target but leave environment markers (`triton;
sys_platform == 'linux'`, torch's own) to this machine's values, so pip runs here with the target's marker
values in their place.
"""

from __future__ import annotations

import ast
import fnmatch
import json
import os
import shutil
import socket
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PYTHONS = ["3.11", "3.12", "3.13"]
# pip does not widen a manylinux_2_N tag to older glibcs, so every tag a current Linux accepts is listed
LINUX_X86_64 = [f"manylinux_2_{n}_x86_64" for n in range(28, 4, -1)] + ["manylinux2014_x86_64"]
PLATFORMS = {"linux-x86_64": LINUX_X86_64, "macos-arm64": ["macosx_14_0_arm64"]}
MARKERS = {
    "linux-x86_64": {"sys_platform": "linux", "platform_system": "Linux", "platform_machine": "x86_64"},
    "macos-arm64": {"sys_platform": "darwin", "platform_system": "Darwin", "platform_machine": "arm64"},
}
# pip, with the marker environment of the target (argv[1], JSON) in place of this machine's
PIP_AS_TARGET = """
import json, sys
import pip._vendor.packaging.markers as markers
target = {**markers.default_environment(), **json.loads(sys.argv[1])}
markers.default_environment = lambda: dict(target)
from pip._internal.cli.main import main
sys.exit(main(sys.argv[2:]))
"""
# pip settings that would change what is resolved: the project's files must not depend on them
PIP_RESOLVE_VARS = (
    "PIP_CONSTRAINT",
    "PIP_FIND_LINKS",
    "PIP_INDEX_URL",
    "PIP_EXTRA_INDEX_URL",
    "PIP_NO_INDEX",
    "PIP_REQUIRE_VIRTUALENV",
    "PIP_TARGET",
    "PIP_PREFIX",
    "PIP_USER",
    "PIP_ONLY_BINARY",
    "PIP_NO_BINARY",
)


@pytest.fixture(scope="module")
def pypi() -> None:
    try:
        socket.create_connection(("pypi.org", 443), timeout=5).close()
    except OSError:
        pytest.skip("PyPI cannot be reached")


def declared_requirements() -> list[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return project["dependencies"] + project["optional-dependencies"]["dev"]


def shipped_patterns() -> list[str]:
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    return setuptools["packages"]["find"]["include"]


def first_party_imports(path: Path) -> set[str]:
    """The top-level names of ours that `path` imports (at module level or inside a function)."""
    ours = {p.name for p in ROOT.iterdir() if (p / "__init__.py").is_file()}
    ours |= {p.stem for p in ROOT.glob("*.py")}
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names & ours


def test_the_wheel_ships_every_package_the_shipped_code_imports():
    patterns = shipped_patterns()
    shipped = sorted(
        p.name for p in ROOT.iterdir() if p.is_dir() and any(fnmatch.fnmatch(p.name, pat) for pat in patterns)
    )
    print("shipped packages:", shipped)
    missing = {
        f"{path.relative_to(ROOT)} imports {name}"
        for package in shipped
        for path in (ROOT / package).rglob("*.py")
        for name in first_party_imports(path)
        if not any(fnmatch.fnmatch(name, pat) for pat in patterns)
    }
    assert not missing, f"not in pyproject's packages.find include {patterns}: {sorted(missing)}"
    assert {"engine", "agent", "tools", "ui", "envsettings"} <= set(shipped)


def test_the_wheel_ships_the_files_the_code_reads_beside_its_modules(tmp_path):
    """The native audio's C sources (built on the host at first use), the prompts' clips, the schema: every
    file of a shipped package that is not Python and not built, in the wheel `pip install .` makes (built
    from a copy of the project's files, so no build folder is left in the tree)."""
    patterns = shipped_patterns()
    files = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()
    packaged = [
        f
        for f in files
        if "/" in f
        and any(fnmatch.fnmatch(f.split("/")[0], pat) for pat in patterns)
        and (ROOT / f.split("/")[0] / "__init__.py").is_file()
        and (ROOT / f).is_file()
    ]
    wanted = {f for f in packaged if Path(f).suffix in {".c", ".h", ".wav", ".json", ".sql", ".md"}}
    native = ("audio_pump.c", "capture.c", "resample.c", "pump.h", "resample.h")
    assert {f"agent/audio_in/native/{name}" for name in native} <= wanted
    src = tmp_path / "src"
    for f in [*packaged, "pyproject.toml", "README.md"]:
        (src / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(ROOT / f, src / f)
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            str(src),
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path),
        ],
        check=True,
        capture_output=True,
        timeout=300,
    )
    [wheel] = tmp_path.glob("*.whl")
    shipped = set(zipfile.ZipFile(wheel).namelist())
    missing = sorted(wanted - shipped)
    assert not missing, f"not in the wheel (pyproject's package-data): {missing}"


@pytest.mark.slow
@pytest.mark.network
@pytest.mark.parametrize("platform", sorted(PLATFORMS))
@pytest.mark.parametrize("python", PYTHONS)
def test_the_dependencies_and_the_lock_resolve(python, platform, tmp_path, pypi):
    (tmp_path / "requirements.txt").write_text("\n".join(declared_requirements()) + "\n")
    env = {k: v for k, v in os.environ.items() if k not in PIP_RESOLVE_VARS}
    env["PIP_CONFIG_FILE"] = os.devnull  # no global, user or site pip configuration
    markers = {**MARKERS[platform], "python_version": python, "python_full_version": f"{python}.0"}
    cmd = [sys.executable, "-c", PIP_AS_TARGET, json.dumps(markers)]
    cmd += ["install", "--dry-run", "--ignore-installed", "--only-binary=:all:", "--quiet"]
    cmd += ["--index-url", "https://pypi.org/simple", "--python-version", python]
    cmd += [arg for tag in PLATFORMS[platform] for arg in ("--platform", tag)]
    cmd += ["--target", str(tmp_path / "target"), "--report", str(tmp_path / "report.json")]
    cmd += ["-r", str(tmp_path / "requirements.txt"), "-c", str(ROOT / "constraints.txt")]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"Python {python} on {platform} does not resolve:\n{proc.stderr[-3000:]}"
    installed = {
        item["metadata"]["name"].lower(): item["metadata"]["version"]
        for item in json.loads((tmp_path / "report.json").read_text())["install"]
    }
    print(f"Python {python} on {platform}: {len(installed)} packages, torch {installed.get('torch')}")
    assert installed["torch"] == "2.13.0" and installed["livekit-agents"] == "1.8.9"
    assert ("triton" in installed) == platform.startswith("linux")
