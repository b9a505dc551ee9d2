"""A private `redis-server` for tests: started on a free loopback port with persistence off, PING-checked, killed at
the end. A missing server is a failure naming the install (the suite runs with --fail-on-skip: a skip fails too)."""
from __future__ import annotations

import shutil
import socket
import subprocess
import time

INSTALL = "apt-get install -y redis-server (Debian/Ubuntu; .ci/run does this as root)"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    """One redis-server process: `url` (redis://127.0.0.1:<port>/0), `client()`, `stop()` (SIGKILL: a crash)."""

    def __init__(self, *args: str, password: str | None = None):
        exe = shutil.which("redis-server")
        if exe is None:
            raise RuntimeError(f"redis-server is not installed: the Redis store's tests need a real server. "
                               f"Install it: {INSTALL}")
        self.port = free_port()
        cmd = [exe, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
               "--protected-mode", "no", *args]
        if password:
            cmd += ["--requirepass", password]
        self.password = password
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.url = f"redis://{':' + password + '@' if password else ''}127.0.0.1:{self.port}/0"
        deadline = time.monotonic() + 20
        while True:
            try:
                if self.client().ping():
                    break
            except Exception:  # noqa: BLE001 -- not up yet
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"redis-server on port {self.port} did not answer PING "
                                   f"(exit {self.proc.returncode})")
            time.sleep(0.05)

    def client(self):
        import redis

        return redis.Redis(host="127.0.0.1", port=self.port, password=self.password, socket_timeout=5)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=10)
