"""The PyTorch extractor and extractor plug-ins, with a small CNN whose weights the test writes."""

from __future__ import annotations

import sys
import textwrap

import numpy as np
import pytest

from tasks.ingest.features import UntrustedExtractorError, extractor_from_spec, extractor_spec, make_extractor, resolve_extractor

torch = pytest.importorskip("torch")

TINY_CNN = """
import torch


class TinyCNN(torch.nn.Module):
    def __init__(self, width: int = 4):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, width, 3, padding=1)
        self.pool = torch.nn.AdaptiveAvgPool2d(1)

    def forward(self, x):
        return self.pool(torch.relu(self.conv(x))).flatten(1)


class TupleCNN(TinyCNN):
    def forward(self, x):
        return super().forward(x), x.mean()


class MapCNN(TinyCNN):
    def forward(self, x):
        return torch.relu(self.conv(x))


class ColourMeans:
    name, version, n_features = "colour-means", "1", 3

    def __init__(self, scale: float = 1.0):
        self.scale = scale

    def params(self):
        return {"scale": self.scale}

    def __call__(self, batch):
        return (batch[..., :3].mean(axis=(1, 2)) * self.scale).astype("float32")
"""


@pytest.fixture
def user_package(tmp_path, monkeypatch):
    """A user's own module on the path (as an installed package would be), and weights for it."""
    (tmp_path / "lab_models.py").write_text(textwrap.dedent(TINY_CNN))
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("lab_models", None)
    import lab_models

    torch.manual_seed(0)
    model = lab_models.TinyCNN(width=4)
    torch.save(model.state_dict(), tmp_path / "tiny.pt")
    from safetensors.torch import save_file

    save_file(model.state_dict(), str(tmp_path / "tiny.safetensors"))
    return tmp_path, model


def test_torch_extractor_matches_the_model_it_loads_and_records_its_weights(user_package):
    folder, model = user_package
    tiles = np.random.default_rng(0).integers(0, 256, size=(5, 32, 32, 3), dtype=np.uint8)
    extractor = make_extractor("torch", model="lab_models:TinyCNN", model_kwargs={"width": 4},
                               weights=str(folder / "tiny.pt"), batch_size=2, device="cpu")
    assert extractor.n_features == 4
    x = torch.from_numpy(tiles).permute(0, 3, 1, 2).float() / 255.0
    mean, std = torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1), torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1)
    with torch.no_grad():
        expected = model((x - mean) / std).numpy()
    np.testing.assert_allclose(extractor(tiles), expected, rtol=1e-5, atol=1e-6)  # batched 2 + 2 + 1
    from_safetensors = make_extractor("torch", model="lab_models:TinyCNN", model_kwargs={"width": 4},
                                      weights=str(folder / "tiny.safetensors"), device="cpu")
    np.testing.assert_allclose(from_safetensors(tiles), expected, rtol=1e-5, atol=1e-6)

    spec = extractor_spec(extractor)
    assert spec["factory"] == "torch" and len(spec["params"]["weights_sha256"]) == 64
    with pytest.raises(UntrustedExtractorError, match="'lab_models:TinyCNN' to import and run"):
        extractor_from_spec(spec, source="s.zarr")  # a store alone may not name code to run
    np.testing.assert_array_equal(extractor_from_spec(spec, source="s.zarr", trusted={"lab_models:TinyCNN"})(tiles),
                                  extractor(tiles))

    import pickle  # how Dask sends the extractor to a worker: its parameters only, rebuilt there

    travelled = pickle.loads(pickle.dumps(extractor))
    assert travelled._module is None and travelled.params() == extractor.params()

    torch.save({k: v + 1 for k, v in model.state_dict().items()}, folder / "tiny.pt")  # retrained weights
    with pytest.raises(ValueError, match="not the .* recorded with the store"):
        extractor_from_spec(spec, source="s.zarr", trusted={"lab_models:TinyCNN"})


def test_extractors_resolve_by_import_path_and_refuse_unknown_names(user_package):
    plug = make_extractor("lab_models:ColourMeans", scale=2.0)
    spec = extractor_spec(plug)
    assert spec["factory"] == "lab_models:ColourMeans" and spec["params"] == {"scale": 2.0}
    tiles = np.full((2, 8, 8, 3), 10, dtype=np.uint8)
    np.testing.assert_array_equal(extractor_from_spec(spec, source="s.zarr", trusted={"lab_models:ColourMeans"})(tiles),
                                  np.full((2, 3), 20.0))
    with pytest.raises(KeyError, match="no feature extractor registered as 'my-rp'.*package.module:Class"):
        resolve_extractor("my-rp")
    folder = user_package[0]  # an installed distribution declaring the entry point (its metadata on sys.path)
    (folder / "lab_models-1.0.dist-info").mkdir()
    (folder / "lab_models-1.0.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: lab-models\nVersion: 1.0\n")
    (folder / "lab_models-1.0.dist-info" / "entry_points.txt").write_text("[gpmil.extractors]\nmy-rp = lab_models:ColourMeans\n")
    assert make_extractor("my-rp", scale=3.0)(tiles)[0, 0] == 30.0
    from tasks.ingest.features import known_extractors

    assert "my-rp" in known_extractors()
    recorded = extractor_spec(make_extractor("my-rp", scale=3.0))  # what a store built by the entry point records:
    assert recorded["factory"] == "lab_models:ColourMeans"  # the class's path, which the entry point declares
    assert extractor_from_spec(recorded, source="s.zarr")(tiles)[0, 0] == 30.0  # installed code: no trust asked
    (folder / "lab_models-1.0.dist-info" / "entry_points.txt").write_text("[gpmil.extractors]\n")  # uninstalled
    with pytest.raises(UntrustedExtractorError, match="or ingest.trusted_imports"):
        extractor_from_spec(recorded, source="s.zarr")
    with pytest.raises(KeyError, match="cannot import it"):
        resolve_extractor("lab_models:Missing")
    with pytest.raises(TypeError, match="lacks"):
        make_extractor("lab_models:TinyCNN")  # a bare module is not an extractor: wrap it with 'torch'


def test_the_config_accepts_import_paths_and_names_the_field_for_unknown_ones(user_package):
    from flows.config import ConfigError, load_config

    folder, _ = user_package
    good = folder / "good.yaml"
    good.write_text(f"name: t\nstore: {folder}/s.zarr\noutput_dir: {folder}/out\ningest: {{kind: wsi, source: {folder}, extractor: 'lab_models:ColourMeans'}}\n")
    assert load_config(good).ingest.extractor == "lab_models:ColourMeans"
    (folder / "cfg").mkdir()
    relative = folder / "cfg" / "torch.yaml"  # weights beside the config, named relative to it like every other file
    relative.write_text("name: t\nstore: s.zarr\noutput_dir: out\ningest: {kind: wsi, source: ../, extractor: torch, "
                        "extractor_params: {model: 'lab_models:TinyCNN', weights: ../tiny.pt}}\n")
    assert load_config(relative).ingest.extractor_params["weights"] == str(folder / "tiny.pt")
    bad = folder / "bad.yaml"
    bad.write_text(f"name: t\nstore: {folder}/s.zarr\noutput_dir: {folder}/out\ningest: {{kind: wsi, source: {folder}, extractor: my-rp}}\n")
    with pytest.raises(ConfigError, match="ingest.extractor.*my-rp"):
        load_config(bad)


def test_random_weights_are_refused_and_a_wrapped_checkpoint_loads_under_its_module_names(user_package):
    """Without weights each process built a freshly initialised module (features differed between
    two runs with one recorded spec); strict: false with a checkpoint saved from a wrapper
    ('model.conv.weight') loaded nothing and recorded the file's SHA-256 all the same."""
    folder, model = user_package
    tiles = np.random.default_rng(1).integers(0, 256, size=(3, 32, 32, 3), dtype=np.uint8)
    with pytest.raises(ValueError, match=r"without weights starts from random numbers: two builds differ"):
        make_extractor("torch", model="lab_models:TinyCNN", model_kwargs={"width": 4}, device="cpu")
    reference = make_extractor("torch", model="lab_models:TinyCNN", model_kwargs={"width": 4},
                               weights=str(folder / "tiny.pt"), device="cpu")(tiles)
    for prefix in ("model.", "module.backbone."):
        torch.save({prefix + k: v for k, v in model.state_dict().items()}, folder / "wrapped.pt")
        for strict in (True, False):
            wrapped = make_extractor("torch", model="lab_models:TinyCNN", model_kwargs={"width": 4},
                                     weights=str(folder / "wrapped.pt"), device="cpu", strict=strict)
            np.testing.assert_array_equal(wrapped(tiles), reference)
    # strict: false with weights the file lacks: each process started them from other random numbers
    torch.save({k: v for k, v in model.state_dict().items() if not k.startswith(last := sorted(model.state_dict())[-1])},
               folder / "partial.pt")
    with pytest.raises(ValueError, match=rf"partial.pt leave 1 of lab_models:TinyCNN's parameters \({last}\) at a random start"):
        make_extractor("torch", model="lab_models:TinyCNN", model_kwargs={"width": 4}, weights=str(folder / "partial.pt"),
                       device="cpu", strict=False)
    torch.save({"head.weight": torch.zeros(2, 2)}, folder / "other.pt")
    with pytest.raises(ValueError, match=r"other.pt: none of its 1 tensor names is one of the module's"):
        make_extractor("torch", model="lab_models:TinyCNN", model_kwargs={"width": 4}, weights=str(folder / "other.pt"),
                       device="cpu", strict=False)


def test_checkpoints_as_training_code_saves_them_load_or_say_what_to_save(user_package):
    """DeiT/MAE save {'model': state dict, 'epoch': …}: refused as 'none of its 2 tensor names'; DINO
    {'teacher': …, 'student': …} the same; a whole pickled model got torch's advice to load it with
    weights_only=False, which would run its code."""
    folder, model = user_package
    tiles = np.random.default_rng(2).integers(0, 256, size=(2, 32, 32, 3), dtype=np.uint8)
    build = {"model": "lab_models:TinyCNN", "model_kwargs": {"width": 4}, "device": "cpu"}
    reference = make_extractor("torch", weights=str(folder / "tiny.pt"), **build)(tiles)
    torch.save({"model": model.state_dict(), "epoch": 3}, folder / "deit.pt")
    np.testing.assert_array_equal(make_extractor("torch", weights=str(folder / "deit.pt"), **build)(tiles), reference)
    torch.save({"teacher": model.state_dict(), "student": model.state_dict()}, folder / "dino.pt")
    with pytest.raises(ValueError, match=r"dino.pt hold no tensors at the top, but dictionaries under 'teacher', 'student'"):
        make_extractor("torch", weights=str(folder / "dino.pt"), **build)
    torch.save(model, folder / "whole.pt")
    with pytest.raises(ValueError, match=r"whole.pt hold pickled objects besides tensors .* never code. Save model.state_dict\(\)"):
        make_extractor("torch", weights=str(folder / "whole.pt"), **build)


def test_an_encoder_that_returns_a_tuple_or_a_feature_map_is_named(user_package):
    """A tuple failed with "'tuple' object has no attribute 'reshape'"; a feature map (N, C, H, W)
    was flattened into C·H·W features of positions without a word (with input_size given)."""
    folder, _ = user_package
    build = {"model_kwargs": {"width": 4}, "weights": str(folder / "tiny.pt"), "device": "cpu", "input_size": 16}
    with pytest.raises(TypeError, match=r"'lab_models:TupleCNN' returned a tuple, not one tensor of features per tile"):
        make_extractor("torch", model="lab_models:TupleCNN", **build)
    with pytest.raises(ValueError, match=r"'lab_models:MapCNN' returned a feature map of shape \(\d+, 4, 16, 16\): pool it"):
        make_extractor("torch", model="lab_models:MapCNN", **build)


def test_an_extractor_that_cannot_be_built_is_refused_before_the_run_starts(user_package):
    """A misspelt parameter, a missing module or weights of another shape failed inside the flow,
    after Prefect and the cluster started, with 50–75 lines of traceback."""
    from flows.checks import check_inputs
    from flows.config import ConfigError, load_config

    folder, _ = user_package
    torch.save({"conv.weight": torch.zeros(2, 3, 3, 3), "conv.bias": torch.zeros(2)}, folder / "narrow.pt")
    for params, message in [
        ("{model: 'lab_models:TinyCNN', weights: tiny.pt, widht: 4}", r"unexpected keyword argument 'widht'"),
        ("{model: 'lab_models:NoSuchNet', weights: tiny.pt}", r"NoSuchNet"),
        ("{model: 'lab_models:TinyCNN', weights: narrow.pt}", r"weights .*narrow.pt do not fit lab_models:TinyCNN: .*size mismatch"),
        # with n_features given the module was built only on the workers: every slide's task failed
        ("{model: 'not_installed.models:Net', weights: tiny.pt, n_features: 8}", r"cannot import it \(ModuleNotFoundError"),
        ("{model: 'lab_models:TinyCNN', weights: narrow.pt, n_features: 4}", r"narrow.pt do not fit lab_models:TinyCNN"),
    ]:
        path = folder / "c.yaml"
        path.write_text(f"name: t\nstore: s.zarr\noutput_dir: out\ningest: {{kind: wsi, source: ., extractor: torch, "
                        f"extractor_params: {params}}}\n")
        with pytest.raises(ConfigError, match=rf"ingest.extractor_params: torch cannot be built: .*{message}"):
            load_config(path, preflight=lambda config: check_inputs(config, "ingest"))
