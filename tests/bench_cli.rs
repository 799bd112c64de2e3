//! End-to-end: `copilot-pool bench` at its smallest size runs all four modes and its JSON
//! object carries every figure of every mode and every ratio to the SDK alone,
//! the returning agent's (after its process went away) included.

mod support;

use std::process::Command;

use serde_json::Value;

/// The figures every mode reports; the pool's own only exist where there is a pool.
const FIGURES: [&str; 14] = [
    "turns_per_second",
    "cold_first_event_p50_ms",
    "first_idle_p50_ms",
    "warm_turn_p50_ms",
    "warm_turn_p99_ms",
    "runtime_cpu_per_turn_ms",
    "pool_cpu_per_turn_ms",
    "gateway_cpu_per_turn_ms",
    "runtime_peak_pss_mib",
    "pool_peak_pss_mib",
    "kill_to_ready_ms",
    "returning_first_event_p50_ms",
    "returning_first_idle_p50_ms",
    "returning_on_spare_percent",
];
const POOL_ONLY: [&str; 3] = [
    "pool_cpu_per_turn_ms",
    "pool_peak_pss_mib",
    "returning_on_spare_percent",
];

#[tokio::test]
async fn a_tiny_bench_reports_every_figure_of_every_mode_as_json() {
    let runtime = support::runtime::runtime_path().await;
    support::node_sdk::sdk_dir().await;
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_copilot-pool"));
    cmd.env("COPILOT_CLI_PATH", &runtime).args([
        "bench",
        "--agents",
        "1",
        "--conversations",
        "1",
        "--turns",
        "2",
        "--pairs",
        "1",
        // The SDK alone learns of its killed runtime only when an attempt times out.
        "--attempt-secs",
        "5",
        "--json",
    ]);
    let (report, stdout): (Value, String) = support::json_report(cmd, "bench").await;
    assert_eq!(report["workload"]["agents"], 1);
    assert_eq!(report["workload"]["pairs"], 1);
    for mode in ["http", "endpoint", "resume", "attached"] {
        let pool = mode == "http" || mode == "endpoint";
        for figure in FIGURES {
            let value = &report["modes"][mode][figure];
            if POOL_ONLY.contains(&figure) && !pool {
                assert!(value.is_null(), "{mode}.{figure} is {value}, not null");
                continue;
            }
            let median = value["median"]
                .as_f64()
                .unwrap_or_else(|| panic!("{mode}.{figure} has no median: {value}"));
            assert!(median > 0.0, "{mode}.{figure} = {median}");
            assert_eq!(
                value["runs"].as_array().map(Vec::len),
                Some(1),
                "{mode}.{figure}"
            );
            if mode != "resume" && !POOL_ONLY.contains(&figure) {
                let ratio = &report["ratios_vs_resume"][mode][figure]["median"];
                assert!(
                    ratio.as_f64().is_some_and(|r| r > 0.0),
                    "{mode}/resume {figure}: {ratio}"
                );
            }
        }
    }
    assert!(report["ratios_vs_resume"]["resume"].is_null());
    // The table is printed too, one row per figure.
    assert!(stdout.contains("kill to ready ms"), "{stdout}");
    assert!(stdout.contains("returning first event p50 ms"), "{stdout}");
    // The returning agent's turn found the primed spare the pool kept (no spawn, no wait).
    for mode in ["http", "endpoint"] {
        let on_spare = &report["modes"][mode]["returning_on_spare_percent"]["median"];
        assert_eq!(on_spare.as_f64(), Some(100.0), "{mode}: {on_spare}");
    }
}
