//! The bundled `google-gemini-cli` backend on the process-per-turn runner
//! (`backend::oneshot::Oneshot`, `Dialect::Gemini`) against the real Gemini CLI 0.61.0
//! (installed from npm by the library's installer; its `bundle/gemini.js` starts with
//! `#!/usr/bin/env node`) and the crate's scripted model speaking the Gemini API on
//! loopback: a turn (through the model router) and a resume by a new runner that carries the
//! first turn to the model, a tool call of the CLI's own `read_file`, a kill mid-turn ending
//! the turn `crashed` at once and the next turn resuming, an error answer tried once, a dead
//! endpoint failing within seconds of the CLI's start-up, an unknown resume id, and the
//! output limit keeping the answer that had streamed. The bundled backend runs
//! `--output-format stream-json`: the answer streams as `assistant.message_delta`s and the
//! CLI's tool calls as `tool.call`s while the process runs.
//!
//! The runner writes the settings (`backend::gemini::write_settings`) and puts the key and
//! endpoint in the child's environment; these tests only give it a home, a working
//! directory, the endpoint and the key. At most two Gemini processes run at once.

mod support;

use std::path::PathBuf;
use std::time::{Duration, Instant};

use copilot_pool::backend::gemini::{self, GeminiError};
use copilot_pool::backend::oneshot::{Dialect, Oneshot, OneshotConfig, StoredSession};
use copilot_pool::backend::{BackendEvent, CliTurnOutcome, TurnFailure};
use copilot_pool::process::{ChildGroup, ChildSpec};
use copilot_pool::scripted_model::{Decision, HttpEndpoint, RecordedRequest, Reply, ScriptedModel};
use copilot_pool::{Secret, TurnEnd};
use serde_json::Value;
use tempfile::TempDir;
use tokio::io::AsyncReadExt;
use tokio::sync::{Semaphore, SemaphorePermit};

use support::agent_cli::{gemini_launch, path};
use support::hook_files::PlantedHooks;
use support::procs::wait_group_gone;

/// Upper bound for one whole turn (a failure guard, not a wait): node boots a 96 MB bundle,
/// slowly on a loaded machine.
const TURN_LIMIT: Duration = Duration::from_secs(180);

/// The model the runs name (`--model`), so that a turn makes one model call.
const MODEL: &str = "gemini-2.5-pro";

/// The fake key the CLI gets, only in its environment.
const KEY: &str = "AIza-FAKE-not-a-real-key";

/// At most two Gemini processes at once, whatever the test threads.
static SLOTS: Semaphore = Semaphore::const_new(2);

struct Fixture {
    model: ScriptedModel,
    endpoint: HttpEndpoint,
    dir: TempDir,
}

impl Fixture {
    async fn new() -> Self {
        let model = ScriptedModel::new();
        let endpoint = model.serve_http().await.expect("scripted model");
        Self {
            model,
            endpoint,
            dir: tempfile::tempdir().expect("tempdir"),
        }
    }

    fn base_url(&self) -> String {
        format!("http://{}", self.endpoint.addr())
    }

    fn home(&self, agent: &str) -> PathBuf {
        self.dir.path().join(agent).join("home")
    }

    fn cwd(&self, agent: &str) -> PathBuf {
        self.dir.path().join(agent).join("work")
    }

    /// The bundled backend for `agent` (its own home and working directory), pointed at
    /// the scripted model, naming `MODEL`.
    async fn config(&self, agent: &str) -> OneshotConfig {
        let script = path(copilot_pool::runtime::AgentCli::Gemini).await;
        let mut config = OneshotConfig::gemini(script, self.home(agent), self.cwd(agent));
        config.base_url = Some(self.base_url());
        config.api_key = Some(Secret::new(KEY));
        config.model = Some(MODEL.to_owned());
        config.turn_timeout = TURN_LIMIT;
        config
    }

    async fn oneshot(&self, agent: &str) -> Oneshot {
        Oneshot::new(self.config(agent).await).expect("valid config")
    }

    /// The conversation calls (`streamGenerateContent`) the model received, oldest first.
    fn turn_calls(&self) -> Vec<RecordedRequest> {
        self.model
            .requests()
            .into_iter()
            .filter(|r| r.path.ends_with(":streamGenerateContent"))
            .collect()
    }
}

/// Runs one turn (holding a process slot) with a guard against hanging.
async fn turn(
    oneshot: &mut Oneshot,
    prompt: &str,
) -> (CliTurnOutcome, Vec<BackendEvent>, Duration) {
    let _slot = slot().await;
    let started = Instant::now();
    let mut events = Vec::new();
    let outcome = tokio::time::timeout(TURN_LIMIT, oneshot.run(prompt, |e| events.push(e.clone())))
        .await
        .expect("the turn ended in time")
        .expect("the turn started");
    (outcome, events, started.elapsed())
}

/// The assistant text the turn's deltas add up to.
fn deltas(events: &[BackendEvent]) -> String {
    events
        .iter()
        .filter_map(|e| match e {
            BackendEvent::MessageDelta { delta } => Some(delta.as_str()),
            _ => None,
        })
        .collect()
}

async fn slot() -> SemaphorePermit<'static> {
    SLOTS.acquire().await.expect("slots")
}

/// Every content of a Gemini request as `<role>: <text parts>`, joined (to look for an
/// earlier turn in the history).
fn history_text(request: &RecordedRequest) -> String {
    request.body["contents"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|c| {
            let text = c["parts"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|p| p["text"].as_str())
                .collect::<Vec<_>>()
                .join("\n");
            format!("{}: {text}", c["role"].as_str().unwrap_or("user"))
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// How long `gemini --version` takes here now: the CLI's own start-up (a loaded machine
/// stretches it a lot), to bound the dead-endpoint turn by.
async fn start_up(fx: &Fixture) -> Duration {
    let _slot = slot().await;
    let launch = gemini_launch().await;
    let mut args = launch.args.clone();
    args.push("--version".into());
    let home = fx.home("version");
    std::fs::create_dir_all(&home).expect("home");
    let spec = ChildSpec {
        program: launch.program,
        args,
        env: vec![
            ("HOME".into(), home.clone().into()),
            ("PATH".into(), std::env::var_os("PATH").unwrap_or_default()),
            ("GEMINI_CLI_NO_RELAUNCH".into(), "true".into()),
        ],
        cwd: home,
    };
    let started = Instant::now();
    let (child, io) = ChildGroup::spawn(&spec).expect("spawn gemini --version");
    drop(io.stdin);
    let mut stdout = io.stdout;
    let mut out = Vec::new();
    tokio::time::timeout(TURN_LIMIT, async {
        let _ = stdout.read_to_end(&mut out).await;
        child.wait().await
    })
    .await
    .expect("--version ends");
    started.elapsed()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_turn_returns_the_scripted_text_and_usage_and_a_new_runner_resumes_carrying_the_first_turn()
 {
    let fx = Fixture::new().await;

    // No model named: the CLI's router asks first (JSON mode), then the chosen model.
    let mut config = fx.config("a").await;
    config.model = None;
    let mut gemini = Oneshot::new(config).expect("valid");
    let (first, events, took) = turn(&mut gemini, "REPLY=pong from gemini").await;
    eprintln!("measured: first turn, router included, spawn to exit {took:?}");
    assert_eq!(first.end, Some(TurnEnd::Idle), "{first:?}");
    assert_eq!(first.text, "pong from gemini");
    assert!(!first.resumed);
    // `--output-format stream-json`: the answer streams as it arrives, one delta a chunk
    // (the scripted model sends a word a chunk), then the whole message, then the end.
    let names: Vec<&str> = events.iter().map(BackendEvent::name).collect();
    assert_eq!(
        names,
        [
            "assistant.message_delta",
            "assistant.message_delta",
            "assistant.message_delta",
            "assistant.message",
            "turn.end"
        ],
        "{events:?}"
    );
    assert_eq!(deltas(&events), "pong from gemini");
    let session = first.session_id.clone().expect("a session id");
    let per_call = ScriptedModel::PROMPT_TOKENS - ScriptedModel::CACHED_PROMPT_TOKENS;
    assert_eq!(
        first.usage.input_tokens,
        2 * per_call,
        "the router call and the turn: {first:?}"
    );
    assert_eq!(
        first.usage.cache_read_tokens,
        2 * ScriptedModel::CACHED_PROMPT_TOKENS
    );
    assert_eq!(
        first.usage.output_tokens,
        2 * ScriptedModel::COMPLETION_TOKENS
    );
    let router = fx
        .model
        .requests()
        .into_iter()
        .find(|r| r.path.ends_with(":generateContent"))
        .expect("the router call");
    let Some(Decision::Text(routed)) = router.decision() else {
        panic!("the router call was answered with text: {router:?}");
    };
    let routed: Value = serde_json::from_str(routed).expect("a JSON answer");
    assert!((1..=100).contains(&routed["complexity_score"].as_i64().unwrap_or(0)));
    let call = fx.turn_calls().pop().expect("the turn's call");
    assert_eq!(
        call.header("x-goog-api-key"),
        [KEY],
        "the key reached the model"
    );
    // The runner wrote the settings into the agent's home.
    let settings = std::fs::read_to_string(gemini::settings_path(&fx.home("a"))).expect("settings");
    assert!(settings.contains("gemini-api-key"), "{settings}");

    // The CLI's transcript is where the pool looks before a resume.
    let transcript = Dialect::Gemini
        .transcript(&fx.home("a"), &fx.cwd("a"), &session)
        .expect("gemini has transcripts")
        .expect("a transcript");
    assert!(transcript.starts_with(fx.home("a").join(".gemini/tmp")));

    // A new runner (the pool restarted) with the stored session, naming the model: one
    // call, and it carries the first turn.
    let mut config = fx.config("a").await;
    config.session = Some(StoredSession::new(session.clone()));
    let mut resumed = Oneshot::new(config).expect("valid");
    let before = fx.model.requests().len();
    let (second, _, took) = turn(&mut resumed, "REPLY=second answer").await;
    eprintln!("measured: resumed turn, one model call, spawn to exit {took:?}");
    assert_eq!(second.end, Some(TurnEnd::Idle), "{second:?}");
    assert_eq!(second.text, "second answer");
    assert!(second.resumed);
    assert_eq!(second.session_id.as_deref(), Some(session.as_str()));
    assert_eq!(second.usage.input_tokens, per_call, "usage is per turn");
    let calls = fx.model.requests().split_off(before);
    assert_eq!(calls.len(), 1, "--model skips the router: {calls:?}");
    assert!(
        calls[0]
            .path
            .ends_with(&format!("/models/{MODEL}:streamGenerateContent"))
    );
    let history = history_text(&calls[0]);
    assert!(
        history.contains("REPLY=pong from gemini")
            && history.contains("model: pong from gemini")
            && history.contains("REPLY=second answer"),
        "the resumed call carries the first turn: {history}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tool_call_of_the_clis_own_read_file_reaches_the_model_and_is_counted() {
    let fx = Fixture::new().await;
    std::fs::create_dir_all(fx.cwd("tool")).expect("work dir");
    std::fs::write(fx.cwd("tool").join("note.txt"), "the note says 42\n").expect("note");
    let mut gemini = fx.oneshot("tool").await;
    let (outcome, events, _) = turn(
        &mut gemini,
        r#"SCENARIO:tool NAME=read_file ARGS={"file_path":"note.txt"}"#,
    )
    .await;
    assert_eq!(outcome.end, Some(TurnEnd::Idle), "{outcome:?}");
    assert_eq!(outcome.tool_calls, 1, "{outcome:?}");
    // The call streams as `tool.call` when the CLI makes it, before the answer's deltas.
    let calls: Vec<(usize, &str, &Value)> = events
        .iter()
        .enumerate()
        .filter_map(|(at, e)| match e {
            BackendEvent::ToolCall { name, input, id } => {
                assert!(!id.is_empty(), "{e:?}");
                Some((at, name.as_str(), input))
            }
            _ => None,
        })
        .collect();
    assert_eq!(calls.len(), 1, "{events:?}");
    let (at, name, input) = calls[0];
    assert_eq!(name, "read_file");
    assert_eq!(input["file_path"], "note.txt");
    let first_delta = events
        .iter()
        .position(|e| matches!(e, BackendEvent::MessageDelta { .. }))
        .expect("the answer streamed");
    assert!(at < first_delta, "{events:?}");
    assert_eq!(deltas(&events), outcome.text);
    assert!(
        outcome.usage.input_tokens > 0 && outcome.usage.output_tokens > 0,
        "{outcome:?}"
    );
    assert!(
        outcome.text.starts_with("tool said:") && outcome.text.contains("the note says 42"),
        "the model saw the file: {}",
        outcome.text
    );
    let calls = fx.turn_calls();
    assert_eq!(calls.len(), 2, "the call and the answer to its result");
    assert!(
        matches!(calls[0].decision(), Some(Decision::ToolCall { name, .. }) if name == "read_file")
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killing_the_process_mid_turn_ends_it_crashed_at_once_and_the_next_turn_resumes() {
    let fx = Fixture::new().await;
    let mut gemini = fx.oneshot("crash").await;
    let (first, _, _) = turn(&mut gemini, "REPLY=remember the first answer").await;
    assert_eq!(first.end, Some(TurnEnd::Idle), "{first:?}");
    let session = first.session_id.clone().expect("a session id");

    // The slow answer is queued rather than asked for in the prompt: Gemini CLI keeps the
    // interrupted prompt in its transcript and sends it with the next one in the same user
    // content, where a `SCENARIO:` directive would be obeyed again.
    fx.model.push_reply(Reply::Slow {
        chunks: 60,
        interval: Duration::from_millis(250),
    });
    let slot = slot().await;
    let slow = gemini
        .start_turn("a question the crash interrupts")
        .await
        .expect("started");
    let pid = slow.pid().expect("running");
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
    drop(slot);
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

    let (after, _, _) = turn(&mut gemini, "REPLY=after the crash").await;
    assert_eq!(after.end, Some(TurnEnd::Idle), "{after:?}");
    assert_eq!(after.text, "after the crash");
    assert!(after.resumed, "the next process resumed the stored session");
    assert_eq!(after.session_id.as_deref(), Some(session.as_str()));
    let call = fx.turn_calls().pop().expect("the last call");
    let history = history_text(&call);
    assert!(
        history.contains("REPLY=remember the first answer"),
        "the resumed run sent the earlier turn: {history}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_error_answer_is_tried_once_and_fails_the_turn_with_its_status() {
    let fx = Fixture::new().await;
    let mut gemini = fx.oneshot("error").await;
    let (outcome, _, took) = turn(&mut gemini, "SCENARIO:error STATUS=503").await;
    eprintln!("measured: 503 answer to turn.end {took:?}");
    assert_eq!(outcome.end, Some(TurnEnd::Error), "{outcome:?}");
    assert!(
        matches!(&outcome.failure, Some(TurnFailure::Gemini { error: GeminiError::Failed { code: Some(503), message, .. } }) if message == "scripted upstream failure"),
        "{outcome:?}"
    );
    assert_eq!(
        fx.model.requests().len(),
        1,
        "one attempt (`general.maxAttempts = 1`), no retries: {:?}",
        fx.model.requests()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn workspace_settings_in_the_working_directory_neither_run_commands_nor_allow_the_shell() {
    let fx = Fixture::new().await;
    std::fs::create_dir_all(fx.cwd("planted")).expect("work dir");
    let planted = PlantedHooks::plant_gemini(&fx.cwd("planted"), fx.dir.path());
    let mut gemini = fx.oneshot("planted").await;
    let (outcome, _, _) = turn(
        &mut gemini,
        r#"SCENARIO:tool NAME=run_shell_command ARGS={"command":"touch shell-ran"}"#,
    )
    .await;
    assert_eq!(outcome.end, Some(TurnEnd::Idle), "{outcome:?}");
    assert!(
        !fx.cwd("planted").join("shell-ran").exists(),
        "the shell ran without asking"
    );
    assert_eq!(
        planted.ran(),
        None,
        "a command of the workspace's settings ran"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_workspace_is_trusted_by_the_homes_settings_when_the_env_does_not_trust_it() {
    let fx = Fixture::new().await;
    let mut config = fx.config("trust").await;
    // Names the variable, so the runner leaves it: neither "true" nor "false", the CLI
    // falls through to its folder-trust setting, which the pool turned off.
    config
        .backend
        .env
        .insert("GEMINI_CLI_TRUST_WORKSPACE".to_owned(), String::new());
    let mut gemini = Oneshot::new(config).expect("valid");
    let (outcome, _, _) = turn(&mut gemini, "REPLY=trusted by settings").await;
    assert_eq!(outcome.end, Some(TurnEnd::Idle), "not exit 55: {outcome:?}");
    assert_eq!(outcome.text, "trusted by settings");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_endpoint_fails_the_turn_within_seconds_of_the_clis_start_up() {
    let fx = Fixture::new().await;
    let start_up = start_up(&fx).await;
    // Nothing listens. Unbounded, the CLI retries for minutes; bounded (one attempt, no
    // retry of fetch errors) it gives up at the first failed fetch.
    let mut config = fx.config("dead").await;
    let dead = support::refusing_port::RefusingPort::new();
    config.base_url = Some(format!("http://127.0.0.1:{}", dead.port()));
    let mut gemini = Oneshot::new(config).expect("valid");
    let (outcome, _, took) = turn(&mut gemini, "REPLY=never answered").await;
    eprintln!("measured: dead endpoint to turn.end {took:?} (--version: {start_up:?})");
    assert_eq!(outcome.end, Some(TurnEnd::Error), "{outcome:?}");
    assert!(
        matches!(
            &outcome.failure,
            Some(TurnFailure::Gemini {
                error: GeminiError::Failed { .. }
            })
        ),
        "{outcome:?}"
    );
    assert!(
        took < start_up + Duration::from_secs(10),
        "a dead endpoint kept the CLI {took:?} (start-up {start_up:?})"
    );
    assert!(fx.model.requests().is_empty());
}

/// The chat files of `session` in the project's `chats` folder (`session-*-<id8>.jsonl`).
fn chat_files(transcript: &std::path::Path, session: &str) -> Vec<PathBuf> {
    let suffix = format!("-{}.jsonl", &session[..8]);
    let folder = transcript.parent().expect("the chats folder");
    let mut files: Vec<PathBuf> = std::fs::read_dir(folder)
        .expect("the chats folder")
        .filter_map(Result::ok)
        .map(|e| e.path())
        .filter(|p| p.to_string_lossy().ends_with(&suffix))
        .collect();
    files.sort();
    files
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_conversation_resumed_in_another_minute_survives_the_next_conversations_run_and_resumes()
{
    let fx = Fixture::new().await;
    let mut first = fx.oneshot("minute").await;
    let (one, _, _) = turn(&mut first, "REPLY=pong one").await;
    assert_eq!(one.end, Some(TurnEnd::Idle), "{one:?}");
    let session = one.session_id.clone().expect("a session id");
    let transcript = Dialect::Gemini
        .transcript(&fx.home("minute"), &fx.cwd("minute"), &session)
        .expect("gemini has transcripts")
        .expect("a transcript");

    // The CLI names a chat file after the minute its run starts. A conversation started in
    // an earlier minute than its resume (here for sure: the file is renamed back in time)
    // gets a second file from the resume, holding only the session's header, while the
    // conversation goes on in the first.
    let earlier =
        transcript.with_file_name(format!("session-2000-01-01T00-00-{}.jsonl", &session[..8]));
    std::fs::rename(&transcript, &earlier).expect("rename the chat file");
    let mut config = fx.config("minute").await;
    config.session = Some(StoredSession::new(session.clone()));
    let mut resumed = Oneshot::new(config).expect("valid");
    let (two, _, _) = turn(&mut resumed, "REPLY=pong two").await;
    assert_eq!(two.end, Some(TurnEnd::Idle), "{two:?}");
    assert!(two.resumed);
    let files = chat_files(&earlier, &session);
    assert_eq!(
        files.len(),
        2,
        "the resume in another minute left a second file: {files:?}"
    );

    // Another conversation's run in the same project. Gemini CLI's session clean-up (on by
    // default) took the second file for corrupt and deleted every file of the session:
    // the pool's settings turn it off.
    let mut other = fx.oneshot("minute").await;
    let (three, _, _) = turn(&mut other, "REPLY=pong three").await;
    assert_eq!(three.end, Some(TurnEnd::Idle), "{three:?}");
    assert_ne!(three.session_id.as_deref(), Some(session.as_str()));
    assert_eq!(
        chat_files(&earlier, &session),
        files,
        "the first conversation's chat files are kept"
    );
    assert_eq!(
        Dialect::Gemini.transcript(&fx.home("minute"), &fx.cwd("minute"), &session),
        Some(Ok(earlier))
    );

    // And it resumes, carrying both of its turns.
    let mut config = fx.config("minute").await;
    config.session = Some(StoredSession::new(session.clone()));
    let mut resumed = Oneshot::new(config).expect("valid");
    let before = fx.turn_calls().len();
    let (four, _, _) = turn(&mut resumed, "REPLY=pong four").await;
    assert_eq!(four.end, Some(TurnEnd::Idle), "{four:?}");
    assert_eq!(four.session_id.as_deref(), Some(session.as_str()));
    let call = fx.turn_calls().split_off(before).pop().expect("the call");
    let history = history_text(&call);
    assert!(
        history.contains("REPLY=pong one")
            && history.contains("REPLY=pong two")
            && !history.contains("REPLY=pong three"),
        "{history}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unknown_resume_id_has_no_transcript_and_the_cli_refuses_it_with_the_typed_error() {
    let fx = Fixture::new().await;
    let unknown = "00000000-1111-2222-3333-444444444444";
    assert!(
        matches!(
            Dialect::Gemini.transcript(&fx.home("stale"), &fx.cwd("stale"), unknown),
            Some(Err(_))
        ),
        "no transcript"
    );
    // What the CLI itself says when asked anyway (the pool never asks: it answers
    // transcript-missing first).
    let mut config = fx.config("stale").await;
    config.session = Some(StoredSession::new(unknown));
    let mut gemini = Oneshot::new(config).expect("valid");
    let (outcome, _, _) = turn(&mut gemini, "REPLY=not reached").await;
    assert_eq!(outcome.end, Some(TurnEnd::Error), "{outcome:?}");
    let Some(TurnFailure::Gemini {
        error: GeminiError::ResumeNotFound { message },
    }) = &outcome.failure
    else {
        panic!("{outcome:?}");
    };
    assert!(message.contains("Error resuming session"), "{message}");
    assert!(
        fx.model.requests().is_empty(),
        "no model call was made: {:?}",
        fx.model.requests()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn output_past_the_line_limit_ends_the_turn_with_a_typed_error_keeping_the_answer_streamed() {
    let fx = Fixture::new().await;
    let mut config = fx.config("limit").await;
    // The answer streams a word a line; `init` and the prompt's echo are envelopes, not
    // counted. The fourth word passes the limit: the three before it are kept.
    config.backend.output_limits.max_turn_lines = 3;
    let mut gemini = Oneshot::new(config).expect("valid");
    let _slot = slot().await;
    let started = gemini
        .start_turn("REPLY=kept as streamed but never finished")
        .await
        .expect("started");
    let pid = started.pid().expect("running");
    let outcome = tokio::time::timeout(TURN_LIMIT, started.finish())
        .await
        .expect("ended");
    support::output_limit::assert_past_line_limit(&outcome, 3, 4, pid).await;
    assert_eq!(
        outcome.text, "kept as streamed",
        "the answer that had streamed is kept"
    );
    assert!(outcome.session_id.is_some(), "{outcome:?}");
}
