//! Tokens and keys never appear in logs or `Debug` output: every log line of a full lease
//! cycle (token auth, BYOK key, a crash, a rotation) is captured at TRACE level and searched.
//! This binary installs a global subscriber, so it holds this one test only.

mod support;

use std::io::Write;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use copilot_pool::auth::LeaseAuth;
use copilot_pool::pool::{LeaseRequest, Pool, PoolConfig};
use copilot_pool::rpc::messages::ProviderConfig;
use copilot_pool::scripted_model::ScriptedModel;
use copilot_pool::secret::Secret;
use copilot_pool::worker::WorkerConfig;

#[derive(Clone, Default)]
struct Capture(Arc<Mutex<Vec<u8>>>);

impl Write for Capture {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        if let Ok(mut v) = self.0.lock() {
            v.extend_from_slice(buf);
        }
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

const TOKEN_V1: &str = "ghu_SECRET_token_one_4c1d";
const TOKEN_V2: &str = "ghu_SECRET_token_two_9e7a";
const API_KEY: &str = "sk-SECRET-provider-key-77";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokens_never_reach_logs_or_debug_output() {
    let capture = Capture::default();
    let writer = capture.clone();
    tracing_subscriber::fmt()
        .with_max_level(tracing::Level::TRACE)
        .with_writer(move || writer.clone())
        .init();

    let scratch = support::Scratch::new();
    let model = ScriptedModel::new();
    let endpoint = model.serve_http().await.expect("model");
    let mut worker =
        WorkerConfig::new(support::runtime::runtime_path().await, "".into(), "".into());
    worker.kill_grace = Duration::from_secs(2);
    let mut config = PoolConfig::new(
        worker,
        scratch.path().join("state"),
        scratch.path().join("agents"),
    );
    config.model_guard.allow_private_endpoints = true;
    let pool = Pool::start(config).await.expect("pool");
    let mut req = LeaseRequest::new("agent-s", "conv", scratch.work());
    req.model = Some(ScriptedModel::MODEL_ID.into());
    req.provider = Some(ProviderConfig::openai(
        endpoint.base_url(),
        Some(Secret::new(API_KEY)),
    ));
    req.available_tools = Some(vec![]);
    req.auth = LeaseAuth {
        github_token: Some(Secret::new(TOKEN_V1)),
        profile_id: Some("p".into()),
        profile_version: Some("v1".into()),
        ..Default::default()
    };
    let mut debug_text = format!("{req:?}");
    let mut lease = pool.lease(req.clone()).await.expect("lease");
    lease.run("REPLY=one").await.expect("turn");
    debug_text += &format!("{lease:?}");
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(lease.worker_pid() as i32),
        nix::sys::signal::Signal::SIGKILL,
    )
    .expect("kill");
    let _ = lease.run("REPLY=two").await;
    drop(lease);
    req.auth.github_token = Some(Secret::new(TOKEN_V2));
    req.auth.profile_version = Some("v2".into());
    let mut lease = pool.lease(req.clone()).await.expect("lease after rotation");
    lease.run("REPLY=three").await.expect("turn");
    debug_text += &format!("{:?} {:?}", pool.status().await.expect("status"), req);
    drop(lease);
    pool.shutdown().await.expect("shutdown");

    let logs = String::from_utf8_lossy(&capture.0.lock().expect("logs")).into_owned();
    assert!(
        logs.len() > 1000,
        "expected real log output, got {} bytes",
        logs.len()
    );
    for secret in [TOKEN_V1, TOKEN_V2, API_KEY] {
        assert!(!logs.contains(secret), "{secret} in the logs");
        assert!(
            !debug_text.contains(secret),
            "{secret} in Debug output: {debug_text}"
        );
    }
    // The bindings on disk hold no secret either.
    for entry in std::fs::read_dir(scratch.path().join("state/bindings")).expect("bindings") {
        let text = std::fs::read_to_string(entry.expect("entry").path()).unwrap_or_default();
        for secret in [TOKEN_V1, TOKEN_V2, API_KEY] {
            assert!(!text.contains(secret), "{secret} in a binding file");
        }
    }
}
