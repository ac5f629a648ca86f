"""SFT data: prompt/response pairs from the embedded task, files or HF datasets (loss on responses)."""

from __future__ import annotations

import functools
import json
import logging
import math
import random
from typing import Any

import lightning.pytorch as pl
from torch.utils.data import DataLoader

from lit_rlhf.data.chat import (
    as_messages,
    check_messages,
    encode_conversation,
    field_text_or_turns,
    get_template,
    hh_to_messages,
    naming_row,
)
from lit_rlhf.data.collate import EncodedPair, collate_sft, encode_pairs
from lit_rlhf.data.configs import EMBEDDED_SOURCES, SFTDataConfig
from lit_rlhf.data.io import DataError, Row, iter_rows, select_rows
from lit_rlhf.data.loader import ResumableDataLoader
from lit_rlhf.data.preference import parse_pair
from lit_rlhf.data.reasoning import ReasoningTask
from lit_rlhf.data.sampler import EpochSampler
from lit_rlhf.data.synthetic import SyntheticTask
from lit_rlhf.data.templates import AUTO
from lit_rlhf.data.tokenizers import check_embedded_vocabulary
from lit_rlhf.utils.config import resolve_config

log = logging.getLogger(__name__)


class SFTDataModule(pl.LightningDataModule):
    """Tokenized prompt/response pairs, right-padded, with a response-only loss mask.

    Call :meth:`connect` with the model's tokenizer before ``setup`` (train.py does it):
    the tokenizer belongs to the model spec, the data only uses it.

    After ``setup`` the counters of what was read, skipped and truncated are in ``stats``, and
    for the embedded task ``reference_perplexity`` is the true language's perplexity on exactly
    the validation tokens the model is scored on (its floor).
    """

    config_class = SFTDataConfig

    def __init__(self, config: SFTDataConfig | None = None, **kwargs: Any) -> None:
        super().__init__()
        self.config = resolve_config(SFTDataConfig, config, kwargs, "data")
        self.tokenizer: Any = None
        self.train_set: list[EncodedPair] | None = None
        self.val_set: list[EncodedPair] = []
        self.stats: dict[str, int] = {}
        self.reference_perplexity: float | None = None

    def connect(self, tokenizer: Any, kind: str = "causal_lm") -> SFTDataModule:
        if kind != "causal_lm":
            raise ValueError(f"SFT needs a causal LM, got model.kind={kind}")
        self.tokenizer = tokenizer
        return self

    # ----------------------------------------------------------------- loading
    def _pairs_from_rows(self, rows: list[Row], split: str) -> list[tuple[Any, str, str]]:
        """(prompt, response, where) per usable row; with ``template=auto`` (messages, "", where):
        the conversation the tokenizer's chat template renders (data/chat.py)."""
        c = self.config
        chat = c.template == AUTO
        out, empty = [], 0
        for row in rows:
            if c.format == "messages":
                messages = row.data.get(c.messages_field)
                if messages is None:
                    raise DataError(f"{row.where}: no '{c.messages_field}' field (data.sft.messages_field)")
                turns = messages if isinstance(messages, list) else []
                response = (
                    ""
                    if any(
                        isinstance(m, dict)
                        and m.get("role") == "assistant"
                        and isinstance(m.get("content"), str)
                        and not m["content"].strip()
                        for m in turns
                    )
                    else "-"
                )
            elif c.format == "hh":  # the dialogue up to the last shared "Assistant:", then the chosen reply
                pair = parse_pair(row, "hh", None, "raw", chat=chat, section="sft")  # (TRL's conversational pairs too)
                prompt, response = pair.prompt, pair.chosen
            else:  # strings, or with template=auto TRL's conversational prompt (messages) and completion
                prompt = field_text_or_turns(row, c.prompt_field, "sft", chat, True, ["data.sft.prompt_field"])
                response = field_text_or_turns(row, c.response_field, "sft", chat, False, ["data.sft.response_field"])
            if not response.strip():
                if c.on_empty == "error":
                    raise DataError(f"{row.where}: empty response (set data.sft.on_empty=skip to skip such rows)")
                empty += 1
                continue
            if not chat:
                out.append((prompt, response, row.where))
                continue
            if c.format == "messages":
                conversation = check_messages(messages, row.where, ends_with="assistant")
            elif c.format == "hh":  # the whole chosen conversation
                chosen = row.data["chosen"]
                conversation = (
                    check_messages(chosen, f"{row.where}: field 'chosen'", ends_with="assistant")
                    if isinstance(chosen, list)
                    else hh_to_messages(chosen, row.where)
                )
            else:
                conversation = [*as_messages(prompt), {"role": "assistant", "content": response}]
            out.append((conversation, "", row.where))
        self.stats[f"{split}_rows_read"] = len(rows)
        self.stats[f"{split}_skipped_empty"] = empty
        self.stats[f"{split}_duplicates"] = len(out) - len({json.dumps(p) + r for p, r, _ in out})
        return out

    def _load_rows(self) -> tuple[list[Row], list[Row]]:
        c = self.config
        if c.source in EMBEDDED_SOURCES:
            check_embedded_vocabulary(self.tokenizer, "sft", c.source)
        if c.source == "synthetic":
            task = SyntheticTask(c.task)
            train = [Row(r, f"synthetic[train] #{i}") for i, r in enumerate(task.sft_records(c.n_train, "train"))]
            val = [Row(r, f"synthetic[val] #{i}") for i, r in enumerate(task.sft_records(c.n_val, "val"))]
            self._task = task
            return train, val
        if c.source == "reasoning":  # the imperfect teacher's worked solutions (lit_rlhf/data/reasoning.py)
            rtask = ReasoningTask(c.reasoning)
            train = [Row(r, f"reasoning[train] #{i}") for i, r in enumerate(rtask.sft_records(c.n_train, "train"))]
            val = [Row(r, f"reasoning[val] #{i}") for i, r in enumerate(rtask.sft_records(c.n_val, "val"))]
            return train, val
        if c.source in ("reasoning_tool", "guess"):  # conversations of the multi-turn tasks (data/agent_tasks.py)
            from lit_rlhf.data.agent_tasks import guess_traces, tool_traces

            def traces(n: int, split: str) -> list[dict]:
                if c.source == "guess":
                    return guess_traces(n, c.seed, split)
                return tool_traces(c.reasoning, n, split, c.reasoning.tool_fraction)

            train = [Row(r, f"{c.source}[train] #{i}") for i, r in enumerate(traces(c.n_train, "train"))]
            val = [Row(r, f"{c.source}[val] #{i}") for i, r in enumerate(traces(c.n_val, "val"))]
            return train, val
        train = select_rows(list(iter_rows(c.source, c.train_split, c.hub_data_dir)), c.train_rows)
        if c.val_source is not None:
            val = list(iter_rows(c.val_source, c.val_split or c.train_split))
        elif c.val_split is not None:
            val = list(iter_rows(c.source, c.val_split, c.hub_data_dir))
        else:
            order = list(range(len(train)))
            random.Random(c.seed).shuffle(order)
            n_val = int(round(len(train) * c.val_fraction))
            val_idx = set(order[:n_val])
            val = [r for i, r in enumerate(train) if i in val_idx]
            train = [r for i, r in enumerate(train) if i not in val_idx]
        return train, val

    def _encode(self, pairs: list[tuple[str, str, str]], split: str) -> list[EncodedPair]:
        c = self.config
        if c.template == "auto":  # the tokenizer's own chat template renders each conversation
            encoded = []
            for m, _, where in pairs:
                with naming_row(where):
                    encoded.append(encode_conversation(self.tokenizer, m, c.max_length))
        else:
            prompts, responses = [p for p, _, _ in pairs], [r for _, r, _ in pairs]
            encoded = encode_pairs(self.tokenizer, prompts, responses, get_template(c.template), c.max_length)
        self.stats[f"{split}_pairs"] = len(encoded)
        self.stats[f"{split}_prompts_cut"] = sum(e.prompt_cut > 0 for e in encoded)
        self.stats[f"{split}_responses_cut"] = sum(e.response_cut > 0 for e in encoded)
        return encoded

    def setup(self, stage: str | None = None) -> None:
        if self.train_set is not None:
            return
        if self.tokenizer is None:
            raise RuntimeError("SFTDataModule.connect(tokenizer) must be called before setup()")
        c = self.config
        train_rows, val_rows = self._load_rows()
        if c.max_samples is not None:
            train_rows = train_rows[: c.max_samples]
        train = self._pairs_from_rows(train_rows, "train")
        val = self._pairs_from_rows(val_rows, "val")
        if not train:
            raise DataError(
                f"{c.source}: no usable SFT rows ({self.stats['train_rows_read']} read, "
                f"{self.stats['train_skipped_empty']} skipped for an empty response)"
            )
        self.train_set = self._encode(train, "train")
        self.val_set = self._encode(val, "val")
        if c.source == "synthetic":
            self.reference_perplexity = self._true_perplexity(val)
        for split in ("train", "val"):
            s = self.stats
            log.info(
                "SFT %s: %d pairs from %s (%d rows read, %d skipped for an empty response, %d duplicated pairs kept, "
                "%d prompts cut from the left, %d responses truncated at max_length=%d)",
                split,
                s[f"{split}_pairs"],
                c.val_source if split == "val" and c.val_source else c.source,
                s[f"{split}_rows_read"],
                s[f"{split}_skipped_empty"],
                s.get(f"{split}_duplicates", 0),
                s[f"{split}_prompts_cut"],
                s[f"{split}_responses_cut"],
                c.max_length,
            )

    def _true_perplexity(self, val: list[tuple[str, str, str]]) -> float | None:
        """exp(mean NLL) of the val response tokens (words + EOS) under the true language."""
        if not val or self.stats["val_responses_cut"] or self.stats["val_prompts_cut"]:
            return None  # the model would be scored on other tokens than these
        lang = self._task.language
        nll, count = 0.0, 0
        for prompt, response, _ in val:
            lp = lang.transition_logprobs(prompt, response, ended=True)
            nll -= float(lp.sum())
            count += len(lp)
        return math.exp(nll / count)

    # ------------------------------------------------------------- dataloaders
    def _loader(self, data: list[EncodedPair], shuffle: bool, batch_size: int) -> DataLoader:
        return ResumableDataLoader(
            data,  # a list is a map-style dataset
            batch_size=batch_size,
            sampler=EpochSampler(len(data), seed=self.config.seed) if shuffle else None,
            num_workers=self.config.num_workers,
            collate_fn=functools.partial(collate_sft, pad_id=self.tokenizer.pad_token_id),
        )

    def train_dataloader(self) -> DataLoader:
        assert self.train_set is not None, "setup() first"
        return self._loader(self.train_set, True, self.config.batch_size)

    def val_dataloader(self) -> DataLoader | list:
        if not self.val_set:
            return []
        return self._loader(self.val_set, False, self.config.eval_batch_size or self.config.batch_size)
