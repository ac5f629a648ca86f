"""``pipeline=reasoning``: RL with verifiable rewards on the embedded reasoning task, then a table of
held-out accuracy (docs/rewards.md §7-§8).

The stages (SFT on an imperfect teacher, then GRPO, DAPO and Dr. GRPO with the exact-match reward)
run as ordinary jobs through :class:`~lit_rlhf.pipelines.demo.StagePipeline`; :class:`ReasoningPipeline`
then answers the task's test problems with every policy, greedily and k times sampled, scored by
the task's exact checker: greedy accuracy, pass@k, mean@k, KL and length against SFT (``summary.md``).
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import asdict, dataclass, field
from typing import Any

from lit_rlhf.pipelines.demo import PipelineConfig, StagePipeline, _without_grad
from lit_rlhf.utils.config import check

log = logging.getLogger(__name__)


@dataclass
class ReasoningConfig(PipelineConfig):
    """The stages and the final accuracy table of a verifiable task: every stage's policy answers
    held-out problems of the embedded reasoning task, greedily and ``pass_k`` times sampled."""

    labels: dict[str, str] = field(default_factory=dict)
    """Stage → its row in the table (a stage without one is named by its stage name)."""
    baseline: str = "sft"
    """The stage whose policy the others are compared with (accuracy gains in points)."""
    eval_stage: str = "grpo"
    """The job whose sampling settings (algo.generation, template, prompt length) and task
    (data.reasoning) the table uses."""
    eval_problems: int = field(default=500, metadata={"ge": 1})
    """Held-out problems (the task's test split, never trained on) per policy."""
    eval_batch_size: int = field(default=100, metadata={"ge": 1})
    """Problems per sampling batch in the final evaluation."""
    pass_k: int = field(default=8, metadata={"ge": 0})
    """Samples per problem for pass@k and mean@k (0 = greedy accuracy only)."""

    def validate(self) -> None:
        super().validate()
        for key in ("baseline", "eval_stage"):
            check(getattr(self, key) in self.jobs, key, f"{getattr(self, key)!r} is not a job ({list(self.jobs)})")


class ReasoningPipeline(StagePipeline):
    """The stages, then every policy's held-out accuracy on the embedded reasoning task (the
    task's exact checker): greedy accuracy, pass@k, mean@k and response length, in ``summary.md``."""

    config_class = ReasoningConfig
    config: ReasoningConfig

    def label(self, stage: str) -> str:
        return self.config.labels.get(stage, stage)

    def summarize(self, run_dir: str, cfg: Any) -> dict[str, Any]:
        from lit_rlhf.data.reasoning import ReasoningTask, ReasoningTaskConfig
        from lit_rlhf.rollout.generate import GenerationConfig
        from lit_rlhf.utils.config import build_config

        c = self.config
        stage_cfg = self.stage_config(c.eval_stage, run_dir, cfg)
        task = ReasoningTask(
            build_config(ReasoningTaskConfig, stage_cfg.data.prompt.reasoning, "data.prompt.reasoning")
        )
        gen = build_config(GenerationConfig, stage_cfg.algo.generation, "algo.generation")
        policies = {}
        for stage in c.stages:
            export = self.export_of(stage, run_dir, cfg)
            if export and os.path.isdir(export):
                policies[self.label(stage)] = export
        if self.label(c.baseline) not in policies:
            raise FileNotFoundError(
                f"pipeline.baseline={c.baseline}: no policy at "
                f"{self.export_of(c.baseline, run_dir, cfg)} (run that stage first)"
            )
        problems = task.qa_records(c.eval_problems, "test")
        results = evaluate_reasoning(
            policies,
            task,
            problems,
            c.eval_batch_size,
            gen,
            str(stage_cfg.data.prompt.template),
            int(stage_cfg.data.prompt.max_prompt_length),
            c.pass_k,
            reference=self.label(c.baseline),
        )
        base = results[self.label(c.baseline)]
        checks = {
            f"{stage}_greedy_gain_points": 100
            * (results[self.label(stage)]["greedy_accuracy"] - base["greedy_accuracy"])
            for stage in c.stages
            if stage != c.baseline and self.label(stage) in results
        }
        flat = {f"eval/{name}/{k}": v for name, res in results.items() for k, v in res.items()}
        table = format_accuracy_table(results, self.label(c.baseline), c.pass_k, len(problems))
        print("\n" + table + "\n", flush=True)
        with open(os.path.join(run_dir, "summary.md"), "w") as fh:
            fh.write(table + "\n")
        with open(os.path.join(run_dir, "summary.json"), "w") as fh:
            json.dump({"policies": results, "checks": checks, "config": asdict(c)}, fh, indent=2)
        log.info("summary: %s", os.path.join(run_dir, "summary.md"))
        return {"results": results, "checks": checks, "flat": flat}


@_without_grad
def evaluate_reasoning(
    policies: dict[str, str],
    task: Any,
    problems: list[dict[str, str]],
    batch_size: int,
    gen: Any,
    template: str,
    max_prompt_length: int,
    k: int,
    reference: str | None = None,
) -> dict[str, dict[str, float]]:
    """Every policy on the same held-out problems through the one rollout path
    (:func:`~lit_rlhf.rollout.evaluate.evaluate_verifiable`), scored by the task's exact checker
    (:func:`~lit_rlhf.data.reasoning.answer_reward_fn`: the answer line equals the problem's
    solution and the response ended): greedy accuracy and length, pass@k and mean@k from ``k``
    samples with ``gen``, and each other policy's KL to the ``reference`` one (a key of
    ``policies``: the SFT policy RL started from) on those samples."""
    import torch

    from lit_rlhf.data.chat import get_template
    from lit_rlhf.data.prompts import collate_prompts, encode_prompt
    from lit_rlhf.data.reasoning import answer_reward_fn
    from lit_rlhf.data.tokenizers import build_tokenizer
    from lit_rlhf.models.builders import build_causal_lm, freeze
    from lit_rlhf.models.spec import ModelSpec
    from lit_rlhf.rollout.evaluate import evaluate_verifiable
    from lit_rlhf.rollout.scorers import CallableScorer
    from lit_rlhf.rollout.vllm_engine import engine_for

    chat = get_template(template)
    scorer = CallableScorer(answer_reward_fn(task.config), "reasoning.answer_reward_fn")
    results, engine, ref_model = {}, None, None
    if reference is not None and k:
        path = policies[reference]
        ref_model = freeze(build_causal_lm(ModelSpec(name_or_path=path), build_tokenizer(ModelSpec(name_or_path=path))))
    try:
        for name, path in policies.items():
            tok = build_tokenizer(ModelSpec(name_or_path=path))
            if name == reference and ref_model is not None:  # already loaded as the KL's reference
                policy, against = ref_model, None
            else:
                policy, against = freeze(build_causal_lm(ModelSpec(name_or_path=path), tok)), ref_model
            engine = engine_for(policy, gen, path, engine)  # None: the hf loop samples from the policy
            torch.manual_seed(0)
            parts = []
            for start in range(0, len(problems), batch_size):
                chunk = problems[start : start + batch_size]
                items = [
                    (encode_prompt(tok, r["prompt"], max_prompt_length, chat)[0], r["prompt"], {"answer": r["answer"]})
                    for r in chunk
                ]
                batch = collate_prompts(items, tok.pad_token_id)
                parts.append(evaluate_verifiable(policy, batch, tok, gen, scorer, k, engine=engine, reference=against))
            fields = ("greedy_correct", "greedy_length", "sample_correct", "sample_kl")
            ev = type(parts[0])(
                *(None if getattr(parts[0], f) is None else torch.cat([getattr(p, f) for p in parts]) for f in fields)
            )
            results[name] = ev.metrics()
    finally:
        if engine is not None:
            engine.close()
    return results


def format_accuracy_table(results: dict[str, dict[str, float]], baseline: str, k: int, n: int) -> str:
    """The reasoning pipeline's markdown table (summary.md): accuracy in %, gains over the baseline in points."""
    cols = [("greedy accuracy", "greedy_accuracy")] + (
        [(f"pass@{k}", f"pass@{k}"), (f"mean@{k}", f"mean@{k}")] if k else []
    )
    kl = any("kl" in res for res in results.values())
    head = " | ".join(c for c, _ in cols) + f"{f' | KL to {baseline}' if kl else ''} | length (greedy) |"
    lines = [f"| policy | {head}", "|---" * (len(cols) + 2 + kl) + "|"]
    base = results[baseline]
    for name, res in results.items():
        cells = [
            f"{100 * res[key]:.1f}%" + ("" if name == baseline else f" ({100 * (res[key] - base[key]):+.1f})")
            for _, key in cols
        ]
        if kl:
            cells.append(f"{res['kl']:.2f}" if "kl" in res else "0")
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {res['greedy_length']:.1f} |")
    return "\n".join(
        lines
        + [
            "",
            f"- {n} held-out problems (the task's test split, never trained on); in brackets: "
            f"points over {baseline}; pass@{k} and mean@{k} from {k} samples per problem "
            "at the RL stages' sampling settings"
            + (f"; KL: KL(policy ‖ {baseline}) in nats per response on those samples" if kl else ""),
        ]
    )
