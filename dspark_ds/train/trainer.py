"""The training loop. `train(cfg)` is the whole of `dspark-ds train`; `Trainer.run` is the loop,
and each concern it calls on is a component with a small interface:

    CheckpointManager  train/checkpoint.py    the resume (chosen, verified, its rules checked),
                                              load(), save(step) over engine, data, RNG, run state
    StepBatches        train/step_batches.py  a step's micro-batches (served: fetched a step
                                              ahead); a checkpoint, then a stop, when they fail
    Validator          train/validator.py     should_validate(step), validate()
    MetricsLogger      train/metrics.py       train_log.jsonl, MLflow, progress, the summary
    Signals            train/signals.py       SIGTERM / SIGUSR1 → exit 75 (requeue), Ctrl-C → 130
    Schedule           train/schedule.py      warmup + cosine, and what a changed length does

The trainer is itself one of the parts a checkpoint holds (`state_dict` / `load_state_dict`: step,
epoch, schedule, the non-finite counters).

One optimizer step = `grad_accum` micro-batches per rank, each one call of the drafter kind's
`training_step` (drafters/kind.py): the forward and the loss, with the loss's denominators summed
over the ranks, and the metric sums left on the device. Anchors are sampled per sample from
(seed, epoch, sample id), so a step sees the same blocks whatever the world size or a resume.

Per micro-batch the ranks talk twice: the loss's denominators (inside the step) and one control
all_reduce (`_control`) that says whether the loss is finite on every rank and whether a signal
asked any rank to stop; its result is the one value a step reads back from the device before
the backward. Metrics are summed over the ranks on log steps only (train/metrics.py).

A non-finite loss (NaN / inf on any rank) never reaches a backward: the step is skipped (no
update, the learning rate moves on, counted as train/nonfinite_steps). When the bad micro-batch
was not the step's first, the step's earlier micro-batches have already accumulated gradients
inside the ZeRO optimizer, which has no public way to drop them: the run then checkpoints (the
skipped step included) and leaves with exit 75 for a restart from that checkpoint (Slurm's
requeue does it). `train.max_nonfinite_in_row` skipped steps in a row stop the run (exit 1)
with a checkpoint of the last finite weights.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from dspark_ds import distributed
from dspark_ds.config import TrainRunConfig, dump_config, to_plain
from dspark_ds.cost.devices import peak_flops
from dspark_ds.cost.flops import WindowFlops, target_in_job
from dspark_ds.distributed import print0
from dspark_ds.drafters import save_draft_model
from dspark_ds.drafters.io import check_init_state, draft_config_dict, read_init_state
from dspark_ds.drafters.kind import TRAIN_KEYS, StepContext, StepOutput
from dspark_ds.drafters.registry import get_kind
from dspark_ds.engine.checkpoint import full_fp32_state_dict
from dspark_ds.engine.config import build_ds_config
from dspark_ds.engine.drafter import DrafterEngine
from dspark_ds.engine.target import check_target_dtype, load_target_in_job
from dspark_ds.errors import ConfigError, TrainingStopped
from dspark_ds.target import target_shared_weights
from dspark_ds.target_checkpoint import read_target_config
from dspark_ds.tracking.system import NodeMetrics, discover_layout
from dspark_ds.train import rundir, signals
from dspark_ds.train.batches import build_batch_source, served_client
from dspark_ds.train.checkpoint import CheckpointManager
from dspark_ds.train.draft_config import drafter_maker, make_draft_config
from dspark_ds.train.lineage import log_export, start_tracking
from dspark_ds.train.metrics import LOG_FILE, MetricsLogger
from dspark_ds.train.rng import seed_everything
from dspark_ds.train.schedule import Schedule
from dspark_ds.train.signals import REQUEUE_EXIT_CODE, Signals, exit_code_for
from dspark_ds.train.step_batches import StepBatches, StepStart
from dspark_ds.train.validator import Validator


@dataclass
class TrainResult:
    steps: int
    losses: dict[int, float] = field(default_factory=dict)
    """Training loss of every optimizer step run by this process (1-based step; skipped steps
    are absent)."""
    val_metrics: dict[str, float] = field(default_factory=dict)
    run_dir: str = ""
    export_dir: str | None = None
    mlflow_run_id: str | None = None
    nonfinite_steps: int = 0
    """Steps skipped for a non-finite loss over the whole run (resumes included)."""


@dataclass
class StepResult:
    """What one optimizer step did."""

    outputs: list[StepOutput] | None
    """Its micro-batches' outputs; None when a loss was non-finite on some rank (skipped)."""
    clean: bool
    """False: gradients of earlier micro-batches of a skipped step are still accumulated."""
    stop: int | None
    """The exit code every rank leaves with after this step (a signal), or None."""


class Trainer:
    def __init__(self, cfg: TrainRunConfig):
        self.cfg = cfg.validate().check_paths()
        self.kind = get_kind(cfg.model.kind)
        # config-level failures (exit 2) come before any process group exists
        self.draft_config = make_draft_config(cfg)
        # the target runs in the job (features online, synthetic data) and then lends the
        # drafter its embedding and lm_head (engine/target.py); a served one runs elsewhere
        self.needs_target = target_in_job(cfg)
        if self.needs_target:
            check_target_dtype(cfg.target.torch_dtype, cfg.train.precision)
        self.rank, self.world, _ = distributed.init(cfg.deepspeed.backend, settings=cfg.distributed)
        self.device = distributed.local_device()
        self.run_dir = Path(cfg.run_dir)
        self.lock = rundir.acquire_collectively(self.run_dir, self.rank)
        try:
            self._build(cfg)
        except BaseException:
            self.release_run_dir()
            raise

    def _announce(self, cfg: TrainRunConfig) -> None:
        zero = self.engine.zero_stage
        print0(
            f"[train] {cfg.model.kind}: ZeRO-{zero}, loss {self.loss_impl}, "
            f"optimizer {self.engine.optimizer_name}, world size {self.world}"
        )
        # the clipping DeepSpeed applies, as engine/config.py set it (off for Muon under ZeRO-1/2/3)
        clipping = float(self.ds_config.get("gradient_clipping") or 0.0)
        if cfg.train.max_grad_norm and clipping != cfg.train.max_grad_norm:
            print0(
                f"[train] train.max_grad_norm {cfg.train.max_grad_norm} is not applied: under "
                f"ZeRO-{zero} DeepSpeed takes the clipping norm over Muon's orthogonalised "
                "updates, not the gradients (docs/training.md#muon)"
            )

    def release_run_dir(self) -> None:
        """Lets another job use the run directory (rank 0 holds its lock)."""
        if self.lock is not None:
            self.lock.release()

    def _build(self, cfg: TrainRunConfig) -> None:
        rundir.check_shared(self.run_dir, self.rank)
        seed_everything(cfg.train.seed)
        ds_config = build_ds_config(
            cfg.deepspeed,
            cfg.train,
            micro_batch_size=cfg.data.batch_size,
            world_size=self.world,
            use_gpu=self.device.type == "cuda",
            ranks_per_node=distributed.ranks_per_node(),
        )
        draft_record = draft_config_dict(self.draft_config) | {
            "architectures": self.draft_config.architectures
        }
        self.checkpoints = CheckpointManager(cfg.checkpoint, self.run_dir, self.rank, self.world)
        self.resume = self.checkpoints.find_resume(to_plain(cfg), draft_record, ds_config)
        # on another world size the engine loads DeepSpeed's universal form of the checkpoint
        self.ds_config = ds_config if self.resume is None else self.resume.ds_config
        self._build_data()
        self.grad_accum = int(self.ds_config["gradient_accumulation_steps"])
        self.steps_per_epoch = len(self.source) // self.grad_accum
        if self.steps_per_epoch == 0:
            raise ConfigError(
                f"train.global_batch_size: {cfg.train.global_batch_size} is more than one epoch "
                f"of data ({len(self.source)} micro-batches per rank)"
            )
        self.total_steps = cfg.train.max_steps or cfg.train.num_epochs * self.steps_per_epoch
        self.schedule = self._schedule()
        self.engine = self._build_engine()
        # the kind's attention / compile / loss-path choice for this run (the perf section)
        self.loss_impl = self.kind.train.prepare(
            self.engine.module, cfg.perf, self.device, zero_stage=self.engine.zero_stage
        )
        self._announce(cfg)
        self.step, self.epoch = 0, 0
        self.nonfinite_total, self.nonfinite_in_row = 0, 0
        files = {
            "draft_config.json": json.dumps(draft_record, indent=2, sort_keys=True),
            "run_config.yaml": self.config_yaml(),
            "ds_config.json": json.dumps(self.ds_config, indent=2),
        }
        self.checkpoints.attach(self.engine, data=self.source, run=self, files=files)
        self.checkpoints.load()
        self.nodes = None
        if cfg.tracking.system_metrics:  # collective: which node each rank is on
            layout = discover_layout(self.rank, distributed.discover().local_rank)
            self.nodes = NodeMetrics(layout, self.rank, self.device, cfg.tracking.system_interval_s)
        self.tracker = start_tracking(self)
        try:
            flops = WindowFlops(cfg, self.device, self.engine.zero_stage)
        except Exception as err:  # noqa: BLE001 - a throughput figure never stops a run
            flops = None
            print0(
                f"[train] no model FLOP count for this run ({type(err).__name__}: {err}): "
                "system/tflops_per_gpu and system/mfu are not logged"
            )
        self.metrics = MetricsLogger(
            self.run_dir,
            self.tracker,
            rank=self.rank,
            log_every=cfg.train.log_every,
            total_steps=self.total_steps,
            progress_bar=cfg.train.progress_bar,
            device=self.device,
            to_metrics=self.to_metrics,
            nodes=self.nodes,
            flops=flops,
            peak_flops=peak_flops(cfg.train.peak_tflops, cfg.train.precision, self.device),
            world=self.world,
            fleet_counts=None if self.served is None else self.served[0].counts,
        )
        self.validator = Validator(cfg.validation, self.val_source)
        self.signals = Signals()

    # ---- building ---------------------------------------------------------------------------
    def _build_data(self) -> None:
        cfg = self.cfg
        # under ZeRO-3 no rank loads the whole target (engine/target.py)
        self.target = (
            load_target_in_job(cfg.target, self.ds_config, self.device)
            if self.needs_target
            else None
        )
        # offline: the target's tensors, copied into the drafter; export writes these (a bf16
        # engine holds its copies rounded). Online the drafter holds the target's own weights.
        self.shared = None if self.needs_target else target_shared_weights(cfg.target.path)
        head = None if self.shared is None else self.shared[1]
        self.served = served_client(cfg, self.draft_config, head)
        kwargs = dict(
            rank=self.rank,
            world_size=self.world,
            target=self.target,
            draft_config=self.draft_config,
            served=self.served,
        )
        self.source = build_batch_source(cfg, **kwargs)
        self.val_source = build_batch_source(cfg, **kwargs, split="val")

    def _build_engine(self) -> DrafterEngine:
        init_state = None
        if self.cfg.model.init_from and self.resume is None:
            # ours, DeepSpec's, or an engine format's (a published DFlash / Eagle3 checkpoint,
            # whose embedding and lm_head are the target's anyway)
            target_config = read_target_config(
                self.cfg.target.path, trust_remote_code=self.cfg.target.trust_remote_code
            )
            init_state = read_init_state(self.cfg.model.init_from, target_config)
            check_init_state(init_state, self.draft_config, self.cfg.model.init_from)
        return DrafterEngine.build(
            drafter_maker(self.draft_config, self.source, self.run_dir, init_state),
            ds_config=self.ds_config,
            seed=self.cfg.train.seed,
            target=self.target,
            shared_weights=self.shared,
            lr_lambda=self.schedule.lr_lambda(),
            init_state=init_state,
            zero_init=self.cfg.deepspeed.zero_init,
        )

    def config_yaml(self) -> str:
        return dump_config(self.cfg)

    @property
    def resumed_from(self) -> str | None:
        return None if self.resume is None else str(self.resume.tag_dir)

    def _schedule(self) -> Schedule:
        t = self.cfg.train
        fresh = Schedule(int(t.warmup_ratio * self.total_steps), self.total_steps, t.min_lr_ratio)
        if self.resume is None:
            return fresh
        meta = self.resume.meta
        old = Schedule.from_dict(meta["schedule"])
        schedule = old.resized(int(meta["step"]), self.total_steps)
        if schedule != old:
            lr = t.lr * old.factor(int(meta["step"]))
            print0(
                f"[train] schedule: {old.total_steps} -> {self.total_steps} steps; the learning "
                f"rate continues from {lr:.3g} and reaches lr x min_lr_ratio at step "
                f"{self.total_steps} (the warmup keeps its {old.warmup_steps} steps)"
            )
        return schedule

    # ---- checkpoints and export ---------------------------------------------------------------
    def state_dict(self) -> dict:
        """The run state a checkpoint holds: step, epoch, schedule, the non-finite counters."""
        nonfinite = {"total": self.nonfinite_total, "in_row": self.nonfinite_in_row}
        schedule = self.schedule.to_dict()
        return {
            "step": self.step,
            "epoch": self.epoch,
            "schedule": schedule,
            "nonfinite": nonfinite,
        }

    def load_state_dict(self, state: dict) -> None:
        self.step, self.epoch = int(state["step"]), int(state["epoch"])
        nonfinite = state.get("nonfinite", {})
        self.nonfinite_total = int(nonfinite.get("total", 0))
        self.nonfinite_in_row = int(nonfinite.get("in_row", 0))

    def save(self) -> Path:
        self.metrics.sync()  # the log's rows of these steps reach the disk first
        return self.checkpoints.save(self.step)

    def save_from(self, at_start: StepStart) -> Path:
        """Checkpoints the finished steps, the data rewound to the start of the step that could
        not run (`at_start`: its epoch and the batch source's state)."""
        self.epoch = at_start[0]
        self.source.load_state_dict(at_start[1])
        return self.save()

    def export(self) -> Path:
        """Collective: the live weights (fp32 master copies) as an interchange directory."""
        state = full_fp32_state_dict(self.engine.module)
        out = self.run_dir / "export"
        error = None
        if self.rank == 0:
            # online, `state` already holds the target's own (shared) weights
            module = self.engine.module
            names = module.shared_parameter_names()
            for name, weight in zip(names, self.shared or ()):
                if name == "lm_head.weight":  # its rows of a draft vocabulary
                    weight = module.head_weight_rows(weight)
                if name in state:
                    state[name] = weight.detach().float().cpu().clone()
            try:
                save_draft_model(self.engine.module, out, state_dict=state)
            except (OSError, RuntimeError) as err:
                error = f"{type(err).__name__}: {err}"
        errors = [e for e in distributed.all_gather_object(error) if e]
        if errors:
            raise TrainingStopped(
                f"export to {out} failed ({errors[0].splitlines()[0]}); the final checkpoint is "
                f"intact: dspark-ds export --checkpoint {self.run_dir} --output_dir <dir>"
            )
        print0(f"[train] exported the final weights to {out}")
        if self.rank == 0:
            log_export(self, out)
        return out

    # ---- one step -----------------------------------------------------------------------------
    def train_step(self) -> StepResult:
        """One optimizer step over `grad_accum` micro-batches."""
        at_start = self.epoch, self.source.state_dict()
        if self.source.position + self.grad_accum > len(self.source):
            # NOTE: a step never spans two epochs; the tail that is shorter than one step is
            # dropped (every rank drops the same number of batches).
            self.epoch += 1
            self.batches.start(self.epoch)
        ctx = self.step_context(training=True)
        outputs: list[StepOutput] = []
        batches = self.batches
        ahead = batches.fetch_step(at_start) if batches.fetch_ahead else None
        for i in range(self.grad_accum):
            batch = ahead[i] if ahead else batches.next_batch(i, at_start)
            out = self.kind.train.training_step(self.engine, self.on_device(batch), ctx)
            self.metrics.add_sampler_sums(out.sampler_sums)
            finite, stop = self._control(out.loss)
            if not finite:
                self._report_nonfinite(i, batch, out.loss)
                if ahead is None:
                    batches.skip(self.grad_accum - i - 1)  # the step's other batches go with it
                self.engine.skip_step()
                return StepResult(None, clean=i == 0, stop=stop)
            self.engine.ds.backward(out.loss)
            self.engine.ds.step()
            outputs.append(out)
            self.metrics.add_micro_batch(batch)
        return StepResult(outputs, clean=True, stop=stop)

    def step_context(self, training: bool) -> StepContext:
        cfg = self.cfg
        return StepContext(
            model=cfg.model,
            perf=cfg.perf,
            loss_impl=self.loss_impl,
            seed=cfg.train.seed,
            epoch=self.epoch,
            training=training,
        )

    def on_device(self, batch: dict) -> dict:
        """The tensors a step reads on the engine's device (`sample_ids` stay on the host)."""
        moved = {k: batch[k].to(self.device, non_blocking=True) for k in TRAIN_KEYS}
        return {**moved, "sample_ids": batch["sample_ids"]}

    def to_metrics(self, sums: dict[str, float]) -> dict[str, float]:
        """A micro-batch's metrics from its sums over the ranks (the kind's `metrics`)."""
        return self.kind.train.metrics(sums, self.cfg.model)

    def _control(self, loss: torch.Tensor) -> tuple[bool, int | None]:
        """Collective, one all_reduce: (is the loss finite on every rank, the exit code a
        signal on any rank asks for after this step). The step's one read from the device."""
        bad = (~torch.isfinite(loss.detach())).float()
        flags = torch.stack([bad, torch.full_like(bad, self.signals.request())])
        flags = distributed.all_reduce_(flags.to(distributed.collective_device()), op="max")
        bad, request = flags.tolist()
        return bad == 0, exit_code_for(int(request))

    def _report_nonfinite(self, i: int, batch: dict, loss: torch.Tensor) -> None:
        self.nonfinite_total += 1
        self.nonfinite_in_row += 1
        ids = [int(x) for x in batch["sample_ids"][:8]]
        mine = "" if math.isfinite(float(loss)) else f" (here: {float(loss)}, sample ids {ids})"
        distributed.log(
            f"[train] step {self.step + 1}: non-finite loss in micro-batch {i + 1}/"
            f"{self.grad_accum} on some rank{mine}; the step is skipped ({self.nonfinite_in_row} "
            f"in a row, {self.nonfinite_total} in the run)"
        )

    def validate(self) -> list[StepOutput]:
        """The held-out batches through the kind's step, without gradients (their metrics are
        reduced and logged with the step's)."""
        ctx = self.step_context(training=False)
        return self.validator.validate(
            self.engine.ds,
            lambda batch: self.kind.train.training_step(self.engine, self.on_device(batch), ctx),
        )

    # ---- the loop -----------------------------------------------------------------------------
    def run(self) -> TrainResult:
        result = TrainResult(
            steps=self.step, run_dir=str(self.run_dir), mlflow_run_id=self.tracker.run_id
        )
        # served: a step's micro-batches are fetched before it starts, and every rank agrees
        # that all of them arrived (a fleet failure stops every rank at the same step)
        self.batches = StepBatches(
            self.source,
            self.grad_accum,
            self.metrics,
            fetch_ahead=self.served is not None,
            save_from=self.save_from,
        )
        self.batches.start(self.epoch)  # continue where the checkpoint left the data
        self.metrics.start(self.step)
        self.signals.install()
        self.engine.ds.train()
        self._t0, self._first_step = time.perf_counter(), self.step
        try:
            while self.step < self.total_steps:
                lr = self.engine.lr  # the rate this step uses (the scheduler moves on after it)
                done = self.train_step()
                self.step += 1
                last = self.step == self.total_steps
                if done.outputs is not None:
                    self.nonfinite_in_row = 0
                val = None
                if self.validator.should_validate(self.step, last_step=last):
                    val = self.validate()
                self.metrics.log_step(
                    self.step,
                    done.outputs,
                    val,
                    lr=lr,
                    epoch=self.epoch,
                    grad_norm=lambda: self.engine.grad_norm,
                    counters={"nonfinite_steps": self.nonfinite_total},
                )
                stop, clean = done.stop, done.clean
                diverged = self.nonfinite_in_row >= self.cfg.train.max_nonfinite_in_row
                must_save = stop or diverged or not clean
                if must_save or self.checkpoints.should_save(self.step, last_step=last):
                    self.save()
                if diverged:
                    self._stop_diverged()
                if stop or not clean:
                    self._leave(stop or REQUEUE_EXIT_CODE, clean)
            if self.cfg.checkpoint.export_final:
                result.export_dir = str(self.export())
            if self.rank == 0:
                (self.run_dir / "REQUEUE").unlink(missing_ok=True)
            self._finish("FINISHED", f"finished at step {self.step}", result.export_dir)
        except TrainingStopped:
            self._finish("FAILED", f"stopped at step {self.step}", None)
            raise
        except BaseException:
            self._finish("FAILED", None, None)
            raise
        finally:
            self.batches.close()
            if self.served is not None:
                self.served[0].close()
            self.signals.restore()
            self.metrics.close()
            result.losses = dict(self.metrics.losses)
            result.val_metrics = dict(self.metrics.val_metrics)
            self.release_run_dir()
        result.steps, result.nonfinite_steps = self.step, self.nonfinite_total
        result.mlflow_run_id = self.tracker.run_id
        return result

    def _leave(self, code: int, clean: bool) -> None:
        """After the checkpoint: every rank leaves with `code` (75: requeue, 130: Ctrl-C)."""
        why = {REQUEUE_EXIT_CODE: "requeue"}.get(code, "interrupted")
        if not clean:
            why = "restart from it to drop the skipped step's partial gradients"
        if code == REQUEUE_EXIT_CODE and self.rank == 0:
            (self.run_dir / "REQUEUE").write_text(f"{self.step}\n")
        if self.rank == 0:
            signals.record_exit(code, why, self.step)
        # NOTE: a pre-empted job has seconds before SIGKILL: what MLflow has not taken by then
        # waits in <run_dir>/mlflow_undelivered.json, which the requeued run sends first
        self._finish(
            "KILLED",
            f"stopped at step {self.step} (exit {code}: {why})",
            None,
            flush_timeout_s=min(self.cfg.tracking.flush_timeout_s, 5.0),
        )
        # NOTE: every rank leaves together, after rank 0 closed its MLflow run:
        # `srun --kill-on-bad-exit` stops the whole step at the first exit 75.
        distributed.barrier()
        raise SystemExit(code)

    def _stop_diverged(self) -> None:
        n = self.nonfinite_in_row
        raise TrainingStopped(
            f"the loss was non-finite in {n} steps in a row (steps {self.step - n + 1}-"
            f"{self.step}; train.max_nonfinite_in_row {self.cfg.train.max_nonfinite_in_row}): "
            f"stopped; {self.checkpoints.latest()} holds the last "
            f"finite weights (those of step {self.step - n})"
        )

    def _finish(
        self,
        status: str,
        outcome: str | None,
        export_dir: str | None,
        flush_timeout_s: float | None = None,
    ) -> None:
        """Rank 0: the end-of-run summary (when the run ended in good order) and the MLflow run's
        status. Safe to call twice (the tracker finishes once)."""
        undelivered = self.tracker.finish(status, flush_timeout_s) if self.tracker.enabled else None
        if outcome is not None:
            latest = self.checkpoints.latest()
            lines = [
                f"{outcome}: steps {self._first_step + 1}-{self.step} of {self.total_steps} in "
                f"{time.perf_counter() - self._t0:.0f} s",
                f"log: {self.run_dir / LOG_FILE}",
                f"checkpoints: {self.checkpoints.dir} (latest {latest and latest.name})",
            ]
            if self.resumed_from:
                lines.insert(1, f"resumed from {self.resumed_from}")
            if self.nonfinite_total:
                lines.append(f"steps skipped for a non-finite loss: {self.nonfinite_total}")
            if export_dir:
                lines.append(f"export: {export_dir}")
            if self.tracker.run_id:
                lines.append(f"MLflow run {self.tracker.run_id} ({self.tracker.uri})")
            if undelivered:
                lines.append(
                    f"MLflow: not all delivered, kept for `dspark-ds sync-tracking --run_dir "
                    f"{self.run_dir}`"
                )
            self.metrics.summary(lines)


def train(cfg: TrainRunConfig) -> TrainResult:
    """`dspark-ds train`."""
    return Trainer(cfg).run()
