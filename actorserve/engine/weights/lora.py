"""Multi-LoRA, the engine half: PEFT adapters read into slots, served beside the base model.

Folders. An adapter is a PEFT folder: ``adapter_config.json`` (``peft_type`` LORA, ``r``,
``lora_alpha``, ``use_rslora``, ``target_modules``) and ``adapter_model.safetensors`` holding
``...layers.<i>.{self_attn,mlp}.<module>.lora_A.weight`` ``[r, in]`` and ``lora_B.weight``
``[out, r]``. `read_adapter` reads them with json and safetensors alone (peft is never
imported at run time) and checks them against the base model: the modules must be any of
q/k/v/o/gate/up/down_proj that the model has as separate linears (Phi-3's fused projections
are not), every A/B pair must fit that linear's shape, the rank must not pass ``max_rank``,
and what PEFT can save but this engine does not compute (DoRA, biases, ``modules_to_save``,
per-module rank or alpha patterns, fan-in-fan-out weights, pickled ``.bin`` weights) is
refused. A bad folder raises `LoraFolderError` (a `LoraError`, a ``ValueError``) naming the
folder and what is wrong. The scaling is ``lora_alpha / r`` (``lora_alpha / sqrt(r)`` with
rsLoRA), folded into B; A and B are held in float32 (the step computes its small products in
float32 whatever the model's dtype, `lora_step`).

Slots. `LoraSlots` (the paged runner's ``runner.lora``) holds at most ``max_loaded``
adapters, each in a slot, under a unique name. The interface the adapter lifecycle uses:

* ``ref = slots.load(name, path)``: read, check and place an adapter in a free slot; returns
  its `LoraRef` ``(name, slot, uid, key)``. ``uid`` is new for every load (so a slot reused by
  another load is told apart); ``key`` is a digest of the adapter's config and weights (the
  prefix cache's salt: the same adapter, whatever its name or slot, computes the same KV).
  `LoraSlotsFull` when every slot is taken, `LoraError` for a name already loaded. Reading
  the folder happens outside the lock and never touches the slots a step is reading, so it
  may run off the step thread; only the slot assignment is under the lock.
* ``slots.acquire(name) -> LoraRef`` / ``slots.release(ref)``: a sequence that will run
  under the adapter holds it (``Sequence.lora = slots.acquire(name)``) until it ends.
* ``slots.unload(name) -> LoraRef``: free the slot; `LoraInUse` while any hold is left
  (the lifecycle waits for, or aborts, the holders first), `LoraNotLoaded` for an unknown name.
* ``slots.get(name)``, ``slots.loaded()``: what is loaded, for listings.

A step (`lora_step.LoraStep`, made by ``slots.step(batch, plan)``) checks that each member's
`LoraRef` is still the adapter in its slot (same uid): a sequence whose adapter was unloaded
fails its step loudly instead of running under another adapter or the base. The adapters of a
step are laid side by side once per set of adapters (`lora_step.Combo`; the last
`COMBO_CACHE` sets are kept, dropped when one of theirs is unloaded).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import re
import threading
from pathlib import Path
from typing import Any

import torch

from .lora_adapter import LoraAdapter
from ..runners.lora_step import Combo, LoraStep
from ..runners.paged_attention import StepPlan
from ..scheduling.sequence import LoraRef, Sequence

__all__ = ["CONFIG_FILE", "SUPPORTED_MODULES", "WEIGHTS_FILE", "LoraAdapter", "LoraError",
           "LoraFolderError", "LoraInUse", "LoraNotLoaded", "LoraRef", "LoraSlots", "LoraSlotsFull",
           "model_shapes", "read_adapter"]

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# the linears an adapter may target, and the submodule of a layer that holds each
SUPPORTED_MODULES = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn",
                     "o_proj": "self_attn", "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.(self_attn|mlp)\.([a-z_]+)\.lora_([AB])(?:\.default)?\.weight$")
_uids = itertools.count(1)
COMBO_CACHE = 4         # sets of adapters laid out for steps, kept (most recent first)


class LoraError(ValueError):
    """An adapter operation that cannot be done (the message says why)."""


class LoraFolderError(LoraError):
    """A folder that is not a PEFT LoRA adapter this engine can serve on its base model."""


class LoraSlotsFull(LoraError):
    """Every slot holds an adapter."""


class LoraInUse(LoraError):
    """An unload while sequences still hold the adapter."""


class LoraNotLoaded(LoraError):
    """A name (or a sequence's `LoraRef`) that no slot holds (any more)."""


def model_shapes(layers: list[Any]) -> dict[tuple[int, str], tuple[int, int]]:
    """``(layer, module) -> (out_features, in_features)`` of each linear an adapter may target
    that the model has (as a separate ``nn.Linear``)."""
    shapes: dict[tuple[int, str], tuple[int, int]] = {}
    for li, layer in enumerate(layers):
        for name, parent in SUPPORTED_MODULES.items():
            mod = getattr(getattr(layer, parent, None), name, None)
            if isinstance(mod, torch.nn.Linear):
                shapes[(li, name)] = (int(mod.out_features), int(mod.in_features))
    return shapes


def _config(folder: Path, bad: Any) -> dict[str, Any]:
    try:
        cfg = json.loads((folder / CONFIG_FILE).read_text())
    except FileNotFoundError:
        raise bad(f"no {CONFIG_FILE}") from None
    except (OSError, ValueError) as e:
        raise bad(f"{CONFIG_FILE} is not readable JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise bad(f"{CONFIG_FILE} is not a JSON object")
    if str(cfg.get("peft_type", "LORA")).upper() != "LORA":
        raise bad(f"peft_type {cfg.get('peft_type')!r} is not LORA")
    for flag, why in (("use_dora", "DoRA"), ("fan_in_fan_out", "fan_in_fan_out weights")):
        if cfg.get(flag):
            raise bad(f"{why} ({flag}) is not supported")
    if cfg.get("bias", "none") not in (None, "none"):
        raise bad(f"bias {cfg.get('bias')!r} is not supported (only 'none')")
    for key in ("modules_to_save", "rank_pattern", "alpha_pattern"):
        if cfg.get(key):
            raise bad(f"{key} is not supported")
    r, alpha = cfg.get("r"), cfg.get("lora_alpha", cfg.get("r"))
    if not isinstance(r, int) or isinstance(r, bool) or r < 1:
        raise bad(f"r must be a positive integer, got {r!r}")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not math.isfinite(alpha):
        raise bad(f"lora_alpha must be a number, got {alpha!r}")
    targets = cfg.get("target_modules")
    if isinstance(targets, (list, tuple)):
        odd = sorted(str(t) for t in targets if t not in SUPPORTED_MODULES)
        if odd:
            raise bad(f"target_modules {odd} not supported (any of {', '.join(SUPPORTED_MODULES)})")
    return cfg


def read_adapter(name: str, path: str | Path, shapes: dict[tuple[int, str], tuple[int, int]], *,
                 max_rank: int) -> LoraAdapter:
    """Read and check the PEFT folder at `path` against the model's linears `shapes`
    (`model_shapes`); see the module docstring. Raises `LoraFolderError`."""
    from safetensors import SafetensorError
    from safetensors.torch import load as load_safetensors

    folder = Path(path).expanduser()

    def bad(why: str) -> LoraFolderError:
        return LoraFolderError(f"LoRA adapter {name!r} at {str(path)!r}: {why}")

    if not folder.is_dir():
        raise bad("not a folder")
    cfg = _config(folder, bad)
    rank = int(cfg["r"])
    if rank > max_rank:
        raise bad(f"rank {rank} is above max_lora_rank {max_rank}")
    alpha = float(cfg.get("lora_alpha", rank))
    scaling = alpha / math.sqrt(rank) if cfg.get("use_rslora") else alpha / rank
    wfile = folder / WEIGHTS_FILE
    if not wfile.is_file():
        extra = " (adapter_model.bin is pickled; only safetensors is read)" \
            if (folder / "adapter_model.bin").exists() else ""
        raise bad(f"no {WEIGHTS_FILE}{extra}")
    raw = wfile.read_bytes()
    try:
        tensors = load_safetensors(raw)
    except (SafetensorError, ValueError, RuntimeError) as e:
        raise bad(f"{WEIGHTS_FILE} is not a readable safetensors file ({e})") from None
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        m = _KEY.search(key)
        if m is None:
            raise bad(f"tensor {key!r} is not a LoRA A/B weight of q/k/v/o/gate/up/down_proj")
        li, parent, mod, ab = int(m.group(1)), m.group(2), m.group(3), m.group(4)
        if SUPPORTED_MODULES.get(mod) != parent:
            raise bad(f"tensor {key!r}: module {parent}.{mod} is not supported "
                      f"(any of {', '.join(SUPPORTED_MODULES)})")
        if (li, mod) not in shapes:
            raise bad(f"tensor {key!r}: the base model has no separate linear {parent}.{mod} in layer {li}")
        if ab in pairs.setdefault((li, mod), {}):
            raise bad(f"tensor {key!r} appears twice")
        if not t.is_floating_point() or t.dim() != 2:
            raise bad(f"tensor {key!r} must be a 2-D floating-point matrix, got {t.dtype} {tuple(t.shape)}")
        pairs[(li, mod)][ab] = t
    if not pairs:
        raise bad(f"{WEIGHTS_FILE} holds no LoRA weights")
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
    nbytes = 0
    for (li, mod), ab in sorted(pairs.items()):
        where = f"layer {li} {mod}"
        if set(ab) != {"A", "B"}:
            raise bad(f"{where}: lora_A and lora_B must come together")
        a, b = ab["A"], ab["B"]
        out_f, in_f = shapes[(li, mod)]
        if a.shape[0] != rank or b.shape[1] != rank:
            raise bad(f"{where}: A {tuple(a.shape)} and B {tuple(b.shape)} do not have rank r={rank}")
        if a.shape[1] != in_f or b.shape[0] != out_f:
            raise bad(f"{where}: A {tuple(a.shape)} and B {tuple(b.shape)} do not fit the base "
                      f"linear's [{out_f}, {in_f}] (another base model's adapter?)")
        if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
            raise bad(f"{where}: weights that are not finite")
        A = a.float().contiguous()
        B = (b.float() * scaling).t().contiguous().t()      # [out, r], held as B^T [r, out]
        weights[(li, mod)] = (A, B)
        nbytes += A.numel() * A.element_size() + B.numel() * B.element_size()
    modules = tuple(m for m in SUPPORTED_MODULES if any(k[1] == m for k in weights))
    digest = hashlib.sha256(b"actorserve-lora\0")
    digest.update(json.dumps(cfg, sort_keys=True, default=str).encode())
    digest.update(b"\0")
    digest.update(raw)
    return LoraAdapter(name=name, path=str(path), rank=rank, alpha=alpha, scaling=scaling, modules=modules,
                       weights=weights, key=digest.digest(), nbytes=nbytes,
                       layers=frozenset(li for li, _ in weights))


class LoraSlots:
    """The loaded adapters, in at most `max_loaded` slots (see the module docstring)."""

    def __init__(self, layers: list[Any], *, max_loaded: int, max_rank: int) -> None:
        if max_loaded < 0 or max_rank < 1:
            raise ValueError("max_loaded_loras must be >= 0 and max_lora_rank >= 1")
        self.max_loaded = int(max_loaded)
        self.max_rank = int(max_rank)
        self.shapes = model_shapes(layers)
        self._slots: list[tuple[LoraRef, LoraAdapter] | None] = [None] * self.max_loaded
        self._by_name: dict[str, int] = {}
        self._holds: dict[int, int] = {}          # uid -> sequences holding it
        self._combos: dict[tuple[int, ...], Combo] = {}   # uids -> their layout, most recent last
        self._lock = threading.Lock()

    # -- lifecycle interface -----------------------------------------------------------------
    def load(self, name: str, path: str | Path) -> LoraRef:
        """`read` then `place`: read and check the folder, then put it in a free slot."""
        with self._lock:
            self._check_room(self._check_name(name))
        return self.place(name, self.read(name, path))

    def read(self, name: str, path: str | Path) -> Any:
        """Read and check the folder (no slot is taken: any thread, outside the lock)."""
        self._check_name(name)
        return self._read(name, path)

    def place(self, name: str, adapter: Any) -> LoraRef:
        """Put a `read` adapter in a free slot; `LoraSlotsFull` / `LoraError` as `load`."""
        with self._lock:
            slot = self._check_room(name)
            ref = LoraRef(name, slot, next(_uids), adapter.key)
            self._slots[slot] = (ref, adapter)
            self._by_name[name] = slot
            self._holds[ref.uid] = 0
            return ref

    def _check_name(self, name: str) -> str:
        if not isinstance(name, str) or not name:
            raise LoraError("a LoRA adapter needs a non-empty name")
        if self.max_loaded == 0:
            raise LoraSlotsFull("LoRA adapters are off: this engine has no adapter slots (max_loaded_loras=0)")
        return name

    def _read(self, name: str, path: str | Path) -> Any:
        """Read and check the folder, outside the lock (what a slot holds: it has a ``key``)."""
        return read_adapter(name, path, self.shapes, max_rank=self.max_rank)

    def _check_room(self, name: str) -> int:
        if name in self._by_name:
            raise LoraError(f"a LoRA adapter named {name!r} is already loaded")
        for slot, held in enumerate(self._slots):
            if held is None:
                return slot
        raise LoraSlotsFull(f"every LoRA slot is taken ({self.max_loaded} loaded: max_loaded_loras)")

    def unload(self, name: str) -> LoraRef:
        with self._lock:
            ref, _ = self._entry(name)
            if self._holds.get(ref.uid, 0):
                raise LoraInUse(f"LoRA adapter {name!r} is used by {self._holds[ref.uid]} sequence(s)")
            self._slots[ref.slot] = None
            del self._by_name[name]
            self._holds.pop(ref.uid, None)
            self._combos = {k: c for k, c in self._combos.items() if ref.uid not in k}
            return ref

    def acquire(self, name: str) -> LoraRef:
        with self._lock:
            ref, _ = self._entry(name)
            self._holds[ref.uid] += 1
            return ref

    def release(self, ref: LoraRef) -> None:
        with self._lock:
            if self._holds.get(ref.uid, 0) > 0:
                self._holds[ref.uid] -= 1

    def holders(self, name: str) -> int:
        with self._lock:
            ref, _ = self._entry(name)
            return self._holds.get(ref.uid, 0)

    def get(self, name: str) -> LoraRef | None:
        with self._lock:
            slot = self._by_name.get(name)
            return None if slot is None else self._slots[slot][0]     # type: ignore[index]

    def adapter(self, name: str) -> LoraAdapter:
        with self._lock:
            return self._entry(name)[1]

    def loaded(self) -> list[LoraRef]:
        with self._lock:
            return [held[0] for held in self._slots if held is not None]

    def _entry(self, name: str) -> tuple[LoraRef, LoraAdapter]:
        slot = self._by_name.get(name)
        if slot is None:
            raise LoraNotLoaded(f"no LoRA adapter named {name!r} is loaded")
        held = self._slots[slot]
        assert held is not None
        return held

    # -- the step ----------------------------------------------------------------------------
    def resolve(self, ref: LoraRef) -> LoraAdapter:
        """The adapter a sequence's `ref` names, if its slot still holds that very load."""
        held = self._slots[ref.slot] if 0 <= ref.slot < len(self._slots) else None
        if held is None or held[0].uid != ref.uid:
            raise LoraNotLoaded(f"LoRA adapter {ref.name!r} (slot {ref.slot}) is no longer loaded")
        return held[1]

    def step(self, batch: list[tuple[Sequence, int]], plan: StepPlan) -> LoraStep | None:
        """The step's adapter segments, or None when every member runs on the base model."""
        if all(seq.lora is None for seq, _ in batch):
            return None
        uid_of: dict[int, int] = {}
        members = []
        for (seq, n), last in zip(batch, plan.last_rows):
            ad = None
            if seq.lora is not None:
                ad = self.resolve(seq.lora)
                uid_of[id(ad)] = seq.lora.uid
            members.append((ad, n, last))
        adapters, runs = LoraStep.plan(members)
        if not runs:
            return None
        key = tuple(uid_of[id(ad)] for ad in adapters)
        with self._lock:
            combo = self._combos.pop(key, None)
        if combo is None:
            combo = Combo(adapters)
        with self._lock:
            self._combos[key] = combo               # most recent last
            while len(self._combos) > COMBO_CACHE:
                del self._combos[next(iter(self._combos))]
        return LoraStep.of(combo, runs, plan.num_tokens)
