"""The main job: SFT → reward model → PPO (β = 0), PPO-max and DPO on the embedded task, then a table.

``python train.py`` (no ``algo`` chosen: the ``pipeline`` group's default, ``pipeline=demo``) runs
every stage as an ordinary job of its own (``runner.run`` on the stage's composed config), each
in ``<run dir>/<stage>/``; stages hand
artifacts to each other by path, so any stage can be rerun alone with the command it logs. At the
end the policies (SFT, PPO, PPO-max, DPO) are sampled on held-out prompts and compared on the
gold reward, the proxy (RM) reward, KL to the SFT model, perplexity and length (``summary.md``,
``summary.json``), and ``stability.png`` overlays both RL runs' stability panels.

What the demo shows (docs/demo.md, MOSS-RLHF): PPO-max raises the gold reward with a bounded KL;
vanilla PPO over-optimizes the proxy — its proxy reward keeps rising while its gold reward falls
below its own peak, with KL and length drifting.
"""

from __future__ import annotations

import json
import logging
import math
import os
from dataclasses import asdict, dataclass, field
from typing import Any

from lit_rlhf.utils.config import check

log = logging.getLogger(__name__)

STAGES = ("sft", "rm", "ppo", "ppo_max", "dpo", "grpo", "dapo")
EXPORTS = {"sft": "policy", "rm": "reward_model", "ppo": "actor", "ppo_max": "actor", "dpo": "policy", "grpo": "actor",
           "dapo": "actor"}  # fmt: skip
LABELS = {"ppo": "PPO (β=0)", "ppo_max": "PPO-max", "dpo": "DPO", "grpo": "GRPO", "dapo": "DAPO"}  # table rows
RL_STAGES = ("ppo", "ppo_max", "grpo", "dapo")  # stages with a validation curve of proxy and gold reward


@dataclass
class DemoConfig:
    """Stages and their Hydra overrides (``{sft}``, ``{rm}`` … expand to the stage directories)."""

    stages: list[str] = field(default_factory=lambda: list(STAGES))
    """Stages to run, in order (a later stage reads earlier stages' exports)."""
    common: list[str] = field(default_factory=list)
    """Overrides for every stage (command-line overrides other than algo.*/pipeline.*/hydra.* are added too)."""
    sft: list[str] = field(default_factory=lambda: ["algo=sft"])
    """Overrides composing the SFT stage."""
    rm: list[str] = field(default_factory=lambda: ["algo=rm"])
    """Overrides composing the reward-model stage."""
    ppo: list[str] = field(default_factory=lambda: ["algo=ppo"])
    """Overrides composing the vanilla PPO stage."""
    ppo_max: list[str] = field(default_factory=lambda: ["algo=ppo_max"])
    """Overrides composing the PPO-max stage."""
    dpo: list[str] = field(default_factory=lambda: ["algo=dpo"])
    """Overrides composing the DPO stage (trained from the SFT model on the reward model's pairs)."""
    grpo: list[str] = field(default_factory=lambda: ["algo=grpo"])
    """Overrides composing the GRPO stage (on the proxy reward model, PPO's prompt budget)."""
    dapo: list[str] = field(default_factory=lambda: ["algo=dapo"])
    """Overrides composing the DAPO stage."""
    reuse: bool = True
    """Skip a stage whose export already exists in the run directory (resume a pipeline)."""
    eval_prompts: int = field(default=256, metadata={"ge": 1})
    """Held-out prompts (the task's test split) sampled per policy for the final table."""
    eval_batch_size: int = field(default=64, metadata={"ge": 1})
    """Prompts per sampling batch in the final evaluation."""
    kl_bound: float = field(default=10.0, metadata={"gt": 0.0})
    """PPO-max's KL to SFT (nats per response) counts as bounded below this."""

    def validate(self) -> None:
        unknown = [s for s in self.stages if s not in STAGES]
        check(not unknown, "stages", f"unknown stages {unknown}; known: {list(STAGES)}")


class DemoPipeline:
    """Runs the stages, evaluates the policies, writes the summary and the PNG."""

    config_class = DemoConfig

    def __init__(self, config: DemoConfig) -> None:
        self.config = config

    # ---------------------------------------------------------------- stages
    def stage_overrides(self, stage: str, run_dir: str, cli: list[str]) -> list[str]:
        dirs = {s: os.path.join(run_dir, s) for s in STAGES}

        def expand(o: str) -> str:  # {sft}, {rm}, … → stage directories (str.format would trip on {_target_:…})
            for name, path in {**dirs, "run_dir": run_dir}.items():
                o = o.replace("{" + name + "}", path)
            return o

        overrides = [expand(o) for o in getattr(self.config, stage)]
        # the user's command line (seed=…, logger=…, trainer.…) reaches every stage; the stages choose their algo
        forwarded = [o for o in cli if not o.lstrip("+~").startswith(("algo", "pipeline", "hydra"))]
        return [*forwarded, *map(expand, self.config.common), *overrides, f"paths.output_dir={dirs[stage]}"]

    def compose_stage(self, overrides: list[str], root_dir: str) -> Any:
        from hydra import compose, initialize_config_dir
        from hydra.core.global_hydra import GlobalHydra

        if GlobalHydra.instance().is_initialized():  # inside train.py's Hydra app
            return compose(config_name="train", overrides=overrides)
        with initialize_config_dir(config_dir=os.path.join(root_dir, "conf"), version_base="1.3"):
            return compose(config_name="train", overrides=overrides)

    def run(self, cfg: Any) -> dict[str, float]:
        from lit_rlhf.runner import run as run_job

        run_dir = os.path.abspath(str(cfg.paths.output_dir))
        root_dir = str(cfg.paths.root_dir)
        cli = _cli_overrides()
        metrics: dict[str, float] = {}
        for stage in self.config.stages:
            export = os.path.join(run_dir, stage, EXPORTS[stage])
            overrides = self.stage_overrides(stage, run_dir, cli)
            log.info("stage %s — rerun it alone with: python train.py %s", stage, " ".join(_quote(o) for o in overrides))
            if self.config.reuse and os.path.isdir(export):
                log.info("stage %s: %s exists, reusing it (algo.reuse=false to retrain)", stage, export)
                continue
            stage_metrics = run_job(self.compose_stage(overrides, root_dir))
            metrics.update({f"{stage}/{k}": v for k, v in stage_metrics.items()})
        summary = self.summarize(run_dir, cfg)
        metrics.update(summary["flat"])
        return metrics

    # ------------------------------------------------------------ evaluation
    def summarize(self, run_dir: str, cfg: Any) -> dict[str, Any]:
        from lit_rlhf.data.synthetic import SyntheticTask, TaskConfig
        from lit_rlhf.report import render
        from lit_rlhf.utils.config import build_config

        task_cfg = build_config(TaskConfig, cfg.data.task, "data.task") if "task" in cfg.data else TaskConfig()
        task = SyntheticTask(task_cfg)
        prompts = [r["prompt"] for r in task.prompts(self.config.eval_prompts, "test")]
        sft, rm = os.path.join(run_dir, "sft", "policy"), os.path.join(run_dir, "rm", "reward_model")
        policies = {"SFT": sft}
        for stage, label in LABELS.items():
            path = os.path.join(run_dir, stage, EXPORTS[stage])
            if os.path.isdir(path):
                policies[label] = path
        gen, template, max_prompt_length = self.rollout_settings(run_dir, cfg)
        results = evaluate_policies(policies, sft, rm, task, prompts, self.config.eval_batch_size, gen, template,
                                    max_prompt_length)  # fmt: skip
        curves = {stage: training_curve(os.path.join(run_dir, stage)) for stage in RL_STAGES}
        checks = self.checks(results, curves)
        flat = {f"eval/{name}/{k}": v for name, res in results.items() for k, v in res.items()}
        flat.update({f"check/{k}": float(v) for k, v in checks.items() if isinstance(v, bool)})
        table = format_table(results, checks)
        print("\n" + table + "\n", flush=True)
        with open(os.path.join(run_dir, "summary.md"), "w") as fh:
            fh.write(table + "\n")
        with open(os.path.join(run_dir, "summary.json"), "w") as fh:
            json.dump({"policies": results, "curves": curves, "checks": checks, "config": asdict(self.config)}, fh, indent=2)
        rl_dirs = [(os.path.join(run_dir, s), LABELS[s]) for s in RL_STAGES if os.path.isdir(os.path.join(run_dir, s, "csv"))]
        if rl_dirs:
            png = render([d for d, _ in rl_dirs], os.path.join(run_dir, "stability.png"), [lbl for _, lbl in rl_dirs],
                         title="embedded task: " + " vs ".join(lbl for _, lbl in rl_dirs))  # fmt: skip
            log.info("stability panels: %s", png)
        log.info("summary: %s", os.path.join(run_dir, "summary.md"))
        return {"results": results, "checks": checks, "flat": flat}

    def rollout_settings(self, run_dir: str, cfg: Any) -> tuple[Any, str, int]:
        """The RL stages' own sampling settings, chat template and prompt length (the last RL stage
        of ``stages`` as composed for this run), so the final table samples as training did."""
        from lit_rlhf.rollout.generate import GenerationConfig
        from lit_rlhf.utils.config import build_config

        rl = [s for s in self.config.stages if s in ("ppo", "ppo_max")]  # (GRPO/DAPO sample alike: see the experiments)
        stage = rl[-1] if rl else "ppo_max"
        stage_cfg = self.compose_stage(self.stage_overrides(stage, run_dir, _cli_overrides()), str(cfg.paths.root_dir))
        gen = build_config(GenerationConfig, stage_cfg.algo.generation, "algo.generation")
        prompt = stage_cfg.data.prompt
        return gen, str(prompt.template), int(prompt.max_prompt_length)

    def checks(self, results: dict[str, dict[str, float]], curves: dict[str, dict[str, Any]]) -> dict[str, Any]:
        """The demo's claims, from the evaluation and the RL stages' validation curves: each trained
        policy's gold gain (in SFT σ) and whether its KL is bounded; for each RL stage, whether the
        gold reward fell from its peak while the proxy rose (over-optimization); PPO (β=0)'s drift."""
        out: dict[str, Any] = {}
        sft = results.get("SFT")
        for stage, label in LABELS.items():
            res = results.get(label)
            if sft and res:
                out[f"{stage}_gold_gain_in_sft_sigma"] = (res["gold_mean"] - sft["gold_mean"]) / max(sft["gold_std"], 1e-9)
                out[f"{stage}_kl_bounded"] = res["kl_to_sft"] < self.config.kl_bound
            curve = curves.get(stage) or {}
            gold, proxy = curve.get("gold", []), curve.get("proxy", [])
            if len(gold) >= 2 and len(proxy) >= 2:
                peak = max(range(len(gold)), key=lambda i: gold[i])
                out.update({f"{stage}_gold_peak": gold[peak], f"{stage}_gold_final": gold[-1],
                            f"{stage}_proxy_at_gold_peak": proxy[peak], f"{stage}_proxy_final": proxy[-1],
                            f"{stage}_overoptimized": gold[-1] < gold[peak] and proxy[-1] > proxy[peak]})  # fmt: skip
        if "ppo_max_gold_gain_in_sft_sigma" in out:
            out["ppo_max_raises_gold_by_1_sigma"] = out["ppo_max_gold_gain_in_sft_sigma"] >= 1.0
        ppo, pmax = results.get("PPO (β=0)"), results.get("PPO-max")
        if ppo and sft and pmax:
            # the drift that comes with it: KL far beyond PPO-max's bound, length away from SFT's
            out["ppo_kl_drift"] = ppo["kl_to_sft"] > self.config.kl_bound
            out["ppo_length_drift"] = abs(ppo["response_length"] - sft["response_length"]) > abs(
                pmax["response_length"] - sft["response_length"])
        return out


def _cli_overrides() -> list[str]:
    try:
        from hydra.core.hydra_config import HydraConfig

        return list(HydraConfig.get().overrides.task)
    except Exception:  # not inside a Hydra app (tests call DemoPipeline.run directly)
        return []


def _quote(o: str) -> str:
    """Shell-quote an override that holds braces, brackets or spaces."""
    return f"'{o}'" if any(c in o for c in " {}()[]$") else o


def training_curve(stage_dir: str) -> dict[str, list[float]]:
    """A PPO stage's validation curve from its CSV log: steps, proxy (RM) and gold reward, KL, length."""
    from lit_rlhf.report import find_metrics_csv, read_series

    path = find_metrics_csv(stage_dir) if os.path.isdir(stage_dir) else None
    if path is None:
        return {}
    s = read_series(path)
    out = {"steps": s.get("val/score_mean", ([], []))[0]}
    for key, name in (("val/score_mean", "proxy"), ("val/gold_score_mean", "gold"), ("val/kl", "kl"),
                      ("val/response_length", "length")):  # fmt: skip
        out[name] = s.get(key, ([], []))[1]
    return out


def _without_grad(fn: Any) -> Any:
    """``torch.no_grad()`` as a decorator that imports torch when called, not when this module is
    imported (train.py's config checks import it for ``DemoConfig`` and must stay light)."""
    import functools

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        import torch

        with torch.no_grad():
            return fn(*args, **kwargs)

    return wrapper


@_without_grad
def evaluate_policies(
    policies: dict[str, str], sft_path: str, rm_path: str, task: Any, prompts: list[str], batch_size: int,
    gen: Any = None, template: str = "plain", max_prompt_length: int = 16,
) -> dict[str, dict[str, float]]:  # fmt: skip
    """Sample every policy on the same held-out prompts (the RL stages' generation settings,
    template and prompt length; ``gen`` None = the tiny experiments' sampling) through the one
    rollout path (:func:`~lit_rlhf.rollout.collect.generate_and_score`) and measure the gold
    reward, the proxy reward, KL to SFT (Σ_t k1 per response), the perplexity of the responses
    under the policy, response length and truncation rate."""
    import torch

    from lit_rlhf.core.kl import sequence_kl
    from lit_rlhf.core.masked import masked_sum
    from lit_rlhf.data.prompts import collate_prompts, encode_prompt
    from lit_rlhf.data.templates import get_template
    from lit_rlhf.models.builders import build_causal_lm, build_tokenizer, freeze
    from lit_rlhf.models.reward import load_reward_model
    from lit_rlhf.models.spec import ModelSpec
    from lit_rlhf.rollout.collect import generate_and_score
    from lit_rlhf.rollout.generate import GenerationConfig
    from lit_rlhf.rollout.score import ModelScorer

    tok = build_tokenizer(ModelSpec(name_or_path=sft_path))
    sft = freeze(build_causal_lm(ModelSpec(name_or_path=sft_path), tok))
    rm = freeze(load_reward_model(rm_path)) if os.path.isdir(rm_path) else None
    chat = get_template(template)
    scorer = ModelScorer(rm, tok, tok, chat, 512) if rm is not None else None
    if gen is None:
        gen = GenerationConfig(max_new_tokens=24, temperature=0.8, top_p=0.9, repetition_penalty=1.1)
    results = {}
    for name, path in policies.items():
        policy = sft if path == sft_path else freeze(build_causal_lm(ModelSpec(name_or_path=path), tok))
        torch.manual_seed(0)
        gold, proxy, kl, nll, tokens, lengths, ended = [], [], [], 0.0, 0, [], []
        for start in range(0, len(prompts), batch_size):
            chunk = prompts[start : start + batch_size]
            batch = collate_prompts([(encode_prompt(tok, chat.format_prompt(p), max_prompt_length)[0], p) for p in chunk],
                                    tok.pad_token_id)  # fmt: skip
            r = generate_and_score(policy, batch, tok, gen, reference=sft, scorer=scorer)
            gold += [task.gold_reward(p, t, e) for p, t, e in zip(chunk, r.responses_text, r.ended.tolist())]
            proxy += r.scores.tolist() if r.scores is not None else []
            kl += sequence_kl(r.logprobs, r.ref_logprobs, r.response_mask, clamp=None).tolist()
            nll -= float(masked_sum(r.logprobs, r.response_mask))
            tokens += int(r.response_mask.sum())
            lengths += r.response_lengths.tolist()
            ended += r.ended.tolist()
        g = torch.tensor(gold)
        results[name] = {
            "gold_mean": float(g.mean()),
            "gold_std": float(g.std(unbiased=True)),
            "proxy_mean": float(torch.tensor(proxy).mean()) if proxy else math.nan,
            "kl_to_sft": float(torch.tensor(kl).mean()),
            "perplexity": math.exp(nll / max(tokens, 1)),
            "response_length": float(torch.tensor(lengths, dtype=torch.float32).mean()),
            "truncation_rate": 1.0 - sum(ended) / len(ended),
        }
    return results


def format_table(results: dict[str, dict[str, float]], checks: dict[str, Any]) -> str:
    """The markdown table printed at the end of the demo (and saved as summary.md), with its notes."""
    cols = [("gold reward", "gold_mean", "{:+.3f}"), ("(std)", "gold_std", "{:.3f}"),
            ("proxy (RM) reward", "proxy_mean", "{:+.3f}"), ("KL to SFT", "kl_to_sft", "{:.2f}"),
            ("perplexity", "perplexity", "{:.2f}"), ("length", "response_length", "{:.1f}"),
            ("truncated", "truncation_rate", "{:.0%}")]  # fmt: skip
    lines = ["| policy | " + " | ".join(c for c, _, _ in cols) + " |", "|---" * (len(cols) + 1) + "|"]
    for name, res in results.items():
        lines.append(f"| {name} | " + " | ".join(fmt.format(res[k]) for _, k, fmt in cols) + " |")
    return "\n".join(lines + [""] + [f"- {n}" for n in _notes(results, checks)])


def _notes(results: dict[str, dict[str, float]], checks: dict[str, Any]) -> list[str]:
    notes = []
    for stage, label in LABELS.items():
        if f"{stage}_gold_gain_in_sft_sigma" not in checks or stage == "ppo":
            continue
        line = (f"{label} vs SFT: gold {checks[f'{stage}_gold_gain_in_sft_sigma']:+.2f} SFT σ; KL to SFT "
                f"{results[label]['kl_to_sft']:.2f} ({'bounded' if checks[f'{stage}_kl_bounded'] else 'NOT bounded'})")  # fmt: skip
        if stage != "ppo_max":
            line += f", length {results['SFT']['response_length']:.1f} → {results[label]['response_length']:.1f}"
        if f"{stage}_overoptimized" in checks and stage != "ppo_max":
            line += (f"; during training gold peaked at {checks[f'{stage}_gold_peak']:+.3f} and ended at "
                     f"{checks[f'{stage}_gold_final']:+.3f}: "
                     f"{'over-optimization' if checks[f'{stage}_overoptimized'] else 'no over-optimization'}")  # fmt: skip
        notes.append(line)
    if "ppo_overoptimized" in checks:
        notes.append(
            f"PPO (β=0) during training: gold peaked at {checks['ppo_gold_peak']:+.3f} and ended at "
            f"{checks['ppo_gold_final']:+.3f} while the proxy went {checks['ppo_proxy_at_gold_peak']:+.2f} → "
            f"{checks['ppo_proxy_final']:+.2f}: {'over-optimization' if checks['ppo_overoptimized'] else 'no over-optimization'}"
        )
    if "ppo_kl_drift" in checks:
        ppo, sft = results["PPO (β=0)"], results["SFT"]
        notes.append(
            f"PPO (β=0) drift: KL to SFT {ppo['kl_to_sft']:.1f} ({'beyond' if checks['ppo_kl_drift'] else 'within'} the "
            f"bound), length {sft['response_length']:.1f} → {ppo['response_length']:.1f} "
            f"({'more' if checks['ppo_length_drift'] else 'less'} than PPO-max's change)"
        )
    return notes
