"""How the demo starts a multi-rank stage: `torchrun`, or ranks forked from the demo's process.

    torchrun   `python -m torch.distributed.run --nproc_per_node N -m dspark_ds.cli <sub> ...`:
               what a user types; every stage pays a new interpreter per rank (and one for
               torchrun itself) that imports torch, transformers, DeepSpeed and MLflow again.
    fork       the demo imports those once (`preload`), then forks N rank processes per stage
               that run the same `dspark_ds.cli.main([<sub>, "--config", yaml])` with the
               variables torchrun would set (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
               MASTER_ADDR, MASTER_PORT). Each stage still gets fresh processes and a fresh
               process group; only the imports are shared.

Both launchers tee the ranks' output to the console and to the stage's log, and fail the stage
naming the log when a rank fails (forked: the other ranks are stopped rather than left waiting
in a collective).
"""

from __future__ import annotations

import contextlib
import importlib
import os
import signal
import subprocess
import sys
import threading
import time
import traceback
import warnings
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import torch
import torch.distributed as dist

from dspark_ds import cli
from dspark_ds.distributed import free_port, print0
from dspark_ds.engine.runtime import accelerator_name

PRELOAD = (
    "deepspeed",
    "mlflow",
    "mlflow.store.tracking.sqlalchemy_store",
    "transformers.models.qwen3.modeling_qwen3",
    "dspark_ds.engine.drafter",
    "dspark_ds.train.trainer",
    "dspark_ds.tracking.mlflow",
    "dspark_ds.data.regeneration",
    "dspark_ds.data.cache_writer",
)
"""What the demo's stages import that the demo process itself would not: imported once before the
first fork, so the forked ranks start with them (the time torchrun's ranks spend importing)."""

STOP_GRACE_S = 10.0
"""After one forked rank failed, how long the others get to finish on their own before SIGTERM
(and as long again before SIGKILL)."""


@contextlib.contextmanager
def environment(values: Mapping[str, str]) -> Iterator[None]:
    """`values` set in os.environ for the block, the previous environment restored after."""
    saved = dict(os.environ)
    os.environ.update(values)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def preload(env: Mapping[str, str]) -> None:
    """Imports `PRELOAD` under the stages' environment (DeepSpeed picks its accelerator from
    DS_ACCELERATOR when first imported). Raises if DeepSpeed was imported earlier with another
    accelerator than the environment asks for."""
    wanted = env.get("DS_ACCELERATOR")
    with environment(env), warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        if wanted and "deepspeed" in sys.modules:
            have = accelerator_name()
            if have != wanted:
                raise RuntimeError(
                    f"demo launcher 'fork': DeepSpeed was already imported in this process "
                    f"with accelerator {have!r}, the stages need {wanted!r}; run with "
                    "--launcher torchrun"
                )
        for module in PRELOAD:
            importlib.import_module(module)


def _tee(stream, log, sink) -> None:
    for line in stream:
        log.write(line)
        sink.write(line)
    sink.flush()


def run_torchrun(argv: list[str], nproc: int, env: Mapping[str, str], log_path: Path) -> int:
    """`torchrun --nproc_per_node nproc -m dspark_ds.cli <argv>` in a subprocess -> exit code."""
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}"]
    cmd += ["--master_addr=127.0.0.1", f"--master_port={free_port()}", "-m", "dspark_ds.cli", *argv]
    print0("[demo] $ " + " ".join(cmd[1:]))
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            cmd,
            env={**os.environ, **env},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            bufsize=1,
        )
        assert proc.stdout is not None
        _tee(proc.stdout, log, sys.stdout)
        return proc.wait()


def _rank_main(main, argv: list[str], rank_env: Mapping[str, str], write_fd: int, threads: int):
    """A forked rank: output into the pipe, torchrun's variables, `main(argv)`, exit with its
    code."""
    code = 1
    try:
        os.dup2(write_fd, 1)
        os.dup2(write_fd, 2)
        os.close(write_fd)
        # the parent's sys.stdout may write elsewhere than its fd 1 (pytest's capture, a
        # notebook): this rank's Python output goes to the pipe as well
        sys.stdout = open(1, "w", buffering=1, errors="replace", closefd=False)  # noqa: SIM115
        sys.stderr = open(2, "w", buffering=1, errors="replace", closefd=False)  # noqa: SIM115
        # the parent's handlers (pytest's, the demo's) are not this rank's
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.environ.update(rank_env)
        _fresh_database_connections()
        warnings.simplefilter("ignore", FutureWarning)
        torch.set_num_threads(threads)
        code = (main or cli.main)(argv)
    except SystemExit as err:
        code = err.code if isinstance(err.code, int) else 1
    except BaseException:
        traceback.print_exc()
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


def _fresh_database_connections() -> None:
    """SQLAlchemy's rule after fork(): the parent's pooled connections are not the child's
    (`engine.dispose(close=False)` gives the child its own pool). MLflow keeps one engine per
    tracking database, which the demo process has used if it evaluated before this stage."""
    store = sys.modules.get("mlflow.store.tracking.sqlalchemy_store")
    engines = getattr(getattr(store, "SqlAlchemyStore", None), "_engine_map", None) or {}
    for engine in list(engines.values()):
        engine.dispose(close=False)


def run_forked(
    argv: list[str],
    nproc: int,
    env: Mapping[str, str],
    log_path: Path,
    threads: int = 1,
    main: Callable[[list[str]], int] | None = None,
) -> int:
    """`dspark-ds <argv>` (or `main(argv)`) on `nproc` ranks forked from this process -> the
    first non-zero exit code of a rank (0 when all succeeded)."""
    if dist.is_available() and dist.is_initialized():
        raise RuntimeError(
            "demo launcher 'fork': this process is in a process group, which forked ranks "
            "would inherit; run with --launcher torchrun"
        )
    port = free_port()
    print0(f"[demo] $ dspark-ds {' '.join(argv)}  ({nproc} forked rank(s), port {port})")
    sys.stdout.flush()
    sys.stderr.flush()
    read_fd, write_fd = os.pipe()
    pids: list[int] = []
    for rank in range(nproc):
        rank_env = {
            **env,
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(nproc),
            "LOCAL_WORLD_SIZE": str(nproc),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
        }
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child's coverage is its output
            os.close(read_fd)
            _rank_main(main, argv, rank_env, write_fd, threads)
        pids.append(pid)
    os.close(write_fd)
    with open(log_path, "w") as log, os.fdopen(read_fd, errors="replace") as pipe:
        reader = threading.Thread(target=_tee, args=(pipe, log, sys.stdout), daemon=True)
        reader.start()
        code = _wait_all(pids)
        reader.join()
    return code


def _wait_all(pids: list[int]) -> int:
    """Waits for every rank; once one fails, the rest get `STOP_GRACE_S`, then SIGTERM, then
    SIGKILL (a rank left alone in a collective would wait forever). Ctrl-C here stops them the
    same way."""
    alive, first_bad, failed_at, sent = set(pids), 0, None, set()
    try:
        while alive:
            # NOTE: each rank by its pid: waitpid(-1) would also reap children this process
            # started elsewhere (a subprocess.Popen whose exit status would then be lost)
            for pid in sorted(alive):
                done, status = os.waitpid(pid, os.WNOHANG)
                if done == 0:
                    continue
                alive.discard(pid)
                code = os.waitstatus_to_exitcode(status)
                if code != 0 and first_bad == 0:
                    first_bad = code if code > 0 else 128 - code
                    failed_at = time.monotonic()
            if alive:
                if failed_at is not None:
                    _stop(alive, time.monotonic() - failed_at, sent)
                time.sleep(0.05)
    except KeyboardInterrupt:
        for pid in alive:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
        for pid in alive:
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, 0)
        raise
    return first_bad


def _stop(alive: set[int], since_failure_s: float, sent: set[int]) -> None:
    """SIGTERM once `STOP_GRACE_S` after the failure, SIGKILL once after twice that."""
    if since_failure_s < STOP_GRACE_S:
        return
    sig = signal.SIGTERM if since_failure_s < 2 * STOP_GRACE_S else signal.SIGKILL
    if sig in sent:
        return
    sent.add(sig)
    for pid in alive:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)
