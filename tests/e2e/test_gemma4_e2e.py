"""A tiny random Gemma4 target through the whole pipeline: offline cache -> 2-rank ZeRO-3
training -> export -> lossless greedy speculative decoding.

The target is a `Gemma4ForConditionalGeneration` (the multimodal wrapper, text only) with
sliding and full-attention layers of different head shapes, k_eq_v attention and logit
softcapping, so every Gemma4-specific path of cache, trainer, drafter and decoder runs.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from helpers.dist import GUARDED, check, guard_stats, guarded_env, torchrun
from helpers.gemma4 import greedy_without_cache, tiny_gemma4_text
from helpers.tiny_models import build_tiny_tokenizer, write_chat_jsonl

LAYER_IDS = [0, 1, 2]  # of 4 target layers; the last one is refused at evaluation


def build_tiny_gemma4_target(out_dir: Path, seed: int = 0) -> Path:
    """A random Gemma4 checkpoint + tokenizer saved like a hub download (config.json wraps
    `text_config`)."""
    from transformers import Gemma4Config, Gemma4ForConditionalGeneration

    tok = build_tiny_tokenizer(out_dir, template="gemma")
    text = tiny_gemma4_text(
        vocab_size=len(tok),
        final_logit_softcapping=30.0,
        max_position_embeddings=512,
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
        bos_token_id=tok.convert_tokens_to_ids("<bos>"),
    )  # sliding window 8, shorter than the prompts: the decoder's cache rollback matters
    torch.manual_seed(seed)
    model = Gemma4ForConditionalGeneration(Gemma4Config(text_config=text)).eval()
    model.save_pretrained(out_dir)
    return out_dir


@pytest.mark.slow
@pytest.mark.distributed
def test_tiny_gemma4_target_end_to_end(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dspark_ds.cli import main as cli_main
    from dspark_ds.drafters import load_draft_model
    from dspark_ds.drafters.dspark.gemma4 import Gemma4DSparkModel
    from dspark_ds.eval.decoding import speculative_generate

    target_dir = build_tiny_gemma4_target(tmp_path / "target")
    data = write_chat_jsonl(tmp_path / "train.jsonl", 16)
    tok = AutoTokenizer.from_pretrained(target_dir)
    mask_id = tok.convert_tokens_to_ids("<|mask|>")
    common_target = [
        f"--target.path={target_dir}",
        f"--target.layer_ids={json.dumps(LAYER_IDS)}",
        "--target.dtype=float32",
    ]

    # 1. offline cache (one process)
    cache = tmp_path / "cache"
    rc = cli_main(
        [
            "build-cache",
            f"--data.paths=[{data}]",
            f"--data.cache_dir={cache}",
            "--data.max_length=96",
            "--data.num_workers=0",
            "--data.samples_per_shard=8",
            "--target.device=cpu",
            "--batch_size=4",
            *common_target,
        ]
    )
    assert rc == 0 and (cache / "manifest.json").exists()

    # 2. training: 2 gloo ranks, ZeRO-3, features from the cache, under the device guard
    run = check(
        torchrun(
            [
                *GUARDED,
                "-m",
                "dspark_ds.cli",
                "train",
                "--name=g4",
                f"--output_dir={tmp_path / 'runs'}",
                "--data.mode=offline",
                f"--data.cache_dir={cache}",
                "--data.num_workers=0",
                "--data.max_length=96",
                "--model.num_draft_layers=2",
                "--model.block_size=4",
                "--model.num_anchors=8",
                "--model.markov_rank=8",
                f"--model.mask_token_id={mask_id}",
                "--train.global_batch_size=4",
                "--train.num_epochs=2",
                "--train.lr=3e-3",
                "--train.precision=fp32",
                "--train.progress_bar=false",
                "--deepspeed.config=zero3",
                "--tracking.enabled=false",
                *common_target,
            ],
            env=guarded_env(tmp_path / "guard"),
        )
    )
    assert [s["policed"] > 0 for s in guard_stats(tmp_path / "guard")] == [True, True]
    run_dir = tmp_path / "runs" / "g4"
    log = [json.loads(line) for line in (run_dir / "train_log.jsonl").read_text().splitlines()]
    losses = [row["loss"] for row in log if "loss" in row]
    assert len(losses) == 8 and all(math.isfinite(x) for x in losses), run.stdout[-2000:]

    # 3. the exported drafter: Gemma4 interchange layout (docs/checkpoint-format.md)
    export = run_dir / "export"
    written = json.loads((export / "config.json").read_text())
    assert written["architectures"] == ["Gemma4DSparkModel"]
    assert written["target_model_type"] == "gemma4"
    assert written["target_text_model_type"] == "gemma4_text"
    assert (written["global_head_dim"], written["num_global_key_value_heads"]) == (16, 1)
    assert written["target_layer_ids"] == LAYER_IDS and written["num_target_layers"] == 4
    drafter = load_draft_model(export)
    assert isinstance(drafter, Gemma4DSparkModel)
    # `dspark-ds export` of the ZeRO-3 checkpoint (tied target: one embedding tensor serves as
    # embed_tokens and lm_head) gives the same drafter as the end-of-run export
    assert cli_main(["export", f"--checkpoint={run_dir}", f"--output_dir={tmp_path / 'x'}"]) == 0
    offline = load_draft_model(tmp_path / "x").state_dict()
    for name, tensor in drafter.state_dict().items():
        assert torch.equal(offline[name], tensor), name
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    # the drafter shares the target's (tied) embedding and lm_head
    embed = target.get_input_embeddings().weight
    assert torch.equal(drafter.embed_tokens.weight, embed)
    assert torch.equal(drafter.lm_head.weight, target.get_output_embeddings().weight)

    # 4. lossless greedy decoding: speculative output == plain greedy, token for token
    stops = {int(tok.eos_token_id)}
    rounds = 0
    for k, prompt in enumerate(["Hi!", "What is 2 + 3?", "Write add(a, b) in python."]):
        ids = tok.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, return_tensors="pt"
        )
        ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
        assert ids.shape[1] > 8  # past the sliding window
        want = greedy_without_cache(target, ids, 20, stops)
        got, stats = speculative_generate(
            target, drafter, ids, max_new_tokens=20, temperature=0.0, stop_token_ids=list(stops)
        )
        assert got.tolist() == want.tolist(), f"prompt {k}: speculative != greedy"
        assert stats.new_tokens == want.shape[1] - ids.shape[1]
        rounds += stats.rounds
    assert rounds > 0

    # 5. the `eval` subcommand on the same pair (greedy; tracking off)
    out_dir = tmp_path / "eval"
    rc = cli_main(
        [
            "eval",
            f"--target.path={target_dir}",
            f"--drafter={export}",
            "--benchmarks=[gsm8k]",
            "--max_samples=1",
            "--max_new_tokens=16",
            "--temperature=0",
            "--dtype=float32",
            "--device=cpu",
            f"--output_dir={tmp_path}",
            "--name=eval",
            "--calibration.fit_sts=false",
            "--tracking.enabled=false",
        ]
    )
    assert rc == 0
    results = json.loads((out_dir / "results.json").read_text())
    (row,) = results["benchmarks"]
    assert row["benchmark"] == "gsm8k" and row["new_tokens"] == 16
    # τ is what the rounds committed: every new token but the prefill's
    assert row["tau"] == pytest.approx((row["new_tokens"] - 1) / row["rounds"])
