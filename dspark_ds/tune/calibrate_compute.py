"""The calibration's arithmetic rates: the peak (an [n × n] matmul in the compute dtype), the
sustained fractions of a training micro-batch of the recipe's drafter kind and of a frozen
target's forward at the reference shape (`reference_shape`), and the optimizers' step rates."""

from __future__ import annotations

from dataclasses import replace

import torch

from dspark_ds.cost.flops import forward_flops
from dspark_ds.cost.inventory import target_config_of
from dspark_ds.drafters.common.memory import StepShape, Widths
from dspark_ds.drafters.common.target_config import global_attr, text_config
from dspark_ds.drafters.registry import get_kind
from dspark_ds.engine.probes import cpu_adam
from dspark_ds.target import default_layer_ids
from dspark_ds.tune.calibrate_timing import max_over_ranks, timed
from dspark_ds.tune.workload import (
    KindStep,
    TargetForward,
    counted_perf,
    narrow_config,
    resized_config,
)

# ---- compute --------------------------------------------------------------------------------
# The compute rates are measured at the recipe's own widths (a GEMM's efficiency depends on its
# sizes: on this project's CPU machine the bench recipe's drafter runs 12 % and its target's
# forward 80 % nearer the peak than at a 192-wide shape), with one draft layer, a few target
# layers, each size at least REFERENCE_FLOOR (below it the step is all host time, which the
# 32-wide copy takes out, and the difference is noise) and at most the device's cap, so that a
# sample stays short; the FLOP model carries the rates to the recipe's full depth and length.
REFERENCE_FLOOR = dict(hidden=192,  intermediate=512,   heads=4,  head_dim=48,  vocab=12000,
                       layers=4, seq_len=192,  anchors=24,  draft_layers=1)  # fmt: skip
REFERENCE_CAPS = {
    "cpu":  dict(hidden=512,  intermediate=1536,  heads=8,  head_dim=128, vocab=32768,
                 layers=4, seq_len=256,  anchors=32,  draft_layers=1),
    "cuda": dict(hidden=8192, intermediate=32768, heads=64, head_dim=256, vocab=262144,
                 layers=4, seq_len=2048, anchors=256, draft_layers=1),
}  # fmt: skip


def reference_shape(run_cfg, device_type: str) -> dict[str, int]:
    """The shape the compute rates are measured at: the recipe's target widths and its
    sequence and anchors, each between REFERENCE_FLOOR and the device type's REFERENCE_CAPS."""
    text = text_config(target_config_of(run_cfg.target.path))
    heads = int(global_attr(text, "num_attention_heads"))  # per-layer on Gemma4: its global
    own = dict(
        hidden=int(text.hidden_size),
        intermediate=int(text.intermediate_size),
        heads=heads,
        head_dim=int(global_attr(text, "head_dim") or text.hidden_size // heads),
        vocab=int(text.vocab_size),
        layers=int(text.num_hidden_layers),
        seq_len=int(run_cfg.data.max_length),
        anchors=int(run_cfg.model.num_anchors or 1),
        draft_layers=1,
    )
    caps = REFERENCE_CAPS["cuda" if device_type == "cuda" else "cpu"]
    shape = {k: max(REFERENCE_FLOOR[k], min(v, caps[k])) for k, v in own.items()}
    shape["heads"] -= shape["heads"] % 2  # GQA halves them (the floor's 4 keeps them even)
    return shape


def _reference_config(run_cfg, shape: dict[str, int], narrow: bool):
    r = shape
    config = resized_config(
        target_config_of(run_cfg.target.path),
        hidden=r["hidden"],
        intermediate=r["intermediate"],
        heads=r["heads"],
        head_dim=r["head_dim"],
        vocab=r["vocab"],
        layers=r["layers"],
    )
    return narrow_config(config) if narrow else config


class Compute:
    """The compute rates' workloads: a matmul (the peak) and, at the reference shape, a
    training micro-batch of the recipe's drafter kind and a frozen target's forward, each also
    32 wide (their host time, taken out)."""

    def __init__(self, run_cfg, device: torch.device, dtype: torch.dtype):
        r = self.shape = reference_shape(run_cfg, device.type)
        self.device = device
        n = 4096 if device.type == "cuda" else 1024
        self.a = torch.randn(n, n, device=device, dtype=dtype)
        self.b = torch.randn(n, n, device=device, dtype=dtype)
        self.matmul_flops = 2.0 * n**3
        model = replace(run_cfg.model, num_draft_layers=r["draft_layers"], num_anchors=r["anchors"])
        perf = counted_perf(run_cfg.perf, device.type)
        layer_ids = default_layer_ids(r["layers"])
        self.drafter, self.target = [], []
        for narrow in (False, True):
            config = _reference_config(run_cfg, r, narrow)
            self.drafter.append(
                KindStep(
                    model,
                    perf,
                    config,
                    layer_ids,
                    1,
                    r["seq_len"],
                    zero3=False,
                    device=device,
                    dtype=dtype,
                )
            )
            self.target.append(TargetForward(config, layer_ids, 1, r["seq_len"], device, dtype))
        text = text_config(_reference_config(run_cfg, r, False))
        kind = get_kind(model.kind)
        widths = Widths.of_config(text, r["draft_layers"], len(layer_ids))
        width = torch.tensor([], dtype=dtype).element_size()
        shape = StepShape.of(widths, 1, r["seq_len"], kind.cost.step_part(model), width, width)
        self.drafter_flops = sum(kind.cost.step_flops(shape, perf, device.type, 0).values())
        layer_params = sum(p.numel() for p in self.target[0].target.decoder.layers.parameters())
        attention = [(r["heads"] * r["head_dim"], None)] * r["layers"]
        self.target_flops = forward_flops(layer_params, attention, 1, r["seq_len"])
        self.sample()  # warm-up

    def sample(self) -> dict[str, float]:
        d = self.device
        t = [timed(lambda: self.a @ self.b, d)]
        t += [timed(step, d) for step in self.drafter]
        with torch.no_grad():
            t += [timed(target, d) for target in self.target]
        mm, d_full, d_narrow, t_full, t_narrow = max_over_ranks(t)
        return {
            "peak_flops": self.matmul_flops / mm,
            "sustained": self.drafter_flops / max(d_full - d_narrow, 1e-9),
            "target_sustained": self.target_flops / max(t_full - t_narrow, 1e-9),
        }


# ---- optimizers -------------------------------------------------------------------------------
class Optimizers:
    """torch's AdamW over one flat tensor (as ZeRO hands it) and over 200 small ones (as plain
    data parallelism hands it the parameter list); DeepSpeed's CPU Adam over a flat one."""

    NUMEL, TENSORS, SMALL = 4 * 2**20, 200, 256

    def __init__(self, device: torch.device):
        self.device = device

        def made(make_opt, params):
            for p in params:
                p.grad = torch.full_like(p, 1e-3)
            return make_opt(params)

        adamw = lambda ps: torch.optim.AdamW(ps, lr=1e-4)  # noqa: E731
        self.flat = made(adamw, [torch.zeros(self.NUMEL, device=device, requires_grad=True)])
        self.many = made(
            adamw,
            [
                torch.zeros(self.SMALL, device=device, requires_grad=True)
                for _ in range(self.TENSORS)
            ],
        )
        self.cpu = made(cpu_adam, [torch.zeros(self.NUMEL, requires_grad=True)])
        self.sample()  # warm-up

    def sample(self) -> dict[str, float]:
        d = self.device
        t_flat, t_many, t_cpu = max_over_ranks(
            [timed(self.flat.step, d), timed(self.many.step, d), timed(self.cpu.step, d)]
        )
        per_element = t_flat / self.NUMEL
        return {
            "device_adam_params_per_s": self.NUMEL / t_flat,
            "device_adam_tensor_s": max(
                0.0, (t_many - self.TENSORS * self.SMALL * per_element) / self.TENSORS
            ),
            "cpu_adam_params_per_s": self.NUMEL / t_cpu,
        }
