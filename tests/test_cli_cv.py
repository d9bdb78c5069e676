"""``gpmil cv TABLE``: bag cross-validation of the default models on a MIL CSV table (label, bag id,
features…; bag ids numbers or text), the pipeline's default model first; a missing table is refused
with its path, a bad one with the file and the row, bag or field at fault, before any fit."""

from __future__ import annotations

import numpy as np
import pytest

from flows.cli import main
from flows.config import ModelConfig


def _rows(n_bags: int = 20, size: int = 5) -> list[list[str]]:
    """A MIL table's cells: label, a text bag id, three features; witnesses in the positive bags."""
    rng = np.random.default_rng(0)
    labels = np.repeat(np.arange(n_bags) % 2, size)
    X = rng.normal(size=(labels.size, 3))
    X[:, 0] += 3.0 * labels * (rng.random(labels.size) < 0.4)
    ids = np.repeat([f"slide-{b:02d}" for b in range(n_bags)], size)
    return [[str(label), bag, *map(str, x)] for label, bag, x in zip(labels, ids, X)]


def _write(path, rows) -> str:
    path.write_text("".join(",".join(row) + "\n" for row in rows))
    return str(path)


def test_cv_scores_the_pipeline_default_first_on_a_table_with_text_bag_ids(tmp_path, capsys):
    assert main(["cv", _write(tmp_path / "mil.csv", _rows()), "--inducing", "6"]) == 0
    out = capsys.readouterr().out
    assert "100 instances, 20 bags, 3 features" in out
    lines = [line for line in out.splitlines() if "bag AUC" in line]
    scored = [line.split()[0] for line in lines]
    assert scored[0] == ModelConfig().name and sorted(scored) == ["GVGPMIL", "VGPMIL", "VGPMILPR"], scored
    assert all(float(line.split("bag AUC ")[1].split()[0]) > 0.5 for line in lines), lines


def test_cv_refuses_a_missing_table_naming_it(tmp_path, capsys):
    assert main(["cv", str(tmp_path / "absent.csv")]) == 2
    assert "absent.csv not found" in capsys.readouterr().err


def _cell(row: int, column: int, value: str):
    def corrupt(rows):
        rows[row][column] = value
        return rows
    return corrupt


BAD_TABLES = {  # the file's lines, 1-based (a blank line counts: row 12 of 'a NaN feature after a blank line' is line 14)
    "a cell that is not a number": (_cell(7, 3, "abc"), "line 8, column 4: 'abc' is not a number"),
    "a header line": (lambda rows: [["label", "bag", "f1", "f2", "f3"], *rows], "line 1 (label, bag, f1, f2, …) looks like a header"),
    "a NaN feature": (_cell(12, 4, "nan"), "line 13 (bag 'slide-02') has empty, NaN or infinite features"),
    "a NaN feature after a blank line": (lambda rows: [*rows[:5], [], *_cell(12, 4, "nan")(rows)[5:]],
                                         "line 14 (bag 'slide-02') has empty, NaN or infinite features"),
    "a short row": (lambda rows: [*rows[:3], rows[3][:-1], *rows[4:]], "line 4 (bag 'slide-00') has empty, NaN or infinite features"),
    "labels that differ within a bag": (_cell(1, 0, "1"), "bag 'slide-00' has instances with different bag labels"),
    "a label that is not 0/1": (lambda rows: [["2" if r[0] == "1" else "0", *r[1:]] for r in rows],
                                "line 6 (bag 'slide-01') has bag label 2:"),
    "an empty label": (_cell(9, 0, ""), "line 10 (bag 'slide-01') has no bag label (an empty cell)"),
    "labels -1 beside 0": (lambda rows: [["-1" if i >= 90 else r[0], *r[1:]] for i, r in enumerate(rows)],
                           "bag labels mix -1 (line 91, bag 'slide-18') and 0 (line 1, bag 'slide-00')"),
    "one class": (lambda rows: [["0", *r[1:]] for r in rows], "need bags of both classes"),
    "too few bags of a class": (lambda rows: rows[:40] + [r for r in rows[40:] if r[0] == "0"],
                                "5-fold CV needs at least 5 bags of each class; the table has 10 negative and 4 positive bags"),
    "no feature columns": (lambda rows: [r[:2] for r in rows], "at least one feature column"),
    "one column": (lambda rows: [r[:1] for r in rows], "a MIL CSV is bag label, bag id, features"),
    "an empty bag id": (_cell(4, 1, ""), "no bag id at line(s) [5]"),
    "an empty file": (lambda rows: [], "cannot read CSV"),
}


def test_cv_reads_true_false_labels_and_blank_lines_as_the_ingest_does(tmp_path):
    from flows.cli import _mil_table

    rows = [["True" if r[0] == "1" else "False", *r[1:]] for r in _rows()]
    path = tmp_path / "bools.csv"
    path.write_text("\n" + "".join(",".join(row) + "\n" + ("   \n" if i == 10 else "") for i, row in enumerate(rows)))
    X, bags, y = _mil_table(path, 5)
    assert X.shape == (100, 3) and np.unique(bags).size == 20 and np.asarray(y, dtype=float).sum() == 50


@pytest.mark.parametrize("problem", sorted(BAD_TABLES))
def test_cv_refuses_a_bad_table_naming_the_file_and_what_is_wrong(tmp_path, capsys, problem):
    corrupt, message = BAD_TABLES[problem]
    table = _write(tmp_path / "bad.csv", corrupt(_rows()))
    assert main(["cv", table]) == 2
    captured = capsys.readouterr()
    assert "bad.csv" in captured.err, captured.err
    assert message in captured.err, captured.err
    assert "bag AUC" not in captured.out  # refused before any fit
