//! The pool actor: a thin shell over the pure placement core ([`super::placement`]). It
//! feeds the core what happened (acquires, returns, spawns, crashes, confirmations, ticks)
//! and carries out the effects the core answers with: it owns the worker handles and the
//! reply ports, starts and stops workers, detaches sessions, measures memory, and publishes
//! events and gauges. It never awaits the runtime: spawns, stops, detaches and aborts run in
//! tasks that report back by message. Every decision is taken under the shared process
//! budget's lock ([`super::cli::CliPool::budget`]): the core hears the CLI side's count
//! first, a request of the core for the CLI side's idle process is carried out under the
//! same lock, and the CLI side hears this side's count after.

use std::collections::HashMap;
use std::time::Instant;

use ractor::{Actor, ActorProcessingErr, ActorRef, RpcReplyPort, SupervisionEvent};
use tokio::sync::{broadcast, watch};

use crate::ids::CliSessionId;
use crate::kinds::Priming;
use crate::metrics::{self, ProcessExit};
use crate::rpc::messages::{AbortParams, AbortReason, SessionAbort};
use crate::worker::{Session, WorkerConfig, WorkerError, WorkerExit, WorkerHandle};

use super::bindings::BindingStore;
use super::budget::Nudge;
use super::cli::{BudgetGuard, CliPool};
use super::config::PoolConfig;
use super::error::PoolError;
use super::key::PoolKey;
use super::lease::OpenReason;
use super::placement::{
    Abandon, Ask, Death, DetachTarget, Effect, Granted, Limits, Placement, RequestId, StartedWorker,
};
use super::prime::{PrimeVia, PrimingSink};
use super::status::{PoolEvent, PoolStatus};
use super::warm::{Recent, Reopen};

pub(crate) use super::placement::{Settle, WorkerId};

/// A conversation that was attached to a worker when its lease was granted.
pub(crate) type Carried = super::placement::Carried<Session>;

/// One lease asking for a place to run (its `id` is set by the actor).
pub(crate) type AcquireRequest = Ask<WorkerConfig>;

/// The answer to an acquire: the worker to use and what was attached before.
pub(crate) struct Grant {
    pub(crate) conversation: String,
    pub(crate) worker_id: WorkerId,
    pub(crate) worker: WorkerHandle,
    /// The conversation as it was attached before this lease, if it was.
    pub(crate) carried: Option<Carried>,
    /// Consecutive resumes of this conversation that crashed their runtime.
    pub(crate) resume_crashes: u32,
    /// Gives the slot back if the grant is dropped before it became a `Lease` (a failed
    /// open, or a caller that gave up while the grant was on its way).
    pub(crate) armed: bool,
    /// Set by the opener before it gives up: a session opened on the granted worker that
    /// must be detached with confirmation…
    pub(crate) opened: Option<Session>,
    /// …or the id of a session the granted worker may hold (an open that timed out).
    pub(crate) maybe_attached: Option<CliSessionId>,
    /// The open failed because its resume crashed the runtime.
    pub(crate) resume_crashed: bool,
    pub(crate) pool: ActorRef<PoolMsg>,
}

impl Grant {
    /// The grant became a lease (or was returned explicitly): no automatic return.
    pub(crate) fn disarm(&mut self) {
        self.armed = false;
    }
}

impl Drop for Grant {
    fn drop(&mut self) {
        if self.armed {
            let carried = self
                .carried
                .take()
                .and_then(|c| c.session.map(|s| (s, c.from)));
            let _ = self.pool.cast(PoolMsg::Abandoned(Box::new(Abandon {
                conversation: std::mem::take(&mut self.conversation),
                worker: self.worker_id,
                carried,
                opened: self.opened.take(),
                maybe_attached: self.maybe_attached.take(),
                resume_crashed: self.resume_crashed,
            })));
        }
    }
}

/// Messages of the pool actor.
pub(crate) enum PoolMsg {
    Acquire {
        req: Box<AcquireRequest>,
        reply: RpcReplyPort<Result<Grant, PoolError>>,
    },
    /// A process of a key for a call naming no conversation (`req.process_only`).
    AcquireProcess {
        req: Box<AcquireRequest>,
        reply: RpcReplyPort<Result<ProcessLease, PoolError>>,
    },
    /// A [`ProcessLease`] was dropped.
    Released(WorkerId),
    /// A lease opened (created or resumed) its CLI session; `reopen`: what it opened with,
    /// for a warm spare to resume it ahead of its return.
    Opened {
        conversation: String,
        worker_id: WorkerId,
        cli_session_id: CliSessionId,
        reason: OpenReason,
        reopen: Option<Box<Reopen>>,
    },
    /// A lease ended; `session` is `None` when it was lost or never opened.
    Return {
        conversation: String,
        worker_id: WorkerId,
        session: Option<Session>,
        settle: Settle,
        turns: u64,
    },
    Spawned {
        key: PoolKey,
        result: Result<WorkerHandle, WorkerError>,
        /// How it was primed, when it started ahead of demand.
        primed: Option<Priming>,
    },
    /// A grant that did not become a `Lease`: give the slot back and detach, with
    /// confirmation, whatever it may have left attached.
    Abandoned(Box<Abandon<Session>>),
    /// A background detach finished for these conversations.
    Detached {
        conversations_detached: Vec<String>,
        worker_id: WorkerId,
        ok: bool,
    },
    /// An evicted worker has stopped (its process is gone), with the conversations it held.
    EvictionDone {
        conversations: Vec<String>,
        worker_id: WorkerId,
    },
    Respawn(PoolKey),
    /// Resident memory of workers, measured off the actor.
    Measured(Vec<(WorkerId, u64)>),
    WaiterExpired(u64),
    Tick,
    Status(RpcReplyPort<PoolStatus>),
    /// Stop leasing: waiters fail, new acquires fail.
    Close(RpcReplyPort<()>),
    /// Abort the running turns of leased conversations; replies with how many.
    AbortLeased(RpcReplyPort<usize>),
    /// Abort the running turn of one conversation, on Copilot or a CLI backend; replies
    /// whether there was one (a Copilot lease with an open session, or a CLI turn).
    Abort {
        conversation: String,
        reply: RpcReplyPort<bool>,
    },
    /// Whether a conversation is leased or waited for (`Placement::is_busy`).
    IsBusy {
        conversation: String,
        reply: RpcReplyPort<bool>,
    },
    /// Stop every worker and wait until they are gone.
    StopAll(RpcReplyPort<()>),
    /// The CLI side's processes changed, or it needs an idle worker stopped.
    Cli(Nudge),
    /// A worker's actor ended and its process has been reaped (`crashed`: not an orderly
    /// stop): only now may its conversations resume elsewhere.
    WorkerGone {
        worker_id: WorkerId,
        crashed: bool,
    },
}

/// How a worker's actor ended, as its supervision event says.
enum ActorEnd {
    /// Its handler failed or panicked, or it ended on its child's death (`die`).
    Failed(String),
    /// Killed: no `post_stop`, no state handed back.
    Killed,
    /// Stopped: `post_stop` ran.
    Stopped,
}

impl ActorEnd {
    /// Whether the worker crashed, given its exit report: a failure always; a kill unless its
    /// orderly stop had begun (a stop that overran its limit is killed); a stop when its
    /// report says the process was not shut down.
    fn crashed(&self, exit: Option<WorkerExit>) -> bool {
        match self {
            ActorEnd::Failed(_) => true,
            ActorEnd::Killed => !exit.is_some_and(|e| e.is_shutdown()),
            ActorEnd::Stopped => exit.is_some_and(|e| !e.is_shutdown()),
        }
    }
}

/// The pool actor (its state is [`PoolState`]).
pub(crate) struct PoolActor;

/// What the pool actor starts with.
pub(crate) struct PoolArgs {
    pub(crate) config: PoolConfig,
    pub(crate) leased: watch::Sender<usize>,
    pub(crate) events: broadcast::Sender<PoolEvent>,
    /// The CLI side, whose processes share `max_processes`.
    pub(crate) cli: std::sync::Arc<CliPool>,
    /// The conversations' bindings (a resume ahead reads them).
    pub(crate) bindings: std::sync::Arc<BindingStore>,
    /// Where primings without a tunnel send their model call.
    pub(crate) priming_sink: Option<PrimingSink>,
}

/// What a runtime's "session not found" answer to a detach means.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum NotFound {
    /// The session was open in that process: not found there means not attached.
    Detached,
    /// The session's open may still be in progress: not found proves nothing.
    Unconfirmed,
}

/// Where the answer to an acquire goes.
enum Reply {
    Conversation(RpcReplyPort<Result<Grant, PoolError>>),
    Process(RpcReplyPort<Result<ProcessLease, PoolError>>),
}

impl Reply {
    fn is_closed(&self) -> bool {
        match self {
            Reply::Conversation(port) => port.is_closed(),
            Reply::Process(port) => port.is_closed(),
        }
    }

    fn fail(self, error: PoolError) {
        let _ = match self {
            Reply::Conversation(port) => port.send(Err(error)).is_ok(),
            Reply::Process(port) => port.send(Err(error)).is_ok(),
        };
    }
}

/// A process of a key, held for a call that names no conversation (`session.list`,
/// `models.list`, …; [`crate::pool::Pool::lease_process`]): the worker is not evicted, and
/// does not finish a drain, while it is held. Dropping it gives it back.
pub struct ProcessLease {
    worker: WorkerHandle,
    worker_id: WorkerId,
    pool: ActorRef<PoolMsg>,
}

impl ProcessLease {
    /// The process's worker: call the runtime through it.
    pub fn worker(&self) -> &WorkerHandle {
        &self.worker
    }

    /// The process id.
    pub fn pid(&self) -> u32 {
        self.worker.pid()
    }
}

impl std::fmt::Debug for ProcessLease {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ProcessLease")
            .field("pid", &self.worker.pid())
            .finish_non_exhaustive()
    }
}

impl Drop for ProcessLease {
    fn drop(&mut self) {
        let _ = self.pool.cast(PoolMsg::Released(self.worker_id));
    }
}

/// Everything the pool actor owns: the placement core and what the core must not hold
/// (handles, reply ports, the event channels, tasks).
pub(crate) struct PoolState {
    core: Placement<WorkerConfig, Session>,
    /// The handle of every worker the core knows.
    handles: HashMap<WorkerId, WorkerHandle>,
    /// Acquires not yet answered.
    replies: HashMap<RequestId, Reply>,
    next_request: RequestId,
    leased: watch::Sender<usize>,
    /// The gauges as last set: set again only when they changed (each set is a lookup in
    /// the recorder's registry, and most events of a turn change none of them), and all at
    /// every maintenance tick.
    gauges: Option<crate::metrics::PoolGauges>,
    events: broadcast::Sender<PoolEvent>,
    tick: Option<tokio::task::JoinHandle<()>>,
    myself: ActorRef<PoolMsg>,
    /// Workers being stopped; `StopAll` waits for them.
    stopping: Vec<tokio::task::JoinHandle<()>>,
    /// A `StopAll` waiting for in-flight spawns to land.
    stop_requested: Option<RpcReplyPort<()>>,
    /// The CLI side (the shared process budget).
    cli: std::sync::Arc<CliPool>,
    /// Each key's recently opened conversations, for its warm spare.
    recent: Recent,
    bindings: std::sync::Arc<BindingStore>,
    /// Where a priming turn of a worker without a tunnel sends its model call (`None`: the
    /// loopback listener could not be bound; such a call fails at once).
    priming_sink: Option<PrimingSink>,
}

impl Drop for PoolState {
    fn drop(&mut self) {
        if let Some(t) = self.tick.take() {
            t.abort();
        }
    }
}

impl Actor for PoolActor {
    type Msg = PoolMsg;
    type State = PoolState;
    type Arguments = PoolArgs;

    async fn pre_start(
        &self,
        myself: ActorRef<PoolMsg>,
        args: PoolArgs,
    ) -> Result<PoolState, ActorProcessingErr> {
        let interval = args.config.maintenance_interval;
        let tick = (!interval.is_zero()).then(|| myself.send_interval(interval, || PoolMsg::Tick));
        Ok(PoolState {
            core: Placement::new(Limits::from(&args.config)),
            handles: HashMap::new(),
            replies: HashMap::new(),
            next_request: 1,
            leased: args.leased,
            gauges: None,
            events: args.events,
            tick,
            myself,
            stopping: Vec::new(),
            stop_requested: None,
            cli: args.cli,
            recent: Recent::new(if args.config.warm_spares > 0 {
                args.config.warm_spare_conversations
            } else {
                0
            }),
            bindings: args.bindings,
            priming_sink: args.priming_sink,
        })
    }

    async fn handle(
        &self,
        _myself: ActorRef<PoolMsg>,
        msg: PoolMsg,
        state: &mut PoolState,
    ) -> Result<(), ActorProcessingErr> {
        state.observe();
        let now = Instant::now();
        let cli = state.cli.clone();
        let mut budget = cli.budget();
        let early = state.core.look_at_others(budget.cli_view(), now);
        // A spare may have come up, a conversation come free, or a resume ahead made way for
        // the next by ending or failing (they run a few at a time): resume ahead after these.
        let resume_ahead = match &msg {
            PoolMsg::Tick | PoolMsg::Spawned { .. } | PoolMsg::EvictionDone { .. } => true,
            PoolMsg::Return { conversation, .. } => state.core.resuming_ahead(conversation),
            PoolMsg::Abandoned(abandon) => state.core.resuming_ahead(&abandon.conversation),
            _ => false,
        };
        let effects = match msg {
            PoolMsg::Acquire { req, reply } => state.acquire(*req, Reply::Conversation(reply), now),
            PoolMsg::AcquireProcess { req, reply } => {
                state.acquire(*req, Reply::Process(reply), now)
            }
            PoolMsg::Released(worker_id) => state.core.released(worker_id, now),
            PoolMsg::Opened {
                conversation,
                worker_id,
                cli_session_id,
                reason,
                reopen,
            } => {
                if let Some(reopen) = reopen {
                    state.recent.remember(*reopen);
                }
                state
                    .core
                    .opened(&conversation, worker_id, cli_session_id, reason)
            }
            PoolMsg::Return {
                conversation,
                worker_id,
                session,
                settle,
                turns,
            } => {
                let session = session.filter(|s| s.is_alive());
                state
                    .core
                    .returned(conversation, worker_id, session, settle, turns, now)
            }
            PoolMsg::Spawned {
                key,
                result,
                primed,
            } => state.on_spawned(key, result, primed, now),
            PoolMsg::Abandoned(abandon) => state.core.abandoned(*abandon, now),
            PoolMsg::Detached {
                conversations_detached,
                worker_id,
                ok,
            } => state
                .core
                .detached(&conversations_detached, worker_id, ok, now),
            PoolMsg::EvictionDone {
                conversations,
                worker_id,
            } => state.core.eviction_done(&conversations, worker_id, now),
            PoolMsg::Respawn(key) => state.core.respawn_due(&key, now),
            PoolMsg::WaiterExpired(id) => state.core.expire(id),
            PoolMsg::Tick => {
                // Every gauge is set again once a tick (an exporter that drops gauges not
                // set for a while, or a recorder installed after the pool, gets them back).
                state.gauges = None;
                budget.republish_gauges();
                let effects = state.core.maintain(now);
                let core = &state.core;
                state.recent.retain_keys(|key| core.knows_key(key));
                state.measure();
                state.stopping.retain(|t| !t.is_finished());
                effects
            }
            PoolMsg::Measured(measured) => state.core.measured(&measured, now),
            PoolMsg::Status(reply) => {
                let mut status = state.core.status(now);
                status.budget.by_backend.extend(budget.cli_by_backend());
                status.budget.used = status.budget.by_backend.values().sum();
                status.waiters += budget.cli_waiting();
                let _ = reply.send(status);
                Vec::new()
            }
            PoolMsg::Close(reply) => {
                // The waiters hear `Closed` before the caller of `close` goes on.
                let effects = state.core.close();
                state.perform(effects);
                let _ = reply.send(());
                Vec::new()
            }
            PoolMsg::AbortLeased(reply) => {
                let open = state.core.open_leases();
                let n = open
                    .into_iter()
                    .filter(|(worker, id)| state.abort_turn(*worker, id, "pool shutdown"))
                    .count();
                let _ = reply.send(n);
                Vec::new()
            }
            PoolMsg::Abort {
                conversation,
                reply,
            } => {
                let copilot = state
                    .core
                    .open_lease(&conversation)
                    .is_some_and(|(w, id)| state.abort_turn(w, &id, "aborted by the gateway"));
                // A turn on a CLI backend: its lease is the CLI side's, not the placement's.
                let cli = state.cli.abort(&conversation);
                let _ = reply.send(copilot || cli);
                Vec::new()
            }
            PoolMsg::IsBusy {
                conversation,
                reply,
            } => {
                let _ = reply.send(state.core.is_busy(&conversation));
                Vec::new()
            }
            PoolMsg::StopAll(reply) => {
                state.stop_requested = Some(reply);
                Vec::new()
            }
            PoolMsg::Cli(Nudge::Changed) => state.core.others_changed(now),
            PoolMsg::Cli(Nudge::EvictIdle) if budget.cli_wants_room() => {
                state.core.evict_for_other()
            }
            PoolMsg::Cli(Nudge::EvictIdle) => Vec::new(),
            PoolMsg::WorkerGone { worker_id, crashed } => {
                state.worker_gone(worker_id, crashed, now)
            }
        };
        let effects = early.into_iter().chain(effects).collect();
        let effects = state.settle_budget(&mut budget, effects, now);
        drop(budget);
        state.perform(effects);
        if resume_ahead {
            state.resume_ahead(now);
        }
        state.try_finish_stop();
        state.publish();
        Ok(())
    }

    async fn handle_supervisor_evt(
        &self,
        _myself: ActorRef<PoolMsg>,
        event: SupervisionEvent,
        state: &mut PoolState,
    ) -> Result<(), ActorProcessingErr> {
        // Never stop the pool because a worker ended (ractor's default would).
        state.observe();
        let now = Instant::now();
        let cli = state.cli.clone();
        let mut budget = cli.budget();
        let early = state.core.look_at_others(budget.cli_view(), now);
        let ended = match &event {
            SupervisionEvent::ActorFailed(cell, error) => {
                Some((cell.get_id(), ActorEnd::Failed(error.to_string())))
            }
            // No state handed back: killed (ractor skipped `post_stop`).
            SupervisionEvent::ActorTerminated(cell, None, _) => {
                Some((cell.get_id(), ActorEnd::Killed))
            }
            // Stopped by us (eviction, shutdown) or after its child died (`die`).
            SupervisionEvent::ActorTerminated(cell, Some(_), _) => {
                Some((cell.get_id(), ActorEnd::Stopped))
            }
            _ => None,
        };
        let effects =
            match ended.and_then(|(actor, end)| state.worker_by_actor(actor).map(|id| (id, end))) {
                Some((worker_id, end)) => {
                    if let ActorEnd::Failed(error) = &end {
                        tracing::warn!(%error, "Pool worker failed.");
                    }
                    state.core.exited(worker_id);
                    match state.handles.get(&worker_id) {
                        Some(handle) if handle.is_reaped() && handle.exit().is_some() => {
                            state.worker_gone(worker_id, end.crashed(handle.exit()), now)
                        }
                        // ractor tells the supervisor before a killed or panicked actor's state
                        // drops, and that drop is what SIGKILLs the group and reports the exit
                        // once the process is reaped: the process may still run (and hold its
                        // sessions' locks) now. It counts as gone once reaped and reported.
                        Some(handle) => {
                            let handle = handle.clone();
                            let pool = state.myself.clone();
                            tokio::spawn(async move {
                                handle.reaped().await;
                                let exit = handle.reported().await;
                                let crashed = end.crashed(exit);
                                let _ = pool.cast(PoolMsg::WorkerGone { worker_id, crashed });
                            });
                            Vec::new()
                        }
                        None => Vec::new(),
                    }
                }
                None => Vec::new(),
            };
        let effects = early.into_iter().chain(effects).collect();
        let effects = state.settle_budget(&mut budget, effects, now);
        drop(budget);
        state.perform(effects);
        state.publish();
        Ok(())
    }

    async fn post_stop(
        &self,
        _myself: ActorRef<PoolMsg>,
        state: &mut PoolState,
    ) -> Result<(), ActorProcessingErr> {
        let effects = state.core.close();
        state.perform(effects);
        for (_, reply) in state.replies.drain() {
            reply.fail(PoolError::Closed);
        }
        let stops = state.take_all_workers();
        state.publish();
        futures_util::future::join_all(stops.iter().map(|h| h.shutdown())).await;
        futures_util::future::join_all(state.stopping.drain(..)).await;
        Ok(())
    }
}

impl PoolState {
    /// Carries out, under the budget's lock, the core's requests for the CLI side's idle
    /// process (each closed one lets the waiters here take its room), then tells the CLI
    /// side this side's count. Returns the other effects.
    fn settle_budget(
        &mut self,
        budget: &mut BudgetGuard<'_>,
        mut effects: Vec<Effect<WorkerConfig, Session>>,
        now: Instant,
    ) -> Vec<Effect<WorkerConfig, Session>> {
        loop {
            let asked = effects.iter().any(|e| matches!(e, Effect::EvictOther));
            effects.retain(|e| !matches!(e, Effect::EvictOther));
            if !asked || !budget.evict_for_copilot() {
                break;
            }
            self.core.set_others(budget.cli_view());
            effects.extend(self.core.others_changed(now));
        }
        budget.copilot_is(self.core.view());
        // A worker stopped for the CLI side is gone and the CLI side has had its room: the
        // waiters here get what it left (then the CLI side hears this side's count again).
        self.core.set_others(budget.cli_view());
        let owed = self.core.serve_owed(now);
        if !owed.is_empty() {
            effects.extend(owed);
            budget.copilot_is(self.core.view());
        }
        effects
    }

    /// Tells the core what the handles know already: children that exited (before their
    /// supervision event), and waiters whose caller gave up.
    fn observe(&mut self) {
        for (id, handle) in &self.handles {
            if handle.exit().is_some() {
                self.core.exited(*id);
            }
        }
        let gone: Vec<RequestId> = self
            .replies
            .iter()
            .filter(|(_, reply)| reply.is_closed())
            .map(|(id, _)| *id)
            .collect();
        for id in gone {
            self.replies.remove(&id);
            self.core.withdraw(id);
        }
    }

    fn acquire(
        &mut self,
        req: AcquireRequest,
        reply: Reply,
        now: Instant,
    ) -> Vec<Effect<WorkerConfig, Session>> {
        let id = self.next_request;
        self.next_request += 1;
        self.replies.insert(id, reply);
        let ask = Ask { id, ..req };
        self.core.acquire(ask, now)
    }

    fn on_spawned(
        &mut self,
        key: PoolKey,
        result: Result<WorkerHandle, WorkerError>,
        primed: Option<Priming>,
        now: Instant,
    ) -> Vec<Effect<WorkerConfig, Session>> {
        // A worker that died before this message arrived is a crash, not a worker.
        let result = match result {
            Ok(handle) => match handle.exit() {
                Some(exit) => Err(WorkerError::Died(exit)),
                None => Ok(handle),
            },
            Err(e) => Err(e),
        };
        let started = result
            .as_ref()
            .map(|h| StartedWorker {
                pid: h.pid(),
                primed,
            })
            .map_err(Clone::clone);
        let (id, effects) = self.core.spawned(key, started, now);
        match (id, result) {
            (Some(id), Ok(handle)) => {
                self.handles.insert(id, handle);
            }
            (None, Ok(handle)) => {
                // The pool closed while it started.
                metrics::process_exited(metrics::COPILOT_BACKEND, ProcessExit::Shutdown);
                self.stopping.push(tokio::spawn(async move {
                    handle.shutdown().await;
                }));
            }
            (_, Err(_)) => {}
        }
        effects
    }

    /// Carries out the core's effects.
    fn perform(&mut self, effects: Vec<Effect<WorkerConfig, Session>>) {
        for effect in effects {
            match effect {
                Effect::Grant(granted) => self.deliver(granted),
                Effect::GrantProcess { request, worker } => self.deliver_process(request, worker),
                Effect::Fail { request, error } => {
                    if let Some(reply) = self.replies.remove(&request) {
                        reply.fail(error);
                    }
                }
                Effect::Queued { request, wait } => {
                    self.myself
                        .send_after(wait, move || PoolMsg::WaiterExpired(request));
                }
                Effect::Spawn { key, spec, prime } => self.start_spawn(key, spec, prime),
                Effect::RespawnAfter { key, after } => {
                    self.myself.send_after(after, move || PoolMsg::Respawn(key));
                }
                Effect::Detach {
                    conversation,
                    worker,
                    target,
                } => self.detach(conversation, worker, target),
                Effect::Evict {
                    worker,
                    reason,
                    attached,
                } => {
                    metrics::evicted(metrics::COPILOT_BACKEND, reason);
                    let target = self.myself.clone();
                    let handle = self.handles.remove(&worker);
                    self.stopping.retain(|t| !t.is_finished());
                    self.stopping.push(tokio::spawn(async move {
                        if let Some(handle) = handle {
                            handle.shutdown().await;
                        }
                        let _ = target.cast(PoolMsg::EvictionDone {
                            conversations: attached,
                            worker_id: worker,
                        });
                    }));
                }
                Effect::Forget { worker } => {
                    self.handles.remove(&worker);
                }
                // Carried out under the budget's lock (`settle_budget`).
                Effect::EvictOther => {}
                Effect::Event(event) => {
                    match &event {
                        PoolEvent::WorkerCrashed { .. } => {
                            metrics::process_exited(metrics::COPILOT_BACKEND, ProcessExit::Crash)
                        }
                        PoolEvent::KeyQuarantined { .. } => {
                            metrics::quarantined(metrics::COPILOT_BACKEND)
                        }
                        _ => {}
                    }
                    // Nobody listening is fine.
                    let _ = self.events.send(event);
                }
            }
        }
    }

    /// Hands a grant to its caller; if the caller is gone, the grant is dropped here and its
    /// guard returns the slot (and detaches what it carried) through the mailbox.
    fn deliver(&mut self, granted: Granted<Session>) {
        let reply = match self.replies.remove(&granted.request) {
            Some(Reply::Conversation(port)) => Some(port),
            Some(other) => {
                other.fail(PoolError::Internal(
                    "a conversation was granted to a process request; please report this".into(),
                ));
                None
            }
            None => None,
        };
        let answer = self.arm(granted).ok_or_else(|| {
            PoolError::Internal(
                "granted a worker the pool holds no handle of; please report this".into(),
            )
        });
        if let Some(reply) = reply {
            let _ = reply.send(answer);
        }
    }

    /// The armed [`Grant`] a grant of the core becomes, on its worker's handle. With no
    /// handle (unreachable while the core grants only workers the actor holds a handle of)
    /// the slot, with what it carried, goes back through the same path as an abandoned
    /// grant's, and there is none.
    fn arm(&self, granted: Granted<Session>) -> Option<Grant> {
        let Some(worker) = self.handles.get(&granted.worker).cloned() else {
            let carried = granted.carried.and_then(|c| c.session.map(|s| (s, c.from)));
            let _ = self.myself.cast(PoolMsg::Abandoned(Box::new(Abandon {
                conversation: granted.conversation,
                worker: granted.worker,
                carried,
                opened: None,
                maybe_attached: None,
                resume_crashed: false,
            })));
            return None;
        };
        Some(Grant {
            conversation: granted.conversation,
            worker_id: granted.worker,
            worker,
            carried: granted.carried,
            resume_crashes: granted.resume_crashes,
            armed: true,
            opened: None,
            maybe_attached: None,
            resume_crashed: false,
            pool: self.myself.clone(),
        })
    }

    /// Hands a process lease to its caller; a caller that is gone drops it here, and its
    /// drop gives the worker back through the mailbox.
    fn deliver_process(&mut self, request: RequestId, worker_id: WorkerId) {
        let lease = self
            .handles
            .get(&worker_id)
            .cloned()
            .map(|worker| ProcessLease {
                worker,
                worker_id,
                pool: self.myself.clone(),
            });
        let reply = self.replies.remove(&request);
        match (reply, lease) {
            (Some(Reply::Process(port)), Some(lease)) => {
                let _ = port.send(Ok(lease));
            }
            (reply, lease) => {
                // Unreachable while the core grants only workers the actor holds a handle
                // of; the worker's lease count comes back either way.
                if lease.is_none() {
                    let _ = self.myself.cast(PoolMsg::Released(worker_id));
                }
                if let Some(reply) = reply {
                    reply.fail(PoolError::Internal(
                        "a process lease could not be delivered; please report this".into(),
                    ));
                }
            }
        }
    }

    fn start_spawn(&self, key: PoolKey, spec: WorkerConfig, prime: bool) {
        let target = self.myself.clone();
        let supervisor = self.myself.get_cell();
        let working_directory = spec.working_directory.clone();
        let via = match (&spec.model_tunnel, &self.priming_sink) {
            (Some(_), _) => PrimeVia::Tunnel,
            (None, Some(sink)) => PrimeVia::Sink(sink.base_url()),
            (None, None) => PrimeVia::Nothing,
        };
        tokio::spawn(async move {
            let started = Instant::now();
            let result = WorkerHandle::start_supervised(spec, supervisor).await;
            let outcome = match &result {
                Ok(h) if h.exit().is_none() => metrics::SpawnResult::Ok,
                Err(WorkerError::ResourceExhausted(_)) => metrics::SpawnResult::ResourceExhausted,
                _ => metrics::SpawnResult::Error,
            };
            metrics::process_started(metrics::COPILOT_BACKEND, outcome, started.elapsed());
            let mut primed = None;
            if prime && let Ok(handle) = &result {
                // Placement counts it as starting until then (the caps hold).
                let outcome = tokio::time::timeout(
                    super::prime::PRIME_LIMIT,
                    super::prime::prime(handle, &working_directory, &via),
                )
                .await;
                primed = Some(match outcome {
                    Ok(Ok(priming)) => {
                        tracing::debug!(
                            pid = handle.pid(),
                            priming = priming.label(),
                            "Primed a process started ahead of demand."
                        );
                        priming
                    }
                    Ok(Err(super::prime::PrimeError::TimedOut)) => {
                        tracing::info!(
                            pid = handle.pid(),
                            "Priming a process started ahead of demand ran out of time; it serves unprimed."
                        );
                        Priming::TimedOut
                    }
                    Ok(Err(error)) => {
                        tracing::info!(pid = handle.pid(), %error, "Priming a process started ahead of demand failed; it serves unprimed.");
                        Priming::Failed
                    }
                    Err(_) => {
                        tracing::info!(
                            pid = handle.pid(),
                            "Priming a process started ahead of demand ran out of time; it serves unprimed."
                        );
                        Priming::TimedOut
                    }
                });
            }
            let _ = target.cast(PoolMsg::Spawned {
                key,
                result,
                primed,
            });
        });
    }

    /// Runs a detach in a task; it reports back (`Detached`): confirmed, or failed (and the
    /// core then stops the worker). A worker that is gone holds nothing.
    fn detach(&mut self, conversation: String, worker: WorkerId, target: DetachTarget<Session>) {
        let (not_found, old, detach): (NotFound, _, futures_util::future::BoxFuture<'static, _>) =
            match target {
                DetachTarget::Session(session) => (
                    NotFound::Detached,
                    Some(session.worker().clone()),
                    Box::pin(async move { session.detach().await }),
                ),
                DetachTarget::Id(id) => match self.handles.get(&worker).cloned() {
                    Some(handle) => (
                        NotFound::Unconfirmed,
                        Some(handle.clone()),
                        Box::pin(async move { handle.detach_session(&id).await }),
                    ),
                    None => (NotFound::Detached, None, Box::pin(async { Ok(()) })),
                },
            };
        let target = self.myself.clone();
        tokio::spawn(async move {
            let ok = match detach.await {
                // Died is published once the process is gone (`die` reaps first).
                Ok(()) | Err(WorkerError::Died(_)) => true,
                // An orderly stop under way: the detach counts once the process is gone
                // (`shutdown` returns then).
                Err(WorkerError::Stopped) => {
                    if let Some(old) = old {
                        old.shutdown().await;
                    }
                    true
                }
                Err(error) if not_found == NotFound::Detached && super::is_not_found(&error) => {
                    true
                }
                Err(error) => {
                    tracing::warn!(%error, "Detaching a conversation failed; its worker will be stopped.");
                    false
                }
            };
            let _ = target.cast(PoolMsg::Detached {
                conversations_detached: vec![conversation],
                worker_id: worker,
                ok,
            });
        });
    }

    /// Resumes each key's remembered conversations onto its spare where placement lets it
    /// ([`Placement::warm_up`]), each in a task of its own ([`super::warm::resume_ahead`]);
    /// one granted is forgotten until its conversation is opened again.
    fn resume_ahead(&mut self, now: Instant) {
        if !self.recent.enabled() {
            return;
        }
        for reopen in self.recent.candidates() {
            let Some(granted) = self.core.warm_up(
                &reopen.key,
                &reopen.conversation,
                &reopen.compat,
                &reopen.setup,
                now,
            ) else {
                continue;
            };
            self.recent.take(&reopen);
            let Some(grant) = self.arm(granted) else {
                continue;
            };
            tokio::spawn(super::warm::resume_ahead(
                grant,
                reopen,
                self.bindings.clone(),
            ));
        }
    }

    /// Sends `session.abort` for a leased, opened conversation (in a task; its turn then ends
    /// `aborted` through its lease).
    fn abort_turn(&self, worker: WorkerId, cli_session_id: &CliSessionId, why: &str) -> bool {
        let Some(handle) = self.handles.get(&worker).cloned() else {
            return false;
        };
        // The runtime echoes the reason in the turn's `abort` event, which SDK clients read
        // as its enum: the pool's aborts are commands from outside the session.
        let params = AbortParams {
            session_id: cli_session_id.to_string(),
            reason: Some(AbortReason::RemoteCommand),
        };
        let why = why.to_owned();
        tokio::spawn(async move {
            if let Err(error) = handle.call::<SessionAbort>(&params).await {
                tracing::debug!(%error, %why, "Abort of a leased conversation failed.");
            }
        });
        true
    }

    /// Replies to a pending `StopAll` once no spawn is in flight: stops every worker and
    /// waits for them and for earlier evictions.
    fn try_finish_stop(&mut self) {
        if self.stop_requested.is_none() || self.core.any_spawning() {
            return;
        }
        let Some(reply) = self.stop_requested.take() else {
            return;
        };
        let stops = self.take_all_workers();
        let earlier: Vec<_> = self.stopping.drain(..).collect();
        tokio::spawn(async move {
            futures_util::future::join_all(stops.iter().map(|h| h.shutdown())).await;
            futures_util::future::join_all(earlier).await;
            let _ = reply.send(());
        });
    }

    /// Every worker, forgotten by the core, for stopping.
    fn take_all_workers(&mut self) -> Vec<WorkerHandle> {
        let stops: Vec<WorkerHandle> = self
            .core
            .remove_all_workers()
            .into_iter()
            .filter_map(|id| self.handles.remove(&id))
            .collect();
        for handle in &stops {
            // One whose crash was still on its way (its process being reaped) is a crash.
            let crashed = handle.exit().is_some_and(|e| !e.is_shutdown());
            let exit = if crashed {
                ProcessExit::Crash
            } else {
                ProcessExit::Shutdown
            };
            metrics::process_exited(metrics::COPILOT_BACKEND, exit);
        }
        stops
    }

    /// Reads every worker's resident memory off the actor (a blocking thread reads `/proc`);
    /// the answer comes back as `Measured`.
    fn measure(&self) {
        let pids = self.core.worker_pids();
        if pids.is_empty() {
            return;
        }
        let target = self.myself.clone();
        tokio::task::spawn_blocking(move || {
            let measured = pids
                .into_iter()
                .map(|(id, pid)| (id, crate::process::rss_bytes(pid).unwrap_or(0)))
                .collect();
            let _ = target.cast(PoolMsg::Measured(measured));
        });
    }

    /// A worker whose actor ended is gone with its process: a crash is the core's to replace
    /// or quarantine, an orderly stop is forgotten.
    fn worker_gone(
        &mut self,
        id: WorkerId,
        crashed: bool,
        now: Instant,
    ) -> Vec<Effect<WorkerConfig, Session>> {
        if crashed {
            let exit = self.handles.get(&id).and_then(|h| h.exit());
            return self.core.crashed(id, Death::of_worker(exit.as_ref()), now);
        }
        let (known, effects) = self.core.stopped(id, now);
        if known {
            metrics::process_exited(metrics::COPILOT_BACKEND, ProcessExit::Shutdown);
        }
        effects
    }

    fn worker_by_actor(&self, id: ractor::ActorId) -> Option<WorkerId> {
        self.handles
            .iter()
            .find(|(_, h)| h.actor().get_id() == id)
            .map(|(id, _)| *id)
    }

    /// Sets the pool's gauges and the leased count.
    fn publish(&mut self) {
        let gauges = self.core.gauges(Instant::now());
        if self.gauges != Some(gauges) {
            gauges.publish();
            self.gauges = Some(gauges);
        }
        self.leased.send_replace(self.core.leased_count());
    }
}
