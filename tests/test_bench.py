"""The benchmark suite runs end to end in smoke mode (tiny shapes, no TRL, no timing asserts)."""

import json
import subprocess
import sys

import pytest

from tests.conftest import ROOT


@pytest.mark.slow
@pytest.mark.integration
def test_bench_smoke(tmp_path):
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "run.py"), "--smoke", "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=900, cwd=ROOT)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads((tmp_path / "latest.json").read_text())
    for case in ("generate_bare", "generate_ours", "floor", "ppo_ours", "rm_ours", "dpo_ours", "dpo_ours_precomputed",
                 "grpo_ours"):  # fmt: skip
        assert "error" not in result["results"][case], (case, result["results"][case])
    assert result["results"]["ppo_ours"]["fused_first_forward"] is True
    assert result["results"]["ppo_ours"]["rss_mb"] > 0
    table = (tmp_path / "latest.md").read_text()
    assert "lit_rlhf PPO step / naive floor" in table and "SMOKE" in table
    assert "| GRPO samples/s, lit_rlhf / TRL | — |" in table  # TRL's side is not run in smoke mode: visible
    assert result["results"]["grpo_ours"]["rollout_s"] > 0  # the phase breakdown
