"""Headless Chromium for the picture tests: screenshots, the DOM after scripts ran, PNG pixels.

Debian's ``chromium`` (``make browser`` installs it when it can); tests that need it skip
with `SKIP_REASON` when it is absent. Every run gets a fresh profile and none of the
browser's own network traffic (no first-run, sync, component updates or QUIC), so a run
depends on nothing but the file it opens. PNGs are decoded here with zlib + struct (8-bit
RGB/RGBA, every filter type), one row of bytes per pixel row.
"""

from __future__ import annotations

import shutil
import struct
import subprocess
import zlib
from pathlib import Path

CHROMIUM = next((p for p in (shutil.which("chromium"), shutil.which("chromium-browser"),
                             "/usr/bin/chromium") if p and Path(p).exists()), None)
SKIP_REASON = "headless chromium is not installed (Debian package chromium; `make browser`)"
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--hide-scrollbars", "--force-device-scale-factor=1"]


def _run(tmp: Path, args: list[str], url: str) -> subprocess.CompletedProcess:
    profile = tmp / f"profile-{len(list(tmp.glob('profile-*')))}"
    assert CHROMIUM is not None
    return subprocess.run([CHROMIUM, *FLAGS, f"--user-data-dir={profile}", *args, url],
                          check=True, capture_output=True, timeout=120)


def screenshot(tmp: Path, page: Path, width: int, height: int) -> "Image":
    png = tmp / (page.stem + ".png")
    _run(tmp, [f"--screenshot={png}", f"--window-size={width},{height}"], page.as_uri())
    return Image(png.read_bytes())


def dump_dom(tmp: Path, page: Path, width: int, height: int, fragment: str = "") -> str:
    """The page's DOM once its scripts have run (same window size as a screenshot);
    `fragment` (``#zoom=4``) is added to the page's URL."""
    r = _run(tmp, ["--dump-dom", f"--window-size={width},{height}"], page.as_uri() + fragment)
    return r.stdout.decode("utf-8")


def rgb(color: str) -> tuple[int, int, int]:
    return tuple(int(color[i:i + 2], 16) for i in (1, 3, 5))  # type: ignore[return-value]


class Image:
    """A decoded PNG: `pixel(x, y)` -> (r, g, b)."""

    def __init__(self, data: bytes):
        assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
        pos, idat = 8, b""
        while pos < len(data):
            (n,) = struct.unpack(">I", data[pos:pos + 4])
            ctype, body = data[pos + 4:pos + 8], data[pos + 8:pos + 8 + n]
            if ctype == b"IHDR":
                self.width, self.height, depth, color = struct.unpack(">IIBB", body[:10])
                assert depth == 8 and color in (2, 6), (depth, color)
                self.bpp = 3 if color == 2 else 4
            elif ctype == b"IDAT":
                idat += body
            pos += 12 + n
        raw, stride, bpp = zlib.decompress(idat), self.width * self.bpp, self.bpp
        self.rows: list[bytes] = []
        prev, i = bytearray(stride), 0
        for _ in range(self.height):
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
            self.rows.append(bytes(line))
            prev = line

    def pixel(self, x: float, y: float) -> tuple[int, int, int]:
        xi, yi = int(x), int(y)
        assert 0 <= xi < self.width and 0 <= yi < self.height, (x, y, self.width, self.height)
        o = xi * self.bpp
        return tuple(self.rows[yi][o:o + 3])  # type: ignore[return-value]

    def near(self, x: float, y: float, color: str, tol: int = 6) -> bool:
        return all(abs(a - b) <= tol for a, b in zip(self.pixel(x, y), rgb(color)))
