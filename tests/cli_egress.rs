//! No CLI backend talks outward by default (issue 17, item 7): one full turn of each bundled
//! CLI (`claude-cli`, `codex-cli`, `google-gemini-cli`, the real CLIs installed by the
//! library's installer, with the bundled defaults and nothing else) against the scripted
//! model on loopback, with every `connect()` of the CLI's whole process tree traced
//! (`support::connect_trace`: ptrace, no strace needed). Every inet connect must go to the
//! scripted model's address; Unix sockets are allowed; a DNS query (port 53) or any other
//! destination is listed in the failure. Each test also checks the trace saw the model
//! connect, so a tracer that sees nothing cannot pass.
//!
//! One CLI runs at a time (a lock), each under its own tracer thread.

mod support;

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use copilot_pool::Secret;
use copilot_pool::TurnEnd;
use copilot_pool::backend::CliTurnOutcome;
use copilot_pool::backend::claude_live::{ClaudeLive, ClaudeLiveConfig};
use copilot_pool::backend::oneshot::{Oneshot, OneshotConfig};
use copilot_pool::runtime::AgentCli;
use copilot_pool::scripted_model::{HttpEndpoint, ScriptedModel};
use tempfile::TempDir;
use tokio::sync::Mutex;

use support::agent_cli::{claude_path, codex_path, path};
use support::connect_trace::{ConnectTrace, Target, Trace};

/// One traced CLI at a time.
static SERIAL: Mutex<()> = Mutex::const_new(());

/// A failure guard for one traced turn (syscall tracing slows a CLI down), not a wait.
const TURN_LIMIT: Duration = Duration::from_secs(240);

struct Fixture {
    _model: ScriptedModel,
    endpoint: HttpEndpoint,
    /// Outside the system temp folder (Codex warns about a `CODEX_HOME` under it).
    dir: TempDir,
}

impl Fixture {
    async fn new() -> Self {
        let model = ScriptedModel::new();
        let endpoint = model.serve_http().await.expect("scripted model");
        Self {
            _model: model,
            endpoint,
            dir: tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).expect("tempdir"),
        }
    }

    fn model_addr(&self) -> SocketAddr {
        self.endpoint.addr()
    }
}

/// Fails listing every inet call of the trace that did not go to the model, and when the
/// trace never saw the model connect.
fn assert_only_the_model(cli: &str, trace: &Trace, model: SocketAddr, took: Duration) {
    eprintln!(
        "measured: {cli} traced turn {took:?}, {} tasks, {} syscalls, {} socket calls",
        trace.tasks,
        trace.syscalls,
        trace.attempts.len()
    );
    for attempt in &trace.attempts {
        eprintln!("  {attempt}");
    }
    let outbound = trace.outbound_except(model);
    assert!(
        outbound.is_empty(),
        "{cli} talked to something other than the model at {model} (fix its switches: \
         src/backend/config.rs, or Gemini's settings in src/backend/gemini.rs):\n{}",
        outbound
            .iter()
            .map(|a| format!("  {a}"))
            .collect::<Vec<_>>()
            .join("\n")
    );
    assert!(
        trace
            .attempts
            .iter()
            .any(|a| a.syscall == "connect" && a.target == Target::Inet(model)),
        "the trace of {cli} never saw it connect to the model at {model}: {:?}",
        trace.attempts
    );
}

fn assert_idle(outcome: &CliTurnOutcome, text: &str) {
    assert_eq!(outcome.end, Some(TurnEnd::Idle), "{outcome:?}");
    assert_eq!(outcome.text, text, "{outcome:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claude_turn_with_the_bundled_defaults_connects_only_to_the_model() {
    let _serial = SERIAL.lock().await;
    let fx = Fixture::new().await;
    let trace = ConnectTrace::start(&fx.dir.path().join("trace"), &claude_path().await);
    let mut config = ClaudeLiveConfig::new(
        trace.wrapper(),
        fx.dir.path().join("claude-cli"),
        fx.dir.path().join("work"),
    );
    config.base_url = Some(format!("http://{}", fx.model_addr()));
    config.api_key = Some(Secret::new("sk-ant-FAKE-not-a-real-key"));
    let mut live = ClaudeLive::new(config).expect("valid config");
    let started = Instant::now();
    let outcome = tokio::time::timeout(TURN_LIMIT, live.run("REPLY=traced pong", |_| {}))
        .await
        .expect("the turn ended in time")
        .expect("the turn started");
    live.close().await;
    let took = started.elapsed();
    assert_idle(&outcome, "traced pong");
    assert_only_the_model("claude-cli", &trace.finish(), fx.model_addr(), took);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_codex_turn_with_the_bundled_defaults_connects_only_to_the_model() {
    let _serial = SERIAL.lock().await;
    let fx = Fixture::new().await;
    let trace = ConnectTrace::start(&fx.dir.path().join("trace"), &codex_path().await);
    let mut config = OneshotConfig::codex(
        trace.wrapper(),
        fx.dir.path().join("codex-cli"),
        fx.dir.path().join("work"),
    );
    config.base_url = Some(format!("http://{}/v1", fx.model_addr()));
    config.api_key = Some(Secret::new("sk-FAKE-not-a-real-key"));
    config.turn_timeout = TURN_LIMIT;
    let mut codex = Oneshot::new(config).expect("valid config");
    let started = Instant::now();
    let outcome = tokio::time::timeout(TURN_LIMIT, codex.run("REPLY=traced pong", |_| {}))
        .await
        .expect("the turn ended in time")
        .expect("the turn started");
    let took = started.elapsed();
    assert_idle(&outcome, "traced pong");
    assert_only_the_model("codex-cli", &trace.finish(), fx.model_addr(), took);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gemini_turn_with_the_bundled_defaults_connects_only_to_the_model() {
    let _serial = SERIAL.lock().await;
    let fx = Fixture::new().await;
    let trace = ConnectTrace::start(&fx.dir.path().join("trace"), &path(AgentCli::Gemini).await);
    let mut config = OneshotConfig::gemini(
        trace.wrapper(),
        fx.dir.path().join("google-gemini-cli"),
        fx.dir.path().join("work"),
    );
    config.base_url = Some(format!("http://{}", fx.model_addr()));
    config.api_key = Some(Secret::new("AIza-FAKE-not-a-real-key"));
    config.turn_timeout = TURN_LIMIT;
    let mut gemini = Oneshot::new(config).expect("valid config");
    let started = Instant::now();
    let outcome = tokio::time::timeout(TURN_LIMIT, gemini.run("REPLY=traced pong", |_| {}))
        .await
        .expect("the turn ended in time")
        .expect("the turn started");
    let took = started.elapsed();
    assert_idle(&outcome, "traced pong");
    assert_only_the_model("google-gemini-cli", &trace.finish(), fx.model_addr(), took);
}
