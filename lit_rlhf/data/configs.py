"""The data groups' typed configs (``data.sft``, ``data.preference``, ``data.prompt``;
docs/configs.md), apart from their data modules so that composing and checking a config
(train.py's key checks, ``--cfg job``, lit_rlhf/launch/schemas.py) imports neither torch nor
Lightning. The data modules (data/sft.py, data/preference.py, data/prompts.py) re-export them.

``DataConfig`` holds what the three sections share (split, rows, template, loader settings, the
embedded task) and their common checks; ``HeldOutDataConfig`` adds the validation carve-out and
bad-row rules that SFT pairs and preference pairs share."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Literal

from lit_rlhf.data.io import parse_rows, ranges_overlap
from lit_rlhf.data.reasoning import ReasoningTaskConfig
from lit_rlhf.data.synthetic import TaskConfig
from lit_rlhf.data.templates import TEMPLATES
from lit_rlhf.utils.config import ConfigError, check


@dataclass
class DataConfig:
    """What every data section shares: which rows of ``source`` to train on, the chat template,
    the loader settings and the embedded task (each section adds its format, lengths and sizes)."""

    source: str = "synthetic"
    """"synthetic" (the embedded task), "reasoning" (the embedded reasoning task: SFT and prompt
    data only, prompts with their answers), a .jsonl/.jsonl.gz/.json/.parquet file, a ``save_to_disk``
    folder or a hub dataset name (prompt data: with a prompt column, or HH-style pairs)."""
    train_split: str = "train"
    """Split name for folder/hub sources."""
    hub_data_dir: str | None = None
    """Subset folder of a hub dataset (``harmless-base`` of ``Anthropic/hh-rlhf``); files ignore it."""
    train_rows: str | None = None
    """1-based inclusive row range of ``source`` to train on (e.g. "1-2000"); None = all rows."""
    template: str = "plain"
    """Prompt template, the same for SFT, the reward model, DPO and the RL stages: "auto" = the tokenizer's
    own chat template (data/chat.py; conversations as messages, a Human/Assistant dialogue when the tokenizer
    has none), or a named Python template for base models and the embedded tasks (data/templates.py:
    plain = none, the text as it is; human_assistant; dialogue)."""
    eval_batch_size: int | None = field(default=None, metadata={"ge": 1})
    """Validation (and test) batch size; None = batch_size."""
    num_workers: int = field(default=0, metadata={"ge": 0})
    """DataLoader worker processes (0 = load in the main process)."""
    seed: int = 0
    """Shuffling seed (also of the validation split, length grouping and, + 1, the ptx sampler where
    the section has them)."""
    task: TaskConfig = field(default_factory=TaskConfig)
    """Embedded task settings (source=synthetic only)."""
    reasoning: ReasoningTaskConfig = field(default_factory=ReasoningTaskConfig)
    """Embedded reasoning task settings (source=reasoning only; lit_rlhf/data/reasoning.py)."""

    ROW_KEYS: ClassVar[tuple[str, ...]] = ("train_rows",)
    """The section's row-range keys, each checked to parse ("1-2000", "2001-")."""

    def validate(self) -> None:
        check(
            self.template in TEMPLATES or self.template == "auto",
            "template",
            f"must be one of {[*TEMPLATES, 'auto']}, got {self.template!r}",
        )
        for key in self.ROW_KEYS:
            try:
                parse_rows(getattr(self, key))
            except ValueError as err:
                raise ConfigError(key, str(err)) from None


@dataclass
class HeldOutDataConfig(DataConfig):
    """Labelled rows (SFT pairs, preference pairs): a validation part held out of them, and what to
    do with rows whose response is empty."""

    val_source: str | None = None
    """Validation file/dataset; None = ``val_split`` of ``source`` (or its ``val_rows`` for
    preference data), else a ``val_fraction`` carve-out."""
    val_split: str | None = None
    """Split name of ``source`` used for validation (folder/hub sources)."""
    val_fraction: float = field(default=0.05, metadata={"ge": 0.0, "lt": 1.0})
    """Share of the training rows held out for validation when no validation source, split (or rows) is set."""
    on_empty: Literal["skip", "error"] = "skip"
    """Rows with an empty (whitespace-only) response: skip them (counted) or fail."""
    max_samples: int | None = field(default=None, metadata={"ge": 1})
    """Use at most this many training rows (quick runs); None = all."""


@dataclass
class SFTDataConfig(HeldOutDataConfig):
    """Where SFT pairs come from and how they are batched (``data.sft.*``)."""

    source: str | None = "synthetic"
    """"synthetic" (the embedded task), "reasoning" (the reasoning task's teacher solutions),
    "reasoning_tool" (its teacher calling a calculator, as conversations) or "guess" (the guessing
    game's traces; both lit_rlhf/data/agent_tasks.py, format=messages), a .jsonl/.jsonl.gz/.json/.parquet
    file, a ``save_to_disk`` folder, or a hub dataset name (required: None is refused)."""
    format: Literal["prompt_response", "hh", "messages"] = "prompt_response"
    """prompt_response = the two fields below; hh = HH-RLHF pairs, trained on the prompt and the CHOSEN reply;
    messages = a conversation (``messages_field``: a list of {role, content}, system turns kept), trained on
    every assistant turn (needs template=auto)."""
    messages_field: str = "messages"
    """Column holding the conversation (format=messages)."""
    prompt_field: str = "prompt"
    """Column holding the prompt (a string; with template=auto also TRL's conversational prompt: messages)."""
    response_field: str = "response"
    """Column holding the response, the target (a string; with template=auto also one assistant message:
    TRL's conversational prompt-completion rows, response_field=completion)."""
    max_length: int = field(default=128, metadata={"ge": 2})
    """Prompt + response tokens; longer pairs lose prompt tokens from the left first."""
    batch_size: int = field(default=32, metadata={"ge": 1})
    """Pairs per training batch (per process)."""
    n_train: int = field(default=20000, metadata={"ge": 1})
    """Embedded tasks: training pairs to generate."""
    n_val: int = field(default=1000, metadata={"ge": 1})
    """Embedded tasks: held-out pairs to generate (a separate random stream)."""

    def validate(self) -> None:
        check(
            self.source is not None,
            "source",
            "is required: a .jsonl/.json/.parquet file, a save_to_disk "
            "folder or a hub dataset name, e.g. data.sft.source=/path/train.jsonl",
        )
        check(
            self.format != "messages" or self.template == "auto",
            "template",
            f"format=messages is rendered by the tokenizer's chat template: set data.sft.template=auto, got "
            f"{self.template!r}",
        )
        check(
            self.source not in ("reasoning_tool", "guess") or self.format == "messages",
            "format",
            f"source={self.source} gives conversations: set data.sft.format=messages (and template=auto)",
        )
        super().validate()


@dataclass
class PreferenceDataConfig(HeldOutDataConfig):
    """Where preference pairs come from and how they are batched (``data.preference.*``)."""

    source: str | None = "synthetic"
    """"synthetic" (the embedded task's gold-labelled pairs), a .jsonl/.jsonl.gz/.json/.parquet file, a
    ``save_to_disk`` folder or a hub dataset name (required: None is refused)."""
    fallback_source: str | None = None
    """Used when ``source`` is a file that does not exist (e.g. the hub copy of a local file)."""
    format: Literal["auto", "hh", "question", "generic", "unpaired"] = "auto"
    """Row layout; auto = detected from the first row's keys (hh, question, generic, unpaired). hh = ``chosen``
    and ``rejected`` whole dialogues sharing their prompt; generic = ``prompt``, ``chosen``, ``rejected``; unpaired
    = ``prompt``, ``completion``, ``label`` (true = desirable) rows: KTO's data only. With template=auto the
    fields may be TRL's conversational values: a prompt as messages ending with a user turn, a response as
    one assistant message, hh's chosen/rejected as whole conversations."""
    val_rows: str | None = None
    """Row range of ``source`` for validation (instead of a ``val_fraction`` carve-out)."""
    test_source: str | None = None
    """Held-out pairs for ``test=true``; None = ``source`` when test_split or test_rows is set."""
    test_split: str | None = None
    """Split of ``source`` (or test_source) used by test=true."""
    test_rows: str | None = None
    """1-based inclusive row range of ``source`` held out for test=true; must not overlap train_rows."""
    margin_field: str | None = None
    """Column with a per-pair rating (Llama-2 margin); None = margin 0."""
    margin_scale: Literal["llama2_small", "llama2_large", "raw"] = "llama2_small"
    """Rating 3/2/1/0 → margin 1, 2/3, 1/3, 0 (small) or 3, 2, 1, 0 (large); raw = the number itself."""
    max_length: int = field(default=512, metadata={"ge": 8})
    """Prompt + response tokens per sequence; longer pairs lose prompt tokens from the left (counted)."""
    on_identical: Literal["skip", "error"] = "skip"
    """Pairs whose chosen and rejected responses are identical: skip them (counted) or fail."""
    batch_size: int = field(default=16, metadata={"ge": 1})
    """Pairs per batch (2 × sequences)."""
    group_by_length: bool = True
    """Batch pairs of similar length (much less padding); order stays random across batches."""
    unpaired: bool = False
    """Batches of unpaired examples (prompt, completion, desirable or not) instead of pairs, for KTO
    (docs/algorithms.md §5.3; set by algo.loss_type=kto): pairs are split, the chosen response a
    desirable example and the rejected one an undesirable example; ``batch_size`` then counts examples."""
    n_train: int = field(default=10000, metadata={"ge": 1})
    """Embedded task: training pairs to generate."""
    n_val: int = field(default=500, metadata={"ge": 1})
    """Embedded task: validation pairs (a separate random stream)."""
    n_test: int = field(default=1000, metadata={"ge": 1})
    """Embedded task: held-out pairs for test=true."""

    ROW_KEYS: ClassVar[tuple[str, ...]] = ("train_rows", "val_rows", "test_rows")

    def validate(self) -> None:
        check(
            self.source is not None,
            "source",
            "is required: a .jsonl/.json/.parquet file, a save_to_disk folder or "
            "a hub dataset name, e.g. data.preference.source=/path/pairs.jsonl",
        )
        check(
            self.source != "reasoning",
            "source",
            "the reasoning task has no preference pairs (it is SFT and "
            "prompt data with answers: data=reasoning's sft and prompt sections)",
        )
        super().validate()
        same_test = self.test_source in (None, self.source) and self.test_split in (None, self.train_split)
        if self.test_rows is not None and same_test:
            check(
                not ranges_overlap(self.train_rows, self.test_rows),
                "test_rows",
                f"overlaps train_rows={self.train_rows!r}: held-out pairs must never be trained on",
            )
        if self.val_rows is not None and self.val_source is None and self.val_split is None:
            check(
                not ranges_overlap(self.train_rows, self.val_rows),
                "val_rows",
                f"overlaps train_rows={self.train_rows!r}",
            )


@dataclass
class PromptDataConfig(DataConfig):
    """Prompts for rollouts (``data.prompt.*``)."""

    source: str | None = "synthetic"
    """"synthetic" (the embedded task), "reasoning" (the reasoning task's problems with their
    answers), "guess" (the guessing game's prompts with their ``secret``; lit_rlhf/data/agent_tasks.py),
    a .jsonl/.jsonl.gz/.json/.parquet file, a ``save_to_disk`` folder or a hub dataset name, with a
    prompt column or HH-style pairs (required: None is refused)."""

    format: Literal["auto", "prompt", "hh"] = "auto"
    """prompt = a ``prompt_field`` column (a string; with template=auto also messages ending with a user turn);
    hh = the shared prompt of chosen/rejected dialogues (or, with template=auto, conversations)."""
    prompt_field: str = "prompt"
    """Column holding the prompt (format=prompt)."""
    answer_field: str | None = None
    """Column holding each prompt's ground truth (a verifiable task, docs/rewards.md): handed to the
    reward callables as ``answer=`` with the responses; None = no ground truth."""
    answer_format: Literal["raw", "gsm8k"] = "raw"
    """raw = the column as it is (a number becomes its text); gsm8k = the text after the last "####"
    of a worked solution ("... #### 72" → "72"; a row without one is an error naming it)."""
    columns: list[str] = field(default_factory=list)
    """Other columns of each row kept with its prompt: handed to reward callables and to an
    environment's ``reset`` by name (docs/agents.md), e.g. a secret, a test case, or ``tools`` (the
    row's tools: a list of names or of JSON schemas, TRL's format; the environment's tools by default)."""
    val_rows: str | None = None
    """Rows of ``source`` whose prompts are sampled in validation (with ``algo.generation``); None = none."""
    max_prompt_length: int = field(default=64, metadata={"ge": 1})
    """Longer prompts lose tokens from the left (a leading BOS is kept); counted in the log."""
    batch_size: int | None = field(default=None, metadata={"ge": 1})
    """Prompts per training batch = the rollout batch per process. In train.py runs it is the RL
    stage's ``algo.rollout_batch_size`` (set by the runner; leave it None); set it when using the
    data module on its own."""
    n_train: int = field(default=20000, metadata={"ge": 1})
    """Embedded tasks: training prompts."""
    n_val: int = field(default=64, metadata={"ge": 0})
    """Embedded tasks: validation prompts (0 = no validation; the reasoning task's come with answers)."""
    ptx_source: str | None = None
    """SFT pairs for the ptx loss: "synthetic" (the embedded SFT corpus) or a prompt/response file."""
    ptx_batch_size: int = field(default=16, metadata={"ge": 1})
    """SFT pairs per ptx batch (one ptx batch per RL iteration)."""
    ptx_max_length: int = field(default=64, metadata={"ge": 2})
    """Prompt + response tokens of a ptx pair."""

    ROW_KEYS: ClassVar[tuple[str, ...]] = ("train_rows", "val_rows")

    def validate(self) -> None:
        check(
            self.source is not None,
            "source",
            "is required: a .jsonl/.json/.parquet file, a save_to_disk folder or "
            "a hub dataset name, e.g. data.prompt.source=/path/questions.jsonl",
        )
        super().validate()
