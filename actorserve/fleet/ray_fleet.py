"""The fleet placed by Ray (`actorserve fleet --ray ADDRESS|auto`).

Each replica is one Ray actor (`ray_replica.ReplicaServer`: a whole server in one process),
asked for its resources (``--ray-cpus`` per replica, default the ``--threads`` it runs with,
and ``--ray-gpus``) and restarted by Ray whenever its process dies (``max_restarts=-1``). The
router is the same sglang-router as the process fleet's, started here with no workers: a
replica is registered (``POST /workers``) once Ray has it serving and the router has found it
healthy, and removed (``DELETE /workers/{id}``) as soon as it stops answering, because a
restarted actor comes back on another port, maybe another node, and the old URL must not stay
in the router's list.

The loop (`supervise`) asks each actor every `POLL_S` for its `info` with a short timeout. A
replica answers with its incarnation (new at every start of the actor), so a restart is seen
even when no poll failed in between. States are the process fleet's: ``starting`` (placed or
restarting, or registered and not yet healthy in the router), ``ready``, ``dead`` (not
answering: Ray is restarting it), ``stopped``.

``--ray auto`` joins the cluster that ``ray.init()`` finds (``RAY_ADDRESS``, or one started with
``ray start`` on this machine) and, when there is none, starts a private one on 127.0.0.1
(`head_argv`, in a process group of its own, so a Ctrl-C or a SIGTERM to the fleet's group
reaches the fleet, which drains, and not Ray's daemons under it) that stops with the fleet. ``--ray ADDRESS`` joins that cluster. Every node must have actorserve
and its models installed; the router and the front run where the command runs.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import IO, Any, Callable

import aiohttp

from ..omp import OMP_ENV
from .supervisor import Replica, ReplicaState, RouterFleet, _spawn, fire, free_port, router_argv

POLL_S = 0.5
CALL_TIMEOUT_S = 2.0


@dataclass(slots=True)
class RayReplica(Replica):
    handle: Any = None               # the Ray actor handle
    worker_id: str | None = None     # the router's id for the registered URL
    incarnation: str | None = None
    node_id: str | None = None
    actor_id: str | None = None
    placement: dict[str, float] | None = None
    pid: int | None = None

    def info(self) -> dict[str, object]:
        return {**Replica.info(self), "url": self.url if self.port else None, "pid": self.pid,
                "ray": {"actor_id": self.actor_id, "node_id": self.node_id,
                        "incarnation": self.incarnation, "resources": self.placement}}


def _cluster_known() -> bool:
    """A cluster ``ray.init(address="auto")`` would join: RAY_ADDRESS, or the address file a
    ``ray start`` leaves in Ray's temp dir (read without importing Ray)."""
    if os.environ.get("RAY_ADDRESS"):
        return True
    base = os.environ.get("RAY_TMPDIR") or os.environ.get("TMPDIR") or "/tmp"
    return os.path.exists(os.path.join(base, "ray", "ray_current_cluster"))


def head_argv(port: int, num_cpus: int, temp_dir: str) -> list[str]:
    """``ray start --head --block`` on 127.0.0.1: a private cluster whose daemons all belong to
    this one process group, so the fleet stops exactly them (never ``ray stop``, which stops
    every cluster on the machine). Every port it would take by default is a free one instead."""
    return [sys.executable, "-c", "from ray.scripts.scripts import main; main()", "start",
            "--head", "--block", "--node-ip-address=127.0.0.1", f"--port={port}",
            f"--num-cpus={num_cpus}", "--include-dashboard=false", "--disable-usage-stats",
            f"--object-store-memory={100 * 1024 * 1024}", f"--temp-dir={temp_dir}",
            f"--metrics-export-port={free_port()}",
            f"--dashboard-agent-listen-port={free_port()}", f"--dashboard-agent-grpc-port={free_port()}",
            f"--runtime-env-agent-port={free_port()}"]


def _ray_join(address: str) -> bool:
    """``ray.init`` on `address` ("auto": the cluster it finds); False when there is none."""
    import ray

    # ray.init takes SIGTERM (and, in its core worker, SIGINT) for itself: exit at once. The
    # fleet's own handlers (drain first) are put back.
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        ray.init(address=address, include_dashboard=False, log_to_driver=False,
                 logging_level="warning")
        return True
    except ConnectionError:
        return False
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)


HEAD_ATTEMPTS = 3          # starts of a private cluster's head before giving up


class RayFleet(RouterFleet):
    """The same surface as `supervisor.Fleet` (the front uses it unchanged), over Ray actors."""

    def __init__(self, serve_args: Callable[[int], list[str]], replicas: int, policy: str, *,
                 address: str = "auto", cpus: float = 1.0, gpus: float = 0.0,
                 router_port: int | None = None, log: IO[bytes] | None = None,
                 ready_timeout_s: float = 300.0, grace_s: float = 30.0,
                 name_of: Callable[[int], str] = lambda i: f"r{i}") -> None:
        self.replicas = [RayReplica(i, 0, serve_args(i), name=name_of(i)) for i in range(replicas)]
        self.policy, self.address = policy, address
        self.cpus, self.gpus = cpus, gpus
        self.router_port = router_port or free_port()
        self.router: subprocess.Popen | None = None
        self.log = log
        self.ready_timeout_s, self.grace_s = ready_timeout_s, grace_s
        self.on_restart: list[Callable[[Replica], None]] = []
        self._stopping = False
        self.head: subprocess.Popen | None = None      # the private cluster, when the fleet made one
        self.head_dir: str | None = None
        self._http: aiohttp.ClientSession | None = None

    # -- start --------------------------------------------------------------------------------
    async def start(self) -> None:
        """The cluster joined (or started), the router up, every replica placed, serving and
        healthy in the router; a replica that cannot be placed is an error naming why."""
        await self._join_or_start()        # first: Ray reads its settings when imported
        import ray

        from .ray_replica import ReplicaServer

        have = ray.cluster_resources()
        need = {"CPU": self.cpus * len(self.replicas), "GPU": self.gpus * len(self.replicas)}
        short = {k: (v, have.get(k, 0.0)) for k, v in need.items() if v > have.get(k, 0.0)}
        if short and self.head is not None:   # a private cluster never grows: say so now
            raise RuntimeError("the replicas cannot all be placed: " + ", ".join(
                f"{len(self.replicas)} x {need[k] / len(self.replicas):g} {k} = {v:g} asked, "
                f"the cluster has {h:g}" for k, (v, h) in short.items())
                + " (lower --ray-cpus / --ray-gpus or --replicas)")
        self._http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3))
        self.router = _spawn(router_argv([], self.router_port, self.policy), self.log)
        await self._await_router()
        remote = ray.remote(ReplicaServer).options(
            num_cpus=self.cpus, num_gpus=self.gpus, max_restarts=-1, max_task_retries=0,
            runtime_env={"env_vars": dict(OMP_ENV)})
        for r in self.replicas:
            r.handle = remote.remote(r.argv, r.name)
            r.placement = {"CPU": self.cpus, "GPU": self.gpus}
            fire(r, "launch")
            r.started_at = time.monotonic()
        end = time.monotonic() + self.ready_timeout_s
        while len(self.live()) < len(self.replicas):
            await self.poll_once()
            if time.monotonic() > end:
                have = ray.cluster_resources()
                raise RuntimeError(
                    f"{len(self.live())} of {len(self.replicas)} replicas ready after "
                    f"{self.ready_timeout_s:g}s (each asks CPU {self.cpus:g}, GPU {self.gpus:g}; "
                    f"the cluster has CPU {have.get('CPU', 0):g}, GPU {have.get('GPU', 0):g})")
            await asyncio.sleep(POLL_S)

    async def _join_or_start(self) -> None:
        # ray.init and ray.shutdown on the main thread (the loop's): Ray's driver wants its
        # signal handling there, and a driver set up on another thread aborts at exit
        if self.address != "auto" or _cluster_known():
            if not _ray_join(self.address):
                raise RuntimeError(f"no Ray cluster answers at {self.address}")
            return
        # A private cluster with its own temp dir (its address file is not the user's) and its
        # own token, set before Ray is first imported here (its config is read once): the
        # driver, the head and every worker share it, whatever a HOME holds.
        base = os.environ.get("RAY_TMPDIR") or tempfile.gettempdir()
        os.makedirs(base, exist_ok=True)
        self.head_dir = tempfile.mkdtemp(prefix="actorserve-ray-", dir=base)
        os.environ.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=secrets.token_hex(32))
        os.environ.pop("RAY_AUTH_TOKEN_PATH", None)
        end = time.monotonic() + 120
        for attempt in range(1, HEAD_ATTEMPTS + 1):
            # the ports are chosen free, then bound by Ray's daemons: another process can take
            # one in between (seen once in a test run: `ray start` exited 1), so a head that
            # dies before it answers is started again on fresh ports, a bounded number of times
            port = free_port()
            self.head = _spawn(head_argv(port, os.cpu_count() or 1, self.head_dir), self.log)
            # ray.init waits minutes for a GCS that is not there: join only once its port answers
            while not await _port_open(port) or not _ray_join(f"127.0.0.1:{port}"):
                if self.head.poll() is not None:
                    break
                if time.monotonic() > end:
                    raise RuntimeError("the private Ray cluster did not come up in 120s")
                await asyncio.sleep(0.5)
            else:
                return
            if attempt == HEAD_ATTEMPTS:
                raise RuntimeError(f"ray start exited with {self.head.returncode}, {attempt} times "
                                   "(see the fleet log)")
            if self.log is not None:
                self.log.write(f"actorserve fleet: ray start exited with {self.head.returncode}; starting "
                               f"it again on fresh ports ({attempt + 1}/{HEAD_ATTEMPTS})\n".encode())
                self.log.flush()

    async def _await_router(self) -> None:
        end = time.monotonic() + 60
        while not await self._get_json(self.router_url + "/workers"):
            if self.router is None or self.router.poll() is not None:
                raise RuntimeError("sglang-router exited at start (see the fleet log)")
            if time.monotonic() > end:
                raise RuntimeError("sglang-router did not answer in 60s")
            await asyncio.sleep(0.2)

    async def _get_json(self, url: str) -> Any:
        assert self._http is not None
        try:
            async with self._http.get(url) as resp:
                return await resp.json() if resp.status == 200 else None
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
            return None

    # -- supervise ----------------------------------------------------------------------------
    async def supervise(self) -> None:
        while not self._stopping:
            await self.poll_once()
            await asyncio.sleep(POLL_S)

    async def poll_once(self) -> None:
        infos = await asyncio.gather(*(self._info(r) for r in self.replicas))
        workers = await self._get_json(self.router_url + "/workers") or {}
        healthy = {w.get("id") for w in workers.get("workers", []) if w.get("is_healthy")}
        for r, info in zip(self.replicas, infos):
            if self._stopping:
                return
            if info is None or not info.get("serving"):
                if r.state is ReplicaState.ready:
                    await self._lost(r)
                continue
            if info["incarnation"] != r.incarnation:
                await self._arrived(r, info)
            elif r.state is ReplicaState.starting and r.worker_id in healthy:
                fire(r, "ready")
                r.ready_at = time.monotonic()

    async def _info(self, r: RayReplica) -> dict[str, Any] | None:
        try:
            return await asyncio.wait_for(asyncio.wrap_future(r.handle.info.remote().future()),
                                          CALL_TIMEOUT_S)
        except Exception:                  # noqa: BLE001 - dead, restarting or not yet placed
            return None

    async def _lost(self, r: RayReplica) -> None:
        """Stopped answering: out of the router now; Ray restarts the actor."""
        fire(r, "die")
        r.died_at = time.monotonic()
        for cb in self.on_restart:
            cb(r)
        await self._unregister(r)

    async def _arrived(self, r: RayReplica, info: dict[str, Any]) -> None:
        """A new incarnation (the first, or a restart): register its URL with the router."""
        if r.incarnation is not None:
            if r.state is ReplicaState.ready:    # restarted between two polls
                await self._lost(r)
            r.restarts += 1
        await self._unregister(r)
        host_port = str(info["url"]).rsplit("//", 1)[1]
        r.host, r.port = host_port.rsplit(":", 1)[0], int(host_port.rsplit(":", 1)[1])
        r.incarnation, r.pid = info["incarnation"], info["pid"]
        r.node_id, r.actor_id = info["node_id"], info["actor_id"]
        fire(r, "launch")
        r.ready_at = None
        assert self._http is not None
        try:
            async with self._http.post(self.router_url + "/workers", json={"url": r.url}) as resp:
                body = await resp.json()
                r.worker_id = body.get("worker_id") if resp.status < 300 else None
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
            r.worker_id = None
        if r.worker_id is None:
            r.incarnation = None          # try again at the next poll

    async def _unregister(self, r: RayReplica) -> None:
        if r.worker_id is None or self._http is None:
            return
        try:
            async with self._http.delete(f"{self.router_url}/workers/{r.worker_id}"):
                pass
        except (aiohttp.ClientError, asyncio.TimeoutError):
            pass
        r.worker_id = None

    # -- stop ---------------------------------------------------------------------------------
    async def stop(self) -> None:
        """Drain every replica (bounded by `grace_s`), end the actors for good, stop the router,
        and the cluster if the fleet started it."""
        import ray

        self._stopping = True
        handles = [r.handle for r in self.replicas if r.handle is not None]
        if handles:
            drains = [asyncio.wrap_future(h.drain.remote(self.grace_s).future()) for h in handles]
            await asyncio.wait(drains, timeout=self.grace_s + 5)
            for h in handles:
                ray.kill(h, no_restart=True)
        for r in self.replicas:
            fire(r, "stop")
        await self._stop_router()
        if ray.is_initialized():
            ray.shutdown()
        if self.head is not None:                  # the private cluster: its whole group
            await _stop_group(self.head.pid)
        if self.head_dir is not None:
            shutil.rmtree(self.head_dir, ignore_errors=True)


async def _port_open(port: int) -> bool:
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), 2)
    except (OSError, asyncio.TimeoutError):
        return False
    writer.close()
    return True


async def _stop_group(pgid: int, grace_s: float = 20.0) -> None:
    """SIGTERM to every process of group `pgid`, SIGKILL to what is left after `grace_s`, and
    wait (bounded) until the group is empty."""
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            return
        end = time.monotonic() + wait_s
        while time.monotonic() < end:
            try:
                os.waitpid(pgid, os.WNOHANG)       # reap the leader (our child) if it exited
            except ChildProcessError:
                pass
            try:
                os.killpg(pgid, 0)
            except ProcessLookupError:
                return
            await asyncio.sleep(0.1)
