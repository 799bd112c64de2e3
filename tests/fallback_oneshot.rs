//! Fallback from a one-shot CLI backend (issue 17, item 6) through a real `copilot-pool
//! serve`: the real Codex CLI, the real Gemini CLI and the real Copilot runtime (all installed
//! by the test support) against one scripted model on loopback (Codex posts to
//! `/v1/responses`, Gemini CLI to the Gemini API's paths, the runtime's BYOK `openai`
//! provider to `…/chat/completions` under the same base URL). A Codex (or Gemini) conversation
//! runs one turn; its next fails with a retryable class (the model answers 401), and the turn
//! runs again on `copilot`, whose model request must carry the earlier turn in its prelude,
//! read from the CLI's own transcript (Codex's rollout, Gemini CLI's chat file) without what
//! the CLI injected itself.
//!
//! The tests take one lock, so at most one conversation's processes run at a time.

mod support;

use std::time::Duration;

use copilot_pool::scripted_model::{RecordedRequest, Reply};
use serde_json::{Value, json};
use tokio::sync::Mutex;

use copilot_pool::runtime::AgentCli;
use support::agent_cli::{codex_path, path};
use support::cli_daemon::{CliFixture as Fixture, FellBack, streamed_turn, user_text};
use support::http::{Daemon, Sse};

/// One test at a time (each runs its own Codex and runtime processes).
static SERIAL: Mutex<()> = Mutex::const_new(());

/// A failure guard for one whole turn, not a wait.
const TURN_LIMIT: Duration = Duration::from_secs(180);

/// How many model calls answered 401 Codex makes before it fails the turn (a first try and
/// the one retry of the bundled backend's `request_max_retries=1`; measured with Codex
/// 0.171.0: with one 401 queued, the retry got the answer).
const CODEX_401_ATTEMPTS: usize = 2;

/// The model named to both backends (Codex needs one it knows).
const MODEL: &str = "gpt-5.5";

/// The model named to Gemini CLI (so that a turn makes one model call) and the runtime.
const GEMINI_MODEL: &str = "gemini-2.5-pro";

/// How many model calls answered 401 Gemini CLI makes before it fails the turn (the retries
/// the pool's settings bound; measured with Gemini CLI 0.61.0).
const GEMINI_401_ATTEMPTS: usize = 1;

impl Fixture {
    /// The daemon with the bundled `codex-cli` and `google-gemini-cli` and the installed
    /// executables (Gemini CLI's `bundle/gemini.js` runs through its `#!/usr/bin/env node`).
    async fn daemon(&self) -> Daemon {
        let config = format!(
            "drain_grace_secs = 5\n[backends.codex-cli]\ncommand = {:?}\n\
             [backends.google-gemini-cli]\ncommand = {:?}\n",
            codex_path().await.display().to_string(),
            path(AgentCli::Gemini).await.display().to_string(),
        );
        Daemon::start(self.scratch.path(), &config, &[]).await
    }

    /// A turn body on `codex-cli` falling back to `copilot`; one OpenAI provider serves both.
    fn body(&self, session_key: &str, prompt: &str) -> Value {
        json!({
            "agent_id": "agent-x",
            "session_key": session_key,
            "prompt": prompt,
            "backend": "codex-cli",
            "fallback": ["copilot"],
            "model": MODEL,
            "provider": {
                "type": "openai",
                "base_url": format!("http://{}/v1", self.endpoint.addr()),
                "api_key": "sk-FAKE-fallback-key",
            },
        })
    }

    /// A turn body on `google-gemini-cli` falling back to `copilot`: Gemini CLI calls the
    /// Gemini API under the base URL, the runtime `…/chat/completions` under it.
    fn gemini_body(&self, session_key: &str, prompt: &str) -> Value {
        json!({
            "agent_id": "agent-g",
            "session_key": session_key,
            "prompt": prompt,
            "backend": "google-gemini-cli",
            "fallback": ["copilot"],
            "model": GEMINI_MODEL,
            "provider": {
                "type": "openai",
                "base_url": format!("http://{}", self.endpoint.addr()),
                "api_key": "AIza-FAKE-fallback-key",
            },
        })
    }
}

/// Whether a model call came from Gemini CLI (the Gemini API's paths).
fn from_gemini(request: &RecordedRequest) -> bool {
    request.path.contains("/models/")
}

/// Whether a model call came from Codex (its own user agent) rather than the runtime.
fn from_codex(request: &RecordedRequest) -> bool {
    request
        .header("user-agent")
        .iter()
        .any(|ua| ua.to_ascii_lowercase().contains("codex"))
}

/// Runs a streamed turn; its events and its `turn.end`.
async fn turn(daemon: &Daemon, body: &Value) -> (Vec<Sse>, Value) {
    streamed_turn(daemon, body, TURN_LIMIT).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_codex_turn_failing_with_auth_falls_back_to_copilot_with_the_codex_rollout_in_its_prelude()
 {
    let _serial = SERIAL.lock().await;
    let fx = Fixture::new().await;
    let daemon = fx.daemon().await;

    // No `REPLY=` here: the prelude carries this prompt into the fallback's model call,
    // whose answer must come from the fallback's own prompt.
    let (_, first) = turn(&daemon, &fx.body("x1", "remember PELICAN-17")).await;
    assert_eq!(first["status"], "idle", "{first}");
    assert_eq!(first["backend"], "codex-cli", "{first}");
    let answer = first["final_text"].as_str().unwrap_or_default().to_owned();
    assert!(answer.starts_with("scripted reply #"), "{first}");

    for _ in 0..CODEX_401_ATTEMPTS {
        fx.model.push_reply(Reply::Error { status: 401 });
    }
    let before = fx.model.requests().len();
    let started = std::time::Instant::now();
    let (events, end) = turn(&daemon, &fx.body("x1", "REPLY=answered by copilot")).await;
    eprintln!(
        "measured: a failing Codex turn and its Copilot fallback {:?}",
        started.elapsed()
    );
    let names: Vec<&str> = events.iter().map(|e| e.event.as_str()).collect();
    let requests = fx.model.requests();
    assert_eq!(
        requests[before..].iter().filter(|r| from_codex(r)).count(),
        CODEX_401_ATTEMPTS,
        "Codex met every 401 and asked no more: {names:?} {end}"
    );
    let fell_back = FellBack {
        from: "codex-cli",
        to: "copilot",
        class: "auth",
    };
    let notice = fell_back.assert(&events, &end, "answered by copilot");
    assert_eq!(
        notice["status_code"], 401,
        "the status Codex's error names: {notice}"
    );
    assert!(
        notice["prelude_chars"].as_u64().unwrap_or(0) > 0,
        "a prelude from Codex's rollout: {notice}"
    );

    // The runtime's model call: the prelude (the earlier Codex turn, not Codex's injected
    // environment) before the prompt, the prompt once.
    let call = requests[before..]
        .iter()
        .rfind(|r| !from_codex(r) && user_text(r).contains("REPLY=answered by copilot"))
        .unwrap_or_else(|| panic!("no runtime model call for the prompt"));
    let text = user_text(call);
    for carried in [
        "(codex-cli)",
        "user: remember PELICAN-17",
        &format!("assistant: {answer}"),
    ] {
        assert!(
            text.contains(carried),
            "the prelude carries {carried:?}: {text}"
        );
    }
    assert!(
        !text.contains("<environment_context>"),
        "Codex's injected context is not carried: {text}"
    );
    let prelude_at = text.find("PELICAN-17").unwrap_or(usize::MAX);
    let prompt_at = text.rfind("REPLY=answered by copilot").unwrap_or(0);
    assert!(prelude_at < prompt_at, "the prelude comes first: {text}");
    assert_eq!(
        text.matches("REPLY=answered by copilot").count(),
        1,
        "the failed prompt is not carried twice: {text}"
    );
    assert!(daemon.terminate().await.success());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gemini_turn_failing_with_auth_falls_back_to_copilot_with_the_gemini_chat_in_its_prelude()
{
    let _serial = SERIAL.lock().await;
    let fx = Fixture::new().await;
    let daemon = fx.daemon().await;

    let (_, first) = turn(&daemon, &fx.gemini_body("g1", "remember HERON-42")).await;
    assert_eq!(first["status"], "idle", "{first}");
    assert_eq!(first["backend"], "google-gemini-cli", "{first}");
    let answer = first["final_text"].as_str().unwrap_or_default().to_owned();
    assert!(answer.starts_with("scripted reply #"), "{first}");

    for _ in 0..GEMINI_401_ATTEMPTS {
        fx.model.push_reply(Reply::Error { status: 401 });
    }
    let before = fx.model.requests().len();
    let started = std::time::Instant::now();
    let (events, end) = turn(&daemon, &fx.gemini_body("g1", "REPLY=answered by copilot")).await;
    eprintln!(
        "measured: a failing Gemini turn and its Copilot fallback {:?}",
        started.elapsed()
    );
    let names: Vec<&str> = events.iter().map(|e| e.event.as_str()).collect();
    let requests = fx.model.requests();
    assert_eq!(
        requests[before..].iter().filter(|r| from_gemini(r)).count(),
        GEMINI_401_ATTEMPTS,
        "Gemini CLI met every 401 and asked no more: {names:?} {end}"
    );
    let fell_back = FellBack {
        from: "google-gemini-cli",
        to: "copilot",
        class: "auth",
    };
    let notice = fell_back.assert(&events, &end, "answered by copilot");
    assert!(
        notice["prelude_chars"].as_u64().unwrap_or(0) > 0,
        "a prelude from Gemini CLI's chat file: {notice}"
    );

    let call = requests[before..]
        .iter()
        .rfind(|r| !from_gemini(r) && user_text(r).contains("REPLY=answered by copilot"))
        .unwrap_or_else(|| panic!("no runtime model call for the prompt"));
    let text = user_text(call);
    for carried in [
        "(google-gemini-cli)",
        "user: remember HERON-42",
        &format!("assistant: {answer}"),
    ] {
        assert!(
            text.contains(carried),
            "the prelude carries {carried:?}: {text}"
        );
    }
    assert!(
        !text.contains("<session_context>"),
        "Gemini CLI's injected context is not carried: {text}"
    );
    assert_eq!(
        text.matches("REPLY=answered by copilot").count(),
        1,
        "the failed prompt is not carried twice: {text}"
    );
    assert!(daemon.terminate().await.success());
}
