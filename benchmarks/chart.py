"""Charts of a run's results (matplotlib, Agg backend): PNGs for docs/performance.md.

- ``benchmarks.png``: dispatch ratios to the floor, every case and peer (log scale);
- ``per_variable.png``: extra microseconds over the floor against the number
  of Variables, per peer, with the fitted lines.

Run: ``python benchmarks/chart.py`` (reads ``benchmarks/results/results.json``;
needs ``pip install -e '.[bench]'``).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from _common import RESULTS

ASSETS = Path(__file__).resolve().parent.parent / "docs" / "assets"


def dispatch_chart(data: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    table = data["dispatch"]
    peers = [p for p in table["columns"] if p != "floor"]
    cases = list(table["us"])
    fig, ax = plt.subplots(figsize=(11, 5.6), dpi=110)
    width = 0.8 / len(peers)
    for j, peer in enumerate(peers):
        ratios = [table["us"][c][peer] / table["us"][c]["floor"] for c in cases]
        xs = [i + (j - (len(peers) - 1) / 2) * width for i in range(len(cases))]
        ax.bar(xs, ratios, width, label=peer)
    ax.axhline(1.0, color="black", linewidth=1, linestyle="--", label="floor (jax.jit, flat tuple)")
    ax.set_yscale("log")
    ax.set_xticks(range(len(cases)))
    ax.set_xticklabels([c.replace(", ", "\n") for c in cases])
    ax.set_ylabel("time per call / floor (log scale, lower is better)")
    ax.set_title("Dispatch cost per call, ratio to jax.jit on a flat tuple (best sample)")
    # The legend sits below the axes, so it can never cover a bar.
    ax.legend(ncol=4, fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.16), frameon=False)
    ax.grid(axis="y", which="both", alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)


def per_variable_chart(data: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fits = data["per_variable"]["fits"]
    fig, ax = plt.subplots(figsize=(10, 4.8), dpi=110)
    lowest = float("inf")
    for peer, f in fits.items():
        if peer == "floor":
            continue
        xs = f["nvars"]
        points = [(x, y) for x, y in zip(xs, f["extra_us"], strict=True) if y > 0]
        line = ax.plot(
            *zip(*points, strict=True), "o", label=f"{peer}: {f['slope_us']:.2f} µs/Variable"
        )[0]
        lowest = min([lowest, *(y for _, y in points)])
        dense = [xs[0] * (xs[-1] / xs[0]) ** (i / 49) for i in range(50)]
        fitted = [(x, f["intercept_us"] + f["slope_us"] * x) for x in dense]
        fitted = [(x, y) for x, y in fitted if y > 0]  # a log axis shows positive values only
        if fitted:
            ax.plot(*zip(*fitted, strict=True), "-", color=line.get_color(), alpha=0.6)
    if lowest < float("inf"):
        ax.set_ylim(bottom=lowest / 2)
    ax.set_xscale("log")
    ax.set_yscale("log")
    nvars = next(iter(fits.values()))["nvars"]
    ax.set_xticks(nvars, [str(n) for n in nvars])
    ax.minorticks_off()
    ax.set_xlabel("Variables in the model (2 per layer)")
    ax.set_ylabel("extra µs per call over the floor (log)")
    ax.set_title("Cost per Variable: forward pass, MLP of growing depth (lines: fits)")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    ax.grid(which="both", alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)


def write_charts(results: Path = RESULTS, assets: Path = ASSETS) -> list[Path]:
    data = json.loads((results / "results.json").read_text())
    written = []
    if "dispatch" in data:
        dispatch_chart(data, assets / "benchmarks.png")
        written.append(assets / "benchmarks.png")
    if "per_variable" in data:
        per_variable_chart(data, assets / "per_variable.png")
        written.append(assets / "per_variable.png")
    return written


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--results", type=Path, default=RESULTS)
    parser.add_argument("--assets", type=Path, default=ASSETS)
    args = parser.parse_args()
    for path in write_charts(args.results, args.assets):
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
