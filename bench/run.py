"""lit_rlhf benchmarks: PPO, RM, DPO and GRPO steps vs TRL, the PPO step vs its compute floor, generation,
answer extraction on degenerate responses.

    python bench/run.py              # full run (make bench): installs TRL 1.12.0 into bench/.trl
    python bench/run.py --smoke      # tiny shapes, 1 timed step, no TRL: a CI check that it runs

Setting: a tiny Llama (hidden 256, 4 layers, 4 heads, intermediate 512), fp32, 2 threads,
16 prompts x 64 new tokens, 1 PPO epoch over 1 minibatch. Every case runs in its own subprocess
(so its peak RSS is its own; ``--smoke`` runs them in one process) and reports the median seconds
of its timed steps after warm-up.
Both sides sample with temperature 0.7 and no top-k/top-p/repetition penalty (TRL's sampler).
Ratios come from one run (these machines are noisy), never from absolute times; ``grpo_paired``
runs lit_rlhf's and TRL's GRPO in one process with their steps alternating, so that each ratio
compares steps seconds apart (the VM's speed drifts over seconds: ratios of separate processes
minutes apart moved from 0.97 to 1.55 between rounds of one run). Results:
``bench/results/latest.json`` and ``latest.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from cases import CASES, ROOT, TRL_CASES, build_models, peak_rss_mb, shapes  # bench/cases/ (this script's folder)


# --------------------------------------------------------------------------- driver
def run_case(name: str, models: Path, smoke: bool) -> dict:
    """One case in a fresh interpreter (own peak RSS, 2 threads). Smoke mode runs the cases in
    this process instead (its RSS figures are then cumulative: smoke results are not measurements),
    which saves an interpreter start per case in CI."""
    if smoke:
        from lit_rlhf.utils.compat.torch import set_num_threads

        set_num_threads(2)  # torch.set_num_threads is vLLM's no-op once a case built a CPU engine here
        try:
            return {**CASES[name](models, shapes(True)), "rss_mb": peak_rss_mb()}
        except Exception as err:  # reported like a failed child process
            return {"error": f"{type(err).__name__}: {err}"}
    env = dict(
        os.environ,
        OMP_NUM_THREADS="2",
        MKL_NUM_THREADS="2",
        TOKENIZERS_PARALLELISM="false",
        HF_HUB_OFFLINE="1",
        PYTHONPATH=str(ROOT),
        WANDB_MODE="disabled",
    )
    cmd = [sys.executable, str(Path(__file__)), "--case", name, "--models", str(models)] + (
        ["--smoke"] if smoke else []
    )
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        return {"error": proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else f"exit {proc.returncode}"}
    return json.loads(proc.stdout.strip().splitlines()[-1])


#: every target of the benchmark, and only here (docs/benchmarks.md states these): derived ratio -> (">=" or
#: "<=", bound). A ratio that misses its target is printed as a MISS, in its row and in the closing line.
TARGETS = {
    "ppo_step_over_naive_floor": ("<=", 1.10),
    "ppo_ours_over_trl": (">=", 2.0),
    "rm_ours_over_trl": (">=", 1.8),
    "dpo_ours_over_trl": (">=", 1.8),
    "dpo_ours_precomputed_over_trl": (">=", 1.8),
    "grpo_paired_over_trl": (">=", 1.4),
    "ppo_lora_rss_over_full": ("<=", 0.60),
    "ppo_ours_rss_over_trl": ("<=", 1.0),
    "grpo_ours_rss_over_trl": ("<=", 1.0),
    "extraction_scaling": ("<=", 2.0),
    "extraction_1mb_s": ("<=", 2.0),
    "multiturn_single_over_multi": ("<=", 1.5),
    "async3_merged_over_sync": (">=", 1.3),
}


def target_text(name: str) -> str:
    """The target column of ratio ``name`` ("≥ 2.0"; "" when it has none)."""
    if name not in TARGETS:
        return ""
    op, bound = TARGETS[name]
    return f"{'≥' if op == '>=' else '≤'} {bound}"


def misses(derived: dict) -> list[str]:
    """The measured ratios that miss their targets (a ratio not measured is not a miss)."""
    out = []
    for name, (op, bound) in TARGETS.items():
        value = derived.get(name)
        if value is not None and not (value >= bound if op == ">=" else value <= bound):
            out.append(f"{name} {value:.2f} (target {target_text(name)})")
    return out


PAIRS = [  # (ratio name, ours, TRL's, throughput key): lit_rlhf over TRL, higher is better; targets: TARGETS
    ("PPO samples/s, lit_rlhf / TRL", "ppo_ours", "ppo_trl", "samples_per_s"),
    ("RM pairs/s, lit_rlhf / TRL", "rm_ours", "rm_trl", "pairs_per_s"),
    ("DPO pairs/s, lit_rlhf / TRL (live reference)", "dpo_ours", "dpo_trl", "pairs_per_s"),
    (
        "DPO pairs/s, lit_rlhf / TRL (precomputed reference)",
        "dpo_ours_precomputed",
        "dpo_trl_precomputed",
        "pairs_per_s",
    ),
    (
        "GRPO samples/s, lit_rlhf / TRL (separate processes; the target is the paired row's)",
        "grpo_ours",
        "grpo_trl",
        "samples_per_s",
    ),
]
UNITS = {
    "ppo": "samples_per_s",
    "ppomem": "samples_per_s",
    "rm": "pairs_per_s",
    "dpo": "pairs_per_s",
    "grpo": "samples_per_s",
    "generate": "tokens_per_s",
}


def _ratio(r: dict, ours: str, theirs: str, unit: str) -> tuple[float | None, list[float]]:
    """Throughput ratio of the medians, and the same ratio within each interleaved round (its spread is the noise)."""
    a, b = r.get(ours, {}), r.get(theirs, {})
    if unit not in a or unit not in b:
        return None, []
    rounds = [t / o for o, t in zip(a.get("rounds", []), b.get("rounds", [])) if o and t]
    return a[unit] / b[unit], rounds


def summarize(r: dict, s: dict, smoke: bool) -> tuple[dict, str]:
    floor, ours = r.get("floor", {}), r.get("ppo_ours", {})

    def fmt(x, spec="{:.3f}"):
        return "—" if x is None else spec.format(x)

    lines = [
        f"Machine: {platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}, "
        f"torch threads 2; tiny Llama {s['hidden']}x{s['layers']} ({r.get('params', '?')} params), fp32, "
        f"{s['batch']} prompts x {s['new_tokens']} new tokens; median of {s['steps']} steps after {s['warmup']} warm-up"
        + (" — SMOKE (tiny shapes, not a measurement)" if smoke else ""),
        "",
        "| case | s / step | throughput | peak RSS (MB) |",
        "|---|---|---|---|",
    ]
    for name in r:
        c = r[name]
        skipped = ("floor", "sync_engine", "extraction", "reward_server", "multiturn", "async_rollouts")
        if not isinstance(c, dict) or name in skipped:
            continue
        unit = UNITS.get(name.split("_")[0])
        if "error" in c or unit not in c:
            lines.append(f"| {name} | {c.get('error', 'skipped')} | | |")
            continue
        lines.append(
            f"| {name} | {fmt(c['step_s'])} | {fmt(c[unit], '{:.1f}')} {unit.replace('_per_s', '/s')} | "
            f"{fmt(c.get('rss_mb'), '{:.0f}')} |"
        )
    derived: dict = {}
    if "floor_s" in floor:
        lines += [
            "",
            f"Naive floor: generate {floor['generate_s']:.3f} s + four scoring forwards "
            f"{floor['score_forwards_s']:.3f} s + actor & critic train fwd/bwd {floor['train_fwd_bwd_s']:.3f} s "
            f"= {floor['floor_s']:.3f} s",
        ]
    if "rollout_s" in r.get("grpo_ours", {}):
        g = r["grpo_ours"]
        lines += [
            "",
            f"GRPO step, lit_rlhf: rollout (generation, reference, reward, and the fused first training forward) "
            f"{g['rollout_s']:.3f} s + the rest of the update "
            f"{g['update_s']:.3f} s",
        ]
    full, lora = r.get("ppomem_full", {}), r.get("ppomem_lora", {})
    if "rss_mb" in full and "rss_mb" in lora and "error" not in full and "error" not in lora:
        lines += [
            "",
            f"PPO memory (ppomem_*: {full['policy_params'] / 1e6:.0f}M-parameter policy, 4 models, fp32; "
            f"process RSS before the models {full['base_mb']:.0f} MB): full fine-tuning {full['rss_mb']:.0f} MB "
            f"peak, LoRA r=16 {lora['rss_mb']:.0f} MB peak ({lora['trainable'] / 1e6:.2f}M trainable parameters "
            f"in actor and critic, against {full['trainable'] / 1e6:.0f}M)",
        ]
    lines += ["", "| ratio | value | target | |", "|---|---|---|---|"]

    def row(label: str, name: str, value: float | None, detail: str = "") -> None:
        held = "" if name not in TARGETS or value is None else "MISS" if misses({name: value}) else "held"
        lines.append(f"| {label}{detail} | {fmt(value, '{:.2f}')} | {target_text(name)} | {held} |")

    if "rss_mb" in full and "rss_mb" in lora and "error" not in full and "error" not in lora:
        derived["ppo_lora_rss_over_full"] = lora["rss_mb"] / full["rss_mb"]
        row("PPO step peak RSS, LoRA / full fine-tuning", "ppo_lora_rss_over_full", derived["ppo_lora_rss_over_full"])
    if "step_s" in ours and "floor_s" in floor:
        derived["ppo_step_over_naive_floor"] = ours["step_s"] / floor["floor_s"]
        row("lit_rlhf PPO step / naive floor", "ppo_step_over_naive_floor", derived["ppo_step_over_naive_floor"])
    for label, a, b, unit in PAIRS:
        value, rounds = _ratio(r, a, b, unit)
        derived[f"{a}_over_trl"], derived[f"{a}_over_trl_by_round"] = value, rounds
        by_round = f" (by round: {', '.join(f'{x:.2f}' for x in rounds)})" if len(rounds) > 1 else ""
        row(label, f"{a}_over_trl", value, by_round)
    paired = r.get("grpo_paired", {})
    if "ratio" in paired:  # one process, steps alternating (bench/cases/alternation.py): the steadier measurement
        rounds = paired.get("ratio_rounds") or [paired["ratio"]]
        derived["grpo_paired_over_trl"], derived["grpo_paired_over_trl_by_round"] = statistics.median(rounds), rounds
        by_round = f"; by round: {', '.join(f'{x:.2f}' for x in rounds)}" if len(rounds) > 1 else ""
        row(
            "GRPO samples/s, lit_rlhf / TRL, one process, steps alternating",
            "grpo_paired_over_trl",
            derived["grpo_paired_over_trl"],
            f" (median of each round's {paired['pairs']} step pairs{by_round}; per-pair quartiles in the round "
            f"of median step time {paired['ratio_q1']:.2f}–{paired['ratio_q3']:.2f})",
        )
    else:
        row("GRPO samples/s, lit_rlhf / TRL, one process, steps alternating", "grpo_paired_over_trl", None)
    value, rounds = _ratio(r, "generate_ours", "generate_bare", "tokens_per_s")
    row("generation tokens/s, lit_rlhf / bare generate", "generate_ours_over_generate_bare", value)
    # the vLLM engine on CPU: reported, no target (vLLM's CPU path is not what it is for)
    for label, a, b, unit in (
        ("generation tokens/s, vllm engine / hf engine", "generate_vllm", "generate_ours", "tokens_per_s"),
        ("generation tokens/s, vllm engine / bare generate", "generate_vllm", "generate_bare", "tokens_per_s"),
        ("PPO-max samples/s, vllm engine / hf engine", "ppo_vllm", "ppo_ours", "samples_per_s"),
    ):
        value, _ = _ratio(r, a, b, unit)
        derived[f"{a}_over_{b}"] = value
        row(f"{label} (CPU)", f"{a}_over_{b}", value)
    for name, a, b in (("PPO", "ppo_ours", "ppo_trl"), ("GRPO", "grpo_ours", "grpo_trl")):
        if "rss_mb" in r.get(a, {}) and "rss_mb" in r.get(b, {}):
            derived[f"{a}_rss_over_trl"] = r[a]["rss_mb"] / r[b]["rss_mb"]
            row(f"{name} peak RSS, lit_rlhf / TRL", f"{a}_rss_over_trl", derived[f"{a}_rss_over_trl"])
    ext = r.get("extraction", {})
    if "scaling" in ext:
        derived["extraction_scaling"] = ext["scaling"]
        size = lambda n: "1 MB" if n == 1_000_000 else f"{n // 1000} kB"  # noqa: E731
        row(
            f"answer extraction, seconds per byte at {size(ext['large_bytes'])} / at {size(ext['small_bytes'])} "
            "(worst degenerate pattern)",
            "extraction_scaling",
            ext["scaling"],
        )
        if ext["large_bytes"] == 1_000_000:
            derived["extraction_1mb_s"] = ext["large_s"]
            row(
                "answer extraction of a 1 MB degenerate response, seconds (slowest pattern)",
                "extraction_1mb_s",
                ext["large_s"],
            )
    modes = r.get("async_rollouts", {})
    if "async1_over_sync" in modes:

        def rounds(name: str) -> str:
            q = modes[f"{name}_over_sync_quartiles"]
            return (
                f" ({modes['paired_rounds']} rounds' iterations summed; median round "
                f"{modes[f'{name}_over_sync']:.2f}, quartiles {q[0]:.2f}–{q[1]:.2f})"
            )

        for name, label in (
            ("async1", "max_staleness 1"),
            ("async2_balanced", "max_staleness 2, the reference split between the two sides"),
            ("async2_merged", "max_staleness 2, balanced, the rollouts admitted at once sampled as one batch"),
            ("async3_merged", "max_staleness 3, balanced, up to 2 rollouts sampled as one batch"),
        ):
            if f"{name}_over_sync_total" not in modes:
                continue
            derived[f"{name}_over_sync"] = modes[f"{name}_over_sync_total"]
            row(
                f"GRPO iterations/s, async ({label}) / sync",
                f"{name}_over_sync",
                derived[f"{name}_over_sync"],
                rounds(name),
            )
        derived["async_ceiling_over_sync"] = modes["ceiling_over_sync_total"]
        row(
            "the ceiling of any split over 2 cores: sync step on 2 threads / (sync step on 1 thread / 2)",
            "async_ceiling_over_sync",
            derived["async_ceiling_over_sync"],
            rounds("ceiling"),
        )
        derived["async_ceiling_busy_over_sync"] = modes["ceiling_busy_over_sync_total"]
        row(
            "the ceiling with both cores at work: sync step on 2 threads / (sync step on 1 thread beside "
            f"another run on the other core / 2; that neighbour slows it {modes['neighbour_slowdown']:.2f}x)",
            "async_ceiling_busy_over_sync",
            derived["async_ceiling_busy_over_sync"],
            rounds("ceiling_busy"),
        )
        for name, label in (
            ("async2_balanced", "max_staleness 2, balanced"),
            ("async2_merged", "max_staleness 2, balanced, merged"),
            ("async3_merged", "max_staleness 3, balanced, merged"),
        ):
            if f"{name}_cpu_s" in modes:  # /proc: Linux
                key = f"{name}_cpu_over_sync_1thread"
                derived[key] = modes[f"{name}_cpu_s"] / modes["sync_1thread_cpu_s"]
                row(
                    f"CPU seconds per GRPO iteration, async ({label}; both processes) / sync "
                    f"on 1 thread (the async run keeps {modes[f'{name}_cores_busy']:.0%} of the 2 cores busy; "
                    f"{modes[f'{name}_merged']:.2f} rollouts in the batch of an iteration's sample, on average)",
                    key,
                    derived[key],
                )
    turns = r.get("multiturn", {})
    if "single_over_multi" in turns:
        derived["multiturn_single_over_multi"] = turns["single_over_multi"]
        row(
            f"tokens/s, one single-turn rollout / a multi-turn one of the same length (hf engine; "
            f"{turns['turns']:.1f} turns, {turns['tokens_per_trajectory']:.0f} tokens per trajectory)",
            "multiturn_single_over_multi",
            turns["single_over_multi"],
        )
    remote = r.get("reward_server", {})
    if "remote_step_s" in remote:  # reported, no target: the same machine runs the trainer and the server
        derived["grpo_remote_rm_over_in_process"] = remote["remote_over_local"]
        row(
            "GRPO steps/s, reward model behind lit_rlhf.serve / in-process (same model, same 2 cores)",
            "grpo_remote_rm_over_in_process",
            remote["remote_over_local"],
        )
        derived["remote_scoring_hidden"] = remote["hidden"]
        row(
            f"remote scoring hidden behind the rollout's reference forward (request {remote['latency_s']:.3f} s, "
            f"trainer blocked {remote['blocked_s']:.3f} s)",
            "remote_scoring_hidden",
            remote["hidden"],
        )
    missed = misses(derived)
    unmeasured = [name for name in TARGETS if derived.get(name) is None]
    lines += ["", f"Targets missed: {'; '.join(missed)}" if missed else "Every measured target held."]
    if unmeasured:
        lines.append(f"Not measured: {', '.join(unmeasured)}")
    if "pairs_per_s" in remote:
        pairs = remote["pairs_per_s"]
        lines += [
            "",
            "Reward server (lit_rlhf.serve, the bench reward model, one thread, requests one at a time): pairs/s by "
            "request rows: " + ", ".join(f"{b}: {v:.0f}" for b, v in pairs.items()),
        ]
    sync = r.get("sync_engine", {})
    if "bench_sync_s" in sync:
        lines += [
            "",
            f"vLLM engine weight sync (all parameters pushed, prefix cache reset; median): "
            f"{sync['bench_sync_s'] * 1e3:.1f} ms for the bench policy ({sync['bench_params'] / 1e6:.1f}M parameters)"
            + (
                f", {sync['big_sync_s'] * 1e3:.0f} ms for a {sync['big_params'] / 1e6:.0f}M-parameter Llama"
                if "big_sync_s" in sync
                else ""
            ),
            "Async producer weight path (board write by the trainer + read by the producer; a safetensors "
            "round trip through /dev/shm for comparison; median): "
            + "; ".join(
                f"{label}: {sync[f'{k}_board_publish_s'] * 1e3:.1f} + {sync[f'{k}_board_read_s'] * 1e3:.1f} ms "
                f"(files {sync[f'{k}_file_s'] * 1e3:.1f} ms)"
                for k, label in (("bench", "bench policy"), ("big", "103M Llama"))
                if f"{k}_board_publish_s" in sync
            ),
        ]
    return derived, "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, no TRL: checks the suite runs")
    ap.add_argument("--case", choices=list(CASES), help=argparse.SUPPRESS)
    ap.add_argument("--models", help=argparse.SUPPRESS)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    ap.add_argument("--cases", nargs="*", choices=list(CASES), help="run only these cases")
    ap.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="run the case list this many times, interleaved (A B A B), and keep each case's median "
        "round: noise on a shared VM hits one process at a time, not one case",
    )
    ap.add_argument("--summarize", metavar="JSON", help="only rebuild the tables from a results file")
    args = ap.parse_args()
    s = shapes(args.smoke)
    if args.summarize:
        saved = json.loads(Path(args.summarize).read_text())
        print(summarize(saved["results"], saved["shapes"], args.smoke)[1])
        return
    if args.case:  # child process
        import torch

        torch.set_num_threads(2)
        result = CASES[args.case](Path(args.models), s)
        result["rss_mb"] = peak_rss_mb()
        print(json.dumps(result))
        return
    cases = args.cases or [c for c in CASES if not (args.smoke and c in TRL_CASES)]
    with tempfile.TemporaryDirectory() as tmp:
        models = Path(tmp)
        build_models(models, s)
        results = {"params": json.loads((models / "params.json").read_text())["policy_params"]}
        rounds: dict[str, list[dict]] = {name: [] for name in cases}
        for r in range(1 if args.smoke else args.rounds):
            for name in cases:
                print(f"[bench] round {r + 1}: {name} …", flush=True)
                rounds[name].append(run_case(name, models, args.smoke))
                print(f"[bench] {name}: {rounds[name][-1]}", flush=True)
        for name, runs in rounds.items():
            ok = [x for x in runs if "error" not in x]
            key = {"floor": "floor_s", "sync_engine": "bench_sync_s", "extraction": "large_s"}
            key = {**key, "reward_server": "remote_over_local", "multiturn": "single_over_multi"}
            key = {**key, "async_rollouts": "async3_merged_over_sync_total"}.get(name, "step_s")
            results[name] = sorted(ok, key=lambda x: x[key])[(len(ok) - 1) // 2] if ok else runs[-1]
            results[name]["rounds"] = [x.get(key) for x in runs]
            if any("ratio" in x for x in ok):  # a paired case: its own ratio per round
                results[name]["ratio_rounds"] = [x["ratio"] for x in ok if "ratio" in x]
    derived, table = summarize(results, s, args.smoke)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "latest.json").write_text(json.dumps({"shapes": s, "results": results, "ratios": derived}, indent=2))
    (out / "latest.md").write_text(table + "\n")
    print(table)


if __name__ == "__main__":
    main()
