"""Helpers for multi-process tests (shared by every test module).

- ``free_port()``: a TCP port nobody listens on.
- ``run_distributed(fn, world_size=2, backend="gloo", args=())``: run ``fn(rank, world_size,
  *args)`` in ``world_size`` spawned processes that share a gloo process group; re-raises the
  first failure. ``fn`` must be importable (a module-level function).
- ``torchrun(argv, nproc=2, ...)``: ``torchrun --nproc_per_node nproc <argv>`` as a subprocess
  with a free rendezvous port and ``DS_ACCELERATOR=cpu``; returns the CompletedProcess.
- ``python(argv, ...)``: the same for one plain process (``python3 <argv>``).
- ``train_many``: ``python tests/helpers/dist.py train-many <json>`` runs several
  ``dspark-ds train`` argument lists in ONE process (one deepspeed import, one process group);
  used under torchrun to keep 2-rank tests cheap. The runs are under the device guard
  (helpers/device_guard.py).
- ``GUARDED``: prefix of a torchrun / python argv that runs the rest under the device guard;
  ``guarded_env(dir)`` / ``guard_stats(dir)``: where its processes leave their counts.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import traceback
from pathlib import Path

import torch.multiprocessing as mp

REPO = Path(__file__).resolve().parents[2]
LAUNCHES: list[str] = []
"""Every multi-process launch of this process's tests, in order (`run_distributed`,
`torchrun` with 2 or more ranks): tests/conftest.py checks that a test which launched one is
marked `distributed` and `slow`."""
GUARDED = [str(REPO / "tests" / "helpers" / "device_guard.py")]


def guarded_env(stats_dir: Path) -> dict:
    """Env of a GUARDED launch whose ranks write their guard counts under `stats_dir`."""
    stats_dir.mkdir(parents=True, exist_ok=True)
    return {"DEVICE_GUARD_STATS": str(stats_dir / "guard")}


def guard_stats(stats_dir: Path) -> list[dict]:
    """The counts each guarded process of a launch left (one dict per process)."""
    return [json.loads(p.read_text()) for p in sorted(stats_dir.glob("guard.*"))]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(extra: dict | None = None) -> dict:
    env = dict(os.environ)
    env["DS_ACCELERATOR"] = "cpu"
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("PYTHONFAULTHANDLER", "1")  # a crashing rank prints where each thread was
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    env.update(extra or {})
    return env


def _worker(rank, world_size, backend, port, fn, args, errors):
    import faulthandler

    import torch.distributed as dist

    faulthandler.enable()  # a rank that aborts in C++ prints where each Python thread was
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        DS_ACCELERATOR="cpu",
    )
    try:
        dist.init_process_group(backend, rank=rank, world_size=world_size)
        fn(rank, world_size, *args)
        dist.barrier()  # no rank tears its gloo pairs down while another still uses them
    except BaseException:  # noqa: BLE001 - reported to the parent
        errors.put((rank, traceback.format_exc()))
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    # Done and torn down: leave without the interpreter's and C++ static destructors. gloo's
    # and the TCP store's threads ending beside them aborted a passing rank once in a loaded
    # suite ("terminate called without an active exception", SIGABRT, stop 57's CI).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_distributed(fn, world_size: int = 2, backend: str = "gloo", args: tuple = ()) -> None:
    LAUNCHES.append(f"run_distributed({getattr(fn, '__name__', fn)}, world_size={world_size})")
    ctx = mp.get_context("spawn")
    errors = ctx.SimpleQueue()
    port = free_port()
    try:
        mp.start_processes(
            _worker,
            args=(world_size, backend, port, fn, args, errors),
            nprocs=world_size,
            join=True,
            start_method="spawn",
        )
    except mp.ProcessRaisedException as err:
        details = [] if errors.empty() else [errors.get()]
        msg = "\n".join(f"rank {r}:\n{tb}" for r, tb in details) or str(err)
        raise AssertionError(f"distributed test failed:\n{msg}") from None


def torchrun(
    argv: list[str],
    nproc: int = 2,
    env: dict | None = None,
    timeout_s: float = 600,
    cwd: str | Path | None = None,
) -> subprocess.CompletedProcess:
    if nproc >= 2:
        LAUNCHES.append(f"torchrun --nproc_per_node={nproc} {' '.join(map(str, argv[:3]))}")
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc_per_node={nproc}",
        "--master_addr=127.0.0.1",
        f"--master_port={free_port()}",
        *argv,
    ]
    return subprocess.run(
        cmd, env=_env(env), capture_output=True, text=True, timeout=timeout_s, cwd=cwd or REPO
    )


def python(
    argv: list[str], env: dict | None = None, timeout_s: float = 600, cwd: str | Path | None = None
) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, *argv],
        env=_env(env),
        capture_output=True,
        text=True,
        timeout=timeout_s,
        cwd=cwd or REPO,
    )


def check(proc: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    """Assert success, showing the tail of the output otherwise."""
    assert proc.returncode == 0, (
        f"exit {proc.returncode}\n--- stdout ---\n{proc.stdout[-4000:]}\n"
        f"--- stderr ---\n{proc.stderr[-6000:]}"
    )
    return proc


def target_facts(trainer) -> dict | None:
    """How the in-job target is held on this rank (None offline): whether the drafter's
    embedding / lm_head are the target's Parameters, and how many target weights this rank
    stores (a ZeRO-3 partition: ds_tensor) and has materialised right now (param.data)."""
    target = trainer.target
    if target is None:
        return None
    drafter, params = trainer.engine.module, list(target.parameters())
    return {
        "shares": drafter.embed_tokens.weight is target.embed_weight
        and drafter.lm_head.weight is target.lm_head_weight,
        "frozen": not any(p.requires_grad for p in params),
        "full_numel": sum(int(getattr(p, "ds_numel", p.numel())) for p in params),
        "local_numel": sum(
            p.ds_tensor.numel() if hasattr(p, "ds_tensor") else p.numel() for p in params
        ),
        "materialized_numel": sum(p.data.numel() for p in params),
    }


def train_many(runs: list[list[str]], result_file: str) -> None:
    """Each entry: the argv of `dspark-ds train`. Rank 0 writes {name: losses, ...} to
    result_file (with `target_facts` of every rank, after the run), and to
    `<result_file>.device_guard.json` the counts of the collectives the device guard checked
    (helpers/device_guard.py: every run here is guarded; a host-made tensor handed to a
    collective by dspark_ds fails the run)."""
    import torch.distributed as dist

    from dspark_ds.cli import parse_config
    from dspark_ds.distributed import leave
    from dspark_ds.train.trainer import Trainer

    from helpers.device_guard import DeviceGuard

    results = {}
    with DeviceGuard() as guard:
        for argv in runs:
            cfg = parse_config("train", argv)
            trainer = Trainer(cfg)
            res = trainer.run()
            facts = [None] * dist.get_world_size()
            dist.all_gather_object(facts, target_facts(trainer))
            results[cfg.name] = {
                "losses": res.losses,
                "export_dir": res.export_dir,
                "mlflow_run_id": res.mlflow_run_id,
                "val": res.val_metrics,
                "target": facts,
            }
            del trainer
        if int(os.environ.get("RANK", 0)) == 0:
            Path(result_file).write_text(json.dumps(results))
            Path(f"{result_file}.device_guard.json").write_text(json.dumps(guard.stats))
        leave(0, whole_process=True)


if __name__ == "__main__":
    sys.path.insert(0, str(REPO / "tests"))  # `helpers.*` as the test modules import it
    if sys.argv[1] == "train-many":
        spec = json.loads(Path(sys.argv[2]).read_text())
        train_many(spec["runs"], spec["result_file"])
