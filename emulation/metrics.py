"""Prometheus endpoints of the testbed's processes: metric definitions as data, one registry per process,
a loopback HTTP server, and the port rule. The controller (controller/metrics.py) and the driver
(testbed/runs/metrics.py) define what they export with :class:`MetricDef`; README's metric table is rendered from
those definitions (:func:`markdown_rows`) and a unit test holds the two together.

The endpoint is ``prometheus_client``'s WSGI app on a threading WSGI server (a daemon thread), answering in
the Prometheus text format (0.0.4) whatever the scraper offers: prometheus_client 0.26 writes a name with a
colon (``vllm:num_requests_running``) with an underscore on the OpenMetrics sample lines but not on their
``# TYPE`` lines (prometheus/client_python issue #1177, open), so a Prometheus server that negotiates
OpenMetrics (2.42 does) stored ``vllm_num_requests_running``; the text format keeps the colon. It is bound
to ``host`` (loopback by default) on a port picked by :func:`bind_port`:

* 0: off (nothing listens);
* None: the default port, or a free one when another process holds it (two runs side by side both export;
  each prints the URL it took);
* N: that port, or SpecError naming the field when it is taken.

Counters do not export ``_created`` series (:func:`new_registry` turns them off): a scrape is half the size,
and nothing here reads them.
"""
from __future__ import annotations

import errno
import logging
import socket
import socketserver
import threading
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from .validation import SpecError, require

log = logging.getLogger(__name__)

KINDS = {"counter": Counter, "gauge": Gauge, "histogram": Histogram}


@dataclass(frozen=True)
class MetricDef:
    """One exported metric: ``name`` as Prometheus shows it (a counter's ends in ``_total``), its kind
    (counter | gauge | histogram), the help text (also README's "meaning" column), its label names and, for a
    histogram, its bucket bounds."""

    name: str
    kind: str
    help: str
    labels: tuple[str, ...] = ()
    buckets: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        require(self.kind in KINDS, "kind", f"must be one of {', '.join(KINDS)}, got {self.kind!r}")
        require(self.kind != "counter" or self.name.endswith("_total"), "name",
                f"a counter's name ends in _total, got {self.name!r}")
        require(self.kind == "histogram" or not self.buckets, "buckets", "only a histogram has buckets")

    @property
    def base_name(self) -> str:
        """The name prometheus_client is given (it appends ``_total`` to a counter's)."""
        return self.name[: -len("_total")] if self.kind == "counter" else self.name


def new_registry() -> CollectorRegistry:
    """A registry of its own (not prometheus_client's global one, which also holds the process collectors)."""
    prometheus_client.disable_created_metrics()
    return CollectorRegistry(auto_describe=True)


def build(registry: CollectorRegistry, defs: Iterable[MetricDef]) -> dict[str, Any]:
    """Register every definition in ``registry``; the metric objects by exported name."""
    out: dict[str, Any] = {}
    for d in defs:
        kw: dict[str, Any] = {"labelnames": d.labels, "registry": registry}
        if d.kind == "histogram":
            kw["buckets"] = d.buckets
        out[d.name] = KINDS[d.kind](d.base_name, d.help, **kw)
    return out


def registered(registry: CollectorRegistry) -> dict[str, tuple[str, tuple[str, ...]]]:
    """What ``registry`` exports: exported name -> (kind, label names), read back from prometheus_client
    (the unit test that holds README to the code compares this with the definitions)."""
    out = {}
    for collector in list(registry._collector_to_names):  # noqa: SLF001 - the registry has no public listing
        for fam in (collector.describe() if hasattr(collector, "describe") else collector.collect()):
            name = fam.name + ("_total" if fam.type == "counter" else "")
            # a metric object's label names, else (a collector of its own) those its family was described with
            labels = getattr(collector, "_labelnames", None)
            out[name] = (fam.type, tuple(labels if labels is not None else getattr(fam, "_labelnames", ())))
    return out


def markdown_rows(defs: Sequence[MetricDef], process: str) -> list[str]:
    """README's table rows for ``defs`` (``| name | type | labels | meaning |``)."""
    rows = []
    for d in defs:
        labels = ", ".join(f"`{x}`" for x in d.labels) or "-"
        rows.append(f"| `{d.name}` | {d.kind} | {process} | {labels} | {d.help} |")
    return rows


# ---- the endpoint -----------------------------------------------------------------------------------------
def _bindable(host: str, port: int) -> bool:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the servers bind: TIME_WAIT is no owner
        try:
            s.bind((host, port))
        except OSError as e:
            if e.errno in (errno.EADDRINUSE, errno.EACCES):
                return False
            raise
    return True


def bind_port(host: str, port: int | None, default: int, field: str) -> int:
    """The port an endpoint is to listen on (0: off), by the rule in the module docstring. Only checks
    (binds and closes): the process that serves binds it itself, a moment later."""
    if port == 0:
        return 0
    if port is not None:
        try:
            free = _bindable(host, port)
        except OSError as e:
            raise SpecError(field, f"cannot listen on {host}:{port}: {e.strerror or e}") from None
        require(free, field, f"port {port} on {host} is in use (another run?): give another, or 0 for no endpoint")
        return port
    try:
        if _bindable(host, default):
            return default
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((host, 0))
            picked = s.getsockname()[1]
    except OSError as e:
        raise SpecError(field, f"cannot listen on {host}: {e.strerror or e}") from None
    log.warning("%s: the default port %d on %s is in use: serving on %d instead", field, default, host, picked)
    return picked


def url(host: str, port: int) -> str:
    return f"http://{f'[{host}]' if ':' in host else host}:{port}/metrics"


TEXT_FORMAT = "text/plain; version=0.0.4"


def text_format_app(registry: CollectorRegistry) -> Callable:
    """prometheus_client's WSGI app for ``registry`` (gzip, ``name[]`` filters, HEAD), always answering in the
    text format (see the module docstring: OpenMetrics output loses the colons of vLLM's names)."""
    inner = prometheus_client.make_wsgi_app(registry)

    def app(environ: dict, start_response: Callable) -> Iterable[bytes]:
        return inner({**environ, "HTTP_ACCEPT": TEXT_FORMAT}, start_response)

    return app


class _Server(socketserver.ThreadingMixIn, WSGIServer):
    daemon_threads = True  # a scrape in flight never keeps the process from exiting
    allow_reuse_address = True


class _Server6(_Server):
    address_family = socket.AF_INET6


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # no access log on stderr (a scrape a second)
        logging.getLogger(__name__ + ".access").debug("%s " + format, self.address_string(), *args)


class MetricsServer:
    """``registry`` served on ``host:port`` (port from :func:`bind_port`; 0 serves nothing). A context
    manager; :meth:`stop` is idempotent. ``url`` is None when off."""

    def __init__(self, registry: CollectorRegistry, host: str, port: int):
        self.registry = registry
        self.host = host
        self.port = port
        self._httpd = None
        self._thread = None

    @property
    def url(self) -> str | None:
        return url(self.host, self.port) if self.port else None

    def start(self) -> "MetricsServer":
        if self.port and self._httpd is None:
            self._listen(self.port)
        return self

    def _listen(self, port: int) -> None:
        """Bind ``port`` (0: a free one the OS picks) and serve on a daemon thread."""
        cls = _Server6 if ":" in self.host else _Server
        httpd = cls((self.host, port), _QuietHandler)
        httpd.set_app(text_format_app(self.registry))
        self._httpd = httpd
        self._thread = threading.Thread(target=httpd.serve_forever, args=(0.5,), daemon=True, name="metrics")
        self._thread.start()
        self.port = httpd.server_port
        log.info("Prometheus metrics on %s", self.url)

    def stop(self) -> None:
        httpd, self._httpd = self._httpd, None
        if httpd is not None:
            httpd.shutdown()
            httpd.server_close()
            if self._thread is not None:
                self._thread.join(timeout=5.0)

    def __enter__(self) -> "MetricsServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def serve_free(registry: CollectorRegistry, host: str = "127.0.0.1") -> MetricsServer:
    """Serve ``registry`` on a free port the OS picks (benchmarks, tests: never a default one)."""
    server = MetricsServer(registry, host, 0)
    server._listen(0)
    return server


def serve(registry: CollectorRegistry, host: str, port: int | None, default: int, field: str) -> MetricsServer:
    """Serve ``registry`` in this process by the port rule (module docstring), binding at once (no window for
    another process to take the port in between). SpecError naming ``field`` when a given port is taken."""
    if port == 0:
        return MetricsServer(registry, host, 0)
    want = default if port is None else port
    try:
        return MetricsServer(registry, host, want).start()
    except OSError as e:
        if e.errno not in (errno.EADDRINUSE, errno.EACCES):
            raise SpecError(field, f"cannot listen on {host}:{want}: {e.strerror or e}") from None
        if port is not None:
            raise SpecError(field, f"port {port} on {host} is in use (another run?): give another, or 0 for no "
                                   f"endpoint") from None
    try:
        server = serve_free(registry, host)
    except OSError as e:
        raise SpecError(field, f"cannot listen on {host}: {e.strerror or e}") from None
    log.warning("%s: the default port %d on %s is in use: serving on %d instead", field, default, host, server.port)
    return server


class Scraper:
    """GET ``url`` every ``interval_s`` on a daemon thread, as a Prometheus server would (the benchmarks' load
    with metrics on); ``scrapes`` counts the answered ones. A context manager; :meth:`stop` is idempotent."""

    def __init__(self, url: str, interval_s: float = 1.0):
        self.url, self.interval_s = url, interval_s
        self.scrapes = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="scraper")

    def _run(self) -> None:
        import urllib.request

        while not self._stop.wait(self.interval_s):
            try:
                with urllib.request.urlopen(self.url, timeout=5) as r:
                    r.read()
                self.scrapes += 1
            except OSError as e:
                log.warning("scrape of %s failed: %s", self.url, e)

    def __enter__(self) -> "Scraper":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=10.0)

    def __exit__(self, *exc) -> None:
        self.stop()
