"""Validation at the boundary, per item: the error names the file, the bag, the row and the reason,
and nothing committed before is lost."""

from __future__ import annotations

import os
from dataclasses import replace

import numpy as np
import pytest
import zarr

from tasks.ingest.errors import NonFiniteFeaturesError
from tasks.store import BagData, CohortSpec, StagingWriter, append_bags, create_cohort, open_cohort, read_staged


def _store(tmp_path, n_features=3):
    path = tmp_path / "c.zarr"
    create_cohort(path, CohortSpec(name="c", n_features=n_features, coords_dim=1, coords_meaning="index"))
    return path


def _bag(bag_id, features, label=1):
    n = len(features)
    return BagData(bag_id=bag_id, label=label, source=f"/data/{bag_id}.csv", features=np.asarray(features, dtype=float),
                   coords=np.arange(n)[:, None], instance_labels=np.full(n, -1))


def test_nan_features_are_refused_naming_bag_file_row_and_column_and_nothing_is_committed(tmp_path):
    store = _store(tmp_path)
    append_bags(store, [_bag("good", np.ones((2, 3)))])
    bad = np.ones((7, 3))
    bad[4, 1] = np.nan
    with pytest.raises(NonFiniteFeaturesError, match=r"rows \[4\] of the bag, columns \[1\].*path='/data/bad.csv', bag='bad'"):
        append_bags(store, [_bag("ok2", np.zeros((2, 3))), _bag("bad", bad)])
    assert list(open_cohort(store).bag_ids) == ["good"]  # the earlier bag stays, the call commits nothing


def test_float32_overflow_counts_as_infinite(tmp_path):
    store = _store(tmp_path)
    with pytest.raises(NonFiniteFeaturesError, match=r"rows \[0\].*float32 overflow"):
        append_bags(store, [_bag("big", [[1e39, 0.0, 0.0]])])


def test_the_staging_writer_rejects_or_drops_nonfinite_rows_by_policy(tmp_path):
    store = _store(tmp_path)
    X = np.arange(12.0).reshape(4, 3)
    X[1, 0], X[3, 2] = np.inf, np.nan
    rejecting = StagingWriter(store, "s1", 1, "/slides/s1.tiff")
    rejecting.write(np.ones((5, 3)), np.zeros((5, 1)), np.full(5, -1))
    with pytest.raises(NonFiniteFeaturesError, match=r"2 instance row\(s\).*rows \[6, 8\] of the bag"):
        rejecting.write(X, np.zeros((4, 1)), np.full(4, -1))  # rows counted across batches

    dropping = StagingWriter(store, "s2", 1, "/slides/s2.tiff", nonfinite="drop")
    dropping.write(X, np.arange(4)[:, None], np.full(4, -1))
    assert dropping.finish() == 2 and dropping.n_dropped == 2
    staged = read_staged(zarr.open_group(str(store), mode="r"), "s2")
    np.testing.assert_array_equal(staged.coords[:, 0], [0, 2])
    assert np.isfinite(staged.features).all()

    empty = StagingWriter(store, "s3", 1, "/slides/s3.tiff", nonfinite="drop")
    empty.write(np.full((2, 3), np.nan), np.zeros((2, 1)), np.full(2, -1))
    with pytest.raises(NonFiniteFeaturesError, match="all 2 instances have NaN"):
        empty.finish()


def test_a_name_from_non_utf8_bytes_is_refused_for_that_item_with_a_readable_reason(tmp_path):
    from tasks.ingest.errors import IngestError

    store = _store(tmp_path)
    name = os.fsdecode(b"slide\xff")  # what os.listdir gives for a Latin-1 file name
    with pytest.raises(IngestError, match=r"bag id is not valid UTF-8 \(slide\\udcff\); rename the file"):
        StagingWriter(store, name, 1, str(tmp_path / f"{name}.tiff"))
    with pytest.raises(IngestError, match="source path is not valid UTF-8"):
        append_bags(store, [replace(_bag("fine", np.ones((1, 3))), source=f"/data/{name}.csv")])
