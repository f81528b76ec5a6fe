"""`python -m agent simulate | token | dev | start | console`: the simulation (the embedded default), a join
token for a test client, or the livekit-agents worker commands, passed through with Chorus's server.
Settings come from the environment or `.env` (see agent/settings.py).
"""

from __future__ import annotations

import argparse
import sys


def _token(argv: list[str]) -> int:
    from livekit import api

    from agent.settings import AgentSettings

    p = argparse.ArgumentParser(
        prog="python -m agent token", description="print a join token for a test client"
    )
    p.add_argument("--room", required=True)
    p.add_argument("--identity", default="caller")
    p.add_argument("--ttl-minutes", type=int, default=60)
    args = p.parse_args(argv)
    s = AgentSettings.from_env()
    if not s.livekit_api_key or not s.livekit_api_secret:
        print("token: set LIVEKIT_API_KEY and LIVEKIT_API_SECRET (environment or .env)", file=sys.stderr)
        return 2
    from datetime import timedelta

    token = (
        api.AccessToken(s.livekit_api_key, s.livekit_api_secret)
        .with_identity(args.identity)
        .with_ttl(timedelta(minutes=args.ttl_minutes))
        .with_grants(api.VideoGrants(room_join=True, room=args.room))
        .with_room_config(api.RoomConfiguration(agents=[api.RoomAgentDispatch(agent_name=s.agent_name)]))
        .to_jwt()
    )
    print(token)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = argv[0] if argv else "simulate"
    if command == "simulate":
        from agent import simulate

        p = argparse.ArgumentParser(
            prog="python -m agent simulate", description=simulate.__doc__.splitlines()[0]
        )
        simulate.add_arguments(p)
        return simulate.main(p.parse_args(argv[1:]))
    if command == "token":
        return _token(argv[1:])
    if command in ("-h", "--help"):
        print(__doc__)
        return 0
    # dev | start | console | download-files ...: livekit-agents' own CLI, running Chorus's server
    from livekit.agents import cli

    from agent.settings import AgentSettings
    from agent.worker import build_server

    settings = AgentSettings.from_env()
    if command in ("dev", "start", "connect"):
        missing = [
            name
            for name, value in (
                ("LIVEKIT_URL", settings.livekit_url),
                ("LIVEKIT_API_KEY", settings.livekit_api_key),
                ("LIVEKIT_API_SECRET", settings.livekit_api_secret),
            )
            if not value
        ]
        if missing:
            print(
                f"{command}: set {', '.join(missing)} (environment or .env) to reach a LiveKit server",
                file=sys.stderr,
            )
            return 2
    sys.argv = [sys.argv[0], *argv]
    cli.run_app(build_server(settings))
    return 0


if __name__ == "__main__":
    sys.exit(main())
