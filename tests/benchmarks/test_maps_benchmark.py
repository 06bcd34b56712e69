"""benchmarks/maps.py: every variant names every lever the model takes, and the table's mean and worst seed."""

from benchmarks import maps
from vit_ct.task.settings import group_of


def test_every_variant_sets_every_lever_by_its_model_argument():
    assert all(group_of(lever) is not None for lever in maps.LEVERS)  # each a setting of the model
    for variant in maps.VARIANTS:
        args = maps.variant_args(variant)
        assert args[::2] == [f"--model.{group_of(lever)}.{lever}" for lever in maps.LEVERS]
    assert maps.variant_args("baseline (every patch a key)")[:2] == ["--model.network.mask_air", "false"]


def test_mean_and_worst_seed_by_direction():
    assert maps.mean_and_worst([0.8, 0.9, 1.0], higher_is_better=True) == "0.900 (0.800)"
    assert maps.mean_and_worst([0.1, 0.3, float("nan")], higher_is_better=False) == "0.200 (0.300)"
    assert maps.mean_and_worst([], higher_is_better=True) == "-"


def test_table_has_one_row_per_variant_with_its_seed_count():
    faithfulness = {method: {"deletion": 0.1 * (i + 1)} for i, method in enumerate(maps.DELETION_METHODS)}
    run = {"metrics": {"test/auroc": 0.9, "test/rollout_outside_head_floor": 0.13}, "faithfulness": faithfulness}
    text = maps.table({"air masked": [run, run]})
    header, rule, row = text.splitlines()
    assert header.count("|") == rule.count("|") == row.count("|")
    assert row.startswith("| air masked | 2 | 0.900 (0.900) | - |") and "| 0.130 |" in row
