"""The pythonic tool-call format (`--tool-call-parser pythonic`): the whole answer is a
Python list of calls with keyword arguments, `[get_weather(city="Paris"), now()]`.

Owns that reading. Calls are parsed with `ast` and argument values must be literals
(strings, numbers, booleans, None, and lists, tuples and dicts of them); nothing is ever
evaluated. Arguments become JSON (`json.dumps`, as vLLM writes them). While streaming, a
call's id and name go out once `name(` is written, its arguments once the call is complete.
An answer that is not such a list (text after it included) is content.

Must not: evaluate model text.
"""

from __future__ import annotations

import ast
import json
import re
from typing import Any

from octavo.entrypoints.server.tool_parsers.base import register_tool_parser
from octavo.entrypoints.server.tool_parsers.json_stream import skip_space
from octavo.entrypoints.server.tool_parsers.section import PartialCall, SectionToolParser

_CALL_START = re.compile(r"\s*([A-Za-z_]\w*)\s*(\()?")
_CLOSING = {")": "(", "]": "[", "}": "{"}


class NotACall(ValueError):
    pass


@register_tool_parser("pythonic")
class PythonicToolParser(SectionToolParser):
    def split(self, text: str) -> tuple[int, bool]:
        first = skip_space(text, 0)
        if first == len(text):
            return 0, False  # only whitespace so far: the list may still open the answer
        return first, text.startswith("[", first)

    def read_calls(self, section: str, final: bool) -> list[PartialCall] | None:
        try:
            items, end = split_list(section)
        except NotACall:
            return None
        if (final and end is None) or (end is not None and section[end:].strip()):
            return None  # unclosed at the end, or text after the list
        calls = []
        for number, (start, stop) in enumerate(items):
            item = section[start:stop]
            if stop == len(section) and end is None:  # the call being written
                match = _CALL_START.match(item)
                if not item.strip():
                    break
                if match is None or (match.end() < len(item) and match.group(2) is None):
                    return None
                if match.group(2) is None:
                    break
                # A call that parses is complete: only "," or "]" may follow it.
                try:
                    calls.append(parse_call(item))
                except NotACall:
                    calls.append(PartialCall(match.group(1), ""))
                break
            if not item.strip() and number == len(items) - 1 and number > 0:
                break  # a trailing comma
            try:
                calls.append(parse_call(item))
            except NotACall:
                return None
        return calls


def split_list(text: str) -> tuple[list[tuple[int, int]], int | None]:
    """The spans of the items of the list that `text` opens, split at its top-level commas
    (the last one may be unfinished), and the index past its closing bracket (None while
    open). Strings and nested brackets are skipped; NotACall for mismatched brackets."""
    pos = skip_space(text, 0)
    if not text.startswith("[", pos):
        raise NotACall("not a list")
    stack = ["["]
    items = []
    item_start = pos + 1
    i = pos + 1
    while i < len(text):
        char = text[i]
        if char in "'\"":
            i = _skip_string(text, i)
            continue
        if char in "([{":
            stack.append(char)
        elif char in ")]}":
            if stack.pop() != _CLOSING[char]:
                raise NotACall("mismatched brackets")
            if not stack:
                items.append((item_start, i))
                return items, i + 1
        elif char == "," and len(stack) == 1:
            items.append((item_start, i))
            item_start = i + 1
        i += 1
    items.append((item_start, len(text)))
    return items, None


def _skip_string(text: str, start: int) -> int:
    """The index past the string literal opening at `start` (len(text) while unclosed)."""
    quote = text[start] * 3 if text.startswith(text[start] * 3, start) else text[start]
    i = start + len(quote)
    while i < len(text):
        if text[i] == "\\":
            i += 2
        elif text.startswith(quote, i):
            return i + len(quote)
        else:
            i += 1
    return len(text)


def parse_call(text: str) -> PartialCall:
    """`name(key=literal, ...)` -> the call with its arguments as JSON; NotACall otherwise."""
    try:
        node = ast.parse(text.strip(), mode="eval").body
    except SyntaxError:
        raise NotACall(text) from None
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
        raise NotACall(text)
    arguments = {}
    for keyword in node.keywords:
        if keyword.arg is None:  # **kwargs
            raise NotACall(text)
        try:
            arguments[keyword.arg] = _jsonable(ast.literal_eval(keyword.value))
        except (ValueError, TypeError, SyntaxError, RecursionError):
            raise NotACall(text) from None
    return PartialCall(node.func.id, json.dumps(arguments, ensure_ascii=False))


def _jsonable(value: Any) -> Any:
    if value is None or isinstance(value, (str, bool, int)):
        return value
    if isinstance(value, float) and value == value and abs(value) != float("inf"):
        return value
    if isinstance(value, (list, tuple)):
        return [_jsonable(item) for item in value]
    if isinstance(value, dict) and all(isinstance(key, str) for key in value):
        return {key: _jsonable(item) for key, item in value.items()}
    raise ValueError(f"not a JSON value: {value!r}")
