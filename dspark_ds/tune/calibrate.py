"""`--cluster.calibrate`: measures, on this machine and the launcher's ranks, every rate the
step-time model divides by, and returns them as Machine fields (a profile).

All ranks measure at once (ranks of a node share its cores, memory bandwidth and links, as in
training); each figure is the median of repeats, and the slowest rank's. What is measured:

- peak_flops: an [n x n] matmul in the compute dtype; sustained_fraction: a training
  micro-batch of the recipe's drafter kind at a fixed reference shape (REFERENCE: narrower and
  shorter than any recipe), its FLOPs by the kind's own count over its time less its host
  time, as a share of that peak; target_sustained_fraction: the same for a frozen target's
  forward.
- the three collectives of ZeRO (all-reduce, all-gather, reduce-scatter) on the process group:
  latency from a one-element call, bus bandwidth from a large one.
- host <-> device copies: pinned copies on CUDA; on a CPU-only machine the "device" is the
  host, and DeepSpeed's offload copies are RAM-to-RAM copies: that is what is measured.
- Adam: torch's AdamW (the optimizer without offload here; FusedAdam on a GPU) per element
  and per tensor, DeepSpeed's CPU Adam per element (the optimizer of an offloaded run).
- host time per dispatched op: a small Qwen3 model's forward + backward (the stand-in,
  workload.py), whose ops are counted, at a width where the arithmetic takes no time.
- what DeepSpeed adds, per engine mode (ZeRO stage × offload): the stand-in under a real
  engine against plain PyTorch timed just before it, per micro-batch and per step; under
  ZeRO-3 per module (its hooks run on every module; the stand-in's parameters are all under
  the persistence threshold, so none of this is all-gather traffic) and per step less the
  modelled all-gather of each persistent parameter.
- comm_overlap: a large all-gather issued asynchronously during a matmul (CUDA; on a CPU the
  collectives' copies run on the cores that compute, so none is hidden: 0).

NVMe is not measured (DeepSpeed's NVMe offload needs libaio and a local NVMe path); nor is
the network between nodes (one node): those keep the preset's figures and say so.
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

import torch

from dspark_ds import distributed
from dspark_ds.tune.cluster import ENGINE_MODES, GIB
from dspark_ds.tune.config import OPTIONS
from dspark_ds.tune.workload import OpCounter, stand_in_model

ENGINE_OPTIONS = dict(zip(ENGINE_MODES, ("zero0", "zero1", "zero2", "zero2+offload_opt",
                                         "zero3", "zero3+offload_opt",
                                         "zero3+offload_opt+param")))  # fmt: skip


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed(fn: Callable[[], object], device: torch.device, repeats: int, warmup: int = 1) -> float:
    """Median seconds of `fn` over `repeats` (after `warmup`), every rank starting together;
    the slowest rank's median."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        distributed.barrier()
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return max_over_ranks(statistics.median(times))


def max_over_ranks(value: float) -> float:
    return distributed.all_reduce_values([value], op="max")[0]


# ---- compute --------------------------------------------------------------------------------
def matmul_flops(device: torch.device, dtype: torch.dtype) -> float:
    n = 4096 if device.type == "cuda" else 1024
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    return 2.0 * n**3 / timed(lambda: a @ b, device, repeats=5)


# A reference shape, narrower and shorter than any recipe's (and unlike the tests' recipes): the
# rates measured there apply to the recipe's FLOPs through the same FLOP model.
REFERENCE = dict(hidden=192, intermediate=512, heads=4, head_dim=48, vocab=12000, layers=4,
                 seq_len=192, anchors=24, draft_layers=1)  # fmt: skip


def _reference_config(run_cfg, narrow: bool):
    from dspark_ds.tune.inventory import target_config_of
    from dspark_ds.tune.workload import narrow_config, resized_config

    r = REFERENCE
    config = resized_config(
        target_config_of(run_cfg.target.path), hidden=r["hidden"],
        intermediate=r["intermediate"], heads=r["heads"], head_dim=r["head_dim"],
        vocab=r["vocab"], layers=r["layers"],
    )  # fmt: skip
    return narrow_config(config) if narrow else config


def drafter_rate(run_cfg, device: torch.device, dtype: torch.dtype) -> float:
    """FLOP/s of a training micro-batch of the recipe's drafter kind at the reference shape:
    its FLOPs (the kind's own count) over its time less its host time (the same step at the
    narrow width, where the arithmetic takes none)."""
    from dspark_ds.drafters.common.memory import StepShape
    from dspark_ds.drafters.common.target_config import text_config
    from dspark_ds.drafters.registry import get_kind
    from dspark_ds.target import default_layer_ids
    from dspark_ds.tune.workload import KindStep, counted_perf

    r = REFERENCE
    model = replace(run_cfg.model, num_draft_layers=r["draft_layers"], num_anchors=r["anchors"])
    perf = counted_perf(run_cfg.perf, device.type)
    layer_ids = default_layer_ids(r["layers"])
    times = []
    for narrow in (False, True):
        config = _reference_config(run_cfg, narrow)
        step = KindStep(model, perf, config, layer_ids, 1, r["seq_len"], zero3=False,
                        device=device, dtype=dtype)  # fmt: skip
        times.append(timed(step, device, repeats=3))
        if not narrow:
            text = text_config(config)
            shape = StepShape(
                batch=1, seq_len=r["seq_len"], num_anchors=model.num_anchors,
                block_size=model.block_size, hidden=r["hidden"],
                intermediate=r["intermediate"], vocab=r["vocab"], heads=r["heads"],
                kv_heads=int(text.num_key_value_heads), head_dim=r["head_dim"],
                draft_layers=r["draft_layers"], taps=len(layer_ids),
                markov_rank=model.markov_rank, markov_head_type=model.markov_head_type,
                compute_bytes=torch.tensor([], dtype=dtype).element_size(),
                feature_bytes=torch.tensor([], dtype=dtype).element_size(),
                confidence_head=model.confidence_head_alpha > 0, ttt_length=model.ttt_length,
            )  # fmt: skip
            flops = sum(get_kind(model.kind).step_flops(shape, perf, device.type, 0).values())
    return flops / max(times[0] - times[1], 1e-9)


def target_rate(run_cfg, device: torch.device, dtype: torch.dtype) -> float:
    """FLOP/s of the frozen target's forward (no grad) at the reference shape, its host time
    (the narrow width) taken out."""
    from transformers import AutoModelForCausalLM

    from dspark_ds.target import FrozenTarget, default_layer_ids
    from dspark_ds.tune.workload import forward_flops

    r = REFERENCE
    times = []
    for narrow in (False, True):
        config = _reference_config(run_cfg, narrow)
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config).to(device, dtype)
        target = FrozenTarget(model, default_layer_ids(r["layers"]))
        if not narrow:
            layer_params = sum(p.numel() for p in target.decoder.layers.parameters())
        ids = torch.randint(0, 64, (1, r["seq_len"]), device=device)
        mask = torch.ones_like(ids)
        times.append(timed(lambda t=target, i=ids, m=mask: t(i, attention_mask=m), device, 3))
    flops = forward_flops(layer_params, r["layers"], r["heads"], r["head_dim"], 1, r["seq_len"])
    return flops / max(times[0] - times[1], 1e-9)


# ---- communication --------------------------------------------------------------------------
def collectives(device: torch.device, dtype: torch.dtype) -> dict[str, float]:
    """Latency (1 element) and bus bandwidth (a large buffer) of each ZeRO collective."""
    import torch.distributed as dist

    world = distributed.world_size()
    out: dict[str, float] = {}
    numel = (64 if device.type == "cuda" else 2) * 2**20
    elem = torch.tensor([], dtype=dtype).element_size()
    latencies = []
    for op in ("all_reduce", "all_gather", "reduce_scatter"):
        times = {}
        for n in (1, numel):
            full = torch.zeros(n * world, device=device, dtype=dtype)
            part = torch.zeros(n, device=device, dtype=dtype)
            call = {
                "all_reduce": lambda p=part: dist.all_reduce(p),
                "all_gather": lambda f=full, p=part: dist.all_gather_into_tensor(f, p),
                "reduce_scatter": lambda f=full, p=part: dist.reduce_scatter_tensor(p, f),
            }[op]
            times[n] = timed(call, device, repeats=2 if n > 1 else 6, warmup=1)
        latencies.append(times[1])
        out[f"{op}_latency_s"] = times[1]
        # bytes each rank moves over its link: ring all-reduce 2(N-1)/N of the buffer, the
        # others (N-1)/N of the gathered / scattered whole
        factor = 2 * (world - 1) / world if op == "all_reduce" else (world - 1) / world
        moved = factor * numel * elem * (1 if op == "all_reduce" else world)
        out[f"{op}_bytes_per_s"] = moved / max(times[numel] - times[1], 1e-9)
    out["collective_latency_s"] = statistics.median(latencies)
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
        return numel * 4 / max(h2d, d2h)
    src, dst = torch.ones(numel), torch.empty(numel)
    return numel * 4 / timed(lambda: dst.copy_(src), device, repeats=5)


def comm_overlap(device: torch.device, dtype: torch.dtype) -> float:
    """Share of an all-gather hidden behind a matmul issued while it runs (0..1)."""
    import torch.distributed as dist

    world = distributed.world_size()
    n = 4096 if device.type == "cuda" else 768
    a = torch.randn(n, n, device=device, dtype=dtype)
    part = torch.zeros(2**20 * (16 if device.type == "cuda" else 1), device=device, dtype=dtype)
    full = torch.zeros(part.numel() * world, device=device, dtype=dtype)
    t_mm = timed(lambda: a @ a, device, repeats=3)
    t_comm = timed(lambda: dist.all_gather_into_tensor(full, part), device, repeats=3)

    def both():
        work = dist.all_gather_into_tensor(full, part, async_op=True)
        a @ a
        work.wait()

    t_both = timed(both, device, repeats=3)
    hidden = t_mm + t_comm - t_both
    return float(min(1.0, max(0.0, hidden / max(min(t_mm, t_comm), 1e-9))))


# ---- optimizers -------------------------------------------------------------------------------
def adam_rates(device: torch.device) -> dict[str, float]:
    """torch's AdamW per element (one flat tensor, as ZeRO-1/2/3 hand it) and per tensor (as
    plain data parallelism hands it the parameter list); DeepSpeed's CPU Adam per element."""
    from dspark_ds.engine import cpu_adam

    numel = 4 * 2**20

    def rate(make_opt, params, repeats=3):
        for p in params:
            p.grad = torch.full_like(p, 1e-3)
        opt = make_opt(params)
        return timed(opt.step, device, repeats=repeats)

    flat = [torch.zeros(numel, device=device, requires_grad=True)]
    t_flat = rate(lambda ps: torch.optim.AdamW(ps, lr=1e-4), flat)
    many = [torch.zeros(256, device=device, requires_grad=True) for _ in range(200)]
    t_many = rate(lambda ps: torch.optim.AdamW(ps, lr=1e-4), many, repeats=5)
    host = [torch.zeros(numel, requires_grad=True)]
    t_cpu = rate(cpu_adam, host)
    return {
        "device_adam_params_per_s": numel / t_flat,
        "device_adam_tensor_s": max(0.0, (t_many - 200 * 256 * t_flat / numel) / 200),
        "cpu_adam_params_per_s": numel / t_cpu,
    }


# ---- host time per op, and what DeepSpeed adds ---------------------------------------------------
def _phases(model_call, backward, step, device, repeats: int) -> tuple[float, float, float]:
    """Median forward, backward and step seconds (slowest rank each)."""
    fwd, bwd, opt = [], [], []
    for i in range(repeats + 2):
        distributed.barrier()
        t0 = time.perf_counter()
        loss = model_call()
        _sync(device)
        t1 = time.perf_counter()
        backward(loss)
        _sync(device)
        t2 = time.perf_counter()
        step()
        _sync(device)
        t3 = time.perf_counter()
        if i >= 2:
            fwd.append(t1 - t0)
            bwd.append(t2 - t1)
            opt.append(t3 - t2)
    return tuple(max_over_ranks(statistics.median(x)) for x in (fwd, bwd, opt))


class StandIn:
    """The stand-in model (workload.stand_in_model, 2 layers) in plain PyTorch: the host time
    per op, and the baseline DeepSpeed's costs are measured against."""

    def __init__(self, device: torch.device, dtype: torch.dtype):
        self.device, self.dtype = device, dtype
        self.make = stand_in_model(2, dtype)
        self.ids = torch.randint(0, 64, (1, 32), device=device)
        self.model = self.make().to(device).train()
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        with OpCounter() as counter:
            self.loss(self.model).backward()
        self.model.zero_grad(set_to_none=True)
        self.ops = counter.ops
        self.modules = sum(1 for _ in self.model.modules())
        self.tensors = sum(1 for _ in self.model.parameters())

    def loss(self, model):
        return model(input_ids=self.ids).last_hidden_state.float().pow(2).mean()

    def phases(self, repeats: int) -> tuple[float, float, float]:
        return _phases(
            lambda: self.loss(self.model),
            lambda loss: loss.backward(),
            lambda: (self.opt.step(), self.model.zero_grad(set_to_none=True)),
            self.device,
            repeats,
        )

    def op_seconds(self, repeats: int = 10) -> float:
        fwd, bwd, _ = self.phases(repeats)
        return (fwd + bwd) / self.ops

    def frozen_forward(self, model, repeats: int) -> float:
        """Median seconds of `model`'s forward without gradients (the slowest rank's)."""

        def forward():
            with torch.no_grad():
                model(input_ids=self.ids)

        return timed(forward, self.device, repeats)


class Probe:
    """A fixed small workload — the stand-in's forward + backward, a 512² matmul and two small
    all-reduces (a step's synchronisations, where a descheduled rank makes the others wait),
    four times, on every rank — that says how fast the machine is at a moment (the slowest
    rank's seconds). Timed in every calibration round, and by `--measure` between an option's
    timed steps: their ratio is how much slower (or faster) the machine ran while that option
    was measured than while it was calibrated (other jobs on a shared machine)."""

    def __init__(self, device: torch.device, dtype: torch.dtype):
        self.device = device
        self.stand_in = StandIn(device, dtype)
        self.a = torch.randn(512, 512, device=device, dtype=dtype)
        self.flag = torch.zeros(1, device=distributed.collective_device())

    def __call__(self) -> float:
        import torch.distributed as dist

        model = self.stand_in.model
        distributed.barrier()
        _sync(self.device)
        t0 = time.perf_counter()
        for _ in range(4):
            self.stand_in.loss(model).backward()
            model.zero_grad(set_to_none=True)
            if distributed.has_group():
                dist.all_reduce(self.flag)
            self.a @ self.a
            if distributed.has_group():
                dist.all_reduce(self.flag)
        _sync(self.device)
        return max_over_ranks(time.perf_counter() - t0)


def engine_cost(run_cfg, stand_in: StandIn, mode: int, ag_latency: float, repeats: int = 8):
    """What DeepSpeed adds in engine mode `mode` (ENGINE_MODES) to the stand-in, against plain
    PyTorch timed right before it: (per micro-batch, per step, per module forward, per module
    backward, per module of a frozen target's forward) seconds. Under ZeRO-3 the micro-batch's
    part is per module (its hooks run on every module; the stand-in's parameters are all under
    the persistence threshold, so none of it is all-gather traffic), the step's less the
    modelled all-gather of each parameter, and an in-job target's optimizer-less engine is
    timed on its own (its forward under no_grad)."""
    from dspark_ds.engine import build_ds_config, frozen_engine, plain_engine, release_engine
    from dspark_ds.tune.estimate import option_overrides

    device = stand_in.device
    world = distributed.world_size()
    option = {o.name: o for o in OPTIONS}[ENGINE_OPTIONS[ENGINE_MODES[mode]]]
    ds_config = build_ds_config(
        replace(run_cfg.deepspeed, config=option.config,
                overrides=option_overrides(option, run_cfg)),
        replace(run_cfg.train, global_batch_size=world),
        micro_batch_size=1, world_size=world, use_gpu=device.type == "cuda",
    )  # fmt: skip
    engine = plain_engine(stand_in.make, ds_config)
    base = stand_in.phases(repeats)
    got = _phases(lambda: stand_in.loss(engine), engine.backward, engine.step, device, repeats)
    release_engine(engine)
    fwd, bwd, step = (max(0.0, g - p) for g, p in zip(got, base))
    if not ENGINE_MODES[mode].startswith("zero3"):
        return fwd + bwd, step, 0.0, 0.0, 0.0
    m = stand_in.modules
    frozen = frozen_engine(stand_in.make(), ds_config)
    plain = stand_in.frozen_forward(stand_in.model, repeats)
    target = max(0.0, stand_in.frozen_forward(frozen, repeats) - plain) / m
    release_engine(frozen)
    return 0.0, max(0.0, step - stand_in.tensors * ag_latency), fwd / m, bwd / m, target


# ---- the whole calibration ---------------------------------------------------------------------
def host_memory_bytes() -> float:
    try:
        for line in open("/proc/meminfo"):
            if line.startswith("MemTotal:"):
                return float(line.split()[1]) * 1024
    except OSError:
        pass
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


class Calibration:
    """The measurements of one calibration on every rank of the group.

    The rates that follow the machine's load (compute, collectives, host time per op, the
    recipe's host work) are measured in rounds, and each figure is the median over the rounds;
    DeepSpeed's costs once per engine mode. `--measure` runs a round and the option's engine
    mode right before measuring each option, so that prediction and measurement see the same
    load (on a machine shared with other jobs); a plain calibration runs its rounds back to
    back."""

    def __init__(self, run_cfg, device: torch.device, stages: tuple[int, ...]):
        self.run_cfg, self.device, self.stages = run_cfg, device, stages
        self.dtype = torch.bfloat16 if run_cfg.train.precision == "bf16" else torch.float32
        self.load = [os.getloadavg()[0]]
        self.spent = 0.0
        self.rounds: list[dict] = []
        self.engines: dict[int, tuple] = {}
        self.fixed: dict = {}
        self.stand_in = StandIn(device, self.dtype)
        self.probe = Probe(device, self.dtype)

    def once(self) -> None:
        """What does not follow the load much: copies, overlap, optimizers."""
        t0 = time.perf_counter()
        device, dtype = self.device, self.dtype
        self.fixed["host_device_bytes_per_s"] = host_device_copy(device)
        if device.type == "cuda" and distributed.world_size() > 1:
            self.fixed["comm_overlap"] = comm_overlap(device, dtype)
        elif device.type != "cuda":
            # NOTE: gloo's copies run on the cores that compute: a ZeRO-3 step on a CPU hides
            # none of its all-gathers (a matmul beside an idle core would suggest otherwise)
            self.fixed["comm_overlap"] = 0.0
        self.fixed.update(adam_rates(device))
        self.spent += time.perf_counter() - t0

    def round(self) -> None:
        """The load-following rates once more."""
        from dspark_ds.tune.workload import host_work

        t0 = time.perf_counter()
        device, dtype, run_cfg = self.device, self.dtype, self.run_cfg
        got = {"peak_flops": matmul_flops(device, dtype)}
        got["sustained"] = drafter_rate(run_cfg, device, dtype)
        got["target_sustained"] = target_rate(run_cfg, device, dtype)
        if distributed.world_size() > 1:
            got.update(collectives(device, dtype))
        got["op_overhead_s"] = self.stand_in.op_seconds()
        got["probe_s"] = statistics.median(self.probe() for _ in range(5))
        if device.type != "cuda":  # a CPU machine's host work is timed (workload.py)
            got["host_work"] = host_work(run_cfg, self.stages, "cpu")
        self.rounds.append(got)
        self.load.append(os.getloadavg()[0])
        self.spent += time.perf_counter() - t0

    def engine(self, mode: int) -> None:
        t0 = time.perf_counter()
        ag = statistics.median(r.get("all_gather_latency_s", 0.0) for r in self.rounds)
        self.engines[mode] = engine_cost(self.run_cfg, self.stand_in, mode, ag)
        self.spent += time.perf_counter() - t0

    def run(self, rounds: int = 3) -> None:
        """A calibration on its own: the fixed part, `rounds` rounds, every engine mode."""
        from tqdm import tqdm

        self.once()
        parts = [self.round] * rounds + [
            lambda m=m: self.engine(m) for m in range(len(ENGINE_MODES))
        ]
        for part in tqdm(
            parts, desc="calibrating", unit="part", disable=not distributed.is_rank0()
        ):
            part()

    def result(self) -> tuple[dict, dict, dict | None]:
        """(Machine fields measured here, what / where / when, the recipe's host work)."""
        for mode in range(len(ENGINE_MODES)):
            if mode not in self.engines:
                self.engine(mode)

        def median(key):
            return statistics.median(r[key] for r in self.rounds)

        values = dict(self.fixed)
        values["peak_flops"] = median("peak_flops")
        values["sustained_fraction"] = min(1.0, median("sustained") / values["peak_flops"])
        values["target_sustained_fraction"] = min(
            1.0, median("target_sustained") / values["peak_flops"]
        )
        values["op_overhead_s"] = median("op_overhead_s")
        values["probe_s"] = median("probe_s")
        if distributed.world_size() > 1:
            for key in ("all_reduce_bytes_per_s", "all_gather_bytes_per_s",
                        "reduce_scatter_bytes_per_s", "collective_latency_s"):  # fmt: skip
                values[key] = median(key)
        engines = [list(self.engines[m]) for m in range(len(ENGINE_MODES))]
        # ZeRO-3's hooks are the same code in its three modes (their offload costs are modelled
        # apart): one figure each, the median of the three measurements
        zero3 = [m for m, name in enumerate(ENGINE_MODES) if name.startswith("zero3")]
        for i in (2, 3, 4):
            pooled = statistics.median(engines[m][i] for m in zero3)
            for m in zero3:
                engines[m][i] = pooled
        for i, key in enumerate(
            ("engine_micro_s", "engine_step_s", "engine_module_fwd_s", "engine_module_bwd_s",
             "engine_target_module_s")
        ):  # fmt: skip
            values[key] = tuple(e[i] for e in engines)
        work = None
        if "host_work" in self.rounds[0]:
            work = dict(self.rounds[0]["host_work"])
            work["drafter"] = {
                s: statistics.median(r["host_work"]["drafter"][s] for r in self.rounds)
                for s in self.stages
            }
            work["target"] = statistics.median(r["host_work"]["target"] for r in self.rounds)
        cuda = self.device.type == "cuda"
        memory = host_memory_bytes()
        values.update(
            gpus_per_node=int(os.environ.get("LOCAL_WORLD_SIZE", distributed.world_size())),
            gpu_memory_bytes=float(torch.cuda.get_device_properties(self.device).total_memory)
            if cuda
            else memory,
            host_memory_bytes=memory,
            dispatch_overlaps_compute=cuda,
        )
        device_name = torch.cuda.get_device_name(self.device) if cuda else platform.processor()
        meta = {
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "host": socket.gethostname(),
            "device": device_name or "cpu",
            "ranks": distributed.world_size(),
            "dtype": str(self.dtype).removeprefix("torch."),
            "threads_per_rank": torch.get_num_threads(),
            "rounds": len(self.rounds),
            "load_average": [round(min(self.load), 2), round(max(self.load), 2)],
            "seconds": round(self.spent, 1),
            "torch": torch.__version__,
            "host_memory_gib": round(memory / GIB, 1),
            "drafter_kind": self.run_cfg.model.kind,
        }
        return values, meta, work
