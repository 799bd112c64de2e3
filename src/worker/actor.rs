//! The worker actor's lifecycle: spawn and handshake, health pings, the message loop, and
//! the two ends — `die` (the child is gone: fail everything at once, kill the group, report
//! the exit) and the orderly stop. Dispatching what the child sends lives in `dispatch.rs`.
//! The actor never decides which worker serves a conversation.

use std::collections::hash_map::Entry;
use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use ractor::{Actor, ActorProcessingErr, ActorRef, RpcReplyPort};
use tokio::sync::{mpsc, oneshot, watch};
use tokio::task::JoinHandle;

use crate::process::{ChildGroup, ExitInfo};
use crate::rpc::messages::{
    ClientInfo, Connect, ConnectParams, LlmSetProvider, Method, PROTOCOL_VERSION, Ping, PingParams,
    SessionDetach, SessionIdParams,
};
use crate::rpc::{CloseCause, Connection, ConnectionOptions, Incoming, RpcError, SessionEvent};
use crate::tunnel::frames::TunnelRequests;

use super::config::WorkerConfig;
use super::error::{ExitReason, WorkerError, WorkerExit, stderr_in_message};
use super::handle::{PendingKind, REAP_WAIT, WorkerInfo};
use super::health::HealthMisses;
use super::mailbox::{Admit, MailboxBytes, batch_weight};
use super::session::{LEAST_UNREAD_WEIGHT, Routed, SessionUpdate, Unread};

/// After stdout closes, how long to wait for the child's exit status before reporting the
/// closed pipe without it.
const EXIT_AFTER_EOF_WAIT: Duration = Duration::from_millis(200);
/// How long to wait for the last stderr bytes once the child has exited.
const STDERR_SETTLE_WAIT: Duration = Duration::from_millis(100);
/// Per-session `session.detach` timeout during an orderly stop.
pub(super) const DETACH_TIMEOUT: Duration = Duration::from_secs(2);

/// The worker actor (stateless; its state is [`WorkerState`]).
pub(crate) struct Worker;

/// What the worker is started with.
pub(crate) struct StartArgs {
    pub(crate) config: WorkerConfig,
    pub(crate) exit: watch::Sender<Option<WorkerExit>>,
    /// The connection, what the runtime said of itself, and the child's reap watch.
    pub(crate) ready: oneshot::Sender<(Connection, WorkerInfo, watch::Receiver<Option<ExitInfo>>)>,
}

/// Messages of the worker actor.
pub(crate) enum WorkerMsg {
    /// What the child sent, in order, as the connection's reader read it together, and
    /// what it weighs in the mailbox ([`MailboxBytes`]).
    Incoming(Vec<Incoming>, usize),
    /// The child's leader was reaped.
    ChildExited(ExitInfo),
    /// Time for a health ping.
    HealthTick,
    /// A health ping came back (or did not).
    HealthResult(Result<(), RpcError>),
    /// Register a session's update stream (before `session.create`/`resume` is sent).
    OpenRoute {
        session_id: String,
        reply: RpcReplyPort<Result<OpenedRoute, WorkerError>>,
    },
    /// Stop routing a session; with `detach`, detach it in the runtime too. With a
    /// `generation`, only if the route is still that one (a newer open of the same id is
    /// left alone, and not detached).
    CloseRoute {
        session_id: String,
        generation: Option<u64>,
        detach: bool,
    },
    /// Check that `session_id` has this pending request, and remove it.
    TakePending {
        kind: PendingKind,
        session_id: String,
        request_id: String,
        reply: RpcReplyPort<Result<(), WorkerError>>,
    },
    /// An answer taken with `TakePending` could not be delivered: it is pending again.
    RestorePending {
        kind: PendingKind,
        session_id: String,
        request_id: String,
    },
    /// A tunnelled model request's serving ended.
    TunnelDone(crate::tunnel::frames::ServingEnded),
    /// Answers once everything queued before it has been handled.
    Flush(RpcReplyPort<()>),
}

/// A session's new route, and a background detach of the same id still in flight (the
/// opener waits for it, so that detach cannot undo the new open).
pub(crate) struct OpenedRoute {
    pub(crate) updates: mpsc::UnboundedReceiver<Routed>,
    /// What the route holds unread.
    pub(crate) unread: Unread,
    /// Which open of this id the route belongs to.
    pub(crate) generation: u64,
    pub(crate) pending_detach: Option<watch::Receiver<bool>>,
}

/// Where one session's updates go.
pub(crate) struct Route {
    generation: u64,
    updates: mpsc::UnboundedSender<Routed>,
    unread: Unread,
}

impl Route {
    /// Delivers `update`, counted as `weight` bytes unread (what the runtime sent for it, at
    /// least [`LEAST_UNREAD_WEIGHT`]; nothing for the end) until the session takes it; false
    /// when the session's receiver is gone.
    pub(super) fn send(&self, update: SessionUpdate, weight: usize) -> bool {
        let weight = match update {
            SessionUpdate::Ended(_) => 0,
            _ => weight.max(LEAST_UNREAD_WEIGHT),
        };
        self.unread.add(weight);
        let sent = self.updates.send(Box::new((update, weight))).is_ok();
        if !sent {
            self.unread.take(weight);
        }
        sent
    }

    /// What the route holds unread, in bytes.
    pub(super) fn unread_bytes(&self) -> usize {
        self.unread.bytes()
    }
}

/// Everything the worker owns.
pub(crate) struct WorkerState {
    pub(super) config: WorkerConfig,
    /// The child; dropping it kills the group.
    pub(super) child: ChildGroup,
    pub(super) conn: Connection,
    /// Session id → its update stream.
    pub(super) routes: HashMap<String, Route>,
    /// The generation of the next route (never reused).
    next_generation: u64,
    /// (kind, session id, request id) of tool calls and permission prompts awaiting an answer.
    pub(super) pending: HashSet<(PendingKind, String, String)>,
    /// Background detaches of dropped sessions, by id: `true` once answered.
    detaches: HashMap<String, watch::Receiver<bool>>,
    pub(super) tunnel: TunnelRequests,
    ping_in_flight: bool,
    /// Health pings missed in a row.
    health: HealthMisses,
    /// Set when a route holds more unread than `max_unread_route_bytes`: why the runtime is
    /// killed once the batch being handled is done.
    pub(super) flooded: Option<String>,
    /// The bytes the reader handed on and the actor has not handled yet.
    mailbox: Arc<MailboxBytes>,
    exit: watch::Sender<Option<WorkerExit>>,
    health_timer: Option<JoinHandle<()>>,
    exit_watcher: Option<JoinHandle<()>>,
}

impl Drop for WorkerState {
    fn drop(&mut self) {
        if let Some(t) = self.health_timer.take() {
            t.abort();
        }
        if let Some(t) = self.exit_watcher.take() {
            t.abort();
        }
        self.tunnel.abort_all();
        if self.exit.borrow().is_none() {
            // Killed or panicked: ractor skipped `post_stop`, so report here, once the process
            // is gone, as `die` does (whoever reads `Died` may resume the conversation
            // elsewhere). The group gets its SIGKILL now; the reaper task reaps the leader.
            self.child.signal_group(nix::sys::signal::Signal::SIGKILL);
            let exit = WorkerExit {
                reason: ExitReason::Killed,
                pid: self.child.pid(),
                stderr_tail: self.child.stderr().text(),
            };
            let routes: Vec<Route> = self.routes.drain().map(|(_, route)| route).collect();
            self.pending.clear();
            let publish = {
                let exit_tx = self.exit.clone();
                move || {
                    exit_tx.send_replace(Some(exit.clone()));
                    for route in routes {
                        let _ =
                            route.send(SessionUpdate::Ended(WorkerError::Died(exit.clone())), 0);
                    }
                }
            };
            let mut reaped = self.child.exit_watch();
            match tokio::runtime::Handle::try_current() {
                Ok(runtime) => {
                    runtime.spawn(async move {
                        let _ =
                            tokio::time::timeout(REAP_WAIT, reaped.wait_for(|r| r.is_some())).await;
                        publish();
                    });
                }
                // No runtime to wait on (it is being torn down): report at once.
                Err(_) => publish(),
            }
        }
        // `child` drops after this and kills the group.
    }
}

impl Actor for Worker {
    type Msg = WorkerMsg;
    type State = WorkerState;
    type Arguments = StartArgs;

    async fn pre_start(
        &self,
        myself: ActorRef<WorkerMsg>,
        args: StartArgs,
    ) -> Result<WorkerState, ActorProcessingErr> {
        let StartArgs {
            config,
            exit,
            ready,
        } = args;
        let spec = config.child_spec().map_err(boxed)?;
        let (child, io) = ChildGroup::spawn(&spec).map_err(|e| boxed(e.into()))?;
        if let Some(ledger) = &config.group_ledger {
            ledger.track(&child);
        }
        let sink_target = myself.clone();
        // As much as the runtime's routes may hold unread together (`check_flood`).
        let mailbox = Arc::new(MailboxBytes::new(
            config.max_unread_route_bytes.saturating_mul(4),
        ));
        let counted = mailbox.clone();
        let conn = Connection::start_batched(
            io.stdout,
            io.stdin,
            ConnectionOptions {
                max_frame_bytes: config.max_frame_bytes,
                default_timeout: config.request_timeout,
                // Events are routed by the session they name: read once fewer.
                split_session_events: true,
                // What a frame takes parsed stays within a few times its size: a request's
                // params, a notification's and an event's typed payload are parsed whole.
                max_frame_values: Some(crate::json_values::value_limit(config.max_frame_bytes)),
                ..ConnectionOptions::default()
            },
            Box::new(move |batch| {
                // If the actor is gone (or the batch is dropped), an incoming request's
                // responder is dropped here and answers with an error by itself.
                let weight = batch_weight(&batch);
                let batch = match counted.admit(weight) {
                    Admit::Pass => batch,
                    Admit::FirstOver(waiting) => {
                        let detail = format!(
                            "the runtime wrote faster than its worker could route: {waiting} \
                             bytes were waiting to be routed, past the {} its routes may hold \
                             together (four times max_unread_route_bytes)",
                            counted.max()
                        );
                        let flooded = Incoming::Closed(CloseCause::ProtocolViolation(detail));
                        let _ = sink_target.cast(WorkerMsg::Incoming(vec![flooded], 0));
                        return;
                    }
                    Admit::Drop => return,
                };
                let _ = sink_target.cast(WorkerMsg::Incoming(batch, weight));
            }),
        );
        let info = match handshake(&conn, &config).await {
            Ok(info) => WorkerInfo {
                pid: child.pid(),
                ..info
            },
            Err(err) => {
                // Say why the child failed if it died: exit status and stderr beat
                // "connection closed".
                let err = match tokio::time::timeout(EXIT_AFTER_EOF_WAIT, child.wait()).await {
                    Ok(status) => {
                        child.stderr().settled(STDERR_SETTLE_WAIT).await;
                        let detail = match err {
                            WorkerError::Handshake(detail) => detail,
                            err => err.to_string(),
                        };
                        WorkerError::Handshake(format!(
                            "{detail}; the runtime exited ({status}); stderr: {}",
                            stderr_in_message(&child.stderr().text())
                        ))
                    }
                    Err(_) => still_running(err, &child),
                };
                conn.close(CloseCause::Local);
                child.terminate(config.kill_grace).await;
                return Err(boxed(err));
            }
        };
        tracing::debug!(pid = info.pid, version = %info.runtime_version, "Copilot worker started.");

        let watcher_target = myself.clone();
        let mut exit_rx = child.exit_watch();
        let exit_watcher = tokio::spawn(async move {
            if let Ok(status) = exit_rx.wait_for(|e| e.is_some()).await {
                let status = status.unwrap_or(ExitInfo::Unknown);
                let _ = watcher_target.cast(WorkerMsg::ChildExited(status));
            }
        });
        let _ = ready.send((conn.clone(), info, child.exit_watch()));
        let health = HealthMisses::new(config.health_misses, config.health_timeout);
        Ok(WorkerState {
            config,
            child,
            conn,
            routes: HashMap::new(),
            next_generation: 1,
            pending: HashSet::new(),
            detaches: HashMap::new(),
            tunnel: TunnelRequests::default(),
            ping_in_flight: false,
            health,
            flooded: None,
            mailbox,
            exit,
            health_timer: None,
            exit_watcher: Some(exit_watcher),
        })
    }

    async fn post_start(
        &self,
        myself: ActorRef<WorkerMsg>,
        state: &mut WorkerState,
    ) -> Result<(), ActorProcessingErr> {
        let interval = state.config.health_interval;
        if !interval.is_zero() {
            state.health_timer = Some(myself.send_interval(interval, || WorkerMsg::HealthTick));
        }
        Ok(())
    }

    async fn handle(
        &self,
        myself: ActorRef<WorkerMsg>,
        msg: WorkerMsg,
        state: &mut WorkerState,
    ) -> Result<(), ActorProcessingErr> {
        match msg {
            WorkerMsg::Incoming(batch, weight) => {
                state.mailbox.handled(weight);
                for incoming in batch {
                    match incoming {
                        Incoming::SessionEvent { session_id, event } => {
                            state.on_session_event(session_id, SessionEvent::from_raw(event));
                        }
                        Incoming::Notification { method, params } => {
                            state.on_notification(&method, &params);
                        }
                        Incoming::Request(request) => state.on_request(request, &myself),
                        Incoming::Closed(cause) => {
                            let reason = match cause {
                                CloseCause::ProtocolViolation(detail) => {
                                    ExitReason::ProtocolViolation(detail)
                                }
                                CloseCause::Eof | CloseCause::Io(_) | CloseCause::Local => {
                                    let waited = tokio::time::timeout(
                                        EXIT_AFTER_EOF_WAIT,
                                        state.child.wait(),
                                    );
                                    match waited.await {
                                        Ok(status) => ExitReason::ChildExited(status),
                                        Err(_) => ExitReason::TransportClosed(None),
                                    }
                                }
                            };
                            return Err(state.die(reason).await);
                        }
                    }
                    if let Some(detail) = state.flooded.take() {
                        return Err(state.die(ExitReason::ProtocolViolation(detail)).await);
                    }
                }
            }
            WorkerMsg::ChildExited(status) => {
                return Err(state.die(ExitReason::ChildExited(status)).await);
            }
            WorkerMsg::HealthTick => {
                if !state.ping_in_flight {
                    state.ping_in_flight = true;
                    let conn = state.conn.clone();
                    let timeout = state.config.health_timeout;
                    let target = myself.clone();
                    tokio::spawn(async move {
                        let started = std::time::Instant::now();
                        let result = conn
                            .call_with_timeout::<Ping>(&PingParams::default(), Some(timeout))
                            .await
                            .map(|_| ());
                        crate::metrics::rpc_finished(Ping::NAME, started.elapsed());
                        let _ = target.cast(WorkerMsg::HealthResult(result));
                    });
                }
            }
            WorkerMsg::HealthResult(result) => {
                state.ping_in_flight = false;
                match result {
                    Err(RpcError::Timeout { after, .. }) => {
                        let pid = state.child.pid();
                        match state.health.missed() {
                            Some(hung) => {
                                tracing::warn!(pid, ?after, %hung, "Copilot runtime hung; killing it.");
                                return Err(state.die(hung).await);
                            }
                            None => tracing::info!(
                                pid,
                                ?after,
                                misses = state.health.misses(),
                                "Copilot runtime missed a health ping; it is hung only if it misses the next ones too."
                            ),
                        }
                    }
                    // A closed connection is reported by the reader; any other answer (even
                    // an error) proves the runtime is alive.
                    Ok(()) | Err(_) => state.health.answered(),
                }
            }
            WorkerMsg::OpenRoute { session_id, reply } => {
                state.detaches.retain(|_, done| !*done.borrow());
                let pending_detach = state.detaches.get(&session_id).cloned();
                let generation = state.next_generation;
                state.next_generation += 1;
                let (tx, updates) = mpsc::unbounded_channel();
                let unread = Unread::default();
                let route = Route {
                    generation,
                    updates: tx,
                    unread: unread.clone(),
                };
                let result = match state.routes.entry(session_id) {
                    // A route whose receiver is gone (its opener was cancelled, or its
                    // session dropped) is stale: it is replaced, not refused.
                    Entry::Occupied(mut e) if e.get().updates.is_closed() => {
                        e.insert(route);
                        Ok(())
                    }
                    Entry::Occupied(e) => Err(WorkerError::SessionAlreadyOpen(e.key().clone())),
                    Entry::Vacant(e) => {
                        e.insert(route);
                        Ok(())
                    }
                };
                let result = result.map(|()| OpenedRoute {
                    updates,
                    unread,
                    generation,
                    pending_detach,
                });
                let _ = reply.send(result);
            }
            WorkerMsg::CloseRoute {
                session_id,
                generation,
                detach,
            } => {
                let newer = match (generation, state.routes.get(&session_id)) {
                    (Some(g), Some(route)) => route.generation != g,
                    _ => false,
                };
                if newer {
                    // A later open of this id owns the route (and the session) now.
                    return Ok(());
                }
                state.routes.remove(&session_id);
                state.pending.retain(|(_, sid, _)| *sid != session_id);
                if detach {
                    let conn = state.conn.clone();
                    let (done, done_rx) = watch::channel(false);
                    state.detaches.insert(session_id.clone(), done_rx);
                    tokio::spawn(async move {
                        let params = SessionIdParams { session_id };
                        if let Err(error) = conn
                            .call_with_timeout::<SessionDetach>(&params, Some(DETACH_TIMEOUT))
                            .await
                        {
                            tracing::debug!(%error, "Detach of a dropped session failed.");
                        }
                        done.send_replace(true);
                    });
                }
            }
            WorkerMsg::TakePending {
                kind,
                session_id,
                request_id,
                reply,
            } => {
                let key = (kind, session_id, request_id);
                let result = if state.pending.remove(&key) {
                    Ok(())
                } else {
                    let (kind, session_id, request_id) = key;
                    Err(WorkerError::NoSuchPendingRequest {
                        kind: kind.as_str(),
                        session_id,
                        request_id,
                    })
                };
                let _ = reply.send(result);
            }
            WorkerMsg::RestorePending {
                kind,
                session_id,
                request_id,
            } => {
                if state.routes.contains_key(&session_id) {
                    state.pending.insert((kind, session_id, request_id));
                }
            }
            WorkerMsg::TunnelDone(ended) => state.tunnel.done(&ended),
            WorkerMsg::Flush(reply) => {
                let _ = reply.send(());
            }
        }
        Ok(())
    }

    async fn post_stop(
        &self,
        _myself: ActorRef<WorkerMsg>,
        state: &mut WorkerState,
    ) -> Result<(), ActorProcessingErr> {
        // An orderly stop (a crash never gets here: `die` already cleaned up).
        if state.exit.borrow().is_some() {
            return Ok(());
        }
        // Published first, so requests that fail from here on report a stop, not a crash.
        state.exit.send_replace(Some(WorkerExit {
            reason: ExitReason::Shutdown,
            pid: state.child.pid(),
            stderr_tail: String::new(),
        }));
        let sessions: Vec<String> = state.routes.keys().cloned().collect();
        let detaches = sessions.into_iter().map(|session_id| {
            let conn = state.conn.clone();
            async move {
                let params = SessionIdParams { session_id };
                let _ = conn
                    .call_with_timeout::<SessionDetach>(&params, Some(DETACH_TIMEOUT))
                    .await;
            }
        });
        futures_util::future::join_all(detaches).await;
        state.fail_routes(WorkerError::Stopped);
        state.tunnel.abort_all();
        // End of input and SIGTERM together, one grace period, then SIGKILL to the group.
        state.conn.close(CloseCause::Local);
        let status = state.child.terminate(state.config.kill_grace).await;
        tracing::debug!(pid = state.child.pid(), %status, "Copilot worker stopped.");
        Ok(())
    }
}

fn boxed(err: WorkerError) -> ActorProcessingErr {
    Box::new(err)
}

async fn handshake(conn: &Connection, config: &WorkerConfig) -> Result<WorkerInfo, WorkerError> {
    let params = ConnectParams {
        token: None,
        supported_task_kinds: None,
        client_info: Some(ClientInfo {
            extension_name: Some("copilot-pool".to_owned()),
            extension_version: Some(env!("CARGO_PKG_VERSION").to_owned()),
        }),
    };
    let started = std::time::Instant::now();
    let connected = conn
        .call_with_timeout::<Connect>(&params, Some(config.start_timeout))
        .await;
    crate::metrics::rpc_finished(Connect::NAME, started.elapsed());
    let connected = connected.map_err(|e| handshake_failed("", e, config))?;
    if connected.protocol_version != PROTOCOL_VERSION {
        return Err(WorkerError::ProtocolVersion {
            got: connected.protocol_version,
            supported: PROTOCOL_VERSION,
            runtime_version: connected.version,
        });
    }
    if config.model_tunnel.is_some() {
        let set = conn
            .call_with_timeout::<LlmSetProvider>(&Default::default(), Some(config.start_timeout))
            .await
            .map_err(|e| handshake_failed("llmInference.setProvider: ", e, config))?;
        if !set.success {
            return Err(WorkerError::Handshake(
                "llmInference.setProvider refused by the runtime".to_owned(),
            ));
        }
    }
    Ok(WorkerInfo {
        pid: 0,
        runtime_version: connected.version,
        protocol_version: connected.protocol_version,
    })
}

/// A handshake that failed with the runtime still running, with what it wrote to stderr.
fn still_running(err: WorkerError, child: &ChildGroup) -> WorkerError {
    let stderr = stderr_in_message(&child.stderr().text());
    match err {
        WorkerError::Handshake(detail) if !stderr.is_empty() => {
            WorkerError::Handshake(format!("{detail}; stderr: {stderr}"))
        }
        err => err,
    }
}

/// A handshake call's failure; one that ran out of time says what to do about it.
fn handshake_failed(call: &str, error: RpcError, config: &WorkerConfig) -> WorkerError {
    match error {
        RpcError::Timeout { .. } => WorkerError::Handshake(format!(
            "{call}{error}; the runtime did not finish its handshake within {:?}: on an \
             overloaded machine raise start_timeout, otherwise run `copilot-pool doctor` to \
             check the runtime",
            config.start_timeout
        )),
        error => WorkerError::Handshake(format!("{call}{error}")),
    }
}

impl WorkerState {
    /// The child is gone or unusable: tell everyone at once, then make sure the group is dead.
    async fn die(&mut self, reason: ExitReason) -> ActorProcessingErr {
        // A runtime still alive here (hung, broke the protocol, closed its output) still holds
        // its sessions' locks and could still append to their histories: it is killed at once
        // (no grace: it cannot be trusted to shut down) and reaped first. So `Died`, wherever
        // it is read (the exit below, failed requests, ended sessions), means the process is
        // gone, and no conversation is resumed elsewhere while it exists.
        self.child.terminate(Duration::ZERO).await;
        self.child.stderr().settled(STDERR_SETTLE_WAIT).await;
        let exit = WorkerExit {
            reason,
            pid: self.child.pid(),
            stderr_tail: self.child.stderr().text(),
        };
        tracing::warn!(pid = exit.pid, reason = %exit.reason, "Copilot worker ended.");
        // Publish before closing: callers whose requests fail next read the exit from here.
        self.exit.send_replace(Some(exit.clone()));
        self.conn.close(CloseCause::Local);
        self.fail_routes(WorkerError::Died(exit.clone()));
        self.tunnel.abort_all();
        Box::new(exit)
    }
}
