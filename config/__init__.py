"""YAML configuration, validated once into frozen dataclasses."""

from .model import Config, ListenConfig, MetricsConfig, UpstreamConfig
from .loader import ConfigError, load_config, parse_config

__all__ = [
    "Config",
    "ConfigError",
    "ListenConfig",
    "MetricsConfig",
    "UpstreamConfig",
    "load_config",
    "parse_config",
]
