"""One console line per event: what ``train.py`` sets up before its job runs.

- Lightning's package logger (``lightning``) has a console handler of its own ("INFO: …") and also
  passes its records on to the root logger, where Hydra's handlers print them (and write them to
  ``train.log``): every Lightning line appeared twice. Once Hydra has configured logging, the
  Lightning loggers' own console handlers are removed; Hydra's handlers print and file each record.
- Lightning's "💡 Tip: … litlogger / litmodels" advertisements are dropped by the logger that logs
  them; so is DeepSpeed's "Setting accelerator to CPU" warning, logged by its import on every CPU run.
- torch's ``FutureWarning`` about ``isinstance(treespec, LeafSpec)``, raised from Lightning's own
  ``_pytree`` helper in every fit, is ignored for that module only.
"""

from __future__ import annotations

import logging
import warnings

# logger name → start of the messages dropped there
DROPPED = {
    "lightning.pytorch.utilities.rank_zero": ("💡 Tip:",),  # Lightning's ads for litlogger / litmodels
    "DeepSpeed": ("Setting accelerator to CPU",),  # deepspeed.accelerator.real_accelerator, on a CPU host
}
LIGHTNING_LOGGERS = ("lightning", "lightning.pytorch", "lightning.fabric")


class DropMessages(logging.Filter):
    """Drop the records of one logger whose message starts with one of ``prefixes``."""

    def __init__(self, prefixes: tuple[str, ...]) -> None:
        super().__init__()
        self.prefixes = prefixes

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.prefixes)


def one_line_per_event() -> None:
    """Filter the known ads and harmless warnings; with handlers on the root logger (Hydra's job
    logging), remove Lightning's own console handlers so that each record is printed once."""
    for name, prefixes in DROPPED.items():
        logger = logging.getLogger(name)  # the same object the library gets when it is imported later
        if not any(isinstance(f, DropMessages) for f in logger.filters):
            logger.addFilter(DropMessages(prefixes))
    warnings.filterwarnings(
        "ignore",
        message=r"`isinstance\(treespec, LeafSpec\)` is deprecated",
        category=FutureWarning,
        module=r"lightning\.pytorch\.utilities\._pytree",
    )
    if not logging.getLogger().handlers:
        return  # no Hydra logging (`--plan`, tests): Lightning's handlers are the only console output
    import lightning  # noqa: F401  (its import adds the handler removed here)

    for name in LIGHTNING_LOGGERS:
        logger = logging.getLogger(name)
        for handler in list(logger.handlers):
            if type(handler) is logging.StreamHandler:  # a console handler, not a file handler
                logger.removeHandler(handler)
        logger.propagate = True  # (set False when imported before Hydra's logging)
