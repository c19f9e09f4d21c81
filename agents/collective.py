"""A GPU-node agent's collective worker: real torch.distributed (Gloo here, NCCL on GPUs) over the fabric.

    GLOO_SOCKET_IFNAME=<fabric intf> python -m agents.collective --op all_reduce --rank R --world N \\
        --init tcp://<rank-0 fabric ip>:<port> --bytes B [--iters K] [--src 0] --out FILE

Runs one untimed warm-up (connection set-up), then ``iters`` timed operations, each after a barrier, and
writes JSON: ``{"op", "rank", "world", "bytes", "times_s": [...], "backend"}``. Nothing but JSON leaves the
process (no pickle on any socket of ours; Gloo's own wire format carries the tensors).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

from emulation.files import write_json_atomic

OPS = ("all_reduce", "broadcast")


def run(op: str, rank: int, world: int, init: str, nbytes: int, iters: int, src: int,
        timeout_s: float) -> dict:
    import datetime

    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout_s))
    try:
        n = max(1, nbytes // 4)
        t = torch.ones(n, dtype=torch.float32) * (rank + 1)

        def once() -> None:
            if op == "all_reduce":
                dist.all_reduce(t)
            else:
                dist.broadcast(t, src=src)

        once()  # warm-up: connections
        times = []
        for _ in range(iters):
            dist.barrier()
            t0 = time.perf_counter()
            once()
            times.append(time.perf_counter() - t0)
        # a correctness check the caller can read: after broadcast every rank holds src's value
        check = float(t[0].item())
    finally:
        dist.destroy_process_group()
    return {"op": op, "rank": rank, "world": world, "bytes": n * 4, "times_s": times, "backend": "gloo",
            "check_value": check, "ifname": os.environ.get("GLOO_SOCKET_IFNAME")}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m agents.collective", description=__doc__.splitlines()[0])
    p.add_argument("--op", choices=OPS, required=True)
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--init", required=True, help="tcp://IP:PORT of rank 0")
    p.add_argument("--bytes", type=int, required=True)
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--src", type=int, default=0, help="broadcast source rank")
    p.add_argument("--timeout-s", type=float, default=120.0)
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    problems = []
    if a.world < 1:
        problems.append(f"--world must be >= 1, got {a.world}")
    if not 0 <= a.rank < max(a.world, 1):
        problems.append(f"--rank must be in 0..{a.world - 1}, got {a.rank}")
    if not 0 <= a.src < max(a.world, 1):
        problems.append(f"--src must be in 0..{a.world - 1}, got {a.src}")
    if a.bytes < 4:
        problems.append(f"--bytes must be >= 4, got {a.bytes}")
    if a.iters < 1:
        problems.append(f"--iters must be >= 1, got {a.iters}")
    if not a.init.startswith("tcp://"):
        problems.append(f"--init must be tcp://IP:PORT, got {a.init!r}")
    if problems:
        print("agents.collective: error: " + "; ".join(problems), file=sys.stderr)
        return 2
    res = run(a.op, a.rank, a.world, a.init, a.bytes, a.iters, a.src, a.timeout_s)
    write_json_atomic(a.out, res, fsync=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
