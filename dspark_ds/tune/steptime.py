"""Seconds of one optimizer step of one ZeRO option on a cluster, as a sum of named terms.

A step is `accum` micro-batches per rank (the recipe's global batch over micro-batch × ranks:
weak scaling of the micro-batch, the global batch held) and one optimizer step. b = bytes of
the compute dtype, P = trainable parameters, N = ranks, ring collectives (bus bytes: an
all-reduce moves 2(N-1)/N of its buffer over each rank's link, an all-gather or a
reduce-scatter (N-1)/N of the whole); across nodes the slower of NVLink and the network.

- compute: the micro-batch's matmul FLOPs (the drafter's for the option's loss path, the in-job
  target's forward) over peak × their sustained fractions.
- host_ops: the host work of the drafter's forward + loss + backward and of the target's
  forward (workload.py, in stand-in ops) × host time per op (on a GPU only what the device's
  work does not hide).
- step_collectives: the loss's two small all-reduces per micro-batch (denominators, metrics),
  unless the host work was timed on a process group (then it holds them).
- engine: what DeepSpeed adds per micro-batch and per step at this stage and offload
  (measured by the calibration on a stand-in model).
- zero3_hooks: ZeRO-3's hooks on every module call of the drafter (its forward + loss, and in
  the backward the calls whose output needs a gradient) and of the in-job target (forward);
  the calls counted on the recipe's own copy 32 wide (workload.py).
- grad_reduce: ZeRO-0/1 all-reduce the gradients once per step; ZeRO-2 all-reduces each
  micro-batch's (the optimizer keeps its partition); ZeRO-3 reduce-scatters each micro-batch's;
  in reduce_bucket_size buckets (one latency each beyond the first, which `engine` holds);
  with overlap_comm, `comm_overlap` of it runs during the backward (2/3 of the compute), out
  of what the gathers left: a micro-batch's compute hides communication once in all.
- param_gather: ZeRO-1/2 all-gather the updated parameters after the step; ZeRO-3 all-gathers
  each partitioned module's parameters at every use (forward; backward where it needs them;
  the target's forward), one call per module, prefetching so that `comm_overlap` of it runs
  during compute, and re-gathers each persistent trainable parameter after the step (one
  call each).
- offload_copy: optimizer offload moves each micro-batch's gradient partition to the host
  (fp32) and the updated partition back; parameter offload copies a partition to the device
  at every gather.
- optimizer: Adam over the rank's elements (all of them at ZeRO-0), on the device or, with
  optimizer offload, DeepSpeed's CPU Adam on the host.
- nvme: NVMe offload reads and writes the optimizer states (fp32 master + Adam m, v) every
  step, writes each micro-batch's fp32 gradient partition and reads it back for the step;
  with parameters on NVMe, reads the partition of every parameter DeepSpeed swaps (1 MiB or
  more) at each gather and writes the updated ones after the step; a node's drives serve its
  ranks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from dspark_ds.engine.config import ZeroSettings
from dspark_ds.tune.cluster import Machine, engine_mode
from dspark_ds.tune.inventory import Inventory, ModuleParams
from dspark_ds.tune.workload import Workload, target_in_job

SWAP_MIN_BYTES = 2**20
"""DeepSpeed swaps a parameter partition to NVMe only from this size (its MIN_AIO_BYTES, the
default aio block size)."""
TERMS = ("compute", "host_ops", "step_collectives", "engine", "zero3_hooks", "grad_reduce",
         "param_gather", "offload_copy", "optimizer", "nvme")  # fmt: skip


@dataclass
class StepTime:
    option: str
    nodes: int
    world: int
    accum: int
    """Micro-batches per rank and step."""
    sequences: int
    """Sequences per optimizer step (the global batch, or what the cluster must take)."""
    tokens_per_sequence: int
    terms: dict[str, float] = field(default_factory=dict)
    """Seconds per step by term (TERMS)."""
    in_step: dict[str, float] = field(default_factory=dict)
    """The part of each term spent in DeepSpeed's optimizer step (after the last backward);
    the rest is in the micro-batches."""
    note: str = ""

    @property
    def seconds(self) -> float:
        return sum(self.terms.values())

    @property
    def tokens_per_s(self) -> float:
        return self.sequences * self.tokens_per_sequence / self.seconds

    def as_dict(self) -> dict:
        return {
            "option": self.option,
            "nodes": self.nodes,
            "world": self.world,
            "accum": self.accum,
            "predicted_step_s": self.seconds,
            "tokens_per_s": self.tokens_per_s,
            "terms": dict(self.terms),
            "optimizer_step_s": sum(self.in_step.values()),
            "note": self.note,
        }


def accumulation(run_cfg, world: int) -> tuple[int, int, str]:
    """(micro-batches per rank and step, sequences per step, a note when the cluster cannot
    take the recipe's global batch as it is)."""
    micro, global_batch = run_cfg.data.batch_size, run_cfg.train.global_batch_size
    per_pass = micro * world
    if global_batch < per_pass:
        return (
            1,
            per_pass,
            (
                f"{world} ranks × micro-batch {micro} take {per_pass} sequences per step, more "
                f"than the global batch {global_batch}"
            ),
        )
    accum = global_batch // per_pass
    note = "" if global_batch % per_pass == 0 else (
        f"global batch {global_batch} is not a multiple of {per_pass}: {accum * per_pass} "
        "sequences per step"
    )  # fmt: skip
    return accum, accum * per_pass, note


def bus_seconds(machine: Machine, op: str, nbytes: float, world: int, nodes: int) -> float:
    """Bandwidth time of one ring collective over `nbytes` (the whole buffer)."""
    if world < 2 or nbytes <= 0:
        return 0.0
    _, bw = machine.collective(op, nodes)
    factor = 2 * (world - 1) / world if op == "all_reduce" else (world - 1) / world
    return factor * nbytes / bw


def partitioned_elements(module: ModuleParams, threshold: int) -> int:
    """Elements of a module's parameters ZeRO-3 partitions (larger than the persistence
    threshold)."""
    return sum(n for n in module.numels if n > threshold)


def zero3_gathers(
    inv: Inventory, zero: ZeroSettings, in_job: bool, min_numel: int = 0
) -> tuple[int, float]:
    """(all-gather calls, elements gathered) of one micro-batch under ZeRO-3: each module with
    partitioned parameters once in forward and, where its backward needs them, once in
    backward; the in-job target's modules once (its forward). `min_numel`: only parameters of
    more elements count (those DeepSpeed swaps to NVMe)."""
    calls, elements = 0, 0.0
    visits = [(m, 1 + int(m.backward)) for m in inv.drafter_param_modules]
    if in_job:
        visits += [(m, 1) for m in inv.target_param_modules]
    for module, times in visits:
        e = partitioned_elements(module, max(zero.param_persistence_threshold, min_numel))
        if e:
            calls += times
            elements += times * e
    return calls, elements


def step_time(
    option: str,
    zero: ZeroSettings,
    b: int,
    inv: Inventory,
    run_cfg,
    machine: Machine,
    nodes: int,
    wl: Workload,
    persistent: list[int],
) -> StepTime:
    """The option's step on `nodes` nodes of `machine` (see the module docstring)."""
    world = nodes * machine.gpus_per_node
    accum, sequences, note = accumulation(run_cfg, world)
    stage, m = zero.stage, machine
    P, tensors = inv.trainable, len(inv.trainable_numels)
    in_job = target_in_job(run_cfg)
    mode = engine_mode(stage, zero.offload_optimizer, zero.offload_param)
    latency = m.collective("all_reduce", nodes)[0] if world > 1 else 0.0
    t: dict[str, float] = dict.fromkeys(TERMS, 0.0)

    compute_micro = sum(wl.drafter_flops.values()) / (m.peak_flops * m.sustained_fraction)
    compute_micro += wl.target_flops / (m.peak_flops * m.target_sustained_fraction)
    t["compute"] = accum * compute_micro
    # host time of a micro-batch: the ops' dispatch, DeepSpeed's own, ZeRO-3's module hooks
    host = {
        "host_ops": (wl.drafter_ops + wl.target_ops) * m.op_overhead_s,
        "engine": m.engine_micro_s[mode],
        "zero3_hooks": 0.0,
    }
    if stage == 3:
        fwd_calls, bwd_calls = wl.drafter_calls
        host["zero3_hooks"] = (
            fwd_calls * m.engine_module_fwd_s[mode]
            + bwd_calls * m.engine_module_bwd_s[mode]
            + wl.target_calls * m.engine_target_module_s[mode]
        )
    # NOTE: on a GPU the host runs ahead of the device: only what exceeds its compute shows
    total_host = sum(host.values())
    shown = 1.0
    if m.dispatch_overlaps_compute and total_host > 0:
        shown = max(0.0, total_host - compute_micro) / total_host
    for key, value in host.items():
        t[key] = accum * value * shown
    t["engine"] += m.engine_step_s[mode]
    in_step = {"engine": m.engine_step_s[mode]}
    if not wl.collectives_timed:
        t["step_collectives"] = accum * 2 * latency

    # NOTE: communication hides behind a micro-batch's compute at most once in all (the
    # prefetched gathers first, the reduction during the backward with what is left), and
    # then only `comm_overlap` of it
    budget = compute_micro

    # gradients: ZeRO-1 reduces its fp32 accumulator, the others the compute dtype
    grad_bytes = P * (4 if stage == 1 else b)
    buckets = max(1, math.ceil(P / max(zero.reduce_bucket_size, 1)))
    extra = (buckets - 1) * latency
    # parameters
    ag_latency = m.collective("all_gather", nodes)[0] if world > 1 else 0.0
    gather_elements = 0.0
    if stage in (1, 2):
        gathers = max(1, math.ceil(P / max(zero.allgather_bucket_size, 1)))
        t["param_gather"] = bus_seconds(m, "all_gather", P * b, world, nodes)
        t["param_gather"] += (gathers - 1) * ag_latency
        in_step["param_gather"] = t["param_gather"]
    elif stage == 3:
        calls, gather_elements = zero3_gathers(inv, zero, in_job)
        gather = 0.0
        if world > 1:
            gather = calls * ag_latency + bus_seconds(
                m, "all_gather", gather_elements * b, world, nodes
            )
        if zero.prefetch_bucket_size > 0 and zero.overlap_comm:
            under = min(gather, budget)
            gather, budget = gather - m.comm_overlap * under, budget - under
        # the updated persistent parameters, one all-gather each
        after = len(persistent) * ag_latency if world > 1 else 0.0
        after += bus_seconds(m, "all_gather", sum(persistent) * b, world, nodes)
        t["param_gather"] = accum * gather + after
        in_step["param_gather"] = after

    if stage in (0, 1):
        t["grad_reduce"] = bus_seconds(m, "all_reduce", grad_bytes, world, nodes) + extra
    else:
        op = "all_reduce" if stage == 2 else "reduce_scatter"
        one = bus_seconds(m, op, grad_bytes, world, nodes) + extra
        if zero.overlap_comm:  # reduced bucket by bucket while the backward goes on
            one -= m.comm_overlap * min(one, budget, 2 / 3 * compute_micro)
        t["grad_reduce"] = accum * one

    # offload traffic (host <-> device) and the optimizer
    own = P / world if stage >= 1 else P
    if zero.offload_optimizer:
        t["offload_copy"] = (accum * own * 4 + own * b) / m.host_device_bytes_per_s
        in_step["offload_copy"] = own * b / m.host_device_bytes_per_s
        t["optimizer"] = own / m.cpu_adam_params_per_s
    else:
        t["optimizer"] = own / m.device_adam_params_per_s
        if stage == 0:
            t["optimizer"] += tensors * m.device_adam_tensor_s
    # a node's drives serve its ranks
    read_s = m.gpus_per_node / m.nvme_read_bytes_per_s
    write_s = m.gpus_per_node / m.nvme_write_bytes_per_s
    in_step["nvme"] = 0.0
    if zero.offload_param:
        per_micro = gather_elements / world * b
        if zero.offload_param == "nvme":
            swapped = zero3_gathers(inv, zero, in_job, min_numel=SWAP_MIN_BYTES * world // b)
            t["nvme"] += accum * swapped[1] / world * b * read_s
            updated = sum(
                partitioned_elements(mod, max(zero.param_persistence_threshold,
                                              SWAP_MIN_BYTES * world // b))
                for mod in inv.drafter_param_modules if mod.trainable
            )  # fmt: skip
            in_step["nvme"] += updated / world * b * write_s
            t["nvme"] += updated / world * b * write_s
        t["offload_copy"] += accum * per_micro / m.host_device_bytes_per_s
    if zero.offload_optimizer == "nvme":
        states = own * 12  # fp32 master, Adam m and v
        grads = own * 4 * accum  # each micro-batch's fp32 partition
        in_step["nvme"] += states * (read_s + write_s) + grads * read_s
        t["nvme"] += states * (read_s + write_s) + grads * (read_s + write_s)
    in_step["optimizer"] = t["optimizer"]
    return StepTime(
        option=option,
        nodes=nodes,
        world=world,
        accum=accum,
        sequences=sequences,
        tokens_per_sequence=run_cfg.data.max_length,
        terms=t,
        in_step=in_step,
        note=note,
    )
