"""A real uvicorn server in a thread of this process, on a socket it already holds: for tests, benchmarks,
load tests and the deploy flow's smoke tests (``python -m serve`` is the process a user starts)."""

from __future__ import annotations


class BackgroundServer:
    """uvicorn in a thread on a socket it already holds (port 0 = a free port, no race): for tests,
    benchmarks and the deploy flow's smoke tests.

        with BackgroundServer(create_app(folder)) as srv:
            httpx.get(srv.url + "/ready")
    """

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0, ready_timeout_s: float = 60.0):
        import socket

        import uvicorn

        self.app = app
        # proto=IPPROTO_TCP: asyncio sets TCP_NODELAY only on sockets that say so; without it every
        # keep-alive response waits ~40 ms for a delayed ACK (Nagle between header and body writes).
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, port))
        self.host, self.port = self.sock.getsockname()[:2]
        self.url = f"http://{self.host}:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
        self.ready_timeout_s = ready_timeout_s
        self._thread = None

    def start(self) -> BackgroundServer:
        import threading
        import time

        self._thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                        name="uvicorn", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + self.ready_timeout_s
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the server on {self.url} did not start within {self.ready_timeout_s:.0f} s")
            time.sleep(0.02)
        return self

    def wait_ready(self, timeout_s: float | None = None) -> None:
        """Until /ready answers 200 (the model is loaded)."""
        import time

        import httpx

        deadline = time.monotonic() + (timeout_s or self.ready_timeout_s)
        while time.monotonic() < deadline:
            try:
                if httpx.get(self.url + "/ready", timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        raise RuntimeError(f"{self.url}/ready did not answer 200 within the timeout")

    def stop(self) -> None:
        self.server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=30)
        self.sock.close()

    def __enter__(self) -> BackgroundServer:
        self.start()
        self.wait_ready()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
