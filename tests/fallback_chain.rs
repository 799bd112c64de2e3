//! Fallback along a chain longer than one (issue 17, item 6) through a real `copilot-pool
//! serve`: the real Copilot runtime, the real Claude Code CLI and the real Codex CLI (all
//! installed by the test support) against one scripted model on loopback (the runtime's BYOK
//! Anthropic provider and Claude post to `/v1/messages`, Codex to `/responses` under the same
//! base URL). A Copilot conversation runs two turns; on its third the model refuses the
//! runtime and then Claude with a retryable class, and the turn ends on `codex-cli`, the
//! third backend of the chain, whose model request must carry the earlier Copilot turns in
//! its prelude (once, not nested in Claude's failed attempt). A 429 on Copilot falls back as
//! `rate_limit`.
//!
//! The scripted model's replies are one queue: the backends of a chain run one after the
//! other, so queued errors are met in order (the runtime's, then Claude's). The tests take
//! one lock, so at most one conversation's processes run at a time.

mod support;

use std::time::Duration;

use copilot_pool::scripted_model::{RecordedRequest, Reply};
use serde_json::{Value, json};
use tokio::sync::Mutex;

use support::agent_cli::{claude_path, codex_path};
use support::cli_daemon::{CliFixture as Fixture, streamed_turn, user_text};
use support::http::{Daemon, Sse, call};

/// One test at a time (each runs its own runtime, Claude and Codex processes).
static SERIAL: Mutex<()> = Mutex::const_new(());

/// How many times the runtime sends a model call answered 401 before it fails the turn (a
/// first try and two retries; measured with runtime 1.0.14, as in `tests/fallback.rs`).
const RUNTIME_401_ATTEMPTS: usize = 3;

/// How many times Claude Code sends a model call answered 401 before it ends the turn
/// (`CLAUDE_CODE_MAX_RETRIES=1`: a first try and one retry).
const CLAUDE_401_ATTEMPTS: usize = 2;

/// A failure guard for one whole turn, not a wait.
const TURN_LIMIT: Duration = Duration::from_secs(240);

/// The model the turn names (the runtime's BYOK and Claude take it as it is).
const MODEL: &str = "claude-sonnet-4-5";

/// What `codex-cli` runs for [`MODEL`] (its `modelAliases`): a model Codex knows.
const CODEX_MODEL: &str = "gpt-5.5";

impl Fixture {
    /// The daemon: the transcript mirror on (the first prelude's source), the bundled
    /// `claude-cli` and `codex-cli` with the installed executables, Codex mapping the turn's
    /// model to one it knows.
    async fn daemon(&self) -> Daemon {
        let config = format!(
            "drain_grace_secs = 5\n[turns]\ntranscript_dir = {:?}\n\
             [backends.claude-cli]\ncommand = {:?}\n\
             [backends.codex-cli]\ncommand = {:?}\n\
             [backends.codex-cli.modelAliases]\n{MODEL:?} = {CODEX_MODEL:?}\n",
            self.scratch
                .path()
                .join("transcripts")
                .display()
                .to_string(),
            claude_path().await.display().to_string(),
            codex_path().await.display().to_string(),
        );
        Daemon::start(self.scratch.path(), &config, &[]).await
    }

    /// A turn body on `copilot` falling back to `claude-cli`, then `codex-cli`; one
    /// Anthropic provider (base URL and key) serves all three.
    fn body(&self, session_key: &str, prompt: &str) -> Value {
        json!({
            "agent_id": "agent-chain",
            "session_key": session_key,
            "prompt": prompt,
            "model": MODEL,
            "provider": {
                "type": "anthropic",
                "base_url": format!("http://{}", self.endpoint.addr()),
                "api_key": "sk-ant-FAKE-chain",
            },
            "fallback": ["claude-cli", "codex-cli"],
        })
    }
}

/// Who sent a model call, by its path and user agent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Sender {
    Runtime,
    Claude,
    Codex,
}

fn sender(request: &RecordedRequest) -> Sender {
    let agent = request.header("user-agent").join(" ").to_ascii_lowercase();
    if request.path.ends_with("/responses") || agent.contains("codex") {
        Sender::Codex
    } else if agent.contains("claude-cli") {
        Sender::Claude
    } else {
        Sender::Runtime
    }
}

/// The user text of a Responses API request (Codex's `input` messages), joined.
fn codex_user_text(request: &RecordedRequest) -> String {
    request.body["input"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|item| item["role"] == "user")
        .flat_map(|item| match &item["content"] {
            Value::String(text) => vec![text.clone()],
            Value::Array(blocks) => blocks
                .iter()
                .filter_map(|b| b["text"].as_str().map(str::to_owned))
                .collect(),
            _ => Vec::new(),
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// The model calls since `before` that `who` sent.
fn calls_by(fx: &Fixture, before: usize, who: Sender) -> Vec<RecordedRequest> {
    fx.model
        .requests()
        .into_iter()
        .skip(before)
        .filter(|r| sender(r) == who && r.method == "POST")
        .collect()
}

async fn turn(daemon: &Daemon, body: &Value) -> (Vec<Sse>, Value) {
    streamed_turn(daemon, body, TURN_LIMIT).await
}

fn names(events: &[Sse]) -> Vec<&str> {
    events.iter().map(|e| e.event.as_str()).collect()
}

async fn metrics(daemon: &Daemon) -> String {
    call(daemon.addr, "GET", "/metrics", None, None).await.body
}

/// Asserts `metrics` has the fallback series `from` → `to` of `class` at `count`.
fn assert_fallbacks_counted(metrics: &str, from: &str, to: &str, class: &str, count: u64) {
    let series = format!(
        "copilot_pool_fallbacks_total{{from=\"{from}\",to=\"{to}\",class=\"{class}\"}} {count}"
    );
    support::http::assert_has_series(metrics, &series);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_copilot_turn_refused_on_copilot_and_on_claude_ends_on_codex_with_the_copilot_turns_in_its_prelude()
 {
    let _serial = SERIAL.lock().await;
    let fx = Fixture::new().await;
    let daemon = fx.daemon().await;

    // Two Copilot turns that work: nothing falls back.
    for prompt in ["remember PELICAN-17", "and also HERON-42"] {
        let (events, end) = turn(&daemon, &fx.body("chain-1", prompt)).await;
        assert_eq!(end["status"], "idle", "{end}");
        assert_eq!(end["backend"], "copilot", "{end}");
        assert!(
            !names(&events).contains(&"backend.fallback"),
            "{:?}",
            names(&events)
        );
    }

    // The runtime's next model calls are refused (401, with its retries), then Claude's
    // (401, with its retry); Codex's are answered.
    for _ in 0..RUNTIME_401_ATTEMPTS + CLAUDE_401_ATTEMPTS {
        fx.model.push_reply(Reply::Error { status: 401 });
    }
    let before = fx.model.requests().len();
    let started = std::time::Instant::now();
    let (events, end) = turn(&daemon, &fx.body("chain-1", "REPLY=answered by codex")).await;
    eprintln!(
        "measured: a turn failing on Copilot and on Claude, ending on Codex (spawns included) {:?}",
        started.elapsed()
    );
    let names = names(&events);
    assert_eq!(
        fx.model.pending_replies(),
        0,
        "the runtime and Claude met every 401: {names:?} {end}"
    );
    assert_eq!(
        calls_by(&fx, before, Sender::Runtime).len(),
        RUNTIME_401_ATTEMPTS,
        "{names:?}"
    );
    assert_eq!(
        calls_by(&fx, before, Sender::Claude).len(),
        CLAUDE_401_ATTEMPTS,
        "Claude met its 401s and asked no more: {names:?}"
    );

    // Two notices, in the chain's order.
    let notices: Vec<(usize, &Value)> = events
        .iter()
        .enumerate()
        .filter(|(_, e)| e.event == "backend.fallback")
        .map(|(at, e)| (at, &e.data))
        .collect();
    assert_eq!(notices.len(), 2, "{names:?}; turn.end {end}");
    let hops: Vec<(&str, &str)> = notices
        .iter()
        .map(|(_, n)| {
            (
                n["from"].as_str().unwrap_or_default(),
                n["to"].as_str().unwrap_or_default(),
            )
        })
        .collect();
    assert_eq!(
        hops,
        [("copilot", "claude-cli"), ("claude-cli", "codex-cli")],
        "{names:?}"
    );
    for (_, notice) in &notices {
        assert_eq!(notice["class"], "auth", "{notice}");
        assert_eq!(notice["status_code"], 401, "{notice}");
        assert!(
            notice["prelude_chars"].as_u64().unwrap_or(0) > 0,
            "each hop carries the Copilot turns: {notice}"
        );
    }
    let (first, _) = notices[0];
    let (second, _) = notices[1];
    assert!(
        !names[..first]
            .iter()
            .any(|n| n.starts_with("assistant.message")),
        "no Copilot output before the first fallback: {names:?}"
    );
    // Between the notices nothing of Claude's: its own error (`API Error: 401 …`, which it
    // sends as an assistant message) is no answer, and the turn fell back over it.
    assert!(
        !names[first..second]
            .iter()
            .any(|n| n.starts_with("assistant.message")),
        "no Claude output before the second fallback: {names:?}"
    );
    assert!(
        names[second..].contains(&"assistant.message"),
        "Codex's events follow in the same vocabulary: {names:?}"
    );
    assert_eq!(end["status"], "idle", "{end}");
    assert_eq!(end["backend"], "codex-cli", "{end}");
    assert_eq!(end["fallback_from"], "claude-cli", "{end}");
    assert_eq!(end["final_text"], "answered by codex", "{end}");

    // Claude's model calls carried the prelude.
    let claude = calls_by(&fx, before, Sender::Claude);
    let claude_text = user_text(claude.last().expect("Claude's model call"));
    assert!(
        claude_text.contains("PELICAN-17") && claude_text.contains("HERON-42"),
        "Claude's prelude: {claude_text}"
    );

    // Codex's model call: the earlier Copilot turns before the prompt, the prompt once, and
    // nothing of Claude's failed attempt (its prelude nested again, its API error).
    let codex = calls_by(&fx, before, Sender::Codex);
    let call = codex
        .iter()
        .rfind(|r| codex_user_text(r).contains("REPLY=answered by codex"))
        .unwrap_or_else(|| panic!("no Codex model call for the prompt: {codex:?}"));
    let text = codex_user_text(call);
    for earlier in ["PELICAN-17", "HERON-42", "scripted reply #"] {
        assert!(
            text.contains(earlier),
            "Codex's prelude carries {earlier:?}: {text}"
        );
    }
    let prelude_at = text.find("PELICAN-17").unwrap_or(usize::MAX);
    let prompt_at = text.rfind("REPLY=answered by codex").unwrap_or(0);
    assert!(prelude_at < prompt_at, "the prelude comes first: {text}");
    for once in [
        "REPLY=answered by codex",
        "[Context carried over",
        "user: remember PELICAN-17",
        "user: and also HERON-42",
    ] {
        assert_eq!(
            text.matches(once).count(),
            1,
            "{once:?} is carried once: {text}"
        );
    }
    assert!(
        text.contains("ran on another backend (copilot)"),
        "the prelude is the Copilot conversation's: {text}"
    );
    assert!(
        !text.to_ascii_lowercase().contains("api error"),
        "Claude's error is not carried as a turn: {text}"
    );

    let metrics = metrics(&daemon).await;
    assert_fallbacks_counted(&metrics, "copilot", "claude-cli", "auth", 1);
    assert_fallbacks_counted(&metrics, "claude-cli", "codex-cli", "auth", 1);
    assert!(daemon.terminate().await.success());
}

/// How many times the runtime sends a model call answered 429 before it fails the turn (a
/// first try and five retries; measured with runtime 1.0.14).
const RUNTIME_429_ATTEMPTS: usize = 6;
/// The wait each 429 asks for (`retry-after-ms`): the runtime's own backoff would take about
/// a minute over its five retries.
const RETRY_AFTER: Duration = Duration::from_millis(20);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_copilot_turn_the_model_rate_limits_falls_back_to_claude_as_rate_limit() {
    let _serial = SERIAL.lock().await;
    let fx = Fixture::new().await;
    let daemon = fx.daemon().await;

    let (_, first) = turn(&daemon, &fx.body("rate-1", "remember OSPREY-5")).await;
    assert_eq!(first["status"], "idle", "{first}");
    assert_eq!(first["backend"], "copilot", "{first}");

    for _ in 0..RUNTIME_429_ATTEMPTS {
        fx.model.push_reply(Reply::RateLimited {
            retry_after: RETRY_AFTER,
        });
    }
    let before = fx.model.requests().len();
    let started = std::time::Instant::now();
    let (events, end) = turn(&daemon, &fx.body("rate-1", "REPLY=answered by claude")).await;
    eprintln!(
        "measured: a rate-limited Copilot turn (the runtime's retries) and its Claude fallback {:?}",
        started.elapsed()
    );
    let names = names(&events);
    assert_eq!(
        fx.model.pending_replies(),
        0,
        "the runtime met every 429: {names:?} {end}"
    );
    assert_eq!(
        calls_by(&fx, before, Sender::Runtime).len(),
        RUNTIME_429_ATTEMPTS,
        "{names:?}"
    );
    let notices: Vec<&Value> = events
        .iter()
        .filter(|e| e.event == "backend.fallback")
        .map(|e| &e.data)
        .collect();
    assert_eq!(notices.len(), 1, "Claude answered: {names:?} {end}");
    let notice = notices[0];
    assert_eq!(notice["from"], "copilot", "{notice}");
    assert_eq!(notice["to"], "claude-cli", "{notice}");
    assert_eq!(notice["class"], "rate_limit", "{notice}");
    assert_eq!(notice["status_code"], 429, "{notice}");
    assert!(
        notice["prelude_chars"].as_u64().unwrap_or(0) > 0,
        "{notice}"
    );
    assert_eq!(end["status"], "idle", "{end}");
    assert_eq!(end["backend"], "claude-cli", "{end}");
    assert_eq!(end["fallback_from"], "copilot", "{end}");
    assert_eq!(end["final_text"], "answered by claude", "{end}");
    assert!(
        calls_by(&fx, before, Sender::Codex).is_empty(),
        "the chain stopped at Claude"
    );
    let claude = calls_by(&fx, before, Sender::Claude);
    let text = user_text(claude.last().expect("Claude's model call"));
    assert!(
        text.contains("user: remember OSPREY-5"),
        "Claude's prelude: {text}"
    );

    let metrics = metrics(&daemon).await;
    assert_fallbacks_counted(&metrics, "copilot", "claude-cli", "rate_limit", 1);
    assert_fallbacks_counted(&metrics, "copilot", "claude-cli", "auth", 0);
    assert!(daemon.terminate().await.success());
}
