"""MLflow tracker: rank 0 only, a resumed run continues its MLflow run, a dead server is harmless."""

from __future__ import annotations

import warnings

from dspark_ds.tracking.mlflow import (
    Tracker,
    default_artifact_location,
    default_uri,
    list_artifacts,
    metric_history,
    read_run,
)

from helpers.dist import free_port


def test_log_then_resume_same_run(tmp_path):
    uri = default_uri(str(tmp_path))
    kw = dict(enabled=True, uri=uri, experiment="exp", run_name="r", run_dir=str(tmp_path / "r"))
    kw["artifact_location"] = default_artifact_location(str(tmp_path))
    t = Tracker.for_rank(0, **kw)
    t.log_params({"train.lr": 0.1, "model.block_size": 7})
    t.log_metrics({"train/loss": 2.0, "train/accept_rate@0": 0.5}, step=1)
    t.log_dict({"zero_optimization": {"stage": 3}}, "ds_config.json")
    t.set_tags({"world_size": 2, "slurm_job_id": None})
    t.finish("KILLED")
    first = t.run_id

    again = Tracker.for_rank(0, **kw)  # the requeued job
    assert again.run_id == first
    again.log_params({"train.lr": 0.1, "train.extra": 1})  # logged ones are not re-sent
    again.log_metrics({"train/loss": 1.5}, step=2)
    again.finish()

    run = read_run(uri, first)
    assert run.data.params == {"train.lr": "0.1", "model.block_size": "7", "train.extra": "1"}
    assert run.data.tags["world_size"] == "2" and "slurm_job_id" not in run.data.tags
    assert metric_history(uri, first, "train/loss") == [(1, 2.0), (2, 1.5)]
    assert metric_history(uri, first, "train/accept_rate_at_0") == [(1, 0.5)]
    assert "ds_config.json" in list_artifacts(uri, first)
    assert run.info.status == "FINISHED"


def test_other_ranks_and_disabled_do_nothing(tmp_path):
    t = Tracker.for_rank(
        1,
        enabled=True,
        uri=default_uri(str(tmp_path)),
        experiment="e",
        run_name="r",
        run_dir=str(tmp_path / "r"),
        artifact_location=default_artifact_location(str(tmp_path)),
    )
    assert not t.enabled and t.run_id is None
    t.log_metrics({"x": 1.0}, step=1)
    t.finish()
    assert not (tmp_path / "mlflow.db").exists()


def test_unreachable_server_warns_and_goes_on(tmp_path):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        t = Tracker.for_rank(
            0,
            enabled=True,
            uri=f"http://127.0.0.1:{free_port()}",
            experiment="e",
            run_name="r",
            run_dir=str(tmp_path),
            artifact_location=default_artifact_location(str(tmp_path)),
            timeout_s=2,
        )
    assert not t.enabled and t.run_id is None
    assert any("training continues" in str(w.message) for w in caught)
    t.log_metrics({"train/loss": 1.0}, step=1)  # no exception
    t.finish()


def test_artifacts_stay_under_the_output_directory(tmp_path, monkeypatch):
    """Nothing lands in the current directory (MLflow's default artifact root is ./mlruns)."""
    cwd, out = tmp_path / "cwd", tmp_path / "out"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    export = tmp_path / "export"
    export.mkdir()
    (export / "model.safetensors").write_bytes(b"weights")
    t = Tracker.for_rank(
        0,
        enabled=True,
        uri=default_uri(str(out)),
        experiment="exp",
        run_name="r",
        run_dir=str(out / "r"),
        artifact_location=default_artifact_location(str(out)),
    )
    t.log_text("a: 1\n", "config.yaml")
    t.log_artifacts(str(export), "export")
    t.finish()
    assert list(cwd.iterdir()) == []
    stored = sorted(p.relative_to(out).parts[0] for p in out.rglob("model.safetensors"))
    assert stored == ["mlartifacts"]
    assert "export" in list_artifacts(default_uri(str(out)), t.run_id)
