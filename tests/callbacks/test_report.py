import csv
import json
import subprocess
import sys

import numpy as np
import pytest

from lit_rlhf.report import read_series, render
from tests.conftest import ROOT


def fake_run(path, drift: float, steps: int = 30):
    (path / "csv").mkdir(parents=True)
    keys = ["step", "reward/score_mean", "reward/score_q05", "reward/score_q95", "stability/kl", "stability/kl_k3",
            "stability/perplexity", "stability/perplexity_ref", "stability/response_length",
            "stability/response_length_max", "policy/entropy", "policy/clipfrac", "val/score_mean"]  # fmt: skip
    rng = np.random.default_rng(0)
    with open(path / "csv" / "metrics.csv", "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=keys)
        w.writeheader()
        for s in range(steps):
            w.writerow({"step": s, "reward/score_mean": 0.1 * s, "reward/score_q05": 0.1 * s - 1, "reward/score_q95": 0.1 * s + 1,
                        "stability/kl": drift * s, "stability/kl_k3": 0.5 * drift * s, "stability/perplexity": 6 - 0.1 * s,
                        "stability/perplexity_ref": 6, "stability/response_length": 10 + drift * s,
                        "stability/response_length_max": 20 + drift * s, "policy/entropy": 2.0, "policy/clipfrac": 0.05,
                        "val/score_mean": 0.1 * s if s % 10 == 0 else ""})  # fmt: skip
    with open(path / "reward_scores.jsonl", "w") as fh:
        for s in range(steps):
            fh.write(json.dumps({"step": s, "scores": (rng.normal(0.1 * s, 0.5, 16)).tolist()}) + "\n")


def test_series_parsing_skips_blanks(tmp_path):
    fake_run(tmp_path / "a", 0.1)
    series = read_series(str(tmp_path / "a" / "csv" / "metrics.csv"))
    assert series["val/score_mean"][0] == [0.0, 10.0, 20.0]
    assert len(series["stability/kl"][0]) == 30


def test_png_is_produced_and_not_trivial(tmp_path):
    import matplotlib.image as mpimg

    fake_run(tmp_path / "ppo", 0.3)
    fake_run(tmp_path / "ppo_max", 0.05)
    out = render([str(tmp_path / "ppo"), str(tmp_path / "ppo_max")], str(tmp_path / "both.png"))
    img = mpimg.imread(out)
    assert img.shape[0] > 600 and img.shape[1] > 1200
    colours = np.unique((img[..., :3] * 255).astype(np.uint8).reshape(-1, 3), axis=0)
    assert len(colours) > 200  # lines, fills and the heat map: far from a blank canvas


def test_cli_and_missing_csv(tmp_path):
    fake_run(tmp_path / "run", 0.1)
    out = subprocess.run([sys.executable, "-m", "lit_rlhf.report", str(tmp_path / "run")], capture_output=True,
                         text=True, cwd=ROOT)  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "run" / "stability.png").stat().st_size > 20_000
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no metrics.csv"):
        render([str(tmp_path / "empty")], str(tmp_path / "x.png"))
