"""Real UDP probe traffic to measure blackouts (runs inside Mininet hosts through EmulatedFabric.popen).

    python -m emulation.probe recv --port P --duration S --out FILE [--ready-file F]
    python -m emulation.probe send --dst IP --port P --pps N --duration S --out FILE [--size B]
    python -m emulation.probe analyze --send FILE --recv FILE

Each datagram carries a sequence number and its send time (CLOCK_MONOTONIC, shared by every namespace
of the machine). A blackout is measured by the run of lost sequence numbers and the *sender's* clock:
on a busy 2-core machine arrival times come in bursts, so arrival gaps overstate it (PLATFORM.md).

Output files are JSON: ``{"role": "send", ..., "records": [[seq, t_send], ...]}`` and
``{"role": "recv", ..., "records": [[seq, t_arrival], ...]}``. Times are ``time.monotonic()`` seconds.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import socket
import struct
import sys
import time
from dataclasses import asdict, dataclass
from typing import Iterable, Sequence

from emulation.files import write_json_atomic
from emulation.validation import SpecError, positive

HEADER = struct.Struct("!Qd")  # seq, send time
MAGIC = b"ORLP"
MIN_SIZE = HEADER.size + len(MAGIC)
SPIN_S = 0.0015  # busy-wait the last part before each deadline (sleep is too coarse at 5-10k pps)


@dataclass(frozen=True)
class Gap:
    first_lost: int  # first lost sequence number
    last_lost: int  # last lost sequence number
    lost: int  # number of lost packets in the run
    duration_s: float  # send time of first packet received after - send time of last received before
    truncated: bool = False  # the run touches the start or the end of the stream (one bound unknown)


def _send_times(sent: Iterable[Sequence[float]]) -> dict[int, float]:
    return {int(r[0]): float(r[1]) for r in sent}


def gaps(sent: Iterable[Sequence[float]], received_seqs: Iterable[int]) -> list[Gap]:
    """Runs of lost sequence numbers, each with its duration on the sender's clock.

    ``sent``: (seq, send_time) records; ``received_seqs``: sequence numbers that arrived (any order,
    duplicates allowed; numbers that were never sent are ignored). A run with received packets on both
    sides lasts ``send_time(first received after) - send_time(last received before)``; a run at the start
    (end) of the stream is measured from its first lost packet (to its last lost packet) and marked
    ``truncated``.
    """
    times = _send_times(sent)
    seqs = sorted(times)
    got = set(int(s) for s in received_seqs)
    out: list[Gap] = []
    i, n = 0, len(seqs)
    while i < n:
        if seqs[i] in got:
            i += 1
            continue
        j = i
        while j + 1 < n and seqs[j + 1] not in got:
            j += 1
        first, last = seqs[i], seqs[j]
        before = seqs[i - 1] if i > 0 else None
        after = seqs[j + 1] if j + 1 < n else None
        start = times[before] if before is not None else times[first]
        end = times[after] if after is not None else times[last]
        out.append(Gap(first, last, j - i + 1, end - start, truncated=before is None or after is None))
        i = j + 1
    return out


def lost_count(sent: Iterable[Sequence[float]], received_seqs: Iterable[int]) -> int:
    seqs = {int(r[0]) for r in sent}
    return len(seqs - {int(s) for s in received_seqs})


def summarize(send_doc: dict, recv_doc: dict) -> dict:
    sent = send_doc["records"]
    received = [int(r[0]) for r in recv_doc["records"]]
    g = gaps(sent, received)
    inner = [x for x in g if not x.truncated]
    return {"sent": len(sent), "received": len(set(received) & {int(r[0]) for r in sent}),
            "lost": lost_count(sent, received), "gaps": [asdict(x) for x in g],
            "max_gap_s": max((x.duration_s for x in inner), default=0.0),
            "pps_target": send_doc.get("pps"),
            "pps_achieved": (len(sent) - 1) / (sent[-1][1] - sent[0][1]) if len(sent) > 1 and sent[-1][1] > sent[0][1]
            else None}


# ---- sender / receiver ---------------------------------------------------------------------------
def _tight_timer_slack() -> None:
    """Ask the kernel for 1 us timer slack (default 50 us) so short sleeps wake on time; best effort."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(29, 1000, 0, 0, 0)  # PR_SET_TIMERSLACK
    except (OSError, AttributeError):
        pass


def send(dst: str, port: int, pps: float, duration_s: float, size: int = 64) -> dict:
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    pad = MAGIC + b"\0" * (size - MIN_SIZE)
    interval = 1.0 / pps
    total = int(math.floor(pps * duration_s))
    records: list[list[float]] = []
    errors = 0
    wall = time.time()
    _tight_timer_slack()
    # spin only the last part of each interval: at thousands of packets/s a full busy-wait would take a whole
    # core, starving Open vSwitch and the controller on a 2-core machine (the send *times* are recorded, so
    # pacing jitter does not bias the measurement)
    spin = min(SPIN_S, interval / 4)
    t0 = time.monotonic() + 0.001
    mono = time.monotonic
    for seq in range(total):
        deadline = t0 + seq * interval
        now = mono()
        if deadline - now > spin:
            time.sleep(deadline - now - spin)
        while mono() < deadline:
            pass
        t = mono()
        try:
            sock.sendto(HEADER.pack(seq, t) + pad, (dst, port))
        except OSError:  # e.g. ENOBUFS, unreachable: counted, the packet is lost
            errors += 1
        records.append([seq, t])
    sock.close()
    return {"role": "send", "dst": dst, "port": port, "pps": pps, "duration_s": duration_s, "size": size,
            "clock": "monotonic", "wall_start": wall, "send_errors": errors, "records": records}


def recv(port: int, duration_s: float, ready_file: str | None = None, bind: str = "0.0.0.0") -> dict:
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 * 1024 * 1024)
    sock.bind((bind, port))
    sock.settimeout(0.05)
    if ready_file:
        with open(ready_file, "w") as f:
            f.write(str(os.getpid()))
    records: list[list[float]] = []
    bad = 0
    end = time.monotonic() + duration_s
    mono = time.monotonic
    while mono() < end:
        try:
            data = sock.recv(65535)
        except socket.timeout:
            continue
        t = mono()
        if len(data) < MIN_SIZE or data[HEADER.size:HEADER.size + len(MAGIC)] != MAGIC:
            bad += 1
            continue
        seq, _ = HEADER.unpack_from(data)
        records.append([seq, t])
    sock.close()
    return {"role": "recv", "port": port, "duration_s": duration_s, "clock": "monotonic", "bad_packets": bad,
            "records": records}


def _positive_arg(kind):
    """argparse type: ``kind(text)``, held to validation.positive."""
    def conv(text: str):
        try:
            v = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
        try:
            positive(v, "")
        except SpecError as e:
            raise argparse.ArgumentTypeError(e.message) from None
        return v
    return conv


def _port(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if not 1 <= v <= 65535:
        raise argparse.ArgumentTypeError(f"must be in 1..65535, got {v}")
    return v


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m emulation.probe", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("send", help="paced UDP with sequence numbers and send times")
    s.add_argument("--dst", required=True)
    s.add_argument("--port", type=_port, required=True)
    s.add_argument("--pps", type=_positive_arg(float), required=True)
    s.add_argument("--duration", type=_positive_arg(float), required=True)
    s.add_argument("--size", type=int, default=64, help=f"UDP payload bytes (>= {MIN_SIZE})")
    s.add_argument("--out", required=True)
    r = sub.add_parser("recv", help="record (seq, arrival time) of probe packets")
    r.add_argument("--port", type=_port, required=True)
    r.add_argument("--duration", type=_positive_arg(float), required=True)
    r.add_argument("--bind", default="0.0.0.0")
    r.add_argument("--ready-file", help="written once the socket is bound")
    r.add_argument("--out", required=True)
    a = sub.add_parser("analyze", help="loss and gaps of a send/recv pair (JSON to stdout)")
    a.add_argument("--send", required=True)
    a.add_argument("--recv", required=True)
    args = p.parse_args(argv)
    if args.cmd == "send":
        if not MIN_SIZE <= args.size <= 65000:
            p.error(f"--size: must be in {MIN_SIZE}..65000, got {args.size}")
        try:
            socket.inet_aton(args.dst)
        except OSError:
            p.error(f"--dst: not an IPv4 address: {args.dst!r}")
        write_json_atomic(args.out, send(args.dst, args.port, args.pps, args.duration, args.size), fsync=False)
    elif args.cmd == "recv":
        write_json_atomic(args.out, recv(args.port, args.duration, args.ready_file, args.bind), fsync=False)
    else:
        with open(args.send) as f:
            sd = json.load(f)
        with open(args.recv) as f:
            rd = json.load(f)
        json.dump(summarize(sd, rd), sys.stdout, indent=1)
        print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
