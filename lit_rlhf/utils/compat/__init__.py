"""Every use of another project's private API, gathered: one module per framework.

lit_rlhf reaches into a few internals that no public API offers (docs/architecture.md
"Compatibility modules"): Lightning's loop and strategy internals, DeepSpeed's ZeRO-3 hook
lists, torch's oneDNN operators and global hook registries, transformers' attention registry,
OmegaConf's raw nodes. Each such access lives here, nowhere else, behind a small function; when
an upgrade moves one, the function raises :class:`CompatError` naming the framework, the
internal that moved and the versions lit_rlhf is tested with (pyproject.toml's lower bound and
the lock file requirements/constraints.txt), and
``tests/utils/test_compat.py`` exercises every function against the installed packages, so an upgrade
fails there first, loudly, instead of deep inside a run.
"""

from __future__ import annotations

from importlib import metadata

#: (lowest, locked): the versions every function here is tested against — pyproject.toml's lower
#: bound (``make test-min`` runs lightning's and transformers' at theirs) and the lock's
TESTED = {
    "lightning": ("2.6.0", "2.6.6"),
    "deepspeed": ("0.19.8", "0.19.8"),
    "torch": ("2.13.0", "2.13.0"),
    "transformers": ("5.16.1", "5.19.0"),
    "omegaconf": ("2.3.1", "2.3.1"),
}


def tested(package: str) -> str:
    """The tested versions of ``package`` as a sentence part: "2.6.0 to 2.6.6" or "2.13.0"."""
    low, high = TESTED[package]
    return low if low == high else f"{low} to {high}"


class CompatError(RuntimeError):
    """A private API of another project moved (an upgrade): names what and the tested versions."""

    def __init__(self, package: str, internal: str, detail: str = "") -> None:
        try:
            installed = metadata.version(package)
        except metadata.PackageNotFoundError:
            installed = "not installed"
        super().__init__(
            f"{package} {installed}: {internal} is no longer where lit_rlhf expects it"
            f"{': ' + detail if detail else ''} "
            f"(lit_rlhf is tested with {package} {tested(package)}; install one of those, or update "
            f"lit_rlhf/utils/compat/{package}.py)"
        )


def private_attr(obj: object, name: str, package: str, where: str) -> object:
    """``getattr(obj, name)``, or a :class:`CompatError` naming ``where`` (e.g.
    ``Trainer.fit_loop._combined_loader``)."""
    try:
        return getattr(obj, name)
    except AttributeError as err:
        raise CompatError(package, where, str(err)) from None
