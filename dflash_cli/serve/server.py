"""Listening socket and the uvicorn server loop: a stop signal ends the server cleanly with exit 0."""

from __future__ import annotations

import asyncio
import signal
import socket
from types import FrameType
from typing import Any

from dflash_cli.errors import ServeError


def bind(host: str, port: int) -> socket.socket:
    """Bind before loading the pair, so an address in use fails in a second rather than after a build."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise ServeError(
            f"cannot resolve host {host!r}: {exc.strerror}", hint="use an IP address such as 127.0.0.1"
        ) from None
    family, _, _, _, address = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as exc:
        sock.close()
        raise ServeError(
            f"cannot listen on {host}:{port}: {exc.strerror}",
            hint="pick another --port (0 = any free port), or stop the process that holds it",
        ) from None
    sock.listen(128)
    sock.set_inheritable(True)
    return sock


CUT_MARGIN_S = 2.0  # after our own deadline, uvicorn's: a backstop that drops whatever is still open


def build_server(app: Any, *, access_log: bool = False, graceful_s: float = 30.0) -> Any:
    """A uvicorn server for `app`: a stop signal gives requests in flight `graceful_s` seconds to
    finish; then each is answered properly (a 503 error, or a stream's final chunk and [DONE])."""
    try:
        import uvicorn
    except ImportError:
        raise ServeError(
            "uvicorn is not installed", hint="pip install 'dflash-toolchain' again (it depends on it)"
        ) from None
    scheduler = app.state.scheduler

    class _Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: FrameType | None) -> None:
            # uvicorn re-raises a captured signal after shutdown (exit 130/143); a stop we asked for
            # should end with 0, so only the flags are set here. A second Ctrl-C forces the exit.
            if self.should_exit and sig == signal.SIGINT:
                self.force_exit = True
            else:
                self.should_exit = True

        async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
            scheduler.closing = True
            # uvicorn's own deadline cancels handlers mid-answer (a plain-text 500, a stream cut
            # without [DONE]); ours comes first and lets every handler answer.
            cut = asyncio.get_running_loop().call_later(graceful_s, scheduler.cut_all)
            try:
                await super().shutdown(sockets)
            finally:
                cut.cancel()

    config = uvicorn.Config(
        app,
        log_level="info" if access_log else "warning",
        access_log=access_log,
        lifespan="off",
        timeout_graceful_shutdown=graceful_s + CUT_MARGIN_S,
    )
    return _Server(config)


def serve_forever(server: Any, sock: socket.socket) -> None:
    """Serve until SIGINT/SIGTERM."""
    server.run(sockets=[sock])
