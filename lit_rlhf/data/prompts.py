"""Prompt-only data for RL stages (PPO, GRPO): left-padded prompts, plus optional ptx batches.

Prompts come from the embedded task (sentence openings), the embedded reasoning task (problems,
each with its answer in the batch's ``columns``), a file with a prompt field, or the
prompts of preference pairs (HH-RLHF dialogues up to the last "Assistant:"). With
``ptx_source`` set, every batch also carries an SFT batch for the PPO-ptx loss (InstructGPT):
``{"prompt_ids", "prompt_mask", "prompts", "ptx": {input_ids, attention_mask, response_mask}}``.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.utilities import CombinedLoader
from torch.utils.data import DataLoader

from lit_rlhf.data.chat import field_text_or_turns, get_template, naming_row, prompt_key
from lit_rlhf.data.collate import pad
from lit_rlhf.data.configs import EMBEDDED_SOURCES, PromptDataConfig
from lit_rlhf.data.io import DataError, Row, iter_rows, select_rows
from lit_rlhf.data.loader import ResumableDataLoader
from lit_rlhf.data.preference import parse_pair
from lit_rlhf.data.reasoning import ReasoningTask
from lit_rlhf.data.sampler import EpochSampler
from lit_rlhf.data.synthetic import SyntheticTask
from lit_rlhf.data.templates import AUTO, TEMPLATES
from lit_rlhf.data.tokenizers import check_embedded_vocabulary
from lit_rlhf.utils.config import resolve_config

log = logging.getLogger(__name__)


def row_answer(row: Row, field: str, fmt: str = "raw") -> str | list[str]:
    """The ground truth of a prompt row (``data.prompt.answer_field``): the column as text (a number
    becomes its text), or with ``fmt="gsm8k"`` the text after the last "####" of a worked solution;
    a list of them (several acceptable answers, any of which scores) is a list of such texts."""
    if field not in row.data:
        have = ", ".join(sorted(row.data)) or "none"
        raise DataError(f"{row.where}: missing answer field '{field}' (data.prompt.answer_field); the row has: {have}")
    value = row.data[field]
    if isinstance(value, (list, tuple)):
        if not value:
            raise DataError(f"{row.where}: answer field '{field}' is an empty list (give at least one answer)")
        return [_answer_text(row, f"{field}[{i}]", item, fmt) for i, item in enumerate(value)]
    return _answer_text(row, field, value, fmt)


def _answer_text(row: Row, field: str, value: Any, fmt: str) -> str:
    """One ground truth of :func:`row_answer` (``field`` names it in errors: ``answer`` or ``answer[1]``)."""
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise DataError(
            f"{row.where}: answer field '{field}' must be text, a number or a list of them, got {type(value).__name__}"
        )
    text = value if isinstance(value, str) else format(value, "g") if isinstance(value, float) else str(value)
    if fmt == "gsm8k":
        if "####" not in text:
            raise DataError(
                f"{row.where}: answer field '{field}' has no '#### <answer>' line (data.prompt.answer_format="
                f"gsm8k): {text[-80:]!r}"
            )
        text = text.rsplit("####", 1)[1]
    text = text.strip()
    if not text:
        raise DataError(f"{row.where}: answer field '{field}' is empty")
    return text


def encode_prompt(
    tokenizer: Any, prompt: Any, max_length: int, template: Any = TEMPLATES["plain"]
) -> tuple[list[int], int]:
    """Prompt ids as ``template`` writes them (data/templates.py; named ones add the tokenizer's
    special tokens, ``auto`` renders a conversation or a one-turn string with the chat template and
    its generation prompt), cut from the left to ``max_length`` keeping a leading BOS; and the cut."""
    ids = template.prompt_ids(tokenizer, prompt)
    cut = max(0, len(ids) - max_length)
    if cut:
        keep_bos = ids[0] == tokenizer.bos_token_id and max_length > 1
        ids = ids[:1] + ids[1 + cut :] if keep_bos else ids[cut:]
    return ids, cut


def collate_prompts(items: list[tuple], pad_id: int) -> dict[str, Any]:
    """Left-padded prompts (generation continues every row at the same column). An item is
    ``(ids, text)`` or ``(ids, text, columns)`` with ``columns`` a dict of the row's dataset
    columns for the reward callables (the ground truth ``answer`` of a verifiable task).

    Returns:
        prompt_ids (B, P), prompt_mask (B, P) 1 = real token, prompts: the raw prompt strings, and
        ``columns`` (name → B values) when the items carry any.
    """
    ids, mask = pad([item[0] for item in items], pad_id, "left")
    batch: dict[str, Any] = {"prompt_ids": ids, "prompt_mask": mask, "prompts": [item[1] for item in items]}
    if items and len(items[0]) > 2:
        batch["columns"] = {k: [item[2][k] for item in items] for k in items[0][2]}
    return batch


class PromptDataModule(pl.LightningDataModule):
    """Left-padded prompt batches for RL; ``connect(tokenizer)`` before ``setup``."""

    config_class = PromptDataConfig

    def __init__(self, config: PromptDataConfig | None = None, **kwargs: Any) -> None:
        super().__init__()
        self.config = resolve_config(PromptDataConfig, config, kwargs, "data")
        self.tokenizer: Any = None
        self.train_set: list[tuple[list[int], str]] | None = None
        self.val_set: list[tuple[list[int], str]] = []
        self.ptx: Any = None
        self.stats: dict[str, int] = {}

    def connect(self, tokenizer: Any, kind: str = "causal_lm") -> PromptDataModule:
        if kind != "causal_lm":
            raise ValueError(f"RL rollouts need a causal LM policy, got model.kind={kind}")
        self.tokenizer = tokenizer
        return self

    def _prompts(self, rows_spec: str | None) -> list[tuple[Any, dict[str, str]]]:
        """(prompt, columns) of the rows: columns = ``{"answer": …}`` with ``answer_field`` set, else {}.
        With template=auto a prompt is a conversation: TRL's prompt-only rows (a list of messages
        ending with a user turn) as they are, HH dialogues converted, a string kept (one user turn)."""
        c = self.config
        chat = c.template == AUTO
        rows = select_rows(list(iter_rows(c.source, c.train_split, c.hub_data_dir)), rows_spec)
        fmt = c.format
        if fmt == "auto" and rows:
            fmt = (
                "prompt"
                if c.prompt_field in rows[0].data
                else "hh"
                if {"chosen", "rejected"} <= set(rows[0].data)
                else "prompt"
            )
        out = []
        for row in rows:
            if fmt == "hh":
                prompt = parse_pair(row, "hh", None, "raw", chat=chat, section="prompt").prompt
            else:
                prompt = field_text_or_turns(row, c.prompt_field, "prompt", chat, True, ["data.prompt.prompt_field"])
            columns = {"answer": row_answer(row, c.answer_field, c.answer_format)} if c.answer_field else {}
            for name in c.columns:
                if name not in row.data:
                    have = ", ".join(sorted(row.data)) or "none"
                    raise DataError(f"{row.where}: missing column '{name}' (data.prompt.columns); the row has: {have}")
                columns[name] = row.data[name]
            out.append((prompt, columns))
        return out

    def _encode(self, prompts: list[tuple[Any, dict[str, str]]], split: str) -> list[tuple]:
        c = self.config
        template = get_template(c.template)
        out, cut = [], 0
        # an empty prompt (or a conversation whose last user turn is blank) is no question: skipped, counted
        kept = [(p, cols) for p, cols in prompts if (p if isinstance(p, str) else p[-1]["content"]).strip()]
        for i, (p, cols) in enumerate(kept):
            with naming_row(f"{c.source} [{split}] prompt {i + 1}"):
                ids, n = encode_prompt(self.tokenizer, p, c.max_prompt_length, template)
            cut += n > 0
            out.append((ids, p, cols) if cols else (ids, p))
        s = self.stats
        s[f"{split}_prompts"], s[f"{split}_prompts_cut"] = len(out), cut
        s[f"{split}_skipped_empty"] = len(prompts) - len(kept)
        s[f"{split}_duplicates"] = len(kept) - len({prompt_key(p) for p, _ in kept})
        log.info(
            "prompts %s: %d (%d empty or blank skipped; %d duplicates kept; %d cut from the left at "
            "max_prompt_length=%d)",
            split,
            len(out),
            s[f"{split}_skipped_empty"],
            s[f"{split}_duplicates"],
            cut,
            c.max_prompt_length,
        )
        return out

    def setup(self, stage: str | None = None) -> None:
        if self.train_set is not None:
            return
        if self.tokenizer is None:
            raise RuntimeError("PromptDataModule.connect(tokenizer) must be called before setup()")
        c = self.config
        if c.source in EMBEDDED_SOURCES:
            check_embedded_vocabulary(self.tokenizer, "prompt", c.source)
        if c.source == "synthetic":
            task = SyntheticTask(c.task)
            train = [(r["prompt"], {}) for r in task.prompts(c.n_train, "train")]
            val = [(r["prompt"], {}) for r in task.prompts(c.n_val, "val")] if c.n_val else []
        elif c.source == "reasoning":  # problems with their exact answers as the reward's ground truth
            rtask = ReasoningTask(c.reasoning)
            train = [(r["prompt"], {"answer": r["answer"]}) for r in rtask.qa_records(c.n_train, "train")]
            val = [(r["prompt"], {"answer": r["answer"]}) for r in rtask.qa_records(c.n_val, "val")] if c.n_val else []
        elif c.source == "guess":  # the number-guessing game: each prompt with its secret (data/agent_tasks.py)
            from lit_rlhf.data.agent_tasks import guess_prompts

            train = [(r["prompt"], {"secret": r["secret"]}) for r in guess_prompts(c.n_train, c.seed, "train")]
            val = [(r["prompt"], {"secret": r["secret"]}) for r in guess_prompts(c.n_val, c.seed, "val")]
        else:
            train = self._prompts(c.train_rows)
            val = self._prompts(c.val_rows) if c.val_rows else []
        self.train_set = self._encode(train, "train")
        if not self.train_set:
            raise DataError(f"{c.source}: no usable prompts ({len(train)} read, all empty or blank)")
        self.val_set = self._encode(val, "val") if val else []
        if c.ptx_source:
            from lit_rlhf.data.sft import SFTDataModule

            self.ptx = SFTDataModule(
                source=c.ptx_source,
                task=c.task,
                template=c.template,
                max_length=c.ptx_max_length,
                batch_size=c.ptx_batch_size,
                val_fraction=0.0,
                n_val=1,
                seed=c.seed,
            ).connect(self.tokenizer)
            self.ptx.setup(stage)

    def extra_dataloader(self) -> DataLoader:
        """The training prompts in another shuffled order (seed + 1,000,003), for stages that draw
        extra prompts within an iteration (DAPO's dynamic sampling) without disturbing the order
        of the main loader. Under several processes each rank draws its own share of that order
        (Lightning shards only the loaders it is given)."""
        assert self.train_set is not None, "setup() first"
        trainer = getattr(self, "trainer", None)
        shard = (trainer.global_rank, trainer.world_size) if trainer is not None else (0, 1)
        return self._prompt_loader(
            self.train_set, True, self.config.batch_size, seed=self.config.seed + 1_000_003, shard=shard
        )

    def _prompt_loader(
        self, data: list, shuffle: bool, size: int, seed: int | None = None, shard: tuple[int, int] = (0, 1)
    ) -> DataLoader:
        sampler = (
            EpochSampler(len(data), seed=self.config.seed if seed is None else seed, shard=shard) if shuffle else None
        )
        return ResumableDataLoader(
            data,
            batch_size=size,
            sampler=sampler,
            num_workers=self.config.num_workers,
            collate_fn=functools.partial(collate_prompts, pad_id=self.tokenizer.pad_token_id),
            drop_last=shuffle,
        )

    def train_dataloader(self) -> Any:
        assert self.train_set is not None, "setup() first"
        c = self.config
        if c.batch_size is None:
            raise ValueError("PromptDataModule needs batch_size (in train.py runs: algo.rollout_batch_size)")
        prompts = self._prompt_loader(self.train_set, True, c.batch_size)
        if self.ptx is None:
            return prompts
        # one ptx batch per prompt batch, sampled with replacement, whatever the corpus size
        from lit_rlhf.data.collate import collate_sft

        sampler = EpochSampler(
            len(self.ptx.train_set), seed=c.seed + 1, replacement=True, num_samples=len(prompts) * c.ptx_batch_size
        )
        ptx = ResumableDataLoader(
            self.ptx.train_set,
            batch_size=c.ptx_batch_size,
            sampler=sampler,
            num_workers=c.num_workers,
            collate_fn=functools.partial(collate_sft, pad_id=self.tokenizer.pad_token_id),
        )
        return CombinedLoader({"prompts": prompts, "ptx": ptx}, mode="min_size")

    def val_dataloader(self) -> Any:
        if not self.val_set:
            return []
        return self._prompt_loader(self.val_set, False, self.config.eval_batch_size or self.config.batch_size or 16)
