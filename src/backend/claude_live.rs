//! The `claude-cli` live backend: one long-lived Claude Code process per conversation, on
//! stdio, stream-json in and out (reference: `cli-backends.md` §3.4).
//!
//! Owns that process and its turns. [`ClaudeLive`] starts the process lazily, in its own
//! process group ([`crate::process::ChildGroup`]), with a home of its own
//! (`CLAUDE_CONFIG_DIR` and `TMPDIR` inside the agent's home) and the key only in the
//! child's environment. A turn ([`ClaudeLive::start_turn`], [`ClaudeTurn::next`]) writes one
//! user line (its images, [`ClaudeLive::start_turn_with_images`], as base64 `image` content
//! blocks) and maps what comes back to [`BackendEvent`]s: partial text deltas, assistant
//! messages, tool calls, `can_use_tool` control requests answered by the conversation's
//! [`PermissionPolicy`] (reject-all by default), and the `result` line as the
//! `turn.end` with its usage.
//!
//! Invariants:
//! * the process group is killed on every path that leaves it behind: a crash, an output
//!   limit, an interrupt that is not honoured in time, a turn dropped before its end, the
//!   [`ClaudeLive`] dropped; its leader is always reaped (by `ChildGroup`);
//! * a process that dies mid-turn ends the turn `crashed` as soon as its stdout closes (no
//!   timeout wait), and the next turn starts a new process with `--resume <session id>`;
//! * the output a turn retains (every line but the stream's envelopes, `is_envelope`: the
//!   `stream_event`s of partial deltas, the `system` lines, the `result`, the control
//!   protocol's requests and responses) is bounded by the backend's `outputLimits`
//!   (8 MiB / 20,000 lines by default); an envelope line is still bounded by the byte limit
//!   alone, as any line read;
//!   past it the turn ends with [`TurnFailure::OutputLimit`], keeping the last assistant
//!   message already received;
//! * the API key is held as a [`Secret`] and put only into the child's environment;
//! * no wait of a turn outlasts its abort (the pool's time limit) by more than
//!   `interrupt_grace` (and, when the process breaks its pipes then, the crash's own wait
//!   for its exit and stderr, 2.5 s, ending the turn `crashed`): its lines to stdin (the user message, of megabytes with images;
//!   control responses; the interrupt) are written by the process's own writer task, never
//!   awaited, and the permission policy's decision races the abort, so a process that stops
//!   reading stdin or a policy that never answers ends the turn `aborted` (the pool reports
//!   `timeout` when its limit fired).

use std::collections::VecDeque;
use std::ffi::OsString;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt;
use serde_json::{Value, json};
use tokio::io::AsyncWriteExt;
use tokio::process::ChildStdin;
use tokio::sync::Notify;
use tokio::time::Instant;
use tokio_util::codec::{FramedRead, LinesCodec, LinesCodecError};

use super::config::{CliBackendConfig, ConfigError, SystemPromptWhen};
use super::config::{SafetySwitches, claude_effort, claude_permission_mode, names_flag};
use super::event::{BackendEvent, CliTurnOutcome, TurnFailure};
use super::image::{self, ImageError};
use crate::kinds::{ReasoningEffort, TurnEnd};
use crate::permission::{
    PermissionDecision, PermissionPolicy, PermissionRequest, RejectAll, decide_safely,
};
use crate::process::{ChildGroup, ChildSpec, ExitInfo, SpawnError};
use crate::sandbox::Sandbox;
use crate::secret::Secret;
use crate::turn::Usage;

/// The backend id of the bundled configuration.
pub const BACKEND_ID: &str = "claude-cli";

/// How much of the process's stderr a crash reports (its end).
const CRASH_STDERR_CHARS: usize = 2000;
/// How long a crash waits for the leader's exit status after its stdout closed.
const CRASH_EXIT_WAIT: Duration = Duration::from_secs(2);
/// How long a crash waits for the rest of stderr once the leader has exited.
const CRASH_STDERR_WAIT: Duration = Duration::from_millis(500);
/// The feedback of a permission request answered while (or after) its turn was aborted.
const INTERRUPTED_FEEDBACK: &str = "the turn was interrupted before the permission was decided";

/// How to run one conversation's Claude Code process.
#[non_exhaustive]
pub struct ClaudeLiveConfig {
    /// The backend configuration; [`CliBackendConfig::claude_cli`] with `command` set to the
    /// executable unless changed. Validated by [`ClaudeLive::new`].
    pub backend: CliBackendConfig,
    /// The agent's own home: `HOME`, with `CLAUDE_CONFIG_DIR=<home>/.claude` and
    /// `TMPDIR=<home>/tmp` (created when missing).
    pub home: PathBuf,
    /// The conversation's working directory.
    pub cwd: PathBuf,
    /// `ANTHROPIC_BASE_URL`, when the model is not Anthropic's own endpoint.
    pub base_url: Option<String>,
    /// `ANTHROPIC_API_KEY`: only ever in the child's environment.
    pub api_key: Option<Secret>,
    /// The pool's model name (mapped through `modelAliases`).
    pub model: Option<String>,
    /// Appended to Claude's system prompt (`systemPromptArg`, as `systemPromptWhen` says).
    pub system_prompt: Option<String>,
    /// The stored CLI session id to resume when the process starts.
    pub session_id: Option<String>,
    /// Answers `can_use_tool` requests. Default: reject all (fail closed). A policy that
    /// approves everything ([`PermissionPolicy::approves_all`]) also starts Claude with
    /// `--permission-mode bypassPermissions` ([`claude_permission_mode`]).
    pub permission: Arc<dyn PermissionPolicy>,
    /// `--effort` ([`claude_effort`]); `None`: no flag (Claude's own default).
    pub reasoning_effort: Option<ReasoningEffort>,
    /// After an interrupt, how long the process has to end the turn before it is killed.
    pub interrupt_grace: Duration,
    /// On [`ClaudeLive::close`], how long the process has to exit after its stdin closed,
    /// and then after SIGTERM, before SIGKILL.
    pub close_grace: Duration,
    /// `PATH` of the child (default: the caller's own `PATH`).
    pub path_var: Option<OsString>,
    /// Start Claude through this sandbox's wrapper ([`Sandbox::cli_command`]; the pool passes
    /// its workers' sandbox made for the agent, [`Sandbox::for_cli_agent`]): the agent's
    /// directory read and write, TCP to the model endpoint (and the MCP bridge) only. A
    /// sandboxed Claude gets `IS_SANDBOX=1`, so an approve-all policy runs it in
    /// `bypassPermissions` even as root. `None`: Claude runs with the caller's rights.
    pub sandbox: Option<Sandbox>,
    /// The daemon's ledger of process groups: each CLI process started is recorded until
    /// it is reaped, so a daemon restarted after a crash kills what survived of it (its
    /// tools; the CLI itself dies with the daemon). `None`: not recorded.
    pub group_ledger: Option<std::sync::Arc<crate::group_ledger::GroupLedger>>,
    /// The conversation's gateway tools, served to Claude by a loopback MCP bridge
    /// (`mcp__<server>__<tool>`). `None`, or no tools: no bridge, nothing changes.
    #[cfg(feature = "mcp-bridge")]
    pub gateway_tools: Option<super::mcp_bridge::McpGatewayTools>,
}

impl ClaudeLiveConfig {
    /// The bundled `claude-cli` backend running `executable`, homed in `home`, working in
    /// `cwd`, rejecting every tool permission request.
    pub fn new(
        executable: impl Into<PathBuf>,
        home: impl Into<PathBuf>,
        cwd: impl Into<PathBuf>,
    ) -> Self {
        let mut backend = CliBackendConfig::claude_cli();
        backend.command = executable.into().display().to_string();
        Self {
            backend,
            home: home.into(),
            cwd: cwd.into(),
            base_url: None,
            api_key: None,
            model: None,
            system_prompt: None,
            session_id: None,
            permission: Arc::new(RejectAll::default()),
            reasoning_effort: None,
            interrupt_grace: Duration::from_secs(5),
            close_grace: Duration::from_secs(2),
            path_var: std::env::var_os("PATH"),
            sandbox: None,
            group_ledger: None,
            #[cfg(feature = "mcp-bridge")]
            gateway_tools: None,
        }
    }
}

impl std::fmt::Debug for ClaudeLiveConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClaudeLiveConfig")
            .field("backend", &self.backend)
            .field("home", &self.home)
            .field("cwd", &self.cwd)
            .field("base_url", &crate::secret::RedactedUrl(&self.base_url))
            .field("api_key", &self.api_key)
            .field("model", &self.model)
            .field("session_id", &self.session_id)
            .finish_non_exhaustive()
    }
}

/// Why a turn could not start.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ClaudeLiveError {
    /// The backend configuration cannot run.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// The backend's `command` is not there ([`CliBackendConfig::check_installed`]): no
    /// process was started.
    #[error(transparent)]
    NotInstalled(ConfigError),
    /// The agent's home (or a folder in it) could not be created.
    #[error(
        "could not create {} for the Claude process: {error}; the agent's home must be on a \
         writable filesystem",
        path.display()
    )]
    Home {
        /// The folder.
        path: PathBuf,
        /// The error.
        #[source]
        error: std::io::Error,
    },
    /// The process could not be started.
    #[error(
        "{0}; is `command` the Claude Code executable (install it with \
         `copilot_pool::runtime::install_agent_cli`)?"
    )]
    Spawn(#[from] SpawnError),
    /// The MCP bridge for the conversation's gateway tools could not start.
    #[cfg(feature = "mcp-bridge")]
    #[error(transparent)]
    McpBridge(#[from] super::mcp_bridge::McpBridgeError),
    /// An image of the turn cannot be read into the message.
    #[error(transparent)]
    Image(#[from] ImageError),
    /// The system prompt (the gateway's `systemMessage`) is too long to pass as the one
    /// argument `systemPromptArg` gives it; nothing was started.
    #[error(
        "the systemMessage has {bytes} bytes, over the {max} Claude Code takes as one \
         argument (`systemPromptArg`); shorten the systemMessage (put long instructions in a \
         file in the working directory and point to it)"
    )]
    SystemMessageTooLong {
        /// The system prompt's length in bytes.
        bytes: usize,
        /// The limit.
        max: usize,
    },
}

/// The running process and its pipes.
struct LiveProcess {
    child: ChildGroup,
    /// Writes its stdin.
    writer: StdinWriter,
    lines: FramedRead<tokio::process::ChildStdout, LinesCodec>,
    /// Started with `--resume`.
    resumed: bool,
    /// The `--effort` and `--permission-mode` it was started with.
    flags: LaunchFlags,
}

/// The writer of a process's stdin: a task writing the queued lines in order, so nobody
/// waits on a process that stops reading (a user line of megabytes with its images, a
/// control response, an interrupt). A turn's waits are its abort and `interrupt_grace`,
/// never a write. Dropping it stops the task, which closes stdin.
struct StdinWriter {
    shared: Arc<WriterShared>,
    /// Changes (or closes) when a write failed: the process no longer reads its stdin.
    failed: tokio::sync::watch::Receiver<bool>,
    task: tokio::task::JoinHandle<()>,
}

/// What a [`StdinWriter`] shares with its task.
#[derive(Default)]
struct WriterShared {
    /// The lines not begun yet, each with its newline.
    lines: std::sync::Mutex<VecDeque<Vec<u8>>>,
    /// Wakes the task for a queued line.
    queued: Notify,
}

impl WriterShared {
    fn lines(&self) -> std::sync::MutexGuard<'_, VecDeque<Vec<u8>>> {
        self.lines
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

impl StdinWriter {
    fn start(stdin: ChildStdin) -> Self {
        let shared = Arc::new(WriterShared::default());
        let (failed_tx, failed) = tokio::sync::watch::channel(false);
        let task = tokio::spawn(write_lines(stdin, shared.clone(), failed_tx));
        Self {
            shared,
            failed,
            task,
        }
    }

    /// Queues `value` as one line.
    fn queue(&self, value: &Value) {
        let mut line = value.to_string().into_bytes();
        line.push(b'\n');
        self.shared.lines().push_back(line);
        self.shared.queued.notify_one();
    }

    /// Drops the lines not begun (at a turn's end: an interrupt written later would
    /// interrupt the next turn); a line being written is finished.
    fn drop_unbegun_lines(&self) {
        self.shared.lines().clear();
    }
}

impl Drop for StdinWriter {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// A [`StdinWriter`]'s task: writes each queued line whole, in order, until a write fails
/// (then says so on `failed`) or the writer is dropped.
async fn write_lines(
    mut stdin: ChildStdin,
    shared: Arc<WriterShared>,
    failed: tokio::sync::watch::Sender<bool>,
) {
    loop {
        let next = shared.lines().pop_front();
        let Some(line) = next else {
            // `notify_one` keeps a permit: a line queued since the look is not missed.
            shared.queued.notified().await;
            continue;
        };
        if let Err(error) = stdin.write_all(&line).await {
            tracing::debug!(%error, "could not write to claude's stdin");
            failed.send_replace(true);
            return;
        }
    }
}

/// The per-lease flags a Claude process is started with; a lease that wants others gets a
/// new process (resuming the session).
#[derive(Debug, Clone, PartialEq, Eq)]
struct LaunchFlags {
    effort: Option<&'static str>,
    permission_mode: &'static str,
    model: Option<String>,
    system_prompt: Option<String>,
}

/// One conversation's Claude Code process, started on the first turn and restarted (with
/// `--resume`) on the turn after it died. Dropping it kills the process group.
pub struct ClaudeLive {
    config: ClaudeLiveConfig,
    session_id: Option<String>,
    process: Option<LiveProcess>,
    /// The gateway tools' bridge of the running process (declared after `process`, so the
    /// process is killed before its bridge stops).
    #[cfg(feature = "mcp-bridge")]
    bridge: Option<super::mcp_bridge::McpBridge>,
}

impl std::fmt::Debug for ClaudeLive {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClaudeLive")
            .field("session_id", &self.session_id)
            .field("pid", &self.pid())
            .finish_non_exhaustive()
    }
}

impl ClaudeLive {
    /// Checks the configuration; starts nothing yet.
    pub fn new(config: ClaudeLiveConfig) -> Result<Self, ClaudeLiveError> {
        config.backend.validate(BACKEND_ID)?;
        let session_id = config.session_id.clone();
        Ok(Self {
            config,
            session_id,
            process: None,
            #[cfg(feature = "mcp-bridge")]
            bridge: None,
        })
    }

    /// The CLI session id to store (learned from the process, or the configured one).
    pub fn session_id(&self) -> Option<&str> {
        self.session_id.as_deref()
    }

    /// The directory its process runs in (Claude Code files its transcript by it).
    pub fn working_directory(&self) -> &std::path::Path {
        &self.config.cwd
    }

    /// The gateway tools' MCP bridge, while one serves the running process.
    #[cfg(feature = "mcp-bridge")]
    pub fn mcp_bridge(&self) -> Option<&super::mcp_bridge::McpBridge> {
        self.bridge.as_ref()
    }

    /// The process's pid (= its process group id) while one is running.
    pub fn pid(&self) -> Option<u32> {
        self.process
            .as_ref()
            .filter(|p| p.child.exit_info().is_none())
            .map(|p| p.child.pid())
    }

    /// Sends `prompt` as the next user message, starting (or restarting with `--resume`)
    /// the process first when none is running. Read the turn's events with
    /// [`ClaudeTurn::next`] until [`BackendEvent::TurnEnd`].
    pub async fn start_turn(&mut self, prompt: &str) -> Result<ClaudeTurn<'_>, ClaudeLiveError> {
        self.start_turn_with_images(prompt, &[]).await
    }

    /// [`ClaudeLive::start_turn`] with image files: each is read (before any process starts)
    /// into an Anthropic `image` content block (base64, its media type told by its content,
    /// at most [`image::MAX_IMAGE_BYTES`]) of the user message, after the prompt's text
    /// block. Each path is opened from `/` without following a link ([`image::content_block`]):
    /// give resolved paths.
    pub async fn start_turn_with_images(
        &mut self,
        prompt: &str,
        images: &[PathBuf],
    ) -> Result<ClaudeTurn<'_>, ClaudeLiveError> {
        let mut blocks = Vec::with_capacity(images.len());
        for path in images {
            blocks.push(image::content_block(path).await?);
        }
        let running = self
            .process
            .as_ref()
            .is_some_and(|p| p.child.exit_info().is_none());
        // A bridge stopped by its idle TTL leaves the process's MCP config pointing at a
        // dead port: restart both (the session resumes).
        // The turn holds its bridge from here (taken before the look, so the bridge found
        // running cannot idle out after it): the CLI may call a tool at any time.
        #[cfg(feature = "mcp-bridge")]
        let mut bridge_hold = self.bridge.as_ref().map(super::mcp_bridge::McpBridge::hold);
        // An approval an earlier turn's call never used is good for no call of this one.
        #[cfg(feature = "mcp-bridge")]
        if let Some(bridge) = &self.bridge {
            bridge.forget_approvals();
        }
        if !running || self.bridge_expired() {
            // A live process (its bridge expired) is closed as any restart closes it, so it
            // writes what it holds of the session first; a dead one is only reaped.
            if let Some(process) = self.process.take()
                && running
            {
                close_process(process, self.config.close_grace).await;
            }
            self.spawn().await?;
            #[cfg(feature = "mcp-bridge")]
            {
                bridge_hold = self.bridge.as_ref().map(super::mcp_bridge::McpBridge::hold);
            }
        }
        let prompt = self.config.backend.transform(prompt, false);
        let content = if blocks.is_empty() {
            Value::String(prompt)
        } else {
            let mut content = vec![json!({"type": "text", "text": prompt})];
            content.extend(blocks);
            Value::Array(content)
        };
        let line = json!({
            "type": "user",
            "message": {"role": "user", "content": content},
            "parent_tool_use_id": null,
            "session_id": self.session_id.as_deref().unwrap_or(""),
        });
        let limits = self.config.backend.output_limits;
        let mut turn = ClaudeTurn {
            resumed: self.process.as_ref().is_some_and(|p| p.resumed),
            live: self,
            queue: VecDeque::new(),
            ended: false,
            abort: Arc::new(Notify::new()),
            interrupt_deadline: None,
            interrupted: false,
            last_text: String::new(),
            tool_calls: 0,
            permission_prompts: 0,
            retained_bytes: 0,
            retained_lines: 0,
            max_bytes: limits.max_turn_raw_chars,
            max_lines: limits.max_turn_lines,
            #[cfg(feature = "mcp-bridge")]
            _bridge_hold: bridge_hold,
        };
        // Written by the process's writer task: a line of megabytes (images) into a process
        // that stopped reading must not hold the caller before the turn, and its time
        // limit, exist.
        turn.send(&line);
        Ok(turn)
    }

    /// Sends `prompt` and reads the turn to its end, handing each event to `on_event`.
    pub async fn run(
        &mut self,
        prompt: &str,
        mut on_event: impl FnMut(&BackendEvent),
    ) -> Result<CliTurnOutcome, ClaudeLiveError> {
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

    /// Ends the process: closes its stdin (Claude exits after the current turn), waits up to
    /// `close_grace`, then SIGTERM, `close_grace`, SIGKILL to the group. Returns how it
    /// ended, if one was running.
    pub async fn close(mut self) -> Option<ExitInfo> {
        let process = self.process.take()?;
        Some(close_process(process, self.config.close_grace).await)
    }

    /// Makes `tools` the conversation's gateway tools from now on (a pool lease installs its
    /// own handlers this way; the other settings of `gateway_tools` stay). When the running
    /// process's bridge lists the same tools (names, descriptions, schemas), their handlers
    /// are swapped in and the process is kept ([`super::GatewayToolsChange::Installed`]); when the
    /// tools differ from what the process was started with, it is closed (gracefully, as
    /// [`ClaudeLive::close`]) so the next turn starts one with a bridge listing these
    /// tools, resuming the session ([`super::GatewayToolsChange::Restart`]): never a stale list.
    #[cfg(feature = "mcp-bridge")]
    pub async fn set_gateway_tools(
        &mut self,
        tools: Vec<crate::turn::GatewayTool>,
    ) -> super::GatewayToolsChange {
        use super::GatewayToolsChange as Change;
        let running = self.pid().is_some();
        // A process started without a bridge lists no gateway tools: an empty set matches it.
        let listless = self.bridge.is_none() && tools.is_empty();
        let installed = super::mcp_bridge::offer_tools(
            self.bridge.as_ref(),
            &mut self.config.gateway_tools,
            tools,
        );
        let change = match installed {
            _ if !running => Change::NotRunning,
            Some(true) => Change::Installed,
            None if listless => Change::Installed,
            _ => Change::Restart,
        };
        if change == Change::Restart {
            tracing::debug!("the gateway tools changed; restarting claude with a new bridge");
            if let Some(process) = self.process.take() {
                close_process(process, self.config.close_grace).await;
            }
            self.bridge = None;
        }
        change
    }

    /// Takes the gateway tools' handlers out (a pool lease ended): a call that arrives
    /// before the next [`ClaudeLive::set_gateway_tools`] is an `isError` result at once.
    /// The bridge and its list stay, for the next lease to install its handlers into.
    #[cfg(feature = "mcp-bridge")]
    pub fn clear_gateway_handlers(&mut self) {
        super::mcp_bridge::take_out_handlers(self.bridge.as_ref(), &mut self.config.gateway_tools);
    }

    /// The process's MCP bridge stopped (idle TTL) while the process runs.
    fn bridge_expired(&self) -> bool {
        #[cfg(feature = "mcp-bridge")]
        if self.bridge.as_ref().is_some_and(|b| !b.is_running()) {
            tracing::debug!("the MCP bridge expired; restarting claude with a new one");
            return true;
        }
        false
    }

    async fn spawn(&mut self) -> Result<(), ClaudeLiveError> {
        let config = &self.config;
        let backend = &config.backend;
        let pass = match backend.system_prompt_when {
            SystemPromptWhen::Always => true,
            SystemPromptWhen::First => self.session_id.is_none(),
            SystemPromptWhen::Never => false,
        };
        // The flag and the text, when this start passes them.
        let system_prompt = (backend.system_prompt_arg.as_ref())
            .zip(config.system_prompt.as_ref())
            .filter(|_| pass);
        // Checked before anything is made or started, as a one-shot backend checks it: past
        // the limit the spawn would fail with E2BIG, read as a CLI that cannot start.
        if let Some((_, prompt)) = system_prompt
            && prompt.len() > super::MAX_ARG_BYTES
        {
            return Err(ClaudeLiveError::SystemMessageTooLong {
                bytes: prompt.len(),
                max: super::MAX_ARG_BYTES,
            });
        }
        let claude_dir = config.home.join(".claude");
        let tmp_dir = config.home.join("tmp");
        // Private (0700, whatever the umask): Claude keeps its transcripts and credentials
        // there.
        // A link planted in the home is refused, never followed.
        crate::home::ensure_private_dirs_below(config.home.clone(), vec![".claude", "tmp"])
            .await
            .map_err(|(path, error)| ClaudeLiveError::Home { path, error })?;
        crate::home::ensure_private_dirs(vec![config.cwd.clone()])
            .await
            .map_err(|(path, error)| ClaudeLiveError::Home { path, error })?;
        let mut args = backend.argv(self.session_id.as_deref(), config.model.as_deref());
        if let Some((flag, prompt)) = system_prompt {
            args.extend([flag.clone(), prompt.clone()]);
        }
        let flags = self.launch_flags();
        if !names_flag(&backend.args, "--permission-mode") {
            args.extend([
                "--permission-mode".to_owned(),
                flags.permission_mode.to_owned(),
            ]);
        }
        if let Some(effort) = flags.effort
            && !names_flag(&backend.args, "--effort")
        {
            args.extend(["--effort".to_owned(), effort.to_owned()]);
        }
        let mut env: Vec<(OsString, OsString)> = vec![
            ("HOME".into(), config.home.clone().into_os_string()),
            ("CLAUDE_CONFIG_DIR".into(), claude_dir.into_os_string()),
            ("TMPDIR".into(), tmp_dir.into_os_string()),
        ];
        if let Some(path) = &config.path_var {
            env.push(("PATH".into(), path.clone()));
        }
        env.extend(
            backend
                .env
                .iter()
                .map(|(k, v)| (OsString::from(k), OsString::from(v))),
        );
        env.extend(
            SafetySwitches::CLAUDE
                .env_for(&backend.env)
                .into_iter()
                .map(|(k, v)| (OsString::from(k), OsString::from(v))),
        );
        if let Some(url) = &config.base_url {
            env.push(("ANTHROPIC_BASE_URL".into(), url.into()));
        }
        if let Some(key) = config.api_key.as_ref().filter(|k| !k.is_empty()) {
            env.push(("ANTHROPIC_API_KEY".into(), key.expose().into()));
        }
        if config.sandbox.is_some() {
            env.retain(|(k, _)| k != "IS_SANDBOX");
            env.push(("IS_SANDBOX".into(), "1".into()));
        }
        #[allow(unused_mut)]
        let mut ports: Vec<u16> = Vec::new();
        #[cfg(feature = "mcp-bridge")]
        {
            self.bridge = None;
            if let Some(gateway) = config
                .gateway_tools
                .as_ref()
                .filter(|g| !g.tools.is_empty())
            {
                let mut bridge_config = gateway.bridge.clone();
                if bridge_config.working_directory.is_none() {
                    bridge_config.working_directory = Some(config.cwd.display().to_string());
                }
                // Asked about: the bridge runs only the calls the policy approved (a shell
                // tool of Claude's could call it with the token from its environment). A
                // policy that approves everything starts Claude with bypassPermissions,
                // which asks nothing: no approval would ever come.
                let asks = flags.permission_mode != "bypassPermissions";
                bridge_config.calls_need_approval |= gateway.ask_permission && asks;
                let bridge =
                    super::mcp_bridge::McpBridge::start(gateway.tools.clone(), bridge_config)
                        .await?;
                if let Some(id) = &self.session_id {
                    bridge.set_session_id(id);
                }
                ports.push(bridge.addr().port());
                let mcp = bridge.claude_args(!gateway.ask_permission);
                args.extend(mcp.args);
                env.extend(
                    mcp.env
                        .iter()
                        .map(|(k, v)| (OsString::from(k), OsString::from(v.expose()))),
                );
                self.bridge = Some(bridge);
            }
        }
        let switches = SafetySwitches::CLAUDE.flag_args_for(backend);
        args.extend(switches);
        let args: Vec<OsString> = args.into_iter().map(OsString::from).collect();
        backend
            .check_installed(BACKEND_ID, config.path_var.as_deref())
            .map_err(ClaudeLiveError::NotInstalled)?;
        let program = PathBuf::from(&backend.command);
        let (program, args) = match &config.sandbox {
            Some(sandbox) => {
                // Only a script the configuration names is granted, never a filled-in model.
                let resume = backend.resume_args.as_deref().unwrap_or_default();
                sandbox.cli_command(
                    &program,
                    &args,
                    &[&backend.args, resume],
                    backend
                        .child_path_var(config.path_var.as_deref())
                        .as_deref(),
                    &ports,
                )
            }
            None => (program, args),
        };
        let spec = ChildSpec {
            program,
            args,
            env,
            cwd: config.cwd.clone(),
        };
        // Never log `spec`: its environment holds the key.
        let (child, io) = ChildGroup::spawn(&spec)?;
        if let Some(ledger) = &config.group_ledger {
            ledger.track(&child);
        }
        let resumed = self.session_id.is_some();
        tracing::debug!(pid = child.pid(), resumed, "claude process started");
        let max_line = usize::try_from(backend.output_limits.max_turn_raw_chars)
            .unwrap_or(usize::MAX)
            .saturating_add(1);
        self.process = Some(LiveProcess {
            child,
            writer: StdinWriter::start(io.stdin),
            lines: FramedRead::new(io.stdout, LinesCodec::new_with_max_length(max_line)),
            resumed,
            flags,
        });
        Ok(())
    }

    /// The `--effort` and `--permission-mode` the current settings start Claude with.
    fn launch_flags(&self) -> LaunchFlags {
        let config = &self.config;
        let root = nix::unistd::geteuid().is_root();
        let sandboxed = config.sandbox.is_some()
            || config
                .backend
                .env
                .get("IS_SANDBOX")
                .is_some_and(|v| v == "1");
        let approves_all = config.permission.approves_all();
        if approves_all && root && !sandboxed {
            tracing::debug!(
                "the permission policy approves everything, but Claude refuses \
                 bypassPermissions as root without IS_SANDBOX=1 in the backend's env: \
                 --permission-mode default, each prompt approved by the policy"
            );
        }
        LaunchFlags {
            effort: config.reasoning_effort.map(claude_effort),
            permission_mode: claude_permission_mode(approves_all, root, sandboxed),
            model: config.model.clone(),
            // Compared only where a restart passes it again: with the backend's default
            // (`First`) a resumed session keeps the one it began with, and a restart for
            // another would change nothing.
            system_prompt: (config.backend.system_prompt_when == SystemPromptWhen::Always)
                .then(|| config.system_prompt.clone())
                .flatten(),
        }
    }

    /// The model and system prompt of the turns to come (a lease's, on a conversation kept
    /// between leases): the next [`ClaudeLive::set_lease_settings`] closes a process started
    /// with another model, or with another system prompt where the backend passes it at
    /// every start (`systemPromptWhen = "always"`; with `first`, the default, a session keeps
    /// the one it began with), as for its own settings.
    pub fn set_model(&mut self, model: Option<String>, system_prompt: Option<String>) {
        self.config.model = model;
        self.config.system_prompt = system_prompt;
    }

    /// A lease's settings for the turns to come: its permission policy and its reasoning
    /// effort. A running process started with another `--effort` or `--permission-mode` (or
    /// another model or system prompt, [`ClaudeLive::set_model`]) is closed (gracefully, as
    /// [`ClaudeLive::close`]): the next turn starts one with these flags, resuming the
    /// session (a live process cannot change them). Returns whether it was closed.
    pub async fn set_lease_settings(
        &mut self,
        permission: Arc<dyn PermissionPolicy>,
        reasoning_effort: Option<ReasoningEffort>,
    ) -> bool {
        self.config.permission = permission;
        self.config.reasoning_effort = reasoning_effort;
        let wanted = self.launch_flags();
        let differs = self
            .process
            .as_ref()
            .is_some_and(|p| p.child.exit_info().is_none() && p.flags != wanted);
        if differs {
            tracing::debug!(
                ?wanted,
                "the lease's model, system prompt, effort or permission mode changed; \
                 restarting claude"
            );
            if let Some(process) = self.process.take() {
                close_process(process, self.config.close_grace).await;
            }
        }
        differs
    }
}

/// Whether a stream-json line of Claude Code is an envelope of the stream, not output the
/// turn retains (so not counted against `outputLimits`): partial deltas (`stream_event`), the
/// session's `system` lines (`init`, and the `status` Claude Code 2.1 prints before each model
/// request), the closing `result`, rate limit notices and the control protocol
/// (`control_request`, `control_response`, `keep_alive`). Assistant messages and tool results
/// (`user` lines) are retained.
pub(crate) fn is_envelope(value: &Value) -> bool {
    matches!(
        value.get("type").and_then(Value::as_str),
        Some(
            "stream_event"
                | "system"
                | "result"
                | "control_request"
                | "control_response"
                | "keep_alive"
                | "rate_limit_event"
        )
    )
}

/// Closes a process: its stdin first (Claude exits after the current turn), `grace`, then
/// SIGTERM, `grace`, SIGKILL to the group.
async fn close_process(process: LiveProcess, grace: Duration) -> ExitInfo {
    let LiveProcess { child, writer, .. } = process;
    drop(writer);
    match tokio::time::timeout(grace, child.wait()).await {
        Ok(info) => info,
        Err(_) => child.terminate(grace).await,
    }
}

/// The handle that interrupts a turn (one type for every runner).
pub use super::event::AbortHandle;

/// One turn of a [`ClaudeLive`]. Read it with [`ClaudeTurn::next`] to its
/// [`BackendEvent::TurnEnd`]; dropping it earlier kills the process (the next turn resumes).
pub struct ClaudeTurn<'a> {
    live: &'a mut ClaudeLive,
    queue: VecDeque<BackendEvent>,
    ended: bool,
    abort: Arc<Notify>,
    interrupt_deadline: Option<Instant>,
    interrupted: bool,
    resumed: bool,
    last_text: String,
    tool_calls: u32,
    permission_prompts: u32,
    retained_bytes: u64,
    retained_lines: u64,
    max_bytes: u64,
    max_lines: u64,
    /// Keeps the process's bridge from idling out during the turn.
    #[cfg(feature = "mcp-bridge")]
    _bridge_hold: Option<super::mcp_bridge::BridgeHold>,
}

impl Drop for ClaudeTurn<'_> {
    fn drop(&mut self) {
        if !self.ended {
            // Its output would leak into the next turn: kill the group (ChildGroup's drop).
            self.live.process = None;
        }
    }
}

impl ClaudeTurn<'_> {
    /// A handle that interrupts this turn.
    pub fn abort_handle(&self) -> AbortHandle {
        AbortHandle::new(self.abort.clone())
    }

    /// The pid (= process group id) of the process serving this turn, while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.live.pid()
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
            let Some(process) = self.live.process.as_mut() else {
                self.crash().await;
                continue;
            };
            let deadline = self.interrupt_deadline;
            // Stdin is written by its own task: nothing here waits on a process that stops
            // reading it, beyond the abort and the interrupt's grace. What it printed before
            // a write failed is read first.
            let wake = tokio::select! {
                biased;
                () = self.abort.notified(), if !self.interrupted => Wake::Abort,
                () = sleep_until_opt(deadline), if deadline.is_some() => Wake::Grace,
                line = process.lines.next() => Wake::Line(line),
                _ = process.writer.failed.changed() => Wake::WriteFailed,
            };
            match wake {
                Wake::Abort => self.interrupt(),
                Wake::Grace => {
                    tracing::debug!("claude did not end an interrupted turn in time; killing it");
                    self.live.process = None;
                    self.end_with(TurnEnd::Aborted, None, Usage::default());
                }
                Wake::WriteFailed => self.crash().await,
                Wake::Line(None | Some(Err(LinesCodecError::Io(_)))) => self.crash().await,
                Wake::Line(Some(Err(LinesCodecError::MaxLineLengthExceeded))) => {
                    self.over_limit(true)
                }
                Wake::Line(Some(Ok(line))) => self.handle_line(&line).await,
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

    async fn handle_line(&mut self, line: &str) {
        let Ok(value) = serde_json::from_str::<Value>(line) else {
            tracing::debug!(bytes = line.len(), "claude printed a line that is not JSON");
            self.retain(line);
            return;
        };
        let kind = value.get("type").and_then(Value::as_str).unwrap_or("");
        if !is_envelope(&value) && !self.retain(line) {
            return;
        }
        self.note_session_id(&value);
        match kind {
            "stream_event" => {
                let event = &value["event"];
                if event["type"] == "content_block_delta"
                    && event["delta"]["type"] == "text_delta"
                    && let Some(text) = event["delta"]["text"].as_str()
                {
                    self.queue.push_back(BackendEvent::MessageDelta {
                        delta: text.to_owned(),
                    });
                }
            }
            "assistant" => self.assistant(&value),
            "control_request" => self.control_request(&value).await,
            "result" => self.result(&value),
            _ => {}
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

    fn note_session_id(&mut self, value: &Value) {
        for field in &self.live.config.backend.session_id_fields {
            if let Some(id) = value.get(field).and_then(Value::as_str)
                && !id.is_empty()
            {
                if self.live.session_id.as_deref() != Some(id) {
                    self.live.session_id = Some(id.to_owned());
                    #[cfg(feature = "mcp-bridge")]
                    if let Some(bridge) = &self.live.bridge {
                        bridge.set_session_id(id);
                    }
                }
                return;
            }
        }
    }

    fn assistant(&mut self, value: &Value) {
        let Some(blocks) = value["message"]["content"].as_array() else {
            return;
        };
        let mut text = String::new();
        for block in blocks {
            match block["type"].as_str() {
                Some("text") => text.push_str(block["text"].as_str().unwrap_or("")),
                Some("tool_use") => {
                    self.tool_calls += 1;
                    self.queue.push_back(BackendEvent::ToolCall {
                        id: block["id"].as_str().unwrap_or("").to_owned(),
                        name: block["name"].as_str().unwrap_or("").to_owned(),
                        input: block["input"].clone(),
                    });
                }
                _ => {}
            }
        }
        if !text.is_empty() {
            self.last_text = text.clone();
            self.queue.push_back(BackendEvent::Message { text });
        }
    }

    async fn control_request(&mut self, value: &Value) {
        let request_id = value["request_id"].clone();
        let request = &value["request"];
        let subtype = request["subtype"].as_str().unwrap_or("");
        if subtype != "can_use_tool" {
            let reply = json!({
                "type": "control_response",
                "response": {
                    "subtype": "error",
                    "request_id": request_id,
                    "error": format!("copilot-pool does not handle `{subtype}` requests"),
                },
            });
            self.send(&reply);
            return;
        }
        let tool_name = request["tool_name"].as_str().unwrap_or("").to_owned();
        let input = request["input"].clone();
        let asked = permission_request(&tool_name, request, &self.live.config.cwd);
        let (decision, aborted) = self.decide(asked).await;
        self.permission_prompts += 1;
        let approved = decision.approves();
        #[cfg(feature = "mcp-bridge")]
        if approved && let Some(bridge) = &self.live.bridge {
            let prefix = format!("mcp__{}__", bridge.server_name());
            if let Some(tool) = tool_name.strip_prefix(&prefix) {
                // Claude calls it with the input it is allowed with.
                bridge.approve(tool, &input);
            }
        }
        let answer = match &decision {
            // Claude is not told to remember: approve-for-session approves this use.
            PermissionDecision::Approve | PermissionDecision::ApproveForSession => {
                json!({"behavior": "allow", "updatedInput": input})
            }
            PermissionDecision::Reject { feedback } => {
                json!({"behavior": "deny", "message": feedback})
            }
        };
        tracing::debug!(tool = %tool_name, approved, "answered claude's permission request");
        self.queue.push_back(BackendEvent::PermissionRequest {
            tool_name,
            input,
            approved,
        });
        let reply = json!({
            "type": "control_response",
            "response": {"subtype": "success", "request_id": request_id, "response": answer},
        });
        self.send(&reply);
        if aborted {
            self.interrupt();
        }
    }

    /// The permission policy's decision on `asked`, raced against the turn's abort (a
    /// policy may wait for a human who never answers): aborted first, the request is
    /// rejected and `true` says the turn must now be interrupted. An interrupted turn asks
    /// the policy nothing more.
    async fn decide(&mut self, asked: PermissionRequest) -> (PermissionDecision, bool) {
        if self.interrupted {
            return (PermissionDecision::reject(INTERRUPTED_FEEDBACK), false);
        }
        let policy = self.live.config.permission.clone();
        tokio::select! {
            biased;
            () = self.abort.notified() => {
                tracing::debug!("the turn was aborted while its permission policy decided");
                (PermissionDecision::reject(INTERRUPTED_FEEDBACK), true)
            }
            decision = decide_safely(policy.as_ref(), asked) => (decision, false),
        }
    }

    fn result(&mut self, value: &Value) {
        let number = |key: &str| value["usage"][key].as_u64().unwrap_or(0);
        let usage = Usage {
            input_tokens: number("input_tokens"),
            output_tokens: number("output_tokens"),
            cache_read_tokens: number("cache_read_input_tokens"),
            cache_write_tokens: number("cache_creation_input_tokens"),
        };
        let result_text = value["result"].as_str().map(str::to_owned);
        // `subtype` says `success` even for errors: `is_error` is what counts.
        let is_error = value["is_error"].as_bool() == Some(true);
        if self.interrupted {
            self.end_with(TurnEnd::Aborted, None, usage);
        } else if is_error {
            let failure = TurnFailure::Cli {
                message: result_text.unwrap_or_else(|| "no message".to_owned()),
                reason: value["terminal_reason"].as_str().map(str::to_owned),
                status: super::event::reported_status(value),
            };
            self.end_with(TurnEnd::Error, Some(failure), usage);
        } else {
            if let Some(text) = result_text {
                self.last_text = text;
            }
            self.end_with(TurnEnd::Idle, None, usage);
        }
    }

    /// Asks the process to interrupt the turn; past `interrupt_grace` it is killed (`next`),
    /// whether it answered or never read the request.
    fn interrupt(&mut self) {
        self.interrupted = true;
        self.interrupt_deadline = Some(Instant::now() + self.live.config.interrupt_grace);
        let request = json!({
            "type": "control_request",
            "request_id": format!("interrupt-{}", uuid::Uuid::new_v4().simple()),
            "request": {"subtype": "interrupt"},
        });
        self.send(&request);
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
        tracing::warn!(%failure, "claude turn stopped");
        // The rest of the turn's output cannot be read safely: kill the group.
        self.live.process = None;
        self.end_with(TurnEnd::Error, Some(failure), Usage::default());
    }

    /// The process died or its output closed: end the turn `crashed` now.
    async fn crash(&mut self) {
        if self.ended {
            return;
        }
        let (exit, stderr) = match self.live.process.take() {
            Some(process) => {
                let child = process.child;
                let exit = tokio::time::timeout(CRASH_EXIT_WAIT, child.wait())
                    .await
                    .map(|info| info.to_string())
                    .unwrap_or_else(|_| "still running; killed".to_owned());
                child.stderr().settled(CRASH_STDERR_WAIT).await;
                (exit, tail_chars(&child.stderr().text(), CRASH_STDERR_CHARS))
                // `child` dropped here: the group is killed if anything is left.
            }
            None => ("not running".to_owned(), String::new()),
        };
        tracing::debug!(%exit, "claude process ended mid-turn");
        let failure = TurnFailure::Crashed {
            exit,
            stderr_tail: stderr,
        };
        self.end_with(TurnEnd::Crashed, Some(failure), Usage::default());
    }

    fn end_with(&mut self, end: TurnEnd, failure: Option<TurnFailure>, usage: Usage) {
        if self.ended {
            return;
        }
        self.ended = true;
        if let Some(process) = &self.live.process {
            process.writer.drop_unbegun_lines();
        }
        let text = self.live.config.backend.transform(&self.last_text, true);
        self.queue.push_back(BackendEvent::TurnEnd(CliTurnOutcome {
            text,
            end: Some(end),
            failure,
            usage,
            session_id: self.live.session_id.clone(),
            resumed: self.resumed,
            tool_calls: self.tool_calls,
            permission_prompts: self.permission_prompts,
            retained_lines: self.retained_lines,
            retained_bytes: self.retained_bytes,
            // Claude Code's stream-json reports each tool call as it starts.
            tool_calls_unseen: false,
        }));
    }

    /// Queues `value` as a line for the process's stdin (its writer task writes it); a turn
    /// without a process ends `crashed` in [`ClaudeTurn::next`].
    fn send(&mut self, value: &Value) {
        if let Some(process) = &self.live.process {
            process.writer.queue(value);
        }
    }
}

/// What woke a turn's [`ClaudeTurn::next`].
enum Wake {
    /// The turn's abort handle fired.
    Abort,
    /// The interrupt's grace is over.
    Grace,
    /// A write to stdin failed.
    WriteFailed,
    /// A line of stdout (or its end).
    Line(Option<Result<String, LinesCodecError>>),
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

/// Claude's `can_use_tool` request in the pool's [`PermissionRequest`] terms: `Bash` is a
/// `shell` request with its command, file tools are `write` / `read` requests with their
/// path, web tools `url`, MCP tools `mcp`, anything else `custom-tool`; the tool name is
/// always set and the whole request kept in `raw`.
fn permission_request(tool: &str, request: &Value, cwd: &std::path::Path) -> PermissionRequest {
    let input = &request["input"];
    let kind = match tool {
        "Bash" => "shell",
        "Write" | "Edit" | "MultiEdit" | "NotebookEdit" => "write",
        "Read" | "Glob" | "Grep" | "LS" => "read",
        "WebFetch" | "WebSearch" => "url",
        name if name.starts_with("mcp__") => "mcp",
        _ => "custom-tool",
    };
    let mut paths: Vec<Value> = Vec::new();
    for key in ["file_path", "notebook_path", "path"] {
        if let Some(path) = input.get(key).filter(|p| p.is_string()) {
            paths.push(path.clone());
        }
    }
    if let Some(blocked) = request.get("blocked_path").filter(|p| p.is_string()) {
        paths.push(blocked.clone());
    }
    let wire = json!({
        "kind": kind,
        "command": input.get("command"),
        "paths": paths,
        "url": input.get("url"),
        "toolName": tool,
        "claude": request,
    });
    PermissionRequest::from_wire(&wire).with_working_directory(cwd)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    /// Starts a stand-in for Claude that records its argv and environment into its home and
    /// exits; returns what it recorded.
    async fn launch(live: &mut ClaudeLive, home: &std::path::Path) -> (String, String) {
        let _ = live.run("p", |_| {}).await;
        let read = |name: &str| std::fs::read_to_string(home.join(name)).unwrap_or_default();
        (read("args.txt"), read("env.txt"))
    }

    #[tokio::test]
    async fn the_safety_switches_effort_and_permission_mode_survive_an_override_of_args_and_env() {
        let dir = tempfile::tempdir().unwrap();
        let home = dir.path().join("home");
        let mut config = ClaudeLiveConfig::new("/bin/sh", &home, dir.path().join("work"));
        // An override of both `args` and `env`, as a `[backends.claude-cli]` table makes.
        config.backend.args = vec![
            "-c".into(),
            r#"printf '%s\n' "$@" > "$HOME/args.txt"; env > "$HOME/env.txt""#.into(),
            "claude".into(),
        ];
        config.backend.resume_args = None;
        config.backend.session_mode = crate::backend::SessionMode::None;
        config.backend.env = BTreeMap::from([("HTTPS_PROXY".into(), "http://p:3128".into())]);
        config.reasoning_effort = Some(ReasoningEffort::High);
        let mut live = ClaudeLive::new(config).unwrap();
        let (args, env) = launch(&mut live, &home).await;
        assert!(
            env.contains("CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC=1\n"),
            "{env}"
        );
        assert!(env.contains("CLAUDE_CODE_MAX_RETRIES=1\n"), "{env}");
        assert!(env.contains("HTTPS_PROXY=http://p:3128\n"), "{env}");
        assert!(args.contains("--effort\nhigh\n"), "{args}");
        assert!(args.contains("--permission-mode\ndefault\n"), "{args}");

        // A variable or flag the configuration names itself is its own.
        let mut config = ClaudeLiveConfig::new("/bin/sh", &home, dir.path().join("work"));
        config.backend.args = vec![
            "-c".into(),
            r#"printf '%s\n' "$@" > "$HOME/args.txt"; env > "$HOME/env.txt""#.into(),
            "claude".into(),
            "--permission-mode".into(),
            "acceptEdits".into(),
        ];
        config.backend.resume_args = None;
        config.backend.session_mode = crate::backend::SessionMode::None;
        config.backend.env = BTreeMap::from([
            ("CLAUDE_CODE_MAX_RETRIES".into(), "3".into()),
            ("IS_SANDBOX".into(), "1".into()),
        ]);
        config.permission = Arc::new(crate::permission::ApproveAll);
        let mut live = ClaudeLive::new(config).unwrap();
        let (args, env) = launch(&mut live, &home).await;
        assert!(env.contains("CLAUDE_CODE_MAX_RETRIES=3\n"), "{env}");
        assert!(!env.contains("CLAUDE_CODE_MAX_RETRIES=1"), "{env}");
        assert!(
            env.contains("CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC=1\n"),
            "{env}"
        );
        assert!(args.contains("--permission-mode\nacceptEdits\n"), "{args}");
        assert_eq!(args.matches("--permission-mode").count(), 1, "{args}");
        assert!(!args.contains("--effort"), "no effort, no flag: {args}");
    }

    #[tokio::test]
    async fn a_process_started_in_a_fresh_home_finds_its_directories_private() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let home = dir.path().join("agent/claude-cli");
        let work = dir.path().join("agent/work");
        let mut config = ClaudeLiveConfig::new("/bin/sh", &home, &work);
        config.backend.args = vec!["-c".into(), "exit 0".into()];
        config.backend.resume_args = None;
        config.backend.session_mode = crate::backend::SessionMode::None;
        let mut live = ClaudeLive::new(config).unwrap();
        launch(&mut live, &home).await;
        for made in [
            dir.path().join("agent"),
            home.clone(),
            home.join(".claude"),
            home.join("tmp"),
            work,
        ] {
            let mode = std::fs::metadata(&made).unwrap().permissions().mode() & 0o777;
            assert_eq!(mode, 0o700, "{made:?}");
        }
    }

    #[test]
    fn an_approve_all_policy_bypasses_permissions_unless_root_without_a_sandbox() {
        assert_eq!(
            claude_permission_mode(true, false, false),
            "bypassPermissions"
        );
        assert_eq!(
            claude_permission_mode(true, true, true),
            "bypassPermissions"
        );
        assert_eq!(claude_permission_mode(true, true, false), "default");
        assert_eq!(claude_permission_mode(false, false, true), "default");
        assert!(crate::permission::ApproveAll.approves_all());
        assert!(!crate::permission::RejectAll::default().approves_all());
        let efforts: Vec<_> = ReasoningEffort::ALL
            .into_iter()
            .map(claude_effort)
            .collect();
        assert_eq!(efforts, ["low", "medium", "high", "xhigh"]);
    }

    #[test]
    fn claudes_tool_requests_read_as_the_pools_permission_requests() {
        let cwd = std::path::Path::new("/w");
        let bash = json!({"tool_name": "Bash", "input": {"command": "echo hi > f.txt"},
                          "blocked_path": "/w/f.txt"});
        let asked = permission_request("Bash", &bash, cwd);
        assert_eq!(asked.kind, "shell");
        assert_eq!(asked.command.as_deref(), Some("echo hi > f.txt"));
        assert_eq!(asked.paths, ["/w/f.txt"]);
        assert_eq!(asked.tool_name.as_deref(), Some("Bash"));
        let write = json!({"tool_name": "Write", "input": {"file_path": "a.txt", "content": "x"}});
        let asked = permission_request("Write", &write, cwd);
        assert_eq!(asked.kind, "write");
        assert_eq!(asked.paths, ["a.txt"]);
        assert_eq!(asked.working_directory.as_deref(), Some(cwd));
        assert_eq!(permission_request("mcp__x__y", &json!({}), cwd).kind, "mcp");
        assert_eq!(
            permission_request("Skill", &json!({}), cwd).kind,
            "custom-tool"
        );
    }

    /// A stand-in for Claude Code: reads the prompt, prints 200 envelopes (init, control,
    /// stream events) around an assistant message, then tool results of 100 bytes each.
    const FAKE_CLAUDE: &str = r#"#!/bin/sh
read prompt
echo '{"type":"system","subtype":"init","session_id":"s-1"}'
i=0
while [ $i -lt 200 ]; do
  echo '{"type":"stream_event","event":{"type":"message_start"}}'
  i=$((i+1))
done
echo '{"type":"assistant","message":{"content":[{"type":"text","text":"kept"}]}}'
echo '{"type":"control_response","response":{}}'
i=0
while [ $i -lt 1000 ]; do
  echo '{"type":"user","message":{"content":"xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx"}}'
  i=$((i+1))
done
sleep 30
"#;

    #[tokio::test]
    async fn output_past_the_byte_limit_ends_the_turn_with_a_typed_error_keeping_the_message_and_envelopes_do_not_count()
     {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let script = dir.path().join("claude");
        std::fs::write(&script, FAKE_CLAUDE).unwrap();
        std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o755)).unwrap();
        let mut config = ClaudeLiveConfig::new(
            script.to_str().unwrap(),
            dir.path().join("home"),
            dir.path().join("work"),
        );
        config.path_var = Some("/usr/bin:/bin".into());
        config.backend.output_limits.max_turn_raw_chars = 1000;
        let mut live = ClaudeLive::new(config).unwrap();
        let turn = live.start_turn("hello").await.unwrap();
        let outcome = tokio::time::timeout(Duration::from_secs(30), turn.finish())
            .await
            .expect("the turn ended at the limit, not at the script's end");
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
        assert_eq!(outcome.text, "kept", "the message already received is kept");
        // The message and the tool results up to the breach; none of the 202 envelopes.
        let message =
            r#"{"type":"assistant","message":{"content":[{"type":"text","text":"kept"}]}}"#;
        let result = format!(
            r#"{{"type":"user","message":{{"content":"{}"}}}}"#,
            "x".repeat(65)
        );
        let (message, result) = (message.len() as u64 + 1, result.len() as u64 + 1);
        assert_eq!(
            outcome.retained_lines,
            1 + (1000 - message) / result + 1,
            "{outcome:?}"
        );
        assert_eq!(live.pid(), None, "the process was stopped");
    }

    /// `script` as an executable fake `claude` in `dir`, and a config running it.
    fn fake_claude(dir: &std::path::Path, script: &str) -> ClaudeLiveConfig {
        use std::os::unix::fs::PermissionsExt;
        let path = dir.join("claude");
        std::fs::write(&path, script).unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
        let mut config =
            ClaudeLiveConfig::new(path.to_str().unwrap(), dir.join("home"), dir.join("work"));
        config.path_var = Some("/usr/bin:/bin".into());
        config
    }

    /// Aborts `turn` once `limit` is over, as a pool lease's turn timeout does
    /// (`CliLease::set_turn_timeout`, which reports that `aborted` as `timeout`).
    fn time_limit(turn: &ClaudeTurn<'_>, limit: Duration) -> tokio::task::JoinHandle<()> {
        let abort = turn.abort_handle();
        tokio::spawn(async move {
            tokio::time::sleep(limit).await;
            abort.abort();
        })
    }

    #[tokio::test]
    async fn a_process_that_stops_reading_stdin_cannot_hold_a_large_prompt_or_its_turn_past_the_time_limit()
     {
        let dir = tempfile::tempdir().unwrap();
        // Never reads its stdin: 200 KiB is over the pipe's buffer.
        let mut config = fake_claude(dir.path(), "#!/bin/sh\nexec sleep 30\n");
        config.interrupt_grace = Duration::from_millis(500);
        let mut live = ClaudeLive::new(config).unwrap();
        let started = Instant::now();
        let prompt = "p".repeat(200 * 1024);
        let turn = tokio::time::timeout(Duration::from_secs(5), live.start_turn(&prompt))
            .await
            .expect("the turn started without waiting for the prompt to be read")
            .unwrap();
        assert!(turn.pid().is_some(), "running");
        let timer = time_limit(&turn, Duration::from_secs(1));
        let outcome = tokio::time::timeout(Duration::from_secs(5), turn.finish())
            .await
            .expect("the turn ended at its time limit and grace");
        timer.await.unwrap();
        ended_by_the_time_limit(&outcome, started);
        assert_eq!(live.pid(), None, "the process was killed");
    }

    /// The turn ended `aborted` by its 1 s limit and its grace, well before its 5 s guard
    /// (not when the stuck process or policy let go).
    fn ended_by_the_time_limit(outcome: &CliTurnOutcome, started: Instant) {
        assert_eq!(outcome.end, Some(TurnEnd::Aborted), "{outcome:?}");
        assert!(
            started.elapsed() < Duration::from_secs(4),
            "{:?}",
            started.elapsed()
        );
    }

    /// A permission policy that never answers (a human who is away).
    struct NeverAnswers;

    impl PermissionPolicy for NeverAnswers {
        fn decide(&self, _: PermissionRequest) -> crate::permission::DecisionFuture {
            Box::pin(std::future::pending())
        }
    }

    /// A stand-in for Claude Code that asks to run a tool, records what it reads after, and
    /// ends the turn when asked to interrupt it.
    const ASKING_CLAUDE: &str = r#"#!/bin/sh
read prompt
echo '{"type":"system","subtype":"init","session_id":"s-1"}'
echo '{"type":"control_request","request_id":"r-1","request":{"subtype":"can_use_tool","tool_name":"Bash","input":{"command":"ls"}}}'
while read line; do
  printf '%s\n' "$line" >> "$HOME/stdin.txt"
  case "$line" in
    *'"interrupt"'*) echo '{"type":"result","subtype":"success","is_error":false,"result":"stopped"}' ;;
  esac
done
"#;

    #[tokio::test]
    async fn a_permission_policy_that_never_answers_cannot_hold_the_turn_past_its_time_limit() {
        let dir = tempfile::tempdir().unwrap();
        let mut config = fake_claude(dir.path(), ASKING_CLAUDE);
        config.permission = Arc::new(NeverAnswers);
        let mut live = ClaudeLive::new(config).unwrap();
        let started = Instant::now();
        let mut turn = live.start_turn("run ls").await.unwrap();
        let timer = time_limit(&turn, Duration::from_secs(1));
        let mut events = Vec::new();
        let outcome = tokio::time::timeout(Duration::from_secs(5), async {
            loop {
                match turn.next().await {
                    Some(BackendEvent::TurnEnd(outcome)) => return outcome,
                    Some(event) => events.push(event),
                    None => panic!("no turn.end"),
                }
            }
        })
        .await
        .expect("the turn ended at its time limit, not when the policy answered");
        drop(turn);
        timer.await.unwrap();
        ended_by_the_time_limit(&outcome, started);
        assert_eq!(
            events,
            [BackendEvent::PermissionRequest {
                tool_name: "Bash".into(),
                input: json!({"command": "ls"}),
                approved: false,
            }]
        );
        // Claude was told no, then asked to interrupt; the process is kept for the next turn.
        let read = std::fs::read_to_string(dir.path().join("home/stdin.txt")).unwrap();
        let lines: Vec<Value> = read
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        assert_eq!(lines.len(), 2, "{read}");
        assert_eq!(lines[0]["response"]["request_id"], "r-1", "{read}");
        assert_eq!(
            lines[0]["response"]["response"]["behavior"], "deny",
            "{read}"
        );
        assert_eq!(lines[1]["request"]["subtype"], "interrupt", "{read}");
        assert!(
            live.pid().is_some(),
            "the process answered the interrupt: kept"
        );
    }

    #[tokio::test]
    async fn a_system_message_too_long_for_one_argument_is_refused_naming_it_before_any_spawn() {
        let dir = tempfile::tempdir().unwrap();
        let started = dir.path().join("started");
        let mut config = fake_claude(
            dir.path(),
            &format!("#!/bin/sh\ntouch '{}'\n", started.display()),
        );
        config.system_prompt = Some("s".repeat(200 * 1024));
        let mut live = ClaudeLive::new(config).unwrap();
        let Err(err) = live.start_turn("p").await else {
            panic!("a 200 KiB system message was passed as an argument");
        };
        assert!(
            matches!(
                err,
                ClaudeLiveError::SystemMessageTooLong {
                    bytes: 204_800,
                    max: super::super::MAX_ARG_BYTES
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
        assert!(!dir.path().join("home").exists(), "nothing was made");
    }

    #[test]
    fn the_config_debug_never_shows_the_key() {
        let mut config = ClaudeLiveConfig::new("/bin/claude", "/h", "/w");
        config.api_key = Some(Secret::new("sk-ant-FAKE-very-secret"));
        let text = format!("{config:?}");
        assert!(!text.contains("very-secret"), "{text}");
    }

    #[test]
    fn a_turn_failure_says_how_to_fix_it() {
        let failure = TurnFailure::OutputLimit {
            unit: "lines",
            key: "maxTurnLines",
            limit: 3,
            cap: super::super::MAX_TURN_LINES_CAP,
        };
        assert!(
            failure
                .to_string()
                .contains("raise `outputLimits.maxTurnLines`")
        );
    }
}
