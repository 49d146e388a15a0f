"""`model.ce_labels: target`: the cross-entropy's labels are the target's greedy tokens (the
argmax of its aligned logits) instead of the training sequence's next tokens; checked against
a hand computation, on every loss path, and over a reduced draft vocabulary."""

from __future__ import annotations

import math
from dataclasses import asdict

import pytest
import torch
import torch.nn.functional as F

from dspark_ds.drafters.common.vocab import vocab_maps
from dspark_ds.drafters.dspark.blocks import sample_anchor_positions
from dspark_ds.drafters.dspark.config import DFLASH_LOSS, DSPARK_LOSS, LossWeights
from dspark_ds.drafters.dspark.step import forward_and_loss, greedy_target_ids
from dspark_ds.drafters.presets import preset
from dspark_ds.errors import ConfigError

from helpers.drafters import DFLASH, random_batch, tiny_drafter

TARGET = dict(asdict(DFLASH_LOSS), ce_labels="target")


def _batch(model, seed, **kw):
    """A random batch with its anchors drawn once (every forward then sees the same blocks)."""
    batch = random_batch(model, seed=seed, **kw)
    anchors, keep = sample_anchor_positions(
        batch["loss_mask"], model.num_anchors, torch.Generator().manual_seed(seed)
    )
    return {**batch, "anchor_positions": anchors, "block_keep_mask": keep}


def _hand_ce(model, batch):
    """CE of the draft logits against argmax(aligned target logits), exp(-j/4)-weighted mean
    over the supervised slots, computed from the reference forward's tensors alone."""
    with torch.no_grad():
        out = model(**batch)
    labels = out.aligned_target_logits.argmax(-1)
    logp = F.log_softmax(out.draft_logits.float(), -1)
    ce = -logp.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    j = torch.arange(ce.shape[-1], dtype=torch.float32)
    w = torch.exp(-j / 4.0) * out.eval_mask.float()
    return (ce * w).sum() / w.sum(), labels, out


def test_target_labels_are_the_targets_greedy_tokens_by_hand():
    model = tiny_drafter(**DFLASH)
    batch = _batch(model, 1, batch=2, seq_len=24)
    want, labels, out = _hand_ce(model, batch)
    # the random sequence's next tokens are not what the target would say
    differ = (labels != out.target_ids) & out.eval_mask
    assert differ.sum() > 10
    with torch.no_grad():
        loss, m = forward_and_loss(model, batch, TARGET, impl="reference")
        _, data = forward_and_loss(model, batch, asdict(DFLASH_LOSS), impl="reference")
    assert m["ce_loss"] == pytest.approx(want.item(), rel=1e-5)
    assert loss.item() == pytest.approx(want.item(), rel=1e-5)
    assert data["ce_loss"] != pytest.approx(want.item(), rel=1e-2)
    # the greedy-acceptance metrics are against the same labels
    hit = (out.draft_logits.argmax(-1) == labels) & out.eval_mask
    assert m["greedy_accept@0"] == pytest.approx(
        hit[..., 0].sum().item() / out.eval_mask[..., 0].sum().item()
    )


@pytest.mark.parametrize("impl", ["chunked", "recompute"])
@pytest.mark.parametrize(
    "args",
    [TARGET, dict(TARGET, loss_schedule="dpace"), dict(asdict(DSPARK_LOSS), ce_labels="target")],
    ids=["dflash", "dflash-dpace", "dspark"],
)
def test_every_loss_path_gives_the_reference_loss_and_gradients(impl, args):
    kw = DFLASH if args["ce_loss_alpha"] == 1.0 else {}
    model = tiny_drafter(**kw)
    batch = _batch(model, 2, batch=3, seq_len=22)
    results = {}
    for path in ("reference", impl):
        model.zero_grad(set_to_none=True)
        loss, metrics = forward_and_loss(model, batch, args, impl=path, chunk_anchors=3)
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        results[path] = (loss.detach(), metrics, grads)
    (ref_loss, ref_m, ref_g), (loss, m, g) = results["reference"], results[impl]
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    for name, value in ref_m.items():
        assert m[name] == pytest.approx(value, rel=1e-5, abs=1e-6), name
    assert set(g) == set(ref_g) and len(g) > 5
    for name, grad in ref_g.items():
        torch.testing.assert_close(g[name], grad, rtol=1e-5, atol=1e-5, msg=name)


def test_greedy_ids_do_not_depend_on_the_chunk():
    model = tiny_drafter(**DFLASH)
    states = torch.randn(2, 5, 4, model.config.hidden_size)
    full = model.target_logits(states).argmax(-1)
    for chunk in (1, 3, 100):
        assert torch.equal(greedy_target_ids(model, states, chunk), full)


def test_over_a_draft_vocabulary_the_labels_are_draft_ids_all_in_it():
    base = tiny_drafter(**DFLASH)
    ids = torch.arange(0, base.config.vocab_size, 3)
    model = tiny_drafter(draft_vocab_size=len(ids), **DFLASH)
    full_head = torch.randn(model.config.vocab_size, model.config.hidden_size)
    model.set_draft_vocab(vocab_maps(ids, model.config.vocab_size)[0])
    model.initialize_embeddings_and_head(model.embed_tokens.weight.detach().clone(), full_head)
    batch = _batch(model, 4, batch=2, seq_len=24)
    want, labels, out = _hand_ce(model, batch)
    assert labels.max() < len(ids)  # draft ids
    assert out.label_in_vocab is not None and not out.label_in_vocab.all()  # data labels miss
    with torch.no_grad():
        _, m = forward_and_loss(model, batch, TARGET, impl="reference")
    assert m["ce_loss"] == pytest.approx(want.item(), rel=1e-5)
    assert math.isfinite(m["ce_loss"])


def test_without_the_targets_states_or_with_a_bad_value_it_says_so():
    model = tiny_drafter(**DFLASH)
    batch = random_batch(model, batch=2, seq_len=24)
    batch.pop("target_last_hidden_states")
    for impl in ("reference", "chunked"):
        with pytest.raises(ValueError, match="ce_labels 'target' needs the target's final"):
            forward_and_loss(model, batch, TARGET, impl=impl)
    with pytest.raises(ConfigError, match=r"model\.ce_labels: expected one of \('data', 'target'"):
        preset("dflash", ce_labels="argmax").validate()
    with pytest.raises(ConfigError, match="ce_labels"):
        LossWeights(4.0, 1.0, 0.0, 0.0, ce_labels="argmax")
    assert LossWeights.of(preset("dflash", ce_labels="target").validate()).ce_labels == "target"


def test_padded_to_blocks_every_rank_calls_the_head_equally_often():
    """Under ZeRO-3 each head call is a gather with the other ranks: with `pad_to_blocks` the
    number of calls depends on it, not on this rank's blocks (the 2-rank ZeRO-3 demo run hung
    without it), and the labels are the same."""
    model = tiny_drafter(**DFLASH)
    calls = []
    project = model.target_logits
    model.target_logits = lambda x: calls.append(len(x)) or project(x)
    few, many = torch.randn(1, 3, 4, model.config.hidden_size), 11
    plain = greedy_target_ids(model, few, 2)
    assert len(calls) == 2
    calls.clear()
    padded = greedy_target_ids(model, few, 2, pad_to_blocks=many)
    assert len(calls) == 6 and calls[2:] == [0, 0, 0, 0]  # ceil(11 / 2), the last ones empty
    assert torch.equal(padded, plain)
