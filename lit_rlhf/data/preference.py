"""Preference pairs for reward models (and DPO): HH-RLHF, question/response, generic, embedded.

Formats (``format="auto"`` detects them from the first row's keys):

* ``hh`` — ``chosen``/``rejected`` whole dialogues (Anthropic HH-RLHF). The prompt is their
  common prefix up to its last ``"\\n\\nAssistant:"``; the responses are the two remainders.
  (A handful of HH rows differ before the final turn; the common prefix handles them too.)
* ``question`` — ``question``, ``response_chosen``, ``response_rejected``.
* ``generic`` — ``prompt``, ``chosen``, ``rejected``.
* ``unpaired`` — ``prompt``, ``completion``, ``label`` (true = desirable): KTO's examples
  (``unpaired=true``, set by algo.loss_type=kto, which also splits the pair formats above into
  examples: the chosen response desirable, the rejected one undesirable).
* ``source="synthetic"`` — the embedded task's gold-labeled pairs (they also carry the gold
  rewards, so the noise ceiling — the gold reward's own accuracy — is known).

Over-long pairs keep the response and lose prompt tokens from the left; identical or empty
responses are skipped (counted, logged) or rejected, per config; a malformed row raises a
:class:`DataError` naming file and line.
"""

from __future__ import annotations

import functools
import logging
import os
import random
from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl
from torch.utils.data import DataLoader

from lit_rlhf.data.chat import (
    Message,
    field_text_or_turns,
    get_template,
    hh_to_messages,
    naming_row,
    prompt_key,
    split_conversations,
)
from lit_rlhf.data.collate import (
    EncodedExample,
    EncodedPreference,
    collate_preference,
    collate_unpaired,
    encode_encoder_pair,
    encode_pair,
    encode_pairs,
)
from lit_rlhf.data.configs import PreferenceDataConfig
from lit_rlhf.data.io import DataError, Row, is_file_source, iter_rows, require_str, select_rows
from lit_rlhf.data.loader import ResumableDataLoader
from lit_rlhf.data.sampler import EpochSampler, LengthGroupedSampler
from lit_rlhf.data.synthetic import SyntheticTask
from lit_rlhf.data.templates import AUTO
from lit_rlhf.data.tokenizers import check_embedded_vocabulary
from lit_rlhf.utils.config import ConfigError, resolve_config

log = logging.getLogger(__name__)

ASSISTANT = "\n\nAssistant:"
FORMAT_FIELDS = {
    "hh": ("chosen", "rejected"),
    "question": ("question", "response_chosen", "response_rejected"),
    "generic": ("prompt", "chosen", "rejected"),
    "unpaired": ("prompt", "completion", "label"),
}
# Llama-2 rating → margin (Touvron et al. 2023, Table 28). Ratings: 3 = significantly better,
# 2 = better, 1 = slightly better, 0 = negligibly better / unsure (names accepted too).
RATING_NAMES = {
    "significantly better": 3,
    "better": 2,
    "slightly better": 1,
    "negligibly better": 0,
    "unsure": 0,
}
MARGIN_SCALES = {"llama2_small": (0.0, 1 / 3, 2 / 3, 1.0), "llama2_large": (0.0, 1.0, 2.0, 3.0)}


@dataclass(frozen=True)
class PreferencePair:
    prompt: str | list[Message]
    """The prompt's text, or with template=auto a conversation ending with a user turn."""
    chosen: str
    rejected: str
    margin: float | None = None
    where: str = ""
    gold: tuple[float, float] | None = None
    """(gold reward of chosen, of rejected), embedded task only."""


def detect_format(row: Row) -> str:
    keys = set(row.data)
    for fmt in ("question", "generic", "hh", "unpaired"):  # generic has chosen/rejected too: test it before hh
        if set(FORMAT_FIELDS[fmt]) <= keys:
            return fmt
    raise DataError(
        f"{row.where}: cannot detect the preference format from keys {sorted(keys)}; expected "
        + " or ".join("/".join(f) for f in FORMAT_FIELDS.values())
    )


@dataclass(frozen=True)
class UnpairedExample:
    """One KTO example (docs/algorithms.md §5.3): a completion of a prompt, desirable or not."""

    prompt: str | list[Message]
    completion: str
    desirable: bool
    where: str = ""


def parse_example(row: Row, chat: bool = False) -> UnpairedExample:
    """An ``unpaired`` row (with ``chat``, its prompt and completion may be conversational: messages,
    one assistant message); a missing field or a label that is not true/false is a DataError naming the row."""
    hint = ["data.preference.format"]
    prompt = field_text_or_turns(row, "prompt", "preference", chat, True, hint)
    completion = field_text_or_turns(row, "completion", "preference", chat, False, hint)
    if "label" not in row.data:
        raise DataError(
            f"{row.where}: missing field 'label' (true = desirable, false = undesirable); the row has: "
            f"{', '.join(sorted(row.data))}"
        )
    label = row.data["label"]
    if not isinstance(label, bool):
        raise DataError(f"{row.where}: field 'label' must be true or false (desirable or not), got {label!r}")
    return UnpairedExample(prompt, completion, label, row.where)


def unpair(pairs: list[PreferencePair]) -> list[UnpairedExample]:
    """Pairs → KTO examples: each chosen response a desirable example, each rejected one an
    undesirable example; all chosen first, then all rejected, each in pair order (as TRL's
    ``unpair_preference_dataset``)."""
    return [UnpairedExample(p.prompt, p.chosen, True, p.where) for p in pairs] + [
        UnpairedExample(p.prompt, p.rejected, False, p.where) for p in pairs
    ]


def kl_partners(prompts: list[str], where: str) -> list[int]:
    """For each example i, the example j whose completion makes i's KL row (prompt_i, completion_j):
    the nearest one before i, cyclically, with another prompt. TRL shifts completions by one
    (example i gets example i − 1's); skipping examples of the same prompt keeps every KL pair
    mismatched (docs/algorithms.md §5.3)."""
    n, out = len(prompts), []
    for i in range(n):
        j = next(((i - k) % n for k in range(1, n) if prompts[(i - k) % n] != prompts[i]), None)
        if j is None:
            raise DataError(
                f"{where}: KTO's reference point pairs each prompt with another prompt's completion, "
                f"and these {n} examples have a single prompt: add examples of other prompts"
            )
        out.append(j)
    return out


def split_hh(chosen: str, rejected: str, where: str) -> tuple[str, str, str]:
    """HH dialogues → (prompt up to and including the last shared "\\n\\nAssistant:", chosen, rejected)."""
    n = 0
    limit = min(len(chosen), len(rejected))
    while n < limit and chosen[n] == rejected[n]:
        n += 1
    cut = chosen.rfind(ASSISTANT, 0, n)  # the last marker lying entirely inside the shared prefix
    if cut < 0:
        raise DataError(f"{where}: no shared '\\n\\nAssistant:' turn: not an HH-RLHF dialogue pair")
    end = cut + len(ASSISTANT)
    return chosen[:end], chosen[end:].strip(), rejected[end:].strip()


def margin_of(row: Row, field_name: str, scale: str) -> float:
    raw = row.data.get(field_name)
    if raw is None:
        raise DataError(f"{row.where}: missing margin field '{field_name}' (data.preference.margin_field)")
    if scale == "raw":
        if not isinstance(raw, (int, float)) or isinstance(raw, bool):
            raise DataError(f"{row.where}: margin '{field_name}' must be a number, got {raw!r}")
        return float(raw)
    rating = RATING_NAMES.get(raw.strip().lower()) if isinstance(raw, str) else raw
    if rating not in (0, 1, 2, 3) or isinstance(rating, bool):
        raise DataError(f"{row.where}: rating '{field_name}'={raw!r} is not 0-3 or one of {sorted(RATING_NAMES)}")
    return MARGIN_SCALES[scale][int(rating)]


def parse_pair(
    row: Row, fmt: str, margin_field: str | None, margin_scale: str, chat: bool = False, section: str = "preference"
) -> PreferencePair:
    """A pair of ``fmt`` (errors name ``data.<section>.*``: the SFT and prompt data read HH pairs too).
    With ``chat`` (template=auto) the prompt is a conversation: TRL's
    conversational rows (a prompt of messages, chosen/rejected as one assistant message each, or
    chosen/rejected whole conversations sharing their prompt) as they are, HH dialogues converted
    (Human → user, Assistant → assistant), a string prompt kept (one user turn)."""
    fields = FORMAT_FIELDS[fmt]
    hint = [f"data.{section}.format"]
    if fmt == "hh":
        chosen_v, rejected_v = (row.data.get(k) for k in ("chosen", "rejected"))
        if isinstance(chosen_v, list) or isinstance(rejected_v, list):
            if not chat:
                raise DataError(
                    f"{row.where}: 'chosen'/'rejected' are conversations (lists of messages), rendered by "
                    f"the tokenizer's chat template: set data.{section}.template=auto"
                )
            prompt, chosen, rejected = split_conversations(chosen_v, rejected_v, row.where)
        else:
            prompt, chosen, rejected = split_hh(
                require_str(row, "chosen", hint), require_str(row, "rejected", hint), row.where
            )
            prompt = hh_to_messages(prompt, row.where) if chat else prompt
    elif fmt == "question":
        prompt, chosen, rejected = (require_str(row, f, hint) for f in fields)
    else:
        prompt = field_text_or_turns(row, "prompt", section, chat, True, hint)
        chosen, rejected = (field_text_or_turns(row, f, section, chat, False, hint) for f in fields[1:])
    margin = margin_of(row, margin_field, margin_scale) if margin_field else None
    return PreferencePair(prompt, chosen, rejected, margin, row.where)


class PreferenceDataModule(pl.LightningDataModule):
    """Tokenized (chosen, rejected) pairs; ``connect(tokenizer, kind)`` before ``setup``.

    Batches stack chosen rows then rejected rows (see ``collate_preference``). After ``setup``:
    ``stats`` counts rows read, skipped and truncated per split; for the embedded task
    ``gold_accuracy[split]`` is the gold reward's own accuracy on those pairs (the ceiling).
    With ``unpaired`` (KTO) the splits hold :class:`EncodedExample` items instead (``examples``: the
    parsed ones), batched by ``collate_unpaired``: completion rows then KL rows.
    """

    config_class = PreferenceDataConfig

    def __init__(self, config: PreferenceDataConfig | None = None, **kwargs: Any) -> None:
        super().__init__()
        self.config = resolve_config(PreferenceDataConfig, config, kwargs, "data")
        self.tokenizer: Any = None
        self.kind = "causal_lm"
        self.splits: dict[str, list[EncodedPreference]] | dict[str, list[EncodedExample]] | None = None
        self.pairs: dict[str, list[PreferencePair]] = {}
        self.examples: dict[str, list[UnpairedExample]] = {}
        self.stats: dict[str, int] = {}
        self.gold_accuracy: dict[str, float] = {}

    def connect(self, tokenizer: Any, kind: str = "causal_lm") -> PreferenceDataModule:
        self.tokenizer, self.kind = tokenizer, kind
        return self

    # ------------------------------------------------------------------ loading
    def _source(self) -> str:
        c = self.config
        if is_file_source(c.source) and not os.path.exists(c.source) and c.fallback_source:
            log.warning("%s not found; loading the preference pairs from %s instead", c.source, c.fallback_source)
            return c.fallback_source
        return c.source

    def _rows(self, source: str, split: str | None, rows: str | None) -> list[Row]:
        c = self.config
        data_dir = c.hub_data_dir if not is_file_source(source) and not os.path.isdir(source) else None
        return select_rows(list(iter_rows(source, split or c.train_split, data_dir)), rows)

    def _load_file_splits(self) -> dict[str, list[Row]]:
        c = self.config
        source = self._source()
        out = {"train": self._rows(source, c.train_split, c.train_rows)}
        if c.val_source is not None:
            out["val"] = self._rows(c.val_source, c.val_split, c.val_rows)
        elif c.val_split is not None or c.val_rows is not None:
            out["val"] = self._rows(source, c.val_split, c.val_rows)
        else:
            order = list(range(len(out["train"])))
            random.Random(c.seed).shuffle(order)
            held = set(order[: int(round(len(order) * c.val_fraction))])
            out["val"] = [r for i, r in enumerate(out["train"]) if i in held]
            out["train"] = [r for i, r in enumerate(out["train"]) if i not in held]
        if c.test_source is not None or c.test_split is not None or c.test_rows is not None:
            out["test"] = self._rows(c.test_source or source, c.test_split, c.test_rows)
        return out

    def _format(self, rows: list[Row]) -> str:
        c = self.config
        return c.format if c.format != "auto" or not rows else detect_format(rows[0])

    def _parse(self, rows: list[Row], split: str) -> list[PreferencePair]:
        c = self.config
        fmt = self._format(rows)
        pairs, identical, empty = [], 0, 0
        for row in rows:
            pair = parse_pair(row, fmt, c.margin_field, c.margin_scale, chat=c.template == AUTO)
            if not pair.chosen.strip() or not pair.rejected.strip():
                if c.on_empty == "error":
                    raise DataError(f"{row.where}: empty response (data.preference.on_empty=skip skips such pairs)")
                empty += 1
                continue
            if pair.chosen.strip() == pair.rejected.strip():
                if c.on_identical == "error":
                    raise DataError(f"{row.where}: chosen and rejected are identical (data.preference.on_identical)")
                identical += 1
                continue
            pairs.append(pair)
        duplicates = len(pairs) - len({(prompt_key(p.prompt), p.chosen, p.rejected) for p in pairs})
        self.stats.update(
            {
                f"{split}_rows_read": len(rows),
                f"{split}_skipped_empty": empty,
                f"{split}_skipped_identical": identical,
                f"{split}_duplicates": duplicates,
            }
        )
        return pairs

    def _parse_examples(self, rows: list[Row], split: str) -> list[UnpairedExample]:
        """``unpaired`` rows (KTO only); empty completions are skipped (counted) or refused, per ``on_empty``."""
        c = self.config
        if not c.unpaired:
            raise DataError(
                f"{rows[0].where}: unpaired rows (prompt, completion, label) have no pairs to compare: "
                "they train algo.loss_type=kto only"
            )
        examples, empty = [], 0
        for row in rows:
            example = parse_example(row, chat=c.template == AUTO)
            if not example.completion.strip():
                if c.on_empty == "error":
                    raise DataError(f"{row.where}: empty completion (data.preference.on_empty=skip skips such rows)")
                empty += 1
                continue
            examples.append(example)
        duplicates = len(examples) - len({(prompt_key(e.prompt), e.completion, e.desirable) for e in examples})
        self.stats.update(
            {
                f"{split}_rows_read": len(rows),
                f"{split}_skipped_empty": empty,
                f"{split}_skipped_identical": 0,
                f"{split}_duplicates": duplicates,
            }
        )
        return examples

    def _synthetic_pairs(self) -> dict[str, list[PreferencePair]]:
        c = self.config
        task = SyntheticTask(c.task)
        out = {}
        for split, n in (("train", c.n_train), ("val", c.n_val), ("test", c.n_test)):
            recs = task.preference_pairs(n, split)
            out[split] = [
                PreferencePair(
                    r["prompt"],
                    r["chosen"],
                    r["rejected"],
                    None,
                    f"synthetic[{split}] #{i}",
                    (r["gold_chosen"], r["gold_rejected"]),
                )
                for i, r in enumerate(recs)
            ]
            self.stats.update({f"{split}_rows_read": n, f"{split}_skipped_empty": 0, f"{split}_skipped_identical": 0})
            self.gold_accuracy[split] = sum(p.gold[0] > p.gold[1] for p in out[split]) / max(1, n)
        return out

    def _encode(self, pairs: list[PreferencePair], split: str) -> list[EncodedPreference]:
        c = self.config
        template = get_template(c.template)
        if self.kind == "encoder" and c.template == AUTO:
            raise ConfigError(
                "data.preference.template",
                "'auto' renders with a causal LM's chat template; an "
                "encoder reward model (model.kind=encoder) reads one of the named templates",
            )
        sides = self._encode_two(pairs, [p.chosen for p in pairs], [p.rejected for p in pairs], template)
        out = [
            EncodedPreference(chosen, rejected, p.margin, i, p.prompt)
            for i, (p, (chosen, rejected)) in enumerate(zip(pairs, sides))
        ]
        self.stats[f"{split}_pairs"] = len(out)
        self.stats[f"{split}_prompts_cut"] = sum(e.chosen.prompt_cut > 0 or e.rejected.prompt_cut > 0 for e in out)
        self.stats[f"{split}_responses_cut"] = sum(
            e.chosen.response_cut > 0 or e.rejected.response_cut > 0 for e in out
        )
        return out

    def _encode_two(self, rows: list[Any], firsts: list[str], seconds: list[str], template: Any) -> list[tuple]:
        """(encoded first, encoded second) completion of each row's prompt. A causal model with a named
        template: one tokenizer call per side for all rows (encode_pairs, the same ids); otherwise row by
        row, a chat template's refusal naming the row."""
        c = self.config
        if self.kind != "encoder" and c.template != AUTO:
            encoded = encode_pairs(
                self.tokenizer, [r.prompt for r in rows] * 2, firsts + seconds, template, c.max_length
            )
            return list(zip(encoded[: len(rows)], encoded[len(rows) :]))
        enc = functools.partial(
            encode_encoder_pair if self.kind == "encoder" else encode_pair,
            self.tokenizer,
            template=template,
            max_length=c.max_length,
        )
        sides = []
        for r, first, second in zip(rows, firsts, seconds):
            with naming_row(r.where):
                sides.append((enc(r.prompt, first), enc(r.prompt, second)))
        return sides

    def _encode_examples(self, examples: list[UnpairedExample], split: str) -> list[EncodedExample]:
        """Each example with its KL row: its prompt and the completion of :func:`kl_partners`' choice."""
        c = self.config
        template = get_template(c.template)
        partners = kl_partners([e.prompt for e in examples], f"{c.source} [{split}]") if examples else []
        sides = self._encode_two(
            examples, [e.completion for e in examples], [examples[j].completion for j in partners], template
        )
        out = [
            EncodedExample(completion, kl, e.desirable, i, e.prompt)
            for i, (e, (completion, kl)) in enumerate(zip(examples, sides))
        ]
        self.stats[f"{split}_examples"] = len(out)
        self.stats[f"{split}_desirable"] = sum(e.desirable for e in out)
        self.stats[f"{split}_prompts_cut"] = sum(e.completion.prompt_cut > 0 for e in out)
        self.stats[f"{split}_responses_cut"] = sum(e.completion.response_cut > 0 for e in out)
        return out

    def _nothing_usable(self, what: str) -> DataError:
        """The error when no training row survived parsing, with the counts of what was skipped."""
        s = self.stats
        return DataError(
            f"{self.config.source}: no usable {what} in the training rows ({s.get('train_rows_read', 0)} "
            f"read, {s.get('train_skipped_empty', 0)} skipped as empty, "
            f"{s.get('train_skipped_identical', 0)} as identical)"
        )

    def _setup_examples(self) -> None:
        """``unpaired`` (KTO): the pairs split into examples (unpaired rows already are), then encoded."""
        c = self.config
        self.examples.update({split: unpair(pairs) for split, pairs in self.pairs.items()})
        if not self.examples.get("train"):
            raise self._nothing_usable("examples")
        self.splits = {split: self._encode_examples(examples, split) for split, examples in self.examples.items()}
        s = self.stats
        for split in self.splits:
            log.info(
                "preference %s: %d unpaired examples, %d desirable (%d rows read; skipped %d empty, %d identical; "
                "%d examples had prompt tokens cut from the left, %d a completion cut, at max_length=%d)",
                split,
                s[f"{split}_examples"],
                s[f"{split}_desirable"],
                s[f"{split}_rows_read"],
                s[f"{split}_skipped_empty"],
                s[f"{split}_skipped_identical"],
                s[f"{split}_prompts_cut"],
                s[f"{split}_responses_cut"],
                c.max_length,
            )

    def setup(self, stage: str | None = None) -> None:
        if self.splits is not None:
            return
        if self.tokenizer is None:
            raise RuntimeError("PreferenceDataModule.connect(tokenizer) must be called before setup()")
        c = self.config
        if c.source == "synthetic":
            check_embedded_vocabulary(self.tokenizer, "preference", c.source)
            self.pairs = self._synthetic_pairs()
        else:
            for split, rows in self._load_file_splits().items():
                if self._format(rows) == "unpaired":
                    self.examples[split] = self._parse_examples(rows, split)
                else:
                    self.pairs[split] = self._parse(rows, split)
        if c.max_samples is not None:
            for part in (self.pairs, self.examples):
                if "train" in part:
                    part["train"] = part["train"][: c.max_samples]
        if c.unpaired:
            return self._setup_examples()
        if not self.pairs["train"]:
            raise self._nothing_usable("preference pairs")
        self.splits = {split: self._encode(pairs, split) for split, pairs in self.pairs.items()}
        s = self.stats
        for split in self.splits:
            log.info(
                "preference %s: %d pairs (%d rows read; skipped %d empty, %d identical; %d duplicated pairs kept; "
                "%d pairs had prompt tokens cut from the left, %d a response cut, at max_length=%d)",
                split,
                s[f"{split}_pairs"],
                s[f"{split}_rows_read"],
                s[f"{split}_skipped_empty"],
                s[f"{split}_skipped_identical"],
                s.get(f"{split}_duplicates", 0),
                s[f"{split}_prompts_cut"],
                s[f"{split}_responses_cut"],
                c.max_length,
            )

    # -------------------------------------------------------------- dataloaders
    def ordered_dataloader(self, split: str, batch_size: int | None = None) -> DataLoader | list:
        """Every pair of ``split`` once, in order (no shuffling, no length grouping): e.g. to
        precompute per-pair quantities (DPO's reference log-probs), keyed by ``pair_index``."""
        return self._loader(split, train=False, batch_size=batch_size)

    def _loader(self, split: str, train: bool, batch_size: int | None = None) -> DataLoader | list:
        assert self.splits is not None, "setup() first"
        data = self.splits.get(split) or []
        if not data:
            return []
        c = self.config
        size = batch_size or (c.batch_size if train else (c.eval_batch_size or c.batch_size))
        collate = functools.partial(
            collate_unpaired if c.unpaired else collate_preference, pad_id=self.tokenizer.pad_token_id
        )
        if train and c.group_by_length:
            lengths = [
                max(e.completion.length, e.kl.length) if c.unpaired else max(e.chosen.length, e.rejected.length)
                for e in data
            ]
            sampler = LengthGroupedSampler(lengths, size, seed=c.seed)
        else:
            sampler = EpochSampler(len(data), seed=c.seed) if train else None
        return ResumableDataLoader(
            data, batch_size=size, sampler=sampler, num_workers=c.num_workers, collate_fn=collate
        )

    def train_dataloader(self) -> DataLoader:
        return self._loader("train", True)

    def val_dataloader(self) -> DataLoader | list:
        return self._loader("val", False)

    def test_dataloader(self) -> DataLoader | list:
        if not (self.splits or {}).get("test"):
            raise DataError("no test pairs configured: set data.preference.test_rows, test_split or test_source")
        return self._loader("test", False)
