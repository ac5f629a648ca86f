"""lit_rlhf as a library: ranges (not pins) that admit a CUDA vLLM's torch, a wheel that carries its
configs and the ``lit-rlhf`` command, and that wheel installed into a fresh virtual environment,
run from an empty folder with the repository nowhere on the path."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from lit_rlhf.launch.presets import CONF_DIR
from tests.helpers.package_meta import ROOT, locked, lower_bounds, minimum, project, requirements

VLLM_CUDA = ROOT / "tests" / "fixtures" / "vllm-0.34.0.requires.txt"
CUDA_ONLY = {"vllm"}  # the extra a CPU machine cannot install: checked against its metadata instead


def test_requirements_are_ranges_not_pins():
    pinned = [str(r) for r in requirements() if any(s.operator in ("==", "===") for s in r.specifier)]
    assert pinned == []
    unbounded = [str(r) for r in requirements() if not any(s.operator == ">=" for s in r.specifier)]
    assert unbounded == []  # every requirement names the lowest version it is tested with


def test_the_lock_satisfies_every_range_and_the_minimum_file_is_the_lower_bounds():
    lock = locked()
    for req in requirements():
        name = canonicalize_name(req.name)
        if name in CUDA_ONLY:
            continue
        assert name in lock, f"{name} is not in requirements/constraints.txt"
        assert req.specifier.contains(lock[name], prereleases=True), f"lock {name}=={lock[name]} outside {req}"
    bounds = lower_bounds()
    assert {k: bounds[k] for k in minimum()} == minimum()
    assert set(minimum()) >= {"transformers", "lightning", "peft", "datasets"}


def test_the_ranges_admit_a_cuda_vllm_release():
    """A GPU machine's ``pip install lit_rlhf[vllm]`` resolves: for each package vLLM 0.34.0 (CUDA)
    also requires, some version satisfies both its requirement and ours (read from its metadata,
    tests/fixtures/; nothing is downloaded)."""
    ours = {canonicalize_name(r.name): r for r in requirements(extras=False)}
    theirs = [Requirement(line) for line in VLLM_CUDA.read_text().splitlines() if line and not line.startswith("#")]
    shared = [r for r in theirs if canonicalize_name(r.name) in ours and r.marker is None]
    assert {"torch", "transformers", "tokenizers", "numpy"} <= {canonicalize_name(r.name) for r in shared}
    for req in shared:
        mine = ours[canonicalize_name(req.name)].specifier
        candidates = [Version(s.version) for s in [*req.specifier, *mine] if s.operator in ("==", ">=")]
        assert any(req.specifier.contains(v) and mine.contains(v) for v in candidates), f"{req} vs {mine}"
    vllm = next(r for r in requirements() if r.name == "vllm")
    assert vllm.specifier.contains("0.34.0")


def test_version_has_one_home():
    import lit_rlhf

    assert "version" in project()["dynamic"] and "version" not in project()
    assert Version(lit_rlhf.__version__) >= Version("0.2.0")
    assert f"## {lit_rlhf.__version__}" in (ROOT / "CHANGELOG.md").read_text()


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel, built from a copy of the checkout's files (setuptools writes build/ beside its source)."""
    import shutil

    source, out = tmp_path_factory.mktemp("source"), tmp_path_factory.mktemp("wheel")
    git = ["git", "ls-files", "--cached", "--others", "--exclude-standard"]
    listed = subprocess.run(git, cwd=ROOT, capture_output=True, text=True, timeout=120)
    if listed.returncode == 0:
        files = listed.stdout.splitlines()
    else:  # not a git checkout: the package and what its build reads
        files = [str(p.relative_to(ROOT)) for p in (ROOT / "lit_rlhf").rglob("*") if p.is_file()]
        files += ["pyproject.toml", "README.md"]
    for name in files:
        if (ROOT / name).is_file():
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, source / name)
    build = [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation", "-w", str(out)]
    subprocess.run([*build, str(source)], check=True, capture_output=True, timeout=900)
    (found,) = out.glob("lit_rlhf-*.whl")
    return found


def test_the_wheel_carries_every_config_and_the_command(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    shipped = {str(p.relative_to(CONF_DIR.parent.parent)) for p in CONF_DIR.rglob("*.yaml")}
    assert shipped and shipped <= names
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    text = zipfile.ZipFile(wheel).read(entry_points).decode()
    assert "lit-rlhf = lit_rlhf.launch.command:main" in text
    assert not any(n.startswith(("tests/", "bench/", "docs/")) for n in names)


USER_EXPERIMENT = """\
# @package _global_
# a user's recipe, outside the package: the shipped SFT recipe on the embedded task, two steps
defaults:
  - sft_synthetic_tiny
trainer:
  max_steps: 2
tags: [mine]
"""


@pytest.mark.slow
@pytest.mark.integration
def test_installed_wheel_runs_from_an_empty_folder(wheel, tmp_path):
    """pip installs the wheel (dependencies from the lock, the CPU torch first) into a new virtual
    environment; from an empty folder, without the repository on the path: ``--help``, a 2-step SFT
    on the embedded task, the 7B headline's ``plan``, and an experiment from the user's own folder."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    pip = [
        str(venv / "bin" / "python"),
        "-m",
        "pip",
        "install",
        "--quiet",
        "--no-compile",  # no bytecode for every installed file (~1 CPU-min): the runs compile what they import
        "-c",
        str(ROOT / "requirements" / "constraints.txt"),
    ]
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "LIT_RLHF_ROOT", "VIRTUAL_ENV")}
    env.update(DS_BUILD_OPS="0", HF_HUB_OFFLINE="1", WANDB_MODE="disabled", TOKENIZERS_PARALLELISM="false")
    subprocess.run([*pip, "torch==2.13.0"], check=True, env=env, timeout=1200)
    subprocess.run([*pip, str(wheel)], check=True, env=env, timeout=1200)
    work = tmp_path / "empty"
    work.mkdir()
    cli = str(venv / "bin" / "lit-rlhf")

    def run(*args: str) -> str:
        proc = subprocess.run([cli, *args], cwd=work, env=env, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, f"lit-rlhf {' '.join(args)}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        return proc.stdout + proc.stderr

    where = subprocess.run(
        [str(venv / "bin" / "python"), "-c", "import lit_rlhf; print(lit_rlhf.__file__)"],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
    ).stdout
    assert str(venv) in where and str(ROOT) not in where  # the installed copy, not the checkout

    helped = run("--help")
    assert "config groups" in helped and "experiment" in helped
    assert "lit_rlhf" in run("--version")

    run("train", "experiment=sft_synthetic_tiny", "trainer.max_steps=2", "logger=csv", "callbacks=default")
    (metrics,) = (work / "logs" / "sft").glob("runs/*/csv/metrics.csv")  # outputs under the current folder
    header, *rows = metrics.read_text().splitlines()
    assert "val/loss" in header.split(",") and rows[-1].split(",")[1] == "2"  # 2 steps, validated at the end

    plan = run("plan", "experiment=ppo_max_llama7b_a100x8", "algo.reward_path=/ckpt/rm-7b")
    assert "FITS" in plan and not (work / "logs" / "ppo_max").exists()

    user = tmp_path / "my_conf" / "experiment"
    user.mkdir(parents=True)
    (user / "mine.yaml").write_text(USER_EXPERIMENT)
    run("train", "-cd", str(tmp_path / "my_conf"), "experiment=mine")
    runs = sorted((work / "logs" / "sft").glob("runs/*/.hydra/config.yaml"))
    assert len(runs) == 2 and "- mine" in runs[-1].read_text()
    # a misspelt key under the user's experiment is named with the allowed ones, not a traceback
    bad = subprocess.run(
        [cli, "train", "-cd", str(tmp_path / "my_conf"), "experiment=mine", "algo.lrr=1"],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert bad.returncode != 0 and "Did you mean 'lr'" in bad.stderr and "Traceback" not in bad.stderr
