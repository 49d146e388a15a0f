"""Where runs live and what names them: the store and the experiment (the options, else the
environment), the tags every run carries, the files that name a run (<run_dir>/mlflow_run_id, an
export's record), and reading runs back (for tools and tests).

Default store: `$MLFLOW_TRACKING_URI`, else `sqlite:///<output_dir>/mlflow.db` (every run under
one output dir lands in one store, so `mlflow ui --backend-store-uri sqlite:///runs/mlflow.db`
compares them). With a local store (sqlite or files) an experiment the tracker creates keeps its
artifacts under `<output_dir>/mlartifacts` (MLflow's own default is `./mlruns` of the current
directory); a tracking server decides where its artifacts go.

Every run says what it is (`kind`: train / eval / tune / demo / bench) and carries the tags runs
are grouped by (`RUN_TAGS`); a nested run names its parent (`mlflow.parentRunId`): the demo's
stages under the demo's run, an evaluation under the training run of the drafter it evaluates
(the export's `mlflow_run.json` names it), the tuner's options under the sweep.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

RUN_ID_FILE = "mlflow_run_id"
EXPORT_RECORD = "mlflow_run.json"
"""In an export directory: the MLflow run that trained it ({"run_id", "tracking_uri", ...})."""
KIND_TAG = "kind"
KINDS = ("train", "eval", "tune", "demo", "bench")
PARENT_TAG = "mlflow.parentRunId"
LAUNCH_TAG = "dspark.launch_id"
"""A random id per tracker: finds the run a create_run made whose answer was lost."""
RUN_TAGS = (
    "kind",
    "drafter_kind",
    "target",
    "recipe",
    "zero",
    "seed",
    "world_size",
    "slurm_job_id",
)
"""The tags a user groups runs by (each run sets those that apply to it)."""
DEFAULT_EXPERIMENT = "dspark-ds"
MODEL_TYPE = "dspark-ds-drafter"


def default_uri(output_dir: str) -> str:
    return f"sqlite:///{Path(output_dir).resolve() / 'mlflow.db'}"


def resolve_uri(uri: str | None, output_dir: str) -> str:
    """`tracking.uri`, else `$MLFLOW_TRACKING_URI`, else the output directory's sqlite store."""
    return uri or os.environ.get("MLFLOW_TRACKING_URI") or default_uri(output_dir)


def resolve_experiment(experiment: str | None) -> str:
    """`tracking.experiment`, else `$MLFLOW_EXPERIMENT_NAME`, else "dspark-ds"."""
    return experiment or os.environ.get("MLFLOW_EXPERIMENT_NAME") or DEFAULT_EXPERIMENT


def default_artifact_location(output_dir: str) -> str:
    """Where a new experiment in a local store keeps its artifacts: under the output directory."""
    return (Path(output_dir).resolve() / "mlartifacts").as_uri()


def is_local_store(uri: str) -> bool:
    """sqlite / file stores (and plain paths): MLflow itself decides their artifact location."""
    scheme = uri.split(":", 1)[0] if "://" in uri or uri.startswith("sqlite:") else ""
    return scheme in ("", "file", "sqlite")


def git_sha() -> str | None:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            timeout=5,
            cwd=Path(__file__).resolve().parent,
        )
        return out.stdout.strip() or None if out.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        return None


def write_export_record(export_dir: str | Path, run_id: str, tracking_uri: str | None) -> None:
    """Names the training run in an export directory (`dspark-ds export` of its checkpoint:
    the store is not known there, None)."""
    record = {"run_id": run_id, "experiment_id": None, "tracking_uri": tracking_uri}
    (Path(export_dir) / EXPORT_RECORD).write_text(json.dumps(record, indent=1) + "\n")


def run_exists(uri: str, run_id: str) -> bool:
    # lazy: mlflow, 1.4 s of import
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    try:
        MlflowClient(tracking_uri=uri).get_run(run_id)
        return True
    except MlflowException:
        return False


def read_export_record(export_dir: str | Path) -> dict | None:
    """The MLflow run an export directory names (`EXPORT_RECORD`), or None."""
    path = Path(export_dir) / EXPORT_RECORD
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) and record.get("run_id") else None


def read_run(uri: str, run_id: str):
    """The MLflow run (params, metrics, tags) — for tools and tests."""
    # lazy: mlflow, 1.4 s of import
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=uri).get_run(run_id)


def metric_history(uri: str, run_id: str, key: str) -> list[tuple[int, float]]:
    # lazy: mlflow, 1.4 s of import
    from mlflow.tracking import MlflowClient

    hist = MlflowClient(tracking_uri=uri).get_metric_history(run_id, key)
    return [(m.step, m.value) for m in sorted(hist, key=lambda m: (m.step, m.timestamp))]


def list_artifacts(uri: str, run_id: str) -> list[str]:
    # lazy: mlflow, 1.4 s of import
    from mlflow.tracking import MlflowClient

    return [a.path for a in MlflowClient(tracking_uri=uri).list_artifacts(run_id)]


def child_runs(uri: str, parent_run_id: str) -> list:
    """The runs nested under `parent_run_id` (oldest first)."""
    # lazy: mlflow, 1.4 s of import
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    parent = client.get_run(parent_run_id)
    return client.search_runs(
        [parent.info.experiment_id],
        filter_string=f"tags.`{PARENT_TAG}` = '{parent_run_id}'",
        order_by=["attributes.start_time ASC"],
    )
