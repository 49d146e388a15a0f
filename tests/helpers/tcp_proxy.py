"""A TCP forwarder on loopback that a test can cut and restore, for a server that must vanish and
come back without being restarted (a vLLM start costs a minute on 2 cores).

    with TcpProxy(upstream_port) as proxy:   # listens on proxy.port, forwards every connection
        proxy.cut()       # closes the listener and every open connection: clients see refusals
        proxy.restore()   # listens on the same port again
        proxy.cut_after(b"POST /v1/completions", 18)  # forwards 18 such requests, then cuts

``cut_after``: a deterministic cut in the middle of a client's run (the 19th request finds the
proxy gone, and so does everything after it until `restore`); ``seen`` counts the requests.

One thread runs the proxy's asyncio loop; the forwarding is byte for byte.
"""

from __future__ import annotations

import asyncio
import threading

from dspark_ds.distributed import free_port


class TcpProxy:
    def __init__(self, upstream_port: int, host: str = "127.0.0.1"):
        self.upstream_port, self.host = upstream_port, host
        self.port = free_port()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._server: asyncio.base_events.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._marker: bytes | None = None
        self._limit: int | None = None
        self.seen = 0

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def __enter__(self) -> TcpProxy:
        self._thread.start()
        self.restore()
        return self

    def __exit__(self, *exc) -> None:
        self.cut()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)

    def _run(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout=30)

    def cut_after(self, marker: bytes, requests: int) -> None:
        self._marker, self._limit, self.seen = marker, requests, 0

    def restore(self) -> None:
        self._limit = None

        async def listen():
            self._server = await asyncio.start_server(self._serve, self.host, self.port)

        self._run(listen())

    def cut(self) -> None:
        self._run(self._close())

    async def _close(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
        for writer in list(self._writers):
            writer.close()
        self._writers.clear()

    async def _serve(self, reader, writer) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(self.host, self.upstream_port)
        except OSError:
            writer.close()
            return
        self._writers |= {writer, up_writer}

        async def pipe(src, dst, upstream: bool):
            try:
                while data := await src.read(1 << 16):
                    if upstream and self._marker is not None and self._marker in data:
                        self.seen += data.count(self._marker)
                        if self._limit is not None and self.seen > self._limit:
                            await self._close()
                            return
                    dst.write(data)
                    await dst.drain()
            except (OSError, asyncio.CancelledError):
                pass
            finally:
                dst.close()
                self._writers.discard(dst)

        await asyncio.gather(pipe(reader, up_writer, True), pipe(up_reader, writer, False))
