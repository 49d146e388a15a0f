"""A sweep as MLflow runs: one parent run with one child run per point (a ZeRO option of
`dspark-ds tune`, a variant of `dspark-ds bench`), so that MLflow's Compare view of the children
shows the sweep side by side and `dspark-ds compare` prints it as one table."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from dspark_ds.tracking.mlflow import Tracker


@dataclass
class Point:
    """One child run."""

    name: str
    params: dict = field(default_factory=dict)
    tags: dict = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)
    """Logged at step 0."""
    series: dict[int, dict[str, float]] = field(default_factory=dict)
    """step -> metrics (e.g. a figure per node count)."""


def log_sweep(
    *,
    kind: str,
    name: str,
    uri: str,
    experiment: str | None,
    run_dir: Path,
    artifact_location: str,
    tags: dict,
    params: dict,
    text: dict[str, str],
    points: list[Point],
    timeout_s: float = 10.0,
    flush_timeout_s: float = 60.0,
    parent_run_id: str | None = None,
) -> str | None:
    """The parent (`tags`, `params`, `text` as artifacts: file name -> text) and one child per
    point, each tagged with the sweep's `tags` too; returns the parent's run id (None when the
    server did not answer: then no child is made, the parent's calls wait in its run dir)."""
    common = dict(
        enabled=True,
        uri=uri,
        experiment=experiment,
        kind=kind,
        resume=False,
        artifact_location=artifact_location,
        timeout_s=timeout_s,
        flush_timeout_s=flush_timeout_s,
    )
    parent = Tracker(
        **common, run_name=name, run_dir=str(run_dir), tags=tags, parent_run_id=parent_run_id
    )
    parent.log_params(params)
    for file_name, content in text.items():
        parent.log_text(content, file_name)
    if parent.run_id is None:
        parent.finish()
        return None
    for point in points:
        child = Tracker(
            **common,
            run_name=point.name,
            run_dir=str(run_dir / point.name),
            tags={**tags, **point.tags},
            parent_run_id=parent.run_id,
        )
        child.log_params(point.params)
        child.log_metrics(point.metrics, step=0)
        for step, metrics in point.series.items():
            child.log_metrics(metrics, step=step)
        child.finish()
    parent.finish()
    return parent.run_id
