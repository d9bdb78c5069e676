"""Feature extractors: handcrafted ones for H&E tiles and CT slices, and the plug-in interface.

An extractor maps a batch of images to a ``(B, n_features)`` float32 array. Anything with the
attributes and methods of :class:`FeatureExtractor` works (a torch model a user has locally, for
instance); register a factory with :func:`register_extractor` so that a store's recorded
``feature_extractor`` attribute can rebuild it (:func:`extractor_from_spec`) when an ingest is resumed.
Extractors that need fitting (the HOG PCA of :class:`HandcraftedHE`) have ``is_fitted`` and
``fit(sample) -> fitted extractor``; their fitted state is part of ``params()``.

All texture statistics are computed for the whole batch at once with NumPy (no per-tile loops).
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import numpy as np
from skimage.transform import resize

# --------------------------------------------------------------------------------- the protocol


@runtime_checkable
class FeatureExtractor(Protocol):
    """What the ingest needs from an extractor.

    ``__call__`` takes a batch ``(B, H, W, C)`` (uint8 RGB tiles, or float32 windowed CT slices in
    [0, 1]) and returns ``(B, n_features)`` float32. ``params()`` is JSON-serialisable and, with
    ``name`` and ``version``, recorded in the store; ``make_extractor(name, **params())`` must give
    back an equivalent extractor.
    """

    name: str
    version: str
    n_features: int

    def params(self) -> dict[str, Any]: ...

    def __call__(self, batch: np.ndarray) -> np.ndarray: ...


_REGISTRY: dict[str, Callable[..., FeatureExtractor]] = {}
ENTRY_POINT_GROUP = "gpmil.extractors"


def register_extractor(name: str) -> Callable[[Callable[..., FeatureExtractor]], Callable[..., FeatureExtractor]]:
    """Class/function decorator: make ``factory(**params)`` available as ``name``."""
    def decorate(factory: Callable[..., FeatureExtractor]) -> Callable[..., FeatureExtractor]:
        _REGISTRY[name] = factory
        return factory
    return decorate


def _torch_extractor(**params: Any) -> FeatureExtractor:
    from tasks.ingest.torch_extractor import TorchExtractor  # PyTorch only when asked for

    return TorchExtractor(**params)


_REGISTRY["torch"] = _torch_extractor


def known_extractors() -> list[str]:
    """Registered names and the names of the ``gpmil.extractors`` entry points."""
    from importlib.metadata import entry_points

    return sorted(set(_REGISTRY) | {ep.name for ep in entry_points(group=ENTRY_POINT_GROUP)})


def resolve_extractor(name: str) -> Callable[..., FeatureExtractor]:
    """The factory called ``name``: a registered name (``he-handcrafted``, ``ct-handcrafted``,
    ``torch``), an entry point of the group ``gpmil.extractors``, or an import path
    ``package.module:Class``. Importing runs the package's code, as ``import`` does: name only
    packages you trust. Resolved wherever an extractor is built, so on every worker."""
    import importlib
    from importlib.metadata import entry_points

    if name in _REGISTRY:
        return _REGISTRY[name]
    found = [ep for ep in entry_points(group=ENTRY_POINT_GROUP) if ep.name == name]
    if found:
        return found[0].load()
    if ":" in name:
        module_name, _, attribute = name.partition(":")
        try:
            factory: Any = importlib.import_module(module_name)
            for part in attribute.split("."):
                factory = getattr(factory, part)
        except (ImportError, AttributeError) as error:
            raise KeyError(f"feature extractor {name!r}: cannot import it ({type(error).__name__}: {error})") from error
        if not callable(factory):
            raise KeyError(f"feature extractor {name!r} is not a class or function")
        return factory
    raise KeyError(f"no feature extractor registered as {name!r}; known: {known_extractors()}, "
                   "or give an import path package.module:Class")


def make_extractor(name: str, **params: Any) -> FeatureExtractor:
    """Build the extractor ``name`` (see :func:`resolve_extractor`) with ``params``."""
    extractor = resolve_extractor(name)(**params)
    missing = [a for a in ("name", "version", "n_features", "params") if not hasattr(extractor, a)]
    if missing or not callable(extractor):
        raise TypeError(f"feature extractor {name!r} lacks {missing or ['__call__']} (see FeatureExtractor)")
    return extractor


def _factory_name(extractor: FeatureExtractor) -> str:
    """How to build ``extractor`` again: its registered name, else its class's import path."""
    if _REGISTRY.get(extractor.name) is type(extractor) or extractor.name == "torch":
        return extractor.name
    cls = type(extractor)
    return f"{cls.__module__}:{cls.__qualname__}"


def trusted_imports(extractor: FeatureExtractor | None) -> frozenset[str]:
    """The import paths a configured ``extractor`` was built from (what a store may name again)."""
    return frozenset() if extractor is None else import_paths(_factory_name(extractor), extractor.params())


def extractor_spec(extractor: FeatureExtractor) -> dict[str, Any]:
    """The store attribute describing ``extractor``: name, version, n_features, params and the
    factory that rebuilds it."""
    return {"name": extractor.name, "version": extractor.version, "factory": _factory_name(extractor),
            "n_features": int(extractor.n_features), "params": extractor.params()}


class UntrustedExtractorError(ValueError):
    """A store names code to import and run that the user's configuration does not name."""


def installed_import_paths() -> frozenset[str]:
    """The import paths of installed extractors: the registered factories' and the ``gpmil.extractors``
    entry points' targets (a store records an extractor by its class's path, :func:`_factory_name`),
    read without importing anything."""
    from importlib.metadata import entry_points

    registered = {f"{factory.__module__}:{factory.__qualname__}" for factory in _REGISTRY.values()}
    return frozenset(registered | {ep.value for ep in entry_points(group=ENTRY_POINT_GROUP)})


def import_paths(name: str, params: dict[str, Any]) -> frozenset[str]:
    """The import paths that building extractor ``name`` with ``params`` imports and calls: ``name``
    itself unless it is registered or a ``gpmil.extractors`` entry point (installed code), and the
    torch extractor's ``model``. A name without ``:`` is no import path (registered names and entry
    points are installed code), nor is an installed extractor's path."""
    paths = {name} if ":" in name and name not in installed_import_paths() else set()
    if name == "torch" and isinstance(params.get("model"), str):
        paths.add(params["model"])
    return frozenset(paths)


def extractor_from_spec(spec: dict[str, Any], *, source: str | Path, trusted: Collection[str] = ()) -> FeatureExtractor:
    """Rebuild the extractor the store at ``source`` was written with (same name, version and
    params); the torch extractor also checks its weights file against the recorded SHA-256.

    A store is data that others may write: it may name registered extractors and installed entry
    points, but an import path (``package.module:Factory``, the torch extractor's ``model``) only
    where ``trusted`` — the import paths the user's own configuration names — holds it. Anything else
    is refused before it is imported (a store naming ``subprocess:run`` would otherwise run it)."""
    factory = spec.get("factory", spec["name"])
    params = spec.get("params")
    if not isinstance(params, dict):
        raise ValueError(f"{source}: feature_extractor.params is a {type(params).__name__}, not a mapping")
    untrusted = sorted(import_paths(factory, params) - set(trusted))
    if untrusted:
        raise UntrustedExtractorError(
            f"{source}: its feature_extractor names {', '.join(map(repr, untrusted))} to import and run; gpmil builds "
            "an extractor from a store only by a registered name or an installed gpmil.extractors entry point. If you "
            "trust that code, name it in your configuration (ingest.extractor, extractor_params.model for torch, or "
            "ingest.trusted_imports)")
    extractor = make_extractor(factory, **params)
    if extractor.name != spec["name"] or extractor.version != spec["version"]:
        raise ValueError(f"extractor {spec.get('factory', spec['name'])!r} is now {extractor.name} v{extractor.version}; "
                         f"the store used {spec['name']} v{spec['version']}")
    return extractor


def needs_fit(extractor: FeatureExtractor) -> bool:
    """Whether ``extractor`` must be fitted on a sample before use."""
    return not getattr(extractor, "is_fitted", True)


# --------------------------------------------------------------------- vectorised image statistics
_LBP_OFFSETS = ((-1, -1), (-1, 0), (-1, 1), (0, 1), (1, 1), (1, 0), (1, -1), (0, -1))  # circular order
_GLCM_PROPERTIES = ("contrast", "dissimilarity", "homogeneity", "energy", "correlation", "entropy")
_HED_FROM_RGB = np.linalg.inv(np.array([[0.65, 0.70, 0.29], [0.07, 0.99, 0.11], [0.27, 0.57, 0.78]]))


def _uniform_lbp_table() -> np.ndarray:
    """Map 8-bit LBP codes to rotation-invariant uniform codes 0..9 (9 = non-uniform)."""
    codes = np.arange(256)
    bits = (codes[:, None] >> np.arange(8)) & 1
    transitions = (bits != np.roll(bits, 1, axis=1)).sum(axis=1)
    return np.where(transitions <= 2, bits.sum(axis=1), 9)


_LBP_TABLE = _uniform_lbp_table()


def downscale(batch: np.ndarray, size: int) -> np.ndarray:
    """Resize ``(B, H, W, ...)`` to ``(B, size, size, ...)`` as float32 (block mean when it divides)."""
    b, h, w = batch.shape[:3]
    rest = batch.shape[3:]
    if h % size == 0 and w % size == 0:
        blocks = batch.reshape(b, size, h // size, size, w // size, *rest)
        return blocks.mean(axis=(2, 4), dtype=np.float32)
    return resize(batch.astype(np.float32), (b, size, size, *rest), order=1,
                  anti_aliasing=True, preserve_range=True).astype(np.float32)


def batch_frequencies(codes: np.ndarray, n_codes: int) -> np.ndarray:
    """Per-row relative frequencies of integer ``codes`` (B, P) in [0, n_codes): (B, n_codes)."""
    b = codes.shape[0]
    index = codes.reshape(b, -1) + np.arange(b)[:, None] * n_codes
    counts = np.bincount(index.ravel(), minlength=b * n_codes).reshape(b, n_codes)
    return (counts / index.shape[1]).astype(np.float32)


def batch_histograms(values: np.ndarray, bins: int) -> np.ndarray:
    """Per-row normalised histograms of ``values`` (B, P) in [0, 1] with ``bins`` equal bins."""
    return batch_frequencies(np.clip((values * bins).astype(np.int64), 0, bins - 1), bins)


def lbp_histograms(gray: np.ndarray) -> np.ndarray:
    """Rotation-invariant uniform LBP histograms, (B, H, W) → (B, 10).

    The 8 neighbours are the square 3×3 ring (diagonals not interpolated, unlike the circular
    sampling of ``skimage.feature.local_binary_pattern``); code ``k`` ∈ 0..8 counts neighbours
    ``>=`` the centre for uniform patterns (≤ 2 transitions), 9 collects the others.
    """
    centre = gray[:, 1:-1, 1:-1]
    h, w = centre.shape[1:]
    codes = np.zeros(centre.shape, dtype=np.int64)
    for bit, (dy, dx) in enumerate(_LBP_OFFSETS):
        neighbour = gray[:, 1 + dy:1 + dy + h, 1 + dx:1 + dx + w]
        codes |= (neighbour >= centre).astype(np.int64) << bit
    return batch_frequencies(_LBP_TABLE[codes], 10)


def glcm_properties(gray: np.ndarray, levels: int = 8, distances: tuple[int, ...] = (1, 2)) -> np.ndarray:
    """Grey-level co-occurrence properties of (B, H, W) images in [0, 1].

    Grey levels are quantised to ``levels``; for each distance the symmetric, normalised matrices of
    the four directions (0, 45, 90, 135 degrees) give contrast, dissimilarity, homogeneity, energy,
    correlation and entropy, averaged over directions: ``(B, 6 * len(distances))``. Distance ``d``
    means the offsets (0, d), (-d, d), (-d, 0), (-d, -d) (for ``d = 1`` this equals
    ``skimage.feature.graycomatrix``, which rounds the diagonal offsets of larger distances).
    """
    b = gray.shape[0]
    q = np.clip((gray * levels).astype(np.int64), 0, levels - 1)
    i, j = np.meshgrid(np.arange(levels), np.arange(levels), indexing="ij")
    batch_index = np.arange(b)[:, None, None] * levels * levels
    features = []
    for d in distances:
        per_angle = []
        for dy, dx in ((0, d), (-d, d), (-d, 0), (-d, -d)):
            a = q[:, max(0, -dy):q.shape[1] - max(0, dy), max(0, -dx):q.shape[2] - max(0, dx)]
            c = q[:, max(0, dy):q.shape[1] - max(0, -dy), max(0, dx):q.shape[2] - max(0, -dx)]
            index = batch_index + a * levels + c
            counts = np.bincount(index.ravel(), minlength=b * levels * levels).reshape(b, levels, levels)
            p = counts + counts.transpose(0, 2, 1)
            p = p / p.sum(axis=(1, 2), keepdims=True)
            per_angle.append(_glcm_stats(p, i, j))
        features.append(np.mean(per_angle, axis=0))
    return np.concatenate(features, axis=1).astype(np.float32)


def _glcm_stats(p: np.ndarray, i: np.ndarray, j: np.ndarray) -> np.ndarray:
    diff = (i - j).astype(np.float64)
    mu_i = (p * i).sum(axis=(1, 2))
    mu_j = (p * j).sum(axis=(1, 2))
    sd_i = np.sqrt((p * (i - mu_i[:, None, None]) ** 2).sum(axis=(1, 2)))
    sd_j = np.sqrt((p * (j - mu_j[:, None, None]) ** 2).sum(axis=(1, 2)))
    cov = (p * (i - mu_i[:, None, None]) * (j - mu_j[:, None, None])).sum(axis=(1, 2))
    flat = (sd_i < 1e-12) | (sd_j < 1e-12)
    correlation = np.where(flat, 1.0, cov / np.where(flat, 1.0, sd_i * sd_j))  # skimage's convention
    entropy = -(p * np.log2(np.where(p > 0, p, 1.0))).sum(axis=(1, 2))
    return np.stack([
        (p * diff ** 2).sum(axis=(1, 2)),
        (p * np.abs(diff)).sum(axis=(1, 2)),
        (p / (1.0 + diff ** 2)).sum(axis=(1, 2)),
        np.sqrt((p ** 2).sum(axis=(1, 2))),
        correlation,
        entropy,
    ], axis=1)


def hog_descriptors(gray: np.ndarray, cell: int = 8, orientations: int = 9) -> np.ndarray:
    """Unsigned-gradient HOG of (B, H, W): per-cell orientation histograms weighted by magnitude,
    L2-normalised per image, ``(B, (H // cell) * (W // cell) * orientations)``."""
    b, h, w = gray.shape
    gy = np.zeros_like(gray)
    gx = np.zeros_like(gray)
    gy[:, 1:-1, :] = gray[:, 2:, :] - gray[:, :-2, :]
    gx[:, :, 1:-1] = gray[:, :, 2:] - gray[:, :, :-2]
    magnitude = np.hypot(gx, gy)
    angle = np.rad2deg(np.arctan2(gy, gx)) % 180.0
    bins = np.minimum((angle / (180.0 / orientations)).astype(np.int64), orientations - 1)
    ch, cw = h // cell, w // cell
    cell_index = (np.arange(h)[:, None] // cell).clip(max=ch - 1) * cw + (np.arange(w)[None, :] // cell).clip(max=cw - 1)
    index = (np.arange(b)[:, None, None] * ch * cw + cell_index[None]) * orientations + bins
    hist = np.bincount(index.ravel(), weights=magnitude.ravel(), minlength=b * ch * cw * orientations)
    hist = hist.reshape(b, -1)
    return hist / np.maximum(np.linalg.norm(hist, axis=1, keepdims=True), 1e-12)


def _to_unit_rgb(batch: np.ndarray, size: int) -> np.ndarray:
    return downscale(batch, size) / 255.0


# ------------------------------------------------------------------------------ H&E extractor
@register_extractor("he-handcrafted")
class HandcraftedHE:
    """Handcrafted H&E tile features (tiles downscaled to ``work_size`` first).

    Blocks, in order (``blocks()`` lists them with their widths):

    - ``hed_stats`` (15): mean, std, 10/50/90th percentiles of the haematoxylin, eosin and DAB
      optical densities (Ruifrok & Johnston colour deconvolution, as ``skimage.color.rgb2hed``).
    - ``rgb_hist`` (24): 8-bin histograms of R, G, B.
    - ``lbp_hist`` (10): rotation-invariant uniform LBP (P=8, R=1) histogram of the grey image.
    - ``glcm`` (12): contrast, dissimilarity, homogeneity, energy, correlation, entropy of 8-level
      co-occurrence matrices at distances 1 and 2, averaged over 4 directions.
    - ``hog_pca`` (``hog_components``): HOG (9 orientations, 8×8-pixel cells) of the grey image
      downscaled to 32×32, projected on its first principal components. The PCA is fitted once per
      store on a sample of its tiles (:meth:`fit`) and stored in ``params()``; with fewer than
      ``hog_components + 1`` sample tiles the trailing components are zero.
    """

    name = "he-handcrafted"
    version = "1"

    def __init__(self, work_size: int = 64, hog_components: int = 16,
                 hog_mean: list[float] | None = None, hog_basis: list[list[float]] | None = None):
        self.work_size = int(work_size)
        self.hog_components = int(hog_components)
        self.hog_mean = None if hog_mean is None else np.asarray(hog_mean, dtype=np.float64)
        self.hog_basis = None if hog_basis is None else np.asarray(hog_basis, dtype=np.float64)
        self.n_features = 61 + self.hog_components

    def blocks(self) -> list[tuple[str, int]]:
        return [("hed_stats", 15), ("rgb_hist", 24), ("lbp_hist", 10), ("glcm", 12),
                ("hog_pca", self.hog_components)]

    @property
    def is_fitted(self) -> bool:
        return self.hog_basis is not None

    def params(self) -> dict[str, Any]:
        return {"work_size": self.work_size, "hog_components": self.hog_components,
                "hog_mean": None if self.hog_mean is None else self.hog_mean.tolist(),
                "hog_basis": None if self.hog_basis is None else self.hog_basis.tolist()}

    def _hog(self, rgb: np.ndarray) -> np.ndarray:
        return hog_descriptors(downscale(rgb.mean(axis=3), 32))

    def fit(self, sample: np.ndarray) -> HandcraftedHE:
        """Return a copy with the HOG PCA fitted on ``sample`` (B, H, W, 3) uint8 tiles."""
        if len(sample) < 2:
            raise ValueError(f"need at least 2 tiles to fit the HOG PCA, got {len(sample)}")
        hog = self._hog(_to_unit_rgb(sample, self.work_size))
        mean = hog.mean(axis=0)
        _, _, vt = np.linalg.svd(hog - mean, full_matrices=False)
        basis = np.zeros((self.hog_components, hog.shape[1]))
        rank = min(self.hog_components, len(vt), len(sample) - 1)  # fewer tiles: trailing components stay 0
        basis[:rank] = vt[:rank]
        basis[:rank] *= np.sign(basis[np.arange(rank), np.abs(basis[:rank]).argmax(axis=1)])[:, None]  # fixed signs
        return HandcraftedHE(self.work_size, self.hog_components, mean.tolist(), basis.tolist())

    def __call__(self, batch: np.ndarray) -> np.ndarray:
        if not self.is_fitted:
            raise RuntimeError("HandcraftedHE needs fit(sample) before use (the HOG PCA)")
        rgb = _to_unit_rgb(batch, self.work_size)
        b = len(rgb)
        flat = rgb.reshape(b, -1, 3)
        hed = np.maximum(np.log(np.maximum(flat, 1e-6)) / np.log(1e-6) @ _HED_FROM_RGB, 0.0)
        hed_stats = np.concatenate([hed.mean(axis=1), hed.std(axis=1),
                                    np.percentile(hed, [10, 50, 90], axis=1).transpose(1, 0, 2).reshape(b, 9)],
                                   axis=1)
        rgb_hist = np.concatenate([batch_histograms(flat[:, :, c], 8) for c in range(3)], axis=1)
        gray = rgb.mean(axis=3)
        hog = (self._hog(rgb) - self.hog_mean) @ self.hog_basis.T
        return np.concatenate([hed_stats, rgb_hist, lbp_histograms(gray), glcm_properties(gray), hog],
                              axis=1).astype(np.float32)


# ------------------------------------------------------------------------------- CT extractor
@register_extractor("ct-handcrafted")
class HandcraftedCT:
    """Handcrafted CT slice features from the three windowed channels (each in [0, 1]).

    Blocks, in order:

    - ``window_hist`` (3 × ``bins``): ``bins``-bin histogram of each window (brain, blood, soft tissue).
    - ``window_moments`` (6): mean and standard deviation of each window.
    - ``window_gradient`` (3): mean gradient magnitude of each window.
    - ``lbp_hist`` (10): rotation-invariant uniform LBP histogram of the brain window.
    - ``glcm`` (6): co-occurrence properties (distance 1, 8 levels) of the blood window.

    Slices are downscaled to ``work_size`` first.
    """

    name = "ct-handcrafted"
    version = "1"

    def __init__(self, work_size: int = 128, bins: int = 16):
        self.work_size = int(work_size)
        self.bins = int(bins)
        self.n_features = 3 * self.bins + 25

    def blocks(self) -> list[tuple[str, int]]:
        return [("window_hist", 3 * self.bins), ("window_moments", 6), ("window_gradient", 3),
                ("lbp_hist", 10), ("glcm", 6)]

    def params(self) -> dict[str, Any]:
        return {"work_size": self.work_size, "bins": self.bins}

    def __call__(self, batch: np.ndarray) -> np.ndarray:
        windows = downscale(batch, self.work_size)
        b = len(windows)
        flat = windows.reshape(b, -1, 3)
        hist = np.concatenate([batch_histograms(flat[:, :, c], self.bins) for c in range(3)], axis=1)
        moments = np.concatenate([flat.mean(axis=1), flat.std(axis=1)], axis=1)
        gy, gx = np.gradient(windows, axis=(1, 2))
        gradient = np.hypot(gx, gy).reshape(b, -1, 3).mean(axis=1)
        return np.concatenate([hist, moments, gradient, lbp_histograms(windows[..., 0]),
                               glcm_properties(windows[..., 1], distances=(1,))], axis=1).astype(np.float32)
