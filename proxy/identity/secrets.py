"""Secrets the configuration names by file or environment variable (never inline in the YAML).

Read when they are used, so a password rotated in its file or a refreshed token is picked up by
the next connection; a secret that cannot be read is a ConfigError naming the YAML path, and
its value never appears in an error or a log line.
"""

from __future__ import annotations

import os

from config import ConfigError


def read_secret(path: str, file_key: str, file: str | None, env_key: str, env: str | None) -> str | None:
    """The secret from ``file`` (its trailing newline dropped) or the environment variable
    ``env``; None when neither is configured. ``path`` is the YAML path of the section."""
    if file is not None:
        try:
            with open(file, encoding="utf-8") as f:
                value = f.read().rstrip("\r\n")
        except OSError as exc:
            raise ConfigError(f"{path}.{file_key}", f"cannot read {file}: {exc.strerror}") from exc
        except UnicodeDecodeError as exc:
            raise ConfigError(f"{path}.{file_key}", f"{file} is not UTF-8 text") from exc
        if not value:
            raise ConfigError(f"{path}.{file_key}", f"{file} is empty")
        return value
    if env is not None:
        from_env = os.environ.get(env)
        if not from_env:
            raise ConfigError(f"{path}.{env_key}", f"environment variable {env} is not set or empty")
        return from_env
    return None
