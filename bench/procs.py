"""Processes the benchmark starts: Tansu broker, Tansu proxy, the byte pump, HAProxy and our proxy.

Tansu is started as proxy.app.local_broker does it (a port read back from port 0, confirmed to be
held by Tansu's own process, retried otherwise; readiness is an ApiVersions round trip), but
here every process also gets a log file, a CPU pin and a role, and Tansu's own proxy is
started the same way.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from proxy.app.local_broker import api_versions_ping, tansu_binary
from proxy.app.local_broker import candidate_port as free_port
from proxy.app.procnet import listening_inodes, socket_inodes

from .tls import BenchPki
from .tls import api_versions_ping as tls_api_versions_ping

REPO = Path(__file__).resolve().parent.parent





def haproxy_binary() -> str | None:
    """The haproxy executable (Debian puts it in /usr/sbin, which a user's PATH may lack)."""
    found = shutil.which("haproxy")
    if found is None and os.access("/usr/sbin/haproxy", os.X_OK):
        found = "/usr/sbin/haproxy"
    return found


def haproxy_config(port: int, upstream: tuple[str, int]) -> str:
    """HAProxy as a plain TCP forwarder on 127.0.0.1:``port``: one thread (as the pump and the
    proxy run one event loop), everything else at its defaults (16 KiB buffers, no splicing).
    maxconn is set from the open-files limit so the 1,000-connection memory test fits."""
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    maxconn = max(256, min(10_000, (soft - 100) // 2))
    return (
        "global\n"
        "    nbthread 1\n"
        f"    maxconn {maxconn}\n"
        "defaults\n"
        "    mode tcp\n"
        "    timeout connect 5s\n"
        "    timeout client 1h\n"
        "    timeout server 1h\n"
        "frontend kafka\n"
        f"    bind 127.0.0.1:{port}\n"
        "    default_backend broker\n"
        "backend broker\n"
        f"    server broker {upstream[0]}:{upstream[1]}\n"
    )


def raise_nofile(want: int | None = None) -> tuple[int, int]:
    """Raise the soft open-files limit (to ``want`` or the hard limit); returns the new limits."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if want is None else min(max(want, soft), hard)
    if hard == resource.RLIM_INFINITY and want is None:
        target = max(soft, 1 << 20)
    if target > soft:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)


def pid_owns_listener(pid: int, port: int) -> bool:
    return bool(listening_inodes(port) & socket_inodes(pid))








def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError(f"no VmRSS for pid {pid}")


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process (all threads)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    ticks = os.sysconf("SC_CLK_TCK")
    return (int(fields[11]) + int(fields[12])) / ticks


def _thread_run_ns(pid: int) -> dict[int, int] | None:
    """Nanoseconds on CPU of each live thread of ``pid`` (the first field of
    /proc/PID/task/TID/schedstat); None where the kernel keeps no schedstat."""
    out: dict[int, int] = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return None
    for tid in tids:
        try:
            out[int(tid)] = int(Path(f"/proc/{pid}/task/{tid}/schedstat").read_text().split()[0])
        except FileNotFoundError:
            continue  # the thread exited just now (elapsed() then falls back)
        except (OSError, ValueError, IndexError):
            return None
    return out


class CpuClock:
    """CPU time (user + system) ``pid`` uses from now on, to the nanosecond: the run time the
    scheduler keeps per thread (/proc/PID/task/TID/schedstat) summed over the threads.
    :func:`cpu_seconds` counts clock ticks (10 ms), too coarse for the CPU per MB of a
    one-second run. A thread that exits in between takes its run time with it, so then (and
    without schedstat) the tick count of :func:`cpu_seconds` is what ``elapsed()`` gives;
    threads started in between count from their start."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.coarse0 = cpu_seconds(pid)
        self.fine0 = _thread_run_ns(pid)

    def elapsed(self) -> float:
        coarse = cpu_seconds(self.pid) - self.coarse0
        fine1 = _thread_run_ns(self.pid)
        if self.fine0 is None or fine1 is None or not self.fine0.keys() <= fine1.keys():
            return coarse
        fine = (sum(fine1.values()) - sum(self.fine0.values())) / 1e9
        return coarse if fine <= 0 < coarse else fine


def system_busy_seconds() -> float:
    """CPU time spent by all CPUs on anything but idle/iowait since boot (from /proc/stat)."""
    fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in fields[:8])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")








@dataclass
class Proc:
    """A started subprocess and the address clients should bootstrap from."""

    name: str
    popen: subprocess.Popen
    address: tuple[str, int]
    log_path: Path
    extra: dict = field(default_factory=dict)

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def ca_file(self) -> str | None:
        """The CA a client must trust when this process terminates TLS (None: plaintext)."""
        return self.extra.get("ca_file")

    def alive(self) -> bool:
        return self.popen.poll() is None

    def stop(self, timeout_s: float = 5.0) -> None:
        if self.popen.poll() is not None:
            return
        self.popen.send_signal(signal.SIGTERM)
        try:
            self.popen.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait(timeout_s)

    def log_tail(self, n: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""


class Launcher:
    """Starts and remembers processes; ``close()`` stops them all (in reverse order)."""

    def __init__(self, workdir: Path | None = None, pin: dict[str, str] | None = None,
                 python_wrapper=None) -> None:
        self.workdir = Path(workdir or tempfile.mkdtemp(prefix="kqp-bench-"))
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.procs: list[Proc] = []
        self.pin = pin or {}  # role -> taskset cpu list, e.g. {"broker": "0", "intermediary": "1"}
        # name -> argv between the interpreter and "-m MODULE" for the pump and our proxy
        # (bench.callbacks uses it to time their callbacks); none by default.
        self.python_wrapper = python_wrapper or (lambda name: [])
        self._n = 0

    def _popen(self, name: str, role: str, argv: list[str], cwd: Path | None = None) -> tuple[subprocess.Popen, Path]:
        self._n += 1
        log_path = self.workdir / f"{self._n:02d}-{name}.log"
        cpus = self.pin.get(role)
        if cpus and shutil.which("taskset"):
            argv = ["taskset", "-c", cpus, *argv]
        with open(log_path, "wb") as log:
            popen = subprocess.Popen(
                argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                cwd=cwd or REPO, start_new_session=True,
            )
        return popen, log_path

    def _wait_ready(self, proc: Proc, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not proc.alive():
                raise RuntimeError(f"{proc.name} exited with {proc.popen.returncode}:\n{proc.log_tail()}")
            ok = (api_versions_ping(*proc.address, timeout_s=1.0) if proc.ca_file is None
                  else tls_api_versions_ping(proc.address, proc.ca_file, timeout_s=1.0))
            if ok:
                return
            time.sleep(0.02)
        raise RuntimeError(f"{proc.name} not answering ApiVersions at {proc.address}:\n{proc.log_tail()}")

    def _start_tansu(self, name: str, role: str, argv_for_port, attempts: int = 10,
                     ready_timeout_s: float = 20.0, before_check=None) -> Proc:
        last = ""
        for _ in range(attempts):
            port = free_port()
            popen, log_path = self._popen(name, role, argv_for_port(port))
            proc = Proc(name, popen, ("127.0.0.1", port), log_path)
            if not _listening_within(proc, port, 5.0):
                last = f"port {port}: {'exited' if not proc.alive() else 'not listening'}\n{proc.log_tail()}"
                proc.stop(1.0)
                continue
            self.procs.append(proc)
            if before_check is not None:
                before_check(proc)
            self._wait_ready(proc, ready_timeout_s)
            return proc
        raise RuntimeError(f"could not start {name}: {last}")

    def tansu_broker(self, advertised_port: int | None = None, name: str = "tansu-broker") -> Proc:
        """A Tansu broker (memory storage); advertised at its own port unless told otherwise."""
        binary = str(tansu_binary())

        def argv(port: int) -> list[str]:
            adv = advertised_port if advertised_port is not None else port
            return [binary, "broker", "--listener-url", f"tcp://127.0.0.1:{port}",
                    "--advertised-listener-url", f"tcp://127.0.0.1:{adv}",
                    "--storage-engine", "memory://tansu/"]

        return self._start_tansu(name, "broker", argv)

    def tansu_proxy(self, origin: tuple[str, int], name: str = "tansu-proxy") -> Proc:
        binary = str(tansu_binary())

        def argv(port: int) -> list[str]:
            return [binary, "proxy", "--listener-url", f"tcp://127.0.0.1:{port}",
                    "--advertised-listener-url", f"tcp://127.0.0.1:{port}",
                    "--origin-url", f"tcp://{origin[0]}:{origin[1]}"]

        return self._start_tansu(name, "tansu-proxy", argv)  # multi-threaded: not an "intermediary" pin

    def _python_with_ready_file(self, name: str, argv: list[str], ready: Path, timeout_s: float,
                                cwd: Path | None = None, tls: BenchPki | None = None) -> Proc:
        ready.unlink(missing_ok=True)  # one a reused workdir kept from an earlier run names a dead process
        popen, log_path = self._popen(name, "intermediary", argv, cwd)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if popen.poll() is not None:
                tail = log_path.read_text(errors="replace")[-3000:]
                raise RuntimeError(f"{name} exited with {popen.returncode}:\n{tail}")
            if ready.exists():
                info = json.loads(ready.read_text())
                if tls is not None:
                    info["ca_file"] = tls.ca_file
                proc = Proc(name, popen, tuple(info["bootstrap"]), log_path, extra=info)
                self.procs.append(proc)
                return proc
            time.sleep(0.02)
        popen.kill()
        raise RuntimeError(f"{name}: no ready file after {timeout_s}s:\n{log_path.read_text(errors='replace')[-3000:]}")

    def byte_pump(self, upstream: tuple[str, int], name: str = "byte-pump", tls: BenchPki | None = None) -> Proc:
        """Start the pump (it connects upstream lazily, so the broker may come later); with
        ``tls``, it terminates TLS towards its clients (plaintext to the broker)."""
        ready = self.workdir / f"{name}-{self._n + 1}.ready.json"
        argv = [sys.executable, *self.python_wrapper(name), "-m", "bench.byte_pump", "--listen", "127.0.0.1:0",
                "--upstream", f"{upstream[0]}:{upstream[1]}", "--ready-file", str(ready)]
        if tls is not None:
            argv += ["--tls-cert", tls.cert_file, "--tls-key", tls.key_file]
        return self._python_with_ready_file(name, argv, ready, 15.0, tls=tls)

    def pumped_broker(self, attempts: int = 10, tls: BenchPki | None = None,
                      name: str = "byte-pump") -> tuple[Proc, Proc]:
        """Tansu on port A advertised at the pump's port P; the pump forwards P -> A.

        The pump is started first (on port 0, so its port is certain) with upstream A chosen by
        bind-and-close; if Tansu cannot get A, both are stopped and another A is tried.
        """
        binary = str(tansu_binary())
        last = ""
        for _ in range(attempts):
            port_a = free_port()
            pump = self.byte_pump(("127.0.0.1", port_a), name=name, tls=tls)
            argv = [binary, "broker", "--listener-url", f"tcp://127.0.0.1:{port_a}",
                    "--advertised-listener-url", f"tcp://127.0.0.1:{pump.address[1]}",
                    "--storage-engine", "memory://tansu/"]
            popen, log_path = self._popen("tansu-broker", "broker", argv)
            broker = Proc("tansu-broker", popen, ("127.0.0.1", port_a), log_path)
            if not _listening_within(broker, port_a, 5.0):
                last = f"port {port_a}: {broker.log_tail()}"
                broker.stop(1.0)
                pump.stop()
                self.procs.remove(pump)
                continue
            self.procs.insert(self.procs.index(pump), broker)
            self._wait_ready(broker, 20.0)
            self._wait_ready(pump, 10.0)
            return broker, pump
        raise RuntimeError(f"could not start a pumped broker: {last}")

    def haproxy(self, upstream: tuple[str, int], name: str = "haproxy", attempts: int = 10,
                wait_ready: bool = True) -> Proc:
        """HAProxy in TCP mode, one thread, forwarding a port of its own to ``upstream``.

        HAProxy cannot listen on port 0 and tell which port it got, so a port is chosen by
        bind-and-close, haproxy started on it in the foreground (``-db``), and another port tried
        if it is not the one listening there within 5 s (it exits when the bind fails). With
        ``wait_ready`` (the broker is up), an ApiVersions round trip through it must succeed."""
        binary = haproxy_binary()
        if binary is None:
            raise RuntimeError("haproxy is not installed (apt-get install haproxy)")
        last = ""
        for _ in range(attempts):
            port = free_port()
            cfg = self.workdir / f"{name}-{self._n + 1}.cfg"
            cfg.write_text(haproxy_config(port, upstream))
            popen, log_path = self._popen(name, "intermediary", [binary, "-db", "-f", str(cfg)])
            proc = Proc(name, popen, ("127.0.0.1", port), log_path)
            if not _listening_within(proc, port, 5.0):
                last = f"port {port}: {'exited' if not proc.alive() else 'not listening'}\n{proc.log_tail()}"
                proc.stop(1.0)
                continue
            self.procs.append(proc)
            if wait_ready:
                self._wait_ready(proc, 10.0)
            return proc
        raise RuntimeError(f"could not start {name}: {last}")

    def haproxy_broker(self, attempts: int = 10, name: str = "haproxy") -> tuple[Proc, Proc]:
        """Tansu on port A advertised at HAProxy's port P; HAProxy forwards P -> A (it cannot
        rewrite the addresses in Metadata either). As :meth:`pumped_broker`: HAProxy first (its
        port is then certain), A chosen by bind-and-close and retried if Tansu cannot get it."""
        binary = str(tansu_binary())
        last = ""
        for _ in range(attempts):
            port_a = free_port()
            hap = self.haproxy(("127.0.0.1", port_a), name=name, wait_ready=False)
            argv = [binary, "broker", "--listener-url", f"tcp://127.0.0.1:{port_a}",
                    "--advertised-listener-url", f"tcp://127.0.0.1:{hap.address[1]}",
                    "--storage-engine", "memory://tansu/"]
            popen, log_path = self._popen("tansu-broker", "broker", argv)
            broker = Proc("tansu-broker", popen, ("127.0.0.1", port_a), log_path)
            if not _listening_within(broker, port_a, 5.0):
                last = f"port {port_a}: {broker.log_tail()}"
                broker.stop(1.0)
                self.stop(hap)
                continue
            self.procs.insert(self.procs.index(hap), broker)
            self._wait_ready(broker, 20.0)
            self._wait_ready(hap, 10.0)
            return broker, hap
        raise RuntimeError(f"could not start a broker behind haproxy: {last}")

    def our_proxy(self, upstream: tuple[str, int], name: str = "kafka-quota-proxy",
                  log_level: str = "warning", extra_yaml: str = "", checkout: Path | None = None,
                  tls: BenchPki | None = None) -> Proc:
        """This project's proxy; with ``checkout``, the one in that directory (another commit's
        work tree: ``python -m proxy`` finds its packages there first); with ``tls``, its client
        listeners terminate TLS (``listen.tls``, client_auth none; plaintext to the broker)."""
        n = self._n + 1
        cfg = self.workdir / f"{name}-{n}.yaml"
        ready = self.workdir / f"{name}-{n}.ready.json"
        cfg.write_text(
            "upstream:\n"
            f"  bootstrap_servers: [\"{upstream[0]}:{upstream[1]}\"]\n"
            "listen:\n"
            "  host: 127.0.0.1\n"
            "  advertised_host: 127.0.0.1\n"
            "  bootstrap_port: 0\n"
            "  broker_port_base: 0\n"
            + (("  tls:\n"
                f"    certificate: {json.dumps(tls.cert_file)}\n"
                f"    key: {json.dumps(tls.key_file)}\n") if tls is not None else "")
            + "metrics:\n"
            "  host: 127.0.0.1\n"
            "  port: 0\n"
            + extra_yaml
        )
        argv = [sys.executable, *self.python_wrapper(name), "-m", "proxy", "run", "--config", str(cfg),
                "--ready-file", str(ready),
                "--log-level", log_level]
        proc = self._python_with_ready_file(name, argv, ready, 30.0, checkout, tls=tls)
        self._wait_ready(proc, 10.0)
        return proc

    def stop(self, proc: Proc) -> None:
        proc.stop()
        if proc in self.procs:
            self.procs.remove(proc)

    def close(self) -> None:
        for proc in reversed(self.procs):
            try:
                proc.stop()
            except Exception:
                pass
        self.procs.clear()


def _listening_within(proc: Proc, port: int, timeout_s: float) -> bool:
    """Whether ``proc`` itself (not another process that took the port) listens on ``port``
    within ``timeout_s`` while it stays alive."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.alive():
        if pid_owns_listener(proc.pid, port):
            return True
        time.sleep(0.01)
    return False
