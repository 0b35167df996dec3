"""The engine's HTTP API as the supervisor uses it (127.0.0.1 only, short timeouts).

Connection refused is normal while SGLang loads (its port opens only when ready), so every
call answers None/False instead of raising. Every call carries the engine's API key
(`appliance.secrets.engine_api_key`) when given: SGLang exempts only /health*, /ready* and
/metrics* from it, so /server_info and /v1/loads need it.
"""

from __future__ import annotations

from typing import Any

import httpx


def engine_headers(api_key: str | None) -> dict[str, str]:
    """The headers every request to the engine carries: its API key, when it has one."""
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


class EngineClient:
    def __init__(self, base_url: str, transport: httpx.AsyncBaseTransport | None = None, *,
                 api_key: str | None = None) -> None:
        self._http = httpx.AsyncClient(base_url=base_url, transport=transport, timeout=5.0,
                                       trust_env=False, headers=engine_headers(api_key))

    async def aclose(self) -> None:
        await self._http.aclose()

    async def _get(self, path: str, timeout: float = 5.0) -> httpx.Response | None:
        try:
            return await self._http.get(path, timeout=timeout)
        except httpx.HTTPError:
            return None

    async def ready(self) -> bool:
        """The cheap probe: startup done, not draining, not unhealthy."""
        response = await self._get("/ready")
        return response is not None and response.status_code == 200

    async def health_generate(self, timeout: float = 30.0) -> bool:
        """A one-token generation through the whole engine; only when idle or at first ready."""
        response = await self._get("/health_generate", timeout=timeout)
        return response is not None and response.status_code == 200

    async def server_info(self) -> dict[str, Any] | None:
        response = await self._get("/server_info")
        if response is None or response.status_code != 200:
            return None
        body = response.json()
        return body if isinstance(body, dict) else None

    async def in_flight(self) -> int | None:
        """Running plus queued requests, from /v1/loads (no --enable-metrics needed)."""
        response = await self._get("/v1/loads")
        if response is None or response.status_code != 200:
            return None
        try:
            loads = response.json()["loads"]  # {"timestamp", "version", ..., "loads": [per DP]}
            return sum(
                int(entry.get("num_running_reqs", 0)) + int(entry.get("num_waiting_reqs", 0))
                for entry in loads
            )
        except (ValueError, KeyError, AttributeError, TypeError):
            return None
