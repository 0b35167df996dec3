"""Full-verification throughput: the appliance's hasher against coreutils `sha256sum`.

    .venv/bin/python benchmarks/verify_throughput.py [--files 8] [--size-mib 256]
        [--workers 2] [--dir DIR] [--repeat 3] [--cold] [--keep]

Writes `--files` files of random bytes once (hashing them as they are written, which gives
the reference digests of the manifest), then times, in the same run and on the same files:

  appliance   hash_files(workers=W, drop_cache=False), the full tier of appliance.weights
  sha256sum   `xargs -0 -P W -n 1 sha256sum`, the same parallelism, one file per process

Warm runs (always): before each timed run every file is read once so it sits in the page
cache; this measures hashing, not the disk. Cold runs (`--cold`): before each timed run every
file is dropped from the page cache (posix_fadvise DONTNEED; the files were fsynced, so the
pages are clean and really go), and the appliance runs as in production, drop_cache=True.
Cold numbers on a virtual disk show trends only.

Each figure is the median of `--repeat` runs (best in brackets). The target is a ratio
appliance/sha256sum >= 1.0: the appliance must never be slower than the obvious shell loop.
Nothing is asserted: this is a measuring instrument, run by hand.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import platform
import shutil
import ssl
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from appliance.weights.hashing import hash_files
from appliance.weights.manifest import ManifestFile

CHUNK = 8 << 20


def write_files(directory: Path, count: int, size: int) -> list[tuple[Path, ManifestFile]]:
    """Random files, each hashed while it is written and fsynced (so DONTNEED can drop it)."""
    items = []
    for n in range(count):
        path = directory / f"bench-{n:03d}.bin"
        digest = hashlib.sha256()
        with path.open("wb") as handle:
            left = size
            while left:
                block = os.urandom(min(CHUNK, left))
                handle.write(block)
                digest.update(block)
                left -= len(block)
            handle.flush()
            os.fsync(handle.fileno())
        items.append((path, ManifestFile(path.name, size, sha256=digest.hexdigest())))
    return items


def warm(paths: list[Path]) -> None:
    buffer = bytearray(CHUNK)
    for path in paths:
        with path.open("rb", buffering=0) as handle:
            while handle.readinto(buffer):
                pass


def drop(paths: list[Path]) -> None:
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def run_appliance(items: list[tuple[Path, ManifestFile]], workers: int, cold: bool) -> None:
    results = hash_files(items, workers=workers, drop_cache=cold)
    bad = [r.message for r in results if not r.ok]
    if bad:
        raise SystemExit("appliance hash_files disagrees with the written bytes:\n"
                         + "\n".join(bad))


def run_sha256sum(items: list[tuple[Path, ManifestFile]], workers: int) -> None:
    listing = b"".join(bytes(path) + b"\0" for path, _ in items)
    out = subprocess.run(["xargs", "-0", "-P", str(workers), "-n", "1", "sha256sum"],
                         input=listing, capture_output=True, check=True).stdout.decode()
    found = {Path(line.split("  ", 1)[1]).name: line.split("  ", 1)[0]
             for line in out.splitlines() if line}
    expected = {file.path: file.sha256 for _, file in items}
    if found != expected:
        raise SystemExit(f"sha256sum's digests differ from the written bytes: {found}")


def timed(runs: int, prepare: Callable[[], None], body: Callable[[], None]) -> list[float]:
    seconds = []
    for _ in range(runs):
        prepare()
        started = time.perf_counter()
        body()
        seconds.append(time.perf_counter() - started)
    return seconds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--files", type=int, default=8)
    parser.add_argument("--size-mib", type=int, default=256)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--dir", type=Path, help="where to write the files (default: a "
                        "temporary folder; use the models volume to measure its disk)")
    parser.add_argument("--cold", action="store_true", help="also time with the page cache "
                        "dropped before each run")
    parser.add_argument("--keep", action="store_true", help="leave the files behind")
    args = parser.parse_args(argv)
    if shutil.which("sha256sum") is None or shutil.which("xargs") is None:
        print("sha256sum and xargs are needed for the baseline", file=sys.stderr)
        return 1

    size = args.size_mib << 20
    total = args.files * size
    if args.dir is not None:
        args.dir.mkdir(parents=True, exist_ok=True)
    directory = Path(tempfile.mkdtemp(prefix="verify-bench-", dir=args.dir))
    coreutils = subprocess.run(["sha256sum", "--version"], capture_output=True,
                               text=True, check=False).stdout.splitlines()[:1]
    print(f"{args.files} files x {args.size_mib} MiB = {total / 1e9:.2f} GB in {directory}; "
          f"workers {args.workers}; median of {args.repeat} (best)")
    print(f"cpus {os.cpu_count()}, {platform.machine()}, Python {platform.python_version()}, "
          f"{ssl.OPENSSL_VERSION}; {coreutils[0] if coreutils else 'sha256sum ?'}")
    try:
        items = write_files(directory, args.files, size)
        paths = [path for path, _ in items]
        rows: list[tuple[str, list[float]]] = [
            ("appliance (warm)", timed(args.repeat, lambda: warm(paths),
                                       lambda: run_appliance(items, args.workers, False))),
            ("sha256sum (warm)", timed(args.repeat, lambda: warm(paths),
                                       lambda: run_sha256sum(items, args.workers))),
        ]
        if args.cold:
            rows += [
                ("appliance (cold)", timed(args.repeat, lambda: drop(paths),
                                           lambda: run_appliance(items, args.workers, True))),
                ("sha256sum (cold)", timed(args.repeat, lambda: drop(paths),
                                           lambda: run_sha256sum(items, args.workers))),
            ]
    finally:
        if not args.keep:
            shutil.rmtree(directory, ignore_errors=True)

    print(f"\n{'method':<18} {'seconds':>16} {'GB/s':>14}")
    medians = {}
    for name, seconds in rows:
        median = medians[name] = statistics.median(seconds)
        print(f"{name:<18} {median:>7.2f} ({min(seconds):>6.2f}) "
              f"{total / median / 1e9:>6.2f} ({total / min(seconds) / 1e9:>5.2f})")
    for state in ("warm", "cold"):
        ours, theirs = medians.get(f"appliance ({state})"), medians.get(f"sha256sum ({state})")
        if ours and theirs:
            print(f"ratio appliance/sha256sum ({state}): {theirs / ours:.2f}x "
                  f"(target >= 1.0)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
