"""`python -m appliance.testing.fake_hub`: the FAKE Hugging Face Hub as a process, a test and
demo instrument (see the package docstring for the protocol and the fault specs).

    python -m appliance.testing.fake_hub --repo ORG/NAME=DIR [--repo ...] [--port N]
        [--host 127.0.0.1] [--token T] [--fault SPEC ...] [--request-log FILE.jsonl]
        [--page-size N] [--warm]

Prints exactly one line to stdout when ready, `fake hub listening on http://127.0.0.1:PORT`
(`--port 0`, the default, picks a free port). SIGTERM and SIGINT stop it: exit 0. A bad
argument or fault spec: the message on stderr, exit 2.
"""

from __future__ import annotations

import argparse
import ipaddress
import signal
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from types import FrameType

from appliance.testing.fake_hub.faults import FORMS
from appliance.testing.fake_hub.hub import DEFAULT_PAGE_SIZE, FakeHub


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m appliance.testing.fake_hub",
        description="A FAKE Hugging Face Hub (test and demo instrument) serving folders as "
                    "model repos over plain HTTP.",
        epilog="fault specs: " + "; ".join(FORMS.values()))
    parser.add_argument("--repo", action="append", required=True, metavar="ORG/NAME=DIR",
                        help="serve DIR as the model repo ORG/NAME (repeatable)")
    parser.add_argument("--port", type=int, default=0, help="0 (default) picks a free port")
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to bind (default 127.0.0.1; anything else is explicit)")
    parser.add_argument("--token", help="require Authorization: Bearer TOKEN on /api and "
                        "/resolve")
    parser.add_argument("--fault", action="append", default=[], metavar="SPEC",
                        help="inject a fault (repeatable)")
    parser.add_argument("--request-log", type=Path, metavar="FILE.jsonl",
                        help="append every request as a JSON line (flushed per line)")
    parser.add_argument("--page-size", type=int, default=DEFAULT_PAGE_SIZE,
                        help="tree listing page size (default 1000, as the Hub)")
    parser.add_argument("--warm", action="store_true",
                        help="hash every file before announcing readiness (otherwise the "
                        "first request that needs the commit hashes them)")
    return parser


def _repos(parser: argparse.ArgumentParser, values: list[str]) -> dict[str, Path]:
    repos: dict[str, Path] = {}
    for value in values:
        repo_id, sep, folder = value.partition("=")
        if not sep or not repo_id or not folder:
            parser.error(f"--repo {value!r}: expected ORG/NAME=DIR")
        if repo_id in repos:
            parser.error(f"--repo {repo_id} given twice")
        repos[repo_id] = Path(folder)
    return repos


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    repos = _repos(parser, args.repo)
    try:
        hub = FakeHub(repos, host=args.host, port=args.port, token=args.token,
                      faults=args.fault, request_log=args.request_log,
                      page_size=args.page_size)
    except (ValueError, OSError) as exc:  # FaultSpecError is a ValueError
        parser.error(str(exc))
    stopping = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stopping.set()

    # Before any slow work (--warm), so an early SIGTERM still ends in a clean exit 0.
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    for repo_id, folder in repos.items():
        print(f"fake hub (a test and demo instrument): serving {repo_id} from {folder}",
              file=sys.stderr)
        if args.warm:
            hub.commit(repo_id)
    if not _is_loopback(args.host):
        print(f"fake hub: WARNING: bound to {args.host}, not loopback: this test instrument "
              "serves its folders to anyone who can reach that address", file=sys.stderr)
    try:
        hub.start()
    except OSError as exc:
        print(f"fake hub: cannot listen on {args.host}:{args.port}: {exc}", file=sys.stderr)
        return 1
    print(f"fake hub listening on {hub.url}", flush=True)
    try:
        # A timed wait, so the signal handler runs promptly in this (main) thread.
        while not stopping.wait(0.5):
            pass
    finally:
        hub.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
