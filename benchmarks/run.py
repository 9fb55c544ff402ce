"""The whole benchmark suite: every case, every peer side by side, in one process.

Prints each case's tables as it finishes, then writes them as Markdown
(``benchmarks/results/<case>.md``) and raw numbers (``results.json``), draws the
charts (``docs/assets/*.png``) and rewrites the generated section of
``docs/performance.md``.

Run: ``make bench`` or ``python benchmarks/run.py [--quick] [--only CASE ...]``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import cached_partial
import cold
import compilation
import decode
import dispatch
import eager
import loops
import memory
import per_variable
import report
import stages
import targets
import write_sets
from _common import (
    RESULTS,
    Table,
    add_config_arguments,
    config_from,
    environment,
    print_tables,
    write_tables,
)

CASES = {
    "dispatch": dispatch.run_all,
    "per_variable": per_variable.run,
    "eager": eager.run,
    "memory": memory.run,
    "live_memory": memory.run_live,
    "compilation": compilation.run,
    "stages": stages.run,
    "decode": decode.run,
    "loops": loops.run,
    "write_sets": write_sets.run,
    "cached_partial": cached_partial.run,
    "cold": cold.run,
}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    add_config_arguments(parser)
    parser.add_argument("--only", nargs="+", choices=list(CASES), help="run only these cases")
    parser.add_argument("--out", type=Path, default=RESULTS, help="results directory")
    parser.add_argument("--no-chart", action="store_true", help="skip the PNG charts")
    parser.add_argument("--page", type=Path, default=report.PAGE, help="page to rewrite")
    parser.add_argument("--no-docs", action="store_true", help="do not rewrite the docs page")
    args = parser.parse_args(argv)
    config = config_from(args)
    print(f"treemode benchmark suite ({config.name}): {environment()}\n", flush=True)

    if not args.only:  # a whole run replaces the previous results
        (args.out / "results.json").unlink(missing_ok=True)
    start = time.perf_counter()
    for name in args.only or CASES:
        print(f"-- {name}", flush=True)
        tables: list[Table] = CASES[name](config)
        print_tables(tables)
        write_tables(tables, args.out, config)

    data = json.loads((args.out / "results.json").read_text())
    checks = targets.check(data)
    print_tables(checks)
    write_tables(checks, args.out, config)

    if not args.no_chart:
        import chart

        for path in chart.write_charts(args.out, args.page.parent / "assets"):
            print(f"wrote {path}")
    if not args.no_docs:
        report.rewrite(args.out, args.page)
        print(f"updated {args.page}")
    print(f"suite finished in {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
