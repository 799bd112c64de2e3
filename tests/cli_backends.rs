//! CLI backends over the daemon (issue 17, items 1, 4 and 8): a real `copilot-pool serve`
//! configured with `[backends.claude-cli]`, the real Claude Code CLI (installed by the
//! library's installer) and the scripted model speaking Anthropic messages on loopback.
//! Turns over HTTP with `backend: "claude-cli"` stream the pool's SSE vocabulary, carry
//! their history, show the `backend` label on `/metrics`, resume across a daemon restart,
//! fail `transcript_missing` when Claude's transcript is gone, start fresh on another auth
//! identity and resume on a key refresh; the daemon's shutdown leaves no Claude process.
//! A turn's gateway `tools` reach Claude through the MCP bridge: each call is a `tool.call`
//! answered on `/v1/requests/{id}`, and the answer reaches the model's next request. An
//! abort over HTTP ends a running Claude turn `aborted`.
//!
//! The tests take one lock, so at most one conversation's Claude processes run at a time
//! (at most two processes: one closing while its successor starts).

mod support;

use std::time::Duration;

use copilot_pool::scripted_model::RecordedRequest;
use serde_json::{Value, json};
use tokio::sync::Mutex;

use support::cli_daemon::{
    CliFixture as Fixture, event_names, streamed_tool_turn, streamed_turn, tool_calls, user_text,
};
use support::http::{Daemon, SseStream, call};
use support::procs::{wait_none, with_env_prefix};

/// One test at a time (each runs its own Claude processes).
static SERIAL: Mutex<()> = Mutex::const_new(());

/// A failure guard for one whole turn, not a wait.
const TURN_LIMIT: Duration = Duration::from_secs(120);

impl Fixture {
    /// The daemon's TOML: the bundled `claude-cli` with the installed executable.
    async fn config(&self) -> String {
        support::agent_cli::claude_daemon_config("", "").await
    }

    async fn daemon(&self) -> Daemon {
        Daemon::start(self.scratch.path(), &self.config().await, &[]).await
    }

    /// A turn body on the `claude-cli` backend with `key` under auth profile `profile`.
    fn body(&self, session_key: &str, prompt: &str, key: &str, profile: Option<&str>) -> Value {
        let mut body = json!({
            "agent_id": "agent-c",
            "session_key": session_key,
            "prompt": prompt,
            "backend": "claude-cli",
            "provider": {
                "type": "anthropic",
                "base_url": format!("http://{}", self.endpoint.addr()),
                "api_key": key,
            },
        });
        if let Some(profile) = profile {
            body["auth"] = json!({ "auth_profile_id": profile });
        }
        body
    }

    /// The model call whose last user message is `prompt`.
    fn call_for(&self, prompt: &str) -> RecordedRequest {
        self.model
            .requests()
            .into_iter()
            .filter(|r| r.path.ends_with("/messages"))
            .rfind(|r| user_text(r).ends_with(prompt))
            .unwrap_or_else(|| panic!("no model call for {prompt:?}"))
    }

    /// Claude processes of this fixture (found by their `CLAUDE_CONFIG_DIR`).
    fn claude_processes(&self) -> Vec<u32> {
        with_env_prefix(
            "CLAUDE_CONFIG_DIR",
            &self.scratch.path().display().to_string(),
        )
    }
}

/// Runs a streamed turn; its event names and its `turn.end`.
async fn turn(daemon: &Daemon, body: &Value) -> (Vec<String>, Value) {
    let (events, end) = streamed_turn(daemon, body, TURN_LIMIT).await;
    (event_names(&events), end)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claude_turns_over_http_stream_the_pools_events_carry_history_count_spawns_and_crashes_by_backend_and_leave_no_process()
 {
    let _serial = SERIAL.lock().await;
    let fx = Fixture::new().await;
    let daemon = fx.daemon().await;

    let started = std::time::Instant::now();
    let (events, first) = turn(
        &daemon,
        &fx.body("c1", "REPLY=pong one", "sk-ant-FAKE-1", None),
    )
    .await;
    eprintln!(
        "measured: first claude-cli turn over HTTP (spawn included) {:?}",
        started.elapsed()
    );
    assert_eq!(first["status"], "idle", "{first}");
    assert_eq!(first["backend"], "claude-cli");
    assert_eq!(first["final_text"], "pong one");
    assert_eq!(first["open_reason"], "new");
    assert!(
        first["usage"]["output_tokens"].as_u64().unwrap_or(0) > 0,
        "usage: {first}"
    );
    assert!(
        events.iter().any(|e| e == "assistant.message_delta"),
        "deltas stream under the pool's name: {events:?}"
    );
    assert_eq!(events.last().map(String::as_str), Some("turn.end"));
    let session = first["session_id"]
        .as_str()
        .expect("a session id")
        .to_owned();
    assert_eq!(
        fx.claude_processes().len(),
        1,
        "one live process per conversation"
    );

    let started = std::time::Instant::now();
    let (_, second) = turn(
        &daemon,
        &fx.body("c1", "REPLY=pong two", "sk-ant-FAKE-1", None),
    )
    .await;
    eprintln!(
        "measured: second claude-cli turn over HTTP (live process) {:?}",
        started.elapsed()
    );
    assert_eq!(second["status"], "idle", "{second}");
    assert_eq!(second["final_text"], "pong two");
    assert_eq!(
        second["open_reason"], "attached",
        "the live process was kept"
    );
    assert_eq!(second["session_id"], session.as_str());
    let model_call = fx.call_for("REPLY=pong two");
    assert!(
        user_text(&model_call).contains("REPLY=pong one"),
        "the second turn carries the first: {}",
        user_text(&model_call)
    );

    // An unknown backend is a 400 that lists the configured ones.
    let mut unknown = fx.body("c2", "hi", "k", None);
    unknown["backend"] = json!("nope-cli");
    let refused = call(daemon.addr, "POST", "/v1/turns", None, Some(&unknown)).await;
    assert_eq!(refused.status, 400, "{}", refused.body);
    assert!(
        refused.body.contains("`copilot`") && refused.body.contains("`claude-cli`"),
        "{}",
        refused.body
    );
    assert!(
        refused.body.contains("[backends.nope-cli]"),
        "{}",
        refused.body
    );

    let metrics = call(daemon.addr, "GET", "/metrics", None, None).await;
    for series in [
        "copilot_pool_turns_total{outcome=\"idle\",backend=\"claude-cli\"} 2",
        "copilot_pool_processes{state=\"live\",backend=\"claude-cli\"} 1",
        "copilot_pool_turns_total{outcome=\"idle\",backend=\"copilot\"} 0",
        "copilot_pool_tokens_total{kind=\"output\",backend=\"copilot\"} 0",
        // The pool's process, lease and session series cover the CLI backend too.
        "copilot_pool_process_spawns_total{result=\"ok\",backend=\"claude-cli\"} 1",
        "copilot_pool_process_start_seconds_count{backend=\"claude-cli\"} 1",
        "copilot_pool_process_exits_total{reason=\"crash\",backend=\"claude-cli\"} 0",
        "copilot_pool_session_resumes_total{result=\"new\",backend=\"claude-cli\"} 1",
        "copilot_pool_lease_wait_seconds_count{backend=\"claude-cli\"} 2",
        "copilot_pool_leases_active{backend=\"claude-cli\"} 0",
        "copilot_pool_lease_waiters{backend=\"claude-cli\"} 0",
        "copilot_pool_leases_active{backend=\"copilot\"} 0",
        "copilot_pool_process_spawns_total{result=\"ok\",backend=\"copilot\"} 0",
    ] {
        support::http::assert_has_series(&metrics.body, series);
    }
    // Claude's usage is counted under its own backend label.
    let claude_output = metrics
        .body
        .lines()
        .find_map(|l| {
            l.strip_prefix("copilot_pool_tokens_total{kind=\"output\",backend=\"claude-cli\"} ")
        })
        .and_then(|v| v.parse::<f64>().ok());
    assert!(
        claude_output.is_some_and(|n| n > 0.0),
        "no output tokens counted for claude-cli in:\n{}",
        metrics.body
    );

    // A crash of the parked process (SIGKILL of its group) is counted when the next turn
    // finds it dead, under the backend's label, and the next turn starts a new process.
    let pids = fx.claude_processes();
    assert_eq!(pids.len(), 1, "{pids:?}");
    nix::sys::signal::killpg(
        nix::unistd::Pid::from_raw(i32::try_from(pids[0]).expect("pid")),
        nix::sys::signal::Signal::SIGKILL,
    )
    .expect("kill the group");
    let gone = wait_none(|| fx.claude_processes(), Duration::from_secs(10)).await;
    assert!(gone.is_empty(), "{gone:?}");
    // The next turn finds the process dead and starts one; should the runner not have seen
    // the exit yet, the prompt's write fails and that turn ends `crashed` instead (the crash
    // counted once either way), and the turn after it starts the new process.
    let (_, mut third) = turn(
        &daemon,
        &fx.body("c1", "REPLY=pong three", "sk-ant-FAKE-1", None),
    )
    .await;
    if third["status"] == "crashed" {
        (_, third) = turn(
            &daemon,
            &fx.body("c1", "REPLY=pong three", "sk-ant-FAKE-1", None),
        )
        .await;
    }
    assert_eq!(third["status"], "idle", "{third}");
    assert_eq!(third["final_text"], "pong three");
    let metrics = call(daemon.addr, "GET", "/metrics", None, None).await;
    for series in [
        "copilot_pool_process_exits_total{reason=\"crash\",backend=\"claude-cli\"} 1",
        "copilot_pool_process_spawns_total{result=\"ok\",backend=\"claude-cli\"} 2",
        "copilot_pool_turns_total{outcome=\"idle\",backend=\"claude-cli\"} 3",
        "copilot_pool_process_exits_total{reason=\"crash\",backend=\"copilot\"} 0",
    ] {
        support::http::assert_has_series(&metrics.body, series);
    }

    let started = std::time::Instant::now();
    let status = daemon.terminate().await;
    assert!(status.success(), "{status:?}");
    eprintln!(
        "measured: serve's SIGTERM to exit with a parked Claude process {:?}",
        started.elapsed()
    );
    let left = wait_none(|| fx.claude_processes(), Duration::from_secs(5)).await;
    assert!(
        left.is_empty(),
        "Claude processes left after shutdown: {left:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_daemon_resumes_the_stored_session_even_from_where_earlier_versions_kept_it_and_refuses_one_whose_transcript_is_gone()
 {
    let _serial = SERIAL.lock().await;
    let fx = Fixture::new().await;

    let daemon = fx.daemon().await;
    let (_, first) = turn(
        &daemon,
        &fx.body("r1", "REPLY=before restart", "sk-ant-FAKE-r", None),
    )
    .await;
    assert_eq!(first["status"], "idle", "{first}");
    let session = first["session_id"]
        .as_str()
        .expect("a session id")
        .to_owned();
    assert!(daemon.terminate().await.success());
    // Versions before the CLI backends' store of their own kept its bindings among the
    // Copilot runtime's: put this one back there, as such a version left it.
    let state = fx.scratch.path().join("pool-home/state");
    let cli_bindings = state.join("cli-bindings");
    for entry in std::fs::read_dir(&cli_bindings).expect("the CLI backends' bindings") {
        let path = entry.expect("entry").path();
        if path.extension().is_some_and(|e| e == "json") {
            let name = path.file_name().expect("a name");
            std::fs::rename(&path, state.join("bindings").join(name)).expect("moved back");
        }
    }
    std::fs::remove_dir_all(&cli_bindings).expect("no CLI store yet");

    let daemon = fx.daemon().await;
    let (_, second) = turn(
        &daemon,
        &fx.body("r1", "REPLY=after restart", "sk-ant-FAKE-r", None),
    )
    .await;
    assert_eq!(second["status"], "idle", "{second}");
    assert_eq!(second["open_reason"], "resumed", "{second}");
    assert_eq!(second["session_id"], session.as_str());
    assert!(user_text(&fx.call_for("REPLY=after restart")).contains("REPLY=before restart"));
    assert!(daemon.terminate().await.success());

    let files = support::cli_daemon::files_named(fx.scratch.path(), &format!("{session}.jsonl"));
    assert_eq!(
        files.len(),
        1,
        "Claude's transcript of the session: {files:?}"
    );
    std::fs::remove_file(&files[0]).expect("delete the transcript");

    let daemon = fx.daemon().await;
    let body = fx.body("r1", "REPLY=must not run", "sk-ant-FAKE-r", None);
    fx.assert_transcript_missing(&daemon, &body, &session).await;
    assert!(fx.claude_processes().is_empty(), "nothing was started");

    // Deleted over HTTP, the conversation starts over. Deleting it again ends its kept
    // Claude process and removes the new session's transcript; then nothing is left.
    let delete = |status: u16| async move {
        let path = "/v1/sessions/agent-c/r1?backend=claude-cli";
        let answer = call(daemon.addr, "DELETE", path, None, None).await;
        assert_eq!(answer.status, status, "DELETE {path}: {}", answer.body);
    };
    delete(204).await;
    let (_, fresh) = turn(
        &daemon,
        &fx.body("r1", "REPLY=started over", "sk-ant-FAKE-r", None),
    )
    .await;
    assert_eq!(fresh["status"], "idle", "{fresh}");
    assert_eq!(fresh["open_reason"], "new", "{fresh}");
    let fresh_id = fresh["session_id"]
        .as_str()
        .expect("a session id")
        .to_owned();
    let transcript = format!("{fresh_id}.jsonl");
    assert_eq!(
        support::cli_daemon::files_named(fx.scratch.path(), &transcript).len(),
        1
    );
    assert!(!fx.claude_processes().is_empty(), "its process is kept");
    delete(204).await;
    assert!(fx.claude_processes().is_empty(), "ended before the answer");
    let left = support::cli_daemon::files_named(fx.scratch.path(), &transcript);
    assert!(left.is_empty(), "{left:?}");
    delete(404).await;
    assert!(daemon.terminate().await.success());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_refresh_under_the_same_profile_resumes_and_another_profile_starts_fresh() {
    let _serial = SERIAL.lock().await;
    let fx = Fixture::new().await;
    let daemon = fx.daemon().await;

    let (_, first) = turn(
        &daemon,
        &fx.body("a1", "REPLY=first", "sk-ant-FAKE-k1", Some("team-a")),
    )
    .await;
    assert_eq!(first["status"], "idle", "{first}");
    let session = first["session_id"]
        .as_str()
        .expect("a session id")
        .to_owned();

    // A refreshed key of the same profile: a new process (it holds the key), same session.
    let (_, refreshed) = turn(
        &daemon,
        &fx.body("a1", "REPLY=refreshed", "sk-ant-FAKE-k2", Some("team-a")),
    )
    .await;
    assert_eq!(refreshed["status"], "idle", "{refreshed}");
    assert_eq!(refreshed["open_reason"], "resumed", "{refreshed}");
    assert_eq!(refreshed["session_id"], session.as_str());
    let model_call = fx.call_for("REPLY=refreshed");
    assert!(
        user_text(&model_call).contains("REPLY=first"),
        "{}",
        user_text(&model_call)
    );
    assert_eq!(
        model_call.header("x-api-key"),
        ["sk-ant-FAKE-k2"],
        "the new key is used"
    );

    // Another identity: the stored session is dropped.
    let (_, other) = turn(
        &daemon,
        &fx.body("a1", "REPLY=other", "sk-ant-FAKE-k2", Some("team-b")),
    )
    .await;
    assert_eq!(other["status"], "idle", "{other}");
    assert_eq!(other["open_reason"], "compat-changed", "{other}");
    assert_ne!(other["session_id"], session.as_str());
    let model_call = fx.call_for("REPLY=other");
    assert!(
        !user_text(&model_call).contains("REPLY=first"),
        "a fresh session: {}",
        user_text(&model_call)
    );
    assert!(daemon.terminate().await.success());
    let left = wait_none(|| fx.claude_processes(), Duration::from_secs(5)).await;
    assert!(left.is_empty(), "{left:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claude_turn_past_its_timeout_ms_ends_timeout_and_the_next_turn_is_served() {
    let _serial = SERIAL.lock().await;
    let fx = Fixture::new().await;
    let daemon = fx.daemon().await;

    // 60 chunks 250 ms apart: 15 s of answer against a 2 s limit.
    let mut body = fx.body("t1", "SCENARIO:slow SLOW=60x250", "sk-ant-FAKE-k1", None);
    body["timeout_ms"] = json!(2000);
    let (events, slow) = turn(&daemon, &body).await;
    assert_eq!(slow["status"], "timeout", "{slow}");
    assert!(
        slow["error"]
            .as_str()
            .is_some_and(|e| e.contains("ran past its limit of 2 s")),
        "{slow}"
    );
    assert!(
        events.iter().any(|e| e == "assistant.message_delta"),
        "the answer had started streaming: {events:?}"
    );

    let (_, next) = turn(
        &daemon,
        &fx.body("t1", "REPLY=after the timeout", "sk-ant-FAKE-k1", None),
    )
    .await;
    assert_eq!(next["status"], "idle", "{next}");
    assert_eq!(next["final_text"], "after the timeout", "{next}");
    assert!(daemon.terminate().await.success());
    let left = wait_none(|| fx.claude_processes(), Duration::from_secs(5)).await;
    assert!(left.is_empty(), "{left:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_abort_over_http_ends_a_running_claude_turn_aborted_and_the_next_turn_is_served() {
    let _serial = SERIAL.lock().await;
    let fx = Fixture::new().await;
    let daemon = fx.daemon().await;
    let abort = "/v1/sessions/agent-c/a1/abort";

    // 60 chunks 250 ms apart: 15 s of answer, aborted once it streams.
    let body = fx.body("a1", "SCENARIO:slow SLOW=60x250", "sk-ant-FAKE-k1", None);
    let run = async {
        let mut stream = SseStream::open(daemon.addr, "/v1/turns", None, &body).await;
        assert_eq!(stream.status, 200, "the turn was accepted");
        let mut aborted = false;
        while let Some(event) = stream.next().await {
            if event.event == "turn.end" {
                return (aborted, event.data);
            }
            if event.event == "assistant.message_delta" && !aborted {
                let answered = call(daemon.addr, "POST", abort, None, None).await;
                assert_eq!(answered.status, 204, "{}", answered.body);
                aborted = true;
            }
        }
        panic!("the stream ended without turn.end");
    };
    let started = std::time::Instant::now();
    let (aborted, end) = tokio::time::timeout(TURN_LIMIT, run)
        .await
        .expect("the turn ended in time");
    assert!(aborted, "the answer streamed before its end: {end}");
    assert_eq!(end["status"], "aborted", "{end}");
    assert_eq!(end["backend"], "claude-cli", "{end}");
    assert!(
        started.elapsed() < Duration::from_secs(14),
        "ended by the abort, not by the answer's end: {:?}",
        started.elapsed()
    );
    // Nothing runs now: nothing to abort.
    let again = call(daemon.addr, "POST", abort, None, None).await;
    assert_eq!(again.status, 404, "{}", again.body);

    let (_, next) = turn(
        &daemon,
        &fx.body("a1", "REPLY=after the abort", "sk-ant-FAKE-k1", None),
    )
    .await;
    assert_eq!(next["status"], "idle", "{next}");
    assert_eq!(next["final_text"], "after the abort", "{next}");
    assert!(daemon.terminate().await.success());
    let left = wait_none(|| fx.claude_processes(), Duration::from_secs(5)).await;
    assert!(left.is_empty(), "{left:?}");
}

/// The `lookup` gateway tool of a turn body.
fn lookup_tools() -> Value {
    json!([{
        "name": "lookup",
        "description": "Looks a key up in the gateway's table.",
        "parameters": {"type": "object", "properties": {"key": {"type": "string"}},
                       "required": ["key"]},
    }])
}

/// The text of the `tool_result` blocks in the model's requests.
fn tool_results(fx: &Fixture) -> Vec<String> {
    fx.model
        .requests()
        .iter()
        .filter(|r| r.path.ends_with("/messages"))
        .flat_map(|r| r.messages().to_vec())
        .flat_map(|m| m["content"].as_array().cloned().unwrap_or_default())
        .filter(|b| b["type"] == "tool_result")
        .map(|b| match &b["content"] {
            Value::String(text) => text.clone(),
            Value::Array(parts) => parts
                .iter()
                .filter_map(|p| p["text"].as_str())
                .collect::<Vec<_>>()
                .join("\n"),
            _ => String::new(),
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claude_turns_gateway_tool_call_is_answered_over_http_and_the_answer_reaches_the_model() {
    let _serial = SERIAL.lock().await;
    let fx = Fixture::new().await;
    let daemon = fx.daemon().await;
    let answer = |call: &Value| json!({"result": format!("answered {}", call["arguments"]["key"].as_str().unwrap_or("?"))});

    let mut body = fx.body(
        "g1",
        r#"SCENARIO:tool NAME=mcp__gateway__lookup ARGS={"key":"alpha"}"#,
        "sk-ant-FAKE-g",
        None,
    );
    body["tools"] = lookup_tools();
    let started = std::time::Instant::now();
    let (events, end) = streamed_tool_turn(&daemon, &body, answer, TURN_LIMIT).await;
    eprintln!(
        "measured: claude-cli turn with one gateway tool call over HTTP (spawn included) {:?}",
        started.elapsed()
    );
    assert_eq!(end["status"], "idle", "{end}");
    assert_eq!(end["final_text"], "tool said: answered alpha", "{end}");
    // One `tool.call` per call, the one to answer (the CLI's own report of it is not
    // streamed as a second one).
    let calls = tool_calls(&events);
    assert_eq!(calls.len(), 1, "{calls:?}");
    assert_eq!(calls[0]["tool_name"], "lookup", "{calls:?}");
    assert_eq!(calls[0]["arguments"], json!({"key": "alpha"}));
    assert!(
        calls[0]["tool_call_id"]
            .as_str()
            .is_some_and(|id| !id.is_empty() && !id.starts_with("mcp-")),
        "the model's own id of the call, not one the bridge made up: {calls:?}"
    );
    let results = tool_results(&fx);
    assert!(
        results.iter().any(|r| r == "answered alpha"),
        "the answer reached the model: {results:?}"
    );

    // The next turn is another lease on the same process: its own stream answers.
    let mut body = fx.body(
        "g1",
        r#"SCENARIO:tool NAME=mcp__gateway__lookup ARGS={"key":"beta"}"#,
        "sk-ant-FAKE-g",
        None,
    );
    body["tools"] = lookup_tools();
    let (events, second) = streamed_tool_turn(&daemon, &body, answer, TURN_LIMIT).await;
    assert_eq!(second["status"], "idle", "{second}");
    assert_eq!(second["open_reason"], "attached", "{second}");
    assert_eq!(second["final_text"], "tool said: answered beta", "{second}");
    assert_eq!(tool_calls(&events).len(), 1, "{events:?}");
    let results = tool_results(&fx);
    assert!(
        results.iter().any(|r| r == "answered beta"),
        "the second answer reached the model: {results:?}"
    );

    // `?stream=false` cannot answer tools.
    let refused = call(
        daemon.addr,
        "POST",
        "/v1/turns?stream=false",
        None,
        Some(&body),
    )
    .await;
    assert_eq!(refused.status, 400, "{}", refused.body);
    assert!(refused.body.contains("event stream"), "{}", refused.body);
    assert!(daemon.terminate().await.success());
    let left = wait_none(|| fx.claude_processes(), Duration::from_secs(5)).await;
    assert!(left.is_empty(), "{left:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claude_tools_permission_prompt_streams_as_permission_request_and_the_gateways_answer_decides()
 {
    let _serial = SERIAL.lock().await;
    let fx = Fixture::new().await;
    let daemon = fx.daemon().await;
    let prompt = r#"SCENARIO:tool NAME=Bash ARGS={"command":"echo written > approved-by-gateway.txt","description":"write a file"}"#;
    let run = async {
        let body = fx.body("p1", prompt, "sk-ant-FAKE-k1", None);
        let mut stream = SseStream::open(daemon.addr, "/v1/turns", None, &body).await;
        assert_eq!(stream.status, 200, "the turn was accepted");
        let mut asked = Vec::new();
        while let Some(event) = stream.next().await {
            if event.event == "turn.end" {
                return (asked, event.data);
            }
            if event.event == "permission.request" {
                asked.push(event.data.clone());
                let id = event.data["request_id"].as_str().unwrap_or_default();
                let answered = call(
                    daemon.addr,
                    "POST",
                    &format!("/v1/requests/{id}"),
                    None,
                    Some(&json!({"decision": "approve-once"})),
                )
                .await;
                assert_eq!(answered.status, 204, "{}", answered.body);
            }
        }
        panic!("the stream ended without turn.end");
    };
    let (asked, end) = tokio::time::timeout(TURN_LIMIT, run)
        .await
        .expect("the turn ended in time");
    assert_eq!(end["status"], "idle", "{end}");
    assert_eq!(asked.len(), 1, "one prompt for the Bash call: {asked:?}");
    assert!(
        asked[0].to_string().contains("approved-by-gateway.txt"),
        "the prompt names the command: {}",
        asked[0]
    );
    // The gateway's approval let the tool run in the conversation's working directory.
    let mut found = Vec::new();
    let mut stack = vec![fx.scratch.path().to_path_buf()];
    while let Some(dir) = stack.pop() {
        for entry in std::fs::read_dir(&dir).into_iter().flatten().flatten() {
            let path = entry.path();
            if path.is_dir() {
                stack.push(path);
            } else if path.ends_with("approved-by-gateway.txt") {
                found.push(path);
            }
        }
    }
    assert_eq!(found.len(), 1, "the approved command ran once: {found:?}");
    assert!(daemon.terminate().await.success());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claude_turns_images_inline_or_by_path_reach_the_model_as_image_blocks_and_other_attachments_get_a_400()
 {
    let _serial = SERIAL.lock().await;
    let fx = Fixture::new().await;
    let daemon = fx.daemon().await;
    let answered = |text: &str| {
        fx.model
            .requests()
            .into_iter()
            .find(|r| {
                matches!(r.decision(), Some(copilot_pool::scripted_model::Decision::Text(t)) if t == text)
            })
            .unwrap_or_else(|| panic!("no model call answered {text:?}"))
    };
    support::cli_daemon::image_turns(
        &fx,
        &daemon,
        "claude-cli",
        |prompt| fx.body("images", prompt, "sk-ant-FAKE-images", None),
        answered,
        TURN_LIMIT,
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claude_that_dies_at_every_start_is_quarantined_within_the_restart_intensity() {
    let _serial = SERIAL.lock().await;
    let fx = Fixture::new().await;
    // The real Claude Code given an option it does not know: it exits at once, every time.
    let config =
        support::agent_cli::claude_daemon_config("", "args = [\"--no-such-option\"]\n").await;
    let daemon = Daemon::start(fx.scratch.path(), &config, &[]).await;
    let body = fx.body("q1", "REPLY=never answered", "sk-ant-FAKE-q", None);
    // The default restart policy: five crashes within 30 s, then the key is quarantined.
    let mut ends = Vec::new();
    let refused = loop {
        let answer = call(
            daemon.addr,
            "POST",
            "/v1/turns?stream=false",
            None,
            Some(&body),
        )
        .await;
        if answer.status == 503 || ends.len() > 10 {
            break answer;
        }
        assert_eq!(answer.status, 200, "{}", answer.body);
        let end: Value = serde_json::from_str(&answer.body).expect("turn.end JSON");
        assert_eq!(end["status"], "crashed", "{end}");
        // No turn got as far as a session: none continued a context.
        assert_eq!(end["open_reason"], "new", "{end}");
        assert_eq!(end["resumed"], false, "{end}");
        ends.push(end);
    };
    assert_eq!(
        refused.status,
        503,
        "after {} crashes: {}",
        ends.len(),
        refused.body
    );
    assert!(
        (1..=6).contains(&ends.len()),
        "quarantined after {} crashed turns",
        ends.len()
    );
    assert!(refused.body.contains("quarantined"), "{}", refused.body);
    let metrics = call(daemon.addr, "GET", "/metrics", None, None).await.body;
    let series = "copilot_pool_quarantines_total{backend=\"claude-cli\"} 1";
    support::http::assert_has_series(&metrics, series);
    assert!(fx.model.requests().is_empty(), "no model call was made");
    assert!(daemon.terminate().await.success());
    assert!(fx.claude_processes().is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backend_whose_command_is_not_installed_fails_its_turn_naming_the_command_and_the_fix() {
    let _serial = SERIAL.lock().await;
    let fx = Fixture::new().await;
    // A bare name found nowhere on the daemon's PATH, for the live runner and the
    // process-per-turn one, inside the daemon's sandbox (on where the kernel has Landlock)
    // and outside it.
    // Unsandboxed, the API needs its token.
    let token = "missing-command-test-token";
    for sandbox in ["auto", "off"] {
        let config = format!(
            "drain_grace_secs = 5\nsandbox = {sandbox:?}\napi_token = {token:?}\n\
             [backends.claude-cli]\ncommand = \"claude-not-installed-here\"\n\
             [backends.codex-cli]\ncommand = \"codex-not-installed-here\"\n"
        );
        let daemon = Daemon::start(fx.scratch.path(), &config, &[]).await;
        for (backend, command) in [
            ("claude-cli", "claude-not-installed-here"),
            ("codex-cli", "codex-not-installed-here"),
        ] {
            let mut body = fx.body(
                &format!("{backend}-{sandbox}"),
                "REPLY=never",
                "sk-FAKE",
                None,
            );
            body["backend"] = json!(backend);
            let answer = call(
                daemon.addr,
                "POST",
                "/v1/turns?stream=false",
                Some(token),
                Some(&body),
            )
            .await;
            let said = answer.body.clone();
            assert!(
                said.contains(command) && said.contains("PATH") && said.contains("command"),
                "{backend}, sandbox {sandbox}: the answer names the command, where it was \
                 looked for and the key that fixes it: {} {said}",
                answer.status
            );
            assert!(
                !said.contains("--rx"),
                "{backend}: the sandbox wrapper's usage: {said}"
            );
            assert!(
                !said.contains("invalid lease request"),
                "{backend}: the backend's to fix, not the request's: {said}"
            );
            assert!(
                !said.contains("resumes the stored session"),
                "{backend}: no session to resume: {said}"
            );
        }
        let metrics = call(daemon.addr, "GET", "/metrics", Some(token), None)
            .await
            .body;
        // Counted as the starts that failed they are (an alert's signal), none as started.
        for backend in ["claude-cli", "codex-cli"] {
            for (result, n) in [("ok", 0), ("error", 1)] {
                support::http::assert_has_series(
                    &metrics,
                    &format!(
                        "copilot_pool_process_spawns_total{{result=\"{result}\",backend=\"{backend}\"}} {n}"
                    ),
                );
            }
        }
        assert!(daemon.terminate().await.success());
    }
    assert!(fx.model.requests().is_empty(), "no model call was made");
}
