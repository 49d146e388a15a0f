"""A training run's metrics logger without tracking, as a test builds it."""

from __future__ import annotations

from pathlib import Path

import torch

from dspark_ds.tracking.mlflow import Tracker
from dspark_ds.train.metrics import MetricsLogger


def metrics_logger(
    run_dir: str | Path,
    *,
    log_every: int,
    total_steps: int,
    rank: int = 0,
    world: int = 1,
    flops=None,
    peak: float | None = None,
) -> MetricsLogger:
    """Rank `rank`'s logger of `world` writing under `run_dir` (MLflow off), its micro-batches'
    metrics the loss alone."""
    tracker = Tracker.for_rank(
        rank,
        enabled=False,
        uri="",
        experiment=None,
        run_name="r",
        run_dir=str(run_dir),
        artifact_location="",
    )
    return MetricsLogger(
        run_dir,
        tracker,
        rank=rank,
        log_every=log_every,
        total_steps=total_steps,
        progress_bar=False,
        device=torch.device("cpu"),
        to_metrics=lambda sums: {"loss": sums["loss"]},
        flops=flops,
        peak_flops=peak,
        world=world,
    )
