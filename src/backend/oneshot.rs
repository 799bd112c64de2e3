//! The `cli-oneshot` runner: one CLI process per turn, driven by a [`CliBackendConfig`], with
//! session continuity through resume arguments (reference: `cli-backends.md` §4, §6, §7).
//! The bundled `codex-cli` backend runs on it ([`OneshotConfig::codex`]), and so does
//! `google-gemini-cli` ([`OneshotConfig::gemini`], with what [`gemini`] provides: its settings
//! file before each run, its `stream-json` lines read as they arrive (or its one JSON answer
//! under `output = "json"`), its exit codes, its transcripts). A backend's
//! [`Dialect`] is part of its configuration ([`CliBackendConfig::dialect_of`]: the `dialect`
//! key, else the bundled id's, else inferred from the command's file name);
//! [`Dialect::transcript`] says where each dialect's CLI keeps a session, which the pool
//! checks before it resumes one.
//!
//! Owns a conversation's stored CLI session ([`StoredSession`]: the id and, for CLIs that
//! report usage per thread, the last totals) and each turn's process. A turn
//! ([`Oneshot::start_turn`], [`OneshotTurn::next`]) builds the argv (`args`, or `resumeArgs`
//! with `{sessionId}` when a stored session is continued; model, system prompt, images and
//! the prompt as the configuration says), starts the process in its own process group
//! ([`ChildGroup`]) with a home of its own, and maps its output (`json`, `jsonl` or `text`,
//! `resumeOutput` on a resume) to [`BackendEvent`]s.
//!
//! Invariants:
//! * stdin is never left open: with input `arg` it is `/dev/null` (Codex waits forever on an
//!   open pipe); with input `stdin` (or a prompt over `maxPromptArgChars` when the backend
//!   allows the fallback) the prompt is written and the pipe closed;
//! * the process group is killed and its leader reaped on every path: the end of the turn,
//!   an abort, the turn timeout, an output limit, a turn dropped before its end (the
//!   [`ChildGroup`] guard);
//! * a process killed by a signal, or exiting non-zero with neither a final message nor an
//!   error of its own, ends the turn `crashed` as soon as its stdout closes; the stored
//!   session is kept, so the next turn resumes it;
//! * the output a turn retains (every line but the stream's envelopes: Codex's thread and
//!   turn start/end events, `is_jsonl_envelope`, and Gemini CLI's init, prompt echo and
//!   result) is bounded by `outputLimits` (8 MiB / 20,000 lines by default; an envelope line
//!   is still bounded by the byte limit alone, as any line read); past it the turn ends with [`TurnFailure::OutputLimit`], keeping the final
//!   message when it had already arrived;
//! * the API key is a [`Secret`] put only into the child's environment, under a variable
//!   the argv names (Codex: the provider's `env_key`) or the backend's `apiKeyEnv` (Gemini:
//!   `GEMINI_API_KEY`; its endpoint under `baseUrlEnv`), never into the argv or a log;
//! * usage is per turn: for Codex, which reports thread totals, the totals stored with the
//!   session are subtracted, so a resumed process diffs right.

use std::collections::{HashSet, VecDeque};
use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt;
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use tokio::io::AsyncWriteExt;
use tokio::process::ChildStdout;
use tokio::sync::{Notify, watch};
use tokio::time::Instant;
use tokio_util::codec::{FramedRead, LinesCodec, LinesCodecError};

use super::MAX_ARG_BYTES;
use super::config::{
    CliBackendConfig, ConfigError, ImageMode, InputMode, OutputFormat, PROMPT_PLACEHOLDER,
    SafetySwitches, SessionMode, SystemPromptWhen, codex_effort, names_config_key,
};
use super::event::{BackendEvent, CliTurnOutcome, TurnFailure};
use super::gemini;
use super::image::{self, ImageError};
use crate::kinds::{ReasoningEffort, TurnEnd};
use crate::process::{ChildGroup, ChildSpec, ExitInfo, SpawnError};
use crate::sandbox::Sandbox;
use crate::secret::Secret;
use crate::turn::Usage;

/// The backend id of the bundled Codex configuration.
pub const CODEX_BACKEND_ID: &str = "codex-cli";
/// The environment variable holding the model key for Codex (the provider's `env_key`).
pub const CODEX_KEY_ENV: &str = "COPILOT_POOL_MODEL_KEY";
/// OpenAI's endpoint, the provider's base URL when a Codex lease has a key and no base URL.
pub const CODEX_OPENAI_BASE_URL: &str = "https://api.openai.com/v1";
/// The name of the model provider the runner declares for Codex.
const CODEX_PROVIDER: &str = "copilot_pool";

/// What Gemini CLI reads of stdin (`MAX_STDIN_SIZE` in its bundle, 0.61.0); past it the
/// input is cut with a warning on stderr.
const GEMINI_MAX_STDIN_BYTES: usize = 8 * 1024 * 1024;
/// How much of the process's stderr a failure reports (its end).
const STDERR_TAIL_CHARS: usize = 2000;
/// How long the end of a turn waits for the leader's exit status once stdout closed.
const EXIT_WAIT: Duration = Duration::from_secs(2);
/// How long the end of a turn waits for the rest of stderr once the leader exited.
const STDERR_WAIT: Duration = Duration::from_millis(300);
/// How long stdout may stay open after the leader exited (a stray holder of the pipe).
const DRAIN_AFTER_EXIT: Duration = Duration::from_millis(500);
/// The default time limit of one turn.
pub const DEFAULT_TURN_TIMEOUT: Duration = Duration::from_secs(10 * 60);

/// CLI-specific behaviour on top of the generic configuration (a backend's `dialect` key:
/// `generic`, `codex`, `gemini`, `claude`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
#[non_exhaustive]
pub enum Dialect {
    /// Only what the configuration says.
    #[default]
    Generic,
    /// Codex CLI: `CODEX_HOME` in the agent's home, the model provider declared in a
    /// profile file there (`CodexProfile`: bounded retries, `wire_api = "responses"`, the
    /// key's variable, the endpoint's query), usage
    /// de-cumulated (Codex reports thread totals).
    Codex,
    /// Gemini CLI: its settings written into the agent's home before every run
    /// ([`gemini::write_settings`]: auth type, no telemetry, bounded retries), the key and
    /// endpoint in the variables `apiKeyEnv` / `baseUrlEnv` name, its `stream-json` output
    /// (`output = "jsonl"`, the bundled default) read line by line by
    /// [`gemini::StreamState`] (answer chunks as deltas, its tool calls as `tool.call`s,
    /// usage from `result.stats`, per invocation), a `json` one by [`gemini::parse_output`];
    /// its exit codes become [`TurnFailure::Gemini`].
    Gemini,
    /// Claude Code: the `cli-live` runner's CLI (a `cli-live` backend is always of this
    /// dialect); as a one-shot CLI (`claude -p`), its switches ([`SafetySwitches::CLAUDE`])
    /// and its transcript (`<home>/.claude/projects/<cwd slug>/<id>.jsonl`) checked before
    /// a resume.
    Claude,
}

impl Dialect {
    /// The switches this dialect's runner applies whatever `args`/`env` say.
    pub fn safety_switches(self) -> SafetySwitches {
        match self {
            Dialect::Generic => SafetySwitches::NONE,
            Dialect::Codex => SafetySwitches::CODEX,
            Dialect::Gemini => SafetySwitches::GEMINI,
            Dialect::Claude => SafetySwitches::CLAUDE,
        }
    }

    /// The dialect of a bundled backend id (`codex-cli` → Codex, `google-gemini-cli` →
    /// Gemini, `claude-cli` → Claude), [`Dialect::Generic`] for any other id. A backend's
    /// own dialect is [`CliBackendConfig::dialect_of`] (its configuration first).
    pub fn of_backend(id: &str) -> Self {
        match id {
            CODEX_BACKEND_ID => Dialect::Codex,
            gemini::BACKEND_ID => Dialect::Gemini,
            "claude-cli" => Dialect::Claude,
            _ => Dialect::Generic,
        }
    }

    /// The dialect a CLI's executable names (its file name: `codex…` → Codex, `gemini…`
    /// (also `gemini.js`) → Gemini, `claude…` → Claude), [`Dialect::Generic`] otherwise.
    pub fn of_command(command: &str) -> Self {
        let name = Path::new(command)
            .file_name()
            .map(|n| n.to_string_lossy().to_ascii_lowercase())
            .unwrap_or_default();
        if name.starts_with("codex") {
            Dialect::Codex
        } else if name.starts_with("gemini") {
            Dialect::Gemini
        } else if name.starts_with("claude") {
            Dialect::Claude
        } else {
            Dialect::Generic
        }
    }

    /// The most bytes of a prompt this dialect's CLI reads from stdin, where it cuts a
    /// longer one short with no more than a warning (Gemini CLI: 8 MiB), so the runner
    /// refuses it instead ([`OneshotError::PromptTooLongForStdin`]).
    pub fn stdin_prompt_limit(self) -> Option<usize> {
        match self {
            Dialect::Gemini => Some(GEMINI_MAX_STDIN_BYTES),
            Dialect::Generic | Dialect::Codex | Dialect::Claude => None,
        }
    }

    /// As the configuration's `dialect` key spells it.
    pub fn as_str(self) -> &'static str {
        match self {
            Dialect::Generic => "generic",
            Dialect::Codex => "codex",
            Dialect::Gemini => "gemini",
            Dialect::Claude => "claude",
        }
    }

    /// Where this dialect's CLI keeps session `session_id`'s transcript, run with `home`
    /// in `cwd`: `Some(Ok(path))` when it is there, `Some(Err(where it was looked for))`
    /// when it is not (a resume would fail or silently start afresh), `None` when the
    /// dialect has no known transcript to check (generic CLIs). Blocking (small directory
    /// reads).
    pub fn transcript(
        self,
        home: &Path,
        cwd: &Path,
        session_id: &str,
    ) -> Option<Result<PathBuf, PathBuf>> {
        match self {
            Dialect::Generic => None,
            Dialect::Claude => {
                let path = super::CliConversation::transcript_path(home, cwd, session_id);
                // Below the agent's home, without following a link it planted.
                let found = path
                    .strip_prefix(home)
                    .is_ok_and(|rel| crate::agent_files::is_file(home, rel));
                Some(if found { Ok(path) } else { Err(path) })
            }
            Dialect::Codex => Some(codex_rollout_path(home, session_id)),
            Dialect::Gemini => {
                Some(
                    gemini::transcript_path(home, cwd, session_id).map_err(|e| match e {
                        gemini::GeminiError::TranscriptMissing { searched, .. } => searched,
                        _ => gemini::gemini_dir(home),
                    }),
                )
            }
        }
    }

    /// Everything this dialect's CLI keeps of session `session_id` run with `home` in `cwd`,
    /// for deleting the conversation: Claude Code's transcript, and a folder beside it named
    /// after the session if there is one; Codex's rollout;
    /// every chat file of Gemini CLI's (two after a resume in another minute). Empty when
    /// there is nothing, and for generic CLIs (nothing known). Blocking (small directory
    /// reads).
    pub fn session_files(self, home: &Path, cwd: &Path, session_id: &str) -> Vec<PathBuf> {
        match self {
            Dialect::Generic => Vec::new(),
            // Claude Code's session ids are UUIDs: anything else could name another path.
            Dialect::Claude if !is_session_id(session_id) => Vec::new(),
            Dialect::Claude => {
                let transcript = super::CliConversation::transcript_path(home, cwd, session_id);
                let folder = transcript.with_extension("");
                [transcript, folder]
                    .into_iter()
                    .filter(|p| std::fs::symlink_metadata(p).is_ok())
                    .collect()
            }
            Dialect::Codex => codex_rollout_path(home, session_id).into_iter().collect(),
            Dialect::Gemini => gemini::session_files(home, cwd, session_id).unwrap_or_default(),
        }
    }
}

/// Checks that every image lies inside `cwd` once links are resolved (Gemini CLI skips an
/// `@path` outside its workspace without a word).
async fn in_workspace(cwd: &Path, images: &[PathBuf]) -> Result<(), ImageError> {
    if images.is_empty() {
        return Ok(());
    }
    let unreadable = |path: &Path, error| ImageError::Unreadable {
        path: path.to_path_buf(),
        error,
    };
    let root = tokio::fs::canonicalize(cwd)
        .await
        .map_err(|e| unreadable(cwd, e))?;
    for image in images {
        let resolved = tokio::fs::canonicalize(image)
            .await
            .map_err(|e| unreadable(image, e))?;
        if !resolved.starts_with(&root) {
            return Err(ImageError::OutsideWorkspace {
                path: resolved,
                cwd: root,
            });
        }
    }
    Ok(())
}

/// What a run hands its CLI as a file of its own in the agent's backend home: its system
/// prompt (`system-prompt-<uuid>.md`) or Codex's provider profile
/// (`.codex/copilot-pool-<uuid>.config.toml`). A name of the run's own (conversations of one
/// home run at once unless the backend is serialized, and one must never read another's
/// prompt or provider), created exclusively (never through a link the agent planted) and
/// removed when the run is dropped: a provider's query may carry a tenant's key, which
/// stays on disk no longer than the run that needs it.
struct RunFile {
    /// Where the CLI reads it.
    path: PathBuf,
    home: PathBuf,
    rel: PathBuf,
}

/// The files a run hands its CLI, each spelled once: where it goes and which names are its.
#[derive(Clone, Copy)]
enum RunFileKind {
    SystemPrompt,
    CodexProfile,
}

impl RunFileKind {
    /// The directory of the home the files go in.
    fn dir(self) -> &'static Path {
        match self {
            Self::SystemPrompt => Path::new(""),
            Self::CodexProfile => Path::new(".codex"),
        }
    }

    /// Whether `name` is a run's file of this kind, or the one earlier versions left
    /// (`system-prompt.md` shared by every run; a profile named by its content's 16-hex
    /// hash, never removed): no other file of the home.
    fn is_ours(self, name: &str) -> bool {
        let hex = |id: &str, lens: &[usize]| {
            lens.contains(&id.len()) && id.bytes().all(|b| b.is_ascii_hexdigit())
        };
        match self {
            Self::SystemPrompt => {
                name == "system-prompt.md"
                    || name
                        .strip_prefix("system-prompt-")
                        .and_then(|rest| rest.strip_suffix(".md"))
                        .is_some_and(|id| hex(id, &[32]))
            }
            Self::CodexProfile => name
                .strip_prefix("copilot-pool-")
                .and_then(|rest| rest.strip_suffix(".config.toml"))
                .is_some_and(|id| hex(id, &[16, 32])),
        }
    }
}

/// A run's file at least this old (and twice the turn timeout) was left by a daemon that did
/// not live to remove it.
const LEFT_RUN_FILE_AGE: Duration = Duration::from_secs(24 * 3600);

impl RunFile {
    /// Writes `text` into a new file of `kind` in `home` (0600; its directory must exist),
    /// after removing the files of runs a crash cut short (older than [`LEFT_RUN_FILE_AGE`]
    /// and twice `turn_timeout`: no run of this backend lasts that long). Blocking.
    fn create(
        home: &Path,
        kind: RunFileKind,
        name: &str,
        text: &str,
        turn_timeout: Duration,
    ) -> std::io::Result<Self> {
        Self::remove_left(
            home,
            kind,
            LEFT_RUN_FILE_AGE.max(turn_timeout.saturating_mul(2)),
        );
        let rel = kind.dir().join(name);
        crate::agent_files::create_new(home, &rel, text.as_bytes(), 0o600)?;
        Ok(Self {
            path: home.join(&rel),
            home: home.to_path_buf(),
            rel,
        })
    }

    /// Removes the files of `kind` in `home` older than `age`.
    fn remove_left(home: &Path, kind: RunFileKind, age: Duration) {
        let _ = crate::agent_files::remove_old_files(home, kind.dir(), age, |name| {
            name.to_str().is_some_and(|n| kind.is_ours(n))
        });
    }
}

impl Drop for RunFile {
    fn drop(&mut self) {
        // The entry goes, reached and removed without following a link.
        if let Err(error) = crate::agent_files::remove_file(&self.home, &self.rel) {
            tracing::debug!(%error, path = %self.path.display(), "could not remove a run's file");
        }
    }
}

/// How much of a rollout's end [`codex_rollout_totals`] reads.
const ROLLOUT_TAIL_BYTES: u64 = 256 * 1024;

/// The thread's usage totals as Codex last recorded them in its rollout (the
/// `total_token_usage` of the last `token_count` event in the file's last 256 KiB), so a new
/// runner resuming the thread (the pool restarted) reports the next turn's own usage. `None`
/// when there is none to read. Blocking (one small read).
pub fn codex_rollout_totals(home: &Path, rollout: &Path) -> Option<UsageTotals> {
    use std::io::{Read, Seek, SeekFrom};
    let rel = rollout.strip_prefix(home).ok()?;
    let mut file = crate::agent_files::open_regular(home, rel).ok()?;
    let len = file.metadata().ok()?.len();
    let start = len.saturating_sub(ROLLOUT_TAIL_BYTES);
    file.seek(SeekFrom::Start(start)).ok()?;
    let mut tail = Vec::new();
    file.take(ROLLOUT_TAIL_BYTES).read_to_end(&mut tail).ok()?;
    let text = String::from_utf8_lossy(&tail);
    // A cut first line does not parse and is skipped.
    text.lines().rev().find_map(|line| {
        if !line.contains("\"token_count\"") {
            return None;
        }
        let value: Value = serde_json::from_str(line).ok()?;
        let payload = &value["payload"];
        if payload["type"] != "token_count" {
            return None;
        }
        usage_of(&payload["info"]["total_token_usage"])
    })
}

/// Whether `id` looks like a CLI's session id (letters, digits and `-`, as UUIDs are), so
/// it can name no other path when it is part of a file name.
pub(crate) fn is_session_id(id: &str) -> bool {
    !id.is_empty() && id.chars().all(|c| c.is_ascii_alphanumeric() || c == '-')
}

/// Codex's rollout of thread `thread_id` for an agent homed in `home`:
/// `<home>/.codex/sessions/YYYY/MM/DD/rollout-<local time>-<thread_id>.jsonl` (reference
/// `cli-backends.md` §4.3); `Err(<home>/.codex/sessions)` when there is none. Ids that could
/// name a path are never found; the folders are the agent's, walked without following a
/// link (`agent_files`).
pub fn codex_rollout_path(home: &Path, thread_id: &str) -> Result<PathBuf, PathBuf> {
    use crate::agent_files::{EntryKind, entries_where};
    let sessions = Path::new(".codex").join("sessions");
    if !is_session_id(thread_id) {
        return Err(home.join(sessions));
    }
    let suffix = format!("-{thread_id}.jsonl");
    // The entries `keep` picks in every folder of `level`, as paths below the home (only
    // those are held, however many other files a folder has).
    let children = |level: &[PathBuf], keep: &dyn Fn(&std::ffi::OsStr, EntryKind) -> bool| {
        level
            .iter()
            .filter_map(|dir| Some((dir, entries_where(home, dir, keep).ok()?)))
            .flat_map(|(dir, found)| found.into_iter().map(move |(name, _)| dir.join(name)))
            .collect::<Vec<PathBuf>>()
    };
    // Three levels of dated folders, newest first (a resumed thread keeps its first file).
    let mut level = vec![sessions.clone()];
    for _ in 0..3 {
        let mut next = children(&level, &|_, kind| kind == EntryKind::Dir);
        next.sort_unstable_by(|a, b| b.cmp(a));
        level = next;
    }
    let rollout = |name: &std::ffi::OsStr, kind: EntryKind| {
        kind == EntryKind::File
            && name
                .to_str()
                .is_some_and(|n| n.starts_with("rollout-") && n.ends_with(&suffix))
    };
    children(&level, &rollout)
        .into_iter()
        .next()
        .map(|rel| home.join(rel))
        .ok_or(home.join(sessions))
}

/// Token counts as a CLI reports them, kept with the session for CLIs that report totals.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct UsageTotals {
    /// Input tokens.
    pub input_tokens: u64,
    /// Output tokens.
    pub output_tokens: u64,
    /// Input tokens read from the prompt cache.
    pub cache_read_tokens: u64,
    /// Input tokens written to the prompt cache.
    pub cache_write_tokens: u64,
}

impl UsageTotals {
    /// The usage between `earlier` totals and these; these as they are when any count went
    /// down (the totals were reset, e.g. a different thread).
    pub fn since(self, earlier: UsageTotals) -> Usage {
        let fields = [
            (self.input_tokens, earlier.input_tokens),
            (self.output_tokens, earlier.output_tokens),
            (self.cache_read_tokens, earlier.cache_read_tokens),
            (self.cache_write_tokens, earlier.cache_write_tokens),
        ];
        let base = if fields.iter().any(|(now, before)| now < before) {
            UsageTotals::default()
        } else {
            earlier
        };
        Usage {
            input_tokens: self.input_tokens - base.input_tokens,
            output_tokens: self.output_tokens - base.output_tokens,
            cache_read_tokens: self.cache_read_tokens - base.cache_read_tokens,
            cache_write_tokens: self.cache_write_tokens - base.cache_write_tokens,
        }
    }

    fn of(usage: Usage) -> Self {
        Self {
            input_tokens: usage.input_tokens,
            output_tokens: usage.output_tokens,
            cache_read_tokens: usage.cache_read_tokens,
            cache_write_tokens: usage.cache_write_tokens,
        }
    }

    fn as_usage(self) -> Usage {
        self.since(UsageTotals::default())
    }
}

/// A conversation's CLI session, to persist between processes and restarts of the pool.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct StoredSession {
    /// The CLI's session (Codex: thread) id.
    pub session_id: String,
    /// The last usage totals the CLI reported for it (CLIs that report totals only).
    #[serde(default)]
    pub usage_totals: UsageTotals,
}

impl StoredSession {
    /// A session with no usage recorded yet.
    pub fn new(session_id: impl Into<String>) -> Self {
        Self {
            session_id: session_id.into(),
            usage_totals: UsageTotals::default(),
        }
    }
}

/// How to run one conversation's turns.
#[non_exhaustive]
pub struct OneshotConfig {
    /// The backend id (for error messages), e.g. `codex-cli`.
    pub id: String,
    /// The backend configuration; validated by [`Oneshot::new`].
    pub backend: CliBackendConfig,
    /// CLI-specific behaviour.
    pub dialect: Dialect,
    /// The agent's own home: `HOME`, `TMPDIR=<home>/tmp`, Codex's `CODEX_HOME=<home>/.codex`
    /// (created when missing). Keep it outside the system temp folder for Codex.
    pub home: PathBuf,
    /// The working directory of the turns.
    pub cwd: PathBuf,
    /// The model endpoint (Codex: the provider's `base_url`, e.g. `http://127.0.0.1:8080/v1`).
    pub base_url: Option<String>,
    /// The model key: only ever in the child's environment.
    pub api_key: Option<Secret>,
    /// The variable the key goes in; when `None`, the backend's `apiKeyEnv`, else for
    /// Codex [`CODEX_KEY_ENV`] with a `base_url` or `OPENAI_API_KEY`, else the key is not
    /// passed. (`base_url` goes under the backend's `baseUrlEnv` when it names one.)
    pub key_env: Option<String>,
    /// The pool's model name (mapped through `modelAliases`).
    pub model: Option<String>,
    /// The reasoning effort: Codex gets `-c model_reasoning_effort=<effort>`; other
    /// dialects have no mapping and ignore it (the page: a CLI's effort flag must be
    /// declared by its owner; a fallback chain carries one request across backends, so
    /// refusing would turn an effort into a failed failover).
    pub reasoning_effort: Option<ReasoningEffort>,
    /// The system prompt (passed as `systemPrompt*` and `systemPromptWhen` say).
    pub system_prompt: Option<String>,
    /// The stored session to continue.
    pub session: Option<StoredSession>,
    /// The time limit of one turn; past it the group is killed and the turn ends `timeout`.
    pub turn_timeout: Duration,
    /// A prompt over `maxPromptArgChars` (or the OS's argument limit) goes to stdin; when
    /// false it is refused with [`OneshotError::PromptTooLong`].
    pub prompt_stdin_fallback: bool,
    /// `PATH` of the child (default: the caller's own `PATH`).
    pub path_var: Option<OsString>,
    /// Start each turn's CLI through this sandbox's wrapper ([`Sandbox::cli_command`]; the
    /// pool passes its workers' sandbox made for the agent, [`Sandbox::for_cli_agent`]): the
    /// agent's directory read and write, TCP to the model endpoint (and the MCP bridge)
    /// only. `None`: the CLI runs with the caller's rights.
    pub sandbox: Option<Sandbox>,
    /// The daemon's ledger of process groups: each CLI process started is recorded until
    /// it is reaped, so a daemon restarted after a crash kills what survived of it (its
    /// tools; the CLI itself dies with the daemon). `None`: not recorded.
    pub group_ledger: Option<std::sync::Arc<crate::group_ledger::GroupLedger>>,
    /// The conversation's gateway tools, served to Codex by a loopback MCP bridge (the
    /// `mcp__<server>` namespace) kept across turns and restarted once its idle TTL ended
    /// it. `None`, no tools, or another dialect: no bridge.
    #[cfg(feature = "mcp-bridge")]
    pub gateway_tools: Option<super::mcp_bridge::McpGatewayTools>,
}

impl OneshotConfig {
    /// A backend `id` configured by `backend`, homed in `home`, working in `cwd`.
    pub fn new(
        id: impl Into<String>,
        backend: CliBackendConfig,
        home: impl Into<PathBuf>,
        cwd: impl Into<PathBuf>,
    ) -> Self {
        Self {
            id: id.into(),
            backend,
            dialect: Dialect::Generic,
            home: home.into(),
            cwd: cwd.into(),
            base_url: None,
            api_key: None,
            key_env: None,
            model: None,
            reasoning_effort: None,
            system_prompt: None,
            session: None,
            turn_timeout: DEFAULT_TURN_TIMEOUT,
            prompt_stdin_fallback: true,
            path_var: std::env::var_os("PATH"),
            sandbox: None,
            group_ledger: None,
            #[cfg(feature = "mcp-bridge")]
            gateway_tools: None,
        }
    }

    /// The bundled `codex-cli` backend running `executable` (the vendored native binary,
    /// see [`crate::runtime::AgentCli::Codex`]).
    pub fn codex(
        executable: impl Into<PathBuf>,
        home: impl Into<PathBuf>,
        cwd: impl Into<PathBuf>,
    ) -> Self {
        let mut backend = CliBackendConfig::codex_cli();
        backend.command = executable.into().display().to_string();
        let mut config = Self::new(CODEX_BACKEND_ID, backend, home, cwd);
        config.dialect = Dialect::Codex;
        config
    }

    /// The bundled `google-gemini-cli` backend running `executable`: Gemini CLI's
    /// `bundle/gemini.js` (it starts with `#!/usr/bin/env node`, so `node` must be on the
    /// child's `PATH`) or its `gemini` launcher.
    pub fn gemini(
        executable: impl Into<PathBuf>,
        home: impl Into<PathBuf>,
        cwd: impl Into<PathBuf>,
    ) -> Self {
        let mut backend = CliBackendConfig::google_gemini_cli();
        backend.command = executable.into().display().to_string();
        let mut config = Self::new(gemini::BACKEND_ID, backend, home, cwd);
        config.dialect = Dialect::Gemini;
        config
    }
}

impl std::fmt::Debug for OneshotConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OneshotConfig")
            .field("id", &self.id)
            .field("backend", &self.backend)
            .field("dialect", &self.dialect)
            .field("home", &self.home)
            .field("cwd", &self.cwd)
            .field("base_url", &crate::secret::RedactedUrl(&self.base_url))
            .field("api_key", &self.api_key)
            .field("key_env", &self.key_env)
            .field("model", &self.model)
            .field("session", &self.session)
            .field("turn_timeout", &self.turn_timeout)
            .finish_non_exhaustive()
    }
}

/// Why a turn could not start.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum OneshotError {
    /// The backend configuration cannot run.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// The backend's `command` is not there ([`CliBackendConfig::check_installed`]): no
    /// process was started.
    #[error(transparent)]
    NotInstalled(ConfigError),
    /// The agent's home (or a file in it) could not be written.
    #[error(
        "could not write {} for the CLI process: {error}; the agent's home must be on a \
         writable filesystem",
        path.display()
    )]
    Home {
        /// The folder or file.
        path: PathBuf,
        /// The error.
        #[source]
        error: std::io::Error,
    },
    /// The prompt is too long to pass as an argument and the backend does not read stdin.
    #[error(
        "the prompt has {chars} characters, over the {max} this backend takes as an \
         argument, and it does not read prompts on stdin; shorten the prompt, raise \
         `maxPromptArgChars`, or set `input = \"stdin\"` if the CLI reads it there"
    )]
    PromptTooLong {
        /// The prompt's length.
        chars: usize,
        /// The limit.
        max: usize,
    },
    /// The system prompt (the gateway's `systemMessage`) is too long to pass as the one
    /// argument `systemPromptArg` gives it.
    #[error(
        "the systemMessage has {bytes} bytes, over the {max} a CLI takes as one argument \
         (`systemPromptArg`); shorten the systemMessage (put long instructions in a file in \
         the working directory and point to it), or, if the CLI reads its system prompt \
         from a file, configure `systemPromptFileArg` instead"
    )]
    SystemMessageTooLong {
        /// The system prompt's length in bytes.
        bytes: usize,
        /// The limit.
        max: usize,
    },
    /// The prompt is longer than the CLI reads from stdin (it would cut the rest off).
    #[error(
        "the prompt has {bytes} bytes, over the {max} this CLI reads from stdin (it would \
         drop the rest with only a warning); shorten the prompt, or pass large inputs as \
         files in the working directory"
    )]
    PromptTooLongForStdin {
        /// The prompt's length in bytes.
        bytes: usize,
        /// The limit.
        max: usize,
    },
    /// Codex CLI's model provider cannot be given to it as it is (the lease's
    /// `provider.base_url`, or the backend's own arguments).
    #[error("codex-cli cannot be given the provider: {0}")]
    CodexProvider(String),
    /// Gemini CLI's settings could not be written into the agent's home.
    #[error(transparent)]
    Gemini(#[from] gemini::GeminiError),
    /// An image of the turn cannot be passed (Gemini CLI: outside its workspace).
    #[error(transparent)]
    Image(#[from] ImageError),
    /// The MCP bridge for the gateway tools could not start.
    #[cfg(feature = "mcp-bridge")]
    #[error(transparent)]
    McpBridge(#[from] super::mcp_bridge::McpBridgeError),
    /// The process could not be started.
    #[error(
        "{0}; is `command` the CLI's executable (install Codex with \
         `copilot_pool::runtime::install_agent_cli`)?"
    )]
    Spawn(#[from] SpawnError),
}

/// What one run is given: its argv, and the prompt when it goes on stdin.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Invocation {
    args: Vec<String>,
    stdin_prompt: Option<String>,
    /// The session id passed (resumed, or a new one under `sessionMode = "always"`).
    session_id: Option<String>,
    /// A stored session is continued.
    resumed: bool,
    output: OutputFormat,
    /// Codex's model provider, written into its `CODEX_HOME` before the run (`-p` names it).
    codex_profile: Option<CodexProfile>,
}

/// Codex's model provider as a profile file, `$CODEX_HOME/<name>.config.toml`, which
/// `codex -p <name>` layers over the agent's own `config.toml` (Codex 0.171): the endpoint,
/// the Responses API, one retry per request and stream, the key's variable, and the
/// endpoint's query as Codex's `query_params`. In a file, not in `-c` overrides: a command
/// line is readable by every process of the host (`/proc/<pid>/cmdline`), and a query may
/// carry a tenant's key. Each run writes a file of its own ([`RunFile`]), removed when the
/// run ends, so runs of one agent never read each other's provider, and a key in a query
/// stays on disk no longer than the run that needs it.
#[derive(Clone, PartialEq, Eq)]
struct CodexProfile {
    name: String,
    text: String,
}

impl std::fmt::Debug for CodexProfile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The text holds the endpoint (and its query).
        f.debug_struct("CodexProfile")
            .field("name", &self.name)
            .finish_non_exhaustive()
    }
}

impl CodexProfile {
    /// The profile for `url` (its query split off), with `key_env` as the key's variable.
    fn new(url: &str, key_env: Option<&str>) -> Result<Self, OneshotError> {
        let (base, query) = match url.split_once('?') {
            Some((base, query)) => (base, Some(query)),
            None => (url, None),
        };
        if query.is_some_and(|q| q.contains('#')) || base.contains('#') {
            return Err(OneshotError::CodexProvider(
                "provider.base_url has a fragment ('#...'), which an endpoint never \
                 carries: remove it"
                    .into(),
            ));
        }
        let mut text = format!(
            "# Written by copilot-pool for one run of codex-cli (`codex -p {{name}}`), \
             removed when the run ends.\n\
             model_provider = {provider}\n\n\
             [model_providers.{CODEX_PROVIDER}]\n\
             name = {provider}\n\
             base_url = {base}\n\
             wire_api = \"responses\"\n\
             request_max_retries = 1\n\
             stream_max_retries = 1\n",
            provider = toml_string(CODEX_PROVIDER),
            base = toml_string(base),
        );
        if let Some(key_env) = key_env {
            text.push_str(&format!("env_key = {}\n", toml_string(key_env)));
        }
        if let Some(query) = query.filter(|q| !q.is_empty()) {
            // Codex joins `query_params` into the query as they are (measured, 0.171: no
            // escaping but of spaces), so each key and value goes in as the URL has it,
            // escapes and all, and the endpoint gets the query it was given. (In
            // `base_url` the query would come before the `/responses` Codex appends.)
            let mut seen = HashSet::new();
            let mut params = Vec::new();
            for pair in query.split('&').filter(|p| !p.is_empty()) {
                let (key, value) = pair.split_once('=').unwrap_or((pair, ""));
                if !seen.insert(key) {
                    return Err(OneshotError::CodexProvider(format!(
                        "provider.base_url's query names '{key}' twice, which Codex cannot \
                         pass on (its query parameters are a table): name each parameter once"
                    )));
                }
                params.push(format!("{} = {}", toml_string(key), toml_string(value)));
            }
            text.push_str(&format!("query_params = {{ {} }}\n", params.join(", ")));
        }
        let name = format!("copilot-pool-{}", uuid::Uuid::new_v4().simple());
        let text = text.replacen("{name}", &name, 1);
        Ok(Self { name, text })
    }

    /// Writes the run's file (0600) into the agent's home; it goes when the returned file is
    /// dropped. Blocking.
    fn write(&self, home: &Path, turn_timeout: Duration) -> std::io::Result<RunFile> {
        let file = format!("{}.config.toml", self.name);
        RunFile::create(
            home,
            RunFileKind::CodexProfile,
            &file,
            &self.text,
            turn_timeout,
        )
    }
}

/// One conversation of a `cli-oneshot` backend: the stored session, and a process per turn.
pub struct Oneshot {
    config: OneshotConfig,
    session: Option<StoredSession>,
    /// The gateway tools' bridge (Codex), while it runs.
    #[cfg(feature = "mcp-bridge")]
    bridge: Option<super::mcp_bridge::McpBridge>,
}

impl std::fmt::Debug for Oneshot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Oneshot")
            .field("id", &self.config.id)
            .field("session", &self.session)
            .finish_non_exhaustive()
    }
}

impl Oneshot {
    /// Checks the configuration; starts nothing yet.
    pub fn new(config: OneshotConfig) -> Result<Self, OneshotError> {
        config.backend.validate(&config.id)?;
        if config.backend.kind != super::BackendKind::CliOneshot {
            return Err(ConfigError {
                backend: config.id.clone(),
                problem: "this runner is for `kind = \"cli-oneshot\"` backends; a `cli-live` \
                          backend runs on its live runner"
                    .to_owned(),
            }
            .into());
        }
        let session = config.session.clone();
        Ok(Self {
            config,
            session,
            #[cfg(feature = "mcp-bridge")]
            bridge: None,
        })
    }

    /// The CLI session id to store (learned from the CLI, or the configured one).
    pub fn session_id(&self) -> Option<&str> {
        self.session.as_ref().map(|s| s.session_id.as_str())
    }

    /// The directory its turns run in (where its CLI files the session, for some dialects).
    pub fn working_directory(&self) -> &Path {
        &self.config.cwd
    }

    /// The session with its usage totals, to persist with the conversation.
    pub fn stored_session(&self) -> Option<&StoredSession> {
        self.session.as_ref()
    }

    /// Starts a process for `prompt` (resuming the stored session when there is one). Read
    /// the turn's events with [`OneshotTurn::next`] until [`BackendEvent::TurnEnd`].
    pub async fn start_turn(&mut self, prompt: &str) -> Result<OneshotTurn<'_>, OneshotError> {
        self.start_turn_with_images(prompt, &[]).await
    }

    /// [`Oneshot::start_turn`] with image files (absolute paths): after `imageArg` as
    /// `imageMode` says, or appended to the prompt when the backend has none (Gemini CLI: as
    /// `@path` references, which it reads only inside its workspace, so an image outside the
    /// working directory is refused with [`ImageError::OutsideWorkspace`] rather than
    /// skipped by the CLI).
    pub async fn start_turn_with_images(
        &mut self,
        prompt: &str,
        images: &[PathBuf],
    ) -> Result<OneshotTurn<'_>, OneshotError> {
        let config = &self.config;
        let tmp_dir = config.home.join("tmp");
        let mut below = vec!["tmp"];
        if config.dialect == Dialect::Codex {
            below.push(".codex");
        }
        // Private (0700, whatever the umask): the CLI keeps its transcripts and
        // credentials there; a link planted in the home is refused, never followed.
        crate::home::ensure_private_dirs_below(config.home.clone(), below)
            .await
            .map_err(|(path, error)| OneshotError::Home { path, error })?;
        crate::home::ensure_private_dirs(vec![config.cwd.clone()])
            .await
            .map_err(|(path, error)| OneshotError::Home { path, error })?;
        if config.dialect == Dialect::Gemini && config.backend.image_arg.is_none() {
            if !images.is_empty() && config.sandbox.is_some() {
                return Err(ImageError::GeminiSandboxed.into());
            }
            in_workspace(&config.cwd, images).await?;
        }
        if config.dialect == Dialect::Gemini {
            let home = config.home.clone();
            let written = tokio::task::spawn_blocking(move || gemini::write_settings(&home))
                .await
                .map_err(|e| gemini::GeminiError::Settings {
                    path: gemini::settings_path(&config.home),
                    problem: format!("the writer stopped: {e}"),
                })?;
            written?;
        }
        let system_prompt_file = match (&config.system_prompt, self.system_prompt_needs_file()) {
            (Some(text), true) => {
                let home = config.home.clone();
                let text = text.clone();
                let timeout = config.turn_timeout;
                let written = tokio::task::spawn_blocking(move || {
                    let name = format!("system-prompt-{}.md", uuid::Uuid::new_v4().simple());
                    RunFile::create(&home, RunFileKind::SystemPrompt, &name, &text, timeout)
                })
                .await
                .unwrap_or_else(|e| Err(std::io::Error::other(e.to_string())));
                Some(written.map_err(|error| OneshotError::Home {
                    path: config.home.clone(),
                    error,
                })?)
            }
            _ => None,
        };
        config
            .backend
            .check_installed(&config.id, config.path_var.as_deref())
            .map_err(OneshotError::NotInstalled)?;
        let invocation = self.invocation(
            prompt,
            images,
            system_prompt_file.as_ref().map(|f| f.path.as_path()),
        )?;
        let mut codex_profile_file = None;
        if let Some(profile) = invocation.codex_profile.clone() {
            let home = config.home.clone();
            let timeout = config.turn_timeout;
            let written = tokio::task::spawn_blocking(move || profile.write(&home, timeout))
                .await
                .unwrap_or_else(|e| Err(std::io::Error::other(e.to_string())));
            codex_profile_file = Some(written.map_err(|error| OneshotError::Home {
                path: config.home.join(RunFileKind::CodexProfile.dir()),
                error,
            })?);
        }
        #[allow(unused_mut)]
        let mut spec = self.child_spec(&invocation, tmp_dir);
        #[allow(unused_mut)]
        let mut ports: Vec<u16> = Vec::new();
        #[cfg(feature = "mcp-bridge")]
        let mut bridge_hold = None;
        #[cfg(feature = "mcp-bridge")]
        if let Some((mcp, hold)) = self.bridge_for_turn().await? {
            bridge_hold = Some(hold);
            if let Some(bridge) = &self.bridge {
                ports.push(bridge.addr().port());
            }
            // Global `-c` overrides, before the subcommand like the provider's profile.
            spec.args
                .splice(0..0, mcp.args.into_iter().map(OsString::from));
            spec.env.extend(
                mcp.env
                    .iter()
                    .map(|(k, v)| (OsString::from(k), OsString::from(v.expose()))),
            );
        }
        if let Some(sandbox) = &self.config.sandbox {
            // Only a script the configuration names is granted, never a filled-in prompt.
            let backend = &self.config.backend;
            let resume = backend.resume_args.as_deref().unwrap_or_default();
            let (program, args) = sandbox.cli_command(
                &spec.program,
                &spec.args,
                &[&backend.args, resume],
                backend
                    .child_path_var(self.config.path_var.as_deref())
                    .as_deref(),
                &ports,
            );
            spec.program = program;
            spec.args = args;
        }
        // Never log `spec`: its environment holds the key.
        let (child, stdout) = match &invocation.stdin_prompt {
            None => ChildGroup::spawn_null_stdin(&spec)?,
            Some(text) => {
                let (child, io) = ChildGroup::spawn(&spec)?;
                let mut stdin = io.stdin;
                let text = text.clone();
                // A task, so a CLI that prints before reading all of stdin cannot deadlock
                // us; the pipe closes when it is done (or the process is gone). Started at
                // once after the spawn: Gemini CLI takes an empty prompt if nothing arrives
                // on stdin within 500 ms of its read, so this write must never wait.
                tokio::spawn(async move {
                    if let Err(error) = stdin.write_all(text.as_bytes()).await {
                        tracing::debug!(%error, "could not write the prompt to the CLI's stdin");
                    }
                    let _ = stdin.shutdown().await;
                });
                (child, io.stdout)
            }
        };
        if let Some(ledger) = &self.config.group_ledger {
            ledger.track(&child);
        }
        tracing::debug!(
            backend = %self.config.id,
            pid = child.pid(),
            resumed = invocation.resumed,
            "cli-oneshot process started"
        );
        let limits = self.config.backend.output_limits;
        let max_line = usize::try_from(limits.max_turn_raw_chars)
            .unwrap_or(usize::MAX)
            .saturating_add(1);
        Ok(OneshotTurn {
            pid: child.pid(),
            exit: child.exit_watch(),
            child: Some(child),
            lines: FramedRead::new(stdout, LinesCodec::new_with_max_length(max_line)),
            stdout_done: false,
            exit_seen: false,
            drain_deadline: None,
            // The lease's limit (no limit: `Duration::MAX`) can be past any instant.
            deadline: crate::deadline::from_now(self.config.turn_timeout),
            abort: Arc::new(Notify::new()),
            queue: VecDeque::new(),
            ended: false,
            format: invocation.output,
            resumed: invocation.resumed,
            passed_session: invocation.session_id,
            learned_session: None,
            collected: String::new(),
            last_text: None,
            cli_error: None,
            error_event: None,
            reported: None,
            tool_calls: 0,
            started_items: HashSet::new(),
            gemini: (self.config.dialect == Dialect::Gemini
                && invocation.output == OutputFormat::Jsonl)
                .then(gemini::StreamState::default),
            retained_bytes: 0,
            retained_lines: 0,
            max_bytes: limits.max_turn_raw_chars,
            max_lines: limits.max_turn_lines,
            _run_files: [system_prompt_file, codex_profile_file],
            #[cfg(feature = "mcp-bridge")]
            _bridge_hold: bridge_hold,
            conversation: self,
        })
    }

    /// Runs `prompt` to the end of its turn, handing each event to `on_event`.
    pub async fn run(
        &mut self,
        prompt: &str,
        mut on_event: impl FnMut(&BackendEvent),
    ) -> Result<CliTurnOutcome, OneshotError> {
        let mut turn = self.start_turn(prompt).await?;
        while let Some(event) = turn.next().await {
            on_event(&event);
            if let BackendEvent::TurnEnd(outcome) = event {
                return Ok(outcome);
            }
        }
        // `next` always yields a TurnEnd before None.
        Ok(CliTurnOutcome {
            end: Some(TurnEnd::Crashed),
            ..CliTurnOutcome::default()
        })
    }

    fn system_prompt_needs_file(&self) -> bool {
        let backend = &self.config.backend;
        backend.system_prompt_file_arg.is_some() || backend.system_prompt_file_config_arg.is_some()
    }

    /// The argv and stdin of the next run (pure: no I/O).
    fn invocation(
        &self,
        prompt: &str,
        images: &[PathBuf],
        system_prompt_file: Option<&Path>,
    ) -> Result<Invocation, OneshotError> {
        let config = &self.config;
        let backend = &config.backend;
        let stored = self.session.as_ref().map(|s| s.session_id.clone());
        let (session_id, resumed) = match backend.session_mode {
            SessionMode::None => (None, false),
            SessionMode::Existing => (stored.clone(), stored.is_some()),
            SessionMode::Always => match stored {
                Some(id) => (Some(id), true),
                None => (Some(uuid::Uuid::new_v4().to_string()), false),
            },
        };
        let model = config.model.as_deref();
        let mut args = if resumed || session_id.is_none() {
            backend.argv(session_id.as_deref(), model)
        } else {
            // A new id under `always`: the fresh arguments, with the session flag.
            let mut fresh = backend.clone();
            fresh.resume_args = None;
            fresh.argv(session_id.as_deref(), model)
        };
        let mut codex_profile = None;
        if config.dialect == Dialect::Codex {
            let mut global = SafetySwitches::CODEX.config_args_for(backend);
            codex_profile = self.codex_profile()?;
            if let Some(profile) = &codex_profile {
                global.extend(["-p".to_owned(), profile.name.clone()]);
            }
            if let Some(effort) = config.reasoning_effort
                && !names_config_key(&args, "model_reasoning_effort")
            {
                global.extend([
                    "-c".to_owned(),
                    format!(
                        "model_reasoning_effort={}",
                        toml_string(codex_effort(effort))
                    ),
                ]);
            }
            args.splice(0..0, global);
            if config.sandbox.is_some() {
                codex_sandbox_off(&mut args);
            }
        }
        let switches = config.dialect.safety_switches().flag_args_for(backend);
        args.extend(switches);

        let pass_system_prompt = match backend.system_prompt_when {
            SystemPromptWhen::Always => true,
            SystemPromptWhen::First => !resumed,
            SystemPromptWhen::Never => false,
        };
        if let (true, Some(text)) = (pass_system_prompt, &config.system_prompt) {
            if let Some(flag) = &backend.system_prompt_arg {
                // Checked here, as the prompt is: past the limit the spawn would fail with
                // E2BIG, read as a CLI that cannot start.
                if text.len() > MAX_ARG_BYTES {
                    return Err(OneshotError::SystemMessageTooLong {
                        bytes: text.len(),
                        max: MAX_ARG_BYTES,
                    });
                }
                args.extend([flag.clone(), text.clone()]);
            } else if let (Some(flag), Some(path)) =
                (&backend.system_prompt_file_arg, system_prompt_file)
            {
                args.extend([flag.clone(), path.display().to_string()]);
            } else if let (Some(flag), Some(key), Some(path)) = (
                &backend.system_prompt_file_config_arg,
                &backend.system_prompt_file_config_key,
                system_prompt_file,
            ) {
                args.extend([
                    flag.clone(),
                    format!("{key}={}", toml_string(&path.display().to_string())),
                ]);
            }
        }

        let mut prompt = backend.transform(prompt, false);
        if !images.is_empty() {
            let paths: Vec<String> = images.iter().map(|p| p.display().to_string()).collect();
            // `--image=` is joined to its value; `--image` is followed by it.
            let flagged = |flag: &str, value: String| {
                if flag.ends_with('=') {
                    vec![format!("{flag}{value}")]
                } else {
                    vec![flag.to_owned(), value]
                }
            };
            match (&backend.image_arg, backend.image_mode) {
                (Some(flag), ImageMode::Repeat) => {
                    for path in paths {
                        args.extend(flagged(flag, path));
                    }
                }
                (Some(flag), ImageMode::List) => args.extend(flagged(flag, paths.join(","))),
                (None, _) if config.dialect == Dialect::Gemini => {
                    // Gemini CLI reads `@path` references into the model request. Relative
                    // to its working directory (where `in_workspace` found them): it globs an
                    // absolute reference from `/`, which the sandbox does not let it read,
                    // and then skips the image without a word.
                    let refs: Vec<String> = images
                        .iter()
                        .map(|p| image::gemini_reference(p.strip_prefix(&config.cwd).unwrap_or(p)))
                        .collect();
                    prompt.push_str("\n\n");
                    prompt.push_str(&refs.join("\n"));
                }
                (None, _) => {
                    prompt.push_str("\n\n");
                    prompt.push_str(&paths.join("\n"));
                }
            }
        }

        let chars = prompt.chars().count();
        let max = backend.max_prompt_arg_chars.unwrap_or(usize::MAX);
        let too_long = chars > max || prompt.len() > MAX_ARG_BYTES;
        // Codex would read a prompt that starts with `-` as an option.
        let looks_like_flag = config.dialect == Dialect::Codex && prompt.starts_with('-');
        let on_stdin = match backend.input {
            InputMode::Stdin => true,
            InputMode::Arg if too_long || looks_like_flag => {
                if !config.prompt_stdin_fallback {
                    return Err(OneshotError::PromptTooLong {
                        chars,
                        max: max.min(MAX_ARG_BYTES),
                    });
                }
                true
            }
            InputMode::Arg => false,
        };
        if on_stdin
            && let Some(max) = config.dialect.stdin_prompt_limit()
            && prompt.len() > max
        {
            return Err(OneshotError::PromptTooLongForStdin {
                bytes: prompt.len(),
                max,
            });
        }
        if on_stdin {
            args = without_prompt_placeholder(args);
        } else if args.iter().any(|a| a.contains(PROMPT_PLACEHOLDER)) {
            for arg in &mut args {
                *arg = arg.replace(PROMPT_PLACEHOLDER, &prompt);
            }
        } else {
            args.push(prompt.clone());
        }
        let output = match (resumed, backend.resume_output) {
            (true, Some(format)) => format,
            _ => backend.output,
        };
        Ok(Invocation {
            args,
            stdin_prompt: on_stdin.then_some(prompt),
            session_id,
            resumed,
            output,
            codex_profile,
        })
    }

    /// Codex's model provider as a profile file ([`CodexProfile`]): the endpoint, the Responses API, the key's
    /// variable (when there is a key) and one retry per request and stream.
    ///
    /// Without a `base_url` but with a key, the provider is OpenAI's own endpoint
    /// ([`CODEX_OPENAI_BASE_URL`], the key in `OPENAI_API_KEY`) declared by the pool: Codex
    /// refuses overrides of its built-in `openai` provider, whose retries are 4 per request
    /// and 5 per stream (a dead endpoint took 34.5 s to fail, 2.4 s with this provider).
    /// Without either, the CLI's own login (`codex login` in the agent's home) is used
    /// through the built-in provider and its retries stay Codex's own; a warning says so
    /// once per process.
    fn codex_profile(&self) -> Result<Option<CodexProfile>, OneshotError> {
        let url = match (&self.config.base_url, &self.config.api_key) {
            (Some(url), _) => url.as_str(),
            (None, Some(_)) => CODEX_OPENAI_BASE_URL,
            (None, None) => {
                static WARNED: std::sync::Once = std::sync::Once::new();
                WARNED.call_once(|| {
                    tracing::warn!(
                        backend = %self.config.id,
                        "codex-cli runs on its own login with no base_url and no key: its \
                         built-in provider keeps Codex's default retries (5 per stream, about \
                         35 s against a dead endpoint); give the lease a provider (base_url \
                         and api_key) to bound them to one"
                    );
                });
                return Ok(None);
            }
        };
        let backend = &self.config.backend;
        let resume = backend.resume_args.iter().flatten();
        if let Some(flag) = backend.args.iter().chain(resume).find(|a| {
            *a == "-p"
                || *a == "--profile"
                || a.starts_with("--profile=")
                || a.starts_with("-p") && a.len() > 2 && !a.starts_with("--")
        }) {
            return Err(OneshotError::CodexProvider(format!(
                "the backend's args name a profile ('{flag}'), and the pool passes the \
                 lease's provider as a profile of its own (`-p`): move those settings into \
                 the agent's $CODEX_HOME/config.toml and drop '{flag}' from the args"
            )));
        }
        let key_env = self.config.api_key.as_ref().map(|_| self.key_env());
        CodexProfile::new(url, key_env.as_deref()).map(Some)
    }

    /// The variable the key goes in: the runner's `key_env`, else the backend's
    /// `apiKeyEnv`, else the dialect's own (Codex), else none.
    fn key_env(&self) -> String {
        if let Some(name) = self.config.key_env.as_ref().or(self
            .config
            .backend
            .api_key_env
            .as_ref())
        {
            return name.clone();
        }
        match (self.config.dialect, &self.config.base_url) {
            (Dialect::Codex, Some(_)) => CODEX_KEY_ENV.to_owned(),
            (Dialect::Codex, None) => "OPENAI_API_KEY".to_owned(),
            (Dialect::Generic | Dialect::Gemini | Dialect::Claude, _) => String::new(),
        }
    }

    /// The model and system prompt of the next runs (a lease's, on a conversation kept
    /// between leases).
    pub fn set_model(&mut self, model: Option<String>, system_prompt: Option<String>) {
        self.config.model = model;
        self.config.system_prompt = system_prompt;
    }

    /// How long the next runs may take before the process is killed and the turn ends
    /// `timeout` ([`OneshotConfig::turn_timeout`]).
    pub fn set_turn_timeout(&mut self, limit: Duration) {
        self.config.turn_timeout = limit;
    }

    /// [`OneshotConfig::turn_timeout`] of the next runs.
    pub fn turn_timeout(&self) -> Duration {
        self.config.turn_timeout
    }

    /// The reasoning effort of the next runs ([`OneshotConfig::reasoning_effort`]).
    pub fn set_reasoning_effort(&mut self, effort: Option<ReasoningEffort>) {
        if effort.is_some() && self.config.dialect != Dialect::Codex {
            tracing::debug!(
                backend = %self.config.id,
                "this CLI has no reasoning-effort mapping; the lease's effort is ignored"
            );
        }
        self.config.reasoning_effort = effort;
    }

    /// Whether this conversation serves gateway tools to its CLI (the Codex dialect does,
    /// through the MCP bridge; Gemini CLI and generic CLIs do not).
    pub fn serves_gateway_tools(&self) -> bool {
        cfg!(feature = "mcp-bridge") && self.config.dialect == Dialect::Codex
    }

    /// Makes `tools` the conversation's gateway tools from now on (a pool lease installs its
    /// own handlers this way). When the bridge kept from the last turn lists the same tools,
    /// their handlers are swapped in ([`super::GatewayToolsChange::Installed`]); otherwise the
    /// bridge is stopped and the next turn's process gets a new one listing these tools
    /// ([`super::GatewayToolsChange::NotRunning`]: no process runs between turns).
    #[cfg(feature = "mcp-bridge")]
    pub fn set_gateway_tools(
        &mut self,
        tools: Vec<crate::turn::GatewayTool>,
    ) -> super::GatewayToolsChange {
        use super::GatewayToolsChange as Change;
        let installed = super::mcp_bridge::offer_tools(
            self.bridge.as_ref(),
            &mut self.config.gateway_tools,
            tools,
        );
        if installed == Some(true) {
            Change::Installed
        } else {
            // The next run starts a bridge listing the new tools.
            self.bridge = None;
            Change::NotRunning
        }
    }

    /// Takes the gateway tools' handlers out (a pool lease ended): a call that arrives
    /// before the next [`Oneshot::set_gateway_tools`] is an `isError` result at once.
    #[cfg(feature = "mcp-bridge")]
    pub fn clear_gateway_handlers(&mut self) {
        super::mcp_bridge::take_out_handlers(self.bridge.as_ref(), &mut self.config.gateway_tools);
    }

    /// Codex's overrides for the conversation's gateway tools: the running bridge's, or a
    /// new bridge's when there is none or its idle TTL ended it. `None` without tools or for
    /// another dialect.
    #[cfg(feature = "mcp-bridge")]
    async fn bridge_for_turn(
        &mut self,
    ) -> Result<
        Option<(
            super::mcp_bridge::ClaudeMcpArgs,
            super::mcp_bridge::BridgeHold,
        )>,
        OneshotError,
    > {
        let config = &self.config;
        let Some(gateway) = config
            .gateway_tools
            .as_ref()
            .filter(|g| !g.tools.is_empty() && config.dialect == Dialect::Codex)
        else {
            return Ok(None);
        };
        // The hold first: a bridge found running then cannot idle out before the turn ends.
        let mut hold = self.bridge.as_ref().map(super::mcp_bridge::McpBridge::hold);
        if !self.bridge.as_ref().is_some_and(|b| b.is_running()) {
            let mut bridge_config = gateway.bridge.clone();
            if bridge_config.working_directory.is_none() {
                bridge_config.working_directory = Some(config.cwd.display().to_string());
            }
            // Asked about: `codex exec` cannot ask, so no call is approved and none runs,
            // not even one a shell tool makes with the token from the CLI's environment.
            bridge_config.calls_need_approval |= gateway.ask_permission;
            let bridge =
                super::mcp_bridge::McpBridge::start(gateway.tools.clone(), bridge_config).await?;
            hold = Some(bridge.hold());
            self.bridge = Some(bridge);
        }
        let allow = !gateway.ask_permission;
        Ok(self.bridge.as_ref().zip(hold).map(|(b, hold)| {
            if let Some(id) = self.session.as_ref().map(|s| s.session_id.as_str()) {
                b.set_session_id(id);
            }
            (b.codex_overrides(allow), hold)
        }))
    }

    fn child_spec(&self, invocation: &Invocation, tmp_dir: PathBuf) -> ChildSpec {
        let config = &self.config;
        let mut env: Vec<(OsString, OsString)> = vec![
            ("HOME".into(), config.home.clone().into_os_string()),
            ("TMPDIR".into(), tmp_dir.into_os_string()),
        ];
        if config.dialect == Dialect::Codex {
            env.push((
                "CODEX_HOME".into(),
                config.home.join(".codex").into_os_string(),
            ));
        }
        if let Some(path) = &config.path_var {
            env.push(("PATH".into(), path.clone()));
        }
        env.extend(
            config
                .backend
                .env
                .iter()
                .map(|(k, v)| (OsString::from(k), OsString::from(v))),
        );
        env.extend(
            config
                .dialect
                .safety_switches()
                .env_for(&config.backend.env)
                .into_iter()
                .map(|(k, v)| (OsString::from(k), OsString::from(v))),
        );
        if let (Some(name), Some(url)) = (&config.backend.base_url_env, &config.base_url) {
            env.push((name.into(), url.into()));
        }
        let key_env = self.key_env();
        if let Some(key) = config.api_key.as_ref().filter(|k| !k.is_empty())
            && !key_env.is_empty()
        {
            env.push((key_env.into(), key.expose().into()));
        }
        ChildSpec {
            program: PathBuf::from(&config.backend.command),
            args: invocation.args.iter().map(OsString::from).collect(),
            env,
            cwd: config.cwd.clone(),
        }
    }
}

/// Codex's own command sandbox switched off in `args` (`--sandbox <mode>`, `--sandbox=<mode>`
/// and `-c sandbox_mode=...` become `danger-full-access`) for a Codex the pool runs inside
/// its Landlock sandbox: Codex's bubblewrap cannot mount there (Landlock forbids a
/// sandboxed process to change its mounts), so every shell tool call would fail with
/// "error building bubblewrap command"; the pool's walls hold its commands instead.
fn codex_sandbox_off(args: &mut [String]) {
    const OPEN: &str = "danger-full-access";
    let mut value_next = false;
    for arg in args.iter_mut() {
        if value_next {
            *arg = OPEN.to_owned();
            value_next = false;
        } else if arg == "--sandbox" || arg == "-s" {
            value_next = true;
        } else if arg.starts_with("--sandbox=") {
            *arg = format!("--sandbox={OPEN}");
        } else if arg.starts_with("sandbox_mode=") {
            *arg = format!("sandbox_mode={}", toml_string(OPEN));
        }
    }
}

/// `args` without the prompt placeholder: an argument that is exactly `{prompt}` goes with
/// the flag just before it; inside a longer argument it becomes empty.
fn without_prompt_placeholder(args: Vec<String>) -> Vec<String> {
    let mut out: Vec<String> = Vec::with_capacity(args.len());
    for arg in args {
        if arg == PROMPT_PLACEHOLDER {
            if out.last().is_some_and(|prev| prev.starts_with('-')) {
                out.pop();
            }
        } else {
            out.push(arg.replace(PROMPT_PLACEHOLDER, ""));
        }
    }
    out
}

/// `text` as a TOML basic string (JSON's escapes are TOML's).
fn toml_string(text: &str) -> String {
    // JSON's escapes are TOML's, but for DEL, which TOML forbids raw and JSON leaves.
    serde_json::to_string(text)
        .unwrap_or_else(|_| "\"\"".to_owned())
        .replace('\u{7f}', "\\u007F")
}

/// What woke a turn's read loop.
enum Wake {
    Abort,
    Timeout,
    Drained,
    Exited,
    Line(Option<Result<String, LinesCodecError>>),
}

/// The handle that ends a turn (one type for every runner): here it kills the turn's
/// process group.
pub use super::event::AbortHandle;

/// One turn of a [`Oneshot`]: its process and what it printed. Read it with
/// [`OneshotTurn::next`] to its [`BackendEvent::TurnEnd`]; dropping it earlier kills the
/// process group.
pub struct OneshotTurn<'a> {
    conversation: &'a mut Oneshot,
    /// `None` once the process was ended (its group killed, the leader reaped).
    child: Option<ChildGroup>,
    pid: u32,
    exit: watch::Receiver<Option<ExitInfo>>,
    lines: FramedRead<ChildStdout, LinesCodec>,
    stdout_done: bool,
    exit_seen: bool,
    drain_deadline: Option<Instant>,
    deadline: Instant,
    abort: Arc<Notify>,
    queue: VecDeque<BackendEvent>,
    ended: bool,
    format: OutputFormat,
    resumed: bool,
    passed_session: Option<String>,
    learned_session: Option<String>,
    /// Stdout of a `json` or `text` run.
    collected: String,
    /// The final assistant text so far (output transforms not applied yet).
    last_text: Option<String>,
    /// The CLI's own report that the turn failed: message and reason.
    cli_error: Option<TurnFailure>,
    /// The last non-fatal error event (e.g. Codex's `Reconnecting...`).
    error_event: Option<String>,
    /// The usage the CLI reported (totals for Codex).
    reported: Option<UsageTotals>,
    tool_calls: u32,
    started_items: HashSet<String>,
    /// Gemini CLI's `stream-json` run as read so far (the Gemini dialect with `jsonl`
    /// output).
    gemini: Option<gemini::StreamState>,
    retained_bytes: u64,
    retained_lines: u64,
    max_bytes: u64,
    max_lines: u64,
    /// The run's system prompt file and Codex profile, removed when the turn is dropped
    /// (after `child`: the process is killed first).
    _run_files: [Option<RunFile>; 2],
    /// Keeps the bridge serving the CLI's gateway tools from idling out during the run.
    #[cfg(feature = "mcp-bridge")]
    _bridge_hold: Option<super::mcp_bridge::BridgeHold>,
}

impl Drop for OneshotTurn<'_> {
    fn drop(&mut self) {
        // Cut off before its end: what its CLI started is still the conversation's.
        if !self.ended {
            self.keep_session();
        }
    }
}

impl OneshotTurn<'_> {
    /// A handle that aborts this turn.
    pub fn abort_handle(&self) -> AbortHandle {
        AbortHandle::new(self.abort.clone())
    }

    /// The pid (= process group id) of the turn's process while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.child
            .as_ref()
            .filter(|c| c.exit_info().is_none())
            .map(|_| self.pid)
    }

    /// The session id this turn knows (learned from the output, else the one passed).
    pub fn session_id(&self) -> Option<&str> {
        self.learned_session
            .as_deref()
            .or(self.passed_session.as_deref())
    }

    /// The next event; `None` after the [`BackendEvent::TurnEnd`].
    pub async fn next(&mut self) -> Option<BackendEvent> {
        loop {
            if let Some(event) = self.queue.pop_front() {
                return Some(event);
            }
            if self.ended {
                return None;
            }
            if self.stdout_done {
                self.conclude().await;
                continue;
            }
            let abort = self.abort.clone();
            let deadline = self.deadline;
            let drain = self.drain_deadline;
            let exit_seen = self.exit_seen;
            let wake = {
                let exit = &mut self.exit;
                let lines = &mut self.lines;
                tokio::select! {
                    biased;
                    () = abort.notified() => Wake::Abort,
                    () = tokio::time::sleep_until(deadline) => Wake::Timeout,
                    () = sleep_until_opt(drain), if drain.is_some() => Wake::Drained,
                    _ = exit.wait_for(Option::is_some), if !exit_seen => Wake::Exited,
                    line = lines.next() => Wake::Line(line),
                }
            };
            let line = match wake {
                Wake::Abort => {
                    tracing::debug!(pid = self.pid, "cli-oneshot turn aborted");
                    self.child = None;
                    self.end_with(TurnEnd::Aborted, None);
                    continue;
                }
                Wake::Timeout => {
                    self.timed_out().await;
                    continue;
                }
                Wake::Drained => {
                    // The leader is gone but something still holds stdout open.
                    self.stdout_done = true;
                    continue;
                }
                Wake::Exited => {
                    self.exit_seen = true;
                    self.drain_deadline = Some(Instant::now() + DRAIN_AFTER_EXIT);
                    continue;
                }
                Wake::Line(line) => line,
            };
            match line {
                None | Some(Err(LinesCodecError::Io(_))) => self.stdout_done = true,
                Some(Err(LinesCodecError::MaxLineLengthExceeded)) => self.over_limit(true),
                Some(Ok(line)) => self.handle_line(&line),
            }
        }
    }

    /// Reads the turn to its end.
    pub async fn finish(mut self) -> CliTurnOutcome {
        while let Some(event) = self.next().await {
            if let BackendEvent::TurnEnd(outcome) = event {
                return outcome;
            }
        }
        CliTurnOutcome {
            end: Some(TurnEnd::Crashed),
            ..CliTurnOutcome::default()
        }
    }

    fn handle_line(&mut self, line: &str) {
        if self.gemini.is_some() {
            self.gemini_line(line);
            return;
        }
        match self.format {
            OutputFormat::Json | OutputFormat::Text => {
                if !self.retain(line) {
                    return;
                }
                self.collected.push_str(line);
                self.collected.push('\n');
            }
            OutputFormat::Jsonl => match serde_json::from_str::<Value>(line) {
                Ok(value) => {
                    if !is_jsonl_envelope(&value) && !self.retain(line) {
                        return;
                    }
                    self.jsonl_event(&value)
                }
                Err(_) => {
                    if !self.retain(line) {
                        return;
                    }
                    tracing::debug!(
                        bytes = line.len(),
                        "the CLI printed a line that is not JSON"
                    )
                }
            },
        }
    }

    /// One line of Gemini CLI's `stream-json` output: its envelopes (`init`, the prompt's
    /// echo, `result`) are read without counting against the output limits; chunks of the
    /// answer stream as deltas, the CLI's tool calls as `tool.call`s.
    fn gemini_line(&mut self, line: &str) {
        let Ok(value) = serde_json::from_str::<Value>(line) else {
            tracing::debug!(bytes = line.len(), "gemini printed a line that is not JSON");
            self.retain(line);
            return;
        };
        if !gemini::StreamState::is_envelope(&value) && !self.retain(line) {
            return;
        }
        self.note_session_id(&value);
        let Some(state) = self.gemini.as_mut() else {
            return;
        };
        for item in state.line(&value) {
            match item {
                gemini::StreamItem::Delta(delta) => {
                    self.queue.push_back(BackendEvent::MessageDelta { delta });
                }
                gemini::StreamItem::Message(text) => self.message(text),
                gemini::StreamItem::ToolCall { id, name, input } => {
                    self.tool_calls += 1;
                    self.queue
                        .push_back(BackendEvent::ToolCall { id, name, input });
                }
            }
        }
    }

    /// One JSONL event: Codex's `exec --json` events, and the generic shapes of other CLIs
    /// (`result` / `response` texts, `is_error`, `usage`).
    fn jsonl_event(&mut self, value: &Value) {
        self.note_session_id(value);
        let kind = value["type"].as_str().unwrap_or("");
        match kind {
            "item.started" => self.tool_item(&value["item"]),
            "item.completed" => {
                let item = &value["item"];
                if item["type"] == "agent_message" {
                    if let Some(text) = item["text"].as_str() {
                        self.message(text.to_owned());
                    }
                } else {
                    self.tool_item(item);
                }
            }
            "turn.completed" => self.reported = usage_of(&value["usage"]),
            "turn.failed" => {
                let message = value["error"]["message"]
                    .as_str()
                    .or_else(|| value["message"].as_str())
                    .unwrap_or("the turn failed")
                    .to_owned();
                self.cli_error = Some(TurnFailure::Cli {
                    message,
                    reason: Some("turn.failed".to_owned()),
                    status: None,
                });
            }
            "error" => {
                self.error_event = value["message"].as_str().map(str::to_owned);
            }
            _ => self.generic_document(value),
        }
    }

    /// A CLI's tool item as a `tool.call` (once per item id).
    fn tool_item(&mut self, item: &Value) {
        let kind = item["type"].as_str().unwrap_or("");
        let input = match kind {
            "command_execution" => json!({ "command": item["command"] }),
            "file_change" => json!({ "changes": item["changes"] }),
            "mcp_tool_call" => item["arguments"].clone(),
            "web_search" => json!({ "query": item["query"] }),
            _ => return,
        };
        let id = item["id"].as_str().unwrap_or("").to_owned();
        if !self.started_items.insert(id.clone()) {
            return;
        }
        let name = match kind {
            "mcp_tool_call" => format!(
                "{}/{}",
                item["server"].as_str().unwrap_or(""),
                item["tool"].as_str().unwrap_or("")
            ),
            other => other.to_owned(),
        };
        self.tool_calls += 1;
        self.queue
            .push_back(BackendEvent::ToolCall { id, name, input });
    }

    /// The final text, error flag and usage of a one-document answer (Claude `-p --output-
    /// format json`: `result`, `is_error`, `usage`; Gemini: `response`, `error`, `stats`).
    fn generic_document(&mut self, value: &Value) {
        let text = ["result", "response"]
            .iter()
            .find_map(|key| value[*key].as_str());
        let is_error = value["is_error"].as_bool() == Some(true);
        if is_error {
            self.cli_error = Some(TurnFailure::Cli {
                message: text.unwrap_or("the CLI reported an error").to_owned(),
                reason: value["terminal_reason"].as_str().map(str::to_owned),
                status: super::event::reported_status(value),
            });
        } else if let Some(message) = value["error"]["message"].as_str() {
            self.cli_error = Some(TurnFailure::Cli {
                message: message.to_owned(),
                reason: value["error"]["type"].as_str().map(str::to_owned),
                status: None,
            });
        } else if let Some(text) = text {
            self.message(text.to_owned());
        }
        if let Some(usage) = usage_of(&value["usage"]).or_else(|| gemini_stats(&value["stats"])) {
            self.reported = Some(usage);
        }
    }

    fn message(&mut self, text: String) {
        let shown = self.conversation.config.backend.transform(&text, true);
        self.last_text = Some(text);
        self.queue.push_back(BackendEvent::Message { text: shown });
    }

    fn note_session_id(&mut self, value: &Value) {
        if self.conversation.config.backend.session_mode == SessionMode::None {
            return;
        }
        for field in &self.conversation.config.backend.session_id_fields {
            if let Some(id) = value.get(field).and_then(Value::as_str)
                && !id.is_empty()
            {
                self.learned_session = Some(id.to_owned());
                return;
            }
        }
    }

    /// Counts a retained line; false (and the turn ended) when it passes a limit.
    fn retain(&mut self, line: &str) -> bool {
        self.retained_lines += 1;
        self.retained_bytes += line.len() as u64 + 1;
        if self.retained_bytes > self.max_bytes {
            self.over_limit(true);
            return false;
        }
        if self.retained_lines > self.max_lines {
            self.over_limit(false);
            return false;
        }
        true
    }

    fn over_limit(&mut self, bytes: bool) {
        let failure = if bytes {
            TurnFailure::OutputLimit {
                unit: "bytes",
                key: "maxTurnRawChars",
                limit: self.max_bytes,
                cap: super::MAX_TURN_RAW_CHARS_CAP,
            }
        } else {
            TurnFailure::OutputLimit {
                unit: "lines",
                key: "maxTurnLines",
                limit: self.max_lines,
                cap: super::MAX_TURN_LINES_CAP,
            }
        };
        tracing::warn!(backend = %self.conversation.config.id, %failure, "cli-oneshot turn stopped");
        self.child = None;
        if let Some(state) = &self.gemini {
            // The answer streamed so far (the gateway has its deltas already).
            if !state.text().is_empty() {
                self.last_text = Some(state.text().to_owned());
            }
            if let Some(usage) = state.usage() {
                self.reported = Some(UsageTotals::of(usage));
            }
        } else if self.format != OutputFormat::Jsonl && self.last_text.is_none() {
            // Plain text is kept as far as read. A one-document answer cut short is not JSON,
            // but a pretty-printed one (Gemini CLI's) may already hold its answer and session
            // on lines of their own: those are kept.
            if self.format == OutputFormat::Text && !self.collected.is_empty() {
                self.last_text = Some(self.collected.trim_end().to_owned());
            } else if self.format == OutputFormat::Json {
                for key in &self.conversation.config.backend.session_id_fields {
                    if let Some(id) = cut_document_field(&self.collected, key) {
                        self.learned_session = Some(id);
                        break;
                    }
                }
                self.last_text = ["response", "result"]
                    .iter()
                    .find_map(|key| cut_document_field(&self.collected, key));
            }
        }
        self.end_with(TurnEnd::Error, Some(failure));
    }

    async fn timed_out(&mut self) {
        let stderr_tail = match self.child.take() {
            Some(child) => {
                let tail = tail_chars(&child.stderr().text(), STDERR_TAIL_CHARS);
                drop(child);
                tail
            }
            None => String::new(),
        };
        let failure = TurnFailure::TimedOut {
            limit_secs: self.conversation.config.turn_timeout.as_secs(),
            stderr_tail,
        };
        tracing::warn!(backend = %self.conversation.config.id, %failure, "cli-oneshot turn timed out");
        self.end_with(TurnEnd::Timeout, Some(failure));
    }

    /// Stdout closed: wait for the exit status, read a one-document answer, and end the
    /// turn by what the process said and how it ended.
    async fn conclude(&mut self) {
        let (exit, full_stderr) = match self.child.take() {
            Some(child) => {
                let exit = tokio::time::timeout(EXIT_WAIT, child.wait()).await.ok();
                child.stderr().settled(STDERR_WAIT).await;
                // `child` dropped here: the group is killed if anything is left.
                (exit, child.stderr().text())
            }
            None => (None, String::new()),
        };
        let stderr = tail_chars(&full_stderr, STDERR_TAIL_CHARS);
        if self.conversation.config.dialect == Dialect::Gemini
            && let Some(info @ ExitInfo::Code(_)) = exit
        {
            self.conclude_gemini(info, &full_stderr);
            return;
        }
        match self.format {
            OutputFormat::Json => {
                let document = std::mem::take(&mut self.collected);
                match serde_json::from_str::<Value>(document.trim()) {
                    Ok(value) => {
                        self.note_session_id(&value);
                        self.generic_document(&value);
                    }
                    Err(_) if !document.trim().is_empty() => {
                        tracing::debug!(
                            bytes = document.len(),
                            "the CLI's json output did not parse"
                        );
                    }
                    Err(_) => {}
                }
            }
            OutputFormat::Text => {
                let text = self.collected.trim().to_owned();
                if !text.is_empty() {
                    self.message(text);
                }
            }
            OutputFormat::Jsonl => {}
        }
        let crashed = |exit: String| TurnFailure::Crashed {
            exit,
            stderr_tail: stderr.clone(),
        };
        let (end, failure) = match exit {
            None => (
                TurnEnd::Crashed,
                Some(crashed(
                    "still running after its output closed; killed".to_owned(),
                )),
            ),
            Some(info @ ExitInfo::Signal(_)) => (TurnEnd::Crashed, Some(crashed(info.to_string()))),
            Some(info) => match (&self.cli_error, info) {
                (Some(failure), _) => (TurnEnd::Error, Some(failure.clone())),
                (None, ExitInfo::Code(0)) => (TurnEnd::Idle, None),
                (None, _) if self.last_text.is_some() || self.error_event.is_some() => {
                    let message = self
                        .error_event
                        .clone()
                        .unwrap_or_else(|| format!("the CLI ended with {info} after its answer"));
                    (
                        TurnEnd::Error,
                        Some(TurnFailure::Cli {
                            message,
                            reason: Some(info.to_string()),
                            status: None,
                        }),
                    )
                }
                (None, _) => (TurnEnd::Crashed, Some(crashed(info.to_string()))),
            },
        };
        if end == TurnEnd::Crashed {
            // Shown (`Display`): its stderr's URLs without their queries.
            if let Some(failure) = &failure {
                tracing::debug!(backend = %self.conversation.config.id, %failure, "cli-oneshot process crashed");
            }
        }
        self.end_with(end, failure);
    }

    /// Gemini CLI exited (not killed): its answer (read from its stream as it came, or its
    /// one JSON document), or its typed failure.
    fn conclude_gemini(&mut self, exit: ExitInfo, stderr: &str) {
        let result = match &self.gemini {
            Some(state) => {
                // A failed run's model calls count too.
                if let Some(usage) = state.usage() {
                    self.reported = Some(UsageTotals::of(usage));
                }
                state.finish(exit, stderr)
            }
            None => gemini::parse_output(exit, &std::mem::take(&mut self.collected), stderr),
        };
        match result {
            Ok(reply) => {
                if let Some(id) = reply.session_id.filter(|id| !id.is_empty()) {
                    self.learned_session = Some(id);
                }
                self.tool_calls = u32::try_from(reply.tool_calls).unwrap_or(u32::MAX);
                self.reported = Some(UsageTotals::of(reply.usage));
                self.message(reply.text);
                self.end_with(TurnEnd::Idle, None);
            }
            Err(error) => {
                tracing::debug!(backend = %self.conversation.config.id, %error, "gemini run failed");
                self.end_with(TurnEnd::Error, Some(TurnFailure::Gemini { error }));
            }
        }
    }

    /// Stores the session this turn ran in (learned from the output, else the one passed)
    /// in the conversation, for the next turn to continue: at the turn's end, and when the
    /// turn is dropped before it (its caller gone), since the CLI may have started a
    /// session by then that holds the exchange so far.
    fn keep_session(&mut self) {
        if self.conversation.config.backend.session_mode == SessionMode::None {
            return;
        }
        let Some(id) = self
            .learned_session
            .clone()
            .or_else(|| self.passed_session.clone())
        else {
            return;
        };
        let same = self
            .conversation
            .session
            .as_ref()
            .is_some_and(|s| s.session_id == id);
        if !same {
            self.conversation.session = Some(StoredSession::new(id));
        }
    }

    /// Ends the turn: stores the session, de-cumulates the usage, queues the `turn.end`.
    fn end_with(&mut self, end: TurnEnd, failure: Option<TurnFailure>) {
        if self.ended {
            return;
        }
        self.ended = true;
        self.keep_session();
        let config = &self.conversation.config;
        let mut usage = Usage::default();
        if let Some(reported) = self.reported {
            usage = match (config.dialect, self.conversation.session.as_mut()) {
                (Dialect::Codex, Some(stored)) => {
                    let turn = reported.since(stored.usage_totals);
                    stored.usage_totals = reported;
                    turn
                }
                _ => reported.as_usage(),
            };
        }
        let text = self
            .last_text
            .as_deref()
            .map(|t| config.backend.transform(t, true))
            .unwrap_or_default();
        self.queue.push_back(BackendEvent::TurnEnd(CliTurnOutcome {
            text,
            end: Some(end),
            failure,
            usage,
            session_id: self.conversation.session_id().map(str::to_owned),
            resumed: self.resumed,
            tool_calls: self.tool_calls,
            permission_prompts: 0,
            retained_lines: self.retained_lines,
            retained_bytes: self.retained_bytes,
            tool_calls_unseen: self.gemini.is_none()
                && matches!(self.format, OutputFormat::Json | OutputFormat::Text),
        }));
    }
}

/// The string at top-level `key` of a pretty-printed (two-space indented) JSON object that
/// was cut short: its `  "key": "..."` line, when that line arrived whole.
/// Whether a JSONL event (Codex's `exec --json` vocabulary) is an envelope of the stream,
/// not output the turn retains (so not counted against `outputLimits`): the thread's and
/// the turn's start and end (`thread.started`, `turn.started`, `turn.completed`,
/// `turn.failed`). Items (`item.*`, the final message among them) and `error` lines are
/// retained.
pub(crate) fn is_jsonl_envelope(value: &Value) -> bool {
    matches!(
        value.get("type").and_then(Value::as_str),
        Some("thread.started" | "turn.started" | "turn.completed" | "turn.failed")
    )
}

fn cut_document_field(document: &str, key: &str) -> Option<String> {
    let prefix = format!("  \"{key}\":");
    document.lines().find_map(|line| {
        let value = line.strip_prefix(&prefix)?.trim();
        let value = value.strip_suffix(',').unwrap_or(value);
        serde_json::from_str::<String>(value).ok()
    })
}

/// A `usage` object in the names Codex and Claude use; `None` when there is none.
fn usage_of(usage: &Value) -> Option<UsageTotals> {
    if !usage.is_object() {
        return None;
    }
    let number = |keys: &[&str]| keys.iter().find_map(|k| usage[*k].as_u64()).unwrap_or(0);
    Some(UsageTotals {
        input_tokens: number(&["input_tokens"]),
        output_tokens: number(&["output_tokens"]),
        cache_read_tokens: number(&["cached_input_tokens", "cache_read_input_tokens"]),
        cache_write_tokens: number(&["cache_write_input_tokens", "cache_creation_input_tokens"]),
    })
}

/// Gemini's `stats.models.<model>.tokens`, summed over the models.
fn gemini_stats(stats: &Value) -> Option<UsageTotals> {
    let models = stats["models"].as_object()?;
    let mut total = UsageTotals::default();
    for model in models.values() {
        let tokens = &model["tokens"];
        let number = |key: &str| tokens[key].as_u64().unwrap_or(0);
        total.input_tokens += number("prompt");
        total.output_tokens += number("candidates");
        total.cache_read_tokens += number("cached");
    }
    Some(total)
}

async fn sleep_until_opt(deadline: Option<Instant>) {
    match deadline {
        Some(deadline) => tokio::time::sleep_until(deadline).await,
        None => std::future::pending().await,
    }
}

/// The end of `text`, at most `max` characters.
fn tail_chars(text: &str, max: usize) -> String {
    let count = text.chars().count();
    text.chars().skip(count.saturating_sub(max)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::{SESSION_ID_PLACEHOLDER, TextRewrite};
    use std::collections::BTreeMap;

    /// A generic backend whose "CLI" is `/bin/sh -c <script> sh [args...] <prompt>`.
    fn sh_config(dir: &Path, script: &str) -> OneshotConfig {
        let mut backend = CliBackendConfig::new("/bin/sh");
        backend.args = vec!["-c".into(), script.into(), "sh".into()];
        backend.resume_args = Some(vec![
            "-c".into(),
            script.into(),
            "sh".into(),
            "resume".into(),
            SESSION_ID_PLACEHOLDER.into(),
        ]);
        backend.output = OutputFormat::Jsonl;
        backend.session_id_fields = vec!["thread_id".into()];
        let mut config = OneshotConfig::new("sh-cli", backend, dir.join("home"), dir.join("work"));
        config.path_var = Some("/usr/bin:/bin".into());
        config.turn_timeout = Duration::from_secs(30);
        config
    }

    #[tokio::test]
    async fn a_run_whose_output_shows_no_tool_call_until_its_end_says_its_tool_calls_were_unseen() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(dir.path().join("home")).unwrap();
        std::fs::create_dir_all(dir.path().join("work")).unwrap();
        for (output, unseen) in [
            (OutputFormat::Json, true),
            (OutputFormat::Text, true),
            (OutputFormat::Jsonl, false),
        ] {
            // A crash before any output.
            let mut config = sh_config(dir.path(), "kill -9 $$");
            config.backend.output = output;
            let mut oneshot = Oneshot::new(config).unwrap();
            let (outcome, _) = run(&mut oneshot, "p").await;
            assert_eq!(
                outcome.end,
                Some(TurnEnd::Crashed),
                "{output:?}: {outcome:?}"
            );
            assert_eq!(outcome.tool_calls_unseen, unseen, "{output:?}");
        }
    }

    fn codex(dir: &Path) -> Oneshot {
        let mut config = OneshotConfig::codex("/opt/codex", dir.join("home"), dir.join("work"));
        config.base_url = Some("http://127.0.0.1:9/v1".into());
        config.api_key = Some(Secret::new("sk-FAKE-do-not-print"));
        Oneshot::new(config).expect("valid")
    }

    const MESSAGE: &str =
        r#"{"type":"item.completed","item":{"id":"m","type":"agent_message","text":"done"}}"#;

    async fn run(oneshot: &mut Oneshot, prompt: &str) -> (CliTurnOutcome, Vec<BackendEvent>) {
        let mut events = Vec::new();
        let outcome = tokio::time::timeout(
            Duration::from_secs(60),
            oneshot.run(prompt, |e| events.push(e.clone())),
        )
        .await
        .expect("the turn ended")
        .expect("the turn started");
        (outcome, events)
    }

    fn mode(path: &Path) -> u32 {
        use std::os::unix::fs::PermissionsExt;
        std::fs::metadata(path).unwrap().permissions().mode() & 0o777
    }

    #[tokio::test]
    async fn a_run_in_a_fresh_home_makes_its_directories_private() {
        let dir = tempfile::tempdir().unwrap();
        let mut oneshot = Oneshot::new(sh_config(dir.path(), "exit 0")).unwrap();
        let _ = oneshot.run("hello", |_| {}).await;
        let home = dir.path().join("home");
        for made in [home.clone(), home.join("tmp"), dir.path().join("work")] {
            assert_eq!(mode(&made), 0o700, "{made:?}");
        }
        // Codex's own home too (its CLI is missing here: the run fails after them).
        let dir = tempfile::tempdir().unwrap();
        let _ = codex(dir.path()).run("hello", |_| {}).await;
        let home = dir.path().join("home");
        for made in [home.clone(), home.join("tmp"), home.join(".codex")] {
            assert_eq!(mode(&made), 0o700, "{made:?}");
        }
    }

    #[tokio::test]
    async fn a_prompt_that_names_another_agents_file_is_not_granted_by_the_sandbox() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().canonicalize().unwrap();
        let bob = root.join("agents/bob/claude-cli");
        std::fs::create_dir_all(&bob).unwrap();
        let credentials = bob.join(".claude.json");
        std::fs::write(&credentials, "{}").unwrap();
        // A wrapper that records the rules it is given, and runs nothing.
        let rules = root.join("rules.txt");
        let wrapper = crate::sandbox::Sandbox::new(
            "/bin/sh".into(),
            vec![
                "-c".into(),
                format!(r#"printf '%s\n' "$@" > '{}'"#, rules.display()).into(),
                "sh".into(),
            ],
        );
        let alice = root.join("agents/alice");
        // A generic backend whose `args` start with the prompt.
        let mut backend = CliBackendConfig::new("/bin/echo");
        backend.args = vec![crate::backend::PROMPT_PLACEHOLDER.into()];
        backend.output = OutputFormat::Text;
        backend.session_mode = SessionMode::None;
        let mut config = OneshotConfig::new(
            "generic",
            backend,
            alice.join("generic"),
            alice.join("work"),
        );
        config.path_var = Some("/usr/bin:/bin".into());
        config.sandbox = Some(wrapper.for_cli_agent(&alice, &[443]).unwrap());
        let mut oneshot = Oneshot::new(config).unwrap();
        let _ = oneshot.run(credentials.to_str().unwrap(), |_| {}).await;
        let rules = std::fs::read_to_string(&rules).unwrap();
        let lines: Vec<&str> = rules.lines().collect();
        let granted: Vec<&str> = lines
            .windows(2)
            .filter(|w| ["--rx", "--ro", "--rw", "--agent-dir"].contains(&w[0]))
            .map(|w| w[1])
            .collect();
        assert!(
            lines.contains(&credentials.to_str().unwrap()),
            "the prompt is the argument: {rules}"
        );
        assert!(
            granted
                .iter()
                .all(|p| !Path::new(p).starts_with(root.join("agents/bob"))),
            "{granted:?}"
        );
    }

    #[test]
    fn codex_runs_resume_after_its_exec_flags_with_the_provider_and_no_key_in_the_argv() {
        let dir = tempfile::tempdir().unwrap();
        let mut oneshot = codex(dir.path());
        let fresh = oneshot.invocation("hello", &[], None).unwrap();
        assert!(!fresh.resumed);
        assert_eq!(fresh.stdin_prompt.as_deref(), Some("hello"), "on stdin");
        assert!(!fresh.args.iter().any(|a| a == "hello"));
        let at = fresh
            .args
            .iter()
            .position(|a| a == "-p")
            .expect("the provider's profile is named");
        assert!(
            at < fresh.args.iter().position(|a| a == "exec").unwrap(),
            "global options go before the subcommand"
        );
        let profile = fresh.codex_profile.as_ref().expect("a profile");
        assert_eq!(fresh.args[at + 1], profile.name);
        for part in [
            r#"model_provider = "copilot_pool""#,
            r#"base_url = "http://127.0.0.1:9/v1""#,
            r#"wire_api = "responses""#,
            "request_max_retries = 1",
            "stream_max_retries = 1",
            r#"env_key = "COPILOT_POOL_MODEL_KEY""#,
        ] {
            assert!(profile.text.contains(part), "{part} in {}", profile.text);
        }
        assert!(
            fresh.args.iter().all(|a| !a.contains("127.0.0.1:9")),
            "the endpoint is not on the command line: {:?}",
            fresh.args
        );
        assert!(fresh.args.iter().all(|a| !a.contains("do-not-print")));

        oneshot.session = Some(StoredSession::new("thread-1"));
        let resumed = oneshot.invocation("again", &[], None).unwrap();
        assert!(resumed.resumed);
        let n = resumed.args.len();
        assert_eq!(resumed.args[n - 2..], ["resume", "thread-1"]);
        assert_eq!(resumed.stdin_prompt.as_deref(), Some("again"));
        assert_eq!(resumed.output, OutputFormat::Jsonl);
        let spec = oneshot.child_spec(&resumed, dir.path().join("home/tmp"));
        let env: std::collections::HashMap<_, _> = spec.env.into_iter().collect();
        assert_eq!(env[&OsString::from(CODEX_KEY_ENV)], "sk-FAKE-do-not-print");
        assert_eq!(
            env[&OsString::from("CODEX_HOME")],
            dir.path().join("home/.codex").into_os_string()
        );
        // A prompt Codex would read as an option goes on stdin.
        let flag = oneshot.invocation("--help me", &[], None).unwrap();
        assert_eq!(flag.stdin_prompt.as_deref(), Some("--help me"));
        assert_ne!(flag.args.last().map(String::as_str), Some("--help me"));
    }

    #[test]
    fn codexs_profile_carries_the_endpoints_query_as_its_query_params_as_given() {
        let profile = CodexProfile::new(
            "https://llm.example/v1?api-version=2025-01-01&key=s%26cret&flag",
            Some("K"),
        )
        .unwrap();
        assert!(
            profile
                .text
                .contains(r#"base_url = "https://llm.example/v1""#),
            "{}",
            profile.text
        );
        assert!(
            profile.text.contains(
                r#"query_params = { "api-version" = "2025-01-01", "key" = "s%26cret", "flag" = "" }"#
            ),
            "{}",
            profile.text
        );
        assert!(profile.text.contains(&format!("codex -p {}", profile.name)));
        // A run, a file: runs never share one, even with one provider.
        let other = CodexProfile::new("https://llm.example/v1?key=other", Some("K")).unwrap();
        let again = CodexProfile::new("https://llm.example/v1?key=other", Some("K")).unwrap();
        assert_ne!(again.name, other.name);
        assert_eq!(
            again.text.replace(&again.name, ""),
            other.text.replace(&other.name, "")
        );
        assert!(!format!("{other:?}").contains("other"), "{other:?}");
        let twice = CodexProfile::new("https://llm.example/v1?a=1&a=2", None).unwrap_err();
        assert!(twice.to_string().contains("'a' twice"), "{twice}");
        let fragment = CodexProfile::new("https://llm.example/v1#x", None).unwrap_err();
        assert!(fragment.to_string().contains("fragment"), "{fragment}");
    }

    #[test]
    fn codexs_profile_is_a_private_file_of_its_run_that_goes_with_it_and_never_through_a_link() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let home = dir.path();
        std::fs::create_dir(home.join(".codex")).unwrap();
        let profile = CodexProfile::new("http://127.0.0.1:9/v1?k=v", None).unwrap();
        let file = profile.write(home, Duration::from_secs(60)).unwrap();
        let path = home
            .join(".codex")
            .join(format!("{}.config.toml", profile.name));
        assert_eq!(file.path, path);
        let meta = std::fs::symlink_metadata(&path).unwrap();
        assert!(meta.is_file());
        assert_eq!(meta.permissions().mode() & 0o777, 0o600);
        assert_eq!(std::fs::read_to_string(&path).unwrap(), profile.text);
        drop(file);
        assert!(!path.exists(), "the key in its query leaves with the run");

        // A link planted in its place is refused, never written through.
        std::os::unix::fs::symlink(home.join("elsewhere"), &path).unwrap();
        assert!(profile.write(home, Duration::from_secs(60)).is_err());
        assert!(!home.join("elsewhere").exists());
        std::fs::remove_file(&path).unwrap();

        // With `.codex` swapped for a link after the write, the drop removes nothing where it
        // leads.
        let file = profile.write(home, Duration::from_secs(60)).unwrap();
        std::fs::rename(home.join(".codex"), home.join("moved")).unwrap();
        std::os::unix::fs::symlink(home.join("moved"), home.join(".codex")).unwrap();
        drop(file);
        assert!(
            home.join("moved")
                .join(format!("{}.config.toml", profile.name))
                .exists(),
            "nothing removed through the link"
        );
        std::fs::remove_file(home.join(".codex")).unwrap();
        std::fs::rename(home.join("moved"), home.join(".codex")).unwrap();

        // What a crash left a day ago (this version's names and the content-hash names
        // earlier versions never removed) goes with the next run's write; a recent one (a
        // running conversation's) and a file the pool did not name stay.
        let codex = home.join(".codex");
        let a_day_ago = std::time::SystemTime::now() - LEFT_RUN_FILE_AGE - Duration::from_secs(1);
        let old = |name: &str| {
            let path = codex.join(name);
            std::fs::File::create(&path)
                .and_then(|f| f.set_modified(a_day_ago))
                .unwrap();
            path
        };
        let (stale, earlier, theirs) = (
            old(&format!("copilot-pool-{}.config.toml", "a".repeat(32))),
            old(&format!("copilot-pool-{}.config.toml", "c".repeat(16))),
            old("copilot-pool-mine.config.toml"),
        );
        let recent = codex.join(format!("copilot-pool-{}.config.toml", "b".repeat(32)));
        std::fs::write(&recent, "running").unwrap();
        let next = CodexProfile::new("http://127.0.0.1:9/v1?k=v", None).unwrap();
        let file = next.write(home, Duration::from_secs(60)).unwrap();
        assert!(!stale.exists(), "a crash's leftover is removed");
        assert!(!earlier.exists(), "an earlier version's file is removed");
        assert!(recent.exists(), "another run's file stays");
        assert!(theirs.exists(), "a file the pool did not name stays");
        drop(file);
    }

    #[test]
    fn a_codex_backend_whose_args_name_a_profile_is_refused_with_the_fix() {
        let dir = tempfile::tempdir().unwrap();
        for flag in ["-p", "--profile", "--profile=mine", "-pmine"] {
            let mut oneshot = codex(dir.path());
            oneshot.config.backend.args.insert(0, flag.to_owned());
            let refused = oneshot.invocation("hello", &[], None).unwrap_err();
            assert!(
                refused.to_string().contains("config.toml"),
                "{flag}: {refused}"
            );
        }
    }

    #[test]
    fn codex_in_the_pools_sandbox_runs_its_commands_without_its_own_bubblewrap() {
        let mut args: Vec<String> = [
            "-c",
            "sandbox_mode=\"workspace-write\"",
            "exec",
            "--sandbox",
            "workspace-write",
            "--sandbox=read-only",
            "--json",
        ]
        .map(String::from)
        .to_vec();
        codex_sandbox_off(&mut args);
        assert_eq!(
            args,
            [
                "-c",
                "sandbox_mode=\"danger-full-access\"",
                "exec",
                "--sandbox",
                "danger-full-access",
                "--sandbox=danger-full-access",
                "--json"
            ]
        );
    }

    #[test]
    fn a_model_name_that_reads_like_a_flag_takes_no_safety_switch_off() {
        let argv = |config: OneshotConfig| {
            let oneshot = Oneshot::new(config).unwrap();
            oneshot.invocation("hi", &[], None).unwrap().args
        };
        let dir = tempfile::tempdir().unwrap();
        let mut config = OneshotConfig::codex("/opt/codex", dir.path().join("h"), dir.path());
        config.model = Some("--config=analytics.enabled=true".to_owned());
        let args = argv(config);
        assert!(
            args.iter().any(|a| a == "analytics.enabled=false"),
            "{args:?}"
        );
        // Claude Code run as a one-shot CLI keeps its setting sources the same way.
        let mut claude = CliBackendConfig::bundled("claude-cli").unwrap();
        claude.kind = crate::backend::BackendKind::CliOneshot;
        let mut config = OneshotConfig::new("claude-cli", claude, dir.path().join("h"), dir.path());
        config.dialect = Dialect::Claude;
        config.model = Some("--setting-sources=user,project".to_owned());
        config.system_prompt = Some("--strict-mcp-config=false".to_owned());
        let args = argv(config);
        let at = args
            .iter()
            .rposition(|a| a == "--setting-sources")
            .expect("the switch");
        assert_eq!(args[at + 1], "user", "{args:?}");
        assert!(
            args.iter().filter(|a| *a == "--strict-mcp-config").count() == 1,
            "{args:?}"
        );
    }

    #[test]
    fn codex_keeps_its_safety_switches_under_overridden_args_and_gets_effort_and_bounded_retries() {
        let dir = tempfile::tempdir().unwrap();
        let mut config = OneshotConfig::codex("/opt/codex", dir.path().join("h"), dir.path());
        config.backend.args = ["exec", "--json", "-c", "analytics.enabled=true"]
            .map(String::from)
            .to_vec();
        config.backend.resume_args = None;
        config.backend.session_mode = SessionMode::None;
        config.backend.env = BTreeMap::from([("RUST_LOG".into(), "warn".into())]);
        config.reasoning_effort = Some(ReasoningEffort::High);
        config.api_key = Some(Secret::new("sk-FAKE-do-not-print"));
        let oneshot = Oneshot::new(config).unwrap();
        let invocation = oneshot.invocation("hi", &[], None).unwrap();
        let args = invocation.args;
        for switch in [
            "features.plugins=false",
            "check_for_update_on_startup=false",
            "features.unbounded_connection_retries=false",
            r#"model_reasoning_effort="high""#,
        ] {
            assert!(args.iter().any(|a| a == switch), "{switch} in {args:?}");
        }
        // The key the configuration names is its own.
        assert!(
            !args.iter().any(|a| a == "analytics.enabled=false"),
            "{args:?}"
        );
        // No base URL but a key: OpenAI's endpoint, declared by the pool, retries bounded.
        let provider = invocation.codex_profile.expect("a provider").text;
        for part in [
            r#"base_url = "https://api.openai.com/v1""#,
            "request_max_retries = 1",
            "stream_max_retries = 1",
            r#"env_key = "OPENAI_API_KEY""#,
        ] {
            assert!(provider.contains(part), "{part} in {provider}");
        }
        // Neither: the CLI's own login through its built-in provider.
        let mut config = OneshotConfig::codex("/opt/codex", dir.path().join("h"), dir.path());
        config.backend.args = vec!["exec".into(), "-c".into(), "x=1".into()];
        config.backend.session_mode = SessionMode::None;
        let invocation = Oneshot::new(config)
            .unwrap()
            .invocation("hi", &[], None)
            .unwrap();
        assert!(invocation.codex_profile.is_none());
        let args = invocation.args;
        assert!(!args.iter().any(|a| a == "-p"), "{args:?}");
        assert!(!args.iter().any(|a| a.contains("reasoning")), "{args:?}");
        assert!(
            args.iter().any(|a| a == "analytics.enabled=false"),
            "{args:?}"
        );
    }

    #[test]
    fn gemini_is_trusted_whatever_its_env_unless_the_env_names_the_variable() {
        let dir = tempfile::tempdir().unwrap();
        let env_of = |env: &[(&str, &str)]| {
            let mut config = OneshotConfig::gemini("/opt/gemini", dir.path().join("h"), dir.path());
            config.backend.env = env
                .iter()
                .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                .collect();
            let oneshot = Oneshot::new(config).unwrap();
            let invocation = oneshot.invocation("hi", &[], None).unwrap();
            oneshot
                .child_spec(&invocation, dir.path().join("tmp"))
                .env
                .into_iter()
                .filter(|(k, _)| k == "GEMINI_CLI_TRUST_WORKSPACE")
                .map(|(_, v)| v)
                .collect::<Vec<_>>()
        };
        assert_eq!(env_of(&[("HTTPS_PROXY", "http://p:3128")]), ["false"]);
        assert_eq!(env_of(&[("GEMINI_CLI_TRUST_WORKSPACE", "true")]), ["true"]);
    }

    #[test]
    fn the_bundled_codex_and_gemini_never_put_the_prompt_on_their_command_line() {
        // The host's other users read every process's command line (`/proc/<pid>/cmdline`).
        let dir = tempfile::tempdir().unwrap();
        let prompt = "the secret is 4242";
        let made = |dialect: Dialect, session: Option<&str>| {
            let (home, work) = (dir.path().join("h"), dir.path().join("w"));
            let mut config = match dialect {
                Dialect::Codex => OneshotConfig::codex("/nonexistent/codex", home, work),
                _ => OneshotConfig::gemini("/nonexistent/gemini", home, work),
            };
            config.session = session.map(StoredSession::new);
            Oneshot::new(config).expect("valid")
        };
        for dialect in [Dialect::Codex, Dialect::Gemini] {
            for session in [None, Some("0199a213-81c0-7800-8aa1-bbab2a035a53")] {
                let run = made(dialect, session)
                    .invocation(prompt, &[], None)
                    .expect("an invocation");
                assert_eq!(run.resumed, session.is_some());
                assert_eq!(run.stdin_prompt.as_deref(), Some(prompt), "{dialect:?}");
                assert!(
                    !run.args.iter().any(|a| a.contains("4242")),
                    "{dialect:?}: {:?}",
                    run.args
                );
            }
        }
        // Past what Gemini CLI reads of stdin it would drop the rest: refused, not cut.
        let long = "x".repeat(GEMINI_MAX_STDIN_BYTES + 1);
        let refused = made(Dialect::Gemini, None)
            .invocation(&long, &[], None)
            .expect_err("refused");
        assert!(
            matches!(refused, OneshotError::PromptTooLongForStdin { max, .. } if max == GEMINI_MAX_STDIN_BYTES),
            "{refused}"
        );
        assert!(refused.to_string().contains("shorten the prompt"));
        made(Dialect::Codex, None)
            .invocation(&long, &[], None)
            .expect("Codex reads all of it");
    }

    #[tokio::test]
    async fn gemini_gets_images_as_at_references_in_its_prompt_and_none_from_outside_its_workspace()
    {
        let dir = tempfile::tempdir().unwrap();
        let work = dir.path().join("work");
        std::fs::create_dir_all(work.join("my pics")).unwrap();
        let inside = work.join("my pics").join("a.png");
        std::fs::write(&inside, b"\x89PNG\r\n\x1a\n").unwrap();
        let outside = dir.path().join("b.png");
        std::fs::write(&outside, b"\x89PNG\r\n\x1a\n").unwrap();
        let config = OneshotConfig::gemini("/nonexistent/gemini", dir.path().join("h"), &work);
        let mut oneshot = Oneshot::new(config).unwrap();
        let run = oneshot
            .invocation("look", std::slice::from_ref(&inside), None)
            .unwrap();
        assert_eq!(
            run.stdin_prompt.as_deref(),
            // Relative to the working directory (an absolute one Gemini globs from `/`).
            Some("look\n\n@my\\ pics/a.png"),
            "{:?}",
            run.args
        );
        // Refused before any process: Gemini CLI would skip it without a word.
        let refused = oneshot
            .start_turn_with_images("look", &[inside, outside])
            .await
            .err()
            .expect("refused");
        assert!(
            matches!(
                refused,
                OneshotError::Image(ImageError::OutsideWorkspace { .. })
            ),
            "{refused}"
        );
        assert!(
            refused
                .to_string()
                .contains("put the image under the working directory"),
            "{refused}"
        );
    }

    #[test]
    fn a_prompt_over_max_prompt_arg_chars_goes_to_stdin_or_is_refused_with_a_typed_error() {
        let dir = tempfile::tempdir().unwrap();
        let mut config = sh_config(dir.path(), "true");
        config.backend.max_prompt_arg_chars = Some(10);
        config
            .backend
            .args
            .extend(["--prompt".into(), PROMPT_PLACEHOLDER.into()]);
        let oneshot = Oneshot::new(config).unwrap();
        let short = oneshot.invocation("short", &[], None).unwrap();
        assert_eq!(short.args[short.args.len() - 2..], ["--prompt", "short"]);
        let long = oneshot
            .invocation("a prompt of 23 chars..", &[], None)
            .unwrap();
        assert_eq!(long.stdin_prompt.as_deref(), Some("a prompt of 23 chars.."));
        assert!(
            !long.args.iter().any(|a| a == "--prompt"),
            "{:?}",
            long.args
        );

        let mut config = sh_config(dir.path(), "true");
        config.backend.max_prompt_arg_chars = Some(10);
        config.prompt_stdin_fallback = false;
        let oneshot = Oneshot::new(config).unwrap();
        let err = oneshot
            .invocation("a prompt of 23 chars..", &[], None)
            .expect_err("too long");
        assert!(
            matches!(err, OneshotError::PromptTooLong { chars: 22, max: 10 }),
            "{err}"
        );
        assert!(err.to_string().contains("maxPromptArgChars"));
    }

    #[test]
    fn session_modes_decide_whether_and_how_an_id_is_passed() {
        let dir = tempfile::tempdir().unwrap();
        let mut config = sh_config(dir.path(), "true");
        config.backend.session_mode = SessionMode::Always;
        config.backend.session_arg = Some("--session-id".into());
        let mut oneshot = Oneshot::new(config).unwrap();
        let first = oneshot.invocation("p", &[], None).unwrap();
        let id = first.session_id.clone().expect("a new id under always");
        assert!(!first.resumed);
        assert!(
            !first.args.iter().any(|a| a == "resume"),
            "fresh args: {:?}",
            first.args
        );
        let at = first.args.iter().position(|a| a == "--session-id").unwrap();
        assert_eq!(first.args[at + 1], id);
        oneshot.session = Some(StoredSession::new("s-9"));
        let next = oneshot.invocation("p", &[], None).unwrap();
        assert!(next.resumed && next.args.contains(&"s-9".to_owned()));

        let mut config = sh_config(dir.path(), "true");
        config.backend.session_mode = SessionMode::None;
        config.session = Some(StoredSession::new("ignored"));
        let oneshot = Oneshot::new(config).unwrap();
        let none = oneshot.invocation("p", &[], None).unwrap();
        assert!(none.session_id.is_none() && !none.resumed);
        assert!(!none.args.iter().any(|a| a == "ignored"));
    }

    #[test]
    fn the_system_prompt_and_images_are_passed_as_configured() {
        let dir = tempfile::tempdir().unwrap();
        let mut oneshot = codex(dir.path());
        // The prompt as an argument (the bundled Codex writes it to stdin), after the images.
        oneshot.config.backend.input = InputMode::Arg;
        oneshot.config.system_prompt = Some("be brief".into());
        let file = dir.path().join("sp.md");
        let images = [PathBuf::from("a.png"), PathBuf::from("b.png")];
        let run = oneshot.invocation("p", &images, Some(&file)).unwrap();
        let expected = format!(
            "model_instructions_file={}",
            toml_string(&file.display().to_string())
        );
        assert!(run.args.contains(&expected), "{:?}", run.args);
        let n = run.args.len();
        // Joined (`--image=`): Codex's `--image <FILE>...` would swallow the prompt.
        assert_eq!(run.args[n - 3..], ["--image=a.png", "--image=b.png", "p"]);
        oneshot.config.backend.image_arg = Some("--image".into());
        let run = oneshot.invocation("p", &images, None).unwrap();
        let n = run.args.len();
        assert_eq!(
            run.args[n - 5..],
            ["--image", "a.png", "--image", "b.png", "p"]
        );
        oneshot.config.backend.image_mode = ImageMode::List;
        let run = oneshot.invocation("p", &images, None).unwrap();
        let n = run.args.len();
        assert_eq!(run.args[n - 3..], ["--image", "a.png,b.png", "p"]);

        let mut config = sh_config(dir.path(), "true");
        config.backend.system_prompt_arg = Some("--system".into());
        config.system_prompt = Some("be brief".into());
        config.session = Some(StoredSession::new("s"));
        let oneshot = Oneshot::new(config).unwrap();
        let resumed = oneshot.invocation("p", &images, None).unwrap();
        assert!(
            !resumed.args.iter().any(|a| a == "--system"),
            "first turn only"
        );
        assert_eq!(
            resumed.args.last().map(String::as_str),
            Some("p\n\na.png\nb.png")
        );
    }

    #[tokio::test]
    async fn a_system_message_too_long_for_one_argument_is_refused_naming_it_before_any_spawn() {
        let dir = tempfile::tempdir().unwrap();
        let started = dir.path().join("started");
        let mut config = sh_config(dir.path(), &format!("touch '{}'", started.display()));
        config.backend.system_prompt_arg = Some("--system".into());
        config.system_prompt = Some("s".repeat(200 * 1024));
        let mut oneshot = Oneshot::new(config).unwrap();
        let Err(err) = oneshot.start_turn("p").await else {
            panic!("a 200 KiB system message was passed as an argument");
        };
        assert!(
            matches!(
                err,
                OneshotError::SystemMessageTooLong {
                    bytes: 204_800,
                    max: MAX_ARG_BYTES
                }
            ),
            "{err}"
        );
        let text = err.to_string();
        assert!(
            text.contains("systemMessage") && text.contains("131071"),
            "{text}"
        );
        assert!(!started.exists(), "no process was started");
        // At the limit it still goes as an argument.
        oneshot.config.system_prompt = Some("s".repeat(MAX_ARG_BYTES));
        let run = oneshot.invocation("p", &[], None).unwrap();
        assert!(run.args.iter().any(|a| a.len() == MAX_ARG_BYTES));
    }

    #[tokio::test]
    async fn a_cli_process_is_in_the_daemons_group_ledger_while_it_runs_and_leaves_it_when_reaped()
    {
        let dir = tempfile::tempdir().unwrap();
        let ledger_path = dir.path().join("state/process-groups.json");
        let ledger = crate::group_ledger::GroupLedger::open(&ledger_path).unwrap();
        let seen = dir.path().join("seen.json");
        let pid = dir.path().join("pid");
        // The script waits (boundedly) until the pool has recorded it: the record is made
        // right after the spawn, which the script may outrun.
        let script = format!(
            "i=0; until grep -Eq '\"pgid\": ?'$$'[,}}]' '{ledger}' 2>/dev/null || [ $i -ge 1000 ]; \
             do i=$((i+1)); sleep 0.01; done; cp '{ledger}' '{seen}'; echo $$ > '{pid}'; \
             echo '{MESSAGE}'",
            ledger = ledger_path.display(),
            seen = seen.display(),
            pid = pid.display()
        );
        let mut config = sh_config(dir.path(), &script);
        config.group_ledger = Some(ledger.clone());
        let mut oneshot = Oneshot::new(config).unwrap();
        let (outcome, _) = run(&mut oneshot, "p").await;
        assert_eq!(outcome.end, Some(TurnEnd::Idle), "{outcome:?}");
        let pid: u32 = std::fs::read_to_string(&pid)
            .unwrap()
            .trim()
            .parse()
            .unwrap();
        let during = std::fs::read_to_string(&seen).unwrap();
        assert!(
            during.contains(&format!("\"pgid\":{pid}"))
                || during.contains(&format!("\"pgid\": {pid}")),
            "the running CLI's group is recorded: {during}"
        );
        // Reaped: its entry is removed (by a task that waits for the reap).
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while ledger.live().iter().any(|e| e.pgid == pid) {
            assert!(
                std::time::Instant::now() < deadline,
                "still recorded after the reap"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    #[tokio::test]
    async fn conversations_of_one_home_each_read_their_own_system_prompt_file_which_goes_with_the_run()
     {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(dir.path().join("home")).unwrap();
        std::fs::create_dir_all(dir.path().join("work")).unwrap();
        // Prints the system prompt file it was given; the first waits for `go` first.
        let script = |wait: bool| {
            format!(
                r#"while [ $# -gt 0 ] && [ "$1" != --system-file ]; do shift; done
{}echo '{{"type":"item.completed","item":{{"id":"m","type":"agent_message","text":"'"$(cat "$2")"'"}}}}'"#,
                if wait {
                    "while [ ! -e go ]; do sleep 0.01; done\n"
                } else {
                    ""
                }
            )
        };
        let conversation = |wait: bool, prompt: &str| {
            let mut config = sh_config(dir.path(), &script(wait));
            config.backend.system_prompt_file_arg = Some("--system-file".into());
            config.system_prompt = Some(prompt.into());
            Oneshot::new(config).unwrap()
        };
        let (mut first, mut second) = (
            conversation(true, "be brief"),
            conversation(false, "be long"),
        );
        let mut waiting = first.start_turn("p").await.expect("started");
        // The second conversation runs a whole turn while the first's CLI has not read yet.
        let (outcome, _) = run(&mut second, "p").await;
        assert_eq!(outcome.text, "be long");
        std::fs::write(dir.path().join("work").join("go"), "").unwrap();
        let mut text = None;
        while let Some(event) = waiting.next().await {
            if let BackendEvent::TurnEnd(outcome) = event {
                text = Some(outcome.text);
            }
        }
        assert_eq!(
            text.as_deref(),
            Some("be brief"),
            "its own prompt, not the other's"
        );
        drop(waiting);
        let left: Vec<_> = std::fs::read_dir(dir.path().join("home"))
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .filter(|n| n.to_string_lossy().starts_with("system-prompt"))
            .collect();
        assert!(left.is_empty(), "removed with their runs: {left:?}");

        // One a crash left a day ago goes with the next run's; a recent one (a run of another
        // conversation) stays.
        let home = dir.path().join("home");
        let (stale, recent, theirs) = (
            home.join(format!("system-prompt-{}.md", "a".repeat(32))),
            home.join(format!("system-prompt-{}.md", "b".repeat(32))),
            home.join("system-prompt-notes.md"),
        );
        let a_day_ago = std::time::SystemTime::now() - LEFT_RUN_FILE_AGE - Duration::from_secs(1);
        std::fs::File::create(&stale)
            .and_then(|f| f.set_modified(a_day_ago))
            .unwrap();
        std::fs::File::create(&theirs)
            .and_then(|f| f.set_modified(a_day_ago))
            .unwrap();
        std::fs::write(&recent, "running").unwrap();
        let _ = run(&mut second, "p").await;
        assert!(!stale.exists(), "a crash's leftover is removed");
        assert!(recent.exists(), "another run's file stays");
        assert!(theirs.exists(), "a file the pool did not name stays");
    }

    #[tokio::test]
    async fn with_input_arg_stdin_is_closed_and_the_jsonl_answer_session_and_tools_are_read() {
        let dir = tempfile::tempdir().unwrap();
        // `cat` would block forever on an open stdin.
        let script = r#"cat >/dev/null
echo '{"type":"thread.started","thread_id":"t-42"}'
echo '{"type":"item.started","item":{"id":"c1","type":"command_execution","command":"echo hi"}}'
echo '{"type":"item.completed","item":{"id":"c1","type":"command_execution","command":"echo hi"}}'
echo 'not json'
echo '{"type":"item.completed","item":{"id":"m","type":"agent_message","text":"args: '"$*"'"}}'
echo '{"type":"turn.completed","usage":{"input_tokens":7,"output_tokens":3}}'"#;
        let mut config = sh_config(dir.path(), script);
        config.backend.text_transforms.input.push(TextRewrite {
            from: "secret".into(),
            to: "public".into(),
        });
        config.backend.text_transforms.output.push(TextRewrite {
            from: "args".into(),
            to: "ARGS".into(),
        });
        let mut oneshot = Oneshot::new(config).unwrap();
        let (outcome, events) = run(&mut oneshot, "a secret prompt").await;
        assert_eq!(outcome.end, Some(TurnEnd::Idle), "{outcome:?}");
        assert_eq!(outcome.text, "ARGS: a public prompt");
        assert_eq!(outcome.session_id.as_deref(), Some("t-42"));
        assert_eq!(oneshot.session_id(), Some("t-42"));
        assert_eq!(outcome.usage.input_tokens, 7);
        assert_eq!(outcome.tool_calls, 1, "started and completed are one call");
        // thread.started and turn.completed are envelopes: not retained.
        assert_eq!(outcome.retained_lines, 4);
        let names: Vec<_> = events.iter().map(BackendEvent::name).collect();
        assert_eq!(names, ["tool.call", "assistant.message", "turn.end"]);

        let (again, _) = run(&mut oneshot, "second").await;
        assert!(again.resumed);
        assert_eq!(again.text, "ARGS: resume t-42 second");
    }

    #[tokio::test]
    async fn input_stdin_writes_the_prompt_and_closes_the_pipe_and_text_output_is_the_answer() {
        let dir = tempfile::tempdir().unwrap();
        let mut config = sh_config(dir.path(), "printf 'got: '; cat; echo");
        config.backend.input = InputMode::Stdin;
        config.backend.output = OutputFormat::Text;
        config.backend.session_mode = SessionMode::None;
        let mut oneshot = Oneshot::new(config).unwrap();
        let (outcome, _) = run(&mut oneshot, "from stdin").await;
        assert_eq!(outcome.end, Some(TurnEnd::Idle), "{outcome:?}");
        assert_eq!(outcome.text, "got: from stdin");
        assert_eq!(outcome.session_id, None);
    }

    #[tokio::test]
    async fn a_json_document_gives_text_session_usage_and_is_error() {
        let dir = tempfile::tempdir().unwrap();
        let ok = r#"echo '{"result":"fine","session_id":"s-1","usage":{"input_tokens":5,"output_tokens":2,"cache_read_input_tokens":1}}'"#;
        let mut config = sh_config(dir.path(), ok);
        config.backend.output = OutputFormat::Json;
        config.backend.session_id_fields = vec!["session_id".into()];
        let mut oneshot = Oneshot::new(config).unwrap();
        let (outcome, _) = run(&mut oneshot, "p").await;
        assert_eq!(
            (outcome.end, outcome.text.as_str()),
            (Some(TurnEnd::Idle), "fine")
        );
        assert_eq!(outcome.session_id.as_deref(), Some("s-1"));
        assert_eq!(outcome.usage.cache_read_tokens, 1);

        let failed = r#"echo '{"result":"API Error: refused","is_error":true,"terminal_reason":"api_error","api_error_status":429}'; exit 1"#;
        let mut config = sh_config(dir.path(), failed);
        config.backend.output = OutputFormat::Json;
        let mut oneshot = Oneshot::new(config).unwrap();
        let (outcome, _) = run(&mut oneshot, "p").await;
        assert_eq!(outcome.end, Some(TurnEnd::Error), "{outcome:?}");
        assert!(matches!(&outcome.failure,
            Some(TurnFailure::Cli { message, reason, status }) if message == "API Error: refused"
                && reason.as_deref() == Some("api_error") && *status == Some(429)));
    }

    #[tokio::test]
    async fn a_killed_process_or_a_silent_nonzero_exit_is_a_crash_and_turn_failed_is_an_error() {
        let dir = tempfile::tempdir().unwrap();
        for (script, end) in [
            (format!("echo '{MESSAGE}'; kill -9 $$"), TurnEnd::Crashed),
            ("echo oops >&2; exit 3".to_owned(), TurnEnd::Crashed),
            (
                r#"echo '{"type":"error","message":"Reconnecting... 1/1"}'; echo '{"type":"turn.failed","error":{"message":"stream disconnected"}}'; exit 1"#.to_owned(),
                TurnEnd::Error,
            ),
        ] {
            let mut oneshot = Oneshot::new(sh_config(dir.path(), &script)).unwrap();
            let started = std::time::Instant::now();
            let (outcome, _) = run(&mut oneshot, "p").await;
            assert_eq!(outcome.end, Some(end), "{script}: {outcome:?}");
            assert!(started.elapsed() < Duration::from_secs(5), "at once");
            match end {
                TurnEnd::Crashed => assert!(
                    matches!(&outcome.failure, Some(TurnFailure::Crashed { .. })),
                    "{outcome:?}"
                ),
                _ => assert!(matches!(&outcome.failure,
                    Some(TurnFailure::Cli { message, .. }) if message == "stream disconnected")),
            }
        }
        let mut oneshot = Oneshot::new(sh_config(dir.path(), "echo oops >&2; exit 3")).unwrap();
        let (outcome, _) = run(&mut oneshot, "p").await;
        assert!(matches!(&outcome.failure,
            Some(TurnFailure::Crashed { exit, stderr_tail }) if exit == "exit code 3" && stderr_tail == "oops\n"));
    }

    #[tokio::test]
    async fn output_past_the_line_limit_ends_the_turn_with_a_typed_error_keeping_the_answer() {
        let dir = tempfile::tempdir().unwrap();
        let script = format!(
            "echo '{MESSAGE}'; i=0; while [ $i -lt 1000 ]; do echo '{{\"type\":\"item.updated\"}}'; i=$((i+1)); done; sleep 30"
        );
        let mut config = sh_config(dir.path(), &script);
        config.backend.output_limits.max_turn_lines = 10;
        let mut oneshot = Oneshot::new(config).unwrap();
        let turn = oneshot.start_turn("p").await.unwrap();
        let pid = turn.pid().expect("running");
        let outcome = turn.finish().await;
        assert_eq!(outcome.end, Some(TurnEnd::Error), "{outcome:?}");
        assert!(matches!(
            outcome.failure,
            Some(TurnFailure::OutputLimit {
                key: "maxTurnLines",
                limit: 10,
                ..
            })
        ));
        assert_eq!(outcome.text, "done", "the answer already received is kept");
        assert_eq!(outcome.retained_lines, 11);
        assert!(group_gone(pid).await, "the group was killed");
    }

    #[tokio::test]
    async fn output_past_the_byte_limit_ends_the_turn_with_a_typed_error_keeping_the_answer_and_envelopes_do_not_count()
     {
        let dir = tempfile::tempdir().unwrap();
        // 200 envelopes (about 10 KB) around the answer, then items of 100 bytes each.
        let pad = "x".repeat(70);
        let script = format!(
            "echo '{{\"type\":\"thread.started\",\"thread_id\":\"t1\"}}'; i=0; \
             while [ $i -lt 200 ]; do echo '{{\"type\":\"turn.started\"}}'; i=$((i+1)); done; \
             echo '{MESSAGE}'; echo '{{\"type\":\"turn.completed\",\"usage\":{{}}}}'; \
             i=0; while [ $i -lt 1000 ]; do echo '{{\"type\":\"item.updated\",\"p\":\"{pad}\"}}'; \
             i=$((i+1)); done; sleep 30"
        );
        let mut config = sh_config(dir.path(), &script);
        config.backend.output_limits.max_turn_raw_chars = 1000;
        let mut oneshot = Oneshot::new(config).unwrap();
        let turn = oneshot.start_turn("p").await.unwrap();
        let pid = turn.pid().expect("running");
        let outcome = turn.finish().await;
        assert_eq!(outcome.end, Some(TurnEnd::Error), "{outcome:?}");
        assert!(
            matches!(
                outcome.failure,
                Some(TurnFailure::OutputLimit {
                    unit: "bytes",
                    key: "maxTurnRawChars",
                    limit: 1000,
                    ..
                })
            ),
            "{outcome:?}"
        );
        assert_eq!(outcome.text, "done", "the answer already received is kept");
        // The answer and the items up to the breach; none of the 203 envelopes.
        let item = format!(r#"{{"type":"item.updated","p":"{pad}"}}"#).len() as u64 + 1;
        let expected_lines = 1 + (1000 - (MESSAGE.len() as u64 + 1)) / item + 1;
        assert_eq!(outcome.retained_lines, expected_lines, "{outcome:?}");
        assert!(outcome.retained_bytes > 1000);
        assert!(group_gone(pid).await, "the group was killed");
    }

    #[tokio::test]
    async fn a_turn_dropped_before_its_end_leaves_the_session_its_cli_started_to_the_next() {
        let dir = tempfile::tempdir().unwrap();
        let script = r#"cat >/dev/null
echo '{"type":"thread.started","thread_id":"t-7"}'
echo '{"type":"item.completed","item":{"id":"m","type":"agent_message","text":"args: '"$*"'"}}'
sleep 30 & wait"#;
        let mut oneshot = Oneshot::new(sh_config(dir.path(), script)).unwrap();
        let mut turn = oneshot.start_turn("first").await.unwrap();
        let pid = turn.pid().expect("running");
        let first = tokio::time::timeout(Duration::from_secs(10), turn.next())
            .await
            .expect("an event in time");
        assert!(
            matches!(first, Some(BackendEvent::Message { .. })),
            "{first:?}"
        );
        // The caller goes away mid-turn (an SSE client hanging up).
        drop(turn);
        assert!(group_gone(pid).await);
        assert_eq!(oneshot.session_id(), Some("t-7"));
        let quick = r#"cat >/dev/null
echo '{"type":"item.completed","item":{"id":"m","type":"agent_message","text":"args: '"$*"'"}}'
echo '{"type":"turn.completed","usage":{"input_tokens":1,"output_tokens":1}}'"#;
        oneshot.config.backend.resume_args = sh_config(dir.path(), quick).backend.resume_args;
        let (next, _) = run(&mut oneshot, "second").await;
        assert!(next.resumed, "{next:?}");
        assert!(next.text.contains("resume t-7 second"), "{next:?}");
    }

    #[tokio::test]
    async fn a_turn_without_a_limit_of_its_own_runs() {
        let dir = tempfile::tempdir().unwrap();
        let mut config = sh_config(
            dir.path(),
            r#"cat >/dev/null
echo '{"type":"item.completed","item":{"id":"m","type":"agent_message","text":"done"}}'"#,
        );
        // What a lease without a limit passes on (`Duration::MAX` is "none" in the crate).
        config.turn_timeout = Duration::MAX;
        let mut oneshot = Oneshot::new(config).unwrap();
        let (outcome, _) = run(&mut oneshot, "p").await;
        assert_eq!(outcome.end, Some(TurnEnd::Idle), "{outcome:?}");
        assert_eq!(outcome.text, "done");
    }

    #[tokio::test]
    async fn a_turn_past_its_timeout_or_aborted_kills_the_group() {
        let dir = tempfile::tempdir().unwrap();
        let mut config = sh_config(dir.path(), "sleep 30 & wait");
        config.turn_timeout = Duration::from_millis(300);
        let mut oneshot = Oneshot::new(config).unwrap();
        let turn = oneshot.start_turn("p").await.unwrap();
        let pid = turn.pid().expect("running");
        let outcome = turn.finish().await;
        assert_eq!(outcome.end, Some(TurnEnd::Timeout), "{outcome:?}");
        assert!(matches!(
            outcome.failure,
            Some(TurnFailure::TimedOut { .. })
        ));
        assert!(group_gone(pid).await);

        let mut oneshot = Oneshot::new(sh_config(dir.path(), "sleep 30 & wait")).unwrap();
        let turn = oneshot.start_turn("p").await.unwrap();
        let pid = turn.pid().expect("running");
        turn.abort_handle().abort();
        let started = std::time::Instant::now();
        let outcome = turn.finish().await;
        assert_eq!(outcome.end, Some(TurnEnd::Aborted), "{outcome:?}");
        assert!(started.elapsed() < Duration::from_secs(2));
        assert!(group_gone(pid).await);
    }

    #[tokio::test]
    async fn codex_usage_is_diffed_against_the_totals_stored_with_the_session() {
        let dir = tempfile::tempdir().unwrap();
        // Thread totals grow by 100 input / 10 output tokens per turn, like Codex's.
        let script = r#"n=$(cat count 2>/dev/null || echo 0); n=$((n+1)); echo $n > count
echo '{"type":"thread.started","thread_id":"t-1"}'
echo "{\"type\":\"turn.completed\",\"usage\":{\"input_tokens\":$((n*100)),\"output_tokens\":$((n*10))}}""#;
        // The Codex dialect puts its `-c` switches first: run the script as a file that
        // takes them as arguments.
        let file = dir.path().join("codex.sh");
        std::fs::write(&file, format!("#!/bin/sh\n{script}\n")).unwrap();
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o755)).unwrap();
        let codex_sh = || {
            let mut config = sh_config(dir.path(), script);
            config.dialect = Dialect::Codex;
            config.backend.command = file.display().to_string();
            config.backend.args = Vec::new();
            config.backend.resume_args = Some(vec!["resume".into(), SESSION_ID_PLACEHOLDER.into()]);
            config
        };
        let mut oneshot = Oneshot::new(codex_sh()).unwrap();
        for _ in 0..3 {
            let (outcome, _) = run(&mut oneshot, "p").await;
            assert_eq!(outcome.end, Some(TurnEnd::Idle), "{outcome:?}");
            assert_eq!(
                (outcome.usage.input_tokens, outcome.usage.output_tokens),
                (100, 10)
            );
        }
        let stored = oneshot.stored_session().cloned().expect("stored");
        assert_eq!(stored.usage_totals.input_tokens, 300);
        let text = serde_json::to_string(&stored).unwrap();
        assert!(text.contains("usageTotals"), "{text}");

        // A new process (the pool restarted) resumes from the persisted totals.
        let mut config = codex_sh();
        config.session = Some(serde_json::from_str(&text).unwrap());
        let mut resumed = Oneshot::new(config).unwrap();
        let (outcome, _) = run(&mut resumed, "p").await;
        assert!(outcome.resumed);
        assert_eq!(outcome.usage.input_tokens, 100);
    }

    /// A Gemini-dialect backend whose "CLI" is `/bin/sh -c <script>`, json output.
    fn gemini_sh(dir: &Path, script: &str) -> OneshotConfig {
        let mut config = sh_config(dir, script);
        config.backend.output = OutputFormat::Json;
        config.backend.session_id_fields = vec!["session_id".into()];
        config.backend.api_key_env = Some("GEMINI_API_KEY".into());
        config.backend.base_url_env = Some("GOOGLE_GEMINI_BASE_URL".into());
        config.dialect = Dialect::Gemini;
        config.base_url = Some("http://127.0.0.1:9".into());
        config.api_key = Some(Secret::new("AIza-FAKE-do-not-print"));
        config
    }

    #[tokio::test]
    async fn gemini_gets_its_settings_its_key_and_endpoint_in_the_environment_and_its_answer_read()
    {
        let dir = tempfile::tempdir().unwrap();
        // Answers with what it was given: the variables, and whether the key is in its argv.
        let script = r#"case "$*" in *do-not-print*) argv=leaked;; *) argv=clean;; esac
printf '{"session_id":"g-1234567","response":"%s %s %s","stats":{"models":{"m":{"tokens":{"prompt":10,"candidates":2,"cached":4,"thoughts":1,"tool":0}}},"tools":{"totalCalls":1}}}' "$GEMINI_API_KEY" "$GOOGLE_GEMINI_BASE_URL" "$argv""#;
        let mut oneshot = Oneshot::new(gemini_sh(dir.path(), script)).unwrap();
        let (outcome, events) = run(&mut oneshot, "p").await;
        assert_eq!(outcome.end, Some(TurnEnd::Idle), "{outcome:?}");
        assert_eq!(
            outcome.text,
            "AIza-FAKE-do-not-print http://127.0.0.1:9 clean"
        );
        assert_eq!(outcome.session_id.as_deref(), Some("g-1234567"));
        assert_eq!(
            (
                outcome.usage.input_tokens,
                outcome.usage.cache_read_tokens,
                outcome.usage.output_tokens
            ),
            (6, 4, 3),
            "stats summed as gemini::parse_output reads them"
        );
        assert_eq!(outcome.tool_calls, 1);
        assert_eq!(
            events.iter().map(BackendEvent::name).collect::<Vec<_>>(),
            ["assistant.message", "turn.end"]
        );
        let settings = std::fs::read_to_string(gemini::settings_path(&dir.path().join("home")))
            .expect("the settings were written before the run");
        assert!(settings.contains("gemini-api-key"), "{settings}");
    }

    #[tokio::test]
    async fn gemini_stream_json_streams_deltas_and_tool_calls_as_they_are_printed_and_counts_no_envelope()
     {
        let dir = tempfile::tempdir().unwrap();
        // The second chunk is printed only once the first event was read: a turn that
        // buffered stdout to its end would never see it.
        let script = r#"echo '{"type":"init","session_id":"g-7654321","model":"m"}'
echo '{"type":"message","role":"user","content":"p"}'
echo '{"type":"tool_use","tool_name":"read_file","tool_id":"t-1","parameters":{"file_path":"a"}}'
echo '{"type":"tool_result","tool_id":"t-1","status":"success","output":""}'
echo '{"type":"message","role":"assistant","content":"one","delta":true}'
read go < "$1"
echo '{"type":"message","role":"assistant","content":" two","delta":true}'
echo '{"type":"result","status":"success","stats":{"total_tokens":16,"input_tokens":10,"output_tokens":6,"cached":4,"input":6,"tool_calls":1}}'"#;
        let fifo = dir.path().join("go");
        nix::unistd::mkfifo(&fifo, nix::sys::stat::Mode::S_IRWXU).unwrap();
        let mut config = gemini_sh(dir.path(), script);
        config.backend.output = OutputFormat::Jsonl;
        config.backend.args.push(fifo.display().to_string());
        let mut oneshot = Oneshot::new(config).unwrap();
        let mut turn = oneshot.start_turn("p").await.unwrap();
        let mut names = Vec::new();
        loop {
            let event = tokio::time::timeout(Duration::from_secs(30), turn.next())
                .await
                .expect("an event")
                .expect("not ended");
            names.push(event.name());
            if let BackendEvent::MessageDelta { delta } = &event {
                assert_eq!(delta, "one");
                break;
            }
            if let BackendEvent::ToolCall { id, name, input } = &event {
                assert_eq!((id.as_str(), name.as_str()), ("t-1", "read_file"));
                assert_eq!(input["file_path"], "a");
            }
        }
        // The first delta arrived while the process still waits: release it.
        std::fs::write(&fifo, "go\n").unwrap();
        let outcome = tokio::time::timeout(Duration::from_secs(30), async {
            loop {
                let event = turn.next().await.expect("to the end");
                names.push(event.name());
                if let BackendEvent::TurnEnd(outcome) = event {
                    return outcome;
                }
            }
        })
        .await
        .expect("ended");
        assert_eq!(
            names,
            [
                "tool.call",
                "assistant.message_delta",
                "assistant.message_delta",
                "assistant.message",
                "turn.end"
            ]
        );
        assert_eq!(outcome.end, Some(TurnEnd::Idle), "{outcome:?}");
        assert_eq!(outcome.text, "one two");
        assert_eq!(outcome.session_id.as_deref(), Some("g-7654321"));
        assert_eq!(outcome.tool_calls, 1);
        assert_eq!(
            (
                outcome.usage.input_tokens,
                outcome.usage.cache_read_tokens,
                outcome.usage.output_tokens
            ),
            (6, 4, 6)
        );
        assert_eq!(
            outcome.retained_lines, 4,
            "init, the prompt's echo and result are envelopes"
        );
    }

    #[tokio::test]
    async fn gemini_exit_codes_are_typed_failures_and_a_kill_is_a_crash() {
        let dir = tempfile::tempdir().unwrap();
        let auth = r#"echo '{"session_id":"s","error":{"type":"Error","message":"Invalid auth method selected.","code":41}}'; exit 41"#;
        let mut oneshot = Oneshot::new(gemini_sh(dir.path(), auth)).unwrap();
        let (outcome, _) = run(&mut oneshot, "p").await;
        assert_eq!(outcome.end, Some(TurnEnd::Error), "{outcome:?}");
        assert!(
            matches!(&outcome.failure, Some(TurnFailure::Gemini { error: gemini::GeminiError::Auth { message } }) if message == "Invalid auth method selected."),
            "{outcome:?}"
        );
        let json = serde_json::to_value(&outcome).unwrap();
        assert_eq!(json["failure"]["kind"], "gemini");
        assert_eq!(json["failure"]["error"]["error"], "auth");

        let mut config = gemini_sh(
            dir.path(),
            "echo 'Error resuming session: Invalid session identifier' >&2; exit 42",
        );
        config.session = Some(StoredSession::new("0000-stale"));
        let mut oneshot = Oneshot::new(config).unwrap();
        let (outcome, _) = run(&mut oneshot, "p").await;
        assert!(
            matches!(
                &outcome.failure,
                Some(TurnFailure::Gemini {
                    error: gemini::GeminiError::ResumeNotFound { .. }
                })
            ),
            "{outcome:?}"
        );

        let mut oneshot = Oneshot::new(gemini_sh(dir.path(), "kill -9 $$")).unwrap();
        let (outcome, _) = run(&mut oneshot, "p").await;
        assert_eq!(outcome.end, Some(TurnEnd::Crashed), "{outcome:?}");
        assert!(matches!(
            &outcome.failure,
            Some(TurnFailure::Crashed { .. })
        ));
    }

    #[tokio::test]
    async fn a_pretty_json_answer_cut_by_the_line_limit_keeps_the_response_that_had_arrived() {
        let dir = tempfile::tempdir().unwrap();
        let script = r#"printf '{\n  "session_id": "g-abcdefgh",\n  "response": "kept \\"as is\\"",\n  "stats": {\n'
i=0; while [ $i -lt 50 ]; do echo '    "x": 1,'; i=$((i+1)); done; sleep 30"#;
        let mut config = gemini_sh(dir.path(), script);
        config.backend.output_limits.max_turn_lines = 6;
        let mut oneshot = Oneshot::new(config).unwrap();
        let turn = oneshot.start_turn("p").await.unwrap();
        let pid = turn.pid().expect("running");
        let outcome = turn.finish().await;
        assert!(
            matches!(
                outcome.failure,
                Some(TurnFailure::OutputLimit {
                    key: "maxTurnLines",
                    ..
                })
            ),
            "{outcome:?}"
        );
        assert_eq!(outcome.text, r#"kept "as is""#);
        assert_eq!(outcome.session_id.as_deref(), Some("g-abcdefgh"));
        assert!(group_gone(pid).await);
        assert_eq!(
            cut_document_field("{\n    \"response\": \"nested\"", "response"),
            None
        );
    }

    #[test]
    fn dialects_follow_the_bundled_ids_and_codex_rollouts_are_found_in_dated_folders() {
        assert_eq!(Dialect::of_backend("codex-cli"), Dialect::Codex);
        assert_eq!(Dialect::of_backend("google-gemini-cli"), Dialect::Gemini);
        assert_eq!(Dialect::of_backend("my-cli"), Dialect::Generic);
        let home = tempfile::tempdir().unwrap();
        let cwd = home.path();
        let id = "019a227d-9ace-7703-b7ac-389dd1c45dcf";
        let sessions = home.path().join(".codex/sessions");
        assert_eq!(
            Dialect::Codex.transcript(home.path(), cwd, id),
            Some(Err(sessions.clone()))
        );
        let day = sessions.join("2026/12/01");
        std::fs::create_dir_all(&day).unwrap();
        std::fs::write(day.join("rollout-2026-12-01T10-00-00-other.jsonl"), "{}").unwrap();
        assert!(codex_rollout_path(home.path(), id).is_err());
        let file = day.join(format!("rollout-2026-12-01T10-00-01-{id}.jsonl"));
        std::fs::write(&file, "{}").unwrap();
        assert_eq!(codex_rollout_path(home.path(), id), Ok(file.clone()));
        assert_eq!(
            Dialect::Codex.transcript(home.path(), cwd, id),
            Some(Ok(file))
        );
        assert!(codex_rollout_path(home.path(), "../../x").is_err());
        assert!(codex_rollout_path(home.path(), "").is_err());
        // Another agent's rollout reached through a link the agent planted is not found.
        let other = tempfile::tempdir().unwrap();
        let theirs = "019a227d-9ace-7703-b7ac-000000000001";
        let their_day = other.path().join("12/02");
        std::fs::create_dir_all(&their_day).unwrap();
        std::fs::write(
            their_day.join(format!("rollout-2026-12-02T10-00-00-{theirs}.jsonl")),
            "{}",
        )
        .unwrap();
        std::os::unix::fs::symlink(other.path(), sessions.join("2027")).unwrap();
        std::os::unix::fs::symlink(
            their_day.join(format!("rollout-2026-12-02T10-00-00-{theirs}.jsonl")),
            day.join(format!("rollout-2026-12-01T10-00-02-{theirs}.jsonl")),
        )
        .unwrap();
        assert!(codex_rollout_path(home.path(), theirs).is_err());
        assert_eq!(Dialect::Generic.transcript(home.path(), cwd, id), None);
        assert!(matches!(
            Dialect::Gemini.transcript(home.path(), cwd, id),
            Some(Err(_))
        ));
    }

    #[test]
    fn a_rollouts_last_token_count_gives_the_threads_totals() {
        let dir = tempfile::tempdir().unwrap();
        let rollout = dir.path().join("rollout.jsonl");
        let count = |input: u64| {
            json!({"type": "event_msg", "payload": {"type": "token_count", "info": {
                "total_token_usage": {"input_tokens": input, "cached_input_tokens": 4, "output_tokens": 3},
                "last_token_usage": {"input_tokens": 1}}}})
            .to_string()
        };
        std::fs::write(
            &rollout,
            format!(
                "{}\n{}\n{}\n{{\"type\":\"response_item\",\"payload\":{{\"type\":\"token_count\"}}}}\n",
                count(100),
                "x".repeat(300 * 1024),
                count(300)
            ),
        )
        .unwrap();
        let totals = codex_rollout_totals(dir.path(), &rollout).expect("totals");
        assert_eq!(
            (
                totals.input_tokens,
                totals.cache_read_tokens,
                totals.output_tokens
            ),
            (300, 4, 3)
        );
        std::fs::write(&rollout, format!("{}\n", "y".repeat(10))).unwrap();
        assert_eq!(codex_rollout_totals(dir.path(), &rollout), None);
        assert_eq!(
            codex_rollout_totals(dir.path(), &dir.path().join("missing")),
            None
        );
        // A FIFO the agent put in its place is not opened for reading (it would block).
        std::fs::remove_file(&rollout).unwrap();
        nix::unistd::mkfifo(&rollout, nix::sys::stat::Mode::from_bits_truncate(0o600)).unwrap();
        assert_eq!(codex_rollout_totals(dir.path(), &rollout), None);
    }

    #[test]
    fn usage_totals_that_went_down_count_from_zero() {
        let earlier = UsageTotals {
            input_tokens: 500,
            ..UsageTotals::default()
        };
        let now = UsageTotals {
            input_tokens: 120,
            output_tokens: 4,
            ..UsageTotals::default()
        };
        assert_eq!(now.since(earlier).input_tokens, 120);
    }

    #[test]
    fn the_config_debug_never_shows_the_key() {
        let mut config = OneshotConfig::codex("/c", "/h", "/w");
        config.api_key = Some(Secret::new("sk-FAKE-very-secret"));
        assert!(!format!("{config:?}").contains("very-secret"));
    }

    /// Whether process group `pgid` is empty within a few seconds.
    async fn group_gone(pgid: u32) -> bool {
        let pgid = nix::unistd::Pid::from_raw(i32::try_from(pgid).unwrap());
        for _ in 0..100 {
            if nix::sys::signal::killpg(pgid, None).is_err() {
                return true;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        false
    }
}
