//! The `codex-cli` one-shot backend against the real Codex CLI (its vendored native binary,
//! installed from npm by the library's installer) and the crate's scripted model speaking
//! the OpenAI Responses API on loopback: a turn, a resume that carries history, a tool call,
//! a kill mid-turn and the resume after it, a dead endpoint, the output limit, usage per
//! turn, and the reasoning effort. At most two Codex processes run at once (the test threads), each test one at a
//! time.

mod support;

use std::path::PathBuf;
use std::time::{Duration, Instant};

use copilot_pool::backend::oneshot::{Oneshot, OneshotConfig};
use copilot_pool::backend::{BackendEvent, CliTurnOutcome, TurnFailure};
use copilot_pool::scripted_model::{Decision, HttpEndpoint, RecordedRequest, ScriptedModel};
use copilot_pool::{ReasoningEffort, Secret, TurnEnd};
use tempfile::TempDir;

use support::agent_cli::codex_path;
use support::procs::wait_group_gone;

/// Upper bound for one whole turn (a failure guard, not a wait).
const TURN_LIMIT: Duration = Duration::from_secs(90);
/// The fake key; it must reach the model as the bearer token and nowhere else.
const KEY: &str = "sk-FAKE-not-a-real-key";
/// The model named to Codex (`--model`).
const MODEL: &str = "gpt-5.5";

struct Fixture {
    model: ScriptedModel,
    endpoint: HttpEndpoint,
    /// Outside the system temp folder: Codex warns (and skips its helper links) when
    /// `CODEX_HOME` is under it.
    dir: TempDir,
}

impl Fixture {
    async fn new() -> Self {
        let model = ScriptedModel::new();
        let endpoint = model.serve_http().await.expect("scripted model");
        Self {
            model,
            endpoint,
            dir: tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).expect("tempdir"),
        }
    }

    fn work(&self, name: &str) -> PathBuf {
        self.dir.path().join(name).join("work")
    }

    /// The bundled backend homed in this fixture's directory, pointed at the scripted model.
    async fn config(&self, name: &str) -> OneshotConfig {
        let mut config = OneshotConfig::codex(
            codex_path().await,
            self.dir.path().join(name).join("home"),
            self.work(name),
        );
        config.base_url = Some(format!("http://{}/v1", self.endpoint.addr()));
        config.api_key = Some(Secret::new(KEY));
        // A model Codex knows with its classic tool set (`exec_command` at the top level of
        // `tools`); 0.171.0's default model runs in "code mode", where the tools sit in an
        // `additional_tools` input item behind a JavaScript `exec` tool.
        config.model = Some(MODEL.to_owned());
        config
    }

    async fn oneshot(&self, name: &str) -> Oneshot {
        Oneshot::new(self.config(name).await).expect("valid config")
    }

    /// The model call answered with `text`.
    fn call_answered(&self, text: &str) -> RecordedRequest {
        self.model
            .requests()
            .into_iter()
            .filter(|r| r.path.ends_with("/responses"))
            .find(|r| matches!(r.decision(), Some(Decision::Text(t)) if t == text))
            .unwrap_or_else(|| panic!("no model call answered {text:?}"))
    }
}

/// Runs one turn with a guard against hanging, collecting its events.
async fn turn(oneshot: &mut Oneshot, prompt: &str) -> (CliTurnOutcome, Vec<BackendEvent>) {
    let mut events = Vec::new();
    let outcome = tokio::time::timeout(TURN_LIMIT, oneshot.run(prompt, |e| events.push(e.clone())))
        .await
        .expect("the turn ended in time")
        .expect("the turn started");
    (outcome, events)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_turn_returns_the_scripted_text_and_a_resume_carries_the_first_turn() {
    let fx = Fixture::new().await;
    let mut codex = fx.oneshot("a").await;

    let started = Instant::now();
    let (first, events) = turn(&mut codex, "REPLY=pong from the script").await;
    eprintln!(
        "measured: first turn, spawn to exit {:?}",
        started.elapsed()
    );
    assert_eq!(first.end, Some(TurnEnd::Idle), "{first:?}");
    assert_eq!(first.text, "pong from the script");
    assert!(first.failure.is_none());
    assert!(!first.resumed);
    let thread = first.session_id.clone().expect("the thread id");
    assert_eq!(
        events.iter().map(BackendEvent::name).collect::<Vec<_>>(),
        ["assistant.message", "turn.end"]
    );
    let call = fx.call_answered("pong from the script");
    assert_eq!(call.header("authorization"), [format!("Bearer {KEY}")]);
    assert_eq!(call.body["model"], MODEL, "--model reached the request");

    let started = Instant::now();
    let (second, _) = turn(&mut codex, "REPLY=second answer").await;
    eprintln!(
        "measured: resumed turn, spawn to exit {:?}",
        started.elapsed()
    );
    assert_eq!(second.end, Some(TurnEnd::Idle), "{second:?}");
    assert_eq!(second.text, "second answer");
    assert!(second.resumed);
    assert_eq!(second.session_id.as_deref(), Some(thread.as_str()));
    let history = fx.call_answered("second answer").body["input"].to_string();
    assert!(
        history.contains("REPLY=pong from the script") && history.contains("pong from the script"),
        "the resumed run sent the first turn to the model: {history}"
    );
    // Codex kept its state (rollouts, SQLite, temp files) in the agent's home, and the key
    // is in none of it.
    let home = fx.dir.path().join("a").join("home");
    let files = files_under(&home);
    assert!(
        files
            .iter()
            .any(|f| f.starts_with(home.join(".codex").join("sessions"))),
        "the rollout is under CODEX_HOME: {files:?}"
    );
    for file in &files {
        let bytes = std::fs::read(file).unwrap_or_default();
        assert!(
            !bytes.windows(KEY.len()).any(|w| w == KEY.as_bytes()),
            "the key leaked into {}",
            file.display()
        );
    }
}

/// Every regular file under `dir`, recursively.
fn files_under(dir: &std::path::Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut pending = vec![dir.to_path_buf()];
    while let Some(dir) = pending.pop() {
        let Ok(entries) = std::fs::read_dir(&dir) else {
            continue;
        };
        for entry in entries.flatten() {
            let Ok(kind) = entry.file_type() else {
                continue;
            };
            if kind.is_dir() {
                pending.push(entry.path());
            } else if kind.is_file() {
                out.push(entry.path());
            }
        }
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_endpoints_query_reaches_the_model_whole_through_a_private_profile_file() {
    let fx = Fixture::new().await;
    let mut config = fx.config("q").await;
    // A query like Azure's api-version, and a tenant's signature that must not show in
    // the process list: in `base_url` Codex put its `/responses` after the query.
    config.base_url = Some(format!(
        "http://{}/v1?api-version=2025-01-01&sig=t%2Fop",
        fx.endpoint.addr()
    ));
    let mut codex = Oneshot::new(config).expect("valid config");
    let (outcome, _) = turn(&mut codex, "REPLY=with a query").await;
    assert_eq!(outcome.end, Some(TurnEnd::Idle), "{outcome:?}");
    let call = fx.call_answered("with a query");
    assert_eq!(call.path, "/v1/responses");
    let mut query: Vec<&str> = call
        .query
        .as_deref()
        .unwrap_or_default()
        .split('&')
        .collect();
    query.sort_unstable();
    assert_eq!(query, ["api-version=2025-01-01", "sig=t%2Fop"]);
    // The run's profile (0600 while it runs: the unit tests) leaves with it, and the
    // signature in its query with it.
    let codex_home = fx.dir.path().join("q").join("home").join(".codex");
    let profiles: Vec<PathBuf> = files_under(&codex_home)
        .into_iter()
        .filter(|f| f.to_string_lossy().ends_with(".config.toml"))
        .collect();
    assert!(profiles.is_empty(), "left after the run: {profiles:?}");
    let kept: Vec<PathBuf> = files_under(&codex_home)
        .into_iter()
        .filter(|f| std::fs::read_to_string(f).is_ok_and(|text| text.contains("t%2Fop")))
        .collect();
    assert!(kept.is_empty(), "the signature is kept in {kept:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_reasoning_effort_reaches_the_model_as_codexs_model_reasoning_effort() {
    let fx = Fixture::new().await;
    let mut config = fx.config("effort").await;
    config.reasoning_effort = Some(ReasoningEffort::High);
    let mut codex = Oneshot::new(config).expect("valid");
    let (outcome, _) = turn(&mut codex, "REPLY=effort given").await;
    assert_eq!(outcome.end, Some(TurnEnd::Idle), "{outcome:?}");
    let body = &fx.call_answered("effort given").body;
    assert_eq!(body["reasoning"]["effort"], "high", "{body}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn usage_per_turn_is_not_the_threads_running_total_even_across_a_new_runner() {
    let fx = Fixture::new().await;
    let mut codex = fx.oneshot("usage").await;
    let mut per_turn = Vec::new();
    for n in 0..2 {
        let (outcome, _) = turn(&mut codex, &format!("REPLY=answer {n}")).await;
        assert_eq!(outcome.end, Some(TurnEnd::Idle), "{outcome:?}");
        per_turn.push(outcome.usage.input_tokens);
    }
    let stored = codex.stored_session().cloned().expect("a stored session");
    eprintln!(
        "measured: per-turn input tokens {per_turn:?}, thread totals {:?}",
        stored.usage_totals
    );
    assert_eq!(
        per_turn,
        [ScriptedModel::PROMPT_TOKENS, ScriptedModel::PROMPT_TOKENS],
        "each turn made one model call"
    );
    assert_eq!(
        stored.usage_totals.input_tokens,
        2 * ScriptedModel::PROMPT_TOKENS
    );

    // The pool restarted: a new runner with the persisted session diffs against its totals.
    let mut config = fx.config("usage").await;
    config.session = Some(stored);
    let mut again = Oneshot::new(config).expect("valid");
    let (third, _) = turn(&mut again, "REPLY=answer 2").await;
    assert!(third.resumed);
    assert_eq!(third.usage.input_tokens, ScriptedModel::PROMPT_TOKENS);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_scripted_exec_command_shows_up_as_a_tool_call_and_the_final_text_arrives() {
    let fx = Fixture::new().await;
    let mut codex = fx.oneshot("tool").await;
    let prompt = r#"SCENARIO:tool NAME=exec_command ARGS={"cmd":"echo hi-from-tool > tool_out.txt && cat tool_out.txt"}"#;
    let (outcome, events) = turn(&mut codex, prompt).await;
    assert_eq!(outcome.end, Some(TurnEnd::Idle), "{outcome:?}");
    let calls: Vec<_> = events
        .iter()
        .filter_map(|e| match e {
            BackendEvent::ToolCall { name, input, .. } => Some((name.clone(), input.clone())),
            _ => None,
        })
        .collect();
    assert_eq!(calls.len(), 1, "{events:?}");
    assert_eq!(calls[0].0, "command_execution");
    assert!(
        calls[0].1["command"]
            .as_str()
            .is_some_and(|c| c.contains("echo hi-from-tool")),
        "{calls:?}"
    );
    assert_eq!(outcome.tool_calls, 1);
    assert!(
        outcome.text.starts_with("tool said:") && outcome.text.contains("hi-from-tool"),
        "the model saw the command's output: {}",
        outcome.text
    );
    let written = std::fs::read_to_string(fx.work("tool").join("tool_out.txt"))
        .expect("the command ran in the workspace");
    assert_eq!(written.trim(), "hi-from-tool");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killing_the_process_mid_turn_ends_the_turn_crashed_at_once_and_the_next_turn_resumes() {
    let fx = Fixture::new().await;
    let mut codex = fx.oneshot("crash").await;
    let (first, _) = turn(&mut codex, "REPLY=remember the first answer").await;
    assert_eq!(first.end, Some(TurnEnd::Idle), "{first:?}");
    let thread = first.session_id.clone().expect("a thread id");

    let slow = codex
        .start_turn("SCENARIO:slow SLOW=60x250")
        .await
        .expect("started");
    let pid = slow.pid().expect("running");
    // Mid-turn: the model is streaming the slow answer.
    tokio::time::timeout(
        TURN_LIMIT,
        fx.model.wait_until(|requests| {
            requests
                .iter()
                .any(|r| matches!(r.decision(), Some(Decision::Slow { .. })))
        }),
    )
    .await
    .expect("the slow call reached the model");
    nix::sys::signal::killpg(
        nix::unistd::Pid::from_raw(i32::try_from(pid).expect("pid")),
        nix::sys::signal::Signal::SIGKILL,
    )
    .expect("kill the group");
    let killed = Instant::now();
    let crashed = tokio::time::timeout(TURN_LIMIT, slow.finish())
        .await
        .expect("ended");
    let took = killed.elapsed();
    eprintln!("measured: kill -9 to turn.end {took:?}");
    assert_eq!(crashed.end, Some(TurnEnd::Crashed), "{crashed:?}");
    assert!(
        matches!(&crashed.failure, Some(TurnFailure::Crashed { exit, .. }) if exit.contains("SIGKILL")),
        "{crashed:?}"
    );
    assert!(
        took < Duration::from_secs(1),
        "a crash ends the turn at once, took {took:?}"
    );
    assert!(
        wait_group_gone(pid, Duration::from_secs(10))
            .await
            .is_empty()
    );

    let (after, _) = turn(&mut codex, "REPLY=after the crash").await;
    assert_eq!(after.end, Some(TurnEnd::Idle), "{after:?}");
    assert_eq!(after.text, "after the crash");
    assert!(after.resumed, "the next process resumed the stored thread");
    assert_eq!(after.session_id.as_deref(), Some(thread.as_str()));
    let history = fx.call_answered("after the crash").body["input"].to_string();
    assert!(
        history.contains("REPLY=remember the first answer"),
        "the resumed run sent the earlier turn: {history}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_endpoint_fails_the_turn_fast_with_codexs_error() {
    let fx = Fixture::new().await;
    // Nothing listens there, and no other test can take the port meanwhile.
    let dead = support::refusing_port::RefusingPort::new();
    let mut config = fx.config("dead").await;
    config.base_url = Some(format!("http://127.0.0.1:{}/v1", dead.port()));
    let mut codex = Oneshot::new(config).expect("valid");
    let started = Instant::now();
    let (outcome, _) = turn(&mut codex, "REPLY=never answered").await;
    let took = started.elapsed();
    eprintln!(
        "measured: dead endpoint turn {took:?}: {:?}",
        outcome.failure
    );
    assert_eq!(outcome.end, Some(TurnEnd::Error), "{outcome:?}");
    assert!(
        matches!(&outcome.failure, Some(TurnFailure::Cli { .. })),
        "{outcome:?}"
    );
    assert!(
        took < Duration::from_secs(10),
        "retries are bounded (no unbounded reconnects, one retry): took {took:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn envelopes_do_not_count_and_output_past_the_turn_limit_ends_the_turn_with_a_typed_error() {
    let fx = Fixture::new().await;
    let mut config = fx.config("limit").await;
    // Retained output only: thread.started, turn.started and turn.completed are envelopes
    // (the keeping of a final message received before a breach is tested in `oneshot`'s
    // unit tests: Codex prints nothing retained after it).
    config.backend.output_limits.max_turn_lines = 1;
    let mut codex = Oneshot::new(config).expect("valid");
    let fits = tokio::time::timeout(
        TURN_LIMIT,
        codex
            .start_turn("REPLY=fits")
            .await
            .expect("started")
            .finish(),
    )
    .await
    .expect("ended");
    assert_eq!(fits.end, Some(TurnEnd::Idle), "{fits:?}");
    assert_eq!(fits.text, "fits");
    assert_eq!(fits.retained_lines, 1, "only the agent message: {fits:?}");

    // A command retains its item.started and item.completed: the second passes the limit.
    let prompt = r#"SCENARIO:tool NAME=exec_command ARGS={"cmd":"echo hi"}"#;
    let started = codex.start_turn(prompt).await.expect("started");
    let pid = started.pid().expect("running");
    let outcome = tokio::time::timeout(TURN_LIMIT, started.finish())
        .await
        .expect("ended");
    support::output_limit::assert_past_line_limit(&outcome, 1, 2, pid).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gateway_tool_is_called_through_the_mcp_bridge_and_its_result_reaches_the_model() {
    use copilot_pool::backend::mcp_bridge::McpGatewayTools;
    use copilot_pool::turn::{GatewayTool, ToolCall};
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};

    let fx = Fixture::new().await;
    let calls = Arc::new(AtomicUsize::new(0));
    let seen = calls.clone();
    let tool = GatewayTool::new(
        "lookup",
        "Looks a key up in the gateway's table.",
        serde_json::json!({"type": "object", "properties": {"key": {"type": "string"}}, "required": ["key"]}),
        move |call: ToolCall| {
            let seen = seen.clone();
            async move {
                seen.fetch_add(1, Ordering::SeqCst);
                Ok(format!("value of {}", call.arguments["key"]))
            }
        },
    );
    let mut config = fx.config("gateway").await;
    // A model Codex has no metadata for: for a known one it defers MCP tools behind its
    // client-side `tool_search` instead of offering them.
    config.model = Some("fake-model".to_owned());
    config.gateway_tools = Some(McpGatewayTools::new(vec![tool]));
    let mut codex = Oneshot::new(config).expect("valid config");
    let prompt = r#"SCENARIO:tool NAME=mcp__gateway__lookup ARGS={"key":"alpha"}"#;
    let (outcome, events) = turn(&mut codex, prompt).await;
    assert_eq!(outcome.end, Some(TurnEnd::Idle), "{outcome:?}");
    assert_eq!(
        calls.load(Ordering::SeqCst),
        1,
        "the gateway's handler ran once"
    );
    assert!(
        events
            .iter()
            .any(|e| matches!(e, BackendEvent::ToolCall { name, .. } if name == "gateway/lookup")),
        "{events:?}"
    );
    let output = fx
        .model
        .requests()
        .iter()
        .flat_map(|r| r.body["input"].as_array().cloned().unwrap_or_default())
        .find(|item| item["type"] == "function_call_output")
        .expect("the call's output reached the model");
    assert!(
        output.to_string().contains("value of \\\"alpha\\\""),
        "{output}"
    );
    // The bridge's token reached Codex through its environment, never its argv.
    for request in fx.model.requests() {
        assert!(
            !request.body.to_string().contains("COPILOT_POOL_MCP_TOKEN="),
            "no token in the model's requests"
        );
    }
}
