"""The `perf` section: how a drafter's training step computes attention and the loss, and
whether the drafter is compiled. Every choice gives the same results at another cost; each kind
honours the options it can (`DrafterKind.train.check_perf`) and refuses the others by name.

`activation_checkpointing` recomputes each draft decoder layer in backward instead of keeping
what it saved (drafters/common/layers.py `run_layer`; exact: the same ops run again).

`compile_drafter` applies `perf.compile`: "layers" compiles each draft decoder layer
(`nn.Module.compile`, which keeps the module and its parameter names: checkpoints, export and
ZeRO's hooks see the same tree); "model" compiles the whole drafter's forward; `compile_backend`
is torch.compile's backend (inductor by default). Under ZeRO-3
DeepSpeed's gather / release hooks are excluded from compilation (`torch.compiler.disable`), so a
compiled layer runs as graphs between them. Recompiles follow the flex kernel's plan
(drafters/common/flex.py): the first step compiles for its shapes, the first batch of another
length recompiles with the length symbolic.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from dspark_ds.errors import ConfigError

LOSS_IMPLEMENTATIONS = ("auto", "reference", "chunked", "recompute")
ATTN_IMPLEMENTATIONS = ("dense", "blockwise", "flex")
"""The attention paths of the kinds' training forwards (`perf.attn_implementation` besides
"auto"); each kind honours some of them (`Capabilities.attn_impls`)."""
COMPILE_MODES = ("auto", "off", "layers", "model")

CHUNK_ANCHORS_CPU = 32
"""32: on CPU a chunk's [N, V] fp32 tensors (N = chunk × G; 32 × 7 × 32 000 × 4 B ≈ 29 MB) should
roughly fit the last-level cache, while N stays large enough for efficient matmuls (16 / 32 / 64 /
128 measured on the idle 2-core machine: 3.24 / 2.82 / 3.58 / 4.27 s per step; docs/performance.md).
"""
CHUNK_ANCHORS_CUDA = 256
"""256: on an H200 at the Qwen3-8B shape, compiled flex attention with the chunked loss at chunk
256 took 0.134 s per step (0.487 s uncompiled, docs/performance.md); on a GPU a larger chunk only
cuts kernel launches, and 256 x 7 x 151 936 fp32 logits are ~1 GiB."""


@dataclass
class PerfConfig:
    """How the training step computes attention and the loss (results are the same)."""

    loss_impl: str = "auto"
    """"reference": full [B, A, G, V] logits (the golden-tested path); "chunked": the
    vocabulary-sized work a few anchors at a time, same loss and gradients with
    O(loss_chunk_anchors × G × V) memory, each chunk's gradient computed in closed form as it
    goes; "recompute": the same chunks under activation checkpointing (logits computed twice;
    what "chunked" becomes under ZeRO-3, whose partitioned head weights only module calls
    may touch); "auto" = "chunked". Eagle3: auto | reference | chunked, "auto" = "reference"
    under ZeRO-3."""

    loss_chunk_anchors: int | str = "auto"
    """Anchors (blocks, over the whole micro-batch) per chunk of the chunked loss; "auto" = 32
    on CPU (keeps a chunk near the cache size; docs/performance.md) and 256 on CUDA (fewer
    kernel launches; docs/performance.md). Eagle3: positions, each ttt_length rows."""

    attn_implementation: str = "auto"
    """Block-mask attention of the training forward: "flex" (a BlockMask built from the
    anchors, flex_attention compiled once per process on CUDA), "blockwise" (exact, skips
    masked work; CPU training path), "dense" (full boolean mask, reference) or "auto" (flex
    on CUDA, blockwise elsewhere). Eagle3: auto (flex on CUDA, dense elsewhere) | flex |
    dense."""

    compile: str = "auto"
    """torch.compile of the drafter: "off"; "layers" (each draft decoder layer compiled in
    place, as torchtitan compiles its blocks; checkpoint names unchanged); "model" (the whole
    drafter's forward, graph breaks where it samples anchors or runs the chunked loss);
    "auto" = "off" on every device until a GPU measurement shows a gain (`dspark-ds
    gpu-check` benches "layers" beside the default). The flex kernel is compiled whatever
    this says."""

    compile_backend: str = "inductor"
    """torch.compile's backend for `compile`: "inductor" (generated kernels), "aot_eager"
    (dynamo's graphs and AOTAutograd's forward / backward split, run by eager kernels: no code
    generation, compiles in seconds; tells a tracing problem from an inductor one), or another
    backend torch._dynamo lists (`torch._dynamo.list_backends()`, e.g. "cudagraphs")."""

    activation_checkpointing: bool = False
    """Recompute each draft decoder layer in backward (torch.utils.checkpoint, non-reentrant)
    instead of keeping its activations: memory keeps each layer's input (and, for Eagle3, each
    unrolled step's keys and values) plus one layer's working set while it is recomputed; the
    layers' forward runs twice. Loss and gradients are the same (the same ops run again)."""

    drop_empty_blocks: str = "auto"
    """DSpark / DFlash: "on" drops the trailing anchor blocks that no row of a micro-batch uses
    (sequences with fewer valid anchor positions than `num_anchors` get dummy blocks, which
    supervise nothing), so the step computes only up to the busiest row's block count: same
    loss, gradients and metrics, less work. "off" keeps `num_anchors` blocks in every step (a
    fixed shape); "auto" = "on" except on CUDA, where the compiled kernels keep fixed shapes."""

    def __post_init__(self) -> None:
        if self.drop_empty_blocks not in ("auto", "on", "off"):
            raise ConfigError(
                f"perf.drop_empty_blocks: expected auto, on or off, got {self.drop_empty_blocks!r}"
            )
        if self.loss_impl not in LOSS_IMPLEMENTATIONS:
            raise ConfigError(
                f"perf.loss_impl: expected one of {LOSS_IMPLEMENTATIONS}, got {self.loss_impl!r}"
            )
        chunk = self.loss_chunk_anchors
        if isinstance(chunk, str) and chunk != "auto":
            raise ConfigError(f"perf.loss_chunk_anchors: an integer or 'auto', got {chunk!r}")
        if not isinstance(chunk, str) and chunk < 1:
            raise ConfigError(f"perf.loss_chunk_anchors: must be >= 1, got {chunk}")
        allowed = ("auto", *ATTN_IMPLEMENTATIONS)
        if self.attn_implementation not in allowed:
            raise ConfigError(
                f"perf.attn_implementation: expected one of {allowed}, "
                f"got {self.attn_implementation!r}"
            )
        if self.compile not in COMPILE_MODES:
            raise ConfigError(
                f"perf.compile: expected one of {COMPILE_MODES}, got {self.compile!r}"
            )
        if self.compile_backend != "inductor":  # (listing them imports dynamo: only then)
            # lazy: torch._dynamo, 1 s of import, only to compile
            import torch._dynamo

            backends = torch._dynamo.list_backends(exclude_tags=())
            if self.compile_backend not in backends:
                raise ConfigError(
                    f"perf.compile_backend: {self.compile_backend!r} is not a torch.compile "
                    f"backend; expected one of {sorted(backends)}"
                )

    def chunk_anchors(self, device: torch.device | str) -> int:
        """`loss_chunk_anchors` with "auto" resolved for the run's device."""
        if self.loss_chunk_anchors != "auto":
            return int(self.loss_chunk_anchors)
        return CHUNK_ANCHORS_CUDA if torch.device(device).type == "cuda" else CHUNK_ANCHORS_CPU

    def drops_empty_blocks(self, device: torch.device | str) -> bool:
        """`drop_empty_blocks` with "auto" resolved for the run's device."""
        if self.drop_empty_blocks == "auto":
            return torch.device(device).type != "cuda"
        return self.drop_empty_blocks == "on"

    def compile_mode(self, device: torch.device | str) -> str:
        """`compile` with "auto" resolved for the run's device ("off" | "layers" | "model")."""
        return "off" if self.compile == "auto" else self.compile


def compile_drafter(model: nn.Module, mode: str, backend: str = "inductor") -> nn.Module:
    """Compiles `model` in place per `mode` ("off" | "layers" | "model") with torch.compile's
    `backend`; returns it."""
    if mode not in COMPILE_MODES or mode == "auto":
        raise ValueError(f"perf.compile: expected off, layers or model, got {mode!r}")
    if mode == "layers":
        for layer in model.layers:
            layer.compile(dynamic=None, backend=backend)
    elif mode == "model":
        model.compile(dynamic=None, backend=backend)
    return model
