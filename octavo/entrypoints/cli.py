"""`octavo serve|generate|chat|bench|plan`: parse flags -> EngineArgs -> run. Flag names follow
vLLM."""

from __future__ import annotations

import argparse
import logging
import sys

from octavo.config import ADMISSION_POLICIES, DTYPES, PREEMPT_VICTIMS, EngineArgs


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    defaults = EngineArgs()
    group = parser.add_argument_group("engine")
    group.add_argument(
        "--model",
        default=None,
        help="HF folder or .gguf file (default: the embedded SmolLM2-135M-Instruct)",
    )
    group.add_argument("--dtype", default=defaults.dtype, choices=list(DTYPES))
    group.add_argument(
        "--kv-cache-dtype",
        default=defaults.kv_cache_dtype,
        choices=list(DTYPES),
        help="dtype of the KV cache (auto: the compute dtype); bfloat16 with "
        "float32 compute halves each token's bytes",
    )
    group.add_argument("--max-model-len", type=int, default=None)
    group.add_argument("--max-num-seqs", type=int, default=defaults.max_num_seqs)
    group.add_argument("--max-num-batched-tokens", type=int, default=None)
    group.add_argument(
        "--long-prefill-token-threshold",
        type=int,
        default=None,
        help="at most this many prompt tokens of one request per step (0: no cap; default: "
        "256 on a CPU, no cap elsewhere)",
    )
    group.add_argument("--kv-cache-tokens", type=int, default=None)
    group.add_argument("--kv-cache-memory-bytes", type=int, default=None)
    group.add_argument(
        "--block-size",
        type=int,
        default=defaults.block_size,
        help="tokens per KV cache block (default: 128 on a CPU, 16 elsewhere)",
    )
    group.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=defaults.enable_prefix_caching,
    )
    group.add_argument("--seed", type=int, default=defaults.seed)
    group.add_argument("--device", default=defaults.device)
    group.add_argument(
        "--admission",
        default=defaults.admission,
        choices=list(ADMISSION_POLICIES),
        help="what must be free before a request starts: current (vLLM: the next "
        "chunk), reserve (TGI: prompt + max_tokens, never evicts), ratio "
        "(SGLang: an adaptive share of max_tokens)",
    )
    group.add_argument(
        "--watermark",
        type=float,
        default=defaults.watermark,
        help="share of the KV pool kept free when a request is admitted",
    )
    group.add_argument(
        "--preempt-victim",
        default=defaults.preempt_victim,
        choices=list(PREEMPT_VICTIMS),
        help="whom to evict when a block is missing (default: the policy's)",
    )
    group.add_argument(
        "--request-log",
        default=defaults.request_log,
        metavar="PATH",
        help="append one JSON line per finished request (lengths, finish "
        "reason, TTFT, largest token gap, evictions) to PATH",
    )
    group.add_argument(
        "--chat-template",
        default=None,
        metavar="PATH_OR_TEMPLATE",
        help="Jinja chat template (a file, or the template text) that replaces the model's own",
    )


def engine_args_from(ns: argparse.Namespace) -> EngineArgs:
    return EngineArgs(
        model=ns.model,
        dtype=ns.dtype,
        kv_cache_dtype=ns.kv_cache_dtype,
        max_model_len=ns.max_model_len,
        max_num_seqs=ns.max_num_seqs,
        max_num_batched_tokens=ns.max_num_batched_tokens,
        long_prefill_token_threshold=ns.long_prefill_token_threshold,
        kv_cache_tokens=ns.kv_cache_tokens,
        kv_cache_memory_bytes=ns.kv_cache_memory_bytes,
        block_size=ns.block_size,
        enable_prefix_caching=ns.enable_prefix_caching,
        seed=ns.seed,
        device=ns.device,
        admission=ns.admission,
        watermark=ns.watermark,
        preempt_victim=ns.preempt_victim,
        request_log=ns.request_log,
        chat_template=ns.chat_template,
    )


def add_server_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "model_tag",
        nargs="?",
        default=None,
        metavar="MODEL",
        help="model to serve (same as --model)",
    )
    group = parser.add_argument_group("server")
    group.add_argument("--host", default="127.0.0.1")
    group.add_argument("--port", type=int, default=8000)
    group.add_argument(
        "--served-model-name",
        default=None,
        help="the name clients use in `model` (default: from the model)",
    )
    group.add_argument(
        "--api-key",
        default=None,
        help="require `Authorization: Bearer KEY` on every path but /health",
    )
    group.add_argument(
        "--allowed-origins",
        default=None,
        help="CORS origins, a JSON list or comma-separated (e.g. '[\"*\"]'); "
        "CORS is off by default",
    )
    # Checked by ServerConfig (importing the parser registry here would load the server).
    group.add_argument(
        "--tool-call-parser",
        default=None,
        metavar="NAME",
        help="how tool calls are read from the model's text (hermes: "
        "<tool_call>{json}</tool_call>, Hermes and Qwen models)",
    )
    group.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help='allow tool_choice "auto" (the default when a request has tools); '
        "needs --tool-call-parser",
    )


def server_config_from(ns: argparse.Namespace):
    import json

    from octavo.entrypoints.server.app import ServerConfig

    origins: tuple[str, ...] = ()
    if ns.allowed_origins:
        text = ns.allowed_origins.strip()
        values = json.loads(text) if text.startswith("[") else text.split(",")
        origins = tuple(str(v).strip() for v in values if str(v).strip())
    return ServerConfig(
        host=ns.host,
        port=ns.port,
        api_key=ns.api_key,
        allowed_origins=origins,
        tool_call_parser=ns.tool_call_parser,
        enable_auto_tool_choice=ns.enable_auto_tool_choice,
    )


def add_sampling_args(parser: argparse.ArgumentParser, max_tokens: int) -> None:
    group = parser.add_argument_group("sampling")
    group.add_argument("--max-tokens", type=int, default=max_tokens)
    group.add_argument("--temperature", type=float, default=0.0)
    group.add_argument("--top-p", type=float, default=1.0)
    group.add_argument("--top-k", type=int, default=0)
    group.add_argument("--min-p", type=float, default=0.0)
    group.add_argument("--repetition-penalty", type=float, default=1.0)
    group.add_argument("--sampling-seed", type=int, default=None)
    group.add_argument("--stop", action="append", default=None)


def sampling_params_from(ns: argparse.Namespace):
    from octavo.core.sampling_params import SamplingParams

    return SamplingParams(
        max_tokens=ns.max_tokens,
        temperature=ns.temperature,
        top_p=ns.top_p,
        top_k=ns.top_k,
        min_p=ns.min_p,
        repetition_penalty=ns.repetition_penalty,
        seed=ns.sampling_seed,
        stop=ns.stop,
    )


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="octavo", description="LLM inference and serving")
    commands = parser.add_subparsers(dest="command", required=True)

    serve = commands.add_parser("serve", help="OpenAI-compatible HTTP server")
    add_server_args(serve)
    add_engine_args(serve)

    generate = commands.add_parser("generate", help="complete one prompt and print the text")
    generate.add_argument("prompt")
    add_engine_args(generate)
    add_sampling_args(generate, max_tokens=64)

    chat = commands.add_parser("chat", help="interactive chat, streaming tokens as they come")
    chat.add_argument("--system", default=None, help="system message")
    add_engine_args(chat)
    add_sampling_args(chat, max_tokens=512)

    bench = commands.add_parser("bench", help="benchmarks")
    bench_commands = bench.add_subparsers(dest="bench_command", required=True)
    from octavo.bench.throughput import add_throughput_args

    throughput = bench_commands.add_parser("throughput", help="offline throughput")
    add_throughput_args(throughput)
    add_engine_args(throughput)

    from octavo.bench.structured import add_structured_args

    structured_bench = bench_commands.add_parser(
        "structured", help="throughput with half the batch under a JSON schema; compile time"
    )
    add_structured_args(structured_bench)
    add_engine_args(structured_bench)

    from octavo.bench.decode import add_decode_bench_args

    decode_bench = bench_commands.add_parser(
        "decode", help="time of one steady decode step, by batch size"
    )
    add_decode_bench_args(decode_bench)
    add_engine_args(decode_bench)

    from octavo.bench.serve import add_serve_bench_args

    serve_bench = bench_commands.add_parser(
        "serve", help="load generator for any OpenAI-compatible server"
    )
    add_serve_bench_args(serve_bench)

    from octavo.bench.policies import add_policies_bench_args

    policies_bench = bench_commands.add_parser(
        "policies", help="admission policies on one synthetic trace, with a cost-model executor"
    )
    add_policies_bench_args(policies_bench)

    from octavo.bench.machine import add_machine_args

    machine_bench = bench_commands.add_parser(
        "machine", help="matmul GFLOP/s, memory bandwidth and the tokens/s ceilings they set"
    )
    add_machine_args(machine_bench)

    from octavo.bench.plan import add_plan_args

    plan = commands.add_parser("plan", help="max_tokens and concurrency from a request log")
    add_plan_args(plan)

    convert = commands.add_parser(
        "convert", help="GGUF -> Hugging Face folder (config.json, safetensors, tokenizer files)"
    )
    add_convert_args(convert)
    return parser


def add_convert_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("gguf", metavar="GGUF", help="the .gguf file to convert")
    parser.add_argument("out_dir", metavar="OUTDIR", help="folder to write (created if missing)")
    parser.add_argument(
        "--dtype",
        default="bfloat16",
        choices=["bfloat16", "float16", "float32"],
        help="dtype of the written weights (default: bfloat16)",
    )
    parser.add_argument(
        "--format",
        dest="fmt",
        default="hf",
        choices=["hf", "gguf"],
        help="hf: config.json + model.safetensors + tokenizer files; "
        "gguf: OUTDIR/model.gguf with float tensors (for llama.cpp)",
    )


def convert_command(ns: argparse.Namespace) -> list[str]:
    """The converter runs as its own program: the CLI does not import model code (DESIGN.md's
    dependency direction), and a conversion shares nothing with a running engine."""
    return [
        sys.executable,
        "-m",
        "octavo.model.convert",
        ns.gguf,
        ns.out_dir,
        "--dtype",
        ns.dtype,
        "--format",
        ns.fmt,
    ]


def main(argv: list[str] | None = None) -> int:
    ns = make_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO,
        format="%(levelname)s %(asctime)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    try:
        if ns.command == "serve":
            from octavo.entrypoints.server.app import run_server

            args = engine_args_from(ns)
            args.model = ns.model_tag or ns.model
            args.served_model_name = ns.served_model_name
            return run_server(args, server_config_from(ns))
        if ns.command == "generate":
            from octavo.entrypoints.chat import run_generate

            return run_generate(engine_args_from(ns), sampling_params_from(ns), ns.prompt)
        if ns.command == "chat":
            from octavo.entrypoints.chat import run_chat

            return run_chat(engine_args_from(ns), sampling_params_from(ns), ns.system)
        if ns.command == "bench" and ns.bench_command == "throughput":
            from octavo.bench.throughput import run_throughput

            return run_throughput(ns, engine_args_from(ns))
        if ns.command == "bench" and ns.bench_command == "structured":
            from octavo.bench.structured import run_structured_bench

            return run_structured_bench(ns, engine_args_from(ns))
        if ns.command == "bench" and ns.bench_command == "decode":
            from octavo.bench.decode import run_decode_bench

            return run_decode_bench(ns, engine_args_from(ns))
        if ns.command == "bench" and ns.bench_command == "serve":
            from octavo.bench.serve import run_serve_bench

            return run_serve_bench(ns)
        if ns.command == "bench" and ns.bench_command == "policies":
            from octavo.bench.policies import run_policies_bench

            return run_policies_bench(ns)
        if ns.command == "bench" and ns.bench_command == "machine":
            from octavo.bench.machine import run_machine

            return run_machine(ns)
        if ns.command == "plan":
            from octavo.bench.plan import run_plan

            return run_plan(ns)
        if ns.command == "convert":
            import subprocess

            return subprocess.call(convert_command(ns))
    except ValueError as exc:
        # Bad settings or input: one clear line, not a traceback.
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 1


if __name__ == "__main__":
    sys.exit(main())
