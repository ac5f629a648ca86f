"""The run's CSV log across a resume (lit_rlhf/callbacks/csv_log.py): Lightning's CSVLogger deletes
the metrics.csv in its folder; ours keeps a resumed run's earlier rows, drops the ones the resumed
run logs again, and starts anew for a fresh fit, as Lightning's does."""

from __future__ import annotations

import csv

from lit_rlhf.callbacks.csv_log import RunCSVLogger


def _old_log(folder, steps):
    """A metrics.csv as an interrupted run left it: a loss at every step, a validation at odd steps."""
    folder.mkdir(parents=True)
    with open(folder / "metrics.csv", "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=["epoch", "step", "train/loss", "val/score"])
        w.writeheader()
        for s in steps:
            w.writerow({"epoch": 0, "step": s, "train/loss": 10 - s, "val/score": s if s % 2 else ""})


def _rows(folder):
    with open(folder / "metrics.csv", newline="") as fh:
        return list(csv.DictReader(fh))


def test_a_resumed_fit_keeps_the_rows_before_its_first_step_and_logs_new_columns(tmp_path):
    _old_log(tmp_path / "csv", range(6))
    logger = RunCSVLogger(tmp_path, name="csv", version="")
    logger.fit_started(resumed=True)
    logger.log_metrics({"train/loss": 0.5, "train/new": 1.0}, step=3)
    logger.log_metrics({"train/loss": 0.25}, step=4)
    logger.save()
    rows = _rows(tmp_path / "csv")
    assert [r["step"] for r in rows] == ["0", "1", "2", "3", "4"]  # the old 3, 4, 5 logged again
    assert [r["train/loss"] for r in rows] == ["10", "9", "8", "0.5", "0.25"]
    assert rows[1]["val/score"] == "1" and rows[3]["train/new"] == "1.0" and rows[0]["train/new"] == ""
    logger.log_metrics({"train/loss": 0.125}, step=5)  # later writes append as Lightning's do
    logger.save()
    assert [r["step"] for r in _rows(tmp_path / "csv")] == ["0", "1", "2", "3", "4", "5"]


def test_a_fresh_fit_starts_the_log_anew_and_anything_else_appends(tmp_path):
    _old_log(tmp_path / "fresh" / "csv", range(6))
    fresh = RunCSVLogger(tmp_path / "fresh", name="csv", version="")
    fresh.log_metrics({"val/before": 1.0}, step=0)  # a validation before the fit (the demo pipeline's): its own
    fresh.save()
    fresh.fit_started(resumed=False)
    fresh.log_metrics({"train/other": 2.0}, step=0)
    fresh.save()
    assert _rows(tmp_path / "fresh" / "csv") == [
        {"step": "0", "train/other": "", "val/before": "1.0"},
        {"step": "0", "train/other": "2.0", "val/before": ""},
    ]
    fresh.log_metrics({"train/other": 3.0}, step=1)  # decided once: the fit's rows stay (and a test's after them)
    fresh.save()
    assert [r["step"] for r in _rows(tmp_path / "fresh" / "csv")] == ["0", "0", "1"]
    first = RunCSVLogger(tmp_path / "first", name="csv", version="")  # a fresh fit in a new folder
    first.fit_started(resumed=False)
    for step in (0, 1):
        first.log_metrics({"train/loss": 1.0}, step=step)
        first.save()
    assert [r["step"] for r in _rows(tmp_path / "first" / "csv")] == ["0", "1"]
    _old_log(tmp_path / "test" / "csv", range(2))
    tested = RunCSVLogger(tmp_path / "test", name="csv", version="")  # trainer.test after the fit: no fit start
    tested.log_metrics({"test/score": 3.0}, step=2)
    tested.save()
    assert [(r["step"], r["test/score"]) for r in _rows(tmp_path / "test" / "csv")] == [
        ("0", ""),
        ("1", ""),
        ("2", "3.0"),
    ]
