"""The producer's store writes, off the forward step: gathered K/V go to one background thread that writes them.

vLLM calls the connector's `wait_for_save` at the end of every forward step, and every request in the batch waits
for it; a store write (hashing, serialising, fsyncing one file per block) takes seconds at thousands of tokens. So
the worker only gathers a prompt's new blocks out of the paged cache (a copy: the paged blocks may be reused as
soon as the step ends) and hands them to `StoreWriter.submit`, which returns at once. One thread writes them in the
order they came (a conversation's later turn never lands before its earlier one).

Bounded, and never blocking: at most `max_pending_bytes` of gathered K/V wait in memory. A save that would take
the pending bytes over the cap is dropped and counted (`stats["dropped"]`, logged once per `log_every` drops):
a slow or hung store (a stuck network mount) costs future misses, never a stalled forward step. `close` drains
within a deadline and then abandons what is left (the thread is a daemon). A consumer that looks up a prompt whose
write is still in flight maps the blocks already written and prefills the rest (blocks are written in chain order,
each atomically). `background=False` writes inside `submit` (the old synchronous path).

What is stored is checked here, on the writer's thread, never on vLLM's scheduler thread (a stat per block on a
stuck mount would stall every request): after each save, and for each `verify` (a prompt the scheduler believes
stored), the writer asks the store how many of the prompt's leading blocks it holds and appends a report
(chain hashes stored, chain hashes missing) to `reports`; the connector hands them to its scheduler side
(`take_reports`), which keeps the set of chain hashes it knows are stored. A dropped save reports its blocks
missing at once.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque

import torch

from .blockstore import BlockStore

log = logging.getLogger("kvtransfer.serve")


def _nbytes(layers: list[tuple[torch.Tensor, torch.Tensor]]) -> int:
    return sum(t.numel() * t.element_size() for kv in layers for t in kv)


class StoreWriter:
    """Writes (token ids, per-layer K/V, identity, first, namespace) to a BlockStore on a background thread; `stats`
    counts saves submitted, blocks and bytes written (gathered_bytes: the bytes of the saves done, blocks the store
    already held included), failed, dropped (over the byte cap, or after close) and
    abandoned (still pending at close's deadline) saves, the seconds spent writing, and verifications done and
    dropped (beyond `max_pending_verifies` queued). `reports` holds what each save and verification found stored
    (see the module docstring), at most `max_reports` (the oldest dropped: a lost report costs a redundant gather)."""

    def __init__(self, store: BlockStore, *, max_pending_bytes: int = 1 << 30, background: bool = True,
                 log_every: int = 100, max_pending_verifies: int = 256, max_reports: int = 1024):
        self.store, self.max_pending_bytes, self.background = store, int(max_pending_bytes), background
        self.log_every = max(1, int(log_every))
        self.max_pending_verifies = int(max_pending_verifies)
        self.stats = {"submitted": 0, "written_blocks": 0, "written_bytes": 0, "gathered_bytes": 0, "failed": 0,
                      "dropped": 0,
                      "dropped_bytes": 0, "abandoned": 0, "write_s": 0.0, "verified": 0, "verify_dropped": 0}
        self.reports: deque = deque(maxlen=max(1, int(max_reports)))  # (stored hashes, missing hashes), in order
        self._pending = 0  # bytes queued or being written
        self._jobs = 0  # saves queued or being written
        self._verifies = 0  # verifications queued or running
        self._closed = False
        self._cond = threading.Condition()
        self._queue: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None

    def submit(self, req_id: str, token_ids: list[int], layers: list[tuple[torch.Tensor, torch.Tensor]],
               model: dict, first: int = 0, ns: str = "") -> bool:
        """Queue one prompt's blocks from token `first` on, in store namespace `ns` (layers: per layer (keys,
        values) [n_kv, len(token_ids) - first, head_dim]). True: queued (or written, background=False); False:
        dropped -- the pending bytes would pass the cap (a save alone larger than the cap is taken when nothing is
        pending), or the writer is closed. Never blocks in the background mode; never raises for a failed write
        (it is logged and counted when it happens)."""
        size = _nbytes(layers)
        self.stats["submitted"] += 1
        if not self.background:
            self._write(req_id, token_ids, layers, model, first, ns, size)
            return True
        with self._cond:
            drop = self._closed or (self._pending > 0 and self._pending + size > self.max_pending_bytes)
            if drop:
                self.stats["dropped"] += 1
                self.stats["dropped_bytes"] += size
                dropped, pending = self.stats["dropped"], self._pending
            else:
                self._pending += size
                self._jobs += 1
                self._start_thread()
        if drop:
            self._report_missing(token_ids, model, first, ns)
            if dropped % self.log_every == 1 or self.log_every == 1:
                why = ("the writer is closed" if self._closed else
                       f"{pending} bytes already wait for the store (cap {self.max_pending_bytes}): its writes are "
                       f"slow or hung")
                log.warning("kvtransfer: dropped the store save of request %s (%d bytes): %s; %d saves dropped so far "
                            "(logged once per %d)", req_id, size, why, dropped, self.log_every)
            return False
        self._queue.put((req_id, token_ids, layers, model, first, ns, size))
        return True

    def verify(self, req_id: str, token_ids: list[int], model: dict, ns: str = "") -> bool:
        """Queue a check of how many of the prompt's leading full blocks the store holds (a prompt the scheduler
        believes stored: nothing to gather), reported in `reports`. False: dropped (`max_pending_verifies` already
        queued, or the writer is closed). Never blocks in the background mode."""
        if not self.background:
            self._verify(token_ids, model, ns)
            return True
        with self._cond:
            if self._closed or self._verifies >= self.max_pending_verifies:
                self.stats["verify_dropped"] += 1
                return False
            self._verifies += 1
            self._jobs += 1
            self._start_thread()
        self._queue.put((req_id, token_ids, None, model, 0, ns, 0))
        return True

    def take_reports(self) -> tuple[list[str], list[str]]:
        """(chain hashes found stored, chain hashes found missing) of every report since the last call, in the
        order found. A hash in both lists is taken as stored by the connector (it drops the missing, then adds the
        stored): at worst one request skips a block that was evicted meanwhile, and the next verification reports it
        missing, so the view heals."""
        stored, missing = [], []
        while True:
            try:
                have, lack = self.reports.popleft()
            except IndexError:
                return stored, missing
            stored.extend(have)
            missing.extend(lack)

    def _start_thread(self) -> None:
        """Start the writer thread if it is not running (under self._cond)."""
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._run, name="kvtransfer-store-writer", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            try:
                if job[2] is None:
                    self._verify(job[1], job[3], job[5])
                else:
                    self._write(*job)
            finally:
                with self._cond:
                    self._pending -= job[-1]
                    self._jobs -= 1
                    if job[2] is None:
                        self._verifies -= 1
                    self._cond.notify_all()

    def _write(self, req_id, token_ids, layers, model, first, ns, size) -> None:
        t0 = time.perf_counter()
        try:
            blocks = self.store.write(token_ids, layers, model, first=first, ns=ns)
            self.stats["written_blocks"] += blocks
            self.stats["gathered_bytes"] += size
            gathered = (len(token_ids) - first) // self.store.block_size  # blocks already stored were skipped
            self.stats["written_bytes"] += size * blocks // gathered if gathered else 0
        except Exception as err:  # noqa: BLE001 -- a failed save (disk full, ...) is a future miss, not a failure
            self.stats["failed"] += 1
            log.error("kvtransfer: could not store request %s: %s: %s", req_id, type(err).__name__, err)
        self.stats["write_s"] += time.perf_counter() - t0
        self._verify(token_ids, model, ns)

    def _verify(self, token_ids, model, ns) -> None:
        """Report how many of the prompt's leading blocks the store holds (on the writer's thread; a fault: none)."""
        try:
            hashes = self.store.hashes(token_ids, model["key"], ns)
        except Exception as err:  # noqa: BLE001 -- a malformed identity or namespace: nothing to report
            log.error("kvtransfer: cannot hash a prompt for the store (%s: %s)", type(err).__name__, err)
            return
        try:
            n = self.store.stored_blocks(token_ids, model["key"], ns)
        except Exception:  # noqa: BLE001 -- the store did not answer: nothing is known stored
            n = 0
        self.stats["verified"] += 1
        self.reports.append((hashes[:n], hashes[n:]))

    def _report_missing(self, token_ids, model, first, ns) -> None:
        """Report a dropped save's blocks (from token `first` on) missing: the scheduler gathers them again."""
        try:
            hashes = self.store.hashes(token_ids, model["key"], ns)
        except Exception:  # noqa: BLE001
            return
        self.reports.append(([], hashes[first // self.store.block_size:]))

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until every submitted write is done (True), or `timeout_s` seconds passed (False)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._cond:
            while self._jobs:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(timeout=left if left is not None else 1.0)
        return True

    def close(self, timeout_s: float = 10.0) -> bool:
        """Stop taking saves, let the queued writes finish for at most `timeout_s` seconds, and stop the thread.
        True: everything was written; False: the saves still pending at the deadline are abandoned (counted in
        stats["abandoned"], logged) -- the thread is a daemon, so a hung write never keeps the process alive."""
        deadline = time.monotonic() + max(0.0, timeout_s)
        with self._cond:
            again, self._closed = self._closed, True
        thread = self._thread
        if thread is not None and thread.is_alive():
            drained = self.flush(max(0.0, deadline - time.monotonic()))
            self._queue.put(None)  # after the queued jobs: the thread exits once they are done
            if drained:
                thread.join(timeout=max(0.0, deadline - time.monotonic()))
        with self._cond:
            abandoned = self._jobs - self._verifies  # saves; a verification left undone loses nothing
        if abandoned and not again:  # a second close counts nothing twice
            self.stats["abandoned"] += abandoned
            log.error("kvtransfer: the store writer did not finish within %.1f s: %d saves abandoned (the store's "
                      "writes are slow or hung)", timeout_s, abandoned)
        return abandoned == 0
