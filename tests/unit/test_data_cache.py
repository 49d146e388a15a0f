"""The offline target cache: contents, refusals, resumable builds, rank independence, fp8."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch

from dspark_ds.data.cache import CacheError, TargetCache, bytes_per_token
from dspark_ds.data.cache_writer import build_cache, estimate_cache
from dspark_ds.data.config import BuildCacheConfig, DataConfig, EstimateCacheConfig
from dspark_ds.data.loader import build_train_loader
from dspark_ds.data.tokens import TokenStore
from dspark_ds.target import TargetConfig, load_target

from helpers.tiny_models import prepare_chat

LAYERS = [-1, 1, 2]


@pytest.fixture(scope="module")
def env(tmp_path_factory, tiny_target):
    root = tmp_path_factory.mktemp("cache")
    prepare_chat(root, 14, seed=1, tokenizer=tiny_target, max_length=64)
    return root, tiny_target


def make_cfg(env, cache_dir, dtype="float32", per_shard=4):
    root, target = env
    data = DataConfig(
        paths=[str(root / "prep")],
        mode="offline",
        cache_dir=str(cache_dir),
        cache_dtype=dtype,
        samples_per_shard=per_shard,
        num_workers=0,
    )
    return BuildCacheConfig(
        data=data, target=TargetConfig(path=target, layer_ids=LAYERS, dtype="float32"), batch_size=3
    )


@pytest.fixture(scope="module")
def built(env, tmp_path_factory):
    cache_dir = tmp_path_factory.mktemp("built") / "cache"
    manifest = build_cache(make_cfg(env, cache_dir))
    return cache_dir, manifest


def files_of(d: Path) -> dict[str, bytes]:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def test_cache_holds_the_targets_features(env, built):
    root, target_dir = env
    cache_dir, manifest = built
    store = TokenStore.load(root / "prep")
    assert manifest["num_samples"] == len(store) == 14 and len(manifest["shards"]) == 4
    assert manifest["layer_ids"] == LAYERS and manifest["hidden_size"] == 32
    assert (
        manifest["target"]["vocab_size"] == 384 and len(manifest["target"]["config_sha256"]) == 64
    )
    for shard in manifest["shards"]:
        assert len(shard["sha256"]) == 64 and shard["lengths"] == [
            store.lengths[i] for i in shard["sample_ids"]
        ]
    cache = TargetCache(cache_dir)
    target = load_target(TargetConfig(path=target_dir, layer_ids=LAYERS, dtype="float32"))
    for i in (0, 7, 13):
        s = cache[i]
        assert torch.equal(s["input_ids"], store[i]["input_ids"])
        assert torch.equal(s["loss_mask"], store[i]["loss_mask"])
        hidden, last = target(s["input_ids"][None])
        torch.testing.assert_close(s["target_hidden_states"], hidden[0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(s["target_last_hidden_states"], last[0], atol=1e-5, rtol=1e-5)


def test_refuses_damaged_or_mismatched_cache(env, built, tmp_path):
    src, _ = built
    cache = TargetCache(src)
    with pytest.raises(CacheError, match="target_layer_ids is .*expects \\[-1, 1, 3\\]"):
        cache.check_compatible(layer_ids=[-1, 1, 3])
    with pytest.raises(CacheError, match="hidden size is 32, .*expects 64"):
        cache.check_compatible(hidden_size=64)
    with pytest.raises(CacheError, match="vocab size"):
        cache.check_compatible(vocab_size=500)
    cache.check_compatible(hidden_size=32, layer_ids=LAYERS, vocab_size=384)
    data = make_cfg(env, src).data
    with pytest.raises(CacheError, match="target_layer_ids"):  # refused before any training
        build_train_loader(data, 0, 1, None, hidden_size=32, layer_ids=[-1, 2], vocab_size=384)

    def damaged(how, tag=""):
        d = tmp_path / (how + tag)
        shutil.copytree(src, d)
        shard = d / "shards" / "000002.safetensors"
        blob = bytearray(shard.read_bytes())
        if how == "missing":
            shard.unlink()
        elif how == "truncated":
            shard.write_bytes(blob[:-100])
        elif how == "corrupt":
            blob[-5] ^= 0xFF
            shard.write_bytes(bytes(blob))
        elif how == "no_manifest":
            (d / "manifest.json").unlink()
        return d

    for how, why in (
        ("missing", "shards/000002.safetensors is missing"),
        ("truncated", "shards/000002.safetensors is truncated"),
        ("corrupt", "shards/000002.safetensors fails its sha256"),
        ("no_manifest", "no manifest.json"),
    ):
        with pytest.raises(CacheError, match=why):
            TargetCache(damaged(how))
    # verify="size" (for multi-TB caches) skips hashing: a same-size corruption gets through.
    assert len(TargetCache(damaged("corrupt", "_size_only"), verify="size")) == 14


def test_repair_remakes_exactly_the_damaged_shards(env, built, tmp_path):
    reference, _ = built
    cache_dir = tmp_path / "cache"
    shutil.copytree(reference, cache_dir)
    shards = cache_dir / "shards"
    blob = bytearray((shards / "000001.safetensors").read_bytes())
    blob[-5] ^= 0xFF  # same size: only the checksum sees it
    (shards / "000001.safetensors").write_bytes(bytes(blob))
    (shards / "000002.safetensors").write_bytes(blob[:100])  # truncated
    (cache_dir / "manifest.json").write_text('{"format": "dspark-ds-tar')  # torn
    cfg = make_cfg(env, cache_dir)

    # the loader names the damage and the way out
    with pytest.raises(CacheError, match=r"manifest\.json is unreadable.*--repair true"):
        TargetCache(cache_dir)
    # a plain rerun trusts sizes: it re-makes the truncated shard, keeps the corrupted one, and
    # the reader then refuses it, naming the repair
    build_cache(cfg, on_shard_written=lambda s: None)
    with pytest.raises(CacheError, match=r"000001\.safetensors fails its sha256.*--repair true"):
        TargetCache(cache_dir)
    (shards / "000003.safetensors").unlink()
    (shards / "000000.json").write_text("{")  # an unreadable sidecar: its shard is not trusted

    written = []
    repair = dataclasses.replace(cfg, repair=True)
    manifest = build_cache(repair, on_shard_written=lambda s: written.append(s["name"]))
    assert sorted(written) == ["000000", "000001", "000003"]  # exactly the bad ones
    assert files_of(cache_dir) == files_of(reference)  # byte-identical to a clean build
    assert manifest == json.loads((reference / "manifest.json").read_text())
    written.clear()
    build_cache(repair, on_shard_written=lambda s: written.append(s["name"]))
    assert written == [] and len(TargetCache(cache_dir)) == 14


def test_two_ranks_repair_their_own_shards(env, built, tmp_path, monkeypatch):
    reference, _ = built
    cache_dir = tmp_path / "cache"
    shutil.copytree(reference, cache_dir)
    for k in (1, 2):  # one shard of each rank
        shard = cache_dir / "shards" / f"00000{k}.safetensors"
        shard.write_bytes(shard.read_bytes()[:-1] + b"!")
    repair = dataclasses.replace(make_cfg(env, cache_dir), repair=True)
    monkeypatch.setenv("WORLD_SIZE", "2")
    written = []
    for rank in (1, 0):  # no process group: the ranks agree through the files
        monkeypatch.setenv("RANK", str(rank))
        build_cache(repair, on_shard_written=lambda s, r=rank: written.append((r, s["name"])))
    assert written == [(1, "000001"), (0, "000002")]  # each rank re-makes its own shard
    assert files_of(cache_dir) == files_of(reference)


def test_interrupted_build_resumes_to_identical_cache(env, built, tmp_path):
    reference, _ = built
    cache_dir = tmp_path / "cache"
    cfg = make_cfg(env, cache_dir)

    def crash_after_two(sidecar):
        if sidecar["name"] == "000001":
            raise KeyboardInterrupt("killed")

    with pytest.raises(KeyboardInterrupt):
        build_cache(cfg, on_shard_written=crash_after_two)
    assert not (cache_dir / "manifest.json").exists()
    with pytest.raises(CacheError, match="no manifest"):
        TargetCache(cache_dir)
    # A kill in the middle of the next shard leaves a temp file behind.
    (cache_dir / "shards" / ".000002.safetensors.tmp123").write_bytes(b"half a shard")
    written = []
    build_cache(cfg, on_shard_written=lambda s: written.append(s["name"]))
    assert written == ["000002", "000003"]  # completed shards are not recomputed
    got = {k: v for k, v in files_of(cache_dir).items() if ".tmp" not in k}
    assert got == files_of(reference)


def test_two_ranks_build_the_same_cache_as_one(env, built, tmp_path, monkeypatch):
    reference, _ = built
    cfg = make_cfg(env, tmp_path / "cache")
    monkeypatch.setenv("WORLD_SIZE", "2")
    for rank in (1, 0):  # plain env-var ranks: the last one to finish writes the manifest
        monkeypatch.setenv("RANK", str(rank))
        manifest = build_cache(cfg)
        assert (manifest is None) == (rank == 1)
    assert files_of(tmp_path / "cache") == files_of(reference)


def test_batch_shell_builds_every_shard(env, built, tmp_path, monkeypatch):
    # The batch script of an `sbatch --ntasks 4` job sees SLURM_PROCID=0 and SLURM_NTASKS=4
    # but is one process: it must build the whole cache, not every 4th shard (the data tools
    # and the trainer share one rank discovery, dspark_ds.distributed).
    reference, _ = built
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("SLURM_PROCID", "0")
    monkeypatch.setenv("SLURM_NTASKS", "4")
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    manifest = build_cache(make_cfg(env, tmp_path / "cache"))
    assert manifest is not None and len(manifest["shards"]) == 4
    assert files_of(tmp_path / "cache") == files_of(reference)


def test_build_refuses_a_directory_of_another_build(env, built):
    cache_dir, _ = built
    cfg = make_cfg(env, cache_dir)
    cfg.target.layer_ids = [-1, 2]
    with pytest.raises(CacheError, match="different build .*layer_ids"):
        build_cache(cfg)


def test_fp8_halves_bf16_and_stays_close(env, built, tmp_path):
    ref_dir, ref_manifest = built
    manifest = build_cache(make_cfg(env, tmp_path / "fp8", dtype="fp8"))
    bf16 = build_cache(make_cfg(env, tmp_path / "bf16", dtype="bfloat16"))
    feats = ref_manifest["num_tokens"] * (len(LAYERS) + 1) * 32
    assert manifest["total_bytes"] < 0.6 * bf16["total_bytes"]
    assert bytes_per_token(2560, 5, "fp8") / bytes_per_token(2560, 5, "bfloat16") < 0.51
    assert bf16["total_bytes"] - manifest["total_bytes"] > 0.8 * feats  # ~1 byte per feature
    ref, q = TargetCache(ref_dir), TargetCache(tmp_path / "fp8")
    for i in range(len(ref)):
        a, b = ref[i]["target_hidden_states"], q[i]["target_hidden_states"]
        assert b.dtype == torch.float32 and b.shape == a.shape
        rel = (a - b).norm() / a.norm()
        assert rel < 0.05  # e4m3 has a 3-bit mantissa: ~2-4 % relative error
        assert torch.equal(ref[i]["input_ids"], q[i]["input_ids"])


def test_estimate_matches_the_built_size(env, built):
    cache_dir, manifest = built
    cfg = make_cfg(env, cache_dir)
    est = estimate_cache(EstimateCacheConfig(data=cfg.data, target=cfg.target, dtype="float32"))
    assert est["num_tokens"] == manifest["num_tokens"]
    header_overhead = 1024 * len(manifest["shards"])
    assert est["total_bytes"] <= manifest["total_bytes"] <= est["total_bytes"] + header_overhead
    quick = estimate_cache(
        dataclasses.replace(
            EstimateCacheConfig(target=cfg.target, dtype="bfloat16"),
            num_samples=1000,
            mean_tokens=10.0,
        )
    )
    assert quick["total_bytes"] == 10_000 * (4 + 1 + 4 * 32 * 2)
    assert json.loads(json.dumps(quick))["human"].endswith("MiB")


def test_the_token_counts_of_a_cache_are_those_of_its_data(env, built, tmp_path):
    """A draft vocabulary counted from the cache (offline) or from its prepared data (online)
    is the same; the counts are written beside each."""
    import shutil
    from types import SimpleNamespace

    from dspark_ds.data.vocab_counts import COUNTS_FILE, token_counts

    root, _ = env
    prep = shutil.copytree(root / "prep", tmp_path / "prep")
    cache_dir = shutil.copytree(built[0], tmp_path / "cache")
    online = SimpleNamespace(samples=TokenStore.load(prep), cache=None)
    offline = SimpleNamespace(samples=None, cache=TargetCache(cache_dir))
    want = token_counts(online, 384, tmp_path / "run")
    assert torch.equal(token_counts(offline, 384, tmp_path / "run"), want) and int(want.sum()) > 0
    assert (prep / COUNTS_FILE).is_file() and (cache_dir / COUNTS_FILE).is_file()
    # the cache still opens and verifies with the file beside its shards
    assert len(TargetCache(cache_dir)) == 14
