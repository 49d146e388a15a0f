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
    cmd = ["tune", "--recipe", str(RECIPES / recipe), *argv, "--output_json", str(out)]
    assert cli_main(cmd) == 0
    return json.loads(out.read_text())


@pytest.mark.slow
def test_a_written_tiny_recipe_trains_as_it_is(tmp_path, tiny_target):
    """The tiny recipe's recommended point written for one CPU rank, then `dspark-ds train
    --config PATH` with no other flag runs its two steps at that point."""
    target = tiny_target
    path = tmp_path / "tuned.yaml"
    overrides = ["--train.max_steps", "2", "--tracking.enabled", "false"]
    overrides += ["--output_dir", str(tmp_path / "runs"), "--checkpoint.every_steps", "0"]
    overrides += ["--checkpoint.export_final", "false", "--validation.every_steps", "0"]
    argv = ["--target.path", target, "--device", "cpu", "--cluster.gpus_per_node", "1"]
    argv += ["--overrides", json.dumps(overrides), "--write_recipe", str(path)]
    result = _tune(tmp_path, "tiny_cpu.yaml", *argv)
    best = next(r for r in result["options"] if r["option"] == result["recommended"])
    assert best["micro_batch"] == 4 and best["accum"] == 1  # the global batch on one rank
    train = ["-m", "dspark_ds.cli", "train", "--config", str(path)]
    proc = check(python(train, timeout_s=300, cwd=tmp_path))
    log = [
        json.loads(line)
        for line in (tmp_path / "runs" / "tiny_cpu" / "train_log.jsonl").read_text().splitlines()
    ]
    steps = [r for r in log if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2], proc.stdout[-2000:]
