"""Chat templates: a chat request's prompt_tokens equals what /tokenize counts for the same
fields; add_generation_prompt, continue_final_message, chat_template_kwargs and tools render as
the template says; tool calls and tool results in the history reach the template; a
`--chat-template` override (file or inline text) replaces the model's template everywhere."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from octavo.config import EngineArgs, load_chat_template
from octavo.engine.tokenizer import load_tokenizer
from octavo.entrypoints.cli import engine_args_from, main, make_parser, server_config_from

pytestmark = pytest.mark.slow

CHAT = "/v1/chat/completions"
SYSTEM = "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
HISTORY = [
    {"role": "user", "content": "Weather in Oslo?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "c1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "c1", "content": "-3 C"},
]


def encode(server, text: str) -> list[int]:
    return server.call(lambda e: e.tokenizer.encode(text, add_special_tokens=False))


def prompt_tokens(http, body: dict[str, Any]) -> int:
    response = http.post(CHAT, json={**body, "max_tokens": 1, "tool_choice": "none"})
    assert response.status_code == 200, response.text
    return response.json()["usage"]["prompt_tokens"]


@pytest.mark.parametrize(
    "fields",
    [
        {"messages": [{"role": "user", "content": "Hi"}]},
        {
            "messages": [
                {"role": "system", "content": "Be brief."},
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                },
            ]
        },
        {"messages": HISTORY, "tools": [TOOL]},
        {"messages": [{"role": "user", "content": "Hi"}], "add_generation_prompt": False},
        {
            "messages": [
                {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hel"},
            ],
            "add_generation_prompt": False,
            "continue_final_message": True,
        },
        {"messages": [{"role": "user", "content": "Hi"}], "chat_template_kwargs": {"x": 1}},
    ],
    ids=["plain", "system-and-parts", "tool-history", "no-generation-prompt", "continue", "kwargs"],
)
def test_prompt_tokens_equal_tokenize_count(http, fields) -> None:
    tokenized = http.post("/tokenize", json=fields)
    assert tokenized.status_code == 200, tokenized.text
    assert prompt_tokens(http, fields) == tokenized.json()["count"]


def test_generation_prompt_and_continue_final_message_render_exactly(http, server) -> None:
    user = {"role": "user", "content": "Hi"}
    expected = {
        "with": f"{SYSTEM}<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n",
        "without": f"{SYSTEM}<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n",
        "continue": f"{SYSTEM}<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\nThe answer is",
    }
    bodies = {
        "with": {"messages": [user]},
        "without": {"messages": [user], "add_generation_prompt": False},
        "continue": {
            "messages": [user, {"role": "assistant", "content": "The answer is"}],
            "add_generation_prompt": False,
            "continue_final_message": True,
        },
    }
    for name, body in bodies.items():
        tokens = http.post("/tokenize", json=body).json()["tokens"]
        assert tokens == encode(server, expected[name]), name


@pytest.mark.parametrize(
    "fields,param,fragment",
    [
        (
            {"continue_final_message": True},
            "continue_final_message",
            "continue_final_message and add_generation_prompt cannot both be true",
        ),
        (
            {"chat_template_kwargs": {"tokenize": True}},
            "chat_template_kwargs",
            "chat_template_kwargs must not set tokenize",
        ),
    ],
)
@pytest.mark.parametrize("path", [CHAT, "/tokenize"])
def test_render_options_that_cannot_work_are_400s(http, path, fields, param, fragment) -> None:
    body = {"messages": [{"role": "user", "content": "Hi"}], **fields}
    response = http.post(path, json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and fragment in error["message"]


# --- --chat-template ------------------------------------------------------------------------

# Renders tool calls (their arguments must arrive as objects), tool results, the tools and a
# chat_template_kwargs variable, so one prompt shows that each reaches the template.
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.tool_calls %}{% for c in m.tool_calls %}call {{ c.function.name }}"
    "({{ c.function.arguments.city }}){% endfor %}{% else %}{{ m.content }}{% endif %}"
    "<|im_end|>\n{% endfor %}"
    # transformers' Jinja drops a newline right after a block tag: write it as an expression.
    "{% if tools %}tools:{% for t in tools %} {{ t.function.name }}{% endfor %}{{ '\\n' }}"
    "{% endif %}"
    "{{ greeting | default('') }}{{ reasoning_effort | default('') }}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
RENDERED = (
    "<|im_start|>user\nWeather in Oslo?<|im_end|>\n<|im_start|>assistant\ncall get_weather(Oslo)"
    "<|im_end|>\n<|im_start|>tool\n-3 C<|im_end|>\ntools: get_weather\nhello"
    "<|im_start|>assistant\n"
)


@pytest.fixture
def overridden(server) -> Iterator[None]:
    """The shared engine's tokenizer with TEMPLATE in place, as `--chat-template` leaves it."""
    previous = server.call(lambda e: e.tokenizer.chat_template)
    server.call(lambda e: setattr(e.tokenizer, "chat_template", TEMPLATE))
    try:
        yield
    finally:
        server.call(lambda e: setattr(e.tokenizer, "chat_template", previous))


def test_override_template_renders_tools_history_and_kwargs(http, server, overridden) -> None:
    body = {"messages": HISTORY, "tools": [TOOL], "chat_template_kwargs": {"greeting": "hello"}}
    tokenized = http.post("/tokenize", json=body).json()
    assert tokenized["tokens"] == encode(server, RENDERED)
    assert prompt_tokens(http, body) == tokenized["count"]


def test_reasoning_effort_reaches_the_template(http, overridden) -> None:
    """OpenAI's reasoning_effort renders as that template variable (and a value it does not
    define is a 400 naming it)."""
    body = {"messages": [{"role": "user", "content": "Hi"}]}
    kwargs = {"chat_template_kwargs": {"reasoning_effort": "high", "enable_thinking": True}}
    with_effort = http.post("/tokenize", json={**body, **kwargs}).json()["count"]
    assert with_effort > http.post("/tokenize", json=body).json()["count"]
    assert prompt_tokens(http, {**body, "reasoning_effort": "high"}) == with_effort
    response = http.post(CHAT, json={**body, "reasoning_effort": "huge"})
    assert response.status_code == 400 and response.json()["error"]["param"] == "reasoning_effort"


def test_load_chat_template_reads_files_or_takes_text(tmp_path) -> None:
    path = tmp_path / "template.jinja"
    path.write_text(TEMPLATE)
    assert load_chat_template(str(path)) == TEMPLATE
    assert load_chat_template("{{ messages[0]['content'] }}") == "{{ messages[0]['content'] }}"
    assert load_chat_template(None) is None
    missing = str(tmp_path / "missing.jinja")
    with pytest.raises(ValueError, match="chat_template .* is neither a readable file"):
        load_chat_template(missing)
    with pytest.raises(ValueError, match="chat_template"):
        EngineArgs(chat_template=missing)


def test_load_tokenizer_puts_the_override_in_place(tmp_path) -> None:
    """On a two-word Hugging Face tokenizer folder whose own template says MODEL."""
    tokenizer = Tokenizer(models.WordLevel({"[UNK]": 0, "Hi": 1}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", "chat_template": "MODEL"})
    )
    assert load_tokenizer(str(tmp_path)).chat_template == "MODEL"
    loaded = load_tokenizer(str(tmp_path), chat_template=TEMPLATE)
    assert loaded.chat_template == TEMPLATE
    text = loaded.apply_chat_template(
        [{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=False
    )
    assert text == "<|im_start|>user\nHi<|im_end|>\n"


def test_cli_flags_reach_engine_args_and_server_config(capsys) -> None:
    ns = make_parser().parse_args(
        [
            "serve",
            "--chat-template",
            "{{ messages }}",
            "--tool-call-parser",
            "hermes",
            "--enable-auto-tool-choice",
        ]
    )
    assert engine_args_from(ns).chat_template == "{{ messages }}"
    config = server_config_from(ns)
    assert (config.tool_call_parser, config.enable_auto_tool_choice) == ("hermes", True)
    # Refused before any model is loaded.
    assert main(["serve", "--enable-auto-tool-choice"]) == 2
    assert "needs tool_call_parser (--tool-call-parser)" in capsys.readouterr().err
    assert main(["serve", "--tool-call-parser", "xml"]) == 2
    names = "deepseek_v3, granite, hermes, llama3_json, llama4_json, mistral, pythonic, "
    assert f"tool_call_parser must be one of {names}qwen3_coder, qwen3_xml; got 'xml'" in (
        capsys.readouterr().err
    )
