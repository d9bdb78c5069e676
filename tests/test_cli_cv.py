"""``gpmil cv TABLE``: bag cross-validation of the default models on a MIL CSV table (label, bag id,
features…), the pipeline's default model first; a missing table is refused with its path."""

from __future__ import annotations

import numpy as np

from flows.cli import main
from flows.config import ModelConfig


def test_cv_scores_the_pipeline_default_first_on_a_real_table(tmp_path, capsys):
    rng = np.random.default_rng(0)
    bags = np.repeat(np.arange(20), 5)
    labels = np.repeat(np.arange(20) % 2, 5)
    X = rng.normal(size=(100, 3))
    X[:, 0] += 3.0 * labels * (rng.random(100) < 0.4)  # witnesses in the positive bags
    table = tmp_path / "mil.csv"
    np.savetxt(table, np.column_stack([labels, bags, X]), delimiter=",")

    assert main(["cv", str(table), "--inducing", "6"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if "bag AUC" in line]
    scored = [line.split()[0] for line in lines]
    assert scored[0] == ModelConfig().name and sorted(scored) == ["GVGPMIL", "VGPMIL", "VGPMILPR"], scored
    assert all(float(line.split("bag AUC ")[1].split()[0]) > 0.5 for line in lines), lines


def test_cv_refuses_a_missing_table_naming_it(tmp_path, capsys):
    assert main(["cv", str(tmp_path / "absent.csv")]) == 2
    assert "absent.csv not found" in capsys.readouterr().err
