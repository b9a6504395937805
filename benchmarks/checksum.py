"""The cost of checkpoint checksums: XXH3-64 (checkpoint_convert/integrity.py) over a ~1 GB
file, as MB/s, median of 3 runs (docs/BENCHMARKS.md §17).

    python benchmarks/checksum.py                 # 1 GiB in a temporary directory
    python benchmarks/checksum.py --mib 4096 --dir /scratch

The file is written first, so the runs read it from the page cache: the figure is the hash's
own cost (CPU). A checkpoint that is not in the cache costs one read of its files on top.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

from checkpoint_convert.integrity import file_checksum


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=1024, help="file size in MiB (default 1024)")
    parser.add_argument("--dir", default=None, help="where to write the file (default: the system's temp dir)")
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        path = Path(tmp) / "data.bin"
        block = os.urandom(2**20)
        with open(path, "wb") as fh:
            for _ in range(args.mib):
                fh.write(block)
        size = path.stat().st_size
        file_checksum(path)  # warm the page cache
        seconds = []
        for _ in range(args.runs):
            start = time.perf_counter()
            file_checksum(path)
            seconds.append(time.perf_counter() - start)
    median = statistics.median(seconds)
    print(f"xxh3_64 over {size / 1e6:.0f} MB (page cache): {size / 1e6 / median:.0f} MB/s "
          f"(median of {args.runs}: {', '.join(f'{s:.3f}' for s in seconds)} s)")


if __name__ == "__main__":
    main()
