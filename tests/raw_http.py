"""A POST written to the socket by hand, for the REST tests that send what no HTTP client would: a body shorter
than its Content-Length, or one that stalls."""
from __future__ import annotations

import json
import socket
import time


def raw_post(addr: tuple[str, int], token: str, body: bytes, declared: int, then: str,
             timeout: float = 10.0) -> tuple[int, dict, float]:
    """POST /api/v1/phase to ``addr`` declaring ``declared`` bytes but sending ``body``; ``then``: "half-close"
    (shut the write side) or "stall" (keep the connection open, send nothing more).
    Returns (status, JSON answer, seconds from the request to the end of the answer)."""
    s = socket.create_connection(addr, timeout=timeout)
    try:
        s.sendall(f"POST /api/v1/phase HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {token}\r\n"
                  f"Content-Type: application/json\r\nContent-Length: {declared}\r\n\r\n".encode() + body)
        t0 = time.monotonic()
        if then == "half-close":
            s.shutdown(socket.SHUT_WR)
        data = b""
        while chunk := s.recv(65536):
            data += chunk
        took = time.monotonic() - t0
    finally:
        s.close()
    head, _, payload = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(payload), took
