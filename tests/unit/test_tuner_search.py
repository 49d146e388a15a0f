"""The tuner's search over micro-batches, the DeepSpeed keys its model does not read,
`--write_recipe`, and the docs' `dspark-ds tune` commands: predictions only, no measured step
(tests/multiprocess/test_tuner_write.py trains a written recipe)."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest

from dspark_ds import tune
from dspark_ds.cli import main as cli_main
from dspark_ds.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]
RECIPES = REPO / "dspark_ds" / "recipes"
CLUSTER_32B = ["--cluster.gpus_per_node", "8", "--cluster.gpu_memory_gb", "80"]
CLUSTER_32B += ["--cluster.host_memory_gb", "1024"]


def _tune(tmp_path: Path, recipe: str, *argv: str) -> dict:
    out = tmp_path / "tune.json"
    cmd = ["tune", "--recipe", str(RECIPES / recipe), *argv, "--output_json", str(out)]
    assert cli_main(cmd) == 0
    return json.loads(out.read_text())


def test_search_takes_the_largest_micro_batch_that_fits(tmp_path, capsys):
    """Qwen3-32B on 2 nodes of 8 × 80 GB (issue 35: at micro-batch 1 every micro-batch gathers
    the target across the network): each option's micro-batches are the divisors of its 32
    sequences per rank, its memory grows with them, its point is the fastest (= the largest)
    that fits, the global batch held; ZeRO-0/1/2 fit at none and show micro-batch 1; the
    recommendation is the fastest point over all options (hpZ's, listed on 2 nodes)."""
    argv = ["--cluster.nodes", "2,1", *CLUSTER_32B, "--recompute", "false"]
    result = _tune(tmp_path, "dspark_qwen3_32b.yaml", *argv)
    text = capsys.readouterr().out
    rows = {r["option"]: r for r in result["options"]}
    est = {e["option"]: e for e in result["estimates"]}
    for name, e in est.items():
        tried = e["point"]["tried"]
        assert [t["micro_batch"] for t in tried] == [1, 2, 4, 8, 16, 32], name
        memory = [t["device_bytes"] for t in tried]
        assert memory == sorted(memory), name
        fitting = [t for t in tried if t["fits"]]
        r = rows[name]
        assert r["micro_batch"] * r["accum"] * 16 == 512 == r["global_batch"], name
        if fitting:
            fastest = min(fitting, key=lambda t: t["predicted_step_s"])["micro_batch"]
            assert r["micro_batch"] == fastest == e["point"]["largest_fitting_micro_batch"]
            assert r["fits"]
        else:
            assert r["micro_batch"] == 1 and not r["fits"], name
    assert not any(rows[n]["fits"] for n in ("zero0", "zero1", "zero2"))
    # ZeRO-3 at 2 nodes: micro-batch 8 (4 micro-batches per rank), not 16 (over 80 GB)
    assert (rows["zero3"]["micro_batch"], rows["zero3"]["accum"]) == (8, 4)
    # one gather of the 32.8 B target per micro-batch instead of 32: the step nearly halves
    at_one = est["zero3"]["point"]["tried"][0]["predicted_step_s"]
    assert rows["zero3"]["predicted_step_s"] < 0.6 * at_one
    fitting = [r for r in rows.values() if r["fits"]]
    assert result["recommended"] == min(fitting, key=lambda r: r["predicted_step_s"])["option"]
    # hpZ: its secondary copy of the target leaves room for micro-batch 4, not 8
    assert result["recommended"] == "zero3+hpz" and rows["zero3+hpz"]["micro_batch"] == 4
    assert "recommended: zero3+hpz at micro-batch 4 × 8 accumulation" in text
    assert "--data.batch_size 4" in text and "the recipe as given (micro-batch 1)" in text
    # the table shows each option's point; the scaling table each size's
    assert re.search(r"^zero3 +8 +- +4 ", text, re.M), text
    one_node = {r["option"]: r for r in result["scaling"]["1"]}
    assert one_node["zero3"]["micro_batch"] == 4  # 8 does not fit next to 1/8 of the target
    assert not any(r["recompute"] for r in result["options"])


def test_recomputation_lets_a_larger_micro_batch_fit_and_wins(tmp_path, capsys):
    """Qwen3-32B on 2 nodes of 8 GPUs of 40 GB under plain ZeRO-3: without recomputation
    micro-batch 2 is the largest that fits (16 gathers of the target per step); recomputing the
    draft layers (their saves are most of the activations) lets micro-batch 8 fit, 4 gathers,
    and it is faster despite the layers' second forward. Recomputation is tried only where the
    plain point does not fit; the table, the terms and the recommended flags say it; the written
    recipe carries perf.activation_checkpointing and trains as the config training builds."""
    from dspark_ds.config import TrainRunConfig, parse
    from dspark_ds.engine.config import build_ds_config

    path = tmp_path / "tuned.yaml"
    argv = ["--cluster.nodes", "2", "--cluster.gpus_per_node", "8", "--cluster.gpu_memory_gb", "40"]
    argv += ["--options", "[zero3]"]
    result = _tune(tmp_path, "dspark_qwen3_32b.yaml", *argv, "--write_recipe", str(path))
    text = capsys.readouterr().out
    (est,) = result["estimates"]
    tried = est["point"]["tried"]
    plain = {t["micro_batch"]: t for t in tried if not t["recompute"]}
    recomputed = {t["micro_batch"]: t for t in tried if t["recompute"]}
    assert sorted(plain) == [1, 2, 4, 8, 16, 32]
    assert sorted(recomputed) == [m for m, t in plain.items() if not t["fits"]] == [4, 8, 16, 32]
    for m, t in recomputed.items():  # less memory for a slower step at the same micro-batch
        assert t["device_bytes"] < 0.6 * plain[m]["device_bytes"]
        assert t["predicted_step_s"] > plain[m]["predicted_step_s"]
    assert est["point"]["largest_fitting_micro_batch"] == 2
    assert est["point"]["largest_fitting_with_recompute"] == 8
    (row,) = result["options"]
    assert (row["micro_batch"], row["accum"], row["recompute"]) == (8, 4, True)
    assert row["predicted_step_s"] < plain[2]["predicted_step_s"] / 1.05
    terms = est["step"]["terms"]
    assert 0 < terms["recompute"] < 0.1 * terms["compute"]
    assert re.search(r"^zero3 +8 +yes +4 ", text, re.M), text
    assert "recomputing the draft layers (--deepspeed.config zero3 --data.batch_size 8 " in text
    assert "--perf.activation_checkpointing true)" in text
    # the recipe: the flag, and the DeepSpeed config training builds from it
    cfg = parse(TrainRunConfig, ["--config", str(path)])
    assert cfg.perf.activation_checkpointing is True and cfg.data.batch_size == 8
    built = build_ds_config(
        cfg.deepspeed, cfg.train, micro_batch_size=8, world_size=16, use_gpu=True
    )
    assert built == cfg.deepspeed.overrides and built["gradient_accumulation_steps"] == 4
    assert "recomputing the draft layers" in path.read_text().splitlines()[0]


def test_recomputation_is_not_chosen_where_it_does_not_help(tmp_path):
    """Qwen3-32B on 2 nodes of 8 × 80 GB: ZeRO-3 fits up to micro-batch 8; recomputing lets 16
    fit, but the 4 gathers it saves cost less than the layers' second forward: the point stays
    8 without recomputation. And where the plain points fit (ZeRO-3 with hpZ at micro-batch 1 and
    2) recomputation is not tried."""
    argv = ["--cluster.nodes", "2", *CLUSTER_32B, "--options", "[zero3, zero3+hpz]"]
    result = _tune(tmp_path, "dspark_qwen3_32b.yaml", *argv)
    zero3, hpz = result["estimates"]
    recomputed = {t["micro_batch"]: t for t in zero3["point"]["tried"] if t["recompute"]}
    assert recomputed[16]["fits"]
    assert recomputed[16]["predicted_step_s"] > zero3["step"]["predicted_step_s"]
    assert (zero3["point"]["micro_batch"], zero3["point"]["recompute"]) == (8, False)
    assert zero3["step"]["terms"]["recompute"] == 0
    assert [t["micro_batch"] for t in hpz["point"]["tried"][:3]] == [1, 2, 4]
    assert not any(t["recompute"] for t in hpz["point"]["tried"][:3])


def test_a_global_batch_the_cluster_cannot_split_is_held_near(tmp_path, capsys):
    """512 sequences over 3 × 8 ranks: every point holds 504 (21 per rank: micro-batches 1, 3,
    7, 21), and says so."""
    result = _tune(tmp_path, "dspark_qwen3_8b.yaml", "--cluster.nodes", "3")
    text = capsys.readouterr().out
    for e in result["estimates"]:
        tried = [t["micro_batch"] for t in e["point"]["tried"] if not t["recompute"]]
        assert tried == [1, 3, 7, 21]
        assert e["point"]["global_batch"] == 504
    for r in result["options"]:
        assert r["micro_batch"] * r["accum"] * 24 == 504
    assert "the search holds 504 sequences per step (21 per rank)" in text


def test_unread_deepspeed_keys_are_named_in_a_warning(tmp_path, capsys):
    """Quantized weights / gradients (ZeRO++, CUDA only) and partial optimizer offload change
    nothing in the model's figures: a warning line names each; keys it reads (a bucket size,
    hpZ's partition size) or that change neither memory nor time (the clipping threshold) are
    not named; a recipe's own deepspeed.config file, which the options replace by the shipped
    ones, is said too."""
    unread = {
        "zero_hpz_partition_size": 8,
        "zero_quantized_weights": True,
        "zero_quantized_gradients": True,
        "offload_optimizer": {"ratio": 0.3},
    }
    overrides = {
        "zero_optimization": {**unread, "reduce_bucket_size": 10**8},
        "gradient_clipping": 1.0,
    }
    argv = ["--options", "[zero3, zero3+offload_opt]", "--cluster.nodes", "2"]
    plain = _tune(tmp_path, "dspark_qwen3_32b.yaml", *argv)
    assert plain["warnings"] == [] and "warning:" not in capsys.readouterr().out
    deepspeed = json.dumps(["--deepspeed.overrides", json.dumps(overrides)])
    result = _tune(tmp_path, "dspark_qwen3_32b.yaml", *argv, "--overrides", deepspeed)
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("warning:")]
    assert len(lines) == 1 and lines == [f"warning: {w}" for w in result["warnings"]]
    named = lines[0].split(": ")[-1].split(", ")
    assert named == [
        "zero_optimization.zero_quantized_weights",
        "zero_optimization.zero_quantized_gradients",
        "zero_optimization.offload_optimizer.ratio",
    ]
    deepspeed = json.dumps(["--deepspeed.config", str(REPO / "ds_configs" / "zero2.json")])
    custom = _tune(tmp_path, "dspark_qwen3_32b.yaml", *argv, "--overrides", deepspeed)
    assert (
        len(custom["warnings"]) == 1
        and "the tuner compares the shipped configs" in (custom["warnings"][0])
    )


def test_a_muon_recipe_is_tuned_and_told_what_the_model_prices(tmp_path, capsys):
    """The memory and step-time model know AdamW only: a Muon recipe gets every option (the
    tuner used to stop with training's refusal of an offloaded optimizer, building the NVMe
    option's config for its calibration) and one warning line saying what its figures leave out
    (Newton-Schulz) and over-count (the states). With AdamW: no warning (the test above)."""
    from dspark_ds.tune.config import default_options

    muon_flags = ["--overrides", json.dumps(["--train.optimizer", "muon"])]
    muon = _tune(tmp_path, "dspark_qwen3_8b.yaml", *muon_flags)
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("warning:")]
    assert lines == [f"warning: {w}" for w in muon["warnings"]] and len(lines) == 1
    assert "train.optimizer muon" in lines[0] and "Newton-Schulz" in lines[0]
    assert {r["option"] for r in muon["options"]} == set(default_options(1))


def test_written_recipe_is_the_config_training_builds(tmp_path, capsys):
    """`--write_recipe`: the train CLI's parser reads it; it holds the point (micro-batch,
    accumulation, the global batch held on 24 ranks); its deepspeed.overrides merged over its
    shipped config is exactly the config training builds from it, nothing left "auto", the ZeRO
    values the tuner read explicit; on another world size training refuses it by name."""
    from dspark_ds.config import TrainRunConfig, parse
    from dspark_ds.engine.config import build_ds_config, zero_settings

    path = tmp_path / "tuned.yaml"
    result = _tune(
        tmp_path, "dspark_qwen3_8b.yaml", "--cluster.nodes", "3", "--write_recipe", str(path)
    )
    assert f"wrote {path}: {result['recommended']}" in capsys.readouterr().out
    best = next(r for r in result["options"] if r["option"] == result["recommended"])
    cfg = parse(TrainRunConfig, ["--config", str(path)])
    assert cfg.data.batch_size == best["micro_batch"]
    assert cfg.train.global_batch_size == 504 == best["micro_batch"] * best["accum"] * 24
    option = next(o for o in tune.OPTIONS if o.name == best["option"])
    assert cfg.deepspeed.config == option.config
    built = build_ds_config(
        cfg.deepspeed, cfg.train, micro_batch_size=cfg.data.batch_size, world_size=24, use_gpu=True
    )
    assert built == cfg.deepspeed.overrides
    assert "auto" not in json.dumps(built)
    assert built["gradient_accumulation_steps"] == best["accum"]
    zero = zero_settings(built)
    written = built["zero_optimization"]
    assert (
        written["stage"] == zero.stage and written["reduce_bucket_size"] == zero.reduce_bucket_size
    )
    assert written["overlap_comm"] == zero.overlap_comm
    with pytest.raises(ConfigError, match="train_batch_size|global_batch_size"):
        build_ds_config(
            cfg.deepspeed,
            cfg.train,
            micro_batch_size=cfg.data.batch_size,
            world_size=8,
            use_gpu=True,
        )


def test_hpz_gathers_within_a_node(tmp_path, capsys):
    """Qwen3-32B on 2 nodes of 8 × 80 GB at micro-batch 1 (issue 35: 32 gathers of the 32.8 B
    target across the network per step): hpZ's gathers run within a node, its step is well
    under plain ZeRO-3's (the same compute, the reduce-scatter still global), its memory is
    ZeRO-3's plus the secondary partition, 2 bytes × (the target + the drafter's partitioned
    parameters) / 8 ranks of a node; `--write_recipe` writes the node's 8 ranks as
    zero_hpz_partition_size. On one node it is not listed, and named it steps as ZeRO-3."""
    from dspark_ds.config import TrainRunConfig, parse
    from dspark_ds.tune.config import default_options

    path = tmp_path / "hpz.yaml"
    argv = ["--cluster.nodes", "2,1", "--micro_batches", "[1]", *CLUSTER_32B]
    argv += ["--options", "[zero3, zero3+hpz]", "--write_recipe", str(path)]
    two = _tune(tmp_path, "dspark_qwen3_32b.yaml", *argv)
    plain, hpz = ({k: e[k] for k in ("step", "device")} for e in two["estimates"])
    assert hpz["step"]["predicted_step_s"] < 0.6 * plain["step"]["predicted_step_s"]
    assert hpz["step"]["terms"]["compute"] == plain["step"]["terms"]["compute"]
    assert hpz["step"]["terms"]["param_gather"] < 0.1 * plain["step"]["terms"]["param_gather"]
    inv = two["inventory"]
    secondary = 2 * (inv["target_params"] + inv["trainable"]) / 8
    assert hpz["device"]["hpz_secondary"] == pytest.approx(secondary, rel=0.01)
    assert {k: v for k, v in hpz["device"].items() if k != "hpz_secondary"} == plain["device"]
    assert two["recommended"] == "zero3+hpz" and two["warnings"] == []
    cfg = parse(TrainRunConfig, ["--config", str(path)])
    assert cfg.deepspeed.config == "zero3_hpz"
    assert cfg.deepspeed.overrides["zero_optimization"]["zero_hpz_partition_size"] == 8
    assert "zero3+hpz" in default_options(2) and "zero3+hpz" not in default_options(1)
    plain, hpz = (e["predicted_step_s"] for e in two["scaling"]["1"])
    assert hpz == pytest.approx(plain, rel=1e-9)


def _doc_commands() -> list[list[str]]:
    """Every `dspark-ds tune` command of the docs' bash blocks (continuations joined), as the
    arguments after `tune`."""
    out = []
    for doc in (REPO / "docs" / "tuner.md", REPO / "README.md"):
        for block in re.findall(r"```bash\n(.*?)```", doc.read_text(), re.S):
            for cmd in re.sub(r"\\\n\s*", " ", block).splitlines():
                words = shlex.split(cmd, comments=True)
                if "tune" not in words or "..." in words:
                    continue
                start = words.index("tune")
                if words[start - 1] not in ("dspark-ds", "dspark_ds.cli"):
                    continue
                if words[start + 1 :] not in out:  # the same command in two docs: once
                    out.append(words[start + 1 :])
    return out


def test_the_docs_tune_commands_parse(tmp_path, monkeypatch):
    """Each `dspark-ds tune` command the docs show parses (the tuner's flags and the train flags
    of its --overrides), so that a renamed flag fails here rather than for a reader."""
    from dspark_ds.cli import parse_config
    from dspark_ds.tune.cluster import preset_machine, save_profile
    from dspark_ds.tune.config import load_recipe

    commands = _doc_commands()
    assert len(commands) >= 8
    assert any("dspark_qwen3_32b.yaml" in " ".join(c) for c in commands)
    monkeypatch.chdir(tmp_path)
    save_profile(preset_machine("8xH100-80GB"), tmp_path / "node.json", {})  # node.json's place
    for argv in commands:
        argv = [str(REPO / a) if a.startswith("dspark_ds/recipes/") else a for a in argv]
        if "--cluster.from_run" in argv:  # a run directory's place
            (tmp_path / argv[argv.index("--cluster.from_run") + 1]).mkdir(parents=True)
        load_recipe(parse_config("tune", argv))


def test_micro_batches_restrict_the_search(tmp_path, capsys):
    """`--micro_batches [1, 4]` searches those alone; one that divides nothing is refused by
    name, with the ones that would."""
    argv = ["--cluster.nodes", "2", "--options", "[zero3]", "--micro_batches", "[1, 4]"]
    result = _tune(tmp_path, "dspark_qwen3_32b.yaml", *argv)
    (est,) = result["estimates"]
    assert [t["micro_batch"] for t in est["point"]["tried"]] == [1, 4]
    assert est["point"]["micro_batch"] == 4
    argv = ["tune", "--recipe", str(RECIPES / "dspark_qwen3_32b.yaml"), "--cluster.nodes", "2"]
    argv += ["--options", "[zero3]", "--micro_batches", "[3]"]
    capsys.readouterr()
    assert cli_main(argv) == 2
    assert "micro_batches: none of [3] divides the 32 sequences per rank on 16 ranks" in (
        capsys.readouterr().err
    )


def test_measure_runs_a_recompute_point_with_activation_checkpointing(tmp_path):
    """`--measure` runs each option at its searched point: a point that recomputes builds its
    short run with perf.activation_checkpointing on (and one that does not, off, whatever the
    recipe says), at the point's micro-batch and global batch."""
    from dspark_ds.cli import parse_config
    from dspark_ds.tune.config import load_recipe
    from dspark_ds.tune.measure import option_run_config
    from dspark_ds.tune.search import point_args, point_config

    argv = ["--recipe", str(RECIPES / "dspark_qwen3_8b.yaml")]
    argv += ["--overrides", '["--perf.activation_checkpointing", "true"]']
    run_cfg = load_recipe(parse_config("tune", argv))
    (zero3,) = [o for o in tune.OPTIONS if o.name == "zero3"]
    for recompute in (True, False):
        point = {"micro_batch": 4, "global_batch": 64, "recompute": recompute, "accum": 2}
        at = point_config(run_cfg, **point_args(point))
        cfg = option_run_config(zero3, at, 2, str(tmp_path))
        assert cfg.perf.activation_checkpointing is recompute
        assert (cfg.data.batch_size, cfg.train.global_batch_size) == (4, 64)
