"""Start-up configuration: every engine setting spelled once, resolved once, logged once.

`EngineArgs` is what a user sets, with vLLM's names: its fields are the `LLM(...)` keywords and,
through `add_cli_args`, the command line's flags, with their help text. `EngineArgs.
create_engine_config` resolves it, given what the engine found out about the machine
(`PlatformInfo`) and the model (its ModelConfig), into a frozen `EngineConfig`: every effective
value, defaults included, which the engine logs as one JSON document at start-up. Nothing edits
a config after that. Plain Python: no torch, no model code (the facts come in as plain data).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from octavo.core.kv_cache_manager import sliding_window_blocks

if TYPE_CHECKING:
    from octavo.model.config import ModelConfig

# --dtype and --kv-cache-dtype; "auto" is resolved from the machine (dtype) or the compute
# dtype (the cache).
DTYPES = ("auto", "float32", "bfloat16", "float16")
# vLLM's other spellings of them.
DTYPE_ALIASES = {"half": "float16", "float": "float32"}
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# The attention backends select_backend knows (model/backends/select.py).
ATTENTION_BACKENDS = ("auto", "cpu_paged", "sdpa", "reference")
# --quantization: "gguf" (vLLM's name) keeps a GGUF file's block types, as without the flag;
# a block type or a mix of them (llama-quantize's q4_k_m, q5_k_m) quantizes a float
# checkpoint's matrices at load (model/loader/quantization.py's PLANS); "gptq", "awq" and
# "compressed-tensors" (vLLM's names) name a Hugging Face checkpoint's own method, which is
# read as without the flag (model/loader/hf_quantized.py).
CHECKPOINT_QUANTIZATIONS = ("gguf", "gptq", "awq", "compressed-tensors")
# vLLM's names for its kernels over those checkpoints: the same checkpoints here.
QUANTIZATION_ALIASES = {"gptq_marlin": "gptq", "awq_marlin": "awq"}
QUANTIZATIONS = (
    *CHECKPOINT_QUANTIZATIONS,
    *("q8_0", "q6_k", "q5_k", "q5_1", "q5_0", "q4_k", "q4_1", "q4_0", "q4_k_m", "q5_k_m"),
)

DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048
# --scheduling-policy (vLLM's): the waiting queue in arrival order, or by each request's
# `priority` (lower first), then arrival (core/scheduler.py).
SCHEDULING_POLICIES = ("fcfs", "priority")
# vLLM's cap on the logprobs a request may ask for per position.
# vLLM's names for how the ranks of a tensor-parallel model run.
DISTRIBUTED_EXECUTOR_BACKENDS = ("mp", "uni", "ray", "external_launcher")
DEFAULT_MAX_LOGPROBS = 20
# vLLM's --logprobs-mode values (the sampler's LOGPROBS_MODES, which says what each means).
LOGPROBS_MODES = ("raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits")
# --profiler-config (vLLM's ProfilerConfig): the keys octavo takes, with vLLM's defaults. Only
# the torch profiler exists here; VLLM_TORCH_PROFILER_DIR (vLLM's older switch) is read where
# the flag is not given.
PROFILER_CONFIG_DEFAULTS: dict[str, Any] = {
    "profiler": None,
    "torch_profiler_dir": "",
    "torch_profiler_with_stack": True,
    "torch_profiler_with_flops": False,
    "torch_profiler_use_gzip": True,
    "torch_profiler_record_shapes": False,
    "torch_profiler_with_memory": False,
}
# speculative_config (vLLM's SpeculativeConfig): the methods and the fields octavo takes.
SPECULATIVE_METHODS = ("ngram", "suffix", "draft_model")
SPECULATIVE_FIELDS = (
    "method",
    "model",
    "quantization",
    "draft_tensor_parallel_size",
    "num_speculative_tokens",
    "prompt_lookup_min",
    "prompt_lookup_max",
    "disable_by_batch_size",
    "min_acceptance_rate",
    "rejection_sample_method",
    "suffix_decoding_max_tree_depth",
    "suffix_decoding_max_cached_requests",
    "suffix_decoding_max_spec_factor",
)
# On a CPU, a step with this many running requests or more verifies no proposal unless
# disable_by_batch_size says otherwise (vLLM never switches off by batch size, and neither
# does octavo on other devices, where it was not measured). Measured
# (BENCHMARKS.md, 2026-12-07): on a 2-core Zen 4 EPYC the copying workload gains 1.23-1.27x
# output tok/s at 8 streams and 1.07x at 16, breaks even at 32 (ngram 0.99x, suffix 1.06x),
# and random prompts at 32 streams (compare.sh's A) lose 3.6% with suffix, none with this
# default; at 32 a step is already compute-bound, and every verified token adds a row to it.
DEFAULT_DISABLE_BY_BATCH_SIZE = 32
PROFILER_DIR_ENV = "VLLM_TORCH_PROFILER_DIR"
# On a CPU a step's time grows with every prompt token it carries (~1 ms per token for the
# embedded model on two cores), so a prompt taking the whole 2,048-token budget freezes every
# running stream for seconds. With a cap per prompt and step, the prompts that arrive together
# advance together, and one that arrives while others decode delays them by one chunk's time
# (benchmarks/history/, "Prompt chunks while decoding"). 256 rather than 128: a 256-token
# prompt then runs in one step, as do D's 256 new tokens per prompt (its p99 TTFT 2.4 s instead
# of 2.7-3.4), with C's and D's p99 ITL unchanged ("The prompt cap at 256", ibid.). The cap
# applies only to steps that carry decoding streams (core/scheduler.py): prompts that arrive
# together with nothing decoding run whole, oldest first, so their first tokens come in turn
# rather than all at the end of the burst.
DEFAULT_CPU_LONG_PREFILL_TOKEN_THRESHOLD = 256
# Tokens per KV block on a CPU (vLLM's CPU default too). Decode attention reads a request's
# blocks from wherever they lie in the pool; 128 tokens make each block's keys a contiguous
# run of 96 KB (the embedded model, float32), where 16 tokens make 12 KB runs that the memory
# system streams less well: a decode step of 32 requests at 320 tokens ~5% faster (ibid.,
# "Decode attention in sixteen lanes, huge pages, 128-token blocks"). GPUs keep 16.
DEFAULT_CPU_BLOCK_SIZE = 128
DEFAULT_GPU_BLOCK_SIZE = 16
# --generation-config: where the sampling defaults come from ("auto": the model's
# generation_config.json, "vllm": none, vLLM's own defaults; any other value: a folder, or a
# Hub id, holding a generation_config.json).
GENERATION_CONFIG_SOURCES = ("auto", "vllm")
# generation_config.json key -> SamplingParams field: the keys vLLM takes as the defaults of a
# request that leaves the field unset (Hugging Face's max_new_tokens is vLLM's max_tokens).
GENERATION_DEFAULT_FIELDS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}


# vLLM's --runner and --convert values octavo runs: a generation model, or a pooling model
# (embeddings), either natively (BertModel, LlamaModel, ...) or converted from a causal LM
# (`--convert embed`: its final-norm hidden states pooled instead of its logits).
RUNNERS = ("auto", "generate", "pooling")
CONVERTS = ("auto", "none", "embed")
# vLLM's sequence pooling types: the last prompt token's hidden state, the mean over the
# prompt's, the first token's.
POOLING_TYPES = ("LAST", "MEAN", "CLS")
# --pooler-config keys (vLLM's PoolerConfig) octavo takes, and those it refuses at any value
# but their default (they belong to tasks octavo does not run).
POOLER_CONFIG_KEYS = ("pooling_type", "seq_pooling_type", "use_activation", "dimensions")
POOLER_CONFIG_REFUSED = {
    "task": (None, "embed"),
    "tok_pooling_type": (None,),
    "enable_chunked_processing": (None, False),
    "max_embed_len": (None,),
    "logit_mean": (None,),
    "logit_sigma": (None,),
    "step_tag_id": (None,),
    "returned_token_ids": (None,),
    "enable_flash_late_interaction": (None, True),
}


# --------------------------------------------------------------------------- resolved configs


@dataclass(frozen=True)
class PoolerConfig:
    """How a pooling model turns a prompt's final-norm hidden states into one vector."""

    # POOLING_TYPES
    pooling_type: str
    # L2-normalize by default (a request's use_activation overrides it).
    use_activation: bool = True
    # The dimensions a request keeps by default (None: all).
    dimensions: int | None = None
    # Where the pooling type came from: user, sentence_transformers or model_default.
    source: str = "model_default"
    # The pooled vector's length (the model's hidden size), and the Matryoshka prefixes a
    # request's `dimensions` may keep (any length where is_matryoshka; only those listed where
    # the model lists them).
    embedding_size: int = 0
    is_matryoshka: bool = False
    matryoshka_dimensions: tuple[int, ...] | None = None


@dataclass(frozen=True)
class CacheConfig:
    block_size: int
    num_blocks: int
    enable_prefix_caching: bool = True
    # Bytes one token of KV takes across all layers (K and V); 0 when no model is attached.
    bytes_per_token: int = 0
    # A draft model's (speculative decoding): its own cache tensors over the same block ids,
    # this many bytes a token beside bytes_per_token; 0 without one.
    draft_bytes_per_token: int = 0
    # The cache tensors' dtype ("" when no model is attached).
    dtype: str = ""
    # KV cache groups (the hybrid KV cache manager): layers of one attention kind, as many per
    # group, share block ids; all groups share the one pool. group_windows[g]: group g's
    # sliding window (0: full attention), whose blocks before the window go back to the pool
    # as requests move on; layer_groups[i]: layer i's (group, cache tensor), the tensor shared
    # by the i-th layer of every group. One group (the default, and with the hybrid manager
    # off) is every layer with its own tensor; bytes_per_token then counts all layers, else the
    # layers of one group (what a block id holds).
    group_windows: tuple[int, ...] = (0,)
    layer_groups: tuple[tuple[int, int], ...] = ()
    # Share of the blocks handed out whose life (allocation, prefix hits, reuse for other
    # data) feeds the vllm:kv_block_* histograms (vLLM's --kv-cache-metrics-sample); 0: none,
    # and the histograms are not exported (--kv-cache-metrics off).
    kv_cache_metrics_sample: float = 0.0

    @property
    def sliding_window(self) -> int:
        """The window of a one-group cache (0: none, or several groups)."""
        return self.group_windows[0] if len(self.group_windows) == 1 else 0

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}.")
        if self.num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {self.num_blocks}.")
        if not 0.0 <= self.kv_cache_metrics_sample <= 1.0:
            raise ValueError(
                f"kv_cache_metrics_sample must be in [0, 1], got {self.kv_cache_metrics_sample}."
            )

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size


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
    # SCHEDULING_POLICIES: fcfs, or priority (the waiting queue by (priority, arrival), the
    # victim the running request with the largest).
    scheduling_policy: str = "fcfs"
    # vLLM's bounds on the serving frontend's queue (engine/queue_limits.py): requests in
    # flight, and prompt tokens not yet prefilled; None: no bound.
    max_num_queued_reqs: int | None = None
    max_num_queued_tokens: int | None = None
    # octavo's wait bound (--max-queue-wait): the longest predicted time to first token a
    # request is admitted with (engine/step_rates.py predicts it); None: no bound.
    max_queue_wait_s: float | None = None
    # False for an encoder: every prompt runs whole in one step (vLLM's chunked prefill off
    # for bidirectional attention), so max_num_batched_tokens holds max_model_len.
    enable_chunked_prefill: bool = True

    def __post_init__(self) -> None:
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"max_num_batched_tokens={self.max_num_batched_tokens} is smaller than "
                f"max_model_len={self.max_model_len}: an encoder runs each prompt whole in one "
                "step (no chunked prefill); raise it or lower max_model_len."
            )
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}.")
        _check_queue_bounds(self.max_num_queued_reqs, self.max_num_queued_tokens)
        _check_queue_wait("max_queue_wait_s", self.max_queue_wait_s)
        _check_scheduling(
            self.admission,
            self.watermark,
            self.preempt_victim,
            self.long_prefill_token_threshold,
            self.scheduling_policy,
        )


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (vLLM's speculative_config, resolved by resolve_speculative_config):
    how proposals are made and when they are not (core/spec_decode.py makes them)."""

    # SPECULATIVE_METHODS: ngram (prompt lookup in the request's own tokens), suffix (the
    # same over earlier requests' outputs too) or draft_model (a smaller model's greedy
    # continuation, run by the runner after each step: worker/drafter.py).
    method: str
    # Most proposed tokens a request verifies per step.
    num_speculative_tokens: int
    # The n-gram lengths looked up, longest first (ngram); suffix matches from the min on.
    prompt_lookup_min: int
    prompt_lookup_max: int
    # A step with this many running requests or more runs no proposal (vLLM v0's name);
    # None: never switched off by batch size. Default: DEFAULT_DISABLE_BY_BATCH_SIZE on a CPU,
    # None elsewhere (resolve_speculative_config).
    disable_by_batch_size: int | None = DEFAULT_DISABLE_BY_BATCH_SIZE
    # A request whose share of accepted proposed tokens, over its recent proposals, falls
    # below this stops proposing for a while (octavo's; 0: never).
    min_acceptance_rate: float = 0.1
    # suffix: the longest match plus proposal, the earlier requests cached (FIFO eviction),
    # and the proposal's cap as a multiple of the match length (vLLM's names).
    suffix_decoding_max_tree_depth: int = 24
    suffix_decoding_max_cached_requests: int = 10000
    suffix_decoding_max_spec_factor: float = 1.0
    # draft_model: the draft's model as given (a folder, GGUF file or Hub id; EngineConfig's
    # holds the resolved path) and its --quantization (None: what its files say).
    model: str | None = None
    quantization: str | None = None

    @property
    def drafts_by_model(self) -> bool:
        """Whether the runner makes the proposals (a draft model), not the scheduler."""
        return self.method == "draft_model"


@dataclass(frozen=True)
class BackendConfig:
    """What the model backend may use (model/backends/select.py decides the rest)."""

    # auto, or one of ATTENTION_BACKENDS to force it.
    attention_backend: str = "auto"
    # Whether a CPU may use octavo's C++ kernels (compiled on first use); False: torch ops.
    cpu_kernels: bool = True
    # Rows up to which the packed matmul kernel takes a batch; None: timed per weight shape
    # when the model is loaded.
    packed_max_rows: int | None = None
    # Whether the KV cache and packed weights ask the kernel for 2 MiB pages.
    huge_pages: bool = True
    # Whether weights in block types, dequantized for a prompt-sized matmul under float32
    # compute, are multiplied in bfloat16 (the CPU has native bfloat16: its GEMM runs 2-3x
    # float32's, and rounding activations to bfloat16 costs no more than the block kernel's
    # 8 bits per 32 values do).
    bf16_dequantized_gemm: bool = False


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
    backend: BackendConfig = field(default_factory=BackendConfig)
    # The float weight matrices' dtype where it is not the compute dtype (None: the same).
    weight_dtype: str | None = None
    # JSON-lines file that gets one line per finished request; None: no log.
    request_log: str | None = None
    # The chat template text that replaces the model's own (--chat-template); None: the model's.
    chat_template: str | None = None
    # --quantization (QUANTIZATIONS); None: the checkpoint's weights as they are.
    quantization: str | None = None
    # What the backend chose once the model was loaded (ModelBackend.describe()); empty before.
    backend_choices: dict[str, Any] = field(default_factory=dict)
    # Every name clients may give in `model` (served_model_name is the first, the one reported).
    served_model_names: tuple[str, ...] = ()
    # Most logprobs a request may ask for per position; -1: the vocabulary.
    max_logprobs: int = DEFAULT_MAX_LOGPROBS
    # Ranks the model is split over (worker/executor.py); each holds 1 / tensor_parallel_size
    # of every token's KV.
    tensor_parallel_size: int = 1
    # How its ranks run (worker/setup.py picks the executor): mp, ray or external_launcher.
    distributed_executor_backend: str = "mp"
    # Where the tokenizer and its chat template are loaded from (--tokenizer, resolved to a
    # folder or a .gguf file); "": the model's path.
    tokenizer: str = ""
    # The folder whose config.json replaces the model's (--hf-config-path, resolved; "": the
    # model's), and the keys that replace the config's (--hf-overrides).
    hf_config_path: str = ""
    hf_overrides: dict[str, Any] = field(default_factory=dict)
    # --generation-config as given, and --override-generation-config's keys (Hugging Face's
    # names); the server's max_tokens rule tells them apart (sampling_max_tokens_cap).
    generation_config: str = "auto"
    override_generation_config: dict[str, Any] = field(default_factory=dict)
    # The defaults of a request that leaves a field unset, as SamplingParams field names: the
    # generation config's with the overrides on top (vLLM's get_diff_sampling_param).
    sampling_defaults: dict[str, Any] = field(default_factory=dict)
    # sleep() / wake_up() allowed (vLLM's --enable-sleep-mode).
    enable_sleep_mode: bool = False
    # The torch profiler's settings (PROFILER_CONFIG_DEFAULTS' keys); empty: no profiler, and
    # start_profile() is refused.
    profiler_config: dict[str, Any] = field(default_factory=dict)
    # LOGPROBS_MODES: which numbers the sampler reports as logprobs (vLLM's --logprobs-mode).
    logprobs_mode: str = "raw_logprobs"
    # --reasoning-parser: output constraints wait for the thinking to end (structured_output/
    # reasoning.py); the server also splits thinking from answer by it.
    reasoning_parser: str | None = None
    # vLLM's resolved --runner ("generate" or "pooling") and --convert ("none" or "embed");
    # a pooling engine has its pooler (None for generation).
    runner: str = "generate"
    convert: str = "none"
    pooler: PoolerConfig | None = None

    @property
    def is_pooling(self) -> bool:
        return self.runner == "pooling"

    # Speculative decoding; None: off.
    speculative: SpeculativeConfig | None = None

    @property
    def tokenizer_path(self) -> str:
        return self.tokenizer or self.model

    @property
    def max_tokens_cap(self) -> int | None:
        """The max_tokens no server request may exceed, its own included (vLLM's
        override_max_tokens): a --generation-config folder's max_new_tokens (with the
        overrides), else --override-generation-config's; None: no cap. The model's own
        max_new_tokens is only a default."""
        if self.generation_config not in GENERATION_CONFIG_SOURCES:
            return self.sampling_defaults.get("max_tokens")
        return self.override_generation_config.get("max_new_tokens")

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)


@dataclass(frozen=True)
class PlatformInfo:
    """What the engine found out about the machine, as plain data (worker/device.py probes)."""

    # The torch device ("cpu", "cuda:0") and its type.
    device: str
    device_type: str
    # Why bfloat16 is the natural compute dtype here ("" where it is not): the CPU's native
    # bfloat16 flags, or a GPU that supports it.
    native_bf16: str
    # Bytes the KV cache takes when the user sets no capacity.
    default_kv_cache_bytes: int
    # The device's whole memory (host RAM on a CPU), which gpu_memory_utilization is a share of.
    total_memory_bytes: int = 0


# --------------------------------------------------------------------------- user settings


def setting(
    default: Any,
    help: str,
    *,
    choices: Sequence[str] | Callable[[], Sequence[str]] | None = None,
    metavar: str | None = None,
    cli: bool = True,
    alias: str | None = None,
    parse: Callable[[str], Any] | None = None,
    nargs: str | None = None,
    const: Any = None,
) -> Any:
    """An EngineArgs field: its default, the help text its flag shows, the values it takes (a
    sequence, or a function giving them where they live in another module), whether it is a
    flag at all, its other spelling (vLLM's `-q`, `--device-memory-utilization`), how its
    value is parsed where that is not the field's type (vLLM's `4k`), argparse's nargs
    (several values, or "?": an optional one) and the value of the flag given without one
    (nargs "?")."""
    metadata = {
        "const": const,
        "help": help,
        "choices": choices,
        "metavar": metavar,
        "cli": cli,
        "alias": alias,
        "parse": parse,
        "nargs": nargs,
    }
    return field(default=default, metadata=metadata)


def human_readable_int(text: str) -> int:
    """An integer as vLLM's flags take it: digits, or a number with a suffix, k/m/g/t for
    powers of 1000 (`25.6k` = 25600) and K/M/G/T for powers of 1024 (`4K` = 4096, whole
    numbers only)."""
    text = str(text).strip()
    decimal = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
    binary = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
    suffix = text[-1:]
    try:
        if suffix in decimal:
            return int(float(text[:-1]) * decimal[suffix])
        if suffix in binary:
            return int(text[:-1]) * binary[suffix]
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not an integer (digits, or a number with k/m/g/t for powers of 1000 "
            "or a whole number with K/M/G/T for powers of 1024)"
        ) from None


def json_object(text: str, name: str) -> dict[str, Any]:
    """A setting's JSON object (vLLM's dict-valued flags); ValueError naming the setting for
    anything else."""
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise ValueError(f"{name} is not valid JSON ({exc}): {text!r}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{name} must be a JSON object, got {text!r}")
    return value


def json_object_flag(name: str) -> Callable[[str], dict[str, Any]]:
    """json_object as an argparse type: its message, not argparse's "invalid value"."""

    def parse(text: str) -> dict[str, Any]:
        try:
            return json_object(text, name)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return parse


def model_len(text: str) -> int | None:
    """--max-model-len: human_readable_int, or auto / -1 for the model's own (capped)."""
    if str(text).strip().lower() in ("auto", "-1"):
        return None
    return human_readable_int(text)


@dataclass
class EngineArgs:
    """User-facing settings with vLLM's names. None means "decide from the model/machine"."""

    model: str | None = setting(
        None,
        "HF folder, .gguf file, or Hugging Face Hub id org/name (default: the embedded "
        "SmolLM2-135M-Instruct)",
    )
    revision: str | None = setting(
        None,
        "the branch, tag or commit of a Hugging Face Hub model id (default: main)",
    )
    download_dir: str | None = setting(
        None,
        "where Hub models are cached (default: huggingface_hub's cache, HF_HOME / HF_HUB_CACHE)",
        metavar="DIR",
    )
    tokenizer: str | None = setting(
        None,
        "load the tokenizer and its chat template from this HF folder, .gguf file or Hub id "
        "instead of from the model",
        metavar="NAME_OR_PATH",
    )
    tokenizer_revision: str | None = setting(
        None,
        "the branch, tag or commit of a Hub id --tokenizer (default: --revision)",
    )
    hf_token: str | bool | None = setting(
        None,
        "the Hugging Face token that Hub downloads (the model, --tokenizer, --hf-config-path, "
        "--generation-config) are made with; the flag alone: the one `hf auth login` stored "
        "(default: HF_TOKEN, else the stored one)",
        metavar="TOKEN",
        nargs="?",
        const=True,
    )
    hf_config_path: str | None = setting(
        None,
        "read config.json from this HF folder or Hub id (at --revision) instead of the model's",
        metavar="NAME_OR_PATH",
    )
    hf_overrides: dict[str, Any] | None = setting(
        None,
        "a JSON object of keys that replace those of the model's config.json before octavo "
        "reads it, e.g. '{\"max_position_embeddings\": 4096}' (a *_config sub-config's keys "
        "are replaced one by one)",
        metavar="JSON",
        parse=json_object_flag("hf_overrides"),
    )
    served_model_name: str | list[str] | None = setting(
        None,
        "the name clients use in `model`, or several (the first is the one reported; default: "
        "from the model)",
        nargs="+",
    )
    dtype: str = setting(
        "auto",
        "compute dtype (auto: float32 on CPUs, over bfloat16 weight matrices where the CPU has "
        "native bfloat16; bfloat16 on GPUs that support it, else float16)",
        choices=(*DTYPES, *DTYPE_ALIASES),
    )
    quantization: str | None = setting(
        None,
        "weights in GGML block types: gguf keeps a GGUF file's own (the default for one); a "
        "type (q8_0 ... q4_0, q6_k, q5_k, q4_k) or llama-quantize's mix q4_k_m / q5_k_m "
        "quantizes a float checkpoint's matrices at load; gptq, awq, compressed-tensors (and "
        "vLLM's gptq_marlin, awq_marlin) name a quantized checkpoint's own method",
        choices=(*QUANTIZATIONS, *QUANTIZATION_ALIASES),
        alias="-q",
    )
    kv_cache_dtype: str = setting(
        "auto",
        "dtype of the KV cache (auto: the weights' float dtype); bfloat16 with float32 compute "
        "halves each token's bytes",
        choices=DTYPES,
    )
    max_model_len: int | None = setting(
        None,
        "longest prompt + output, e.g. 4096 or 4k (default or auto: the model's, capped by the "
        "KV capacity)",
        parse=model_len,
    )
    max_num_seqs: int = setting(64, "most requests running at once")
    max_num_batched_tokens: int | None = setting(
        None,
        f"token budget of one step (default: {DEFAULT_MAX_NUM_BATCHED_TOKENS})",
        parse=human_readable_int,
    )
    long_prefill_token_threshold: int | None = setting(
        None,
        "at most this many prompt tokens of one request per step while streams decode (0: "
        "no cap; default: "
        f"{DEFAULT_CPU_LONG_PREFILL_TOKEN_THRESHOLD} on a CPU, no cap elsewhere)",
    )
    kv_cache_tokens: int | None = setting(None, "KV capacity in tokens", parse=human_readable_int)
    kv_cache_memory_bytes: int | None = setting(
        None,
        "KV capacity in bytes, e.g. 4G (default: see --gpu-memory-utilization)",
        parse=human_readable_int,
    )
    gpu_memory_utilization: float | None = setting(
        None,
        "share of the device's memory (host RAM on a CPU) for the weights and the KV cache: "
        "the KV cache gets this share of the total less the model's weight files (default: a "
        "quarter of the available memory, at most 4 GiB, on a CPU; 0.8 of the free memory on "
        "a GPU)",
        alias="--device-memory-utilization",
    )
    block_size: int | None = setting(
        None,
        f"tokens per KV cache block (default: {DEFAULT_CPU_BLOCK_SIZE} on a CPU, "
        f"{DEFAULT_GPU_BLOCK_SIZE} elsewhere)",
    )
    enable_prefix_caching: bool = setting(True, "reuse the KV blocks of shared prompt prefixes")
    disable_hybrid_kv_cache_manager: bool = setting(
        False,
        "keep every KV block of a sliding-window model (default: blocks a window no longer "
        "sees go back to the pool)",
    )
    seed: int = setting(0, "seed of the engine's random state")
    max_logprobs: int = setting(
        DEFAULT_MAX_LOGPROBS,
        "most logprobs (top_logprobs) a request may ask for per position; -1: the vocabulary",
    )
    logprobs_mode: str = setting(
        "raw_logprobs",
        "what the returned logprobs are: raw_logprobs (log_softmax of the model's logits), "
        "raw_logits (those logits), processed_logprobs / processed_logits (the same of the "
        "logits the token was drawn from: after logit bias, min_tokens, penalties, temperature, "
        "min_p, top_k and top_p)",
        choices=LOGPROBS_MODES,
    )
    reasoning_parser: str | None = setting(
        None,
        "how the model's thinking is told from its answer, vLLM's names: deepseek_r1 (the "
        "output starts inside the thinking, up to </think>), qwen3 (the same, and a <tool_call> "
        "ends it too; off for a request with chat_template_kwargs enable_thinking false). The "
        "server sends the thinking as message.reasoning (its own stream deltas) and reads tool "
        "calls after it; output constraints (response_format, structured_outputs, a forced "
        "tool call) hold from the end of the thinking",
        choices=lambda: list(_reasoning_parsers()),
        metavar="NAME",
    )
    device: str = setting("auto", "torch device (auto: cuda if available, else cpu)")
    admission: str = setting(
        "current",
        "what must be free before a request starts: current (vLLM: the next chunk), reserve "
        "(TGI: prompt + max_tokens, never evicts), ratio (SGLang: an adaptive share of "
        "max_tokens), forecast (octavo: the batch's predicted peak, from the lengths of "
        "recent answers)",
        choices=lambda: list(_admission_policies()),
    )
    watermark: float = setting(0.0, "share of the KV pool kept free when a request is admitted")
    preempt_victim: str | None = setting(
        None,
        "whom to evict when a block is missing (default: the policy's)",
        choices=lambda: list(_victim_rules()),
    )
    scheduling_policy: str = setting(
        "fcfs",
        "the waiting queue's order: fcfs (arrival) or priority (each request's `priority`, "
        "lower first, then arrival; a running request that needs a block evicts the least "
        "important, latest one)",
        choices=SCHEDULING_POLICIES,
    )
    max_num_queued_reqs: int | None = setting(
        None,
        "octavo serve: answer 503 at once to a request that would make more than N requests "
        "in flight, waiting or running (n > 1 counts n) (default: no bound)",
        metavar="N",
        parse=human_readable_int,
    )
    max_num_queued_tokens: int | None = setting(
        None,
        "octavo serve: answer 503 at once to requests while the prompts not yet prefilled hold "
        "N tokens or more (default: no bound)",
        metavar="N",
        parse=human_readable_int,
    )
    max_queue_wait: float | None = setting(
        None,
        "octavo serve: answer 503 at once, with Retry-After, to a request whose predicted time "
        "to first token (the prompt tokens ahead of it, the running requests and the engine's "
        "measured step rates) is over SECONDS; nothing is shed before the rates are measured "
        "(default: no bound)",
        metavar="SECONDS",
    )
    request_log: str | None = setting(
        None,
        "append one JSON line per finished request (lengths, finish reason, TTFT, largest "
        "token gap, evictions) to PATH",
        metavar="PATH",
    )
    # A Jinja chat template, as a file path or the template text itself (vLLM's rule).
    chat_template: str | None = setting(
        None,
        "Jinja chat template (a file, or the template text) that replaces the model's own",
        metavar="PATH_OR_TEMPLATE",
    )
    generation_config: str = setting(
        "auto",
        "where the defaults of the sampling fields a request leaves unset come from: auto (the "
        "model's generation_config.json), vllm (none: SamplingParams' own), or a folder (or Hub "
        "id) holding a generation_config.json, whose max_new_tokens then caps every request",
        metavar="auto|vllm|FOLDER",
    )
    override_generation_config: dict[str, Any] | None = setting(
        None,
        "a JSON object of generation defaults over those of --generation-config, with Hugging "
        'Face\'s names, e.g. \'{"temperature": 0.5, "max_new_tokens": 256}\' (the last caps '
        "every request's max_tokens)",
        metavar="JSON",
        parse=json_object_flag("override_generation_config"),
    )
    attention_backend: str = setting(
        "auto",
        "attention implementation (auto: cpu_paged on a CPU with the kernels and a float32 or "
        "bfloat16 cache, else sdpa; reference: plain torch, for checking)",
        choices=ATTENTION_BACKENDS,
    )
    cpu_kernels: bool = setting(True, "use octavo's C++ kernels on a CPU (else torch ops)")
    packed_max_rows: int | None = setting(
        None,
        "rows up to which the packed (or GGML block) matmul kernel takes a batch; 0: none, "
        "every matmul in torch's GEMM on weights in the compute dtype, the float reference "
        "(default: timed against it per weight shape at load)",
    )
    huge_pages: bool = setting(
        True, "allocate the KV cache and packed or block weights in 2 MiB pages"
    )
    tensor_parallel_size: int = setting(
        1,
        "ranks the model's heads, MLP columns and vocabulary are split over, each a process of "
        "its own (joined by torch.distributed: gloo on a CPU, NCCL on CUDA) with its share of "
        "the CPUs and of every token's KV",
        alias="-tp",
    )
    distributed_executor_backend: str | None = setting(
        None,
        "how the tensor-parallel ranks run: mp (processes on this machine, the default above "
        "one rank), ray (Ray actors on the cluster ray.init() finds, machines included; pip "
        "install 'octavo[ray]'), external_launcher (each rank a process torchrun started, "
        "offline LLM only) or uni (one rank, in the engine's process)",
        choices=DISTRIBUTED_EXECUTOR_BACKENDS,
    )
    kv_cache_metrics: bool = setting(
        False,
        "sample KV blocks and export how long they live, sit idle before their reuse for "
        "other data, and wait between prefix-cache hits (vllm:kv_block_*_seconds)",
    )
    kv_cache_metrics_sample: float = setting(
        0.01, "with kv_cache_metrics, the share of the blocks handed out that is sampled"
    )
    enable_sleep_mode: bool = setting(
        False,
        "allow sleep() / wake_up() (POST /sleep, /wake_up with the dev endpoints): level 1 "
        "frees the KV cache (weights stay in host memory on a CPU), level 2 the weights too, "
        "reloaded from the model files at wake-up",
    )
    profiler_config: dict[str, Any] | None = setting(
        None,
        'the torch profiler, vLLM\'s JSON: {"profiler": "torch", "torch_profiler_dir": DIR} '
        "(and torch_profiler_with_stack, _record_shapes, _with_memory, _with_flops, "
        "_use_gzip); start_profile() / stop_profile() (POST /start_profile, /stop_profile) "
        "write a trace of the steps between them to DIR. Default: " + PROFILER_DIR_ENV + " if set",
        parse=json_object_flag("profiler_config"),
        metavar="JSON",
    )
    runner: str = setting(
        "auto",
        "generate: a text generation model; pooling: an embedding model, served at "
        "/v1/embeddings and by LLM.embed (auto: pooling for a sentence-transformers folder, "
        "a *Model architecture (BertModel, Qwen3Model) or a --convert, else generate)",
        choices=RUNNERS,
    )
    convert: str = setting(
        "auto",
        "embed: run a causal LM (Qwen3ForCausalLM, LlamaForCausalLM) as an embedding model, "
        "its final hidden states pooled (auto: embed for --runner pooling over a causal LM)",
        choices=CONVERTS,
    )
    pooler_config: dict[str, Any] | None = setting(
        None,
        'a pooling model\'s pooler, vLLM\'s JSON: {"pooling_type": "MEAN", "use_activation": '
        "false} (pooling_type LAST, MEAN or CLS; use_activation: L2-normalize; dimensions). "
        "Default: the sentence-transformers 1_Pooling config, else LAST (CLS for BERT)",
        parse=json_object_flag("pooler_config"),
        metavar="JSON",
    )
    speculative_config: dict[str, Any] | None = setting(
        None,
        'speculative decoding, vLLM\'s JSON, e.g. \'{"method": "ngram", '
        '"num_speculative_tokens": 4, "prompt_lookup_max": 4}\': method ngram, suffix or '
        "draft_model (with model, quantization), num_speculative_tokens, "
        "prompt_lookup_min/max, disable_by_batch_size, "
        "min_acceptance_rate, suffix_decoding_max_tree_depth / _max_cached_requests / "
        "_max_spec_factor (README, Speculative decoding)",
        parse=json_object_flag("speculative_config"),
        metavar="JSON",
        alias="-sc",
    )
    spec_method: str | None = setting(
        None, "speculative_config's method (vLLM's shorthand; not with the same key there)"
    )
    spec_model: str | None = setting(
        None, "speculative_config's model (vLLM's shorthand; not with the same key there)"
    )
    spec_tokens: int | None = setting(
        None,
        "speculative_config's num_speculative_tokens (vLLM's shorthand; not with the same "
        "key there)",
    )
    data_parallel_size: int = setting(
        1,
        "engine-core processes, each with its own scheduler and KV pool, behind one API "
        "server that routes each request by its cached prefix, else to the least loaded; "
        "the CPUs are split between them, and so are the default KV capacity and "
        "--gpu-memory-utilization (an explicit --kv-cache-tokens / --kv-cache-memory-bytes "
        "is each one's); octavo serve only",
        alias="-dp",
    )

    def __post_init__(self) -> None:
        load_chat_template(self.chat_template)  # a missing file fails here, not at serve time
        if isinstance(self.override_generation_config, str):  # LLM(...) may pass vLLM's JSON
            self.override_generation_config = json_object(
                self.override_generation_config, "override_generation_config"
            )
        if not isinstance(self.override_generation_config, (dict, type(None))):
            raise ValueError(
                "override_generation_config must be a dict (a JSON object), got "
                f"{type(self.override_generation_config).__name__}."
            )
        if not self.generation_config:
            raise ValueError("generation_config must be auto, vllm or a folder; got ''.")
        if isinstance(self.hf_overrides, str):  # LLM(...) may pass vLLM's JSON
            self.hf_overrides = json_object(self.hf_overrides, "hf_overrides")
        if not isinstance(self.hf_overrides, (dict, type(None))):
            raise ValueError(
                "hf_overrides must be a dict (a JSON object) of config.json keys; got "
                f"{type(self.hf_overrides).__name__} (a function of the config is not "
                "supported)."
            )
        for name in ("dtype", "kv_cache_dtype"):
            value = getattr(self, name)
            setattr(self, name, DTYPE_ALIASES.get(value, value))
        self.quantization = QUANTIZATION_ALIASES.get(self.quantization, self.quantization)
        names = self.served_model_name
        if isinstance(names, (list, tuple)) and not (names and all(names)):
            raise ValueError("served_model_name must name at least one model.")
        if self.tensor_parallel_size < 1:
            raise ValueError(
                f"tensor_parallel_size must be at least 1, got {self.tensor_parallel_size}."
            )
        backend = self.distributed_executor_backend
        if backend not in (None, *DISTRIBUTED_EXECUTOR_BACKENDS):
            raise ValueError(
                f"distributed_executor_backend must be one of "
                f"{', '.join(DISTRIBUTED_EXECUTOR_BACKENDS)}; got {backend!r}."
            )
        if backend == "uni" and self.tensor_parallel_size > 1:
            raise ValueError(
                "distributed_executor_backend='uni' runs one rank; tensor_parallel_size="
                f"{self.tensor_parallel_size} needs mp."
            )
        if self.data_parallel_size < 1:
            raise ValueError(
                f"data_parallel_size must be at least 1, got {self.data_parallel_size}."
            )
        if not 0 < self.kv_cache_metrics_sample <= 1:
            raise ValueError(
                f"kv_cache_metrics_sample must be in (0, 1], got {self.kv_cache_metrics_sample}."
            )
        if self.enable_sleep_mode and self.tensor_parallel_size > 1:
            raise ValueError(
                "enable_sleep_mode with tensor_parallel_size > 1 is not supported: sleep and "
                "wake_up act on the engine's own process only."
            )
        if isinstance(self.pooler_config, str):  # LLM(...) may pass vLLM's JSON
            self.pooler_config = json_object(self.pooler_config, "pooler_config")
        if self.runner not in RUNNERS:
            raise ValueError(f"runner must be one of {', '.join(RUNNERS)}; got {self.runner!r}.")
        if self.convert not in CONVERTS:
            raise ValueError(
                f"convert must be one of {', '.join(CONVERTS)} (vLLM's classify and reward "
                f"conversions are not implemented); got {self.convert!r}."
            )
        check_pooler_config(self.pooler_config)
        if isinstance(self.profiler_config, str):  # LLM(...) may pass vLLM's JSON
            self.profiler_config = json_object(self.profiler_config, "profiler_config")
        resolve_profiler_config(self.profiler_config, {})  # a bad key fails here
        if isinstance(self.speculative_config, str):  # LLM(...) may pass vLLM's JSON
            self.speculative_config = json_object(self.speculative_config, "speculative_config")
        self.speculative_config = _merge_spec_flags(
            self.speculative_config, self.spec_method, self.spec_model, self.spec_tokens
        )
        self.spec_method = self.spec_model = self.spec_tokens = None
        resolve_speculative_config(self.speculative_config)  # a bad field fails here
        if self.gpu_memory_utilization is not None:
            if not 0 < self.gpu_memory_utilization <= 1:
                raise ValueError(
                    f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}."
                )
            if self.kv_cache_tokens is not None or self.kv_cache_memory_bytes is not None:
                raise ValueError(
                    "Set gpu_memory_utilization or a KV capacity (kv_cache_tokens, "
                    "kv_cache_memory_bytes), not both."
                )
        for name in ("dtype", "kv_cache_dtype"):
            if getattr(self, name) not in DTYPES:
                raise ValueError(
                    f"{name} must be one of {', '.join(DTYPES)}; got {getattr(self, name)!r}."
                )
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise ValueError(
                f"quantization must be one of {', '.join(QUANTIZATIONS)}; got "
                f"{self.quantization!r}."
            )
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(
                f"attention_backend must be one of {', '.join(ATTENTION_BACKENDS)}; got "
                f"{self.attention_backend!r}."
            )
        for name in (
            "max_model_len",
            "max_num_batched_tokens",
            "kv_cache_tokens",
            "kv_cache_memory_bytes",
            "block_size",
        ):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}.")
        if self.packed_max_rows is not None and self.packed_max_rows < 0:
            raise ValueError(f"packed_max_rows must be >= 0, got {self.packed_max_rows}.")
        _check_queue_bounds(self.max_num_queued_reqs, self.max_num_queued_tokens)
        _check_queue_wait("max_queue_wait", self.max_queue_wait)
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(
                f"logprobs_mode must be one of {', '.join(LOGPROBS_MODES)}; got "
                f"{self.logprobs_mode!r}."
            )
        if self.max_logprobs < -1:
            raise ValueError(f"max_logprobs must be >= -1, got {self.max_logprobs}.")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}.")
        if self.kv_cache_tokens is not None and self.kv_cache_memory_bytes is not None:
            raise ValueError("Set kv_cache_tokens or kv_cache_memory_bytes, not both.")
        _check_scheduling(
            self.admission,
            self.watermark,
            self.preempt_victim,
            self.long_prefill_token_threshold or 0,
            self.scheduling_policy,
        )

    # ----------------------------------------------------------------------- command line

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser, skip: Sequence[str] = ()) -> None:
        """One flag per field (`--max-num-seqs` for max_num_seqs), typed by the field, with its
        default, choices and help; booleans take --x / --no-x. `skip` leaves fields out."""
        group = parser.add_argument_group("engine")
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if not f.metadata.get("cli", True) or f.name in skip:
                continue
            flags = ["--" + f.name.replace("_", "-")]
            if f.metadata["alias"]:
                flags.append(f.metadata["alias"])
            kind = _scalar_type(hints[f.name])
            choices = f.metadata["choices"]
            options: dict[str, Any] = {"default": f.default, "help": f.metadata["help"]}
            if kind is bool:
                options["action"] = argparse.BooleanOptionalAction
            else:
                options["type"] = f.metadata["parse"] or kind
                if choices is not None:
                    options["choices"] = list(choices() if callable(choices) else choices)
                if f.metadata["metavar"]:
                    options["metavar"] = f.metadata["metavar"]
                if f.metadata["nargs"]:
                    options["nargs"] = f.metadata["nargs"]
                if f.metadata["const"] is not None:
                    options["const"] = f.metadata["const"]
            group.add_argument(*flags, **options)

    @classmethod
    def from_cli_args(cls, ns: argparse.Namespace, **overrides: Any) -> EngineArgs:
        """The EngineArgs of parsed flags (fields without a flag keep their default)."""
        values = {
            f.name: getattr(ns, f.name) for f in dataclasses.fields(cls) if hasattr(ns, f.name)
        }
        return cls(**{**values, **overrides})

    # ----------------------------------------------------------------------- resolution

    def create_engine_config(
        self,
        platform: PlatformInfo,
        model_config: ModelConfig,
        model_path: str,
        weight_bytes: int = 0,
        *,
        tokenizer_path: str = "",
        generation_defaults: Mapping[str, Any] | None = None,
        hf_config_path: str = "",
        st_pooling: Mapping[str, Any] | None = None,
        draft_model_path: str = "",
        draft_model_config: ModelConfig | None = None,
    ) -> EngineConfig:
        """Every effective setting for this machine and model (whose weight files hold
        weight_bytes). `tokenizer_path`: the resolved --tokenizer ("": the model's);
        `hf_config_path`: the resolved --hf-config-path ("": the model's config.json);
        `generation_defaults`: the sampling defaults of a --generation-config folder (None:
        the model's own, model_config.sampling_defaults); `st_pooling`: what a
        sentence-transformers folder's modules.json says of its pooling (None: not one);
        `draft_model_path` / `draft_model_config`: speculative_config's draft model, resolved
        (method draft_model only).
        Raises ValueError naming the setting when the capacity asked for cannot hold what is
        asked of it, or when the runner, conversion or pooler asked for does not fit the
        model."""
        runner, convert, pooler = resolve_runner(
            self.runner, self.convert, self.pooler_config, model_config, st_pooling
        )
        block_types = model_config.weight_block_types
        if self.quantization not in (None, *CHECKPOINT_QUANTIZATIONS):
            block_types = (self.quantization.upper(),)
        dtype, weight_dtype, dtype_reason = resolve_dtype(self.dtype, platform, block_types)
        if self.packed_max_rows == 0:  # the float reference: weights in the compute dtype
            weight_dtype = None
        kv_cache_dtype = self.kv_cache_dtype
        if kv_cache_dtype == "auto":
            kv_cache_dtype = weight_dtype or dtype
        hybrid = bool(model_config.sliding_layers) and not self.disable_hybrid_kv_cache_manager
        layer_windows = [
            model_config.layer_window(i) if hybrid else 0
            for i in range(model_config.num_hidden_layers)
        ]
        group_windows, layer_groups = kv_cache_groups(layer_windows)
        group_layers = 1 + max(slot for _, slot in layer_groups)
        bytes_per_token = kv_cache_bytes_per_token(model_config, kv_cache_dtype, group_layers)
        speculative = resolve_speculative_config(self.speculative_config, platform.device_type)
        draft_bytes_per_token = 0
        if speculative is not None and speculative.drafts_by_model:
            if self.tensor_parallel_size > 1:
                raise ValueError(
                    "speculative_config: method draft_model with tensor_parallel_size > 1 is "
                    "not supported (the draft runs in the engine's process)."
                )
            check_draft_model(
                speculative, model_config, draft_model_config, len(group_windows), runner
            )
            assert draft_model_config is not None
            speculative = dataclasses.replace(speculative, model=draft_model_path)
            draft_bytes_per_token = kv_cache_bytes_per_token(draft_model_config, kv_cache_dtype)
        on_cpu = platform.device_type == "cpu"
        block_size = self.block_size or (
            DEFAULT_CPU_BLOCK_SIZE if on_cpu else DEFAULT_GPU_BLOCK_SIZE
        )
        num_blocks = self._num_kv_blocks(
            block_size,
            bytes_per_token,
            platform,
            kv_cache_bytes_per_token(model_config, kv_cache_dtype),
            weight_bytes,
            draft_bytes_per_token,
        )
        max_num_batched_tokens = self.max_num_batched_tokens or DEFAULT_MAX_NUM_BATCHED_TOKENS
        # The longest request the pool holds: with sliding groups, their windows' blocks beside
        # the full groups' whole contexts.
        capacity = num_blocks * block_size
        if any(group_windows):
            model_max = model_config.max_position_embeddings
            lengths = [*range(block_size, model_max, block_size), model_max]
            fitting = [
                n
                for n in lengths
                if request_blocks(group_windows, block_size, n, max_num_batched_tokens)
                <= num_blocks
            ]
            capacity = max(fitting, default=block_size)
        max_model_len = self._max_model_len(model_config, capacity)
        long_prefill = self.long_prefill_token_threshold
        if long_prefill is None:
            long_prefill = DEFAULT_CPU_LONG_PREFILL_TOKEN_THRESHOLD if on_cpu else 0
        names = self.served_model_name or [_default_name(self.model)]
        names = [names] if isinstance(names, str) else list(dict.fromkeys(names))
        return EngineConfig(
            model=model_path,
            served_model_name=names[0],
            served_model_names=tuple(names),
            max_logprobs=self.max_logprobs,
            logprobs_mode=self.logprobs_mode,
            reasoning_parser=self.reasoning_parser,
            dtype=dtype,
            dtype_reason=dtype_reason,
            weight_dtype=weight_dtype,
            device=platform.device,
            seed=self.seed,
            cache=CacheConfig(
                block_size=block_size,
                num_blocks=num_blocks,
                # An encoder's hidden states depend on the whole prompt: no prefix reuse.
                enable_prefix_caching=self.enable_prefix_caching and model_config.is_causal,
                bytes_per_token=bytes_per_token,
                draft_bytes_per_token=draft_bytes_per_token,
                dtype=kv_cache_dtype,
                group_windows=group_windows,
                layer_groups=layer_groups,
                kv_cache_metrics_sample=(
                    self.kv_cache_metrics_sample if self.kv_cache_metrics else 0.0
                ),
            ),
            scheduler=SchedulerConfig(
                max_num_seqs=self.max_num_seqs,
                max_num_batched_tokens=max_num_batched_tokens,
                long_prefill_token_threshold=long_prefill,
                max_model_len=max_model_len,
                admission=self.admission,
                watermark=self.watermark,
                preempt_victim=self.preempt_victim,
                scheduling_policy=self.scheduling_policy,
                max_num_queued_reqs=self.max_num_queued_reqs,
                max_num_queued_tokens=self.max_num_queued_tokens,
                max_queue_wait_s=self.max_queue_wait,
                enable_chunked_prefill=model_config.is_causal,
            ),
            backend=BackendConfig(
                attention_backend=self.attention_backend,
                cpu_kernels=self.cpu_kernels,
                packed_max_rows=self.packed_max_rows,
                huge_pages=self.huge_pages,
                # packed_max_rows=0 is the float reference: weights in the compute dtype.
                bf16_dequantized_gemm=(
                    on_cpu and bool(platform.native_bf16) and self.packed_max_rows != 0
                ),
            ),
            request_log=self.request_log,
            chat_template=load_chat_template(self.chat_template),
            quantization=self.quantization,
            tensor_parallel_size=self.tensor_parallel_size,
            distributed_executor_backend=(
                "mp"
                if self.distributed_executor_backend in (None, "uni")
                else self.distributed_executor_backend
            ),
            tokenizer=tokenizer_path,
            hf_config_path=hf_config_path,
            hf_overrides=dict(self.hf_overrides or {}),
            generation_config=self.generation_config,
            override_generation_config=dict(self.override_generation_config or {}),
            sampling_defaults=self._sampling_defaults(model_config, generation_defaults),
            enable_sleep_mode=self.enable_sleep_mode,
            profiler_config=resolve_profiler_config(self.profiler_config, os.environ),
            runner=runner,
            convert=convert,
            pooler=pooler,
            speculative=speculative,
        )

    def _sampling_defaults(
        self, model_config: ModelConfig, generation_defaults: Mapping[str, Any] | None
    ) -> dict[str, Any]:
        """vLLM's get_diff_sampling_param: the generation config's defaults (none under
        `vllm`), then the overrides key by key; an override of null drops that default."""
        if self.generation_config == "vllm":
            defaults: dict[str, Any] = {}
        elif generation_defaults is not None:
            defaults = dict(generation_defaults)
        else:
            defaults = dict(model_config.sampling_defaults)
        overrides = self.override_generation_config or {}
        for key, name in GENERATION_DEFAULT_FIELDS.items():
            if key in overrides:
                defaults[name] = overrides[key]
        return {name: value for name, value in sorted(defaults.items()) if value is not None}

    def _num_kv_blocks(
        self,
        block_size: int,
        bytes_per_token: int,
        platform: PlatformInfo,
        model_bytes_per_token: int,
        weight_bytes: int,
        draft_bytes_per_token: int = 0,
    ) -> int:
        """bytes_per_token: what a block holds per token (one KV cache group's layers);
        model_bytes_per_token: all layers' (kv_cache_tokens counts tokens of every layer, so
        with groups the pool has that memory in more, smaller blocks); draft_bytes_per_token:
        a draft model's, whose cache has a slot for every block's token (a memory budget
        pays for both; kv_cache_tokens counts the target's tokens, the draft's come on top)."""
        if self.kv_cache_tokens is not None:
            tokens_bytes = -(-self.kv_cache_tokens // block_size) * model_bytes_per_token
            return -(-tokens_bytes // bytes_per_token)
        block_bytes = (bytes_per_token + draft_bytes_per_token) * block_size
        # Data-parallel replicas share this machine's memory (and device): the default and
        # gpu_memory_utilization are split between them; an explicit capacity is each one's.
        replicas = self.data_parallel_size
        budget = self.kv_cache_memory_bytes or platform.default_kv_cache_bytes // replicas
        if self.gpu_memory_utilization is not None:
            share = int(self.gpu_memory_utilization * platform.total_memory_bytes) // replicas
            budget = share - weight_bytes
            if budget < block_bytes:
                raise ValueError(
                    f"gpu_memory_utilization={self.gpu_memory_utilization}: that share of the "
                    f"{platform.total_memory_bytes / 2**30:.1f} GiB of memory less the model's "
                    f"{weight_bytes / 2**30:.2f} GiB of weights leaves {max(budget, 0)} bytes, "
                    f"less than one KV block ({block_bytes} bytes); raise it or set "
                    "kv_cache_memory_bytes."
                )
        num_blocks = budget // block_bytes
        if num_blocks < 1:
            raise ValueError(
                f"kv_cache_memory_bytes={budget} is smaller than one block ({block_bytes} bytes)."
            )
        return num_blocks

    def _max_model_len(self, model_config: ModelConfig, capacity: int) -> int:
        model_max = model_config.max_position_embeddings
        if self.max_model_len is None:
            # Fit the model's context into the pool when the user left it to us.
            return min(model_max, capacity)
        if self.max_model_len > model_max:
            raise ValueError(
                f"max_model_len={self.max_model_len} exceeds the model's context length "
                f"{model_max}."
            )
        if self.max_model_len > capacity:
            raise ValueError(
                f"max_model_len={self.max_model_len} does not fit in the KV cache ({capacity} "
                "tokens): raise kv_cache_tokens / kv_cache_memory_bytes or lower max_model_len."
            )
        return self.max_model_len


class AsyncEngineArgs(EngineArgs):
    """vLLM's name for the settings of the async engine (AsyncLLMEngine.from_engine_args):
    EngineArgs' fields, meanings and defaults."""


def resolve_dtype(
    dtype: str, platform: PlatformInfo, weight_block_types: tuple[str, ...] = ()
) -> tuple[str, str | None, str]:
    """The compute dtype for `dtype` ("auto" or a name) here, the dtype of the float weight
    matrices where it differs (else None), and the reason, for the log. `weight_block_types`:
    the GGML block types the weights are in (a quantized GGUF's)."""
    if dtype != "auto":
        return dtype, None, f"dtype={dtype} was asked for"
    if platform.device_type == "cpu" and weight_block_types:
        # The block kernels take either; what differs is everything around the matmuls, where
        # the float32 layer ops are the CPU's fastest (a decode step of the embedded model on
        # a Zen 4 with AVX512-BF16: 13.3 ms in float32, 25.9 in bfloat16).
        return (
            "float32",
            None,
            (
                f"auto: the weights are in GGML block types ({', '.join(weight_block_types)}), "
                "computed on their blocks, with float32 activations"
            ),
        )
    if platform.device_type == "cuda":
        if platform.native_bf16:
            return "bfloat16", None, "auto: the GPU supports bfloat16"
        return "float16", None, "auto: the GPU lacks bfloat16, float16 instead"
    if platform.native_bf16:
        # The decode matmuls read bfloat16 weights either way (packed, exact) and the prompt
        # matmuls run bfloat16 GEMMs either way; float32 activations keep the one-call decode
        # layer and the float32 layer ops, the CPU's fastest (single stream on a Zen 4 with
        # AVX512-BF16: 11.3 ms a token against 16.9 in bfloat16), and the weights' and the
        # KV cache's bytes stay those of bfloat16.
        return (
            "float32",
            "bfloat16",
            (
                f"auto: the CPU has native bfloat16 ({platform.native_bf16}): bfloat16 weights and "
                "KV cache, float32 activations"
            ),
        )
    return "float32", None, "auto: the CPU has no native bfloat16 (no AVX512-BF16/AMX), so float32"


def kv_cache_bytes_per_token(
    model_config: ModelConfig, dtype: str, num_layers: int | None = None
) -> int:
    """Bytes one token's K and V take across all layers (or `num_layers` of them: one KV
    cache group's) in a cache of `dtype`."""
    per_layer = 2 * model_config.num_key_value_heads * model_config.head_dim * _DTYPE_BYTES[dtype]
    return (num_layers or model_config.num_hidden_layers) * per_layer


def kv_cache_groups(
    layer_windows: list[int],
) -> tuple[tuple[int, ...], tuple[tuple[int, int], ...]]:
    """(group windows, each layer's (group, tensor)) for layers of these windows (0: full),
    as vLLM's hybrid manager groups them: the layers of each kind, in order, cut into groups of
    as many layers as the smallest kind has (the last group of a kind may hold fewer), full
    groups first. Layer i of every group shares tensor i, so a block id stands for one group's
    tokens in those tensors and no memory sits idle. One kind: one group of every layer."""
    kinds: dict[int, list[int]] = {}
    for layer, window in enumerate(layer_windows):
        kinds.setdefault(window, []).append(layer)
    size = min(len(layers) for layers in kinds.values())
    windows: list[int] = []
    placement: dict[int, tuple[int, int]] = {}
    for window in sorted(kinds):
        layers = kinds[window]
        for start in range(0, len(layers), size):
            for slot, layer in enumerate(layers[start : start + size]):
                placement[layer] = (len(windows), slot)
            windows.append(window)
    return tuple(windows), tuple(placement[layer] for layer in range(len(layer_windows)))


def request_blocks(
    group_windows: tuple[int, ...], block_size: int, length: int, max_num_batched_tokens: int
) -> int:
    """The most blocks one request of `length` tokens holds across the groups: its whole
    context in a full group, at most a window and a chunk in a sliding one."""
    context = -(-length // block_size)
    return sum(
        min(context, sliding_window_blocks(w, block_size, max_num_batched_tokens)) if w else context
        for w in group_windows
    )


def capacity_line(
    cache: CacheConfig, max_model_len: int, max_num_batched_tokens: int | None = None
) -> str:
    """The start-up line users size deployments by."""
    mib = cache.num_tokens * cache.bytes_per_token / (1 << 20)
    fit = cache.num_tokens // max_model_len
    window = layers = ""
    if len(cache.group_windows) > 1:  # a block holds one group's layers
        layers = f" of {1 + max(slot for _, slot in cache.layer_groups)} layers"
    if any(cache.group_windows):
        chunk = max_num_batched_tokens or DEFAULT_MAX_NUM_BATCHED_TOKENS
        held = request_blocks(cache.group_windows, cache.block_size, max_model_len, chunk)
        fit = cache.num_blocks // held
        windows = sorted({w for w in cache.group_windows if w})
        groups = len(cache.group_windows)
        window = (
            f" ({groups} KV cache group{'s' if groups > 1 else ''}, sliding window "
            f"{', '.join(map(str, windows))}: each request holds at most {held} blocks, the "
            "blocks a window has left go back to the pool)"
        )
    draft = ""
    if cache.draft_bytes_per_token:
        draft_mib = cache.num_tokens * cache.draft_bytes_per_token / (1 << 20)
        draft = f", and the draft model's {draft_mib:.1f} MiB over the same blocks"
    return (
        f"KV cache: {cache.num_blocks} blocks x {cache.block_size} tokens{layers} = "
        f"{cache.num_tokens} tokens ({mib:.1f} MiB, {cache.dtype or 'no model'}{draft}); "
        f"{fit} requests of max_model_len ({max_model_len}) fit{window}"
    )


def weights_line(bytes_by_type: dict[str, int]) -> str:
    """The start-up line of what the weights take: 'weights: 98.1 MiB (Q4_1 70.0 MiB, ...)'."""
    total = sum(bytes_by_type.values())
    parts = ", ".join(f"{kind} {n / 2**20:.1f} MiB" for kind, n in bytes_by_type.items())
    return f"weights: {total / 2**20:.1f} MiB ({parts})"


def resolve_profiler_config(
    given: Mapping[str, Any] | None, environ: Mapping[str, str]
) -> dict[str, Any]:
    """The profiler's settings: `given` (vLLM's ProfilerConfig keys) over vLLM's defaults, or
    where nothing is given a torch profiler writing to `environ`'s VLLM_TORCH_PROFILER_DIR;
    {} when neither asks for a profiler. ValueError naming a key octavo does not take, a
    profiler other than torch, or a torch profiler without a folder."""
    if given is None:
        folder = environ.get(PROFILER_DIR_ENV, "")
        given = {"profiler": "torch", "torch_profiler_dir": folder} if folder else {}
    unknown = sorted(set(given) - set(PROFILER_CONFIG_DEFAULTS))
    if unknown:
        raise ValueError(
            f"profiler_config: {', '.join(unknown)} not supported (octavo takes "
            f"{', '.join(PROFILER_CONFIG_DEFAULTS)})."
        )
    settings = {**PROFILER_CONFIG_DEFAULTS, **given}
    if settings["profiler"] is None and settings["torch_profiler_dir"]:
        settings["profiler"] = "torch"  # a folder alone asks for the only profiler there is
    if settings["profiler"] is None:
        return {}
    if settings["profiler"] != "torch":
        raise ValueError(
            f"profiler_config: profiler must be 'torch' (octavo has no CUDA profiler hook); "
            f"got {settings['profiler']!r}."
        )
    if not settings["torch_profiler_dir"]:
        raise ValueError("profiler_config: the torch profiler needs a torch_profiler_dir.")
    settings["torch_profiler_dir"] = os.path.abspath(
        os.path.expanduser(str(settings["torch_profiler_dir"]))
    )
    return settings


def check_draft_model(
    speculative: SpeculativeConfig,
    model_config: ModelConfig,
    draft_config: ModelConfig | None,
    num_kv_groups: int,
    runner: str,
) -> None:
    """ValueError where a draft model cannot speculate for this model: its vocabulary differs
    (its tokens would not be the target's), the target keeps several KV cache groups (the
    draft's cache follows the one block table), or the model pools rather than generates."""
    name = speculative.model
    if draft_config is None:
        raise ValueError(f"speculative_config: the draft model {name!r} was not read.")
    if runner != "generate":
        raise ValueError("speculative_config: a pooling model generates no tokens to draft.")
    if draft_config.vocab_size != model_config.vocab_size:
        raise ValueError(
            f"speculative_config: the draft model {name!r} has a vocabulary of "
            f"{draft_config.vocab_size} tokens, the model {model_config.vocab_size}; a draft "
            "must share the model's tokenizer."
        )
    if num_kv_groups > 1:
        raise ValueError(
            "speculative_config: method draft_model with a model whose sliding-window layers "
            "keep their own KV cache groups is not supported; add "
            "--disable-hybrid-kv-cache-manager."
        )


def _merge_spec_flags(
    given: dict[str, Any] | None, method: str | None, model: str | None, tokens: int | None
) -> dict[str, Any] | None:
    """vLLM's --spec-method / --spec-model / --spec-tokens folded into speculative_config;
    ValueError where one repeats a key the JSON has."""
    for flag, key, value in (
        ("spec_method", "method", method),
        ("spec_model", "model", model),
        ("spec_tokens", "num_speculative_tokens", tokens),
    ):
        if value is None:
            continue
        given = {} if given is None else dict(given)
        if key in given:
            raise ValueError(f"{flag} and speculative_config's {key!r} are mutually exclusive.")
        given[key] = value
    return given


def _positive_int(given: Mapping[str, Any], key: str, default: int | None) -> int | None:
    value = given.get(key, default)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"speculative_config: {key} must be an integer >= 1, got {value!r}.")
    return value


def _rate(given: Mapping[str, Any], key: str, default: float, upper: float | None) -> float:
    value = given.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
        raise ValueError(f"speculative_config: {key} must be a number >= 0, got {value!r}.")
    if upper is not None and value > upper:
        raise ValueError(f"speculative_config: {key} must be <= {upper}, got {value!r}.")
    return float(value)


def resolve_speculative_config(
    given: Mapping[str, Any] | None, device_type: str = "cpu"
) -> SpeculativeConfig | None:
    """vLLM's speculative_config as octavo runs it on a device of device_type; None for none.
    ValueError naming the field for one octavo does not take (SPECULATIVE_FIELDS lists those
    it does), a method other than SPECULATIVE_METHODS, or a value out of range. Defaults are
    vLLM's (ngram looks up 5-grams; suffix proposes up to suffix_decoding_max_tree_depth
    tokens) but for disable_by_batch_size on a CPU: DEFAULT_DISABLE_BY_BATCH_SIZE."""
    if given is None:
        return None
    given = {str(key).replace("-", "_"): value for key, value in given.items()}
    unknown = sorted(set(given) - set(SPECULATIVE_FIELDS))
    if unknown:
        raise ValueError(
            f"speculative_config: {', '.join(unknown)} not supported (octavo takes "
            f"{', '.join(SPECULATIVE_FIELDS)})."
        )
    method, model = given.get("method"), given.get("model")
    if model in ("ngram", "[ngram]") and method in (None, "ngram", "[ngram]"):
        method, model = "ngram", None
    elif model is not None and method is None:
        method = "draft_model"  # vLLM's inference for a model that is neither EAGLE nor MTP
    if method == "[ngram]":
        method = "ngram"
    if method not in SPECULATIVE_METHODS:
        raise ValueError(
            f"speculative_config: method must be one of {', '.join(SPECULATIVE_METHODS)}; "
            f"got {method!r}."
        )
    if method == "draft_model":
        if not isinstance(model, str) or not model:
            raise ValueError("speculative_config: method draft_model needs the draft's model.")
    elif model is not None or given.get("quantization") is not None:
        key = "model" if model is not None else "quantization"
        raise ValueError(f"speculative_config: {key} is a draft model's; method is {method!r}.")
    if given.get("draft_tensor_parallel_size", 1) != 1:
        raise ValueError(
            "speculative_config: draft_tensor_parallel_size must be 1 (the draft runs whole in "
            f"the engine's process); got {given['draft_tensor_parallel_size']!r}."
        )
    if given.get("rejection_sample_method", "standard") != "standard":
        raise ValueError(
            "speculative_config: rejection_sample_method must be 'standard' (the exact "
            f"rejection sampler); got {given['rejection_sample_method']!r}."
        )
    depth = _positive_int(given, "suffix_decoding_max_tree_depth", 24)
    default_tokens = depth if method == "suffix" else None
    num_tokens = _positive_int(given, "num_speculative_tokens", default_tokens)
    if num_tokens is None:
        raise ValueError(f"speculative_config: num_speculative_tokens is required for {method}.")
    lookup_min = _positive_int(given, "prompt_lookup_min", None)
    lookup_max = _positive_int(given, "prompt_lookup_max", None)
    if lookup_min is None and lookup_max is None:
        lookup_min = lookup_max = 5 if method == "ngram" else 2
        if method == "suffix":
            lookup_max = depth
    lookup_min = lookup_min or lookup_max
    lookup_max = lookup_max or lookup_min
    if lookup_min > lookup_max:
        raise ValueError(
            f"speculative_config: prompt_lookup_min={lookup_min} must be <= "
            f"prompt_lookup_max={lookup_max}."
        )
    # Absent: the default measured on CPUs, vLLM's never elsewhere; null: never.
    batch_size_default = DEFAULT_DISABLE_BY_BATCH_SIZE if device_type == "cpu" else None
    disable_by_batch_size = _positive_int(given, "disable_by_batch_size", batch_size_default)
    cached = given.get("suffix_decoding_max_cached_requests", 10000)
    if isinstance(cached, bool) or not isinstance(cached, int) or cached < 0:
        raise ValueError(
            "speculative_config: suffix_decoding_max_cached_requests must be an integer "
            f">= 0, got {cached!r}."
        )
    spec_factor = _rate(given, "suffix_decoding_max_spec_factor", 1.0, None)
    if spec_factor <= 0:
        raise ValueError(
            f"speculative_config: suffix_decoding_max_spec_factor must be > 0, got {spec_factor}."
        )
    return SpeculativeConfig(
        method=method,
        num_speculative_tokens=num_tokens,
        prompt_lookup_min=lookup_min,
        prompt_lookup_max=lookup_max,
        disable_by_batch_size=disable_by_batch_size,
        min_acceptance_rate=_rate(given, "min_acceptance_rate", 0.1, 1.0),
        suffix_decoding_max_tree_depth=depth,
        suffix_decoding_max_cached_requests=cached,
        suffix_decoding_max_spec_factor=spec_factor,
        model=model,
        quantization=given.get("quantization"),
    )


def _default_name(model: str | None) -> str:
    if model is None:
        return "SmolLM2-135M-Instruct"
    return model.rstrip("/")


def _scalar_type(hint: Any) -> type:
    """int for `int | None`, and so on: the type a flag parses its value to."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    return args[0] if args else hint


def _reasoning_parsers() -> dict[str, Any]:
    from octavo.core.reasoning import REASONING_MARKERS

    return REASONING_MARKERS


def _admission_policies() -> dict[str, Any]:
    # core/admission.py imports this module, so its registry is read when asked for.
    from octavo.core.admission import ADMISSION_POLICIES

    return ADMISSION_POLICIES


def _victim_rules() -> dict[str, Any]:
    from octavo.core.admission import VICTIM_RULES

    return VICTIM_RULES


def _check_queue_bounds(*bounds: int | None) -> None:
    for name, bound in zip(("max_num_queued_reqs", "max_num_queued_tokens"), bounds, strict=True):
        if bound is not None and bound < 1:
            raise ValueError(f"{name} must be >= 1 (or unset: no bound), got {bound}.")


def _check_queue_wait(name: str, seconds: float | None) -> None:
    if seconds is not None and not seconds > 0:
        raise ValueError(f"{name} must be > 0 seconds (or unset: no bound), got {seconds}.")


def _check_scheduling(
    admission: str,
    watermark: float,
    preempt_victim: str | None,
    long_prefill_token_threshold: int,
    scheduling_policy: str = "fcfs",
) -> None:
    """The scheduler knobs EngineArgs and SchedulerConfig share, checked the same way."""
    if long_prefill_token_threshold < 0:
        raise ValueError(
            f"long_prefill_token_threshold must be >= 0, got {long_prefill_token_threshold}."
        )
    policies = _admission_policies()
    if admission not in policies:
        raise ValueError(f"admission must be one of {', '.join(policies)}; got {admission!r}.")
    if not 0.0 <= watermark < 1.0:
        raise ValueError(f"watermark must be in [0, 1), got {watermark}.")
    victims = _victim_rules()
    if preempt_victim is not None and preempt_victim not in victims:
        raise ValueError(
            f"preempt_victim must be one of {', '.join(victims)}; got {preempt_victim!r}."
        )
    if scheduling_policy not in SCHEDULING_POLICIES:
        raise ValueError(
            f"scheduling_policy must be one of {', '.join(SCHEDULING_POLICIES)}; got "
            f"{scheduling_policy!r}."
        )
    if scheduling_policy == "priority" and preempt_victim is not None:
        # Two rules for one choice: the priority policy's victim is the least important.
        raise ValueError(
            f"preempt_victim={preempt_victim!r} cannot be combined with "
            "scheduling_policy='priority', which evicts the running request of the largest "
            "(priority, arrival time)."
        )


def sampling_defaults_from(generation_config: Mapping[str, Any]) -> dict[str, Any]:
    """The sampling defaults a generation_config.json gives, by SamplingParams field name
    (GENERATION_DEFAULT_FIELDS; its other keys and unset values are no defaults)."""
    return {
        name: generation_config[key]
        for key, name in GENERATION_DEFAULT_FIELDS.items()
        if generation_config.get(key) is not None
    }


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


def check_pooler_config(pooler_config: Mapping[str, Any] | None) -> None:
    """ValueError naming a --pooler-config key octavo does not take (vLLM's removed
    `normalize` with vLLM's own words), or a bad value."""
    if pooler_config is None:
        return
    if "normalize" in pooler_config:
        raise ValueError(
            "pooler_config: Parameter `normalize` was removed; use `use_activation` instead."
        )
    for key, value in pooler_config.items():
        if key in POOLER_CONFIG_REFUSED:
            if value not in POOLER_CONFIG_REFUSED[key]:
                raise ValueError(
                    f"pooler_config: {key}={value!r} is not supported (octavo pools sequences "
                    "for the embed task only)."
                )
        elif key not in POOLER_CONFIG_KEYS:
            raise ValueError(
                f"pooler_config: unknown key {key!r} (octavo takes "
                f"{', '.join(POOLER_CONFIG_KEYS)})."
            )
    if "pooling_type" in pooler_config and "seq_pooling_type" in pooler_config:
        raise ValueError("pooler_config: Cannot set both `pooling_type` and `seq_pooling_type`.")
    kind = pooler_config.get("pooling_type", pooler_config.get("seq_pooling_type"))
    if kind is not None and kind not in POOLING_TYPES:
        raise ValueError(
            f"pooler_config: pooling_type must be one of {', '.join(POOLING_TYPES)}; got "
            f"{kind!r} (vLLM's token pooling ALL and STEP are not implemented)."
        )
    use_activation = pooler_config.get("use_activation")
    if use_activation is not None and not isinstance(use_activation, bool):
        raise ValueError(
            f"pooler_config: use_activation must be a boolean, got {use_activation!r}."
        )
    dimensions = pooler_config.get("dimensions")
    if dimensions is not None and (not isinstance(dimensions, int) or dimensions < 1):
        raise ValueError(
            f"pooler_config: dimensions must be a positive integer, got {dimensions!r}."
        )


def resolve_runner(
    runner: str,
    convert: str,
    pooler_config: Mapping[str, Any] | None,
    model_config: ModelConfig,
    st_pooling: Mapping[str, Any] | None,
) -> tuple[str, str, PoolerConfig | None]:
    """vLLM's resolution of --runner and --convert auto, and of the pooler: (runner, convert,
    pooler). A sentence-transformers folder, an architecture that is a pooling model (its
    ArchSpec's default pooling type: BertModel, Qwen3Model, ...) or a --convert other than
    none makes `auto` a pooling runner; a causal LM is converted to an embedder (`embed`).
    The pooler's fields: --pooler-config's, else the sentence-transformers folder's (its
    Pooling module's mode, and whether a Normalize module follows), else the architecture's
    default (LAST; CLS for BERT), normalized. Raises ValueError naming the setting."""
    native = model_config.default_pooling_type
    if runner == "auto":
        pooling = st_pooling is not None or native is not None or convert not in ("auto", "none")
        runner = "pooling" if pooling else "generate"
    if runner == "generate":
        if convert not in ("auto", "none"):
            raise ValueError(f"convert={convert!r} needs runner='pooling'.")
        if native is not None:
            raise ValueError(
                f"{model_config.architecture} has no language-model head: it runs as a pooling "
                "model (runner='pooling', the default for it)."
            )
        if pooler_config is not None:
            raise ValueError("pooler_config applies to runner='pooling' only.")
        return "generate", "none", None
    if convert == "auto":
        convert = "none" if native is not None else "embed"
    elif convert == "none" and native is None:
        raise ValueError(
            f"{model_config.architecture} is a generation model: runner='pooling' needs "
            "convert='embed' (or auto) to run it as an embedder."
        )
    given = dict(pooler_config or {})
    if "seq_pooling_type" in given:
        given["pooling_type"] = given.pop("seq_pooling_type")
    fields: dict[str, Any] = {"pooling_type": native or "LAST", "source": "model_default"}
    for source, values in (("sentence_transformers", st_pooling or {}), ("user", given)):
        for key in ("pooling_type", "use_activation", "dimensions"):
            if values.get(key) is not None:
                fields[key] = values[key]
                if key == "pooling_type":
                    fields["source"] = source
    if fields["pooling_type"] not in POOLING_TYPES:
        raise ValueError(
            f"the model's sentence-transformers pooling {fields['pooling_type']!r} is not "
            f"supported (octavo pools {', '.join(POOLING_TYPES)}); set pooler_config."
        )
    return (
        "pooling",
        convert,
        PoolerConfig(
            **fields,
            embedding_size=model_config.hidden_size,
            is_matryoshka=model_config.is_matryoshka,
            matryoshka_dimensions=model_config.matryoshka_dimensions,
        ),
    )
