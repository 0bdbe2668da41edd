"""Helpers of `benchmarks/compare.sh`: KV sizes, server facts, memory, and the results table.

Owns the arithmetic and parsing the shell script should not do: the KV cache capacity each
engine is given for one number of tokens, what each server says it resolved (dtype, KV tokens)
from its log, the resident memory of a server's process tree, what the machine did during a run
(CPU time the hypervisor took away, the server's page faults that read a disk), and the
markdown table of medians and ratios written to stdout and into BENCHMARKS.md between markers.
Standard library only (it runs with any python3); it imports nothing of octavo and starts
nothing.

    python3 benchmarks/compare.py kv MODEL_DIR --tokens N --dtype auto|bfloat16|float32|float16
    python3 benchmarks/compare.py server-info ENGINE LOG
    python3 benchmarks/compare.py rss PID
    python3 benchmarks/compare.py watch PID OUT.jsonl      # until PID exits or is told to stop
    python3 benchmarks/compare.py table RESULTS_DIR [--write BENCHMARKS.md]
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "f32": 4, "bf16": 2, "f16": 2}
ENGINES = {"octavo": "octavo", "vllm": "vLLM", "llamacpp": "llama.cpp"}
BEGIN = "<!-- compare.sh: begin (written by benchmarks/compare.sh; edits here are replaced) -->"
END = "<!-- compare.sh: end -->"


# -------------------------------------------------------------------- KV capacity


def kv_bytes_per_token(config: dict[str, Any], dtype_bytes: int) -> int:
    """Keys and values of every layer for one token: 2 x layers x kv heads x head_dim x bytes."""
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    return 2 * config["num_hidden_layers"] * kv_heads * head_dim * dtype_bytes


def cmd_kv(ns: argparse.Namespace) -> int:
    config = json.loads((Path(ns.model_dir) / "config.json").read_text())
    # vLLM's "auto" takes the checkpoint's dtype (on x86 every float dtype is supported).
    dtype = ns.dtype
    if dtype == "auto":
        dtype = config.get("torch_dtype") or config.get("dtype") or "float32"
    per_token = kv_bytes_per_token(config, DTYPE_BYTES[dtype])
    print(
        json.dumps(
            {
                "tokens": ns.tokens,
                "dtype": dtype,
                "bytes_per_token": per_token,
                "bytes": ns.tokens * per_token,
            }
        )
    )
    return 0


# -------------------------------------------------------------------- server logs and memory

# What each server logs about the settings it resolved; the first group is the value.
_LOG_FACTS = {
    "octavo": {
        "kv_tokens": r"KV cache: .* = (\d+) tokens",
        "dtype": r": dtype (\w+) \(",
        "kv_dtype": r"KV cache: .* MiB, (\w+)\)",
    },
    "vllm": {
        "kv_tokens": r"KV cache size: ([\d,]+) tokens",
        "dtype": r"dtype=torch\.(\w+)",
        "kv_dtype": r"kv_cache_dtype=(\w+)",
    },
    # llama-server logs neither at its default verbosity: see server_info's `props`.
    "llamacpp": {},
}


def server_info(engine: str, log_text: str, props: dict[str, Any] | None = None) -> dict[str, Any]:
    """What the server resolved, from its log; for llama.cpp from its /props answer (weights
    type; its KV pool is the -c the script passes, shared by all slots with --kv-unified)."""
    facts: dict[str, Any] = {}
    if props:
        facts["dtype"] = f"{props.get('model_ftype', '?')} weights, f16 KV"
    for name, pattern in _LOG_FACTS[engine].items():
        match = re.search(pattern, log_text)
        if match:
            value = match.group(1).replace(",", "")
            facts[name] = int(value) if value.isdigit() else value
    kv = facts.pop("kv_dtype", None)
    if kv and "dtype" in facts:  # vLLM's "auto" cache is its compute dtype
        facts["dtype"] = f"{facts['dtype']}, {facts['dtype'] if kv == 'auto' else kv} KV"
    return facts


def cmd_server_info(ns: argparse.Namespace) -> int:
    text = Path(ns.log).read_text(errors="replace")
    props = json.loads(Path(ns.props).read_text()) if ns.props else None
    print(json.dumps(server_info(ns.engine, text, props)))
    return 0


def process_tree(pid: int) -> list[int]:
    """`pid` and its descendants (vLLM serves from several processes)."""
    pids, frontier = [pid], [pid]
    while frontier:
        children = Path(f"/proc/{frontier.pop()}/task")
        for task in children.glob("*/children") if children.exists() else []:
            for child in task.read_text().split():
                pids.append(int(child))
                frontier.append(int(child))
    return pids


def process_tree_memory(pid: int) -> dict[str, int]:
    """RSS and PSS (KiB) summed over `pid` and its descendants. vLLM serves from two processes
    (API server and engine core) that share libraries: RSS counts shared pages in each, PSS
    splits them, so PSS is the fair sum and RSS the one a process monitor shows."""
    totals = {"rss_kib": 0, "pss_kib": 0, "processes": 0}
    for member in process_tree(pid):
        try:
            rollup = Path(f"/proc/{member}/smaps_rollup").read_text()
        except OSError:
            continue  # exited in between
        totals["processes"] += 1
        for line in rollup.splitlines():
            key, _, rest = line.partition(":")
            if key in ("Rss", "Pss"):
                totals[f"{key.lower()}_kib"] += int(rest.split()[0])
    return totals


def cmd_rss(ns: argparse.Namespace) -> int:
    print(json.dumps(process_tree_memory(ns.pid)))
    return 0


# -------------------------------------------------------------------- the machine during a run


def machine_sample(pid: int, faults: dict[int, int]) -> dict[str, float]:
    """One sample of what can slow a run without any engine being at fault: the machine's CPU
    time in jiffies (all CPUs) and the part of it the hypervisor gave to another guest
    (steal), and the major page faults (a read from disk, for example of library code the
    kernel had dropped from memory) of the server's process tree. `faults` keeps each process's
    last count, so that one that exits still counts."""
    jiffies = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    for member in process_tree(pid):
        try:
            stat = Path(f"/proc/{member}/stat").read_text()
        except OSError:
            continue  # exited in between
        faults[member] = int(stat.rsplit(")", 1)[1].split()[9])  # field 12, majflt
    return {
        "t": time.monotonic(),
        "cpu": sum(jiffies),
        "steal": jiffies[7] if len(jiffies) > 7 else 0,
        "major_faults": sum(faults.values()),
    }


def cmd_watch(ns: argparse.Namespace) -> int:
    faults: dict[int, int] = {}
    with open(ns.out, "w") as out:
        while Path(f"/proc/{ns.pid}").exists():
            out.write(json.dumps(machine_sample(ns.pid, faults)) + "\n")
            out.flush()
            time.sleep(ns.interval)
    return 0


def watch_summary(samples: list[dict[str, float]]) -> dict[str, float]:
    """Over a run: the steal share of all CPU time, the worst share in any second, and the
    server's major faults."""
    if len(samples) < 2:
        return {}
    first, last = samples[0], samples[-1]
    worst, j = 0.0, 0
    for i, start in enumerate(samples):
        j = max(j, i + 1)
        while j < len(samples) and samples[j]["t"] - start["t"] < 1.0:
            j += 1
        if j == len(samples):
            break
        cpu = samples[j]["cpu"] - start["cpu"]
        if cpu > 0:
            worst = max(worst, 100 * (samples[j]["steal"] - start["steal"]) / cpu)
    cpu = last["cpu"] - first["cpu"]
    return {
        "steal %": 100 * (last["steal"] - first["steal"]) / cpu if cpu > 0 else 0.0,
        "steal % worst 1 s": worst,
        "major faults": last["major_faults"] - first["major_faults"],
    }


# -------------------------------------------------------------------- results table


def load_runs(results: Path) -> dict[tuple[str, str], list[dict[str, Any]]]:
    """(workload, engine) -> one dict per round: vLLM bench's result JSON (saved with
    --save-detailed) merged with the script's meta file of that run, the summary of its watch
    file and its round."""
    runs: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for path in sorted(results.glob("*-r*.json")):
        match = re.fullmatch(r"([A-Z])-(\w+)-r(\d+)\.json", path.name)
        if match is None:  # the meta and props files beside each result
            continue
        workload, engine, round_ = match.groups()
        run = json.loads(path.read_text())
        meta = path.with_name(path.stem + ".meta.json")
        if meta.exists():
            run.update(json.loads(meta.read_text()))
        watch = path.with_name(path.stem + ".watch.jsonl")
        if watch.exists():
            samples = [json.loads(line) for line in watch.read_text().splitlines() if line]
            run.update(watch_summary(samples))
        run["round"] = int(round_)
        runs.setdefault((workload, engine), []).append(run)
    return runs


def run_metrics(run: dict[str, Any]) -> dict[str, float]:
    """The table's numbers for one run. Max gap: per stream, the largest time between two
    consecutive tokens (octavo bench serve's definition), from the per-request ITLs."""
    gaps = sorted(max(itls) * 1000 for itls in run.get("itls") or [] if itls)
    metrics = {
        "req/s": run["request_throughput"],
        "out tok/s": run["output_throughput"],
        "total tok/s": run["total_token_throughput"],
        "TTFT p50": run["median_ttft_ms"],
        "TTFT p99": run["p99_ttft_ms"],
        "TPOT p50": run["median_tpot_ms"],
        "ITL p50": run["median_itl_ms"],
        "ITL p99": run["p99_itl_ms"],
    }
    if gaps:
        metrics["max gap p50"] = statistics.median(gaps)
        metrics["max gap p99"] = gaps[min(len(gaps) - 1, round(0.99 * (len(gaps) - 1)))]
    if run.get("pss_kib"):
        metrics["RSS MiB"] = run["rss_kib"] / 1024
        metrics["PSS MiB"] = run["pss_kib"] / 1024
    return metrics


COLUMNS = [
    "req/s",
    "out tok/s",
    "total tok/s",
    "TTFT p50",
    "TTFT p99",
    "TPOT p50",
    "ITL p50",
    "ITL p99",
    "max gap p50",
    "max gap p99",
]
HIGHER_IS_BETTER = {"req/s", "out tok/s", "total tok/s"}


def medians(runs: list[dict[str, Any]]) -> dict[str, float]:
    per_run = [run_metrics(run) for run in runs if run.get("completed")]
    keys = {key for metrics in per_run for key in metrics}
    return {key: statistics.median(m[key] for m in per_run if key in m) for key in keys}


def render_table(runs: dict[tuple[str, str], list[dict[str, Any]]], header: str) -> str:
    workloads = sorted({workload for workload, _ in runs})
    engines = [e for e in ENGINES if any(engine == e for _, engine in runs)]
    lines = [
        header,
        "",
        "| workload | engine | runs | " + " | ".join(COLUMNS) + " |",
        "|---|---|---|" + "---|" * len(COLUMNS),
    ]
    summary: dict[tuple[str, str], dict[str, float]] = {}
    for workload in workloads:
        for engine in engines:
            if (workload, engine) not in runs:
                continue
            rounds = runs[(workload, engine)]
            summary[(workload, engine)] = values = medians(rounds)
            done = sum(1 for run in rounds if run.get("completed"))
            cells = [_fmt(values.get(column)) for column in COLUMNS]
            lines.append(f"| {workload} | {ENGINES[engine]} | {done} | " + " | ".join(cells) + " |")
        for peer in ("vllm", "llamacpp"):
            ours, theirs = summary.get((workload, "octavo")), summary.get((workload, peer))
            if ours and theirs:
                cells = [_ratio(ours.get(c), theirs.get(c)) for c in COLUMNS]
                lines.append(
                    f"| {workload} | octavo/{ENGINES[peer]} | | " + " | ".join(cells) + " |"
                )
    lines += [
        "",
        "Times in ms (medians over rounds of each run's median or p99). Ratios are octavo",
        "over the peer: above 1 is better for octavo in req/s and tok/s, below 1 in every",
        "time. Max gap: per stream, the largest time between two consecutive tokens, then",
        "p50 / p99 over streams.",
        "",
    ]
    lines += _memory_lines(runs, engines)
    lines += _settings_lines(runs)
    lines += _prefix_lines(runs)
    lines += _machine_lines(runs, engines)
    return "\n".join(lines) + "\n"


def _memory_lines(runs: dict[tuple[str, str], list[dict[str, Any]]], engines: list[str]) -> list:
    lines = [
        "| engine | compute dtype, KV cache | KV tokens (asked / reported) | RSS at end "
        "of A (MiB) | PSS at end of A (MiB) |",
        "|---|---|---|---|---|",
    ]
    for engine in engines:
        rounds = [run for (w, e), rs in runs.items() if e == engine for run in rs]
        if not rounds:
            continue
        last = rounds[-1]
        at_a = medians(runs.get(("A", engine), []))
        dtype = last.get("dtype") or "?"
        lines.append(
            f"| {ENGINES[engine]} | {dtype} | {last.get('kv_tokens_asked', '?')} / "
            f"{last.get('kv_tokens', '-')} | {_fmt(at_a.get('RSS MiB'))} | "
            f"{_fmt(at_a.get('PSS MiB'))} |"
        )
    return lines


def _settings_lines(runs: dict[tuple[str, str], list[dict[str, Any]]]) -> list:
    """The llama.cpp configuration each workload's rounds ran, where the runs record one."""
    settings = {
        workload: run["llama_settings"]
        for (workload, engine), rounds in sorted(runs.items())
        if engine == "llamacpp"
        for run in rounds
        if run.get("llama_settings")
    }
    if not settings:
        return []
    return [
        "",
        "llama.cpp ran: "
        + "; ".join(f"{w}: {describe_llama_config(c)}" for w, c in settings.items())
        + ".",
    ]


def prefix_hits_by_engine(before: str, after: str) -> dict[str, list[float]]:
    """Prefix-cache hits and queries (tokens) per `engine` label between two scrapes of a
    server's /metrics (vLLM's and octavo's vllm:prefix_cache_* counters): {engine: [hits,
    queries]}. Empty where the server exports neither."""

    def totals(text: str) -> dict[str, list[float]]:
        found: dict[str, list[float]] = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                index = {
                    "vllm:prefix_cache_hits_total": 0,
                    "vllm:prefix_cache_queries_total": 1,
                }.get(sample.name)
                if index is not None:
                    engine = sample.labels.get("engine", "0")
                    found.setdefault(engine, [0.0, 0.0])[index] += sample.value
        return found

    start, end = totals(before), totals(after)
    return {
        engine: [
            hits - start.get(engine, [0.0, 0.0])[0],
            queries - start.get(engine, [0.0, 0.0])[1],
        ]
        for engine, (hits, queries) in sorted(end.items())
    }


def cmd_prefix_hits(ns: argparse.Namespace) -> int:
    hits = prefix_hits_by_engine(Path(ns.before).read_text(), Path(ns.after).read_text())
    print(json.dumps({"prefix_hits_by_engine": hits} if hits else {}))
    return 0


def _prefix_lines(runs: dict[tuple[str, str], list[dict[str, Any]]]) -> list:
    """Per run of a server with several engines (data parallelism): each replica's
    prefix-cache hit rate over the measured requests."""
    cells = [
        (w, run["round"], e, run["prefix_hits_by_engine"])
        for (w, e), rs in runs.items()
        for run in rs
        if len(run.get("prefix_hits_by_engine") or {}) > 1
    ]
    if not cells:
        return []
    lines = [
        "",
        "Prefix-cache hits per replica (engine label), over the measured requests: cached",
        "prompt tokens / prompt tokens looked up, and the rate.",
        "",
        "| run | engine | replicas: hits / queries (rate) |",
        "|---|---|---|",
    ]
    for workload, round_, engine, by_engine in sorted(cells, key=lambda c: c[:3]):
        parts = [
            f"{name}: {hits:.0f} / {queries:.0f} ({hits / queries:.0%})"
            if queries
            else f"{name}: 0 / 0"
            for name, (hits, queries) in by_engine.items()
        ]
        lines.append(f"| {workload} r{round_} | {ENGINES[engine]} | " + "; ".join(parts) + " |")
    return lines


def _machine_lines(runs: dict[tuple[str, str], list[dict[str, Any]]], engines: list[str]) -> list:
    """Per run: steal % of the machine's CPU time (worst second), the server's major faults."""
    cells = {
        (w, run["round"], e): run for (w, e), rs in runs.items() for run in rs if "steal %" in run
    }
    if not cells:
        return []
    lines = [
        "",
        "The machine during each run: steal (CPU time the hypervisor gave to other",
        "guests) as a share of all CPU time, in the worst second in brackets, and the",
        "server's major page faults (reads from disk).",
        "",
        "| run | " + " | ".join(ENGINES[e] for e in engines) + " |",
        "|---|" + "---|" * len(engines),
    ]
    for workload, round_ in sorted({(w, r) for w, r, _ in cells}):
        row = []
        for engine in engines:
            run = cells.get((workload, round_, engine))
            row.append(
                "-"
                if run is None
                else f"{run['steal %']:.1f}% "
                f"({run['steal % worst 1 s']:.0f}%), {run['major faults']:.0f}"
            )
        lines.append(f"| {workload} r{round_} | " + " | ".join(row) + " |")
    return lines


# -------------------------------------------------------------------- llama.cpp's calibration


def calibration_value(result: dict[str, Any], workload: str) -> float:
    """What a calibration trial is judged by: the median TPOT for B (lower is better), output
    tok/s for the others (higher is better)."""
    return result["median_tpot_ms"] if workload == "B" else result["output_throughput"]


def calibration_better(workload: str, value: float, best: float) -> bool:
    return value < best if workload == "B" else value > best


def cmd_calibration_value(ns: argparse.Namespace) -> int:
    print(calibration_value(json.loads(Path(ns.result).read_text()), ns.workload))
    return 0


def cmd_calibration_better(ns: argparse.Namespace) -> int:
    return 0 if calibration_better(ns.workload, ns.value, ns.best) else 1


def cmd_calibration_record(ns: argparse.Namespace) -> int:
    with open(ns.out, "a") as f:
        f.write(json.dumps({"workload": ns.workload, "config": ns.config, "value": ns.value}))
        f.write("\n")
    return 0


def describe_llama_config(config: str) -> str:
    """'per-slot|-b 512 -ub 128' -> 'KV per slot, -b 512 -ub 128'."""
    kv, _, flags = config.partition("|")
    kv = "KV per slot" if kv == "per-slot" else "one unified KV pool"
    return f"{kv}, `{flags.strip()}`" if flags.strip() else f"{kv}, defaults"


def _calibration_lines(results: Path) -> list:
    """llama.cpp's trials per workload and the one its rounds ran, from
    llamacpp-calibration.jsonl."""
    path = results / "llamacpp-calibration.jsonl"
    if not path.exists():
        return []
    values: dict[str, dict[str, float]] = {}  # workload -> config -> value
    for line in path.read_text().splitlines():
        if line.strip():
            trial = json.loads(line)
            values.setdefault(trial["workload"], {})[trial["config"]] = trial["value"]
    configs = list(dict.fromkeys(c for trials in values.values() for c in trials))
    lines = [
        "",
        "llama.cpp's configurations, each run briefly per workload before the rounds (a",
        "quarter of its prompts; B by median TPOT in ms, the others by output tok/s); its",
        "rounds ran the best (**bold**):",
        "",
        "| workload | " + " | ".join(describe_llama_config(c) for c in configs) + " |",
        "|---|" + "---|" * len(configs),
    ]
    for workload, trials in sorted(values.items()):
        best = next(iter(trials))
        for config, value in trials.items():
            if calibration_better(workload, value, trials[best]):
                best = config
        cells = [
            "-" if c not in trials else f"**{_fmt(trials[c])}**" if c == best else _fmt(trials[c])
            for c in configs
        ]
        lines.append(f"| {workload} | " + " | ".join(cells) + " |")
    return lines


def replace_section(document: str, section: str) -> str:
    """`document` with the text between the markers replaced by `section` (markers kept);
    the marked section is appended if the markers are missing."""
    block = f"{BEGIN}\n{section}{END}"
    start, end = document.find(BEGIN), document.find(END)
    if start == -1 or end == -1:
        return document.rstrip("\n") + "\n\n" + block + "\n"
    return document[:start] + block + document[end + len(END) :]


def cmd_table(ns: argparse.Namespace) -> int:
    results = Path(ns.results)
    runs = load_runs(results)
    if not runs:
        print(f"error: no results in {results}", file=sys.stderr)
        return 1
    header_path = results / "header.md"
    header = header_path.read_text().strip() if header_path.exists() else ""
    table = render_table(runs, header) + "\n".join(_calibration_lines(results))
    table = table.rstrip("\n") + "\n"
    print(table)
    if ns.write:
        target = Path(ns.write)
        document = target.read_text() if target.exists() else ""
        target.write_text(replace_section(document, table))
    return 0


def _fmt(value: float | None) -> str:
    if value is None:
        return "-"
    return (
        f"{value:.3f}"
        if abs(value) < 10
        else f"{value:.1f}"
        if abs(value) < 1000
        else f"{value:.0f}"
    )


def _ratio(ours: float | None, theirs: float | None) -> str:
    return "-" if not ours or not theirs else f"{ours / theirs:.2f}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="compare.py", description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    kv = commands.add_parser("kv", help="KV bytes for a number of tokens")
    kv.add_argument("model_dir")
    kv.add_argument("--tokens", type=int, required=True)
    kv.add_argument("--dtype", default="auto", choices=["auto", *DTYPE_BYTES])
    info = commands.add_parser("server-info", help="resolved settings from a server log")
    info.add_argument("engine", choices=list(ENGINES))
    info.add_argument("log")
    info.add_argument("--props", default=None, help="llama-server's /props answer (JSON)")
    rss = commands.add_parser("rss", help="RSS/PSS of a process tree")
    rss.add_argument("pid", type=int)
    watch = commands.add_parser("watch", help="sample steal and major faults until PID exits")
    watch.add_argument("pid", type=int)
    watch.add_argument("out")
    watch.add_argument("--interval", type=float, default=0.25, help="seconds between samples")
    prefix = commands.add_parser(
        "prefix-hits", help="prefix-cache hits per engine between two /metrics scrapes"
    )
    prefix.add_argument("before")
    prefix.add_argument("after")
    table = commands.add_parser("table", help="markdown table of medians and ratios")
    table.add_argument("results")
    table.add_argument("--write", default=None, metavar="BENCHMARKS.md")
    value = commands.add_parser("calibration-value", help="a calibration trial's measure")
    value.add_argument("result")
    value.add_argument("workload")
    better = commands.add_parser(
        "calibration-better", help="exit 0 if VALUE beats BEST for the workload"
    )
    better.add_argument("workload")
    better.add_argument("value", type=float)
    better.add_argument("best", type=float)
    record = commands.add_parser("calibration-record", help="append a trial to a JSONL file")
    record.add_argument("out")
    record.add_argument("workload")
    record.add_argument("config")
    record.add_argument("value", type=float)
    ns = parser.parse_args(argv)
    handlers = {
        "kv": cmd_kv,
        "server-info": cmd_server_info,
        "rss": cmd_rss,
        "watch": cmd_watch,
        "prefix-hits": cmd_prefix_hits,
        "table": cmd_table,
        "calibration-value": cmd_calibration_value,
        "calibration-better": cmd_calibration_better,
        "calibration-record": cmd_calibration_record,
    }
    return handlers[ns.command](ns)


if __name__ == "__main__":
    sys.exit(main())
