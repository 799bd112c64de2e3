//! CLI backends under the pool (issue 17, items 1 and 4): leases of conversations held by
//! other agent CLIs ([`CliLease`]), with the pool's caps, FIFO waiters, restart intensity,
//! durable bindings, metrics and shutdown.
//!
//! * `slots` — the pure core: slots, caps, waiters, LRU victims, quarantine.
//! * `session` — the pure session rules: identity, credential, resume / fresh /
//!   `transcript-missing`.
//! * this module — the thin shell: a mutex around the core (never held across an await),
//!   the parked [`CliConversation`]s, the waiters' reply ports, the binding reads and
//!   writes, closing processes the core names. The same mutex guards the shared process
//!   budget ([`super::budget`]): the pool actor takes it ([`CliPool::budget`]) around each of
//!   its placement decisions, tells the core how many Copilot processes there are, and
//!   closes a parked CLI process when its side needs the room; this side asks the actor
//!   (a [`Nudge`]) for an idle Copilot worker, and wakes its waiters when room comes free.
//!
//! A conversation is (agent, session key, backend id): its CLI session id is bound under
//! `<agent>/<session key>#backend=<id>` in the CLI backends' binding store
//! (`<state_dir>/cli-bindings`, [`open_bindings`]: apart from the Copilot runtime's, so no
//! session key can name the other's binding), with its auth identity as the compat key.

pub(crate) mod options;
pub(crate) mod session;
pub(crate) mod slots;

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use tokio::sync::{oneshot, watch};

use crate::backend::claude_live::{ClaudeLive, ClaudeLiveConfig};
use crate::backend::oneshot::{
    Dialect, Oneshot, OneshotConfig, codex_rollout_path, codex_rollout_totals,
};
use crate::backend::{
    AbortHandle, BackendEvent, BackendKind, CliBackendConfig, CliConversation, CliStartError,
    CliTurn, CliTurnOutcome, TurnFailure,
};
use crate::ids::CliSessionId;
use crate::kinds::{Eviction, OpenReason, TurnEnd};
use crate::metrics::{ProcessExit, SpawnResult};
use crate::permission::PermissionPolicy;

use super::WhileHeld;
use super::bindings::{Binding, BindingError, BindingStore};
use super::budget::{Nudge, Others};
use super::error::PoolError;
use super::restart::RestartPolicy;
use session::{CliCredentials, SessionDecision, StoredSession};
use slots::{Caps, CliKey, Effect, Kept, Refusal, Slots};

/// The backend id of the Copilot runtime (the pool's workers).
pub const COPILOT_BACKEND: &str = "copilot";

/// What a CLI lease asks for (built by [`super::Pool::lease_cli`] from a `LeaseRequest`).
pub(crate) struct CliAsk {
    pub backend: String,
    pub conversation: String,
    pub home: PathBuf,
    pub cwd: PathBuf,
    pub creds: CliCredentials,
    pub model: Option<String>,
    /// The lease's reasoning effort (Claude `--effort`, Codex `model_reasoning_effort`).
    pub reasoning_effort: Option<crate::kinds::ReasoningEffort>,
    pub permission: Arc<dyn PermissionPolicy>,
    pub fail_if_busy: bool,
    pub wait: Duration,
    /// Each turn's time limit (the pool's absolute turn timeout, or the request's).
    pub turn_timeout: Option<Duration>,
    /// The lease's gateway tools (checked; each with its timeout), served by the
    /// conversation's MCP bridge while the lease holds it.
    #[cfg_attr(not(feature = "mcp-bridge"), allow(dead_code))]
    pub tools: Vec<crate::turn::GatewayTool>,
    /// The conversation's system prompt ([`options::system_prompt`]), given to the CLI by
    /// its backend's route when the conversation's runner is made.
    pub system_prompt: Option<String>,
    /// The agent's CLI sandbox (`super::cli_sandbox`), when the pool's workers run in one.
    pub sandbox: Option<crate::sandbox::Sandbox>,
    /// The daemon's ledger of process groups (`WorkerConfig::group_ledger`): the CLI's
    /// processes are recorded there too.
    pub group_ledger: Option<Arc<crate::group_ledger::GroupLedger>>,
}

struct Shell {
    core: Slots,
    parked: HashMap<String, Parked>,
    waiters: HashMap<u64, oneshot::Sender<Result<bool, PoolError>>>,
    next_id: u64,
    /// The core's view when the Copilot side last heard of it (a change wakes it).
    told: Others,
    /// Processes of conversations being closed in the background, by conversation: `true`
    /// once gone. A new process of the same conversation (a refreshed credential) starts
    /// only after its old one is gone: two CLI processes never hold one session.
    closing: HashMap<String, watch::Receiver<bool>>,
    /// Each backend's gauges as last set (processes, leased, waiting): set again only when
    /// they changed (every Copilot lease's settle passes here too).
    gauges: BTreeMap<String, (usize, usize, usize)>,
}

impl Shell {
    /// Closes `parked` in the background, recorded as `conversation`'s closing (the records
    /// of processes gone since are let go).
    fn close_parked(&mut self, conversation: String, parked: Parked, why: Stop) {
        let gone = parked.close(why);
        self.closing.retain(|_, gone| !*gone.borrow());
        self.closing.insert(conversation, gone);
    }
}

/// A conversation between its leases: its runner, the pid of its process the metrics count
/// as running (its start counted, its exit not yet), and where its session id is bound.
struct Parked {
    runner: CliConversation,
    backend: String,
    process: Option<u32>,
    /// Where its session id is bound (`None`: nowhere, a runner a test parked).
    record: Option<SessionRecord>,
}

/// Where a conversation's CLI session id is bound, and the id its leases know is bound
/// there. A session id its runner learned that no turn's end bound (a live turn dropped
/// before its end, a binding write that failed) is bound when the runner is closed in the
/// background (evicted, recycled, shut down; not deleted), once its process is gone, if its
/// CLI filed a transcript of it (resuming one it did not file would fail
/// `transcript-missing`; a generic CLI's, with no transcript to check, is bound as a turn's
/// end would): without it the conversation's next lease would start a new session.
#[derive(Clone)]
struct SessionRecord {
    bindings: Arc<BindingStore>,
    key: String,
    identity: String,
    home: PathBuf,
    dialect: Dialect,
    kind: BackendKind,
    bound: Option<String>,
    /// The working directory the binding of `bound` records, when this record wrote it, took
    /// it over from the lease that did, or resumed by it; `None`: not known, so a turn's end
    /// writes it.
    bound_in: Option<PathBuf>,
    /// Held by each binding write of the conversation for its whole length, one abandoned by
    /// a cancelled caller included: writes land in the order they began, so an older id
    /// can never be renamed over a newer one. Shared by the record's clones.
    writes: Arc<tokio::sync::Mutex<()>>,
}

impl SessionRecord {
    /// Binds `id` (its turns ran in `cwd`) under the conversation's key durably and notes it
    /// as bound. Disk work: from a turn's end or a blocking thread.
    fn bind(&mut self, id: &str, cwd: &std::path::Path) -> Result<(), BindingError> {
        self.bindings.put(&Binding {
            session_key: self.key.clone(),
            cli_session_id: CliSessionId::new(id.to_owned()),
            compat_key: self.identity.clone(),
            updated_at_ms: super::now_ms(),
            working_directory: Some(cwd.to_path_buf()),
        })?;
        self.bound = Some(id.to_owned());
        self.bound_in = Some(cwd.to_path_buf());
        Ok(())
    }

    /// Whether `id` is bound already as run in `cwd`: a turn's end then writes nothing (each
    /// write is two fsyncs on a path every turn of the conversation takes).
    fn holds(&self, id: &str, cwd: &std::path::Path) -> bool {
        self.bound.as_deref() == Some(id) && self.bound_in.as_deref() == Some(cwd)
    }

    /// [`SessionRecord::bind`] on a blocking thread (the write's fsyncs stay off the async
    /// threads), the record updated once the binding is written. Cancelled, the write still
    /// ends on its thread and the record stays as it was (the next turn binds again).
    async fn bind_off_thread(&mut self, id: &str, cwd: &std::path::Path) -> Result<(), PoolError> {
        let (mut record, id, cwd) = (self.clone(), id.to_owned(), cwd.to_path_buf());
        let turn = self.writes.clone().lock_owned().await;
        let bound = tokio::task::spawn_blocking(move || {
            let _turn = turn;
            let bound = record.bind(&id, &cwd);
            (record, bound)
        })
        .await;
        match bound {
            Ok((record, Ok(()))) => {
                *self = record;
                Ok(())
            }
            Ok((_, Err(error))) => Err(PoolError::StateUnwritable {
                dir: self.bindings.dir().to_path_buf(),
                error: error.os_error(),
            }),
            Err(error) => Err(PoolError::Internal(error.to_string())),
        }
    }
}

/// A session id to bind once its runner is closed: the record, the id, and the directory its
/// turns ran in.
struct Unbound(SessionRecord, String, PathBuf);

impl Unbound {
    /// `runner`'s session id, when `record` does not have it bound.
    fn of(runner: &CliConversation, record: Option<&SessionRecord>) -> Option<Unbound> {
        let record = record?;
        let id = runner.session_id()?;
        (!record.holds(id, runner.working_directory())).then(|| {
            Unbound(
                record.clone(),
                id.to_owned(),
                runner.working_directory().to_path_buf(),
            )
        })
    }

    /// Binds the id if its CLI filed a transcript of it. File work in the agent's home: run
    /// it on a blocking thread.
    fn bind(self) {
        let Unbound(mut record, id, cwd) = self;
        let filed =
            CliConversation::find_transcript(record.dialect, record.kind, &record.home, &cwd, &id)
                .is_ok();
        if !filed {
            tracing::debug!(session = %id, "a CLI session id with no transcript is not bound");
            return;
        }
        // On a blocking thread (or a plain one): after any write of the conversation still
        // under way.
        let _turn = record.writes.clone().blocking_lock_owned();
        if let Err(error) = record.bind(&id, &cwd) {
            tracing::warn!(%error, "could not record a closed CLI conversation's session id");
        }
    }

    /// [`Unbound::bind`] on a blocking thread, awaited.
    async fn bind_blocking(self) {
        let _ = tokio::task::spawn_blocking(move || self.bind()).await;
    }
}

/// Why the pool stops a parked conversation's process.
#[derive(Clone, Copy)]
enum Stop {
    Evicted(Eviction),
    Shutdown,
    /// Its conversation's next lease wants another working directory.
    Recycled,
}

impl Parked {
    /// Counts how its process leaves (a crash when it died while parked) and closes it in
    /// the background; the receiver turns `true` once it is gone.
    fn close(self, why: Stop) -> watch::Receiver<bool> {
        count_stop(&self.backend, self.process, self.runner.pid(), why);
        let unbound = Unbound::of(&self.runner, self.record.as_ref());
        close_in_background(self.runner, unbound)
    }

    /// Counts how its process leaves and closes it, returning once it is gone; its session
    /// is not bound (the deletion's close: the session goes).
    async fn close_now(self, why: Stop) {
        count_stop(&self.backend, self.process, self.runner.pid(), why);
        let _ = self.runner.close().await;
    }
}

/// The names a conversation of a CLI backend goes by: its slot in the core, and its stored
/// session (binding).
pub(crate) struct CliNames {
    /// `<agent_id>/<session_key>#<backend>`.
    pub(crate) slot: String,
    /// `<agent_id>/<session_key>#backend=<backend>`.
    pub(crate) binding: String,
}

/// What joins a CLI conversation's backend id to its conversation in its binding's key
/// (backend ids have no `#`, so the key names one conversation whatever its session key
/// holds).
const CLI_BINDING_SEPARATOR: &str = "#backend=";

/// Written into the CLI backends' store once the bindings that versions before it kept among
/// the Copilot runtime's have been moved there.
const MOVED_MARKER: &str = ".moved-from-bindings";

/// Opens the CLI backends' binding store, `<state_dir>/cli-bindings`: a namespace of its own
/// beside the Copilot runtime's (`<state_dir>/bindings`), so a Copilot conversation's session
/// key may be anything (`alice#backend=claude-cli` included) without naming a CLI
/// conversation's binding. Versions before it kept the CLI bindings in the Copilot store, where no session
/// key could contain `#backend=`: every binding there whose key ends in `#backend=<id>` of
/// a backend in `backends` is moved here, once. (Earlier still, a Copilot session key could
/// hold `#backend=`; one that ends so with a configured id is taken for a CLI conversation's:
/// that Copilot conversation starts anew.)
pub(crate) fn open_bindings<'a>(
    state_dir: &std::path::Path,
    copilot: &BindingStore,
    backends: impl IntoIterator<Item = &'a String>,
) -> Result<BindingStore, super::bindings::BindingError> {
    let store = BindingStore::open_named(state_dir, super::bindings::CLI_BINDINGS_DIR)?;
    let backends: std::collections::HashSet<&str> =
        backends.into_iter().map(String::as_str).collect();
    let moved = store.take_once_from(copilot, MOVED_MARKER, |binding| {
        binding
            .session_key
            .rsplit_once(CLI_BINDING_SEPARATOR)
            .is_some_and(|(_, id)| backends.contains(id))
    })?;
    if moved > 0 {
        tracing::info!(
            moved,
            to = %store.dir().display(),
            "Moved the CLI backends' bindings into a store of their own."
        );
    }
    Ok(store)
}

impl CliNames {
    pub(crate) fn new(agent_id: &str, session_key: &str, backend: &str) -> Self {
        let conversation = super::ConversationId::new(agent_id, session_key).key();
        CliNames {
            slot: Self::slot_of(&conversation, backend),
            binding: format!("{conversation}{CLI_BINDING_SEPARATOR}{backend}"),
        }
    }

    /// The slot of `conversation` (its [`super::ConversationId::key`]) on `backend`.
    fn slot_of(conversation: &str, backend: &str) -> String {
        format!("{conversation}#{backend}")
    }
}

/// Counts the exit of a process the metrics count as running (`counted`) that the pool
/// stops for `why`; `running` is the runner's live pid (another or none: it died unseen).
fn count_stop(backend: &str, counted: Option<u32>, running: Option<u32>, why: Stop) {
    if counted.is_none() {
        return;
    }
    if running != counted {
        crate::metrics::process_exited(backend, ProcessExit::Crash);
        return;
    }
    match why {
        Stop::Evicted(reason) => crate::metrics::evicted(backend, reason),
        Stop::Shutdown => crate::metrics::process_exited(backend, ProcessExit::Shutdown),
        Stop::Recycled => crate::metrics::process_exited(backend, ProcessExit::Recycled),
    }
}

/// The `result` of a turn's start that failed, when it failed to start a process (a
/// prompt or configuration the runner refused started none).
fn failed_start(error: &CliStartError) -> Option<SpawnResult> {
    use crate::backend::claude_live::ClaudeLiveError as L;
    use crate::backend::oneshot::OneshotError as O;
    if error.is_callers() {
        return None;
    }
    let spawn = match error {
        CliStartError::Live(L::Config(_)) | CliStartError::Oneshot(O::Config(_)) => return None,
        // The pool meant to start one, and its command is not there.
        CliStartError::Live(L::NotInstalled(_)) | CliStartError::Oneshot(O::NotInstalled(_)) => {
            None
        }
        CliStartError::Live(L::Spawn(e)) | CliStartError::Oneshot(O::Spawn(e)) => Some(e),
        _ => None,
    };
    Some(match spawn {
        Some(e) if e.is_resource_exhaustion() => SpawnResult::ResourceExhausted,
        _ => SpawnResult::Error,
    })
}

/// A turn's start that failed as the pool's error: the caller's prompt, system message or
/// images refused are the caller's to fix ([`PoolError::InvalidRequest`]); a backend that
/// could not start its process (its command missing, the OS refusing, its configuration, the
/// agent's home) is the backend's ([`PoolError::CliStart`]).
fn start_error(backend: &str, error: CliStartError) -> PoolError {
    if error.is_callers() {
        PoolError::InvalidRequest(format!("backend `{backend}`: {error}"))
    } else {
        PoolError::CliStart {
            backend: backend.to_owned(),
            error: error.to_string(),
        }
    }
}

/// The CLI side of a pool.
pub(crate) struct CliPool {
    shell: Mutex<Shell>,
    backends: BTreeMap<String, CliBackendConfig>,
    bindings: Arc<BindingStore>,
    /// Conversations leased or being deleted ([`Slots::in_use`]), published at each change.
    in_use: watch::Sender<usize>,
    closed: AtomicBool,
    /// Tells the pool actor (set once it runs; before, there is no Copilot side to tell).
    copilot: OnceLock<Box<dyn Fn(Nudge) + Send + Sync>>,
    /// The abort handles of the turns running now, by their conversation's slot
    /// ([`CliNames::slot`]): how [`CliPool::abort`] reaches a turn on a CLI backend. A slot
    /// has one lease, and a lease one turn at a time: at most one entry per slot.
    running: Mutex<HashMap<String, RunningTurn>>,
}

/// A turn running now, as [`CliPool::abort`] reaches it: its abort handle, and why it was
/// stopped (the first of the turn's time limit and an abort wins).
struct RunningTurn {
    handle: AbortHandle,
    stopped: Arc<StopReason>,
}

/// Why a CLI turn was stopped, decided once: its time limit and an abort of the conversation
/// may come together, and a turn aborted first is no timeout (which would fall back).
#[derive(Default)]
struct StopReason(std::sync::atomic::AtomicU8);

impl StopReason {
    const NONE: u8 = 0;
    const TIMED_OUT: u8 = 1;
    const ABORTED: u8 = 2;

    /// Records `reason` unless one was recorded already; whether it was.
    fn decide(&self, reason: u8) -> bool {
        self.0
            .compare_exchange(Self::NONE, reason, Ordering::SeqCst, Ordering::SeqCst)
            .is_ok()
    }

    fn timed_out(&self) -> bool {
        self.0.load(Ordering::SeqCst) == Self::TIMED_OUT
    }
}

impl std::fmt::Debug for CliPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CliPool")
            .field("backends", &self.backends.keys())
            .finish_non_exhaustive()
    }
}

/// What a lease's open found stored ([`CliPool::stored_session`]).
struct Found {
    /// The CLI session to resume.
    resume: Option<String>,
    reason: OpenReason,
    /// Codex's thread totals as its rollout last recorded them.
    usage_totals: Option<crate::backend::oneshot::UsageTotals>,
    /// The lease's working directory, when the session resumed is bound as run there.
    resumed_in: Option<PathBuf>,
}

impl CliPool {
    pub(crate) fn new(
        backends: BTreeMap<String, CliBackendConfig>,
        caps: Caps,
        restart: RestartPolicy,
        bindings: Arc<BindingStore>,
    ) -> Self {
        let core = Slots::new(caps, restart);
        Self {
            shell: Mutex::new(Shell {
                core,
                parked: HashMap::new(),
                waiters: HashMap::new(),
                next_id: 1,
                told: Others::default(),
                closing: HashMap::new(),
                gauges: BTreeMap::new(),
            }),
            backends,
            bindings,
            in_use: watch::channel(0).0,
            closed: AtomicBool::new(false),
            copilot: OnceLock::new(),
            running: Mutex::new(HashMap::new()),
        }
    }

    /// Connects the Copilot side: `tell` reaches the pool actor (set once).
    pub(crate) fn connect_copilot(&self, tell: Box<dyn Fn(Nudge) + Send + Sync>) {
        let _ = self.copilot.set(tell);
    }

    fn tell_copilot(&self, nudge: Nudge) {
        if let Some(tell) = self.copilot.get() {
            tell(nudge);
        }
    }

    /// The shared process budget, locked: the pool actor holds it around each placement
    /// decision (it never awaits while holding it).
    pub(crate) fn budget(&self) -> BudgetGuard<'_> {
        BudgetGuard {
            pool: self,
            shell: self.lock(),
        }
    }

    /// Every backend id a lease may name: `copilot` first, then the configured CLI ids.
    pub(crate) fn backend_ids(&self) -> Vec<String> {
        std::iter::once(COPILOT_BACKEND.to_owned())
            .chain(self.backends.keys().cloned())
            .collect()
    }

    /// The configuration of CLI backend `id`: a table of kind `copilot` is refused (its
    /// conversations run on the pool's workers).
    fn cli_backend(&self, id: &str) -> Result<&CliBackendConfig, PoolError> {
        let config = self.backend(id)?;
        if config.kind == BackendKind::Copilot {
            return Err(PoolError::InvalidRequest(format!(
                "backend `{id}` is of kind `copilot`, which runs on the pool's workers; give a \
                 `[backends.<id>]` table `kind = \"cli-oneshot\"` or `\"cli-live\"`, or name \
                 the backend `{COPILOT_BACKEND}`"
            )));
        }
        Ok(config)
    }

    /// The configuration of a CLI backend, or the error naming the configured ids.
    pub(crate) fn backend(&self, id: &str) -> Result<&CliBackendConfig, PoolError> {
        self.backends.get(id).ok_or_else(|| {
            PoolError::InvalidRequest(format!(
                "unknown backend `{id}`; the configured backends are {}. Add one as a \
                 `[backends.{id}]` table in the daemon's TOML (command, args, ...; the \
                 bundled `claude-cli` needs only its `command`), or in \
                 `PoolConfig::cli_backends`",
                self.backend_ids()
                    .iter()
                    .map(|b| format!("`{b}`"))
                    .collect::<Vec<_>>()
                    .join(", ")
            ))
        })
    }

    /// Whether backend `id`'s conversations serve gateway tools (see
    /// `CliConversation::serves_gateway_tools`): a `cli-live` backend (Claude Code's runner)
    /// and a one-shot backend of the Codex dialect, with the `mcp-bridge` feature.
    pub(crate) fn serves_gateway_tools(&self, id: &str) -> Result<bool, PoolError> {
        let config = self.backend(id)?;
        Ok(cfg!(feature = "mcp-bridge")
            && match config.kind {
                BackendKind::CliLive => true,
                BackendKind::CliOneshot => config.dialect_of(id) == Dialect::Codex,
                BackendKind::Copilot => false,
            })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Shell> {
        // A panic while holding it left plain bookkeeping: keep going with it.
        self.shell.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn running(&self) -> std::sync::MutexGuard<'_, HashMap<String, RunningTurn>> {
        // As `lock`: a map of handles, never left half-changed.
        self.running.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Aborts the running turn of conversation `conversation` (`<agent>/<session key>`,
    /// [`super::ConversationId::key`]) on every CLI backend it runs one on: the turn ends
    /// `aborted` and the stored session stays, so the next turn resumes it. `false` when
    /// it runs no turn on a CLI backend.
    pub(crate) fn abort(&self, conversation: &str) -> bool {
        let running = self.running();
        let mut aborted = false;
        for backend in self.backends.keys() {
            let slot = CliNames::slot_of(conversation, backend);
            if let Some(turn) = running.get(&slot) {
                turn.stopped.decide(StopReason::ABORTED);
                turn.handle.abort();
                aborted = true;
            }
        }
        aborted
    }

    /// Carries out the core's effects (under the lock; closing runs in tasks).
    fn apply(&self, shell: &mut Shell, effects: Vec<Effect>) {
        for effect in effects {
            match effect {
                Effect::Grant { id, reuse, .. } => {
                    if let Some(port) = shell.waiters.remove(&id) {
                        // A waiter that went away returns its slot when its lease is dropped:
                        // the receiver side handles a grant nobody takes (below).
                        let _ = port.send(Ok(reuse));
                    }
                }
                Effect::Fail { id, why } => {
                    if let Some(port) = shell.waiters.remove(&id) {
                        let _ = port.send(Err(refusal(why)));
                    }
                }
                Effect::Close { conversation } => {
                    if let Some(parked) = shell.parked.remove(&conversation) {
                        shell.close_parked(conversation, parked, Stop::Evicted(Eviction::Full));
                    }
                }
                Effect::EvictOther => self.tell_copilot(Nudge::EvictIdle),
            }
        }
        self.publish(shell);
        // Room given up here, or a process newly idle, may serve a waiting Copilot lease.
        let view = shell.core.view();
        if view != shell.told {
            shell.told = view;
            self.tell_copilot(Nudge::Changed);
        }
    }

    fn publish(&self, shell: &mut Shell) {
        for (id, config) in &self.backends {
            // A parked one-shot conversation holds no process (one runs per turn): its
            // backend's processes are at most its leased conversations.
            let processes = match config.kind {
                BackendKind::CliOneshot => shell.core.leased_of(id),
                _ => shell.core.processes_of(id),
            };
            let figures = (
                processes,
                shell.core.leased_of(id),
                shell.core.waiting_of(id),
            );
            if shell.gauges.get(id) == Some(&figures) {
                continue;
            }
            crate::metrics::cli_processes(id, figures.0);
            crate::metrics::leases(id, figures.1, figures.2);
            shell.gauges.insert(id.clone(), figures);
        }
        self.in_use.send_replace(shell.core.in_use());
    }

    /// Leases a conversation of a CLI backend.
    pub(crate) async fn lease(
        self: &Arc<Self>,
        ask: CliAsk,
        bindings_key: String,
    ) -> Result<CliLease, PoolError> {
        let config = self.cli_backend(&ask.backend)?.clone();
        let identity = session::identity(&ask.creds);
        let key = CliKey {
            home: ask.home.display().to_string(),
            credential: session::credential(&ask.creds),
            backend: ask.backend.clone(),
            serialize: config.serialize,
        };
        let started = Instant::now();
        let (tx, rx) = oneshot::channel();
        let id = {
            let mut shell = self.lock();
            let id = shell.next_id;
            shell.next_id += 1;
            shell.waiters.insert(id, tx);
            let effects = shell.core.ask(
                id,
                &ask.conversation,
                key.clone(),
                ask.fail_if_busy,
                started,
            );
            self.apply(&mut shell, effects);
            id
        };
        // Until the grant is taken, a cancelled wait must hand a granted slot back.
        let mut guard = WaitGuard {
            pool: self.clone(),
            id,
            conversation: ask.conversation.clone(),
            answer: rx,
            armed: true,
        };
        let reuse = match tokio::time::timeout(ask.wait, &mut guard.answer).await {
            Ok(Ok(result)) => {
                guard.armed = false;
                result.map_err(|e| match e {
                    PoolError::ConversationBusy { .. } => PoolError::ConversationBusy {
                        session_key: ask.conversation.clone(),
                    },
                    other => other,
                })?
            }
            Ok(Err(_)) => {
                guard.armed = false;
                return Err(PoolError::Closed);
            }
            Err(_) => {
                return Err(PoolError::WaitTimeout { after: ask.wait });
            }
        };
        crate::metrics::lease_granted(&ask.backend, started.elapsed());
        let mut lease = CliLease {
            pool: self.clone(),
            backend: ask.backend.clone(),
            conversation_key: ask.conversation.clone(),
            conversation: None,
            reason: OpenReason::Attached,
            crashed: false,
            cwd: ask.cwd.clone(),
            turn_timeout: ask.turn_timeout,
            process: None,
            record: SessionRecord {
                bindings: self.bindings.clone(),
                key: bindings_key,
                identity,
                home: ask.home.clone(),
                dialect: config.dialect_of(&ask.backend),
                kind: config.kind,
                bound: None,
                bound_in: None,
                writes: Default::default(),
            },
        };
        let parked = reuse
            .then(|| self.lock().parked.remove(&ask.conversation))
            .flatten();
        let parked = match parked {
            // Its runner works in another directory than this lease asks for: it is closed,
            // and a new runner in the lease's directory continues the conversation as
            // `session::decide` says (resumed where its CLI finds the session from there, a
            // new session where the CLI filed it by the old directory), never a turn run
            // elsewhere.
            Some(parked) if parked.runner.working_directory() != ask.cwd => {
                // Closed in the background and recorded as closing (its session id bound
                // first, if no turn's end bound it): the wait for it below reads the binding
                // after, and a lease cancelled meanwhile cuts nothing short.
                self.lock()
                    .close_parked(ask.conversation.clone(), parked, Stop::Recycled);
                None
            }
            other => other,
        };
        if let Some(parked) = parked {
            if parked.runner.session_id().is_none() {
                // Its turns never got as far as a session (they crashed at start, say):
                // there is no context to continue.
                lease.reason = OpenReason::New;
            }
            lease.conversation = Some(parked.runner);
            lease.process = parked.process;
            // The same runner, so the same working directory its binding records.
            if let Some(record) = parked.record {
                lease.record.bound = record.bound;
                lease.record.bound_in = record.bound_in;
                lease.record.writes = record.writes;
            }
            // Its process may have died while parked.
            lease.settle_process(ProcessExit::Crash);
        }
        if lease.conversation.is_none() {
            // Its old process (closed for a refreshed credential) goes first: two CLI
            // processes must not write one session.
            // (A copy: a lease cancelled while it waits leaves the next one waiting too.)
            let closing = self.lock().closing.get(&ask.conversation).cloned();
            if let Some(mut gone) = closing {
                let _ = gone.wait_for(|gone| *gone).await;
            }
            // The pool shut down meanwhile: no new process (dropping the lease gives it back).
            if self.closed.load(Ordering::SeqCst) {
                return Err(PoolError::Closed);
            }
            // A new process: resume the stored session, or start one (the rules decide).
            let found = self.stored_session(&ask, &config, &lease).await?;
            lease.record.bound = found.resume.clone();
            lease.record.bound_in = found.resumed_in.clone();
            let (conversation, reason) = self.open(&ask, &config, found)?;
            lease.conversation = Some(conversation);
            lease.reason = reason;
        } else if let Some(conversation) = lease.conversation.as_mut()
            && conversation
                .set_lease_settings(
                    ask.permission.clone(),
                    ask.reasoning_effort,
                    ask.model.clone(),
                    ask.system_prompt.clone(),
                )
                .await
            && lease.reason == OpenReason::Attached
        {
            // Its process was closed for other flags: the next turn resumes the session.
            lease.reason = OpenReason::Resumed;
        }
        // This lease's handlers answer the CLI's tool calls until it is dropped; a CLI
        // started with other tools is started again with these (never a stale list).
        #[cfg(feature = "mcp-bridge")]
        if let Some(conversation) = lease.conversation.as_mut()
            && conversation.serves_gateway_tools()
        {
            let change = conversation.set_gateway_tools(ask.tools).await;
            tracing::debug!(backend = %ask.backend, ?change, "gateway tools installed");
            if change == crate::backend::GatewayToolsChange::Restart
                && lease.reason == OpenReason::Attached
            {
                // Its process was closed: the next turn resumes the session in a new one.
                lease.reason = OpenReason::Resumed;
            }
            lease.settle_process(ProcessExit::Recycled);
        }
        Ok(lease)
    }

    /// What the lease's conversation resumes, if anything (the rules decide): its binding,
    /// its transcript where the CLI keeps it, Codex's last totals. File work in the agent's
    /// home (which the agent may write: a FIFO or a deep tree there must not stall the async
    /// threads), so one blocking task does it.
    async fn stored_session(
        &self,
        ask: &CliAsk,
        config: &CliBackendConfig,
        lease: &CliLease,
    ) -> Result<Found, PoolError> {
        let bindings = self.bindings.clone();
        let bindings_key = lease.record.key.clone();
        let identity = lease.record.identity.clone();
        let backend = ask.backend.clone();
        let (dialect, kind) = (config.dialect_of(&ask.backend), config.kind);
        let (home, cwd) = (ask.home.clone(), ask.cwd.clone());
        tokio::task::spawn_blocking(move || {
            let binding = bindings
                .get(&bindings_key)
                .map_err(|e| PoolError::Bindings(e.to_string()))?;
            let recorded = binding.as_ref().and_then(|b| b.working_directory.clone());
            let ran_in = recorded.clone().filter(|dir| *dir != cwd);
            let stored = binding.map(|b| StoredSession {
                session_id: b.cli_session_id.into_string(),
                identity: b.compat_key,
            });
            let transcript_in = |dir: &std::path::Path, id: &str| {
                CliConversation::find_transcript(dialect, kind, &home, dir, id)
            };
            let decision = session::decide(
                stored.as_ref(),
                &identity,
                |id| transcript_in(&cwd, id).is_ok(),
                |id| {
                    ran_in
                        .as_ref()
                        .is_some_and(|dir| transcript_in(dir, id).is_ok())
                },
            )
            .map_err(|missing| PoolError::TranscriptMissing {
                backend: backend.clone(),
                session_id: missing.session_id.clone(),
                path: transcript_in(&cwd, &missing.session_id)
                    .err()
                    .unwrap_or_default(),
            })?;
            let (resume, reason) = match decision {
                SessionDecision::Resume(id) => (Some(id), OpenReason::Resumed),
                SessionDecision::New => (None, OpenReason::New),
                // Its old session's files stay where they were filed, as a conversation's
                // earlier sessions do after a changed identity.
                SessionDecision::IdentityChanged | SessionDecision::Moved => {
                    bindings
                        .remove(&bindings_key)
                        .map_err(|e| PoolError::Bindings(e.to_string()))?;
                    (None, OpenReason::CompatChanged)
                }
            };
            // Codex reports thread totals: a resumed runner starts from the last ones it
            // recorded, so the first resumed turn's usage is its own.
            let usage_totals = match (&resume, kind, dialect) {
                (Some(id), BackendKind::CliOneshot, Dialect::Codex) => {
                    codex_rollout_path(&home, id)
                        .ok()
                        .and_then(|rollout| codex_rollout_totals(&home, &rollout))
                }
                _ => None,
            };
            let resumed_in = (resume.is_some() && recorded.as_ref() == Some(&cwd)).then_some(cwd);
            Ok(Found {
                resume,
                reason,
                usage_totals,
                resumed_in,
            })
        })
        .await
        .map_err(|e| PoolError::Internal(e.to_string()))?
    }

    /// A new runner for the lease, resuming what [`Self::stored_session`] found.
    fn open(
        &self,
        ask: &CliAsk,
        config: &CliBackendConfig,
        found: Found,
    ) -> Result<(CliConversation, OpenReason), PoolError> {
        let Found {
            resume,
            reason,
            usage_totals,
            resumed_in: _,
        } = found;
        crate::metrics::session_opened(&ask.backend, reason);
        let invalid = |e: &dyn std::fmt::Display| {
            PoolError::InvalidRequest(format!("backend `{}`: {e}", ask.backend))
        };
        if config.kind == BackendKind::CliOneshot {
            let mut one = OneshotConfig::new(&ask.backend, config.clone(), &ask.home, &ask.cwd);
            one.dialect = config.dialect_of(&ask.backend);
            one.base_url = ask.creds.base_url.clone();
            one.api_key = ask.creds.api_key.clone();
            one.model = ask.model.clone();
            one.system_prompt = ask.system_prompt.clone();
            one.reasoning_effort = ask.reasoning_effort;
            one.sandbox = ask.sandbox.clone();
            one.group_ledger = ask.group_ledger.clone();
            one.session = resume.map(|id| {
                let mut stored = crate::backend::oneshot::StoredSession::new(id);
                if let Some(totals) = usage_totals {
                    stored.usage_totals = totals;
                }
                stored
            });
            let runner = Oneshot::new(one).map_err(|e| invalid(&e))?;
            return Ok((CliConversation::Oneshot(Box::new(runner)), reason));
        }
        let mut live = ClaudeLiveConfig::new(&config.command, &ask.home, &ask.cwd);
        live.backend = config.clone();
        live.base_url = ask.creds.base_url.clone();
        live.api_key = ask.creds.api_key.clone();
        live.model = ask.model.clone();
        live.system_prompt = ask.system_prompt.clone();
        live.session_id = resume;
        live.permission = ask.permission.clone();
        live.reasoning_effort = ask.reasoning_effort;
        live.sandbox = ask.sandbox.clone();
        live.group_ledger = ask.group_ledger.clone();
        let runner = ClaudeLive::new(live).map_err(|e| invalid(&e))?;
        Ok((CliConversation::Live(Box::new(runner)), reason))
    }

    /// Takes a conversation back from its lease: its runner, if it has one, to park.
    fn give_back(&self, conversation: &str, parked: Option<Parked>, crashed: bool) {
        // The lease's handlers go with it: a call before the next lease is refused.
        #[cfg(feature = "mcp-bridge")]
        let parked = parked.map(|mut parked| {
            parked.runner.clear_gateway_handlers();
            parked
        });
        let mut shell = self.lock();
        // Read under the lock: a shutdown sets it before it takes the lock to empty
        // `parked`, so a runner kept here is either emptied by it or not kept at all.
        let closed = self.closed.load(Ordering::SeqCst);
        let kept = parked.is_some() && !closed;
        // A conversation without a running process (a one-shot's between turns, one whose
        // process died or was closed) is parked for its next lease but takes no process slot
        // meanwhile.
        let live = parked.as_ref().is_some_and(|p| p.runner.pid().is_some());
        let held = match (kept, live) {
            (false, _) => Kept::Nothing,
            (true, true) => Kept::Process,
            (true, false) => Kept::Conversation,
        };
        let effects = shell
            .core
            .returned(conversation, held, crashed, Instant::now());
        if let Some(parked) = parked {
            if kept {
                shell.parked.insert(conversation.to_owned(), parked);
            } else {
                // Recorded, so a shutdown waits for it too.
                shell.close_parked(conversation.to_owned(), parked, Stop::Shutdown);
            }
        }
        self.apply(&mut shell, effects);
    }

    /// Whether `conversation` is held (leased, or parked with or without its process), is
    /// being deleted, or is waited for.
    pub(crate) fn holds(&self, conversation: &str) -> bool {
        self.lock().core.holds(conversation)
    }

    /// The CLI backends' binding store.
    pub(crate) fn bindings(&self) -> &BindingStore {
        &self.bindings
    }

    /// Whether the conversation `names` has a stored session (a binding).
    pub(crate) fn is_stored(&self, names: &CliNames) -> Result<bool, PoolError> {
        self.bindings
            .is_present(&names.binding)
            .map_err(|e| super::state_unwritable(&self.bindings, e.to_string()))
    }

    /// Deletes a conversation of backend `backend` (`names`), its backend home `home` (`None`:
    /// there is none, so no file to remove), run in `cwd`: refused while it runs a turn or a
    /// lease waits for it (`ConversationBusy`); else no lease is granted it until the
    /// deletion is done, its kept process is ended, the files its CLI keeps of the session
    /// (the stored one, filed by the working directory its binding recorded, else by `cwd`,
    /// and the kept process's, filed by the directory that process ran in) are removed
    /// ([`Dialect::session_files`], only inside `home`, links not followed), then the
    /// binding. The work runs in a task of its own: a caller that goes away does not cut it
    /// short, and the conversation is held until it ends. `Ok(Some(dir))`: deleted; `dir` is
    /// where its turns ran (the binding's record, else the kept process's directory, else
    /// `cwd`); `Ok(None)`: nothing was stored or kept.
    pub(crate) async fn delete(
        self: &Arc<Self>,
        backend: &str,
        names: &CliNames,
        home: Option<std::path::PathBuf>,
        cwd: &std::path::Path,
        while_held: Option<WhileHeld>,
    ) -> Result<Option<std::path::PathBuf>, PoolError> {
        let config = self.cli_backend(backend)?;
        let dialect = CliConversation::runner_dialect(config.kind, config.dialect_of(backend));
        let parked =
            {
                let mut shell = self.lock();
                let (close, effects) = shell.core.delete(&names.slot, Instant::now()).map_err(
                    |why| match refusal(why) {
                        PoolError::ConversationBusy { .. } => PoolError::ConversationBusy {
                            session_key: names.slot.clone(),
                        },
                        other => other,
                    },
                )?;
                let parked = if close {
                    shell.parked.remove(&names.slot)
                } else {
                    None
                };
                self.apply(&mut shell, effects);
                (parked, shell.closing.get(&names.slot).cloned())
            };
        let (parked, closing) = parked;
        // Held for the deletion from here until the task ends, whatever its caller does.
        let held = Deleting {
            pool: self.clone(),
            conversation: names.slot.clone(),
        };
        let binding = names.binding.clone();
        let cwd = cwd.to_path_buf();
        let task = tokio::spawn(async move {
            let pool = held.pool.clone();
            // The kept process's session, filed by the directory that process runs in.
            let kept = parked.as_ref().and_then(|p| {
                let id = p.runner.session_id()?.to_owned();
                Some((id, p.runner.working_directory().to_path_buf()))
            });
            let had_process = parked.is_some();
            if let Some(parked) = parked {
                // Ended before its files go: a live CLI writes its transcript to the end.
                parked.close_now(Stop::Shutdown).await;
            }
            // Likewise one closing in the background (evicted idle just before).
            if let Some(mut gone) = closing {
                let _ = gone.wait_for(|gone| *gone).await;
            }
            let unwritable = |e: super::bindings::BindingError| {
                super::state_unwritable(&pool.bindings, e.to_string())
            };
            // The state directory's reads and writes go to the blocking threads.
            let bindings = pool.bindings.clone();
            let key = binding.clone();
            let stored = tokio::task::spawn_blocking(move || bindings.get(&key))
                .await
                .map_err(|e| PoolError::Internal(format!("reading a CLI binding: {e}")))?
                .map_err(unwritable)?;
            // Where the stored session's turns ran: its binding says (since the twenty-ninth
            // session), else the deletion's request. The conversation's directory, answered:
            // that, or the kept process's when nothing is stored.
            let recorded = stored.as_ref().and_then(|b| b.working_directory.clone());
            let ran_in = recorded
                .clone()
                .or_else(|| kept.as_ref().map(|(_, dir)| dir.clone()))
                .unwrap_or_else(|| cwd.clone());
            let stored_in = recorded.unwrap_or(cwd);
            let mut sessions: Vec<(String, std::path::PathBuf)> = stored
                .iter()
                .map(|b| (b.cli_session_id.as_str().to_owned(), stored_in.clone()))
                .chain(kept)
                .collect();
            sessions.dedup();
            if let Some(home) = home {
                tokio::task::spawn_blocking(move || {
                    sessions
                        .iter()
                        .try_for_each(|(id, cwd)| remove_session_files(dialect, &home, cwd, id))
                })
                .await
                .map_err(|e| PoolError::Internal(format!("removing a session's files: {e}")))??;
            }
            if stored.is_some() {
                let bindings = pool.bindings.clone();
                tokio::task::spawn_blocking(move || bindings.remove(&binding))
                    .await
                    .map_err(|e| PoolError::Internal(format!("removing a CLI binding: {e}")))?
                    .map_err(unwritable)?;
            }
            let found = had_process || stored.is_some();
            // The caller's own clean-up of the conversation (its attachments), before a turn
            // of it may run again.
            if found && let Some(while_held) = while_held {
                while_held(ran_in.clone()).await;
            }
            drop(held);
            Ok(found.then_some(ran_in))
        });
        task.await
            .map_err(|e| PoolError::Internal(format!("deleting a CLI conversation: {e}")))?
    }

    /// Closes the parked processes idle for `ttl`.
    pub(crate) fn close_idle(&self, ttl: Duration) {
        let mut shell = self.lock();
        let now = Instant::now();
        for conversation in shell.core.idle(now, ttl) {
            let effects = shell.core.forget(&conversation, now);
            if let Some(parked) = shell.parked.remove(&conversation) {
                shell.close_parked(conversation.clone(), parked, Stop::Evicted(Eviction::Idle));
            }
            self.apply(&mut shell, effects);
        }
        shell.core.forget_quiet_keys(now);
    }

    /// Stops leasing: waiters fail, parked processes are closed (their groups killed past
    /// the grace), and running leases and deletions get `grace` to end (a deletion cut
    /// short by the daemon's exit would leave the binding of a session whose files are
    /// gone); a lease returned later closes its process, and the shutdown waits for every
    /// process closing by then.
    pub(crate) async fn shutdown(&self, grace: Duration) {
        self.closed.store(true, Ordering::SeqCst);
        {
            let mut shell = self.lock();
            // The core's effects: its waiters fail; the parked ones it names are closed with
            // the rest below.
            let effects = shell.core.close();
            let failed = effects
                .into_iter()
                .filter(|e| !matches!(e, Effect::Close { .. }))
                .collect();
            self.apply(&mut shell, failed);
            // Closed all at once, each recorded as closing: a lease granted just before the
            // shutdown (its runner still parked) waits for its old process to be gone.
            let parked: Vec<(String, Parked)> = shell.parked.drain().collect();
            for (conversation, p) in parked {
                shell.close_parked(conversation, p, Stop::Shutdown);
            }
            self.publish(&mut shell);
        }
        // The leases and deletions running get `grace`; the closes run meanwhile.
        let mut in_use = self.in_use.subscribe();
        let _ = tokio::time::timeout(grace, in_use.wait_for(|n| *n == 0)).await;
        // Every process closing now (parked ones, and those of the leases returned), each
        // bounded by its close's own grace and kill.
        let closing: Vec<watch::Receiver<bool>> = self.lock().closing.values().cloned().collect();
        for mut gone in closing {
            let _ = gone.wait_for(|gone| *gone).await;
        }
    }
}

/// The shared process budget, locked ([`CliPool::budget`]).
pub(crate) struct BudgetGuard<'a> {
    pool: &'a CliPool,
    shell: std::sync::MutexGuard<'a, Shell>,
}

impl BudgetGuard<'_> {
    /// What the Copilot side sees of the CLI processes.
    pub(crate) fn cli_view(&self) -> Others {
        self.shell.core.view()
    }

    /// Processes held now per CLI backend id, as the budget counts them.
    pub(crate) fn cli_by_backend(&self) -> BTreeMap<String, usize> {
        self.pool
            .backends
            .keys()
            .map(|id| (id.clone(), self.shell.core.processes_of(id)))
            .collect()
    }

    /// CLI leases waiting for capacity now.
    pub(crate) fn cli_waiting(&self) -> usize {
        self.shell.core.waiting()
    }

    /// Whether a CLI lease still waits for the idle Copilot worker it asked for
    /// ([`Nudge::EvictIdle`]): a request whose lease was served meanwhile stops nothing.
    pub(crate) fn cli_wants_room(&self) -> bool {
        self.shell.core.wants_other()
    }

    /// The Copilot side needs room and the CLI side's parked process is the oldest idle
    /// one: it closes (false: none is parked).
    pub(crate) fn evict_for_copilot(&mut self) -> bool {
        let (evicted, effects) = self.shell.core.evict_for_other();
        // The actor asked: it serves its waiters itself (no nudge for this room).
        self.shell.told = self.shell.core.view();
        self.pool.apply(&mut self.shell, effects);
        evicted
    }

    /// Makes the next publish set every CLI gauge again (the pool's maintenance tick calls
    /// it, as it does for its own gauges).
    pub(crate) fn republish_gauges(&mut self) {
        self.shell.gauges.clear();
    }

    /// The Copilot side's processes after its decision; when they changed, the CLI waiters
    /// are served (room it gave up, or a new idle worker to ask for).
    pub(crate) fn copilot_is(&mut self, copilot: Others) {
        let effects = self.shell.core.others_changed(copilot, Instant::now());
        self.pool.apply(&mut self.shell, effects);
    }
}

/// Closes a runner's process gracefully in a task; outside a runtime (a lease dropped on a
/// plain thread) it is dropped, which kills its process group at once.
fn close_in_background(runner: CliConversation, unbound: Option<Unbound>) -> watch::Receiver<bool> {
    let (gone, receiver) = watch::channel(false);
    match tokio::runtime::Handle::try_current() {
        Ok(handle) => {
            handle.spawn(async move {
                let _ = runner.close().await;
                // Bound before it counts as gone: the conversation's next lease, which waits
                // for that, finds the session.
                if let Some(unbound) = unbound {
                    unbound.bind_blocking().await;
                }
                let _ = gone.send(true);
            });
        }
        Err(_) => {
            drop(runner);
            if let Some(unbound) = unbound {
                unbound.bind();
            }
            let _ = gone.send(true);
        }
    }
    receiver
}

/// A conversation held for its deletion ([`CliPool::delete`]), released when dropped.
struct Deleting {
    pool: Arc<CliPool>,
    conversation: String,
}

impl Drop for Deleting {
    fn drop(&mut self) {
        let mut shell = self.pool.lock();
        let effects = shell.core.deleted(&self.conversation, Instant::now());
        self.pool.apply(&mut shell, effects);
    }
}

/// Removes what `dialect`'s CLI keeps of session `session_id` ([`Dialect::session_files`])
/// that lies inside `home` once the folders above it are resolved: a link an agent planted
/// on the way (its own processes may write its home) must not make the pool, which is not
/// sandboxed, delete another agent's files. (A link swapped in between the check and the
/// removal, by the agent's own running process, is not caught; it would need a file of the
/// same session id on the other side.) A file already gone is no error.
fn remove_session_files(
    dialect: Dialect,
    home: &std::path::Path,
    cwd: &std::path::Path,
    session_id: &str,
) -> Result<(), PoolError> {
    let failed = |path: &std::path::Path, error: std::io::Error| PoolError::TranscriptUnremovable {
        path: path.to_path_buf(),
        error: error.to_string(),
    };
    let root = match std::fs::canonicalize(home) {
        Ok(root) => root,
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(error) => return Err(failed(home, error)),
    };
    let files = dialect.session_files(home, cwd, session_id);
    if files.is_empty() && dialect != Dialect::Generic {
        tracing::warn!(
            session = session_id,
            home = %home.display(),
            cwd = %cwd.display(),
            "No file of the deleted CLI session was found; if its turns ran in another \
             working directory, delete it again naming that one (session.workingDirectory)."
        );
    }
    for path in files {
        let inside = path.parent().is_some_and(|parent| {
            std::fs::canonicalize(parent).is_ok_and(|p| p.starts_with(&root))
        });
        if !inside {
            tracing::warn!(
                path = %path.display(),
                "Not removing a CLI session's file outside the agent's home."
            );
            continue;
        }
        let removed = match std::fs::symlink_metadata(&path) {
            Ok(meta) if meta.is_dir() => std::fs::remove_dir_all(&path),
            Ok(_) => std::fs::remove_file(&path),
            Err(error) => Err(error),
        };
        match removed {
            Ok(()) => {}
            Err(error) if error.kind() == std::io::ErrorKind::NotFound => {}
            Err(error) => return Err(failed(&path, error)),
        }
    }
    Ok(())
}

/// Fails an ask that cannot be granted (a busy one's session key is filled in by its lease).
fn refusal(why: Refusal) -> PoolError {
    match why {
        Refusal::Busy => PoolError::ConversationBusy {
            session_key: String::new(),
        },
        Refusal::WaitersFull { max } => PoolError::WaitersFull { max },
        Refusal::AgentWaitersFull { max } => PoolError::AgentWaitersFull { max },
        Refusal::Quarantined(left) => PoolError::RestartIntensityExceeded {
            key_hash: "cli".to_owned(),
            retry_after: left,
            last_error: None,
        },
        Refusal::Closed => PoolError::Closed,
    }
}

/// Withdraws an ask whose caller stopped waiting; a grant that raced it is handed back.
struct WaitGuard {
    pool: Arc<CliPool>,
    id: u64,
    conversation: String,
    /// The pool's answer to the ask (sent under the pool's lock as the ask leaves its
    /// waiters).
    answer: oneshot::Receiver<Result<bool, PoolError>>,
    armed: bool,
}

impl Drop for WaitGuard {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        let mut shell = self.pool.lock();
        if shell.waiters.remove(&self.id).is_some() {
            let effects = shell.core.abandon(self.id, Instant::now());
            self.pool.apply(&mut shell, effects);
            return;
        }
        // Answered meanwhile. A refusal (the pool shutting down, the key quarantined) holds
        // nothing: handing the conversation back would free another lease's.
        if !matches!(self.answer.try_recv(), Ok(Ok(_))) {
            return;
        }
        // Granted meanwhile, to nobody: give the conversation back (its parked process,
        // if any, stays parked), taken out under the same lock.
        let parked = shell.parked.remove(&self.conversation);
        drop(shell);
        self.pool.give_back(&self.conversation, parked, false);
    }
}

/// Exclusive use of one conversation of a CLI backend until dropped. Dropping it parks the
/// conversation's process for its next lease (or closes it when the pool is closing).
pub struct CliLease {
    pool: Arc<CliPool>,
    backend: String,
    conversation_key: String,
    conversation: Option<CliConversation>,
    reason: OpenReason,
    crashed: bool,
    cwd: PathBuf,
    turn_timeout: Option<Duration>,
    /// The pid of the conversation's process the metrics count as running: its start
    /// counted, its exit not yet.
    process: Option<u32>,
    /// Where its session id is bound (key, identity, the agent's home, the backend's kind
    /// and dialect) and the id bound there as far as the lease knows.
    record: SessionRecord,
}

impl std::fmt::Debug for CliLease {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CliLease")
            .field("backend", &self.backend)
            .field("reason", &self.reason)
            .finish_non_exhaustive()
    }
}

impl Drop for CliLease {
    fn drop(&mut self) {
        let parked = self.conversation.take().map(|runner| Parked {
            runner,
            backend: self.backend.clone(),
            process: self.process,
            record: Some(self.record.clone()),
        });
        self.pool
            .give_back(&self.conversation_key, parked, self.crashed);
    }
}

impl CliLease {
    /// The backend id.
    pub fn backend(&self) -> &str {
        &self.backend
    }

    /// How the conversation's CLI session was opened for this lease: `attached` (its live
    /// process kept from the last lease), `resumed`, `new`, or `compat-changed` (the auth
    /// identity changed: the stored session was dropped).
    pub fn reason(&self) -> OpenReason {
        self.reason
    }

    /// The CLI session id, once known.
    pub fn session_id(&self) -> Option<&str> {
        self.conversation.as_ref().and_then(|c| c.session_id())
    }

    /// The pid (= process group id) of the CLI process while one runs.
    pub fn pid(&self) -> Option<u32> {
        self.conversation.as_ref().and_then(|c| c.pid())
    }

    /// The agent's home for this backend (`HOME` of the CLI).
    pub fn home(&self) -> &std::path::Path {
        &self.record.home
    }

    /// The conversation's working directory.
    pub fn working_directory(&self) -> &std::path::Path {
        &self.cwd
    }

    /// Each turn's time limit from now on (`None`: only the runner's own). A turn past it is
    /// interrupted and ends `timeout` ([`crate::backend::TurnFailure::TimedOut`]).
    pub fn set_turn_timeout(&mut self, limit: Option<Duration>) {
        self.turn_timeout = limit;
    }

    /// The backend's kind (`cli-oneshot` or `cli-live`).
    pub fn kind(&self) -> BackendKind {
        self.record.kind
    }

    /// The backend's dialect ([`CliBackendConfig::dialect_of`]).
    pub fn dialect(&self) -> Dialect {
        self.record.dialect
    }

    /// Counts the exit (for `why`) of the process the metrics count as running when the
    /// conversation no longer runs it.
    fn settle_process(&mut self, why: ProcessExit) {
        let running = self.conversation.as_ref().and_then(|c| c.pid());
        if self.process.is_some() && running != self.process {
            crate::metrics::process_exited(&self.backend, why);
            self.process = None;
        }
    }

    /// Sends `prompt` and returns the running turn; read it with [`CliLeaseTurn::next`] to
    /// its `turn.end`, which records the CLI session id durably.
    pub async fn start_turn(&mut self, prompt: &str) -> Result<CliLeaseTurn<'_>, PoolError> {
        self.start_turn_with_images(prompt, &[]).await
    }

    /// [`CliLease::start_turn`] with the turn's images: absolute paths of PNG, JPEG, GIF or
    /// WebP files the caller has confined (the daemon: inside the agent's work directory or
    /// an allowed root). Claude Code gets each as an `image` content block of the user
    /// message; a one-shot backend after its `imageArg` (`codex-cli`: `--image=<path>`), or
    /// in its prompt (`google-gemini-cli`: `@path`, inside the working directory only). A
    /// path that is not absolute, not named as an image, unreadable, reached through a link
    /// (give resolved paths: the pool, unsandboxed, follows no link to an image, since the
    /// agent may have planted it), or (Claude) not an image by its content is refused
    /// ([`PoolError::InvalidRequest`]) before the turn starts. [`crate::backend::image::images_of`] takes them from a message's
    /// attachments.
    pub async fn start_turn_with_images(
        &mut self,
        prompt: &str,
        images: &[PathBuf],
    ) -> Result<CliLeaseTurn<'_>, PoolError> {
        if let Err(e) = crate::backend::image::check_files(images).await {
            return Err(PoolError::InvalidRequest(format!(
                "backend `{}`: {e}",
                self.backend
            )));
        }
        self.bind_unbound().await?;
        // A live process that died since the last turn crashed.
        self.settle_process(ProcessExit::Crash);
        let Some(conversation) = self.conversation.as_mut() else {
            return Err(PoolError::Internal("a CLI lease without its runner".into()));
        };
        conversation.set_turn_limit(self.turn_timeout);
        let spawning = Instant::now();
        let turn = match conversation.start_turn_with_images(prompt, images).await {
            Ok(turn) => turn,
            Err(e) => {
                // A turn that fails to start has stopped the process it found running (to
                // start it again: an expired bridge) before its start failed; one whose
                // image could not be read (read before anything else) stopped nothing.
                let untouched = matches!(
                    &e,
                    CliStartError::Live(crate::backend::claude_live::ClaudeLiveError::Image(_))
                );
                if self.process.is_some() && !untouched {
                    crate::metrics::process_exited(&self.backend, ProcessExit::Recycled);
                    self.process = None;
                }
                if let Some(result) = failed_start(&e) {
                    crate::metrics::process_started(&self.backend, result, spawning.elapsed());
                }
                return Err(start_error(&self.backend, e));
            }
        };
        let pid = turn.pid();
        if pid.is_some() && pid != self.process {
            if self.process.is_some() {
                // The live runner stopped its process to start one anew (an expired bridge).
                crate::metrics::process_exited(&self.backend, ProcessExit::Recycled);
            }
            crate::metrics::process_started(&self.backend, SpawnResult::Ok, spawning.elapsed());
            self.process = pid;
        }
        // The limit interrupts the turn through its abort handle (a task, so no read of the
        // runner is ever cut short); the runner then ends it `aborted`, which `next` reports
        // as the timeout it was. Each turn has its own handle: a late firing cannot reach
        // the next turn.
        let stopped = Arc::new(StopReason::default());
        // The gateway's abort ([`CliPool::abort`]) reaches the turn through its handle too,
        // until the turn ends or is dropped.
        self.pool.running().insert(
            self.conversation_key.clone(),
            RunningTurn {
                handle: turn.abort_handle(),
                stopped: stopped.clone(),
            },
        );
        let timer = self.turn_timeout.map(|limit| {
            let abort = turn.abort_handle();
            let reason = stopped.clone();
            let timer = tokio::spawn(async move {
                tokio::time::sleep(limit).await;
                // A turn aborted already ends `aborted`, not as a timeout.
                if reason.decide(StopReason::TIMED_OUT) {
                    abort.abort();
                }
            });
            (timer, limit)
        });
        Ok(CliLeaseTurn {
            turn,
            timer,
            stopped,
            pool: &self.pool,
            slot: &self.conversation_key,
            cwd: &self.cwd,
            backend: &self.backend,
            crashed: &mut self.crashed,
            process: &mut self.process,
            record: &mut self.record,
            started: Instant::now(),
            ending: None,
        })
    }

    /// Binds the session id the runner holds when its last turn's binding could not be
    /// written (a full disk), before another turn runs: no conversation runs unrecorded,
    /// since a crash would then start it anew, its history lost. Still failing, the turn is
    /// refused ([`PoolError::StateUnwritable`]).
    async fn bind_unbound(&mut self) -> Result<(), PoolError> {
        let Some(id) = self
            .conversation
            .as_ref()
            .and_then(|c| c.session_id())
            .filter(|id| !self.record.holds(id, &self.cwd))
            .map(str::to_owned)
        else {
            return Ok(());
        };
        self.record.bind_off_thread(&id, &self.cwd).await
    }

    /// Runs one turn to its end, handing each event to `on_event`.
    pub async fn run(
        &mut self,
        prompt: &str,
        mut on_event: impl FnMut(&BackendEvent),
    ) -> Result<CliTurnOutcome, PoolError> {
        let mut turn = self.start_turn(prompt).await?;
        while let Some(event) = turn.next().await {
            on_event(&event);
            if let BackendEvent::TurnEnd(outcome) = event {
                return Ok(outcome);
            }
        }
        Err(PoolError::Internal(
            "a CLI turn ended without turn.end".into(),
        ))
    }
}

impl Drop for CliLeaseTurn<'_> {
    fn drop(&mut self) {
        self.pool.running().remove(self.slot);
        if let Some((timer, _)) = self.timer.take() {
            timer.abort();
        }
        // A one-shot turn dropped before its end took its process with it.
        if self.oneshot() && self.process.take().is_some() {
            crate::metrics::process_exited(self.backend, ProcessExit::Completed);
        }
    }
}

/// A running turn of a [`CliLease`].
pub struct CliLeaseTurn<'a> {
    turn: CliTurn<'a>,
    /// The task that interrupts the turn at its time limit, and the limit.
    timer: Option<(tokio::task::JoinHandle<()>, Duration)>,
    /// Why the turn was stopped, if it was: by its timer, or by an abort.
    stopped: Arc<StopReason>,
    /// The pool, which holds the turn's abort handle under `slot` while it runs.
    pool: &'a CliPool,
    slot: &'a str,
    /// The conversation's working directory (recorded in its binding).
    cwd: &'a std::path::Path,
    backend: &'a str,
    crashed: &'a mut bool,
    /// The lease's counted process (see `CliLease::process`).
    process: &'a mut Option<u32>,
    /// Where the lease's session id is bound (see `CliLease::record`).
    record: &'a mut SessionRecord,
    started: Instant,
    /// The turn's `turn.end` while its session id is being bound: a `next` cancelled during
    /// the write loses nothing (the next call binds and returns it).
    ending: Option<BackendEvent>,
}

impl CliLeaseTurn<'_> {
    /// Whether the backend is one-shot: its process ends with its turn.
    fn oneshot(&self) -> bool {
        self.record.kind == BackendKind::CliOneshot
    }

    /// A handle that interrupts the turn (it ends `aborted`).
    pub fn abort_handle(&self) -> crate::backend::AbortHandle {
        self.turn.abort_handle()
    }

    /// The pid (= process group id) of the process serving the turn, while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.turn.pid()
    }

    /// The next event; `None` after `turn.end`. At `turn.end` the CLI session id is bound
    /// durably (a binding that cannot be written is logged: the session id is still in the
    /// outcome) and the turn counted in the metrics.
    pub async fn next(&mut self) -> Option<BackendEvent> {
        if let Some(ending) = self.ending.take() {
            return self.bound(ending).await;
        }
        let mut event = self.turn.next().await?;
        if let BackendEvent::TurnEnd(outcome) = &mut event {
            // Ended: nothing is left to abort.
            self.pool.running().remove(self.slot);
            if let Some((timer, limit)) = self.timer.take() {
                timer.abort();
                if self.stopped.timed_out() && outcome.end == Some(TurnEnd::Aborted) {
                    outcome.end = Some(TurnEnd::Timeout);
                    outcome.failure = Some(TurnFailure::TimedOut {
                        limit_secs: limit.as_secs(),
                        stderr_tail: String::new(),
                    });
                }
            }
            let end = outcome.end.unwrap_or(TurnEnd::Error);
            if end == TurnEnd::Crashed {
                *self.crashed = true;
            }
            if self.process.is_some() && (end == TurnEnd::Crashed || self.oneshot()) {
                let why = if end == TurnEnd::Crashed {
                    ProcessExit::Crash
                } else {
                    ProcessExit::Completed
                };
                crate::metrics::process_exited(self.backend, why);
                *self.process = None;
            }
            crate::metrics::cli_turn_finished(self.backend, end, self.started.elapsed());
            for (kind, n) in outcome.usage.by_kind() {
                crate::metrics::tokens(self.backend, kind, n);
            }
            return self.bound(event).await;
        }
        Some(event)
    }

    /// The turn's outcome when it has ended and only its binding's write was still under way
    /// (a caller that stops waiting then, its gateway gone, still has the turn's end: the
    /// session id is bound before the next turn, or when the runner is closed).
    pub fn take_ended(&mut self) -> Option<CliTurnOutcome> {
        match self.ending.take()? {
            BackendEvent::TurnEnd(outcome) => Some(outcome),
            _ => None,
        }
    }

    /// `ending` (the turn's `turn.end`) once its session id is bound, unless it is bound
    /// there already (a binding that cannot be written is logged: it is tried again before
    /// the next turn, or when the runner is closed, [`SessionRecord`]).
    async fn bound(&mut self, ending: BackendEvent) -> Option<BackendEvent> {
        let BackendEvent::TurnEnd(outcome) = &ending else {
            return Some(ending);
        };
        let Some(id) = outcome
            .session_id
            .clone()
            .filter(|id| !self.record.holds(id, self.cwd))
        else {
            return Some(ending);
        };
        self.ending = Some(ending);
        if let Err(error) = self.record.bind_off_thread(&id, self.cwd).await {
            tracing::warn!(%error, "could not record a CLI backend's session id");
        }
        self.ending.take()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A pool of one CLI backend `id` with `config`, its bindings under `dir`.
    fn pool(id: &str, config: CliBackendConfig, dir: &std::path::Path) -> Arc<CliPool> {
        let bindings = Arc::new(BindingStore::open(dir).expect("bindings"));
        pool_with(id, config, bindings)
    }

    /// A pool of one CLI backend `id` with `config` and `bindings`.
    fn pool_with(id: &str, config: CliBackendConfig, bindings: Arc<BindingStore>) -> Arc<CliPool> {
        Arc::new(CliPool::new(
            BTreeMap::from([(id.to_owned(), config)]),
            Caps {
                max_processes: 4,
                max_per_key: 4,
                max_waiters: 4,
                max_waiters_per_agent: 4,
            },
            RestartPolicy::default(),
            bindings,
        ))
    }

    #[test]
    fn cli_bindings_an_earlier_version_kept_among_the_copilot_runtimes_move_to_a_store_of_their_own()
     {
        let dir = tempfile::tempdir().expect("tempdir");
        let bound = |key: &str, id: &str| Binding {
            session_key: key.to_owned(),
            cli_session_id: CliSessionId::new(id.to_owned()),
            compat_key: "c".to_owned(),
            updated_at_ms: 0,
            working_directory: None,
        };
        let claude = CliNames::new("agent", "k", "claude-cli").binding;
        let copilot = BindingStore::open(dir.path()).expect("bindings");
        copilot.put(&bound(&claude, "claude-1")).expect("put");
        copilot.put(&bound("agent/k", "copilot-1")).expect("put");
        // Of a backend not configured: no CLI conversation's, left where it is.
        let other = CliNames::new("agent", "k", "gone-cli").binding;
        copilot.put(&bound(&other, "copilot-2")).expect("put");
        let backends = ["claude-cli".to_owned()];
        let cli = open_bindings(dir.path(), &copilot, &backends).expect("opened");
        assert_eq!(cli.list().expect("list"), vec![bound(&claude, "claude-1")]);
        assert_eq!(
            copilot.list().expect("list"),
            vec![bound("agent/k", "copilot-1"), bound(&other, "copilot-2")]
        );
        // Now a Copilot conversation may be keyed so: it is bound in its own store, and the
        // Claude conversation's binding is not touched, at this open or the next.
        let copilot_key = super::super::ConversationId::new("agent", "k#backend=claude-cli").key();
        assert_eq!(copilot_key, claude);
        copilot.put(&bound(&copilot_key, "copilot-3")).expect("put");
        let cli = open_bindings(dir.path(), &copilot, &backends).expect("opened again");
        assert_eq!(
            cli.get(&claude).expect("read"),
            Some(bound(&claude, "claude-1"))
        );
        assert_eq!(
            copilot.get(&copilot_key).expect("read"),
            Some(bound(&copilot_key, "copilot-3"))
        );
    }

    fn ask(id: &str, home: PathBuf, cwd: PathBuf) -> CliAsk {
        CliAsk {
            backend: id.to_owned(),
            conversation: format!("agent/k#{id}"),
            home,
            cwd,
            creds: CliCredentials {
                base_url: Some("http://127.0.0.1:9/v1".to_owned()),
                api_key: Some(crate::secret::Secret::new("sk-FAKE")),
                profile_id: None,
            },
            model: None,
            reasoning_effort: None,
            permission: Arc::new(crate::permission::ApproveAll),
            fail_if_busy: false,
            wait: Duration::from_secs(5),
            turn_timeout: None,
            tools: Vec::new(),
            system_prompt: None,
            sandbox: None,
            group_ledger: None,
        }
    }

    #[test]
    fn a_start_the_runner_refused_before_any_process_counts_no_failed_spawn() {
        use crate::backend::claude_live::ClaudeLiveError as L;
        use crate::backend::oneshot::OneshotError as O;
        let refused = [
            CliStartError::Live(L::SystemMessageTooLong { bytes: 2, max: 1 }),
            CliStartError::Oneshot(O::SystemMessageTooLong { bytes: 2, max: 1 }),
            CliStartError::Oneshot(O::PromptTooLong { chars: 2, max: 1 }),
        ];
        for error in &refused {
            assert_eq!(failed_start(error), None, "{error}");
        }
    }

    /// A pool of a generic one-shot CLI (`sh-cli`) whose turns would run for 30 s, a lease
    /// of conversation `agent`/`k` on it, and that conversation's key.
    async fn sleeping_cli_lease(dir: &std::path::Path) -> (Arc<CliPool>, CliLease, String) {
        let mut config = CliBackendConfig::new("/bin/sh");
        config.args = vec!["-c".into(), "sleep 30 & wait".into(), "sh".into()];
        config.output = crate::backend::OutputFormat::Jsonl;
        config.session_mode = crate::backend::SessionMode::None;
        let pool = pool("sh-cli", config, &dir.join("state"));
        let (home, cwd) = (dir.join("home"), dir.join("work"));
        std::fs::create_dir_all(&cwd).expect("work");
        let names = CliNames::new("agent", "k", "sh-cli");
        let conversation = super::super::ConversationId::new("agent", "k").key();
        let mut asked = ask("sh-cli", home, cwd);
        asked.conversation = names.slot.clone();
        let lease = pool
            .lease(asked, names.binding.clone())
            .await
            .expect("lease");
        (pool, lease, conversation)
    }

    #[tokio::test]
    async fn the_gateways_abort_ends_a_turn_running_on_a_cli_backend_and_reaches_no_other() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (pool, mut lease, conversation) = sleeping_cli_lease(dir.path()).await;
        assert!(!pool.abort(&conversation), "a lease without a turn");
        let mut turn = lease.start_turn("hello").await.expect("turn");
        let other = super::super::ConversationId::new("agent", "other").key();
        assert!(!pool.abort(&other), "another conversation runs nothing");
        assert!(pool.abort(&conversation), "the running turn was reached");
        let outcome = tokio::time::timeout(Duration::from_secs(5), async {
            loop {
                match turn.next().await {
                    Some(BackendEvent::TurnEnd(outcome)) => return outcome,
                    Some(_) => {}
                    None => panic!("the turn ended without turn.end"),
                }
            }
        })
        .await
        .expect("the aborted turn ended at once, not after its 30 s");
        assert_eq!(outcome.end, Some(TurnEnd::Aborted), "{outcome:?}");
        assert!(
            !pool.abort(&conversation),
            "an ended turn is no longer there to abort"
        );
        drop(turn);
        drop(lease);
        pool.shutdown(Duration::from_secs(5)).await;
    }

    #[tokio::test(start_paused = true)]
    async fn a_turn_aborted_as_its_time_limit_passes_ends_aborted_not_timed_out() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (pool, mut lease, conversation) = sleeping_cli_lease(dir.path()).await;
        lease.set_turn_timeout(Some(Duration::from_secs(10)));
        let mut turn = lease.start_turn("hello").await.expect("turn");
        // The timer's task starts its wait (this test's runtime has one thread).
        for _ in 0..8 {
            tokio::task::yield_now().await;
        }
        // The gateway's abort first, then the limit passes before the turn's end is read.
        assert!(pool.abort(&conversation));
        tokio::time::advance(Duration::from_secs(11)).await;
        for _ in 0..8 {
            tokio::task::yield_now().await;
        }
        let outcome = loop {
            match turn.next().await {
                Some(BackendEvent::TurnEnd(outcome)) => break outcome,
                Some(_) => {}
                None => panic!("the turn ended without turn.end"),
            }
        };
        assert_eq!(outcome.end, Some(TurnEnd::Aborted), "{outcome:?}");
        drop(turn);
        drop(lease);
        pool.shutdown(Duration::from_secs(5)).await;
    }

    #[tokio::test]
    async fn a_kept_conversation_runs_each_leases_model_system_prompt_and_turn_limit() {
        let dir = tempfile::tempdir().expect("tempdir");
        // A generic one-shot CLI that answers with the arguments it was given.
        let mut config = CliBackendConfig::new("/bin/sh");
        let script = r#"echo "{\"type\":\"item.completed\",\"item\":{\"id\":\"m\",\"type\":\"agent_message\",\"text\":\"$*\"}}""#;
        config.args = vec!["-c".into(), script.into(), "sh".into()];
        config.output = crate::backend::OutputFormat::Jsonl;
        config.session_mode = crate::backend::SessionMode::None;
        config.model_arg = Some("--model".into());
        config.system_prompt_arg = Some("--system".into());
        let pool = pool("sh-cli", config, &dir.path().join("state"));
        let (home, cwd) = (dir.path().join("home"), dir.path().join("work"));
        std::fs::create_dir_all(&cwd).expect("work");
        let names = CliNames::new("agent", "k", "sh-cli");
        async fn turn_text(lease: &mut CliLease) -> String {
            let mut turn = lease.start_turn("hello").await.expect("turn");
            loop {
                match turn.next().await {
                    Some(BackendEvent::TurnEnd(outcome)) => return outcome.text,
                    Some(_) => {}
                    None => panic!("the turn ended without turn.end"),
                }
            }
        }
        for (model, system, limit) in [
            ("model-one", "first-rules", None),
            ("model-two", "second-rules", Some(Duration::from_secs(1800))),
        ] {
            let mut asked = ask("sh-cli", home.clone(), cwd.clone());
            asked.conversation = names.slot.clone();
            asked.model = Some(model.to_owned());
            asked.system_prompt = Some(system.to_owned());
            let mut lease = pool
                .lease(asked, names.binding.clone())
                .await
                .expect("lease");
            lease.set_turn_timeout(limit);
            let text = tokio::time::timeout(Duration::from_secs(10), turn_text(&mut lease))
                .await
                .expect("the turn ended");
            assert!(
                text.contains(&format!("--model {model}"))
                    && text.contains(&format!("--system {system}")),
                "{text}"
            );
            let own = lease
                .conversation
                .as_ref()
                .and_then(CliConversation::own_turn_limit);
            let wanted = limit.map_or(crate::backend::oneshot::DEFAULT_TURN_TIMEOUT, |l| {
                l + crate::backend::ONESHOT_LIMIT_MARGIN
            });
            assert_eq!(own, Some(wanted));
            drop(lease);
        }
        pool.shutdown(Duration::from_secs(5)).await;
    }

    #[tokio::test]
    async fn a_refreshed_credential_starts_the_new_claude_process_only_after_the_old_one_is_gone() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().expect("tempdir");
        let log = dir.path().join("log");
        let script = dir.path().join("claude");
        let id = "8f14e45f-ceea-467f-a8f0-3a1b0c6f2d11";
        // Answers one turn, then takes half a second to go once its input closes.
        std::fs::write(
            &script,
            format!(
                "#!/bin/sh\necho \"start $$\" >> '{log}'\nread prompt\n\
                 echo '{{\"type\":\"system\",\"subtype\":\"init\",\"session_id\":\"{id}\"}}'\n\
                 echo '{{\"type\":\"result\",\"subtype\":\"success\",\"is_error\":false,\"result\":\"hi\",\"session_id\":\"{id}\",\"usage\":{{}}}}'\n\
                 while read line; do :; done\n/bin/sleep 0.5\necho \"exit $$\" >> '{log}'\n",
                log = log.display()
            ),
        )
        .expect("script");
        std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o755)).expect("mode");
        let mut config = CliBackendConfig::claude_cli();
        config.command = script.display().to_string();
        let pool = pool("claude-cli", config, &dir.path().join("state"));
        let (home, cwd) = (dir.path().join("home"), dir.path().join("work"));
        std::fs::create_dir_all(&cwd).expect("work");
        let names = CliNames::new("agent", "k", "claude-cli");
        // One turn of the conversation with `key`; the lease is kept until the next.
        let turn = async |key: &str| {
            let mut asked = ask("claude-cli", home.clone(), cwd.clone());
            asked.conversation = names.slot.clone();
            asked.creds.api_key = Some(crate::secret::Secret::new(key));
            let mut lease = pool
                .lease(asked, names.binding.clone())
                .await
                .expect("lease");
            let outcome = lease.run("hello", |_| {}).await.expect("turn");
            assert_eq!(outcome.end, Some(TurnEnd::Idle), "{outcome:?}");
            lease
        };
        drop(turn("sk-FAKE").await);
        // The same conversation with a refreshed key: its parked process is closed, and the
        // new one starts only once the old one is gone; a lease that gives up while it
        // waits leaves the next one waiting too.
        let mut asked = ask("claude-cli", home.clone(), cwd.clone());
        asked.conversation = names.slot.clone();
        asked.creds.api_key = Some(crate::secret::Secret::new("sk-FAKE-refreshed"));
        let given_up = tokio::time::timeout(
            Duration::from_millis(100),
            pool.lease(asked, names.binding.clone()),
        )
        .await;
        assert!(given_up.is_err(), "the lease was still waiting");
        let lease = turn("sk-FAKE-refreshed").await;
        let text = std::fs::read_to_string(&log).expect("log");
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 3, "{text}");
        let old = lines[0].trim_start_matches("start ");
        assert_eq!(
            lines[1],
            format!("exit {old}"),
            "the old process was gone before the new one started: {text}"
        );
        assert!(lines[2].starts_with("start "), "{text}");
        drop(lease);
        pool.shutdown(Duration::from_secs(5)).await;
    }

    #[tokio::test]
    async fn a_custom_id_running_codex_checks_its_rollout_and_a_missing_one_is_transcript_missing()
    {
        let dir = tempfile::tempdir().expect("tempdir");
        // `[backends.my-codex]`: the bundled Codex keys under another id, no `dialect` key.
        let mut config = CliBackendConfig::codex_cli();
        config.dialect = None;
        config.command = "/opt/codex/bin/codex".to_owned();
        assert_eq!(config.dialect_of("my-codex"), Dialect::Codex);
        let pool = pool("my-codex", config, &dir.path().join("state"));
        let (home, cwd) = (dir.path().join("home"), dir.path().join("work"));
        let ask = ask("my-codex", home.clone(), cwd);
        let id = "019a227d-9ace-7703-b7ac-389dd1c45dcf";
        let bindings_key = "agent/k#backend=my-codex".to_owned();
        pool.bindings
            .put(&Binding {
                session_key: bindings_key.clone(),
                cli_session_id: CliSessionId::new(id.to_owned()),
                compat_key: session::identity(&ask.creds),
                updated_at_ms: 0,
                working_directory: None,
            })
            .expect("bound");
        let error = pool
            .lease(ask, bindings_key.clone())
            .await
            .expect_err("no rollout: no resume");
        assert!(
            matches!(&error, PoolError::TranscriptMissing { backend, session_id, .. }
                if backend == "my-codex" && session_id == id),
            "{error:?}"
        );
        // With the rollout there, the stored thread resumes.
        let day = home.join(".codex/sessions/2026/12/01");
        std::fs::create_dir_all(&day).expect("dir");
        std::fs::write(
            day.join(format!("rollout-2026-12-01T10-00-00-{id}.jsonl")),
            "{}",
        )
        .expect("rollout");
        let lease = pool
            .lease(
                self::ask("my-codex", home, dir.path().join("work")),
                bindings_key,
            )
            .await
            .expect("resumed");
        assert_eq!(lease.reason(), OpenReason::Resumed);
        assert_eq!(lease.dialect(), Dialect::Codex);
    }

    /// A pool of the bundled Codex backend under `dir`, an agent home and working directory
    /// there, and the names of conversation `agent/k` on it.
    fn codex_pool(dir: &std::path::Path) -> (Arc<CliPool>, PathBuf, PathBuf, CliNames) {
        let pool = pool(
            "codex-cli",
            CliBackendConfig::codex_cli(),
            &dir.join("state"),
        );
        let names = CliNames::new("agent", "k", "codex-cli");
        (pool, dir.join("home"), dir.join("work"), names)
    }

    /// A lease of [`codex_pool`]'s conversation `names` (its home and work directory under
    /// `dir`).
    fn codex_lease<'a>(
        pool: &'a Arc<CliPool>,
        dir: &std::path::Path,
        names: &CliNames,
    ) -> impl std::future::Future<Output = Result<CliLease, PoolError>> + 'a {
        pool.lease(
            ask("codex-cli", dir.join("home"), dir.join("work")),
            names.binding.clone(),
        )
    }

    /// A Codex rollout of thread `id` under `home`.
    fn codex_rollout(home: &std::path::Path, id: &str) -> PathBuf {
        let day = home.join(".codex/sessions/2026/12/01");
        std::fs::create_dir_all(&day).expect("dir");
        let file = day.join(format!("rollout-2026-12-01T10-00-00-{id}.jsonl"));
        std::fs::write(&file, "{}").expect("rollout");
        file
    }

    #[tokio::test]
    async fn a_deleted_conversation_loses_its_rollout_and_binding_but_nothing_through_a_link() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (pool, home, cwd, names) = codex_pool(dir.path());
        let ask = ask("codex-cli", home.clone(), cwd.clone());
        assert_eq!(names.slot, ask.conversation, "the lease's slot");
        let key = names.binding.as_str();
        let identity = session::identity(&ask.creds);
        let bind = |id: &str| {
            pool.bindings
                .put(&Binding {
                    session_key: key.to_owned(),
                    cli_session_id: CliSessionId::new(id.to_owned()),
                    compat_key: identity.clone(),
                    updated_at_ms: 0,
                    working_directory: None,
                })
                .expect("bound");
        };
        let id = "019a227d-9ace-7703-b7ac-389dd1c45dcf";
        bind(id);
        let file = codex_rollout(&home, id);
        let other = codex_rollout(&home, "019a227d-0000-7703-b7ac-389dd1c45dcf");
        // While a lease holds it, the deletion is refused and nothing is touched.
        let lease = pool.lease(ask, key.to_owned()).await.expect("resumed");
        let busy = pool
            .delete("codex-cli", &names, Some(home.clone()), &cwd, None)
            .await;
        assert!(
            matches!(busy, Err(PoolError::ConversationBusy { .. })),
            "{busy:?}"
        );
        assert!(file.is_file());
        drop(lease);
        assert_eq!(
            pool.delete("codex-cli", &names, Some(home.clone()), &cwd, None)
                .await
                .expect("deleted"),
            Some(cwd.clone())
        );
        assert!(
            !file.exists() && other.is_file(),
            "only its own rollout goes"
        );
        assert!(pool.bindings.get(key).expect("read").is_none());
        assert_eq!(
            pool.delete("codex-cli", &names, Some(home.clone()), &cwd, None)
                .await
                .expect("nothing"),
            None
        );
        // A link the agent planted in its home to another's sessions: the pool, not
        // sandboxed, removes nothing through it (and still forgets the session).
        let victim = dir.path().join("victim");
        let theirs = codex_rollout(&victim, id);
        std::fs::remove_dir_all(home.join(".codex/sessions")).expect("rm");
        std::os::unix::fs::symlink(victim.join(".codex/sessions"), home.join(".codex/sessions"))
            .expect("link");
        bind(id);
        assert!(
            pool.delete("codex-cli", &names, Some(home.clone()), &cwd, None)
                .await
                .expect("deleted")
                .is_some()
        );
        assert!(theirs.is_file(), "nothing removed outside the agent's home");
        assert!(pool.bindings.get(key).expect("read").is_none());
    }

    #[tokio::test]
    async fn a_one_shot_conversation_given_back_is_parked_for_its_next_lease_without_a_slot() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (pool, _, _, names) = codex_pool(dir.path());
        let lease = codex_lease(&pool, dir.path(), &names)
            .await
            .expect("leased");
        assert_eq!(pool.lock().core.view().held, 1, "a lease takes a slot");
        drop(lease);
        assert!(pool.holds(&names.slot), "parked for its next lease");
        assert_eq!(pool.lock().core.view().held, 0, "with no process, no slot");
    }

    #[tokio::test]
    async fn a_waiter_refused_by_the_shutdown_and_then_dropped_leaves_the_holders_lease_alone() {
        use futures_util::FutureExt;
        let dir = tempfile::tempdir().expect("tempdir");
        let (pool, _, _, names) = codex_pool(dir.path());
        let holder = codex_lease(&pool, dir.path(), &names)
            .await
            .expect("leased");
        let mut waiter = Box::pin(codex_lease(&pool, dir.path(), &names));
        assert!(
            (&mut waiter).now_or_never().is_none(),
            "waits behind the holder"
        );
        // The shutdown refuses the waiter; its caller goes away before it reads the refusal.
        pool.shutdown(Duration::ZERO).await;
        drop(waiter);
        assert_eq!(
            pool.lock().core.view().held,
            1,
            "the holder's conversation is still held"
        );
        drop(holder);
    }

    #[tokio::test]
    async fn a_waiter_that_gives_up_waiting_or_once_granted_passes_the_conversation_to_the_one_behind_it()
     {
        use futures_util::FutureExt;
        let dir = tempfile::tempdir().expect("tempdir");
        let (pool, _, _, names) = codex_pool(dir.path());
        let lease = || codex_lease(&pool, dir.path(), &names);
        let holder = lease().await.expect("leased");
        // Three callers wait for the held conversation, in turn.
        let mut first = Box::pin(lease());
        let mut second = Box::pin(lease());
        let mut third = Box::pin(lease());
        for waiter in [&mut first, &mut second, &mut third] {
            assert!(waiter.now_or_never().is_none(), "waits behind the holder");
        }
        // The first gives up while it waits.
        drop(first);
        // The holder is done: the second is granted, but its caller goes away before it reads
        // the grant.
        drop(holder);
        drop(second);
        // The third gets the conversation, within its wait.
        let third = third.await.expect("the third waiter is granted");
        assert_eq!(pool.lock().core.view().held, 1, "held by the third alone");
        drop(third);
        assert_eq!(pool.lock().core.view().held, 0);
    }

    /// A disk that is full while `full` is set (the bindings' writes fail), and whose next
    /// write, once `stall` is set, says so on its first channel and waits for the second.
    #[derive(Debug, Default)]
    struct FullWhile {
        full: AtomicBool,
        /// Writes begun (a binding's and its index entry's each count).
        writes: std::sync::atomic::AtomicUsize,
        #[allow(clippy::type_complexity)]
        stall: std::sync::Mutex<
            Option<(
                tokio::sync::oneshot::Sender<()>,
                std::sync::mpsc::Receiver<()>,
            )>,
        >,
    }

    impl crate::faults::DiskFaults for FullWhile {
        fn before_write(&self, _: crate::faults::Store) -> Option<std::io::Error> {
            self.writes.fetch_add(1, Ordering::SeqCst);
            let stall = self.stall.lock().expect("stall").take();
            if let Some((entered, release)) = stall {
                let _ = entered.send(());
                let _ = release.recv();
            }
            self.full
                .load(Ordering::SeqCst)
                .then(|| std::io::Error::from_raw_os_error(nix::libc::ENOSPC))
        }
    }

    /// A pool of a fake Codex under `dir` (a whole turn on thread `$(cat id)`, the id read
    /// from the working directory) whose bindings' disk is full while the returned switch is
    /// set; with the conversation's names, the agent's home and the working directory.
    fn codex_on_a_disk_that_fills(
        dir: &std::path::Path,
    ) -> (Arc<CliPool>, Arc<FullWhile>, CliNames, PathBuf, PathBuf) {
        let mut config = CliBackendConfig::codex_cli();
        let script = dir.join("codex");
        std::fs::write(
            &script,
            r#"#!/bin/sh
printf '{"type":"thread.started","thread_id":"%s"}\n' "$(cat id)"
echo '{"type":"item.completed","item":{"id":"m1","type":"agent_message","text":"hi"}}'
echo '{"type":"turn.completed","usage":{"input_tokens":1,"cached_input_tokens":0,"output_tokens":1}}'
"#,
        )
        .expect("script");
        std::fs::set_permissions(&script, std::os::unix::fs::PermissionsExt::from_mode(0o755))
            .expect("executable");
        config.command = script.display().to_string();
        let disk = Arc::new(FullWhile::default());
        let bindings = BindingStore::open(&dir.join("state"))
            .expect("bindings")
            .with_disk_faults(Some(disk.clone()));
        let pool = pool_with("codex-cli", config, Arc::new(bindings));
        let names = CliNames::new("agent", "k", "codex-cli");
        let (home, cwd) = (dir.join("home"), dir.join("work"));
        std::fs::create_dir_all(&cwd).expect("work");
        (pool, disk, names, home, cwd)
    }

    #[tokio::test]
    async fn a_turns_end_writes_the_binding_only_when_the_session_or_its_directory_is_new() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (pool, disk, names, home, cwd) = codex_on_a_disk_that_fills(dir.path());
        let writes = || disk.writes.load(Ordering::SeqCst);
        let bound = || {
            pool.bindings
                .get(&names.binding)
                .expect("read")
                .expect("bound")
        };
        let lease_in = |cwd: &PathBuf| {
            pool.lease(
                ask("codex-cli", home.clone(), cwd.clone()),
                names.binding.clone(),
            )
        };
        let ran = |outcome: Result<CliTurnOutcome, PoolError>| {
            let outcome = outcome.expect("ran");
            assert_eq!(outcome.end, Some(TurnEnd::Idle), "{outcome:?}");
        };
        std::fs::write(cwd.join("id"), "0199aaaa-0000-7000-8000-000000000004").expect("id");
        let mut lease = lease_in(&cwd).await.expect("leased");
        ran(lease.run("hello", |_| {}).await);
        let first = writes();
        assert!(first > 0, "the new session was not bound");
        // The same session in the same directory: nothing written.
        ran(lease.run("again", |_| {}).await);
        assert_eq!(writes(), first, "the binding was written again");
        // The next lease takes the parked runner over, and with it what is bound.
        drop(lease);
        let mut lease = lease_in(&cwd).await.expect("leased");
        ran(lease.run("and again", |_| {}).await);
        assert_eq!(writes(), first, "the binding was written again");
        // Another session id: bound.
        std::fs::write(cwd.join("id"), "0199aaaa-0000-7000-8000-000000000005").expect("id");
        ran(lease.run("a new thread", |_| {}).await);
        let second = writes();
        assert!(second > first, "the new session was not bound");
        assert_eq!(
            bound().cli_session_id.as_str(),
            "0199aaaa-0000-7000-8000-000000000005"
        );
        // A runner closed (idle) and started again in the same directory resumes the stored
        // session as bound there: nothing written.
        drop(lease);
        codex_rollout(&home, "0199aaaa-0000-7000-8000-000000000005");
        pool.close_idle(Duration::ZERO);
        let closing = pool.lock().closing.get(&names.slot).cloned();
        let _ = closing.expect("closing").wait_for(|gone| *gone).await;
        let mut lease = lease_in(&cwd).await.expect("leased");
        ran(lease.run("resumed", |_| {}).await);
        assert_eq!(writes(), second, "the resumed binding was written again");
        // The same session from another working directory: bound again, with it.
        drop(lease);
        let elsewhere = dir.path().join("elsewhere");
        std::fs::create_dir_all(&elsewhere).expect("elsewhere");
        std::fs::write(elsewhere.join("id"), "0199aaaa-0000-7000-8000-000000000005").expect("id");
        let mut lease = lease_in(&elsewhere).await.expect("leased");
        ran(lease.run("from elsewhere", |_| {}).await);
        assert!(writes() > second, "the new directory was not bound");
        assert_eq!(bound().working_directory, Some(elsewhere.clone()));
    }

    /// A lease of a fake Codex on thread `id` (under `dir`) whose next binding write stalls:
    /// with the pool, the names, the signal that the write began and the switch that lets it
    /// go on.
    async fn leased_with_a_stalling_write(
        dir: &std::path::Path,
        id: &str,
    ) -> (
        Arc<CliPool>,
        CliNames,
        CliLease,
        tokio::sync::oneshot::Receiver<()>,
        std::sync::mpsc::Sender<()>,
    ) {
        let (pool, disk, names, home, cwd) = codex_on_a_disk_that_fills(dir);
        std::fs::write(cwd.join("id"), id).expect("id");
        let lease = pool
            .lease(ask("codex-cli", home, cwd), names.binding.clone())
            .await
            .expect("leased");
        let (entered_tx, entered) = tokio::sync::oneshot::channel();
        let (release, release_rx) = std::sync::mpsc::channel();
        *disk.stall.lock().expect("stall") = Some((entered_tx, release_rx));
        (pool, names, lease, entered, release)
    }

    /// `turn`'s events up to its end, its `next` dropped once the binding's write began.
    async fn next_until_the_write_stalls(
        turn: &mut CliLeaseTurn<'_>,
        entered: &mut tokio::sync::oneshot::Receiver<()>,
    ) {
        loop {
            tokio::select! {
                biased;
                _ = &mut *entered => return,
                event = turn.next() => {
                    let event = event.expect("an event before the turn's end");
                    assert!(!matches!(event, BackendEvent::TurnEnd(_)), "{event:?}");
                }
            }
        }
    }

    #[tokio::test]
    async fn a_turn_end_whose_wait_for_its_binding_is_cancelled_is_still_the_next_event() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (pool, names, mut lease, mut entered, release) =
            leased_with_a_stalling_write(dir.path(), "0199aaaa-0000-7000-8000-000000000006").await;
        let mut turn = lease.start_turn("hello").await.expect("started");
        next_until_the_write_stalls(&mut turn, &mut entered).await;
        release.send(()).expect("release");
        let event = turn.next().await;
        assert!(
            matches!(&event, Some(BackendEvent::TurnEnd(o)) if o.end == Some(TurnEnd::Idle)),
            "{event:?}"
        );
        assert!(turn.next().await.is_none());
        drop(turn);
        let bound = pool.bindings.get(&names.binding).expect("read");
        assert_eq!(
            bound.map(|b| b.cli_session_id.into_string()).as_deref(),
            Some("0199aaaa-0000-7000-8000-000000000006")
        );
    }

    #[tokio::test]
    async fn a_caller_that_stops_waiting_during_the_binding_write_still_has_the_turns_end() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (pool, names, mut lease, mut entered, release) =
            leased_with_a_stalling_write(dir.path(), "0199aaaa-0000-7000-8000-000000000007").await;
        {
            let mut turn = lease.start_turn("hello").await.expect("started");
            assert!(turn.take_ended().is_none(), "not ended yet");
            next_until_the_write_stalls(&mut turn, &mut entered).await;
            // The gateway left: the turn's end is had without waiting for the write.
            let ended = turn.take_ended().expect("the turn's end");
            assert_eq!(ended.end, Some(TurnEnd::Idle), "{ended:?}");
        }
        release.send(()).expect("release");
        // The next turn waits for the abandoned write, then finds the id bound or binds it.
        let outcome = lease.run("again", |_| {}).await.expect("ran");
        assert_eq!(outcome.end, Some(TurnEnd::Idle), "{outcome:?}");
        let bound = pool.bindings.get(&names.binding).expect("read");
        assert_eq!(
            bound.map(|b| b.cli_session_id.into_string()).as_deref(),
            Some("0199aaaa-0000-7000-8000-000000000007")
        );
    }

    #[tokio::test]
    async fn a_session_id_whose_binding_write_failed_is_bound_before_the_next_turn_or_that_turn_is_refused()
     {
        let dir = tempfile::tempdir().expect("tempdir");
        let (pool, disk, names, home, cwd) = codex_on_a_disk_that_fills(dir.path());
        std::fs::write(cwd.join("id"), "0199aaaa-0000-7000-8000-000000000003").expect("id");
        let mut lease = pool
            .lease(
                ask("codex-cli", home.clone(), cwd.clone()),
                names.binding.clone(),
            )
            .await
            .expect("leased");
        disk.full.store(true, Ordering::SeqCst);
        let outcome = lease.run("hello", |_| {}).await.expect("ran");
        assert_eq!(outcome.end, Some(TurnEnd::Idle), "{outcome:?}");
        assert_eq!(pool.bindings.get(&names.binding).expect("read"), None);
        // Still full: the next turn does not run unrecorded.
        let refused = lease.run("again", |_| {}).await;
        assert!(
            matches!(refused, Err(PoolError::StateUnwritable { .. })),
            "{refused:?}"
        );
        // Room again: bound first, then it runs.
        disk.full.store(false, Ordering::SeqCst);
        let outcome = lease.run("again", |_| {}).await.expect("ran");
        assert_eq!(outcome.end, Some(TurnEnd::Idle), "{outcome:?}");
        let bound = pool.bindings.get(&names.binding).expect("read");
        assert_eq!(
            bound.map(|b| b.cli_session_id.into_string()).as_deref(),
            Some("0199aaaa-0000-7000-8000-000000000003")
        );
    }

    #[tokio::test]
    async fn a_session_id_whose_binding_write_failed_is_bound_when_its_runner_is_closed_if_its_cli_filed_it()
     {
        let dir = tempfile::tempdir().expect("tempdir");
        let (pool, disk, names, home, cwd) = codex_on_a_disk_that_fills(dir.path());
        // A turn on thread `id` whose binding cannot be written (the disk full), then the
        // conversation's runner closed (idle) once the disk has room again.
        let turn_unbound_then_closed = |id: &'static str| {
            let (pool, home, cwd, disk) = (&pool, &home, &cwd, &disk);
            let (key, slot) = (&names.binding, &names.slot);
            async move {
                std::fs::write(cwd.join("id"), id).expect("id");
                let mut lease = pool
                    .lease(ask("codex-cli", home.clone(), cwd.clone()), key.clone())
                    .await
                    .expect("leased");
                disk.full.store(true, Ordering::SeqCst);
                let outcome = lease.run("hello", |_| {}).await.expect("ran");
                assert_eq!(outcome.end, Some(TurnEnd::Idle), "{outcome:?}");
                assert_eq!(pool.bindings.get(key).expect("read"), None, "not bound");
                disk.full.store(false, Ordering::SeqCst);
                drop(lease);
                pool.close_idle(Duration::ZERO);
                let closing = pool.lock().closing.get(slot).cloned();
                let mut gone = closing.expect("closing");
                let _ = gone.wait_for(|gone| *gone).await;
                pool.bindings
                    .get(key)
                    .expect("read")
                    .map(|b| b.cli_session_id.into_string())
            }
        };
        // Codex filed no rollout of it: resuming it would fail, so it is not bound.
        let unfiled = "0199aaaa-0000-7000-8000-000000000001";
        assert_eq!(turn_unbound_then_closed(unfiled).await, None);
        // Filed: bound, and the next lease resumes it.
        let filed = "0199aaaa-0000-7000-8000-000000000002";
        codex_rollout(&home, filed);
        assert_eq!(
            turn_unbound_then_closed(filed).await.as_deref(),
            Some(filed)
        );
        let lease = codex_lease(&pool, dir.path(), &names)
            .await
            .expect("leased");
        assert_eq!(lease.reason(), OpenReason::Resumed);
        assert_eq!(lease.session_id(), Some(filed));
    }

    #[tokio::test]
    async fn a_lease_returned_during_the_shutdowns_grace_is_closed_not_parked() {
        use futures_util::FutureExt;
        let dir = tempfile::tempdir().expect("tempdir");
        let (pool, home, cwd, names) = codex_pool(dir.path());
        let lease = pool
            .lease(ask("codex-cli", home, cwd), names.binding.clone())
            .await
            .expect("leased");
        // The shutdown starts and gives the running lease its grace.
        let mut shutdown = Box::pin(pool.shutdown(Duration::from_secs(30)));
        assert!(
            (&mut shutdown).now_or_never().is_none(),
            "waits for the lease"
        );
        drop(lease);
        assert!(
            pool.lock().parked.is_empty(),
            "a lease returned after the shutdown began is not parked"
        );
        shutdown.await;
        assert!(!pool.holds(&names.slot));
        let closed = pool
            .lock()
            .closing
            .get(&names.slot)
            .map(|gone| *gone.borrow());
        assert_eq!(
            closed,
            Some(true),
            "its close was recorded, and the shutdown waited for it"
        );
    }

    #[tokio::test]
    async fn a_lease_granted_just_before_the_shutdown_starts_no_process_after_it() {
        use futures_util::FutureExt;
        let dir = tempfile::tempdir().expect("tempdir");
        let (pool, _, _, names) = codex_pool(dir.path());
        let lease = || codex_lease(&pool, dir.path(), &names);
        let holder = lease().await.expect("leased");
        let mut waiter = Box::pin(lease());
        assert!(
            (&mut waiter).now_or_never().is_none(),
            "waits behind the holder"
        );
        // Granted the conversation (its runner parked for it), not yet running when the
        // shutdown closes what is parked.
        drop(holder);
        pool.shutdown(Duration::ZERO).await;
        assert!(
            matches!(waiter.await, Err(PoolError::Closed)),
            "no new runner once the pool is closed"
        );
    }

    #[tokio::test]
    async fn a_kept_conversation_asked_for_in_another_directory_continues_in_that_one() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (pool, home, cwd, names) = codex_pool(dir.path());
        let elsewhere = dir.path().join("elsewhere");
        let runs_in = |lease: &CliLease| {
            lease
                .conversation
                .as_ref()
                .map(|c| c.working_directory().to_path_buf())
        };
        let first = codex_lease(&pool, dir.path(), &names)
            .await
            .expect("leased");
        assert_eq!(runs_in(&first), Some(cwd.clone()));
        drop(first);
        let next = pool
            .lease(
                ask("codex-cli", home.clone(), elsewhere.clone()),
                names.binding.clone(),
            )
            .await
            .expect("leased again");
        assert_eq!(
            runs_in(&next),
            Some(elsewhere.clone()),
            "its turns run where the lease asks, not where its kept runner was started"
        );
        assert_eq!(next.working_directory(), elsewhere);
    }

    #[tokio::test]
    async fn a_claude_conversation_moved_to_another_directory_starts_a_session_there() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (pool, names, home, ran_in, moved_to) = claude_deletion(dir.path());
        let id = "8f14e45f-ceea-467f-a8f0-3a1b0c6f2d13";
        let ask = |cwd: &std::path::Path| ask("claude-cli", home.clone(), cwd.to_path_buf());
        let identity = session::identity(&ask(&ran_in).creds);
        pool.bindings
            .put(&Binding {
                session_key: names.binding.clone(),
                cli_session_id: CliSessionId::new(id.to_owned()),
                compat_key: identity,
                updated_at_ms: 0,
                working_directory: Some(ran_in.clone()),
            })
            .expect("bound");
        let transcript = claude_transcript(&home, &ran_in, id);
        // Where its turns ran, it resumes.
        let lease = pool
            .lease(ask(&ran_in), names.binding.clone())
            .await
            .expect("resumed");
        assert_eq!(lease.reason, OpenReason::Resumed);
        drop(lease);
        // Elsewhere Claude Code cannot find it: a new session there, not `transcript-missing`
        // for as long as the gateway asks for the new directory.
        let lease = pool
            .lease(ask(&moved_to), names.binding.clone())
            .await
            .expect("a new session");
        assert_eq!(lease.reason, OpenReason::CompatChanged);
        assert!(pool.bindings.get(&names.binding).expect("read").is_none());
        assert!(transcript.exists(), "the old session's transcript stays");
    }

    /// A Codex pool whose conversation `agent/k` is bound to a thread with a rollout file:
    /// (pool, home, cwd, names, the rollout).
    fn bound_codex_conversation(
        dir: &std::path::Path,
    ) -> (Arc<CliPool>, PathBuf, PathBuf, CliNames, PathBuf) {
        let (pool, home, cwd, names) = codex_pool(dir);
        let id = "019a227d-9ace-7703-b7ac-389dd1c45dcf";
        pool.bindings
            .put(&Binding {
                session_key: names.binding.clone(),
                cli_session_id: CliSessionId::new(id.to_owned()),
                compat_key: "identity".to_owned(),
                updated_at_ms: 0,
                working_directory: None,
            })
            .expect("bound");
        let file = codex_rollout(&home, id);
        (pool, home, cwd, names, file)
    }

    /// Polls `future` exactly once: whether it was still pending. (On a test's one thread
    /// nothing else runs until it yields, so a spawned task has not run by then.)
    async fn still_pending_after_one_poll<F: std::future::Future>(
        mut future: std::pin::Pin<&mut F>,
    ) -> bool {
        std::future::poll_fn(|cx| std::task::Poll::Ready(future.as_mut().poll(cx).is_pending()))
            .await
    }

    #[tokio::test]
    async fn a_deletions_own_clean_up_runs_in_the_conversations_directory_while_it_is_still_held() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (pool, home, cwd, names, _) = bound_codex_conversation(dir.path());
        let (seen_tx, seen_rx) = tokio::sync::oneshot::channel();
        let held_pool = pool.clone();
        let slot = names.slot.clone();
        let while_held: WhileHeld = Box::new(move |work| {
            Box::pin(async move {
                let _ = seen_tx.send((work, held_pool.holds(&slot)));
            })
        });
        let deleted = pool
            .delete(
                "codex-cli",
                &names,
                Some(home.clone()),
                &cwd,
                Some(while_held),
            )
            .await
            .expect("deleted");
        let (work, held) = seen_rx.await.expect("the clean-up ran");
        assert_eq!(deleted, Some(work), "in the directory the deletion answers");
        assert!(held, "before the conversation was let go");
        assert!(!pool.holds(&names.slot), "let go after it");
    }

    #[tokio::test]
    async fn a_deletion_whose_caller_goes_away_still_finishes_before_the_conversation_is_free() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (pool, home, cwd, names, file) = bound_codex_conversation(dir.path());
        // Polled once, then dropped: the caller went away mid-way. (On this test's one
        // thread nothing else runs until it yields, so the first poll cannot finish.)
        let mut deletion =
            Box::pin(pool.delete("codex-cli", &names, Some(home.clone()), &cwd, None));
        assert!(
            still_pending_after_one_poll(deletion.as_mut()).await,
            "the deletion was still running when its caller left"
        );
        drop(deletion);
        // The conversation is held until the deletion is done, and then it is all done.
        let mut freed = pool.in_use.subscribe();
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        while pool.holds(&names.slot) {
            // Each release publishes the count in use; a bounded wait between looks.
            let _ = tokio::time::timeout_at(
                deadline.min(tokio::time::Instant::now() + Duration::from_millis(20)),
                freed.changed(),
            )
            .await;
            assert!(tokio::time::Instant::now() < deadline, "never released");
        }
        assert!(pool.bindings.get(&names.binding).expect("read").is_none());
        assert!(!file.exists());
    }

    /// A Claude pool in `dir` and its conversation `agent/k`, the agent's home, the directory
    /// its turns ran in and another one a deletion names: (pool, names, home, ran in, asked
    /// in).
    fn claude_deletion(
        dir: &std::path::Path,
    ) -> (Arc<CliPool>, CliNames, PathBuf, PathBuf, PathBuf) {
        let pool = pool(
            "claude-cli",
            CliBackendConfig::claude_cli(),
            &dir.join("state"),
        );
        let names = CliNames::new("agent", "k", "claude-cli");
        (
            pool,
            names,
            dir.join("home"),
            dir.join("ran-in"),
            dir.join("asked-in"),
        )
    }

    /// What deleting `names` answers, the deletion naming `asked_in` as its directory.
    async fn claude_deleted(
        pool: &Arc<CliPool>,
        names: &CliNames,
        home: &std::path::Path,
        asked_in: &std::path::Path,
    ) -> Option<PathBuf> {
        let home = Some(home.to_path_buf());
        pool.delete("claude-cli", names, home, asked_in, None)
            .await
            .expect("deleted")
    }

    /// Claude's transcript of session `id` in `home`, as its CLI files it for a session run
    /// in `ran_in`: written, its path.
    fn claude_transcript(home: &std::path::Path, ran_in: &std::path::Path, id: &str) -> PathBuf {
        let transcript = CliConversation::transcript_path(home, ran_in, id);
        std::fs::create_dir_all(transcript.parent().expect("a folder")).expect("dir");
        std::fs::write(&transcript, "{}").expect("transcript");
        transcript
    }

    #[tokio::test]
    async fn a_deletion_removes_a_kept_claude_sessions_transcript_filed_by_the_directory_its_process_runs_in()
     {
        let dir = tempfile::tempdir().expect("tempdir");
        let (pool, names, home, ran_in, asked_in) = claude_deletion(dir.path());
        let id = "8f14e45f-ceea-467f-a8f0-3a1b0c6f2d11";
        // A kept process with a session of its own (nothing stored yet), running in another
        // directory than the one the deletion names.
        let mut config = ClaudeLiveConfig::new("claude", &home, &ran_in);
        config.session_id = Some(id.to_owned());
        let runner =
            CliConversation::Live(Box::new(ClaudeLive::new(config).expect("a valid config")));
        {
            let now = Instant::now();
            let mut shell = pool.lock();
            let key = CliKey {
                home: home.display().to_string(),
                credential: "c".to_owned(),
                backend: "claude-cli".to_owned(),
                serialize: false,
            };
            shell.core.ask(1, &names.slot, key, false, now);
            shell.core.returned(&names.slot, Kept::Process, false, now);
            shell.parked.insert(
                names.slot.clone(),
                Parked {
                    runner,
                    backend: "claude-cli".to_owned(),
                    process: None,
                    record: None,
                },
            );
        }
        let transcript = claude_transcript(&home, &ran_in, id);
        assert_eq!(
            claude_deleted(&pool, &names, &home, &asked_in).await,
            Some(ran_in.clone()),
            "nothing stored: the directory its process ran in"
        );
        assert!(
            !transcript.exists(),
            "the kept process's transcript is gone"
        );
        assert!(!pool.holds(&names.slot));
    }

    #[tokio::test]
    async fn a_deletion_removes_a_stored_claude_sessions_transcript_filed_by_the_directory_its_binding_recorded()
     {
        let dir = tempfile::tempdir().expect("tempdir");
        let (pool, names, home, ran_in, asked_in) = claude_deletion(dir.path());
        let id = "8f14e45f-ceea-467f-a8f0-3a1b0c6f2d12";
        // Stored (no process kept) by turns that ran in another directory than the one the
        // deletion names (a DELETE that names none: the agent's own).
        pool.bindings
            .put(&Binding {
                session_key: names.binding.clone(),
                cli_session_id: CliSessionId::new(id.to_owned()),
                compat_key: "c".to_owned(),
                updated_at_ms: 0,
                working_directory: Some(ran_in.clone()),
            })
            .expect("bound");
        let transcript = claude_transcript(&home, &ran_in, id);
        assert_eq!(
            claude_deleted(&pool, &names, &home, &asked_in).await,
            Some(ran_in.clone()),
            "where its attachments are looked for"
        );
        assert!(
            !transcript.exists(),
            "the stored session's transcript is gone"
        );
        assert!(pool.bindings.get(&names.binding).expect("read").is_none());
    }

    #[tokio::test]
    async fn a_shutdown_waits_for_a_deletion_in_progress_to_remove_the_binding() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (pool, home, cwd, names, file) = bound_codex_conversation(dir.path());
        // Started (on this test's one thread its task has not run yet), then the daemon
        // shuts down before anyone awaits it.
        let mut deletion =
            Box::pin(pool.delete("codex-cli", &names, Some(home.clone()), &cwd, None));
        assert!(
            still_pending_after_one_poll(deletion.as_mut()).await,
            "the deletion was running when the shutdown began"
        );
        pool.shutdown(Duration::from_secs(10)).await;
        // The shutdown returned once the deletion was done: files and binding both gone.
        assert!(!file.exists());
        assert!(pool.bindings.get(&names.binding).expect("read").is_none());
        assert!(!pool.holds(&names.slot));
        drop(deletion);
    }

    #[test]
    fn a_backends_dialect_is_its_key_else_the_bundled_ids_else_its_commands_name() {
        let mut generic = CliBackendConfig::new("/usr/local/bin/my-agent");
        assert_eq!(generic.dialect_of("my-agent"), Dialect::Generic);
        generic.command = "/opt/gemini-cli/bundle/gemini.js".to_owned();
        assert_eq!(generic.dialect_of("my-gemini"), Dialect::Gemini);
        generic.command = "claude".to_owned();
        assert_eq!(generic.dialect_of("my-claude"), Dialect::Claude);
        generic.dialect = Some(Dialect::Generic);
        assert_eq!(
            generic.dialect_of("my-claude"),
            Dialect::Generic,
            "the key wins"
        );
        let mut codex = CliBackendConfig::codex_cli();
        codex.dialect = None;
        codex.command = "/somewhere/else".to_owned();
        assert_eq!(
            codex.dialect_of("codex-cli"),
            Dialect::Codex,
            "the bundled id's"
        );
        assert_eq!(
            CliBackendConfig::claude_cli().dialect_of("x"),
            Dialect::Claude
        );
        let mut live = CliBackendConfig::claude_cli();
        live.dialect = Some(Dialect::Codex);
        let refused = live.validate("x").expect_err("a live Codex");
        assert!(refused.problem.contains("cli-live"), "{refused}");
    }
}
