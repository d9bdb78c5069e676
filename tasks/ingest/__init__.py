"""Ingest sources into a cohort store.

Submodules (imported explicitly, so that reading a store never imports DICOM or image stacks):

- :mod:`tasks.ingest.errors`   -- the exception hierarchy used by every reader.
- :mod:`tasks.ingest.tables`   -- MIL CSV, Parquet, NumPy, CLAM/TRIDENT ``.h5`` and torchmil per-bag files.
- :mod:`tasks.ingest.wsi`      -- tissue mask, tile grid, tile batches and QC thumbnails of slides.
- :mod:`tasks.ingest.ct`       -- head-CT DICOM series: grouping, ordering, HU, windows.
- :mod:`tasks.ingest.features` -- handcrafted extractors and the plug-in protocol/registry.
- :mod:`tasks.ingest.cohort`   -- the parallel, resumable ingest driver, its report and the ``ingest_*`` entry points.
- :mod:`tasks.ingest.synthetic` -- seeded synthetic slides, CT series and feature cohorts.

The store layout and the conventions of every source are in ``docs/STORE.md``.
"""
