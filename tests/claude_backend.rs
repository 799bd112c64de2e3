//! The `claude-cli` live backend against the real Claude Code CLI (installed from npm by the
//! library's installer) and the crate's scripted model speaking Anthropic messages on
//! loopback: a turn, history across turns, a crash mid-turn and the resume after it, a dead
//! endpoint, the default permission denial (and an approving policy for contrast), the
//! reasoning effort and `bypassPermissions` for an approve-all policy, an interrupt, and the
//! output limit. At most two Claude processes run at once per test.

mod support;

use std::sync::Arc;
use std::time::{Duration, Instant};

use copilot_pool::backend::claude_live::{ClaudeLive, ClaudeLiveConfig};
use copilot_pool::backend::{BackendEvent, CliTurnOutcome, TurnFailure};
use copilot_pool::kinds::ReasoningEffort;
use copilot_pool::permission::{ApproveAll, RejectAll};
use copilot_pool::scripted_model::{Decision, HttpEndpoint, RecordedRequest, ScriptedModel};
use copilot_pool::{Secret, TurnEnd};
use serde_json::Value;
use tempfile::TempDir;

use support::agent_cli::claude_path;
use support::hook_files::PlantedHooks;
use support::procs::wait_group_gone;

/// Upper bound for one whole turn (a failure guard, not a wait).
const TURN_LIMIT: Duration = Duration::from_secs(90);

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

    /// A live backend homed in this fixture's directory, pointed at the scripted model.
    async fn config(&self, name: &str) -> ClaudeLiveConfig {
        let mut config = ClaudeLiveConfig::new(
            claude_path().await,
            self.dir.path().join(name).join("home"),
            self.dir.path().join(name).join("work"),
        );
        config.base_url = Some(format!("http://{}", self.endpoint.addr()));
        config.api_key = Some(Secret::new("sk-ant-FAKE-not-a-real-key"));
        config
    }

    async fn live(&self, name: &str) -> ClaudeLive {
        ClaudeLive::new(self.config(name).await).expect("valid config")
    }

    /// The model call answered with `text`.
    fn call_answered(&self, text: &str) -> RecordedRequest {
        self.model
            .requests()
            .into_iter()
            .filter(|r| r.path.ends_with("/messages"))
            .find(|r| matches!(r.decision(), Some(Decision::Text(t)) if t == text))
            .unwrap_or_else(|| panic!("no model call answered {text:?}"))
    }
}

/// Runs one turn with a guard against hanging, collecting its events.
async fn turn(live: &mut ClaudeLive, prompt: &str) -> (CliTurnOutcome, Vec<BackendEvent>) {
    let mut events = Vec::new();
    let outcome = tokio::time::timeout(TURN_LIMIT, live.run(prompt, |e| events.push(e.clone())))
        .await
        .expect("the turn ended in time")
        .expect("the turn started");
    (outcome, events)
}

/// Every message of a request as `<role>: <text>`, joined (to look for an earlier turn in
/// the history).
fn history_text(request: &RecordedRequest) -> String {
    request
        .messages()
        .iter()
        .map(|m| {
            let text = match &m["content"] {
                Value::String(text) => text.clone(),
                Value::Array(blocks) => blocks
                    .iter()
                    .filter_map(|b| b["text"].as_str())
                    .collect::<Vec<_>>()
                    .join("\n"),
                _ => String::new(),
            };
            format!("{}: {text}", m["role"].as_str().unwrap_or("?"))
        })
        .collect::<Vec<_>>()
        .join("\n")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_turn_returns_the_scripted_text_and_the_next_turn_in_the_same_process_carries_it() {
    let fx = Fixture::new().await;
    let mut live = fx.live("a").await;

    let started = Instant::now();
    let (first, events) = turn(&mut live, "REPLY=pong from the script").await;
    eprintln!(
        "measured: first turn (spawn included) {:?}",
        started.elapsed()
    );
    assert_eq!(first.end, Some(TurnEnd::Idle), "{first:?}");
    assert_eq!(first.text, "pong from the script");
    assert!(first.failure.is_none());
    assert!(
        first.usage.output_tokens > 0,
        "usage is reported: {first:?}"
    );
    let session = first.session_id.clone().expect("a session id");
    assert!(!first.resumed);
    assert!(
        events.iter().any(|e| e.name() == "assistant.message_delta"),
        "deltas stream: {events:?}"
    );
    assert_eq!(events.last().map(BackendEvent::name), Some("turn.end"));
    let pid = live.pid().expect("the process stays up between turns");
    // The key reached the model only as the child's credential.
    let call = fx.call_answered("pong from the script");
    assert_eq!(call.header("x-api-key"), ["sk-ant-FAKE-not-a-real-key"]);

    let started = Instant::now();
    let (second, _) = turn(&mut live, "REPLY=second answer").await;
    eprintln!(
        "measured: second turn (live process) {:?}",
        started.elapsed()
    );
    assert_eq!(second.end, Some(TurnEnd::Idle), "{second:?}");
    assert_eq!(second.text, "second answer");
    assert_eq!(second.session_id.as_deref(), Some(session.as_str()));
    assert_eq!(
        live.pid(),
        Some(pid),
        "the same live process served both turns"
    );
    let call = fx.call_answered("second answer");
    let history = history_text(&call);
    assert!(
        history.contains("REPLY=pong from the script")
            && history.contains("assistant: pong from the script"),
        "the second model call carries the first turn: {history}"
    );

    let exit = live.close().await;
    assert!(exit.is_some());
    assert!(
        wait_group_gone(pid, Duration::from_secs(10))
            .await
            .is_empty()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killing_the_process_mid_turn_ends_the_turn_crashed_at_once_and_the_next_turn_resumes_with_history()
 {
    let fx = Fixture::new().await;
    let mut live = fx.live("crash").await;
    let (first, _) = turn(&mut live, "REPLY=remember the first answer").await;
    assert_eq!(first.end, Some(TurnEnd::Idle), "{first:?}");
    let session = first.session_id.clone().expect("a session id");

    let slow = live
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

    let (after, _) = turn(&mut live, "REPLY=after the crash").await;
    assert_eq!(after.end, Some(TurnEnd::Idle), "{after:?}");
    assert_eq!(after.text, "after the crash");
    assert!(after.resumed, "a new process resumed the stored session");
    assert_eq!(after.session_id.as_deref(), Some(session.as_str()));
    assert_ne!(live.pid(), Some(pid));
    let history = history_text(&fx.call_answered("after the crash"));
    assert!(
        history.contains("REPLY=remember the first answer"),
        "the resumed process sent the earlier turns: {history}"
    );
    live.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_endpoint_fails_the_turn_fast_with_the_clis_error() {
    let fx = Fixture::new().await;
    // Nothing listens there, and no other test can take the port meanwhile.
    let dead = support::refusing_port::RefusingPort::new();
    let mut config = fx.config("dead").await;
    config.base_url = Some(format!("http://127.0.0.1:{}", dead.port()));
    let mut live = ClaudeLive::new(config).expect("valid");
    let started = Instant::now();
    let (outcome, _) = turn(&mut live, "REPLY=never answered").await;
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
        took < Duration::from_secs(20),
        "retries are bounded (CLAUDE_CODE_MAX_RETRIES=1): took {took:?}"
    );
    live.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_model_refusing_the_key_fails_the_turn_with_the_status_claude_reports_in_its_result() {
    let fx = Fixture::new().await;
    // Every model call is refused (Claude retries once: CLAUDE_CODE_MAX_RETRIES=1).
    for _ in 0..4 {
        fx.model
            .push_reply(copilot_pool::scripted_model::Reply::Error { status: 401 });
    }
    let mut live = fx.live("refused").await;
    let (outcome, _) = turn(&mut live, "REPLY=never answered").await;
    assert_eq!(outcome.end, Some(TurnEnd::Error), "{outcome:?}");
    assert!(
        matches!(
            &outcome.failure,
            Some(TurnFailure::Cli {
                status: Some(401),
                ..
            })
        ),
        "the result line's api_error_status: {outcome:?}"
    );
    assert_eq!(copilot_pool::fallback::cli_status_code(&outcome), Some(401));
    live.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tool_permission_request_is_denied_by_default_and_approved_only_by_a_policy_that_says_so()
{
    let fx = Fixture::new().await;
    let prompt = r#"SCENARIO:tool NAME=Bash ARGS={"command":"echo written > out.txt","description":"write a file"}"#;

    let denied_config = fx.config("deny").await;
    let denied_work = denied_config.cwd.clone();
    let mut live = ClaudeLive::new(denied_config).expect("valid");
    let (outcome, events) = turn(&mut live, prompt).await;
    assert_eq!(outcome.end, Some(TurnEnd::Idle), "{outcome:?}");
    let asked: Vec<_> = events
        .iter()
        .filter_map(|e| match e {
            BackendEvent::PermissionRequest {
                tool_name,
                approved,
                ..
            } => Some((tool_name.clone(), *approved)),
            _ => None,
        })
        .collect();
    assert_eq!(asked, [("Bash".to_owned(), false)], "{events:?}");
    assert!(events.iter().any(|e| e.name() == "tool.call"));
    assert_eq!(outcome.permission_prompts, 1);
    assert!(
        outcome.text.starts_with("tool said:")
            && outcome
                .text
                .contains("rejects built-in tool use by default"),
        "the model saw the policy's denial: {}",
        outcome.text
    );
    assert!(
        !denied_work.join("out.txt").exists(),
        "the tool did not run"
    );
    live.close().await;

    let mut approved_config = fx.config("approve").await;
    approved_config.permission = Arc::new(ApproveAll);
    let approved_work = approved_config.cwd.clone();
    let mut live = ClaudeLive::new(approved_config).expect("valid");
    let (outcome, events) = turn(&mut live, prompt).await;
    assert_eq!(outcome.end, Some(TurnEnd::Idle), "{outcome:?}");
    assert!(
        events
            .iter()
            .any(|e| matches!(e, BackendEvent::PermissionRequest { approved: true, .. })),
        "{events:?}"
    );
    let written = std::fs::read_to_string(approved_work.join("out.txt")).expect("the tool ran");
    assert_eq!(written.trim(), "written");
    live.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn project_settings_in_the_working_directory_run_no_hook() {
    let fx = Fixture::new().await;
    let config = fx.config("project").await;
    let work = config.cwd.clone();
    std::fs::create_dir_all(&work).expect("work");
    let hooks = PlantedHooks::plant(&work, fx.dir.path());
    let mut live = ClaudeLive::new(config).expect("valid");
    let prompt = r#"SCENARIO:tool NAME=Bash ARGS={"command":"echo written > out.txt","description":"write a file"}"#;
    let (outcome, events) = turn(&mut live, prompt).await;
    assert_eq!(outcome.end, Some(TurnEnd::Idle), "{outcome:?}");
    assert!(
        events.iter().any(|e| matches!(
            e,
            BackendEvent::PermissionRequest {
                approved: false,
                ..
            }
        )),
        "the pool's policy was asked: {events:?}"
    );
    assert!(!work.join("out.txt").exists(), "the tool did not run");
    // What fails without `--setting-sources user` (seen): the hooks ran. (The allow-all
    // rule did not skip the prompt even then: Claude 2.1.332 asks over stdio regardless, so
    // the two checks above guard the policy, not the setting sources.)
    assert_eq!(hooks.ran(), None, "a hook file's command ran");
    live.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_reasoning_effort_reaches_the_model_and_a_new_effort_restarts_the_process_resuming_the_session()
 {
    let fx = Fixture::new().await;
    let mut config = fx.config("effort").await;
    config.reasoning_effort = Some(ReasoningEffort::High);
    let mut live = ClaudeLive::new(config).expect("valid");
    let (first, _) = turn(&mut live, "REPLY=thinking hard").await;
    assert_eq!(first.end, Some(TurnEnd::Idle), "{first:?}");
    let body = &fx.call_answered("thinking hard").body;
    assert_eq!(body["output_config"]["effort"], "high", "{body}");
    let pid = live.pid().expect("running");

    // Same settings: the process stays.
    assert!(
        !live
            .set_lease_settings(Arc::new(RejectAll::default()), Some(ReasoningEffort::High))
            .await
    );
    assert_eq!(live.pid(), Some(pid));
    // Another effort cannot be applied to a live process: it restarts, resuming.
    assert!(
        live.set_lease_settings(Arc::new(RejectAll::default()), Some(ReasoningEffort::Low))
            .await
    );
    let (second, _) = turn(&mut live, "REPLY=thinking less").await;
    assert_eq!(second.end, Some(TurnEnd::Idle), "{second:?}");
    assert!(second.resumed, "{second:?}");
    assert_ne!(live.pid(), Some(pid));
    let call = fx.call_answered("thinking less");
    assert_eq!(call.body["output_config"]["effort"], "low");
    assert!(
        history_text(&call).contains("assistant: thinking hard"),
        "the session was resumed"
    );
    // Another model (a later lease's, on the kept conversation) restarts it too.
    let pid = live.pid().expect("running");
    live.set_model(Some("claude-sonnet-4-5".to_owned()), None);
    assert!(
        live.set_lease_settings(Arc::new(RejectAll::default()), Some(ReasoningEffort::Low))
            .await
    );
    let (third, _) = turn(&mut live, "REPLY=another model").await;
    assert_eq!(third.end, Some(TurnEnd::Idle), "{third:?}");
    assert!(third.resumed, "{third:?}");
    assert_ne!(live.pid(), Some(pid));
    let call = fx.call_answered("another model");
    assert_eq!(call.body["model"], "claude-sonnet-4-5", "{}", call.body);
    // Another system prompt, where the backend passes it to a session's first start only
    // (the default): a restart would pass nothing, so the process stays.
    live.set_model(
        Some("claude-sonnet-4-5".to_owned()),
        Some("other rules".to_owned()),
    );
    assert!(
        !live
            .set_lease_settings(Arc::new(RejectAll::default()), Some(ReasoningEffort::Low))
            .await
    );
    live.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_approve_all_policy_runs_claude_in_bypass_permissions_mode_without_asking() {
    let fx = Fixture::new().await;
    let prompt = r#"SCENARIO:tool NAME=Bash ARGS={"command":"echo bypassed > out.txt","description":"write a file"}"#;
    let mut config = fx.config("bypass").await;
    config.permission = Arc::new(ApproveAll);
    // Claude refuses bypassPermissions as root unless it is told it runs sandboxed.
    config
        .backend
        .env
        .insert("IS_SANDBOX".to_owned(), "1".to_owned());
    let work = config.cwd.clone();
    let mut live = ClaudeLive::new(config).expect("valid");
    let (outcome, events) = turn(&mut live, prompt).await;
    assert_eq!(outcome.end, Some(TurnEnd::Idle), "{outcome:?}");
    assert_eq!(outcome.permission_prompts, 0, "{events:?}");
    assert!(
        !events
            .iter()
            .any(|e| matches!(e, BackendEvent::PermissionRequest { .. })),
        "{events:?}"
    );
    let written = std::fs::read_to_string(work.join("out.txt")).expect("the tool ran");
    assert_eq!(written.trim(), "bypassed");
    live.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_interrupt_ends_the_turn_aborted_and_the_same_process_takes_the_next_turn() {
    let fx = Fixture::new().await;
    let mut live = fx.live("interrupt").await;
    let mut slow = live
        .start_turn("SCENARIO:slow SLOW=60x250")
        .await
        .expect("started");
    let pid = slow.pid().expect("running");
    let abort = slow.abort_handle();
    // Interrupt once the first delta arrived: the turn is mid-stream (60 chunks, 15 s).
    let mut aborted_at = None;
    let outcome = tokio::time::timeout(TURN_LIMIT, async {
        while let Some(event) = slow.next().await {
            match event {
                BackendEvent::MessageDelta { .. } if aborted_at.is_none() => {
                    aborted_at = Some(Instant::now());
                    abort.abort();
                }
                BackendEvent::TurnEnd(outcome) => return outcome,
                _ => {}
            }
        }
        panic!("the turn ended without turn.end");
    })
    .await
    .expect("ended in time");
    let took = aborted_at.expect("a delta came").elapsed();
    eprintln!("measured: interrupt to turn.end {took:?}");
    drop(slow);
    assert_eq!(outcome.end, Some(TurnEnd::Aborted), "{outcome:?}");
    assert!(
        took < Duration::from_secs(4),
        "Claude honoured the interrupt (the slow answer had 15 s to go): {took:?}"
    );

    let (next, _) = turn(&mut live, "REPLY=still here").await;
    assert_eq!(next.end, Some(TurnEnd::Idle), "{next:?}");
    assert_eq!(next.text, "still here");
    assert_eq!(live.pid(), Some(pid), "the interrupt kept the process");
    live.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn envelopes_do_not_count_and_output_past_the_turn_limit_ends_the_turn_with_a_typed_error_and_stops_the_process()
 {
    let fx = Fixture::new().await;
    let mut config = fx.config("limit").await;
    // Retained output only: the init, the result and the control lines are envelopes.
    config.backend.output_limits.max_turn_lines = 1;
    let mut live = ClaudeLive::new(config).expect("valid");
    let (fits, _) = turn(&mut live, "REPLY=fits").await;
    assert_eq!(fits.end, Some(TurnEnd::Idle), "{fits:?}");
    assert_eq!(fits.text, "fits");
    assert_eq!(
        fits.retained_lines, 1,
        "only the assistant message: {fits:?}"
    );

    // A tool call retains its request and its result: the second line passes the limit.
    let prompt = r#"SCENARIO:tool NAME=Bash ARGS={"command":"echo hi","description":"say hi"}"#;
    let started = live.start_turn(prompt).await.expect("started");
    let pid = started.pid().expect("running");
    let outcome = tokio::time::timeout(TURN_LIMIT, started.finish())
        .await
        .expect("ended");
    support::output_limit::assert_past_line_limit(&outcome, 1, 2, pid).await;
}
