//! End-to-end: `copilot-pool chaos` and `copilot-pool load` at a small size, so they never rot.
//! The chaos run (HTTP and SDK endpoint conversations) must inject faults of many kinds within
//! its turns and report every invariant held (memory and descriptors back to their baseline
//! among them); the load run must finish its turns and leave the idle daemon where warm-up
//! left it (live heap, resident memory, descriptors, tasks).

mod support;

use std::process::{Command, Output};

use serde_json::Value;

fn bin() -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_copilot-pool"));
    cmd.env_remove("COPILOT_POOL_LOG");
    cmd
}

async fn output(mut cmd: Command) -> Output {
    tokio::task::spawn_blocking(move || cmd.output().expect("run copilot-pool"))
        .await
        .expect("join")
}

/// The JSON object a run printed as its last stdout line.
fn report(out: &Output) -> Value {
    let stdout = String::from_utf8_lossy(&out.stdout);
    let last = stdout.lines().last().unwrap_or_default();
    serde_json::from_str(last).unwrap_or_else(|e| {
        panic!(
            "no JSON report ({e}):\n{stdout}\n{}",
            String::from_utf8_lossy(&out.stderr)
        )
    })
}

#[tokio::test]
async fn a_small_chaos_run_injects_faults_and_holds_every_invariant() {
    let runtime = support::runtime::runtime_path().await;
    let mut cmd = bin();
    cmd.env("COPILOT_CLI_PATH", &runtime).args([
        "chaos",
        "--agents",
        "2",
        "--sdk-agents",
        "1",
        "--conversations",
        "2",
        "--turns",
        "10000",
        "--max-seconds",
        "25",
        "--fault-every-ms",
        "250",
        "--seed",
        "2026",
        "--json",
    ]);
    let out = output(cmd).await;
    let report = report(&out);
    let invariants = report["invariants"].as_array().expect("invariants");
    assert!(invariants.len() >= 9, "{report}");
    for invariant in invariants {
        assert_eq!(invariant["held"], true, "{invariant}");
    }
    assert!(out.status.success(), "{report}");
    let faults = &report["faults_injected"];
    let injected: u64 = faults
        .as_object()
        .expect("faults")
        .values()
        .filter_map(Value::as_u64)
        .sum();
    assert!(injected >= 20, "{faults}");
    assert!(faults["kill"].as_u64() >= Some(1), "{faults}");
    assert!(report["ends"]["idle"].as_u64() >= Some(10), "{report}");
    // The checks had something to check: model requests and transcripts were read.
    let detail = |name: &str| {
        invariants
            .iter()
            .find(|i| i["name"] == name)
            .and_then(|i| i["detail"].as_str())
            .unwrap_or_default()
            .to_owned()
    };
    let memory = detail("memory back to its baseline");
    assert!(memory.contains("live heap"), "{memory}");
    let histories = detail("no conversation lost its history");
    assert!(!histories.contains(" of 0 model requests"), "{histories}");
    let transcripts = detail("no duplicate or torn transcript line");
    assert!(!transcripts.contains(" in 0 transcripts"), "{transcripts}");
    // The SDK endpoint's conversations ran through the same storm.
    assert!(report["sdk_ends"]["idle"].as_u64() >= Some(3), "{report}");
}

#[tokio::test]
async fn a_small_load_run_finishes_its_turns_and_leaves_the_idle_daemon_where_warm_up_left_it() {
    let runtime = support::runtime::runtime_path().await;
    let mut cmd = bin();
    cmd.env("COPILOT_CLI_PATH", &runtime).args([
        "load",
        "--clients",
        "8",
        "--agents",
        "2",
        "--turns",
        "60",
        "--json",
    ]);
    let out = output(cmd).await;
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let report = report(&out);
    assert_eq!(report["turns"], 60, "{report}");
    assert_eq!(report["failed_turns"], 0, "{report}");
    assert!(report["end"]["rss_bytes"].as_u64() > Some(0), "{report}");
    assert!(report["end"]["tasks"].as_u64() > Some(0), "{report}");
    // The heap is the daemon's own reading, not a default.
    assert!(
        report["after_warm_up"]["heap_bytes"].as_u64() > Some(1 << 20),
        "{report}"
    );
    let checks = report["checks"].as_array().expect("checks");
    let names: Vec<&str> = checks.iter().filter_map(|c| c["name"].as_str()).collect();
    for name in [
        "live heap flat after warm-up",
        "resident memory flat after warm-up",
        "descriptors flat after warm-up",
        "tasks flat after warm-up",
    ] {
        assert!(names.contains(&name), "{name} missing from {names:?}");
    }
    assert!(checks.iter().all(|c| c["held"] == true), "{report}");
}

#[tokio::test]
async fn a_load_run_whose_daemon_is_killed_ends_at_once_saying_so() {
    use tokio::io::AsyncBufReadExt;
    let runtime = support::runtime::runtime_path().await;
    let mut cmd = tokio::process::Command::new(env!("CARGO_BIN_EXE_copilot-pool"));
    cmd.env_remove("COPILOT_POOL_LOG")
        .env("COPILOT_CLI_PATH", &runtime)
        .args([
            "load",
            "--clients",
            "2",
            "--agents",
            "1",
            "--turns",
            "1000000",
        ])
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true);
    let mut load = cmd.spawn().expect("start load");
    let mut lines = tokio::io::BufReader::new(load.stderr.take().expect("stderr")).lines();
    let mut said = Vec::new();
    // Its daemon's pid, from its first line (`load: daemon <pid> on …`); then the warm-up.
    let daemon = loop {
        let line = lines
            .next_line()
            .await
            .expect("read")
            .expect("load said nothing");
        said.push(line.clone());
        if let Some(pid) = line
            .strip_prefix("load: daemon ")
            .and_then(|rest| rest.split_whitespace().next())
            .and_then(|pid| pid.parse::<i32>().ok())
        {
            break pid;
        }
    };
    while let Some(line) = lines.next_line().await.expect("read") {
        let warmed = line.starts_with("load: warmed up");
        said.push(line);
        if warmed {
            break;
        }
    }
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(daemon),
        nix::sys::signal::Signal::SIGKILL,
    )
    .expect("kill the daemon");
    // A failure guard, not a wait: the run ends as its daemon's exit is seen.
    let status = tokio::time::timeout(std::time::Duration::from_secs(20), load.wait())
        .await
        .unwrap_or_else(|_| panic!("load still running 20 s after its daemon died: {said:?}"))
        .expect("wait");
    while let Ok(Some(line)) = lines.next_line().await {
        said.push(line);
    }
    assert!(!status.success(), "{said:?}");
    assert!(
        said.iter()
            .any(|l| l.contains("the daemon exited during the load") && l.contains("signal")),
        "{said:?}"
    );
}
