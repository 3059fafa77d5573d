//! The statistics every benchmark reports, defined once: percentiles by nearest rank
//! (the ceil(p * n)-th smallest of n samples), the median among them. bench/reporting.py
//! defines the same for the scripts and for every peer's figures, and the reports say
//! which definition they used ([`PERCENTILE`]).

use serde::Serialize;

/// How the reports' percentiles are taken, as they state it (the same words as
/// bench/reporting.py's `PERCENTILE`).
pub const PERCENTILE: &str = "nearest rank: the ceil(p * n)-th smallest of n samples, never an interpolation";

/// The `p`-quantile (0 < p <= 1) of `sorted` (ascending, not empty) by nearest rank: p99
/// of 200 samples is the 198th smallest, never an interpolation between two runs.
pub fn percentile(sorted: &[f64], p: f64) -> f64 {
    assert!(!sorted.is_empty(), "no samples");
    sorted[((p * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len()) - 1]
}

/// The median by [`percentile`]: one of the samples (of an even count, the lower middle
/// one), never the mean of the two middle ones.
pub fn median(sorted: &[f64]) -> f64 {
    percentile(sorted, 0.5)
}

/// Summary of timing samples, in microseconds.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Stats {
    pub avg: f64,
    pub p50: f64,
    pub p99: f64,
    pub min: f64,
    pub max: f64,
    pub samples: usize,
}

impl Stats {
    /// `None` for no samples. Percentiles as [`percentile`] takes them.
    pub fn of(samples: &[f64]) -> Option<Stats> {
        if samples.is_empty() {
            return None;
        }
        let mut s = samples.to_vec();
        s.sort_by(f64::total_cmp);
        Some(Stats {
            avg: nanos(s.iter().sum::<f64>() / s.len() as f64),
            p50: nanos(percentile(&s, 0.50)),
            p99: nanos(percentile(&s, 0.99)),
            min: nanos(s[0]),
            max: nanos(s[s.len() - 1]),
            samples: s.len(),
        })
    }
}

/// Microseconds rounded to the nanosecond: the clock resolves no finer, and JSON readers
/// should not see 0.21284999999999998.
fn nanos(us: f64) -> f64 {
    (us * 1e3).round() / 1e3
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stats_use_nearest_rank() {
        assert_eq!(Stats::of(&[]), None);
        let s = Stats::of(&[3.0, 1.0, 2.0]).unwrap();
        assert_eq!((s.avg, s.p50, s.p99, s.min, s.max), (2.0, 2.0, 3.0, 1.0, 3.0));
        let v: Vec<f64> = (1..=200).map(f64::from).collect();
        let s = Stats::of(&v).unwrap();
        assert_eq!((s.p50, s.p99), (100.0, 198.0));
    }

    #[test]
    fn percentiles_are_samples_by_nearest_rank() {
        let s: Vec<f64> = (1..=200).map(f64::from).collect();
        assert_eq!(percentile(&s, 0.99), 198.0);
        assert_eq!(percentile(&s, 0.5), 100.0);
        assert_eq!(median(&[1.0, 2.0, 3.0, 4.0]), 2.0, "the lower middle, not 2.5");
        assert_eq!(median(&[7.0]), 7.0);
        assert_eq!(percentile(&s, 1e-9), 1.0);
        assert_eq!(percentile(&s, 1.0), 200.0);
    }
}
