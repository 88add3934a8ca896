"""Weights sent by a trainer process over torch.distributed (`/init_weights_update_group`,
`/update_weights_from_distributed`, `/destroy_weights_update_group`): SGLang's recipe, on gloo.

The group. SGLang's trainers (slime, AReaL, OpenRLHF, verl's SGLang rollout) make a process
group outside any default group: a ``tcp://`` rendezvous whose TCP store the trainer (rank 0)
hosts, the store prefixed with the group's name, then a backend made on it, registered under
that name. `init_custom_process_group` here builds exactly that, so a trainer using SGLang's
own helper and a server using this one meet in one group; the server calls it with
``rank = rank_offset`` (one engine process, tensor parallel 1). Both sides block until every
rank has joined (the store waits for ``world_size`` clients, the backend for a full mesh), so
the trainer's call and the server's ``/init_weights_update_group`` must run concurrently; on
the server it runs on a worker thread, bounded by `INIT_TIMEOUT_S`.

An update. The trainer broadcasts each tensor from rank 0 in the order of the request's
``names``; the server receives each into a fresh tensor of the request's dtype and shape
(`receive_checked`, on a worker thread: neither the event loop nor the model-step thread),
then checks the names and shapes against the served model as a folder is checked
(`refit.read_checked`): any subset of the parameters, each at most once, each of its shape.
The receive always runs in full before the check, so the trainer's broadcasts and the
server's receives stay paired even when the check refuses them; only a request larger than
the whole served model is refused before receiving (it cannot be a legitimate update). The
checked tensors are then copied at the scheduler's step barrier by `refit.apply_checked`,
like every other update.

The trainer's side, for tests, benchmarks and trainers without SGLang at hand::

    from actorserve.engine.weights.weights_group import init_custom_process_group, broadcast_weights
    group = init_custom_process_group(backend="gloo", init_method=f"tcp://{addr}:{port}",
                                      world_size=2, rank=0, group_name="weight_update_group")
    # meanwhile: POST /init_weights_update_group {"master_address": addr, "master_port": port,
    #   "rank_offset": 1, "world_size": 2, "backend": "gloo"}
    # then, per update, concurrently with POST /update_weights_from_distributed
    #   {"names": [...], "dtypes": [...], "shapes": [...]} (`update_body` writes it):
    broadcast_weights(group, named_tensors)
    # and at the end, after POST /destroy_weights_update_group:
    torch.distributed.destroy_process_group(group)
"""

from __future__ import annotations

import inspect
import logging
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Iterable

from .refit import WeightsMismatch, _model_of

log = logging.getLogger(__name__)

INIT_TIMEOUT_S = 60.0       # the rendezvous and the mesh, on the server's side
GROUP_TIMEOUT_S = 600.0     # each collective of the group (a broadcast the trainer never sends)
BACKENDS = ("gloo",)        # nccl needs CUDA devices, which this server does not serve on

_DTYPES = {"float32": "float32", "float": "float32", "float16": "float16", "half": "float16",
           "bfloat16": "bfloat16", "float64": "float64", "double": "float64"}


def dtype_name(spelled: str) -> str | None:
    """The canonical name of a floating dtype as SGLang's clients spell it (``"bfloat16"``,
    ``"torch.bfloat16"``, ``"half"``), or None for anything else."""
    name = spelled[6:] if spelled.startswith("torch.") else spelled
    return _DTYPES.get(name)


class GroupError(RuntimeError):
    """The group could not be made (a rendezvous that timed out, a port taken, a rank clash)."""


def init_custom_process_group(backend: str, init_method: str, world_size: int, rank: int,
                              group_name: str, timeout: timedelta | float | None = None) -> Any:
    """A process group outside any default group, as SGLang's helper of the same name makes it:
    a ``tcp://`` rendezvous (rank 0 hosts the store), the store prefixed with `group_name`, a
    `backend` group registered under `group_name`. Blocks until all `world_size` ranks joined.
    The trainer calls it with ``rank=0``; the server with its ``rank_offset``."""
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import (
        Backend, PrefixStore, _new_process_group_helper, _world, rendezvous,
    )

    if timeout is None:
        timeout = timedelta(seconds=GROUP_TIMEOUT_S)
    elif not isinstance(timeout, timedelta):
        timeout = timedelta(seconds=float(timeout))
    if not dist.is_available():
        raise GroupError("torch.distributed is not available in this build of torch")
    store, rank, world_size = next(rendezvous(init_method, rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    store = PrefixStore(group_name, store)
    kw: dict[str, Any] = {"group_name": group_name, "timeout": timeout}
    params = inspect.signature(_new_process_group_helper).parameters
    kw["backend_options" if "backend_options" in params else "pg_options"] = None
    pg, _ = _new_process_group_helper(world_size, rank, [], Backend(backend), store, **kw)
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}    # ranks are the group's own
    return pg


def broadcast_weights(group: Any, named_tensors: Iterable[tuple[str, Any]]) -> int:
    """The trainer's side of one update: broadcast each tensor from rank 0, in order (the order
    of the request's ``names``). Returns the bytes sent."""
    import torch.distributed as dist
    sent = 0
    for _, t in named_tensors:
        t = t.detach().contiguous()
        dist.broadcast(t, src=0, group=group)
        sent += t.numel() * t.element_size()
    return sent


def update_body(named_tensors: Iterable[tuple[str, Any]], **fields: Any) -> dict[str, Any]:
    """The ``/update_weights_from_distributed`` body describing `named_tensors` (SGLang's)."""
    items = list(named_tensors)
    return {"names": [n for n, _ in items], "dtypes": [str(t.dtype).removeprefix("torch.") for _, t in items],
            "shapes": [list(t.shape) for _, t in items], **fields}


@dataclass
class WeightsGroup:
    """The server's member of one weight-update group."""
    name: str
    backend: str
    rank: int
    world_size: int
    master: str                       # "address:port"
    pg: Any = field(repr=False)
    updates: int = 0                  # updates received through it

    def describe(self) -> dict[str, Any]:
        return {"group_name": self.name, "backend": self.backend, "rank": self.rank,
                "world_size": self.world_size, "master": self.master, "updates": self.updates}


def open_group(master_address: str, master_port: int, rank: int, world_size: int, group_name: str,
               backend: str = "gloo", timeout_s: float | None = None) -> WeightsGroup:
    """The server's side of `init_custom_process_group` (blocking: run it on a worker thread),
    with its errors made plain. The rendezvous and the mesh are bounded by `timeout_s`
    (`INIT_TIMEOUT_S`); the group's collectives then by `GROUP_TIMEOUT_S`."""
    if backend not in BACKENDS:
        raise GroupError(f"backend {backend!r} is not available: this server runs on CPU; use gloo")
    limit = INIT_TIMEOUT_S if timeout_s is None else timeout_s
    host = f"[{master_address}]" if ":" in master_address else master_address
    url = f"tcp://{host}:{master_port}"
    try:
        pg = init_custom_process_group(backend, url, world_size, rank, group_name, timeout=limit)
    except Exception as exc:          # DistStoreError, RuntimeError (gloo), ValueError (a name taken)
        raise GroupError(f"could not join the weight update group {group_name!r} at {url} as rank "
                         f"{rank} of {world_size} within {limit:g}s: {type(exc).__name__}: "
                         f"{(str(exc).splitlines() or [''])[0][:300]}") from None
    _set_timeout(pg, GROUP_TIMEOUT_S)
    log.info("joined weight update group %s at %s: rank %d of %d (%s)", group_name, url, rank,
             world_size, backend)
    return WeightsGroup(group_name, backend, rank, world_size, f"{master_address}:{master_port}", pg)


def _set_timeout(pg: Any, seconds: float) -> None:
    """Collectives of an opened group wait `seconds` (the rendezvous ran under the init bound)."""
    try:
        from torch.distributed.distributed_c10d import _set_pg_timeout
        _set_pg_timeout(timedelta(seconds=seconds), pg)
    except (ImportError, RuntimeError, AttributeError, ValueError) as exc:   # older torch: the init bound stays
        log.debug("cannot set the weight update group's timeout: %r", exc)


def close_group(group: WeightsGroup) -> None:
    """Free the group (its sockets and its name, which can then be used again)."""
    import torch.distributed as dist
    try:
        dist.destroy_process_group(group.pg)
    except (ValueError, RuntimeError) as exc:
        log.warning("destroying the weight update group %s: %r", group.name, exc)


def _mismatch(names: list[str], shapes: list[list[int]], served: dict[str, tuple[int, ...]]) -> str | None:
    """Why these tensors cannot serve (`refit.read_checked`'s rules, any subset), or None."""
    seen: set[str] = set()
    for i, (name, shape) in enumerate(zip(names, shapes)):
        if name in seen:
            return f"names[{i}]: {name} is sent twice"
        seen.add(name)
        if name not in served:
            return f"names[{i}]: no parameter named {name!r} in the served model"
        if tuple(shape) != served[name]:
            return f"shapes[{i}]: {name} has shape {list(shape)}, the served model's is {list(served[name])}"
    return None if names else "names holds no tensor"


def receive_checked(engine: Any, group: WeightsGroup, names: list[str], dtypes: list[str],
                    shapes: list[list[int]]) -> dict[str, Any]:
    """Phase one of a distributed update, on a worker thread: receive each tensor broadcast
    from rank 0 into a fresh one of the request's dtype and shape, in the order of `names`.
    Tensors that cannot serve (`_mismatch`) are still received, one at a time, and dropped, so
    the trainer's broadcasts stay paired with this server's receives; then `WeightsMismatch`.
    A tensor larger than the whole served model is refused before anything is received."""
    import torch
    import torch.distributed as dist

    model = _model_of(engine)
    state = model.state_dict()
    served = {name: tuple(t.shape) for name, t in state.items()}
    served_numel = sum(t.numel() for t in state.values())
    for i, shape in enumerate(shapes):
        n = 1
        for d in shape:
            n *= d
        if n > served_numel:
            raise WeightsMismatch(f"shapes[{i}]: {n} elements, more than the whole served model's "
                                  f"{served_numel}; nothing was received")
    problem = _mismatch(names, shapes, served)
    new: dict[str, Any] = {}
    for name, dt, shape in zip(names, dtypes, shapes):
        t = torch.empty(shape, dtype=getattr(torch, dtype_name(dt) or "float32"))
        dist.broadcast(t, src=0, group=group.pg)
        if problem is None:
            new[name] = t
    group.updates += 1
    if problem is not None:
        raise WeightsMismatch(f"{problem} (the {len(names)} tensors were received and dropped)")
    return new


# -- the trainer's side over HTTP (tests, the rollout benchmark, a trainer without SGLang) ---------

def _post(url: str, body: dict[str, Any], timeout_s: float, api_key: str | None = None) -> tuple[int, Any]:
    import json
    import urllib.error
    import urllib.request
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers=headers, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            return r.status, json.loads(r.read() or b"null")
    except urllib.error.HTTPError as exc:
        raw = exc.read()
        try:
            return exc.code, json.loads(raw or b"null")
        except ValueError:
            return exc.code, raw.decode(errors="replace")


def _alongside(post: Any, work: Any) -> tuple[int, Any, float]:
    """Run the HTTP call `post()` on a thread while `work()` runs here (a join, a broadcast: the
    server's side of each only completes with ours); (status, answer, seconds) of the call."""
    import concurrent.futures
    import time
    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(1) as ex:
        fut = ex.submit(post)
        try:
            work()
        finally:
            status, answer = fut.result()
    return status, answer, time.perf_counter() - t0


def load_named(folder: str, dtype: str = "float32") -> list[tuple[str, Any]]:
    """A model folder's tensors by name, in state-dict order, each storage once (a tied
    ``lm_head.weight`` is the embedding: it is sent once, under the embedding's name)."""
    import torch
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, dtype), local_files_only=True)
    seen: set[int] = set()
    out = []
    for name, t in model.state_dict().items():
        if t.data_ptr() in seen:
            continue
        seen.add(t.data_ptr())
        out.append((name, t.detach().contiguous()))
    return out


def trainer_main(argv: list[str] | None = None) -> int:
    """A trainer process driven by JSON lines on stdin, answering one JSON line each on stdout:
    ``{"op": "join", "master_port": P}`` (joins as rank 0 while it posts
    ``/init_weights_update_group``), ``{"op": "update", "weights": KEY, "fields": {...}}`` (posts
    ``/update_weights_from_distributed`` while it broadcasts the weights loaded as KEY),
    ``{"op": "destroy"}``. First line out: ``{"op": "ready"}`` once the weights are loaded."""
    import argparse
    import json
    import sys

    import torch.distributed as dist

    p = argparse.ArgumentParser(description="a trainer that broadcasts weights to an actorserve server")
    p.add_argument("--server", required=True, help="http://host:port")
    p.add_argument("--weights", action="append", default=[], metavar="KEY=FOLDER")
    p.add_argument("--dtype", default="float32", help="the dtype the tensors are sent in")
    p.add_argument("--master-address", default="127.0.0.1")
    p.add_argument("--api-key", default=None)
    p.add_argument("--timeout", type=float, default=120.0)
    args = p.parse_args(argv)
    sets = {k: load_named(f, args.dtype) for k, f in (w.split("=", 1) for w in args.weights)}
    group: Any = None
    name = "weight_update_group"

    def say(**kw: Any) -> None:
        sys.stdout.write(json.dumps(kw) + "\n")
        sys.stdout.flush()

    say(op="ready", tensors={k: len(v) for k, v in sets.items()})
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd["op"]
        if op == "join":
            name = cmd.get("group_name", name)
            body = {"master_address": args.master_address, "master_port": cmd["master_port"], "rank_offset": 1,
                    "world_size": 2, "group_name": name, "backend": "gloo"}
            box: dict[str, Any] = {}

            def join() -> None:
                try:
                    box["g"] = init_custom_process_group("gloo", f"tcp://{args.master_address}:{cmd['master_port']}",
                                                         2, 0, name, timeout=cmd.get("timeout_s", args.timeout))
                except Exception as exc:           # reported with the server's answer
                    box["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
            status, answer, s = _alongside(lambda: _post(f"{args.server}/init_weights_update_group", body,
                                                         args.timeout, args.api_key), join)
            group = box.get("g")
            say(op=op, status=status, answer=answer, s=s, error=box.get("error"))
        elif op == "update":
            named = sets[cmd["weights"]]
            body = update_body(named, group_name=name, **cmd.get("fields", {}))
            status, answer, s = _alongside(lambda: _post(f"{args.server}/update_weights_from_distributed", body,
                                                         args.timeout, args.api_key),
                                           lambda: broadcast_weights(group, named))
            say(op=op, status=status, answer=answer, s=s)
        elif op == "destroy":
            status, answer = _post(f"{args.server}/destroy_weights_update_group", {"group_name": name},
                                   args.timeout, args.api_key)
            if group is not None:
                dist.destroy_process_group(group)
                group = None
            say(op=op, status=status, answer=answer)
        else:
            say(op=op, error=f"unknown op {op!r}")
    if group is not None:
        dist.destroy_process_group(group)
    return 0


if __name__ == "__main__":
    raise SystemExit(trainer_main())
