"""The frozen target: taps equal HF's hidden_states[i + 1], no gradients, eval mode, sharing."""

from __future__ import annotations

import pytest
import torch

from dspark_ds.target import (
    FrozenTarget,
    TargetConfig,
    TargetFeatureProvider,
    default_layer_ids,
    load_target,
    share_embeddings_and_head,
)

from helpers.drafters import tiny_dspark_config


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory, tiny_target):
    return tiny_target


def test_taps_match_hf_hidden_states(target_dir):
    target = load_target(TargetConfig(path=target_dir, layer_ids=[-1, 0, 2, 3], dtype="float32"))
    ids = torch.randint(4, 300, (2, 17), generator=torch.Generator().manual_seed(0))
    hidden, last = target(ids)
    ref = target.model(ids, output_hidden_states=True)
    hs = ref.hidden_states
    assert hidden.shape == (2, 17, 4 * 32) and last.shape == (2, 17, 32)
    torch.testing.assert_close(hidden, torch.cat([hs[0], hs[1], hs[3], hs[4]], -1), rtol=0, atol=0)
    # The final normed state is what the lm_head consumes.
    torch.testing.assert_close(target.model.lm_head(last), ref.logits, rtol=1e-6, atol=1e-6)


def test_frozen_eval_no_grad(target_dir):
    target = load_target(TargetConfig(path=target_dir, layer_ids=[1], dtype="float32"))
    target.train()
    assert not target.training and not target.model.training
    assert not any(p.requires_grad for p in target.parameters())
    hidden, last = target(torch.tensor([[5, 6, 7]]))
    assert not hidden.requires_grad and hidden.grad_fn is None and last.grad_fn is None


def test_layer_id_validation(target_dir):
    for bad, why in (
        ([2, 1], "strictly increasing"),
        ([-2, 1], "out of range"),
        ([0, 4], "out of range"),
        ([], "empty"),
    ):
        with pytest.raises(ValueError, match=why):
            load_target(TargetConfig(path=target_dir, layer_ids=bad, dtype="float32"))
    with pytest.raises(ValueError, match="target.dtype"):
        TargetConfig(path=target_dir, dtype="int8")
    assert default_layer_ids(36) == [1, 9, 17, 25, 33]
    assert default_layer_ids(40) == [1, 10, 19, 28, 37]


def test_provider_zeroes_padding_and_matches_unpadded(target_dir):
    target = load_target(TargetConfig(path=target_dir, layer_ids=[-1, 1], dtype="float32"))
    ids = torch.tensor([[5, 6, 7, 8, 9], [10, 11, 12, 0, 0]])
    attn = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])
    out = TargetFeatureProvider(target)(
        {"input_ids": ids, "loss_mask": attn, "attention_mask": attn}
    )
    assert out["target_hidden_states"][1, 3:].abs().sum() == 0
    alone, alone_last = target(ids[1:, :3])
    torch.testing.assert_close(out["target_hidden_states"][1, :3], alone[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(
        out["target_last_hidden_states"][1, :3], alone_last[0], atol=1e-5, rtol=1e-5
    )


def test_drafter_shares_target_embedding_and_head(target_dir):
    from dspark_ds.drafters import build_draft_model

    target = load_target(TargetConfig(path=target_dir, layer_ids=[-1, 1, 2], dtype="float32"))
    cfg = tiny_dspark_config(target.config, [-1, 1, 2], num_anchors=4, markov_rank=4)
    drafter = build_draft_model(cfg)
    share_embeddings_and_head(drafter, target)
    assert drafter.embed_tokens.weight is target.embed_weight
    assert drafter.lm_head.weight is target.lm_head_weight
    assert not drafter.embed_tokens.weight.requires_grad
    trainable = {id(p) for p in drafter.parameters() if p.requires_grad}
    assert id(target.embed_weight) not in trainable and len(trainable) > 0
    assert isinstance(target, FrozenTarget)


def test_final_layer_id_is_the_normed_state_in_training_and_evaluation(target_dir):
    """Id L-1 is HF's hidden_states[L] (normed) in both the training tap and the evaluation tap,
    not the raw output of the last decoder layer (what the reference's cache stores)."""
    from dspark_ds.eval.target_step import TargetDecoder

    target = load_target(TargetConfig(path=target_dir, layer_ids=[0, 3], dtype="float32"))
    ids = torch.randint(4, 300, (1, 11), generator=torch.Generator().manual_seed(1))
    raw = {}
    handle = target.decoder.layers[3].register_forward_hook(
        lambda _m, _i, out: raw.setdefault("out", out[0] if isinstance(out, tuple) else out)
    )
    train_features, last = target(ids)
    handle.remove()
    eval_features = TargetDecoder(target.model, [0, 3]).forward(ids).features_LnH
    torch.testing.assert_close(eval_features, train_features, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(train_features[..., 32:], last, rtol=0, atol=0)
    assert not torch.allclose(train_features[..., 32:], raw["out"], atol=1e-3)
