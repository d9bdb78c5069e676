"""Handcrafted H&E features: blocks checked against scikit-image and direct definitions; spec round trip."""

from __future__ import annotations

import numpy as np
import pytest
from skimage.color import rgb2hed
from skimage.feature import graycomatrix, graycoprops

from tasks.ingest.features import (
    HandcraftedHE,
    extractor_from_spec,
    extractor_spec,
    glcm_properties,
    lbp_histograms,
    needs_fit,
)


def test_glcm_properties_equal_scikit_image_averaged_over_four_directions():
    gray = np.random.default_rng(0).random((3, 24, 24))
    ours = glcm_properties(gray, levels=8, distances=(1,))
    for b in range(3):
        quantised = np.clip((gray[b] * 8).astype(np.uint8), 0, 7)
        matrix = graycomatrix(quantised, [1], [0, np.pi / 4, np.pi / 2, 3 * np.pi / 4], levels=8,
                              symmetric=True, normed=True)
        reference = [graycoprops(matrix, p).mean()
                     for p in ("contrast", "dissimilarity", "homogeneity", "energy", "correlation")]
        np.testing.assert_allclose(ours[b, :5], reference, rtol=1e-5)


def test_lbp_histogram_matches_the_per_pixel_definition():
    gray = np.random.default_rng(1).integers(0, 4, size=(1, 9, 9)).astype(float)  # ties included
    ring = ((-1, -1), (-1, 0), (-1, 1), (0, 1), (1, 1), (1, 0), (1, -1), (0, -1))
    codes = []
    for y in range(1, 8):
        for x in range(1, 8):
            bits = [int(gray[0, y + dy, x + dx] >= gray[0, y, x]) for dy, dx in ring]
            transitions = sum(bits[k] != bits[k - 1] for k in range(8))
            codes.append(sum(bits) if transitions <= 2 else 9)
    np.testing.assert_allclose(lbp_histograms(gray)[0], np.bincount(codes, minlength=10) / 49)


def test_he_features_need_the_hog_pca_and_rebuild_from_the_recorded_spec():
    rng = np.random.default_rng(2)
    tiles = rng.integers(0, 256, size=(40, 32, 32, 3), dtype=np.uint8).repeat(2, axis=1).repeat(2, axis=2)
    unfitted = HandcraftedHE(work_size=32, hog_components=8)
    assert needs_fit(unfitted)
    with pytest.raises(RuntimeError, match="fit"):
        unfitted(tiles)
    fitted = unfitted.fit(tiles)
    features = fitted(tiles[:5])
    assert features.shape == (5, fitted.n_features) == (5, sum(w for _, w in fitted.blocks()))
    assert features.dtype == np.float32 and np.isfinite(features).all()
    rebuilt = extractor_from_spec(extractor_spec(fitted), source="a store")
    np.testing.assert_array_equal(rebuilt(tiles[:5]), features)
    hed = rgb2hed(tiles[:5] / 255.0).clip(0).reshape(5, -1, 3)  # tiles are 2x2 blocks: downscaling is exact
    np.testing.assert_allclose(features[:, :3], hed.mean(1), rtol=1e-4)
    np.testing.assert_allclose(features[:, 3:6], hed.std(1), rtol=1e-4)
    np.testing.assert_allclose(features[:, 15:39].reshape(5, 3, 8).sum(2), 1.0, rtol=1e-6)  # RGB histograms


def test_a_hog_pca_fitted_on_few_tiles_keeps_the_dimension_with_zero_trailing_components():
    tiles = np.random.default_rng(3).integers(0, 256, size=(4, 32, 32, 3), dtype=np.uint8)
    fitted = HandcraftedHE(work_size=32, hog_components=8).fit(tiles)
    features = fitted(tiles)
    assert features.shape[1] == 61 + 8
    np.testing.assert_array_equal(features[:, 61 + 3:], 0.0)  # 4 tiles span 3 components
