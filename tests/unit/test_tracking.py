"""MLflow tracker: rank 0 only, a resumed run continues its MLflow run, a dead server is harmless."""

from __future__ import annotations

import json

import pytest

from dspark_ds.cli import main as cli_main
from dspark_ds.errors import ConfigError
from dspark_ds.tracking.mlflow import Tracker
from dspark_ds.tracking.store import (
    default_artifact_location,
    default_uri,
    list_artifacts,
    metric_history,
    read_run,
)

from helpers.dist import free_port


def local_run(root, experiment: str = "exp") -> dict:
    """A tracker's options for the run "r" (its directory `root`/r) in the store under `root`."""
    return dict(
        enabled=True,
        uri=default_uri(str(root)),
        experiment=experiment,
        run_name="r",
        run_dir=str(root / "r"),
        artifact_location=default_artifact_location(str(root)),
    )


def test_log_then_resume_same_run(tmp_path):
    uri = default_uri(str(tmp_path))
    kw = local_run(tmp_path)
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
    t = Tracker.for_rank(1, **local_run(tmp_path, "e"))
    assert not t.enabled and t.run_id is None
    t.log_metrics({"x": 1.0}, step=1)
    t.finish()
    assert not (tmp_path / "mlflow.db").exists()


def test_unreachable_server_keeps_everything_for_sync(tmp_path, capfd):
    """No server at all: the tracker stays on; its end waits `flush_timeout_s`, keeps every call
    in <run>/mlflow_undelivered.json and names the command; `dspark-ds sync-tracking` later sends
    the run (made then), its params, every step and its end. A queue over its bound drops the
    oldest log steps from memory and reads them back from train_log.jsonl."""
    run = tmp_path / "r"
    run.mkdir()
    log = run / "train_log.jsonl"
    t = Tracker.for_rank(
        0,
        enabled=True,
        uri=f"http://127.0.0.1:{free_port()}",
        experiment="e",
        run_name="r",
        run_dir=str(run),
        artifact_location=default_artifact_location(str(tmp_path)),
        timeout_s=1,
        kind="train",
        replay_log=log,
        flush_timeout_s=0.5,
        max_queued_values=1000,
    )
    assert t.enabled and t.run_id is None
    t.log_params({"train.lr": 0.1})
    rows = []
    for step in range(1, 61):  # 60 x 30 values: past the bound of 1000 values
        row = {
            "step": step,
            "time": 1.7e9 + step,
            "loss": 1.0 / step,
            "train/loss": 1.0 / step,
            **{f"train/m{i}": float(i) for i in range(28)},
            "val/accept_rate@0": 0.5,
        }
        rows.append(row)
        metrics = {k: v for k, v in row.items() if "/" in k}
        t.log_metrics(metrics, step=step, timestamp=row["time"], in_log=True)
    log.write_text("".join(json.dumps(r) + "\n" for r in rows))
    left = t.finish()
    assert left and left[0].kind == "start" and left[-1].kind == "end"
    assert {op.kind for op in left} >= {"replay", "metrics", "params"}
    err = capfd.readouterr().err
    assert "training goes on" in err and f"dspark-ds sync-tracking --run_dir {run}" in err, err
    assert (run / "mlflow_undelivered.json").is_file()

    uri = default_uri(str(tmp_path))  # the store is back (here: another one, by --tracking_uri)
    assert cli_main(["sync-tracking", "--run_dir", str(run), "--tracking_uri", uri]) == 0
    assert not (run / "mlflow_undelivered.json").exists()
    run_id = (run / "mlflow_run_id").read_text().strip()
    got = read_run(uri, run_id)
    assert got.info.status == "FINISHED" and got.data.tags["kind"] == "train"
    assert got.data.params == {"train.lr": "0.1"}
    assert metric_history(uri, run_id, "train/loss") == [(r["step"], r["loss"]) for r in rows]
    assert len(metric_history(uri, run_id, "val/accept_rate_at_0")) == 60
    # sending again (e.g. the whole log, after a killed rank 0) adds no copy
    assert cli_main(["sync-tracking", "--run_dir", str(run), "--tracking_uri", uri]) == 0
    assert len(metric_history(uri, run_id, "train/m3")) == 60


def test_mlflow_run_id_in_the_environment(tmp_path, monkeypatch):
    """MLFLOW_RUN_ID: a RUNNING run is logged into (and said so); a finished one, a missing one,
    or one other than the run directory's own is refused with one line (exit 2); a nested run
    never reads it."""
    from mlflow.tracking import MlflowClient

    uri = default_uri(str(tmp_path))
    client = MlflowClient(tracking_uri=uri)
    exp = client.create_experiment("e", artifact_location=default_artifact_location(str(tmp_path)))
    theirs = client.create_run(exp).info.run_id
    kw = dict(
        enabled=True,
        uri=uri,
        experiment="e",
        run_name="r",
        artifact_location=default_artifact_location(str(tmp_path)),
        kind="train",
    )
    monkeypatch.setenv("MLFLOW_RUN_ID", theirs)
    t = Tracker(run_dir=str(tmp_path / "a"), **kw)
    assert t.run_id == theirs
    t.finish()
    assert read_run(uri, theirs).data.tags["kind"] == "train"
    with pytest.raises(ConfigError, match=f"MLFLOW_RUN_ID: run {theirs} is FINISHED"):
        Tracker(run_dir=str(tmp_path / "b"), **kw)
    monkeypatch.setenv("MLFLOW_RUN_ID", "0" * 32)
    with pytest.raises(ConfigError, match="does not exist"):
        Tracker(run_dir=str(tmp_path / "c"), **kw)
    nested = Tracker(run_dir=str(tmp_path / "d"), parent_run_id=theirs, **kw)
    assert nested.run_id not in (theirs, "0" * 32)
    nested.finish()
    assert read_run(uri, nested.run_id).data.tags["mlflow.parentRunId"] == theirs
    other = client.create_run(exp).info.run_id
    monkeypatch.setenv("MLFLOW_RUN_ID", other)
    with pytest.raises(ConfigError, match="is not the run this run directory continues"):
        Tracker(run_dir=str(tmp_path / "a"), **kw)  # a/mlflow_run_id names `theirs`


def test_artifacts_stay_under_the_output_directory(tmp_path, monkeypatch):
    """Nothing lands in the current directory (MLflow's default artifact root is ./mlruns)."""
    cwd, out = tmp_path / "cwd", tmp_path / "out"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    export = tmp_path / "export"
    export.mkdir()
    (export / "model.safetensors").write_bytes(b"weights")
    t = Tracker.for_rank(0, **local_run(out))
    t.log_text("a: 1\n", "config.yaml")
    t.log_artifacts(str(export), "export")
    t.finish()
    assert list(cwd.iterdir()) == []
    stored = sorted(p.relative_to(out).parts[0] for p in out.rglob("model.safetensors"))
    assert stored == ["mlartifacts"]
    assert "export" in list_artifacts(default_uri(str(out)), t.run_id)


def test_node_layout_and_monitor():
    """Ranks of one host and node id are one node, in the order of their lowest rank; the
    node's lowest rank monitors it. On this machine (no GPU) the monitor's window has the CPU
    and host memory figures, no GPU ones."""
    import torch

    from dspark_ds.tracking.system import FIELDS, NodeLayout, NodeMetrics

    keys = [("b", "1"), ("a", "0"), ("b", "1"), ("a", "0")]  # a cyclic placement of 4 ranks
    layout = NodeLayout.from_keys(keys)
    assert layout.node_of_rank == [0, 1, 0, 1] and layout.hosts == ["b", "a"]
    assert [layout.leader(r) for r in range(4)] == [True, True, False, False]
    assert layout.local_ranks(3) == 2
    one = NodeLayout.from_keys([("vm", "0")])
    nodes = NodeMetrics(one, 0, torch.device("cpu"), interval_s=0.05)
    try:
        part = nodes.part()
        assert part.shape == (1, len(FIELDS)) and part.dtype == torch.float64
        metrics = nodes.metrics(part.view(-1).tolist())
    finally:
        nodes.close()
    assert set(metrics) == {
        f"system/node0/{f}" for f in ("cpu_percent", "host_memory_used_gb", "host_memory_percent")
    }
    assert 0 <= metrics["system/node0/cpu_percent"] <= 100
    assert 0 < metrics["system/node0/host_memory_used_gb"]
    # a rank that is not its node's leader contributes zeros
    other = NodeMetrics(NodeLayout.from_keys(keys), 2, torch.device("cpu"), interval_s=0.05)
    assert other.monitor is None and float(other.part().abs().sum()) == 0.0


def test_dataset_digests_tell_regenerations_apart(tmp_path):
    """The same path holding two regenerations (other tokens) gives two digests; the same
    tokens give the same one."""
    from types import SimpleNamespace

    from dspark_ds.data.config import DataConfig
    from dspark_ds.data.tokens import TokenStore
    from dspark_ds.train.lineage import data_inputs

    path = tmp_path / "prepared"
    cfg = DataConfig(paths=[str(path)])

    def digest_of(samples):
        TokenStore.from_samples(samples, {"pad_token_id": 0}).save(path)
        return data_inputs(SimpleNamespace(samples=TokenStore.load(path)), cfg)[0]

    first = digest_of([([1, 2, 3], [0, 1, 1]), ([4, 5], [0, 1])])
    again = digest_of([([1, 2, 3], [0, 1, 1]), ([4, 5], [0, 1])])
    other = digest_of([([1, 2, 7], [0, 1, 1]), ([4, 5], [0, 1])])
    assert first["digest"] == again["digest"] != other["digest"]
    assert first["source"] == str(path.resolve()) and first["profile"]["num_samples"] == 2
    assert len(first["digest"]) <= 36  # MLflow's column


def test_zero_option_names_are_the_tuners():
    from dspark_ds.cli import parse_config
    from dspark_ds.train.lineage import zero_option
    from dspark_ds.tune.config import OPTIONS
    from dspark_ds.tune.estimate import resolved_ds_config

    run_cfg = parse_config("train", ["--config", "tiny_cpu", "--target.path", "x"])
    for option in OPTIONS:
        ds = resolved_ds_config(option, run_cfg, 1, use_gpu=False)
        if option.name == "zero3+hpz":  # resolved on one rank: a group of 1, hpZ off
            assert ds["zero_optimization"]["zero_hpz_partition_size"] == 1
            assert zero_option(ds) == "zero3"
            ds["zero_optimization"]["zero_hpz_partition_size"] = 8  # a node's 8 ranks
        assert zero_option(ds) == option.name, option
