"""What the inference engines (vLLM, SGLang) read in a drafter directory (docs/serving.md).

A drafter directory is written in the format the engines load as it is, chosen by its kind and
layout: each kind's `serving.py` (drafters/dspark/serving.py, drafters/eagle3/serving.py) maps
the drafter's own config.json fields to the engine's (`engine_dict`) and back (`native_dict`,
which also reads the published checkpoints of those formats, to fine-tune them), and says how
the engines serve it (`ServingFormat`). Parameter names are the same on both sides.

    data = engine_dict(native)          # what save_draft_model writes
    native = native_dict(data)          # what load_draft_model reads (ours or an engine's)
    fmt = serving_format(native)        # the vLLM method, SGLang's algorithm, the commands
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from dspark_ds.drafters import speculators_format
from dspark_ds.drafters.registry import REGISTERED
from dspark_ds.errors import ConfigError

# the registered kinds' format modules, each with ARCHITECTURES (our own), READS (every
# architecture its native_dict maps), engine_dict, native_dict, serving_format
_KIND_FORMATS = tuple(r.serving for r in REGISTERED.values())


@dataclass(frozen=True)
class ServingFormat:
    """How the engines serve a drafter directory (docs/serving.md)."""

    name: str
    """The format's name in messages ("DFlash", "DeepSpec DSpark", "Eagle3")."""
    architecture: str
    """`architectures[0]` of the directory's config.json."""
    vllm_method: str | None
    """`speculative_config.method` of vLLM; None: vLLM cannot serve it."""
    num_speculative_tokens: int
    """Draft tokens per round (`num_speculative_tokens`, SGLang's `--speculative-num-steps`)."""
    vllm_v2_runner: bool = False
    """vLLM runs it only in its V2 model runner (`VLLM_USE_V2_MODEL_RUNNER=1`; Triton, a GPU)."""
    sglang_algorithm: str | None = None
    """SGLang's `--speculative-algorithm`; None: SGLang cannot serve it."""
    warnings: tuple[str, ...] = field(default_factory=tuple)
    """What an engine will do differently from our evaluation (one line each)."""
    vllm_block_mask: str | None = None
    """"module:function" of vLLM that reads from the draft's config whether vLLM drafts its
    blocks bidirectionally, as dspark-ds trains them (serve-check reports it); None: no block."""

    @property
    def vllm_cpu(self) -> bool:
        """vLLM's CPU build serves it (its V1 runner)."""
        return self.vllm_method is not None and not self.vllm_v2_runner

    def speculative_config(self, drafter_dir: str) -> dict:
        """vLLM's `speculative_config` for this directory."""
        return {
            "method": self.vllm_method,
            "model": str(drafter_dir),
            "num_speculative_tokens": self.num_speculative_tokens,
        }

    def vllm_command(self, target: str, drafter_dir: str) -> str | None:
        if self.vllm_method is None:
            return None

        env = "VLLM_USE_V2_MODEL_RUNNER=1 " if self.vllm_v2_runner else ""
        spec = json.dumps(self.speculative_config(drafter_dir))
        return f"{env}vllm serve {target} --speculative-config '{spec}'"

    def sglang_command(self, target: str, drafter_dir: str) -> str | None:
        if self.sglang_algorithm is None:
            return None
        steps = self.num_speculative_tokens
        command = (
            f"python -m sglang.launch_server --model-path {target} "
            f"--speculative-algorithm {self.sglang_algorithm} "
            f"--speculative-draft-model-path {drafter_dir} "
        )
        # DFlash's block: the anchor and the γ masks; DSpark's γ: the draft tokens less one
        if self.sglang_algorithm in ("DFLASH", "DSPARK"):
            return command + f"--speculative-num-draft-tokens {steps + 1}"
        return command + (
            f"--speculative-num-steps {steps} --speculative-eagle-topk 1 "
            f"--speculative-num-draft-tokens {steps + 1}"
        )


def _format_module(architecture: str):
    for module in _KIND_FORMATS:
        if architecture in module.READS:
            return module
    return None


def engine_dict(data: dict) -> dict:
    """A drafter's config.json dict (ours, as its config holds it) -> what the directory holds:
    the engine's format for the drafter's kind and layout."""
    module = _format_module((data.get("architectures") or [""])[0])
    return module.engine_dict(data) if module is not None else data


def native_dict(data: dict, target_config=None) -> dict:
    """A directory's config.json dict (ours, DeepSpec's, or an engine format's: vLLM's and
    SGLang's DFlash, vLLM's Eagle3, the speculators format) -> the drafter config dict our
    backends build from. `target_config` (the target's Hugging Face config) fills what a
    published checkpoint leaves out (the target's layer count). ConfigError names what cannot
    be read."""
    if speculators_format.is_speculators(data):
        return speculators_format.native_dict(data, target_config)
    archs = data.get("architectures") or []
    if not archs:
        raise ConfigError("architectures: missing from the drafter config.json")
    module = _format_module(archs[0])
    if module is None:
        return data
    return module.native_dict(data, target_config)


def serving_format(data: dict) -> ServingFormat | None:
    """How the engines serve a drafter whose config.json dict (ours) is `data`; None for an
    architecture no engine format covers."""
    module = _format_module((data.get("architectures") or [""])[0])
    if module is None:
        return None
    fmt = module.serving_format(data)
    return ServingFormat(
        **{**fmt, "warnings": tuple(fmt.get("warnings", ())) + _tap_warnings(data)}
    )


def _tap_warnings(data: dict) -> tuple[str, ...]:
    """The tapped-layer ids the engines read differently from us."""
    ids = [int(i) for i in data.get("target_layer_ids") or []]
    last = int(data.get("num_target_layers") or 0) - 1
    out = []
    if last >= 0 and last in ids:
        out.append(
            f"target_layer_ids: {last} is the target's last layer, whose final normed state "
            "dspark-ds taps (as Hugging Face's hidden_states do); vLLM and SGLang tap that "
            "layer's output before the final norm, so served acceptance will be lower than "
            "evaluated. Train on ids below it."
        )
    if -1 in ids:
        out.append(
            "target_layer_ids: -1 (the embedding output) is read by vLLM (its aux layer 0) but "
            "refused by SGLang, whose ids start at 0"
        )
    return tuple(out)


def parity_suspects(data: dict) -> list[str]:
    """What to look at when an engine accepts differently from our evaluation, for a drafter
    whose config.json dict (ours) is `data`."""
    module = _format_module((data.get("architectures") or [""])[0])
    return module.parity_suspects(data) if module is not None else []
