//! What Gemini CLI (`google-gemini-cli`, reference `cli-backends.md` §5) needs beyond the
//! configuration surface of [`CliBackendConfig::google_gemini_cli`](super::CliBackendConfig):
//!
//! * [`write_settings`]: the settings file in the agent's home
//!   (`<home>/.gemini/settings.json`) that selects the `gemini-api-key` auth type (env-only
//!   auth is refused with exit 41), turns usage statistics, telemetry and auto-update off
//!   (no outbound traffic), bounds retries to one attempt (a dead endpoint fails in
//!   seconds instead of retrying for minutes) and turns the CLI's session clean-up off (it
//!   would delete chat files the pool resumes). Idempotent (unchanged settings are not
//!   rewritten; the user's other keys are kept) and atomic (temp file, fsync, rename).
//! * [`StreamState`]: one run read line by line from `--output-format stream-json` (what
//!   the bundled backend passes): the answer's chunks, the CLI's tool calls, and at the end
//!   the answer or the typed failure, as [`parse_output`] gives them.
//! * [`parse_output`]: one run's result from its exit status and `--output-format json`
//!   stdout (a backend configured with `output = "json"`): `response`, `session_id`, usage summed over `stats.models.*.tokens`. Stdout may be
//!   empty on failure; the documented exit codes 41 (auth), 42 (input: an unknown resume id),
//!   53 (turn limit) and 55 (untrusted folder) become typed [`GeminiError`]s.
//! * [`transcript_path`]: where the CLI keeps a session's transcript
//!   (`<home>/.gemini/tmp/<project slug>/chats/session-<time>-<first 8 of id>.jsonl`, the slug
//!   from `<home>/.gemini/projects.json`), so a resume can be refused as
//!   [`GeminiError::TranscriptMissing`] before the CLI starts, never turned into a silent fresh
//!   session.
//!
//! Nothing here spawns a process: the process-per-turn runner does, with the bundled
//! configuration's argv and environment.

use std::io::BufRead;
use std::path::{Path, PathBuf};

use serde_json::{Map, Value, json};

use crate::process::ExitInfo;
use crate::turn::Usage;

/// The backend id of the bundled configuration.
pub const BACKEND_ID: &str = "google-gemini-cli";

/// Exit code: authentication failed or the auth method is not usable headless.
pub const EXIT_AUTH: i32 = 41;
/// Exit code: bad input (an unknown `--resume` id among them).
pub const EXIT_INPUT: i32 = 42;
/// Exit code: the session reached its turn limit.
pub const EXIT_TURN_LIMIT: i32 = 53;
/// Exit code: the working directory is not trusted.
pub const EXIT_UNTRUSTED: i32 = 55;

/// How much of stderr an error message repeats (its end).
const STDERR_MESSAGE_CHARS: usize = 600;

/// Stderr lines Gemini CLI prints on every run; never the reason of a failure.
const STDERR_NOISE: [&str; 2] = ["Warning: 256-color support", "Ripgrep is not available"];

/// A Gemini CLI run that did not produce an answer, or a session that cannot be resumed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error, serde::Serialize)]
#[serde(tag = "error", rename_all = "snake_case")]
#[non_exhaustive]
pub enum GeminiError {
    /// The settings file could not be read, merged or written.
    #[error(
        "cannot prepare Gemini CLI's settings at {path}: {problem}; fix or remove the file \
         (the pool rewrites its own keys)"
    )]
    Settings {
        /// `<home>/.gemini/settings.json`.
        path: PathBuf,
        /// What went wrong.
        problem: String,
    },
    /// Exit 41: the credentials or the auth method were refused.
    #[error(
        "Gemini CLI refused its credentials (exit 41): {message}; check the key the backend \
         was given, and that `.gemini/settings.json` in the agent's home selects \
         `gemini-api-key` (`backend::gemini::write_settings` writes it)"
    )]
    Auth {
        /// The CLI's message.
        message: String,
    },
    /// Exit 42 on `--resume`: the CLI has no session with that id in this project.
    #[error(
        "Gemini CLI has no session to resume (exit 42): {message}; the stored session id is \
         stale or belongs to another working directory, and every turn of this conversation \
         will fail the same way: delete the conversation (the HTTP API's DELETE \
         /v1/sessions/{{agent_id}}/{{session_key}}?backend=<id>, which drops the stored \
         id) or go on under a new session key"
    )]
    ResumeNotFound {
        /// The CLI's message.
        message: String,
    },
    /// Exit 42 for another reason.
    #[error("Gemini CLI refused its input (exit 42): {message}; check the prompt and arguments")]
    Input {
        /// The CLI's message.
        message: String,
    },
    /// Exit 53: the session reached its turn limit.
    #[error(
        "Gemini CLI ended the session at its turn limit (exit 53): {message}; start a new \
         conversation, or raise `model.maxSessionTurns` in its settings"
    )]
    TurnLimit {
        /// The CLI's message.
        message: String,
    },
    /// Exit 55: the working directory is not trusted.
    #[error(
        "Gemini CLI does not trust its working directory (exit 55): {message}; folder trust \
         was turned on (the pool writes security.folderTrust.enabled = false to the agent's \
         .gemini/settings.json): turn it off there, or set GEMINI_CLI_TRUST_WORKSPACE=true in \
         the backend's `env` (which also has the CLI load the workspace's own settings)"
    )]
    UntrustedFolder {
        /// The CLI's message.
        message: String,
    },
    /// Any other failure: the model call failed (the endpoint is unreachable, or answered
    /// with an error status) or the CLI broke.
    #[error(
        "Gemini CLI failed ({exit}): {message}; check the model endpoint and key the backend \
         was given"
    )]
    Failed {
        /// How it ended (`exit code 1`; after an error answer the exit code is its HTTP status
        /// modulo 256: `exit code 247` for a 503).
        exit: String,
        /// The `error.code` of the CLI's JSON error: the model's HTTP status when the model
        /// answered with one (429, 503, ...), 1 when it could not be reached.
        code: Option<i64>,
        /// The CLI's message, or the end of its stderr.
        message: String,
    },
    /// The process was killed by a signal.
    #[error("Gemini CLI was killed ({exit}); the next turn resumes the stored session")]
    Killed {
        /// How it ended (`signal 9 (SIGKILL)`).
        exit: String,
    },
    /// It exited 0 but stdout held no answer to read.
    #[error(
        "Gemini CLI exited 0 without an answer the pool can read ({detail}); the backend \
         must pass `--output-format stream-json` with `output = \"jsonl\"` (the bundled \
         default), or `--output-format json` with `output = \"json\"`"
    )]
    Unreadable {
        /// What was wrong with stdout.
        detail: String,
    },
    /// The CLI's transcript of the stored session is not where a resume looks for it.
    #[error(
        "transcript-missing: Gemini CLI has no transcript of session {session_id} (looked in \
         {searched}); a resume would fail, so the stored id is dropped: start a new \
         conversation"
    )]
    TranscriptMissing {
        /// The stored session id.
        session_id: String,
        /// Where it was looked for.
        searched: PathBuf,
    },
}

/// What one successful run produced.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct GeminiReply {
    /// The final text (`response`).
    pub text: String,
    /// The CLI's session id (`session_id`), to store and resume with.
    pub session_id: Option<String>,
    /// Tokens of this run's model calls, summed over `stats.models.*.tokens` (they cover
    /// this invocation only, resumed or not): `input_tokens` is the prompt without its
    /// cached part plus tool-use prompt tokens, `cache_read_tokens` the cached part,
    /// `output_tokens` candidates plus thoughts.
    pub usage: Usage,
    /// Model calls of this run (`stats.models.*.api.totalRequests`).
    pub model_calls: u64,
    /// Tool calls of this run (`stats.tools.totalCalls`).
    pub tool_calls: u64,
}

/// `<home>/.gemini`.
pub fn gemini_dir(home: &Path) -> PathBuf {
    home.join(".gemini")
}

/// `<home>/.gemini/settings.json`.
pub fn settings_path(home: &Path) -> PathBuf {
    gemini_dir(home).join("settings.json")
}

/// The settings the pool owns, as (key path, value).
fn owned_settings() -> [(&'static [&'static str], Value); 9] {
    [
        // Folder trust off: a workspace the environment leaves untrusted (the runner's
        // `GEMINI_CLI_TRUST_WORKSPACE=false`) runs without its own settings instead of
        // failing with exit 55, and one it does not decide on is trusted.
        (&["security", "folderTrust", "enabled"], json!(false)),
        (
            &["security", "auth", "selectedType"],
            json!("gemini-api-key"),
        ),
        (&["privacy", "usageStatisticsEnabled"], json!(false)),
        (&["telemetry", "enabled"], json!(false)),
        (&["general", "enableAutoUpdate"], json!(false)),
        (&["general", "enableAutoUpdateNotification"], json!(false)),
        (&["general", "maxAttempts"], json!(1)),
        (&["general", "retryFetchErrors"], json!(false)),
        // The pool decides which stored sessions it resumes: the CLI's own clean-up (on by
        // default in 0.61.0, at the start of every run) must not delete a chat file. It
        // takes a session file without conversation for corrupt and deletes every file of
        // that session, and a resume started in another minute than the session leaves
        // such a file (the header only; the conversation goes on in the first file), so the
        // next run of another session in the project deleted the whole conversation.
        (&["general", "sessionRetention", "enabled"], json!(false)),
    ]
}

/// Whether [`write_settings`] changed the file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SettingsWrite {
    /// The file was created or rewritten.
    Written,
    /// It already held the pool's settings; it was not touched.
    Unchanged,
}

/// Makes `<home>/.gemini/settings.json` hold the pool's settings (auth type
/// `gemini-api-key`, usage statistics, telemetry and auto-update off, one attempt per model
/// call, no retry of fetch errors, no session clean-up), keeping every other key the file
/// has. Creates `<home>/.gemini` (0700) when missing. Writes only when something changes,
/// through a temporary file that is fsync'd and renamed over the old one, so the CLI never
/// reads a half-written file. Blocking (small file I/O): call it before the run, off the
/// async threads.
pub fn write_settings(home: &Path) -> Result<SettingsWrite, GeminiError> {
    let path = settings_path(home);
    let fail = |problem: String| GeminiError::Settings {
        path: path.clone(),
        problem,
    };
    // The home is the agent's: its `.gemini` and the file are opened below it without
    // following a link the agent may have planted (`agent_files`).
    let rel = Path::new(".gemini").join("settings.json");
    crate::agent_files::create_dirs(home, Path::new(".gemini"), 0o700)
        .map_err(|e| fail(format!("cannot create {}: {e}", gemini_dir(home).display())))?;
    let (current, present) = match crate::agent_files::read(home, &rel, SETTINGS_LIMIT_BYTES) {
        Ok(bytes) => {
            let text =
                String::from_utf8(bytes).map_err(|_| fail("it is not UTF-8 text".to_owned()))?;
            if text.trim().is_empty() {
                (Map::new(), true)
            } else {
                match serde_json::from_str::<Value>(&text) {
                    Ok(Value::Object(map)) => (map, true),
                    Ok(_) => return Err(fail("it is not a JSON object".to_owned())),
                    Err(e) => {
                        return Err(fail(format!(
                            "it is not plain JSON ({e}; comments are not supported here)"
                        )));
                    }
                }
            }
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => (Map::new(), false),
        Err(e) => return Err(fail(format!("cannot read it: {e}; remove it"))),
    };
    let mut merged = Value::Object(current.clone());
    for (keys, value) in owned_settings() {
        set_path(&mut merged, keys, value);
    }
    if merged == Value::Object(current) && present {
        return Ok(SettingsWrite::Unchanged);
    }
    let mut text = serde_json::to_string_pretty(&merged)
        .map_err(|e| fail(format!("cannot serialize: {e}")))?;
    text.push('\n');
    crate::agent_files::replace(home, &rel, text.as_bytes(), 0o600)
        .map_err(|e| fail(format!("cannot write it: {e}")))?;
    Ok(SettingsWrite::Written)
}

/// The largest `settings.json` (and `projects.json`) the pool reads (1 MiB).
const SETTINGS_LIMIT_BYTES: u64 = 1 << 20;

/// Sets `value` at `keys` inside `root`, turning whatever is in the way into objects.
fn set_path(root: &mut Value, keys: &[&str], value: Value) {
    let Some((last, parents)) = keys.split_last() else {
        return;
    };
    let mut node = root;
    for key in parents {
        if !node.is_object() {
            *node = Value::Object(Map::new());
        }
        let Value::Object(map) = node else { return };
        node = map
            .entry((*key).to_owned())
            .or_insert_with(|| Value::Object(Map::new()));
    }
    if !node.is_object() {
        *node = Value::Object(Map::new());
    }
    if let Value::Object(map) = node {
        map.insert((*last).to_owned(), value);
    }
}

/// One run's result from how it exited, its stdout (`--output-format json`: one JSON
/// object) and the end of its stderr. Exit 0 with a `response` is the answer; everything
/// else is a [`GeminiError`] carrying the CLI's own message: `error.message` of its JSON
/// error (on stdout, or pretty-printed at the end of stderr, where 0.61.0 puts it after a
/// failed model call), else the end of stderr without the CLI's start-up noise.
pub fn parse_output(
    exit: ExitInfo,
    stdout: &str,
    stderr: &str,
) -> Result<GeminiReply, GeminiError> {
    let document = json_document(stdout);
    let code = match exit {
        ExitInfo::Code(code) => code,
        ExitInfo::Signal(_) | ExitInfo::Unknown => {
            return Err(GeminiError::Killed {
                exit: exit.to_string(),
            });
        }
    };
    let error_of = |d: Option<&Value>| {
        d.and_then(|d| d.get("error"))
            .filter(|e| !e.is_null())
            .cloned()
    };
    let json_error = error_of(document.as_ref()).or_else(|| {
        if code == 0 {
            None
        } else {
            error_of(trailing_json(stderr).as_ref())
        }
    });
    if code == 0 && json_error.is_none() {
        let Some(document) = document else {
            return Err(GeminiError::Unreadable {
                detail: if stdout.trim().is_empty() {
                    "stdout was empty".to_owned()
                } else {
                    "stdout was not one JSON object".to_owned()
                },
            });
        };
        let Some(text) = document.get("response").and_then(Value::as_str) else {
            return Err(GeminiError::Unreadable {
                detail: "the JSON object has no `response` text".to_owned(),
            });
        };
        return Ok(GeminiReply {
            text: text.to_owned(),
            session_id: document
                .get("session_id")
                .and_then(Value::as_str)
                .map(str::to_owned),
            usage: usage_of(&document),
            model_calls: sum_models(&document, |m| number(m, &["api", "totalRequests"])),
            tool_calls: number(&document, &["stats", "tools", "totalCalls"]),
        });
    }
    let message = json_error
        .as_ref()
        .and_then(|e| e.get("message"))
        .and_then(Value::as_str)
        .map(str::to_owned)
        .unwrap_or_else(|| stderr_message(stderr));
    let error_code = json_error
        .as_ref()
        .and_then(|e| e.get("code"))
        .and_then(Value::as_i64);
    Err(failure(exit, code, message, error_code, stderr))
}

/// The typed failure of a run that exited with `code` (not killed): the documented exit
/// codes first, then a failed model call or a broken CLI ([`GeminiError::Failed`]).
fn failure(
    exit: ExitInfo,
    code: i32,
    message: String,
    error_code: Option<i64>,
    stderr: &str,
) -> GeminiError {
    match code {
        EXIT_AUTH => GeminiError::Auth { message },
        EXIT_INPUT if is_resume_miss(stderr) || is_resume_miss(&message) => {
            GeminiError::ResumeNotFound { message }
        }
        EXIT_INPUT => GeminiError::Input { message },
        EXIT_TURN_LIMIT => GeminiError::TurnLimit { message },
        EXIT_UNTRUSTED => GeminiError::UntrustedFolder { message },
        _ => GeminiError::Failed {
            exit: exit.to_string(),
            code: error_code,
            message,
        },
    }
}

/// What one `--output-format stream-json` line brings to the turn's stream.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub enum StreamItem {
    /// A chunk of the assistant's text (`message`, role `assistant`, `delta: true`).
    Delta(String),
    /// The assistant's text of one model call, complete: the text before a tool call (its
    /// `tool_use` line closed it).
    Message(String),
    /// The CLI's model called one of the CLI's own tools (`tool_use`).
    ToolCall {
        /// `tool_id`.
        id: String,
        /// `tool_name` (`read_file`, `run_shell_command`, ...).
        name: String,
        /// `parameters`.
        input: Value,
    },
}

/// One run's progress through Gemini CLI's `--output-format stream-json` output (JSONL,
/// one event a line, as it happens): `init` (`session_id`, `model`), `message` (the
/// prompt's echo with role `user`, then the answer as role `assistant` chunks with
/// `delta: true`), `tool_use` / `tool_result` around each call of the CLI's own tools,
/// `error` (`severity`, `message`: a warning, or why the stream was invalid) and last
/// `result` (`status` `success` or `error`, `error.message` on a failed model call, usage
/// under `stats`). Feed it each line with [`StreamState::line`] as it arrives; once the
/// process exited, [`StreamState::finish`] gives the answer or the typed failure exactly as
/// [`parse_output`] does for `--output-format json` (same exit codes, same
/// [`GeminiError`]s). Measured with 0.61.0: the unknown resume id (exit 42) and refused
/// auth (exit 41) print nothing on stdout, only their message on stderr; a failed model
/// call prints `result` with status `error` and exits with its HTTP status modulo 256 (or 1
/// when the endpoint could not be reached).
#[derive(Debug, Clone, Default)]
pub struct StreamState {
    session_id: Option<String>,
    /// The assistant text of the current model call (JSON mode's `response` is the last
    /// call's text too).
    text: String,
    tool_calls: u64,
    result: Option<Value>,
    /// The message of the last `error` event of severity `error`.
    error_event: Option<String>,
}

impl StreamState {
    /// Whether `value` is an envelope rather than output: `init`, the prompt's echo
    /// (`message` with role `user`) and the closing `result` (status and usage). Output
    /// limits count the other lines only.
    pub fn is_envelope(value: &Value) -> bool {
        match value.get("type").and_then(Value::as_str) {
            Some("init" | "result") => true,
            Some("message") => value.get("role").and_then(Value::as_str) == Some("user"),
            _ => false,
        }
    }

    /// Takes one parsed line; what it brings to the stream (nothing for envelopes and
    /// `tool_result`, which only the CLI's model reads).
    pub fn line(&mut self, value: &Value) -> Vec<StreamItem> {
        let text = |key: &str| value.get(key).and_then(Value::as_str).unwrap_or("");
        match text("type") {
            "init" => {
                if !text("session_id").is_empty() {
                    self.session_id = Some(text("session_id").to_owned());
                }
                Vec::new()
            }
            "message" if text("role") == "assistant" => {
                let chunk = text("content");
                if chunk.is_empty() {
                    return Vec::new();
                }
                self.text.push_str(chunk);
                vec![StreamItem::Delta(chunk.to_owned())]
            }
            "tool_use" => {
                self.tool_calls += 1;
                let mut items = Vec::new();
                let said = std::mem::take(&mut self.text);
                if !said.is_empty() {
                    items.push(StreamItem::Message(said));
                }
                items.push(StreamItem::ToolCall {
                    id: text("tool_id").to_owned(),
                    name: text("tool_name").to_owned(),
                    input: value.get("parameters").cloned().unwrap_or(Value::Null),
                });
                items
            }
            "error" => {
                if text("severity") != "warning" && !text("message").is_empty() {
                    self.error_event = Some(text("message").to_owned());
                }
                Vec::new()
            }
            "result" => {
                self.result = Some(value.clone());
                Vec::new()
            }
            _ => Vec::new(),
        }
    }

    /// The assistant text of the current model call so far (what streamed since the last
    /// tool call).
    pub fn text(&self) -> &str {
        &self.text
    }

    /// The session id `init` named.
    pub fn session_id(&self) -> Option<&str> {
        self.session_id.as_deref()
    }

    /// The run's usage once `result` arrived (also after a failure: the calls made count).
    pub fn usage(&self) -> Option<Usage> {
        self.result
            .as_ref()
            .and_then(|r| r.get("stats"))
            .filter(|s| s.is_object())
            .map(stream_usage)
    }

    /// The run's result from how it exited and the end of its stderr, once its stdout
    /// closed: exit 0 with a `result` of status `success` is the answer (the last model
    /// call's text, the session id of `init`, usage from `result.stats`); anything else is
    /// the [`GeminiError`] [`parse_output`] gives the same exit, with the CLI's message:
    /// `result.error.message` (without its `[API Error: ...]` wrapping), else the last
    /// `error` event, else the end of stderr. The model's HTTP status of a failed call is
    /// read from the message when it is the API's JSON error, else from the `status: <n>`
    /// Node prints on stderr with the error (stream-json has no `error.code`).
    pub fn finish(&self, exit: ExitInfo, stderr: &str) -> Result<GeminiReply, GeminiError> {
        let code = match exit {
            ExitInfo::Code(code) => code,
            ExitInfo::Signal(_) | ExitInfo::Unknown => {
                return Err(GeminiError::Killed {
                    exit: exit.to_string(),
                });
            }
        };
        let status = self
            .result
            .as_ref()
            .and_then(|r| r.get("status"))
            .and_then(Value::as_str);
        if code == 0 && status == Some("success") {
            return Ok(GeminiReply {
                text: self.text.clone(),
                session_id: self.session_id.clone(),
                usage: self.usage().unwrap_or_default(),
                model_calls: 0,
                tool_calls: self.tool_calls,
            });
        }
        if code == 0 && self.result.is_none() {
            return Err(GeminiError::Unreadable {
                detail: "stdout had no `result` event".to_owned(),
            });
        }
        let reported = self
            .result
            .as_ref()
            .and_then(|r| r.pointer("/error/message"))
            .and_then(Value::as_str)
            .filter(|m| !m.trim().is_empty());
        let (message, mut error_code) = match reported {
            Some(message) => unwrap_api_error(message),
            None => (
                self.error_event
                    .clone()
                    .unwrap_or_else(|| stderr_message(stderr)),
                None,
            ),
        };
        if error_code.is_none() && code != 0 {
            error_code = stderr_status(stderr);
        }
        Err(failure(exit, code, message, error_code, stderr))
    }
}

/// A stream's `result.stats`: `input` is the prompt without its cached part (else
/// `input_tokens - cached`), `cached` the cached part, and output everything the total has
/// beyond the prompt (`output_tokens` counts candidates only; the total adds thoughts, which
/// are billed as output), at least `output_tokens`.
fn stream_usage(stats: &Value) -> Usage {
    let n = |key: &str| stats.get(key).and_then(Value::as_u64);
    let prompt = n("input_tokens").unwrap_or(0);
    let cached = n("cached").unwrap_or(0);
    let candidates = n("output_tokens").unwrap_or(0);
    let beyond_prompt = n("total_tokens").unwrap_or(0).saturating_sub(prompt);
    Usage {
        input_tokens: n("input").unwrap_or_else(|| prompt.saturating_sub(cached)),
        output_tokens: candidates.max(beyond_prompt),
        cache_read_tokens: cached,
        cache_write_tokens: 0,
    }
}

/// A stream's error message without the CLI's `[API Error: ...]` wrapping (and the advice
/// it appends after a 429), and the HTTP status when the message is the API's JSON error
/// (`{"error":{"code":401,"message":...}}`), whose own message is then the message.
fn unwrap_api_error(message: &str) -> (String, Option<i64>) {
    let Some(inner) = message.strip_prefix("[API Error: ") else {
        return (message.to_owned(), None);
    };
    let first = inner.split('\n').next().unwrap_or(inner).trim_end();
    let inner = first.strip_suffix(']').unwrap_or(first);
    let inner = match inner.rfind(" (Status: ") {
        Some(at) if inner.ends_with(')') => &inner[..at],
        _ => inner,
    };
    if let Ok(value) = serde_json::from_str::<Value>(inner)
        && let Some(text) = value.pointer("/error/message").and_then(Value::as_str)
    {
        return (
            text.to_owned(),
            value.pointer("/error/code").and_then(Value::as_i64),
        );
    }
    (inner.to_owned(), None)
}

/// The HTTP status Node prints with a failed model call's error at the end of stderr
/// (`  status: 503`), the last one.
fn stderr_status(stderr: &str) -> Option<i64> {
    stderr.lines().rev().find_map(|line| {
        let value = line.trim().strip_prefix("status: ")?;
        let value = value.strip_suffix(',').unwrap_or(value);
        value
            .parse::<i64>()
            .ok()
            .filter(|s| (100..=599).contains(s))
    })
}

/// The JSON object on stdout: all of it, else its last line that is one.
fn json_document(stdout: &str) -> Option<Value> {
    let whole = stdout.trim();
    if let Ok(value @ Value::Object(_)) = serde_json::from_str(whole) {
        return Some(value);
    }
    stdout
        .lines()
        .rev()
        .filter(|l| l.trim_start().starts_with('{'))
        .find_map(|l| match serde_json::from_str(l.trim()) {
            Ok(value @ Value::Object(_)) => Some(value),
            _ => None,
        })
}

/// The JSON object that ends `text`: from the last line that opens one (`{` at the start of
/// a line) to the end.
fn trailing_json(text: &str) -> Option<Value> {
    let starts: Vec<usize> = text
        .match_indices('{')
        .map(|(i, _)| i)
        .filter(|&i| i == 0 || text[..i].ends_with('\n'))
        .collect();
    starts
        .into_iter()
        .rev()
        .find_map(|i| match serde_json::from_str(text[i..].trim()) {
            Ok(value @ Value::Object(_)) => Some(value),
            _ => None,
        })
}

fn is_resume_miss(text: &str) -> bool {
    text.contains("Error resuming session") || text.contains("Invalid session identifier")
}

/// The end of stderr without the start-up noise, at most [`STDERR_MESSAGE_CHARS`].
fn stderr_message(stderr: &str) -> String {
    let kept: Vec<&str> = stderr
        .lines()
        .map(str::trim_end)
        .filter(|l| !l.trim().is_empty() && !STDERR_NOISE.iter().any(|n| l.starts_with(n)))
        .collect();
    let text = kept.join("\n");
    if text.is_empty() {
        return "no message (stdout and stderr were empty)".to_owned();
    }
    let start = text
        .char_indices()
        .rev()
        .nth(STDERR_MESSAGE_CHARS - 1)
        .map(|(i, _)| i)
        .unwrap_or(0);
    text[start..].to_owned()
}

/// The unsigned number at `keys` under `value` (0 when absent).
fn number(value: &Value, keys: &[&str]) -> u64 {
    keys.iter()
        .try_fold(value, |v, k| v.get(k))
        .and_then(Value::as_u64)
        .unwrap_or(0)
}

/// `f` summed over `stats.models.*`.
fn sum_models(document: &Value, f: impl Fn(&Value) -> u64) -> u64 {
    document
        .pointer("/stats/models")
        .and_then(Value::as_object)
        .map(|models| models.values().map(&f).fold(0u64, u64::saturating_add))
        .unwrap_or(0)
}

/// Usage summed over `stats.models.*.tokens`: `prompt` counts the cached tokens too.
fn usage_of(document: &Value) -> Usage {
    let tokens = |key: &'static str| sum_models(document, move |m| number(m, &["tokens", key]));
    let cached = tokens("cached");
    Usage {
        input_tokens: tokens("prompt")
            .saturating_sub(cached)
            .saturating_add(tokens("tool")),
        output_tokens: tokens("candidates").saturating_add(tokens("thoughts")),
        cache_read_tokens: cached,
        cache_write_tokens: 0,
    }
}

/// The transcript Gemini CLI keeps of `session_id` for a run in `cwd`:
/// `<home>/.gemini/tmp/<slug>/chats/session-<time>-<first 8 of id>.jsonl` whose first line
/// names the session, where `<slug>` is what `<home>/.gemini/projects.json` maps `cwd` to
/// (the CLI resumes only sessions of the current project; of several files for the session,
/// the largest). [`GeminiError::TranscriptMissing`]
/// when there is none: resuming would fail (exit 42), so the stored id must be dropped
/// rather than the run started. Blocking (small file reads).
pub fn transcript_path(home: &Path, cwd: &Path, session_id: &str) -> Result<PathBuf, GeminiError> {
    // A resume started in another minute than the session opens a second file named after
    // it (measured with 0.61.0: a header and the CLI's context only) and keeps appending
    // the conversation to the first one: the largest file is the conversation.
    session_files(home, cwd, session_id)?
        .into_iter()
        .map(|p| {
            let len = p
                .strip_prefix(home)
                .ok()
                .and_then(|rel| crate::agent_files::open_regular(home, rel).ok())
                .and_then(|f| f.metadata().ok())
                .map_or(0, |m| m.len());
            (len, p)
        })
        .max()
        .map(|(_, p)| p)
        .ok_or_else(|| GeminiError::TranscriptMissing {
            session_id: session_id.to_owned(),
            searched: gemini_dir(home).join("tmp"),
        })
}

/// Every chat file Gemini CLI keeps of `session_id` for a run in `cwd` (see
/// [`transcript_path`]: one, or two after a resume in another minute), at least one, else
/// [`GeminiError::TranscriptMissing`]. Blocking (small file reads, below the agent's home
/// without following a link: `agent_files`).
pub fn session_files(
    home: &Path,
    cwd: &Path,
    session_id: &str,
) -> Result<Vec<PathBuf>, GeminiError> {
    let dir = gemini_dir(home);
    let missing = |searched: PathBuf| GeminiError::TranscriptMissing {
        session_id: session_id.to_owned(),
        searched,
    };
    if session_id.len() < 8 || !super::oneshot::is_session_id(session_id) {
        return Err(missing(dir.join("tmp")));
    }
    let Some(slug) = project_slug(home, cwd) else {
        return Err(missing(dir.join("projects.json")));
    };
    let chats = Path::new(".gemini").join("tmp").join(slug).join("chats");
    let suffix = format!("-{}.jsonl", &session_id[..8]);
    // Only the session's files are held, however many others the folder has.
    let of_session = |name: &std::ffi::OsStr, kind| {
        kind == crate::agent_files::EntryKind::File
            && name
                .to_str()
                .is_some_and(|n| n.starts_with("session-") && n.ends_with(&suffix))
    };
    let Ok(entries) = crate::agent_files::entries_where(home, &chats, of_session) else {
        return Err(missing(home.join(chats)));
    };
    let files: Vec<PathBuf> = entries
        .into_iter()
        .filter_map(|(name, _)| name.into_string().ok())
        .map(|n| chats.join(n))
        .filter(|rel| first_line_names(home, rel, session_id))
        .map(|rel| home.join(rel))
        .collect();
    if files.is_empty() {
        return Err(missing(home.join(chats)));
    }
    Ok(files)
}

/// The slug `<home>/.gemini/projects.json` gives `cwd` (as given, or canonicalized). Slugs
/// that could leave the `tmp` folder are ignored.
fn project_slug(home: &Path, cwd: &Path) -> Option<String> {
    let rel = Path::new(".gemini").join("projects.json");
    let bytes = crate::agent_files::read(home, &rel, SETTINGS_LIMIT_BYTES).ok()?;
    let document: Value = serde_json::from_slice(&bytes).ok()?;
    let map = document.get("projects")?.as_object()?;
    let canonical = std::fs::canonicalize(cwd).ok();
    let keys = std::iter::once(cwd.to_path_buf()).chain(canonical);
    keys.filter_map(|k| k.to_str().map(str::to_owned))
        .find_map(|k| map.get(&k).and_then(Value::as_str).map(str::to_owned))
        .filter(|slug| !slug.is_empty() && !slug.contains('/') && slug != "." && slug != "..")
}

/// The longest header line of a transcript the pool reads (64 KiB).
const HEADER_LIMIT_BYTES: u64 = 64 * 1024;

/// Whether the transcript `home/rel`'s header line has `"sessionId": session_id`.
fn first_line_names(home: &Path, rel: &Path, session_id: &str) -> bool {
    use std::io::Read;
    let Ok(file) = crate::agent_files::open_regular(home, rel) else {
        return false;
    };
    let mut line = String::new();
    if std::io::BufReader::new(file.take(HEADER_LIMIT_BYTES))
        .read_line(&mut line)
        .is_err()
    {
        return false;
    }
    serde_json::from_str::<Value>(&line)
        .ok()
        .is_some_and(|header| header.get("sessionId").and_then(Value::as_str) == Some(session_id))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Trimmed stdout of a real 0.61.0 run (`--output-format json`, router call included).
    const ANSWER: &str = r#"{
      "session_id": "95642bd1-0b6b-49cf-9ddd-06d68bd0870f",
      "response": "FAKE-REPLY #2",
      "stats": {
        "models": {
          "gemini-3.8-flash": {
            "api": {"totalRequests": 1, "totalErrors": 0, "totalLatencyMs": 119},
            "tokens": {"input": 70, "prompt": 110, "candidates": 7, "total": 117, "cached": 40, "thoughts": 3, "tool": 0}
          },
          "gemini-3.5-flash-lite": {
            "api": {"totalRequests": 1, "totalErrors": 0, "totalLatencyMs": 20},
            "tokens": {"input": 90, "prompt": 90, "candidates": 5, "total": 95, "cached": 0, "thoughts": 0, "tool": 2}
          }
        },
        "tools": {"totalCalls": 1, "totalSuccess": 1, "totalFail": 0}
      }
    }"#;

    #[test]
    fn a_successful_run_reads_the_response_the_session_id_and_usage_summed_over_models() {
        let reply = parse_output(ExitInfo::Code(0), ANSWER, "Warning: 256-color support")
            .expect("an answer");
        assert_eq!(reply.text, "FAKE-REPLY #2");
        assert_eq!(
            reply.session_id.as_deref(),
            Some("95642bd1-0b6b-49cf-9ddd-06d68bd0870f")
        );
        assert_eq!(reply.usage.input_tokens, (110 - 40) + 90 + 2);
        assert_eq!(reply.usage.cache_read_tokens, 40);
        assert_eq!(reply.usage.output_tokens, 7 + 3 + 5);
        assert_eq!(reply.model_calls, 2);
        assert_eq!(reply.tool_calls, 1);
    }

    /// Feeds `lines` (one JSON object each) to a new [`StreamState`]; what they brought.
    fn stream(lines: &[&str]) -> (StreamState, Vec<StreamItem>) {
        let mut state = StreamState::default();
        let mut items = Vec::new();
        for line in lines {
            let value: Value = serde_json::from_str(line).expect("a JSON line");
            items.extend(state.line(&value));
        }
        (state, items)
    }

    /// Lines of a real 0.61.0 run with a call of its `read_file` (timestamps dropped).
    const TOOL_RUN: [&str; 8] = [
        r#"{"type":"init","session_id":"89211f50-ea5b-4de1-b563-73c352416ef2","model":"gemini-2.5-pro"}"#,
        r#"{"type":"message","role":"user","content":"SCENARIO:tool"}"#,
        r#"{"type":"message","role":"assistant","content":"Let me look.","delta":true}"#,
        r#"{"type":"tool_use","tool_name":"read_file","tool_id":"read_file__call_4","parameters":{"file_path":"note.txt"}}"#,
        r#"{"type":"tool_result","tool_id":"read_file__call_4","status":"success","output":""}"#,
        r#"{"type":"message","role":"assistant","content":"tool said:","delta":true}"#,
        r#"{"type":"message","role":"assistant","content":" 42","delta":true}"#,
        r#"{"type":"result","status":"success","stats":{"total_tokens":223,"input_tokens":200,"output_tokens":20,"cached":80,"input":120,"duration_ms":394,"tool_calls":1,"models":{}}}"#,
    ];

    #[test]
    fn a_stream_json_run_yields_deltas_the_tool_call_and_the_last_calls_text_with_usage() {
        let (state, items) = stream(&TOOL_RUN);
        assert_eq!(
            items,
            [
                StreamItem::Delta("Let me look.".into()),
                StreamItem::Message("Let me look.".into()),
                StreamItem::ToolCall {
                    id: "read_file__call_4".into(),
                    name: "read_file".into(),
                    input: json!({"file_path": "note.txt"}),
                },
                StreamItem::Delta("tool said:".into()),
                StreamItem::Delta(" 42".into()),
            ]
        );
        let reply = state
            .finish(ExitInfo::Code(0), "Warning: 256-color support")
            .expect("an answer");
        assert_eq!(reply.text, "tool said: 42", "the last model call's text");
        assert_eq!(
            reply.session_id.as_deref(),
            Some("89211f50-ea5b-4de1-b563-73c352416ef2")
        );
        assert_eq!(reply.tool_calls, 1);
        // `input` is the uncached prompt; output is the total beyond the prompt (thoughts
        // included), never less than the candidates.
        assert_eq!(
            reply.usage,
            Usage {
                input_tokens: 120,
                output_tokens: 23,
                cache_read_tokens: 80,
                cache_write_tokens: 0
            }
        );
        for (line, envelope) in TOOL_RUN
            .iter()
            .zip([true, true, false, false, false, false, false, true])
        {
            let value: Value = serde_json::from_str(line).unwrap();
            assert_eq!(StreamState::is_envelope(&value), envelope, "{line}");
        }
    }

    #[test]
    fn stream_json_failures_are_the_typed_errors_of_json_mode_with_the_http_status() {
        let init = r#"{"type":"init","session_id":"s-1","model":"m"}"#;
        // A 503 as 0.61.0 reports it in stream-json: the wrapped message on stdout, exit
        // 503 % 256, the status only in Node's print of the error on stderr.
        let (state, _) = stream(&[
            init,
            r#"{"type":"result","status":"error","error":{"type":"unknown","message":"[API Error: scripted upstream failure]"},"stats":{"total_tokens":0}}"#,
        ]);
        let stderr = "Attempt 1 failed\nRetryableQuotaError: scripted upstream failure\n    at x \
                      {\n  cause: { code: 503, message: 'scripted upstream failure' },\n  \
                      retryDelayMs: undefined,\n  status: 503\n}\n";
        assert_eq!(
            state.finish(ExitInfo::Code(247), stderr).unwrap_err(),
            GeminiError::Failed {
                exit: "exit code 247".into(),
                code: Some(503),
                message: "scripted upstream failure".into()
            }
        );
        // A 401: the API's JSON error inside the wrapping names the status.
        let (state, _) = stream(&[
            init,
            r#"{"type":"result","status":"error","error":{"type":"unknown","message":"[API Error: {\"error\":{\"code\":401,\"message\":\"key refused\",\"status\":\"UNAUTHENTICATED\"}}]"}}"#,
        ]);
        assert_eq!(
            state.finish(ExitInfo::Code(145), "").unwrap_err(),
            GeminiError::Failed {
                exit: "exit code 145".into(),
                code: Some(401),
                message: "key refused".into()
            }
        );
        // A 429 with the advice appended, and a status suffix.
        assert_eq!(
            unwrap_api_error("[API Error: slow down (Status: RESOURCE_EXHAUSTED)]\nPlease wait"),
            ("slow down".to_owned(), None)
        );
        // A dead endpoint: exit 1, no status anywhere.
        let (state, _) = stream(&[
            init,
            r#"{"type":"result","status":"error","error":{"type":"unknown","message":"[API Error: exception TypeError: fetch failed sending request]"}}"#,
        ]);
        assert_eq!(
            state
                .finish(ExitInfo::Code(1), "TypeError: fetch failed\n    at y")
                .unwrap_err(),
            GeminiError::Failed {
                exit: "exit code 1".into(),
                code: None,
                message: "exception TypeError: fetch failed sending request".into()
            }
        );
        // Refused auth and an unknown resume id print nothing on stdout.
        let (state, _) = stream(&[]);
        assert_eq!(
            state
                .finish(
                    ExitInfo::Code(41),
                    "Warning: 256-color support\nInvalid auth method selected."
                )
                .unwrap_err(),
            GeminiError::Auth {
                message: "Invalid auth method selected.".into()
            }
        );
        let err = state
            .finish(
                ExitInfo::Code(42),
                "Error resuming session: Invalid session identifier \"0000\".",
            )
            .unwrap_err();
        assert!(matches!(err, GeminiError::ResumeNotFound { .. }), "{err:?}");
        // An invalid stream: an `error` event, then `result` with status error, exit 0.
        let (state, _) = stream(&[
            init,
            r#"{"type":"error","severity":"warning","message":"Loop detected"}"#,
            r#"{"type":"error","severity":"error","message":"The model returned an empty response."}"#,
            r#"{"type":"result","status":"error","stats":{}}"#,
        ]);
        assert!(matches!(state.finish(ExitInfo::Code(0), "").unwrap_err(),
                GeminiError::Failed { message, code: None, .. } if message == "The model returned an empty response."),);
        // Exit 0 without a `result`: nothing to read.
        let (state, _) = stream(&[init]);
        let err = state.finish(ExitInfo::Code(0), "").unwrap_err();
        assert!(matches!(err, GeminiError::Unreadable { .. }), "{err:?}");
        assert!(err.to_string().contains("stream-json"), "{err}");
        let err = state.finish(ExitInfo::Signal(9), "").unwrap_err();
        assert!(matches!(err, GeminiError::Killed { .. }), "{err:?}");
    }

    #[test]
    fn documented_exit_codes_become_typed_errors_with_the_clis_message() {
        let auth = r#"{"session_id":"s","error":{"type":"Error","message":"Invalid auth method selected.","code":41}}"#;
        let err = parse_output(ExitInfo::Code(41), auth, "").unwrap_err();
        assert_eq!(
            err,
            GeminiError::Auth {
                message: "Invalid auth method selected.".into()
            }
        );
        assert!(err.to_string().contains("gemini-api-key"), "{err}");

        // The unknown resume id: plain text on stderr, empty stdout, even in JSON mode.
        let stderr = "Warning: 256-color support not detected.\nError resuming session: Invalid \
                      session identifier \"0000\".\n  Searched for sessions in /h/.gemini/tmp/w/chats.";
        let err = parse_output(ExitInfo::Code(42), "", stderr).unwrap_err();
        let GeminiError::ResumeNotFound { message } = &err else {
            panic!("{err:?}");
        };
        assert!(message.starts_with("Error resuming session"), "{message}");
        assert!(
            !message.contains("256-color"),
            "noise is dropped: {message}"
        );

        let err = parse_output(ExitInfo::Code(42), "", "Unknown argument: --bogus").unwrap_err();
        assert!(matches!(err, GeminiError::Input { .. }), "{err:?}");
        let err = parse_output(ExitInfo::Code(53), "", "Reached max session turns").unwrap_err();
        assert!(matches!(err, GeminiError::TurnLimit { .. }), "{err:?}");
        let err =
            parse_output(ExitInfo::Code(55), "", "not running in a trusted directory").unwrap_err();
        assert!(
            err.to_string().contains("GEMINI_CLI_TRUST_WORKSPACE"),
            "{err}"
        );

        // A dead endpoint: exit 1, stdout empty or a JSON error.
        let err = parse_output(
            ExitInfo::Code(1),
            "",
            "Error when talking to Gemini API\nfetch failed",
        )
        .unwrap_err();
        assert_eq!(
            err,
            GeminiError::Failed {
                exit: "exit code 1".into(),
                code: None,
                message: "Error when talking to Gemini API\nfetch failed".into()
            }
        );
        let json =
            r#"{"session_id":"s","error":{"type":"Error","message":"fetch failed","code":1}}"#;
        let err = parse_output(ExitInfo::Code(1), json, "a long trace").unwrap_err();
        assert!(
            matches!(&err, GeminiError::Failed { message, code: Some(1), .. } if message == "fetch failed")
        );
        // A 503 answer as 0.61.0 reports it: exit 503 % 256, the trace and then the
        // pretty-printed JSON error on stderr, nothing on stdout.
        let stderr = "Error when talking to Gemini API\n    at async main (gemini.js:1:1) {\n  \
                      status: 503\n}\n{\n  \"session_id\": \"s\",\n  \"error\": {\n    \
                      \"type\": \"Error\",\n    \"message\": \"scripted upstream failure\",\n    \
                      \"code\": 503\n  }\n}\n";
        let err = parse_output(ExitInfo::Code(247), "", stderr).unwrap_err();
        assert_eq!(
            err,
            GeminiError::Failed {
                exit: "exit code 247".into(),
                code: Some(503),
                message: "scripted upstream failure".into()
            }
        );

        let err = parse_output(ExitInfo::Signal(9), ANSWER, "").unwrap_err();
        assert!(matches!(err, GeminiError::Killed { .. }), "{err:?}");
        let err = parse_output(ExitInfo::Code(0), "", "").unwrap_err();
        assert!(err.to_string().contains("--output-format json"), "{err}");
        assert!(
            err.to_string().contains("--output-format stream-json"),
            "{err}"
        );
        let err = parse_output(ExitInfo::Code(0), r#"{"session_id":"s"}"#, "").unwrap_err();
        assert!(matches!(err, GeminiError::Unreadable { .. }), "{err:?}");
        let err = parse_output(ExitInfo::Code(1), "", "").unwrap_err();
        assert!(err.to_string().contains("no message"), "{err}");
    }

    #[test]
    fn settings_are_written_once_keep_the_users_keys_and_replace_only_the_pools() {
        let home = tempfile::tempdir().unwrap();
        assert_eq!(write_settings(home.path()).unwrap(), SettingsWrite::Written);
        let path = settings_path(home.path());
        let written: Value =
            serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        assert_eq!(
            written["security"]["auth"]["selectedType"],
            "gemini-api-key"
        );
        assert_eq!(written["privacy"]["usageStatisticsEnabled"], false);
        assert_eq!(written["telemetry"]["enabled"], false);
        assert_eq!(written["general"]["enableAutoUpdate"], false);
        assert_eq!(written["general"]["maxAttempts"], 1);
        assert_eq!(written["general"]["retryFetchErrors"], false);
        assert_eq!(written["general"]["sessionRetention"]["enabled"], false);
        assert_eq!(written["security"]["folderTrust"]["enabled"], false);
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(gemini_dir(home.path()))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o700);

        let before = std::fs::metadata(&path).unwrap().modified().unwrap();
        assert_eq!(
            write_settings(home.path()).unwrap(),
            SettingsWrite::Unchanged
        );
        assert_eq!(
            std::fs::metadata(&path).unwrap().modified().unwrap(),
            before
        );

        std::fs::write(
            &path,
            r#"{"mcpServers":{"x":{"command":"y"}},"general":{"maxAttempts":10,"vimMode":true,"sessionRetention":{"enabled":true,"maxAge":"7d"}},"telemetry":true}"#,
        )
        .unwrap();
        assert_eq!(write_settings(home.path()).unwrap(), SettingsWrite::Written);
        let merged: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        assert_eq!(merged["mcpServers"]["x"]["command"], "y");
        assert_eq!(merged["general"]["vimMode"], true);
        assert_eq!(merged["general"]["maxAttempts"], 1);
        assert_eq!(merged["general"]["sessionRetention"]["enabled"], false);
        assert_eq!(merged["general"]["sessionRetention"]["maxAge"], "7d");
        assert_eq!(merged["telemetry"]["enabled"], false);
        let leftovers: Vec<_> = std::fs::read_dir(gemini_dir(home.path()))
            .unwrap()
            .filter_map(Result::ok)
            .filter(|e| e.file_name().to_string_lossy().contains(".tmp-"))
            .collect();
        assert!(leftovers.is_empty(), "{leftovers:?}");

        std::fs::write(&path, "// a comment\n{}").unwrap();
        let err = write_settings(home.path()).unwrap_err();
        assert!(err.to_string().contains("fix or remove the file"), "{err}");
    }

    #[test]
    fn links_and_fifos_the_agent_planted_are_never_followed_or_waited_on() {
        let home = tempfile::tempdir().unwrap();
        let other = tempfile::tempdir().unwrap();
        let theirs = other.path().join("config.json");
        std::fs::write(&theirs, r#"{"secret":"theirs"}"#).unwrap();
        // settings.json a link to another agent's settings: neither read nor written through.
        std::fs::create_dir(gemini_dir(home.path())).unwrap();
        std::os::unix::fs::symlink(&theirs, settings_path(home.path())).unwrap();
        let err = write_settings(home.path()).unwrap_err();
        assert!(err.to_string().contains("not a regular file"), "{err}");
        assert_eq!(
            std::fs::read_to_string(&theirs).unwrap(),
            r#"{"secret":"theirs"}"#
        );
        // The `.gemini` folder itself a link elsewhere: nothing is made there.
        std::fs::remove_file(settings_path(home.path())).unwrap();
        std::fs::remove_dir(gemini_dir(home.path())).unwrap();
        std::os::unix::fs::symlink(other.path(), gemini_dir(home.path())).unwrap();
        assert!(write_settings(home.path()).is_err());
        assert!(!other.path().join("settings.json").exists());
        // A FIFO as projects.json: the transcript lookup answers at once instead of
        // blocking the thread that opens it.
        std::fs::remove_file(gemini_dir(home.path())).unwrap();
        std::fs::create_dir(gemini_dir(home.path())).unwrap();
        nix::unistd::mkfifo(
            &gemini_dir(home.path()).join("projects.json"),
            nix::sys::stat::Mode::from_bits_truncate(0o600),
        )
        .unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        let dir = home.path().to_path_buf();
        std::thread::spawn(move || {
            let _ = tx.send(transcript_path(
                &dir,
                Path::new("/work"),
                "95642bd1-0b6b-49cf-9ddd-06d68bd0870f",
            ));
        });
        let found = rx
            .recv_timeout(std::time::Duration::from_secs(10))
            .expect("the lookup came back instead of blocking on the FIFO");
        assert!(
            matches!(found, Err(GeminiError::TranscriptMissing { .. })),
            "{found:?}"
        );
    }

    #[test]
    fn a_transcript_is_found_by_project_slug_id_prefix_and_header_and_missing_otherwise() {
        let home = tempfile::tempdir().unwrap();
        let work = tempfile::tempdir().unwrap();
        let cwd = work.path().canonicalize().unwrap();
        let id = "dfb439f3-b82c-4ec3-a3d8-31c7df9ac3f9";
        let err = transcript_path(home.path(), &cwd, id).unwrap_err();
        assert!(
            matches!(&err, GeminiError::TranscriptMissing { searched, .. } if searched.ends_with("projects.json")),
            "{err:?}"
        );
        assert!(err.to_string().starts_with("transcript-missing"), "{err}");

        let gemini = gemini_dir(home.path());
        std::fs::create_dir_all(gemini.join("tmp/work/chats")).unwrap();
        std::fs::write(
            gemini.join("projects.json"),
            json!({"projects": {cwd.to_str().unwrap(): "work"}}).to_string(),
        )
        .unwrap();
        let chats = gemini.join("tmp/work/chats");
        let err = transcript_path(home.path(), &cwd, id).unwrap_err();
        assert!(
            matches!(&err, GeminiError::TranscriptMissing { searched, .. } if *searched == chats),
            "{err:?}"
        );
        // Same 8-character prefix, another session: not it.
        std::fs::write(
            chats.join("session-2026-12-01T16-07-dfb439f3.jsonl"),
            format!(
                "{}\n",
                json!({"sessionId": "dfb439f3-0000-0000-0000-000000000000"})
            ),
        )
        .unwrap();
        assert!(transcript_path(home.path(), &cwd, id).is_err());
        let file = chats.join("session-2026-12-01T16-09-dfb439f3.jsonl");
        std::fs::write(
            &file,
            format!(
                "{}\n{{\"type\":\"user\"}}\n",
                json!({"sessionId": id, "kind": "main"})
            ),
        )
        .unwrap();
        assert_eq!(transcript_path(home.path(), &cwd, id).unwrap(), file);
        // A resume in a later minute left a second, smaller file for the same session.
        std::fs::write(
            chats.join("session-2026-12-01T16-12-dfb439f3.jsonl"),
            format!("{}\n", json!({"sessionId": id})),
        )
        .unwrap();
        assert_eq!(transcript_path(home.path(), &cwd, id).unwrap(), file);
        // Deleting the conversation takes both files of the session, not the other one's.
        let mut both = session_files(home.path(), &cwd, id).unwrap();
        both.sort();
        assert_eq!(
            both,
            [
                file.clone(),
                chats.join("session-2026-12-01T16-12-dfb439f3.jsonl")
            ]
        );
        let elsewhere = tempfile::tempdir().unwrap();
        assert!(transcript_path(home.path(), elsewhere.path(), id).is_err());
        assert!(transcript_path(home.path(), &cwd, "../../x").is_err());
        assert!(transcript_path(home.path(), &cwd, "short").is_err());
    }
}
