"""A real multi-host Slurm cluster on one machine, for tests: N hosts made of network namespaces.

    from helpers.multihost import multihost_cluster  # noqa: F401  (the pytest fixture)

    def test_x(multihost_cluster):
        job, _ = multihost_cluster.sbatch(["--wait", "--nodes=2", "slurm/train.sbatch"], env=...)

What each host is:

- a network namespace `<prefix>h<i>` with one interface, `eth0`, address 198.18.0.<i>/24 (the
  benchmarking range, RFC 2544), joined to the others through a bridge that lives in a namespace
  of its own (`<prefix>sw`); no default route, so nothing leaves the namespaces, and a process on
  one host reaches another only over that link (each host's loopback is its own);
- its own host name (a UTS namespace: `hostname` prints `dsn<i>`) and its own `/etc/hosts` view
  (`/etc/netns/<ns>/hosts`, which `ip netns exec` mounts over `/etc/hosts`). By default a host
  maps its own name to 127.0.1.1, as Debian's installer writes it on machines without a static
  address: the trap that makes gloo bind loopback unless the interface is chosen;
- one `slurmd -N dsn<i>`; `slurmctld` runs on host 1, which is also where client commands
  (`sbatch`, `squeue`, `scontrol`, `srun`) run (`cluster.run`, `cluster.sbatch`, `cluster.exec`).

One munged serves every host (its socket is a file, which namespaces share), as one munge key
does on a cluster. The file system is shared too, as a cluster's shared disk is. Everything is
created as root (CI runs as root); when a piece is missing the fixture fails naming it (tests
install nothing). Daemons, namespaces and `/etc/netns` entries are removed when the fixture ends,
also after a failure, and namespaces left by a killed test session (their owner pid is gone) are
removed at the next start.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from dspark_ds.train.rundir import pid_alive

from helpers.slurm_cluster import APT_PACKAGES, BINARIES, SlurmCluster, _terminate, serve
from helpers.system import SBIN, missing_message, which

SUBNET = "198.18.0"
"""Hosts get SUBNET.<i>/24, i = 1..N: addresses inside the test's own namespaces only."""
NETNS_DIR = Path("/etc/netns")
PREFIX = "dspk"


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise RuntimeError(f"`ip {' '.join(args)}` failed: {proc.stderr.strip()}")
    return proc


def remove_stale_namespaces() -> list[str]:
    """Namespaces (and /etc/netns entries) of earlier test sessions whose process is gone."""
    out = _ip("netns", "list", check=False).stdout
    removed = []
    for name in {line.split()[0] for line in out.splitlines() if line.strip()}:
        m = re.fullmatch(rf"{PREFIX}(\d+)(?:h\d+|sw)", name)
        if m and not pid_alive(int(m.group(1))):
            _kill_namespace_processes(name)
            _ip("netns", "del", name, check=False)
            shutil.rmtree(NETNS_DIR / name, ignore_errors=True)
            removed.append(name)
    return removed


def _kill_namespace_processes(ns: str) -> None:
    # NOTE: processes started with `ip netns exec` do not die with the namespace
    pids = _ip("netns", "pids", ns, check=False).stdout.split()
    for pid in pids:
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass


class MultiHostCluster(SlurmCluster):
    """`hosts` hosts dsn1..dsnN, `cpus` CPUs each, partition `debug` over all of them."""

    def __init__(
        self,
        root: str | Path,
        hosts: int = 2,
        cpus: int = 2,
        real_memory_mb: int = 8000,
        cred_expire_s: int = 5,
        mpi_default: str = "pmi2",
        loopback_alias: bool = True,
        kill_wait_s: int = 30,
        task_plugin: str = "task/affinity",
        slurmd_timeout_s: int = 10,
    ):
        super().__init__(
            root, cpus=cpus, real_memory_mb=real_memory_mb, cred_expire_s=cred_expire_s
        )
        self.n = hosts
        self.mpi_default = mpi_default
        self.loopback_alias = loopback_alias
        self.kill_wait_s = kill_wait_s
        self.task_plugin = task_plugin
        self.slurmd_timeout_s = slurmd_timeout_s
        self.prefix = f"{PREFIX}{os.getpid()}"
        self.hosts = [f"dsn{i}" for i in range(1, hosts + 1)]
        self.addrs = {h: f"{SUBNET}.{i}" for i, h in enumerate(self.hosts, start=1)}
        self.namespaces = {h: f"{self.prefix}h{i}" for i, h in enumerate(self.hosts, start=1)}
        self.switch = f"{self.prefix}sw"
        self.host = self.hosts[0]
        self.pid_files = {
            **{f"slurmd.{h}": self.root / f"slurmd.{h}.pid" for h in self.hosts},
            "slurmctld": self.root / "slurmctld.pid",
            "munged": self.root / "munge" / "munged.pid",
        }

    @property
    def nodelist(self) -> str:
        return f"dsn[1-{self.n}]"

    # ---- running things on a host ------------------------------------------------------------
    def exec_prefix(self, host: str | None = None) -> list[str]:
        """The command prefix that runs a process on `host` (default: the head, dsn1): its
        network namespace, its /etc/hosts, its host name."""
        host = host or self.host
        ns = self.namespaces[host]
        # NOTE: not `ip netns exec`: it remounts /sys for the namespace, which hides the
        # machine's cgroup mounts, and slurmd will not start without them.
        script = (
            f"mount --bind {NETNS_DIR / ns / 'hosts'} /etc/hosts && "
            f"mount --bind {self.node_local}.{host} {self.node_local} && hostname {host} && "
            f'exec nsenter --net=/run/netns/{ns} "$@"'
        )
        return ["unshare", "--mount", "--uts", "--propagation", "private", "sh", "-c", script, "sh"]

    @property
    def node_local(self) -> Path:
        """A directory each host sees on a disk of its own (`<root>/nodelocal.<host>` mounted
        there), as a compute node's local scratch; everything else is shared."""
        return self.root / "nodelocal"

    @property
    def rsh_agent(self) -> Path:
        """A remote-shell agent (`agent <host> <command...>`, as ssh is called) that runs the
        command on a namespace host: Open MPI's `plm_rsh_agent`."""
        return self.root / "netns-rsh"

    def _write_rsh_agent(self) -> None:
        cases = "\n".join(
            f'  {h}) exec {shlex.join(self.exec_prefix(h))} sh -c "$*" ;;' for h in self.hosts
        )
        self.rsh_agent.write_text(
            "#!/bin/sh\n"
            "# written by tests/helpers/multihost.py: a command on a namespace host, as ssh runs it\n"
            'while [ "${1#-}" != "$1" ]; do shift; done  # ssh-style options before the host\n'
            "host=$1; shift\n"
            f'case $host in\n{cases}\n  *) echo "netns-rsh: unknown host $host" >&2; exit 255 ;;\nesac\n'
        )
        os.chmod(self.rsh_agent, 0o755)

    def exec(self, host: str | None, *cmd: str, **kwargs) -> subprocess.CompletedProcess:
        kwargs.setdefault("env", self.env)
        kwargs.setdefault("capture_output", True)
        kwargs.setdefault("text", True)
        return subprocess.run([*self.exec_prefix(host), *cmd], **kwargs)

    def popen(self, host: str | None, *cmd: str, **kwargs) -> subprocess.Popen:
        kwargs.setdefault("env", self.env)
        return subprocess.Popen([*self.exec_prefix(host), *cmd], **kwargs)

    def run(self, *cmd: str, check: bool = True, timeout: float = 60) -> str:
        proc = self.exec(None, *cmd, timeout=timeout)
        if check and proc.returncode != 0:
            raise RuntimeError(
                f"`{' '.join(cmd)}` on {self.host} failed ({proc.returncode}): "
                f"{proc.stderr.strip()}{proc.stdout.strip()}"
            )
        return proc.stdout

    def sbatch(self, args, env=None, cwd=None, timeout: float = 600):
        full_env = self.env
        full_env.update(env or {})
        proc = self.exec(
            None, "sbatch", "--parsable", *args, env=full_env, cwd=cwd, timeout=timeout
        )
        first = proc.stdout.strip().splitlines()[:1]
        if not first or not first[0].split(";")[0].isdigit():
            raise RuntimeError(
                f"sbatch {' '.join(args)} failed ({proc.returncode}): {proc.stderr}{proc.stdout}"
            )
        return int(first[0].split(";")[0]), proc

    def sbatch_popen(self, args, env=None, cwd=None) -> subprocess.Popen:
        """`sbatch --wait ...` in the background (stdout/stderr piped, text)."""
        full_env = self.env
        full_env.update(env or {})
        return self.popen(
            None,
            "sbatch",
            *args,
            env=full_env,
            cwd=cwd,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )

    # ---- faults --------------------------------------------------------------------------------
    def link(self, host: str, up: bool) -> None:
        """Cut (or restore) `host`'s link to the switch: a network partition. Its processes live
        on; packets to and from it are dropped."""
        _ip(
            "-n",
            self.switch,
            "link",
            "set",
            f"p{self.hosts.index(host) + 1}",
            "up" if up else "down",
        )

    def crash(self, host: str) -> None:
        """`host` dies: SIGKILL to every process on it, its slurmd included (Slurm then finds the
        node not responding after SlurmdTimeout and fails its jobs). `restart(host)` boots it."""
        _kill_namespace_processes(self.namespaces[host])

    def restart(self, host: str, timeout_s: float = 120) -> None:
        """Starts `host`'s slurmd again and waits until Slurm has the node back in service."""
        self._daemon(host, "slurmd", "-N", host)
        self._wait_in_service([host], timeout_s)

    def _wait_in_service(self, hosts: list[str], timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        states = ""
        while time.monotonic() < deadline:
            out = self.exec(None, "sinfo", "-h", "-N", "-n", ",".join(hosts), "-o", "%N %T")
            states = out.stdout.strip()
            ok = [line for line in states.splitlines() if line.split()[-1] in ("idle", "mixed")]
            if out.returncode == 0 and len(ok) == len(hosts):
                return
            time.sleep(0.5)
        raise RuntimeError(
            f"{', '.join(hosts)} not in service (sinfo: {states!r})\n{self.log_tail('slurmctld')}"
            + "".join(f"\n{self.log_tail(f'slurmd.{h}')}" for h in hosts)
        )

    def job_pids(self, host: str) -> list[int]:
        """Processes of jobs on `host`: everything in its namespace but the daemons."""
        daemons = set()
        for path in self.pid_files.values():
            try:
                daemons.add(int(path.read_text().strip()))
            except (OSError, ValueError):
                pass
        pids = [int(p) for p in _ip("netns", "pids", self.namespaces[host]).stdout.split()]
        return [p for p in pids if p not in daemons]

    # ---- lifecycle -----------------------------------------------------------------------------
    def start(self, timeout_s: float = 90) -> MultiHostCluster:
        if os.geteuid() != 0:
            raise PermissionError("network namespaces need root")
        remove_stale_namespaces()
        self._make_dirs()
        self._make_network()
        self._start_munge()
        self._write_conf()
        for h in self.hosts:
            (self.root / "spool" / h).mkdir(exist_ok=True)
            Path(f"{self.node_local}.{h}", "pmix").mkdir(parents=True, exist_ok=True)
        self.node_local.mkdir(exist_ok=True)
        self._write_rsh_agent()
        self._daemon(self.host, "slurmctld")
        for h in self.hosts:
            self._daemon(h, "slurmd", "-N", h)
        self._wait_in_service(self.hosts, timeout_s)
        return self

    def _daemon(self, host: str, daemon: str, *args: str) -> None:
        proc = self.exec(host, which(daemon), "-f", str(self.conf), *args)
        if proc.returncode != 0:
            name = daemon if daemon == "slurmctld" else f"slurmd.{host}"
            raise RuntimeError(
                f"{daemon} on {host} did not start ({proc.returncode}): {proc.stderr}"
                f"\n{self.log_tail(name)}"
            )

    def _make_network(self) -> None:
        _ip("netns", "add", self.switch)
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "br0", "up")
        for i, h in enumerate(self.hosts, start=1):
            ns = self.namespaces[h]
            _ip("netns", "add", ns)
            veth = ["eth0", "type", "veth", "peer", "name", f"p{i}", "netns", self.switch]
            _ip("-n", ns, "link", "add", *veth)
            _ip("-n", ns, "addr", "add", f"{self.addrs[h]}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "lo", "up")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", self.switch, "link", "set", f"p{i}", "master", "br0")
            _ip("-n", self.switch, "link", "set", f"p{i}", "up")
            etc = NETNS_DIR / ns
            etc.mkdir(parents=True, exist_ok=True)
            lines = ["127.0.0.1 localhost"]
            for other in self.hosts:
                if other == h and self.loopback_alias:
                    lines.append(f"127.0.1.1 {h}")
                else:
                    lines.append(f"{self.addrs[other]} {other}")
            (etc / "hosts").write_text("\n".join(lines) + "\n")

    def _write_conf(self) -> None:
        ctld_port, slurmd_port = 6817, 6818  # every host has its own network: no collisions
        r = self.root
        settings = self._conf_settings(ctld_port, slurmd_port)
        settings.update(
            ClusterName="dsparkmulti",
            SlurmctldHost=f"{self.host}({self.addrs[self.host]})",
            SlurmUser="root",
            TaskPlugin=self.task_plugin,
            MpiDefault=self.mpi_default,
            KillWait=self.kill_wait_s,
            SlurmdTimeout=self.slurmd_timeout_s,
            SlurmdSpoolDir=f"{r / 'spool'}/%n",
            SlurmdPidFile=f"{r}/slurmd.%n.pid",
            SlurmdLogFile=f"{r / 'log'}/slurmd.%n.log",
            SlurmdParameters="config_overrides",
        )
        nodes = [
            f"NodeName={h} NodeAddr={self.addrs[h]} NodeHostname={h} CPUs={self.cpus} "
            f"RealMemory={self.real_memory_mb} State=UNKNOWN"
            for h in self.hosts
        ]
        self._write_conf_text(
            f"written by tests/helpers/multihost.py: {self.n} hosts in network namespaces",
            settings,
            nodes,
        )

        # NOTE: PMIx's per-step directories would collide in the /tmp the hosts share
        (self.root / "mpi.conf").write_text(f"PMIxCliTmpDirBase={self.node_local / 'pmix'}\n")

    def stop(self) -> None:
        """Cancel jobs, stop the daemons, remove the namespaces and their /etc/netns entries."""
        try:
            if self.conf.exists() and self.pid_files["slurmctld"].exists():
                self.exec(None, "scancel", "--full", "--user", "0", timeout=30)
        except (OSError, subprocess.SubprocessError):
            pass
        for name in (*(f"slurmd.{h}" for h in self.hosts), "slurmctld", "munged"):
            try:
                pid = int(self.pid_files[name].read_text().strip())
            except (OSError, ValueError):
                continue
            _terminate(pid)
        for ns in (*self.namespaces.values(), self.switch):
            _kill_namespace_processes(ns)
            _ip("netns", "del", ns, check=False)
            shutil.rmtree(NETNS_DIR / ns, ignore_errors=True)


def require_multihost() -> None:
    """Fails the test, naming what is missing, unless this machine can make namespace hosts."""
    missing = [b for b in (*BINARIES, "ip", "unshare", "nsenter") if which(b) is None]
    if missing:
        pytest.fail(missing_message(missing, (*APT_PACKAGES, "iproute2")), pytrace=False)
    if os.geteuid() != 0:
        pytest.fail(
            "the multi-host cluster needs root (network namespaces, slurmd): run the tests as "
            "root, as .ci/run does",
            pytrace=False,
        )


@pytest.fixture(scope="session")
def multihost_cluster(tmp_path_factory):
    """A started 2-host cluster (dsn1, dsn2; 2 CPUs each; MpiDefault=pmi2)."""
    require_multihost()
    yield from serve(MultiHostCluster(tmp_path_factory.mktemp("multihost")))


__all__ = ["MultiHostCluster", "multihost_cluster", "require_multihost", "SBIN"]
