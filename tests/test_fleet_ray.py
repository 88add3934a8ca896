"""`actorserve fleet --ray auto`: each replica a Ray actor, restarted by Ray and registered with
the real sglang-router as it comes and goes. Ray binds every interface it finds, so the whole
run (Ray's private cluster, the router, the replicas, the client) happens inside a
loopback-only network namespace (``unshare -n``), with HOME and RAY_TMPDIR in temp folders;
the scenario is tests/ray_fleet_scenario.py, judged here from what it saw."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from actorserve.engine.weights.models import cache_root

HERE = Path(__file__).parent


def _why_not() -> str | None:
    for mod, extra in (("ray", "ray"), ("sglang_router", "fleet")):
        if importlib.util.find_spec(mod) is None:
            return f"{mod} is not installed (pip install 'actorserve[{extra}]')"
    if shutil.which("unshare") is None or shutil.which("ip") is None:
        return "unshare or ip (util-linux, iproute2) not found: no loopback-only namespace"
    r = subprocess.run(["unshare", "-n", "sh", "-c", "ip link set lo up"], capture_output=True)
    if r.returncode != 0:
        return f"network namespaces are not allowed here: {r.stderr.decode().strip()[:200]}"
    return None


def _leftovers(marker: str) -> list[int]:
    """Processes whose command line names `marker` (Ray's daemons name their temp dir)."""
    pids = []
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                if marker.encode() in (p / "cmdline").read_bytes():
                    pids.append(int(p.name))
            except OSError:
                pass
    return pids


@pytest.fixture(scope="module")
def ray_run(tmp_path_factory):
    why = _why_not()
    if why:
        pytest.skip(why)
    home = tmp_path_factory.mktemp("rayhome")
    ray_tmp = tempfile.mkdtemp(prefix="asray", dir="/tmp")   # short: Ray's socket paths
    out = home / "out.json"
    env = {**os.environ, "HOME": str(home), "RAY_TMPDIR": ray_tmp,
           "ACTORSERVE_CACHE": str(cache_root()), "OMP_WAIT_POLICY": "PASSIVE",
           "RAY_USAGE_STATS_ENABLED": "0"}
    cmd = f"ip link set lo up && exec {sys.executable} {HERE / 'ray_fleet_scenario.py'} {out} 18431"
    try:
        proc = subprocess.run(["unshare", "-n", "sh", "-c", cmd], env=env, cwd=HERE.parent,
                              capture_output=True, timeout=1500)
        assert out.exists(), (proc.returncode, proc.stderr[-2000:])
        seen = json.loads(out.read_text())
        seen["leftovers"] = _leftovers(ray_tmp)
        yield seen, (out.parent / "out.json.log")
    finally:
        for pid in _leftovers(ray_tmp):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        shutil.rmtree(ray_tmp, ignore_errors=True)


def test_replicas_are_ray_actors_registered_with_the_router(ray_run):
    seen, log = ray_run
    assert "error" not in seen, (seen.get("error"), log.read_text()[-3000:])
    first = seen["first"]
    assert [r["name"] for r in first] == ["r0", "r1"]
    assert all(r["ray"]["actor_id"] and r["ray"]["resources"] == {"CPU": 1.0, "GPU": 0.0} for r in first)
    assert len({r["pid"] for r in first}) == 2 and len({r["ray"]["actor_id"] for r in first}) == 2
    assert seen["router_first"] == sorted([r["url"], True] for r in first)
    assert all(o.endswith(":200") for o in seen["traffic_before"]), seen["traffic_before"]


def test_a_killed_replica_is_restarted_by_ray_and_re_registered(ray_run):
    seen, log = ray_run
    assert "error" not in seen, (seen.get("error"), log.read_text()[-3000:])
    before, after = seen["first"][0], seen["after"][0]
    assert after["ray"]["actor_id"] == before["ray"]["actor_id"]          # the same actor,
    assert after["pid"] != before["pid"] and after["restarts"] == 1       # a new process
    assert after["ray"]["incarnation"] != before["ray"]["incarnation"]
    assert seen["after"][1]["pid"] == seen["first"][1]["pid"]             # the other untouched
    # out of the router while down, the new URL in (the old one gone) once back
    assert seen["router_while_down"] == [seen["first"][1]["url"]]
    assert seen["router_after"] == sorted([r["url"], True] for r in seen["after"])
    assert all(o.endswith(":200") for o in seen["traffic_while_down"]), seen["traffic_while_down"]
    assert all(o.endswith(":200") for o in seen["traffic_after"]), seen["traffic_after"]


def test_sigterm_stops_the_fleet_and_its_private_cluster(ray_run):
    seen, log = ray_run
    assert seen["exit_code"] == 0, log.read_text()[-3000:]
    assert seen["stop_s"] < 60
    assert seen["leftovers"] == []          # no Ray daemon outlives the fleet that started it


def test_a_fleet_the_private_cluster_cannot_place_fails_at_once(ray_run):
    seen, _ = ray_run
    big = seen["too_big"]
    assert big["exit_code"] == 1, big
    assert "cannot all be placed" in big["stderr"] and "CPU" in big["stderr"], big["stderr"]
    assert big["s"] < 120                     # not the 300 s placement timeout


def test_replica_and_head_command_lines():
    """No namespace needed: what each Ray replica is told to serve (the fleet's own options
    stay with the fleet) and the private head (every port it would take by default is free)."""
    from actorserve.cli import build_parser
    from actorserve.fleet.fleet_cli import serve_args
    from actorserve.fleet.ray_fleet import head_argv

    args = build_parser().parse_args(["fleet", "--ray", "auto", "--ray-cpus", "2", "--replicas", "3",
                                      "--model", "tiny", "--threads", "1", "--replica-id", "box"])
    argv = serve_args(args, 1)
    assert argv[-2:] == ["--replica-id", "box-r1"] and "--model" in argv and "--threads" in argv
    assert not {"--ray", "--ray-cpus", "--replicas", "fleet", "serve"} & set(argv)
    head = head_argv(6379, 2, "/tmp/t")
    assert "--head" in head and "--block" in head and "--node-ip-address=127.0.0.1" in head
    assert "--port=6379" in head and "--temp-dir=/tmp/t" in head and "--num-cpus=2" in head
    for opt in ("--metrics-export-port", "--dashboard-agent-listen-port", "--runtime-env-agent-port"):
        assert any(a.startswith(opt + "=") and int(a.split("=")[1]) > 0 for a in head)


async def test_a_head_that_dies_at_start_is_started_again_a_bounded_number_of_times(monkeypatch, tmp_path):
    """No namespace needed: `ray start` stands in for one that exits at once (e.g. a port taken
    between choosing it and binding it); each try gets fresh ports, then a clear error."""
    from actorserve.fleet import ray_fleet

    ports: list[int] = []
    monkeypatch.setattr(ray_fleet, "_cluster_known", lambda: False)
    monkeypatch.setattr(ray_fleet, "head_argv",
                        lambda port, cpus, d: (ports.append(port), ["sh", "-c", "exit 3"])[1])
    monkeypatch.setenv("RAY_TMPDIR", str(tmp_path))
    for key in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):   # the fleet sets them:
        monkeypatch.setenv(key, "")                                          # undone after the test
        monkeypatch.delenv(key)
    with open(tmp_path / "fleet.log", "wb") as log:
        fleet = ray_fleet.RayFleet(lambda i: [], 2, "round_robin", log=log)
        with pytest.raises(RuntimeError, match="ray start exited with 3, 3 times"):
            await fleet._join_or_start()
    assert len(ports) == ray_fleet.HEAD_ATTEMPTS == 3
    assert (tmp_path / "fleet.log").read_text().count("starting it again on fresh ports") == 2
