"""Reading a tool call's JSON object while the model is still writing it.

Owns `scan_object` (which members of a possibly unfinished JSON object are complete, where the
value being written starts, whether the text can no longer become JSON) and `CallStreamer`
(one call's OpenAI deltas: id and name once the name is complete, then argument fragments).

Nothing sent to a client can be taken back, so argument fragments are always a prefix of the
argument value's own text and stop at its end: concatenated, they equal the raw text of the
value in the model's output, which is also what a non-streamed response carries.

Must not: know about markup around the JSON (`<tool_call>`) or about HTTP shapes.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from octavo.entrypoints.server.tool_parsers.base import ToolCallDelta, make_tool_call_id

_DECODER = json.JSONDecoder()
_SPACE = re.compile(r"[ \t\n\r]*")
# What may be left of a value that is merely unfinished when the decoder stops: a literal or
# number in progress, or a \uXXXX escape cut short.
_UNFINISHED_TAIL = re.compile(
    r"t(r(ue?)?)?|f(a(l(se?)?)?)?|n(u(ll?)?)?|[-+.eE0-9]+|\\?u[0-9a-fA-F]{0,3}"
)


def skip_space(text: str, pos: int) -> int:
    return _SPACE.match(text, pos).end()


@dataclass(slots=True)
class ObjectScan:
    """What is known about `text[start:]` read as one JSON object. Spans index into `text`."""

    # Members whose values are complete: key -> (start, end) of the value's text.
    members: dict[str, tuple[int, int]] = field(default_factory=dict)
    # The key whose value is being written and where that value's text starts.
    open_key: str | None = None
    open_start: int | None = None
    # Index just past the closing brace, once the object is complete.
    end: int | None = None
    # The text can never become a JSON object (as opposed to merely unfinished).
    malformed: bool = False


def decode_value(text: str, pos: int) -> tuple[object, int] | None:
    """The JSON value starting at `pos` and its end, or None while it is unfinished. Raises
    ValueError when no continuation can make it valid."""
    try:
        value, end = _DECODER.raw_decode(text, pos)
    except json.JSONDecodeError as exc:
        if exc.pos >= len(text) or exc.msg.startswith("Unterminated string"):
            return None
        if _UNFINISHED_TAIL.fullmatch(text, exc.pos):
            return None
        raise ValueError(exc.msg) from None
    # A number at the very end may still grow ("12" -> "123"): complete once something follows.
    if end >= len(text) and isinstance(value, (int, float)) and not isinstance(value, bool):
        return None
    return value, end


def scan_object(text: str, start: int = 0) -> ObjectScan:
    scan = ObjectScan()
    pos = skip_space(text, start)
    if pos >= len(text):
        return scan
    if text[pos] != "{":
        scan.malformed = True
        return scan
    pos = skip_space(text, pos + 1)
    if text.startswith("}", pos):
        scan.end = pos + 1
        return scan
    try:
        while pos < len(text):
            if text[pos] != '"':
                raise ValueError("expected a key")
            decoded = decode_value(text, pos)
            if decoded is None:
                return scan
            key, pos = decoded
            pos = skip_space(text, pos)
            if pos >= len(text):
                return scan
            if text[pos] != ":":
                raise ValueError("expected ':'")
            pos = skip_space(text, pos + 1)
            scan.open_key = str(key)
            if pos >= len(text):
                return scan
            scan.open_start = pos
            decoded = decode_value(text, pos)
            if decoded is None:
                return scan
            scan.members[str(key)] = (pos, decoded[1])
            scan.open_key = scan.open_start = None
            pos = skip_space(text, decoded[1])
            if pos >= len(text):
                return scan
            if text[pos] == "}":
                scan.end = pos + 1
                return scan
            if text[pos] != ",":
                raise ValueError("expected ',' or '}'")
            pos = skip_space(text, pos + 1)
    except ValueError:
        scan.malformed = True
    return scan


class CallStreamer:
    """Turns the growing text of one call object (`{"name": ..., "<args_key>": {...}}`) into
    deltas for call `index`. Call `update` with the whole object text so far, each time."""

    def __init__(self, index: int, args_key: str = "arguments") -> None:
        self.index = index
        self.args_key = args_key
        self.id: str | None = None
        self.name: str | None = None
        self.num_args_sent = 0

    @property
    def started(self) -> bool:
        """Whether the client has been told about this call (its id and name)."""
        return self.id is not None

    def update(self, text: str, checked: bool = False) -> list[ToolCallDelta]:
        """Deltas for what `text` (the object so far) adds. The header waits for the name and
        an argument object's opening brace, or for `checked` (`close` validated the call)."""
        scan = scan_object(text)
        if scan.malformed:
            return []  # stop here: `close` decides between a call and content
        if self.args_key in scan.members:
            args_start, args_end = scan.members[self.args_key]
        elif scan.open_key == self.args_key and scan.open_start is not None:
            args_start, args_end = scan.open_start, len(text)
        else:
            args_start = args_end = None
        # Only an object can be arguments; anything else waits for `close` to reject it.
        args_ok = args_start is not None and text[args_start] == "{"
        deltas = []
        if not self.started:
            span = scan.members.get("name")
            name = json.loads(text[span[0] : span[1]]) if span else None
            if not isinstance(name, str) or not name or not (args_ok or checked):
                return []
            self.name, self.id = name, make_tool_call_id()
            deltas.append(ToolCallDelta(self.index, self.id, name, ""))
        if args_ok:
            fragment = text[args_start + self.num_args_sent : args_end]
            if fragment:
                self.num_args_sent += len(fragment)
                deltas.append(ToolCallDelta(self.index, arguments=fragment))
        return deltas

    def close(self, text: str) -> tuple[list[ToolCallDelta], bool]:
        """The object's text is final: the remaining deltas, and whether it is a valid call.
        An invalid one that was `started` has been partly sent already; the caller decides
        what to do with one that was not."""
        if parse_call(text, self.args_key) is None:
            return [], False
        deltas = self.update(text, checked=True)
        if self.num_args_sent == 0:
            deltas.append(ToolCallDelta(self.index, arguments="{}"))
            self.num_args_sent = 2
        return deltas, True


def parse_call(text: str, args_key: str = "arguments") -> tuple[str, str] | None:
    """A complete call object -> (name, raw argument text), or None if it is not one. A call
    without arguments gets "{}" (a function that takes none)."""
    try:
        value = json.loads(text)
    except ValueError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not value["name"]:
        return None
    if args_key not in value:
        return value["name"], "{}"
    if not isinstance(value[args_key], dict):
        return None
    span = scan_object(text).members[args_key]
    return value["name"], text[span[0] : span[1]]
