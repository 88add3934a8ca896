"""A client that stops reading a stream is cut off after a bound, and its request aborted."""

from __future__ import annotations

import asyncio

import pytest

from actorserve.http.edge import sse


class StuckResponse:
    """A response whose connection takes nothing: every write waits for room forever."""

    def __init__(self) -> None:
        self.writes = 0

    async def write(self, data: bytes) -> None:
        self.writes += 1
        await asyncio.Event().wait()


async def test_a_write_that_cannot_drain_ends_as_a_client_that_went_away():
    resp = StuckResponse()
    with pytest.raises(ConnectionResetError, match="read nothing"):
        await sse.send(resp, {"x": 1}, stall_s=0.01)      # type: ignore[arg-type]
    assert resp.writes == 1


async def test_a_write_that_drains_is_sent_whole():
    class Sink:
        def __init__(self) -> None:
            self.data = b""

        async def write(self, data: bytes) -> None:
            self.data += data

    out = Sink()
    await sse.send(out, {"a": "é"})                       # type: ignore[arg-type]
    assert out.data == 'data: {"a": "é"}\n\n'.encode()


async def test_a_live_client_that_stops_reading_is_aborted_and_frees_its_kv(monkeypatch):
    import socket

    from http_support import load_tiny, serve, settle, until

    monkeypatch.setattr(sse, "WRITE_STALL_S", 0.3)
    async with serve(load_tiny(), kv_blocks=160) as (http, rt):
        host, port = http.server.host, http.server.port
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 2048)   # a tiny window, never read
        sock.setblocking(False)
        loop = asyncio.get_running_loop()
        await loop.sock_connect(sock, (host, port))
        body = ('{"text": "go", "stream": true, "sampling_params": '
                '{"max_new_tokens": 2000, "ignore_eos": true}}').encode()
        await loop.sock_sendall(sock, b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: "
                                b"application/json\r\nContent-Length: " + str(len(body)).encode()
                                + b"\r\n\r\n" + body)
        try:
            await until(lambda: rt.stats().live_requests == 1, timeout=10)
            await until(lambda: any(e.kind == "control" and e.event == "create"
                                    for e in rt.recorder.events()), timeout=60)
            await settle(rt, timeout=10)
            assert rt.stats().live_requests == 0 and rt.stats().kv_used_blocks == 0
            gen = [e for e in rt.recorder.events(kind="generation") if e.dst == "aborted"]
            assert len(gen) == 1 and rt.stats().generated_tokens < 2000   # cut off, not finished
            aborts = [e.data["args"]["reason"] for e in rt.recorder.events(kind="input")
                      if e.event == "control" and e.data["op"] == "AbortRequest"]
            assert aborts == ["client went away"]
        finally:
            sock.close()
        ok = await http.post("/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 2}})
        assert ok.status == 200                                          # the server goes on
