"""Python imports `sitecustomize` at start-up from sys.path: a job whose PYTHONPATH holds this
directory installs the faults of $DSPARK_TEST_FAULTS in its ranks (tests/helpers/faults.py),
whatever launcher starts them (srun, torchrun under srun)."""

import os
import sys

# a rank: started by torchrun (RANK) or an srun step (SLURM_STEP_NUM_TASKS); not the batch shell
if os.environ.get("DSPARK_TEST_FAULTS") and (
    "RANK" in os.environ or "SLURM_STEP_NUM_TASKS" in os.environ
):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from faults import install_from_env

    install_from_env()
