"""The job's network and devices as a site presents them: the device of a task that sees one GPU,
rendezvous ports, the interface rule, the bounded rendezvous. Rank discovery is in
tests/cluster/test_slurm_launch.py, what needs several hosts in tests/cluster/test_multihost.py."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from dspark_ds import distributed, network
from dspark_ds.distributed import DistributedConfig, configure_network

REPO = Path(__file__).resolve().parents[2]


# ---- the device of a task --------------------------------------------------------------------
@pytest.mark.parametrize(
    ("visible", "local_rank", "expected"),
    [(1, 3, 0), (8, 3, 3), (4, 5, 1), (2, 0, 0)],
    ids=["gpus-per-task=1", "all-8-visible", "4-visible-local-5", "2-visible-local-0"],
)
def test_local_device_indexes_visible_devices(monkeypatch, visible, local_rank, expected):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: visible)
    for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("LOCAL_RANK", str(local_rank))
    assert distributed.local_device() == torch.device("cuda", expected)


def test_local_device_without_a_visible_device_says_so(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    with pytest.raises(RuntimeError, match="sees no device"):
        distributed.local_device()


# ---- ports -----------------------------------------------------------------------------------
def test_job_port_is_below_the_ephemeral_range(monkeypatch):
    monkeypatch.setattr(network, "ephemeral_ports", lambda: (32768, 60999))
    ports = {network.job_port(j) for j in range(0, 100_000, 7)}
    assert min(ports) >= network.FIRST_JOB_PORT and max(ports) < 32768
    assert network.job_port(1234) != network.job_port(1235)
    # a range that starts low: above it
    monkeypatch.setattr(network, "ephemeral_ports", lambda: (10000, 40000))
    assert all(40000 < network.job_port(j) <= 65535 for j in range(0, 50_000, 11))


def test_this_machines_ephemeral_range_is_read():
    lo, hi = (int(x) for x in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    assert network.ephemeral_ports() == (lo, hi)
    assert not lo <= network.job_port(987654) <= hi


def test_a_taken_port_moves_to_the_next_free_one():
    first = network.job_port(4242)
    with socket.socket() as s:
        s.bind(("0.0.0.0", first))
        s.listen()
        assert not network.port_is_free(first)
        assert network.free_job_port(4242) == first + 1
    assert network.free_job_port(4242) == first


# ---- the interface rule (one host: loopback; hosts of their own: tests/cluster/test_multihost.py) ------
def test_interfaces_see_loopback():
    here = network.interfaces()
    assert "127.0.0.1" in here["lo"].addresses and here["lo"].loopback
    assert network.interface_of("127.0.0.1") == "lo"


def test_single_host_job_binds_loopback():
    env: dict[str, str] = {"LOCAL_WORLD_SIZE": "2", "WORLD_SIZE": "2", "LOCAL_RANK": "0"}
    info = distributed.LaunchInfo("torchrun", 0, 2, 0, "127.0.0.1", 29500)
    choice = configure_network(info, env=env)
    assert choice.ifname == "lo"
    assert env["GLOO_SOCKET_IFNAME"] == "lo" and env["NCCL_SOCKET_IFNAME"] == "lo"


def test_user_settings_win():
    info = distributed.LaunchInfo("torchrun", 0, 2, 0, "127.0.0.1", 29500)
    env = {"GLOO_SOCKET_IFNAME": "eth7", "LOCAL_RANK": "1"}
    configure_network(info, env=env)
    assert env["GLOO_SOCKET_IFNAME"] == "eth7" and env["NCCL_SOCKET_IFNAME"] == "lo"
    env = {"DSPARK_IFNAME": "lo", "LOCAL_RANK": "1"}
    assert configure_network(info, env=env).why == "given"
    with pytest.raises(network.NetworkError, match="'nope0' .* does not exist here"):
        configure_network(info, "nope0", env={"LOCAL_RANK": "1"})


def test_world_of_one_needs_no_network():
    env: dict[str, str] = {}
    info = distributed.LaunchInfo("single", 0, 1, 0, "127.0.0.1", 0)
    assert configure_network(info, env=env) is None and env == {}


def test_multi_host_from_the_launchers_variables():
    assert distributed.multi_host({"LOCAL_WORLD_SIZE": "2", "WORLD_SIZE": "4"}) is True
    assert distributed.multi_host({"LOCAL_WORLD_SIZE": "4", "WORLD_SIZE": "4"}) is False
    srun = {"SLURM_PROCID": "3", "SLURM_STEP_NUM_TASKS": "4", "SLURM_STEP_NUM_NODES": "2"}
    assert distributed.multi_host(srun) is True
    assert distributed.multi_host(srun | {"SLURM_STEP_NUM_NODES": "1"}) is False
    ompi = {"OMPI_COMM_WORLD_LOCAL_SIZE": "2", "OMPI_COMM_WORLD_SIZE": "2"}
    assert distributed.multi_host(ompi) is False
    assert distributed.multi_host({}) is None


def test_distributed_timeout_must_be_positive():
    with pytest.raises(ValueError, match="distributed.timeout_s"):
        DistributedConfig(timeout_s=0)


# ---- a rendezvous that cannot be reached ------------------------------------------------------
def second_rank_env(port: int) -> dict[str, str]:
    """Rank 1 of 2, its head at 127.0.0.1:`port`."""
    return {
        "RANK": "1",
        "WORLD_SIZE": "2",
        "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "2",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
    }


def test_unreachable_rendezvous_fails_in_bounded_time(monkeypatch):
    port = network.free_job_port(777)  # nothing listens there
    for key, value in second_rank_env(port).items():
        monkeypatch.setenv(key, value)
    for key in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "DSPARK_IFNAME"):
        monkeypatch.delenv(key, raising=False)
    t0 = time.monotonic()
    with pytest.raises(network.NetworkError) as err:
        distributed.init("gloo", settings=DistributedConfig(timeout_s=2))
    took = time.monotonic() - t0
    assert 2 <= took < 10, took
    text = str(err.value)
    assert "\n" not in text
    assert f"127.0.0.1:{port}" in text and "via lo" in text and "within 2 s" in text


@pytest.mark.slow
def test_cli_names_the_rendezvous_it_cannot_reach(tmp_path, tiny_target):
    """What a user sees: one line, exit 1, within the timeout (not a hang)."""
    port = network.free_job_port(778)
    env = {
        "PATH": "/usr/bin:/bin",
        "PYTHONPATH": str(REPO),
        "DS_ACCELERATOR": "cpu",
        **second_rank_env(port),
        "HF_HUB_OFFLINE": "1",
    }

    target = tiny_target
    t0 = time.monotonic()
    argv = [sys.executable, "-m", "dspark_ds.cli", "train", "--config", "tiny_cpu"]
    argv += ["--target.path", target, "--output_dir", str(tmp_path / "runs")]
    argv += ["--distributed.timeout_s", "3"]
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("dspark-ds: error:")]
    assert len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert f"127.0.0.1:{port}" in errors[0] and "did not answer within 3 s" in errors[0]
    assert time.monotonic() - t0 < 60
