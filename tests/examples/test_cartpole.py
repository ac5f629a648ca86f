"""The classic PPO example (examples/cartpole_ppo.py) learns CartPole-v1 with lit_rlhf.core's functions."""

import importlib.util
import sys

import pytest

from tests.conftest import ROOT


@pytest.mark.slow
def test_cartpole_ppo_learns_within_a_short_budget():
    """50,000 environment steps (~10 s on 2 cores): the running mean return of the last 20 episodes
    passes 150 (a random policy scores ~22), and the whole curve is logged."""
    pytest.importorskip("gymnasium", reason="optional extra: pip install -e '.[control]'")
    example = load_example()
    result = example.train(example.Args(seed=1, total_steps=50_000))
    first = result["curve"][0][1]
    assert first < 60  # the untrained policy's episodes are short
    assert result["best_mean"] > 150, result["best_mean"]
    assert result["curve"][-1][0] <= 50_000 and result["episodes"] > 50


def load_example():
    spec = importlib.util.spec_from_file_location("cartpole_ppo", ROOT / "examples" / "cartpole_ppo.py")
    example = importlib.util.module_from_spec(spec)
    sys.modules["cartpole_ppo"] = example  # (dataclasses look their module up)
    spec.loader.exec_module(example)
    return example


def test_cli_help_describes_every_flag_and_results_record_the_steps_run(tmp_path):
    """``--help`` gives each flag a description and its default; ``results.json`` records the
    ``--total-steps`` passed (it recorded the default 500,000 whatever ran)."""
    pytest.importorskip("gymnasium", reason="optional extra: pip install -e '.[control]'")
    import json

    example = load_example()
    text = example.parser().format_help()
    for flag, default in (("--seeds", "[1, 2, 3, 4]"), ("--total-steps", "500000"), ("--out", "logs/cartpole")):
        assert f"(default: {default})" in " ".join(text.split()), flag
    assert text.count("(default:") == 3 and "environment steps per seed" in text
    example.main(["--seeds", "1", "--total-steps", "1024", "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["args"]["total_steps"] == 1024 and saved["args"]["seeds"] == [1]
    assert saved["results"][0]["seed"] == 1
