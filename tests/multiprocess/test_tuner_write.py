"""`dspark-ds tune --write_recipe`: the recipe it writes trains as it is (a CLI run)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dspark_ds.cli import main as cli_main

from helpers.dist import check, python

REPO = Path(__file__).resolve().parents[2]
RECIPES = REPO / "dspark_ds" / "recipes"


def _tune(tmp_path: Path, recipe: str, *argv: str) -> dict:
    out = tmp_path / "tune.json"
    assert cli_main(["tune", "--recipe", str(RECIPES / recipe), *argv,
                     "--output_json", str(out)]) == 0  # fmt: skip
    return json.loads(out.read_text())


@pytest.mark.slow
def test_a_written_tiny_recipe_trains_as_it_is(tmp_path, tiny_target):
    """The tiny recipe's recommended point written for one CPU rank, then `dspark-ds train
    --config PATH` with no other flag runs its two steps at that point."""
    target = tiny_target
    path = tmp_path / "tuned.yaml"
    overrides = ["--train.max_steps", "2", "--tracking.enabled", "false",
                 "--output_dir", str(tmp_path / "runs"), "--checkpoint.every_steps", "0",
                 "--checkpoint.export_final", "false", "--validation.every_steps", "0"]  # fmt: skip
    result = _tune(tmp_path, "tiny_cpu.yaml", "--target.path", target, "--device", "cpu",
                   "--cluster.gpus_per_node", "1", "--overrides", json.dumps(overrides),
                   "--write_recipe", str(path))  # fmt: skip
    best = next(r for r in result["options"] if r["option"] == result["recommended"])
    assert best["micro_batch"] == 4 and best["accum"] == 1  # the global batch on one rank
    proc = check(python(["-m", "dspark_ds.cli", "train", "--config", str(path)],
                        timeout_s=300, cwd=tmp_path))  # fmt: skip
    log = [json.loads(line) for line in
           (tmp_path / "runs" / "tiny_cpu" / "train_log.jsonl").read_text().splitlines()]  # fmt: skip
    steps = [r for r in log if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2], proc.stdout[-2000:]
