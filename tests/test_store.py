"""The Zarr cohort store: CSR round trips, bag-aligned partitions, crash safety, synthetic feature cohorts."""

from __future__ import annotations

import numpy as np
import pytest
import zarr

from tasks.ingest.errors import DuplicateIdError, FeatureDimensionError
from tasks.ingest.synthetic import make_feature_cohort
from tasks.store import (
    BagData,
    CohortSpec,
    Partition,
    StagingWriter,
    StoredBags,
    _open_root,
    append_bags,
    create_cohort,
    open_cohort,
    repair,
    write_cohort_from_arrays,
)


def random_bags(rng: np.random.Generator, n_bags: int, n_features: int = 5, prefix: str = "bag") -> list[BagData]:
    bags = []
    for b in range(n_bags):
        n = int(rng.integers(1, 9))
        bags.append(BagData(bag_id=f"{prefix}{b}", label=int(rng.integers(-1, 2)), source=f"/data/{prefix}{b}",
                            features=rng.normal(size=(n, n_features)).astype(np.float32),
                            coords=rng.integers(0, 100, size=(n, 2)), instance_labels=rng.integers(-1, 2, size=n)))
    return bags


@pytest.fixture
def spec() -> CohortSpec:
    return CohortSpec(name="toy", n_features=5, coords_dim=2, coords_meaning="tile_row,tile_col", chunk_rows=8)


def test_appended_bags_read_back_exactly_in_csr_layout(tmp_path, spec):
    bags = random_bags(np.random.default_rng(0), 12)
    create_cohort(tmp_path / "c.zarr", spec)
    append_bags(tmp_path / "c.zarr", bags[:5])
    append_bags(tmp_path / "c.zarr", bags[5:])
    cohort = open_cohort(tmp_path / "c.zarr")

    assert (cohort.n_bags, cohort.n_features) == (12, 5)
    assert cohort.n_instances == sum(b.n_instances for b in bags)
    assert cohort.offsets.dtype == np.int64 and cohort.bag_labels.dtype == np.int8
    assert cohort.bag_ids.dtype == object and list(cohort.bag_ids) == [b.bag_id for b in bags]
    assert list(cohort.bag_labels) == [b.label for b in bags]
    assert cohort.attrs["cohort_name"] == "toy" and cohort.attrs["schema_version"] == 1
    block = cohort.read_bags(3, 9)
    assert isinstance(block, StoredBags)
    assert block.offsets[0] == 0 and len(block.offsets) == 7
    for local, bag in enumerate(bags[3:9]):
        rows = slice(block.offsets[local], block.offsets[local + 1])
        np.testing.assert_array_equal(block.features[rows], bag.features)
        np.testing.assert_array_equal(block.coords[rows], bag.coords)
        np.testing.assert_array_equal(block.instance_labels[rows], bag.instance_labels)
        assert cohort.bag_slice(3 + local) == slice(cohort.offsets[3 + local], cohort.offsets[4 + local])
    assert list(block.bag_ids) == [b.bag_id for b in bags[3:9]] and (block.bag_start, block.bag_stop) == (3, 9)


@pytest.mark.parametrize("target_bytes", [1, 200, 1000, 10**9])
def test_partitions_are_bag_aligned_cover_the_cohort_and_hold_about_the_target(tmp_path, spec, target_bytes):
    bags = random_bags(np.random.default_rng(1), 40)
    create_cohort(tmp_path / "c.zarr", spec)
    append_bags(tmp_path / "c.zarr", bags)
    cohort = open_cohort(tmp_path / "c.zarr")
    parts = cohort.partitions(target_bytes)

    assert all(isinstance(p, Partition) for p in parts)
    assert [p.index for p in parts] == list(range(len(parts)))
    assert parts[0].bag_start == 0 and parts[-1].bag_stop == cohort.n_bags
    assert all(a.bag_stop == b.bag_start for a, b in zip(parts, parts[1:]))
    assert all(p.row_start == cohort.offsets[p.bag_start] and p.row_stop == cohort.offsets[p.bag_stop] for p in parts)
    target_rows = max(1, target_bytes // cohort.bytes_per_instance)
    largest_bag = int(np.diff(cohort.offsets).max())
    assert all(p.n_rows < target_rows + largest_bag for p in parts)
    block = cohort.read_partition(parts[-1])
    np.testing.assert_array_equal(block.features, np.concatenate([b.features for b in bags[parts[-1].bag_start:]]))


def test_write_cohort_from_arrays_groups_interleaved_bags_chunk_by_chunk(tmp_path):
    rng = np.random.default_rng(2)
    n = 1000
    bag_of_row = rng.integers(0, 37, size=n)  # interleaved rows
    bag_label = rng.integers(0, 2, size=37)
    X = np.lib.format.open_memmap(tmp_path / "X.npy", mode="w+", dtype=np.float64, shape=(n, 3))
    X[:] = rng.normal(size=(n, 3))
    inst = rng.integers(-1, 2, size=n)
    cohort = write_cohort_from_arrays(tmp_path / "a.zarr", X, np.char.add("b", bag_of_row.astype(str)),
                                      bag_label[bag_of_row], instance_labels=inst, chunk_rows=64)

    first_seen = list(dict.fromkeys(bag_of_row))
    assert list(cohort.bag_ids) == [f"b{b}" for b in first_seen]
    assert list(cohort.bag_labels) == [bag_label[b] for b in first_seen]
    block = cohort.read_bags(0, cohort.n_bags)
    for local, b in enumerate(first_seen):
        rows = np.flatnonzero(bag_of_row == b)
        stored = slice(block.offsets[local], block.offsets[local + 1])
        np.testing.assert_allclose(block.features[stored], X[rows], rtol=1e-6)
        np.testing.assert_array_equal(block.instance_labels[stored], inst[rows])
        np.testing.assert_array_equal(block.coords[stored, 0], np.arange(len(rows)))


def test_write_cohort_from_arrays_rejects_labels_that_differ_within_a_bag(tmp_path):
    with pytest.raises(ValueError, match="differs within a bag"):
        write_cohort_from_arrays(tmp_path / "a.zarr", np.zeros((3, 2)), np.array(["a", "a", "b"]), np.array([0, 1, 1]))


def test_duplicate_ids_and_wrong_dimensions_commit_nothing(tmp_path, spec):
    rng = np.random.default_rng(3)
    create_cohort(tmp_path / "c.zarr", spec)
    append_bags(tmp_path / "c.zarr", random_bags(rng, 3))
    with pytest.raises(DuplicateIdError, match="bag0"):
        append_bags(tmp_path / "c.zarr", random_bags(rng, 3, prefix="new") + random_bags(rng, 2))
    wide = random_bags(rng, 1, n_features=6, prefix="wide")
    with pytest.raises(FeatureDimensionError, match="/data/wide0"):
        append_bags(tmp_path / "c.zarr", random_bags(rng, 2, prefix="ok") + wide)
    cohort = open_cohort(tmp_path / "c.zarr")
    assert list(cohort.bag_ids) == ["bag0", "bag1", "bag2"]
    assert repair(tmp_path / "c.zarr") > 0  # the rejected calls left rows behind, now dropped
    assert _open_root(tmp_path / "c.zarr", "r")["instances/features"].shape[0] == cohort.n_instances


class Crash(BaseException):
    """Stands for a killed process (not an Exception: nothing catches it)."""


def test_an_interrupted_append_leaves_no_visible_bag_and_the_next_append_repairs(tmp_path, spec):
    rng = np.random.default_rng(4)
    bags = random_bags(rng, 20)
    create_cohort(tmp_path / "c.zarr", spec)
    append_bags(tmp_path / "c.zarr", bags[:4])

    def crashing():
        yield from bags[4:15]
        raise Crash

    with pytest.raises(Crash):
        append_bags(tmp_path / "c.zarr", crashing())
    assert open_cohort(tmp_path / "c.zarr").n_bags == 4
    assert _open_root(tmp_path / "c.zarr", "r")["instances/features"].shape[0] > open_cohort(tmp_path / "c.zarr").n_instances

    # A crash after the bag arrays but before `done`: bags with done == False are not visible.
    root = _open_root(tmp_path / "c.zarr", "r+")
    for name in ("id", "label", "source", "done"):
        root[f"bags/{name}"].resize((6,))
    assert open_cohort(tmp_path / "c.zarr").n_bags == 4

    append_bags(tmp_path / "c.zarr", bags[4:])
    cohort = open_cohort(tmp_path / "c.zarr")
    assert list(cohort.bag_ids) == [b.bag_id for b in bags]
    np.testing.assert_array_equal(cohort.read_bags(0, 20).features, np.concatenate([b.features for b in bags]))


def test_staging_writer_rejects_a_feature_dimension_that_does_not_match_the_store(tmp_path, spec):
    create_cohort(tmp_path / "c.zarr", spec)
    writer = StagingWriter(tmp_path / "c.zarr", "slide-7", 1, "/slides/7.tiff")
    writer.write(np.zeros((3, 5)), np.zeros((3, 2)), np.zeros(3))
    with pytest.raises(FeatureDimensionError, match="/slides/7.tiff"):
        writer.write(np.zeros((3, 4)), np.zeros((3, 2)), np.zeros(3))


def test_open_cohort_on_a_missing_path_says_so(tmp_path):
    with pytest.raises(FileNotFoundError, match="no cohort store"):
        open_cohort(tmp_path / "absent.zarr")


def test_synthetic_feature_cohort_has_witnesses_exactly_in_positive_bags(tmp_path):
    cohort = make_feature_cohort(tmp_path / "f.zarr", n_bags=300, mean_bag_size=12, n_features=8,
                                 witness_rate=0.2, seed=5, bags_per_batch=64)
    block = cohort.read_bags(0, cohort.n_bags)
    witnesses_per_bag = np.add.reduceat(block.instance_labels.astype(int), block.offsets[:-1])
    assert cohort.n_bags == 300 and abs(cohort.n_instances / 300 - 12) < 1.5
    assert np.all((witnesses_per_bag > 0) == (cohort.bag_labels == 1))
    positive_rows = np.repeat(cohort.bag_labels == 1, np.diff(block.offsets))
    assert abs(block.instance_labels[positive_rows].mean() - 0.2) < 0.05
    # Witnesses are shifted by `separation` along one direction: their mean lies ~3 from the others'.
    shift = block.features[block.instance_labels == 1].mean(0) - block.features[block.instance_labels == 0].mean(0)
    assert abs(np.linalg.norm(shift) - 3.0) < 0.5
    again = make_feature_cohort(tmp_path / "g.zarr", 300, 12, 8, 0.2, 5, bags_per_batch=64)
    np.testing.assert_array_equal(again.read_bags(0, 300).features, block.features)


@pytest.mark.parametrize("keeps", [True, False], ids=["store-keeps-ids", "store-keeps-none"])
def test_the_direct_append_and_the_staging_writer_check_instance_ids_alike(tmp_path, spec, keeps):
    """One check, one message for both ways into the store: a store that keeps instance ids needs one
    per row, a store that keeps none takes none; nothing of the refused bag is written."""
    import dataclasses

    path = tmp_path / "ids.zarr"
    create_cohort(path, dataclasses.replace(spec, instance_ids="SOPInstanceUID" if keeps else None))
    bag = random_bags(np.random.default_rng(0), 1)[0]
    wrong = None if keeps else np.array([f"uid{i}" for i in range(bag.n_instances)])
    message = r"the store keeps instance ids \(SOPInstanceUID\), one per instance" if keeps else "the store keeps no instance ids"
    with pytest.raises(FeatureDimensionError, match=message) as direct:
        append_bags(path, [dataclasses.replace(bag, instance_ids=wrong)])
    writer = StagingWriter(path, bag.bag_id, bag.label, bag.source)
    with pytest.raises(FeatureDimensionError, match=message) as staged:
        writer.write(bag.features, bag.coords, bag.instance_labels, instance_ids=wrong)
    assert str(direct.value) == str(staged.value)
    if keeps:  # and one id short
        with pytest.raises(FeatureDimensionError, match=rf"instance ids of shape \({bag.n_instances - 1},\) for {bag.n_instances}"):
            append_bags(path, [dataclasses.replace(bag, instance_ids=np.array(["u"] * (bag.n_instances - 1)))])
    assert open_cohort(path).n_bags == 0


def test_a_store_with_other_settings_names_the_setting_that_differs(tmp_path, spec):
    """Changed tiling: the field and both values, not two whole dicts; another kind of cohort: say
    that a store holds one kind."""
    import dataclasses

    from tasks.ingest.errors import StoreMismatchError
    from tasks.store import open_or_create_cohort

    tiled = dataclasses.replace(spec, tiling={"tile_size": 128, "level": 0, "min_tissue": 0.5})
    open_or_create_cohort(tmp_path / "s.zarr", tiled)
    with pytest.raises(StoreMismatchError, match=r"^tiling.tile_size: store 128, this ingest 64; ingest into a new store"):
        open_or_create_cohort(tmp_path / "s.zarr", dataclasses.replace(spec, tiling={**tiled.tiling, "tile_size": 64}))
    with pytest.raises(StoreMismatchError, match=r"store has coords_dim=2, this ingest has 1; a store holds one kind of cohort"):
        open_or_create_cohort(tmp_path / "s.zarr", dataclasses.replace(tiled, coords_dim=1))


def test_a_store_is_renamed_into_place_whole_and_a_half_created_one_is_made_again(tmp_path, spec, monkeypatch):
    """A run killed while creating a store left zarr.json without attributes; every later run then
    failed with 'store schema version None'. The store is now built aside and renamed into place;
    one left half-created by an earlier version is created again; a folder of other files is refused."""
    import tasks.store as store_module
    from tasks.ingest.errors import StoreMismatchError
    from tasks.store import open_or_create_cohort

    def killed(root, spec):
        root.create_group("instances")
        raise KeyboardInterrupt  # the run dies half-way through building the store

    monkeypatch.setattr(store_module, "_build_empty_cohort", killed)
    with pytest.raises(KeyboardInterrupt):
        open_or_create_cohort(tmp_path / "c.zarr", spec)
    assert not (tmp_path / "c.zarr").exists()
    monkeypatch.undo()
    root = open_or_create_cohort(tmp_path / "c.zarr", spec)
    assert root.attrs["schema_version"] == store_module.SCHEMA_VERSION and not list(tmp_path.glob(".c.zarr.creating-*"))

    (tmp_path / "old.zarr").mkdir()  # what a kill left before: a root group without attributes or arrays
    zarr.open_group(zarr.storage.LocalStore(str(tmp_path / "old.zarr")), mode="w")
    assert open_or_create_cohort(tmp_path / "old.zarr", spec).attrs["n_features"] == spec.n_features

    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    with pytest.raises(StoreMismatchError, match="the folder exists and is not a cohort store"):
        open_or_create_cohort(tmp_path / "mine", spec)
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"


def test_only_a_store_without_a_bag_is_made_again_for_other_settings_and_nothing_else_is_removed(tmp_path, monkeypatch):
    """``open_or_start_afresh`` (an ingest killed before its first commit, rerun corrected): another
    extractor or width makes an empty store again, through a link too; a store with a bag, a folder
    that is no store and a staged bag whose input cannot be read now (not: is gone) are kept."""
    import os

    from tasks.ingest.errors import StoreMismatchError
    from tasks.store import drop_staged_of_gone_inputs, open_or_start_afresh

    old = CohortSpec(name="c", n_features=4, coords_dim=1, coords_meaning="given", feature_extractor={"name": "a", "version": "1"})
    wider = CohortSpec(name="c", n_features=8, coords_dim=1, coords_meaning="given", feature_extractor={"name": "b", "version": "1"})
    create_cohort(tmp_path / "real.zarr", old)
    os.symlink(tmp_path / "real.zarr", tmp_path / "link.zarr")
    root, created = open_or_start_afresh(tmp_path / "link.zarr", wider)
    assert created and root.attrs["n_features"] == 8 and (tmp_path / "link.zarr").is_symlink()
    append_bags(tmp_path / "link.zarr", [BagData("b", 0, "memory", np.zeros((2, 8), np.float32), np.zeros((2, 1), np.int32),
                                                 np.full(2, -1, np.int8))])
    with pytest.raises(FeatureDimensionError):  # a cohort: refused as before
        open_or_start_afresh(tmp_path / "link.zarr", old)
    assert open_cohort(tmp_path / "link.zarr").n_bags == 1
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    with pytest.raises(StoreMismatchError, match="the folder exists and is not a cohort store"):
        open_or_start_afresh(tmp_path / "mine", old)
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"

    from tasks.ingest.driver import run_ingest

    (tmp_path / "empty").mkdir()  # a first run through a link to an empty folder, which commits nothing
    os.symlink(tmp_path / "empty", tmp_path / "empty-link.zarr")
    run_ingest(tmp_path / "empty-link.zarr", old, [], bag_writer=None)
    assert (tmp_path / "empty-link.zarr").is_symlink() and not (tmp_path / "empty").exists()  # removed again, the link kept
    create_cohort(tmp_path / "empty-link.zarr", old)
    assert open_cohort(tmp_path / "empty-link.zarr").n_bags == 0 and (tmp_path / "empty" / "zarr.json").is_file()

    root = zarr.open_group(str(tmp_path / "real.zarr"), mode="r+")
    for bag_id, source in (("gone", tmp_path / "gone.tiff"), ("locked", tmp_path / "locked" / "s.tiff")):
        root["staging"].create_group(bag_id).update_attributes({"bag_id": bag_id, "source": str(source)})
    real_stat = os.stat

    def stat(path, *args, **kwargs):  # a folder this user may not enter (running as root, chmod would not stop it)
        if "locked" in str(path):
            raise PermissionError(13, "Permission denied", str(path))
        return real_stat(path, *args, **kwargs)

    monkeypatch.setattr(os, "stat", stat)
    assert drop_staged_of_gone_inputs(root, keep=()) == ["gone"] and list(root["staging"].group_keys()) == ["locked"]


def test_the_kmeans_sample_reads_the_chunks_its_small_bags_share_once_and_returns_each_chosen_bag(tmp_path, monkeypatch):
    """A sample of small bags read each run of consecutive chosen bags on its own: the chunk that
    ten of them share was read ten times (21 of 33 s before the fit on 10,000 bags of 100 rows)."""
    from tasks.store import Cohort
    from tasks.training.preprocess import read_bags

    rng = np.random.default_rng(0)
    sizes = rng.integers(1, 7, size=60)
    path = tmp_path / "s.zarr"
    create_cohort(path, CohortSpec(name="s", n_features=3, coords_dim=2, coords_meaning="index", chunk_rows=16))
    features = [rng.normal(size=(n, 3)).astype(np.float32) for n in sizes]
    append_bags(path, [BagData(bag_id=f"b{b:03d}", label=b % 2, source="memory", features=features[b],
                               coords=np.arange(2 * n).reshape(n, 2), instance_labels=np.full(n, -1))
                       for b, n in enumerate(sizes)])
    cohort = open_cohort(path)
    chosen = np.sort(rng.choice(60, size=25, replace=False))
    reads = []
    real = Cohort.read_bags
    monkeypatch.setattr(Cohort, "read_bags", lambda self, start, stop: reads.append((start, stop)) or real(self, start, stop))
    X, y, offsets, coords = read_bags(cohort, np.arange(60) % 2, chosen, None, with_coords=True)
    np.testing.assert_array_equal(X, np.concatenate([features[b] for b in chosen]))
    np.testing.assert_array_equal(offsets, np.concatenate([[0], np.cumsum(sizes[chosen])]))
    np.testing.assert_array_equal(y, np.repeat(chosen % 2, sizes[chosen]))
    np.testing.assert_array_equal(coords, np.concatenate([np.arange(2 * sizes[b]).reshape(-1, 2) for b in chosen]))
    runs = np.flatnonzero(np.diff(chosen) != 1).size + 1
    assert len(reads) < runs / 2, (len(reads), runs)
