"""`python -m agent simulate | token | sip | dev | start | console`: the simulation (the embedded default), a
join token for a test client, the phone line (`sip setup | list | teardown | call`, agent/phone/sip.py), or
the worker: `dev` and `start` are livekit-agents' `python -m livekit.agents start [--dev] agent/worker.py`,
`console` is what `lk agent console` runs (it needs the LiveKit CLI's --connect-addr). Settings come from the
environment or `.env` (see agent/settings.py).
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
    s = AgentSettings.for_command("token")
    if s is None:
        return 2
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


def _store_problem() -> str | None:
    """Why the booking store cannot serve calls (unreachable, or no hotel in it), or None: a worker that would
    fail every job says so before it registers with LiveKit."""
    import logging

    from tools.hotel import Hotel, NotSetUp
    from tools.settings import StoreSettings
    from tools.store import open_store

    quiet = logging.getLogger("tools")
    level = quiet.level
    quiet.setLevel(logging.CRITICAL)  # the one line below says it; the store's own log would repeat it
    try:
        with open_store() as store:
            Hotel(store).policy()
    except NotSetUp:
        return "the booking store has no hotel: run `python -m tools seed` once"
    except Exception as e:  # noqa: BLE001 (an unreachable database, a bad file: one line, no traceback)
        return f"{StoreSettings.from_env().setting}: the booking store cannot be opened ({type(e).__name__})"
    finally:
        quiet.setLevel(level)
    return None


# `python -m agent X` -> `python -m livekit.agents ... agent/worker.py`
WORKER_COMMANDS = {"dev": ["start", "--dev"], "start": ["start"], "console": ["console"]}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = argv[0] if argv else "simulate"
    if command == "simulate":
        from agent.sim import simulate

        p = argparse.ArgumentParser(
            prog="python -m agent simulate", description=simulate.__doc__.splitlines()[0]
        )
        simulate.add_arguments(p)
        return simulate.main(p.parse_args(argv[1:]))
    if command == "token":
        return _token(argv[1:])
    if command == "sip":
        from agent.phone import sip

        return sip.main(argv[1:])
    if command in ("-h", "--help"):
        print(__doc__)
        return 0
    if command not in WORKER_COMMANDS:
        print(
            f"{command}: unknown command; choose simulate, token, sip, dev, start or console", file=sys.stderr
        )
        return 2
    # dev | start | console: livekit-agents' own CLI, on the `server` of agent/worker.py
    from agent.settings import AgentSettings
    from tools.settings import StoreSettings

    settings = AgentSettings.for_command(command)
    # the jobs open the store later: a bad setting of it is refused now
    if settings is None or StoreSettings.for_command(command) is None:
        return 2
    if command in ("dev", "start"):
        missing = settings.missing_livekit()
        if missing:
            print(
                f"{command}: set {', '.join(missing)} (environment or .env) to reach a LiveKit server",
                file=sys.stderr,
            )
            return 2
        from agent.startup import port_problem

        problem = port_problem(settings) or _store_problem()
        if problem:
            print(f"{command}: {problem}", file=sys.stderr)
            return 2
    if command == "console" and not any(a.split("=")[0] == "--connect-addr" for a in argv[1:]):
        print(
            "console: run `lk agent console` on agent/worker.py "
            "(the LiveKit CLI owns the microphone and speaker)",
            file=sys.stderr,
        )
        return 2
    from livekit.agents.__main__ import main as livekit_agents_main

    from agent import worker  # its settings were checked above

    status = livekit_agents_main([*WORKER_COMMANDS[command], worker.__file__, *argv[1:]])
    # a worker that failed after it started (one that failed to start has exited: agent/startup.py)
    server = vars(worker).get("server")
    return 1 if server is not None and server.failed else status


if __name__ == "__main__":
    sys.exit(main())
