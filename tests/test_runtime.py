import time

from fedmitr_core.runtime import Seconds, Stopwatch


def test_a_stopwatch_counts_cpu_time_for_work_and_not_for_waiting():
    watch = Stopwatch()
    end = time.perf_counter() + 0.3
    while time.perf_counter() < end:
        sum(range(1000))
    busy = watch.elapsed()
    watch = Stopwatch()
    time.sleep(0.3)
    idle = watch.elapsed()
    assert busy.wall >= 0.3 and busy.cpu >= 0.5 * busy.wall
    assert idle.wall >= 0.3 and idle.cpu < 0.2 * idle.wall


def test_seconds_add_field_by_field():
    assert Seconds(1.0, 0.5) + Seconds(2.0, 0.25) == Seconds(3.0, 0.75)
    assert Seconds() == Seconds(0.0, 0.0)
