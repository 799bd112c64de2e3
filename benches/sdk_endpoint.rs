//! The same workload through the official Node SDK two ways, against the real runtime and the
//! scripted model: attached by URL to copilot-pool's SDK endpoint (one connection token per
//! agent), and spawning its own runtime per agent (the SDK's default way). For each it prints
//! the cold first event (a new client to the first event of its first turn, the runtime's
//! start included), the warm turn (one session, turns one after another), turns per second
//! with every session of every agent busy at once, the resident memory of the runtime
//! processes, and the time from `kill -9` of every runtime process to a successful turn on
//! each agent's session (the pool resumes it by itself; the SDK alone needs a new client, a
//! new runtime and `resumeSession`). The workload is `benches/support/sdk_bench.mjs`.
//!
//! Run with `cargo bench --bench sdk_endpoint`. Numbers are wall-clock on this machine;
//! printed, never asserted.

#[path = "../tests/support/node_sdk.rs"]
mod node_sdk;
#[path = "../tests/support/runtime.rs"]
mod runtime;
#[path = "support/summary.rs"]
mod summary;

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use copilot_pool::pool::{Pool, PoolConfig};
use copilot_pool::scripted_model::ScriptedModel;
use copilot_pool::sdk_endpoint::{self, AgentTokens, SdkConfig, SdkEndpoint};
use copilot_pool::secret::Secret;
use copilot_pool::worker::WorkerConfig;
use serde_json::Value;
use summary::summary;
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::sync::watch;

const AGENTS: usize = 4;
const SESSIONS: usize = 2;
const WARM_TURNS: usize = 50;
const LOAD_TURNS: usize = 10;
/// A failure guard for one line of the workload, not a measurement.
const STEP_LIMIT: Duration = Duration::from_secs(300);

/// What one way of running the workload measured.
struct Measured {
    cold: Vec<Duration>,
    warm: Vec<Duration>,
    turns_per_sec: f64,
    processes: usize,
    rss_bytes: u64,
    ready: Vec<Duration>,
}

enum Mode<'a> {
    Pool { pool: &'a Pool, url: String },
    Direct { runtime: &'a Path, homes: PathBuf },
}

#[tokio::main]
async fn main() {
    let program = runtime::runtime_path().await;
    let sdk = node_sdk::sdk_dir().await;
    let model = ScriptedModel::new();
    let endpoint = model.serve_http().await.expect("model");
    let model_url = endpoint.base_url();
    let scratch = tempfile::tempdir().expect("tempdir");

    // Through the pool.
    let mut config = PoolConfig::new(
        WorkerConfig::new(program.clone(), "".into(), "".into()),
        scratch.path().join("state"),
        scratch.path().join("agents"),
    );
    config.maintenance_interval = Duration::from_millis(200);
    config.restart.max_restarts = 1000;
    let pool = Pool::start(config).await.expect("pool");
    let mut tokens = AgentTokens::new();
    for a in 0..AGENTS {
        tokens
            .add_token(
                &format!("agent-{a}"),
                &Secret::new(format!("bench-token-{a}")),
            )
            .expect("token");
    }
    let sdk_endpoint = SdkEndpoint::new(pool.clone(), SdkConfig::new(tokens));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let url = listener.local_addr().expect("addr").to_string();
    let (stop, mut stopped) = watch::channel(false);
    let served = sdk_endpoint.clone();
    let server = tokio::spawn(async move {
        sdk_endpoint::serve_tcp(&served, listener, async move {
            let _ = stopped.wait_for(|s| *s).await;
        })
        .await;
    });
    let pooled = run(&sdk, &model_url, Mode::Pool { pool: &pool, url }).await;
    stop.send_replace(true);
    let _ = tokio::time::timeout(Duration::from_secs(20), server).await;
    pool.shutdown().await.expect("shutdown");

    // The SDK spawning its own runtime per agent.
    let direct = run(
        &sdk,
        &model_url,
        Mode::Direct {
            runtime: &program,
            homes: scratch.path().join("direct"),
        },
    )
    .await;

    println!(
        "workload: {AGENTS} agents x {SESSIONS} sessions, {WARM_TURNS} warm turns, \
         {LOAD_TURNS} turns per session under load (Node SDK {})",
        node_sdk::VERSION
    );
    for (name, m) in [("pool (by URL)", pooled), ("direct (own runtime)", direct)] {
        summary(&format!("{name}: cold first event"), m.cold);
        summary(&format!("{name}: warm turn"), m.warm);
        println!(
            "{:<34} {:.1} turns/s",
            format!("{name}: load"),
            m.turns_per_sec
        );
        println!(
            "{:<34} {} processes, {:.0} MiB RSS",
            format!("{name}: runtime memory"),
            m.processes,
            m.rss_bytes as f64 / (1 << 20) as f64
        );
        summary(&format!("{name}: kill -9 to ready"), m.ready);
    }
}

/// Runs the workload once and measures it.
async fn run(sdk: &Path, model_url: &str, mode: Mode<'_>) -> Measured {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("benches/support/sdk_bench.mjs");
    let mut command = tokio::process::Command::new("node");
    command
        .arg(script)
        .env("SDK_DIR", sdk)
        .env("AGENTS", AGENTS.to_string())
        .env("SESSIONS", SESSIONS.to_string())
        .env("WARM_TURNS", WARM_TURNS.to_string())
        .env("LOAD_TURNS", LOAD_TURNS.to_string())
        .env("MODEL_URL", model_url)
        .env("MODEL_ID", ScriptedModel::MODEL_ID)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .process_group(0)
        .kill_on_drop(true);
    match &mode {
        Mode::Pool { url, .. } => {
            command
                .env("MODE", "pool")
                .env("SDK_URL", url)
                .env("TOKEN_PREFIX", "bench-token-");
        }
        Mode::Direct { runtime, homes } => {
            command
                .env("MODE", "direct")
                .env("RUNTIME", runtime)
                .env("HOMES", homes);
        }
    }
    let mut child = command.spawn().expect("node (Node.js must be installed)");
    let group = child.id().expect("pid");
    let mut stdin = child.stdin.take().expect("stdin");
    let mut lines = BufReader::new(child.stdout.take().expect("stdout")).lines();
    let mut measured = Measured {
        cold: Vec::new(),
        warm: Vec::new(),
        turns_per_sec: 0.0,
        processes: 0,
        rss_bytes: 0,
        ready: Vec::new(),
    };
    loop {
        let line = tokio::time::timeout(STEP_LIMIT, lines.next_line())
            .await
            .expect("the workload goes on")
            .expect("read")
            .expect("the workload ended early");
        let value: Value = serde_json::from_str(&line).expect("a JSON line");
        if let Some(error) = value.get("error") {
            panic!("the workload failed: {error}");
        }
        let ms = |v: &Value| Duration::from_secs_f64(v.as_f64().unwrap_or(0.0) / 1000.0);
        let list = |v: &Value| v.as_array().map(|a| a.iter().map(ms).collect::<Vec<_>>());
        match value["step"].as_str() {
            Some("cold") => measured.cold.push(ms(&value["ms"])),
            Some("warm") => measured.warm = list(&value["ms"]).unwrap_or_default(),
            Some("load") => {
                let turns = value["turns"].as_f64().unwrap_or(0.0);
                measured.turns_per_sec = turns / ms(&value["ms"]).as_secs_f64().max(1e-9);
            }
            Some("memory") => {
                let pids = runtime_pids(&mode, &value).await;
                measured.processes = pids.len();
                measured.rss_bytes = pids
                    .iter()
                    .filter_map(|pid| copilot_pool::process::rss_bytes(*pid))
                    .sum();
                stdin.write_all(b"measured\n").await.expect("stdin");
            }
            Some("kill") => {
                for pid in runtime_pids(&mode, &value).await {
                    let _ = nix::sys::signal::kill(
                        nix::unistd::Pid::from_raw(pid as i32),
                        nix::sys::signal::Signal::SIGKILL,
                    );
                }
                stdin.write_all(b"killed\n").await.expect("stdin");
            }
            Some("ready") => measured.ready = list(&value["ms"]).unwrap_or_default(),
            _ if value["done"] == true => break,
            _ => panic!("unexpected line {line}"),
        }
    }
    let _ = tokio::time::timeout(Duration::from_secs(30), child.wait()).await;
    // Whatever the workload left in its group (direct: runtimes it spawned) goes too.
    let _ = nix::sys::signal::killpg(
        nix::unistd::Pid::from_raw(group as i32),
        nix::sys::signal::Signal::SIGKILL,
    );
    measured
}

/// The runtime processes of the workload: the pool's workers, or the pids the SDK reported.
async fn runtime_pids(mode: &Mode<'_>, line: &Value) -> Vec<u32> {
    match mode {
        Mode::Pool { pool, .. } => pool
            .status()
            .await
            .map(|s| s.workers.iter().map(|w| w.pid).collect())
            .unwrap_or_default(),
        Mode::Direct { .. } => line["pids"]
            .as_array()
            .map(|a| {
                a.iter()
                    .filter_map(|p| p.as_u64())
                    .map(|p| p as u32)
                    .collect()
            })
            .unwrap_or_default(),
    }
}
