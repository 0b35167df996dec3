"""Health for `make demo`: a webhook receiver and a GPU that runs hot for a while.

A demo instrument, never used in production. The demo box is healthy, so without help the
Health page would only ever show green. `hot_gpu_episode` makes one fake GPU run above the
warning line for a few minutes and then cool down, so the dashboard, the Health page, the
event log and the webhook show a failure and its recovery, each recorded once.
`webhook_sink` is a loopback HTTP server that appends every alert it receives to a file
(JSON lines), standing in for the operator's alerting endpoint.
"""

from __future__ import annotations

import contextlib
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from appliance.testing.fake_gpus import FakeGpus

HOT_GPU = 5
HOT_CELSIUS = 88.0  # above the default 85 °C warning line, below the 92 °C critical one


@contextlib.contextmanager
def webhook_sink(path: Path) -> Iterator[str]:
    """A receiver on 127.0.0.1 that appends each POSTed JSON body to `path`; its URL."""
    lock = threading.Lock()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            try:
                line = json.dumps(json.loads(body), ensure_ascii=False)
            except ValueError:
                line = json.dumps({"unparsed": body.decode(errors="replace")})
            with lock, path.open("a", encoding="utf-8") as out:
                out.write(line + "\n")
            self.send_response(204)
            self.end_headers()

        def log_message(self, format: str, *args: object) -> None:
            pass  # the file is the record; the demo's terminal stays readable

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, name="demo-webhook", daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/alerts"
    finally:
        server.shutdown()
        server.server_close()


@contextlib.contextmanager
def hot_gpu_episode(gpus: FakeGpus, *, after_seconds: float,
                    lasts_seconds: float) -> Iterator[None]:
    """GPU `HOT_GPU` reads `HOT_CELSIUS` from `after_seconds` for `lasts_seconds`, then its
    own temperature again; stopped early when the context ends."""
    stop = threading.Event()

    def episode() -> None:
        if stop.wait(after_seconds):
            return
        gpus.set_fields(HOT_GPU, temperature_c=HOT_CELSIUS)
        stop.wait(lasts_seconds)
        gpus.reset_fields(HOT_GPU, "temperature_c")

    thread = threading.Thread(target=episode, name="demo-hot-gpu", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(timeout=5)
