"""DeepSpeed config assembly (no process group needed)."""

from __future__ import annotations

import json

import pytest

from dspark_ds.config import DeepSpeedConfig, TrainConfig
from dspark_ds.engine.config import SHIPPED_DS_CONFIGS, build_ds_config, zero_stage

SHIPPED = ["zero0", "zero1", "zero2", "zero3", "zero3_offload_cpu", "zero3_offload_nvme"]


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_configs_fill_auto(name):
    train = TrainConfig(global_batch_size=32, precision="bf16", max_grad_norm=0.5, lr=1e-3)
    cfg = build_ds_config(
        DeepSpeedConfig(config=name), train, micro_batch_size=2, world_size=4, use_gpu=False
    )
    assert cfg["train_batch_size"] == 32 and cfg["train_micro_batch_size_per_gpu"] == 2
    assert cfg["gradient_accumulation_steps"] == 4
    assert cfg["gradient_clipping"] == 0.5 and cfg["bf16"]["enabled"] is True
    assert cfg["optimizer"]["params"]["lr"] == 1e-3
    assert "auto" not in json.dumps(cfg)
    assert zero_stage(cfg) == int(name[4])
    offloaded = "offload" in name
    # torch AdamW on CPU unless DeepSpeed's CPU Adam serves an offloaded optimizer
    assert cfg["optimizer"]["params"].get("torch_adam", False) is (not offloaded)


def test_config_errors_name_the_option(tmp_path):
    train = TrainConfig(global_batch_size=10)
    with pytest.raises(ValueError, match="train.global_batch_size"):
        build_ds_config(DeepSpeedConfig(), train, micro_batch_size=4, world_size=1, use_gpu=False)
    with pytest.raises(ValueError, match="deepspeed.config: unknown config 'zero9'"):
        build_ds_config(
            DeepSpeedConfig(config="zero9"), train, micro_batch_size=1, world_size=1, use_gpu=False
        )
    own = tmp_path / "mine.json"
    own.write_text(json.dumps({"gradient_clipping": 0.3, "zero_optimization": {"stage": 1}}))
    with pytest.raises(ValueError, match="train.max_grad_norm"):
        build_ds_config(
            DeepSpeedConfig(config=str(own)),
            TrainConfig(global_batch_size=2),
            micro_batch_size=1,
            world_size=2,
            use_gpu=False,
        )


def test_overrides_and_own_file(tmp_path):
    cfg = build_ds_config(
        DeepSpeedConfig(
            config="zero3_offload_nvme",
            overrides={"zero_optimization": {"offload_param": {"nvme_path": "/x"}}},
        ),
        TrainConfig(global_batch_size=2),
        micro_batch_size=1,
        world_size=2,
        use_gpu=True,
    )
    assert cfg["zero_optimization"]["offload_param"]["nvme_path"] == "/x"
    assert cfg["zero_optimization"]["offload_optimizer"]["nvme_path"] == "/local_nvme"
    assert (SHIPPED_DS_CONFIGS / "zero3.json").exists()
