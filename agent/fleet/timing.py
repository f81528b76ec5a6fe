"""The fleet's timings (agent/fleet/fleet.py), in one place: each named with its unit (`_S` seconds, `_MS`
milliseconds, Redis' `px`), each derived from what it depends on, with why. The modules read them as
`timing.NAME` when they run, so a test may set one here. Knows nothing else.

The two periods everything else is counted in are the worker's BEAT_S (it marks its rooms) and SWEEP_S (it
looks for rooms alone); the rest are the times LiveKit and its SDKs take, as seen on busy hosts.
"""

from __future__ import annotations

# -- a worker's marks (agent/fleet/fleet.py `beat`)
BEAT_S = 0.5  # how often a worker marks its rooms live (and a job polls its own connection)
# a mark not renewed this long is a hung worker's (a dead one's process is found by its presence connection
# at once): ten beats, so a worker whose loop or Redis stalls for seconds under load still renews it (at four
# beats, 2 s, a busy host's rooms were taken for lost and sent second agents)
LIVE_MS = round(10 * BEAT_S * 1000)
SERVED_S = 3600  # how long a room is remembered to have had an agent after its last mark: longer than a call

# -- a worker's sweep (agent/fleet/fleet.py `sweep`)
SWEEP_S = 0.5  # how often a worker looks for rooms alone
# a worker whose presence connection is missing from Redis this long is dead: under one sweep, so it is found
# gone at the second sweep that finds it missing (one sweep's look could race its reconnect)
GONE_S = 0.6 * SWEEP_S
FIRST_AGENT_S = 5.0  # a caller who has waited this long for the room's first agent gets one asked for
OTHERS_S = 20 * SWEEP_S  # a room dispatched no agent of this name is asked about again after twenty sweeps
# a served room with no agent and no caller this long: the call is over (its caller hung up); ten sweeps, so a
# caller whose connection blinked (back within seconds) is not taken for one who hung up
OVER_S = 10 * SWEEP_S

# -- one new agent per room (agent/fleet/fleet.py `_dispatch`)
# one new dispatch per room in this long, cluster-wide: the time a dispatch takes to bring a job that marks
# its room (a new job marks it at launch); a dispatch that brought none by then is asked for again
CLAIM_MS = 5000

# -- a room made again on another node (agent/fleet/classify.py `_moved`)
ABSENT_S = 2 * SWEEP_S  # a moved room's caller with no agent in it for two sweeps is alone
MOVED_S = 15.0  # a room made again on another node is looked into this long: callers' SDKs rejoin within it
# a moved room's agent, not in it, is taken as down this long: two claims, time for its replacement to mark it
MOVED_DOWN_MS = 2 * CLAIM_MS

# -- what LiveKit agrees with (agent/fleet/classify.py, agent/fleet/agreed.py)
# a job's mark is believed this long before its agent is in the room: a new job marks its room at launch, and
# its agent joins seconds later (more on a busy host)
JOIN_S = 10.0
# a held room's live mark, its agent seen in the room, is believed this long before LiveKit's list is read
# again: a job its worker still lists may have left the room with no down mark (its process ending after its
# connection was lost, or hung), and its caller is alone; one join, twenty sweeps between a room's reads
AGREED_S = JOIN_S
# a room whose marks were forged this long ago or less: a live mark missing there is asked of LiveKit too
# (removing a forged mark, by its writer or by the room's job, leaves the room unmarked until the next beat);
# three joins, so a forger's mark written again while a job joins is still caught
FORGED_S = 3 * JOIN_S

# -- a drain's handovers (agent/fleet/fleet.py)
HANDING_MS = 30_000  # a handover asked for is waited for this long (the draining agent talks on meanwhile)
HANDOVER_S = 2 * HANDING_MS // 1000  # a room handed over is known as such this long: two handovers' waits
# a drain's calls are handed over this many at a time, cluster-wide as the sweeps see it: each new agent's
# start (a process, a connection, a prefill) is a burst of work on the host that takes it, and a host handed a
# whole worker's calls at once starves its own calls and its LiveKit server (seen: connections failing by
# the dozen)
HANDOVERS_AT_ONCE = 4

# -- a room's job (agent/fleet/room_job.py, agent/fleet/takeover.py)
# a job's room connection down this long is lost: not a blip the SDK mends by itself (a resume on a busy
# machine can take more than a second), and well inside the time a node's callers take to come back (3 s+)
DOWN_GRACE_S = 3.0
# a job that ends while its connection is down leaves the room marked down this long: its worker lists it, and
# marks the room live, until its process has exited (livekit-agents gives a closing process 10 s; a busy
# host's may take longer), and a live mark of a job that has left the room must not hold it meanwhile
ENDED_DOWN_MS = 60_000
HELD_S = 4 * BEAT_S  # how often a job that is up looks whether another job holds its room
GONE_WAIT_S = 5.0  # how long a room whose connection closed is looked for (the server lists a closing room)
GONE_POLL_S = BEAT_S  # ... how often
TAKE_OVER_S = 10.0  # a handed-over call's new session sends its first frame within this, or takes over anyway
HOLD_ON_S = 0.5  # a call carried on after a break whose new session is not live this soon hears a hold clip

# -- a job's own re-dispatch, without Redis (agent/fleet/dispatches.py `redispatch_lost`)
REDISPATCH_MAX = 1  # a room whose agent lost its connection gets a new one this often at most
REDISPATCH_LOOKS = 3  # how often a room is searched for its caller (one dropped with the agent may rejoin)
REDISPATCH_LOOK_S = 4 * BEAT_S  # ... how far apart
