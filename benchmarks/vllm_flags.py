"""Write vLLM's `vllm serve` flags as data (octavo/entrypoints/vllm_flags.json), so that
octavo's own parser and its tests can hold every one of them to a disposition
(octavo/entrypoints/vllm_compat.py). Run it with the Python of an environment that has vLLM
(benchmarks/compare.sh makes one):

    ~/.cache/octavo-compare/vllm-venv/bin/python benchmarks/vllm_flags.py

Each entry: the option strings (short ones and a boolean flag's `--no-` twin included),
whether it takes a value and how many (argparse's nargs), its choices, and the help group it
is listed under.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "octavo" / "entrypoints" / "vllm_flags.json"


def main() -> int:
    import vllm
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = make_arg_parser(FlexibleArgumentParser(prog="vllm serve"))
    groups = {}
    for group in parser._action_groups:
        for action in group._group_actions:
            groups[id(action)] = group.title or ""
    flags = []
    for action in parser._actions:
        options = list(action.option_strings)
        if not options or isinstance(action, argparse._HelpAction):
            continue
        takes_value = action.nargs != 0
        flags.append(
            {
                "options": options,
                "dest": action.dest,
                "nargs": action.nargs if takes_value else 0,
                "choices": [str(c) for c in action.choices] if action.choices else None,
                "group": groups.get(id(action), ""),
            }
        )
    data = {"vllm_version": vllm.__version__, "command": "vllm serve", "flags": flags}
    OUT.write_text(json.dumps(data, indent=1) + "\n")
    print(f"{len(flags)} flags of vLLM {vllm.__version__} -> {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
