"""Node metrics: one monitor per node (the node's lowest rank, its local rank 0), reduced with
the log step's metrics so that every node's figures reach rank 0 and the run.

    system/node<k>/cpu_percent            the node's CPU use, all cores (psutil), 0-100
    system/node<k>/host_memory_used_gb    the node's used host memory (psutil)
    system/node<k>/host_memory_percent
    system/node<k>/gpu_utilization_percent  mean over the node's GPUs that its ranks use
    system/node<k>/gpu_memory_used_gb     summed over them (as nvidia-smi shows it)
    system/node<k>/gpu_power_w            summed over them
    system/node<k>/gpus                   how many GPUs those figures cover

Each figure is the mean of the samples taken (every `interval_s`) since the last log step. The
GPU figures come from NVML through torch.cuda (`utilization`, `device_memory_used`,
`power_draw`, which honour CUDA_VISIBLE_DEVICES and create no CUDA context); they need the
`nvidia-ml-py` package and are left out without it (said once). `NodeLayout` finds the nodes
once, at start: ranks that share a host name and node id (SLURM_NODEID, torchrun's GROUP_RANK,
else the first rank of the rank's local block) are one node, in the order of their lowest rank.
"""

from __future__ import annotations

import os
import socket
import threading
from dataclasses import dataclass

import psutil
import torch

from dspark_ds import distributed
from dspark_ds.distributed import log

FIELDS = (
    "cpu_percent",
    "host_memory_used_gb",
    "host_memory_percent",
    "gpu_utilization_percent",
    "gpu_memory_used_gb",
    "gpu_power_w",
    "gpus",
)
GPU_FIELDS = FIELDS[3:]
"""Logged for a node whose monitor read at least one GPU ("gpus": how many)."""


def node_key(rank: int, local_rank: int, env=os.environ) -> tuple[str, str]:
    node = env.get("SLURM_NODEID") or env.get("GROUP_RANK") or str(rank - local_rank)
    return socket.gethostname(), node


@dataclass(frozen=True)
class NodeLayout:
    """Which node each rank is on."""

    node_of_rank: list[int]
    hosts: list[str]
    """Each node's host name."""

    @classmethod
    def from_keys(cls, keys: list[tuple[str, str]]) -> NodeLayout:
        order: dict[tuple[str, str], int] = {}
        for key in keys:
            order.setdefault(tuple(key), len(order))
        return cls([order[tuple(k)] for k in keys], [k[0] for k in order])

    @property
    def num_nodes(self) -> int:
        return len(self.hosts)

    def leader(self, rank: int) -> bool:
        """The node's lowest rank runs its monitor."""
        return self.node_of_rank.index(self.node_of_rank[rank]) == rank

    def local_ranks(self, rank: int) -> int:
        return self.node_of_rank.count(self.node_of_rank[rank])


def discover_layout(rank: int, local_rank: int) -> NodeLayout:
    """Collective when a process group exists: every rank's node key, gathered."""
    key = node_key(rank, local_rank)
    keys = distributed.all_gather_object(key) if distributed.has_group() else [key]
    return NodeLayout.from_keys(keys)


def _gpu_reader():
    """(device count, read(i) -> (util %, memory bytes, power W)) or (0, None)."""
    if not torch.cuda.is_available():
        return 0, None
    try:
        # lazy: optional dependency nvidia-ml-py
        import pynvml  # noqa: F401 - torch.cuda's NVML readers need it
    except ImportError:
        log(
            "[tracking] GPU utilisation, memory and power need nvidia-ml-py "
            "(pip install nvidia-ml-py); node metrics without them"
        )
        return 0, None

    def read(i: int) -> tuple[float, float, float]:
        return (
            float(torch.cuda.utilization(i)),
            float(torch.cuda.device_memory_used(i)),
            torch.cuda.power_draw(i) / 1000.0,
        )

    return torch.cuda.device_count(), read


class NodeMonitor:
    """Samples this node every `interval_s` on a thread; `window()` gives the means since the
    last call."""

    def __init__(self, num_gpus: int, interval_s: float = 1.0):
        """`num_gpus`: the node's GPUs its ranks use (0 .. num_gpus-1 in CUDA's numbering)."""
        self._psutil = psutil
        count, self._read_gpu = _gpu_reader()
        self.gpus = list(range(min(num_gpus, count)))
        self.interval_s = interval_s
        self._sums = [0.0] * len(FIELDS)
        self._n = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        psutil.cpu_percent(None)  # the first call only starts psutil's interval
        self._thread = threading.Thread(target=self._loop, name="node-monitor", daemon=True)
        self._thread.start()

    def sample(self) -> list[float]:
        mem = self._psutil.virtual_memory()
        used_gb = (mem.total - mem.available) / 2**30
        values = [self._psutil.cpu_percent(None), used_gb, mem.percent, 0.0, 0.0, 0.0, 0.0]
        if self.gpus and self._read_gpu is not None:
            reads = [self._read_gpu(i) for i in self.gpus]
            values[3] = sum(r[0] for r in reads) / len(reads)
            values[4] = sum(r[1] for r in reads) / 2**30
            values[5] = sum(r[2] for r in reads)
            values[6] = float(len(reads))
        return values

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                values = self.sample()
            except Exception as err:  # noqa: BLE001 - a monitor never stops training
                log(f"[tracking] node monitor stopped: {err}")
                return
            with self._lock:
                self._sums = [s + v for s, v in zip(self._sums, values)]
                self._n += 1

    def window(self) -> list[float]:
        """The means since the last call (a sample now when none was taken since)."""
        with self._lock:
            sums, n = self._sums, self._n
            self._sums, self._n = [0.0] * len(FIELDS), 0
        if n == 0:
            sums, n = self.sample(), 1
        return [s / n for s in sums]

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2 * self.interval_s + 1)


class NodeMetrics:
    """Every rank's part of the log step's node figures: a [nodes x fields] tensor, filled by
    the node's monitor on its leader and zero elsewhere, summed with the step's metrics."""

    def __init__(self, layout: NodeLayout, rank: int, device: torch.device, interval_s: float):
        self.layout, self.rank, self.device = layout, rank, device
        self.node = layout.node_of_rank[rank]
        gpus = layout.local_ranks(rank) if device.type == "cuda" else 0
        self.monitor = NodeMonitor(gpus, interval_s) if layout.leader(rank) else None

    def part(self) -> torch.Tensor:
        values = torch.zeros(
            self.layout.num_nodes, len(FIELDS), dtype=torch.float64, device=self.device
        )
        if self.monitor is not None:
            values[self.node] = torch.tensor(
                self.monitor.window(), dtype=torch.float64, device=self.device
            )
        return values

    def metrics(self, summed: list[float]) -> dict[str, float]:
        """The reduced tensor's values -> system/node<k>/<field> (GPU fields only with GPUs)."""
        out = {}
        width = len(FIELDS)
        for node in range(self.layout.num_nodes):
            row = summed[node * width : (node + 1) * width]
            for name, value in zip(FIELDS, row):
                if name in GPU_FIELDS and row[-1] == 0:
                    continue
                out[f"system/node{node}/{name}"] = value
        return out

    def close(self) -> None:
        if self.monitor is not None:
            self.monitor.stop()
