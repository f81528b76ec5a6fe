-- A call's conversation while the call lasts (agent/carry.py): the agent's turns and its tool calls with their
-- results, as JSON, keyed by the room's sid, so that an agent replacing a lost one carries the call on.
-- Deleted when the call ends; one left behind by a call that never ended cleanly is purged by `updated_at`.

CREATE TABLE conversations (
    room_sid   TEXT        PRIMARY KEY,
    state      TEXT        NOT NULL,
    updated_at {timestamp} NOT NULL
);

CREATE INDEX conversations_updated ON conversations (updated_at);
