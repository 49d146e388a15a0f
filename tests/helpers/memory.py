"""Allocator-independent memory of one training micro-batch (forward + loss + backward).

- ``saved_bytes``: the bytes of the tensors autograd saves for backward, each storage once,
  leaving out the weights, buffers and the batch (torch.autograd.graph.saved_tensors_hooks).
- ``live_peak_bytes``: the peak of the bytes held in tensors during the micro-batch, above
  what was held before it, from the profiler's record of every tensor allocation and free (the
  bytes torch asked for: no allocator cache, no fragmentation, no freed-but-kept heap).

Gradients of the weights are allocated before the measured micro-batch (a warm-up backward,
then zeroed in place), so the peak holds activations, the loss's transients and the backward's
temporaries only: what dspark_ds.drafters.dspark.memory estimates.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch.profiler import ProfilerActivity, profile


def _storage(t: torch.Tensor):
    st = t.untyped_storage()
    return st.data_ptr(), st.nbytes()


def saved_bytes(fn: Callable[[], torch.Tensor], exclude: Iterable[torch.Tensor]) -> tuple:
    """(loss, bytes saved for backward while `fn()` runs), storages of `exclude` left out."""
    skip = {_storage(t)[0] for t in exclude}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        ptr, nbytes = _storage(t)
        if ptr not in skip:
            seen[ptr] = max(seen.get(ptr, 0), nbytes)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = fn()
    return loss, sum(seen.values())


def live_peak_bytes(fn: Callable[[], None]) -> int:
    """Peak of the tensor bytes allocated during `fn()` above those alive when it starts."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted(
        (e.start_ns(), e.nbytes())
        for e in prof.profiler.kineto_results.events()
        if e.name() == "[memory]" and str(e.device_type()).endswith("CPU")
    )
    live = peak = 0
    for _, nbytes in events:
        live += nbytes
        peak = max(peak, live)
    return peak


def micro_batch_memory(model, batch: dict, step: Callable[[], torch.Tensor]) -> dict[str, int]:
    """Saved bytes and live peak of `step()` (forward + loss; its backward is run here) on a
    model whose gradients already exist. `batch` tensors are the step's inputs."""
    exclude = [*model.parameters(), *model.buffers(), *batch.values()]
    for p in model.parameters():  # gradients allocated beforehand, as an engine's buffers are
        if p.requires_grad and p.grad is None:
            p.grad = torch.zeros_like(p)
    _, saved = saved_bytes(step, exclude)  # (its graph is dropped here)

    def full_step() -> None:
        step().backward()

    peak = live_peak_bytes(full_step)
    return {"saved_bytes": saved, "peak_bytes": peak}
