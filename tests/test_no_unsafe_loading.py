"""Nothing in the product deserialises in a way that can run code (a static check of every module,
so a new loader cannot slip in): no pickle-family imports, no ``torch.load`` without
``weights_only=True``, no ``np.load`` whose ``allow_pickle`` is anything but ``False``, no
``pd.read_pickle``, no YAML loader but the safe ones, no ``eval``/``exec``; the names also when
imported bare (``from numpy import load``)."""

from __future__ import annotations

import ast
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
PRODUCT = [p for folder in ("mil_core", "tasks", "flows", "benchmarks", "infra") for p in sorted((ROOT / folder).rglob("*.py"))]
PICKLE_FAMILY = {"pickle", "cPickle", "_pickle", "dill", "joblib", "cloudpickle", "shelve", "marshal", "jsonpickle"}


SAFE_YAML_LOADERS = {"SafeLoader", "CSafeLoader", "BaseLoader", "CBaseLoader"}


def unsafe_calls(source: str) -> list[str]:
    """``line: what`` for every unsafe import or call in ``source``."""
    found = []
    tree = ast.parse(source)
    # names imported bare from the loaders' modules: ``from numpy import load`` → ``load`` is np.load
    bare = {a.asname or a.name: f"{ {'numpy': 'np', 'pandas': 'pd'}.get(n.module, n.module)}.{a.name}"
            for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module in ("numpy", "pandas", "torch", "yaml")
            for a in n.names}
    # a loader class of this module counts as safe when it derives from safe loaders only
    safe_loaders = SAFE_YAML_LOADERS | {
        n.name for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.bases
        and all((b.attr if isinstance(b, ast.Attribute) else getattr(b, "id", None)) in SAFE_YAML_LOADERS for b in n.bases)}
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            found += [f"{node.lineno}: imports {n}" for n in names if n.split(".")[0] in PICKLE_FAMILY]
        elif isinstance(node, ast.Call):
            keywords = {k.arg: k.value for k in node.keywords}

            def constant(name: str, value: object, keywords: dict = keywords) -> bool:
                return isinstance(keywords.get(name), ast.Constant) and keywords[name].value is value

            if isinstance(node.func, ast.Attribute):
                owner = node.func.value.id if isinstance(node.func.value, ast.Name) else ""
                call = f"{ {'numpy': 'np', 'pandas': 'pd'}.get(owner, owner)}.{node.func.attr}"
            elif isinstance(node.func, ast.Name):
                call = bare.get(node.func.id, node.func.id)
            else:
                continue
            loader = keywords.get("Loader")
            loader_name = loader.attr if isinstance(loader, ast.Attribute) else loader.id if isinstance(loader, ast.Name) else None
            if call in ("eval", "exec"):
                found.append(f"{node.lineno}: {call}()")
            elif call == "torch.load" and not constant("weights_only", True):
                found.append(f"{node.lineno}: torch.load without weights_only=True")
            elif call == "np.load" and "allow_pickle" in keywords and not constant("allow_pickle", False):
                found.append(f"{node.lineno}: np.load(allow_pickle=True)")
            elif call in ("pd.read_pickle", "yaml.unsafe_load", "yaml.full_load"):
                found.append(f"{node.lineno}: {call}")
            elif call == "yaml.load" and loader_name not in safe_loaders:
                found.append(f"{node.lineno}: yaml.load without a safe Loader")
            elif call in ("zarr.open_group", "zarr.open", "zarr.open_array") and not (
                    isinstance(keywords.get("zarr_format"), ast.Constant) and keywords["zarr_format"].value == 3
                    or _tiff_pages(node)):
                found.append(f"{node.lineno}: {call} without zarr_format=3")
    return found


def _tiff_pages(call: ast.Call) -> bool:
    """``zarr.open(series.aszarr(…))``: a TIFF's pages through tifffile's store, whose metadata
    tifffile writes from the file's tags (no codec a file can name)."""
    first = call.args[0] if call.args else None
    return isinstance(first, ast.Call) and isinstance(first.func, ast.Attribute) and first.func.attr == "aszarr"


@pytest.mark.parametrize("path", PRODUCT, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_module_deserialises_unsafely(path):
    assert unsafe_calls(path.read_text()) == []


def test_the_check_finds_what_it_looks_for():
    source = ("import pickle\nfrom joblib import load\nimport torch, numpy as np, yaml, pandas as pd\n"
              "torch.load('w.pt')\ntorch.load('w.pt', weights_only=True)\nnp.load('a.npy', allow_pickle=True)\n"
              "np.load('a.npy')\npd.read_pickle('t.pkl')\nyaml.load(s)\nyaml.safe_load(s)\n"
              "zarr.open_group(p, mode='r')\nzarr.open_group(p, mode='r', zarr_format=3)\nzarr.open(p, zarr_format=2)\n"
              "zarr.open(series.aszarr(level=0), mode='r')\n")
    assert [f.split(": ")[1] for f in unsafe_calls(source)] == [
        "imports pickle", "imports joblib", "torch.load without weights_only=True", "np.load(allow_pickle=True)",
        "pd.read_pickle", "yaml.load without a safe Loader", "zarr.open_group without zarr_format=3",
        "zarr.open without zarr_format=3"]


def test_the_check_sees_through_aliases_loaders_and_non_constant_flags():
    source = ("from numpy import load as npload\nfrom yaml import load\nimport numpy, yaml\n"
              "npload('a.npy', allow_pickle=flag)\nnumpy.load('a.npy', allow_pickle=False)\n"
              "load(s, Loader=yaml.Loader)\nyaml.load(s, Loader=yaml.SafeLoader)\nyaml.load(s, Loader=yaml.UnsafeLoader)\n"
              "eval(text)\nexec(code)\ntorch.load('w.pt', weights_only=False)\n"
              "class Mine(yaml.SafeLoader): pass\nclass Yours(yaml.Loader): pass\n"
              "yaml.load(s, Loader=Mine)\nyaml.load(s, Loader=Yours)\n")
    assert [f.split(": ")[1] for f in unsafe_calls(source)] == [
        "np.load(allow_pickle=True)", "yaml.load without a safe Loader", "yaml.load without a safe Loader", "eval()", "exec()",
        "torch.load without weights_only=True", "yaml.load without a safe Loader"]


class _Payload:
    """Unpickling this creates the file ``self.marker``: proof that code from the store ran."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


@pytest.mark.parametrize("codec", ["numcodecs.pickle", "pickle"])
def test_a_store_whose_array_claims_a_pickle_codec_is_refused_without_running_it(tmp_path, codec):
    """A shared cohort store edited to pickle its features (Zarr v3 naming numcodecs' pickle codec)
    must fail to read, not unpickle: the guard is Zarr's codec registry, checked here on a real store."""
    import json
    import pickle

    from tasks.store import open_cohort
    from tests.conftest import make_toy_bags
    from tests.test_distributed import write_store

    X, bags, y, _ = make_toy_bags(6)
    store = Path(write_store(tmp_path / "shared.zarr", X, bags, y))
    features = store / "instances" / "features"
    meta = json.loads((features / "zarr.json").read_text())
    meta["codecs"] = [{"name": codec, "configuration": {}}]
    (features / "zarr.json").write_text(json.dumps(meta))
    marker = tmp_path / "code-ran"
    for chunk in (p for p in (features / "c").rglob("*") if p.is_file()):
        chunk.write_bytes(pickle.dumps(_Payload(str(marker))))
    with pytest.raises(Exception, match="codec"):
        open_cohort(store).read_bags(0, 6)
    assert not marker.exists()


def test_a_store_rewritten_as_zarr_v2_with_a_pickled_array_is_refused_without_running_it(tmp_path):
    """Zarr 3.0 with numcodecs < 0.15.2 opened a v2 layout (``.zgroup``/``.zarray``) whose object
    array names the pickle filter, and reading it unpickled the chunk; the product opens stores as
    v3 only (``zarr_format=3``, checked above) and the dependency floors exclude those releases."""
    import json
    import pickle

    from tasks.store import committed_bag_ids

    store = tmp_path / "shared.zarr"
    array = store / "bags" / "id"
    array.mkdir(parents=True)
    for group in (store, store / "bags"):
        (group / ".zgroup").write_text(json.dumps({"zarr_format": 2}))
    (array / ".zarray").write_text(json.dumps({
        "zarr_format": 2, "shape": [1], "chunks": [1], "dtype": "|O", "compressor": None, "fill_value": 0,
        "order": "C", "filters": [{"id": "pickle", "protocol": 5}], "dimension_separator": "."}))
    marker = tmp_path / "code-ran"
    (array / "0").write_bytes(pickle.dumps(np.array([_Payload(str(marker))], dtype=object)))
    with pytest.raises(Exception, match="[Nn]o group found"):
        committed_bag_ids(store)
    assert not marker.exists()


def _store_naming(path: Path, spec: dict) -> Path:
    """A cohort store's root whose recorded ``feature_extractor`` is ``spec`` (what anyone who can
    write the shared store can set)."""
    from tasks.store import BagData, CohortSpec, append_bags, create_cohort

    create_cohort(path, CohortSpec(name="shared", n_features=3, coords_dim=1, coords_meaning="slice_index",
                                   feature_extractor=spec))
    append_bags(path, [BagData("b0", 0, "memory", np.zeros((2, 3), np.float32), np.zeros((2, 1), np.int32),
                               np.full(2, -1, np.int8))])  # a cohort's bag: its extractor is the one an ingest resumes with
    return path


def _runs_touch(marker: Path) -> list[dict]:
    """Recorded extractors that, rebuilt, would create ``marker``: a factory import path, and the
    torch extractor's ``model`` import path."""
    return [{"name": "he-handcrafted", "version": "1", "factory": "subprocess:run", "params": {"args": ["touch", str(marker)]}},
            {"name": "torch", "version": "1", "factory": "torch", "n_features": 3,
             "params": {"model": "subprocess:run", "model_kwargs": {"args": ["touch", str(marker)]}, "n_features": 3}}]


@pytest.mark.parametrize("which", [0, 1], ids=["factory", "torch-model"])
def test_code_a_store_names_is_not_run_when_an_ingest_resumes_or_takes_its_extractor(tmp_path, which):
    """A store's zarr.json named ``subprocess:run`` as its extractor's factory: resuming an ingest into
    it, or taking a new cohort's extractor from it (``extractor_from``, the model folder's training
    store for ``predict --source``), imported and called it with the store's params."""
    from tasks.ingest.features import UntrustedExtractorError
    from tasks.ingest.wsi import plan_slides

    marker = tmp_path / "ran"
    spec = _runs_touch(marker)[which]
    store = _store_naming(tmp_path / "shared.zarr", spec)
    (tmp_path / "slides").mkdir()
    with pytest.raises(UntrustedExtractorError, match=rf"shared.zarr: its feature_extractor names 'subprocess:run'"):
        plan_slides(store, tmp_path / "slides")  # resuming: the store's own extractor
    with pytest.raises(UntrustedExtractorError, match="subprocess:run"):
        plan_slides(tmp_path / "new.zarr", tmp_path / "slides", extractor_from=store)
    if which == 0:  # the configured he-handcrafted needs fitting: the store's fitted one of that name is taken
        from tasks.ingest.features import HandcraftedHE

        with pytest.raises(UntrustedExtractorError, match="subprocess:run"):
            plan_slides(store, tmp_path / "slides", extractor=HandcraftedHE())
    assert not marker.exists()


def test_a_ct_cohort_to_predict_does_not_run_code_its_training_store_names(tmp_path):
    from flows.config import PipelineConfig
    from tasks.ingest.features import UntrustedExtractorError
    from tasks.prefect_tasks import list_inputs

    marker = tmp_path / "ran"
    store = _store_naming(tmp_path / "training.zarr", _runs_touch(marker)[0])
    (tmp_path / "dicom").mkdir()
    config = PipelineConfig.model_validate({"name": "ct", "store": str(tmp_path / "new.zarr"), "output_dir": str(tmp_path / "out"),
                                            "ingest": {"kind": "ct", "source": str(tmp_path / "dicom"), "extractor_from": str(store)}})
    with pytest.raises(UntrustedExtractorError, match="training.zarr: its feature_extractor names 'subprocess:run'"):
        list_inputs.fn(config)
    assert not marker.exists()
    trusted = config.model_copy(update={"ingest": config.ingest.model_copy(update={"trusted_imports": ["subprocess:run"]})})
    with pytest.raises(TypeError, match="lacks"):  # listed as trusted by the user's own config: built (and found no extractor)
        list_inputs.fn(trusted)
    assert marker.exists()
