"""The fleet's processes: N `actorserve serve` replicas and one sglang-router in front.

Each child runs in its own session (process group), so stopping one stops everything it
started. A replica keeps its loopback port for life: when it dies the supervisor loop starts it
again on the same port after a bounded exponential backoff (`Backoff`), and the router, which
health-checks every worker each second, takes the same URL back into rotation by itself; no
re-registration is needed. A replica that stayed up for `STABLE_S` seconds has its backoff
reset.

States of a replica are few and explicit, the REPLICA lifecycle (`statemachines.replica`, drawn
in docs/lifecycles.md): ``starting`` (process up, not yet answering ``/health``), ``ready``,
``dead`` (exited; waiting out its backoff), ``stopped``; only that machine writes a replica's
state (`fire`).
`Fleet.stop` drains: SIGTERM to every replica (each drains its in-flight requests, see
`http.edge.server`), wait up to `grace_s`, then SIGKILL what is left; the router last.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import IO, Callable

from ..omp import OMP_ENV
from ..statemachines import REPLICA, ReplicaState

import aiohttp

STABLE_S = 30.0


def free_port() -> int:
    """A free TCP port on the loopback interface (the kernel's pick)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def fire(r: "Replica", event: str) -> None:
    """Move a replica through its lifecycle (an event its state does not allow raises)."""
    REPLICA.fire(r, event)


@dataclass(slots=True)
class Backoff:
    """Delay before restart number k: ``min(base * 2**k, cap)`` seconds."""
    base: float = 0.5
    cap: float = 10.0
    failures: int = 0

    def next(self) -> float:
        delay = min(self.base * (2 ** self.failures), self.cap)
        self.failures += 1
        return delay


@dataclass(slots=True)
class Replica:
    index: int
    port: int
    argv: list[str]
    state: ReplicaState = ReplicaState.stopped
    proc: subprocess.Popen | None = None
    restarts: int = 0
    started_at: float = 0.0
    ready_at: float | None = None
    died_at: float | None = None
    backoff: Backoff = field(default_factory=Backoff)
    name: str = ""                     # its --replica-id (r<i>), which its response ids carry
    host: str = "127.0.0.1"

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def info(self) -> dict[str, object]:
        return {"index": self.index, "name": self.name, "url": self.url, "state": self.state.value,
                "pid": self.proc.pid if self.proc else None, "restarts": self.restarts,
                "ready_at": self.ready_at, "died_at": self.died_at}


def _spawn(argv: list[str], log: IO[bytes] | None) -> subprocess.Popen:
    return subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log or subprocess.DEVNULL,
                            stderr=subprocess.STDOUT if log else subprocess.DEVNULL,
                            start_new_session=True, env={**os.environ, **OMP_ENV})


def _signal_group(proc: subprocess.Popen | None, sig: int) -> None:
    if proc is not None and proc.poll() is None:
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            pass


def router_argv(urls: list[str], port: int, policy: str) -> list[str]:
    """sglang-router, loopback only (its default host is 0.0.0.0, its metrics port 29000: both
    pinned here), health-checking each worker every second, dropping it at the first failure
    and taking it back at the first success."""
    return [sys.executable, "-m", "sglang_router.launch_router", "--worker-urls", *urls,
            "--policy", policy, "--host", "127.0.0.1", "--port", str(port),
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
            "--health-check-interval-secs", "1", "--health-failure-threshold", "1",
            "--health-success-threshold", "1", "--health-check-timeout-secs", "2",
            "--shutdown-grace-period-secs", "2",      # the replicas have drained by then
            "--log-level", "warn"]


class RouterFleet:
    """What every fleet has: its replicas and the router in front (the front reads these)."""

    replicas: list[Replica]
    router_port: int
    router: subprocess.Popen | None
    _http: aiohttp.ClientSession | None

    @property
    def router_url(self) -> str:
        return f"http://127.0.0.1:{self.router_port}"

    def live(self) -> list[Replica]:
        return [r for r in self.replicas if r.state is ReplicaState.ready]

    async def _stop_router(self) -> None:
        """SIGTERM to the router, SIGKILL after 5 s; then the fleet's HTTP client."""
        _signal_group(self.router, signal.SIGTERM)
        if self.router is not None:
            try:
                await asyncio.to_thread(self.router.wait, 5)
            except subprocess.TimeoutExpired:
                _signal_group(self.router, signal.SIGKILL)
                self.router.wait()
        if self._http is not None:
            await self._http.close()


class Fleet(RouterFleet):
    """Replicas, the router, and the loop that keeps the replicas up."""

    def __init__(self, serve_argv: Callable[[int, int], list[str]], replicas: int, policy: str,
                 router_port: int | None = None, log: IO[bytes] | None = None,
                 ready_timeout_s: float = 180.0, grace_s: float = 30.0,
                 name_of: Callable[[int], str] = lambda i: f"r{i}") -> None:
        self.replicas = [Replica(i, p, serve_argv(i, p), name=name_of(i))
                         for i, p in enumerate(free_port() for _ in range(replicas))]
        self.policy = policy
        self.router_port = router_port or free_port()
        self.router: subprocess.Popen | None = None
        self.log = log
        self.ready_timeout_s = ready_timeout_s
        self.grace_s = grace_s
        self.on_restart: list[Callable[[Replica], None]] = []   # e.g. forget its sessions
        self._stopping = False
        self._http: aiohttp.ClientSession | None = None

    # -- start --------------------------------------------------------------------------------
    async def start(self) -> None:
        """Every replica up and answering, then the router up with all of them healthy."""
        self._http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3))
        for r in self.replicas:
            self._launch(r)
        await asyncio.gather(*(self._await_ready(r) for r in self.replicas))
        self.router = _spawn(router_argv([r.url for r in self.replicas], self.router_port,
                                         self.policy), self.log)
        await self._await_router()

    def _launch(self, r: Replica) -> None:
        r.proc = _spawn(r.argv, self.log)
        fire(r, "launch")
        r.started_at, r.ready_at = time.monotonic(), None

    async def _healthy(self, url: str) -> bool:
        assert self._http is not None
        try:
            async with self._http.get(url) as resp:
                return resp.status == 200
        except (aiohttp.ClientError, asyncio.TimeoutError):
            return False

    async def _await_ready(self, r: Replica) -> None:
        end = time.monotonic() + self.ready_timeout_s
        while not await self._healthy(r.url + "/health"):
            if r.proc is None or r.proc.poll() is not None:
                raise RuntimeError(f"replica {r.index} exited with {r.proc and r.proc.returncode} "
                                   "before it was ready")
            if time.monotonic() > end:
                raise RuntimeError(f"replica {r.index} not ready after {self.ready_timeout_s:g}s")
            await asyncio.sleep(0.2)
        fire(r, "ready")
        r.ready_at = time.monotonic()

    async def _await_router(self) -> None:
        assert self._http is not None
        end = time.monotonic() + 60
        while True:
            if self.router is None or self.router.poll() is not None:
                raise RuntimeError("sglang-router exited at start (see the fleet log)")
            try:
                async with self._http.get(self.router_url + "/workers") as resp:
                    workers = (await resp.json()).get("workers", []) if resp.status == 200 else []
                if sum(1 for w in workers if w.get("is_healthy")) == len(self.replicas):
                    return
            except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
                pass
            if time.monotonic() > end:
                raise RuntimeError("sglang-router did not see every replica healthy in 60s")
            await asyncio.sleep(0.2)

    # -- supervise ----------------------------------------------------------------------------
    async def supervise(self) -> None:
        """Restart replicas that die, each after its backoff; runs until `stop`."""
        while not self._stopping:
            for r in self.replicas:
                if REPLICA.can(r.state, "die") and r.proc and r.proc.poll() is not None:
                    fire(r, "die")
                    r.died_at = time.monotonic()
                    if r.ready_at is not None and r.died_at - r.ready_at > STABLE_S:
                        r.backoff.failures = 0
                    asyncio.ensure_future(self._restart(r, r.backoff.next()))
            await asyncio.sleep(0.1)

    async def _restart(self, r: Replica, delay: float) -> None:
        await asyncio.sleep(delay)
        if self._stopping:
            return
        for cb in self.on_restart:
            cb(r)
        r.restarts += 1
        self._launch(r)
        try:
            await self._await_ready(r)
        except RuntimeError:
            pass                           # died again while starting: the loop sees it

    # -- stop ---------------------------------------------------------------------------------
    async def stop(self) -> None:
        """Drain: SIGTERM to each replica, up to `grace_s` for them to finish, then SIGKILL;
        then the router."""
        self._stopping = True
        for r in self.replicas:
            _signal_group(r.proc, signal.SIGTERM)
        end = time.monotonic() + self.grace_s
        while any(r.proc and r.proc.poll() is None for r in self.replicas) and time.monotonic() < end:
            await asyncio.sleep(0.1)
        for r in self.replicas:
            _signal_group(r.proc, signal.SIGKILL)
            if r.proc is not None:
                r.proc.wait()
            fire(r, "stop")
        await self._stop_router()
