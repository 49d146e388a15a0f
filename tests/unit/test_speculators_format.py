"""The speculators checkpoint format on our side (drafters/speculators_format.py): what
`dspark-ds export --format speculators` writes, read back by every reader of a drafter directory
(eval, model.init_from, serve-check) with the same decoding as the native export, and each
speculators option without a counterpart here refused by name. speculators' own loader and
forward on these directories: tests/e2e/test_speculators_interop.py."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoConfig, Qwen3ForCausalLM

from dspark_ds.drafters import build_draft_config, build_draft_model, load_draft_model
from dspark_ds.drafters.eagle3.build import build_eagle3_config
from dspark_ds.drafters.io import (
    check_init_state,
    config_from_dict,
    read_init_state,
    read_state_dict,
    save_draft_model,
    save_speculators_model,
)
from dspark_ds.errors import ConfigError
from dspark_ds.eval.decoding import speculative_generate
from dspark_ds.serve.check import describe
from dspark_ds.train.export import export_checkpoint

from helpers.evaluation import cpu_eval, decoding_prompts, record_proposals
from helpers.gemma4 import tiny_gemma4_target_config
from helpers.speculators_env import make_drafter

# the top-level keys of the config.json speculators 0.9.0 saves (`save_pretrained` of its
# DSparkDraftModel, DFlashDraftModel and Eagle3DraftModel; tests/e2e checks them against a
# directory speculators writes)
_BOOKKEEPING = {
    "architectures",
    "auto_map",
    "dtype",
    "speculators_config",
    "speculators_model_type",
    "speculators_version",
    "target_hidden_size",
    "tie_word_embeddings",
    "transformer_layer_config",
    "transformers_version",
    "draft_vocab_size",
}
_DFLASH = {
    "aux_hidden_state_layer_ids",
    "block_size",
    "mask_token_id",
    "sample_from_anchor",
    "sliding_window_non_causal",
}
_HEADS = {
    "markov_rank",
    "markov_head_type",
    "enable_confidence_head",
    "confidence_head_with_markov",
}
_EAGLE3 = {
    "eagle_aux_hidden_state_layer_ids",
    "embed_requires_grad",
    "fc_norm",
    "norm_before_fc",
    "norm_before_residual",
    "norm_output",
}
SPECULATORS_KEYS = {
    "dspark": _BOOKKEEPING | _DFLASH | _HEADS,
    "dflash": _BOOKKEEPING | _DFLASH,
    "eagle3": _BOOKKEEPING | _EAGLE3,
}
SHARED = {"embed_tokens.weight", "lm_head.weight"}


DRAFTERS = ("dspark", "dspark_gated", "dspark_rnn", "dflash", "dflash_anchor", "eagle3")


@pytest.fixture(scope="module")
def target(tiny_target):
    return Qwen3ForCausalLM.from_pretrained(tiny_target, dtype=torch.float32).eval()


def _shared(target):
    return target.model.embed_tokens.weight, target.lm_head.weight


@pytest.mark.parametrize("name", DRAFTERS)
def test_the_export_is_speculators_layout_and_reads_back_exactly(
    name, target, tiny_target, tmp_path
):
    model = make_drafter(name, target)
    out = save_speculators_model(model, tmp_path / "spec", target_path=tiny_target)
    data = json.loads((out / "config.json").read_text())
    model_type = data["speculators_model_type"]
    assert model_type == {"dflash_anchor": "dflash", "dspark_gated": "dspark"}.get(
        name, name.split("_")[0]
    )
    assert set(data) == SPECULATORS_KEYS[model_type]
    assert data["speculators_config"]["algorithm"] == model_type
    assert data["speculators_config"]["verifier"]["name_or_path"] == str(tiny_target)
    assert data["transformer_layer_config"]["num_hidden_layers"] == len(model.layers)
    ids = data.get("aux_hidden_state_layer_ids") or data["eagle_aux_hidden_state_layer_ids"]
    assert ids == [i + 1 for i in model.target_layer_ids]  # speculators: embedding = layer 0
    tokens = data["speculators_config"]["proposal_methods"][0]["speculative_tokens"]
    assert tokens == getattr(model.config, "block_size", getattr(model.config, "ttt_length", 0))
    written = set(read_state_dict(out))
    own = set(model.state_dict())
    assert written == (own if model_type == "eagle3" else own - SHARED)

    back = load_draft_model(out, target_config=target.config, shared_weights=_shared(target))
    assert type(back) is type(model)
    mine, theirs = model.state_dict(), back.state_dict()
    assert sorted(mine) == sorted(theirs)
    assert all(torch.equal(mine[k], theirs[k]) for k in mine)
    for field in ("target_layer_ids", "block_size", "sample_from_anchor", "mask_token_id"):
        assert getattr(back.config, field, None) == getattr(model.config, field, None), field
    for field in ("markov_rank", "markov_head_type", "enable_confidence_head", "ttt_length"):
        assert getattr(back.config, field, None) == getattr(model.config, field, None), field


def _decode(target, drafter, monkeypatch):
    seen = record_proposals(monkeypatch, drafter)
    runs = []
    for prompt in decoding_prompts(target.config.vocab_size):
        seen.clear()
        out, stats = speculative_generate(target, drafter, prompt, max_new_tokens=12)
        runs.append(
            (
                out.tolist(),
                list(seen),
                stats.accepted_per_round,
                stats.proposed_per_round,
                stats.confidence_logits_per_round,
            )
        )
    monkeypatch.undo()
    return runs


@pytest.mark.parametrize("name", ("dspark", "dflash", "eagle3"))
def test_decoding_a_speculators_export_equals_the_native_one(
    name, target, tiny_target, tmp_path, monkeypatch
):
    """The same run exported both ways: the same drafts every round, the same tokens and the
    same acceptance at every position."""
    model = make_drafter(name, target)
    save_draft_model(model, tmp_path / "native")
    save_speculators_model(model, tmp_path / "spec", target_path=tiny_target)
    loaded = [
        load_draft_model(tmp_path / d, target_config=target.config, shared_weights=_shared(target))
        for d in ("native", "spec")
    ]
    native, spec = (_decode(target, d, monkeypatch) for d in loaded)
    assert native == spec
    assert sum(len(r[1]) for r in native) > 0  # rounds were drafted


def test_dspark_ds_eval_reads_a_speculators_directory(target, tiny_target, tmp_path):
    model = make_drafter("dspark", target)
    save_draft_model(model, tmp_path / "native")
    save_speculators_model(model, tmp_path / "spec", target_path=tiny_target)
    rows = []
    for d in ("native", "spec"):
        kw = dict(benchmarks=["gsm8k"], max_samples=2, max_new_tokens=8)
        rows.append(cpu_eval(tiny_target, tmp_path / d, tmp_path / f"runs_{d}", **kw))
    native, spec = (r["benchmarks"][0] for r in rows)
    for key in ("tau", "rounds", "new_tokens", "accept_rate_by_position"):
        assert native[key] == spec[key], key


def test_init_from_and_serve_check_read_a_speculators_directory(target, tiny_target, tmp_path):
    model = make_drafter("dflash", target)
    out = save_speculators_model(model, tmp_path / "spec", target_path=tiny_target)
    state = read_init_state(out, target.config)  # model.init_from
    mine = model.state_dict()
    assert set(state) == set(mine) - SHARED
    assert all(torch.equal(state[k], mine[k]) for k in state)
    check_init_state(state, model.config, out)  # the run's drafter is the checkpoint's
    dspark = make_drafter("dspark", target)  # a run with heads the checkpoint does not have
    with pytest.raises(ConfigError, match="init_from: .* confidence_head.proj.bias .missing"):
        check_init_state(state, dspark.config, out)
    with pytest.raises(ConfigError, match="fc.weight .shape .32, 96., the run's drafter .32, 64."):
        check_init_state(state, make_drafter("dflash_anchor", target).config, out)
    native, fmt = describe(str(out), tiny_target)  # serve-check's reading
    assert fmt.name == "DFlash" and fmt.vllm_method == "dflash"
    assert fmt.num_speculative_tokens == 4 and native["target_layer_ids"] == [-1, 1, 2]
    assert any("speculators checkpoint: vLLM reads it as it is" in w for w in fmt.warnings)
    # without the target, the verifier directory the checkpoint names gives its layer count
    assert config_from_dict(json.loads((out / "config.json").read_text())).num_target_layers == 4


def _spec_config(name, target, tiny_target, tmp_path) -> dict:
    out = save_speculators_model(
        make_drafter(name, target), tmp_path / name, target_path=tiny_target
    )
    return json.loads((out / "config.json").read_text())


def _set(data: dict, path: str, value) -> dict:
    data = json.loads(json.dumps(data))
    *parents, last = path.split(".")
    node = data
    for key in parents:
        node = node[int(key)] if key.isdigit() else node[key]
    node[last] = value
    return data


REFUSED = [
    # (drafter, field path, value, what the one-line error names)
    ("dspark", "speculators_model_type", "peagle", "speculators_model_type: 'peagle'"),
    ("dspark", "speculators_model_type", "dflash2", "speculators_model_type: 'dflash2'"),
    ("dspark", "speculators_config.algorithm", "mtp", "speculators_config.algorithm"),
    ("dspark", "speculators_config.proposal_methods.0.proposal_type", "tree", "proposal_type"),
    ("dspark", "speculators_config.proposal_methods.0.verifier_accept_k", 5, "verifier_accept_k"),
    ("dspark", "speculators_config.proposal_methods.0.speculative_tokens", 2, "speculative_tokens"),
    ("dspark", "draft_vocab_size", 128, "draft_vocab_size: 128 .*d2t"),
    ("dspark", "transformer_layer_config.model_type", "llama", "model_type: 'llama'"),
    (
        "dspark",
        "transformer_layer_config.layer_types",
        ["sliding_attention", "full_attention"],
        "layer_types: \\['sliding_attention'\\]",
    ),
    ("dspark", "target_hidden_size", 64, "target_hidden_size: 64"),
    ("dspark", "aux_hidden_state_layer_ids", [3, 1], "aux_hidden_state_layer_ids: \\[3, 1\\]"),
    ("dspark", "markov_head_type", "rnn", None),  # valid in the anchor layout: read
    ("dspark_gated", "markov_head_type", "rnn", "markov_head_type: 'rnn' in the fill-in"),
    ("dspark", "loss_fn", "kl_div", "loss_fn: a speculators dspark option"),
    ("eagle3", "norm_before_residual", True, "norm_before_residual: true"),
    ("eagle3", "norm_output", True, "norm_output: true"),
    ("eagle3", "embed_requires_grad", True, "embed_requires_grad: true"),
    ("eagle3", "transformer_layer_config.num_hidden_layers", 2, "num_hidden_layers: 2"),
    ("eagle3", "eagle_aux_hidden_state_layer_ids", None, "eagle_aux_hidden_state_layer_ids: miss"),
]


@pytest.mark.parametrize("name,path,value,error", REFUSED)
def test_a_speculators_option_without_a_counterpart_is_refused_by_name(
    name, path, value, error, target, tiny_target, tmp_path
):
    data = _set(_spec_config(name, target, tiny_target, tmp_path), path, value)
    if error is None:
        assert config_from_dict(data, target.config).markov_head_type == value
        return
    with pytest.raises(ConfigError, match=error) as caught:
        config_from_dict(data, target.config)
    assert "\n" not in str(caught.value)


def test_what_the_format_cannot_hold_is_refused_before_writing(target, tiny_target, tmp_path):
    eagle3 = build_eagle3_config(target.config, target_layer_ids=[0, 2], num_draft_layers=2)
    gemma4 = build_draft_config(
        tiny_gemma4_target_config(), target_layer_ids=[0, 1], mask_token_id=3, num_draft_layers=1
    )
    cases = [
        (eagle3, "num_hidden_layers: 2"),
        (gemma4, "architectures: Gemma4DSparkModel has no speculators format"),
    ]
    for cfg, error in cases:
        with pytest.raises(ConfigError, match=error):
            save_speculators_model(
                build_draft_model(cfg), tmp_path / "out", target_path=tiny_target
            )
        assert not (tmp_path / "out").exists()
    rnn = make_drafter("dspark_gated", target)
    rnn.config.markov_head_type = "rnn"
    with pytest.raises(ConfigError, match="markov_head_type: 'rnn' in the fill-in layout"):
        save_speculators_model(rnn, tmp_path / "out", target_path=tiny_target)
    with pytest.raises(ConfigError, match="format: native or speculators"):
        export_checkpoint(tmp_path / "run", tmp_path / "export", format="onnx")


def test_a_checkpoint_without_a_local_verifier_needs_the_target(target, tiny_target, tmp_path):
    data = _set(
        _spec_config("eagle3", target, tiny_target, tmp_path),
        "speculators_config.verifier.name_or_path",
        "org/some-model",
    )
    with pytest.raises(ConfigError, match="verifier.name_or_path: 'org/some-model'.*target.path"):
        config_from_dict(data)
    assert config_from_dict(data, AutoConfig.from_pretrained(tiny_target)).num_target_layers == 4
