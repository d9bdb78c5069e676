"""Saving fitted estimators and fit states without pickle: arrays plus JSON, from an allowlist of types.

A pickle runs code when it is loaded, and model folders and cohort stores are shared between
teams, so nothing here ever unpickles. An object is written as one ``.npz`` archive (read back
with ``allow_pickle=False``) holding its arrays and a JSON tree, ``__gpmil__``, that says how to
rebuild it:

- ``None``, ``bool``, ``int``, ``str`` and finite ``float`` as themselves; other floats, NumPy
  scalars, tuples and dicts as tagged objects (``{"$float": "nan"}``, ``{"$scalar": "<f4", …}``,
  ``{"$tuple": […]}``, ``{"$dict": [[key, value], …]}``); lists as JSON lists;
- NumPy arrays of numbers, booleans or fixed-width strings as ``{"$array": k}``, the archive's
  ``a<k>`` member (object arrays are refused);
- dataclasses of an allowed type as ``{"$dataclass": name, "fields": {…}}`` (their ``__init__``
  fields; a field with ``metadata={"transient": True}`` is a cache and is not saved: it needs a
  default and is rebuilt);
- scikit-learn estimators of an allowed type as ``{"$estimator": name, "params": get_params(deep=False),
  "state": everything else in the instance ``__dict__``}`` (fitted attributes, nested fitted
  estimators, ``dict[str, ndarray]`` network weights).

Types are looked up by name in :func:`allowed_types` only — the numerics' dataclasses (q, the
sparse GP, kernels, ψ functions, random features), the estimators and fit states that
:mod:`mil_core.models` registers, and what a caller adds with :func:`allow_types` — never by
importing a name read from disk. Anything else (a lambda ``psi``, an unknown class) is refused
when saving, naming the attribute. The archive records :data:`FORMAT_VERSION`; a newer one is
refused with a message saying so.
"""

from __future__ import annotations

import dataclasses
import io
import json
import math
import os
import secrets
import zipfile
import zlib
from pathlib import Path
from typing import Any

import numpy as np

from .engine import GaussianQ, SparseGP
from .kernels import RBF
from .likelihoods import GammaMixture, HyperbolicSecant, ThetaFunction
from .random_features import RandomFourierFeatures

__all__ = ["FORMAT", "FORMAT_VERSION", "UnsafeFileError", "allow_types", "allowed_types", "dumps", "loads", "save", "load"]

FORMAT = "gpmil-arrays+json"
FORMAT_VERSION = 1
_META = "__gpmil__"
_ARRAY_KINDS = set("biufcUS")  # bool, ints, floats, complex, fixed-width strings: no Python objects
_NUMERICS_TYPES = (GaussianQ, SparseGP, RBF, HyperbolicSecant, GammaMixture, ThetaFunction, RandomFourierFeatures)
_EXTRA_TYPES: dict[str, type] = {}


class UnsafeFileError(ValueError):
    """A file that is not a gpmil arrays+JSON archive (a pickle, say), or that names a type
    outside the allowlist: refused before anything in it is run or built."""


def allow_types(*classes: type) -> None:
    """Add dataclasses or scikit-learn estimators defined outside :mod:`mil_core` (the pipeline's
    feature scaling, a plug-in model) to the allowlist, under their class name."""
    for cls in classes:
        if not (dataclasses.is_dataclass(cls) or hasattr(cls, "get_params")):
            raise TypeError(f"{cls!r}: only dataclasses and scikit-learn estimators can be allowed")
        known = allowed_types().get(cls.__name__)
        if known is not None and known is not cls:
            raise ValueError(f"another class is already allowed under the name {cls.__name__!r}: {known!r}")
        _EXTRA_TYPES[cls.__name__] = cls


def allowed_types() -> dict[str, type]:
    """Name → class of every type this format builds: the numerics' dataclasses listed here and
    what :func:`allow_types` added (``mil_core.models`` adds its estimators and fit states)."""
    return {cls.__name__: cls for cls in _NUMERICS_TYPES} | _EXTRA_TYPES


# ------------------------------------------------------------------------------------ encoding
class _Encoder:
    def __init__(self) -> None:
        self.arrays: list[np.ndarray] = []
        self.names = {cls: name for name, cls in allowed_types().items()}

    def __call__(self, value: Any, where: str) -> Any:
        if value is None or isinstance(value, (bool, str)) or type(value) is int:
            return value
        if type(value) is float:
            return value if math.isfinite(value) else {"$float": repr(value)}
        if isinstance(value, np.generic):
            self._check_dtype(value.dtype, where)
            return {"$scalar": value.dtype.str, "value": self(value.item(), where)}
        if isinstance(value, np.ndarray):
            self._check_dtype(value.dtype, where)
            self.arrays.append(value)
            return {"$array": len(self.arrays) - 1}
        if type(value) is list:
            return [self(v, f"{where}[{i}]") for i, v in enumerate(value)]
        if type(value) is tuple:
            return {"$tuple": [self(v, f"{where}[{i}]") for i, v in enumerate(value)]}
        if type(value) is dict:
            return {"$dict": [[self(k, f"{where} key"), self(v, f"{where}[{k!r}]")] for k, v in value.items()]}
        name = self.names.get(type(value))
        if name is not None and dataclasses.is_dataclass(value):
            fields = {f.name: self(getattr(value, f.name), f"{where}.{f.name}") for f in dataclasses.fields(value)
                      if f.init and not f.metadata.get("transient")}
            return {"$dataclass": name, "fields": fields}
        if name is not None:
            params = value.get_params(deep=False)
            state = {k: v for k, v in vars(value).items() if k not in params}
            return {"$estimator": name, "params": {k: self(v, f"{where}.{k}") for k, v in params.items()},
                    "state": {k: self(v, f"{where}.{k}") for k, v in state.items()}}
        raise TypeError(f"cannot save {where}: a {type(value).__module__}.{type(value).__qualname__} is not a type this "
                        f"format stores (arrays, numbers, strings, lists, tuples, dicts and the allowed types "
                        f"{sorted(self.names.values())}; see mil_core.persist.allow_types)")

    @staticmethod
    def _check_dtype(dtype: np.dtype, where: str) -> None:
        if dtype.kind not in _ARRAY_KINDS or dtype.fields is not None:
            raise TypeError(f"cannot save {where}: arrays of dtype {dtype} hold Python objects or records")


def dumps(obj: Any) -> bytes:
    """``obj`` as the bytes of an ``.npz`` archive (arrays + the JSON tree)."""
    encode = _Encoder()
    tree = encode(obj, type(obj).__name__)
    meta = json.dumps({"format": FORMAT, "version": FORMAT_VERSION, "root": tree}, allow_nan=False)
    buffer = io.BytesIO()
    members = {f"a{k}": array for k, array in enumerate(encode.arrays)}
    np.savez(buffer, **members, **{_META: np.frombuffer(meta.encode(), dtype=np.uint8)})
    return buffer.getvalue()


# ------------------------------------------------------------------------------------ decoding
def loads(data: bytes, *, source: str = "<bytes>") -> Any:
    """Rebuild what :func:`dumps` wrote; refuse anything else without running it."""
    if data[:2] != b"PK":
        kind = "a pickle" if data[:1] == b"\x80" else "not an .npz archive"
        raise UnsafeFileError(f"{source}: {kind}, not a gpmil {FORMAT} file; pickles are never loaded (they can run code). "
                              "Refit the model (or rerun the training) with this version to write it in the safe format.")
    try:
        with np.load(io.BytesIO(data), allow_pickle=False) as archive:
            meta = json.loads(archive[_META].tobytes().decode())
            arrays = {name: archive[name] for name in archive.files if name != _META}
    except (ValueError, KeyError, OSError, UnicodeDecodeError, EOFError, RecursionError, zipfile.BadZipFile,
            zlib.error) as error:  # truncated, corrupted (CRC), or JSON nested beyond reason
        raise UnsafeFileError(f"{source}: not a readable gpmil {FORMAT} file ({type(error).__name__}: {error})") from None
    if not isinstance(meta, dict):
        raise UnsafeFileError(f"{source}: its {_META} member is a JSON {type(meta).__name__}, not an object")
    if raw := sorted(name for name, member in arrays.items() if not isinstance(member, np.ndarray)):
        raise UnsafeFileError(f"{source}: member(s) {raw[:3]} are not .npy arrays")
    if meta.get("format") != FORMAT:
        raise UnsafeFileError(f"{source}: format {meta.get('format')!r}, expected {FORMAT!r}")
    if not isinstance(meta.get("version"), int) or meta["version"] > FORMAT_VERSION:
        raise UnsafeFileError(f"{source}: format version {meta.get('version')!r} is newer than this gpmil reads "
                              f"({FORMAT_VERSION}); upgrade gpmil")
    try:
        return _Decoder(arrays, allowed_types(), source)(meta["root"])
    except UnsafeFileError:
        raise
    except (TypeError, ValueError, KeyError, AttributeError, RecursionError) as error:  # e.g. a parameter the allowed class does not take
        raise UnsafeFileError(f"{source}: malformed gpmil {FORMAT} file ({type(error).__name__}: {error})") from None


class _Decoder:
    def __init__(self, arrays: dict[str, np.ndarray], types: dict[str, type], source: str):
        self.arrays, self.types, self.source = arrays, types, source

    def _type(self, name: Any, kind: str) -> type:
        cls = self.types.get(name) if isinstance(name, str) else None
        if cls is None or (kind == "$dataclass") != dataclasses.is_dataclass(cls):
            raise UnsafeFileError(f"{self.source}: names {kind[1:]} type {name!r}, which is not in the allowlist")
        return cls

    def __call__(self, node: Any) -> Any:
        if node is None or isinstance(node, (bool, int, float, str)):
            return node
        if isinstance(node, list):
            return [self(v) for v in node]
        if not isinstance(node, dict) or len([k for k in node if k.startswith("$")]) != 1:
            raise UnsafeFileError(f"{self.source}: malformed node {str(node)[:80]!r}")
        if "$float" in node:
            return float(node["$float"]) if node["$float"] in ("nan", "inf", "-inf") else self._bad(node)
        if "$scalar" in node:
            dtype = np.dtype(node["$scalar"])
            return dtype.type(node["value"]) if dtype.kind in _ARRAY_KINDS else self._bad(node)
        if "$array" in node:
            return self.arrays[f"a{int(node['$array'])}"]
        if "$tuple" in node:
            return tuple(self(v) for v in node["$tuple"])
        if "$dict" in node:
            return {self(k): self(v) for k, v in node["$dict"]}
        if "$dataclass" in node:
            return self._type(node["$dataclass"], "$dataclass")(**{k: self(v) for k, v in self._object(node, "fields").items()})
        if "$estimator" in node:
            estimator = self._type(node["$estimator"], "$estimator")(
                **{k: self(v) for k, v in self._object(node, "params").items()})
            for key, value in self._object(node, "state").items():
                if not key.isidentifier() or key.startswith("__"):
                    self._bad(node)
                vars(estimator)[key] = self(value)
            if callable(check := getattr(estimator, "_check_restored", None)):
                try:  # fitted arrays of the wrong shape or type would fail later, or predict other numbers
                    check()
                except ValueError as error:
                    raise UnsafeFileError(f"{self.source}: {type(estimator).__name__}: {error}") from None
            return estimator
        return self._bad(node)

    def _object(self, node: dict, key: str) -> dict:
        value = node.get(key)
        return value if isinstance(value, dict) else self._bad(node)

    def _bad(self, node: Any):
        raise UnsafeFileError(f"{self.source}: malformed node {str(node)[:80]!r}")


# ---------------------------------------------------------------------------------- file helpers
def write_whole(path: str | Path, payload: bytes) -> Path:
    """Write ``payload`` to ``path`` whole: into a new file of a random name beside it (``O_EXCL``:
    never through a file or link already there), then renamed over ``path`` (which replaces a link
    at ``path`` instead of writing where it points). A reader sees the old file or the new one. The
    file gets the mode any new file gets (0o666 less the umask): ``tempfile``'s 0o600 kept a model
    in a shared folder from every other account."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    staged = path.with_name(f".{path.name}.{secrets.token_hex(8)}.writing")
    fd = os.open(staged, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, "wb") as file:
            file.write(payload)
        os.replace(staged, path)
    except BaseException:
        staged.unlink(missing_ok=True)
        raise
    return path


def save(obj: Any, path: str | Path) -> Path:
    """Write ``obj`` to ``path`` whole (:func:`write_whole`)."""
    return write_whole(path, dumps(obj))


def load(path: str | Path) -> Any:
    """Read an object written by :func:`save` (never a pickle)."""
    return loads(Path(path).read_bytes(), source=str(path))
