"""`dspark-ds export`: a training checkpoint of any ZeRO stage -> the interchange directory
(docs/checkpoint-format.md): the trainable weights from the checkpoint's fp32 master copies, the
embedding and lm_head from the target's own files."""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
import yaml

from dspark_ds.distributed import print0
from dspark_ds.drafters import build_draft_model, save_draft_model
from dspark_ds.drafters.io import config_from_dict, save_speculators_model
from dspark_ds.engine.checkpoint import checkpoint_trainable_fp32
from dspark_ds.errors import ConfigError
from dspark_ds.target import target_shared_weights
from dspark_ds.tracking.store import write_export_record
from dspark_ds.train.checkpoint_files import check_files, read_manifest, resolve_tag_dir


def claim_output_dir(output_dir: str | Path, overwrite: bool, option: str = "output_dir") -> None:
    """Refuse (ConfigError naming `option`) to write a drafter into a non-empty directory unless
    `overwrite`; with it, remove the weight files of an earlier (sharded) drafter there, which
    would otherwise sit beside the new ones."""
    out = Path(output_dir)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"{option}: {out} is a file, not a directory")
    held = sorted(p.name for p in out.iterdir()) if out.is_dir() else []
    if held and not overwrite:
        shown = ", ".join(held[:4]) + (f", +{len(held) - 4} more" if len(held) > 4 else "")
        raise ConfigError(
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
    format: str = "native",
) -> Path:
    """Any ZeRO stage's checkpoint → interchange directory (docs/checkpoint-format.md), in the
    engines' format of the drafter's kind (`format` "native") or speculators' ("speculators").
    A non-empty `output_dir` is refused unless `overwrite`."""
    if format not in ("native", "speculators"):
        raise ConfigError(f"format: native or speculators, got {format!r}")
    try:
        tag_dir = resolve_tag_dir(checkpoint)
    except ConfigError as err:
        raise ConfigError(f"checkpoint: {err}") from None
    problems = check_files(tag_dir, read_manifest(tag_dir), set())
    if problems:
        raise ConfigError(f"checkpoint: {tag_dir} is damaged: {'; '.join(problems[:4])}")
    claim_output_dir(output_dir, overwrite)
    if target_path is not None and not Path(target_path).is_dir():
        raise ConfigError(f"target.path: {target_path} is not a local model directory")

    draft_cfg = config_from_dict(json.loads((tag_dir / "draft_config.json").read_text()))
    if target_path is None:
        run = yaml.safe_load((tag_dir / "run_config.yaml").read_text())
        target_path = run["target"]["path"]
    trainable = checkpoint_trainable_fp32(tag_dir)
    model = build_draft_model(draft_cfg)
    embed, head = target_shared_weights(target_path)
    state = assemble_state_dict(model, trainable, embed, head)
    state = {k: v.to(dtype) for k, v in state.items()}
    if format == "speculators":
        out = save_speculators_model(model, output_dir, state, target_path=str(target_path))
    else:
        out = save_draft_model(model, output_dir, state)
    run_id_file = tag_dir.parent.parent / "mlflow_run_id"  # <run>/checkpoints/<tag>
    if run_id_file.is_file():  # the export names the run that trained it (tracking.md)
        write_export_record(out, run_id_file.read_text().strip(), None)
    return out


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
        raise ConfigError(
            f"checkpoint does not match the drafter: missing {missing[:8]}, "
            f"unexpected {unexpected[:8]}"
        )
    for name, tensor in state.items():
        if tuple(tensor.shape) != tuple(own[name].shape):
            raise ConfigError(
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
        format=cfg.format,
    )

    print0(f"[export] wrote {out}")
    return out
