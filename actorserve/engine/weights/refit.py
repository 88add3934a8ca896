"""Weights changed in place: load a model folder into the served model and rebuild every
derived copy of its weights, so that no step reads a stale one.

What is derived from the module weights, and rebuilt here after the copy:

* the oneDNN-packed dense weights (`dense.pack_model`: ``_actorserve_packed`` on each linear);
* the q4/q8 quantized copies (`quant.quantize_model`: each linear's ``QuantLinear`` forward and
  the q/k/v and gate/up `QuantGroup` concatenations);
* the fused decode step (`fused_step.FusedStep`), which holds raw pointers to those quantized
  copies (its norm pointers stay valid: the copy keeps every parameter's storage).

The new folder must hold the same parameters with the same shapes (the same architecture);
anything else is a `WeightsMismatch` and nothing is changed. An update is two phases: `read_checked`
(reading the folder and checking it, the slow part: off the event loop, on a worker thread, while
requests are served) and `apply_checked` (the copy and the rebuild: at the scheduler's barrier, on
the thread the model steps run on, so no forward mixes two versions).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

LOAD_FORMATS = (None, "auto", "safetensors", "pt")


class WeightsMismatch(ValueError):
    """The new weights cannot replace the served ones (a bad path, other names or shapes)."""


def _model_of(engine: Any) -> Any:
    model = getattr(engine, "model", None)
    if model is None or not hasattr(model, "state_dict"):
        raise WeightsMismatch(f"{type(engine).__name__} serves no weights that can be updated")
    return model


def _read_folder(path: str, load_format: str | None) -> dict[str, Any]:
    """The folder's tensors by name (float32), read with transformers like a fresh load."""
    import torch
    from transformers import AutoModelForCausalLM

    from .models import ModelNotFound, resolve_model
    if load_format not in LOAD_FORMATS:
        raise WeightsMismatch(f"unsupported load_format {load_format!r}; use auto, safetensors or pt")
    try:
        folder = resolve_model(path, convert=False)
    except ModelNotFound as exc:
        raise WeightsMismatch(str(exc)) from None
    if not Path(folder).is_dir():
        raise WeightsMismatch(f"{path} is not a model folder (a .gguf must be converted first)")
    try:
        new = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32, local_files_only=True,
                                                   use_safetensors=None if load_format in (None, "auto", "pt")
                                                   else True)
    except (OSError, ValueError, KeyError, RuntimeError) as exc:
        raise WeightsMismatch(f"cannot load {path}: {type(exc).__name__}: {exc}") from None
    return dict(new.state_dict())


def read_folder(path: str, load_format: str | None = None) -> dict[str, Any]:
    """A model folder's tensors by name, unchecked (re-execution reloads a recorded update's
    folder this way: its stand-in engine has no parameters to check them against)."""
    return _read_folder(path, load_format)


def read_checked(engine: Any, path: str, load_format: str | None = None) -> dict[str, Any]:
    """Phase one of an update, on any thread: the folder's tensors by name, checked against the
    served model's names and shapes. Pure I/O and CPU that touches nothing served (it reads the
    served parameters' names and shapes only), so it runs off the event loop while requests go
    on being served. Raises `WeightsMismatch`."""
    model = _model_of(engine)
    new = _read_folder(path, load_format)
    old = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    missing = sorted(set(old) - set(new))
    extra = sorted(set(new) - set(old))
    if missing or extra:
        raise WeightsMismatch(f"{path} holds other parameters than the served model "
                              f"(missing {missing[:3]}, unexpected {extra[:3]})")
    for name, shape in old.items():
        if tuple(new[name].shape) != shape:
            raise WeightsMismatch(f"{path}: {name} has shape {list(new[name].shape)}, "
                                  f"the served model's is {list(shape)}")
    return new


def apply_checked(engine: Any, new: dict[str, Any]) -> int:
    """Phase two, where the model steps run and between two of them: copy `read_checked`'s
    tensors (or `refit_tensors.read_tensors_checked`'s subset) into `engine`'s model in place and rebuild the derived copies; returns how many
    tensors were copied.

    The derived copies are made as a fresh load makes them (`models.load_model`): a quantized
    model is quantized from the float32 weights, then cast back to its dtype, then packed."""
    import torch

    model = _model_of(engine)
    report = getattr(model, "actorserve_quant", None)
    dtype = model.get_input_embeddings().weight.dtype
    _strip_derived(model)
    recast = report is not None and dtype != torch.float32
    if recast:                                 # quantize from float32, as a fresh load does
        model.float()
    n = 0
    try:
        with torch.no_grad():
            for name, t in model.state_dict().items():
                if name in new:                # a partial update (tensors) copies its names only
                    t.copy_(new[name].to(t.dtype))
                    n += 1
        if report is not None:
            from ..kernels.quant import quantize_model
            model.actorserve_quant = quantize_model(model, report.asked or report.mode, dtype)
    finally:                                   # even a failed copy leaves a model that runs in
        if recast:                             # its own dtype with its derived copies (what it
            model.to(dtype)                    # holds then is said by the raised error's caller)
        _rederive(engine, model)
    return n


def load_from_disk(engine: Any, path: str, load_format: str | None = None) -> int:
    """Both phases at once (`read_checked` then `apply_checked`): raises `WeightsMismatch` with
    nothing changed, else returns how many tensors were copied."""
    return apply_checked(engine, read_checked(engine, path, load_format))


def _strip_derived(model: Any) -> None:
    """Forget every derived copy: the linears' quantized or packed forwards, the packed weights,
    the q/k/v and gate/up groups (a layer that no longer quantizes must not keep its old copy)."""
    from ..runners.dense import PACKED, PackedLinear
    from ..kernels.quant import GATE_UP_GROUP, QKV_GROUP, QuantLinear
    for mod in model.modules():
        attrs = vars(mod)
        if isinstance(attrs.get("forward"), (QuantLinear, PackedLinear)):
            del attrs["forward"]
        for name in (PACKED, QKV_GROUP, GATE_UP_GROUP):
            attrs.pop(name, None)
    model.actorserve_quant = None
    model.actorserve_packed = 0


def _rederive(engine: Any, model: Any) -> None:
    """Pack the dense weights again and rebuild the fused decode step's tables."""
    from ..runners.dense import pack_model
    model.actorserve_packed = pack_model(model)
    if getattr(engine, "fused", None) is not None or getattr(engine, "glue", None) is not None:
        from ..kernels.fused_step import FusedStep
        from ..kernels.quant import _Lib as quant_lib
        engine.fused = (FusedStep(engine, quant_lib(), engine.decode_kernel._fn, engine.decode_kernel.part)
                        if engine.decode_kernel is not None and FusedStep.supports(engine) else None)
    report = model.actorserve_quant
    if report is None and getattr(engine, "glue", None) is not None:
        engine.glue = None                     # the C glue serves quantized steps only
    log.info("weights reloaded: %d linears packed, quantization %s", model.actorserve_packed,
             report.describe() if report is not None else "none")


def weights_by_name(engine: Any, name: str, truncate_size: int = 100) -> list[Any]:
    """One parameter's values as nested lists (float32), its first dimension cut at
    `truncate_size` (SGLang's `/get_weights_by_name`)."""
    model = _model_of(engine)
    params = model.state_dict()           # tied weights under each of their names
    if name not in params:
        raise WeightsMismatch(f"no parameter named {name!r}")
    t = params[name].detach()
    return t[:truncate_size].float().tolist() if t.dim() else [float(t)]
