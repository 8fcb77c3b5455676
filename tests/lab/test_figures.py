"""The lab's one percentile: nearest rank, as its reports state it."""

from lab.figures import percentile


def test_percentile_is_the_nearest_rank():
    values = [5.0, 1.0, 4.0, 2.0, 3.0]
    assert [percentile(values, q) for q in (0, 20, 21, 50, 95, 100)] == [1.0, 1.0, 2.0, 3.0, 5.0, 5.0]
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.0
    assert percentile([1.23456], 99, 2) == 1.23
    assert percentile([], 50) is None
