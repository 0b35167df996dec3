"""`make demo-cell`: a cell of three appliances on this one machine, with no GPU (issue 17).

A demo instrument, not production. Three boxes, each with its own folder under
`./.appliance-cell/` (its `appliance.toml`, state, models and logs: the `--dev` profile rooted
there), its own console port, daemon (a child process: `python -m appliance.testing.demo_cell
box NAME`), engine emulator (each daemon's ProcessRunner starts it) and eight pretend GPUs
(its own fake GPU file: a shared one would make each preflight see the other boxes' engines
as foreign processes and refuse):

- `head`, role `prefill`: its daemon heads the cell and starts the REAL `sglang-router` (the
  dev venv's, from the spec it writes; ProcessRouterRunner), and its gateway (`python -m
  appliance --dev --config HEAD gateway`, a child process) is the users' endpoint;
- `decode-1`, `decode-2`, role `decode`: members the head drives through their peer API.

No Hub pull: each box gets a small generated checkpoint (its tokenizer.json is one the router
loads), imported and proven through the real WeightsService with its manifest. The head's
engine is asked to run on the first start (demo.want_engine_running_once); each member joins
through the daemons' real admin API (a join token on the member, `POST
/api/v1/cell/members` with role decode on the head, which hands the member its engine key),
and only then are the members' engines started, so they run with the head's key (a member
engine started before the hand-over keeps its own key until it restarts, and the head would
not count it ready). Three pretend users (demo_traffic) chat through the head's gateway.

Ctrl-C stops everything it started, unlike `make demo`: the pretend users, the gateway, the
engines (each stopped through its daemon), the daemons and the router. The state stays: the
next run finds the members joined and starts the engines again (an engine left running by a
killed demo is adopted). `--smoke` (tests) starts everything on free ports with short clocks,
waits until one chat completion goes through the head's gateway and the cell, prints a
one-line verdict, stops everything and exits 0, or 1 naming what never came up.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any, Final

import httpx

from appliance.cell.router import METRICS_PORT
from appliance.cell.router_runner import ProcessRouterRunner
from appliance.engine.cli import checked, daemon_api
from appliance.engine.runner import ProcessRunner
from appliance.errors import ApplianceError
from appliance.testing.demo_accounts import VIEWER
from appliance.testing.demo_cell_boxes import (
    BOXES,
    Box,
    Layout,
    Login,
    box_config,
    free_port,
    moved_ports,
    plan_layout,
    port_free,
    port_picker,
    prepare_box,
    read_layout,
    run_box,
)
from appliance.testing.demo_curl import curl_example

DEFAULT_ROOT: Final = Path(".appliance-cell")
LOAD_SECONDS: Final = {"demo": "20", "smoke": "1"}  # the emulator's "90-minute" start
UP_SECONDS: Final = 90.0  # a daemon answering /healthz
STOP_SECONDS: Final = 60.0  # each shutdown step


# --- the child processes ------------------------------------------------------------------------

@dataclass
class Child:
    name: str
    process: subprocess.Popen[bytes]
    log: Path


def start_child(name: str, argv: Sequence[str], log: Path, env: dict[str, str]) -> Child:
    """A child in its own session (a terminal's Ctrl-C reaches only the demo, which stops its
    children in order), its output appended to `log`."""
    with log.open("ab") as out:
        process = subprocess.Popen(list(argv), stdin=subprocess.DEVNULL, stdout=out,
                                   stderr=subprocess.STDOUT, env=env, start_new_session=True)
    return Child(name, process, log)


def stop_child(child: Child) -> None:
    """SIGTERM (each of ours shuts down gracefully on it), then SIGKILL if it lingers."""
    if child.process.poll() is None:
        child.process.terminate()
    try:
        child.process.wait(timeout=STOP_SECONDS)
    except subprocess.TimeoutExpired:
        child.process.kill()
        child.process.wait(timeout=10)


def become_subreaper() -> None:
    """Orphans of our children (an engine or the router whose daemon ended first) become ours,
    so that `reap_orphans` ends them for good: some hosts' init (a container's) never reaps,
    and they would stay as zombies."""
    if sys.platform == "linux":
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER


def reap_orphans() -> None:
    with contextlib.suppress(ChildProcessError):
        while os.waitpid(-1, os.WNOHANG)[0] != 0:
            pass


def tail(path: Path, lines: int = 15) -> str:
    try:
        text = path.read_text(errors="replace").splitlines()[-lines:]
    except OSError:
        return f"    ({path} cannot be read)"
    return "\n".join("    " + line for line in text)


# --- talking to the daemons (their admin API, as the CLI does) ----------------------------------

def api_call(box: Box, command: str, method: str, path: str,
             body: dict[str, Any] | None = None) -> Any:
    """One call to a box's daemon with a short token of `command`'s role (daemon_api)."""
    with daemon_api(box_config(box), command) as api:
        answer = api.request(method, path, json=body)
        if answer.status_code < 400 and isinstance(answer.json(), list):
            return answer.json()
        return checked(answer, "demo_cell")


def wait_daemons(children: dict[str, Child], layout: Layout, up: set[str]) -> None:
    """Until each box's daemon answers /healthz, its name then added to `up` (only those are
    stopped and cleaned up after: a daemon that exited at once may have found another demo
    on the same folder, whose engines are not ours to stop)."""
    deadline = time.monotonic() + UP_SECONDS
    waiting = list(layout.boxes)
    while waiting:
        box = waiting[0]
        child = children[box.name]
        if child.process.poll() is not None:
            raise ApplianceError(
                "demo_cell_daemon", f"{box.name}'s daemon exited ({child.process.returncode}) "
                f"before it answered; its log {child.log} ends with:\n{tail(child.log)}",
                f"fix what it says, or delete {layout.root} to start over")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{box.url}/healthz", timeout=2).status_code == 200:
                up.add(waiting.pop(0).name)
                continue
        if time.monotonic() > deadline:
            raise ApplianceError("demo_cell_daemon", f"{box.name}'s daemon did not answer at "
                                 f"{box.url}/healthz within {UP_SECONDS:.0f} s",
                                 f"see its log {child.log}")
        time.sleep(0.2)


def join_members(layout: Layout) -> list[str]:
    """Each decode box joins the head (skipped when the head already has it at its address):
    a join token made on the member, given to the head with the role. What was done, said."""
    head = layout.head
    known = {m["address"] for m in api_call(head, "cell members", "GET", "/api/v1/cell/members")}
    done = []
    for member in layout.members:
        if member.url in known:
            done.append(f"{member.name} was already a member")
            continue
        token = api_call(member, "cell join-token", "POST", "/api/v1/cell/join-tokens")["token"]
        added = api_call(head, "cell add", "POST", "/api/v1/cell/members",
                         {"address": member.url, "token": token, "role": member.role})
        handed = "handed over" if added["engine_key"]["handed_over"] else "NOT handed over"
        done.append(f"{member.name} joined as member {added['id']} (engine key {handed})")
    return done


def start_engines(layout: Layout) -> None:
    """Ask every stopped engine to start (the members' only now that they hold the head's
    key); one the daemon is already starting or has adopted is left alone."""
    for box in layout.boxes:
        state = api_call(box, "engine status", "GET", "/api/v1/engine")["state"]
        if state in ("stopped", "failed"):
            with contextlib.suppress(ApplianceError):  # started meanwhile: nothing to do
                api_call(box, "engine start", "POST", "/api/v1/engine/start", {})


def stop_engines(boxes: Sequence[Box]) -> None:
    """Stop each box's engine through its daemon (the run ends as a stop, not a crash) and
    wait, bounded, until each says stopped."""
    asked = []
    for box in boxes:
        with contextlib.suppress(ApplianceError, httpx.HTTPError):
            state = api_call(box, "engine status", "GET", "/api/v1/engine")["state"]
            if state != "stopped":
                api_call(box, "engine stop", "POST", "/api/v1/engine/stop", {"confirm": True})
                asked.append(box)
    deadline = time.monotonic() + STOP_SECONDS
    while asked and time.monotonic() < deadline:
        with contextlib.suppress(ApplianceError, httpx.HTTPError):
            if api_call(asked[0], "engine status", "GET", "/api/v1/engine")["state"] == "stopped":
                asked.pop(0)
                continue
        time.sleep(0.3)


def end_leftovers(layout: Layout, boxes: Sequence[Box]) -> list[str]:
    """After the daemons: any engine of `boxes` still running (its daemon died, or did not
    stop it in time) and the head's router. Returns what had to be ended this way."""
    ended = []
    for box in boxes:
        runner = ProcessRunner(box.state_dir)
        ident = runner.find()
        if ident is None:
            continue
        runner.terminate(ident)
        deadline = time.monotonic() + 15
        while runner.find() is not None and time.monotonic() < deadline:
            reap_orphans()
            time.sleep(0.1)
        runner.kill(ident)
        ended.append(f"{box.name}'s engine (pid {ident.pid})")
    if layout.head in boxes:
        asyncio.run(ProcessRouterRunner(layout.head.state_dir, grace=10).stop())
    reap_orphans()
    return ended


# --- what the demo says -------------------------------------------------------------------------

def appliance_command(box: Box, *args: str) -> str:
    program = Path(sys.executable).with_name("appliance")
    launcher = str(program) if program.exists() else f"{sys.executable} -m appliance"
    return " ".join([launcher, "--dev", "--config", str(box.config_path), *args])


def banner(layout: Layout, logins: dict[str, Login], chat_key: str, moved: list[str]) -> str:
    head = layout.head
    lines = ["", f"  Kimi K3 appliance — a cell of three boxes on this machine (demo; state in "
             f"{layout.root}/)", ""]
    for box in layout.boxes:
        login = logins[box.name]
        admin = (f"admin / {login.one_time_password} (one-time: you choose a new password)"
                 if login.one_time_password else "admin / the password you chose")
        lines += [f"  {box.name:<9}{box.role:<8} console {box.url}/   engine emulator on "
                  f"127.0.0.1:{box.engine_port}, 8 pretend GPUs",
                  f"{'':19}log in as {admin}, or {VIEWER} / {login.viewer_password} (no "
                  f"action)",
                  f"{'':19}its daemon's log: {box.directory / 'daemon.log'}"]
    if moved:
        lines.append(f"  Taken ports, so moved: {'; '.join(moved)}.")
    lines += [
        "  (The consoles share the host 127.0.0.1, so a browser keeps one login for all three:",
        "  use a private window per box, or open a member as http://localhost:PORT/.)",
        "",
        f"  Cell:     {head.url}/cell — each member's role, engine state and GPUs, the router's",
        "            view of each engine (healthy, circuit breaker, running requests), the",
        "            capacity left and the traffic. The head's daemon runs the REAL sglang-router",
        f"            on 127.0.0.1:{layout.router_port} (log: "
        f"{head.state_dir / 'router' / 'router.log'}).",
        f"  Gateway:  {layout.gateway_url}/v1 (the head's; through the router to the head's",
        "            prefill engine and a decode member), for example:",
        *curl_example(layout.gateway_url, chat_key),
        "            Three pretend users chat through it once the cell serves (about a minute).",
        "  Try:      on the Cell page, \"Restart a role, one box at a time\" with decode: each",
        "            decode engine restarts in turn while the users keep being served (Usage);",
        "            Stop… on decode-2's card: the capacity left halves; Start brings it back.",
        "            From a shell (any directory):",
        f"              {appliance_command(head, 'cell', 'status')}",
        f"              {appliance_command(head, 'cell', 'plan')}",
        f"              {appliance_command(head, 'cell', 'rolling-restart', 'decode', '--yes')}",
        "  Stop with Ctrl-C: unlike `make demo` it stops everything it started — the users, the",
        "  gateway, the three engines, the daemons and the router. The members stay joined and",
        f"  the next `make demo-cell` starts the engines again; delete {layout.root} to start "
        "over.",
        "",
    ]
    return "\n".join(lines)


# --- the whole demo -----------------------------------------------------------------------------

class Stop(Exception):
    """SIGTERM, raised in the main thread like Ctrl-C's KeyboardInterrupt."""


def _raise_stop(signum: int, frame: FrameType | None) -> None:
    raise Stop


def _patience(signum: int, frame: FrameType | None) -> None:
    print("demo-cell: already stopping everything; a moment", file=sys.stderr, flush=True)


@dataclass(frozen=True)
class Options:
    root: Path
    smoke: bool
    timeout: float


def open_layout(options: Options) -> tuple[Layout, list[str]]:
    """The cell an earlier run left, or a new one; the ports that had to move, in words."""
    existing = read_layout(options.root)
    if existing is not None:
        return existing, []
    layout = plan_layout(options.root, port_picker(prefer=not options.smoke))
    return layout, [] if options.smoke else moved_ports(layout)


def child_env(options: Options) -> dict[str, str]:
    """The children's environment: no APPLIANCE_* of the developer's shell (each box's
    settings are its appliance.toml), a short emulator start."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("APPLIANCE_")}
    env.setdefault("FAKE_SGLANG_LOAD_SECONDS", LOAD_SECONDS["smoke" if options.smoke else "demo"])
    # A decode engine stopped mid-request fails the prefill's wait in 30 s, not the 60 of
    # cell.bootstrap_timeout_s (which the launch spec sets, over any inherited variable).
    for side in ("BOOTSTRAP", "WAITING"):
        env[f"APPLIANCE_CELL_{side}_TIMEOUT_S"] = "30"
    return env


def run(options: Options) -> int:
    for name in [k for k in os.environ if k.startswith("APPLIANCE_")]:
        print(f"demo-cell: ignoring {name} (each box's settings are in its appliance.toml)",
              file=sys.stderr)
        del os.environ[name]
    become_subreaper()
    options.root.mkdir(parents=True, exist_ok=True)
    layout, moved = open_layout(options)
    logins = {box.name: prepare_box(layout, box) for box in layout.boxes}
    env = child_env(options)
    metrics_port = METRICS_PORT if port_free(METRICS_PORT) and not options.smoke else free_port()
    if metrics_port != METRICS_PORT and not options.smoke:
        moved.append(f"the router's metrics {METRICS_PORT} → {metrics_port}")
    children: dict[str, Child] = {}
    up: set[str] = set()  # the boxes whose daemon answered
    # Ctrl-C and SIGTERM stop everything, even where the launcher ignored SIGINT (a
    # background job of a script): the engines and the router would be left otherwise.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, _raise_stop)
    started = time.monotonic()
    try:
        for box in layout.boxes:
            argv = [sys.executable, "-m", "appliance.testing.demo_cell", "box", box.name,
                    "--root", str(layout.root), "--router-metrics-port", str(metrics_port)]
            children[box.name] = start_child(box.name, argv + ["--fast"] * options.smoke,
                                             box.directory / "daemon.log", env)
        wait_daemons(children, layout, up)
        for line in join_members(layout):
            print(f"demo-cell: {line}", flush=True)
        start_engines(layout)
        head = layout.head
        keys = json.loads((head.state_dir / "demo-api-keys.json").read_text())
        children["gateway"] = start_child(
            "gateway", [sys.executable, "-m", "appliance", "--dev", "--config",
                        str(head.config_path), "gateway"], head.directory / "gateway.log", env)
        if options.smoke:
            return smoke(layout, keys["chat"], children, options.timeout, started)
        children["traffic"] = start_child(
            "traffic", [sys.executable, "-m", "appliance.testing.demo_traffic",
                        layout.gateway_url, str(head.state_dir / "demo-api-keys.json")],
            head.directory / "traffic.log", env)
        print(banner(layout, logins, keys["chat"], moved), flush=True)
        return watch(layout, children, started)
    except (KeyboardInterrupt, Stop):
        return 0
    except ApplianceError as exc:
        print(f"demo-cell: {exc.as_text()}", file=sys.stderr, flush=True)
        return exc.exit_code
    finally:
        signal.signal(signal.SIGINT, _patience)
        signal.signal(signal.SIGTERM, _patience)
        print(shut_down(layout, children, up), flush=True)


def watch(layout: Layout, children: dict[str, Child], started: float) -> int:
    """Until Ctrl-C: say once when the cell first serves; end if a child dies."""
    served = False
    while True:
        for child in children.values():
            if child.process.poll() is not None:
                print(f"demo-cell: {child.name} exited ({child.process.returncode}); its log "
                      f"{child.log} ends with:\n{tail(child.log)}", file=sys.stderr, flush=True)
                return 1
        if not served:
            with contextlib.suppress(httpx.HTTPError, ValueError):
                body = httpx.get(f"{layout.gateway_url}/health", timeout=2).json()
                if (body.get("cell") or {}).get("serving"):
                    served = True
                    print(f"demo-cell: the cell serves ({time.monotonic() - started:.0f} s "
                          f"after start): {body['admission']['words']}", flush=True)
        time.sleep(2)


def smoke(layout: Layout, key: str, children: dict[str, Child], timeout: float,
          started: float) -> int:
    """Until one chat completion goes through the head's gateway while the head says the cell
    serves (bounded by `timeout`); the verdict in one line."""
    deadline = started + timeout
    last = "no answer yet"
    while time.monotonic() < deadline:
        for child in children.values():
            if child.process.poll() is not None:
                print(f"demo-cell smoke: FAILED: {child.name} exited "
                      f"({child.process.returncode}); its log ends with:\n{tail(child.log)}",
                      flush=True)
                return 1
        try:
            reply = httpx.post(f"{layout.gateway_url}/v1/chat/completions", timeout=30,
                               headers={"Authorization": f"Bearer {key}"},
                               json={"model": "kimi-k3", "max_tokens": 4, "messages": [
                                   {"role": "user", "content": "hello, cell"}]})
            health = httpx.get(f"{layout.gateway_url}/health", timeout=5).json()
        except (httpx.HTTPError, ValueError) as exc:
            last = f"the gateway: {exc}"
        else:
            through_cell = bool((health.get("cell") or {}).get("serving"))
            if reply.status_code == 200 and through_cell:
                text = reply.json()["choices"][0]["message"]["content"]
                print(f"demo-cell smoke: OK: a chat completion ({text!r}) went through the "
                      f"head's gateway and the cell's router to the head's prefill engine and a "
                      f"decode member, {time.monotonic() - started:.0f} s after start",
                      flush=True)
                return 0
            last = f"the gateway answered {reply.status_code}: {reply.text[:300]}"
        time.sleep(0.5)
    print(f"demo-cell smoke: FAILED: no chat completion went through the cell within "
          f"{timeout:.0f} s; {what_is_missing(layout)}; last, {last}", flush=True)
    return 1


def what_is_missing(layout: Layout) -> str:
    """Each engine's state and the head's own reason, for a smoke that did not serve."""
    said = []
    for box in layout.boxes:
        try:
            said.append(f"{box.name}'s engine is "
                        f"{api_call(box, 'engine status', 'GET', '/api/v1/engine')['state']}")
        except (ApplianceError, httpx.HTTPError) as exc:
            said.append(f"{box.name}'s daemon does not say ({exc})")
    with contextlib.suppress(ApplianceError, httpx.HTTPError):
        view = api_call(layout.head, "cell status", "GET", "/api/v1/cell")
        said.append(f"the head says: {json.dumps(view)[:600]}")
    return "; ".join(said)


def shut_down(layout: Layout, children: dict[str, Child], up: set[str]) -> str:
    """Everything the demo started, in order: users and gateway, the engines through their
    daemons, the daemons, then whatever is left (the router; an engine a daemon did not
    stop). What was stopped, in words."""
    for name in ("traffic", "gateway"):
        if name in children:
            stop_child(children[name])
    ours = [box for box in layout.boxes if box.name in up]
    stop_engines([box for box in ours if children[box.name].process.poll() is None])
    daemons = [children[b.name] for b in layout.boxes if b.name in children]
    for child in daemons:  # all at once, then each waited for
        if child.process.poll() is None:
            child.process.terminate()
    for child in daemons:
        stop_child(child)
    forced = end_leftovers(layout, ours)
    said = ("demo-cell stopped: everything it started has ended (the pretend users, the "
            "gateway, the engines, the daemons and the cell's router); nothing is left running.")
    if forced:
        said += f" (Ended without their daemon: {', '.join(forced)}.)"
    return (f"{said}\nThe state stays in {layout.root}: the members stay joined, and the next "
            f"`make demo-cell` starts the engines again. Delete {layout.root} to start over.")


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m appliance.testing.demo_cell",
                                     description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--root", type=Path, default=DEFAULT_ROOT,
                        help="the cell's folder (default ./.appliance-cell)")
    parser.add_argument("--smoke", action="store_true",
                        help="free ports, short clocks; exit once one chat went through the cell")
    parser.add_argument("--timeout", type=float, default=180.0,
                        help="--smoke: seconds to wait for the chat (default 180)")
    sub = parser.add_subparsers(dest="command")
    box = sub.add_parser("box", help="one box's daemon (the demo starts three)")
    box.add_argument("name", choices=[name for name, _, _, _ in BOXES])
    box.add_argument("--root", type=Path, default=DEFAULT_ROOT)
    box.add_argument("--fast", action="store_true")
    box.add_argument("--router-metrics-port", type=int, default=None)
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse(argv)
    root = args.root.absolute()
    try:
        if args.command == "box":
            return run_box(root, args.name, fast=args.fast,
                           metrics_port=args.router_metrics_port)
        return run(Options(root, args.smoke, args.timeout))
    except ApplianceError as exc:
        print(f"demo-cell: {exc.as_text()}", file=sys.stderr)
        return exc.exit_code


if __name__ == "__main__":
    raise SystemExit(main())
