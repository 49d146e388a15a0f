"""`--cluster.calibrate`: measures, on this machine and the launcher's ranks, every rate the
step-time model divides by, and returns them as Machine fields (a profile).

All ranks measure at once (ranks of a node share its cores, memory bandwidth and links, as in
training); each figure is the slowest rank's. What is measured:

- peak_flops: an [n × n] matmul in the compute dtype; sustained_fraction: a training
  micro-batch of the recipe's drafter kind, one draft layer at the recipe's widths, sequence
  and anchors (capped for the device: `reference_shape`), its FLOPs by the kind's own count
  over its time less its host time (the same step 32 wide), as a share of that peak;
  target_sustained_fraction: the same for a frozen target's forward, a few layers deep.
- the three collectives of ZeRO (all-reduce, all-gather, reduce-scatter) on the process group:
  latency from a one-element call, bus bandwidth from a large one.
- the optimizers: torch's AdamW per element (one flat tensor, as ZeRO-1/2/3 hand it) and per
  tensor (as plain data parallelism hands it the parameter list), DeepSpeed's CPU Adam per
  element (the optimizer of an offloaded run).
- host time per dispatched op: a small Qwen3 model's forward + backward (the stand-in,
  workload.py), whose ops are counted, at a width where the arithmetic takes no time; and the
  recipe's own host work in those ops (its drafter and target 32 wide, workload.NarrowCopies).
- what DeepSpeed adds, per engine mode (ZeRO stage × offload): the recipe's drafter 32 wide
  under a real engine of that mode against the same drafter in plain PyTorch, per micro-batch
  and per step; under ZeRO-3 per module call (forward and backward: its hooks run on every
  call; at 32 wide every parameter is under the persistence threshold, so none of it is
  all-gather traffic) and per module call of the target 32 wide under its own optimizer-less
  engine, called as training calls it. The module calls are counted on the same copies.
- once: host <-> device copies (pinned on CUDA; on a CPU-only machine a RAM-to-RAM copy, what
  DeepSpeed's offload does when the device is the host), NVMe write and read through
  DeepSpeed's asynchronous I/O on the directory NVMe offload would use (every rank at once,
  when one is given), and comm_overlap (a large all-gather issued during a matmul on CUDA; on
  a CPU the collectives' copies run on the cores that compute, so none is hidden: 0).

Everything but the "once" part is measured in samples (`Calibration.sample`), each a single
pass over every workload, and each figure is the median over the samples. `--measure`
interleaves them with each option's timed steps (a sample before each block of steps, with that
option's engine mode), so that an option's prediction and its measurement see the same
conditions on a machine shared with other jobs; a calibration on its own takes its samples
back to back, for every engine mode. Not measured: the network between nodes (one node); it
keeps the preset's figures and the profile leaves it out.
"""

from __future__ import annotations

import datetime
import os
import platform
import socket
import statistics
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch

from dspark_ds import distributed
from dspark_ds.tune.cluster import ENGINE_MODES, GIB, TUPLE_FIELDS
from dspark_ds.tune.config import OPTIONS
from dspark_ds.tune.workload import NarrowCopies, OpCounter, stand_in_model

_MODE_OPTIONS = (
    "zero0",
    "zero1",
    "zero2",
    "zero2+offload_opt",
    "zero3",
    "zero3+offload_opt",
    "zero3+offload_opt+param",
)
ENGINE_OPTIONS = dict(zip(ENGINE_MODES, _MODE_OPTIONS))
REPEATS = 3
"""Timings of a host-bound workload per sample (the median is kept)."""
NVME_PROBE_BYTES = 32 * 2**20
"""Bytes each rank writes and reads to measure NVMe."""


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def max_over_ranks(values: list[float]) -> list[float]:
    return distributed.all_reduce_values(values, op="max")


def timed(fn: Callable[[], object], device: torch.device, repeats: int = 1) -> float:
    """Median seconds of `fn` over `repeats` calls, every rank starting each together; this
    rank's (callers take the slowest rank's, several figures at once)."""
    times = []
    for _ in range(repeats):
        distributed.barrier()
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


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
    from dspark_ds.cost.inventory import target_config_of
    from dspark_ds.drafters.common.target_config import global_attr, text_config

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
    from dspark_ds.cost.inventory import target_config_of
    from dspark_ds.tune.workload import narrow_config, resized_config

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
        from dspark_ds.cost.flops import forward_flops
        from dspark_ds.drafters.common.memory import StepShape
        from dspark_ds.drafters.common.target_config import global_attr, text_config
        from dspark_ds.drafters.registry import get_kind
        from dspark_ds.target import default_layer_ids
        from dspark_ds.tune.workload import KindStep, TargetForward, counted_perf

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
        shape = StepShape(
            batch=1,
            seq_len=r["seq_len"],
            hidden=r["hidden"],
            intermediate=r["intermediate"],
            vocab=r["vocab"],
            heads=r["heads"],
            kv_heads=int(global_attr(text, "num_key_value_heads")),
            head_dim=r["head_dim"],
            draft_layers=r["draft_layers"],
            taps=len(layer_ids),
            drafter=kind.step_part(model),
            compute_bytes=torch.tensor([], dtype=dtype).element_size(),
            feature_bytes=torch.tensor([], dtype=dtype).element_size(),
        )
        self.drafter_flops = sum(kind.step_flops(shape, perf, device.type, 0).values())
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


# ---- communication --------------------------------------------------------------------------
class Collectives:
    """Latency (1 element) and bus bandwidth (a large buffer) of each ZeRO collective."""

    OPS = ("all_reduce", "all_gather", "reduce_scatter")

    def __init__(self, device: torch.device, dtype: torch.dtype):
        import torch.distributed as dist

        self.device, self.world = device, distributed.world_size()
        self.numel = (64 if device.type == "cuda" else 2) * 2**20
        self.elem = torch.tensor([], dtype=dtype).element_size()
        self.calls = {}
        for n in (1, self.numel):
            full = torch.zeros(n * self.world, device=device, dtype=dtype)
            part = torch.zeros(n, device=device, dtype=dtype)
            self.calls[n] = {
                "all_reduce": lambda p=part: dist.all_reduce(p),
                "all_gather": lambda f=full, p=part: dist.all_gather_into_tensor(f, p),
                "reduce_scatter": lambda f=full, p=part: dist.reduce_scatter_tensor(p, f),
            }
        self.sample()  # warm-up

    def sample(self) -> dict[str, float]:
        t = []
        for op in self.OPS:
            t += [
                timed(self.calls[1][op], self.device, 3),
                timed(self.calls[self.numel][op], self.device),
            ]
        t = max_over_ranks(t)
        out: dict[str, float] = {}
        world = self.world
        for i, op in enumerate(self.OPS):
            small, large = t[2 * i], t[2 * i + 1]
            out[f"{op}_latency_s"] = small
            # bytes each rank moves over its link: ring all-reduce 2(N-1)/N of the buffer, the
            # others (N-1)/N of the gathered / scattered whole
            factor = 2 * (world - 1) / world if op == "all_reduce" else (world - 1) / world
            moved = factor * self.numel * self.elem * (1 if op == "all_reduce" else world)
            out[f"{op}_bytes_per_s"] = moved / max(large - small, 1e-9)
        out["collective_latency_s"] = statistics.median(out[f"{op}_latency_s"] for op in self.OPS)
        return out


def host_device_copy(device: torch.device) -> float:
    """Bytes/s of one rank's host <-> device copies (the slower direction); on a CPU-only
    machine a RAM-to-RAM copy (what DeepSpeed's offload does when the device is the host)."""
    numel = 32 * 2**20
    if device.type == "cuda":
        host = torch.empty(numel, dtype=torch.float32, pin_memory=True)
        dev = torch.empty(numel, dtype=torch.float32, device=device)
        h2d = timed(lambda: dev.copy_(host, non_blocking=True), device, repeats=5)
        d2h = timed(lambda: host.copy_(dev, non_blocking=True), device, repeats=5)
        return numel * 4 / max_over_ranks([max(h2d, d2h)])[0]
    src, dst = torch.ones(numel), torch.empty(numel)
    return numel * 4 / max_over_ranks([timed(lambda: dst.copy_(src), device, repeats=5)])[0]


def comm_overlap(device: torch.device, dtype: torch.dtype) -> float:
    """Share of an all-gather hidden behind a matmul issued while it runs (0..1)."""
    import torch.distributed as dist

    world = distributed.world_size()
    n = 4096 if device.type == "cuda" else 768
    a = torch.randn(n, n, device=device, dtype=dtype)
    part = torch.zeros(2**20 * (16 if device.type == "cuda" else 1), device=device, dtype=dtype)
    full = torch.zeros(part.numel() * world, device=device, dtype=dtype)

    def both():
        work = dist.all_gather_into_tensor(full, part, async_op=True)
        a @ a
        work.wait()

    t_mm, t_comm, t_both = max_over_ranks(
        [
            timed(fn, device, repeats=3)
            for fn in (lambda: a @ a, lambda: dist.all_gather_into_tensor(full, part), both)
        ]
    )
    hidden = t_mm + t_comm - t_both
    return float(min(1.0, max(0.0, hidden / max(min(t_mm, t_comm), 1e-9))))


def nvme_rates(directory: str | Path, aio: dict | None, ranks_per_node: int) -> dict[str, float]:
    """A node's NVMe write and read bytes/s through DeepSpeed's asynchronous I/O under
    `directory`, every rank at once (the node's drives serve its ranks): the median of three
    write + read pairs per rank, the slowest rank's, times the ranks."""
    from dspark_ds.engine.probes import aio_bandwidth

    Path(directory).mkdir(parents=True, exist_ok=True)
    pairs = []
    for _ in range(3):
        distributed.barrier()
        pairs.append(aio_bandwidth(directory, NVME_PROBE_BYTES, aio))
    write, read = max_over_ranks([statistics.median(p[i] for p in pairs) for i in (0, 1)])
    return {
        "nvme_write_bytes_per_s": ranks_per_node * NVME_PROBE_BYTES / write,
        "nvme_read_bytes_per_s": ranks_per_node * NVME_PROBE_BYTES / read,
    }


# ---- optimizers -------------------------------------------------------------------------------
class Optimizers:
    """torch's AdamW over one flat tensor (as ZeRO hands it) and over 200 small ones (as plain
    data parallelism hands it the parameter list); DeepSpeed's CPU Adam over a flat one."""

    NUMEL, TENSORS, SMALL = 4 * 2**20, 200, 256

    def __init__(self, device: torch.device):
        from dspark_ds.engine.probes import cpu_adam

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


# ---- host time per op, the recipe's host work, what DeepSpeed adds ----------------------------
class HostWork:
    """The stand-in (workload.stand_in_model, 2 layers) in plain PyTorch, its ops counted: the
    host time per op; and the recipe's drafter (each loss path and anchor point) and target 32
    wide (workload.NarrowCopies) timed beside it: their work in stand-in ops."""

    def __init__(self, run_cfg, stages: tuple[int, ...], device: torch.device, dtype):
        self.device = device
        self.model = stand_in_model(2, dtype)().to(device).train()
        self.ids = torch.randint(0, 64, (1, 32), device=device)
        with OpCounter() as counter:
            self.stand_in()
        self.ops = counter.ops
        run_on = distributed.collective_device() if distributed.has_group() else device
        # NOTE: in the run's dtype, as the stand-in: the engine windows build their drafter
        # from these copies (an fp32 copy under a bf16 ZeRO-3 engine with offloaded
        # parameters keeps fp32 weights)
        self.copies = NarrowCopies(run_cfg, stages, device.type, run_on, dtype)
        self.counts = self.copies.counts()
        self.sample()  # warm-up

    def stand_in(self) -> None:
        self.model(input_ids=self.ids).last_hidden_state.float().pow(2).mean().backward()
        self.model.zero_grad(set_to_none=True)

    def sample(self) -> dict:
        d = self.device
        # NOTE: each figure this rank's median of REPEATS, then the slowest rank's: a single
        # timing's noise, maximised over ranks, biases the host work upwards
        t = [timed(self.stand_in, d, REPEATS)]
        layout = []
        for stage, steps in self.copies.steps.items():
            for i, step in enumerate(steps):
                t.append(timed(step, d, REPEATS))
                layout.append((stage, i))
        with torch.no_grad():
            t.append(timed(self.copies.target, d, REPEATS))
        t = max_over_ranks(t)
        per_op = t[0] / self.ops
        work: dict = {"drafter": {}}
        for stage, steps in self.copies.steps.items():
            work["drafter"][stage] = [0.0] * len(steps)
        for (stage, i), seconds in zip(layout, t[1:-1]):
            work["drafter"][stage][i] = seconds / per_op
        work["target"] = t[-1] / per_op
        return {"op_overhead_s": per_op, "work": work}


class EngineWindow:
    """What DeepSpeed adds in one engine mode (ENGINE_MODES): the recipe's drafter 32 wide
    under a real engine of that mode against the plain copy (`HostWork`'s), per micro-batch and
    per step, and under ZeRO-3 the target 32 wide under its own optimizer-less engine against
    the plain one. The engines live until `close`."""

    def __init__(self, run_cfg, host: HostWork, mode: int, target_in_job: bool):
        from dspark_ds.engine.config import build_ds_config
        from dspark_ds.engine.probes import frozen_engine, plain_engine
        from dspark_ds.tune.estimate import option_overrides

        self.mode, self.host = mode, host
        self.zero3 = ENGINE_MODES[mode].startswith("zero3")
        stage = 3 if self.zero3 else 0
        steps = host.copies.steps.get(stage) or next(iter(host.copies.steps.values()))
        self.step = steps[-1]
        self.calls = host.counts["calls"]["drafter"].get(stage, (1, 1))
        self.point = len(steps) - 1
        world, B = distributed.world_size(), run_cfg.data.batch_size
        option = {o.name: o for o in OPTIONS}[ENGINE_OPTIONS[ENGINE_MODES[mode]]]
        ds_config = build_ds_config(
            replace(
                run_cfg.deepspeed, config=option.config, overrides=option_overrides(option, run_cfg)
            ),
            replace(run_cfg.train, global_batch_size=B * world),
            micro_batch_size=B,
            world_size=world,
            use_gpu=host.device.type == "cuda",
        )
        self.engine = plain_engine(self.step.make, ds_config)
        self.plain_opt = torch.optim.AdamW(
            [p for p in self.step.model.parameters() if p.requires_grad], lr=1e-4
        )
        self.tensors = sum(1 for p in self.step.model.parameters() if p.requires_grad)
        self.target = self.target_engine = None
        if self.zero3 and target_in_job:
            self.target = host.copies.target.make()
            self.target_engine = frozen_engine(self.target, ds_config)
        self.sample()  # warm-up

    def _phases(self, model, backward, step) -> list[float]:
        """Forward + loss, backward and step seconds: each this rank's median of REPEATS."""
        d = self.host.device
        runs = []
        for _ in range(REPEATS):
            distributed.barrier()
            _sync(d)
            t0 = time.perf_counter()
            loss = self.step.loss(model)
            _sync(d)
            t1 = time.perf_counter()
            backward(loss)
            _sync(d)
            t2 = time.perf_counter()
            step()
            _sync(d)
            runs.append((t1 - t0, t2 - t1, time.perf_counter() - t2))
        return [statistics.median(r[i] for r in runs) for i in range(3)]

    def sample(self, ag_latency: float = 0.0) -> dict[str, float]:
        """One pass: plain and engine forward, backward and step of the drafter copy (and the
        target's forward under ZeRO-3) -> (micro-batch, step, per forward call, per backward
        call, per target call) seconds added."""
        plain_model = self.step.model

        def plain_step():
            self.plain_opt.step()
            plain_model.zero_grad(set_to_none=True)

        t = self._phases(plain_model, lambda loss: loss.backward(), plain_step)
        t += self._phases(self.engine, self.engine.backward, self.engine.step)
        if self.target is not None:
            copy = self.host.copies.target
            with torch.no_grad():
                t += [
                    timed(copy, self.host.device, REPEATS),
                    timed(lambda: copy.run(self.target), self.host.device, REPEATS),
                ]
        t = max_over_ranks(t)
        fwd, bwd, step = (max(0.0, e - p) for e, p in zip(t[3:6], t[0:3]))
        out = dict.fromkeys(("micro", "step", "fwd_call", "bwd_call", "target_call"), 0.0)
        if not self.zero3:
            out["micro"], out["step"] = fwd + bwd, step
            return out
        # NOTE: ZeRO-3 refreshes each persistent parameter after the step, one all-gather each:
        # the model counts those apart (param_gather)
        out["step"] = max(0.0, step - self.tensors * ag_latency)
        out["fwd_call"] = fwd / max(self.calls[0], 1)
        out["bwd_call"] = bwd / max(self.calls[1], 1)
        if self.target is not None:
            target_calls = max(self.host.counts["calls"]["target"], 1)
            out["target_call"] = max(0.0, t[7] - t[6]) / target_calls
        return out

    def close(self) -> None:
        from dspark_ds.engine.probes import release_engine

        release_engine(self.engine)
        if self.target_engine is not None:
            release_engine(self.target_engine)
        self.engine = self.target_engine = self.target = None


# ---- the whole calibration ---------------------------------------------------------------------
def host_memory_bytes() -> float:
    try:
        for line in open("/proc/meminfo"):
            if line.startswith("MemTotal:"):
                return float(line.split()[1]) * 1024
    except OSError:
        pass
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


ENGINE_KEYS = {
    "micro": "engine_micro_s",
    "step": "engine_step_s",
    "fwd_call": "engine_module_fwd_s",
    "bwd_call": "engine_module_bwd_s",
    "target_call": "engine_target_module_s",
}


class Calibration:
    """The measurements of one calibration on every rank of the group: the "once" part, then
    samples (`sample`), each with the engine mode of an open `window`; `values` turns samples
    into Machine fields and host work."""

    def __init__(self, run_cfg, device: torch.device, stages: tuple[int, ...]):
        from dspark_ds.cost.flops import target_in_job

        self.run_cfg, self.device, self.stages = run_cfg, device, stages
        self.dtype = torch.bfloat16 if run_cfg.train.precision == "bf16" else torch.float32
        self.in_job = target_in_job(run_cfg)
        self.load = [os.getloadavg()[0]]
        self.spent = 0.0
        self.samples: list[dict] = []
        self.fixed: dict = {}
        t0 = time.perf_counter()
        self.host = HostWork(run_cfg, stages, device, self.dtype)
        self.compute = Compute(run_cfg, device, self.dtype)
        self.collectives = Collectives(device, self.dtype) if distributed.world_size() > 1 else None
        self.optimizers = Optimizers(device)
        self.spent += time.perf_counter() - t0

    def once(self, nvme_dir: str | Path | None = None, aio: dict | None = None) -> None:
        """What does not follow the load much: copies, overlap; NVMe under `nvme_dir`."""
        t0 = time.perf_counter()
        device, dtype = self.device, self.dtype
        self.fixed["host_device_bytes_per_s"] = host_device_copy(device)
        if device.type == "cuda" and distributed.world_size() > 1:
            self.fixed["comm_overlap"] = comm_overlap(device, dtype)
        elif device.type != "cuda":
            # NOTE: gloo's copies run on the cores that compute: a ZeRO-3 step on a CPU hides
            # none of its all-gathers (a matmul beside an idle core would suggest otherwise)
            self.fixed["comm_overlap"] = 0.0
        if nvme_dir is not None:
            self.fixed.update(nvme_rates(nvme_dir, aio, ranks_per_node()))
        self.spent += time.perf_counter() - t0

    def window(self, mode: int) -> EngineWindow:
        t0 = time.perf_counter()
        window = EngineWindow(self.run_cfg, self.host, mode, self.in_job)
        self.spent += time.perf_counter() - t0
        return window

    def sample(self, window: EngineWindow) -> dict:
        """One pass over every load-following workload and `window`'s engine."""
        t0 = time.perf_counter()
        got = {"mode": window.mode}
        got.update(self.compute.sample())
        if self.collectives is not None:
            got.update(self.collectives.sample())
        got.update(self.optimizers.sample())
        got.update(self.host.sample())
        got["engine"] = window.sample(got.get("all_gather_latency_s", 0.0))
        self.samples.append(got)
        self.load.append(os.getloadavg()[0])
        self.spent += time.perf_counter() - t0
        return got

    def run(self, modes: list[int], samples: int = 3) -> None:
        """A calibration on its own: the once part, then `samples` samples in each mode."""
        from tqdm import tqdm

        self.once()
        for mode in tqdm(
            modes, desc="calibrating", unit="mode", disable=not distributed.is_rank0()
        ):
            window = self.window(mode)
            for _ in range(samples):
                self.sample(window)
            window.close()

    def values(self, samples: list[dict] | None = None) -> tuple[dict, dict]:
        """(Machine fields, the recipe's host work) from `samples` (default: every sample):
        each figure the median over them, each engine mode's from its own samples (modes
        without a sample: 0)."""
        samples = samples if samples is not None else self.samples

        def median(key):
            return statistics.median(s[key] for s in samples)

        values = dict(self.fixed)
        values["peak_flops"] = median("peak_flops")
        values["sustained_fraction"] = min(1.0, median("sustained") / values["peak_flops"])
        values["target_sustained_fraction"] = min(
            1.0, median("target_sustained") / values["peak_flops"]
        )
        values["op_overhead_s"] = median("op_overhead_s")
        for key in ("device_adam_params_per_s", "device_adam_tensor_s", "cpu_adam_params_per_s"):
            values[key] = median(key)
        if self.collectives is not None:
            for op in Collectives.OPS:
                values[f"{op}_bytes_per_s"] = median(f"{op}_bytes_per_s")
            values["collective_latency_s"] = median("collective_latency_s")
        modes = {s["mode"] for s in samples}
        for part, key in ENGINE_KEYS.items():
            values[key] = tuple(
                statistics.median(s["engine"][part] for s in samples if s["mode"] == mode)
                if mode in modes
                else 0.0
                for mode in range(len(ENGINE_MODES))
            )
        from dspark_ds.tune.workload import at_scale

        scale = self.host.copies.scale
        work = dict(self.host.counts, collectives_timed=distributed.has_group())
        work["drafter"] = {
            stage: at_scale(
                [
                    statistics.median(s["work"]["drafter"][stage][i] for s in samples)
                    for i in range(len(steps))
                ],
                scale,
            )
            for stage, steps in self.host.copies.steps.items()
        }
        work["target"] = statistics.median(s["work"]["target"] for s in samples)
        return values, work

    def meta(self) -> dict:
        """What was measured, where and when."""
        cuda = self.device.type == "cuda"
        device_name = torch.cuda.get_device_name(self.device) if cuda else platform.processor()
        return {
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "host": socket.gethostname(),
            "device": device_name or "cpu",
            "ranks": distributed.world_size(),
            "dtype": str(self.dtype).removeprefix("torch."),
            "threads_per_rank": torch.get_num_threads(),
            "samples": len(self.samples),
            "load_average": [round(min(self.load), 2), round(max(self.load), 2)],
            "seconds": round(self.spent, 1),
            "torch": torch.__version__,
            "host_memory_gib": round(host_memory_bytes() / GIB, 1),
            "drafter_kind": self.run_cfg.model.kind,
            "nvme_measured": "nvme_read_bytes_per_s" in self.fixed,
            "compute_shape": dict(self.compute.shape),
        }

    def machine_values(self) -> dict:
        """The fields that describe the machine rather than a measurement."""
        cuda = self.device.type == "cuda"
        memory = host_memory_bytes()
        return dict(
            gpus_per_node=ranks_per_node(),
            gpu_memory_bytes=float(torch.cuda.get_device_properties(self.device).total_memory)
            if cuda
            else memory,
            host_memory_bytes=memory,
            dispatch_overlaps_compute=cuda,
        )


def ranks_per_node() -> int:
    return int(os.environ.get("LOCAL_WORLD_SIZE", distributed.world_size()))


def engine_values(values: dict, mode: int, base: dict) -> dict:
    """`values` with its engine tuples holding only `mode`'s entry from them, the other modes'
    from `base` (a machine's fields)."""
    out = dict(values)
    for key in TUPLE_FIELDS:
        merged = list(base[key])
        merged[mode] = values[key][mode]
        out[key] = tuple(merged)
    return out
