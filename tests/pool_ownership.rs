//! One owner per CLI session on every path: cancelled opens, dropped leases whose turn does
//! not settle, bindings that cannot be written, resumes that crash the runtime. Real runtime
//! processes where they can show it; the fake runtime (Node) for faults the real one cannot
//! be told to produce.

mod support;

use std::time::Duration;

use copilot_pool::kinds::TurnEnd;
use copilot_pool::pool::{CliSessionId, LeaseRequest, OpenReason, Pool, PoolError, PoolEvent};
use copilot_pool::transcript::TranscriptMode;
use copilot_pool::turn::{TranscriptSettings, TurnError};
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use support::pool_fixture::{Fixture, shutdown_leaves_nothing, wait_event};
use support::procs::wait_group_gone;

/// Where a lease is cancelled while it opens its conversation.
#[derive(Debug, Clone, Copy)]
enum CancelPoint {
    /// As soon as the process the lease will be granted has started (before any request).
    WorkerStarted,
    /// Once the runtime has streamed the `session.resume` event, before its reply (which
    /// the proxy in front of it holds back).
    ResumeEvent,
    /// Once the proxy has passed the runtime's reply on (the pool is recording the
    /// conversation).
    Reply,
}

async fn cancel_point_reached(
    point: CancelPoint,
    events: &mut tokio::sync::broadcast::Receiver<PoolEvent>,
    resume_marker: &std::path::Path,
) {
    match point {
        CancelPoint::WorkerStarted => {
            wait_event(events, |e| matches!(e, PoolEvent::WorkerStarted { .. })).await;
        }
        CancelPoint::ResumeEvent => loop {
            // The proxy's marker file is the only signal of this point (it then holds the
            // reply back for a while); polled, bounded by the caller's timeout.
            if resume_marker.exists() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(2)).await;
        },
        CancelPoint::Reply => loop {
            if resume_marker.with_extension("replied").exists() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
        },
    }
}

/// A conversation on one process; a lease that would move it to the second process (other
/// settings) is cancelled at `point`; the next lease, with the first settings, moves it back
/// to the other process. That open must find the session free (`alreadyInUse: false`) and
/// the history whole.
async fn cancel_while_opening_then_lease_on_the_other_process(point: CancelPoint) {
    let fx = Fixture::new().await;
    let mut config = fx.config().await;
    config.max_processes_per_key = 2;
    config.max_sessions_per_process = 1;
    let resume_marker = fx.scratch.path().join("resume-event-seen");
    config.worker.program = fx.resume_delay_proxy(&config.worker.program, &resume_marker);
    let pool = Pool::start(config).await.expect("pool");
    let mut lease = pool
        .lease(fx.request("agent-a", "conv"))
        .await
        .expect("first lease");
    lease
        .run("REPLY=first MARKER-before-the-cancel")
        .await
        .expect("first turn");
    let id = lease.cli_session_id().to_owned();
    let first_pid = lease.worker_pid();
    drop(lease);

    // Other settings: the attached session cannot be reused, its process is full, so the
    // lease is granted a second process and resumes the conversation there.
    let mut moved = fx.request("agent-a", "conv");
    moved.reasoning_effort = Some(copilot_pool::ReasoningEffort::High);
    let mut events = pool.subscribe();
    let mut opening = Box::pin(pool.lease(moved));
    tokio::select! {
        finished = &mut opening => {
            // The open finished before the cancel point: dropping the lease is the cancel.
            drop(finished.expect("the moved lease"));
        }
        _ = tokio::time::timeout(
            Duration::from_secs(30),
            cancel_point_reached(point, &mut events, &resume_marker),
        ) => {}
    }
    drop(opening);
    // The process the cancelled lease was granted (the one that is not the first).
    let status = pool.status().await.expect("status");
    let second_pid = status
        .workers
        .iter()
        .map(|w| w.pid)
        .find(|pid| *pid != first_pid);

    // Back to the first settings: the conversation is not attached with them anywhere, so
    // it is (re)opened; wherever the cancelled open left it, it must be free.
    let mut lease = tokio::time::timeout(
        Duration::from_secs(60),
        pool.lease(fx.request("agent-a", "conv")),
    )
    .await
    .expect("lease after the cancel")
    .expect("lease after the cancel");
    assert_eq!(
        lease.cli_session_id(),
        &id,
        "{point:?}: the same conversation"
    );
    if lease.reason() == OpenReason::Resumed {
        assert!(
            !lease.already_in_use(),
            "{point:?}: the session was still attached to another process (split brain)"
        );
        assert_ne!(
            Some(lease.worker_pid()),
            second_pid,
            "{point:?}: moved back"
        );
    } else {
        // Cancelled before it was granted: nothing moved.
        assert_eq!(lease.reason(), OpenReason::Attached, "{point:?}");
        assert_eq!(lease.worker_pid(), first_pid, "{point:?}");
    }
    lease
        .run("REPLY=after")
        .await
        .expect("turn after the cancel");
    assert!(
        fx.last_model_request().contains("MARKER-before-the-cancel"),
        "{point:?}: the history is whole"
    );
    drop(lease);
    let status = pool.status().await.expect("status");
    assert_eq!(status.conversations, 1, "{point:?}: {status:?}");
    shutdown_leaves_nothing(&pool).await;
}

#[tokio::test]
async fn a_lease_cancelled_when_its_process_starts_leaves_the_session_with_one_owner() {
    cancel_while_opening_then_lease_on_the_other_process(CancelPoint::WorkerStarted).await;
}

#[tokio::test]
async fn a_lease_cancelled_after_the_runtimes_resume_event_leaves_the_session_with_one_owner() {
    cancel_while_opening_then_lease_on_the_other_process(CancelPoint::ResumeEvent).await;
}

#[tokio::test]
async fn a_lease_cancelled_after_the_runtimes_reply_leaves_the_session_with_one_owner() {
    cancel_while_opening_then_lease_on_the_other_process(CancelPoint::Reply).await;
}

/// The process that may still run an unsettled turn is stopped with its group, and the
/// conversation resumes on another one.
async fn stopped_then_resumed_elsewhere(
    pool: &Pool,
    events: &mut tokio::sync::broadcast::Receiver<PoolEvent>,
    req: LeaseRequest,
    id: &copilot_pool::ids::CliSessionId,
    stuck_pid: u32,
) {
    let evicted = wait_event(events, |e| matches!(e, PoolEvent::WorkerEvicted { .. })).await;
    let PoolEvent::WorkerEvicted { pid, .. } = evicted else {
        unreachable!()
    };
    assert_eq!(
        pid, stuck_pid,
        "the process that may still run the turn is stopped"
    );
    let left = wait_group_gone(stuck_pid, Duration::from_secs(10)).await;
    assert!(left.is_empty(), "group {stuck_pid} left behind: {left:?}");
    let lease = pool.lease(req).await.expect("lease after the stop");
    assert_eq!(lease.cli_session_id(), id);
    assert_eq!(lease.reason(), OpenReason::Resumed);
    assert_ne!(lease.worker_pid(), stuck_pid);
    drop(lease);
    shutdown_leaves_nothing(pool).await;
}

#[tokio::test]
async fn a_dropped_lease_whose_turn_never_settles_stops_its_process_and_the_conversation_resumes_elsewhere()
 {
    let fx = Fixture::new().await;
    let mut config = fx.fake_runtime_config("never-idle").await;
    config.max_processes_per_key = 2;
    config.abort_settle_timeout = Duration::from_millis(300);
    config.worker.health_interval = Duration::ZERO;
    let pool = Pool::start(config).await.expect("pool");
    let mut events = pool.subscribe();
    let mut lease = pool
        .lease(fx.request("agent-a", "conv"))
        .await
        .expect("lease");
    let id = lease.cli_session_id().to_owned();
    let stuck_pid = lease.worker_pid();
    lease.send("this turn never ends").await.expect("send");
    // Dropped mid-turn: the abort is acknowledged, but no session.idle ever comes.
    drop(lease);
    stopped_then_resumed_elsewhere(
        &pool,
        &mut events,
        fx.request("agent-a", "conv"),
        &id,
        stuck_pid,
    )
    .await;
}

#[tokio::test]
async fn a_turn_that_times_out_and_never_settles_stops_its_process_and_the_conversation_resumes_elsewhere()
 {
    let fx = Fixture::new().await;
    let mut config = fx.fake_runtime_config("never-idle").await;
    config.max_processes_per_key = 2;
    config.abort_settle_timeout = Duration::from_millis(300);
    config.worker.health_interval = Duration::ZERO;
    let pool = Pool::start(config).await.expect("pool");
    let mut events = pool.subscribe();
    let mut req = fx.request("agent-a", "conv");
    req.handlers.timeouts.inactivity = Duration::from_millis(200);
    let mut lease = pool.lease(req.clone()).await.expect("lease");
    let id = lease.cli_session_id().to_owned();
    let stuck_pid = lease.worker_pid();
    // No event ever comes: the inactivity timeout aborts the turn, which never goes idle.
    let timed_out = lease.run("this turn never ends").await;
    assert!(
        matches!(timed_out, Err(PoolError::Turn(TurnError::Timeout { .. }))),
        "{timed_out:?}"
    );
    assert_eq!(lease.outcome().end, Some(TurnEnd::Timeout));
    drop(lease);
    stopped_then_resumed_elsewhere(&pool, &mut events, req, &id, stuck_pid).await;
}

#[tokio::test]
async fn a_compaction_the_runtime_finishes_between_turns_is_mirrored_as_the_next_turn_starts() {
    let fx = Fixture::new().await;
    let pool = Pool::start(fx.fake_runtime_config("compaction-between-turns").await)
        .await
        .expect("pool");
    let dir = fx.scratch.path().join("transcripts");
    let mut req = fx.request("agent-a", "conv");
    req.handlers.transcript = Some(TranscriptSettings::new(dir.clone(), TranscriptMode::Strict));
    let mut lease = pool.lease(req).await.expect("lease");
    let transcript = dir.join(format!("copilot-{}.jsonl", lease.cli_session_id()));
    lease.run("first").await.expect("first turn");
    // The first turn's compaction ended after its `session.idle`: it waits, unread, and is
    // mirrored when the next turn starts (before, it was dropped there). Another
    // conversation opened on the same process makes sure it is waiting: an open returns
    // once what the runtime sent before its answer is routed.
    let other = pool
        .lease(fx.request("agent-a", "other"))
        .await
        .expect("other lease");
    assert_eq!(other.worker_pid(), lease.worker_pid(), "one process");
    drop(other);
    lease.run("second").await.expect("second turn");
    let tail = copilot_pool::fallback::read_transcript_tail(&transcript, 10_000).expect("read");
    assert_eq!(tail.summary.as_deref(), Some("SUMMARY-AFTER-first"));
    drop(lease);
    shutdown_leaves_nothing(&pool).await;
}

/// A pool of the fake runtime in `stray-after-abort` mode: after an abort it asks for a
/// client tool call and reaches `session.idle` only once that call is answered.
async fn stray_after_abort_pool(fx: &Fixture) -> Pool {
    let mut config = fx.fake_runtime_config("stray-after-abort").await;
    config.max_processes_per_key = 2;
    config.abort_settle_timeout = Duration::from_secs(2);
    config.worker.health_interval = Duration::ZERO;
    Pool::start(config).await.expect("pool")
}

/// Leases `req` again (after the previous lease's return): it must still be attached to
/// the process `pid`, which was not stopped. Then shuts the pool down.
async fn the_conversation_is_parked_on(pool: &Pool, req: LeaseRequest, pid: u32) {
    let lease = pool.lease(req).await.expect("lease again");
    assert_eq!(
        lease.reason(),
        OpenReason::Attached,
        "the conversation was parked"
    );
    assert_eq!(lease.worker_pid(), pid, "its process was not stopped");
    drop(lease);
    shutdown_leaves_nothing(pool).await;
}

#[tokio::test]
async fn a_dropped_lease_refuses_a_tool_call_its_aborted_turn_asks_for_and_keeps_the_conversation_on_its_process()
 {
    let fx = Fixture::new().await;
    let pool = stray_after_abort_pool(&fx).await;
    let mut lease = pool
        .lease(fx.request("agent-a", "conv"))
        .await
        .expect("lease");
    let pid = lease.worker_pid();
    lease.send("this turn is dropped").await.expect("send");
    // Dropped mid-turn: the abort's drain refuses the stray tool call, so the turn settles.
    drop(lease);
    the_conversation_is_parked_on(&pool, fx.request("agent-a", "conv"), pid).await;
}

#[tokio::test]
async fn a_timed_out_turn_refuses_a_tool_call_its_abort_asks_for_and_keeps_the_conversation_on_its_process()
 {
    let fx = Fixture::new().await;
    let pool = stray_after_abort_pool(&fx).await;
    let mut req = fx.request("agent-a", "conv");
    req.handlers.timeouts.inactivity = Duration::from_millis(200);
    let mut lease = pool.lease(req.clone()).await.expect("lease");
    let pid = lease.worker_pid();
    let timed_out = lease.run("no event ever comes").await;
    assert!(
        matches!(timed_out, Err(PoolError::Turn(TurnError::Timeout { .. }))),
        "{timed_out:?}"
    );
    drop(lease);
    the_conversation_is_parked_on(&pool, req, pid).await;
}

#[tokio::test]
async fn a_conversation_whose_resume_crashes_the_runtime_twice_starts_fresh_without_quarantining_its_key()
 {
    let fx = Fixture::new().await;
    let config = fx.fake_runtime_config("crash-on-resume").await;
    let pool = Pool::start(config.clone()).await.expect("pool");
    let lease = pool
        .lease(fx.request("agent-a", "conv"))
        .await
        .expect("lease");
    let id = lease.cli_session_id().to_owned();
    assert_eq!(lease.reason(), OpenReason::New);
    drop(lease);
    shutdown_leaves_nothing(&pool).await;

    // A new pool on the same state resumes from the binding: the runtime dies each time.
    let pool = Pool::start(config).await.expect("pool");
    for attempt in 1..=2 {
        let crashed = pool.lease(fx.request("agent-a", "conv")).await;
        let Err(PoolError::Worker(error)) = &crashed else {
            panic!("attempt {attempt}: expected the crash, got {crashed:?}")
        };
        assert!(error.to_string().contains("crashing on resume"), "{error}");
    }
    let lease = pool
        .lease(fx.request("agent-a", "conv"))
        .await
        .expect("the third lease starts fresh");
    assert_eq!(lease.reason(), OpenReason::ResumeFailed);
    assert_ne!(lease.cli_session_id(), &id);
    assert_eq!(
        lease.outcome().open_reason,
        Some(OpenReason::ResumeFailed),
        "the turn outcome says why the context is gone"
    );
    drop(lease);
    let status = pool.status().await.expect("status");
    assert!(status.quarantined_keys.is_empty(), "{status:?}");
    // The fresh session is the conversation's from now on.
    let lease = pool
        .lease(fx.request("agent-a", "conv"))
        .await
        .expect("lease");
    assert_eq!(lease.reason(), OpenReason::Attached);
    drop(lease);
    shutdown_leaves_nothing(&pool).await;
}

#[tokio::test]
async fn a_pinned_session_whose_resume_crashes_the_runtime_twice_is_refused_for_a_while_saying_so()
{
    let fx = Fixture::new().await;
    let config = fx.fake_runtime_config("crash-on-resume").await;
    let pinned = || {
        let mut req = fx.request("agent-a", "pinned");
        req.cli_session_id = Some(CliSessionId::new("0c8f5e0e-5d1c-4c55-9d8a-6f1f7c1b2a33"));
        req
    };
    let pool = Pool::start(config.clone()).await.expect("pool");
    drop(pool.lease(pinned()).await.expect("created under its id"));
    shutdown_leaves_nothing(&pool).await;
    let pool = Pool::start(config).await.expect("pool");
    for attempt in 1..=2 {
        let crashed = pool.lease(pinned()).await;
        assert!(
            matches!(&crashed, Err(PoolError::Worker(_))),
            "attempt {attempt}: {crashed:?}"
        );
    }
    // Its id cannot be given to a new session: refused, saying when to retry.
    let refused = pool.lease(pinned()).await.expect_err("refused");
    assert!(
        matches!(refused, PoolError::ResumeCrashedRepeatedly { .. }),
        "{refused:?}"
    );
    assert_eq!(refused.kind(), copilot_pool::kinds::ErrorKind::Quarantined);
    assert!(refused.to_string().contains("retry then"), "{refused}");
    shutdown_leaves_nothing(&pool).await;
}

#[tokio::test]
async fn a_conversation_pinned_anew_to_a_session_another_conversation_holds_is_refused() {
    let fx = Fixture::new().await;
    let config = fx.fake_runtime_config("never-idle").await;
    let pool = Pool::start(config.clone()).await.expect("pool");
    let theirs = CliSessionId::new("5b0c0de0-1111-4222-8333-944455556666");
    let mut y = fx.request("agent-a", "y");
    y.cli_session_id = Some(theirs.clone());
    drop(pool.lease(y).await.expect("y holds its session"));
    // x has a session of its own, bound; then (attached nowhere, after a restart) it names
    // y's.
    drop(pool.lease(fx.request("agent-a", "x")).await.expect("x"));
    shutdown_leaves_nothing(&pool).await;
    let pool = Pool::start(config).await.expect("pool");
    let mut x = fx.request("agent-a", "x");
    x.cli_session_id = Some(theirs);
    let refused = pool.lease(x).await.expect_err("y's session is y's");
    assert!(
        refused
            .to_string()
            .contains("one session holds one conversation"),
        "{refused}"
    );
    shutdown_leaves_nothing(&pool).await;
}

#[tokio::test]
async fn a_binding_that_cannot_be_written_fails_the_lease_and_leaves_nothing_attached() {
    let fx = Fixture::new().await;
    // No warm spare: once the bindings are back, a spare standing in for the killed process
    // may resume "kept" ahead of its lease, which then finds it attached (seen once in CI);
    // this test pins the lease's own resume.
    let mut config = fx.config().await;
    config.warm_spares = 0;
    let state = config.state_dir.clone();
    let pool = Pool::start(config).await.expect("pool");
    let mut lease = pool
        .lease(fx.request("agent-a", "kept"))
        .await
        .expect("lease");
    lease.run("REPLY=one MARKER-kept").await.expect("turn");
    let pid = lease.worker_pid();
    drop(lease);

    // The state directory is replaced by a file between two turns.
    let aside = state.with_extension("aside");
    std::fs::rename(&state, &aside).expect("move the state directory");
    std::fs::write(&state, b"not a directory").expect("a file in its place");

    // The attached conversation's binding is gone with the directory: its next turn fails
    // instead of running unrecorded.
    let attached = pool.lease(fx.request("agent-a", "kept")).await;
    assert!(
        matches!(attached, Err(PoolError::StateUnwritable { .. })),
        "{attached:?}"
    );
    // A new conversation cannot be recorded: its lease fails and nothing stays attached.
    let failed = pool.lease(fx.request("agent-a", "new")).await;
    let Err(error @ PoolError::StateUnwritable { .. }) = &failed else {
        panic!("expected StateUnwritable, got {failed:?}")
    };
    let message = error.to_string();
    assert!(message.contains(&state.display().to_string()), "{message}");
    assert!(message.contains("Not a directory"), "{message}");
    // A conversation that must be resumed after a crash cannot be recorded either.
    kill(Pid::from_raw(pid as i32), Signal::SIGKILL).expect("kill");
    let left = wait_group_gone(pid, Duration::from_secs(10)).await;
    assert!(left.is_empty());
    let resumed = pool.lease(fx.request("agent-a", "kept")).await;
    assert!(
        matches!(resumed, Err(PoolError::StateUnwritable { .. })),
        "{resumed:?}"
    );
    let status = pool.status().await.expect("status");
    assert_eq!(
        status.conversations, 0,
        "nothing attached without a binding: {status:?}"
    );

    // Reads work but writes fail (the bindings directory is now a read-only place where
    // nothing exists and nothing can be created): the session is opened in the runtime,
    // cannot be recorded, and is detached again.
    std::fs::remove_file(&state).expect("remove the file");
    std::fs::rename(&aside, &state).expect("restore the state directory");
    let bindings = state.join("bindings");
    let bindings_aside = state.join("bindings.aside");
    std::fs::rename(&bindings, &bindings_aside).expect("move the bindings");
    std::os::unix::fs::symlink("/proc", &bindings).expect("symlink");
    let failed = pool.lease(fx.request("agent-a", "new")).await;
    assert!(
        matches!(failed, Err(PoolError::StateUnwritable { .. })),
        "{failed:?}"
    );
    let detached = async {
        loop {
            let status = pool.status().await.expect("status");
            if status.conversations == 0 && status.workers.iter().all(|w| w.conversations == 0) {
                break;
            }
            tokio::task::yield_now().await;
        }
    };
    tokio::time::timeout(Duration::from_secs(10), detached)
        .await
        .expect("nothing stays attached without a binding");

    // Once the directory is back, both continue: "kept" with its history.
    std::fs::remove_file(&bindings).expect("remove the symlink");
    std::fs::rename(&bindings_aside, &bindings).expect("restore the bindings");
    let mut kept = pool
        .lease(fx.request("agent-a", "kept"))
        .await
        .expect("kept");
    assert_eq!(kept.reason(), OpenReason::Resumed);
    kept.run("REPLY=two").await.expect("turn");
    assert!(fx.last_model_request().contains("MARKER-kept"));
    drop(kept);
    let new = pool.lease(fx.request("agent-a", "new")).await.expect("new");
    assert_eq!(new.reason(), OpenReason::New);
    drop(new);
    shutdown_leaves_nothing(&pool).await;
}

#[tokio::test]
async fn each_turn_says_how_its_conversation_was_opened() {
    let fx = Fixture::new().await;
    // The third turn's lease resumes the conversation itself: a warm spare (the default)
    // standing in for the killed process may have resumed it ahead, and then the lease finds
    // it attached (seen once, in a fresh machine's run).
    let mut config = fx.config().await;
    config.warm_spares = 0;
    let pool = Pool::start(config).await.expect("pool");
    let mut lease = pool
        .lease(fx.request("agent-a", "conv"))
        .await
        .expect("lease");
    let first = lease.run("REPLY=one").await.expect("turn");
    assert_eq!(first.open_reason, Some(OpenReason::New));
    assert_eq!(first.end, Some(TurnEnd::Idle));
    assert!(
        first.usage.input_tokens > 0 && first.usage.output_tokens > 0,
        "{first:?}"
    );
    // The scripted model reports 40 cached prompt tokens per call.
    assert_eq!(
        first.usage.cache_read_tokens,
        40 * u64::from(first.model_calls),
        "{first:?}"
    );
    let second = lease.run("REPLY=two").await.expect("turn");
    assert_eq!(second.open_reason, Some(OpenReason::Attached));
    let pid = lease.worker_pid();
    drop(lease);
    kill(Pid::from_raw(pid as i32), Signal::SIGKILL).expect("kill");
    assert!(
        wait_group_gone(pid, Duration::from_secs(10))
            .await
            .is_empty()
    );
    let mut lease = pool
        .lease(fx.request("agent-a", "conv"))
        .await
        .expect("lease");
    let third = lease.run("REPLY=three").await.expect("turn");
    assert_eq!(third.open_reason, Some(OpenReason::Resumed));
    drop(lease);
    shutdown_leaves_nothing(&pool).await;
}

#[tokio::test]
async fn a_child_killed_during_a_first_turn_makes_the_next_turn_say_its_context_was_lost() {
    let fx = Fixture::new().await;
    let pool = Pool::start(fx.config().await).await.expect("pool");
    let mut lease = pool
        .lease(fx.request("agent-a", "conv"))
        .await
        .expect("lease");
    let pid = lease.worker_pid();
    lease
        .send("SCENARIO:slow SLOW=200x100")
        .await
        .expect("send");
    // Killed as the first model call starts: the runtime has persisted nothing yet.
    loop {
        match lease.next_event().await {
            Some(Ok(event)) if event.event_type() == "assistant.turn_start" => break,
            Some(Ok(_)) => continue,
            other => panic!("the turn ended before its model call: {other:?}"),
        }
    }
    kill(Pid::from_raw(pid as i32), Signal::SIGKILL).expect("kill");
    let ended = loop {
        match lease.next_event().await {
            Some(Ok(_)) => continue,
            other => break other,
        }
    };
    assert!(
        matches!(ended, Some(Err(PoolError::Worker(_)))),
        "{ended:?}"
    );
    drop(lease);
    assert!(
        wait_group_gone(pid, Duration::from_secs(10))
            .await
            .is_empty()
    );

    let mut lease = pool
        .lease(fx.request("agent-a", "conv"))
        .await
        .expect("lease after the kill");
    let outcome = lease.run("REPLY=again").await.expect("turn");
    assert!(
        matches!(
            outcome.open_reason,
            Some(OpenReason::TranscriptMissing | OpenReason::NotFound)
        ),
        "the gateway learns the context is gone and why: {:?}",
        outcome.open_reason
    );
    drop(lease);
    shutdown_leaves_nothing(&pool).await;
}

/// A runtime stopped with SIGSTOP mid-turn is found hung by its health pings; its turn ends
/// `crashed`, and the next turn resumes the conversation on a new process. The hung process
/// still holds the session's lock until it is gone, so it must be killed and reaped before
/// its turn fails: the resume finds the session free (`alreadyInUse: false`, one owner)
/// and the history whole. (The chaos run found this: with SIGTERM and a grace period first,
/// a stopped runtime outlived its failed turn by the grace period.)
#[tokio::test]
async fn a_hung_runtime_is_gone_before_its_conversation_resumes_elsewhere() {
    let fx = Fixture::new().await;
    let mut config = fx.config().await;
    config.worker.health_interval = Duration::from_millis(500);
    config.worker.health_timeout = Duration::from_millis(500);
    config.worker.kill_grace = Duration::from_secs(5);
    // The next lease resumes the conversation itself (a warm spare could resume it ahead).
    config.warm_spares = 0;
    let pool = Pool::start(config).await.expect("pool");
    let mut lease = pool
        .lease(fx.request("agent-a", "conv"))
        .await
        .expect("first lease");
    lease
        .run("REPLY=first MARKER-before-the-hang")
        .await
        .expect("first turn");
    let hung_pid = lease.worker_pid();
    lease
        .send("SCENARIO:slow SLOW=100x100")
        .await
        .expect("a slow turn starts");
    kill(Pid::from_raw(hung_pid as i32), Signal::SIGSTOP).expect("stop the runtime");
    let outcome = tokio::time::timeout(Duration::from_secs(30), lease.wait_idle())
        .await
        .expect("the hung turn ends");
    match outcome {
        Ok(outcome) => assert_eq!(outcome.end, Some(TurnEnd::Crashed), "{outcome:?}"),
        Err(error) => assert!(
            matches!(
                error,
                PoolError::Worker(_) | PoolError::Turn(TurnError::Worker(_))
            ),
            "{error}"
        ),
    }
    drop(lease);

    let mut lease = tokio::time::timeout(
        Duration::from_secs(60),
        pool.lease(fx.request("agent-a", "conv")),
    )
    .await
    .expect("lease after the hang")
    .expect("lease after the hang");
    assert_ne!(lease.worker_pid(), hung_pid);
    assert_eq!(lease.reason(), OpenReason::Resumed);
    assert!(
        !lease.already_in_use(),
        "the session was still attached to the hung process (two owners)"
    );
    lease.run("REPLY=after").await.expect("turn after the hang");
    assert!(
        fx.last_model_request().contains("MARKER-before-the-hang"),
        "the history is whole"
    );
    drop(lease);
    let left = wait_group_gone(hung_pid, Duration::from_secs(5)).await;
    assert!(
        left.is_empty(),
        "the hung process's group is gone: {left:?}"
    );
    shutdown_leaves_nothing(&pool).await;
}

#[tokio::test]
async fn a_reset_whose_caller_stops_waiting_still_deletes_the_conversation_before_it_is_leased_again()
 {
    let fx = Fixture::new().await;
    // The fake runtime takes 500 ms to delete (the real one cannot be made to take long).
    let pool = Pool::start(fx.fake_runtime_config("slow-answers").await)
        .await
        .expect("pool");
    drop(
        pool.lease(fx.request("agent-a", "conv"))
            .await
            .expect("lease"),
    );
    let existing = || {
        let mut req = fx.request("agent-a", "conv");
        req.existing_only = true;
        req
    };
    let lease = pool.lease(existing()).await.expect("lease");
    // The caller (a client that hung up mid-DELETE) stops waiting while the runtime deletes.
    let cut = tokio::time::timeout(Duration::from_millis(100), lease.reset()).await;
    assert!(
        cut.is_err(),
        "the deletion takes longer than the caller waited"
    );
    // The conversation is not handed on before its deletion is done: the next lease finds
    // it gone, its binding removed.
    let next = pool.lease(existing()).await;
    assert!(
        matches!(next, Err(PoolError::NoSuchConversation { .. })),
        "{next:?}"
    );
    assert!(
        pool.bindings()
            .get("agent-a/conv")
            .expect("bindings")
            .is_none()
    );
    shutdown_leaves_nothing(&pool).await;
}

#[tokio::test]
async fn a_turn_whose_send_the_caller_stopped_waiting_for_is_aborted_before_the_conversation_goes_back()
 {
    let fx = Fixture::new().await;
    // The fake runtime answers `session.send` 500 ms late, having taken the turn.
    let pool = Pool::start(fx.fake_runtime_config("slow-answers").await)
        .await
        .expect("pool");
    let mut lease = pool
        .lease(fx.request("agent-a", "conv"))
        .await
        .expect("lease");
    let cut = tokio::time::timeout(Duration::from_millis(100), lease.send("hello")).await;
    assert!(
        cut.is_err(),
        "the send's answer takes longer than the caller waited"
    );
    drop(lease);
    // The next lease of the conversation gets it once the dropped one's turn was aborted.
    drop(
        pool.lease(fx.request("agent-a", "conv"))
            .await
            .expect("lease"),
    );
    let calls = fx.fake_runtime_calls("slow-answers");
    assert!(
        calls.iter().any(|method| method == "session.abort"),
        "the turn the runtime may be running was aborted: {calls:?}"
    );
    shutdown_leaves_nothing(&pool).await;
}

#[tokio::test]
async fn a_reset_the_runtime_refuses_keeps_the_conversation_for_a_retry_that_deletes_it() {
    let fx = Fixture::new().await;
    let pool = Pool::start(fx.fake_runtime_config("delete-fails-once").await)
        .await
        .expect("pool");
    let opened = pool
        .lease(fx.request("agent-a", "conv"))
        .await
        .expect("lease");
    // The bindings are filed by "<agent>/<session key>".
    let key = "agent-a/conv";
    drop(opened);
    let existing = || {
        let mut req = fx.request("agent-a", "conv");
        req.existing_only = true;
        req
    };
    // The runtime refuses the deletion: the reset fails, the conversation stays findable.
    let refused = pool
        .lease(existing())
        .await
        .expect("lease")
        .reset()
        .await
        .expect_err("the runtime refused");
    assert!(
        refused.to_string().contains("could not delete"),
        "{refused}"
    );
    assert!(
        pool.bindings().get(key).expect("bindings").is_some(),
        "the binding of a conversation the runtime still holds stays"
    );
    // The retry finds it (on a fresh process: the refusing one was stopped) and deletes it.
    pool.lease(existing())
        .await
        .expect("the retry finds the conversation")
        .reset()
        .await
        .expect("deleted");
    assert!(pool.bindings().get(key).expect("bindings").is_none());
    shutdown_leaves_nothing(&pool).await;
}
