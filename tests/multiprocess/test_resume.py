"""A resumed run under changed options (issue: resume accepts a changed config). What would
change what the checkpoint means is refused by name (exit 2, saved vs new values); the run's
length may change, and the learning rate then continues without a jump; a moved target is
fine, another target is not."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from helpers.dist import REPO, check, python
from helpers.tiny_models import build_tiny_target, write_chat_jsonl

pytestmark = [pytest.mark.slow]

RECIPE = str(REPO / "dspark_ds" / "recipes" / "tiny_cpu.yaml")


def args(target, out: Path, *extra: str) -> list[str]:
    argv = ["-m", "dspark_ds.cli", "train", "--config", RECIPE, "--target.path", str(target)]
    argv += ["--output_dir", str(out), "--name", "run", "--train.progress_bar", "false"]
    argv += ["--validation.every_steps", "0", "--checkpoint.every_steps", "3", *extra]
    return argv


def rows(out: Path) -> list[dict]:
    return [json.loads(x) for x in (out / "run" / "train_log.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def saved(tmp_path_factory, tiny_target):
    """A 6-step run (checkpoints at 3 and 6) to resume; each test resumes a copy of it."""
    root = tmp_path_factory.mktemp("resume")
    target = Path(tiny_target)
    check(python(args(target, root / "runs", "--train.max_steps", "6")))
    return root, target


@pytest.fixture
def copy(saved, tmp_path):
    root, target = saved
    shutil.copytree(root / "runs", tmp_path / "runs")
    return tmp_path / "runs", target


def one_error_line(proc) -> str:
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    [line] = [x for x in proc.stderr.splitlines() if x.startswith("dspark-ds: error:")]
    return line


def test_changes_of_meaning_are_refused(copy, tmp_path):
    """Each of these was accepted before: block size 4 -> 1 exported a config.json saying 1 for
    weights trained with 4; markov_rank gave a raw state-dict size traceback; synthetic data ->
    chat files a KeyError: 'samples_consumed'. Now one line names every one, nothing touched."""
    out, target = copy
    chat = write_chat_jsonl(tmp_path / "chat.jsonl", 8, seed=0)
    before = sorted(p.name for p in (out / "run" / "checkpoints").iterdir())
    change = ["--model.block_size", "1", "--model.markov_rank", "8"]
    change += ["--train.synthetic_samples", "0", "--data.paths", f"[{chat}]"]
    argv = args(target, out, "--train.max_steps", "6", "--checkpoint.resume", "auto", *change)
    proc = python(argv)
    line = one_error_line(proc)
    assert "step_00000006 was trained with other settings" in line, line
    for named in (
        "model.block_size (saved 4, now 1)",
        "model.markov_rank (saved 16, now 8)",
        "train.synthetic_samples (saved 256, now 0)",
        f"data.paths (saved [], now ['{chat}'])",
    ):
        assert named in line, (named, line)
    assert "--model.init_from" in line
    assert sorted(p.name for p in (out / "run" / "checkpoints").iterdir()) == before


def test_another_target_is_refused(copy, tmp_path):
    out, target = copy
    other = build_tiny_target(tmp_path / "other", hidden_size=64)
    proc = python(args(other, out, "--train.max_steps", "6", "--checkpoint.resume", "auto"))
    line = one_error_line(proc)
    assert (
        "target.path: the drafter built from" in line and "hidden_size (saved 32, now 64)" in line
    )


def test_longer_run_continues_the_learning_rate(copy, tmp_path):
    """max_steps 6 -> 12, resumed from the step-3 checkpoint with a moved copy of the same
    target: the rate goes on from where it was, never rises, and ends near lr x min_lr_ratio;
    MLflow is told; the newer step-6 checkpoint is set aside, not deleted."""
    out, target = copy
    moved = tmp_path / "moved_target"
    shutil.copytree(target, moved)
    first = rows(out)
    tag = out / "run" / "checkpoints" / "step_00000003"
    proc = check(
        python(args(moved, out, "--train.max_steps", "12", "--checkpoint.resume", str(tag)))
    )
    assert "train.max_steps (saved 6, now 12)" in proc.stdout, proc.stdout[-3000:]
    assert f"target.path (saved '{target}', now '{moved}')" in proc.stdout
    assert "step_00000006 set aside as step_00000006.abandoned" in proc.stdout
    assert (out / "run" / "checkpoints" / "step_00000006.abandoned" / "COMPLETE").exists()
    log = rows(out)
    assert [r["step"] for r in log] == list(range(1, 13))
    assert [r["loss"] for r in log[:3]] == [r["loss"] for r in first[:3]]
    assert log[3]["lr"] == pytest.approx(first[3]["lr"])  # step 4: the rate it had
    lrs = [r["lr"] for r in log[2:]]
    assert all(b < a for a, b in zip(lrs, lrs[1:])), lrs
    assert lrs[-1] < 0.1 * lrs[0]
    from mlflow.tracking import MlflowClient

    run_id = (out / "run" / "mlflow_run_id").read_text().strip()
    tags = MlflowClient(tracking_uri=f"sqlite:///{out / 'mlflow.db'}").get_run(run_id).data.tags
    assert tags["changed_on_resume.train.max_steps"] == "6 -> 12 at step 3"
    assert tags["total_steps"] == "12"
    config = json.loads((out / "run" / "export" / "config.json").read_text())
    assert config["block_size"] == 4
