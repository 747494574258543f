"""A file's signature: what a stat says about its identity and content, to notice a change
without reading it."""

from __future__ import annotations

import os
from typing import NamedTuple


class Signature(NamedTuple):
    device: int
    inode: int
    mtime_ns: int
    size: int


def signature(path: str) -> Signature | None:
    """The file's signature (through symlinks, as Kubernetes' ConfigMap and Secret volumes swap),
    None when absent."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return Signature(st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size)
