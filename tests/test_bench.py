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
    assert "| GRPO samples/s, lit_rlhf / TRL (separate processes; the target is the paired row's) | — |" in table
    assert "| GRPO samples/s, lit_rlhf / TRL, one process, steps alternating | — |" in table  # no TRL in smoke mode
    assert result["results"]["grpo_ours"]["rollout_s"] > 0  # the phase breakdown


def test_alternation_runs_one_loop_at_a_time_and_times_each_cycle():
    """bench/cases.py ``Alternation``: two loops in two threads take strict turns (ours, theirs, …),
    never compute at once, wait for each other's set-up, and each recorded cycle spans exactly
    its loop's turn; a loop that ends (or fails) lets the other run on alone."""
    import threading
    import time

    sys.path.insert(0, str(ROOT / "bench"))
    try:
        from cases import Alternation
    finally:
        sys.path.remove(str(ROOT / "bench"))

    alt = Alternation("ours", "trl", timeout=30)
    log, busy = [], []

    def loop(side, steps, setup, work):
        time.sleep(setup)  # "trl" sets up longer: "ours" must wait for it before its first step
        try:
            for i in range(steps):
                alt.step(side)
                busy.append(side)
                assert len(busy) == 1, f"{busy} computing at once"
                log.append((side, i))
                time.sleep(work)
                busy.remove(side)
        finally:
            alt.finish(side)

    other = threading.Thread(target=loop, args=("ours", 4, 0.0, 0.02))
    other.start()
    loop("trl", 6, 0.1, 0.05)  # two more steps than "ours": they run without waiting
    other.join()
    assert log == [("ours", 0), ("trl", 0), ("ours", 1), ("trl", 1), ("ours", 2), ("trl", 2), ("ours", 3),
                   ("trl", 3), ("trl", 4), ("trl", 5)]  # fmt: skip
    ours, theirs = alt.cycles["ours"], alt.cycles["trl"]
    assert len(ours) == 3 and len(theirs) == 5  # a loop's last cycle (into its teardown) is not recorded
    assert all(0.02 <= c < 0.5 for c in ours) and all(0.05 <= c < 0.5 for c in theirs)  # its own work, not the other's
    assert alt.pairs(1) == list(zip(ours, theirs))[1:]
