"""Fault injection into real training runs (tiny recipe, CPU, gloo): each fault either lets the
run go on or stops it with a one-line reason, and nothing finished is lost. The faults are
installed by tests/helpers/faults.py in the training process itself; docs/training.md's
reliability table points here. (SIGUSR1 / requeue under Slurm: tests/cluster/test_slurm.py.)
"""

from __future__ import annotations

import json
import math
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from helpers.dist import REPO, _env, check, python, torchrun
from helpers.tiny_models import prepare_chat

pytestmark = [pytest.mark.slow]

FAULTS = str(REPO / "tests" / "helpers" / "faults.py")
RECIPE = str(REPO / "dspark_ds" / "recipes" / "tiny_cpu.yaml")
STAMP = re.compile(r"^\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d rank \d+\] ")


@pytest.fixture(scope="module")
def target(tmp_path_factory, tiny_target) -> Path:
    return Path(tiny_target)


def train_args(target: Path, out: Path, name: str, *extra: str) -> list[str]:
    argv = ["--config", RECIPE, "--target.path", str(target), "--output_dir", str(out)]
    argv += ["--name", name, "--train.progress_bar", "false", "--tracking.enabled", "false"]
    argv += ["--validation.every_steps", "0", *extra]
    return argv


def with_faults(faults: list[dict], args: list[str]) -> list[str]:
    return [FAULTS, json.dumps(faults), *args]


def cli_train(args: list[str]) -> list[str]:
    return ["-m", "dspark_ds.cli", "train", *args]


def rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "train_log.jsonl").read_text().splitlines()]


def error_line(proc: subprocess.CompletedProcess) -> str:
    """The CLI's one-line reason; nothing else on stderr looks like a traceback."""
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if line.startswith("dspark-ds: error:")]
    assert len(lines) == 1, proc.stderr[-3000:]
    return lines[0]


def trainable(tag: Path) -> dict[str, torch.Tensor]:
    from dspark_ds.engine.checkpoint import checkpoint_trainable_fp32

    return checkpoint_trainable_fp32(tag)


def same_weights(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def assert_same_losses(got: list[dict], ref: list[dict], steps) -> None:
    by_step = {r["step"]: r["loss"] for r in ref}
    for r in got:
        if r["step"] in steps:
            assert r["loss"] == pytest.approx(by_step[r["step"]], rel=1e-6, abs=1e-7), r["step"]


@pytest.mark.distributed
def test_kill9_of_one_rank_during_a_save(target, tmp_path):
    """2 ranks, ZeRO-2: rank 1 is SIGKILLed while writing checkpoint step 8. The resume skips
    the incomplete tag, continues from step 4, and recomputes steps 5-8 exactly."""
    args = train_args(
        target, tmp_path, "k9", "--train.max_steps", "8", "--checkpoint.every_steps", "4"
    )
    proc = torchrun(with_faults([{"kind": "kill_during_save", "step": 8, "rank": 1}], args))
    assert proc.returncode != 0
    ckpts = tmp_path / "k9" / "checkpoints"
    assert (ckpts / "step_00000004" / "COMPLETE").exists()
    assert not (ckpts / "step_00000008" / "COMPLETE").exists()
    uninterrupted = rows(tmp_path / "k9")  # steps 1-8 ran before the kill
    assert [r["step"] for r in uninterrupted] == list(range(1, 9))

    proc = check(torchrun(cli_train([*args, "--checkpoint.resume", "auto"])))
    out = proc.stdout + proc.stderr
    assert "skipping step_00000008: no COMPLETE marker" in out, out[-3000:]
    assert re.search(r"resumed from \S+step_00000004 at step 4", out), out[-3000:]
    again = rows(tmp_path / "k9")
    assert [r["step"] for r in again] == list(range(1, 9))  # the log follows the resumed state
    assert_same_losses(again, uninterrupted, range(1, 9))
    tag = ckpts / "step_00000008"
    assert (tag / "COMPLETE").exists() and (tag / "MANIFEST.json").exists()
    manifest = json.loads((tag / "MANIFEST.json").read_text())["files"]
    assert {f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in (0, 1)} <= set(manifest)


def test_disk_full_during_a_save(target, tmp_path):
    """The file size limit a full disk imposes (RLIMIT_FSIZE) hits checkpoint step 8: one line,
    exit 1, the partial tag removed, step 4 intact and resumable to the same losses."""
    args = train_args(
        target, tmp_path, "full", "--train.max_steps", "8", "--checkpoint.every_steps", "4"
    )
    proc = python(with_faults([{"kind": "fsize_limit", "step": 5, "bytes": 64 * 1024}], args))
    assert proc.returncode == 1, proc.stderr[-3000:]
    line = error_line(proc)
    assert "checkpoint step_00000008 could not be written" in line, line
    assert "step_00000004 is intact" in line and "--checkpoint.resume auto" in line, line
    ckpts = tmp_path / "full" / "checkpoints"
    assert not (ckpts / "step_00000008").exists()
    first = rows(tmp_path / "full")
    assert [r["step"] for r in first] == list(range(1, 9))

    proc = check(python(cli_train([*args, "--checkpoint.resume", "auto"])))
    assert re.search(r"resumed from \S+step_00000004 at step 4", proc.stdout)
    again = rows(tmp_path / "full")
    assert [r["step"] for r in again] == list(range(1, 9))
    assert_same_losses(again, first, range(1, 9))


def test_nonfinite_losses_are_skipped_then_stop_the_run(target, tmp_path):
    """NaN in the first micro-batch of step 3: skipped in place (no update). NaN at steps 6, 7,
    8: three in a row stop the run (exit 1) with a checkpoint of the last finite weights."""
    steps = ["--train.max_steps", "10", "--checkpoint.every_steps", "1"]
    args = train_args(target, tmp_path, "nan", *steps, "--checkpoint.keep_last", "20")
    fault = {"kind": "nonfinite_loss", "steps": [3, 6, 7, 8], "micro_batch": 0}
    proc = python(with_faults([fault], args))
    assert proc.returncode == 1, proc.stderr[-3000:]
    line = error_line(proc)
    assert "non-finite in 3 steps in a row (steps 6-8" in line, line
    assert "step_00000008 holds the last finite weights (those of step 5)" in line, line
    log = rows(tmp_path / "nan")
    assert [r["step"] for r in log] == list(range(1, 9))
    skipped = [r["step"] for r in log if r.get("skipped") == "nonfinite"]
    assert skipped == [3, 6, 7, 8] and all(log[s - 1]["loss"] is None for s in skipped)
    assert all(math.isfinite(r["loss"]) for r in log if r["step"] not in skipped)
    assert log[-1]["train/nonfinite_steps"] == 4
    ckpts = tmp_path / "nan" / "checkpoints"
    w = {s: trainable(ckpts / f"step_{s:08d}") for s in (2, 3, 4, 5, 8)}
    assert same_weights(w[2], w[3]) and not same_weights(w[3], w[4])  # step 3: no update
    assert same_weights(w[5], w[8])
    assert all(torch.isfinite(t).all() for t in w[8].values())


def test_nonfinite_loss_after_accumulated_micro_batches(target, tmp_path):
    """NaN in the second micro-batch (the first is already back-propagated): checkpoint with
    the step skipped, exit 75; the restart continues without that update, never NaN."""
    steps = ["--train.max_steps", "6", "--checkpoint.every_steps", "1"]
    args = train_args(target, tmp_path, "nan2", *steps, "--checkpoint.keep_last", "20")
    proc = python(with_faults([{"kind": "nonfinite_loss", "steps": [3], "micro_batch": 1}], args))
    assert proc.returncode == 75, proc.stderr[-3000:]
    run = tmp_path / "nan2"
    assert (run / "REQUEUE").read_text().strip() == "3"
    ckpts = run / "checkpoints"
    assert same_weights(trainable(ckpts / "step_00000002"), trainable(ckpts / "step_00000003"))
    check(python(cli_train([*args, "--checkpoint.resume", "auto"])))
    log = rows(run)
    assert [r["step"] for r in log] == list(range(1, 7))
    assert [r["step"] for r in log if r.get("skipped")] == [3]
    from safetensors.torch import load_file

    export = load_file(run / "export" / "model.safetensors")
    assert all(torch.isfinite(t).all() for t in export.values())
    assert not (run / "REQUEUE").exists()


@pytest.fixture(scope="module")
def cache_env(target, tmp_path_factory):
    """Prepared chat data (14 samples) and its offline cache, 4 samples per shard."""
    from dspark_ds.data.cache_writer import build_cache
    from dspark_ds.data.config import BuildCacheConfig, DataConfig
    from dspark_ds.target import TargetConfig

    root = tmp_path_factory.mktemp("cache")
    prep = prepare_chat(root, 14, seed=3, tokenizer=target, max_length=64)

    def build(cache_dir: Path, repair: bool = False, on_shard_written=None):
        data = DataConfig(
            paths=[str(prep)],
            mode="offline",
            cache_dir=str(cache_dir),
            samples_per_shard=4,
            num_workers=0,
            max_length=64,
        )
        cfg = BuildCacheConfig(
            data=data,
            target=TargetConfig(path=str(target), dtype="float32"),
            batch_size=4,
            repair=repair,
        )
        return build_cache(cfg, on_shard_written=on_shard_written)

    build(root / "cache")
    return root, build


def offline_args(target: Path, out: Path, name: str, cache: Path, *extra: str) -> list[str]:
    offline = ["--train.synthetic_samples", "0", "--data.mode", "offline"]
    offline += ["--data.cache_dir", str(cache), "--train.max_steps", "null"]
    offline += ["--train.num_epochs", "2", "--checkpoint.every_steps", "0"]
    offline += ["--data.max_length", "64"]
    return train_args(target, out, name, *offline, *extra)


def test_cache_shard_corrupted_between_epochs(target, cache_env, tmp_path):
    """A shard damaged after the cache was checked: the next epoch's check names it and the
    repair; the finished epoch is checkpointed; after `build-cache --repair true` the resumed run
    ends with the losses of an undisturbed run."""
    root, build = cache_env
    cache = tmp_path / "cache"
    shutil.copytree(root / "cache", cache)
    ref = check(python(cli_train(offline_args(target, tmp_path, "ref", cache))))
    assert ref.returncode == 0
    reference = rows(tmp_path / "ref")
    steps = len(reference)
    assert steps == 6  # 14 samples, global batch 4: 3 steps per epoch, 2 epochs

    shard = cache / "shards" / "000002.safetensors"
    intact = shard.read_bytes()
    args = offline_args(target, tmp_path, "bad", cache)
    proc = python(with_faults([{"kind": "corrupt_at_epoch", "epoch": 1, "file": str(shard)}], args))
    assert proc.returncode == 2, proc.stderr[-3000:]
    line = error_line(proc)
    assert "000002.safetensors fails its sha256" in line and "--repair true" in line, line
    assert "step_00000003" in line, line
    assert [r["step"] for r in rows(tmp_path / "bad")] == [1, 2, 3]

    build(cache, repair=True)
    assert shard.read_bytes() == intact
    check(python(cli_train([*args, "--checkpoint.resume", "auto"])))
    again = rows(tmp_path / "bad")
    assert [r["step"] for r in again] == list(range(1, steps + 1))
    assert_same_losses(again, reference, range(1, steps + 1))


def test_cache_shard_truncated_while_building(cache_env, tmp_path):
    """A shard cut short as it was written: the build does not publish the cache (no manifest),
    training refuses it naming the fix, and rerunning build-cache re-makes exactly that shard."""
    from dspark_ds.data.cache import CacheError, TargetCache

    root, build = cache_env
    cache = tmp_path / "cache"

    def truncate(sidecar):
        if sidecar["name"] == "000001":
            path = cache / "shards" / "000001.safetensors"
            path.write_bytes(path.read_bytes()[:100])

    build(cache, on_shard_written=truncate)
    with pytest.raises(CacheError, match=r"no manifest\.json.*rerun build-cache"):
        TargetCache(cache)  # what `train` opens before its first step
    remade = []
    build(cache, on_shard_written=lambda s: remade.append(s["name"]))
    assert remade == ["000001"]
    TargetCache(cache)
    for name in ("000000", "000001", "000002", "000003"):
        a, b = (d / "shards" / f"{name}.safetensors" for d in (cache, root / "cache"))
        assert a.read_bytes() == b.read_bytes(), name


def _wait_for(predicate, proc, what: str, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        assert proc.poll() is None, f"the run ended ({proc.returncode}) before {what}"
        time.sleep(0.1)
    pytest.fail(f"timed out waiting for {what}")


def test_ctrl_c_checkpoints_and_a_damaged_checkpoint_falls_back(target, tmp_path):
    """Ctrl-C: the step finishes, a checkpoint is written, exit 130, no traceback. Then that
    checkpoint is damaged (a truncated file): the resume names it, falls back to the newest
    intact one and recomputes the same losses. Status lines carry the time and the rank, and
    stdout being a pipe gives plain progress lines instead of a bar."""
    run = tmp_path / "int"
    steps = ["--train.max_steps", "40", "--checkpoint.every_steps", "3", "--train.log_every", "1"]
    args = [*train_args(target, tmp_path, "int", *steps)]
    args.remove("--train.progress_bar")
    args.remove("false")
    log = tmp_path / "int.out"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, *cli_train(args)],
            cwd=REPO,
            env=_env(),
            stdout=out,
            stderr=subprocess.STDOUT,
            text=True,
        )
        _wait_for(
            lambda: (run / "train_log.jsonl").exists() and len(rows(run)) >= 4, proc, "4 steps"
        )
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=300)
    text = log.read_text()
    assert proc.returncode == 130, text[-3000:]
    assert "Traceback" not in text and "KeyboardInterrupt" not in text, text[-3000:]
    assert "Ctrl-C: finishing this step and writing a checkpoint" in text
    stopped = rows(run)
    stop = stopped[-1]["step"]
    assert 4 <= stop < 40 and not (run / "REQUEUE").exists()
    assert (run / "checkpoints" / f"step_{stop:08d}" / "COMPLETE").exists()
    status = [line for line in text.splitlines() if "[train]" in line]
    assert status and all(STAMP.match(line) for line in status), status[:5]
    assert any(f"[train] step {stop}/40" in line for line in status)

    # damage the newest checkpoint: the resume falls back to the periodic one before it
    tag = run / "checkpoints" / f"step_{stop:08d}"
    states = tag / "mp_rank_00_model_states.pt"
    states.write_bytes(states.read_bytes()[:1000])
    fallback = (stop - 1) // 3 * 3
    proc = check(python(cli_train([*args, "--checkpoint.resume", "auto"])))
    out = proc.stdout
    assert f"skipping step_{stop:08d}: damaged (mp_rank_00_model_states.pt has 1000 bytes" in out
    assert f"falling back to step_{fallback:08d}" in out, out[-3000:]
    assert (run / "checkpoints" / f"step_{stop:08d}.damaged").is_dir()
    again = rows(run)
    assert [r["step"] for r in again] == list(range(1, 41))
    assert_same_losses(again, stopped, range(1, stop + 1))


def test_second_ctrl_c_stops_at_once(target, tmp_path):
    """A second Ctrl-C during the (slowed) checkpoint ends the process at once, by SIGINT; the
    half-written checkpoint is never taken for a complete one."""
    run = tmp_path / "int2"
    args = train_args(
        target, tmp_path, "int2", "--train.max_steps", "60", "--checkpoint.every_steps", "0"
    )
    log = tmp_path / "int2.out"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, *with_faults([{"kind": "sleep_in_save", "seconds": 120}], args)],
            cwd=REPO,
            env=_env(),
            stdout=out,
            stderr=subprocess.STDOUT,
            text=True,
        )
        _wait_for(lambda: (run / "train_log.jsonl").exists() and rows(run), proc, "a step")
        proc.send_signal(signal.SIGINT)
        _wait_for(lambda: "Ctrl-C: finishing this step" in log.read_text(), proc, "the handler")
        time.sleep(0.5)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGINT, log.read_text()[-3000:]
    assert time.monotonic() - t0 < 30
    assert not list((run / "checkpoints").glob("step_*/COMPLETE"))
