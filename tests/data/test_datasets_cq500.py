"""CQ500 by name: a fixture in the archive's layout (``CQ500CT<N> CQ500CT<N>/Unknown Study/CT <series>/CT<6
digits>.dcm``, real CT DICOM written by pydicom, several series per study, and reads.csv with its 43 columns),
converted; the series chosen by the stated rule, the scan labels from two of three readers, slices ordered along the
scan, all checked by hand."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from cq500_layout import SERIES, write_reads, write_series
from pydicom.uid import generate_uid

from vit_ct.data.datasets import write_dataset_manifest
from vit_ct.data.datasets.cq500 import choose_series, study_series
from vit_ct.data.io.reader import load_ct_slice
from vit_ct.data.manifests.manifest import read_manifest, validate_manifest_files

CHOSEN = {0: "CT Plain", 1: "CT 2.55mm", 2: "CT Thin Plain", 3: "CT 5mm-2"}  # by the rule, worked out by hand


def test_one_series_per_study_by_the_rule_and_scan_labels_by_majority(cq500_root, tmp_path):
    out = tmp_path / "cq500.csv"
    written = write_dataset_manifest("cq500", cq500_root, out, progress=False)
    table = pd.read_csv(out, keep_default_na=False)
    scans = table.groupby("scan", sort=False)
    assert list(scans.groups) == ["CQ500-CT-0", "CQ500-CT-1", "CQ500-CT-2", "CQ500-CT-3"]
    chosen = {int(s[-1]): Path(g["image"].iloc[0]).parent.name for s, g in scans}
    assert chosen == CHOSEN
    assert scans.size().tolist() == [12, 14, 20, 13]
    assert (scans["series_description"].first() == ["Plain", "2.55mm", "Thin Plain", "5mm-2"]).all()
    assert scans["slice_thickness_mm"].first().tolist() == [5.0, 2.5, 0.625, 5.0]
    assert scans["kernel"].first().tolist() == ["H30s", "STANDARD", "SOFT", "STANDARD"]
    assert "label" not in table.columns and (table["slice"] == "").all()  # scan labels only; one file per slice
    # the majority of three readers, the same on every row of a scan
    columns = ["scan_label", "scan_intraparenchymal", "scan_subdural", "scan_epidural", "scan_subarachnoid",
               "scan_intraventricular", "fracture", "midline_shift", "ich_reads", "r3_ich"]  # fmt: skip
    labels = scans[columns].agg(["min", "max"])
    assert (labels.xs("min", axis=1, level=1) == labels.xs("max", axis=1, level=1)).all().all()
    assert labels.xs("max", axis=1, level=1).values.tolist() == [
        [1, 0, 0, 0, 0, 0, 1, 0, 2, 0],
        [0, 0, 0, 0, 0, 0, 0, 0, 1, 1],
        [1, 0, 1, 0, 0, 0, 0, 1, 3, 1],
        [1, 0, 0, 0, 1, 1, 0, 0, 2, 0],
    ]
    assert scans["category"].first().tolist() == ["B1", "B1", "B2", "B2"]
    assert (table["patient_id"] == table["scan"]).all()
    # slices in order along the scan, whatever the file names: pixel (0, 0) is 100 + k HU on the k-th slice
    for row in table[table["scan"] == "CQ500-CT-1"].itertuples():
        assert row.scan_slice == load_ct_slice(out.parent / row.image)[0, 0] - 100
    assert np.all(np.diff(table[table["scan"] == "CQ500-CT-1"]["position_mm"]) == 2.5)

    series = pd.read_csv(tmp_path / "cq500.series.csv", keep_default_na=False)
    assert written.files == [out, tmp_path / "cq500.series.csv"]
    assert len(series) == 12 and series.groupby("scan")["chosen"].sum().tolist() == [1, 1, 1, 1]
    picked = series[series["chosen"] == 1]
    assert [Path(f).name for f in picked["folder"]] == list(CHOSEN.values()) and (picked["rank"] == "1").all()
    where = series["folder"].map(lambda f: f.split("/", 1)[0][-1] + Path(f).name)  # study number + series folder
    reasons = dict(zip(where, series["reason"], strict=True))
    assert reasons["1CT 5mm POST CONTRAST"].startswith("post-contrast, soft kernel, 2.5 mm")
    assert reasons["0CT 5mm"] == "contrast not said, sharp/bone kernel, 5 mm, 12 images"  # by its kernel alone
    assert reasons["2CT Thin Bone"] == "contrast not said, sharp/bone kernel, 0.625 mm (< 2.5), 20 images"
    assert reasons["0CT PLAIN THIN"] == "said plain, soft kernel, 0.625 mm (< 2.5), 16 images"
    assert reasons["2CT SCOUT"] == "a localizer" and series[series["reason"] == "a localizer"]["rank"].item() == ""
    why = dict(zip(where, series["why"], strict=True))  # the key of the rule that decided
    assert why["0CT Plain"] == "chosen: first by the rule" and why["0CT 5mm"] == "below CT Plain: sharp/bone kernel"
    assert why["0CT PLAIN THIN"] == "below CT Plain: thinner than 2.5 mm"
    assert (
        why["1CT 5mm POST CONTRAST"] == "below CT 2.55mm: post-contrast"
        and why["1CT 5mm"] == "below CT 2.55mm: thicker"
    )
    assert why["3CT 5mm"] == "below CT 5mm-2: fewer images" and why["2CT SCOUT"] == "not a CT image series"

    df = read_manifest(out, label_columns=["scan_label"])
    good, bad = validate_manifest_files(df, progress=False, workers=1)
    assert bad == [] and len(good) == 59


def test_thinner_slices_when_the_minimum_is_lowered(cq500_root, tmp_path):
    table = write_dataset_manifest("cq500", cq500_root, tmp_path / "m.csv", progress=False, min_thickness_mm=0.5).table
    first = table.groupby("scan", sort=False)["image"].first()
    assert [Path(p).parent.name for p in first] == ["CT PLAIN THIN", "CT 2.55mm", "CT Thin Plain", "CT 5mm-2"]


def test_studies_the_mirror_lacks_are_left_out_and_listed_unless_raise_is_asked(cq500_root, tmp_path):
    """The Kaggle mirror lacks some studies of reads.csv: by default the manifest holds the studies present and
    OUT.left_out.csv the absent ones; on_missing='raise' stops before anything is written."""
    write_reads(cq500_root / "reads.csv", [*SERIES, 4, 5])
    with pytest.raises(ValueError, match=r"CQ500-CT-4 \(no folder CQ500CT4 CQ500CT4\).*on_missing='skip'"):
        write_dataset_manifest("cq500", cq500_root, tmp_path / "m.csv", progress=False, on_missing="raise")
    assert not (tmp_path / "m.csv").exists()
    written = write_dataset_manifest("cq500", cq500_root, tmp_path / "m.csv", progress=False)
    assert written.table["scan"].nunique() == 4 and tmp_path / "m.left_out.csv" in written.files
    left_out = pd.read_csv(tmp_path / "m.left_out.csv")
    assert left_out.to_dict("list") == {
        "scan": ["CQ500-CT-4", "CQ500-CT-5"],
        "reason": ["no folder CQ500CT4 CQ500CT4", "no folder CQ500CT5 CQ500CT5"],
    }
    assert written.notes[-1].startswith("2 stud(ies) of reads.csv left out: CQ500-CT-4 (no folder CQ500CT4 CQ500CT4)")
    assert "m.left_out.csv" in written.notes[-1]
    with pytest.raises(ValueError, match=r"m\.csv.* already exist"):
        write_dataset_manifest("cq500", cq500_root, tmp_path / "m.csv", progress=False)
    # the mirror's tree: study folders one level down (qct01/...), reads.csv beside them, all below ROOT
    mirror = tmp_path / "kaggle" / "qureai-headct"
    (mirror / "qct01").mkdir(parents=True)
    for folder in sorted(cq500_root.iterdir()):
        folder.rename(mirror / ("qct01" if folder.is_dir() else "") / folder.name)
    below = write_dataset_manifest("cq500", tmp_path / "kaggle", tmp_path / "k.csv", progress=False)
    assert below.table["scan"].nunique() == 4


def test_bad_reads_and_roots_are_refused_by_name(cq500_root, tmp_path):
    reads = cq500_root / "reads.csv"
    text = reads.read_text()
    reads.write_text(text.replace("CQ500-CT-2,B2,1", "CQ500-CT-2,B2,2"))
    with pytest.raises(ValueError, match=r"reads\.csv: R1:ICH, R2:ICH, R3:ICH must be 0 or 1; bad on lines \[4\]"):
        write_dataset_manifest("cq500", cq500_root, tmp_path / "m.csv", progress=False)
    reads.write_text(text.replace("R2:SDH", "R2:SDX"))
    with pytest.raises(ValueError, match=r"lacks the columns \['R2:SDH'\]"):
        write_dataset_manifest("cq500", cq500_root, tmp_path / "m.csv", progress=False)
    reads.unlink()
    with pytest.raises(ValueError, match=r"lacks reads\.csv, and no folder .* holds reads\.csv; expected reads\.csv"):
        write_dataset_manifest("cq500", cq500_root, tmp_path / "m.csv", progress=False)
    with pytest.raises(ValueError, match=r"unknown dataset 'cq-5000'; expected one of cq500, ctich, instance, bhsd"):
        write_dataset_manifest("cq-5000", cq500_root, tmp_path / "m.csv")


def test_a_study_with_contrast_and_plain_series_of_equal_traits_trains_on_the_plain_one(tmp_path):
    """CQ500CT183 holds CT C, CT C THIN, CT Plain and CT PLAIN THIN: with equal traits the folder name put CT C
    first."""
    study = tmp_path / "CQ500CT183 CQ500CT183" / "Unknown Study"
    uid = generate_uid()
    for name, thickness in (("CT C", 5.0), ("CT C THIN", 0.625), ("CT Plain", 5.0), ("CT PLAIN THIN", 0.625)):
        write_series(study / name, 183, uid, thickness, 12, "H30s", {})
    candidates = study_series(study.parent)
    chosen = choose_series(candidates, 2.5, [])
    assert chosen.folder.name == "CT Plain"
    why = {s.folder.name: s.why(chosen, 2.5) for s in candidates}
    assert why == {
        "CT C": "below CT Plain: post-contrast",
        "CT C THIN": "below CT Plain: post-contrast",
        "CT Plain": "chosen: first by the rule",
        "CT PLAIN THIN": "below CT Plain: thinner than 2.5 mm",
    }
    # a description that says nothing loses to one that says plain only where everything else is equal
    other = tmp_path / "CQ500CT7 CQ500CT7" / "Unknown Study"
    for name in ("CT 5mm", "CT Plain"):
        write_series(other / name, 7, uid, 5.0, 12, "H30s", {})
    candidates = study_series(other.parent)
    chosen = choose_series(candidates, 2.5, [])
    assert chosen.folder.name == "CT Plain"
    assert {s.folder.name: s.why(chosen, 2.5) for s in candidates}["CT 5mm"] == "below CT Plain: plain not said"
