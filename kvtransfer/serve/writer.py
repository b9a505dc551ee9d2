"""The producer's store writes, off the forward step: gathered K/V go to one background thread that writes them.

vLLM calls the connector's `wait_for_save` at the end of every forward step, and every request in the batch waits
for it; a store write (hashing, serialising, one file per block) takes seconds at thousands of tokens. So the
worker only gathers a prompt's new blocks out of the paged cache (a copy: the paged blocks may be reused as soon as
the step ends) and hands them to `StoreWriter.submit`, which returns at once. One thread writes them in the
order they came (a conversation's later turn never lands before its earlier one).

Bounded: at most `max_pending_bytes` of gathered K/V wait in memory; a submit beyond that waits for the writer
(backpressure, counted as `waited_s`) instead of growing the worker's memory without limit. A consumer that looks
up a prompt whose write is still in flight maps the blocks already written and prefills the rest (blocks are
written in chain order, each atomically). `background=False` writes inside `submit` (the old synchronous path).
"""
from __future__ import annotations

import logging
import queue
import threading
import time

import torch

from .store import KVStore

log = logging.getLogger("kvtransfer.serve")


def _nbytes(layers: list[tuple[torch.Tensor, torch.Tensor]]) -> int:
    return sum(t.numel() * t.element_size() for kv in layers for t in kv)


class StoreWriter:
    """Writes (token ids, per-layer K/V, identity, first) to a KVStore on a background thread; `stats` counts
    writes, blocks, bytes, failures and the seconds submits waited."""

    def __init__(self, store: KVStore, *, max_pending_bytes: int = 1 << 30, background: bool = True):
        self.store, self.max_pending_bytes, self.background = store, int(max_pending_bytes), background
        self.stats = {"submitted": 0, "written_blocks": 0, "written_bytes": 0, "failed": 0, "waited_s": 0.0,
                      "write_s": 0.0}
        self._pending = 0
        self._cond = threading.Condition()
        self._queue: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None

    def submit(self, req_id: str, token_ids: list[int], layers: list[tuple[torch.Tensor, torch.Tensor]],
               model: dict, first: int = 0) -> None:
        """Queue one prompt's blocks from token `first` on (layers: [n_kv, len(token_ids) - first, head_dim] each).
        Returns at once unless the pending bytes are over the cap; never raises for a failed write (it is logged
        and counted when it happens)."""
        size = _nbytes(layers)
        self.stats["submitted"] += 1
        if not self.background:
            self._write(req_id, token_ids, layers, model, first, size)
            return
        t0 = time.perf_counter()
        with self._cond:
            while self._pending and self._pending + size > self.max_pending_bytes:
                self._cond.wait(timeout=1.0)
            self._pending += size
        self.stats["waited_s"] += time.perf_counter() - t0
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._run, name="kvtransfer-store-writer", daemon=True)
            self._thread.start()
        self._queue.put((req_id, token_ids, layers, model, first, size))

    def _run(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                self._queue.task_done()
                return
            try:
                self._write(*job)
            finally:
                with self._cond:
                    self._pending -= job[-1]
                    self._cond.notify_all()
                self._queue.task_done()

    def _write(self, req_id, token_ids, layers, model, first, size) -> None:
        t0 = time.perf_counter()
        try:
            blocks = self.store.write(token_ids, layers, model, first=first)
            self.stats["written_blocks"] += blocks
            self.stats["written_bytes"] += size
        except Exception as err:  # noqa: BLE001 -- a failed save (disk full, ...) is a future miss, not a failure
            self.stats["failed"] += 1
            log.error("kvtransfer: could not store request %s: %s: %s", req_id, type(err).__name__, err)
        self.stats["write_s"] += time.perf_counter() - t0

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until every submitted write is done (True), or `timeout_s` passed (False)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._cond:
            while self._pending:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(timeout=left if left is not None else 1.0)
        return True

    def close(self, timeout_s: float = 60.0) -> None:
        """Finish the queued writes (up to `timeout_s`) and stop the thread."""
        if self._thread is not None and self._thread.is_alive():
            self.flush(timeout_s)
            self._queue.put(None)
            self._thread.join(timeout=5.0)
