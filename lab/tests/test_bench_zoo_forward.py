"""``lab.scripts.bench_zoo_forward``: the arms as given, the table's ratios, the refusals."""

from __future__ import annotations

import argparse

import pytest

from lab.scripts import bench_zoo_forward


def _args(**fields):
    return argparse.Namespace(**{"models": [], "labels": None, "overrides": [], **fields})


def test_the_default_arms_are_dense_yarn_and_the_zoo_entry():
    labels = [label for label, _, _ in bench_zoo_forward.parse_arms(_args())]
    assert labels == ["dense + YaRN x4", "smollm2-135m-32k"]


def test_one_override_for_all_or_one_per_model():
    arms = bench_zoo_forward.parse_arms(_args(models=["a", "b"], overrides=['{"x": 1}']))
    assert [over for _, _, over in arms] == [{"x": 1}, {"x": 1}]
    arms = bench_zoo_forward.parse_arms(_args(models=["a", "b"], labels=["A", "B"],
                                              overrides=["{}", '{"y": 2}']))
    assert arms == [("A", "a", {}), ("B", "b", {"y": 2})]
    with pytest.raises(SystemExit, match="one --overrides object"):
        bench_zoo_forward.parse_arms(_args(models=["a", "b", "c"], overrides=["{}", "{}"]))


def test_the_table_divides_by_the_first_arm_at_each_length():
    rows = [{"n": 8, "system": "dense", "seconds": 4.0}, {"n": 8, "system": "ours", "seconds": 1.0},
            {"n": 16, "system": "dense", "seconds": 10.0},
            {"n": 16, "system": "ours", "seconds": 5.0}]
    lines = bench_zoo_forward.table(rows).splitlines()
    assert lines[0] == "| tokens | model | median s | vs dense |"
    assert lines[3] == "| 8 | ours | 1.0 | 0.25x |" and lines[5] == "| 16 | ours | 5.0 | 0.50x |"
