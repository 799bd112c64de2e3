//! End-to-end: what happens when the child dies, hangs or misbehaves. Crash cases use the
//! real runtime; malformed frames and protocol faults the real one cannot produce use a
//! small fault-injecting fake peer written in `sh` (the only fake CLI in the test suite).

mod support;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use copilot_pool::kinds::TurnEnd;
use copilot_pool::pool::{OpenReason, Pool, PoolError, PoolEvent};
use copilot_pool::process::ExitInfo;
use copilot_pool::rpc::EventKind;
use copilot_pool::rpc::messages::SessionConfig;
use copilot_pool::scripted_model::ScriptedModel;
use copilot_pool::turn::TurnError;
use copilot_pool::worker::{
    ExitReason, SessionUpdate, WorkerConfig, WorkerError, WorkerExit, WorkerHandle,
};
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use ractor::{Actor, ActorProcessingErr, ActorRef, SupervisionEvent};
use support::pool_fixture::{Fixture, shutdown_leaves_nothing, wait_event};
use support::procs::wait_group_gone;
use support::{Scratch, event_where, session_config, worker_config};
use tokio::sync::mpsc;

/// A supervisor that reports every supervision event it gets.
struct Recorder;

impl Actor for Recorder {
    type Msg = ();
    type State = mpsc::UnboundedSender<SupervisionEvent>;
    type Arguments = mpsc::UnboundedSender<SupervisionEvent>;

    async fn pre_start(
        &self,
        _: ActorRef<()>,
        tx: Self::Arguments,
    ) -> Result<Self::State, ActorProcessingErr> {
        Ok(tx)
    }

    async fn handle_supervisor_evt(
        &self,
        _: ActorRef<()>,
        event: SupervisionEvent,
        tx: &mut Self::State,
    ) -> Result<(), ActorProcessingErr> {
        let _ = tx.send(event);
        Ok(())
    }
}

async fn recorder() -> (ActorRef<()>, mpsc::UnboundedReceiver<SupervisionEvent>) {
    let (tx, rx) = mpsc::unbounded_channel();
    let (actor, _) = Actor::spawn(None, Recorder, tx).await.expect("recorder");
    (actor, rx)
}

/// The reason a linked worker reported when it failed.
async fn failure_reported(events: &mut mpsc::UnboundedReceiver<SupervisionEvent>) -> WorkerExit {
    loop {
        match tokio::time::timeout(Duration::from_secs(30), events.recv()).await {
            Ok(Some(SupervisionEvent::ActorFailed(_, err))) => {
                return err
                    .downcast_ref::<WorkerExit>()
                    .cloned()
                    .unwrap_or_else(|| panic!("failure is not a WorkerExit: {err}"));
            }
            Ok(Some(SupervisionEvent::ActorTerminated(_, _, reason))) => {
                panic!("worker terminated normally ({reason:?}) instead of failing")
            }
            Ok(Some(_)) => continue,
            Ok(None) | Err(_) => panic!("no supervision event"),
        }
    }
}

#[tokio::test]
async fn kill_9_mid_turn_fails_the_turn_fast_and_leaves_no_process() {
    let scratch = Scratch::new();
    let model = ScriptedModel::new();
    let endpoint = model.serve_http().await.expect("model endpoint");
    let (supervisor, mut supervision) = recorder().await;
    let worker =
        WorkerHandle::start_supervised(worker_config(&scratch).await, supervisor.get_cell())
            .await
            .expect("worker starts");
    let pid = worker.pid();
    let mut session = worker
        .create_session(SessionConfig {
            streaming: true,
            ..session_config(&endpoint.base_url(), &scratch)
        })
        .await
        .expect("session");
    session
        .send("SCENARIO:slow SLOW=300x100")
        .await
        .expect("send");
    event_where(&mut session, |kind| {
        matches!(kind, EventKind::AssistantMessageDelta(_)).then_some(())
    })
    .await;

    let killed_at = Instant::now();
    kill(Pid::from_raw(pid as i32), Signal::SIGKILL).expect("kill -9");
    let error = loop {
        match tokio::time::timeout(Duration::from_secs(10), session.next()).await {
            Ok(Some(SessionUpdate::Ended(error))) => break error,
            Ok(Some(_)) => continue,
            Ok(None) => panic!("stream closed without Ended"),
            Err(_) => panic!("the caller was not told within 10 s"),
        }
    };
    let waited = killed_at.elapsed();
    println!("kill -9 → typed error after {waited:?}");
    assert!(waited < Duration::from_millis(500), "took {waited:?}");
    let WorkerError::Died(exit) = &error else {
        panic!("unexpected error {error}")
    };
    assert_eq!(exit.exit_info(), Some(ExitInfo::Signal(9)), "{exit}");
    assert_eq!(exit.pid, pid);
    assert!(error.to_string().contains("signal 9"), "{error}");

    // Later calls fail with the same typed error instead of hanging.
    let later = session
        .send("anyone there?")
        .await
        .expect_err("dead worker");
    assert!(matches!(later, WorkerError::Died(_)), "{later}");

    // The supervisor learns why the worker ended.
    let reported = failure_reported(&mut supervision).await;
    assert_eq!(reported.exit_info(), Some(ExitInfo::Signal(9)));

    let left = wait_group_gone(pid, Duration::from_secs(5)).await;
    assert!(left.is_empty(), "processes left in group {pid}: {left:?}");
    supervisor.stop(None);
}

/// Waits until every thread of `pid` is in the stopped state: a SIGSTOP reaches a running
/// thread of a multi-threaded runtime a little after `kill` returns, and until then it may
/// still answer. No event tells a non-parent of a stop, so `/proc` is read (bounded).
async fn wait_all_threads_stopped(pid: Pid) {
    let deadline = Instant::now() + Duration::from_secs(5);
    let stopped = || -> bool {
        let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
            return false;
        };
        tasks.flatten().all(|task| {
            std::fs::read_to_string(task.path().join("stat"))
                .ok()
                .and_then(|stat| {
                    // The state follows the command name's closing parenthesis.
                    let after = &stat[stat.rfind(')')? + 1..];
                    after
                        .split_whitespace()
                        .next()
                        .map(|s| s == "T" || s == "t")
                })
                .unwrap_or(false)
        })
    };
    while !stopped() {
        assert!(Instant::now() < deadline, "{pid} did not stop within 5 s");
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

#[tokio::test]
async fn an_in_flight_request_fails_with_the_exit_status() {
    let scratch = Scratch::new();
    let worker = WorkerHandle::start(worker_config(&scratch).await)
        .await
        .expect("worker starts");
    let pid = Pid::from_raw(worker.pid() as i32);
    // A stopped process reads nothing: the ping stays in flight until the kill.
    kill(pid, Signal::SIGSTOP).expect("stop");
    wait_all_threads_stopped(pid).await;
    let mut ping = tokio::spawn({
        let worker = worker.clone();
        async move { worker.ping().await }
    });
    // The stopped runtime cannot answer: the ping is still waiting after a while.
    let early = tokio::time::timeout(Duration::from_millis(100), &mut ping).await;
    assert!(early.is_err(), "answered while stopped: {early:?}");
    assert_eq!(worker.pending_requests(), 1);
    kill(pid, Signal::SIGKILL).expect("kill");
    let error = tokio::time::timeout(Duration::from_secs(5), ping)
        .await
        .expect("ping failed fast")
        .expect("task")
        .expect_err("ping to a killed runtime");
    let WorkerError::Died(exit) = &error else {
        panic!("unexpected error {error}")
    };
    assert_eq!(exit.exit_info(), Some(ExitInfo::Signal(9)));
    let left = wait_group_gone(worker.pid(), Duration::from_secs(5)).await;
    assert!(left.is_empty(), "{left:?}");
}

#[tokio::test]
async fn a_hung_runtime_is_detected_by_health_pings_and_killed() {
    let scratch = Scratch::new();
    let mut config = worker_config(&scratch).await;
    config.health_interval = Duration::from_millis(200);
    config.health_timeout = Duration::from_millis(150);
    config.health_misses = 1;
    config.kill_grace = Duration::from_millis(300);
    let (supervisor, mut supervision) = recorder().await;
    let worker = WorkerHandle::start_supervised(config, supervisor.get_cell())
        .await
        .expect("worker starts");
    kill(Pid::from_raw(worker.pid() as i32), Signal::SIGSTOP).expect("stop");
    let exit = tokio::time::timeout(Duration::from_secs(10), worker.ended())
        .await
        .expect("hang detected");
    assert_eq!(
        exit.reason,
        ExitReason::Hung {
            misses: 1,
            timeout: Duration::from_millis(150)
        },
        "{exit}"
    );
    let reported = failure_reported(&mut supervision).await;
    assert!(matches!(reported.reason, ExitReason::Hung { .. }));
    // A stopped process does not act on SIGTERM; the group must still be gone (SIGKILL).
    let left = wait_group_gone(worker.pid(), Duration::from_secs(5)).await;
    assert!(left.is_empty(), "{left:?}");
    supervisor.stop(None);
}

#[tokio::test]
async fn a_runtime_stopped_mid_turn_is_declared_hung_within_two_intervals_and_the_turn_ends_crashed()
 {
    let fx = Fixture::new().await;
    let mut config = fx.config().await;
    let interval = Duration::from_millis(400);
    let timeout = Duration::from_millis(250);
    config.worker.health_interval = interval;
    config.worker.health_timeout = timeout;
    config.worker.health_misses = 2;
    let pool = Pool::start(config).await.expect("pool");
    let mut events = pool.subscribe();
    let mut request = fx.request("agent-h", "conv");
    request.streaming = true;
    let mut lease = pool.lease(request).await.expect("lease");
    let pid = lease.worker_pid();
    lease
        .send("SCENARIO:slow SLOW=200x100")
        .await
        .expect("a slow turn starts");
    // Mid-turn: the first delta has arrived (the model streams one every 100 ms for 20 s).
    loop {
        let event = tokio::time::timeout(Duration::from_secs(30), lease.next_event())
            .await
            .expect("the turn streams")
            .expect("the turn ended before the stop")
            .expect("no error before the stop");
        if matches!(event.kind, EventKind::AssistantMessageDelta(_)) {
            break;
        }
    }
    let stopped_at = Instant::now();
    kill(Pid::from_raw(pid as i32), Signal::SIGSTOP).expect("stop the runtime");
    let outcome = tokio::time::timeout(Duration::from_secs(30), lease.wait_idle())
        .await
        .expect("the hung turn ends");
    let took = stopped_at.elapsed();
    println!("SIGSTOP mid-turn -> turn ended after {took:?}");
    match outcome {
        Ok(outcome) => assert_eq!(outcome.end, Some(TurnEnd::Crashed), "{outcome:?}"),
        Err(error) => {
            assert!(
                matches!(
                    &error,
                    PoolError::Worker(WorkerError::Died(exit))
                        | PoolError::Turn(TurnError::Worker(WorkerError::Died(exit)))
                        if exit.reason == ExitReason::Hung { misses: 2, timeout }
                ),
                "not ended as hung (crashed): {error}"
            );
            assert!(!matches!(error, PoolError::Turn(TurnError::Timeout { .. })));
        }
    }
    // Two intervals plus the timeout, plus the kill and reap of the group (generous for a
    // loaded machine, far below the turn's own inactivity timeout).
    let bound = interval * 2 + timeout;
    assert!(
        took < bound + Duration::from_secs(1),
        "declared hung after {took:?} (bound {bound:?})"
    );
    wait_event(
        &mut events,
        |event| matches!(event, PoolEvent::WorkerCrashed { pid: p, .. } if *p == pid),
    )
    .await;
    let left = wait_group_gone(pid, Duration::from_secs(5)).await;
    assert!(left.is_empty(), "{left:?}");
    drop(lease);
    shutdown_leaves_nothing(&pool).await;
}

#[tokio::test]
async fn a_killed_worker_actor_counts_as_crashed_once_its_process_is_reaped() {
    let fx = Fixture::new().await;
    let mut config = fx.config().await;
    // The lease after the kill resumes the conversation itself (no spare resumes it ahead).
    config.warm_spares = 0;
    let pool = Pool::start(config).await.expect("pool");
    let mut events = pool.subscribe();
    let mut lease = pool
        .lease(fx.request("agent-k", "conv"))
        .await
        .expect("lease");
    lease.run("REPLY=one MARKER-killed").await.expect("turn");
    let pid = lease.worker_pid();
    let actor = lease.worker_actor().expect("an open session");
    drop(lease);
    // A kill (or a panic) skips post_stop, and ractor tells the pool before the actor's state
    // drops, which is what SIGKILLs the group: the pool must wait for the reap.
    actor.kill();
    wait_event(
        &mut events,
        |event| matches!(event, PoolEvent::WorkerCrashed { pid: p, .. } if *p == pid),
    )
    .await;
    assert!(
        !Path::new(&format!("/proc/{pid}")).exists(),
        "the pool counted the crash of {pid} before its process was reaped"
    );
    let reason = fx
        .goes_on_elsewhere(&pool, "agent-k", "conv", pid, "MARKER-killed")
        .await;
    assert_eq!(reason, OpenReason::Resumed);
    shutdown_leaves_nothing(&pool).await;
}

#[tokio::test]
async fn a_turn_whose_worker_actor_is_killed_ends_died_only_once_the_process_is_gone() {
    let fx = Fixture::new().await;
    // A warm spare (the default) stands by: the conversation could move at once.
    let pool = Pool::start(fx.config().await).await.expect("pool");
    let mut lease = pool
        .lease(fx.request("agent-k", "conv"))
        .await
        .expect("lease");
    lease.run("REPLY=one MARKER-mid-turn").await.expect("turn");
    let pid = lease.worker_pid();
    let actor = lease.worker_actor().expect("an open session");
    lease
        .send("SCENARIO:slow SLOW=200x100")
        .await
        .expect("a slow turn starts");
    loop {
        match lease.next_event().await {
            Some(Ok(event)) if event.event_type() == "assistant.turn_start" => break,
            Some(Ok(_)) => continue,
            other => panic!("the turn ended before its model call: {other:?}"),
        }
    }
    // Killed mid-turn: whoever reads `Died` may resume the conversation elsewhere, so it
    // must come once the runtime (which holds the session) is gone.
    actor.kill();
    let ended = loop {
        match lease.next_event().await {
            Some(Ok(_)) => continue,
            other => break other,
        }
    };
    assert!(
        !Path::new(&format!("/proc/{pid}")).exists(),
        "the turn ended ({ended:?}) while process {pid} still existed"
    );
    assert!(
        matches!(
            &ended,
            Some(Err(PoolError::Worker(WorkerError::Died(exit))))
                | Some(Err(PoolError::Turn(TurnError::Worker(WorkerError::Died(exit)))))
                if exit.reason == ExitReason::Killed
        ),
        "{ended:?}"
    );
    drop(lease);
    fx.goes_on_elsewhere(&pool, "agent-k", "conv", pid, "MARKER-mid-turn")
        .await;
    shutdown_leaves_nothing(&pool).await;
}

#[tokio::test]
async fn dropping_every_handle_stops_the_worker_and_its_group() {
    let scratch = Scratch::new();
    let worker = WorkerHandle::start(worker_config(&scratch).await)
        .await
        .expect("worker starts");
    let pid = worker.pid();
    let actor = worker.actor();
    drop(worker);
    tokio::time::timeout(Duration::from_secs(10), actor.wait(None))
        .await
        .expect("actor stopped")
        .ok();
    let left = wait_group_gone(pid, Duration::from_secs(5)).await;
    assert!(left.is_empty(), "{left:?}");
}

#[tokio::test]
async fn killing_the_actor_kills_the_group() {
    let scratch = Scratch::new();
    let worker = WorkerHandle::start(worker_config(&scratch).await)
        .await
        .expect("worker starts");
    let pid = worker.pid();
    let model = ScriptedModel::new();
    let endpoint = model.serve_http().await.expect("model endpoint");
    let mut session = worker
        .create_session(session_config(&endpoint.base_url(), &scratch))
        .await
        .expect("session");
    // Kill skips post_stop: only the guard in the state can clean up and report.
    worker.actor().kill();
    let ended = loop {
        match tokio::time::timeout(Duration::from_secs(10), session.next()).await {
            Ok(Some(SessionUpdate::Ended(error))) => break error,
            Ok(Some(_)) => continue,
            other => panic!("no Ended after the kill: {other:?}"),
        }
    };
    let WorkerError::Died(exit) = &ended else {
        panic!("{ended}")
    };
    assert_eq!(exit.reason, ExitReason::Killed);
    let left = wait_group_gone(pid, Duration::from_secs(5)).await;
    assert!(left.is_empty(), "{left:?}");
}

#[tokio::test]
async fn shutdown_detaches_sessions_and_leaves_no_process() {
    let (scratch, _model, endpoint, worker) = support::worker_and_model().await;
    let mut session = worker
        .create_session(session_config(&endpoint.base_url(), &scratch))
        .await
        .expect("session");
    let exit = worker.shutdown().await;
    assert!(exit.is_shutdown(), "{exit}");
    let ended = loop {
        match session.next().await {
            Some(SessionUpdate::Ended(error)) => break error,
            Some(_) => continue,
            None => panic!("open session not told about the shutdown"),
        }
    };
    assert!(matches!(ended, WorkerError::Stopped), "{ended}");
    let left = wait_group_gone(worker.pid(), Duration::from_secs(5)).await;
    assert!(left.is_empty(), "{left:?}");
}

// ---------------------------------------------------------------------------------------
// Fault injection with a fake peer (sh). Each script answers `connect` (our first request
// has id 1), keeps a grandchild `sleep` in its process group, then misbehaves.

const CONNECT_OK: &str =
    r#"{"jsonrpc":"2.0","id":1,"result":{"ok":true,"protocolVersion":3,"version":"fake-peer"}}"#;

fn frame(body: &str) -> String {
    format!(
        "Content-Length: {}\\r\\n\\r\\n{}",
        body.len(),
        body.replace('"', "\\\"")
    )
}

/// Writes an executable fake peer that answers `connect` with `connect_body`, then, when
/// the header of the client's next request arrives (frames end without a newline, so the
/// second `Content-Length` line is the first sign of it), writes `fault` (raw printf text).
fn fake_peer(scratch: &Scratch, connect_body: &str, fault: &str) -> PathBuf {
    let path = scratch.path().join("fake-peer.sh");
    let script = format!(
        "#!/bin/sh\n\
         echo $$ > \"$(dirname \"$0\")/fake.pid\"\n\
         sleep 300 &\n\
         printf \"{connect}\"\n\
         n=0\n\
         while IFS= read -r line; do\n\
           case \"$line\" in *Content-Length*) n=$((n+1));; esac\n\
           [ $n -ge 2 ] && break\n\
         done\n\
         printf \"{fault}\"\n\
         while IFS= read -r line; do echo \"$line\" >&2; done\n",
        connect = frame(connect_body),
    );
    std::fs::write(&path, script).expect("write fake");
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    path
}

/// No process of the fake peer (its script path is in the command line) is left.
async fn assert_fake_gone(scratch: &Scratch) {
    let needle = scratch.path().display().to_string();
    let left = support::procs::wait_none(
        || support::procs::with_cmdline_containing(&needle),
        Duration::from_secs(5),
    )
    .await;
    assert!(left.is_empty(), "fake peer left behind: {left:?}");
    // Its whole process group (the `sleep` grandchild included) is gone too.
    if let Ok(pid) = std::fs::read_to_string(scratch.path().join("fake.pid")) {
        let pgid: u32 = pid.trim().parse().expect("pid");
        let left = wait_group_gone(pgid, Duration::from_secs(5)).await;
        assert!(left.is_empty(), "fake peer group left behind: {left:?}");
    }
}

fn fake_config(scratch: &Scratch, program: PathBuf) -> WorkerConfig {
    let mut config = WorkerConfig::new(program, scratch.copilot_home(), scratch.work());
    config.kill_grace = Duration::from_millis(500);
    config.health_interval = Duration::ZERO;
    config
}

async fn broken_by(fault: &str) -> (WorkerExit, WorkerError, u32) {
    let scratch = Scratch::new();
    let program = fake_peer(&scratch, CONNECT_OK, fault);
    let worker = WorkerHandle::start(fake_config(&scratch, program))
        .await
        .expect("fake peer handshake");
    assert_eq!(worker.info().runtime_version, "fake-peer");
    // The ping triggers the fault and is in flight when it arrives.
    let error = worker.ping().await.expect_err("ping into a broken stream");
    let exit = tokio::time::timeout(Duration::from_secs(10), worker.ended())
        .await
        .expect("worker ended");
    let pid = worker.pid();
    let left = wait_group_gone(pid, Duration::from_secs(5)).await;
    assert!(left.is_empty(), "fake peer group left behind: {left:?}");
    (exit, error, pid)
}

#[tokio::test]
async fn a_malformed_frame_breaks_the_connection_and_ends_the_worker() {
    let (exit, error, _) = broken_by(&frame("{this is not json")).await;
    let ExitReason::ProtocolViolation(detail) = &exit.reason else {
        panic!("{exit}")
    };
    assert!(detail.contains("not JSON"), "{detail}");
    assert!(matches!(error, WorkerError::Died(_)), "{error}");
}

#[tokio::test]
async fn a_bad_header_breaks_the_connection() {
    let (exit, _, _) = broken_by("Content-Length: twelve\\r\\n\\r\\n{}").await;
    assert!(
        matches!(exit.reason, ExitReason::ProtocolViolation(ref d) if d.contains("Content-Length")),
        "{exit}"
    );
}

#[tokio::test]
async fn an_oversized_frame_breaks_the_connection() {
    let (exit, _, _) = broken_by("Content-Length: 999999999999\\r\\n\\r\\n").await;
    assert!(
        matches!(exit.reason, ExitReason::ProtocolViolation(ref d) if d.contains("exceeds the maximum")),
        "{exit}"
    );
}

/// A fake peer that asks the worker `ask` (a raw frame of a request with id `srv-1`), echoes
/// the worker's answer to it to stderr and exits 7: how the worker (configured by `config`)
/// ended, its stderr holding that answer.
async fn answer_to(ask: &str, config: impl FnOnce(&mut WorkerConfig)) -> WorkerExit {
    let scratch = Scratch::new();
    let path = scratch.path().join("fake-peer.sh");
    let script = format!(
        "#!/bin/sh\n\
         printf \"{connect}\"\n\
         printf \"{ask}\"\n\
         while IFS= read -r line; do\n\
           case \"$line\" in *srv-1*) echo \"$line\" >&2; exit 7;; esac\n\
         done\n",
        connect = frame(CONNECT_OK),
    );
    std::fs::write(&path, script).expect("write fake");
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    let mut worker_config = fake_config(&scratch, path);
    config(&mut worker_config);
    let worker = WorkerHandle::start(worker_config).await.expect("handshake");
    // Our answer ends without a newline; only the header of a request we send after it ends
    // the fake's line, and nothing orders the worker's answer before a first ping. So the
    // pinger keeps sending (each ping gives up after 200 ms: the fake answers none) until
    // the fake has read its line and exited.
    let pinger = worker.clone();
    tokio::spawn(async move {
        let ping = copilot_pool::rpc::messages::PingParams::default();
        let short = Duration::from_millis(200);
        while pinger.exit().is_none() {
            let _ = pinger
                .call_with_timeout::<copilot_pool::rpc::messages::Ping>(&ping, short)
                .await;
        }
    });
    let exit = tokio::time::timeout(Duration::from_secs(10), worker.ended())
        .await
        .expect("fake exits after reading the answer");
    assert_eq!(exit.exit_info(), Some(ExitInfo::Code(7)), "{exit}");
    exit
}

#[tokio::test]
async fn an_unknown_server_request_gets_method_not_found() {
    // The fake asks us something we do not know.
    let ask = frame(r#"{"jsonrpc":"2.0","id":"srv-1","method":"no.such.method","params":{}}"#);
    let exit = answer_to(&ask, |_| {}).await;
    assert!(exit.stderr_tail.contains("-32601"), "{}", exit.stderr_tail);
    assert!(
        exit.stderr_tail.contains("no.such.method"),
        "{}",
        exit.stderr_tail
    );
}

#[tokio::test]
async fn a_request_holding_more_values_than_its_size_allows_is_refused_unread() {
    // 140 KB of `0,`: 70,001 values, over the 65,536 any frame limit allows (parsed, a value
    // every two bytes takes 16 times the frame's size).
    let dense = format!("[{}0]", "0,".repeat(70_000));
    let ask = frame(&format!(
        r#"{{"jsonrpc":"2.0","id":"srv-1","method":"no.such.method","params":{dense}}}"#
    ));
    let exit = answer_to(&ask, |config| config.max_frame_bytes = 1 << 20).await;
    assert!(
        exit.stderr_tail.contains("more than 65536 JSON values"),
        "{}",
        exit.stderr_tail
    );
}

#[tokio::test]
async fn another_protocol_version_is_refused_with_the_fix() {
    let scratch = Scratch::new();
    let program = fake_peer(
        &scratch,
        r#"{"jsonrpc":"2.0","id":1,"result":{"ok":true,"protocolVersion":2,"version":"0.3.0"}}"#,
        "",
    );
    let err = WorkerHandle::start(fake_config(&scratch, program))
        .await
        .expect_err("protocol 2 refused");
    let text = err.to_string();
    assert!(
        matches!(err, WorkerError::ProtocolVersion { got: 2, .. }),
        "{text}"
    );
    assert!(text.contains("copilot-pool install-cli"), "{text}");
    assert_fake_gone(&scratch).await;
}

/// Starts a worker on the fake runtime `script` (configured by `config`) and returns why the
/// start failed, with the scratch directory the fake ran in.
async fn start_failure(script: &str, config: impl FnOnce(&mut WorkerConfig)) -> (String, Scratch) {
    let scratch = Scratch::new();
    let path = scratch.path().join("fake-peer.sh");
    std::fs::write(&path, script).expect("write");
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    let mut worker_config = fake_config(&scratch, path);
    config(&mut worker_config);
    let err = WorkerHandle::start(worker_config)
        .await
        .expect_err("start fails");
    (err.to_string(), scratch)
}

#[tokio::test]
async fn a_runtime_that_exits_at_once_reports_its_status_and_stderr() {
    let script = "#!/bin/sh\necho 'fatal: cannot load runtime.node' >&2\nexit 3\n";
    let (text, scratch) = start_failure(script, |_| {}).await;
    assert!(text.contains("exit code 3"), "{text}");
    assert!(text.contains("cannot load runtime.node"), "{text}");
    assert_fake_gone(&scratch).await;
}

#[tokio::test]
async fn a_runtime_that_exits_at_once_after_much_stderr_reports_its_last_lines_only() {
    let script = "#!/bin/sh\ni=0\nwhile [ $i -lt 200 ]; do echo 'noise noise noise noise noise noise noise' >&2; i=$((i+1)); done\n\
         echo 'fatal: https://user:s3cret@proxy.example/ refused' >&2\nexit 3\n";
    let (text, scratch) = start_failure(script, |_| {}).await;
    assert!(text.contains("refused"), "{text}");
    assert!(!text.contains("s3cret"), "{text}");
    assert!(text.len() < 3 * 1024, "{} bytes: {text}", text.len());
    assert_eq!(text.matches("handshake").count(), 1, "{text}");
    assert_fake_gone(&scratch).await;
}

#[tokio::test]
async fn a_runtime_that_never_answers_its_handshake_is_reported_with_the_fix_and_its_stderr() {
    let script = "#!/bin/sh\necho 'waiting for a license server' >&2\nexec sleep 300\n";
    let (text, scratch) = start_failure(script, |config| {
        config.start_timeout = Duration::from_millis(500);
    })
    .await;
    assert!(text.contains("raise start_timeout"), "{text}");
    assert!(text.contains("waiting for a license server"), "{text}");
    assert_fake_gone(&scratch).await;
}

/// Events for a session parked between turns, each frame under PIPE_BUF (no write mixes
/// with the runtime's own).
fn small_events(id: &str, n: usize) -> String {
    let padding = "x".repeat(3500);
    format!(
        r#"{{"jsonrpc":"2.0","method":"session.event","params":{{"sessionId":"{id}","event":{{"id":"flood-{n}","timestamp":"2026-12-06T00:00:00.000Z","parentId":null,"type":"assistant.message_delta","data":{{"messageId":"m","deltaContent":"{padding}"}}}}}}}}"#
    )
}

/// A large notification naming the session (routed to it as the runtime sent it).
fn large_notifications(id: &str, n: usize) -> String {
    let padding = "x".repeat(100 << 10);
    format!(
        r#"{{"jsonrpc":"2.0","method":"flood.note","params":{{"sessionId":"{id}","n":{n},"pad":"{padding}"}}}}"#
    )
}

#[tokio::test]
async fn a_runtime_that_floods_a_session_nobody_reads_is_stopped_before_the_daemon_holds_it_all() {
    flood_a_parked_session(small_events, 200).await;
}

#[tokio::test]
async fn a_runtime_that_floods_a_session_with_large_notifications_is_stopped_too() {
    // Counted at their size, not as a small request would be.
    flood_a_parked_session(large_notifications, 8).await;
}

/// Writes `count` frames of `body(id, n)` for a parked session into the runtime's output
/// and checks the worker is stopped for leaving more than 256 KiB unread.
async fn flood_a_parked_session(body: fn(&str, usize) -> String, count: usize) {
    let scratch = Scratch::new();
    let model = ScriptedModel::new();
    let endpoint = model.serve_http().await.expect("model");
    let mut config = worker_config(&scratch).await;
    config.health_interval = Duration::ZERO;
    config.max_unread_route_bytes = 256 << 10;
    let worker = WorkerHandle::start(config).await.expect("start");
    // A session parked between turns: nothing reads its route.
    let mut session = worker
        .create_session(session_config(&endpoint.base_url(), &scratch))
        .await
        .expect("create");
    worker.ping().await.expect("ping");
    // What a tool process can do (the sandbox does not wall a pipe reached through
    // `/proc/<pid>/fd`): write frames into the runtime's output, here events for the parked
    // session. Each frame under PIPE_BUF, so no write mixes with the runtime's own.
    let pid = worker.pid();
    let output = std::fs::OpenOptions::new()
        .write(true)
        .open(format!("/proc/{pid}/fd/1"))
        .expect("the runtime's output pipe");
    let id = session.id().to_string();
    // On a thread of its own: once the runtime is stopped nothing reads the pipe, and a
    // write would block until this test's process ends.
    let (wrote_tx, wrote) = std::sync::mpsc::channel();
    let flood_id = id.clone();
    std::thread::spawn(move || {
        use std::io::Write;
        let mut output = output;
        let mut written = 0;
        for n in 0..count {
            let body = body(&flood_id, n);
            let frame = format!("Content-Length: {}\r\n\r\n{body}", body.len());
            if output.write_all(frame.as_bytes()).is_err() {
                break; // Nothing reads the pipe any more.
            }
            written += frame.len();
            let _ = wrote_tx.send(written);
        }
    });
    let exit = tokio::time::timeout(Duration::from_secs(10), worker.ended())
        .await
        .expect("the flooding runtime is stopped");
    let written = wrote.try_iter().last().unwrap_or(0);
    assert!(written > 256 << 10, "stopped after only {written} bytes");
    let ExitReason::ProtocolViolation(detail) = &exit.reason else {
        panic!("{exit}")
    };
    assert!(
        detail.contains("max_unread_route_bytes") && detail.contains(&id),
        "{detail}"
    );
    // The parked session learns its worker died; the process group is gone.
    let ended = loop {
        match session.next().await {
            Some(SessionUpdate::Ended(error)) => break error,
            Some(_) => continue,
            None => panic!("the route closed without its end"),
        }
    };
    assert!(matches!(ended, WorkerError::Died(_)), "{ended}");
    let left = wait_group_gone(pid, Duration::from_secs(5)).await;
    assert!(left.is_empty(), "runtime group left behind: {left:?}");
}
