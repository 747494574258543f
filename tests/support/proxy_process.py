"""The proxy as a real subprocess (``python -m proxy run``), the way an operator runs it.

It listens on 127.0.0.1 with OS-picked ports and reports them in its ready file; this helper
waits for that file, failing fast (with the proxy's log) if the process exits first.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import yaml
from prometheus_client.parser import text_string_to_metric_families

REPO_ROOT = Path(__file__).resolve().parents[2]

MetricKey = tuple[str, frozenset]


class ProxyProcess:
    def __init__(self, upstream_bootstrap: list[str], *, log_level: str = "info",
                 extra_config: dict | None = None) -> None:
        self._dir = tempfile.TemporaryDirectory(prefix="kqp-test-")
        root = Path(self._dir.name)
        self.config_path = root / "config.yaml"
        self.ready_path = root / "ready.json"
        self.log_path = root / "proxy.log"
        config = {
            "upstream": {"bootstrap_servers": list(upstream_bootstrap)},
            "listen": {
                "host": "127.0.0.1",
                "advertised_host": "127.0.0.1",
                "bootstrap_port": 0,
                "broker_port_base": 0,
                "max_frame_bytes": 104857600,
            },
            "metrics": {"host": "127.0.0.1", "port": 0},
        }
        for section, values in (extra_config or {}).items():
            if isinstance(values, dict):
                config.setdefault(section, {}).update(values)
            else:
                config[section] = values
        self.config = config
        self.config_path.write_text(yaml.safe_dump(config))
        self.log_level = log_level
        self.process: subprocess.Popen | None = None
        self.ready: dict | None = None

    # -- lifecycle ------------------------------------------------------------------------

    def start(self, timeout_s: float = 20.0) -> ProxyProcess:
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "proxy", "run",
                 "--config", str(self.config_path),
                 "--ready-file", str(self.ready_path),
                 "--log-level", self.log_level],
                cwd=REPO_ROOT, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
            )
        deadline = time.monotonic() + timeout_s
        # The ready file is the proxy's only signal; poll it briefly, bounded by the timeout.
        while not self.ready_path.exists():
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"proxy exited with code {self.process.returncode} before it was ready\n"
                    f"--- proxy log ---\n{self.log_text()}"
                )
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"proxy not ready after {timeout_s} s\n--- proxy log ---\n{self.log_text()}")
            time.sleep(0.02)
        self.ready = json.loads(self.ready_path.read_text())
        if self.ready.get("pid") != self.process.pid:
            raise RuntimeError(f"ready file pid {self.ready.get('pid')} is not the proxy's {self.process.pid}")
        return self

    def stop(self, timeout_s: float = 10.0) -> int | None:
        """SIGTERM, then SIGKILL after ``timeout_s``; returns the exit code."""
        process = self.process
        if process is None:
            return None
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(5)
        return process.returncode

    def close(self) -> None:
        self.stop()
        self._dir.cleanup()

    def __enter__(self) -> ProxyProcess:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    # -- addresses ------------------------------------------------------------------------

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    @property
    def address(self) -> tuple[str, int]:
        assert self.ready is not None, "proxy not started"
        host, port = self.ready["bootstrap"]
        return host, int(port)

    @property
    def bootstrap(self) -> str:
        return "{}:{}".format(*self.address)

    @property
    def metrics_url(self) -> str:
        assert self.ready is not None and self.ready.get("metrics"), "proxy has no metrics endpoint"
        host, port = self.ready["metrics"]
        return f"http://{host}:{port}/metrics"

    @property
    def healthz_url(self) -> str:
        return self.metrics_url.rsplit("/", 1)[0] + "/healthz"

    # -- observing ------------------------------------------------------------------------

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def metrics_text(self) -> str:
        with urllib.request.urlopen(self.metrics_url, timeout=5) as resp:
            return resp.read().decode()

    def metrics(self) -> dict[MetricKey, float]:
        """Every sample: {(sample name, frozenset(labels.items())): value}."""
        samples = {}
        for family in text_string_to_metric_families(self.metrics_text()):
            for sample in family.samples:
                samples[(sample.name, frozenset(sample.labels.items()))] = sample.value
        return samples

    def metric_sum(self, name: str, **labels) -> float:
        return sum_samples(self.metrics(), name, **labels)


def sum_samples(metrics: dict[MetricKey, float], name: str, **labels) -> float:
    """Sum of the samples called ``name`` whose labels include ``labels`` (0.0 when none)."""
    wanted = set(labels.items())
    return sum(v for (n, ls), v in metrics.items() if n == name and wanted <= ls)


def start_proxies(upstream_bootstrap: list[str], n: int, extra_config: dict) -> list[ProxyProcess]:
    """``n`` proxy processes with the same configuration, all started (or none: those already
    started are stopped when one fails to)."""
    out: list[ProxyProcess] = []
    try:
        for _ in range(n):
            out.append(ProxyProcess(upstream_bootstrap, extra_config=extra_config).start())
    except BaseException:
        for p in out:
            p.stop()
        raise
    return out
