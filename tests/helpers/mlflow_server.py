"""A real `mlflow server` on loopback, and a TCP proxy in front of it that delays each request.

    with MlflowServer(tmp_path) as server, DelayProxy(server.port) as proxy:
        uri = proxy.uri             # http://127.0.0.1:<proxy port>
        proxy.delay_s = 1.0         # from now on each chunk a client sends waits 1 s
        server.kill(); server.start()   # down (SIGKILL), then back on the same port and store

Both stop with the block (the server's whole process group, the proxy's sockets and threads):
nothing is left running after a test.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from helpers.dist import _env, free_port
from helpers.system import wait_healthy


class MlflowServer:
    def __init__(self, root: Path, port: int | None = None):
        self.root, self.port = Path(root), port or free_port()
        self.proc: subprocess.Popen | None = None
        self.uri = f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 90) -> None:
        argv = [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1"]
        argv += ["--port", str(self.port), "--workers", "1"]
        argv += ["--backend-store-uri", f"sqlite:///{self.root / 'server.db'}"]
        argv += ["--artifacts-destination", str(self.root / "artifacts")]
        self.proc = subprocess.Popen(
            argv,
            cwd=self.root,
            env=_env(),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        if wait_healthy(f"{self.uri}/health", self.proc, timeout_s, poll_s=0.3, request_s=2):
            return
        assert self.proc.poll() is None, "the MLflow server exited"
        raise RuntimeError(f"no MLflow server at {self.uri} after {timeout_s} s")

    def kill(self) -> None:
        """SIGKILL to the server's process group (its workers too), and wait for it."""
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)

    def __enter__(self) -> MlflowServer:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.kill()


class DelayProxy:
    """Forwards TCP connections to 127.0.0.1:`upstream_port`; every chunk a client sends waits
    `delay_s` first (an HTTP request, or each piece of a large upload), answers pass at once."""

    def __init__(self, upstream_port: int):
        self.upstream_port = upstream_port
        self.delay_s = 0.0
        self.delayed = 0
        """Chunks delayed so far."""
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self.uri = f"http://127.0.0.1:{self.port}"
        self._sockets: list[socket.socket] = []
        self._threads: list[threading.Thread] = []
        self._closed = threading.Event()

    def __enter__(self) -> DelayProxy:
        self._spawn(self._accept)
        return self

    def __exit__(self, *exc) -> None:
        self._closed.set()
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)  # NOTE: close() alone leaves accept() waiting
        self._listener.close()
        for s in list(self._sockets):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()
        for t in self._threads:
            t.join(timeout=5)

    def _spawn(self, fn, *args) -> None:
        t = threading.Thread(target=fn, args=args, daemon=True)
        self._threads.append(t)
        t.start()

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(("127.0.0.1", self.upstream_port), timeout=5)
            except OSError:  # the server is down: the client sees its connection closed
                client.close()
                continue
            upstream.settimeout(None)
            self._sockets += [client, upstream]
            self._spawn(self._pump, client, upstream, True)
            self._spawn(self._pump, upstream, client, False)

    def _pump(self, src: socket.socket, dst: socket.socket, delayed: bool) -> None:
        try:
            while data := src.recv(65536):
                if delayed and self.delay_s > 0:
                    self.delayed += 1
                    time.sleep(self.delay_s)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)
