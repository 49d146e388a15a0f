"""`dspark-ds sync-tracking`: send to MLflow what a run could not deliver.

    dspark-ds sync-tracking --run_dir runs/dspark-8b
    dspark-ds sync-tracking --run_dir runs/dspark-8b --tracking_uri http://mlflow-new:5000

With `<run_dir>/mlflow_undelivered.json` (written by a run's end when the server did not take
everything in `tracking.flush_timeout_s`): its calls, in their order, through the same sender
the run used (the run is made first if it never was); the file is removed once all arrived, or
keeps what still did not. Without it (a rank 0 that was killed never wrote one): every row of
the run's train_log.jsonl into the run named in `<run_dir>/mlflow_run_id`. Sending a metric
twice is harmless: each keeps the step and time it was logged with, and MLflow's SQL store keeps
one copy of a metric logged again with the same step, time and value.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from dspark_ds.errors import ConfigError
from dspark_ds.network import NetworkError
from dspark_ds.tracking.delivery import Delivery, rows_as_ops
from dspark_ds.tracking.sender import (
    UNDELIVERED_FILE,
    Sender,
    read_undelivered,
    summarize,
    write_undelivered,
)
from dspark_ds.tracking.store import RUN_ID_FILE


@dataclass
class SyncConfig:
    """Send what a run could not deliver to MLflow (or replay its train_log.jsonl)."""

    run_dir: str = ""
    """The run directory (<output_dir>/<name>)."""
    tracking_uri: str | None = None
    """Where to send; None = the store the run logged to."""
    timeout_s: float = 120.0
    """Give up (keeping what is left) after this long without the server taking everything."""
    request_timeout_s: float = 10.0
    """One request's timeout."""

    def validate(self) -> SyncConfig:
        if not self.run_dir:
            raise ConfigError("run_dir: required (the run directory, <output_dir>/<name>)")
        if not Path(self.run_dir).is_dir():
            raise ConfigError(f"run_dir: {self.run_dir} is not a directory")
        return self


def run_sync(cfg: SyncConfig) -> dict:
    """Returns {"sent": n, "left": n, "run_id": ...}."""
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", str(int(max(1, cfg.request_timeout_s))))
    run_dir = Path(cfg.run_dir)
    path = run_dir / UNDELIVERED_FILE
    if path.is_file():
        header, ops = read_undelivered(path)
        uri = cfg.tracking_uri or header["tracking_uri"]
        replay_log = header.get("replay_log")
        delivery = Delivery(uri, cfg.request_timeout_s, Path(replay_log) if replay_log else None)
        delivery.run_id, delivery.experiment_id = header.get("run_id"), header.get("experiment_id")
        delivery.records = [Path(p) for p in header.get("records", [])]
    else:
        run_id_file = run_dir / RUN_ID_FILE
        if not run_id_file.is_file():
            raise ConfigError(
                f"run_dir: {run_dir} has neither {UNDELIVERED_FILE} nor {RUN_ID_FILE}: no MLflow "
                "run to send to"
            )
        if cfg.tracking_uri is None:
            raise ConfigError(
                f"tracking_uri: required when {run_dir} has no {UNDELIVERED_FILE} (the store "
                f"of run {run_id_file.read_text().strip()})"
            )
        header, ops = {}, rows_as_ops(run_dir / "train_log.jsonl")
        delivery = Delivery(cfg.tracking_uri, cfg.request_timeout_s)
        delivery.run_id = run_id_file.read_text().strip()
        if not ops:
            raise ConfigError(f"run_dir: {run_dir}/train_log.jsonl has no rows to send")
    sender = Sender(delivery, max_queued_values=10**12, log=print)
    for op in ops:
        sender.put(op)
    what = summarize(ops)
    print(f"[sync-tracking] sending {what} to {delivery.uri} (run {delivery.run_id or 'new'})")
    done = sender.run_inline(cfg.timeout_s)
    left = sender.pending()
    for why in sender.dropped:
        print(f"[sync-tracking] WARNING: refused, not kept: {why}")
    if left:
        kept = "run it again once the server answers"
        if header:
            write_undelivered(
                path, {**header, "tracking_uri": delivery.uri, "run_id": delivery.run_id}, left
            )
            kept = f"kept in {path}"
        raise NetworkError(
            f"sync-tracking: {summarize(left)} still not delivered to {delivery.uri} after "
            f"{cfg.timeout_s:.0f} s ({sender.last_error or 'no answer'}); {kept}"
        )
    if path.is_file():
        path.unlink()
    print(f"[sync-tracking] delivered: run {delivery.run_id} at {delivery.uri}")
    return {"sent": len(ops), "left": 0, "run_id": delivery.run_id, "done": done}
