#!/usr/bin/env python3
"""ZeRO stage / offload tuner (the same as `python -m dspark_ds.tuner`); see dspark_ds/tuner.py.

    python tools/zero_tuner.py --recipe dspark_ds/recipes/dspark_qwen3_8b.yaml \
        --nodes 1 --gpus_per_node 8 --gpu_memory_gb 80
    DS_ACCELERATOR=cpu torchrun --nproc_per_node 2 tools/zero_tuner.py \
        --recipe dspark_ds/recipes/tiny_cpu.yaml --target_path runs/tiny_target --measure true
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dspark_ds.tuner import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
