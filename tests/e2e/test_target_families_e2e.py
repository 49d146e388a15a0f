"""Targets of other families through the whole pipeline, on 2 ranks, and ZeRO-3 loading.

- every family of `helpers.tiny_models.FAMILIES` and of `HYBRID_FAMILIES` (Qwen3.5, Qwen3.5-MoE,
  Qwen3-Next: Gated DeltaNet layers; Granite-4.0-H, Falcon-H1: Mamba2): an offline cache, then ONE torchrun launch
  (`train-many`) training each family online under ZeRO-3 (the target loaded partition by
  partition, `engine.target.load_partitioned_target`) and offline under ZeRO-2, 3 steps each,
  with the end-of-run export; then each export decodes losslessly (greedy) against its target;
- T = 1: speculative sampling has each family's exact target distribution (chi-square, tiny
  vocabulary, random drafters of both kinds);
- ZeRO-3 loading on 2 ranks gives the very features a whole `from_pretrained` gives (every
  family, every hybrid family (MoE experts included), Qwen3, Gemma4; fp32 and bf16; parameters swapped to NVMe), and a rank's host memory grows by at most 0.6x the
  target's size while loading a 176 MB target.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from dspark_ds.eval.decoding import speculative_generate

from helpers.dist import REPO, check, run_distributed, torchrun
from helpers.evaluation import chi_square_pvalue, exact_continuation_probs
from helpers.gemma4 import greedy_without_cache
from helpers.tiny_models import (
    FAMILIES,
    HYBRID_FAMILIES,
    build_tiny_family_target,
    build_tiny_hybrid_target,
    build_tiny_target,
    family_config,
    write_chat_jsonl,
)

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

# the KV-cache families and every hybrid (Gated DeltaNet or Mamba2 layers, MoE ones included:
# their recurrent state rolled back in the exports' decoding)
TRAINED = [*FAMILIES, *HYBRID_FAMILIES]
LAYER_IDS = [-1, 0, 2]  # of 4 target layers (the last one is refused at evaluation)
STEPS = 3
RECIPE = str(REPO / "dspark_ds" / "recipes" / "tiny_cpu.yaml")


# ---- train (online ZeRO-3, offline ZeRO-2), export, decode -----------------------------------


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from dspark_ds.cli import main as cli_main

    root = tmp_path_factory.mktemp("family_runs")
    data = write_chat_jsonl(root / "train.jsonl", 16)
    targets, argvs = {}, []
    for family in TRAINED:
        build = build_tiny_hybrid_target if family in HYBRID_FAMILIES else build_tiny_family_target
        target = targets[family] = build(root / family, family)
        layer_ids = f"--target.layer_ids={json.dumps(LAYER_IDS)}"
        common = ["--config", RECIPE, f"--target.path={target}", layer_ids]
        common += [f"--output_dir={root / 'runs'}", f"--train.max_steps={STEPS}"]
        common += ["--train.progress_bar=false", "--tracking.enabled=false"]
        cache = root / family / "cache"
        cache_argv = ["build-cache", f"--data.paths=[{data}]", f"--data.cache_dir={cache}"]
        cache_argv += ["--data.max_length=64", "--data.num_workers=0", "--data.samples_per_shard=8"]
        cache_argv += [f"--target.path={target}", layer_ids, "--target.dtype=float32"]
        cache_argv += ["--target.device=cpu", "--batch_size=4"]
        assert cli_main(cache_argv) == 0
        argvs.append([*common, f"--name={family}_online", "--deepspeed.config=zero3"])
        offline = [f"--name={family}_offline", "--deepspeed.config=zero2", "--data.mode=offline"]
        offline += [f"--data.cache_dir={cache}", "--train.synthetic_samples=0"]
        argvs.append([*common, *offline])
    spec, result = root / "spec.json", root / "result.json"
    spec.write_text(json.dumps({"runs": argvs, "result_file": str(result)}))
    check(torchrun([str(REPO / "tests" / "helpers" / "dist.py"), "train-many", str(spec)]))
    return targets, json.loads(result.read_text())


@pytest.mark.parametrize("family", TRAINED)
def test_family_trains_online_and_offline_exports_and_decodes_losslessly(family, runs):
    from dspark_ds.drafters import load_draft_model

    targets, results = runs
    target = AutoModelForCausalLM.from_pretrained(targets[family], dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(targets[family])
    online, offline = results[f"{family}_online"], results[f"{family}_offline"]
    for res in (online, offline):
        losses = list(res["losses"].values())
        assert len(losses) == STEPS and all(math.isfinite(x) for x in losses)
    # online under ZeRO-3: the drafter holds the target's own embedding / lm_head, and each rank
    # stores half of the target
    for facts in online["target"]:
        assert facts["shares"] and facts["frozen"]
        assert facts["local_numel"] <= facts["full_numel"] // 2 + 4096
    assert offline["target"] == [None, None]
    prompts = ["Hi!", "Write add(a, b) in python."]
    for res in (online, offline):
        export = Path(res["export_dir"])
        written = json.loads((export / "config.json").read_text())
        assert written["architectures"] == ["Qwen3DSparkModel"]
        assert written["model_type"] == "qwen3" and written["target_model_type"] == family
        drafter = load_draft_model(export)
        assert torch.equal(drafter.lm_head.weight, target.get_output_embeddings().weight)
        for text in prompts:
            ids = tok.apply_chat_template(
                [{"role": "user", "content": text}],
                add_generation_prompt=True,
                return_tensors="pt",
                return_dict=True,
            )["input_ids"]
            want = greedy_without_cache(target, ids, 12, {int(tok.eos_token_id)})
            got, stats = speculative_generate(
                target,
                drafter,
                ids,
                max_new_tokens=12,
                temperature=0.0,
                stop_token_ids=[int(tok.eos_token_id)],
            )
            assert got.tolist() == want.tolist(), f"{family}: {text!r}"
            assert stats.rounds >= 1


# ---- T = 1 ------------------------------------------------------------------------------------

NUM_NEW = 4
NUM_SAMPLES = 300


# each family with one drafter kind, the kinds taking turns (both kinds verify through the same
# code; what a family changes is its target: its logits, its cache's rollback)
SAMPLED = [(family, ("dspark", "eagle3")[i % 2]) for i, family in enumerate(FAMILIES)]


@pytest.mark.parametrize("family,kind", SAMPLED)
def test_sampled_speculative_decoding_has_the_family_targets_distribution(family, kind):
    """x1 comes from the prefill, (x2, x3) and x4 from verification rounds."""
    from dspark_ds.drafters.dspark.build import build_draft_config
    from dspark_ds.drafters.eagle3.build import build_eagle3_config
    from dspark_ds.drafters.io import build_draft_model

    torch.manual_seed(0)
    target = AutoModelForCausalLM.from_config(
        family_config(family, 8, tie_word_embeddings=False), dtype=torch.float32
    ).eval()
    with torch.no_grad():
        target.get_output_embeddings().weight.mul_(4.0)  # sharper next-token distributions
    prompt = torch.tensor([[1, 2, 3]])
    exact = exact_continuation_probs(target, prompt, NUM_NEW)
    if kind == "dspark":
        cfg = build_draft_config(
            target.config,
            target_layer_ids=[0],
            mask_token_id=7,
            block_size=3,
            markov_rank=4,
            num_draft_layers=1,
        )
    else:
        cfg = build_eagle3_config(target.config, target_layer_ids=[0], ttt_length=2)
    torch.manual_seed(1)
    drafter = build_draft_model(cfg)
    drafter.initialize_embeddings_and_head(
        target.get_input_embeddings().weight, target.get_output_embeddings().weight
    )
    counts, accepted = torch.zeros([8] * NUM_NEW), 0
    for seed in range(NUM_SAMPLES):
        out, stats = speculative_generate(
            target,
            drafter.eval(),
            prompt,
            max_new_tokens=NUM_NEW,
            temperature=1.0,
            generator=torch.Generator().manual_seed(seed),
        )
        counts[tuple(out[0, 3:].tolist())] += 1
        accepted += sum(stats.accepted_per_round)
    assert accepted > 0.1 * NUM_SAMPLES, (kind, accepted)  # both verifier outcomes happen
    pvalues = [
        chi_square_pvalue(counts.sum(dim=(0, 3)), exact.sum(dim=(0, 3))),
        chi_square_pvalue(counts.sum(dim=(0, 1, 2)), exact.sum(dim=(0, 1, 2))),
    ]
    assert min(pvalues) > 1e-3, (kind, pvalues)


# ---- ZeRO-3 loading: exact, and no rank holds the whole target --------------------------------

DS_CONFIG = {
    "train_micro_batch_size_per_gpu": 1,
    "gradient_accumulation_steps": 1,
    "train_batch_size": 2,
    "zero_optimization": {"stage": 3},
}


def _nvme_config(swap_dir: str) -> dict:
    """DS_CONFIG with the parameters swapped to NVMe (a partition of 1 MiB or more is)."""
    nvme = {
        "device": "nvme",
        "nvme_path": swap_dir,
        "pin_memory": False,
        "buffer_count": 5,
        "buffer_size": 1e6,
    }
    aio = {
        "block_size": 1048576,
        "queue_depth": 8,
        "thread_count": 1,
        "single_submit": False,
        "overlap_events": True,
    }
    return {**DS_CONFIG, "zero_optimization": {"stage": 3, "offload_param": nvme}, "aio": aio}


def _partitioned_equals_whole(rank, world, paths: dict[str, str], bf16: list[str], swap: str):
    from deepspeed.runtime.zero.offload_config import OffloadDeviceEnum

    from dspark_ds.engine.target import load_partitioned_target, shard_target
    from dspark_ds.target import TargetConfig, load_target

    ids = torch.randint(4, 300, (2, 12), generator=torch.Generator().manual_seed(0))
    for name, path in paths.items():
        for dtype in ["float32", "bfloat16"] if name in bf16 else ["float32"]:
            cfg = TargetConfig(path=path, layer_ids=LAYER_IDS, dtype=dtype, device="cpu")
            ds = {**DS_CONFIG, "bf16": {"enabled": dtype == "bfloat16"}}
            if name == "llama_nvme":  # the embedding's partitions go through the NVMe swapper
                ds = _nvme_config(f"{swap}/{rank}")
            target = load_partitioned_target(cfg, ds)
            params = list(target.parameters())
            assert all(p.data.numel() == 0 for p in params), name  # nothing gathered
            full = sum(p.ds_numel for p in params)
            assert sum(p.ds_tensor.numel() for p in params) <= full // 2 + len(params), name
            locations = [getattr(p.ds_tensor, "final_location", None) for p in params]
            assert (OffloadDeviceEnum.nvme in locations) == (name == "llama_nvme"), name
            shard_target(target, ds)
            target.check_head()
            hidden, last = target(ids)
            whole_hidden, whole_last = load_target(cfg, "cpu")(ids)
            assert torch.equal(hidden, whole_hidden), (name, dtype)
            assert torch.equal(last, whole_last), (name, dtype)


def test_zero3_target_loaded_partition_by_partition_equals_the_whole_load(tmp_path):
    from helpers.gemma4 import tiny_gemma4_target_config
    from helpers.tiny_models import build_tiny_tokenizer

    paths = {f: build_tiny_family_target(tmp_path / f, f) for f in FAMILIES}
    paths.update({f: build_tiny_hybrid_target(tmp_path / f, f) for f in HYBRID_FAMILIES})
    paths["qwen3"] = build_tiny_target(tmp_path / "qwen3", tie_word_embeddings=True)
    tok = build_tiny_tokenizer(tmp_path / "gemma4")
    torch.manual_seed(0)
    gemma4 = AutoModelForCausalLM.from_config(
        tiny_gemma4_target_config(vocab_size=len(tok)), dtype=torch.float32
    )
    with torch.no_grad():  # a persistent buffer the checkpoint must restore
        for i, layer in enumerate(gemma4.model.language_model.layers):
            layer.layer_scalar.fill_(0.5 + 0.25 * i)
    gemma4.save_pretrained(tmp_path / "gemma4")
    paths["gemma4"] = str(tmp_path / "gemma4")
    # a 2 MiB embedding (8192 x 64 fp32): its 1 MiB partitions are swapped to NVMe
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(
        family_config("llama", 8192, hidden_size=64, head_dim=16)
    ).save_pretrained(tmp_path / "llama_nvme")
    paths["llama_nvme"] = str(tmp_path / "llama_nvme")
    run_distributed(
        _partitioned_equals_whole,
        2,
        args=(paths, ["llama", "qwen3_moe", "qwen3"], str(tmp_path / "swap")),
    )


def _rss() -> dict[str, int]:
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            out[key] = int(value.split()[0]) * 1024
    return out


def _host_memory_of_a_load(rank, world, warmup: str, path: str, out_file: str):
    """Peak RSS growth of loading `path` partitioned (and its target engine), after loading
    `warmup` the same way (imports, DeepSpeed's first-use set-up)."""
    from dspark_ds.engine.runtime import join_deepspeed_comm
    from dspark_ds.engine.target import load_partitioned_target, shard_target
    from dspark_ds.target import TargetConfig

    join_deepspeed_comm()
    growth = []
    for p in (warmup, path):
        cfg = TargetConfig(path=p, layer_ids=[1], dtype="float32", device="cpu")
        before = _rss()["VmRSS"]
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
        target = load_partitioned_target(cfg, DS_CONFIG)
        shard_target(target, DS_CONFIG)
        growth.append(_rss()["VmHWM"] - before)
    Path(f"{out_file}.{rank}").write_text(json.dumps(growth[-1]))


def test_zero3_loading_holds_at_most_0_6x_of_the_target_per_rank(tmp_path, monkeypatch):
    """A 176 MB fp32 Llama on 2 ranks: each rank's peak RSS growth while the target is built,
    read and given its engine. Measured with glibc's mmap threshold pinned at 128 KiB, so freed
    tensors go back to the system instead of staying in the heap as RSS (the allocator's
    policy, not what the code holds)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=2048,
        hidden_size=384,
        intermediate_size=1024,
        num_hidden_layers=24,
        num_attention_heads=6,
        num_key_value_heads=6,
        max_position_embeddings=256,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    size = sum(p.numel() * p.element_size() for p in model.parameters())
    largest = max(p.numel() * p.element_size() for p in model.parameters())
    assert size >= 100 * 2**20 and largest <= 0.03 * size
    model.save_pretrained(tmp_path / "big")
    del model
    small = build_tiny_family_target(tmp_path / "small", "llama")
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", str(128 * 1024))
    out = tmp_path / "growth"
    run_distributed(_host_memory_of_a_load, 2, args=(small, str(tmp_path / "big"), str(out)))
    growth = [json.loads(Path(f"{out}.{r}").read_text()) for r in range(2)]
    print(
        f"[memory] target {size / 2**20:.0f} MiB, peak growth per rank "
        f"{[f'{g / 2**20:.0f} MiB ({g / size:.2f}x)' for g in growth]}"
    )
    assert all(g <= 0.6 * size for g in growth), growth
