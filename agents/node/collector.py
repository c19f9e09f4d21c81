"""The token collector (trainer side): receives every generator's token stream over the fabric and counts each
token of each request exactly once.

Bookkeeping is vectorised: a request gets a slot when its first token arrives; per slot the collector keeps
the contiguous prefix ``next`` (positions 0..next-1 have arrived), the number of unique tokens, duplicates,
tokens out of order (held aside until the gap fills, e.g. around a migration, when the old and the new agent's
streams race), a finished flag and arrival times. A token id that is not the deterministic one for its
(request, position) counts as corrupt. A malformed message is counted and dropped; it never stops the thread.
"""
from __future__ import annotations

import logging
import threading
import time

import numpy as np

from agents.protocol import ProtocolError, TokenBatch, pack_array, token_ids

log = logging.getLogger(__name__)


class TokenLedger:
    """Exactly-once accounting of (request id, position) tokens (pure numpy; the collector thread feeds it)."""

    def __init__(self) -> None:
        self.clear()

    def clear(self) -> None:
        self._sorted = np.zeros(0, np.int64)  # known rids, sorted
        self._sorted_slot = np.zeros(0, np.int64)
        self._rids: list[int] = []
        cap = 1024
        self.next = np.zeros(cap, np.int64)
        self.count = np.zeros(cap, np.int64)
        self.dups = np.zeros(cap, np.int64)
        self.first_t = np.zeros(cap)
        self.last_t = np.zeros(cap)
        self.final_len = np.full(cap, -1, np.int64)
        self.aside: dict[int, set[int]] = {}  # slot -> positions beyond the contiguous prefix
        self.out_of_order = 0
        self.corrupt = 0
        self.bad_messages = 0
        self.messages = 0
        self.tokens = 0
        self.sources: dict[int, list[int]] = {}  # source agent -> [tokens received, of which unique]

    def _grow(self, n: int) -> None:
        cap = len(self.next)
        if n <= cap:
            return
        new = max(n, 2 * cap)
        for name in ("next", "count", "dups", "first_t", "last_t"):
            a = getattr(self, name)
            b = np.zeros(new, a.dtype)
            b[:cap] = a
            setattr(self, name, b)
        f = np.full(new, -1, np.int64)
        f[:cap] = self.final_len
        self.final_len = f

    def slots(self, ids: np.ndarray) -> np.ndarray:
        """Slot of every id, registering unknown ids."""
        if len(self._sorted):
            idx = np.searchsorted(self._sorted, ids)
            idx_c = np.minimum(idx, len(self._sorted) - 1)
            known = self._sorted[idx_c] == ids
        else:
            known = np.zeros(len(ids), bool)
        if not known.all():
            new = np.unique(ids[~known])
            start = len(self._rids)
            self._rids.extend(int(x) for x in new)
            self._grow(len(self._rids))
            all_rids = np.asarray(self._rids, np.int64)
            order = np.argsort(all_rids, kind="stable")
            self._sorted, self._sorted_slot = all_rids[order], order.astype(np.int64)
            del start
        idx = np.searchsorted(self._sorted, ids)
        return self._sorted_slot[idx]

    def add(self, ids: np.ndarray, pos: np.ndarray, t: float, src: int | None = None) -> int:
        """Count the tokens (request ``ids[i]``, position ``pos[i]``) of one message from agent ``src``; how many
        were new (the rest are duplicates)."""
        if not len(ids):
            return 0
        slot = self.slots(ids)
        order = np.lexsort((pos, slot))
        slot, pos = slot[order], pos.astype(np.int64)[order]
        # rank of each token inside its slot's group
        start = np.r_[True, slot[1:] != slot[:-1]]
        grp_start = np.maximum.accumulate(np.where(start, np.arange(len(slot)), 0))
        rank = np.arange(len(slot)) - grp_start
        expect = self.next[slot] + rank
        ok = pos == expect
        # a group is fast-path only if every one of its tokens is in order
        bad_grp = np.zeros(len(slot), bool)
        if not ok.all():
            first_bad = np.where(~ok, rank, np.iinfo(np.int64).max)
            grp_ids = np.cumsum(start) - 1
            min_bad = np.full(grp_ids[-1] + 1, np.iinfo(np.int64).max)
            np.minimum.at(min_bad, grp_ids, first_bad)
            bad_grp = rank >= min_bad[grp_ids]  # tokens from the first out-of-order one on take the slow path
        good = ~bad_grp
        if good.any():
            s_good = slot[good]
            inc = np.bincount(s_good, minlength=len(self.next))[: len(self.next)]
            self.next[: len(inc)] += inc
            self.count[: len(inc)] += inc
            first_seen = self.first_t[s_good] == 0
            self.first_t[s_good[first_seen]] = t
            self.last_t[s_good] = t
        new = int(good.sum())
        for s, p in zip(slot[bad_grp].tolist(), pos[bad_grp].tolist()):
            new += self._slow(s, p, t)
        for s in set(slot[good].tolist()) & set(self.aside):
            self._absorb(s)
        self.tokens += len(ids)
        if src is not None:
            acc = self.sources.setdefault(int(src), [0, 0])
            acc[0] += len(ids)
            acc[1] += new
        return new

    def _slow(self, s: int, p: int, t: float) -> int:
        aside = self.aside.setdefault(s, set())
        if p < self.next[s] or p in aside:
            self.dups[s] += 1
            return 0
        if self.first_t[s] == 0:
            self.first_t[s] = t
        self.last_t[s] = t
        self.count[s] += 1
        if p == self.next[s]:
            self.next[s] += 1
            self._absorb(s)
        else:
            aside.add(p)
            self.out_of_order += 1
        if not aside:
            self.aside.pop(s, None)
        return 1

    def _absorb(self, s: int) -> None:
        aside = self.aside.get(s)
        while aside and self.next[s] in aside:
            aside.discard(int(self.next[s]))
            self.next[s] += 1
        if aside is not None and not aside:
            del self.aside[s]

    def finish(self, fin: np.ndarray, lengths: np.ndarray) -> None:
        if len(fin):
            sl = self.slots(fin)
            self.final_len[sl] = lengths

    def summary(self, with_arrays: bool = True) -> dict:
        n = len(self._rids)
        out = {"requests": n, "tokens_unique": int(self.count[:n].sum()), "tokens_received": int(self.tokens),
               "duplicates": int(self.dups[:n].sum()), "out_of_order": int(self.out_of_order),
               "held_aside": int(sum(len(v) for v in self.aside.values())), "corrupt": int(self.corrupt),
               "bad_messages": int(self.bad_messages), "messages": int(self.messages),
               "finished": int(np.count_nonzero(self.final_len[:n] >= 0)),
               # finished and every token of it in: a migrated request's last tokens can arrive before the
               # earlier ones its source sent (and a source that died may never send them)
               "complete": int(np.count_nonzero((self.final_len[:n] >= 0) & (self.next[:n] >= self.final_len[:n]))),
               "sources": [[src, r, u] for src, (r, u) in sorted(self.sources.items())]}
        if with_arrays:
            rids = np.asarray(self._rids, np.int64)
            out.update(rid=pack_array(rids), count=pack_array(self.count[:n]), contiguous=pack_array(self.next[:n]),
                       dups=pack_array(self.dups[:n]), first_t=pack_array(self.first_t[:n]),
                       last_t=pack_array(self.last_t[:n]), final_len=pack_array(self.final_len[:n]))
        return out


class Collector:
    """A ZeroMQ PULL socket on the fabric address and the thread that feeds a :class:`TokenLedger`."""

    def __init__(self, ctx, bind_ip: str, port: int, clock, vocab: int = 151_936):
        import zmq

        self.zmq = zmq
        self.sock = ctx.socket(zmq.PULL)
        self.sock.setsockopt(zmq.RCVHWM, 100_000)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(f"tcp://{bind_ip}:{port}")
        self.ledger = TokenLedger()
        self.lock = threading.Lock()
        self.clock = clock
        self.vocab = vocab
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="collector", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        zmq = self.zmq
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(100):
                continue
            while True:
                try:
                    raw = self.sock.recv(zmq.NOBLOCK)
                except zmq.Again:
                    break
                self.handle(raw)

    def handle(self, raw: bytes) -> None:
        t = self.clock()
        with self.lock:
            led = self.ledger
            led.messages += 1
            try:
                b = TokenBatch.decode(raw)
            except ProtocolError as e:
                led.bad_messages += 1
                log.warning("bad token message: %s", e)
                return
            try:
                bad = b.tok != token_ids(b.ids, b.pos, self.vocab)
                led.corrupt += int(bad.sum())
                led.add(b.ids, b.pos, t, b.src)
                if len(b.fin):  # a finished request's length is its last position + 1
                    fin_pos = {int(i): int(p) for i, p in zip(b.ids.tolist(), b.pos.tolist())}
                    lengths = np.asarray([fin_pos.get(int(r), -2) + 1 for r in b.fin.tolist()], np.int64)
                    led.finish(b.fin, lengths)
            except Exception:  # noqa: BLE001 - a message the schema let through must still not kill the thread
                led.bad_messages += 1
                log.exception("token message could not be counted")

    def stats(self, with_arrays: bool = True) -> dict:
        with self.lock:
            return self.ledger.summary(with_arrays)

    def reset(self) -> None:
        with self.lock:
            self.ledger.clear()

    def close(self) -> None:
        self._stop.set()
        self.thread.join(timeout=2.0)
        self.sock.close(0)
