"""Head CT: HU and windows against hand-computed values, slice ordering, RSNA labels, bad inputs, plug-in extractors."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pydicom
import pytest
from pydicom.data import get_testdata_file

from tasks.ingest.errors import IngestError
from tasks.ingest.ct import (ingest_ct, load_windowed_slices, order_slices, scan_dicom_dir, studies_of_several_bags, to_hu,
                             windowed_channels)
from tasks.ingest.features import HandcraftedCT, extractor_spec, make_extractor, register_extractor
from tasks.ingest.synthetic import make_ct_cohort, write_ct_series
from tasks.store import open_cohort


def test_bundled_ct_small_is_rescaled_to_hu_before_windowing():
    ds = pydicom.dcmread(get_testdata_file("CT_small.dcm"))
    assert (ds.RescaleSlope, ds.RescaleIntercept) == (1, -1024)
    hu = to_hu(ds)
    assert hu[0, 0] == 175 - 1024 and hu[0, 49] == 1053 - 1024  # stored values 175 and 1053
    windows = windowed_channels(hu)
    np.testing.assert_allclose(windows[0, 0], [0.0, 0.0, 0.0])  # -849 HU: below every window
    # 29 HU: brain (29 - 0) / 80, blood (29 + 20) / 200, soft tissue (29 + 150) / 380
    np.testing.assert_allclose(windows[0, 49], [29 / 80, 49 / 200, 179 / 380], rtol=1e-6)
    assert windows[64, 64].tolist() == [1.0, 1.0, 1.0]  # 904 HU (bone): above every window


def test_slope_and_intercept_are_applied_and_windows_clip(tmp_path):
    hu = np.array([[[40.0, 80.0], [-1000.0, 3000.0]]])
    _, _, paths = write_ct_series(tmp_path, hu, series_key="k", rescale_intercept=-1000.0, rescale_slope=2.0)
    ds = pydicom.dcmread(paths[0])
    assert ds.pixel_array[0, 0] == 520  # (40 + 1000) / 2
    np.testing.assert_array_equal(to_hu(ds), hu[0])
    windows = load_windowed_slices([str(paths[0])])[0]
    np.testing.assert_allclose(windows[0, 0], [0.5, 0.3, 0.5])
    np.testing.assert_allclose(windows[0, 1], [1.0, 0.5, 230 / 380], rtol=1e-6)
    np.testing.assert_allclose(windows[1], [[0, 0, 0], [1, 1, 1]])


def test_slices_are_ordered_along_the_slice_normal_not_by_name_or_instance_number(tmp_path):
    scans = make_ct_cohort(tmp_path, 2, n_slices=7, size=16, seed=1)
    series, errors = scan_dicom_dir(tmp_path)
    assert not errors
    by_uid = {s.series_uid: s for s in series}
    for scan in scans:
        assert by_uid[scan.series_uid].sop_uids == scan.sop_uids
    # Column cosine (0, -1, 0) flips the normal to -z: the slice at the highest z comes first.
    headers = [pydicom.Dataset() for _ in range(3)]
    for header, z in zip(headers, (5.0, -5.0, 0.0)):
        header.ImageOrientationPatient = [1, 0, 0, 0, -1, 0]
        header.ImagePositionPatient = [0, 0, z]
    assert order_slices(headers) == [0, 2, 1]


def test_ct_ingest_takes_rsna_labels_and_reports_bad_files(tmp_path):
    scans = make_ct_cohort(tmp_path / "dicom", 4, n_slices=8, size=32, positive_fraction=0.5, seed=2)
    (tmp_path / "dicom" / "patient_00000" / "garbage.dcm").write_bytes(b"not a dicom file at all")
    negative = next(s for s in scans if s.label == 0)
    positive = next(s for s in scans if s.label == 1)
    clean_slices = np.flatnonzero(positive.slice_labels == 0)[:2]
    dropped = {*negative.sop_uids[:2], *(positive.sop_uids[k] for k in clean_slices)}
    labels = pd.read_csv(tmp_path / "dicom" / "labels.csv")
    labels = labels[~labels["ID"].str.slice(3).str.rsplit("_", n=1).str[0].isin(dropped)]
    labels.to_csv(tmp_path / "labels.csv", index=False)

    report = ingest_ct(tmp_path / "ct.zarr", tmp_path / "dicom", labels_csv=tmp_path / "labels.csv")

    problems = {(s.error, Path(s.path).name) for s in report.skipped}
    assert problems == {("UnreadableFileError", "garbage.dcm"),
                        ("MissingLabelError", Path(negative.paths[0]).parent.name)}
    cohort = open_cohort(tmp_path / "ct.zarr")
    expected = {s.series_uid: s for s in scans if s is not negative}
    assert set(cohort.bag_ids) == set(expected)
    assert cohort.n_features == HandcraftedCT().n_features and cohort.attrs["coords_meaning"] == "slice_index"
    for b, uid in enumerate(cohort.bag_ids):
        block = cohort.read_bags(b, b + 1)
        truth = expected[uid].slice_labels.copy()
        if uid == positive.series_uid:
            truth[clean_slices] = -1  # their labels were removed; the bag is still positive
        np.testing.assert_array_equal(block.instance_labels, truth)
        np.testing.assert_array_equal(block.coords[:, 0], np.arange(len(truth)))
        assert cohort.bag_labels[b] == expected[uid].label


@register_extractor("window-means")
class WindowMeans:
    """A user's own extractor (stands for a local torch model): mean of each window."""

    name, version, n_features = "window-means", "1", 3

    def params(self) -> dict[str, Any]:
        return {}

    def __call__(self, batch: np.ndarray) -> np.ndarray:
        return batch.mean(axis=(1, 2)).astype(np.float32)


def test_a_registered_plug_in_extractor_is_used_and_recorded(tmp_path):
    scans = make_ct_cohort(tmp_path / "dicom", 2, n_slices=5, size=16, seed=3)
    ingest_ct(tmp_path / "ct.zarr", tmp_path / "dicom", extractor=WindowMeans())
    cohort = open_cohort(tmp_path / "ct.zarr")
    assert cohort.attrs["feature_extractor"] == extractor_spec(make_extractor("window-means"))
    assert (cohort.bag_labels == -1).all()  # no labels CSV: a cohort to predict
    for b, uid in enumerate(cohort.bag_ids):
        scan = next(s for s in scans if s.series_uid == uid)
        expected = load_windowed_slices([str(p) for p in scan.paths]).mean(axis=(1, 2))
        np.testing.assert_allclose(cohort.read_bags(b, b + 1).features, expected, rtol=1e-6)


def test_handcrafted_ct_features_have_the_documented_blocks():
    rng = np.random.default_rng(4)
    batch = rng.random((3, 64, 64, 3)).astype(np.float32)
    extractor = HandcraftedCT(work_size=32, bins=8)
    features = extractor(batch)
    assert features.shape == (3, extractor.n_features) == (3, sum(w for _, w in extractor.blocks()))
    hist = features[:, :24].reshape(3, 3, 8)
    np.testing.assert_allclose(hist.sum(axis=2), 1.0, rtol=1e-6)
    np.testing.assert_allclose(features[0], extractor(batch[:1])[0], rtol=1e-6)  # batch-independent
    with pytest.raises(KeyError, match="no feature extractor registered"):
        make_extractor("absent")


@pytest.mark.slow
def test_process_workers_give_the_same_store_as_the_inline_ingest(tmp_path):
    make_ct_cohort(tmp_path / "dicom", 3, n_slices=6, size=32, seed=5)
    labels = tmp_path / "dicom" / "labels.csv"
    ingest_ct(tmp_path / "inline.zarr", tmp_path / "dicom", labels_csv=labels)
    report = ingest_ct(tmp_path / "pool.zarr", tmp_path / "dicom", labels_csv=labels, max_workers=2)
    assert len(report.added) == 3 and not report.skipped
    a, b = open_cohort(tmp_path / "inline.zarr"), open_cohort(tmp_path / "pool.zarr")
    assert list(a.bag_ids) == list(b.bag_ids)
    np.testing.assert_array_equal(a.read_bags(0, 3).features, b.read_bags(0, 3).features)


def test_findings_name_slices_by_the_sop_uids_stored_at_ingest_after_the_dicom_folder_is_gone(tmp_path):
    """SOPInstanceUIDs are stored per slice at ingest: with the DICOM folder moved away after
    ingest, the instance and bag tables of a real prediction run still name each slice."""
    import shutil

    from distributed import Client, LocalCluster

    from mil_core import VGPMIL
    from tasks import report
    from tasks.training import predict_cohort

    scans = make_ct_cohort(tmp_path / "dicom", 4, n_slices=6, size=32, positive_fraction=0.5, seed=11)
    ingest_ct(tmp_path / "ct.zarr", tmp_path / "dicom", labels_csv=tmp_path / "dicom" / "labels.csv")
    shutil.move(tmp_path / "dicom", tmp_path / "moved")
    cohort = open_cohort(tmp_path / "ct.zarr")
    assert cohort.instance_id_kind == "SOPInstanceUID"
    stored = cohort.read_bags(0, cohort.n_bags)
    model = VGPMIL(n_inducing=4, max_iter=3, tol=0.1, random_state=0).fit(
        stored.features.astype(np.float64), stored.bag, cohort.bag_labels[stored.bag])
    with LocalCluster(n_workers=1, processes=False, dashboard_address=":0") as cluster, Client(cluster) as client:
        predict_cohort(model, tmp_path / "ct.zarr", client, run="p")
    instances = report.instance_table(tmp_path / "ct.zarr", "p")
    assert list(instances.columns[:4]) == ["bag_id", "instance", "slice_index", "sop_instance_uid"]
    by_series = {s.series_uid: s for s in scans}
    for uid in cohort.bag_ids:
        rows = instances[instances["bag_id"] == uid]
        assert rows["sop_instance_uid"].tolist() == list(by_series[uid].sop_uids)  # in slice order, each its own slice
    bags = report.bag_table(tmp_path / "ct.zarr", "p", top_k=2)
    top = json.loads(bags.at[0, "most_suspicious"])
    assert all(t["SOPInstanceUID"] in by_series[cohort.bag_ids[0]].sop_uids for t in top)
    assert bags["original_label"].str.contains('"any":').all()


def test_a_ct_store_keeps_no_bag_without_its_slice_uids(tmp_path):
    from tasks.ingest.errors import FeatureDimensionError
    from tasks.store import BagData, append_bags

    make_ct_cohort(tmp_path / "dicom", 1, n_slices=4, size=32, seed=1)
    ingest_ct(tmp_path / "ct.zarr", tmp_path / "dicom")
    bag = open_cohort(tmp_path / "ct.zarr").read_bags(0, 1)
    with pytest.raises(FeatureDimensionError, match="keeps instance ids \\(SOPInstanceUID\\)"):
        append_bags(tmp_path / "ct.zarr", [BagData("x", 0, "/x", bag.features, bag.coords, bag.instance_labels)])
    assert open_cohort(tmp_path / "ct.zarr").n_bags == 1


def test_a_slice_label_other_than_0_or_1_names_the_slice_and_its_value(tmp_path):
    scans = make_ct_cohort(tmp_path / "dicom", 2, n_slices=4, size=16, seed=4)
    labels = pd.read_csv(tmp_path / "dicom" / "labels.csv")
    wrong = f"ID_{scans[0].sop_uids[2]}_any"
    labels.loc[labels["ID"] == wrong, "Label"] = 2
    labels.to_csv(tmp_path / "labels.csv", index=False)
    report = ingest_ct(tmp_path / "ct.zarr", tmp_path / "dicom", labels_csv=tmp_path / "labels.csv")
    (skipped,) = report.skipped
    assert skipped.bag_id == scans[0].series_uid and f"gives {wrong} = 2 (slice file {Path(scans[0].paths[2]).name})" in skipped.reason


def test_a_scout_in_the_series_is_refused_and_a_dose_report_beside_a_scan_does_not_count(tmp_path):
    """A localizer kept in the series (same SeriesInstanceUID, another plane) was ordered into the
    stack as a slice; an SR dose report in the scan's folder made it 'a folder of 2 series'."""
    from pydicom.uid import generate_uid

    uid, _, paths = write_ct_series(tmp_path / "scout" / "p1", np.zeros((6, 16, 16)), series_key="scout")
    scout = pydicom.dcmread(paths[2])
    scout.SOPInstanceUID = generate_uid(entropy_srcs=["scout-localizer"])
    scout.ImageOrientationPatient = [0.0, 1.0, 0.0, 0.0, 0.0, -1.0]  # sagittal
    scout.ImagePositionPatient = [-22.5, -125.0, 125.0]
    scout.save_as(tmp_path / "scout" / "p1" / "localizer.dcm")
    series, errors = scan_dicom_dir(tmp_path / "scout")
    assert not series and [e.bag_id for e in errors] == [uid]
    assert "slice localizer.dcm lies in another plane (ImageOrientationPatient [0.0, 1.0, 0.0, 0.0, 0.0, -1.0])" in errors[0].reason

    uid, _, paths = write_ct_series(tmp_path / "dose" / "p2", np.zeros((6, 16, 16)), series_key="dose")
    report = pydicom.dcmread(paths[0])
    report.Modality, report.SeriesInstanceUID = "SR", generate_uid(entropy_srcs=["dose-report"])
    report.SOPInstanceUID = generate_uid(entropy_srcs=["dose-report-sop"])
    report.save_as(tmp_path / "dose" / "p2" / "dose.dcm")
    series, errors = scan_dicom_dir(tmp_path / "dose")
    assert [s.series_uid for s in series] == [uid] and len(series[0].files) == 6
    assert [(Path(e.path).name, "Modality 'SR', not CT" in e.reason) for e in errors] == [("p2", True)]


def test_notes_and_dicomdir_beside_the_series_are_not_inputs_and_upper_case_subtypes_label(tmp_path):
    """A README, a DICOMDIR index and a notes file were listed as unreadable DICOM inputs (and
    could be the 'first left out' reason of a run); an RSNA row spelled ID_…_ANY left its scan
    unlabelled."""
    from tasks.ingest.ct import read_rsna_labels

    uid, sops, paths = write_ct_series(tmp_path / "dicom" / "p1", np.zeros((4, 16, 16)), series_key="notes")
    (tmp_path / "dicom" / "README").write_text("exported from PACS\n")
    (tmp_path / "dicom" / "DICOMDIR").write_bytes(pydicom.dcmread(paths[0]).PixelData[:64])
    (tmp_path / "dicom" / "p1" / "notes.TXT").write_text("scan ok\n")
    (tmp_path / "dicom" / "p1" / "broken.dcm").write_bytes(b"not a dicom file")
    series, errors = scan_dicom_dir(tmp_path / "dicom")
    assert [s.series_uid for s in series] == [uid]
    assert [Path(e.path).name for e in errors] == ["broken.dcm"]  # a real non-DICOM slice file is still named

    (tmp_path / "labels.csv").write_text("ID,Label\n" + "".join(f"ID_{s}_ANY,{int(k == 2)}\n" for k, s in enumerate(sops)))
    assert read_rsna_labels(tmp_path / "labels.csv") == {s: int(k == 2) for k, s in enumerate(sops)}


def test_slices_missing_at_regular_intervals_are_refused_as_such_and_one_gap_as_a_missing_slice(tmp_path):
    _, _, paths = write_ct_series(tmp_path / "two" / "p1", np.zeros((10, 16, 16)), series_key="two", slice_thickness=2.5)
    z = np.cumsum([0.0] + [5.0 if k % 3 == 2 else 2.5 for k in range(9)])  # every third step 5 mm: 2.5, 2.5, 5, 2.5 …
    for path, position in zip(paths, z):
        ds = pydicom.dcmread(path)
        ds.ImagePositionPatient = [-125.0, -125.0, float(position)]
        ds.save_as(path)
    (error,) = scan_dicom_dir(tmp_path / "two")[1]
    assert (f"slices 2.50 mm apart (6 steps) and 5.00 mm apart (3 steps, the first between slices {paths[2].name} and "
            f"{paths[3].name}): slices missing at regular intervals, or spacings that alternate") in error.reason

    _, _, paths = write_ct_series(tmp_path / "gap" / "p1", np.zeros((8, 16, 16)), series_key="gap", slice_thickness=2.5)
    paths[4].unlink()
    (error,) = scan_dicom_dir(tmp_path / "gap")[1]
    assert f"gap of 5.00 mm between slices {paths[3].name} and {paths[5].name} (median spacing 2.50 mm): a slice is missing" in error.reason


def test_a_scan_the_labels_do_not_give_is_kept_unlabelled_for_a_cohort_to_predict(tmp_path):
    scans = make_ct_cohort(tmp_path / "dicom", 2, n_slices=4, size=16, positive_fraction=0.0, seed=5)
    labels = pd.read_csv(tmp_path / "dicom" / "labels.csv")
    keep = labels["ID"].str.contains(scans[0].sop_uids[0]) | ~labels["ID"].str.contains("|".join(scans[0].sop_uids))
    labels[keep].to_csv(tmp_path / "labels.csv", index=False)  # scan 0 keeps one labelled slice of four
    skipping = ingest_ct(tmp_path / "a.zarr", tmp_path / "dicom", labels_csv=tmp_path / "labels.csv")
    assert [s.bag_id for s in skipping.skipped] == [scans[0].series_uid]
    from tasks.ingest.ct import plan_ct

    plan = plan_ct(tmp_path / "b.zarr", tmp_path / "dicom", labels_csv=tmp_path / "labels.csv", keep_unlabelled=True)
    kept = {item.bag_id: item for item in plan.items}
    assert not plan.skipped and kept[scans[0].series_uid].label == -1 and kept[scans[1].series_uid].label == 0
    assert kept[scans[0].series_uid].payload["instance_labels"] == [0, -1, -1, -1]


def test_rsna_uids_that_carry_id_prefixes_are_labelled_and_read_quietly(tmp_path, caplog):
    """In the RSNA data the headers' SOPInstanceUIDs are 'ID_00e680819' themselves and the rows
    'ID_00e680819_any': every scan was skipped as unlabelled (and pydicom warned once per file,
    both as a warning and on its logger, which Prefect's logging prints)."""
    import logging
    import warnings

    from tasks.ingest.ct import plan_ct

    _, sops, paths = write_ct_series(tmp_path / "stage_2_train", np.zeros((4, 16, 16)), series_key="rsna")
    rsna_uids = [f"ID_{k:09x}" for k in range(4)]
    for path, uid in zip(paths, rsna_uids):
        ds = pydicom.dcmread(path)
        ds.SOPInstanceUID = ds.file_meta.MediaStorageSOPInstanceUID = uid
        ds.save_as(path)
    (tmp_path / "labels.csv").write_text("ID,Label\n" + "".join(f"{uid}_any,{int(k == 1)}\n{uid}_subdural,0\n"
                                                                for k, uid in enumerate(rsna_uids)))
    caplog.clear()  # pydicom logged the UIDs written above
    with warnings.catch_warnings(record=True) as caught, caplog.at_level(logging.WARNING, logger="pydicom"):
        warnings.simplefilter("always")
        plan = plan_ct(tmp_path / "c.zarr", tmp_path / "stage_2_train", labels_csv=tmp_path / "labels.csv")
        load_windowed_slices(plan.items[0].payload["files"])
    assert not plan.skipped and [i.label for i in plan.items] == [1]
    assert plan.items[0].payload["instance_labels"] == [0, 1, 0, 0]
    assert not [w for w in caught if "pydicom" in str(w.filename)], [str(w.message) for w in caught][:3]
    assert not [r for r in caplog.records if r.name.startswith("pydicom")], caplog.records[:3]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="pydicom"):
        pydicom.dcmread(paths[0]).SOPInstanceUID  # outside gpmil's reads, pydicom's log is as it was
    assert any("Invalid value for VR UI" in r.getMessage() for r in caplog.records if r.name == "pydicom")


def test_conflicting_label_rows_and_subtypes_without_any_are_named(tmp_path):
    make_ct_cohort(tmp_path / "dicom", 2, n_slices=4, size=16, positive_fraction=0.5, seed=6)
    labels = pd.read_csv(tmp_path / "dicom" / "labels.csv")
    row = labels[labels["ID"].str.endswith("_any")].iloc[0]
    pd.concat([labels, pd.DataFrame([{"ID": row["ID"], "Label": 1 - row["Label"]}])]).to_csv(tmp_path / "dup.csv", index=False)
    with pytest.raises(IngestError, match=rf"row {len(labels) + 2}: {row['ID']} = {1 - row['Label']}, but an earlier row gives it"):
        ingest_ct(tmp_path / "a.zarr", tmp_path / "dicom", labels_csv=tmp_path / "dup.csv")
    labels[~labels["ID"].str.endswith("_any")].to_csv(tmp_path / "no_any.csv", index=False)
    report = ingest_ct(tmp_path / "b.zarr", tmp_path / "dicom", labels_csv=tmp_path / "no_any.csv")
    assert len(report.skipped) == 2 and all("only: a scan's label comes from its _any rows" in s.reason for s in report.skipped)


def test_copied_multi_frame_mixed_size_and_preambleless_series(tmp_path):
    """A series copied into two folders was 'slices X.dcm and X.dcm are at the same position'; a
    multi-frame file 'no usable RescaleSlope'; sizes that differ after the first 32 slices were
    ingested and failed in the report; a file without the DICOM preamble was unreadable."""
    import shutil

    from pydicom.filewriter import dcmwrite

    _, _, paths = write_ct_series(tmp_path / "copied" / "export_1" / "SER1", np.zeros((4, 16, 16)), series_key="copy")
    shutil.copytree(tmp_path / "copied" / "export_1", tmp_path / "copied" / "export_2")
    (error,) = scan_dicom_dir(tmp_path / "copied")[1]
    assert f"is in two files, {paths[0]} and {tmp_path / 'copied' / 'export_2' / 'SER1' / paths[0].name}" in error.reason

    _, _, paths = write_ct_series(tmp_path / "multi" / "s", np.zeros((3, 16, 16)), series_key="multi")
    ds = pydicom.dcmread(paths[0])
    ds.NumberOfFrames = 8
    ds.save_as(paths[0])
    (error,) = scan_dicom_dir(tmp_path / "multi")[1]
    assert f"{paths[0].name} holds 8 frames (an enhanced, multi-frame CT)" in error.reason

    hu = np.zeros((36, 16, 16))
    _, _, paths = write_ct_series(tmp_path / "sizes" / "s", hu, series_key="sizes")
    write_ct_series(tmp_path / "bigger", np.zeros((36, 24, 24)), series_key="sizes")  # same UIDs, other size
    for k in range(32, 36):
        shutil.copy(tmp_path / "bigger" / paths[k].name, paths[k])
    (error,) = scan_dicom_dir(tmp_path / "sizes")[1]
    assert f"slice {paths[32].name} is 24×24 pixels, {paths[0].name} 16×16: one size per series" in error.reason

    _, sops, paths = write_ct_series(tmp_path / "bare" / "s", np.zeros((3, 16, 16)), series_key="bare")
    ds = pydicom.dcmread(paths[1])
    ds.preamble = None
    dcmwrite(paths[1], ds, enforce_file_format=False)
    assert paths[1].read_bytes()[128:132] != b"DICM"
    series, errors = scan_dicom_dir(tmp_path / "bare")
    assert not errors and list(series[0].sop_uids) == sops
    assert load_windowed_slices(series[0].files).shape == (3, 16, 16, 3)


def _restudy(paths, key: str, study_of: list, image_type: list[str] | None = None, **tags) -> str:
    """Rewrite a written series as another series (``key``) of the study (and patient) of
    ``study_of[0]``, with ``image_type`` and other header tags; returns its SeriesInstanceUID."""
    from pydicom.uid import generate_uid

    series_uid = generate_uid(entropy_srcs=[key, "series"])
    first = pydicom.dcmread(study_of[0])
    for path in paths:
        ds = pydicom.dcmread(path)
        ds.SeriesInstanceUID, ds.StudyInstanceUID, ds.PatientID = series_uid, first.StudyInstanceUID, first.PatientID
        if image_type is not None:
            ds.ImageType = image_type
        for tag, value in tags.items():
            setattr(ds, tag, value)
        ds.save_as(path)
    return series_uid


def test_a_studys_scout_and_reformat_series_are_named_not_bags_and_do_not_refuse_its_scan(tmp_path):
    """An export per series (study/SER_AXIAL, SER_SCOUT, SER_COR) made the localizer a one-slice
    'scan' and the coronal reformat a second bag of the same patient, silently; exported flat into
    one folder, the scout made the axial scan refused as "folder holds 2 series of one study"."""
    axial_uid, _, axial = write_ct_series(tmp_path / "study" / "SER_AXIAL", np.zeros((6, 16, 16)), series_key="axial")
    _, _, scout = write_ct_series(tmp_path / "study" / "SER_SCOUT", np.zeros((1, 16, 16)), series_key="scout")
    scout_uid = _restudy(scout, "scout", axial, ["ORIGINAL", "PRIMARY", "LOCALIZER"],
                         ImageOrientationPatient=[0.0, 1.0, 0.0, 0.0, 0.0, -1.0])
    _, _, coronal = write_ct_series(tmp_path / "study" / "SER_COR", np.zeros((4, 16, 16)), series_key="coronal")
    coronal_uid = _restudy(coronal, "coronal", axial, ["DERIVED", "SECONDARY", "REFORMATTED"])  # its plane is not what tells
    series, errors = scan_dicom_dir(tmp_path / "study")
    assert [s.series_uid for s in series] == [axial_uid] and len(series[0].files) == 6
    reasons = {e.bag_id: e.reason for e in errors}
    assert reasons[scout_uid] == "series of 1 slice: a localizer/scout (ImageType LOCALIZER), not a scan"
    assert reasons[coronal_uid] == ("a derived series (ImageType DERIVED\\SECONDARY\\REFORMATTED: a reformat or reconstruction) "
                                    f"of the study of the original series {axial_uid}: one series per scan, the original")
    flat = tmp_path / "flat"
    flat.mkdir()
    for path in axial + scout:
        (flat / path.name).write_bytes(path.read_bytes())
    series, errors = scan_dicom_dir(flat)
    assert [s.series_uid for s in series] == [axial_uid] and [e.bag_id for e in errors] == [scout_uid]
    _, _, alone = write_ct_series(tmp_path / "alone" / "s", np.zeros((3, 16, 16)), series_key="alone")  # a derived series alone: a scan
    alone_uid = _restudy(alone, "alone", alone, ["DERIVED", "SECONDARY"])
    assert [s.series_uid for s in scan_dicom_dir(tmp_path / "alone")[0]] == [alone_uid]
    for path in [*alone, *axial]:  # study UIDs anonymised away: another patient's original is no original of this one
        ds = pydicom.dcmread(path)
        del ds.StudyInstanceUID
        (tmp_path / "anonymised" / path.parent.name).mkdir(parents=True, exist_ok=True)
        ds.save_as(tmp_path / "anonymised" / path.parent.name / path.name)
    series, errors = scan_dicom_dir(tmp_path / "anonymised")
    assert {s.series_uid for s in series} == {alone_uid, axial_uid} and not errors


def test_a_slice_without_position_or_another_acquisitions_slices_in_a_series_are_refused(tmp_path):
    """One slice without ImagePositionPatient (a topogram with no ImageType) switched the whole
    series to InstanceNumber order and became slice 0; two slices of a repeat acquisition half-way
    between the others' were interleaved into the stack."""
    _, _, paths = write_ct_series(tmp_path / "topogram" / "s", np.zeros((6, 16, 16)), series_key="topogram")
    ds = pydicom.dcmread(paths[3])
    del ds.ImagePositionPatient, ds.ImageOrientationPatient
    ds.save_as(paths[3])
    (error,) = scan_dicom_dir(tmp_path / "topogram")[1]
    assert (f"slice {paths[3].name} has no ImagePositionPatient/ImageOrientationPatient where 5 others have them: a "
            "localizer or another object in the series; remove it") in error.reason
    _, _, paths = write_ct_series(tmp_path / "repeat" / "s", np.zeros((8, 16, 16)), series_key="repeat")
    for k, path in enumerate(paths):  # step and shoot: each rotation's two adjacent slices an acquisition of their own
        ds = pydicom.dcmread(path)
        ds.AcquisitionNumber = 1 + k // 2
        ds.save_as(path)
    assert not scan_dicom_dir(tmp_path / "repeat")[1]
    ds.SOPInstanceUID, ds.AcquisitionNumber, ds.ImagePositionPatient = "1.2.3.4.5.6.7", 9, [-125.0, -125.0, 12.5]  # 10–15 mm
    ds.save_as(paths[2].with_name("repeat.dcm"))
    (error,) = scan_dicom_dir(tmp_path / "repeat")[1]
    assert ("the slices of acquisitions 2 and 9 lie between one another along the slice normal: a repeat acquisition "
            "in the series; remove one") in error.reason
    thin_then_thick = np.concatenate([np.arange(4) * 2.5, 10.0 + np.arange(6) * 5.0])  # a posterior fossa protocol: kept
    _, _, paths = write_ct_series(tmp_path / "fossa" / "s", np.zeros((10, 16, 16)), series_key="fossa")
    for path, z in zip(paths, thin_then_thick):
        ds = pydicom.dcmread(path)
        ds.ImagePositionPatient = [-125.0, -125.0, float(z)]
        ds.save_as(path)
    assert not scan_dicom_dir(tmp_path / "fossa")[1]


def test_a_slice_written_without_file_meta_decodes(tmp_path):
    """A bare dataset (no preamble, no group 0002: older exports) passed the scan, then failed its
    series at decode: "file_meta has no (0002,0010) Transfer Syntax UID"."""
    from pydicom.filewriter import dcmwrite

    hu = np.full((3, 16, 16), 40.0)
    _, _, paths = write_ct_series(tmp_path / "s", hu, series_key="bare-meta")
    ds = pydicom.dcmread(paths[1])
    del ds.file_meta
    ds.preamble = None
    dcmwrite(paths[1], ds, enforce_file_format=False, implicit_vr=True, little_endian=True)
    series, errors = scan_dicom_dir(tmp_path / "s")
    assert not errors
    np.testing.assert_allclose(load_windowed_slices(series[0].files), windowed_channels(hu), atol=1e-6)


def test_several_series_of_one_study_are_bags_named_in_a_warning_in_any_layout_and_a_reformat_never_stands_in(
        tmp_path, caplog):
    """A CQ500-style study (thin and thick soft-kernel and a bone-kernel series, all ORIGINAL) in one
    folder per series became three bags of one patient without a word, and flat in one folder all
    three were refused (the patient lost). Both layouts now keep each series and the ingest warns
    naming the study's series. A coronal reformat became the bag where the axial series was refused
    (a missing slice), and a dose page must not count as an original scan."""
    import logging

    from tasks.ingest.ct import plan_ct

    thin_uid, thin_sops, thin = write_ct_series(tmp_path / "cq500" / "CT PLAIN THIN", np.zeros((8, 16, 16)),
                                                series_key="thin", slice_thickness=0.625)
    _, _, thick = write_ct_series(tmp_path / "cq500" / "CT 5mm", np.zeros((4, 16, 16)), series_key="thick")
    thick_uid = _restudy(thick, "thick", thin, SeriesDescription="CT 5mm")
    _, _, bone = write_ct_series(tmp_path / "cq500" / "CT BONE", np.zeros((4, 16, 16)), series_key="bone")
    bone_uid = _restudy(bone, "bone", thin, SeriesDescription="CT BONE")
    other_uid, _, _ = write_ct_series(tmp_path / "cq500" / "other patient", np.zeros((4, 16, 16)), series_key="other")
    flat = tmp_path / "flat"
    flat.mkdir()
    for path in thick + bone + thin:
        (flat / path.name).write_bytes(path.read_bytes())
    study = pydicom.dcmread(thin[0]).StudyInstanceUID
    patient = pydicom.dcmread(thin[0]).PatientID
    for root, uids in ((tmp_path / "cq500", {thin_uid, thick_uid, bone_uid, other_uid}), (flat, {thin_uid, thick_uid, bone_uid})):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="gpmil.ingest"):
            plan = plan_ct(tmp_path / "a.zarr", root, keep_unlabelled=True)
        assert {item.bag_id for item in plan.items} == uids and not plan.skipped
        (warning,) = [r.getMessage() for r in caplog.records if r.name == "gpmil.ingest"]
        assert warning.startswith(f"1 CT study gives more than one bag (study {study} of patient {patient}: ")
        assert f"{bone_uid} 'CT BONE' (4 slices in {Path(bone[0]).parent if root != flat else flat})" in warning
        assert warning.endswith("the patient counts once per series in training and evaluation; keep the one series to "
                                "use per scan under the ingest source")
    (tmp_path / "labels.csv").write_text("ID,Label\n" + "".join(f"ID_{sop}_any,0\n" for sop in thin_sops))
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="gpmil.ingest"):  # only the thin series is labelled: one bag, no warning
        plan = plan_ct(tmp_path / "b.zarr", flat, labels_csv=tmp_path / "labels.csv")
    assert [item.bag_id for item in plan.items] == [thin_uid] and not caplog.records

    axial_uid, _, axial = write_ct_series(tmp_path / "study" / "AX", np.zeros((6, 16, 16)), series_key="axial")
    axial[3].unlink()  # a slice missing: the axial scan is refused
    _, _, coronal = write_ct_series(tmp_path / "study" / "COR_MPR", np.zeros((4, 16, 16)), series_key="coronal")
    coronal_uid = _restudy(coronal, "coronal", axial[:1], ["DERIVED", "SECONDARY", "REFORMATTED"])
    _, _, dose = write_ct_series(tmp_path / "study" / "DOSE", np.zeros((1, 16, 16)), series_key="dose")
    dose_uid = _restudy(dose, "dose", axial[:1], ["ORIGINAL", "SECONDARY", "SCREEN SAVE"])  # a dose page saved as CT
    series, errors = scan_dicom_dir(tmp_path / "study")
    reasons = {e.bag_id: e.reason for e in errors}
    assert not series and set(reasons) == {axial_uid, coronal_uid, dose_uid}
    assert f"of the study of the original series {axial_uid} (refused: see its entry): one series" in reasons[coronal_uid]
    assert "is a screen capture (ImageType SCREEN SAVE: a dose page, a saved view), not a slice" in reasons[dose_uid]
    for path in axial:  # the study's only original series gone: the derived series is its scan (TCIA exports)
        path.unlink(missing_ok=True)
    assert [s.series_uid for s in scan_dicom_dir(tmp_path / "study")[0]] == [coronal_uid]

    anonymised = tmp_path / "anonymised"
    anonymised.mkdir()
    for key in ("a", "b", "c"):  # three patients, flat, StudyInstanceUID removed by de-identification
        for path in write_ct_series(tmp_path / "src" / key, np.zeros((3, 16, 16)), series_key=key)[2]:
            ds = pydicom.dcmread(path)
            del ds.StudyInstanceUID
            ds.save_as(anonymised / path.name)
    series, errors = scan_dicom_dir(anonymised)
    assert len(series) == 3 and not errors and not studies_of_several_bags(series)


def test_a_study_uid_an_export_gave_every_patient_is_no_study_of_several_bags(tmp_path):
    """Five patients (their own PatientIDs) exported with one fixed StudyInstanceUID are five scans."""
    first = None
    for k in range(5):
        _, _, paths = write_ct_series(tmp_path / f"P{k}", np.zeros((3, 16, 16)), series_key=f"p{k}")
        first = first or paths
        for path in paths:
            ds = pydicom.dcmread(path)
            ds.StudyInstanceUID = pydicom.dcmread(first[0]).StudyInstanceUID
            ds.save_as(path)
    series, errors = scan_dicom_dir(tmp_path)
    assert len(series) == 5 and not errors and not studies_of_several_bags(series)


def _restack(root: Path, key: str, positions: np.ndarray, thickness: np.ndarray) -> Path:
    """A series whose slices lie at ``positions`` (mm along the normal), each of its ``thickness``
    (None: no SliceThickness)."""
    _, _, paths = write_ct_series(root / key, np.zeros((positions.size, 16, 16)), series_key=key)
    for path, z, mm in zip(paths, positions, thickness):
        ds = pydicom.dcmread(path)
        ds.ImagePositionPatient, ds.SliceThickness = [-125.0, -125.0, float(z)], mm
        if mm is None:
            del ds.SliceThickness
        ds.save_as(path)
    return root / key


@pytest.mark.parametrize("thin, thin_mm, thick, thick_mm", [(8, 2.5, 14, 5.0), (12, 2.5, 10, 5.0), (10, 3.0, 9, 7.0)])
def test_a_head_protocol_of_thin_then_thick_slices_is_one_scan_whichever_part_is_longer(tmp_path, thin, thin_mm, thick,
                                                                                     thick_mm):
    """Thin slices through the posterior fossa, thicker ones through the cerebrum: kept when the thick
    part had most of the steps, refused as "a series of two spacings" when the thin part had. With
    one SliceThickness throughout, longer steps that are most of them are still slices missing."""
    z = np.concatenate([np.arange(thin) * thin_mm, (thin - 1) * thin_mm + np.arange(1, thick + 1) * thick_mm])
    protocol = np.r_[np.full(thin, thin_mm), np.full(thick, thick_mm)]
    series, errors = scan_dicom_dir(_restack(tmp_path, "protocol", z, protocol))
    assert not errors and len(series[0].files) == thin + thick
    missing = np.delete(z, thin + thick // 2)  # a slice missing inside the thick run: still refused
    series, errors = scan_dicom_dir(_restack(tmp_path, "missing", missing, np.delete(protocol, thin + thick // 2)))
    assert not series and len(errors) == 1, [e.reason for e in errors]
    unreadable = protocol.astype(object)
    unreadable[1] = None  # one slice without SliceThickness: the others decide
    series, errors = scan_dicom_dir(_restack(tmp_path, "one without", z, unreadable))
    assert not errors and len(series[0].files) == thin + thick
    if thin - 1 > thick:  # one SliceThickness: every other slice lost where the median step is the thin one (refused before)
        series, errors = scan_dicom_dir(_restack(tmp_path, "lost", z, np.full(z.size, thin_mm)))
        assert not series and "slices missing at regular intervals" in errors[0].reason


def test_a_series_exported_in_parts_is_sourced_from_their_folder_and_labels_naming_the_series_are_explained(tmp_path):
    """A series in SE0001/part1 and SE0001/part2 was one bag whose source was part1 (the report's
    strip found half its slices and was dropped unsaid); rows ID_<SeriesInstanceUID>_any skipped
    the scan as "slices have no label … and none is positive"."""
    from tasks.ingest.ct import plan_ct

    uid, sops, paths = write_ct_series(tmp_path / "dicom" / "SE0001", np.zeros((6, 16, 16)), series_key="parts")
    for k, path in enumerate(paths):
        (tmp_path / "dicom" / "SE0001" / f"part{1 + k % 2}").mkdir(exist_ok=True)
        path.rename(tmp_path / "dicom" / "SE0001" / f"part{1 + k % 2}" / path.name)
    (tmp_path / "labels.csv").write_text(f"ID,Label\nID_{uid}_any,1\n")
    plan = plan_ct(tmp_path / "a.zarr", tmp_path / "dicom", keep_unlabelled=True)
    (item,) = plan.items
    assert item.source == str(tmp_path / "dicom" / "SE0001")
    assert [s.sop_uids for s in scan_dicom_dir(item.source)[0]] == [tuple(sops)]
    (skip,) = plan_ct(tmp_path / "b.zarr", tmp_path / "dicom", labels_csv=tmp_path / "labels.csv").skipped
    assert f"(its rows name the scan's SeriesInstanceUID {uid}: ingest.kind ct reads slice labels" in skip.reason


def test_the_report_finds_a_series_whole_when_its_slices_sit_in_another_patients_folder(tmp_path):
    """Two of P00's slices misfiled in P01's folder: P00's source is the cohort folder, and reading
    P01's folder after it replaced P00's series with its two slices there (the strip showed half)."""
    import logging

    from tasks.prefect_tasks import _ct_series_by_uid

    p00, sops, paths = write_ct_series(tmp_path / "P00", np.zeros((4, 16, 16)), series_key="p00")
    p01, _, _ = write_ct_series(tmp_path / "P01", np.zeros((4, 16, 16)), series_key="p01")
    for path in paths[2:]:
        path.rename(tmp_path / "P01" / path.name)
    from tasks.ingest.ct import plan_ct

    sources = {item.bag_id: item.source for item in plan_ct(tmp_path / "a.zarr", tmp_path, keep_unlabelled=True).items}
    assert sources == {p00: str(tmp_path), p01: str(tmp_path / "P01")}
    found = _ct_series_by_uid(sources.values(), logging.getLogger("test"))
    assert found[p00].sop_uids == tuple(sops) and len(found[p01].files) == 4


def test_the_several_bags_warning_names_a_few_series_of_a_study_of_thousands():
    """An anonymiser that gave 20,000 series one study UID and PatientID made one warning line of
    869,153 characters."""
    from tasks.ingest.ct import CTSeries, several_bags_warning

    series = [CTSeries(f"1.2.{k}", (f"/d/{k}/a.dcm",), (f"1.3.{k}",), "ANON.STUDY", "ANONYMOUS") for k in range(20_000)]
    warning = several_bags_warning(studies_of_several_bags(series))
    assert "1.2.0 (1 slice in /d/0), 1.2.1 (1 slice in /d/1), 1.2.2 (1 slice in /d/2) and 19997 more series" in warning
    assert len(warning) < 600


def test_a_cohort_to_predict_killed_before_its_first_commit_resumes_with_its_training_stores_extractor(tmp_path, monkeypatch):
    """``predict --source`` of scans takes the training store's extractor (``extractor_from``) while
    the new store holds no bag: the rerun of a run killed before its first commit planned the default
    extractor instead, and its store was refused (or made again with features the model cannot use)."""
    import logging

    import tasks.prefect_tasks as prefect_tasks
    from flows.config import PipelineConfig
    from tasks.ingest.ct import plan_ct
    from tasks.ingest.driver import run_ingest
    from tests.test_ingest_wsi import Crash, crash_on

    make_ct_cohort(tmp_path / "train", 2, n_slices=4, size=32, seed=1)
    make_ct_cohort(tmp_path / "new", 2, n_slices=4, size=32, seed=2)
    trained = HandcraftedCT(work_size=32)  # not the default: the new cohort must be featurised as this
    ingest_ct(tmp_path / "train.zarr", tmp_path / "train", labels_csv=tmp_path / "train" / "labels.csv", extractor=trained)
    new = tmp_path / "new.zarr"
    plan = plan_ct(new, tmp_path / "new", extractor=trained, keep_unlabelled=True)
    with pytest.raises(Crash):
        run_ingest(new, plan.spec, plan.items, crash_on(plan.items[1].bag_id, plan.bag_writer), commit_every=16)
    assert open_cohort(new).n_bags == 0 and len(list((new / "staging").glob("*/zarr.json"))) == 2
    config = PipelineConfig.model_validate({"name": "new", "store": str(new), "output_dir": str(tmp_path / "out"),
                                            "ingest": {"kind": "ct", "source": str(tmp_path / "new"), "unlabelled": "keep",
                                                       "extractor_from": str(tmp_path / "train.zarr")}})
    monkeypatch.setattr(prefect_tasks, "get_run_logger", lambda: logging.getLogger("test"))
    work = prefect_tasks.list_inputs.fn(config)
    assert not work.run.created and len(work.run.to_run) == 1  # the staged scan is kept, the half-written one staged again
    assert open_cohort(new).attrs["feature_extractor"] == open_cohort(tmp_path / "train.zarr").attrs["feature_extractor"]
