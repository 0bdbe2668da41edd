"""benchmarks/compare.py, the arithmetic and parsing behind benchmarks/compare.sh: KV sizes, the
facts read from server logs, and the table of medians and ratios written into BENCHMARKS.md."""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib

import psutil
import pytest

SCRIPT = pathlib.Path(__file__).resolve().parent.parent / "benchmarks" / "compare.py"


@pytest.fixture(scope="module")
def compare():
    spec = importlib.util.spec_from_file_location("compare_script", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


SMOLLM2 = {
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "hidden_size": 576,
    "num_hidden_layers": 30,
    "torch_dtype": "bfloat16",
}


def test_kv_bytes_per_token_counts_keys_and_values_of_every_layer(compare) -> None:
    # 2 (K, V) x 30 layers x 3 kv heads x 64 dims x 4 bytes: the 46080 octavo's own log states.
    assert compare.kv_bytes_per_token(SMOLLM2, 4) == 46080
    assert compare.kv_bytes_per_token(SMOLLM2, 2) == 23040
    no_gqa = {"num_attention_heads": 4, "hidden_size": 64, "num_hidden_layers": 2, "head_dim": 32}
    assert compare.kv_bytes_per_token(no_gqa, 2) == 2 * 2 * 4 * 32 * 2


def test_kv_command_resolves_auto_to_the_checkpoint_dtype(compare, tmp_path, capsys) -> None:
    (tmp_path / "config.json").write_text(json.dumps(SMOLLM2))
    assert compare.main(["kv", str(tmp_path), "--tokens", "1000"]) == 0
    auto = json.loads(capsys.readouterr().out)
    assert auto == {
        "tokens": 1000,
        "dtype": "bfloat16",
        "bytes_per_token": 23040,
        "bytes": 23_040_000,
    }
    compare.main(["kv", str(tmp_path), "--tokens", "1000", "--dtype", "float32"])
    assert json.loads(capsys.readouterr().out)["bytes"] == 46_080_000


def test_server_info_reads_what_each_server_logged(compare) -> None:
    octavo_log = (
        "INFO 2026-11-29 21:45:21,417 octavo.worker.setup: dtype float32 (auto: the CPU has no "
        "native bfloat16 (no AVX512-BF16/AMX), so float32)\n"
        "INFO 2026-11-29 21:45:21,417 octavo.worker.setup: KV cache: 256 blocks x 128 tokens = "
        "32768 tokens (720.0 MiB, bfloat16); 4 requests of max_model_len (8192) fit\n"
    )
    assert compare.server_info("octavo", octavo_log) == {
        "kv_tokens": 32768,
        "dtype": "float32, bfloat16 KV",
    }
    vllm_log = (
        "INFO [core.py:133] Initializing a V1 LLM engine (v0.32.0) with config: model='m', "
        "dtype=torch.float32, max_seq_len=8192, kv_cache_dtype=auto, device_config=cpu\n"
        "INFO [kv_cache_utils.py:2327] CPU KV cache size: 32,768 tokens, Maximum concurrency "
        "for 8,192 tokens per request: 4.00x\n"
    )
    # vLLM's "auto" cache holds its compute dtype.
    assert compare.server_info("vllm", vllm_log) == {
        "kv_tokens": 32768,
        "dtype": "float32, float32 KV",
    }
    fp8 = vllm_log.replace("kv_cache_dtype=auto", "kv_cache_dtype=fp8_e5m2")
    assert compare.server_info("vllm", fp8)["dtype"] == "float32, fp8_e5m2 KV"
    assert compare.server_info("vllm", "nothing useful") == {}
    llama = compare.server_info("llamacpp", "", {"model_ftype": "BF16"})
    assert llama == {"dtype": "BF16 weights, f16 KV"}


def _result(out_tps: float, ttft_p99: float, itls: list[list[float]], completed: int = 8):
    return {
        "completed": completed,
        "request_throughput": out_tps / 128,
        "output_throughput": out_tps,
        "total_token_throughput": 3 * out_tps,
        "median_ttft_ms": ttft_p99 / 2,
        "p99_ttft_ms": ttft_p99,
        "median_tpot_ms": 20.0,
        "median_itl_ms": 19.0,
        "p99_itl_ms": 50.0,
        "itls": itls,
    }


def _write_run(directory: pathlib.Path, name: str, result: dict, meta: dict) -> None:
    (directory / f"{name}.json").write_text(json.dumps(result))
    (directory / f"{name}.meta.json").write_text(json.dumps(meta))


def test_table_holds_medians_over_rounds_and_ratios_to_each_peer(compare, tmp_path) -> None:
    meta = {"kv_tokens": 32768, "kv_tokens_asked": 32768, "dtype": "float32"}
    _write_run(
        tmp_path,
        "A-octavo-r1",
        _result(150.0, 900.0, [[0.01, 0.30], [0.02]]),
        {**meta, "rss_kib": 2048 * 1024, "pss_kib": 2000 * 1024},
    )
    _write_run(
        tmp_path,
        "A-octavo-r2",
        _result(170.0, 1100.0, [[0.01, 0.10], [0.04]]),
        {**meta, "rss_kib": 3072 * 1024, "pss_kib": 3000 * 1024},
    )
    _write_run(tmp_path, "A-vllm-r1", _result(100.0, 2000.0, [[0.5]]), meta)
    _write_run(tmp_path, "A-vllm-r2", _result(120.0, 2000.0, [[0.5]]), meta)
    # A failed run (nothing completed) is listed but left out of the medians.
    _write_run(tmp_path, "A-vllm-r3", _result(1.0, 1.0, [], completed=0), meta)
    (tmp_path / "A-vllm-r1.props.json").write_text("{}")  # not a result: skipped
    runs = compare.load_runs(tmp_path)
    assert sorted(runs) == [("A", "octavo"), ("A", "vllm")] and len(runs[("A", "vllm")]) == 3

    octavo = compare.medians(runs[("A", "octavo")])
    assert octavo["out tok/s"] == pytest.approx(160.0)
    assert octavo["TTFT p99"] == pytest.approx(1000.0)
    # Max gap per stream: round 1 (300, 20) ms, round 2 (100, 40) ms; p50 over streams is the
    # middle of two, then the median of the rounds.
    assert octavo["max gap p50"] == pytest.approx(((300 + 20) / 2 + (100 + 40) / 2) / 2)
    assert octavo["RSS MiB"] == pytest.approx(2560.0)
    assert compare.medians(runs[("A", "vllm")])["out tok/s"] == pytest.approx(110.0)

    table = compare.render_table(runs, "## header")
    rows = {
        tuple(cell.strip() for cell in line.split("|")[1:4]): line
        for line in table.splitlines()
        if line.startswith("| A ")
    }
    assert "| 160.0 |" in rows[("A", "octavo", "2")]
    assert "| 110.0 |" in rows[("A", "vLLM", "2")]
    ratio = rows[("A", "octavo/vLLM", "")].split("|")[4:]
    assert ratio[1].strip() == f"{160 / 110:.2f}"  # out tok/s
    assert ratio[4].strip() == f"{1000 / 2000:.2f}"  # TTFT p99
    assert "| octavo | float32 | 32768 / 32768 | 2560 |" in table


def test_replace_section_keeps_the_rest_of_the_document(compare) -> None:
    document = f"# Benchmarks\n\nintro\n\n{compare.BEGIN}\nold table\n{compare.END}\n\n## Later\n"
    updated = compare.replace_section(document, "new table\n")
    assert updated == (
        f"# Benchmarks\n\nintro\n\n{compare.BEGIN}\nnew table\n{compare.END}\n\n## Later\n"
    )
    appended = compare.replace_section("# Benchmarks\n", "t\n")
    assert appended == f"# Benchmarks\n\n{compare.BEGIN}\nt\n{compare.END}\n"


def test_watch_summary_gives_the_steal_share_its_worst_second_and_major_faults(compare) -> None:
    # Four samples 0.5 s apart: 100 jiffies of CPU time each, steal 0, 10, 40 jiffies.
    samples = [
        {"t": 0.5 * i, "cpu": 100 * i, "steal": s, "major_faults": f}
        for i, (s, f) in enumerate([(0, 3), (0, 3), (10, 5), (50, 9)])
    ]
    summary = compare.watch_summary(samples)
    assert summary["steal %"] == pytest.approx(100 * 50 / 300)
    # Seconds: samples 0-2 (10 of 200 jiffies), 1-3 (50 of 200).
    assert summary["steal % worst 1 s"] == pytest.approx(25.0)
    assert summary["major faults"] == 6
    assert compare.watch_summary(samples[:1]) == {}


def test_machine_sample_reads_this_process(compare) -> None:
    faults: dict[int, int] = {}
    first = compare.machine_sample(os.getpid(), faults)
    # This process and its children (the test server's engine core among them).
    family = {os.getpid()} | {child.pid for child in psutil.Process().children(recursive=True)}
    assert os.getpid() in faults and set(faults) <= family, (faults, family)
    assert first["major_faults"] == sum(faults.values()) >= 0
    # A process that exited keeps its last count in the sum.
    faults[-1] = 5
    second = compare.machine_sample(os.getpid(), faults)
    assert second["major_faults"] >= first["major_faults"] + 5
    assert second["t"] >= first["t"] and second["cpu"] >= first["cpu"] > 0
    assert 0 <= first["steal"] <= first["cpu"]


def test_table_lists_the_machine_during_each_run(compare, tmp_path) -> None:
    meta = {"kv_tokens": 32768, "kv_tokens_asked": 32768, "dtype": "float32"}
    for name in ("C-octavo-r1", "C-vllm-r1", "C-octavo-r2"):
        _write_run(tmp_path, name, _result(100.0, 500.0, [[0.01]]), meta)
    samples = [
        {"t": 0.0, "cpu": 0, "steal": 0, "major_faults": 0},
        {"t": 1.0, "cpu": 200, "steal": 30, "major_faults": 12},
    ]
    (tmp_path / "C-octavo-r1.watch.jsonl").write_text(
        "".join(json.dumps(s) + "\n" for s in samples)
    )
    table = compare.render_table(compare.load_runs(tmp_path), "")
    assert "| C r1 | 15.0% (15%), 12 | - |" in table
    assert "C r2" not in table  # no watch file: no row


def test_prefix_hits_per_replica_between_two_scrapes_and_in_the_table(compare, tmp_path) -> None:
    def scrape(hits: dict[str, float], queries: dict[str, float]) -> str:
        lines = [
            "# TYPE vllm:prefix_cache_hits counter",
            "# TYPE vllm:prefix_cache_queries counter",
        ]
        for engine in hits:
            labels = f'{{engine="{engine}",model_name="m"}}'
            lines.append(f"vllm:prefix_cache_hits_total{labels} {hits[engine]}")
            lines.append(f"vllm:prefix_cache_queries_total{labels} {queries[engine]}")
        return "\n".join(lines) + "\n"

    before = scrape({"0": 10.0, "1": 0.0}, {"0": 100.0, "1": 64.0})
    after = scrape({"0": 310.0, "1": 256.0}, {"0": 1100.0, "1": 576.0})
    by_engine = compare.prefix_hits_by_engine(before, after)
    assert by_engine == {"0": [300.0, 1000.0], "1": [256.0, 512.0]}
    assert compare.prefix_hits_by_engine("", "") == {}  # a server without the counters
    meta = {"kv_tokens": 32768, "kv_tokens_asked": 32768, "dtype": "float32"}
    _write_run(
        tmp_path,
        "D-octavo-r1",
        _result(100.0, 500.0, [[0.01]]),
        {**meta, "prefix_hits_by_engine": by_engine},
    )
    _write_run(  # one engine: no replicas to tell apart, no row
        tmp_path,
        "D-vllm-r1",
        _result(100.0, 500.0, [[0.01]]),
        {**meta, "prefix_hits_by_engine": {"0": [5.0, 10.0]}},
    )
    table = compare.render_table(compare.load_runs(tmp_path), "")
    assert "| D r1 | octavo | 0: 300 / 1000 (30%); 1: 256 / 512 (50%) |" in table
    assert "| D r1 | vLLM |" not in table


def test_llama_calibration_picks_per_workload_and_the_table_says_what_ran(
    compare, tmp_path, capsys
) -> None:
    """The calibration's helpers as compare.sh calls them: a trial's measure (B's median TPOT,
    the others' output tok/s), which of two is better, the trials recorded; the table lists
    every trial with the best in bold and names the configuration each workload's rounds ran."""
    result = tmp_path / "trial.json"
    result.write_text(json.dumps({"median_tpot_ms": 17.5, "output_throughput": 140.0}))
    assert compare.main(["calibration-value", str(result), "B"]) == 0
    assert compare.main(["calibration-value", str(result), "A"]) == 0
    assert capsys.readouterr().out.split() == ["17.5", "140.0"]
    assert compare.main(["calibration-better", "B", "16", "17.5"]) == 0
    assert compare.main(["calibration-better", "B", "18", "17.5"]) == 1
    assert compare.main(["calibration-better", "A", "150", "140"]) == 0
    assert compare.main(["calibration-better", "A", "130", "140"]) == 1
    trials = tmp_path / "llamacpp-calibration.jsonl"
    for workload, config, value in [
        ("A", "per-slot|", 140.0),
        ("A", "unified|", 60.0),
        ("A", "per-slot|-b 512 -ub 128", 150.0),
        ("B", "per-slot|", 17.5),
        ("B", "unified|", 16.9),
    ]:
        assert compare.main(["calibration-record", str(trials), workload, config, str(value)]) == 0
    lines = compare._calibration_lines(tmp_path)
    header = (
        "| workload | KV per slot, defaults | one unified KV pool, defaults | KV per slot, "
        "`-b 512 -ub 128` |"
    )
    assert header in lines
    assert "| A | 140.0 | 60.0 | **150.0** |" in lines
    assert "| B | 17.5 | **16.9** | - |" in lines
    meta = {"kv_tokens": 32768, "kv_tokens_asked": 32768, "dtype": "bfloat16"}
    _write_run(
        tmp_path,
        "A-llamacpp-r1",
        _result(150.0, 900.0, [[0.01]]),
        {**meta, "llama_settings": "per-slot|-b 512 -ub 128"},
    )
    _write_run(tmp_path, "B-llamacpp-r1", _result(60.0, 90.0, [[0.01]]), meta)
    table = compare.render_table(compare.load_runs(tmp_path), "## header")
    assert "llama.cpp ran: A: KV per slot, `-b 512 -ub 128`." in table
