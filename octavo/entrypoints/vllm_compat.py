"""vLLM's `vllm serve` flags and `LLM(...)` keywords, each held to one disposition here.

A launch script or program written for vLLM must start octavo unchanged. `vllm_flags.json`
lists every flag of `vllm serve` (vLLM 0.32, written by benchmarks/vllm_flags.py from vLLM's
own parser). Each is one of:

- **octavo's**: octavo's parser has the flag, with vLLM's meaning (config.py, cli.py);
- **accepted at some values**: the values that describe what octavo does anyway (a parallel
  size of 1, chunked prefill on) are taken silently, any other is refused (below);
- **no effect**: accepted, and one start-up log line says why it changes nothing here (a CUDA
  graph size on a CPU, a multimodal limit for a text-only model);
- **refused**: start-up stops with a message naming the flag and the issue that will add it.

`DISPOSITIONS` holds the last three by the flag's argparse dest (vLLM's EngineArgs field, the
same name `LLM(...)` takes as a keyword); a flag of a vLLM config group not named there takes
its group's default in `GROUP_DEFAULTS`. tests/test_vllm_compat.py holds every flag of the
file to exactly one disposition.
"""

from __future__ import annotations

import argparse
import functools
import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

VLLM_FLAGS_FILE = Path(__file__).with_name("vllm_flags.json")

NO_EFFECT = "no effect"
REFUSED = "refused"

# The issues that will add what a refused flag asks for.
SCALE_OUT = (
    "not in octavo's process layout (one API server; engine cores with data and tensor "
    "parallelism, on one machine or over Ray), and no issue plans it yet"
)
API = "issue 28 (the rest of vLLM's serving API)"
NOT_PLANNED = "not implemented, and no issue plans it yet"


@dataclass(frozen=True)
class Disposition:
    kind: str  # NO_EFFECT or REFUSED
    reason: str
    # For a flag taken at some values only: those (what octavo does anyway) pass without a
    # word; any other is refused with `reason`. None: every value gets `kind`.
    accepts: Callable[[Any], bool] | None = None

    def verdict(self, value: Any) -> tuple[str, str] | None:
        """(kind, reason) for a given value; None where it passes silently."""
        if self.accepts is not None:
            return None if self.accepts(value) else (REFUSED, self.reason)
        return self.kind, self.reason


def _no(reason: str) -> Disposition:
    return Disposition(NO_EFFECT, reason)


def _refused(reason: str) -> Disposition:
    return Disposition(REFUSED, reason)


def _only(accepts: Callable[[Any], bool], reason: str) -> Disposition:
    return Disposition(REFUSED, reason, accepts)


def _is_one(value: Any) -> bool:
    return value is None or str(value) == "1"


def _is_zero(value: Any) -> bool:
    return value is None or str(value) in ("0", "0.0")


def _is_in(*allowed: str) -> Callable[[Any], bool]:
    return lambda value: value is None or str(value) in allowed


def _is_false(value: Any) -> bool:
    return value in (None, False)


def _is_true(value: Any) -> bool:
    return value in (None, True)


CPU_ONLY = "octavo's CPU path has no CUDA graphs, NCCL or custom GPU kernels to configure"
TEXT_ONLY = "octavo serves text-only models; multimodal inputs are not supported"
ONE_PROCESS = "octavo runs one engine in one process; this configures a multi-process run"
MAMBA = "no Mamba / state-space architecture is supported"
KERNELS = (
    "octavo picks its kernels at start-up by CPU feature and by timing them (the start-up "
    "configuration says which)"
)
OFFLOAD = "on a CPU the weights already live in host memory; there is nothing to offload"
LORA_ONLY = "configures LoRA adapters, which need --enable-lora (" + NOT_PLANNED + ")"
SEVERAL_MACHINES = (
    "octavo's mp ranks run on one machine; --distributed-executor-backend ray spans machines "
    "(or torchrun with external_launcher)"
)
NUMA = "octavo runs one process on the CPUs it is given; bind it with numactl or taskset"
METRICS = (
    "octavo exports its metrics at /metrics; this vLLM tracing or metric option has no equivalent"
)

# Flags of a vLLM config group not named in DISPOSITIONS.
GROUP_DEFAULTS: dict[str, Disposition] = {
    "MultiModalConfig": _no(TEXT_ONLY),
    "CompilationConfig": _no(CPU_ONLY),
    "KernelConfig": _no(KERNELS),
    "MambaConfig": _no(MAMBA),
    "LoRAConfig": _no(LORA_ONLY),
    "OffloadConfig": _no(OFFLOAD),
    "ParallelConfig": _no(ONE_PROCESS + " (" + SCALE_OUT + ")"),
    "ObservabilityConfig": _no(METRICS),
}

DISPOSITIONS: dict[str, Disposition] = {
    # --- parallelism beyond -dp and -tp (their flags are octavo's own)
    "pipeline_parallel_size": _only(_is_one, "pipeline parallelism: " + SCALE_OUT),
    "data_parallel_size_local": _only(_is_one, "data parallelism: " + SCALE_OUT),
    "decode_context_parallel_size": _only(_is_one, "context parallelism: " + NOT_PLANNED),
    "prefill_context_parallel_size": _only(_is_one, "context parallelism: " + NOT_PLANNED),
    "nnodes": _only(_is_one, "several machines: " + SEVERAL_MACHINES),
    "node_rank": _only(_is_zero, "several machines: " + SEVERAL_MACHINES),
    "data_parallel_rank": _only(_is_zero, "data parallelism: " + SCALE_OUT),
    "data_parallel_start_rank": _only(_is_zero, "data parallelism: " + SCALE_OUT),
    "api_server_count": _only(_is_one, "several API server processes: " + SCALE_OUT),
    "headless": _only(_is_false, "a headless engine without its API server: " + SCALE_OUT),
    "grpc": _only(_is_false, "the gRPC front end: " + NOT_PLANNED),
    "worker_cls": _refused("custom worker classes: octavo's worker is its own"),
    "worker_extension_cls": _refused("custom worker classes: octavo's worker is its own"),
    "enable_expert_parallel": _no(
        "experts are split over ranks only under data or tensor parallelism (" + SCALE_OUT + ")"
    ),
    # --- memory and cache
    "num_gpu_blocks_override": _refused(
        "set the KV capacity with --kv-cache-tokens (blocks are --block-size tokens each)"
    ),
    "prefix_caching_hash_algo": _no(
        "octavo's prefix cache keys blocks by its own hash of their token ids"
    ),
    "prefix_cache_retention_interval": _no("octavo keeps cached blocks until the pool needs them"),
    "kv_cache_dtype_skip_layers": _refused(
        "a per-layer KV cache dtype: octavo's cache has one dtype (" + NOT_PLANNED + ")"
    ),
    "kv_sharing_fast_prefill": _no("no architecture octavo serves shares KV across layers"),
    "swa_bounded_replay": _no(
        "octavo's hybrid KV cache manager frees the blocks a sliding window has left on its own"
    ),
    "prefix_match_unit": _no("prefix hits are whole KV blocks (--block-size)"),
    "kv_offloading_size": _refused("KV offloading: " + NOT_PLANNED),
    "kv_offloading_backend": _refused("KV offloading: " + NOT_PLANNED),
    "cpu_offload_gb": _no(OFFLOAD),
    **{
        name: _no(MAMBA)
        for name in (
            "mamba_cache_dtype",
            "mamba_ssm_cache_dtype",
            "mamba_block_size",
            "mamba_cache_mode",
            "enable_mamba_shared_prefix_checkpoint",
            "replayssm_buffer_len",
            "use_replayssm",
        )
    },
    # --- scheduler
    "enable_chunked_prefill": _only(
        _is_true, "chunked prefill is always on, as in vLLM's V1 engine; it cannot be turned off"
    ),
    "max_num_scheduled_tokens": _refused(
        "octavo's token budget per step is --max-num-batched-tokens"
    ),
    "max_num_active_seqs": _refused("octavo's limit on running requests is --max-num-seqs"),
    "long_prefill_token_threshold_adaptive": _no(
        "octavo's --long-prefill-token-threshold is fixed"
    ),
    "disable_chunked_mm_input": _no(TEXT_ONLY),
    "scheduler_cls": _refused("custom scheduler classes: octavo's scheduler is its own"),
    "scheduler_reserve_full_isl": _no(
        "octavo's admission rule is chosen with --admission (reserve: prompt + max_tokens)"
    ),
    "prefill_schedule_interval": _no("octavo schedules prompt chunks every step"),
    "async_scheduling": _no(
        "octavo's engine overlaps the next step's scheduling with nothing yet; every step is "
        "scheduled after the last one's outputs"
    ),
    "stream_interval": _no("octavo streams every token as it is sampled"),
    # --- model
    "tokenizer_mode": _no(
        "octavo reads the model's tokenizer.json (or the GGUF's vocabulary) with the tokenizers "
        "library"
    ),
    "trust_remote_code": _no(
        "octavo runs no code from a checkpoint: every architecture it serves is its own"
    ),
    "allowed_local_media_path": _no(TEXT_ONLY),
    "allowed_media_domains": _no(TEXT_ONLY),
    "code_revision": _no("octavo runs no code from a checkpoint"),
    "quantization_config": _refused("octavo quantizes with --quantization TYPE (GGML block types)"),
    "allow_deprecated_quantization": _no("octavo's --quantization types are all current"),
    "enforce_eager": _no("octavo has no CUDA graphs or compiled graphs: it always runs eagerly"),
    "enable_return_routed_experts": _refused("returning routed experts: " + NOT_PLANNED),
    "return_sampling_mask": _refused("returning the sampling mask: " + NOT_PLANNED),
    "use_fp64_gumbel": _no("octavo's sampler draws with its own float32 inverse-CDF kernel"),
    "enable_trace_replay": _no(METRICS),
    "disable_sliding_window": _refused(
        "--disable-hybrid-kv-cache-manager keeps every block of a sliding-window model; "
        "attention itself keeps the model's window"
    ),
    "disable_cascade_attn": _no(CPU_ONLY),
    "skip_tokenizer_init": _refused("token-id-only serving: " + API),
    "enable_prompt_embeds": _refused("prompt embeddings as input: " + API),
    "config_format": _no("octavo reads config.json or the GGUF's metadata, whichever is given"),
    "model_class_overrides": _refused("model class overrides: octavo's models are its own"),
    "sleep_mode_offload_cudagraph": _no(CPU_ONLY),
    "sleep_preserve_parameter_names": _no(
        "octavo's level 2 sleep reloads the model from its files, parameter names and all"
    ),
    "enable_cumem_allocator": _no(CPU_ONLY),
    "enable_nccl_comm_suspend": _no(CPU_ONLY),
    "model_impl": _only(
        _is_in("auto", "vllm"), "transformers' own modelling code: octavo's models are its own"
    ),
    "logits_processors": _refused("custom logits processors: " + NOT_PLANNED),
    "io_processor_plugin": _refused("IO processor plugins: " + NOT_PLANNED),
    "renderer_num_workers": _no(
        "octavo renders and tokenizes requests in its own pool of preparation threads"
    ),
    # --- loading
    "load_format": _only(
        _is_in("auto", "safetensors", "pt", "gguf"),
        "octavo loads safetensors or PyTorch .bin folders and GGUF files (auto picks by what "
        "the path holds)",
    ),
    "safetensors_load_strategy": _no("octavo maps safetensors files and copies what it keeps"),
    "safetensors_prefetch_num_threads": _no("octavo maps safetensors files, no prefetch"),
    "safetensors_prefetch_block_size": _no("octavo maps safetensors files, no prefetch"),
    "model_loader_extra_config": _no("octavo's loader takes no extra configuration"),
    "ignore_patterns": _no("octavo reads only the weight files it needs"),
    "use_tqdm_on_load": _no("octavo logs its load time instead of a progress bar"),
    "pt_load_map_location": _no("weights load onto the engine's device"),
    # --- logging
    "logging_config": _no("octavo logs through Python's logging; configure its root logger"),
    "log_level": _no("octavo logs at INFO"),
    "log_config_file": _no("octavo logs through Python's logging; configure its root logger"),
    "disable_log_stats": _no("octavo logs no periodic stats lines; /metrics has them all"),
    "aggregate_engine_logging": _no(ONE_PROCESS),
    "enable_log_requests": _no("octavo's per-request log is --request-log PATH (JSON lines)"),
    "max_log_len": _no("octavo's request log holds lengths, never prompts"),
    "enable_log_outputs": _no("octavo's request log holds lengths, never outputs"),
    "enable_log_deltas": _no("octavo's request log holds lengths, never outputs"),
    "fail_on_environ_validation": _no(
        "octavo reads only VLLM_SERVER_DEV_MODE and VLLM_TORCH_PROFILER_DIR of vLLM's "
        "environment variables"
    ),
    "gdn_prefill_backend": _no(KERNELS),
    "kda_prefill_backend": _no(KERNELS),
    "kda_decode_backend": _no(KERNELS),
    # --- structured outputs, speculative decoding and other engine configs
    "reasoning_parser_plugin": _refused(
        "reasoning parser plugins: octavo runs no plugin code; --reasoning-parser takes "
        "qwen3 or deepseek_r1"
    ),
    "watermark_config": _refused("output watermarking: " + NOT_PLANNED),
    "diffusion_config": _refused("diffusion models: " + NOT_PLANNED),
    "kv_transfer_config": _refused("KV transfer between instances: " + NOT_PLANNED),
    "kv_events_config": _refused("KV cache events: " + NOT_PLANNED),
    "ec_transfer_config": _refused("encoder cache transfer: " + NOT_PLANNED),
    "ec_manager_config": _no(TEXT_ONLY),
    "compilation_config": _no(CPU_ONLY),
    "attention_config": _no(
        "octavo's attention implementation is --attention-backend; the rest of vLLM's attention "
        "options configure GPU kernels"
    ),
    "engram_config": _refused("engram: " + NOT_PLANNED),
    "reasoning_config": _refused("reasoning output: " + API),
    "kernel_config": _no(KERNELS),
    "additional_config": _no("octavo has no platform plugins to pass it to"),
    "structured_outputs_config": _no(
        "octavo's structured outputs always use llguidance (vLLM's `guidance` backend)"
    ),
    "aux_output_config": _refused("auxiliary outputs: " + NOT_PLANNED),
    "optimization_level": _no(CPU_ONLY),
    "performance_mode": _no(
        "octavo's throughput and latency knobs are --max-num-batched-tokens and "
        "--long-prefill-token-threshold"
    ),
    "weight_transfer_config": _refused("weight transfer for RL training: " + NOT_PLANNED),
    # --- LoRA
    "enable_lora": _only(_is_false, "LoRA adapters: " + NOT_PLANNED),
    "lora_modules": _refused("LoRA adapters: " + NOT_PLANNED),
    # --- front end
    "chat_template_content_format": _no(
        "octavo passes message content to the chat template as the template expects it "
        "(strings for text-only templates)"
    ),
    "trust_request_mm_kwargs": _no(TEXT_ONLY),
    "tool_parser_plugin": _refused("tool parser plugins: " + NOT_PLANNED),
    "tool_strict_level": _no("octavo checks tool calls against their schema as it parses them"),
    "tool_server": _refused("built-in tool servers (the Responses API): " + API),
    "enable_prompt_tokens_details": _no(
        "octavo always reports cached prompt tokens in usage.prompt_tokens_details"
    ),
    "enable_per_request_metrics": _no(METRICS),
    "enable_server_load_tracking": _no(METRICS),
    "sse_keep_alive_interval": _no("octavo's streams send each token as it comes"),
    "cohere_is_reasoning_model": _refused("the Cohere API: " + NOT_PLANNED),
    "cohere_format": _refused("the Cohere API: " + NOT_PLANNED),
    "anthropic_disabled_thinking_effort": _no(
        "applies to the Anthropic Messages API (" + API + ")"
    ),
    "log_error_stack": _no("octavo logs every internal error with its stack"),
    "tokens_only": _refused("token-id-only serving: " + API),
    "enable_scale_out": _refused(SCALE_OUT),
    "fingerprint_mode": _no("octavo's responses carry no system fingerprint"),
    "fingerprint_value": _no("octavo's responses carry no system fingerprint"),
    "grpc_port": _no("applies to the gRPC front end only"),
    "data_parallel_supervisor_port": _no(ONE_PROCESS),
    "dp_supervisor_probe_interval_s": _no(ONE_PROCESS),
    "dp_supervisor_probe_timeout_s": _no(ONE_PROCESS),
    "dp_supervisor_probe_failure_threshold": _no(ONE_PROCESS),
    "middleware": _refused("ASGI middleware by import path: " + NOT_PLANNED),
    "h11_max_incomplete_event_size": _no(
        "octavo bounds request heads by time (--header-read-timeout) and bodies by "
        "--max-request-body-bytes"
    ),
    "h11_max_header_count": _no("octavo bounds request heads by time (--header-read-timeout)"),
    "enable_offline_docs": _no("octavo's /docs page loads its scripts from FastAPI's default CDN"),
    "enable_flash_late_interaction": _no(CPU_ONLY),
    "numa_bind": _no(NUMA),
    "numa_bind_nodes": _no(NUMA),
    "numa_bind_cpus": _no(NUMA),
    "device_ids": _no("octavo's device is --device"),
}


@functools.cache
def _flags_file() -> dict[str, Any]:
    return json.loads(VLLM_FLAGS_FILE.read_text())


def vllm_flags() -> tuple[dict[str, Any], ...]:
    """The flags of `vllm serve`, as vllm_flags.json lists them."""
    return tuple(_flags_file()["flags"])


def vllm_version() -> str:
    return _flags_file()["vllm_version"]


@functools.cache
def _flags_by_dest() -> dict[str, dict[str, Any]]:
    return {flag["dest"]: flag for flag in vllm_flags()}


def disposition(flag: dict[str, Any]) -> Disposition | None:
    """A vLLM flag's disposition; None where neither the table nor its group has one."""
    return DISPOSITIONS.get(flag["dest"]) or GROUP_DEFAULTS.get(flag["group"])


# The prefix of the dests the added flags parse into (never one of octavo's own).
_DEST_PREFIX = "vllm_compat__"


def add_vllm_flags(parser: argparse.ArgumentParser) -> None:
    """Add to `parser` every vLLM flag it does not have (as vLLM takes it: a value, several, or
    none), hidden from --help, parsed into a dest of its own only when given. Call after
    octavo's own flags are added."""
    own = {option for action in parser._actions for option in action.option_strings}
    for flag in vllm_flags():
        if any(option in own for option in flag["options"]):
            continue
        options: dict[str, Any] = {
            "dest": _DEST_PREFIX + flag["dest"],
            "default": argparse.SUPPRESS,
            "help": argparse.SUPPRESS,
        }
        if flag["nargs"] == 0:
            negative = [o for o in flag["options"] if o.startswith("--no-")]
            parser.add_argument(
                *[o for o in flag["options"] if o not in negative],
                action="store_true",
                **options,
            )
            if negative:
                parser.add_argument(*negative, action="store_false", **options)
        else:
            if flag["nargs"] is not None:
                options["nargs"] = flag["nargs"]
            parser.add_argument(*flag["options"], **options)


class VllmFlagRefused(ValueError):
    pass


def check_given(given: Iterable[tuple[str, str, Any]]) -> list[str]:
    """(dest, how the user spelled it, value) of each vLLM setting given that octavo does not
    implement: raises VllmFlagRefused naming every refused one; returns the log lines of the
    ones without effect."""
    notes, refused = [], []
    for dest, spelled, value in given:
        flag = _flags_by_dest()[dest]
        verdict = disposition(flag)
        outcome = verdict.verdict(value) if verdict is not None else (REFUSED, NOT_PLANNED)
        if outcome is None:
            continue
        kind, reason = outcome
        if value is False:  # a boolean flag's negative spelling
            spelled = next((o for o in flag["options"] if o.startswith("--no-")), spelled)
        shown = (
            spelled if isinstance(value, bool) or value is None else f"{spelled} {_shown(value)}"
        )
        if kind == REFUSED:
            refused.append(f"{shown}: not supported ({reason})")
        else:
            notes.append(f"{shown} has no effect here: {reason}")
    if refused:
        raise VllmFlagRefused("; ".join(refused))
    return notes


def _shown(value: Any) -> str:
    return " ".join(map(str, value)) if isinstance(value, list) else str(value)


def check_namespace(ns: argparse.Namespace) -> list[str]:
    """check_given for the vLLM flags add_vllm_flags parsed into `ns`."""
    given = []
    for name, value in vars(ns).items():
        if name.startswith(_DEST_PREFIX):
            dest = name[len(_DEST_PREFIX) :]
            given.append((dest, _flags_by_dest()[dest]["options"][0], value))
    return check_given(given)


def check_keywords(kwargs: dict[str, Any]) -> list[str]:
    """check_given for `LLM(...)` keywords that are vLLM EngineArgs fields (its flags' dests)
    and not octavo's; raises TypeError for a keyword neither knows."""
    unknown = sorted(name for name in kwargs if name not in _flags_by_dest())
    if unknown:
        raise TypeError(f"LLM() got unexpected keyword arguments: {', '.join(unknown)}")
    return check_given((name, name, value) for name, value in kwargs.items())
