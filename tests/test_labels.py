"""Label files → binary bag targets: target expressions (parsed, never run), positive values, presets."""

from __future__ import annotations

import pandas as pd
import pytest

from tasks.ingest.errors import DuplicateIdError, IngestError, MissingLabelError
from tasks.ingest.labels import LabelSpec, TargetExpression


@pytest.mark.parametrize("text, row, expected", [
    ("isup_grade > 0", {"isup_grade": 3}, 1),
    ("isup_grade > 0", {"isup_grade": 0}, 0),
    ("diagnosis in ['tumor', 'metastasis']", {"diagnosis": "metastasis"}, 1),
    ("diagnosis not in ('normal',)", {"diagnosis": "normal"}, 0),
    ("grade >= 2 and not qc_fail", {"grade": 2, "qc_fail": False}, 1),
    ("grade >= 2 and not qc_fail", {"grade": 2, "qc_fail": True}, 0),
    ("0 < score <= 0.5 or flag == 'yes'", {"score": 0.9, "flag": "yes"}, 1),
])
def test_target_expressions_compute_the_binary_target(text, row, expected):
    assert TargetExpression(text)(row) == expected


@pytest.mark.parametrize("text", ["__import__('os').system('echo hi')", "grade.real > 1", "grade + 1 > 2",
                                  "[x for x in grade]", "labels[0] > 1", "lambda: 1", "grade >"])
def test_anything_but_comparisons_of_columns_and_constants_is_refused(text):
    with pytest.raises(ValueError, match="not allowed|not an expression"):
        TargetExpression(text)


def test_a_labels_file_gives_targets_originals_and_per_row_errors(tmp_path):
    path = tmp_path / "labels.csv"
    pd.DataFrame({"case": ["a", "b", "c", "d", "d", "e"], "grade": [0, 2, None, 4, 3, 1],
                  "dx": ["normal", "tumor", "tumor", "tumor", "tumor", "Tumor"]}).to_csv(path, index=False)
    labels, original = LabelSpec(str(path), id_column="case", label_column="grade", target="grade > 1").read()
    assert (labels["a"], labels["b"], labels["e"]) == (0, 1, 0) and original["b"] == 2
    assert isinstance(labels["c"], MissingLabelError) and "empty grade" in labels["c"].reason
    assert isinstance(labels["d"], DuplicateIdError) and "rows 4 and 5 after the header: {'grade': 4.0, 'dx': 'tumor'} and {'grade': 3.0" in str(labels["d"])
    by_value = LabelSpec(str(path), id_column="case", label_column="dx", positive=["tumor"]).read()[0]
    assert (by_value["a"], by_value["b"]) == (0, 1)  # values compare exactly; a near miss is refused, not negative
    assert isinstance(by_value["e"], MissingLabelError) and "'Tumor' differs from the positive value 'tumor' only in case" in by_value["e"].reason
    by_target = LabelSpec(str(path), id_column="case", label_column="dx", target="dx in ['tumor'] and grade >= 0").read()[0]
    assert (by_target["a"], by_target["b"]) == (0, 1)  # so does a target expression's comparison with a text
    assert isinstance(by_target["e"], MissingLabelError) and "'Tumor' differs from 'tumor' in the target only in case" in by_target["e"].reason
    listed = LabelSpec(str(path), id_column="case", label_column="dx", target="dx in ['tumor', 'Tumor']").read()[0]
    assert listed["e"] == 1  # a value the target lists exactly is no typo
    numeric = LabelSpec(str(path), id_column="case", label_column="grade", positive=[2, 4]).read()[0]
    assert (numeric["b"], numeric["e"]) == (1, 0)  # 2.0 read from CSV matches 2
    with pytest.raises(IngestError, match=r"no column\(s\) \['stage'\]"):
        LabelSpec(str(path), id_column="case", target="stage > 1").read()
    panda = LabelSpec.preset("panda", path)
    assert (panda.id_column, panda.target) == ("image_id", "isup_grade > 0")


def test_the_config_labels_section_names_the_field_of_a_bad_expression(tmp_path):
    from flows.config import ConfigError, load_config

    (tmp_path / "l.csv").write_text("slide_id,grade\n")
    config = tmp_path / "c.yaml"
    config.write_text("name: t\nstore: s.zarr\noutput_dir: out\ningest:\n  kind: h5\n  source: h5\n"
                      "  labels: {file: l.csv, target: \"open('x')\"}\n")
    with pytest.raises(ConfigError, match="ingest.labels.*Call is not allowed"):
        load_config(config)
    config.write_text("name: t\nstore: s.zarr\noutput_dir: out\ningest:\n  kind: h5\n  source: h5\n"
                      "  labels: {file: l.csv, target: grade > 2}\n")
    assert load_config(config).ingest.labels.file == tmp_path / "l.csv"


def test_a_new_cohorts_labels_file_is_read_as_the_configs_labels_section_reads_its_own(tmp_path):
    """``predict --source NEW --labels FILE`` with a labels section (id column, target): the file
    takes the section's place, not PANDA's convention; a plain labels path stays a path."""
    from flows.config import IngestConfig, LabelsConfig
    from flows.pipeline import new_cohort_ingest

    (tmp_path / "slides").mkdir()
    (tmp_path / "clinical.csv").write_text("slide,dx\n")
    section = IngestConfig(kind="wsi", source=tmp_path / "slides",
                           labels=LabelsConfig(file=tmp_path / "clinical.csv", id_column="slide", label_column="dx",
                                               target="dx in ['tumor']"))
    new = new_cohort_ingest(section, tmp_path / "new", tmp_path / "new.csv", {"store": str(tmp_path / "train.zarr")})
    assert (new.source, new.extractor_from) == (tmp_path / "new", tmp_path / "train.zarr")
    assert new.labels == section.labels.model_copy(update={"file": tmp_path / "new.csv"})
    plain = section.model_copy(update={"labels": tmp_path / "clinical.csv"})
    assert new_cohort_ingest(plain, tmp_path / "new", tmp_path / "new.csv", {}).labels == tmp_path / "new.csv"
    assert new_cohort_ingest(section, tmp_path / "new", None, {}).labels is None


def test_a_ct_labels_section_that_names_columns_or_rules_is_refused_when_the_config_is_loaded(tmp_path):
    """The CT reader reads RSNA slice labels only: a section's id column or positive values were
    ignored silently (and a per-scan table failed after Prefect and Dask started)."""
    from pydantic import ValidationError

    from flows.config import IngestConfig

    with pytest.raises(ValidationError, match=r"ingest.kind ct reads RSNA slice labels"):
        IngestConfig(kind="ct", source=tmp_path, labels={"file": tmp_path / "l.csv", "id_column": "series", "positive": ["yes"]})
    assert IngestConfig(kind="ct", source=tmp_path, labels={"file": tmp_path / "l.csv", "preset": "rsna"}).labels.preset == "rsna"


def test_a_panda_preset_beside_columns_or_rules_is_refused_when_the_config_is_loaded(tmp_path):
    """``preset: panda`` with a target (``isup_grade >= 2``) trained on ISUP > 0 without a word."""
    from pydantic import ValidationError

    from flows.config import LabelsConfig

    with pytest.raises(ValidationError, match=r"preset panda reads image_id and isup_grade > 0; target would be ignored"):
        LabelsConfig(file=tmp_path / "l.csv", preset="panda", target="isup_grade >= 2")
    with pytest.raises(ValidationError, match=r"id_column, label_column would be ignored"):
        LabelsConfig(file=tmp_path / "l.csv", preset="panda", id_column="slide", label_column="grade")
    assert LabelsConfig(file=tmp_path / "l.csv", preset="panda").spec().target == "isup_grade > 0"
    assert LabelsConfig(file=tmp_path / "l.csv", preset="panda", target=None, label_column="label").preset == "panda"  # defaults spelt out
    from flows.config import IngestConfig

    with pytest.raises(ValidationError, match=r"preset rsna reads RSNA CT slice labels \(ingest.kind ct\), not those of ingest.kind 'h5'"):
        IngestConfig(kind="h5", source=tmp_path, labels={"file": tmp_path / "l.csv", "preset": "rsna"})  # its labels were dropped


def test_a_target_that_takes_a_text_column_as_true_or_false_is_refused_before_any_bag(tmp_path):
    """``not qc_fail`` over ``yes``/``no`` read every text as true: every bag negative, no warning.
    0/1 and true/false columns read as they are; a text column compared is fine."""
    path = tmp_path / "labels.csv"
    pd.DataFrame({"slide_id": ["a", "b", "c"], "dx": ["tumor", "tumor", "normal"], "qc_fail": ["no", "yes", "no"],
                  "qc_flag": [0, 1, 0], "qc_bool": [False, True, False]}).to_csv(path, index=False)
    for target in ("dx in ['tumor'] and not qc_fail", "qc_fail", "qc_flag or qc_fail"):
        with pytest.raises(IngestError, match=r"takes the column 'qc_fail' as true/false, but it holds text \['no', 'yes'\] "
                                              r".*compare it, e.g. \"qc_fail == 'yes'\""):
            LabelSpec(str(path), target=target).read()
    for target in ("dx in ['tumor'] and not qc_flag", "dx in ['tumor'] and not qc_bool", "dx in ['tumor'] and qc_fail == 'no'"):
        assert LabelSpec(str(path), target=target).read()[0] == {"a": 1, "b": 0, "c": 0}, target
    # one text cell (a blank, 'pending') in a 0/1 column fails its own row, named, as the label column's do
    pd.DataFrame({"slide_id": ["a", "b", "c", "d"], "dx": ["tumor"] * 4, "qc": ["0", " ", "pending", "1"]}).to_csv(path, index=False)
    labels, _ = LabelSpec(str(path), target="dx == 'tumor' and not qc").read()
    assert (labels["a"], labels["d"]) == (1, 0)
    assert isinstance(labels["b"], MissingLabelError) and "qc is ' ', text where the target takes a true/false value" in labels["b"].reason
    assert isinstance(labels["c"], MissingLabelError) and "(e.g. qc == 'pending')" in labels["c"].reason


def test_a_blank_in_a_nullable_parquet_column_is_a_blank_to_the_whole_column_checks(tmp_path):
    """Parquet keeps pandas' nullable dtypes: a blank is ``pd.NA``, which the column checks took for
    a value (``str(pd.NA)`` is ``'<NA>'``). A 0/1 ``Int64`` column with one blank then escaped the
    "``positive`` matches no row" refusal and every bag was negative; a ``string`` column with one
    blank escaped the text-as-true/false refusal."""
    path = tmp_path / "labels.parquet"
    pd.DataFrame({"slide_id": ["a", "b", "c", "d"], "dx": ["tumor"] * 4,
                  "qc_fail": pd.array(["no", "yes", None, "no"], dtype="string"),
                  "label": pd.array([1, 0, None, 1], dtype="Int64")}).to_parquet(path)
    assert pd.read_parquet(path)["label"].dtype == "Int64"  # the blank comes back as pd.NA
    with pytest.raises(IngestError, match=r"no row's label is one of positive \['tumor'\]; the column holds 0/1 labels"):
        LabelSpec(str(path), positive=["tumor"]).read()
    with pytest.raises(IngestError, match=r"takes the column 'qc_fail' as true/false, but it holds text \['no', 'yes'\]"):
        LabelSpec(str(path), target="dx == 'tumor' and not qc_fail").read()
    labels, _ = LabelSpec(str(path)).read()  # read as 0/1, the blank fails its own row
    assert (labels["a"], labels["b"], labels["d"]) == (1, 0, 1) and isinstance(labels["c"], MissingLabelError)


def test_a_row_whose_label_is_blank_is_an_unlabelled_bag_to_predict_and_a_skipped_one_to_train(tmp_path):
    """A labels export that lists every slide, the pending ones with an empty grade: a cohort to
    predict kept them out of the prediction ('unusable label …: cannot convert float NaN to integer')."""
    from tasks.ingest.errors import BlankLabelError
    from tasks.ingest.labels import labelled_items, read_panda_labels

    path = tmp_path / "labels.csv"
    path.write_text("image_id,data_provider,isup_grade,gleason_score\ns1,radboud,3,4+3\ns2,radboud,,\ns3,radboud,x,0+0\n")
    labels, _ = read_panda_labels(path)
    assert labels["s1"] == 1 and isinstance(labels["s2"], BlankLabelError) and not isinstance(labels["s3"], BlankLabelError)
    assert labels["s2"].reason == "no label yet: empty isup_grade (row 2 after the header)"
    candidates = [(bag, f"/slides/{bag}.tiff", None) for bag in ("s1", "s2", "s3")]
    items, skipped = labelled_items(candidates, labels, str(path), keep_unlabelled=True)
    assert [(i.bag_id, i.label) for i in items] == [("s1", 1), ("s2", -1)] and [s.bag_id for s in skipped] == ["s3"]
    items, skipped = labelled_items(candidates, labels, str(path))
    assert [i.bag_id for i in items] == ["s1"] and [(s.bag_id, s.error) for s in skipped] == [("s2", "BlankLabelError"),
                                                                                             ("s3", "MissingLabelError")]
    spec = tmp_path / "spec.csv"
    spec.write_text("slide_id,label\na,1\nb, \nc,0\n")  # a section's label column: a cell of spaces is blank too
    assert isinstance(LabelSpec(str(spec)).read()[0]["b"], BlankLabelError)


def test_codes_that_spell_numbers_and_booleans_match_positive_and_targets_by_value(tmp_path):
    """The labels reader takes a cell that spells a number as that number (TCGA's sample type ``01``
    is 1), and ``positive: ["01"]`` and ``target: "sample_type == '01'"`` then matched no row: every
    bag negative, without a word; so did ``positive: [1]`` over a True/False column."""
    path = tmp_path / "codes.csv"
    path.write_text("slide_id,sample_type,tumor\na,01,True\nb,11,False\nc,01,True\n")
    expected = {"a": 1, "b": 0, "c": 1}
    assert LabelSpec(str(path), label_column="sample_type", positive=["01"]).read()[0] == expected
    assert LabelSpec(str(path), target="sample_type == '01'").read()[0] == expected
    assert LabelSpec(str(path), target="sample_type in ['01', '02']").read()[0] == expected
    for positive in ([1], [True], ["true"], ["True"]):
        assert LabelSpec(str(path), label_column="tumor", positive=positive).read()[0] == expected, positive
    for target in ("tumor == 'true'", "tumor == 'TRUE'", "tumor != 'false'", "tumor in ['true']", "tumor == True", "tumor == 1"):
        assert LabelSpec(str(path), target=target).read()[0] == expected, target  # 'true' was never a True cell
    assert LabelSpec(str(path), label_column="sample_type", positive=["11"]).read()[0] == {"a": 0, "b": 1, "c": 0}
    path.write_text("slide_id,code\na,10000000000000001\nb,10000000000000000\n")  # compared exactly, not as floats
    assert LabelSpec(str(path), label_column="code", positive=[10000000000000001]).read()[0] == {"a": 1, "b": 0}
    assert LabelSpec(str(path), label_column="code", positive=["10000000000000001"]).read()[0] == {"a": 1, "b": 0}


def test_a_parquet_labels_file_saved_with_its_index_or_an_upper_case_suffix_is_read(tmp_path):
    """``df.set_index('case_id').to_parquet()`` failed with ``TypeError: can only concatenate str``
    naming no file; an id column saved as the index was "no column 'slide_id'"; ``LABELS.PARQUET``
    was read as a CSV and refused as "not UTF-8 text"."""
    table = pd.DataFrame({"case_id": ["p1", "p2"], "slide_id": ["a", "b"], "label": [1, 0]})
    table.set_index("case_id").to_parquet(tmp_path / "indexed.parquet")
    assert LabelSpec(str(tmp_path / "indexed.parquet")).read()[0] == {"a": 1, "b": 0}
    table.set_index("slide_id").to_parquet(tmp_path / "by_id.parquet")
    assert LabelSpec(str(tmp_path / "by_id.parquet")).read()[0] == {"a": 1, "b": 0}
    table.set_index("slide_id", drop=False).to_parquet(tmp_path / "both.parquet")  # the id as the index and a column
    assert LabelSpec(str(tmp_path / "both.parquet")).read()[0] == {"a": 1, "b": 0}
    table.to_parquet(tmp_path / "LABELS.PARQUET")
    assert LabelSpec(str(tmp_path / "LABELS.PARQUET")).read()[0] == {"a": 1, "b": 0}


def test_a_semicolon_separated_labels_file_is_named_for_what_it_is(tmp_path):
    from tasks.ingest.labels import read_panda_labels

    (tmp_path / "labels.csv").write_text("image_id;isup_grade\nslide_a;3\n")
    with pytest.raises(IngestError, match=r"one column 'image_id;isup_grade': it looks semicolon-separated"):
        read_panda_labels(tmp_path / "labels.csv")


def test_an_id_spelled_with_decomposed_accents_finds_its_label_and_original():
    """macOS writes file names with decomposed accents (e + U+0301), a spreadsheet the composed é:
    the slide 'café_01' had 'no label in labels.csv' although the file lists it."""
    import unicodedata

    from tasks.ingest.labels import labelled_items
    from tasks.store import encode_original_label

    composed, decomposed = "café_01", unicodedata.normalize("NFD", "café_01")
    assert composed != decomposed
    items, skipped = labelled_items([(decomposed, f"/slides/{decomposed}.tiff", None), ("other", "/slides/other.tiff", None)],
                                    {composed: 1}, "labels.csv", {composed: "4+4"})
    assert [(i.bag_id, i.label, i.original_label) for i in items] == [(decomposed, 1, encode_original_label("4+4"))]
    assert [s.bag_id for s in skipped] == ["other"]


def test_one_text_cell_leaves_the_other_rows_numbers(tmp_path):
    """A row 'pending' made pandas read the whole label column as text: each bag's original label
    '1' then differed from the 1 stored by the previous run (every bag a LabelChangedError on the
    rerun), and a target 'grade >= 2' failed on every row of a grade column with one text cell."""
    from tasks.store import encode_original_label

    (tmp_path / "a.csv").write_text("slide_id,label,grade\ns1,1,3\ns2,0,1\n")
    (tmp_path / "b.csv").write_text("slide_id,label,grade\ns1,1,3\ns2,0,1\ns9,pending,n/a\n")
    labels_a, originals_a = LabelSpec(str(tmp_path / "a.csv")).read()
    labels_b, originals_b = LabelSpec(str(tmp_path / "b.csv")).read()
    assert {k: labels_b[k] for k in ("s1", "s2")} == labels_a == {"s1": 1, "s2": 0}
    assert isinstance(labels_b["s9"], MissingLabelError)
    assert [encode_original_label(originals_b[k]) for k in ("s1", "s2")] == [encode_original_label(originals_a[k])
                                                                             for k in ("s1", "s2")] == ["1", "0"]
    graded, _ = LabelSpec(str(tmp_path / "b.csv"), label_column="grade", target="grade >= 2").read()
    assert {k: graded[k] for k in ("s1", "s2")} == {"s1": 1, "s2": 0} and isinstance(graded["s9"], MissingLabelError)


def test_positive_values_that_no_row_matches_are_refused_when_they_look_like_a_mistake(tmp_path):
    """positive: [tumour] against a file of 'tumor', or positive: [tumor] against a 0/1 file, made
    every bag negative without a word; a cohort whose rows are all of other classes is read."""
    (tmp_path / "text.csv").write_text("slide_id,label\ns1,tumor\ns2,normal\n")
    (tmp_path / "binary.csv").write_text("slide_id,label\ns1,1\ns2,0\n")
    (tmp_path / "benign.csv").write_text("slide_id,label\ns1,normal\ns2,benign\n")
    with pytest.raises(IngestError, match=r"no row's label is one of positive \['tumour'\]; the column has 'tumor', not 'tumour'"):
        LabelSpec(str(tmp_path / "text.csv"), positive=["tumour"]).read()
    with pytest.raises(IngestError, match=r"the column holds 0/1 labels: drop positive"):
        LabelSpec(str(tmp_path / "binary.csv"), positive=["tumor"]).read()
    assert LabelSpec(str(tmp_path / "benign.csv"), positive=["tumor"]).read()[0] == {"s1": 0, "s2": 0}
    assert LabelSpec(str(tmp_path / "text.csv"), positive=["tumor"]).read()[0] == {"s1": 1, "s2": 0}
    assert LabelSpec(str(tmp_path / "binary.csv"), positive=[1]).read()[0] == {"s1": 1, "s2": 0}


def test_a_new_cohort_is_tiled_and_featurised_as_the_training_store_records(tmp_path):
    """A config edited since training (tile_size 256, another extractor's weights) tiled the new
    cohort otherwise and exited 0, or featurised all of it before failing: the training store's
    recorded tiling and extractor are used."""
    from dataclasses import asdict

    from flows.config import IngestConfig
    from flows.pipeline import new_cohort_ingest
    from tasks.ingest.wsi import TilingParams
    from tasks.store import CohortSpec, create_cohort

    recorded = asdict(TilingParams(tile_size=128, target_mpp=0.5, min_tissue=0.3, base_mpp=0.25))
    create_cohort(tmp_path / "train.zarr", CohortSpec(name="t", n_features=6, coords_dim=4, coords_meaning="tile_row,tile_col,x,y",
                                                      tiling=recorded, feature_extractor={"name": "mean-colour"}))
    (tmp_path / "slides").mkdir()
    edited = IngestConfig(kind="wsi", source=tmp_path / "slides", tile_size=256, magnification=20, min_tissue_fraction=0.5,
                          extractor="he-handcrafted", extractor_params={"hog_components": 4})
    new = new_cohort_ingest(edited, tmp_path / "new", None, {"store": str(tmp_path / "train.zarr")})
    assert (new.tile_size, new.target_mpp, new.magnification, new.min_tissue_fraction) == (128, 0.5, None, 0.3)
    # the training scanner's µm/px overrode every new slide's own (0.5 µm/px slides tiled as 0.25): the new
    # slides' metadata decides, or the µm/px given for them
    assert new.base_mpp is None
    assert new_cohort_ingest(edited, tmp_path / "new", None, {"store": str(tmp_path / "train.zarr")}, base_mpp=0.5).base_mpp == 0.5
    configured = edited.model_copy(update={"base_mpp": 0.25})  # no training store recorded: the config's was kept
    assert new_cohort_ingest(configured, tmp_path / "new", None, {}).base_mpp is None
    assert (new.extractor, new.extractor_params, new.extractor_from) == (None, {}, tmp_path / "train.zarr")
    assert new.trusted_imports == []  # a registered extractor: no import path to trust
    own = edited.model_copy(update={"extractor": "torch", "extractor_params": {"model": "lab_models:TinyCNN"},
                                    "trusted_imports": ["lab_models:Other"]})
    # the config's own torch model stays trusted: the training store's extractor may be rebuilt from it, not from any path
    assert new_cohort_ingest(own, tmp_path / "new", None, {"store": str(tmp_path / "train.zarr")}).trusted_imports == [
        "lab_models:Other", "lab_models:TinyCNN"]


def test_labels_files_as_spreadsheets_export_them_read_or_are_refused_with_what_to_do(tmp_path):
    """From a probe of real teams' files: Excel's blank trailing rows crashed the ingest with a raw
    TypeError; grades or -1/+1 in a 0/1 column skipped bag after bag and trained on the rest with
    exit 0; a workbook, a Windows-encoded or UTF-16 file, a tab-separated .csv got the decoder's
    error or none."""
    from tasks.ingest.labels import read_panda_labels

    def write(name: str, content: str | bytes) -> Path:
        path = tmp_path / name
        path.write_bytes(content if isinstance(content, bytes) else content.encode())
        return path

    labels, _ = LabelSpec(str(write("blank.csv", "slide_id,label,note\na,1,\nb,0,x\n,,\n , ,\na,1,\n"))).read()
    assert labels == {"a": 1, "b": 0}  # the blank rows are no bag, a row copied twice one label
    assert read_panda_labels(write("panda.csv", "image_id,isup_grade\na,3\nb,0\n,\n"))[0] == {"a": 1, "b": 0}
    with pytest.raises(IngestError, match=r"row\(s\) \[3\] after the header of the labels file have no slide_id \(row 3: \{'label': 0.0\}\)"):
        LabelSpec(str(write("noid.csv", "slide_id,label\na,1\n,\n,0\n"))).read()  # the blank row counts
    odd, _ = LabelSpec(str(write("typo.csv", "slide_id,label\na,1\nb,0\nc,2\nd,-1\n"))).read()
    assert (odd["a"], odd["b"]) == (1, 0) and isinstance(odd["c"], MissingLabelError) and isinstance(odd["d"], MissingLabelError)
    refused = {"isup.csv": ("slide_id,label\na,0\nb,1\nc,3\nd,5\n", r"grades \[0, 1, 3, 5\].*\"label > 0\""),
               "pm1.csv": ("slide_id,label\na,1\nb,-1\n", r"-1/\+1 labels: give target: \"label == 1\""),
               "words.csv": ("slide_id,label\na,positive\nb,negative\n",  # no example value: the first sorted is often the negative
                             r"text \['negative', 'positive'\]: give positive, the value\(s\) that mark a positive bag \(positive: \[<one of them>\]\)"),
               "scores.csv": ("slide_id,label\na,0.2\nb,0.9\n", r"values \[0.2, 0.9\]")}
    for name, (text, message) in refused.items():
        with pytest.raises(IngestError, match=message):
            LabelSpec(str(write(name, text))).read()
    assert LabelSpec(str(tmp_path / "isup.csv"), target="label > 0").read()[0] == {"a": 0, "b": 1, "c": 1, "d": 1}
    assert LabelSpec(str(tmp_path / "words.csv"), positive=["positive"]).read()[0] == {"a": 1, "b": 0}
    pending, _ = LabelSpec(str(write("pending.csv", "slide_id,label\na,1\nb,0\nc,pending\nd,\n"))).read()
    assert (pending["a"], pending["b"]) == (1, 0)  # one odd cell among 0/1 skips its bag only
    assert isinstance(pending["c"], MissingLabelError) and "empty label" in pending["d"].reason
    for name, content, message in (("book.csv", b"PK\x03\x04\x14\x00rest", "spreadsheet workbook, not text"),
                                   ("win.csv", "slide_id,label\nM\u00fcller,1\n".encode("cp1252"), "not UTF-8 text"),
                                   ("u16.csv", "slide_id,label\na,1\n".encode("utf-16"), "UTF-16 text"),
                                   ("tabs.csv", "slide_id\tlabel\na\t1\n", "tab-separated; save it comma-separated, or name it .tsv")):
        with pytest.raises(IngestError, match=message):
            LabelSpec(str(write(name, content))).read()
    with pytest.raises(IngestError, match="read as PANDA's .* unless ingest.labels is a section"):
        read_panda_labels(tmp_path / "isup.csv")


def test_a_labels_file_that_gives_no_labels_fails_the_preflight_not_the_run(tmp_path):
    from flows.checks import check_inputs
    from flows.config import ConfigError, LabelsConfig, PipelineConfig

    (tmp_path / "h5").mkdir()
    (tmp_path / "labels.csv").write_text("slide_id,label\na,0\nb,3\nc,5\n")
    config = PipelineConfig.model_validate({"name": "c", "store": str(tmp_path / "s.zarr"), "output_dir": str(tmp_path / "out"),
                                            "ingest": {"kind": "h5", "source": str(tmp_path / "h5"), "labels": str(tmp_path / "labels.csv")}})
    with pytest.raises(ConfigError, match=r"ingest.labels: .*labels.csv: the label column 'label' must hold 0/1.*grades \[0, 3, 5\]"):
        check_inputs(config, "run")
    (tmp_path / "labels.csv").write_text("slide_id,label\na,0\nb,1\n")
    check_inputs(config, "run")
    rsna = config.model_copy(update={"ingest": config.ingest.model_copy(update={"labels": LabelsConfig(file=tmp_path / "labels.csv",
                                                                                                       preset="rsna")})})
    with pytest.raises(ConfigError, match="preset 'rsna' reads CT slice labels"):
        check_inputs(rsna, "run")


def test_a_new_cohorts_labels_in_the_configs_layout_pass_the_preflight_as_the_flow_reads_them(tmp_path):
    """``predict --source --labels``: the preflight read the new file by the kind's default layout
    (slide_id,label) while the flow reads it as the config's labels section, and refused it."""
    from flows.checks import _labels_problem
    from flows.config import IngestConfig, LabelsConfig, new_cohort_labels
    from flows.pipeline import new_cohort_ingest

    (tmp_path / "h5").mkdir()
    (tmp_path / "new.csv").write_text("image_id,isup_grade\nc,0\nd,4\ne,2\n")
    section = LabelsConfig(file=tmp_path / "train.csv", id_column="image_id", label_column="isup_grade", target="isup_grade > 0")
    ingest = IngestConfig(kind="h5", source=tmp_path / "h5", labels=section)
    new = new_cohort_labels(section, tmp_path / "new.csv")
    assert new == new_cohort_ingest(ingest, tmp_path / "h5", tmp_path / "new.csv", {}).labels  # the CLI's and the flow's
    assert _labels_problem(ingest.model_copy(update={"labels": new}), "--labels") is None
    plain = ingest.model_copy(update={"labels": new_cohort_labels(None, tmp_path / "new.csv")})
    assert "no column(s) ['label']" in _labels_problem(plain, "--labels")  # without a section: the kind's layout
