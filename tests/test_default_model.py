"""The pipeline's default model is chosen by measurement (issue 15): ``ModelConfig``'s docstring
cites a "mean of N" column of a table in ``docs/BENCHMARKS.md``, "Accuracy of the defaults" (the
first table there with that column), with the table's numbers, and its default ``name`` is the GP-MIL default with the best
mean there. A re-measured table that changes the ranking, or a docstring left behind, fails here."""

from __future__ import annotations

import re
from pathlib import Path

import mil_core
from flows.config import ModelConfig

DOCS = Path(__file__).resolve().parents[1] / "docs" / "BENCHMARKS.md"
COLUMN = "mean of 7"


def summary_column(text: str, column: str = COLUMN) -> dict[str, float]:
    """``{estimator: value}`` of ``column`` in the first table of the "Accuracy of the defaults"
    section whose rows name a mil_core estimator as ```Name()```."""
    section = text.split("## Accuracy of the defaults", 1)[1]
    lines = [line for line in section.splitlines() if line.startswith("|")]
    header = next(i for i, line in enumerate(lines) if column in line)
    names = [c.strip() for c in lines[header].strip("|").split("|")]
    values = {}
    for line in lines[header + 2:]:
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) != len(names):
            break
        found = re.fullmatch(r"`(\w+)\(\)`", cells[0])
        if found and hasattr(mil_core, found[1]):
            values[found[1]] = float(cells[names.index(column)].split()[0].strip("*"))
    return values


def cited(docstring: str, names: set[str]) -> dict[str, float]:
    """``{estimator: value}`` for every "Name 0.123" in the docstring."""
    return {name: float(value) for name, value in re.findall(r"(?<![\w-])(\w+) (\d\.\d{3})\b", " ".join(docstring.split())) if name in names}


def test_the_default_model_is_the_best_measured_default_and_the_docstring_cites_the_table():
    column = re.search(r"\((mean of \d+):", " ".join(ModelConfig.__doc__.split()))
    assert column, "ModelConfig's docstring names the table column it cites: '(mean of N: Name 0.123, …)'"
    assert column[1] in DOCS.read_text().split("## Accuracy of the defaults", 1)[1], f"no column {column[1]!r} in the table"
    table = summary_column(DOCS.read_text(), column[1])
    assert {"VGPMIL", "GVGPMIL", "VWSGP"} <= set(table), table
    numbers = cited(ModelConfig.__doc__, set(table))
    assert numbers and numbers == {k: table[k] for k in numbers}, (numbers, table)
    assert ModelConfig().name in numbers
    assert ModelConfig().name == max(table, key=table.get), table


def test_the_parsers_read_what_they_are_given():
    text = ("## Accuracy of the defaults (issue 15)\n\n| method | a | mean of 7 |\n|---|---|---|\n"
            "| logistic regression | 0.9 | 0.990 |\n| `VGPMIL()` | 0.8 | 0.845 |\n| `VWSGP()` | 0.7 | **0.850** |\n\n"
            "| other table | mean of 7 |\n|---|---|\n| `GVGPMIL()` | 0.999 |\n")
    assert summary_column(text) == {"VGPMIL": 0.845, "VWSGP": 0.850}
    assert cited("over the sets (mean of 7: VGPMIL 0.845,\n    VWSGP 0.850, G-VGPMIL 0.813)", {"VGPMIL", "VWSGP"}) == {"VGPMIL": 0.845, "VWSGP": 0.85}
