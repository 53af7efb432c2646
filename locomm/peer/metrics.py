"""Observability: Prometheus metrics on a local port and JSON-lines event logs."""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

from locomm.atomic import private_dir
from locomm.config import ConfigError

log = logging.getLogger(__name__)


class Metrics:
    """Gauges and counters of one node; served over HTTP when a port is given.

    ``host`` is the address the server binds: 127.0.0.1 by default (this machine only); 0.0.0.0 in a
    container whose port is published.
    """

    def __init__(self, port: int | None, peer: str, host: str = "127.0.0.1") -> None:
        self.port: int | None = None
        self._server: Any = None
        if port is None:
            self._g = None
            return
        from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server  # noqa: PLC0415

        reg = CollectorRegistry()
        gauges = {
            "round": ("locomm_round", "Outer round"),
            "step": ("locomm_step", "Inner step"),
            "loss": ("locomm_train_loss", "Training loss (nats/byte)"),
            "tokens_per_s": ("locomm_tokens_per_second", "Training throughput"),
            "members": ("locomm_members", "Members of the current round"),
        }
        # Totals that only grow are Counters (exposed as <name>_total, what rate() and increase() expect).
        counters = {
            "bytes_sent": ("locomm_bytes_sent", "Payload bytes sent"),
            "bytes_received": ("locomm_bytes_received", "Payload bytes received"),
            "wait_s": ("locomm_compute_wait_seconds", "Time compute waited on the network"),
        }
        self._g = {
            key: Gauge(name, doc, registry=reg, labelnames=["peer"]).labels(peer=peer[-12:])
            for key, (name, doc) in gauges.items()
        }
        self._c = {
            key: Counter(name, doc, registry=reg, labelnames=["peer"]).labels(peer=peer[-12:])
            for key, (name, doc) in counters.items()
        }
        self._last: dict[str, float] = {}
        try:
            self._server, _ = start_http_server(port, addr=host, registry=reg)
        except OSError as e:  # a bad address or a taken port: one line for the user, not a traceback
            raise ConfigError(f"--metrics-host {host} --metrics-port {port}: cannot serve metrics: {e}") from None
        self.port = self._server.server_port

    def set(self, **values: float) -> None:
        if self._g is None:
            return
        for k, v in values.items():
            if k in self._g:
                self._g[k].set(v)
            elif k in self._c and v is not None:
                grew = float(v) - self._last.get(k, 0.0)
                if grew > 0:  # the peer's own total: the counter takes what it grew by
                    self._c[k].inc(grew)
                    self._last[k] = float(v)

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()


class EventLog:
    """Appends one JSON object per line (flushed, so a watcher sees it at once).

    A write that fails (``ENOSPC``: the disk is full) drops that event and is logged once per run of
    failures; the peer trains on, and the log resumes when space comes back (``dropped`` counts the lost)."""

    def __init__(self, path: Path | None) -> None:
        self._f: IO[str] | None = None
        self._lock = threading.Lock()
        self.dropped = 0
        self.sinks: list[Callable[[str, dict[str, Any]], None]] = []
        """Also called with every event (trackers: peer/trackers.py); a sink that raises is dropped, logged."""
        if path is not None:
            private_dir(path.parent)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)  # the user's alone, as every file
            self._f = open(fd, "a", encoding="utf-8")  # noqa: SIM115 - closed in close()

    def write(self, event: str, **fields: Any) -> None:
        for sink in list(self.sinks):
            try:
                sink(event, fields)
            except Exception as e:  # noqa: BLE001 - a tracker never stops a peer
                log.warning("an event sink failed (%s: %s); it is dropped", type(e).__name__, e)
                self.sinks.remove(sink)
        if self._f is None:
            return
        line = json.dumps({"event": event, "time": time.time(), **fields}, default=float) + "\n"
        with self._lock:
            try:
                self._f.write(line)
                self._f.flush()
            except OSError as e:  # a full disk is a fault of the machine, not a reason to die
                if not self.dropped:
                    log.error("cannot write the event log (%s); events are dropped until it can", e)
                self.dropped += 1
                return
            if self.dropped:
                log.warning("the event log is written again (%d events were dropped)", self.dropped)
                self.dropped = 0

    def close(self) -> None:
        if self._f is not None:
            try:
                self._f.close()
            except OSError as e:  # what a full disk kept in the buffer is lost, the peer still exits cleanly
                log.error("closing the event log: %s", e)
            self._f = None
