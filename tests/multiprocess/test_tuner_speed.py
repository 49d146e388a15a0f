"""The tuner's step-time model: the drafters' FLOP counts against torch's counter, the terms
each ZeRO option adds, the cluster figures (presets, profiles, flags), the scaling table, and
on this machine's 2 gloo ranks the prediction from a calibration against the measured median
step of every option, for the tiny recipe and for one at the bench's widths where compute
shows."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

from dspark_ds import tune
from dspark_ds.cli import main as cli_main
from dspark_ds.tune.cluster import (
    PRESETS,
    PROFILE_VERSION,
    Machine,
    load_profile,
    resolve,
    save_profile,
)
from dspark_ds.tune.steptime import TERMS

from helpers.dist import check, torchrun
from helpers.tiny_models import build_tiny_target, qwen3_target_config

REPO = Path(__file__).resolve().parents[2]
RECIPES = REPO / "dspark_ds" / "recipes"


# ---- FLOPs -----------------------------------------------------------------------------------
class MatmulFlops(TorchDispatchMode):
    """torch's per-op FLOP formulas (torch.utils.flop_counter) summed over every op run inside,
    without FlopCounterMode's module tracking (which the chunked losses' autograd.grad calls
    trip over)."""

    def __init__(self):
        super().__init__()
        self.total = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func._overloadpacket in flop_registry:
            self.total += flop_registry[func._overloadpacket](*args, **kwargs, out_val=out)
        return out


@pytest.mark.parametrize("loss", ["chunked", "recompute", "reference"])
def test_dspark_flops_match_torch_counter(loss):
    """The DSpark FLOP model (blockwise attention, the CPU default; SDPA's CPU kernel has no
    FLOP formula in torch's counter, so the dense path is not checked here) within 3 % of the
    matmuls the step runs, for each loss path (the recompute form computes the chunk logits
    twice), on the small shape `dspark-ds gpu-check` benches on a CPU."""
    from dspark_ds.drafters.dspark.config import LossWeights
    from dspark_ds.drafters.dspark.memory import micro_batch_flops
    from dspark_ds.drafters.dspark.step import forward_and_loss
    from dspark_ds.perf.bench_variant import build_batch, build_model, step_shape
    from dspark_ds.perf.gpu_check import SMALL_SHAPE
    from dspark_ds.perf.train_bench import TrainBenchConfig

    cfg = TrainBenchConfig(**SMALL_SHAPE)
    torch.manual_seed(0)
    model = build_model(cfg)
    model.attn_implementation = "blockwise"
    batch = build_batch(cfg, "cpu")
    with MatmulFlops() as counted:
        out, _ = forward_and_loss(
            model, batch, dataclasses.asdict(LossWeights.of(cfg.model)), impl=loss, chunk_anchors=8
        )
        out.backward()
    model_flops = sum(micro_batch_flops(step_shape(cfg), "blockwise", loss).values())
    assert model_flops == pytest.approx(counted.total, rel=0.03)


@pytest.mark.parametrize("loss", ["chunked", "reference"])
def test_eagle3_flops_match_torch_counter(loss):
    from dspark_ds.drafters.common.memory import StepShape, Widths
    from dspark_ds.drafters.eagle3.build import build_eagle3_config
    from dspark_ds.drafters.eagle3.loss import eagle3_forward_and_loss
    from dspark_ds.drafters.eagle3.memory import Eagle3Shape
    from dspark_ds.drafters.io import build_draft_model
    from dspark_ds.drafters.perf import PerfConfig
    from dspark_ds.drafters.registry import get_kind

    target = qwen3_target_config(3000, hidden_size=64, intermediate_size=160)
    torch.manual_seed(0)
    model = build_draft_model(build_eagle3_config(target, target_layer_ids=[0, 1, 2], ttt_length=4))
    model.freeze_shared()
    B, S = 1, 128
    batch = dict(
        input_ids=torch.randint(0, 2999, (B, S)),
        loss_mask=torch.ones(B, S),
        target_hidden_states=torch.randn(B, S, 3 * 64),
        target_last_hidden_states=torch.randn(B, S, 64),
    )
    with MatmulFlops() as counted:
        out, _ = eagle3_forward_and_loss(model, batch, impl=loss, chunk_rows=64)
        out.backward()
    shape = StepShape.of(Widths(64, 160, 3000, 4, 2, 16, 1, 3), B, S, Eagle3Shape(ttt_length=4))
    flops = get_kind("eagle3").cost.step_flops(shape, PerfConfig(loss_impl=loss), "cpu", 0)
    assert sum(flops.values()) == pytest.approx(counted.total, rel=0.03)


# ---- the cluster's figures -------------------------------------------------------------------
def test_presets_profiles_and_flags_resolve_in_order(tmp_path):
    h100 = resolve(tune.ClusterConfig())
    assert h100.peak_flops == 989e12 and h100.gpus_per_node == 8
    assert h100.sources["peak_flops"] == "8xH100-80GB (published)"
    assert h100.sources["sustained_fraction"] == "8xH100-80GB (assumed)"
    h200 = resolve(tune.ClusterConfig(preset="8xH200-141GB"))
    assert h200.gpu_memory_bytes > h100.gpu_memory_bytes
    assert set(PRESETS) == {"8xH100-80GB", "8xH200-141GB"}
    # a profile replaces the preset's figures, a flag the profile's
    measured = dataclasses.replace(h100, peak_flops=1e12, all_gather_bytes_per_s=2e9)
    path = tmp_path / "profile.json"
    save_profile(measured, path, {"date": "today"})
    values, meta = load_profile(path)
    assert values["peak_flops"] == 1e12 and meta == {"date": "today"}
    cfg = tune.ClusterConfig(profile=str(path), peak_tflops=2.0)
    machine = resolve(cfg.validate())
    assert machine.peak_flops == 2e12 and machine.sources["peak_flops"] == "flag"
    assert machine.all_gather_bytes_per_s == 2e9
    assert machine.sources["all_gather_bytes_per_s"] == f"profile {path}"
    assert machine.inter_node_bytes_per_s == h100.inter_node_bytes_per_s
    assert tune.ClusterConfig(nodes="1,2,8,64").node_counts == [1, 2, 8, 64]
    assert tune.ClusterConfig(nodes=[1, 4]).node_counts == [1, 4]


def test_bad_cluster_values_are_refused_by_name(tmp_path, capsys):
    recipe = str(RECIPES / "dspark_qwen3_8b.yaml")
    for argv, message in (
        (["--cluster.nodes", "1,x"], "cluster.nodes: expected counts like 1,2,8,64"),
        (["--cluster.nodes", "0"], "cluster.nodes: every count must be >= 1"),
        (["--cluster.preset", "8xB200"], "cluster.preset: unknown '8xB200'"),
        (["--cluster.sustained_fraction", "1.5"], "cluster.sustained_fraction: must be in"),
        (["--cluster.profile", str(tmp_path / "none.json")], "does not exist"),
        (["--cpu_memory_gb", "512"], "unrecognized arguments: --cpu_memory_gb 512"),
    ):
        assert cli_main(["tune", "--recipe", recipe, *argv]) == 2, argv
        assert message in capsys.readouterr().err, argv
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(ValueError, match=f"is not a version-{PROFILE_VERSION} profile"):
        load_profile(tmp_path / "bad.json")


# ---- the terms -----------------------------------------------------------------------------------
def _machine(**changes) -> Machine:
    return dataclasses.replace(resolve(tune.ClusterConfig()), **changes)


@pytest.fixture(scope="module")
def qwen3_8b():
    """The Qwen3-8B DSpark recipe's inventory and host work (the GPU preset counts ops)."""
    from dspark_ds.cost.inventory import inventory
    from dspark_ds.tune.config import load_recipe
    from dspark_ds.tune.workload import host_work

    cfg = tune.TunerConfig(recipe=str(RECIPES / "dspark_qwen3_8b.yaml"))
    run_cfg = load_recipe(cfg)
    return cfg, run_cfg, inventory(run_cfg), host_work(run_cfg, (0, 3), "cuda", timed=False)


def _steps(qwen3_8b, machine: Machine, nodes: int) -> dict:
    from dspark_ds.tune.prediction import PredictionInputs, predict

    cfg, run_cfg, inv, work = qwen3_8b
    given = PredictionInputs(cfg, run_cfg, inv, machine, work)
    return {e.option: e.step for e in predict(given, tune.OPTIONS, nodes)}


def test_each_option_adds_its_own_terms(qwen3_8b):
    steps = _steps(qwen3_8b, _machine(), 1)
    for option, step in steps.items():
        assert set(step["terms"]) == set(TERMS), option
        assert step["predicted_step_s"] == pytest.approx(sum(step["terms"].values()))
        assert step["accum"] == 64  # global batch 512 over 8 GPUs × micro-batch 1
    # only ZeRO-3 gathers per module and runs module hooks; only offload copies; only NVMe
    for option, step in steps.items():
        terms = step["terms"]
        assert (terms["offload_copy"] > 0) == ("offload" in option or "nvme" in option), option
        assert (terms["nvme"] > 0) == (option == "zero3+nvme"), option
        assert terms["grad_reduce"] > 0 and terms["compute"] > 0, option
    zero2, zero3 = steps["zero2"]["terms"], steps["zero3"]["terms"]
    # ZeRO-3's loss path computes the chunk logits twice: more compute than ZeRO-2
    assert zero3["compute"] > zero2["compute"]
    assert zero3["param_gather"] > zero2["param_gather"]
    # the CPU optimizer instead of the device's
    assert steps["zero2+offload_opt"]["terms"]["optimizer"] > zero2["optimizer"]
    # NVMe moves the optimizer states through the node's drives every step
    assert (
        steps["zero3+nvme"]["predicted_step_s"]
        > steps["zero3+offload_opt+param"]["predicted_step_s"]
    )


def test_zero2_reduces_every_micro_batch_zero1_once(qwen3_8b):
    """With gradient accumulation ZeRO-2 all-reduces each micro-batch's gradients, ZeRO-0/1
    once per step: across nodes (the network, 50 GB/s per GPU) that is the difference."""
    steps = _steps(qwen3_8b, _machine(comm_overlap=0.0), 2)
    accum = steps["zero2"]["accum"]
    assert accum == 32
    # (the shipped configs' bucket sizes differ: a few more latencies at ZeRO-2)
    assert steps["zero2"]["terms"]["grad_reduce"] == pytest.approx(
        accum * steps["zero0"]["terms"]["grad_reduce"], rel=0.03
    )
    # ZeRO-1 reduces its fp32 accumulator: twice ZeRO-0's bf16 bytes
    assert steps["zero1"]["terms"]["grad_reduce"] == pytest.approx(
        2 * steps["zero0"]["terms"]["grad_reduce"], rel=0.01
    )


def test_faster_links_shrink_only_the_communication(qwen3_8b):
    slow = _steps(qwen3_8b, _machine(inter_node_bytes_per_s=12.5e9), 8)
    fast = _steps(qwen3_8b, _machine(inter_node_bytes_per_s=50e9), 8)
    for option in slow:
        s, f = slow[option]["terms"], fast[option]["terms"]
        assert s["compute"] == f["compute"]
        assert s["grad_reduce"] >= f["grad_reduce"]
    assert slow["zero3"]["terms"]["param_gather"] > fast["zero3"]["terms"]["param_gather"]


def test_scaling_over_node_counts(tmp_path, capsys):
    """`--cluster.nodes 1,2,8,64`: a row per option and a column per size; the global batch is
    held at every size and point (micro-batch × accumulation × GPUs = 512: fewer micro-batches
    per rank as the cluster grows) and tokens/s grows with it."""
    out = tmp_path / "scaling.json"
    argv = ["tune", "--recipe", str(RECIPES / "dspark_qwen3_8b.yaml")]
    argv += ["--cluster.nodes", "1,2,8,64", "--output_json", str(out)]
    assert cli_main(argv) == 0
    text = capsys.readouterr().out
    assert "64 node(s): s / tokens/s @micro-batch" in text and "scaling (the global batch" in text
    result = json.loads(out.read_text())
    assert list(result["scaling"]) == ["1", "2", "8", "64"]
    for n, rows in result["scaling"].items():
        assert [r["option"] for r in rows] == tune.OPTION_NAMES
        for r in rows:
            assert r["micro_batch"] * r["accum"] * r["world"] == 512 == r["sequences"], (n, r)
    # 64 nodes: one sequence per GPU, whatever the option
    assert {(r["micro_batch"], r["accum"]) for r in result["scaling"]["64"]} == {(1, 1)}
    for i, option in enumerate(tune.OPTION_NAMES):
        rates = [result["scaling"][n][i]["tokens_per_s"] for n in ("1", "2", "8", "64")]
        assert rates == sorted(rates), option
    # the JSON's per-option rows
    for row in result["options"]:
        for key in ("predicted_step_s", "measured_step_s", "peak_bytes", "estimated_bytes", "fits"):
            assert key in row
    assert result["machine_sources"]["peak_flops"] == "8xH100-80GB (published)"


# ---- predicted against measured, on this machine ---------------------------------------------------
def build_bench_target(out_dir: Path) -> str:
    """A random Qwen3 target at `dspark-ds bench`'s widths (hidden 256, MLP 768, 4 / 2 heads,
    vocabulary 32 000), 6 layers, with the tiny tokenizer."""
    return build_tiny_target(
        out_dir, hidden_size=256, intermediate_size=768, num_layers=6, vocab_size=32000
    )


# The bench's drafter (2 layers, γ 7, Markov rank 64) on its target widths; the sequence and
# anchors shortened (192, 16) so that seven options × several steps fit the test's time.
BENCH_OVERRIDES = ["--model.num_draft_layers", "2", "--model.block_size", "7"]
BENCH_OVERRIDES += ["--model.num_anchors", "16", "--model.markov_rank", "64"]
BENCH_OVERRIDES += ["--data.max_length", "192", "--data.batch_size", "1"]
BENCH_OVERRIDES += ["--train.global_batch_size", "2", "--target.layer_ids", "[0, 1, 2, 3, 4]"]
# At the bench's widths the options that differ in what compute and the network see (ZeRO-3's
# gathers of the 32 000-word embedding and heads, the partitioned gradients, the states read
# through the drives); the host and engine terms of every option are the tiny recipe's run.
BENCH_OPTIONS = ["zero0", "zero2", "zero3", "zero3+nvme"]
TOLERANCE = 0.30
TIE = 0.20
"""Options predicted within 20 % of the fastest are tied with it (the noise between options
measured a minute apart on a shared 2-core machine, after the load factor)."""


def _tune(tmp_path: Path, name: str, target: str, overrides: list[str], extra: list[str]) -> dict:
    out = tmp_path / f"{name}.json"
    argv = ["-m", "dspark_ds.cli", "tune", "--recipe", str(RECIPES / "tiny_cpu.yaml")]
    argv += ["--target.path", target, "--overrides", json.dumps(overrides), "--measure", "true"]
    argv += ["--measure_memory", "false", "--output_json", str(out), *extra]
    proc = check(torchrun(argv, timeout_s=900, cwd=tmp_path))
    print(proc.stdout[-6000:], file=sys.stderr)
    return json.loads(out.read_text())


def _ratio(row: dict) -> float:
    return row["predicted_at_measurement_s"] / row["measured_step_s"]


def _speeds(rows: dict) -> dict[str, float]:
    """Each option's measured step per unit of the conditions it was measured under (its
    measurement x the prediction from all samples over the prediction from its own), so that
    options measured under different loads compare."""
    return {
        n: r["measured_step_s"] * r["predicted_step_s"] / r["predicted_at_measurement_s"]
        for n, r in rows.items()
    }


def _tied(rows: dict) -> set[str]:
    """The options predicted within TIE of the fastest prediction."""
    fastest = min(r["predicted_step_s"] for r in rows.values())
    return {n for n, r in rows.items() if r["predicted_step_s"] <= (1 + TIE) * fastest}


def _measured(result: dict) -> dict:
    return {r["option"]: r for r in result["options"] if r["measured_step_s"] is not None}


def _outliers(result: dict) -> list[str]:
    """The options `_check_predictions` would fail on: outside the tolerance, or measured
    fastest while the model does not predict them among the fastest."""
    rows = _measured(result)
    out = [n for n, r in rows.items() if not 1 - TOLERANCE <= _ratio(r) <= 1 + TOLERANCE]
    speed = _speeds(rows)
    fastest = min(speed, key=speed.get)
    if fastest not in _tied(rows) and fastest not in out:
        out.append(fastest)
    return out


def _remeasure_outliers(
    tmp_path: Path, name: str, target: str, overrides: list[str], extra: list[str], result: dict
) -> dict:
    """A step measured on a shared 2-core machine can be disturbed by a burst of other work
    between the calibration samples and the timed steps (seen in CI: one option of eight at
    0.69; and one measured fastest, 0.0254 s, with its prediction from its own samples 1.24x
    that). An option `_check_predictions` would fail on is measured once more, alone in a run
    of its own; its second measurement stands. A model that is wrong for an option is wrong
    twice."""
    outliers = _outliers(result)
    if not outliers:
        return result
    print(f"{name}: measuring {outliers} once more", file=sys.stderr)
    only_those = [*extra, "--options", json.dumps(outliers)]
    again = _tune(tmp_path, f"{name}-again", target, overrides, only_those)
    rows = {r["option"]: r for r in again["options"]}
    result["options"] = [rows.get(r["option"], r) for r in result["options"]]
    return result


def _check_predictions(result: dict, options: list[str]) -> None:
    """Each option's prediction from the calibration samples taken between its own timed steps
    (the conditions it was measured under) within 30 % of its measured median; the option
    measured fastest (`_speeds`) is one the model predicts fastest, up to a 20 % tie; what the
    model puts well behind is measured behind."""
    rows = _measured(result)
    assert set(rows) == set(options), result["text"]
    for name, r in rows.items():
        assert 1 - TOLERANCE <= _ratio(r) <= 1 + TOLERANCE, (name, _ratio(r), result["text"])
    speed, tied = _speeds(rows), _tied(rows)
    assert min(speed, key=speed.get) in tied, (tied, speed, result["text"])
    fastest_predicted = min(r["predicted_step_s"] for r in rows.values())
    for name, r in rows.items():
        if r["predicted_step_s"] > (1 + TOLERANCE) * fastest_predicted:
            assert speed[name] > min(speed.values()), (name, result["text"])


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.run_alone  # seen in CI beside two other workers' tests: ZeRO-3 measured at 0.69x
def test_predicted_step_within_30_percent_of_measured(tmp_path):
    """On the 2 gloo ranks: calibrate while measuring every option of the tiny recipe (host
    time and DeepSpeed's own costs: what a shared machine's load moves most), calibration
    samples between blocks of each option's timed steps so that both see the same load, and
    save the profile; the same for four options of a recipe at the bench's widths (compute; ZeRO-3's
    all-gathers of the 32 000-word embedding and heads). Each option's prediction within 30 %
    of its measured median; a later run predicts from the saved profile."""
    tiny = build_tiny_target(tmp_path / "tiny_target")
    profile = tmp_path / "profile.json"
    # three samples per option, each before a block of 16 timed steps (the tiny recipe) or 4
    # (the bench's widths): a median of three still outvotes one disturbed sample
    tiny_steps = ["--measure_steps", str(3 * 16), "--cluster.samples", "3"]
    bench_steps = ["--measure_steps", "12", "--cluster.samples", "3"]
    bench_steps += ["--options", json.dumps(BENCH_OPTIONS)]
    first = _tune(tmp_path, "tiny", tiny, [], [*tiny_steps, "--cluster.save_profile", str(profile)])
    assert first["calibration"]["ranks"] == 2
    assert first["calibration"]["samples"] == 3 * len(tune.OPTION_NAMES)
    assert first["calibration"]["nvme_measured"]
    saved = json.loads(profile.read_text())["machine"]
    assert saved["gpus_per_node"] == 2 and "inter_node_bytes_per_s" not in saved  # not measured
    bench = build_bench_target(tmp_path / "bench_target")
    second = _tune(tmp_path, "bench", bench, BENCH_OVERRIDES, bench_steps)
    assert second["calibration"]["compute_shape"]["vocab"] == 32000  # the recipe's widths
    # the saved profile: a later prediction uses its figures, and calibrates nothing
    out = tmp_path / "later.json"
    argv = ["tune", "--recipe", str(RECIPES / "tiny_cpu.yaml"), "--target.path", tiny]
    argv += ["--cluster.profile", str(profile), "--output_json", str(out)]
    assert cli_main(argv) == 0
    later = json.loads(out.read_text())
    assert later["calibration"] == {}
    for key in ("peak_flops", "op_overhead_s", "engine_micro_s", "nvme_read_bytes_per_s"):
        assert later["machine"][key] == pytest.approx(first["machine"][key]), key
        assert later["machine_sources"][key] == f"profile {profile}", key
    first = _remeasure_outliers(tmp_path, "tiny", tiny, [], tiny_steps, first)
    second = _remeasure_outliers(tmp_path, "bench", bench, BENCH_OVERRIDES, bench_steps, second)
    _check_predictions(first, tune.OPTION_NAMES)
    _check_predictions(second, BENCH_OPTIONS)
    # compute shows: ZeRO-3 (the recompute loss, the gathers) measured well behind ZeRO-2
    rows = {r["option"]: r for r in second["options"]}
    assert rows["zero3"]["measured_step_s"] > 1.3 * rows["zero2"]["measured_step_s"]
    assert rows["zero2"]["terms"]["compute"] > 0.5 * rows["zero2"]["predicted_step_s"]
