"""Training steps run one at a time, each timed by phase: the public entry point through which
`dspark-ds tune --measure` drives training (tune/measure.py), not the loop of `dspark-ds train`.

    steps = TimedSteps(cfg)           # the Trainer `dspark-ds train` builds for the run config
    steps.step(phases, losses)        # one optimizer step: grad_accum micro-batches
    steps.grad_accum, steps.hpz_partition_size
    steps.close()                     # the run directory released, the engines let go

A step here is the kind's `training_step`, the engine's backward and its step for each
micro-batch, and nothing of the run's bookkeeping: no control all-reduce (a non-finite loss is
not caught), no metrics, validation, signals or checkpoints. The micro-batches come epoch after
epoch (`epochs`), and the epoch the steps' anchors are drawn for stays the trainer's first.
"""

from __future__ import annotations

import gc
import time

import torch

from dspark_ds.config import TrainRunConfig
from dspark_ds.errors import ConfigError
from dspark_ds.train.trainer import Trainer

PHASES = ("batch", "forward", "backward", "engine_step")
"""A step's parts: the next batch (with an in-job target, its forward), the drafter's forward +
loss, the backward, DeepSpeed's step."""


def epochs(source):
    """The source's micro-batches, epoch after epoch: a recipe with little data (the tiny one's
    64 synthetic samples) runs out before many measured steps do."""
    epoch = source.epoch
    while True:
        source.set_epoch(epoch)
        empty = True
        for batch in source:
            empty = False
            yield batch
        if empty:
            raise ConfigError("measure: the recipe's data yields no micro-batch on this rank")
        epoch += 1


class TimedSteps:
    """The trainer of `cfg`, built as `dspark-ds train` builds it (its run directory held until
    `close`), its optimizer steps run one at a time by `step`."""

    def __init__(self, cfg: TrainRunConfig):
        self.trainer = Trainer(cfg)
        self._batches = epochs(self.trainer.source)

    @property
    def grad_accum(self) -> int:
        """Micro-batches per optimizer step."""
        return self.trainer.grad_accum

    @property
    def hpz_partition_size(self) -> int:
        """The ranks of ZeRO-3's secondary partition (hpZ; 1: none, and below ZeRO-3)."""
        engine = self.trainer.engine
        return int(engine.ds.zero_hpz_partition_size()) if engine.zero_stage == 3 else 1

    def step(self, phases: list[float] | None = None, losses: list | None = None) -> None:
        """One optimizer step; `phases` (if given) gets the seconds of each of PHASES added
        (summed over the micro-batches; on CUDA each phase ends with a synchronize), `losses`
        each micro-batch's loss (a detached tensor: no host sync)."""
        trainer = self.trainer
        ctx = trainer.step_context(training=True)
        sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
        for _ in range(trainer.grad_accum):
            t = [time.perf_counter()]
            batch = trainer.on_device(next(self._batches))
            sync()
            t.append(time.perf_counter())
            out = trainer.kind.train.training_step(trainer.engine, batch, ctx)
            sync()
            t.append(time.perf_counter())
            if losses is not None:
                losses.append(out.loss.detach())
            trainer.engine.ds.backward(out.loss)
            sync()
            t.append(time.perf_counter())
            trainer.engine.ds.step()
            sync()
            t.append(time.perf_counter())
            if phases is not None:
                for i in range(len(PHASES)):
                    phases[i] += t[i + 1] - t[i]

    def close(self) -> None:
        """Releases the run directory and destroys the engine (its memory freed for the next
        option's run in the same process)."""
        trainer = self.trainer
        trainer.release_run_dir()
        ds = trainer.engine.ds
        if hasattr(ds, "destroy"):
            ds.destroy()
        trainer.engine = None
        trainer.target = None
        gc.collect()
