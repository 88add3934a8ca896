"""Pictures of a recorded run: Mermaid sequence, self-contained HTML, and a real browser."""

from __future__ import annotations

import shutil
import struct
import subprocess
import zlib
from pathlib import Path

import pytest

from actorserve.cli import main as cli
from actorserve.engine.params import SamplingParams
from actorserve.messages import ContinueGeneration, PauseGeneration
from actorserve.replay.recorder import FlightRecorder
from actorserve.replay.render import STATE_COLORS, highlight_for, to_html, to_mermaid_sequence
from actorserve.statemachines import GENERATION, LIFECYCLES, IllegalTransition

from runtime_helpers import make_runtime


async def recorded_run(path: Path):
    rt, engine, _, clock = await make_runtime()
    rec = FlightRecorder(path=path, lifecycles=LIFECYCLES.values(), clock=clock)
    rt.recorder = rt.system.recorder = rec
    hs = []
    for i in range(4):
        clock.advance(0.001)
        hs.append(rt.generate([i + 1, i + 2, i + 3], SamplingParams(max_new_tokens=3 + i)))
    await rt.control(PauseGeneration("in_place"))
    clock.advance(0.002)
    await rt.control(ContinueGeneration())
    for h in hs:
        await h.stream.final()
        clock.advance(0.001)
    # one refused event, on the record
    actor_like = type("A", (), {})()
    actor_like.state, actor_like.rid = GENERATION.initial, hs[0].rid
    with pytest.raises(IllegalTransition):
        GENERATION.fire(actor_like, "deliver", observer=rec)
    await rt.quiesce()
    await rt.shutdown()
    return rec, [h.rid for h in hs]


async def test_mermaid_sequence_has_lanes_steps_and_refusals(tmp_path):
    rec, rids = await recorded_run(tmp_path / "run.jsonl")
    text = to_mermaid_sequence(rec.events())
    assert text.startswith("sequenceDiagram")
    for i in range(1, 5):
        assert f"participant R{i} as" in text
    assert "Note over S: step 1 [" in text
    assert "S->>R1: schedule (queued→prefill)" in text
    assert "-xR1: deliver REFUSED in queued" in text


async def test_highlight_counts_and_failed_edge(tmp_path):
    rec, rids = await recorded_run(tmp_path / "run.jsonl")
    kind, hl = highlight_for(rec.events(), rids[0])
    assert kind == "generation" and hl["current"] == "done"
    assert hl["visited"]["decode"] >= 1 and hl["edges"][("queued", "schedule", "prefill")] == 1
    assert hl["failed_edge"] == ("queued", "deliver", None)


async def test_cli_writes_self_contained_html(tmp_path, capsys):
    path = tmp_path / "run.jsonl"
    rec, rids = await recorded_run(path)
    out = tmp_path / "run.html"
    assert cli(["replay", str(path), "--format", "html", "--out", str(out)]) == 0
    page = out.read_text()
    assert "http://" not in page.replace("http://www.w3.org", "") and "https://" not in page
    assert page.count("class='lane'") == 4 and "class='step'" in page
    assert cli(["replay", str(path), "--format", "mermaid", "--rid", rids[1]]) == 0
    assert "participant R1" in capsys.readouterr().out


def _png_pixels(data: bytes) -> tuple[int, int, list[bytes]]:
    """Decode an 8-bit RGB/RGBA PNG (what Chromium writes) into rows of raw pixels."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, idat, width = 8, b"", 0
    while pos < len(data):
        (n,) = struct.unpack(">I", data[pos:pos + 4])
        ctype, body = data[pos + 4:pos + 8], data[pos + 8:pos + 8 + n]
        if ctype == b"IHDR":
            width, height, depth, color = struct.unpack(">IIBB", body[:10])
            assert depth == 8 and color in (2, 6)
            bpp = 3 if color == 2 else 4
        elif ctype == b"IDAT":
            idat += body
        pos += 12 + n
    raw = zlib.decompress(idat)
    stride = width * bpp
    rows, prev, i = [], bytearray(stride), 0
    for _ in range(height):
        f, line = raw[i], bytearray(raw[i + 1:i + 1 + stride])
        i += 1 + stride
        for x in range(stride):
            a = line[x - bpp] if x >= bpp else 0
            b, c = prev[x], (prev[x - bpp] if x >= bpp else 0)
            if f == 1:
                line[x] = (line[x] + a) & 255
            elif f == 2:
                line[x] = (line[x] + b) & 255
            elif f == 3:
                line[x] = (line[x] + (a + b) // 2) & 255
            elif f == 4:
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                line[x] = (line[x] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 255
        rows.append(bytes(line))
        prev = line
    return width, bpp, rows


CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.mark.skipif(CHROMIUM is None, reason="headless chromium not installed (make setup installs it)")
async def test_headless_chromium_screenshot_shows_the_lanes(tmp_path):
    path = tmp_path / "run.jsonl"
    rec, rids = await recorded_run(path)
    page = tmp_path / "run.html"
    page.write_text(to_html(rec.events()))
    png = tmp_path / "shot.png"
    subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
                    "--disable-background-networking", "--disable-component-update", "--disable-sync",
                    f"--user-data-dir={tmp_path / 'profile'}", f"--screenshot={png}",
                    "--window-size=1100,500", page.as_uri()],
                   check=True, capture_output=True, timeout=90)
    width, bpp, rows = _png_pixels(png.read_bytes())

    def near(rgb, c):
        return all(abs(a - b) <= 6 for a, b in zip(rgb, c))

    def bands(state: str) -> int:
        rgb = tuple(int(STATE_COLORS[state][i:i + 2], 16) for i in (1, 3, 5))
        ys = [y for y, row in enumerate(rows) if any(near(rgb, row[x:x + 3]) for x in range(0, len(row), bpp))]
        return sum(1 for i, y in enumerate(ys) if i == 0 or y != ys[i - 1] + 1)

    # one band is the legend swatch; every request lane ends in a 'done' mark, and the
    # lanes that decoded for a while show a decode bar
    assert bands("done") >= 5, "the 4 request lanes are not in the screenshot"
    assert bands("decode") >= 4 and bands("paused") >= 5
