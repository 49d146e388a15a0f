"""Training checkpoints: layout, crash-safe publication, retention, resume, RNG state, export.

    <run>/checkpoints/
      latest                  the newest complete tag (replaced atomically, written last)
      step_00000100/          one DeepSpeed checkpoint (every rank's files) plus, from rank 0,
        draft_config.json     the drafter's config (docs/checkpoint-format.md fields)
        run_config.yaml       the resolved run config
        ds_config.json        the DeepSpeed config it was trained with
        COMPLETE              written after every rank has finished; a tag without it is junk
      step_00000100_universal/  made on demand when resuming on another world size

A crash during a save leaves a tag without COMPLETE; `latest` still names the previous one.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
from pathlib import Path

import numpy as np
import torch

LATEST = "latest"
COMPLETE = "COMPLETE"
TAG_RE = re.compile(r"^step_(\d+)$")


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
    """Rank 0, after every rank saved: mark complete, point `latest` at it, prune old tags."""
    root = Path(checkpoint_dir)
    _atomic_write(root / tag / COMPLETE, "ok\n")
    _atomic_write(root / LATEST, tag + "\n")
    for old in complete_tags(root)[:-keep_last]:
        shutil.rmtree(root / old, ignore_errors=True)
        shutil.rmtree(root / f"{old}_universal", ignore_errors=True)
    # incomplete leftovers of crashed saves, older than the newest complete tag
    newest = int(TAG_RE.match(tag).group(1))
    for p in root.iterdir():
        m = TAG_RE.match(p.name)
        if m and int(m.group(1)) < newest and not (p / COMPLETE).exists():
            shutil.rmtree(p, ignore_errors=True)


def write_metadata(
    tag_dir: str | Path, *, draft_config: dict, run_config_yaml: str, ds_config: dict
) -> None:
    tag_dir = Path(tag_dir)
    tag_dir.mkdir(parents=True, exist_ok=True)
    _atomic_write(tag_dir / "draft_config.json", json.dumps(draft_config, indent=2, sort_keys=True))
    _atomic_write(tag_dir / "run_config.yaml", run_config_yaml)
    _atomic_write(tag_dir / "ds_config.json", json.dumps(ds_config, indent=2))


def _atomic_write(path: Path, text: str) -> None:
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
    raise FileNotFoundError(f"{path}: no complete checkpoint (looked for {COMPLETE} / {LATEST})")


# ---- RNG ------------------------------------------------------------------------------------
def rng_state() -> dict:
    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


# ---- shared weights + export ------------------------------------------------------------------
def target_shared_weights(target_path: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(embedding [V,H], lm_head [V,H]) read straight from the target's safetensors, without
    loading the whole target. Tied targets return the embedding twice."""
    from safetensors import safe_open

    root = Path(target_path)
    files: dict[str, Path] = {}
    index = root / "model.safetensors.index.json"
    if index.exists():
        for name, shard in json.loads(index.read_text())["weight_map"].items():
            files[name] = root / shard
    elif (root / "model.safetensors").exists():
        with safe_open(str(root / "model.safetensors"), framework="pt") as f:
            files = {name: root / "model.safetensors" for name in f.keys()}
    else:
        raise FileNotFoundError(f"target.path: {root} has no model.safetensors(.index.json)")

    def find(suffixes: tuple[str, ...]) -> torch.Tensor | None:
        for name, file in files.items():
            if name.endswith(suffixes):
                with safe_open(str(file), framework="pt") as f:
                    return f.get_tensor(name)
        return None

    embed = find(("embed_tokens.weight",))
    if embed is None:
        raise ValueError(f"target.path: {root} has no *embed_tokens.weight tensor")
    head = find(("lm_head.weight",))
    return embed, (embed if head is None else head)


def claim_output_dir(output_dir: str | Path, overwrite: bool, option: str = "output_dir") -> None:
    """Refuse (ValueError naming `option`) to write a drafter into a non-empty directory unless
    `overwrite`; with it, remove the weight files of an earlier (sharded) drafter there, which
    would otherwise sit beside the new ones."""
    out = Path(output_dir)
    if out.exists() and not out.is_dir():
        raise ValueError(f"{option}: {out} is a file, not a directory")
    held = sorted(p.name for p in out.iterdir()) if out.is_dir() else []
    if held and not overwrite:
        shown = ", ".join(held[:4]) + (f", +{len(held) - 4} more" if len(held) > 4 else "")
        raise ValueError(
            f"{option}: {out} is not empty ({shown}); choose another directory, or pass "
            "--overwrite true to replace its config.json and weights"
        )
    for name in held:
        if name == "model.safetensors.index.json" or re.match(r"^model-.*\.safetensors$", name):
            (out / name).unlink()


def export_checkpoint(
    checkpoint: str | Path,
    output_dir: str | Path,
    *,
    target_path: str | None = None,
    dtype: torch.dtype = torch.float32,
    overwrite: bool = False,
) -> Path:
    """Any ZeRO stage's checkpoint → interchange directory (docs/checkpoint-format.md). A
    non-empty `output_dir` is refused unless `overwrite`."""
    try:
        tag_dir = resolve_tag_dir(checkpoint)
    except FileNotFoundError as err:
        raise ValueError(f"checkpoint: {err}") from None
    claim_output_dir(output_dir, overwrite)
    if target_path is not None and not Path(target_path).is_dir():
        raise ValueError(f"target.path: {target_path} is not a local model directory")

    import yaml

    from dspark_ds.drafters import build_draft_model, save_draft_model
    from dspark_ds.drafters.io import config_from_dict
    from dspark_ds.engine import checkpoint_trainable_fp32

    draft_cfg = config_from_dict(json.loads((tag_dir / "draft_config.json").read_text()))
    if target_path is None:
        run = yaml.safe_load((tag_dir / "run_config.yaml").read_text())
        target_path = run["target"]["path"]
    trainable = checkpoint_trainable_fp32(tag_dir)
    model = build_draft_model(draft_cfg)
    embed, head = target_shared_weights(target_path)
    state = assemble_state_dict(model, trainable, embed, head)
    return save_draft_model(model, output_dir, {k: v.to(dtype) for k, v in state.items()})


def assemble_state_dict(
    model, trainable: dict[str, torch.Tensor], embed: torch.Tensor, head: torch.Tensor
) -> dict[str, torch.Tensor]:
    """The full drafter state: trainable weights + the target's shared ones; strict."""
    own = model.state_dict()
    shared = dict(zip(model.shared_parameter_names(), (embed, head)))
    state = {**trainable, **shared}
    missing = sorted(set(own) - set(state))
    unexpected = sorted(set(state) - set(own))
    if missing or unexpected:
        raise ValueError(
            f"checkpoint does not match the drafter: missing {missing[:8]}, "
            f"unexpected {unexpected[:8]}"
        )
    for name, tensor in state.items():
        if tuple(tensor.shape) != tuple(own[name].shape):
            raise ValueError(
                f"{name}: checkpoint shape {tuple(tensor.shape)} != drafter "
                f"{tuple(own[name].shape)}"
            )
    return {name: state[name].float() for name in own}


def run_export(cfg) -> Path:
    """`dspark-ds export` (an `ExportConfig`): any ZeRO stage's checkpoint → interchange
    directory."""
    out = export_checkpoint(
        cfg.checkpoint,
        cfg.output_dir,
        target_path=cfg.target.path,
        dtype=getattr(torch, cfg.dtype),
        overwrite=cfg.overwrite,
    )
    print(f"[export] wrote {out}")
    return out
