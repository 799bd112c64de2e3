//! The configuration surface of one CLI backend (issue 17, item 2): the product page's
//! `agents.defaults.cliBackends.<id>` keys with their meaning, as a serde struct read from our
//! TOML (or JSON), its validation, and the bundled defaults (`claude-cli`, `codex-cli`,
//! `google-gemini-cli`).
//!
//! Keys keep the page's camelCase spelling (`resumeArgs`, `maxPromptArgChars`, ...), so a
//! configuration written for the page reads the same here; unknown keys are refused.
//! [`CliBackendConfig::validate`] says what is wrong and how to fix it; nothing runs with a
//! configuration that did not pass it.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::BackendKind;
use super::oneshot::Dialect;
use crate::kinds::ReasoningEffort;

/// Placeholder for the stored CLI session id in `sessionArgs` and `resumeArgs`.
pub const SESSION_ID_PLACEHOLDER: &str = "{sessionId}";
/// Placeholder for the prompt in `args` / `resumeArgs` (input `arg`).
pub const PROMPT_PLACEHOLDER: &str = "{prompt}";
/// Placeholder for the model in `args` / `resumeArgs`.
pub const MODEL_PLACEHOLDER: &str = "{model}";
const PLACEHOLDERS: [&str; 3] = [
    SESSION_ID_PLACEHOLDER,
    PROMPT_PLACEHOLDER,
    MODEL_PLACEHOLDER,
];

/// Default cap on the output a turn retains: 8 MiB of raw JSONL.
pub const DEFAULT_MAX_TURN_RAW_CHARS: u64 = 8 * 1024 * 1024;
/// Default cap on the output a turn retains: 20,000 JSONL lines.
pub const DEFAULT_MAX_TURN_LINES: u64 = 20_000;
/// The highest `maxTurnRawChars` accepted: 64 MiB.
pub const MAX_TURN_RAW_CHARS_CAP: u64 = 64 * 1024 * 1024;
/// The highest `maxTurnLines` accepted.
pub const MAX_TURN_LINES_CAP: u64 = 100_000;

/// How the CLI prints its answer.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum OutputFormat {
    /// One JSON document: the text and the session id are read from it.
    #[default]
    Json,
    /// JSON lines (a stream of events); the final message and the session id are read from them.
    Jsonl,
    /// Plain text: stdout is the answer.
    Text,
}

/// How the prompt reaches the CLI.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum InputMode {
    /// As the last argument (or where `{prompt}` stands).
    #[default]
    Arg,
    /// On stdin.
    Stdin,
}

/// When a CLI session id is passed.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum SessionMode {
    /// Always: a new UUID when none is stored.
    Always,
    /// Only when one was stored before (a resume).
    #[default]
    Existing,
    /// Never.
    None,
}

/// When the system prompt is passed.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum SystemPromptWhen {
    /// On the first turn of a CLI session only (a resume already carries it).
    #[default]
    First,
    /// On every turn.
    Always,
    /// Never.
    Never,
}

/// How several image paths are passed with `imageArg`. An `imageArg` ending in `=` is joined
/// to its value in one argument (`--image=a.png`), so an option that takes several values
/// (Codex's `--image <FILE>...`) cannot swallow the prompt after it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ImageMode {
    /// `imageArg` before each path: `--image a.png --image b.png` (`--image=a.png
    /// --image=b.png` for `imageArg = "--image="`).
    #[default]
    Repeat,
    /// `imageArg` once, then the paths joined with commas: `--image a.png,b.png`.
    List,
}

/// Limits on the output a turn retains (stream envelopes such as partial deltas excluded).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct OutputLimits {
    /// Bytes of retained raw output per turn (default 8 MiB, at most 64 MiB).
    #[serde(default = "default_raw_chars")]
    pub max_turn_raw_chars: u64,
    /// Lines of retained raw output per turn (default 20,000, at most 100,000).
    #[serde(default = "default_lines")]
    pub max_turn_lines: u64,
}

fn default_raw_chars() -> u64 {
    DEFAULT_MAX_TURN_RAW_CHARS
}

fn default_lines() -> u64 {
    DEFAULT_MAX_TURN_LINES
}

impl Default for OutputLimits {
    fn default() -> Self {
        Self {
            max_turn_raw_chars: DEFAULT_MAX_TURN_RAW_CHARS,
            max_turn_lines: DEFAULT_MAX_TURN_LINES,
        }
    }
}

/// One regex rewrite of the text going to the CLI (`input`) or coming back (`output`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TextRewrite {
    /// The pattern (Rust `regex` syntax); every match is replaced.
    pub from: String,
    /// The replacement (`$1`, `${name}` refer to groups).
    pub to: String,
}

/// The text transforms of a backend.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TextTransforms {
    /// Applied to the prompt, in order.
    #[serde(default)]
    pub input: Vec<TextRewrite>,
    /// Applied to the answer, in order.
    #[serde(default)]
    pub output: Vec<TextRewrite>,
}

/// The configuration of one CLI backend (the daemon's `[backends.<id>]` table).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
#[non_exhaustive]
pub struct CliBackendConfig {
    /// `cli-oneshot` (a process per turn) or `cli-live` (a process per conversation).
    #[serde(default = "default_kind")]
    pub kind: BackendKind,
    /// The executable (a path, or a name looked up on `PATH`).
    pub command: String,
    /// Arguments of a fresh run.
    #[serde(default)]
    pub args: Vec<String>,
    /// Arguments of a resumed run, in place of `args` (`{sessionId}` marks the id).
    #[serde(default)]
    pub resume_args: Option<Vec<String>>,
    /// How the CLI prints its answer.
    #[serde(default)]
    pub output: OutputFormat,
    /// How a resumed run prints its answer, when it differs from `output`.
    #[serde(default)]
    pub resume_output: Option<OutputFormat>,
    /// How the prompt reaches the CLI.
    #[serde(default)]
    pub input: InputMode,
    /// With input `arg`: a longer prompt goes to stdin instead.
    #[serde(default)]
    pub max_prompt_arg_chars: Option<usize>,
    /// The flag that names the model (`--model`).
    #[serde(default)]
    pub model_arg: Option<String>,
    /// The pool's model names mapped to the CLI's own.
    #[serde(default)]
    pub model_aliases: BTreeMap<String, String>,
    /// The flag followed by the session id (`--session-id`).
    #[serde(default)]
    pub session_arg: Option<String>,
    /// Arguments carrying the session id where `{sessionId}` stands, when one flag is not enough.
    #[serde(default)]
    pub session_args: Option<Vec<String>>,
    /// When a session id is passed.
    #[serde(default)]
    pub session_mode: SessionMode,
    /// The output fields the session id is read from, first found wins.
    #[serde(default = "default_session_id_fields")]
    pub session_id_fields: Vec<String>,
    /// The flag followed by the system prompt text.
    #[serde(default)]
    pub system_prompt_arg: Option<String>,
    /// The flag followed by a file holding the system prompt.
    #[serde(default)]
    pub system_prompt_file_arg: Option<String>,
    /// A config-override flag (`-c`) whose value is `<key>=<file>` ...
    #[serde(default)]
    pub system_prompt_file_config_arg: Option<String>,
    /// ... with this key (`model_instructions_file`).
    #[serde(default)]
    pub system_prompt_file_config_key: Option<String>,
    /// When the system prompt is passed.
    #[serde(default)]
    pub system_prompt_when: SystemPromptWhen,
    /// The flag before image paths (one ending in `=` is joined to the path: `--image=`);
    /// without it, paths are appended to the prompt (Gemini CLI: as `@path` references).
    #[serde(default)]
    pub image_arg: Option<String>,
    /// How several image paths are passed.
    #[serde(default)]
    pub image_mode: ImageMode,
    /// Runs of the same lane are kept in order: with `true`, one lease at a time per agent
    /// home on this backend (FIFO), whatever the conversation. The pool already runs each
    /// conversation one lease at a time for every backend, so this is the page's wider
    /// "provider lane" ("most CLIs serialize on a provider lane"): CLIs that keep shared
    /// state in their home (Codex's SQLite files, Gemini's `projects.json`, Claude's
    /// `.claude.json`) never run two turns of one agent at once. `false`: conversations of
    /// one agent run side by side, within the pool's caps. The bundled backends set it.
    #[serde(default)]
    pub serialize: bool,
    /// What the runner knows of the CLI beyond these keys ([`Dialect`]: `codex`, `gemini`,
    /// `claude` or `generic`): its switches, provider or settings, output reader, and the
    /// transcript checked before a resume (`transcript-missing`). Not set: the bundled id's
    /// own, else inferred from `command`'s file name ([`CliBackendConfig::dialect_of`]), so
    /// `[backends.my-codex]` running `codex` is a Codex backend. A `cli-live` backend is
    /// `claude`.
    #[serde(default)]
    pub dialect: Option<Dialect>,
    /// Extra environment of the child (no credentials: those go in the backend's secret).
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    /// The environment variable that carries the backend's secret (the model key) into the
    /// child, and only there (`GEMINI_API_KEY`). Not set: the CLI gets no key from the pool.
    #[serde(default)]
    pub api_key_env: Option<String>,
    /// The environment variable that carries the model endpoint's base URL, when the pool
    /// points the CLI at one (`GOOGLE_GEMINI_BASE_URL`). Not set: the CLI's own default.
    #[serde(default)]
    pub base_url_env: Option<String>,
    /// Limits on the output a turn retains.
    #[serde(default)]
    pub output_limits: OutputLimits,
    /// Regex rewrites of the prompt and the answer.
    #[serde(default)]
    pub text_transforms: TextTransforms,
}

/// The switches the runner of a bundled CLI applies to every process, whatever the
/// backend's `args` and `env` say (issue 17, item 7: no outbound traffic by default, bounded
/// retries, a trusted workspace): an override of `args` or `env` cannot drop them. A
/// configuration that names the very key (the variable in `env`, the `-c` key in `args`)
/// sets it instead: that is the one way to change a switch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SafetySwitches {
    /// Environment variables and their values.
    pub env: &'static [(&'static str, &'static str)],
    /// Codex `-c key=value` config overrides.
    pub config_overrides: &'static [(&'static str, &'static str)],
    /// Command-line flags and their values (`None`: a flag that takes none).
    pub flags: &'static [(&'static str, Option<&'static str>)],
}

impl SafetySwitches {
    /// Claude Code: no nonessential traffic (telemetry, feature flags: 0 DNS queries) and one
    /// API retry (a dead endpoint fails in ~1 s instead of retrying for minutes); settings
    /// from the agent's own config directory only (`--setting-sources user`), never the
    /// working directory's `.claude/settings.json` or `.claude/settings.local.json`, whose
    /// hooks Claude runs at every session start and prompt, past the permission policy (a
    /// conversation's directory holds whatever its tenant put there), and no MCP server but
    /// the pool's (`--strict-mcp-config`: a project's `.mcp.json` starts none).
    pub const CLAUDE: Self = Self {
        env: &[
            ("CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC", "1"),
            ("CLAUDE_CODE_MAX_RETRIES", "1"),
        ],
        config_overrides: &[],
        flags: &[
            ("--setting-sources", Some("user")),
            ("--strict-mcp-config", None),
        ],
    };
    /// Codex: analytics, plugins and the update check off (0 DNS queries), no unbounded
    /// reconnects (else a dead endpoint waits forever).
    pub const CODEX: Self = Self {
        env: &[],
        config_overrides: &[
            ("analytics.enabled", "false"),
            ("features.plugins", "false"),
            ("check_for_update_on_startup", "false"),
            ("features.unbounded_connection_retries", "false"),
        ],
        flags: &[],
    };
    /// Gemini CLI: the workspace not trusted, so the CLI loads none of its settings: a
    /// working directory's `.gemini/settings.json` has hooks run at session start and before
    /// every prompt, local MCP servers started and tools allowed without asking, and its
    /// `.gemini/.env` set variables (a conversation's directory holds whatever its tenant put
    /// there). With folder trust off in the home's settings an untrusted workspace is no
    /// exit 55. Its telemetry, update and retry switches live in its settings file
    /// ([`crate::backend::gemini::write_settings`]).
    pub const GEMINI: Self = Self {
        env: &[("GEMINI_CLI_TRUST_WORKSPACE", "false")],
        config_overrides: &[],
        flags: &[],
    };
    /// None (a CLI the pool knows nothing about).
    pub const NONE: Self = Self {
        env: &[],
        config_overrides: &[],
        flags: &[],
    };

    /// The switch variables `env` does not name, to add to the child's environment.
    pub fn env_for(&self, env: &BTreeMap<String, String>) -> Vec<(String, String)> {
        self.env
            .iter()
            .filter(|(k, _)| !env.contains_key(*k))
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect()
    }

    /// The switch flags the backend's configured `args` and `resumeArgs` do not carry (as
    /// `flag` or `flag=value`), each followed by its value, to append to a run's arguments.
    /// Only the configuration is read, never a run's filled-in values: a model name or a
    /// system prompt that reads like a flag cannot take a switch off.
    pub fn flag_args_for(&self, backend: &CliBackendConfig) -> Vec<String> {
        let configured = backend.configured_args();
        self.flags
            .iter()
            .filter(|(flag, _)| !names_flag(&configured, flag))
            .flat_map(|(flag, value)| std::iter::once(*flag).chain(*value))
            .map(str::to_owned)
            .collect()
    }

    /// `-c key=value` pairs for the switches whose key the backend's configured `args` and
    /// `resumeArgs` do not set (as `-c key=`, `--config key=` or `--config=key=`), to put
    /// before the subcommand (as [`SafetySwitches::flag_args_for`], the configuration only).
    pub fn config_args_for(&self, backend: &CliBackendConfig) -> Vec<String> {
        let configured = backend.configured_args();
        self.config_overrides
            .iter()
            .filter(|(k, _)| !names_config_key(&configured, k))
            .flat_map(|(k, v)| ["-c".to_owned(), format!("{k}={v}")])
            .collect()
    }
}

/// Whether `args` set the Codex config key `key` (as `-c key=...`, `--config key=...` or
/// `--config=key=...`).
pub fn names_config_key(args: &[String], key: &str) -> bool {
    args.iter().enumerate().any(|(i, arg)| {
        let value = match arg.strip_prefix("--config=") {
            Some(v) => Some(v),
            None if i > 0 && matches!(args[i - 1].as_str(), "-c" | "--config") => {
                Some(arg.as_str())
            }
            None => None,
        };
        value.is_some_and(|v| v.split_once('=').is_some_and(|(k, _)| k.trim() == key))
    })
}

/// Whether `args` carry `flag` (as `flag` or `flag=value`).
pub fn names_flag(args: &[String], flag: &str) -> bool {
    args.iter().any(|a| {
        a == flag
            || a.strip_prefix(flag)
                .is_some_and(|rest| rest.starts_with('='))
    })
}

/// Claude Code's `--effort` level for the lease's reasoning effort (the page: minimal and
/// low → `low`, adaptive and medium → `medium`, high, xhigh and max as they are; the pool's
/// [`ReasoningEffort`] has `low`, `medium`, `high`, `xhigh`). No effort: no flag.
pub fn claude_effort(effort: ReasoningEffort) -> &'static str {
    match effort {
        ReasoningEffort::Low => "low",
        ReasoningEffort::Medium => "medium",
        ReasoningEffort::High => "high",
        ReasoningEffort::XHigh => "xhigh",
    }
}

/// Codex's `model_reasoning_effort` for the lease's reasoning effort (Codex takes `low`,
/// `medium`, `high` and `xhigh` as they are).
pub fn codex_effort(effort: ReasoningEffort) -> &'static str {
    effort.as_str()
}

/// Claude Code's `--permission-mode` for a permission policy: `bypassPermissions` when the
/// policy approves everything (the page: the exec policy is YOLO), else `default` (every
/// tool that needs approval asks the policy over stdio). Claude refuses
/// `bypassPermissions` as root unless `IS_SANDBOX=1` is in its environment. `sandboxed` is
/// true when the runner starts Claude in the pool's sandbox (it then sets `IS_SANDBOX=1`
/// itself) or the backend's `env` sets `IS_SANDBOX=1`; as root without either, `default`
/// stays and the approve-all policy answers each prompt, which runs the same tools.
pub fn claude_permission_mode(approves_all: bool, root: bool, sandboxed: bool) -> &'static str {
    if approves_all && (!root || sandboxed) {
        "bypassPermissions"
    } else {
        "default"
    }
}

/// The ids a CLI backend may not take (compared ignoring ASCII case). A backend's home is
/// `<agent's directory>/<id>`, or `<COPILOT_HOME>/<id>` with an explicit `COPILOT_HOME`
/// ([`crate::home::backend_home`]): beside the agent's `copilot` home and `work` directory
/// and the sandbox's `tmp` ([`crate::sandbox::Sandbox::for_agent`]), or among what the
/// Copilot runtime keeps in its home (`session-state`, `logs`, `installed-plugins`; its files
/// have a `.`, which no id has; reference `copilot-protocol.md` §9), and `pkg`, where the
/// `copilot` executable unpacks its packages (under its cache directory in the reference;
/// kept free in case a version unpacks into its home).
const RESERVED_BACKEND_IDS: &[&str] = &[
    "copilot",
    "work",
    "tmp",
    "session-state",
    "logs",
    "installed-plugins",
    "pkg",
];

fn default_kind() -> BackendKind {
    BackendKind::CliOneshot
}

fn default_session_id_fields() -> Vec<String> {
    vec!["session_id".to_owned()]
}

/// A backend configuration that cannot run; the message says how to fix it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("CLI backend `{backend}`: {problem}")]
pub struct ConfigError {
    /// The backend id.
    pub backend: String,
    /// What is wrong and what to change.
    pub problem: String,
}

impl CliBackendConfig {
    /// A `cli-oneshot` backend running `command` with the page's defaults (output `json`,
    /// input `arg`, session mode `existing`).
    pub fn new(command: impl Into<String>) -> Self {
        Self {
            kind: BackendKind::CliOneshot,
            command: command.into(),
            args: Vec::new(),
            resume_args: None,
            output: OutputFormat::default(),
            resume_output: None,
            input: InputMode::default(),
            max_prompt_arg_chars: None,
            model_arg: None,
            model_aliases: BTreeMap::new(),
            session_arg: None,
            session_args: None,
            session_mode: SessionMode::default(),
            session_id_fields: default_session_id_fields(),
            system_prompt_arg: None,
            system_prompt_file_arg: None,
            system_prompt_file_config_arg: None,
            system_prompt_file_config_key: None,
            system_prompt_when: SystemPromptWhen::default(),
            image_arg: None,
            image_mode: ImageMode::default(),
            serialize: false,
            dialect: None,
            env: BTreeMap::new(),
            api_key_env: None,
            base_url_env: None,
            output_limits: OutputLimits::default(),
            text_transforms: TextTransforms::default(),
        }
    }

    /// The bundled `claude-cli` backend: one live Claude Code process per conversation on
    /// stdio, stream-json in and out (`--verbose` is required for stream-json output with
    /// `-p`), partial messages for deltas, tool permissions asked over stdio
    /// (`--permission-prompt-tool stdio`, answered by the pool's permission policy),
    /// `--resume {sessionId}` when a stored session is continued.
    ///
    /// Not in `args`/`env`, applied by the runner whatever they say
    /// ([`SafetySwitches::CLAUDE`]): nonessential traffic (telemetry, feature flags) off and
    /// API retries bounded to one, so a dead endpoint fails in about a second instead of
    /// retrying for minutes; `--permission-mode` from the permission policy
    /// ([`claude_permission_mode`]) and `--effort` from the lease's reasoning effort
    /// ([`claude_effort`]), each unless `args` name that flag themselves.
    ///
    /// `CLAUDE_CONFIG_DIR` and `TMPDIR` are not static: the live backend sets them inside
    /// the agent's own home when it spawns the process.
    pub fn claude_cli() -> Self {
        let args: Vec<String> = [
            "-p",
            "--input-format",
            "stream-json",
            "--output-format",
            "stream-json",
            "--verbose",
            "--include-partial-messages",
            "--permission-prompt-tool",
            "stdio",
        ]
        .into_iter()
        .map(str::to_owned)
        .collect();
        let mut resume_args = args.clone();
        resume_args.extend(["--resume".to_owned(), SESSION_ID_PLACEHOLDER.to_owned()]);
        let mut config = Self::new("claude");
        config.kind = BackendKind::CliLive;
        config.args = args;
        config.resume_args = Some(resume_args);
        config.output = OutputFormat::Jsonl;
        config.input = InputMode::Stdin;
        config.model_arg = Some("--model".to_owned());
        config.session_mode = SessionMode::Existing;
        config.session_id_fields = vec!["session_id".to_owned()];
        config.system_prompt_arg = Some("--append-system-prompt".to_owned());
        config.system_prompt_when = SystemPromptWhen::First;
        config.serialize = true;
        config.dialect = Some(Dialect::Claude);
        config
    }

    /// The bundled `codex-cli` backend: a Codex process per turn (`cli-oneshot`), JSONL
    /// events on stdout (`exec --json`), the prompt written to stdin, which is then closed
    /// (Codex reads its instructions from stdin when none is on its command line, and waits
    /// forever on a stdin left open), so it is never in the process's command line, where
    /// the host's other users could read it; commands sandboxed (`workspace-write`).
    ///
    /// * A resume puts `resume {sessionId}` after the exec flags (`exec <flags> resume
    ///   <id>`, the prompt on stdin): `--color` and `--sandbox` after `resume` are fatal, and
    ///   this form keeps the JSONL output of a fresh run, so `resumeOutput` stays unset.
    /// * Applied by the runner, not in `args` ([`SafetySwitches::CODEX`]): outbound traffic
    ///   off (analytics, plugins: GitHub and chatgpt.com sync, the update check) and
    ///   retries bounded (`features.unbounded_connection_retries=false`, otherwise a dead
    ///   endpoint is retried forever; the provider's `request_max_retries` and
    ///   `stream_max_retries` of 1 are set with the provider itself).
    /// * The session id is the `thread_id` of `thread.started`; the system prompt goes in a
    ///   file named by `-c model_instructions_file=...` on every run.
    /// * A turn's images go as `--image=<path>` each (joined: exec's `--image <FILE>...`
    ///   takes several values and would swallow the prompt); Codex sends them to the model
    ///   as `input_image` data URLs, on a fresh run and on a resume.
    ///
    /// The model provider (a profile file in `CODEX_HOME` named by `-p`: base URL and query,
    /// `wire_api = "responses"`, the key's variable), `CODEX_HOME` and `TMPDIR` are not static: the one-shot runner adds
    /// them when it spawns the process ([`super::oneshot`]).
    pub fn codex_cli() -> Self {
        let args: Vec<String> = [
            "exec",
            "--json",
            "--color",
            "never",
            "--sandbox",
            "workspace-write",
            "--skip-git-repo-check",
            "--model",
            MODEL_PLACEHOLDER,
        ]
        .into_iter()
        .map(str::to_owned)
        .collect();
        let mut resume_args = args.clone();
        resume_args.extend(["resume".to_owned(), SESSION_ID_PLACEHOLDER.to_owned()]);
        let mut config = Self::new("codex");
        config.kind = BackendKind::CliOneshot;
        config.args = args;
        config.resume_args = Some(resume_args);
        config.output = OutputFormat::Jsonl;
        config.input = InputMode::Stdin;
        config.model_arg = Some("--model".to_owned());
        config.session_mode = SessionMode::Existing;
        config.session_id_fields = vec!["thread_id".to_owned()];
        config.system_prompt_file_config_arg = Some("-c".to_owned());
        config.system_prompt_file_config_key = Some("model_instructions_file".to_owned());
        config.system_prompt_when = SystemPromptWhen::Always;
        // `--image=<path>`: exec's `--image <FILE>...` takes several values, so a separate
        // `--image a.png` would swallow the prompt after it (resume takes both forms).
        config.image_arg = Some("--image=".to_owned());
        config.image_mode = ImageMode::Repeat;
        config.serialize = true;
        config.dialect = Some(Dialect::Codex);
        config
    }

    /// The bundled `google-gemini-cli` backend (reference: `cli-backends.md` §5): a process
    /// per turn, `--output-format stream-json` with the prompt written to stdin, which is then
    /// closed (non-interactive: stdin is not a terminal; never on the process's command line,
    /// where the host's other users could read it) (JSONL as it happens: `init`
    /// with the `session_id`, the answer's chunks, the CLI's tool calls and results, a closing
    /// `result` with usage under `stats`; read by [`crate::backend::gemini::StreamState`]),
    /// `--resume {sessionId}` to continue
    /// a stored session (the CLI's own transcript must exist: see
    /// [`crate::backend::gemini::transcript_path`]), `--model` so each turn makes one model
    /// call instead of a router call first. The key goes in `GEMINI_API_KEY` and the endpoint
    /// in `GOOGLE_GEMINI_BASE_URL`, both only in the child's environment; the self-relaunch
    /// (a second Node boot, 1–4 s) is off. The workspace is left untrusted by the runner
    /// ([`SafetySwitches::GEMINI`]: `GEMINI_CLI_TRUST_WORKSPACE=false`, with folder trust off
    /// in the home's settings, so no exit 55) unless `env` names the variable: its own
    /// settings are not loaded, and the CLI ignores `--approval-mode yolo` there.
    ///
    /// Not expressible here and required before the first run: the auth type, telemetry,
    /// auto-update and the retry bound in `<home>/.gemini/settings.json`
    /// ([`crate::backend::gemini::write_settings`]).
    pub fn google_gemini_cli() -> Self {
        let strings = |list: &[&str]| list.iter().map(|s| (*s).to_owned()).collect::<Vec<_>>();
        let mut config = Self::new("gemini");
        config.kind = BackendKind::CliOneshot;
        config.args = strings(&["--output-format", "stream-json"]);
        config.resume_args = Some(strings(&[
            "--resume",
            SESSION_ID_PLACEHOLDER,
            "--output-format",
            "stream-json",
        ]));
        config.output = OutputFormat::Jsonl;
        config.input = InputMode::Stdin;
        config.model_arg = Some("--model".to_owned());
        config.session_mode = SessionMode::Existing;
        config.session_id_fields = strings(&["session_id"]);
        // A resume must see the previous turn's transcript: one run at a time.
        config.serialize = true;
        config.env = BTreeMap::from([("GEMINI_CLI_NO_RELAUNCH".to_owned(), "true".to_owned())]);
        config.api_key_env = Some("GEMINI_API_KEY".to_owned());
        config.base_url_env = Some("GOOGLE_GEMINI_BASE_URL".to_owned());
        config.dialect = Some(Dialect::Gemini);
        config
    }

    /// The arguments the configuration names, fresh and resumed (placeholders unfilled).
    fn configured_args(&self) -> Vec<String> {
        let resume = self.resume_args.as_deref().unwrap_or_default();
        self.args.iter().chain(resume).cloned().collect()
    }

    /// The dialect backend `id` runs with: its `dialect` key; else Claude for a `cli-live`
    /// backend; else the bundled id's ([`Dialect::of_backend`]); else the one `command`'s
    /// file name names ([`Dialect::of_command`]: `codex`, `gemini`, `gemini.js`, `claude`),
    /// or generic.
    pub fn dialect_of(&self, id: &str) -> Dialect {
        if let Some(dialect) = self.dialect {
            return dialect;
        }
        if self.kind == BackendKind::CliLive {
            return Dialect::Claude;
        }
        match Dialect::of_backend(id) {
            Dialect::Generic => Dialect::of_command(&self.command),
            bundled => bundled,
        }
    }

    /// The bundled default of a backend id, if there is one (`claude-cli`, `codex-cli`,
    /// `google-gemini-cli`).
    pub fn bundled(id: &str) -> Option<Self> {
        match id {
            "claude-cli" => Some(Self::claude_cli()),
            "codex-cli" => Some(Self::codex_cli()),
            "google-gemini-cli" => Some(Self::google_gemini_cli()),
            _ => None,
        }
    }

    /// The CLI's model name for the pool's `model` (its alias, else itself).
    pub fn cli_model<'a>(&'a self, model: &'a str) -> &'a str {
        self.model_aliases
            .get(model)
            .map(String::as_str)
            .unwrap_or(model)
    }

    /// The arguments of a run: `args`, or `resumeArgs` with the id when resuming, with
    /// `{sessionId}` and `{model}` filled in. Placeholders of absent values are dropped with
    /// the flag just before them (a `--resume {sessionId}` without an id disappears).
    pub fn argv(&self, session_id: Option<&str>, model: Option<&str>) -> Vec<String> {
        let resuming = session_id.is_some() && self.resume_args.is_some();
        let base = match (&self.resume_args, session_id) {
            (Some(resume), Some(_)) => resume.clone(),
            _ => self.args.clone(),
        };
        let mut out: Vec<String> = Vec::with_capacity(base.len() + 4);
        for arg in base {
            let filled = fill(&arg, SESSION_ID_PLACEHOLDER, session_id)
                .and_then(|a| fill(&a, MODEL_PLACEHOLDER, model.map(|m| self.cli_model(m))));
            match filled {
                Some(a) => out.push(a),
                None => {
                    // Drop the flag that introduced the missing value.
                    if out.last().is_some_and(|prev| prev.starts_with('-')) {
                        out.pop();
                    }
                }
            }
        }
        if !resuming && let Some(id) = session_id {
            match (&self.session_arg, &self.session_args) {
                (Some(flag), _) => out.extend([flag.clone(), id.to_owned()]),
                (None, Some(args)) => {
                    out.extend(args.iter().map(|a| a.replace(SESSION_ID_PLACEHOLDER, id)))
                }
                (None, None) => {}
            }
        }
        if let (Some(flag), Some(model)) = (&self.model_arg, model)
            && !self.args.iter().any(|a| a.contains(MODEL_PLACEHOLDER))
        {
            out.extend([flag.clone(), self.cli_model(model).to_owned()]);
        }
        out
    }

    /// Applies the `input` (or `output`) text transforms, in order.
    pub fn transform(&self, text: &str, output: bool) -> String {
        let rules = if output {
            &self.text_transforms.output
        } else {
            &self.text_transforms.input
        };
        let mut text = text.to_owned();
        for rule in rules {
            // Validation compiled every pattern; one that fails here is skipped.
            if let Ok(re) = regex::Regex::new(&rule.from) {
                text = re.replace_all(&text, rule.to.as_str()).into_owned();
            }
        }
        text
    }

    /// The `PATH` the backend's processes get: its own `env`'s over `path_var` (the daemon's).
    pub fn child_path_var(&self, path_var: Option<&std::ffi::OsStr>) -> Option<std::ffi::OsString> {
        self.env
            .get("PATH")
            .map(std::ffi::OsString::from)
            .or_else(|| path_var.map(ToOwned::to_owned))
    }

    /// Checks, before a process of backend `id` starts, that its `command` is there: a bare
    /// name an executable file on `path_var` (the `PATH` its processes get), an absolute path
    /// an executable file. A relative path with a `/` is left to the spawn. The error names
    /// the command, where it was looked for and how to fix it, where a start would fail with
    /// the OS's "No such file" (or, sandboxed, inside the sandbox's wrapper).
    pub fn check_installed(
        &self,
        id: &str,
        path_var: Option<&std::ffi::OsStr>,
    ) -> Result<(), ConfigError> {
        let command = std::path::Path::new(&self.command);
        let bare = crate::runtime::is_bare_name(command);
        let path_var = self.child_path_var(path_var);
        let found = if bare {
            // No PATH at all: left to the spawn (the OS's default search).
            path_var.is_none() || crate::runtime::find_on_path(&self.command, path_var).is_some()
        } else {
            !command.is_absolute() || crate::runtime::is_executable_file(command)
        };
        if found {
            return Ok(());
        }
        let place = if bare {
            "found on the PATH the backend's processes get"
        } else {
            "an executable file"
        };
        Err(ConfigError {
            backend: id.to_owned(),
            problem: format!(
                "its `command` {:?} is not {place}; install the CLI there (the library's \
                 `copilot_pool::runtime::install_agent_cli` installs Claude Code, Codex and \
                 Gemini CLI) or set `command` in `[backends.{id}]` to the executable's full path",
                self.command
            ),
        })
    }

    /// Checks that this configuration can run as backend `id`; the error says what to change.
    pub fn validate(&self, id: &str) -> Result<(), ConfigError> {
        let fail = |problem: String| {
            Err(ConfigError {
                backend: id.to_owned(),
                problem,
            })
        };
        if id.is_empty()
            || !id
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
        {
            return fail(
                "a backend id is made of ASCII letters, digits, `-` and `_` (e.g. `claude-cli`)"
                    .to_owned(),
            );
        }
        if let Some(reserved) = RESERVED_BACKEND_IDS
            .iter()
            .find(|name| name.eq_ignore_ascii_case(id))
        {
            return fail(format!(
                "the id `{reserved}` is reserved: a backend's home is the directory named by \
                 its id in the agent's directory (or in an explicit COPILOT_HOME), where {} \
                 are the pool's or the Copilot runtime's own; name the backend otherwise \
                 (e.g. `{reserved}-cli`)",
                RESERVED_BACKEND_IDS
                    .iter()
                    .map(|name| format!("`{name}`"))
                    .collect::<Vec<_>>()
                    .join(", ")
            ));
        }
        if self.kind == BackendKind::Copilot {
            return fail(
                "`kind = \"copilot\"` is the Copilot runtime, configured by the pool's worker \
                 settings; a CLI backend is `cli-oneshot` or `cli-live`"
                    .to_owned(),
            );
        }
        if self.command.trim().is_empty() {
            return fail(
                "`command` is empty; set it to the CLI's executable (a path, or a name on PATH)"
                    .to_owned(),
            );
        }
        if self.dialect_of(id) == Dialect::Gemini
            && gemini_approves_without_asking(&self.configured_args())
            && !self.env.contains_key("GEMINI_CLI_TRUST_WORKSPACE")
        {
            return fail(
                "Gemini CLI takes `--approval-mode yolo` or `auto_edit` (`--yolo`) only in a \
                 trusted workspace, and the pool leaves the working directory untrusted (so the \
                 CLI loads none of its `.gemini/` settings, hooks or MCP servers); set \
                 `GEMINI_CLI_TRUST_WORKSPACE = \"true\"` in `env` to trust it (the workspace's \
                 settings are then loaded too), or drop the approval mode"
                    .to_owned(),
            );
        }
        if self.kind == BackendKind::CliLive
            && let Some(dialect) = self.dialect.filter(|d| *d != Dialect::Claude)
        {
            return fail(format!(
                "a `cli-live` backend runs Claude Code (`dialect = \"claude\"`), not `{}`; \
                 drop the `dialect` key, or use `kind = \"cli-oneshot\"` for that CLI",
                dialect.as_str()
            ));
        }
        if self.kind == BackendKind::CliLive
            && (self.input != InputMode::Stdin || self.output != OutputFormat::Jsonl)
        {
            return fail(
                "a `cli-live` backend talks over stdio: set `input = \"stdin\"` and \
                 `output = \"jsonl\"`"
                    .to_owned(),
            );
        }
        let lists = std::iter::once(("args", &self.args))
            .chain(self.resume_args.iter().map(|a| ("resumeArgs", a)))
            .chain(self.session_args.iter().map(|a| ("sessionArgs", a)));
        for (key, list) in lists {
            for arg in list {
                if let Some(unknown) = unknown_placeholder(arg) {
                    return fail(format!(
                        "`{key}` has the unknown placeholder `{unknown}` in `{arg}`; the \
                         placeholders are {}",
                        PLACEHOLDERS.join(", ")
                    ));
                }
                if arg.contains('\0') {
                    return fail(format!(
                        "`{key}` has an argument with a NUL byte; remove it"
                    ));
                }
            }
        }
        if self.session_arg.is_some() && self.session_args.is_some() {
            return fail(
                "both `sessionArg` and `sessionArgs` are set; keep `sessionArg` for one flag, \
                 or `sessionArgs` with `{sessionId}` when the id goes in several places"
                    .to_owned(),
            );
        }
        if let Some(args) = &self.session_args
            && !args.iter().any(|a| a.contains(SESSION_ID_PLACEHOLDER))
        {
            return fail(
                "`sessionArgs` never mentions `{sessionId}`; put it where the id goes".to_owned(),
            );
        }
        if let Some(args) = &self.resume_args
            && !args.iter().any(|a| a.contains(SESSION_ID_PLACEHOLDER))
            && self.session_arg.is_none()
            && self.session_args.is_none()
        {
            return fail(
                "`resumeArgs` never mentions `{sessionId}` and no `sessionArg` is set, so a \
                 resume could not name the session; add `{sessionId}` to `resumeArgs`"
                    .to_owned(),
            );
        }
        if self.session_mode != SessionMode::None
            && self.session_arg.is_none()
            && self.session_args.is_none()
            && self.resume_args.is_none()
        {
            return fail(
                "`sessionMode` asks for a session id but there is no way to pass one; set \
                 `sessionArg`, `sessionArgs` or `resumeArgs`, or `sessionMode = \"none\"`"
                    .to_owned(),
            );
        }
        if self.session_mode != SessionMode::None && self.session_id_fields.is_empty() {
            return fail(
                "`sessionIdFields` is empty, so the session id could never be read from the \
                 output; list the field(s) that hold it (e.g. [\"session_id\"])"
                    .to_owned(),
            );
        }
        match self.max_prompt_arg_chars {
            Some(0) => {
                return fail(
                    "`maxPromptArgChars` is 0; leave it out, or give the longest prompt that \
                     may be passed as an argument"
                        .to_owned(),
                );
            }
            Some(_) if self.input == InputMode::Stdin => {
                return fail(
                    "`maxPromptArgChars` only applies to `input = \"arg\"`; remove it".to_owned(),
                );
            }
            _ => {}
        }
        let prompt_routes = [
            self.system_prompt_arg.is_some(),
            self.system_prompt_file_arg.is_some(),
            self.system_prompt_file_config_arg.is_some(),
        ];
        if prompt_routes.iter().filter(|set| **set).count() > 1 {
            return fail(
                "more than one of `systemPromptArg`, `systemPromptFileArg` and \
                 `systemPromptFileConfigArg` is set; keep the one the CLI understands"
                    .to_owned(),
            );
        }
        if self.system_prompt_file_config_arg.is_some()
            != self.system_prompt_file_config_key.is_some()
        {
            return fail(
                "`systemPromptFileConfigArg` and `systemPromptFileConfigKey` go together (e.g. \
                 `-c` and `model_instructions_file`); set both or neither"
                    .to_owned(),
            );
        }
        for (key, value) in &self.env {
            if key.is_empty() || key.contains('=') || key.contains('\0') || value.contains('\0') {
                return fail(format!(
                    "`env` has an invalid variable `{key}`; names are non-empty without `=`, \
                     and neither side holds a NUL byte"
                ));
            }
            if looks_like_credential(key) {
                return fail(format!(
                    "`env.{key}` looks like a credential; configuration files are not the \
                     place for keys: pass it as the backend's secret (it then reaches only \
                     the child's environment and never a log)"
                ));
            }
        }
        let routed = [
            ("apiKeyEnv", &self.api_key_env),
            ("baseUrlEnv", &self.base_url_env),
        ];
        for (key, name) in routed {
            let Some(name) = name else { continue };
            if !is_env_name(name) {
                return fail(format!(
                    "`{key}` is `{name}`, which is not an environment variable name; use \
                     letters, digits and `_`, not starting with a digit (e.g. `GEMINI_API_KEY`)"
                ));
            }
            if self.env.contains_key(name) {
                return fail(format!(
                    "`{key}` names `{name}`, which `env` also sets; remove it from `env`: the \
                     pool fills it for each run"
                ));
            }
        }
        if self.api_key_env.is_some() && self.api_key_env == self.base_url_env {
            return fail(
                "`apiKeyEnv` and `baseUrlEnv` name the same variable; give each its own".to_owned(),
            );
        }
        let limits = self.output_limits;
        if limits.max_turn_raw_chars == 0 || limits.max_turn_raw_chars > MAX_TURN_RAW_CHARS_CAP {
            return fail(format!(
                "`outputLimits.maxTurnRawChars` is {}; it must be between 1 and {} (64 MiB)",
                limits.max_turn_raw_chars, MAX_TURN_RAW_CHARS_CAP
            ));
        }
        if limits.max_turn_lines == 0 || limits.max_turn_lines > MAX_TURN_LINES_CAP {
            return fail(format!(
                "`outputLimits.maxTurnLines` is {}; it must be between 1 and {}",
                limits.max_turn_lines, MAX_TURN_LINES_CAP
            ));
        }
        let rewrites = self
            .text_transforms
            .input
            .iter()
            .map(|r| ("input", r))
            .chain(self.text_transforms.output.iter().map(|r| ("output", r)));
        for (side, rewrite) in rewrites {
            if let Err(error) = regex::Regex::new(&rewrite.from) {
                return fail(format!(
                    "`textTransforms.{side}` pattern `{}` is not a valid regex ({error}); fix \
                     or escape it",
                    rewrite.from
                ));
            }
        }
        Ok(())
    }
}

/// `arg` with `placeholder` replaced by `value`; `None` when it holds the placeholder and
/// there is no value.
fn fill(arg: &str, placeholder: &str, value: Option<&str>) -> Option<String> {
    if !arg.contains(placeholder) {
        return Some(arg.to_owned());
    }
    value.map(|v| arg.replace(placeholder, v))
}

/// The first `{word}` in `arg` that is not one of the known placeholders.
fn unknown_placeholder(arg: &str) -> Option<String> {
    let mut rest = arg;
    while let Some(start) = rest.find('{') {
        let after = &rest[start..];
        let end = after.find('}')?;
        let candidate = &after[..=end];
        let word = &candidate[1..candidate.len() - 1];
        if !word.is_empty()
            && word.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
            && !PLACEHOLDERS.contains(&candidate)
        {
            return Some(candidate.to_owned());
        }
        rest = &after[end + 1..];
    }
    None
}

/// A portable environment variable name: `[A-Za-z_][A-Za-z0-9_]*`.
fn is_env_name(name: &str) -> bool {
    let mut chars = name.chars();
    chars
        .next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
}

/// Whether Gemini CLI arguments ask for an approval mode that runs tools without asking
/// (`--approval-mode yolo|auto_edit`, `--approval-mode=…`, `--yolo`, `-y`).
fn gemini_approves_without_asking(args: &[String]) -> bool {
    let unasked = |mode: &str| matches!(mode, "yolo" | "auto_edit");
    args.iter().enumerate().any(|(i, arg)| {
        arg == "--yolo"
            || arg == "-y"
            || arg.strip_prefix("--approval-mode=").is_some_and(unasked)
            || (arg == "--approval-mode" && args.get(i + 1).is_some_and(|m| unasked(m)))
    })
}

/// Environment names that hold credentials (`*_API_KEY`, `*_TOKEN`, `*_SECRET`, `*PASSWORD*`).
fn looks_like_credential(name: &str) -> bool {
    let upper = name.to_ascii_uppercase();
    upper.ends_with("API_KEY")
        || upper.ends_with("_TOKEN")
        || upper.ends_with("_SECRET")
        || upper.contains("PASSWORD")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_command_is_looked_for_on_the_path_its_processes_get() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let tool = dir.path().join("my-cli");
        std::fs::write(&tool, "#!/bin/sh\n").unwrap();
        std::fs::set_permissions(&tool, std::fs::Permissions::from_mode(0o755)).unwrap();
        let daemons = std::ffi::OsString::from("/nonexistent-bin");
        let mut config = CliBackendConfig::new("my-cli");
        // Not on the daemon's PATH: refused, naming the command, the PATH and the key.
        let err = config.check_installed("mine", Some(&daemons)).unwrap_err();
        assert!(
            err.problem.contains("\"my-cli\"")
                && err.problem.contains("PATH")
                && err.problem.contains("[backends.mine]"),
            "{err}"
        );
        // On the backend's own `env` PATH, which its processes get over the daemon's.
        config
            .env
            .insert("PATH".into(), dir.path().display().to_string());
        config.check_installed("mine", Some(&daemons)).unwrap();
        // An absolute path: an executable file, or refused.
        let mut absolute = CliBackendConfig::new(tool.display().to_string());
        absolute.check_installed("mine", None).unwrap();
        absolute.command = dir.path().join("gone").display().to_string();
        let err = absolute.check_installed("mine", None).unwrap_err();
        assert!(err.problem.contains("an executable file"), "{err}");
        // A relative path with a directory, and a bare name with no PATH at all, are left to
        // the spawn.
        CliBackendConfig::new("bin/my-cli")
            .check_installed("mine", Some(&daemons))
            .unwrap();
        CliBackendConfig::new("my-cli")
            .check_installed("mine", None)
            .unwrap();
    }

    fn problem(config: &CliBackendConfig) -> String {
        config
            .validate("my-cli")
            .expect_err("the configuration should be refused")
            .to_string()
    }

    #[test]
    fn the_bundled_claude_backend_is_valid_live_stream_json_with_bounded_retries() {
        let claude = CliBackendConfig::bundled("claude-cli").expect("bundled");
        claude.validate("claude-cli").expect("valid");
        assert_eq!(claude.kind, BackendKind::CliLive);
        for flag in ["--verbose", "stream-json", "--permission-prompt-tool"] {
            assert!(claude.args.iter().any(|a| a == flag), "{flag}");
        }
        // The safety switches and the permission mode are the runner's, not in `args`/`env`
        // (an override of those cannot drop them).
        assert!(claude.env.is_empty(), "{:?}", claude.env);
        assert!(!claude.args.iter().any(|a| a == "--permission-mode"));
        let switches = SafetySwitches::CLAUDE.env_for(&claude.env);
        assert!(switches.contains(&("CLAUDE_CODE_MAX_RETRIES".into(), "1".into())));
        assert!(switches.contains(&(
            "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC".into(),
            "1".into()
        )));
        assert!(CliBackendConfig::bundled("nope").is_none());
    }

    #[test]
    fn a_gemini_approval_mode_that_needs_a_trusted_workspace_is_refused_unless_env_trusts_it() {
        for args in [
            vec!["--approval-mode", "yolo"],
            vec!["--approval-mode=auto_edit"],
            vec!["--yolo"],
        ] {
            let mut gemini = CliBackendConfig::bundled("google-gemini-cli").expect("bundled");
            gemini.args.extend(args.iter().map(|a| (*a).to_owned()));
            let e = gemini
                .validate("google-gemini-cli")
                .expect_err("refused")
                .to_string();
            assert!(e.contains("GEMINI_CLI_TRUST_WORKSPACE"), "{args:?}: {e}");
            gemini
                .env
                .insert("GEMINI_CLI_TRUST_WORKSPACE".to_owned(), "true".to_owned());
            gemini
                .validate("google-gemini-cli")
                .expect("trusted by the operator");
        }
        let mut gemini = CliBackendConfig::bundled("google-gemini-cli").expect("bundled");
        gemini
            .args
            .extend(["--approval-mode".to_owned(), "default".to_owned()]);
        gemini.validate("google-gemini-cli").expect("asks");
    }

    #[test]
    fn claudes_settings_come_from_the_agents_home_alone_unless_the_args_say_otherwise() {
        let claude = CliBackendConfig::bundled("claude-cli").expect("bundled");
        assert_eq!(
            SafetySwitches::CLAUDE.flag_args_for(&claude),
            ["--setting-sources", "user", "--strict-mcp-config"]
        );
        // Flags the operator's arguments carry already (fresh or resumed) are not repeated.
        let mut own = claude.clone();
        own.args.push("--setting-sources=user,project".to_owned());
        own.resume_args = Some(vec!["--strict-mcp-config".to_owned()]);
        assert!(SafetySwitches::CLAUDE.flag_args_for(&own).is_empty());
        let codex = CliBackendConfig::bundled("codex-cli").expect("bundled");
        assert!(SafetySwitches::CODEX.flag_args_for(&codex).is_empty());
    }

    #[test]
    fn the_bundled_codex_backend_is_valid_jsonl_with_the_resume_after_the_exec_flags() {
        let codex = CliBackendConfig::bundled("codex-cli").expect("bundled");
        codex.validate("codex-cli").expect("valid");
        assert_eq!(codex.kind, BackendKind::CliOneshot);
        assert_eq!(codex.output, OutputFormat::Jsonl);
        assert_eq!(codex.resume_output, None, "a resume keeps the JSONL");
        assert_eq!(codex.input, InputMode::Stdin, "never on the command line");
        assert_eq!(codex.session_id_fields, ["thread_id"]);
        for switch in [
            "analytics.enabled=false",
            "features.plugins=false",
            "check_for_update_on_startup=false",
            "features.unbounded_connection_retries=false",
        ] {
            assert!(
                !codex.args.iter().any(|a| a == switch),
                "the runner's: {switch}"
            );
            assert!(
                SafetySwitches::CODEX
                    .config_args_for(&codex)
                    .contains(&switch.to_owned()),
                "{switch}"
            );
        }
        let fresh = codex.argv(None, None);
        assert_eq!(fresh[..3], ["exec", "--json", "--color"]);
        assert!(
            !fresh.iter().any(|a| a == "--model" || a == "resume"),
            "{fresh:?}"
        );
        let resumed = codex.argv(Some("t-1"), Some("gpt-5.5"));
        assert_eq!(resumed[resumed.len() - 2..], ["resume", "t-1"]);
        let at = |flag: &str| resumed.iter().position(|a| a == flag).expect(flag);
        assert!(at("--color") < at("resume") && at("--sandbox") < at("resume"));
        assert_eq!(resumed[at("--model") + 1], "gpt-5.5");
        assert_eq!(
            resumed.iter().filter(|a| *a == "--model").count(),
            1,
            "{resumed:?}"
        );
    }

    #[test]
    fn the_bundled_gemini_backend_is_a_valid_oneshot_with_stream_json_output_resume_and_trust() {
        let gemini = CliBackendConfig::bundled("google-gemini-cli").expect("bundled");
        gemini.validate("google-gemini-cli").expect("valid");
        assert_eq!(gemini.kind, BackendKind::CliOneshot);
        assert_eq!(gemini.output, OutputFormat::Jsonl);
        assert_eq!(gemini.session_id_fields, ["session_id"]);
        assert_eq!(
            SafetySwitches::GEMINI.env_for(&gemini.env),
            [("GEMINI_CLI_TRUST_WORKSPACE".to_owned(), "false".to_owned())]
        );
        assert_eq!(gemini.env["GEMINI_CLI_NO_RELAUNCH"], "true");
        assert_eq!(gemini.api_key_env.as_deref(), Some("GEMINI_API_KEY"));
        assert_eq!(
            gemini.base_url_env.as_deref(),
            Some("GOOGLE_GEMINI_BASE_URL")
        );
        assert_eq!(
            gemini.argv(None, Some("gemini-2.5-pro")),
            [
                "--output-format",
                "stream-json",
                "--model",
                "gemini-2.5-pro"
            ]
        );
        assert_eq!(
            gemini.argv(Some("95642bd1-0b6b"), None),
            [
                "--resume",
                "95642bd1-0b6b",
                "--output-format",
                "stream-json",
            ]
        );
    }

    #[test]
    fn the_key_and_endpoint_variables_must_be_names_the_env_table_does_not_also_set() {
        let mut c = CliBackendConfig::google_gemini_cli();
        c.api_key_env = Some("GEMINI API KEY".into());
        assert!(problem(&c).contains("not an environment variable name"));
        let mut c = CliBackendConfig::google_gemini_cli();
        c.base_url_env = Some("GEMINI_CLI_NO_RELAUNCH".into());
        assert!(problem(&c).contains("which `env` also sets"));
        let mut c = CliBackendConfig::google_gemini_cli();
        c.base_url_env = c.api_key_env.clone();
        assert!(problem(&c).contains("name the same variable"));
        let read: CliBackendConfig = serde_json::from_str(
            r#"{"command":"gemini","sessionMode":"none","apiKeyEnv":"K","baseUrlEnv":"U"}"#,
        )
        .expect("camelCase keys");
        assert_eq!(read.api_key_env.as_deref(), Some("K"));
        assert_eq!(read.base_url_env.as_deref(), Some("U"));
        read.validate("g").expect("valid");
    }

    #[test]
    fn claude_argv_resumes_with_the_stored_id_and_maps_model_aliases() {
        let mut claude = CliBackendConfig::claude_cli();
        claude
            .model_aliases
            .insert("anthropic/opus".to_owned(), "opus".to_owned());
        let fresh = claude.argv(None, Some("anthropic/opus"));
        assert!(!fresh.iter().any(|a| a == "--resume"), "{fresh:?}");
        assert_eq!(fresh[fresh.len() - 2..], ["--model", "opus"]);
        let resumed = claude.argv(Some("abc-123"), None);
        assert_eq!(resumed[resumed.len() - 2..], ["--resume", "abc-123"]);
    }

    #[test]
    fn session_args_carry_the_id_on_a_fresh_run() {
        let mut config = CliBackendConfig::new("my-cli");
        config.session_args = Some(vec!["--session".into(), "s={sessionId}".into()]);
        config.session_mode = SessionMode::Always;
        config.validate("my-cli").expect("valid");
        assert_eq!(config.argv(Some("42"), None), ["--session", "s=42"]);
        config.session_args = None;
        config.session_arg = Some("--session-id".into());
        assert_eq!(config.argv(Some("42"), None), ["--session-id", "42"]);
    }

    #[test]
    fn the_page_example_reads_from_toml_keys_in_camel_case() {
        let text = r#"
            command = "my-cli"
            args = ["--json"]
            output = "json"
            input = "arg"
            modelArg = "--model"
            sessionArg = "--session"
            sessionMode = "existing"
            sessionIdFields = ["session_id", "conversation_id"]
            systemPromptArg = "--system"
            systemPromptWhen = "first"
            imageArg = "--image"
            imageMode = "repeat"
            serialize = true
            [modelAliases]
            "claude-opus-4-6" = "opus"
            [outputLimits]
            maxTurnLines = 50000
        "#;
        let config: CliBackendConfig = toml_like(text);
        config.validate("my-cli").expect("valid");
        assert_eq!(config.cli_model("claude-opus-4-6"), "opus");
        assert_eq!(config.output_limits.max_turn_lines, 50_000);
        assert_eq!(
            config.output_limits.max_turn_raw_chars,
            DEFAULT_MAX_TURN_RAW_CHARS
        );
    }

    /// The daemon's TOML parser (feature `cli`) reads the page's keys as they are spelled.
    #[cfg(feature = "cli")]
    fn toml_like(text: &str) -> CliBackendConfig {
        toml::from_str(text).expect("parses")
    }

    #[cfg(not(feature = "cli"))]
    fn toml_like(_text: &str) -> CliBackendConfig {
        let mut config = CliBackendConfig::new("my-cli");
        config.session_arg = Some("--session".into());
        config
            .model_aliases
            .insert("claude-opus-4-6".into(), "opus".into());
        config.output_limits.max_turn_lines = 50_000;
        config
    }

    #[test]
    fn unknown_keys_are_refused_by_name() {
        let err = serde_json::from_str::<CliBackendConfig>(r#"{"command":"x","resumeArg":["a"]}"#)
            .expect_err("unknown key");
        assert!(err.to_string().contains("resumeArg"), "{err}");
    }

    #[test]
    fn invalid_configurations_say_what_to_change() {
        let base = || {
            let mut c = CliBackendConfig::new("my-cli");
            c.session_arg = Some("--session".into());
            c
        };
        base().validate("my-cli").expect("the base is valid");

        let mut c = base();
        c.command = " ".into();
        assert!(problem(&c).contains("`command` is empty"));

        let mut c = base();
        c.kind = BackendKind::Copilot;
        assert!(problem(&c).contains("cli-oneshot"));

        let mut c = base();
        c.kind = BackendKind::CliLive;
        assert!(problem(&c).contains("input = \"stdin\""));

        let mut c = base();
        c.session_args = Some(vec!["--s".into(), "{sessionId}".into()]);
        assert!(problem(&c).contains("both `sessionArg` and `sessionArgs`"));

        let mut c = base();
        c.session_arg = None;
        c.session_args = Some(vec!["--s".into()]);
        assert!(problem(&c).contains("never mentions `{sessionId}`"));

        let mut c = base();
        c.session_arg = None;
        c.resume_args = Some(vec!["resume".into()]);
        assert!(problem(&c).contains("add `{sessionId}` to `resumeArgs`"));

        let mut c = base();
        c.session_arg = None;
        assert!(problem(&c).contains("sessionMode = \"none\""));
        c.session_mode = SessionMode::None;
        c.validate("my-cli").expect("no session, no way needed");

        let mut c = base();
        c.args = vec!["--p".into(), "{promt}".into()];
        assert!(problem(&c).contains("unknown placeholder `{promt}`"));

        let mut c = base();
        c.max_prompt_arg_chars = Some(0);
        assert!(problem(&c).contains("`maxPromptArgChars` is 0"));
        c.max_prompt_arg_chars = Some(1000);
        c.input = InputMode::Stdin;
        assert!(problem(&c).contains("only applies to `input = \"arg\"`"));

        let mut c = base();
        c.system_prompt_arg = Some("--system".into());
        c.system_prompt_file_arg = Some("--system-file".into());
        assert!(problem(&c).contains("more than one of"));

        let mut c = base();
        c.system_prompt_file_config_arg = Some("-c".into());
        assert!(problem(&c).contains("set both or neither"));

        let mut c = base();
        c.env.insert("ANTHROPIC_API_KEY".into(), "sk".into());
        let text = problem(&c);
        assert!(text.contains("looks like a credential"), "{text}");
        assert!(
            !text.contains("sk\""),
            "the value is never repeated: {text}"
        );

        let mut c = base();
        c.output_limits.max_turn_raw_chars = MAX_TURN_RAW_CHARS_CAP + 1;
        assert!(problem(&c).contains("64 MiB"));
        let mut c = base();
        c.output_limits.max_turn_lines = 0;
        assert!(problem(&c).contains("between 1 and 100000"));

        let mut c = base();
        c.text_transforms.output.push(TextRewrite {
            from: "(unclosed".into(),
            to: "x".into(),
        });
        assert!(problem(&c).contains("not a valid regex"));

        let err = base().validate("bad id!").expect_err("bad id");
        assert!(err.to_string().contains("ASCII letters"), "{err}");
    }

    #[test]
    fn a_backend_id_naming_a_directory_of_the_pool_or_the_runtime_in_the_agents_home_is_refused_listing_the_reserved_names()
     {
        let mut config = CliBackendConfig::new("my-cli");
        config.session_mode = SessionMode::None;
        for id in [
            "copilot",
            "work",
            "tmp",
            "session-state",
            "logs",
            "installed-plugins",
            "pkg",
            "Work",
        ] {
            let err = config.validate(id).expect_err("a reserved id");
            let text = err.to_string();
            assert!(text.contains("is reserved"), "{text}");
            for name in RESERVED_BACKEND_IDS {
                assert!(text.contains(&format!("`{name}`")), "{id}: {text}");
            }
        }
        for id in ["work-cli", "copilot2", "my-logs", "claude-cli"] {
            config.validate(id).expect("not reserved");
        }
    }

    #[test]
    fn text_transforms_rewrite_in_order() {
        let mut c = CliBackendConfig::new("my-cli");
        c.text_transforms.input.push(TextRewrite {
            from: "red (basket)".into(),
            to: "blue $1".into(),
        });
        c.text_transforms.output.push(TextRewrite {
            from: "blue".into(),
            to: "red".into(),
        });
        assert_eq!(c.transform("a red basket", false), "a blue basket");
        assert_eq!(c.transform("a blue basket", true), "a red basket");
    }
}
