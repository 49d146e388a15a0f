"""A `dspark-ds tune` sweep in MLflow: one parent run (kind tune: the recipe, the cluster, the
recommendation) with one child run per ZeRO option, so that MLflow's compare view (select the
children, Compare) shows the sweep side by side.

    child params   option, its searched micro_batch and accum, deepspeed.config / overrides,
                   the option's ZeRO settings
    child tags     kind=tune, zero=<option>, fits, recipe, drafter_kind, target
    child metrics  memory/device_gib, memory/host_per_rank_gib, memory/<component>_gib, fits,
                   predicted/step_s, predicted/tokens_per_s, predicted/<term>_s (each
                   step-time term) on the first node count; scaling/step_s,
                   scaling/tokens_per_s and scaling/micro_batch at step = the node count
                   (one point per --cluster.nodes); with --measure: measured/step_s, measured/peak_gib,
                   predicted/at_measurement_s
"""

from __future__ import annotations

import time
from pathlib import Path

from dspark_ds.config import flatten
from dspark_ds.drafters.registry import get_kind
from dspark_ds.tracking.store import default_artifact_location, resolve_uri
from dspark_ds.tracking.sweeps import Point
from dspark_ds.tracking.sweeps import log_sweep as log_points
from dspark_ds.tune.config import OPTIONS

GIB = 2**30


def _option_metrics(est, measured: dict | None, at_measurement: float | None) -> dict:
    metrics = {
        "memory/device_gib": est.device_total / GIB,
        "memory/host_per_rank_gib": est.host_total_per_rank / GIB,
        "fits": float(est.fits),
    }
    metrics.update({f"memory/{k}_gib": v / GIB for k, v in est.device.items()})
    if measured:
        if measured.get("step_s") is not None:
            metrics["measured/step_s"] = measured["step_s"]
        if measured.get("peak_bytes") is not None:
            metrics["measured/peak_gib"] = measured["peak_bytes"] / GIB
    if at_measurement is not None:
        metrics["predicted/at_measurement_s"] = at_measurement
    return metrics


def _step_metrics(step: dict) -> dict:
    out = {
        "predicted/step_s": step["predicted_step_s"],
        "predicted/tokens_per_s": step["tokens_per_s"],
    }
    terms = step.get("terms", {})
    out.update({f"predicted/{k}_s": v for k, v in terms.items() if isinstance(v, int | float)})
    return out


def log_sweep(
    cfg,
    run_cfg,
    estimates,
    scaling: dict,
    measured: dict,
    at_measurement: dict,
    recommended: str,
    text: str,
) -> str | None:
    """Rank 0: the sweep's parent and children; returns the parent's run id."""
    t = cfg.tracking
    recipe = Path(cfg.recipe).stem
    by_name = {o.name: o for o in OPTIONS}
    points = []
    for est in estimates:
        option = by_name[est.option]
        figures = _option_metrics(est, measured.get(est.option), at_measurement.get(est.option))
        series = {}
        for nodes, ests in scaling.items():
            at = next(e for e in ests if e.option == est.option)
            series[int(nodes)] = {
                "scaling/step_s": at.step["predicted_step_s"],
                "scaling/tokens_per_s": at.step["tokens_per_s"],
                "scaling/micro_batch": at.point.get("micro_batch", 0),
            }
        params = {
            "option": est.option,
            "micro_batch": est.point.get("micro_batch"),
            "accum": est.step["accum"],
            "perf.activation_checkpointing": bool(est.point.get("recompute")),
            "deepspeed.config": option.config,
            "deepspeed.overrides": option.overrides or {},
            **{f"zero.{k}": v for k, v in est.zero.items()},
        }
        tags = {"zero": est.option, "fits": est.fits, "why": est.why or None}
        metrics = {**figures, **_step_metrics(est.step)}
        points.append(Point(est.option, params=params, tags=tags, metrics=metrics, series=series))
    stamp = time.strftime("%Y%m%d-%H%M%S")
    return log_points(
        kind="tune",
        name=t.run_name or f"tune-{recipe}",
        uri=resolve_uri(t.uri, run_cfg.output_dir),
        experiment=t.experiment,
        run_dir=Path(run_cfg.output_dir) / "tune" / f"{run_cfg.name}-{stamp}",
        artifact_location=default_artifact_location(run_cfg.output_dir),
        tags={
            **t.tags,
            "recipe": recipe,
            "drafter_kind": get_kind(run_cfg.model.kind).name,
            "target": run_cfg.target.path,
            "cluster": cfg.cluster.preset,
            "measured": cfg.measure,
            "recommended": recommended,
        },
        params={f"tune.{k}": v for k, v in flatten(cfg).items() if not k.startswith("tracking.")},
        text={"tune.txt": text},
        points=points,
        timeout_s=t.timeout_s,
        flush_timeout_s=t.flush_timeout_s,
        parent_run_id=t.parent_run_id,
    )
