//! What a pool is started with, and what one lease asks for.
//!
//! Every cap and timeout has a finite default, chosen from the measurements in
//! `packing-study.md` (see the field docs).

use std::path::PathBuf;
use std::time::Duration;

use crate::auth::LeaseAuth;
use crate::faults::SharedDiskFaults;
use crate::ids::CliSessionId;
use crate::kinds::ReasoningEffort;
use crate::model_guard::{ModelGuard, ModelGuardConfig};
use crate::rpc::messages::{ProviderConfig, SessionConfig};
use crate::session_options::SessionOptions;
use crate::turn::TurnHandlers;
use crate::worker::WorkerConfig;

use super::PoolError;
use super::restart::RestartPolicy;

/// Pool-wide settings.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct PoolConfig {
    /// Template for every worker: program, timeouts, environment, tunnel. Its
    /// `copilot_home`, `working_directory` and `auth_token` are set per key.
    pub worker: WorkerConfig,
    /// Where durable bindings live (`<state_dir>/bindings`, and the CLI backends' in
    /// `<state_dir>/cli-bindings`).
    pub state_dir: PathBuf,
    /// Base of per-agent homes: `<base>/agents/<agent_id>/copilot`.
    pub agents_base_dir: PathBuf,
    /// Live processes in the pool (default 64), of every backend together: Copilot workers
    /// and CLI backend processes share this one budget.
    pub max_processes: usize,
    /// Processes per key (default 4).
    pub max_processes_per_key: usize,
    /// Conversations attached to one process (default 32). A key fills one process up to
    /// this before it starts another (unless its processes are CPU-bound, below): a second
    /// process costs a cold start and ~105 MiB, the price of ~27 conversations after a turn
    /// (+3.9 MiB each, packing study §0), and 32 conversations in one process turn as fast
    /// as over four at ~1 turn/s each (p50 25 ms either way, §6). 32 conversations of 30
    /// turns stay near 0.8 GiB, under `max_rss_bytes`. Keep the `cli` flavour well below
    /// 128: it opens one inotify instance per session and the default per-user limit
    /// (`fs.inotify.max_user_instances`) is 128 for all processes of the user together.
    pub max_sessions_per_process: usize,
    /// A process running this many leases at once counts as busy (default 8: at 8 streaming
    /// conversations one runtime process is saturated at 151–166 % CPU, packing study §5). A
    /// key whose processes with conversations are all busy brings one more into play (its
    /// spare, or a start) while it runs fewer than `cpu_processes_per_key` of them.
    pub busy_leases_per_process: usize,
    /// Processes of one key worth running for CPU (default: two thirds of the machine's
    /// cores, at least 1; one saturated runtime process uses ~1.5 cores). Beyond them a key
    /// starts another process only when its processes are full.
    pub cpu_processes_per_key: usize,
    /// Warm spares per key (default 1; 0 turns them off): empty, started processes kept for a
    /// key that had a conversation lease within `warm_spare_window`, so a lease that finds no
    /// process (its key's idled out, was recycled or replaced) takes one at once instead of
    /// waiting for a start and handshake. None stands beside a process of the key that serves
    /// conversations, unless all are full and the key outgrew them within the window (a
    /// conversation found them full). A spare counts in `max_processes` and
    /// `max_processes_per_key`, is never started by stopping another worker, and is the first
    /// stopped when the pool needs room. A key never leased gets none; a spare is started
    /// once its key is quiet (no lease running) and none of its evicted processes is still
    /// stopping.
    pub warm_spares: usize,
    /// How long after a key's last conversation lease its spares are kept (default 10 min);
    /// then they are stopped.
    pub warm_spare_window: Duration,
    /// Conversations a warm spare resumes ahead of their return (default 32; a spare takes
    /// at most `max_sessions_per_process` − 1 of them, 31 by default, one slot left free):
    /// the key's most recently leased ones that are attached nowhere (their process idled
    /// out, was recycled or replaced), so a returning agent's turn starts on an attached
    /// session instead of waiting for a resume, whichever of its conversations it comes back
    /// to. Each costs the runtime's memory of a resumed conversation (~2 MiB, runtime 1.0.85;
    /// the spare stays smaller than the process that held them); 0 turns it off. Only with
    /// `warm_spares`.
    pub warm_spare_conversations: usize,
    /// Conversations attached in the whole pool (default 1024).
    pub max_sessions: usize,
    /// Leases waiting for capacity (default 1024); more fail with `WaitersFull`.
    pub max_waiters: usize,
    /// Leases of one agent (its home) waiting at once (default 256); more fail with
    /// `AgentWaitersFull`, so one agent's flood cannot take every place in the queue and
    /// leave the other agents' leases refused.
    pub max_waiters_per_agent: usize,
    /// Conversations of one agent (its home, every credential of it) leased at once, turns
    /// running on the Copilot runtime (default `None`: no cap). A multi-tenant pool sets it
    /// below `max_processes`: each lease of another credential, model or provider can hold
    /// a process of its own, so one agent with long turns could otherwise take every
    /// process while the others' leases wait and fail. Past it the agent's next lease waits
    /// (queued, within `max_waiters_per_agent`) for one of its own to return, and fails
    /// after its wait with `AgentLeasesFull`; other agents' leases are granted meanwhile.
    /// It counts turns, not processes (a process runs up to `busy_leases_per_process` of
    /// them). A deletion's lease ([`Pool::lease_to_delete`](super::Pool)) or a lease of a
    /// process alone (the SDK endpoint's `session.list`) is neither counted nor held back.
    pub max_leases_per_agent: Option<usize>,
    /// Conversations one agent keeps on the Copilot runtime, stored (bound) or being opened
    /// (default `None`: no cap). Each keeps its session state in the agent's home and a
    /// binding in the state directory until it is deleted, so without a cap one agent's
    /// conversations can fill the disk the others share. Past it a lease that would start a
    /// new conversation of the agent fails at once with `AgentConversationsFull` (its
    /// existing conversations go on); deleting one frees its place. Set, the pool reads every
    /// binding once at start to count them.
    pub max_conversations_per_agent: Option<usize>,
    /// How long a lease waits for capacity or for its conversation (default 30 s).
    pub wait_timeout: Duration,
    /// A worker with no lease for this long is stopped (default 5 min).
    pub idle_ttl: Duration,
    /// Recycle a process after at most this many turns (default 2,000). Runtime 1.0.85 keeps
    /// 0.2–0.6 MiB per turn that detach and delete never return (packing-study §7), so 2,000
    /// turns bound the growth to roughly +0.4–1.2 GiB before the process is replaced. Each
    /// process has its own limit between 80 % and 100 % of this, fixed at its start, so the
    /// processes of an evenly loaded pool do not all drain and restart at once.
    pub max_turns_per_process: u64,
    /// Recycle a process whose resident memory exceeds this (default 1 GiB: a base of
    /// ~105 MiB plus 16 conversations at ~5 MiB leaves ample room for the leak above).
    pub max_rss_bytes: u64,
    /// A draining process (rotation, recycling) is stopped after this even with leases.
    pub drain_grace: Duration,
    /// On shutdown, running turns get this long to finish before they are aborted.
    pub shutdown_grace: Duration,
    /// Crash restart backoff and intensity.
    pub restart: RestartPolicy,
    /// How often idle, lifetime and memory limits are checked (default 1 s; zero is refused
    /// by `Pool::start`).
    pub maintenance_interval: Duration,
    /// The runtime's `infiniteSessions` settings, passed to every session as they are.
    pub infinite_sessions: Option<InfiniteSessions>,
    /// An aborted turn (a timeout, or a lease dropped with a turn running) gets this long
    /// to reach `session.idle` (default 10 s). A turn that does not settle in time leaves
    /// its process in an unknown state: that process is stopped before the conversation is
    /// granted anywhere else.
    pub abort_settle_timeout: Duration,
    /// A conversation whose resume crashed the runtime this many times in a row, the last
    /// within ten minutes, starts a new session (`resume-failed`) instead of crashing it
    /// again (default 2); a session the caller pinned is refused meanwhile
    /// ([`PoolError::ResumeCrashedRepeatedly`](super::PoolError::ResumeCrashedRepeatedly)).
    pub max_resume_crashes: u32,
    /// The guarded model path of BYOK workers: `allow_private_endpoints` (default off),
    /// extra CAs, the request body limit and the connect, first-byte and idle timeouts.
    pub model_guard: ModelGuardConfig,
    /// The CLI backends leases may name besides `copilot`, by id (default: the bundled
    /// `claude-cli`, running `claude` from `PATH`). Their processes count in the same
    /// `max_processes` as the Copilot workers (one budget: when it is full, a lease of either
    /// kind stops the oldest idle process of either kind, or waits), and in
    /// `max_processes_per_key` per key of their own (agent home, credential, backend id),
    /// with the same waiters cap, wait timeout, restart policy and idle TTL.
    pub cli_backends: std::collections::BTreeMap<String, crate::backend::CliBackendConfig>,
    /// Binding writes to fail on purpose, as a failing disk would (chaos runs; default none).
    /// Transcript writes take theirs from [`crate::TranscriptSettings::with_disk_faults`].
    pub disk_faults: Option<SharedDiskFaults>,
}

/// The runtime's automatic context management (`infiniteSessions` on the wire).
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub struct InfiniteSessions {
    /// Compact automatically.
    pub enabled: bool,
    /// Start a background compaction at this share of the context window (runtime: 0.80).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub background_compaction_threshold: Option<f64>,
    /// Block and compact at this share (runtime: 0.95).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub buffer_exhaustion_threshold: Option<f64>,
}

impl PoolConfig {
    /// A config with the defaults above, spawning `worker.program`.
    pub fn new(worker: WorkerConfig, state_dir: PathBuf, agents_base_dir: PathBuf) -> Self {
        Self {
            worker,
            state_dir,
            agents_base_dir,
            max_processes: 64,
            max_processes_per_key: 4,
            max_sessions_per_process: 32,
            busy_leases_per_process: 8,
            cpu_processes_per_key: super::placement::cpu_processes_for(
                std::thread::available_parallelism().map_or(1, |n| n.get()),
            ),
            warm_spares: 1,
            warm_spare_window: Duration::from_secs(600),
            warm_spare_conversations: 32,
            max_sessions: 1024,
            max_waiters: 1024,
            max_waiters_per_agent: 256,
            max_leases_per_agent: None,
            max_conversations_per_agent: None,
            wait_timeout: Duration::from_secs(30),
            idle_ttl: Duration::from_secs(300),
            max_turns_per_process: 2000,
            max_rss_bytes: 1 << 30,
            drain_grace: Duration::from_secs(60),
            shutdown_grace: Duration::from_secs(10),
            restart: RestartPolicy::default(),
            maintenance_interval: Duration::from_secs(1),
            infinite_sessions: None,
            abort_settle_timeout: Duration::from_secs(10),
            max_resume_crashes: 2,
            model_guard: ModelGuardConfig::default(),
            disk_faults: None,
            cli_backends: std::collections::BTreeMap::from([(
                "claude-cli".to_owned(),
                crate::backend::CliBackendConfig::claude_cli(),
            )]),
        }
    }

    /// Checks what [`Pool::start`](super::Pool::start) would refuse, without starting
    /// anything (no process, no store opened): a zero that would stop the pool from working,
    /// the model guard's settings (its extra root certificates parsed), every CLI backend.
    /// `copilot-pool doctor` runs it; the error names the setting and the fix.
    pub fn check(&self) -> Result<(), PoolError> {
        self.checked().map(drop)
    }

    /// [`PoolConfig::check`], keeping the model guard it built.
    pub(super) fn checked(&self) -> Result<ModelGuard, PoolError> {
        let invalid = |message: &str| Err(PoolError::InvalidRequest(message.to_owned()));
        // A zero cap does not turn the cap off: no lease would ever be placed.
        let zero = [
            ("max_processes", self.max_processes == 0),
            ("max_processes_per_key", self.max_processes_per_key == 0),
            (
                "max_sessions_per_process",
                self.max_sessions_per_process == 0,
            ),
            ("max_sessions", self.max_sessions == 0),
            ("busy_leases_per_process", self.busy_leases_per_process == 0),
            ("cpu_processes_per_key", self.cpu_processes_per_key == 0),
        ];
        if let Some((field, _)) = zero.iter().find(|(_, is_zero)| *is_zero) {
            return Err(PoolError::InvalidRequest(format!(
                "{field} must be at least 1 (a zero does not turn the cap off: no lease would \
                 ever be placed); leave it at its default"
            )));
        }
        if self.max_conversations_per_agent == Some(0) {
            return invalid(
                "max_conversations_per_agent must be at least 1 (with 0 no agent could start a \
                 conversation); leave it unset for no cap",
            );
        }
        if self.max_leases_per_agent == Some(0) {
            return invalid(
                "max_leases_per_agent must be at least 1 (with 0 no agent could run a turn); \
                 leave it unset for no cap",
            );
        }
        if self.max_waiters_per_agent == 0 {
            return invalid(
                "max_waiters_per_agent must be at least 1 (with 0 no lease of any agent could \
                 wait for capacity); the default is 256",
            );
        }
        if self.maintenance_interval.is_zero() {
            return invalid(
                "maintenance_interval must be more than zero (with 0 the pool would never evict \
                 idle processes, recycle them, nor prune its keys); the default is 1s",
            );
        }
        if self.max_resume_crashes == 0 {
            return invalid(
                "max_resume_crashes must be at least 1 (with 0 no conversation would ever be \
                 resumed); the default is 2",
            );
        }
        for (id, config) in &self.cli_backends {
            if id == super::cli::COPILOT_BACKEND {
                return Err(PoolError::InvalidRequest(format!(
                    "backend id `{id}` is the Copilot runtime's own; name the CLI backend \
                     otherwise (e.g. `claude-cli`)"
                )));
            }
            config
                .validate(id)
                .map_err(|e| PoolError::InvalidRequest(e.to_string()))?;
        }
        ModelGuard::new(self.model_guard.clone())
            .map_err(|e| PoolError::InvalidRequest(e.to_string()))
    }
}

/// What one lease asks for.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct LeaseRequest {
    /// The agent (`^[a-z0-9][a-z0-9_-]{0,63}$`); names its default COPILOT_HOME.
    pub agent_id: String,
    /// The gateway's conversation key; bound durably to a CLI session id.
    pub session_key: String,
    /// Credentials; see [`crate::auth::resolve`] for the precedence.
    pub auth: LeaseAuth,
    /// Explicit COPILOT_HOME (wins over `agent_dir`).
    pub copilot_home: Option<PathBuf>,
    /// The agent's directory (`<agent_dir>/copilot` is the home).
    pub agent_dir: Option<PathBuf>,
    /// Model id.
    pub model: Option<String>,
    /// How hard the model thinks (the runtime's default when `None`).
    pub reasoning_effort: Option<ReasoningEffort>,
    /// BYOK provider (sent on create and on every resume).
    pub provider: Option<ProviderConfig>,
    /// The conversation's working directory.
    pub working_directory: PathBuf,
    /// Stream deltas.
    pub streaming: bool,
    /// Allow-list of tools for new sessions (`None`: the runtime's defaults).
    pub available_tools: Option<Vec<String>>,
    /// The runtime's own `session.create`/`session.resume` fields beyond the ones above
    /// (system message, excluded tools, custom agents, MCP servers, …; see
    /// [`SessionOptions`]), merged into the params of every open; the pool's own fields win.
    /// The fields this request has a field for (`model`, `reasoningEffort`,
    /// `workingDirectory`, `streaming`, `availableTools`) are moved onto it by the lease
    /// ([`LeaseRequest::apply_session_options`]). The fields that change what a stored
    /// conversation means take part in its compat key: changing them starts a new session.
    pub session_options: SessionOptions,
    /// Fail at once with `ConversationBusy` instead of queueing behind a running turn.
    pub fail_if_busy: bool,
    /// Overrides the pool's `wait_timeout` for this lease.
    pub wait_timeout: Option<Duration>,
    /// Only continue an existing conversation (attached or resumable with these settings);
    /// never start a new CLI session. For operations like compact or reset.
    pub existing_only: bool,
    /// The lease runs no turn (a compact, a reset): a session parked with other tools or
    /// handlers (those its turns opened it with) is used as it is, not detached and resumed
    /// to match this lease's, which would cost a resume now and another at the next turn.
    pub runs_no_turn: bool,
    /// Tools, permission policy, ask_user, hooks, timeouts and the transcript mirror.
    pub handlers: TurnHandlers,
    /// The session's config as a client put it on the wire (the SDK endpoint passes its
    /// client's `session.create`/`session.resume` params): sent as it is on create and on
    /// every resume, instead of the one built from the fields above. The pool key still
    /// comes from `auth`, `provider` and `model`, which the caller fills from it.
    pub wire_config: Option<SessionConfig>,
    /// The CLI session id this conversation runs under, chosen by the caller (the SDK
    /// endpoint: the SDK's own session id). A new session is created with this id; a stored
    /// session of this id under the agent's home is resumed whatever its binding says.
    pub cli_session_id: Option<CliSessionId>,
    /// The backend holding the conversation: `copilot` (the default, [`super::Pool::lease`])
    /// or a configured CLI backend id ([`super::Pool::lease_cli`]). Each backend keeps its
    /// own session of the conversation.
    pub backend: String,
}

impl LeaseRequest {
    /// A request with defaults: no explicit home, no provider, streaming on, queue when busy.
    pub fn new(
        agent_id: impl Into<String>,
        session_key: impl Into<String>,
        working_directory: PathBuf,
    ) -> Self {
        Self {
            agent_id: agent_id.into(),
            session_key: session_key.into(),
            auth: LeaseAuth::default(),
            copilot_home: None,
            agent_dir: None,
            model: None,
            reasoning_effort: None,
            provider: None,
            working_directory,
            streaming: true,
            available_tools: None,
            session_options: SessionOptions::new(),
            fail_if_busy: false,
            wait_timeout: None,
            existing_only: false,
            runs_no_turn: false,
            handlers: TurnHandlers::default(),
            wire_config: None,
            cli_session_id: None,
            backend: super::cli::COPILOT_BACKEND.to_owned(),
        }
    }
}

impl LeaseRequest {
    /// Adds `options` to this request (checked first): the fields the request has its own
    /// field for move onto it (`model`, `reasoningEffort`, `availableTools`: refused when
    /// the request already has another value; `workingDirectory` and `streaming` replace the
    /// request's), the rest join [`LeaseRequest::session_options`] (a field set twice takes
    /// the later value). The lease applies its own `session_options` this way too.
    pub fn apply_session_options(
        &mut self,
        mut options: SessionOptions,
    ) -> Result<(), super::PoolError> {
        options.validate()?;
        if let Some(value) = options.remove("model") {
            let model = string_field("model", value)?;
            agree("model", self.model.as_ref(), &model)?;
            self.model = Some(model);
        }
        if let Some(value) = options.remove("reasoningEffort") {
            let effort = string_field("reasoningEffort", value)?;
            let effort: ReasoningEffort = effort
                .parse()
                .map_err(|e| invalid(format!("session.reasoningEffort: {e}")))?;
            agree("reasoningEffort", self.reasoning_effort.as_ref(), &effort)?;
            self.reasoning_effort = Some(effort);
        }
        if let Some(value) = options.remove("availableTools") {
            let tools: Vec<String> = serde_json::from_value(value)
                .map_err(|e| invalid(format!("session.availableTools: {e}")))?;
            agree("availableTools", self.available_tools.as_ref(), &tools)?;
            self.available_tools = Some(tools);
        }
        if let Some(value) = options.remove("workingDirectory") {
            self.working_directory = PathBuf::from(string_field("workingDirectory", value)?);
        }
        if let Some(value) = options.remove("streaming") {
            self.streaming = value
                .as_bool()
                .ok_or_else(|| invalid("session.streaming must be a boolean".to_owned()))?;
        }
        self.session_options.extend(options)?;
        Ok(())
    }
}

fn invalid(message: String) -> super::PoolError {
    super::PoolError::InvalidRequest(message)
}

fn string_field(field: &str, value: serde_json::Value) -> Result<String, super::PoolError> {
    match value {
        serde_json::Value::String(s) => Ok(s),
        _ => Err(invalid(format!("session.{field} must be a string"))),
    }
}

/// A field given both on the request and in its session options must agree.
fn agree<T: PartialEq + std::fmt::Debug>(
    field: &str,
    current: Option<&T>,
    new: &T,
) -> Result<(), super::PoolError> {
    match current {
        Some(current) if current != new => Err(invalid(format!(
            "session.{field} ({new:?}) differs from the request's own {field} ({current:?}); \
             set it in one place"
        ))),
        _ => Ok(()),
    }
}

/// The longest gateway session key a lease accepts.
pub const MAX_SESSION_KEY_BYTES: usize = 512;

/// How many conversations a warm spare resumes ahead of their return at most: every slot of
/// its process but one (`max_sessions_per_process` - 1), which stays free for a cold
/// conversation; `warm_spare_conversations` and the key's remembered conversations bound it
/// further.
pub fn spare_room(max_sessions_per_process: usize) -> usize {
    max_sessions_per_process.saturating_sub(1)
}

/// Checks a gateway session key: 1 to 512 bytes. The pool checks every lease's key with it;
/// the daemon checks a request's key with it before it creates anything.
pub fn validate_session_key(session_key: &str) -> Result<(), super::PoolError> {
    if session_key.is_empty() || session_key.len() > MAX_SESSION_KEY_BYTES {
        return Err(super::PoolError::InvalidRequest(format!(
            "session_key must be 1 to {MAX_SESSION_KEY_BYTES} bytes (it has {}); use a shorter \
             key, such as a hash of the gateway's own",
            session_key.len()
        )));
    }
    Ok(())
}

/// Checks a BYOK provider before anything runs with it: its shape
/// ([`crate::provider::check_shape`]: fields that fit its type, headers, keys, model names,
/// limits) and its base URL. (Its type and wire API are enums, checked where they are
/// parsed.) The pool checks every lease's provider with it; the daemon checks a request's
/// provider with it before it creates anything, so both give the same errors.
pub fn validate_provider(provider: &ProviderConfig) -> Result<(), super::PoolError> {
    crate::provider::check_shape(provider)
        .map_err(|e| super::PoolError::InvalidRequest(e.to_string()))?;
    if !(provider.base_url.starts_with("http://") || provider.base_url.starts_with("https://")) {
        return Err(super::PoolError::InvalidRequest(
            "provider.base_url must be an http(s) URL".to_owned(),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_zero_cap_is_refused_by_name_before_anything_starts() {
        let config = || {
            let worker = WorkerConfig::new("copilot".into(), PathBuf::new(), PathBuf::new());
            PoolConfig::new(worker, PathBuf::from("/state"), PathBuf::from("/agents"))
        };
        assert!(config().check().is_ok());
        type Zero = fn(&mut PoolConfig);
        let zeroes: [(&str, Zero); 6] = [
            ("max_processes", |c| c.max_processes = 0),
            ("max_processes_per_key", |c| c.max_processes_per_key = 0),
            ("max_sessions_per_process", |c| {
                c.max_sessions_per_process = 0
            }),
            ("max_sessions", |c| c.max_sessions = 0),
            ("busy_leases_per_process", |c| c.busy_leases_per_process = 0),
            ("cpu_processes_per_key", |c| c.cpu_processes_per_key = 0),
        ];
        for (field, zero) in zeroes {
            let mut c = config();
            zero(&mut c);
            let refused = c.check().expect_err(field).to_string();
            assert!(
                refused.contains(&format!("{field} must be at least 1")),
                "{refused}"
            );
        }
    }

    use super::*;

    #[test]
    fn a_session_key_is_one_to_512_bytes() {
        assert!(validate_session_key("k").is_ok());
        assert!(validate_session_key(&"k".repeat(512)).is_ok());
        let long = validate_session_key(&"k".repeat(513))
            .unwrap_err()
            .to_string();
        assert!(long.contains("513"), "{long}");
        assert!(validate_session_key("").is_err());
    }

    #[test]
    fn a_session_key_may_hold_what_names_a_cli_conversations_binding() {
        // The CLI backends' bindings (`agent/alice#backend=claude-cli`) are a store of their
        // own: this key names a Copilot conversation only.
        assert!(validate_session_key("alice#backend=claude-cli").is_ok());
        assert!(validate_session_key("a=b#c").is_ok());
    }

    #[test]
    fn a_provider_with_an_unknown_type_wire_api_or_url_scheme_is_refused_with_the_field() {
        let good = ProviderConfig::openai("https://models.example/v1", None);
        assert!(validate_provider(&good).is_ok());
        // Type and wire API cannot hold an unknown value: reading one fails.
        let wire = |field: &str, value: &str| {
            let mut json = serde_json::to_value(&good).unwrap();
            json[field] = value.into();
            serde_json::from_value::<ProviderConfig>(json)
                .unwrap_err()
                .to_string()
        };
        assert!(wire("type", "gemini").contains("provider.type \"gemini\""));
        assert!(wire("wireApi", "chat").contains("provider.wire_api \"chat\""));
        let mut bad = good;
        bad.base_url = "file:///etc/passwd".into();
        assert!(
            validate_provider(&bad)
                .unwrap_err()
                .to_string()
                .contains("provider.base_url")
        );
    }
}
