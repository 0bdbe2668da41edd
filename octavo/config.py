"""Start-up configuration: frozen dataclasses, validated once, logged as one JSON document.

`EngineArgs` is what a user passes (LLM(...) keywords, CLI flags); the engine resolves it into
an `EngineConfig` once the model is known (max_model_len, dtype, KV capacity). Nothing edits a
config after that.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass


@dataclass(frozen=True)
class CacheConfig:
    block_size: int
    num_blocks: int
    enable_prefix_caching: bool = True
    # Bytes one token of KV takes across all layers (K and V); 0 when no model is attached.
    bytes_per_token: int = 0
    # The cache tensors' dtype ("" when no model is attached).
    dtype: str = ""

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}.")
        if self.num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {self.num_blocks}.")

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size


ADMISSION_POLICIES = ("current", "reserve", "ratio")
# --dtype and --kv-cache-dtype; "auto" is resolved from the machine (dtype) or the compute
# dtype (the cache).
DTYPES = ("auto", "float32", "bfloat16", "float16")
PREEMPT_VICTIMS = ("newest", "least-output")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    # Admission policy (core/admission.py): current (vLLM), reserve (TGI), ratio (SGLang).
    admission: str = "current"
    # Share of the KV pool kept free when a request is admitted.
    watermark: float = 0.0
    # Overrides the policy's victim rule; None keeps the policy's own.
    preempt_victim: str | None = None
    # A prompt chunk runs at most this many tokens per step (0: up to the whole budget), so
    # one long prompt cannot stall every running stream for a whole big step (vLLM's name).
    long_prefill_token_threshold: int = 0

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}.")
        _check_scheduling(
            self.admission, self.watermark, self.preempt_victim, self.long_prefill_token_threshold
        )


@dataclass(frozen=True)
class EngineConfig:
    model: str
    served_model_name: str
    dtype: str
    dtype_reason: str
    device: str
    seed: int
    cache: CacheConfig
    scheduler: SchedulerConfig
    # JSON-lines file that gets one line per finished request; None: no log.
    request_log: str | None = None
    # The chat template text that replaces the model's own (--chat-template); None: the model's.
    chat_template: str | None = None

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)


@dataclass
class EngineArgs:
    """User-facing settings with vLLM's names. None means "decide from the model/machine"."""

    model: str | None = None
    dtype: str = "auto"
    # "auto": the compute dtype (vLLM's rule); bfloat16 halves the bytes of every cached token.
    kv_cache_dtype: str = "auto"
    max_model_len: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int | None = None
    # None: DEFAULT_CPU_LONG_PREFILL_TOKEN_THRESHOLD on a CPU, 0 (no cap) elsewhere.
    long_prefill_token_threshold: int | None = None
    kv_cache_tokens: int | None = None
    kv_cache_memory_bytes: int | None = None
    # None: DEFAULT_CPU_BLOCK_SIZE on a CPU, 16 elsewhere (vLLM's defaults).
    block_size: int | None = None
    enable_prefix_caching: bool = True
    seed: int = 0
    device: str = "auto"
    served_model_name: str | None = None
    admission: str = "current"
    watermark: float = 0.0
    preempt_victim: str | None = None
    request_log: str | None = None
    # A Jinja chat template, as a file path or the template text itself (vLLM's rule).
    chat_template: str | None = None

    def __post_init__(self) -> None:
        load_chat_template(self.chat_template)  # a missing file fails here, not at serve time
        for name in ("dtype", "kv_cache_dtype"):
            if getattr(self, name) not in DTYPES:
                raise ValueError(
                    f"{name} must be one of {', '.join(DTYPES)}; got {getattr(self, name)!r}."
                )
        for name in (
            "max_model_len",
            "max_num_batched_tokens",
            "kv_cache_tokens",
            "kv_cache_memory_bytes",
        ):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}.")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}.")
        if self.block_size is not None and self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}.")
        if self.kv_cache_tokens is not None and self.kv_cache_memory_bytes is not None:
            raise ValueError("Set kv_cache_tokens or kv_cache_memory_bytes, not both.")
        _check_scheduling(
            self.admission,
            self.watermark,
            self.preempt_victim,
            self.long_prefill_token_threshold or 0,
        )


def _check_scheduling(
    admission: str,
    watermark: float,
    preempt_victim: str | None,
    long_prefill_token_threshold: int,
) -> None:
    """The scheduler knobs EngineArgs and SchedulerConfig share, checked the same way."""
    if long_prefill_token_threshold < 0:
        raise ValueError(
            f"long_prefill_token_threshold must be >= 0, got {long_prefill_token_threshold}."
        )
    if admission not in ADMISSION_POLICIES:
        raise ValueError(
            f"admission must be one of {', '.join(ADMISSION_POLICIES)}; got {admission!r}."
        )
    if not 0.0 <= watermark < 1.0:
        raise ValueError(f"watermark must be in [0, 1), got {watermark}.")
    if preempt_victim is not None and preempt_victim not in PREEMPT_VICTIMS:
        raise ValueError(
            f"preempt_victim must be one of {', '.join(PREEMPT_VICTIMS)}; got {preempt_victim!r}."
        )


# Characters that mark a value as template text rather than a path (vLLM's test).
_TEMPLATE_CHARS = "{}\n"


def load_chat_template(value: str | None) -> str | None:
    """`--chat-template`: the text of the file it names, else the value itself if it looks like
    a template. ValueError naming chat_template for a path that cannot be read."""
    if value is None:
        return None
    try:
        with open(value, encoding="utf-8") as file:
            return file.read()
    except OSError as exc:
        if any(char in value for char in _TEMPLATE_CHARS):
            return value
        raise ValueError(
            f"chat_template {value!r} is neither a readable file ({exc.strerror}) nor a template."
        ) from None
