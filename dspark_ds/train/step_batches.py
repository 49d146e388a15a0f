"""A step's micro-batches: the run's batch source (train/batches.py) read `grad_accum`
micro-batches a step, the time each kept the step waiting (to the metrics), and the stop when
they cannot come, after a checkpoint of every finished step (the data rewound to the start of
the step that could not run, so a resume runs it).

Served features are fetched a step ahead (`fetch_step`): every rank agrees that all of the
step's micro-batches arrived (one flag), so that a fleet failure stops every rank at the same
step (`DataUnavailable`, exit 1). A cache found damaged when a step begins (`CacheError`) stops
the run the same way, naming the repair.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import torch

from dspark_ds import distributed
from dspark_ds.data.cache import CacheError
from dspark_ds.data.served import DataUnavailable
from dspark_ds.train.metrics import MetricsLogger

StepStart = tuple[int, dict]
"""Where a step began: the epoch and the batch source's state (`source.state_dict()`)."""


class StepBatches:
    """The micro-batches of each step, from `source`; `save_from(at_start)` checkpoints the
    finished steps with the data rewound to `at_start` and returns the checkpoint's tag."""

    def __init__(
        self,
        source,
        grad_accum: int,
        metrics: MetricsLogger,
        *,
        fetch_ahead: bool,
        save_from: Callable[[StepStart], Path],
    ):
        self.source, self.grad_accum, self.metrics = source, grad_accum, metrics
        self.fetch_ahead = fetch_ahead
        """Collective: the step's micro-batches are fetched before it starts (`fetch_step`)."""
        self.save_from = save_from
        self._iter = None

    def start(self, epoch: int) -> None:
        """Reads the source from `epoch`, at its position (where a checkpoint left it, or the
        epoch's start)."""
        self.source.set_epoch(epoch)
        self._iter = iter(self.source)

    def next_batch(self, i: int, at_start: StepStart) -> dict:
        """The step's micro-batch `i`; the time it kept the step waiting goes to the metrics."""
        t0 = time.perf_counter()
        try:
            batch = next(self._iter)
        except CacheError as err:  # every rank (the cache's checks are collective)
            if i > 0:
                raise
            self._save_before_data_error(at_start, err)
        self.metrics.add_data_wait(time.perf_counter() - t0)
        return batch

    def skip(self, count: int) -> None:
        """Drops the next `count` micro-batches (a skipped step's others go with it)."""
        for _ in range(count):
            next(self._iter)

    def fetch_step(self, at_start: StepStart) -> list[dict]:
        """Collective (served features): the step's micro-batches, once every rank has all of
        its own; when a rank could not get one, every rank checkpoints the finished steps and
        stops with the reason (`DataUnavailable`), exit 1."""
        t0 = time.perf_counter()
        batches, failure = [], None
        try:
            for _ in range(self.grad_accum):
                batches.append(next(self._iter))
        except DataUnavailable as err:
            failure = err
        flag = torch.tensor([float(failure is not None)], device=distributed.collective_device())
        if distributed.all_reduce_(flag, op="max").item():
            self._stop_for_data(at_start, failure)
        self.metrics.add_data_wait(time.perf_counter() - t0)
        return batches

    def _stop_for_data(self, at_start: StepStart, failure: Exception | None) -> None:
        self.close()
        tag = self.save_from(at_start)
        why = str(failure) if failure is not None else "[data] served: another rank's data failed"
        raise DataUnavailable(
            f"{why} (checkpoint {tag} holds every finished step; once the servers are back, "
            "--checkpoint.resume auto continues from it)"
        )

    def _save_before_data_error(self, at_start: StepStart, err: Exception) -> None:
        """A cache found damaged when a step begins (e.g. at an epoch start): checkpoint the
        finished steps (data rewound to this step's start), then the one-line error."""
        tag = self.save_from(at_start)
        raise CacheError(
            f"{err} (checkpoint {tag} holds every finished step; after the repair, "
            "--checkpoint.resume auto continues from it)"
        ) from None

    def close(self) -> None:
        """Ends the batch iterator (a served one lets its requests in flight finish and deletes
        their files)."""
        close = getattr(self._iter, "close", None)
        if close is not None:
            close()
