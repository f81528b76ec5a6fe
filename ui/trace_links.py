"""A live session's link to its call's trace on the monitoring page: the operator's trace store's URL for one
trace (`CHORUS_TRACE_URL_TEMPLATE`, e.g. Jaeger's `http://jaeger:16686/trace/{trace_id}`), with the trace id
the worker's snapshot carries (engine/api.py `SessionSnapshot.trace_id`) in place of `{trace_id}`.

Knows URLs; nothing of Streamlit or the engine.
"""

from __future__ import annotations

import re
from urllib.parse import urlsplit

PLACEHOLDER = "{trace_id}"
TEMPLATE = "an http:// or https:// URL with {trace_id} in it (e.g. http://127.0.0.1:16686/trace/{trace_id})"
_TRACE_ID = re.compile(r"[0-9a-f]{32}")


def check_template(template: str) -> str:
    """`template` when it is empty (no links) or an http(s) URL with the placeholder; ValueError otherwise."""
    template = template.strip()
    if not template:
        return ""
    parts = urlsplit(template.replace(PLACEHOLDER, "0" * 32))
    if parts.scheme not in ("http", "https") or not parts.hostname or PLACEHOLDER not in template:
        raise ValueError(TEMPLATE)
    if any(c.isspace() for c in template):
        raise ValueError(TEMPLATE)
    return template


def trace_link(template: str, trace_id: str) -> str:
    """The trace's URL, or "" when there is no template or the session has no trace (an id that is not 32
    lowercase hex digits, whatever a worker sent, is none)."""
    if not template or not _TRACE_ID.fullmatch(trace_id):
        return ""
    return template.replace(PLACEHOLDER, trace_id)
