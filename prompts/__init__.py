"""Prompt files (Markdown) and the one function that loads them: `load_prompt(name, **fields)`.

A prompt file may open with an HTML comment for its readers; the comment is not part of the prompt.
`{{field}}` placeholders are filled from `fields`; a missing or an unknown field is an error.
"""

from __future__ import annotations

import re
from pathlib import Path

PROMPTS_DIR = Path(__file__).resolve().parent
_COMMENT = re.compile(r"<!--.*?-->", re.DOTALL)
_FIELD = re.compile(r"\{\{\s*([a-z_][a-z0-9_]*)\s*\}\}")
_NAME = re.compile(r"^[a-z0-9_]+$")


def load_prompt(name: str, **fields: str) -> str:
    """The text of `prompts/<name>.md` without reader comments, placeholders filled, stripped."""
    if not _NAME.match(name):
        raise ValueError(f"prompt names are lower-case words, got {name!r}")
    path = PROMPTS_DIR / f"{name}.md"
    if not path.is_file():
        raise FileNotFoundError(f"no prompt {name!r} in {PROMPTS_DIR}")
    text = _COMMENT.sub("", path.read_text(encoding="utf-8")).strip()
    wanted = set(_FIELD.findall(text))
    if missing := sorted(wanted - fields.keys()):
        raise KeyError(f"prompt {name!r} needs {missing}")
    if unknown := sorted(fields.keys() - wanted):
        raise KeyError(f"prompt {name!r} has no field {unknown}")
    return _FIELD.sub(lambda m: str(fields[m.group(1)]), text)
