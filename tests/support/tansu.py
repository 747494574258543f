"""The real Tansu broker the tests run against (see proxy.app.local_broker for how it starts)."""

from proxy.app.local_broker import TANSU_VERSION, tansu_binary, tansu_version
from proxy.app.local_broker import LocalTansu as TansuBroker

__all__ = ["TANSU_VERSION", "TansuBroker", "tansu_binary", "tansu_version"]
