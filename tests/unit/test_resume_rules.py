"""Which options a resumed run may change (dspark_ds/train/resume.py)."""

from __future__ import annotations

import copy

from dspark_ds.config import TrainRunConfig, to_plain
from dspark_ds.train.resume import compare, describe


def base() -> dict:
    cfg = TrainRunConfig()
    cfg.target.path = "/models/target"
    return to_plain(cfg)


def test_meaning_is_refused_watching_is_free_length_has_a_rule():
    saved, new = base(), base()
    new["model"]["block_size"] = 1
    new["model"]["markov_rank"] = 8
    new["train"]["synthetic_samples"] = 64
    new["data"]["paths"] = ["other.jsonl"]
    new["train"]["lr"] = 1e-4
    new["train"]["max_steps"] = 40
    new["train"]["log_every"] = 1
    new["checkpoint"]["every_steps"] = 5
    new["validation"]["every_steps"] = 7
    new["tracking"]["tags"] = {"team": "x"}
    new["deepspeed"]["overrides"] = {"zero_optimization": {"reduce_bucket_size": 1000}}
    new["deepspeed"]["backend"] = "gloo"
    new["data"]["batch_size"] = 4
    new["target"]["path"] = "/mnt/other/target"
    ch = compare(saved, new)
    assert sorted(ch.refused) == [
        "data.paths",
        "model.block_size",
        "model.markov_rank",
        "train.lr",
        "train.synthetic_samples",
    ]
    assert ch.refused["model.block_size"] == (7, 1)
    assert ch.schedule == {"train.max_steps": (None, 40)}
    assert ch.target_place == {"target.path": ("/models/target", "/mnt/other/target")}
    assert {
        "train.log_every",
        "checkpoint.every_steps",
        "validation.every_steps",
        "tracking.tags.team",
        "deepspeed.backend",
        "deepspeed.overrides.zero_optimization.reduce_bucket_size",
        "data.batch_size",
    } <= set(ch.free)
    assert "model.block_size (saved 7, now 1)" in describe(ch.refused)


def test_unchanged_and_other_versions_options():
    saved, new = base(), base()
    assert not compare(saved, copy.deepcopy(saved)).allowed()
    assert not compare(saved, new).refused
    del saved["train"]["max_nonfinite_in_row"]  # an option this version added
    saved["model"]["retired_option"] = 3  # one a later version dropped
    new["train"]["betas"] = [0.9, 0.999]  # tuple vs list, as YAML gives it back
    ch = compare(saved, new)
    assert not ch.refused and not ch.allowed()
