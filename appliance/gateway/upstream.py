"""The gateway's client to the engine on 127.0.0.1: one aiohttp session with a keep-alive
pool, opened when the gateway starts.

aiohttp's client rather than httpx's: for a streaming passthrough it was measured several
times faster on these machines (see benchmarks/gateway_throughput.py), and the gateway's
whole budget is a millisecond. Timeouts: connecting must take under 5 s; the first byte and
every later read may take up to `read_timeout` (a long prompt's prefill, a busy engine).
Every request carries the engine's API key (`appliance.secrets.engine_api_key`), which SGLang
demands on all but /health*, /ready* and /metrics*; the client's own Authorization header is
never forwarded.

On the head of a cell the same client reaches the cell's router: each call may name another
base URL (`base_url`), and the router is sent the same key (it demands it of its callers).
"""

from __future__ import annotations

from typing import Any

import aiohttp

CONNECT_TIMEOUT = 5.0


class Upstream:
    def __init__(self, base_url: str, read_timeout: float, api_key: str | None = None) -> None:
        self.base_url = base_url.rstrip("/")
        self.read_timeout = read_timeout
        self.api_key = api_key
        self._session: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=60, ttl_dns_cache=None)
        self._session = aiohttp.ClientSession(
            connector=connector, auto_decompress=False, skip_auto_headers=("User-Agent",),
            headers={"Authorization": f"Bearer {self.api_key}"} if self.api_key else None,
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=CONNECT_TIMEOUT,
                                          sock_read=self.read_timeout))

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            raise RuntimeError("the gateway's upstream client is not started")
        return self._session

    def request(self, method: str, path: str, body: bytes | None,
                headers: dict[str, str], base_url: str | None = None) -> Any:
        """An aiohttp request context (`async with upstream.request(...) as response`), to
        the local engine unless `base_url` names another upstream (a cell's router).

        A request to the router goes on a connection of its own (`Connection: close`):
        sglang-router 0.3.2 holds a stream's first token until the client acknowledges the
        one before it, and on a kept-alive connection Linux delays that acknowledgement by
        up to 40 ms. Measured on loopback (benchmarks/cell_latency.py, 1 and 8 users): +29 to
        +32 ms of time to first token through the router on kept-alive connections, -1.9 to
        +0.2 ms on fresh ones; a loopback connection costs far less than that."""
        if base_url is not None and base_url != self.base_url:
            headers = {**headers, "Connection": "close"}
        return self.session.request(method, (base_url or self.base_url) + path, data=body,
                                    headers=headers, allow_redirects=False)

    async def get_json(self, path: str, timeout: float = 5.0,
                       base_url: str | None = None) -> Any:
        async with self.session.get((base_url or self.base_url) + path,
                                    timeout=aiohttp.ClientTimeout(total=timeout)) as response:
            response.raise_for_status()
            return await response.json(content_type=None)
