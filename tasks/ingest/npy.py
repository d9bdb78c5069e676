"""torchmil-style per-bag ``.npy`` folders: ``features/<bag>.npy`` (N, D), ``labels/<bag>.npy`` (the
bag label), optionally ``inst_labels/<bag>.npy`` (N,) and ``coords/<bag>.npy`` (N, k).

Each feature file is one bag; the workers memory-map it and copy it into the store ``batch_rows``
rows at a time through the parallel, resumable ingest driver.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from tasks.ingest.driver import IngestReport, Skipped, existing_attrs, ingested_from_elsewhere, run_ingest, summarise_left_out
from tasks.ingest.errors import FeatureDimensionError, IngestError, MissingLabelError, UnreadableFileError
from tasks.ingest.labels import LabelSpec, binary, check_instance_labels, labelled_bags_without_file, labelled_items
from tasks.store import CohortSpec, NonFinitePolicy, non_integer_coords, open_cohort


def npy_bag_writer(item, writer, *, batch_rows: int = 65536) -> None:
    """Ingest worker for torchmil-style per-bag ``.npy`` files (``item.payload`` holds their paths).

    ``payload``: ``features`` (path, (N, D)), and optionally ``inst_labels`` ((N,)) and
    ``coords`` ((N, k)); features are memory-mapped and copied ``batch_rows`` rows at a time.
    """
    paths = item.payload
    arrays: dict[str, np.ndarray | None] = {}
    for name in ("features", "inst_labels", "coords"):  # each file named when it is the one that fails
        try:
            arrays[name] = None if not paths.get(name) else np.load(paths[name], mmap_mode="r" if name == "features" else None)
        except Exception as error:
            raise UnreadableFileError(f"cannot read .npy: {type(error).__name__}: {error}", path=paths[name]) from error
    features, inst, coords = arrays["features"], arrays["inst_labels"], arrays["coords"]
    if features.ndim != 2 or features.shape[0] == 0:
        raise FeatureDimensionError(f"features of shape {features.shape}; expected (N, D) with N >= 1", path=item.source)
    n = features.shape[0]
    for name, array in (("inst_labels", inst), ("coords", coords)):
        if array is not None and (array.ndim == 0 or array.shape[0] != n):
            raise FeatureDimensionError(f"{name} of shape {array.shape} for {n} instances", path=paths[name])
    if inst is not None:
        check_instance_labels(np.asarray(inst).reshape(n), paths["inst_labels"], "instance labels")
    if coords is not None and (bad := np.flatnonzero(non_integer_coords(coords.reshape(n, -1)).any(axis=1))).size:
        raise FeatureDimensionError(f"coords row {int(bad[0])} is {coords.reshape(n, -1)[bad[0]].tolist()}: coordinates are "
                                    f"stored as integers within int32, e.g. level-0 pixels ({bad.size} such row(s); "
                                    "fractional ones were cut, NaN stored as -2147483648)", path=paths["coords"])
    for start in range(0, n, batch_rows):
        rows = slice(start, min(n, start + batch_rows))
        count = rows.stop - rows.start
        writer.write(np.asarray(features[rows], dtype=np.float32),
                     np.arange(rows.start, rows.stop)[:, None] if coords is None else coords[rows].reshape(count, -1),
                     np.full(count, -1, dtype=np.int8) if inst is None else np.asarray(inst[rows]).astype(np.int8))


def ingest_bag_files(store: str | Path, features_dir: str | Path, *, labels_dir: str | Path | None = None,
                     inst_labels_dir: str | Path | None = None, coords_dir: str | Path | None = None,
                     name: str | None = None, client: Any = None, max_workers: int = 1,
                     report_path: str | Path | None = None, nonfinite: NonFinitePolicy = "reject",
                     keep_unlabelled: bool = False, labels_file: LabelSpec | None = None) -> IngestReport:
    """Ingest torchmil-style per-bag ``.npy`` folders: ``features_dir/<bag>.npy`` (N, D),
    ``labels_dir/<bag>.npy`` (the bag label) or a labels file read by ``labels_file`` (its ids the
    file stems, as for ``.h5`` folders), optional ``inst_labels_dir`` and ``coords_dir``."""
    if labels_dir is not None and labels_file is not None:
        raise ValueError("give labels_dir or labels_file, not both")
    feature_files = sorted(Path(features_dir).glob("*.npy"))
    labels: dict[str, int | Exception] | None = None
    originals: dict[str, Any] = {}
    if labels_file is not None:
        labels, originals = labels_file.read()
    elif labels_dir is not None:
        labels = {}
        for path in sorted(Path(labels_dir).glob("*.npy")):
            try:
                value = np.load(path, allow_pickle=False)
                if value.size != 1:  # a one-hot [0, 1] read as its first entry inverted every label
                    raise ValueError(f"it holds {value.size} values of shape {value.shape}, a bag label file holds one (0 or 1)")
                originals[path.stem] = value.reshape(-1)[0]
                labels[path.stem] = binary(originals[path.stem])
            except Exception as error:
                labels[path.stem] = MissingLabelError(f"unusable label file: {error}", path=str(path), bag_id=path.stem)

    def optional(folder: str | Path | None, stem: str) -> str | None:
        path = None if folder is None else Path(folder) / f"{stem}.npy"
        return str(path) if path is not None and path.exists() else None

    candidates = [(p.stem, str(p), {"features": str(p), "inst_labels": optional(inst_labels_dir, p.stem),
                                    "coords": optional(coords_dir, p.stem)}) for p in feature_files]
    labels_from = labels_file.file if labels_file is not None else None if labels_dir is None else str(labels_dir)
    items, skipped = labelled_items(candidates, labels, labels_from, originals, keep_unlabelled)
    if labels is not None:
        present = [p.stem for p in feature_files] + ingested_from_elsewhere(store, features_dir)
        skipped += labelled_bags_without_file(labels, present, labels_from, features_dir, ".npy")
    stored = existing_attrs(store)  # a store's own kind and dimensions, else the folder's and its first readable bag's
    items, mismatched = _one_kind_of_positions(store, stored, items, coords_dir or Path(features_dir).parent / "coords")
    skipped += mismatched
    items = [replace(item, inputs=tuple(path for path in item.payload.values() if path)) for item in items]
    n_features = None if stored is None else int(stored["n_features"])
    if stored is not None and stored.get("coords_meaning") in ("given", "instance_index"):  # a torchmil store's kind
        given = stored["coords_meaning"] == "given"
    else:  # the folder's (CohortSpec checks it against another kind of store, naming both)
        given = any(item.payload["coords"] for item in items)
    coords_dim = int(stored["coords_dim"]) if stored is not None and given else None
    for item in items if stored is None else ():
        try:
            n_features = int(np.load(item.source, mmap_mode="r").shape[1])
            if item.payload["coords"]:
                coords_dim = int(np.prod(np.load(item.payload["coords"], mmap_mode="r").shape[1:]))
            break
        except Exception:  # reported by the worker
            continue
    if n_features is None:
        raise IngestError(f"no readable feature file to ingest: {summarise_left_out(f'{len(feature_files)} .npy file(s) found', skipped)}",
                          path=str(features_dir))
    spec = CohortSpec(name=name or Path(str(store)).stem, n_features=n_features,
                      coords_dim=coords_dim or 1, coords_meaning="given" if given else "instance_index",
                      labels=labels_file.describe() if labels_file is not None else None if labels_dir is None else {
                          "file": str(labels_dir), "column": "labels/<bag>.npy", "target": None, "positive": None})
    return run_ingest(store, spec, items, npy_bag_writer, skipped=skipped, client=client,
                      max_workers=max_workers, report_path=report_path, nonfinite=nonfinite)


def _one_kind_of_positions(store: str | Path, stored: dict[str, Any] | None, items: list, coords_dir: str | Path
                           ) -> tuple[list, list[Skipped]]:
    """The items whose positions are of the cohort's one kind — given (``coords/<bag>.npy``) or
    instance indices — and a skipped entry for each other new bag. The kind is the store's where it
    exists (a nightly folder that gains or lacks ``coords/``), else the folder's: given if any new
    bag has a coordinates file (``stored``: the store's attributes, None before its first ingest).
    Bags already in the store are left to the ingest (done)."""
    committed = set(open_cohort(store).bag_ids) if stored is not None else set()
    new = [item for item in items if item.bag_id not in committed]
    with_coords = sum(bool(item.payload["coords"]) for item in new)
    given = with_coords > 0 if stored is None else stored.get("coords_meaning") != "instance_index"
    skipped = []
    for item in new:
        if bool(item.payload["coords"]) == given:
            continue
        if not given:
            reason = (f"has a coordinates file {item.payload['coords']}, but the store {store} holds instance indices for "
                      "its bags (its first ingest had no coords/): ingest the folder into a new store to keep positions")
        elif stored is None:
            reason = (f"no coordinates file {item.bag_id}.npy in {coords_dir}, where {with_coords} other bag(s) have one: a "
                      "cohort's positions are given for every bag or for none")
        else:
            reason = (f"no coordinates file {item.bag_id}.npy in {coords_dir}: the store {store} holds positions for its "
                      "bags (a cohort's positions are given for every bag or for none)")
        skipped.append(Skipped(path=str(Path(coords_dir) / f"{item.bag_id}.npy"), bag_id=item.bag_id,
                               error="UnreadableFileError", reason=reason))
    refused = {entry.bag_id for entry in skipped}
    kept = [item for item in items if item.bag_id not in refused]
    if not given:  # a stored bag's coords/ file that appeared since is no input of it (else: 'its input changed')
        kept = [replace(item, payload=item.payload | {"coords": None}) if item.bag_id in committed else item for item in kept]
    return kept, skipped
