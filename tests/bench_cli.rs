//! End-to-end: `copilot-pool bench` at its smallest size runs all four modes and its JSON
//! object carries every figure of every mode and every ratio to the SDK alone,
//! the returning agent's (after its process went away) included.

mod support;

use std::process::Command;

use serde_json::Value;

/// The figures every mode reports; the pool's own only exist where there is a pool.
const FIGURES: [&str; 16] = [
    "turns_per_second",
    "cold_first_event_p50_ms",
    "first_idle_p50_ms",
    "warm_turn_p50_ms",
    "warm_turn_p99_ms",
    "runtime_cpu_per_turn_ms",
    "pool_cpu_per_turn_ms",
    "gateway_cpu_per_turn_ms",
    "runtime_peak_pss_mib",
    "runtime_peak_pss_after_load_mib",
    "pool_peak_pss_mib",
    "kill_to_ready_ms",
    "returning_first_event_p50_ms",
    "returning_first_idle_p50_ms",
    "returning_on_spare_percent",
    "spare_pss_mib",
];
const POOL_ONLY: [&str; 4] = [
    "pool_cpu_per_turn_ms",
    "pool_peak_pss_mib",
    "returning_on_spare_percent",
    "spare_pss_mib",
];

#[tokio::test]
async fn a_tiny_bench_reports_every_figure_of_every_mode_as_json() {
    let runtime = support::runtime::runtime_path().await;
    support::node_sdk::sdk_dir().await;
    let scratch = tempfile::tempdir().expect("tempdir");
    let trace = scratch.path().join("trace.jsonl");
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
        "--trace",
    ]);
    cmd.arg(&trace);
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
    each_turn_traced_from_its_prompt(&trace);
}

/// The trace has every mode's turns (both load turns, the return, the turn after the kill),
/// each sent, then ready, then its first event, then ended; and every mode's first event is
/// one the prompt caused, never the session's own `session.start` / `session.resume` the SDK
/// hands over as a session opens.
fn each_turn_traced_from_its_prompt(trace: &std::path::Path) {
    let text = std::fs::read_to_string(trace).expect("the trace file");
    let lines: Vec<Value> = text
        .lines()
        .map(|l| serde_json::from_str(l).expect("a JSON line"))
        .collect();
    for mode in ["http", "endpoint", "resume", "attached"] {
        for (phase, turn) in [("load", 0), ("load", 1), ("return", 0)] {
            let line = lines
                .iter()
                .find(|l| l["mode"] == mode && l["phase"] == phase && l["turn"] == turn)
                .unwrap_or_else(|| panic!("no {mode} {phase} turn {turn} in {text}"));
            let at = |k: &str| {
                line[k]
                    .as_f64()
                    .unwrap_or_else(|| panic!("{mode} {phase} {turn}: no {k} in {line}"))
            };
            assert!(
                at("sent") <= at("ready") && at("ready") <= at("first") && at("first") <= at("end"),
                "{line}"
            );
            let first = line["first_type"].as_str().unwrap_or_default();
            assert!(
                !first.is_empty() && !first.starts_with("session."),
                "{mode} {phase} {turn}: first event {first}"
            );
        }
        assert!(
            lines
                .iter()
                .any(|l| l["mode"] == mode && l["phase"] == "kill"),
            "no {mode} turn after the kill in {text}"
        );
    }
}

#[tokio::test]
async fn an_interrupted_bench_stops_its_daemon_workload_and_runtimes() {
    let runtime = support::runtime::runtime_path().await;
    support::node_sdk::sdk_dir().await;
    let child = tokio::process::Command::new(env!("CARGO_BIN_EXE_copilot-pool"))
        .env("COPILOT_CLI_PATH", &runtime)
        .args(["bench", "--agents", "1", "--conversations", "1"])
        .args(["--turns", "2", "--pairs", "1", "--attempt-secs", "5"])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("start the bench");
    let bench = child.id().expect("the bench's pid");
    // Its children lead their own process groups, out of reach of a terminal's Ctrl-C: the
    // bench must stop them itself. Interrupted once a runtime serves (`--headless`, not the
    // bench's check of its version) under it.
    let serving = || {
        let under = support::procs::descendants(bench);
        support::procs::with_cmdline_containing("--headless")
            .into_iter()
            .filter(|pid| under.contains(pid))
            .collect()
    };
    let runtimes = support::procs::wait_some(serving, std::time::Duration::from_secs(120)).await;
    assert!(
        !runtimes.is_empty(),
        "no runtime under the bench within 120 s"
    );
    let under = support::procs::descendants(bench);
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(bench as i32),
        nix::sys::signal::Signal::SIGINT,
    )
    .expect("SIGINT");
    let out = tokio::time::timeout(std::time::Duration::from_secs(30), child.wait_with_output())
        .await
        .expect("the bench, and every child holding its stderr, exits on SIGINT")
        .expect("its output");
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("interrupted by SIGINT"), "{stderr}");
    let left = support::procs::wait_none(
        || support::procs::alive(&under),
        std::time::Duration::from_secs(10),
    )
    .await;
    assert!(
        left.is_empty(),
        "left behind by the bench: {left:?} of {under:?}"
    );
}
