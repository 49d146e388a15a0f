"""What a training run reports, and where: one record per optimizer step.

    <run>/train_log.jsonl   rank 0, one row per step: {"step", "time", "loss", "lr"}; on the
                            log steps (every train.log_every) also every metric sent to MLflow
                            ("train/*", "system/*"), and "val/*" on validation steps; a skipped
                            step has "loss": null and "skipped": "nonfinite". After a resume the
                            file holds exactly the rows up to the resumed step (rewritten
                            atomically), so it always follows the checkpointed state.
    MLflow                  the same log-step metrics (window means over train.log_every steps)
    progress                a tqdm bar on a terminal; otherwise a plain line per log step
    summary                 steps, final and best loss / τ, where checkpoints and export went

`log_step` is collective on log steps (tokens, samples and sampler statistics are summed over
the ranks); everything that writes happens on rank 0.
"""

from __future__ import annotations

import json
import math
import os
import resource
import sys
import time
from pathlib import Path

import torch

from dspark_ds import distributed
from dspark_ds.distributed import print0
from dspark_ds.drafters.common.blocks import SAMPLER_STATS

LOG_FILE = "train_log.jsonl"
TAU = "train/tau_probabilistic"


def peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def _clock(seconds: float) -> str:
    s = int(seconds)
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


class _Best:
    """Final and best value of one metric over the run (rows kept from before a resume too)."""

    def __init__(self, key: str, higher_is_better: bool):
        self.key, self.higher = key, higher_is_better
        self.final: tuple[int, float] | None = None
        self.best: tuple[int, float] | None = None

    def add(self, step: int, row: dict) -> None:
        value = row.get(self.key)
        if not isinstance(value, (int, float)) or not math.isfinite(value):
            return
        self.final = (step, float(value))
        if self.best is None or (value > self.best[1] if self.higher else value < self.best[1]):
            self.best = (step, float(value))

    def text(self) -> str | None:
        if self.final is None:
            return None
        (fs, fv), (bs, bv) = self.final, self.best
        return f"{self.key} final {fv:.4g} (step {fs}), best {bv:.4g} (step {bs})"


class MetricsLogger:
    def __init__(
        self,
        run_dir: str | Path,
        tracker,
        *,
        rank: int,
        log_every: int,
        total_steps: int,
        progress_bar: bool,
        device: torch.device,
    ):
        self.path = Path(run_dir) / LOG_FILE
        self.tracker = tracker
        self.rank, self.log_every, self.total_steps = rank, log_every, total_steps
        self.device = device
        # NOTE: a tqdm bar in a Slurm log is one line rewritten with \r thousands of times
        self.use_bar = rank == 0 and progress_bar and sys.stdout.isatty()
        self.bests = [_Best("loss", False), _Best(TAU, True),
                      _Best("val/loss", False), _Best("val/tau_probabilistic", True)]  # fmt: skip
        self.sampler_sums = [0.0] * (len(SAMPLER_STATS) + 1)  # + the sample count
        self._file = None
        self._bar = None
        self._reset_window()

    # ---- the log follows the state -----------------------------------------------------------
    def start(self, step: int) -> None:
        """Rank 0: keep the rows of steps <= `step` (the state the run continues from), drop the
        rest (steps a resumed run will redo, a torn last line), then append from there."""
        self.start_step, self.t_start = step, time.perf_counter()
        self._reset_window()
        if self.rank != 0:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        kept = []
        if self.path.exists():
            for line in self.path.read_text().splitlines():
                try:
                    row = json.loads(line)
                except ValueError:
                    continue
                if (
                    isinstance(row, dict)
                    and isinstance(row.get("step"), int)
                    and row["step"] <= step
                ):
                    kept.append(line)
                    for best in self.bests:
                        best.add(row["step"], row)
            tmp = self.path.with_name(self.path.name + ".tmp")
            tmp.write_text("".join(line + "\n" for line in kept))
            os.replace(tmp, self.path)
        self._file = open(self.path, "a")
        if self.use_bar:
            from tqdm import tqdm

            self._bar = tqdm(total=self.total_steps, initial=step, desc="train", unit="step",
                             dynamic_ncols=True, file=sys.stdout)  # fmt: skip

    def sync(self) -> None:
        """Rank 0: the rows so far on disk (before a checkpoint that includes their steps)."""
        if self._file is not None:
            self._file.flush()
            os.fsync(self._file.fileno())

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        if self._file is not None:
            self._file.close()
            self._file = None

    # ---- per micro-batch / per step ------------------------------------------------------------
    def _reset_window(self) -> None:
        self.window: dict[str, float] = {}
        self.window_steps, self.tokens, self.samples = 0, 0, 0
        self.t0 = time.perf_counter()

    def add_micro_batch(self, batch: dict) -> None:
        self.tokens += int(batch["attention_mask"].sum())
        self.samples += int(batch["input_ids"].shape[0])

    def add_sampler_stats(self, sums: list[float]) -> None:
        self.sampler_sums = [a + b for a, b in zip(self.sampler_sums, sums)]

    def log_step(
        self,
        step: int,
        metrics: dict[str, float] | None,
        val: dict[str, float],
        *,
        lr: float,
        epoch: int,
        grad_norm: float | None,
        counters: dict[str, float],
    ) -> None:
        """Collective on log steps. `metrics`: the step's means over its micro-batches, or None
        for a skipped step; `val`: validation metrics of this step ({} if none)."""
        if metrics is not None:
            for k, v in metrics.items():
                self.window[k] = self.window.get(k, 0.0) + v
            self.window_steps += 1
        row: dict = {"step": step, "time": round(time.time(), 3),
                     "loss": None if metrics is None else metrics["loss"], "lr": lr}  # fmt: skip
        if metrics is None:
            row["skipped"] = "nonfinite"
        logged: dict[str, float] = {}
        if step % self.log_every == 0 or step == self.total_steps:
            logged = self._window_metrics(lr, epoch, grad_norm, counters)
            row.update(logged)
        row.update(val)
        if self.rank != 0:
            return
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()
        for best in self.bests:
            best.add(step, row)
        if logged:
            self.tracker.log_metrics(logged, step=step)
        if val:
            self.tracker.log_metrics(val, step=step)
        self._progress(step, row)

    def _window_metrics(self, lr, epoch, grad_norm, counters) -> dict[str, float]:
        all_tokens, all_samples, *sampler = distributed.all_reduce_values(
            [self.tokens, self.samples, *self.sampler_sums]
        )
        elapsed = max(time.perf_counter() - self.t0, 1e-9)
        logged = {f"train/{k}": v / self.window_steps for k, v in self.window.items()}
        if sampler[-1] > 0:  # samples seen by the anchor sampler (DSpark / DFlash)
            logged.update({f"train/{k}": v / sampler[-1] for k, v in zip(SAMPLER_STATS, sampler)})
        self.sampler_sums = [0.0] * (len(SAMPLER_STATS) + 1)
        logged.update({
            "train/lr": lr,
            "train/epoch": epoch,
            **{f"train/{k}": v for k, v in counters.items()},
            "system/tokens_per_s": all_tokens / elapsed,
            "system/samples_per_s": all_samples / elapsed,
            "system/peak_memory_mb": peak_memory_mb(self.device),
        })  # fmt: skip
        if grad_norm is not None and self.window_steps:
            logged["train/grad_norm"] = grad_norm
        self._reset_window()
        return logged

    def _progress(self, step: int, row: dict) -> None:
        loss = "skipped (non-finite)" if row["loss"] is None else f"{row['loss']:.4f}"
        if self._bar is not None:
            self._bar.update(step - self._bar.n)
            self._bar.set_postfix(loss=loss, tau=f"{row.get(TAU, 0):.2f}")
            return
        if "system/tokens_per_s" not in row:  # plain lines on log steps only
            return
        done = step - self.start_step
        elapsed = time.perf_counter() - self.t_start
        left = elapsed / done * (self.total_steps - step) if done else 0.0
        parts = [
            f"[train] step {step}/{self.total_steps} ({100 * step / self.total_steps:.0f}%)",
            f"loss {loss}",
        ]
        if TAU in row:
            parts.append(f"tau {row[TAU]:.3f}")
        if "val/loss" in row:
            parts.append(f"val/loss {row['val/loss']:.4f}")
        parts += [
            f"lr {row['lr']:.3g}",
            f"{row['system/tokens_per_s']:.0f} tok/s",
            f"{_clock(elapsed)} elapsed, {_clock(left)} left",
        ]
        print0(" | ".join(parts))

    # ---- the end -------------------------------------------------------------------------------
    def summary(self, lines: list[str]) -> None:
        """Rank 0: the end-of-run summary, `lines` (what happened) then the metrics."""
        if self.rank != 0:
            return
        for best in self.bests:
            text = best.text()
            if text is not None:
                lines.append(text)
        print0("\n".join(f"[train] {line}" for line in lines))
