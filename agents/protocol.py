"""Agent messages (pure): the agent's start-up config, its RPC requests and replies, and token-stream messages.

Wire format: msgpack maps (never pickle). Every message is validated at the boundary into a frozen
dataclass with :func:`emulation.validation.from_dict`, so an unknown field, a wrong type or an impossible
value is an error that names the field (``params.nbytes: must be >= 4, got 0``); the agent answers it with an
error reply and keeps serving.

RPC (management network, ZeroMQ ROUTER/DEALER): a request is ``{"v": 1, "id": <int>, "method": <name>,
"params": {...}}``; a reply ``{"v": 1, "id": <int>, "ok": true, "result": {...}}`` or ``{"v": 1, "id": <int>,
"ok": false, "error": "<field>: <message>", "field": "<field>"}``. Methods and their parameters are the
``*Params`` dataclasses in :data:`METHODS`.

Token stream (fabric, ZeroMQ PUSH -> PULL): :class:`TokenBatch`, one message per decode step (or per wake-up
of an agent's loop: the steps that ended together) and destination collector; request ids, positions and
token ids travel as little-endian numpy buffers.

Numpy arrays inside results travel as ``{"dtype": "<i8", "shape": [n], "data": <bytes>}`` (:func:`pack_array`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Optional

import msgpack
import numpy as np

from emulation.orchestration import MIGRATION_MODES, EngineSettings
from emulation.validation import SpecError, from_dict, require, to_dict

from .engine import Layout
from .realcompute import DecoderConfig

PROTOCOL_VERSION = 1
MAX_MESSAGE_BYTES = 64 * 2**20
MAX_TIMEOUT_S = 3600.0
MAX_NBYTES = 4 * 2**30
MAX_CHUNKS = 65535
ROLES = ("train", "gen")
ARRAY_DTYPES = ("<i8", "<i4", "<f8", "<f4", "|i1")


class ProtocolError(SpecError):
    """A message that does not follow the schema. ``request_id`` is the id when it could be read."""

    def __init__(self, field: str, message: str, request_id: int | None = None):
        super().__init__(field, message)
        self.request_id = request_id


def _finite_positive(v: float, name: str, upper: float | None = None) -> None:
    require(math.isfinite(v) and v > 0, name, f"must be a finite number > 0, got {v!r}")
    if upper is not None:
        require(v <= upper, name, f"must be <= {upper:g}, got {v}")


def _timeout(v: float) -> None:
    _finite_positive(v, "timeout_s", MAX_TIMEOUT_S)


def _nbytes(v: int, name: str = "nbytes", minimum: int = 4) -> None:
    require(minimum <= v <= MAX_NBYTES, name, f"must be in {minimum}..{MAX_NBYTES}, got {v}")


MAX_TAG = 2**20


def _tag(v: int) -> None:
    require(0 <= v < MAX_TAG, "tag", f"must be in 0..{MAX_TAG - 1}, got {v}")


def _transfer(peer_name: str, peer: int, nbytes: int, tag: int, timeout_s: float) -> None:
    """The checks of a point-to-point transfer's fields (P2PParams, KvIncomingParams)."""
    require(peer >= 0, peer_name, f"must be >= 0, got {peer}")
    _nbytes(nbytes, minimum=1)
    _tag(tag)
    _timeout(timeout_s)


# ---- start-up config ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Endpoint:
    host: str
    port: int

    def __post_init__(self) -> None:
        require(bool(self.host) and len(self.host) < 256, "host", f"must be an address, got {self.host!r}")
        require(1 <= self.port <= 65535, "port", f"must be a TCP port 1..65535, got {self.port}")

    @property
    def url(self) -> str:
        return f"tcp://{self.host}:{self.port}"


@dataclass(frozen=True)
class AgentConfig:
    """What an agent process is told at start (``--config FILE``, JSON)."""

    index: int  # agent number = its torch.distributed rank in the cluster's world
    server: int  # FabricSpec server index
    role: str  # train | gen
    gpus: int
    model: str
    gpu: str
    rpc: Endpoint  # where it listens (management network)
    fabric_ip: str  # its address on the emulated fabric
    fabric_intf: str  # its fabric interface (GLOO_SOCKET_IFNAME)
    layout: str = "TP1x8"
    engine: EngineSettings = field(default_factory=EngineSettings)
    time_dilation: float = 1.0
    scale: float = 0.001  # fabric byte scale: emulated bytes = modelled bytes x scale
    collector_port: Optional[int] = None  # a trainer agent hosting a token collector listens here (fabric)
    collectors: tuple[Endpoint, ...] = ()  # token destinations, by index (request.dest)
    real_compute: Optional[DecoderConfig] = None  # real-compute mode: this decoder times every decode step
    heartbeat_s: float = 0.5
    tick_s: float = 0.002  # the engine loop wakes at most this often (wall seconds): steps ending closer together
                           # are completed (and their tokens streamed) together, on schedule
                           # (agents.node.runner.EngineRunner.loop)
    # the agent lowers its CPU priority by this much: the emulated GPUs' compute is modelled and late wakes only
    # delay tokens (the fidelity monitor bounds that), while the driver's decisions (bench planner: a few ms)
    # and the datapath must not wait behind eight agents on two cores
    nice: int = 5
    # the process that started it (PID, and its start time in clock ticks since boot, /proc/PID/stat field 22):
    # when that process is gone (even killed by SIGKILL) the agent shuts itself down
    owner_pid: Optional[int] = None
    owner_start: Optional[int] = None

    def __post_init__(self) -> None:
        require(self.index >= 0, "index", f"must be >= 0, got {self.index}")
        require(self.server >= 0, "server", f"must be >= 0, got {self.server}")
        require(self.role in ROLES, "role", f"must be one of {', '.join(ROLES)}, got {self.role!r}")
        require(1 <= self.gpus <= 64, "gpus", f"must be in 1..64, got {self.gpus}")
        _finite_positive(self.time_dilation, "time_dilation", 1000.0)
        _finite_positive(self.scale, "scale", 1.0)
        _finite_positive(self.heartbeat_s, "heartbeat_s", 60.0)
        _finite_positive(self.tick_s, "tick_s", 1.0)
        require(isinstance(self.nice, int) and 0 <= self.nice <= 19, "nice", f"must be in 0..19, got {self.nice!r}")
        if self.collector_port is not None:
            require(1 <= self.collector_port <= 65535, "collector_port",
                    f"must be a TCP port 1..65535, got {self.collector_port}")
        require(bool(self.fabric_intf) and len(self.fabric_intf) <= 15, "fabric_intf",
                f"must be an interface name, got {self.fabric_intf!r}")
        Layout.parse(self.layout, self.gpus, "layout")


def load_agent_config(data: Any) -> AgentConfig:
    return from_dict(AgentConfig, data, "config")


# ---- RPC parameters --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class NoParams:
    pass


@dataclass(frozen=True)
class ResetParams:
    """``reset``: drop every request; ``engine``: the scheduler settings the fresh engine runs with (a run of
    another configuration on the same agents, e.g. the tuned baseline's max_num_seqs); None keeps the current
    ones. The cost model (and so ``switch_reinit_s``) stays the agent's."""

    engine: EngineSettings | None = None


@dataclass(frozen=True)
class DistInitParams:
    """(Re-)form the cluster's torch.distributed world (destroys the previous one). ``agents``: the members of
    the new world by agent index (rank = position in this list); the rendezvous (TCPStore) listens at
    ``master`` (the first member's management address). Every other message names peers by agent index."""

    agents: tuple[int, ...]
    master: Endpoint
    timeout_s: float = 60.0

    def __post_init__(self) -> None:
        require(len(self.agents) >= 1, "agents", "must name at least one agent")
        require(len(set(self.agents)) == len(self.agents), "agents", f"has duplicates: {list(self.agents)}")
        require(all(r >= 0 for r in self.agents), "agents", "agent indices must be >= 0")
        _timeout(self.timeout_s)


@dataclass(frozen=True)
class GroupParams:
    """Form a process group ``name`` of ``agents`` (only its members call it; re-forming a name replaces it)."""

    name: str
    agents: tuple[int, ...]
    timeout_s: float = 60.0

    def __post_init__(self) -> None:
        require(bool(self.name) and len(self.name) <= 64 and self.name.replace("-", "").replace("_", "").isalnum(),
                "name", f"must be 1-64 letters, digits, '-' or '_', got {self.name!r}")
        require(len(self.agents) >= 2, "agents", f"a group needs >= 2 agents, got {list(self.agents)}")
        require(len(set(self.agents)) == len(self.agents), "agents", f"has duplicates: {list(self.agents)}")
        _timeout(self.timeout_s)


@dataclass(frozen=True)
class CollectiveParams:
    """``all_reduce`` (``nbytes`` per rank) or ``all_to_all`` (``nbytes`` sent by each rank in total, split
    evenly over the ranks) over group ``group``, ``iters`` timed runs after one warm-up."""

    group: str
    nbytes: int
    iters: int = 1
    warmup: int = 1
    timeout_s: float = 120.0

    def __post_init__(self) -> None:
        _nbytes(self.nbytes)
        require(1 <= self.iters <= 1000, "iters", f"must be in 1..1000, got {self.iters}")
        require(0 <= self.warmup <= 10, "warmup", f"must be in 0..10, got {self.warmup}")
        _timeout(self.timeout_s)


@dataclass(frozen=True)
class BroadcastChild:
    """A child of a broadcast hop. ``sources``: the child's own sources with their shares when it has
    several (it then gets from this agent only the chunks dealt to it, chunk_owners); empty: every chunk."""

    agent: int
    sources: tuple[tuple[int, float], ...] = ()

    def __post_init__(self) -> None:
        require(self.agent >= 0, "agent", f"must be >= 0, got {self.agent}")
        for i, (r, share) in enumerate(self.sources):
            require(math.isfinite(share) and share > 0, f"sources[{i}]", f"share must be > 0, got {share}")


@dataclass(frozen=True)
class BroadcastParams:
    """This agent's part in a chunked, pipelined weight broadcast. ``sources``: (agent, share) of the agents
    that feed it (none: it holds the weights); the shares split the chunks among them. ``children``: agents it
    forwards every chunk to as soon as it has it. ``tag`` keeps concurrent broadcasts apart."""

    nbytes: int
    bucket_bytes: int
    tag: int
    sources: tuple[tuple[int, float], ...] = ()
    children: tuple[BroadcastChild, ...] = ()
    version: int = 0  # content seed: a root fills the buffer with data derived from it
    timeout_s: float = 120.0

    def __post_init__(self) -> None:
        _nbytes(self.nbytes)
        _nbytes(self.bucket_bytes, "bucket_bytes")
        _tag(self.tag)
        require(self.version >= 0, "version", f"must be >= 0, got {self.version}")
        for i, (r, share) in enumerate(self.sources):
            require(r >= 0, f"sources[{i}]", f"agent must be >= 0, got {r}")
            require(math.isfinite(share) and share > 0, f"sources[{i}]", f"share must be > 0, got {share}")
        require(len({r for r, _ in self.sources}) == len(self.sources), "sources", "has duplicate ranks")
        require(len({c.agent for c in self.children}) == len(self.children), "children", "has duplicates")
        require(-(-self.nbytes // self.bucket_bytes) <= MAX_CHUNKS, "bucket_bytes",
                f"{self.nbytes} bytes in buckets of {self.bucket_bytes} make more than {MAX_CHUNKS} chunks")
        _timeout(self.timeout_s)


@dataclass(frozen=True)
class P2PParams:
    """A point-to-point transfer of ``nbytes`` with agent ``peer`` (``send`` or ``recv``)."""

    peer: int
    nbytes: int
    tag: int = 0
    timeout_s: float = 60.0

    def __post_init__(self) -> None:
        _transfer("peer", self.peer, self.nbytes, self.tag, self.timeout_s)


@dataclass(frozen=True)
class RequestSpec:
    rid: int
    prompt: int
    target: int
    dest: int = 0
    generated: int = 0

    def __post_init__(self) -> None:
        require(0 <= self.rid < 2**62, "rid", f"must be in 0..2^62, got {self.rid}")
        require(1 <= self.prompt <= 10**7, "prompt", f"must be in 1..10^7, got {self.prompt}")
        require(1 <= self.target <= 10**7, "target", f"must be in 1..10^7, got {self.target}")
        require(self.dest >= 0, "dest", f"must be >= 0, got {self.dest}")
        require(0 <= self.generated < self.target, "generated",
                f"must be in 0..target-1 ({self.target - 1}), got {self.generated}")


@dataclass(frozen=True)
class SubmitParams:
    requests: tuple[RequestSpec, ...]
    replica: Optional[int] = None
    chunked: bool = False  # equal consecutive chunks per replica (veRL's dispatch), else least loaded each

    def __post_init__(self) -> None:
        require(len(self.requests) <= 1_000_000, "requests", "at most 1,000,000 per call")
        require(len({r.rid for r in self.requests}) == len(self.requests), "requests", "has duplicate rids")
        if self.replica is not None:
            require(self.replica >= 0, "replica", f"must be >= 0, got {self.replica}")


@dataclass(frozen=True)
class StatsParams:
    snapshot: bool = False  # also every request's progress (ids, generated, replica, running)


@dataclass(frozen=True)
class CollectorStatsParams:
    arrays: bool = True  # per-request arrays too (else the counts alone: cheap enough to poll)


@dataclass(frozen=True)
class FidelityParams:
    clear: bool = False  # start a fresh record after this report


@dataclass(frozen=True)
class LayoutParams:
    layout: str
    free: bool = False  # no switch cost: the server starts a run (or a step) in it, its weights loaded that way


@dataclass(frozen=True)
class MigrateParams:
    """Move request ``rid`` to agent ``dst`` (whose RPC endpoint is ``dst_rpc``), its KV cache over the fabric.

    ``multi_stage`` (Llumnix): copy the KV while the request keeps decoding here, then the increment, until an
    increment is at most ``stop_bytes`` or ``max_stages`` copies were made; then stop it, copy the last
    increment and hand it over (the downtime is only this last stage). ``stop_copy``: stop, copy all, hand over."""

    rid: int
    dst: int
    dst_rpc: Endpoint
    dst_replica: Optional[int] = None  # None: the destination engine picks its least loaded replica
    mode: str = "multi_stage"
    max_stages: int = 4
    stop_bytes: int = 256 * 1024  # multi-stage: stop-and-copy once the increment is this small (emulated bytes)
    timeout_s: float = 30.0

    def __post_init__(self) -> None:
        require(self.mode in MIGRATION_MODES, "mode", f"must be one of {', '.join(MIGRATION_MODES)}, got {self.mode!r}")
        require(1 <= self.max_stages <= 32, "max_stages", f"must be in 1..32, got {self.max_stages}")
        require(self.stop_bytes >= 0, "stop_bytes", f"must be >= 0, got {self.stop_bytes}")
        require(self.dst >= 0, "dst", f"must be >= 0, got {self.dst}")
        _timeout(self.timeout_s)


@dataclass(frozen=True)
class KvIncomingParams:
    """Agent to agent (migration): post a receive of ``nbytes`` of KV from agent ``src``."""

    rid: int
    src: int
    nbytes: int
    tag: int
    timeout_s: float = 30.0

    def __post_init__(self) -> None:
        _transfer("src", self.src, self.nbytes, self.tag, self.timeout_s)


@dataclass(frozen=True)
class KvWaitParams:
    """Agent to agent (migration): answer once the announced KV transfers ``tags`` have all arrived."""

    tags: tuple[int, ...]
    timeout_s: float = 30.0

    def __post_init__(self) -> None:
        require(len(self.tags) >= 1, "tags", "must name at least one transfer")
        _timeout(self.timeout_s)


@dataclass(frozen=True)
class MigrateCommitParams:
    """Agent to agent (migration): the request's state at the stop; the receiver resumes it."""

    request: RequestSpec
    kv_tokens: int
    preemptions: int = 0
    replica: Optional[int] = None
    tags: tuple[int, ...] = ()  # the KV transfers that must have arrived first

    def __post_init__(self) -> None:
        require(self.kv_tokens >= 0, "kv_tokens", f"must be >= 0, got {self.kv_tokens}")


@dataclass(frozen=True)
class ComputeParams:
    """Model GPU compute on this agent for ``seconds`` of real GPU time (slept for seconds x TDF)."""

    seconds: float

    def __post_init__(self) -> None:
        require(math.isfinite(self.seconds) and 0 <= self.seconds <= MAX_TIMEOUT_S, "seconds",
                f"must be in 0..{MAX_TIMEOUT_S:g}, got {self.seconds}")


@dataclass(frozen=True)
class PeerDownParams:
    """The driver tells an agent that agent ``agent`` failed: a migration to or from it gives up at once."""

    agent: int

    def __post_init__(self) -> None:
        require(self.agent >= 0, "agent", f"must be >= 0, got {self.agent}")


METHODS: dict[str, type] = {
    "ping": NoParams,
    "dist_init": DistInitParams,
    "form_group": GroupParams,
    "all_reduce": CollectiveParams,
    "all_to_all": CollectiveParams,
    "broadcast": BroadcastParams,
    "send": P2PParams,
    "recv": P2PParams,
    "submit": SubmitParams,
    "stats": StatsParams,
    "set_layout": LayoutParams,
    "migrate": MigrateParams,
    "kv_incoming": KvIncomingParams,
    "kv_wait": KvWaitParams,
    "migrate_commit": MigrateCommitParams,
    "reset": ResetParams,
    "collector_stats": CollectorStatsParams,
    "collector_reset": NoParams,
    "fidelity": FidelityParams,
    "compute": ComputeParams,
    "peer_down": PeerDownParams,
    "shutdown": NoParams,
}


@dataclass(frozen=True)
class Request:
    id: int
    method: str
    params: Any


# ---- encoding --------------------------------------------------------------------------------------------
def _unpack(raw: bytes) -> Any:
    if not isinstance(raw, (bytes, bytearray, memoryview)):
        raise ProtocolError("message", f"must be bytes, got {type(raw).__name__}")
    if len(raw) > MAX_MESSAGE_BYTES:
        raise ProtocolError("message", f"{len(raw)} bytes is larger than the limit of {MAX_MESSAGE_BYTES}")
    try:
        # strict_map_key: map keys must be str/bytes; bounded nesting is msgpack's default (no recursion bomb)
        return msgpack.unpackb(raw, raw=False, strict_map_key=True)
    except (ValueError, TypeError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError,
            msgpack.exceptions.OutOfData) as e:
        raise ProtocolError("message", f"not a msgpack message: {type(e).__name__}: {e}") from None


def pack(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def encode_request(request_id: int, method: str, params: Any = None) -> bytes:
    if method not in METHODS:
        raise ProtocolError("method", f"unknown method {method!r}")
    body = params if isinstance(params, dict) else (to_dict(params) if params is not None else {})
    return pack({"v": PROTOCOL_VERSION, "id": int(request_id), "method": method, "params": body})


def decode_request(raw: bytes) -> Request:
    """Validate a request; ProtocolError names the field (``params.nbytes``) and carries the id if known."""
    msg = _unpack(raw)
    if not isinstance(msg, dict):
        raise ProtocolError("message", f"must be a map, got {type(msg).__name__}")
    rid = msg.get("id")
    rid = rid if isinstance(rid, int) and not isinstance(rid, bool) else None
    unknown = sorted(set(map(str, msg)) - {"v", "id", "method", "params"})
    if unknown:
        raise ProtocolError(unknown[0], "unknown field (known: id, method, params, v)", rid)
    if msg.get("v") != PROTOCOL_VERSION:
        raise ProtocolError("v", f"must be {PROTOCOL_VERSION}, got {msg.get('v')!r}", rid)
    if rid is None:
        raise ProtocolError("id", f"must be an integer, got {msg.get('id')!r}")
    method = msg.get("method")
    if not isinstance(method, str) or method not in METHODS:
        raise ProtocolError("method", f"unknown method {method!r} (known: {', '.join(sorted(METHODS))})", rid)
    try:
        params = from_dict(METHODS[method], msg.get("params", {}), "params")
    except SpecError as e:
        raise ProtocolError(e.field if e.field.startswith("params") else f"params.{e.field}", e.message, rid) from None
    return Request(rid, method, params)


def encode_ok(request_id: int | None, result: Any) -> bytes:
    return pack({"v": PROTOCOL_VERSION, "id": request_id, "ok": True, "result": result})


def encode_error(request_id: int | None, error: str, field_name: str | None) -> bytes:
    return pack({"v": PROTOCOL_VERSION, "id": request_id, "ok": False, "error": error, "field": field_name})


@dataclass(frozen=True)
class Reply:
    id: Optional[int]
    ok: bool
    result: Any = None
    error: Optional[str] = None
    field: Optional[str] = None


def decode_reply(raw: bytes) -> Reply:
    msg = _unpack(raw)
    if not isinstance(msg, dict):
        raise ProtocolError("reply", f"must be a map, got {type(msg).__name__}")
    if msg.get("v") != PROTOCOL_VERSION:
        raise ProtocolError("reply.v", f"must be {PROTOCOL_VERSION}, got {msg.get('v')!r}")
    ok = msg.get("ok")
    if not isinstance(ok, bool):
        raise ProtocolError("reply.ok", f"must be true or false, got {ok!r}")
    rid = msg.get("id")
    if rid is not None and (not isinstance(rid, int) or isinstance(rid, bool)):
        raise ProtocolError("reply.id", f"must be an integer or null, got {rid!r}")
    if ok:
        return Reply(rid, True, msg.get("result"))
    err, fld = msg.get("error"), msg.get("field")
    if not isinstance(err, str):
        raise ProtocolError("reply.error", f"must be a string, got {err!r}")
    return Reply(rid, False, None, err, fld if isinstance(fld, str) else None)


# ---- arrays -------------------------------------------------------------------------------------------
def pack_array(a: np.ndarray) -> dict:
    a = np.ascontiguousarray(a)
    dt = a.dtype.newbyteorder("<") if a.dtype.byteorder == ">" else a.dtype
    return {"dtype": dt.str, "shape": list(a.shape), "data": a.astype(dt, copy=False).tobytes()}


def unpack_array(obj: Any, name: str = "array") -> np.ndarray:
    if not isinstance(obj, dict) or set(obj) != {"dtype", "shape", "data"}:
        raise ProtocolError(name, "must be {dtype, shape, data}")
    dt, shape, data = obj["dtype"], obj["shape"], obj["data"]
    if dt not in ARRAY_DTYPES:
        raise ProtocolError(f"{name}.dtype", f"must be one of {', '.join(ARRAY_DTYPES)}, got {dt!r}")
    if not (isinstance(shape, list) and len(shape) <= 2 and all(isinstance(x, int) and x >= 0 for x in shape)):
        raise ProtocolError(f"{name}.shape", f"must be a list of at most 2 sizes >= 0, got {shape!r}")
    if not isinstance(data, (bytes, bytearray)):
        raise ProtocolError(f"{name}.data", "must be bytes")
    n = int(np.prod(shape)) if shape else 1
    if n * np.dtype(dt).itemsize != len(data):
        raise ProtocolError(f"{name}.data", f"{len(data)} bytes do not hold shape {shape} of {dt}")
    return np.frombuffer(data, dtype=np.dtype(dt)).reshape(shape)


# ---- token stream -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class TokenBatch:
    """Tokens one agent produced in one decode step (or several steps that ended together) for one collector:
    the i-th token belongs to request ``ids[i]`` at position ``pos[i]`` with token id ``tok[i]``; ``fin``:
    requests whose last token is in this batch."""

    src: int
    seq: int
    t: float
    ids: np.ndarray
    pos: np.ndarray
    tok: np.ndarray
    fin: np.ndarray

    def encode(self) -> bytes:
        return pack({"v": PROTOCOL_VERSION, "src": self.src, "seq": self.seq, "t": self.t,
                     "ids": self.ids.astype("<i8").tobytes(), "pos": self.pos.astype("<i4").tobytes(),
                     "tok": self.tok.astype("<i4").tobytes(), "fin": self.fin.astype("<i8").tobytes()})

    @classmethod
    def decode(cls, raw: bytes) -> "TokenBatch":
        msg = _unpack(raw)
        if not isinstance(msg, dict) or set(msg) != {"v", "src", "seq", "t", "ids", "pos", "tok", "fin"}:
            raise ProtocolError("tokens", "must be a map with v, src, seq, t, ids, pos, tok, fin")
        if msg["v"] != PROTOCOL_VERSION:
            raise ProtocolError("tokens.v", f"must be {PROTOCOL_VERSION}, got {msg['v']!r}")
        for k in ("src", "seq"):
            if not isinstance(msg[k], int) or isinstance(msg[k], bool) or msg[k] < 0:
                raise ProtocolError(f"tokens.{k}", f"must be an integer >= 0, got {msg[k]!r}")
        if not isinstance(msg["t"], float) or not math.isfinite(msg["t"]):
            raise ProtocolError("tokens.t", f"must be a finite float, got {msg['t']!r}")
        arrs = {}
        for k, dt in (("ids", "<i8"), ("pos", "<i4"), ("tok", "<i4"), ("fin", "<i8")):
            b = msg[k]
            if not isinstance(b, bytes) or len(b) % np.dtype(dt).itemsize:
                raise ProtocolError(f"tokens.{k}", f"must be bytes of {dt} values")
            arrs[k] = np.frombuffer(b, dtype=dt)
        if not len(arrs["ids"]) == len(arrs["pos"]) == len(arrs["tok"]):
            raise ProtocolError("tokens", "ids, pos and tok must have the same length")
        if len(arrs["pos"]) and arrs["pos"].min() < 0:
            raise ProtocolError("tokens.pos", "positions must be >= 0")
        return cls(msg["src"], msg["seq"], msg["t"], arrs["ids"], arrs["pos"], arrs["tok"], arrs["fin"])


def token_ids(ids: np.ndarray, pos: np.ndarray, vocab: int = 151_936) -> np.ndarray:
    """The (synthetic) token id at each (request, position): deterministic, so a collector can check it."""
    h = (ids.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15)) ^ (pos.astype(np.uint64) * np.uint64(0xBF58476D1CE4E5B9))
    return (h % np.uint64(vocab)).astype(np.int32)
