"""`dspark-ds train` for real on CPU: DeepSpeed (gloo), 1 and 2 ranks, ZeRO 0 / 2 / 3 / 3+offload.

Launches are grouped to keep the suite short (each process imports deepspeed once):
  B  torchrun 2: ZeRO-0, 2, 3, 3+CPU offload; the 1-step ZeRO-3 twin of the reference
                 Muon under ZeRO-0 (Newton-Schulz sharded and not), 2 and 3, and resumes;
                 hybrid data under ZeRO-3 (the cache completed in epoch 0)
  A  1 process : ZeRO-0, 2, 3 (draft layers compiled, aot_eager), 3+CPU offload; the 1-step ZeRO-0
                 reference; an unreachable MLflow; C: B's ZeRO-3 step-4 checkpoint resumed on
                 1 rank (universal checkpoint), which is why A runs after B
  D  1 process : SIGUSR1 mid-run (exit 75), then `--resume auto` (2 launches)
  E  `dspark-ds export` from B's ZeRO-3 checkpoint
Every run is online (synthetic sequences, features from the target in the job): the drafter
shares the target's embedding / lm_head Parameters; B's ZeRO-3 runs partition the target.
"""

from __future__ import annotations

import json
import math
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from helpers.dist import REPO, _env, check, free_port, python, torchrun
from helpers.tiny_models import build_tiny_target, prepare_chat

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

RECIPE = str(REPO / "dspark_ds" / "recipes" / "tiny_cpu.yaml")
STAGES = {"z0": "zero0", "z2": "zero2", "z3": "zero3", "z3off": "zero3_offload_cpu"}
STEPS = 8


def base_args(target: Path, out: Path, name: str, *extra: str) -> list[str]:
    return [
        "--config",
        RECIPE,
        "--target.path",
        str(target),
        "--output_dir",
        str(out),
        "--name",
        name,
        "--train.max_steps",
        str(STEPS),
        "--train.progress_bar",
        "false",
        "--checkpoint.every_steps",
        "4",
        "--checkpoint.keep_last",
        "2",
        *extra,
    ]


# ZeRO-3 with nothing kept whole: every weight (the target's too) is released after its use
NO_PERSIST = [
    "--deepspeed.overrides",
    json.dumps({"zero_optimization": {"stage3_param_persistence_threshold": 0}}),
]

# the 1-rank vs 2-rank equality: same global batch (4), one step, a clip that never bites; a
# large AdamW eps makes the update proportional to the gradient (Adam alone would hide a wrong
# gradient scale)
EQ = [
    "--train.max_steps",
    "1",
    "--train.max_grad_norm",
    "1e6",
    "--train.eps",
    "1.0",
    "--train.lr",
    "0.05",
    "--checkpoint.save_final",
    "false",
]


def train_many(out: Path, runs: list[list[str]], nproc: int):
    out.mkdir(parents=True, exist_ok=True)
    spec = out / f"spec_{nproc}.json"
    result = out / f"result_{nproc}.json"
    spec.write_text(json.dumps({"runs": runs, "result_file": str(result)}))
    argv = [str(REPO / "tests" / "helpers" / "dist.py"), "train-many", str(spec)]
    t0 = time.time()
    proc = torchrun(argv, nproc=nproc) if nproc > 1 else python(argv)
    check(proc)
    (out / f"launch_{nproc}.log").write_text(proc.stdout + proc.stderr)
    print(f"[launch nproc={nproc}] {time.time() - t0:.0f}s")
    data = json.loads(result.read_text())
    for res in data.values():
        res["losses"] = {int(k): v for k, v in res["losses"].items()}
    # every run was under the device guard; with 2 ranks it saw dspark_ds's own collectives
    # (loss terms, logged counts, signal check, validation, barriers) and none was made on the
    # host (a world of one makes no collective of its own)
    guard = json.loads(Path(f"{result}.device_guard.json").read_text())
    assert guard["policed"] >= (len(runs) * STEPS if nproc > 1 else 0), guard
    return data


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_target):
    root = tmp_path_factory.mktemp("train")
    target = Path(tiny_target)
    out = root / "runs"
    # a_z3 also compiles its draft layers (perf.compile layers: dynamo's graphs and AOTAutograd
    # under ZeRO-3's hooks; the aot_eager backend generates no kernels, which cost a fresh clone
    # 87 s of inductor's C++ builds here: tests/unit/test_perf_compile.py holds inductor's own
    # kernels to the eager loss and gradients); test_stages_agree holds it to the eager ZeRO-0
    # losses
    compiled = ["--perf.compile", "layers", "--perf.compile_backend", "aot_eager"]
    one = [
        base_args(target, out, f"a_{k}", "--deepspeed.config", v, *(compiled if k == "z3" else []))
        for k, v in STAGES.items()
    ]
    one.append(
        base_args(
            target, out, "eq_ref", "--deepspeed.config", "zero0", "--data.batch_size", "4", *EQ
        )
    )
    one.append(
        base_args(
            target,
            out,
            "a_nomlflow",
            "--deepspeed.config",
            "zero0",
            "--tracking.uri",
            f"http://127.0.0.1:{free_port()}",
            "--tracking.flush_timeout_s",
            "1",
            "--train.max_steps",
            "2",
            "--checkpoint.save_final",
            "false",
            "--checkpoint.export_final",
            "false",
        )
    )
    two = [
        base_args(
            target, out, f"b_{k}", "--deepspeed.config", v, *(NO_PERSIST if k == "z3" else [])
        )
        for k, v in STAGES.items()
    ]
    two.append(
        base_args(
            target, out, "eq_z3", "--deepspeed.config", "zero3", "--data.batch_size", "2", *EQ
        )
    )
    # a tied target (one Parameter is embedding and lm_head) shared under ZeRO-3
    tied = Path(build_tiny_target(root / "tied", tie_word_embeddings=True))
    two.append(
        base_args(
            tied,
            out,
            "b_z3_tied",
            "--deepspeed.config",
            "zero3",
            *NO_PERSIST,
            "--train.max_steps",
            "2",
            "--checkpoint.save_final",
            "false",
        )
    )
    # perf.drop_empty_blocks under ZeRO-3: 64 blocks, 23-47 valid anchors per row, so each rank
    # cuts a different count of dummy blocks; with chunks of 4 blocks the ranks must agree on
    # one count, or their ZeRO-3 gathers part ways (a hang). Held to 64 blocks on one rank.
    drop = ["--model.num_anchors", "64", "--perf.loss_chunk_anchors", "4", *EQ]
    all_blocks = ["--data.batch_size", "4", "--perf.drop_empty_blocks", "off", *drop]
    one.append(
        base_args(target, out, "eq_ref_all_blocks", "--deepspeed.config", "zero0", *all_blocks)
    )
    dropped = ["--data.batch_size", "2", "--perf.drop_empty_blocks", "on", *drop]
    zero3 = ["--deepspeed.config", "zero3", *NO_PERSIST]
    two.append(base_args(target, out, "eq_z3_drop", *zero3, *dropped))
    # train.optimizer muon, 4 steps (a checkpoint at 2), and the ZeRO-2 run again from it
    muon = ["--train.optimizer", "muon", "--train.max_steps", "4", "--checkpoint.every_steps", "2"]
    for k in ("z2", "z3"):
        two.append(base_args(target, out, f"b_muon_{k}", "--deepspeed.config", STAGES[k], *muon))
    tag = out / "b_muon_z2" / "checkpoints" / "step_00000002"
    resume = ["--checkpoint.resume", str(tag), "--checkpoint.export_final", "false"]
    two.append(
        base_args(target, out, "b_muon_resume", "--deepspeed.config", "zero2", *muon, *resume)
    )
    # the optimizer offloaded: ZeRO-2 with it, ZeRO-3 with it and the parameters
    off = [
        "--deepspeed.overrides",
        json.dumps({"zero_optimization": {"offload_optimizer": {"device": "cpu"}}}),
    ]
    two.append(base_args(target, out, "b_muon_z2off", "--deepspeed.config", "zero2", *muon, *off))
    two.append(base_args(target, out, "b_muon_z3off", "--deepspeed.config", STAGES["z3off"], *muon))
    # ZeRO-0: each matrix's Newton-Schulz on one rank (train.muon_shard_ns, the default), on
    # every rank, and the sharded run resumed from its step-2 checkpoint
    two.append(base_args(target, out, "b_muon_z0", "--deepspeed.config", "zero0", *muon))
    whole = ["--train.muon_shard_ns", "false"]
    two.append(
        base_args(target, out, "b_muon_z0_whole", "--deepspeed.config", "zero0", *muon, *whole)
    )
    tag = out / "b_muon_z0" / "checkpoints" / "step_00000002"
    resume = ["--checkpoint.resume", str(tag), "--checkpoint.export_final", "false"]
    two.append(
        base_args(target, out, "b_muon_z0_resume", "--deepspeed.config", "zero0", *muon, *resume)
    )
    # hybrid mode under ZeRO-3 on real (prepared) data:
    # test_hybrid_zero3_two_ranks_completes_the_cache
    (root / "hyb").mkdir()
    prep = prepare_chat(root / "hyb", 17, seed=2, tokenizer=target, max_length=72)
    hybrid = ["--deepspeed.config", "zero3", *NO_PERSIST, "--train.synthetic_samples", "0"]
    hybrid += ["--data.mode", "hybrid", "--data.paths", f"[{prep}]"]
    hybrid += ["--data.cache_dir", str(root / "hyb" / "cache"), "--data.max_length", "72"]
    two.append(base_args(target, out, "hyb", *hybrid, "--tracking.enabled", "false"))
    # B's ZeRO-3 step-4 checkpoint on 1 rank (C: test_resume_two_ranks_on_one), so A runs
    # after B
    tag = out / "b_z3" / "checkpoints" / "step_00000004"
    resume = ["--checkpoint.resume", str(tag), "--checkpoint.export_final", "false"]
    zero3 = ["--deepspeed.config", "zero3", "--data.batch_size", "4"]
    one.append(base_args(target, out, "c_resume", *zero3, *resume))
    res = train_many(out, two, nproc=2)
    res.update(train_many(out, one, nproc=1))
    return {"root": root, "target": target, "tied": tied, "out": out, "res": res}


def mlflow_client(out: Path):
    from mlflow.tracking import MlflowClient

    from dspark_ds.tracking.store import default_uri

    return MlflowClient(tracking_uri=default_uri(str(out)))


@pytest.mark.parametrize("prefix", ["a", "b"])
@pytest.mark.parametrize("stage", list(STAGES))
def test_trains_and_loss_falls(runs, prefix, stage):
    losses = runs["res"][f"{prefix}_{stage}"]["losses"]
    assert sorted(losses) == list(range(1, STEPS + 1))
    first, last = sum(losses[s] for s in (1, 2)) / 2, sum(losses[s] for s in (7, 8)) / 2
    assert last < 0.97 * first, losses


@pytest.mark.parametrize("prefix", ["a", "b"])
def test_stages_agree(runs, prefix):
    """Same data, same init, same world size: every ZeRO stage computes the same losses."""
    ref = runs["res"][f"{prefix}_z0"]["losses"]
    for stage in STAGES:
        losses = runs["res"][f"{prefix}_{stage}"]["losses"]
        for step in range(1, STEPS + 1):
            assert losses[step] == pytest.approx(ref[step], rel=2e-4), (stage, step)


def test_muon_under_zero_2_and_3_agrees_and_resumes(runs):
    """train.optimizer muon (DeepSpeed's Muon with our groups, engine/optimizer.py) on 2 ranks:
    ZeRO-2's and ZeRO-3's partition-aware updates are the same step, and a run resumed from a
    checkpoint continues exactly (Muon's momentum in it). Its step against torch's own Muon:
    tests/unit/test_muon.py."""
    res = runs["res"]
    z2, z3 = res["b_muon_z2"]["losses"], res["b_muon_z3"]["losses"]
    assert sorted(z2) == sorted(z3) == [1, 2, 3, 4]
    for step in z2:
        assert math.isfinite(z2[step]) and z3[step] == pytest.approx(z2[step], rel=2e-4), step
    resumed = res["b_muon_resume"]["losses"]
    assert sorted(resumed) == [3, 4]
    for step in resumed:
        assert resumed[step] == pytest.approx(z2[step], rel=1e-5), step
    # another optimizer than AdamW's (the same first step: the same init and batch)
    adamw = res["b_z2"]["losses"]
    assert z2[1] == pytest.approx(adamw[1], rel=1e-6) and z2[4] != pytest.approx(adamw[4], rel=1e-3)


def test_muon_with_the_optimizer_offloaded_takes_the_same_steps(runs):
    """train.optimizer muon with an offloaded optimizer (DeepSpeed orthogonalises the gathered
    gradients on the device, its CPU Adam steps the rest): ZeRO-2 with the optimizer on the
    host and ZeRO-3 with the optimizer and parameters there train the same drafter as without
    offload, to float rounding. (Before, a Muon run with an offloaded optimizer was refused.)

    The weight matrices Muon steps agree to 5e-4, the rest to 1e-5: Newton-Schulz's quintic
    iteration amplifies the rounding of the gradients' other reduction order. After these 4
    steps on an AVX-512 CPU (2026-12-08; within 1e-5 on the CPU before): offload against not up
    to 9.7e-5, ZeRO-3 against ZeRO-2 (neither offloaded) 2.2e-4, AdamW in Muon's place 1.6e-2."""
    res = runs["res"]
    for name, ref in (("b_muon_z2off", "b_muon_z2"), ("b_muon_z3off", "b_muon_z3")):
        got, want = res[name]["losses"], res[ref]["losses"]
        assert sorted(got) == [1, 2, 3, 4], name
        for step in got:
            assert got[step] == pytest.approx(want[step], rel=1e-5), (name, step)
        a, b = (load_file(Path(res[n]["export_dir"]) / "model.safetensors") for n in (name, ref))
        assert a.keys() == b.keys()
        for key in a:
            atol = 5e-4 if a[key].ndim == 2 else 1e-5
            what = f"{name} {key}"
            torch.testing.assert_close(
                a[key], b[key], rtol=0, atol=atol, msg=lambda m, what=what: f"{what}: {m}"
            )


def test_muon_under_zero_0_shards_newton_schulz_without_changing_a_bit(runs):
    """train.muon_shard_ns on 2 ZeRO-0 ranks: each rank computes half the matrices' updates
    and gets the rest by broadcast (the run announces the sharded optimizer); the weights are
    those of every rank computing all of them, bit for bit, and a resume from its checkpoint
    continues exactly (every rank holds every momentum, rank 0 saves them). The step itself
    against DeepSpeed's: tests/multiprocess/test_muon_sharded.py."""
    res = runs["res"]
    log = (runs["out"] / "launch_2.log").read_text()
    assert log.count("optimizer NSShardedMuonWithAuxAdam, world size 2") == 2, log[-3000:]
    sharded, whole = (
        load_file(Path(res[name]["export_dir"]) / "model.safetensors")
        for name in ("b_muon_z0", "b_muon_z0_whole")
    )
    assert sharded.keys() == whole.keys()
    for name in sharded:
        assert torch.equal(sharded[name], whole[name]), name
    assert res["b_muon_z0"]["losses"] == res["b_muon_z0_whole"]["losses"]
    resumed = res["b_muon_z0_resume"]["losses"]
    assert sorted(resumed) == [3, 4]
    for step in resumed:
        assert resumed[step] == pytest.approx(res["b_muon_z0"]["losses"][step], rel=1e-5), step


def test_one_rank_equals_two_ranks(runs):
    """A 2-rank ZeRO-3 step and a 1-rank ZeRO-0 step on the same global batch."""
    ref = load_file(Path(runs["res"]["eq_ref"]["export_dir"]) / "model.safetensors")
    two = load_file(Path(runs["res"]["eq_z3"]["export_dir"]) / "model.safetensors")
    assert ref.keys() == two.keys()
    for name in ref:
        torch.testing.assert_close(two[name], ref[name], rtol=1e-5, atol=1e-6, msg=name)
    one, two = runs["res"]["eq_ref"]["losses"][1], runs["res"]["eq_z3"]["losses"][1]
    assert one == pytest.approx(two, rel=1e-6)
    # The anchor sampler's statistics are means over the global batch, whatever the world size.
    client = mlflow_client(runs["out"])
    for key in ("valid_anchors_abs", "sampled_anchors_ratio", "block_supervised_tokens_abs"):
        a, b = (
            client.get_metric_history(runs["res"][name]["mlflow_run_id"], f"train/{key}")
            for name in ("eq_ref", "eq_z3")
        )
        assert len(a) == len(b) == 1 and a[0].value == pytest.approx(b[0].value), key
        assert a[0].value > 0, key


def test_two_ranks_dropping_empty_blocks_equal_one_rank_with_every_block(runs):
    """perf.drop_empty_blocks: the ranks agree on one block count (ZeRO-3 runs), and the step
    equals a 1-rank step over all num_anchors blocks."""
    ref = load_file(Path(runs["res"]["eq_ref_all_blocks"]["export_dir"]) / "model.safetensors")
    two = load_file(Path(runs["res"]["eq_z3_drop"]["export_dir"]) / "model.safetensors")
    for name in ref:
        torch.testing.assert_close(two[name], ref[name], rtol=1e-5, atol=1e-6, msg=name)
    one, two = (runs["res"][n]["losses"][1] for n in ("eq_ref_all_blocks", "eq_z3_drop"))
    assert one == pytest.approx(two, rel=1e-6)


def test_mlflow_run_has_params_metrics_artifacts_tags(runs):
    client = mlflow_client(runs["out"])
    run = client.get_run(runs["res"]["b_z3"]["mlflow_run_id"])
    params = run.data.params
    assert params["train.lr"] == "0.003" and params["deepspeed.config"] == "zero3"
    assert params["model.num_anchors"] == "8" and params["derived.world_size"] == "2"
    # ZeRO-3: the chunked loss in its recompute form (partitioned head weights)
    assert params["derived.loss_impl"] == "recompute"
    assert (
        client.get_run(runs["res"]["a_z0"]["mlflow_run_id"]).data.params["derived.loss_impl"]
        == "chunked"
    )
    assert params["derived.compile"] == "off" and params["derived.loss_chunk_anchors"] == "32"
    compiled = client.get_run(runs["res"]["a_z3"]["mlflow_run_id"]).data.params
    assert compiled["derived.compile"] == "layers"
    assert compiled["perf.compile_backend"] == "aot_eager"
    assert params["perf.compile_backend"] == "inductor"
    assert run.data.tags["zero_stage"] == "3" and run.data.tags["world_size"] == "2"
    assert "git_sha" in run.data.tags
    hist = client.get_metric_history(run.info.run_id, "train/loss")
    assert [m.step for m in hist] == list(range(1, STEPS + 1))
    assert hist[0].value == pytest.approx(runs["res"]["b_z3"]["losses"][1])
    for key in (
        "train/ce_loss",
        "train/l1_loss",
        "train/tau_probabilistic",
        "train/lr",
        "train/valid_anchors_abs",
        "train/sampled_anchors_abs",
        "train/block_supervised_tokens_ratio",
        "system/tokens_per_s",
        "system/peak_memory_mb",
        "system/step_s",
        "system/tflops_per_gpu",
        "val/loss",
        "val/tau_probabilistic",
    ):
        assert client.get_metric_history(run.info.run_id, key), key
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"ds_config.json", "config.yaml"} <= artifacts
    assert run.info.status == "FINISHED"
    # the export is the run's MLflow model, with its files
    model = client.get_logged_model(run.data.tags["model_id"])
    assert model.source_run_id == run.info.run_id
    files = {a.path for a in client.list_logged_model_artifacts(model.model_id)}
    assert {"config.json", "model.safetensors", "mlflow_run.json"} <= files


def test_log_throughput_and_the_tuner_calibrated_from_a_finished_run(runs, tmp_path):
    """Each log step's model FLOP/s per GPU is the kind's count of the window's sequences (its
    row's own rates) shared by the 2 ranks over its time, with no MFU on a CPU without a peak;
    `dspark-ds tune --cluster.from_run` on the finished 1-rank ZeRO-0 run derives the sustained
    fraction at which the model predicts that run's measured step, and saves it as a profile."""
    from dspark_ds.cli import main as cli_main
    from dspark_ds.config import TrainRunConfig, parse
    from dspark_ds.cost.flops import WindowFlops
    from dspark_ds.tune.cluster import PROFILE_VERSION

    b_z3 = runs["out"] / "b_z3"
    config = b_z3 / "checkpoints" / "step_00000008" / "run_config.yaml"
    flops = WindowFlops(parse(TrainRunConfig, ["--config", str(config)]), "cpu", zero_stage=3)
    rows = [json.loads(line) for line in (b_z3 / "train_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "system/tflops_per_gpu" in r] == list(range(1, STEPS + 1))
    for r in rows:  # log_every 1: each window is one step
        s = r["system/step_s"]
        count = flops(
            r["system/samples_per_s"] * s,
            r["system/tokens_per_s"] * s,
            r["train/sampled_anchors_abs"],
        )
        assert r["system/tflops_per_gpu"] * 1e12 == pytest.approx(count / 2 / s, rel=1e-6)
        assert "system/mfu" not in r

    run, out, profile = runs["out"] / "a_z0", tmp_path / "tune.json", tmp_path / "profile.json"
    # the preset's host and DeepSpeed figures are an H100 node's (0.035 s a step at this point):
    # a run on an idle CPU can step faster than they alone allow, and the fraction then caps at
    # 1 (what the report's NOTE says); what this test checks is the compute term's calibration
    host = tmp_path / "host.json"
    tiny = {"op_overhead_s": 1e-8, "engine_micro_s": [1e-7] * 7, "engine_step_s": [1e-7] * 7}
    host.write_text(json.dumps({"version": PROFILE_VERSION, "meta": {}, "machine": tiny}))
    argv = ["tune", "--recipe", RECIPE, "--target.path", str(runs["target"]), "--device", "cpu"]
    argv += ["--options", "[zero0]", "--cluster.from_run", str(run), "--cluster.profile", str(host)]
    argv += ["--cluster.save_profile", str(profile), "--output_json", str(out)]
    assert cli_main(argv) == 0
    rec = json.loads(out.read_text())["from_run"]
    assert (rec["option"], rec["world"], rec["micro_batch"], rec["accum"]) == ("zero0", 1, 2, 2)
    log = [json.loads(line) for line in (run / "train_log.jsonl").read_text().splitlines()]
    steps = sorted(r["system/step_s"] for r in log[1:])  # the first window is the warm-up
    assert len(steps) == STEPS - 1 and rec["measured_step_s"] == pytest.approx(steps[3])
    # the model's FLOPs of the run's point are the log's up to rounding its mean sequence (~48
    # synthetic tokens) to a whole token: within 2 %, and so is its predicted step
    assert rec["model_flops_per_step"] == pytest.approx(rec["logged_flops_per_step"], rel=0.02)
    assert rec["predicted_step_s"] == pytest.approx(rec["measured_step_s"], rel=0.02)
    assert not rec["capped"] and 0 < rec["mfu"] <= rec["sustained_fraction"] < 1
    saved = json.loads(profile.read_text())["machine"]
    assert saved["sustained_fraction"] == saved["target_sustained_fraction"]
    assert saved["sustained_fraction"] == rec["sustained_fraction"]


def test_unreachable_mlflow_does_not_stop_training(runs):
    res = runs["res"]["a_nomlflow"]
    assert res["mlflow_run_id"] is None and sorted(res["losses"]) == [1, 2]
    kept = json.loads((runs["out"] / "a_nomlflow" / "mlflow_undelivered.json").read_text())
    assert kept["run_id"] is None and [op["kind"] for op in kept["ops"]][:1] == ["start"]
    assert kept["ops"][-1] == {"kind": "end", "args": kept["ops"][-1]["args"], "in_log": False}


@pytest.mark.parametrize("name", ["a_z0", "b_z2", "b_z3", "a_z3off"])
def test_export_from_checkpoint_equals_live_weights(runs, name):
    from dspark_ds.drafters import load_draft_model
    from dspark_ds.train.export import export_checkpoint

    out = runs["root"] / f"export_{name}"
    export_checkpoint(runs["out"] / name, out)
    live = load_file(Path(runs["res"][name]["export_dir"]) / "model.safetensors")
    got = load_file(out / "model.safetensors")
    assert live.keys() == got.keys()
    for key in live:
        assert torch.equal(live[key], got[key]), key
    model = load_draft_model(out)
    assert model.config.block_size == 4 and model.config.markov_rank == 16


def test_export_in_the_speculators_format(runs):
    """`dspark-ds export --format speculators` of B's ZeRO-3 checkpoint: the run's weights under
    speculators' config (the run's target as its verifier), without the target's embedding and
    lm_head, read back as the native export's drafter."""
    from dspark_ds.cli import main as cli_main
    from dspark_ds.drafters import load_draft_model

    out = runs["root"] / "export_speculators"
    argv = ["export", "--checkpoint", str(runs["out"] / "b_z3"), "--output_dir", str(out)]
    assert cli_main([*argv, "--format", "speculators"]) == 0
    data = json.loads((out / "config.json").read_text())
    assert data["speculators_model_type"] == "dspark" and data["block_size"] == 4
    assert data["speculators_config"]["verifier"]["name_or_path"] == str(
        Path(runs["target"]).resolve()
    )
    live = load_file(Path(runs["res"]["b_z3"]["export_dir"]) / "model.safetensors")
    got = load_file(out / "model.safetensors")
    assert got.keys() == live.keys() - {"embed_tokens.weight", "lm_head.weight"}
    assert all(torch.equal(live[k], got[k]) for k in got)
    native = load_draft_model(Path(runs["res"]["b_z3"]["export_dir"]))
    shared = (native.embed_tokens.weight, native.lm_head.weight)
    back = load_draft_model(out, shared_weights=shared)  # the verifier gives the layer count
    assert back.config.markov_rank == 16 and back.config.num_target_layers == (
        native.config.num_target_layers
    )


def test_resume_two_ranks_on_one(runs):
    """B's ZeRO-3 2-rank checkpoint at step 4, continued on 1 rank: the same steps 5..8.

    NOTE: the 1-rank run takes the whole global batch as one micro-batch; with gradient
    accumulation instead, each micro-batch would be normalised on its own (not one global
    weighted mean) and the losses would drift apart by ~1e-4."""
    tag = runs["out"] / "b_z3" / "checkpoints" / "step_00000004"
    assert (tag / "COMPLETE").exists()
    # the run: c_resume in the file's 1-process launch (`runs`), after the 2-rank one
    losses, ref = runs["res"]["c_resume"]["losses"], runs["res"]["b_z3"]["losses"]
    assert sorted(losses) == [5, 6, 7, 8]
    for step in losses:
        assert losses[step] == pytest.approx(ref[step], rel=1e-5), step
    assert (runs["out"] / "b_z3" / "checkpoints" / "step_00000004_universal").is_dir()


def read_log(run_dir: Path) -> dict[int, float]:
    losses = {}
    for line in (run_dir / "train_log.jsonl").read_text().splitlines():
        row = json.loads(line)
        losses[row["step"]] = row["loss"]  # a replayed step overwrites the earlier entry
    return losses


def test_preempt_then_resume_auto_continues_exactly(runs):
    out, name = runs["out"], "sig"
    argv = [
        sys.executable,
        "-m",
        "dspark_ds.cli",
        "train",
        *base_args(
            runs["target"],
            out,
            name,
            "--deepspeed.config",
            "zero0",
            "--checkpoint.every_steps",
            "0",
        ),
    ]
    # NOTE: Slurm's pre-emption warning (SIGUSR1) sent at once, to a process that starts with
    # it blocked (the mask is inherited): it waits until the trainer's handlers take it, so the
    # run stops after its first step, whatever the machine's speed (a signal sent at a logged
    # step raced the remaining steps)
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})
    try:
        proc = subprocess.Popen(
            argv, env=_env(), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
    proc.send_signal(signal.SIGUSR1)
    output = proc.communicate(timeout=400)[0]
    assert proc.returncode == 75, output[-3000:]
    assert (out / name / "REQUEUE").exists()
    assert int((out / name / "REQUEUE").read_text()) == 1
    run_id = (out / name / "mlflow_run_id").read_text().strip()

    check(
        subprocess.run(
            [*argv, "--checkpoint.resume", "auto"],
            env=_env(),
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=600,
        )
    )
    assert not (out / name / "REQUEUE").exists()
    # the log follows the resumed state: each step once, the replayed ones not twice
    steps = [
        json.loads(x)["step"] for x in (out / name / "train_log.jsonl").read_text().splitlines()
    ]
    assert steps == list(range(1, STEPS + 1))
    got, ref = read_log(out / name), runs["res"]["a_z0"]["losses"]
    assert sorted(got) == list(range(1, STEPS + 1))
    for step in got:
        assert got[step] == pytest.approx(ref[step], rel=1e-6, abs=1e-7), step
    # the resumed job continued the same MLflow run
    assert (out / name / "mlflow_run_id").read_text().strip() == run_id
    hist = mlflow_client(out).get_metric_history(run_id, "train/loss")
    assert sorted({m.step for m in hist}) == list(range(1, STEPS + 1))


def test_export_cli(runs):
    out = runs["root"] / "export_cli"
    proc = check(
        python(
            [
                "-m",
                "dspark_ds.cli",
                "export",
                "--checkpoint",
                str(runs["out"] / "b_z3"),
                "--output_dir",
                str(out),
            ]
        )
    )
    assert "wrote" in proc.stdout
    live = load_file(Path(runs["res"]["b_z3"]["export_dir"]) / "model.safetensors")
    got = load_file(out / "model.safetensors")
    assert all(torch.equal(live[k], got[k]) for k in live)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3DSparkModel"] and cfg["block_size"] == 4
    # readable by a serving job of another user (safetensors alone writes 0600)
    assert (out / "model.safetensors").stat().st_mode & 0o044 == 0o044

    # a non-empty directory is refused (one line, exit 2, nothing touched) unless asked
    other = runs["root"] / "export_taken"
    other.mkdir()
    (other / "config.json").write_text('{"unrelated": true}')
    argv = ["-m", "dspark_ds.cli", "export", "--checkpoint", str(runs["out"] / "b_z3")]
    proc = python([*argv, "--output_dir", str(other)])
    assert proc.returncode == 2, proc.stderr
    assert "output_dir:" in proc.stderr and "--overwrite true" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert (other / "config.json").read_text() == '{"unrelated": true}'
    from dspark_ds.train.export import export_checkpoint

    (other / "model-00001-of-00002.safetensors").write_bytes(b"stale shard")
    export_checkpoint(runs["out"] / "b_z3", other, overwrite=True)
    got = load_file(other / "model.safetensors")
    assert all(torch.equal(live[k], got[k]) for k in live)
    # the export names the run that trained it (the checkpoint's run directory holds its id)
    assert sorted(p.name for p in other.iterdir()) == [
        "config.json",
        "mlflow_run.json",
        "model.safetensors",
    ]
    record = json.loads((other / "mlflow_run.json").read_text())
    assert record["run_id"] == runs["res"]["b_z3"]["mlflow_run_id"]


def test_online_target_shared_and_partitioned_under_zero3(runs):
    """The drafter's embedding / lm_head are the target's frozen Parameters at every stage;
    under ZeRO-3 each rank stores only its partition of the target (nothing left gathered
    after the run), and the losses equal the replicated (ZeRO-2) run's."""
    res = runs["res"]
    for name in ("b_z0", "b_z2", "b_z3", "b_z3off", "a_z0", "a_z3", "b_z3_tied"):
        assert all(f["shares"] and f["frozen"] for f in res[name]["target"]), name
    for rank_facts in res["b_z2"]["target"]:  # replicated
        assert (
            rank_facts["local_numel"]
            == rank_facts["materialized_numel"]
            == rank_facts["full_numel"]
        )
    for name in ("b_z3", "b_z3_tied"):
        facts = res[name]["target"]
        full = facts[0]["full_numel"]
        assert len(facts) == 2 and full > 10_000
        for rank_facts in facts:
            assert rank_facts["local_numel"] <= full // 2 + 64, (name, rank_facts)
            assert rank_facts["materialized_numel"] == 0, (name, rank_facts)
        assert sum(f["local_numel"] for f in facts) >= full
    for step in range(1, STEPS + 1):
        assert res["b_z3"]["losses"][step] == pytest.approx(
            res["b_z2"]["losses"][step], rel=2e-4
        ), step


@pytest.mark.parametrize("name", ["b_z2", "b_z3"])
def test_shared_weights_not_in_checkpoints_but_exported(runs, name):
    from dspark_ds.engine.checkpoint import checkpoint_trainable_fp32
    from dspark_ds.target import target_shared_weights

    trainable = checkpoint_trainable_fp32(runs["out"] / name / "checkpoints" / "step_00000008")
    assert "fc.weight" in trainable
    assert not {"embed_tokens.weight", "lm_head.weight"} & set(trainable)
    live = load_file(Path(runs["res"][name]["export_dir"]) / "model.safetensors")
    embed, head = target_shared_weights(str(runs["target"]))
    assert torch.equal(live["embed_tokens.weight"], embed.float())
    assert torch.equal(live["lm_head.weight"], head.float())


def test_tied_target_export_under_zero3(runs):
    from dspark_ds.target import target_shared_weights

    live = load_file(Path(runs["res"]["b_z3_tied"]["export_dir"]) / "model.safetensors")
    embed, head = target_shared_weights(str(runs["tied"]))
    assert torch.equal(embed, head)
    assert torch.equal(live["embed_tokens.weight"], embed.float())
    assert torch.equal(live["lm_head.weight"], embed.float())


def test_target_dtype_must_match_precision_online(tmp_path, tiny_target):
    from dspark_ds.cli import parse_config
    from dspark_ds.train.trainer import Trainer

    target = tiny_target
    cfg = parse_config(
        "train", base_args(Path(target), tmp_path, "dtype", "--train.precision", "bf16")
    )
    with pytest.raises(
        ValueError,
        match="target.dtype: .*train.precision=bf16 needs target.dtype=bfloat16, got float32",
    ):
        Trainer(cfg)


def test_hybrid_zero3_two_ranks_completes_the_cache(runs):
    """Hybrid mode, ZeRO-3, 2 ranks, real (prepared) data: epoch 0 runs the partitioned target,
    whose every forward all-gathers weights (a collective), so the samples left out of epoch 0
    must cost both ranks the same number of forwards; epoch 1 reads the completed cache. (The
    run: hyb in the file's 2-rank launch.)"""
    from dspark_ds.data.cache import TargetCache

    res = runs["res"]
    cache = TargetCache(runs["root"] / "hyb" / "cache")
    assert len(cache) % 4, "the test needs samples left out of epoch 0 (global batch 4)"
    losses = res["hyb"]["losses"]
    assert sorted(losses) == list(range(1, STEPS + 1))  # epoch 1 (steps 5..8) from the cache
    assert all(f["shares"] and f["materialized_numel"] == 0 for f in res["hyb"]["target"])


def test_zero3_nvme_with_a_target_in_the_job(tmp_path):
    """ZeRO-3 with parameters and optimizer on NVMe and the target in the job: the target's
    parameters larger than DeepSpeed's smallest swap (1 MiB: its 32 000 × 64 embedding and
    lm_head) are swapped to files of their own, which the drafter's parameter swapper (started
    after it, emptying its own folder) leaves in place: the steps run and the loss is finite."""
    target = Path(build_tiny_target(tmp_path / "target", hidden_size=64, vocab_size=32000))
    nvme = tmp_path / "nvme"
    # NOTE: swap buffers of 5 x 4e6 elements, not the shipped 5 x 1e8 (2 GB page-locked per
    # engine, the drafter's and the target's): the largest parameter is the 2.05e6 embedding
    overrides = {
        "zero_optimization": {
            "offload_param": {"nvme_path": str(nvme), "buffer_size": 4_000_000},
            "offload_optimizer": {"nvme_path": str(nvme)},
        }
    }
    offload = ["--deepspeed.config", "zero3_offload_nvme"]
    offload += ["--deepspeed.overrides", json.dumps(overrides)]
    short = ["--train.max_steps", "2", "--checkpoint.every_steps", "0"]
    short += ["--tracking.enabled", "false"]
    args = base_args(target, tmp_path / "runs", "nvme", *offload, *short)
    check(python(["-m", "dspark_ds.cli", "train", *args], timeout_s=600))
    assert list((nvme / "target").rglob("*_param.tensor.swp")), "no target parameter swapped"
    log = [json.loads(line) for line in (tmp_path / "runs" / "nvme" / "train_log.jsonl").open()]
    losses = [row["loss"] for row in log if "loss" in row]
    assert len(losses) == 2 and all(loss == loss for loss in losses), log
