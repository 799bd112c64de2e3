//! Shared helpers for the end-to-end tests: the real runtime, scratch homes, a scripted
//! model, collecting a turn, and checking that no process is left behind.

#![allow(dead_code)]

pub mod agent_cli;
pub mod api;
pub mod cli_daemon;
pub mod connect_trace;
pub mod hook_files;
pub mod http;
pub mod node_sdk;
pub mod output_limit;
pub mod pool_fixture;
pub mod procs;
pub mod promtool;
pub mod python_sdk;
pub mod refusing_port;
pub mod runtime;
pub mod schemathesis;
pub mod step;
pub mod tool_install;

use std::path::{Path, PathBuf};
use std::time::Duration;

use copilot_pool::rpc::messages::{ProviderConfig, SessionConfig, ToolDefinition};
use copilot_pool::rpc::{EventKind, SessionEvent};
use copilot_pool::scripted_model::ScriptedModel;
use copilot_pool::worker::{Session, SessionUpdate, WorkerConfig, WorkerError};
use serde_json::json;
use tempfile::TempDir;

/// Upper bound for one whole turn in these tests (a failure guard, not a wait).
pub const TURN_LIMIT: Duration = Duration::from_secs(60);

/// A scratch directory with a `home/` (COPILOT_HOME and HOME) and a `work/` directory.
pub struct Scratch {
    pub dir: TempDir,
}

impl Scratch {
    pub fn new() -> Self {
        let dir = tempfile::Builder::new()
            .prefix("copilot-pool-test-")
            .tempdir()
            .expect("tempdir");
        std::fs::create_dir_all(dir.path().join("home/copilot")).expect("home");
        std::fs::create_dir_all(dir.path().join("work")).expect("work");
        Self { dir }
    }

    pub fn copilot_home(&self) -> PathBuf {
        self.dir.path().join("home/copilot")
    }

    pub fn work(&self) -> PathBuf {
        self.dir.path().join("work")
    }

    pub fn path(&self) -> &Path {
        self.dir.path()
    }
}

/// How long a `copilot-pool` command run by [`json_report`] may take (a bench at the tests'
/// sizes takes a few minutes on a loaded 2-core machine).
const JSON_REPORT_DEADLINE: Duration = Duration::from_secs(20 * 60);

/// Runs a `copilot-pool` command that ends with one JSON object (`--json`) in a process group
/// of its own, killed with it at [`JSON_REPORT_DEADLINE`] or when the test's future is
/// dropped; fails the test with its stderr unless it succeeded, and returns that object and
/// the whole of its standard output.
pub async fn json_report(
    cmd: std::process::Command,
    what: &'static str,
) -> (serde_json::Value, String) {
    let mut cmd = tokio::process::Command::from(cmd);
    cmd.stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped());
    let leader = copilot_pool::process::GroupLeader::spawn(cmd)
        .unwrap_or_else(|e| panic!("run copilot-pool {what}: {e}"));
    let deadline = tokio::time::Instant::now() + JSON_REPORT_DEADLINE;
    let out = leader
        .output_until(deadline, Duration::from_secs(5))
        .await
        .unwrap_or_else(|_| {
            panic!("copilot-pool {what} did not finish in {JSON_REPORT_DEADLINE:?}; its process group was killed")
        })
        .unwrap_or_else(|e| panic!("waiting for copilot-pool {what}: {e}"));
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "copilot-pool {what} failed: {}\n{stdout}",
        String::from_utf8_lossy(&out.stderr)
    );
    let last = stdout.lines().last().expect("a JSON line");
    let report = serde_json::from_str(last).expect("the last line is JSON");
    (report, stdout)
}

/// A worker config for the real runtime with an isolated home and a short kill grace.
pub async fn worker_config(scratch: &Scratch) -> WorkerConfig {
    let mut config = WorkerConfig::new(
        runtime::runtime_path().await,
        scratch.copilot_home(),
        scratch.work(),
    );
    config.extra_env = vec![(
        "HOME".to_owned(),
        scratch.path().join("home").display().to_string(),
    )];
    config.kill_grace = Duration::from_secs(2);
    config
}

/// A worker on the real runtime ([`worker_config`]) in a fresh scratch directory, and a
/// scripted model served over loopback HTTP for its sessions.
#[allow(dead_code)]
pub async fn worker_and_model() -> (
    Scratch,
    ScriptedModel,
    copilot_pool::scripted_model::HttpEndpoint,
    copilot_pool::worker::WorkerHandle,
) {
    let scratch = Scratch::new();
    let model = ScriptedModel::new();
    let endpoint = model.serve_http().await.expect("model endpoint");
    let worker = copilot_pool::worker::WorkerHandle::start(worker_config(&scratch).await)
        .await
        .expect("worker starts");
    (scratch, model, endpoint, worker)
}

/// Session params pointing at a scripted model served at `base_url`.
pub fn session_config(base_url: &str, scratch: &Scratch) -> SessionConfig {
    SessionConfig {
        model: Some(ScriptedModel::MODEL_ID.to_owned()),
        provider: Some(ProviderConfig::openai(
            base_url,
            Some("scripted-key".into()),
        )),
        working_directory: Some(scratch.work().display().to_string()),
        env_value_mode: Some("direct".to_owned()),
        tool_filter_precedence: Some("excluded".to_owned()),
        // Only our own tools: keeps model requests small and deterministic.
        available_tools: Some(vec!["custom:*".to_owned()]),
        ..Default::default()
    }
}

/// The client tool used by the tool tests.
pub fn secret_tool() -> ToolDefinition {
    ToolDefinition {
        name: "get_secret_number".to_owned(),
        description: "Returns the secret number for a key".to_owned(),
        parameters: json!({"type": "object", "properties": {"key": {"type": "string"}}, "required": ["key"]}),
        skip_permission: Some(true),
        overrides_built_in_tool: None,
    }
}

/// The next session event, skipping hooks (answered with their default) and failing the
/// test on anything else or on the turn limit.
pub async fn next_event(session: &mut Session) -> Result<SessionEvent, WorkerError> {
    loop {
        let update = tokio::time::timeout(TURN_LIMIT, session.next())
            .await
            .expect("no session update within the turn limit")
            .expect("session stream ended without Ended");
        match update {
            SessionUpdate::Event(event) => return Ok(event),
            SessionUpdate::Hook(hook) => drop(hook),
            SessionUpdate::UserInput(req) => req.fail("not expected in this test"),
            SessionUpdate::Request(req) => drop(req),
            SessionUpdate::Notification(_) => {}
            SessionUpdate::Ended(err) => return Err(err),
        }
    }
}

/// Reads events until `pick` accepts one, and returns what it picked.
pub async fn event_where<T>(session: &mut Session, pick: impl Fn(EventKind) -> Option<T>) -> T {
    loop {
        let event = next_event(session)
            .await
            .expect("worker ended before the event");
        if let Some(picked) = pick(event.kind) {
            return picked;
        }
    }
}

/// Events up to and including `session.idle`.
pub async fn collect_turn(session: &mut Session) -> Vec<SessionEvent> {
    let mut events = Vec::new();
    loop {
        let event = next_event(session)
            .await
            .expect("worker ended during the turn");
        let idle = matches!(event.kind, EventKind::SessionIdle(_));
        events.push(event);
        if idle {
            return events;
        }
    }
}

/// The content of the last `assistant.message` of a turn.
pub fn final_text(events: &[SessionEvent]) -> String {
    events
        .iter()
        .rev()
        .find_map(|e| match &e.kind {
            EventKind::AssistantMessage(m) if !m.content.is_empty() => Some(m.content.clone()),
            _ => None,
        })
        .unwrap_or_default()
}

/// Shuts the worker down and checks that nothing of its process group is left.
pub async fn shutdown_and_check(worker: &copilot_pool::worker::WorkerHandle) {
    let exit = worker.shutdown().await;
    assert!(exit.is_shutdown(), "{exit}");
    let left = procs::wait_group_gone(worker.pid(), Duration::from_secs(5)).await;
    assert!(
        left.is_empty(),
        "processes left in group {}: {left:?}",
        worker.pid()
    );
}

/// Position of the first event of `event_type`.
pub fn position(events: &[SessionEvent], event_type: &str) -> Option<usize> {
    events.iter().position(|e| e.event_type() == event_type)
}
