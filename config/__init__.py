"""YAML configuration, validated once into frozen dataclasses."""

from .loader import ConfigError, ConfigErrors, load_config, parse_config
from .model import Config, ListenConfig, MetricsConfig, UpstreamConfig

__all__ = [
    "Config",
    "ConfigError",
    "ConfigErrors",
    "ListenConfig",
    "MetricsConfig",
    "UpstreamConfig",
    "load_config",
    "parse_config",
]
