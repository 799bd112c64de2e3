//! Prints what the pool adds on the paths a gateway waits on, against the real runtime and
//! the scripted model: a warm lease (conversation already attached), the same with a
//! transcript mirror of 10 to 10,000 entries (flat: a lease reads only what the file
//! gained), and the time from `kill -9` of a worker to a lease whose conversation is
//! resumed on the restarted worker and ready for a turn.
//!
//! Run with `cargo bench --bench pool`. Numbers are wall-clock on this machine; printed,
//! never asserted.

#[path = "../tests/support/runtime.rs"]
mod runtime;
#[path = "support/summary.rs"]
mod summary;

use std::time::{Duration, Instant};

use copilot_pool::pool::{LeaseRequest, OpenReason, Pool, PoolConfig, PoolEvent};
use copilot_pool::rpc::messages::ProviderConfig;
use copilot_pool::scripted_model::ScriptedModel;
use copilot_pool::transcript::TranscriptMode;
use copilot_pool::turn::TranscriptSettings;
use copilot_pool::worker::WorkerConfig;
use summary::summary;

const WARM: usize = 2000;
/// Warm leases per transcript size.
const MIRRORED: usize = 300;
const TRANSCRIPT_SIZES: [usize; 4] = [10, 100, 1_000, 10_000];
const CRASHES: usize = 10;

#[tokio::main]
async fn main() {
    let program = runtime::runtime_path().await;
    let model = ScriptedModel::new();
    let endpoint = model.serve_http().await.expect("model");
    let scratch = tempfile::tempdir().expect("tempdir");
    let worker = WorkerConfig::new(program, "".into(), "".into());
    let mut config = PoolConfig::new(
        worker,
        scratch.path().join("state"),
        scratch.path().join("agents"),
    );
    config.maintenance_interval = Duration::from_millis(200);
    // Crashes are on purpose here: do not quarantine the key.
    config.restart.max_restarts = 1000;
    let pool = Pool::start(config).await.expect("pool");
    let request = |key: &str| {
        let mut req = LeaseRequest::new("bench", key, scratch.path().to_path_buf());
        req.model = Some(ScriptedModel::MODEL_ID.into());
        req.provider = Some(ProviderConfig::openai(
            endpoint.base_url(),
            Some("k".into()),
        ));
        req.available_tools = Some(vec![]);
        req.streaming = false;
        req
    };

    // Warm lease: the conversation stays attached between leases.
    let mut lease = pool.lease(request("warm")).await.expect("lease");
    lease.run("REPLY=warm up").await.expect("turn");
    drop(lease);
    let mut warm = Vec::with_capacity(WARM);
    for _ in 0..WARM {
        let t = Instant::now();
        let lease = pool.lease(request("warm")).await.expect("lease");
        warm.push(t.elapsed());
        assert_eq!(lease.reason(), OpenReason::Attached);
        drop(lease);
    }
    summary("warm lease (attached)", warm);

    // Warm lease with a transcript mirror of n entries: flat in n.
    let transcripts =
        TranscriptSettings::new(scratch.path().join("transcripts"), TranscriptMode::Strict);
    for n in TRANSCRIPT_SIZES {
        let key = format!("mirrored-{n}");
        let mirrored = || {
            let mut req = request(&key);
            req.handlers.transcript = Some(transcripts.clone());
            req
        };
        let mut lease = pool.lease(mirrored()).await.expect("lease");
        lease.run("REPLY=mirrored").await.expect("turn");
        let id = lease.cli_session_id().to_owned();
        drop(lease);
        let file = scratch
            .path()
            .join("transcripts")
            .join(format!("copilot-{id}.jsonl"));
        append_entries(&file, id.as_str(), n);
        // The first lease after that outside write reads the file whole, once.
        drop(pool.lease(mirrored()).await.expect("lease"));
        let mut times = Vec::with_capacity(MIRRORED);
        for _ in 0..MIRRORED {
            let t = Instant::now();
            let lease = pool.lease(mirrored()).await.expect("lease");
            times.push(t.elapsed());
            drop(lease);
        }
        summary(&format!("warm lease, transcript of {n} entries"), times);
    }

    // Crash to resumed-and-ready.
    let mut events = pool.subscribe();
    let mut crash = Vec::new();
    for i in 0..CRASHES {
        let mut lease = pool.lease(request("crash")).await.expect("lease");
        lease
            .run(format!("REPLY=before crash {i}"))
            .await
            .expect("turn");
        let pid = lease.worker_pid();
        drop(lease);
        let t = Instant::now();
        nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(pid as i32),
            nix::sys::signal::Signal::SIGKILL,
        )
        .expect("kill");
        // The gateway's next lease arrives once the pool has seen the crash.
        loop {
            match events.recv().await {
                Ok(PoolEvent::WorkerCrashed { pid: p, .. }) if p == pid => break,
                Ok(_) => {}
                Err(e) => panic!("{e}"),
            }
        }
        let lease = pool
            .lease(request("crash"))
            .await
            .expect("lease after crash");
        crash.push(t.elapsed());
        assert_eq!(lease.reason(), OpenReason::Resumed);
        drop(lease);
    }
    summary("kill -9 → resumed lease ready", crash);
    let status = pool.status().await.expect("status");
    println!(
        "restarts {}, resumed {}",
        status.totals.restarts, status.totals.resumed
    );
    pool.shutdown().await.expect("shutdown");
}

/// Appends `n` entries to a transcript the way the mirror writes them (one JSON object a
/// line), without an fsync per line.
fn append_entries(path: &std::path::Path, session: &str, n: usize) {
    use std::io::Write;
    let file = std::fs::OpenOptions::new()
        .append(true)
        .open(path)
        .expect("transcript");
    let mut file = std::io::BufWriter::new(file);
    for i in 0..n {
        let line = serde_json::json!({
            "id": format!("bench-{i}"),
            "scope": format!("copilot:{session}"),
            "role": if i % 2 == 0 { "user" } else { "assistant" },
            "content": format!("message {i}: {}", "lorem ipsum dolor sit amet ".repeat(6)),
            "ts_ms": 1_700_000_000_000u64 + i as u64,
        });
        serde_json::to_writer(&mut file, &line).expect("write");
        file.write_all(b"\n").expect("write");
    }
    file.flush().expect("flush");
}
