//! Fallback across backends (issue 17, item 6) through a real `copilot-pool serve`: the
//! real Copilot runtime and the real Claude Code CLI (both installed by the test support)
//! against one scripted model speaking Anthropic messages on loopback. A Copilot
//! conversation runs two turns; its third fails with a retryable class (the model answers
//! 401 to the runtime), and the turn runs again on `claude-cli`, whose model request must
//! carry the earlier turns in its prelude. A non-retryable failure (400) does not fall back,
//! and bad chains are refused. A turn's gateway `tools` go with it to the next backend: a
//! Copilot turn with tools that fails falls back to Claude, whose call of one is answered
//! over HTTP. A CLI backend whose command is not installed falls back to Copilot as a crash.
//!
//! The tests take one lock, so at most one conversation's processes run at a time.

mod support;

use std::time::Duration;

use copilot_pool::scripted_model::{RecordedRequest, Reply};
use serde_json::{Value, json};
use tokio::sync::Mutex;

use support::cli_daemon::{
    CliFixture as Fixture, FellBack, streamed_tool_turn, streamed_turn, tool_calls, user_text,
};
use support::http::{Daemon, Sse, SseStream, call};
use support::procs::with_env_prefix;

/// One test at a time (each runs its own runtime and Claude processes).
static SERIAL: Mutex<()> = Mutex::const_new(());

/// How many times the runtime sends a model call that was answered 401 before it fails the
/// turn (a first try and two retries; measured with runtime 1.0.14).
const RUNTIME_401_ATTEMPTS: usize = 3;

/// A Copilot turn that crashed (or whose runtime could not start), answered by Claude.
const COPILOT_CRASHED: FellBack = FellBack {
    from: "copilot",
    to: "claude-cli",
    class: "crash",
};

/// A failure guard for one whole turn, not a wait.
const TURN_LIMIT: Duration = Duration::from_secs(180);

impl Fixture {
    /// The daemon: the transcript mirror on (the prelude's source) and the bundled
    /// `claude-cli` with the installed executable.
    async fn daemon(&self) -> Daemon {
        self.daemon_with(&[]).await
    }

    /// [`Fixture::daemon`] with more `serve` arguments.
    async fn daemon_with(&self, extra: &[&str]) -> Daemon {
        let transcripts = self.scratch.path().join("transcripts");
        let turns = format!(
            "[turns]\ntranscript_dir = {:?}\n",
            transcripts.display().to_string()
        );
        let config = support::agent_cli::claude_daemon_config(&turns, "").await;
        Daemon::start(self.scratch.path(), &config, extra).await
    }

    /// A turn body on `copilot` falling back to `claude-cli`; one Anthropic provider serves
    /// both (the runtime's BYOK and Claude's endpoint and key).
    fn body(&self, session_key: &str, prompt: &str) -> Value {
        json!({
            "agent_id": "agent-f",
            "session_key": session_key,
            "prompt": prompt,
            "model": "claude-sonnet-4-5",
            "provider": {
                "type": "anthropic",
                "base_url": format!("http://{}", self.endpoint.addr()),
                "api_key": "sk-ant-FAKE-fallback",
            },
            "fallback": ["claude-cli"],
        })
    }

    /// Claude processes of this fixture (found by their `CLAUDE_CONFIG_DIR`).
    fn claude_processes(&self) -> Vec<u32> {
        with_env_prefix(
            "CLAUDE_CONFIG_DIR",
            &self.scratch.path().display().to_string(),
        )
    }

    /// The model calls whose user text contains `needle`.
    fn calls_with(&self, needle: &str) -> Vec<RecordedRequest> {
        self.model
            .requests()
            .into_iter()
            .filter(|r| user_text(r).contains(needle))
            .collect()
    }
}

/// Whether a model call came from Claude Code (its own user agent) rather than the runtime.
fn from_claude(request: &RecordedRequest) -> bool {
    request
        .header("user-agent")
        .iter()
        .any(|ua| ua.to_ascii_lowercase().contains("claude-cli"))
}

/// Runs a streamed turn; its events and its `turn.end`.
async fn turn(daemon: &Daemon, body: &Value) -> (Vec<Sse>, Value) {
    streamed_turn(daemon, body, TURN_LIMIT).await
}

fn names(events: &[Sse]) -> Vec<&str> {
    events.iter().map(|e| e.event.as_str()).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_copilot_turn_failing_with_auth_falls_back_to_claude_with_the_earlier_turns_in_its_prelude()
 {
    let _serial = SERIAL.lock().await;
    let fx = Fixture::new().await;
    let daemon = fx.daemon().await;

    // Two Copilot turns that work: no fallback.
    for prompt in ["remember PELICAN-17", "and also HERON-42"] {
        let (events, end) = turn(&daemon, &fx.body("f1", prompt)).await;
        assert_eq!(end["status"], "idle", "{end}");
        assert_eq!(end["backend"], "copilot", "{end}");
        assert_eq!(end["fallback_from"], Value::Null, "{end}");
        assert!(
            !names(&events).contains(&"backend.fallback"),
            "{:?}",
            names(&events)
        );
    }
    assert!(fx.claude_processes().is_empty(), "Claude was not needed");

    // The runtime's next model calls are refused: a retryable auth failure. The runtime
    // (1.0.14) retries a 401 twice before it fails the turn.
    for _ in 0..RUNTIME_401_ATTEMPTS {
        fx.model.push_reply(Reply::Error { status: 401 });
    }
    let started = std::time::Instant::now();
    let (events, end) = turn(&daemon, &fx.body("f1", "REPLY=answered by claude")).await;
    eprintln!(
        "measured: a failing Copilot turn and its Claude fallback (spawn included) {:?}",
        started.elapsed()
    );
    let names = names(&events);
    assert_eq!(
        fx.model.pending_replies(),
        0,
        "the runtime met every 401: {names:?} {end}"
    );
    let at = names
        .iter()
        .position(|n| *n == "backend.fallback")
        .unwrap_or_else(|| panic!("no backend.fallback in {names:?}; turn.end {end}"));
    let notice = &events[at].data;
    assert_eq!(notice["from"], "copilot", "{notice}");
    assert_eq!(notice["to"], "claude-cli", "{notice}");
    assert_eq!(notice["class"], "auth", "{notice}");
    assert_eq!(notice["status_code"], 401, "{notice}");
    assert!(
        notice["prelude_chars"].as_u64().unwrap_or(0) > 0,
        "{notice}"
    );
    assert!(
        !names[..at]
            .iter()
            .any(|n| n.starts_with("assistant.message")),
        "no Copilot output before the fallback: {names:?}"
    );
    assert!(
        names[at..].contains(&"assistant.message_delta"),
        "Claude's events follow in the same vocabulary: {names:?}"
    );
    assert_eq!(end["status"], "idle", "{end}");
    assert_eq!(end["backend"], "claude-cli", "{end}");
    assert_eq!(end["fallback_from"], "copilot", "{end}");
    assert_eq!(end["final_text"], "answered by claude", "{end}");

    // What Claude's model call carried: the prelude with both earlier turns, then the prompt.
    let claude_calls: Vec<RecordedRequest> = fx
        .calls_with("REPLY=answered by claude")
        .into_iter()
        .filter(from_claude)
        .collect();
    let call = claude_calls.last().unwrap_or_else(|| {
        let agents: Vec<Vec<String>> = fx
            .model
            .requests()
            .iter()
            .map(|r| {
                r.header("user-agent")
                    .iter()
                    .map(|s| s.to_string())
                    .collect()
            })
            .collect();
        panic!("no Claude model call for the prompt; user agents seen: {agents:?}")
    });
    let text = user_text(call);
    for earlier in ["PELICAN-17", "HERON-42", "scripted reply #"] {
        assert!(
            text.contains(earlier),
            "the prelude carries {earlier:?}: {text}"
        );
    }
    let prelude_at = text.find("PELICAN-17").unwrap_or(usize::MAX);
    let prompt_at = text.rfind("REPLY=answered by claude").unwrap_or(0);
    assert!(prelude_at < prompt_at, "the prelude comes first: {text}");
    assert_eq!(
        text.matches("REPLY=answered by claude").count(),
        1,
        "the failed prompt is not carried twice: {text}"
    );

    let metrics = call_metrics(&daemon).await;
    let series =
        "copilot_pool_fallbacks_total{from=\"copilot\",to=\"claude-cli\",class=\"auth\"} 1";
    support::http::assert_has_series(&metrics, series);
    assert!(daemon.terminate().await.success());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_transcript_mirror_the_prelude_comes_from_the_runtimes_own_event_log() {
    let _serial = SERIAL.lock().await;
    let fx = Fixture::new().await;
    // No `[turns] transcript_dir`: the daemon keeps no mirror of its own.
    let config = support::agent_cli::claude_daemon_config("", "").await;
    let daemon = Daemon::start(fx.scratch.path(), &config, &[]).await;
    prelude_from_the_runtimes_event_log(&fx, &daemon, "EGRET-8", "IBIS-31").await;
    assert!(daemon.terminate().await.success());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_best_effort_mirror_that_could_not_open_leaves_the_prelude_to_the_runtimes_event_log() {
    let _serial = SERIAL.lock().await;
    let fx = Fixture::new().await;
    let daemon = fx.daemon().await;
    // A file where the mirror's directory would be made: every lease's best-effort open
    // fails, and the turns go on without a mirror.
    let dir = fx.scratch.path().join("transcripts");
    std::fs::write(&dir, "not a directory").expect("a file in its place");
    prelude_from_the_runtimes_event_log(&fx, &daemon, "HERON-5", "AVOCET-12").await;
    assert!(daemon.terminate().await.success());
}

/// Two Copilot turns naming `first` and `second`, then one whose model calls fail 401 and
/// which falls back to Claude: its prelude carries both earlier turns, read from the
/// runtime's own event log.
async fn prelude_from_the_runtimes_event_log(
    fx: &Fixture,
    daemon: &Daemon,
    first: &str,
    second: &str,
) {
    for prompt in [format!("remember {first}"), format!("and also {second}")] {
        let (_, end) = turn(daemon, &fx.body("m1", &prompt)).await;
        assert_eq!(end["status"], "idle", "{end}");
        assert_eq!(end["backend"], "copilot", "{end}");
    }
    for _ in 0..RUNTIME_401_ATTEMPTS {
        fx.model.push_reply(Reply::Error { status: 401 });
    }
    let (events, end) = turn(daemon, &fx.body("m1", "REPLY=claude without a mirror")).await;
    assert_eq!(end["backend"], "claude-cli", "{end}");
    assert_eq!(end["status"], "idle", "{end}");
    let notice = events
        .iter()
        .find(|e| e.event == "backend.fallback")
        .map(|e| e.data.clone())
        .unwrap_or_else(|| panic!("no backend.fallback: {:?}", names(&events)));
    assert!(
        notice["prelude_chars"].as_u64().unwrap_or(0) > 0,
        "{notice}"
    );
    let call = fx
        .calls_with("REPLY=claude without a mirror")
        .into_iter()
        .rfind(from_claude)
        .expect("Claude's model call");
    let text = user_text(&call);
    for earlier in [first, second, "scripted reply #"] {
        assert!(
            text.contains(earlier),
            "the prelude carries {earlier:?}: {text}"
        );
    }
    assert!(
        text.find(first) < text.rfind("REPLY=claude without a mirror"),
        "the prelude comes first: {text}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fallback_waiting_for_its_backends_capacity_stops_waiting_when_its_caller_leaves_or_aborts()
 {
    let _serial = SERIAL.lock().await;
    let fx = Fixture::new().await;
    // One Claude process per key: a conversation's fallback to Claude waits while another
    // conversation of the agent runs a Claude turn.
    let config =
        support::agent_cli::claude_daemon_config("[pool]\nmax_processes_per_key = 1\n", "").await;
    let daemon = Daemon::start(fx.scratch.path(), &config, &[]).await;
    let mut hold = fx.body("holder", "SCENARIO:slow SLOW=120x250");
    hold["backend"] = json!("claude-cli");
    hold.as_object_mut().expect("an object").remove("fallback");
    let mut holding = SseStream::open(daemon.addr, "/v1/turns", None, &hold).await;
    holding.until_event("assistant.message_delta").await;
    for _ in 0..RUNTIME_401_ATTEMPTS {
        fx.model.push_reply(Reply::Error { status: 401 });
    }
    let waiters = || async {
        call(daemon.addr, "GET", "/v1/pool", None, None)
            .await
            .json()["waiters"]
            .as_u64()
            .unwrap_or(u64::MAX)
    };
    let leaving = SseStream::open(
        daemon.addr,
        "/v1/turns",
        None,
        &fx.body("leaver", "REPLY=x"),
    )
    .await;
    let queued = tokio::time::timeout(TURN_LIMIT, async {
        while waiters().await == 0 {
            tokio::task::yield_now().await;
        }
    })
    .await;
    assert!(queued.is_ok(), "the fallback never waited for Claude");
    // The caller leaves while its fallback waits: the wait ends with it, not at the pool's
    // 30 s wait timeout.
    drop(leaving);
    let gone = tokio::time::timeout(Duration::from_secs(10), async {
        while waiters().await != 0 {
            tokio::task::yield_now().await;
        }
    })
    .await;
    assert!(
        gone.is_ok(),
        "the waiter of the caller that left stayed queued"
    );
    // A caller that stays and aborts its turn while the fallback waits: the wait ends at
    // once, the turn ends aborted, and its prompt is never sent to the fallback.
    for _ in 0..RUNTIME_401_ATTEMPTS {
        fx.model.push_reply(Reply::Error { status: 401 });
    }
    let mut stopping = SseStream::open(
        daemon.addr,
        "/v1/turns",
        None,
        &fx.body("stopper", "REPLY=never MARKER-stopped"),
    )
    .await;
    let queued = tokio::time::timeout(TURN_LIMIT, async {
        while waiters().await == 0 {
            tokio::task::yield_now().await;
        }
    })
    .await;
    assert!(
        queued.is_ok(),
        "the second fallback never waited for Claude"
    );
    // Meanwhile the conversation's next turn runs on Copilot (the first let its lease go when
    // it failed) and waits for its gateway tool's answer: the abort is not its.
    let mut next = fx.body(
        "stopper",
        r#"SCENARIO:tool NAME=lookup ARGS={"key":"next"}"#,
    );
    next.as_object_mut().expect("an object").remove("fallback");
    next["tools"] = json!([{
        "name": "lookup",
        "description": "Looks a key up in the gateway's table.",
        "parameters": {"type": "object", "properties": {"key": {"type": "string"}}},
    }]);
    let mut running = SseStream::open(daemon.addr, "/v1/turns", None, &next).await;
    let tool_call = tokio::time::timeout(TURN_LIMIT, running.until_event("tool.call"))
        .await
        .expect("the next turn calls its tool");
    let stop = call(
        daemon.addr,
        "POST",
        "/v1/sessions/agent-f/stopper/abort",
        None,
        None,
    )
    .await;
    assert_eq!(stop.status, 204, "{}", stop.body);
    let (_, end) = tokio::time::timeout(Duration::from_secs(10), stopping.until_end())
        .await
        .expect("the aborted turn stops waiting for its fallback");
    assert_eq!(end["status"], "aborted", "{end}");
    assert_eq!(waiters().await, 0, "the aborted turn's waiter is gone");
    assert!(
        fx.model
            .requests()
            .iter()
            .filter(|r| from_claude(r))
            .all(|r| !serde_json::to_string(r.messages())
                .unwrap_or_default()
                .contains("MARKER-stopped")),
        "the aborted turn's prompt reached the fallback"
    );
    let request_id = tool_call.data["request_id"].as_str().unwrap_or_default();
    let answered = call(
        daemon.addr,
        "POST",
        &format!("/v1/requests/{request_id}"),
        None,
        Some(&json!({"result": "answered next"})),
    )
    .await;
    assert_eq!(
        answered.status, 204,
        "the next turn's tool call is still waiting: {}",
        answered.body
    );
    let (_, end) = tokio::time::timeout(TURN_LIMIT, running.until_end())
        .await
        .expect("the next turn ends");
    assert_eq!(
        end["status"], "idle",
        "the next turn was not aborted: {end}"
    );
    let abort = call(
        daemon.addr,
        "POST",
        "/v1/sessions/agent-f/holder/abort",
        None,
        None,
    )
    .await;
    assert_eq!(abort.status, 204);
    holding.until_end().await;
    assert!(daemon.terminate().await.success());
}

async fn call_metrics(daemon: &Daemon) -> String {
    call(daemon.addr, "GET", "/metrics", None, None).await.body
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_non_retryable_failure_does_not_fall_back_and_bad_chains_are_refused() {
    let _serial = SERIAL.lock().await;
    let fx = Fixture::new().await;
    let daemon = fx.daemon().await;

    let (_, first) = turn(&daemon, &fx.body("n1", "remember OSPREY-5")).await;
    assert_eq!(first["status"], "idle", "{first}");

    // A bad request is not retryable: the turn ends with its error on Copilot.
    fx.model.push_reply(Reply::Error { status: 400 });
    let (events, end) = turn(&daemon, &fx.body("n1", "REPLY=must stay on copilot")).await;
    assert_eq!(end["status"], "error", "{end}");
    assert_eq!(end["backend"], "copilot", "{end}");
    assert_eq!(end["status_code"], 400, "{end}");
    assert_eq!(end["fallback_from"], Value::Null, "{end}");
    assert!(
        !names(&events).contains(&"backend.fallback"),
        "{:?}",
        names(&events)
    );
    assert!(
        !fx.model.requests().iter().any(from_claude),
        "Claude was never asked"
    );
    assert!(
        fx.claude_processes().is_empty(),
        "no Claude process started"
    );
    let metrics = call_metrics(&daemon).await;
    assert!(
        !metrics
            .lines()
            .any(|l| l.starts_with("copilot_pool_fallbacks_total{") && !l.ends_with(" 0")),
        "no fallback counted:\n{metrics}"
    );

    // Chains the daemon refuses, each a 400 that says how to fix it.
    let refused = |mut body: Value, patch: Value| {
        for (k, v) in patch.as_object().cloned().unwrap_or_default() {
            body[k] = v;
        }
        async move {
            let answer = call(daemon.addr, "POST", "/v1/turns", None, Some(&body)).await;
            assert_eq!(answer.status, 400, "{}", answer.body);
            answer.body
        }
    };
    let body = fx.body("n2", "hi");
    let twice = refused(
        body.clone(),
        json!({"fallback": ["claude-cli", "claude-cli"]}),
    )
    .await;
    assert!(twice.contains("`claude-cli` twice"), "{twice}");
    let primary = refused(body.clone(), json!({"fallback": ["copilot"]})).await;
    assert!(primary.contains("`copilot` twice"), "{primary}");
    let unknown = refused(body.clone(), json!({"fallback": ["nope-cli"]})).await;
    assert!(unknown.contains("[backends.nope-cli]"), "{unknown}");
    let hooks = refused(body.clone(), json!({"hooks": ["llm_input"]})).await;
    assert!(
        hooks
            .contains("hooks are not offered to CLI backend `claude-cli`, and `fallback` names it"),
        "{hooks}"
    );
    // Gateway tools are not refused for `claude-cli` (its MCP bridge serves them), but
    // still checked as for any turn.
    let unnamed = refused(body.clone(), json!({"tools": [{"name": ""}]})).await;
    assert!(unnamed.contains("tools.0.name is empty"), "{unnamed}");
    let budget = refused(body, json!({"prelude_chars": 0})).await;
    assert!(budget.contains("prelude_chars"), "{budget}");
    assert!(daemon.terminate().await.success());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_runtime_killed_mid_turn_falls_back_to_claude_as_a_crash() {
    let _serial = SERIAL.lock().await;
    let fx = Fixture::new().await;
    let daemon = fx.daemon().await;

    let (_, first) = turn(&daemon, &fx.body("k1", "remember KESTREL-8")).await;
    assert_eq!(first["status"], "idle", "{first}");

    // The runtime's next model call hangs; the runtime is killed while it waits.
    let before = fx.model.requests().len();
    fx.model.push_reply(Reply::Hang);
    let run = async {
        let body = fx.body("k1", "REPLY=after the crash");
        let mut stream = SseStream::open(daemon.addr, "/v1/turns", None, &body).await;
        assert_eq!(stream.status, 200, "the turn was accepted");
        fx.model.wait_for_requests(before + 1).await;
        let pool = call(daemon.addr, "GET", "/v1/pool", None, None)
            .await
            .json();
        let pid = pool["processes"][0]["pid"]
            .as_u64()
            .expect("the runtime's pid");
        nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(i32::try_from(pid).expect("a pid")),
            nix::sys::signal::Signal::SIGKILL,
        )
        .expect("kill the runtime");
        stream.until_end().await
    };
    let (events, end) = tokio::time::timeout(TURN_LIMIT, run)
        .await
        .expect("the turn ended in time");
    COPILOT_CRASHED.assert(&events, &end, "after the crash");
    let call = fx
        .calls_with("REPLY=after the crash")
        .into_iter()
        .rfind(from_claude)
        .expect("Claude's model call");
    assert!(
        user_text(&call).contains("KESTREL-8"),
        "the prelude carries the turn before the crash: {}",
        user_text(&call)
    );
    let metrics = call_metrics(&daemon).await;
    let series =
        "copilot_pool_fallbacks_total{from=\"copilot\",to=\"claude-cli\",class=\"crash\"} 1";
    support::http::assert_has_series(&metrics, series);
    assert!(daemon.terminate().await.success());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_copilot_runtime_that_cannot_start_falls_back_to_claude_and_without_a_chain_is_the_leases_error()
 {
    let _serial = SERIAL.lock().await;
    let fx = Fixture::new().await;
    // A broken runtime install: the executable exits at once, so no Copilot process starts.
    let daemon = fx.daemon_with(&["--cli", "/bin/false"]).await;

    let (events, end) = turn(&daemon, &fx.body("k-broken", "REPLY=from claude")).await;
    let notice = COPILOT_CRASHED.assert(&events, &end, "from claude");
    assert_eq!(notice["prelude_chars"], 0, "{notice}");
    assert!(
        notice["error"].as_str().is_some_and(|e| !e.is_empty()),
        "the notice says why the lease failed: {notice}"
    );
    let metrics = call_metrics(&daemon).await;
    let series =
        "copilot_pool_fallbacks_total{from=\"copilot\",to=\"claude-cli\",class=\"crash\"} 1";
    support::http::assert_has_series(&metrics, series);

    // Without a chain the same failure is the lease's own error, before any stream.
    let mut body = fx.body("k-broken-2", "REPLY=never");
    body.as_object_mut().expect("an object").remove("fallback");
    let answer = call(daemon.addr, "POST", "/v1/turns", None, Some(&body)).await;
    assert!(
        answer.status == 502 || answer.status == 503,
        "the lease's error: {} {}",
        answer.status,
        answer.json()
    );
    assert!(daemon.terminate().await.success());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cli_backend_whose_command_is_not_installed_falls_back_to_copilot_as_a_crash() {
    let _serial = SERIAL.lock().await;
    let fx = Fixture::new().await;
    let config =
        "drain_grace_secs = 5\n[backends.claude-cli]\ncommand = \"claude-not-installed-here\"\n";
    let daemon = Daemon::start(fx.scratch.path(), config, &[]).await;

    let mut body = fx.body("k-missing", "REPLY=from copilot");
    body["backend"] = json!("claude-cli");
    body["fallback"] = json!(["copilot"]);
    let (events, end) = turn(&daemon, &body).await;
    let fell_back = FellBack {
        from: "claude-cli",
        to: "copilot",
        class: "crash",
    };
    let notice = fell_back.assert(&events, &end, "from copilot");
    assert!(
        notice["error"]
            .as_str()
            .is_some_and(|e| e.contains("claude-not-installed-here")),
        "the notice names the command that is missing: {notice}"
    );
    let metrics = call_metrics(&daemon).await;
    let series =
        "copilot_pool_fallbacks_total{from=\"claude-cli\",to=\"copilot\",class=\"crash\"} 1";
    support::http::assert_has_series(&metrics, series);
    assert!(daemon.terminate().await.success());
}

/// How many times Claude Code sends a model call answered 401 before it ends the turn with
/// its error (`CLAUDE_CODE_MAX_RETRIES=1`: a first try and one retry).
const CLAUDE_401_ATTEMPTS: usize = 2;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claude_turn_failing_with_auth_falls_back_to_copilot_with_claudes_transcript_in_its_prelude()
 {
    let _serial = SERIAL.lock().await;
    let fx = Fixture::new().await;
    let daemon = fx.daemon().await;
    let body = |prompt: &str| {
        let mut body = fx.body("c1", prompt);
        body["backend"] = json!("claude-cli");
        body["fallback"] = json!(["copilot"]);
        body
    };

    let (_, first) = turn(&daemon, &body("remember ALBATROSS-3")).await;
    assert_eq!(first["status"], "idle", "{first}");
    assert_eq!(first["backend"], "claude-cli", "{first}");

    for _ in 0..CLAUDE_401_ATTEMPTS {
        fx.model.push_reply(Reply::Error { status: 401 });
    }
    let (events, end) = turn(&daemon, &body("REPLY=answered by copilot")).await;
    let names = names(&events);
    assert_eq!(
        fx.model.pending_replies(),
        0,
        "Claude met every 401: {names:?} {end}"
    );
    let fell_back = FellBack {
        from: "claude-cli",
        to: "copilot",
        class: "auth",
    };
    let notice = fell_back.assert(&events, &end, "answered by copilot");
    assert_eq!(
        notice["status_code"], 401,
        "the status Claude's error names: {notice}"
    );
    let call = fx
        .calls_with("REPLY=answered by copilot")
        .into_iter()
        .rfind(|r| !from_claude(r))
        .expect("the runtime's model call");
    let text = user_text(&call);
    assert!(
        text.contains("ALBATROSS-3") && text.contains("(claude-cli)"),
        "the prelude carries Claude's earlier turn: {text}"
    );
    assert!(daemon.terminate().await.success());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_turn_with_gateway_tools_falls_back_to_claude_whose_tool_call_is_answered_over_http() {
    let _serial = SERIAL.lock().await;
    let fx = Fixture::new().await;
    let daemon = fx.daemon().await;
    for _ in 0..RUNTIME_401_ATTEMPTS {
        fx.model.push_reply(Reply::Error { status: 401 });
    }
    let mut body = fx.body(
        "tools-1",
        r#"SCENARIO:tool NAME=mcp__gateway__lookup ARGS={"key":"chain"}"#,
    );
    body["tools"] = json!([{
        "name": "lookup",
        "description": "Looks a key up in the gateway's table.",
        "parameters": {"type": "object", "properties": {"key": {"type": "string"}}},
    }]);
    let answer = |call: &Value| json!({"result": format!("answered {}", call["arguments"]["key"].as_str().unwrap_or("?"))});
    let (events, end) = streamed_tool_turn(&daemon, &body, answer, TURN_LIMIT).await;
    assert_eq!(end["backend"], "claude-cli", "{end}");
    assert_eq!(end["fallback_from"], "copilot", "{end}");
    assert_eq!(end["status"], "idle", "{end}");
    // (Claude appends its own `<system-reminder>` to a tool result for this model.)
    assert!(
        end["final_text"]
            .as_str()
            .is_some_and(|t| t.starts_with("tool said: answered chain")),
        "the gateway's answer reached Claude's model: {end}"
    );
    let calls = tool_calls(&events);
    assert_eq!(calls.len(), 1, "{calls:?}");
    assert_eq!(calls[0]["tool_name"], "lookup", "{calls:?}");
    assert!(
        names(&events).contains(&"backend.fallback"),
        "{:?}",
        names(&events)
    );
    assert!(daemon.terminate().await.success());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claude_turns_image_goes_with_the_turn_to_the_copilot_fallback_as_an_attachment() {
    use support::cli_daemon::{PNG, images_in};
    let _serial = SERIAL.lock().await;
    let fx = Fixture::new().await;
    let daemon = fx.daemon().await;
    for _ in 0..CLAUDE_401_ATTEMPTS {
        fx.model.push_reply(Reply::Error { status: 401 });
    }
    let mut body = fx.body("image-1", "REPLY=copilot saw the dot");
    body["backend"] = json!("claude-cli");
    body["fallback"] = json!(["copilot"]);
    body["attachments"] =
        json!([{"type": "inline", "data": PNG, "media_type": "image/png", "name": "dot.png"}]);
    let (events, end) = turn(&daemon, &body).await;
    assert_eq!(end["status"], "idle", "{end} {:?}", names(&events));
    assert_eq!(end["backend"], "copilot", "{end}");
    assert_eq!(end["fallback_from"], "claude-cli", "{end}");
    let png = ("image/png".to_owned(), PNG.to_owned());
    let calls = fx.calls_with("REPLY=copilot saw the dot");
    let claude: Vec<_> = calls.iter().filter(|r| from_claude(r)).collect();
    let runtime: Vec<_> = calls.iter().filter(|r| !from_claude(r)).collect();
    assert!(
        !claude.is_empty() && claude.iter().all(|r| images_in(r).contains(&png)),
        "Claude's calls carried the image"
    );
    assert!(
        runtime.iter().any(|r| images_in(r).contains(&png)),
        "the Copilot fallback's call carried it"
    );

    // A Copilot turn whose chain names a CLI backend takes images only, too.
    let mut body = fx.body("image-2", "REPLY=never");
    body["attachments"] = json!([{"type": "directory", "path": "."}]);
    let refused = call(daemon.addr, "POST", "/v1/turns", None, Some(&body)).await;
    assert_eq!(refused.status, 400, "{}", refused.body);
    let message = refused.json()["message"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    assert!(
        message.contains("attachments[0] (directory")
            && message.contains("`fallback` names CLI backend `claude-cli`"),
        "{message}"
    );
    assert!(daemon.terminate().await.success());
}
