"""The Ray fleet scenario, run by tests/test_fleet_ray.py inside a loopback-only network
namespace (Ray binds every interface it finds; here there is only lo).

``python tests/ray_fleet_scenario.py OUT.json PORT`` starts ``actorserve fleet --ray auto
--replicas 2`` (which starts a private Ray cluster on 127.0.0.1), sends mixed traffic, SIGKILLs
replica 0's process, sends traffic while Ray restarts it, waits for it to be back and
registered again, then SIGTERMs the fleet; it writes what it saw to OUT.json for the test to
judge. Every wait is bounded; the fleet is stopped on every path.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time

import aiohttp

from waiting import until      # this script's folder is on sys.path (run as tests/ray_fleet_scenario.py)

MODEL = "tiny-llama"


async def get(http: aiohttp.ClientSession, url: str):  # type: ignore[no-untyped-def]
    try:
        async with http.get(url) as r:
            return await r.json() if r.status == 200 else None
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
        return None


async def mixed(http: aiohttp.ClientSession, url: str, n: int) -> list[str]:
    """n requests of four kinds; each outcome as 'kind:status[:detail]'."""
    async def one(i: int) -> str:
        kind = ("chat", "stream", "generate", "completion")[i % 4]
        if kind == "generate":
            path, body = "/generate", {"text": f"count {i}", "sampling_params": {"max_new_tokens": 4}}
        elif kind == "completion":
            path, body = "/v1/completions", {"model": MODEL, "prompt": f"say {i}", "max_tokens": 4}
        else:
            path, body = "/v1/chat/completions", {
                "model": MODEL, "max_tokens": 4, "stream": kind == "stream",
                "messages": [{"role": "user", "content": f"hello {i}"}]}
        async with http.post(url + path, json=body) as r:
            text = await r.text()
            ok = r.status == 200 and (kind != "stream" or text.rstrip().endswith("data: [DONE]"))
            return f"{kind}:{r.status}" + ("" if ok else f":{text[:200]}")
    return list(await asyncio.gather(*(one(i) for i in range(n))))


def router_urls(workers: dict) -> list[tuple[str, bool]]:
    return sorted((w["url"], bool(w["is_healthy"])) for w in workers.get("workers", []))


async def scenario(url: str, out: dict) -> None:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as http:
        async def all_ready():
            f = await get(http, url + "/fleet")
            return f if f and all(r["state"] == "ready" for r in f["replicas"]) else None

        first = await until(all_ready, 300, poll=0.25, what="both replicas ready")
        out["first"] = first["replicas"]
        out["router_first"] = router_urls(await get(http, first["router"] + "/workers") or {})
        out["traffic_before"] = await mixed(http, url, 12)
        victim = first["replicas"][0]
        os.kill(victim["pid"], signal.SIGKILL)
        killed = time.monotonic()

        async def r0_not_ready():
            f = await get(http, url + "/fleet")
            return f if f and f["replicas"][0]["state"] != "ready" else None

        await until(r0_not_ready, 60, poll=0.25, what="replica 0 seen down")
        out["seen_down_s"] = round(time.monotonic() - killed, 2)

        async def unregistered():
            urls = [u for u, _ in router_urls(await get(http, first["router"] + "/workers") or {})]
            return victim["url"] not in urls and urls

        out["router_while_down"] = await until(unregistered, 30, poll=0.25,
                                               what="the dead URL out of the router")
        out["unregistered_s"] = round(time.monotonic() - killed, 2)
        out["traffic_while_down"] = await mixed(http, url, 8)

        async def r0_back():
            f = await get(http, url + "/fleet")
            return f if f and f["replicas"][0]["state"] == "ready" and f["replicas"][0]["restarts"] >= 1 else None

        back = await until(r0_back, 300, poll=0.25, what="replica 0 back")
        out["back_s"] = round(time.monotonic() - killed, 2)
        out["after"] = back["replicas"]
        out["router_after"] = router_urls(await get(http, back["router"] + "/workers") or {})
        out["traffic_after"] = await mixed(http, url, 12)


def too_big(out: dict) -> None:
    """A fleet asking more CPUs than the private cluster has fails at once, saying why."""
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "actorserve.cli", "fleet", "--ray", "auto",
                        "--replicas", "3", "--ray-cpus", str(os.cpu_count() or 1), "--model", "tiny"],
                       capture_output=True, timeout=180)
    err = r.stderr.decode(errors="replace")     # Ray's head logs its own shutdown after ours
    out["too_big"] = {"exit_code": r.returncode, "s": round(time.monotonic() - t0, 1),
                      "stderr": "\n".join(line for line in err.splitlines()
                                          if line.startswith("actorserve fleet:")) or err[-600:]}


def main() -> int:
    out_path, port = sys.argv[1], int(sys.argv[2])
    out: dict = {}
    try:
        too_big(out)
    except subprocess.TimeoutExpired:
        out["too_big"] = {"exit_code": None}
    log = open(out_path + ".log", "wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "actorserve.cli", "fleet", "--ray", "auto", "--replicas", "2",
         "--ray-cpus", "1", "--model", "tiny", "--threads", "1", "--embedding-model", "none",
         "--policy", "round_robin", "--port", str(port)],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        asyncio.run(scenario(f"http://127.0.0.1:{port}", out))
    except Exception as exc:                 # noqa: BLE001 - reported to the test
        out["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        t0 = time.monotonic()
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            out["exit_code"] = proc.wait(timeout=90)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out["exit_code"] = proc.wait()
        out["stop_s"] = round(time.monotonic() - t0, 2)
        with open(out_path, "w") as f:
            json.dump(out, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
