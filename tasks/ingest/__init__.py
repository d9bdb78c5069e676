"""Ingest sources into a cohort store.

One module per source format, each holding its readers and its ``ingest_*`` entry point:

- :mod:`tasks.ingest.tables`   -- one table for the cohort: MIL CSV, Parquet, NumPy ``.npz`` (:func:`ingest_table`).
- :mod:`tasks.ingest.h5`       -- CLAM/TRIDENT per-slide ``.h5`` feature files (:func:`ingest_h5_features`).
- :mod:`tasks.ingest.npy`      -- torchmil-style per-bag ``.npy`` folders (:func:`ingest_bag_files`).
- :mod:`tasks.ingest.wsi`      -- whole-slide images: tissue mask, tile grid, tile batches, QC (:func:`ingest_slides`).
- :mod:`tasks.ingest.ct`       -- head-CT DICOM series: grouping, ordering, HU, windows (:func:`ingest_ct`).

and the shared pieces:

- :mod:`tasks.ingest.driver`   -- the parallel, resumable ingest driver and its report.
- :mod:`tasks.ingest.labels`   -- bag labels from label files.
- :mod:`tasks.ingest.features` -- handcrafted extractors and the plug-in protocol/registry.
- :mod:`tasks.ingest.errors`   -- the exception hierarchy used by every reader.
- :mod:`tasks.ingest.synthetic` -- seeded synthetic slides, CT series and feature cohorts.

The entry points are also attributes of this package (``from tasks.ingest import ingest_slides``),
imported on first use so that reading a store never imports DICOM or image stacks. The store layout
and the conventions of every source are in ``docs/STORE.md``.
"""

from __future__ import annotations

import importlib
from typing import Any

_ENTRY_POINTS = {"ingest_table": "tables", "ingest_h5_features": "h5", "ingest_bag_files": "npy",
                 "ingest_slides": "wsi", "ingest_ct": "ct", "run_ingest": "driver"}

__all__ = sorted(_ENTRY_POINTS)


def __getattr__(name: str) -> Any:
    if name in _ENTRY_POINTS:
        return getattr(importlib.import_module(f"tasks.ingest.{_ENTRY_POINTS[name]}"), name)
    raise AttributeError(f"module 'tasks.ingest' has no attribute {name!r}")
