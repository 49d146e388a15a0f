"""``data.mode: served``: the target's hidden states, computed by the vLLM fleet that serves it.

Each training sequence is one ``POST /v1/completions`` (its token ids as the prompt,
``max_tokens: 1``) to the least busy server in rotation (`Fleet`: retries, backoff, servers
taken out of rotation and probed back). The server runs vLLM's ``extract_hidden_states`` method
with a KV connector that writes the tapped layers of the prompt into ``data.served.storage``
and answers with the file's path; the file is read (after the connector's lock is released),
checked, turned into the feature contract (`ServedLayout.features`: our tap ids, the final norm
applied here) and deleted. Nothing is trained on a file that is missing, truncated or of the
wrong shape: the request is named in one line and tried again, on any server.

    features = ServedFeatures(cfg.served, layout, norm, hidden_size=H, vocab_size=V,
                              lm_head=head, say=log)
    features.check(probe_ids)           # ConfigError naming the URL of an unfit server
    for batch in features.batches(todo, store, collate): ...    # prefetched, in order
    features(batch)                     # one collated token batch, its features (hybrid's tail)
    features.close()

One asyncio loop per rank, on a thread of its own, holds the HTTP session; the training thread
submits whole micro-batches and waits only when the next one is not ready. At most
``prefetch_batches`` micro-batches are in flight or waiting (their features in host memory); a
file lives on the storage only between the server's write and our read.
"""

from __future__ import annotations

import asyncio
import fcntl
import json
import os
import socket
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from dspark_ds.data.config import ServedConfig
from dspark_ds.data.fleet import BadAnswer, Fleet, FleetDown, RequestFailed, Server
from dspark_ds.drafters.common.target_config import text_config
from dspark_ds.errors import ConfigError, TrainingStopped
from dspark_ds.serve.hidden_states import FORMAT, ServedLayout
from dspark_ds.target import target_final_norm, target_model_config

HEAD_TOP_K = 5
"""At the start-up check the server's greedy token must be among our top-k of lm_head(last
state): a different target, vocabulary or last layer fails it; bf16 rounding does not."""


class DataUnavailable(TrainingStopped):
    """A micro-batch whose features the fleet could not deliver (every try of a sequence failed,
    or no server in rotation for ``give_up_s``)."""


class _Answer:
    """What a completion with ``kv_transfer_params`` says: the file, the prompt it echoes, the
    token it generated."""

    def __init__(self, raw: bytes):
        try:
            data = json.loads(raw)
            self.request_id = str(data.get("id", "?"))
            self.path = data["kv_transfer_params"]["hidden_states_path"]
            choice = data["choices"][0]
            self.prompt = choice.get("prompt_token_ids")
            self.generated = (choice.get("token_ids") or [None])[0]
            if not isinstance(self.path, str):
                raise TypeError
        except (ValueError, KeyError, IndexError, TypeError, AttributeError):
            text = " ".join(raw.decode("utf-8", "replace").split())[:160]
            raise ValueError(
                "not a completion with kv_transfer_params.hidden_states_path (is the server "
                f"started with the extract_hidden_states method and a hidden-states connector? "
                f"dspark-ds serve-target): {text}"
            ) from None


def wait_for_file(path: Path, wait_s: float, named: str | None = None) -> None:
    """Returns once ``path`` is whole: it or its ``<file>.lock`` has appeared (a shared file
    system may show them late), and the connector's writer, which holds an exclusive lock on the
    lock file until the file is complete, let go of it (stock connectors and ours). `BadAnswer`
    after ``wait_s``; ``named``: the path the server gave, for the message."""
    lock = path.with_name(path.name + ".lock")
    deadline = time.monotonic() + wait_s
    while not path.exists() and not lock.exists():
        if time.monotonic() > deadline:
            raise BadAnswer(f"{path} is missing (the server named {named or path})")
        time.sleep(0.01)
    if not lock.exists():
        return
    with open(lock) as f:
        while True:
            try:
                fcntl.flock(f, fcntl.LOCK_SH | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise BadAnswer(
                        f"{lock} still locked by its writer after {wait_s:g} s"
                    ) from None
                time.sleep(0.005)


def _discard(path: Path) -> None:
    for p in (path, path.with_name(path.name + ".lock")):
        p.unlink(missing_ok=True)


class ServedFeatures:
    """One rank's client of the target's fleet (module docstring)."""

    def __init__(
        self,
        cfg: ServedConfig,
        layout: ServedLayout,
        final_norm: Callable[[torch.Tensor], torch.Tensor],
        *,
        hidden_size: int,
        vocab_size: int,
        lm_head: torch.Tensor | None,
        say: Callable[[str], None] = print,
    ):
        self.cfg, self.layout, self.final_norm = cfg, layout, final_norm
        self.hidden_size, self.vocab_size, self.lm_head = hidden_size, vocab_size, lm_head
        self.say = say
        self.storage = Path(cfg.storage)
        self.storage.mkdir(parents=True, exist_ok=True)
        self.sequences = self.tokens = 0
        self.fetch_s = 0.0
        """Sequences and tokens delivered, and the seconds of their requests (summed)."""
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="served-features", daemon=True
        )
        self._thread.start()
        self.fleet = Fleet(cfg, say=say, label="data", option="data.served")
        self._call(self.fleet.__aenter__())
        self._closed = False
        self.model: str | None = None
        """The served model's name, once `check` passed."""
        self._prefix = f"dspark-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self._named = self._in_flight = 0

    def _call(self, coro, timeout: float | None = None):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    def counts(self) -> tuple[int, int]:
        """(sequences, tokens) delivered so far."""
        return self.sequences, self.tokens

    # ---- start-up ------------------------------------------------------------------------------
    def check(self, probe_ids: list[int]) -> str:
        """Every server lists the model and answers ``probe_ids`` with a file of the recipe's
        layers, hidden size and vocabulary (our connector's metadata where it wrote some, the
        shapes always, and the server's greedy token among our top-k of lm_head(last state)).
        Returns the model; ConfigError naming the first unfit URL. Checks once per client (the
        training and the held-out loaders share it)."""
        if self.model is None:
            try:
                model = self._call(self.fleet.check_models())
                for i, server in enumerate(self.fleet.servers):
                    self._call(self._probe(i, server, probe_ids))
            except BaseException:
                self.close()
                raise
            self.model = model
            self.say(
                f"[data] served: {len(self.fleet.servers)} server(s) of {model!r}, vLLM aux "
                f"layers {self.layout.aux_ids}, storage {self.cfg.storage}, "
                f"{self.cfg.prefetch_batches} micro-batches ahead"
            )
        return self.model

    async def _probe(self, i: int, server: Server, ids: list[int]) -> None:
        where = self.fleet.where(i)
        body = {"model": self.fleet.model, **self._body(ids)}
        try:
            answer = await self.fleet.post(
                server, "/completions", body, _Answer, timeout_s=self.cfg.timeout_s
            )
            sample = await asyncio.to_thread(self._read, answer, ids, strict=True)
        except ConfigError:
            raise
        except BadAnswer as bad:
            raise ConfigError(f"{where}: {bad.reason}") from None
        except Exception as err:  # the fleet's failures: one line, the reason
            raise ConfigError(f"{where}: a hidden-states request failed: {err}") from None
        if self.lm_head is not None and answer.generated is not None:
            last = sample["target_last_hidden_states"][-1]
            logits = (self.lm_head @ last.to(self.lm_head.dtype)).float()  # no [V, H] copy
            top = logits.topk(min(HEAD_TOP_K, logits.numel())).indices.tolist()
            if int(answer.generated) not in top:
                raise ConfigError(
                    f"{where}: its greedy token after the probe ({answer.generated}) is not among "
                    f"the recipe's target's top {HEAD_TOP_K} ({top}): it serves another target "
                    "(weights, vocabulary or last layer differ from target.path)"
                )

    # ---- one sequence --------------------------------------------------------------------------
    def _body(self, ids: list[int]) -> dict:
        """A completion of ``ids`` that only prefills, asking (our connector) for a file name of
        this client's: its files are known before their answers come."""
        self._named += 1
        name = f"{self._prefix}-{self._named}.safetensors"
        return {
            "prompt": ids,
            "max_tokens": 1,
            "temperature": 0.0,
            "return_token_ids": True,
            "kv_transfer_params": {"hidden_states_name": name},
        }

    def sweep(self) -> int:
        """Deletes the files this client asked for that nobody will read (an answer lost with
        its connection, a request cut off: the server wrote on); call it when nothing of this
        client is in flight. Returns how many went."""
        gone = 0
        if self._in_flight:  # another iterator's requests (a validation beside training)
            return gone
        for path in self.storage.glob(f"{self._prefix}-*"):
            path.unlink(missing_ok=True)
            gone += path.suffix != ".lock"
        return gone

    async def _sequence(self, sample: dict, where: str) -> dict:
        """``sample`` (a token store row) with its features, from the fleet."""
        ids = [int(t) for t in sample["input_ids"]]
        t0 = time.perf_counter()
        self._in_flight += 1

        async def read(answer: _Answer, server: Server) -> dict:
            try:
                return await asyncio.to_thread(self._read, answer, ids, strict=False)
            except BadAnswer as bad:
                self.say(
                    f"[data] served: sample {sample['sample_id']} ({where}; request "
                    f"{answer.request_id} to {server.base}): {bad.reason}; trying it again"
                )
                raise

        try:
            feats, _ = await self.fleet.request("/completions", self._body(ids), _Answer, read)
        except RequestFailed as err:
            raise DataUnavailable(
                f"[data] served: sample {sample['sample_id']} ({where}): every try failed, the "
                f"last: {err}"
            ) from None
        except FleetDown as err:
            raise DataUnavailable(f"[data] served: {err}") from None
        finally:
            self._in_flight -= 1
        self.sequences += 1
        self.tokens += len(ids)
        self.fetch_s += time.perf_counter() - t0
        return {**sample, **feats}

    def _read(self, answer: _Answer, ids: list[int], strict: bool) -> dict:
        """The features of ``answer``'s file (our storage, the server's file name), which is
        deleted whatever its state. ``strict`` (the start-up probe): our connector's metadata
        must match the recipe too."""
        path = self.storage / Path(answer.path).name
        try:
            wait_for_file(path, self.cfg.file_wait_s, answer.path)
            try:
                with safe_open(str(path), framework="pt") as f:
                    meta = f.metadata() or {}
                    hidden, tokens = f.get_tensor("hidden_states"), f.get_tensor("token_ids")
            except FileNotFoundError:
                raise BadAnswer(f"{path} is missing (the server named {answer.path})") from None
            except (SafetensorError, OSError, KeyError, ValueError, RuntimeError) as err:
                why = " ".join(str(err).split())[:120]
                raise BadAnswer(f"{path} cannot be read (truncated or damaged: {why})") from None
        finally:
            _discard(path)
        self._check_file(path, meta, hidden, tokens, ids, answer, strict)
        hidden_states, last = self.layout.features(hidden, self.final_norm)
        return {"target_hidden_states": hidden_states, "target_last_hidden_states": last}

    def _check_file(self, path, meta, hidden, tokens, ids, answer, strict: bool) -> None:
        want = (len(ids), len(self.layout.aux_ids), self.hidden_size)
        if meta.get("format") == FORMAT:
            served = json.loads(meta.get("aux_layer_ids", "[]"))
            if served != self.layout.aux_ids:
                raise BadAnswer(
                    f"the server taps vLLM aux layers {served}, the recipe needs "
                    f"{self.layout.aux_ids} (target.layer_ids {list(self.layout.layer_ids)} + the "
                    "last layer); restart it with dspark-ds serve-target on this recipe",
                    down=True,
                )
            for key, have in (("hidden_size", self.hidden_size), ("vocab_size", self.vocab_size)):
                if meta.get(key) not in (None, str(have)):
                    raise BadAnswer(
                        f"the served target has {key} {meta[key]}, the recipe's has {have}",
                        down=True,
                    )
        if hidden.dim() != 3 or tuple(hidden.shape) != want or not hidden.is_floating_point():
            raise BadAnswer(
                f"{path}: hidden_states of shape {tuple(hidden.shape)} ({hidden.dtype}), expected "
                f"{want} (tokens, the {len(self.layout.aux_ids)} tapped layers "
                f"{self.layout.aux_ids}, hidden size)",
                down=strict,
            )
        if tokens.tolist() != ids or (answer.prompt is not None and list(answer.prompt) != ids):
            raise BadAnswer(f"{path}: token_ids differ from the sequence sent")

    # ---- micro-batches ---------------------------------------------------------------------------
    async def _batch(self, samples: list[dict], where: str) -> list[dict]:
        return list(await asyncio.gather(*(self._sequence(s, where) for s in samples)))

    def batches(
        self, todo: Iterable[tuple[str, list[dict]]], collate: Callable[[list[dict]], dict]
    ) -> Iterator[dict]:
        """Collated feature batches of ``todo`` ((where, samples) per micro-batch), in order,
        ``prefetch_batches`` ahead. Closing the iterator early lets what is in flight finish (its
        files read and deleted), at most ``timeout_s``."""
        todo = iter(todo)
        pending: deque[Future] = deque()

        def submit() -> None:
            nxt = next(todo, None)
            if nxt is not None:
                where, samples = nxt
                coro = self._batch(samples, where)
                pending.append(asyncio.run_coroutine_threadsafe(coro, self._loop))

        for _ in range(self.cfg.prefetch_batches):
            submit()
        try:
            while pending:
                samples = pending.popleft().result()
                submit()
                yield collate(samples)
        finally:
            self._drain(pending)
            self.sweep()

    def _drain(self, pending: deque[Future]) -> None:
        deadline = time.monotonic() + min(self.cfg.timeout_s, 120.0)
        for fut in pending:
            try:
                fut.result(timeout=max(0.0, deadline - time.monotonic()))
            except FutureTimeout:
                fut.cancel()
            except Exception:  # noqa: BLE001 - discarded batches: their failure no longer matters
                pass

    def __call__(self, batch: dict) -> dict:
        """A collated token batch (``input_ids``, ``loss_mask``, ``attention_mask``,
        ``sample_ids``) with its features, zero on the padding as the collator pads them (what
        hybrid mode's cache fill asks of a feature provider)."""
        lengths = batch["attention_mask"].sum(-1).tolist()
        samples = [
            {
                "sample_id": int(batch["sample_ids"][b]),
                "input_ids": batch["input_ids"][b, :n],
                "loss_mask": batch["loss_mask"][b, :n],
            }
            for b, n in enumerate(lengths)
        ]
        done = self._call(self._batch(samples, "cache fill"))
        out = dict(batch)
        bsz, seq = batch["input_ids"].shape
        for key in ("target_hidden_states", "target_last_hidden_states"):
            first = done[0][key]
            out[key] = first.new_zeros(bsz, seq, first.shape[-1])
            for b, (sample, n) in enumerate(zip(done, lengths)):
                out[key][b, :n] = sample[key]
        return out

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.sweep()
        try:
            self._call(self.fleet.__aexit__(None, None, None), timeout=30)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=30)


class ServedTarget:
    """What the run knows of a target that only its servers run: its config and the recipe's
    taps (the attributes of `FrozenTarget` a cache header reads, for hybrid mode)."""

    def __init__(self, target_cfg, layer_ids: list[int]):
        self.config = target_model_config(target_cfg)
        tcfg = text_config(self.config)
        self.name_or_path = target_cfg.path
        self.hidden_size = int(tcfg.hidden_size)
        self.num_layers = int(tcfg.num_hidden_layers)
        self.vocab_size = int(tcfg.vocab_size)
        self.layer_ids = list(layer_ids)
        self.dtype = target_cfg.torch_dtype


def connect(
    data_cfg,
    target_cfg,
    layer_ids: list[int],
    lm_head: torch.Tensor | None,
    say: Callable[[str], None],
) -> tuple[ServedFeatures, ServedTarget]:
    """This rank's client of ``data_cfg.served`` for the recipe's target (checked against it by
    the loader, on the first sample: `ServedFeatures.check`)."""
    target = ServedTarget(target_cfg, layer_ids)
    layout = ServedLayout(tuple(layer_ids), target.num_layers)
    features = ServedFeatures(
        data_cfg.served,
        layout,
        target_final_norm(target_cfg.path),
        hidden_size=target.hidden_size,
        vocab_size=target.vocab_size,
        lm_head=lm_head,
        say=say,
    )
    return features, target
