"""``backend: "python"`` with ``platform: "pytorch"``: Triton's PyTorch platform handler, Sluice's own.

Triton's Python backend runs a bundled handler instead of a ``TritonPythonModel`` when the config names
this platform (marked experimental there): the version directory holds a plain PyTorch model, either
``model.py`` defining a ``torch.nn.Module`` subclass (built with no arguments, its weights loaded from
``model.pt`` beside it when present, then ``torch.compile``d) or a TorchScript ``model.pt``.
``default_model_filename`` is tried first. Inputs are passed positionally in the config's order and the
outputs (one tensor, or a tuple/list) named in the config's order. Parameters, as Triton's handler
reads them: ``TORCH_COMPILE_OPTIONAL_PARAMETERS`` (a JSON object of ``torch.compile`` keyword
arguments, e.g. ``{"backend": "eager"}`` or ``{"disable": true}``), ``NUM_THREADS`` and
``NUM_INTEROP_THREADS``.

Differences from Triton's handler, each because Sluice runs every model in one process: the thread
settings change the whole process (Triton's handler runs in a stub process of its own), so they are
applied only when the config sets them, never defaulted to 1; the ``torch.nn.Module`` subclass is the
first one defined in ``model.py`` itself (Triton takes the first name in ``dir()``, which can be one
the file imported); requests of a batch are concatenated for real (Triton's handler drops the
concatenation, so a batch of several requests runs only the first one's rows).

Imported only when such a model loads (torch is an optional extra).
"""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType
from typing import Any

from sluice.runtime.backends import triton_python_backend_utils as pb_utils

PLATFORM = "pytorch"
MODEL_FILES = ("model.py", "model.pt")
"""Tried in this order after ``default_model_filename`` (Triton's handler's order)."""


def model_file(version_dir: Path, default_filename: str) -> Path | None:
    """The file the handler loads, None when the version directory has none of them."""
    for name in ((default_filename,) if default_filename else ()) + MODEL_FILES:
        if (version_dir / name).is_file():
            return version_dir / name
    return None


def module_class(module: ModuleType) -> type | None:
    """The ``torch.nn.Module`` subclass ``model.py`` defines (the first by name), else one it imported."""
    import torch

    found: list[type] = []
    for name in sorted(dir(module)):
        attr = getattr(module, name)
        if isinstance(attr, type) and issubclass(attr, torch.nn.Module) and attr is not torch.nn.Module:
            found.append(attr)
    own = [cls for cls in found if cls.__module__ == module.__name__]
    chosen = own or found
    return chosen[0] if chosen else None


def compile_options(config: dict[str, Any]) -> dict[str, Any]:
    """``TORCH_COMPILE_OPTIONAL_PARAMETERS`` as keyword arguments; raises ValueError naming the problem."""
    parameter = (config.get("parameters") or {}).get("TORCH_COMPILE_OPTIONAL_PARAMETERS")
    if parameter is None:
        return {}
    text = parameter.get("string_value", "")
    try:
        options = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"parameter TORCH_COMPILE_OPTIONAL_PARAMETERS is not JSON ({exc.msg}): {text!r}") from None
    if not isinstance(options, dict):
        raise ValueError(
            "parameter TORCH_COMPILE_OPTIONAL_PARAMETERS must be a JSON object of torch.compile arguments, "
            f"got {text!r}"
        )
    if "model" in options:
        raise ValueError("'model' is not an optional parameter for 'torch.compile'")
    return options


def handler(model_path: Path, module: ModuleType | None) -> type:
    """The ``TritonPythonModel`` class that serves ``model_path`` (``module``: the imported ``model.py``)."""
    cls = module_class(module) if module is not None else None
    if module is not None and cls is None:
        raise pb_utils.TritonModelException(f"Cannot find a subclass of torch.nn.Module in {model_path.name}")
    return type("TritonPythonModel", (_TorchPlatformModel,), {"_path": model_path, "_class": cls})


class _TorchPlatformModel:
    _path: Path
    _class: type | None

    def initialize(self, args: dict[str, str]) -> None:
        import torch

        config = json.loads(args["model_config"])
        self._batched = int(config.get("max_batch_size", 0)) > 0
        self._inputs = [io["name"] for io in config.get("input", [])]
        self._outputs = [io["name"] for io in config.get("output", [])]
        parameters = config.get("parameters") or {}
        for key, setter in (("NUM_THREADS", torch.set_num_threads), ("NUM_INTEROP_THREADS", _set_interop_threads)):
            if key in parameters:
                setter(int(parameters[key]["string_value"]))
        kind = args["model_instance_kind"]
        self._device = torch.device(f"cuda:{args['model_instance_device_id']}" if kind == "GPU" else "cpu")
        if self._class is None:  # TorchScript
            self._model = torch.jit.load(str(self._path), map_location=self._device).eval()
            return
        module = self._class()
        weights = self._path.with_suffix(".pt")
        if weights.is_file():
            module.load_state_dict(torch.load(weights, map_location=self._device, weights_only=True))
        module = module.to(self._device).eval()
        self._model = torch.compile(module, **compile_options(config))

    def execute(self, requests: list[Any]) -> list[Any]:
        import torch

        per_request = []
        for request in requests:
            tensors = []
            for name in self._inputs:
                found = pb_utils.get_input_tensor_by_name(request, name)
                if found is None:
                    raise pb_utils.TritonModelException(f"input '{name}' is missing")
                tensors.append(torch.tensor(found.as_numpy()).to(self._device))
            per_request.append(tensors)
        with torch.inference_mode():
            if self._batched and len(per_request) > 1:
                rows = [tensors[0].shape[0] for tensors in per_request] if self._inputs else [0] * len(per_request)
                merged = [torch.cat(column, 0) for column in zip(*per_request, strict=True)]
                outputs = self._as_list(self._model(*merged))
                split = [output.split(rows, 0) for output in outputs]
                answers = [[parts[i] for parts in split] for i in range(len(per_request))]
            else:
                answers = [self._as_list(self._model(*tensors)) for tensors in per_request]
        responses = []
        for outputs in answers:
            if len(outputs) < len(self._outputs):
                raise pb_utils.TritonModelException(
                    f"the model returned {len(outputs)} tensor(s); the config names {len(self._outputs)} output(s)"
                )
            named = zip(self._outputs, outputs[: len(self._outputs)], strict=True)
            response = [pb_utils.Tensor(name, out.detach().cpu().numpy()) for name, out in named]
            responses.append(pb_utils.InferenceResponse(output_tensors=response))
        return responses

    @staticmethod
    def _as_list(result: Any) -> list[Any]:
        return list(result) if isinstance(result, (tuple, list)) else [result]


def _set_interop_threads(count: int) -> None:
    import torch

    try:
        torch.set_num_interop_threads(count)
    except RuntimeError:  # torch allows it once, before any inter-op work; later calls keep the first
        pass
