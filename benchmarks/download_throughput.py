"""Download throughput: the appliance's downloader against `curl`, from the same fake Hub.

    .venv/bin/python benchmarks/download_throughput.py [--shards 8] [--shard-mib 128]
        [--parallel 4] [--repeats 2] [--dir DIR] [--keep] [--profile]

Generates a checkpoint once (`appliance.testing.checkpoint.write_checkpoint`: the shards plus
the small JSON files), serves it with the fake Hub started as a separate process (`python -m
appliance.testing.fake_hub --warm`; it sends bodies with `sendfile`, and its CPU is not
charged to either client), reads the commit and the file list from its API, then times, in the
same run and from the same server, every file fetched with the same parallelism P:

  curl          `xargs -0 -P P -n 2 curl -sS -f -o OUT URL`, one process per file, into a
                fresh folder: the obvious shell loop, and the figure the target is against
  curl + fsync  the same, each file `sync FILE`ed once curl has it (the appliance makes every
                file durable before it counts it; this line shows what that costs alone)
  appliance     `WeightsService.pull()` to `wait_idle()` with weights.concurrency = P, in a
                fresh state and models folder with a migrated SQLite database, as the daemon
                runs it: the manifest request, every byte sha256-hashed as it arrives, fsync,
                rename, the database records and the final quick check

Before each timed run the destination folder is new and `sync` has written back what earlier
runs left dirty; the source stays in the page cache (it was just written), so the disk is
only written to, as on a real pull. The order of the methods is reversed on every other
repeat, so page-cache and writeback effects favour none. After each run every file is checked
against the source's sha256 (outside the timing), and the appliance's pull must end ready for
the engine.

Figures are per repeat and the median, with the client's CPU per GB (user + system of every
thread, or of every child process for curl; the hub's CPU is printed per run and stays small).
The target is a ratio appliance/curl >= 0.90 (median GB/s over median GB/s).

`--profile` adds one untimed appliance pull under cProfile and prints where the event-loop
thread spends its time, grouped by package, then the top functions (cProfile sees that thread
only: the executor's writes and hashing show up as the waits for them). Nothing is asserted:
this is a measuring instrument, run by hand.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import hashlib
import io
import json
import os
import platform
import pstats
import resource
import shutil
import ssl
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from profiling import profile_group  # beside this script

from appliance.clock import SystemClock
from appliance.config import load_config
from appliance.db.database import Database
from appliance.db.schema import migrate
from appliance.resources import migrations_dir
from appliance.testing.checkpoint import write_checkpoint
from appliance.weights.service import WeightsService

REPO = "moonshotai/Kimi-K3"  # the dev profile's engine.model, so the pull can end "ready"
CHUNK = 8 << 20
TARGET = 0.90
CURL_FSYNC = 'curl -sS -f -o "$0" "$1" && exec sync "$0"'  # sh -c: $0 is the first argument


@dataclass(frozen=True)
class Hub:
    process: subprocess.Popen[str]
    url: str
    commit: str
    files: list[tuple[str, int]]  # (path, size) in the API's order
    log: Path

    def cpu(self) -> float:
        fields = Path(f"/proc/{self.process.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def check_alive(self) -> None:
        """A hub that died would leave the appliance retrying forever: stop the benchmark."""
        if self.process.poll() is not None:
            tail = self.log.read_text(errors="replace")[-2000:]
            raise SystemExit(f"the fake hub exited ({self.process.returncode}) mid-run; "
                             f"the end of its stderr ({self.log}):\n{tail}")

    @property
    def total(self) -> int:
        return sum(size for _, size in self.files)

    def file_url(self, path: str) -> str:
        return f"{self.url}/{REPO}/resolve/{self.commit}/{path}"


@dataclass(frozen=True)
class Run:
    """One timed run: wall seconds, client CPU seconds (user + system, every thread or child
    process of that client) and the fake Hub's CPU seconds meanwhile."""

    seconds: float
    cpu: float
    hub_cpu: float


def own_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def children_cpu() -> float:
    """CPU of reaped children (curl, sh, sync and xargs; the hub is reaped only at the end)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    buffer = bytearray(CHUNK)
    view = memoryview(buffer)
    with path.open("rb", buffering=0) as handle:
        while n := handle.readinto(buffer):
            digest.update(view[:n])
    return digest.hexdigest()


def start_hub(repo_dir: Path, log: Path) -> Hub:
    """The fake Hub as a child process (its stderr into `log`); its URL from the one line it
    prints when ready."""
    with log.open("w") as stderr:
        process = subprocess.Popen(
            [sys.executable, "-m", "appliance.testing.fake_hub", "--repo",
             f"{REPO}={repo_dir}", "--port", "0", "--warm"],
            stdout=subprocess.PIPE, stderr=stderr, text=True)
    assert process.stdout is not None
    line = process.stdout.readline().strip()
    prefix = "fake hub listening on "
    if not line.startswith(prefix):
        process.kill()
        raise SystemExit(f"the fake hub did not start (it said {line!r}; see {log})")
    url = line[len(prefix):]
    with urllib.request.urlopen(  # noqa: S310 - our own loopback server
            f"{url}/api/models/{REPO}/revision/main?blobs=True", timeout=60) as answer:
        info = json.load(answer)
    files = [(s["rfilename"], int(s["size"])) for s in info["siblings"]]
    return Hub(process, url, info["sha"], files, log)


def stop_hub(hub: Hub) -> None:
    hub.process.terminate()
    try:
        hub.process.wait(10)
    except subprocess.TimeoutExpired:
        hub.process.kill()
        hub.process.wait()


def check_same(directory: Path, expected: dict[str, str], who: str) -> None:
    found = {p.name: sha256_of(p) for p in directory.iterdir() if p.is_file()}
    if found != expected:
        wrong = sorted(set(found) ^ set(expected) | {n for n in found.keys() & expected.keys()
                                                      if found[n] != expected[n]})
        raise SystemExit(f"{who}: the files in {directory} differ from the source: {wrong}")


def run_curl(hub: Hub, out: Path, parallel: int, fsync: bool) -> Run:
    """curl fetching every file, P processes at a time, into `out` (new)."""
    out.mkdir()
    listing = b"".join(bytes(out / path) + b"\0" + hub.file_url(path).encode() + b"\0"
                       for path, _ in hub.files)
    command = ["xargs", "-0", "-P", str(parallel), "-n", "2"]
    command += ["sh", "-c", CURL_FSYNC] if fsync else ["curl", "-sS", "-f", "-o"]
    cpu, hub_cpu, started = children_cpu(), hub.cpu(), time.perf_counter()
    done = subprocess.run(command, input=listing, capture_output=True, check=False)
    run = Run(time.perf_counter() - started, children_cpu() - cpu, hub.cpu() - hub_cpu)
    if done.returncode:
        hub.check_alive()
        raise SystemExit(f"curl failed (exit {done.returncode}): "
                         f"{done.stderr.decode(errors='replace')[:500]}")
    return run


def appliance_service(hub: Hub, root: Path, parallel: int) -> tuple[WeightsService, Database]:
    """A fresh dev-profile box under `root` (state, models, a migrated SQLite database)."""
    env = {"APPLIANCE_WEIGHTS_ENDPOINT": hub.url, "APPLIANCE_WEIGHTS_RESERVE_GIB": "0",
           "APPLIANCE_WEIGHTS_CONCURRENCY": str(parallel)}
    config = load_config(dev=True, dev_root=root, env=env)
    db = Database(config.database_url)
    migrate(db, migrations_dir(), config.paths.state_dir / "backups", SystemClock().now())
    return WeightsService(config, db, SystemClock()), db


async def pull(service: WeightsService, hub: Hub) -> Run:
    cpu, hub_cpu, started = own_cpu(), hub.cpu(), time.perf_counter()
    await service.pull(actor="benchmark")
    idle = asyncio.ensure_future(service.wait_idle())
    while not idle.done():
        await asyncio.wait({idle}, timeout=1.0)
        if not idle.done() and hub.process.poll() is not None:
            idle.cancel()
            await service.stop_service()
            hub.check_alive()
    run = Run(time.perf_counter() - started, own_cpu() - cpu, hub.cpu() - hub_cpu)
    view = await service.status()
    await service.stop_service()
    if not view.ready_for_engine or view.commit is None:
        raise SystemExit(f"the appliance's pull did not end ready: {view.activity}: "
                         f"{view.message} {view.hint}")
    return run


def run_appliance(hub: Hub, root: Path, parallel: int,
                  profiler: cProfile.Profile | None = None) -> tuple[Run, Path]:
    """The appliance's pull into a fresh box under `root`; and where the files landed."""
    service, db = appliance_service(hub, root, parallel)
    try:
        if profiler is None:
            run = asyncio.run(pull(service, hub))
        else:
            run = profiler.runcall(asyncio.run, pull(service, hub))
    finally:
        db.dispose()
    return run, service.dir_for(REPO)


def show_profile(profiler: cProfile.Profile, limit: int) -> None:
    stats = pstats.Stats(profiler)
    raw: dict[tuple[str, int, str], tuple[int, int, float, float, object]] = (
        stats.stats)  # type: ignore[attr-defined]
    groups: dict[str, float] = {}
    for (filename, _, function), (_, _, own, _, _) in raw.items():
        group = profile_group(filename, function, idle_label="epoll wait (the loop idle)")
        groups[group] = groups.get(group, 0.0) + own
    whole = sum(groups.values())
    print(f"\ncProfile of one more appliance pull: event-loop thread, {whole:.2f} s, own "
          "time by where it is spent:")
    for group, own in sorted(groups.items(), key=lambda item: -item[1])[:12]:
        print(f"  {own:6.2f} s {own / whole:6.1%}  {group}")
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).strip_dirs().sort_stats("tottime").print_stats(limit)
    print(f"top {limit} functions by own time:")
    print("\n".join(line for line in text.getvalue().splitlines()[4:] if line.strip()))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shards", type=int, default=8)
    parser.add_argument("--shard-mib", type=int, default=128)
    parser.add_argument("--parallel", type=int, default=4, help="files at once, both sides")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--dir", type=Path, help="where to put the checkpoint and the "
                        "downloads (default: a temporary folder; use the models volume to "
                        "measure its disk)")
    parser.add_argument("--keep", action="store_true", help="leave the checkpoint and the "
                        "fake hub's log behind")
    parser.add_argument("--profile", action="store_true", help="then profile one more "
                        "appliance pull with cProfile and print the top functions")
    args = parser.parse_args(argv)
    if min(args.shards, args.shard_mib, args.parallel, args.repeats) < 1:
        parser.error("--shards, --shard-mib, --parallel and --repeats must be at least 1")
    packages = {"curl": "curl", "xargs": "findutils", "sync": "coreutils", "sh": "dash"}
    missing = [tool for tool in packages if shutil.which(tool) is None]
    if missing:
        print(f"the baseline needs {', '.join(missing)}: apt-get install "
              f"{' '.join(sorted({packages[tool] for tool in missing}))}", file=sys.stderr)
        return 2

    if args.dir is not None:
        args.dir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="download-bench-", dir=args.dir))
    curl_version = subprocess.run(["curl", "--version"], capture_output=True, text=True,
                                  check=False).stdout.split(" (")[0]
    hub: Hub | None = None
    rows: dict[str, list[Run]] = {"curl": [], "curl + fsync": [], "appliance": []}
    try:
        source = work / "hub-repo"
        write_checkpoint(source, shards=args.shards, shard_bytes=args.shard_mib << 20)
        expected = {p.name: sha256_of(p) for p in source.iterdir()}
        os.sync()
        hub = served = start_hub(source, work / "fake-hub.log")
        total = served.total
        print(f"{len(hub.files)} files ({args.shards} shards x {args.shard_mib} MiB) = "
              f"{total / 1e9:.2f} GB in {work}; parallel {args.parallel}; "
              f"{args.repeats} repeats")
        print(f"cpus {os.cpu_count()}, {platform.machine()}, Python "
              f"{platform.python_version()}, {ssl.OPENSSL_VERSION}; {curl_version}; "
              f"fake hub at {hub.url} (pid {hub.process.pid})")

        def curl(fsync: bool) -> Callable[[int], Run]:
            def one(n: int) -> Run:
                out = work / f"curl-{n}"
                run = run_curl(served, out, args.parallel, fsync)
                check_same(out, expected, "curl")
                shutil.rmtree(out)
                return run
            return one

        def appliance(n: int) -> Run:
            root = work / f"appliance-{n}"
            run, landed = run_appliance(served, root, args.parallel)
            check_same(landed, expected, "appliance")
            shutil.rmtree(root)
            return run

        methods: list[tuple[str, Callable[[int], Run]]] = [
            ("curl", curl(False)), ("curl + fsync", curl(True)), ("appliance", appliance)]
        count = 0
        for repeat in range(args.repeats):
            order = methods if repeat % 2 == 0 else methods[::-1]
            for name, method in order:
                os.sync()
                count += 1
                run = method(count)
                rows[name].append(run)
                print(f"  repeat {repeat + 1}: {name:<13} {run.seconds:6.2f} s "
                      f"{total / run.seconds / 1e9:6.2f} GB/s, client CPU {run.cpu:5.2f} s, "
                      f"hub CPU {run.hub_cpu:4.2f} s", flush=True)
        if args.profile:
            profiler = cProfile.Profile()
            os.sync()
            run, _ = run_appliance(served, work / "appliance-profiled", args.parallel,
                                   profiler)
            print(f"  profiled:  appliance     {run.seconds:6.2f} s "
                  f"{total / run.seconds / 1e9:6.2f} GB/s (under cProfile, not counted)")
            show_profile(profiler, 20)
    finally:
        if hub is not None:
            stop_hub(hub)
        if args.keep:
            print(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)

    width = max(20, 7 * args.repeats)
    print(f"\n{'method':<13} {'seconds per repeat':>{width}} {'GB/s per repeat':>{width}} "
          f"{'median GB/s':>12} {'CPU s/GB':>9}")
    medians = {}
    for name, runs in rows.items():
        rates = [total / r.seconds / 1e9 for r in runs]
        medians[name] = statistics.median(rates)
        cpu_per_gb = statistics.median(r.cpu for r in runs) / (total / 1e9)
        print(f"{name:<13} {' '.join(f'{r.seconds:6.2f}' for r in runs):>{width}} "
              f"{' '.join(f'{r:6.2f}' for r in rates):>{width}} {medians[name]:>12.2f} "
              f"{cpu_per_gb:>9.2f}")
    ratio = medians["appliance"] / medians["curl"]
    print(f"\nratio appliance/curl = {ratio:.2f} (target >= {TARGET:.2f})"
          f"{'' if ratio >= TARGET else '  BELOW TARGET'}")
    print(f"ratio appliance/(curl + fsync) = "
          f"{medians['appliance'] / medians['curl + fsync']:.2f} (for scale: the cost of "
          "making every file durable, which the appliance must pay)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
