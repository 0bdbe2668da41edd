"""`octavo serve|run-batch|generate|chat|bench|plan`: parse flags -> EngineArgs -> run. Flag
names follow vLLM."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Callable
from typing import Any

from octavo.config import EngineArgs, json_object_flag


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Every EngineArgs field as a flag (octavo/config.py holds their names, types, defaults
    and help)."""
    EngineArgs.add_cli_args(parser)


def engine_args_from(ns: argparse.Namespace) -> EngineArgs:
    return EngineArgs.from_cli_args(ns)


def add_server_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "model_tag",
        nargs="?",
        default=None,
        metavar="MODEL",
        help="model to serve (same as --model)",
    )
    group = parser.add_argument_group("server")
    group.add_argument(
        "--config",
        metavar="FILE.yaml",
        help="flags from a YAML file (`port: 8000`, `api-key: [a, b]`, `enable-auto-tool-choice: "
        "true`); flags on the command line win",
    )
    group.add_argument("--host", default="127.0.0.1")
    group.add_argument("--port", type=int, default=8000)
    group.add_argument(
        "--uds",
        default=None,
        metavar="PATH",
        help="serve on this Unix domain socket instead of --host and --port",
    )
    group.add_argument(
        "--api-key",
        default=None,
        nargs="+",
        help="require `Authorization: Bearer KEY` on every path but /health (one of several "
        "keys, if several are given)",
    )
    group.add_argument(
        "--allowed-origins",
        default=None,
        help="CORS origins, a JSON list or comma-separated (e.g. '[\"*\"]'); "
        "CORS is off by default",
    )
    group.add_argument(
        "--allowed-methods",
        default=None,
        help='CORS methods, as --allowed-origins (default: ["*"])',
    )
    group.add_argument(
        "--allowed-headers",
        default=None,
        help='CORS headers, as --allowed-origins (default: ["*"])',
    )
    group.add_argument(
        "--allow-credentials",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="CORS: allow credentials",
    )
    group.add_argument(
        "--uvicorn-log-level",
        default="info",
        choices=["critical", "debug", "error", "info", "trace", "warning"],
        help="uvicorn's log level",
    )
    group.add_argument(
        "--disable-uvicorn-access-log",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="no line per HTTP request",
    )
    group.add_argument(
        "--disable-access-log-for-endpoints",
        default=None,
        metavar="PATHS",
        help="comma-separated paths whose requests get no access-log line, e.g. "
        "/health,/metrics (the query string aside)",
    )
    group.add_argument(
        "--root-path",
        default="",
        help="the path prefix a reverse proxy serves this server under (FastAPI's root_path)",
    )
    group.add_argument("--ssl-keyfile", default=None, help="serve HTTPS with this key file")
    group.add_argument("--ssl-certfile", default=None, help="serve HTTPS with this certificate")
    group.add_argument(
        "--ssl-ca-certs", default=None, help="CA certificates that client certificates must match"
    )
    group.add_argument(
        "--ssl-cert-reqs",
        type=int,
        default=0,
        help="whether client certificates are required (Python's ssl.CERT_NONE 0, "
        "CERT_OPTIONAL 1, CERT_REQUIRED 2)",
    )
    group.add_argument("--ssl-ciphers", default=None, help="the TLS ciphers allowed")
    group.add_argument(
        "--enable-ssl-refresh",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="load the --ssl-keyfile, --ssl-certfile and --ssl-ca-certs files again when they "
        "change while serving (checked every second); new connections get the new certificate",
    )
    group.add_argument(
        "--enable-tokenizer-info-endpoint",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="serve GET /tokenizer_info: the tokenizer's configuration (its "
        "tokenizer_config.json, special tokens, the --chat-template if set)",
    )
    group.add_argument(
        "--enable-request-id-headers",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="give every response an X-Request-Id header (the request's own, or a new one)",
    )
    group.add_argument(
        "--disable-fastapi-docs",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="do not serve /docs, /redoc and /openapi.json",
    )
    add_serving_args(group)
    limits = parser.add_argument_group("server limits")
    limits.add_argument(
        "--max-request-body-bytes", type=int, default=16 << 20, help="larger bodies get 413"
    )
    limits.add_argument(
        "--max-sequences-per-request",
        type=int,
        default=256,
        help="most output streams (prompts x n) one request may ask for",
    )
    limits.add_argument(
        "--header-read-timeout",
        type=float,
        default=30.0,
        metavar="SECONDS",
        help="close a connection that has not sent a complete request head in this time",
    )
    limits.add_argument(
        "--body-read-timeout",
        type=float,
        default=60.0,
        metavar="SECONDS",
        help="answer 408 when a request body takes longer than this to arrive",
    )
    limits.add_argument(
        "--timeout-keep-alive",
        type=float,
        default=5.0,
        metavar="SECONDS",
        help="close idle keep-alive connections after this",
    )
    limits.add_argument(
        "--limit-concurrency",
        type=int,
        default=None,
        help="answer 503 beyond this many connections and requests at once (default: none)",
    )
    limits.add_argument(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        metavar="SECONDS",
        help="on SIGTERM, how long running requests may go on; streams still running then "
        "end with an error event and [DONE]",
    )
    limits.add_argument(
        "--enable-dev-endpoints",
        action="store_true",
        help="serve /reset_prefix_cache, /sleep, /wake_up and /is_sleeping (vLLM's dev-mode "
        "endpoints, also on with VLLM_SERVER_DEV_MODE=1; behind --api-key if set)",
    )


def add_serving_args(group: argparse._ArgumentGroup) -> None:
    """The flags that shape responses, which `serve` and `run-batch` share."""
    group.add_argument(
        "--response-role",
        default="assistant",
        help="the role of chat completion responses (default: assistant)",
    )
    group.add_argument(
        "--enable-force-include-usage",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="end every stream with a usage chunk, whether stream_options asks for it or not",
    )
    group.add_argument(
        "--default-chat-template-kwargs",
        type=json_object_flag("default_chat_template_kwargs"),
        default=None,
        metavar="JSON",
        help="a JSON object of keyword arguments every chat request's template gets, e.g. "
        "'{\"enable_thinking\": false}'; a request's own chat_template_kwargs win key by key",
    )
    group.add_argument(
        "--return-tokens-as-token-ids",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="name each token of a response's logprobs `token_id:ID` instead of by its text "
        "(for tokens whose text is not valid UTF-8 on its own)",
    )
    group.add_argument(
        "--trust-request-chat-template",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="let a chat request (or /tokenize) bring its own chat_template, a Jinja template "
        "the server runs (default: such a request is refused with 400)",
    )
    group.add_argument(
        "--engine-in-process",
        action="store_true",
        help="step the engine on a thread of the API server process instead of in an "
        "engine-core process of its own (one process; the layout before the engine-core "
        "process, kept for comparison and debugging)",
    )
    # Checked by ServerConfig (importing the parser registry here would load the server).
    group.add_argument(
        "--tool-call-parser",
        default=None,
        metavar="NAME",
        help="how tool calls are read from the model's text, vLLM's names: hermes "
        "(<tool_call>{json}</tool_call>: Hermes, Qwen 2.5/3), llama3_json or llama4_json "
        "(Llama 3.x JSON calls), mistral ([TOOL_CALLS]), pythonic ([f(a=1)]: Llama 3.2, "
        "ToolACE), qwen3_coder or qwen3_xml (<function=...><parameter=...>: Qwen3-Coder), "
        "deepseek_v3 (DeepSeek-V3's tool-call tokens), granite (<|tool_call|>[...])",
    )
    group.add_argument(
        "--enable-auto-tool-choice",
        action=argparse.BooleanOptionalAction,
        default=False,
        help='allow tool_choice "auto" (the default when a request has tools); '
        "needs --tool-call-parser",
    )
    group.add_argument(
        "--exclude-tools-when-tool-choice-none",
        action=argparse.BooleanOptionalAction,
        default=False,
        help='leave a request\'s tools out of the prompt when its tool_choice is "none" '
        "(default: the chat template renders them, and the output is plain content)",
    )


def add_run_batch_args(parser: argparse.ArgumentParser) -> None:
    """`octavo run-batch`'s own flags (vLLM's run-batch names); the engine's and the response
    flags are serve's."""
    group = parser.add_argument_group("batch")
    group.add_argument(
        "-i",
        "--input-file",
        required=True,
        metavar="PATH",
        help="the requests, one JSON object a line in OpenAI's batch format (custom_id, "
        "method, url /v1/chat/completions or /v1/completions, body); - reads stdin",
    )
    group.add_argument(
        "-o",
        "--output-file",
        required=True,
        metavar="PATH",
        help="where the results go, one line per request in input order; - writes stdout",
    )
    group.add_argument(
        "--output-tmp-dir",
        default=None,
        metavar="DIR",
        help="vLLM's staging folder for uploading the output to a URL; no effect here "
        "(octavo writes local files only)",
    )
    group.add_argument(
        "--enable-metrics",
        action="store_true",
        help="vLLM's Prometheus server for a batch run; no effect here",
    )
    group.add_argument(
        "--url", default=None, help="with --enable-metrics, its address; no effect here"
    )
    group.add_argument(
        "--port", type=int, default=None, help="with --enable-metrics, its port; no effect here"
    )
    serving = parser.add_argument_group("responses")
    add_serving_args(serving)
    serving.add_argument(
        "--max-sequences-per-request",
        type=int,
        default=256,
        help="most output streams (prompts x n) one request may ask for",
    )


def run_batch_notes(ns: argparse.Namespace) -> list[str]:
    """A log line for each of vLLM's run-batch flags given that changes nothing here."""
    given = [
        ("--output-tmp-dir", ns.output_tmp_dir is not None, "octavo writes local files only"),
        ("--enable-metrics", ns.enable_metrics, "a batch run serves no /metrics"),
        ("--url", ns.url is not None, "a batch run serves no /metrics"),
        ("--port", ns.port is not None, "a batch run serves no /metrics"),
    ]
    return [f"{flag} has no effect here: {why}" for flag, is_given, why in given if is_given]


def batch_config_from(ns: argparse.Namespace):
    """The ServerConfig of `run-batch`: the settings that shape responses, the rest defaults."""
    from octavo.entrypoints.server.app import ServerConfig

    return ServerConfig(
        **serving_settings(ns), max_sequences_per_request=ns.max_sequences_per_request
    )


def serving_settings(ns: argparse.Namespace) -> dict[str, Any]:
    """The ServerConfig fields of add_serving_args' flags (serve and run-batch alike)."""
    return {
        "response_role": ns.response_role,
        "enable_force_include_usage": ns.enable_force_include_usage,
        "default_chat_template_kwargs": ns.default_chat_template_kwargs,
        "return_tokens_as_token_ids": ns.return_tokens_as_token_ids,
        "trust_request_chat_template": ns.trust_request_chat_template,
        "engine_in_process": ns.engine_in_process,
        "tool_call_parser": ns.tool_call_parser,
        "enable_auto_tool_choice": ns.enable_auto_tool_choice,
        "reasoning_parser": ns.reasoning_parser,
        "exclude_tools_when_tool_choice_none": ns.exclude_tools_when_tool_choice_none,
    }


def add_router_args(parser: argparse.ArgumentParser) -> None:
    """`octavo router`'s flags (entrypoints/router.py)."""
    parser.add_argument(
        "--backend",
        action="append",
        required=True,
        metavar="URL",
        help="a server to route to (http://host:port); repeat for each",
    )
    parser.add_argument("--host", default="0.0.0.0")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument(
        "--health-check-interval",
        type=float,
        default=5.0,
        metavar="SECONDS",
        help="how often each backend's /health is asked",
    )
    parser.add_argument(
        "--read-timeout",
        type=float,
        default=600.0,
        metavar="SECONDS",
        help="longest wait for a backend's next bytes",
    )


def _string_list(text: str | None, default: tuple[str, ...] = ()) -> tuple[str, ...]:
    """A JSON list or comma-separated values (vLLM's CORS flags take JSON lists)."""
    if not text:
        return default
    text = text.strip()
    values = json.loads(text) if text.startswith("[") else text.split(",")
    return tuple(str(v).strip() for v in values if str(v).strip())


def dev_mode_from_environment() -> bool:
    """vLLM's switch for its development endpoints: VLLM_SERVER_DEV_MODE=1."""
    return os.environ.get("VLLM_SERVER_DEV_MODE", "0").strip().lower() in ("1", "true")


def server_config_from(ns: argparse.Namespace):
    from octavo.entrypoints.server.app import ServerConfig
    from octavo.entrypoints.server.http_server import access_log_paths

    return ServerConfig(
        host=ns.host,
        port=ns.port,
        uds=ns.uds,
        api_key=tuple(ns.api_key) if ns.api_key else None,
        allowed_origins=_string_list(ns.allowed_origins),
        allowed_methods=_string_list(ns.allowed_methods, ("*",)),
        allowed_headers=_string_list(ns.allowed_headers, ("*",)),
        allow_credentials=ns.allow_credentials,
        uvicorn_log_level=ns.uvicorn_log_level,
        disable_uvicorn_access_log=ns.disable_uvicorn_access_log,
        disable_access_log_for_endpoints=access_log_paths(ns.disable_access_log_for_endpoints),
        root_path=ns.root_path,
        ssl_keyfile=ns.ssl_keyfile,
        ssl_certfile=ns.ssl_certfile,
        ssl_ca_certs=ns.ssl_ca_certs,
        ssl_cert_reqs=ns.ssl_cert_reqs,
        ssl_ciphers=ns.ssl_ciphers,
        enable_ssl_refresh=ns.enable_ssl_refresh,
        disable_fastapi_docs=ns.disable_fastapi_docs,
        enable_tokenizer_info_endpoint=ns.enable_tokenizer_info_endpoint,
        enable_request_id_headers=ns.enable_request_id_headers,
        max_request_body_bytes=ns.max_request_body_bytes,
        max_sequences_per_request=ns.max_sequences_per_request,
        header_read_timeout_s=ns.header_read_timeout,
        body_read_timeout_s=ns.body_read_timeout,
        timeout_keep_alive_s=ns.timeout_keep_alive,
        limit_concurrency=ns.limit_concurrency,
        shutdown_timeout_s=ns.shutdown_timeout,
        enable_dev_endpoints=ns.enable_dev_endpoints or dev_mode_from_environment(),
        **serving_settings(ns),
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
    # Then every other flag of `vllm serve`, held to its disposition (vllm_compat.py).
    from octavo.entrypoints.vllm_compat import add_vllm_flags

    add_vllm_flags(serve)

    run_batch = commands.add_parser(
        "run-batch",
        help="answer a file of OpenAI batch requests (chat and completions) in order",
    )
    add_run_batch_args(run_batch)
    add_engine_args(run_batch)
    add_vllm_flags(run_batch)

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

    router = commands.add_parser(
        "router",
        help="one OpenAI-compatible address in front of several servers, routing by cached "
        "prefix and load",
    )
    add_router_args(router)

    plan = commands.add_parser("plan", help="max_tokens and concurrency from a request log")
    add_plan_args(plan)

    # Listed for --help only: main() hands everything after `convert` to the converter, which
    # parses its own flags (python -m octavo.model.convert --help).
    commands.add_parser(
        "convert", help="GGUF -> Hugging Face folder (config.json, safetensors, tokenizer files)"
    )
    return parser


def convert_command(args: list[str]) -> list[str]:
    """The converter runs as its own program: the CLI does not import model code (DESIGN.md's
    dependency direction), and a conversion shares nothing with a running engine."""
    return [sys.executable, "-m", "octavo.model.convert", *args]


def config_file_args(path: str, has_option: Callable[[str], bool]) -> list[str]:
    """A YAML file of flags (vLLM's --config) as command-line arguments: `key: value` is
    `--key value`, a list several values, a mapping its JSON, true `--key` and false
    `--no-key` where the flag has that form."""
    import yaml

    if not path.endswith((".yaml", ".yml")):
        raise ValueError(f"--config takes a .yaml or .yml file, got {path!r}.")
    with open(path) as f:
        entries = yaml.safe_load(f) or {}
    if not isinstance(entries, dict):
        raise ValueError(f"--config {path}: the file must hold a mapping of flag names to values.")
    args: list[str] = []
    for key, value in entries.items():
        flag = "--" + str(key).replace("_", "-")
        if isinstance(value, bool):
            negative = "--no-" + flag[2:]
            args += [flag] if value else [negative] if has_option(negative) else []
        elif isinstance(value, list):
            args += [flag, *map(str, value)] if value else []
        elif isinstance(value, dict):
            args += [flag, json.dumps(value)]
        else:
            args += [flag, str(value)]
    return args


def expand_config_file(argv: list[str], parser: argparse.ArgumentParser) -> list[str]:
    """`serve [MODEL] ... --config FILE ...` with the file's flags in place of the option,
    right after the command and its model, so that flags given on the command line win."""
    if argv[:1] != ["serve"] or "--config" not in argv:
        return argv
    if argv.count("--config") > 1:
        raise ValueError("--config may be given once.")
    index = argv.index("--config")
    if index + 1 >= len(argv):
        raise ValueError("--config needs a file.")
    serve = subparser(parser, "serve")
    known = {option for action in serve._actions for option in action.option_strings}
    added = config_file_args(argv[index + 1], known.__contains__)
    rest = argv[:index] + argv[index + 2 :]
    head = 2 if len(rest) > 1 and not rest[1].startswith("-") else 1
    return rest[:head] + added + rest[head:]


def subparser(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    """The parser of one `octavo` command."""
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return commands.choices[name]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["convert"]:
        import subprocess

        return subprocess.call(convert_command(argv[1:]))
    parser = make_parser()
    try:
        argv = expand_config_file(argv, parser)
    except (OSError, ValueError) as exc:
        parser.exit(2, f"octavo serve: error: {exc}\n")
    ns = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO,
        format="%(levelname)s %(asctime)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    try:
        if ns.command == "serve":
            from octavo.entrypoints.server.app import run_server
            from octavo.entrypoints.vllm_compat import VllmFlagRefused, check_namespace

            try:
                notes = check_namespace(ns)
            except VllmFlagRefused as exc:
                parser.exit(2, f"octavo serve: error: {exc}\n")
            for note in notes:
                logging.getLogger("octavo.serve").info(note)
            args = EngineArgs.from_cli_args(ns, model=ns.model_tag or ns.model)
            return run_server(args, server_config_from(ns))
        if ns.command == "run-batch":
            from octavo.entrypoints.run_batch import run_batch
            from octavo.entrypoints.vllm_compat import VllmFlagRefused, check_namespace

            try:
                notes = check_namespace(ns) + run_batch_notes(ns)
            except VllmFlagRefused as exc:
                parser.exit(2, f"octavo run-batch: error: {exc}\n")
            for note in notes:
                logging.getLogger("octavo.run_batch").info(note)
            config = batch_config_from(ns)
            return run_batch(engine_args_from(ns), config, ns.input_file, ns.output_file)
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
        if ns.command == "router":
            from octavo.entrypoints.router import run_router

            return run_router(ns)
        if ns.command == "plan":
            from octavo.bench.plan import run_plan

            return run_plan(ns)
    except ValueError as exc:
        # Bad settings or input: one clear line, not a traceback.
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 1


if __name__ == "__main__":
    sys.exit(main())
