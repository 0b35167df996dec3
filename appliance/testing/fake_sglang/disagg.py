"""Prefill/decode disaggregation, emulated: a cell's two engines handing a request's "KV" over.
A test and demo instrument (`appliance.testing.fake_sglang`): no KV exists and nothing moves
over RDMA; what is emulated is the protocol around it, as SGLang 0.5.23 runs it with
`--disaggregation-mode prefill|decode` behind `sglang-router --pd-disaggregation`.

The router sends every request to both engines, with `bootstrap_host`, `bootstrap_port` and
`bootstrap_room` added to the body (the prefill's host, its `--disaggregation-bootstrap-port`,
a random room number naming this one request on both sides).

- **Prefill** (`--disaggregation-mode prefill`) serves SGLang's bootstrap server on
  `--disaggregation-bootstrap-port` (the same host as its HTTP port), as
  `disaggregation/common/conn.py`'s `CommonKVBootstrapServer` does: `GET /health`, `GET|PUT
  /route` (the prefill's parallel layout for `prefill_dp_rank=-1&...`, one rank's address for
  a rank), `POST /register_dp_rank`, `POST /query_dp_ranks`; it logs `CommonKVBootstrapServer
  started successfully on HOST:PORT`. A request waits until the decode side asks for its room
  (SGLang's KV sender in `KVPoll.Bootstrapping`), "prefills" one token through the scheduler,
  and hands the room over. No decode within `SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT` (300 s)
  fails it with SGLang's warning and `Prefill bootstrap failed for request ... timed out after
  Xs in KVPoll.Bootstrapping` (HTTP 500); a decode that went away while waiting fails it with
  `Prefill transfer failed ... Decode instance could be dead ...`.
- **Decode** (`--disaggregation-mode decode`) first reads the prefill's layout from its
  bootstrap server (`GET /route`, cached per address; a different `--page-size` or
  `--kv-cache-dtype` fails the request with SGLang's mismatch message), then fetches the room
  over HTTP on the bootstrap port (`GET /emulator/kv/{room}`, an EMULATOR-ONLY route standing
  in for the RDMA transfer), and only then decodes. A prefill that cannot be reached fails the
  request as `Decode handshake failed ...`; one that dies mid-transfer as `Lost connection with
  prefill instance (bootstrap_addr: ...)`; no KV within `SGLANG_DISAGGREGATION_WAITING_TIMEOUT`
  (300 s) as `... timed out after Xs in KVPoll.WaitingForInput`. Each is HTTP 500 with the
  reason, and the engine keeps serving.

Both timeouts are SGLang's variables, read in seconds and multiplied by the emulator's time
scale (`FAKE_SGLANG_TIME_SCALE` under the performance model, else 1). A request without the
bootstrap fields is served as a unified engine would (SGLang's own warmup path differs).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NoReturn
from urllib.parse import parse_qs

import httpx

from appliance.testing.fake_sglang.asgi import Receive, Scope, Send, read_body, respond
from appliance.testing.fake_sglang.core import EngineAbort

if TYPE_CHECKING:
    import uvicorn

    from appliance.testing.fake_sglang.args import ServeArgs
    from appliance.testing.fake_sglang.core import Request
    from appliance.testing.fake_sglang.logwriter import LogWriter

BOOTSTRAP_TIMEOUT = "SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT"  # srt/environ.py:759, 300
WAITING_TIMEOUT = "SGLANG_DISAGGREGATION_WAITING_TIMEOUT"  # srt/environ.py:763, 300
KV_PATH = "/emulator/kv/"
BOOTSTRAP_WARNING = (  # common/conn.py:2396, logged once
    "Some requests timed out when bootstrapping, which means prefill instances fail to receive "
    "the KV indices from the decode instance of this request. If a greater mean TTFT is "
    "acceptable, you can 'export SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT=600' (10 minutes) to "
    "relax the timeout condition. ")
WAITING_WARNING = (  # common/conn.py:2894, logged once
    "Some requests fail to receive KV Cache transfer done signal after bootstrapping. If a "
    "greater mean TTFT is acceptable, you can 'export SGLANG_DISAGGREGATION_WAITING_TIMEOUT=600' "
    "(10 minutes) to relax the timeout condition. ")
PREFILL_DEAD = "Failed to get kvcache from prefill instance, it might be dead"  # conn.py:313


@dataclass(frozen=True)
class Bootstrap:
    """Where a request's KV comes from: the prefill's bootstrap server and the room."""

    host: str
    port: int
    room: int

    @property
    def addr(self) -> str:
        return f"{self.host}:{self.port}"


def bootstrap_of(body: dict[str, Any]) -> Bootstrap | None:
    """The router's three fields, when the body carries all of them (else None)."""
    host, port, room = (body.get(k) for k in ("bootstrap_host", "bootstrap_port",
                                              "bootstrap_room"))
    if not isinstance(host, str) or isinstance(port, bool) or isinstance(room, bool):
        return None
    try:
        return Bootstrap(host, int(port), int(room))  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return None


def timeout_seconds(name: str, scale: float) -> float:
    """SGLang's timeout variable (default 300 s), times the emulator's time scale."""
    try:
        seconds = float(os.environ.get(name, "300"))
    except ValueError:
        seconds = 300.0
    return max(0.0, seconds) * scale


@dataclass
class Room:
    """One request's handover on the prefill side; either side may create it first."""

    connected: asyncio.Event = field(default_factory=asyncio.Event)  # decode asked for it
    ready: asyncio.Event = field(default_factory=asyncio.Event)  # prefill done (or failed)
    owned: bool = False  # the prefill request exists
    decode_gone: bool = False
    failure: str | None = None
    prompt_tokens: int = 0


def _failed(side: str, req: Request, room: int, reason: str) -> str:
    """SGLang's per-request failure line (prefill.py:1287/1355, decode.py:1159/2864)."""
    who = "req" if side == "Prefill" else "decode_req.req"
    return (f"rank=0 {who}.rid={req.rid!r} {who}.bootstrap_room={room} with exception "
            f"KVTransferError(bootstrap_room={room}): {reason}")


class Handover:
    """One engine's side of the cell: the prefill's rooms and bootstrap server, or the
    decode's fetches. `before` runs ahead of a request's tokens, `sent` after the prefill's."""

    def __init__(self, args: ServeArgs, log: LogWriter, time_scale: float) -> None:
        self.args, self.log = args, log
        self.prefill = args.disaggregation_mode == "prefill"
        self.bootstrap_timeout = timeout_seconds(BOOTSTRAP_TIMEOUT, time_scale)
        self.waiting_timeout = timeout_seconds(WAITING_TIMEOUT, time_scale)
        self.rooms: dict[int, Room] = {}
        self.prefill_info: dict[str, dict[str, Any]] = {}
        self.warned: set[str] = set()
        self.server: uvicorn.Server | None = None
        self.serving: asyncio.Task[None] | None = None
        self._client: httpx.AsyncClient | None = None

    def client(self) -> httpx.AsyncClient:
        """The decode's one client to prefills' bootstrap servers: building one per request
        loads the CA bundle each time (tens of ms of CPU), which would show as the
        handover's own latency. No limit on connections: every request's fetch waits on
        the prefill at once, as one per request did."""
        if self._client is None:
            self._client = httpx.AsyncClient(limits=httpx.Limits(max_connections=None,
                                                                 max_keepalive_connections=64))
        return self._client

    def warn_once(self, text: str) -> None:
        if text not in self.warned:
            self.warned.add(text)
            self.log.line(text, 0)

    def room(self, number: int) -> Room:
        return self.rooms.setdefault(number, Room())

    # -- a request's handover ---------------------------------------------------------------
    async def before(self, req: Request, boot: Bootstrap) -> None:
        """Prefill: wait for the decode to ask for the room, then prefill one token. Decode:
        fetch the room's KV. Raises `EngineAbort` (500) with SGLang's reason."""
        if self.prefill:
            await self._await_decode(req, boot)
        else:
            await self._fetch(req, boot)

    async def _await_decode(self, req: Request, boot: Bootstrap) -> None:
        room = self.room(boot.room)
        room.owned, room.prompt_tokens = True, req.prompt_tokens
        started = time.monotonic()
        try:
            await asyncio.wait_for(room.connected.wait(), self.bootstrap_timeout)
        except TimeoutError:
            self.rooms.pop(boot.room, None)
            self.warn_once(BOOTSTRAP_WARNING)
            reason = (f"Request {boot.room} timed out after {time.monotonic() - started:.1f}s "
                      "in KVPoll.Bootstrapping")
            message = "Prefill bootstrap failed for request " + _failed("Prefill", req,
                                                                        boot.room, reason)
            self.log.line(message, 0)
            raise EngineAbort(message, 500) from None
        req.completion_tokens, req.finish_reason = 1, "length"  # a prefill server stops there

    def sent(self, req: Request, boot: Bootstrap, finished: bool) -> None:
        """The prefill's token is out: hand the room over, or fail it (decode gone, or the
        prefill itself aborted). Raises `EngineAbort` when the decode went away."""
        room = self.rooms.pop(boot.room, None)
        if room is None:
            return
        if not finished:
            room.failure = "Aborted by AbortReq."
        elif room.decode_gone:
            reason = (f"Decode instance could be dead, remote mooncake session "
                      f"{boot.addr} is not alive")
            message = "Prefill transfer failed for request " + _failed("Prefill", req,
                                                                       boot.room, reason)
            self.log.line(message, 0)
            room.ready.set()
            raise EngineAbort(message, 500)
        room.ready.set()

    async def _fetch(self, req: Request, boot: Bootstrap) -> None:
        info = await self._layout(req, boot)
        mismatch = self._mismatch(info)
        if mismatch:
            self.log.line(mismatch, 0)
            raise EngineAbort("Decode handshake failed for request " + _failed(
                "Decode", req, boot.room, mismatch), 500)
        started = time.monotonic()
        url = f"http://{boot.addr}{KV_PATH}{boot.room}?timeout={self.waiting_timeout}"
        try:
            answer = await self.client().get(url, timeout=self.waiting_timeout + 10)
        except httpx.HTTPError:
            self.prefill_info.pop(boot.addr, None)
            self.log.line(f"Lost connection with prefill instance (bootstrap_addr: {boot.addr}), "
                          "1 requests affected", 0)
            self._abort_transfer(req, boot, "Lost connection with prefill instance "
                                            f"(bootstrap_addr: {boot.addr})")
        if answer.status_code == 504:
            self.warn_once(WAITING_WARNING)
            self._abort_transfer(req, boot, f"Request {boot.room} timed out after "
                                            f"{time.monotonic() - started:.1f}s in "
                                            "KVPoll.WaitingForInput")
        if answer.status_code != 200:
            self._abort_transfer(req, boot, answer.text.strip() or PREFILL_DEAD)
        req.cached_tokens = req.prompt_tokens  # the whole prompt's KV arrived

    def _abort_transfer(self, req: Request, boot: Bootstrap, reason: str) -> NoReturn:
        message = "Decode transfer failed for request " + _failed("Decode", req, boot.room,
                                                                  reason)
        self.log.line(message, 0)
        raise EngineAbort(message, 500)

    async def _layout(self, req: Request, boot: Bootstrap) -> dict[str, Any]:
        """The prefill's `PrefillServerInfo` (common/conn.py:1297-1316), cached per address."""
        cached = self.prefill_info.get(boot.addr)
        if cached is not None:
            return cached
        url = (f"http://{boot.addr}/route?prefill_dp_rank=-1&prefill_cp_rank=-1&"
               "target_tp_rank=-1&target_pp_rank=-1")
        try:
            answer = await self.client().get(url, timeout=5)
            if answer.status_code != 200:
                self.log.line(f"Failed to get prefill server info: {answer.status_code}, "
                              f"{answer.text}", 0)
                info = None
            else:
                info = answer.json()
        except (httpx.HTTPError, ValueError) as exc:
            self.log.line(f"Error fetching prefill server info from bootstrap: {exc}", 0)
            info = None
        if not isinstance(info, dict):
            self.log.line(f"Could not fetch prefill parallel info from {boot.addr} after 1 "
                          "attempts", 0)
            raise EngineAbort("Decode handshake failed for request " + _failed(
                "Decode", req, boot.room, PREFILL_DEAD), 500)
        self.prefill_info[boot.addr] = info
        return info

    def _mismatch(self, info: dict[str, Any]) -> str | None:
        """common/conn.py:1319-1334: both servers must lay KV out alike."""
        mine = {"page_size": self.args.page_size, "kv_cache_dtype": self.args.kv_cache_dtype}
        flags = {"page_size": "--page-size", "kv_cache_dtype": "--kv-cache-dtype"}
        names = {"page_size": "Page size", "kv_cache_dtype": "KV cache dtype"}
        for key, value in mine.items():
            theirs = info.get(key)
            if theirs is not None and theirs != value:
                return (f"{names[key]} mismatch: prefill server has {key}={theirs}, but decode "
                        f"server has {key}={value}. Both servers must use the same {flags[key]} "
                        "value.")
        return None

    # -- the prefill's bootstrap server -------------------------------------------------------
    async def start(self) -> None:
        """Bind the bootstrap server (prefill only); a port in use is logged as SGLang's
        bootstrap thread logs it, and the engine carries on without one."""
        if not self.prefill:
            return
        import uvicorn

        class Quiet(uvicorn.Server):
            @contextlib.contextmanager
            def capture_signals(self) -> Iterator[None]:  # the emulator owns the signals
                yield

        host, port = self.args.host, self.args.disaggregation_bootstrap_port
        config = uvicorn.Config(self.app, host=host, port=port, log_config=None,
                                log_level="critical", access_log=False, lifespan="off",
                                interface="asgi3")
        server = self.server = Quiet(config)
        self.serving = asyncio.ensure_future(self._serve(server, host, port))
        while not server.started and not self.serving.done():
            await asyncio.sleep(0.02)
        if server.started:
            self.log.line(f"CommonKVBootstrapServer started successfully on {host}:{port}")

    async def _serve(self, server: uvicorn.Server, host: str, port: int) -> None:
        try:
            await server.serve()
        except SystemExit:  # could not bind
            self.log.line(f"Server error: [Errno 98] error while attempting to bind on address "
                          f"('{host}', {port}): address already in use")

    async def stop(self) -> None:
        if self._client is not None:
            await self._client.aclose()
        if self.server is not None and self.serving is not None:
            self.server.should_exit = True
            with contextlib.suppress(asyncio.CancelledError, SystemExit):
                await asyncio.wait_for(asyncio.shield(self.serving), 3)

    async def app(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        path, method = scope["path"], scope["method"]
        query = {k: v[0] for k, v in parse_qs(scope.get("query_string", b"").decode()).items()}
        if path == "/health":
            await respond(send, 200, "OK", "text/plain")
        elif path == "/route" and method == "PUT":
            await read_body(receive)
            await respond(send, 200, "OK", "text/plain")
        elif path == "/route" and method == "GET":
            await self._route(query, send)
        elif path == "/register_dp_rank" and method == "POST":
            await read_body(receive)
            await respond(send, 200, "OK", "text/plain")
        elif path == "/query_dp_ranks" and method == "POST":
            await read_body(receive)
            await respond(send, 200, {})
        elif path.startswith(KV_PATH) and method == "GET":
            await self._hand_over(path.removeprefix(KV_PATH), query, receive, send)
        else:
            await respond(send, 404, "Not Found", "text/plain")

    async def _route(self, query: dict[str, str], send: Send) -> None:
        keys = ("prefill_dp_rank", "prefill_cp_rank", "target_tp_rank", "target_pp_rank")
        if not all(query.get(k) for k in keys):
            await respond(send, 400, "Missing inputs for bootstrap server.", "text/plain")
            return
        if all(query[k] == "-1" for k in keys):
            await respond(send, 200, {
                "attn_tp_size": self.args.tp_size, "attn_cp_size": 1, "dp_size": 1,
                "pp_size": 1, "page_size": self.args.page_size,
                "kv_cache_dtype": self.args.kv_cache_dtype, "follow_bootstrap_room": True,
                "enable_dsa_cache_layer_split": False, "enable_kv_cache_sharding": False,
                "prefill_http_port": self.args.port, "decode_allocation_policy": "early"})
            return
        await respond(send, 200, {"rank_ip": self.args.host, "rank_port": self.args.port})

    async def _hand_over(self, number: str, query: dict[str, str], receive: Receive,
                         send: Send) -> None:
        """EMULATOR-ONLY: the decode's side of the transfer. Marks the room asked for, waits
        (at most `timeout`) for the prefill to finish it: 200 with the "KV", 500 with the
        prefill's reason, 504 on timeout. A decode that goes away marks the room gone."""
        try:
            key, wait = int(number), float(query.get("timeout", "300"))
        except ValueError:
            await respond(send, 400, "bad room or timeout", "text/plain")
            return
        room = self.room(key)
        room.connected.set()

        async def gone() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass

        watcher = asyncio.ensure_future(gone())
        ready = asyncio.ensure_future(room.ready.wait())
        try:
            done, _ = await asyncio.wait({watcher, ready}, timeout=wait,
                                         return_when=asyncio.FIRST_COMPLETED)
        finally:
            watcher.cancel()
            ready.cancel()
        if watcher in done:
            room.decode_gone = True
            return
        if ready not in done:
            room.decode_gone = True
            if not room.owned:
                self.rooms.pop(key, None)
            await respond(send, 504, "timed out waiting for the prefill", "text/plain")
        elif room.failure is not None:
            await respond(send, 500, room.failure, "text/plain")
        else:
            await respond(send, 200, {"bootstrap_room": key, "prompt_tokens": room.prompt_tokens,
                                      "kv": "emulated"})
