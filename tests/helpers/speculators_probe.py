"""speculators' own side of the speculators-format tests, run by the Python of the speculators
environment (`helpers.speculators_env.run_probe`); it imports nothing of dspark-ds.

    python speculators_probe.py JOBS.json

JOBS.json: {"target": the tiny target directory,
            "build": [{"out": DIR, "type": "dspark" | "dflash" | "eagle3", "layers": N,
                       "args": {from_training_args keywords}}],
            "convert": [{"dir": DIR, "out": DIR}],
            "load": [{"dir": DIR, "inputs": FILE.pt, "out": FILE.pt}]}

`build`: speculators' own model class for the target (`from_training_args`, random init, its
trainable weights spread to N(0, 0.2) so that every head matters), saved with
`save_pretrained`. `convert`: speculators' own converter of DFlash checkpoints (z-lab's
format, which is our native DFlash export) for the target. `load`: `SpeculatorModel.from_pretrained(DIR)` (eager attention), then its
training forward on FILE.pt's tensors; writes the draft logits it computed (and the DSpark
confidence logits), the weights the loader found missing or unexpected, and the names of
parameters left uninitialised (NaN).
"""

from __future__ import annotations

import json
import sys

import torch
from safetensors import safe_open


def build(target: str, job: dict) -> None:
    # lazy: speculators' imports take seconds; only this environment has them
    from speculators.models.dflash import DFlashDraftModel
    from speculators.models.dspark import DSparkDraftModel
    from speculators.models.eagle3 import Eagle3DraftModel
    from speculators.train.cli import create_transformer_layer_config

    classes = {"dspark": DSparkDraftModel, "dflash": DFlashDraftModel, "eagle3": Eagle3DraftModel}
    layers = int(job["layers"])
    layer_config = create_transformer_layer_config(
        target, layers, "qwen3", None, None, list(range(layers))
    )
    torch.manual_seed(int(job.get("seed", 0)))
    model = classes[job["type"]].from_training_args(
        layer_config, verifier_name_or_path=target, draft_attn_impl="eager", **job["args"]
    )
    frozen = ("embed_tokens", "lm_head", "verifier_lm_head", "verifier_norm")
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() > 1 and not name.startswith(frozen):
                param.normal_(0.0, 0.2)
    model.save_pretrained(job["out"])


def convert(target: str, job: dict) -> None:
    # lazy: speculators is importable in its own environment only (and slow to import)
    from speculators.convert.dflash.converter import DFlashConverter

    DFlashConverter().convert(job["dir"], job["out"], base_model=target, validate=False)


def _capture(model, kind: str) -> dict:
    """Records the logits speculators' forward computes: the DFlash-family compute_metrics'
    inputs (after the Markov bias), Eagle3's lm_head outputs, one per TTT step."""
    # lazy: speculators is importable in its own environment only (and slow to import)
    import speculators.models.dflash.core as dflash_core
    import speculators.models.dspark.core as dspark_core

    seen: dict = {"steps": []}

    def dflash_metrics(logits, *args, **kwargs):
        seen["logits"] = logits.detach().clone()
        return torch.tensor(0.0), {}

    def dspark_metrics(logits, targets, confidence, *args, **kwargs):
        seen["logits"] = logits.detach().clone()
        seen["confidence"] = None if confidence is None else confidence.detach().clone()
        return torch.tensor(0.0), {}

    dflash_core.compute_metrics = dflash_metrics
    dspark_core.compute_metrics = dspark_metrics
    if kind == "eagle3":
        model.lm_head.register_forward_hook(
            lambda module, args, out: seen["steps"].append(out.detach().clone())
        )
    return seen


def _check_weights(model, directory: str) -> dict:
    with safe_open(f"{directory}/model.safetensors", "pt") as f:
        saved = set(f.keys())
    own = set(model.state_dict())
    ignored = set(model._keys_to_ignore_on_save or [])
    return {
        "missing": sorted(own - ignored - saved),
        "unexpected": sorted(saved - own),
        "nan": sorted(n for n, p in model.named_parameters() if torch.isnan(p).any()),
    }


def load(job: dict) -> None:
    # lazy: speculators is importable in its own environment only (and slow to import)
    import speculators.models.dflash.core as dflash_core
    from speculators import SpeculatorModel, SpeculatorModelConfig

    config = SpeculatorModelConfig.from_pretrained(job["dir"])
    config.transformer_layer_config._attn_implementation = "eager"
    model = SpeculatorModel.from_pretrained(job["dir"], config=config).eval()
    kind = config.speculators_model_type
    inputs = torch.load(job["inputs"])
    seen = _capture(model, kind)
    ids, hidden = inputs["input_ids"], inputs["hidden_states"]
    seq = ids.shape[1]
    docs = torch.zeros_like(ids)
    with torch.no_grad():
        if kind == "eagle3":  # its data pairs position t with the token after it
            shifted = torch.cat([ids[:, 1:], ids.new_zeros(1, 1)], dim=1)
            positions = torch.arange(seq).unsqueeze(0)
            model(hidden, shifted, docs, position_ids=positions, ttt_steps=inputs["steps"])
            logits = torch.stack(seen["steps"], dim=2)  # [1, S, T, V]
        else:
            anchors = inputs["anchors"]
            dflash_core.select_anchors = lambda mask, n, block: (
                anchors,
                torch.ones_like(anchors, dtype=torch.bool),
            )
            last = torch.randn(1, seq, hidden.shape[-1] // len(model.target_layer_ids))
            model(hidden, ids, torch.ones_like(ids), last, docs, max_anchors=anchors.numel())
            logits = seen["logits"].view(anchors.numel(), model.block_size, -1)
    result = {"logits": logits, "confidence": seen.get("confidence")}
    torch.save({**result, **_check_weights(model, job["dir"])}, job["out"])


def main() -> None:
    jobs = json.loads(open(sys.argv[1]).read())
    for job in jobs.get("build", []):
        build(jobs["target"], job)
    for job in jobs.get("convert", []):
        convert(jobs["target"], job)
    for job in jobs.get("load", []):
        load(job)
    print("ok")


if __name__ == "__main__":
    main()
