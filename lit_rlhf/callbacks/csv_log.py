"""The run's CSV log (``<run>/csv/metrics.csv``) across a resume.

Lightning's ``CSVLogger`` deletes the ``metrics.csv`` it finds in its folder. A run resumed in its
own run directory (``hydra.run.dir=<run> ckpt_path=last``, as docs/running.md says) would lose
every row the interrupted run logged, and the stability report drawn from the file would start at
the resume. :class:`RunCSVLogger` keeps them: told by :class:`~lit_rlhf.callbacks.resume.ResumeState`
whether the fit resumed, it keeps, at its first write, the rows logged before the first step this
run logs (the steps after the checkpoint, which this run logs again, are dropped, and both counts
logged); a fresh fit in a folder that has a log starts it anew, as Lightning's does."""

from __future__ import annotations

import csv
import logging
from typing import Any

from lightning.fabric.loggers.logger import rank_zero_experiment
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.loggers.csv_logs import ExperimentWriter

log = logging.getLogger(__name__)


class _Writer(ExperimentWriter):
    """Lightning's CSV writer, which decides what to do with an existing ``metrics.csv`` at its first
    write instead of deleting it when it is created."""

    def __init__(self, log_dir: str) -> None:
        self.keep: str | None = None  # None: keep and append; "resumed": rows before this run's first step; "none"
        super().__init__(log_dir)

    def _check_log_dir_exists(self) -> None:  # Lightning deletes metrics.csv here
        if self._fs.isfile(self.metrics_file_path):
            with self._fs.open(self.metrics_file_path, "r", newline="") as fh:
                self.metrics_keys = list(next(csv.reader(fh), []))

    def save(self) -> None:
        keep = self.keep if self.metrics else None
        if self.metrics:
            self.keep = None  # decided at the first write only
        if keep is not None and self._fs.isfile(self.metrics_file_path):
            if keep == "none":
                self._fs.rm_file(self.metrics_file_path)
                self.metrics_keys = []
            else:
                first = min(int(m["step"]) for m in self.metrics)
                with self._fs.open(self.metrics_file_path, "r", newline="") as fh:
                    rows = list(csv.DictReader(fh))
                kept = [r for r in rows if int(float(r["step"])) < first]
                with self._fs.open(self.metrics_file_path, "w", newline="") as fh:
                    writer = csv.DictWriter(fh, fieldnames=self.metrics_keys)
                    writer.writeheader()
                    writer.writerows(kept)
                log.info(
                    "%s: kept the %d rows the interrupted run logged before step %d; %d rows after it are "
                    "logged again by this run",
                    self.metrics_file_path,
                    len(kept),
                    first,
                    len(rows) - len(kept),
                )
        super().save()


class RunCSVLogger(CSVLogger):
    """``lightning.pytorch.loggers.CSVLogger`` that keeps a resumed run's earlier rows (module doc)."""

    @property
    @rank_zero_experiment
    def experiment(self) -> Any:
        if self._experiment is None:
            self._fs.makedirs(self.root_dir, exist_ok=True)
            self._experiment = _Writer(log_dir=self.log_dir)
        return self._experiment

    def fit_started(self, resumed: bool) -> None:
        """Called at the start of a fit: keep the earlier rows before this run's first step (a
        resume), or none (a fresh start in a folder that has a log)."""
        writer = self.experiment
        if isinstance(writer, _Writer):
            writer.keep = "resumed" if resumed else "none"
