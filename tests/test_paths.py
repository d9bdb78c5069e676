"""Bag ids never become paths: every file named after a bag goes through :func:`tasks.paths.safe_filename`."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from tasks.paths import HASH_CHARS, bag_file, safe_filename

HOSTILE_IDS = [
    "../../escape",
    "/tmp/absolute-bag",
    "..\\..\\windows\\escape",
    "C:\\Users\\x",
    "bag\x00nul",
    "x" * 300,
    "切片-ü-🧠",
    "..",
    ".",
    "",
    ".hidden",
    "bad\udcffname",  # a non-UTF-8 file name as os.fsdecode gives it
]


@pytest.mark.parametrize("bag_id", HOSTILE_IDS, ids=lambda s: repr(s)[:24])
def test_a_hostile_bag_id_becomes_one_plain_file_inside_the_folder(tmp_path, bag_id):
    name = safe_filename(bag_id, ".png")
    assert os.sep not in name and "/" not in name and "\\" not in name and "\x00" not in name
    assert not name.startswith(".") and name.isascii() and len(name.encode()) <= 80
    path = bag_file(tmp_path / "heatmaps", bag_id, ".png")
    path.parent.mkdir()
    path.write_bytes(b"png")
    assert path.resolve().parent == (tmp_path / "heatmaps").resolve()
    assert [p.name for p in tmp_path.rglob("*") if p.is_file()] == [name]
    assert safe_filename(bag_id, ".png") == name  # deterministic: reruns overwrite, never duplicate


def test_ids_that_slug_alike_get_different_names_and_the_slug_stays_readable():
    alike = ["a/b", "a_b", "a\\b", "a b", "a\x00b", "a:b", "A_B"]
    names = {safe_filename(b) for b in alike}
    assert len(names) == len(alike)
    assert safe_filename("slide_0042") == f"slide_0042-{safe_filename('slide_0042')[-HASH_CHARS:]}"
    assert safe_filename("1.2.840.113619.2.55") .startswith("1.2.840.113619.2.55-")
    long_a, long_b = "p" * 300 + "a", "p" * 300 + "b"
    assert safe_filename(long_a) != safe_filename(long_b)


def test_a_suffix_that_is_not_an_extension_is_refused():
    with pytest.raises(ValueError, match="suffix"):
        safe_filename("bag", "/../x.png")


def test_the_wsi_qc_thumbnail_of_a_hostile_bag_id_stays_in_the_qc_folder(tmp_path):
    from tasks.ingest.driver import IngestItem
    from tasks.ingest.synthetic import TISSUE, write_slide
    from tasks.ingest.wsi import TilingParams, slide_bag_writer

    label_map = np.full((4, 4), TISSUE, dtype=np.uint8)
    slide = write_slide(tmp_path / "s.tiff", label_map, seed=0, tile=64)

    class Sink:
        def write(self, features, coords, labels):
            self.n = len(coords)

    qc = tmp_path / "work" / "qc"
    item = IngestItem("../../escaped", str(slide), 0, None)
    slide_bag_writer(item, Sink(), params=TilingParams(tile_size=64, level=0, min_tissue=0.1),
                     extractor=lambda tiles: tiles.reshape(len(tiles), -1)[:, :4].astype(np.float32), qc_dir=str(qc))
    assert [p.name for p in qc.iterdir()] == [safe_filename("../../escaped", ".png")]
    assert not list(tmp_path.glob("escaped*")) and not (tmp_path / "escaped.png").exists()


@pytest.mark.timeout(600)
@pytest.mark.usefixtures("prefect_server")
def test_the_pipeline_report_names_heatmaps_safely_and_keeps_the_ids_in_its_tables(tmp_path):
    import pandas as pd
    import yaml

    from flows.pipeline import pipeline
    from tasks.store import BagData, CohortSpec, append_bags, create_cohort
    from tests.conftest import make_toy_bags

    ids = ["../../escaped", str(tmp_path / "absolute"), "..\\back", "nul\x00id", "u" * 300, "切片-ü"]
    X, bags, y, _ = make_toy_bags(n_bags=12, seed=3)
    store = tmp_path / "hostile.zarr"
    create_cohort(store, CohortSpec(name="hostile", n_features=X.shape[1], coords_dim=2, coords_meaning="tile row, col"))
    records = []
    for b in np.unique(bags):
        rows = np.flatnonzero(bags == b)
        coords = np.stack([np.arange(rows.size) // 3, np.arange(rows.size) % 3], axis=1)
        bag_id = ids[b] if b < len(ids) else f"bag{b}"
        records.append(BagData(bag_id=bag_id, label=int(y[rows[0]]), source="memory", features=X[rows], coords=coords,
                               instance_labels=np.full(rows.size, -1)))
    append_bags(store, records)
    out = tmp_path / "work" / "out"
    config = {"name": "hostile", "store": str(store), "output_dir": str(out),
              "model": {"name": "VGPMIL", "params": {"n_inducing": 8, "max_iter": 4, "random_state": 0}},
              "dask": {"n_workers": 1, "processes": False}, "prediction": {"n_heatmaps": 12}}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(config))
    before = {p for p in tmp_path.rglob("*") if "work" not in p.relative_to(tmp_path).parts[:1] and "hostile.zarr" not in str(p)}
    result = pipeline(str(tmp_path / "c.yaml"))
    heatmaps = Path(result["report"].path).parent / "heatmaps"
    assert sorted(p.name for p in heatmaps.iterdir()) == sorted(safe_filename(b, ".png") for b in ids + [f"bag{b}" for b in range(6, 12)])
    after = {p for p in tmp_path.rglob("*") if "work" not in p.relative_to(tmp_path).parts[:1] and "hostile.zarr" not in str(p)}
    assert after == before and not Path("/work/escaped.png").exists()
    table = pd.read_parquet(Path(result["report"].path).parent / "bag_predictions.parquet")
    assert set(ids) <= set(table["bag_id"])
