"""SimPO, ORPO (reference-free) and KTO (unpaired) as ``loss_type``s of DPOModule on tiny models
(docs/algorithms.md §5.1–§5.3): the module's loss is each paper's formula on the model's own log-probs,
no reference is built where there is none, training moves every parameter and lowers the loss on a
fixed batch, the family's metrics are logged, LoRA, the precomputed reference, presets and config errors."""

import math

import lightning.pytorch as pl
import pytest
import torch

from lit_rlhf.callbacks import KLMonitor, PerplexityMonitor, ResponseLengthMonitor
from lit_rlhf.data.collate import collate_sft
from lit_rlhf.data.preference import kl_partners
from lit_rlhf.modules.dpo import DPOModule
from lit_rlhf.utils.config import ConfigError
from tests.modules.test_dpo_module import data, fit, make


def kto_data(tokenizer, **kw):
    return data(tokenizer, unpaired=True, **kw)


def data_for(loss_type, tokenizer, **kw):
    return kto_data(tokenizer, **kw) if loss_type == "kto" else data(tokenizer, **kw)


@torch.no_grad()
def alone(model, enc, pad_id) -> tuple[float, int]:
    """(Σ log p over the response tokens, their number), from a forward of this one sequence."""
    batch = collate_sft([enc], pad_id)
    logits = model(input_ids=batch["input_ids"]).logits[0].double().log_softmax(-1)
    ids, start = batch["input_ids"][0], len(enc.prompt_ids)
    return sum(logits[t - 1, ids[t]].item() for t in range(start, start + len(enc.response_ids))), len(enc.response_ids)


def log_sigmoid(x: float) -> float:
    return -math.log1p(math.exp(-x)) if x >= 0 else x - math.log1p(math.exp(x))


@pytest.mark.parametrize("loss_type", ["simpo", "orpo"])
def test_reference_free_losses_build_no_reference(loss_type, saved_models, tokenizer, tmp_path):
    """No reference in the module, none built (not even for validation's drift, which then logs no
    KL), none in the memory plan."""
    m = make(saved_models, tokenizer, loss_type=loss_type)
    m.build_reference = lambda: pytest.fail("a reference-free loss built a reference")
    assert DPOModule.planned_models(m.config) == [("policy", "trained", saved_models[0])]
    trainer = pl.Trainer(
        max_steps=2,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        num_sanity_val_steps=0,
        default_root_dir=tmp_path,
        callbacks=[KLMonitor(), PerplexityMonitor(), ResponseLengthMonitor()],
    )
    trainer.fit(m, data(tokenizer))
    assert "reference" not in m.frozen
    out = trainer.validate(m, data(tokenizer), verbose=False)[0]
    assert "stability/kl" not in out and out["stability/response_length"] > 0 and "val/rewards/accuracies" in out


def test_the_memory_plan_holds_only_the_policy_for_simpo_and_orpo(tmp_path):
    from lit_rlhf.launch.runner import memory_plan
    from tests.conftest import compose

    rows = {
        a: [r.name for r in memory_plan(compose([f"algo={a}", "model=llama7b"], tmp_path)).rows]
        for a in ("dpo", "simpo", "orpo", "kto")
    }
    assert rows == {
        "dpo": ["policy", "reference"],
        "simpo": ["policy"],
        "orpo": ["policy"],
        "kto": ["policy", "reference"],
    }


@pytest.mark.parametrize("loss_type, beta", [("simpo", 2.0), ("orpo", 0.5)])
def test_simpo_and_orpo_are_their_formulas_on_the_models_own_log_probs(loss_type, beta, saved_models, tokenizer):
    """The module's loss on a real batch = the paper's formula in plain Python on each response's
    average log-prob from its own forward (SimPO: −log σ(β p̄_w − β p̄_l − γ); ORPO: −p̄_w + λ·L_OR)."""
    m = make(saved_models, tokenizer, loss_type=loss_type, beta=beta, gamma_beta_ratio=0.3)
    m.configure_model()
    dm = data(tokenizer)
    dm.setup("fit")
    batch = next(iter(dm.ordered_dataloader("train")))
    loss, _ = m.pair_loss(batch, "train")
    total = 0.0
    for pair in dm.splits["train"][:8]:
        (sw, nw), (sl, nl) = (
            alone(m.policy, pair.chosen, tokenizer.pad_token_id),
            alone(m.policy, pair.rejected, tokenizer.pad_token_id),
        )
        pw, pl_ = sw / nw, sl / nl
        if loss_type == "simpo":
            total += -log_sigmoid(beta * pw - beta * pl_ - beta * 0.3)
        else:
            odds_w, odds_l = math.exp(pw) / (1 - math.exp(pw)), math.exp(pl_) / (1 - math.exp(pl_))
            total += -pw - beta * math.log(odds_w / (odds_w + odds_l))
    assert loss.item() == pytest.approx(total / 8, rel=1e-4)


def test_kto_is_its_formula_with_the_reference_point_from_mismatched_pairs(saved_models, tokenizer):
    """By hand on a batch of 8 examples: r_i = log π(y_i|x_i) − log π_ref(y_i|x_i) and
    z_ref = max(0, mean_i log π(y'_i|x_i) − log π_ref(y'_i|x_i)) with y'_i the completion of example
    i − 1 (the data's KL rows; i − 2 … where i − 1 has the same prompt), each log-prob from its own
    forward; the loss is the mean of
    λ_D(1 − σ(β(r − z))) over desirable and λ_U(1 − σ(β(z − r))) over undesirable examples.
    The reference is made sharper than the (random, near-uniform) policy: on tokens it does not
    single out, its log-probs are lower on average (Jensen), so z_ref > 0 (the clamp at 0 is covered
    in tests/core)."""
    beta, wd, wu = 0.5, 1.0, 1.5
    m = make(saved_models, tokenizer, loss_type="kto", beta=beta, desirable_weight=wd, undesirable_weight=wu)
    m.configure_model()
    with torch.no_grad():
        m.frozen["reference"].model.norm.weight.mul_(3.0)  # logits × 3: a sharper π_ref
    dm = kto_data(tokenizer)
    dm.setup("fit")
    examples = dm.splits["train"]
    batch = next(iter(dm.ordered_dataloader("train")))
    assert batch["desirable"].tolist() == [e.desirable for e in examples[:8]]
    loss, stats = m.pair_loss(batch, "train")
    pad, ref = tokenizer.pad_token_id, m.frozen["reference"]
    kl = [alone(m.policy, e.kl, pad)[0] - alone(ref, e.kl, pad)[0] for e in examples[:8]]
    # the KL rows are mismatched pairs: example i's prompt, the completion of the nearest example before it
    # with another prompt (i − 1 unless they share the prompt)
    partners = kl_partners([e.prompt for e in examples], "train")
    for e, j in zip(examples[:8], partners):
        assert e.kl.response_ids == examples[j].completion.response_ids and examples[j].prompt != e.prompt
        assert e.kl.prompt_ids == e.completion.prompt_ids
    z = max(0.0, sum(kl) / 8)
    assert z > 0 and stats["kl"].item() == pytest.approx(z, rel=1e-4)
    total = 0.0
    for e in examples[:8]:
        r = alone(m.policy, e.completion, pad)[0] - alone(ref, e.completion, pad)[0]
        sig = lambda x: 1 / (1 + math.exp(-x))  # noqa: E731
        total += wd * (1 - sig(beta * (r - z))) if e.desirable else wu * (1 - sig(beta * (z - r)))
    assert loss.item() == pytest.approx(total / 8, rel=1e-4)


@pytest.mark.parametrize("loss_type", ["simpo", "orpo", "kto"])
def test_steps_change_every_parameter_log_the_family_metrics_and_lower_the_loss_on_a_fixed_batch(
    loss_type, saved_models, tokenizer, tmp_path
):
    torch.manual_seed(0)
    m = make(saved_models, tokenizer, loss_type=loss_type)
    m.configure_model()
    before = {k: v.clone() for k, v in m.policy.state_dict().items()}
    trainer = fit(m, data_for(loss_type, tokenizer), 4, tmp_path, log_every_n_steps=2)
    for name, p in m.policy.named_parameters():
        assert not torch.equal(before[name], p.detach()), f"policy {name} did not change"
    cm = {k: float(v) for k, v in trainer.callback_metrics.items()}
    keys = {"train/loss", "rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected"}
    keys |= {
        "simpo": {"rewards/accuracies"},
        "orpo": {"rewards/accuracies", "nll_loss", "log_odds_ratio", "log_odds_chosen"},
        "kto": {"kl"},
    }[loss_type]
    assert keys <= set(cm) and all(math.isfinite(cm[k]) for k in keys), sorted(cm)
    assert cm["rewards/margins"] == pytest.approx(cm["rewards/chosen"] - cm["rewards/rejected"], abs=1e-5)
    if loss_type == "orpo":  # L = L_SFT + λ·L_OR over the same window of pairs, L_OR = −log_odds_ratio
        assert cm["train/loss"] == pytest.approx(cm["nll_loss"] - m.config.beta * cm["log_odds_ratio"], rel=1e-5)
    if loss_type == "kto":
        assert cm["kl"] >= 0 and "rewards/accuracies" not in cm  # unpaired: no accuracy
    # a fixed batch: a few optimizer steps lower its loss
    m = make(saved_models, tokenizer, loss_type=loss_type)
    m.configure_model()
    dm = data_for(loss_type, tokenizer)
    dm.setup("fit")
    batch = next(iter(dm.ordered_dataloader("train")))
    opt = torch.optim.AdamW(m.policy.parameters(), lr=1e-3)
    losses = []
    for _ in range(6):
        loss, _ = m.pair_loss(batch, "train")
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 1e-3, losses


@pytest.mark.parametrize("loss_type", ["simpo", "kto"])
def test_lora_trains_only_the_adapters(loss_type, saved_models, tokenizer, tmp_path):
    """Under LoRA SimPO still has no reference and KTO's is the policy with its adapters off (no copy)."""
    from safetensors.torch import load_file

    from lit_rlhf.models.lora import AdaptersDisabled
    from lit_rlhf.models.spec import LoraSpec, ModelSpec

    m = make(saved_models, tokenizer, loss_type=loss_type, lr=1e-2)
    spec = DPOModule.resolve_model_spec(m.config, ModelSpec(name_or_path="unused", lora=LoraSpec(enabled=True, r=4)))
    m = DPOModule(m.config, model=spec, tokenizer=tokenizer)
    fit(m, data_for(loss_type, tokenizer), 3, tmp_path)
    if loss_type == "kto":
        assert isinstance(m.frozen["reference"], AdaptersDisabled) and m.frozen["reference"].model is m.policy
    else:
        assert "reference" not in m.frozen
    saved = load_file(f"{saved_models[0]}/model.safetensors")
    policy = m.policy.state_dict()
    for name, value in policy.items():
        key = name.replace(".base_layer.", ".")
        if ".lora_" not in name and key in saved:
            assert torch.equal(value, saved[key]), name  # the base stays as saved
    assert any(".lora_B." in n and v.abs().max() > 0 for n, v in policy.items())  # B starts at 0: trained


def test_kto_precomputed_reference_equals_live(saved_models, tokenizer, tmp_path):
    """The table holds each example's completion and KL row under the reference: same training."""
    results = []
    for precompute in (False, True):
        torch.manual_seed(0)
        m = make(saved_models, tokenizer, loss_type="kto", precompute_ref_logprobs=precompute, drift_prompts=0)
        fit(m, kto_data(tokenizer), 4, tmp_path / str(precompute))
        assert ("reference" in m.frozen) is not precompute
        results.append({k: v.detach().clone() for k, v in m.policy.state_dict().items()})
    for k in results[0]:
        torch.testing.assert_close(results[1][k], results[0][k], atol=2e-5, rtol=1e-4, msg=k)
    tables = torch.load(tmp_path / "True" / "ref_logprobs.pt", weights_only=True)["tables"]
    assert tables["train"].shape == (64, 2) and tables["val"].shape == (32, 2)  # 32 and 16 pairs, split in two


def test_presets_compose_with_their_papers_recipes(tmp_path):
    from lit_rlhf.launch.runner import plan
    from tests.conftest import compose

    simpo, orpo, kto = (plan(compose([f"algo={a}", "model=llama7b"], tmp_path)) for a in ("simpo", "orpo", "kto"))
    a = simpo.algo  # Llama-3-8B-Base SimPO: β 2, γ/β 0.5, lr 6e-7, cosine to 0 after 10% warm-up
    assert (
        a.loss_type,
        a.beta,
        a.gamma_beta_ratio,
        a.lr,
        a.scheduler,
        a.warmup_steps,
        a.warmup_ratio,
        a.min_lr_ratio,
    ) == ("simpo", 2.0, 0.5, 6e-7, "cosine", 0, 0.1, 0.0)
    a = orpo.algo  # Mistral-ORPO-β: λ 0.1, lr 5e-6, inverse sqrt after 200 warm-up steps, from the base model
    assert (a.loss_type, a.beta, a.lr, a.scheduler, a.warmup_steps, a.policy_path) == (
        "orpo",
        0.1,
        5e-6,
        "inverse_sqrt",
        200,
        None,
    )
    a = kto.algo  # HALOs' KTO: β 0.1, λ_D = λ_U = 1, lr 5e-6 after 150 warm-up steps
    assert (a.loss_type, a.beta, a.desirable_weight, a.undesirable_weight, a.lr, a.warmup_steps) == (
        "kto",
        0.1,
        1.0,
        1.0,
        5e-6,
        150,
    )
    assert kto.data.unpaired and not simpo.data.unpaired  # KTO reads unpaired examples
    with pytest.raises(ConfigError, match=r"data.preference.unpaired: unpaired examples train algo.loss_type=kto only"):
        plan(compose(["algo=dpo", "model=llama7b", "data.preference.unpaired=true"], tmp_path))
    with pytest.raises(ConfigError, match=r"data.preference.format: unpaired rows \(prompt, completion, label\) train"):
        plan(compose(["algo=simpo", "model=llama7b", "data.preference.format=unpaired"], tmp_path))


def test_the_inverse_sqrt_schedule_is_transformers(saved_models, tokenizer):
    """ORPO's schedule: after the warm-up, lr·sqrt(w / step), as transformers' get_inverse_sqrt_schedule."""
    from transformers import get_inverse_sqrt_schedule

    for warmup in (200, 0):
        m = make(saved_models, tokenizer, scheduler="inverse_sqrt", warmup_steps=warmup)
        opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
        hf = get_inverse_sqrt_schedule(opt, num_warmup_steps=warmup).lr_lambdas[0]
        for step in (warmup, warmup + 1, 450, 800, 5000, 20000):
            assert m.lr_factor(step, 100_000) == pytest.approx(hf(step), rel=1e-12), (warmup, step)


@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.parametrize("loss_type", ["simpo", "kto"])
def test_resume_from_a_checkpoint_ends_where_the_uninterrupted_run_ends(loss_type, tmp_path, saved_models):
    """As tests/test_resume.py does for DPO: a run resumed mid-epoch and at the epoch boundary ends with
    the uninterrupted run's weights, optimizer and schedule (SimPO: no reference; KTO: unpaired batches)."""
    from lit_rlhf.launch.runner import run
    from tests.conftest import compose
    from tests.test_resume import EVERY_BATCH, assert_same_end, load

    pairs = {"simpo": 96, "kto": 48}[loss_type]  # 3 batches of 32 pairs, or of 32 examples (2 per pair)
    overrides = [
        f"experiment={loss_type}_synthetic_tiny",
        f"algo.policy_path={saved_models[0]}",
        "data.batch_size=32",
        f"data.preference.n_train={pairs}",
        "data.preference.n_val=16",
        "trainer.max_epochs=2",
        "trainer.val_check_interval=2",
        "algo.drift_prompts=4",
        *EVERY_BATCH,
    ]
    run(compose(overrides, tmp_path / "full"))
    ckpts = sorted((tmp_path / "full" / "checkpoints").glob("b*.ckpt"))
    assert [load(p)["epoch"] for p in ckpts] == [0, 0, 0, 1, 1, 1], [p.name for p in ckpts]
    final = load(tmp_path / "full" / "checkpoints" / "last.ckpt")
    for name, index in (("mid-epoch", 0), ("epoch boundary", 2)):
        out = tmp_path / f"resumed_{index}"
        run(compose([*overrides, f"ckpt_path={ckpts[index]}"], out))
        assert_same_end(
            load(out / "checkpoints" / "last.ckpt"), final, f"{loss_type}, resumed at {ckpts[index].name} ({name})"
        )


@pytest.mark.parametrize("loss_type", ["simpo", "kto"])
def test_the_test_loop_reports_held_out_metrics(loss_type, saved_models, tokenizer, tmp_path):
    """test=true: pairs get the accuracy with its 95% Wilson interval over every test pair (8); KTO's
    unpaired examples get their rewards and z_ref, and no accuracy."""
    m = make(saved_models, tokenizer, loss_type=loss_type, drift_prompts=0)
    trainer = fit(m, data_for(loss_type, tokenizer), 1, tmp_path)
    out = trainer.test(m, data_for(loss_type, tokenizer), verbose=False)[0]
    assert {"test/loss", "test/rewards/chosen", "test/rewards/rejected", "test/rewards/margins"} <= set(out)
    if loss_type == "kto":
        assert "test/kl" in out and not any("accurac" in k for k in out)
    else:
        assert (
            out["test/pairs"] == 8
            and out["test/accuracy_ci_low"] <= out["test/rewards/accuracies"] <= out["test/accuracy_ci_high"]
        )
