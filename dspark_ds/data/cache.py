"""The offline target cache: sharded safetensors + a manifest; writer, reader, build, estimate.

Layout of ``cache_dir``::

    build.json                 what is being built (target, layers, dtype, data fingerprint)
    shards/<name>.safetensors  flat per-token tensors of the samples of one shard
    shards/<name>.json         the shard's sidecar: sample ids, lengths, offsets, bytes, sha256
    manifest.json              written last, atomically: build.json + every sidecar

A shard holds ``input_ids`` (int32 [T]), ``loss_mask`` (uint8 [T]), ``target_hidden_states``
([T, n*H]) and ``target_last_hidden_states`` ([T, H]) in the storage dtype; with fp8 the features
are float8_e4m3fn plus ``<name>_scale`` (fp32, one scale per token and tapped layer).
A shard and its sidecar appear atomically (temp file + rename), and a sidecar only after its
shard: a shard with a sidecar is complete, so an interrupted build resumes shard by shard.
``build-cache --repair true`` checks every shard against its sidecar (size and sha256) and
re-makes exactly the bad or missing ones, then rewrites the manifest.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save as st_save
from tqdm import tqdm

from dspark_ds import distributed as dist
from dspark_ds.data.collate import FEATURE_KEYS, Collator, split_batch
from dspark_ds.data.config import BuildCacheConfig, EstimateCacheConfig
from dspark_ds.data.tokens import TokenStore, atomic_write_text, load_samples
from dspark_ds.errors import ConfigError
from dspark_ds.files import check_model_path, sha256_file
from dspark_ds.target import FrozenTarget, TargetFeatureProvider, config_sha256, text_config

CACHE_FORMAT = "dspark-ds-target-cache"
CACHE_VERSION = 1
FP8_MAX = 448.0  # largest finite float8_e4m3fn
_FLOAT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_BUILD_SHARD = re.compile(r"^\d{6}$")  # build-cache's shard k; hybrid mode writes h<rank>-<k>
REPAIR_HINT = (
    "rerun `dspark-ds build-cache` with the cache's arguments and --repair true to re-make the "
    "damaged shards"
)


class CacheError(ConfigError):
    """A cache that cannot be used as is (missing, corrupt or built for something else)."""


def read_json(path: Path) -> dict | None:
    """A JSON object file, or None when it is missing or unreadable (torn, corrupted)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


# ---------------------------------------------------------------- storage encoding


def encode(x: torch.Tensor, num_groups: int, storage: str) -> dict[str, torch.Tensor]:
    """``x [T, num_groups*H]`` → tensors to store (fp8: e4m3 + per-token, per-group scale)."""
    if storage != "fp8":
        return {"": x.to(_FLOAT_DTYPES[storage]).contiguous()}
    xg = x.float().reshape(x.shape[0], num_groups, -1)
    scale = (xg.abs().amax(-1) / FP8_MAX).clamp_min(1e-12)
    q = (xg / scale.unsqueeze(-1)).to(torch.float8_e4m3fn)
    return {"": q.reshape(x.shape).contiguous(), "_scale": scale.contiguous()}


def decode(q: torch.Tensor, scale: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    if scale is None:
        return q.to(out_dtype)
    t, g = scale.shape
    return (q.float().reshape(t, g, -1) * scale.unsqueeze(-1)).reshape(q.shape).to(out_dtype)


def bytes_per_token(hidden_size: int, num_taps: int, storage: str) -> int:
    """Bytes one token takes in a cache: ids (4) + mask (1) + (n+1)·H features (+ fp8 scales)."""
    elt = {"float32": 4, "bfloat16": 2, "float16": 2, "fp8": 1}[storage]
    scales = (num_taps + 1) * 4 if storage == "fp8" else 0
    return 4 + 1 + (num_taps + 1) * hidden_size * elt + scales


# ---------------------------------------------------------------- writing


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


def completed_shards(cache_dir: str | Path) -> dict[str, dict]:
    """Readable sidecars whose shard file is present with the recorded size (complete shards;
    only `--repair` also checks their sha256)."""
    out = {}
    for side in sorted((Path(cache_dir) / "shards").glob("*.json")):
        meta = read_json(side)
        if meta is None or shard_problem(cache_dir, meta, "size") is not None:
            continue
        out[meta["name"]] = meta
    return out


def shard_problem(cache_dir: str | Path, meta: dict, verify: str = "sha256") -> str | None:
    """What is wrong with the shard a sidecar (or manifest entry) describes, or None.
    verify: "size" checks presence and size only, "sha256" also the checksum."""
    try:
        rel, size, digest = meta["file"], int(meta["bytes"]), meta["sha256"]
    except (KeyError, TypeError, ValueError):
        return f"shard {meta.get('name', '?')} has an unreadable record"
    path = Path(cache_dir) / rel
    if not path.exists():
        return f"shard {rel} is missing"
    if (have := path.stat().st_size) != size:
        return f"shard {rel} is truncated or altered ({have} bytes, its record says {size})"
    if verify == "sha256" and sha256_file(path) != digest:
        return f"shard {rel} fails its sha256 checksum"
    return None


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


def _owner(name: str, index: int, world: int) -> int:
    """The rank that checks and re-makes a shard: shard k's builder for build-cache shards (so
    ranks without a process group agree), else by position in the sorted list."""
    return int(name) % world if _BUILD_SHARD.match(name) else index % world


def _shard_names(cache_dir: Path, manifest: dict) -> list[str]:
    """Every shard name a file, a temp file, a sidecar or the manifest mentions."""
    names = {s.get("name") for s in manifest.get("shards", []) if isinstance(s, dict)}
    for p in (cache_dir / "shards").glob("*"):
        m = re.match(r"^\.?(.+?)\.(safetensors|json)(\.tmp\d+)?$", p.name)
        if m:
            names.add(m.group(1))
    return sorted(n for n in names if isinstance(n, str))


def repair_shards(
    cache_dir: str | Path, num_samples: int, per_shard: int
) -> tuple[dict[str, str], dict[str, list[int]]]:
    """``--repair``: check this rank's share of the shards (sidecar, size, sha256, samples) and
    delete every bad one with its sidecar and any temp files. Returns (bad shard -> what was
    wrong, hybrid shard -> the sample ids to re-make it with); build-cache shards come back
    through the ordinary build, which re-makes every shard that is missing."""
    rank, world = dist.rank_and_world()
    cache_dir = Path(cache_dir)
    shards = cache_dir / "shards"
    manifest = read_json(cache_dir / "manifest.json") or {}
    listed = {s.get("name"): s for s in manifest.get("shards", []) if isinstance(s, dict)}
    bad: dict[str, str] = {}
    remake: dict[str, list[int]] = {}
    for index, name in enumerate(_shard_names(cache_dir, manifest)):
        if _owner(name, index, world) != rank:
            continue
        side = read_json(shards / f"{name}.json")
        if _BUILD_SHARD.match(name):
            k = int(name)
            ids = list(range(k * per_shard, min(num_samples, (k + 1) * per_shard)))
        else:
            known = side or listed.get(name) or {}
            ids = known.get("sample_ids")
        if side is None:
            problem = f"shard {name} has no readable sidecar ({name}.json)"
        elif side.get("sample_ids") != ids:
            problem = f"shard {name} holds other samples than shard {name} of this build"
        else:
            problem = shard_problem(cache_dir, side, "sha256")
        leftovers = list(shards.glob(f".{name}.*.tmp*"))
        if problem is None:
            for p in leftovers:
                p.unlink(missing_ok=True)
            continue
        if not ids:
            raise CacheError(
                f"{cache_dir}: {problem}, and nothing records which samples it held; delete "
                f"{cache_dir} and build the cache again"
            )
        bad[name] = problem
        if not _BUILD_SHARD.match(name):
            remake[name] = list(ids)
        # NOTE: the sidecar goes first: a shard without one counts as not built
        for p in [shards / f"{name}.json", shards / f"{name}.safetensors", *leftovers]:
            p.unlink(missing_ok=True)
    return bad, remake


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
    hybrid = bool(remake) or any(not _BUILD_SHARD.match(n) for n in done)
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
    from dspark_ds.target import load_target

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


# ---------------------------------------------------------------- reading


class TargetCache:
    """A finished cache, checked on open, read lazily (memory-mapped shards)."""

    def __init__(self, cache_dir: str | Path, verify: str = "sha256"):
        self.cache_dir = Path(cache_dir)
        path = self.cache_dir / "manifest.json"
        if not self.cache_dir.is_dir():
            raise CacheError(f"{self.cache_dir}: no such cache directory")
        if not path.exists():
            raise CacheError(
                f"{self.cache_dir}: no manifest.json — the cache was never built or "
                "its build did not finish; rerun build-cache to complete it"
            )
        m = read_json(path)
        if m is None:
            raise CacheError(f"{path} is unreadable (not a JSON object); {REPAIR_HINT}")
        self.manifest = m
        if m.get("format") != CACHE_FORMAT or m.get("version") != CACHE_VERSION:
            raise CacheError(f"{path}: not a {CACHE_FORMAT} v{CACHE_VERSION} manifest")
        self.layer_ids, self.hidden_size = m["layer_ids"], m["hidden_size"]
        self.storage = m["dtype"]
        self.out_dtype = _FLOAT_DTYPES[m["feature_dtype"]]
        self.verify(verify)
        n = m["num_samples"]
        self._where = torch.zeros(n, 3, dtype=torch.int64)  # shard index, offset, length
        for k, s in enumerate(m["shards"]):
            ids = torch.tensor(s["sample_ids"], dtype=torch.int64)
            self._where[ids, 0] = k
            self._where[ids, 1] = torch.tensor(s["offsets"], dtype=torch.int64)
            self._where[ids, 2] = torch.tensor(s["lengths"], dtype=torch.int64)
        self.lengths = self._where[:, 2].tolist()
        self.meta = {
            "pad_token_id": m["dataset"].get("pad_token_id", 0),
            "fingerprint": m["dataset"].get("fingerprint"),
        }
        self._files: OrderedDict = OrderedDict()

    def verify(self, verify: str) -> None:
        """Collective. Presence + size of every shard; sha256 ("sha256") of this rank's share;
        CacheError naming the damaged shards and the repair (errors are shared)."""
        rank, world = dist.rank_and_world()
        errors = []
        for k, s in enumerate(self.manifest["shards"]):
            check = verify if k % world == rank else "size"
            if (problem := shard_problem(self.cache_dir, s, check)) is not None:
                errors.append(problem)
        errors = sorted({e for rank_errors in dist.all_gather_object(errors) for e in rank_errors})
        if errors:
            raise CacheError(
                f"{self.cache_dir}: "
                + "; ".join(errors[:5])
                + (f" (+{len(errors) - 5} more)" if len(errors) > 5 else "")
                + f"; {REPAIR_HINT}"
            )

    def check_compatible(
        self,
        *,
        hidden_size: int | None = None,
        layer_ids: list[int] | None = None,
        vocab_size: int | None = None,
        target_config_sha256: str | None = None,
    ) -> None:
        """Refuse (CacheError naming the field) a cache built for another drafter / target."""
        t = self.manifest["target"]
        checks = [
            ("hidden size", hidden_size, self.hidden_size),
            (
                "target_layer_ids",
                list(layer_ids) if layer_ids is not None else None,
                self.layer_ids,
            ),
            ("vocab size", vocab_size, t["vocab_size"]),
            ("target config (sha256)", target_config_sha256, t["config_sha256"]),
        ]
        for what, want, have in checks:
            if want is not None and want != have:
                raise CacheError(
                    f"{self.cache_dir}: cache {what} is {have}, but the drafter / "
                    f"target expects {want}; rebuild the cache or fix the config"
                )

    def __len__(self) -> int:
        return len(self.lengths)

    def __getstate__(self):  # NOTE: mmap handles do not survive pickling into workers.
        return {**self.__dict__, "_files": OrderedDict()}

    def _file(self, k: int):
        f = self._files.get(k)
        if f is None:
            f = safe_open(str(self.cache_dir / self.manifest["shards"][k]["file"]), "pt")
            self._files[k] = f
            if len(self._files) > 64:  # bound open memory maps
                self._files.popitem(last=False)
        else:
            self._files.move_to_end(k)
        return f

    def __getitem__(self, i: int) -> dict:
        k, a, n = self._where[i].tolist()
        f = self._file(k)
        sample = {
            "sample_id": i,
            "input_ids": f.get_slice("input_ids")[a : a + n].long(),
            "loss_mask": f.get_slice("loss_mask")[a : a + n].long(),
        }
        for key in FEATURE_KEYS:
            scale = f.get_slice(key + "_scale")[a : a + n] if self.storage == "fp8" else None
            sample[key] = decode(f.get_slice(key)[a : a + n], scale, self.out_dtype)
        return sample


# ---------------------------------------------------------------- estimate


def estimate_cache(cfg: EstimateCacheConfig) -> dict:
    """``dspark-ds estimate cache``: bytes a cache will take, without running the target."""
    from transformers import AutoConfig

    from dspark_ds.target import default_layer_ids, validate_layer_ids

    if not cfg.target.path:
        raise ConfigError("target.path is required (only its config.json is read)")
    check_model_path(cfg.target.path, "target.path")
    tcfg = text_config(
        AutoConfig.from_pretrained(
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
