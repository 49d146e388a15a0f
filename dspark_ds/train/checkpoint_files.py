"""Training checkpoints on disk: layout, crash-safe publication, integrity, retention. No process
group here (`checkpoint.py`'s manager is the collective side, `export.py` turns a checkpoint into
an interchange directory).

    <run>/checkpoints/
      latest                  the newest complete tag (replaced atomically, written last)
      step_00000100/          one DeepSpeed checkpoint (every rank's files) plus, from rank 0,
        draft_config.json     the drafter's config (the interchange fields)
        run_config.yaml       the resolved run config
        ds_config.json        the DeepSpeed config it was trained with
        meta.json             step, world size, ZeRO stage, the learning-rate schedule
        MANIFEST.json         size and sha256 of every file above (each rank hashed its own)
        COMPLETE              written after the manifest, once every rank has finished
      step_00000100_universal/  made on demand when resuming on another world size
      step_00000200.damaged/  a checkpoint that failed verification on resume (kept, ignored)
      step_00000300.abandoned/  newer than the checkpoint a run resumed from (kept, ignored)

A crash during a save leaves a tag without COMPLETE; `latest` still names the previous one.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

from dspark_ds.errors import ConfigError
from dspark_ds.files import sha256_file

LATEST = "latest"
COMPLETE = "COMPLETE"
MANIFEST = "MANIFEST.json"
TAG_RE = re.compile(r"^step_(\d+)$")
_RANK_FILE = re.compile(r"zero_pp_rank_(\d+)_|^offloaded_tensors/rank0*(\d+)/")


def tag_step(tag: str) -> int:
    return int(TAG_RE.match(tag).group(1))


def tag_for_step(step: int) -> str:
    return f"step_{step:08d}"


def complete_tags(checkpoint_dir: str | Path) -> list[str]:
    """Complete tags, oldest first."""
    root = Path(checkpoint_dir)
    if not root.is_dir():
        return []
    tags = [p.name for p in root.iterdir() if TAG_RE.match(p.name) and (p / COMPLETE).exists()]
    return sorted(tags, key=lambda t: int(TAG_RE.match(t).group(1)))


def latest_tag(checkpoint_dir: str | Path) -> str | None:
    """The tag named by `latest` when complete, else the newest complete tag, else None."""
    root = Path(checkpoint_dir)
    link = root / LATEST
    if link.is_file():
        tag = link.read_text().strip()
        if (root / tag / COMPLETE).exists():
            return tag
    tags = complete_tags(root)
    return tags[-1] if tags else None


def publish(checkpoint_dir: str | Path, tag: str, keep_last: int) -> None:
    """Rank 0, after every rank saved and the manifest is written: mark complete, point
    `latest` at it, prune older complete tags beyond `keep_last` and every incomplete one."""
    root = Path(checkpoint_dir)
    atomic_write(root / tag / COMPLETE, "ok\n")
    atomic_write(root / LATEST, tag + "\n")
    newest = tag_step(tag)
    older = [t for t in complete_tags(root) if tag_step(t) < newest]
    for old in older[: max(0, len(older) - (keep_last - 1))]:
        remove_tag(root / old)
        shutil.rmtree(root / f"{old}_universal", ignore_errors=True)
    # leftovers of crashed saves (a newer one too: `latest` has just moved past it)
    for p in root.iterdir():
        if TAG_RE.match(p.name) and p.name != tag and not (p / COMPLETE).exists():
            shutil.rmtree(p, ignore_errors=True)


def remove_tag(tag_dir: Path) -> None:
    """COMPLETE first, so that a crash in the middle never leaves a half-deleted tag that
    looks complete."""
    (tag_dir / COMPLETE).unlink(missing_ok=True)
    shutil.rmtree(tag_dir, ignore_errors=True)


def set_aside(tag_dir: Path, why: str) -> Path:
    """Rename a tag out of the way (`step_X.<why>`): never loaded, never pruned, not lost."""
    target = tag_dir.with_name(f"{tag_dir.name}.{why}")
    n = 1
    while target.exists():
        n += 1
        target = tag_dir.with_name(f"{tag_dir.name}.{why}{n}")
    os.replace(tag_dir, target)
    return target


# ---- integrity --------------------------------------------------------------------------------
def file_owner(name: str, world_size: int) -> int:
    """The rank that writes (and at save time hashes) a checkpoint file: DeepSpeed's
    `zero_pp_rank_<r>_...` files and `offloaded_tensors/rank<r>/` (NVMe offload) belong to rank
    r, everything else to rank 0."""
    m = _RANK_FILE.search(name)
    rank = int(m.group(1) or m.group(2)) if m else 0
    return rank if rank < world_size else 0


def payload_files(tag_dir: Path) -> list[str]:
    """The files a manifest covers, as paths relative to the tag: everything but the manifest,
    COMPLETE and temp files."""
    return sorted(
        p.relative_to(tag_dir).as_posix()
        for p in tag_dir.rglob("*")
        if p.is_file() and p.name not in (MANIFEST, COMPLETE) and not p.name.endswith(".tmp")
    )


def describe_files(tag_dir: Path, names: list[str]) -> dict[str, dict]:
    """{name: {"size": bytes, "sha256": hex}}."""
    return {
        n: {"size": (tag_dir / n).stat().st_size, "sha256": sha256_file(tag_dir / n)} for n in names
    }


def write_manifest(tag_dir: Path, files: dict[str, dict], step: int) -> None:
    atomic_write(tag_dir / MANIFEST, json.dumps({"step": step, "files": files}, indent=1))


def read_manifest(tag_dir: Path) -> dict:
    """The tag's manifest. One that is missing or cannot be parsed is reported as damage by
    `check_files`."""
    path = tag_dir / MANIFEST
    if not path.exists():
        return {"files": {}, "error": f"{MANIFEST} is missing"}
    try:
        manifest = json.loads(path.read_text())
        if not isinstance(manifest.get("files"), dict):
            raise ValueError("no file list")
        return manifest
    except (OSError, ValueError) as err:
        return {"files": {}, "error": f"{MANIFEST} cannot be read ({err})"}


def check_files(tag_dir: Path, manifest: dict, hash_names: set[str]) -> list[str]:
    """What is wrong with a tag against its manifest: missing files, other sizes (always), other
    sha256 (the files in `hash_names`). An empty list: the tag is as it was saved."""
    if "error" in manifest:
        return [manifest["error"]]
    problems = []
    for name, rec in sorted(manifest["files"].items()):
        path = tag_dir / name
        if not path.is_file():
            problems.append(f"{name} is missing")
            continue
        size = path.stat().st_size
        if size != rec["size"]:
            problems.append(f"{name} has {size} bytes, {rec['size']} when saved")
        elif name in hash_names and sha256_file(path) != rec["sha256"]:
            problems.append(f"{name}: sha256 differs from the one recorded at save")
    return problems


def atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def resolve_tag_dir(path: str | Path) -> Path:
    """A run dir, a checkpoints dir (uses `latest`) or a tag dir → the tag dir."""
    path = Path(path)
    if (path / COMPLETE).exists():
        return path
    for root in (path / "checkpoints", path):
        if root.is_dir():
            tag = latest_tag(root)
            if tag is not None:
                return root / tag
    raise ConfigError(f"{path}: no complete checkpoint (looked for {COMPLETE} / {LATEST})")
