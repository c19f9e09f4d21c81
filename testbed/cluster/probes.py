"""Real traffic on the emulated fabric: probe streams (UDP sequence numbers) and iperf3 TCP transfers.

Every process runs inside a Mininet host through ``EmulatedFabric.popen`` (recorded, stopped with the
fabric). Waits poll a condition with a deadline.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from emulation import probe
from emulation.builder import EmulatedFabric


def wait_for(cond, timeout_s: float, what: str, poll_s: float = 0.01) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout_s:g} s waiting for {what}")
        time.sleep(poll_s)


def _finish(p: subprocess.Popen, timeout_s: float, what: str) -> None:
    # communicate, not wait: a child that writes more than a pipe's worth to stderr (a torch traceback) would
    # otherwise block until the deadline and its real error would be lost
    try:
        _, err = p.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        p.kill()
        p.communicate()
        raise TimeoutError(f"{what} did not finish within {timeout_s:g} s") from None
    if p.returncode != 0:
        raise RuntimeError(f"{what} exited with {p.returncode}: {err[-2000:] if err else ''}")


def _scratch(fabric: EmulatedFabric, prefix: str) -> Path:
    """A fresh folder inside the fabric's own scratch folder (removed with the fabric)."""
    return Path(tempfile.mkdtemp(prefix=prefix, dir=fabric.workdir))


@dataclass
class ProbeStream:
    """One paced UDP stream ``src -> dst`` measured by sequence numbers on the sender's clock."""

    fabric: EmulatedFabric
    src: int
    dst: int
    pps: float
    duration_s: float
    port: int = 47000
    workdir: Path | None = None  # default: a folder inside the fabric's scratch folder

    def __post_init__(self) -> None:
        if self.workdir is None:
            self.workdir = _scratch(self.fabric, "probe-")
        tag = f"{self.src}-{self.dst}-{self.port}"
        self.send_out = self.workdir / f"send-{tag}.json"
        self.recv_out = self.workdir / f"recv-{tag}.json"
        self.ready = self.workdir / f"ready-{tag}"
        self._recv: subprocess.Popen | None = None
        self._send: subprocess.Popen | None = None

    def start_receiver(self, extra_s: float = 2.0) -> None:
        spec = self.fabric.spec
        self._recv = self.fabric.popen(
            self.dst, [sys.executable, "-m", "emulation.probe", "recv", "--port", str(self.port), "--duration",
                       f"{self.duration_s + extra_s:.3f}", "--out", str(self.recv_out), "--ready-file",
                       str(self.ready), "--bind", spec.host_ip(self.dst)],
            stderr=subprocess.PIPE, text=True, role="probe-recv")
        recv = self._recv
        wait_for(lambda: self.ready.exists() or recv.poll() is not None, 15.0, f"probe receiver on host {self.dst}")
        if not self.ready.exists():  # it died (e.g. the port is taken): say why
            _finish(recv, 5.0, f"probe receiver on host {self.dst}")
            raise RuntimeError(f"probe receiver on host {self.dst} exited before binding port {self.port}")

    def start_sender(self) -> None:
        spec = self.fabric.spec
        self._send = self.fabric.popen(
            self.src, [sys.executable, "-m", "emulation.probe", "send", "--dst", spec.host_ip(self.dst), "--port",
                       str(self.port), "--pps", str(self.pps), "--duration", f"{self.duration_s:.3f}", "--out",
                       str(self.send_out)], stderr=subprocess.PIPE, text=True, role="probe-send")

    def start(self) -> "ProbeStream":
        self.start_receiver()
        self.start_sender()
        return self

    def result(self, timeout_s: float | None = None) -> tuple[dict, dict]:
        """Wait for both ends; return (send document, recv document)."""
        t = timeout_s if timeout_s is not None else self.duration_s + 30.0
        if self._send is None or self._recv is None:
            raise RuntimeError("probe stream not started")
        _finish(self._send, t, f"probe sender on host {self.src}")
        _finish(self._recv, t, f"probe receiver on host {self.dst}")
        return json.loads(self.send_out.read_text()), json.loads(self.recv_out.read_text())

    def summary(self, timeout_s: float | None = None) -> dict:
        send_doc, recv_doc = self.result(timeout_s)
        out = probe.summarize(send_doc, recv_doc)
        out["records"] = send_doc["records"]
        return out


def _wait_line(p: subprocess.Popen, needle: str, timeout_s: float, what: str) -> None:
    """Read p's stdout until a line containing ``needle`` appears (deadline)."""
    import select

    deadline = time.monotonic() + timeout_s
    buf = ""
    while needle not in buf:
        left = deadline - time.monotonic()
        if left <= 0 or p.poll() is not None:
            raise RuntimeError(f"{what}: never printed {needle!r} (exit {p.poll()}): {buf[-500:]}")
        ready, _, _ = select.select([p.stdout], [], [], min(left, 0.2))
        if ready:  # raw read: a buffered readline could hold the line we wait for where select can't see it
            buf += os.read(p.stdout.fileno(), 4096).decode(errors="replace")


def iperf3(fabric: EmulatedFabric, src: int, dst: int, seconds: float, port: int = 5201,
           parallel: int = 1) -> subprocess.Popen:
    """Start an iperf3 TCP transfer src -> dst (the server runs one test and exits). Returns the client."""
    ip = fabric.spec.host_ip(dst)
    srv = fabric.popen(dst, ["iperf3", "-s", "-1", "--forceflush", "-p", str(port), "-B", ip], stdout=subprocess.PIPE,
                       stderr=subprocess.STDOUT, text=True, role="iperf3-server")
    _wait_line(srv, "Server listening", 10.0, f"iperf3 server on host {dst}")
    return fabric.popen(src, ["iperf3", "-c", ip, "-p", str(port), "-t", f"{seconds:g}", "-J", "-P",
                              str(parallel), "--connect-timeout", "3000"],
                        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, role="iperf3-client")


def iperf3_result(cli: subprocess.Popen, timeout_s: float) -> dict:
    """Goodput of a finished iperf3 client: {'bps': received bits/s, 'retransmits': n}."""
    try:
        out, err = cli.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        cli.kill()
        raise TimeoutError(f"iperf3 did not finish within {timeout_s:g} s") from None
    try:
        doc = json.loads(out)
    except json.JSONDecodeError:
        raise RuntimeError(f"iperf3 printed no JSON (exit {cli.returncode}): {(out + err)[-500:]}") from None
    if "error" in doc:
        raise RuntimeError(f"iperf3: {doc['error']}")
    end = doc["end"]
    return {"bps": float(end["sum_received"]["bits_per_second"]),
            "retransmits": int(end["sum_sent"].get("retransmits", 0))}
