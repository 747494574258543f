"""What the parts of a closed client connection reach instead of it (proxy.dataplane.connection)."""

from __future__ import annotations

from proxy.dataplane.filters.api import ConnectionActions
from proxy.dataplane.flow import ChannelMute, ReadGate
from proxy.dataplane.inflight import Frame, InFlight
from proxy.dataplane.raw_sasl import RawSasl
from proxy.dataplane.requests import RequestOwner
from proxy.dataplane.response_queue import QueueOwner


class _Closed:
    """What the parts of a closed connection (its FilterContext, response queue and request
    side) reach instead of it: a RequestOwner, QueueOwner and ConnectionActions that is closed,
    and whose every action is a no-op."""

    closed = True
    channel_mute: ChannelMute | None = None
    raw_sasl: RawSasl | None = None
    gate: ReadGate | None = None

    def mute(self, throttle_ms: int) -> None:
        pass

    def uplift_changed(self, uplift: dict[int, int] | None) -> None:
        pass

    def start_raw_sasl(self, mechanism: str | None) -> None:
        pass

    def close(self) -> None:
        pass

    def response_failed(self, exc: Exception) -> None:
        pass

    def reject(self, reason: str, detail: str, drain: bool = False) -> None:
        pass

    def send_upstream(self, out: list[Frame]) -> None:
        pass

    def hold_for_throttle(self, entry: InFlight | None) -> None:
        pass

    def requests_done(self) -> None:
        pass


CLOSED = _Closed()
# The stand-in is each contract it stands in for (mypy checks this line).
_STANDS_IN: tuple[RequestOwner, QueueOwner, ConnectionActions] = (CLOSED, CLOSED, CLOSED)
