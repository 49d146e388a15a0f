"""The offline target cache: sharded safetensors + a manifest; its format and its reader.

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

Written by data/cache_writer.py (`dspark-ds build-cache`, hybrid mode's epoch 0); checked and
re-made by data/cache_repair.py (`--repair true`); read by `TargetCache`.
"""

from __future__ import annotations

import json
import re
from collections import OrderedDict
from pathlib import Path

import torch
from safetensors import safe_open

from dspark_ds import distributed as dist
from dspark_ds.data.collate import FEATURE_KEYS
from dspark_ds.errors import ConfigError
from dspark_ds.files import sha256_file

CACHE_FORMAT = "dspark-ds-target-cache"
CACHE_VERSION = 1
FP8_MAX = 448.0  # largest finite float8_e4m3fn
_FLOAT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
BUILD_SHARD = re.compile(r"^\d{6}$")  # build-cache's shard k; hybrid mode writes h<rank>-<k>
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


# ---------------------------------------------------------------- checking shards


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
