//! The pool's own cost, with the runtime taken out: a synthetic peer (`tests/support/
//! fake_runtime.mjs` in its `flood` mode) answers every `session.send` with a burst of
//! `assistant.message_delta` events written at once, so what is measured is copilot-pool's
//! side of one process's pipe: `Content-Length` framing, JSON-RPC decoding, event decoding,
//! the worker's dispatch to the session named, and (at the pool level) the lease's turn
//! bookkeeping on every event.
//!
//! For 1, 4 and 16 conversations at once on one process it prints the events per second that
//! reach the consumers (send of every turn → the last `session.idle`) and the CPU the bench
//! process (the pool's side, its consumers included) spends per event, beside the peer's.
//!
//! Run with `cargo bench --bench routing`. Numbers are printed, never asserted.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use copilot_pool::pool::{LeaseRequest, Pool, PoolConfig};
use copilot_pool::rpc::EventKind;
use copilot_pool::rpc::messages::SessionConfig;
use copilot_pool::worker::{Session, SessionUpdate, WorkerConfig, WorkerHandle};
use nix::sys::resource::{UsageWho, getrusage};

/// Events the peer sends per turn.
const EVENTS_PER_TURN: usize = 20_000;
/// Turns measured per conversation (after one warm-up turn that frames the peer's burst).
const TURNS: usize = 5;
const CONVERSATIONS: [usize; 3] = [1, 4, 16];

/// CPU seconds this process has used (user + system).
fn own_cpu() -> f64 {
    let usage = getrusage(UsageWho::RUSAGE_SELF).expect("getrusage");
    let (u, s) = (usage.user_time(), usage.system_time());
    u.tv_sec() as f64 + u.tv_usec() as f64 / 1e6 + s.tv_sec() as f64 + s.tv_usec() as f64 / 1e6
}

/// CPU seconds `pid` has used (user + system), from `/proc/<pid>/stat` in clock ticks.
fn process_cpu(pid: u32) -> f64 {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return 0.0;
    };
    let Some(close) = stat.rfind(')') else {
        return 0.0;
    };
    let fields: Vec<&str> = stat[close + 1..].split_whitespace().collect();
    // After the name: state is field 3, utime 14 and stime 15 (1-based, whole line).
    let ticks = |i: usize| fields.get(i - 3).and_then(|f| f.parse::<f64>().ok());
    let hz = nix::unistd::sysconf(nix::unistd::SysconfVar::CLK_TCK)
        .ok()
        .flatten()
        .unwrap_or(100) as f64;
    (ticks(14).unwrap_or(0.0) + ticks(15).unwrap_or(0.0)) / hz
}

/// A wrapper script that starts the synthetic peer in flood mode.
fn peer_script(dir: &Path) -> PathBuf {
    let fake = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/support/fake_runtime.mjs");
    let script = dir.join("flood-peer.sh");
    std::fs::write(
        &script,
        format!(
            "#!/bin/sh\nFAKE_RUNTIME_MODE=flood FAKE_RUNTIME_FLOOD_EVENTS={EVENTS_PER_TURN} \
             exec node '{}' \"$@\"\n",
            fake.display()
        ),
    )
    .expect("peer script");
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    script
}

/// One measured figure: events that reached the consumers, wall time, and CPU of both sides.
struct Measured {
    events: usize,
    wall: Duration,
    pool_cpu: f64,
    peer_cpu: f64,
}

impl Measured {
    fn print(&self, level: &str, conversations: usize) {
        let rate = self.events as f64 / self.wall.as_secs_f64();
        println!(
            "{level:<7} {conversations:>3} conversations: {:>9.0} events/s, pool {:>5.2} µs CPU/event, \
             peer {:>5.2} µs CPU/event ({} events in {:.2?})",
            rate,
            self.pool_cpu / self.events as f64 * 1e6,
            self.peer_cpu / self.events as f64 * 1e6,
            self.events,
            self.wall,
        );
    }
}

/// Starts the conversations' turns (each task returns the deltas it saw) and measures them:
/// the events, the wall time, and the CPU of this process and of the peer `pid`.
async fn measure(
    pid: u32,
    start: impl FnOnce() -> Vec<tokio::task::JoinHandle<usize>>,
) -> Measured {
    let (cpu0, peer0, started) = (own_cpu(), process_cpu(pid), Instant::now());
    let mut events = 0;
    for run in futures_util::future::join_all(start()).await {
        events += run.expect("turns");
    }
    Measured {
        events,
        wall: started.elapsed(),
        pool_cpu: own_cpu() - cpu0,
        peer_cpu: process_cpu(pid) - peer0,
    }
}

/// Reads one turn's updates on a worker session; returns the deltas seen.
async fn worker_turn(session: &mut Session) -> usize {
    let mut deltas = 0;
    while let Some(update) = session.next().await {
        match update {
            SessionUpdate::Event(e) => match e.kind {
                EventKind::AssistantMessageDelta(_) => deltas += 1,
                EventKind::SessionIdle(_) => return deltas,
                _ => {}
            },
            SessionUpdate::Ended(err) => panic!("worker ended: {err}"),
            _ => {}
        }
    }
    panic!("session stream ended before idle")
}

async fn worker_level(dir: &Path, peer: &Path, conversations: usize) -> Measured {
    let home = dir.join(format!("worker-{conversations}"));
    std::fs::create_dir_all(&home).expect("home");
    let mut config = WorkerConfig::new(peer.to_path_buf(), home.clone(), dir.to_path_buf());
    config.extra_env = vec![("HOME".into(), home.display().to_string())];
    let worker = WorkerHandle::start(config).await.expect("peer starts");
    let mut sessions = Vec::new();
    for _ in 0..conversations {
        let mut session = worker
            .create_session(SessionConfig::default())
            .await
            .expect("create");
        // Warm-up: the peer frames its burst for this session once.
        session.send("warm up").await.expect("send");
        worker_turn(&mut session).await;
        sessions.push(session);
    }
    let measured = measure(worker.pid(), || {
        sessions
            .into_iter()
            .map(|mut session| {
                tokio::spawn(async move {
                    let mut events = 0;
                    for i in 0..TURNS {
                        session.send(format!("turn {i}")).await.expect("send");
                        events += worker_turn(&mut session).await;
                    }
                    events
                })
            })
            .collect()
    })
    .await;
    worker.shutdown().await;
    measured
}

async fn pool_level(dir: &Path, peer: &Path, conversations: usize) -> Measured {
    let base = dir.join(format!("pool-{conversations}"));
    let mut config = PoolConfig::new(
        WorkerConfig::new(peer.to_path_buf(), "".into(), "".into()),
        base.join("state"),
        base.join("agents"),
    );
    config.max_sessions_per_process = conversations;
    config.max_processes_per_key = 1;
    let pool = Pool::start(config).await.expect("pool");
    let mut leases = Vec::new();
    for c in 0..conversations {
        let request = LeaseRequest::new("agent", format!("conversation-{c}"), base.clone());
        let mut lease = pool.lease(request).await.expect("lease");
        lease.send("warm up").await.expect("send");
        while let Some(event) = lease.next_event().await {
            if matches!(event.expect("event").kind, EventKind::SessionIdle(_)) {
                break;
            }
        }
        leases.push(lease);
    }
    let pid = leases.first().map(|l| l.worker_pid()).unwrap_or(0);
    let measured = measure(pid, || {
        leases
            .into_iter()
            .map(|mut lease| {
                tokio::spawn(async move {
                    let mut events = 0;
                    for i in 0..TURNS {
                        lease.send(format!("turn {i}")).await.expect("send");
                        while let Some(event) = lease.next_event().await {
                            match event.expect("event").kind {
                                EventKind::AssistantMessageDelta(_) => events += 1,
                                EventKind::SessionIdle(_) => break,
                                _ => {}
                            }
                        }
                    }
                    events
                })
            })
            .collect()
    })
    .await;
    pool.shutdown().await.expect("shutdown");
    measured
}

#[tokio::main]
async fn main() {
    let scratch = tempfile::tempdir().expect("tempdir");
    let peer = peer_script(scratch.path());
    println!(
        "synthetic peer: {EVENTS_PER_TURN} assistant.message_delta events per turn, \
         {TURNS} turns per conversation, one process"
    );
    for conversations in CONVERSATIONS {
        worker_level(scratch.path(), &peer, conversations)
            .await
            .print("worker", conversations);
        pool_level(scratch.path(), &peer, conversations)
            .await
            .print("pool", conversations);
    }
}
