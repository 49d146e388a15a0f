"""The speculators format against speculators 0.9.0 itself (its own environment, made by
tools/install.sh; the tests fail naming it when it is missing): speculators' own loader and
forward on what `dspark-ds export --format speculators` writes (no weight missing or unexpected,
the same logits as our drafter), and the checkpoints speculators' own model classes build and
save for the tiny target read by us (the same logits as speculators' forward, greedy decoding
equal to the target's, written back as speculators wrote them).

One run of speculators for the whole module (helpers/speculators_probe.py: it builds its three
drafters, then loads and runs every directory), since importing it takes seconds.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import Qwen3ForCausalLM

from dspark_ds.drafters import load_draft_model
from dspark_ds.drafters.io import save_draft_model, save_speculators_model
from dspark_ds.eval.decoding import speculative_generate

from helpers.evaluation import decoding_prompts, greedy_reference
from helpers.speculators_env import draft_ids, make_drafter, run_probe
from helpers.vllm_serving import require_vllm

pytestmark = pytest.mark.slow

OURS = ("dspark", "dspark_gated", "dspark_rnn", "dflash", "dflash_anchor", "eagle3")
REDUCED = ("dspark_reduced", "dflash_reduced", "eagle3_reduced")  # 200 of the 384 tokens
ANCHORS = torch.tensor([2, 7, 11])
SEQ = 20
# speculators' own drafters for the tiny target (from_training_args keywords): taps given in its
# counting (the embedding output is 0), γ 4; `<kind>_reduced`: over the draft vocabulary
# helpers/speculators_env.draft_ids gives ours, its d2t / t2d handed to from_training_args
THEIRS = {
    "dspark": dict(
        layers=2,
        args=dict(
            target_layer_ids=[1, 3],
            block_size=4,
            markov_rank=8,
            markov_head_type="gated",
            sample_from_anchor=True,
        ),
    ),
    "dflash": dict(layers=2, args=dict(target_layer_ids=[0, 2, 3], block_size=5)),
    "eagle3": dict(
        layers=1, args=dict(target_layer_ids=[0, 2, 3], norm_before_residual=False, ttt_steps=3)
    ),
}
THEIRS |= {f"{name}_reduced": spec for name, spec in THEIRS.items()}


def _inputs(model_or_taps, steps: int, seed: int) -> dict:
    taps = model_or_taps if isinstance(model_or_taps, int) else len(model_or_taps.target_layer_ids)
    g = torch.Generator().manual_seed(seed)
    return {
        "input_ids": torch.randint(0, 383, (1, SEQ), generator=g),
        "hidden_states": torch.randn(1, SEQ, taps * 32, generator=g),
        "anchors": ANCHORS,
        "steps": steps,
    }


@torch.no_grad()
def our_logits(model, inputs: dict) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Our training forward's draft logits ([1, A, γ, V] or [1, S, T, V]) and confidence."""
    ids, hidden = inputs["input_ids"], inputs["hidden_states"]
    mask = torch.ones_like(ids, dtype=torch.float32)
    if hasattr(model, "ttt_length"):
        return model(input_ids=ids, target_hidden_states=hidden, loss_mask=mask).draft_logits, None
    out = model(
        input_ids=ids, target_hidden_states=hidden, loss_mask=mask, anchor_positions=ANCHORS[None]
    )
    return out.draft_logits, out.confidence_pred


def their_slots(result: dict, model) -> tuple[torch.Tensor, torch.Tensor | None]:
    """speculators' logits (and confidence) of the slots we draft: its DFlash-family blocks
    hold the anchor's slot too in the fill-in layout."""
    logits = result["logits"]
    if hasattr(model, "ttt_length"):
        return logits, None
    gamma, slots = model.block_size, logits.shape[1]
    confidence = result["confidence"]
    if confidence is not None:
        confidence = confidence.view(1, len(ANCHORS), slots)[..., slots - gamma :]
    return logits[None, :, slots - gamma :], confidence


@pytest.fixture(scope="module")
def interop(tiny_target, tmp_path_factory):
    work = tmp_path_factory.mktemp("speculators")
    target = Qwen3ForCausalLM.from_pretrained(tiny_target, dtype=torch.float32).eval()
    ours, jobs = {}, {"target": tiny_target, "build": [], "load": []}
    for i, name in enumerate(OURS + REDUCED):
        model = make_drafter(name, target)
        save_speculators_model(model, work / name, target_path=tiny_target)
        torch.save(_inputs(model, getattr(model, "ttt_length", 0), i), work / f"{name}.in.pt")
        ours[name] = model
    for i, (name, spec) in enumerate(THEIRS.items()):
        kind = name.removesuffix("_reduced")
        ids = draft_ids(384) if name.endswith("_reduced") else None
        args = dict(spec["args"], draft_vocab_size=len(ids) if ids else 384)
        if kind != "eagle3":
            args["mask_token_id"] = 383
        build = dict(out=str(work / f"theirs_{name}"), type=kind, layers=spec["layers"], args=args)
        jobs["build"].append({**build, "draft_ids": ids} if ids else build)
        steps = args.get("ttt_steps", 0)
        taps = len(args["target_layer_ids"])
        torch.save(_inputs(taps, steps, 10 + i), work / f"theirs_{name}.in.pt")
    for name in [*OURS, *REDUCED, *(f"theirs_{n}" for n in THEIRS)]:
        jobs["load"].append(
            dict(
                dir=str(work / name),
                inputs=str(work / f"{name}.in.pt"),
                out=str(work / name) + ".out.pt",
            )
        )
    save_draft_model(ours["dflash"], work / "native_dflash")  # DFlash's own format
    jobs["convert"] = [dict(dir=str(work / "native_dflash"), out=str(work / "converted_dflash"))]
    run_probe(jobs, work)
    return {"work": work, "target": target, "ours": ours, "tiny_target": tiny_target}


@pytest.mark.parametrize("name", OURS + REDUCED)
def test_speculators_loads_our_export_with_the_same_logits(interop, name):
    work, model = interop["work"], interop["ours"][name]
    result = torch.load(work / f"{name}.out.pt")
    assert (result["missing"], result["unexpected"], result["nan"]) == ([], [], [])
    logits, confidence = our_logits(model, torch.load(work / f"{name}.in.pt"))
    theirs, their_confidence = their_slots(result, model)
    assert theirs.shape == logits.shape
    torch.testing.assert_close(theirs, logits, atol=1e-5, rtol=1e-5)
    assert (confidence is None) == (their_confidence is None)
    if confidence is not None:
        torch.testing.assert_close(their_confidence, confidence, atol=1e-5, rtol=1e-5)


def test_speculators_converter_agrees_with_our_export(interop):
    """speculators' own converter of our native DFlash export (z-lab's format) reads the taps,
    the block and the mask as our speculators export writes them, and keeps the weights."""
    work = interop["work"]
    converted = json.loads((work / "converted_dflash" / "config.json").read_text())
    mine = json.loads((work / "dflash" / "config.json").read_text())
    for key in ("aux_hidden_state_layer_ids", "block_size", "mask_token_id", "sample_from_anchor"):
        assert converted[key] == mine[key], key
    methods = [c["speculators_config"]["proposal_methods"][0] for c in (converted, mine)]
    assert methods[0]["speculative_tokens"] == methods[1]["speculative_tokens"]
    theirs = load_file(work / "converted_dflash" / "model.safetensors")
    ours = load_file(work / "dflash" / "model.safetensors")
    assert theirs.keys() == ours.keys()
    assert all(torch.equal(theirs[k], ours[k]) for k in ours)


@pytest.mark.parametrize("name", ("dspark", "dflash", "eagle3") + REDUCED)
def test_our_config_json_has_the_keys_speculators_writes(interop, name):
    work = interop["work"]
    mine = json.loads((work / name / "config.json").read_text())
    theirs = json.loads((work / f"theirs_{name}" / "config.json").read_text())
    assert set(mine) == set(theirs)
    assert set(mine["transformer_layer_config"]) == set(theirs["transformer_layer_config"])
    assert mine["speculators_config"].keys() == theirs["speculators_config"].keys()
    mine_method, their_method = (
        c["speculators_config"]["proposal_methods"] for c in (mine, theirs)
    )
    assert mine_method[0].keys() == their_method[0].keys()
    assert set(load_file(work / name / "model.safetensors")) == set(
        load_file(work / f"theirs_{name}" / "model.safetensors")
    ) - {"markov_head.gate_proj.weight", "markov_head.gate_proj.bias"}


@pytest.mark.parametrize("name", tuple(THEIRS))
def test_we_read_and_decode_what_speculators_saves(interop, name, tmp_path):
    work, target = interop["work"], interop["target"]
    directory = work / f"theirs_{name}"
    shared = (target.model.embed_tokens.weight, target.lm_head.weight)
    model = load_draft_model(directory, target_config=target.config, shared_weights=shared)
    # speculators' forward and ours on the same inputs
    result = torch.load(work / f"theirs_{name}.out.pt")
    logits, confidence = our_logits(model, torch.load(work / f"theirs_{name}.in.pt"))
    theirs, their_confidence = their_slots(result, model)
    torch.testing.assert_close(theirs, logits, atol=1e-5, rtol=1e-5)
    if confidence is not None:
        torch.testing.assert_close(their_confidence, confidence, atol=1e-5, rtol=1e-5)
    # lossless: greedy speculative decoding is the target's greedy continuation
    for prompt in decoding_prompts(target.config.vocab_size):
        out, stats = speculative_generate(target, model, prompt, max_new_tokens=10)
        assert out.tolist() == greedy_reference(target, prompt, 10, with_generate=False).tolist()
        assert stats.rounds > 0
    # and written back, it is the directory speculators wrote
    again = save_speculators_model(model, tmp_path / "again", target_path=interop["tiny_target"])
    mine = json.loads((again / "config.json").read_text())
    theirs_config = json.loads((directory / "config.json").read_text())
    for data in (mine, theirs_config):
        data.pop("transformers_version")
    # the one field written otherwise: speculators' default (false) has vLLM 0.32 draft with
    # causal blocks; its full-attention blocks, like ours, are bidirectional either way
    non_causal = mine.pop("sliding_window_non_causal", None)
    if non_causal is not None:  # DSpark, DFlash
        assert non_causal is True and theirs_config.pop("sliding_window_non_causal") is False
    assert mine == theirs_config
    mine_state, their_state = (load_file(d / "model.safetensors") for d in (again, directory))
    assert mine_state.keys() == their_state.keys()
    assert all(torch.equal(mine_state[k], their_state[k]) for k in mine_state)


def test_serve_check_loads_a_speculators_export_in_vllm(interop):
    """vLLM's own config validation and weight loader take our speculators DFlash export (vLLM
    gives it the target's embedding and lm_head, which the directory leaves out), and its DFlash
    proposer drafts its blocks bidirectional, as we trained them."""
    # lazy: the serve-check module is this test's only user here
    from dspark_ds.serve.check import ServeCheckConfig, run_serve_check
    from dspark_ds.target import TargetPathConfig

    require_vllm()
    result = run_serve_check(
        ServeCheckConfig(
            drafter=str(interop["work"] / "dflash"),
            target=TargetPathConfig(path=interop["tiny_target"]),
        )
    )
    load = result["load"]
    assert result["vllm_method"] == "dflash" and load["ok"] and load["missing"] == [], load
    assert load["model_class"].endswith("DFlashQwen3ForCausalLM")
    assert load["draft_attention"] == "bidirectional"
    assert load["tensors"] == len(load_file(interop["work"] / "dflash" / "model.safetensors"))
