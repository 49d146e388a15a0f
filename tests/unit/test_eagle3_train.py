"""Eagle3 through `dspark-ds train` (DeepSpeed on CPU, MLflow) and `dspark-ds export`."""

from __future__ import annotations

import json
import math

import pytest
import torch

from dspark_ds.drafters import load_draft_model
from dspark_ds.drafters.eagle3.qwen3 import Qwen3Eagle3Model
from dspark_ds.drafters.presets import DrafterConfig

from helpers.dist import check, python


def test_eagle3_config_section_checks_its_own_fields():
    DrafterConfig(kind="eagle3", num_draft_layers=1).validate()
    with pytest.raises(ValueError, match="model.ttt_length"):
        DrafterConfig(kind="eagle3", ttt_length=0).validate()
    with pytest.raises(ValueError, match="model.step_loss_decay"):
        DrafterConfig(kind="eagle3", step_loss_decay=0.0).validate()


@pytest.mark.parametrize(
    ("option", "value"), [("loss_impl", "recompute"), ("attn_implementation", "blockwise")]
)
def test_eagle3_run_refuses_a_perf_option_it_cannot_honour(tmp_path, capsys, option, value):
    from dspark_ds.cli import main

    argv = ["train", "--config", "dspark_ds/recipes/eagle3_tiny_cpu.yaml"]
    argv += ["--target.path", str(tmp_path / "target"), "--output_dir", str(tmp_path)]
    argv += [f"--perf.{option}", value]
    assert main(argv) == 2
    assert f"perf.{option}: '{value}' is not available for eagle3" in capsys.readouterr().err


@pytest.mark.slow
def test_tiny_eagle3_trains_exports_and_logs(tmp_path, tiny_target):
    target = tiny_target
    out = tmp_path / "runs"
    argv = ["-m", "dspark_ds.cli", "train", "--config", "dspark_ds/recipes/eagle3_tiny_cpu.yaml"]
    argv += ["--target.path", target, "--target.layer_ids", "[0, 1, 2]", "--output_dir", str(out)]
    argv += ["--train.max_steps", "4", "--train.synthetic_samples", "32"]
    argv += ["--checkpoint.every_steps", "2", "--validation.every_steps", "2"]
    argv += ["--train.progress_bar", "false", "--perf.loss_impl", "reference"]
    argv += ["--perf.attn_implementation", "dense"]
    check(python(argv, timeout_s=900))
    run = out / "eagle3_tiny_cpu"
    losses = [
        json.loads(line)["loss"] for line in (run / "train_log.jsonl").read_text().splitlines()
    ]
    assert len(losses) == 4 and all(math.isfinite(x) and x > 0 for x in losses)

    # The live export is vLLM's Eagle3 format with the reference's fields (docs/serving.md).
    data = json.loads((run / "export" / "config.json").read_text())
    assert data["architectures"] == ["Eagle3Qwen3ForCausalLM"]
    assert data["ttt_length"] == 4 and data["step_loss_decay"] == 0.8
    assert data["target_layer_ids"] == [0, 1, 2] and data["num_hidden_layers"] == 1
    live = load_draft_model(run / "export")
    assert isinstance(live, Qwen3Eagle3Model)

    # `dspark-ds export` from the last DeepSpeed checkpoint gives the same weights.
    export = ["-m", "dspark_ds.cli", "export", "--checkpoint", str(run)]
    check(python([*export, "--output_dir", str(tmp_path / "exported")], timeout_s=600))
    exported = load_draft_model(tmp_path / "exported")
    for name, tensor in live.state_dict().items():
        torch.testing.assert_close(exported.state_dict()[name], tensor, msg=name)

    # MLflow got the Eagle3 metrics (train and validation).
    import mlflow

    client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{out}/mlflow.db")
    run_id = (run / "mlflow_run_id").read_text().strip()
    metrics = client.get_run(run_id).data.metrics
    # the run took the loss path its perf section asked for
    assert client.get_run(run_id).data.params["derived.loss_impl"] == "reference"
    for key in (
        "train/loss",
        "train/tau_probabilistic",
        "train/accept_rate_at_3",
        "train/ploss_0",
        "val/tau_greedy",
    ):
        assert key in metrics, (key, sorted(metrics))
    # what MLflow holds is the local log's last window (test_eagle3.py checks the metrics
    # themselves against plain loops)
    last = json.loads((run / "train_log.jsonl").read_text().splitlines()[-1])
    assert metrics["train/tau_probabilistic"] == pytest.approx(last["train/tau_probabilistic"])
    assert metrics["train/loss"] == pytest.approx(last["train/loss"])


@pytest.mark.parametrize("family", ["qwen3_4b", "qwen3_8b", "qwen3_14b", "gemma4_12b"])
def test_eagle3_recipes_are_the_dspark_recipes_with_the_eagle3_model(family):
    """Same data, target taps, schedule and budget as DSpark: only the name, the model and the
    recipe tag differ, and the model is the Eagle3 preset."""
    from dataclasses import asdict, replace

    from dspark_ds.cli import parse_config
    from dspark_ds.drafters.presets import preset

    base = parse_config("train", ["--config", f"dspark_ds/recipes/dspark_{family}.yaml"])
    recipe = parse_config("train", ["--config", f"dspark_ds/recipes/eagle3_{family}.yaml"])
    assert recipe.tracking.tags == {"recipe": f"eagle3_{family}"}
    tracking = replace(base.tracking, tags=recipe.tracking.tags)
    derived = asdict(replace(base, model=preset("eagle3"), name=recipe.name, tracking=tracking))
    assert asdict(recipe) == derived
    assert recipe.model.ttt_length == 7 and recipe.model.num_draft_layers == 1
    assert recipe.train.lr == 6e-4 and recipe.model.step_loss_decay == 0.8
