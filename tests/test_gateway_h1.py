"""The gateway's lean HTTP/1.1 client (appliance.gateway.h1) against real servers on loopback:
a real aiohttp server for the ordinary answers, and a raw asyncio server where a test needs a
server that misbehaves byte by byte (stops mid-body, goes silent, closes early)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
from aiohttp import web

from appliance.gateway.h1 import Client, UpstreamFailed, UpstreamTimeout

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


@contextlib.asynccontextmanager
async def aiohttp_server(app: web.Application) -> AsyncIterator[str]:
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


@contextlib.asynccontextmanager
async def raw_server(handler: Handler) -> AsyncIterator[str]:
    server = await asyncio.start_server(handler, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.close()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(server.wait_closed(), 5)


async def read_request(reader: asyncio.StreamReader) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":")[1])
    return head + (await reader.readexactly(length) if length else b"")


def test_a_stream_arrives_chunk_by_chunk_and_its_connection_is_used_again() -> None:
    peers: list[int] = []
    read: asyncio.Queue[None] = asyncio.Queue()  # the client's word that it read an event

    async def stream(request: web.Request) -> web.StreamResponse:
        assert request.transport is not None
        peers.append(request.transport.get_extra_info("peername")[1])
        assert request.headers["Authorization"] == "Bearer k"
        assert await request.read() == b'{"a": 1}'
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for i in range(3):  # the next event only once the client read this one
            await response.write(f"data: {i}\n\n".encode())
            await read.get()
        await response.write_eof()
        return response

    async def scenario() -> list[bytes]:
        app = web.Application()
        app.router.add_post("/s", stream)
        async with aiohttp_server(app) as url:
            client = Client(read_timeout=10, connect_timeout=5,
                            headers={"Authorization": "Bearer k"})
            got = []
            for _ in range(2):
                async with client.request("POST", url + "/s", b'{"a": 1}', {}) as response:
                    assert response.status == 200
                    assert response.content_type == "text/event-stream"
                    while chunk := await response.chunk():
                        got.append(chunk)
                        read.put_nowait(None)
            client.close()
            return got

    got = asyncio.run(scenario())
    # each event read as it came, not gathered at the end
    assert got == [b"data: 0\n\n", b"data: 1\n\n", b"data: 2\n\n"] * 2
    assert peers[0] == peers[1]  # one connection, kept alive and used again


def test_a_request_that_says_close_and_an_unread_answer_do_not_go_back_to_the_pool() -> None:
    peers: list[int] = []

    async def answer(request: web.Request) -> web.Response:
        assert request.transport is not None
        peers.append(request.transport.get_extra_info("peername")[1])
        return web.json_response({"ok": True})

    async def scenario() -> None:
        app = web.Application()
        app.router.add_post("/j", answer)
        async with aiohttp_server(app) as url:
            client = Client(read_timeout=10, connect_timeout=5)
            async with client.request("POST", url + "/j", b"{}", {"Connection": "close"}) as r:
                assert await r.read() == b'{"ok": true}'
            async with client.request("POST", url + "/j", b"{}", {}) as r:
                pass  # not read: the connection is closed, not pooled half-read
            async with client.request("POST", url + "/j", b"{}", {}) as r:
                assert r.status == 200 and await r.read() == b'{"ok": true}'
            client.close()

    asyncio.run(scenario())
    assert len(set(peers)) == 3


def test_a_body_cut_before_its_end_is_a_failure_not_an_end() -> None:
    async def cut(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                     b"Transfer-Encoding: chunked\r\n\r\n" + b"9\r\ndata: 1\n\n\r\n")
        await writer.drain()
        writer.close()  # the engine died: no terminating chunk

    async def scenario() -> tuple[list[bytes], BaseException | None]:
        async with raw_server(cut) as url:
            client = Client(read_timeout=10, connect_timeout=5)
            got: list[bytes] = []
            try:
                async with client.request("POST", url + "/s", b"{}", {}) as response:
                    while chunk := await response.chunk():
                        got.append(chunk)
            except UpstreamFailed as exc:
                return got, exc
            return got, None

    got, error = asyncio.run(scenario())
    assert got == [b"data: 1\n\n"]
    assert isinstance(error, UpstreamFailed)
    assert "before the end of its answer" in str(error)


def test_an_upstream_gone_silent_times_out_and_one_that_keeps_sending_does_not() -> None:
    async def slow(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        request = await read_request(reader)
        silent = b"/silent" in request
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n"
                     b"Connection: close\r\n\r\n")
        for _ in range(12):  # 12 x 0.1 s: longer than the 1 s timeout in all, never between
            await asyncio.sleep(0.1)
            if not silent:
                writer.write(b"2\r\nab\r\n")
        with contextlib.suppress(ConnectionError):
            writer.write(b"0\r\n\r\n")
            await writer.drain()
        writer.close()

    async def scenario() -> tuple[bytes, BaseException | None]:
        async with raw_server(slow) as url:
            client = Client(read_timeout=1.0, connect_timeout=5)
            async with client.request("POST", url + "/busy", b"{}", {}) as response:
                body = await response.read()
            try:
                async with client.request("POST", url + "/silent", b"{}", {}) as response:
                    await response.read()
            except UpstreamTimeout as exc:
                return body, exc
            return body, None

    body, error = asyncio.run(scenario())
    assert body == b"ab" * 12
    assert isinstance(error, TimeoutError) and "sent nothing for 1 s" in str(error)


def test_nothing_listening_and_a_bad_answer_are_failures_that_say_so() -> None:
    async def garbage(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"NOT HTTP AT ALL\r\n\r\n")
        await writer.drain()

    async def scenario() -> tuple[str, str, str]:
        client = Client(read_timeout=5, connect_timeout=5)
        async with raw_server(garbage) as url:
            port = url.rsplit(":", 1)[1]
            with pytest.raises(UpstreamFailed) as bad:
                async with client.request("POST", url + "/x", b"{}", {}):
                    pass
        with pytest.raises(UpstreamFailed) as gone:  # the server is closed now
            async with client.request("POST", url + "/x", b"{}", {}):
                pass
        with pytest.raises(UpstreamFailed) as scheme:
            async with client.request("POST", "https://127.0.0.1:1/x", b"{}", {}):
                pass
        assert port in str(gone.value)
        return str(bad.value), str(gone.value), str(scheme.value)

    bad, gone, scheme = asyncio.run(scenario())
    assert "not valid HTTP" in bad
    assert "cannot connect to 127.0.0.1" in gone
    assert "plain http://" in scheme


def test_a_reader_slower_than_its_upstream_pauses_it_and_loses_nothing() -> None:
    big = b"x" * (256 << 10)

    async def flood(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse()
        await response.prepare(request)
        for _ in range(16):  # 4 MiB: past the client's high-water mark
            await response.write(big)
        await response.write_eof()
        return response

    async def scenario() -> tuple[int, bool]:
        app = web.Application()
        app.router.add_post("/f", flood)
        async with aiohttp_server(app) as url:
            client = Client(read_timeout=10, connect_timeout=5)
            total, paused = 0, False
            async with client.request("POST", url + "/f", b"{}", {}) as response:
                # the server runs ahead until the client pauses it (bounded: 30 s)
                deadline = asyncio.get_running_loop().time() + 30
                while not response._conn.paused and \
                        asyncio.get_running_loop().time() < deadline:
                    await asyncio.sleep(0.01)
                paused = response._conn.paused
                while chunk := await response.chunk():
                    total += len(chunk)
            client.close()
            return total, paused

    total, paused = asyncio.run(scenario())
    assert total == 16 * len(big)
    assert paused
