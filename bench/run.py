"""lit_rlhf benchmarks: PPO step vs TRL and vs the compute floor, RM step vs TRL, generation.

    python bench/run.py              # full run (make bench): installs TRL 1.12.0 into bench/.trl
    python bench/run.py --smoke      # tiny shapes, 1 timed step, no TRL: a CI check that it runs

Setting: a tiny Llama (hidden 256, 4 layers, 4 heads, intermediate 512), fp32, 2 threads,
16 prompts x 64 new tokens, 1 PPO epoch over 1 minibatch. Every case runs in its own subprocess
(so its peak RSS is its own) and reports the median seconds of its timed steps after warm-up.
Both sides sample with temperature 0.7 and no top-k/top-p/repetition penalty (TRL's sampler).
Ratios come from one run (these machines are noisy), never from absolute times. Results:
``bench/results/latest.json`` and ``latest.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

from cases import CASES, ROOT, TRL_CASES, build_models, peak_rss_mb, shapes  # bench/cases.py (this script's folder)


# --------------------------------------------------------------------------- driver
def run_case(name: str, models: Path, smoke: bool) -> dict:
    """One case in a fresh interpreter (own peak RSS, 2 threads)."""
    env = dict(os.environ, OMP_NUM_THREADS="2", MKL_NUM_THREADS="2", TOKENIZERS_PARALLELISM="false",
               HF_HUB_OFFLINE="1", PYTHONPATH=str(ROOT), WANDB_MODE="disabled")  # fmt: skip
    cmd = [sys.executable, str(Path(__file__)), "--case", name, "--models", str(models)] + (["--smoke"] if smoke else [])
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        return {"error": proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else f"exit {proc.returncode}"}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def summarize(r: dict, s: dict, smoke: bool) -> tuple[dict, str]:
    ours, trl, floor = r.get("ppo_ours", {}), r.get("ppo_trl", {}), r.get("floor", {})
    derived = {}
    if "step_s" in ours and "floor_s" in floor:
        derived["ppo_step_over_naive_floor"] = ours["step_s"] / floor["floor_s"]
    if "samples_per_s" in ours and "samples_per_s" in trl:
        derived["ppo_samples_per_s_ours_over_trl"] = ours["samples_per_s"] / trl["samples_per_s"]
        # the same ratio within each interleaved round (TRL's step time / ours): its spread is the noise
        paired = [t / o for o, t in zip(ours.get("rounds", []), trl.get("rounds", [])) if o and t]
        derived["ppo_samples_per_s_ours_over_trl_by_round"] = paired
        derived["trl_step_over_naive_floor"] = trl["step_s"] / floor["floor_s"] if "floor_s" in floor else None
    if "pairs_per_s" in r.get("rm_ours", {}) and "pairs_per_s" in r.get("rm_trl", {}):
        derived["rm_pairs_per_s_ours_over_trl"] = r["rm_ours"]["pairs_per_s"] / r["rm_trl"]["pairs_per_s"]
    if "tokens_per_s" in r.get("generate_ours", {}) and "tokens_per_s" in r.get("generate_bare", {}):
        derived["generate_tokens_per_s_ours_over_bare"] = r["generate_ours"]["tokens_per_s"] / r["generate_bare"]["tokens_per_s"]

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
    for name, unit in (("ppo_ours", "samples_per_s"), ("ppo_trl", "samples_per_s"), ("rm_ours", "pairs_per_s"),
                       ("rm_trl", "pairs_per_s"), ("generate_ours", "tokens_per_s"), ("generate_bare", "tokens_per_s")):  # fmt: skip
        c = r.get(name, {})
        if "error" in c or not c:
            lines.append(f"| {name} | {c.get('error', 'skipped')} | | |")
            continue
        lines.append(f"| {name} | {fmt(c['step_s'])} | {fmt(c[unit], '{:.1f}')} {unit.replace('_per_s', '/s')} | {fmt(c['rss_mb'], '{:.0f}')} |")
    lines.append("| grpo_ours vs trl GRPOTrainer | skipped: GRPO not implemented yet (GRPO issue) | | |")
    if floor and "floor_s" in floor:
        lines += ["", f"Naive floor: generate {floor['generate_s']:.3f} s + four scoring forwards "
                  f"{floor['score_forwards_s']:.3f} s + actor & critic train fwd/bwd {floor['train_fwd_bwd_s']:.3f} s "
                  f"= {floor['floor_s']:.3f} s"]  # fmt: skip
    lines += ["", "| ratio | value | target |", "|---|---|---|",
              f"| lit_rlhf PPO step / naive floor | {fmt(derived.get('ppo_step_over_naive_floor'), '{:.2f}')} | ≤ 1.10 |",
              f"| TRL PPO step / naive floor | {fmt(derived.get('trl_step_over_naive_floor'), '{:.2f}')} | |",
              f"| PPO samples/s, lit_rlhf / TRL | {fmt(derived.get('ppo_samples_per_s_ours_over_trl'), '{:.2f}')}"
              + (f" (by round: {', '.join(f'{x:.2f}' for x in derived['ppo_samples_per_s_ours_over_trl_by_round'])})"
                 if len(derived.get("ppo_samples_per_s_ours_over_trl_by_round", [])) > 1 else "") + " | ≥ 1.5 |",
              f"| RM pairs/s, lit_rlhf / TRL | {fmt(derived.get('rm_pairs_per_s_ours_over_trl'), '{:.2f}')} | |",
              f"| generation tokens/s, lit_rlhf / bare generate | {fmt(derived.get('generate_tokens_per_s_ours_over_bare'), '{:.2f}')} | |"]  # fmt: skip
    if "rss_mb" in ours and "rss_mb" in trl:
        lines.append(f"| PPO peak RSS, lit_rlhf / TRL | {ours['rss_mb'] / trl['rss_mb']:.2f} | ≤ 1.0 |")
        derived["ppo_rss_ours_over_trl"] = ours["rss_mb"] / trl["rss_mb"]
    return derived, "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, no TRL: checks the suite runs")
    ap.add_argument("--case", choices=list(CASES), help=argparse.SUPPRESS)
    ap.add_argument("--models", help=argparse.SUPPRESS)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    ap.add_argument("--cases", nargs="*", choices=list(CASES), help="run only these cases")
    ap.add_argument("--rounds", type=int, default=3,
                    help="run the case list this many times, interleaved (A B A B), and keep each case's median "
                         "round: noise on a shared VM hits one process at a time, not one case")  # fmt: skip
    args = ap.parse_args()
    s = shapes(args.smoke)
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
            key = "floor_s" if name == "floor" else "step_s"
            results[name] = sorted(ok, key=lambda x: x[key])[(len(ok) - 1) // 2] if ok else runs[-1]
            results[name]["rounds"] = [x.get(key) for x in runs]
    derived, table = summarize(results, s, args.smoke)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "latest.json").write_text(json.dumps({"shapes": s, "results": results, "ratios": derived}, indent=2))
    (out / "latest.md").write_text(table + "\n")
    print(table)


if __name__ == "__main__":
    main()
