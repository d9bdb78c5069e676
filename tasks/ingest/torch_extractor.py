"""A user's PyTorch model as a feature extractor, with weights from a local file (nothing downloaded).

``model`` is an import path ``package.module:Factory`` to an ``nn.Module`` class or a function
returning one, built with ``model_kwargs``; ``weights`` is a state dict saved with ``torch.save``
(read with ``weights_only=True``: no pickled code runs) or a ``.safetensors`` file. The file's
SHA-256 is recorded in the store with the extractor, so a rerun, an extension of the store or a
prediction with other weights is refused. Tiles are converted to float in [0, 1], resized to
``input_size`` if given, normalised with ``mean``/``std`` (ImageNet's by default) and run through
the model ``batch_size`` at a time under ``torch.inference_mode`` on ``device`` (``auto``: the
worker's GPU if it has one). The module is built lazily, on the worker that uses it: the extractor
travels to workers as its parameters only.

The package extra ``torch`` installs PyTorch and safetensors. Recipes (ResNet-50, timm foundation
models) are in ``docs/STORE.md``.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import numpy as np

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


_HASHES: dict[tuple[str, int, int], str] = {}  # (path, size, mtime_ns) -> SHA-256, per process
_MODULES: dict[tuple[Any, ...], Any] = {}  # built modules per process: one load per worker, not per slide


def file_sha256(path: str | Path) -> str:
    """SHA-256 of a file, remembered per process while its size and modification time stay the same
    (an extractor is unpickled once per slide task on a worker; weights can be gigabytes)."""
    stat = Path(path).stat()
    key = (str(Path(path).resolve()), stat.st_size, stat.st_mtime_ns)
    if key not in _HASHES:
        digest = hashlib.sha256()
        with open(path, "rb") as handle:
            for block in iter(lambda: handle.read(1 << 20), b""):
                digest.update(block)
        _HASHES[key] = digest.hexdigest()
    return _HASHES[key]


class TorchExtractor:
    """``(B, H, W, C)`` tiles → ``(B, n_features)`` float32 through a local ``torch.nn.Module``."""

    name = "torch"
    version = "1"

    def __init__(self, model: str, weights: str | None = None, model_kwargs: dict[str, Any] | None = None,
                 weights_sha256: str | None = None, n_features: int | None = None, batch_size: int = 64,
                 device: str = "auto", input_size: int | None = None, mean: list[float] | None = None,
                 std: list[float] | None = None, strict: bool = True):
        self.model = str(model)
        self.weights = None if weights is None else str(weights)
        self.model_kwargs = dict(model_kwargs or {})
        self.batch_size = int(batch_size)
        self.device = device
        self.input_size = None if input_size is None else int(input_size)
        self.mean = list(IMAGENET_MEAN if mean is None else mean)
        self.std = list(IMAGENET_STD if std is None else std)
        self.strict = bool(strict)
        if self.weights is not None:
            if not Path(self.weights).is_file():
                raise FileNotFoundError(f"torch extractor weights {self.weights}: no such file")
            actual = file_sha256(self.weights)
            if weights_sha256 is not None and weights_sha256 != actual:
                raise ValueError(f"torch extractor weights {self.weights} have SHA-256 {actual[:12]}…, not the "
                                 f"{weights_sha256[:12]}… recorded with the store: other weights give other features")
            weights_sha256 = actual
        self.weights_sha256 = weights_sha256
        self._module: Any = None
        self._torch_device: Any = None
        self.n_features = int(n_features) if n_features is not None else self._infer_n_features()

    def params(self) -> dict[str, Any]:
        return {"model": self.model, "weights": self.weights, "model_kwargs": self.model_kwargs,
                "weights_sha256": self.weights_sha256, "n_features": self.n_features, "batch_size": self.batch_size,
                "device": self.device, "input_size": self.input_size, "mean": self.mean, "std": self.std,
                "strict": self.strict}

    def __getstate__(self) -> dict[str, Any]:  # parameters only: the module is rebuilt on the worker
        return self.params()

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(**state)

    def _build(self):
        import torch

        from tasks.ingest.features import resolve_extractor

        key = (self.model, repr(sorted(self.model_kwargs.items())), self.weights_sha256, self.strict, self.device)
        if self._module is None and key in _MODULES:
            self._module, self._torch_device = _MODULES[key]
        if self._module is None:
            factory = resolve_extractor(self.model) if ":" in self.model else None
            if factory is None:
                raise ValueError(f"torch extractor model {self.model!r}: expected an import path package.module:Class")
            module = factory(**self.model_kwargs)
            if not isinstance(module, torch.nn.Module):
                raise TypeError(f"torch extractor model {self.model!r} built a {type(module).__name__}, not a torch.nn.Module")
            if self.weights is not None:
                state = _matching_state(module, _read_state_dict(self.weights), self.weights)
                try:
                    missing = module.load_state_dict(state, strict=self.strict).missing_keys
                except RuntimeError as error:  # torch's missing/unexpected keys, size mismatches: one line, naming the file
                    raise ValueError(f"torch extractor weights {self.weights} do not fit {self.model}: "
                                     f"{' '.join(str(error).split())}") from None
                if missing and not _same_parameters(module, _loaded(factory(**self.model_kwargs), state)):
                    raise ValueError(f"torch extractor weights {self.weights} leave {len(missing)} of {self.model}'s "
                                     f"parameters ({', '.join(missing[:4])}{', …' if len(missing) > 4 else ''}) at a "
                                     "random start: two builds differ, so every worker would compute other features. "
                                     "strict: false tolerates names the module lacks, not weights the file lacks: give "
                                     "them, or build the module without those layers (e.g. num_classes=0)")
            elif not _same_parameters(module, factory(**self.model_kwargs)):
                raise ValueError(f"torch extractor model {self.model!r} without weights starts from random numbers: two "
                                 "builds differ, so every worker would compute other features. Give extractor_params."
                                 "weights (a state dict file), or a factory that loads its own")
            wanted = self.device
            if wanted == "auto":
                wanted = "cuda" if torch.cuda.is_available() else "cpu"
            self._torch_device = torch.device(wanted)
            self._module = module.to(self._torch_device).eval()
            _MODULES[key] = (self._module, self._torch_device)
        return self._module

    def check(self) -> None:
        """Build the module as a worker will (import its factory, load the weights): a missing module
        or weights of another shape are found now, not by every slide's task. ``n_features`` given
        skips the forward pass that would otherwise build it."""
        self._build()

    def _infer_n_features(self) -> int:
        size = self.input_size or 224
        return int(self(np.zeros((1, size, size, 3), dtype=np.uint8), _check=False).shape[1])

    def __call__(self, batch: np.ndarray, _check: bool = True) -> np.ndarray:
        import torch

        module = self._build()
        out = []
        mean = torch.tensor(self.mean, dtype=torch.float32, device=self._torch_device).view(1, -1, 1, 1)
        std = torch.tensor(self.std, dtype=torch.float32, device=self._torch_device).view(1, -1, 1, 1)
        with torch.inference_mode():
            for start in range(0, len(batch), self.batch_size):
                part = np.ascontiguousarray(batch[start:start + self.batch_size, ..., :3])
                x = torch.from_numpy(part).to(self._torch_device).permute(0, 3, 1, 2).float()
                if batch.dtype == np.uint8:
                    x = x / 255.0
                if self.input_size is not None and x.shape[-1] != self.input_size:
                    x = torch.nn.functional.interpolate(x, size=(self.input_size, self.input_size), mode="bilinear",
                                                        antialias=True, align_corners=False)
                features = _per_tile(module((x - mean) / std), self.model)
                out.append(features.reshape(features.shape[0], -1).float().cpu().numpy())
        features = np.concatenate(out).astype(np.float32, copy=False)
        if _check and features.shape[1] != self.n_features:
            raise ValueError(f"torch extractor {self.model!r} gave {features.shape[1]} features, expected {self.n_features}")
        return features


def _per_tile(features: Any, model: str) -> Any:
    """The module's output as one feature vector per tile: a tuple (a model returning its logits
    beside the embedding) failed with "'tuple' object has no attribute 'reshape'", and a spatial
    map (N, C, H, W) was flattened into C·H·W features of positions, without a word."""
    import torch

    if not isinstance(features, torch.Tensor):
        raise TypeError(f"torch extractor {model!r} returned a {type(features).__name__}, not one tensor of features per "
                        "tile: give a module whose forward returns the embedding alone")
    if features.ndim == 4 and features.shape[-2:] != (1, 1):
        raise ValueError(f"torch extractor {model!r} returned a feature map of shape {tuple(features.shape)}: pool it to "
                         "one vector per tile (e.g. end the module with AdaptiveAvgPool2d(1) and flatten(1))")
    return features


def _loaded(module: Any, state: dict[str, Any]) -> Any:
    """``module`` with ``state`` loaded as far as its names go (``strict=False``)."""
    module.load_state_dict(state, strict=False)
    return module


def _same_parameters(a: Any, b: Any) -> bool:
    """Whether two built modules hold equal parameters and buffers (a factory that loads weights
    builds the same module twice; a freshly initialised one does not)."""
    import torch

    left, right = a.state_dict(), b.state_dict()
    return left.keys() == right.keys() and all(torch.equal(left[k], right[k]) for k in left)


def _matching_state(module: Any, state: dict[str, Any], path: str) -> dict[str, Any]:
    """``state`` with the prefix every key shares removed (``module.`` of DataParallel, ``model.`` of a
    training wrapper) when that is what makes its names the module's; refused when no name matches
    (with ``strict: false`` nothing was loaded, and the features came from random numbers)."""
    wanted = set(module.state_dict())
    if wanted & set(state):
        return state
    keys = list(state)
    prefix = keys[0][: keys[0].index(".") + 1] if keys and "." in keys[0] else ""
    while prefix and all(k.startswith(prefix) for k in keys):
        stripped = {k[len(prefix):]: v for k, v in state.items()}
        if wanted & set(stripped):
            return stripped
        state, keys = stripped, list(stripped)
        prefix = keys[0][: keys[0].index(".") + 1] if "." in keys[0] else ""
    raise ValueError(f"torch extractor weights {path}: none of its {len(state)} tensor names is one of the module's "
                     f"(file: {sorted(state)[:2]}, module: {sorted(wanted)[:2]})")


def _read_state_dict(path: str) -> dict[str, Any]:
    """A state dict from ``.safetensors`` or a ``torch.save`` file, never unpickling code."""
    import torch

    if path.endswith(".safetensors"):
        from safetensors.torch import load_file

        return load_file(path)
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # pickle's UnpicklingError (this module imports no pickle): torch's advice,
        if type(error).__name__ != "UnpicklingError":  # weights_only=False, would run the file's code
            raise
        raise ValueError(f"torch extractor weights {path} hold pickled objects besides tensors (a whole model saved with "
                         "torch.save(model), a checkpoint with its training state): gpmil loads tensors only, never code. "
                         f"Save model.state_dict() (or a .safetensors file) ({type(error).__name__})") from None
    for key in ("state_dict", "model"):  # Lightning's checkpoints; DeiT's and MAE's {"model": …, "epoch": …}
        if isinstance(state, dict) and isinstance(state.get(key), dict):
            state = state[key]
            break
    if not isinstance(state, dict):
        raise TypeError(f"{path}: expected a state dict (name → tensor), found {type(state).__name__}")
    nested = [key for key, value in state.items() if isinstance(value, dict)]
    if nested and not any(hasattr(value, "shape") for value in state.values()):
        raise ValueError(f"torch extractor weights {path} hold no tensors at the top, but dictionaries under "
                         f"{', '.join(map(repr, nested[:5]))}: save the encoder's own state_dict() (e.g. a DINO "
                         "checkpoint's 'teacher') to a file of its own")
    return state
