"""`actorserve serve` as a subprocess for the benchmarks that must not share its event loop.

The server runs with this interpreter and environment (PYTHONPATH included, so a worktree
measures its own code), bound to 127.0.0.1 on a free port; `stop_server` drains it with
SIGTERM and kills it if it has not stopped within a minute.
"""

from __future__ import annotations

import asyncio
import platform
import socket
import subprocess
import sys
import time
from typing import Any

import aiohttp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(port: int, *args: str, **popen: Any) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "actorserve.cli", "serve", "--host", "127.0.0.1",
                             "--port", str(port), *args], **popen)


async def wait_up(url: str, proc: subprocess.Popen, timeout: float = 300) -> None:
    """Until `/health` answers 200 (raises if the server exits or does not come up)."""
    end = time.monotonic() + timeout
    async with aiohttp.ClientSession() as http:
        while time.monotonic() < end:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited with {proc.returncode}")
            try:
                async with http.get(f"{url}/health") as r:
                    if r.status == 200:
                        return
            except aiohttp.ClientError:     # not listening yet
                pass
            await asyncio.sleep(0.3)
    raise TimeoutError("server did not come up")


def stop_server(proc: subprocess.Popen) -> None:
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def cpu_name() -> str:
    """The CPU's model name (what every figure must say it came from)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def rss_bytes(pid: int) -> int:
    """A process's resident set (``VmRSS``), in bytes."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")
