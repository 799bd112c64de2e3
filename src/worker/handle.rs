//! The caller's handle to a running worker: starting it, calling the runtime, opening
//! sessions, stopping it.
//!
//! Requests go straight onto the worker's JSON-RPC connection; only session routing and the
//! ledger of pending requests go through the actor. When the connection fails because the
//! child died, the error is replaced by the worker's exit (status, signal, stderr tail).

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use ractor::{Actor, ActorCell, ActorRef};
use tokio::sync::{oneshot, watch};

use crate::ids::CliSessionId;
use crate::process::ExitInfo;
use crate::rpc::messages::{
    HandlePendingPermission, HandlePendingToolCall, Method, Ping, PingParams, SessionConfig,
    SessionCreate, SessionDetach, SessionIdParams, SessionOpened, SessionResume,
};
use crate::rpc::{Connection, RpcError};

use super::actor::{StartArgs, Worker, WorkerMsg};
use super::config::WorkerConfig;
use super::error::{WorkerError, WorkerExit};
use super::session::Session;

/// How long a failed request waits for the worker to report the child's exit, so the error
/// can carry the exit status instead of a bare "connection closed".
const EXIT_REPORT_WAIT: Duration = Duration::from_millis(500);

/// Timeout of the actor's own bookkeeping calls (it never blocks on the runtime).
const ACTOR_CALL_TIMEOUT: Duration = Duration::from_secs(10);

/// Slack on top of detach + kill grace before a stopping actor is killed outright.
const STOP_MARGIN: Duration = Duration::from_secs(2);
/// How long [`WorkerHandle::shutdown`] waits, after the actor is gone, for the child to be
/// reaped (it was SIGKILLed at the latest when the actor's state dropped).
pub(super) const REAP_WAIT: Duration = Duration::from_secs(5);

/// Which kind of pending runtime request an answer is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PendingKind {
    /// `external_tool.requested` → `handlePendingToolCall`.
    ToolCall,
    /// `permission.requested` → `handlePendingPermissionRequest`.
    Permission,
}

impl PendingKind {
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            PendingKind::ToolCall => "tool call",
            PendingKind::Permission => "permission",
        }
    }
}

/// Facts about the child, known once the handshake succeeded.
#[derive(Debug, Clone)]
pub struct WorkerInfo {
    /// The child's pid (and process group id).
    pub pid: u32,
    /// The runtime's version (`connect` result).
    pub runtime_version: String,
    /// The protocol version it speaks.
    pub protocol_version: u32,
}

/// What an open that did not complete leaves behind.
#[derive(Clone, Copy)]
enum FailedOpen {
    /// Detach the session in the background (best effort): for direct users of the worker.
    DetachInBackground,
    /// Only close the route: the caller detaches with confirmation (the pool).
    LeaveToCaller,
}

/// Closes a session's route if its open did not complete (an error, or the opening future
/// was dropped), so no stale route refuses the next open of that id.
struct RouteGuard<'a> {
    worker: &'a WorkerHandle,
    session_id: &'a str,
    generation: u64,
    detach: bool,
    armed: bool,
}

impl Drop for RouteGuard<'_> {
    fn drop(&mut self) {
        if self.armed {
            self.worker
                .close_route(self.session_id, Some(self.generation), self.detach);
        }
    }
}

/// Stops the worker when the last handle (including those inside sessions) is dropped.
struct StopOnDrop(ActorRef<WorkerMsg>);

impl Drop for StopOnDrop {
    fn drop(&mut self) {
        // An orderly stop: the actor detaches, closes the child's input and kills the group.
        self.0.stop(Some("all handles dropped".to_owned()));
    }
}

/// A cloneable handle to one worker (one CLI child). When the last clone is dropped (sessions
/// hold one), the worker stops and its process group is killed.
#[derive(Clone)]
pub struct WorkerHandle {
    actor: ActorRef<WorkerMsg>,
    _stop_on_drop: Arc<StopOnDrop>,
    conn: Connection,
    exit: watch::Receiver<Option<WorkerExit>>,
    /// Set once the child's leader has been reaped: the process is gone.
    reaped: watch::Receiver<Option<ExitInfo>>,
    info: Arc<WorkerInfo>,
    request_timeout: Duration,
    /// Upper bound of an orderly stop: detach, then TERM, grace, KILL.
    stop_limit: Duration,
}

impl fmt::Debug for WorkerHandle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("WorkerHandle")
            .field("pid", &self.info.pid)
            .field("runtime_version", &self.info.runtime_version)
            .finish()
    }
}

impl WorkerHandle {
    /// Spawns the child, performs the `connect` handshake and starts supervising it. How it
    /// ends is [`WorkerHandle::ended`]; a session sees [`super::SessionUpdate::Ended`].
    pub async fn start(config: WorkerConfig) -> Result<WorkerHandle, WorkerError> {
        Self::start_with(config, None).await
    }

    /// [`WorkerHandle::start`], linked to a ractor `supervisor` that receives the worker's
    /// end as a supervision event: `ActorFailed` with a [`WorkerExit`] error on a crash, hang
    /// or protocol violation, `ActorTerminated` after [`WorkerHandle::shutdown`]. The pool's
    /// own plumbing (and its tests): ractor types stay out of the documented surface.
    #[doc(hidden)]
    pub async fn start_supervised(
        config: WorkerConfig,
        supervisor: ActorCell,
    ) -> Result<WorkerHandle, WorkerError> {
        Self::start_with(config, Some(supervisor)).await
    }

    async fn start_with(
        config: WorkerConfig,
        supervisor: Option<ActorCell>,
    ) -> Result<WorkerHandle, WorkerError> {
        let (exit_tx, exit_rx) = watch::channel(None);
        let (ready_tx, ready_rx) = oneshot::channel();
        let request_timeout = config.request_timeout;
        let stop_limit = super::actor::DETACH_TIMEOUT + config.kill_grace + STOP_MARGIN;
        let args = StartArgs {
            config,
            exit: exit_tx,
            ready: ready_tx,
        };
        let spawned = match supervisor {
            Some(sup) => Actor::spawn_linked(None, Worker, args, sup).await,
            None => Actor::spawn(None, Worker, args).await,
        };
        let actor = match spawned {
            Ok((actor, _join)) => actor,
            Err(ractor::SpawnErr::StartupFailed(err)) => {
                return Err(match err.downcast::<WorkerError>() {
                    Ok(e) => *e,
                    Err(other) => WorkerError::Spawn(other.to_string()),
                });
            }
            Err(other) => return Err(WorkerError::Spawn(other.to_string())),
        };
        let (conn, info, reaped) = ready_rx
            .await
            .map_err(|_| WorkerError::Spawn("worker ended during start".into()))?;
        Ok(WorkerHandle {
            _stop_on_drop: Arc::new(StopOnDrop(actor.clone())),
            actor,
            conn,
            exit: exit_rx,
            reaped,
            info: Arc::new(info),
            request_timeout,
            stop_limit,
        })
    }

    /// The child's pid (also its process group id).
    pub fn pid(&self) -> u32 {
        self.info.pid
    }

    /// Facts about the child.
    pub fn info(&self) -> &WorkerInfo {
        &self.info
    }

    /// The default timeout of requests to the runtime.
    pub fn request_timeout(&self) -> Duration {
        self.request_timeout
    }

    /// Requests to the runtime still waiting for an answer.
    pub fn pending_requests(&self) -> usize {
        self.conn.pending_requests()
    }

    /// Leaves the event types `unread` names of session `session_id` unread while the guard
    /// lives (those the pool does not read either are dropped as they are read).
    pub(crate) fn leave_unread(
        &self,
        session_id: &str,
        unread: crate::rpc::UnreadEvents,
    ) -> crate::rpc::gate::UnreadGuard {
        self.conn.leave_unread(session_id, unread)
    }

    /// The actor, e.g. to link or monitor it (ractor plumbing, out of the documented
    /// surface).
    #[doc(hidden)]
    pub fn actor(&self) -> ActorCell {
        self.actor.get_cell()
    }

    /// Whether the child's leader has been reaped: the process is gone.
    pub(crate) fn is_reaped(&self) -> bool {
        self.reaped.borrow().is_some()
    }

    /// Waits until the child's leader has been reaped (the process, which may hold its
    /// sessions' locks, is gone), at most [`REAP_WAIT`]: the leader has its SIGKILL by then on
    /// every path that ends the actor, so a longer wait is a kernel's (logged).
    pub(crate) async fn reaped(&self) {
        let mut reaped = self.reaped.clone();
        if tokio::time::timeout(REAP_WAIT, reaped.wait_for(|r| r.is_some()))
            .await
            .is_err()
        {
            tracing::warn!(
                pid = self.info.pid,
                "Copilot worker's process was not reaped within {REAP_WAIT:?} of its stop."
            );
        }
    }

    /// How the worker ended, waiting at most [`EXIT_REPORT_WAIT`] for the report (written
    /// once the process is gone, on every path: `die`, or a killed actor's state).
    pub(crate) async fn reported(&self) -> Option<WorkerExit> {
        tokio::time::timeout(EXIT_REPORT_WAIT, self.ended())
            .await
            .ok()
    }

    /// How the worker ended, once it has.
    pub fn exit(&self) -> Option<WorkerExit> {
        self.exit.borrow().clone()
    }

    /// Waits until the worker has stopped serving (crashed, killed, or begun an orderly
    /// stop) and returns why. [`WorkerHandle::shutdown`] additionally waits for the process.
    pub async fn ended(&self) -> WorkerExit {
        let mut rx = self.exit.clone();
        let ended = rx.wait_for(|e| e.is_some()).await.map(|e| e.clone());
        match ended {
            Ok(Some(exit)) => exit,
            // The sender is gone without a report (cannot happen: the state reports on drop).
            _ => self.killed(),
        }
    }

    /// The report for an end the worker could not describe itself.
    fn killed(&self) -> WorkerExit {
        WorkerExit {
            reason: super::error::ExitReason::Killed,
            pid: self.info.pid,
            stderr_tail: String::new(),
        }
    }

    /// Sends a typed request to the runtime with the worker's request timeout.
    pub async fn call<M: Method>(&self, params: &M::Params) -> Result<M::Result, WorkerError> {
        self.call_with_timeout::<M>(params, self.request_timeout)
            .await
    }

    /// Sends a typed request with an explicit timeout. Answers to pending tool calls and
    /// permission prompts are refused here: they go through [`Session::answer_tool_call`] and
    /// [`Session::answer_permission`], which check that the request belongs to the session.
    pub async fn call_with_timeout<M: Method>(
        &self,
        params: &M::Params,
        timeout: Duration,
    ) -> Result<M::Result, WorkerError> {
        if M::NAME == HandlePendingToolCall::NAME || M::NAME == HandlePendingPermission::NAME {
            return Err(WorkerError::Config(format!(
                "{} must go through Session::answer_tool_call or Session::answer_permission, \
                 which check that the request belongs to that session",
                M::NAME
            )));
        }
        self.call_unchecked::<M>(params, timeout).await
    }

    /// Sends any typed request (no ledger check).
    pub(crate) async fn call_unchecked<M: Method>(
        &self,
        params: &M::Params,
        timeout: Duration,
    ) -> Result<M::Result, WorkerError> {
        let started = std::time::Instant::now();
        let result = self
            .conn
            .call_with_timeout::<M>(params, Some(timeout))
            .await;
        crate::metrics::rpc_finished(M::NAME, started.elapsed());
        match result {
            Ok(result) => Ok(result),
            Err(err @ RpcError::Closed { .. }) => Err(self.explain_closed(err).await),
            Err(err) => Err(WorkerError::Rpc(err)),
        }
    }

    /// Sends a request with raw params and returns the raw result (a client's call passed on
    /// as it is). The answers to pending tool calls and permission prompts are refused here,
    /// like in [`WorkerHandle::call_with_timeout`]: they go through the ledger.
    #[cfg(feature = "sdk-endpoint")]
    pub(crate) async fn call_raw(
        &self,
        method: &str,
        params: serde_json::Value,
        timeout: Duration,
    ) -> Result<serde_json::Value, WorkerError> {
        if method == HandlePendingToolCall::NAME || method == HandlePendingPermission::NAME {
            return Err(WorkerError::Config(format!(
                "{method} must go through Session::answer_tool_call or \
                 Session::answer_permission, which check that the request belongs to that session"
            )));
        }
        let started = std::time::Instant::now();
        let result = self.conn.request(method, params, Some(timeout)).await;
        crate::metrics::rpc_finished(method, started.elapsed());
        match result {
            Ok(result) => Ok(result),
            Err(err @ RpcError::Closed { .. }) => Err(self.explain_closed(err).await),
            Err(err) => Err(WorkerError::Rpc(err)),
        }
    }

    /// Pings the runtime.
    pub async fn ping(&self) -> Result<(), WorkerError> {
        self.call::<Ping>(&PingParams::default()).await.map(|_| ())
    }

    /// Creates a new session. A missing `session_id` in `config` gets a fresh UUID.
    pub async fn create_session(&self, mut config: SessionConfig) -> Result<Session, WorkerError> {
        if config.session_id.is_empty() {
            config.session_id = CliSessionId::random().into_string();
        }
        self.open::<SessionCreate>(config, FailedOpen::DetachInBackground)
            .await
            .map(|(s, _)| s)
    }

    /// Resumes a stored session in this process. The provider must be given again.
    pub async fn resume_session(
        &self,
        config: SessionConfig,
    ) -> Result<(Session, SessionOpened), WorkerError> {
        self.open::<SessionResume>(config, FailedOpen::DetachInBackground)
            .await
    }

    /// Opens (`resume`) or creates a session for the pool. On failure the route is closed
    /// but nothing is detached: the runtime may still hold the session (after a timeout),
    /// and the pool detaches it with confirmation or stops this worker.
    pub(crate) async fn open_for_pool(
        &self,
        config: SessionConfig,
        resume: bool,
    ) -> Result<(Session, SessionOpened), WorkerError> {
        if resume {
            self.open::<SessionResume>(config, FailedOpen::LeaveToCaller)
                .await
        } else {
            self.open::<SessionCreate>(config, FailedOpen::LeaveToCaller)
                .await
        }
    }

    /// Detaches a session by id and waits for the runtime's answer (its state stays on
    /// disk). Used when no [`Session`] exists for it, e.g. after an open that timed out.
    pub async fn detach_session(&self, session_id: &CliSessionId) -> Result<(), WorkerError> {
        self.close_route(session_id.as_str(), None, false);
        let params = SessionIdParams {
            session_id: session_id.to_string(),
        };
        self.call::<SessionDetach>(&params).await.map(|_| ())
    }

    async fn open<M>(
        &self,
        config: SessionConfig,
        failed: FailedOpen,
    ) -> Result<(Session, SessionOpened), WorkerError>
    where
        M: Method<Params = SessionConfig, Result = SessionOpened>,
    {
        let id = config.session_id.clone();
        // The route exists before the request is sent, so no event of the session is lost.
        let route = self
            .ask(|reply| WorkerMsg::OpenRoute {
                session_id: id.clone(),
                reply,
            })
            .await??;
        let (updates, unread) = (route.updates, route.unread);
        let generation = route.generation;
        // From here, a dropped future (or a failed request) closes the route; the runtime may
        // have opened the session anyway, so it is detached unless the caller takes that on.
        let mut guard = RouteGuard {
            worker: self,
            session_id: &id,
            generation,
            detach: true,
            armed: true,
        };
        if let Some(mut detached) = route.pending_detach {
            // A dropped session of this id is still being detached in the background: an
            // open sent now could be undone by that detach.
            let _ = tokio::time::timeout(
                super::actor::DETACH_TIMEOUT + STOP_MARGIN,
                detached.wait_for(|done| *done),
            )
            .await;
        }
        match self.call::<M>(&config).await {
            Ok(opened) => {
                // Events the runtime sent before its answer are routed once the actor has
                // handled everything queued before this call.
                self.flush().await?;
                guard.armed = false;
                let mut session = Session::new(
                    CliSessionId::new(id.clone()),
                    generation,
                    self.clone(),
                    updates,
                    unread,
                );
                session.set_opened(&opened);
                Ok((session, opened))
            }
            Err(err) => {
                guard.detach = matches!(failed, FailedOpen::DetachInBackground);
                Err(err)
            }
        }
    }

    /// Asks the actor to check and remove a pending request of `session_id`.
    pub(crate) async fn take_pending(
        &self,
        kind: PendingKind,
        session_id: &str,
        request_id: &str,
    ) -> Result<(), WorkerError> {
        self.ask(|reply| WorkerMsg::TakePending {
            kind,
            session_id: session_id.to_owned(),
            request_id: request_id.to_owned(),
            reply,
        })
        .await?
    }

    /// Puts back a pending request whose answer could not be delivered, so it can be
    /// answered again.
    pub(crate) fn restore_pending(&self, kind: PendingKind, session_id: &str, request_id: &str) {
        let _ = self.actor.cast(WorkerMsg::RestorePending {
            kind,
            session_id: session_id.to_owned(),
            request_id: request_id.to_owned(),
        });
    }

    /// Stops routing a session's updates; with `detach`, also detaches it in the runtime.
    /// With a `generation`, only while the route is still that open's.
    pub(crate) fn close_route(&self, session_id: &str, generation: Option<u64>, detach: bool) {
        let _ = self.actor.cast(WorkerMsg::CloseRoute {
            session_id: session_id.to_owned(),
            generation,
            detach,
        });
    }

    /// Stops the worker: detaches its sessions, closes the child's input, and kills the
    /// group after the grace period if it has not exited. Returns once the actor is gone.
    /// Bounded: an actor still busy after detach + grace + a margin is killed, and dropping
    /// its state SIGKILLs the group.
    pub async fn shutdown(&self) -> WorkerExit {
        self.actor.stop(Some("shutdown".to_owned()));
        if self.actor.wait(Some(self.stop_limit)).await.is_err() {
            tracing::warn!(
                pid = self.info.pid,
                "Copilot worker did not stop in time; killing it."
            );
            self.actor.kill();
            let _ = self.actor.wait(Some(STOP_MARGIN)).await;
        }
        // A killed actor's state SIGKILLs the group without waiting: the process (which may
        // hold its sessions' locks) is gone only once it is reaped, and a caller moving its
        // conversations elsewhere must not go on before that.
        self.reaped().await;
        self.reported().await.unwrap_or_else(|| self.killed())
    }

    /// Returns once the actor has routed everything the runtime sent before this call
    /// (what an answer just read was preceded by is then in its sessions' streams).
    pub(crate) async fn flush(&self) -> Result<(), WorkerError> {
        self.ask(WorkerMsg::Flush).await
    }

    async fn ask<T>(
        &self,
        msg: impl FnOnce(ractor::RpcReplyPort<T>) -> WorkerMsg,
    ) -> Result<T, WorkerError>
    where
        T: Send + 'static,
    {
        match self.actor.call(msg, Some(ACTOR_CALL_TIMEOUT)).await {
            Ok(ractor::rpc::CallResult::Success(value)) => Ok(value),
            _ => Err(self.gone().await),
        }
    }

    /// The error for "the actor or the connection is gone".
    async fn gone(&self) -> WorkerError {
        match self.reported().await {
            Some(exit) if exit.is_shutdown() => WorkerError::Stopped,
            Some(exit) => WorkerError::Died(exit),
            None => WorkerError::Stopped,
        }
    }

    async fn explain_closed(&self, err: RpcError) -> WorkerError {
        match self.reported().await {
            Some(exit) if exit.is_shutdown() => WorkerError::Stopped,
            Some(exit) => WorkerError::Died(exit),
            None => WorkerError::Rpc(err),
        }
    }
}
