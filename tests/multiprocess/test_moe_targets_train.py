"""The large MoE targets of 2026 (`helpers.moe_targets`) through `dspark-ds train`: a few steps of
the tiny recipe on 8 chat samples (2 steps an epoch, 3 steps: the third from epoch 1) on 2 gloo
ranks, each family under every ZeRO stage (0, 1, 2, 3; ZeRO-3 reading the target partition by
partition, each rank keeping its own,
Kimi-K2.5's text model out of the whole vision-language checkpoint) online, in the hybrid data
mode (epoch 0 online writing the cache, epoch 1 reading it; its ZeRO stage rotating over the
families) and offline from a `build-cache` cache: every run's
losses equal the ZeRO-2 online run's (the same batches in every mode, docs/data.md), and the
export decodes losslessly against its target (one row; batched: tests/unit/test_moe_targets.py).
Every family's runs, and DeepSeek-V4's own drafter's, share one launch of 2 ranks
(`helpers/dist.py train-many`: one import of DeepSpeed)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from dspark_ds.data.cache import TargetCache
from dspark_ds.drafters import load_draft_model
from dspark_ds.eval.decoding import speculative_generate
from dspark_ds.target import TargetConfig, load_target

from helpers.dist import REPO, check, python, torchrun
from helpers.gemma4 import greedy_without_cache
from helpers.moe_targets import MOE_TARGETS, build_tiny_moe_target
from helpers.tiny_models import write_chat_jsonl

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

FAMILIES = list(MOE_TARGETS)
STAGES = ("zero0", "zero1", "zero2", "zero3")


def _build_cache(path: str, data: str, cache: Path) -> None:
    argv = ["-m", "dspark_ds.cli", "build-cache", f"--data.paths=[{data}]"]
    argv += [f"--data.cache_dir={cache}", "--data.max_length=64", "--data.num_workers=0"]
    argv += ["--data.samples_per_shard=8", f"--target.path={path}", "--target.layer_ids=[-1, 0, 2]"]
    argv += ["--target.dtype=float32", "--target.device=cpu", "--batch_size=4"]
    check(python(argv, timeout_s=600))


def _train_many(root: Path, runs: dict[str, list[str]], data: str) -> dict:
    """`dspark-ds train` of the tiny recipe, 3 steps on `data`, once per entry of `runs` (name
    -> its own options, its target among them), on 2 ranks, in one process each: {name:
    {"losses": [...], "export_dir": ...}}."""
    common = ["--config", "dspark_ds/recipes/tiny_cpu.yaml"]
    common += ["--target.layer_ids", "[-1, 0, 2]", "--output_dir", str(root / "runs")]
    common += ["--train.max_steps", "3", "--train.synthetic_samples", "0"]
    common += ["--data.paths", f"[{data}]", "--train.progress_bar", "false"]
    common += ["--tracking.enabled", "false", "--checkpoint.save_final", "false"]
    argvs = [[*common, "--name", name, *extra] for name, extra in runs.items()]
    spec, result = root / "spec.json", root / "result.json"
    spec.write_text(json.dumps({"runs": argvs, "result_file": str(result)}))
    argv = [str(REPO / "tests" / "helpers" / "dist.py"), "train-many", str(spec)]
    check(torchrun(argv, nproc=2))
    out = json.loads(result.read_text())
    for res in out.values():
        res["losses"] = [v for _, v in sorted((int(k), v) for k, v in res["losses"].items())]
    return out


# DeepSeek-V4's own drafter (`model.backbone: target`); NOTE: without its MoE blocks as ZeRO-3
# leaves its ZeRO-3 run hung after step 1, and the bounded collectives turn such a hang into a
# failed run
V4_OWN = ["--model.backbone", "target", "--distributed.timeout_s", "120"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> dict:
    """Every family's runs and DeepSeek-V4's own drafter's, in one launch of 2 ranks (one
    import of DeepSpeed): {"paths": {family: target dir}, "res": {f"{family}/{run}": ...}}."""
    root = tmp_path_factory.mktemp("moe_train")
    data = write_chat_jsonl(root / "train.jsonl", 8)
    paths, runs = {}, {}
    for i, family in enumerate(FAMILIES):
        path = paths[family] = build_tiny_moe_target(root / family, family)
        target = ["--target.path", path]
        for stage in STAGES:
            runs[f"{family}/{stage}"] = [*target, "--deepspeed.config", stage]
        hybrid = ["--data.mode", "hybrid"]
        hybrid += ["--data.cache_dir", str(root / "caches" / family / "hybrid")]
        runs[f"{family}/hybrid"] = [*target, *hybrid, "--deepspeed.config", STAGES[i % 4]]
        cache = str(root / "caches" / family / "offline")
        _build_cache(path, data, cache)
        runs[f"{family}/offline"] = [*target, "--data.mode", "offline", "--data.cache_dir", cache]
    for zero in STAGES[2:]:
        runs[f"v4_own/{zero}"] = ["--target.path", paths["deepseek_v4"], *V4_OWN]
        runs[f"v4_own/{zero}"] += ["--deepspeed.config", zero]
    # the run names are directories: one per family and run
    res = _train_many(root, {n.replace("/", "_"): a for n, a in runs.items()}, data)
    return {"root": root, "paths": paths, "res": {n: res[n.replace("/", "_")] for n in runs}}


def _decodes(path: str, export: Path, shared: bool = False) -> None:
    """The export at `export` decodes greedily as its target does (one row)."""
    target = load_target(TargetConfig(path=path, layer_ids=[0], dtype="float32"), "cpu").model
    weights = (target.model.embed_tokens.weight, target.lm_head.weight) if shared else None
    drafter = load_draft_model(export, shared_weights=weights)
    ids = torch.randint(4, 300, (1, 10), generator=torch.Generator().manual_seed(1))
    got, _ = speculative_generate(target, drafter, ids, max_new_tokens=12)
    assert got.tolist() == greedy_without_cache(target, ids, 12, set()).tolist()


@pytest.mark.parametrize("family", FAMILIES)
def test_trains_under_every_zero_stage_and_data_mode_and_the_export_decodes(family, trained):
    res = {n.split("/")[1]: r for n, r in trained["res"].items() if n.startswith(family + "/")}
    want = res["zero2"]["losses"]
    assert len(want) == 3 and all(math.isfinite(x) for x in want)
    assert set(res) == {*STAGES, "hybrid", "offline"}
    for name, r in res.items():
        torch.testing.assert_close(r["losses"], want, rtol=1e-3, atol=1e-4, msg=name)
        written = json.loads((Path(r["export_dir"]) / "config.json").read_text())
        assert written["target_model_type"] == family
    # epoch 0 wrote it, epoch 1 read it
    assert len(TargetCache(trained["root"] / "caches" / family / "hybrid")) == 8
    _decodes(trained["paths"][family], Path(res["zero2"]["export_dir"]))


def test_deepseek_v4s_own_drafter_trains_under_zero3_and_its_export_decodes(trained):
    """`model.backbone: target` on DeepSeek-V4, on 2 ranks: the V4 draft layers (experts
    partitioned under ZeRO-3, initialised module by module as the whole drafter is; each MoE
    block one ZeRO-3 leaf, since the experts a rank's tokens are routed to differ between
    ranks) train to the ZeRO-2 losses; the export (vLLM's V4 DSpark layout, no embedding /
    lm_head) loads with the target's and decodes losslessly."""
    res = trained["res"]
    want = res["v4_own/zero2"]["losses"]
    assert len(want) == 3 and all(math.isfinite(x) for x in want)
    torch.testing.assert_close(res["v4_own/zero3"]["losses"], want, rtol=1e-3, atol=1e-4)
    export = Path(res["v4_own/zero3"]["export_dir"])
    assert json.loads((export / "config.json").read_text())["architectures"] == [
        "DeepseekV4ForCausalLM"
    ]
    _decodes(trained["paths"]["deepseek_v4"], export, shared=True)
