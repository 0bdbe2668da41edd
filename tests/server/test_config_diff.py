"""`octavo config diff OLD NEW` over two servers' GET /v1/config (mock engines with different
settings), over a file and over a start-up log: it names exactly the changed settings, and
exits 1 when any differs, 0 when none does."""

from __future__ import annotations

import json

from octavo.entrypoints.cli import main
from octavo.entrypoints.config_diff import ABSENT, diff_configs, load_config

from ..mock_engine import CHAT_TEMPLATE, mock_llm
from .mock_server import mock_server

OTHER_TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}"


def test_it_names_exactly_the_settings_two_servers_differ_in(tmp_path, capsys) -> None:
    with (
        mock_server(llm=mock_llm(max_model_len=128)) as old,
        mock_server(
            llm=mock_llm(max_model_len=128, max_num_queued_reqs=8),
            chat_template=OTHER_TEMPLATE,
            sampling_defaults={"max_tokens": 5},
        ) as new,
        mock_server(llm=mock_llm(max_model_len=128)) as same,
    ):
        assert main(["config", "diff", old.base_url, new.base_url]) == 1
        lines = capsys.readouterr().out.splitlines()
        assert [line.split()[0] for line in lines[1:-1]] == [
            "chat_template",
            "sampling_defaults.max_tokens",
            "scheduler.max_num_queued_reqs",
        ]
        assert lines[-1] == "3 settings differ"
        assert lines[3].split() == ["scheduler.max_num_queued_reqs", "null", "8"]
        assert lines[2].split() == ["sampling_defaults.max_tokens", ABSENT.split()[0], "5"]

        assert main(["config", "diff", old.base_url, same.base_url + "/v1/config"]) == 0
        assert capsys.readouterr().out.strip() == "no setting differs"

        # The same document from a start-up log and from a JSON file.
        document = load_config(new.base_url)
        log = tmp_path / "serve.log"
        log.write_text(
            "INFO 12:00:00 octavo.engine.llm_engine: dtype float32 (a mock model)\n"
            "INFO 12:00:01 octavo.engine.llm_engine: resolved configuration: "
            f"{json.dumps(document)}\n"
        )
        saved = tmp_path / "config.json"
        saved.write_text(json.dumps(document))
        assert load_config(str(log)) == document
        assert main(["config", "diff", str(saved), new.base_url]) == 0
        capsys.readouterr()
        ignored = ["--ignore", "chat_template", "--ignore", "sampling_defaults"]
        assert main(["config", "diff", old.base_url, str(log), *ignored]) == 1
        assert capsys.readouterr().out.splitlines()[-1] == "1 setting differs"


def test_nested_and_missing_settings_and_unreadable_sources(tmp_path, capsys) -> None:
    old = {"a": 1, "cache": {"block_size": 16, "num_blocks": 10}, "chat_template": CHAT_TEMPLATE}
    new = {"a": 1, "cache": {"block_size": 16, "num_blocks": 12}, "extra": [1, 2]}
    assert diff_configs(old, new) == [
        ("cache.num_blocks", 10, 12),
        ("chat_template", CHAT_TEMPLATE, ABSENT),
        ("extra", ABSENT, [1, 2]),
    ]
    bad = tmp_path / "empty.log"
    bad.write_text("nothing here\n")
    assert main(["config", "diff", str(bad), str(bad)]) == 2
    assert "resolved configuration" in capsys.readouterr().err
