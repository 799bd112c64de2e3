//! Placement as a pure core: the pool's whole bookkeeping (keys, workers, attached
//! conversations, the FIFO of waiting leases, who is leased and who is being detached, crash
//! restart, draining, eviction, recycling), driven by events and answering with effects.
//!
//! State in, effects out: every entry point takes what happened (a lease asks, a lease comes
//! back, a spawn landed, a worker crashed, a detach was confirmed, time passed) and returns
//! what the pool actor must now do ([`Effect`]: `Spawn`, `Detach`, `Evict`, `Grant`, `Fail`,
//! …). Nothing here awaits, spawns, signals, reads `/proc` or the clock; the actor owns the
//! worker handles and reply ports and carries the effects out. Conversation ownership lives
//! here and nowhere else: a conversation is granted only when it is neither leased nor being
//! detached (the property test `no_sequence_of_events_grants_one_conversation_twice` plays
//! random event sequences against that rule and the caps).
//!
//! The core is generic over what it carries without looking inside: `Spec` (how to start a
//! worker of a key) and `S` (a parked CLI session), so its tests run without processes.

mod rules;
#[cfg(test)]
mod tests;

use std::collections::{HashMap, HashSet, VecDeque};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use crate::ids::CliSessionId;
use crate::kinds::{Eviction, Priming};
use crate::worker::WorkerError;

use super::budget::{Others, Room, has_room, make_room};
use super::config::PoolConfig;
use super::error::PoolError;
use super::key::PoolKey;
use super::lease::OpenReason;
use super::restart::{RestartDecision, RestartPolicy, RestartTracker};
use super::status::{PoolEvent, PoolStatus, PoolTotals, ProcessBudget, WorkerState, WorkerStatus};

use rules::{
    ConversationView, Packing, Recycle, UpkeepLimits, UpkeepView, WorkerView, evict_now,
    idle_victim, is_spare, least_busy, least_loaded, lru_parked, recycle, serves, spare,
    spares_wanted, spread, within,
};
pub(crate) use rules::{WorkerId, cpu_processes_for};

/// Conversations whose resume crashes are remembered at most (a bound on memory; when it is
/// reached, the conversation whose last resume crash is oldest is forgotten).
const RESUME_CRASHES_REMEMBERED: usize = 4096;

/// How long a conversation's resume crashes count: one whose last resume crashed longer ago
/// resumes again (the runtime may have been killed from outside, twice, while it resumed a
/// crowd of conversations; a pinned session must not be refused for good).
pub(crate) const RESUME_CRASH_WINDOW: Duration = Duration::from_secs(600);

/// A conversation's resumes that crashed the runtime in a row, and when the last one did.
#[derive(Debug, Clone, Copy)]
struct ResumeCrashes {
    count: u32,
    last: Instant,
}

impl ResumeCrashes {
    /// The crashes that still count at `now` (none once [`RESUME_CRASH_WINDOW`] has passed
    /// since the last).
    fn at(self, now: Instant) -> u32 {
        if now.saturating_duration_since(self.last) >= RESUME_CRASH_WINDOW {
            0
        } else {
            self.count
        }
    }
}

/// Counts a resume of `conversation` that crashed the runtime at `now`. With
/// [`RESUME_CRASHES_REMEMBERED`] other conversations counted already, the one whose last
/// crash is oldest is forgotten first (the scan of all happens only then): a conversation
/// crashing its runtime in a loop keeps its count however many others crashed once.
fn count_resume_crash(
    counts: &mut HashMap<String, ResumeCrashes>,
    conversation: &str,
    now: Instant,
) {
    if counts.len() >= RESUME_CRASHES_REMEMBERED && !counts.contains_key(conversation) {
        let oldest = counts
            .iter()
            .min_by_key(|(_, crashes)| crashes.last)
            .map(|(name, _)| name.clone());
        if let Some(oldest) = oldest {
            counts.remove(&oldest);
        }
    }
    let crashes = counts
        .entry(conversation.to_owned())
        .or_insert(ResumeCrashes {
            count: 0,
            last: now,
        });
    crashes.count = crashes.at(now) + 1;
    crashes.last = now;
}

/// How many conversations' former keys placement remembers at most (when full, the eighth
/// used longest ago is forgotten: a rotation of those then drains the old version only
/// through an attached conversation, as before the memory existed; one agent's many
/// conversations never wipe every other's).
const FORMER_KEYS_REMEMBERED: usize = 65_536;

/// Resumes ahead of a return running at once over the whole pool. Each is ~33 ms of one
/// runtime's CPU: a crowd of keys whose spares came up in the same tick resumes a few at a
/// time (the rest at the next chances: the end or failure of one, a tick, a start, a stop)
/// instead of taking every core from the turns being served.
const RESUMES_AHEAD_AT_ONCE: usize = 2;

/// Identifies one acquire (its reply port lives in the actor).
pub(crate) type RequestId = u64;

/// The caps and timings placement applies (from [`PoolConfig`]).
#[derive(Debug, Clone)]
pub(crate) struct Limits {
    pub(crate) max_processes: usize,
    pub(crate) max_processes_per_key: usize,
    pub(crate) max_sessions_per_process: usize,
    pub(crate) max_sessions: usize,
    pub(crate) max_waiters: usize,
    pub(crate) max_waiters_per_agent: usize,
    /// `usize::MAX` for no cap.
    pub(crate) max_leases_per_agent: usize,
    pub(crate) idle_ttl: Duration,
    pub(crate) max_rss_bytes: u64,
    pub(crate) max_turns_per_process: u64,
    pub(crate) drain_grace: Duration,
    pub(crate) restart: RestartPolicy,
    pub(crate) busy_leases_per_process: usize,
    pub(crate) cpu_processes_per_key: usize,
    pub(crate) warm_spares: usize,
    pub(crate) warm_spare_window: Duration,
}

impl From<&PoolConfig> for Limits {
    fn from(c: &PoolConfig) -> Self {
        Limits {
            max_processes: c.max_processes,
            max_processes_per_key: c.max_processes_per_key,
            max_sessions_per_process: c.max_sessions_per_process,
            max_sessions: c.max_sessions,
            max_waiters: c.max_waiters,
            max_waiters_per_agent: c.max_waiters_per_agent,
            max_leases_per_agent: c.max_leases_per_agent.unwrap_or(usize::MAX),
            idle_ttl: c.idle_ttl,
            max_rss_bytes: c.max_rss_bytes,
            max_turns_per_process: c.max_turns_per_process,
            drain_grace: c.drain_grace,
            restart: c.restart.clone(),
            busy_leases_per_process: c.busy_leases_per_process,
            cpu_processes_per_key: c.cpu_processes_per_key,
            warm_spares: c.warm_spares,
            warm_spare_window: c.warm_spare_window,
        }
    }
}

/// One lease asking for a place to run.
#[derive(Debug, Clone)]
pub(crate) struct Ask<Spec> {
    pub(crate) id: RequestId,
    pub(crate) key: PoolKey,
    /// How to start a worker for this key (carried, never read).
    pub(crate) spec: Spec,
    pub(crate) conversation: String,
    /// The conversation's compat key: a parked session with another one is not reused.
    pub(crate) compat: String,
    /// What the session is opened with (tools, handler flags): a parked session opened
    /// differently is resumed anew rather than reused.
    pub(crate) setup: String,
    /// The lease runs no turn (a compact, a reset): a parked session is reused as it was
    /// opened, whatever its `setup` (no tool call nor prompt of it reaches this lease).
    pub(crate) any_setup: bool,
    /// The gateway's own key of the conversation (for errors).
    pub(crate) gateway_key: String,
    /// Refuse at once if the conversation is leased, instead of queueing behind its lease.
    pub(crate) fail_if_busy: bool,
    pub(crate) wait: Duration,
    /// Asks for a process of `key`, not for a conversation (a call that names no session:
    /// `session.list`, `models.list`, …). `conversation`, `compat` and `setup` are unused.
    /// Granted with [`Effect::GrantProcess`] on the key's least busy usable worker (started
    /// if the key has none); it counts as a lease of that worker (never evicted or drained
    /// away under it) until [`Placement::released`].
    pub(crate) process_only: bool,
    /// The ask is traffic of its key: the key's warm spares are kept for the window from
    /// now. False for a process-only ask and a deletion's lease (it predicts no turn).
    pub(crate) traffic: bool,
}

/// A conversation that was attached to a worker when its lease was granted.
#[derive(Debug)]
pub(crate) struct Carried<S> {
    /// The attached session (`None` if it was lost with its worker).
    pub(crate) session: Option<S>,
    /// True when the grant is on the same worker (no resume needed).
    pub(crate) same_worker: bool,
    /// The worker it was attached to.
    pub(crate) from: WorkerId,
}

/// A lease granted: the conversation is leased on `worker` until it is returned or abandoned.
#[derive(Debug)]
pub(crate) struct Granted<S> {
    pub(crate) request: RequestId,
    pub(crate) conversation: String,
    pub(crate) worker: WorkerId,
    pub(crate) carried: Option<Carried<S>>,
    /// Consecutive resumes of this conversation that crashed their runtime.
    pub(crate) resume_crashes: u32,
}

/// A grant that did not become a lease, and what it may have left attached.
#[derive(Debug)]
pub(crate) struct Abandon<S> {
    pub(crate) conversation: String,
    /// The granted worker.
    pub(crate) worker: WorkerId,
    /// The session it carried from another worker, and that worker.
    pub(crate) carried: Option<(S, WorkerId)>,
    /// A session it opened on `worker`.
    pub(crate) opened: Option<S>,
    /// A session id `worker` may hold (an open that timed out).
    pub(crate) maybe_attached: Option<CliSessionId>,
    /// The open failed because its resume crashed the runtime.
    pub(crate) resume_crashed: bool,
}

/// What a detach removes from a worker.
#[derive(Debug)]
pub(crate) enum DetachTarget<S> {
    /// A session that was open there: "not found" means detached.
    Session(S),
    /// A session known only by id (an open that timed out may have attached it): "not
    /// found" proves nothing, only a confirmed detach counts.
    Id(CliSessionId),
}

/// What the pool actor must do. Every `Detach` and every `Evict` must be answered by exactly
/// one [`Placement::detached`] (for an eviction: once the worker has stopped).
#[derive(Debug)]
pub(crate) enum Effect<Spec, S> {
    /// Hand this grant to the request's caller.
    Grant(Granted<S>),
    /// Hand this process lease (an [`Ask::process_only`]) to the request's caller; it is
    /// answered by exactly one [`Placement::released`].
    GrantProcess {
        request: RequestId,
        worker: WorkerId,
    },
    /// Answer the request with this error.
    Fail {
        request: RequestId,
        error: PoolError,
    },
    /// The request waits in the FIFO; expire it after `wait`.
    Queued { request: RequestId, wait: Duration },
    /// Start a worker for `key`; `prime`: it starts ahead of demand (a warm spare, or one
    /// more process for a busy key), so it runs the runtime's first-turn initialisation
    /// before it is reported started.
    Spawn {
        key: PoolKey,
        spec: Spec,
        prime: bool,
    },
    /// Call [`Placement::respawn_due`] for `key` after `after`.
    RespawnAfter { key: PoolKey, after: Duration },
    /// Detach a conversation's session from `worker`, with confirmation.
    Detach {
        conversation: String,
        worker: WorkerId,
        target: DetachTarget<S>,
    },
    /// Stop `worker`; its `attached` conversations are granted again only once it is gone.
    Evict {
        worker: WorkerId,
        reason: Eviction,
        attached: Vec<String>,
    },
    /// `worker` is gone by itself (crash or exit): drop its handle.
    Forget { worker: WorkerId },
    /// The pool is full and the CLI side holds the oldest idle process: ask it to close that
    /// one ([`Placement::others_changed`] once it has). Emitted once until the CLI side's
    /// view changes.
    EvictOther,
    /// Publish this event.
    Event(PoolEvent),
}

/// What the pool does with a returned conversation's session.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Settle {
    /// Its turn ended: keep it attached (parked) for the next lease, if the worker may.
    Park,
    /// It must not be reused (lost, poisoned): detach it with confirmation.
    Detach,
    /// A turn was still running when the lease was dropped and did not end after an abort:
    /// the process is in an unknown state and is stopped before the conversation moves.
    Unsettled,
}

/// A worker's start, as placement hears of it.
pub(crate) type Started = Result<StartedWorker, WorkerError>;

/// How a worker's child died, as far as the restart policy tells deaths apart.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Death {
    /// Killed from outside (SIGKILL: the OOM killer, an operator; SIGTERM, SIGINT, SIGHUP,
    /// or the exit status a runtime gives for one), or how is not known.
    Killed,
    /// Failed by itself: an exit code of its own, or the signal of a fault (SIGSEGV,
    /// SIGABRT, SIGBUS, SIGILL, SIGFPE, SIGSYS, SIGTRAP).
    Failed,
}

impl Death {
    /// The death a worker's end tells of: a runtime that hung (missed its health pings) or
    /// broke the protocol failed by itself, whatever signal then ended it; otherwise its
    /// exit status says ([`Death::of`]).
    pub(crate) fn of_worker(exit: Option<&crate::worker::WorkerExit>) -> Self {
        use crate::worker::ExitReason;
        match exit.map(|e| &e.reason) {
            Some(ExitReason::Hung { .. } | ExitReason::ProtocolViolation(_)) => Death::Failed,
            _ => Death::of(exit.and_then(crate::worker::WorkerExit::exit_info)),
        }
    }

    /// The death an exit status tells of.
    pub(crate) fn of(exit: Option<crate::process::ExitInfo>) -> Self {
        use crate::process::ExitInfo;
        use nix::sys::signal::Signal;
        const FAULTS: [Signal; 7] = [
            Signal::SIGSEGV,
            Signal::SIGABRT,
            Signal::SIGBUS,
            Signal::SIGILL,
            Signal::SIGFPE,
            Signal::SIGSYS,
            Signal::SIGTRAP,
        ];
        const STOPS: [Signal; 4] = [
            Signal::SIGKILL,
            Signal::SIGTERM,
            Signal::SIGINT,
            Signal::SIGHUP,
        ];
        match exit {
            Some(ExitInfo::Signal(n)) if FAULTS.iter().any(|s| *s as i32 == n) => Death::Failed,
            // 0 and 128 + a stopping signal: a runtime that handled the signal and exited.
            Some(ExitInfo::Code(code))
                if code != 0 && !STOPS.iter().any(|s| 128 + *s as i32 == code) =>
            {
                Death::Failed
            }
            _ => Death::Killed,
        }
    }
}

/// A worker that started.
#[derive(Debug, Clone, Copy)]
pub(crate) struct StartedWorker {
    pub(crate) pid: u32,
    /// How it was primed (`None`: it was not started ahead of demand).
    pub(crate) primed: Option<Priming>,
}

struct KeyState<Spec> {
    spec: Spec,
    workers: Vec<WorkerId>,
    spawning: bool,
    /// The next spawn replaces a crashed worker.
    respawn: bool,
    /// A restart of the key is scheduled for then (until `respawn_due` runs): the key gets
    /// no warm spare meanwhile (see `top_up_spares`).
    backoff_until: Option<Instant>,
    restart: RestartTracker,
    /// Why the last start of this key failed (cleared by a start that works).
    last_start_error: Option<WorkerError>,
    /// When a conversation of this key was last granted (its warm spares follow it).
    last_lease: Option<Instant>,
    /// When a conversation of this key last found every process of it that serves full
    /// (the key outgrew them): only then does a spare stand beside full processes.
    outgrown: Option<Instant>,
    /// A newer credential version of this key's family took its traffic
    /// ([`drain_version`](Placement::drain_version)): a start of it still in flight then
    /// (a spare priming) is drained as it lands unless a lease waits for it. Its next
    /// lease clears it.
    rotated: bool,
}

/// A worker evicted and not yet stopped (or whose detach failed, on its way to eviction).
struct Stopping {
    /// Its key: the key's spare waits until its process is gone, so the two never add up.
    key: PoolKey,
    /// Conversations whose detach from it failed while it could still hold their sessions:
    /// they stay in `detaching` until the process is gone
    /// ([`eviction_done`](Placement::eviction_done)), so none is resumed elsewhere meanwhile.
    held: Vec<String>,
    /// Stopped for the CLI side's lease: the room it leaves is that lease's, so its end
    /// serves nobody here (no waiter, no spare) before the CLI side has seen it.
    for_other: bool,
    /// Stopped to make room for this waiter's start (`grow`): served again before the stop
    /// is confirmed (a tick, a return), it waits for its own stop instead of stopping another
    /// tenant's idle process. Other waiters make room for themselves.
    for_ask: Option<RequestId>,
    /// The key that start is for: the key's other waiters wait for the same stop (a key
    /// starts one process at a time), instead of each stopping another tenant's.
    for_key: Option<PoolKey>,
}

/// The key of the process a conversation left, and when the conversation was last used.
struct FormerKey {
    key: PoolKey,
    last_used: Instant,
}

struct Worker {
    key: PoolKey,
    pid: u32,
    /// Its child still serves (the actor reports an exit as soon as it sees one).
    alive: bool,
    draining: bool,
    drain_deadline: Option<Instant>,
    /// Conversations attached to this worker.
    attached: HashSet<String>,
    leased: usize,
    turns: u64,
    last_used: Instant,
    rss_bytes: u64,
    /// When it started.
    started: Instant,
    /// A conversation was opened on it (it got past its start and served).
    served: bool,
    /// A spare whose conversations the pool resumed ahead of their return
    /// ([`Placement::warm_up`]); the first lease that lands on it makes it a serving worker.
    warm: bool,
    /// How it was primed, when it started ahead of demand.
    primed: Option<Priming>,
}

impl Worker {
    fn view(&self, id: WorkerId) -> WorkerView {
        WorkerView {
            id,
            attached: self.attached.len(),
            leased: self.leased,
            draining: self.draining,
            alive: self.alive,
            last_used: self.last_used,
            warm: self.warm,
        }
    }

    fn upkeep_view(&self, id: WorkerId) -> UpkeepView {
        UpkeepView {
            id,
            leased: self.leased,
            last_used: self.last_used,
            draining: self.draining,
            drain_deadline: self.drain_deadline,
            rss_bytes: self.rss_bytes,
            turns: self.turns,
        }
    }
}

struct Conversation<S> {
    worker: WorkerId,
    /// The CLI session, once the lease has opened it.
    cli_session_id: Option<CliSessionId>,
    compat: String,
    setup: String,
    parked: Option<S>,
    leased: bool,
    last_used: Instant,
    /// Resumed ahead of its return ([`Placement::warm_up`]) and not leased since.
    ahead: bool,
    /// Its lease is for turns (`Ask::traffic`), the kind `max_leases_per_agent` caps; a
    /// deletion's or a resume ahead is not.
    for_turns: bool,
    /// The agent's home (its last grant's key's), whose turns it counts in.
    home: PathBuf,
}

impl<S> Conversation<S> {
    fn view<'a>(&self, key: &'a str) -> ConversationView<'a> {
        ConversationView {
            key,
            leased: self.leased,
            last_used: self.last_used,
            ahead: self.ahead,
        }
    }
}

/// The pool's bookkeeping (see the module doc).
pub(crate) struct Placement<Spec, S> {
    limits: Limits,
    keys: HashMap<PoolKey, KeyState<Spec>>,
    workers: HashMap<WorkerId, Worker>,
    conversations: HashMap<String, Conversation<S>>,
    waiters: VecDeque<Ask<Spec>>,
    next_worker_id: WorkerId,
    closed: bool,
    totals: PoolTotals,
    /// Conversations whose session is being detached from a worker, with how many detaches
    /// are outstanding: they are not granted until each is confirmed (one owner per CLI
    /// session id).
    detaching: HashMap<String, usize>,
    /// Workers evicted and not yet stopped (see [`Stopping`]).
    stopping: HashMap<WorkerId, Stopping>,
    /// Consecutive resumes that crashed the runtime, per conversation (cleared when it
    /// opens).
    resume_crashes: HashMap<String, ResumeCrashes>,
    /// The key of the process each conversation last left (the process stopped or died
    /// under it, or it was detached), for the spare window after the conversation's last
    /// use and while that key is kept: a conversation that comes back with another
    /// credential version of that key's family is a rotation even when the process it was
    /// on is gone ([`drain_rotated`](Self::drain_rotated)). At most
    /// [`FORMER_KEYS_REMEMBERED`] entries.
    former_keys: HashMap<String, FormerKey>,
    /// The agents' leases for turns by home, counted for one pass over the waiters
    /// ([`serve_waiters`](Self::serve_waiters)) when `max_leases_per_agent` is set.
    turns_by_home: Option<HashMap<PathBuf, usize>>,
    /// The CLI backends' processes, which count in `max_processes` too.
    others: Others,
    /// An [`Effect::EvictOther`] is outstanding.
    asked_other: bool,
    /// The ask being placed could not wait (the waiter caps are reached): it is granted
    /// now or refused, and starts, evicts and marks nothing on its way (`acquire`).
    queue_full: bool,
    /// A worker stopped for the CLI side is gone: this side's waiters are served once the
    /// CLI side has taken (or left) the room ([`serve_owed`](Self::serve_owed)).
    owed_serve: bool,
    out: Vec<Effect<Spec, S>>,
}

impl<Spec: Clone, S> Placement<Spec, S> {
    pub(crate) fn new(limits: Limits) -> Self {
        Placement {
            limits,
            keys: HashMap::new(),
            workers: HashMap::new(),
            conversations: HashMap::new(),
            waiters: VecDeque::new(),
            next_worker_id: 1,
            closed: false,
            queue_full: false,
            owed_serve: false,
            totals: PoolTotals::default(),
            detaching: HashMap::new(),
            stopping: HashMap::new(),
            resume_crashes: HashMap::new(),
            former_keys: HashMap::new(),
            turns_by_home: None,
            others: Others::default(),
            asked_other: false,
            out: Vec::new(),
        }
    }

    // ---- The shared process budget ----------------------------------------------------------

    /// The CLI side's processes as they are now (set before every decision, under the lock
    /// both sides decide under). A changed view lets a waiter ask for its idle one again.
    pub(crate) fn set_others(&mut self, others: Others) {
        if others != self.others {
            self.asked_other = false;
        }
        self.others = others;
    }

    /// [`set_others`](Self::set_others) at the start of a message: room the CLI side gave
    /// up since the last look goes to the waiters at once, before whatever the message asks
    /// (a new lease must not take it ahead of them).
    pub(crate) fn look_at_others(&mut self, others: Others, now: Instant) -> Vec<Effect<Spec, S>> {
        let freed = others.held < self.others.held;
        self.set_others(others);
        if freed && !self.waiters.is_empty() {
            self.serve_waiters(now);
        }
        self.effects()
    }

    /// The CLI side's processes changed (after [`set_others`](Self::set_others)): serve the
    /// waiters with the room it gave up.
    pub(crate) fn others_changed(&mut self, now: Instant) -> Vec<Effect<Spec, S>> {
        self.serve_waiters(now);
        self.effects()
    }

    /// What the CLI side sees of this side: workers (and starts in flight), and when the
    /// idle worker it would stop first ([`idle_victim`]) was last used.
    pub(crate) fn view(&self) -> Others {
        let starting = self.keys.values().filter(|k| k.spawning).count();
        let idle = idle_victim(self.workers.iter().map(|(id, w)| w.view(*id)));
        Others {
            // A process being stopped is still there (its grace runs up to seconds): it
            // counts until it is gone, so a replacement never runs beside it past the cap.
            held: self.workers.len() + starting + self.stopping.len(),
            idle_since: idle
                .and_then(|id| self.workers.get(&id))
                .map(|w| w.last_used),
            making_room: self.stopping.values().any(|s| s.for_other),
        }
    }

    /// A CLI lease needs room and this side holds the oldest idle process: its idle victim
    /// is evicted (the waiters here are not served: the room is the asker's).
    pub(crate) fn evict_for_other(&mut self) -> Vec<Effect<Spec, S>> {
        if let Some(id) = idle_victim(self.workers.iter().map(|(id, w)| w.view(*id))) {
            self.evict(id, Eviction::Full);
            if let Some(stopping) = self.stopping.get_mut(&id) {
                stopping.for_other = true;
            }
        }
        self.effects()
    }

    /// Leases for turns of the agent whose home is `home` granted and not returned (every
    /// credential of it): its leased conversations. Counted once per pass over the waiters
    /// (`turns_by_home`), else a pass over the attached conversations; only with the cap set.
    fn leased_of(&self, home: &std::path::Path) -> usize {
        if let Some(counted) = &self.turns_by_home {
            return counted.get(home).copied().unwrap_or(0);
        }
        self.conversations
            .values()
            .filter(|c| c.leased && c.for_turns && c.home == home)
            .count()
    }

    /// The leases for turns of every agent, by home.
    fn turns_by_home(&self) -> HashMap<PathBuf, usize> {
        let mut counted = HashMap::new();
        for c in self
            .conversations
            .values()
            .filter(|c| c.leased && c.for_turns)
        {
            *counted.entry(c.home.clone()).or_default() += 1;
        }
        counted
    }

    /// A lease for turns of `home` was granted: counted in the pass's tally, if one is kept.
    fn count_turn(&mut self, home: &std::path::Path) {
        if let Some(counted) = &mut self.turns_by_home {
            *counted.entry(home.to_path_buf()).or_default() += 1;
        }
    }

    /// Whether the agent whose home is `home` holds `max_leases_per_agent` leases.
    fn agent_at_lease_cap(&self, home: &std::path::Path) -> bool {
        self.limits.max_leases_per_agent != usize::MAX
            && self.leased_of(home) >= self.limits.max_leases_per_agent
    }

    /// Leases of the agent whose home is `home` waiting (every credential of it).
    fn waiting_of(&self, home: &std::path::Path) -> usize {
        self.waiters.iter().filter(|w| w.key.home == home).count()
    }

    /// Processes of this side in the budget.
    fn held(&self) -> usize {
        self.view().held
    }

    fn effects(&mut self) -> Vec<Effect<Spec, S>> {
        std::mem::take(&mut self.out)
    }

    fn emit(&mut self, event: PoolEvent) {
        self.out.push(Effect::Event(event));
    }

    // ---- Events ----------------------------------------------------------------------------

    /// A lease asks for a place: granted, failed, or queued (a spawn may start).
    pub(crate) fn acquire(&mut self, ask: Ask<Spec>, now: Instant) -> Vec<Effect<Spec, S>> {
        // An ask that could not wait is placed without growing the pool: a refused ask must
        // not evict another tenant's idle process, start one, or keep its key's spares warm.
        self.queue_full = self.waiters.len() >= self.limits.max_waiters
            || self.waiting_of(&ask.key.home) >= self.limits.max_waiters_per_agent;
        let placed = self.try_grant(&ask, now);
        self.queue_full = false;
        match placed {
            Ok(true) => {
                if ask.traffic
                    && let Some(ks) = self.keys.get_mut(&ask.key)
                {
                    ks.last_lease = Some(now);
                    ks.rotated = false;
                }
            }
            Err(error) => self.out.push(Effect::Fail {
                request: ask.id,
                error,
            }),
            Ok(false) if self.waiters.len() >= self.limits.max_waiters => {
                self.out.push(Effect::Fail {
                    request: ask.id,
                    error: PoolError::WaitersFull {
                        max: self.limits.max_waiters,
                    },
                })
            }
            Ok(false) if self.waiting_of(&ask.key.home) >= self.limits.max_waiters_per_agent => {
                self.out.push(Effect::Fail {
                    request: ask.id,
                    error: PoolError::AgentWaitersFull {
                        max: self.limits.max_waiters_per_agent,
                    },
                })
            }
            Ok(false) => {
                self.out.push(Effect::Queued {
                    request: ask.id,
                    wait: ask.wait,
                });
                self.waiters.push_back(ask);
            }
        }
        self.top_up_spares(now);
        self.effects()
    }

    /// A lease opened (created or resumed) its CLI session.
    pub(crate) fn opened(
        &mut self,
        conversation: &str,
        worker: WorkerId,
        cli_session_id: CliSessionId,
        reason: OpenReason,
    ) -> Vec<Effect<Spec, S>> {
        if let Some(conv) = self.conversations.get_mut(conversation)
            && conv.worker == worker
        {
            conv.cli_session_id = Some(cli_session_id);
        }
        if let Some(w) = self.workers.get_mut(&worker) {
            w.served = true;
        }
        if let Some(pid) = self.workers.get(&worker).map(|w| w.pid) {
            self.emit(PoolEvent::ConversationOpened { pid, reason });
        }
        self.resume_crashes.remove(conversation);
        match reason {
            OpenReason::Attached => {}
            OpenReason::Resumed => self.totals.resumed += 1,
            _ => self.totals.created += 1,
        }
        self.effects()
    }

    /// Resumes `conversation` of `key` ahead of its return (the pool remembers the key's
    /// recently leased ones): granted onto the key's spare when the key keeps spares now, the
    /// spare has room, and the conversation is attached nowhere, leased by nobody, waited for
    /// by nobody and not being detached. The spare stays a spare (`warm`), the key's traffic
    /// clock does not move, and nothing starts or queues. The grant is answered like a
    /// lease's: [`opened`](Self::opened), then [`returned`](Self::returned) with
    /// [`Settle::Park`], or [`abandoned`](Self::abandoned).
    pub(crate) fn warm_up(
        &mut self,
        key: &PoolKey,
        conversation: &str,
        compat: &str,
        setup: &str,
        now: Instant,
    ) -> Option<Granted<S>> {
        let wanted = self.keys.get(key).map(|ks| self.spares_wanted(ks, now))?;
        let free = !self.closed
            && wanted > 0
            && !self.conversations.contains_key(conversation)
            && !self.detaching.contains_key(conversation)
            && self.resume_crashes(conversation, now) == 0
            && !self.agent_at_lease_cap(&key.home)
            && !self.waiters.iter().any(|w| w.conversation == conversation)
            && self.conversations.len() + self.waiters.len() < self.limits.max_sessions;
        if !free || self.resumes_ahead_in_flight() >= RESUMES_AHEAD_AT_ONCE {
            return None;
        }
        let room = super::config::spare_room(self.limits.max_sessions_per_process);
        let target = spare(self.views_of(key).into_iter().filter(|w| w.attached < room))?;
        let w = self.workers.get_mut(&target)?;
        w.attached.insert(conversation.to_owned());
        w.leased += 1;
        w.warm = true;
        self.former_keys.remove(conversation);
        self.conversations.insert(
            conversation.to_owned(),
            Conversation {
                worker: target,
                cli_session_id: None,
                compat: compat.to_owned(),
                setup: setup.to_owned(),
                parked: None,
                leased: true,
                last_used: now,
                ahead: true,
                for_turns: false,
                home: key.home.clone(),
            },
        );
        Some(Granted {
            request: 0,
            conversation: conversation.to_owned(),
            worker: target,
            carried: None,
            resume_crashes: 0,
        })
    }

    /// Whether `conversation` is being resumed ahead of its return (granted by
    /// [`warm_up`](Self::warm_up), not yet parked or abandoned).
    pub(crate) fn resuming_ahead(&self, conversation: &str) -> bool {
        self.conversations
            .get(conversation)
            .is_some_and(|c| c.ahead && c.leased)
    }

    /// Resumes ahead granted and not yet parked or abandoned, over every key.
    fn resumes_ahead_in_flight(&self) -> usize {
        self.conversations
            .values()
            .filter(|c| c.ahead && c.leased)
            .count()
    }

    /// A lease ended after `turns` turns; `session` is its session if it is still alive.
    pub(crate) fn returned(
        &mut self,
        conversation: String,
        worker: WorkerId,
        session: Option<S>,
        settle: Settle,
        turns: u64,
        now: Instant,
    ) -> Vec<Effect<Spec, S>> {
        self.settle_return(conversation, worker, session, settle, turns, now);
        self.serve_waiters(now);
        self.effects()
    }

    /// A process lease ([`Effect::GrantProcess`]) is over: the worker may be idle again,
    /// finish its drain, or make room.
    pub(crate) fn released(&mut self, worker: WorkerId, now: Instant) -> Vec<Effect<Spec, S>> {
        if let Some(w) = self.workers.get_mut(&worker) {
            w.leased = w.leased.saturating_sub(1);
            w.last_used = now;
        }
        self.maybe_finish_drain(worker);
        self.serve_waiters(now);
        self.effects()
    }

    /// A grant that did not become a lease: the slot comes back, and whatever it may have
    /// left attached is detached with confirmation before the conversation is granted again.
    pub(crate) fn abandoned(&mut self, abandon: Abandon<S>, now: Instant) -> Vec<Effect<Spec, S>> {
        let Abandon {
            conversation,
            worker,
            carried,
            opened,
            maybe_attached,
            resume_crashed,
        } = abandon;
        self.settle_return(conversation.clone(), worker, None, Settle::Detach, 0, now);
        if resume_crashed {
            count_resume_crash(&mut self.resume_crashes, &conversation, now);
        }
        if let Some((session, from)) = carried {
            self.detach(conversation.clone(), from, DetachTarget::Session(session));
        }
        if let Some(session) = opened {
            self.detach(conversation.clone(), worker, DetachTarget::Session(session));
        }
        if let Some(id) = maybe_attached {
            if self.workers.contains_key(&worker) {
                self.detach(conversation, worker, DetachTarget::Id(id));
            } else if let Some(stopping) = self.stopping.get_mut(&worker) {
                // Evicted (by this return ending its drain, say) but not gone yet: it may
                // hold the session until its process is, as after a failed detach.
                stopping.held.push(conversation.clone());
                *self.detaching.entry(conversation).or_default() += 1;
            }
            // A worker that is gone holds nothing.
        }
        self.serve_waiters(now);
        self.effects()
    }

    /// A `Detach` effect finished for these conversations; `ok == false` means the old
    /// worker may still hold the sessions: it is stopped, and they wait for it to be gone.
    pub(crate) fn detached(
        &mut self,
        conversations: &[String],
        worker: WorkerId,
        ok: bool,
        now: Instant,
    ) -> Vec<Effect<Spec, S>> {
        // A failed detach from a process that still runs (live, or evicted and stopping)
        // waits for its stop: the worker's key, for its stopping entry.
        let held_by = if ok {
            None
        } else {
            self.workers
                .get(&worker)
                .map(|w| w.key.clone())
                .or_else(|| self.stopping.get(&worker).map(|s| s.key.clone()))
        };
        for key in conversations {
            match &held_by {
                Some(worker_key) => self
                    .stopping_entry(worker, worker_key)
                    .held
                    .push(key.clone()),
                None => self.detach_done(key),
            }
        }
        if !ok && self.workers.contains_key(&worker) {
            self.evict(worker, Eviction::DetachFailed);
        }
        self.serve_waiters(now);
        self.effects()
    }

    /// An `Evict` effect finished: the worker's process is gone, with it every session it
    /// held (`conversations`, the eviction's, and those whose detach from it failed).
    pub(crate) fn eviction_done(
        &mut self,
        conversations: &[String],
        worker: WorkerId,
        now: Instant,
    ) -> Vec<Effect<Spec, S>> {
        let (held, for_other) = self
            .stopping
            .remove(&worker)
            .map(|s| (s.held, s.for_other))
            .unwrap_or_default();
        for key in conversations.iter().chain(&held) {
            self.detach_done(key);
        }
        // The room is the CLI side's lease's when it was stopped for one: the actor tells
        // the CLI side this side's count first, then serves the waiters here with what the
        // CLI side left (`serve_owed`).
        if for_other {
            self.owed_serve = true;
        } else {
            self.serve_waiters(now);
        }
        self.effects()
    }

    /// Serves the waiters a stop for the CLI side held back, once the CLI side has seen the
    /// room (the actor calls it after telling it this side's count).
    pub(crate) fn serve_owed(&mut self, now: Instant) -> Vec<Effect<Spec, S>> {
        if std::mem::take(&mut self.owed_serve) {
            self.serve_waiters(now);
        }
        self.effects()
    }

    /// One outstanding detach of `key` is over.
    fn detach_done(&mut self, key: &str) {
        if let Some(n) = self.detaching.get_mut(key) {
            *n -= 1;
            if *n == 0 {
                self.detaching.remove(key);
            }
        }
    }

    /// A start of `key` finished. Returns the new worker's id if placement keeps it (the
    /// caller must stop a started worker it gets no id for).
    pub(crate) fn spawned(
        &mut self,
        key: PoolKey,
        started: Started,
        now: Instant,
    ) -> (Option<WorkerId>, Vec<Effect<Spec, S>>) {
        let id = self.on_spawned(key, started, now);
        self.serve_waiters(now);
        (id, self.effects())
    }

    /// The backoff of `key` is over: start its replacement if it still has none.
    pub(crate) fn respawn_due(&mut self, key: &PoolKey, now: Instant) -> Vec<Effect<Spec, S>> {
        // The pool's cap holds for replacements too: a full pool leaves the replacement to
        // the key's next lease (which may make room by stopping an idle worker).
        let room = has_room(self.held(), &self.others, self.limits.max_processes);
        let waited_for = self.waiters.iter().any(|w| w.key == *key);
        if let Some(ks) = self.keys.get_mut(key) {
            ks.backoff_until = None;
            // Only for someone: a crashed process's conversations (`respawn`, which a
            // failed start clears) or a lease still waiting. A start that failed for
            // waiters that have since given up is left to the key's next lease, not
            // retried forever (a runtime hanging at its handshake fails slower than the
            // restart window, so it would never be quarantined either).
            let wanted = ks.respawn || waited_for;
            let quarantined = ks.restart.quarantined_until(now).is_some();
            if !self.closed
                && room
                && wanted
                && !quarantined
                && ks.workers.is_empty()
                && !ks.spawning
            {
                ks.respawn = true;
                ks.spawning = true;
                self.out.push(Effect::Spawn {
                    key: key.clone(),
                    spec: ks.spec.clone(),
                    prime: false,
                });
            }
        }
        self.serve_waiters(now);
        self.effects()
    }

    /// A waiter's time is up: it fails, saying why (its conversation still leased, its
    /// agent at its lease cap, its key's last start error, or no capacity).
    pub(crate) fn expire(&mut self, request: RequestId) -> Vec<Effect<Spec, S>> {
        if let Some(pos) = self.waiters.iter().position(|w| w.id == request)
            && let Some(w) = self.waiters.remove(pos)
        {
            let busy = self.is_leased(&w.conversation);
            let start_error = self
                .keys
                .get(&w.key)
                .filter(|ks| ks.workers.is_empty())
                .and_then(|ks| ks.last_start_error.clone());
            let at_cap = w.traffic && !w.process_only && self.agent_at_lease_cap(&w.key.home);
            let error = match (busy, start_error) {
                (true, _) => PoolError::ConversationWaitTimeout {
                    session_key: w.gateway_key.clone(),
                    after: w.wait,
                },
                (false, _) if at_cap => PoolError::AgentLeasesFull {
                    max: self.limits.max_leases_per_agent,
                    after: w.wait,
                },
                (false, Some(error)) => PoolError::Worker(error),
                (false, None) => PoolError::WaitTimeout { after: w.wait },
            };
            self.out.push(Effect::Fail { request, error });
        }
        self.effects()
    }

    /// A waiter's caller gave up: forget it without an answer.
    pub(crate) fn withdraw(&mut self, request: RequestId) {
        self.waiters.retain(|w| w.id != request);
    }

    /// The worker's child has exited (its supervision event may still be on its way).
    pub(crate) fn exited(&mut self, worker: WorkerId) {
        if let Some(w) = self.workers.get_mut(&worker) {
            w.alive = false;
        }
    }

    /// A worker died: it is forgotten, and replaced (after the backoff) if it had work, or
    /// its key is quarantined.
    pub(crate) fn crashed(
        &mut self,
        id: WorkerId,
        death: Death,
        now: Instant,
    ) -> Vec<Effect<Spec, S>> {
        if let Some(w) = self.workers.get(&id) {
            let key = w.key.clone();
            // A draining worker was on its way out, and a warm spare's conversations were
            // resumed ahead of anyone asking (the key's next quiet tick owes it a spare, and
            // a returning conversation's lease starts a process): neither is replaced.
            let had_conversations = !w.attached.is_empty() && !w.draining && !w.warm;
            // A worker that served, lived past its start period and was killed by a signal
            // from outside (the OOM killer, an operator) is replaced at once, no quarantine.
            // A crash loop (deaths at start, before serving, while resuming) still counts,
            // and so does a runtime that fails by itself (a fault, an exit code of its own)
            // on every turn, however long it served first.
            let outside = w.served
                && death == Death::Killed
                && now.saturating_duration_since(w.started) >= self.limits.restart.healthy_after;
            self.emit(PoolEvent::WorkerCrashed {
                key_hash: key.short_hash(),
                pid: w.pid,
            });
            self.remove_worker(id);
            self.out.push(Effect::Forget { worker: id });
            self.totals.crashes += 1;
            let demand = had_conversations || self.waiters.iter().any(|w| w.key == key);
            if let Some(ks) = self.keys.get_mut(&key) {
                let already = ks.restart.quarantined_until(now).is_some();
                let decision = if outside {
                    ks.restart.record_outside_kill(now)
                } else {
                    ks.restart.record_crash(now, &self.limits.restart)
                };
                match decision {
                    RestartDecision::Restart { after } => {
                        if demand && !self.closed {
                            tracing::info!(key = %key.short_hash(), ?after, "Restarting a crashed worker.");
                            // Whichever spawn comes next for this key (the scheduled respawn,
                            // or a lease arriving after the backoff) replaces the crashed one.
                            ks.respawn = true;
                            ks.backoff_until = Some(crate::deadline::from_std(now, after));
                            self.out.push(Effect::RespawnAfter { key, after });
                        }
                    }
                    RestartDecision::Quarantine { until } => {
                        if !already {
                            tracing::warn!(key = %key.short_hash(), "Restart intensity exceeded; key quarantined.");
                        }
                        self.quarantine(&key, until, already, now);
                    }
                }
            }
        }
        self.serve_waiters(now);
        self.effects()
    }

    /// A worker stopped on its own without crashing. Returns whether placement knew it.
    pub(crate) fn stopped(&mut self, id: WorkerId, now: Instant) -> (bool, Vec<Effect<Spec, S>>) {
        let known = self.remove_worker(id);
        if known {
            self.out.push(Effect::Forget { worker: id });
        }
        self.serve_waiters(now);
        (known, self.effects())
    }

    /// Resident memory measured off the actor; a worker above `max_rss_bytes` drains.
    pub(crate) fn measured(
        &mut self,
        measured: &[(WorkerId, u64)],
        now: Instant,
    ) -> Vec<Effect<Spec, S>> {
        let limits = self.upkeep_limits();
        for (id, rss) in measured {
            let Some(w) = self.workers.get_mut(id) else {
                continue;
            };
            w.rss_bytes = *rss;
            if recycle(&w.upkeep_view(*id), &limits) == Some(Recycle::Memory) {
                tracing::info!(rss = w.rss_bytes, "Recycling a worker above max_rss_bytes.");
                w.draining = true;
                w.drain_deadline = Some(crate::deadline::from_std(now, self.limits.drain_grace));
                // With no lease it goes now, not at the next tick.
                self.maybe_finish_drain(*id);
            }
        }
        self.serve_waiters(now);
        self.effects()
    }

    /// The maintenance tick: idle TTL and drain deadlines; keys with nothing left are
    /// forgotten (their spec holds the old token of a rotation).
    pub(crate) fn maintain(&mut self, now: Instant) -> Vec<Effect<Spec, S>> {
        let limits = self.upkeep_limits();
        // A key's spares are kept past the idle TTL while it had a lease within the window
        // and wants them; once the window lapses they are stopped.
        let mut kept = HashSet::new();
        let mut retired = HashSet::new();
        if self.limits.warm_spares > 0 {
            let window = self.limits.warm_spare_window;
            for ks in self.keys.values() {
                let spares = self.spares_of(ks);
                let lapsed = ks.last_lease.is_some() && !within(ks.last_lease, now, window);
                if lapsed {
                    // Not under a lease: a process lease, or a resume ahead in flight.
                    retired.extend(
                        spares
                            .into_iter()
                            .filter(|id| self.workers.get(id).is_some_and(|w| w.leased == 0)),
                    );
                } else {
                    // Empty processes the key keeps no spare in (a busy key's extra process,
                    // one beside a process with room) go with the idle TTL like any other.
                    kept.extend(spares.into_iter().take(self.spares_wanted(ks, now)));
                }
            }
        }
        let mut evict: Vec<(WorkerId, Eviction)> = self
            .workers
            .iter()
            .filter(|(id, _)| !kept.contains(*id))
            // A dead worker's end (a crash) is on its way; evicting it would count a stop.
            .filter(|(_, w)| w.alive)
            .filter_map(|(id, w)| {
                if retired.contains(id) {
                    return Some((*id, Eviction::Idle));
                }
                evict_now(now, &w.upkeep_view(*id), &limits).map(|r| (*id, r))
            })
            .collect();
        evict.sort_unstable_by_key(|(id, _)| *id);
        for (id, reason) in evict {
            self.evict(id, reason);
        }
        let waiting: HashSet<PoolKey> = self.waiters.iter().map(|w| w.key.clone()).collect();
        let policy = &self.limits.restart;
        let (warm_spares, window) = (self.limits.warm_spares, self.limits.warm_spare_window);
        self.keys.retain(|key, ks| {
            !ks.workers.is_empty()
                || ks.spawning
                || ks.backoff_until.is_some()
                || ks.restart.quarantined_until(now).is_some()
                || ks.restart.restarts_in_window(now, policy) > 0
                || waiting.contains(key)
                || spares_wanted(ks.last_lease, now, warm_spares, window) > 0
        });
        let keys = &self.keys;
        self.former_keys
            .retain(|_, f| keys.contains_key(&f.key) && within(Some(f.last_used), now, window));
        self.serve_waiters(now);
        self.effects()
    }

    /// Stop leasing: every waiter fails, and so does every later acquire.
    pub(crate) fn close(&mut self) -> Vec<Effect<Spec, S>> {
        self.closed = true;
        for w in self.waiters.drain(..) {
            self.out.push(Effect::Fail {
                request: w.id,
                error: PoolError::Closed,
            });
        }
        self.effects()
    }

    /// Forgets every worker (the pool is stopping them all); returns their ids.
    pub(crate) fn remove_all_workers(&mut self) -> Vec<WorkerId> {
        let mut ids: Vec<WorkerId> = self.workers.keys().copied().collect();
        ids.sort_unstable();
        for id in &ids {
            self.remove_worker(*id);
        }
        ids
    }

    // ---- Queries ---------------------------------------------------------------------------

    /// The leased conversation's worker and CLI session, once it is open (what an abort needs).
    pub(crate) fn open_lease(&self, conversation: &str) -> Option<(WorkerId, CliSessionId)> {
        let conv = self.conversations.get(conversation).filter(|c| c.leased)?;
        self.workers.get(&conv.worker)?;
        Some((conv.worker, conv.cli_session_id.clone()?))
    }

    /// Every leased, opened conversation (what a shutdown aborts).
    pub(crate) fn open_leases(&self) -> Vec<(WorkerId, CliSessionId)> {
        self.conversations
            .keys()
            .filter_map(|k| self.open_lease(k))
            .collect()
    }

    /// Whether placement still keeps `key` (its workers, spares, backoff or quarantine).
    pub(crate) fn knows_key(&self, key: &PoolKey) -> bool {
        self.keys.contains_key(key)
    }

    /// Whether a start is in flight for any key.
    pub(crate) fn any_spawning(&self) -> bool {
        self.keys.values().any(|k| k.spawning)
    }

    /// Every worker's id and pid.
    pub(crate) fn worker_pids(&self) -> Vec<(WorkerId, u32)> {
        self.workers.iter().map(|(id, w)| (*id, w.pid)).collect()
    }

    /// Conversations currently leased.
    pub(crate) fn leased_count(&self) -> usize {
        self.conversations.values().filter(|c| c.leased).count()
    }

    /// The gauges' numbers: conversations, leases, waiters, live and draining workers, RSS.
    pub(crate) fn gauges(&self, now: Instant) -> crate::metrics::PoolGauges {
        let mut gauges = crate::metrics::PoolGauges {
            conversations: self.conversations.len(),
            leases: self.leased_count(),
            waiters: self.waiters.len(),
            ..crate::metrics::PoolGauges::default()
        };
        for (id, w) in &self.workers {
            match self.state_of(*id, w, now) {
                WorkerState::Draining => gauges.draining += 1,
                WorkerState::Spare => gauges.spare += 1,
                WorkerState::Live => gauges.live += 1,
            }
            gauges.rss_bytes += w.rss_bytes;
        }
        gauges
    }

    /// A worker's state for status and gauges: draining; a spare (empty, and its key keeps
    /// spares now); else live.
    fn state_of(&self, id: WorkerId, w: &Worker, now: Instant) -> WorkerState {
        if w.draining {
            WorkerState::Draining
        } else if is_spare(&w.view(id))
            && self
                .keys
                .get(&w.key)
                .is_some_and(|ks| self.spares_wanted(ks, now) > 0)
        {
            WorkerState::Spare
        } else {
            WorkerState::Live
        }
    }

    /// The pool's status as of `now`.
    pub(crate) fn status(&self, now: Instant) -> PoolStatus {
        let mut workers: Vec<WorkerStatus> = self
            .workers
            .iter()
            .map(|(id, w)| WorkerStatus {
                key_hash: w.key.short_hash(),
                pid: w.pid,
                state: self.state_of(*id, w, now),
                conversations: w.attached.len(),
                leases: w.leased,
                turns: w.turns,
                restarts: self
                    .keys
                    .get(&w.key)
                    .map(|k| k.restart.total_restarts())
                    .unwrap_or(0),
                rss_bytes: w.rss_bytes,
                primed: w.primed,
            })
            .collect();
        workers.sort_by(|a, b| a.key_hash.cmp(&b.key_hash).then(a.pid.cmp(&b.pid)));
        PoolStatus {
            workers,
            waiters: self.waiters.len(),
            conversations: self.conversations.len(),
            leased: self.leased_count(),
            quarantined_keys: self
                .keys
                .iter()
                .filter(|(_, k)| k.restart.quarantined_until(now).is_some())
                .map(|(key, _)| key.short_hash())
                .collect(),
            closed: self.closed,
            totals: self.totals.clone(),
            budget: ProcessBudget {
                max_processes: self.limits.max_processes,
                used: self.held(),
                by_backend: std::collections::BTreeMap::from([(
                    crate::metrics::COPILOT_BACKEND.to_owned(),
                    self.held(),
                )]),
            },
        }
    }

    // ---- Decisions -------------------------------------------------------------------------

    fn upkeep_limits(&self) -> UpkeepLimits {
        UpkeepLimits {
            idle_ttl: self.limits.idle_ttl,
            max_rss_bytes: self.limits.max_rss_bytes,
            max_turns_per_process: self.limits.max_turns_per_process,
        }
    }

    fn is_leased(&self, conversation: &str) -> bool {
        self.conversations
            .get(conversation)
            .is_some_and(|c| c.leased)
    }

    /// Whether `conversation` is leased, or a lease of it waits (its first turn's, for one,
    /// while its process starts: it has no binding yet).
    pub(crate) fn is_busy(&self, conversation: &str) -> bool {
        self.is_leased(conversation) || self.waiters.iter().any(|a| a.conversation == conversation)
    }

    fn worker_usable(&self, id: WorkerId) -> bool {
        self.workers
            .get(&id)
            .is_some_and(|w| !w.draining && w.alive)
    }

    /// Serves waiting leases in FIFO order, as far as capacity allows; then tops up the
    /// warm spares.
    fn serve_waiters(&mut self, now: Instant) {
        // The agents' turns counted once for the pass (each grant adds its own), not once per
        // waiter.
        if self.limits.max_leases_per_agent != usize::MAX && !self.waiters.is_empty() {
            self.turns_by_home = Some(self.turns_by_home());
        }
        let mut kept = VecDeque::new();
        while let Some(w) = self.waiters.pop_front() {
            match self.try_grant(&w, now) {
                Ok(true) => {}
                Err(error) => self.out.push(Effect::Fail {
                    request: w.id,
                    error,
                }),
                Ok(false) => kept.push_back(w),
            }
        }
        self.waiters = kept;
        self.turns_by_home = None;
        self.top_up_spares(now);
    }

    /// Grants now (true, with a `Grant` effect), fails, or returns false (wait; a spawn
    /// may have been started).
    fn try_grant(&mut self, ask: &Ask<Spec>, now: Instant) -> Result<bool, PoolError> {
        if self.closed {
            return Err(PoolError::Closed);
        }
        // One turn at a time per conversation: a leased conversation's next lease waits in
        // the FIFO until the return (or is refused at once with `fail_if_busy`).
        if self.is_leased(&ask.conversation) {
            // A resume ahead is nobody's lease: the ask waits for it (moments) instead.
            let ahead = self
                .conversations
                .get(&ask.conversation)
                .is_some_and(|c| c.ahead);
            if ask.fail_if_busy && !ahead {
                return Err(PoolError::ConversationBusy {
                    session_key: ask.gateway_key.clone(),
                });
            }
            return Ok(false);
        }
        // The agent's own turns hold its share: a lease for turns waits for one of them,
        // starting nothing. A deletion's or a process lease (no turn, moments) is not held.
        if ask.traffic && !ask.process_only && self.agent_at_lease_cap(&ask.key.home) {
            return Ok(false);
        }
        let ks = self
            .keys
            .entry(ask.key.clone())
            .or_insert_with(|| KeyState {
                spec: ask.spec.clone(),
                workers: Vec::new(),
                spawning: false,
                respawn: false,
                backoff_until: None,
                restart: RestartTracker::default(),
                last_start_error: None,
                last_lease: None,
                outgrown: None,
                rotated: false,
            });
        if let Some(until) = ks.restart.quarantined_until(now) {
            return Err(PoolError::RestartIntensityExceeded {
                key_hash: ask.key.short_hash(),
                retry_after: until.saturating_duration_since(now),
                last_error: ks.last_start_error.as_ref().map(ToString::to_string),
            });
        }
        if ask.traffic && !self.queue_full {
            // Traffic of this key: its warm spares are kept for the window from now (for
            // an ask that cannot wait, once it is granted).
            ks.last_lease = Some(now);
            ks.rotated = false;
        }
        self.drain_rotated(ask, now);
        if ask.process_only {
            return Ok(self.grant_process(ask, now));
        }

        // Being detached from its previous worker: wait for the confirmation.
        if self.detaching.contains_key(&ask.conversation) {
            return Ok(false);
        }
        // Still attached to a usable worker of this key with the same settings: reuse it.
        if let Some(conv) = self.conversations.get(&ask.conversation) {
            let same = conv.compat == ask.compat
                && (conv.setup == ask.setup || ask.any_setup)
                && self.worker_usable(conv.worker)
                && self
                    .workers
                    .get(&conv.worker)
                    .is_some_and(|w| w.key == ask.key);
            if same {
                let id = conv.worker;
                return Ok(self.grant_attached(ask, id, now));
            }
        }

        let new_to_the_key = !self.conversations.contains_key(&ask.conversation);
        let mut target = self.place_new(&ask.key, new_to_the_key, now);
        if target.is_none() && !self.grow(ask.id, &ask.key, now) {
            // No room and no new process allowed: a conversation parked (with other
            // settings) on a usable worker of its key takes its own slot there again (its
            // session moves with the grant, whose open detaches it before reopening);
            // otherwise room is made on one of this key's workers by detaching its least
            // recently used parked conversation.
            target = self
                .parked_on_usable_worker(ask)
                .or_else(|| self.detach_lru_parked_of_key(&ask.key, &ask.conversation));
        }
        let Some(target) = target else {
            return Ok(false);
        };
        if !self.conversations.contains_key(&ask.conversation)
            && self.conversations.len() >= self.limits.max_sessions
            && !self.detach_lru_parked(&ask.conversation)
        {
            return Ok(false);
        }
        // Move (or place) the conversation onto the target.
        let carried = self.conversations.remove(&ask.conversation).map(|conv| {
            if let Some(w) = self.workers.get_mut(&conv.worker) {
                w.attached.remove(&ask.conversation);
            }
            self.maybe_finish_drain(conv.worker);
            Carried {
                session: conv.parked,
                same_worker: false,
                from: conv.worker,
            }
        });
        let Some(w) = self.workers.get_mut(&target) else {
            // The target was the worker the conversation left and it just finished
            // draining: nothing was granted, and what it carried is detached.
            if let Some(Carried {
                session: Some(session),
                from,
                ..
            }) = carried
            {
                self.detach(
                    ask.conversation.clone(),
                    from,
                    DetachTarget::Session(session),
                );
            }
            return Ok(false);
        };
        w.attached.insert(ask.conversation.clone());
        w.leased += 1;
        w.warm = false;
        w.last_used = now;
        self.former_keys.remove(&ask.conversation);
        self.conversations.insert(
            ask.conversation.clone(),
            Conversation {
                worker: target,
                cli_session_id: None,
                compat: ask.compat.clone(),
                setup: ask.setup.clone(),
                parked: None,
                leased: true,
                last_used: now,
                ahead: false,
                for_turns: ask.traffic,
                home: ask.key.home.clone(),
            },
        );
        if ask.traffic {
            self.count_turn(&ask.key.home);
        }
        let resume_crashes = self.resume_crashes(&ask.conversation, now);
        self.out.push(Effect::Grant(Granted {
            request: ask.id,
            conversation: ask.conversation.clone(),
            worker: target,
            carried,
            resume_crashes,
        }));
        Ok(true)
    }

    /// Grants a process lease on the key's least busy usable worker; with none, starts one
    /// if the caps allow (or waits for room) and returns false.
    fn grant_process(&mut self, ask: &Ask<Spec>, now: Instant) -> bool {
        let target = self.keys.get(&ask.key).and_then(|ks| {
            least_busy(
                ks.workers
                    .iter()
                    .filter_map(|id| self.workers.get(id).map(|w| w.view(*id))),
            )
        });
        let Some(w) = target.and_then(|id| self.workers.get_mut(&id).map(|w| (id, w))) else {
            self.grow(ask.id, &ask.key, now);
            return false;
        };
        let (id, w) = w;
        // A call naming no conversation leaves a warm spare warm.
        w.leased += 1;
        w.last_used = now;
        self.out.push(Effect::GrantProcess {
            request: ask.id,
            worker: id,
        });
        true
    }

    /// The usable worker of `ask`'s key its conversation is parked on, if it is.
    fn parked_on_usable_worker(&self, ask: &Ask<Spec>) -> Option<WorkerId> {
        let conv = self
            .conversations
            .get(&ask.conversation)
            .filter(|c| !c.leased)?;
        let usable = self.worker_usable(conv.worker)
            && self
                .workers
                .get(&conv.worker)
                .is_some_and(|w| w.key == ask.key);
        usable.then_some(conv.worker)
    }

    fn resume_crashes(&self, conversation: &str, now: Instant) -> u32 {
        self.resume_crashes
            .get(conversation)
            .map_or(0, |c| c.at(now))
    }

    fn grant_attached(&mut self, ask: &Ask<Spec>, id: WorkerId, now: Instant) -> bool {
        let resume_crashes = self.resume_crashes(&ask.conversation, now);
        let (Some(w), Some(conv)) = (
            self.workers.get_mut(&id),
            self.conversations.get_mut(&ask.conversation),
        ) else {
            return false;
        };
        w.leased += 1;
        w.warm = false;
        w.last_used = now;
        conv.leased = true;
        conv.ahead = false;
        conv.for_turns = ask.traffic;
        conv.home.clone_from(&ask.key.home);
        conv.last_used = now;
        let session = conv.parked.take();
        self.out.push(Effect::Grant(Granted {
            request: ask.id,
            conversation: ask.conversation.clone(),
            worker: id,
            carried: Some(Carried {
                session,
                same_worker: true,
                from: id,
            }),
            resume_crashes,
        }));
        if ask.traffic {
            self.count_turn(&ask.key.home);
        }
        true
    }

    /// The views of `key`'s workers.
    fn views_of(&self, key: &PoolKey) -> Vec<WorkerView> {
        self.keys.get(key).map_or_else(Vec::new, |ks| {
            ks.workers
                .iter()
                .filter_map(|id| self.workers.get(id).map(|w| w.view(*id)))
                .collect()
        })
    }

    fn packing(&self) -> Packing {
        Packing {
            busy_leases_per_process: self.limits.busy_leases_per_process,
            cpu_processes_per_key: self.limits.cpu_processes_per_key,
        }
    }

    /// Where a conversation that is not attached goes (`None`: the key needs a start): the
    /// least loaded process of the key that already serves and has room; when those are
    /// all busy ([`spread`]), the key's spare instead, or one more process is started for
    /// the next conversation while this one joins; with no serving process with room, the
    /// key's spare (the oldest empty worker). `grows`: the conversation holds no slot on any
    /// process now (one that does, back with other settings, finding them full is no sign
    /// that the key outgrew them).
    fn place_new(&mut self, key: &PoolKey, grows: bool, now: Instant) -> Option<WorkerId> {
        let views = self.views_of(key);
        let max = self.limits.max_sessions_per_process;
        let spare = spare(views.iter().copied().filter(|w| w.attached < max));
        let Some(joined) = least_loaded(views.iter().copied().filter(|w| w.attached > 0), max)
        else {
            if grows
                && views.iter().any(|w| serves(w) && w.attached >= max)
                && let Some(ks) = self.keys.get_mut(key)
            {
                ks.outgrown = Some(now);
            }
            return spare.or_else(|| least_loaded(views.iter().copied(), max));
        };
        if spread(views.iter().copied(), &self.packing()) {
            if spare.is_some() {
                return spare;
            }
            self.start_extra(key, now);
        }
        Some(joined)
    }

    /// Starts one more worker for `key` (a warm spare, or a process for a busy key) if the
    /// caps allow it without stopping anything; false when they do not.
    fn start_extra(&mut self, key: &PoolKey, now: Instant) -> bool {
        if self.closed {
            return false;
        }
        let room = has_room(self.held(), &self.others, self.limits.max_processes);
        let Some(ks) = self.keys.get_mut(key) else {
            return false;
        };
        if !room
            || ks.spawning
            || ks.backoff_until.is_some_and(|t| now < t)
            || ks.restart.quarantined_until(now).is_some()
            || ks.workers.len() >= self.limits.max_processes_per_key
        {
            return false;
        }
        ks.spawning = true;
        self.out.push(Effect::Spawn {
            key: key.clone(),
            spec: ks.spec.clone(),
            prime: true,
        });
        true
    }

    /// How many spares `ks` keeps now: `warm_spares` within the window after its last
    /// lease, but none beside a process of the key that serves conversations: while one has
    /// room, the next new conversation goes there at once; when all are full, a spare stands
    /// beside them only if the key outgrew them within the window (a conversation found them
    /// full), since a key whose conversations all fit would only pay a process's memory for
    /// it. A spare stands in for serving processes that went (idle TTL, recycling, a crash, a
    /// drain), so a returning agent's conversation starts at once.
    fn spares_wanted(&self, ks: &KeyState<Spec>, now: Instant) -> usize {
        let max = self.limits.max_sessions_per_process;
        let (mut serving, mut room) = (false, false);
        for view in ks
            .workers
            .iter()
            .filter_map(|id| self.workers.get(id).map(|w| w.view(*id)))
            .filter(serves)
        {
            serving = true;
            room |= view.attached < max;
        }
        let window = self.limits.warm_spare_window;
        if room || (serving && !within(ks.outgrown, now, window)) {
            return 0;
        }
        spares_wanted(
            ks.last_lease,
            now,
            self.limits.warm_spares,
            self.limits.warm_spare_window,
        )
    }

    /// Whether a lease runs on a process of `ks` (a spare's own resumes ahead aside).
    fn key_busy(&self, ks: &KeyState<Spec>) -> bool {
        ks.workers.iter().any(|id| {
            self.workers
                .get(id)
                .is_some_and(|w| w.leased > 0 && !w.warm)
        })
    }

    /// Whether a process of `key` was evicted and is still stopping.
    fn key_stopping(&self, key: &PoolKey) -> bool {
        self.stopping.values().any(|s| s.key == *key)
    }

    /// `worker`'s entry among the stopping ones (of `key`), made if it has none yet.
    fn stopping_entry(&mut self, worker: WorkerId, key: &PoolKey) -> &mut Stopping {
        self.stopping.entry(worker).or_insert_with(|| Stopping {
            key: key.clone(),
            held: Vec::new(),
            for_other: false,
            for_ask: None,
            for_key: None,
        })
    }

    /// The spares of `ks` (oldest first).
    fn spares_of(&self, ks: &KeyState<Spec>) -> Vec<WorkerId> {
        let mut spares: Vec<WorkerId> = ks
            .workers
            .iter()
            .copied()
            .filter(|id| self.workers.get(id).is_some_and(|w| is_spare(&w.view(*id))))
            .collect();
        spares.sort_unstable();
        spares
    }

    /// Starts a spare for every key with fewer than it keeps, once the key is quiet (no
    /// lease running on any of its processes: a spare's start and priming take ~300 ms of
    /// CPU, which must not compete with the key's own turns, and a key under load holds no
    /// idle process beside its busy ones) and none of its evicted processes is still
    /// stopping (the spare that stands in for one must not add up with it); one start in
    /// flight per key; never for a key
    /// whose processes crashed within the restart window (a crash loop gets no spares to
    /// burn).
    fn top_up_spares(&mut self, now: Instant) {
        if self.limits.warm_spares == 0 || self.closed {
            return;
        }
        let policy = &self.limits.restart;
        let mut short: Vec<PoolKey> = self
            .keys
            .iter()
            .filter(|(key, ks)| {
                // A restart is scheduled (a crashed worker's replacement): it starts
                // unprimed for the conversations coming back to it, and a primed spare
                // started first would hold their leases up for its priming turn.
                !ks.spawning
                    && ks.backoff_until.is_none()
                    && ks.restart.restarts_in_window(now, policy) == 0
                    && !self.key_busy(ks)
                    && !self.key_stopping(key)
                    && self.spares_of(ks).len() < self.spares_wanted(ks, now)
            })
            .map(|(key, _)| key.clone())
            .collect();
        short.sort_by_cached_key(PoolKey::short_hash);
        for key in short {
            self.start_extra(&key, now);
        }
    }

    /// Starts a worker for `key` if the caps allow (evicting the least recently used idle
    /// worker of another key when the pool is full). Returns false when no new process may
    /// come for this key (its caps are reached and no idle worker can make room).
    fn grow(&mut self, ask: RequestId, key: &PoolKey, now: Instant) -> bool {
        let Some(ks) = self.keys.get(key) else {
            return false;
        };
        if ks.spawning || ks.backoff_until.is_some_and(|t| now < t) {
            return true;
        }
        if ks.workers.len() >= self.limits.max_processes_per_key || self.queue_full {
            return false;
        }
        if !has_room(self.held(), &self.others, self.limits.max_processes) {
            // Room is being made for this ask, or for its key, already: it waits for that
            // stop.
            if self
                .stopping
                .values()
                .any(|s| s.for_ask == Some(ask) || s.for_key.as_ref() == Some(key))
            {
                return true;
            }
            // The oldest idle process makes room: a worker of another key here, or the CLI
            // side's parked process (asked for once; the lease waits until it is gone).
            let victim = idle_victim(
                self.workers
                    .iter()
                    .filter(|(_, w)| w.key != *key)
                    .map(|(id, w)| w.view(*id)),
            );
            let own = victim
                .and_then(|id| self.workers.get(&id))
                .map(|w| w.last_used);
            match (make_room(own, self.others.idle_since), victim) {
                (Some(Room::Own), Some(id)) => {
                    // The start follows once the victim is gone (`eviction_done` serves
                    // the waiters again): the cap holds processes, not workers.
                    self.evict(id, Eviction::Full);
                    if let Some(stopping) = self.stopping.get_mut(&id) {
                        stopping.for_ask = Some(ask);
                        stopping.for_key = Some(key.clone());
                    }
                    return true;
                }
                (Some(Room::Other), _) => {
                    if !self.asked_other {
                        self.asked_other = true;
                        self.out.push(Effect::EvictOther);
                    }
                    return true;
                }
                _ => return false,
            }
        }
        if let Some(ks) = self.keys.get_mut(key) {
            ks.spawning = true;
            self.out.push(Effect::Spawn {
                key: key.clone(),
                spec: ks.spec.clone(),
                prime: false,
            });
        }
        true
    }

    /// Detaches the least recently used parked conversation of a live worker of `key` and
    /// returns that worker (now with room for one more). Never `asking` itself: its parked
    /// session moves with its grant, and a detach of it racing its own open would break the
    /// one-owner rule.
    fn detach_lru_parked_of_key(&mut self, key: &PoolKey, asking: &str) -> Option<WorkerId> {
        let of_key = self.conversations.iter().filter(|(k, c)| {
            k.as_str() != asking
                && self.worker_usable(c.worker)
                && self.workers.get(&c.worker).is_some_and(|w| w.key == *key)
        });
        let conversation = lru_parked(of_key.map(|(k, c)| c.view(k)))?.to_owned();
        self.detach_parked(conversation)
    }

    /// Detaches the least recently used parked conversation (never `asking`) to make room.
    fn detach_lru_parked(&mut self, asking: &str) -> bool {
        let victim = lru_parked(
            self.conversations
                .iter()
                .filter(|(k, _)| k.as_str() != asking)
                .map(|(k, c)| c.view(k)),
        );
        match victim.map(str::to_owned) {
            Some(conversation) => {
                self.detach_parked(conversation);
                true
            }
            None => false,
        }
    }

    /// Removes a parked conversation from its worker (its binding stays for a resume, which
    /// waits for this detach); returns the worker.
    fn detach_parked(&mut self, conversation: String) -> Option<WorkerId> {
        let conv = self.conversations.remove(&conversation)?;
        if let Some(w) = self.workers.get_mut(&conv.worker) {
            w.attached.remove(&conversation);
            let key = w.key.clone();
            self.left_key(&conversation, &key, conv.last_used);
        }
        if let Some(session) = conv.parked {
            self.detach(conversation, conv.worker, DetachTarget::Session(session));
        }
        Some(conv.worker)
    }

    /// Asks for a confirmed detach; the conversation is not granted until it is answered.
    fn detach(&mut self, conversation: String, worker: WorkerId, target: DetachTarget<S>) {
        *self.detaching.entry(conversation.clone()).or_default() += 1;
        self.out.push(Effect::Detach {
            conversation,
            worker,
            target,
        });
    }

    /// A conversation that comes back with another credential version of its key's family
    /// (a token or BYOK key rotation) drains the old version's workers. Nothing else does:
    /// conversations of one family on different versions at once (two users' keys for one
    /// endpoint) must not stop each other's processes; a version nobody uses any more goes
    /// with the idle TTL.
    fn drain_rotated(&mut self, ask: &Ask<Spec>, now: Instant) {
        let attached = self
            .conversations
            .get(&ask.conversation)
            .and_then(|c| self.workers.get(&c.worker))
            .map(|w| &w.key);
        let old = attached
            .or_else(|| self.former_keys.get(&ask.conversation).map(|f| &f.key))
            .filter(|old| **old != ask.key && old.family() == ask.key.family())
            .cloned();
        if let Some(old) = old {
            // Acted on once: a lease still waiting drains no process started meanwhile.
            self.former_keys.remove(&ask.conversation);
            self.drain_version(&old, &ask.key, now);
        }
    }

    /// Remembers that `conversation`, last used at `last_used`, left a process of `key`.
    fn left_key(&mut self, conversation: &str, key: &PoolKey, last_used: Instant) {
        if self.former_keys.len() >= FORMER_KEYS_REMEMBERED
            && !self.former_keys.contains_key(conversation)
        {
            // The eighth used longest ago goes (amortized: one pass per eighth).
            let mut used: Vec<Instant> = self.former_keys.values().map(|f| f.last_used).collect();
            let cut = used.len() / 8;
            let (_, cutoff, _) = used.select_nth_unstable(cut);
            let cutoff = *cutoff;
            self.former_keys.retain(|_, f| f.last_used > cutoff);
        }
        self.former_keys.insert(
            conversation.to_owned(),
            FormerKey {
                key: key.clone(),
                last_used,
            },
        );
    }

    /// Drains every worker of `old` (a rotated-away version of `new`'s family) and forgets
    /// its traffic: its credentials are stale, so no warm spare is started for it.
    fn drain_version(&mut self, old: &PoolKey, new: &PoolKey, now: Instant) {
        if let Some(ks) = self.keys.get_mut(old) {
            ks.last_lease = None;
            ks.outgrown = None;
            ks.rotated = true;
        }
        let deadline = crate::deadline::from_std(now, self.limits.drain_grace);
        let mut drained = Vec::new();
        for (id, w) in &mut self.workers {
            if !w.draining && w.key == *old {
                w.draining = true;
                w.drain_deadline = Some(deadline);
                drained.push(*id);
            }
        }
        drained.sort_unstable();
        for id in drained {
            tracing::info!(key = %new.short_hash(), "Credentials rotated; draining the old worker.");
            self.maybe_finish_drain(id);
        }
    }

    fn maybe_finish_drain(&mut self, id: WorkerId) {
        let done = self
            .workers
            .get(&id)
            .is_some_and(|w| w.draining && w.leased == 0);
        if done {
            self.evict(id, Eviction::Drained);
        }
    }

    fn settle_return(
        &mut self,
        conversation: String,
        worker_id: WorkerId,
        session: Option<S>,
        settle: Settle,
        turns: u64,
        now: Instant,
    ) {
        let limits = self.upkeep_limits();
        let drain_grace = self.limits.drain_grace;
        let mut keep = false;
        let mut alive = false;
        if let Some(w) = self.workers.get_mut(&worker_id) {
            w.leased = w.leased.saturating_sub(1);
            w.turns += turns;
            w.last_used = now;
            if turns > 0 {
                self.totals.turns += turns;
                if let Some(ks) = self.keys.get_mut(&w.key) {
                    ks.restart.record_stable();
                }
            }
            if let Some(why) = recycle(&w.upkeep_view(worker_id), &limits) {
                tracing::info!(
                    turns = w.turns,
                    rss = w.rss_bytes,
                    ?why,
                    "Recycling a worker."
                );
                w.draining = true;
                w.drain_deadline = Some(crate::deadline::from_std(now, drain_grace));
            }
            keep = settle == Settle::Park && !w.draining && session.is_some();
            // A worker that died under the turn is a crash (its supervision event says
            // so), not something to stop.
            alive = w.alive;
        }
        if settle == Settle::Unsettled && alive {
            // The session may still be running a turn in that process: nothing but stopping
            // the process makes it safe to resume elsewhere. The eviction keeps every
            // conversation of the worker (this one included) from being granted until the
            // process is gone.
            if let Some(conv) = self.conversations.get_mut(&conversation)
                && conv.worker == worker_id
            {
                conv.leased = false;
                conv.parked = None;
            }
            tracing::warn!(
                "A dropped lease's turn did not end after its abort; stopping its process."
            );
            drop(session);
            self.evict(worker_id, Eviction::Unsettled);
            return;
        }
        match self.conversations.get_mut(&conversation) {
            Some(conv) if conv.worker == worker_id && keep => {
                conv.leased = false;
                conv.parked = session;
                conv.last_used = now;
            }
            Some(conv) if conv.worker == worker_id => {
                self.conversations.remove(&conversation);
                if let Some(w) = self.workers.get_mut(&worker_id) {
                    w.attached.remove(&conversation);
                    let key = w.key.clone();
                    self.left_key(&conversation, &key, now);
                }
                // Its binding stays for a resume, which waits for this detach.
                if let Some(session) = session {
                    self.detach(conversation, worker_id, DetachTarget::Session(session));
                }
            }
            _ => {
                if let Some(session) = session {
                    self.detach(conversation, worker_id, DetachTarget::Session(session));
                }
            }
        }
        self.maybe_finish_drain(worker_id);
    }

    fn on_spawned(&mut self, key: PoolKey, started: Started, now: Instant) -> Option<WorkerId> {
        let closed = self.closed;
        let ks = self.keys.get_mut(&key)?;
        ks.spawning = false;
        match started {
            Ok(_) if closed => None,
            Ok(StartedWorker { pid, primed }) => {
                ks.last_start_error = None;
                let rotated = ks.rotated;
                let key_of_start = key.clone();
                let id = self.next_worker_id;
                self.next_worker_id += 1;
                ks.workers.push(id);
                let restart = std::mem::take(&mut ks.respawn);
                if restart {
                    self.totals.restarts += 1;
                }
                self.totals.processes_spawned += 1;
                tracing::debug!(key = %key.short_hash(), pid, "Pool worker started.");
                self.emit(PoolEvent::WorkerStarted {
                    key_hash: key.short_hash(),
                    pid,
                    restart,
                    primed,
                });
                self.workers.insert(
                    id,
                    Worker {
                        key,
                        pid,
                        alive: true,
                        draining: false,
                        drain_deadline: None,
                        attached: HashSet::new(),
                        leased: 0,
                        turns: 0,
                        last_used: now,
                        rss_bytes: 0,
                        started: now,
                        served: false,
                        warm: false,
                        primed,
                    },
                );
                // Rotated away while it started (a spare priming with the old token): it
                // goes at once unless a lease of its key waits for it.
                if rotated && !self.waiters.iter().any(|w| w.key == key_of_start) {
                    if let Some(w) = self.workers.get_mut(&id) {
                        w.draining = true;
                        w.drain_deadline = Some(now);
                    }
                    self.maybe_finish_drain(id);
                }
                Some(id)
            }
            Err(error @ WorkerError::ResourceExhausted(_)) => {
                // The machine, not the runtime: no crash, no backoff, no quarantine. The
                // waiters hear why at once; the next lease tries again.
                tracing::warn!(key = %key.short_hash(), %error, "Pool worker could not start: out of resources.");
                let failed = PoolError::Worker(error);
                self.fail_waiters_of(&key, |_| failed.clone(), now);
                None
            }
            Err(error) => {
                // Not cached: the next lease tries again (after the backoff).
                tracing::warn!(key = %key.short_hash(), %error, "Pool worker failed to start.");
                ks.respawn = false;
                ks.last_start_error = Some(error);
                let already = ks.restart.quarantined_until(now).is_some();
                match ks.restart.record_crash(now, &self.limits.restart) {
                    RestartDecision::Restart { after } => {
                        // A retry is scheduled: the waiters stay queued for it (each still
                        // bounded by its own wait timeout).
                        ks.backoff_until = Some(crate::deadline::from_std(now, after));
                        self.out.push(Effect::RespawnAfter { key, after });
                    }
                    RestartDecision::Quarantine { until } => {
                        self.quarantine(&key, until, already, now)
                    }
                }
                None
            }
        }
    }

    /// Quarantines `key` until `until` (its waiters fail saying when to retry); `already`:
    /// it was quarantined before this crash (a worker of it still running died), which is
    /// no new quarantine to report.
    fn quarantine(&mut self, key: &PoolKey, until: Instant, already: bool, now: Instant) {
        let key_hash = key.short_hash();
        if !already {
            self.emit(PoolEvent::KeyQuarantined {
                key_hash: key_hash.clone(),
            });
        }
        // No restart scheduled before (another worker's backoff) starts one inside it.
        let last_error = self.keys.get_mut(key).and_then(|ks| {
            ks.respawn = false;
            ks.last_start_error.as_ref().map(ToString::to_string)
        });
        self.fail_waiters_of(
            key,
            |now| PoolError::RestartIntensityExceeded {
                key_hash: key_hash.clone(),
                retry_after: until.saturating_duration_since(now),
                last_error: last_error.clone(),
            },
            now,
        );
    }

    fn fail_waiters_of(
        &mut self,
        key: &PoolKey,
        error: impl Fn(Instant) -> PoolError,
        now: Instant,
    ) {
        let (fail, keep): (VecDeque<_>, VecDeque<_>) =
            self.waiters.drain(..).partition(|w| w.key == *key);
        self.waiters = keep;
        for w in fail {
            self.out.push(Effect::Fail {
                request: w.id,
                error: error(now),
            });
        }
    }

    /// Forgets a worker: its parked conversations are dropped (their bindings stay), leased
    /// ones are dropped when their lease returns.
    fn remove_worker(&mut self, id: WorkerId) -> bool {
        let Some(w) = self.workers.remove(&id) else {
            return false;
        };
        if let Some(ks) = self.keys.get_mut(&w.key) {
            ks.workers.retain(|x| *x != id);
        }
        for conversation in &w.attached {
            let Some(c) = self
                .conversations
                .get(conversation)
                .filter(|c| c.worker == id)
            else {
                continue;
            };
            // A leased one stays until its lease returns; both have left the process.
            let (leased, last_used) = (c.leased, c.last_used);
            if !leased {
                self.conversations.remove(conversation);
            }
            self.left_key(conversation, &w.key, last_used);
        }
        true
    }

    fn evict(&mut self, id: WorkerId, reason: Eviction) {
        let Some(w) = self.workers.get(&id) else {
            return;
        };
        let key_hash = w.key.short_hash();
        let pid = w.pid;
        // Its conversations resume elsewhere only once the worker (which detaches them on
        // its way out) has stopped.
        let mut attached: Vec<String> = w.attached.iter().cloned().collect();
        attached.sort_unstable();
        for key in &attached {
            *self.detaching.entry(key.clone()).or_default() += 1;
        }
        let key = w.key.clone();
        self.remove_worker(id);
        self.stopping_entry(id, &key);
        tracing::info!(pid, why = reason.describe(), "Evicting a pool worker.");
        self.totals.evicted += 1;
        self.emit(PoolEvent::WorkerEvicted {
            key_hash,
            pid,
            reason,
        });
        self.out.push(Effect::Evict {
            worker: id,
            reason,
            attached,
        });
    }
}
