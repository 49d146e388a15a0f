"""The project's hidden-states connector, run by vLLM's own Python (`dspark-ds serve-target`
puts this folder on its PYTHONPATH and names ``kv_connector_module_path: shared_storage_hidden_states``).

vLLM's stock `ExampleHiddenStatesConnector` with three changes:

- on a KV cache that is not on CUDA (vLLM's CPU build), the tapped states are copied out of the
  cache at once, before ``get_finished`` reports the request done and its blocks are freed: no
  pinned memory, CUDA stream or event (the stock copy needs an accelerator and kills a CPU
  engine at its first file); on CUDA the stock asynchronous copy is kept;
- every file appears whole or not at all: written to a temporary name in the same directory,
  then renamed (``os.replace``); the stock ``<file>.lock`` protocol is kept, so stock clients
  (`load_hidden_states`) still wait on it;
- every file says what wrote it, in its safetensors metadata: ``format`` (FORMAT),
  ``aux_layer_ids`` (JSON: vLLM's ids of the ``k`` columns), ``hidden_size``,
  ``num_hidden_layers``, ``vocab_size`` and ``model`` (the served model's name), so a trainer can
  refuse a server whose target is not its recipe's.

File: ``hidden_states [T, k, H]`` (the model's dtype) and ``token_ids [T]`` (the prompt).
Imports only the standard library, torch, safetensors and vllm.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import uuid
from functools import partial

import torch
from safetensors.torch import save_file
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    PendingSave,
    extract_from_kv_cache,
)
from vllm.v1.request import RequestStatus

FILE_NAME = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,200}\.safetensors")
"""A file name a client may ask for (``kv_transfer_params.hidden_states_name``)."""
FORMAT = "dspark-hidden-states/1"
"""NOTE: the same literal as `dspark_ds.serve.hidden_states.FORMAT` (this module cannot import
dspark_ds); a test checks they agree."""


class _CopyDone:
    """Stands in for the stock CUDA event of a copy that already happened (``get_finished``
    polls ``query()``; the writer thread calls ``synchronize()``)."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


def file_mode() -> int:
    """0666 & ~umask, the mode any other new file gets, read without setting the umask (which
    would race with the threads creating files)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return 0o666 & ~int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return 0o666 & ~mask


def write_atomic(
    tensors: dict[str, torch.Tensor], path: str, metadata: dict[str, str], mode: int
) -> None:
    """``save_file`` to a hidden temporary name beside ``path``, then renamed onto it: a reader
    never sees a partial file, even one that does not wait on the lock.

    NOTE: ``save_file`` creates its file with mode 0600; a trainer running as another user must
    read it, so it gets ``mode``."""
    directory, name = os.path.split(path)
    tmp = os.path.join(directory, f".{name}.{uuid.uuid4().hex[:12]}.tmp")
    try:
        save_file(tensors, tmp, metadata=metadata)
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


class SharedStorageHiddenStatesConnector(ExampleHiddenStatesConnector):
    """`ExampleHiddenStatesConnector` that also runs on CPU engines and writes atomically, with
    metadata (module docstring)."""

    def __init__(self, vllm_config, role, kv_cache_config):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        model = vllm_config.model_config
        spec = vllm_config.speculative_config.draft_model_config.hf_config
        aux_ids = list(getattr(spec, "eagle_aux_hidden_state_layer_ids", []))
        self._file_metadata = {
            "format": FORMAT,
            "aux_layer_ids": json.dumps(aux_ids),
            "hidden_size": str(model.get_hidden_size()),
            "num_hidden_layers": str(model.get_total_num_hidden_layers()),
            "vocab_size": str(model.get_vocab_size()),
            "model": str(model.served_model_name or model.model),
        }
        self._file_mode = file_mode()
        self._lock_paths: dict[str, str] = {}  # worker side: req_id -> its pre-created lock file
        self._written: set[str] = set()  # worker side: writes submitted in this get_finished

    # ---- the client's file name -------------------------------------------------------------------
    def build_connector_meta(self, scheduler_output):
        """The stock one, except that a request whose ``kv_transfer_params`` name a plain file
        (``hidden_states_name``: letters, digits, ``._-``, ending ``.safetensors``) is written
        under that name in the storage: a client that knows its files' names before the answers
        come can delete what a lost answer left behind. No path, only a name: nothing is
        written outside ``shared_storage_path``."""
        meta = super().build_connector_meta(scheduler_output)
        for new_req in scheduler_output.scheduled_new_reqs:
            extra = new_req.sampling_params.extra_args if new_req.sampling_params else None
            name = ((extra or {}).get("kv_transfer_params") or {}).get("hidden_states_name")
            if isinstance(name, str) and FILE_NAME.fullmatch(name):
                path = os.path.join(self._storage_path, name)
                self._request_filenames[new_req.req_id] = path
                meta.new_req_filenames[new_req.req_id] = path
        return meta

    # ---- requests nobody will read: no file, no lock left behind ---------------------------------
    def request_finished(self, request, block_ids):
        """An aborted request (its client went away: a cut connection, a cancelled prefetch)
        writes nothing: nobody would ever read or delete its file. Others as the stock one."""
        if request.status == RequestStatus.FINISHED_ABORTED:
            self._request_filenames.pop(request.request_id, None)
            self._pending_saves.pop(request.request_id, None)
            return False, None
        return super().request_finished(request, block_ids)

    def wait_for_save(self) -> None:
        super().wait_for_save()
        if self.has_connector_metadata():
            metadata = self._get_connector_metadata()
            for req_id, filename in getattr(metadata, "new_req_filenames", {}).items():
                self._lock_paths.setdefault(req_id, filename + ".lock")

    def get_finished(self, finished_req_ids):
        """The stock one, and then the lock files of requests that finished without a write
        (aborted) are deleted: the stock connector only closes them, leaving one empty file per
        aborted request in the storage."""
        held = set(self._lock_fds)
        self._written.clear()
        done = super().get_finished(finished_req_ids)
        for req_id in held - set(self._lock_fds) - self._written:
            lock = self._lock_paths.pop(req_id, None)
            if lock is not None and os.path.exists(lock):
                os.remove(lock)
        return done

    def _write_tensors(self, tensors, event, filename: str, lock_fd: int | None) -> None:
        """Thread worker (the stock one's contract): wait for the copy, write the file, then
        release the lock (closing ``lock_fd``), so a client waiting on it finds the file whole."""
        try:
            event.synchronize()
            write_atomic(tensors, filename, self._file_metadata, self._file_mode)
        finally:
            if lock_fd is not None:
                os.close(lock_fd)

    def _submit_async_write(self, pending: PendingSave) -> None:
        if not self._is_tp_rank_zero:
            return
        assert self._kv_cache is not None
        self._written.add(pending.req_id)
        self._lock_paths.pop(pending.req_id, None)  # its reader deletes it
        if self._kv_cache.is_cuda:
            super()._submit_async_write(pending)
            return
        # NOTE: the copy must be done before this returns: get_finished then reports the
        # request as sent, and the scheduler frees (and may reuse) its blocks.
        block_ids = torch.tensor(pending.block_ids, dtype=torch.long)
        offsets = torch.arange(self._block_size, dtype=torch.long)
        slot_mapping = (block_ids[:, None] * self._block_size + offsets[None, :]).flatten()
        num_tokens = pending.token_ids.shape[0]
        slot_mapping = slot_mapping[:num_tokens].to(self._kv_cache.device)
        # advanced indexing copies: [T, k, H] of its own, no longer aliasing the cache
        hidden = extract_from_kv_cache(self._kv_cache, slot_mapping, num_tokens).cpu()
        tensors = {"hidden_states": hidden, "token_ids": pending.token_ids.clone()}
        assert pending.req_id not in self._req_futures, "another write for the same req_id"
        os.makedirs(os.path.dirname(pending.filename), exist_ok=True)
        lock_fd = self._lock_fds.pop(pending.req_id, None)
        if lock_fd is None and self.use_lock:  # as the stock one: normally made in wait_for_save
            flags = os.O_CREAT | os.O_WRONLY | os.O_TRUNC
            lock_fd = os.open(pending.filename + ".lock", flags, 0o644)
            fcntl.flock(lock_fd, fcntl.LOCK_EX)
        done = _CopyDone()
        future = self._executor.submit(
            self._write_tensors, tensors, done, pending.filename, lock_fd
        )
        self._req_copy_events[pending.req_id] = done
        self._req_futures[pending.req_id] = future
        future.add_done_callback(partial(self._on_write_done, pending.req_id))
