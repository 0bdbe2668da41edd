"""vLLM's sampling surface, field by field: every SamplingParams field and every extra field of
its CompletionRequest and ChatCompletionRequest bodies is octavo's own, or refused naming
itself (a ValueError from SamplingParams, a 400 from the server), never accepted and dropped.

The lists are data, written from vLLM's vllm/sampling_params.py and its completion and chat
protocol models. Each field comes with a value that is not its "off" value, so that a refusal
is exercised, not just declared."""

from __future__ import annotations

import dataclasses
import json

import pytest

from octavo import SamplingParams
from octavo.entrypoints.server.errors import OpenAIError
from octavo.entrypoints.server.protocol import (
    REFUSED_OFF_VALUES,
    ChatCompletionRequest,
    CompletionRequest,
)
from octavo.entrypoints.server.request_body import parse_body

# vLLM's SamplingParams fields a user sets (its internal, engine-set ones left out), each with a
# value other than its default.
VLLM_SAMPLING_FIELDS: dict[str, object] = {
    "n": 2,
    "presence_penalty": 0.5,
    "frequency_penalty": 0.5,
    "repetition_penalty": 1.2,
    "temperature": 0.5,
    "top_p": 0.9,
    "top_k": 5,
    "min_p": 0.1,
    "seed": 1,
    "stop": ["x"],
    "stop_token_ids": [2],
    "ignore_eos": True,
    "max_tokens": 8,
    "min_tokens": 2,
    "logprobs": 2,
    "prompt_logprobs": 2,
    "prompt_logprob_token_ids": [1],
    "prompt_logprob_start": 1,
    "logprob_token_ids": [1],
    "flat_logprobs": True,
    "detokenize": False,
    "skip_special_tokens": False,
    "spaces_between_special_tokens": False,
    "include_stop_str_in_output": True,
    "output_kind": 1,
    "stream_interval": 4,
    "skip_clone": True,
    "structured_outputs": None,  # a StructuredOutputsParams: covered by its own tests
    "logit_bias": {1: 1.0},
    "allowed_token_ids": [1, 2],
    "extra_args": {"k": 1},
    "bad_words": ["x"],
    "skip_reading_prefix_cache": True,
    "thinking_token_budget": 16,
    "repetition_detection": {"max_pattern_size": 4, "min_count": 3},
    "routed_experts_prompt_start": 2,
    "trace_decode_token_ids": [1],
    # vLLM's earlier SamplingParams field, now a tokenization setting of its requests.
    "truncate_prompt_tokens": 4,
}

# The extra (non-OpenAI) fields of vLLM's completion and chat bodies, with a value each.
VLLM_SHARED_BODY_EXTRAS: dict[str, object] = {
    "use_beam_search": True,
    "top_k": 5,
    "min_p": 0.1,
    "repetition_penalty": 1.2,
    "watermarking": True,
    "length_penalty": 0.5,
    "stop_token_ids": [2],
    "include_stop_str_in_output": True,
    "ignore_eos": True,
    "min_tokens": 1,
    "skip_special_tokens": False,
    "spaces_between_special_tokens": False,
    "truncate_prompt_tokens": 4,
    "truncation_side": "right",
    "allowed_token_ids": [1, 2],
    "logprob_token_ids": [1],
    "prompt_logprobs": 2,
    "bad_words": ["x"],
    "add_special_tokens": True,
    "structured_outputs": {"regex": "a+"},
    "priority": 0,
    "request_id": "mine",
    "session_id": "s",
    "return_tokens_as_token_ids": True,
    "return_token_ids": True,
    "routed_experts_prompt_start": 2,
    "return_token_offsets": True,
    "return_mm_kwargs": False,
    "cache_salt": "salt",
    "kv_transfer_params": {"k": 1},
    "ec_transfer_params": {"k": 1},
    "vllm_xargs": {"k": 1},
    "repetition_detection": {"max_pattern_size": 4, "min_count": 3},
    "thinking_token_budget": 16,
    "stream_interval": 4,
}
VLLM_COMPLETION_EXTRAS: dict[str, object] = {
    **VLLM_SHARED_BODY_EXTRAS,
    "prompt_embeds": "AAAA",
    "echo": True,
    "response_format": {"type": "json_object"},
}
VLLM_CHAT_EXTRAS: dict[str, object] = {
    **VLLM_SHARED_BODY_EXTRAS,
    "add_special_tokens": False,
    "add_generation_prompt": False,
    "continue_final_message": True,
    "documents": [{"title": "t", "text": "x"}],
    "chat_template": "{{ messages }}",
    "chat_template_kwargs": {"k": 1},
    "media_io_kwargs": {"image": {}},
    "mm_processor_kwargs": {"k": 1},
    "return_prompt_text": True,
    "include_reasoning": False,
}

OCTAVO_FIELDS = {f.name for f in dataclasses.fields(SamplingParams)}


@pytest.mark.parametrize("name", sorted(VLLM_SAMPLING_FIELDS))
def test_each_vllm_sampling_field_is_octavos_or_a_value_error_naming_it(name):
    assert name in OCTAVO_FIELDS, f"SamplingParams({name}=...) would be a TypeError"
    value = VLLM_SAMPLING_FIELDS[name]
    if value is None:
        return
    try:
        SamplingParams(**{name: value})
    except ValueError as exc:
        assert name in str(exc)


@pytest.mark.parametrize(
    "model, body, name",
    [(CompletionRequest, {"prompt": "hi"}, name) for name in sorted(VLLM_COMPLETION_EXTRAS)]
    + [
        (ChatCompletionRequest, {"messages": [{"role": "user", "content": "hi"}]}, name)
        for name in sorted(VLLM_CHAT_EXTRAS)
    ],
)
def test_each_vllm_body_extra_is_parsed_or_a_400_naming_it(model, body, name):
    """A supported field is a field of octavo's body model (the server reads it); a refused
    one is a 400 with the field as `param` for any value but its off one."""
    extras = VLLM_CHAT_EXTRAS if model is ChatCompletionRequest else VLLM_COMPLETION_EXTRAS
    value = extras[name]
    raw = json.dumps({**body, name: value}).encode()
    assert name in model.model_fields, f"{name} would be dropped unread"
    if name in REFUSED_OFF_VALUES:
        with pytest.raises(OpenAIError) as caught:
            parse_body(raw, model)
        assert (caught.value.status_code, caught.value.param) == (400, name)
        assert "not supported" in caught.value.message
        for off in (None, *REFUSED_OFF_VALUES[name]):
            parse_body(json.dumps({**body, name: off}).encode(), model)
    else:
        assert getattr(parse_body(raw, model), name) is not None
