//! The pool actor: decides where each conversation runs. It owns the map of keys to workers,
//! the attached conversations (parked between leases), the FIFO of waiting leases, crash
//! restart with backoff and intensity, rotation draining, eviction and recycling. It never
//! awaits the runtime: spawns, stops and aborts run in tasks that report back by message.

use std::collections::{HashMap, HashSet, VecDeque};
use std::time::{Duration, Instant};

use ractor::{Actor, ActorProcessingErr, ActorRef, RpcReplyPort, SupervisionEvent};
use tokio::sync::{broadcast, watch};

use crate::ids::CliSessionId;
use crate::kinds::Eviction;
use crate::metrics::{self, PoolGauges, ProcessExit};
use crate::rpc::messages::{AbortParams, SessionAbort};
use crate::worker::{Session, WorkerConfig, WorkerError, WorkerHandle};

use super::config::PoolConfig;
use super::error::PoolError;
use super::key::PoolKey;
use super::lease::OpenReason;
use super::restart::{RestartDecision, RestartTracker};
use super::status::{PoolEvent, PoolStatus, PoolTotals, WorkerState, WorkerStatus};

pub(crate) use super::placement::WorkerId;
use super::placement::{
    ConversationView, Recycle, UpkeepLimits, UpkeepView, WorkerView, evict_now, idle_victim,
    least_loaded, lru_parked, recycle,
};

/// Conversations whose resume crashes are remembered at most (a bound on memory; the
/// count restarts for all when it is reached).
const RESUME_CRASHES_REMEMBERED: usize = 4096;

/// One lease asking for a place to run.
pub(crate) struct AcquireRequest {
    pub(crate) key: PoolKey,
    /// How to spawn a worker for this key.
    pub(crate) spec: WorkerConfig,
    pub(crate) conversation: String,
    /// The conversation's compat key: a parked session with another one is not reused.
    pub(crate) compat: String,
    /// What the session is opened with (tools, handler flags): a parked session opened
    /// differently is resumed anew rather than reused.
    pub(crate) setup: String,
    /// The gateway's own key of the conversation (for errors).
    pub(crate) gateway_key: String,
    /// Refuse at once if the conversation is leased, instead of queueing behind its lease.
    pub(crate) fail_if_busy: bool,
    pub(crate) wait: Duration,
}

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
            let _ = self.pool.cast(PoolMsg::Abandoned {
                conversation: std::mem::take(&mut self.conversation),
                worker_id: self.worker_id,
                carried,
                opened: self.opened.take(),
                maybe_attached: self.maybe_attached.take(),
                resume_crashed: self.resume_crashed,
            });
        }
    }
}

/// A conversation that was attached to a worker when its lease was granted.
pub(crate) struct Carried {
    /// The attached session (`None` if it was lost with its worker).
    pub(crate) session: Option<Session>,
    /// True when the grant is on the same worker (no resume needed).
    pub(crate) same_worker: bool,
    /// The worker it was attached to.
    pub(crate) from: WorkerId,
}

/// What a runtime's "session not found" answer to a detach means.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum NotFound {
    /// The session was open in that process: not found there means not attached.
    Detached,
    /// The session's open may still be in progress: not found proves nothing.
    Unconfirmed,
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

/// Messages of the pool actor.
pub(crate) enum PoolMsg {
    Acquire {
        req: Box<AcquireRequest>,
        reply: RpcReplyPort<Result<Grant, PoolError>>,
    },
    /// A lease opened (created or resumed) its CLI session.
    Opened {
        conversation: String,
        worker_id: WorkerId,
        cli_session_id: CliSessionId,
        reason: OpenReason,
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
    },
    /// A grant that did not become a `Lease`: give the slot back and detach, with
    /// confirmation, whatever it may have left attached.
    Abandoned {
        conversation: String,
        worker_id: WorkerId,
        /// The session it carried from another worker, and that worker.
        carried: Option<(Session, WorkerId)>,
        /// A session it opened on `worker_id`.
        opened: Option<Session>,
        /// A session id `worker_id` may hold.
        maybe_attached: Option<CliSessionId>,
        resume_crashed: bool,
    },
    /// A background detach (or worker stop) finished for these conversations.
    Detached {
        conversations_detached: Vec<String>,
        worker_id: WorkerId,
        ok: bool,
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
    /// Abort the running turn of one conversation; replies whether it is leased and open.
    Abort {
        conversation: String,
        reply: RpcReplyPort<bool>,
    },
    /// Stop every worker and wait until they are gone.
    StopAll(RpcReplyPort<()>),
}

/// The pool actor (its state is [`PoolState`]).
pub(crate) struct PoolActor;

/// What the pool actor starts with.
pub(crate) struct PoolArgs {
    pub(crate) config: PoolConfig,
    pub(crate) leased: watch::Sender<usize>,
    pub(crate) events: broadcast::Sender<PoolEvent>,
}

struct KeyState {
    spec: WorkerConfig,
    workers: Vec<WorkerId>,
    spawning: bool,
    /// The next spawn replaces a crashed worker.
    respawn: bool,
    backoff_until: Option<Instant>,
    restart: RestartTracker,
    /// Why the last start of this key failed (cleared by a start that works).
    last_start_error: Option<WorkerError>,
}

struct WorkerEntry {
    key: PoolKey,
    handle: WorkerHandle,
    draining: bool,
    drain_deadline: Option<Instant>,
    /// Session keys attached to this worker.
    attached: HashSet<String>,
    leased: usize,
    turns: u64,
    last_used: Instant,
    rss_bytes: u64,
}

impl WorkerEntry {
    fn view(&self, id: WorkerId) -> WorkerView {
        WorkerView {
            id,
            attached: self.attached.len(),
            leased: self.leased,
            draining: self.draining,
            alive: self.handle.exit().is_none(),
            last_used: self.last_used,
        }
    }

    fn upkeep_view(&self) -> UpkeepView {
        UpkeepView {
            leased: self.leased,
            last_used: self.last_used,
            draining: self.draining,
            drain_deadline: self.drain_deadline,
            rss_bytes: self.rss_bytes,
            turns: self.turns,
        }
    }
}

struct Conversation {
    worker: WorkerId,
    /// The CLI session, once the lease has opened it.
    cli_session_id: Option<CliSessionId>,
    compat: String,
    setup: String,
    parked: Option<Session>,
    leased: bool,
    last_used: Instant,
}

impl Conversation {
    fn view<'a>(&self, key: &'a str) -> ConversationView<'a> {
        ConversationView {
            key,
            leased: self.leased,
            last_used: self.last_used,
        }
    }
}

struct Waiter {
    id: u64,
    req: AcquireRequest,
    reply: RpcReplyPort<Result<Grant, PoolError>>,
}

/// Everything the pool actor owns.
pub(crate) struct PoolState {
    config: PoolConfig,
    keys: HashMap<PoolKey, KeyState>,
    workers: HashMap<WorkerId, WorkerEntry>,
    conversations: HashMap<String, Conversation>,
    waiters: VecDeque<Waiter>,
    next_worker_id: WorkerId,
    next_waiter_id: u64,
    closed: bool,
    totals: PoolTotals,
    leased: watch::Sender<usize>,
    events: broadcast::Sender<PoolEvent>,
    tick: Option<tokio::task::JoinHandle<()>>,
    myself: ActorRef<PoolMsg>,
    /// Conversations whose session is being detached from a worker: they are not granted
    /// until the detach is confirmed (one owner per CLI session id).
    detaching: HashMap<String, usize>,
    /// Consecutive resumes that crashed the runtime, per conversation (cleared when it
    /// opens); at `max_resume_crashes` the conversation starts anew.
    resume_crashes: HashMap<String, u32>,
    /// Workers being stopped; `StopAll` waits for them.
    stopping: Vec<tokio::task::JoinHandle<()>>,
    /// A `StopAll` waiting for in-flight spawns to land.
    stop_requested: Option<RpcReplyPort<()>>,
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
            config: args.config,
            keys: HashMap::new(),
            workers: HashMap::new(),
            conversations: HashMap::new(),
            waiters: VecDeque::new(),
            next_worker_id: 1,
            next_waiter_id: 1,
            closed: false,
            totals: PoolTotals::default(),
            leased: args.leased,
            events: args.events,
            tick,
            myself: myself.clone(),
            detaching: HashMap::new(),
            resume_crashes: HashMap::new(),
            stopping: Vec::new(),
            stop_requested: None,
        })
    }

    async fn handle(
        &self,
        myself: ActorRef<PoolMsg>,
        msg: PoolMsg,
        state: &mut PoolState,
    ) -> Result<(), ActorProcessingErr> {
        match msg {
            PoolMsg::Acquire { req, reply } => state.acquire(*req, reply, &myself),
            PoolMsg::Opened {
                conversation,
                worker_id,
                cli_session_id,
                reason,
            } => {
                if let Some(conv) = state.conversations.get_mut(&conversation)
                    && conv.worker == worker_id
                {
                    conv.cli_session_id = Some(cli_session_id);
                }
                if let Some(w) = state.workers.get(&worker_id) {
                    state.emit(PoolEvent::ConversationOpened {
                        pid: w.handle.pid(),
                        reason,
                    });
                }
                state.resume_crashes.remove(&conversation);
                match reason {
                    OpenReason::Attached => {}
                    OpenReason::Resumed => state.totals.resumed += 1,
                    _ => state.totals.created += 1,
                }
            }
            PoolMsg::Return {
                conversation,
                worker_id,
                session,
                settle,
                turns,
            } => {
                state.on_return(conversation, worker_id, session, settle, turns);
                state.serve_waiters(&myself);
            }
            PoolMsg::Spawned { key, result } => {
                state.on_spawned(key, result, &myself);
                state.serve_waiters(&myself);
                state.try_finish_stop();
            }
            PoolMsg::Abandoned {
                conversation,
                worker_id,
                carried,
                opened,
                maybe_attached,
                resume_crashed,
            } => {
                state.on_return(conversation.clone(), worker_id, None, Settle::Detach, 0);
                if resume_crashed {
                    if state.resume_crashes.len() >= RESUME_CRASHES_REMEMBERED {
                        state.resume_crashes.clear();
                    }
                    *state
                        .resume_crashes
                        .entry(conversation.clone())
                        .or_default() += 1;
                }
                // One owner per CLI session id: the conversation is granted again only once
                // each of these is confirmed detached (or its worker stopped).
                if let Some((session, from)) = carried {
                    state.detach_in_background(conversation.clone(), session, from);
                }
                if let Some(session) = opened {
                    state.detach_in_background(conversation.clone(), session, worker_id);
                }
                if let Some(id) = maybe_attached {
                    state.detach_id_in_background(conversation, id, worker_id);
                }
                state.serve_waiters(&myself);
            }
            PoolMsg::Detached {
                conversations_detached,
                worker_id,
                ok,
            } => {
                for key in &conversations_detached {
                    if let Some(n) = state.detaching.get_mut(key) {
                        *n -= 1;
                        if *n == 0 {
                            state.detaching.remove(key);
                        }
                    }
                }
                if !ok && state.workers.contains_key(&worker_id) {
                    // The old owner may still hold the session: it must not live on.
                    state.evict(worker_id, Eviction::DetachFailed);
                }
                state.serve_waiters(&myself);
            }
            PoolMsg::Respawn(key) => {
                if let Some(ks) = state.keys.get_mut(&key) {
                    ks.backoff_until = None;
                    if !state.closed && ks.workers.is_empty() && !ks.spawning {
                        ks.respawn = true;
                        start_spawn(&key, ks, &myself);
                    }
                }
                state.serve_waiters(&myself);
            }
            PoolMsg::WaiterExpired(id) => {
                if let Some(pos) = state.waiters.iter().position(|w| w.id == id)
                    && let Some(w) = state.waiters.remove(pos)
                {
                    // A conversation still leased by another caller, or a key whose last start
                    // failed (its retry still pending), says why.
                    let busy = state.is_leased(&w.req.conversation);
                    let start_error = state
                        .keys
                        .get(&w.req.key)
                        .filter(|ks| ks.workers.is_empty())
                        .and_then(|ks| ks.last_start_error.clone());
                    let error = match (busy, start_error) {
                        (true, _) => PoolError::ConversationWaitTimeout {
                            session_key: w.req.gateway_key.clone(),
                            after: w.req.wait,
                        },
                        (false, Some(error)) => PoolError::Worker(error),
                        (false, None) => PoolError::WaitTimeout { after: w.req.wait },
                    };
                    let _ = w.reply.send(Err(error));
                }
            }
            PoolMsg::Tick => {
                state.maintain();
                state.measure();
                state.serve_waiters(&myself);
            }
            PoolMsg::Measured(measured) => {
                state.on_measured(measured);
                state.serve_waiters(&myself);
            }
            PoolMsg::Status(reply) => {
                let _ = reply.send(state.status());
            }
            PoolMsg::Close(reply) => {
                state.closed = true;
                for w in state.waiters.drain(..) {
                    let _ = w.reply.send(Err(PoolError::Closed));
                }
                let _ = reply.send(());
            }
            PoolMsg::AbortLeased(reply) => {
                let leased: Vec<String> = state
                    .conversations
                    .iter()
                    .filter(|(_, c)| c.leased)
                    .map(|(key, _)| key.clone())
                    .collect();
                let n = leased
                    .iter()
                    .filter(|key| state.abort_turn(key, "pool shutdown"))
                    .count();
                let _ = reply.send(n);
            }
            PoolMsg::Abort {
                conversation,
                reply,
            } => {
                let _ = reply.send(state.abort_turn(&conversation, "aborted by the gateway"));
            }
            PoolMsg::StopAll(reply) => {
                state.stop_requested = Some(reply);
                state.try_finish_stop();
            }
        }
        state.publish_gauges();
        Ok(())
    }

    async fn handle_supervisor_evt(
        &self,
        myself: ActorRef<PoolMsg>,
        event: SupervisionEvent,
        state: &mut PoolState,
    ) -> Result<(), ActorProcessingErr> {
        // Never stop the pool because a worker ended (ractor's default would).
        match event {
            SupervisionEvent::ActorFailed(cell, error) => {
                let id = state.worker_by_actor(cell.get_id());
                if let Some(id) = id {
                    tracing::warn!(%error, "Pool worker failed.");
                    state.on_crash(id, &myself);
                    state.serve_waiters(&myself);
                }
            }
            SupervisionEvent::ActorTerminated(cell, _, _) => {
                // Stopped by us (eviction) or killed: either way it is gone.
                if let Some(id) = state.worker_by_actor(cell.get_id()) {
                    let killed = state
                        .workers
                        .get(&id)
                        .and_then(|w| w.handle.exit())
                        .is_some_and(|e| !e.is_shutdown());
                    if killed {
                        state.on_crash(id, &myself);
                    } else if state.remove_worker(id).is_some() {
                        metrics::process_exited(ProcessExit::Shutdown);
                    }
                    state.serve_waiters(&myself);
                }
            }
            _ => {}
        }
        state.publish_gauges();
        Ok(())
    }

    async fn post_stop(
        &self,
        _myself: ActorRef<PoolMsg>,
        state: &mut PoolState,
    ) -> Result<(), ActorProcessingErr> {
        for w in state.waiters.drain(..) {
            let _ = w.reply.send(Err(PoolError::Closed));
        }
        let ids: Vec<WorkerId> = state.workers.keys().copied().collect();
        let stops: Vec<_> = ids
            .into_iter()
            .filter_map(|id| state.remove_worker(id))
            .collect();
        for _ in &stops {
            metrics::process_exited(ProcessExit::Shutdown);
        }
        state.publish_gauges();
        futures_util::future::join_all(stops.iter().map(|h| h.shutdown())).await;
        futures_util::future::join_all(state.stopping.drain(..)).await;
        Ok(())
    }
}

fn start_spawn(key: &PoolKey, ks: &mut KeyState, myself: &ActorRef<PoolMsg>) {
    ks.spawning = true;
    let spec = ks.spec.clone();
    let key = key.clone();
    let target = myself.clone();
    let supervisor = myself.get_cell();
    tokio::spawn(async move {
        let started = Instant::now();
        let result = WorkerHandle::start_supervised(spec, supervisor).await;
        let outcome = match &result {
            Ok(h) if h.exit().is_none() => metrics::SpawnResult::Ok,
            Err(WorkerError::ResourceExhausted(_)) => metrics::SpawnResult::ResourceExhausted,
            _ => metrics::SpawnResult::Error,
        };
        metrics::process_started(outcome, started.elapsed());
        let _ = target.cast(PoolMsg::Spawned { key, result });
    });
}

impl PoolState {
    /// Replies to a pending `StopAll` once no spawn is in flight: stops every worker and
    /// waits for them and for earlier evictions.
    fn try_finish_stop(&mut self) {
        if self.stop_requested.is_none() || self.keys.values().any(|k| k.spawning) {
            return;
        }
        let Some(reply) = self.stop_requested.take() else {
            return;
        };
        let ids: Vec<WorkerId> = self.workers.keys().copied().collect();
        let stops: Vec<WorkerHandle> = ids
            .into_iter()
            .filter_map(|id| self.remove_worker(id))
            .collect();
        for _ in &stops {
            metrics::process_exited(ProcessExit::Shutdown);
        }
        let earlier: Vec<_> = self.stopping.drain(..).collect();
        tokio::spawn(async move {
            futures_util::future::join_all(stops.iter().map(|h| h.shutdown())).await;
            futures_util::future::join_all(earlier).await;
            let _ = reply.send(());
        });
    }

    /// Detaches `session` from `worker_id` in a task; the conversation is not granted
    /// until the detach is confirmed (or, if it fails, the old worker is evicted).
    fn detach_in_background(
        &mut self,
        conversation: String,
        session: Session,
        worker_id: WorkerId,
    ) {
        self.confirm_detach(
            conversation,
            worker_id,
            NotFound::Detached,
            session.detach(),
        );
    }

    /// Detaches a session known only by id (an open that timed out may have attached it)
    /// from `worker_id`, like [`PoolState::detach_in_background`]. "Not found" proves
    /// nothing here (the runtime may still be working on the open), so only a confirmed
    /// detach keeps the worker.
    fn detach_id_in_background(
        &mut self,
        conversation: String,
        cli_session_id: CliSessionId,
        worker_id: WorkerId,
    ) {
        let Some(handle) = self.workers.get(&worker_id).map(|w| w.handle.clone()) else {
            // The worker is gone, and with it whatever it held.
            return;
        };
        self.confirm_detach(conversation, worker_id, NotFound::Unconfirmed, async move {
            handle.detach_session(&cli_session_id).await
        });
    }

    /// Runs `detach` in a task; the conversation is not granted until it reports back
    /// (`Detached`): confirmed, or failed, and then `worker_id` is evicted. A worker that is
    /// gone holds nothing.
    fn confirm_detach(
        &mut self,
        conversation: String,
        worker_id: WorkerId,
        not_found: NotFound,
        detach: impl std::future::Future<Output = Result<(), WorkerError>> + Send + 'static,
    ) {
        *self.detaching.entry(conversation.clone()).or_default() += 1;
        let target = self.myself.clone();
        tokio::spawn(async move {
            let ok = match detach.await {
                Ok(()) | Err(WorkerError::Died(_) | WorkerError::Stopped) => true,
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
                worker_id,
                ok,
            });
        });
    }

    /// Sends `session.abort` for a leased, opened conversation (in a task; its turn then ends
    /// `aborted` through its lease). False when it is not leased or not yet open.
    fn abort_turn(&self, conversation: &str, reason: &str) -> bool {
        let Some(conv) = self.conversations.get(conversation).filter(|c| c.leased) else {
            return false;
        };
        let Some(w) = self.workers.get(&conv.worker) else {
            return false;
        };
        let Some(cli_session_id) = &conv.cli_session_id else {
            return false;
        };
        let handle = w.handle.clone();
        let params = AbortParams {
            session_id: cli_session_id.to_string(),
            reason: Some(reason.to_owned()),
        };
        tokio::spawn(async move {
            if let Err(error) = handle.call::<SessionAbort>(&params).await {
                tracing::debug!(%error, "Abort of a leased conversation failed.");
            }
        });
        true
    }

    /// Whether another caller holds the conversation's lease.
    fn is_leased(&self, conversation: &str) -> bool {
        self.conversations
            .get(conversation)
            .is_some_and(|c| c.leased)
    }

    fn upkeep_limits(&self) -> UpkeepLimits {
        UpkeepLimits {
            idle_ttl: self.config.idle_ttl,
            max_rss_bytes: self.config.max_rss_bytes,
            max_turns_per_process: self.config.max_turns_per_process,
        }
    }

    fn worker_usable(&self, id: WorkerId) -> bool {
        self.workers
            .get(&id)
            .is_some_and(|w| !w.draining && w.handle.exit().is_none())
    }

    /// Sets the pool's gauges (processes by state, their summed RSS as of the last
    /// maintenance tick, conversations, leases, waiters).
    fn publish_gauges(&self) {
        let mut gauges = PoolGauges {
            sessions: self.conversations.len(),
            leases: self.leased_count(),
            waiters: self.waiters.len(),
            ..PoolGauges::default()
        };
        for w in self.workers.values() {
            if w.draining {
                gauges.draining += 1;
            } else {
                gauges.live += 1;
            }
            gauges.rss_bytes += w.rss_bytes;
        }
        gauges.publish();
    }

    fn leased_count(&self) -> usize {
        self.conversations.values().filter(|c| c.leased).count()
    }

    fn publish_leased(&self) {
        self.leased.send_replace(self.leased_count());
    }

    fn worker_by_actor(&self, id: ractor::ActorId) -> Option<WorkerId> {
        self.workers
            .iter()
            .find(|(_, w)| w.handle.actor().get_id() == id)
            .map(|(id, _)| *id)
    }

    fn acquire(
        &mut self,
        req: AcquireRequest,
        reply: RpcReplyPort<Result<Grant, PoolError>>,
        myself: &ActorRef<PoolMsg>,
    ) {
        match self.try_grant(&req, myself) {
            Ok(Some(grant)) => self.deliver(reply, grant),
            Err(e) => {
                let _ = reply.send(Err(e));
            }
            Ok(None) => {
                if self.waiters.len() >= self.config.max_waiters {
                    let _ = reply.send(Err(PoolError::WaitersFull {
                        max: self.config.max_waiters,
                    }));
                    return;
                }
                let id = self.next_waiter_id;
                self.next_waiter_id += 1;
                myself.send_after(req.wait, move || PoolMsg::WaiterExpired(id));
                self.waiters.push_back(Waiter { id, req, reply });
            }
        }
    }

    /// Hands a grant to its caller; if the caller is gone, the grant is undone.
    fn deliver(&mut self, reply: RpcReplyPort<Result<Grant, PoolError>>, grant: Grant) {
        // If the caller gave up, the grant comes back and is dropped here: its guard
        // returns the slot (and detaches what it carried) through the mailbox.
        let _ = reply.send(Ok(grant));
        self.publish_leased();
    }

    /// Serves waiting leases in FIFO order, as far as capacity allows.
    fn serve_waiters(&mut self, myself: &ActorRef<PoolMsg>) {
        let mut kept = VecDeque::new();
        while let Some(w) = self.waiters.pop_front() {
            if w.reply.is_closed() {
                continue;
            }
            match self.try_grant(&w.req, myself) {
                Ok(Some(grant)) => self.deliver(w.reply, grant),
                Err(e) => {
                    let _ = w.reply.send(Err(e));
                }
                Ok(None) => kept.push_back(w),
            }
        }
        self.waiters = kept;
    }

    /// Grants now, fails, or returns `None` (wait; a spawn may have been started).
    fn try_grant(
        &mut self,
        req: &AcquireRequest,
        myself: &ActorRef<PoolMsg>,
    ) -> Result<Option<Grant>, PoolError> {
        if self.closed {
            return Err(PoolError::Closed);
        }
        // One turn at a time per conversation: a leased conversation's next lease waits in
        // the FIFO until the return (or is refused at once with `fail_if_busy`).
        if self.is_leased(&req.conversation) {
            if req.fail_if_busy {
                return Err(PoolError::ConversationBusy {
                    session_key: req.gateway_key.clone(),
                });
            }
            return Ok(None);
        }
        let now = Instant::now();
        let ks = self
            .keys
            .entry(req.key.clone())
            .or_insert_with(|| KeyState {
                spec: req.spec.clone(),
                workers: Vec::new(),
                spawning: false,
                respawn: false,
                backoff_until: None,
                restart: RestartTracker::default(),
                last_start_error: None,
            });
        if let Some(until) = ks.restart.quarantined_until(now) {
            return Err(PoolError::RestartIntensityExceeded {
                key_hash: req.key.short_hash(),
                retry_after: until.saturating_duration_since(now),
            });
        }
        self.drain_other_versions(&req.key);

        // Being detached from its previous worker: wait for the confirmation.
        if self.detaching.contains_key(&req.conversation) {
            return Ok(None);
        }
        // Still attached to a usable worker of this key with the same settings: reuse it.
        if let Some(conv) = self.conversations.get(&req.conversation) {
            let same = conv.compat == req.compat
                && conv.setup == req.setup
                && self.worker_usable(conv.worker)
                && self
                    .workers
                    .get(&conv.worker)
                    .is_some_and(|w| w.key == req.key);
            if same {
                let id = conv.worker;
                return Ok(self.grant_attached(&req.conversation, id, now));
            }
        }

        let mut target = self.least_loaded(&req.key);
        if target.is_none() && !self.grow(&req.key, myself) {
            // No room and no new process allowed: make room on one of this key's workers
            // by detaching its least recently used parked conversation.
            target = self.detach_lru_parked_of_key(&req.key);
        }
        let Some(target) = target else {
            return Ok(None);
        };
        if !self.conversations.contains_key(&req.conversation)
            && self.conversations.len() >= self.config.max_sessions
            && !self.detach_lru_parked()
        {
            return Ok(None);
        }
        // Move (or place) the conversation onto the target.
        let carried = self.conversations.remove(&req.conversation).map(|conv| {
            if let Some(w) = self.workers.get_mut(&conv.worker) {
                w.attached.remove(&req.conversation);
            }
            self.maybe_finish_drain(conv.worker);
            Carried {
                session: conv.parked,
                same_worker: false,
                from: conv.worker,
            }
        });
        let Some(w) = self.workers.get_mut(&target) else {
            return Ok(None);
        };
        w.attached.insert(req.conversation.clone());
        w.leased += 1;
        w.last_used = now;
        let handle = w.handle.clone();
        self.conversations.insert(
            req.conversation.clone(),
            Conversation {
                worker: target,
                cli_session_id: None,
                compat: req.compat.clone(),
                setup: req.setup.clone(),
                parked: None,
                leased: true,
                last_used: now,
            },
        );
        Ok(Some(Grant {
            conversation: req.conversation.clone(),
            worker_id: target,
            worker: handle,
            carried,
            resume_crashes: self
                .resume_crashes
                .get(&req.conversation)
                .copied()
                .unwrap_or(0),
            armed: true,
            opened: None,
            maybe_attached: None,
            resume_crashed: false,
            pool: self.myself.clone(),
        }))
    }

    fn grant_attached(&mut self, conversation: &str, id: WorkerId, now: Instant) -> Option<Grant> {
        let w = self.workers.get_mut(&id)?;
        let conv = self.conversations.get_mut(conversation)?;
        w.leased += 1;
        w.last_used = now;
        conv.leased = true;
        conv.last_used = now;
        Some(Grant {
            conversation: conversation.to_owned(),
            worker_id: id,
            worker: w.handle.clone(),
            carried: Some(Carried {
                session: conv.parked.take(),
                same_worker: true,
                from: id,
            }),
            resume_crashes: self.resume_crashes.get(conversation).copied().unwrap_or(0),
            armed: true,
            opened: None,
            maybe_attached: None,
            resume_crashed: false,
            pool: self.myself.clone(),
        })
    }

    /// The live, non-draining worker of `key` with the fewest conversations and room for one more.
    fn least_loaded(&self, key: &PoolKey) -> Option<WorkerId> {
        let ks = self.keys.get(key)?;
        let views = ks
            .workers
            .iter()
            .filter_map(|id| self.workers.get(id).map(|w| w.view(*id)));
        least_loaded(views, self.config.max_sessions_per_process)
    }

    /// Starts a worker for `key` if the caps allow (evicting the least recently used idle
    /// worker when the pool is full). Returns false when no new process may come for this
    /// key (its caps are reached and no idle worker can make room).
    fn grow(&mut self, key: &PoolKey, myself: &ActorRef<PoolMsg>) -> bool {
        let now = Instant::now();
        let Some(ks) = self.keys.get(key) else {
            return false;
        };
        if ks.spawning || ks.backoff_until.is_some_and(|t| now < t) {
            return true;
        }
        if ks.workers.len() >= self.config.max_processes_per_key {
            return false;
        }
        let spawning = self.keys.values().filter(|k| k.spawning).count();
        if self.workers.len() + spawning >= self.config.max_processes {
            let victim = idle_victim(
                self.workers
                    .iter()
                    .filter(|(_, w)| w.key != *key)
                    .map(|(id, w)| w.view(*id)),
            );
            match victim {
                Some(id) => self.evict(id, Eviction::Full),
                None => return false,
            }
        }
        if let Some(ks) = self.keys.get_mut(key) {
            start_spawn(key, ks, myself);
        }
        true
    }

    /// Detaches the least recently used parked conversation of a live worker of `key` and
    /// returns that worker (now with room for one more).
    fn detach_lru_parked_of_key(&mut self, key: &PoolKey) -> Option<WorkerId> {
        let of_key = self.conversations.iter().filter(|(_, c)| {
            self.workers
                .get(&c.worker)
                .is_some_and(|w| w.key == *key && !w.draining)
        });
        let conversation = lru_parked(of_key.map(|(k, c)| c.view(k)))?.to_owned();
        let conv = self.conversations.remove(&conversation)?;
        if let Some(w) = self.workers.get_mut(&conv.worker) {
            w.attached.remove(&conversation);
        }
        // Its binding stays for a resume, which waits for this detach.
        if let Some(session) = conv.parked {
            self.detach_in_background(conversation, session, conv.worker);
        }
        Some(conv.worker)
    }

    /// Detaches the least recently used parked conversation to make room.
    fn detach_lru_parked(&mut self) -> bool {
        let victim = lru_parked(self.conversations.iter().map(|(k, c)| c.view(k)));
        let Some(conversation) = victim.map(str::to_owned) else {
            return false;
        };
        if let Some(conv) = self.conversations.remove(&conversation) {
            if let Some(w) = self.workers.get_mut(&conv.worker) {
                w.attached.remove(&conversation);
            }
            if let Some(session) = conv.parked {
                self.detach_in_background(conversation, session, conv.worker);
            }
        }
        true
    }

    /// A key of the same account with another credential version is in use: the other
    /// versions' workers drain (rotation).
    fn drain_other_versions(&mut self, key: &PoolKey) {
        let family = key.family();
        let deadline = crate::deadline::from_std(Instant::now(), self.config.drain_grace);
        let mut drained = Vec::new();
        for (id, w) in &mut self.workers {
            if !w.draining && w.key != *key && w.key.family() == family {
                w.draining = true;
                w.drain_deadline = Some(deadline);
                drained.push(*id);
            }
        }
        for id in drained {
            tracing::info!(key = %key.short_hash(), "Credentials rotated; draining the old worker.");
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

    fn on_return(
        &mut self,
        conversation: String,
        worker_id: WorkerId,
        session: Option<Session>,
        settle: Settle,
        turns: u64,
    ) {
        let now = Instant::now();
        let limits = self.upkeep_limits();
        let mut keep = false;
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
            if let Some(why) = recycle(&w.upkeep_view(), &limits) {
                tracing::info!(
                    turns = w.turns,
                    rss = w.rss_bytes,
                    ?why,
                    "Recycling a worker."
                );
                w.draining = true;
                w.drain_deadline = Some(crate::deadline::from_std(now, self.config.drain_grace));
            }
            keep = settle == Settle::Park
                && !w.draining
                && session.as_ref().is_some_and(|s| s.is_alive());
        }
        // A worker that died under the turn is a crash (its supervision event says so),
        // not something to stop.
        let alive = self
            .workers
            .get(&worker_id)
            .is_some_and(|w| w.handle.exit().is_none());
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
            self.publish_leased();
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
                }
                // Its binding stays for a resume, which waits for this detach.
                if let Some(session) = session.filter(|s| s.is_alive()) {
                    self.detach_in_background(conversation, session, worker_id);
                }
            }
            _ => {
                if let Some(session) = session.filter(|s| s.is_alive()) {
                    self.detach_in_background(conversation, session, worker_id);
                }
            }
        }
        self.maybe_finish_drain(worker_id);
        self.publish_leased();
    }

    fn on_spawned(
        &mut self,
        key: PoolKey,
        result: Result<WorkerHandle, WorkerError>,
        myself: &ActorRef<PoolMsg>,
    ) {
        let Some(ks) = self.keys.get_mut(&key) else {
            return;
        };
        ks.spawning = false;
        // A worker that died before this message arrived is a crash, not a worker.
        let result = match result {
            Ok(handle) => match handle.exit() {
                Some(exit) => Err(WorkerError::Died(exit)),
                None => Ok(handle),
            },
            Err(e) => Err(e),
        };
        match result {
            Ok(handle) if !self.closed => {
                ks.last_start_error = None;
                let id = self.next_worker_id;
                self.next_worker_id += 1;
                ks.workers.push(id);
                let restart = std::mem::take(&mut ks.respawn);
                if restart {
                    self.totals.restarts += 1;
                }
                let _ = self.events.send(PoolEvent::WorkerStarted {
                    key_hash: key.short_hash(),
                    pid: handle.pid(),
                    restart,
                });
                self.totals.processes_spawned += 1;
                tracing::debug!(key = %key.short_hash(), pid = handle.pid(), "Pool worker started.");
                self.workers.insert(
                    id,
                    WorkerEntry {
                        key,
                        handle,
                        draining: false,
                        drain_deadline: None,
                        attached: HashSet::new(),
                        leased: 0,
                        turns: 0,
                        last_used: Instant::now(),
                        rss_bytes: 0,
                    },
                );
            }
            Ok(handle) => {
                metrics::process_exited(ProcessExit::Shutdown);
                self.stopping.push(tokio::spawn(async move {
                    handle.shutdown().await;
                }));
            }
            Err(error @ WorkerError::ResourceExhausted(_)) => {
                // The machine, not the runtime: no crash, no backoff, no quarantine. The
                // waiters hear why at once; the next lease tries again.
                tracing::warn!(key = %key.short_hash(), %error, "Pool worker could not start: out of resources.");
                let failed = PoolError::Worker(error);
                self.fail_waiters_of(&key, |_| failed.clone());
            }
            Err(error) => {
                // Not cached: the next lease tries again (after the backoff).
                tracing::warn!(key = %key.short_hash(), %error, "Pool worker failed to start.");
                ks.respawn = false;
                ks.last_start_error = Some(error.clone());
                let decision = ks
                    .restart
                    .record_crash(Instant::now(), &self.config.restart);
                match decision {
                    RestartDecision::Restart { after } => {
                        // A retry is scheduled: the waiters stay queued for it (each still
                        // bounded by its own wait timeout).
                        ks.backoff_until = Some(Instant::now() + after);
                        myself.send_after(after, {
                            let key = key.clone();
                            move || PoolMsg::Respawn(key)
                        });
                    }
                    RestartDecision::Quarantine { until } => {
                        metrics::quarantined();
                        let hash = key.short_hash();
                        let _ = self.events.send(PoolEvent::KeyQuarantined {
                            key_hash: hash.clone(),
                        });
                        self.fail_waiters_of(&key, |now| PoolError::RestartIntensityExceeded {
                            key_hash: hash.clone(),
                            retry_after: until.saturating_duration_since(now),
                        });
                    }
                }
            }
        }
    }

    fn on_crash(&mut self, id: WorkerId, myself: &ActorRef<PoolMsg>) {
        let Some(w) = self.workers.get(&id) else {
            return;
        };
        let key = w.key.clone();
        // A draining worker was on its way out: it is not replaced.
        let had_conversations = !w.attached.is_empty() && !w.draining;
        self.emit(PoolEvent::WorkerCrashed {
            key_hash: key.short_hash(),
            pid: w.handle.pid(),
        });
        self.remove_worker(id);
        metrics::process_exited(ProcessExit::Crash);
        self.totals.crashes += 1;
        let demand = had_conversations || self.waiters.iter().any(|w| w.req.key == key);
        let Some(ks) = self.keys.get_mut(&key) else {
            return;
        };
        match ks
            .restart
            .record_crash(Instant::now(), &self.config.restart)
        {
            RestartDecision::Restart { after } => {
                if demand && !self.closed {
                    tracing::info!(key = %key.short_hash(), ?after, "Restarting a crashed worker.");
                    // Whichever spawn comes next for this key (the scheduled respawn, or a
                    // lease arriving after the backoff) replaces the crashed worker.
                    ks.respawn = true;
                    ks.backoff_until = Some(Instant::now() + after);
                    myself.send_after(after, {
                        let key = key.clone();
                        move || PoolMsg::Respawn(key)
                    });
                }
            }
            RestartDecision::Quarantine { until } => {
                tracing::warn!(key = %key.short_hash(), "Restart intensity exceeded; key quarantined.");
                metrics::quarantined();
                let _ = self.events.send(PoolEvent::KeyQuarantined {
                    key_hash: key.short_hash(),
                });
                let hash = key.short_hash();
                self.fail_waiters_of(&key, |now| PoolError::RestartIntensityExceeded {
                    key_hash: hash.clone(),
                    retry_after: until.saturating_duration_since(now),
                });
            }
        }
    }

    fn fail_waiters_of(&mut self, key: &PoolKey, error: impl Fn(Instant) -> PoolError) {
        let now = Instant::now();
        let (fail, keep): (VecDeque<_>, VecDeque<_>) =
            self.waiters.drain(..).partition(|w| w.req.key == *key);
        self.waiters = keep;
        for w in fail {
            let _ = w.reply.send(Err(error(now)));
        }
    }

    /// Forgets a worker: its parked conversations are dropped (their bindings stay), leased
    /// ones are dropped when their lease returns. Returns the handle for stopping it.
    fn remove_worker(&mut self, id: WorkerId) -> Option<WorkerHandle> {
        let w = self.workers.remove(&id)?;
        if let Some(ks) = self.keys.get_mut(&w.key) {
            ks.workers.retain(|x| *x != id);
        }
        for conversation in &w.attached {
            if self
                .conversations
                .get(conversation)
                .is_some_and(|c| c.worker == id && !c.leased)
            {
                self.conversations.remove(conversation);
            }
        }
        self.publish_leased();
        Some(w.handle)
    }

    fn emit(&self, event: PoolEvent) {
        // Nobody listening is fine.
        let _ = self.events.send(event);
    }

    fn evict(&mut self, id: WorkerId, reason: Eviction) {
        let why = reason.describe();
        let key_hash = self.workers.get(&id).map(|w| w.key.short_hash());
        // Its conversations resume elsewhere only once the worker (which detaches them on
        // its way out) has stopped.
        let attached: Vec<String> = self
            .workers
            .get(&id)
            .map(|w| w.attached.iter().cloned().collect())
            .unwrap_or_default();
        for key in &attached {
            *self.detaching.entry(key.clone()).or_default() += 1;
        }
        if let Some(handle) = self.remove_worker(id) {
            self.emit(PoolEvent::WorkerEvicted {
                key_hash: key_hash.unwrap_or_default(),
                pid: handle.pid(),
                reason,
            });
            tracing::info!(pid = handle.pid(), why, "Evicting a pool worker.");
            self.totals.evicted += 1;
            metrics::evicted(reason);
            let target = self.myself.clone();
            self.stopping.retain(|t| !t.is_finished());
            self.stopping.push(tokio::spawn(async move {
                handle.shutdown().await;
                let _ = target.cast(PoolMsg::Detached {
                    conversations_detached: attached,
                    worker_id: id,
                    ok: true,
                });
            }));
        } else {
            for key in &attached {
                self.detaching.remove(key);
            }
        }
    }

    /// Reads every worker's resident memory off the actor (a blocking thread reads `/proc`);
    /// the answer comes back as `Measured`.
    fn measure(&self) {
        let pids: Vec<(WorkerId, u32)> = self
            .workers
            .iter()
            .map(|(id, w)| (*id, w.handle.pid()))
            .collect();
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

    /// Records measured memory; a worker above `max_rss_bytes` starts draining.
    fn on_measured(&mut self, measured: Vec<(WorkerId, u64)>) {
        let now = Instant::now();
        let limits = self.upkeep_limits();
        for (id, rss) in measured {
            let Some(w) = self.workers.get_mut(&id) else {
                continue;
            };
            w.rss_bytes = rss;
            if recycle(&w.upkeep_view(), &limits) == Some(Recycle::Memory) {
                tracing::info!(rss = w.rss_bytes, "Recycling a worker above max_rss_bytes.");
                w.draining = true;
                w.drain_deadline = Some(crate::deadline::from_std(now, self.config.drain_grace));
            }
        }
    }

    /// Idle TTL and drain deadlines.
    fn maintain(&mut self) {
        let now = Instant::now();
        let limits = self.upkeep_limits();
        let mut evict = Vec::new();
        for (id, w) in &self.workers {
            if let Some(reason) = evict_now(now, &w.upkeep_view(), &limits) {
                evict.push((*id, reason));
            }
        }
        for (id, reason) in evict {
            self.evict(id, reason);
        }
        // Forget keys with nothing left (their spec holds the old token of a rotation).
        let waiting: HashSet<PoolKey> = self.waiters.iter().map(|w| w.req.key.clone()).collect();
        self.keys.retain(|key, ks| {
            !ks.workers.is_empty()
                || ks.spawning
                || ks.backoff_until.is_some()
                || ks.restart.quarantined_until(now).is_some()
                || ks.restart.restarts_in_window(now, &self.config.restart) > 0
                || waiting.contains(key)
        });
        self.stopping.retain(|t| !t.is_finished());
    }

    fn status(&self) -> PoolStatus {
        let now = Instant::now();
        let mut workers: Vec<WorkerStatus> = self
            .workers
            .values()
            .map(|w| WorkerStatus {
                key_hash: w.key.short_hash(),
                pid: w.handle.pid(),
                state: if w.draining {
                    WorkerState::Draining
                } else {
                    WorkerState::Live
                },
                sessions: w.attached.len(),
                leases: w.leased,
                turns: w.turns,
                restarts: self
                    .keys
                    .get(&w.key)
                    .map(|k| k.restart.total_restarts())
                    .unwrap_or(0),
                rss_bytes: w.rss_bytes,
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
        }
    }
}
