"""The device guard (tests/helpers/device_guard.py): what it calls host-born, and that its
collectives refuse such tensors from the policed code, on 2 real gloo ranks."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from dspark_ds import distributed

from helpers.device_guard import DeviceGuard, DeviceGuardError, host_born_site
from helpers.dist import run_distributed

HERE = __file__


def host_born(t: torch.Tensor) -> bool:
    return host_born_site(t) is not None


def test_factories_without_a_device_are_host_born():
    dev = torch.device("cpu")  # what distributed.collective_device() says under gloo
    with DeviceGuard():
        host = torch.tensor([1.0, 2.0])
        assert host_born(host) and host_born(torch.zeros(3)) and host_born(torch.arange(4))
        assert host_born(torch.tensor([1.0], device="cpu"))  # hard-coded host
        assert not host_born(torch.tensor([1.0], device=dev))
        assert not host_born(torch.zeros(3, device=dev))
        # derived from host tensors only: still host-born
        assert host_born(host.double()) and host_born(host * 2)
        assert host_born(torch.stack([host, host])) and host_born(torch.zeros_like(host))
        assert host_born(host.to(torch.float64))
        # any operand with a device, or an explicit device, and it is not
        placed = torch.ones(2, device=dev)
        assert not host_born(host + placed) and not host_born(torch.stack([host, placed]))
        assert not host_born(torch.zeros_like(host, device=dev))
        assert not host_born(host.new_zeros(2, device=dev))
        assert host_born(placed.cpu()) and host_born(placed.to("cpu")) and not host_born(placed)
        assert host_born(placed.to(host)) and not host_born(placed)
        assert not host_born(host.to(placed))
        # NOTE: `.to(dev)` of a tensor already there returns the tensor itself, which then
        # counts as placed (`x = x.to(device)`, and what Module.to does to parameters)
        assert not host_born(host.to(dev)) and not host_born(host)
        # in place keeps the tensor where it was
        placed.add_(host)
        assert not host_born(placed)
        # a module's output on a placed input (its Parameters are not host-born: nn.Parameter
        # wraps the factory's tensor outside torch functions; on a GPU run a host input to a
        # placed module fails in the op itself)
        assert not host_born(nn.Linear(2, 2)(placed))
        again = torch.zeros(2)
    assert host_born(again)  # marks stay, the mode does not
    with DeviceGuard():
        assert host_born(torch.tensor([1.0]).sum())
    assert not host_born(torch.tensor([1.0]))  # outside the guard nothing is marked


def _ranks(rank: int, world: int) -> None:
    with DeviceGuard(police=(HERE,)) as guard:
        ok = torch.tensor([rank + 1.0], device=distributed.collective_device())
        dist.all_reduce(ok)
        assert ok.item() == 3.0
        assert distributed.all_reduce_values([rank, 1]) == [1.0, 2.0]  # not policed here
        # the bug of issue 13: counts built without a device, all-reduced
        counts = torch.tensor([10, 2], dtype=torch.float64)
        with pytest.raises(DeviceGuardError, match="all_reduce at .*made on the host"):
            dist.all_reduce(counts)
        with pytest.raises(DeviceGuardError, match="all_gather_into_tensor"):
            dist.all_gather_into_tensor(torch.zeros(2, device=ok.device), counts[:1])
        with pytest.raises(DeviceGuardError, match="broadcast"):
            dist.broadcast(counts.float(), src=0)
        assert guard.stats["policed"] == 4
    # calls from outside the policed code are counted, not checked (DeepSpeed's own)
    with DeviceGuard(police=("/nowhere/",)) as guard:
        dist.all_reduce(torch.tensor([1.0]))
        assert guard.stats == {"policed": 0, "skipped": 1}
    # the package itself, policed by default: its helpers put tensors on the group's device
    with DeviceGuard() as guard:
        assert distributed.all_reduce_values([1.0, rank], op="max") == [1.0, 1.0]
        distributed.barrier()
        assert guard.stats["policed"] == 2
    assert dist.all_reduce is not None and "checked" not in dist.all_reduce.__qualname__


@pytest.mark.slow
@pytest.mark.distributed
def test_collectives_refuse_host_tensors_from_policed_code():
    run_distributed(_ranks, world_size=2)
