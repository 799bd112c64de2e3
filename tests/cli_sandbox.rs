//! CLI backends inside the workers' Landlock sandbox (issue 17, item 7): the real Claude
//! Code (live), Codex and Gemini CLI (one-shot) CLIs started through `copilot-pool sandbox-exec` with
//! the sandbox the pool makes for an agent's CLI processes (`Sandbox::for_cli_agent`: the
//! agent's directory read and write, TCP to the model's port only). A turn runs; the
//! model's shell tool call writes inside the agent's work directory but not outside it, and
//! cannot connect to a loopback port other than the model's. Without the sandbox the same
//! tool call escapes (the contrast that shows the walls are the sandbox's).
//!
//! One CLI runs at a time (a lock).

mod support;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use copilot_pool::backend::CliTurnOutcome;
use copilot_pool::backend::claude_live::{ClaudeLive, ClaudeLiveConfig};
use copilot_pool::backend::oneshot::{Oneshot, OneshotConfig};
use copilot_pool::permission::ApproveAll;
use copilot_pool::sandbox::Sandbox;
use copilot_pool::scripted_model::{HttpEndpoint, ScriptedModel};
use copilot_pool::{Secret, TurnEnd};
use tempfile::TempDir;
use tokio::sync::Mutex;

use support::agent_cli::{claude_path, codex_path, path};

/// One CLI at a time.
static SERIAL: Mutex<()> = Mutex::const_new(());

/// A failure guard for one turn, not a wait.
const TURN_LIMIT: Duration = Duration::from_secs(120);

struct Fixture {
    _model: ScriptedModel,
    endpoint: HttpEndpoint,
    /// Outside the system temp folder (Codex warns about a `CODEX_HOME` under it), so
    /// `/tmp` is outside every agent directory too.
    dir: TempDir,
    /// A loopback listener that is not the model: the tool call's connect must fail.
    other: std::net::TcpListener,
}

impl Fixture {
    async fn new() -> Self {
        let model = ScriptedModel::new();
        let endpoint = model.serve_http().await.expect("scripted model");
        Self {
            _model: model,
            endpoint,
            dir: tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).expect("tempdir"),
            other: std::net::TcpListener::bind("127.0.0.1:0").expect("listener"),
        }
    }

    /// The agent's directory (as the pool lays it out: the backend's home and the work
    /// directory inside).
    fn agent(&self) -> PathBuf {
        self.dir.path().join("agents/a1")
    }

    fn outside(&self) -> PathBuf {
        let dir = self.dir.path().join("outside");
        std::fs::create_dir_all(&dir).expect("outside dir");
        dir
    }

    /// The sandbox the pool gives this agent's CLI processes, run by the daemon's wrapper.
    fn sandbox(&self) -> Sandbox {
        let template = Sandbox::new(
            PathBuf::from(env!("CARGO_BIN_EXE_copilot-pool")),
            vec!["sandbox-exec".into()],
        );
        template
            .for_cli_agent(&self.agent(), &[self.endpoint.addr().port()])
            .expect("agent sandbox")
    }

    /// A shell script that writes inside the work directory, outside the agent's
    /// directory, and connects to the other listener, printing what happened.
    fn probe(&self) -> String {
        let outside = self.outside().join("escaped.txt");
        format!(
            "echo in > inside.txt && echo inside=open || echo inside=shut; \
             (echo out > {}) 2>/dev/null && echo outside=open || echo outside=shut; \
             (exec 3<>/dev/tcp/127.0.0.1/{}) 2>/dev/null && echo tcp=open || echo tcp=shut",
            outside.display(),
            self.other.local_addr().expect("addr").port()
        )
    }

    fn escaped(&self) -> bool {
        self.outside().join("escaped.txt").exists()
    }
}

/// `name=open|shut` pairs the probe printed (they come back in the model's answer).
fn verdicts(outcome: &CliTurnOutcome) -> Vec<String> {
    ["inside", "outside", "tcp"]
        .iter()
        .map(|name| {
            let open = format!("{name}=open");
            let shut = format!("{name}=shut");
            match (outcome.text.contains(&open), outcome.text.contains(&shut)) {
                (true, false) => open,
                (false, true) => shut,
                _ => format!("{name}=? in {:?}", outcome.text),
            }
        })
        .collect()
}

async fn claude_turn(fx: &Fixture, sandbox: Option<Sandbox>) -> (CliTurnOutcome, PathBuf) {
    let agent = fx.agent();
    let mut config = ClaudeLiveConfig::new(
        claude_path().await,
        agent.join("claude-cli"),
        agent.join("work"),
    );
    config.base_url = Some(format!("http://{}", fx.endpoint.addr()));
    config.api_key = Some(Secret::new("sk-ant-FAKE-not-a-real-key"));
    // Approve-all: as root, Claude takes bypassPermissions only when it runs sandboxed
    // (the runner says so with IS_SANDBOX=1; the backend's env does not set it here).
    config.permission = Arc::new(ApproveAll);
    config.sandbox = sandbox;
    let work = config.cwd.clone();
    let mut live = ClaudeLive::new(config).expect("valid config");
    let args = serde_json::json!({"command": fx.probe(), "description": "probe"});
    let prompt = format!("SCENARIO:tool NAME=Bash ARGS={args}");
    let outcome = tokio::time::timeout(TURN_LIMIT, live.run(&prompt, |_| {}))
        .await
        .expect("the turn ended in time")
        .expect("the turn started");
    live.close().await;
    (outcome, work)
}

async fn codex_turn(fx: &Fixture, sandbox: Option<Sandbox>) -> (CliTurnOutcome, PathBuf) {
    let agent = fx.agent();
    let mut config = OneshotConfig::codex(
        codex_path().await,
        agent.join("codex-cli"),
        agent.join("work"),
    );
    config.base_url = Some(format!("http://{}/v1", fx.endpoint.addr()));
    config.api_key = Some(Secret::new("sk-FAKE-not-a-real-key"));
    config.model = Some("gpt-5.5".to_owned());
    config.turn_timeout = TURN_LIMIT;
    config.sandbox = sandbox;
    let work = config.cwd.clone();
    let mut codex = Oneshot::new(config).expect("valid config");
    let args = serde_json::json!({ "cmd": fx.probe() });
    let prompt = format!("SCENARIO:tool NAME=exec_command ARGS={args}");
    let outcome = tokio::time::timeout(TURN_LIMIT, codex.run(&prompt, |_| {}))
        .await
        .expect("the turn ended in time")
        .expect("the turn started");
    (outcome, work)
}

async fn gemini_turn(fx: &Fixture, sandbox: Option<Sandbox>) -> (CliTurnOutcome, PathBuf) {
    let agent = fx.agent();
    let script = path(copilot_pool::runtime::AgentCli::Gemini).await;
    let mut config =
        OneshotConfig::gemini(script, agent.join("google-gemini-cli"), agent.join("work"));
    config.base_url = Some(format!("http://{}", fx.endpoint.addr()));
    config.api_key = Some(Secret::new("AIza-FAKE-not-a-real-key"));
    config.model = Some("gemini-2.5-pro".to_owned());
    config.turn_timeout = TURN_LIMIT;
    // Headless Gemini offers its shell tool only when every call is approved, and takes
    // that approval mode only in a trusted workspace (whose own settings it then loads: the
    // pool leaves it untrusted unless the backend's env names the variable).
    config
        .backend
        .args
        .extend(["--approval-mode".to_owned(), "yolo".to_owned()]);
    config
        .backend
        .env
        .insert("GEMINI_CLI_TRUST_WORKSPACE".to_owned(), "true".to_owned());
    config.sandbox = sandbox;
    let work = config.cwd.clone();
    let mut gemini = Oneshot::new(config).expect("valid config");
    let args = serde_json::json!({ "command": fx.probe() });
    let prompt = format!("SCENARIO:tool NAME=run_shell_command ARGS={args}");
    let outcome = tokio::time::timeout(TURN_LIMIT, gemini.run(&prompt, |_| {}))
        .await
        .expect("the turn ended in time")
        .expect("the turn started");
    (outcome, work)
}

fn assert_walled(cli: &str, outcome: &CliTurnOutcome, work: &Path, fx: &Fixture) {
    assert_eq!(outcome.end, Some(TurnEnd::Idle), "{cli}: {outcome:?}");
    assert_eq!(
        verdicts(outcome),
        ["inside=open", "outside=shut", "tcp=shut"],
        "{cli}: {outcome:?}"
    );
    assert!(work.join("inside.txt").is_file(), "{cli} wrote at home");
    assert!(!fx.escaped(), "{cli} wrote outside the agent's directory");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sandboxed_claude_turn_runs_its_bash_tool_at_home_but_cannot_write_outside_or_connect_elsewhere()
 {
    let _serial = SERIAL.lock().await;
    let fx = Fixture::new().await;
    let (outcome, work) = claude_turn(&fx, Some(fx.sandbox())).await;
    assert_walled("claude-cli", &outcome, &work, &fx);
    // Sandboxed, the approve-all policy runs Claude in bypassPermissions (root included):
    // the tool call asked nothing.
    assert_eq!(outcome.permission_prompts, 0, "{outcome:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sandboxed_codex_turn_runs_its_shell_tool_at_home_but_cannot_write_outside_or_connect_elsewhere()
 {
    let _serial = SERIAL.lock().await;
    let fx = Fixture::new().await;
    let (outcome, work) = codex_turn(&fx, Some(fx.sandbox())).await;
    assert_walled("codex-cli", &outcome, &work, &fx);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sandboxed_gemini_turn_runs_its_shell_tool_at_home_but_cannot_write_outside_or_connect_elsewhere()
 {
    let _serial = SERIAL.lock().await;
    let fx = Fixture::new().await;
    let (outcome, work) = gemini_turn(&fx, Some(fx.sandbox())).await;
    assert_walled("google-gemini-cli", &outcome, &work, &fx);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_the_sandbox_the_same_claude_tool_call_writes_outside_and_connects() {
    let _serial = SERIAL.lock().await;
    let fx = Fixture::new().await;
    let (outcome, _) = claude_turn(&fx, None).await;
    if nix::unistd::geteuid().is_root() {
        // As root and unsandboxed, Claude stays in `default` mode: the policy approved it.
        assert!(outcome.permission_prompts > 0, "{outcome:?}");
    }
    assert_eq!(
        verdicts(&outcome),
        ["inside=open", "outside=open", "tcp=open"],
        "{outcome:?}"
    );
    assert!(fx.escaped());
}

/// Over the daemon (`sandbox = "auto"`, its default): the pool puts the `claude-cli`
/// backend's process in the agent's sandbox, so the same probe, approved by the gateway,
/// writes at home but not outside and reaches no other port.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_daemon_runs_a_claude_backend_turn_in_the_agents_sandbox() {
    use support::http::{Daemon, SseStream, call};
    let _serial = SERIAL.lock().await;
    let fx = Fixture::new().await;
    let scratch = fx.dir.path().join("daemon");
    std::fs::create_dir_all(&scratch).expect("scratch");
    let config = support::agent_cli::claude_daemon_config("", "").await;
    let daemon = Daemon::start(&scratch, &config, &[]).await;
    let args = serde_json::json!({"command": fx.probe(), "description": "probe"});
    let body = serde_json::json!({
        "agent_id": "walled",
        "session_key": "s1",
        "prompt": format!("SCENARIO:tool NAME=Bash ARGS={args}"),
        "backend": "claude-cli",
        "provider": {
            "type": "anthropic",
            "base_url": format!("http://{}", fx.endpoint.addr()),
            "api_key": "sk-ant-FAKE-k1",
        },
    });
    let run = async {
        let mut stream = SseStream::open(daemon.addr, "/v1/turns", None, &body).await;
        assert_eq!(stream.status, 200, "the turn was accepted");
        while let Some(event) = stream.next().await {
            if event.event == "turn.end" {
                return event.data;
            }
            if event.event == "permission.request" {
                let id = event.data["request_id"].as_str().unwrap_or_default();
                let answered = call(
                    daemon.addr,
                    "POST",
                    &format!("/v1/requests/{id}"),
                    None,
                    Some(&serde_json::json!({"decision": "approve-once"})),
                )
                .await;
                assert_eq!(answered.status, 204, "{}", answered.body);
            }
        }
        panic!("the stream ended without turn.end");
    };
    let end = tokio::time::timeout(TURN_LIMIT, run)
        .await
        .expect("the turn ended in time");
    assert_eq!(end["status"], "idle", "{end}");
    let text = end["final_text"].as_str().unwrap_or_default();
    for verdict in ["inside=open", "outside=shut", "tcp=shut"] {
        assert!(text.contains(verdict), "{verdict} in {end}");
    }
    assert!(
        !fx.escaped(),
        "the tool wrote outside the agent's directory"
    );
}
