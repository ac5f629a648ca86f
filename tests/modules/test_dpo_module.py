"""DPOModule on tiny models: the concatenated forward, live vs precomputed reference, drift, config errors."""

import math

import lightning.pytorch as pl
import pytest
import torch

from lit_rlhf.callbacks import KLMonitor, PerplexityMonitor, ResponseLengthMonitor
from lit_rlhf.data.preference import PreferenceDataModule
from lit_rlhf.models.packed import packing_verdict
from lit_rlhf.models.spec import ModelSpec
from lit_rlhf.modules.configs import DPOConfig
from lit_rlhf.modules.dpo import DPOModule
from lit_rlhf.utils.config import ConfigError, build_config
from tests.helpers.presets import preset


def make(saved_models, tokenizer, **kw):
    args = dict(policy_path=saved_models[0], lr=1e-3, warmup_steps=0, drift_prompts=8, generation={"max_new_tokens": 8})
    args.update(kw)
    cfg = build_config(DPOConfig, preset("dpo", args), "algo")
    spec = DPOModule.resolve_model_spec(cfg, ModelSpec(name_or_path="the model group, unused"))
    return DPOModule(cfg, model=spec, tokenizer=tokenizer)


def data(tokenizer, **kw):
    return PreferenceDataModule(n_train=32, n_val=16, n_test=8, batch_size=8, **kw).connect(tokenizer)


def fit(module, dm, max_steps, tmp_path, ckpt_path=None, **kw):
    trainer = pl.Trainer(
        max_steps=max_steps,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        limit_val_batches=0,
        default_root_dir=tmp_path,
        **kw,
    )
    trainer.fit(module, dm, ckpt_path=ckpt_path)
    return trainer


def test_concatenated_forward_equals_separate_forwards(saved_models, tokenizer):
    """ONE forward of the 2B stacked rows (packed without padding) gives each response's log-prob
    as its own forward does; and each is the naive sum over response tokens."""
    from lit_rlhf.data.collate import collate_sft

    m = make(saved_models, tokenizer)
    m.configure_model()
    dm = data(tokenizer)
    dm.setup("fit")
    batch = next(iter(dm.ordered_dataloader("train")))
    chosen, rejected = m.sequence_logps(m.policy, batch)
    assert packing_verdict(m.policy) is True  # the padding-free forward (algo.padding_free)
    for i, pair in enumerate(dm.splits["train"][:8]):
        for enc, got in ((pair.chosen, chosen[i]), (pair.rejected, rejected[i])):
            alone = collate_sft([enc], tokenizer.pad_token_id)
            with torch.no_grad():
                logits = m.policy(input_ids=alone["input_ids"]).logits[0].log_softmax(-1)
            ids, start = alone["input_ids"][0], len(enc.prompt_ids)
            naive = sum(logits[t - 1, ids[t]].item() for t in range(start, start + len(enc.response_ids)))
            assert got.item() == pytest.approx(naive, abs=1e-4)


def test_steps_change_every_policy_parameter_and_never_the_reference(saved_models, tokenizer, tmp_path):
    torch.manual_seed(0)
    m = make(saved_models, tokenizer)
    m.configure_model()
    policy0 = {k: v.clone() for k, v in m.policy.state_dict().items()}
    ref0 = {k: v.clone() for k, v in m.frozen["reference"].state_dict().items()}
    trainer = fit(m, data(tokenizer), 4, tmp_path, log_every_n_steps=2)
    for name, p in m.policy.named_parameters():
        assert not torch.equal(policy0[name], p.detach()), f"policy {name} did not change"
    assert all(torch.equal(ref0[k], v) for k, v in m.frozen["reference"].state_dict().items())
    assert not any(n.startswith("frozen") for n, _ in m.named_parameters())  # never checkpointed
    cm = trainer.callback_metrics
    for key in (
        "train/loss",
        "rewards/chosen",
        "rewards/rejected",
        "rewards/accuracies",
        "rewards/margins",
        "logps/chosen",
        "logps/rejected",
    ):
        assert key in cm and math.isfinite(float(cm[key])), key
    assert float(cm["rewards/margins"]) == pytest.approx(float(cm["rewards/chosen"] - cm["rewards/rejected"]), abs=1e-5)


def test_precomputed_reference_equals_live(saved_models, tokenizer, tmp_path):
    """precompute_ref_logprobs: the same training (weights to float precision) with no reference
    model in memory while training, from a cache next to the run that a second fit reuses."""
    results = []
    for precompute in (False, True):
        torch.manual_seed(0)
        m = make(saved_models, tokenizer, precompute_ref_logprobs=precompute, drift_prompts=0)
        fit(m, data(tokenizer), 4, tmp_path / str(precompute))
        assert ("reference" in m.frozen) is not precompute
        results.append({k: v.detach().clone() for k, v in m.policy.state_dict().items()})
    for k in results[0]:
        torch.testing.assert_close(results[1][k], results[0][k], atol=2e-5, rtol=1e-4, msg=k)
    cache = tmp_path / "True" / "ref_logprobs.pt"
    tables = torch.load(cache, weights_only=True)["tables"]
    assert tables["train"].shape == (32, 2) and tables["val"].shape == (16, 2)
    m = make(saved_models, tokenizer, precompute_ref_logprobs=True, drift_prompts=0)
    m.build_reference = lambda: pytest.fail("the cache matches: the reference must not be rebuilt")
    fit(m, data(tokenizer), 1, tmp_path / "True")
    torch.testing.assert_close(m.ref_table["train"], tables["train"])


def test_validation_measures_drift_through_the_monitors(saved_models, tokenizer, tmp_path):
    """Before training the policy IS the reference: KL exactly 0; after training it has drifted."""
    torch.manual_seed(0)
    m = make(saved_models, tokenizer, lr=3e-3)
    trainer = pl.Trainer(
        max_steps=8,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        num_sanity_val_steps=0,
        default_root_dir=tmp_path,
        callbacks=[KLMonitor(), PerplexityMonitor(), ResponseLengthMonitor()],
    )
    dm = data(tokenizer)
    before = trainer.validate(m, dm, verbose=False)[0]
    assert before["stability/kl"] == pytest.approx(0.0, abs=1e-5) and before["stability/response_length"] > 0
    assert before["stability/perplexity"] == pytest.approx(before["stability/perplexity_ref"], rel=1e-5)
    trainer.fit(m, dm)
    after = trainer.validate(m, dm, verbose=False)[0]
    assert abs(after["stability/kl"]) > 1e-3 and 0 <= after["stability/truncation_rate"] <= 1
    assert {"val/loss", "val/rewards/accuracies", "val/rewards/margins", "val/logps/chosen"} <= set(after)


@pytest.mark.parametrize(
    "values, message",
    [
        ({"beta": 0.0}, r"algo.beta: must be > 0.0"),
        ({"label_smoothing": 0.5}, r"algo.label_smoothing: must be >= 0.0 and < 0.5"),
        (
            {"loss_type": "ipo", "label_smoothing": 0.1},
            r"algo.label_smoothing: applies to the sigmoid and simpo losses only",
        ),
        (
            {"loss_type": "orpo", "label_smoothing": 0.1},
            r"algo.label_smoothing: applies to the sigmoid and simpo losses only",
        ),
        ({"loss_type": "hinge"}, r"algo.loss_type: must be one of \['sigmoid', 'ipo', 'simpo', 'orpo', 'kto'\]"),
        (
            {"loss_type": "simpo", "reference_path": "/ckpt/ref"},
            r"algo.reference_path: loss_type='simpo' is reference-free",
        ),
        (
            {"loss_type": "orpo", "precompute_ref_logprobs": True},
            r"algo.precompute_ref_logprobs: loss_type='orpo' is reference-free",
        ),
        ({"gamma_beta_ratio": -0.1}, r"algo.gamma_beta_ratio: must be >= 0.0"),
        ({"desirable_weight": 0.0}, r"algo.desirable_weight: must be > 0.0"),
        ({"undesirable_weight": -1.0}, r"algo.undesirable_weight: must be > 0.0"),
        ({"scheduler": "step"}, r"algo.scheduler: must be one of \['constant', 'linear', 'cosine', 'inverse_sqrt'\]"),
    ],
)
def test_bad_values_name_the_key(values, message):
    with pytest.raises(ConfigError, match=message):
        build_config(DPOConfig, values, "algo")


def test_presets_compose(tmp_path):
    from lit_rlhf.launch.runner import plan
    from tests.conftest import compose

    base = ["model=llama7b", "algo.policy_path=/ckpt/sft"]
    dpo, ipo, cdpo = (plan(compose([f"algo={a}", *base], tmp_path)).algo for a in ("dpo", "ipo", "cdpo"))
    assert (dpo.beta, dpo.lr, dpo.warmup_steps, dpo.loss_type, dpo.label_smoothing) == (0.1, 1e-6, 150, "sigmoid", 0.0)
    assert (ipo.loss_type, cdpo.loss_type, cdpo.label_smoothing) == ("ipo", "sigmoid", 0.1)
    with pytest.raises(ConfigError, match="model.kind: DPO trains a causal LM"):
        plan(compose(["algo=dpo", "model=minilm_rm", "algo.policy_path=/x"], tmp_path))


def test_checkpoint_resume_and_export(saved_models, tokenizer, tmp_path):
    from transformers import AutoModelForCausalLM

    m = make(saved_models, tokenizer, export_dir=str(tmp_path / "policy"), drift_prompts=0)
    trainer = fit(m, data(tokenizer), 2, tmp_path)
    trainer.save_checkpoint(tmp_path / "dpo.ckpt")
    ckpt = torch.load(tmp_path / "dpo.ckpt", weights_only=True)
    assert all(k.startswith("policy.") for k in ckpt["state_dict"])  # no reference in the checkpoint
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "policy")
    x = torch.tensor([[2, 5, 9]])
    torch.testing.assert_close(exported(input_ids=x).logits, m.policy(input_ids=x).logits)
    resumed = make(saved_models, tokenizer, drift_prompts=0)
    t2 = fit(resumed, data(tokenizer), 3, tmp_path / "resumed", ckpt_path=tmp_path / "dpo.ckpt")
    assert t2.global_step == 3
