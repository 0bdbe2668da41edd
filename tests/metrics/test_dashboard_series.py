"""benchmarks/vllm_dashboard_series.py, which lists the series Grafana dashboards read, and the
list kept from vLLM's dashboards (tests/data/vllm_dashboard_series.json), which
tests/server/test_metrics.py holds /metrics to."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "vllm_dashboard_series.py"
DATA = ROOT / "tests" / "data" / "vllm_dashboard_series.json"


def load_script():
    spec = importlib.util.spec_from_file_location("vllm_dashboard_series", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_names_come_from_selectors_ranges_and_label_values() -> None:
    dashboard = {
        "panels": [
            {
                "type": "row",
                "panels": [
                    {
                        "targets": [
                            {
                                "expr": "histogram_quantile(0.9, sum by (le) (rate("
                                'vllm:time_to_first_token_seconds_bucket{model_name=~"$m"}'
                                "[$__rate_interval])))",
                                "legendFormat": "{{model_name}}",
                            },
                            {"expr": "rate(vllm_prompt_tokens_total[$__interval]) / 2"},
                            {"expr": 'count(up{job=~"$job"} == 0) or vector(0)'},
                        ]
                    }
                ],
            }
        ],
        "templating": {
            "list": [
                {
                    "definition": "label_values(vllm:num_requests_running, job)",
                    "query": {"query": "label_values(vllm:num_requests_running, job)"},
                },
                {"query": "100ms : 0.1, 1s : 1.0", "type": "custom"},
            ]
        },
    }
    assert load_script().series_names(dashboard) == [
        "up",
        "vllm:num_requests_running",
        "vllm:time_to_first_token_seconds_bucket",
        "vllm_prompt_tokens_total",
    ]


def test_the_kept_list_is_sorted_sourced_and_explains_every_exception() -> None:
    data = json.loads(DATA.read_text())
    dashboards = [d.get("name", Path(d["file"]).name) for d in data["dashboards"]]
    assert len(set(dashboards)) == len(dashboards), "two dashboards share a name"
    assert all(d["commit"] for d in data["dashboards"])
    # Every dashboard is read: none is left for later.
    assert not data.get("not_yet_listed")
    names = [entry["name"] for entry in data["series"]]
    assert names == sorted(set(names))
    for entry in data["series"]:
        assert entry["dashboards"] and set(entry["dashboards"]) <= set(dashboards), entry
        # Each dashboard that reads a series names it once.
        assert len(set(entry["dashboards"])) == len(entry["dashboards"]), entry
        if entry["name"].startswith("vllm_"):
            assert entry["served_as"] == "vllm:" + entry["name"].removeprefix("vllm_")
        exceptions = [entry.get(k) for k in ("not_applicable", "from_prometheus") if k in entry]
        assert all(exceptions), entry
        labels = entry.get("labels", [])
        assert all(isinstance(label, str) and label for label in labels), entry
