import os

import lightning.pytorch as pl
import pytest
import torch

from lit_rlhf.data.chat import get_template
from lit_rlhf.data.collate import collate_sft, encode_pair
from lit_rlhf.data.sft import SFTDataModule
from lit_rlhf.modules.sft import SFTModule


def batch_of(tokenizer, pairs):
    enc = [encode_pair(tokenizer, p, r, get_template("plain"), 64) for p, r in pairs]
    return collate_sft(enc, tokenizer.pad_token_id), enc


def make_module(tiny_spec, tokenizer, **kw):
    m = SFTModule(model=tiny_spec, tokenizer=tokenizer, **kw)
    m.configure_model()
    return m


def test_response_nll_matches_naive_loop(tiny_spec, tokenizer):
    torch.manual_seed(0)
    m = make_module(tiny_spec, tokenizer)
    batch, enc = batch_of(tokenizer, [("the dog", "sees a cat"), ("a", "happy cat loves the sun")])
    nll, n = m.response_nll(batch)
    # naive: run each unpadded sequence alone; sum -log p over response tokens (EOS included)
    expected, count = 0.0, 0
    for e in enc:
        ids = torch.tensor([e.prompt_ids + e.response_ids])
        logp = m.model(input_ids=ids).logits[0].log_softmax(-1)
        for t in range(len(e.prompt_ids), ids.shape[1]):
            expected -= logp[t - 1, ids[0, t]].item()
            count += 1
    assert n.item() == count == 4 + 6
    assert nll.item() == pytest.approx(expected, rel=1e-5)


def test_prompt_tokens_do_not_affect_the_loss_gradient(tiny_spec, tokenizer):
    """Changing only which tokens are masked changes the loss: the prompt is really excluded."""
    m = make_module(tiny_spec, tokenizer)
    batch, _ = batch_of(tokenizer, [("the dog", "sees a cat")])
    full = dict(batch, response_mask=batch["attention_mask"])
    assert m.response_nll(full)[1] > m.response_nll(batch)[1]


def test_few_steps_change_every_parameter_and_validate(tiny_spec, tokenizer, tmp_path):
    torch.manual_seed(0)
    m = make_module(tiny_spec, tokenizer, lr=1e-2, export_dir=str(tmp_path / "policy"))
    before = {k: v.detach().clone() for k, v in m.model.named_parameters()}
    dm = SFTDataModule(n_train=64, n_val=40, batch_size=16, eval_batch_size=16).connect(tokenizer)
    trainer = pl.Trainer(
        max_steps=4,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        limit_val_batches=3,
        val_check_interval=4,
    )
    trainer.fit(m, dm)
    for name, p in m.model.named_parameters():
        assert not torch.equal(before[name], p.detach()), f"{name} did not change"
    metrics = trainer.callback_metrics
    assert torch.isfinite(metrics["train/loss"])
    # val perplexity = exp(Σ NLL / Σ tokens) over all val batches (sizes 16, 16, 8), not a mean of means
    nll, tok = 0.0, 0
    m.eval()
    with torch.no_grad():
        for b in dm.val_dataloader():
            a, c = m.response_nll(b)
            nll, tok = nll + a.item(), tok + c.item()
    assert metrics["val/perplexity"].item() == pytest.approx(torch.tensor(nll / tok).exp().item(), rel=1e-4)
    assert metrics["val/perplexity_ratio"].item() == pytest.approx(
        metrics["val/perplexity"].item() / dm.reference_perplexity, rel=1e-5
    )
    # on_fit_end exported a loadable Hugging Face model with the trained weights
    from transformers import AutoModelForCausalLM, AutoTokenizer

    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "policy")
    assert (
        AutoTokenizer.from_pretrained(tmp_path / "policy")("the dog")["input_ids"] == tokenizer("the dog")["input_ids"]
    )
    x = torch.tensor([[2, 5, 9, 30]])
    torch.testing.assert_close(loaded(input_ids=x).logits, m.model(input_ids=x).logits)


def test_export_is_atomic(tiny_spec, tokenizer, tmp_path, monkeypatch):
    m = make_module(tiny_spec, tokenizer)
    target = tmp_path / "policy"
    m.export(str(target))
    first = (target / "model.safetensors").read_bytes()

    def boom(*a, **k):
        raise RuntimeError("disk full")

    monkeypatch.setattr(type(tokenizer), "save_pretrained", boom)
    with torch.no_grad():
        next(m.model.parameters()).add_(1.0)
    with pytest.raises(RuntimeError, match="disk full"):
        m.export(str(target))
    # the previous export is intact and no temporary folder is left behind
    assert (target / "model.safetensors").read_bytes() == first
    assert sorted(os.listdir(tmp_path)) == ["policy"]


def test_lr_schedule_warmup_and_cosine(tiny_spec, tokenizer):
    m = SFTModule(model=tiny_spec, lr=1.0, warmup_steps=2, scheduler="cosine", min_lr_ratio=0.1)
    f = [m.lr_factor(s, 10) for s in range(11)]
    assert f[0] == pytest.approx(0.5) and f[1] == pytest.approx(1.0)
    assert f[2] == pytest.approx(1.0)  # decay starts after warm-up
    assert f[6] == pytest.approx(0.1 + 0.9 * 0.5)  # halfway through the 8 decay steps
    assert f[10] == pytest.approx(0.1)
    lin = SFTModule(model=tiny_spec, scheduler="linear", min_lr_ratio=0.0, warmup_ratio=0.0)
    assert [lin.lr_factor(s, 4) for s in range(5)] == pytest.approx([1.0, 0.75, 0.5, 0.25, 0.0])


def test_fused_adamw_steps_like_the_per_parameter_loop_and_stays_off_under_deepspeed(tiny_spec, tokenizer):
    """The fused AdamW kernel (single device / DDP) updates exactly as torch's per-parameter
    loop with the same settings; DeepSpeed keeps the unfused optimizer (it steps its own flat
    partitions)."""
    from unittest import mock

    from lightning.pytorch.strategies import DeepSpeedStrategy

    m = make_module(tiny_spec, tokenizer, lr=1e-2, weight_decay=0.1)
    decay = [p for p in m.parameters() if p.ndim >= 2]
    no_decay = [p for p in m.parameters() if p.ndim < 2]
    opt = m.build_optimizer([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}])
    assert opt.defaults["fused"] is True
    params = decay + no_decay
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    loop = torch.optim.AdamW(
        [
            {"params": twins[: len(opt.param_groups[0]["params"])], "weight_decay": 0.1},
            {"params": twins[len(opt.param_groups[0]["params"]) :], "weight_decay": 0.0},
        ],
        lr=1e-2,
        betas=opt.defaults["betas"],
        eps=opt.defaults["eps"],
        foreach=False,
    )
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        for p, q in zip(params, twins):
            p.grad = torch.randn(p.shape, generator=g)
            q.grad = p.grad.clone()
        opt.step()
        loop.step()
    for p, q in zip(params, twins):
        torch.testing.assert_close(p, q, atol=1e-7, rtol=1e-6)
    trainer = mock.Mock()
    trainer.strategy = mock.Mock(spec=DeepSpeedStrategy)
    m._trainer = trainer
    assert not m.build_optimizer(opt.param_groups).defaults["fused"]


def test_hparams_are_small_and_reload(tiny_spec, tokenizer):
    m = SFTModule(model=tiny_spec, tokenizer=tokenizer, lr=0.5)
    assert set(m.hparams) == {"config", "model"}
    again = SFTModule(config=m.hparams["config"], model=m.hparams["model"])
    assert again.config == m.config and again.model_spec == m.model_spec


def test_a_validation_before_fit_leaves_the_metrics_usable_by_the_fit(tiny_spec, tokenizer):
    """validate_before_fit=true: the baseline validation (inference mode) resets the metric states;
    the fit's own validations update them in place, which failed on inference tensors."""
    torch.manual_seed(0)
    m = make_module(tiny_spec, tokenizer, lr=1e-2)
    dm = SFTDataModule(n_train=64, n_val=16, batch_size=16, eval_batch_size=16).connect(tokenizer)
    trainer = pl.Trainer(
        max_steps=4,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        val_check_interval=4,
    )
    before = trainer.validate(m, dm, verbose=False)[0]["val/perplexity"]
    trainer.fit(m, dm)
    assert not m.val_nll.sum_value.is_inference()
    assert trainer.callback_metrics["val/perplexity"].item() < before  # the fit validated, after learning
