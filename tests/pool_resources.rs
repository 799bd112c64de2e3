//! Running out of file descriptors is the machine's problem, not the runtime's: spawn
//! failures from EMFILE are `resource_exhausted`, never crashes, and never quarantine the
//! key. Its own test binary: it lowers this process's open-file limit.

mod support;

use std::time::Duration;

use copilot_pool::pool::{Pool, PoolError};
use copilot_pool::worker::WorkerError;
use nix::sys::resource::{Resource, getrlimit, setrlimit};
use support::pool_fixture::{Fixture, shutdown_leaves_nothing};

#[tokio::test]
async fn spawns_that_fail_for_lack_of_file_descriptors_are_not_crashes_and_never_quarantine_the_key()
 {
    let fx = Fixture::new().await;
    let mut config = fx.config().await;
    config.restart.first_retry = Duration::ZERO;
    let pool = Pool::start(config.clone()).await.expect("pool");

    // Use up every descriptor under a lowered soft limit.
    let (soft, hard) = getrlimit(Resource::RLIMIT_NOFILE).expect("getrlimit");
    setrlimit(Resource::RLIMIT_NOFILE, 512.min(soft), hard).expect("lower the soft limit");
    let mut hogs = Vec::new();
    while let Ok(file) = std::fs::File::open("/dev/null") {
        hogs.push(file);
        assert!(hogs.len() < 4096, "the lowered limit did not hold");
    }

    // More failures than the restart intensity allows (5 in 30 s by default).
    for attempt in 1..=config.restart.max_restarts + 2 {
        let failed = pool.lease(fx.request("agent-a", "conv")).await;
        let Err(PoolError::Worker(WorkerError::ResourceExhausted(message))) = &failed else {
            panic!("attempt {attempt}: expected ResourceExhausted, got {failed:?}")
        };
        assert!(message.contains("Too many open files"), "{message}");
    }
    drop(hogs);
    setrlimit(Resource::RLIMIT_NOFILE, soft, hard).expect("restore the limit");

    let status = pool.status().await.expect("status");
    assert!(status.quarantined_keys.is_empty(), "{status:?}");
    assert_eq!(status.totals.crashes, 0, "{status:?}");
    // Descriptors are back: the same key works at once.
    let mut lease = pool
        .lease(fx.request("agent-a", "conv"))
        .await
        .expect("lease once descriptors are free");
    lease.run("REPLY=back").await.expect("turn");
    drop(lease);
    shutdown_leaves_nothing(&pool).await;
}
