"""The embedded task's vocabulary and grammar (lit_rlhf/data/synthetic.py; docs/demo.md).

Data tables only: ~180 English words with a part of speech and a sentiment in [-1, 1], and the
class grammar that picks the next word's part of speech.
"""

from __future__ import annotations

PAD, UNK, BOS, EOS = "<pad>", "<unk>", "<bos>", "<eos>"
SPECIAL_TOKENS = (PAD, UNK, BOS, EOS)

# fmt: off
# (word, sentiment in [-1, 1]) per part of speech. Function words are neutral.
LEXICON: dict[str, list[tuple[str, float]]] = {
    "det": [(w, 0.0) for w in (
        "the", "a", "every", "this", "that", "my", "your", "our", "one", "some", "no", "each")],
    "adj": [
        ("happy", 0.9), ("bright", 0.7), ("kind", 0.8), ("gentle", 0.6), ("lovely", 0.9),
        ("brave", 0.7), ("warm", 0.5), ("clever", 0.6), ("cheerful", 0.9), ("calm", 0.5),
        ("generous", 0.8), ("sweet", 0.6), ("wonderful", 1.0), ("friendly", 0.8), ("proud", 0.4),
        ("fresh", 0.4), ("graceful", 0.6), ("lucky", 0.6), ("honest", 0.7), ("golden", 0.5),
        ("sad", -0.8), ("dark", -0.5), ("cruel", -1.0), ("angry", -0.8), ("cold", -0.4),
        ("broken", -0.7), ("lonely", -0.7), ("bitter", -0.6), ("grim", -0.7), ("nasty", -0.9),
        ("gloomy", -0.7), ("rotten", -0.9), ("sick", -0.6), ("rude", -0.8), ("dull", -0.4),
        ("weary", -0.5), ("harsh", -0.6), ("filthy", -0.8), ("scary", -0.6), ("awful", -1.0),
        ("old", 0.0), ("small", 0.0), ("tall", 0.0), ("quiet", 0.0), ("round", 0.0),
        ("green", 0.0), ("wooden", 0.0), ("distant", 0.0), ("little", 0.0), ("heavy", 0.0),
    ],
    "noun": [
        ("friend", 0.6), ("garden", 0.4), ("gift", 0.7), ("sun", 0.4), ("smile", 0.8),
        ("song", 0.5), ("hero", 0.7), ("treasure", 0.7), ("feast", 0.5), ("flower", 0.5),
        ("storm", -0.5), ("thief", -0.8), ("ghost", -0.4), ("wound", -0.7), ("monster", -0.7),
        ("ruin", -0.6), ("liar", -0.8), ("grave", -0.6), ("plague", -0.9), ("trap", -0.5),
        ("dog", 0.0), ("cat", 0.0), ("river", 0.0), ("house", 0.0), ("city", 0.0),
        ("child", 0.0), ("teacher", 0.0), ("farmer", 0.0), ("bird", 0.0), ("tree", 0.0),
        ("road", 0.0), ("window", 0.0), ("king", 0.0), ("boat", 0.0), ("hill", 0.0),
        ("door", 0.0), ("stone", 0.0), ("horse", 0.0), ("village", 0.0), ("book", 0.0),
        ("sailor", 0.0), ("baker", 0.0), ("forest", 0.0), ("lamp", 0.0), ("bridge", 0.0),
        ("moon", 0.0), ("letter", 0.0), ("wolf", 0.0), ("castle", 0.0), ("field", 0.0),
    ],
    "verb": [
        ("loves", 0.8), ("helps", 0.7), ("praises", 0.7), ("hugs", 0.8), ("welcomes", 0.6),
        ("saves", 0.7), ("heals", 0.7), ("admires", 0.6), ("thanks", 0.6), ("cherishes", 0.9),
        ("hates", -0.8), ("breaks", -0.6), ("fears", -0.5), ("attacks", -0.8), ("curses", -0.8),
        ("ruins", -0.8), ("mocks", -0.6), ("steals", -0.7), ("burns", -0.6), ("betrays", -1.0),
        ("sees", 0.0), ("finds", 0.0), ("follows", 0.0), ("watches", 0.0), ("reaches", 0.0),
        ("passes", 0.0), ("carries", 0.0), ("meets", 0.0), ("opens", 0.0), ("visits", 0.0),
        ("paints", 0.0), ("builds", 0.0), ("remembers", 0.0), ("leaves", 0.0), ("crosses", 0.0),
    ],
    "adv": [
        ("gladly", 0.7), ("warmly", 0.6), ("kindly", 0.7), ("proudly", 0.4), ("happily", 0.8),
        ("sadly", -0.7), ("coldly", -0.5), ("bitterly", -0.6), ("cruelly", -0.9), ("angrily", -0.7),
        ("slowly", 0.0), ("quickly", 0.0), ("again", 0.0), ("today", 0.0), ("often", 0.0),
        ("quietly", 0.0), ("later", 0.0), ("early", 0.0),
    ],
    "prep": [(w, 0.0) for w in (
        "with", "near", "under", "behind", "beside", "over", "into", "across", "for", "from")],
    "conj": [(w, 0.0) for w in ("and", "but", "while", "because", "so", "until")],
}
# fmt: on

# Probability of the next word's class given the current word's class ("<bos>": sentence start).
CLASS_GRAMMAR: dict[str, dict[str, float]] = {
    BOS: {"det": 0.85, "adj": 0.15},
    "det": {"adj": 0.35, "noun": 0.65},
    "adj": {"adj": 0.12, "noun": 0.88},
    "noun": {"verb": 0.45, "prep": 0.17, "conj": 0.1, EOS: 0.28},
    "verb": {"det": 0.6, "adv": 0.25, EOS: 0.15},
    "adv": {EOS: 0.4, "prep": 0.25, "conj": 0.15, "det": 0.2},
    "prep": {"det": 1.0},
    "conj": {"det": 0.9, "adj": 0.1},
}


def word_level_tokenizer(words: list[str]):
    """A word-level ``PreTrainedTokenizerFast`` over ``words`` (the embedded tasks' tokenizers):
    whitespace-split, <bos> prepended, padding on the left, no truncation. Ids: <pad>=0, <unk>=1,
    <bos>=2, <eos>=3, then ``words`` in order."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(list(SPECIAL_TOKENS) + list(words))}
    backend = Tokenizer(models.WordLevel(vocab, unk_token=UNK))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, vocab[BOS])]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        unk_token=UNK,
        padding_side="left",
        model_max_length=512,
    )
