"""`dspark-ds tune`'s serving fleet for a served run (dspark_ds/tune/fleet.py) against a hand
computation at the Qwen3-8B recipe, and a MoE target's active parameters against its config's
sizes. Predictions only."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from dspark_ds.cli import main as cli_main
from dspark_ds.cost.inventory import KNOWN_TARGETS, active_params

from helpers.tiny_models import family_config

REPO = Path(__file__).resolve().parents[2]
RECIPE = REPO / "dspark_ds" / "recipes" / "dspark_qwen3_8b.yaml"
PEAK = 989e12  # the 8xH100-80GB preset's dense bf16 FLOP/s
T = 4096  # the recipe's data.max_length
SERVED = [
    "--data.mode",
    "served",
    "--data.served.urls",
    "[http://h1:8000/v1]",
    "--data.served.storage",
    "/shared/hs",
]


def _tune(tmp_path: Path, name: str, *argv: str) -> dict:
    out = tmp_path / f"{name}.json"
    assert (
        cli_main(
            [
                "tune",
                "--recipe",
                str(RECIPE),
                "--options",
                "[zero2]",
                *argv,
                "--output_json",
                str(out),
            ]
        )
        == 0
    )
    return json.loads(out.read_text())


def qwen3_8b_by_hand(sequences_per_s: float, tp: int, mfu: float = 0.4) -> dict:
    """The fleet figures from the model's config, written out."""
    c = KNOWN_TARGETS["Qwen/Qwen3-8B"]
    H, L, d = c["hidden_size"], c["num_hidden_layers"], c["head_dim"]
    q, kv = c["num_attention_heads"] * d, c["num_key_value_heads"] * d
    attention = H * q + 2 * H * kv + q * H + 2 * d  # q, k, v, o projections; q / k norms
    mlp = 3 * H * c["intermediate_size"]
    layer = attention + mlp + 2 * H  # and its two norms
    active = L * layer
    # the recipe taps [1, 9, 17, 25, 33]: vLLM's aux ids are each + 1, and L = 36 (the last
    # hidden state, before the final norm): 6 states a token, not 5
    states = 6
    file_bytes = T * (states * H * 2 + 8)  # bf16 states and an int64 token id
    per_token = 2 * active + 4 * q * (T * T / 2) * L / T  # the matmuls and causal attention
    gpu = PEAK * mfu / per_token
    gpus = math.ceil(sequences_per_s * T / (gpu * tp)) * tp
    return {
        "active_params": active,
        "bytes_per_sequence": file_bytes,
        "prefill_flops_per_token": per_token,
        "gpu_tokens_per_s": gpu,
        "gpus": gpus,
        "storage_bytes_per_s": sequences_per_s * file_bytes,
    }


def check_by_hand(result: dict, tp: int) -> dict:
    fleet, step = result["fleet"], result["estimates"][0]["step"]
    assert "target_weights" not in result["estimates"][0]["device"]  # not in the job
    sequences_per_s = step["sequences"] / step["predicted_step_s"]
    for key, value in qwen3_8b_by_hand(sequences_per_s, tp).items():
        assert fleet[key] == pytest.approx(value, rel=1e-9), key
    assert fleet["aux_ids"] == [2, 10, 18, 26, 34, 36]
    assert fleet["sequences_per_s"] == pytest.approx(sequences_per_s, rel=1e-12)
    assert fleet["gpus"] == fleet["servers"] * tp
    return fleet


def test_a_served_recipe_gets_the_hand_computed_fleet(tmp_path, capsys):
    result = _tune(
        tmp_path,
        "given",
        "--overrides",
        json.dumps([*SERVED, "--data.served.tensor_parallel_size", "4"]),
    )
    text = capsys.readouterr().out
    f = check_by_hand(result, tp=4)
    assert "served target: the fleet that keeps zero2 fed" in text
    assert f"{f['bytes_per_sequence'] / 1e6:.1f} MB" in text
    assert f"{f['servers']} server(s) × tensor_parallel_size 4" in text


def test_served_true_tunes_any_recipe_as_a_served_run(tmp_path):
    f = check_by_hand(_tune(tmp_path, "asked", "--served", "true", "--prefill_mfu", "0.4"), tp=1)
    # the "about 170 MB" is the five taps; the file holds the last layer's too
    assert f["bytes_per_sequence"] / (T * 5 * 4096 * 2) == pytest.approx(6 / 5, rel=1e-3)


def test_no_fleet_for_a_run_with_the_target_in_the_job(tmp_path):
    online = _tune(tmp_path, "online")
    assert online["fleet"] is None
    assert "target_weights" in online["estimates"][0]["device"]


def test_served_refuses_what_runs_the_recipe_as_it_is(tmp_path):
    assert (
        cli_main(
            [
                "tune",
                "--recipe",
                str(RECIPE),
                "--served",
                "true",
                "--write_recipe",
                str(tmp_path / "r.yaml"),
            ]
        )
        == 2
    )


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3", "gpt_oss"])
def test_moe_active_params_count_top_k_of_the_routed_experts(family):
    from transformers import AutoModelForCausalLM

    cfg = family_config(family, 384)
    with torch.device("meta"):
        layers = AutoModelForCausalLM.from_config(cfg).get_decoder().layers
    total = sum(p.numel() for p in layers.parameters())
    experts = getattr(cfg, "n_routed_experts", None) or getattr(cfg, "num_local_experts", None)
    experts = experts or cfg.num_experts
    k, H = cfg.num_experts_per_tok, cfg.hidden_size
    moe_layers = len(layers) - getattr(cfg, "first_k_dense_replace", 0)
    if family == "gpt_oss":  # gate_up / down of width I, with biases
        I = cfg.intermediate_size  # noqa: E741
        routed = experts * (3 * H * I + 2 * I + H)
    else:  # gate, up, down of width moe_intermediate_size; shared experts always run
        routed = experts * 3 * H * cfg.moe_intermediate_size
    assert active_params(layers, k) == total - moe_layers * routed * (1 - k / experts)
    assert active_params(layers, None) == total


def test_active_params_of_experts_as_a_list_of_modules():
    class Layer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = torch.nn.Linear(8, 8, bias=False)
            self.experts = torch.nn.ModuleList(torch.nn.Linear(8, 16) for _ in range(4))

    layers = torch.nn.ModuleList([Layer(), Layer()])
    assert active_params(layers, 1) == 2 * (64 + (8 * 16 + 16))
