"""Which options a resumed run may change, compared with the checkpoint's `run_config.yaml`.

A checkpoint is the state of one training run; continuing it under other settings must either
mean the same thing or be refused. Three kinds of options:

- **free**: how the run is watched, saved and executed, not what it computes — `name`,
  `output_dir`, `train.log_every`, `train.progress_bar`, `train.max_nonfinite_in_row`,
  `tracking.*`, `checkpoint.*`, `validation.*`, `perf.*` (same results, another cost),
  `deepspeed.*` as long as the resolved DeepSpeed config keeps the ZeRO stage, the offload and
  the optimizer implementation (`engine.checkpoint.optimizer_layout`, checked where the checkpoint is
  loaded: offloading the optimizer swaps torch's AdamW for DeepSpeed's CPU Adam, whose state
  does not load from the other's);
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

from dataclasses import dataclass, field

FREE = (
    "name",
    "output_dir",
    "train.log_every",
    "train.progress_bar",
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
