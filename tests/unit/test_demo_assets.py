"""Demo assets: synthetic corpus, BPE tokenizer + chat template, cached tiny Qwen3 target."""

from __future__ import annotations

import json
import math
from collections import defaultdict

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen3ForCausalLM

from dspark_ds.data.synthetic import make_corpus, write_corpus
from dspark_ds.demo.target import (
    REPORT_FILE,
    DemoTargetConfig,
    assistant_entropy,
    build_model_config,
    ensure_demo_target,
)
from dspark_ds.demo.tokenizer import IM_END, IM_START, MASK_TOKEN, PAD_TOKEN, train_tokenizer

from helpers.tiny_models import TINY_DEMO_TARGET_FIELDS


@pytest.fixture(scope="module")
def corpus():
    return make_corpus(seed=0, num_train=300, num_heldout=20)


@pytest.fixture(scope="module")
def tokenizer(corpus):
    return train_tokenizer(corpus[0], vocab_size=400)


def _tiny_cfg(tmp_path, **overrides) -> DemoTargetConfig:
    """The demo smoke's tiny target (2 layers, 25 steps, 16 probe rows here)."""
    fields = {**dict(num_hidden_layers=2, max_steps=25, num_probe_rows=16), **overrides}
    return DemoTargetConfig(
        **{**TINY_DEMO_TARGET_FIELDS, "cache_dir": str(tmp_path / "cache"), **fields}
    )


# ---------------------------------------------------------------- corpus


def test_corpus_is_a_pure_function_of_the_seed(corpus):
    train, heldout = corpus
    assert (train, heldout) == make_corpus(seed=0, num_train=300, num_heldout=20)
    assert make_corpus(seed=1, num_train=300, num_heldout=20)[0] != train
    # Row i does not depend on the corpus size: a larger corpus extends a smaller one.
    small_train, small_heldout = make_corpus(seed=0, num_train=50, num_heldout=5)
    assert small_train == train[:50] and small_heldout == heldout[:5]


def test_corpus_rows_are_chat_conversations(corpus):
    train, heldout = corpus
    for row in train:
        roles = [m["role"] for m in row["messages"]]
        assert roles in (["user", "assistant"], ["system", "user", "assistant"])
        assert all(m["content"] for m in row["messages"])
    for row in heldout:
        assert [m["role"] for m in row["messages"]][-1] == "user"
        assert "assistant" not in [m["role"] for m in row["messages"]]


def test_corpus_branches_same_prompt_different_answers():
    # T = 1 must matter: identical prompts get different answers, but not unboundedly many.
    train, _ = make_corpus(seed=0, num_train=2000, num_heldout=0)
    answers = defaultdict(set)
    for row in train:
        prompt = tuple(m["content"] for m in row["messages"][:-1])
        answers[prompt].add(row["messages"][-1]["content"])
    repeated = [a for a in answers.values() if len(a) > 1]
    assert len(repeated) > 50
    assert len(answers) < len(train)  # prompts recur: the mapping is learnable


def test_write_corpus_roundtrips_jsonl(tmp_path):
    train_path, heldout_path = write_corpus(tmp_path / "c", seed=3, num_train=12, num_heldout=4)
    train, heldout = make_corpus(seed=3, num_train=12, num_heldout=4)
    assert [json.loads(line) for line in train_path.read_text().splitlines()] == train
    assert [json.loads(line) for line in heldout_path.read_text().splitlines()] == heldout


def test_make_corpus_rejects_bad_sizes():
    with pytest.raises(ValueError, match="num_train"):
        make_corpus(seed=0, num_train=0, num_heldout=1)


# ---------------------------------------------------------------- tokenizer


def test_tokenizer_special_tokens_and_round_trip(corpus, tokenizer):
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in (PAD_TOKEN, IM_START, IM_END, MASK_TOKEN)}
    assert ids == {PAD_TOKEN: 0, IM_START: 1, IM_END: 2, MASK_TOKEN: 3}
    assert tokenizer.pad_token_id == 0 and tokenizer.eos_token_id == 2
    assert tokenizer.mask_token_id == 3
    assert len(tokenizer) == 400
    texts = [m["content"] for row in corpus[0][:100] for m in row["messages"]]
    texts.append("unseen bytes: ü → 42\t{}")
    for text in texts:
        assert tokenizer.decode(tokenizer.encode(text)) == text


def test_tokenizer_keeps_words_apart(tokenizer):
    # Multi-word names must stay several tokens: the branch structure lives there.
    assert len(tokenizer.encode(" Buenos Aires")) >= 2


def test_chat_template_renders_chatml(corpus, tokenizer):
    row = next(r for r in corpus[0] if r["messages"][0]["role"] == "system")
    text = tokenizer.apply_chat_template(row["messages"], tokenize=False)
    expected = "".join(
        f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in row["messages"]
    )
    assert text == expected
    prompt = tokenizer.apply_chat_template(
        corpus[1][0]["messages"], tokenize=False, add_generation_prompt=True
    )
    assert prompt.endswith("<|im_end|>\n<|im_start|>assistant\n")


def test_assistant_mask_covers_exactly_the_answer(corpus, tokenizer):
    for row in corpus[0][:50]:
        enc = tokenizer.apply_chat_template(
            row["messages"], tokenize=True, return_dict=True, return_assistant_tokens_mask=True
        )
        ids, mask = enc["input_ids"], enc["assistant_masks"]
        assert len(ids) == len(mask) and sum(mask) > 0
        masked = [i for i, m in zip(ids, mask) if m]
        unmasked = [i for i, m in zip(ids, mask) if not m]
        assert tokenizer.decode(masked) == row["messages"][-1]["content"] + IM_END
        for m in row["messages"][:-1]:  # prompt text sits entirely outside the mask
            assert m["content"] in tokenizer.decode(unmasked)
        # The mask is one contiguous span ending on <|im_end|>.
        first, last = mask.index(1), len(mask) - 1 - mask[::-1].index(1)
        assert all(mask[first : last + 1]) and ids[last] == tokenizer.eos_token_id


def test_tokenizer_save_load_keeps_template_and_mask(corpus, tokenizer, tmp_path):
    tokenizer.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    row = corpus[0][0]
    kwargs = dict(tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    a = tokenizer.apply_chat_template(row["messages"], **kwargs)
    b = loaded.apply_chat_template(row["messages"], **kwargs)
    assert a["input_ids"] == b["input_ids"] and a["assistant_masks"] == b["assistant_masks"]
    assert loaded.mask_token_id == 3 and loaded.pad_token_id == 0


def test_tokenizer_rejects_tiny_vocab(corpus):
    with pytest.raises(ValueError, match="vocab_size"):
        train_tokenizer(corpus[0], vocab_size=100)


# ---------------------------------------------------------------- target


def test_target_trains_saves_loads_and_is_cached(tmp_path):
    cfg = _tiny_cfg(tmp_path)
    first = ensure_demo_target(cfg, progress=False)
    assert not first.from_cache
    report = first.report
    assert report["final_loss"] < report["initial_loss"] - 1.0, report["loss_curve"]
    assert (first.path / REPORT_FILE).is_file()
    assert str(first.path).startswith(str(tmp_path / "cache"))

    model = AutoModelForCausalLM.from_pretrained(first.path)
    tok = AutoTokenizer.from_pretrained(first.path)
    assert model.config.model_type == "qwen3"
    assert model.config.vocab_size == len(tok) == 320
    assert model.config.hidden_size == 32 and model.config.num_hidden_layers == 2
    assert model.config.eos_token_id == tok.eos_token_id
    # The saved weights are the trained ones: they reproduce the reported probe loss.
    rows, _ = make_corpus(cfg.seed + 1, 16, 0)
    probe = assistant_entropy(model, tok, rows)
    assert probe["assistant_loss"] == pytest.approx(report["probe"]["assistant_loss"], rel=1e-4)
    assert 0.0 < probe["assistant_entropy_nats"]

    weights = first.path / "model.safetensors"
    mtime = weights.stat().st_mtime_ns
    second = ensure_demo_target(cfg, progress=False)
    assert second.from_cache and second.path == first.path
    assert weights.stat().st_mtime_ns == mtime  # not retrained, not rewritten
    assert second.report["final_loss"] == report["final_loss"]
    assert not list(first.path.parent.glob("*.tmp-*"))


def test_target_cache_key_and_env_override(tmp_path, monkeypatch):
    monkeypatch.setenv("DSPARK_DS_CACHE", str(tmp_path / "env"))
    cfg = _tiny_cfg(tmp_path, cache_dir=None, max_steps=2)
    got = ensure_demo_target(cfg, progress=False)
    assert str(got.path).startswith(str(tmp_path / "env"))
    # Training settings are in the key; threads are not.
    other = ensure_demo_target(_tiny_cfg(tmp_path, cache_dir=None, max_steps=3), progress=False)
    assert other.path != got.path and not other.from_cache
    same = ensure_demo_target(
        _tiny_cfg(tmp_path, cache_dir=None, max_steps=2, num_threads=2), progress=False
    )
    assert same.path == got.path and same.from_cache
    # force=True retrains in place; nothing half-written or stale is left next to it.
    forced = ensure_demo_target(
        _tiny_cfg(tmp_path, cache_dir=None, max_steps=2), force=True, progress=False
    )
    assert forced.path == got.path and not forced.from_cache
    assert (forced.path / REPORT_FILE).is_file()
    assert sorted(p.name for p in got.path.parent.iterdir()) == sorted(
        [got.path.name, other.path.name]
    )


@pytest.mark.parametrize(
    ("field", "value"),
    [("hidden_size", 30), ("num_key_value_heads", 3), ("max_steps", 0), ("lr", 0.0)],
)
def test_target_config_rejects_bad_values(field, value):
    with pytest.raises(ValueError, match=field):
        DemoTargetConfig(**{field: value})


def test_entropy_of_a_uniform_model_is_log_vocab(tmp_path, tokenizer, corpus):
    # Reference value for the branchiness metric: zero logits give log(V) nats everywhere.
    model = Qwen3ForCausalLM(build_model_config(_tiny_cfg(tmp_path), tokenizer))
    with torch.no_grad():
        model.lm_head.weight.zero_()
    uniform = assistant_entropy(model, tokenizer, corpus[0][:4])
    assert uniform["assistant_entropy_nats"] == pytest.approx(math.log(len(tokenizer)), rel=1e-5)
    assert uniform["assistant_loss"] == pytest.approx(math.log(len(tokenizer)), rel=1e-5)
    assert uniform["branch_point_fraction"] == 1.0
