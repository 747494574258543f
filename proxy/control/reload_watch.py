"""The configuration file, read once and watched: a change is applied to the running proxy
(``ProxyServer.reload``) when polling sees it settle, or at once on SIGHUP."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple, Protocol

from config import ConfigError, parse_config
from config.loader import written_sections, yaml_document
from config.model import Config
from proxy.control.file_signature import Signature, signature

log = logging.getLogger(__name__)


class ConfigFile(NamedTuple):
    """The configuration file as read once: the configuration, the file's signature just before
    the read (a later write changes it), the SHA-256 of exactly the bytes parsed, and the
    top-level sections those bytes write (``config.loader.written_sections``)."""

    path: str
    config: Config
    signature: Signature | None
    digest: str
    sections: frozenset[str]
    data: bytes = b""  # the very bytes parsed


def read_config_file(path: str) -> ConfigFile:
    """Reads ``path`` once and parses those bytes. Raises ConfigError naming the YAML path."""
    before = signature(path)
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise ConfigError(path, f"cannot read: {exc.strerror}") from exc
    root = yaml_document(path, data)
    return ConfigFile(path, parse_config(root), before, hashlib.sha256(data).hexdigest(), written_sections(root),
                      data)


def unwritten_in_force(in_force: Config, loaded: ConfigFile) -> list[ConfigError]:
    """One ConfigError (named by the section's YAML path) per section the file does not write
    whose default would replace what is in force: what a reload applies (``ProxyServer.reload``:
    the file's quotas, rate_limiters, mode, producer_id_quota.reaction) must be changed by what
    the file says, never by a file that stops before saying it. A section that was never written,
    or whose value in force is its default, may be left out: that changes nothing. Every other
    section is read at start only, so its absence changes nothing in force either."""
    new = loaded.config
    unwritten = "missing (no key, or nothing under it)"
    errors = []
    if "quotas" not in loaded.sections and in_force.quotas != new.quotas:
        errors.append(ConfigError("quotas", (
            f"{unwritten} while {_entries(len(in_force.quotas))} in force, as in a file cut short before "
            "quotas: (to remove them all, write quotas: [])")))
    if "rate_limiters" not in loaded.sections and in_force.rate_limiters != new.rate_limiters:
        errors.append(ConfigError("rate_limiters", (
            f"{unwritten} while rate_limiters: [{_targets(in_force)}] is in force, which the defaults "
            f"([{_targets(new)}]) would replace (write the list wanted, [] for none)")))
    if "mode" not in loaded.sections and in_force.mode != new.mode:
        errors.append(ConfigError("mode", (
            f"{unwritten} while mode: {in_force.mode} is in force, and every quota entry without a mode of its "
            f"own would switch to {new.mode} (to mean it, write mode: {new.mode})")))
    reaction, default = in_force.producer_id_quota.reaction, new.producer_id_quota.reaction
    if "producer_id_quota" not in loaded.sections and reaction != default:
        errors.append(ConfigError("producer_id_quota", (
            f"{unwritten} while reaction: {reaction} is in force, which would switch to {default} (to mean it, "
            "write producer_id_quota: {} for every setting at its default, or the reaction)")))
    return errors


def _entries(n: int) -> str:
    return "1 quota entry is" if n == 1 else f"{n} quota entries are"


def _targets(config: Config) -> str:
    return ", ".join(spec.target for spec in config.rate_limiters)


class Reloadable(Protocol):
    """What the watcher uses of the proxy: the configuration in force and a way to replace it
    (ConfigError: refused, nothing changed)."""

    config: Config

    def reload(self, config: Config) -> None: ...


class ConfigWatcher:
    """Applies changes of the configuration file to a running ``server`` (``server.reload``).

    Guarantees, for every reload (a change seen by polling, :meth:`poll_at`, or SIGHUP,
    :meth:`reload_now`):

    * an invalid file is logged at ERROR with its YAML path and changes nothing;
    * a file that leaves out a section a reload applies (``quotas``, ``rate_limiters``, ``mode``,
      ``producer_id_quota``), or writes its key with nothing under it, while that section's value
      in force is not its default, is refused at ERROR naming the file and the section: that is
      what a file cut short looks like, and it would silently take away what is in force. Taking
      it away is written out: ``quotas: []``, ``rate_limiters: [...]``, ``mode: enforce``,
      ``producer_id_quota: {}``. A section never written (or in force at its default) may stay
      out. Nothing of a refused file is applied, and its bytes are not taken as in force: the
      file completed, or any later valid one, is applied.

    For changes seen by polling, in addition:

    * the file is read only after its signature (device, inode, mtime, size) has stayed the same
      for ``reload.debounce_ms`` and again after the read: a file being written in place is not
      read half-written, unless its writer pauses for longer than that;
    * it is read once per change (so a refused or invalid version is logged once, not once per
      poll), and applied only when those bytes differ from the ones in force;
    * a missing file is waited for (logged once per disappearance), never applied as empty;
    * with ``reload.require_atomic_rename``, only a file replaced by a rename (a new inode) is
      applied; a change written in place is logged at WARNING and left for SIGHUP.

    SIGHUP reads the file at once, whatever changed, and answers each signal (a refusal is logged
    again). The ``reload:`` settings are the ones read at start; a reload does not change them.
    """

    IDLE_POLL_S = 1.0
    MIN_POLL_S = 0.05

    def __init__(self, server: Reloadable, loaded: ConfigFile) -> None:
        self.server = server
        self.path = loaded.path
        settings = loaded.config.reload
        self.debounce_s = settings.debounce_ms / 1000
        self.require_atomic_rename = settings.require_atomic_rename
        self._seen = loaded.signature  # the last signature acted on (None: the file was gone)
        self._digest = loaded.digest  # of the bytes whose configuration is in force
        self._settling: tuple[Signature, float] | None = None  # a change: its signature, seen since
        self._missing = False

    @property
    def poll_interval_s(self) -> float:
        """Seconds to the next poll: shorter while a change settles, so that the debounce, not
        the polling, sets how soon a finished write is applied."""
        if self._settling is None:
            return self.IDLE_POLL_S
        return max(self.debounce_s / 4, self.MIN_POLL_S)

    def poll_at(self, now_s: float) -> bool:
        """One look at the file at monotonic ``now_s``; True when a change was applied."""
        current = signature(self.path)
        if current is None:
            self._on_missing()
            return False
        self._missing = False
        if current == self._seen:
            self._settling = None
            return False
        if self._settling is None or self._settling[0] != current:
            self._settling = (current, now_s)  # a new change, or the same one still being written
        if now_s - self._settling[1] < self.debounce_s:
            return False
        self._settling = None
        previous, self._seen = self._seen, current
        if self.require_atomic_rename and previous is not None and _same_inode(previous, current):
            log.warning("%s written in place; reload.require_atomic_rename is on: send SIGHUP to apply", self.path)
            return False
        return self._apply_stable(current)

    def reload_now(self) -> bool:
        """SIGHUP: reads and applies the file at once, whatever changed (the operator asked)."""
        log.info("SIGHUP: reloading %s", self.path)
        self._settling = None
        try:
            loaded = read_config_file(self.path)
        except ConfigError as exc:
            return self._rejected(exc)
        self._seen = loaded.signature
        return self._apply(loaded)

    def _on_missing(self) -> None:
        if not self._missing:
            log.warning("%s is gone; waiting for it to come back, the configuration in force stays", self.path)
        self._missing = True
        self._seen = self._settling = None  # whatever comes back is a change

    def _apply_stable(self, current: Signature) -> bool:
        try:
            loaded = read_config_file(self.path)
        except ConfigError as exc:
            if signature(self.path) != current:
                return False  # written again while read: the next polls settle the new change
            return self._rejected(exc)
        if loaded.signature != current or signature(self.path) != current:
            return False  # written again meanwhile: the next polls settle the new change
        if loaded.digest == self._digest:
            log.info("%s changed on disk but holds the configuration in force: nothing to reload", self.path)
            return False
        return self._apply(loaded)

    def _apply(self, loaded: ConfigFile) -> bool:
        unwritten = unwritten_in_force(self.server.config, loaded)
        if unwritten:
            log.error("reload of %s refused, the configuration in force stays: %s", self.path,
                      "; ".join(str(exc) for exc in unwritten))
            return False
        try:
            self.server.reload(loaded.config)
        except ConfigError as exc:
            return self._rejected(exc)
        self._digest = loaded.digest
        return True

    def _rejected(self, exc: ConfigError) -> bool:
        log.error("reload of %s rejected, the previous configuration stays in force: %s", self.path, exc)
        return False


def _same_inode(a: Signature, b: Signature) -> bool:
    """True when the path still names the same file: written in place, not replaced by a rename."""
    return (a.device, a.inode) == (b.device, b.inode)


async def watch_config(watcher: ConfigWatcher, clock: Callable[[], float] = time.monotonic) -> None:
    """Polls the file for ever (no inotify needed): every second, faster while a change settles."""
    while True:
        await asyncio.sleep(watcher.poll_interval_s)
        try:
            watcher.poll_at(clock())
        except Exception:  # one failed reload must not end the watching for the proxy's lifetime
            log.exception("reload of %s failed; still watching it", watcher.path)
