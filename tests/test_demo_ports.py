"""The demos' port check: a port is taken only while something listens on it. A connection of
a demo that just ended, in TIME_WAIT on the port, leaves it free (without SO_REUSEADDR the
check called it taken, and `make demo-cell` right after `make demo` moved off :8080)."""

from __future__ import annotations

import socket

from appliance.testing.demo_cell_boxes import port_free, port_picker


def time_wait_port() -> int:
    """A port whose listener is gone and whose server side closed a connection first, so
    that connection lingers in TIME_WAIT on it. The listener sets SO_REUSEADDR as the
    daemons' servers do (asyncio's, under uvicorn): Linux lets a bind share a port with a
    TIME_WAIT socket only when both sides asked for it."""
    server = socket.socket()
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    server.bind(("127.0.0.1", 0))
    server.listen()
    port = int(server.getsockname()[1])
    client = socket.create_connection(("127.0.0.1", port))
    accepted, _ = server.accept()
    accepted.close()  # the active close: TIME_WAIT on the server's side, the port's
    client.recv(1)  # the peer's FIN has arrived: the close is under way
    client.close()
    server.close()
    return port


def test_a_listener_takes_a_port_and_time_wait_does_not() -> None:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        held = int(listener.getsockname()[1])
        assert not port_free(held)
        assert port_picker(prefer=True)(held) != held
    lingering = time_wait_port()
    assert port_free(lingering)
    assert port_picker(prefer=True)(lingering) == lingering
