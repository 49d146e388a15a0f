"""Fault injection into a real `dspark-ds train` (tests/multiprocess/test_faults.py).

    python tests/helpers/faults.py '<faults json>' <dspark-ds train arguments...>

installs the faults below by wrapping methods of the real classes in this process only, then
runs the CLI's `main(["train", ...])` and exits with its code (torchrun runs it on every rank).
Each fault is {"kind": ..., params}; `rank` (default: every rank) limits it to one rank.

    kill_during_save   {"step": s}: while checkpoint step s is written, this rank's first
                       DeepSpeed file is cut to half its size and the process is SIGKILLed
    fsize_limit        {"step": s, "bytes": n}: RLIMIT_FSIZE = n from step s on (a full disk)
    nonfinite_loss     {"steps": [s, ...], "micro_batch": i, "once_file": f}: the loss of
                       micro-batch i of those optimizer steps becomes NaN (with once_file: only
                       while f does not exist, and f is created then, so a restarted job
                       trains the step cleanly)
    kill_process       {"step": s, "pgid": g}: SIGKILL process group g when step s begins
    sleep_in_save      {"seconds": t}: every checkpoint save first sleeps t seconds
    corrupt_at_epoch   {"epoch": e, "file": f}: flip bytes in the middle of file f when the
                       training data moves to epoch e (after the cache was checked on open)
"""

from __future__ import annotations

import json
import os
import resource
import signal
import sys


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def install(faults: list[dict]) -> None:
    import torch

    from dspark_ds.data.loader import TrainLoader
    from dspark_ds.train.trainer import Trainer

    for fault in faults:
        if fault.get("rank") is not None and fault["rank"] != _rank():
            continue
        kind = fault["kind"]
        if kind == "kill_during_save":
            tag = f"step_{fault['step']:08d}"
            real_save = torch.save

            def save(obj, f, *args, _real=real_save, _tag=tag, **kwargs):
                _real(obj, f, *args, **kwargs)
                if isinstance(f, (str, os.PathLike)) and _tag in str(f):
                    size = os.path.getsize(f)
                    with open(f, "r+b") as fh:
                        fh.truncate(size // 2)
                    os.kill(os.getpid(), signal.SIGKILL)

            torch.save = save
        elif kind in ("fsize_limit", "kill_process"):
            real_step = Trainer.train_step

            def train_step(self, _real=real_step, _fault=fault):
                if self.step + 1 == _fault["step"]:
                    if _fault["kind"] == "fsize_limit":
                        _, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
                        resource.setrlimit(resource.RLIMIT_FSIZE, (_fault["bytes"], hard))
                    else:
                        os.killpg(_fault["pgid"], signal.SIGKILL)
                return _real(self)

            Trainer.train_step = train_step
        elif kind == "nonfinite_loss":
            from dspark_ds.drafters.registry import KINDS

            real_step = Trainer.train_step
            seen: dict[int, int] = {}
            now = {"step": 0}

            def train_step(self, _real=real_step, _now=now):
                _now["step"] = self.step + 1
                return _real(self)

            Trainer.train_step = train_step
            for drafter_kind in KINDS.values():

                def training_step(
                    model,
                    batch,
                    ctx,
                    _real=drafter_kind.train.training_step,
                    _fault=fault,
                    _seen=seen,
                    _now=now,
                ):
                    out = _real(model, batch, ctx)
                    if not ctx.training:  # validation
                        return out
                    step = _now["step"]
                    i = _seen[step] = _seen.get(step, -1) + 1
                    once = _fault.get("once_file")
                    if step in _fault["steps"] and i == _fault["micro_batch"]:
                        if once and os.path.exists(once):
                            return out
                        if once:
                            open(once, "w").close()
                        out.loss = out.loss * float("nan")
                    return out

                drafter_kind.train.training_step = training_step
        elif kind == "sleep_in_save":
            import time

            from dspark_ds.train.checkpoint import CheckpointManager

            real_ckpt_save = CheckpointManager.save

            def slow_save(self, *args, _real=real_ckpt_save, _fault=fault, **kwargs):
                time.sleep(_fault["seconds"])
                return _real(self, *args, **kwargs)

            CheckpointManager.save = slow_save
        elif kind == "corrupt_at_epoch":
            real_set_epoch = TrainLoader.set_epoch

            def set_epoch(self, epoch, _real=real_set_epoch, _fault=fault):
                if epoch == _fault["epoch"] and epoch != self.epoch and _rank() == 0:
                    path = _fault["file"]
                    size = os.path.getsize(path)
                    with open(path, "r+b") as fh:
                        fh.seek(size // 2)
                        chunk = fh.read(16)
                        fh.seek(size // 2)
                        fh.write(bytes(b ^ 0xFF for b in chunk))
                _real(self, epoch)

            TrainLoader.set_epoch = set_epoch
        else:
            raise ValueError(f"unknown fault {kind!r}")


def main() -> int:
    faults = json.loads(sys.argv[1])
    install(faults)
    from dspark_ds.cli import main as cli_main

    return cli_main(["train", *sys.argv[2:]])


def install_from_env() -> None:
    """Installs the faults of $DSPARK_TEST_FAULTS (JSON) in a rank of a job whose command line
    the test does not write (a batch script's launcher): `tests/helpers/faults_site` on
    PYTHONPATH calls this at interpreter start."""
    spec = os.environ.get("DSPARK_TEST_FAULTS")
    if spec:
        install(json.loads(spec))


if __name__ == "__main__":
    sys.exit(main())
