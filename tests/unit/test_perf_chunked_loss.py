"""The chunked losses (fused and recompute) equal the reference loss: value, every metric,
every gradient."""

from __future__ import annotations

from dataclasses import asdict

import pytest
import torch

from dspark_ds.drafters.dspark.blocks import sample_anchor_positions
from dspark_ds.drafters.dspark.config import DFLASH_LOSS, DSPARK_LOSS
from dspark_ds.drafters.dspark.loss import compute_dspark_loss
from dspark_ds.drafters.dspark.step import forward_and_loss
from dspark_ds.drafters.perf import PerfConfig
from dspark_ds.drafters.registry import get_kind

from helpers.drafters import DFLASH, random_batch, tiny_drafter

DSPARK_ARGS = asdict(DSPARK_LOSS)
DFLASH_ARGS = asdict(DFLASH_LOSS)


def _batch(model, seed=3):
    batch = random_batch(model, batch=3, seq_len=22, seed=seed)
    # Sample 2 has 2 anchor candidates only: dummy blocks in the chunks.
    batch["loss_mask"][2, :19] = 0
    anchors, keep = sample_anchor_positions(
        batch["loss_mask"], model.num_anchors, torch.Generator().manual_seed(seed)
    )
    assert not keep.all()
    return {**batch, "anchor_positions": anchors, "block_keep_mask": keep}


def _run(model, batch, loss_args, impl, chunk):
    model.zero_grad(set_to_none=True)
    loss, metrics = forward_and_loss(model, batch, loss_args, impl=impl, chunk_anchors=chunk)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), metrics, grads


def _assert_same(model, batch, loss_args, chunk, impl="chunked"):
    ref_loss, ref_metrics, ref_grads = _run(model, batch, loss_args, "reference", chunk)
    loss, metrics, grads = _run(model, batch, loss_args, impl, chunk)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    assert set(metrics) == set(ref_metrics)
    for name, value in ref_metrics.items():
        assert metrics[name] == pytest.approx(value, rel=1e-5, abs=1e-6), name
    assert set(grads) == set(ref_grads) and len(grads) > 5
    for name, g in ref_grads.items():
        assert g.abs().max() > 0, name  # every compared gradient is live
        torch.testing.assert_close(grads[name], g, rtol=1e-5, atol=1e-5, msg=name)


IMPLS = ["chunked", "recompute"]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("head", ["vanilla", "gated", "rnn"])
@pytest.mark.parametrize("chunk", [1, 4, 100])
def test_chunked_equals_reference_dspark(head, chunk, impl):
    model = tiny_drafter(markov_head_type=head)
    _assert_same(model, _batch(model), DSPARK_ARGS, chunk, impl)


@pytest.mark.parametrize("impl", IMPLS)
def test_chunked_equals_reference_dflash(impl):
    model = tiny_drafter(**DFLASH)
    batch = _batch(model)
    _assert_same(model, batch, DFLASH_ARGS, 5, impl)
    # DFlash batches may come without target_last_hidden_states at all.
    batch.pop("target_last_hidden_states")
    _assert_same(model, batch, DFLASH_ARGS, 5, impl)


@pytest.mark.parametrize("impl", IMPLS)
def test_chunked_equals_reference_confidence_without_l1(impl):
    model = tiny_drafter(confidence_head_with_markov=False)
    args = dict(DSPARK_ARGS, l1_loss_alpha=0.0)
    _assert_same(model, _batch(model), args, 3, impl)


@pytest.mark.parametrize("impl", IMPLS)
def test_chunked_trainable_lm_head_gets_its_gradient(impl):
    """compute_logits' own parameters are differentiated too (not only the Markov head)."""
    model = tiny_drafter()
    model.lm_head.requires_grad_(True)
    _assert_same(model, _batch(model), DSPARK_ARGS, 4, impl)


ALL_TERMS = {"kl": 0.3, "rkl": 0.2, "jsd": 0.5, "tv": 0.4, "nla": 0.1, "lk": 0.7}


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize(
    "options",
    [
        {"loss_terms": ALL_TERMS},
        *({"loss_terms": {name: 1.0}, "l1_loss_alpha": 0.0} for name in ALL_TERMS),
        {"loss_schedule": "dpace"},
        {"loss_schedule": "dpace", "loss_terms": {"lk": 1.0, "jsd": 0.5}},
        {"loss_schedule": "geometric", "loss_terms": {"tv": 1.0}},
    ],
    ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items()),
)
def test_chunked_equals_reference_with_distribution_terms(options, impl):
    """Each distribution term and schedule: loss, metrics (their `<term>_loss` too) and
    gradients of the chunked paths are the reference's."""
    model = tiny_drafter()
    _assert_same(model, _batch(model), dict(DSPARK_ARGS, **options), 3, impl)


@pytest.mark.parametrize("impl", IMPLS)
def test_chunked_terms_with_a_trainable_lm_head(impl):
    """The terms' gradient reaches the target side too when compute_logits trains."""
    model = tiny_drafter(**DFLASH)
    model.lm_head.requires_grad_(True)
    args = dict(DFLASH_ARGS, loss_terms={"kl": 0.5, "lk": 0.5}, loss_schedule="dpace")
    _assert_same(model, _batch(model), args, 4, impl)


@pytest.mark.parametrize("impl", IMPLS)
def test_chunked_without_grad_gives_the_same_metrics(impl):
    model = tiny_drafter()
    batch = _batch(model)
    with torch.no_grad():
        loss, metrics = forward_and_loss(model, batch, DSPARK_ARGS, impl=impl, chunk_anchors=2)
        ref = compute_dspark_loss(model(**batch), **DSPARK_ARGS)
    assert loss.item() == pytest.approx(ref[0].item(), rel=1e-5)
    assert metrics["tau_probabilistic"] == pytest.approx(ref[1]["tau_probabilistic"], rel=1e-5)


def test_bad_options_name_the_field():
    model = tiny_drafter()
    with pytest.raises(ValueError, match="loss_impl"):
        forward_and_loss(model, _batch(model), DSPARK_ARGS, impl="fast")
    with pytest.raises(ValueError, match="loss_chunk_anchors"):
        forward_and_loss(model, _batch(model), DSPARK_ARGS, impl="chunked", chunk_anchors=0)
    with pytest.raises(ValueError, match="perf.attn_implementation"):
        PerfConfig(attn_implementation="sparse")


def test_auto_is_chunked_and_recompute_under_zero3():
    # the ZeRO stage is the run's, passed down (nothing is read off the parameters)
    kind, model = get_kind("dspark"), tiny_drafter()
    for stage, want in ((0, "chunked"), (2, "chunked"), (3, "recompute")):
        assert kind.train.prepare(model, PerfConfig(), zero_stage=stage) == want
        assert kind.train.prepare(model, PerfConfig(loss_impl="chunked"), zero_stage=stage) == want
    for stage in (0, 3):
        for impl in ("reference", "recompute"):
            assert kind.train.prepare(model, PerfConfig(loss_impl=impl), zero_stage=stage) == impl


def test_recompute_keeps_no_vocab_sized_tensor_for_backward():
    """What autograd saves between forward and backward is O(chunk·G·V), not O(A·G·V): the
    recompute path stores each chunk's inputs only; the reference path stores full logits."""
    model = tiny_drafter()
    batch = _batch(model)
    vocab = model.config.vocab_size

    def largest_saved(impl):
        sizes = []

        def pack(t):
            sizes.append(t.numel() if t.shape[-1:] == (vocab,) else 0)
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            forward_and_loss(model, batch, DSPARK_ARGS, impl=impl, chunk_anchors=1)
        return max(sizes)

    slots = batch["anchor_positions"].numel() * model.block_size
    assert largest_saved("reference") >= slots * vocab
    assert largest_saved("recompute") <= model.block_size * vocab


@pytest.mark.parametrize("kind", ["dspark", "dflash"])
@pytest.mark.parametrize("impl", ["reference", "chunked"])
def test_dropping_empty_blocks_changes_nothing_but_the_work(kind, impl):
    """perf.drop_empty_blocks: the blocks no row uses are cut; loss, metrics and every gradient
    stay those of the full num_anchors blocks."""
    from dspark_ds.drafters.dspark.step import drop_empty_blocks

    model = tiny_drafter(seed=2, **({} if kind == "dspark" else DFLASH))
    model.num_anchors = 9
    batch = random_batch(model, batch=3, seq_len=22, seed=4)
    batch["loss_mask"][:, :15] = 0  # at most 6 anchor candidates per row, 9 blocks
    batch["loss_mask"][1, :18] = 0  # and a row with fewer
    anchors, keep = sample_anchor_positions(
        batch["loss_mask"], model.num_anchors, torch.Generator().manual_seed(4)
    )
    cut_anchors, cut_keep = drop_empty_blocks(anchors, keep)
    assert cut_anchors.shape == (3, 6) and cut_keep.any(dim=0).all()
    assert torch.equal(cut_anchors[cut_keep], anchors[keep])
    args = DSPARK_ARGS if kind == "dspark" else DFLASH_ARGS
    full_batch = {**batch, "anchor_positions": anchors, "block_keep_mask": keep}
    full = _run(model, full_batch, args, impl, 4)
    cut_batch = {**batch, "anchor_positions": cut_anchors, "block_keep_mask": cut_keep}
    cut = _run(model, cut_batch, args, impl, 4)
    torch.testing.assert_close(cut[0], full[0], rtol=1e-6, atol=1e-7)
    assert cut[1] == pytest.approx(full[1], rel=1e-6, abs=1e-7)
    assert set(cut[2]) == set(full[2])
    for name, g in full[2].items():
        torch.testing.assert_close(cut[2][name], g, rtol=1e-5, atol=1e-6, msg=name)


def test_drop_empty_blocks_keeps_one_block_when_no_row_has_any():
    from dspark_ds.drafters.dspark.step import drop_empty_blocks

    anchors = torch.zeros(2, 5, dtype=torch.long)
    cut, keep = drop_empty_blocks(anchors, anchors.bool())
    assert cut.shape == keep.shape == (2, 1) and not keep.any()


def test_drop_empty_blocks_resolves_per_device():
    assert PerfConfig().drops_empty_blocks("cpu")
    assert not PerfConfig().drops_empty_blocks("cuda")
    assert PerfConfig(drop_empty_blocks="on").drops_empty_blocks("cuda")
    assert not PerfConfig(drop_empty_blocks="off").drops_empty_blocks("cpu")
    with pytest.raises(ValueError, match="perf.drop_empty_blocks"):
        PerfConfig(drop_empty_blocks="yes")
