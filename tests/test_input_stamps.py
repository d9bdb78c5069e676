"""A rerun tells an unchanged input (done) from one that changed since it was ingested (reported,
the store keeps what it has): files by size, time and sampled content, table bags by their rows."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import h5py
import numpy as np
import pandas as pd
import zarr

from tasks.ingest.driver import IngestItem, run_ingest
from tasks.ingest.stamps import SAMPLE_BYTES, file_change, file_stamp, rows_change, rows_stamp
from tasks.store import CohortSpec, StagingWriter, create_cohort, open_cohort


def test_a_file_stamp_ignores_a_touch_or_a_copy_and_sees_any_change_of_size_or_sampled_bytes(tmp_path):
    a = tmp_path / "a.bin"
    a.write_bytes(bytes(range(256)) * (3 * SAMPLE_BYTES // 256))  # larger than the two samples
    stamp = file_stamp([str(a)])
    assert file_change([str(a)], stamp) is None
    os.utime(a, ns=(1, 1))  # touched: the stat digest differs, the content digest does not
    assert file_change([str(a)], stamp) is None
    copy = tmp_path / "copy" / "a.bin"
    copy.parent.mkdir()
    shutil.copy(a, copy)  # a copied cohort: another path and time, the same name and bytes
    assert file_change([str(copy)], stamp) is None
    data = bytearray(a.read_bytes())
    for where in (0, len(data) - 1):  # one byte in the head or the tail, same size
        changed = data.copy()
        changed[where] ^= 1
        a.write_bytes(bytes(changed))
        assert file_change([str(a)], stamp) == "same size, other content"
    a.write_bytes(bytes(data) + b"x")
    assert file_change([str(a)], stamp) == f"{len(data)} bytes when ingested, {len(data) + 1} now"
    b = tmp_path / "b.bin"
    b.write_bytes(b"b")
    assert file_change([str(a), str(b)], stamp) == "1 file(s) when ingested, 2 now"
    a.unlink()
    assert "cannot be read now" in file_change([str(a)], stamp)
    assert file_stamp([str(a)]) == "" and file_stamp([str(tmp_path)]) == "" and file_change([str(b)], "") is None


def test_a_rows_stamp_changes_with_any_value_dtype_or_shape_and_names_the_array():
    X, coords, labels = np.arange(6, dtype=np.float64).reshape(3, 2), np.arange(3)[:, None], np.full(3, -1)
    stamp = rows_stamp(X, coords, labels)
    assert stamp == rows_stamp(X.copy(), coords, labels) and rows_change(stamp, rows_stamp(X.copy(), coords, labels)) is None
    changed = X.copy()
    changed[2, 1] += 1e-9
    assert rows_change(stamp, rows_stamp(changed, coords, labels)) == "features"
    assert rows_change(stamp, rows_stamp(X.astype(np.float32), coords, labels)) == "features"
    assert rows_change(stamp, rows_stamp(X.reshape(2, 3), coords, labels)) == "features"
    assert rows_change(stamp, rows_stamp(X, coords, np.array([0, 1, -1]))) == "instance labels"
    assert rows_change(stamp, rows_stamp(X, coords + 1, np.array([0, 1, -1]))) == "coordinates, instance labels"
    assert rows_change('{"rows": "0"}', stamp) == "rows" and rows_change("", stamp) is None
    assert "table" in file_change(["x"], stamp)


def features_of(store: Path, bag: int) -> np.ndarray:
    return zarr.open_group(str(store), mode="r")["instances/features"][open_cohort(store).bag_slice(bag)]


def write_h5(path: Path, features: np.ndarray) -> None:
    with h5py.File(path, "w") as handle:
        handle["features"] = features
        handle["coords"] = np.arange(2 * len(features)).reshape(-1, 2) * 256


def test_an_h5_file_re_extracted_since_its_ingest_is_reported_and_the_store_keeps_its_features(tmp_path):
    from tasks.ingest.h5 import ingest_h5_features

    rng = np.random.default_rng(0)
    folder = tmp_path / "h5"
    folder.mkdir()
    first = {f"s{k}": rng.normal(size=(5, 4)).astype(np.float32) for k in range(3)}
    for name, features in first.items():
        write_h5(folder / f"{name}.h5", features)
    pd.DataFrame({"slide_id": list(first), "label": [0, 1, 1]}).to_csv(tmp_path / "labels.csv", index=False)
    store = tmp_path / "c.zarr"
    assert ingest_h5_features(store, folder, tmp_path / "labels.csv").added == ("s0", "s1", "s2")
    write_h5(folder / "s1.h5", rng.normal(size=(5, 4)).astype(np.float32))  # another extractor, same shape
    os.utime(folder / "s2.h5", ns=(7, 7))  # only touched
    report = ingest_h5_features(store, folder, tmp_path / "labels.csv")
    assert report.already_done == ("s0", "s2") and report.added == ()
    assert [(s.bag_id, s.error) for s in report.skipped] == [("s1", "SourceChangedError")]
    assert "changed since it was ingested (same size, other content)" in report.skipped[0].reason
    assert "ingest into a new store" in report.skipped[0].reason and report.skipped[0].path == str(folder / "s1.h5")
    assert np.array_equal(features_of(store, 1), first["s1"])  # the store keeps what it has
    write_h5(folder / "s1.h5", first["s1"])  # put back: done again
    assert ingest_h5_features(store, folder, tmp_path / "labels.csv").already_done == ("s0", "s1", "s2")


def test_a_table_whose_rows_for_a_bag_changed_reports_that_bag_only(tmp_path):
    from tasks.ingest.tables import ingest_table, read_mil_csv

    rng = np.random.default_rng(1)
    rows = [[label, bag, *rng.normal(size=3).round(6)] for bag, label in (("a", 0), ("b", 1), ("c", 1)) for _ in range(4)]
    path = tmp_path / "t.csv"
    pd.DataFrame(rows).to_csv(path, header=False, index=False)
    store = tmp_path / "t.zarr"
    assert ingest_table(store, read_mil_csv(path)).added == ("a", "b", "c")
    before = features_of(store, 1)
    assert ingest_table(store, read_mil_csv(path)).already_done == ("a", "b", "c")
    rows[5][3] += 0.5  # one value of bag b
    pd.DataFrame(rows).to_csv(path, header=False, index=False)
    report = ingest_table(store, read_mil_csv(path))
    assert report.already_done == ("a", "c") and [(s.bag_id, s.error) for s in report.skipped] == [("b", "SourceChangedError")]
    assert "its features differ from those ingested" in report.skipped[0].reason
    assert np.array_equal(features_of(store, 1), before)


def _write_tagged(item: IngestItem, writer) -> None:
    """Bag writer reading one number from the item's file: the features show which version was read."""
    value = float(Path(item.source).read_text())
    writer.write(np.full((2, 3), value, dtype=np.float32), np.zeros((2, 1)), np.full(2, -1))


def test_a_bag_staged_by_an_interrupted_run_from_a_file_changed_since_is_staged_again(tmp_path):
    spec = CohortSpec("c", n_features=3, coords_dim=1, coords_meaning="instance_index")
    store, files = tmp_path / "c.zarr", [tmp_path / f"s{k}.txt" for k in range(2)]
    for k, path in enumerate(files):
        path.write_text(str(k))
    items = [IngestItem(f"s{k}", str(path), k) for k, path in enumerate(files)]
    create_cohort(store, spec)
    for item in items:  # an interrupted run staged both bags completely, then died before committing
        staged = StagingWriter(store, item.bag_id, item.label, item.source, input_stamp=file_stamp(item.input_files()))
        _write_tagged(item, staged)
        staged.finish()
    files[1].write_text("5")
    report = run_ingest(store, spec, items, _write_tagged)
    assert report.added == ("s0", "s1") and features_of(store, 0)[0, 0] == 0 and features_of(store, 1)[0, 0] == 5
    assert set(zarr.open_group(str(store), mode="r")["staging"]) == set()


def test_a_torchmil_side_file_belongs_to_its_bag_and_a_store_without_stamps_reads_as_done(tmp_path):
    from tasks.ingest.npy import ingest_bag_files

    rng = np.random.default_rng(2)
    for sub in ("features", "labels", "inst"):
        (tmp_path / sub).mkdir()
    for k in range(2):
        np.save(tmp_path / "features" / f"b{k}.npy", rng.normal(size=(3, 4)).astype(np.float32))
        np.save(tmp_path / "labels" / f"b{k}.npy", np.array([k]))
        np.save(tmp_path / "inst" / f"b{k}.npy", np.array([0, 0, k]))
    store = tmp_path / "n.zarr"

    def ingest():
        return ingest_bag_files(store, tmp_path / "features", labels_dir=tmp_path / "labels", inst_labels_dir=tmp_path / "inst")

    assert ingest().added == ("b0", "b1")
    np.save(tmp_path / "inst" / "b1.npy", np.array([0, 1, 1]))  # only the instance labels changed
    report = ingest()
    assert [(s.bag_id, s.error) for s in report.skipped] == [("b1", "SourceChangedError")]
    assert zarr.open_group(str(store), mode="r")["instances/label"][:].tolist() == [0, 0, 0, 0, 0, 1]
    # A store written before stamps existed: its bags have none, so a rerun finds them done and the array is added.
    group = zarr.open_group(str(store), mode="a")
    del group["bags/input_stamp"]
    assert ingest().already_done == ("b0", "b1")
    assert zarr.open_group(str(store), mode="r")["bags/input_stamp"][:].tolist() == ["", ""]
    shutil.move(tmp_path / "features", tmp_path / "moved")  # such a store cannot tell a moved file: it says so
    report = ingest_bag_files(store, tmp_path / "moved", labels_dir=tmp_path / "labels", inst_labels_dir=tmp_path / "inst")
    assert {s.error for s in report.skipped} == {"DuplicateIdError"} and "no input stamp for it" in report.skipped[0].reason


def test_a_ct_series_that_lost_a_slice_since_its_ingest_is_reported(tmp_path):
    from tasks.ingest.ct import ingest_ct
    from tasks.ingest.synthetic import make_ct_cohort

    scans = make_ct_cohort(tmp_path / "dicom", 2, n_slices=6, size=32, positive_fraction=0.5, seed=3)
    store, labels = tmp_path / "ct.zarr", tmp_path / "dicom" / "labels.csv"
    assert len(ingest_ct(store, tmp_path / "dicom", labels_csv=labels).added) == 2
    Path(scans[0].paths[-1]).unlink()  # the first series' last slice (one from the middle would be a gap)
    report = ingest_ct(store, tmp_path / "dicom", labels_csv=labels)
    assert report.already_done == (scans[1].series_uid,)
    assert [(s.bag_id, s.error) for s in report.skipped] == [(scans[0].series_uid, "SourceChangedError")]
    assert "6 file(s) when ingested, 5 now" in report.skipped[0].reason
    assert np.diff(open_cohort(store).offsets).tolist() == [6, 6]


def test_a_cohort_moved_or_copied_since_its_ingest_is_done_and_another_file_under_its_ids_is_a_duplicate(tmp_path):
    """A rerun on a moved folder found every bag 'already in the store from <old path>' (a duplicate):
    nothing added, nothing done, and the pipeline's ingest failed. The stamp tells the same files at
    a new path (done) from other files under the same ids (duplicates)."""
    from tasks.ingest.h5 import ingest_h5_features
    from tasks.ingest.tables import ingest_table, read_npz_table

    rng = np.random.default_rng(4)
    (tmp_path / "a").mkdir()
    for k in range(3):
        write_h5(tmp_path / "a" / f"s{k}.h5", rng.normal(size=(4, 3)).astype(np.float32))
    pd.DataFrame({"slide_id": ["s0", "s1", "s2"], "label": [0, 1, 1]}).to_csv(tmp_path / "labels.csv", index=False)
    store = tmp_path / "c.zarr"
    assert len(ingest_h5_features(store, tmp_path / "a", tmp_path / "labels.csv").added) == 3
    shutil.move(tmp_path / "a", tmp_path / "moved")  # same files, same times
    report = ingest_h5_features(store, tmp_path / "moved", tmp_path / "labels.csv")
    assert report.already_done == ("s0", "s1", "s2") and not report.skipped
    shutil.copytree(tmp_path / "moved", tmp_path / "copy", copy_function=shutil.copyfile)  # new times, same bytes
    write_h5(tmp_path / "copy" / "s2.h5", rng.normal(size=(4, 3)).astype(np.float32))  # another file called s2
    report = ingest_h5_features(store, tmp_path / "copy", tmp_path / "labels.csv")
    assert report.already_done == ("s0", "s1")
    assert [(s.bag_id, s.error) for s in report.skipped] == [("s2", "DuplicateIdError")]
    assert f"already in the store from {tmp_path / 'a' / 's2.h5'}" in report.skipped[0].reason
    assert open_cohort(store).n_bags == 3

    np.savez(tmp_path / "t.npz", X=rng.normal(size=(4, 2)), bag_ids=np.array(["a", "a", "b", "b"]), labels=np.array([0, 0, 1, 1]))
    assert ingest_table(tmp_path / "t.zarr", read_npz_table(tmp_path / "t.npz")).added == ("a", "b")
    shutil.copy(tmp_path / "t.npz", tmp_path / "u.npz")
    assert ingest_table(tmp_path / "t.zarr", read_npz_table(tmp_path / "u.npz")).already_done == ("a", "b")


def test_two_stores_of_one_cohort_from_other_feature_files_do_not_share_a_model_key(tmp_path):
    """Bag ids, labels and offsets are equal for two extractors' .h5 folders of one cohort; the
    fingerprint (and so the model and prediction keys) now tells them apart by the input stamps'
    content, and keeps the fingerprint of a store without stamps as it was."""
    import hashlib
    import json

    from tasks.ingest.h5 import ingest_h5_features
    from tasks.prefect_tasks import fingerprint_cohort

    rng = np.random.default_rng(8)
    pd.DataFrame({"slide_id": ["s0", "s1"], "label": [0, 1]}).to_csv(tmp_path / "labels.csv", index=False)
    for folder in ("uni", "conch"):
        (tmp_path / folder).mkdir()
        for k in range(2):
            write_h5(tmp_path / folder / f"s{k}.h5", rng.normal(size=(4, 3)).astype(np.float32))
        ingest_h5_features(tmp_path / f"{folder}.zarr", tmp_path / folder, tmp_path / "labels.csv")
    shutil.copytree(tmp_path / "uni", tmp_path / "uni-copy", copy_function=shutil.copyfile)
    ingest_h5_features(tmp_path / "uni-copy.zarr", tmp_path / "uni-copy", tmp_path / "labels.csv")
    keys = {name: fingerprint_cohort.fn(str(tmp_path / f"{name}.zarr")) for name in ("uni", "conch", "uni-copy")}
    assert keys["uni"] != keys["conch"] and keys["uni"] == keys["uni-copy"]  # other features / the same files elsewhere

    group = zarr.open_group(str(tmp_path / "conch.zarr"), mode="a")
    del group["bags/input_stamp"]  # a store written before stamps: the fingerprint it always had
    cohort = open_cohort(tmp_path / "conch.zarr")
    digest = hashlib.sha256()
    for array in (np.asarray(cohort.bag_ids, dtype=str), np.asarray(cohort.bag_labels), np.asarray(cohort.offsets)):
        digest.update(array.tobytes())
    digest.update(json.dumps(cohort.attrs.get("feature_extractor"), sort_keys=True, default=str).encode())
    assert fingerprint_cohort.fn(str(tmp_path / "conch.zarr")) == digest.hexdigest()[:16]


def test_a_table_read_with_other_feature_columns_is_refused_by_the_model(tmp_path):
    import json

    import pytest

    from tasks.ingest.tables import ingest_table, read_parquet_table
    from tasks.prefect_tasks import _check_same_features

    frame = pd.DataFrame({"bag_id": ["a", "a", "b", "b"], "label": [0, 0, 1, 1], "f0": [1.0, 2, 3, 4], "f1": [5.0, 6, 7, 8]})
    frame.to_parquet(tmp_path / "t.parquet")
    ingest_table(tmp_path / "train.zarr", read_parquet_table(tmp_path / "t.parquet"))
    ingest_table(tmp_path / "new.zarr", read_parquet_table(tmp_path / "t.parquet", feature_columns=["f1", "f0"]))
    (tmp_path / "model").mkdir()
    train = open_cohort(tmp_path / "train.zarr").attrs
    (tmp_path / "model" / "model.json").write_text(json.dumps({
        "store": str(tmp_path / "train.zarr"), "feature_extractor": train["feature_extractor"],
        "feature_columns": train["feature_columns"]}))
    _check_same_features(str(tmp_path / "train.zarr"), str(tmp_path / "model"))
    with pytest.raises(ValueError, match=r"new\.zarr's features are other table columns .*first difference at feature 0: "
                                         r"here 'f1', in .*train\.zarr 'f0'\): read the table with the training table's"):
        _check_same_features(str(tmp_path / "new.zarr"), str(tmp_path / "model"))


def test_a_slide_is_stamped_with_every_file_it_is_read_from(tmp_path):
    from tasks.ingest.slide_io import slide_files

    (tmp_path / "a").mkdir()
    for name in ("a.mrxs", "a/Slidedat.ini", "a/Data0000.dat", "b.svs"):
        (tmp_path / name).write_bytes(b"x")
    (tmp_path / "dicom").mkdir()
    for name in ("level1.dcm", "level0.dcm", "notes.txt"):
        (tmp_path / "dicom" / name).write_bytes(b"x")
    assert slide_files(tmp_path / "a.mrxs") == tuple(str(tmp_path / n) for n in ("a.mrxs", "a/Data0000.dat", "a/Slidedat.ini"))
    assert slide_files(tmp_path / "dicom") == tuple(str(tmp_path / "dicom" / n) for n in ("level0.dcm", "level1.dcm"))
    assert slide_files(tmp_path / "b.svs") == (str(tmp_path / "b.svs"),)
    stamp = file_stamp(slide_files(tmp_path / "a.mrxs"))
    (tmp_path / "a" / "Data0000.dat").write_bytes(b"y")  # the MIRAX data changed, its index did not
    assert file_change(slide_files(tmp_path / "a.mrxs"), stamp) == "same size, other content"


def test_a_changed_file_reached_by_another_spelling_of_its_path_is_a_change_not_a_duplicate(tmp_path, monkeypatch):
    from tasks.ingest.h5 import ingest_h5_features

    rng = np.random.default_rng(9)
    (tmp_path / "h5").mkdir()
    write_h5(tmp_path / "h5" / "s0.h5", rng.normal(size=(4, 3)).astype(np.float32))
    write_h5(tmp_path / "h5" / "s1.h5", rng.normal(size=(4, 3)).astype(np.float32))
    pd.DataFrame({"slide_id": ["s0", "s1"], "label": [0, 1]}).to_csv(tmp_path / "labels.csv", index=False)
    monkeypatch.chdir(tmp_path)
    assert len(ingest_h5_features(tmp_path / "c.zarr", Path("h5"), tmp_path / "labels.csv").added) == 2  # relative
    (tmp_path / "link").symlink_to(tmp_path / "h5")
    write_h5(tmp_path / "h5" / "s1.h5", rng.normal(size=(5, 3)).astype(np.float32))
    report = ingest_h5_features(tmp_path / "c.zarr", tmp_path / "link", tmp_path / "labels.csv")  # absolute, via a symlink
    assert report.already_done == ("s0",) and [(s.bag_id, s.error) for s in report.skipped] == [("s1", "SourceChangedError")]


def test_a_report_draws_a_slide_only_if_it_is_the_one_ingested_also_after_a_move(tmp_path):
    """The store keeps the path a slide was ingested from. A heatmap's thumbnail comes from that
    path while its files match the stamp; after the cohort moved, from the slide of that name under
    the run's ingest.source that matches; a replaced slide (at either place) gives none, never
    another image under the stored tiles."""
    from tasks.ingest.synthetic import make_slide_cohort
    from tasks.ingest.wsi import TilingParams, ingest_slides
    from tasks.prefect_tasks import _slides_as_ingested

    make_slide_cohort(tmp_path / "slides", 3, map_shape=(16, 24), seed=4, tile=128)
    store = tmp_path / "s.zarr"
    ingest_slides(store, tmp_path / "slides", labels_csv=tmp_path / "slides" / "labels.csv",
                  params=TilingParams(tile_size=128, mask_max_side=256), fit_tiles=64)
    cohort = open_cohort(store)
    names = [Path(s).name for s in cohort.sources]
    assert _slides_as_ingested(cohort, [0, 1, 2], tmp_path / "slides") == {}  # every stored path holds its slide
    shutil.move(tmp_path / "slides", tmp_path / "moved")
    shutil.copy(tmp_path / "moved" / names[2], tmp_path / "moved" / names[1])  # another slide under bag 1's name
    assert _slides_as_ingested(cohort, [0, 1, 2], tmp_path / "moved") == {
        cohort.bag_ids[0]: str(tmp_path / "moved" / names[0]), cohort.bag_ids[1]: None,
        cohort.bag_ids[2]: str(tmp_path / "moved" / names[2])}
    shutil.move(tmp_path / "moved", tmp_path / "slides")  # back in place, bag 1's file still replaced
    assert _slides_as_ingested(cohort, [0, 1, 2], tmp_path / "slides") == {cohort.bag_ids[1]: None}


def test_a_ct_report_reads_the_series_of_a_moved_cohort_under_the_runs_source(tmp_path):
    """A CT cohort moved since its ingest is done on rerun; its report's strips read the series
    under the run's ingest.source (slices are taken by the SOPInstanceUIDs the store keeps)."""
    import logging

    from tasks.ingest.ct import ingest_ct
    from tasks.ingest.synthetic import make_ct_cohort
    from tasks.prefect_tasks import _ct_series_by_uid

    scans = make_ct_cohort(tmp_path / "dicom", 2, n_slices=6, size=32, positive_fraction=0.5, seed=5)
    ingest_ct(tmp_path / "ct.zarr", tmp_path / "dicom", labels_csv=tmp_path / "dicom" / "labels.csv")
    sources = open_cohort(tmp_path / "ct.zarr").sources
    shutil.move(tmp_path / "dicom", tmp_path / "moved")
    logger = logging.getLogger("test")
    assert _ct_series_by_uid(sources, logger) == {}
    found = _ct_series_by_uid(sources, logger, tmp_path / "moved")
    assert sorted(found) == sorted(s.series_uid for s in scans)
    assert all(Path(f).is_relative_to(tmp_path / "moved") for s in found.values() for f in s.files)
