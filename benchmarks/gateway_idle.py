"""Gateway idle CPU: what the gateway costs the box when nobody sends anything, against a bare
uvicorn passthrough (the same server stack with no background work), in the same run.

    .venv/bin/python benchmarks/gateway_idle.py [--seconds 20] [--rounds 2] [--keep]

Both are separate processes on 127.0.0.1 in front of one engine emulator, warmed by a few
requests, then left alone:

  gateway       `python -m appliance --config FILE gateway` in a fresh box (temporary state
                folder, migrated SQLite database, one API key, the engine published as
                ready): its status and key polls, usage writer and uvicorn's own ticks
  passthrough   uvicorn with uvloop and an aiohttp client to the engine, nothing else

Each is measured over `--seconds` with psutil (user + system of every thread), `--rounds`
times, alternating; printed as CPU milliseconds per second, median of the rounds, and the
ratio gateway/passthrough. The gateway's idle work is the status-row poll, the key-table
fingerprint and the usage flush (`appliance.gateway.parts`, `recorder`). Nothing is asserted:
a measuring instrument, run by hand.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from gateway_throughput import (  # beside this script
    Child,
    http_get,
    model_dir,
    start_engine,
    start_gateway,
    start_passthrough,
)

# A bare passthrough: uvicorn + uvloop + aiohttp forwarding every request to the engine.
PASSTHROUGH = """
import sys, aiohttp, uvicorn
engine, port = sys.argv[1], int(sys.argv[2])
session = None
async def app(scope, receive, send):
    global session
    if scope["type"] == "lifespan":
        while (await receive())["type"] != "lifespan.shutdown":
            await send({"type": "lifespan.startup.complete"})
        await send({"type": "lifespan.shutdown.complete"})
        return
    if session is None:
        session = aiohttp.ClientSession()
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body"):
            break
    async with session.request(scope["method"], engine + scope["path"], data=body,
                               headers={"content-type": "application/json"}) as answer:
        data = await answer.read()
    await send({"type": "http.response.start", "status": answer.status,
                "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": data})
uvicorn.run(app, host="127.0.0.1", port=port, loop="uvloop", http="httptools",
            log_level="warning", access_log=False)
"""




def idle_ms_per_second(child: Child, seconds: float) -> float:
    before = child.cpu()
    time.sleep(seconds)
    child.check_alive()
    return (child.cpu() - before) / seconds * 1000


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--keep", action="store_true", help="keep the work folder")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="gateway-idle-"))
    children: list[Child] = []
    try:
        engine, engine_port = start_engine(work, model_dir(work), 0.0)
        children.append(engine)
        gateway = start_gateway(work, engine_port)
        children.append(gateway.child)
        passthrough, url = start_passthrough(work, engine_port, PASSTHROUGH)
        children.append(passthrough)
        for _ in range(5):  # warm both: connections open, code paths taken once
            http_get(f"{url}/health")
            http_get(gateway.target.url.replace("/v1/chat/completions", "/health"))
        time.sleep(2.0)  # the usage writer's first flush, the poll's first rounds
        measured: dict[str, list[float]] = {"gateway": [], "passthrough": []}
        for number in range(args.rounds):
            order = [("gateway", gateway.child), ("passthrough", passthrough)]
            for name, child in order if number % 2 == 0 else order[::-1]:
                measured[name].append(idle_ms_per_second(child, args.seconds))
        ours = statistics.median(measured["gateway"])
        base = statistics.median(measured["passthrough"])
        print(f"idle CPU over {args.seconds:g} s x {args.rounds} (median), ms per second:")
        for name, value in (("gateway", ours), ("passthrough", base)):
            rounds = ", ".join(f"{v:.2f}" for v in measured[name])
            print(f"  {name:<12} {value:7.2f}   rounds {rounds}")
        print(f"  ratio gateway/passthrough: {ours / base:.2f}" if base > 0 else
              "  ratio: the passthrough used no measurable CPU")
    finally:
        for child in reversed(children):
            child.stop()
        if args.keep:
            print(f"work folder kept: {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
