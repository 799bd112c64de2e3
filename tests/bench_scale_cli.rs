//! End-to-end: `copilot-pool bench scale` at a tiny size (2 agents x 2 conversations, 20
//! turns, recycling after 3 turns per process) runs through a real `serve`, its JSON object
//! carries every sample figure and every summary figure, and its chart is a PNG.

mod support;

use std::process::Command;

use serde_json::Value;

const SAMPLE_FIGURES: [&str; 8] = [
    "turns_done",
    "seconds",
    "pool_rss_mib",
    "pool_pss_mib",
    "pool_heap_mib",
    "runtimes_pss_mib",
    "runtimes_rss_mib",
    "processes",
];
const SUMMARY_FIGURES: [&str; 15] = [
    "turns",
    "failed_turns",
    "seconds",
    "turns_per_second",
    "warm_up_turns",
    "pool_peak_rss_mib",
    "pool_peak_pss_mib",
    "pool_peak_heap_mib",
    "runtimes_pss_at_warm_up_mib",
    "runtimes_pss_at_end_mib",
    "runtimes_peak_pss_mib",
    "runtimes_pss_slope_mib_per_1000_turns",
    "processes_peak",
    "process_spawns",
    "processes_recycled",
];

#[tokio::test]
async fn a_tiny_scale_bench_reports_every_figure_as_json_and_draws_a_png() {
    let runtime = support::runtime::runtime_path().await;
    let dir = tempfile::tempdir().expect("a temporary directory");
    let png = dir.path().join("figures").join("scale.png");
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_copilot-pool"));
    cmd.env("COPILOT_CLI_PATH", &runtime).args([
        "bench",
        "scale",
        "--agents",
        "2",
        "--conversations",
        "2",
        "--turns",
        "20",
        "--concurrency",
        "2",
        // A process is recycled after 3 turns: each of the 2 agents gets 10.
        "--recycle-turns",
        "3",
        "--sample-every",
        "2",
        "--json",
        "--png",
    ]);
    cmd.arg(&png);
    let (report, stdout): (Value, String) = support::json_report(cmd, "bench scale").await;
    assert_eq!(report["workload"]["agents"], 2);
    assert_eq!(report["workload"]["conversations"], 4);
    assert_eq!(report["recycling"]["max_turns_per_process"], 3);

    let samples = report["samples"].as_array().expect("samples");
    // One before the load, one every 2 turns (warm-up's end, at 4, among them).
    assert_eq!(samples.len(), 11, "{samples:?}");
    for sample in samples {
        for figure in SAMPLE_FIGURES {
            assert!(sample[figure].is_number(), "sample {figure}: {sample}");
        }
    }
    let under_load = &samples[samples.len() - 1];
    assert_eq!(under_load["turns_done"], 20);
    assert!(under_load["pool_rss_mib"].as_f64().is_some_and(|m| m > 1.0));
    assert!(
        under_load["pool_heap_mib"]
            .as_f64()
            .is_some_and(|m| m > 0.1)
    );
    assert!(
        under_load["runtimes_pss_mib"]
            .as_f64()
            .is_some_and(|m| m > 10.0)
    );
    assert!(under_load["processes"].as_u64().is_some_and(|n| n >= 1));

    let summary = &report["summary"];
    for figure in SUMMARY_FIGURES {
        assert!(summary[figure].is_number(), "summary {figure}: {summary}");
    }
    assert_eq!(summary["turns"], 20);
    assert_eq!(summary["failed_turns"], 0);
    assert_eq!(summary["warm_up_turns"], 4);
    // 20 turns over 2 agents, recycled every 3: every agent's process was replaced.
    assert!(
        summary["processes_recycled"]
            .as_u64()
            .is_some_and(|n| n >= 2),
        "{summary}"
    );
    assert!(
        summary["process_spawns"].as_u64().is_some_and(|n| n >= 4),
        "{summary}"
    );
    let checks = report["checks"].as_array().expect("checks");
    assert_eq!(checks.len(), 2, "{checks:?}");
    assert!(checks.iter().all(|c| c["held"].is_boolean()));

    assert_eq!(report["png"].as_str(), Some(png.to_str().expect("utf-8")));
    let bytes = std::fs::read(&png).expect("the chart was written");
    assert!(bytes.len() > 1000, "{} bytes", bytes.len());
    assert_eq!(&bytes[..8], b"\x89PNG\r\n\x1a\n");
    assert!(stdout.contains("runtimes PSS MiB"), "{stdout}");
}
