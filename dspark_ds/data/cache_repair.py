"""``build-cache --repair true``: each rank checks its share of a cache's shards (sidecar, size,
sha256, the samples of its name) and deletes every bad one with its sidecar and temp files, so
that the build re-makes exactly those (data/cache_writer.py)."""

from __future__ import annotations

import re
from pathlib import Path

from dspark_ds import distributed as dist
from dspark_ds.data.cache import BUILD_SHARD, CacheError, read_json, shard_problem


def _owner(name: str, index: int, world: int) -> int:
    """The rank that checks and re-makes a shard: shard k's builder for build-cache shards (so
    ranks without a process group agree), else by position in the sorted list."""
    return int(name) % world if BUILD_SHARD.match(name) else index % world


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
        if BUILD_SHARD.match(name):
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
        if not BUILD_SHARD.match(name):
            remake[name] = list(ids)
        # NOTE: the sidecar goes first: a shard without one counts as not built
        for p in [shards / f"{name}.json", shards / f"{name}.safetensors", *leftovers]:
            p.unlink(missing_ok=True)
    return bad, remake
