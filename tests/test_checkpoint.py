"""Checkpoint layout: a crash mid-save never breaks the last good one; keep the last K."""

from __future__ import annotations

import pytest

from dspark_ds.train import checkpoint as ckpt


def fake_tag(root, step, complete=True):
    d = root / ckpt.tag_for_step(step)
    d.mkdir(parents=True)
    (d / "mp_rank_00_model_states.pt").write_bytes(b"x")
    if complete:
        ckpt.publish(root, d.name, keep_last=2)
    return d


def test_publish_latest_and_keep_last(tmp_path):
    for step in (10, 20, 30):
        fake_tag(tmp_path, step)
    assert ckpt.complete_tags(tmp_path) == ["step_00000020", "step_00000030"]
    assert (tmp_path / "latest").read_text().strip() == "step_00000030"
    assert not (tmp_path / "step_00000010").exists()


def test_crash_mid_save_keeps_previous(tmp_path):
    fake_tag(tmp_path, 10)
    fake_tag(tmp_path, 20, complete=False)  # every rank started writing, then the job died
    assert ckpt.latest_tag(tmp_path) == "step_00000010"
    assert ckpt.resolve_tag_dir(tmp_path) == tmp_path / "step_00000010"
    # `latest` pointing at an incomplete tag (written by something else) is not trusted
    (tmp_path / "latest").write_text("step_00000020\n")
    assert ckpt.latest_tag(tmp_path) == "step_00000010"
    # the next good save removes the junk
    fake_tag(tmp_path, 30)
    assert not (tmp_path / "step_00000020").exists()


def test_resolve_run_dir_and_missing(tmp_path):
    fake_tag(tmp_path / "run" / "checkpoints", 5)
    assert ckpt.resolve_tag_dir(tmp_path / "run").name == "step_00000005"
    with pytest.raises(FileNotFoundError, match="no complete checkpoint"):
        ckpt.resolve_tag_dir(tmp_path / "empty")


def test_rng_state_roundtrip():
    import random

    import torch

    ckpt.seed_everything(3)
    state = ckpt.rng_state()
    a = (random.random(), torch.rand(2))
    ckpt.set_rng_state(state)
    b = (random.random(), torch.rand(2))
    assert a[0] == b[0] and torch.equal(a[1], b[1])
