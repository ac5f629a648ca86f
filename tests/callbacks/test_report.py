import csv
import json
import subprocess
import sys

import numpy as np
import pytest

from lit_rlhf.callbacks.dashboard import read_series, render
from tests.conftest import ROOT


def fake_run(path, drift: float, steps: int = 30):
    (path / "csv").mkdir(parents=True)
    keys = [
        "step",
        "reward/score_mean",
        "reward/score_q05",
        "reward/score_q95",
        "stability/kl",
        "stability/kl_k3",
        "stability/perplexity",
        "stability/perplexity_ref",
        "stability/response_length",
        "stability/response_length_max",
        "policy/entropy",
        "policy/clipfrac",
        "val/score_mean",
    ]
    rng = np.random.default_rng(0)
    with open(path / "csv" / "metrics.csv", "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=keys)
        w.writeheader()
        for s in range(steps):
            w.writerow(
                {
                    "step": s,
                    "reward/score_mean": 0.1 * s,
                    "reward/score_q05": 0.1 * s - 1,
                    "reward/score_q95": 0.1 * s + 1,
                    "stability/kl": drift * s,
                    "stability/kl_k3": 0.5 * drift * s,
                    "stability/perplexity": 6 - 0.1 * s,
                    "stability/perplexity_ref": 6,
                    "stability/response_length": 10 + drift * s,
                    "stability/response_length_max": 20 + drift * s,
                    "policy/entropy": 2.0,
                    "policy/clipfrac": 0.05,
                    "val/score_mean": 0.1 * s if s % 10 == 0 else "",
                }
            )
    with open(path / "reward_scores.jsonl", "w") as fh:
        for s in range(steps):
            fh.write(json.dumps({"step": s, "scores": (rng.normal(0.1 * s, 0.5, 16)).tolist()}) + "\n")


def test_series_parsing_skips_blanks(tmp_path):
    fake_run(tmp_path / "a", 0.1)
    series = read_series(str(tmp_path / "a" / "csv" / "metrics.csv"))
    assert series["val/score_mean"][0] == [0.0, 10.0, 20.0]
    assert len(series["stability/kl"][0]) == 30


def test_figure_draws_each_logged_series_in_its_panel(tmp_path, monkeypatch):
    """The figure ``render`` saves: the six titled panels, each run's logged series as lines of exactly
    the logged values (reward with its 5-95% band and validation points, KL, perplexity on a log scale,
    length, entropy / clip fraction), the reward histogram with one column of all 16 scores per
    logged step, runs side by side, and the PNG at the figure's size."""
    import matplotlib.figure
    import matplotlib.image as mpimg

    from lit_rlhf.callbacks.dashboard import PANEL_TITLES

    drifts = {"ppo": 0.3, "ppo_max": 0.05}
    for name, drift in drifts.items():
        fake_run(tmp_path / name, drift)
    saved = []
    original = matplotlib.figure.Figure.savefig
    monkeypatch.setattr(
        matplotlib.figure.Figure, "savefig", lambda fig, *a, **k: (saved.append(fig), original(fig, *a, **k))[1]
    )
    out = render([str(tmp_path / n) for n in drifts], str(tmp_path / "both.png"))
    (fig,) = saved
    axes = fig.axes[:6]
    assert [ax.get_title() for ax in axes] == [t for t, _ in PANEL_TITLES]
    assert all(name in fig.get_suptitle() for name in drifts)
    steps = np.arange(30.0)

    def line(ax, label, xs=steps):
        (found,) = [ln for ln in ax.get_lines() if ln.get_label() == label]
        assert np.array_equal(found.get_xdata(), xs), label
        return np.asarray(found.get_ydata())

    reward, kl, ppl, length, hist, policy = axes
    for name, drift in drifts.items():
        assert np.allclose(line(reward, f"{name} train"), 0.1 * steps)
        assert np.allclose(line(reward, f"{name} val", xs=[0.0, 10.0, 20.0]), [0.0, 1.0, 2.0])  # logged every 10 steps
        assert np.allclose(line(kl, f"{name} KL / response"), drift * steps)
        assert np.allclose(line(kl, f"{name} k3"), 0.5 * drift * steps)
        assert np.allclose(line(ppl, f"{name} policy"), 6 - 0.1 * steps) and np.allclose(
            line(ppl, f"{name} reference"), 6
        )
        assert np.allclose(line(length, f"{name} mean"), 10 + drift * steps)
        assert np.allclose(line(length, f"{name} max"), 20 + drift * steps)
        assert np.allclose(line(policy, f"{name} entropy"), 2.0) and np.allclose(
            line(policy, f"{name} clip fraction"), 0.05
        )
    (band_ppo, band_max) = reward.collections  # the 5-95% bands, one per run
    lo, hi = band_ppo.get_paths()[0].vertices[:, 1].min(), band_ppo.get_paths()[0].vertices[:, 1].max()
    assert np.isclose(lo, -1.0) and np.isclose(hi, 0.1 * 29 + 1)
    assert ppl.get_yscale() == "log"
    (image,) = hist.get_images()
    grid = np.asarray(image.get_array())
    assert grid.shape == (40, 2 * 30) and (grid.sum(axis=0) == 16).all()  # every score of every step, in range
    assert {t.get_text() for t in hist.texts} == set(drifts)
    img = mpimg.imread(out)
    assert img.shape[:2] == (round(fig.get_figheight() * fig.dpi), round(fig.get_figwidth() * fig.dpi))


def test_cli_and_missing_csv(tmp_path):
    fake_run(tmp_path / "run", 0.1)
    out = subprocess.run(
        [sys.executable, "-m", "lit_rlhf.callbacks.dashboard", str(tmp_path / "run")],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "run" / "stability.png").stat().st_size > 20_000
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no metrics.csv"):
        render([str(tmp_path / "empty")], str(tmp_path / "x.png"))


def test_cli_says_in_one_line_what_it_needs(tmp_path):
    """A run directory without its CSV log (e.g. a W&B-only run of an older version) or a wrong path:
    one line naming the directory and what the report reads, not a FileNotFoundError traceback."""
    (tmp_path / "wandb_only" / "wandb").mkdir(parents=True)
    for run_dir, says in (
        (tmp_path / "wandb_only", "no metrics.csv (the report reads <run>/csv/metrics.csv"),
        (tmp_path / "nowhere", "not a directory"),
    ):
        out = subprocess.run(
            [sys.executable, "-m", "lit_rlhf.callbacks.dashboard", str(run_dir)],
            capture_output=True,
            text=True,
            cwd=ROOT,
            timeout=300,
        )
        assert out.returncode == 1 and "Traceback" not in out.stderr
        assert len(out.stderr.strip().splitlines()) == 1 and out.stderr.startswith(
            f"python -m lit_rlhf.callbacks.dashboard: {run_dir}: "
        )
        assert says in out.stderr
