"""Seconds of one optimizer step of one ZeRO option on a cluster, as a sum of named terms.

A step is `accum` micro-batches per rank (the recipe's global batch over micro-batch × ranks:
weak scaling of the micro-batch, the global batch held) and one optimizer step. b = bytes of
the compute dtype, P = trainable parameters, N = ranks, ring collectives (bus bytes: an
all-reduce moves 2(N-1)/N of its buffer over each rank's link, an all-gather or a
reduce-scatter (N-1)/N of the whole); across nodes the slower of NVLink and the network.

- compute: the micro-batch's matmul FLOPs (the drafter's for the option's loss path, the in-job
  target's forward) over peak × their sustained fractions.
- recompute: with activation checkpointing (perf.activation_checkpointing), the draft layers'
  forward FLOPs once more (the kind's `draft_layers_recompute`), at the drafter's rate; under
  ZeRO-3 the recomputation gathers each layer's partitioned modules once more (param_gather).
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
  call each). With hpZ (zero_hpz_partition_size h > 1) every gather reads the secondary
  partition over h consecutive ranks (a node's: NVLink, not the network) except each trainable
  parameter's first after a step (DeepSpeed drops their secondary partitions in the step): the
  first micro-batch's forward gathers the drafter's trainable modules across the world, every
  other gather of the step — the frozen target's and embedding / lm_head's always — within
  the group; the gradients' reduce-scatter stays global.
- offload_copy: optimizer offload moves each micro-batch's gradient partition to the host
  (fp32) and the updated partition back; parameter offload copies a partition to the device
  at every gather.
- optimizer: Adam over the rank's elements (all of them at ZeRO-0), on the device or, with
  optimizer offload, DeepSpeed's CPU Adam on the host.
- data_read: an offline cache's features, read by a node's ranks at the node's read bandwidth
  (dataio.py); with loader workers only what exceeds the rest of the step.
- nvme: NVMe offload reads and writes the optimizer states (fp32 master + Adam m, v) every
  step, writes each micro-batch's fp32 gradient partition and reads it back for the step;
  with parameters on NVMe, reads the partition of every parameter DeepSpeed swaps (1 MiB or
  more) at each gather and writes the updated ones after the step; a node's drives serve its
  ranks.

Each term is one function of the option's `Step` (`TERM_FUNCTIONS`); `step_time` adds them up.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import NamedTuple

from dspark_ds.cost.inventory import Inventory, ModuleParams
from dspark_ds.drafters.common.memory import LAYERS_RECOMPUTE
from dspark_ds.engine.config import ZeroSettings
from dspark_ds.tune.cluster import Machine, engine_mode
from dspark_ds.tune.workload import Workload

SWAP_MIN_BYTES = 2**20
"""DeepSpeed swaps a parameter partition to NVMe only from this size (its MIN_AIO_BYTES, the
default aio block size)."""


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
            "sequences": self.sequences,
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
    note = ""
    if global_batch % per_pass != 0:
        note = (
            f"global batch {global_batch} is not a multiple of {per_pass}: {accum * per_pass} "
            "sequences per step"
        )
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
    inv: Inventory,
    zero: ZeroSettings,
    in_job: bool,
    min_numel: int = 0,
    first_forward: bool | None = None,
    recompute: bool = False,
) -> tuple[int, float]:
    """(all-gather calls, elements gathered) of one micro-batch under ZeRO-3: each module with
    partitioned parameters once in forward and, where its backward needs them, once in
    backward; the in-job target's modules once (its forward). `min_numel`: only parameters of
    more elements count (those DeepSpeed swaps to NVMe). `first_forward` True: only the
    forward gathers of trainable modules (hpZ's global ones); False: all the others.
    `recompute`: the decoder layers' modules once more (their forward runs again in backward)."""
    calls, elements = 0, 0.0
    visits = [
        (m, 1 + int(m.backward) + int(recompute and m.in_layers)) for m in inv.drafter_param_modules
    ]
    if in_job:
        visits += [(m, 1) for m in inv.target_param_modules]
    if first_forward is not None:
        trainable_fwd = [(m, 1) for m, _ in visits if m.trainable]
        if first_forward:
            visits = trainable_fwd
        else:
            visits = [(m, times - int(m.trainable)) for m, times in visits]
    for module, times in visits:
        e = partitioned_elements(module, max(zero.param_persistence_threshold, min_numel))
        if e and times:
            calls += times
            elements += times * e
    return calls, elements


@dataclass(frozen=True)
class Step:
    """One option's optimizer step on a cluster: what every term reads."""

    option: str
    zero: ZeroSettings
    dtype_bytes: int
    """Bytes of the compute dtype (2 under bf16, 4 under fp32)."""
    inv: Inventory
    machine: Machine
    nodes: int
    workload: Workload
    """One micro-batch of one rank."""
    persistent_numels: tuple[int, ...]
    """The trainable parameters ZeRO-3 keeps whole (each re-gathered after the step)."""
    accum: int
    """Micro-batches per rank and step."""
    sequences: int
    """Sequences per optimizer step (the global batch, or what the cluster must take)."""
    tokens_per_sequence: int
    in_job: bool
    """The target runs in the job (its forward, its modules)."""
    note: str = ""
    read_bytes_per_micro: float = 0.0
    """Bytes one rank's micro-batch reads from an offline cache (0: the run reads none)."""
    loader_workers: int = 0
    """data.num_workers: with workers the reads run ahead of the step."""
    recompute: bool = False
    """perf.activation_checkpointing: the draft layers run their forward again in backward."""

    @property
    def world(self) -> int:
        return self.nodes * self.machine.gpus_per_node

    @property
    def mode(self) -> int:
        z = self.zero
        return engine_mode(z.stage, z.offload_optimizer, z.offload_param)

    def latency(self, op: str) -> float:
        """One call of collective `op` (0 on one rank)."""
        return self.machine.collective(op, self.nodes)[0] if self.world > 1 else 0.0

    def bus(self, op: str, nbytes: float) -> float:
        return bus_seconds(self.machine, op, nbytes, self.world, self.nodes)

    @property
    def hpz_ranks(self) -> int:
        """hpZ's group: consecutive ranks, a node's when it is the node's size (1: off)."""
        return min(self.zero.hpz_partition_size, self.world) if self.zero.stage == 3 else 1

    @property
    def hpz_nodes(self) -> int:
        """Nodes one hpZ group spans."""
        return math.ceil(self.hpz_ranks / self.machine.gpus_per_node)

    @property
    def compute_per_micro_s(self) -> float:
        """A micro-batch's matmul FLOPs over the sustained rates."""
        m, wl = self.machine, self.workload
        drafter = sum(wl.drafter_flops.values()) / drafter_rate(self)
        return drafter + wl.target_flops / (m.peak_flops * m.target_sustained_fraction)

    @property
    def own_elements(self) -> float:
        """Trainable elements this rank's optimizer updates (all of them at ZeRO-0)."""
        return self.inv.trainable / self.world if self.zero.stage >= 1 else self.inv.trainable


class Term(NamedTuple):
    seconds: float
    """Per optimizer step."""
    in_step: float = 0.0
    """Of which in DeepSpeed's optimizer step (after the last backward)."""


# ---- compute and host time ------------------------------------------------------------------
def drafter_rate(s: Step) -> float:
    return s.machine.peak_flops * s.machine.sustained_fraction


def compute(s: Step) -> Term:
    recomputed = s.workload.drafter_flops.get(LAYERS_RECOMPUTE, 0.0) / drafter_rate(s)
    return Term(s.accum * (s.compute_per_micro_s - recomputed))


def recompute(s: Step) -> Term:
    """The draft layers' forward, run again in backward under activation checkpointing."""
    return Term(s.accum * s.workload.drafter_flops.get(LAYERS_RECOMPUTE, 0.0) / drafter_rate(s))


def host_per_micro(s: Step) -> dict[str, float]:
    """Host seconds of a micro-batch: the ops' dispatch, DeepSpeed's own, ZeRO-3's module
    hooks."""
    m, wl, mode = s.machine, s.workload, s.mode
    hooks = 0.0
    if s.zero.stage == 3:
        fwd_calls, bwd_calls = wl.drafter_calls
        hooks = (
            fwd_calls * m.engine_module_fwd_s[mode]
            + bwd_calls * m.engine_module_bwd_s[mode]
            + wl.target_calls * m.engine_target_module_s[mode]
        )
    return {
        "host_ops": (wl.drafter_ops + wl.target_ops) * m.op_overhead_s,
        "engine": m.engine_micro_s[mode],
        "zero3_hooks": hooks,
    }


def host_shown(s: Step) -> float:
    """The share of the host time that adds to the step. NOTE: on a GPU the host runs ahead of
    the device: only what exceeds its compute shows."""
    total = sum(host_per_micro(s).values())
    if not s.machine.dispatch_overlaps_compute or total <= 0:
        return 1.0
    return max(0.0, total - s.compute_per_micro_s) / total


def host_ops(s: Step) -> Term:
    return Term(s.accum * host_per_micro(s)["host_ops"] * host_shown(s))


def zero3_hooks(s: Step) -> Term:
    return Term(s.accum * host_per_micro(s)["zero3_hooks"] * host_shown(s))


def engine(s: Step) -> Term:
    micro = s.accum * host_per_micro(s)["engine"] * host_shown(s)
    step = s.machine.engine_step_s[s.mode]
    return Term(micro + step, step)


def step_collectives(s: Step) -> Term:
    """The loss's two small all-reduces per micro-batch, unless the timed host work holds
    them."""
    if s.workload.collectives_timed:
        return Term(0.0)
    return Term(s.accum * 2 * s.latency("all_reduce"))


# ---- communication --------------------------------------------------------------------------
# NOTE: communication hides behind a micro-batch's compute at most once in all (the prefetched
# gathers first, the reduction during the backward with what is left), and then only
# `comm_overlap` of it
def gather_s(s: Step, calls: int, elements: float, ranks: int, nodes: int) -> float:
    """Latency and bandwidth of `calls` all-gathers of `elements` in all over `ranks` ranks on
    `nodes` nodes."""
    if ranks < 2 or not calls:
        return 0.0
    latency = s.machine.collective("all_gather", nodes)[0]
    nbytes = elements * s.dtype_bytes
    return calls * latency + bus_seconds(s.machine, "all_gather", nbytes, ranks, nodes)


def zero3_gather_per_micro_s(s: Step) -> float:
    """Latency and bandwidth of a micro-batch's ZeRO-3 all-gathers (with hpZ, the step's over
    its micro-batches: the first forward's trainable gathers are global)."""
    if s.world < 2:
        return 0.0
    if s.hpz_ranks < 2:
        gathers = zero3_gathers(s.inv, s.zero, s.in_job, recompute=s.recompute)
        return gather_s(s, *gathers, s.world, s.nodes)
    first = zero3_gathers(s.inv, s.zero, s.in_job, first_forward=True)
    rest = zero3_gathers(s.inv, s.zero, s.in_job, first_forward=False, recompute=s.recompute)
    group = (s.hpz_ranks, s.hpz_nodes)
    step = gather_s(s, *first, s.world, s.nodes) + (s.accum - 1) * gather_s(s, *first, *group)
    step += s.accum * gather_s(s, *rest, *group)
    return step / s.accum


def prefetched_s(s: Step) -> float:
    """The part of a micro-batch's compute ZeRO-3's prefetched gathers run under."""
    z = s.zero
    if z.stage != 3 or not (z.prefetch_bucket_size > 0 and z.overlap_comm):
        return 0.0
    return min(zero3_gather_per_micro_s(s), s.compute_per_micro_s)


def param_gather(s: Step) -> Term:
    z, b, P = s.zero, s.dtype_bytes, s.inv.trainable
    if z.stage in (1, 2):  # the updated parameters, after the step
        gathers = max(1, math.ceil(P / max(z.allgather_bucket_size, 1)))
        after = s.bus("all_gather", P * b) + (gathers - 1) * s.latency("all_gather")
        return Term(after, after)
    if z.stage != 3:
        return Term(0.0)
    per_micro = zero3_gather_per_micro_s(s) - s.machine.comm_overlap * prefetched_s(s)
    # the updated persistent parameters, one all-gather each
    after = len(s.persistent_numels) * s.latency("all_gather")
    after += s.bus("all_gather", sum(s.persistent_numels) * b)
    return Term(s.accum * per_micro + after, after)


def grad_reduce(s: Step) -> Term:
    """In reduce_bucket_size buckets (one latency each beyond the first, which `engine`
    holds)."""
    z, P = s.zero, s.inv.trainable
    grad_bytes = P * (4 if z.stage == 1 else s.dtype_bytes)  # ZeRO-1: its fp32 accumulator
    buckets = max(1, math.ceil(P / max(z.reduce_bucket_size, 1)))
    extra = (buckets - 1) * s.latency("all_reduce")
    if z.stage in (0, 1):
        return Term(s.bus("all_reduce", grad_bytes) + extra)
    op = "all_reduce" if z.stage == 2 else "reduce_scatter"
    one = s.bus(op, grad_bytes) + extra
    if z.overlap_comm:  # reduced bucket by bucket while the backward goes on
        budget = s.compute_per_micro_s - prefetched_s(s)
        one -= s.machine.comm_overlap * min(one, budget, 2 / 3 * s.compute_per_micro_s)
    return Term(s.accum * one)


# ---- offload, the optimizer, NVMe -------------------------------------------------------------
def offload_copy(s: Step) -> Term:
    z, b, h2d = s.zero, s.dtype_bytes, s.machine.host_device_bytes_per_s
    seconds = in_step = 0.0
    if z.offload_optimizer:  # each micro-batch's fp32 gradient out, the updated partition back
        own = s.own_elements
        seconds = (s.accum * own * 4 + own * b) / h2d
        in_step = own * b / h2d
    if z.offload_param:  # a partition to the device at every gather
        gathers = zero3_gathers(s.inv, z, s.in_job, recompute=s.recompute)
        elements = gathers[1] if z.stage == 3 else 0.0
        seconds += s.accum * (elements / s.world * b) / h2d
    return Term(seconds, in_step)


def optimizer(s: Step) -> Term:
    m = s.machine
    if s.zero.offload_optimizer:
        seconds = s.own_elements / m.cpu_adam_params_per_s
    else:
        seconds = s.own_elements / m.device_adam_params_per_s
        if s.zero.stage == 0:
            seconds += len(s.inv.trainable_numels) * m.device_adam_tensor_s
    return Term(seconds, seconds)


def nvme(s: Step) -> Term:
    """A node's drives serve its ranks."""
    z, b, m, world = s.zero, s.dtype_bytes, s.machine, s.world
    read_s = m.gpus_per_node / m.nvme_read_bytes_per_s
    write_s = m.gpus_per_node / m.nvme_write_bytes_per_s
    seconds = in_step = 0.0
    if z.offload_param == "nvme":
        swapped_min = SWAP_MIN_BYTES * world // b
        swapped = zero3_gathers(s.inv, z, s.in_job, swapped_min, recompute=s.recompute)[1]
        seconds += s.accum * swapped / world * b * read_s
        updated = sum(
            partitioned_elements(mod, max(z.param_persistence_threshold, swapped_min))
            for mod in s.inv.drafter_param_modules
            if mod.trainable
        )
        in_step += updated / world * b * write_s
        seconds += updated / world * b * write_s
    if z.offload_optimizer == "nvme":
        states = s.own_elements * 12  # fp32 master, Adam m and v
        grads = s.own_elements * 4 * s.accum  # each micro-batch's fp32 partition
        in_step += states * (read_s + write_s) + grads * read_s
        seconds += states * (read_s + write_s) + grads * (read_s + write_s)
    return Term(seconds, in_step)


# ---- the data ---------------------------------------------------------------------------------
def data_read(s: Step) -> Term:
    """An offline cache's reads: the node's ranks read their micro-batches' features together
    at the node's read bandwidth; with loader workers the reads run ahead, and only what
    exceeds the rest of the step shows."""
    if s.read_bytes_per_micro <= 0:
        return Term(0.0)
    m = s.machine
    read = s.accum * s.read_bytes_per_micro * m.gpus_per_node / m.cache_read_bytes_per_s
    if not s.loader_workers:
        return Term(read)
    rest = sum(f(s).seconds for name, f in TERM_FUNCTIONS.items() if name != "data_read")
    return Term(max(0.0, read - rest))


TERM_FUNCTIONS = {
    "compute": compute,
    "recompute": recompute,
    "host_ops": host_ops,
    "step_collectives": step_collectives,
    "engine": engine,
    "zero3_hooks": zero3_hooks,
    "grad_reduce": grad_reduce,
    "param_gather": param_gather,
    "offload_copy": offload_copy,
    "optimizer": optimizer,
    "nvme": nvme,
    "data_read": data_read,
}
TERMS = tuple(TERM_FUNCTIONS)


def step_time(s: Step) -> StepTime:
    """The option's step (see the module docstring): the sum of its terms."""
    terms = {name: term(s) for name, term in TERM_FUNCTIONS.items()}
    return StepTime(
        option=s.option,
        nodes=s.nodes,
        world=s.world,
        accum=s.accum,
        sequences=s.sequences,
        tokens_per_sequence=s.tokens_per_sequence,
        terms={name: t.seconds for name, t in terms.items()},
        in_step={name: t.in_step for name, t in terms.items()},
        note=s.note,
    )
