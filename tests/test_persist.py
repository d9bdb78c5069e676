"""No deserialisation that can run code: estimators and fit states round-trip through arrays + JSON
(:mod:`mil_core.persist`), and a crafted pickle where a model or a checkpoint lives is refused."""

from __future__ import annotations

import dataclasses
import io
import os
import pickle
import zipfile

import numpy as np
import pytest
from sklearn.base import clone

import mil_core
from mil_core import persist
from mil_core.persist import UnsafeFileError
from tests.conftest import make_toy_bags


class _CreatesAFile:
    """Unpickling this runs ``open(path, "w")``: the proof that a loader executed a payload."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def crafted_pickle(marker) -> bytes:
    return pickle.dumps(_CreatesAFile(str(marker)))


def _coords(n: int) -> np.ndarray:
    return np.stack([np.arange(n) % 3, np.arange(n) // 3], axis=1)


ESTIMATORS = {
    "VGPMIL": lambda: mil_core.VGPMIL(n_inducing=6, max_iter=3, random_state=0),
    "VGPMIL-learnt": lambda: mil_core.VGPMIL(n_inducing=6, max_iter=3, learn_kernel=True, early_stopping=True, random_state=0,
                                             kernel=mil_core.RBF(length_scale=(1.0, 2.0))),
    "VGPMIL-ard": lambda: mil_core.VGPMIL(n_inducing=6, max_iter=3, learn_kernel=True, random_state=0,
                                          kernel=mil_core.RBF(4.0, "ard")),
    "VGPMIL-bias": lambda: mil_core.VGPMIL(n_inducing=6, max_iter=3, kernel=mil_core.RBF(2.0, bias=2.0), random_state=0),
    "GVGPMIL": lambda: mil_core.GVGPMIL(n_inducing=6, max_iter=3, learn_psi=True, random_state=0),
    "PsiVGPMIL": lambda: mil_core.PsiVGPMIL(mil_core.GammaMixture(), n_inducing=6, max_iter=3, random_state=0),
    "VGPMILPR": lambda: mil_core.VGPMILPR(n_inducing=6, max_iter=3, random_state=0),
    "VGPMILPRI": lambda: mil_core.VGPMILPRI(n_inducing=6, max_iter=3, learn_lam=True, random_state=0),
    "VGPMILPRGibbs": lambda: mil_core.VGPMILPRGibbs(n_inducing=6, n_samples=40, burn_in=10, thin=1, random_state=0),
    "VWSGP": lambda: mil_core.VWSGP(n_inducing=6, max_iter=3, random_state=0),
    "AbSMIL": lambda: mil_core.AbSMIL(max_iter=3, random_state=0),
    "AbSMIL-rff": lambda: mil_core.AbSMIL(max_iter=3, n_random_features=8, random_state=0),
    "ABMIL": lambda: mil_core.ABMIL(n_components=4, hidden=(8,), attention_dim=4, max_epochs=2, random_state=0),
    "EmbeddedGPMIL": lambda: mil_core.EmbeddedGPMIL(mil_core.VGPMIL(n_inducing=6, max_iter=3), n_components=4, hidden=(8,),
                                                    attention_dim=4, max_epochs=2, random_state=0),
}
NEEDS_TORCH = {"ABMIL", "EmbeddedGPMIL"}  # to train; their saved network is plain arrays


def _predictions(model, X, bags, coords) -> list[np.ndarray]:
    if isinstance(model, mil_core.AbSMIL):  # a point estimate: no std
        return [*model.predict_bag_proba(X, bags), model.predict_instance_proba(X, bags)]
    if isinstance(model, mil_core.ABMIL):  # the network alone: no std
        return [*model.predict_bag_proba(X, bags), model.predict_instance_proba(X), model.predict_attention(X, bags)]
    if isinstance(model, mil_core.EmbeddedGPMIL):
        return [*model.predict_bag_proba(X, bags, return_std=True), *model.predict_instance_proba(X, return_std=True)]
    kw = {"coords": coords} if coords is not None else {}
    return [*model.predict_bag_proba(X, bags, return_std=True, **kw), *model.predict_latent(X)]


@pytest.mark.parametrize("name", list(ESTIMATORS))
def test_every_estimator_round_trips_with_equal_predictions(tmp_path, name):
    if name in NEEDS_TORCH:
        pytest.importorskip("torch", reason='training the network needs the extra "torch"')
    X, bags, y, _ = make_toy_bags(n_bags=16, seed=2)
    coords = _coords(len(X)) if name in ("VGPMILPRI", "VGPMILPRGibbs") else None
    model = ESTIMATORS[name]().fit(X, bags, y, **({"coords": coords} if coords is not None else {}))
    path = persist.save(model, tmp_path / "model.npz")
    loaded = persist.load(path)
    assert type(loaded) is type(model) and loaded.get_params(deep=False).keys() == model.get_params(deep=False).keys()
    assert repr(clone(loaded)) == repr(clone(model))
    # VGPMIL-PR-I's coupled bag probabilities come from scipy's randomised orthant CDF, which
    # scatters by ~1e-6 between two calls on the same object; everything else must be identical.
    atol = 1e-5 if name == "VGPMILPRI" else 0.0
    for a, b in zip(_predictions(model, X, bags, coords), _predictions(loaded, X, bags, coords), strict=True):
        np.testing.assert_allclose(np.asarray(a, dtype=float), np.asarray(b, dtype=float), rtol=0, atol=atol)
    assert zipfile.is_zipfile(path)
    with np.load(path, allow_pickle=False) as archive:  # every member loads without pickle
        assert all(archive[k].dtype != object for k in archive.files)


def test_every_allowed_estimator_class_has_a_round_trip_case():
    estimators = {name for name, cls in persist.allowed_types().items() if hasattr(cls, "get_params")} - {"TrainedModel"}
    covered = {type(make()).__name__ for make in ESTIMATORS.values()}
    assert estimators <= covered, f"add a round-trip case to ESTIMATORS for {sorted(estimators - covered)}"


def test_nested_estimators_dict_of_arrays_and_nonfinite_numbers_round_trip():
    inner = mil_core.VGPMIL(n_inducing=4, max_iter=2, random_state=0)
    X, bags, y, _ = make_toy_bags(n_bags=8, seed=1)
    inner.fit(X, bags, y)
    outer = mil_core.VGPMIL(n_inducing=4)
    outer.network_ = {"attention.weight": np.arange(6.0).reshape(2, 3), "bias": np.float32(0.5)}
    outer.gp_estimator_ = inner
    outer.history_ = [(1, float("nan")), {"inf": float("-inf"), 3: np.int64(7)}]
    loaded = persist.loads(persist.dumps(outer))
    np.testing.assert_array_equal(loaded.network_["attention.weight"], outer.network_["attention.weight"])
    assert loaded.network_["bias"].dtype == np.float32 and loaded.network_["bias"] == 0.5
    np.testing.assert_array_equal(loaded.gp_estimator_.predict_bag_proba(X, bags), inner.predict_bag_proba(X, bags))
    assert loaded.history_[0][0] == 1 and np.isnan(loaded.history_[0][1])
    assert loaded.history_[1] == {"inf": float("-inf"), 3: 7} and type(loaded.history_[1][3]) is np.int64


def test_a_transient_cache_field_is_not_saved():
    from mil_core.models.ising_hyper import LamLocal

    local = LamLocal(warm=np.ones(3), bags="a prepared block")
    loaded = persist.loads(persist.dumps(local))
    np.testing.assert_array_equal(loaded.warm, local.warm)
    assert loaded.bags is None


def test_what_the_format_cannot_store_is_refused_when_saving_naming_the_attribute():
    model = mil_core.PsiVGPMIL(psi=lambda z: z, n_inducing=4)
    with pytest.raises(TypeError, match=r"PsiVGPMIL\.psi: a builtins\.function is not a type this format stores"):
        persist.dumps(model)
    with pytest.raises(TypeError, match="Python objects"):
        persist.dumps({"x": np.array([object()])})

    @dataclasses.dataclass
    class NotAllowed:
        x: int = 1

    with pytest.raises(TypeError, match="NotAllowed"):
        persist.dumps([NotAllowed()])


def test_a_saved_file_is_written_whole_with_the_umasks_mode_and_replaces_a_planted_link(tmp_path):
    """Models are read from shared folders by other accounts (a served prediction): the file gets
    0o666 less the umask, as any new file (a temporary file's 0o600 made every model its writer's
    alone); a link planted at the name is replaced, not written through; a failed write leaves the
    earlier file and no staged one."""
    from mil_core.persist import write_whole

    umask = os.umask(0o027)
    try:
        path = persist.save(mil_core.VGPMIL(), tmp_path / "shared" / "model.npz")
    finally:
        os.umask(umask)
    assert path.stat().st_mode & 0o777 == 0o640
    victim = tmp_path / "victim.txt"
    victim.write_text("keep")
    (tmp_path / "shared" / "model.json").symlink_to(victim)
    write_whole(tmp_path / "shared" / "model.json", b"{}")
    assert victim.read_text() == "keep" and not (tmp_path / "shared" / "model.json").is_symlink()
    with pytest.raises(TypeError):
        write_whole(path, "not bytes")
    assert persist.load(path).get_params() == mil_core.VGPMIL().get_params()
    assert sorted(p.name for p in (tmp_path / "shared").iterdir()) == ["model.json", "model.npz"]


def test_a_crafted_pickle_in_place_of_a_model_is_refused_and_never_run(tmp_path):
    marker = tmp_path / "pwned"
    path = tmp_path / "model.npz"
    path.write_bytes(crafted_pickle(marker))
    with pytest.raises(UnsafeFileError, match="a pickle.*never loaded"):
        persist.load(path)
    assert not marker.exists()


def test_an_archive_smuggling_a_pickled_object_array_or_an_unknown_type_is_refused(tmp_path):
    marker = tmp_path / "pwned"
    payload = np.array([_CreatesAFile(str(marker))], dtype=object)
    good = persist.dumps(mil_core.RBF(variance=2.0))
    buffer = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(good)) as src, zipfile.ZipFile(buffer, "w") as dst:
        for item in src.infolist():
            dst.writestr(item, src.read(item))
        member = io.BytesIO()
        np.save(member, payload, allow_pickle=True)
        dst.writestr("a0.npy", member.getvalue())
    with pytest.raises(UnsafeFileError, match="not a readable"):
        persist.loads(buffer.getvalue())
    assert not marker.exists()

    meta = b'{"format": "gpmil-arrays+json", "version": 1, "root": {"$estimator": "Popen", "params": {"args": "touch x"}, "state": {}}}'
    forged = io.BytesIO()
    np.savez(forged, __gpmil__=np.frombuffer(meta, dtype=np.uint8))
    with pytest.raises(UnsafeFileError, match="'Popen', which is not in the allowlist"):
        persist.loads(forged.getvalue())
    wrong_param = meta.replace(b'"Popen", "params": {"args": "touch x"}', b'"RBF", "params": {"shell": "touch x"}')
    wrong_param = wrong_param.replace(b'"$estimator"', b'"$dataclass"').replace(b'"params"', b'"fields"').replace(b', "state": {}', b"")
    forged = io.BytesIO()
    np.savez(forged, __gpmil__=np.frombuffer(wrong_param, dtype=np.uint8))
    with pytest.raises(UnsafeFileError, match="malformed .*TypeError"):
        persist.loads(forged.getvalue())
    newer = meta.replace(b'"version": 1', b'"version": 99')
    forged = io.BytesIO()
    np.savez(forged, __gpmil__=np.frombuffer(newer, dtype=np.uint8))
    with pytest.raises(UnsafeFileError, match="newer than this gpmil reads"):
        persist.loads(forged.getvalue())


def test_persist_itself_never_imports_pickle():
    import ast
    import inspect

    tree = ast.parse(inspect.getsource(persist))
    imported = {a.name for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom)) for a in n.names}
    assert not imported & {"pickle", "cloudpickle", "dill", "joblib", "marshal"}
    assert os.path.basename(persist.__file__) == "persist.py"


def test_load_model_refuses_a_crafted_model_file_and_an_old_model_pkl(tmp_path):
    from tasks.prefect_tasks import TrainedModel, load_model, save_model

    marker = tmp_path / "pwned"
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "model.pkl").write_bytes(crafted_pickle(marker))
    with pytest.raises(UnsafeFileError, match=r"model\.pkl: a pickled model from an older gpmil"):
        load_model(tmp_path / "old")
    (tmp_path / "new").mkdir()
    (tmp_path / "new" / "model.npz").write_bytes(crafted_pickle(marker))
    with pytest.raises(UnsafeFileError, match="a pickle"):
        load_model(tmp_path / "new")
    persist.save(mil_core.RBF(), tmp_path / "other" / "model.npz")
    with pytest.raises(UnsafeFileError, match="holds a RBF, not a trained model"):
        load_model(tmp_path / "other")
    assert not marker.exists()
    X, bags, y, _ = make_toy_bags(n_bags=8, seed=0)
    model = mil_core.VGPMIL(n_inducing=4, max_iter=2, random_state=0).fit(X, bags, y)
    save_model(tmp_path / "ok", TrainedModel(model, None))
    np.testing.assert_array_equal(load_model(tmp_path / "ok").estimator.predict_bag_proba(X, bags)[1], model.predict_bag_proba(X, bags)[1])


@pytest.mark.timeout(300)
@pytest.mark.usefixtures("prefect_server")
def test_gpmil_predict_with_a_crafted_model_pickle_fails_without_running_it(tmp_path):
    import json

    import yaml

    from flows.pipeline import predict_cohort
    from tests.test_distributed import write_store

    X, bags, y, _ = make_toy_bags(n_bags=6, seed=0)
    store = write_store(tmp_path / "c.zarr", X, bags, y)
    model_dir = tmp_path / "shared-models" / "abc"
    model_dir.mkdir(parents=True)
    (model_dir / "model.json").write_text(json.dumps({"store": store}))
    marker = tmp_path / "pwned"
    (model_dir / "model.npz").write_bytes(crafted_pickle(marker))
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump({"name": "c", "store": store, "output_dir": str(tmp_path / "out"),
                                      "model": {"name": "VGPMIL", "params": {"n_inducing": 4}},
                                      "dask": {"n_workers": 1, "processes": False}}))
    with pytest.raises(UnsafeFileError, match="pickles are never loaded"):
        predict_cohort(str(config), str(model_dir))
    assert not marker.exists()


@pytest.mark.parametrize("member", ["model", "state", "local"])
def test_a_crafted_pickle_in_a_training_checkpoint_is_refused_and_never_run(tmp_path, member):
    import zarr
    from distributed import Client, LocalCluster

    from tasks.training import fit_cohort
    from tests.test_distributed import write_store

    X, bags, y, _ = make_toy_bags(n_bags=12, seed=0)
    store = write_store(tmp_path / "shared.zarr", X.astype(np.float32).astype(np.float64), bags, y)
    params = dict(n_inducing=5, max_iter=4, tol=0.0, random_state=0)

    class Stop(Exception):
        pass

    def stop_at_3(iteration, objective):
        if iteration == 3:
            raise Stop

    marker = tmp_path / "pwned"
    with LocalCluster(n_workers=1, threads_per_worker=1, processes=False, dashboard_address=":0") as cluster, Client(cluster) as client:
        with pytest.raises(Stop):
            fit_cohort(mil_core.VGPMIL(**params), store, client, run="r", partition_bytes=1_000, checkpoint_every=2,
                       on_iteration=stop_at_3)
        run = zarr.open_group(store, mode="a")["training/r"]
        target = {"model": (run, "model"), "state": (run["it2"], "state"), "local": (run["it2/local"], "0")}[member]
        target[0].create_array(target[1], data=np.frombuffer(crafted_pickle(marker), dtype=np.uint8), overwrite=True)
        with pytest.raises(UnsafeFileError, match=r"checkpoint .*shared\.zarr/training/r.*a pickle"):
            fit_cohort(mil_core.VGPMIL(**params), store, client, run="r", partition_bytes=1_000, checkpoint_every=2)
    assert not marker.exists()


def test_a_damaged_or_tampered_model_file_is_refused_as_such(tmp_path):
    """A truncated or corrupted archive, metadata that is no JSON object or nests beyond reason, a
    member that is no .npy, and fitted arrays of the wrong shape, type or value all raise
    UnsafeFileError naming the file; before, some raised BadZipFile / AttributeError / RecursionError,
    and a string q_.mean loaded and predicted other probabilities."""
    import dataclasses

    X, bags, y, _ = make_toy_bags(n_bags=12, seed=4)
    model = mil_core.VGPMIL(kernel=mil_core.RBF(4.0), max_iter=3, random_state=0).fit(X, bags, y)
    data = persist.dumps(model)

    def with_members(**members: bytes) -> bytes:
        buffer = io.BytesIO()
        with zipfile.ZipFile(io.BytesIO(data)) as src, zipfile.ZipFile(buffer, "w") as dst:
            for item in src.infolist():
                dst.writestr(item, members.pop(item.filename, None) or src.read(item))
            for name, payload in members.items():
                dst.writestr(name, payload)
        return buffer.getvalue()

    def meta(text: bytes) -> bytes:
        member = io.BytesIO()
        np.save(member, np.frombuffer(text, dtype=np.uint8))
        return member.getvalue()

    middle = len(data) // 2
    damaged = {
        "truncated": (data[:middle], "not a readable"),
        "corrupted": (data[:middle] + bytes([data[middle] ^ 0xFF]) + data[middle + 1:], "not a readable"),
        "metadata a list": (with_members(**{"__gpmil__.npy": meta(b"[1, 2]")}), "is a JSON list, not an object"),
        "metadata nested": (with_members(**{"__gpmil__.npy": meta(b"[" * 100_000 + b"]" * 100_000)}), "not a readable .*RecursionError"),
        "raw member": (with_members(junk=b"hello"), r"member\(s\) \['junk'\] are not .npy arrays"),
    }
    tampered = {
        "short q mean": lambda m: setattr(m, "q_", dataclasses.replace(m.q_, mean=m.q_.mean[:-1])),
        "text q mean": lambda m: setattr(m, "q_", dataclasses.replace(m.q_, mean=m.q_.mean.astype(str))),
        "zero scale": lambda m: m.feature_scale_.__setitem__(0, 0.0),
        "text width": lambda m: setattr(m, "n_features_in_", "3"),
    }
    messages = {"short q mean": r"q_.mean is float64 \(\d+,\), not floats of shape", "text q mean": r"q_.mean is <U\d+",
                "zero scale": "feature_scale_ holds a scale <= 0", "text width": "n_features_in_ is '3', not a positive integer"}
    for what, tamper in tampered.items():
        copy = persist.loads(data)
        tamper(copy)
        damaged[what] = (persist.dumps(copy), messages[what])
    for what, (payload, message) in damaged.items():
        path = tmp_path / f"{what.replace(' ', '-')}.npz"
        path.write_bytes(payload)
        with pytest.raises(UnsafeFileError, match=f"{path}: .*{message}"):
            persist.load(path)
    np.testing.assert_array_equal(persist.loads(data).predict_bag_proba(X, bags)[1], model.predict_bag_proba(X, bags)[1])
