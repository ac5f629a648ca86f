"""Pipelines: named stages run as ordinary jobs, then an evaluation table.

``python train.py`` (no ``algo`` chosen: the ``pipeline`` group's default, ``pipeline=demo``) runs
every stage of ``pipeline.stages`` as an ordinary job of its own (``runner.run`` on the stage's
composed config, ``pipeline.jobs.<stage>`` its overrides), each in ``<run dir>/<stage>/``; stages
hand artifacts to each other by path (``{sft}`` in an override is the sft stage's directory), so
any stage can be rerun alone with the command it logs, and a stage whose export exists is reused.

:class:`DemoPipeline` (``pipeline=demo``, ``pipeline=zoo``) then samples every policy on held-out
prompts of the embedded task and compares it with the baseline (SFT) on the gold reward, the proxy
(RM) reward, KL to SFT, perplexity and length (``summary.md``, ``summary.json``), and
``stability.png`` overlays the RL runs' stability panels.

:class:`~lit_rlhf.pipelines.reasoning.ReasoningPipeline` (``pipeline=reasoning``) runs the same
stages machinery and instead answers held-out problems of the embedded reasoning task with every
policy (docs/rewards.md §8).

What the demo shows (docs/demo.md, MOSS-RLHF): PPO-max raises the gold reward with a bounded KL;
vanilla PPO over-optimizes the proxy — its proxy reward keeps rising while its gold reward falls
below its own peak, with KL and length drifting. The zoo puts SimPO, ORPO, KTO, REINFORCE++ and
ReMax in the same table as DPO and GRPO.
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


@dataclass
class PipelineConfig:
    """Named stages (each an ordinary train.py job) run in order; ``{<stage>}`` in an override
    expands to that stage's directory, ``{run_dir}`` to the run's."""

    stages: list[str] = field(default_factory=list)
    """Stages to run, in order (a later stage reads earlier stages' exports); each is a key of ``jobs``."""
    jobs: dict[str, list[str]] = field(default_factory=dict)
    """Stage name → the overrides composing it (e.g. ``[experiment=dpo_synthetic_tiny,
    algo.policy_path={sft}/policy]``); a job may be defined and not run (``stages`` chooses)."""
    common: list[str] = field(default_factory=list)
    """Overrides for every stage (command-line overrides other than algo.*/pipeline.*/hydra.* are added too)."""
    reuse: bool = True
    """Skip a stage whose export (its ``algo.export_dir``) already exists in the run directory (resume a
    pipeline, or add stages to a finished run: ``pipeline=zoo paths.output_dir=<a demo run>``)."""

    def validate(self) -> None:
        check(bool(self.stages), "stages", "is empty: name the stages to run (keys of pipeline.jobs)")
        unknown = [s for s in self.stages if s not in self.jobs]
        check(
            not unknown,
            "stages",
            f"{unknown} have no job (pipeline.jobs.<stage>: its overrides); jobs: {list(self.jobs)}",
        )
        odd = [s for s in self.jobs if not s.isidentifier()]
        check(not odd, "jobs", f"stage names must be identifiers (they name folders and {{stage}} placeholders): {odd}")


@dataclass
class DemoConfig(PipelineConfig):
    """The stages and the final gold-reward table: every stage with an export that is a policy is
    sampled on held-out prompts of the embedded task and compared with the ``baseline`` stage."""

    labels: dict[str, str] = field(default_factory=dict)
    """Stage → its row in the table (a stage without one is named by its stage name)."""
    baseline: str = "sft"
    """The stage whose policy is the reference of the table (KL to it, gains in its σ of gold reward)."""
    proxy: str | None = "rm"
    """The reward-model stage whose model scores the proxy reward column; None = no proxy column."""
    eval_stage: str = "ppo_max"
    """The job whose sampling settings (algo.generation, template, prompt length) the table samples with."""
    eval_prompts: int = field(default=256, metadata={"ge": 1})
    """Held-out prompts (the task's test split) sampled per policy for the final table."""
    eval_batch_size: int = field(default=64, metadata={"ge": 1})
    """Prompts per sampling batch in the final evaluation."""
    kl_bound: float = field(default=10.0, metadata={"gt": 0.0})
    """A policy's KL to the baseline (nats per response) counts as bounded below this."""

    def validate(self) -> None:
        super().validate()
        for key in ("baseline", "eval_stage"):
            check(getattr(self, key) in self.jobs, key, f"{getattr(self, key)!r} is not a job ({list(self.jobs)})")
        check(
            self.proxy is None or self.proxy in self.jobs, "proxy", f"{self.proxy!r} is not a job ({list(self.jobs)})"
        )


class StagePipeline:
    """Runs ``config.stages`` in order, each a job of its own in ``<run dir>/<stage>/``, then
    :meth:`summarize` (the subclass's evaluation)."""

    config_class = PipelineConfig

    def __init__(self, config: PipelineConfig) -> None:
        self.config = config
        self._composed: dict[str, Any] = {}

    # ---------------------------------------------------------------- stages
    def stage_overrides(self, stage: str, run_dir: str, cli: list[str]) -> list[str]:
        dirs = {s: os.path.join(run_dir, s) for s in self.config.jobs}

        def expand(o: str) -> str:  # {sft}, {rm}, … → stage directories (str.format would trip on {_target_:…})
            for name, path in {**dirs, "run_dir": run_dir}.items():
                o = o.replace("{" + name + "}", path)
            return o

        overrides = [expand(o) for o in self.config.jobs[stage]]
        # the user's command line (seed=…, logger=…, trainer.…) reaches every stage; the stages choose their algo
        forwarded = [o for o in cli if not o.lstrip("+~").startswith(("algo", "pipeline", "hydra"))]
        return [*forwarded, *map(expand, self.config.common), *overrides, f"paths.output_dir={dirs[stage]}"]

    def compose_stage(self, overrides: list[str]) -> Any:
        from hydra import compose, initialize_config_dir
        from hydra.core.global_hydra import GlobalHydra

        from lit_rlhf.launch.presets import CONF_DIR

        if GlobalHydra.instance().is_initialized():  # inside train.py's Hydra app
            return compose(config_name="train", overrides=overrides)
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            return compose(config_name="train", overrides=overrides)

    def stage_config(self, stage: str, run_dir: str, cfg: Any) -> Any:
        """The stage's job as composed for this run (cached)."""
        if stage not in self._composed:
            overrides = self.stage_overrides(stage, run_dir, _cli_overrides())
            self._composed[stage] = self.compose_stage(overrides)
        return self._composed[stage]

    def export_of(self, stage: str, run_dir: str, cfg: Any) -> str | None:
        """The folder the stage saves its model to (its ``algo.export_dir``), None if it saves none."""
        export = self.stage_config(stage, run_dir, cfg).algo.get("export_dir")
        return os.path.abspath(str(export)) if export else None

    def run(self, cfg: Any) -> dict[str, float]:
        from lit_rlhf.launch.runner import run as run_job

        run_dir = os.path.abspath(str(cfg.paths.output_dir))
        metrics: dict[str, float] = {}
        for stage in self.config.stages:
            overrides = self.stage_overrides(stage, run_dir, _cli_overrides())
            export = self.export_of(stage, run_dir, cfg)
            log.info(
                "stage %s — rerun it alone with: python train.py %s", stage, " ".join(_quote(o) for o in overrides)
            )
            if self.config.reuse and export and os.path.isdir(export):
                log.info("stage %s: %s exists, reusing it (pipeline.reuse=false to retrain)", stage, export)
                continue
            stage_metrics = run_job(self.stage_config(stage, run_dir, cfg))
            metrics.update({f"{stage}/{k}": v for k, v in stage_metrics.items()})
        summary = self.summarize(run_dir, cfg)
        metrics.update(summary["flat"])
        return metrics

    def summarize(self, run_dir: str, cfg: Any) -> dict[str, Any]:
        """The evaluation after the stages: ``{"flat": {metric: value}, …}``."""
        raise NotImplementedError


class DemoPipeline(StagePipeline):
    """The stages, then every policy evaluated on the embedded task's gold reward: the summary and the PNG."""

    config_class = DemoConfig
    config: DemoConfig

    def label(self, stage: str) -> str:
        return self.config.labels.get(stage, stage)

    # ------------------------------------------------------------ evaluation
    def compared_stages(self, run_dir: str, cfg: Any) -> dict[str, str]:
        """Stage → export of every policy the table compares with the baseline: the stages of
        ``stages`` (in order) other than the baseline and the proxy whose export exists and is a
        policy (a reward-model stage's is not)."""
        c = self.config
        out = {}
        for stage in c.stages:
            if stage in (c.baseline, c.proxy):
                continue
            export = self.export_of(stage, run_dir, cfg)
            target = str(self.stage_config(stage, run_dir, cfg).algo.get("_target_", ""))
            if export and os.path.isdir(export) and not target.endswith("RewardModelModule"):
                out[stage] = export
        return out

    def summarize(self, run_dir: str, cfg: Any) -> dict[str, Any]:
        from lit_rlhf.callbacks.dashboard import render
        from lit_rlhf.data.synthetic import SyntheticTask, TaskConfig
        from lit_rlhf.utils.config import build_config

        c = self.config
        task_cfg = build_config(TaskConfig, cfg.data.task, "data.task") if "task" in cfg.data else TaskConfig()
        task = SyntheticTask(task_cfg)
        prompts = [r["prompt"] for r in task.prompts(c.eval_prompts, "test")]
        sft = self.export_of(c.baseline, run_dir, cfg)
        rm = self.export_of(c.proxy, run_dir, cfg) if c.proxy else None
        if sft is None or not os.path.isdir(sft):
            raise FileNotFoundError(f"pipeline.baseline={c.baseline}: no policy at {sft} (run that stage first)")
        compared = self.compared_stages(run_dir, cfg)
        labels = {c.baseline: self.label(c.baseline), **{s: self.label(s) for s in compared}}
        policies = {labels[c.baseline]: sft, **{labels[s]: path for s, path in compared.items()}}
        gen, template, max_prompt_length = self.rollout_settings(run_dir, cfg)
        results = evaluate_policies(
            policies, sft, rm or "", task, prompts, c.eval_batch_size, gen, template, max_prompt_length
        )
        curves = {stage: training_curve(os.path.join(run_dir, stage)) for stage in compared}
        checks = self.checks(results, curves, labels)
        flat = {f"eval/{name}/{k}": v for name, res in results.items() for k, v in res.items()}
        flat.update({f"check/{k}": float(v) for k, v in checks.items() if isinstance(v, bool)})
        table = format_table(results, checks, labels, c.baseline)
        print("\n" + table + "\n", flush=True)
        with open(os.path.join(run_dir, "summary.md"), "w") as fh:
            fh.write(table + "\n")
        with open(os.path.join(run_dir, "summary.json"), "w") as fh:
            json.dump({"policies": results, "curves": curves, "checks": checks, "config": asdict(c)}, fh, indent=2)
        rl = [s for s in compared if curves[s].get("gold")]  # RL stages: a validation curve of gold reward
        if rl:
            png = render(
                [os.path.join(run_dir, s) for s in rl],
                os.path.join(run_dir, "stability.png"),
                [labels[s] for s in rl],
                title="embedded task: " + " vs ".join(labels[s] for s in rl),
            )
            log.info("stability panels: %s", png)
        log.info("summary: %s", os.path.join(run_dir, "summary.md"))
        return {"results": results, "checks": checks, "flat": flat}

    def rollout_settings(self, run_dir: str, cfg: Any) -> tuple[Any, str, int]:
        """The sampling settings, chat template and prompt length of the ``eval_stage`` job as
        composed for this run, so the final table samples as that RL stage trained."""
        from lit_rlhf.rollout.generate import GenerationConfig
        from lit_rlhf.utils.config import build_config

        stage_cfg = self.stage_config(self.config.eval_stage, run_dir, cfg)
        gen = build_config(GenerationConfig, stage_cfg.algo.generation, "algo.generation")
        prompt = stage_cfg.data.prompt
        return gen, str(prompt.template), int(prompt.max_prompt_length)

    def checks(
        self, results: dict[str, dict[str, float]], curves: dict[str, dict[str, Any]], labels: dict[str, str]
    ) -> dict[str, Any]:
        """The demo's claims, from the evaluation and the RL stages' validation curves: each trained
        policy's gold gain (in the baseline's σ) and whether its KL is bounded; for each RL stage,
        whether the gold reward fell from its peak while the proxy rose (over-optimization); PPO
        (β=0)'s drift (stages ``ppo`` and ``ppo_max``)."""
        out: dict[str, Any] = {}
        sft = results.get(labels[self.config.baseline])
        for stage, label in labels.items():
            res = results.get(label)
            if stage == self.config.baseline:
                continue
            if sft and res:
                out[f"{stage}_gold_gain_in_sft_sigma"] = (res["gold_mean"] - sft["gold_mean"]) / max(
                    sft["gold_std"], 1e-9
                )
                out[f"{stage}_kl_bounded"] = res["kl_to_sft"] < self.config.kl_bound
            curve = curves.get(stage) or {}
            gold, proxy = curve.get("gold", []), curve.get("proxy", [])
            if len(gold) >= 2 and len(proxy) >= 2:
                peak = max(range(len(gold)), key=lambda i: gold[i])
                out.update(
                    {
                        f"{stage}_gold_peak": gold[peak],
                        f"{stage}_gold_final": gold[-1],
                        f"{stage}_proxy_at_gold_peak": proxy[peak],
                        f"{stage}_proxy_final": proxy[-1],
                        f"{stage}_overoptimized": gold[-1] < gold[peak] and proxy[-1] > proxy[peak],
                    }
                )
        if "ppo_max_gold_gain_in_sft_sigma" in out:
            out["ppo_max_raises_gold_by_1_sigma"] = out["ppo_max_gold_gain_in_sft_sigma"] >= 1.0
        ppo, pmax = results.get(labels.get("ppo", "")), results.get(labels.get("ppo_max", ""))
        if ppo and sft and pmax:
            # the drift that comes with it: KL far beyond PPO-max's bound, length away from SFT's
            out["ppo_kl_drift"] = ppo["kl_to_sft"] > self.config.kl_bound
            out["ppo_length_drift"] = abs(ppo["response_length"] - sft["response_length"]) > abs(
                pmax["response_length"] - sft["response_length"]
            )
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
    from lit_rlhf.callbacks.dashboard import find_metrics_csv, read_series

    path = find_metrics_csv(stage_dir) if os.path.isdir(stage_dir) else None
    if path is None:
        return {}
    s = read_series(path)
    out = {"steps": s.get("val/score_mean", ([], []))[0]}
    for key, name in (
        ("val/score_mean", "proxy"),
        ("val/gold_score_mean", "gold"),
        ("val/kl", "kl"),
        ("val/response_length", "length"),
    ):
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
    policies: dict[str, str],
    sft_path: str,
    rm_path: str,
    task: Any,
    prompts: list[str],
    batch_size: int,
    gen: Any = None,
    template: str = "plain",
    max_prompt_length: int = 16,
) -> dict[str, dict[str, float]]:
    """Sample every policy on the same held-out prompts (the RL stages' generation settings,
    template and prompt length; ``gen`` None = the tiny experiments' sampling) through the one
    rollout path (:func:`~lit_rlhf.rollout.collect.generate_and_score`) and measure the gold
    reward, the proxy reward, KL to SFT (Σ_t k1 per response), the perplexity of the responses
    under the policy, response length and truncation rate."""
    import torch

    from lit_rlhf.core.kl import sequence_kl
    from lit_rlhf.core.masked import masked_sum
    from lit_rlhf.data.chat import get_template
    from lit_rlhf.data.prompts import collate_prompts, encode_prompt
    from lit_rlhf.data.tokenizers import build_tokenizer
    from lit_rlhf.models.builders import build_causal_lm, freeze
    from lit_rlhf.models.reward import load_reward_model
    from lit_rlhf.models.spec import ModelSpec
    from lit_rlhf.rollout.collect import generate_and_score
    from lit_rlhf.rollout.generate import GenerationConfig
    from lit_rlhf.rollout.scorers import ModelScorer
    from lit_rlhf.rollout.vllm_engine import engine_for

    tok = build_tokenizer(ModelSpec(name_or_path=sft_path))
    sft = freeze(build_causal_lm(ModelSpec(name_or_path=sft_path), tok))
    rm = freeze(load_reward_model(rm_path)) if os.path.isdir(rm_path) else None
    chat = get_template(template)
    scorer = ModelScorer(rm, tok, tok, chat, 512) if rm is not None else None
    if gen is None:
        gen = GenerationConfig(max_new_tokens=24, temperature=0.8, top_p=0.9, repetition_penalty=1.1)
    results, engine = {}, None
    try:
        for name, path in policies.items():
            policy = sft if path == sft_path else freeze(build_causal_lm(ModelSpec(name_or_path=path), tok))
            engine = engine_for(policy, gen, path, engine)  # None: the hf loop samples from the policy
            torch.manual_seed(0)
            gold, proxy, kl, nll, tokens, lengths, ended = [], [], [], 0.0, 0, [], []
            for start in range(0, len(prompts), batch_size):
                chunk = prompts[start : start + batch_size]
                batch = collate_prompts(
                    [(encode_prompt(tok, p, max_prompt_length, chat)[0], p) for p in chunk], tok.pad_token_id
                )
                r = generate_and_score(policy, batch, tok, gen, reference=sft, scorer=scorer, engine=engine)
                gold += [task.gold_reward(p, t, e) for p, t, e in zip(chunk, r.responses_text, r.ended.tolist())]
                proxy += r.scores.tolist() if r.scores is not None else []
                kl += sequence_kl(r.logprobs, r.ref_logprobs, r.response_mask, clamp=None).tolist()
                nll -= float(masked_sum(r.logprobs, r.response_mask))
                tokens += int(r.response_mask.sum())
                lengths += r.response_lengths.tolist()
                ended += r.ended.tolist()
            results[name] = _policy_metrics(gold, proxy, kl, nll, tokens, lengths, ended)
    finally:
        if engine is not None:
            engine.close()
    return results


def _policy_metrics(
    gold: list[float],
    proxy: list[float],
    kl: list[float],
    nll: float,
    tokens: int,
    lengths: list[int],
    ended: list[bool],
) -> dict[str, float]:
    """One policy's row of :func:`evaluate_policies` from its responses' values."""
    import torch

    g = torch.tensor(gold)
    return {
        "gold_mean": float(g.mean()),
        "gold_std": float(g.std(unbiased=True)),
        "proxy_mean": float(torch.tensor(proxy).mean()) if proxy else math.nan,
        "kl_to_sft": float(torch.tensor(kl).mean()),
        "perplexity": math.exp(nll / max(tokens, 1)),
        "response_length": float(torch.tensor(lengths, dtype=torch.float32).mean()),
        "truncation_rate": 1.0 - sum(ended) / len(ended),
    }


def format_table(
    results: dict[str, dict[str, float]], checks: dict[str, Any], labels: dict[str, str], baseline: str = "sft"
) -> str:
    """The markdown table printed at the end of the demo (and saved as summary.md), with its notes;
    ``labels``: stage → row name (the baseline's row first)."""
    cols = [
        ("gold reward", "gold_mean", "{:+.3f}"),
        ("(std)", "gold_std", "{:.3f}"),
        ("proxy (RM) reward", "proxy_mean", "{:+.3f}"),
        ("KL to SFT", "kl_to_sft", "{:.2f}"),
        ("perplexity", "perplexity", "{:.2f}"),
        ("length", "response_length", "{:.1f}"),
        ("truncated", "truncation_rate", "{:.0%}"),
    ]
    lines = ["| policy | " + " | ".join(c for c, _, _ in cols) + " |", "|---" * (len(cols) + 1) + "|"]
    for name, res in results.items():
        lines.append(f"| {name} | " + " | ".join(fmt.format(res[k]) for _, k, fmt in cols) + " |")
    return "\n".join(lines + [""] + [f"- {n}" for n in _notes(results, checks, labels, baseline)])


def _notes(
    results: dict[str, dict[str, float]], checks: dict[str, Any], labels: dict[str, str], baseline: str
) -> list[str]:
    notes = []
    base = labels[baseline]
    for stage, label in labels.items():
        if f"{stage}_gold_gain_in_sft_sigma" not in checks or stage in ("ppo", baseline):
            continue
        line = (
            f"{label} vs {base}: gold {checks[f'{stage}_gold_gain_in_sft_sigma']:+.2f} {base} σ; KL to {base} "
            f"{results[label]['kl_to_sft']:.2f} ({'bounded' if checks[f'{stage}_kl_bounded'] else 'NOT bounded'})"
        )
        if stage != "ppo_max":
            line += f", length {results[base]['response_length']:.1f} → {results[label]['response_length']:.1f}"
        if f"{stage}_overoptimized" in checks and stage != "ppo_max":
            line += (
                f"; during training gold peaked at {checks[f'{stage}_gold_peak']:+.3f} and ended at "
                f"{checks[f'{stage}_gold_final']:+.3f}: "
                f"{'over-optimization' if checks[f'{stage}_overoptimized'] else 'no over-optimization'}"
            )
        notes.append(line)
    ppo = labels.get("ppo", "ppo")
    if "ppo_overoptimized" in checks:
        notes.append(
            f"{ppo} during training: gold peaked at {checks['ppo_gold_peak']:+.3f} and ended at "
            f"{checks['ppo_gold_final']:+.3f} while the proxy went {checks['ppo_proxy_at_gold_peak']:+.2f} → "
            f"{checks['ppo_proxy_final']:+.2f}: "
            f"{'over-optimization' if checks['ppo_overoptimized'] else 'no over-optimization'}"
        )
    if "ppo_kl_drift" in checks:
        p, sft = results[ppo], results[base]
        notes.append(
            f"{ppo} drift: KL to {base} {p['kl_to_sft']:.1f} ({'beyond' if checks['ppo_kl_drift'] else 'within'} the "
            f"bound), length {sft['response_length']:.1f} → {p['response_length']:.1f} "
            f"({'more' if checks['ppo_length_drift'] else 'less'} than PPO-max's change)"
        )
    return notes
