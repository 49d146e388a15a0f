"""How many collectives `dspark-ds train` issues of its own (tests/multiprocess/test_hot_path.py).

    python tests/helpers/collectives.py <result.json> <dspark-ds train arguments...>

run under torchrun, wraps torch.distributed's collectives in this process, runs the CLI's
`main(["train", ...])`, and when `Trainer.run` returns writes (rank 0) to result.json:

    {"steps": n, "collectives": {"<function> <call site>": count, ...}, "losses": {...}}

A call is the package's own when the nearest frame outside torch is in dspark_ds (DeepSpeed's
calls, and torch's own inside them, are not). Counted: everything `Trainer.run` issues, except
inside a checkpoint save or the final export (their barriers and object gathers coordinate
files, once per checkpoint, not per step). The call site is the package's innermost frames.
"""

from __future__ import annotations

import collections
import functools
import json
import os
import sys
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGE_ROOT = str(REPO / "dspark_ds") + os.sep


def install(result_file: str) -> None:
    import torch.distributed as dist

    from dspark_ds.train.trainer import Trainer

    sys.path.insert(0, str(REPO / "tests"))
    from helpers.device_guard import COLLECTIVES, OBJECT_COLLECTIVES, _caller

    counts: collections.Counter = collections.Counter()
    state = {"counting": False}

    def wrap(name: str, fn):
        @functools.wraps(fn)
        def counted(*args, **kwargs):
            file, _ = _caller()
            if state["counting"] and file.startswith(PACKAGE_ROOT):
                frames = [
                    f for f in traceback.extract_stack() if f.filename.startswith(PACKAGE_ROOT)
                ]
                site = " < ".join(
                    f"{os.path.relpath(f.filename, PACKAGE_ROOT)}:{f.name}"
                    for f in reversed(frames[-3:])
                )
                counts[f"{name} {site}"] += 1
            return fn(*args, **kwargs)

        return counted

    for name in COLLECTIVES + OBJECT_COLLECTIVES:
        if hasattr(dist, name):
            setattr(dist, name, wrap(name, getattr(dist, name)))

    def paused(method):
        @functools.wraps(method)
        def run_paused(self, *args, **kwargs):
            before, state["counting"] = state["counting"], False
            try:
                return method(self, *args, **kwargs)
            finally:
                state["counting"] = before

        return run_paused

    Trainer.save = paused(Trainer.save)
    Trainer.export = paused(Trainer.export)
    real_run = Trainer.run

    def run(self):
        first = self.step
        state["counting"] = True
        try:
            result = real_run(self)
        finally:
            state["counting"] = False
        if self.rank == 0:
            Path(result_file).write_text(
                json.dumps(
                    {
                        "steps": self.step - first,
                        "collectives": dict(sorted(counts.items())),
                        "losses": result.losses,
                    },
                    indent=1,
                )
            )
        return result

    Trainer.run = run


def main() -> int:
    install(sys.argv[1])
    from dspark_ds.cli import main as cli_main

    return cli_main(["train", *sys.argv[2:]])


if __name__ == "__main__":
    sys.exit(main())
