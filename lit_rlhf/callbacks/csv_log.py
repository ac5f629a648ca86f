"""The run's CSV log (``<run>/csv/metrics.csv``) across a resume.

Lightning's ``CSVLogger`` deletes the ``metrics.csv`` it finds in its folder. A run resumed in its
own run directory (``hydra.run.dir=<run> ckpt_path=last``, as docs/running.md says) would lose
every row the interrupted run logged, and the stability report drawn from the file would start at
the resume. :class:`RunCSVLogger` keeps them: told by :class:`~lit_rlhf.callbacks.resume.ResumeState`
whether the fit resumed, it keeps, at its first write, the rows logged before the first step this
run logs (the steps after the checkpoint, which this run logs again, are dropped, and both counts
logged); a fresh fit in a folder that has a log starts it anew, as Lightning's does; a run that does
not fit (``trainer.test`` alone) appends to it. Rows this run logs before its fit (a validation)
stay in every case."""

from __future__ import annotations

import csv
import logging
from typing import Any

from lightning.fabric.loggers.logger import rank_zero_experiment
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.loggers.csv_logs import ExperimentWriter

log = logging.getLogger(__name__)


class _Writer(ExperimentWriter):
    """Lightning's CSV writer, except that it leaves the ``metrics.csv`` it finds in place: the rows
    there are an earlier run's (counted), the ones after them this run's own (a validation before the
    fit), and what happens to the earlier ones is decided at the first write after the fit started."""

    def __init__(self, log_dir: str) -> None:
        self.keep: str | None = None  # "resumed": the earlier rows before this run's first step; "none"
        self.earlier = 0  # rows of an earlier run at the top of the file
        super().__init__(log_dir)

    def _check_log_dir_exists(self) -> None:  # Lightning deletes metrics.csv here
        if self._fs.isfile(self.metrics_file_path):
            with self._fs.open(self.metrics_file_path, "r", newline="") as fh:
                reader = csv.DictReader(fh)
                self.metrics_keys = list(reader.fieldnames or [])
                self.earlier = sum(1 for _ in reader)

    def save(self) -> None:
        keep = self.keep if self.metrics else None
        if keep is not None:
            self.keep = None  # decided once
            if self.earlier and self._fs.isfile(self.metrics_file_path):
                self._keep_earlier(keep == "resumed", min(int(m["step"]) for m in self.metrics))
        super().save()

    def _keep_earlier(self, resumed: bool, first: int) -> None:
        """Rewrite the file with the earlier run's rows before step ``first`` (a resume) or none, then
        this run's own."""
        with self._fs.open(self.metrics_file_path, "r", newline="") as fh:
            rows = list(csv.DictReader(fh))
        earlier, own = rows[: self.earlier], rows[self.earlier :]
        kept = [r for r in earlier if int(float(r["step"])) < first] if resumed else []
        rows = kept + own
        self.metrics_keys = [k for k in self.metrics_keys if k == "step" or any(r.get(k) for r in rows)]
        with self._fs.open(self.metrics_file_path, "w", newline="") as fh:
            writer = csv.DictWriter(fh, fieldnames=self.metrics_keys, extrasaction="ignore")
            writer.writeheader()
            writer.writerows(rows)
        if resumed:
            log.info(
                "%s: kept the %d rows the interrupted run logged before step %d; its %d rows after that are "
                "logged again by this run",
                self.metrics_file_path,
                len(kept),
                first,
                len(earlier) - len(kept),
            )
        self.earlier = 0


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
