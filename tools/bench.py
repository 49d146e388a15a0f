#!/usr/bin/env python3
"""Training-step benchmark; see dspark_ds/perf/bench.py (`python tools/bench.py --help`)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dspark_ds.perf.bench import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
