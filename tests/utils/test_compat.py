"""lit_rlhf/utils/compat: every private API of another project that lit_rlhf uses, exercised against the
installed packages, so that an upgrade that moves one fails HERE, naming it and the pinned version."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.demos.boring_classes import BoringModel

from lit_rlhf.utils.compat import TESTED, CompatError, private_attr


def test_a_moved_internal_names_the_package_the_internal_and_the_pinned_version():
    with pytest.raises(CompatError) as err:
        private_attr(object(), "_gone", "lightning", "Trainer.fit_loop._gone")
    text = str(err.value)
    assert "Trainer.fit_loop._gone" in text and "lightning 2.6.0 to 2.6.6" in text
    assert "lit_rlhf/utils/compat/lightning.py" in text


def test_tested_versions_agree_with_pyproject_and_the_lock():
    from tests.helpers.package_meta import locked, lower_bounds

    bounds, lock = lower_bounds(), locked()
    assert {k: (bounds[k], lock[k]) for k in TESTED} == TESTED


class _Seen(pl.Callback):
    def on_train_start(self, trainer, module):
        from lit_rlhf.utils.compat.lightning import combined_loader

        self.loader = combined_loader(trainer)


def test_lightning_combined_loader_and_last_checkpoints(tmp_path):
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lit_rlhf.utils.compat.lightning import last_checkpoints

    seen, ckpt = _Seen(), ModelCheckpoint(dirpath=tmp_path, save_last=True)
    trainer = pl.Trainer(
        max_steps=2,
        accelerator="cpu",
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        callbacks=[seen, ckpt],
    )
    trainer.fit(BoringModel())
    assert len(seen.loader.flattened) == 1 and callable(seen.loader.flattened[0].__iter__)
    assert last_checkpoints(ckpt, trainer) == {str(tmp_path / "last.ckpt")}


def test_lightning_record_device_is_what_module_device_reports():
    from lit_rlhf.utils.compat.lightning import record_device

    module = BoringModel()
    assert module.device == torch.device("cpu")
    record_device(module, torch.device("meta"))
    assert module.device == torch.device("meta")


def test_lightning_fsdp_hooks_exist_and_checkpointing_wraps_the_policy_layers():
    from lightning.pytorch.strategies import FSDPStrategy
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    from lit_rlhf.utils.compat.lightning import FSDP_SETUP_MODEL, check_fsdp_setup_model, setup_activation_checkpointing

    check_fsdp_setup_model()
    assert callable(getattr(FSDPStrategy, FSDP_SETUP_MODEL))
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU())
    setup_activation_checkpointing(model, FSDPStrategy(activation_checkpointing_policy={torch.nn.Linear}))
    assert isinstance(model[0], CheckpointWrapper) and not isinstance(model[1], CheckpointWrapper)


def test_lightning_wrap_save_checkpoint_routes_the_instance_through_the_wrapper():
    from lit_rlhf.utils.compat.lightning import wrap_save_checkpoint

    calls = []

    class Strategy:
        def save_checkpoint(self, checkpoint, path, storage_options=None):
            calls.append(("original", path))

    s = Strategy()
    wrap_save_checkpoint(
        s, lambda original: lambda c, p, o=None: calls.append(("wrapped", p)) or original(c, p + ".x", o)
    )
    s.save_checkpoint({}, "f")
    assert calls == [("wrapped", "f"), ("original", "f.x")] and Strategy().save_checkpoint({}, "g") is None
    assert calls[-1] == ("original", "g")  # other instances keep the class's method


def test_deepspeed_zero3_hook_registration_exists():
    """The hook lists are exercised for real by the ZeRO-3 rollout tests (tests/runtime/test_strategies.py,
    two CPU processes); here: the registration method and the lists' owner are where we expect."""
    import inspect

    from deepspeed.runtime.zero.parameter_offload import DeepSpeedZeRoOffload

    from lit_rlhf.utils.compat.deepspeed import zero3_offload

    assert callable(private_attr(DeepSpeedZeRoOffload, "_register_deepspeed_module", "deepspeed", "x"))
    init = inspect.getsource(DeepSpeedZeRoOffload)
    assert "self.forward_hooks" in init and "self.backward_hooks" in init
    assert zero3_offload(object()) is None  # not a ZeRO-3 engine


def test_torch_mkldnn_linear_equals_f_linear():
    from lit_rlhf.utils.compat.torch import mkldnn_linear, mkldnn_linear_available, mkldnn_reorder_linear_weight

    if not mkldnn_linear_available():
        pytest.skip("this torch build has no oneDNN linear operators (the decoding step falls back)")
    torch.manual_seed(0)
    x, w, b = torch.randn(16, 32), torch.randn(48, 32), torch.randn(48)
    out = mkldnn_linear(x, mkldnn_reorder_linear_weight(w, 16), b)
    torch.testing.assert_close(out, torch.nn.functional.linear(x, w, b), atol=1e-5, rtol=1e-5)


def test_torch_hook_registries():
    from lit_rlhf.utils.compat.torch import global_forward_hooks_active, has_forward_hooks

    m = torch.nn.Linear(2, 2)
    assert not global_forward_hooks_active() and not has_forward_hooks(m)
    handle = torch.nn.modules.module.register_module_forward_hook(lambda *a: None)
    try:
        assert global_forward_hooks_active()
    finally:
        handle.remove()
    assert not global_forward_hooks_active()
    m.register_forward_pre_hook(lambda *a: None)
    assert has_forward_hooks(m)


def test_torch_set_num_threads_sets_them_where_torch_set_num_threads_is_a_no_op(monkeypatch):
    """What a CPU vLLM engine does to the process (tests/rollout/test_vllm_engine.py builds one):
    ``torch.set_num_threads`` replaced by a no-op; the builtin still sets the threads."""
    from lit_rlhf.utils.compat.torch import set_num_threads

    before = torch.get_num_threads()
    other = 2 if before == 1 else 1
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)
    try:
        set_num_threads(other)
        assert torch.get_num_threads() == other
    finally:
        set_num_threads(before)
    assert torch.get_num_threads() == before


def test_transformers_attention_interface_follows_the_config():
    from transformers import LlamaConfig
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from lit_rlhf.utils.compat.transformers import attention_interface

    def eager(*args):
        return None

    config = LlamaConfig()
    config._attn_implementation = "eager"
    assert attention_interface(config, eager) is eager
    config._attn_implementation = "sdpa"
    assert attention_interface(config, eager) is sdpa_attention_forward


def test_transformers_cache_keyword_reaches_the_model_and_comes_back():
    """The KV cache passed by :func:`cache_keyword` is the one the forward fills and returns
    (``cache`` from transformers 5.20, ``past_key_values`` before: vLLM's CPU build needs < 5.20)."""
    import torch
    from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

    from lit_rlhf.utils.compat.transformers import cache_keyword, output_cache

    model = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=16,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=2,
        )
    ).eval()
    cache = DynamicCache(config=model.config)
    out = model(input_ids=torch.tensor([[1, 2, 3]]), use_cache=True, **{cache_keyword(): cache})
    assert output_cache(out) is cache and cache.get_seq_length() == 3


def test_omegaconf_raw_node_does_not_resolve():
    from omegaconf import OmegaConf
    from omegaconf.errors import InterpolationKeyError

    from lit_rlhf.utils.compat.omegaconf import raw_node

    cfg = OmegaConf.create({"a": "${missing}"})
    with pytest.raises(InterpolationKeyError):
        cfg.a  # noqa: B018  (plain access resolves)
    assert raw_node(cfg, "a")._value() == "${missing}"


def test_lightning_wandb_init_kwargs_are_what_wandb_init_gets(tmp_path):
    from lightning.pytorch.loggers import WandbLogger

    from lit_rlhf.utils.compat.lightning import wandb_init_kwargs

    logger = WandbLogger(save_dir=str(tmp_path), offline=True, project="p")
    init = wandb_init_kwargs(logger)
    assert init["project"] == "p" and init["dir"] == str(tmp_path) and "anonymous" in init
