"""The package's floors (docs/architecture.md "Layout and dependency direction"): each package
imports only the floors below it, read from the source (every import, top level or inside a
function). utils/ (with utils/compat/) is the ground floor: it imports nothing else of lit_rlhf."""

from __future__ import annotations

import ast
import pathlib

import lit_rlhf

ROOT = pathlib.Path(lit_rlhf.__file__).parent

#: what each top-level package or module of lit_rlhf may import (besides itself)
ALLOWED = {
    "utils": set(),
    "core": set(),
    "models": {"core", "utils"},
    "data": {"models", "utils"},
    "rollout": {"core", "data", "models", "utils"},
    "rewards": {"core", "utils"},
    "runtime": {"models", "utils"},
    "modules": {"core", "data", "models", "rewards", "rollout", "runtime", "utils"},
    "callbacks": {"core", "utils"},
    "serve": {"data", "models", "rewards", "rollout", "utils"},
    "launch": {"callbacks", "core", "data", "models", "modules", "runtime", "serve", "utils"},
    "pipelines": {"callbacks", "core", "data", "launch", "models", "rollout", "utils"},
}


def _imports(path: pathlib.Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module else []
        names += [a.name for a in node.names] if isinstance(node, ast.Import) else []
        out |= {n.split(".")[1] for n in names if n.startswith("lit_rlhf.")}
    return out


def test_every_package_imports_only_the_floors_below_it():
    seen, wrong = set(), []
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT).with_suffix("").parts
        if rel == ("__init__",):
            continue
        if rel == ("__main__",):  # `python -m lit_rlhf`: the command, nothing else
            assert _imports(path) == {"launch"}
            continue
        floor = rel[0]
        seen.add(floor)
        assert floor in ALLOWED, f"{path}: a new package or module; give it a floor in ALLOWED and the docs"
        extra = _imports(path) - ALLOWED[floor] - {floor}
        if extra:
            wrong.append(f"{path.relative_to(ROOT.parent)} imports {sorted(extra)}")
    assert not wrong, "\n".join(wrong)
    assert seen == set(ALLOWED)


def test_the_top_level_holds_packages_only():
    """Every floor is a package: the job machinery lives in launch/, the pipelines in pipelines/
    (``__main__.py`` is Python's name for ``python -m lit_rlhf``)."""
    loose = sorted(p.name for p in ROOT.glob("*.py") if p.name not in ("__init__.py", "__main__.py"))
    assert not loose, f"modules outside a package: {loose}"


def test_the_check_sees_an_upward_import(tmp_path):
    bad = tmp_path / "x.py"
    bad.write_text("def f():\n    from lit_rlhf.launch.runner import run\n    import lit_rlhf.modules.rl\n")
    assert _imports(bad) == {"launch", "modules"}
