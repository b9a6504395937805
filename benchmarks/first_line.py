"""Seconds from launching `python -m mcore_dpo.train` to its first line of output ("preparing
N workers (...) on a local Ray cluster; loading ..."). Each launch is killed as soon as that line
arrives, so nothing is trained and no Ray cluster is left behind.

    python benchmarks/first_line.py --repeats 5
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]


def time_to_first_line(*, args: list[str]) -> tuple[float, str]:
    with tempfile.TemporaryDirectory() as tmp:
        start = time.monotonic()
        proc = subprocess.Popen([sys.executable, "-m", "mcore_dpo.train", *args, "--output-dir", f"{tmp}/run"],
                                cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                                start_new_session=True)
        line = proc.stdout.readline()
        elapsed = time.monotonic() - start
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    return elapsed, line.strip()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    opts = parser.parse_args()
    times, line = [], ""
    for _ in range(opts.repeats):
        elapsed, line = time_to_first_line(args=["--tp", "2", "--pp", "2", "--max-steps", "1"])
        times.append(elapsed)
    print(f"first line: {line!r}")
    print(f"seconds to the first line: median {statistics.median(times):.2f} (min {min(times):.2f}, "
          f"max {max(times):.2f}) over {len(times)} launches; load average {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
