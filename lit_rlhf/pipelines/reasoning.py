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
from collections.abc import Iterator
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
    """The job whose sampling settings (algo.generation, template, prompt length, environment) and
    task (data.reasoning) the table uses."""
    eval_as: dict[str, str] = field(default_factory=dict)
    """Stage → the job whose sampling settings, template, prompt length and environment evaluate its
    policy (default: ``eval_stage``), e.g. an SFT policy as the RL stage that starts from it."""
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
        for stage, job in self.eval_as.items():
            check(
                stage in self.jobs and job in self.jobs, f"eval_as.{stage}", f"{stage!r} -> {job!r}: both must be jobs"
            )


@dataclass
class PolicyEval:
    """How one policy answers the held-out problems: its folder, and the sampling settings, template,
    prompt length and environment (multi-turn settings, or None) of the job it is evaluated as."""

    path: str
    gen: Any
    template: str
    max_prompt_length: int
    agent: Any = None

    def batches(self, tok: Any, rows: list[dict[str, Any]], size: int, column: str) -> Iterator[dict[str, Any]]:
        """``rows``' prompts in collated batches of ``size``, rendered with this policy's template and
        prompt length, each with its ``column`` (the answer, the secret) for the rewards and the environment."""
        from lit_rlhf.data.chat import get_template
        from lit_rlhf.data.prompts import collate_prompts, encode_prompt

        template = get_template(self.template)
        for start in range(0, len(rows), size):
            items = [
                (encode_prompt(tok, r["prompt"], self.max_prompt_length, template)[0], r["prompt"], {column: r[column]})
                for r in rows[start : start + size]
            ]
            yield collate_prompts(items, tok.pad_token_id)


class ReasoningPipeline(StagePipeline):
    """The stages, then every policy's held-out accuracy on the embedded reasoning task (the
    task's exact checker): greedy accuracy, pass@k, mean@k and response length, in ``summary.md``."""

    config_class = ReasoningConfig
    config: ReasoningConfig

    def label(self, stage: str) -> str:
        return self.config.labels.get(stage, stage)

    def accuracy_stages(self) -> list[str]:
        """The stages whose policies answer the held-out problems (all of them)."""
        return list(self.config.stages)

    def policy_eval(self, stage: str, run_dir: str, cfg: Any, as_job: str | None = None) -> PolicyEval | None:
        """The stage's policy with the settings of the job it is evaluated as (``as_job``, else
        ``eval_as``'s, else ``eval_stage``); None without an export."""
        from lit_rlhf.launch.runner import get_class
        from lit_rlhf.rollout.agent import agent_settings
        from lit_rlhf.rollout.generate import GenerationConfig
        from lit_rlhf.utils.config import build_config

        export = self.export_of(stage, run_dir, cfg)
        if not export or not os.path.isdir(export):
            return None
        job = self.stage_config(as_job or self.config.eval_as.get(stage, self.config.eval_stage), run_dir, cfg)
        prompt = job.data.prompt
        algo = (
            build_config(get_class(job.algo, "algo").config_class, job.algo, "algo")
            if job.algo.get("environment")
            else None
        )
        return PolicyEval(
            export,
            build_config(GenerationConfig, job.algo.generation, "algo.generation"),
            str(prompt.template),
            int(prompt.max_prompt_length),
            agent_settings(algo, int(prompt.max_prompt_length)) if algo is not None else None,
        )

    def summarize(self, run_dir: str, cfg: Any) -> dict[str, Any]:
        table, summary, flat = self.accuracy_summary(run_dir, cfg)
        return self.write_summary(run_dir, table, summary, flat)

    def accuracy_summary(self, run_dir: str, cfg: Any) -> tuple[str, dict[str, Any], dict[str, float]]:
        """(the accuracy table, its figures, its flat metrics) of :meth:`accuracy_stages`' policies."""
        from lit_rlhf.data.reasoning import ReasoningTask, ReasoningTaskConfig
        from lit_rlhf.utils.config import build_config

        c = self.config
        stage_cfg = self.stage_config(c.eval_stage, run_dir, cfg)
        task = ReasoningTask(
            build_config(ReasoningTaskConfig, stage_cfg.data.prompt.reasoning, "data.prompt.reasoning")
        )
        policies = {}
        for stage in self.accuracy_stages():
            evaluation = self.policy_eval(stage, run_dir, cfg)
            if evaluation is not None:
                policies[self.label(stage)] = evaluation
        if self.label(c.baseline) not in policies:
            raise FileNotFoundError(
                f"pipeline.baseline={c.baseline}: no policy at "
                f"{self.export_of(c.baseline, run_dir, cfg)} (run that stage first)"
            )
        problems = task.qa_records(c.eval_problems, "test")
        results = evaluate_reasoning(
            policies, task, problems, c.eval_batch_size, c.pass_k, reference=self.label(c.baseline)
        )
        base = results[self.label(c.baseline)]
        checks = {
            f"{stage}_greedy_gain_points": 100
            * (results[self.label(stage)]["greedy_accuracy"] - base["greedy_accuracy"])
            for stage in self.accuracy_stages()
            if stage != c.baseline and self.label(stage) in results
        }
        flat = {f"eval/{name}/{k}": v for name, res in results.items() for k, v in res.items()}
        table = format_accuracy_table(results, self.label(c.baseline), c.pass_k, len(problems))
        return table, {"policies": results, "checks": checks}, flat

    def write_summary(
        self, run_dir: str, table: str, summary: dict[str, Any], flat: dict[str, float]
    ) -> dict[str, Any]:
        """``summary.md`` (the table) and ``summary.json`` (the figures and the pipeline's config)."""
        print("\n" + table + "\n", flush=True)
        with open(os.path.join(run_dir, "summary.md"), "w") as fh:
            fh.write(table + "\n")
        with open(os.path.join(run_dir, "summary.json"), "w") as fh:
            json.dump({**summary, "config": asdict(self.config)}, fh, indent=2)
        log.info("summary: %s", os.path.join(run_dir, "summary.md"))
        return {**summary, "results": summary.get("policies"), "flat": flat}


@_without_grad
def evaluate_reasoning(
    policies: dict[str, PolicyEval],
    task: Any,
    problems: list[dict[str, str]],
    batch_size: int,
    k: int,
    reference: str | None = None,
) -> dict[str, dict[str, float]]:
    """Every policy on the same held-out problems through the one rollout path
    (:func:`~lit_rlhf.rollout.evaluate.evaluate_verifiable`), each with its own settings (a multi-turn
    policy with its environment), scored by the task's exact checker
    (:func:`~lit_rlhf.data.reasoning.answer_reward_fn`: the answer line equals the problem's
    solution and the response ended): greedy accuracy and length, pass@k and mean@k from ``k``
    samples, each other policy's KL to the ``reference`` one (a key of ``policies``: the SFT policy
    RL started from) on those samples, and a multi-turn policy's tool calls
    (:func:`lit_rlhf.data.agent_tasks.tool_call_rates` of its greedy trajectories)."""
    import torch

    from lit_rlhf.data.agent_tasks import tool_call_rates
    from lit_rlhf.data.reasoning import answer_reward_fn
    from lit_rlhf.data.tokenizers import build_tokenizer
    from lit_rlhf.models.builders import build_causal_lm, freeze
    from lit_rlhf.models.spec import ModelSpec
    from lit_rlhf.rollout.agent import AgentLoop
    from lit_rlhf.rollout.evaluate import VerifiableEval, evaluate_verifiable
    from lit_rlhf.rollout.scorers import CallableScorer
    from lit_rlhf.rollout.vllm_engine import engine_for

    scorer = CallableScorer(answer_reward_fn(task.config), "reasoning.answer_reward_fn")
    results, engine, ref_model = {}, None, None
    if reference is not None and k:
        path = policies[reference].path
        ref_model = freeze(build_causal_lm(ModelSpec(name_or_path=path), build_tokenizer(ModelSpec(name_or_path=path))))
    try:
        for name, pe in policies.items():
            tok = build_tokenizer(ModelSpec(name_or_path=pe.path))
            if name == reference and ref_model is not None:  # already loaded as the KL's reference
                policy, against = ref_model, None
            else:
                policy, against = freeze(build_causal_lm(ModelSpec(name_or_path=pe.path), tok)), ref_model
            if against is not None and against.config.vocab_size != policy.config.vocab_size:
                against = None  # another task language (a policy without the tool): no KL to compare
            engine = engine_for(policy, pe.gen, pe.path, engine)  # None: the hf loop samples from the policy
            agent = AgentLoop(pe.agent) if pe.agent is not None else None
            torch.manual_seed(0)
            parts = []
            try:
                for batch in pe.batches(tok, problems, batch_size, "answer"):
                    parts.append(
                        evaluate_verifiable(
                            policy, batch, tok, pe.gen, scorer, k, engine=engine, reference=against, agent=agent
                        )
                    )
            finally:
                if agent is not None:
                    agent.close()
            ev = VerifiableEval.cat(parts)
            results[name] = ev.metrics()
            if ev.greedy_tool_calls is not None:
                results[name].update(tool_call_rates(task, [r["prompt"] for r in problems], ev.greedy_texts))
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
    tools = any("tool_calls" in res for res in results.values())
    head = " | ".join(c for c, _ in cols) + f"{f' | KL to {baseline}' if kl else ''} | length (greedy) |"
    if tools:
        head += " calls / problem | hard-fact steps called | other steps called |"
    lines = [f"| policy | {head}", "|---" * (len(cols) + 2 + kl + 3 * tools) + "|"]
    base = results[baseline]
    for name, res in results.items():
        cells = [
            f"{100 * res[key]:.1f}%" + ("" if name == baseline else f" ({100 * (res[key] - base[key]):+.1f})")
            for _, key in cols
        ]
        if kl:
            cells.append(f"{res['kl']:.2f}" if "kl" in res else "0" if name == baseline else "—")
        row = f"| {name} | " + " | ".join(cells) + f" | {res['greedy_length']:.1f} |"
        if tools:
            row += (
                f" {res['tool_calls']:.2f} | {100 * res['hard_call_rate']:.0f}% | {100 * res['easy_call_rate']:.0f}% |"
                if "tool_calls" in res
                else " — | — | — |"
            )
        lines.append(row)
    return "\n".join(
        lines
        + [
            "",
            f"- {n} held-out problems (the task's test split, never trained on); in brackets: "
            f"points over {baseline}"
            + (f"; pass@{k} and mean@{k} from {k} samples per problem at the RL stages' sampling settings" if k else "")
            + (f"; KL: KL(policy ‖ {baseline}) in nats per response on those samples" if kl else "")
            + (
                "; calls: the greedy trajectories' calculator calls, and the share of the steps of the problems' "
                "correct workings on the teacher's hard facts (and on the others) that a call computed"
                if tools
                else ""
            ),
        ]
    )
