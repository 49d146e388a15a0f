"""Writing the offline target cache (data/cache.py: its layout): shards and their sidecars, the
build record, the manifest; `dspark-ds build-cache` over every rank, and `dspark-ds estimate
cache`, the bytes a build will write."""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import save as st_save
from tqdm import tqdm

from dspark_ds import distributed as dist
from dspark_ds.data.cache import (
    BUILD_SHARD,
    CACHE_FORMAT,
    CACHE_VERSION,
    CacheError,
    bytes_per_token,
    completed_shards,
    encode,
    read_json,
)
from dspark_ds.data.cache_repair import repair_shards
from dspark_ds.data.collate import FEATURE_KEYS, Collator, split_batch
from dspark_ds.data.config import BuildCacheConfig, EstimateCacheConfig
from dspark_ds.data.tokens import TokenStore, atomic_write_text, load_samples
from dspark_ds.errors import ConfigError
from dspark_ds.files import check_model_path
from dspark_ds.target import (
    FrozenTarget,
    TargetFeatureProvider,
    config_sha256,
    default_layer_ids,
    load_target,
    text_config,
    validate_layer_ids,
)
from dspark_ds.target_checkpoint import read_target_config


def write_shard(
    cache_dir: str | Path, name: str, samples: list[dict], storage: str, num_taps: int
) -> dict:
    """Write one shard (+ sidecar) atomically; ``samples`` in the order they are stored."""
    shard_dir = Path(cache_dir) / "shards"
    shard_dir.mkdir(parents=True, exist_ok=True)
    lengths = [len(s["input_ids"]) for s in samples]
    offsets = [0]
    for n in lengths[:-1]:
        offsets.append(offsets[-1] + n)
    tensors = {
        "input_ids": torch.cat([s["input_ids"] for s in samples]).to(torch.int32),
        "loss_mask": torch.cat([s["loss_mask"] for s in samples]).to(torch.uint8),
    }
    for key, groups in zip(FEATURE_KEYS, (num_taps, 1)):
        for suffix, t in encode(torch.cat([s[key] for s in samples]), groups, storage).items():
            tensors[key + suffix] = t
    blob = st_save(tensors)
    path = shard_dir / f"{name}.safetensors"
    tmp = shard_dir / f".{name}.safetensors.tmp{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(blob)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    sidecar = {
        "name": name,
        "file": f"shards/{name}.safetensors",
        "sample_ids": [int(s["sample_id"]) for s in samples],
        "lengths": lengths,
        "offsets": offsets,
        "num_tokens": sum(lengths),
        "bytes": len(blob),
        "sha256": hashlib.sha256(blob).hexdigest(),
    }
    atomic_write_text(shard_dir / f"{name}.json", json.dumps(sidecar))
    return sidecar


def make_header(target: FrozenTarget, store: TokenStore, storage: str) -> dict:
    tcfg = text_config(target.config)
    return {
        "format": CACHE_FORMAT,
        "version": CACHE_VERSION,
        "target": {
            "path": str(getattr(target, "name_or_path", "")),
            "config_sha256": config_sha256(target.config),
            "model_type": tcfg.model_type,
            "hidden_size": target.hidden_size,
            "num_hidden_layers": target.num_layers,
            "vocab_size": target.vocab_size,
        },
        "layer_ids": list(target.layer_ids),
        "hidden_size": target.hidden_size,
        "dtype": storage,
        "feature_dtype": str(target.dtype).removeprefix("torch."),
        "dataset": {
            "fingerprint": store.meta.get("fingerprint"),
            "num_samples": len(store),
            "num_tokens": int(sum(store.lengths)),
            "pad_token_id": store.meta.get("pad_token_id", 0),
        },
    }


def begin_build(cache_dir: str | Path, header: dict) -> bool:
    """Record ``header`` in ``build.json``; refuse a directory that holds another build.

    Returns True when the cache is already finalised for this exact build."""
    cache_dir = Path(cache_dir)
    cache_dir.mkdir(parents=True, exist_ok=True)
    build = cache_dir / "build.json"
    manifest = cache_dir / "manifest.json"
    if build.exists() and read_json(build) is None:
        # NOTE: the manifest repeats the header; without either nobody can tell what target
        # and data the shards were made from.
        m = read_json(manifest)
        if m is None or any(m.get(k) != v for k, v in header.items()):
            raise CacheError(
                f"{build} is unreadable and no intact manifest.json says what built the shards; "
                f"delete {cache_dir} and build the cache again"
            )
        atomic_write_text(build, json.dumps(header, indent=2, sort_keys=True))
    if build.exists():
        old = json.loads(build.read_text())
        if old != header:
            diff = sorted(k for k in set(old) | set(header) if old.get(k) != header.get(k))
            raise CacheError(
                f"{cache_dir} holds a cache of a different build (differs in "
                f"{diff}); use another cache_dir or delete it"
            )
    else:
        atomic_write_text(build, json.dumps(header, indent=2, sort_keys=True))
    m = read_json(manifest)  # an unreadable manifest is rewritten when the build finishes
    return m is not None and all(m.get(k) == v for k, v in header.items())


def finalize(cache_dir: str | Path) -> dict:
    """Check that the shards cover every sample exactly once; write ``manifest.json``."""
    cache_dir = Path(cache_dir)
    header = json.loads((cache_dir / "build.json").read_text())
    shards = list(completed_shards(cache_dir).values())
    n = header["dataset"]["num_samples"]
    seen = torch.zeros(n, dtype=torch.int64)
    for s in shards:
        seen[torch.tensor(s["sample_ids"], dtype=torch.int64)] += 1
    if (seen != 1).any():
        missing = (seen == 0).nonzero().flatten().tolist()
        dup = (seen > 1).nonzero().flatten().tolist()
        raise CacheError(
            f"{cache_dir}: shards do not cover the data set exactly once "
            f"(missing samples {missing[:10]}…, duplicated {dup[:10]}…)"
        )
    manifest = {
        **header,
        "num_samples": n,
        "num_tokens": sum(s["num_tokens"] for s in shards),
        "total_bytes": sum(s["bytes"] for s in shards),
        "shards": shards,
    }
    atomic_write_text(cache_dir / "manifest.json", json.dumps(manifest, indent=1, sort_keys=True))
    return manifest


def compute_features(
    provider: Callable[[dict], dict],
    store: TokenStore,
    sample_ids: list[int],
    batch_size: int,
    pad_token_id: int = 0,
) -> dict[int, dict]:
    """Run the target over ``sample_ids`` (longest first, fixed batches) → per-sample features."""
    collate = Collator(pad_token_id)
    order = sorted(sample_ids, key=lambda i: (-store.lengths[i], i))
    out = {}
    for k in range(0, len(order), batch_size):
        batch = provider(collate([store[i] for i in order[k : k + batch_size]]))
        for s in split_batch(batch):
            out[s["sample_id"]] = s
    return out


# ---------------------------------------------------------------- build-cache


def _covered(cache_dir: str | Path, num_samples: int) -> bool:
    seen = {i for s in completed_shards(cache_dir).values() for i in s["sample_ids"]}
    return len(seen) == num_samples


def _repair(cache_dir: Path, num_samples: int, per_shard: int) -> dict[str, list[int]]:
    """--repair: removes every damaged shard; returns the non-build ones to re-make by id."""
    bad, remake = repair_shards(cache_dir, num_samples, per_shard)
    shown = "; ".join(bad.values()) if len(bad) <= 5 else f"{len(bad)} shards"
    dist.log(
        f"[build-cache] repair: {len(bad)} damaged shard(s) removed"
        + (f" ({shown}); re-making them" if bad else "")
    )
    dist.barrier()
    return remake


def _shard_jobs(
    cache_dir: Path, num_samples: int, per_shard: int, rank: int, world: int, remake: dict
) -> tuple[list[tuple[str, list[int]]], int]:
    """(shard name, sample ids) this rank still has to write, and how many of its shards are
    complete already."""
    num_shards = math.ceil(num_samples / per_shard)
    done = completed_shards(cache_dir)
    # a hybrid-mode cache (h<rank>-<k> shards) is repaired shard by shard, never re-laid out
    hybrid = bool(remake) or any(not BUILD_SHARD.match(n) for n in done)
    mine = [] if hybrid else list(range(rank, num_shards, world))
    jobs = [
        (f"{k:06d}", list(range(k * per_shard, min(num_samples, (k + 1) * per_shard))))
        for k in mine
        if f"{k:06d}" not in done
    ] + sorted(remake.items())
    return jobs, len(mine) + len(remake) - len(jobs)


def _finish(cache_dir: Path, num_samples: int, rank: int) -> dict | None:
    """Rank 0 writes the manifest (without a process group: the rank that finds every sample
    covered); returns it, or None."""
    if not (rank == 0 or not dist.has_group()):
        return None
    if not (dist.has_group() or _covered(cache_dir, num_samples)):
        dist.log(
            "[build-cache] other ranks still running; the last one to finish writes the manifest"
        )
        return None
    manifest = finalize(cache_dir)
    dist.log(
        f"[build-cache] manifest written: {manifest['num_samples']} samples, "
        f"{manifest['total_bytes'] / 2**20:.1f} MiB in {len(manifest['shards'])} shards"
    )
    return manifest


def build_cache(
    cfg: BuildCacheConfig, on_shard_written: Callable[[dict], None] | None = None
) -> dict | None:
    """``dspark-ds build-cache``: every rank writes its shards; returns the manifest (rank 0).

    Shard ``k`` holds samples ``[k·S, (k+1)·S)`` and belongs to rank ``k % world``, so the cache
    does not depend on how many ranks built it, and a rerun skips completed shards. With
    ``cfg.repair`` every shard is checked first and the bad ones are re-made (the same bytes a
    clean build writes)."""
    if not cfg.data.cache_dir:
        raise ConfigError("data.cache_dir is required (the output directory)")
    check_model_path(cfg.target.path, "target.path")
    dist.init("gloo", always=False, settings=cfg.distributed)
    rank, world = dist.rank_and_world()
    cache_dir = Path(cfg.data.cache_dir)
    store = load_samples(cfg.data, cfg.target.path)
    target = load_target(cfg.target)
    storage = cfg.data.cache_dtype if cfg.data.cache_dtype != "auto" else cfg.target.dtype
    header = make_header(target, store, storage)
    if begin_build(cache_dir, header) and not cfg.repair:
        dist.print0(
            f"[build-cache] {cache_dir} is already complete (--repair true checks every "
            "shard's sha256 and re-makes damaged ones)"
        )
        return json.loads((cache_dir / "manifest.json").read_text())
    per_shard = cfg.data.samples_per_shard
    remake = _repair(cache_dir, len(store), per_shard) if cfg.repair else {}
    jobs, skipped = _shard_jobs(cache_dir, len(store), per_shard, rank, world, remake)
    provider = TargetFeatureProvider(target)
    pad = header["dataset"]["pad_token_id"]
    written = 0
    bar = tqdm(
        total=sum(len(ids) for _, ids in jobs),
        desc=f"build-cache rank {rank}",
        unit="sample",
        disable=rank != 0,
    )
    for name, ids in jobs:
        feats = compute_features(provider, store, ids, cfg.batch_size, pad)
        sidecar = write_shard(
            cache_dir, name, [feats[i] for i in ids], storage, len(target.layer_ids)
        )
        written += 1
        bar.update(len(ids))
        if on_shard_written is not None:
            on_shard_written(sidecar)
    bar.close()
    dist.log(f"[build-cache] shards written: {written}, already complete: {skipped}")
    dist.barrier()
    manifest = _finish(cache_dir, len(store), rank)
    dist.barrier()
    return manifest


# ---------------------------------------------------------------- estimate


def estimate_cache(cfg: EstimateCacheConfig) -> dict:
    """``dspark-ds estimate cache``: bytes a cache will take, without running the target."""
    if not cfg.target.path:
        raise ConfigError("target.path is required (only its config.json is read)")
    tcfg = text_config(
        read_target_config(
            cfg.target.path,
            revision=cfg.target.revision,
            trust_remote_code=cfg.target.trust_remote_code,
        )
    )
    layers = cfg.target.layer_ids or default_layer_ids(tcfg.num_hidden_layers)
    validate_layer_ids(layers, tcfg.num_hidden_layers, field="target.layer_ids")
    if cfg.num_samples is not None and cfg.mean_tokens is not None:
        num_samples, num_tokens = cfg.num_samples, int(round(cfg.num_samples * cfg.mean_tokens))
    else:
        store = load_samples(cfg.data, cfg.target.path)
        num_samples, num_tokens = len(store), int(sum(store.lengths))
    per_token = bytes_per_token(tcfg.hidden_size, len(layers), cfg.dtype)
    total = num_tokens * per_token
    result = {
        "num_samples": num_samples,
        "num_tokens": num_tokens,
        "hidden_size": tcfg.hidden_size,
        "layer_ids": layers,
        "dtype": cfg.dtype,
        "bytes_per_token": per_token,
        "total_bytes": total,
        "human": human_bytes(total),
    }
    dist.print0(
        f"[estimate cache] {num_samples} samples, {num_tokens} tokens x {per_token} "
        f"B/token ({len(layers)} layers + final state, H={tcfg.hidden_size}, "
        f"{cfg.dtype}) = {result['human']}"
    )
    return result


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if n < 1024 or unit == "PiB":
            return f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} PiB"
