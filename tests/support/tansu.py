"""The real Tansu broker the tests run against (see proxy.local_broker for how it starts)."""

from proxy.local_broker import TANSU_VERSION, LocalTansu as TansuBroker, tansu_binary, tansu_version

__all__ = ["TANSU_VERSION", "TansuBroker", "tansu_binary", "tansu_version"]
