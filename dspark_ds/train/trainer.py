"""The training loop: DeepSpeed step with the DSpark loss, schedule, validation, checkpoints,
signals, MLflow. `train(cfg)` is the whole of `dspark-ds train`.

One optimizer step = `grad_accum` micro-batches per rank; anchors are sampled per sample from
(seed, epoch, sample id), so a step sees the same blocks whatever the world size or a resume.
SIGTERM / SIGUSR1 (Slurm's pre-emption warning) → checkpoint at the end of the current step,
write <run>/REQUEUE, exit with REQUEUE_EXIT_CODE (the sbatch script requeues the job).
"""

from __future__ import annotations

import json
import math
import os
import resource
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from dspark_ds import distributed
from dspark_ds.config import TrainRunConfig, dump_config, flatten
from dspark_ds.distributed import print0
from dspark_ds.drafters import build_draft_model
from dspark_ds.drafters.common.blocks import SAMPLER_STATS, sampler_stat_sums
from dspark_ds.drafters.io import draft_config_dict
from dspark_ds.drafters.registry import TRAIN_KEYS, StepArgs, get_spec
from dspark_ds.train import checkpoint as ckpt
from dspark_ds.train.batches import build_batch_source

REQUEUE_EXIT_CODE = 75  # EX_TEMPFAIL: "try again later"


def warmup_cosine(total_steps: int, warmup_steps: int, min_ratio: float = 0.0):
    """lr multiplier of optimizer step k (0-based): linear warmup (k+1)/W, then cosine to
    min_ratio at the last step."""

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return factor


def resolve_mask_token_id(cfg: TrainRunConfig) -> int:
    if cfg.model.mask_token_id is not None:
        return int(cfg.model.mask_token_id)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(cfg.data.tokenizer or cfg.target.path)
    mask_id = tok.convert_tokens_to_ids("<|mask|>")
    if mask_id is None or mask_id == tok.unk_token_id:
        raise ValueError("model.mask_token_id: the tokenizer has no <|mask|> token; set the id")
    return int(mask_id)


def make_draft_config(cfg: TrainRunConfig):
    """The drafter's transformers config for this run's target (its kind's `build_config`)."""
    from transformers import AutoConfig

    from dspark_ds.target import default_layer_ids, text_config

    try:
        target_config = AutoConfig.from_pretrained(
            cfg.target.path, trust_remote_code=cfg.target.trust_remote_code
        )
    except OSError as err:
        raise ValueError(
            f"target.path: cannot read a model config from {cfg.target.path!r} "
            f"({str(err).splitlines()[0]})"
        ) from err
    num_layers = int(text_config(target_config).num_hidden_layers)
    layer_ids = cfg.target.layer_ids or default_layer_ids(num_layers)
    spec = get_spec(cfg.model.kind)
    mask_token_id = resolve_mask_token_id(cfg) if spec.uses_mask_token else None
    try:
        return spec.build_config(
            target_config,
            cfg.model,
            target_layer_ids=layer_ids,
            mask_token_id=mask_token_id,
            target_path=cfg.target.path,
        )
    except ValueError as err:
        # the builders name the drafter config's field; the user set the run's option
        field, _, why = str(err).partition(":")
        option = {"target_layer_ids": "target.layer_ids", "model_type": "target.path"}
        raise ValueError(f"{option.get(field, 'model.' + field)}:{why}") from err


def peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


@dataclass
class TrainResult:
    steps: int
    losses: dict[int, float] = field(default_factory=dict)
    """Training loss of every optimizer step run by this process (1-based step)."""
    val_metrics: dict[str, float] = field(default_factory=dict)
    run_dir: str = ""
    export_dir: str | None = None
    mlflow_run_id: str | None = None


class _Signals:
    """Remembers SIGTERM / SIGUSR1; the loop checks at step boundaries (all ranks agree)."""

    def __init__(self):
        self.received: int | None = None
        for sig in (signal.SIGTERM, signal.SIGUSR1):
            signal.signal(sig, self._handle)

    def _handle(self, signum, _frame) -> None:
        self.received = signum

    def any_rank(self) -> bool:
        [flag] = distributed.all_reduce_values([self.received is not None], op="max")
        return flag > 0


class Trainer:
    def __init__(self, cfg: TrainRunConfig):
        from dspark_ds import engine as eng_lib

        self.cfg = cfg.validate().check_paths()
        # config-level failures (exit 2) come before any process group exists
        self.spec = get_spec(cfg.model.kind)
        self.spec.check_perf(cfg.perf)
        self.draft_config = make_draft_config(cfg)
        # the target runs in the job (features online, synthetic data) and then lends the
        # drafter its embedding and lm_head (engine.py: "the target inside the job")
        needs_target = cfg.data.mode != "offline" or cfg.train.synthetic_samples > 0
        if needs_target:
            eng_lib.check_target_dtype(cfg.target.torch_dtype, cfg.train.precision)
        self.rank, self.world, _ = distributed.init(cfg.deepspeed.backend)
        self.device = distributed.local_device()
        self.run_dir = Path(cfg.run_dir)
        self.ckpt_dir = self.run_dir / "checkpoints"
        ckpt.seed_everything(cfg.train.seed)

        self.ds_config = eng_lib.build_ds_config(
            cfg.deepspeed,
            cfg.train,
            micro_batch_size=cfg.data.batch_size,
            world_size=self.world,
            use_gpu=self.device.type == "cuda",
        )
        from dspark_ds.target import load_target

        self.target = (
            load_target(cfg.target, eng_lib.target_load_device(self.ds_config, self.device))
            if needs_target
            else None
        )
        # offline: the target's tensors, copied into the drafter; export writes these (a bf16
        # engine holds its copies rounded). Online the drafter holds the target's own weights.
        self.shared = None if needs_target else ckpt.target_shared_weights(cfg.target.path)

        self.source = build_batch_source(
            cfg,
            rank=self.rank,
            world_size=self.world,
            target=self.target,
            draft_config=self.draft_config,
        )
        self.val_source = build_batch_source(
            cfg,
            rank=self.rank,
            world_size=self.world,
            target=self.target,
            draft_config=self.draft_config,
            split="val",
        )
        self.val_start = self.val_source.state_dict() if self.val_source is not None else None

        self.grad_accum = int(self.ds_config["gradient_accumulation_steps"])
        # Window sums of the anchor sampler's statistics, then the sample count (logged, reset).
        self.sampler_sums = [0.0] * (len(SAMPLER_STATS) + 1)
        self.steps_per_epoch = len(self.source) // self.grad_accum
        if self.steps_per_epoch == 0:
            raise ValueError(
                f"train.global_batch_size: {cfg.train.global_batch_size} is more than one epoch "
                f"of data ({len(self.source)} micro-batches per rank)"
            )
        self.total_steps = cfg.train.max_steps or cfg.train.num_epochs * self.steps_per_epoch
        warmup = int(cfg.train.warmup_ratio * self.total_steps)

        resume_tag = self._resume_tag()
        if resume_tag is not None:
            resume_tag, self.ds_config = self._prepare_resume(resume_tag, eng_lib)
        init_state = None
        if cfg.model.init_from:
            from dspark_ds.drafters import load_draft_model

            init_state = load_draft_model(cfg.model.init_from).state_dict()
        self.engine = eng_lib.DrafterEngine.build(
            lambda: build_draft_model(self.draft_config),
            ds_config=self.ds_config,
            seed=cfg.train.seed,
            target=self.target,
            shared_weights=self.shared,
            lr_lambda=warmup_cosine(self.total_steps, warmup, cfg.train.min_lr_ratio),
            init_state=init_state,
            zero_init=cfg.deepspeed.zero_init,
        )
        self.loss_impl = self.spec.apply_perf(self.engine.model, cfg.perf, self.engine.device)
        print0(
            f"[train] {cfg.model.kind}: ZeRO-{self.engine.zero_stage}, "
            f"loss {self.loss_impl}, optimizer {self.engine.optimizer_name}, "
            f"world size {self.world}"
        )
        self.step, self.epoch = 0, 0
        self.resumed_from = None
        if resume_tag is not None:
            self._load(resume_tag)

        from dspark_ds.tracking.mlflow import (
            Tracker,
            default_artifact_location,
            default_uri,
            git_sha,
        )

        self.tracker = Tracker.for_rank(
            self.rank,
            enabled=cfg.tracking.enabled,
            uri=cfg.tracking.uri or default_uri(cfg.output_dir),
            experiment=cfg.tracking.experiment,
            run_name=cfg.tracking.run_name or cfg.name,
            run_dir=str(self.run_dir),
            artifact_location=default_artifact_location(cfg.output_dir),
            timeout_s=cfg.tracking.timeout_s,
        )
        if self.rank == 0:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            params = flatten(cfg)
            params.update(
                {
                    "derived.world_size": self.world,
                    "derived.grad_accum": self.grad_accum,
                    "derived.total_steps": self.total_steps,
                    "derived.warmup_steps": warmup,
                    "derived.zero_stage": self.engine.zero_stage,
                    "derived.loss_impl": self.loss_impl,
                    "derived.loss_chunk_anchors": cfg.perf.chunk_anchors(self.engine.device),
                    "derived.compile": cfg.perf.compile_mode(self.engine.device),
                }
            )
            self.tracker.log_params(params)
            self.tracker.log_dict(self.ds_config, "ds_config.json")
            self.tracker.log_text(self.config_yaml(), "config.yaml")
            self.tracker.set_tags(
                {
                    **cfg.tracking.tags,
                    "git_sha": git_sha(),
                    "world_size": self.world,
                    "zero_stage": self.engine.zero_stage,
                    "ds_config": cfg.deepspeed.config,
                    "slurm_job_id": os.environ.get("SLURM_JOB_ID"),
                    "resumed_from": self.resumed_from,
                }
            )
        self.signals = _Signals()

    # ---- config / resume ----------------------------------------------------------------------
    def config_yaml(self) -> str:
        return dump_config(self.cfg)

    def _resume_tag(self) -> str | None:
        resume = self.cfg.checkpoint.resume
        existing = ckpt.latest_tag(self.ckpt_dir)
        if resume is None:
            if existing is not None:
                raise ValueError(
                    f"checkpoint.resume: {self.ckpt_dir} already holds {existing}; pass "
                    "--checkpoint.resume auto to continue it, or choose another --name"
                )
            return None
        if resume == "auto":
            return str(self.ckpt_dir / existing) if existing is not None else None
        try:
            return str(ckpt.resolve_tag_dir(resume))
        except FileNotFoundError as err:
            raise ValueError(f"checkpoint.resume: {err}") from None

    def _prepare_resume(self, tag_dir: str, eng_lib) -> tuple[str, dict]:
        """Same world size: load as is. Otherwise (ZeRO >= 1) convert to a universal
        checkpoint once (rank 0) and load that."""
        meta = json.loads((Path(tag_dir) / "meta.json").read_text())
        stage = eng_lib.zero_stage(self.ds_config)
        if meta["zero_stage"] != stage:
            raise ValueError(
                f"deepspeed.config: {tag_dir} was written with ZeRO-{meta['zero_stage']}, this "
                f"run uses ZeRO-{stage}; resume with the same stage"
            )
        if meta["world_size"] == self.world or stage == 0:
            return tag_dir, self.ds_config
        universal = Path(f"{tag_dir}_universal")
        if self.rank == 0 and not (universal / ckpt.COMPLETE).exists():
            print0(
                f"[train] world size {meta['world_size']} -> {self.world}: converting "
                f"{tag_dir} to a universal checkpoint"
            )
            eng_lib.convert_to_universal(tag_dir, universal)
            (universal / ckpt.COMPLETE).write_text("ok\n")
        distributed.barrier()
        return str(universal), eng_lib.enable_universal_load(self.ds_config)

    def _load(self, tag_dir: str) -> None:
        tag_dir = Path(tag_dir)
        state = self.engine.load(tag_dir.parent, tag_dir.name)
        self.step, self.epoch = int(state["step"]), int(state["epoch"])
        self.source.load_state_dict(state["data"]) if state["world_size"] == self.world else (
            self._load_data_other_world(state)
        )
        if state["world_size"] == self.world:
            ckpt.set_rng_state(state["rng"])
        self.resumed_from = str(tag_dir)
        print0(f"[train] resumed from {tag_dir} at step {self.step} (epoch {self.epoch})")

    def _load_data_other_world(self, state: dict) -> None:
        data = dict(state["data"])
        if "samples_consumed" not in data:  # the data package's loader counts batches
            # NOTE: its order depends on the world size; continue at the same fraction of the
            # epoch (no sample is repeated twice in a row, the order differs).
            data["position"] = data["position"] * state["world_size"] // self.world
            data["world_size"] = self.world
            print0("[train] WARNING: world size changed; the data order within the epoch differs")
        self.source.load_state_dict(data)

    # ---- checkpoints --------------------------------------------------------------------------
    def save(self) -> None:
        tag = ckpt.tag_for_step(self.step)
        if (self.ckpt_dir / tag / ckpt.COMPLETE).exists():
            return
        if self.rank == 0:
            ckpt.write_metadata(
                self.ckpt_dir / tag,
                draft_config=draft_config_dict(self.draft_config)
                | {"architectures": self.draft_config.architectures},
                run_config_yaml=self.config_yaml(),
                ds_config=self.ds_config,
            )
            (self.ckpt_dir / tag / "meta.json").write_text(
                json.dumps(
                    {
                        "step": self.step,
                        "world_size": self.world,
                        "zero_stage": self.engine.zero_stage,
                    }
                )
            )
        distributed.barrier()
        self.engine.save(
            self.ckpt_dir,
            tag,
            {
                "step": self.step,
                "epoch": self.epoch,
                "data": self.source.state_dict(),
                "rng": ckpt.rng_state(),
                "world_size": self.world,
            },
        )
        distributed.barrier()
        if self.rank == 0:
            ckpt.publish(self.ckpt_dir, tag, self.cfg.checkpoint.keep_last)
        distributed.barrier()

    def export_live(self) -> Path | None:
        from dspark_ds.drafters import save_draft_model

        state = self.engine.full_fp32_state_dict()
        out = self.run_dir / "export"
        if self.rank == 0:
            # online, `state` already holds the target's own (shared) weights
            names = self.engine.model.shared_parameter_names()
            for name, weight in zip(names, self.shared or ()):
                if name in state:
                    state[name] = weight.detach().float().cpu().clone()
            save_draft_model(self.engine.model, out, state_dict=state)
        distributed.barrier()
        return out

    # ---- one step -----------------------------------------------------------------------------
    def _forward_loss(self, batch: dict):
        """The drafter kind's forward + loss on one micro-batch (and its metrics)."""
        inputs = {k: batch[k].to(self.engine.device) for k in TRAIN_KEYS}
        inputs["sample_ids"] = batch["sample_ids"]
        args = StepArgs(
            model=self.cfg.model,
            perf=self.cfg.perf,
            loss_impl=self.loss_impl,
            seed=self.cfg.train.seed,
            epoch=self.epoch,
            on_anchors=self._count_sampler_stats if self.engine.model.training else None,
            forward=self.engine,
        )
        return self.spec.forward_and_loss(self.engine.model, inputs, args)

    def _count_sampler_stats(self, loss_mask, anchors, keep) -> None:
        """The reference's anchor-sampler statistics, summed over the log window (train/*)."""
        sums = sampler_stat_sums(
            loss_mask.cpu(), anchors.cpu(), keep.cpu(),
            num_anchors=self.draft_config.num_anchors, block_size=self.draft_config.block_size,
        )  # fmt: skip
        self.sampler_sums = [a + b for a, b in zip(self.sampler_sums, sums)]

    def validate(self) -> dict[str, float]:
        if self.val_source is None:
            return {}
        self.val_source.load_state_dict(self.val_start)
        sums: dict[str, float] = {}
        n = 0
        self.engine.eval()
        with torch.no_grad():
            for i, batch in enumerate(self.val_source):
                if i >= self.cfg.validation.num_batches:
                    break
                _, metrics = self._forward_loss(batch)
                for k, v in metrics.items():
                    sums[k] = sums.get(k, 0.0) + float(v)
                n += 1
        self.engine.train()
        return {f"val/{k}": v / max(n, 1) for k, v in sums.items()}

    def run(self) -> TrainResult:
        cfg = self.cfg
        result = TrainResult(
            steps=self.step, run_dir=str(self.run_dir), mlflow_run_id=self.tracker.run_id
        )
        # continue where the checkpoint left the data (same epoch, same position)
        self.source.set_epoch(self.epoch)
        self._iter = iter(self.source)
        log_path = self.run_dir / "train_log.jsonl"
        bar = None
        if self.rank == 0 and cfg.train.progress_bar:
            from tqdm import tqdm

            bar = tqdm(
                total=self.total_steps,
                initial=self.step,
                desc="train",
                unit="step",
                dynamic_ncols=True,
                file=sys.stdout,
            )
        window: dict[str, float] = {}
        window_steps, tokens, samples, t0 = 0, 0, 0, time.perf_counter()
        self.engine.train()
        status = "FINISHED"
        try:
            while self.step < self.total_steps:
                step_metrics: dict[str, float] = {}
                lr = self.engine.lr  # the rate this step uses (the scheduler moves on after it)
                if self.source.position + self.grad_accum > len(self.source):
                    # NOTE: a step never spans two epochs; the tail that is shorter than one
                    # step is dropped (every rank drops the same number of batches).
                    self.epoch += 1
                    self.source.set_epoch(self.epoch)
                    self._iter = iter(self.source)
                for _ in range(self.grad_accum):
                    batch = next(self._iter)
                    loss, metrics = self._forward_loss(batch)
                    self.engine.backward(loss)
                    self.engine.step()
                    for k, v in metrics.items():
                        step_metrics[k] = step_metrics.get(k, 0.0) + float(v) / self.grad_accum
                    tokens += int(batch["attention_mask"].sum())
                    samples += int(batch["input_ids"].shape[0])
                self.step += 1
                result.losses[self.step] = step_metrics["loss"]
                for k, v in step_metrics.items():
                    window[k] = window.get(k, 0.0) + v
                window_steps += 1
                if self.rank == 0:
                    with open(log_path, "a") as f:
                        f.write(
                            json.dumps({"step": self.step, "loss": step_metrics["loss"], "lr": lr})
                            + "\n"
                        )
                if bar is not None:
                    bar.update(1)
                    bar.set_postfix(
                        loss=f"{step_metrics['loss']:.4f}",
                        tau=f"{step_metrics.get('tau_probabilistic', 0):.2f}",
                    )
                if self.step % cfg.train.log_every == 0 or self.step == self.total_steps:
                    all_tokens, all_samples, *sampler = distributed.all_reduce_values(
                        [tokens, samples, *self.sampler_sums]
                    )
                    elapsed = max(time.perf_counter() - t0, 1e-9)
                    logged = {f"train/{k}": v / window_steps for k, v in window.items()}
                    if sampler[-1] > 0:  # samples seen by the anchor sampler (DSpark / DFlash)
                        logged.update(
                            {f"train/{k}": v / sampler[-1] for k, v in zip(SAMPLER_STATS, sampler)}
                        )
                    self.sampler_sums = [0.0] * (len(SAMPLER_STATS) + 1)
                    logged.update(
                        {
                            "train/lr": lr,
                            "train/epoch": self.epoch,
                            "system/tokens_per_s": all_tokens / elapsed,
                            "system/samples_per_s": all_samples / elapsed,
                            "system/peak_memory_mb": peak_memory_mb(self.device),
                        }
                    )
                    if self.engine.grad_norm is not None:
                        logged["train/grad_norm"] = self.engine.grad_norm
                    self.tracker.log_metrics(logged, step=self.step)
                    window, window_steps, tokens, samples = {}, 0, 0, 0
                    t0 = time.perf_counter()
                every = cfg.checkpoint.every_steps
                if every and self.step % every == 0 and self.step < self.total_steps:
                    self.save()
                val_every = cfg.validation.every_steps
                if val_every and self.step % val_every == 0:
                    val = self.validate()
                    self.tracker.log_metrics(val, step=self.step)
                    result.val_metrics = val
                if self.signals.any_rank():
                    print0(
                        f"[train] signal received: checkpoint at step {self.step}, then "
                        f"exit {REQUEUE_EXIT_CODE} for requeue"
                    )
                    self.save()
                    if self.rank == 0:
                        (self.run_dir / "REQUEUE").write_text(f"{self.step}\n")
                    status = "KILLED"
                    # NOTE: every rank leaves together, after rank 0 closed its MLflow run:
                    # `srun --kill-on-bad-exit` stops the whole step at the first exit 75.
                    self.tracker.finish(status)
                    distributed.barrier()
                    raise SystemExit(REQUEUE_EXIT_CODE)
            if cfg.checkpoint.save_final:
                self.save()
            val = self.validate()
            if val:
                self.tracker.log_metrics(val, step=self.step)
                result.val_metrics = val
            if cfg.checkpoint.export_final:
                result.export_dir = str(self.export_live())
                if self.rank == 0:
                    self.tracker.log_artifacts(result.export_dir, "export")
            if self.rank == 0:
                (self.run_dir / "REQUEUE").unlink(missing_ok=True)
        except BaseException:
            if status == "FINISHED":
                status = "FAILED"
            raise
        finally:
            if bar is not None:
                bar.close()
            self.tracker.finish(status)
        result.steps = self.step
        return result


def train(cfg: TrainRunConfig) -> TrainResult:
    """`dspark-ds train`."""
    return Trainer(cfg).run()
