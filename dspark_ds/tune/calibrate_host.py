"""The calibration's host figures: the host time per dispatched op (a small stand-in model's
ops, counted), the recipe's own host work in those ops (its drafter and target 32 wide), and what
DeepSpeed adds per engine mode (`EngineWindow`: the same drafter under a real engine against
plain PyTorch)."""

from __future__ import annotations

import statistics
import time
from dataclasses import replace

import torch

from dspark_ds import distributed
from dspark_ds.engine.config import build_ds_config
from dspark_ds.engine.probes import frozen_engine, plain_engine, release_engine
from dspark_ds.tune.calibrate_timing import REPEATS, max_over_ranks, sync, timed
from dspark_ds.tune.cluster import ENGINE_MODES
from dspark_ds.tune.config import OPTIONS
from dspark_ds.tune.estimate import option_overrides
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
PAIRS = 9
"""Plain and engine steps timed in alternation per sample, the median of the pairs' differences
kept: a burst of other work falls on both steps of a pair. (Three plain steps, then three engine
steps, put 2-3 ms of noise on ZeRO-1's 4 ms on this 2-core machine: CI's speed test at 1.40x.)"""


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
        self.sample(pairs=1)  # warm-up

    def _added(self, pairs: int) -> list[float]:
        """Forward + loss, backward and step seconds the engine adds to the plain copy: this
        rank's median over `pairs` of a plain step followed by an engine step."""
        plain_model = self.step.model

        def plain_step():
            self.plain_opt.step()
            plain_model.zero_grad(set_to_none=True)

        added = []
        for _ in range(pairs):
            plain = self._phases(plain_model, lambda loss: loss.backward(), plain_step)
            engine = self._phases(self.engine, self.engine.backward, self.engine.step)
            added.append([e - p for e, p in zip(engine, plain)])
        return [statistics.median(pair[i] for pair in added) for i in range(3)]

    def _phases(self, model, backward, step) -> tuple[float, float, float]:
        """Forward + loss, backward and step seconds of one step, every rank starting together."""
        d = self.host.device
        distributed.barrier()
        sync(d)
        t0 = time.perf_counter()
        loss = self.step.loss(model)
        sync(d)
        t1 = time.perf_counter()
        backward(loss)
        sync(d)
        t2 = time.perf_counter()
        step()
        sync(d)
        return t1 - t0, t2 - t1, time.perf_counter() - t2

    def sample(self, pairs: int = PAIRS) -> dict[str, float]:
        """One pass: plain and engine forward, backward and step of the drafter copy in
        alternation (and the target's forward under ZeRO-3) -> (micro-batch, step, per forward
        call, per backward call, per target call) seconds added, and under ZeRO-3 the
        all-gathers its step includes (`refreshes`: the calibration takes them out at its median
        latency)."""
        t = self._added(pairs)
        if self.target is not None:
            copy = self.host.copies.target
            with torch.no_grad():
                t += [
                    timed(copy, self.host.device, REPEATS),
                    timed(lambda: copy.run(self.target), self.host.device, REPEATS),
                ]
        t = max_over_ranks(t)
        fwd, bwd, step = (max(0.0, added) for added in t[:3])
        out = dict.fromkeys(("micro", "fwd_call", "bwd_call", "target_call", "refreshes"), 0.0)
        out["step"] = step
        if not self.zero3:
            out["micro"] = fwd + bwd
            return out
        # NOTE: ZeRO-3 refreshes each persistent parameter after the step, one all-gather each:
        # the model counts those apart (param_gather)
        out["refreshes"] = float(self.tensors)
        out["fwd_call"] = fwd / max(self.calls[0], 1)
        out["bwd_call"] = bwd / max(self.calls[1], 1)
        if self.target is not None:
            target_calls = max(self.host.counts["calls"]["target"], 1)
            out["target_call"] = max(0.0, t[4] - t[3]) / target_calls
        return out

    def close(self) -> None:
        release_engine(self.engine)
        if self.target_engine is not None:
            release_engine(self.target_engine)
        self.engine = self.target_engine = self.target = None
