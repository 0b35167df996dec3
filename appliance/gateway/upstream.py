"""The gateway's client to the engine on 127.0.0.1, opened when the gateway starts: the
generation requests go through `appliance.gateway.h1` (a lean HTTP/1.1 client whose cost per
streamed token is a parser call: the hot path), the few JSON reads (`get_json`: the engine's
figures, the cell's loads) through one aiohttp session.

Timeouts: connecting must take under 5 s; the first byte and every later read may take up to
`read_timeout` (a long prompt's prefill, a busy engine).
Every request carries the engine's API key (`appliance.secrets.engine_api_key`), which SGLang
demands on all but /health*, /ready* and /metrics*; the client's own Authorization header is
never forwarded.

On the head of a cell the same client reaches the cell's router: each call may name another
base URL (`base_url`), and the router is sent the same key (it demands it of its callers).
"""

from __future__ import annotations

from typing import Any

import aiohttp

from appliance.gateway import h1

CONNECT_TIMEOUT = 5.0


class Upstream:
    def __init__(self, base_url: str, read_timeout: float, api_key: str | None = None) -> None:
        self.base_url = base_url.rstrip("/")
        self.read_timeout = read_timeout
        self.api_key = api_key
        self._session: aiohttp.ClientSession | None = None
        self._client: h1.Client | None = None

    async def start(self) -> None:
        auth = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else None
        self._client = h1.Client(read_timeout=self.read_timeout,
                                 connect_timeout=CONNECT_TIMEOUT, headers=auth)
        connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=60, ttl_dns_cache=None)
        self._session = aiohttp.ClientSession(
            connector=connector, auto_decompress=False, skip_auto_headers=("User-Agent",),
            headers=auth,
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=CONNECT_TIMEOUT,
                                          sock_read=self.read_timeout))

    async def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None
        if self._session is not None:
            await self._session.close()
            self._session = None

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            raise RuntimeError("the gateway's upstream client is not started")
        return self._session

    def request(self, method: str, path: str, body: bytes | None,
                headers: dict[str, str], base_url: str | None = None) -> h1.Call:
        """A request context (`async with upstream.request(...) as response`, an
        `h1.Response`: its failures are `h1.UpstreamTimeout` and `h1.UpstreamFailed`), to
        the local engine unless `base_url` names another upstream (a cell's router).

        A request to the router goes on a connection of its own (`Connection: close`):
        sglang-router 0.3.2 holds a stream's first token until the client acknowledges the
        one before it, and on a kept-alive connection Linux delays that acknowledgement by
        up to 40 ms. Measured on loopback (benchmarks/cell_latency.py, 1 and 8 users): +29 to
        +32 ms of time to first token through the router on kept-alive connections, -1.9 to
        +0.2 ms on fresh ones; a loopback connection costs far less than that."""
        if base_url is not None and base_url != self.base_url:
            headers = {**headers, "Connection": "close"}
        if self._client is None:
            raise RuntimeError("the gateway's upstream client is not started")
        return self._client.request(method, (base_url or self.base_url) + path, body, headers)

    async def get_json(self, path: str, timeout: float = 5.0,
                       base_url: str | None = None) -> Any:
        async with self.session.get((base_url or self.base_url) + path,
                                    timeout=aiohttp.ClientTimeout(total=timeout)) as response:
            response.raise_for_status()
            return await response.json(content_type=None)
