"""The reward-model server (docs/remote_rewards.md): ``python -m lit_rlhf.serve --model <rm export>``
or ``lit-rlhf serve``. It sits beside ``launch/`` above ``rollout/``: it loads a reward model with
the stage's own scorer (:class:`lit_rlhf.rollout.scorers.ModelScorer`) and answers OpenRLHF's
``/get_reward`` contract (server.py)."""

from lit_rlhf.serve.server import BatchQueue, build_app, load_scorer, main, parse_args

__all__ = ["BatchQueue", "build_app", "load_scorer", "main", "parse_args"]
