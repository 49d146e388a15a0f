"""The large MoE targets of 2026 (`helpers.moe_targets`) through `dspark-ds train`: a few steps of
the tiny recipe on 8 chat samples (2 steps an epoch, 3 steps: the third from epoch 1) on 2 gloo
ranks, each family under every ZeRO stage (0, 1, 2, 3; ZeRO-3 reading the target partition by
partition, each rank keeping its own,
Kimi-K2.5's text model out of the whole vision-language checkpoint) online, in the hybrid data
mode (epoch 0 online writing the cache, epoch 1 reading it; its ZeRO stage rotating over the
families) and, for DeepSeek-V4 and Kimi-K2.5, offline from a `build-cache` cache: every run's
losses equal the ZeRO-2 online run's (the same batches in every mode, docs/data.md), and the
export decodes losslessly against its target (one row; batched: tests/unit/test_moe_targets.py).
A family's runs share one process a rank (`helpers/dist.py train-many`: one import of
DeepSpeed)."""

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
# the families whose features are new (DeepSeek-V4's streams, Kimi-K2.5's text model) also
# through an offline cache
OFFLINE = ("deepseek_v4", "kimi_k25")


def _build_cache(path: str, data: str, cache: Path) -> None:
    argv = ["-m", "dspark_ds.cli", "build-cache", f"--data.paths=[{data}]"]
    argv += [f"--data.cache_dir={cache}", "--data.max_length=64", "--data.num_workers=0"]
    argv += ["--data.samples_per_shard=8", f"--target.path={path}", "--target.layer_ids=[-1, 0, 2]"]
    argv += ["--target.dtype=float32", "--target.device=cpu", "--batch_size=4"]
    check(python(argv, timeout_s=600))


def _train_many(root: Path, runs: dict[str, list[str]], path: str, data: str) -> dict:
    """`dspark-ds train` of the tiny recipe, 3 steps on `data`, once per entry of `runs` (name
    -> its own options), on 2 ranks, in one process each: {name: {"losses": [...],
    "export_dir": ...}}."""
    common = ["--config", "dspark_ds/recipes/tiny_cpu.yaml", "--target.path", path]
    common += ["--target.layer_ids", "[-1, 0, 2]", "--output_dir", str(root / "runs")]
    common += ["--train.max_steps", "3", "--train.synthetic_samples", "0"]
    common += ["--data.paths", f"[{data}]", "--train.progress_bar", "false"]
    common += ["--tracking.enabled", "false", "--checkpoint.save_final", "false"]
    argvs = [[*common, "--name", name, *extra] for name, extra in runs.items()]
    spec, result = root / "spec.json", root / "result.json"
    spec.write_text(json.dumps({"runs": argvs, "result_file": str(result)}))
    argv = [str(REPO / "tests" / "helpers" / "dist.py"), "train-many", str(spec)]
    check(torchrun(argv))
    out = json.loads(result.read_text())
    for res in out.values():
        res["losses"] = [v for _, v in sorted((int(k), v) for k, v in res["losses"].items())]
    return out


def _decodes(path: str, export: Path, shared: bool = False) -> None:
    """The export at `export` decodes greedily as its target does (one row)."""
    target = load_target(TargetConfig(path=path, layer_ids=[0], dtype="float32"), "cpu").model
    weights = (target.model.embed_tokens.weight, target.lm_head.weight) if shared else None
    drafter = load_draft_model(export, shared_weights=weights)
    ids = torch.randint(4, 300, (1, 10), generator=torch.Generator().manual_seed(1))
    got, _ = speculative_generate(target, drafter, ids, max_new_tokens=12)
    assert got.tolist() == greedy_without_cache(target, ids, 12, set()).tolist()


@pytest.mark.parametrize("family", FAMILIES)
def test_trains_under_every_zero_stage_and_data_mode_and_the_export_decodes(family, tmp_path):
    path = build_tiny_moe_target(tmp_path / family, family)
    data = write_chat_jsonl(tmp_path / "train.jsonl", 8)
    hybrid_stage = STAGES[FAMILIES.index(family) % len(STAGES)]
    runs = {stage: ["--deepspeed.config", stage] for stage in STAGES}
    runs["hybrid"] = ["--data.mode", "hybrid", "--data.cache_dir", str(tmp_path / "hybrid")]
    runs["hybrid"] += ["--deepspeed.config", hybrid_stage]
    if family in OFFLINE:
        _build_cache(path, data, tmp_path / "cache")
        runs["offline"] = ["--data.mode", "offline", "--data.cache_dir", str(tmp_path / "cache")]
    res = _train_many(tmp_path, runs, path, data)
    want = res["zero2"]["losses"]
    assert len(want) == 3 and all(math.isfinite(x) for x in want)
    for name in runs:
        torch.testing.assert_close(res[name]["losses"], want, rtol=1e-3, atol=1e-4, msg=name)
        written = json.loads((Path(res[name]["export_dir"]) / "config.json").read_text())
        assert written["target_model_type"] == family
    assert len(TargetCache(tmp_path / "hybrid")) == 8  # epoch 0 wrote it, epoch 1 read it
    _decodes(path, Path(res["zero2"]["export_dir"]))


def test_deepseek_v4s_own_drafter_trains_under_zero3_and_its_export_decodes(tmp_path):
    """`model.backbone: target` on DeepSeek-V4, on 2 ranks: the V4 draft layers (experts
    partitioned under ZeRO-3, initialised module by module as the whole drafter is; each MoE
    block one ZeRO-3 leaf, since the experts a rank's tokens are routed to differ between
    ranks) train to the ZeRO-2 losses; the export (vLLM's V4 DSpark layout, no embedding /
    lm_head) loads with the target's and decodes losslessly."""
    path = build_tiny_moe_target(tmp_path / "v4", "deepseek_v4")
    data = write_chat_jsonl(tmp_path / "train.jsonl", 8)
    # NOTE: without the leaves the ZeRO-3 run hung after step 1; the bounded collectives turn
    # such a hang into a failed run
    own = ["--model.backbone", "target", "--distributed.timeout_s", "120"]
    runs = {zero: [*own, "--deepspeed.config", zero] for zero in STAGES[2:]}
    res = _train_many(tmp_path, runs, path, data)
    want = res["zero2"]["losses"]
    assert len(want) == 3 and all(math.isfinite(x) for x in want)
    torch.testing.assert_close(res["zero3"]["losses"], want, rtol=1e-3, atol=1e-4)
    export = Path(res["zero3"]["export_dir"])
    assert json.loads((export / "config.json").read_text())["architectures"] == [
        "DeepseekV4ForCausalLM"
    ]
    _decodes(path, export, shared=True)
