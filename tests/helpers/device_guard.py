"""A CPU stand-in for the rule NCCL enforces and gloo does not: a tensor handed to a collective
must live on the process group's device (`RuntimeError: No backend type associated with device
type cpu` on a GPU node). CI has no GPU, so the 2-rank gloo tests run under this guard.

How it decides, without a GPU: a tensor is *host-born* when a factory made it without saying
where (`torch.tensor([...])`, `torch.zeros(n)`, `torch.from_numpy`... with no `device=`), when
it was sent to the host on purpose (`.cpu()`), or when every tensor it was computed from was
host-born (`host.float()`, `torch.stack([host, host])`); a hard-coded `device="cpu"` counts as
host-born too. On a GPU run such a tensor is a CPU tensor. A tensor made with an explicit
device (`device=collective_device()`, `.to(device)`, `zeros_like(x, device=d)`) or computed
with one is not. Wrapped `torch.distributed`
collectives reject a host-born tensor when the call comes from the policed code (dspark_ds by
default); DeepSpeed's own calls and torch's internals are not ours to police.

Limits (deliberate): an explicit device taken from a host tensor (`x.to(host.device)`) counts
as explicit; ops run in other threads (torch function modes are per thread) are not seen.

    with DeviceGuard() as guard:       # in a rank, around the work
        ...
    guard.stats                        # {"policed": n, "skipped": m}: the guard really looked

    python tests/helpers/device_guard.py -m dspark_ds.cli eval ...   # a whole process, guarded
    python tests/helpers/device_guard.py tests/helpers/dist.py train-many spec.json
"""

from __future__ import annotations

import functools
import json
import os
import runpy
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

REPO = Path(__file__).resolve().parents[2]
PACKAGE_ROOT = str(REPO / "dspark_ds") + os.sep
TORCH_ROOT = str(Path(torch.__file__).resolve().parent) + os.sep
THIS_FILE = str(Path(__file__).resolve())

COLLECTIVES = (
    "all_reduce",
    "all_reduce_coalesced",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_coalesced",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "broadcast",
    "reduce",
    "all_to_all",
    "all_to_all_single",
    "gather",
    "scatter",
    "send",
    "recv",
    "isend",
    "irecv",
)
# No tensor of the caller's reaches these (torch picks the device itself), but they are
# counted, so a test can see that the guarded code did talk to the other ranks.
OBJECT_COLLECTIVES = ("barrier", "all_gather_object", "gather_object", "broadcast_object_list")
STATS_ENV = "DEVICE_GUARD_STATS"
"""If set, every policed call rewrites `<value>.<pid>` with the guard's counts (JSON): multi-rank
entry points leave with os._exit, past any exit hook."""
_MARK = "_device_guard_host_born"


class DeviceGuardError(RuntimeError):
    """A host-born tensor reached a collective: on NCCL this call would fail."""


def _tensors(values) -> Iterator[torch.Tensor]:
    """Tensors among `values`, looking one level into lists / tuples (torch.stack, cat...)."""
    for v in values:
        if isinstance(v, torch.Tensor):
            yield v
        elif isinstance(v, (list, tuple)):
            for w in v:
                if isinstance(w, torch.Tensor):
                    yield w


def _storage_ptr(t: torch.Tensor) -> int | None:
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # meta, sparse, nested...
        return None


def host_born_site(t: torch.Tensor) -> str | None:
    """Where the host-born tensor `t` (or what it came from) was made; None if it is not one.

    The mark holds the storage it was given for: `param.data = moved` (Module.to) keeps the
    Python object but not the storage, and so drops the mark."""
    mark = getattr(t, _MARK, None)
    if mark is None:
        return None
    ptr, site = mark
    return site if ptr == _storage_ptr(t) else None


def _mark(t: torch.Tensor, site: str) -> None:
    try:
        setattr(t, _MARK, (_storage_ptr(t), site))
    except (AttributeError, RuntimeError):  # a C++-only tensor subclass
        pass


def _unmark(t: torch.Tensor) -> None:
    if getattr(t, _MARK, None) is not None:
        try:
            delattr(t, _MARK)
        except AttributeError:
            pass


def _caller(skip_files: tuple[str, ...] = ()) -> tuple[str, int]:
    """(file, line) of the nearest frame outside torch and this module."""
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_code.co_filename
        if not name.startswith(TORCH_ROOT) and name != THIS_FILE and name not in skip_files:
            return name, frame.f_lineno
        frame = frame.f_back
    return "?", 0


def _explicit_device(func, args, kwargs) -> bool | str | torch.Tensor | None:
    """What the call says about the device of its result: True = a device (not the literal
    "cpu"), "cpu" = the literal host, a Tensor = `.to(other)` (follows other), None = nothing."""
    device = kwargs.get("device")
    if device is None and func is torch.Tensor.to:  # to(device | str | tensor | dtype, ...)
        first = args[1] if len(args) > 1 else kwargs.get("other")
        if isinstance(first, torch.Tensor):
            return first
        if isinstance(first, (torch.device, str, int)):
            device = first
    if device is None:
        return True if func is torch.Tensor.cuda else None
    # NOTE: a hard-coded "cpu" string is a host tensor on a GPU run too; a torch.device("cpu")
    # object is indistinguishable from the run's own device on a CPU test, so it counts as
    # explicit.
    return "cpu" if isinstance(device, str) and device.split(":")[0] == "cpu" else True


class _Mode(TorchFunctionMode):
    def __init__(self, guard: DeviceGuard):
        super().__init__()
        self.guard = guard

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if not self.guard.active:
            return out
        outs = [out] if isinstance(out, torch.Tensor) else list(_tensors([out]))
        if not outs:
            return out
        inputs = list(_tensors(args)) + list(_tensors(kwargs.values()))
        explicit = _explicit_device(func, args, kwargs)
        moved = explicit is not None or func is torch.Tensor.cpu  # a move / placement
        if isinstance(explicit, torch.Tensor):
            site = host_born_site(explicit)
        elif explicit == "cpu" or func is torch.Tensor.cpu:
            file, line = _caller()
            site = f"{file}:{line} ({getattr(func, '__name__', func)} to the host)"
        elif explicit:
            site = None
        elif not inputs:  # a factory without a device
            file, line = _caller()
            site = f"{file}:{line} ({getattr(func, '__name__', func)} without device=)"
        else:
            sites = [host_born_site(t) for t in inputs]
            site = sites[0] if all(s is not None for s in sites) else None
        if moved and out is args[0]:
            # NOTE: a move to where the tensor already is returns the tensor itself (every
            # move in a CPU test); on a GPU run it is a copy. To the host: an alias stands for
            # that copy (the input stays as it was). To a device: the tensor itself counts as
            # moved (`x = x.to(device)`, and Module.to, which keeps its Parameter objects).
            if site is not None:
                out = outs[0] = out.view_as(out)
            else:
                _unmark(out)
                return out
        for t in outs:
            if any(t is i for i in inputs):
                continue  # in place: the tensor stays where it was
            if site is None:
                _unmark(t)
            else:
                _mark(t, site)
        return out


class DeviceGuard:
    """Context manager: the marking mode plus wrapped torch.distributed collectives.

    police: path prefixes of the code whose collective calls are checked (dspark_ds by
    default); calls from anywhere else (DeepSpeed, torch, tests) are counted as skipped.
    """

    def __init__(self, police: tuple[str, ...] = (PACKAGE_ROOT,)):
        self.police = tuple(police)
        self.stats = {"policed": 0, "skipped": 0}
        self.active = False
        self._mode = _Mode(self)
        self._saved: dict[str, Callable] = {}

    def _wrap(self, name: str, fn: Callable) -> Callable:
        @functools.wraps(fn)
        def checked(*args, **kwargs):
            file, line = _caller()
            if self.active and file.startswith(self.police):
                self.stats["policed"] += 1
                tensors = list(_tensors(args)) + list(_tensors(kwargs.values()))
                self.check(name, tensors, file, line)
                self._write_stats()
            else:
                self.stats["skipped"] += 1
            return fn(*args, **kwargs)

        return checked

    def _write_stats(self) -> None:
        path = os.environ.get(STATS_ENV)
        if path:
            Path(f"{path}.{os.getpid()}").write_text(json.dumps(self.stats))

    @staticmethod
    def check(name: str, tensors: list[torch.Tensor], file: str, line: int) -> None:
        for t in tensors:
            site = host_born_site(t)
            if site is not None:
                raise DeviceGuardError(
                    f"{name} at {file}:{line} got a tensor made on the host ({site}): NCCL "
                    "needs it on the process group's device; build it with "
                    "device=dspark_ds.distributed.collective_device() (or use "
                    "distributed.all_reduce_values)"
                )
            if dist.is_initialized() and dist.get_backend() == "nccl" and t.device.type != "cuda":
                raise DeviceGuardError(f"{name} at {file}:{line}: a {t.device} tensor under NCCL")

    def __enter__(self) -> DeviceGuard:
        for name in COLLECTIVES + OBJECT_COLLECTIVES:
            fn = getattr(dist, name, None)
            if fn is not None:
                self._saved[name] = fn
                setattr(dist, name, self._wrap(name, fn))
        self._mode.__enter__()
        self.active = True
        return self

    def __exit__(self, *exc) -> bool:
        self.active = False
        self._mode.__exit__(*exc)
        for name, fn in self._saved.items():
            setattr(dist, name, fn)
        self._saved.clear()
        return False


def main(argv: list[str]) -> None:
    """`device_guard.py -m module args...` or `device_guard.py script.py args...`: run it
    guarded, as `python` would (sys.argv as the module / script sees it)."""
    if argv[:1] == ["-m"] and len(argv) > 1:
        target, sys.argv = argv[1], [argv[1], *argv[2:]]
        run = functools.partial(runpy.run_module, target, run_name="__main__", alter_sys=True)
    elif argv:
        target, sys.argv = argv[0], list(argv)
        sys.path.insert(0, str(Path(target).resolve().parent))
        run = functools.partial(runpy.run_path, target, run_name="__main__")
    else:
        raise SystemExit("usage: device_guard.py (-m module | script.py) [args...]")
    with DeviceGuard() as guard:
        try:
            run()
        finally:
            # NOTE: multi-rank entry points leave with os._exit (distributed.leave), so this
            # line is printed only by processes that return normally.
            print(f"[device_guard] {guard.stats}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
