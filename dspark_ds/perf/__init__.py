"""Performance tools: the training-step bench (`dspark-ds bench`, train_bench.py; each variant's
process, bench_variant.py) and the GPU node self-check (`dspark-ds gpu-check`, gpu_check.py). The
`perf` config section they vary lives with the drafters (dspark_ds/drafters/perf.py); nothing in
the drafters imports this package."""
