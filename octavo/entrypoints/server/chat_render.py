"""Chat messages -> prompt tokens, rendered one way for /v1/chat/completions and /tokenize, so
that a chat request's `prompt_tokens` equals the `count` /tokenize gives for the same body.

Owns message checking (each error names `messages` and says which message is wrong) and the
conversion of OpenAI messages into what chat templates expect: text parts joined, a missing
assistant `content` as "" (templates concatenate it), and assistant `tool_calls` arguments
parsed from their JSON text into objects (as Hugging Face templates expect, and vLLM does).
A template the request brings (`chat_template`, or that key of `chat_template_kwargs`) is
vLLM's rule: rendered with only where the server trusts them (--trust-request-chat-template),
else a 400 naming `chat_template` (a Jinja template is code the server runs).

Must not: run on the event loop (handlers call it from their preparation threads), or step
the engine.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from octavo.engine.input_processor import InputProcessor, ProcessedPrompt
from octavo.entrypoints.server.errors import bad_request, param_in_message

if TYPE_CHECKING:
    from octavo.entrypoints.server.serving_common import ServingContext

ROLES = ("system", "developer", "user", "assistant", "tool")
# Request fields a rendering error may be about (the first one its message names).
_PARAMS = {
    "messages",
    "tools",
    "chat_template_kwargs",
    "continue_final_message",
    "add_generation_prompt",
}


@dataclass(frozen=True)
class ChatRender:
    """Everything that decides a chat prompt's text; calling it renders and tokenizes."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    add_special_tokens: bool = False
    # The request's own template (trusted); None: the server's.
    chat_template: str | None = None

    def __call__(self, processor: InputProcessor, keep_last: int | None = None) -> ProcessedPrompt:
        """Raises OpenAIError (400 naming the parameter) when the conversation cannot be
        rendered or does not fit max_model_len. keep_last: keep only the prompt's last tokens
        (truncate_prompt_tokens)."""
        try:
            return processor.render_chat(
                self.messages,
                chat_template=self.chat_template,
                add_generation_prompt=self.add_generation_prompt,
                continue_final_message=self.continue_final_message,
                chat_template_kwargs=self.chat_template_kwargs,
                tools=self.tools,
                add_special_tokens=self.add_special_tokens,
                keep_last=keep_last,
            )
        except ValueError as exc:
            message = str(exc)
            param = param_in_message(message, _PARAMS, {}) or "messages"
            raise bad_request(message, param) from None


def chat_render_from(
    request: Any, tools: list[dict[str, Any]] | None, context: ServingContext
) -> ChatRender:
    """The render of a chat completion or /tokenize body (they share these field names); the
    server's --default-chat-template-kwargs go to the template under the request's own
    chat_template_kwargs, which win key by key. 400 naming `chat_template` for a template
    the server does not trust."""
    kwargs = dict(request.chat_template_kwargs or {})
    template = request.chat_template
    if template is None:
        template = kwargs.get("chat_template")
    if template is not None and not context.trust_request_chat_template:
        raise bad_request(
            "The request brings its own chat template, which this server does not run: start "
            "it with --trust-request-chat-template to allow that.",
            "chat_template",
        )
    kwargs.pop("chat_template", None)  # the template itself, not a variable of it
    if context.default_chat_template_kwargs:
        kwargs = {**context.default_chat_template_kwargs, **kwargs}
    kwargs = with_reasoning_effort(kwargs, getattr(request, "reasoning_effort", None))
    return ChatRender(
        check_messages(request.messages),
        tools=tools,
        add_generation_prompt=request.add_generation_prompt,
        continue_final_message=request.continue_final_message,
        chat_template_kwargs=kwargs or None,
        # /tokenize leaves it unset; chat defaults to False (the template writes BOS).
        add_special_tokens=bool(request.add_special_tokens),
        chat_template=template,
    )


def with_reasoning_effort(kwargs: dict[str, Any], effort: str | None) -> dict[str, Any]:
    """A request's reasoning effort as chat templates take it: `reasoning_effort`, and
    `enable_thinking` (off for "none") unless the kwargs set it."""
    if effort is None:
        return kwargs
    kwargs = {**kwargs, "reasoning_effort": effort}
    kwargs.setdefault("enable_thinking", effort != "none")
    return kwargs


def check_messages(messages: list[Any]) -> list[dict[str, Any]]:
    """OpenAI messages -> the template's dicts; 400 naming `messages`."""
    if not messages:
        raise bad_request("messages must be a non-empty list.", "messages")
    checked = []
    for index, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise bad_request(f"messages[{index}] must be an object.", "messages")
        role = message.get("role")
        if role not in ROLES:
            raise bad_request(
                f"messages[{index}].role must be one of {', '.join(ROLES)}; got {role!r}.",
                "messages",
            )
        converted = {**message, "content": _content_text(message.get("content"), index, role)}
        if message.get("tool_calls") is not None:
            if role != "assistant":
                raise bad_request(
                    f"messages[{index}]: only assistant messages have tool_calls.", "messages"
                )
            converted["tool_calls"] = _tool_calls(message["tool_calls"], index)
        checked.append(converted)
    return checked


def _content_text(content: Any, index: int, role: str) -> str:
    if isinstance(content, str):
        return content
    if content is None and role == "assistant":
        return ""  # a turn that only calls tools; templates test it with `if content`
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, Mapping) or part.get("type") != "text":
                kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
                raise bad_request(
                    f"messages[{index}].content: only text parts are supported, got {kind!r}.",
                    "messages",
                )
            if not isinstance(part.get("text"), str):
                raise bad_request(
                    f"messages[{index}].content: a text part needs 'text'.", "messages"
                )
            parts.append(part["text"])
        return "\n".join(parts)
    raise bad_request(
        f"messages[{index}].content must be a string or a list of text parts.", "messages"
    )


def _tool_calls(calls: Any, index: int) -> list[dict[str, Any]]:
    if not isinstance(calls, list):
        raise bad_request(f"messages[{index}].tool_calls must be a list.", "messages")
    converted = []
    for number, call in enumerate(calls):
        where = f"messages[{index}].tool_calls[{number}]"
        function = call.get("function") if isinstance(call, Mapping) else None
        if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
            raise bad_request(f"{where} needs function.name.", "messages")
        arguments = function.get("arguments", "{}")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except ValueError:
                raise bad_request(
                    f"{where}.function.arguments is not valid JSON.", "messages"
                ) from None
        converted.append(
            {
                **call,
                "type": call.get("type", "function"),
                "function": {**function, "arguments": arguments},
            }
        )
    return converted
