"""The demo's two launchers (demo/launcher.py): ranks forked from the demo process, and torchrun.

The forked ranks must look like torchrun's to the code they run (the same variables), report the
first failing rank's exit code, stop ranks that would otherwise wait for a failed peer, and use
their own database connections."""

from __future__ import annotations

import os
import sys
import time

import pytest

from dspark_ds import __version__
from dspark_ds.demo import launcher


def _print_env(argv: list[str]) -> int:
    keys = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    print(" ".join(f"{k}={os.environ[k]}" for k in keys), argv, os.environ["DEMO_TEST_VAR"])
    return 0


def test_forked_ranks_get_torchruns_variables_and_their_output_is_logged(tmp_path):
    log = tmp_path / "stage.log"
    rc = launcher.run_forked(["a", "b"], 2, {"DEMO_TEST_VAR": "seen"}, log, main=_print_env)
    assert rc == 0
    lines = sorted(log.read_text().splitlines())
    assert len(lines) == 2, lines
    ports = {line.split("MASTER_PORT=")[1].split()[0] for line in lines}
    assert len(ports) == 1
    for rank, line in enumerate(lines):
        assert line.startswith(
            f"RANK={rank} LOCAL_RANK={rank} WORLD_SIZE=2 LOCAL_WORLD_SIZE=2 MASTER_ADDR=127.0.0.1"
        ), line
        assert line.endswith("['a', 'b'] seen"), line
    # the parent's environment is not the ranks'
    assert "DEMO_TEST_VAR" not in os.environ


def test_forked_ranks_run_the_cli(tmp_path):
    log = tmp_path / "stage.log"
    assert launcher.run_forked(["--version"], 2, {}, log) == 0
    assert log.read_text().splitlines() == [f"dspark-ds {__version__}"] * 2
    # a subcommand's usage error is the rank's exit code, and its message is in the log
    assert launcher.run_forked(["no-such-subcommand"], 1, {}, log) == 2
    assert "unknown subcommand 'no-such-subcommand'" in log.read_text()


def _rank1_fails_rank0_waits(argv: list[str]) -> int:
    if os.environ["RANK"] == "1":
        raise RuntimeError("rank 1 broke")
    time.sleep(600)  # as a rank waiting in a collective for its failed peer would
    return 0


def test_a_failed_rank_fails_the_stage_and_the_waiting_rank_is_stopped(tmp_path, monkeypatch):
    monkeypatch.setattr(launcher, "STOP_GRACE_S", 0.5)
    log = tmp_path / "stage.log"
    t0 = time.monotonic()
    rc = launcher.run_forked([], 2, {}, log, main=_rank1_fails_rank0_waits)
    assert rc == 1  # the failed rank's code, not the stopped rank's SIGTERM
    assert time.monotonic() - t0 < 30
    assert "RuntimeError: rank 1 broke" in log.read_text()


def _sleep_a_second(argv: list[str]) -> int:
    time.sleep(1.0)
    return 0


def test_waiting_for_the_ranks_leaves_other_children_alone(tmp_path):
    """The launcher reaps its own ranks only: a subprocess the caller started keeps its exit
    status for the caller's wait()."""
    import subprocess

    other = subprocess.Popen([sys.executable, "-c", "raise SystemExit(7)"])
    rc = launcher.run_forked([], 1, {}, tmp_path / "stage.log", main=_sleep_a_second)
    assert rc == 0
    assert other.wait(timeout=30) == 7


def _engine_pool_id(uri: str) -> int:
    from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore

    (engine,) = [e for key, e in SqlAlchemyStore._engine_map.items() if key == uri]
    return id(engine.pool)


def _log_a_run(argv: list[str]) -> int:
    from mlflow.tracking import MlflowClient

    # SQLAlchemy's rule after fork: a pool of its own, not the parent's connections
    if _engine_pool_id(argv[0]) == int(argv[1]):
        return 3
    client = MlflowClient(tracking_uri=argv[0])
    experiment = client.get_experiment_by_name("forked").experiment_id
    run = client.create_run(experiment, run_name=f"rank{os.environ['RANK']}")
    client.log_metric(run.info.run_id, "x", 1.0)
    client.set_terminated(run.info.run_id)
    return 0


def test_forked_ranks_write_to_a_tracking_database_the_parent_has_open(tmp_path):
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=uri)
    experiment = client.create_experiment("forked")
    client.set_terminated(client.create_run(experiment, run_name="parent").info.run_id)

    def names() -> list[str]:
        return sorted(r.info.run_name for r in client.search_runs([experiment]))

    for stage in range(2):  # the second stage forks after the parent read the database again
        argv = [uri, str(_engine_pool_id(uri))]
        assert launcher.run_forked(argv, 1, {}, tmp_path / "stage.log", main=_log_a_run) == 0
        assert names() == ["parent"] + ["rank0"] * (stage + 1)


@pytest.mark.slow  # a torchrun launch, like the other multi-process runs
def test_torchrun_launcher_runs_the_cli_on_every_rank(tmp_path):
    log = tmp_path / "stage.log"
    assert launcher.run_torchrun(["--version"], 2, {}, log) == 0
    assert log.read_text().count(f"dspark-ds {__version__}") == 2


def test_fork_refuses_openmp_threads():
    from dspark_ds.demo.config import DemoConfig

    with pytest.raises(ValueError, match="num_threads: 2 needs launcher torchrun"):
        DemoConfig(num_threads=2).validate()
    DemoConfig(num_threads=2, launcher="torchrun").validate()


def test_preload_imports_under_the_stage_environment_and_restores_it(monkeypatch):
    import deepspeed  # noqa: F401 - imported here with DS_ACCELERATOR=cpu (conftest)

    monkeypatch.delenv("DEMO_TEST_VAR", raising=False)
    launcher.preload({"DS_ACCELERATOR": "cpu", "DEMO_TEST_VAR": "x"})
    assert "DEMO_TEST_VAR" not in os.environ
    assert all(m in sys.modules for m in launcher.PRELOAD)
    # DeepSpeed keeps the accelerator of its first import: forked ranks could not change it
    with pytest.raises(RuntimeError, match="accelerator 'cpu'.*--launcher torchrun"):
        launcher.preload({"DS_ACCELERATOR": "cuda"})
