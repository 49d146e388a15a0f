"""`dspark-ds demo`: the smoke version of the whole pipeline (small budget) and its config.

The smoke run goes through the CLI exactly as a user would (`dspark-ds demo ...`): a tiny
target trained into a temporary cache, regeneration and build-cache as torchrun jobs,
DSpark / DFlash / Eagle3 trained with DeepSpeed ZeRO-3 (2 ranks on a 2-core machine),
evaluation at T = 0 and T = 1, summary.json and MLflow. Then every exported drafter must
decode losslessly: greedy speculative output == plain greedy target output.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from dspark_ds.cli import main, parse_config
from dspark_ds.demo.config import DemoConfig
from dspark_ds.demo.pipeline import format_summary

# A tiny target (seconds to train) and a budget of a few steps: the smoke checks that every
# stage runs and fits together, not what the drafters learn.
SMOKE_ARGS = [
    "--target.num_train_rows", "200", "--target.vocab_size", "320",
    "--target.hidden_size", "32", "--target.num_hidden_layers", "3",
    "--target.num_attention_heads", "2", "--target.num_key_value_heads", "1",
    "--target.intermediate_size", "64", "--target.max_steps", "30", "--target.batch_size", "8",
    "--target.lr", "1e-2", "--target.warmup_steps", "2", "--target.num_probe_rows", "8",
    "--target.num_threads", "1",
    "--data.num_train_prompts", "24", "--data.num_heldout_prompts", "4",
    "--data.max_new_tokens", "24", "--data.regenerate_batch_size", "12",
    "--drafter.num_draft_layers", "1", "--drafter.block_size", "4",
    "--drafter.num_anchors", "4", "--drafter.markov_rank", "8",
    "--budget.max_steps", "3", "--budget.global_batch_size", "4",
    "--budget.micro_batch_size", "2",
    "--eval.max_new_tokens", "12",
]  # fmt: skip


@pytest.mark.slow
def test_demo_smoke_end_to_end(tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dspark_ds.drafters import load_draft_model
    from dspark_ds.eval.benchmarks import encode_prompt, load_benchmark
    from dspark_ds.eval.decoding import speculative_generate, target_generate
    from dspark_ds.tracking.mlflow import read_run

    monkeypatch.setenv("DSPARK_DS_CACHE", str(tmp_path / "cache"))
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    out = tmp_path / "demo"
    assert main(["demo", "--output_dir", str(out), *SMOKE_ARGS]) == 0
    # everything the demo writes is under its output directory, MLflow's artifacts included
    assert list(cwd.iterdir()) == []
    assert len(list((out / "runs" / "mlartifacts").rglob("model.safetensors"))) == 3

    summary = json.loads((out / "summary.json").read_text())
    assert set(summary["drafters"]) == {"dspark", "dflash", "eagle3"}
    for kind, entry in summary["drafters"].items():
        for t in ("T0", "T1"):
            row = entry[t]
            assert row["tau"] >= 1.0, (kind, t, row)
            assert len(row["accept_rate_by_position"]) == 4
            assert all(a is None or 0.0 <= a <= 1.0 for a in row["accept_rate_by_position"])
            assert row["prompts"] == 4 and row["rounds"] > 0
        assert entry["train"]["steps"] == 3
        assert entry["stage_seconds"]["train-" + kind] > 0
    # calibration only for the drafter with a confidence head
    assert 0.0 <= summary["drafters"]["dspark"]["T1"]["calibration"]["raw"]["ece"] <= 1.0
    assert "calibration" not in summary["drafters"]["dflash"]["T1"]
    stages = summary["stage_seconds"]
    for name in (
        "corpus",
        "target",
        "regenerate",
        "prepare",
        "build-cache",
        "train-dspark",
        "train-dflash",
        "train-eagle3",
        "eval-dspark-T0",
        "eval-eagle3-T1",
    ):
        assert stages[name] >= 0.0, name
    assert summary["target"]["from_cache"] is False
    assert set(summary["tau_ratio_dspark_over_dflash"]) == {"T0", "T1"}
    assert "DSpark" in (out / "summary.txt").read_text()

    # every stage ran through its real subcommand (the configs are what users would pass)
    for name in ("regenerate", "build-cache", "train-dspark", "train-dflash", "train-eagle3"):
        assert (out / "configs" / f"{name}.yaml").is_file()
    assert "zero3" in (out / "configs" / "train-eagle3.yaml").read_text()
    # the training runs used 2 ranks (the machine has >= 2 cores) or 1
    assert summary["ranks"] in (1, 2)

    # MLflow: a summary run with the comparison metrics
    run_id = (out / "runs" / "summary" / "mlflow_run_id").read_text().strip()
    run = read_run(summary["mlflow"]["uri"], run_id)
    assert "dspark/T1/tau" in run.data.metrics and "seconds/train-eagle3" in run.data.metrics

    # lossless: greedy speculative decoding == greedy target decoding, for every drafter
    target_dir = summary["target"]["path"]
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(target_dir)
    prompts = load_benchmark(out / "data" / "bench" / "demo.jsonl")
    eos = [tok.convert_tokens_to_ids("<|im_end|>")]
    for kind in ("dspark", "dflash", "eagle3"):
        drafter = load_draft_model(out / "runs" / kind / "export", dtype=torch.float32)
        for turns in prompts[:3]:
            ids = encode_prompt(tok, turns, None)
            spec, stats = speculative_generate(
                target, drafter, ids, max_new_tokens=20, temperature=0.0, stop_token_ids=eos
            )
            ref = target_generate(
                target, ids, max_new_tokens=20, temperature=0.0, stop_token_ids=eos
            )
            assert spec.tolist() == ref.tolist(), kind
            assert stats.rounds > 0

    # a later run reuses the cached target (the demo's target section is the cache key)
    from dspark_ds.demo.target import ensure_demo_target

    cfg = parse_config("demo", ["--output_dir", str(out), *SMOKE_ARGS])
    again = ensure_demo_target(cfg.target, progress=False)
    assert again.from_cache and str(again.path) == target_dir


def test_demo_trains_each_drafter_from_its_preset(tmp_path):
    """Typed train configs: the presets sized to the tiny target, everything else shared."""
    from dataclasses import asdict
    from types import SimpleNamespace

    from dspark_ds.config import TrainRunConfig, parse
    from dspark_ds.demo.pipeline import DemoPipeline
    from dspark_ds.drafters.presets import preset

    cfg = parse_config("demo", ["--output_dir", str(tmp_path / "demo"), *SMOKE_ARGS])
    demo = DemoPipeline(cfg)
    demo.target = SimpleNamespace(path=tmp_path / "target")
    runs = {kind: demo.train_config(kind) for kind in cfg.drafters}
    sized = dict(num_draft_layers=1, block_size=4, num_anchors=4)
    assert runs["dspark"].model == preset("dspark", markov_rank=8, **sized)
    assert runs["dflash"].model == preset("dflash", **sized)
    assert runs["eagle3"].model == preset("eagle3", num_draft_layers=1, ttt_length=4)
    plain = {k: asdict(r) for k, r in runs.items()}
    for kind, run in plain.items():
        differs = {s for s in run if run[s] != plain["dspark"][s]}
        assert differs <= {"name", "model", "tracking"}, (kind, differs)
    # what the subprocess reads back is the same config
    path = demo._write_config("train-eagle3", runs["eagle3"])
    assert parse(TrainRunConfig, ["--config", str(path)]) == runs["eagle3"]


def test_demo_config_from_cli_and_defaults():
    cfg = parse_config("demo", ["--output_dir", "x", "--budget.max_steps", "7"])
    assert isinstance(cfg, DemoConfig)
    assert cfg.budget.max_steps == 7 and cfg.drafters == ["dspark", "dflash", "eagle3"]
    assert cfg.eval.temperatures == [0.0, 1.0]
    assert cfg.budget.zero == "zero3"


@pytest.mark.parametrize(
    "argv, field",
    [
        (["--drafters", "[medusa]"], "drafters"),
        (["--budget.max_steps", "0"], "budget.max_steps"),
        (
            [
                "--budget.global_batch_size",
                "6",
                "--budget.micro_batch_size",
                "4",
                "--budget.nproc",
                "1",
            ],
            "budget.global_batch_size",
        ),
        (["--eval.temperatures", "[-1.0]"], "eval.temperatures"),
        (["--data.mode", "hybrid"], "data.mode"),
    ],
)
def test_demo_bad_config_exits_2_naming_the_field(argv, field, capsys):
    assert main(["demo", "--output_dir", "unused", *argv]) == 2
    assert field in capsys.readouterr().err


def test_format_summary_table():
    row = {"tau": 2.5, "accept_rate_by_position": [0.9, 0.5, None], "prompts": 3, "rounds": 10}
    summary = {
        "temperatures": [1.0],
        "drafters": {
            "dspark": {
                "T1": {**row, "calibration": {"raw": {"ece": 0.05, "auroc": 0.8}}},
                "stage_seconds": {"train-dspark": 12.0},
            },
            "dflash": {"T1": {**row, "tau": 2.0}, "stage_seconds": {"train-dflash": 11.0}},
        },
        "tau_ratio_dspark_over_dflash": {"T1": 1.25},
        "stage_seconds": {"corpus": 0.1, "train-dspark": 12.0},
        "total_seconds": 20.0,
        "target": {"from_cache": True},
        "ranks": 2,
    }
    text = format_summary(summary)
    lines = text.splitlines()
    assert lines[0].split()[:3] == ["drafter", "T", "tau"]
    assert "DSpark" in lines[2] and "2.500" in lines[2] and "0.050" in lines[2]
    assert "DFlash" in lines[3] and "2.000" in lines[3]
    assert "tau(DSpark) / tau(DFlash) at T = 1: 1.250" in text
    assert math.isclose(summary["tau_ratio_dspark_over_dflash"]["T1"], 1.25)
