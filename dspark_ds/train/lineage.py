"""What a training run tells MLflow about itself (rank 0): its kind and the tags runs are grouped
by, its params, the data it trained on as dataset inputs, and the export as an MLflow model.

    tags      kind=train, drafter_kind / drafter (from the kind object), target, recipe, zero
              (the ZeRO option, named as `dspark-ds tune` names them), seed, world_size,
              slurm_job_id, nodes, git_sha, ...
    inputs    the training (and validation) data: a prepared token store or a target cache,
              digest = its fingerprint, so two regenerations of one path differ
    model     <run>/export as a model of the run (its files as written, no flavour; the
              interchange directory that `load_draft_model`, vLLM and SGLang read), registered
              as a version of `tracking.register_as` when set; the export records the run in
              `mlflow_run.json`, which evaluations use to nest under it
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import replace
from pathlib import Path

from dspark_ds import distributed
from dspark_ds.config import flatten
from dspark_ds.errors import ConfigError
from dspark_ds.tracking.mlflow import Tracker
from dspark_ds.tracking.store import EXPORT_RECORD, default_artifact_location, git_sha, resolve_uri


def zero_option(ds_config: dict) -> str:
    """The DeepSpeed config's ZeRO option as `dspark-ds tune` names them (zero2+offload_opt,
    zero3+offload_opt+param, zero3+nvme, zero3+hpz, ...)."""
    zero = ds_config.get("zero_optimization", {}) or {}
    name = f"zero{int(zero.get('stage', 0))}"
    opt = (zero.get("offload_optimizer") or {}).get("device") or "none"
    param = (zero.get("offload_param") or {}).get("device") or "none"
    if "nvme" in (opt, param):
        return name + "+nvme"
    if opt == "cpu":
        name += "+offload_opt"
    if param == "cpu":
        name += "+param"
    hpz = zero.get("zero_hpz_partition_size", 1)
    if name == "zero3" and (hpz == "auto" or int(hpz) > 1):  # 1: hpZ's group is one rank, off
        name += "+hpz"
    return name


def _digest(*parts) -> str:
    """MLflow keeps at most 36 characters of a digest."""
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:32]


def data_inputs(source, data_cfg, synthetic_seed: int | None = None) -> list[dict]:
    """A batch source's data as MLflow dataset inputs: name, digest, source, profile."""
    if source is None:
        return []
    cache = getattr(source, "cache", None)
    manifest = getattr(cache, "manifest", None)
    if manifest is not None:
        dataset = manifest.get("dataset", {})
        target = manifest.get("target", {})
        entry = {
            "name": Path(str(cache.cache_dir)).name,
            "source": str(Path(cache.cache_dir).resolve()),
            "digest": _digest(
                dataset.get("fingerprint"),
                target.get("config_sha256"),
                manifest.get("layer_ids"),
                manifest.get("dtype"),
            ),
            "profile": {
                "kind": "target cache",
                "num_samples": dataset.get("num_samples"),
                "num_tokens": dataset.get("num_tokens"),
                "dtype": manifest.get("dtype"),
                "data_fingerprint": dataset.get("fingerprint"),
            },
        }
        return [entry]
    samples = getattr(source, "samples", None)
    meta = getattr(samples, "meta", None)
    if meta is not None:
        paths = [str(Path(p).resolve()) for p in data_cfg.paths]
        entry = {
            "name": Path(paths[0]).name if len(paths) == 1 else f"{len(paths)} files",
            "source": ",".join(paths),
            "digest": _digest(meta.get("fingerprint")),
            "profile": {
                "kind": "token store",
                "num_samples": meta.get("num_samples"),
                "num_tokens": meta.get("num_tokens"),
                "data_fingerprint": meta.get("fingerprint"),
            },
        }
        return [entry]
    if hasattr(source, "vocab_size") and hasattr(source, "seq_len"):
        spec = (source.num_samples, source.seq_len, source.vocab_size, synthetic_seed)
        entry = {
            "name": "synthetic",
            "source": "synthetic",
            "digest": _digest(*spec),
            "profile": {
                "kind": "synthetic",
                "num_samples": source.num_samples,
                "seq_len": source.seq_len,
            },
        }
        return [entry]
    return []


def start_tracking(trainer):
    """Collective: the training run's tracker (rank 0 logs; a no-op elsewhere), with its tags,
    params, the DeepSpeed config and the data inputs queued. A refused MLFLOW_RUN_ID is a
    ConfigError on every rank."""
    cfg, t = trainer.cfg, trainer.cfg.tracking
    tags = {
        **t.tags,
        "drafter_kind": trainer.kind.name,
        "drafter": trainer.kind.capabilities.label,
        "target": cfg.target.path,
        "zero": zero_option(trainer.ds_config),
        "seed": cfg.train.seed,
        "world_size": trainer.world,
        "nodes": ",".join(trainer.nodes.layout.hosts) if trainer.nodes is not None else None,
        "slurm_job_id": os.environ.get("SLURM_JOB_ID"),
        "git_sha": git_sha(),
        "zero_stage": trainer.engine.zero_stage,
        "ds_config": cfg.deepspeed.config,
        "resumed_from": trainer.resumed_from,
        "total_steps": trainer.total_steps,
    }
    if trainer.resume is not None:
        # MLflow keeps the first value of a param; what a resume changed is said here
        for key, (before, after) in trainer.resume.changes.items():
            tags[f"changed_on_resume.{key}"] = f"{before} -> {after} at step {trainer.step}"
    refused = None
    try:
        tracker = _tracker(trainer, tags)
    except ConfigError as err:  # a refused MLFLOW_RUN_ID: every rank leaves with the line
        refused, tracker = str(err), None
    if distributed.has_group():
        refused = next((e for e in distributed.all_gather_object(refused) if e), None)
    if refused:
        raise ConfigError(refused)
    if trainer.rank != 0:
        return tracker
    _log_run(trainer, tracker)
    return tracker


def _tracker(trainer, tags: dict):
    cfg, t = trainer.cfg, trainer.cfg.tracking
    return Tracker.for_rank(
        trainer.rank,
        enabled=t.enabled,
        uri=resolve_uri(t.uri, cfg.output_dir),
        experiment=t.experiment,
        run_name=t.run_name or cfg.name,
        run_dir=str(trainer.run_dir),
        artifact_location=default_artifact_location(cfg.output_dir),
        timeout_s=t.timeout_s,
        kind="train",
        tags=tags,
        parent_run_id=t.parent_run_id,
        replay_log=trainer.run_dir / "train_log.jsonl",
        flush_timeout_s=t.flush_timeout_s,
        max_queued_values=t.max_queued_values,
    )


def _log_run(trainer, tracker) -> None:
    """Rank 0: the params, the DeepSpeed config and recipe, the data inputs."""
    cfg = trainer.cfg
    params = flatten(cfg)
    params.update(
        {
            "derived.world_size": trainer.world,
            "derived.grad_accum": trainer.grad_accum,
            "derived.total_steps": trainer.total_steps,
            "derived.warmup_steps": trainer.schedule.warmup_steps,
            "derived.zero_stage": trainer.engine.zero_stage,
            "derived.loss_impl": trainer.loss_impl,
            "derived.loss_chunk_anchors": cfg.perf.chunk_anchors(trainer.device),
            "derived.compile": cfg.perf.compile_mode(trainer.device),
        }
    )
    tracker.log_params(params)  # params are immutable: a resume adds only new ones
    tracker.log_dict(trainer.ds_config, "ds_config.json")
    tracker.log_text(trainer.config_yaml(), "config.yaml")
    seed = cfg.train.seed
    for context, source, data_cfg in (
        ("training", trainer.source, cfg.data),
        ("validation", trainer.val_source, cfg.data),
    ):
        if context == "validation" and cfg.validation.paths:
            data_cfg = replace(cfg.data, paths=list(cfg.validation.paths))
        for spec in data_inputs(source, data_cfg, seed):
            tracker.log_dataset(context=context, **spec)


def log_export(trainer, export_dir: Path) -> None:
    """Rank 0: the export records its run and becomes the run's MLflow model."""
    tracker, cfg = trainer.tracker, trainer.cfg
    tracker.record_run(export_dir / EXPORT_RECORD)
    tracker.log_model(
        export_dir,
        name=cfg.name,
        step=trainer.step,
        register_as=cfg.tracking.register_as,
        params={
            "drafter_kind": trainer.kind.name,
            "target": cfg.target.path,
            "architecture": trainer.draft_config.architectures[0],
        },
    )
