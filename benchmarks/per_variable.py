"""Case 2: the cost of each Variable, per call.

The MLP forward pass of case 1 at several depths (8, 64, 256 and 1024 layers:
two Variables per layer), every peer side by side. For each peer, the extra
time over the floor is fitted with a straight line against the number of
Variables: the slope is the extra microseconds per Variable per call, and the
fit's R² (and the slope between consecutive depths) shows whether the cost is a
line (constant per Variable) or grows faster than the model.

Run: ``python benchmarks/per_variable.py [--quick]``.
"""

from __future__ import annotations

import numpy as np
from _common import Config, Table, case_main, measure, ratio_table
from dispatch import PEERS, forward_peers


def fit(nvars: list[int], extra: list[float]) -> tuple[float, float, float]:
    """Least-squares line ``extra = intercept + slope * nvars``; returns slope, intercept, R²."""
    x, y = np.asarray(nvars, float), np.asarray(extra, float)
    if len(x) < 2:
        return float("nan"), float("nan"), float("nan")
    slope, intercept = np.polyfit(x, y, 1)
    residual = y - (intercept + slope * x)
    total = float(np.sum((y - y.mean()) ** 2))
    r2 = 1.0 - float(np.sum(residual**2)) / total if total > 0 else 1.0
    return float(slope), float(intercept), r2


def run(config: Config) -> list[Table]:
    rows = []
    nvars = []
    for depth in config.depths:
        rows.append(
            (f"{depth} layers ({2 * depth} Variables)", measure(forward_peers(depth), config))
        )
        nvars.append(2 * depth)
        print(f"  measured {rows[-1][0]}", flush=True)
    by_depth = ratio_table(
        "per_variable_depths",
        "Forward pass by depth",
        PEERS,
        "floor",
        rows,
    )[0]
    by_depth.file = "per_variable"

    floor = [times["floor"].best for _, times in rows]
    fits = {}
    cells = []
    for peer in PEERS:
        own = [times[peer].best for _, times in rows]
        if peer == "floor":
            extra = own  # the floor's own cost per Variable, for scale
        else:
            extra = [p - f for p, f in zip(own, floor, strict=True)]
        slope, intercept, r2 = fit(nvars, extra)
        # Marginal cost between consecutive depths: equal on every segment for a line.
        per_var = [
            (extra[i] - extra[i - 1]) / (nvars[i] - nvars[i - 1]) for i in range(1, len(nvars))
        ]
        fits[peer] = {
            "slope_us": slope,
            "intercept_us": intercept,
            "r2": r2,
            "nvars": nvars,
            "extra_us": extra,
        }
        label = "floor (its own cost)" if peer == "floor" else peer
        cells.append(
            (
                label,
                [f"{slope:.2f}", f"{intercept:.0f}", f"{r2:.3f}"] + [f"{v:.2f}" for v in per_var],
            )
        )
    slope_table = Table(
        key="per_variable",
        title="Extra microseconds per Variable per call (forward, over the floor)",
        columns=["µs / Variable (slope)", "intercept µs", "R² of the line"]
        + [f"µs / Variable, {a}→{b}" for a, b in zip(nvars[:-1], nvars[1:], strict=True)],
        rows=cells,
        note="Slope and intercept of a least-squares line through (Variables, peer − floor). "
        "The last columns are the slope between consecutive depths: the same value on every "
        "segment (and R² near 1) means a constant cost per Variable, a growing one a curve.",
        data={"fits": fits},
    )
    return [slope_table, by_depth]


def main() -> None:
    case_main(__doc__, run)


if __name__ == "__main__":
    main()
