"""The monitoring page, served by Streamlit (on 127.0.0.1 unless --address says otherwise).

`python -m ui [--port 8501] [--address 127.0.0.1]` runs `streamlit run ui/monitor.py` headless; the page's
settings come from the environment (ui/settings.py)."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

PAGE = Path(__file__).with_name("monitor.py")


def command(port: int, address: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "streamlit",
        "run",
        str(PAGE),
        "--server.address",
        address,
        "--server.port",
        str(port),
        "--server.headless",
        "true",
        "--browser.gatherUsageStats",
        "false",
        "--client.toolbarMode",
        "viewer",
    ]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m ui", description=__doc__.splitlines()[0])
    p.add_argument("--port", type=int, default=8501, help="the page's port (default 8501)")
    p.add_argument(
        "--address",
        default="127.0.0.1",
        help="the address to listen on (default 127.0.0.1: this machine only)",
    )
    args = p.parse_args(argv)
    cmd = command(args.port, args.address)
    os.execv(cmd[0], cmd)


if __name__ == "__main__":
    main()
