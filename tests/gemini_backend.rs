//! The bundled `google-gemini-cli` backend against the real Gemini CLI 0.61.0 (installed from
//! npm by the library's installer, run with `node`) and the crate's scripted model speaking
//! the Gemini API on loopback: a turn (with and without the model router), a resume that
//! carries the first turn to the model, a tool call of the CLI's own `read_file`, an error
//! answer tried once, a dead endpoint failing within seconds of the CLI's start-up, and an
//! unknown resume id.
//!
//! Until the process-per-turn runner lands, each run is spawned here directly with the
//! bundled configuration's argv and environment, the settings `backend::gemini` writes and
//! `process::ChildGroup` (own process group, reaped, killed on drop); its output is read by
//! `backend::gemini::parse_output`. At most two Gemini processes run at once.

mod support;

use std::ffi::OsString;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use copilot_pool::backend::CliBackendConfig;
use copilot_pool::backend::gemini::{self, GeminiError, GeminiReply};
use copilot_pool::process::{ChildGroup, ChildSpec, ExitInfo};
use copilot_pool::scripted_model::{Decision, HttpEndpoint, RecordedRequest, ScriptedModel};
use serde_json::Value;
use tempfile::TempDir;
use tokio::io::AsyncReadExt;
use tokio::sync::Semaphore;

use support::agent_cli::gemini_launch;
use support::procs::wait_group_gone;

/// Upper bound for one whole run (a failure guard, not a wait): node boots a 96 MB bundle,
/// slowly on a loaded machine.
const RUN_LIMIT: Duration = Duration::from_secs(180);

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

/// One finished run of the CLI.
struct Run {
    exit: ExitInfo,
    stdout: String,
    stderr: String,
    took: Duration,
}

impl Run {
    fn parsed(&self) -> Result<GeminiReply, GeminiError> {
        gemini::parse_output(self.exit, &self.stdout, &self.stderr)
    }

    fn reply(&self) -> GeminiReply {
        self.parsed().unwrap_or_else(|err| {
            panic!(
                "the run failed: {err}\nstdout: {}\nstderr: {}",
                self.stdout, self.stderr
            )
        })
    }
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

    /// Runs the bundled backend once for `agent` (its own home and working directory):
    /// fresh, or resuming `session`; `model` through `modelArg`; the endpoint at `base_url`.
    async fn run(
        &self,
        agent: &str,
        prompt: &str,
        session: Option<&str>,
        model: Option<&str>,
        base_url: &str,
    ) -> Run {
        let spec = self.spec(agent, prompt, session, model, base_url).await;
        spawn_run(&spec, RUN_LIMIT)
            .await
            .unwrap_or_else(|stderr| panic!("gemini ran past {RUN_LIMIT:?}: {stderr}"))
    }

    /// The bundled backend's child for one run (settings written, directories made).
    async fn spec(
        &self,
        agent: &str,
        prompt: &str,
        session: Option<&str>,
        model: Option<&str>,
        base_url: &str,
    ) -> ChildSpec {
        let config = CliBackendConfig::google_gemini_cli();
        config
            .validate(gemini::BACKEND_ID)
            .expect("bundled is valid");
        let (home, cwd) = (self.home(agent), self.cwd(agent));
        let tmp = home.join("tmp");
        for dir in [&home, &cwd, &tmp] {
            std::fs::create_dir_all(dir).expect("scratch dirs");
        }
        gemini::write_settings(&home).expect("settings");

        let launch = gemini_launch().await;
        let mut args = launch.args.clone();
        args.extend(
            config
                .argv(session, model)
                .into_iter()
                .map(|a| OsString::from(a.replace("{prompt}", prompt))),
        );
        let mut env: Vec<(OsString, OsString)> = vec![
            ("HOME".into(), home.clone().into()),
            ("TMPDIR".into(), tmp.into()),
        ];
        if let Some(path) = std::env::var_os("PATH") {
            env.push(("PATH".into(), path));
        }
        env.extend(config.env.iter().map(|(k, v)| (k.into(), v.into())));
        let url_var = config.base_url_env.clone().expect("baseUrlEnv");
        let key_var = config.api_key_env.clone().expect("apiKeyEnv");
        env.push((url_var.into(), base_url.into()));
        env.push((key_var.into(), KEY.into()));
        ChildSpec {
            program: launch.program,
            args,
            env,
            cwd,
        }
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

/// Spawns `spec` in its own process group with stdin closed (`--prompt` appends piped stdin
/// to the prompt) and collects it. Past `limit` the group is killed and the end of its
/// stderr returned instead. Either way the group is gone afterwards.
async fn spawn_run(spec: &ChildSpec, limit: Duration) -> Result<Run, String> {
    let _slot = SLOTS.acquire().await.expect("slots");
    let started = Instant::now();
    let (child, io) = ChildGroup::spawn(spec).expect("spawn gemini");
    drop(io.stdin);
    let mut stdout = io.stdout;
    let mut out = Vec::new();
    let exit = tokio::time::timeout(limit, async {
        let _ = stdout.read_to_end(&mut out).await;
        child.wait().await
    })
    .await;
    let took = started.elapsed();
    let pid = child.pid();
    if exit.is_ok() {
        child.stderr().settled(Duration::from_secs(2)).await;
    }
    let stderr = child.stderr().text();
    // Dropping the group kills whatever is left of it.
    drop(child);
    assert!(
        wait_group_gone(pid, Duration::from_secs(10))
            .await
            .is_empty(),
        "the run's process group is gone"
    );
    let exit = exit.map_err(|_| stderr.clone())?;
    Ok(Run {
        exit,
        stdout: String::from_utf8_lossy(&out).into_owned(),
        stderr,
        took,
    })
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

/// A port on which nothing listens (it was free a moment ago).
fn dead_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_turn_returns_the_scripted_text_and_usage_and_a_resume_carries_the_first_turn_to_the_model()
 {
    let fx = Fixture::new().await;

    // No model named: the CLI's router asks first (JSON mode), then the chosen model.
    let first = fx
        .run("a", "REPLY=pong from gemini", None, None, &fx.base_url())
        .await;
    eprintln!("measured: first turn, router included, {:?}", first.took);
    let reply = first.reply();
    assert_eq!(reply.text, "pong from gemini");
    let session = reply.session_id.clone().expect("a session id");
    assert_eq!(
        reply.model_calls, 2,
        "the router call and the turn: {reply:?}"
    );
    let per_call = ScriptedModel::PROMPT_TOKENS - ScriptedModel::CACHED_PROMPT_TOKENS;
    assert_eq!(reply.usage.input_tokens, 2 * per_call, "{reply:?}");
    assert_eq!(
        reply.usage.cache_read_tokens,
        2 * ScriptedModel::CACHED_PROMPT_TOKENS
    );
    assert_eq!(
        reply.usage.output_tokens,
        2 * ScriptedModel::COMPLETION_TOKENS
    );
    let requests = fx.model.requests();
    let router = requests
        .iter()
        .find(|r| r.path.ends_with(":generateContent"))
        .expect("the router call");
    let Some(Decision::Text(routed)) = router.decision() else {
        panic!("the router call was answered with text: {router:?}");
    };
    let routed: Value = serde_json::from_str(routed).expect("a JSON answer");
    let score = routed["complexity_score"].as_i64().expect("a score");
    assert!((1..=100).contains(&score), "{routed}");
    let call = fx.turn_calls().pop().expect("the turn's call");
    assert_eq!(call.query.as_deref(), Some("alt=sse"));
    assert_eq!(
        call.header("x-goog-api-key"),
        [KEY],
        "the key reached the model"
    );

    // The CLI's transcript is where a resume looks for it.
    let transcript =
        gemini::transcript_path(&fx.home("a"), &fx.cwd("a"), &session).expect("a transcript");
    assert!(transcript.starts_with(fx.home("a").join(".gemini/tmp")));

    // The resume, naming the model: one call, and it carries the first turn.
    let before = fx.model.requests().len();
    let second = fx
        .run(
            "a",
            "REPLY=second answer",
            Some(&session),
            Some(MODEL),
            &fx.base_url(),
        )
        .await;
    eprintln!("measured: resumed turn, one model call, {:?}", second.took);
    let reply = second.reply();
    assert_eq!(reply.text, "second answer");
    assert_eq!(reply.session_id.as_deref(), Some(session.as_str()));
    assert_eq!(reply.model_calls, 1, "--model skips the router: {reply:?}");
    assert_eq!(reply.usage.input_tokens, per_call);
    let calls = fx.model.requests().split_off(before);
    assert_eq!(calls.len(), 1, "{calls:?}");
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
async fn a_tool_call_of_the_clis_own_read_file_reaches_the_model_as_a_function_response() {
    let fx = Fixture::new().await;
    std::fs::create_dir_all(fx.cwd("tool")).expect("work dir");
    std::fs::write(fx.cwd("tool").join("note.txt"), "the note says 42\n").expect("note");
    let run = fx
        .run(
            "tool",
            r#"SCENARIO:tool NAME=read_file ARGS={"file_path":"note.txt"}"#,
            None,
            Some(MODEL),
            &fx.base_url(),
        )
        .await;
    let reply = run.reply();
    assert_eq!(reply.tool_calls, 1, "{reply:?}");
    assert_eq!(
        reply.model_calls, 2,
        "the call and the answer to its result"
    );
    assert!(
        reply.text.starts_with("tool said:") && reply.text.contains("the note says 42"),
        "the model saw the file: {}",
        reply.text
    );
    let calls = fx.turn_calls();
    assert!(
        matches!(calls[0].decision(), Some(Decision::ToolCall { name, .. }) if name == "read_file")
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_error_answer_is_tried_once_and_fails_the_run_with_its_status() {
    let fx = Fixture::new().await;
    let failed = fx
        .run(
            "error",
            "SCENARIO:error STATUS=503",
            None,
            Some(MODEL),
            &fx.base_url(),
        )
        .await;
    eprintln!("measured: 503 answer to exit {:?}", failed.took);
    let err = failed.parsed().expect_err("the run fails");
    assert!(
        matches!(&err, GeminiError::Failed { code: Some(503), message, .. } if message == "scripted upstream failure"),
        "{err:?}"
    );
    assert_eq!(
        fx.model.requests().len(),
        1,
        "one attempt (`general.maxAttempts = 1`), no retries: {:?}",
        fx.model.requests()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_endpoint_fails_the_run_within_seconds_of_the_clis_start_up() {
    let fx = Fixture::new().await;
    // The CLI's own start-up on this machine now (a loaded machine stretches it a lot):
    // `--version` boots the same bundle.
    let launch = gemini_launch().await;
    let mut version = fx
        .spec("dead", "unused", None, Some(MODEL), &fx.base_url())
        .await;
    version.args = launch.args.clone();
    version.args.push("--version".into());
    let start_up = spawn_run(&version, RUN_LIMIT)
        .await
        .expect("--version ends")
        .took;

    // Nothing listens. Unbounded, the CLI retries for minutes; bounded (one attempt, no
    // retry of fetch errors) it gives up at the first failed fetch.
    let limit = start_up + Duration::from_secs(10);
    let dead = format!("http://127.0.0.1:{}", dead_port());
    let spec = fx
        .spec("dead", "REPLY=never answered", None, Some(MODEL), &dead)
        .await;
    let run = spawn_run(&spec, limit).await.unwrap_or_else(|stderr| {
        panic!("a dead endpoint kept the CLI past {limit:?} (start-up {start_up:?}): {stderr}")
    });
    eprintln!(
        "measured: dead endpoint to exit {:?} (--version: {start_up:?})",
        run.took
    );
    let err = run.parsed().expect_err("the run fails");
    assert!(matches!(err, GeminiError::Failed { .. }), "{err:?}");
    assert!(fx.model.requests().is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unknown_resume_id_has_no_transcript_and_the_cli_refuses_it_with_the_typed_error() {
    let fx = Fixture::new().await;
    let unknown = "00000000-1111-2222-3333-444444444444";
    let missing = gemini::transcript_path(&fx.home("stale"), &fx.cwd("stale"), unknown)
        .expect_err("no transcript");
    assert!(
        matches!(missing, GeminiError::TranscriptMissing { .. }),
        "{missing:?}"
    );
    // What the CLI itself says when asked anyway (in a fresh project: no sessions at all; in
    // a project with sessions: an invalid identifier; both exit 42).
    let run = fx
        .run(
            "stale",
            "REPLY=not reached",
            Some(unknown),
            Some(MODEL),
            &fx.base_url(),
        )
        .await;
    assert_eq!(
        run.exit,
        ExitInfo::Code(gemini::EXIT_INPUT),
        "{}",
        run.stderr
    );
    let err = run.parsed().expect_err("refused");
    let GeminiError::ResumeNotFound { message } = &err else {
        panic!("{err:?}");
    };
    assert!(message.contains("Error resuming session"), "{message}");
    assert!(
        fx.model.requests().is_empty(),
        "no model call was made: {:?}",
        fx.model.requests()
    );
}
