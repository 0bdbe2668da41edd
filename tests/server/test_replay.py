"""`octavo replay record|check` against mock-engine servers: recorded from one server, checked
against servers that differ in one setting each (a default max_tokens from the generation
config, a chat template), it reports exactly the requests and the checks those settings
change, and nothing against an identical server."""

from __future__ import annotations

import json
import re

import pytest

from octavo.entrypoints.cli import main

from ..mock_engine import mock_llm
from .mock_server import mock_server

OTHER_TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
REQUESTS = [
    {"prompt": "the cat", "max_tokens": 4},
    {"prompt": "one two three", "max_tokens": 6, "model": "mock"},
    {"messages": [{"role": "user", "content": "the cat sat"}], "max_tokens": 4},
    # A batch line, as `octavo run-batch` takes them.
    {
        "custom_id": "x",
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {
            "messages": [
                {"role": "system", "content": "one two"},
                {"role": "user", "content": "the dog"},
            ],
            "max_tokens": 5,
        },
    },
    # No max_tokens: the server's generation config decides, else the room the prompt leaves
    # (a completion's max_tokens is 16 when unset, whatever the generation config says).
    {"messages": [{"role": "user", "content": "the dog"}]},
]


def _llm_with_template(template: str):
    """A mock engine whose chat template is `template`, as --chat-template makes it: in the
    tokenizer that renders chats, and in the resolved configuration."""
    llm = mock_llm(max_model_len=128)
    llm.llm_engine.tokenizer.chat_template = template
    return llm


def _differences(text: str) -> set[tuple[int, str]]:
    return {
        (int(m.group(1)), m.group(2))
        for m in re.finditer(r"^request (\d+): (\w+) ", text, flags=re.MULTILINE)
    }


@pytest.fixture
def requests_file(tmp_path):
    path = tmp_path / "requests.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in REQUESTS))
    return path


def test_check_reports_exactly_what_each_changed_setting_changes(
    tmp_path, requests_file, capsys
) -> None:
    golden = tmp_path / "golden.jsonl"
    with (
        mock_server(llm=mock_llm(max_model_len=128)) as old,
        mock_server(llm=mock_llm(max_model_len=128)) as same,
        mock_server(
            llm=_llm_with_template(OTHER_TEMPLATE), chat_template=OTHER_TEMPLATE
        ) as template,
        mock_server(llm=mock_llm(max_model_len=128), sampling_defaults={"max_tokens": 5}) as five,
    ):
        record = ["replay", "record", "--requests", str(requests_file), "--url", old.base_url]
        assert main([*record, "-o", str(golden)]) == 0
        capsys.readouterr()
        recorded = [json.loads(line) for line in golden.read_text().splitlines()]
        assert [r["status"] for r in recorded] == [200] * 5
        # Greedy, with the tokens: 4 and 6 tokens for the first two.
        assert [r["body"]["temperature"] for r in recorded] == [0] * 5
        assert [len(r["tokens"][0]) for r in recorded[:2]] == [4, 6]
        assert [r["endpoint"] for r in recorded] == [
            "/v1/completions",
            "/v1/completions",
            "/v1/chat/completions",
            "/v1/chat/completions",
            "/v1/chat/completions",
        ]
        default_length = recorded[4]["completion_tokens"]
        assert default_length != 5

        check = ["replay", "check", str(golden), "--latency-slack", "1", "--against"]
        assert main([*check, same.base_url]) == 0
        out = capsys.readouterr().out
        assert _differences(out) == set() and out.splitlines()[-1] == "PASS"

        assert main([*check, template.base_url]) == 1
        out = capsys.readouterr().out
        assert _differences(out) == {
            (2, "output"),
            (2, "prompt_tokens"),
            (3, "output"),
            (3, "prompt_tokens"),
            # The shorter prompt leaves more room for the request without max_tokens.
            (4, "output"),
            (4, "prompt_tokens"),
            (4, "completion_tokens"),
        }
        table = {line.split()[0]: line.split() for line in out.splitlines()[2:8]}
        assert table["output"][1:] == ["3", "0", "FAIL"]
        assert table["finish_reason"][1:] == ["0", "0", "ok"]
        assert out.splitlines()[-1] == "FAIL"

        assert main([*check, five.base_url]) == 1
        out = capsys.readouterr().out
        assert _differences(out) == {(4, "output"), (4, "completion_tokens")}
        assert f"request 4: completion_tokens {default_length} -> 5" in out
        # Allowed by thresholds: passes.
        allow = ["--max-output-diffs", "1", "--max-token-count-diffs", "1"]
        assert main([*check, five.base_url, *allow]) == 0
        assert capsys.readouterr().out.splitlines()[-1] == "PASS"


def test_record_from_a_request_log_says_why_it_cannot(tmp_path, capsys) -> None:
    log = tmp_path / "requests.log"
    log.write_text(json.dumps({"request_id": "0", "prompt_tokens": 5}) + "\n")
    assert main(["replay", "record", "--from-log", str(log), "-o", str(tmp_path / "g")]) == 2
    assert "never its prompt or output text" in capsys.readouterr().err


def test_a_bad_requests_file_is_named(tmp_path, capsys) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"max_tokens": 3}\n')
    argv = ["replay", "record", "--requests", str(path), "--url", "http://127.0.0.1:9", "-o", "g"]
    assert main(argv) == 2
    assert "bad.jsonl:1: a body needs `messages` or `prompt`" in capsys.readouterr().err


def test_an_output_difference_is_shown_where_it_starts() -> None:
    from octavo.entrypoints.replay import divergence

    golden = [["a", "b", "c", "d"]]
    assert divergence(golden, [["a", "b", "x"]]) == (
        'choice 0 from token 2 (of 4 -> 3): ["c", "d"] -> ["x"]'
    )
    assert divergence(golden, [["a", "b", "c", "d", "e"]]) == (
        'choice 0 from token 4 (of 4 -> 5): [] -> ["e"]'
    )
    assert divergence(["same", "text"], ["same", "tent"]) == (
        'choice 1 from char 2 (of 4 -> 4): "xt" -> "nt"'
    )
