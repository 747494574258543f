"""Runs pytest while every core is kept busy, as a loaded CI machine would be: ``make test-stress``.

    python -m tests.under_load [--runs N] [--hogs N] [pytest arguments...]

Starts ``--hogs`` CPU hogs (default: one per core, busy loops at nice 0, as busy as the tests
themselves), runs pytest ``--runs`` times in a row with the given arguments (default: the whole
suite), and stops the hogs by their pids however the runs end. Prints each run's exit status and
wall time; exits non-zero when any run failed. A test that passes here does not depend on having
the machine to itself.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

HOG = "while True: pass"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.under_load", description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=3, help="pytest runs in a row (default 3)")
    parser.add_argument("--hogs", type=int, default=os.cpu_count() or 2,
                        help="busy-loop processes kept running meanwhile (default: one per core)")
    args, pytest_args = parser.parse_known_args(argv)
    hogs = [subprocess.Popen([sys.executable, "-c", HOG]) for _ in range(args.hogs)]
    print(f"under load: {args.hogs} CPU hogs (pids {' '.join(str(h.pid) for h in hogs)}), {args.runs} run(s)",
          flush=True)
    results: list[tuple[int, float]] = []
    try:
        for n in range(1, args.runs + 1):
            started = time.monotonic()
            rc = subprocess.call([sys.executable, "-m", "pytest", *pytest_args])
            results.append((rc, time.monotonic() - started))
            print(f"under load: run {n} of {args.runs}: exit {rc} in {results[-1][1] / 60:.1f} min", flush=True)
    finally:
        for h in hogs:
            h.kill()
        for h in hogs:
            h.wait()
    failed = [n for n, (rc, _) in enumerate(results, 1) if rc != 0]
    print(f"under load: {len(results) - len(failed)} of {len(results)} run(s) green"
          + (f"; failed: run {', '.join(map(str, failed))}" if failed else ""), flush=True)
    return 1 if failed or len(results) < args.runs else 0


if __name__ == "__main__":
    sys.exit(main())
