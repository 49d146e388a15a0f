"""Which options a resumed run may change, compared with the checkpoint's `run_config.yaml`;
`check(tag_dir, run_config, draft_config, ds_config)` applies the rules to a checkpoint (the
checkpoint manager calls it before anything is built).

A checkpoint is the state of one training run; continuing it under other settings must either
mean the same thing or be refused. Three kinds of options:

- **free**: how the run is watched, saved and executed, not what it computes — `name`,
  `output_dir`, `train.log_every`, `train.progress_bar`, `train.peak_tflops`, `train.max_nonfinite_in_row`,
  `tracking.*`, `checkpoint.*`, `validation.*`, `perf.*` (same results, another cost),
  `deepspeed.*` as long as the resolved DeepSpeed config keeps the ZeRO stage, the offload and
  the optimizer implementation (`engine.checkpoint.optimizer_layout`: offloading the optimizer
  swaps torch's AdamW for DeepSpeed's CPU Adam, whose state does not load from the other's);
  `data.batch_size` (the micro-batch; `train.global_batch_size` is what the optimizer sees),
  `data.num_workers`, `data.cache_verify`, `model.init_from` (a resume never reads it);
- **the schedule length** — `train.max_steps`, `train.num_epochs`: allowed, the learning rate
  continues from where it was (`dspark_ds.train.schedule`);
- **the target's place** — `target.path`: allowed when the drafter built from the new target is
  the checkpoint's drafter (same `draft_config.json`: sizes, layers, mask token), i.e. the same
  model moved;
- everything else (the drafter, its loss, the data and its order, the optimizer, the precision,
  the seed, the global batch) is refused by name, listing the saved and the new values.

An option that only one of the two configs has (added or removed by another version) is not
compared.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from dspark_ds.engine.checkpoint import optimizer_layout
from dspark_ds.errors import ConfigError

FREE = (
    "name",
    "output_dir",
    "train.log_every",
    "train.progress_bar",
    "train.peak_tflops",
    "train.max_nonfinite_in_row",
    "tracking.",
    "checkpoint.",
    "validation.",
    "perf.",
    "deepspeed.",
    "data.batch_size",
    "data.num_workers",
    "data.cache_verify",
    "model.init_from",
)
SCHEDULE = ("train.max_steps", "train.num_epochs")
TARGET_PLACE = ("target.path",)


def _matches(key: str, rules: tuple[str, ...]) -> bool:
    return any(key == r or (r.endswith(".") and key.startswith(r)) for r in rules)


def flatten_plain(data, prefix: str = "") -> dict[str, object]:
    """Nested dicts (a config as YAML data) as {"train.lr": 0.0006, ...}; lists stay values."""
    out: dict[str, object] = {}
    for key, value in data.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out.update(flatten_plain(value, name + "."))
        else:
            out[name] = value
    return out


@dataclass
class ConfigChanges:
    """The options whose value differs between the checkpoint's run and this one."""

    free: dict[str, tuple] = field(default_factory=dict)
    schedule: dict[str, tuple] = field(default_factory=dict)
    target_place: dict[str, tuple] = field(default_factory=dict)
    refused: dict[str, tuple] = field(default_factory=dict)

    def allowed(self) -> dict[str, tuple]:
        return {**self.schedule, **self.target_place, **self.free}


def compare(saved: dict, new: dict) -> ConfigChanges:
    """`saved` and `new`: configs as plain data (`config.to_plain`, or the checkpoint's YAML)."""
    old_flat, new_flat = flatten_plain(saved), flatten_plain(new)
    changes = ConfigChanges()
    for key in sorted(set(old_flat) | set(new_flat)):
        before, after = old_flat.get(key), new_flat.get(key)
        if not (_known(key, old_flat) and _known(key, new_flat)):
            continue  # an option only one of the two versions has
        if _same(before, after):
            continue
        if _matches(key, SCHEDULE):
            changes.schedule[key] = (before, after)
        elif _matches(key, TARGET_PLACE):
            changes.target_place[key] = (before, after)
        elif _matches(key, FREE):
            changes.free[key] = (before, after)
        else:
            changes.refused[key] = (before, after)
    return changes


def _known(key: str, flat: dict) -> bool:
    """`key` is an option of this config, or a key inside one of its dict-valued options
    (tracking.tags, deepspeed.overrides: {} / None flatten to the option itself)."""
    parts = key.split(".")
    return any(".".join(parts[:n]) in flat for n in range(len(parts), 0, -1))


def _same(a, b) -> bool:
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool):
        return float(a) == float(b)
    return a == b


def describe(changes: dict[str, tuple]) -> str:
    """`model.block_size (saved 1, now 4), ...`"""
    return ", ".join(f"{k} (saved {a!r}, now {b!r})" for k, (a, b) in changes.items())


def check(tag_dir: Path, run_config: dict, draft_config: dict, ds_config: dict) -> ConfigChanges:
    """The changes this run (`run_config` as plain data, the record of the drafter it builds,
    its DeepSpeed config) makes to the checkpoint `tag_dir`; ConfigError (exit 2) naming every
    option when a resume cannot make them."""
    saved = yaml.safe_load((tag_dir / "run_config.yaml").read_text()) or {}
    changes = compare(saved, run_config)
    if changes.refused:
        raise ConfigError(
            f"checkpoint.resume: {tag_dir} was trained with other settings, which a resume "
            f"cannot change: {describe(changes.refused)}; resume with the saved values, or "
            "start a new run from its weights (dspark-ds export, then --model.init_from)"
        )
    saved_draft = json.loads((tag_dir / "draft_config.json").read_text())
    new_draft = json.loads(json.dumps(draft_config, sort_keys=True))
    differs = {
        k: (saved_draft[k], new_draft[k])
        for k in sorted(set(saved_draft) & set(new_draft))
        if k != "transformers_version" and saved_draft[k] != new_draft[k]
    }
    if differs:
        raise ConfigError(
            f"target.path: the drafter built from {run_config['target']['path']} is not the one "
            f"{tag_dir} holds: {describe(differs)}; resume with the target it was trained with"
        )
    meta = json.loads((tag_dir / "meta.json").read_text())
    layout = optimizer_layout(json.loads((tag_dir / "ds_config.json").read_text()))
    layout["ZeRO stage"] = meta["zero_stage"]
    now = optimizer_layout(ds_config)
    moved = {k: (layout[k], now[k]) for k in layout if layout[k] != now[k]}
    if moved:
        shown = ", ".join(f"{k} {a} (now {b})" for k, (a, b) in moved.items())
        raise ConfigError(
            f"deepspeed.config: {tag_dir} was written with {shown}; its optimizer state loads "
            "only into the same layout: resume with the same ZeRO stage, offload and optimizer "
            "(train.optimizer, deepspeed.torch_adam)"
        )
    return changes
