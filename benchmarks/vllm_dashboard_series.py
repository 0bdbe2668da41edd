"""List the metric series that Grafana dashboards' PromQL reads, so that a test can hold octavo's
/metrics to vLLM's example dashboards (tests/data/vllm_dashboard_series.json). Run it over the
dashboards of a vLLM checkout:

    python benchmarks/vllm_dashboard_series.py vllm/examples/observability/dashboards/grafana/*.json

It prints one JSON object: for each dashboard file, the series names its panel queries and
template variables name (a histogram's `_bucket`, `_sum` and `_count` as written). A name is
what stands before a label matcher or a range (`name{...}`, `name[5m]`) or the first argument
of `label_values(name, label)`. The data file adds to this by hand what needs judgment: which
series have no meaning in octavo, and why.
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

_NAME = r"[A-Za-z_:][A-Za-z0-9_:]*"
# A metric name directly followed by its label matchers or a range selector.
_SELECTOR = re.compile(rf"(?<![A-Za-z0-9_:$.])({_NAME})\s*[{{\[]")
_LABEL_VALUES = re.compile(rf"label_values\(\s*({_NAME})\s*[,{{)]")


def queries(dashboard: Any) -> Iterator[str]:
    """Every PromQL string of a dashboard: panel targets' `expr` and template variables'
    `query` / `definition`, rows and nested panels included."""
    if isinstance(dashboard, dict):
        for key, value in dashboard.items():
            if key in ("expr", "definition", "query") and isinstance(value, str):
                yield value
            else:
                yield from queries(value)
    elif isinstance(dashboard, list):
        for item in dashboard:
            yield from queries(item)


def series_names(dashboard: Any) -> list[str]:
    """The sorted metric names the dashboard's queries select."""
    names: set[str] = set()
    for query in queries(dashboard):
        names.update(_SELECTOR.findall(query))
        names.update(_LABEL_VALUES.findall(query))
    return sorted(names)


def main(paths: list[str]) -> int:
    if not paths:
        print(__doc__, file=sys.stderr)
        return 2
    result = {Path(path).name: series_names(json.loads(Path(path).read_text())) for path in paths}
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
