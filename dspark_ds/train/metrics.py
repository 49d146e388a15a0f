"""What a training run reports, and where: one record per optimizer step.

    <run>/train_log.jsonl   rank 0, one row per step: {"step", "time", "loss", "lr"}; on the
                            log steps (every train.log_every) also every metric sent to MLflow
                            ("train/*", "system/*" with every node's system/node<k>/*), and
                            "val/*" on validation steps; a skipped
                            step has "loss": null and "skipped": "nonfinite". After a resume the
                            file holds exactly the rows up to the resumed step (rewritten
                            atomically), so it always follows the checkpointed state.
    MLflow                  the same log-step metrics (window means over train.log_every steps),
                            queued to the tracker's background sender (tracking/sender.py),
                            which reads them back from train_log.jsonl if it had to drop them
    progress                a tqdm bar on a terminal; otherwise a plain line per log step
    summary                 steps, final and best loss / τ, where checkpoints and export went

The hot path stays on the device: a step hands over its micro-batches' `StepOutput`s (metric
sums not yet reduced) and those of a validation after it; token counts and sampler statistics
stay tensors. The rows wait until a log step, or a checkpoint (`sync`), sums them over the
ranks in ONE all_reduce and reads them back; then they are written. `log_step` is collective on
log steps, `sync` always; everything that writes happens on rank 0.
"""

from __future__ import annotations

import json
import math
import os
import resource
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from tqdm import tqdm

from dspark_ds import distributed
from dspark_ds.distributed import print0
from dspark_ds.drafters.kind import SAMPLER_STATS, StepOutput

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


def sum_over_ranks(parts: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each tensor summed over every rank, in one all_reduce; returned in its own dtype.

    NOTE: packed as fp64. Two fp32 values summed in fp64 and rounded once to fp32 give exactly
    the fp32 sum, so the metrics are those of one fp32 all_reduce per tensor (over more ranks
    the fp64 sum is the more accurate one)."""
    if not parts:
        return []
    flat = torch.cat([p.reshape(-1).to(torch.float64) for p in parts])
    flat = distributed.all_reduce_(flat)
    out, at = [], 0
    for p in parts:
        out.append(flat[at : at + p.numel()].view(p.shape).to(p.dtype))
        at += p.numel()
    return out


def metrics_of(
    outputs: list[StepOutput], summed: list[torch.Tensor], to_metrics: Callable
) -> list[dict[str, float]]:
    """Each micro-batch's metrics, from its sums over the ranks (`to_metrics`)."""
    return [to_metrics(dict(zip(o.names, sums.tolist()))) for o, sums in zip(outputs, summed)]


def step_metrics(
    outputs: list[StepOutput], summed: list[torch.Tensor], to_metrics: Callable
) -> dict[str, float]:
    """A training step's metrics: means over its micro-batches."""
    means: dict[str, float] = {}
    for metrics in metrics_of(outputs, summed, to_metrics):
        for k, v in metrics.items():
            means[k] = means.get(k, 0.0) + float(v) / len(outputs)
    return means


def validation_metrics(
    outputs: list[StepOutput], summed: list[torch.Tensor], to_metrics: Callable
) -> dict[str, float]:
    """A validation's metrics ("val/..."): means over its held-out micro-batches."""
    return {f"val/{k}": v for k, v in step_metrics(outputs, summed, to_metrics).items()}


def _sums_only(outputs: list[StepOutput] | None) -> list[StepOutput] | None:
    """The outputs without their autograd graphs (a waiting row must not keep them alive)."""
    if outputs is None:
        return None
    return [replace(o, loss=o.loss.detach(), sampler_sums=None) for o in outputs]


@dataclass
class _Pending:
    """A step's row, waiting for its metrics."""

    row: dict
    outputs: list[StepOutput] | None
    """Its micro-batches' outputs; None for a skipped step."""
    validation: list[StepOutput] | None
    """The outputs of a validation run after it, if any."""
    window: tuple | None = None
    """On a log step: (lr, epoch, grad norm, counters) for the window's metrics."""


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
        to_metrics: Callable[[dict[str, float]], dict[str, float]],
        nodes=None,
        flops: Callable[[float, float, float | None], float] | None = None,
        peak_flops: float | None = None,
        world: int = 1,
        fleet_counts: Callable[[], tuple[int, int]] | None = None,
    ):
        """`to_metrics`: a micro-batch's metric sums (over the ranks) -> its metrics (the
        drafter kind's `metrics`). `nodes`: every node's monitor figures (tracking/system.py
        `NodeMetrics`), reduced with the log step's counts. `flops(sequences, tokens,
        anchors_per_sequence)`: the model FLOPs of a window over every rank (cost/flops.py
        `WindowFlops`), shared by the `world` ranks; `peak_flops`: one rank's peak, for MFU
        (None: no MFU). `fleet_counts()`: the sequences and tokens a served target's fleet has
        delivered to this rank so far (served mode)."""
        self.path = Path(run_dir) / LOG_FILE
        self.tracker = tracker
        self.rank, self.log_every, self.total_steps = rank, log_every, total_steps
        self.device = device
        self.to_metrics = to_metrics
        self.nodes = nodes
        self.flops, self.peak_flops, self.world = flops, peak_flops, world
        self.fleet_counts = fleet_counts
        self._fleet_seen = (0, 0)
        # NOTE: a tqdm bar in a Slurm log is one line rewritten with \r thousands of times
        self.use_bar = rank == 0 and progress_bar and sys.stdout.isatty()
        self.bests = [
            _Best("loss", False),
            _Best(TAU, True),
            _Best("val/loss", False),
            _Best("val/tau_probabilistic", True),
        ]
        self.losses: dict[int, float] = {}
        """The training loss of every step written so far (skipped steps absent)."""
        self.val_metrics: dict[str, float] = {}
        """The metrics of the last validation written so far."""
        self._pending: list[_Pending] = []
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
            self._bar = tqdm(
                total=self.total_steps,
                initial=step,
                desc="train",
                unit="step",
                dynamic_ncols=True,
                file=sys.stdout,
            )

    def sync(self) -> None:
        """Collective: the rows so far on disk (before a checkpoint that includes their steps)."""
        self._write_pending()
        if self._file is not None:
            self._file.flush()
            os.fsync(self._file.fileno())

    def close(self) -> None:
        if self.nodes is not None:
            self.nodes.close()
            self.nodes = None
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        if self._file is not None:
            self._file.close()
            self._file = None

    # ---- per micro-batch / per step ------------------------------------------------------------
    def _reset_window(self) -> None:
        self.window: dict[str, float] = {}
        self.window_steps, self.samples = 0, 0
        self.steps_in_window = 0  # optimizer steps in its wall time, skipped ones included
        self.tokens = torch.zeros((), dtype=torch.float64, device=self.device)
        self.data_wait_s = 0.0
        self.sampler_sums = torch.zeros(
            len(SAMPLER_STATS) + 1, dtype=torch.float64, device=self.device
        )
        self.t0 = time.perf_counter()

    def _window_s(self) -> float:
        """Seconds since this rank's window began."""
        return max(time.perf_counter() - self.t0, 1e-9)

    def add_micro_batch(self, batch: dict) -> None:
        """A micro-batch that was trained on (its tokens stay a tensor until a log step)."""
        self.tokens += batch["attention_mask"].sum().to(self.tokens.device, torch.float64)
        self.samples += int(batch["input_ids"].shape[0])

    def add_data_wait(self, seconds: float) -> None:
        """Time the step waited for its next micro-batch (online: the in-job target's forward)."""
        self.data_wait_s += seconds

    def _data_counts(self) -> list[float]:
        """The share of this rank's window spent waiting for data, and the fleet's deliveries
        to this rank since the last call."""
        seqs = toks = 0
        if self.fleet_counts is not None:
            now = self.fleet_counts()
            seqs, toks = now[0] - self._fleet_seen[0], now[1] - self._fleet_seen[1]
            self._fleet_seen = now
        # NOTE: over this rank's own window: the ranks do not start theirs at one moment (the
        # run's first one starts when a rank reaches `start`), and a rank that waited in the
        # step's first collective for a later one counted that wait over a longer window than
        # rank 0's: the ranks' summed waits over rank 0's window came out above 1
        wait_share = self.data_wait_s / self._window_s()
        return [wait_share, float(seqs), float(toks)]

    def add_sampler_sums(self, sums: torch.Tensor | None) -> None:
        if sums is not None:
            self.sampler_sums += sums.to(self.sampler_sums.device)

    def log_step(
        self,
        step: int,
        outputs: list[StepOutput] | None,
        validation: list[StepOutput] | None,
        *,
        lr: float,
        epoch: int,
        grad_norm: Callable[[], float | None],
        counters: dict[str, float],
    ) -> None:
        """Collective on log steps. `outputs`: the step's micro-batches, or None for a skipped
        step; `validation`: the held-out batches of a validation after this step (None if
        none); `grad_norm` is read on log steps only."""
        row: dict = {"step": step, "time": round(time.time(), 3), "loss": None, "lr": lr}
        if outputs is None:
            row["skipped"] = "nonfinite"
        pending = _Pending(row, _sums_only(outputs), _sums_only(validation))
        self._pending.append(pending)
        self.steps_in_window += 1
        if step % self.log_every == 0 or step == self.total_steps:
            pending.window = (lr, epoch, grad_norm(), counters)
            self._write_pending(with_window=True)

    def _write_pending(self, with_window: bool = False) -> None:
        """Reduces the waiting steps' sums (and, `with_window`, the window's counts) in one
        all_reduce, then writes their rows."""
        pending, self._pending = self._pending, []
        stats = [out.sums for p in pending for out in (p.outputs or []) + (p.validation or [])]
        counts = []
        if with_window:
            samples = torch.full((1,), float(self.samples), dtype=torch.float64, device=self.device)
            data = torch.tensor(self._data_counts(), dtype=torch.float64, device=self.device)
            counts = [self.tokens.view(1), samples, data, self.sampler_sums]
            if self.nodes is not None:
                counts.append(self.nodes.part().view(-1))
        if not stats and not counts:
            return
        summed = sum_over_ranks([*stats, *counts])
        node_values = {}
        if with_window and self.nodes is not None:
            node_values = self.nodes.metrics(summed.pop().tolist())
        counts = torch.cat(summed[len(stats) :]).tolist() if with_window else []
        summed = iter(summed[: len(stats)])
        for p in pending:
            if p.outputs:
                sums = [next(summed) for _ in p.outputs]
                metrics = step_metrics(p.outputs, sums, self.to_metrics)
                for k, v in metrics.items():
                    self.window[k] = self.window.get(k, 0.0) + v
                self.window_steps += 1
                p.row["loss"] = self.losses[p.row["step"]] = metrics["loss"]
            val = {}
            if p.validation is not None:
                sums = [next(summed) for _ in p.validation]
                val = self.val_metrics = validation_metrics(p.validation, sums, self.to_metrics)
            logged = {}
            if p.window is not None:
                logged = {**self._window_metrics(counts, *p.window), **node_values}
            self._write(p.row, logged, val)

    def _write(self, row: dict, logged: dict[str, float], val: dict[str, float]) -> None:
        row.update(logged)
        row.update(val)
        if self.rank != 0:
            return
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()
        for best in self.bests:
            best.add(row["step"], row)
        if logged or val:  # stamped with the row's time: a replay from this file is the same
            self.tracker.log_metrics(
                {**logged, **val}, step=row["step"], timestamp=row["time"], in_log=True
            )
        self._progress(row["step"], row)

    def _window_metrics(self, counts, lr, epoch, grad_norm, counters) -> dict[str, float]:
        """The log step's metrics: window means and rates. `counts`: the window's tokens,
        samples and sampler statistics, summed over the ranks."""
        all_tokens, all_samples, wait_shares, fleet_seqs, fleet_tokens, *sampler = counts
        elapsed = self._window_s()
        logged = {f"train/{k}": v / self.window_steps for k, v in self.window.items()}
        if sampler[-1] > 0:  # samples seen by the anchor sampler (DSpark / DFlash)
            logged.update({f"train/{k}": v / sampler[-1] for k, v in zip(SAMPLER_STATS, sampler)})
        step_figures = {
            "train/lr": lr,
            "train/epoch": epoch,
            **{f"train/{k}": v for k, v in counters.items()},
            "system/tokens_per_s": all_tokens / elapsed,
            "system/samples_per_s": all_samples / elapsed,
            "system/peak_memory_mb": peak_memory_mb(self.device),
            "data/wait_share": wait_shares / self.world,
        }
        logged.update(step_figures)
        if self.fleet_counts is not None:
            logged["data/served_sequences_per_s"] = fleet_seqs / elapsed
            logged["data/served_tokens_per_s"] = fleet_tokens / elapsed
        if grad_norm is not None and self.window_steps:
            logged["train/grad_norm"] = grad_norm
        logged.update(self._throughput(elapsed, all_samples, all_tokens, sampler))
        self._reset_window()
        return logged

    def _throughput(self, elapsed: float, samples: float, tokens: float, sampler: list[float]):
        """The window's mean step time and its model FLOP/s per rank (and MFU against the
        peak), from counts summed over the ranks: nothing more is read from the device."""
        out = {"system/step_s": elapsed / max(self.steps_in_window, 1)}
        if self.flops is None:
            return out
        at = SAMPLER_STATS.index("sampled_anchors_abs")
        anchors = sampler[at] / sampler[-1] if sampler[-1] > 0 else None
        achieved = self.flops(samples, tokens, anchors) / self.world / elapsed
        out["system/tflops_per_gpu"] = achieved / 1e12
        if self.peak_flops:
            out["system/mfu"] = achieved / self.peak_flops
        return out

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
        parts += [f"lr {row['lr']:.3g}", f"{row['system/tokens_per_s']:.0f} tok/s"]
        if "system/tflops_per_gpu" in row:
            mfu = f" (MFU {row['system/mfu']:.1%})" if "system/mfu" in row else ""
            parts.append(f"{row['system/tflops_per_gpu']:.3g} TFLOP/s per GPU{mfu}")
        parts += [
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
