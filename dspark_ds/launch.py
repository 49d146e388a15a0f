"""`python -m dspark_ds.launch <subcommand> [args]`: what every slurm/*.sbatch script runs per
task. It exports torch's env:// variables for the launcher that started this process (srun tasks
get RANK / WORLD_SIZE / LOCAL_RANK / MASTER_* from SLURM_*; see `dspark_ds.distributed`), then
runs `dspark-ds <subcommand> [args]` in this process, so every subcommand (train, build-cache,
regenerate, eval) sees the same world.
"""

from __future__ import annotations

import os
import sys

from dspark_ds import cli
from dspark_ds.distributed import prepare_env
from dspark_ds.logs import emit


def main(argv: list[str] | None = None, as_process: bool = False) -> int:
    info = prepare_env()
    if os.environ.get("DSPARK_LAUNCH_VERBOSE", "1") != "0" and info.rank in (0, None):
        emit(
            f"[launch] {info.launcher}: world_size={info.world_size} "
            f"master={info.master_addr}:{info.master_port}",
            info.rank,
            sys.stderr,
        )
    argv = sys.argv[1:] if argv is None else argv
    return cli.entry(argv) if as_process else cli.main(argv)


if __name__ == "__main__":
    raise SystemExit(main(as_process=True))
