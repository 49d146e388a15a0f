"""The serving fleet of a served run (`data.mode served`): how many serving GPUs keep the
recommended point fed, and the storage bandwidth its hidden-state files take.

Per sequence of T = data.max_length tokens (the tuner's sequence: every one at full length, so
the figures are upper bounds):

    file                 T · (k · H · target dtype bytes + 8)   what a server writes: k states
                         per token (vLLM's aux ids: the taps, always with the last layer's) and
                         the int64 token ids
    consumption          sequences per step / predicted step s of the recommended point
    prefill              the target's forward over T tokens (`cost.flops.forward_flops`): 2 · T ·
                         active parameters (a MoE layer's routed experts at top-k of E) + attention
    one serving GPU      peak FLOP/s · prefill MFU / prefill FLOPs per token
    serving GPUs         consumption tokens/s / one GPU's, up to whole servers of
                         data.served.tensor_parallel_size GPUs
    storage              consumption sequences/s · file bytes, written by the servers and read
                         by the trainers (each file is read once and deleted)

The serving GPUs are taken to be the cluster's device (its peak FLOP/s), a server's tensor
parallelism to scale linearly, and the drafter to consume at its predicted pace.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, replace

from dspark_ds.cost.flops import forward_flops
from dspark_ds.cost.inventory import DTYPE_BYTES, Inventory
from dspark_ds.serve.hidden_states import ServedLayout
from dspark_ds.tune.cluster import GB, Machine
from dspark_ds.tune.report import table

TOKEN_ID_BYTES = 8
"""A token id in a hidden-states file (int64, as vLLM's connector writes them)."""
SIZING_URL = "http://fleet.sized.by.tune.invalid/v1"
"""The server URL `as_served` gives a recipe that names none (`--served true`): nothing is
sent to it; the tuner sizes the fleet it stands for."""


@dataclass(frozen=True)
class Fleet:
    """The fleet that keeps one point of a served run fed."""

    option: str
    """The point it feeds (the recommended option)."""
    tokens_per_sequence: int
    aux_ids: tuple[int, ...]
    """vLLM's aux layer ids a server taps (`ServedLayout.aux_ids`): k = their count."""
    hidden_size: int
    bytes_per_sequence: float
    sequences_per_s: float
    """The drafter's consumption."""
    tokens_per_s: float
    prefill_flops_per_token: float
    active_params: int
    """Target parameters one token runs through (decoder layers)."""
    prefill_mfu: float
    gpu_tokens_per_s: float
    """One serving GPU's prefill throughput."""
    tensor_parallel_size: int
    servers: int
    gpus: int
    storage_bytes_per_s: float
    """Written by the servers; the trainers read as much."""


def as_served(run_cfg):
    """The recipe as a served run (`--served true`): data.mode served, its server URLs (or
    SIZING_URL) and storage (or the output directory's `served/`) as they are."""
    data, served = run_cfg.data, run_cfg.data.served
    served = replace(
        served,
        urls=served.urls or [SIZING_URL],
        storage=served.storage or f"{run_cfg.output_dir}/served",
    )
    out = copy.copy(run_cfg)
    out.data = replace(data, mode="served", served=served)
    return out


def sequence_file_bytes(run_cfg, inv: Inventory) -> tuple[tuple[int, ...], float]:
    """(vLLM's aux ids, the bytes of one sequence's hidden-states file)."""
    aux = tuple(ServedLayout(inv.layer_ids, inv.target_layers).aux_ids)
    per_token = len(aux) * inv.hidden * DTYPE_BYTES[run_cfg.target.dtype] + TOKEN_ID_BYTES
    return aux, float(run_cfg.data.max_length * per_token)


def prefill_flops_per_token(inv: Inventory, tokens: int) -> float:
    """The target's forward over one sequence of `tokens` tokens, its active parameters only,
    per token."""
    return forward_flops(inv.target_active_layer_params, inv.target_attention, 1, tokens) / tokens


def size_fleet(best, run_cfg, inv: Inventory, machine: Machine, prefill_mfu: float) -> Fleet:
    """The fleet that feeds `best` (an `Estimate` with its predicted step)."""
    tokens = run_cfg.data.max_length
    aux, file_bytes = sequence_file_bytes(run_cfg, inv)
    sequences_per_s = best.step["sequences"] / best.step["predicted_step_s"]
    per_token = prefill_flops_per_token(inv, tokens)
    gpu_tokens_per_s = machine.peak_flops * prefill_mfu / per_token
    tp = run_cfg.data.served.tensor_parallel_size
    servers = max(1, math.ceil(sequences_per_s * tokens / (gpu_tokens_per_s * tp)))
    return Fleet(
        option=best.option,
        tokens_per_sequence=tokens,
        aux_ids=aux,
        hidden_size=inv.hidden,
        bytes_per_sequence=file_bytes,
        sequences_per_s=sequences_per_s,
        tokens_per_s=sequences_per_s * tokens,
        prefill_flops_per_token=per_token,
        active_params=inv.target_active_layer_params,
        prefill_mfu=prefill_mfu,
        gpu_tokens_per_s=gpu_tokens_per_s,
        tensor_parallel_size=tp,
        servers=servers,
        gpus=servers * tp,
        storage_bytes_per_s=sequences_per_s * file_bytes,
    )


def fleet_lines(fleet: Fleet | None, run_cfg, machine: Machine) -> list[str]:
    """The fleet as a short table (or why there is none)."""
    if fleet is None:
        return ["", "served target: nothing fits, so no fleet is sized"]
    f = fleet
    k, tp, dtype = len(f.aux_ids), f.tensor_parallel_size, run_cfg.target.dtype
    peak = machine.peak_flops
    source = machine.sources.get("peak_flops", "default")
    rows = [
        [
            "per sequence",
            f"{f.bytes_per_sequence / 1e6:.1f} MB",
            f"{f.tokens_per_sequence} tokens × ({k} states × H {f.hidden_size} × {dtype} + "
            "an int64 token id); "
            f"vLLM aux ids {list(f.aux_ids)}: the taps and the last layer",
        ],
        [
            "drafter consumes",
            f"{f.sequences_per_s:.3g} sequences/s",
            f"{f.tokens_per_s:.4g} tokens/s at {f.option}'s predicted step",
        ],
        [
            "one serving GPU",
            f"{f.gpu_tokens_per_s:.4g} tokens/s",
            f"peak {peak / 1e12:.3g} TFLOP/s [{source}] × prefill MFU {f.prefill_mfu:.2g} / "
            f"{f.prefill_flops_per_token / 1e9:.3g} GFLOP per token "
            f"({f.active_params / 1e9:.3g} B active parameters + attention)",
        ],
        [
            "serving GPUs",
            str(f.gpus),
            f"{f.servers} server(s) × tensor_parallel_size {tp}",
        ],
        [
            "storage",
            f"{f.storage_bytes_per_s / GB:.3g} GB/s",
            "written by the servers, and as much read by the trainers",
        ],
    ]
    title = f"served target: the fleet that keeps {f.option} fed (data.served):"
    return ["", title, *table(rows, ["", "figure", "from"])]
