"""RSNA 2019 by name: the Kaggle layout converted through `write_dataset_manifest` gives what
`vit_ct.data.datasets.rsna_manifest.build_rsna_manifest` gives, plus ``label`` (= ``any``), the name every public set
uses."""

from __future__ import annotations

import pandas as pd
import pytest
from rsna_files import phantom_hu, write_ct_dicom

from vit_ct.data.datasets import dataset_info, write_dataset_manifest
from vit_ct.data.datasets.rsna_manifest import RSNA_LABELS, build_rsna_manifest
from vit_ct.data.manifests.manifest import read_manifest


@pytest.fixture
def kaggle_root(tmp_path):
    root = tmp_path / "rsna-intracranial-hemorrhage-detection"
    (root / "stage_2_train").mkdir(parents=True)
    labels = {"ID_aaa": [0, 0, 0, 0, 1, 1], "ID_bbb": [0] * 6, "ID_ccc": [1, 1, 0, 0, 0, 1]}
    for i, sop in enumerate(labels):
        write_ct_dicom(root / "stage_2_train" / f"{sop}.dcm", phantom_hu(16, i), f"ID_patient{i % 2}")
    rows = [f"{sop}_{name},{v}" for sop, vs in labels.items() for name, v in zip(RSNA_LABELS, vs, strict=True)]
    (root / "stage_2_train.csv").write_text("\n".join(["ID,Label", *rows]) + "\n")
    return root


def test_the_kaggle_folder_gives_the_rsna_manifest_and_label(kaggle_root, tmp_path):
    out = tmp_path / "rsna.csv"
    written = write_dataset_manifest("RSNA2019", kaggle_root, out, progress=False)
    reference = build_rsna_manifest(kaggle_root / "stage_2_train.csv", kaggle_root / "stage_2_train",
                                    tmp_path / "reference.csv", progress=False)  # fmt: skip
    table = pd.read_csv(out)
    assert table.drop(columns="label").to_dict("list") == reference.to_dict("list")
    assert list(table["label"]) == [1, 0, 1] == list(table["any"])
    assert written.files == [out] and not [p for p in tmp_path.iterdir() if p.name.startswith(".")]
    assert len(read_manifest(out, label_columns=list(RSNA_LABELS))) == 3
    assert "Kaggle competition terms (non-commercial)" in written.summary()


def test_a_folder_without_the_kaggle_files_is_named(kaggle_root, tmp_path):
    expected = r"lacks stage_1_train\.csv, images, and no folder .* holds stage_1_train\.csv and images; expected"
    with pytest.raises(ValueError, match=expected):
        write_dataset_manifest("rsna", kaggle_root, tmp_path / "m.csv", labels_csv="stage_1_train.csv", images="images")
    options = dataset_info("rsna").options()
    assert options == {"labels_csv": "stage_2_train.csv", "images": "stage_2_train", "workers": 8}
