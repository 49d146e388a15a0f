"""The engine format of Eagle3 drafters (drafters/serving.py, docs/serving.md).

A one-layer Eagle3 drafter on the Qwen3 backbone (per-head q / k RMSNorm) is written as vLLM's
`Eagle3Qwen3ForCausalLM`: `eagle_config.eagle_aux_hidden_state_layer_ids` (vLLM counts the
embedding output as layer 0, so our id i is its i + 1), `draft_vocab_size` (the vocabulary, or
the reduced draft vocabulary's N, whose `d2t` offsets and `lm_head` of N rows vLLM reads and
whose `t2d` it skips), `target_hidden_size`. The parameter names are ours (`layers.0.*`,
`fc`, `norm`, `lm_head`, `embed_tokens`); vLLM also reads `midlayer.*`. Other Eagle3 drafters
keep the reference's `Qwen3Eagle3Model` / `Gemma4Eagle3Model` directory, which no engine reads.

`native_dict` reads `Eagle3Qwen3ForCausalLM` directories and the reference's, with or without a
reduced draft vocabulary (drafters/common/vocab.py). It refuses, by name, what our Eagle3 cannot
hold: Llama-style Eagle3 layers without q / k norms (`LlamaForCausalLMEagle3`, SGLang's and
SpecForge's).
"""

from __future__ import annotations

from dspark_ds.drafters.common.target_config import text_config
from dspark_ds.errors import ConfigError

VLLM_QWEN3 = "Eagle3Qwen3ForCausalLM"
LLAMA_STYLE = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")
ARCHITECTURES = ("Qwen3Eagle3Model", "Gemma4Eagle3Model")
READS = (*ARCHITECTURES, VLLM_QWEN3, *LLAMA_STYLE)


def _servable(data: dict) -> bool:
    return data["architectures"][0] == "Qwen3Eagle3Model" and int(data["num_hidden_layers"]) == 1


def engine_dict(data: dict) -> dict:
    if not _servable(data):
        return data
    out = dict(data)
    out["architectures"] = [VLLM_QWEN3]
    out["draft_vocab_size"] = int(data.get("draft_vocab_size") or data["vocab_size"])
    out["target_hidden_size"] = int(data["hidden_size"])
    out["eagle_config"] = {
        "eagle_aux_hidden_state_layer_ids": [int(i) + 1 for i in data["target_layer_ids"]],
        "use_aux_hidden_state": True,
    }
    return out


def native_dict(data: dict, target_config=None) -> dict:
    arch = data["architectures"][0]
    if arch in ARCHITECTURES:
        return data
    if arch in LLAMA_STYLE:
        raise ConfigError(
            f"architectures: {arch} (Llama-style Eagle3 layers, without q / k norms) is not a "
            f"drafter dspark-ds trains; it reads {VLLM_QWEN3} and {', '.join(ARCHITECTURES)}"
        )
    vocab = int(data["vocab_size"])
    draft_vocab = int(data.get("draft_vocab_size") or vocab)
    eagle = data.get("eagle_config") or {}
    if eagle.get("norm_before_fc") or data.get("norm_before_residual") or data.get("fc_norm"):
        raise ConfigError(
            "eagle_config: norm_before_fc / norm_before_residual / fc_norm are not the Eagle3 "
            "layer dspark-ds trains"
        )
    out = {k: v for k, v in data.items() if k not in ("eagle_config", "draft_vocab_size")}
    out.pop("target_hidden_size", None)
    if draft_vocab != vocab:  # the reduced draft vocabulary (its d2t / t2d in the weights)
        out["draft_vocab_size"] = draft_vocab
    if "target_layer_ids" not in out:
        aux = eagle.get("eagle_aux_hidden_state_layer_ids") or data.get(
            "eagle_aux_hidden_state_layer_ids"
        )
        if not aux:
            raise ConfigError(
                "eagle_config.eagle_aux_hidden_state_layer_ids: missing from the Eagle3 "
                "config.json (which target layers the drafter reads)"
            )
        out["target_layer_ids"] = [int(i) - 1 for i in aux]
    out["architectures"] = ["Qwen3Eagle3Model"]
    out.setdefault("draft_num_hidden_layers", int(data["num_hidden_layers"]))
    out.setdefault("ttt_length", 7)
    out.setdefault("step_loss_decay", 0.8)
    if "num_target_layers" not in out:
        if target_config is None:
            raise ConfigError(
                "num_target_layers: missing from the Eagle3 config.json; give the target "
                "(target.path) to read it from"
            )

        out["num_target_layers"] = int(text_config(target_config).num_hidden_layers)
    return out


def serving_format(data: dict) -> dict:
    steps = int(data["ttt_length"])
    if _servable(data):
        return dict(
            name="Eagle3",
            architecture=VLLM_QWEN3,
            vllm_method="eagle3",
            num_speculative_tokens=steps,
        )
    why = (
        f"{data['num_hidden_layers']} layers: vLLM's Eagle3 feeds the 2H-wide input to its "
        "first layer only"
        if data["architectures"][0] == "Qwen3Eagle3Model"
        else f"{data['architectures'][0]}: no engine has this Eagle3 backbone"
    )
    return dict(
        name="Eagle3 (reference)",
        architecture=data["architectures"][0],
        vllm_method=None,
        num_speculative_tokens=steps,
        warnings=(why,),
    )


def parity_suspects(data: dict) -> list[str]:
    """What makes an Eagle3 drafter accept less in an engine than in our evaluation."""
    return [
        f"the tapped layers: target_layer_ids {list(data['target_layer_ids'])} = "
        "eagle_config.eagle_aux_hidden_state_layer_ids - 1",
        "the vocabulary map: draft_vocab_size and the d2t offsets (a reduced draft vocabulary)",
        f"ttt_length {data['ttt_length']} against the server's num_speculative_tokens",
    ]
