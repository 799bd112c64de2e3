//! One SDK client connection: the `connect` handshake (the token names the agent), then where
//! each call goes — the endpoint answers `connect`, `ping` and `status.get` itself, opens and
//! closes sessions through the pool, sends a session's calls to the process that holds it,
//! and passes other calls to a process of the connection's own. Calls that would change a
//! process shared with other clients (`runtime.shutdown`, process-wide providers) are
//! refused. When the client goes, its turns are aborted and its sessions let go.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use serde_json::{Value, json};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::sync::{Semaphore, mpsc, watch};

use crate::rpc::connection::{
    CloseCause, Connection, ConnectionOptions, ErrorObject, INTERNAL_ERROR, INVALID_PARAMS,
    Incoming, IncomingRequest, METHOD_NOT_FOUND, PeerLimits,
};

use super::admission::{Seat, Slot};
use super::session::{self, AfterOpen, CallError, SdkSession, SessionSpec, session_not_found};
use super::{PROTOCOL_VERSION, Shared};

/// The runtime's code for a call before `connect`.
pub const AUTHENTICATION_REQUIRED: i64 = -32001;
/// The runtime's code for a wrong connection token.
pub const AUTHENTICATION_FAILED: i64 = -32002;
/// The pool's code for a `connect` of an agent that holds `max_connections_per_agent`
/// connections already (the runtime has no such limit).
pub const TOO_MANY_CONNECTIONS: i64 = -32003;
/// The pool's code for a session its agent may not start: it keeps
/// `max_conversations_per_agent` conversations already (the runtime has no such limit).
pub const CONVERSATION_LIMIT: i64 = -32004;

/// How long one write to a client may wait for it to read before its connection closes (as
/// the HTTP API's event stream waits for a slow reader).
const WRITE_STALL_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(30);

/// Calls refused because they change a process that other clients share.
const PROCESS_WIDE: &[&str] = &[
    "runtime.shutdown",
    "llmInference.setProvider",
    "sessionFs.setProvider",
    "plugins.builtin.set",
];

/// Calls naming no session that a process of the connection's key answers: reads only.
/// Every other such call (`sessions.bulkDelete`, `sessions.open`, `mcp.config.*`,
/// `user.settings.set`, `plugins.*`, `account.login`, …) would change the agent's home or a
/// process that other conversations share, outside the pool: refused.
const BESIDE_SESSIONS: &[&str] = &[
    "session.list",
    "session.getLastId",
    "models.list",
    "models.getBuiltInCatalog",
    "auth.getStatus",
    "account.getQuota",
    "account.getCurrentAuth",
];

/// The calls on a process's foreground session (a terminal UI's): a pool process has none.
const FOREGROUND: &[&str] = &["session.getForeground", "session.setForeground"];

/// A session's own calls the pool forwards to its runtime, besides those it answers itself
/// (`session.send`, `session.abort`, the tool and permission answers, `session.options.update`
/// with its directories confined, `session.delete`, `session.detach`): reads, the session's
/// own settings (model, mode, name, agent, plan, history) and the answers to what the runtime
/// asks the client. Every other `session.*` call is refused: it would run work outside a turn
/// the pool supervises (`sendMessages`, `schedule.*`, `fleet.*`, `tasks.*`, `factory.*`,
/// `shell.*`, `tools.execute`, `queue.*`), widen what the session may touch
/// (`metadata.setWorkingDirectory`, `permissions.*` changes, `mcp.*` servers, `sandbox.*`),
/// or change its identity (`gitHubAuth.*`). Newer methods are refused until listed here.
const SESSION_CALLS: &[&str] = &[
    // Reads.
    "session.getMessages",
    "session.getMetadata",
    "session.eventLog.read",
    "session.eventLog.tail",
    "session.eventLog.registerInterest",
    "session.eventLog.releaseInterest",
    "session.metadata.activity",
    "session.metadata.contextInfo",
    "session.metadata.getClientMetadata",
    "session.metadata.getContextAttribution",
    "session.metadata.getContextHeaviestMessages",
    "session.metadata.isProcessing",
    "session.metadata.snapshot",
    "session.mode.get",
    "session.model.getCurrent",
    "session.model.list",
    "session.name.get",
    "session.usage.getMetrics",
    "session.plan.read",
    "session.plan.readSqlTodos",
    "session.plan.readSqlTodosWithDependencies",
    "session.permissions.getMode",
    "session.permissions.pendingRequests",
    "session.permissions.paths.list",
    "session.permissions.paths.isPathWithinAllowedDirectories",
    "session.permissions.paths.isPathWithinWorkspace",
    "session.agent.getCurrent",
    "session.agent.list",
    "session.skills.list",
    "session.skills.getInvoked",
    "session.tools.getBuiltinDescriptors",
    "session.tools.getCurrentMetadata",
    "session.history.listRewindPoints",
    "session.history.previewRewind",
    "session.instructions.getSources",
    "session.limitPrediction.predict",
    "session.visibility.get",
    "session.sandbox.getEnforcementStatus",
    "session.mcp.list",
    "session.mcp.listTools",
    "session.mcp.isServerRunning",
    "session.queue.hasPending",
    "session.queue.pendingItems",
    "session.queue.snapshot",
    "session.tasks.list",
    "session.tasks.getProgress",
    // The session's own settings and history.
    "session.log",
    "session.interruptMainTurn",
    "session.cancelAllBackgroundAgents",
    "session.mode.set",
    "session.name.set",
    "session.name.setAuto",
    "session.model.switchTo",
    "session.model.switchAutoTier",
    "session.model.setReasoningEffort",
    "session.agent.select",
    "session.agent.deselect",
    "session.tools.set",
    "session.plan.update",
    "session.plan.delete",
    "session.metadata.updateClientMetadata",
    "session.history.compact",
    "session.history.abortManualCompaction",
    "session.history.cancelBackgroundCompaction",
    "session.history.truncate",
    "session.history.rewind",
    "session.history.clearContext",
    // Answers to what the runtime asks the client.
    "session.ui.elicitation",
    "session.ui.handlePendingUserInput",
    "session.ui.handlePendingElicitation",
    "session.ui.handlePendingExitPlanMode",
    "session.ui.handlePendingSampling",
    "session.ui.handlePendingAutoModeSwitch",
    "session.ui.handlePendingSessionLimitsExhausted",
    "session.commands.handlePendingCommand",
    "session.mcp.oauth.handlePendingRequest",
];

/// The largest frame read from a client before its `connect` succeeded (64 KiB: a `connect`
/// is a few hundred bytes); a larger one closes the connection.
pub const UNAUTHENTICATED_MAX_FRAME_BYTES: usize = 64 * 1024;

/// Incoming messages queued per connection beyond those being handled; more are refused.
const QUEUE: usize = 256;

/// One client connection.
struct Client {
    id: u64,
    shared: Arc<Shared>,
    conn: Connection,
    /// The agent, once `connect` succeeded.
    agent: OnceLock<String>,
    /// The slot among the connections waiting to authenticate, given back at `connect`.
    waiting: Mutex<Option<Slot>>,
    /// The seat among its agent's connections, taken at `connect`, given back at the close.
    seat: Mutex<Option<Seat>>,
    /// Sessions opened on this connection, and those it is deleting.
    sessions: Mutex<Sessions>,
    /// Set, under the `sessions` lock, when the client is gone: an open still running then
    /// takes no session (its claim would never be released).
    gone: AtomicBool,
    /// The session used last, whose process answers calls that name no session.
    last: Mutex<Option<String>>,
}

/// A connection's sessions, under one lock so that an open and a deletion of one id see each
/// other.
#[derive(Default)]
struct Sessions {
    /// Opened on this connection, by SDK session id.
    open: HashMap<String, Arc<SdkSession>>,
    /// Ids whose `session.delete` is running: an open of one is refused until it answers (it
    /// would be deleted under the client, or removed from the connection by the deletion).
    deleting: HashSet<String>,
}

/// The mark of a `session.delete` running on a connection, taken off when it drops (the
/// deletion answered, or was cancelled).
struct Deleting<'a> {
    sessions: &'a Mutex<Sessions>,
    id: String,
}

impl Drop for Deleting<'_> {
    fn drop(&mut self) {
        if let Ok(mut sessions) = self.sessions.lock() {
            sessions.deleting.remove(&self.id);
        }
    }
}

/// Serves one accepted client until it leaves or the listener stops; then aborts its turns
/// and lets go of its sessions.
pub(super) async fn run<S>(
    shared: Arc<Shared>,
    stream: S,
    mut stop: watch::Receiver<bool>,
    slot: Slot,
) where
    S: AsyncRead + AsyncWrite + Send + 'static,
{
    let _counted = crate::metrics::OpenSdkConnection::counted();
    let (read, write) = tokio::io::split(stream);
    let (tx, mut rx) = mpsc::channel(QUEUE);
    let options = ConnectionOptions {
        max_frame_bytes: shared.config.max_frame_bytes,
        default_timeout: shared.config.request_timeout,
        // Until `connect` succeeds a client sends small frames only: one that has not
        // authenticated cannot make the reader parse megabytes.
        read_limit_until_lifted: Some(UNAUTHENTICATED_MAX_FRAME_BYTES),
        // A client's params are parsed into values: a frame dense with them (`[0,0,…]`)
        // would take many times its bytes, so the count is bounded too.
        max_frame_values: Some(crate::json_values::value_limit(
            shared.config.max_frame_bytes,
        )),
        // A client that stops reading, or never closes its side, holds no more than this:
        // its answers and events queue up to two full frames, one write waits for it
        // `WRITE_STALL_TIMEOUT`, and its socket is let go at our close.
        peer_limits: Some(PeerLimits {
            max_queued_bytes: shared.config.max_frame_bytes.saturating_mul(2),
            write_stall_timeout: WRITE_STALL_TIMEOUT,
        }),
        ..ConnectionOptions::default()
    };
    let queue_full = format!(
        "copilot-pool: more than {QUEUE} calls of this connection are waiting to be handled \
         (beyond the {} it handles at once, the endpoint's max_requests_per_connection); \
         wait for answers before sending more",
        shared.config.max_requests_per_connection
    );
    // The calls waiting or being handled hold their params, parsed (their frames' bytes,
    // or 32 bytes a value where that is more: `IncomingRequest::frame_bytes`): at most twice
    // the largest frame per connection, whatever their number.
    let held = Arc::new(AtomicUsize::new(0));
    let held_limit = shared.config.max_frame_bytes.saturating_mul(2);
    let too_much = move |held: usize, bytes: usize| {
        format!(
            "copilot-pool: this connection's calls waiting or being handled hold about \
             {held} bytes parsed, and this one of about {bytes} (its bytes, or 32 a JSON value \
             it holds when that is more) would pass the bound of {held_limit} (twice the \
             endpoint's max_frame_bytes); wait for answers before sending more"
        )
    };
    // Set by the reader when the client is gone, so the loop below notices it even while it
    // waits for a free request slot (and stops reading its queue).
    let closed = tokio_util::sync::CancellationToken::new();
    let sink = {
        let held = held.clone();
        let closed = closed.clone();
        move |incoming: Incoming| {
            if matches!(incoming, Incoming::Closed(_)) {
                closed.cancel();
            }
            // A client's notifications carry nothing the pool acts on: dropped here, so none
            // waits in the queue holding its params.
            if matches!(
                incoming,
                Incoming::Notification { .. } | Incoming::SessionEvent { .. }
            ) {
                return;
            }
            if let Incoming::Request(request) = &incoming {
                // One call is always taken, however large (it is within max_frame_bytes).
                let bytes = request.frame_bytes;
                let before = held.fetch_add(bytes, Ordering::SeqCst);
                if before > 0 && before + bytes > held_limit {
                    held.fetch_sub(bytes, Ordering::SeqCst);
                    if let Incoming::Request(request) = incoming {
                        request
                            .responder
                            .err(ErrorObject::new(INTERNAL_ERROR, too_much(before, bytes)));
                    }
                    return;
                }
            }
            // A full queue refuses the request, saying why.
            if let Err(mpsc::error::TrySendError::Full(Incoming::Request(request))) =
                tx.try_send(incoming)
            {
                held.fetch_sub(request.frame_bytes, Ordering::SeqCst);
                request
                    .responder
                    .err(ErrorObject::new(INTERNAL_ERROR, queue_full.clone()));
            }
        }
    };
    let conn = Connection::start(read, write, options, Box::new(sink));
    let mut displaced = slot.displaced.clone();
    let client = Arc::new(Client {
        id: shared.next_connection_id(),
        shared: shared.clone(),
        conn: conn.clone(),
        agent: OnceLock::new(),
        waiting: Mutex::new(Some(slot)),
        seat: Mutex::new(None),
        sessions: Mutex::new(Sessions::default()),
        gone: AtomicBool::new(false),
        last: Mutex::new(None),
    });
    // 0 counts as 1, as the other caps do: none would never handle a call, `connect` included.
    let in_flight = Arc::new(Semaphore::new(
        shared.config.max_requests_per_connection.max(1),
    ));
    // The calls being handled: aborted when the connection ends, so none runs on for a
    // client that is gone (an open waiting for room would create a session nobody reads).
    let mut handlers = tokio::task::JoinSet::new();
    let connect_deadline = tokio::time::Instant::now() + shared.config.connect_timeout;
    loop {
        let authenticated = client.agent.get().is_some();
        let incoming = tokio::select! {
            incoming = rx.recv() => incoming,
            // Handled calls are reaped as they end (the set keeps what ended until joined).
            Some(_) = handlers.join_next(), if !handlers.is_empty() => continue,
            _ = stop.wait_for(|s| *s) => break,
            () = tokio::time::sleep_until(connect_deadline), if !authenticated => {
                tracing::info!("An SDK client did not authenticate in time; closing its connection.");
                crate::metrics::sdk_connection(crate::metrics::SdkConnection::Unauthenticated);
                break;
            }
            now = displaced.wait_for(|d| *d), if !authenticated => {
                // Closed without a displacement: the slot was given back at `connect`.
                if now.is_err() {
                    continue;
                }
                tracing::info!(
                    "An SDK client that had not authenticated made way for a newer connection; \
                     closing it."
                );
                crate::metrics::sdk_connection(crate::metrics::SdkConnection::Unauthenticated);
                break;
            }
        };
        match incoming {
            Some(Incoming::Request(request)) => {
                // Every slot busy: the call waits here, and a close of either side still ends
                // the connection now (its turns aborted, its seat given back), not once a
                // slot frees. A deletion its client sent before it left runs all the same,
                // without a slot (the connection's other calls are aborted next).
                let outlives = outlives_its_connection(&request.method);
                let permit = tokio::select! {
                    permit = in_flight.clone().acquire_owned() => match permit {
                        Ok(permit) => Some(permit),
                        Err(_) => break,
                    },
                    _ = stop.wait_for(|s| *s) => break,
                    () = closed.cancelled() => {
                        if !outlives {
                            break;
                        }
                        None
                    }
                };
                let client = client.clone();
                let held = HeldBytes {
                    held: held.clone(),
                    bytes: request.frame_bytes,
                };
                let handled = async move {
                    client.handle(request).await;
                    drop(held);
                    drop(permit);
                };
                if outlives {
                    tokio::spawn(handled);
                } else {
                    handlers.spawn(handled);
                }
            }
            // Notifications from a client carry nothing the pool acts on.
            Some(Incoming::Notification { .. } | Incoming::SessionEvent { .. }) => {}
            Some(Incoming::Closed(_)) | None => break,
        }
    }
    // The calls still running go first (each dropped as any cancelled call is: a lease
    // dropped mid-turn aborts its turn and gives the conversation back), then the
    // connection's sessions.
    handlers.abort_all();
    while handlers.join_next().await.is_some() {}
    client.close().await;
    conn.close(CloseCause::Local);
}

/// Whether a call runs to its end when its connection ends, where every other is aborted: a
/// deletion, which holds its session claimed until it ends (another connection's resume
/// meanwhile refused) and which its client may well send just before it leaves.
fn outlives_its_connection(method: &str) -> bool {
    method == "session.delete"
}

/// A conversation claimed by a connection for one call (a deletion), given back when the
/// call ends, or panics.
struct Claimed {
    shared: Arc<Shared>,
    conversation: String,
    connection: u64,
}

impl Drop for Claimed {
    fn drop(&mut self) {
        self.shared.release(&self.conversation, self.connection);
    }
}

/// A handled call's share of its connection's held bytes, given back when it drops (its
/// handler returned, or panicked).
struct HeldBytes {
    held: Arc<AtomicUsize>,
    bytes: usize,
}

impl Drop for HeldBytes {
    fn drop(&mut self) {
        self.held.fetch_sub(self.bytes, Ordering::SeqCst);
    }
}

impl Client {
    fn agent(&self) -> Option<&str> {
        self.agent.get().map(String::as_str)
    }

    async fn handle(self: &Arc<Self>, request: IncomingRequest) {
        let IncomingRequest {
            method,
            params,
            responder,
            ..
        } = request;
        // Handled before the client authenticated (a wrong token, or any other call first).
        let unauthenticated = self.agent().is_none();
        let result = match (self.agent(), method.as_str()) {
            (None, _) => self.before_connect(&method, &params),
            (Some(_), "session.create" | "session.resume") => {
                match self
                    .open(&method, &params, method == "session.resume")
                    .await
                {
                    Ok((answer, after)) => {
                        responder.ok(answer);
                        after.forward().await;
                        return;
                    }
                    Err(error) => Err(error),
                }
            }
            (Some(_), _) => self.dispatch(&method, params).await,
        };
        match result {
            Ok(answer) => responder.ok(answer),
            Err(error) => responder.err(error),
        }
        if unauthenticated && (method != "connect" || self.agent().is_none()) {
            // A wrong token, or any other call first (even with a `connect` that succeeded
            // beside it), closes the connection once the answer is out: a client that has
            // not authenticated gets one answer, not one per call it sends (each would
            // repeat the call's id, up to a frame's size, into the writer's queue of a
            // client that need not read it).
            self.conn.close(CloseCause::Local);
        }
    }

    /// Only `connect` is answered before the client authenticated.
    fn before_connect(&self, method: &str, params: &Value) -> Result<Value, CallError> {
        if method != "connect" {
            return Err(ErrorObject::new(
                AUTHENTICATION_REQUIRED,
                "AUTHENTICATION_REQUIRED: call connect with the connection token first",
            ));
        }
        let token = params.get("token").and_then(Value::as_str).unwrap_or("");
        let Some(agent) = self.shared.config.tokens.agent_for(token) else {
            tracing::warn!("An SDK client presented an unknown connection token.");
            crate::metrics::sdk_connection(crate::metrics::SdkConnection::Unauthenticated);
            let message = if token.is_empty() {
                "AUTHENTICATION_FAILED: connect carried no connection token; give the agent's \
                 token to the SDK (Node: `RuntimeConnection.forUri(url, { connectionToken })`, \
                 Python: `RuntimeConnection.for_uri(url, connection_token=...)`)"
            } else {
                "AUTHENTICATION_FAILED: the connection token is not one of this daemon's \
                 (its SHA-256 must be listed for the agent in the daemon's [sdk] tokens)"
            };
            return Err(ErrorObject::new(AUTHENTICATION_FAILED, message));
        };
        let Some(seat) = self.shared.seats.take(agent) else {
            let max = self.shared.seats.max();
            tracing::warn!(
                agent,
                max_connections_per_agent = max,
                "An SDK client was refused: its agent holds max_connections_per_agent \
                 connections already."
            );
            crate::metrics::sdk_connection(crate::metrics::SdkConnection::AgentLimit);
            return Err(ErrorObject::new(
                TOO_MANY_CONNECTIONS,
                format!(
                    "TOO_MANY_CONNECTIONS: agent {agent} has {max} open connections to this \
                     endpoint already (the daemon's [sdk] max_connections_per_agent); close \
                     the ones it no longer uses (one client runs all of an agent's sessions) \
                     or raise the limit"
                ),
            ));
        };
        match self.agent.set(agent.to_owned()) {
            Ok(()) => {
                if let Ok(mut held) = self.seat.lock() {
                    *held = Some(seat);
                }
            }
            // Two `connect`s at once with the same agent's tokens: its seat is taken once.
            Err(_) if self.agent() == Some(agent) => {}
            Err(_) => {
                return Err(ErrorObject::new(
                    AUTHENTICATION_FAILED,
                    "AUTHENTICATION_FAILED: this connection is authenticated for another agent \
                     already (a connect with another agent's token raced it); open one \
                     connection per agent",
                ));
            }
        }
        if let Ok(mut slot) = self.waiting.lock() {
            slot.take();
        }
        self.conn.lift_read_limit();
        tracing::info!(agent, "An SDK client connected.");
        Ok(self.connect_answer())
    }

    fn connect_answer(&self) -> Value {
        json!({
            "ok": true,
            "protocolVersion": PROTOCOL_VERSION,
            "version": self.shared.config.version,
            "taskKinds": ["agent", "shell"],
        })
    }

    async fn dispatch(self: &Arc<Self>, method: &str, params: Value) -> Result<Value, CallError> {
        match method {
            "connect" => {
                let token = params.get("token").and_then(Value::as_str).unwrap_or("");
                match self.shared.config.tokens.agent_for(token) {
                    Some(agent) if Some(agent) == self.agent() => Ok(self.connect_answer()),
                    // Another agent's token and no token at all get one answer: a client must
                    // not learn which strings are some other agent's token.
                    _ => Err(ErrorObject::new(
                        AUTHENTICATION_FAILED,
                        "AUTHENTICATION_FAILED: the token is not this connection's agent's \
                         (a connection is authenticated once, for one agent: open a new \
                         connection for each agent); this connection stays authenticated as \
                         before",
                    )),
                }
            }
            "ping" => {
                let message = params.get("message").and_then(Value::as_str).unwrap_or("");
                let now = std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map(|d| d.as_millis() as u64)
                    .unwrap_or(0);
                Ok(json!({
                    "message": format!("pong: {message}"),
                    "timestamp": now,
                    "protocolVersion": PROTOCOL_VERSION,
                }))
            }
            "status.get" => Ok(json!({
                "version": self.shared.config.version,
                "protocolVersion": PROTOCOL_VERSION,
            })),
            // `session.create` and `session.resume` are answered by `handle`: their events
            // follow the answer.
            "session.detach" | "session.destroy" => self.let_go(method, &params).await,
            "session.delete" => self.delete(&params).await,
            // Newer SDKs try this first and fall back to session.send on "method not
            // found": the pool runs (and supervises) every turn through session.send.
            "session.sendAndWait" => Err(ErrorObject::new(
                METHOD_NOT_FOUND,
                "Unhandled method session.sendAndWait: copilot-pool runs turns through \
                 session.send (the SDK falls back to it)",
            )),
            m if FOREGROUND.contains(&m) => Err(ErrorObject::new(
                METHOD_NOT_FOUND,
                format!(
                    "{m} is not available through copilot-pool: its processes serve many \
                     sessions at once and have no foreground session (a terminal UI's \
                     notion); each call names the session it is for"
                ),
            )),
            m if PROCESS_WIDE.contains(&m) => Err(ErrorObject::new(
                METHOD_NOT_FOUND,
                format!(
                    "{m} is not available through copilot-pool: it would change a process \
                     that other clients share (give providers per session instead)"
                ),
            )),
            _ => match session_id(&params) {
                // Only a session's own calls go to it: `sessions.open`, `sessions.fork`,
                // `account.*` or `mcp.*` with a `sessionId` added are not (they would open,
                // fork or delete sessions outside the pool, or change what other
                // conversations share).
                Some(id) if method.starts_with("session.") => {
                    self.session_call(method, &id, params).await
                }
                Some(_) => Err(ErrorObject::new(
                    METHOD_NOT_FOUND,
                    format!(
                        "{method} is not available through copilot-pool: it names a session \
                         but is not one of the session's own calls (`session.*`); sessions are \
                         opened with session.create or session.resume and deleted with \
                         session.delete"
                    ),
                )),
                None if BESIDE_SESSIONS.contains(&method) => {
                    self.beside_sessions(method, params).await
                }
                None => Err(ErrorObject::new(
                    METHOD_NOT_FOUND,
                    format!(
                        "{method} is not available through copilot-pool: a call naming no \
                         session may only read (one of {}); others would change the agent's \
                         home or a process other conversations share",
                        BESIDE_SESSIONS.join(", ")
                    ),
                )),
            },
        }
    }

    fn session(&self, id: &str) -> Option<Arc<SdkSession>> {
        self.sessions
            .lock()
            .ok()
            .and_then(|s| s.open.get(id).cloned())
    }

    fn touch(&self, id: &str) {
        if let Ok(mut last) = self.last.lock() {
            *last = Some(id.to_owned());
        }
    }

    /// `session.create` / `session.resume`: the session becomes this connection's (one
    /// connection at a time holds a session), then the pool opens it; the answer, and
    /// the open's events to pass on once it is out.
    async fn open(
        self: &Arc<Self>,
        method: &str,
        params: &Value,
        resume: bool,
    ) -> Result<(Value, AfterOpen), CallError> {
        if self.shared.is_draining() {
            return Err(ErrorObject::new(
                INTERNAL_ERROR,
                format!(
                    "Request {method} failed with message: copilot-pool is draining (shutting \
                     down); connect to another replica or retry after the restart"
                ),
            ));
        }
        let agent = self.agent().unwrap_or_default().to_owned();
        let params =
            session::confine_directories(&self.shared, &agent, method, params.clone()).await?;
        let spec = SessionSpec::from_params(method, &params)?;
        if !self.shared.config.allow_local_mcp_servers
            && let Some(fields) = params.as_object()
        {
            if let Some(field) = crate::session_options::local_mcp_servers(fields)
                .into_iter()
                .next()
            {
                return Err(ErrorObject::new(
                    INVALID_PARAMS,
                    format!(
                        "{field} starts a local command, which copilot-pool's config does not \
                         allow (allow_local_mcp_servers); use a remote (http or sse) MCP server"
                    ),
                ));
            }
            if let Some(field) = super::fields::local_command_source(fields) {
                return Err(ErrorObject::new(
                    INVALID_PARAMS,
                    format!(
                        "{field} has the runtime run commands from files in the agent's \
                         directories (hooks, or MCP servers in configuration it discovers, \
                         plugins or custom agent files), \
                         which copilot-pool's config does not allow (allow_local_mcp_servers); \
                         leave it out, or set allow_local_mcp_servers = true"
                    ),
                ));
            }
        }
        let id = spec.id.to_string();
        let conversation = session::conversation(&agent, &id).key();
        // The claim and the session's place on this connection are taken together, under
        // the lock the client's close takes: a close either finds the session (and lets it
        // go) or comes first (and no claim is taken).
        let (sdk_session, fresh) = {
            let Ok(mut sessions) = self.sessions.lock() else {
                return Err(ErrorObject::new(
                    INTERNAL_ERROR,
                    "connection state poisoned",
                ));
            };
            if self.gone.load(Ordering::SeqCst) {
                return Err(ErrorObject::new(
                    INTERNAL_ERROR,
                    format!("Request {method} failed with message: the connection is closing"),
                ));
            }
            if sessions.deleting.contains(&id) {
                return Err(being_deleted(method, &id));
            }
            let limit = self.shared.config.max_sessions_per_connection;
            if !sessions.open.contains_key(&id) && sessions.open.len() >= limit {
                return Err(ErrorObject::new(
                    INTERNAL_ERROR,
                    format!(
                        "Request {method} failed with message: this connection holds {} \
                         sessions, copilot-pool's max_sessions_per_connection; disconnect the \
                         ones it no longer uses (the SDK's disconnect, session.detach), or use \
                         another connection",
                        sessions.open.len()
                    ),
                ));
            }
            if !self.shared.claim(&conversation, self.id) {
                return Err(open_elsewhere(method, &id));
            }
            match sessions.open.get(&id) {
                Some(held) => {
                    held.set_spec(spec);
                    (held.clone(), false)
                }
                None => {
                    let created = Arc::new(SdkSession::new(
                        self.shared.clone(),
                        agent,
                        spec,
                        self.conn.clone(),
                    ));
                    sessions.open.insert(id.clone(), created.clone());
                    (created, true)
                }
            }
        };
        match sdk_session.open(method, resume).await {
            Ok(answer) => {
                self.touch(&id);
                Ok(answer)
            }
            Err(error) => {
                if fresh {
                    self.forget(&id);
                }
                Err(error)
            }
        }
    }

    /// Removes a session from this connection and lets go of it.
    fn forget(&self, id: &str) {
        // A session being deleted keeps its claim: the deletion's guard gives it back when
        // the deletion ends (an open of it that failed meanwhile must not give it away).
        let removed = self.sessions.lock().ok().and_then(|mut s| {
            let removed = s.open.remove(id);
            removed.filter(|_| !s.deleting.contains(id))
        });
        if let Some(session) = removed {
            self.shared.release(&session.conversation().key(), self.id);
        }
        if let Ok(mut last) = self.last.lock()
            && last.as_deref() == Some(id)
        {
            *last = None;
        }
    }

    /// `session.detach` (the SDK's `disconnect`) and the legacy `session.destroy`: a running
    /// turn is aborted; the session stays stored (and parked in the pool), resumable by this
    /// agent on any connection.
    async fn let_go(&self, method: &str, params: &Value) -> Result<Value, CallError> {
        let id = session_id(params).unwrap_or_default();
        let (session, deleting) = match self.sessions.lock() {
            Ok(sessions) => (
                sessions.open.get(&id).cloned(),
                sessions.deleting.contains(&id),
            ),
            Err(_) => (None, false),
        };
        if deleting {
            // Its deletion holds it: letting go now would give its claim away mid-deletion.
            return Err(being_deleted(method, &id));
        }
        let Some(session) = session else {
            return Err(session_not_found(method, &id));
        };
        session.stop_turn().await;
        self.forget(&id);
        Ok(json!({"success": true}))
    }

    /// `session.delete`: removes the session's state for good, whether or not this
    /// connection opened it (a session another connection holds is refused).
    async fn delete(&self, params: &Value) -> Result<Value, CallError> {
        const METHOD: &str = "session.delete";
        let id = session_id(params).unwrap_or_default();
        let agent = self.agent().unwrap_or_default().to_owned();
        // Marked as being deleted under the lock an open takes: an open of the id on this
        // connection meanwhile is refused, not deleted under the client once it answers.
        let (held, _deleting) = {
            let Ok(mut sessions) = self.sessions.lock() else {
                return Err(ErrorObject::new(
                    INTERNAL_ERROR,
                    "connection state poisoned",
                ));
            };
            if !sessions.deleting.insert(id.clone()) {
                return Err(ErrorObject::new(
                    INTERNAL_ERROR,
                    format!(
                        "Request {METHOD} failed with message: session {id} is already being \
                         deleted on this connection; wait for that session.delete to answer"
                    ),
                ));
            }
            let deleting = Deleting {
                sessions: &self.sessions,
                id: id.clone(),
            };
            (sessions.open.get(&id).cloned(), deleting)
        };
        let opened_here = held.is_some();
        let conversation = session::conversation(&agent, &id).key();
        // Claimed for the deletion (given back when it ends, however it ends, even when the
        // client leaves meanwhile): another connection's resume meanwhile is refused, not
        // deleted under it once it has the session. A session opened here is claimed already.
        if !self.shared.claim(&conversation, self.id) {
            return Err(open_elsewhere(METHOD, &id));
        }
        let _claimed = Claimed {
            shared: self.shared.clone(),
            conversation,
            connection: self.id,
        };
        let session = match held {
            Some(session) => session,
            None => Arc::new(SdkSession::new(
                self.shared.clone(),
                agent,
                SessionSpec::bare(&id)?,
                self.conn.clone(),
            )),
        };
        // Known here by its id alone, it is deleted through a lease that needs none of its
        // credentials (the client's token or BYOK provider, which only its opener gave).
        let deleted = session.delete(!opened_here).await;
        self.forget(&id);
        deleted.or_else(|error| Ok(json!({"success": false, "error": error.message})))
    }

    /// A call naming a session: this connection must hold it.
    async fn session_call(
        self: &Arc<Self>,
        method: &str,
        id: &str,
        params: Value,
    ) -> Result<Value, CallError> {
        let Some(session) = self.session(id) else {
            // The SDKs' lookup of a stored session (`getSessionMetadata`: its metadata, or
            // `null` when there is none) is a read of the agent's home, as `session.list` is:
            // answered beside the sessions for one this connection does not hold.
            if method == "session.getMetadata" {
                session::validate_session_id(id)?;
                return self.beside_sessions(method, params).await;
            }
            return Err(session_not_found(method, id));
        };
        self.touch(id);
        match method {
            "session.send" => {
                let agent = self.agent().unwrap_or_default();
                let params = session::confine_attachments(&self.shared, agent, params).await?;
                session.send(params).await
            }
            "session.abort" => session.abort(params).await,
            "session.tools.handlePendingToolCall" => session.answer_tool(&params).await,
            "session.permissions.handlePendingPermissionRequest" => {
                session.answer_permission(&params).await
            }
            "session.model.switchTo" => session.switch_model(params).await,
            "session.options.update" => {
                let agent = self.agent().unwrap_or_default();
                let params =
                    session::confine_directories(&self.shared, agent, method, params).await?;
                session.update_options(params).await
            }
            // Refused in `call` with its own reason.
            "session.provider.add" => session.call(method, params).await,
            _ if SESSION_CALLS.contains(&method) => session.call(method, params).await,
            _ => Err(ErrorObject::new(
                METHOD_NOT_FOUND,
                format!(
                    "{method} is not available through copilot-pool: a session's calls are its \
                     reads, its own settings (model, mode, name, agent, plan, history) and the \
                     answers to what the runtime asks; this one would run work outside a turn \
                     the pool supervises, widen what the session may touch, or change its \
                     identity. Send turns with session.send; give directories, tools and MCP \
                     servers at session.create"
                ),
            )),
        }
    }

    /// A call naming no session (`session.list`, `session.getLastId`, `models.list`,
    /// `auth.getStatus`, `account.*`, and methods newer than this crate): answered by a
    /// process of the connection's key, held for the call and no longer (no conversation
    /// is opened). The key is that of the session this connection used last (its
    /// credentials and provider), or, before any session, the agent's home with no session
    /// credentials (a process with no GitHub identity unless the logged-in user is allowed).
    async fn beside_sessions(&self, method: &str, params: Value) -> Result<Value, CallError> {
        let last = self.last.lock().ok().and_then(|l| l.clone());
        let session = last.and_then(|id| self.session(&id)).or_else(|| {
            self.sessions
                .lock()
                .ok()
                .and_then(|s| s.open.values().next().cloned())
        });
        let agent = self.agent().unwrap_or_default();
        let request = match session {
            Some(session) => session.process_request(),
            None => session::connection_request(&self.shared, agent),
        };
        let process = self
            .shared
            .pool
            .lease_process(&request)
            .await
            .map_err(|e| session::pool_error(method, &e))?;
        process
            .worker()
            .call_raw(method, params, self.shared.config.request_timeout)
            .await
            .map_err(|e| session::worker_error(method, &e))
    }

    /// The client is gone: its sessions are let go at once (another connection of the agent
    /// may open one now; its lease queues in the pool behind the turn being settled), and
    /// its running turns are aborted and settled.
    async fn close(&self) {
        // The seat first: a client that reconnects at its cap must not wait for this one's
        // turns to settle.
        if let Ok(mut seat) = self.seat.lock() {
            seat.take();
        }
        let (sessions, deleting): (Vec<(String, Arc<SdkSession>)>, HashSet<String>) = self
            .sessions
            .lock()
            .map(|mut s| {
                self.gone.store(true, Ordering::SeqCst);
                (s.open.drain().collect(), s.deleting.clone())
            })
            .unwrap_or_default();
        // A session being deleted stays claimed until its deletion ends (its claim guard
        // gives it back then).
        for (id, session) in &sessions {
            if !deleting.contains(id) {
                self.shared.release(&session.conversation().key(), self.id);
            }
        }
        let stops = sessions.iter().map(|(_, session)| session.stop_turn());
        futures_util::future::join_all(stops).await;
        if let Some(agent) = self.agent() {
            tracing::info!(agent, sessions = sessions.len(), "An SDK client left.");
        }
    }
}

/// The refusal of a call on session `id` while another connection of the agent holds it.
fn open_elsewhere(method: &str, id: &str) -> ErrorObject {
    ErrorObject::new(
        INTERNAL_ERROR,
        format!(
            "Request {method} failed with message: session {id} is open on another connection \
             of this agent, or being deleted there; disconnect it there first, or wait for its \
             session.delete to answer"
        ),
    )
}

/// The refusal of an open or a let-go of session `id` while this connection deletes it.
fn being_deleted(method: &str, id: &str) -> ErrorObject {
    ErrorObject::new(
        INTERNAL_ERROR,
        format!(
            "Request {method} failed with message: session {id} is being deleted on this \
             connection; wait for its session.delete to answer"
        ),
    )
}

/// The `sessionId` a call names, if any.
fn session_id(params: &Value) -> Option<String> {
    params
        .get("sessionId")
        .and_then(Value::as_str)
        .map(str::to_owned)
}
