"""The large MoE targets of 2026 (`helpers.moe_targets`) through `dspark-ds train`: a few steps of
the tiny recipe under ZeRO-2 and ZeRO-3 (the target read partition by partition; Kimi-K2.5's
text model out of the whole vision-language checkpoint), the same losses, offline from a cache
(DeepSeek-V4, Kimi-K2.5), and the export decodes
losslessly against its target (one row)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from dspark_ds.drafters import load_draft_model
from dspark_ds.eval.decoding import speculative_generate
from dspark_ds.target import TargetConfig, load_target

from helpers.dist import check, python
from helpers.gemma4 import greedy_without_cache
from helpers.moe_targets import MOE_TARGETS, build_tiny_moe_target
from helpers.tiny_models import write_chat_jsonl

pytestmark = pytest.mark.slow

# the families whose features are new (DeepSeek-V4's streams, Kimi-K2.5's text model) also
# through an offline cache
OFFLINE = ("deepseek_v4", "kimi_k25")


def _train_offline(path: str, root) -> float:
    """`build-cache`, then 3 offline steps from it: the last loss."""
    data = write_chat_jsonl(root / "train.jsonl", 16)
    cache = root / "cache"
    argv = ["-m", "dspark_ds.cli", "build-cache", f"--data.paths=[{data}]"]
    argv += [f"--data.cache_dir={cache}", "--data.max_length=64", "--data.num_workers=0"]
    argv += ["--data.samples_per_shard=8", f"--target.path={path}", "--target.layer_ids=[-1, 0, 2]"]
    argv += ["--target.dtype=float32", "--target.device=cpu", "--batch_size=4"]
    check(python(argv, timeout_s=600))
    out = root / "offline"
    argv = ["-m", "dspark_ds.cli", "train", "--config", "dspark_ds/recipes/tiny_cpu.yaml"]
    argv += ["--target.path", path, "--target.layer_ids", "[-1, 0, 2]", "--output_dir", str(out)]
    argv += ["--train.max_steps", "3", "--data.mode", "offline", "--data.cache_dir", str(cache)]
    argv += ["--train.synthetic_samples", "0", "--train.progress_bar", "false"]
    argv += ["--tracking.enabled", "false"]
    check(python(argv, timeout_s=600))
    log = (out / "tiny_cpu" / "train_log.jsonl").read_text().splitlines()
    return json.loads(log[-1])["loss"]


@pytest.mark.parametrize("family", list(MOE_TARGETS))
def test_trains_a_few_steps_of_the_tiny_recipe_and_the_export_decodes(family, tmp_path):
    path = build_tiny_moe_target(tmp_path / family, family)
    losses = {}
    for zero in ("zero2", "zero3"):
        out = tmp_path / zero
        argv = ["-m", "dspark_ds.cli", "train", "--config", "dspark_ds/recipes/tiny_cpu.yaml"]
        argv += ["--target.path", path, "--target.layer_ids", "[-1, 0, 2]"]
        argv += ["--output_dir", str(out), "--train.max_steps", "3"]
        argv += ["--train.synthetic_samples", "32", "--train.progress_bar", "false"]
        argv += ["--tracking.enabled", "false", "--deepspeed.config", zero]
        check(python(argv, timeout_s=600))
        log = (out / "tiny_cpu" / "train_log.jsonl").read_text().splitlines()
        losses[zero] = [json.loads(line)["loss"] for line in log]
        written = json.loads((out / "tiny_cpu" / "export" / "config.json").read_text())
        assert written["target_model_type"] == family
    assert len(losses["zero2"]) == 3 and all(math.isfinite(x) for x in losses["zero2"])
    torch.testing.assert_close(losses["zero3"], losses["zero2"], rtol=1e-3, atol=1e-4)
    if family in OFFLINE:
        assert math.isfinite(_train_offline(path, tmp_path))
    target = load_target(TargetConfig(path=path, layer_ids=[0], dtype="float32"), "cpu").model
    drafter = load_draft_model(tmp_path / "zero2" / "tiny_cpu" / "export")
    ids = torch.randint(4, 300, (1, 10), generator=torch.Generator().manual_seed(1))
    got, _ = speculative_generate(target, drafter, ids, max_new_tokens=12)
    assert got.tolist() == greedy_without_cache(target, ids, 12, set()).tolist()


def test_deepseek_v4s_own_drafter_trains_under_zero3_and_its_export_decodes(tmp_path):
    """`model.backbone: target` on DeepSeek-V4: the V4 draft layers (experts partitioned under
    ZeRO-3, initialised module by module as the whole drafter is) train to the ZeRO-2 losses;
    the export (vLLM's V4 DSpark layout, no embedding / lm_head) loads with the target's and
    decodes losslessly."""
    path = build_tiny_moe_target(tmp_path / "v4", "deepseek_v4")
    losses = {}
    for zero in ("zero2", "zero3"):
        argv = ["-m", "dspark_ds.cli", "train", "--config", "dspark_ds/recipes/tiny_cpu.yaml"]
        argv += ["--target.path", path, "--target.layer_ids", "[-1, 0, 2]"]
        argv += ["--output_dir", str(tmp_path / zero), "--train.max_steps", "3"]
        argv += ["--train.synthetic_samples", "32", "--train.progress_bar", "false"]
        argv += ["--tracking.enabled", "false", "--deepspeed.config", zero]
        argv += ["--model.backbone", "target"]
        check(python(argv, timeout_s=600))
        log = (tmp_path / zero / "tiny_cpu" / "train_log.jsonl").read_text().splitlines()
        losses[zero] = [json.loads(line)["loss"] for line in log]
    assert len(losses["zero2"]) == 3 and all(math.isfinite(x) for x in losses["zero2"])
    torch.testing.assert_close(losses["zero3"], losses["zero2"], rtol=1e-3, atol=1e-4)
    export = tmp_path / "zero3" / "tiny_cpu" / "export"
    assert json.loads((export / "config.json").read_text())["architectures"] == ["DSparkDraftModel"]
    target = load_target(TargetConfig(path=path, layer_ids=[0], dtype="float32"), "cpu").model
    shared = (target.model.embed_tokens.weight, target.lm_head.weight)
    drafter = load_draft_model(export, shared_weights=shared)
    ids = torch.randint(4, 300, (1, 10), generator=torch.Generator().manual_seed(1))
    got, _ = speculative_generate(target, drafter, ids, max_new_tokens=12)
    assert got.tolist() == greedy_without_cache(target, ids, 12, set()).tolist()
