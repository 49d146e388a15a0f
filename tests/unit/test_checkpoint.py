"""Checkpoint layout: a crash mid-save never breaks the last good one; keep the last K."""

from __future__ import annotations

import pytest

from dspark_ds.errors import ConfigError
from dspark_ds.train import checkpoint_files as ckpt
from dspark_ds.train import rng
from dspark_ds.train.export import export_checkpoint


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
    with pytest.raises(ConfigError, match="no complete checkpoint"):
        ckpt.resolve_tag_dir(tmp_path / "empty")


def test_rng_state_roundtrip():
    import random

    import torch

    rng.seed_everything(3)
    state = rng.rng_state()
    a = (random.random(), torch.rand(2))
    rng.set_rng_state(state)
    b = (random.random(), torch.rand(2))
    assert a[0] == b[0] and torch.equal(a[1], b[1])


# ---- integrity: the manifest every save records -------------------------------------------------
def saved_tag(root, step=10, files=None):
    """A tag as CheckpointManager.save leaves it: files, MANIFEST.json (sizes + sha256), COMPLETE."""
    tag = root / ckpt.tag_for_step(step)
    tag.mkdir(parents=True)
    files = files or {
        "mp_rank_00_model_states.pt": b"m" * 300,
        "zero_pp_rank_0_mp_rank_00_optim_states.pt": b"a" * 500,
        "zero_pp_rank_1_mp_rank_00_optim_states.pt": b"b" * 500,
        "meta.json": b'{"step": 10}',
    }
    for name, data in files.items():
        (tag / name).write_bytes(data)
    names = ckpt.payload_files(tag)
    ckpt.write_manifest(tag, ckpt.describe_files(tag, names), step)
    ckpt.publish(root, tag.name, keep_last=3)
    return tag


def test_manifest_names_missing_truncated_and_altered_files(tmp_path):
    tag = saved_tag(tmp_path)
    manifest = ckpt.read_manifest(tag)
    every = set(manifest["files"])
    assert every == {
        "meta.json",
        "mp_rank_00_model_states.pt",
        "zero_pp_rank_0_mp_rank_00_optim_states.pt",
        "zero_pp_rank_1_mp_rank_00_optim_states.pt",
    }
    assert ckpt.check_files(tag, manifest, every) == []
    (tag / "mp_rank_00_model_states.pt").write_bytes(b"m" * 100)  # truncated
    (tag / "zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()  # missing
    (tag / "zero_pp_rank_0_mp_rank_00_optim_states.pt").write_bytes(b"x" * 500)  # same size
    assert ckpt.check_files(tag, manifest, set()) == [
        "mp_rank_00_model_states.pt has 100 bytes, 300 when saved",
        "zero_pp_rank_1_mp_rank_00_optim_states.pt is missing",
    ]  # sizes only: the altered file of the same size passes
    assert ckpt.check_files(tag, manifest, every)[1] == (
        "zero_pp_rank_0_mp_rank_00_optim_states.pt: sha256 differs from the one recorded at save"
    )
    (tag / ckpt.MANIFEST).write_text("{not json")
    assert ckpt.check_files(tag, ckpt.read_manifest(tag), every)[0].startswith(
        "MANIFEST.json cannot be read"
    )


def test_each_rank_hashes_its_own_files():
    assert ckpt.file_owner("zero_pp_rank_3_mp_rank_00_optim_states.pt", 4) == 3
    assert ckpt.file_owner("bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt", 4) == 1
    assert ckpt.file_owner("offloaded_tensors/rank02/0.tensor.swp", 4) == 2
    assert ckpt.file_owner("mp_rank_00_model_states.pt", 4) == 0
    assert ckpt.file_owner("zero_pp_rank_7_mp_rank_00_optim_states.pt", 4) == 0  # not a rank


def test_publish_never_removes_a_newer_complete_tag(tmp_path):
    """Newer complete tags are set aside by the resume that skips them (never deleted by a
    save); incomplete ones, newer or older, are junk of crashed saves."""
    saved_tag(tmp_path, 30)
    newer_junk = tmp_path / ckpt.tag_for_step(40)
    newer_junk.mkdir()
    saved_tag(tmp_path, 20)
    assert (tmp_path / "step_00000030" / "COMPLETE").exists()
    assert not newer_junk.exists()
    assert (tmp_path / "latest").read_text().strip() == "step_00000020"
    moved = ckpt.set_aside(tmp_path / "step_00000030", "abandoned")
    assert moved.name == "step_00000030.abandoned"
    saved_tag(tmp_path, 30)
    assert ckpt.set_aside(tmp_path / "step_00000030", "abandoned").name == (
        "step_00000030.abandoned2"
    )
    assert ckpt.complete_tags(tmp_path) == ["step_00000020"]


def test_export_refuses_a_damaged_checkpoint(tmp_path):
    tag = saved_tag(tmp_path / "run" / "checkpoints")
    (tag / "zero_pp_rank_1_mp_rank_00_optim_states.pt").write_bytes(b"b" * 10)
    with pytest.raises(ValueError, match=r"is damaged: zero_pp_rank_1_.* has 10 bytes, 500"):
        export_checkpoint(tmp_path / "run", tmp_path / "out")
    assert not (tmp_path / "out").exists()
