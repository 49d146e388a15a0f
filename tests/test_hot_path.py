"""The training step's own collectives, counted in a real 2-rank run (tiny recipe, ZeRO-2, gloo,
20 steps, log_every 10, validation every 10) by wrapping torch.distributed's functions
(tests/helpers/collectives.py): per step the loss's denominators and one control all_reduce
(finiteness and signals); metric sums, token counts, sampler statistics and validation are
summed over the ranks once per log step. Checkpoint saves and the export are not counted."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers.dist import REPO, check, torchrun
from helpers.tiny_models import build_tiny_target

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

COUNTER = str(REPO / "tests" / "helpers" / "collectives.py")
STEPS = 20


def test_two_collectives_per_step_and_one_per_log_step(tmp_path):
    target = build_tiny_target(tmp_path / "target")
    result = tmp_path / "collectives.json"
    args = [
        COUNTER, str(result), "--config", "tiny_cpu", "--target.path", str(target),
        "--output_dir", str(tmp_path / "runs"), "--name", "hot", "--tracking.enabled", "false",
        "--train.progress_bar", "false", "--deepspeed.config", "zero2",
        "--train.max_steps", str(STEPS), "--train.log_every", "10",
        "--validation.every_steps", "10",
    ]  # fmt: skip
    check(torchrun(args))
    data = json.loads(result.read_text())
    assert data["steps"] == STEPS and sorted(map(int, data["losses"])) == list(range(1, 21))
    # by the package function that called into dspark_ds.distributed
    by_caller: dict[str, int] = {}
    for site, count in data["collectives"].items():
        caller = site.split(" < ")[1]
        by_caller[caller] = by_caller.get(caller, 0) + count
    assert by_caller == {
        "drafters/dspark/loss.py:plan_loss": STEPS,  # the loss's denominators
        "train/trainer.py:_control": STEPS,  # finite on every rank? a signal?
        "train/metrics.py:sum_over_ranks": 2,  # the two log steps (with their validation)
    }, data["collectives"]
    assert sum(by_caller.values()) / STEPS <= 2.2
    assert all(site.startswith("all_reduce ") for site in data["collectives"])
    # the rows written at the log steps: every step, losses and the validation metrics
    log = Path(tmp_path / "runs" / "hot" / "train_log.jsonl").read_text()
    rows = [json.loads(line) for line in log.splitlines()]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert all(r["loss"] == pytest.approx(data["losses"][str(r["step"])]) for r in rows)
    assert {r["step"] for r in rows if "val/loss" in r} == {10, 20}
