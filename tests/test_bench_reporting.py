"""bench/reporting.py's percentile: the one definition every benchmark uses, for freight
and its peers alike, and the same as the CLI's (crates/freight-bench/src/stats.rs,
`stats_use_nearest_rank`)."""

from __future__ import annotations

import random
import re
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"
sys.path.insert(0, str(BENCH))
from reporting import PERCENTILE, median, percentile, save_report  # noqa: E402


def test_nearest_rank_as_the_cli_takes_it():
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0 and percentile([3.0, 1.0, 2.0], 99) == 3.0
    v = [float(i) for i in range(1, 201)]
    assert (percentile(v, 50), percentile(v, 99)) == (100.0, 198.0)
    assert "nearest rank" in PERCENTILE


def test_the_median_is_the_50th_percentile_a_sample_never_a_mean_of_two():
    assert median([4.0, 1.0, 3.0, 2.0]) == 2.0  # statistics.median would say 2.5
    assert median([5.0, 1.0, 3.0]) == 3.0


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


# A script takes statistics where it mentions them (its own are what this guards against).
MENTIONS_STATISTICS = re.compile(r"p50|p99|median|percentile", re.I)
IMPORTS_REPORTING = re.compile(r"^from reporting import|^import reporting\b", re.M)
OWN_STATISTICS = re.compile(r"statistics\.(median\w*|quantiles)|(np|numpy)\.(median|percentile|quantile)"
                            r"|\[len\(\w+\) // 2\]")


def benchmark_scripts() -> list:
    scripts = sorted(BENCH.glob("*.py")) + sorted(BENCH.glob("peers/*.py"))
    return [p for p in scripts if p.name != "reporting.py"]


def test_every_benchmark_takes_its_statistics_from_reporting_and_says_which():
    """One definition for freight and every peer: a script under bench/ that speaks of
    percentiles or medians imports bench/reporting.py, states reporting.PERCENTILE in its
    report (itself or through reporting.save_report), and computes none of its own
    (statistics.median, numpy's, a middle index)."""
    scripts = benchmark_scripts()
    assert len(scripts) > 10 and BENCH / "ep_bench.py" in scripts, scripts
    problems = []
    for path in scripts:
        text = path.read_text()
        name = path.relative_to(BENCH.parent)
        problems += [f"{name}: {m.group()}" for m in OWN_STATISTICS.finditer(text)]
        if MENTIONS_STATISTICS.search(text):
            if not IMPORTS_REPORTING.search(text):
                problems.append(f"{name}: speaks of percentiles or medians but does not import reporting")
            # reporting.save_report writes the definition into the report it saves.
            if "PERCENTILE" not in text and "save_report(" not in text:
                problems.append(f"{name}: does not state reporting.PERCENTILE in its report")
    assert not problems, "\n".join(problems)


def test_a_saved_report_states_the_definition_and_the_machine(tmp_path):
    import argparse
    import json

    out = tmp_path / "sub" / "r.json"
    args = argparse.Namespace(machine="a test box", out=out)
    doc = save_report("bench/x.py", args, 0.0, lambda _: None, rows=[1, 2])
    assert json.loads(out.read_text()) == doc
    assert doc["percentile"] == PERCENTILE and doc["machine"]["label"] == "a test box"
    assert doc["started"] == "1970-01-01T00:00:00Z" and doc["rows"] == [1, 2] and doc["tool"] == "bench/x.py"
    # Without --out nothing is written.
    assert save_report("bench/x.py", argparse.Namespace(machine="m", out=None), 0.0, lambda _: None)["tool"]


def test_the_cli_benchmarks_state_the_same_definition():
    """freight's own benchmark programs (crates/freight-bench) take percentiles the same
    way and say so in the same words as the scripts."""
    stats = (Path(__file__).resolve().parents[1] / "crates" / "freight-bench" / "src" / "stats.rs").read_text()
    stated = re.search(r'pub const PERCENTILE: &str = "([^"]*)";', stats)
    assert stated is not None, "crates/freight-bench/src/stats.rs states no PERCENTILE"
    assert stated.group(1) == PERCENTILE
