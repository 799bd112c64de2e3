//! `cli-oneshot` backends over the daemon (issue 17, items 1, 3, 4 and 8): a real
//! `copilot-pool serve` configured with `[backends.codex-cli]` and
//! `[backends.google-gemini-cli]` (the bundled defaults with the installed executables),
//! the real CLIs and the scripted model on loopback. A turn body naming the backend streams
//! the pool's SSE vocabulary and ends with `turn.end` carrying usage; the second turn
//! carries the first to the model; no CLI process is left once a turn ended (a process per
//! turn). Codex's stored thread is resumed by a restarted daemon, and refused as
//! `transcript_missing` once its rollout file is gone. A Codex turn's gateway `tools` reach
//! Codex through the MCP bridge: each call is a `tool.call` answered on
//! `/v1/requests/{id}`, and the answer reaches the model's next request; Gemini CLI
//! refuses them. A Gemini turn streams its answer as `assistant.message_delta`s and the
//! CLI's own tool calls as `tool.call`s (`--output-format stream-json`).
//!
//! The tests take one lock, so at most one CLI process runs at a time.

mod support;

use std::time::Duration;

use copilot_pool::runtime::AgentCli;
use copilot_pool::scripted_model::{Decision, RecordedRequest, ScriptedModel};
use serde_json::{Value, json};
use tokio::sync::Mutex;

use support::agent_cli::{codex_path, path};
use support::cli_daemon::{
    CliFixture as Fixture, event_names, streamed_tool_turn, streamed_turn, tool_calls,
};
use support::http::{Daemon, call};
use support::procs::{wait_none, with_env_prefix};

/// One test at a time (each runs CLI processes).
static SERIAL: Mutex<()> = Mutex::const_new(());

/// A failure guard for one whole turn, not a wait.
const TURN_LIMIT: Duration = Duration::from_secs(180);

const CODEX: &str = "codex-cli";
const GEMINI: &str = "google-gemini-cli";

impl Fixture {
    /// The daemon's TOML: both bundled one-shot backends with the installed executables
    /// (Gemini CLI's `bundle/gemini.js` runs through its `#!/usr/bin/env node`).
    async fn config(&self) -> String {
        format!(
            "drain_grace_secs = 5\n[backends.{CODEX}]\ncommand = {:?}\n\
             [backends.{GEMINI}]\ncommand = {:?}\n",
            codex_path().await.display().to_string(),
            path(AgentCli::Gemini).await.display().to_string(),
        )
    }

    async fn daemon(&self) -> Daemon {
        Daemon::start(self.scratch.path(), &self.config().await, &[]).await
    }

    /// A turn body on `backend`.
    fn body(&self, backend: &str, session_key: &str, prompt: &str) -> Value {
        let (base_url, key, model) = match backend {
            CODEX => (
                format!("http://{}/v1", self.endpoint.addr()),
                "sk-FAKE-codex-key",
                "gpt-5.5",
            ),
            _ => (
                format!("http://{}", self.endpoint.addr()),
                "AIza-FAKE-gemini-key",
                "gemini-2.5-pro",
            ),
        };
        json!({
            "agent_id": "agent-o",
            "session_key": session_key,
            "prompt": prompt,
            "backend": backend,
            "model": model,
            "provider": { "type": "openai", "base_url": base_url, "api_key": key },
        })
    }

    /// The model call answered with `text`.
    fn call_answered(&self, text: &str) -> RecordedRequest {
        self.model
            .requests()
            .into_iter()
            .find(|r| matches!(r.decision(), Some(Decision::Text(t)) if t == text))
            .unwrap_or_else(|| panic!("no model call answered {text:?}"))
    }

    /// CLI processes of this fixture: Codex's by its `CODEX_HOME`, Gemini CLI's by its
    /// endpoint variable (both only in the children's environments).
    fn cli_processes(&self) -> Vec<u32> {
        let mut found = with_env_prefix("CODEX_HOME", &self.scratch.path().display().to_string());
        found.extend(with_env_prefix(
            "GOOGLE_GEMINI_BASE_URL",
            &format!("http://{}", self.endpoint.addr()),
        ));
        found
    }
}

/// Runs a streamed turn; its event names and its `turn.end`.
async fn turn(daemon: &Daemon, body: &Value) -> (Vec<String>, Value) {
    let (events, end) = streamed_turn(daemon, body, TURN_LIMIT).await;
    (event_names(&events), end)
}

/// Two turns of one conversation on `backend`: both idle with usage, the second carrying
/// the first in `history_of` its model call, and no CLI process after either.
async fn two_turns(
    fx: &Fixture,
    daemon: &Daemon,
    backend: &str,
    history_of: impl Fn(&RecordedRequest) -> String,
) -> String {
    let started = std::time::Instant::now();
    let (events, first) = turn(daemon, &fx.body(backend, "k1", "REPLY=pong one")).await;
    eprintln!(
        "measured: first {backend} turn over HTTP {:?}",
        started.elapsed()
    );
    assert_eq!(first["status"], "idle", "{first}");
    assert_eq!(first["backend"], backend);
    assert_eq!(first["final_text"], "pong one");
    assert_eq!(first["open_reason"], "new");
    assert!(
        first["usage"]["input_tokens"].as_u64().unwrap_or(0) > 0
            && first["usage"]["output_tokens"].as_u64().unwrap_or(0) > 0,
        "usage: {first}"
    );
    assert!(
        events.iter().any(|e| e == "assistant.message"),
        "the answer streams under the pool's name: {events:?}"
    );
    assert_eq!(events.last().map(String::as_str), Some("turn.end"));
    let session = first["session_id"]
        .as_str()
        .filter(|s| !s.is_empty())
        .expect("a session id")
        .to_owned();
    let left = wait_none(|| fx.cli_processes(), Duration::from_secs(5)).await;
    assert!(left.is_empty(), "a process per turn, none after: {left:?}");

    let started = std::time::Instant::now();
    let (_, second) = turn(daemon, &fx.body(backend, "k1", "REPLY=pong two")).await;
    eprintln!(
        "measured: second {backend} turn over HTTP (resumed process) {:?}",
        started.elapsed()
    );
    assert_eq!(second["status"], "idle", "{second}");
    assert_eq!(second["final_text"], "pong two");
    assert_eq!(second["session_id"], session.as_str());
    assert_eq!(
        second["usage"]["input_tokens"], first["usage"]["input_tokens"],
        "usage is the turn's own, not the thread's running total: {second}"
    );
    let history = history_of(&fx.call_answered("pong two"));
    assert!(
        history.contains("REPLY=pong one"),
        "the second turn carries the first: {history}"
    );
    let left = wait_none(|| fx.cli_processes(), Duration::from_secs(5)).await;
    assert!(left.is_empty(), "{left:?}");
    session
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_codex_turns_over_http_carry_history_count_a_process_per_turn_and_a_restarted_daemon_resumes_until_the_rollout_is_gone()
 {
    let _serial = SERIAL.lock().await;
    let fx = Fixture::new().await;
    let daemon = fx.daemon().await;
    let thread = two_turns(&fx, &daemon, CODEX, |r| r.body["input"].to_string()).await;

    let metrics = call(daemon.addr, "GET", "/metrics", None, None).await;
    // Between turns a one-shot conversation runs no process (its slot is still held).
    for series in [
        "copilot_pool_turns_total{outcome=\"idle\",backend=\"codex-cli\"} 2",
        "copilot_pool_processes{state=\"live\",backend=\"codex-cli\"} 0",
        // A process per turn: started, and gone with its turn.
        "copilot_pool_process_spawns_total{result=\"ok\",backend=\"codex-cli\"} 2",
        "copilot_pool_process_exits_total{reason=\"completed\",backend=\"codex-cli\"} 2",
        "copilot_pool_process_exits_total{reason=\"crash\",backend=\"codex-cli\"} 0",
        "copilot_pool_session_resumes_total{result=\"new\",backend=\"codex-cli\"} 1",
        "copilot_pool_leases_active{backend=\"codex-cli\"} 0",
    ] {
        support::http::assert_has_series(&metrics.body, series);
    }
    assert!(daemon.terminate().await.success());
    // Its binding records the directory its turns ran in (a DELETE naming none finds its
    // files there).
    let cli_bindings = fx.scratch.path().join("pool-home/state/cli-bindings");
    let recorded: Vec<Value> = std::fs::read_dir(&cli_bindings)
        .expect("the CLI backends' bindings")
        .filter_map(Result::ok)
        .filter(|e| e.path().extension().is_some_and(|x| x == "json"))
        .map(|e| {
            let text = std::fs::read_to_string(e.path()).expect("a binding");
            serde_json::from_str::<Value>(&text).expect("JSON")["working_directory"].clone()
        })
        .collect();
    assert_eq!(recorded.len(), 1, "{recorded:?}");
    assert!(
        recorded[0]
            .as_str()
            .is_some_and(|dir| dir.ends_with("/agent-o/work")),
        "{recorded:?}"
    );

    // A new daemon resumes the stored thread (its rollout is there).
    let daemon = fx.daemon().await;
    let (_, third) = turn(&daemon, &fx.body(CODEX, "k1", "REPLY=after restart")).await;
    assert_eq!(third["status"], "idle", "{third}");
    assert_eq!(third["open_reason"], "resumed", "{third}");
    assert_eq!(third["session_id"], thread.as_str());
    assert_eq!(
        third["usage"]["input_tokens"],
        ScriptedModel::PROMPT_TOKENS,
        "the new daemon diffs Codex's thread totals against its rollout's last count: {third}"
    );
    let history = fx.call_answered("after restart").body["input"].to_string();
    assert!(history.contains("REPLY=pong one"), "{history}");
    assert!(daemon.terminate().await.success());

    let rollouts = support::cli_daemon::files_named(fx.scratch.path(), &format!("-{thread}.jsonl"));
    assert_eq!(
        rollouts.len(),
        1,
        "Codex's rollout of the thread: {rollouts:?}"
    );
    assert!(
        rollouts[0].to_string_lossy().contains("/.codex/sessions/"),
        "{rollouts:?}"
    );
    std::fs::remove_file(&rollouts[0]).expect("delete the rollout");

    let daemon = fx.daemon().await;
    let body = fx.body(CODEX, "k1", "REPLY=must not run");
    fx.assert_transcript_missing(&daemon, &body, &thread).await;

    // The way out over HTTP: delete the conversation on its backend; the next turn starts a
    // new thread. Deleting that one removes its rollout too; then there is nothing left.
    delete_conversation(&daemon, CODEX, "k1", 204).await;
    let (_, fresh) = turn(&daemon, &fx.body(CODEX, "k1", "REPLY=started over")).await;
    assert_eq!(fresh["status"], "idle", "{fresh}");
    assert_eq!(fresh["open_reason"], "new", "{fresh}");
    let new_thread = fresh["session_id"]
        .as_str()
        .expect("a thread id")
        .to_owned();
    assert_ne!(new_thread, thread);
    let named = format!("-{new_thread}.jsonl");
    assert_eq!(
        support::cli_daemon::files_named(fx.scratch.path(), &named).len(),
        1
    );
    delete_conversation(&daemon, CODEX, "k1", 204).await;
    let left = support::cli_daemon::files_named(fx.scratch.path(), &named);
    assert!(left.is_empty(), "the deleted thread's rollout: {left:?}");
    delete_conversation(&daemon, CODEX, "k1", 404).await;
    // A misspelt query is refused, never taken for the Copilot conversation's reset.
    let misspelt = "/v1/sessions/agent-o/k1?backnd=codex-cli";
    let answer = call(daemon.addr, "DELETE", misspelt, None, None).await;
    assert_eq!(answer.status, 400, "{}", answer.body);
    assert!(answer.body.contains("backnd"), "{}", answer.body);
    assert!(daemon.terminate().await.success());
    assert!(fx.cli_processes().is_empty());
}

/// `DELETE /v1/sessions/agent-o/<session_key>?backend=<backend>`, expecting `status`.
async fn delete_conversation(daemon: &Daemon, backend: &str, session_key: &str, status: u16) {
    let path = format!("/v1/sessions/agent-o/{session_key}?backend={backend}");
    let answer = call(daemon.addr, "DELETE", &path, None, None).await;
    assert_eq!(answer.status, status, "DELETE {path}: {}", answer.body);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gemini_turns_over_http_carry_history_with_usage_stream_deltas_and_tool_calls_and_leave_no_process()
 {
    let _serial = SERIAL.lock().await;
    let fx = Fixture::new().await;
    let daemon = fx.daemon().await;
    let session = two_turns(&fx, &daemon, GEMINI, |r| {
        r.body["contents"]
            .as_array()
            .into_iter()
            .flatten()
            .flat_map(|c| c["parts"].as_array().into_iter().flatten())
            .filter_map(|p| p["text"].as_str())
            .collect::<Vec<_>>()
            .join("\n")
    })
    .await;
    let call = fx.call_answered("pong one");
    assert_eq!(
        call.header("x-goog-api-key"),
        ["AIza-FAKE-gemini-key"],
        "the key reached the model from the child's environment"
    );

    // Gemini CLI runs `--output-format stream-json`: the answer streams as deltas while the
    // process runs, and the CLI's own tool calls as `tool.call`s, as Codex's and Claude's
    // do. (The file is missing: the CLI's `read_file` fails and the model says so.)
    let body = fx.body(
        GEMINI,
        "k2",
        r#"SCENARIO:tool NAME=read_file ARGS={"file_path":"missing-note.txt"}"#,
    );
    let (events, end) = streamed_turn(&daemon, &body, TURN_LIMIT).await;
    let names = event_names(&events);
    assert_eq!(end["status"], "idle", "{end}");
    let call_at = names
        .iter()
        .position(|n| n == "tool.call")
        .unwrap_or_else(|| panic!("the CLI's tool call streams: {names:?}"));
    let calls = tool_calls(&events);
    assert_eq!(calls.len(), 1, "{calls:?}");
    assert_eq!(calls[0]["tool_name"], "read_file", "{calls:?}");
    assert_eq!(calls[0]["arguments"]["file_path"], "missing-note.txt");
    let delta_at: Vec<usize> = names
        .iter()
        .enumerate()
        .filter(|(_, n)| *n == "assistant.message_delta")
        .map(|(at, _)| at)
        .collect();
    assert!(
        delta_at.len() > 1 && delta_at[0] > call_at,
        "the answer streams in pieces after the call: {names:?}"
    );
    let streamed: String = delta_at
        .iter()
        .filter_map(|&at| events[at].data["data"]["deltaContent"].as_str())
        .collect();
    assert_eq!(Some(streamed.as_str()), end["final_text"].as_str(), "{end}");
    assert!(streamed.starts_with("tool said:"), "{streamed}");
    assert_eq!(names.last().map(String::as_str), Some("turn.end"));
    assert!(
        end["usage"]["input_tokens"].as_u64().unwrap_or(0) > 0
            && end["usage"]["output_tokens"].as_u64().unwrap_or(0) > 0,
        "usage: {end}"
    );
    assert!(daemon.terminate().await.success());
    assert!(fx.cli_processes().is_empty());

    // Gemini CLI's chat file of the first conversation gone: a new daemon refuses to resume
    // it (`transcript_missing`), never a silent fresh start.
    let short = session.get(..8).unwrap_or(&session);
    let chats = support::cli_daemon::files_named(fx.scratch.path(), &format!("-{short}.jsonl"));
    assert!(
        !chats.is_empty()
            && chats
                .iter()
                .all(|c| c.to_string_lossy().contains("/chats/")),
        "Gemini CLI's chat file of {session}: {chats:?}"
    );
    for chat in &chats {
        std::fs::remove_file(chat).expect("delete the chat file");
    }
    let daemon = fx.daemon().await;
    let body = fx.body(GEMINI, "k1", "REPLY=must not run");
    fx.assert_transcript_missing(&daemon, &body, &session).await;
    // Deleted over HTTP, the conversation starts over; deleting k2 removes its chat file.
    delete_conversation(&daemon, GEMINI, "k1", 204).await;
    let (_, fresh) = turn(&daemon, &fx.body(GEMINI, "k1", "REPLY=started over")).await;
    assert_eq!(fresh["status"], "idle", "{fresh}");
    assert_eq!(fresh["open_reason"], "new", "{fresh}");
    let chats_of = |session: &str| {
        let short = session.get(..8).unwrap_or(session).to_owned();
        support::cli_daemon::files_named(fx.scratch.path(), &format!("-{short}.jsonl"))
    };
    let k2 = end["session_id"]
        .as_str()
        .expect("k2's session id")
        .to_owned();
    assert!(!chats_of(&k2).is_empty());
    delete_conversation(&daemon, GEMINI, "k2", 204).await;
    assert!(chats_of(&k2).is_empty(), "{:?}", chats_of(&k2));
    assert!(daemon.terminate().await.success());
    assert!(fx.cli_processes().is_empty());
}

/// The `function_call_output` items the model received.
fn call_outputs(fx: &Fixture) -> Vec<String> {
    fx.model
        .requests()
        .iter()
        .flat_map(|r| r.body["input"].as_array().cloned().unwrap_or_default())
        .filter(|item| item["type"] == "function_call_output")
        .map(|item| item["output"].to_string())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_codex_turns_gateway_tool_call_is_answered_over_http_and_gemini_refuses_tools() {
    let _serial = SERIAL.lock().await;
    let fx = Fixture::new().await;
    let daemon = fx.daemon().await;
    let tools = json!([{
        "name": "lookup",
        "description": "Looks a key up in the gateway's table.",
        "parameters": {"type": "object", "properties": {"key": {"type": "string"}},
                       "required": ["key"]},
    }]);
    let answer = |call: &Value| json!({"result": format!("answered {}", call["arguments"]["key"].as_str().unwrap_or("?"))});
    let body = |key: &str| {
        let mut body = fx.body(
            CODEX,
            "g1",
            &format!(r#"SCENARIO:tool NAME=mcp__gateway__lookup ARGS={{"key":"{key}"}}"#),
        );
        // A model Codex has no metadata for: it offers MCP tools directly (for a known
        // one it defers them behind its `tool_search`).
        body["model"] = json!("fake-model");
        body["tools"] = tools.clone();
        body
    };

    let started = std::time::Instant::now();
    let (events, end) = streamed_tool_turn(&daemon, &body("alpha"), answer, TURN_LIMIT).await;
    eprintln!(
        "measured: codex-cli turn with one gateway tool call over HTTP {:?}",
        started.elapsed()
    );
    assert_eq!(end["status"], "idle", "{end}");
    let calls = tool_calls(&events);
    assert_eq!(
        calls.len(),
        1,
        "one tool.call, the one to answer: {calls:?}"
    );
    assert_eq!(calls[0]["tool_name"], "lookup", "{calls:?}");
    assert_eq!(calls[0]["arguments"], json!({"key": "alpha"}));
    assert!(
        calls[0]["request_id"]
            .as_str()
            .is_some_and(|id| !id.is_empty()),
        "{calls:?}"
    );
    let outputs = call_outputs(&fx);
    assert!(
        outputs.iter().any(|o| o.contains("answered alpha")),
        "the answer reached the model: {outputs:?}"
    );
    assert!(
        end["final_text"]
            .as_str()
            .is_some_and(|t| t.contains("answered alpha")),
        "{end}"
    );

    // The next turn (a new lease, a new Codex process, the bridge kept): its own stream
    // answers.
    let (events, second) = streamed_tool_turn(&daemon, &body("beta"), answer, TURN_LIMIT).await;
    assert_eq!(second["status"], "idle", "{second}");
    assert_eq!(second["open_reason"], "attached", "{second}");
    assert_eq!(tool_calls(&events).len(), 1, "{events:?}");
    let outputs = call_outputs(&fx);
    assert!(
        outputs.iter().any(|o| o.contains("answered beta")),
        "the second answer reached the model: {outputs:?}"
    );
    assert!(
        wait_none(|| fx.cli_processes(), Duration::from_secs(5))
            .await
            .is_empty(),
        "no process after the turns"
    );

    // Gemini CLI gets no bridge: its turn refuses tools, naming those that take them.
    let mut gemini = fx.body(GEMINI, "g2", "REPLY=never");
    gemini["tools"] = tools.clone();
    let refused = call(daemon.addr, "POST", "/v1/turns", None, Some(&gemini)).await;
    assert_eq!(refused.status, 400, "{}", refused.body);
    assert!(
        refused.body.contains("gateway tools") && refused.body.contains("`codex-cli`"),
        "{}",
        refused.body
    );
    assert!(daemon.terminate().await.success());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_refresh_under_the_same_profile_resumes_codex_and_gemini_and_another_profile_starts_fresh()
 {
    let _serial = SERIAL.lock().await;
    let fx = Fixture::new().await;
    let daemon = fx.daemon().await;
    for backend in [CODEX, GEMINI] {
        let body = |prompt: &str, key: &str, profile: &str| {
            let mut body = fx.body(backend, "identity-1", prompt);
            body["provider"]["api_key"] = json!(key);
            body["auth"] = json!({ "auth_profile_id": profile });
            body
        };
        let first_prompt = format!("REPLY={backend} first");
        let (_, first) = turn(&daemon, &body(&first_prompt, "k-FAKE-1", "team-a")).await;
        assert_eq!(first["status"], "idle", "{backend}: {first}");
        let session = first["session_id"].as_str().unwrap_or_default().to_owned();
        assert!(!session.is_empty(), "{backend}: {first}");

        // A refreshed key of the same profile: the stored session is resumed.
        let refreshed_answer = format!("{backend} refreshed");
        let (_, refreshed) = turn(
            &daemon,
            &body(&format!("REPLY={refreshed_answer}"), "k-FAKE-2", "team-a"),
        )
        .await;
        assert_eq!(refreshed["status"], "idle", "{backend}: {refreshed}");
        assert_eq!(
            refreshed["open_reason"], "resumed",
            "{backend}: {refreshed}"
        );
        assert_eq!(refreshed["session_id"], session.as_str(), "{backend}");
        let call = fx.call_answered(&refreshed_answer).body.to_string();
        assert!(
            call.contains(&first_prompt),
            "{backend}: the resumed session carries the first turn: {call:.1500}"
        );

        // Another identity: the stored session is dropped, the history with it.
        let other_answer = format!("{backend} other");
        let (_, other) = turn(
            &daemon,
            &body(&format!("REPLY={other_answer}"), "k-FAKE-2", "team-b"),
        )
        .await;
        assert_eq!(other["status"], "idle", "{backend}: {other}");
        assert_eq!(other["open_reason"], "compat-changed", "{backend}: {other}");
        assert_ne!(other["session_id"], session.as_str(), "{backend}");
        let call = fx.call_answered(&other_answer).body.to_string();
        assert!(
            !call.contains(&first_prompt),
            "{backend}: a fresh session: {call:.1500}"
        );
    }
    assert!(daemon.terminate().await.success());
    let left = wait_none(|| fx.cli_processes(), Duration::from_secs(5)).await;
    assert!(left.is_empty(), "{left:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn codex_turns_images_inline_or_by_path_reach_the_model_other_attachments_get_a_400_and_a_sandboxed_gemini_refuses_images()
 {
    let _serial = SERIAL.lock().await;
    let fx = Fixture::new().await;
    let daemon = fx.daemon().await;
    // Gemini CLI in the daemon's sandbox (the default) reads no `@` image reference: its
    // image turn is refused, saying where images go instead.
    let mut refused = fx.body(GEMINI, "images-gemini", "REPLY=gemini saw a dot");
    refused["attachments"] = json!([
        {"type": "inline", "data": support::cli_daemon::PNG, "media_type": "image/png", "name": "dot.png"}
    ]);
    let (_, end) = support::cli_daemon::streamed_turn(&daemon, &refused, TURN_LIMIT).await;
    assert_eq!(end["status"], "error", "{end}");
    let said = end["error"].as_str().unwrap_or_default();
    assert!(
        said.contains("sandbox") && said.contains("codex-cli"),
        "{end}"
    );
    support::cli_daemon::image_turns(
        &fx,
        &daemon,
        CODEX,
        |prompt| fx.body(CODEX, "images-codex-cli", prompt),
        |text| fx.call_answered(text),
        TURN_LIMIT,
    )
    .await;
    let left = wait_none(|| fx.cli_processes(), Duration::from_secs(5)).await;
    assert!(left.is_empty(), "{left:?}");
}
