"""A `graft serve` process for the benchmarks that talk to one: started on a free port, waited for until it
answers `/health`, and stopped with SIGTERM when the block ends, so no benchmark leaves a server behind."""

from __future__ import annotations

import contextlib
import signal
import socket
import subprocess
import time
import urllib.request
from typing import Iterator


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def running(argv: list[str], port: int, env: dict | None = None) -> Iterator[tuple[str, subprocess.Popen]]:
    """The base URL and process of ``argv`` (a server listening on ``port``), once it answers; stopped after."""
    proc = subprocess.Popen(argv, stderr=subprocess.DEVNULL, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):
            if proc.poll() is not None:
                raise SystemExit(f"the server exited with {proc.returncode} before it answered")
            try:
                urllib.request.urlopen(f"{url}/health", timeout=1)
                break
            except OSError:
                time.sleep(0.2)
        else:
            raise SystemExit("the server did not answer /health within two minutes")
        yield url, proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(60)
