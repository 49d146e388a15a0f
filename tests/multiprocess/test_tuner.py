"""The ZeRO tuner: the estimate's structure on the Qwen3-8B DSpark recipe (8×80 GB), and on the
tiny recipe its estimate within 30 % of its own measurement for every option it measures."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from dspark_ds import tune
from dspark_ds.cli import main as cli_main

from helpers.dist import GUARDED, check, guard_stats, guarded_env, python, torchrun
from helpers.tiny_models import build_tiny_target

REPO = Path(__file__).resolve().parents[2]
RECIPES = REPO / "dspark_ds" / "recipes"
GIB = 1024**3


def _estimates(overrides=(), **cluster) -> dict:
    cfg = tune.TunerConfig(
        recipe=str(RECIPES / "dspark_qwen3_8b.yaml"),
        overrides=list(overrides),
        cluster=tune.ClusterConfig(**cluster),
    )
    return tune.run(cfg)


def _fastest_fitting(result: dict) -> str:
    fitting = [o for o in result["options"] if o["fits"]]
    return min(fitting, key=lambda o: o["predicted_step_s"])["option"]


def test_qwen3_8b_on_8x80gb(capsys):
    result = _estimates(nodes=1, gpus_per_node=8, gpu_memory_gb=80)
    inv = result["inventory"]
    # DSpark on Qwen3-8B: 5 target-sized layers + fc + Markov head (~1.1 B), frozen 2·V·H
    assert 1.0e9 < inv["trainable"] < 1.25e9
    assert inv["frozen"] == 2 * 151936 * 4096
    est = {e["option"]: e for e in result["estimates"]}

    def states(name):
        dev = est[name]["device"]
        return sum(
            dev.get(k, 0.0) for k in ("params", "params_working_set", "grads", "optimizer_states")
        )

    # each stage partitions more; offloading moves the optimizer states off the GPU
    assert states("zero0") > states("zero1") > states("zero2") > states("zero3")
    assert states("zero2+offload_opt") < states("zero2")
    assert est["zero2+offload_opt"]["host_total_per_rank"] > 0
    # bf16 ZeRO-2: our model states equal DeepSpeed's own estimator
    assert states("zero2") == pytest.approx(est["zero2"]["deepspeed_states"], rel=0.01)
    # the chunked loss holds 256 of the 512 anchors' B·γ·V logits on CUDA: fused at ZeRO-0..2,
    # in its recompute form (the reference's tensors, one chunk) at ZeRO-3; the reference path
    # would hold every anchor's
    chunk2, chunk3 = (est[n]["device"]["act_logits_chunk"] for n in ("zero2", "zero3"))
    assert chunk2 < chunk3 < 0.7 * reference_logits_bytes()
    # every option fits on 80 GB: the recommendation is the fastest predicted step
    assert all(o["fits"] for o in result["options"])
    assert result["recommended"] == _fastest_fitting(result)
    text = capsys.readouterr().out
    assert f"recommended: {result['recommended']}" in text and "zero3+offload_opt+param" in text


def reference_logits_bytes() -> float:
    from dspark_ds.drafters.common.memory import StepShape, Widths
    from dspark_ds.drafters.dspark.memory import DSparkShape, loss_bytes

    shape = StepShape.of(
        Widths(4096, 12288, 151936, 32, 8, 128, 5, 5), 1, 4096, DSparkShape(512, 7, 256)
    )
    return loss_bytes(shape, "reference", 256)["logits"]


def test_nothing_fits_says_what_to_change(capsys):
    result = _estimates(nodes=1, gpus_per_node=8, gpu_memory_gb=8)
    assert result["recommended"] == "none"
    assert not any(e["fits"] for e in result["estimates"])
    assert "nothing fits" in capsys.readouterr().out


def test_memory_pressure_moves_to_zero3():
    # 24 GB GPUs: ZeRO-2 (~23.7 GiB) no longer fits; ZeRO-3, which also partitions the target
    # (with the shared embedding / lm_head) and the drafter, does and is the fastest left
    result = _estimates(nodes=1, gpus_per_node=8, gpu_memory_gb=24)
    fits = {e["option"]: e["fits"] for e in result["estimates"]}
    assert not fits["zero0"] and not fits["zero1"] and not fits["zero2"] and fits["zero3"]
    assert result["recommended"] == "zero3" == _fastest_fitting(result)


def test_eagle3_recipe_is_estimated_as_eagle3():
    """An Eagle3 recipe is sized as the Eagle3 drafter it trains (it used to be sized as a
    1-layer DSpark drafter with a rank-256 Markov head: 354.6 M parameters)."""
    from transformers import Qwen3Config

    from dspark_ds.drafters.eagle3.build import build_eagle3_config
    from dspark_ds.drafters.io import build_draft_model

    # the chunk pinned at 32 positions (perf.loss_chunk_anchors "auto" is 256 on CUDA)
    result = tune.run(
        tune.TunerConfig(
            recipe=str(RECIPES / "eagle3_qwen3_8b.yaml"),
            overrides=["--perf.loss_chunk_anchors", "32"],
        )
    )
    target = Qwen3Config(**tune.KNOWN_TARGETS["Qwen/Qwen3-8B"])
    with torch.device("meta"):
        model = build_draft_model(build_eagle3_config(target, target_layer_ids=[1, 9, 17, 25, 33]))
    shared = set(model.shared_parameter_names())
    trainable = sum(p.numel() for n, p in model.named_parameters() if n not in shared)
    assert result["inventory"]["trainable"] == trainable
    assert result["inventory"]["draft_layers"] == 1
    est = {e["option"]: e["device"] for e in result["estimates"]}
    assert "act_ttt_steps" in est["zero2"] and "act_markov_confidence" not in est["zero2"]
    # ZeRO-3 takes Eagle3's full-logit loss (its chunked loss does not run there)
    assert est["zero3"]["act_logits_softmax"] > 10 * est["zero2"]["act_logits_softmax"]


def test_bad_option_names_the_field(capsys):
    assert (
        cli_main(
            ["tune", "--recipe", str(RECIPES / "dspark_qwen3_8b.yaml"), "--options", "[zero9]"]
        )
        == 2
    )
    assert "options: unknown ['zero9']" in capsys.readouterr().err
    argv = ["tune", "--recipe", str(RECIPES / "dspark_qwen3_8b.yaml")]
    assert cli_main([*argv, "--cluster.gpus_per_node", "0"]) == 2
    assert "cluster.gpus_per_node: must be >= 1" in capsys.readouterr().err
    # the cluster's shape is under --cluster: a top-level --gpus_per_node is refused by name
    assert cli_main([*argv, "--gpus_per_node", "4"]) == 2
    assert "unrecognized arguments: --gpus_per_node 4" in capsys.readouterr().err
    recipe = str(RECIPES / "dspark_qwen3_8b.yaml")
    assert cli_main(["tune", "--recipe", recipe, "--device", "cuda:0"]) == 2
    assert "device: expected cuda or cpu, got 'cuda:0'" in capsys.readouterr().err


def _shipped_zero(name: str) -> dict:
    return json.loads((RECIPES.parent / "ds_configs" / f"{name}.json").read_text())[
        "zero_optimization"
    ]


def _small_trainable_params(recipe: str, threshold: int) -> int:
    """Elements of the recipe's trainable drafter parameters of at most `threshold` elements,
    counted here on a drafter built on the meta device."""
    from transformers import Qwen3Config

    from dspark_ds.config import TrainRunConfig, parse
    from dspark_ds.drafters.dspark.build import dspark_config
    from dspark_ds.drafters.io import build_draft_model

    run_cfg = parse(TrainRunConfig, ["--config", str(RECIPES / recipe)])
    target = Qwen3Config(**tune.KNOWN_TARGETS["Qwen/Qwen3-8B"])
    config = dspark_config(
        target, run_cfg.model, target_layer_ids=[1, 9, 17, 25, 33], mask_token_id=0
    )
    with torch.device("meta"):
        model = build_draft_model(config)
    shared = set(model.shared_parameter_names())
    return sum(
        p.numel() for n, p in model.named_parameters() if n not in shared and p.numel() <= threshold
    )


def test_deepspeed_values_come_from_the_resolved_config():
    """Bucket sizes, overlap_comm and the ZeRO-3 persistence threshold are read from the
    DeepSpeed config training builds (the shipped JSON + --deepspeed.overrides): changing them
    moves the estimate by what the new values hold, option by option."""
    zero2, zero3 = _shipped_zero("zero2"), _shipped_zero("zero3")
    assert zero2["overlap_comm"] and zero3["stage3_param_persistence_threshold"] > 0
    changed = {
        "reduce_bucket_size": 3 * zero2["reduce_bucket_size"],
        "stage3_prefetch_bucket_size": 2 * zero3["stage3_prefetch_bucket_size"],
        "stage3_param_persistence_threshold": 0,
        "overlap_comm": False,
    }
    base = _estimates()
    new = _estimates(["--deepspeed.overrides", json.dumps({"zero_optimization": changed})])
    base_est = {e["option"]: e for e in base["estimates"]}
    new_est = {e["option"]: e for e in new["estimates"]}
    bf16, world = 2, 8

    def delta(option: str, key: str) -> float:
        return new_est[option]["device"].get(key, 0.0) - base_est[option]["device"].get(key, 0.0)

    # ZeRO-1 / 2: the reduce bucket, twice with overlap_comm (DeepSpeed's default: off below
    # ZeRO-3), fp32 at ZeRO-1, bf16 at ZeRO-2
    for option, config, elem_bytes in (
        ("zero1", "zero1", 4),
        ("zero2", "zero2", bf16),
        ("zero2+offload_opt", "zero2", bf16),
    ):
        shipped = _shipped_zero(config)
        before = shipped["reduce_bucket_size"] * (2 if shipped.get("overlap_comm") else 1)
        want = (changed["reduce_bucket_size"] - before) * elem_bytes
        assert want != 0
        assert delta(option, "ds_grad_buckets") == pytest.approx(want)
        total = new_est[option]["device_total"] - base_est[option]["device_total"]
        assert total == pytest.approx(want)
    # ZeRO-3: one contiguous reduce buffer, the prefetch bucket, and no persistent parameters
    # any more: each rank holds 1/world of the ones it kept whole
    assert delta("zero3", "ds_grad_buckets") == pytest.approx(
        (changed["reduce_bucket_size"] - zero3["reduce_bucket_size"]) * bf16
    )
    assert delta("zero3", "ds_prefetch") == pytest.approx(
        (changed["stage3_prefetch_bucket_size"] - zero3["stage3_prefetch_bucket_size"]) * bf16
    )
    small = _small_trainable_params(
        "dspark_qwen3_8b.yaml", zero3["stage3_param_persistence_threshold"]
    )
    assert small > 0
    assert delta("zero3", "params") == pytest.approx(-small * bf16 * (1 - 1 / world))
    assert new_est["zero3"]["zero"]["param_persistence_threshold"] == 0


def test_nvme_swap_buffers_are_host_memory():
    """NVMe offload swaps through page-locked host buffers DeepSpeed allocates whole when the
    engine starts (5 × 1e8 parameter elements by default: 1 GB in bf16 per rank, whatever the
    model's size); their size follows the config's buffer_count / buffer_size."""
    shipped = _shipped_zero("zero3_offload_nvme")
    param, opt = shipped["offload_param"], shipped["offload_optimizer"]
    changed = {"offload_param": {**param, "buffer_count": 3, "buffer_size": 2 * 10**7}}
    result = _estimates()
    base = {e["option"]: e for e in result["estimates"]}
    new = {
        e["option"]: e
        for e in _estimates(
            overrides=["--deepspeed.overrides", json.dumps({"zero_optimization": changed})]
        )["estimates"]
    }
    bf16, world = 2, 8
    host = base["zero3+nvme"]["host_per_rank"]
    assert host["nvme_param_buffers"] == param["buffer_count"] * param["buffer_size"] * bf16
    # each optimizer buffer holds one rank's fp32 partition (the persistent parameters, a few
    # M of 1126 M, are not partitioned): as many as the four fp32 tensors CPU offload keeps
    trainable = result["inventory"]["trainable"]
    assert host["nvme_optimizer_buffers"] == pytest.approx(
        opt["buffer_count"] * 4 * trainable / world, rel=0.01
    )
    assert new["zero3+nvme"]["host_per_rank"]["nvme_param_buffers"] == 3 * 2 * 10**7 * bf16
    for option in ("zero3", "zero3+offload_opt", "zero3+offload_opt+param"):
        assert not {"nvme_param_buffers", "nvme_optimizer_buffers"} & set(
            base[option]["host_per_rank"]
        ), option


def test_a_bad_deepspeed_value_is_refused_by_name(capsys):
    bad = json.dumps({"zero_optimization": {"reduce_bucket_size": "large"}})
    argv = ["tune", "--recipe", str(RECIPES / "dspark_qwen3_8b.yaml")]
    argv += ["--overrides", json.dumps(["--deepspeed.overrides", bad])]
    assert cli_main(argv) == 2
    err = capsys.readouterr().err
    assert "deepspeed.config: zero_optimization.reduce_bucket_size" in err and "\n" not in (
        err.strip()
    )


def test_a_global_batch_the_cluster_cannot_split_is_reported(capsys):
    # 512 sequences over 3 × 8 ranks: the estimate still comes (memory does not depend on the
    # accumulation) and says that training would refuse the shape
    result = _estimates(nodes=3, gpus_per_node=8)
    assert result["recommended"] == _fastest_fitting(result)
    assert "train.global_batch_size 512 is not a multiple of" in capsys.readouterr().out
    _estimates(nodes=1, gpus_per_node=8)
    assert "global_batch_size" not in capsys.readouterr().out


# NOTE: with the shipped configs DeepSpeed's fixed-size gradient buckets (5e7 elements) dominate
# a tiny model's memory; tiny buckets make the drafter, target and activation terms dominate.
SMALL_BUCKETS = (
    '{"zero_optimization": {"reduce_bucket_size": 10000, '
    '"allgather_bucket_size": 10000, "stage3_prefetch_bucket_size": 10000}}'
)


def _estimate_and_measure(tmp_path, recipe: str, overrides: list[str], options=None) -> dict:
    target = build_tiny_target(tmp_path / "tiny_target")
    out = tmp_path / "tuner.json"
    argv = ["-m", "dspark_ds.cli", "tune", "--recipe", str(RECIPES / recipe)]
    argv += ["--target.path", target, "--overrides", json.dumps(overrides), "--measure", "true"]
    argv += ["--measure_steps", "2", "--output_json", str(out), "--cluster.calibrate", "false"]
    if options:
        argv += ["--options", json.dumps(options)]
    proc = check(python(argv, timeout_s=900, cwd=tmp_path))
    assert "measured peak" in proc.stdout and "est/meas" in proc.stdout
    print(proc.stdout[-3000:], file=sys.stderr)
    return json.loads(out.read_text())


# With the shipped buckets (5e7 elements) DeepSpeed's buffers dominate the tiny recipe's memory:
# one option per formula of `estimate.deepspeed_buffers` (none, ZeRO-1's fp32 staging, ZeRO-2's,
# ZeRO-3's buffer and prefetch); the offload and NVMe options add no bucket of their own and are
# measured with the small buckets, where the model's own memory dominates, as are all eight.
SHIPPED_OPTIONS = ["zero0", "zero1", "zero2", "zero3"]


@pytest.mark.slow
@pytest.mark.parametrize(
    "overrides,options",
    [([], SHIPPED_OPTIONS), (["--deepspeed.overrides", SMALL_BUCKETS], None)],
    ids=["shipped_configs", "small_buckets"],
)
def test_tiny_estimate_within_30_percent_of_measurement(tmp_path, overrides, options):
    result = _estimate_and_measure(tmp_path, "tiny_cpu.yaml", overrides, options)
    measured = result["measured"]
    est = {e["option"]: e for e in result["estimates"]}
    assert set(measured) == set(options or tune.OPTION_NAMES), result["text"]
    # NOTE: with the shipped 5e7-element buckets, DeepSpeed's ZeRO-1/2 bucket set-up (a new
    # buffer allocated while the old one is still referenced) now and then holds one extra fp32
    # reduce bucket at the peak: seen once in CI (zero2+offload_opt measured 601.2 MB against
    # 401.4 MB on every other run, the difference one 200 MB bucket). That extra bucket, exactly,
    # is tolerated; any other deviation beyond 30 % fails.
    bucket = (
        0
        if overrides
        else 4
        * json.loads((REPO / "ds_configs" / "zero2.json").read_text())["zero_optimization"][
            "reduce_bucket_size"
        ]
    )
    for name, m in measured.items():
        estimate = est[name]["device_total"] + est[name]["host_total_per_rank"]
        ratio = estimate / m["peak_bytes"]
        if bucket and ratio < 0.7 and name.startswith(("zero1", "zero2")):
            ratio = estimate / (m["peak_bytes"] - bucket)
        assert 0.7 <= ratio <= 1.3, (name, estimate, m, result["text"])
        assert m["step_s"] > 0


@pytest.mark.slow
def test_tiny_eagle3_estimate_within_30_percent_of_measurement(tmp_path):
    """The Eagle3 activation terms against a real Eagle3 run (chunked loss at ZeRO-0/2, full
    logits at ZeRO-3), with the small buckets that leave the model's own memory dominant."""
    overrides = ["--deepspeed.overrides", SMALL_BUCKETS]
    result = _estimate_and_measure(
        tmp_path, "eagle3_tiny_cpu.yaml", overrides, ["zero0", "zero2", "zero3"]
    )
    est = {e["option"]: e for e in result["estimates"]}
    assert set(result["measured"]) == {"zero0", "zero2", "zero3"}
    for name, m in result["measured"].items():
        estimate = est[name]["device_total"] + est[name]["host_total_per_rank"]
        assert 0.7 <= estimate / m["peak_bytes"] <= 1.3, (name, estimate, m, result["text"])


@pytest.mark.slow
@pytest.mark.distributed
def test_two_rank_measure_under_the_device_guard(tmp_path, tiny_target):
    """`--measure` on 2 gloo ranks (its barriers and the all-reduced peak / step time, the
    training steps' loss reductions) under the device guard: no host-made tensor reaches a
    collective, as NCCL would require."""
    target = tiny_target
    out = tmp_path / "tuner.json"
    check(
        torchrun(
            [
                *GUARDED,
                "-m",
                "dspark_ds.cli",
                "tune",
                "--recipe",
                str(RECIPES / "tiny_cpu.yaml"),
                "--target.path",
                target,
                "--measure",
                "true",
                "--measure_steps",
                "1",
                "--options",
                "[zero2, zero3]",
                "--output_json",
                str(out),
                "--cluster.calibrate",
                "false",
            ],
            env=guarded_env(tmp_path / "guard"),
            timeout_s=900,
            cwd=tmp_path,
        )
    )
    result = json.loads(out.read_text())
    measured = result["measured"]
    assert set(measured) == {"zero2", "zero3"}
    # the estimate for this machine's 2 ranks holds for the peak of the larger one
    est = {e["option"]: e for e in result["estimates"]}
    for name, m in measured.items():
        estimate = est[name]["device_total"] + est[name]["host_total_per_rank"]
        assert 0.7 <= estimate / m["peak_bytes"] <= 1.3, (name, estimate, m, result["text"])
        assert m["step_s"] > 0
    assert [s["policed"] > 0 for s in guard_stats(tmp_path / "guard")] == [True, True]
