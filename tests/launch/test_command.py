"""The ``lit-rlhf`` command (lit_rlhf/launch/command.py): what each subcommand hands on, and its help."""

from __future__ import annotations

import subprocess
import sys

import pytest

from lit_rlhf.launch import command
from lit_rlhf.launch.presets import CONF_DIR


@pytest.fixture
def calls(monkeypatch):
    seen: list[tuple[str, list[str]]] = []
    monkeypatch.setattr(command, "train", lambda args: seen.append(("train", list(args))))
    import lit_rlhf.callbacks.dashboard as dashboard

    monkeypatch.setattr(dashboard, "main", lambda argv, prog: seen.append((prog, list(argv))))
    return seen


def test_subcommands_hand_on_their_arguments(calls):
    command.main(["train", "algo=sft", "-m"])
    command.main(["plan", "experiment=ppo_max_llama7b_a100x8"])
    command.main(["report", "logs/a", "--out", "x.png"])
    # DDP ranks 1… are started with the process's arguments, which hold overrides but not "train"
    command.main(["algo=sft", "hydra.run.dir=x"])
    command.main(["--cfg", "job"])
    assert calls == [
        ("train", ["algo=sft", "-m"]),
        ("train", ["experiment=ppo_max_llama7b_a100x8", "--plan"]),
        ("lit-rlhf report", ["logs/a", "--out", "x.png"]),
        ("train", ["algo=sft", "hydra.run.dir=x"]),
        ("train", ["--cfg", "job"]),
    ]


def test_unknown_command_names_the_commands(calls):
    with pytest.raises(SystemExit) as err:
        command.main(["trian", "algo=sft"])
    assert "unknown command 'trian'" in str(err.value) and "train, plan, report or serve" in str(err.value)
    assert calls == []


def test_help_lists_every_group_and_option(capsys):
    command.main(["--help"])
    out = capsys.readouterr().out
    for group in ("algo", "model", "data", "strategy", "experiment", "pipeline"):
        line = next(x for x in out.splitlines() if x.strip().startswith(group + " "))
        options = sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))
        assert line.split(None, 1)[1].split(", ") == options
    assert "local" not in command.config_groups() and "hydra" not in command.config_groups()
    command.main(["--version"])
    import lit_rlhf

    assert capsys.readouterr().out == f"lit_rlhf {lit_rlhf.__version__}\n"


def test_python_dash_m_runs_the_command(tmp_path):
    """``python -m lit_rlhf``: a config check that fails in about a second, from a folder that is not
    the checkout, with the error the command reports (no traceback, no run directory written)."""
    proc = subprocess.run(
        [sys.executable, "-m", "lit_rlhf", "train", "algo=sft", "algo.lrr=1"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 1 and "Did you mean 'lr'" in proc.stderr and "Traceback" not in proc.stderr
    assert list(tmp_path.iterdir()) == []
