"""Accuracy against ε: private splits beside the reference's non-private ones."""

import math

from benchmarks.dp_curve import curve_points, write_curve


def _rec(split, seed, **acc):
    return {"split": split, "seed": seed,
            "results": {m: {"accuracy": a} for m, a in acc.items()}}


def test_points_join_each_private_split_to_its_reference_seeds(tmp_path):
    private = [_rec("dir-0.5-eps8", 0, fedmitr=0.5, fedavg=0.2),
               _rec("dir-0.5-eps1", 0, fedmitr=0.3, fedavg=0.1)]
    reference = [_rec("dir-0.5", 0, fedmitr=0.7, fedavg=0.25),
                 _rec("dir-0.5", 1, fedmitr=0.9, fedavg=0.3),  # no private run at seed 1
                 _rec("dir-0.1", 0, fedmitr=0.6, fedavg=0.2)]  # no private run of this split
    points = curve_points(private, reference, ["fedmitr", "fedavg"])
    assert points[("dir-0.5", "fedmitr", math.inf)] == {0: 70.0}
    assert points[("dir-0.5", "fedmitr", 8.0)] == {0: 50.0}
    assert points[("dir-0.5", "fedavg", 1.0)] == {0: 10.0}
    assert not any(split == "dir-0.1" for split, _, _ in points)
    table = write_curve(points, tmp_path)
    assert "| dir-0.5 | fedmitr | ∞ | 70.0 (seeds 0) | 70.00 |" in table
    assert "| dir-0.5 | fedmitr | 1 | 30.0 (seeds 0) | 30.00 |" in table
    assert (tmp_path / "dp_curve.png").is_file()
