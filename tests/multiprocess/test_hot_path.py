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

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

COUNTER = str(REPO / "tests" / "helpers" / "collectives.py")
STEPS = 20


def test_two_collectives_per_step_and_one_per_log_step(tmp_path, tiny_target):
    target = tiny_target
    result = tmp_path / "collectives.json"
    args = [COUNTER, str(result), "--config", "tiny_cpu", "--target.path", str(target)]
    args += ["--output_dir", str(tmp_path / "runs"), "--name", "hot", "--tracking.enabled", "false"]
    args += ["--train.progress_bar", "false", "--deepspeed.config", "zero2"]
    args += ["--train.max_steps", str(STEPS), "--train.log_every", "10"]
    args += ["--validation.every_steps", "10"]
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


def _metrics_both_ways(rank: int, world: int, result_file: str) -> None:
    """On each rank's half of a batch: the reference's float metrics (one fp32 all_reduce per
    call) and the trainer's (several micro-batches' sums packed into one all_reduce)."""
    import torch

    from dspark_ds.drafters.dspark.blocks import sample_anchor_positions
    from dspark_ds.drafters.dspark.config import DSPARK_LOSS
    from dspark_ds.drafters.dspark.loss import compute_dspark_loss, dspark_loss, dspark_metrics
    from dspark_ds.train.metrics import metrics_of, sum_over_ranks

    from helpers.drafters import random_batch, tiny_drafter

    model = tiny_drafter(markov_head_type="rnn")
    reference, outputs = [], []
    for seed in (1, 2, 3):  # three micro-batches
        batch = random_batch(model, batch=4, seq_len=20, seed=seed)
        batch["loss_mask"][1, : 5 + 4 * seed] = 0
        anchors, keep = sample_anchor_positions(
            batch["loss_mask"], model.num_anchors, torch.Generator().manual_seed(seed)
        )
        rows = slice(rank * 2, rank * 2 + 2)
        part = {k: v[rows] for k, v in batch.items()}
        with torch.no_grad():
            out = model(**part, anchor_positions=anchors[rows], block_keep_mask=keep[rows])
            reference.append(compute_dspark_loss(out, **vars(DSPARK_LOSS)))
            outputs.append(dspark_loss(out, DSPARK_LOSS))
    summed = sum_over_ranks([o.sums for o in outputs])
    logged = metrics_of(outputs, summed, lambda g: dspark_metrics(g, DSPARK_LOSS))
    if rank == 0:
        Path(result_file).write_text(
            json.dumps({"reference": [m for _, m in reference], "logged": logged})
        )
        for (ref_loss, _), o in zip(reference, outputs):
            assert torch.equal(ref_loss, o.loss)


def test_logged_metrics_are_the_references_exactly(tmp_path):
    """2 gloo ranks: metrics from sums reduced once for many micro-batches (packed as fp64) are
    bit for bit the reference's, whose fp32 sums are reduced per call."""
    from helpers.dist import run_distributed

    result = tmp_path / "metrics.json"
    run_distributed(_metrics_both_ways, world_size=2, args=(str(result),))
    data = json.loads(result.read_text())
    assert len(data["logged"]) == 3 and data["logged"] == data["reference"]
    assert data["logged"][0]["supervised_tokens"] > 0


def _wait_share(rank: int, world: int, run_dir: str) -> None:
    """A log step after rank 1 waited 0.9 s of a 1 s window for its data, while rank 0's window
    began only 0.1 s before (rank 0 reached `start` later: rank 1 waited for it)."""
    import time

    import torch

    from dspark_ds.drafters.kind import StepOutput

    from helpers.metrics import metrics_logger

    logger = metrics_logger(run_dir, log_every=1, total_steps=1, rank=rank, world=world)
    logger.start(0)
    logger.t0 = time.perf_counter() - (1.0 if rank == 1 else 0.1)
    logger.add_data_wait(0.9 if rank == 1 else 0.0)
    out = StepOutput.of(torch.tensor(1.0), {"loss": torch.tensor(1.0)})
    logger.log_step(1, [out], None, lr=1e-4, epoch=0, grad_norm=lambda: None, counters={})
    logger.close()


def test_the_wait_share_is_each_ranks_over_its_own_window(tmp_path):
    """2 gloo ranks whose windows differ: the logged share is the mean of each rank's (0.9 of
    rank 1's second, none of rank 0's), not their summed waits over rank 0's window (4.5)."""
    from helpers.dist import run_distributed

    run_distributed(_wait_share, world_size=2, args=(str(tmp_path),))
    (row,) = [json.loads(line) for line in (tmp_path / "train_log.jsonl").read_text().splitlines()]
    assert row["data/wait_share"] == pytest.approx(0.45, abs=0.03)
