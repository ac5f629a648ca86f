"""Classic actor-critic PPO-clip on CartPole-v1, built from lit_rlhf.core (docs/algorithms.md §7).

The smallest readable example of the library's RL core, with nothing about language in it: the
same ``gae``, ``ppo_policy_loss``, ``value_loss``, ``entropy_loss`` and ``masked_whiten`` that PPO
for language uses, checked here against the public CartPole reference (cleanrl's ppo.py reaches
the 500 cap within 500k steps). A plain script, not a LightningModule: vectorized environments and
a rollout memory are the whole story, and Lightning's loop would only hide them.

    python examples/cartpole_ppo.py --seeds 1 2 3 4        # make cartpole: 4 seeds, curve + table
Needs the optional extra: pip install -e ".[control]" (gymnasium).
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from lit_rlhf.core.advantages import gae
from lit_rlhf.core.losses import entropy_loss, ppo_policy_loss, value_loss
from lit_rlhf.core.masked import masked_whiten


@dataclass
class Args:
    seed: int = 1
    total_steps: int = 500_000  # environment steps over all envs
    num_envs: int = 4
    num_steps: int = 128  # steps per env per rollout: a rollout is num_envs × num_steps transitions
    lr: float = 2.5e-4  # annealed linearly to 0
    gamma: float = 0.99
    lam: float = 0.95
    update_epochs: int = 4
    num_minibatches: int = 4
    clip: float = 0.2
    vf_coef: float = 0.5
    ent_coef: float = 0.01
    max_grad_norm: float = 0.5
    solved: float = 475.0  # CartPole-v1's threshold (the cap is 500)
    window: int = 20  # finished episodes in the running average


def layer(i: int, o: int, std: float = 2**0.5) -> nn.Linear:
    lin = nn.Linear(i, o)
    nn.init.orthogonal_(lin.weight, std)
    nn.init.zeros_(lin.bias)
    return lin


class Agent(nn.Module):
    """Separate actor and critic MLPs (64-64, tanh), orthogonal init as in cleanrl."""

    def __init__(self, obs_dim: int, n_actions: int) -> None:
        super().__init__()
        self.critic = nn.Sequential(layer(obs_dim, 64), nn.Tanh(), layer(64, 64), nn.Tanh(), layer(64, 1, 1.0))
        self.actor = nn.Sequential(layer(obs_dim, 64), nn.Tanh(), layer(64, 64), nn.Tanh(), layer(64, n_actions, 0.01))

    def act(self, obs: torch.Tensor, action: torch.Tensor | None = None):
        """(N, obs) → action (N,), its log-prob (N,), entropy (N,), value (N,)."""
        dist = torch.distributions.Categorical(logits=self.actor(obs))
        action = dist.sample() if action is None else action
        return action, dist.log_prob(action), dist.entropy(), self.critic(obs).squeeze(-1)


def train(args: Args) -> dict:
    """One seed; returns its learning curve (step, running mean return) and summary figures."""
    import gymnasium as gym

    torch.manual_seed(args.seed)
    np.random.seed(args.seed)
    envs = gym.vector.SyncVectorEnv(
        [lambda: gym.make("CartPole-v1") for _ in range(args.num_envs)],
        autoreset_mode=gym.vector.AutoresetMode.SAME_STEP,
    )
    agent = Agent(envs.single_observation_space.shape[0], envs.single_action_space.n)
    opt = torch.optim.Adam(agent.parameters(), lr=args.lr, eps=1e-5)
    E, T = args.num_envs, args.num_steps
    obs_buf, act_buf = torch.zeros(E, T, envs.single_observation_space.shape[0]), torch.zeros(E, T, dtype=torch.long)
    logp_buf, rew_buf, done_buf, val_buf = (torch.zeros(E, T) for _ in range(4))  # (E, T): env-major, like (B, R)
    obs, _ = envs.reset(seed=args.seed)
    obs = torch.as_tensor(obs, dtype=torch.float32)
    returns, ep_return, curve, step = [], np.zeros(E), [], 0
    updates = args.total_steps // (E * T)
    for update in range(updates):
        for g in opt.param_groups:  # lr annealing
            g["lr"] = args.lr * (1.0 - update / updates)
        for t in range(T):  # ---- rollout: the memory of transitions
            with torch.no_grad():
                action, logp, _, value = agent.act(obs)
            nxt, reward, terminated, truncated, _ = envs.step(action.numpy())
            done = np.logical_or(terminated, truncated)
            obs_buf[:, t], act_buf[:, t], logp_buf[:, t], val_buf[:, t] = obs, action, logp, value
            rew_buf[:, t], done_buf[:, t] = torch.as_tensor(reward), torch.as_tensor(done, dtype=torch.float32)
            ep_return += reward
            for i in np.flatnonzero(done):
                returns.append(ep_return[i])
                ep_return[i] = 0.0
            obs, step = torch.as_tensor(nxt, dtype=torch.float32), step + E
            if len(returns) >= args.window:
                curve.append((step, float(np.mean(returns[-args.window :]))))
        with torch.no_grad():  # ---- advantages: the same GAE as for language, with episode ends
            next_value = agent.act(obs)[3]
            adv, ret = gae(
                rew_buf, val_buf, torch.ones(E, T), args.gamma, args.lam, dones=done_buf, next_value=next_value
            )
        b_obs, b_act, b_logp = obs_buf.reshape(E * T, -1), act_buf.reshape(-1), logp_buf.reshape(-1)
        b_adv, b_ret, b_val = adv.reshape(-1), ret.reshape(-1), val_buf.reshape(-1)
        size = E * T // args.num_minibatches
        for _ in range(args.update_epochs):  # ---- update: epochs × shuffled minibatches
            for idx in torch.randperm(E * T).split(size):
                _, logp, entropy, value = agent.act(b_obs[idx], b_act[idx])
                one = torch.ones(1, len(idx))  # (1, N) rows with a mask: the core's (B, T) layout
                mb_adv = masked_whiten(b_adv[idx][None], one)  # per-minibatch normalization (cleanrl)
                pg, _ = ppo_policy_loss(logp[None], b_logp[idx][None], mb_adv, one, args.clip, args.clip)
                vf, _ = value_loss(value[None], b_val[idx][None], b_ret[idx][None], one, args.clip)
                ent, _ = entropy_loss(entropy[None], one, args.ent_coef)
                opt.zero_grad()
                (pg + args.vf_coef * vf + ent).backward()
                nn.utils.clip_grad_norm_(agent.parameters(), args.max_grad_norm)
                opt.step()
    envs.close()
    reached = next((s for s, r in curve if r >= args.solved), None)
    return {
        "seed": args.seed,
        "curve": curve,
        "steps_to_solved": reached,
        "final_mean": curve[-1][1] if curve else 0.0,
        "best_mean": max((r for _, r in curve), default=0.0),
        "episodes": len(returns),
    }


def plot(results: list[dict], out: Path, solved: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for r in results:
        xs, ys = zip(*r["curve"]) if r["curve"] else ([], [])
        ax.plot(xs, ys, label=f"seed {r['seed']}")
    ax.axhline(solved, color="k", linestyle="--", linewidth=0.8, label=f"solved ({solved:g})")
    ax.set(
        xlabel="environment steps",
        ylabel="mean return of the last 20 episodes",
        title="PPO-clip on CartPole-v1 with lit_rlhf.core",
    )
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    ap.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3, 4], help="one training run per seed")
    ap.add_argument(
        "--total-steps",
        type=int,
        default=Args.total_steps,
        help="environment steps per seed, over all vectorized environments",
    )
    ap.add_argument("--out", default="logs/cartpole", help="folder for cartpole.png and results.json")
    return ap


def main(argv: list[str] | None = None) -> None:
    a = parser().parse_args(argv)
    torch.set_num_threads(1)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    results = []
    for seed in a.seeds:
        t0 = time.perf_counter()
        r = train(Args(seed=seed, total_steps=a.total_steps))
        r["seconds"] = round(time.perf_counter() - t0, 1)
        results.append(r)
        print(
            f"seed {seed}: reached {Args.solved:g} at {r['steps_to_solved']} steps; best {r['best_mean']:.1f}, "
            f"final {r['final_mean']:.1f} ({r['episodes']} episodes, {r['seconds']} s)",
            flush=True,
        )
    plot(results, out / "cartpole.png", Args.solved)
    solved = sum(r["steps_to_solved"] is not None for r in results)
    ran = {k: v for k, v in asdict(Args(total_steps=a.total_steps)).items() if k != "seed"} | {"seeds": a.seeds}
    (out / "results.json").write_text(json.dumps({"args": ran, "results": results}, indent=1))
    curve = out / "cartpole.png"
    print(f"{solved} of {len(results)} seeds reached {Args.solved:g} within {a.total_steps} steps; curve: {curve}")


if __name__ == "__main__":
    main()
