"""bench/reporting.py's percentile: the one definition every benchmark uses, for freight
and its peers alike, and the same as the CLI's (crates/freight-bench/src/report.rs,
`stats_use_nearest_rank`)."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
from reporting import PERCENTILE, percentile  # noqa: E402


def test_nearest_rank_as_the_cli_takes_it():
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0 and percentile([3.0, 1.0, 2.0], 99) == 3.0
    v = [float(i) for i in range(1, 201)]
    assert (percentile(v, 50), percentile(v, 99)) == (100.0, 198.0)
    assert "nearest rank" in PERCENTILE


def test_a_percentile_is_always_one_of_the_samples_never_between_two():
    rng = random.Random(7)
    for _ in range(200):
        v = [rng.random() for _ in range(rng.randrange(1, 60))]
        for p in (1, 50, 90, 99, 100):
            got = percentile(v, p)
            assert got in v
            # At least p% of the samples are at or below it, and fewer below it.
            assert sum(x <= got for x in v) >= p / 100 * len(v)
            assert sum(x < got for x in v) < p / 100 * len(v)


@pytest.mark.parametrize("values, p", [([], 50), ([1.0], 0), ([1.0], 101)])
def test_no_samples_or_a_percentile_out_of_range_is_an_error(values, p):
    with pytest.raises(ValueError):
        percentile(values, p)
