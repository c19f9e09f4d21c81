"""torch.distributed inside an agent: the cluster's world, process groups, collectives, the pipelined weight
broadcast and point-to-point transfers. Gloo on CPU (this machine), NCCL when CUDA is present: one code path.

Peers are named by *agent index* everywhere outside this module; :class:`Comm` maps them to world ranks.
Every operation has a timeout (the process group's, and ``Work.wait(timeout)`` for point-to-point), so a dead
peer is an error reply, never a hang. Tensors are filled with data the receivers can check (a correctness
value for all-reduce, a per-chunk pattern for all-to-all, a CRC32 of the broadcast buffer).
"""
from __future__ import annotations

import datetime
import logging
import threading
import time
import zlib

import torch
import torch.distributed as dist

from agents.protocol import BroadcastParams, CollectiveParams, DistInitParams, GroupParams, P2PParams

log = logging.getLogger(__name__)

P2P_TAG_BASE = 1 << 30  # point-to-point (migration) tags live above the broadcast tags
BCAST_CHUNK_BITS = 16
A2A_TAG_BASE = P2P_TAG_BASE + (1 << 21)  # the all-to-all's point-to-point tags, above the migrations'


class CommError(RuntimeError):
    """A collective failed (timeout, dead peer, not initialised): the message says which and why."""


def _td(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=float(seconds))


def exchange(out: torch.Tensor, inp: torch.Tensor, per: int, me: int, ranks: list[int], group) -> None:
    """One all-to-all: ``inp``'s chunk j (``per`` floats) to rank ``ranks[j]``, its chunk for this rank into
    ``out``'s chunk j, every pair at once (the concurrent exchange NCCL's and RLSim's all-to-all is), each
    direction of a pair on its own TCP connection: data from the lower to the higher rank on ``group``'s
    connection, the other way on the world's.

    Not ``all_to_all_single`` over one group: Gloo's unbound-buffer protocol holds a send until the receiver's
    recv-ready notice arrives, and that notice travels on the same connection as the receiver's own bulk data
    to the sender. Behind megabytes of it, one direction of a pair waited for the other to drain: on moe-small's
    EP group the circuits' two directions took turns (one idle for 1.5 s mid-transfer) and the exchange took
    1.15-1.76x RLSim's time; split, 1.06-1.15x (docs/emulation.md "Known limits"). On the world group itself
    (``group`` None) both directions share its connections."""
    out[me * per:(me + 1) * per].copy_(inp[me * per:(me + 1) * per])
    works = []
    for j, r in enumerate(ranks):
        if j == me:
            continue
        gs, gr = (group if me < j else None), (group if j < me else None)  # the send's / the receive's connection
        works.append(dist.irecv(out[j * per:(j + 1) * per], src=r, group=gr, tag=A2A_TAG_BASE))
        works.append(dist.isend(inp[j * per:(j + 1) * per], dst=r, group=gs, tag=A2A_TAG_BASE))
    for w in works:
        w.wait()


def _my_chunks(agent: int, child, nchunks: int) -> set[int] | None:
    """The chunks ``agent`` sends broadcast child ``child``: all (None), or its share of a striped head's."""
    if len(child.sources) <= 1:
        return None
    srcs = [a for a, _ in child.sources]
    if agent not in srcs:
        raise CommError(f"broadcast: agent {agent} is not among child {child.agent}'s sources")
    own = chunk_owners(nchunks, [sh for _, sh in child.sources])
    return {i for i, o in enumerate(own) if o == srcs.index(agent)}


class Comm:
    def __init__(self, agent: int):
        self.agent = agent
        self.backend = "nccl" if torch.cuda.is_available() else "gloo"
        self.device = torch.device("cuda", 0) if self.backend == "nccl" else torch.device("cpu")
        self.rank_of: dict[int, int] = {}
        self.groups: dict[str, tuple[object, tuple[int, ...]]] = {}
        self.generation = 0
        self.lock = threading.Lock()  # world (re)creation vs. operations
        # agents the driver said failed: a transfer with one is refused at once. (A transfer under way with a
        # peer that dies errors by itself: Gloo sees the connection close. Its waits cannot be sliced to poll
        # for news instead: a Gloo wait that times out closes the connection.)
        self.dead: set[int] = set()
        self._root_buf: torch.Tensor | None = None  # the weights this agent broadcasts as a root (_weights)

    # ---- world and groups ----
    @property
    def initialised(self) -> bool:
        return dist.is_available() and dist.is_initialized()

    def init_world(self, p: DistInitParams) -> dict:
        with self.lock:
            if self.initialised:
                self.groups.clear()
                try:
                    dist.destroy_process_group()
                except Exception as e:  # noqa: BLE001 - a broken old world must not stop a new one
                    log.warning("destroying the old world: %s", e)
            self.rank_of = {}
            if self.agent not in p.agents:
                return {"member": False, "world_size": len(p.agents)}
            rank = p.agents.index(self.agent)
            t0 = time.monotonic()
            store = dist.TCPStore(p.master.host, p.master.port, world_size=len(p.agents), is_master=rank == 0,
                                  timeout=_td(p.timeout_s), wait_for_workers=True, multi_tenant=False)
            dist.init_process_group(self.backend, store=store, rank=rank, world_size=len(p.agents),
                                    timeout=_td(p.timeout_s))
            self.rank_of = {a: i for i, a in enumerate(p.agents)}
            self.generation += 1
            return {"member": True, "rank": rank, "world_size": len(p.agents), "backend": self.backend,
                    "init_s": time.monotonic() - t0}

    def _rank(self, agent: int, what: str) -> int:
        if agent not in self.rank_of:
            raise CommError(f"{what}: agent {agent} is not in the current world {sorted(self.rank_of)}")
        return self.rank_of[agent]

    def form_group(self, p: GroupParams) -> dict:
        if not self.initialised:
            raise CommError("form_group: no world yet (dist_init first)")
        if self.agent not in p.agents:
            raise CommError(f"form_group: agent {self.agent} is not a member of {list(p.agents)}")
        ranks = sorted(self._rank(a, "form_group") for a in p.agents)
        t0 = time.monotonic()
        g = dist.new_group(ranks=ranks, timeout=_td(p.timeout_s), use_local_synchronization=True)
        self.groups[p.name] = (g, tuple(p.agents))
        return {"group": p.name, "size": len(ranks), "form_s": time.monotonic() - t0}

    def _group(self, name: str):
        if name == "world":
            if not self.initialised:
                raise CommError("no world yet (dist_init first)")
            return None, tuple(self.rank_of)
        if name not in self.groups:
            raise CommError(f"unknown group {name!r} (known: world, {', '.join(sorted(self.groups)) or '-'})")
        return self.groups[name]

    # ---- collectives ----
    def _timed(self, fn, group, p: CollectiveParams) -> list[float]:
        for _ in range(p.warmup):
            fn()
        times = []
        for _ in range(p.iters):
            dist.barrier(group=group)
            t0 = time.perf_counter()
            fn()
            if self.device.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        return times

    def all_reduce(self, p: CollectiveParams) -> dict:
        group, members = self._group(p.group)
        me = members.index(self.agent) if self.agent in members else None
        if me is None:
            raise CommError(f"all_reduce: agent {self.agent} is not in group {p.group}")
        n = max(1, p.nbytes // 4)
        t = torch.empty(n, dtype=torch.float32, device=self.device)
        value = float(me + 1)

        def once() -> None:
            t.fill_(value)
            dist.all_reduce(t, group=group)

        start = time.monotonic()
        times = self._timed(once, group, p)
        want = len(members) * (len(members) + 1) / 2.0
        got = float(t[0].item()), float(t[-1].item())
        return {"op": "all_reduce", "group": p.group, "ranks": len(members), "bytes": n * 4, "times_s": times,
                "start_mono": start, "end_mono": time.monotonic(), "backend": self.backend,
                "correct": got == (want, want), "value": got[0], "expected": want}

    def all_to_all(self, p: CollectiveParams) -> dict:
        """Every member sends ``nbytes / k`` to every other member at once (:func:`exchange`), every chunk checked."""
        group, members = self._group(p.group)
        if self.agent not in members:
            raise CommError(f"all_to_all: agent {self.agent} is not in group {p.group}")
        k = len(members)
        me = members.index(self.agent)
        per = max(1, p.nbytes // 4 // k)
        inp = torch.empty(per * k, dtype=torch.float32, device=self.device)
        for j in range(k):  # the chunk for peer j carries (me, j)
            inp[j * per:(j + 1) * per] = float(me * 1000 + j)
        out = torch.empty_like(inp)

        ranks = [self._rank(a, "all_to_all") for a in members]
        start = time.monotonic()
        times = self._timed(lambda: exchange(out, inp, per, me, ranks, group), group, p)
        ok = all(float(out[j * per].item()) == float(j * 1000 + me) and float(out[(j + 1) * per - 1].item())
                 == float(j * 1000 + me) for j in range(k))
        return {"op": "all_to_all", "group": p.group, "ranks": k, "bytes": per * k * 4, "times_s": times,
                "start_mono": start, "end_mono": time.monotonic(), "backend": self.backend, "correct": ok}

    # ---- pipelined broadcast ----
    def _weights(self, n: int) -> torch.Tensor:
        """The root's weights buffer of ``n`` floats, kept from one sync to the next (a trainer's weights exist
        before the sync: filling 24-28 MB afresh took the root tens of ms after the driver's call)."""
        if self._root_buf is None or self._root_buf.numel() != n:
            self._root_buf = torch.arange(n, dtype=torch.float32, device=self.device)
        return self._root_buf

    def broadcast(self, p: BroadcastParams) -> dict:
        """Receive each chunk from its source (the sources split the chunks by share), forward it to every
        child as soon as it is in, so a chain of depth d takes ~(bytes + d x bucket) / rate."""
        if not self.initialised:
            raise CommError("broadcast: no world yet (dist_init first)")
        n = max(1, p.nbytes // 4)
        per = max(1, p.bucket_bytes // 4)
        nchunks = -(-n // per)
        src_ranks = [(self._rank(a, "broadcast source"), share) for a, share in p.sources]
        owner = chunk_owners(nchunks, [s for _, s in src_ranks]) if src_ranks else []
        children = [(self._rank(c.agent, "broadcast child"), _my_chunks(self.agent, c, nchunks)) for c in p.children]
        base = (p.tag % (1 << (30 - BCAST_CHUNK_BITS))) << BCAST_CHUNK_BITS
        if not src_ranks:  # the root: weights of version ``version`` (deterministic), ready before the clock
            buf = self._weights(n)
            buf[::per] = float(p.version % 1000)  # every chunk carries the version: a stale chunk changes the CRC
        else:
            buf = torch.empty(n, dtype=torch.float32, device=self.device)
        # the CRC32 of the buffer, the ranks' check that every byte arrived: on the CPU taken chunk by chunk while
        # the next one is on the wire. Taken whole after the last chunk it kept eight agents on two cores busy for
        # 0.1-0.2 s after moe-small's 24 MB sync (a copy and a CRC each), time the phase paid and the network did not
        on_cpu = buf.device.type == "cpu"
        crc = 0
        t0 = time.monotonic()
        recvs = []
        if src_ranks:
            for c in range(nchunks):
                view = buf[c * per:min(n, (c + 1) * per)]
                recvs.append(dist.irecv(view, src=src_ranks[owner[c]][0], tag=base + c))
        # A peer that dies errors the transfers with it (Gloo sees its connection close), but a live peer waiting
        # on this agent would wait out its timeout (a Gloo wait cannot be given up): so every transfer with a
        # live peer is completed even then (chunks that could not be received go on as zeros, which the CRC
        # shows), and the error is raised only at the end. The driver runs the broadcast again without the dead.
        problems: list[str] = []
        no_source = False
        broken: set[int] = set()
        sends = []
        first_in = None
        for c in range(nchunks):
            view = buf[c * per:min(n, (c + 1) * per)]
            if recvs:
                if no_source:
                    view.zero_()
                else:
                    try:
                        _wait(recvs[c], p.timeout_s, f"broadcast: chunk {c}")
                    except CommError as e:
                        problems.append(str(e))
                        no_source = True
                        view.zero_()
                if first_in is None:
                    first_in = time.monotonic()
            for r, mine in children:
                if r not in broken and (mine is None or c in mine):
                    try:
                        sends.append((r, dist.isend(view, dst=r, tag=base + c)))
                    except RuntimeError as e:
                        broken.add(r)
                        problems.append(f"broadcast: a send to rank {r}: {e}")
            if on_cpu:
                crc = zlib.crc32(view.numpy(), crc)
        for r, w in sends:
            if r in broken:
                continue
            try:
                _wait(w, p.timeout_s, "broadcast: a send")
            except CommError as e:
                broken.add(r)
                problems.append(str(e))
        if problems:
            raise CommError(f"broadcast incomplete ({len(problems)} transfer(s) failed): {problems[0]}")
        end = time.monotonic()
        if not on_cpu:
            crc = zlib.crc32(buf.cpu().numpy())
        return {"op": "broadcast", "bytes": n * 4, "chunks": nchunks, "bucket_bytes": per * 4,
                "sources": [a for a, _ in p.sources], "children": [c.agent for c in p.children], "start_mono": t0,
                "first_chunk_mono": first_in, "end_mono": end, "crc32": crc, "backend": self.backend}

    # ---- point to point ----
    def p2p(self, p: P2PParams, send: bool) -> dict:
        if not self.initialised:
            raise CommError("p2p: no world yet (dist_init first)")
        r = self._rank(p.peer, "p2p peer")
        n = max(1, -(-p.nbytes // 4))
        t = torch.empty(n, dtype=torch.float32, device=self.device)
        if send:
            t.fill_(float(self.agent + 1))
        t0 = time.monotonic()
        if p.peer in self.dead:
            raise CommError(f"agent {p.peer} failed")
        w = (dist.isend if send else dist.irecv)(t, r, tag=P2P_TAG_BASE + p.tag)
        _wait(w, p.timeout_s, f"{'send to' if send else 'receive from'} agent {p.peer}")
        out = {"bytes": n * 4, "start_mono": t0, "end_mono": time.monotonic()}
        if not send:
            out["value"] = float(t[0].item())
            out["correct"] = float(t[0].item()) == float(p.peer + 1) == float(t[-1].item())
        return out

    def close(self) -> None:
        with self.lock:
            self.groups.clear()
            if self.initialised:
                try:
                    dist.destroy_process_group()
                except Exception as e:  # noqa: BLE001
                    log.warning("destroy_process_group: %s", e)


def _wait(work, timeout_s: float, what: str) -> None:
    """Wait for a point-to-point Work with a deadline; a timeout or a dead peer is a CommError."""
    try:
        ok = work.wait(timeout=_td(timeout_s))
    except RuntimeError as e:
        raise CommError(f"{what} failed within {timeout_s} s: {e}") from None
    if ok is False:
        raise CommError(f"{what} did not complete within {timeout_s} s")


def chunk_owners(nchunks: int, shares: list[float]) -> list[int]:
    """Which source sends each chunk: chunks dealt in proportion to ``shares``, interleaved (smooth weighted
    round robin), so every source streams at once."""
    total = float(sum(shares))
    credit = [0.0] * len(shares)
    out = []
    for _ in range(nchunks):
        for i, s in enumerate(shares):
            credit[i] += s / total
        k = max(range(len(shares)), key=lambda i: (credit[i], -i))
        credit[k] -= 1.0
        out.append(k)
    return out
