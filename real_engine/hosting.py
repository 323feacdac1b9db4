"""Binding and running ``latsim serve``'s app: a TCP socket with the options streaming
needs (``listen_socket``), whether a host is loopback-only (``is_loopback``), and the app
under uvicorn in a background thread for tests and loopback benchmarks
(``BackgroundServer``)."""
from __future__ import annotations

import ipaddress
import socket
import threading
import time
from typing import Optional


def is_loopback(host: str) -> bool:
    """Whether binding ``host`` keeps the server reachable from this machine only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:          # a host name: it may resolve to anything
        return False


def listen_socket(host: str = "127.0.0.1", port: int = 0,
                  send_buffer_bytes: Optional[int] = None) -> socket.socket:
    """A bound TCP socket for uvicorn (``Server.run(sockets=[...])``).

    ``send_buffer_bytes`` sets ``SO_SNDBUF`` on it, which accepted connections
    inherit (Linux doubles the value and stops autotuning it). By default the
    kernel grows a loopback send buffer to megabytes, i.e. thousands of SSE
    frames absorbed before a slow reader pushes back on the server at all.
    """
    # IPPROTO_TCP explicitly: asyncio only sets TCP_NODELAY on sockets whose proto says
    # TCP, and without it every keep-alive response after the first waits ~40 ms
    # (Nagle vs delayed ACK).
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if send_buffer_bytes:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, int(send_buffer_bytes))
    sock.bind((host, port))
    # Listening at once: a client that connects while the engine is still being built
    # (the banner names the port before uvicorn starts) waits in the backlog instead of
    # being refused. uvicorn's own listen() later only resets the backlog.
    sock.listen(2048)
    return sock


class BackgroundServer:
    """Run an app under uvicorn in a background thread (tests, loopback benchmarks).

    ``with BackgroundServer(app) as s: ... s.url`` binds ``host:port`` (port 0:
    a free one, taken before the thread starts so there is no race), waits for
    startup and shuts down on exit. Signal handlers are left alone (not the
    main thread). ``send_buffer_bytes``: see ``listen_socket``.
    """

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0,
                 startup_timeout: float = 30.0, send_buffer_bytes: Optional[int] = None) -> None:
        import uvicorn
        self.sock = listen_socket(host, port, send_buffer_bytes)
        self.host, self.port = host, self.sock.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
        self.startup_timeout = startup_timeout
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       daemon=True, name="latsim-uvicorn")

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def __enter__(self) -> "BackgroundServer":
        self.thread.start()
        t_end = time.monotonic() + self.startup_timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > t_end:
                raise RuntimeError("the server did not start")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(10)
        self.sock.close()
