"""Shared fixtures: the embedded tokenizer, a tiny model spec, and the real Hydra config composed for CPU."""

from __future__ import annotations

import gc
import os
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
HH_FILE = ROOT.parent / "shared" / "data" / "hh-rlhf" / "harmless-base-test.jsonl.gz"
"""The HH-RLHF harmless-base test split as CI keeps it beside the checkout (the product names the
hub id; tests that read the real file pass this copy with HH_SOURCE and skip where it is absent)."""
HH_SOURCE = f"data.preference.source={HH_FILE}"
needs_hh = pytest.mark.skipif(not HH_FILE.exists(), reason=f"no local copy of the HH-RLHF file at {HH_FILE}")
os.environ.setdefault("LIT_RLHF_ROOT", str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tests never download; fail fast instead of retrying
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
if os.environ.get("PYTEST_XDIST_WORKER"):
    # `make test` runs two pytest workers on the 2-core CI machine: one thread each (and in the
    # train.py / multi-process runs they start), so that they never oversubscribe the cores
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
else:
    torch.set_num_threads(min(2, torch.get_num_threads()))

from lit_rlhf.launch.presets import CONF_DIR  # noqa: E402
from lit_rlhf.launch.schemas import register  # noqa: E402

register()  # the Hydra schemas every preset starts from (train.py does the same)

_real_gc_collect, _real_gc_freeze = gc.collect, gc.freeze  # pytest_collection_finish no-ops gc.freeze
_FROZEN = {"modules": 0}


def _freeze_the_heap() -> None:
    """Move every object alive now into the collector's permanent generation (after a full pass)."""
    _real_gc_collect()
    _real_gc_freeze()
    _FROZEN["modules"] = len(sys.modules)


def pytest_collection_finish(session):
    """Freeze the heap the collection built (torch, transformers, Lightning, the test modules: most
    of a worker's objects), and again after each test that imported modules (vLLM's 300,000 objects
    at the first engine), so that the garbage collector's full passes scan only what the tests
    allocate. vLLM's in-process engine would undo that at every close and freeze again at every
    build (``gc.unfreeze``/``gc.freeze`` in vllm/v1/engine/core.py), each time with full passes over
    the whole heap: 0.5-0.7 s of CPU a pass, five passes an engine, over 40 engines (60% of the
    engine tests' time). Here the session keeps its own freeze, and vLLM's calls are no-ops. Only the
    collector's timing changes: an object that dies after it was frozen (a module fixture's model)
    is freed by its reference count, and only a reference cycle of such objects stays."""
    _freeze_the_heap()
    gc.freeze = gc.unfreeze = lambda: None


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item):
    yield
    if len(sys.modules) > _FROZEN["modules"]:
        _freeze_the_heap()


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    """``--dist loadgroup`` (``make test``): the tests marked ``xdist_group`` share module fixtures (one
    model or one launch of processes for many tests) and must run on one worker. pytest-xdist 3.8 tells
    its scheduler a test's group by appending ``@<group>`` to the node id through the attribute
    ``_nodeid``, which pytest 9.2 no longer reads (its node ids are structured): nothing failed, each
    worker silently ran the groups' fixtures again (pytest-dev/pytest-xdist#1386). Append it where
    pytest keeps it now, on the workers, when xdist's own suffix did not take."""
    if not getattr(config.option, "loadgroup", False):  # set on xdist workers under --dist loadgroup
        return
    from _pytest.nodeid import coerce_node_id

    for item in items:
        groups = sorted(
            {str(m.args[0] if m.args else m.kwargs.get("name", "default")) for m in item.iter_markers("xdist_group")}
        )
        suffix = "@" + "_".join(groups)
        if groups and not item.nodeid.endswith(suffix):
            item._id = coerce_node_id(item.nodeid + suffix)


@pytest.fixture(scope="session")
def tokenizer():
    from lit_rlhf.data.tokenizers import build_tokenizer
    from lit_rlhf.models.spec import ModelSpec, TinyLlamaConfig

    return build_tokenizer(ModelSpec(tiny=TinyLlamaConfig(), tokenizer="synthetic"))


@pytest.fixture(scope="session")
def tiny_spec():
    from lit_rlhf.models.spec import ModelSpec, TinyLlamaConfig

    return ModelSpec(
        tiny=TinyLlamaConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64),
        tokenizer="synthetic",
    )


_COMPOSED: dict[tuple[str, ...], object] = {}


def compose(overrides: list[str], output_dir: Path | None = None):
    """lit_rlhf/conf/train.yaml composed like train.py would, with the Hydra runtime set for ${hydra:…}.

    Without an ``algo=``/``experiment=`` override the tests get the tiny SFT recipe
    (``experiment=sft_synthetic_tiny``), not train.yaml's default (the demo pipeline, which
    runs when no algo is chosen); tests of the pipeline say ``pipeline=demo``.
    """
    if not any(o.startswith(("algo=", "experiment=", "pipeline=")) for o in overrides):  # experiments pick their own
        overrides = ["experiment=sft_synthetic_tiny", *overrides]
    import copy

    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import open_dict

    # a composition is ~0.3 s of OmegaConf merging and the suite composes the same overrides again
    # and again (each option's test, the experiments' checks); a copy of a kept one takes ~0.03 s.
    # Interpolations are not resolved at composition, so a copy resolves them as a new one would.
    key = (os.getcwd(), *overrides)  # hydra.runtime.cwd is the only value composition takes from outside
    if key not in _COMPOSED:
        GlobalHydra.instance().clear()
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            _COMPOSED[key] = hydra_compose("train", overrides=overrides, return_hydra_config=True)
    cfg = copy.deepcopy(_COMPOSED[key])
    if output_dir is not None:
        with open_dict(cfg):
            cfg.paths.output_dir = str(output_dir)
            cfg.paths.log_dir = str(output_dir)
            cfg.hydra.runtime.output_dir = str(output_dir)
    HydraConfig.instance().set_config(cfg)
    return cfg


CPU_FAST = [
    "trainer.accelerator=cpu",
    "trainer.devices=1",
    "trainer.enable_progress_bar=false",
    "logger=none",
    "model.tiny.hidden_size=32",
    "model.tiny.num_hidden_layers=1",
    "model.tiny.num_attention_heads=2",
    "model.tiny.intermediate_size=64",
    "data.sft.n_train=256",
    "data.sft.n_val=64",
    "data.batch_size=32",
]


@pytest.fixture
def cfg_factory(tmp_path):
    """``cfg_factory(*overrides)``: the real config for a fast CPU run writing into tmp_path."""

    def make(*overrides: str, fast: bool = True):
        return compose((CPU_FAST if fast else []) + list(overrides), tmp_path)

    return make


def built_once(tmp_path_factory, name: str, build):
    """``build(folder)`` (returning JSON-able data) run ONCE in the whole session, across the xdist
    workers: a session fixture runs once per worker, and two workers would each train the same
    model. The first worker to get here builds under a file lock in the folder the workers' temporary
    folders share; the other waits and reads the result."""
    import fcntl
    import json
    import shutil

    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # .../pytest-N/popen-gw0 -> .../pytest-N, shared by the workers of this session
    out, done = root / name, root / f"{name}.json"
    with open(root / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if not done.exists():
            shutil.rmtree(out, ignore_errors=True)  # a worker that failed part-way left it
            result = build(out)
            done.write_text(json.dumps(result))
        return json.loads(done.read_text())


@pytest.fixture(scope="session")
def trained_sft(tmp_path_factory):
    """(export folder, final metrics) of the tiny SFT trained on 8,000 embedded-task pairs for 2
    epochs (~12 s alone), shared by the tests that need a policy which has learned the language
    (trained once for both pytest workers)."""

    def build(out):
        from lit_rlhf.launch.runner import run

        metrics = run(
            compose(
                [
                    "trainer.accelerator=cpu",
                    "logger=none",
                    "callbacks=none",
                    "trainer.enable_progress_bar=false",
                    "data.sft.n_train=8000",
                    "data.sft.n_val=1000",
                    "data.batch_size=32",
                    "trainer.max_epochs=2",
                ],
                out,
            )
        )
        return {"policy": str(out / "policy"), "metrics": metrics}

    result = built_once(tmp_path_factory, "trained_sft", build)
    return Path(result["policy"]), result["metrics"]


@pytest.fixture(scope="session")
def saved_models(tiny_spec, tokenizer, tmp_path_factory):
    """(policy dir, reward model dir): a random tiny policy and causal RM saved like the stages do,
    built once for the whole session (tests only read them)."""
    from tests.helpers.ppo import save_tiny_models

    return save_tiny_models(tiny_spec, tokenizer, tmp_path_factory.mktemp("tiny_models"))


@pytest.fixture(scope="session")
def agent_policy_dir(tmp_path_factory):
    """A tiny Llama (head size 32, for vLLM too) with the multi-turn tasks' chat tokenizer, taught both
    embedded multi-turn tasks' forms by 120 Adam steps on their teachers' conversations (the guessing
    game's and the calculator task's, every assistant turn; a few seconds): its turns end, it guesses,
    and it writes calls. Saved once per session (``save_pretrained`` with its tokenizer)."""

    def build(out):
        from lit_rlhf.data.agent_tasks import guess_traces, tool_traces
        from lit_rlhf.data.chat import render_with_assistant_mask
        from lit_rlhf.data.collate import pad
        from lit_rlhf.data.reasoning import ReasoningTaskConfig
        from lit_rlhf.data.tokenizers import build_tokenizer
        from lit_rlhf.models.builders import build_causal_lm
        from lit_rlhf.models.spec import ModelSpec, TinyLlamaConfig

        spec = ModelSpec(
            tiny=TinyLlamaConfig(hidden_size=64, num_hidden_layers=1, num_attention_heads=2, intermediate_size=128),
            tokenizer="agent",
        )
        tok = build_tokenizer(spec)
        torch.manual_seed(3)
        model = build_causal_lm(spec, tok)
        traces = guess_traces(256, 0, "train") + tool_traces(ReasoningTaskConfig(tool_fraction=0.5), 256, "train", 0.5)
        rows = [render_with_assistant_mask(tok, t["messages"]) for t in traces]
        ids, mask = pad([r[0] for r in rows], tok.pad_token_id, "right")
        loss_mask, _ = pad([r[1] for r in rows], 0, "right")
        order = torch.randperm(ids.shape[0], generator=torch.Generator().manual_seed(0))
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        for step in range(120):
            batch = order[torch.arange(step * 32, step * 32 + 32) % ids.shape[0]]
            logits = model(input_ids=ids[batch], attention_mask=mask[batch]).logits[:, :-1]
            nll = torch.nn.functional.cross_entropy(logits.transpose(1, 2), ids[batch, 1:], reduction="none")
            loss = (nll * loss_mask[batch, 1:]).sum() / loss_mask[batch, 1:].sum()
            opt.zero_grad()
            loss.backward()
            opt.step()
        model.save_pretrained(out)
        tok.save_pretrained(out)
        return {"policy": str(out), "loss": float(loss)}

    return Path(built_once(tmp_path_factory, "agent_policy", build)["policy"])
