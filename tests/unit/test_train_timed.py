"""train/timed.py: the steps the tuner's `--measure` runs (the timed steps themselves run in
tests/multiprocess/test_tuner.py's measurements, on 2 ranks)."""

from __future__ import annotations

import pytest
import torch

from dspark_ds.errors import ConfigError
from dspark_ds.train.batches import SyntheticSource
from dspark_ds.train.timed import epochs


def _source(num_samples: int) -> SyntheticSource:
    """Synthetic micro-batches of 2 for rank 0 of 2."""
    return SyntheticSource(
        num_samples=num_samples,
        seq_len=16,
        vocab_size=50,
        batch_size=2,
        rank=0,
        world_size=2,
        seed=0,
        provider=None,
    )


def test_measured_steps_run_past_the_end_of_the_data():
    """`--measure_steps` more than the recipe's data holds (the tiny recipe's 64 synthetic
    samples: 16 micro-batches of 2 per rank on 2 ranks) starts the data over, epoch after epoch,
    as training does, instead of stopping the measurement."""
    source = _source(8)
    batches = epochs(source)
    got = [next(batches)["input_ids"] for _ in range(5)]  # 2 per epoch
    assert source.epoch == 2
    assert not torch.equal(got[0], got[2])  # each epoch in its own order, as training's
    empty = _source(2)
    with pytest.raises(ConfigError, match="yields no micro-batch"):
        next(epochs(empty))
