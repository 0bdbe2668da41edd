"""`octavo config diff OLD NEW`: the settings that differ between two resolved configurations.

Each side is the JSON document octavo logs at start-up ("resolved configuration: {...}") and
serves at GET /v1/config, read from a URL (the server's address, or its /v1/config), from a
file holding the document, or from a log file holding that start-up line. Nested settings
are named by their path (`scheduler.max_num_seqs`, `sampling_defaults.max_tokens`); each
changed, added or removed one is printed with its old and new value. Exit status: 0 when
the two agree, 1 when they differ (the upgrade gate's test), 2 when a side cannot be read.

Must not: change anything; it only reads.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

import httpx

# The start-up line that carries the document (octavo/engine/llm_engine.py logs it).
LOG_MARKER = "resolved configuration: "
# Printed for a setting one side does not have.
ABSENT = "(absent)"


def add_config_diff_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("old", metavar="OLD", help="URL, JSON file or log file")
    parser.add_argument("new", metavar="NEW", help="URL, JSON file or log file")
    parser.add_argument(
        "--ignore",
        action="append",
        default=[],
        metavar="SETTING",
        help="leave this setting (and what is under it) out, e.g. model or backend_choices; "
        "repeat for each",
    )
    parser.add_argument(
        "--api-key",
        default=os.environ.get("OPENAI_API_KEY"),
        help="the servers' API key (default: $OPENAI_API_KEY)",
    )


def load_config(source: str, api_key: str | None = None) -> dict[str, Any]:
    """The resolved-config document of `source` (a URL, a JSON file or a log file).
    ValueError naming the source when it holds none."""
    if source.startswith(("http://", "https://")):
        url = source.rstrip("/")
        if not url.endswith("/v1/config"):
            url += "/v1/config"
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        try:
            response = httpx.get(url, headers=headers, timeout=30)
            response.raise_for_status()
        except httpx.HTTPError as exc:
            raise ValueError(f"{source}: cannot read {url}: {exc}") from None
        return _object(response.text, source)
    try:
        with open(source, encoding="utf-8") as f:
            text = f.read()
    except OSError as exc:
        raise ValueError(f"{source}: {exc.strerror}") from None
    if text.lstrip().startswith("{"):
        return _object(text, source)
    # A log: the last start-up line of the document (a log may hold several starts).
    lines = [line for line in text.splitlines() if LOG_MARKER in line]
    if not lines:
        raise ValueError(
            f"{source}: neither a JSON document nor a log with a {LOG_MARKER.strip()!r} line"
        )
    return _object(lines[-1].split(LOG_MARKER, 1)[1], source)


def _object(text: str, source: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise ValueError(f"{source}: not valid JSON ({exc})") from None
    if not isinstance(value, dict):
        raise ValueError(f"{source}: the configuration must be a JSON object")
    return value


def flatten(document: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested objects as one level of dotted paths; lists and scalars are values. An empty
    object holds no setting (`{}` and a key added to it differ by that key alone)."""
    flat: dict[str, Any] = {}
    for key, value in document.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(flatten(value, path + "."))
        else:
            flat[path] = value
    return flat


def diff_configs(
    old: dict[str, Any], new: dict[str, Any], ignore: list[str] | tuple[str, ...] = ()
) -> list[tuple[str, Any, Any]]:
    """(setting, old value, new value) of every setting that differs, in path order; a side
    without the setting has ABSENT. Settings under an `ignore` path are left out."""
    old_flat, new_flat = flatten(old), flatten(new)
    changes = []
    for path in sorted(old_flat.keys() | new_flat.keys()):
        if any(path == i or path.startswith(i + ".") for i in ignore):
            continue
        before = old_flat.get(path, ABSENT)
        after = new_flat.get(path, ABSENT)
        if before != after:
            changes.append((path, before, after))
    return changes


def format_changes(changes: list[tuple[str, Any, Any]], width: int = 60) -> str:
    """A table of the changes (each value as JSON, shortened past `width` characters)."""
    if not changes:
        return "no setting differs"

    def show(value: Any) -> str:
        text = value if value is ABSENT else json.dumps(value)
        return text if len(text) <= width else text[: width - 3] + "..."

    rows = [("setting", "old", "new"), *((p, show(a), show(b)) for p, a, b in changes)]
    widths = [max(len(row[i]) for row in rows) for i in range(2)]
    lines = [f"{p:<{widths[0]}}  {a:<{widths[1]}}  {b}" for p, a, b in rows]
    count = len(changes)
    lines.append(f"{count} settings differ" if count != 1 else "1 setting differs")
    return "\n".join(lines)


def run_config_diff(ns: argparse.Namespace) -> int:
    try:
        old = load_config(ns.old, ns.api_key)
        new = load_config(ns.new, ns.api_key)
    except ValueError as exc:
        print(f"octavo config diff: {exc}", file=sys.stderr)
        return 2
    changes = diff_configs(old, new, ns.ignore)
    print(format_changes(changes))
    return 1 if changes else 0
