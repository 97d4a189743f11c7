import pytest

from benchmarks.tables import markdown_table, mean_std


def test_mean_std_scales_then_reports_population_std():
    assert mean_std([0.5, 0.7], scale=100) == "60.00 ± 10.00"
    assert mean_std([1.0, 2.0, 3.0], digits=3) == f"2.000 ± {(2 / 3) ** 0.5:.3f}"


@pytest.mark.parametrize(("values", "expected"), [([0.1234], "12.3"), ([], "")])
def test_mean_std_without_a_spread_gives_the_value_alone(values, expected):
    assert mean_std(values, digits=1, scale=100) == expected


def test_markdown_table_formats_floats_and_leaves_missing_cells_empty():
    rows = [{"a": 1.23456, "b": "x"}, {"a": None}]
    assert markdown_table(rows, [("A", "a"), ("B", "b")]) == (
        "| A | B |\n|---|---|\n| 1.235 | x |\n|  |  |\n")
