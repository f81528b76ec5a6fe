"""Token-level protocol of the model: special tokens by name, prompt ids, the text channel as text, tool-call
text and tool responses.

Knows the tokenizer and the model's text formats (MODEL_SPEC 3); knows nothing of slots, tensors or time.
"""

from __future__ import annotations

import codecs
import json
import re
from dataclasses import dataclass

from tokenizers import Tokenizer

from engine.config.stage_config import TokenConfig

CALL_OPEN, CALL_CLOSE = "<TOOLCALL>", "</TOOLCALL>"
RESPONSE_OPEN, RESPONSE_CLOSE = "<TOOL_RESPONSE>", "</TOOL_RESPONSE>"
MAX_TOOLS = 5


class ToolCallError(ValueError):
    """The function channel's text is not a well-formed tool call."""


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: dict


class Tokens:
    """The tokenizer plus the ids of the special tokens, resolved by their strings."""

    def __init__(self, cfg: TokenConfig) -> None:
        try:
            self.tok = Tokenizer.from_file(cfg.tokenizer)
        except Exception as e:  # tokenizers raises its own exception type
            raise FileNotFoundError(f"tokenizer: cannot load {cfg.tokenizer!r}: {e}") from e
        self.vocab_size = self.tok.get_vocab_size()

        def resolve(field: str) -> int:
            name = getattr(cfg, field)
            i = self.tok.token_to_id(name)
            if i is None:
                raise ValueError(f"tokens.{field}: {name!r} is not in the tokenizer {cfg.tokenizer!r}")
            return i

        self.bos, self.eos, self.pad = resolve("bos"), resolve("eos"), resolve("pad")
        self.call_start, self.call_end = resolve("tool_call_start"), resolve("tool_call_end")
        self.response_end = resolve("tool_response_end")
        self._special = {self.bos, self.eos, self.pad, self.call_start, self.call_end, self.response_end}
        # every added token (special or not): none is matched in text from outside the template (a call's
        # turns, a tool's arguments and results), `encode_text`
        self.added = frozenset(self.tok.get_added_tokens_decoder())
        # the text channel's piece per token id, computed once: "" for control tokens, None for a token that
        # is not whole text on its own (a byte of a character split over several tokens), whose bytes are in
        # `_bytes`; a token whose bytes cannot be read keeps its decoded piece
        self._pieces: list[str | None] = []
        self._bytes: dict[int, bytes] = {}
        for i in range(self.vocab_size):
            piece = "" if i in self._special or self._is_control(i) else self.tok.decode([i])
            raw = _token_bytes(self.tok.id_to_token(i)) if "\ufffd" in piece else None
            if raw is not None:
                self._bytes[i] = raw
            self._pieces.append(None if raw is not None else piece)

    def _is_control(self, i: int) -> bool:
        t = self.tok.id_to_token(i)
        return t is None or (
            t.startswith("<") and t.endswith(">") and len(t) > 2 and t[1:-1].replace("_", "").isalnum()
        )

    def encode(self, text: str) -> list[int]:
        # the batch call gives the same ids and lets go of the GIL while it works (`encode` holds it: a long
        # tool result or prompt would stall the tick thread for its whole length)
        return self.tok.encode_batch([text], add_special_tokens=False)[0].ids

    def encode_text(self, text: str) -> list[int]:
        """`text` as text: no added token of the tokenizer is matched in it (a turn holding `</s>` or a
        tool argument holding `<SPECIAL_20>` gives the ids of those characters, never the control id).

        `encode`'s ids where they hold no added token (the same ids); otherwise `_as_text`, whose Python
        calls let other threads run between words (45-65 ms for the 50,000 characters of the longest
        resumed call's context)."""
        ids = self.encode(text)
        return ids if self.added.isdisjoint(ids) else self._as_text(text)

    def _as_text(self, text: str) -> list[int]:
        """The tokenizer's steps after its split at added tokens (normalizer, pre-tokenizer, model) on the
        whole of `text`, in Python: the ids the `tokenizers` library gives text it matches no added token
        in, with no added token's id among them."""
        tok = self.tok
        plain = tok.normalizer.normalize_str(text) if tok.normalizer is not None else text
        pieces = [p for p, _ in tok.pre_tokenizer.pre_tokenize_str(plain)] if tok.pre_tokenizer else [plain]
        ids = [t.id for piece in pieces for t in tok.model.tokenize(piece)]
        return [i for i in ids if i not in self.added]  # a vocabulary whose merges reach an added token

    def encode_template(self, *parts: tuple[str, bool]) -> list[int]:
        """Text made of the format's markers (`(text, True)`: the added token's id where the tokenizer holds
        the marker as one, else its text) and others' text (`(text, False)`: as `encode_text`). The text
        between markers that are added tokens is encoded in one piece, so the ids are `encode`'s for text
        whose other parts hold no added token."""
        ids: list[int] = []
        run: list[str] = []
        for text, marker in parts:
            i = self.tok.token_to_id(text) if marker else None
            if i is None or i not in self.added:
                run.append(text)
                continue
            if run:
                ids += self.encode_text("".join(run))
                run = []
            ids.append(i)
        if run:
            ids += self.encode_text("".join(run))
        return ids

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=False)

    def text(self, stream: TextStream, token: int) -> str:
        """The text `token` adds to the transcript of the session whose text channel `stream` is: "" for
        control tokens and ids beyond the vocabulary, and while a character split over several tokens is not
        whole yet; the whole character with the token that completes it.

        One list lookup for a token that is whole text with nothing held (the vocabulary's own string, not
        copied); the bytes of split characters go through the session's UTF-8 decoder. Control tokens inside
        a character leave it held (a pad between its bytes), a turn's start or end drops it (a turn that ended
        mid-character shows no half of it), and bytes that no character can continue come out as U+FFFD."""
        piece = self._pieces[token] if 0 <= token < self.vocab_size else ""
        if piece is not None and not stream.held:
            return piece
        if piece is None:
            return stream.decode(self._bytes[token])
        if piece:
            return stream.decode(piece.encode())
        if token == self.bos or token == self.eos:
            stream.drop()
        return ""

    # -- prompts and tools ----------------------------------------------------------------------------

    def prompt_ids(self, system_prompt: str, tools: list[dict]) -> list[int]:
        """`[<s>] + tok(system_prompt + tool block) + [</s>]`, prefilled on the audio channel
        at session start."""
        return self.prompt_parts(system_prompt, tools)[0]

    def prompt_parts(self, system_prompt: str, tools: list[dict], context: str = "") -> tuple[list[int], int]:
        """The prompt's ids and the length of its prefix, `[<s>] + tok(system_prompt + tool block)`: with a
        `context` (a call's own, such as its earlier turns), `prefix + tok("\n\n" + context) + [</s>]`, the
        context after the tool block, so that every call of the same agent shares the prefix's state. The
        context is the call's stored text (what was said, tools' names, arguments and results): encoded as
        text (`encode_text`), so none of it is ever a control token."""
        from engine.text.prompt import system_prompt_text

        if len(tools) > MAX_TOOLS:
            raise ValueError(f"tools: the model accepts at most {MAX_TOOLS} tools, got {len(tools)}")
        prefix = [self.bos, *self.encode(system_prompt_text(system_prompt, tools))]
        own = self.encode_text("\n\n" + context) if context else []
        return [*prefix, *own, self.eos], len(prefix)

    def call_ids(self, calls: list[dict]) -> list[int]:
        """The function-channel tokens of a complete call: start, `<TOOLCALL>[...]</TOOLCALL>`, end; the
        calls' names and arguments encoded as text."""
        body = self.encode_template((CALL_OPEN, True), (json.dumps(calls), False), (CALL_CLOSE, True))
        return [self.call_start, *body, self.call_end]

    def response_ids(self, results: list[dict]) -> list[int]:
        """`<TOOL_RESPONSE>[...]</TOOL_RESPONSE>` tokens (no special tokens added), forced on
        the function channel; the results encoded as text."""
        body = json.dumps(results, ensure_ascii=False)
        return self.encode_template((RESPONSE_OPEN, True), (body, False), (RESPONSE_CLOSE, True))


class TextStream:
    """One session's text channel between its tokens: the bytes of a character whose tokens have not all come
    yet. Made with each session, so a session never continues a character of the one before it.

    At most 3 bytes are held (UTF-8's incremental decoder keeps no more than an unfinished character's), so a
    byte sequence that is no UTF-8 costs one U+FFFD, never a stalled transcript."""

    __slots__ = ("_utf8", "held")

    def __init__(self) -> None:
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")
        self.held = False  # bytes of an unfinished character are waiting

    def decode(self, data: bytes) -> str:
        """The text `data` completes, given what was held; keeps the bytes of a character not yet whole."""
        text = self._utf8.decode(data)
        self.held = bool(self._utf8.getstate()[0])
        return text

    def drop(self) -> None:
        """Forget the bytes of an unfinished character."""
        self._utf8.reset()
        self.held = False


def _byte_level_alphabet() -> dict[str, int]:
    """The byte each character of a byte-level BPE's tokens stands for (GPT-2's table: printable Latin-1
    bytes as themselves, the others as the characters from U+0100 on, in byte order)."""
    shown = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    hidden = [b for b in range(256) if b not in shown]
    return {chr(b): b for b in shown} | {chr(256 + n): b for n, b in enumerate(hidden)}


_BYTE_OF = _byte_level_alphabet()
_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _token_bytes(token: str | None) -> bytes | None:
    """The bytes a token stands for, when its text is written in bytes: a byte-fallback token (`<0xC3>`) or
    a byte-level BPE's token (`Ã`, `ĠÃ`); None otherwise."""
    if token is None:
        return None
    if m := _BYTE_FALLBACK.fullmatch(token):
        return bytes([int(m[1], 16)])
    if token and all(c in _BYTE_OF for c in token):
        return bytes(_BYTE_OF[c] for c in token)
    return None


def parse_tool_call(text: str) -> list[ParsedCall]:
    """Parse `<TOOLCALL>[{"name": ..., "arguments": {...}}, ...]</TOOLCALL>`; raise
    ToolCallError if malformed."""
    body = text.strip()
    if not (body.startswith(CALL_OPEN) and body.endswith(CALL_CLOSE)):
        raise ToolCallError(f"a tool call must be wrapped in {CALL_OPEN}...{CALL_CLOSE}")
    try:
        entries = json.loads(body[len(CALL_OPEN) : -len(CALL_CLOSE)])
    except json.JSONDecodeError as e:
        raise ToolCallError(f"the tool call is not valid JSON ({e.msg} at character {e.pos})") from None
    except (RecursionError, ValueError) as e:  # nesting too deep, a number too long to convert
        raise ToolCallError(f"the tool call cannot be read ({type(e).__name__})") from None
    if not isinstance(entries, list) or not entries:
        raise ToolCallError("a tool call must be a non-empty JSON list of calls")
    calls = []
    for i, entry in enumerate(entries):
        if not isinstance(entry, dict) or not isinstance(entry.get("name"), str) or not entry["name"]:
            raise ToolCallError(f"call {i} has no tool name")
        args = entry.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except (RecursionError, ValueError):  # JSONDecodeError is a ValueError
                raise ToolCallError(f"call {i} ({entry['name']}): arguments are not valid JSON") from None
        if not isinstance(args, dict):
            raise ToolCallError(f"call {i} ({entry['name']}): arguments must be a JSON object")
        calls.append(ParsedCall(entry["name"], args))
    return calls


def forced_ids(tok: Tokens, tokens: list[int] | str, vocab_size: int) -> list[int]:
    """What teacher forcing puts on a channel: `tokens` as ids (text is encoded), each within the vocabulary
    (ValueError naming the first few that are not)."""
    ids = tok.encode(tokens) if isinstance(tokens, str) else [int(t) for t in tokens]
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"tokens: ids outside 0..{vocab_size - 1}: {bad[:5]}")
    return ids
