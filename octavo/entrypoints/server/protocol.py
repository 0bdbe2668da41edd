"""Pydantic models of the OpenAI wire format that the server speaks (plus vLLM's extras).

Owns the request bodies (types only: value checks that name a parameter live in SamplingParams
and the handlers) and the response and stream-chunk shapes. Unknown request fields are ignored,
as OpenAI and vLLM do, but vLLM's own fields that octavo does not implement are declared
`Refused`: a value other than the one meaning "off" is a 400 naming the field, never dropped.
Non-finite floats (NaN, Infinity) are rejected at parse time.

Must not: hold behaviour beyond parsing and shaping; handlers convert to engine types.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    model_serializer,
)

# vLLM request fields octavo does not implement, with the values that mean "off" (vLLM's
# default; None and an empty list or object are always off).
REFUSED_OFF_VALUES: dict[str, tuple[Any, ...]] = {
    "watermarking": (False,),
    # vLLM's earlier beam-search field; vLLM 0.32 reads it no more (beams run to max_tokens).
    "early_stopping": (False,),
    "truncation_side": ("left",),
    "logprob_token_ids": (),
    "prompt_embeds": (),
    "request_id": (),
    "session_id": (),
    "return_tokens_as_token_ids": (False,),
    "return_token_ids": (False,),
    "routed_experts_prompt_start": (0,),
    "return_token_offsets": (False,),
    "return_mm_kwargs": (True,),
    "return_prompt_text": (False,),
    "cache_salt": (),
    "kv_transfer_params": (),
    "ec_transfer_params": (),
    "vllm_xargs": (),
    "repetition_detection": (),
    "thinking_token_budget": (-1,),
    "stream_interval": (1,),
    "include_reasoning": (True,),
    "padding": ("do_not_pad",),
    "documents": (),
    "media_io_kwargs": (),
    "mm_processor_kwargs": (),
    # /v1/responses' own (protocol_responses.py).
    "include": (),
    "max_tool_calls": (),
    "prompt": (),
    "prompt_cache_key": (),
    "top_logprobs": (0,),
    "truncation": ("disabled",),
    "enable_response_messages": (False,),
    "previous_input_messages": (),
    "mm_payload": ("tensors",),
}


def is_off(value: Any, off: tuple[Any, ...]) -> bool:
    """Whether `value` is one meaning "not set": None, an empty list or object, or one of
    `off` (a bool only where a bool is)."""
    if value is None or (isinstance(value, (list, dict)) and not value):
        return True
    # True == 1 in Python; a bool is off only where a bool is.
    return any(value == v and isinstance(value, bool) == isinstance(v, bool) for v in off)


def _refuse_unless_off(value: Any, info: ValidationInfo) -> Any:
    name = info.field_name or ""
    if not is_off(value, REFUSED_OFF_VALUES[name]):
        raise ValueError(f"{name}={value!r} is not supported by octavo")
    return value


# A vLLM field octavo refuses (see REFUSED_OFF_VALUES).
Refused = Annotated[Any, AfterValidator(_refuse_unless_off)]


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


class StreamOptions(_Request):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _SamplingFields(_Request):
    """Fields shared by completions and chat, with OpenAI's and vLLM's names and defaults."""

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    # vLLM's extras.
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    structured_outputs: StructuredOutputsRequest | None = None
    # Lower runs earlier; anything but 0 needs `--scheduling-policy priority` (checked by the
    # handler, 400 naming it).
    priority: int = 0
    # For each prompt token after the first, its logprob and the top N (-1: the vocabulary);
    # not with stream (checked by the handler). The response's `prompt_logprobs`.
    prompt_logprobs: int | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    truncate_prompt_tokens: int | None = None
    # vLLM's beam search: `n` is the width (serving_beam_search.py).
    use_beam_search: bool = False
    length_penalty: float = 1.0
    # vLLM's fields refused unless off (REFUSED_OFF_VALUES).
    early_stopping: Refused = None
    watermarking: Refused = None
    truncation_side: Refused = None
    logprob_token_ids: Refused = None
    request_id: Refused = None
    session_id: Refused = None
    return_tokens_as_token_ids: Refused = None
    return_token_ids: Refused = None
    routed_experts_prompt_start: Refused = None
    return_token_offsets: Refused = None
    return_mm_kwargs: Refused = None
    cache_salt: Refused = None
    kv_transfer_params: Refused = None
    ec_transfer_params: Refused = None
    vllm_xargs: Refused = None
    repetition_detection: Refused = None
    thinking_token_budget: Refused = None
    stream_interval: Refused = None


class StructuredOutputsRequest(_Request):
    """vLLM's `structured_outputs` extra: set exactly one (checked by the handler)."""

    model_config = ConfigDict(populate_by_name=True)

    # Aliased: `json` and `schema` would shadow pydantic's own methods.
    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class JsonSchemaResponseFormat(_Request):
    model_config = ConfigDict(populate_by_name=True)

    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    # Accepted for OpenAI compatibility; the schema is always enforced.
    strict: bool | None = None


class ResponseFormat(_Request):
    """OpenAI's `response_format` (chat)."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaResponseFormat | None = None


class CompletionRequest(_SamplingFields):
    # Text, texts, token ids, or lists of token ids (checked by the handler, which names it).
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None
    add_special_tokens: bool = True
    # vLLM's: as chat's (json_object, json_schema or text).
    response_format: ResponseFormat | None = None
    prompt_embeds: Refused = None


class FunctionDefinition(_Request):
    name: str
    description: str | None = None
    # A JSON schema for the arguments object; checked by the handler (400 naming `tools`).
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatCompletionToolsParam(_Request):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(_Request):
    name: str


class ChatCompletionNamedToolChoiceParam(_Request):
    type: Literal["function"] = "function"
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | ChatCompletionNamedToolChoiceParam


class ChatCompletionRequest(_SamplingFields):
    # Checked message by message by the chat handler, so errors can say which one is wrong.
    messages: list[Any]
    tools: list[ChatCompletionToolsParam] | None = None
    # None: "auto" when tools are given, else "none" (OpenAI's and vLLM's default).
    tool_choice: ToolChoice | None = None
    # Special tokens added on top of what the chat template writes (vLLM's; BOS, usually).
    add_special_tokens: bool = False
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    # vLLM's extra: a Jinja template for this request only (--trust-request-chat-template).
    chat_template: str | None = None
    response_format: ResponseFormat | None = None
    # OpenAI's: False keeps a choice's first tool call only.
    parallel_tool_calls: bool | None = True
    # OpenAI's: given to the chat template as `reasoning_effort` (and `enable_thinking`
    # unless chat_template_kwargs sets it), as /v1/responses passes `reasoning.effort`.
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    return_prompt_text: Refused = None
    include_reasoning: Refused = None
    documents: Refused = None
    media_io_kwargs: Refused = None
    mm_processor_kwargs: Refused = None


class TokenizeRequest(_Request):
    model: str | None = None
    prompt: str | None = None
    messages: list[Any] | None = None
    # None: True for a prompt, False for messages (the template writes its own), as vLLM.
    add_special_tokens: bool | None = None
    # Chat only, rendered exactly as /v1/chat/completions renders them.
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    chat_template: str | None = None
    tools: list[ChatCompletionToolsParam] | None = None


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[int]


# --- responses ------------------------------------------------------------------------------


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)


class CompletionLogprobs(BaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class PromptLogprob(BaseModel):
    """One token of a prompt position, as vLLM's `prompt_logprobs` entries carry it."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One entry per prompt token: null for the first, then token id -> its logprob, the prompt
# token's own entry first.
PromptLogprobs = list[dict[int, PromptLogprob] | None]


def _drop_if_none(data: dict[str, Any], name: str) -> dict[str, Any]:
    if data.get(name) is None:
        data.pop(name, None)
    return data


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # Only when the request asked for prompt logprobs (prompt_logprobs, or echo with logprobs).
    prompt_logprobs: PromptLogprobs | None = None

    @model_serializer(mode="wrap")
    def _drop_unset_prompt_logprobs(self, handler: Any) -> dict[str, Any]:
        return _drop_if_none(handler(self), "prompt_logprobs")


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatChoiceLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class FunctionCall(BaseModel):
    name: str
    # JSON text of the arguments object, as OpenAI sends it.
    arguments: str


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    role: str
    # The model's thinking (--reasoning-parser), under vLLM's name (`reasoning`; vLLM no
    # longer sends the older `reasoning_content`).
    reasoning: str | None = None
    content: str | None = None
    tool_calls: list[ToolCall] | None = None

    @model_serializer(mode="wrap")
    def _drop_unset_tool_calls(self, handler: Any) -> dict[str, Any]:
        data = handler(self)
        for key in ("reasoning", "tool_calls"):
            if data.get(key) is None:
                data.pop(key, None)
        return data


class ChatCompletionChoice(BaseModel):
    index: int
    message: ChatMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionChoice]
    usage: UsageInfo
    # Only when the request asked for prompt_logprobs.
    prompt_logprobs: PromptLogprobs | None = None

    @model_serializer(mode="wrap")
    def _drop_unset_prompt_logprobs(self, handler: Any) -> dict[str, Any]:
        return _drop_if_none(handler(self), "prompt_logprobs")


class DeltaFunctionCall(BaseModel):
    name: str | None = None
    arguments: str | None = None

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler: Any) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class DeltaToolCall(BaseModel):
    """A piece of call `index`: the first names id, type and function name; the rest carry
    only argument fragments (OpenAI's stream shape)."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall | None = None

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler: Any) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class DeltaMessage(BaseModel):
    role: str | None = None
    reasoning: str | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None

    @model_serializer(mode="wrap")
    def _drop_unset_role(self, handler: Any) -> dict[str, Any]:
        # Only the first chunk of a choice names the role; later deltas leave the key out, and
        # a delta that carries no thinking, text or call pieces leaves those keys out.
        data = handler(self)
        for key in ("role", "reasoning", "content", "tool_calls"):
            if data.get(key) is None:
                data.pop(key, None)
        return data


class ChatStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None


class CompletionChunk(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "octavo"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


# --- /v1/embeddings -------------------------------------------------------------------------


class EmbeddingRequest(_Request):
    """OpenAI's embeddings request with vLLM 0.32's extras. `input` and `encoding_format` are
    checked by the handler, which names them."""

    model: str | None = None
    # A text, texts, token ids, or lists of token ids.
    input: Any = None
    encoding_format: Any = "float"
    dimensions: int | None = None
    user: str | None = None
    # vLLM's extras.
    truncate_prompt_tokens: Annotated[int, Field(ge=-1)] | None = None
    add_special_tokens: bool = True
    use_activation: bool | None = None
    priority: int = 0
    embed_dtype: Literal["float32"] = "float32"
    endianness: Literal["native", "little", "big"] = "native"
    # vLLM's, refused unless off: keeping the first tokens instead of the last, padding,
    # the request's own id, prefix-cache salt, multimodal options.
    truncation_side: Refused = None
    padding: Refused = None
    request_id: Refused = None
    cache_salt: Refused = None
    mm_processor_kwargs: Refused = None


class EmbeddingResponseData(BaseModel):
    index: int
    object: str = "embedding"
    # The floats, or their little-endian float32 bytes in base64.
    embedding: list[float] | str


class EmbeddingUsage(BaseModel):
    prompt_tokens: int = 0
    total_tokens: int = 0


class EmbeddingResponse(BaseModel):
    id: str
    object: str = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[EmbeddingResponseData]
    usage: EmbeddingUsage
