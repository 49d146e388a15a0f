"""Evaluation: real speculative decoding with a drafter against its target (docs/algorithm.md#inference).

- `speculative_generate` / `target_generate`: the lossless decoding loop and the plain baseline.
- `batched.batched_generate`: the same with several prompts in flight (`--batch_size`), and the
  paper's confidence scheduler (`policy.schedule_prefixes`).
- `run_eval(EvalConfig)`: `dspark-ds eval`, benchmarks → τ, acceptance by position, confidence
  calibration (ECE / AUROC / Brier, STS), tables, JSON / CSV, plots, MLflow.
"""

from dspark_ds.eval.config import CalibrationConfig, DecodeBenchConfig, EvalConfig
from dspark_ds.eval.decoding import speculative_generate, target_generate
from dspark_ds.eval.rounds import DecodeStats
from dspark_ds.eval.runner import run_eval

__all__ = [
    "DecodeBenchConfig",
    "CalibrationConfig",
    "DecodeStats",
    "EvalConfig",
    "run_eval",
    "speculative_generate",
    "target_generate",
]
