//! End-to-end: the pool over real runtime processes and the scripted model.

mod support;

use std::time::Duration;

use copilot_pool::kinds::{Eviction, Priming};
use copilot_pool::pool::{OpenReason, Pool, PoolError, PoolEvent, RestartPolicy, WorkerState};
use copilot_pool::rpc::messages::ProviderConfig;
use copilot_pool::secret::Secret;
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use support::pool_fixture::{
    Fixture, shutdown_leaves_nothing, status_with_worker, token, until_a_lease_waits, wait_event,
};
use support::procs::wait_group_gone;

#[tokio::test]
async fn concurrent_leases_on_a_new_key_spawn_exactly_one_process() {
    let fx = Fixture::new().await;
    let pool = Pool::start(fx.config().await).await.expect("pool");
    let leases = futures_util::future::join_all(
        (0..6).map(|i| pool.lease(fx.request("agent-a", &format!("conv-{i}")))),
    )
    .await;
    let pids: std::collections::HashSet<u32> = leases
        .iter()
        .map(|l| l.as_ref().expect("lease").worker_pid())
        .collect();
    assert_eq!(pids.len(), 1, "one process for one key");
    let status = pool.status().await.expect("status");
    assert_eq!(status.totals.processes_spawned, 1);
    assert_eq!(status.workers[0].conversations, 6);
    drop(leases);
    shutdown_leaves_nothing(&pool).await;
}

#[tokio::test]
async fn twenty_conversations_pack_into_two_processes_within_the_caps() {
    let fx = Fixture::new().await;
    let mut config = fx.config().await;
    config.max_sessions_per_process = 10;
    config.max_processes_per_key = 2;
    let pool = Pool::start(config).await.expect("pool");
    let runs = (0..20).map(|i| {
        let pool = pool.clone();
        let req = fx.request("agent-a", &format!("conv-{i}"));
        async move {
            let mut lease = pool.lease(req).await?;
            let outcome = lease.run(format!("REPLY=answer {i}")).await?;
            Ok::<_, PoolError>((lease.worker_pid(), outcome.text, lease))
        }
    });
    let results = futures_util::future::join_all(runs).await;
    let mut per_pid = std::collections::HashMap::<u32, usize>::new();
    for (i, r) in results.iter().enumerate() {
        let (pid, text, _) = r.as_ref().expect("turn");
        assert_eq!(text, &format!("answer {i}"));
        *per_pid.entry(*pid).or_default() += 1;
    }
    assert_eq!(per_pid.len(), 2, "{per_pid:?}");
    assert!(per_pid.values().all(|n| *n == 10), "{per_pid:?}");
    let status = pool.status().await.expect("status");
    assert!(status.workers.iter().all(|w| w.conversations <= 10));
    assert_eq!(status.totals.processes_spawned, 2);
    drop(results);
    shutdown_leaves_nothing(&pool).await;
}

#[tokio::test]
async fn leases_wait_in_a_bounded_queue_with_a_share_per_agent_and_time_out() {
    let fx = Fixture::new().await;
    let mut config = fx.config().await;
    config.max_processes = 1;
    config.max_processes_per_key = 1;
    config.max_sessions_per_process = 1;
    config.max_waiters = 2;
    config.max_waiters_per_agent = 1;
    let pool = Pool::start(config).await.expect("pool");
    let held = pool
        .lease(fx.request("agent-a", "one"))
        .await
        .expect("first lease");

    let waits = |agent: &str, key: &str| {
        let mut waiting = fx.request(agent, key);
        // Long enough for the steps below on a loaded machine; they end by timing out.
        waiting.wait_timeout = Some(Duration::from_secs(3));
        let pool = pool.clone();
        tokio::spawn(async move { pool.lease(waiting).await })
    };
    let queued = |n: usize| {
        let pool = pool.clone();
        async move {
            let queued = async {
                while pool.status().await.map(|s| s.waiters).unwrap_or(0) != n {
                    tokio::task::yield_now().await;
                }
            };
            tokio::time::timeout(Duration::from_secs(10), queued)
                .await
                .expect("queued");
        }
    };
    let waiter = waits("agent-a", "two");
    queued(1).await;
    // The agent's share of the queue is taken: its next lease is refused, another agent's
    // still waits, and then the queue is full for everyone.
    let overflow = pool.lease(fx.request("agent-a", "three")).await;
    assert!(
        matches!(overflow, Err(PoolError::AgentWaitersFull { max: 1 })),
        "{overflow:?}"
    );
    let other = waits("agent-b", "one");
    queued(2).await;
    let overflow = pool.lease(fx.request("agent-c", "one")).await;
    assert!(
        matches!(overflow, Err(PoolError::WaitersFull { max: 2 })),
        "{overflow:?}"
    );
    // A wait as long as a Duration holds means no limit; it never overflows the pool's
    // own bound on the call.
    let mut forever = fx.request("agent-c", "two");
    forever.wait_timeout = Some(Duration::MAX);
    let overflow = pool.lease(forever).await;
    assert!(
        matches!(overflow, Err(PoolError::WaitersFull { max: 2 })),
        "{overflow:?}"
    );
    let timed_out = other.await.expect("join");
    assert!(
        matches!(timed_out, Err(PoolError::WaitTimeout { .. })),
        "{timed_out:?}"
    );
    let timed_out = waiter.await.expect("join");
    assert!(
        matches!(timed_out, Err(PoolError::WaitTimeout { .. })),
        "{timed_out:?}"
    );

    // Capacity returns with the lease: the only session slot now holds the parked
    // conversation "one", which is detached to make room for "two"…
    drop(held);
    let two = pool
        .lease(fx.request("agent-a", "two"))
        .await
        .expect("lease two");
    let pid = two.worker_pid();
    drop(two);
    // …and "one" resumes on the same process when it comes back.
    let one = pool
        .lease(fx.request("agent-a", "one"))
        .await
        .expect("lease one again");
    assert_eq!(one.worker_pid(), pid);
    assert!(one.reason() != OpenReason::Attached, "{:?}", one.reason());
    let status = pool.status().await.expect("status");
    assert_eq!(status.totals.processes_spawned, 1);
    drop(one);
    shutdown_leaves_nothing(&pool).await;
}

#[tokio::test]
async fn an_agent_keeping_its_cap_of_conversations_is_refused_a_new_one_until_it_deletes_one() {
    let fx = Fixture::new().await;
    let mut config = fx.config().await;
    config.max_conversations_per_agent = Some(2);
    let pool = Pool::start(config.clone()).await.expect("pool");
    for conversation in ["one", "two"] {
        drop(
            pool.lease(fx.request("agent-a", conversation))
                .await
                .expect("lease"),
        );
    }
    let before = pool.status().await.expect("status");
    assert_eq!(before.conversations, 2);
    let refused = pool
        .lease(fx.request("agent-a", "three"))
        .await
        .expect_err("a third conversation");
    assert!(
        matches!(refused, PoolError::AgentConversationsFull { max: 2 }),
        "{refused:?}"
    );
    assert!(refused.to_string().contains("DELETE"), "{refused}");
    assert!(
        pool.bindings()
            .get("agent-a/three")
            .expect("bindings")
            .is_none(),
        "nothing was made for it"
    );
    let after = pool.status().await.expect("status");
    assert_eq!(
        (after.conversations, after.workers.len()),
        (before.conversations, before.workers.len()),
        "no session or process made"
    );
    // Two new ones with one place left: the first takes it, the second is refused.
    drop(
        pool.lease(fx.request("agent-c", "one"))
            .await
            .expect("lease"),
    );
    let (two, three) = tokio::join!(
        pool.lease(fx.request("agent-c", "two")),
        pool.lease(fx.request("agent-c", "three"))
    );
    let refusals = [&two, &three]
        .iter()
        .filter(|r| matches!(r, Err(PoolError::AgentConversationsFull { .. })))
        .count();
    assert!(two.is_ok() && refusals == 1, "{two:?} {three:?}");
    drop((two, three));
    // Its kept conversations go on; another agent's count is its own.
    drop(
        pool.lease(fx.request("agent-a", "one"))
            .await
            .expect("a kept one"),
    );
    drop(
        pool.lease(fx.request("agent-b", "one"))
            .await
            .expect("another agent"),
    );
    // A deleted one frees its place.
    let mut existing = fx.request("agent-a", "two");
    existing.existing_only = true;
    pool.lease(existing)
        .await
        .expect("lease")
        .reset()
        .await
        .expect("deleted");
    drop(
        pool.lease(fx.request("agent-a", "three"))
            .await
            .expect("its place"),
    );
    shutdown_leaves_nothing(&pool).await;
    // A pool started again counts what the state directory keeps.
    let pool = Pool::start(config).await.expect("pool");
    let refused = pool
        .lease(fx.request("agent-a", "four"))
        .await
        .expect_err("a fourth conversation");
    assert!(
        matches!(refused, PoolError::AgentConversationsFull { max: 2 }),
        "{refused:?}"
    );
    drop(
        pool.lease(fx.request("agent-a", "three"))
            .await
            .expect("a kept one"),
    );
    shutdown_leaves_nothing(&pool).await;
}

#[tokio::test]
async fn a_kept_conversation_deleted_while_its_turn_waited_counts_as_new_when_the_turn_opens() {
    let fx = Fixture::new().await;
    let mut config = fx.config().await;
    config.max_conversations_per_agent = Some(2);
    let pool = Pool::start(config).await.expect("pool");
    drop(
        pool.lease(fx.request("agent-a", "two"))
            .await
            .expect("lease"),
    );
    let held = pool
        .lease(fx.request("agent-a", "one"))
        .await
        .expect("lease");
    // A turn of the kept conversation waits for it (passing the count as a kept one)...
    let waiting = tokio::spawn({
        let pool = pool.clone();
        let req = fx.request("agent-a", "one");
        async move { pool.lease(req).await }
    });
    until_a_lease_waits(&pool, "the second lease of one waits").await;
    // ...while its binding goes (what a deletion does to it, done here directly, the session
    // left attached) and a new conversation takes the place.
    pool.bindings().remove("agent-a/one").expect("removed");
    drop(
        pool.lease(fx.request("agent-a", "three"))
            .await
            .expect("its place"),
    );
    drop(held);
    let refused = waiting
        .await
        .expect("task")
        .expect_err("no place left for it");
    assert!(
        matches!(refused, PoolError::AgentConversationsFull { max: 2 }),
        "{refused:?}"
    );
    assert!(pool.bindings().get("agent-a/one").expect("read").is_none());
    shutdown_leaves_nothing(&pool).await;
}

#[tokio::test]
async fn a_stored_session_no_binding_holds_counts_as_new_when_a_caller_names_it() {
    let fx = Fixture::new().await;
    let mut config = fx.config().await;
    config.max_conversations_per_agent = Some(1);
    let pool = Pool::start(config.clone()).await.expect("pool");
    let mut first = pool
        .lease(fx.request("agent-a", "first"))
        .await
        .expect("lease");
    first
        .run("REPLY=stored")
        .await
        .expect("a turn, so the session is stored");
    let stored = first.cli_session_id().clone();
    drop(first);
    // Its binding gone, its session stays in the home (its process gone with the pool).
    pool.bindings().remove("agent-a/first").expect("removed");
    shutdown_leaves_nothing(&pool).await;
    let pool = Pool::start(config).await.expect("pool");
    drop(
        pool.lease(fx.request("agent-a", "other"))
            .await
            .expect("its place"),
    );
    // A caller naming that session (the SDK endpoint's resume) would bind it anew: refused
    // before anything is made for it.
    let mut named = fx.request("agent-a", "named");
    named.existing_only = true;
    named.cli_session_id = Some(stored);
    let before = pool.status().await.expect("status");
    let refused = pool.lease(named).await.expect_err("no place left for it");
    let after = pool.status().await.expect("status");
    assert_eq!(
        (after.workers.len(), after.conversations),
        (before.workers.len(), before.conversations),
        "nothing made for it"
    );
    assert!(
        matches!(refused, PoolError::AgentConversationsFull { max: 1 }),
        "{refused:?}"
    );
    assert!(
        pool.bindings()
            .get("agent-a/named")
            .expect("read")
            .is_none()
    );
    shutdown_leaves_nothing(&pool).await;
}

#[tokio::test]
async fn a_crash_restarts_the_worker_and_the_conversation_resumes_with_its_history() {
    let fx = Fixture::new().await;
    let mut config = fx.config().await;
    // The lease itself resumes the conversation here; with a warm spare (the default) the
    // replacement resumes it ahead of the lease (`a_resume_ahead_that_ends_…` below).
    config.warm_spares = 0;
    let pool = Pool::start(config).await.expect("pool");
    let mut events = pool.subscribe();
    let mut lease = pool
        .lease(fx.request("agent-a", "conv"))
        .await
        .expect("lease");
    let first_id = lease.cli_session_id().to_owned();
    let outcome = lease
        .run("REPLY=noted MARKER-crash-41")
        .await
        .expect("turn");
    assert_eq!(outcome.text, "noted MARKER-crash-41");
    let pid = lease.worker_pid();
    drop(lease);

    kill(Pid::from_raw(pid as i32), Signal::SIGKILL).expect("kill");
    wait_event(
        &mut events,
        |e| matches!(e, PoolEvent::WorkerCrashed { pid: p, .. } if *p == pid),
    )
    .await;
    let started = wait_event(&mut events, |e| {
        matches!(e, PoolEvent::WorkerStarted { restart: true, .. })
    })
    .await;

    let mut lease = pool
        .lease(fx.request("agent-a", "conv"))
        .await
        .expect("lease after crash");
    assert_eq!(lease.reason(), OpenReason::Resumed);
    assert_eq!(lease.cli_session_id(), &first_id);
    let PoolEvent::WorkerStarted { pid: new_pid, .. } = started else {
        unreachable!()
    };
    assert_eq!(lease.worker_pid(), new_pid);
    lease
        .run("what was the marker?")
        .await
        .expect("turn after crash");
    let history = fx.last_model_request();
    assert!(
        history.contains("MARKER-crash-41"),
        "history lost: {history}"
    );
    let status = pool.status().await.expect("status");
    assert_eq!(status.totals.restarts, 1);
    assert_eq!(status.totals.crashes, 1);
    drop(lease);
    assert!(
        wait_group_gone(pid, Duration::from_secs(5))
            .await
            .is_empty()
    );
    shutdown_leaves_nothing(&pool).await;
}

#[tokio::test]
async fn a_process_killed_from_outside_is_replaced_unprimed_so_its_conversation_waits_for_no_priming_turn()
 {
    let fx = Fixture::new().await;
    let mut config = fx.config().await;
    // A warm spare per key (the default) and every served process counted as killed from
    // outside (replaced at once): the spare must not race the replacement.
    config.warm_spares = 1;
    config.restart.healthy_after = Duration::ZERO;
    let pool = Pool::start(config).await.expect("pool");
    let mut events = pool.subscribe();
    let pid = one_turn(&pool, &fx, "conv", "REPLY=one").await;

    kill(Pid::from_raw(pid as i32), Signal::SIGKILL).expect("kill");
    let (new_pid, primed) = match wait_event(
        &mut events,
        |e| matches!(e, PoolEvent::WorkerStarted { pid: p, .. } if *p != pid),
    )
    .await
    {
        PoolEvent::WorkerStarted {
            pid,
            primed,
            restart,
            ..
        } => {
            assert!(restart, "the first start after the kill is its replacement");
            (pid, primed)
        }
        other => unreachable!("{other:?}"),
    };
    assert_eq!(
        primed, None,
        "no priming turn ahead of the returning conversation"
    );
    let mut lease = pool
        .lease(fx.request("agent-a", "conv"))
        .await
        .expect("lease after the kill");
    assert_eq!(lease.worker_pid(), new_pid);
    lease.run("REPLY=two").await.expect("turn after the kill");
    drop(lease);
    let status = pool.status().await.expect("status");
    assert_eq!(status.workers.len(), 1, "{status:?}");
    shutdown_leaves_nothing(&pool).await;
}

#[tokio::test]
async fn restart_intensity_quarantines_a_key_until_the_cool_down_ends() {
    let fx = Fixture::new().await;
    let mut config = fx.config().await;
    config.restart = RestartPolicy {
        max_restarts: 1,
        window: Duration::from_secs(30),
        cooldown: Duration::from_secs(2),
        // Every death here counts as a crash loop, however long the worker served.
        healthy_after: Duration::from_secs(3600),
        ..RestartPolicy::default()
    };
    let pool = Pool::start(config).await.expect("pool");
    let mut events = pool.subscribe();
    let mut pid = one_turn(&pool, &fx, "conv", "REPLY=one").await;
    // Crash 1 is restarted; crash 2 exceeds the intensity.
    kill(Pid::from_raw(pid as i32), Signal::SIGKILL).expect("kill");
    if let PoolEvent::WorkerStarted { pid: p, .. } = wait_event(&mut events, |e| {
        matches!(e, PoolEvent::WorkerStarted { restart: true, .. })
    })
    .await
    {
        pid = p;
    }
    // The restarted worker holds no conversation now (it was lost with the crash); lease it
    // again so the next crash has demand.
    let mut lease = pool
        .lease(fx.request("agent-a", "conv"))
        .await
        .expect("lease");
    lease.run("REPLY=two").await.expect("turn");
    drop(lease);
    kill(Pid::from_raw(pid as i32), Signal::SIGKILL).expect("kill");
    wait_event(&mut events, |e| {
        matches!(e, PoolEvent::KeyQuarantined { .. })
    })
    .await;

    let refused = pool.lease(fx.request("agent-a", "conv")).await;
    let Err(PoolError::RestartIntensityExceeded { retry_after, .. }) = refused else {
        panic!("expected quarantine, got {refused:?}")
    };
    assert!(retry_after <= Duration::from_secs(2));
    // The cool-down is a duration by design: wait it out.
    tokio::time::sleep(retry_after + Duration::from_millis(100)).await;
    let mut lease = pool
        .lease(fx.request("agent-a", "conv"))
        .await
        .expect("lease after cool-down");
    assert_eq!(lease.reason(), OpenReason::Resumed);
    lease
        .run("REPLY=three")
        .await
        .expect("turn after cool-down");
    drop(lease);
    shutdown_leaves_nothing(&pool).await;
}

#[tokio::test]
async fn token_rotation_drains_the_old_process_and_keeps_the_conversation() {
    let fx = Fixture::new().await;
    let pool = Pool::start(fx.config().await).await.expect("pool");
    let mut events = pool.subscribe();
    let mut req = fx.request("agent-a", "conv");
    req.auth = token("v1");
    let mut lease = pool.lease(req.clone()).await.expect("lease v1");
    let id = lease.cli_session_id().to_owned();
    lease
        .run("REPLY=ok MARKER-rotate-7")
        .await
        .expect("turn v1");
    let old_pid = lease.worker_pid();
    drop(lease);

    req.auth = token("v2");
    let mut lease = pool.lease(req).await.expect("lease v2");
    assert_ne!(
        lease.worker_pid(),
        old_pid,
        "a rotated token needs a new process"
    );
    assert_eq!(lease.reason(), OpenReason::Resumed);
    assert_eq!(
        lease.cli_session_id(),
        &id,
        "same conversation after rotation"
    );
    wait_event(
        &mut events,
        |e| matches!(e, PoolEvent::WorkerEvicted { pid, .. } if *pid == old_pid),
    )
    .await;
    lease.run("and the marker?").await.expect("turn v2");
    assert!(fx.last_model_request().contains("MARKER-rotate-7"));
    let status = pool.status().await.expect("status");
    assert_eq!(status.workers.len(), 1);
    assert_eq!(status.totals.evicted, 1);
    assert!(
        wait_group_gone(old_pid, Duration::from_secs(5))
            .await
            .is_empty()
    );
    drop(lease);
    shutdown_leaves_nothing(&pool).await;
}

#[tokio::test]
async fn token_rotation_after_the_old_process_idled_out_stops_the_old_tokens_warm_spare() {
    let fx = Fixture::new().await;
    // The spare holds none of the conversations: the conversation is attached to nothing old.
    let pool = Pool::start(idles_into_a_bare_spare(&fx).await)
        .await
        .expect("pool");
    let mut events = pool.subscribe();
    let mut req = fx.request("agent-a", "conv");
    req.auth = token("v1");
    let mut lease = pool.lease(req.clone()).await.expect("lease v1");
    lease.run("REPLY=one").await.expect("turn v1");
    let old_pid = lease.worker_pid();
    drop(lease);
    let spare_pid = match wait_event(
        &mut events,
        |e| matches!(e, PoolEvent::WorkerStarted { pid, .. } if *pid != old_pid),
    )
    .await
    {
        PoolEvent::WorkerStarted { pid, .. } => pid,
        other => unreachable!("{other:?}"),
    };

    req.auth = token("v2");
    let mut lease = pool.lease(req).await.expect("lease v2");
    assert_ne!(lease.worker_pid(), spare_pid, "the spare has the old token");
    lease.run("REPLY=two").await.expect("turn v2");
    wait_event(&mut events, |e| {
        matches!(e, PoolEvent::WorkerEvicted { pid, reason: Eviction::Drained, .. }
            if *pid == spare_pid)
    })
    .await;
    let status = pool.status().await.expect("status");
    assert!(
        status.workers.iter().all(|w| w.pid != spare_pid),
        "the old token's spare is gone: {status:?}"
    );
    assert!(
        wait_group_gone(spare_pid, Duration::from_secs(5))
            .await
            .is_empty()
    );
    drop(lease);
    shutdown_leaves_nothing(&pool).await;
}

#[tokio::test]
async fn a_byok_endpoint_change_starts_a_new_session() {
    let fx = Fixture::new().await;
    let pool = Pool::start(fx.config().await).await.expect("pool");
    let mut req = fx.request("agent-a", "conv");
    let mut lease = pool.lease(req.clone()).await.expect("lease");
    lease.run("REPLY=first").await.expect("turn");
    let first = lease.cli_session_id().to_owned();
    let first_pid = lease.worker_pid();
    drop(lease);
    let mut provider = fx.provider();
    provider.headers = Some([("X-Tenant".to_owned(), "other".to_owned())].into());
    req.provider = Some(provider);
    let lease = pool.lease(req).await.expect("lease with new headers");
    assert_eq!(lease.reason(), OpenReason::CompatChanged);
    assert_ne!(lease.cli_session_id(), &first);
    assert_ne!(
        lease.worker_pid(),
        first_pid,
        "another endpoint, another worker"
    );
    drop(lease);
    shutdown_leaves_nothing(&pool).await;
}

#[tokio::test]
async fn a_byok_key_rotation_drains_the_old_process_and_keeps_the_conversation() {
    let fx = Fixture::new().await;
    let pool = Pool::start(fx.config().await).await.expect("pool");
    let mut events = pool.subscribe();
    let mut req = fx.request("agent-a", "conv");
    let mut lease = pool.lease(req.clone()).await.expect("lease with key 1");
    let id = lease.cli_session_id().to_owned();
    lease
        .run("REPLY=ok MARKER-key-rotate-3")
        .await
        .expect("turn with key 1");
    let old_pid = lease.worker_pid();
    drop(lease);

    req.provider = Some(ProviderConfig::openai(
        fx.endpoint.base_url(),
        Some(Secret::new("rotated-key")),
    ));
    let mut lease = pool.lease(req).await.expect("lease with key 2");
    assert_ne!(
        lease.worker_pid(),
        old_pid,
        "a rotated key gets a new process"
    );
    assert_eq!(lease.reason(), OpenReason::Resumed);
    assert_eq!(
        lease.cli_session_id(),
        &id,
        "same conversation after rotation"
    );
    wait_event(
        &mut events,
        |e| matches!(e, PoolEvent::WorkerEvicted { pid, .. } if *pid == old_pid),
    )
    .await;
    lease.run("and the marker?").await.expect("turn with key 2");
    assert!(fx.last_model_request().contains("MARKER-key-rotate-3"));
    let last = fx.model.requests().pop().expect("a model request");
    assert_eq!(last.header("authorization"), ["Bearer rotated-key"]);
    let status = pool.status().await.expect("status");
    assert_eq!(status.workers.len(), 1);
    assert_eq!(status.totals.evicted, 1);
    assert!(
        wait_group_gone(old_pid, Duration::from_secs(5))
            .await
            .is_empty()
    );
    drop(lease);
    shutdown_leaves_nothing(&pool).await;
}

/// The text of the binding file under `state_dir` that names the CLI session `id`.
fn binding_file_naming(state_dir: &std::path::Path, id: &str) -> String {
    let files = std::fs::read_dir(state_dir.join("bindings")).expect("the bindings directory");
    files
        .filter_map(|entry| std::fs::read_to_string(entry.ok()?.path()).ok())
        .find(|text| text.contains(&format!("\"{id}\"")))
        .unwrap_or_else(|| panic!("no binding names {id}"))
}

#[tokio::test]
async fn a_pool_restarted_on_its_state_resumes_from_bindings_or_reports_missing_transcripts() {
    let fx = Fixture::new().await;
    let pool = Pool::start(fx.config().await).await.expect("pool");
    let mut kept = pool
        .lease(fx.request("agent-a", "kept"))
        .await
        .expect("lease");
    kept.run("REPLY=ok MARKER-durable-3").await.expect("turn");
    let kept_id = kept.cli_session_id().to_owned();
    drop(kept);
    let mut lost = pool
        .lease(fx.request("agent-a", "lost"))
        .await
        .expect("lease");
    lost.run("REPLY=ok").await.expect("turn");
    let lost_id = lost.cli_session_id().to_owned();
    drop(lost);
    shutdown_leaves_nothing(&pool).await;

    let home = fx.scratch.path().join("agents/agents/agent-a/copilot");
    let home = if home.exists() {
        home
    } else {
        fx.scratch.path().join("agents/agent-a/copilot")
    };
    std::fs::remove_dir_all(home.join("session-state").join(lost_id.as_str()))
        .expect("remove state");

    let config = fx.config().await;
    let kept_binding = || binding_file_naming(&config.state_dir, kept_id.as_str());
    let recorded = |text: &str| {
        serde_json::from_str::<serde_json::Value>(text).expect("JSON")["working_directory"]
            .as_str()
            .map(str::to_owned)
    };
    let work = recorded(&kept_binding()).expect("the binding records its directory");
    // As a version before the record wrote it: no directory.
    let mut earlier: serde_json::Value = serde_json::from_str(&kept_binding()).expect("JSON");
    earlier
        .as_object_mut()
        .expect("an object")
        .remove("working_directory");
    let file = config.state_dir.join("bindings").join(format!(
        "{}.json",
        copilot_pool::ids::sha256_hex("agent-a/kept")
    ));
    std::fs::write(&file, earlier.to_string()).expect("the earlier binding");
    let pool = Pool::start(config.clone()).await.expect("pool again");
    let kept = pool
        .lease(fx.request("agent-a", "kept"))
        .await
        .expect("lease");
    assert_eq!(kept.reason(), OpenReason::Resumed);
    assert_eq!(kept.cli_session_id(), &kept_id);
    // Resumed by a binding without the directory: written once, with it.
    let stored = kept_binding();
    assert_eq!(recorded(&stored).as_deref(), Some(work.as_str()));
    drop(kept);
    shutdown_leaves_nothing(&pool).await;
    let pool = Pool::start(config.clone())
        .await
        .expect("pool a third time");
    let mut kept = pool
        .lease(fx.request("agent-a", "kept"))
        .await
        .expect("lease");
    assert_eq!(kept.reason(), OpenReason::Resumed);
    // Resumed by its binding, which already names the session: not written again.
    assert_eq!(kept_binding(), stored);
    kept.run("the marker?").await.expect("turn");
    assert!(fx.last_model_request().contains("MARKER-durable-3"));
    let lost = pool
        .lease(fx.request("agent-a", "lost"))
        .await
        .expect("lease");
    assert_eq!(lost.reason(), OpenReason::TranscriptMissing);
    assert_ne!(lost.cli_session_id(), &lost_id);
    drop((kept, lost));
    shutdown_leaves_nothing(&pool).await;
}

#[tokio::test]
async fn one_turn_at_a_time_and_one_owner_per_session_id() {
    let fx = Fixture::new().await;
    let pool = Pool::start(fx.config().await).await.expect("pool");
    let mut req = fx.request("agent-a", "conv");
    req.auth = token("v1");
    let mut first = pool.lease(req.clone()).await.expect("lease");
    first.run("REPLY=ok MARKER-owner-5").await.expect("turn");

    // A second lease of a busy conversation fails fast when asked to…
    let mut busy = req.clone();
    busy.fail_if_busy = true;
    let refused = pool.lease(busy).await;
    assert!(
        matches!(refused, Err(PoolError::ConversationBusy { .. })),
        "{refused:?}"
    );

    // …says so when the conversation stays leased for the whole wait…
    let mut patient = req.clone();
    patient.wait_timeout = Some(Duration::from_millis(300));
    let waited = pool.lease(patient).await;
    assert!(
        matches!(waited, Err(PoolError::ConversationWaitTimeout { ref session_key, .. }) if session_key == "conv"),
        "{waited:?}"
    );

    // …and otherwise queues behind it, even on another process (rotated token).
    let mut rotated = req.clone();
    rotated.auth = token("v2");
    let second = tokio::spawn({
        let pool = pool.clone();
        async move { pool.lease(rotated).await }
    });
    assert!(
        tokio::time::timeout(Duration::from_millis(300), async {
            while !second.is_finished() {
                tokio::task::yield_now().await
            }
        })
        .await
        .is_err(),
        "the second lease must wait for the first"
    );
    let old_pid = first.worker_pid();
    drop(first);
    let mut second = second.await.expect("join").expect("second lease");
    assert_ne!(second.worker_pid(), old_pid);
    assert_eq!(second.reason(), OpenReason::Resumed);
    second.run("the marker?").await.expect("turn");
    // No split brain: the resumed session carries the first process's turn.
    assert!(fx.last_model_request().contains("MARKER-owner-5"));
    let status = pool.status().await.expect("status");
    let attached: usize = status.workers.iter().map(|w| w.conversations).sum();
    assert_eq!(attached, 1, "the session is attached to exactly one worker");
    drop(second);
    shutdown_leaves_nothing(&pool).await;
}

#[tokio::test]
async fn shutdown_aborts_running_turns_after_the_grace_and_leaves_no_process() {
    let fx = Fixture::new().await;
    let mut config = fx.config().await;
    config.shutdown_grace = Duration::from_millis(300);
    let pool = Pool::start(config).await.expect("pool");
    let mut lease = pool
        .lease(fx.request("agent-a", "conv"))
        .await
        .expect("lease");
    lease
        .send("SCENARIO:slow SLOW=200x100")
        .await
        .expect("send");
    let pid = lease.worker_pid();
    let turn = tokio::spawn(async move {
        let outcome = lease.wait_idle().await;
        (outcome, lease)
    });
    let report = pool.shutdown().await.expect("shutdown");
    assert_eq!(report.aborted_leases, 1);
    let (outcome, _lease) = turn.await.expect("join");
    match outcome {
        Ok(o) => assert!(o.aborted, "{o:?}"),
        Err(e) => assert!(matches!(e, PoolError::Worker(_)), "{e}"),
    }
    assert!(
        wait_group_gone(pid, Duration::from_secs(5))
            .await
            .is_empty()
    );
    let after = pool.lease(fx.request("agent-a", "conv")).await;
    assert!(matches!(after, Err(PoolError::Closed)), "{after:?}");
}

/// A runtime script that runs `body` before (maybe) exec'ing the real runtime.
fn runtime_wrapper(
    fx: &Fixture,
    real: &std::path::Path,
    name: &str,
    body: &str,
) -> std::path::PathBuf {
    let script = fx.scratch.path().join(name);
    std::fs::write(
        &script,
        format!(
            "#!/bin/sh\n{body}\nexec '{rt}' \"$@\"\n",
            rt = real.display()
        ),
    )
    .expect("script");
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    script
}

#[tokio::test]
async fn a_failed_spawn_is_not_cached_and_its_waiter_is_served_by_the_retry() {
    let fx = Fixture::new().await;
    let mut config = fx.config().await;
    // A runtime that fails its first start, then works.
    let marker = fx.scratch.path().join("failed-once");
    config.worker.program = runtime_wrapper(
        &fx,
        &config.worker.program,
        "flaky-runtime.sh",
        &format!(
            "if [ ! -e '{m}' ]; then touch '{m}'; echo 'first start fails' >&2; exit 3; fi",
            m = marker.display()
        ),
    );
    config.restart.first_retry = Duration::from_millis(50);
    let pool = Pool::start(config).await.expect("pool");
    let mut events = pool.subscribe();
    // The failed start schedules a retry; the lease waits for it instead of failing.
    let mut lease = pool
        .lease(fx.request("agent-a", "conv"))
        .await
        .expect("the waiter is served by the retry");
    assert!(marker.exists(), "the first start ran and failed");
    wait_event(&mut events, |e| {
        matches!(e, PoolEvent::WorkerStarted { .. })
    })
    .await;
    lease.run("REPLY=works now").await.expect("turn");
    drop(lease);
    let status = pool.status().await.expect("status");
    assert_eq!(status.totals.processes_spawned, 1);
    shutdown_leaves_nothing(&pool).await;
}

#[tokio::test]
async fn a_runtime_that_never_starts_fails_its_waiter_with_the_start_error_not_a_bare_timeout() {
    let fx = Fixture::new().await;
    let mut config = fx.config().await;
    config.worker.program = runtime_wrapper(
        &fx,
        &config.worker.program,
        "broken-runtime.sh",
        "echo 'this runtime never starts' >&2; exit 3",
    );
    config.restart.first_retry = Duration::from_millis(50);
    config.restart.backoff_base = Duration::from_millis(200);
    let pool = Pool::start(config).await.expect("pool");
    let mut req = fx.request("agent-a", "conv");
    req.wait_timeout = Some(Duration::from_millis(600));
    let result = pool.lease(req).await;
    let Err(PoolError::Worker(error)) = &result else {
        panic!("expected the start error, got {result:?}")
    };
    assert!(
        error.to_string().contains("this runtime never starts"),
        "{error}"
    );
    shutdown_leaves_nothing(&pool).await;
}

#[tokio::test]
async fn idle_workers_are_evicted_and_conversations_resume_afterwards() {
    let fx = Fixture::new().await;
    let mut config = fx.config().await;
    config.idle_ttl = Duration::from_millis(300);
    // The lease resumes the conversation itself here (a warm spare, the default, would
    // stand in for the idled process and resume it ahead: tests further down).
    config.warm_spares = 0;
    let pool = Pool::start(config).await.expect("pool");
    let mut events = pool.subscribe();
    let pid = one_turn(&pool, &fx, "conv", "REPLY=ok MARKER-idle-9").await;
    let evicted = wait_event(&mut events, |e| {
        matches!(e, PoolEvent::WorkerEvicted { .. })
    })
    .await;
    assert!(
        matches!(
            evicted,
            PoolEvent::WorkerEvicted { pid: p, reason: Eviction::Idle, .. } if p == pid
        ),
        "{evicted:?}"
    );
    assert!(
        wait_group_gone(pid, Duration::from_secs(5))
            .await
            .is_empty()
    );
    let mut lease = pool
        .lease(fx.request("agent-a", "conv"))
        .await
        .expect("lease again");
    assert_eq!(lease.reason(), OpenReason::Resumed);
    assert_ne!(lease.worker_pid(), pid);
    lease.run("the marker?").await.expect("turn");
    assert!(fx.last_model_request().contains("MARKER-idle-9"));
    drop(lease);
    shutdown_leaves_nothing(&pool).await;
}

#[tokio::test]
async fn a_zero_maintenance_interval_is_refused_at_start_naming_what_to_set() {
    let fx = Fixture::new().await;
    let mut config = fx.config().await;
    // With no tick, idle processes would never be evicted nor keys pruned.
    config.maintenance_interval = Duration::ZERO;
    let refused = Pool::start(config).await.expect_err("refused");
    assert!(
        matches!(&refused, PoolError::InvalidRequest(m)
            if m.contains("maintenance_interval") && m.contains("default is 1s")),
        "{refused}"
    );
    assert_eq!(refused.kind(), copilot_pool::kinds::ErrorKind::Invalid);
}

#[tokio::test]
async fn a_worker_is_recycled_after_its_turn_budget() {
    let fx = Fixture::new().await;
    let mut config = fx.config().await;
    config.max_turns_per_process = 3;
    let pool = Pool::start(config).await.expect("pool");
    let mut events = pool.subscribe();
    let mut lease = pool
        .lease(fx.request("agent-a", "conv"))
        .await
        .expect("lease");
    for i in 0..3 {
        lease
            .run(format!("REPLY=turn {i} MARKER-recycle-2"))
            .await
            .expect("turn");
    }
    let pid = lease.worker_pid();
    drop(lease);
    wait_event(
        &mut events,
        |e| matches!(e, PoolEvent::WorkerEvicted { pid: p, reason: Eviction::Drained, .. } if *p == pid),
    )
    .await;
    let reason = fx
        .goes_on_elsewhere(&pool, "agent-a", "conv", pid, "MARKER-recycle-2")
        .await;
    assert_eq!(reason, OpenReason::Resumed);
    shutdown_leaves_nothing(&pool).await;
}

#[tokio::test]
async fn a_changed_working_directory_starts_a_new_session_even_when_attached() {
    let fx = Fixture::new().await;
    let pool = Pool::start(fx.config().await).await.expect("pool");
    let mut lease = pool
        .lease(fx.request("agent-a", "conv"))
        .await
        .expect("lease");
    lease.run("REPLY=first").await.expect("turn");
    let first = lease.cli_session_id().to_owned();
    drop(lease);
    let mut moved = fx.request("agent-a", "conv");
    let elsewhere = fx.scratch.path().join("elsewhere");
    std::fs::create_dir_all(&elsewhere).expect("dir");
    moved.working_directory = elsewhere;
    let lease = pool.lease(moved).await.expect("lease in another directory");
    assert_eq!(lease.reason(), OpenReason::CompatChanged);
    assert_ne!(lease.cli_session_id(), &first);
    drop(lease);
    shutdown_leaves_nothing(&pool).await;
}

#[tokio::test]
async fn a_lease_cancelled_while_opening_on_a_silent_runtime_gives_its_slot_back_and_stops_that_runtime()
 {
    let fx = Fixture::new().await;
    let mut config = fx.config().await;
    // Each round's process count is the subject: no warm spare stands in for the stopped one.
    config.warm_spares = 0;
    // A peer that completes the handshake and then never answers session.create: every
    // lease hangs while opening its conversation, after the pool granted it a worker.
    let script = fx.scratch.path().join("silent-peer.sh");
    let connect =
        r#"{"jsonrpc":"2.0","id":1,"result":{"ok":true,"protocolVersion":3,"version":"silent"}}"#;
    std::fs::write(
        &script,
        format!(
            "#!/bin/sh\nprintf 'Content-Length: {}\\r\\n\\r\\n%s' '{connect}'\nexec sleep 3600\n",
            connect.len()
        ),
    )
    .expect("script");
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    config.worker.program = script;
    config.worker.health_interval = Duration::ZERO;
    // The open gives up after this; so does the detach of the session it may have opened.
    config.worker.request_timeout = Duration::from_millis(500);
    let pool = Pool::start(config).await.expect("pool");
    let mut events = pool.subscribe();
    let mut pids = Vec::new();
    // A token lease: the peer speaks no model tunnel (a BYOK lease's process would first
    // need its answer to `llmInference.setProvider`).
    let mut silent = fx.request("agent-a", "conv");
    silent.provider = None;
    silent.auth = token("v1");
    for round in 1..=2 {
        // Cancelled once the pool has granted it a process (its open is under way).
        let granted = async {
            loop {
                if pool.status().await.map(|s| s.leased).unwrap_or(0) == 1 {
                    break;
                }
                tokio::task::yield_now().await;
            }
        };
        tokio::select! {
            opened = pool.lease(silent.clone()) => {
                panic!("the silent peer must keep the lease opening: {:?}", opened.map(|_| ()))
            }
            _ = tokio::time::timeout(Duration::from_secs(30), granted) => {}
        }
        // The open went on without its caller, timed out, and the session it may have
        // opened could not be detached: the process that may hold it is stopped, and only
        // then is the slot free again.
        let evicted = wait_event(&mut events, |e| {
            matches!(e, PoolEvent::WorkerEvicted { .. })
        })
        .await;
        if let PoolEvent::WorkerEvicted { pid, .. } = evicted {
            pids.push(pid);
        }
        let released = async {
            loop {
                let status = pool.status().await.expect("status");
                if status.leased == 0 && status.conversations == 0 && status.workers.is_empty() {
                    break status;
                }
                tokio::task::yield_now().await;
            }
        };
        let status = tokio::time::timeout(Duration::from_secs(10), released)
            .await
            .expect("the cancelled lease leaked its slot");
        assert_eq!(status.totals.processes_spawned, round);
    }
    for pid in pids {
        let left = wait_group_gone(pid, Duration::from_secs(5)).await;
        assert!(left.is_empty(), "group {pid} left behind: {left:?}");
    }
    shutdown_leaves_nothing(&pool).await;
}

#[tokio::test]
async fn two_agents_with_the_same_session_key_are_two_conversations() {
    let fx = Fixture::new().await;
    let pool = Pool::start(fx.config().await).await.expect("pool");
    let mut a = pool
        .lease(fx.request("agent-a", "shared"))
        .await
        .expect("lease a");
    a.run("REPLY=a MARKER-agent-a").await.expect("turn a");
    let a_id = a.cli_session_id().to_owned();
    drop(a);
    let mut b = pool
        .lease(fx.request("agent-b", "shared"))
        .await
        .expect("lease b");
    b.run("REPLY=b").await.expect("turn b");
    assert_ne!(b.cli_session_id(), &a_id);
    assert!(!fx.last_model_request().contains("MARKER-agent-a"));
    drop(b);
    let a = pool
        .lease(fx.request("agent-a", "shared"))
        .await
        .expect("lease a again");
    assert_eq!(a.reason(), OpenReason::Attached);
    assert_eq!(a.cli_session_id(), &a_id);
    drop(a);
    shutdown_leaves_nothing(&pool).await;
}

#[tokio::test]
async fn a_process_killed_every_two_seconds_is_replaced_each_time_and_its_key_never_quarantined() {
    // SIGKILLs from outside (an operator, the OOM killer) of a process that serves: more of
    // them than the restart intensity allows for a crash loop (5 in 30 s by default).
    let fx = Fixture::new().await;
    let pool = Pool::start(fx.config().await).await.expect("pool");
    // Issue 15's test: a kill every 2 s for 60 s.
    let storm = Duration::from_secs(60);
    let end = tokio::time::Instant::now() + storm;
    let killer = {
        let pool = pool.clone();
        tokio::spawn(async move {
            let mut kills = 0;
            // The storm's own schedule: a kill every 2 s (not a wait for anything).
            let mut tick = tokio::time::interval(Duration::from_secs(2));
            tick.tick().await;
            while tokio::time::Instant::now() < end {
                tick.tick().await;
                if let Ok(status) = pool.status().await {
                    for worker in status.workers {
                        if kill(Pid::from_raw(worker.pid as i32), Signal::SIGKILL).is_ok() {
                            kills += 1;
                        }
                    }
                }
            }
            kills
        })
    };
    let (mut ok, mut crashed) = (0u32, 0u32);
    while tokio::time::Instant::now() < end {
        let mut lease = match pool.lease(fx.request("agent-a", "conv")).await {
            Ok(lease) => lease,
            Err(error @ PoolError::RestartIntensityExceeded { .. }) => {
                panic!("quarantined after {ok} turns and {crashed} crashes: {error}")
            }
            // The process died while the conversation was being opened on it.
            Err(_) => {
                crashed += 1;
                continue;
            }
        };
        match lease.run(format!("REPLY=turn {ok}")).await {
            Ok(outcome) if outcome.error.is_none() => ok += 1,
            _ => crashed += 1,
        }
    }
    let kills = killer.await.expect("killer");
    assert!(kills > 5, "the storm killed only {kills} processes");
    assert!(ok > kills, "{ok} turns succeeded against {kills} kills");
    // After the storm the conversation goes on with its history. The storm's last kill may
    // have landed just now, before the pool heard of it: that turn ends crashed and the
    // next one resumes, as every turn of the storm did.
    let mut after = None;
    for _ in 0..2 {
        let mut lease = pool
            .lease(fx.request("agent-a", "conv"))
            .await
            .expect("lease after the storm");
        if let Ok(outcome) = lease.run("REPLY=after the storm").await
            && outcome.error.is_none()
        {
            after = Some(lease.reason());
            break;
        }
    }
    let reason = after.expect("a turn after the storm succeeds by its second try");
    assert_ne!(reason, OpenReason::New, "the history was kept");
    let status = pool.status().await.expect("status");
    assert!(status.quarantined_keys.is_empty());
    eprintln!("storm: {kills} kills, {ok} turns ok, {crashed} crashed");
    shutdown_leaves_nothing(&pool).await;
}

#[tokio::test]
async fn a_returning_agents_new_conversation_starts_on_its_warm_spare_without_waiting_for_a_start()
{
    let fx = Fixture::new().await;
    // Without a spare, the agent's next conversation would wait for a start and handshake.
    // (Resumes ahead have their own test.)
    let pool = Pool::start(idles_into_a_bare_spare(&fx).await)
        .await
        .expect("pool");
    let mut events = pool.subscribe();

    let mut first = pool
        .lease(fx.request("agent-a", "conv-1"))
        .await
        .expect("first lease");
    let first_pid = first.worker_pid();
    let outcome = first.run("REPLY=one").await.expect("turn");
    assert_eq!(outcome.text, "one");
    // A process a lease waited for was not primed, and says nothing of it; while it serves
    // (it has room for more), no spare stands beside it.
    let status = pool.status().await.expect("status");
    let first_status = status
        .workers
        .iter()
        .find(|w| w.pid == first_pid)
        .expect("the first process");
    assert_eq!(first_status.primed, None);
    assert_eq!(status.workers.len(), 1, "{status:?}");
    drop(first);

    // The agent had traffic: once its process idled out, a spare stands in for it, primed by
    // a throwaway turn whose model call the guard answered (the runtime's failure path costs
    // it ~30 MiB).
    let (spare_pid, primed) = match wait_event(
        &mut events,
        |e| matches!(e, PoolEvent::WorkerStarted { pid, .. } if *pid != first_pid),
    )
    .await
    {
        PoolEvent::WorkerStarted { pid, primed, .. } => (pid, primed),
        other => unreachable!("{other:?}"),
    };
    assert_eq!(primed, Some(Priming::Answered));
    let (status, spare) = status_with_worker(&pool, spare_pid).await;
    assert_eq!(spare.state, WorkerState::Spare);
    assert_eq!(spare.conversations, 0);
    assert_eq!(spare.primed, Some(Priming::Answered));
    let json = serde_json::to_value(&status).expect("status json");
    assert!(
        json["processes"].as_array().is_some_and(|ps| ps
            .iter()
            .any(|p| p["state"] == "spare" && p["primed"] == "answered")),
        "/v1/pool shows the spare and its priming: {json}"
    );
    assert!(
        status.workers.iter().all(|w| w.pid != first_pid),
        "the first process idled out: {status:?}"
    );

    // A new conversation of the returning agent takes the spare, started before the lease
    // asked: no start on its path.
    let mut second = pool
        .lease(fx.request("agent-a", "conv-2"))
        .await
        .expect("second lease");
    assert_eq!(second.worker_pid(), spare_pid);
    let outcome = second.run("REPLY=two").await.expect("turn");
    assert_eq!(outcome.text, "two");
    assert_eq!(outcome.open_reason, Some(OpenReason::New));
    drop(second);
    shutdown_leaves_nothing(&pool).await;

    // The spare was primed with a throwaway turn before it was reported started: that
    // session is gone from the agent's home (only the two conversations are stored), and
    // its model call never reached the model.
    let stored = std::fs::read_dir(
        fx.scratch
            .path()
            .join("agents/agents/agent-a/copilot/session-state"),
    )
    .expect("the agent's session state")
    .count();
    assert_eq!(stored, 2, "only the two conversations are stored");
    assert_eq!(fx.model.requests().len(), 2, "one model call per real turn");
}

#[tokio::test]
async fn a_returning_agents_conversation_is_resumed_on_its_warm_spare_ahead_so_its_turn_starts_attached()
 {
    let fx = Fixture::new().await;
    let mut config = fx.config().await;
    config.idle_ttl = Duration::from_millis(500);
    config.warm_spares = 1;
    let pool = Pool::start(config).await.expect("pool");
    let mut events = pool.subscribe();

    let mut lease = pool
        .lease(fx.request("agent-a", "conv"))
        .await
        .expect("lease");
    let first_pid = lease.worker_pid();
    lease.run("REPLY=ok MARKER-warm-7").await.expect("turn");
    drop(lease);

    // The agent goes away: its process idles out, a primed spare takes its place, and the
    // conversation is resumed there ahead of its return.
    wait_event(
        &mut events,
        |e| matches!(e, PoolEvent::WorkerEvicted { pid, reason: Eviction::Idle, .. } if *pid == first_pid),
    )
    .await;
    let spare_pid = match wait_event(&mut events, |e| {
        matches!(
            e,
            PoolEvent::ConversationOpened {
                reason: OpenReason::Resumed,
                ..
            }
        )
    })
    .await
    {
        PoolEvent::ConversationOpened { pid, .. } => pid,
        other => unreachable!("{other:?}"),
    };
    assert_ne!(spare_pid, first_pid);
    assert!(
        wait_group_gone(first_pid, Duration::from_secs(5))
            .await
            .is_empty()
    );
    // Parked there, and still the key's spare (past the idle TTL).
    tokio::time::sleep(Duration::from_millis(800)).await;
    let (status, spare) = status_with_worker(&pool, spare_pid).await;
    assert_eq!(spare.state, WorkerState::Spare, "{status:?}");
    assert_eq!(spare.conversations, 1);
    assert_eq!(status.workers.len(), 1, "no second spare: {status:?}");

    // The return: attached, no resume on its path, the history intact.
    let mut lease = pool
        .lease(fx.request("agent-a", "conv"))
        .await
        .expect("lease on return");
    assert_eq!(lease.worker_pid(), spare_pid);
    assert_eq!(lease.reason(), OpenReason::Attached);
    let outcome = lease.run("REPLY=back").await.expect("turn on return");
    assert_eq!(outcome.text, "back");
    assert!(
        fx.last_model_request().contains("MARKER-warm-7"),
        "the earlier turn is in the model's context"
    );
    drop(lease);
    let status = pool.status().await.expect("status");
    assert_eq!(status.totals.resumed, 1, "one resume, ahead: {status:?}");
    shutdown_leaves_nothing(&pool).await;
}

#[tokio::test]
async fn resumes_ahead_that_end_or_fail_make_way_for_the_next_without_waiting_for_a_tick() {
    let fx = Fixture::new().await;
    let pool = Pool::start(one_tick_and_spares(&fx, 5).await)
        .await
        .expect("pool");
    let mut events = pool.subscribe();

    // Five conversations on one process, opened conv-1 first: the newest (conv-5, conv-4)
    // are resumed ahead first.
    let (pid, sessions) = turns_on_one_process(&fx, &pool, 5).await;
    // The two newest lose their stored state: their resumes ahead fail.
    let state = fx
        .scratch
        .path()
        .join("agents/agents/agent-a/copilot/session-state");
    for id in &sessions[3..] {
        std::fs::remove_dir_all(state.join(id)).expect("remove a session's state");
    }

    // Killed from outside: the five are attached nowhere, and the replacement is the key's
    // spare, where they are resumed ahead of their return. conv-5 and conv-4 fail; with no
    // tick to come, only their failures can start conv-3 and conv-2, and conv-1 starts when
    // one of those four has ended or failed. (Which one is a race; the end arm alone is the
    // next test's.)
    let spare_pid = killed_and_resumed_ahead(&mut events, pid, 3).await;
    let (status, spare) = status_with_worker(&pool, spare_pid).await;
    assert_eq!(spare.conversations, 3, "{status:?}");

    // The oldest returns attached, its history intact.
    let mut lease = pool
        .lease(fx.request("agent-a", "conv-1"))
        .await
        .expect("lease on return");
    assert_eq!(lease.worker_pid(), spare_pid);
    assert_eq!(lease.reason(), OpenReason::Attached);
    lease.run("REPLY=back").await.expect("turn on return");
    drop(lease);
    shutdown_leaves_nothing(&pool).await;
}

#[tokio::test]
async fn a_spare_resumes_the_conversations_leased_last_not_the_ones_opened_last() {
    let fx = Fixture::new().await;
    let pool = Pool::start(one_tick_and_spares(&fx, 2).await)
        .await
        .expect("pool");
    let mut events = pool.subscribe();
    // conv-1 and conv-2 opened, then conv-1 leased again (attached: no open), then conv-3
    // opened: the two leased last are conv-3 and conv-1, though conv-2 was opened later.
    let (pid, _) = turns_on_one_process(&fx, &pool, 2).await;
    assert_eq!(one_turn(&pool, &fx, "conv-1", "REPLY=again").await, pid);
    assert_eq!(one_turn(&pool, &fx, "conv-3", "REPLY=ok").await, pid);

    let spare_pid = killed_and_resumed_ahead(&mut events, pid, 2).await;
    let mut lease = pool
        .lease(fx.request("agent-a", "conv-1"))
        .await
        .expect("lease on return");
    assert_eq!(lease.worker_pid(), spare_pid);
    assert_eq!(
        lease.reason(),
        OpenReason::Attached,
        "conv-1 was resumed ahead"
    );
    lease.run("REPLY=back").await.expect("turn on return");
    drop(lease);
    shutdown_leaves_nothing(&pool).await;
}

#[tokio::test]
async fn a_resume_ahead_that_ends_starts_the_next_without_waiting_for_a_tick() {
    let fx = Fixture::new().await;
    let pool = Pool::start(one_tick_and_spares(&fx, 3).await)
        .await
        .expect("pool");
    let mut events = pool.subscribe();
    let (pid, _) = turns_on_one_process(&fx, &pool, 3).await;
    // Killed from outside: the three are resumed ahead on the replacement, two at once; the
    // third can start only when one of the first two has ended (nothing fails here).
    let spare_pid = killed_and_resumed_ahead(&mut events, pid, 3).await;
    let (status, spare) = status_with_worker(&pool, spare_pid).await;
    assert_eq!(spare.conversations, 3, "{status:?}");
    shutdown_leaves_nothing(&pool).await;
}

/// A pool with one maintenance tick at its start and none after (every resume ahead past the
/// first two, which run at once, must be started by the end of one before it), and a warm
/// spare per key carrying up to `conversations` of its conversations.
async fn one_tick_and_spares(fx: &Fixture, conversations: usize) -> copilot_pool::pool::PoolConfig {
    let mut config = fx.config().await;
    config.maintenance_interval = Duration::from_secs(3600);
    config.warm_spares = 1;
    config.warm_spare_conversations = conversations;
    config
}

/// A pool whose processes idle out a second after their last turn, a warm spare of their
/// key taking their place with none of their conversations resumed on it.
async fn idles_into_a_bare_spare(fx: &Fixture) -> copilot_pool::pool::PoolConfig {
    let mut config = fx.config().await;
    config.idle_ttl = Duration::from_secs(1);
    config.warm_spares = 1;
    config.warm_spare_conversations = 0;
    config
}

/// One turn of agent-a's `conversation` with `prompt`; its process's pid.
async fn one_turn(pool: &Pool, fx: &Fixture, conversation: &str, prompt: &str) -> u32 {
    let mut lease = pool
        .lease(fx.request("agent-a", conversation))
        .await
        .expect("lease");
    lease.run(prompt).await.expect("turn");
    lease.worker_pid()
}

/// One turn on each of `n` conversations of agent-a, opened conv-1 first: their process's
/// pid and their CLI session ids.
async fn turns_on_one_process(fx: &Fixture, pool: &Pool, n: usize) -> (u32, Vec<String>) {
    let mut pid = 0;
    let mut sessions = Vec::new();
    for i in 1..=n {
        let mut lease = pool
            .lease(fx.request("agent-a", &format!("conv-{i}")))
            .await
            .expect("lease");
        pid = lease.worker_pid();
        lease.run("REPLY=ok").await.expect("turn");
        sessions.push(lease.cli_session_id().to_string());
        drop(lease);
    }
    (pid, sessions)
}

/// SIGKILLs `pid`, waits for its replacement and for `resumed` resumes ahead on it; returns
/// the replacement's pid.
async fn killed_and_resumed_ahead(
    events: &mut tokio::sync::broadcast::Receiver<PoolEvent>,
    pid: u32,
    resumed: usize,
) -> u32 {
    kill(Pid::from_raw(pid as i32), Signal::SIGKILL).expect("kill");
    let spare_pid = match wait_event(events, |e| {
        matches!(e, PoolEvent::WorkerStarted { restart: true, .. })
    })
    .await
    {
        PoolEvent::WorkerStarted { pid, .. } => pid,
        other => unreachable!("{other:?}"),
    };
    for n in 1..=resumed {
        match wait_event(events, |e| {
            matches!(
                e,
                PoolEvent::ConversationOpened {
                    reason: OpenReason::Resumed,
                    ..
                }
            )
        })
        .await
        {
            PoolEvent::ConversationOpened { pid, .. } => {
                assert_eq!(pid, spare_pid, "resume ahead {n} on the spare")
            }
            other => unreachable!("{other:?}"),
        }
    }
    spare_pid
}

/// `lookup` answering `<who>: <key>` (one lease's handler of the listed tool).
fn lookup_tool(who: &'static str) -> copilot_pool::turn::GatewayTool {
    copilot_pool::turn::GatewayTool::new(
        "lookup",
        "Looks a key up.",
        serde_json::json!({"type": "object", "properties": {"key": {"type": "string"}}}),
        move |call: copilot_pool::turn::ToolCall| async move {
            Ok(format!(
                "{who}: {}",
                call.arguments["key"].as_str().unwrap_or("?")
            ))
        },
    )
}

/// Runs one turn of a CLI lease to its end (the limit is a failure guard, not a wait).
async fn run_cli(
    lease: &mut copilot_pool::pool::CliLease,
    prompt: &str,
) -> copilot_pool::backend::CliTurnOutcome {
    tokio::time::timeout(Duration::from_secs(120), lease.run(prompt, |_| {}))
        .await
        .expect("the turn ended in time")
        .expect("the turn ran")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cli_lease_serves_its_own_gateway_tool_handlers_and_other_tools_restart_the_cli() {
    use copilot_pool::backend::CliBackendConfig;
    let fx = Fixture::new().await;
    let mut config = fx.config().await;
    let claude = support::agent_cli::claude_path().await;
    if let Some(backend) = config.cli_backends.get_mut("claude-cli") {
        backend.command = claude.display().to_string();
    }
    // Gemini CLI gets no bridge: never started, its lease is refused first.
    let mut gemini = CliBackendConfig::google_gemini_cli();
    gemini.command = "/nonexistent/gemini".to_owned();
    config
        .cli_backends
        .insert("google-gemini-cli".to_owned(), gemini);
    let pool = Pool::start(config).await.expect("pool");
    let request = |tools: Vec<copilot_pool::turn::GatewayTool>| {
        let mut req = fx.request("agent-t", "tools-1");
        req.backend = "claude-cli".to_owned();
        req.model = None;
        req.provider = Some(ProviderConfig::anthropic(
            format!("http://{}", fx.endpoint.addr()),
            Some(Secret::new("sk-ant-FAKE-pool-tools")),
        ));
        req.handlers.tools = tools;
        req
    };

    // The first lease's handler answers its call.
    let mut first = pool
        .lease_cli(request(vec![lookup_tool("first")]))
        .await
        .expect("first lease");
    let outcome = run_cli(
        &mut first,
        r#"SCENARIO:tool NAME=mcp__gateway__lookup ARGS={"key":"alpha"}"#,
    )
    .await;
    assert_eq!(outcome.text, "tool said: first: alpha", "{outcome:?}");
    let pid = first.pid().expect("a live process");
    drop(first);

    // The next lease of the same conversation, same tool: same process, its own handler.
    let mut second = pool
        .lease_cli(request(vec![lookup_tool("second")]))
        .await
        .expect("second lease");
    assert_eq!(second.reason(), OpenReason::Attached);
    assert_eq!(second.pid(), Some(pid), "the process was kept");
    let outcome = run_cli(
        &mut second,
        r#"SCENARIO:tool NAME=mcp__gateway__lookup ARGS={"key":"beta"}"#,
    )
    .await;
    assert_eq!(
        outcome.text, "tool said: second: beta",
        "the second lease's handler answered: {outcome:?}"
    );
    assert_eq!(second.pid(), Some(pid));
    drop(second);

    // Another tool set: the CLI is started again (resumed) with a bridge listing it.
    let extra = copilot_pool::turn::GatewayTool::new(
        "extra",
        "Only the third lease has it.",
        serde_json::json!({"type": "object", "properties": {}}),
        |_call: copilot_pool::turn::ToolCall| async { Ok("extra ran".to_owned()) },
    );
    let mut third = pool
        .lease_cli(request(vec![lookup_tool("third"), extra]))
        .await
        .expect("third lease");
    assert_eq!(third.reason(), OpenReason::Resumed, "a new process resumes");
    let outcome = run_cli(&mut third, "SCENARIO:tool NAME=mcp__gateway__extra ARGS={}").await;
    assert_eq!(outcome.text, "tool said: extra ran", "{outcome:?}");
    assert!(outcome.resumed, "{outcome:?}");
    assert_ne!(third.pid(), Some(pid), "a new process");
    drop(third);

    // A base URL carrying a credential is refused before any CLI starts (it would reach
    // the CLI's command line), as a Copilot lease's is.
    for base_url in [
        format!("http://user:sk-in-url@{}", fx.endpoint.addr()),
        format!("http://{}/v1?api_key=sk-in-query", fx.endpoint.addr()),
    ] {
        let mut req = request(Vec::new());
        req.provider = Some(ProviderConfig::anthropic(
            base_url,
            Some(Secret::new("sk-ant-FAKE-pool-tools")),
        ));
        let refused = pool.lease_cli(req).await.expect_err("refused");
        assert!(
            matches!(&refused, PoolError::InvalidRequest(m) if m.contains("base_url")),
            "{refused}"
        );
    }

    // A backend whose CLI gets no bridge refuses tools rather than run without them.
    let mut req = request(vec![lookup_tool("gemini")]);
    req.backend = "google-gemini-cli".to_owned();
    let refused = pool.lease_cli(req).await.expect_err("refused");
    assert!(
        matches!(&refused, PoolError::InvalidRequest(m)
            if m.contains("cannot be leased with gateway tools") && m.contains("codex-cli")),
        "{refused}"
    );
    shutdown_leaves_nothing(&pool).await;
    let left = support::procs::wait_none(
        || {
            support::procs::with_env_prefix(
                "CLAUDE_CONFIG_DIR",
                &fx.scratch.path().display().to_string(),
            )
        },
        Duration::from_secs(10),
    )
    .await;
    assert!(left.is_empty(), "Claude processes left: {left:?}");
}

/// A Rust gateway's side of a chain: every event, in order.
#[derive(Default)]
struct RecordingSink {
    events: std::sync::Mutex<Vec<copilot_pool::fallback::ChainEvent>>,
}

impl copilot_pool::fallback::ChainSink for RecordingSink {
    async fn deliver(&self, event: copilot_pool::fallback::ChainEvent) -> bool {
        if let Ok(mut events) = self.events.lock() {
            events.push(event);
        }
        true
    }
}

impl RecordingSink {
    /// The events, named: a session event by its type, a CLI event by its SSE name, a
    /// fallback as `fallback`.
    fn names(&self) -> Vec<String> {
        use copilot_pool::fallback::ChainEvent;
        let events = self.events.lock().expect("events");
        events
            .iter()
            .map(|e| match e {
                ChainEvent::Session(e) => e.event_type().to_owned(),
                ChainEvent::Cli(e) => format!("cli:{}", e.name()),
                ChainEvent::Fallback(_) => "fallback".to_owned(),
                _ => "other".to_owned(),
            })
            .collect()
    }

    fn notices(&self) -> Vec<copilot_pool::fallback::FallbackNotice> {
        use copilot_pool::fallback::ChainEvent;
        let events = self.events.lock().expect("events");
        events
            .iter()
            .filter_map(|e| match e {
                ChainEvent::Fallback(n) => Some(n.clone()),
                _ => None,
            })
            .collect()
    }
}

/// A gateway that leaves when it is handed its first event of type `leave_at`.
struct LeavingAt {
    leave_at: &'static str,
}

impl copilot_pool::fallback::ChainSink for LeavingAt {
    async fn deliver(&self, event: copilot_pool::fallback::ChainEvent) -> bool {
        !matches!(&event, copilot_pool::fallback::ChainEvent::Session(e) if e.event_type() == self.leave_at)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_caller_leaving_at_the_turns_last_event_gets_it_ended_as_it_ran_and_one_leaving_earlier_gets_it_aborted()
 {
    use copilot_pool::TurnEnd;
    use copilot_pool::fallback::{ChainLease, ChainRequest};
    let fx = Fixture::new().await;
    let pool = Pool::start(fx.config().await).await.expect("pool");
    let run = |leave_at: &'static str, prompt: &str| {
        let pool = pool.clone();
        let chain = ChainRequest::new(fx.request("agent-l", "leaving"), prompt);
        async move {
            let sink = std::sync::Arc::new(LeavingAt { leave_at });
            let lease = ChainLease::start(&pool, chain, sink).await.expect("leased");
            tokio::time::timeout(Duration::from_secs(60), lease.run())
                .await
                .expect("the turn ended in time")
        }
    };
    // The runtime had ended the turn when its idle was refused: it ran whole.
    let whole = run("session.idle", "REPLY=whole").await;
    assert!(whole.caller_gone);
    assert_eq!(whole.summary.status, TurnEnd::Idle, "{:?}", whole.summary);
    // Refused at its first message, the turn was still running: aborted.
    let cut = run("assistant.message", "REPLY=cut").await;
    assert!(cut.caller_gone);
    assert_eq!(cut.summary.status, TurnEnd::Aborted, "{:?}", cut.summary);
    // The conversation goes on.
    let next = run("never", "REPLY=next").await;
    assert!(!next.caller_gone);
    assert_eq!(next.summary.status, TurnEnd::Idle, "{:?}", next.summary);
    assert_eq!(next.summary.final_text, "next");
    pool.shutdown().await.expect("shutdown");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rust_gateways_chain_runs_a_turn_the_model_refuses_on_claude_with_the_earlier_turn_in_its_prelude()
 {
    use copilot_pool::fallback::{ChainLease, ChainOutcome, ChainRequest, FallbackClass};
    use copilot_pool::scripted_model::Reply;
    use copilot_pool::transcript::TranscriptMode;
    use copilot_pool::turn::TranscriptSettings;
    use std::sync::Arc;
    let fx = Fixture::new().await;
    let mut config = fx.config().await;
    let claude = support::agent_cli::claude_path().await;
    if let Some(backend) = config.cli_backends.get_mut("claude-cli") {
        backend.command = claude.display().to_string();
    }
    let pool = Pool::start(config).await.expect("pool");
    // One Anthropic provider serves the runtime's BYOK and Claude's endpoint and key; the
    // transcript mirror is the prelude's source.
    let chain = |prompt: &str, fallbacks: &[&str]| {
        let mut req = fx.request("agent-c", "chain-1");
        req.model = Some("claude-sonnet-4-5".to_owned());
        req.provider = Some(ProviderConfig::anthropic(
            format!("http://{}", fx.endpoint.addr()),
            Some(Secret::new("sk-ant-FAKE-pool-chain")),
        ));
        req.handlers.transcript = Some(TranscriptSettings::new(
            fx.scratch.path().join("transcripts"),
            TranscriptMode::BestEffort,
        ));
        let mut chain = ChainRequest::new(req, prompt);
        chain.fallbacks = fallbacks.iter().map(|b| (*b).to_owned()).collect();
        chain
    };
    let run = |chain: ChainRequest, sink: Arc<RecordingSink>| {
        let pool = pool.clone();
        async move {
            let lease = ChainLease::start(&pool, chain, sink).await.expect("leased");
            assert_eq!(lease.leased_backend(), Some("copilot"));
            tokio::time::timeout(Duration::from_secs(180), lease.run())
                .await
                .expect("the turn ended in time")
        }
    };

    // A chain whose first backend answers runs nowhere else.
    let sink = Arc::new(RecordingSink::default());
    let ChainOutcome {
        summary,
        caller_gone,
        ..
    } = run(chain("remember PELICAN-17", &["claude-cli"]), sink.clone()).await;
    assert_eq!(summary.backend, "copilot", "{summary:?}");
    assert_eq!(summary.status, copilot_pool::TurnEnd::Idle, "{summary:?}");
    assert_eq!(summary.fallback_from, None, "{summary:?}");
    assert!(!caller_gone);
    let names = sink.names();
    assert!(names.contains(&"assistant.message".to_owned()), "{names:?}");
    assert!(!names.contains(&"fallback".to_owned()), "{names:?}");

    // The runtime's model calls are refused (401, tried three times by runtime 1.0.14): a
    // retryable auth failure, so the turn runs on Claude, after the notice.
    for _ in 0..3 {
        fx.model.push_reply(Reply::Error { status: 401 });
    }
    let sink = Arc::new(RecordingSink::default());
    let ChainOutcome {
        summary,
        caller_gone,
        ..
    } = run(
        chain("REPLY=answered by claude", &["claude-cli"]),
        sink.clone(),
    )
    .await;
    assert!(!caller_gone);
    assert_eq!(summary.backend, "claude-cli", "{summary:?}");
    assert_eq!(summary.status, copilot_pool::TurnEnd::Idle, "{summary:?}");
    assert_eq!(summary.final_text, "answered by claude", "{summary:?}");
    assert_eq!(
        summary.fallback_from.as_deref(),
        Some("copilot"),
        "{summary:?}"
    );
    let notices = sink.notices();
    assert_eq!(notices.len(), 1, "{notices:?}");
    let notice = &notices[0];
    assert_eq!(
        (notice.from.as_str(), notice.to.as_str()),
        ("copilot", "claude-cli")
    );
    assert_eq!(notice.class, FallbackClass::Auth, "{notice:?}");
    assert_eq!(notice.status_code, Some(401), "{notice:?}");
    assert!(notice.prelude_chars > 0, "{notice:?}");
    // The notice comes before Claude's events, and Claude's answer streams as CLI events.
    let names = sink.names();
    let at = names
        .iter()
        .position(|n| n == "fallback")
        .expect("a notice");
    assert!(
        names[at + 1..].contains(&"cli:assistant.message".to_owned()),
        "{names:?}"
    );
    assert!(
        !names[at + 1..].iter().any(|n| !n.starts_with("cli:")),
        "only Claude's events after the notice: {names:?}"
    );
    // The Claude model call carried the earlier Copilot turn in its prelude.
    let carried = fx.model.requests().into_iter().any(|r| {
        let text = support::cli_daemon::user_text(&r);
        text.contains("answered by claude") && text.contains("PELICAN-17")
    });
    assert!(carried, "no model call with the prelude");

    // Bad chains are refused before anything is leased, with what to fix.
    for (fallbacks, needle) in [
        (&["nonexistent-cli"][..], "nonexistent-cli"),
        (&["claude-cli", "claude-cli"][..], "claude-cli"),
        (&["copilot"][..], "copilot"),
    ] {
        let refused = ChainLease::start(&pool, chain("x", fallbacks), RecordingSink::default())
            .await
            .err()
            .expect("refused");
        assert_eq!(
            refused.kind(),
            copilot_pool::kinds::ErrorKind::Invalid,
            "{refused}"
        );
        assert!(refused.to_string().contains(needle), "{refused}");
    }
    // A bearer token a CLI fallback could never take: refused up front, not in the outage.
    let mut bearer = chain("x", &["claude-cli"]);
    if let Some(provider) = bearer.lease.provider.as_mut() {
        provider.bearer_token = Some(Secret::new("bearer-FAKE"));
    }
    let refused = ChainLease::start(&pool, bearer, RecordingSink::default())
        .await
        .err()
        .expect("refused");
    assert!(
        refused.to_string().contains("bearer_token") && refused.to_string().contains("claude-cli"),
        "{refused}"
    );
    shutdown_leaves_nothing(&pool).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cli_conversations_appended_system_message_reaches_claudes_and_codexs_model_and_runtime_only_options_are_refused()
 {
    use copilot_pool::backend::CliBackendConfig;
    use copilot_pool::session_options::SessionOptions;
    let fx = Fixture::new().await;
    let mut config = fx.config().await;
    let claude = support::agent_cli::claude_path().await;
    let codex = support::agent_cli::codex_path().await;
    if let Some(backend) = config.cli_backends.get_mut("claude-cli") {
        backend.command = claude.display().to_string();
    }
    let mut codex_config = CliBackendConfig::codex_cli();
    codex_config.command = codex.display().to_string();
    config
        .cli_backends
        .insert("codex-cli".to_owned(), codex_config);
    let mut gemini = CliBackendConfig::google_gemini_cli();
    gemini.command = "/nonexistent/gemini".to_owned();
    config
        .cli_backends
        .insert("google-gemini-cli".to_owned(), gemini);
    let pool = Pool::start(config).await.expect("pool");
    let request = |backend: &str, options: serde_json::Value| {
        let mut req = fx.request("agent-s", &format!("system-{backend}"));
        req.backend = backend.to_owned();
        let (base_url, key, model) = if backend == "codex-cli" {
            (
                format!("http://{}/v1", fx.endpoint.addr()),
                "sk-FAKE-codex",
                Some("gpt-5.5"),
            )
        } else {
            (
                format!("http://{}", fx.endpoint.addr()),
                "sk-ant-FAKE-system",
                None,
            )
        };
        req.model = model.map(str::to_owned);
        req.provider = Some(if backend == "codex-cli" {
            ProviderConfig::openai(base_url, Some(Secret::new(key)))
        } else {
            ProviderConfig::anthropic(base_url, Some(Secret::new(key)))
        });
        req.session_options = SessionOptions::from_value(options).expect("valid options");
        req
    };
    let system =
        serde_json::json!({"systemMessage": {"mode": "append", "content": "You are OSPREY-9."}});

    for (backend, answer) in [("claude-cli", "claude heard"), ("codex-cli", "codex heard")] {
        let mut lease = pool
            .lease_cli(request(backend, system.clone()))
            .await
            .unwrap_or_else(|e| panic!("{backend}: {e}"));
        let outcome = run_cli(&mut lease, &format!("REPLY={answer}")).await;
        assert_eq!(outcome.text, answer, "{backend}: {outcome:?}");
        drop(lease);
        let call = fx
            .model
            .requests()
            .into_iter()
            .find(|r| {
                matches!(r.decision(), Some(copilot_pool::scripted_model::Decision::Text(t)) if t == answer)
            })
            .unwrap_or_else(|| panic!("no model call answered {answer:?}"));
        let body = call.body.to_string();
        assert!(
            body.contains("You are OSPREY-9."),
            "{backend}'s model call carries the system message: {body:.2000}"
        );
    }

    // What the CLI cannot take is refused, with what to do.
    let refused = pool
        .lease_cli(request(
            "claude-cli",
            serde_json::json!({"systemMessage": {"mode": "replace", "content": "x"}}),
        ))
        .await
        .expect_err("replace refused");
    assert!(
        refused.to_string().contains("use mode `append`"),
        "{refused}"
    );
    let refused = pool
        .lease_cli(request(
            "codex-cli",
            serde_json::json!({"excludedTools": ["bash"]}),
        ))
        .await
        .expect_err("a runtime-only option refused");
    assert!(refused.to_string().contains("`excludedTools`"), "{refused}");
    let refused = pool
        .lease_cli(request("google-gemini-cli", system.clone()))
        .await
        .expect_err("no route");
    assert!(
        refused.to_string().contains("no system-prompt route"),
        "{refused}"
    );
    shutdown_leaves_nothing(&pool).await;
}

/// Runs a started CLI turn to its `turn.end` (the limit is a failure guard, not a wait).
async fn finish_cli(
    mut turn: copilot_pool::pool::CliLeaseTurn<'_>,
) -> copilot_pool::backend::CliTurnOutcome {
    let run = async {
        while let Some(event) = turn.next().await {
            if let copilot_pool::backend::BackendEvent::TurnEnd(outcome) = event {
                return outcome;
            }
        }
        panic!("the turn ended without turn.end");
    };
    tokio::time::timeout(Duration::from_secs(120), run)
        .await
        .expect("the turn ended in time")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_turns_image_reaches_claudes_and_codexs_model_over_a_cli_lease_and_every_backend_of_a_chain()
 {
    use base64::Engine;
    use copilot_pool::backend::CliBackendConfig;
    use copilot_pool::fallback::{ChainLease, ChainRequest};
    use copilot_pool::scripted_model::{Decision, Reply};
    use copilot_pool::turn::Message;
    use support::cli_daemon::{PNG, images_in};
    let fx = Fixture::new().await;
    let mut config = fx.config().await;
    let claude = support::agent_cli::claude_path().await;
    if let Some(backend) = config.cli_backends.get_mut("claude-cli") {
        backend.command = claude.display().to_string();
    }
    let mut codex = CliBackendConfig::codex_cli();
    codex.command = support::agent_cli::codex_path().await.display().to_string();
    config.cli_backends.insert("codex-cli".to_owned(), codex);
    let pool = Pool::start(config).await.expect("pool");
    let work = fx.scratch.work();
    std::fs::create_dir_all(&work).expect("work dir");
    let image = work.join("dot.png");
    let bytes = base64::engine::general_purpose::STANDARD
        .decode(PNG)
        .expect("png");
    std::fs::write(&image, bytes).expect("write the image");
    let png = ("image/png".to_owned(), PNG.to_owned());
    let request = |backend: &str| {
        let mut req = fx.request("agent-i", &format!("image-{backend}"));
        req.backend = backend.to_owned();
        if backend == "codex-cli" {
            req.model = Some("gpt-5.5".to_owned());
            req.provider = Some(ProviderConfig::openai(
                format!("http://{}/v1", fx.endpoint.addr()),
                Some(Secret::new("sk-FAKE-codex-image")),
            ));
        } else {
            req.model = None;
            req.provider = Some(ProviderConfig::anthropic(
                format!("http://{}", fx.endpoint.addr()),
                Some(Secret::new("sk-ant-FAKE-image")),
            ));
        }
        req
    };
    let answered = |text: &str| {
        fx.model
            .requests()
            .into_iter()
            .find(|r| matches!(r.decision(), Some(Decision::Text(t)) if t == text))
            .unwrap_or_else(|| panic!("no model call answered {text:?}"))
    };

    // Over a lease: Claude gets an image block of the message, Codex an `input_image`.
    for (backend, answer) in [
        ("claude-cli", "claude saw it"),
        ("codex-cli", "codex saw it"),
    ] {
        let mut lease = pool
            .lease_cli(request(backend))
            .await
            .unwrap_or_else(|e| panic!("{backend}: {e}"));
        let turn = lease
            .start_turn_with_images(&format!("REPLY={answer}"), std::slice::from_ref(&image))
            .await
            .unwrap_or_else(|e| panic!("{backend}: {e}"));
        let outcome = finish_cli(turn).await;
        assert_eq!(outcome.text, answer, "{backend}: {outcome:?}");
        let images = images_in(&answered(answer));
        assert!(images.contains(&png), "{backend}'s model call: {images:?}");

        // What is not an image file is refused before the turn starts.
        let notes = work.join("notes.txt");
        std::fs::write(&notes, "text").expect("write");
        let fake = work.join("fake.png");
        std::fs::write(&fake, "text").expect("write");
        for (path, needle) in [
            (notes, "not an image by its name"),
            (fake, "not a PNG, JPEG, GIF or WebP image by its content"),
            (std::path::PathBuf::from("dot.png"), "not an absolute path"),
            (work.join("gone.png"), "cannot be read"),
        ] {
            let refused = lease
                .start_turn_with_images("REPLY=never", &[path])
                .await
                .err()
                .expect("refused");
            assert!(
                matches!(&refused, PoolError::InvalidRequest(m) if m.contains(needle)),
                "{backend}: {refused}"
            );
        }
    }

    // A chain: Copilot's model calls are refused (401, three tries by the runtime), so the
    // turn runs on Claude; both got the image.
    let chain = |attachment: Message| {
        let mut req = fx.request("agent-i", "image-chain");
        req.model = Some("claude-sonnet-4-5".to_owned());
        req.provider = Some(ProviderConfig::anthropic(
            format!("http://{}", fx.endpoint.addr()),
            Some(Secret::new("sk-ant-FAKE-image-chain")),
        ));
        let mut chain = ChainRequest::new(req, attachment);
        chain.fallbacks = vec!["claude-cli".to_owned()];
        chain
    };
    for _ in 0..3 {
        fx.model.push_reply(Reply::Error { status: 401 });
    }
    let asked = fx.model.requests().len();
    let message = Message::new("REPLY=claude saw the chain's image").with_file(&image);
    let lease = ChainLease::start(&pool, chain(message), RecordingSink::default())
        .await
        .expect("leased");
    let outcome = tokio::time::timeout(Duration::from_secs(180), lease.run())
        .await
        .expect("the chain ended in time");
    assert_eq!(
        outcome.summary.backend, "claude-cli",
        "{:?}",
        outcome.summary
    );
    assert_eq!(
        outcome.summary.final_text, "claude saw the chain's image",
        "{:?}",
        outcome.summary
    );
    let requests = fx.model.requests();
    let by_claude = |r: &copilot_pool::scripted_model::RecordedRequest| {
        r.header("user-agent")
            .iter()
            .any(|ua| ua.starts_with("claude-cli"))
    };
    let with_image: Vec<_> = requests[asked..]
        .iter()
        .filter(|r| images_in(r).contains(&png))
        .collect();
    assert!(
        with_image.iter().any(|r| !by_claude(r)),
        "the Copilot runtime's call carried it"
    );
    assert!(
        with_image.iter().any(|r| by_claude(r)),
        "the fallback's Claude call carried it"
    );

    // A chain with a CLI backend refuses other attachments, naming them.
    let refused = ChainLease::start(
        &pool,
        chain(Message::new("REPLY=never").with_directory(&work)),
        RecordingSink::default(),
    )
    .await
    .err()
    .expect("refused");
    assert!(
        matches!(&refused, PoolError::InvalidRequest(m)
            if m.contains("attachments[0] (directory") && m.contains("claude-cli")),
        "{refused}"
    );
    shutdown_leaves_nothing(&pool).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_process_budget_a_cli_lease_stops_the_idle_copilot_worker_and_a_copilot_lease_waits_for_the_busy_cli_process()
 {
    let fx = Fixture::new().await;
    let mut config = fx.config().await;
    config.max_processes = 1;
    let claude = support::agent_cli::claude_path().await;
    if let Some(backend) = config.cli_backends.get_mut("claude-cli") {
        backend.command = claude.display().to_string();
    }
    let pool = Pool::start(config).await.expect("pool");
    let mut events = pool.subscribe();
    let cli_request = || {
        let mut req = fx.request("agent-b", "budget-cli");
        req.backend = "claude-cli".to_owned();
        req.model = None;
        req.provider = Some(ProviderConfig::anthropic(
            format!("http://{}", fx.endpoint.addr()),
            Some(Secret::new("sk-ant-FAKE-budget")),
        ));
        req
    };

    // A Copilot turn, then its worker idles: the pool's one process.
    let mut copilot = pool
        .lease(fx.request("agent-b", "budget-copilot"))
        .await
        .expect("copilot lease");
    let outcome = copilot.run("REPLY=copilot here").await.expect("turn");
    assert_eq!(outcome.text, "copilot here");
    let worker = copilot.worker_pid();
    drop(copilot);

    // A CLI lease finds the budget full: the idle Copilot worker is stopped for it.
    let mut cli = pool.lease_cli(cli_request()).await.expect("cli lease");
    wait_event(&mut events, |e| {
        matches!(e, PoolEvent::WorkerEvicted { pid, reason: Eviction::Full, .. } if *pid == worker)
    })
    .await;
    assert!(
        wait_group_gone(worker, Duration::from_secs(20))
            .await
            .is_empty()
    );
    let outcome = run_cli(&mut cli, "REPLY=claude here").await;
    assert_eq!(outcome.text, "claude here", "{outcome:?}");
    let status = pool.status().await.expect("status");
    assert!(status.workers.is_empty(), "{:?}", status.workers);
    assert_eq!(status.budget.max_processes, 1);
    assert_eq!(status.budget.used, 1);
    assert_eq!(status.budget.by_backend.get("claude-cli"), Some(&1));
    assert_eq!(status.budget.by_backend.get("copilot"), Some(&0));

    // While the CLI process is leased (busy), a Copilot lease waits, and runs out of time.
    let mut req = fx.request("agent-b", "budget-copilot");
    req.wait_timeout = Some(Duration::from_millis(500));
    let refused = pool.lease(req).await.expect_err("no room");
    assert!(
        matches!(refused, PoolError::WaitTimeout { .. }),
        "{refused}"
    );

    // A waiting Copilot lease is served once the CLI lease returns: the parked CLI process
    // (now the idle one) is closed for it.
    let cli_pid = cli.pid().expect("claude's live process");
    let waiting = {
        let pool = pool.clone();
        let req = fx.request("agent-b", "budget-copilot");
        tokio::spawn(async move { pool.lease(req).await })
    };
    tokio::time::timeout(Duration::from_secs(10), async {
        // No event says a lease waits: the status is read until it does.
        while pool.status().await.map(|s| s.waiters).unwrap_or(0) == 0 {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await
    .expect("the Copilot lease waits");
    drop(cli);
    let mut copilot = tokio::time::timeout(Duration::from_secs(60), waiting)
        .await
        .expect("granted in time")
        .expect("task")
        .expect("copilot lease");
    assert!(
        wait_group_gone(cli_pid, Duration::from_secs(20))
            .await
            .is_empty()
    );
    let outcome = copilot.run("REPLY=copilot again").await.expect("turn");
    assert_eq!(outcome.text, "copilot again");
    let status = pool.status().await.expect("status");
    assert_eq!(status.budget.by_backend.get("claude-cli"), Some(&0));
    assert_eq!(status.budget.used, 1);
    drop(copilot);
    shutdown_leaves_nothing(&pool).await;
}

/// A sink whose `deliver` never returns: a gateway that stopped reading and holds on.
struct StuckSink;

impl copilot_pool::fallback::ChainSink for StuckSink {
    async fn deliver(&self, _event: copilot_pool::fallback::ChainEvent) -> bool {
        std::future::pending().await
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_chain_whose_sink_never_returns_ends_caller_gone_after_its_deliver_timeout_and_frees_the_conversation()
 {
    use copilot_pool::fallback::{ChainLease, ChainRequest};
    let fx = Fixture::new().await;
    let pool = Pool::start(fx.config().await).await.expect("pool");
    let mut chain = ChainRequest::new(fx.request("agent-s", "stuck-1"), "REPLY=never read");
    chain.deliver_timeout = Duration::from_millis(500);
    let lease = ChainLease::start(&pool, chain, StuckSink)
        .await
        .expect("leased");
    let outcome = tokio::time::timeout(Duration::from_secs(60), lease.run())
        .await
        .expect("the chain did not stall on its sink");
    assert!(outcome.caller_gone, "{:?}", outcome.summary);
    assert_eq!(
        outcome.summary.status,
        copilot_pool::TurnEnd::Aborted,
        "{:?}",
        outcome.summary
    );
    // The conversation was returned: the next lease of it is granted.
    let mut again = pool
        .lease(fx.request("agent-s", "stuck-1"))
        .await
        .expect("the conversation is free");
    let outcome = again.run("REPLY=read now").await.expect("turn");
    assert_eq!(outcome.text, "read now");
    drop(again);
    shutdown_leaves_nothing(&pool).await;
}

#[tokio::test]
async fn a_conversation_stored_on_another_backend_is_told_apart_from_one_on_its_own() {
    use copilot_pool::pool::{Binding, CliSessionId, ConversationId};
    let fx = Fixture::new().await;
    let pool = Pool::start(fx.config().await).await.expect("pool");
    let conversation = ConversationId::new("agent-s", "shared");
    let stored = |key: &str| Binding {
        session_key: key.to_owned(),
        cli_session_id: CliSessionId::new("s-1"),
        compat_key: "c".to_owned(),
        updated_at_ms: 0,
        working_directory: None,
    };
    let elsewhere = |except: &str| {
        pool.stored_on_another_backend(&conversation, except)
            .expect("bindings")
    };
    assert!(!elsewhere("copilot") && !elsewhere("claude-cli"));
    // Stored on Claude Code (filed as "<agent>/<key>#backend=<id>"): another backend for
    // Copilot, its own for Claude Code.
    pool.cli_bindings()
        .put(&stored("agent-s/shared#backend=claude-cli"))
        .expect("put");
    assert!(elsewhere("copilot"));
    assert!(!elsewhere("claude-cli"));
    // Stored on Copilot too: another backend for Claude Code.
    pool.bindings().put(&stored("agent-s/shared")).expect("put");
    assert!(elsewhere("claude-cli"));
    shutdown_leaves_nothing(&pool).await;
}
