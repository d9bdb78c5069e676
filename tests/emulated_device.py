"""An emulated accelerator for CI: array-api-strict arrays on its non-default device ``device1``.

Like CuPy arrays, they refuse implicit conversion to NumPy (``np.asarray`` raises) and cannot be
mixed with host arrays, so any code path that silently assumes NumPy fails loudly. Every way an
array can leave the device (DLPack, ``to_device``, Python scalars) is counted by
:class:`TransferLog`, so a test can assert which device→host transfers happen.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np

xp = __import__("pytest").importorskip("array_api_strict", reason="array-api-strict is in the dev extra")

NAMESPACE = "array_api_strict:device1"
DEVICE = xp.Device("device1")
Array = type(xp.asarray([0.0]))


def to_emulated(X: np.ndarray):
    """Host array → the emulated device."""
    return xp.asarray(np.ascontiguousarray(X), device=DEVICE)


@dataclass
class TransferLog:
    """Shapes of the arrays (``()`` for scalars) copied from the emulated device to the host."""

    shapes: list[tuple[int, ...]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def record(self, array) -> None:
        if array.device == DEVICE:
            with self.lock:
                self.shapes.append(tuple(array.shape))

    def clear(self) -> None:
        with self.lock:
            self.shapes.clear()

    def offending(self, allowed: set[tuple[int, ...]], n_max: int) -> list[tuple[int, ...]]:
        """Transfers that are neither a scalar, an allowed shape, nor a vector of ≤ ``n_max``
        entries (an N-vector of per-instance moments of one block)."""
        return [s for s in self.shapes if s != () and s not in allowed and not (len(s) == 1 and s[0] <= n_max)]


@contextmanager
def count_transfers(monkeypatch):
    """Patch every exit from the emulated device to record it in a :class:`TransferLog`."""
    log = TransferLog()

    def counting(name):
        original = getattr(Array, name)

        def wrapper(self, *args, **kwargs):
            log.record(self)
            return original(self, *args, **kwargs)

        return wrapper

    for name in ("__dlpack__", "__float__", "__int__", "__bool__", "__index__", "__complex__"):
        monkeypatch.setattr(Array, name, counting(name))
    original_to_device = Array.to_device

    def to_device(self, device, /, stream=None):
        if device != self.device:
            log.record(self)
        return original_to_device(self, device, stream=stream)

    monkeypatch.setattr(Array, "to_device", to_device)
    yield log
