"""The package's declared requirements (pyproject.toml), the lock (requirements/constraints.txt) and
the lower bounds ``make test-min`` installs (requirements/minimum.txt), read for the packaging tests."""

from __future__ import annotations

from pathlib import Path

import tomllib
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[2]


def project() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def requirements(extras: bool = True) -> list[Requirement]:
    """Every requirement of the package: its dependencies and (``extras``) every extra's."""
    meta = project()
    lines = list(meta["dependencies"])
    if extras:
        lines += [r for reqs in meta["optional-dependencies"].values() for r in reqs]
    return [Requirement(line) for line in lines]


def lower_bounds() -> dict[str, str]:
    """package → the version of its ``>=`` bound (dependencies only)."""
    out = {}
    for req in requirements(extras=False):
        for spec in req.specifier:
            if spec.operator == ">=":
                out[canonicalize_name(req.name)] = spec.version
    return out


def _pins(path: Path) -> dict[str, str]:
    out = {}
    for line in path.read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            name, _, version = line.partition("==")
            out[canonicalize_name(name)] = version
    return out


def locked() -> dict[str, str]:
    """package → its version in the lock of the CPU test environment."""
    return _pins(ROOT / "requirements" / "constraints.txt")


def minimum() -> dict[str, str]:
    """package → the version ``make test-min`` installs."""
    return _pins(ROOT / "requirements" / "minimum.txt")
