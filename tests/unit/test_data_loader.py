"""The training loader: deterministic order, resume, and offline == online == hybrid batches."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from dspark_ds.data.cache import CacheError, TargetCache
from dspark_ds.data.cache_writer import build_cache
from dspark_ds.data.config import BuildCacheConfig, DataConfig
from dspark_ds.data.loader import build_train_loader, epoch_batches
from dspark_ds.target import TargetConfig, load_target, share_embeddings_and_head

from helpers.drafters import tiny_dspark_config
from helpers.tiny_models import prepare_chat

LAYERS = [-1, 1, 2]
N = 16  # samples after prepare (max_length 72 keeps >= 2 assistant tokens in each)


def test_epoch_batches_deterministic_disjoint_and_balanced():
    lengths = [(7 * i) % 50 + 3 for i in range(103)]
    per_rank = [epoch_batches(lengths, 4, r, 3, seed=5, epoch=2) for r in range(3)]
    assert per_rank[1] == epoch_batches(lengths, 4, 1, 3, seed=5, epoch=2)
    assert per_rank[1] != epoch_batches(lengths, 4, 1, 3, seed=5, epoch=3)
    assert per_rank[1] != epoch_batches(lengths, 4, 1, 3, seed=6, epoch=2)
    assert len({len(b) for b in per_rank}) == 1 and len(per_rank[0]) == 103 // 12
    flat = [i for r in per_rank for b in r for i in b]
    assert len(flat) == len(set(flat)) == 8 * 12  # each sample at most once per epoch
    assert all(len(b) == 4 for r in per_rank for b in r)

    def padding(batches):
        return sum(
            len(b) * max(lengths[i] for i in b) - sum(lengths[i] for i in b) for b in batches
        )

    grouped = epoch_batches(lengths, 4, 0, 1, seed=0, epoch=0, length_grouping=64)
    plain = epoch_batches(lengths, 4, 0, 1, seed=0, epoch=0, length_grouping=1)
    assert sorted(i for b in grouped for i in b) == sorted(i for b in plain for i in b)
    assert padding(grouped) < padding(plain) / 3


@pytest.fixture(scope="module")
def env(tmp_path_factory, tiny_target):
    root = tmp_path_factory.mktemp("loader")
    prep = prepare_chat(root, 16, seed=2, tokenizer=tiny_target, max_length=72)
    data = DataConfig(
        paths=[str(prep)],
        mode="offline",
        cache_dir=str(root / "cache"),
        batch_size=3,
        num_workers=0,
        samples_per_shard=5,
        seed=11,
    )
    tcfg = TargetConfig(path=tiny_target, layer_ids=LAYERS, dtype="float32")
    build_cache(BuildCacheConfig(data=data, target=tcfg, batch_size=4))
    assert len(TargetCache(data.cache_dir)) == N
    return root, data, load_target(tcfg)


def run_epochs(loader, epochs=(0, 1)):
    out = []
    for e in epochs:
        loader.set_epoch(e)
        out += [{k: v.clone() for k, v in b.items()} for b in loader]
    return out


def assert_same_batches(xs, ys):
    assert len(xs) == len(ys) > 0
    for x, y in zip(xs, ys):
        assert x.keys() == y.keys()
        for k in x:
            if x[k].dtype.is_floating_point:
                assert x[k].dtype == y[k].dtype
                torch.testing.assert_close(x[k], y[k], atol=1e-5, rtol=1e-5)
            else:
                assert torch.equal(x[k], y[k]), k


def step_loss(batch, target, seed=0):
    """One DSpark training step (forward + loss + backward) on a drafter sharing the target's
    embedding and lm_head; returns the loss."""
    from dspark_ds.drafters import build_draft_model
    from dspark_ds.drafters.dspark.config import DSPARK_LOSS
    from dspark_ds.drafters.dspark.loss import compute_dspark_loss

    torch.manual_seed(seed)
    drafter = build_draft_model(tiny_dspark_config(target.config, LAYERS))
    share_embeddings_and_head(drafter, target)
    out = drafter(
        batch["input_ids"],
        batch["target_hidden_states"],
        batch["loss_mask"],
        batch["target_last_hidden_states"],
        generator=torch.Generator().manual_seed(seed),
    )
    loss, metrics = compute_dspark_loss(out, **dataclasses.asdict(DSPARK_LOSS))
    loss.backward()
    assert drafter.fc.weight.grad is not None and target.embed_weight.grad is None
    return loss.item()


def test_offline_online_hybrid_give_identical_batches_and_loss(env, tmp_path, tiny_target):
    root, data, target = env
    offline = run_epochs(
        build_train_loader(data, 0, 1, None, hidden_size=32, layer_ids=LAYERS, vocab_size=384)
    )
    online = run_epochs(
        build_train_loader(dataclasses.replace(data, mode="online"), 0, 1, target, layer_ids=LAYERS)
    )
    hybrid_cfg = dataclasses.replace(
        data, mode="hybrid", cache_dir=str(tmp_path / "hyb"), samples_per_shard=2
    )
    hybrid_loader = build_train_loader(hybrid_cfg, 0, 1, target)
    assert [hybrid_loader.source_for(e) for e in (0, 1)] == ["target", "cache"]
    hybrid = run_epochs(hybrid_loader)
    assert_same_batches(offline, online)
    assert_same_batches(offline, hybrid)
    assert offline[0]["target_hidden_states"].shape[-1] == 3 * 32
    assert all(b["loss_mask"].sum() > 0 for b in offline)
    assert any((b["attention_mask"] == 0).any() for b in offline)  # padded batches compared too
    # The hybrid run left a complete cache with the same features as build-cache's.
    a, b = TargetCache(data.cache_dir), TargetCache(tmp_path / "hyb")
    assert len(a) == len(b) == N
    for i in range(N):
        torch.testing.assert_close(
            a[i]["target_hidden_states"], b[i]["target_hidden_states"], atol=1e-5, rtol=1e-5
        )
    losses = [step_loss(batches[1], target) for batches in (offline, online, hybrid)]
    assert losses[0] == pytest.approx(losses[1], rel=1e-5) == pytest.approx(losses[2], rel=1e-5)
    assert losses[0] > 0

    # a damaged hybrid shard is re-made by build-cache --repair from the samples its sidecar lists
    shard = sorted((tmp_path / "hyb" / "shards").glob("h*.safetensors"))[1]
    blob = bytearray(shard.read_bytes())
    blob[-3] ^= 0xFF
    shard.write_bytes(bytes(blob))
    with pytest.raises(CacheError, match=f"{shard.name} fails its sha256.*--repair true"):
        TargetCache(tmp_path / "hyb")
    tcfg = TargetConfig(path=tiny_target, layer_ids=LAYERS, dtype="float32")
    repair = BuildCacheConfig(data=dataclasses.replace(hybrid_cfg, mode="offline"), target=tcfg)
    build_cache(dataclasses.replace(repair, repair=True))
    b = TargetCache(tmp_path / "hyb")
    assert sorted(s["name"] for s in b.manifest["shards"]) == sorted(
        p.stem for p in (tmp_path / "hyb" / "shards").glob("h*.safetensors")
    )
    for i in range(N):
        torch.testing.assert_close(
            a[i]["target_hidden_states"], b[i]["target_hidden_states"], atol=1e-5, rtol=1e-5
        )


def test_resume_continues_the_same_order(env):
    _, data, _ = env
    cfg = dataclasses.replace(data, batch_size=2)
    full = run_epochs(build_train_loader(cfg, 0, 1), epochs=(0, 1))
    first = build_train_loader(cfg, 0, 1)
    first.set_epoch(0)
    it = iter(first)
    seen = [next(it)["sample_ids"].clone() for _ in range(4)]
    state = first.state_dict()
    assert state["epoch"] == 0 and state["position"] == 4
    second = build_train_loader(cfg, 0, 1)
    second.load_state_dict(state)
    second.set_epoch(0)  # the trainer re-enters the epoch it stopped in
    rest = run_epochs(second, epochs=(0, 1))
    assert [b["sample_ids"].tolist() for b in full] == [s.tolist() for s in seen] + [
        b["sample_ids"].tolist() for b in rest
    ]
    with pytest.raises(ValueError, match="world_size"):
        second.load_state_dict({**state, "world_size": 2})


def test_workers_and_ranks(env):
    _, data, _ = env
    zero = run_epochs(build_train_loader(data, 1, 2), epochs=(0,))
    two = run_epochs(
        build_train_loader(dataclasses.replace(data, num_workers=2), 1, 2), epochs=(0,)
    )
    assert_same_batches(zero, two)
    other = run_epochs(build_train_loader(data, 0, 2), epochs=(0,))
    assert len(other) == len(zero) == N // 6
    ids0 = {i for b in other for i in b["sample_ids"].tolist()}
    ids1 = {i for b in zero for i in b["sample_ids"].tolist()}
    assert not ids0 & ids1


def test_hybrid_resumed_mid_epoch_still_completes_the_cache(env, tmp_path):
    _, data, target = env
    cfg = dataclasses.replace(
        data, mode="hybrid", cache_dir=str(tmp_path / "hyb"), samples_per_shard=2
    )
    first = build_train_loader(cfg, 0, 1, target)
    first.set_epoch(0)
    it = iter(first)
    for _ in range(2):
        next(it)  # then the job dies: buffered samples are lost
    state = first.state_dict()
    del it, first
    second = build_train_loader(cfg, 0, 1, target)
    second.load_state_dict(state)
    epoch0_rest = run_epochs(second, epochs=(0,))
    assert len(epoch0_rest) == N // 3 - 2
    cache = TargetCache(tmp_path / "hyb")
    ref = TargetCache(data.cache_dir)
    assert len(cache) == N
    for i in range(N):
        assert torch.equal(cache[i]["input_ids"], ref[i]["input_ids"])
        torch.testing.assert_close(
            cache[i]["target_last_hidden_states"],
            ref[i]["target_last_hidden_states"],
            atol=1e-5,
            rtol=1e-5,
        )
