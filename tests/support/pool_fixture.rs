//! The pool test fixture: a scratch directory, the scripted model, a pool config for the
//! real runtime, lease requests, and checks on events and leftover processes.

#![allow(dead_code)]

use std::path::PathBuf;
use std::time::Duration;

use copilot_pool::auth::LeaseAuth;
use copilot_pool::pool::{
    LeaseRequest, OpenReason, Pool, PoolConfig, PoolEvent, PoolStatus, WorkerStatus,
};
use copilot_pool::rpc::messages::ProviderConfig;
use copilot_pool::scripted_model::{HttpEndpoint, ScriptedModel};
use copilot_pool::secret::Secret;
use copilot_pool::worker::WorkerConfig;
use tokio::sync::broadcast;

use super::Scratch;
use super::procs::wait_group_gone;

pub struct Fixture {
    pub scratch: Scratch,
    pub model: ScriptedModel,
    pub endpoint: HttpEndpoint,
}

impl Fixture {
    pub async fn new() -> Self {
        let model = ScriptedModel::new();
        let endpoint = model.serve_http().await.expect("model endpoint");
        Self {
            scratch: Scratch::new(),
            model,
            endpoint,
        }
    }

    pub async fn config(&self) -> PoolConfig {
        let mut worker = WorkerConfig::new(
            super::runtime::runtime_path().await,
            PathBuf::new(),
            PathBuf::new(),
        );
        worker.extra_env = vec![(
            "HOME".to_owned(),
            self.scratch.path().join("home").display().to_string(),
        )];
        worker.kill_grace = Duration::from_secs(2);
        let mut config = PoolConfig::new(
            worker,
            self.scratch.path().join("state"),
            self.scratch.path().join("agents"),
        );
        config.maintenance_interval = Duration::from_millis(100);
        config.shutdown_grace = Duration::from_secs(2);
        // The scripted model listens on loopback: every BYOK turn of the tests goes through
        // the guarded model path, with private endpoints allowed.
        config.model_guard.allow_private_endpoints = true;
        config
    }

    pub fn provider(&self) -> ProviderConfig {
        ProviderConfig::openai(self.endpoint.base_url(), Some(Secret::new("scripted-key")))
    }

    pub fn request(&self, agent: &str, session_key: &str) -> LeaseRequest {
        let mut req = LeaseRequest::new(agent, session_key, self.scratch.work());
        req.model = Some(ScriptedModel::MODEL_ID.to_owned());
        req.provider = Some(self.provider());
        req.available_tools = Some(Vec::new());
        req.streaming = false;
        req
    }

    /// The conversation goes on after its process `gone` went: a lease of `agent` /
    /// `session_key` lands on another process, and the next turn's model call carries
    /// `marker`, sent before (its history was kept). Returns how the lease opened it.
    pub async fn goes_on_elsewhere(
        &self,
        pool: &Pool,
        agent: &str,
        session_key: &str,
        gone: u32,
        marker: &str,
    ) -> OpenReason {
        let mut lease = pool
            .lease(self.request(agent, session_key))
            .await
            .expect("lease after the process went");
        assert_ne!(lease.worker_pid(), gone, "the process that went serves it");
        lease
            .run("REPLY=going on")
            .await
            .expect("a turn after the process went");
        assert!(
            self.last_model_request().contains(marker),
            "{marker} was lost with the process"
        );
        lease.reason()
    }

    /// The text of every message of the last model request.
    pub fn last_model_request(&self) -> String {
        let last = self.model.requests().pop().expect("a model request");
        serde_json::to_string(last.messages()).expect("json")
    }
}

pub fn token(version: &str) -> LeaseAuth {
    LeaseAuth {
        github_token: Some(Secret::new(format!("ghu_token_{version}"))),
        profile_id: Some("profile-1".to_owned()),
        profile_version: Some(version.to_owned()),
        ..Default::default()
    }
}

/// Waits (at most 30 s, a failure guard) until a lease of `pool` waits: for room, or for
/// its process to start. `what` says which, in the failure.
pub async fn until_a_lease_waits(pool: &Pool, what: &str) {
    let waiting = async {
        while pool.status().await.expect("status").waiters == 0 {
            tokio::task::yield_now().await;
        }
    };
    tokio::time::timeout(Duration::from_secs(30), waiting)
        .await
        .unwrap_or_else(|_| panic!("{what}"));
}

/// Waits for the first event that `want` accepts (events are how the pool reports).
pub async fn wait_event(
    events: &mut broadcast::Receiver<PoolEvent>,
    want: impl Fn(&PoolEvent) -> bool,
) -> PoolEvent {
    loop {
        match tokio::time::timeout(Duration::from_secs(30), events.recv()).await {
            Ok(Ok(event)) if want(&event) => return event,
            Ok(Ok(_)) => continue,
            Ok(Err(broadcast::error::RecvError::Lagged(_))) => continue,
            other => panic!("no matching pool event: {other:?}"),
        }
    }
}

/// The pool's status, and its process `pid` picked out of it (the test fails if it is not
/// listed).
pub async fn status_with_worker(pool: &Pool, pid: u32) -> (PoolStatus, WorkerStatus) {
    let status = pool.status().await.expect("status");
    let worker = status
        .workers
        .iter()
        .find(|w| w.pid == pid)
        .cloned()
        .unwrap_or_else(|| panic!("process {pid} is not in the pool's status: {status:?}"));
    (status, worker)
}

pub async fn shutdown_leaves_nothing(pool: &Pool) {
    let pids: Vec<u32> = pool
        .status()
        .await
        .map(|s| s.workers.iter().map(|w| w.pid).collect())
        .unwrap_or_default();
    pool.shutdown().await.expect("shutdown");
    for pid in pids {
        let left = wait_group_gone(pid, Duration::from_secs(5)).await;
        assert!(left.is_empty(), "group {pid} left behind: {left:?}");
    }
}

impl Fixture {
    /// A runtime program: `real` behind `tests/support/resume_delay_proxy.mjs`, which
    /// writes `marker` when the runtime streams a `session.resume` event and holds its next
    /// frames (the reply) back for half a second.
    pub fn resume_delay_proxy(&self, real: &std::path::Path, marker: &std::path::Path) -> PathBuf {
        let proxy = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests")
            .join("support")
            .join("resume_delay_proxy.mjs");
        let script = self.scratch.path().join("resume-delay-proxy.sh");
        std::fs::write(
            &script,
            format!(
                "#!/bin/sh\nPROXY_RUNTIME='{}' PROXY_MARKER='{}' PROXY_DELAY_MS=500 exec node '{}' \"$@\"\n",
                real.display(),
                marker.display(),
                proxy.display()
            ),
        )
        .expect("proxy script");
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o755)).expect("chmod");
        script
    }

    /// The file the fake runtime of `mode` appends every method it is called with to.
    pub fn fake_runtime_log(&self, mode: &str) -> PathBuf {
        self.scratch.path().join(format!("fake-runtime-{mode}.log"))
    }

    /// The methods the fake runtimes of `mode` were called with so far, in order.
    pub fn fake_runtime_calls(&self, mode: &str) -> Vec<String> {
        std::fs::read_to_string(self.fake_runtime_log(mode))
            .unwrap_or_default()
            .lines()
            .map(str::to_owned)
            .collect()
    }

    /// A pool config whose workers are the fake runtime (`tests/support/fake_runtime.mjs`,
    /// run by Node) in `mode`: for faults the real runtime cannot be told to produce.
    pub async fn fake_runtime_config(&self, mode: &str) -> PoolConfig {
        let fake = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests")
            .join("support")
            .join("fake_runtime.mjs");
        let script = self.scratch.path().join(format!("fake-runtime-{mode}.sh"));
        std::fs::write(
            &script,
            format!(
                "#!/bin/sh\nFAKE_RUNTIME_MODE='{mode}' FAKE_RUNTIME_LOG='{}' exec node '{}' \"$@\"\n",
                self.fake_runtime_log(mode).display(),
                fake.display()
            ),
        )
        .expect("fake runtime script");
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o755)).expect("chmod");
        let mut config = self.config().await;
        config.worker.program = script;
        config
    }
}
