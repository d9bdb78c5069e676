"""Exceptions raised for bad input.

Every error names the offending file (``path``) and, where known, the bag; the ingest driver turns
them into entries of the skipped-files report and carries on with the other inputs.
"""

from __future__ import annotations


class IngestError(ValueError):
    """An input that cannot be ingested; ``path`` and ``bag_id`` say which."""

    def __init__(self, message: str, *, path: str | None = None, bag_id: str | None = None):
        self.path = None if path is None else str(path)
        self.bag_id = bag_id
        where = ", ".join(f"{k}={v!r}" for k, v in (("path", self.path), ("bag", bag_id)) if v)
        super().__init__(f"{message} ({where})" if where else message)
        self.reason = message


class UnreadableFileError(IngestError):
    """A file that is missing, truncated, corrupt or not of the expected format."""


class NoTissueError(IngestError):
    """A slide on which the tissue mask keeps no tile."""


class MissingLabelError(IngestError):
    """A bag (or slice) absent from the labels table, or a label that is not 0/1."""


class BlankLabelError(MissingLabelError):
    """A labels row whose label cells are all empty: a bag without a label yet (an unlabelled bag
    where the ingest keeps them, as for a cohort to predict)."""


class DuplicateIdError(IngestError):
    """A bag id given twice, or already present in the store for another source."""


class FeatureDimensionError(IngestError):
    """Features whose dimension differs from the store's (or from the other bags')."""


class StoreMismatchError(IngestError):
    """An existing store written with other settings (extractor, coordinates, tiling)."""


class BadValueError(IngestError):
    """A table cell that should be a number and is not (names the file row and column)."""


class NonFiniteFeaturesError(IngestError):
    """NaN or ±inf features (also values beyond float32's range, which the store keeps)."""


class InvalidSeriesError(IngestError):
    """A DICOM series that is not one complete CT scan (modality, rescale tags, missing or
    duplicate slices, mixed series)."""


class LabelChangedError(IngestError):
    """A bag already in the store whose labels file now gives another label (binary or original)."""


class SourceChangedError(IngestError):
    """A bag already in the store whose input (file or table rows) changed since it was ingested."""


class NothingIngestedError(IngestError):
    """An ingest whose source gave the store no bag: every input skipped, or none found."""
