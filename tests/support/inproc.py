"""Runs a ProxyServer on its own event loop in a background thread, for synchronous tests."""

from __future__ import annotations

import asyncio
import threading
import urllib.request
from concurrent.futures import Future

from prometheus_client.parser import text_string_to_metric_families

from config import parse_config
from proxy.app.server import ProxyServer


class InProcessProxy:
    def __init__(self, bootstrap_servers: list[str], **sections) -> None:
        raw = {
            "upstream": {"bootstrap_servers": bootstrap_servers, "connect_timeout_s": 2,
                         **sections.pop("upstream", {})},
            "listen": {"bootstrap_port": 0, "broker_port_base": 0, **sections.pop("listen", {})},
            "metrics": {"port": 0, **sections.pop("metrics", {})},
            **sections,
        }
        self.config = parse_config(raw)
        self.loop = asyncio.new_event_loop()
        self.server: ProxyServer | None = None
        self._thread = threading.Thread(target=self.loop.run_forever, name="proxy-loop", daemon=True)

    def start(self) -> InProcessProxy:
        self._thread.start()
        self.server = ProxyServer(self.config)
        self.call(self.server.start())
        return self

    def call(self, coro, timeout_s: float = 30.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def run(self, fn, *args):
        """Runs ``fn`` on the proxy's loop (to read its state safely)."""
        fut: Future = Future()

        def call() -> None:
            try:
                fut.set_result(fn(*args))
            except Exception as exc:  # surfaced in the test thread
                fut.set_exception(exc)

        self.loop.call_soon_threadsafe(call)
        return fut.result(10)

    @property
    def bootstrap(self) -> str:
        return "{}:{}".format(*self.server.bootstrap_address)

    @property
    def address(self) -> tuple[str, int]:
        return tuple(self.server.bootstrap_address)

    def metrics_text(self) -> str:
        url = "http://{}:{}/metrics".format(*self.server.metrics_address)
        with urllib.request.urlopen(url, timeout=5) as resp:
            return resp.read().decode()

    def metric(self, name: str, **labels) -> float:
        """The value of one sample (0.0 when absent)."""
        for family in text_string_to_metric_families(self.metrics_text()):
            for sample in family.samples:
                if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                    return sample.value
        return 0.0

    def stop(self) -> None:
        if self.server is not None:
            self.call(self.server.stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        self.loop.close()

    def __enter__(self) -> InProcessProxy:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
