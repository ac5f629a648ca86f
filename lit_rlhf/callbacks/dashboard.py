"""The embedded stability dashboard: a PNG of a run's health from its CSV logs (no W&B needed).

RL runs started by train.py keep ``<run>/csv/metrics.csv`` whatever the logger (W&B, TensorBoard,
none: lit_rlhf/launch/runner.py adds a CSV log beside them), so every such run can be drawn.

    python -m lit_rlhf.callbacks.dashboard RUN_DIR [RUN_DIR ...] [--labels a b] [--out stability.png]

Panels (MOSS-RLHF's collapse signals, docs/algorithms.md §4): reward (mean with the 5–95% band,
validation points), KL to the reference, perplexity under policy and reference, response
length (mean, max, truncation rate), the reward histogram over RL steps (from
``reward_scores.jsonl``), and policy entropy / clip fraction. Several runs overlay in one figure.
"""

from __future__ import annotations

import argparse
import csv
import glob
import json
import math
import os
from collections.abc import Sequence


def find_metrics_csv(run_dir: str) -> str | None:
    """The CSVLogger file of a run directory (``<run>/csv/metrics.csv`` by default)."""
    direct = os.path.join(run_dir, "csv", "metrics.csv")
    if os.path.isfile(direct):
        return direct
    found = sorted(glob.glob(os.path.join(run_dir, "**", "metrics.csv"), recursive=True))
    return found[0] if found else None


def missing_csv_message(run_dir: str) -> str:
    """What the report needs, in one line, for a run directory it cannot draw."""
    if not os.path.isdir(run_dir):
        return f"{run_dir}: not a directory (give a run directory: logs/<stage>/runs/<time>)"
    return (
        f"{run_dir}: no metrics.csv (the report reads <run>/csv/metrics.csv, which RL runs of train.py "
        "keep beside any logger; an older run with logger=wandb alone has none: see its W&B dashboard)"
    )


def read_series(path: str) -> dict[str, tuple[list[float], list[float]]]:
    """metrics.csv → {metric: (steps, values)}; blank cells skipped."""
    series: dict[str, tuple[list[float], list[float]]] = {}
    with open(path, newline="") as fh:
        for row in csv.DictReader(fh):
            step = row.get("step")
            if step in (None, ""):
                continue
            for key, value in row.items():
                if key in ("step", "epoch") or value in (None, ""):
                    continue
                try:
                    v = float(value)
                except ValueError:
                    continue
                if math.isfinite(v):
                    xs, ys = series.setdefault(key, ([], []))
                    xs.append(float(step))
                    ys.append(v)
    return series


def read_scores(run_dir: str) -> list[tuple[int, list[float]]]:
    path = os.path.join(run_dir, "reward_scores.jsonl")
    if not os.path.isfile(path):
        return []
    with open(path) as fh:
        return [(int(r["step"]), r["scores"]) for r in map(json.loads, fh) if r.get("scores")]


def _line(ax, series, key, color, label, **kw) -> bool:
    if key in series:
        ax.plot(*series[key], color=color, label=label, **kw)
        return True
    return False


def _curve_panels(axes, series: dict, color: str, label: str) -> None:
    """One run's curves on the five line panels."""
    ax = axes[0, 0]
    drawn = _line(ax, series, "reward/score_mean", color, f"{label} train")
    if drawn and "reward/score_q05" in series and "reward/score_q95" in series:
        xs, lo = series["reward/score_q05"]
        _, hi = series["reward/score_q95"]
        ax.fill_between(xs, lo, hi, color=color, alpha=0.15, linewidth=0)
    if "val/score_mean" in series:
        ax.plot(*series["val/score_mean"], "o--", color=color, label=f"{label} val", markersize=4)
    if "val/gold_score_mean" in series:  # a validation-only gold reward (embedded task)
        ax.plot(*series["val/gold_score_mean"], "s:", color=color, label=f"{label} val gold", markersize=4)
    _line(axes[0, 1], series, "stability/kl", color, f"{label} KL / response")
    _line(axes[0, 1], series, "stability/kl_k3", color, f"{label} k3", linestyle=":")
    _line(axes[0, 2], series, "stability/perplexity", color, f"{label} policy")
    _line(axes[0, 2], series, "stability/perplexity_ref", color, f"{label} reference", linestyle="--")
    _line(axes[1, 0], series, "stability/response_length", color, f"{label} mean")
    _line(axes[1, 0], series, "stability/response_length_max", color, f"{label} max", linestyle=":")
    _line(axes[1, 2], series, "policy/entropy", color, f"{label} entropy")
    _line(axes[1, 2], series, "policy/clipfrac", color, f"{label} clip fraction", linestyle="--")


def _histogram_panel(ax, runs: list, labels: Sequence[str]) -> None:
    """Reward histogram over time: one column of bins per logged step, runs side by side."""
    import numpy as np

    all_scores = [s for _, scores in runs for _, row in scores for s in row]
    if not all_scores:
        ax.text(0.5, 0.5, "no reward_scores.jsonl", ha="center", va="center", transform=ax.transAxes)
        return
    lo, hi = float(np.percentile(all_scores, 0.5)), float(np.percentile(all_scores, 99.5))
    if hi <= lo:
        hi = lo + 1.0
    bins = np.linspace(lo, hi, 41)
    images = []
    for _, scores in runs:
        if scores:
            images.append(np.stack([np.histogram(np.clip(row, lo, hi), bins=bins)[0] for _, row in scores], 1))
    grid = np.concatenate(images, 1) if len(images) > 1 else images[0]
    ax.imshow(
        grid, aspect="auto", origin="lower", cmap="magma", extent=[0, grid.shape[1], lo, hi], interpolation="nearest"
    )
    offset = 0
    for (_, scores), label in zip(runs, labels):
        if scores:
            ax.axvline(offset, color="white", linewidth=0.8)
            ax.text(offset + 0.5, hi, label, color="white", va="top", fontsize=8)
            offset += len(scores)
    ax.set_xlabel("logged RL step (runs side by side)")


PANEL_TITLES = [
    ("reward: train (band 5-95%), val, val gold", "score"),
    ("KL(policy || reference)", "nats / response"),
    ("perplexity of responses", "perplexity"),
    ("response length", "tokens"),
    ("reward histogram over time", "score"),
    ("policy entropy / clip fraction", ""),
]


def render(run_dirs: Sequence[str], out: str, labels: Sequence[str] | None = None, title: str | None = None) -> str:
    """Write the stability PNG for one or more runs; returns its path.

    Raises:
        FileNotFoundError: a run directory without a metrics.csv (:func:`missing_csv_message`).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = list(labels) if labels else [os.path.basename(os.path.normpath(d)) for d in run_dirs]
    runs = []
    for d in run_dirs:
        path = find_metrics_csv(d)
        if path is None:
            raise FileNotFoundError(missing_csv_message(d))
        runs.append((read_series(path), read_scores(d)))
    fig, axes = plt.subplots(2, 3, figsize=(16, 8.5))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, ((series, _), label) in enumerate(zip(runs, labels)):
        _curve_panels(axes, series, colors[i % len(colors)], label)
    _histogram_panel(axes[1, 1], runs, labels)
    for ax, (t, ylabel) in zip(axes.flat, PANEL_TITLES):
        ax.set_title(t)
        ax.set_ylabel(ylabel)
        if ax is not axes[1, 1]:
            ax.set_xlabel("RL step")
            if ax.get_legend_handles_labels()[0]:
                ax.legend(fontsize=8)
            ax.grid(alpha=0.3)
    axes[0, 2].set_yscale("log")  # a collapsing run's reference perplexity explodes; keep both readable
    fig.suptitle(title or "lit_rlhf stability: " + ", ".join(labels))
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def main(argv: Sequence[str] | None = None, prog: str = "python -m lit_rlhf.callbacks.dashboard") -> None:
    """``lit-rlhf report`` (and ``python -m lit_rlhf.callbacks.dashboard``): render the runs' dashboard."""
    ap = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    ap.add_argument("run_dirs", nargs="+", help="run directories (with csv/metrics.csv)")
    ap.add_argument("--labels", nargs="*", help="legend names, one per run")
    ap.add_argument("--out", help="output PNG (default: <first run dir>/stability.png)")
    args = ap.parse_args(argv)
    out = args.out or os.path.join(args.run_dirs[0], "stability.png")
    missing = [d for d in args.run_dirs if not os.path.isdir(d) or find_metrics_csv(d) is None]
    if missing:
        raise SystemExit(f"{prog}: {missing_csv_message(missing[0])}")
    print(render(args.run_dirs, out, args.labels))


if __name__ == "__main__":
    main()
