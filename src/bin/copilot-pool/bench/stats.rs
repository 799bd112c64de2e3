//! The bench's arithmetic: percentiles of one run's samples, and a figure over the pairs of
//! runs as its median with its spread (min–max), for each mode and as a ratio to the SDK in
//! its product pages' mode. Pure functions, no I/O.

use serde::Serialize;

/// The `q`-th percentile (0..=1) of `samples`, nearest rank; `None` when there are none.
pub fn percentile(samples: &[f64], q: f64) -> Option<f64> {
    let mut sorted: Vec<f64> = samples.iter().copied().filter(|v| v.is_finite()).collect();
    if sorted.is_empty() {
        return None;
    }
    sorted.sort_by(f64::total_cmp);
    let rank = (q.clamp(0.0, 1.0) * sorted.len() as f64).ceil() as usize;
    Some(sorted[rank.saturating_sub(1).min(sorted.len() - 1)])
}

/// A figure over several runs: the median, the smallest and the largest, and every run's value.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Spread {
    pub median: f64,
    pub min: f64,
    pub max: f64,
    pub runs: Vec<f64>,
}

impl Spread {
    /// `None` when no run measured the figure.
    pub fn of(values: &[Option<f64>]) -> Option<Spread> {
        let runs: Vec<f64> = values.iter().flatten().copied().collect();
        let min = runs.iter().copied().reduce(f64::min)?;
        let max = runs.iter().copied().reduce(f64::max)?;
        Some(Spread {
            median: median(&runs)?,
            min,
            max,
            runs,
        })
    }
}

/// The median (the mean of the middle two for an even count).
pub fn median(values: &[f64]) -> Option<f64> {
    let mut sorted = values.to_vec();
    if sorted.is_empty() {
        return None;
    }
    sorted.sort_by(f64::total_cmp);
    let mid = sorted.len() / 2;
    Some(if sorted.len().is_multiple_of(2) {
        (sorted[mid - 1] + sorted[mid]) / 2.0
    } else {
        sorted[mid]
    })
}

/// Pair by pair, `value / baseline` (a pair missing either, or a zero baseline, gives none).
pub fn ratios(values: &[Option<f64>], baseline: &[Option<f64>]) -> Vec<Option<f64>> {
    values
        .iter()
        .zip(baseline)
        .map(|(v, b)| match (v, b) {
            (Some(v), Some(b)) if *b != 0.0 => Some(v / b),
            _ => None,
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_take_the_nearest_rank() {
        let samples: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(percentile(&samples, 0.5), Some(50.0));
        assert_eq!(percentile(&samples, 0.99), Some(99.0));
        assert_eq!(percentile(&samples, 1.0), Some(100.0));
        assert_eq!(percentile(&[7.0], 0.99), Some(7.0));
        assert_eq!(percentile(&[3.0, 1.0, 2.0], 0.5), Some(2.0));
        assert_eq!(percentile(&[], 0.5), None);
    }

    #[test]
    fn a_spread_is_the_median_with_min_and_max_of_the_runs_that_measured() {
        let spread =
            Spread::of(&[Some(3.0), None, Some(1.0), Some(10.0), Some(2.0)]).expect("some runs");
        assert_eq!((spread.median, spread.min, spread.max), (2.5, 1.0, 10.0));
        assert_eq!(spread.runs, vec![3.0, 1.0, 10.0, 2.0]);
        assert_eq!(
            Spread::of(&[Some(3.0), Some(1.0), Some(2.0)]).map(|s| s.median),
            Some(2.0)
        );
        assert_eq!(Spread::of(&[None, None]), None);
    }

    #[test]
    fn ratios_are_taken_pair_by_pair_and_skip_missing_or_zero_baselines() {
        let r = ratios(
            &[Some(2.0), Some(3.0), None, Some(1.0)],
            &[Some(4.0), Some(0.0), Some(1.0), Some(2.0)],
        );
        assert_eq!(r, vec![Some(0.5), None, None, Some(0.5)]);
    }
}
