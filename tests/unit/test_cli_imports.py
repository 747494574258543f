"""The proxy's command line loads only what running the proxy needs."""

from __future__ import annotations

import subprocess
import sys


def test_running_the_proxy_does_not_load_the_pipeline_libraries():
    # numpy alone would add about 30 MB of memory and an idle BLAS thread to every proxy.
    code = ("import sys; from proxy.app.cli import _parser; _parser(); "
            "print(sorted(m for m in ('numpy', 'pyarrow', 'pandas', 'pyspark') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
