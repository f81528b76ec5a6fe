"""What the worker's log may carry of a caller: rooms and participants by their labels, none of what
livekit-agents marks personal, and no phone number.

livekit-agents logs a job's room, its participants and what they say as fields of its records (`extra`): the
fields it knows to be personal are named `lk.pii.<what>`, and rooms (`room`, `room_name`) and participants
(`participant`, `identity`, `caller_identity`, ...) by their names, also inside a job's description. A room's
name is its caller's choice or their number (`call-_+14155550123_AbCd`), a SIP participant's identity is their
number (`sip_+14155550123`), and a number may come as an integer too (`log.info("call %x", 14155550100)`).
`CallerDataMask`, a filter on the worker's log handlers (the one livekit-agents' CLI sets up prints every
field: JSON in production, colored in dev), rewrites each record before it is formatted. A room's process
masks its records on the handler that sends them to the worker; the worker's filter masks the fields added on
the way (the job's room, which livekit-agents' process executor adds as it passes them on). Knows logging
and the framework's field names; the rules on strings are redaction/'s.
"""

from __future__ import annotations

import logging
import math
import re
import threading
from collections import OrderedDict
from collections.abc import Mapping

from google.protobuf.json_format import MessageToDict
from google.protobuf.message import Message

from agent.call import room_label
from redaction import mask_numbers, pseudonym

REDACTED = "[redacted]"
PII = "lk.pii."  # livekit-agents' mark on a personal field
PHONE_DIGITS = 7  # free text: a number this long is taken for a phone number (a local one has seven digits)
REMEMBERED = 4096  # rooms' and participants' names whose labels replace them in free text (the latest)
MIN_REMEMBERED_CHARS = 3  # a shorter name would replace parts of ordinary words
# on a record once masked, its fields as masked (a formatter leaves out what starts with "_"): a field added
# or changed after is masked where it is met (livekit-agents' process executor adds a room process's job and
# room to each of its records as it hands them to the worker's handlers, masked already in that process)
MASKED = "_chorus_masked"

# the attributes every record has; the others are its fields
_STANDARD = frozenset(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime"}
_ROOM = re.compile(r"(?:^|_)room(?:_?name)?$")  # room, room_name, human_agent_room_name
_PERSON = re.compile(r"identit|participant|caller")  # identity, caller_identity, expected_identities, ...
_NAME = re.compile(r"(?:^|_)name$|metadata|attributes|phone|number")  # a participant's name, their SIP fields
# ids and kinds, not names: as any other text
_NOT_PERSONAL = re.compile(
    r"^(?:agent_name|tool_name|model_name|room_id|room_sid|participant_sid|participant_kind|track_sid|job_id)$"
)
_TRACE_ID = re.compile(r"[0-9a-f]{32}")  # an OpenTelemetry trace id as the log carries it
# a conversion of printf-style formatting: %s, %(to)x, %-10.3e, %*d, %%
_CONVERSION = re.compile(
    r"%(?:\((?P<key>[^)]*)\))?[#0 +-]*(?P<width>\*|\d+)?(?:\.(?P<precision>\*|\d+))?[hlL]?(?P<type>[a-zA-Z%])"
)


def participant_label(identity: str) -> str:
    """A participant as the log names it: `participant-xqzvbkdt`, a pseudonym of their identity."""
    return pseudonym("participant", identity) if identity else ""


def mask_number(value: int | float) -> int | float | str:
    """A number as the log may carry it: one of PHONE_DIGITS digits or more (a whole float too: 14155550100.0)
    as `mask_numbers` shows it in text, "•••• 0100"; a shorter one, a fraction (a time: 1767225600.25) and a
    bool as they are."""
    if isinstance(value, bool) or (
        isinstance(value, float) and not (math.isfinite(value) and value.is_integer())
    ):
        return value
    text = str(int(value))
    masked = mask_numbers(text, PHONE_DIGITS)
    return value if masked == text else masked


def scrub(key: str, value: object, room: bool = False, seen: dict[str, str] | None = None) -> object:
    """A record's field `key` as the log may carry it: a personal field of livekit-agents' redacted (its room
    and participant as their labels), a room's name and a participant's identity as their labels, a name,
    metadata or attributes redacted, mappings and sequences field by field, any other text with its phone
    numbers masked, a number of any type as `mask_number` has it. `room`: `value` belongs to a room (its
    `name` is the room's). The names given labels go in `seen` (name -> label)."""
    seen = {} if seen is None else seen
    k = key.lower()
    label = None
    if k.startswith(PII):
        if not isinstance(value, str) or k not in (f"{PII}room_name", f"{PII}participant_identity"):
            return REDACTED
        label = room_label if k == f"{PII}room_name" else participant_label
    elif isinstance(value, Message):
        return scrub(key, MessageToDict(value), room, seen)
    elif isinstance(value, Mapping):
        inner = bool(_ROOM.search(k))
        return {str(kk): scrub(str(kk), v, inner, seen) for kk, v in value.items()}
    elif isinstance(value, list | tuple | set | frozenset):
        return [scrub(key, v, room, seen) for v in value]
    elif value is None:
        return value
    elif isinstance(value, int | float):
        return mask_number(value)
    elif k == "trace_id" and isinstance(value, str) and _TRACE_ID.fullmatch(value):
        return value  # a call's trace (agent/tracing.py): random hex, whose digits are no one's number
    elif _NOT_PERSONAL.search(k):
        pass
    elif _ROOM.search(k) or (room and k == "name"):
        label = room_label
    elif _PERSON.search(k):
        label = participant_label
    elif _NAME.search(k):
        return REDACTED
    text = value if isinstance(value, str) else str(value)  # an exception, an object: as a formatter shows it
    if label is None:
        return mask_numbers(text, PHONE_DIGITS)
    seen[text] = label(text)
    return seen[text]


def _numbers_masked(value: object) -> object:
    """`value` (an argument of a record) with every number in it, in tuples, lists and dicts too, as
    `mask_number` has it; anything else as it is."""
    if isinstance(value, int | float):
        return mask_number(value)
    if isinstance(value, tuple | list):
        return type(value)(_numbers_masked(v) for v in value) if type(value) in (tuple, list) else value
    if isinstance(value, dict):
        return {k: _numbers_masked(v) for k, v in value.items()}
    return value


def format_message(record: logging.LogRecord) -> str:
    """The record's message with its arguments (`getMessage`), each number among them (in a tuple or a dict
    too) as `mask_number` has it, whatever its conversion: `%x` or `%e` would spell it in a way no mask of the
    text recognises. Raises as `getMessage` does where they do not fit."""
    msg, args = str(record.msg), record.args
    if not args:
        return msg
    keyed = isinstance(args, Mapping)
    values = dict(args) if keyed else list(args if isinstance(args, tuple) else (args,))
    masked = {i: _numbers_masked(v) for i, v in (values.items() if keyed else enumerate(values))}
    masked = {i: v for i, v in masked.items() if v is not values[i] and v != values[i]}
    if not masked:
        return record.getMessage()
    at = 0  # the next positional argument

    def conversion(m: re.Match[str]) -> str:
        """A number masked to text is formatted as text."""
        nonlocal at
        if m["type"] == "%":
            return m[0]
        if keyed:
            return f"%({m['key']})s" if m["key"] in masked else m[0]
        at += (m["width"] == "*") + (m["precision"] == "*") + 1  # a star takes an argument of its own
        return "%s" if at - 1 in masked else m[0]

    fmt = _CONVERSION.sub(conversion, msg)
    for i, v in masked.items():
        values[i] = v
    return fmt % (values if keyed else tuple(values))


def _masked_args(args: object) -> object:
    """A record's arguments with their numbers masked (and those in their text), for logging's report of
    arguments that do not fit their message."""
    if isinstance(args, Mapping):
        return {k: scrub("args", v) for k, v in args.items()}
    return tuple(scrub("args", v) for v in (args if isinstance(args, tuple) else (args,)))


class CallerDataMask(logging.Filter):
    """Rewrites a record in place before any formatter reads it: its fields as `scrub` has them; its message
    formatted with its arguments, and in it (and in a traceback) the names of the rooms and participants met
    so far (in fields, or told by `learn`) replaced by their labels and phone numbers masked. Another name in
    free text stays: Chorus's own messages carry ids, not names."""

    def __init__(self, remembered: int = REMEMBERED) -> None:
        super().__init__()
        self._lock = threading.Lock()
        self._remembered = remembered
        self._labels: OrderedDict[str, str] = OrderedDict()  # name -> label, the latest last
        self._pattern: re.Pattern[str] | None = None

    def learn(self, room: str = "", participant: str = "") -> None:
        """A room's and a participant's names, for their labels to replace them in free text from now on."""
        self._learn({room: room_label(room), participant: participant_label(participant)})

    def _learn(self, seen: dict[str, str]) -> None:
        fresh = {
            n: lab for n, lab in seen.items() if len(n) >= MIN_REMEMBERED_CHARS and n not in self._labels
        }
        if not fresh:
            return
        with self._lock:
            self._labels.update(fresh)
            while len(self._labels) > self._remembered:
                self._labels.popitem(last=False)
            names = sorted(self._labels, key=len, reverse=True)  # the longest first: a name inside another
            self._pattern = re.compile(
                "|".join(
                    ("(?<!\\w)" if n[0].isalnum() else "")
                    + re.escape(n)
                    + ("(?!\\w)" if n[-1].isalnum() else "")
                    for n in names
                )
            )
            # the re module keeps its last 512 compiled patterns: every past alternation of the names (one per
            # call, each longer than the last, up to REMEMBERED names) would stay in it, hundreds of MB over a
            # day's calls. Only this filter's latest is used, and it is kept above.
            re.purge()

    def free_text(self, text: str) -> str:
        """`text` with the names met so far as their labels and its phone numbers masked."""
        pattern, labels = self._pattern, self._labels
        if pattern is not None:
            text = pattern.sub(lambda m: labels.get(m.group(0), REDACTED), text)
        return mask_numbers(text, PHONE_DIGITS)

    def filter(self, record: logging.LogRecord) -> bool:
        fields = [k for k in vars(record) if k not in _STANDARD and not k.startswith("_")]
        masked = getattr(record, MASKED, None)
        if isinstance(masked, dict):  # by the filter of another handler, maybe in another process
            return self._mask_added(record, masked, fields)
        seen: dict[str, str] = {}
        for key in fields:
            setattr(record, key, scrub(key, getattr(record, key), seen=seen))
        setattr(record, MASKED, {key: getattr(record, key) for key in fields})
        if isinstance(record.msg, Mapping) and not record.args:  # a structured message
            record.msg = scrub("msg", record.msg, seen=seen)
        self._learn(seen)
        if not isinstance(record.msg, Mapping):
            try:
                message = format_message(record)
            except Exception:  # noqa: BLE001 (arguments that do not fit: logging reports the record's own error, with them)
                record.args = _masked_args(record.args)
                return True
            record.msg, record.args = self.free_text(message), None
        if record.exc_info:
            record.exc_text = logging.Formatter().formatException(record.exc_info)
            record.exc_info = None
        if record.exc_text:
            record.exc_text = self.free_text(record.exc_text)
        if record.stack_info:
            record.stack_info = self.free_text(record.stack_info)
        return True

    def _mask_added(self, record: logging.LogRecord, masked: dict[str, object], fields: list[str]) -> bool:
        """A record masked before: the fields added or changed since, as `scrub` has them (its message and
        the others are as they were masked)."""
        seen: dict[str, str] = {}
        for key in fields:
            value = getattr(record, key)
            if key not in masked or not _same(masked[key], value):
                masked[key] = scrub(key, value, seen=seen)
                setattr(record, key, masked[key])
        self._learn(seen)
        return True


def _same(a: object, b: object) -> bool:
    try:
        return a is b or bool(a == b)
    except Exception:  # noqa: BLE001 (a value that cannot be compared is taken for a new one)
        return False


CALLER_DATA_MASK = CallerDataMask()


def mask_log_handlers() -> None:
    """Put the mask on every handler of the root logger that lacks it (livekit-agents' CLI adds its own there
    before the worker starts, and a job may add one): every record any of them writes is masked, whichever
    logger made it. Filters added after it (a job's context fields: Chorus sets none) are not masked. Safe to
    call again."""
    for handler in logging.getLogger().handlers:
        if CALLER_DATA_MASK not in handler.filters:
            handler.addFilter(CALLER_DATA_MASK)
