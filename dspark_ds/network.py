"""Which network a multi-host job talks over: this host's interfaces, the interface that reaches
the rendezvous host, and the head node's address that every node reaches.

Standard library only (the sbatch scripts call it before anything heavy is imported):

    python -m dspark_ds.network head-address dsn1 dsn2 dsn3   # the head's address, seen by peers
    python -m dspark_ds.network ifname 198.18.0.1             # the interface that reaches it
    python -m dspark_ds.network check 198.18.0.1 29500 --timeout_s 60  # wait until it answers
    python -m dspark_ds.network port 4242                     # a free port for job 4242

The rule (docs/multi-node.md): the interface is the one the kernel routes MASTER_ADDR through;
when MASTER_ADDR is this host and resolves to loopback here (Debian writes `127.0.1.1 <host>`
into /etc/hosts), the interface that reaches the job's other hosts; failing that, the only
non-loopback interface that is up. `DSPARK_IFNAME` (or `distributed.ifname`) overrides it.
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import ipaddress
import os
import socket
import sys
import time
from dataclasses import dataclass


class NetworkError(RuntimeError):
    """The job's network cannot be used as configured (one line, names host, address, port)."""


# ---- this host's interfaces -------------------------------------------------------------------
class _SockaddrIn(ctypes.Structure):
    _fields_ = [
        ("sin_family", ctypes.c_ushort),
        ("sin_port", ctypes.c_uint16),
        ("sin_addr", ctypes.c_uint8 * 4),
    ]


class _Ifaddrs(ctypes.Structure):
    pass


_Ifaddrs._fields_ = [
    ("ifa_next", ctypes.POINTER(_Ifaddrs)),
    ("ifa_name", ctypes.c_char_p),
    ("ifa_flags", ctypes.c_uint),
    ("ifa_addr", ctypes.POINTER(_SockaddrIn)),
    ("ifa_netmask", ctypes.POINTER(_SockaddrIn)),
]

_IFF_UP = 0x1
_IFF_LOOPBACK = 0x8


@dataclass(frozen=True)
class Interface:
    name: str
    addresses: tuple[str, ...]
    """IPv4 addresses."""
    up: bool
    loopback: bool


def interfaces() -> dict[str, Interface]:
    """This host's network interfaces with their IPv4 addresses (getifaddrs(3), so it sees the
    network namespace the process runs in)."""
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    head = ctypes.POINTER(_Ifaddrs)()
    if libc.getifaddrs(ctypes.byref(head)) != 0:
        raise OSError(ctypes.get_errno(), "getifaddrs failed")
    found: dict[str, tuple[list[str], int]] = {}
    try:
        node = head
        while node:
            entry = node.contents
            name = entry.ifa_name.decode()
            addrs, flags = found.setdefault(name, ([], entry.ifa_flags))
            if entry.ifa_addr and entry.ifa_addr.contents.sin_family == socket.AF_INET:
                addrs.append(".".join(str(b) for b in entry.ifa_addr.contents.sin_addr))
            node = entry.ifa_next
    finally:
        libc.freeifaddrs(head)
    return {
        name: Interface(name, tuple(addrs), bool(flags & _IFF_UP), bool(flags & _IFF_LOOPBACK))
        for name, (addrs, flags) in found.items()
    }


def interface_of(address: str) -> str | None:
    """The interface that holds `address` (None if no interface here does)."""
    for iface in interfaces().values():
        if address in iface.addresses:
            return iface.name
    return None


# ---- addresses and routes ---------------------------------------------------------------------
def resolve(host: str) -> str:
    """`host` (a name or an address) → an IPv4 address, as this host's resolver sees it."""
    try:
        return str(ipaddress.IPv4Address(host))
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None, socket.AF_INET, socket.SOCK_STREAM)
    except socket.gaierror as err:
        raise NetworkError(
            f"host {socket.gethostname()}: cannot resolve {host!r} ({err.strerror})"
        ) from err
    return infos[0][4][0]


def is_loopback(address: str) -> bool:
    return ipaddress.IPv4Address(address).is_loopback


def source_address(destination: str) -> str | None:
    """The local address the kernel would send from to reach `destination` (no packet is sent:
    connecting a UDP socket only looks up the route); None when there is no route."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((destination, 9))
        except OSError:
            return None
        return s.getsockname()[0]


@dataclass(frozen=True)
class Choice:
    ifname: str
    address: str
    """This host's address on that interface."""
    why: str


def choose_interface(
    master_addr: str, peers: list[str] | None = None, multi_host: bool = True
) -> Choice:
    """The interface this host's ranks should use to talk to the job (the rule in the module
    docstring). `peers`: other hosts of the job (names or addresses), used when MASTER_ADDR is
    this host and resolves to loopback; `multi_host`: whether loopback is a valid answer."""
    master_ip = resolve(master_addr)
    if master_addr == "localhost" or master_addr == master_ip and is_loopback(master_ip):
        multi_host = False  # a loopback address given as such: every rank is on this host
    src = source_address(master_ip)
    if src is None:
        raise NetworkError(
            f"host {socket.gethostname()}: no route to MASTER_ADDR={master_addr} ({master_ip})"
        )
    name = interface_of(src) or "lo"
    if not is_loopback(src) or not multi_host:
        return Choice(name, src, f"route to MASTER_ADDR {master_addr} ({master_ip})")
    for peer in peers or []:
        try:
            peer_ip = resolve(peer)
        except NetworkError:
            continue
        peer_src = source_address(peer_ip)
        if peer_src is not None and not is_loopback(peer_src):
            return Choice(
                interface_of(peer_src) or "?",
                peer_src,
                f"MASTER_ADDR {master_addr} is this host ({master_ip}, loopback); "
                f"route to peer {peer} ({peer_ip})",
            )
    candidates = [i for i in interfaces().values() if i.up and not i.loopback and i.addresses]
    if len(candidates) == 1:
        only = candidates[0]
        return Choice(
            only.name,
            only.addresses[0],
            f"MASTER_ADDR {master_addr} resolves to loopback ({master_ip}); "
            f"the only other interface that is up",
        )
    names = ", ".join(f"{i.name} ({i.addresses[0]})" for i in candidates) or "none"
    raise NetworkError(
        f"host {socket.gethostname()}: MASTER_ADDR={master_addr} resolves to {master_ip} "
        f"(loopback) here, but the job spans several hosts and the interface is ambiguous "
        f"(up: {names}); set DSPARK_IFNAME or give MASTER_ADDR as an address the other hosts reach"
    )


def head_address(nodes: list[str]) -> str:
    """The first node's address as the other nodes reach it, computed on the first node (where a
    batch script runs): its own name's address unless that is loopback, else the address it
    sends from to reach the second node. One node: its own name's address."""
    own = resolve(nodes[0])
    if not is_loopback(own) or len(nodes) == 1:
        return own
    return choose_interface(nodes[0], nodes[1:]).address


def wait_reachable(host: str, port: int, timeout_s: float, ifname: str | None = None) -> float:
    """Connects to host:port until it accepts (returns the seconds it took) or `timeout_s`
    passes (NetworkError naming this host, the address, port and interface). The connection is
    closed at once."""
    address = resolve(host)
    deadline = time.monotonic() + timeout_s
    t0 = time.monotonic()
    last = ""
    while True:
        try:
            with socket.create_connection(
                (address, port), timeout=max(0.1, min(5.0, deadline - time.monotonic()))
            ):
                return time.monotonic() - t0
        except OSError as err:
            last = err.strerror or type(err).__name__
        if time.monotonic() >= deadline:
            via = f" via {ifname}" if ifname else ""
            raise NetworkError(
                f"host {socket.gethostname()}: the rendezvous {host}:{port} ({address}{via}) did "
                f"not answer within {timeout_s:.0f} s ({last})"
            )
        time.sleep(0.5)


# ---- ports -------------------------------------------------------------------------------------
FIRST_JOB_PORT = 20000


def ephemeral_ports() -> tuple[int, int]:
    """The kernel's range for outgoing connections' local ports (a listener there can find its
    port taken by any client socket of the node)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            lo, hi = (int(x) for x in f.read().split())
        return lo, hi
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def job_port_range() -> tuple[int, int]:
    """Ports [lo, hi) for rendezvous: from FIRST_JOB_PORT up to the ephemeral range, or above it
    when it starts too low."""
    lo, hi = ephemeral_ports()
    if lo - FIRST_JOB_PORT >= 1000:
        return FIRST_JOB_PORT, lo
    if 65535 - hi >= 1000:
        return hi + 1, 65536
    return FIRST_JOB_PORT, FIRST_JOB_PORT + 10000  # the whole space is ephemeral: best effort


def job_port(job_id: str | int) -> int:
    """The rendezvous port of a Slurm job: derived from the job id (two jobs sharing a node get
    different ports), outside the ephemeral range."""
    lo, hi = job_port_range()
    return lo + int(str(job_id).split("_")[0]) % (hi - lo)


def port_is_free(port: int) -> bool:
    """Whether a listener could bind `port` on every address of this host now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("0.0.0.0", port))
        except OSError:
            return False
    return True


def free_job_port(job_id: str | int, tries: int = 50) -> int:
    """`job_port(job_id)`, or the next port of the range that is free here when it is taken."""
    lo, hi = job_port_range()
    first = job_port(job_id)
    for k in range(tries):
        port = lo + (first - lo + k) % (hi - lo)
        if port_is_free(port):
            return port
    raise NetworkError(
        f"host {socket.gethostname()}: ports {first}..{first + tries - 1} are all taken"
    )


# ---- command line (for the batch scripts) -----------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dspark_ds.network")
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("head-address", help="the first node's address as the others reach it")
    p.add_argument("nodes", nargs="+")
    p = sub.add_parser("ifname", help="the interface that reaches MASTER_ADDR")
    p.add_argument("master_addr")
    p.add_argument("peers", nargs="*")
    p = sub.add_parser(
        "port", help="a free rendezvous port for a Slurm job, outside the ephemeral range"
    )
    p.add_argument("job_id")
    p = sub.add_parser("check", help="wait until host:port accepts a connection")
    p.add_argument("host")
    p.add_argument("port", type=int)
    p.add_argument("--timeout_s", type=float, default=60.0)
    args = parser.parse_args(argv)
    try:
        if args.cmd == "head-address":
            print(head_address(args.nodes))
        elif args.cmd == "port":
            print(free_job_port(args.job_id))
        elif args.cmd == "ifname":
            print(
                choose_interface(args.master_addr, args.peers, multi_host=bool(args.peers)).ifname
            )
        else:
            wait_reachable(args.host, args.port, args.timeout_s, os.environ.get("DSPARK_IFNAME"))
    except NetworkError as err:
        print(f"dspark-ds: error: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
