//! The daemon's configuration: a TOML file (every field optional, defaults below), then
//! command-line flags and the environment on top. Shared by `serve` and `doctor`.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, Result, bail};
use copilot_pool::backend::CliBackendConfig;
use copilot_pool::http::AttachmentLimits;
use copilot_pool::kinds::SandboxMode;
use copilot_pool::model_guard::ModelGuardConfig;
use copilot_pool::pool::PoolConfig;
use copilot_pool::secret::Secret;
use copilot_pool::transcript::TranscriptMode;
use copilot_pool::turn::{TranscriptSettings, TurnTimeouts};
use copilot_pool::worker::WorkerConfig;
use serde::Deserialize;

/// The environment variable that carries the API token.
pub const API_TOKEN_ENV: &str = "COPILOT_POOL_API_TOKEN";

/// The exit status of a `serve` whose configuration is refused (sysexits' `EX_CONFIG`): a
/// supervisor can tell it from a failure a restart may cure (systemd:
/// `RestartPreventExitStatus=78`).
pub const EXIT_CONFIG: u8 = 78;

/// A configuration `serve` refuses (the file, the flags, the token file, the pool settings):
/// the process exits with [`EXIT_CONFIG`].
#[derive(Debug, thiserror::Error)]
#[error("{0:#}")]
pub struct ConfigRefused(pub anyhow::Error);

/// The most async threads `worker_threads` may ask for.
pub const MAX_WORKER_THREADS: usize = 1024;

/// The daemon's async threads by default on a machine with `cpus` CPUs: one per eight, at
/// least one. The daemon's own CPU was 4-9 % of its runtimes' in the bench (BENCHMARKS.md),
/// so on a machine its runtimes keep busy it needs under a core per eight; more threads than
/// work mostly wake each other (on 2 CPUs, two threads made ~60 % more context switches and
/// spent ~20 % more CPU over the same turns than one).
pub fn default_worker_threads(cpus: usize) -> usize {
    (cpus / 8).max(1)
}

/// The longest any `*_secs` setting may be (30 days): every wait is finite, and a deadline
/// this far out is one no clock arithmetic overflows (a huge value meant as "no limit"
/// would panic where a deadline is computed).
pub const MAX_SECS: u64 = 30 * 24 * 3600;

/// The smallest accepted `pool.max_rss_bytes` (256 MiB): a fresh runtime takes ~105 MiB, so
/// a lower limit would recycle every process, spares included, on every measurement.
pub const MIN_MAX_RSS_BYTES: u64 = 256 << 20;

/// The largest accepted `max_connections`.
const MAX_CONNECTIONS_LIMIT: usize = 1 << 20;

/// Why `--api-token` is refused (the message never repeats the token).
pub const TOKEN_ON_ARGV: &str = "--api-token is not accepted: a token on the command line is \
     visible to every local user in `ps`; set COPILOT_POOL_API_TOKEN or pass --api-token-file \
     PATH (a file readable by its owner only)";

/// `sandbox_tcp_bind`: the fixed ports a sandboxed worker's tools may listen on besides an
/// ephemeral one, or `"any"`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SandboxTcpBind {
    /// These fixed ports, and an ephemeral one (port 0).
    Ports(Vec<u16>),
    /// Any port.
    Any,
}

impl Default for SandboxTcpBind {
    fn default() -> Self {
        SandboxTcpBind::Ports(Vec::new())
    }
}

impl SandboxTcpBind {
    /// The library's form: `None` for any port.
    pub fn ports(&self) -> Option<&[u16]> {
        match self {
            SandboxTcpBind::Ports(ports) => Some(ports),
            SandboxTcpBind::Any => None,
        }
    }
}

impl<'de> Deserialize<'de> for SandboxTcpBind {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Raw {
            Ports(Vec<u16>),
            Word(String),
        }
        let wrong = || {
            serde::de::Error::custom(
                "sandbox_tcp_bind must be a list of ports (e.g. [3000, 5173]; [] for an \
                 ephemeral port only, the default) or \"any\"",
            )
        };
        match Raw::deserialize(deserializer).map_err(|_| wrong())? {
            Raw::Ports(ports) => Ok(SandboxTcpBind::Ports(ports)),
            Raw::Word(word) if word == "any" => Ok(SandboxTcpBind::Any),
            Raw::Word(_) => Err(wrong()),
        }
    }
}

/// `copilot-pool serve` settings. See README for every field and its default.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ServeConfig {
    /// HTTP API address: `HOST:PORT` (default `127.0.0.1:7878`), or `unix:PATH` for a Unix
    /// socket (needs an API token).
    pub listen: ListenAddress,
    /// Separate address for `/metrics` (default: served on `listen` only).
    pub metrics_listen: Option<SocketAddr>,
    /// Bindings live here (default `$COPILOT_POOL_HOME/state` or `~/.copilot-pool/state`).
    pub state_dir: Option<PathBuf>,
    /// Per-agent homes: `<agents_dir>/agents/<agent_id>/copilot` (default the pool home).
    pub agents_dir: Option<PathBuf>,
    /// Bearer token every `/v1` call must carry (or env `COPILOT_POOL_API_TOKEN`).
    pub api_token: Option<Secret>,
    /// The runtime executable (default: `COPILOT_CLI_PATH`, the managed install, PATH).
    pub cli_path: Option<PathBuf>,
    /// Largest accepted request body in bytes (default 1 MiB).
    pub max_body_bytes: usize,
    /// How long a turn asked with an `Idempotency-Key` answers a retry of it with its
    /// `turn.end` after it ended (default 3600; 0: never).
    pub idempotency_ttl_secs: u64,
    /// Bytes of such answers kept at most, the oldest forgotten first (default 16 MiB).
    pub idempotency_max_bytes: usize,
    /// A request head must be complete within this many seconds from when the server starts
    /// waiting for it: after the connection is accepted, and again after each response
    /// (default 30).
    pub header_read_timeout_secs: u64,
    /// A connection on which no byte moves either way for this many seconds is closed; a
    /// response in progress is finished first (default 10).
    pub idle_timeout_secs: u64,
    /// Open connections at most, on `listen` (default 4096; lowered at start when the
    /// descriptor limit would not leave room for the runtime processes). Connections over
    /// the cap are answered 503 and closed without reaching the pool.
    pub max_connections: usize,
    /// On SIGTERM/SIGINT, running turns get this long before they are aborted (default 30).
    pub drain_grace_secs: u64,
    /// The daemon's async threads (default: [`default_worker_threads`] of the CPUs).
    pub worker_threads: Option<usize>,
    /// `human` (default) or `json`.
    pub log_format: LogFormat,
    /// Directories a conversation's `session.workingDirectory` and
    /// `session.additionalDirectories`, and a turn's attachments by path, may lie under,
    /// besides the agent's own working directory (default: none). Absolute paths.
    pub allowed_work_roots: Vec<PathBuf>,
    /// Accept `session.mcpServers` entries that start a local command (default `false`).
    pub allow_local_mcp_servers: bool,
    /// Each worker in its own Landlock sandbox: `auto` (default: what the kernel enforces),
    /// `required` (refuse to start without every wall) or `off`.
    pub sandbox: SandboxMode,
    /// TCP ports a sandboxed worker may connect to (default `[443]`: the Copilot API and
    /// GitHub); a BYOK provider's port is added for its workers. The daemon's own ports are
    /// never allowed.
    pub sandbox_tcp_ports: Vec<u16>,
    /// Fixed TCP ports a sandboxed worker's tools may listen on besides an ephemeral one
    /// (default `[]`: an ephemeral port only), or `"any"` (TCP bind unrestricted).
    pub sandbox_tcp_bind: SandboxTcpBind,
    /// More directories a sandboxed worker may read (default none), e.g. where the logged-in
    /// user's stored credentials live when `allow_logged_in_user` is on.
    pub sandbox_read_paths: Vec<PathBuf>,
    /// Pool caps and lifetimes.
    pub pool: PoolSection,
    /// Turn timeouts and the transcript mirror.
    pub turns: TurnsSection,
    /// Inline attachments.
    pub attachments: AttachmentsSection,
    /// Which credentials a request may fall back to.
    pub auth: AuthSection,
    /// The SDK endpoint (off unless `listen` is set).
    pub sdk: SdkSection,
    /// `[model]`: the guarded model path of BYOK requests.
    pub model: ModelSection,
    /// `[backends.<id>]`: CLI backends a turn may name besides `copilot` (issue 17). Each
    /// table holds the keys of `CliBackendConfig` (the product page's `cliBackends.<id>`,
    /// camelCase); for a bundled id (`claude-cli`) its keys override the bundled default,
    /// so `command = "/path/to/claude"` is enough. Without any table only `claude-cli` is
    /// configured (running `claude` from `PATH`); `codex-cli` and `google-gemini-cli` need
    /// a table, even an empty one, to be offered.
    pub backends: std::collections::BTreeMap<String, toml::Table>,
}

/// `[model]`: the guarded model path. Every BYOK model request goes through the daemon's own
/// HTTP client; these are its switches and limits (never taken from a request).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ModelSection {
    /// Allow providers on loopback, private, CGNAT, link-local and unique-local addresses,
    /// and plain http:// to loopback (local models). Default false.
    pub allow_private_endpoints: bool,
    /// Providers allowed on private addresses even with `allow_private_endpoints` off, by
    /// origin (`http://127.0.0.1:11434`): one local model without opening every private
    /// address.
    pub private_endpoints: Vec<String>,
    /// PEM files of extra root CAs trusted for providers (on top of the Mozilla roots).
    pub extra_ca_files: Vec<PathBuf>,
    /// Largest model request body (default 32 MiB).
    pub max_request_body_bytes: usize,
    /// Resolve plus TCP and TLS connect (default 10).
    pub connect_timeout_secs: u64,
    /// To the response head (default 300).
    pub first_byte_timeout_secs: u64,
    /// Between two pieces of the response body (default 120).
    pub idle_timeout_secs: u64,
    /// Ports a request's provider may name for a CLI backend, which calls its model itself
    /// and whose sandbox opens that port on every address (default `[443]`).
    pub cli_provider_ports: Vec<u16>,
}

impl Default for ModelSection {
    fn default() -> Self {
        let g = ModelGuardConfig::default();
        Self {
            allow_private_endpoints: g.allow_private_endpoints,
            private_endpoints: Vec::new(),
            extra_ca_files: Vec::new(),
            max_request_body_bytes: g.max_request_body_bytes,
            connect_timeout_secs: g.connect_timeout.as_secs(),
            first_byte_timeout_secs: g.first_byte_timeout.as_secs(),
            idle_timeout_secs: g.idle_timeout.as_secs(),
            cli_provider_ports: g.cli_provider_ports,
        }
    }
}

/// `[attachments]`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct AttachmentsSection {
    /// Largest decoded inline attachment in bytes (default 512 KiB).
    pub max_bytes: usize,
    /// Media types accepted inline (default: PNG, JPEG, GIF and WebP images, plain text,
    /// Markdown, CSV, JSON).
    pub media_types: Vec<String>,
    /// The inline attachments one conversation keeps at most, in bytes (default 64 MiB).
    pub max_conversation_bytes: u64,
}

impl Default for AttachmentsSection {
    fn default() -> Self {
        let limits = AttachmentLimits::default();
        Self {
            max_bytes: limits.max_bytes,
            media_types: limits.media_types,
            max_conversation_bytes: limits.max_conversation_bytes,
        }
    }
}

/// `[sdk]`: the endpoint an official Copilot SDK attaches to by URL.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SdkSection {
    /// `HOST:PORT`, or `unix:PATH` for a Unix socket (default: off).
    pub listen: Option<String>,
    /// Open SDK connections at most (default 1024).
    pub max_connections: usize,
    /// Of those, connections not authenticated yet at most (default 64).
    pub max_unauthenticated_connections: usize,
    /// Of those, one agent's authenticated connections at most (default 64).
    pub max_connections_per_agent: usize,
    /// Sessions one connection holds at once (default 1024).
    pub max_sessions_per_connection: usize,
    /// Each agent's connection token, as its SHA-256 in hex.
    pub tokens: Vec<SdkToken>,
}

/// `[[sdk.tokens]]`: one agent's connection token.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SdkToken {
    /// The agent the token names.
    pub agent: String,
    /// `printf %s "$TOKEN" | sha256sum`.
    pub sha256: String,
}

impl Default for SdkSection {
    fn default() -> Self {
        Self {
            listen: None,
            max_connections: 1024,
            max_unauthenticated_connections: 64,
            max_connections_per_agent: 64,
            max_sessions_per_connection: 1024,
            tokens: Vec::new(),
        }
    }
}

/// `[auth]`: the credential levels a request without a token of its own may use. Both are
/// off by default: a request brings its token (or a BYOK provider).
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct AuthSection {
    /// A request with no token runs with the daemon's own token variables
    /// (`OPENCLAW_GITHUB_TOKEN` > `COPILOT_GITHUB_TOKEN` > `GH_TOKEN` > `GITHUB_TOKEN`, read
    /// once at start).
    pub env_fallback: bool,
    /// A request may run as the user logged in to the Copilot CLI on this machine.
    pub allow_logged_in_user: bool,
}

/// Where a listener of the daemon listens (the API's `listen`, `[sdk] listen`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ListenAddress {
    /// A TCP address.
    Tcp(SocketAddr),
    /// A Unix socket path.
    Unix(PathBuf),
}

impl std::str::FromStr for ListenAddress {
    type Err = anyhow::Error;

    fn from_str(text: &str) -> Result<Self> {
        if let Some(path) = text.strip_prefix("unix:") {
            if path.is_empty() {
                bail!("listen address `unix:` names no socket path; use unix:/path/to/api.sock");
            }
            return Ok(ListenAddress::Unix(PathBuf::from(path)));
        }
        text.parse::<SocketAddr>()
            .map(ListenAddress::Tcp)
            .with_context(|| format!("listen address {text:?} is neither HOST:PORT nor unix:PATH"))
    }
}

impl<'de> Deserialize<'de> for ListenAddress {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let text = String::deserialize(d)?;
        text.parse()
            .map_err(|e: anyhow::Error| serde::de::Error::custom(format!("{e:#}")))
    }
}

impl ListenAddress {
    /// The port, for a TCP address.
    pub fn tcp_port(&self) -> Option<u16> {
        match self {
            ListenAddress::Tcp(addr) => Some(addr.port()),
            ListenAddress::Unix(_) => None,
        }
    }
}

impl std::fmt::Display for ListenAddress {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ListenAddress::Tcp(addr) => write!(f, "{addr}"),
            ListenAddress::Unix(path) => write!(f, "unix:{}", path.display()),
        }
    }
}

impl SdkSection {
    /// Where to listen, if anywhere.
    pub fn listen(&self) -> Result<Option<ListenAddress>> {
        self.listen
            .as_deref()
            .map(|text| text.parse().context("[sdk] listen"))
            .transpose()
    }

    /// The token table.
    pub fn tokens(&self) -> Result<copilot_pool::sdk_endpoint::AgentTokens> {
        let mut tokens = copilot_pool::sdk_endpoint::AgentTokens::new();
        for entry in &self.tokens {
            tokens.add_hash(&entry.agent, &entry.sha256)?;
        }
        Ok(tokens)
    }
}

/// Log output format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Default, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    /// Human-readable lines.
    #[default]
    Human,
    /// One JSON object per line.
    Json,
}

/// `[pool]`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct PoolSection {
    pub max_processes: usize,
    pub max_processes_per_key: usize,
    pub max_sessions_per_process: usize,
    pub max_sessions: usize,
    pub max_waiters: usize,
    pub max_waiters_per_agent: usize,
    pub max_leases_per_agent: Option<usize>,
    pub max_conversations_per_agent: Option<usize>,
    pub wait_timeout_secs: u64,
    pub idle_ttl_secs: u64,
    pub max_turns_per_process: u64,
    pub max_rss_bytes: u64,
    /// Leases running at once from which a process counts as busy.
    pub busy_leases_per_process: usize,
    /// Processes of one key worth running for CPU (default: from the machine's cores).
    pub cpu_processes_per_key: Option<usize>,
    /// Warm spares per key with traffic in the window (default 1; 0: off).
    pub warm_spares: usize,
    /// How long after a key's last lease its spares are kept.
    pub warm_spare_window_secs: u64,
    /// Conversations a warm spare resumes ahead of their return (0: none).
    pub warm_spare_conversations: usize,
    /// How often each runtime is pinged.
    pub health_interval_ms: u64,
    /// How long a ping may take before it counts as missed (shorter than the interval).
    pub health_timeout_ms: u64,
    /// Missed pings in a row after which a runtime is hung: killed, its turns end `crashed`.
    pub health_misses: u32,
}

/// `[turns]`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TurnsSection {
    pub inactivity_secs: u64,
    pub absolute_secs: u64,
    pub tool_secs: u64,
    pub permission_secs: u64,
    pub user_input_secs: u64,
    /// A hook (gateway-answered hooks included) must answer within this, else the runtime
    /// gets the hook's default (no output).
    pub hook_secs: u64,
    /// Mirror every conversation's transcript here (default: off).
    pub transcript_dir: Option<PathBuf>,
    /// `best-effort` (default) or `strict`.
    pub transcript_mode: TranscriptMode,
    /// A turn whose gateway leaves more than this many bytes of its events unread is aborted
    /// (default 32 MiB; at least [`MIN_UNREAD_EVENT_BYTES`]).
    pub max_unread_event_bytes: usize,
}

/// The least `[turns] max_unread_event_bytes` taken: one event of a turn can be tens of KiB
/// (a snapshot of the conversation), and a lower limit would abort turns whose gateway reads
/// as they come.
const MIN_UNREAD_EVENT_BYTES: usize = 1 << 20;

/// The most `[turns] max_unread_event_bytes` taken: half of what a runtime may leave unread
/// in one session's route before it is stopped as flooding the daemon
/// (`WorkerConfig::max_unread_route_bytes`), so a slow reader's turn is aborted first.
const MAX_UNREAD_EVENT_BYTES: usize = copilot_pool::worker::DEFAULT_MAX_UNREAD_ROUTE_BYTES / 2;

impl Default for ServeConfig {
    fn default() -> Self {
        Self {
            listen: ListenAddress::Tcp(SocketAddr::from(([127, 0, 0, 1], 7878))),
            metrics_listen: None,
            state_dir: None,
            agents_dir: None,
            api_token: None,
            cli_path: None,
            max_body_bytes: 1 << 20,
            idempotency_ttl_secs: 3600,
            idempotency_max_bytes: 16 << 20,
            header_read_timeout_secs: 30,
            idle_timeout_secs: 10,
            max_connections: 4096,
            drain_grace_secs: 30,
            worker_threads: None,
            log_format: LogFormat::Human,
            allowed_work_roots: Vec::new(),
            allow_local_mcp_servers: false,
            sandbox: SandboxMode::Auto,
            sandbox_tcp_ports: vec![copilot_pool::sandbox::HTTPS_PORT],
            sandbox_tcp_bind: SandboxTcpBind::default(),
            sandbox_read_paths: Vec::new(),
            pool: PoolSection::default(),
            turns: TurnsSection::default(),
            attachments: AttachmentsSection::default(),
            auth: AuthSection::default(),
            sdk: SdkSection::default(),
            model: ModelSection::default(),
            backends: std::collections::BTreeMap::new(),
        }
    }
}

impl PoolSection {
    /// The health settings: finite, a ping given less time than the interval (a ping still
    /// waiting when the next is due makes the next one be skipped, so the hang bound would
    /// be longer than it reads), at least one miss.
    fn validate_health(&self) -> Result<()> {
        let (interval, timeout, misses) = (
            self.health_interval_ms,
            self.health_timeout_ms,
            self.health_misses,
        );
        if interval == 0 || timeout == 0 {
            bail!(
                "pool.health_interval_ms and pool.health_timeout_ms must be above 0 (the \
                 defaults are 10000 and 5000); a runtime that is never pinged is never found hung"
            );
        }
        if timeout >= interval {
            bail!(
                "pool.health_timeout_ms ({timeout}) must be shorter than \
                 pool.health_interval_ms ({interval}): a ping still waiting when the next is due \
                 would skip it; lower the timeout or raise the interval"
            );
        }
        if misses == 0 {
            bail!(
                "pool.health_misses must be at least 1 (the default is 2: one slow ping on a \
                 loaded machine does not kill a healthy runtime)"
            );
        }
        const HOUR_MS: u64 = 3_600_000;
        if interval > HOUR_MS || misses > 100 {
            bail!(
                "pool.health_interval_ms must be at most 3600000 (one hour) and \
                 pool.health_misses at most 100: a hung runtime would hold its conversations \
                 for longer than any turn may last"
            );
        }
        Ok(())
    }
}

impl Default for PoolSection {
    fn default() -> Self {
        Self {
            max_processes: 64,
            max_processes_per_key: 4,
            max_sessions_per_process: 32,
            max_sessions: 1024,
            max_waiters: 1024,
            max_waiters_per_agent: 256,
            max_leases_per_agent: None,
            max_conversations_per_agent: None,
            wait_timeout_secs: 30,
            idle_ttl_secs: 300,
            max_turns_per_process: 2000,
            max_rss_bytes: 1 << 30,
            busy_leases_per_process: 8,
            cpu_processes_per_key: None,
            warm_spares: 1,
            warm_spare_window_secs: 600,
            warm_spare_conversations: 32,
            health_interval_ms: 10_000,
            health_timeout_ms: 5_000,
            health_misses: copilot_pool::worker::DEFAULT_HEALTH_MISSES,
        }
    }
}

impl Default for TurnsSection {
    fn default() -> Self {
        let t = TurnTimeouts::default();
        Self {
            inactivity_secs: t.inactivity.as_secs(),
            absolute_secs: t.absolute.as_secs(),
            tool_secs: t.tool.as_secs(),
            permission_secs: t.permission.as_secs(),
            user_input_secs: t.user_input.as_secs(),
            hook_secs: t.hook.as_secs(),
            transcript_dir: None,
            transcript_mode: TranscriptMode::BestEffort,
            max_unread_event_bytes: copilot_pool::turn::DEFAULT_MAX_UNREAD_EVENT_BYTES,
        }
    }
}

/// ` (line L, column C)` of a byte span's start in `text`, or nothing without one.
fn where_in(text: &str, span: Option<std::ops::Range<usize>>) -> String {
    let Some(span) = span else {
        return String::new();
    };
    let before = text.get(..span.start).unwrap_or(text);
    let line = before.matches('\n').count() + 1;
    let column = before.rsplit('\n').next().map_or(0, |l| l.chars().count()) + 1;
    format!(" (line {line}, column {column})")
}

impl ServeConfig {
    /// Reads `path` (when given) over the defaults, then the API token from the environment
    /// when the file has none.
    pub fn load(path: Option<&Path>) -> Result<Self> {
        let mut config = match path {
            Some(path) => {
                let text = std::fs::read_to_string(path)
                    .with_context(|| format!("reading the config file {}", path.display()))?;
                // toml's error quotes the line it failed on, which may hold the API token (a
                // misspelled `api_token` key is still its line): only where and what.
                let config = toml::from_str::<ServeConfig>(&text).map_err(|e| {
                    anyhow::anyhow!(
                        "invalid config file {}{}: {}",
                        path.display(),
                        where_in(&text, e.span()),
                        e.message()
                    )
                })?;
                if config.api_token.as_ref().is_some_and(|t| !t.is_empty()) {
                    refuse_shared_secret_file(path)?;
                }
                config
            }
            None => ServeConfig::default(),
        };
        // An empty token is no token (it must never make every request pass).
        if config.api_token.as_ref().is_some_and(|t| t.is_empty()) {
            config.api_token = None;
        }
        if config.api_token.is_none()
            && let Some(token) = std::env::var_os(API_TOKEN_ENV).filter(|t| !t.is_empty())
        {
            config.api_token = Some(Secret::new(token.to_string_lossy().into_owned()));
        }
        Ok(config)
    }

    /// Checks what cannot work, with the fix in the message.
    pub fn validate(&self) -> Result<()> {
        match &self.listen {
            ListenAddress::Tcp(addr) if !addr.ip().is_loopback() && self.api_token.is_none() => {
                bail!(
                    "refusing to listen on {addr} without an API token: set {API_TOKEN_ENV} or \
                     pass --api-token-file PATH (or listen on 127.0.0.1)"
                );
            }
            ListenAddress::Unix(path) if self.api_token.is_none() => {
                bail!(
                    "refusing to listen on the Unix socket {} without an API token: any \
                     process of this user can connect to a socket file, an agent's tools \
                     included (the sandbox does not confine connecting to one); set \
                     {API_TOKEN_ENV} or pass --api-token-file PATH",
                    path.display()
                );
            }
            _ => {}
        }
        if let Some(addr) = self.metrics_listen
            && self.listen == ListenAddress::Tcp(addr)
        {
            bail!("metrics_listen must differ from listen ({addr})");
        }
        if self.max_body_bytes == 0 {
            bail!("max_body_bytes must be above 0");
        }
        if self.header_read_timeout_secs == 0 || self.idle_timeout_secs == 0 {
            bail!(
                "header_read_timeout_secs and idle_timeout_secs must be above 0 (every wait is \
                 finite; the defaults are 30 and 10)"
            );
        }
        if let Some(threads) = self.worker_threads
            && !(1..=MAX_WORKER_THREADS).contains(&threads)
        {
            bail!(
                "worker_threads must be 1 to {MAX_WORKER_THREADS} ({threads} given); leave it \
                 out for one per eight CPUs"
            );
        }
        if self.max_connections == 0 || self.max_connections > MAX_CONNECTIONS_LIMIT {
            bail!(
                "max_connections must be 1 to {MAX_CONNECTIONS_LIMIT} (default 4096); each \
                 connection holds a file descriptor"
            );
        }
        if let Some(root) = self.allowed_work_roots.iter().find(|r| !r.is_absolute()) {
            bail!(
                "allowed_work_roots entry {} must be an absolute path",
                root.display()
            );
        }
        if let Some(sdk) = self.sdk.listen()? {
            // Port 0 is a free port each: two listeners may both ask for one.
            let shared = match (&sdk, &self.listen) {
                (ListenAddress::Tcp(a), ListenAddress::Tcp(b)) => a == b && a.port() != 0,
                (a, b) => a == b,
            };
            if shared {
                bail!(
                    "[sdk] listen and listen are both {sdk}: the SDK endpoint and the HTTP API \
                     need an address each"
                );
            }
            if let (Some(metrics), ListenAddress::Tcp(addr)) = (self.metrics_listen, &sdk)
                && metrics == *addr
                && addr.port() != 0
            {
                bail!(
                    "[sdk] listen and metrics_listen are both {addr}: the SDK endpoint and the \
                     metrics need an address each"
                );
            }
            if self.sdk.tokens.is_empty() {
                bail!(
                    "the SDK endpoint is on but [[sdk.tokens]] lists no agent, so every \
                     connect would fail; add `[[sdk.tokens]]` with `agent` and `sha256` \
                     (printf %s \"$TOKEN\" | sha256sum) to the config file"
                );
            }
            self.sdk.tokens()?;
            let caps = [
                self.sdk.max_connections,
                self.sdk.max_unauthenticated_connections,
                self.sdk.max_connections_per_agent,
                self.sdk.max_sessions_per_connection,
            ];
            if caps
                .iter()
                .any(|cap| *cap == 0 || *cap > MAX_CONNECTIONS_LIMIT)
            {
                bail!(
                    "sdk.max_connections, sdk.max_unauthenticated_connections, \
                     sdk.max_connections_per_agent and sdk.max_sessions_per_connection must be \
                     1 to {MAX_CONNECTIONS_LIMIT} (defaults 1024, 64, 64 and 1024)"
                );
            }
        }
        if let Some(path) = self.sandbox_read_paths.iter().find(|r| !r.is_absolute()) {
            bail!(
                "sandbox_read_paths entry {} must be an absolute path",
                path.display()
            );
        }
        if self.pool.max_processes == 0 || self.pool.max_sessions_per_process == 0 {
            bail!("pool.max_processes and pool.max_sessions_per_process must be above 0");
        }
        if self.pool.busy_leases_per_process == 0 || self.pool.cpu_processes_per_key == Some(0) {
            bail!(
                "pool.busy_leases_per_process and pool.cpu_processes_per_key must be above 0 \
                 (leave cpu_processes_per_key out to derive it from the machine's cores)"
            );
        }
        if self.pool.warm_spares > 0 && self.pool.warm_spare_window_secs == 0 {
            bail!(
                "pool.warm_spare_window_secs must be above 0 when pool.warm_spares is set \
                 (or set warm_spares = 0 to turn spares off)"
            );
        }
        self.pool.validate_health()?;
        let m = &self.model;
        if m.max_request_body_bytes == 0
            || m.connect_timeout_secs == 0
            || m.first_byte_timeout_secs == 0
            || m.idle_timeout_secs == 0
        {
            bail!(
                "model.max_request_body_bytes and the model timeouts must be above 0 (the \
                 defaults are 32 MiB, 10, 300 and 120 s)"
            );
        }
        if self.turns.hook_secs == 0 {
            bail!("turns.hook_secs must be above 0 (the default is 30)");
        }
        if self.turns.max_unread_event_bytes > MAX_UNREAD_EVENT_BYTES {
            bail!(
                "turns.max_unread_event_bytes must be at most {MAX_UNREAD_EVENT_BYTES} (128 MiB): \
                 past twice that, a runtime's unread events are taken as a flood and its \
                 process is stopped, so a slow reader's turn must be aborted before (the \
                 default is {})",
                copilot_pool::turn::DEFAULT_MAX_UNREAD_EVENT_BYTES
            );
        }
        if self.turns.max_unread_event_bytes < MIN_UNREAD_EVENT_BYTES {
            bail!(
                "turns.max_unread_event_bytes must be at least {MIN_UNREAD_EVENT_BYTES} (1 MiB): \
                 one event of a turn can be tens of KiB, and a lower limit would abort turns \
                 whose gateway reads them as they come (the default is {})",
                copilot_pool::turn::DEFAULT_MAX_UNREAD_EVENT_BYTES
            );
        }
        // A zero here would not turn a limit off: every turn would time out at once, or no
        // lease would ever be placed. (A zero `max_waiters` or `wait_timeout_secs` is a
        // choice: a lease that must wait fails at once.)
        let (t, p) = (&self.turns, &self.pool);
        let zero = [
            ("turns.inactivity_secs", t.inactivity_secs == 0),
            ("turns.absolute_secs", t.absolute_secs == 0),
            ("turns.tool_secs", t.tool_secs == 0),
            ("turns.permission_secs", t.permission_secs == 0),
            ("turns.user_input_secs", t.user_input_secs == 0),
            ("pool.max_processes_per_key", p.max_processes_per_key == 0),
            ("pool.max_sessions", p.max_sessions == 0),
            ("pool.max_turns_per_process", p.max_turns_per_process == 0),
        ];
        if let Some((key, _)) = zero.iter().find(|(_, is_zero)| *is_zero) {
            bail!(
                "{key} must be above 0 (a zero does not turn the limit off; leave the key out \
                 for its default, listed in the README's config table)"
            );
        }
        if p.max_rss_bytes < MIN_MAX_RSS_BYTES {
            bail!(
                "pool.max_rss_bytes must be at least {MIN_MAX_RSS_BYTES} (256 MiB; {} given): a \
                 fresh runtime takes ~105 MiB, so every process would be recycled on every \
                 measurement (the default is 1073741824, 1 GiB)",
                p.max_rss_bytes
            );
        }
        let m = &self.model;
        let secs = [
            ("idempotency_ttl_secs", self.idempotency_ttl_secs),
            ("header_read_timeout_secs", self.header_read_timeout_secs),
            ("idle_timeout_secs", self.idle_timeout_secs),
            ("drain_grace_secs", self.drain_grace_secs),
            ("model.connect_timeout_secs", m.connect_timeout_secs),
            ("model.first_byte_timeout_secs", m.first_byte_timeout_secs),
            ("model.idle_timeout_secs", m.idle_timeout_secs),
            ("pool.wait_timeout_secs", p.wait_timeout_secs),
            ("pool.idle_ttl_secs", p.idle_ttl_secs),
            ("pool.warm_spare_window_secs", p.warm_spare_window_secs),
            ("turns.inactivity_secs", t.inactivity_secs),
            ("turns.absolute_secs", t.absolute_secs),
            ("turns.tool_secs", t.tool_secs),
            ("turns.permission_secs", t.permission_secs),
            ("turns.user_input_secs", t.user_input_secs),
            ("turns.hook_secs", t.hook_secs),
        ];
        if let Some((key, value)) = secs.iter().find(|(_, value)| *value > MAX_SECS) {
            bail!(
                "{key} must be at most {MAX_SECS} (30 days; {value} given): every wait is \
                 finite, so there is no value meaning \"no limit\""
            );
        }
        Ok(())
    }

    /// The header-read timeout.
    pub fn header_read_timeout(&self) -> Duration {
        Duration::from_secs(self.header_read_timeout_secs)
    }

    /// The idle-connection timeout.
    pub fn idle_timeout(&self) -> Duration {
        Duration::from_secs(self.idle_timeout_secs)
    }

    /// The pool's home: `$COPILOT_POOL_HOME` or `~/.copilot-pool`.
    pub fn home(&self) -> Result<PathBuf> {
        copilot_pool::home::default_base_dir(copilot_pool::runtime::process_env)
            .context("finding the pool's home (set HOME or COPILOT_POOL_HOME)")
    }

    /// Where bindings live (the Copilot runtime's and the CLI backends', and the
    /// process-group ledger).
    pub fn state_dir(&self) -> Result<PathBuf> {
        match &self.state_dir {
            Some(dir) => Ok(dir.clone()),
            None => Ok(self.home()?.join("state")),
        }
    }

    /// The base of per-agent homes.
    pub fn agents_dir(&self) -> Result<PathBuf> {
        match &self.agents_dir {
            Some(dir) => Ok(dir.clone()),
            None => self.home(),
        }
    }

    /// The pool configuration for `program`.
    pub fn pool_config(&self, program: PathBuf) -> Result<PoolConfig> {
        let mut worker = WorkerConfig::new(program, PathBuf::new(), PathBuf::new());
        worker.health_interval = Duration::from_millis(self.pool.health_interval_ms);
        worker.health_timeout = Duration::from_millis(self.pool.health_timeout_ms);
        worker.health_misses = self.pool.health_misses;
        let mut config = PoolConfig::new(worker, self.state_dir()?, self.agents_dir()?);
        let p = &self.pool;
        config.max_processes = p.max_processes;
        config.max_processes_per_key = p.max_processes_per_key;
        config.max_sessions_per_process = p.max_sessions_per_process;
        config.max_sessions = p.max_sessions;
        config.max_waiters = p.max_waiters;
        config.max_waiters_per_agent = p.max_waiters_per_agent;
        config.max_leases_per_agent = p.max_leases_per_agent;
        config.max_conversations_per_agent = p.max_conversations_per_agent;
        config.wait_timeout = Duration::from_secs(p.wait_timeout_secs);
        config.idle_ttl = Duration::from_secs(p.idle_ttl_secs);
        config.max_turns_per_process = p.max_turns_per_process;
        config.max_rss_bytes = p.max_rss_bytes;
        config.busy_leases_per_process = p.busy_leases_per_process;
        if let Some(n) = p.cpu_processes_per_key {
            config.cpu_processes_per_key = n;
        }
        config.warm_spares = p.warm_spares;
        config.warm_spare_window = Duration::from_secs(p.warm_spare_window_secs);
        config.warm_spare_conversations = p.warm_spare_conversations;
        // The pool's shutdown grace is the daemon's drain grace.
        config.shutdown_grace = Duration::from_secs(self.drain_grace_secs);
        let m = &self.model;
        let guard = &mut config.model_guard;
        guard.allow_private_endpoints = m.allow_private_endpoints;
        guard.private_endpoints = m
            .private_endpoints
            .iter()
            .map(|text| ModelGuardConfig::private_endpoint(text))
            .collect::<Result<_, _>>()?;
        guard.max_request_body_bytes = m.max_request_body_bytes;
        guard.connect_timeout = Duration::from_secs(m.connect_timeout_secs);
        guard.first_byte_timeout = Duration::from_secs(m.first_byte_timeout_secs);
        guard.idle_timeout = Duration::from_secs(m.idle_timeout_secs);
        if m.cli_provider_ports.contains(&0) {
            bail!(
                "model.cli_provider_ports lists port 0; list the TCP ports (1-65535) a CLI \
                 backend's provider may use, e.g. [443, 8443]"
            );
        }
        guard.cli_provider_ports.clone_from(&m.cli_provider_ports);
        for (id, table) in &self.backends {
            config
                .cli_backends
                .insert(id.clone(), cli_backend(id, table)?);
        }
        for file in &m.extra_ca_files {
            let pem = std::fs::read(file).with_context(|| {
                format!("reading model.extra_ca_files entry {}", file.display())
            })?;
            guard.extra_root_certificates_pem.push(pem);
        }
        // What `Pool::start` would refuse, refused here (doctor and serve build it so).
        config.check()?;
        Ok(config)
    }

    /// Turn timeouts.
    pub fn timeouts(&self) -> TurnTimeouts {
        let t = &self.turns;
        TurnTimeouts {
            inactivity: Duration::from_secs(t.inactivity_secs),
            absolute: Duration::from_secs(t.absolute_secs),
            tool: Duration::from_secs(t.tool_secs),
            permission: Duration::from_secs(t.permission_secs),
            user_input: Duration::from_secs(t.user_input_secs),
            hook: Duration::from_secs(t.hook_secs),
        }
    }

    /// The inline attachment limits (media types compared in lower case).
    pub fn attachment_limits(&self) -> AttachmentLimits {
        let mut limits = AttachmentLimits::default();
        limits.max_bytes = self.attachments.max_bytes;
        limits.max_conversation_bytes = self.attachments.max_conversation_bytes;
        limits.media_types = self
            .attachments
            .media_types
            .iter()
            .map(|t| t.trim().to_ascii_lowercase())
            .collect();
        limits
    }

    /// The transcript mirror, if configured.
    pub fn transcript(&self) -> Option<TranscriptSettings> {
        self.turns
            .transcript_dir
            .as_ref()
            .map(|dir| TranscriptSettings::new(dir.clone(), self.turns.transcript_mode))
    }
}

/// One `[backends.<id>]` table as a CLI backend: its keys over the bundled default of `id`
/// when there is one, else the table alone; checked by the library's validation. A key
/// replaces the default's, except `env`, merged variable by variable (the table's value wins
/// for a variable it names). The safety switches (telemetry, updates, analytics, bounded
/// retries, workspace trust) are not in the defaults' `args`/`env`: the runner applies them
/// whatever the table says (`SafetySwitches`), unless the table names that very variable or
/// `-c` key.
pub fn cli_backend(id: &str, table: &toml::Table) -> Result<CliBackendConfig> {
    let mut value = match CliBackendConfig::bundled(id) {
        Some(bundled) => serde_json::to_value(bundled).context("the bundled backend")?,
        None => serde_json::Value::Object(serde_json::Map::new()),
    };
    let mut overrides = serde_json::to_value(table).context("reading the backend table")?;
    // The bundled `codex-cli` and `google-gemini-cli` took the prompt as an argument until
    // they wrote it to stdin (kept off the command line); a table written for that may still
    // bound the argument, which would now refuse the whole config.
    let bundled_reads_stdin = CliBackendConfig::bundled(id)
        .is_some_and(|b| b.input == copilot_pool::backend::InputMode::Stdin);
    if let Some(keys) = overrides.as_object_mut()
        && bundled_reads_stdin
        && !keys.contains_key("input")
        && keys.remove("maxPromptArgChars").is_some()
    {
        tracing::warn!(
            backend = id,
            "[backends.{id}] maxPromptArgChars is ignored: this bundled backend writes the \
             prompt to stdin (off the command line); remove the key, or set input = \"arg\" \
             to pass the prompt as an argument again"
        );
    }
    if let (Some(base), serde_json::Value::Object(keys)) = (value.as_object_mut(), overrides) {
        for (key, value) in keys {
            match (key.as_str(), base.get_mut(&key), value) {
                ("env", Some(serde_json::Value::Object(env)), serde_json::Value::Object(more)) => {
                    env.extend(more);
                }
                (_, _, value) => {
                    base.insert(key, value);
                }
            }
        }
    }
    let config: CliBackendConfig = serde_json::from_value(value).with_context(|| {
        format!(
            "[backends.{id}]: the keys are CliBackendConfig's, camelCase (command, args, \
             resumeArgs, output, ...); a backend without a bundled default needs `command`"
        )
    })?;
    config
        .validate(id)
        .with_context(|| format!("[backends.{id}]"))?;
    Ok(config)
}

/// The daemon's token variables for the environment level, read through `var` (the
/// process environment in `serve`): the non-empty ones of
/// [`copilot_pool::auth::ENV_TOKEN_VARIABLES`], as secrets. A value that is not UTF-8 is an
/// error (no token is).
pub fn env_tokens(
    var: impl Fn(&str) -> Option<std::ffi::OsString>,
) -> Result<std::collections::BTreeMap<String, Secret>> {
    let mut tokens = std::collections::BTreeMap::new();
    for name in copilot_pool::auth::ENV_TOKEN_VARIABLES {
        let Some(value) = var(name).filter(|v| !v.is_empty()) else {
            continue;
        };
        let Ok(value) = value.into_string() else {
            bail!(
                "{name} is not valid UTF-8; fix or unset it (it is read for [auth] env_fallback)"
            );
        };
        tokens.insert(name.to_owned(), Secret::new(value));
    }
    Ok(tokens)
}

/// A config file that holds the API token must be readable by its owner only, like a token
/// file.
fn refuse_shared_secret_file(path: &Path) -> Result<()> {
    use std::os::unix::fs::PermissionsExt;
    let shown = path.display();
    let mode = std::fs::metadata(path)
        .with_context(|| format!("reading the config file {shown}"))?
        .permissions()
        .mode()
        & 0o777;
    if mode & 0o044 != 0 {
        bail!(
            "the config file {shown} holds api_token and is readable by other users (mode \
             {mode:04o}); run `chmod 600 {shown}`, or move the token to --api-token-file or \
             COPILOT_POOL_API_TOKEN"
        );
    }
    Ok(())
}

/// Reads the API token from `path`: the file must be readable by its owner only (the token
/// is a credential), a trailing newline is not part of the token, and an empty token is
/// refused (it would open the API).
pub fn read_token_file(path: &Path) -> Result<Secret> {
    use std::os::unix::fs::PermissionsExt;
    let shown = path.display();
    let meta =
        std::fs::metadata(path).with_context(|| format!("reading the API token file {shown}"))?;
    if !meta.is_file() {
        bail!("the API token file {shown} is not a regular file");
    }
    let mode = meta.permissions().mode() & 0o777;
    if mode & 0o044 != 0 {
        bail!(
            "the API token file {shown} is readable by other users (mode {mode:04o}); run \
             `chmod 600 {shown}`"
        );
    }
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("reading the API token file {shown}"))?;
    let token = text
        .strip_suffix('\n')
        .map(|t| t.strip_suffix('\r').unwrap_or(t))
        .unwrap_or(&text);
    if token.is_empty() {
        bail!("the API token file {shown} is empty; write the token into it");
    }
    Ok(Secret::new(token.to_owned()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cli_backends_provider_ports_are_the_operators_and_443_by_default() {
        let default: ServeConfig = toml::from_str("").unwrap();
        let guard = default.pool_config("/bin/true".into()).unwrap().model_guard;
        assert_eq!(guard.cli_provider_ports, vec![443]);
        let listed: ServeConfig =
            toml::from_str("[model]\ncli_provider_ports = [443, 8443]\n").unwrap();
        let guard = listed.pool_config("/bin/true".into()).unwrap().model_guard;
        assert_eq!(guard.cli_provider_ports, vec![443, 8443]);
        let zero: ServeConfig = toml::from_str("[model]\ncli_provider_ports = [0]\n").unwrap();
        let refused = format!("{:#}", zero.pool_config("/bin/true".into()).unwrap_err());
        assert!(
            refused.contains("model.cli_provider_ports lists port 0"),
            "{refused}"
        );
    }

    #[test]
    fn a_config_file_that_holds_the_token_must_be_private() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("serve.toml");
        std::fs::write(&path, "api_token = \"s3cret-token\"\n").unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
        let refused = ServeConfig::load(Some(&path)).map(|_| ()).unwrap_err();
        let message = format!("{refused:#}");
        assert!(message.contains("chmod 600"), "{message}");
        assert!(!message.contains("s3cret-token"), "{message}");
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
        assert!(ServeConfig::load(Some(&path)).unwrap().api_token.is_some());
        // Without a token the file may be shared.
        std::fs::write(&path, "listen = \"127.0.0.1:9000\"\n").unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
        assert!(ServeConfig::load(Some(&path)).is_ok());
    }

    #[test]
    fn the_api_listens_on_a_unix_socket_only_with_a_token_and_never_on_the_sdk_endpoints() {
        let c: ServeConfig =
            toml::from_str("listen = \"unix:/run/copilot-pool/api.sock\"").unwrap();
        assert_eq!(
            c.listen,
            ListenAddress::Unix("/run/copilot-pool/api.sock".into())
        );
        let refused = format!("{:#}", c.validate().unwrap_err());
        assert!(
            refused.contains("API token") && refused.contains("--api-token-file"),
            "{refused}"
        );
        let with_token: ServeConfig =
            toml::from_str("listen = \"unix:/run/copilot-pool/api.sock\"\napi_token = \"t\"\n")
                .unwrap();
        with_token.validate().unwrap();
        // Neither shape of address parses: the error says which two it takes.
        let wrong = toml::from_str::<ServeConfig>("listen = \"api.sock\"").unwrap_err();
        assert!(
            wrong.to_string().contains("HOST:PORT nor unix:PATH"),
            "{wrong}"
        );
        // One address each.
        let hash = copilot_pool::sdk_endpoint::sha256_hex("t");
        let shared: ServeConfig = toml::from_str(&format!(
            "listen = \"unix:/run/a.sock\"\napi_token = \"t\"\n[sdk]\nlisten = \"unix:/run/a.sock\"\n\
             [[sdk.tokens]]\nagent = \"agent-a\"\nsha256 = \"{hash}\"\n"
        ))
        .unwrap();
        let refused = format!("{:#}", shared.validate().unwrap_err());
        assert!(refused.contains("an address each"), "{refused}");
        // A free port each is two addresses.
        let free: ServeConfig = toml::from_str(&format!(
            "listen = \"127.0.0.1:0\"\n[sdk]\nlisten = \"127.0.0.1:0\"\n\
             [[sdk.tokens]]\nagent = \"agent-a\"\nsha256 = \"{hash}\"\n"
        ))
        .unwrap();
        free.validate().unwrap();
        let same: ServeConfig = toml::from_str(&format!(
            "listen = \"127.0.0.1:7000\"\n[sdk]\nlisten = \"127.0.0.1:7000\"\n\
             [[sdk.tokens]]\nagent = \"agent-a\"\nsha256 = \"{hash}\"\n"
        ))
        .unwrap();
        assert!(same.validate().is_err());
    }

    #[test]
    fn the_sdk_endpoint_listens_on_tcp_or_a_unix_socket_and_needs_a_token_per_agent() {
        let hash = copilot_pool::sdk_endpoint::sha256_hex("t");
        let c: ServeConfig = toml::from_str(&format!(
            "[sdk]\nlisten = \"127.0.0.1:7879\"\n[[sdk.tokens]]\nagent = \"agent-a\"\nsha256 = \"{hash}\"\n"
        ))
        .unwrap();
        c.validate().unwrap();
        assert_eq!(
            c.sdk.listen().unwrap(),
            Some(ListenAddress::Tcp(([127, 0, 0, 1], 7879).into()))
        );
        assert_eq!(c.sdk.tokens().unwrap().agent_for("t"), Some("agent-a"));
        assert_eq!(
            "unix:/run/sdk.sock".parse::<ListenAddress>().unwrap(),
            ListenAddress::Unix("/run/sdk.sock".into())
        );
        assert!("unix:".parse::<ListenAddress>().is_err());
        assert!("sdk.sock".parse::<ListenAddress>().is_err());
        // Off by default; on without tokens every connect would fail: refused.
        assert_eq!(ServeConfig::default().sdk.listen().unwrap(), None);
        let mut bare = ServeConfig::default();
        bare.sdk.listen = Some("127.0.0.1:7879".into());
        let refused = format!("{:#}", bare.validate().unwrap_err());
        assert!(refused.contains("[[sdk.tokens]]"), "{refused}");
        let bad: ServeConfig = toml::from_str(
            "[sdk]\nlisten = \"127.0.0.1:7879\"\n[[sdk.tokens]]\nagent = \"agent-a\"\nsha256 = \"nope\"\n",
        )
        .unwrap();
        assert!(format!("{:#}", bad.validate().unwrap_err()).contains("sha256sum"));
        // Room for clients not authenticated yet: 64 by default, never none.
        assert_eq!(c.sdk.max_unauthenticated_connections, 64);
        let none: ServeConfig = toml::from_str(&format!(
            "[sdk]\nlisten = \"127.0.0.1:7879\"\nmax_unauthenticated_connections = 0\n[[sdk.tokens]]\nagent = \"agent-a\"\nsha256 = \"{hash}\"\n"
        ))
        .unwrap();
        let refused = format!("{:#}", none.validate().unwrap_err());
        assert!(
            refused.contains("max_unauthenticated_connections"),
            "{refused}"
        );
        // Each agent's connections: 64 by default, never none.
        assert_eq!(c.sdk.max_connections_per_agent, 64);
        let none: ServeConfig = toml::from_str(&format!(
            "[sdk]\nlisten = \"127.0.0.1:7879\"\nmax_connections_per_agent = 0\n[[sdk.tokens]]\nagent = \"agent-a\"\nsha256 = \"{hash}\"\n"
        ))
        .unwrap();
        let refused = format!("{:#}", none.validate().unwrap_err());
        assert!(refused.contains("max_connections_per_agent"), "{refused}");
        // Nor more than a semaphore holds (it panicked in the SDK endpoint's task).
        let huge: ServeConfig = toml::from_str(&format!(
            "[sdk]\nlisten = \"127.0.0.1:7879\"\nmax_connections = {}\n[[sdk.tokens]]\nagent = \"agent-a\"\nsha256 = \"{hash}\"\n",
            usize::MAX / 2
        ))
        .unwrap();
        let refused = format!("{:#}", huge.validate().unwrap_err());
        assert!(refused.contains("sdk.max_connections"), "{refused}");
    }

    #[test]
    fn warm_spares_and_packing_are_read_from_the_pool_section_and_checked() {
        let c: ServeConfig = toml::from_str(
            "[pool]\nwarm_spares = 2\nwarm_spare_window_secs = 90\nwarm_spare_conversations = 7\nbusy_leases_per_process = 4\ncpu_processes_per_key = 3\n",
        )
        .unwrap();
        c.validate().unwrap();
        let config = c.pool_config(PathBuf::from("/bin/true")).unwrap();
        assert_eq!(config.warm_spares, 2);
        assert_eq!(config.warm_spare_window, Duration::from_secs(90));
        assert_eq!(config.warm_spare_conversations, 7);
        assert_eq!(config.busy_leases_per_process, 4);
        assert_eq!(config.cpu_processes_per_key, 3);
        let derived: ServeConfig = toml::from_str("").unwrap();
        let config = derived.pool_config(PathBuf::from("/bin/true")).unwrap();
        assert!(config.cpu_processes_per_key >= 1, "derived from the cores");
        let bad: ServeConfig =
            toml::from_str("[pool]\nwarm_spares = 1\nwarm_spare_window_secs = 0\n").unwrap();
        assert!(format!("{:#}", bad.validate().unwrap_err()).contains("warm_spare_window_secs"));
        let bad: ServeConfig = toml::from_str("[pool]\ncpu_processes_per_key = 0\n").unwrap();
        assert!(format!("{:#}", bad.validate().unwrap_err()).contains("cpu_processes_per_key"));
    }

    #[test]
    fn the_health_settings_have_finite_defaults_reach_the_worker_and_are_checked() {
        let c = ServeConfig::default();
        c.validate().unwrap();
        let p = &c.pool;
        // A stopped runtime is found within misses x interval + timeout: 25 s.
        assert_eq!(
            p.health_interval_ms * u64::from(p.health_misses) + p.health_timeout_ms,
            25_000
        );
        let c: ServeConfig = toml::from_str(
            "[pool]\nhealth_interval_ms = 2000\nhealth_timeout_ms = 500\nhealth_misses = 3\n",
        )
        .unwrap();
        c.validate().unwrap();
        let worker = c.pool_config("/bin/true".into()).unwrap().worker;
        assert_eq!(worker.health_interval, Duration::from_secs(2));
        assert_eq!(worker.health_timeout, Duration::from_millis(500));
        assert_eq!(worker.health_misses, 3);
        for (text, says) in [
            ("health_misses = 0", "health_misses must be at least 1"),
            ("health_interval_ms = 0", "must be above 0"),
            ("health_timeout_ms = 0", "must be above 0"),
            (
                "health_interval_ms = 1000\nhealth_timeout_ms = 1000",
                "must be shorter than pool.health_interval_ms (1000)",
            ),
            ("health_interval_ms = 3600001", "at most 3600000"),
        ] {
            let bad: ServeConfig = toml::from_str(&format!("[pool]\n{text}\n")).unwrap();
            let error = bad.validate().expect_err(text).to_string();
            assert!(error.contains(says), "{text}: {error}");
        }
    }

    #[test]
    fn a_backends_env_merges_variable_by_variable_over_the_bundled_one() {
        let c: ServeConfig = toml::from_str(
            "[backends.google-gemini-cli]\nenv = { HTTPS_PROXY = \"http://proxy:3128\" }\n\
             [backends.codex-cli]\nargs = [\"exec\", \"--json\"]\n\
             [backends.claude-cli]\nenv = { CLAUDE_CODE_MAX_RETRIES = \"3\" }\n",
        )
        .unwrap();
        let pool = c.pool_config(PathBuf::from("/bin/true")).unwrap();
        let gemini = &pool.cli_backends["google-gemini-cli"].env;
        assert_eq!(gemini["HTTPS_PROXY"], "http://proxy:3128");
        assert_eq!(
            gemini["GEMINI_CLI_NO_RELAUNCH"], "true",
            "the bundled variable stays"
        );
        // The runner adds the safety switches the table does not name.
        let switches = copilot_pool::backend::SafetySwitches::GEMINI.env_for(gemini);
        assert_eq!(
            switches,
            [("GEMINI_CLI_TRUST_WORKSPACE".to_owned(), "false".to_owned())]
        );
        let codex = &pool.cli_backends["codex-cli"];
        let switches = copilot_pool::backend::SafetySwitches::CODEX.config_args_for(codex);
        assert!(
            switches.contains(&"analytics.enabled=false".to_owned()),
            "{switches:?}"
        );
        assert!(switches.contains(&"features.unbounded_connection_retries=false".to_owned()));
        // Naming the very variable is the one way to change a switch.
        let claude = &pool.cli_backends["claude-cli"].env;
        assert_eq!(claude["CLAUDE_CODE_MAX_RETRIES"], "3");
        assert_eq!(
            copilot_pool::backend::SafetySwitches::CLAUDE.env_for(claude),
            [(
                "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC".to_owned(),
                "1".to_owned()
            )]
        );
    }

    #[test]
    fn a_backends_table_overrides_the_bundled_default_and_a_new_id_needs_a_command() {
        let c: ServeConfig = toml::from_str(
            "[backends.claude-cli]\ncommand = \"/opt/claude\"\n\
             [backends.my-cli]\ncommand = \"my\"\nargs = [\"--json\"]\nsessionMode = \"none\"\n",
        )
        .unwrap();
        let pool = c.pool_config(PathBuf::from("/bin/true")).unwrap();
        let claude = &pool.cli_backends["claude-cli"];
        assert_eq!(claude.command, "/opt/claude");
        assert_eq!(
            claude.args,
            CliBackendConfig::claude_cli().args,
            "the bundled keys stay"
        );
        assert_eq!(pool.cli_backends["my-cli"].args, ["--json"]);
        // The bundled id is configured without a table too.
        let plain: ServeConfig = toml::from_str("").unwrap();
        let pool = plain.pool_config(PathBuf::from("/bin/true")).unwrap();
        assert!(pool.cli_backends.contains_key("claude-cli"));
        // A new id without a command, or an unknown key, is refused naming the table.
        for bad in [
            "[backends.x-cli]\nargs = []\n",
            "[backends.claude-cli]\ncomand = \"typo\"\n",
        ] {
            let c: ServeConfig = toml::from_str(bad).unwrap();
            let error = format!(
                "{:#}",
                c.pool_config(PathBuf::from("/bin/true")).unwrap_err()
            );
            assert!(error.contains("[backends."), "{error}");
        }
    }

    #[test]
    fn a_codex_table_written_for_the_prompt_as_an_argument_still_starts() {
        // Before the bundled Codex wrote its prompt to stdin, bounding the argument was right.
        let old = "[backends.codex-cli]\nmaxPromptArgChars = 50000\n";
        let c: ServeConfig = toml::from_str(old).unwrap();
        let pool = c.pool_config(PathBuf::from("/bin/true")).unwrap();
        let codex = &pool.cli_backends["codex-cli"];
        assert_eq!(codex.input, copilot_pool::backend::InputMode::Stdin);
        assert_eq!(codex.max_prompt_arg_chars, None, "ignored, with a warning");
        // Asking for the argument again keeps the bound.
        let arg = format!("{old}input = \"arg\"\n");
        let c: ServeConfig = toml::from_str(&arg).unwrap();
        let pool = c.pool_config(PathBuf::from("/bin/true")).unwrap();
        assert_eq!(
            pool.cli_backends["codex-cli"].max_prompt_arg_chars,
            Some(50_000)
        );
    }

    #[test]
    fn defaults_and_overrides() {
        let c: ServeConfig =
            toml::from_str("listen = \"127.0.0.1:9000\"\n[pool]\nmax_processes = 3\n").unwrap();
        assert_eq!(c.listen, ListenAddress::Tcp(([127, 0, 0, 1], 9000).into()));
        assert_eq!(c.pool.max_processes, 3);
        assert_eq!(c.pool.max_sessions_per_process, 32);
        assert_eq!(
            c.pool.warm_spares, 1,
            "a key with traffic keeps one spare unless told otherwise"
        );
        assert_eq!(c.max_body_bytes, 1 << 20);
        assert!(c.allowed_work_roots.is_empty() && !c.allow_local_mcp_servers);
        c.validate().unwrap();
    }

    #[test]
    fn work_roots_must_be_absolute_and_local_mcp_servers_are_opt_in() {
        let c: ServeConfig = toml::from_str(
            "allowed_work_roots = [\"/srv/repos\"]\nallow_local_mcp_servers = true\n",
        )
        .unwrap();
        assert_eq!(c.allowed_work_roots, [PathBuf::from("/srv/repos")]);
        assert!(c.allow_local_mcp_servers);
        c.validate().unwrap();
        let c: ServeConfig = toml::from_str("allowed_work_roots = [\"repos\"]").unwrap();
        let err = c.validate().unwrap_err().to_string();
        assert!(err.contains("absolute"), "{err}");
    }

    #[test]
    fn work_roots_attachment_limits_and_the_hook_timeout_are_read_and_checked() {
        let c: ServeConfig = toml::from_str(
            "allowed_work_roots = [\"/srv/repos\"]\n[attachments]\nmax_bytes = 2048\n\
             media_types = [\"Image/PNG\"]\n[turns]\nhook_secs = 5\n",
        )
        .unwrap();
        c.validate().unwrap();
        assert_eq!(c.allowed_work_roots, [PathBuf::from("/srv/repos")]);
        let limits = c.attachment_limits();
        assert_eq!(limits.max_bytes, 2048);
        assert_eq!(limits.media_types, ["image/png"]);
        assert_eq!(c.timeouts().hook, Duration::from_secs(5));
        assert_eq!(
            c.turns.max_unread_event_bytes,
            copilot_pool::turn::DEFAULT_MAX_UNREAD_EVENT_BYTES
        );
        let defaults = ServeConfig::default();
        assert_eq!(defaults.attachment_limits(), AttachmentLimits::default());
        assert_eq!(defaults.timeouts(), TurnTimeouts::default());
        for text in ["allowed_work_roots = [\"repos\"]", "[turns]\nhook_secs = 0"] {
            let c: ServeConfig = toml::from_str(text).unwrap();
            assert!(c.validate().is_err(), "{text}");
        }
        let c: ServeConfig = toml::from_str("[turns]\nmax_unread_event_bytes = 4194304").unwrap();
        c.validate().unwrap();
        assert_eq!(c.turns.max_unread_event_bytes, 4 << 20);
        let c: ServeConfig = toml::from_str("[turns]\nmax_unread_event_bytes = 268435456").unwrap();
        let err = c.validate().unwrap_err().to_string();
        assert!(err.contains("at most 134217728"), "{err}");
        let c: ServeConfig = toml::from_str("[turns]\nmax_unread_event_bytes = 65536").unwrap();
        let err = c.validate().unwrap_err().to_string();
        assert!(
            err.contains("turns.max_unread_event_bytes must be at least 1048576"),
            "{err}"
        );
    }

    #[test]
    fn a_zero_timeout_or_placement_cap_is_refused_naming_its_key() {
        for (text, key) in [
            ("[turns]\ninactivity_secs = 0", "turns.inactivity_secs"),
            ("[turns]\nabsolute_secs = 0", "turns.absolute_secs"),
            ("[turns]\ntool_secs = 0", "turns.tool_secs"),
            ("[turns]\npermission_secs = 0", "turns.permission_secs"),
            ("[turns]\nuser_input_secs = 0", "turns.user_input_secs"),
            (
                "[pool]\nmax_processes_per_key = 0",
                "pool.max_processes_per_key",
            ),
            ("[pool]\nmax_sessions = 0", "pool.max_sessions"),
            (
                "[pool]\nmax_turns_per_process = 0",
                "pool.max_turns_per_process",
            ),
        ] {
            let c: ServeConfig = toml::from_str(text).unwrap();
            let err = c.validate().expect_err(text).to_string();
            assert!(
                err.contains(key) && err.contains("above 0"),
                "{text}: {err}"
            );
        }
        // A zero queue or wait is a choice: a lease that must wait fails at once.
        let c: ServeConfig =
            toml::from_str("[pool]\nmax_waiters = 0\nwait_timeout_secs = 0").unwrap();
        c.validate().unwrap();
    }

    #[test]
    fn the_sdk_endpoint_shares_its_address_with_neither_the_api_nor_the_metrics() {
        let hash = copilot_pool::sdk_endpoint::sha256_hex("t");
        let tokens = format!("[[sdk.tokens]]\nagent = \"agent-a\"\nsha256 = \"{hash}\"\n");
        for (top, other) in [
            ("listen = \"127.0.0.1:7890\"\n", "listen"),
            ("metrics_listen = \"127.0.0.1:7890\"\n", "metrics_listen"),
        ] {
            let text = format!("{top}[sdk]\nlisten = \"127.0.0.1:7890\"\n{tokens}");
            let c: ServeConfig = toml::from_str(&text).unwrap();
            let err = format!("{:#}", c.validate().unwrap_err());
            assert!(
                err.contains(&format!("[sdk] listen and {other} are both")),
                "{err}"
            );
        }
    }

    #[test]
    fn a_huge_wait_or_a_memory_limit_below_a_fresh_runtime_is_refused_naming_its_key() {
        let huge = u64::MAX / 2;
        for key in [
            "drain_grace_secs",
            "idle_timeout_secs",
            "header_read_timeout_secs",
            "model.first_byte_timeout_secs",
            "pool.idle_ttl_secs",
            "turns.absolute_secs",
            "turns.hook_secs",
        ] {
            let text = match key.split_once('.') {
                Some((table, field)) => format!("[{table}]\n{field} = {huge}"),
                None => format!("{key} = {huge}"),
            };
            let c: ServeConfig = toml::from_str(&text).unwrap();
            let err = c.validate().expect_err(&text).to_string();
            assert!(
                err.contains(key) && err.contains("at most"),
                "{text}: {err}"
            );
        }
        let month: ServeConfig =
            toml::from_str(&format!("[turns]\nabsolute_secs = {MAX_SECS}")).unwrap();
        month.validate().unwrap();
        for bytes in [0u64, 100 << 20] {
            let c: ServeConfig =
                toml::from_str(&format!("[pool]\nmax_rss_bytes = {bytes}")).unwrap();
            let err = c.validate().expect_err("too low").to_string();
            assert!(err.contains("pool.max_rss_bytes"), "{err}");
        }
        let c: ServeConfig =
            toml::from_str(&format!("[pool]\nmax_rss_bytes = {MIN_MAX_RSS_BYTES}")).unwrap();
        c.validate().unwrap();
    }

    #[test]
    fn a_config_file_that_does_not_parse_is_refused_without_quoting_its_lines() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("serve.toml");
        // The token's key misspelled: its line must not reach the error (nor a log).
        std::fs::write(
            &path,
            "listen = \"127.0.0.1:7878\"\napi-token = \"s3cret-token\"\n",
        )
        .unwrap();
        let err = format!("{:#}", ServeConfig::load(Some(&path)).unwrap_err());
        assert!(!err.contains("s3cret"), "{err}");
        assert!(
            err.contains("line 2, column 1") && err.contains("api-token"),
            "{err}"
        );
        // A token written unquoted: toml's message would quote the integer.
        std::fs::write(&path, "api_token = 73518264090\n").unwrap();
        let err = format!("{:#}", ServeConfig::load(Some(&path)).unwrap_err());
        assert!(!err.contains("7351826"), "{err}");
        assert!(err.contains("expected a string"), "{err}");
    }

    #[test]
    fn unknown_fields_and_open_listeners_are_refused() {
        let err = toml::from_str::<ServeConfig>("lisen = \"127.0.0.1:1\"")
            .unwrap_err()
            .to_string();
        assert!(err.contains("lisen"), "{err}");
        let c: ServeConfig = toml::from_str("listen = \"0.0.0.0:7878\"").unwrap();
        let err = c.validate().unwrap_err().to_string();
        assert!(err.contains("API token"), "{err}");
    }

    #[test]
    fn the_auth_fallbacks_are_off_by_default_and_the_env_level_reads_only_non_empty_token_variables()
     {
        let c = ServeConfig::default();
        assert!(!c.auth.env_fallback && !c.auth.allow_logged_in_user);
        let c: ServeConfig =
            toml::from_str("[auth]\nenv_fallback = true\nallow_logged_in_user = true\n").unwrap();
        assert!(c.auth.env_fallback && c.auth.allow_logged_in_user);
        let err = toml::from_str::<ServeConfig>("[auth]\nenv_fallbak = true\n")
            .unwrap_err()
            .to_string();
        assert!(err.contains("env_fallbak"), "{err}");

        let env = |name: &str| match name {
            "GH_TOKEN" => Some("ghu_gh".into()),
            "COPILOT_GITHUB_TOKEN" => Some("".into()),
            "GITHUB_TOKEN" => Some("ghu_github".into()),
            "UNRELATED_TOKEN" => Some("x".into()),
            _ => None,
        };
        let tokens = env_tokens(env).unwrap();
        let seen: Vec<(&str, &str)> = tokens
            .iter()
            .map(|(k, v)| (k.as_str(), v.expose()))
            .collect();
        assert_eq!(
            seen,
            [("GH_TOKEN", "ghu_gh"), ("GITHUB_TOKEN", "ghu_github")]
        );
        assert!(!format!("{tokens:?}").contains("ghu_gh"));
        use std::os::unix::ffi::OsStringExt;
        let bad =
            |name: &str| (name == "GH_TOKEN").then(|| std::ffi::OsString::from_vec(vec![0xff]));
        let err = env_tokens(bad).unwrap_err().to_string();
        assert!(err.contains("GH_TOKEN") && err.contains("UTF-8"), "{err}");
    }

    #[test]
    fn sandboxed_tools_listen_on_an_ephemeral_port_unless_fixed_ports_or_any_are_configured() {
        assert_eq!(
            ServeConfig::default().sandbox_tcp_bind.ports(),
            Some(&[][..])
        );
        let c: ServeConfig = toml::from_str("sandbox_tcp_bind = [3000, 5173]").unwrap();
        assert_eq!(c.sandbox_tcp_bind.ports(), Some(&[3000, 5173][..]));
        let c: ServeConfig = toml::from_str("sandbox_tcp_bind = \"any\"").unwrap();
        assert_eq!(c.sandbox_tcp_bind.ports(), None);
        for text in ["sandbox_tcp_bind = \"all\"", "sandbox_tcp_bind = [70000]"] {
            let error = toml::from_str::<ServeConfig>(text).unwrap_err().to_string();
            assert!(error.contains("a list of ports"), "{text}: {error}");
        }
    }

    #[test]
    fn the_daemon_runs_one_async_thread_per_eight_cpus_unless_told_and_zero_is_refused() {
        assert_eq!(
            [1, 2, 7, 8, 15, 16, 64].map(default_worker_threads),
            [1, 1, 1, 1, 1, 2, 8]
        );
        assert_eq!(ServeConfig::default().worker_threads, None);
        let c: ServeConfig = toml::from_str("worker_threads = 3").unwrap();
        assert_eq!(c.worker_threads, Some(3));
        c.validate().unwrap();
        for text in ["worker_threads = 0", "worker_threads = 1025"] {
            let c: ServeConfig = toml::from_str(text).unwrap();
            let error = c.validate().unwrap_err().to_string();
            assert!(
                error.contains("worker_threads must be 1 to 1024"),
                "{error}"
            );
        }
    }

    #[test]
    fn connection_limits_are_finite_by_default_and_zero_is_refused() {
        let c = ServeConfig::default();
        assert_eq!(c.header_read_timeout(), Duration::from_secs(30));
        assert_eq!(c.idle_timeout(), Duration::from_secs(10));
        assert_eq!(c.max_connections, 4096);
        for text in [
            "header_read_timeout_secs = 0",
            "idle_timeout_secs = 0",
            "max_connections = 0",
            "max_connections = 2000000",
        ] {
            let c: ServeConfig = toml::from_str(text).unwrap();
            assert!(c.validate().is_err(), "{text}");
        }
    }

    #[test]
    fn a_token_file_must_be_private_and_not_empty() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("token");
        std::fs::write(&path, "abc\r\n").unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o640)).unwrap();
        let err = read_token_file(&path).unwrap_err().to_string();
        assert!(
            err.contains(&format!("chmod 600 {}", path.display())),
            "{err}"
        );
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
        assert_eq!(read_token_file(&path).unwrap().expose(), "abc");
        std::fs::write(&path, "").unwrap();
        assert!(
            read_token_file(&path)
                .unwrap_err()
                .to_string()
                .contains("empty")
        );
    }
}
