"""Run the controller as a subprocess (``python -m controller``) from Python: tests, benchmarks, the CLI.

:class:`ControllerProcess` is a context manager: it picks free ports when none are given, writes a token
file (mode 0600) unless a token is given, records the PID in ``emulation.registry`` (so ``orchestrrl clean``
can stop a leftover), waits until the REST API answers, and stops the process by its PID on exit.
``kill()`` sends SIGKILL (crash tests); ``restart()`` starts a new process on the same ports, token and
state file.

Its files (token, state, log) live in ``workdir`` when one is given (the run's own folder: kept), otherwise
in a ``/tmp/orlctl-*`` folder that :meth:`stop` removes, unless the controller failed (exited by itself,
or a start failed) or ``keep_files`` was set: then the folder stays for its log, and the log says where.
"""
from __future__ import annotations

import json
import logging
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from emulation import registry as _registry
from emulation.signals import shielded
from emulation.spec import FabricSpec, JobLayout
from emulation.validation import SpecError, to_dict
from emulation.workload import WorkloadSpec

from .client import ControllerClient
from .config import ControllerOptions, to_argv

log = logging.getLogger(__name__)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class ControllerProcess:
    def __init__(self, spec: FabricSpec, layout: JobLayout, of_port: int | None = None,
                 rest_port: int | None = None, initial_phase: str = "train", delay_ms: float | None = None,
                 state_file: str | os.PathLike | None = None, token: str | None = None,
                 start_timeout_s: float = 30.0, stop_timeout_s: float = 5.0, verbose: bool = False,
                 workdir: str | os.PathLike | None = None, datapath_flush: str = "auto",
                 workload: WorkloadSpec | None = None,
                 metrics_port: int = 0, metrics_host: str = "127.0.0.1",
                 rule: str = "benefit-aware", rule_params: dict | None = None):
        self.spec = spec
        self.rule, self.rule_params = rule, dict(rule_params or {})  # the fabric's phase rule (fabric_rules)
        self.layout = layout
        self.workload = workload  # what the train topology is built from (None: the uniform mesh)
        self.of_port = of_port or free_port()
        self.rest_port = rest_port or free_port()
        self.initial_phase = initial_phase
        self.delay_ms = delay_ms
        self.datapath_flush = datapath_flush
        self.metrics_port = metrics_port  # 0: no Prometheus endpoint
        self.metrics_host = metrics_host
        self.start_timeout_s = start_timeout_s
        self.stop_timeout_s = stop_timeout_s
        self.verbose = verbose
        self._own_dir = workdir is None
        if workdir is None:
            self._dir = Path(tempfile.mkdtemp(prefix="orlctl-"))
            _registry.record_tmpdir(self._dir)  # removed by stop(); by `orchestrrl clean` after a SIGKILL
        else:
            self._dir = Path(workdir)
            self._dir.mkdir(parents=True, exist_ok=True)
        self._expected_exit = False
        self.keep_files = False  # set to keep the temporary folder after stop (its log: e.g. thread stacks)
        self._failed = False  # a start failed or the process exited by itself: keep the folder for its log
        self.state_file = Path(state_file) if state_file else self._dir / "state.json"
        self.token = token or secrets.token_urlsafe(32)
        self.token_file = self._dir / "token"
        fd = os.open(self.token_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(self.token + "\n")
        self.log_path = self._dir / "controller.log"
        self.client = ControllerClient(f"http://127.0.0.1:{self.rest_port}", self.token)
        self._proc: subprocess.Popen | None = None
        self._log_file = None
        self.starts = 0

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    @property
    def metrics_url(self) -> str | None:
        """The controller's Prometheus endpoint, or None without one."""
        from emulation.metrics import url

        return url(self.metrics_host, self.metrics_port) if self.metrics_port else None

    def options(self) -> ControllerOptions:
        doc = {"fabric": to_dict(self.spec), "layout": to_dict(self.layout)}
        if self.workload is not None:
            doc["workload"] = to_dict(self.workload)
        doc.update(rule=self.rule, rule_params=self.rule_params)
        spec_json = json.dumps(doc)
        return ControllerOptions(spec_json=spec_json, of_port=self.of_port, rest_port=self.rest_port,
                                 token_file=str(self.token_file), state_file=str(self.state_file),
                                 initial_phase=self.initial_phase, delay_ms=self.delay_ms,
                                 datapath_flush=self.datapath_flush, metrics_port=self.metrics_port,
                                 metrics_host=self.metrics_host, verbose=int(self.verbose),
                                 owner_pid=os.getpid(), owner_start=_registry.proc_start_time(os.getpid()))

    def argv(self) -> list[str]:
        return [sys.executable, "-m", "controller"] + to_argv(self.options())

    # ---- life cycle -----------------------------------------------------------------------------------
    def start(self) -> "ControllerProcess":
        if self.running:
            raise RuntimeError(f"controller already running (pid {self.pid})")
        self._expected_exit = False
        self._log_file = open(self.log_path, "ab")
        self._log_file.write(f"==== start {self.starts}: {' '.join(self.argv()[:3])} ...\n".encode())
        self._log_file.flush()
        # its own session: a terminal's Ctrl-C (SIGINT to the foreground group) reaches only its owner, which
        # stops it after the fabric, in order; were the owner killed instead, the controller notices and exits
        self._proc = subprocess.Popen(self.argv(), stdout=self._log_file, stderr=subprocess.STDOUT,
                                      stdin=subprocess.DEVNULL, cwd=str(Path(__file__).resolve().parents[1]),
                                      start_new_session=True)
        self.starts += 1
        try:  # recording inside: if it fails, the process just started is stopped
            try:
                _registry.record_process(self._proc.pid, "controller")
            except SpecError:
                if self._proc.poll() is None:
                    raise
                # it already exited (bad arguments): _wait_answering reports its exit code and log
            self._wait_answering()
        except BaseException:
            self._failed = True
            self.stop()
            raise
        log.info("controller pid %d: OpenFlow :%d, REST :%d, log %s", self.pid, self.of_port, self.rest_port,
                 self.log_path)
        return self

    def _wait_answering(self) -> None:
        deadline = time.monotonic() + self.start_timeout_s
        while True:
            if self._proc.poll() is not None:
                raise RuntimeError(f"controller exited with code {self._proc.returncode} during start:\n"
                                   f"{self.log_tail()}")
            try:
                self.client.request("GET", "state", timeout_s=1.0)
                return
            except OSError:
                pass
            if time.monotonic() >= deadline:
                raise TimeoutError(f"controller REST API not answering on :{self.rest_port} after "
                                   f"{self.start_timeout_s} s:\n{self.log_tail()}")
            time.sleep(0.05)

    def log_tail(self, n_bytes: int = 4000) -> str:
        try:
            data = self.log_path.read_bytes()
        except OSError:
            return ""
        return data[-n_bytes:].decode(errors="replace")

    def _reap(self, timeout_s: float) -> bool:
        try:
            self._proc.wait(timeout=timeout_s)
            return True
        except subprocess.TimeoutExpired:
            return False

    def _forget(self) -> None:
        """Drop the registry record of a process that is gone; keep it when the process outlived SIGKILL
        (so ``orchestrrl clean`` can still find it)."""
        if self._proc is not None:
            if self._proc.poll() is None:
                log.error("controller pid %d is still running after SIGKILL; its registry record is kept",
                          self._proc.pid)
            else:
                _registry.forget_process(self._proc.pid)
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None

    def _note_own_exit(self) -> None:
        """A process that is gone though nobody stopped it crashed: keep its files."""
        if self._proc is not None and self._proc.poll() is not None and not self._expected_exit:
            self._failed = True

    def kill(self) -> None:
        """SIGKILL (a crash: the switches keep their flows)."""
        self._note_own_exit()
        if self.running:
            self._expected_exit = True
            self._proc.send_signal(signal.SIGKILL)
            self._reap(self.stop_timeout_s)
        self._forget()

    def _stop_process(self) -> None:
        self._note_own_exit()
        if self.running:
            self._expected_exit = True
            self._proc.send_signal(signal.SIGTERM)
            if not self._reap(self.stop_timeout_s):
                log.warning("controller pid %d ignored SIGTERM; killing it", self._proc.pid)
                self._proc.send_signal(signal.SIGKILL)
                self._reap(self.stop_timeout_s)
        self._forget()

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after the deadline; then remove the temporary folder (see the module
        docstring for when it stays). Idempotent; a teardown signal meanwhile waits until it is done."""
        with shielded():
            self._stop()

    def _stop(self) -> None:
        self._stop_process()
        if not self._own_dir or not self._dir.exists():
            return
        if self._failed or self.keep_files:
            _registry.forget_tmpdir(self._dir)  # kept on purpose: clean must not remove what the message names
            log.warning("controller files kept in %s (log: %s)", self._dir, self.log_path)
            return
        shutil.rmtree(self._dir, ignore_errors=True)
        _registry.forget_tmpdir(self._dir)

    def restart(self) -> "ControllerProcess":
        """Stop (if running) and start a new process on the same ports, token and state file."""
        self._stop_process()
        return self.start()

    def __enter__(self) -> "ControllerProcess":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
