"""Titles that stand before a person's name (Mr, Mme, Herr, Sra., Dhr., Sig.ra, Dr, Prof, г-н, κ., מר,
श्रीमती), in every language nameparser's vocabulary has them for: read once from the files it ships
(`nameparser/vocab/<language>.toml`, one file a language: docs/monitoring.md lists them), each word with a
salutation or an academic reading, and the few salutations it lacks (Fr., Frl., Doña, Dña.). Knows nothing
of sentences, or of where a title stands in one (`redaction.words`).
"""

from __future__ import annotations

import functools
import importlib.util
import tomllib
from dataclasses import dataclass
from pathlib import Path

# Mr, Frau, Sra.; Dr, Prof, Dott.ssa (not nobility, offices or occupations: Count, Mayor, Chef)
_TITLE_READINGS = ("salutation", "academic")
# salutations the vocabulary lacks: German Frau's and Fräulein's abbreviations (its `fr` is Father, a
# religious reading, with Saint and Canon), Spanish Doña and its abbreviations
_ALSO_TITLES = frozenset({"fr", "frl", "doña", "dña", "dª"})


@dataclass(frozen=True)
class Vocabulary:
    """What nameparser's vocabulary tells of the words around a name, lower-cased, as it spells them (no edge
    period: "sra", "sig.ra", "г-н")."""

    # a word after one of these is a name
    titles: frozenset[str]
    # titles that are names too (Pan, Sig, Sri, Bay: nameparser leaves them out of its own salutations for
    # that): the word after one is still a name, and the title itself goes wherever a capitalised word would
    borne: frozenset[str]
    # words that join two names or titles ("Sr. y Sra.", "Herr und Frau", "M. et Mme"): no name themselves
    conjunctions: frozenset[str]


@functools.cache
def vocabulary() -> Vocabulary:
    """The vocabulary, read on first use (about 40 ms) and kept; nameparser's code is not imported."""
    titles: set[str] = set()
    borne: set[str] = set()
    conjunctions: set[str] = set()
    spec = importlib.util.find_spec("nameparser")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError("redaction needs nameparser (pyproject's dependencies) for its titles")
    for file in sorted((Path(spec.submodule_search_locations[0]) / "vocab").glob("*.toml")):
        for word in tomllib.loads(file.read_text(encoding="utf-8")).get("word", []):
            text = word["text"].lower()
            excluded = word.get("excluded", {})
            left_out = set(excluded) & set(_TITLE_READINGS) if isinstance(excluded, dict) else set()
            if set(word) & set(_TITLE_READINGS) or left_out:
                titles.add(text)
            if left_out:
                borne.add(text)
            if "conjunction" in word:
                conjunctions.add(text)
    return Vocabulary(frozenset(titles | _ALSO_TITLES), frozenset(borne), frozenset(conjunctions))
