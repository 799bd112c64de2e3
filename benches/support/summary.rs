//! One line of percentiles per measured path, shared by the benches.

use std::time::Duration;

/// Prints `name` with the sample count and p50/p90/p99/max of `samples`.
pub fn summary(name: &str, mut samples: Vec<Duration>) {
    if samples.is_empty() {
        println!("{name:<34} n=0");
        return;
    }
    samples.sort();
    let pick = |q: f64| samples[((samples.len() - 1) as f64 * q).round() as usize];
    println!(
        "{name:<34} n={:<5} p50={:>9.3?} p90={:>9.3?} p99={:>9.3?} max={:>9.3?}",
        samples.len(),
        pick(0.5),
        pick(0.9),
        pick(0.99),
        pick(1.0)
    );
}
