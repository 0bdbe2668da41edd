"""InputProcessor: prompt or chat messages -> checked token ids and resolved SamplingParams.

Every check that can reject a request happens here, before the scheduler sees it, so a bad
request never takes blocks or disturbs others. Errors are ValueError naming the parameter.
Inputs too large to fit max_model_len whatever they tokenize to are refused by their size
before any tokenizing or rendering starts, so that the work one request can cause is bounded.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from transformers import PreTrainedTokenizerBase

from octavo.config import PoolerConfig
from octavo.core.pooling_params import PoolingParams
from octavo.core.request import ResolvedParams
from octavo.core.sampling_params import SamplingParams
from octavo.engine.inputs import PromptType
from octavo.structured_output import StructuredOutputManager

# The keys of a prompt dict (vLLM's TextPrompt and TokensPrompt).
PROMPT_KEYS = frozenset({"prompt", "prompt_token_ids"})


@dataclass(frozen=True, slots=True)
class PoolingSupport:
    """What a pooling engine's requests are checked against."""

    pooler: PoolerConfig
    # The name messages give the model (vLLM's served_model_name).
    model_name: str


@dataclass(frozen=True, slots=True)
class ProcessedPrompt:
    prompt: str | None
    prompt_token_ids: list[int]


class InputProcessor:
    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        max_model_len: int,
        vocab_size: int,
        eos_token_ids: Sequence[int],
        structured_output: StructuredOutputManager | None = None,
        max_logprobs: int = -1,
        scheduling_policy: str = "fcfs",
        pooling: PoolingSupport | None = None,
    ) -> None:
        """Without `structured_output`, requests with a constraint are refused. max_logprobs:
        the most logprobs a request may ask for per position (-1: the vocabulary).
        scheduling_policy: the scheduler's (config.SCHEDULING_POLICIES); only `priority`
        takes requests with a priority other than 0. `pooling`: set for a pooling engine,
        whose requests are pooling requests (a prompt may then fill max_model_len: nothing is
        generated after it)."""
        self.tokenizer = tokenizer
        self.scheduling_policy = scheduling_policy
        self.max_logprobs = vocab_size if max_logprobs < 0 else max_logprobs
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(eos_token_ids)
        self.structured_output = structured_output
        self.pooling = pooling
        # A generation prompt leaves room for at least one token.
        self.max_prompt_tokens = max_model_len if pooling is not None else max_model_len - 1
        # No token stands for more characters than its vocabulary string has (byte-level
        # and SentencePiece vocabularies alike, special tokens included), so a text longer
        # than this is more than max_model_len tokens, whatever it tokenizes to.
        longest = max((len(token) for token in tokenizer.get_vocab()), default=1)
        self.max_prompt_chars = max_model_len * max(longest, 1)

    def process_prompt(
        self, prompt: PromptType, add_special_tokens: bool = True, keep_last: int | None = None
    ) -> ProcessedPrompt:
        """Tokenize and check one prompt. keep_last: keep only its last tokens, before the
        length check (prompt_limit's value for the request's params)."""
        if isinstance(prompt, Mapping):
            unknown = sorted(set(prompt) - PROMPT_KEYS)
            if unknown:
                # vLLM's other prompt keys (multi_modal_data, prompt_embeds, cache_salt, ...)
                # are refused, never dropped.
                raise ValueError(
                    f"prompt key {unknown[0]!r} is not supported: a prompt dict holds "
                    "'prompt' or 'prompt_token_ids'."
                )
            if "prompt_token_ids" in prompt:
                return self._check_token_ids(None, list(prompt["prompt_token_ids"]), keep_last)
            if "prompt" in prompt:
                return self.process_prompt(prompt["prompt"], add_special_tokens, keep_last)
            raise ValueError("prompt must hold 'prompt' or 'prompt_token_ids'.")
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt must not be empty.")
            self._check_size(len(prompt), "prompt")
            token_ids = self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
            return self._check_token_ids(prompt, token_ids, keep_last)
        if isinstance(prompt, Sequence) and all(isinstance(t, int) for t in prompt):
            return self._check_token_ids(None, list(prompt), keep_last)
        raise ValueError(
            f"prompt must be a string or a list of token ids, got {type(prompt).__name__}."
        )

    def render_chat(
        self,
        messages: list[Mapping[str, Any]],
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        *,
        tools: list[Mapping[str, Any]] | None = None,
        add_special_tokens: bool = False,
        keep_last: int | None = None,
    ) -> ProcessedPrompt:
        """Render with `chat_template` (default: the tokenizer's, which a `--chat-template`
        override replaced at load) and tokenize. `tools` are passed to the template, which
        renders them if it supports tools; `add_special_tokens` adds the tokenizer's special
        tokens (BOS) on top of what the template writes; `keep_last` is process_prompt's.
        ValueError names the parameter."""
        if not isinstance(messages, list) or not messages:
            raise ValueError("messages must be a non-empty list.")
        for message in messages:
            if not isinstance(message, Mapping) or "role" not in message:
                raise ValueError(f"each message needs a 'role', got {message!r}.")
        # Every message renders to at least its role's token, and no token to more characters
        # than max_prompt_chars allows for: checked before the template runs.
        if len(messages) > self.max_model_len:
            raise ValueError(
                f"messages has {len(messages)} entries, more than max_model_len="
                f"{self.max_model_len} tokens can hold."
            )
        self._check_size(sum(len(str(m.get("content") or "")) for m in messages), "messages")
        if continue_final_message and add_generation_prompt:
            raise ValueError(
                "continue_final_message and add_generation_prompt cannot both be true."
            )
        if chat_template is None and self.tokenizer.chat_template is None:
            raise ValueError("This model has no chat template; pass chat_template.")
        # Keys the renderer sets itself: letting kwargs override them would change what is
        # returned (tokenize) or contradict the explicit parameters.
        fixed = {
            "conversation",
            "messages",
            "tools",
            "documents",
            "chat_template",
            "add_generation_prompt",
            "continue_final_message",
            "tokenize",
            "return_dict",
            "return_tensors",
            "return_assistant_tokens_mask",
            "padding",
            "truncation",
            "max_length",
            "tokenizer_kwargs",
        }
        clash = sorted(fixed.intersection(chat_template_kwargs or {}))
        if clash:
            raise ValueError(
                f"chat_template_kwargs must not set {', '.join(clash)}; use the parameter itself."
            )
        try:
            text = self.tokenizer.apply_chat_template(
                messages,
                tools=tools,
                chat_template=chat_template,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                tokenize=False,
                **dict(chat_template_kwargs or {}),
            )
        except Exception as exc:  # jinja errors: the template rejected these messages
            raise ValueError(f"messages could not be rendered by the chat template: {exc}") from exc
        # The template writes its own special tokens (BOS included); more only if asked.
        token_ids = self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
        return self._check_token_ids(text, token_ids, keep_last)

    def _check_size(self, num_chars: int, param: str) -> None:
        if num_chars > self.max_prompt_chars:
            raise ValueError(
                f"{param} is {num_chars} characters long, more than max_model_len="
                f"{self.max_model_len} tokens can hold (at most {self.max_prompt_chars})."
            )

    def prompt_limit(self, params: SamplingParams | None) -> int | None:
        """How many prompt tokens `params` keeps (truncate_prompt_tokens; -1: what
        max_model_len leaves after max_tokens, all but one without max_tokens); None: all."""
        if params is None or params.truncate_prompt_tokens is None:
            return None
        if params.truncate_prompt_tokens == -1:
            return max(1, self.max_model_len - (params.max_tokens or 1))
        return params.truncate_prompt_tokens

    def truncate(self, processed: ProcessedPrompt, params: SamplingParams) -> ProcessedPrompt:
        """`processed` with only the last prompt_limit(params) tokens (itself when it fits).
        The text stays the one the user gave."""
        keep = self.prompt_limit(params)
        if keep is None or len(processed.prompt_token_ids) <= keep:
            return processed
        return ProcessedPrompt(processed.prompt, processed.prompt_token_ids[-keep:])

    def tokenize_bad_words(self, bad_words: Sequence[str]) -> list[list[int]]:
        """vLLM's bad_words as token id sequences: each word alone and after a space (a
        word inside a text often tokenizes differently from one at its start); the spaced form
        only when it is a different sequence of the same length. ValueError names bad_words
        for a word that tokenizes to nothing or outside the vocabulary."""
        sequences: list[list[int]] = []
        for word in bad_words:
            bare = self.tokenizer.encode(word.lstrip(), add_special_tokens=False)
            if not bare:
                raise ValueError(f"bad_words entry {word!r} tokenizes to no token.")
            sequences.append(bare)
            spaced = self.tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
            if spaced and spaced[0] != bare[0] and len(spaced) == len(bare):
                sequences.append(spaced)
        bad = [t for seq in sequences for t in seq if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"bad_words token id {bad[0]} is out of range for the vocab.")
        return sequences

    def _check_token_ids(
        self, prompt: str | None, token_ids: list[int], keep_last: int | None = None
    ) -> ProcessedPrompt:
        if not token_ids:
            raise ValueError("prompt must not be empty.")
        if keep_last is not None:
            token_ids = token_ids[-keep_last:]
        bad = [t for t in token_ids if not isinstance(t, int) or not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(
                f"prompt token id {bad[0]!r} is out of range for vocab_size {self.vocab_size}."
            )
        if len(token_ids) > self.max_prompt_tokens:
            room = "" if self.pooling is not None else ": it leaves no room to generate"
            raise ValueError(
                f"The prompt is {len(token_ids)} tokens long, but max_model_len is "
                f"{self.max_model_len}{room}."
            )
        return ProcessedPrompt(prompt, token_ids)

    def check_priority(self, priority: int) -> None:
        """A request's `priority` (vLLM's): an integer, and anything but 0 only under the
        priority scheduling policy (vLLM refuses it alike rather than ignore it). Raises
        ValueError naming priority."""
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise ValueError(f"priority must be an integer, got {priority!r}.")
        if priority != 0 and self.scheduling_policy != "priority":
            raise ValueError(
                f"Got priority {priority} but Priority scheduling is not enabled "
                "(--scheduling-policy priority)."
            )

    def resolve_params(self, params: SamplingParams, num_prompt_tokens: int) -> ResolvedParams:
        """Check `params` against the model and the prompt's length, and resolve what the
        engine decides for it: the effective max_tokens and the stop token ids. Does not change
        `params`. Raises ValueError naming the parameter."""
        room = self.max_model_len - num_prompt_tokens
        if params.max_tokens is not None and params.max_tokens > room:
            raise ValueError(
                f"max_tokens={params.max_tokens} plus the prompt's {num_prompt_tokens} tokens "
                f"exceeds max_model_len={self.max_model_len}; at most {room} can be generated."
            )
        if params.logprobs is not None and params.logprobs > self.max_logprobs:
            raise ValueError(
                f"logprobs={params.logprobs} is more than max_logprobs={self.max_logprobs} "
                "(--max-logprobs) allows."
            )
        if params.prompt_logprobs is not None:
            # -1 is the whole vocabulary (vLLM's rule), bounded like any other count.
            num = self.vocab_size if params.prompt_logprobs == -1 else params.prompt_logprobs
            if num > self.max_logprobs:
                raise ValueError(
                    f"prompt_logprobs={num} is more than max_logprobs={self.max_logprobs} "
                    "(--max-logprobs) allows."
                )
        if params.logit_bias:
            bad = [t for t in params.logit_bias if t >= self.vocab_size]
            if bad:
                raise ValueError(f"logit_bias token id {bad[0]} is out of range for the vocab.")
        if params.allowed_token_ids is not None:
            bad = [t for t in params.allowed_token_ids if t >= self.vocab_size]
            if bad:
                raise ValueError(
                    f"allowed_token_ids entry {bad[0]} is out of range for vocab_size "
                    f"{self.vocab_size}."
                )
        if params.bad_words:
            self.tokenize_bad_words(params.bad_words)
        bad_stop = [t for t in params.stop_token_ids if t >= self.vocab_size]
        if bad_stop:
            raise ValueError(f"stop_token_ids entry {bad_stop[0]} is out of range for the vocab.")
        if params.structured_outputs is not None:
            # Parses and checks the schema, regex or grammar (milliseconds, cached by key) so
            # that a bad one is refused here, never while the request waits for its grammar.
            if self.structured_output is None:
                raise ValueError("structured_outputs is not supported by this engine.")
            self.structured_output.validate(params.structured_outputs)
        stop_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            stop_ids.update(self.eos_token_ids)
        max_tokens = room if params.max_tokens is None else params.max_tokens
        return ResolvedParams(max_tokens=max_tokens, stop_token_ids=frozenset(stop_ids))

    def resolve_pooling_params(self, params: PoolingParams) -> PoolingParams:
        """A pooling request's params checked against the model and completed with the
        pooler's defaults (vLLM's PoolingParams.verify): use_activation, dimensions, and
        whether the request may take prefix-cache hits (LAST pooling only). Raises ValueError
        naming the parameter; a generation engine refuses every pooling request."""
        support = self.pooling
        if support is None:
            raise ValueError(
                "Embedding API is not supported by this model. Try converting the model using "
                "`--convert embed`."
            )
        resolved = params.clone()
        pooler = support.pooler
        if resolved.use_activation is None:
            resolved.use_activation = pooler.use_activation
        if resolved.dimensions is None:
            resolved.dimensions = pooler.dimensions
        dimensions = resolved.dimensions
        if dimensions is not None:
            name = support.model_name
            if not pooler.is_matryoshka:
                raise ValueError(
                    f"Model {name!r} does not support Matryoshka embeddings; dimensions must "
                    f"be unset (received dimensions={dimensions})."
                )
            if not 1 <= dimensions <= pooler.embedding_size:
                raise ValueError(
                    f"Model {name!r} only supports dimensions in range "
                    f"[1, {pooler.embedding_size}], got {dimensions}."
                )
            allowed = pooler.matryoshka_dimensions
            if allowed is not None and dimensions not in allowed:
                raise ValueError(
                    f"Model {name!r} only supports Matryoshka dimensions {list(allowed)}, got "
                    f"{dimensions}."
                )
        resolved.task = "embed"
        resolved.skip_reading_prefix_cache = pooler.pooling_type != "LAST"
        return resolved

    def check_generation(self, api: str) -> None:
        """ValueError for a generation request (`api` names the call) to a pooling engine."""
        if self.pooling is not None:
            raise ValueError(
                f"{api} is only supported for generative models. Try passing `--runner "
                "generate` to use the model as a generative model."
            )
