"""`--model.draft_vocab_size` through `dspark-ds train` and `dspark-ds export` (DeepSpeed on
CPU): the vocabulary counted from the data, the export's d2t / t2d, its decoding lossless."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from dspark_ds.data.vocab_counts import COUNTS_FILE, count_tokens
from dspark_ds.drafters import load_draft_model
from dspark_ds.drafters.common.vocab import top_tokens
from dspark_ds.eval.decoding import speculative_generate

from helpers.dist import check, python
from helpers.evaluation import greedy_reference

RECIPES = {"dspark": "tiny_cpu", "eagle3": "eagle3_tiny_cpu"}


@pytest.mark.parametrize(("value", "why"), [("-3", "must be >= 0"), ("100000", "must be in")])
def test_the_option_is_parsed_and_checked(tmp_path, capsys, tiny_target, value, why):
    from dspark_ds.cli import main

    argv = ["train", "--config", "dspark_ds/recipes/tiny_cpu.yaml", "--target.path", tiny_target]
    argv += ["--output_dir", str(tmp_path), "--model.draft_vocab_size", value]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "model.draft_vocab_size: " in err and why in err


def test_the_counts_are_those_of_the_supervised_tokens():
    ids = torch.tensor([5, 5, 7, 1, 5, 7, 2])
    mask = torch.tensor([1, 1, 1, 0, 1, 0, 1])
    counts = count_tokens([(ids, mask), (ids[:2], mask[:2])], 9)
    assert counts.tolist() == [0, 0, 1, 0, 0, 5, 0, 1, 0]


@pytest.mark.slow
# NOTE: ZeRO-2 through Eagle3 and ZeRO-3 through DSpark (the head copy is the kinds' common
# code; DSpark's Markov rows are checked under the partitioned stage)
@pytest.mark.parametrize(("kind", "zero"), [("eagle3", "zero2"), ("dspark", "zero3")])
def test_a_draft_vocabulary_trains_exports_and_decodes_losslessly(
    tmp_path, tiny_target, kind, zero
):
    """ZeRO-3: the target partitioned in the job, the drafter's head gathered from its rows."""
    out = tmp_path / "runs"
    recipe = RECIPES[kind]
    argv = ["-m", "dspark_ds.cli", "train", "--config", f"dspark_ds/recipes/{recipe}.yaml"]
    argv += ["--deepspeed.config", zero]
    argv += ["--target.path", tiny_target, "--target.layer_ids", "[0, 1, 2]"]
    argv += ["--output_dir", str(out), "--model.draft_vocab_size", "64"]
    argv += ["--train.max_steps", "4", "--train.synthetic_samples", "32"]
    argv += ["--checkpoint.every_steps", "4", "--validation.every_steps", "4"]
    argv += ["--train.progress_bar", "false", "--tracking.enabled", "false"]
    check(python(argv, timeout_s=900))
    run = out / recipe
    log = [json.loads(line) for line in (run / "train_log.jsonl").read_text().splitlines()]
    assert len(log) == 4 and all(math.isfinite(r["loss"]) and r["loss"] > 0 for r in log)

    # counted once from the (synthetic) data, beside it: the run directory
    with safe_open(str(run / COUNTS_FILE), "pt") as f:
        counts = f.get_tensor("counts")
    assert int(counts.sum()) > 0
    export = run / "export"
    config = json.loads((export / "config.json").read_text())
    assert config["draft_vocab_size"] == 64
    live = load_draft_model(export)
    ids = live.d2t + torch.arange(64)
    assert ids.tolist() == top_tokens(counts, 64).tolist()
    assert live.lm_head.weight.shape[0] == 64
    with safe_open(str(Path(tiny_target) / "model.safetensors"), "pt") as f:  # the target's rows
        torch.testing.assert_close(live.lm_head.weight, f.get_tensor("lm_head.weight")[ids])

    # `dspark-ds export` from the checkpoint gives the same drafter
    cmd = ["-m", "dspark_ds.cli", "export", "--checkpoint", str(run)]
    check(python([*cmd, "--output_dir", str(tmp_path / "exported")], timeout_s=600))
    exported = load_draft_model(tmp_path / "exported")
    for name, tensor in live.state_dict().items():
        got = exported.state_dict()[name]
        assert got.dtype == tensor.dtype, name
        torch.testing.assert_close(got, tensor, msg=name)
    # and in the speculators format: its N-row head and maps kept, the embedding the target's
    spec = tmp_path / "speculators"
    check(python([*cmd, "--output_dir", str(spec), "--format", "speculators"], timeout_s=600))
    assert json.loads((spec / "config.json").read_text())["draft_vocab_size"] == 64
    with safe_open(str(spec / "model.safetensors"), "pt") as f:
        assert {"lm_head.weight", "d2t", "t2d"} <= set(f.keys())
    with safe_open(str(Path(tiny_target) / "model.safetensors"), "pt") as f:
        shared = (f.get_tensor("model.embed_tokens.weight"), f.get_tensor("lm_head.weight"))
    from_spec = load_draft_model(spec, shared_weights=shared)
    for name, tensor in live.state_dict().items():
        torch.testing.assert_close(from_spec.state_dict()[name], tensor, msg=name)

    if (
        kind == "dspark" and zero == "zero2"
    ):  # a start from it keeps its vocabulary, whatever the new data's counts
        again = [*argv, "--model.init_from", str(export), "--train.seed", "7", "--name", "again"]
        again += ["--train.max_steps", "1"]
        check(python(again, timeout_s=900))
        assert torch.equal(load_draft_model(out / "again" / "export").d2t, live.d2t)

    # greedy speculative decoding with it is the target's own greedy output
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(tiny_target, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(0)
    for n in (5, 11):
        prompt = torch.randint(10, 300, (1, n), generator=g)
        want = greedy_reference(target, prompt, 16, with_generate=False)
        got, _ = speculative_generate(target, live, prompt, max_new_tokens=16)
        assert got.tolist() == want.tolist()


@pytest.mark.parametrize("recipe", ["dspark_qwen3_8b", "eagle3_qwen3_8b"])
def test_the_tuner_and_the_bench_count_the_smaller_head(recipe):
    from dspark_ds.cost.inventory import inventory
    from dspark_ds.drafters.perf import PerfConfig
    from dspark_ds.drafters.registry import get_kind
    from dspark_ds.perf.bench_variant import step_shape
    from dspark_ds.perf.train_bench import TrainBenchConfig
    from dspark_ds.tune.config import TunerConfig, load_recipe

    def counts(*overrides):
        argv = ["--target.path", "Qwen/Qwen3-8B", *overrides]
        run_cfg = load_recipe(
            TunerConfig(recipe=f"dspark_ds/recipes/{recipe}.yaml", overrides=argv)
        )
        inv = inventory(run_cfg)
        shape = inv.step_shape(run_cfg)
        cost = get_kind(run_cfg.model.kind).cost
        return inv, cost.step_flops(shape, PerfConfig(), "cuda", 2), shape

    full, full_flops, _ = counts()
    small, small_flops, shape = counts("--model.draft_vocab_size", "32768")
    assert (full.vocab, small.vocab, shape.vocab) == (151936, 32768, 32768)
    assert small.draft_head == 32768 * 4096 and full.draft_head == 0
    assert small.frozen == (151936 + 32768) * 4096
    for term in ("lm_head", "target_logits"):  # the vocabulary-sized matmuls shrink with N
        assert small_flops[term] == pytest.approx(full_flops[term] * 32768 / 151936)
    same = [
        k for k in full_flops if k not in ("lm_head", "target_logits", "markov", "loss_recompute")
    ]
    assert all(small_flops[k] == full_flops[k] for k in same)  # the rest does not change
    bench = TrainBenchConfig(
        drafter=recipe.split("_")[0], vocab_size=151936, draft_vocab_size=32768
    )
    assert bench.model.draft_vocab_size == 32768 and step_shape(bench).vocab == 32768
