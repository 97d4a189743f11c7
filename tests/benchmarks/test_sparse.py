"""The sparse-inversion benchmark's cases and its memory extrapolation."""

import pytest

from benchmarks.sparse import inversion_case, largest_batch, student_case


def test_smis_schedule_prunes_four_times_and_the_ideal_follows_the_token_count():
    row = inversion_case("vit-tiny-32", "smi", teachers=1, batch=1, iterations=40)
    # 50/100/200/300 of 2000 -> steps 1, 2, 4, 6 of 40; 64 -> 45 -> 32 -> 23 -> 17 tokens.
    assert row["prune-steps"] == [1, 2, 4, 6] and row["tokens-at-end"] == 17
    work = (1 + 45 / 64 + 2 * 32 / 64 + 2 * 23 / 64 + 34 * 17 / 64) / 40
    assert row["token-ideal-speed-up"] == pytest.approx(1 / work)
    dense = inversion_case("vit-tiny-32", "dense", teachers=1, batch=1, iterations=2)
    assert dense["tokens-at-end"] == 64 and dense["token-ideal-speed-up"] == 1.0


def test_the_student_case_runs_on_the_tokens_it_is_given():
    row = student_case("vit-tiny-32", kept_tokens=17, batch=2, steps=1)
    assert row["tokens"] == 17 and row["patches"] == 64 and row["seconds-per-step"] > 0


def test_largest_batch_follows_the_line_through_the_measurements():
    rows = [{"batch": 4, "peak-rss-mb": 2048.0}, {"batch": 8, "peak-rss-mb": 3072.0},
            {"batch": 16, "error": "killed"}]
    fit = largest_batch(rows, budget_gib=24)
    assert fit["mb-per-image"] == 256 and fit["fixed-mb"] == 1024
    assert fit["largest-batch"] == (24 * 1024 - 1024) // 256
    assert "error" in largest_batch(rows[:1])
