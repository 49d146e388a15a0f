"""The tuner's data term: an offline cache's reads per node (bytes per token from the cache's
storage dtype), their time in the step and the warning when a run would wait for them; the
read calibration on a directory. Predictions only."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from dspark_ds.cli import main as cli_main
from dspark_ds.tune.dataio import measure_read

REPO = Path(__file__).resolve().parents[2]
RECIPE = REPO / "dspark_ds" / "recipes" / "dspark_qwen3_8b.yaml"
# Qwen3-8B, 5 tapped layers + the last hidden state, H = 4096: ids 4 + mask 1 bytes, then the
# features in bf16 (2 bytes) or fp8 (1 byte + one fp32 scale per tap and token)
BF16_TOKEN = 4 + 1 + 6 * 4096 * 2
FP8_TOKEN = 4 + 1 + 6 * 4096 + 6 * 4
TOKENS_PER_NODE = 512 * 4096  # the global batch on one node


def _tune(tmp_path: Path, data: list[str], *argv: str) -> dict:
    out = tmp_path / "tune.json"
    overrides = ["--data.mode", "offline", "--data.cache_dir", str(tmp_path / "cache"), *data]
    cmd = ["tune", "--recipe", str(RECIPE), "--options", "[zero2]"]
    cmd += ["--overrides", json.dumps(overrides), *argv, "--output_json", str(out)]
    assert cli_main(cmd) == 0
    return json.loads(out.read_text())


def _step(result: dict) -> dict:
    return result["estimates"][0]["step"]


def test_offline_reads_are_a_term_and_an_io_bound_run_is_warned(tmp_path, capsys):
    # the preset's 2 GB/s per node: the step is the read time (the workers read ahead, the
    # rest of the step hides under it) and a warning points at fp8 caches and online mode
    slow = _tune(tmp_path, [])
    text = capsys.readouterr().out
    read_s = TOKENS_PER_NODE * BF16_TOKEN / 2e9
    assert _step(slow)["terms"]["data_read"] > 0
    assert _step(slow)["predicted_step_s"] == pytest.approx(read_s, rel=1e-6)
    assert f"(bfloat16, {BF16_TOKEN} bytes per token)" in text
    (warning,) = slow["warnings"]
    assert warning.startswith("I/O-bound") and "fp8" in warning and "online" in warning
    assert f"fp8: {FP8_TOKEN} bytes per token" in warning
    # a fast file system: no time, no warning; the rate needed is tokens/s × bytes per token
    fast = _tune(tmp_path, [], "--cluster.cache_read_gb_per_s", "1000")
    text = capsys.readouterr().out
    step = _step(fast)
    assert step["terms"]["data_read"] == 0 and fast["warnings"] == []
    need = step["tokens_per_s"] * BF16_TOKEN / 1e9
    assert f"is read at {need:.3g} GB/s per node" in text
    # an fp8 cache (its manifest says so) and no loader workers: the reads, of half the
    # bytes, on the step's path in full
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / "manifest.json").write_text(json.dumps({"dtype": "fp8"}))
    serial = _tune(tmp_path, ["--data.num_workers", "0"], "--cluster.cache_read_gb_per_s", "10")
    assert f"(fp8, {FP8_TOKEN} bytes per token)" in capsys.readouterr().out
    assert _step(serial)["terms"]["data_read"] == pytest.approx(TOKENS_PER_NODE * FP8_TOKEN / 1e10)
    assert "data.num_workers 0" in serial["warnings"][0]
    # online: the target runs in the job, nothing is read
    out = tmp_path / "online.json"
    argv = ["tune", "--recipe", str(RECIPE), "--options", "[zero2]", "--output_json", str(out)]
    assert cli_main(argv) == 0
    assert json.loads(out.read_text())["estimates"][0]["step"]["terms"]["data_read"] == 0
    assert "data: the offline cache" not in capsys.readouterr().out


def test_the_read_calibration_reads_the_directory(tmp_path):
    """What the calibration measures on a cache's directory: its shards' bytes (up to the
    limit), with the pages dropped first, over the time taken."""
    shards = tmp_path / "shards"
    shards.mkdir()
    for i in range(3):
        (shards / f"{i:05d}.safetensors").write_bytes(os.urandom(4 * 2**20))
    (tmp_path / "manifest.json").write_text("{}")
    total, seconds = measure_read(tmp_path)
    assert total == 3 * 4 * 2**20 + 2 and seconds > 0
    assert measure_read(tmp_path, limit=6 * 2**20)[0] == 6 * 2**20
    assert measure_read(tmp_path / "shards" / "missing") is None
