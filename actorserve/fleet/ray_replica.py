"""One replica as a Ray actor: a whole `actorserve serve` inside the actor's process.

`ReplicaServer` is a plain class; `ray_fleet` wraps it with ``ray.remote`` and the resources
the fleet asks for. Its constructor does what ``actorserve serve`` does (parse the serve
options, load the model, build the runtime: its actors, its engine) and then runs the aiohttp
server on a thread of its own with its own event loop, bound to the node's IP on a port the
kernel picks. Request actors, the scheduler and the engine all live in this one process, as in
a plain replica; Ray only places the process, restarts it when it dies (the constructor runs
again: a new port, a new incarnation) and carries the few control calls below. Nothing here
touches the request path.

Ray runs the constructor and the methods of a (synchronous) actor on one thread; the server's
loop is another, so a slow `drain` never blocks a request.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import threading
import uuid
from typing import Any

READY_TIMEOUT_S = 600.0


class ReplicaServer:
    def __init__(self, serve_args: list[str], name: str) -> None:
        from ..omp import apply_defaults
        apply_defaults()                                         # before torch loads
        import ray

        from ..http.edge import serve_cli
        from ..http.edge.server import build_runtime, serve_async

        parser = argparse.ArgumentParser(prog=f"actorserve replica {name}")
        serve_cli.add_arguments(parser)
        args = parser.parse_args(serve_args)
        args.host, args.port = ray.util.get_node_ip_address(), 0
        config = serve_cli.config_from_args(args)
        built = build_runtime(config)
        self.name = name
        self.incarnation = uuid.uuid4().hex          # new on every (re)start of this actor
        self.url: str | None = None
        self._error: BaseException | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        ready = threading.Event()

        def on_ready(url: str) -> None:
            self.url = url
            ready.set()

        async def main() -> None:
            self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
            await serve_async(config, built=built, on_ready=on_ready, stop=self._stop)

        def run() -> None:
            try:
                asyncio.run(main())
            except BaseException as exc:   # noqa: BLE001 - reported by the constructor below
                self._error = exc
            finally:
                ready.set()

        self._thread = threading.Thread(target=run, name=f"replica-{name}", daemon=True)
        self._thread.start()
        if not ready.wait(READY_TIMEOUT_S) or self.url is None:
            raise RuntimeError(f"replica {name} did not start serving: {self._error!r}")

    def info(self) -> dict[str, Any]:
        """Where this incarnation serves; what the fleet registers with the router."""
        import ray

        ctx = ray.get_runtime_context()
        alive = self._thread.is_alive()
        return {"name": self.name, "url": self.url if alive else None, "pid": os.getpid(),
                "incarnation": self.incarnation, "node_id": ctx.get_node_id(),
                "actor_id": ctx.get_actor_id(), "serving": alive}

    def drain(self, timeout_s: float = 30.0) -> bool:
        """Stop as ``serve`` does on SIGTERM: drain in-flight requests, then close; True once
        the server has stopped within `timeout_s`."""
        if self._loop is not None and self._stop is not None and self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(timeout_s)
        return not self._thread.is_alive()
