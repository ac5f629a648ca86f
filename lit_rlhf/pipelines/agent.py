"""``pipeline=agent``: multi-turn RL on the embedded tasks with tools and environments, then one table
(docs/agents.md §6).

The reasoning task with a calculator: SFT on a teacher that calls the calculator on a random minority
of steps, GRPO with the calculator, and GRPO with the calculator and a cost per call; beside them SFT and
GRPO without the tool (pipeline=reasoning's stages), all answering the same held-out problems
(:class:`~lit_rlhf.pipelines.reasoning.ReasoningPipeline`'s table, with each tool policy's calls). The
guessing game: SFT on a teacher that guesses uniformly among the numbers still possible, then GRPO with
the game's reward; greedy games on held-out secrets give the solve rate and the mean number of guesses,
against binary search's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from lit_rlhf.pipelines.demo import _without_grad
from lit_rlhf.pipelines.reasoning import PolicyEval, ReasoningConfig, ReasoningPipeline
from lit_rlhf.utils.config import check


@dataclass
class AgentConfig(ReasoningConfig):
    """The reasoning pipeline's table for the tool task's stages, and the game's for ``game_stages``."""

    game_stages: list[str] = field(default_factory=list)
    """Stages trained on the guessing game: evaluated by greedy games, not on the problems."""
    game_eval_stage: str | None = None
    """The job whose settings (sampling, template, environment) play the evaluation games."""
    eval_games: int = field(default=256, metadata={"ge": 1})
    """Held-out games (secrets of the game's test stream, never trained on) per game policy."""

    def validate(self) -> None:
        super().validate()
        unknown = [s for s in self.game_stages if s not in self.jobs]
        check(not unknown, "game_stages", f"{unknown} are not jobs ({list(self.jobs)})")
        check(
            not self.game_stages or self.game_eval_stage in self.jobs,
            "game_eval_stage",
            f"{self.game_eval_stage!r} is not a job ({list(self.jobs)}): the game stages need one",
        )


class AgentPipeline(ReasoningPipeline):
    """The stages, then the accuracy table of the tool task's policies and the game table."""

    config_class = AgentConfig
    config: AgentConfig

    def accuracy_stages(self) -> list[str]:
        return [s for s in self.config.stages if s not in self.config.game_stages]

    def summarize(self, run_dir: str, cfg: Any) -> dict[str, Any]:
        table, summary, flat = self.accuracy_summary(run_dir, cfg)
        c = self.config
        if c.game_stages:
            policies = {}
            for stage in c.game_stages:
                evaluation = self.policy_eval(stage, run_dir, cfg, as_job=c.game_eval_stage)
                if evaluation is not None:
                    policies[self.label(stage)] = evaluation
            job = self.stage_config(c.game_eval_stage, run_dir, cfg)
            games = evaluate_games(policies, c.eval_games, int(job.seed), c.eval_batch_size)
            summary["games"] = games
            flat.update({f"eval/{name}/{k}": v for name, res in games.items() for k, v in res.items()})
            table += "\n\n" + format_game_table(games, c.eval_games)
        return self.write_summary(run_dir, table, summary, flat)


def binary_search_guesses(high: int) -> float:
    """Mean guesses of binary search (the midpoint of the numbers still possible) over secrets 0..high."""
    total = 0
    for secret in range(high + 1):
        low, top, guesses = 0, high, 0
        while True:
            guesses += 1
            mid = (low + top) // 2
            if mid == secret:
                break
            low, top = (mid + 1, top) if mid < secret else (low, mid - 1)
        total += guesses
    return total / (high + 1)


@_without_grad
def evaluate_games(policies: dict[str, PolicyEval], n: int, seed: int, batch_size: int) -> dict[str, dict[str, float]]:
    """Greedy games of every policy on the same ``n`` held-out secrets (the game's test stream) through
    the one rollout path: the share solved within the job's turns, and the mean guesses of a solved game."""
    from dataclasses import replace

    import torch

    from lit_rlhf.data.agent_tasks import guess_prompts
    from lit_rlhf.data.tokenizers import build_tokenizer
    from lit_rlhf.models.builders import build_causal_lm, freeze
    from lit_rlhf.models.spec import ModelSpec
    from lit_rlhf.rollout.agent import AgentLoop
    from lit_rlhf.rollout.collect import generate_and_score
    from lit_rlhf.rollout.vllm_engine import engine_for

    games = guess_prompts(n, seed, "test")
    results, engine = {}, None
    try:
        for name, pe in policies.items():
            tok = build_tokenizer(ModelSpec(name_or_path=pe.path))
            policy = freeze(build_causal_lm(ModelSpec(name_or_path=pe.path), tok))
            gen = replace(pe.gen, do_sample=False)
            engine = engine_for(policy, gen, pe.path, engine)
            agent = AgentLoop(pe.agent)
            solved, guesses = [], []
            torch.manual_seed(0)
            try:
                for batch in pe.batches(tok, games, batch_size, "secret"):
                    out = generate_and_score(policy, batch, tok, gen, policy_logprobs=False, engine=engine, agent=agent)
                    for reward, turns in zip(out.columns["env_reward"], out.columns["turns"]):
                        # a game solved at guess k scores 1 - 0.1 (k - 1); an unsolved one -0.1 k
                        won = abs(reward - (1.0 - 0.1 * (turns - 1))) < 1e-6
                        solved.append(won)
                        if won:
                            guesses.append(turns)
            finally:
                agent.close()
            results[name] = {
                "solved": sum(solved) / len(solved),
                "guesses": sum(guesses) / max(len(guesses), 1),
            }
    finally:
        if engine is not None:
            engine.close()
    return results


def format_game_table(results: dict[str, dict[str, float]], n: int) -> str:
    """The game's markdown table: solve rate and mean guesses of a solved game, and binary search's."""
    from lit_rlhf.data.agent_tasks import GUESS_HIGH

    lines = ["| policy (guessing game) | solved | guesses per solved game |", "|---|---|---|"]
    for name, res in results.items():
        lines.append(f"| {name} | {100 * res['solved']:.1f}% | {res['guesses']:.2f} |")
    lines.append(f"| binary search | 100.0% | {binary_search_guesses(GUESS_HIGH):.2f} |")
    return "\n".join(
        lines
        + ["", f"- {n} held-out greedy games (secrets 0..{GUESS_HIGH} of the game's test stream, never trained on)"]
    )
