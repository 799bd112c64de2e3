//! One SDK session on one client connection: the pool conversation behind it, leased for
//! each turn (`session.send` to `session.idle`) and for each call between turns; the turn
//! pump that passes the session's events and the runtime's questions to the client; and what
//! happens when the process dies mid-turn (`session.error`, then `session.idle`, then the
//! next call resumes the session on a fresh process) or the client goes away (the turn is
//! aborted and settled, the session parked).

use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::{Map, Value, json};
use tokio::sync::watch;

use crate::auth::{LeaseAuth, fingerprint};
use crate::ids::{CliSessionId, ConversationId};
use crate::kinds::TurnEnd;
use crate::pool::{Lease, LeaseRequest, OpenReason, PoolError};
use crate::rpc::connection::{Connection, ErrorObject, INTERNAL_ERROR, INVALID_PARAMS};
use crate::rpc::messages::{ProviderConfig, SessionConfig};
use crate::rpc::{EventKind, SessionEvent};
use crate::secret::Secret;
use crate::worker::{
    Answerer, ServerRequest, Session, SessionUpdate, Settled, ToolResult, WorkerError, WorkerHandle,
};

use super::Shared;
use super::fields::{self, Refusal};

/// The prefix of an SDK session's conversation key: `(agent, "sdk:<session id>")`.
pub(super) const SESSION_KEY_PREFIX: &str = crate::ids::SDK_SESSION_KEY_PREFIX;

/// The longest SDK session id accepted (a UUID has 36 characters).
const MAX_SESSION_ID_BYTES: usize = 128;

/// The `errorType` of the `session.error` a client gets when the process running its turn
/// died.
pub const PROCESS_CRASHED: &str = "process_crashed";

/// The client's model switch, applied again where the session moves.
const SWITCH_MODEL: &str = "session.model.switchTo";

/// The call that changes a session's settings, applied again after a resume.
const UPDATE_OPTIONS: &str = "session.options.update";

/// Whether a session still runs a turn (or a background continuation).
const IS_PROCESSING: &str = "session.metadata.isProcessing";

/// How long the pump waits, at a turn's end, for the answers to prompts sent into the turn
/// and for the runtime to say whether it runs on (each): the pump reads nothing meanwhile.
const ASK_LIMIT: Duration = Duration::from_secs(2);

/// The prompts a client sent into a running turn ([`SdkSession::send_into_turn`]).
#[derive(Default)]
struct SentIntoTurn {
    /// Sent since the pump last looked.
    sent: std::sync::atomic::AtomicBool,
    /// Still waiting for the runtime's answer.
    waiting: std::sync::atomic::AtomicUsize,
    answered: tokio::sync::Notify,
}

impl SentIntoTurn {
    /// One send on its way, until the guard drops (answered, failed, or its call dropped).
    fn sending(&self) -> SendingIntoTurn<'_> {
        use std::sync::atomic::Ordering::SeqCst;
        self.waiting.fetch_add(1, SeqCst);
        self.sent.store(true, SeqCst);
        SendingIntoTurn(self)
    }

    /// Whether a send went into the turn since the last look (and forgets it).
    fn take(&self) -> bool {
        self.sent.swap(false, std::sync::atomic::Ordering::SeqCst)
    }

    /// Resolves once no send waits for its answer.
    async fn answered(&self) {
        loop {
            let notified = self.answered.notified();
            if self.waiting.load(std::sync::atomic::Ordering::SeqCst) == 0 {
                return;
            }
            notified.await;
        }
    }
}

/// A send into a running turn on its way ([`SentIntoTurn::sending`]).
struct SendingIntoTurn<'a>(&'a SentIntoTurn);

impl Drop for SendingIntoTurn<'_> {
    fn drop(&mut self) {
        if self
            .0
            .waiting
            .fetch_sub(1, std::sync::atomic::Ordering::SeqCst)
            == 1
        {
            self.0.answered.notify_waiters();
        }
    }
}

/// The `errorType` of the `session.error` a client gets when its turn ran past the
/// endpoint's `max_turn_duration` and was aborted.
pub const TURN_LIMIT: &str = "turn_limit";

/// The `errorType` of the `session.error` a client gets when its turn was still running when
/// the daemon's drain grace ended (the daemon is shutting down) and was aborted.
pub const SHUTDOWN: &str = "shutdown";

/// What a [`SHUTDOWN`] `session.error` says.
const SHUT_DOWN_MESSAGE: &str = "copilot-pool is shutting down: this turn was still running \
    when the drain's grace ended (drain_grace_secs in copilot-pool serve's config) and was \
    aborted; send it again once the daemon, or another replica, serves the agent";

/// A JSON-RPC error for the client.
pub(super) type CallError = ErrorObject;

/// Checks an SDK session id: 1 to 128 of `A-Z a-z 0-9 . _ -`, not `.` or `..` (it names a
/// directory under the agent's home).
pub(super) fn validate_session_id(id: &str) -> Result<(), CallError> {
    let ok = !id.is_empty()
        && id.len() <= MAX_SESSION_ID_BYTES
        && id != "."
        && id != ".."
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'));
    if ok {
        return Ok(());
    }
    // What is wrong with it: its length, or the first character that is not allowed.
    let got = match id
        .chars()
        .find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-')))
    {
        Some(c) => format!("it holds {c:?}"),
        None if id.len() > MAX_SESSION_ID_BYTES || id.is_empty() => {
            format!("got {} bytes", id.len())
        }
        None => format!("{id:?} names a directory"),
    };
    Err(ErrorObject::new(
        INVALID_PARAMS,
        format!(
            "sessionId must be 1 to {MAX_SESSION_ID_BYTES} characters of A-Z, a-z, 0-9, '.', \
             '_' and '-' (the SDK's own UUIDs are), and not '.' or '..'; {got}"
        ),
    ))
}

/// The error the runtime gives for a session it does not hold, so an SDK reacts as it would.
pub(super) fn session_not_found(method: &str, id: &str) -> CallError {
    ErrorObject::new(
        INTERNAL_ERROR,
        format!(
            "Request {method} failed with message: Session not found for sessionId: {id} \
             (copilot-pool: create or resume it on this connection first)"
        ),
    )
}

/// The error for a session this agent has no stored state of (a resume of an unknown id,
/// a call after its delete), in the runtime's words, with the pool's reasons.
pub(super) fn no_stored_session(method: &str, id: &str) -> CallError {
    ErrorObject::new(
        INTERNAL_ERROR,
        format!(
            "Request {method} failed with message: Session not found for sessionId: {id} \
             (copilot-pool: this agent has no stored session with this id: it was deleted, \
             never created, or created with another agent's token; create it with \
             session.create)"
        ),
    )
}

/// A pool error as the client sees it: the runtime's message shape, the pool's words, and
/// the error's kind in `data`.
///
/// In the SDK's terms where the pool's own would not fit: a refused request (kind
/// `invalid`) is `INVALID_PARAMS`, an invalid lease request with the refusal alone (not the
/// library's "invalid lease request"), a
/// session with no credentials names the SDK's session options (not the HTTP API's fields),
/// and a pool shutting down says so as a drain does.
pub(super) fn pool_error(method: &str, error: &PoolError) -> CallError {
    let (code, said) = match error {
        PoolError::InvalidRequest(why) => (INVALID_PARAMS, why.clone()),
        PoolError::Auth(crate::auth::AuthError::NoCredentials) => (
            INVALID_PARAMS,
            "no GitHub credentials for this session: it carries no gitHubToken and no BYOK \
             provider, and the daemon gives none. Create the session with a provider \
             (Node `provider: {...}`, Python `provider={...}`) or a gitHubToken; or, on the \
             daemon, turn on `[auth] env_fallback = true` with a token variable in its \
             environment, or `[auth] allow_logged_in_user = true`"
                .to_owned(),
        ),
        PoolError::AgentConversationsFull { max } => (
            super::connection::CONVERSATION_LIMIT,
            format!(
                "this agent already keeps or is opening {max} sessions \
                 (max_conversations_per_agent on the daemon); delete one it no longer needs \
                 (deleteSession; listSessions shows them) and open this one again"
            ),
        ),
        PoolError::Closed => (
            INTERNAL_ERROR,
            "copilot-pool is shutting down; connect to another replica or retry after the \
             restart"
                .to_owned(),
        ),
        // Refused for the caller's input (a sandbox that cannot hold its directory, an
        // agent id or path it gave, other auth it sent): invalid params too.
        other if other.kind() == crate::kinds::ErrorKind::Invalid => {
            (INVALID_PARAMS, other.to_string())
        }
        other => (INTERNAL_ERROR, other.to_string()),
    };
    ErrorObject {
        code,
        message: format!("Request {method} failed with message: {said}"),
        data: Some(json!({"kind": error.kind().rejection_label()})),
    }
}

/// A worker error as the client sees it.
pub(super) fn worker_error(method: &str, error: &WorkerError) -> CallError {
    match error {
        // The runtime's own answer goes back as it was.
        WorkerError::Rpc(crate::rpc::RpcError::Remote { error, .. }) => error.clone(),
        other => ErrorObject::new(
            INTERNAL_ERROR,
            format!("Request {method} failed with message: {other}"),
        ),
    }
}

/// The directories a `session.create`, `session.resume` or `session.options.update` names,
/// confined as the HTTP API confines a conversation's: inside the agent's work directory or
/// one of [`SdkConfig::allowed_work_roots`](super::SdkConfig::allowed_work_roots) (symlinks
/// and `..` resolved), and passed on as resolved. Without a sandbox nothing else would keep
/// one agent's session out of another agent's directory.
pub(super) async fn confine_directories(
    shared: &Shared,
    agent: &str,
    method: &str,
    params: Value,
) -> Result<Value, CallError> {
    if !params
        .as_object()
        .is_some_and(crate::confine::names_directories)
    {
        return Ok(params);
    }
    confined(shared, agent, method, params, |fields, roots| {
        crate::confine::confine_session_directories(fields, "", roots)
    })
    .await
}

/// The local paths a `session.send`'s attachments name, confined as the HTTP API confines a
/// turn's (inside the agent's work directory or one of the allowed roots; absolute, since the
/// session's directory may have moved since the pool last saw it) and passed on as resolved.
/// A send with no attachment by path is passed on untouched, without a hop to the blocking
/// threads.
pub(super) async fn confine_attachments(
    shared: &Shared,
    agent: &str,
    params: Value,
) -> Result<Value, CallError> {
    let names_any = match params.get("attachments") {
        None | Some(Value::Null) => false,
        Some(Value::Array(list)) => !list.is_empty(),
        // Refused for its shape below.
        Some(_) => true,
    };
    if !names_any {
        return Ok(params);
    }
    confined(
        shared,
        agent,
        "session.send",
        params,
        crate::confine::confine_attachment_paths,
    )
    .await
}

/// `params` with `confine` applied to its fields under the agent's roots (its work directory
/// and the allowed roots), off the async threads (resolving paths is file work); a refusal is
/// `method`'s invalid-params error naming the field.
async fn confined(
    shared: &Shared,
    agent: &str,
    method: &str,
    mut params: Value,
    confine: impl FnOnce(
        &mut serde_json::Map<String, Value>,
        &[PathBuf],
    ) -> Result<(), crate::confine::ConfineError>
    + Send
    + 'static,
) -> Result<Value, CallError> {
    let work = crate::home::work_dir(&shared.pool.config().agents_base_dir, agent)
        .map_err(|e| pool_error(method, &PoolError::from(e)))?;
    let roots = crate::home::conversation_roots(work, &shared.config.allowed_work_roots);
    let method_name = method.to_owned();
    tokio::task::spawn_blocking(move || {
        if let Some(fields) = params.as_object_mut() {
            confine(fields, &roots).map_err(|e| {
                ErrorObject::new(
                    INVALID_PARAMS,
                    format!("Request {method_name} failed with message: {e}"),
                )
            })?;
        }
        Ok(params)
    })
    .await
    .map_err(|e| pool_error(method, &PoolError::Internal(e.to_string())))?
}

/// `session.create`/`session.resume` params.
#[derive(Clone, Debug)]
pub(super) struct SessionSpec {
    /// The SDK's session id, which is also the CLI session id.
    pub(super) id: CliSessionId,
    /// The params as the client sent them (the id removed), passed on as they are.
    wire: SessionConfig,
    provider: Option<ProviderConfig>,
    model: Option<String>,
    working_directory: PathBuf,
    auth: LeaseAuth,
}

impl SessionSpec {
    /// Reads the params of `session.create`/`session.resume`. The SDK always sends its own
    /// `sessionId`; the provider and the session-level `gitHubToken` choose the processes.
    pub(super) fn from_params(method: &str, params: &Value) -> Result<SessionSpec, CallError> {
        let Some(mut map) = params.as_object().cloned() else {
            return Err(ErrorObject::new(INVALID_PARAMS, "params must be an object"));
        };
        // Fields that would bypass the pool (other model endpoints, host code, the agent's
        // home) and those no SDK sends. (`provider` itself is the session's own, guarded,
        // below.)
        fields::check_open(&map)
            .map_err(|refusal| ErrorObject::new(INVALID_PARAMS, refusal.message(method)))?;
        let id = match map.remove("sessionId") {
            Some(Value::String(id)) => id,
            _ => {
                return Err(ErrorObject::new(
                    INVALID_PARAMS,
                    "sessionId is required: copilot-pool runs a session under the id its \
                     client chose (cloud sessions with server-made ids are not supported)",
                ));
            }
        };
        validate_session_id(&id)?;
        let provider = match map.get("provider") {
            None | Some(Value::Null) => None,
            Some(raw) => {
                let provider: ProviderConfig =
                    serde_json::from_value(raw.clone()).map_err(|e| {
                        let e = crate::secret::json_error_without_values(&e);
                        ErrorObject::new(INVALID_PARAMS, format!("provider: {e}"))
                    })?;
                crate::pool::validate_provider(&provider)
                    .map_err(|e| ErrorObject::new(INVALID_PARAMS, e.to_string()))?;
                Some(provider)
            }
        };
        let model = map.get("model").and_then(Value::as_str).map(str::to_owned);
        let working_directory = map
            .get("workingDirectory")
            .and_then(Value::as_str)
            .map(PathBuf::from)
            .unwrap_or_default();
        let token = match map.remove("gitHubToken") {
            Some(Value::String(token)) if !token.is_empty() => Some(Secret::new(token)),
            _ => None,
        };
        let auth = match &token {
            // A session's own identity: its processes are its token's (one profile per
            // token; the fingerprint, never the token, names it).
            Some(token) => LeaseAuth {
                github_token: Some(token.clone()),
                profile_id: Some(format!("sdk-session-{}", fingerprint(token.expose()))),
                profile_version: Some("1".to_owned()),
                ..Default::default()
            },
            None => LeaseAuth::default(),
        };
        let flag = |map: &mut Map<String, Value>, name: &str| {
            map.remove(name).and_then(|v| v.as_bool()).unwrap_or(false)
        };
        let request_permission = flag(&mut map, "requestPermission");
        let request_user_input = flag(&mut map, "requestUserInput");
        let hooks = flag(&mut map, "hooks");
        let streaming = flag(&mut map, "streaming");
        let continue_pending_work = map.remove("continuePendingWork").and_then(|v| v.as_bool());
        // Everything else goes on the wire as the client wrote it: the typed fields left
        // unset are not serialized, so no field appears twice.
        let wire = SessionConfig {
            git_hub_token: token,
            request_permission,
            request_user_input,
            hooks,
            streaming,
            continue_pending_work,
            extra: map,
            ..Default::default()
        };
        Ok(SessionSpec {
            id: CliSessionId::new(id),
            wire,
            provider,
            model,
            working_directory,
            auth,
        })
    }

    /// A spec for a session this connection never opened (to delete it): no config of its
    /// own, so it is resumed as stored.
    pub(super) fn bare(id: &str) -> Result<SessionSpec, CallError> {
        SessionSpec::from_params("session.delete", &json!({"sessionId": id}))
    }

    fn lease_request(&self, shared: &Shared, agent: &str, existing_only: bool) -> LeaseRequest {
        let mut req = LeaseRequest::new(
            agent,
            format!("{SESSION_KEY_PREFIX}{}", self.id),
            self.working_directory.clone(),
        );
        req.auth = self.auth.clone();
        req.auth.forbid_logged_in_user = !shared.config.allow_logged_in_user;
        req.provider = self.provider.clone();
        req.model = self.model.clone();
        req.streaming = self.wire.streaming;
        req.wait_timeout = shared.config.wait_timeout;
        req.existing_only = existing_only;
        req.wire_config = Some(self.wire.clone());
        req.cli_session_id = Some(self.id.clone());
        req
    }
}

/// What becomes of a turn's lease when the turn is over.
enum After {
    /// Parked on its process for the next turn.
    Park,
    /// Its process is gone: what is left is detached.
    Lost,
    /// Aborted without settling: its process is stopped.
    Unsettled,
}

/// A turn in flight: where calls made during it go, and how to stop it.
struct RunningTurn {
    worker: WorkerHandle,
    answerer: Answerer,
    /// Set to ask the pump to abort the turn and settle it (client gone, session detached).
    stop: watch::Sender<bool>,
    /// Becomes true when the pump has given the lease back.
    done: watch::Receiver<bool>,
}

/// One SDK session opened on one client connection.
pub(super) struct SdkSession {
    shared: Arc<Shared>,
    agent: String,
    /// The session's id (its spec's, which a resume on this connection never changes).
    id: CliSessionId,
    /// Shared, not copied, by each call that reads it: it holds the client's whole config
    /// (tool schemas, system message), read for every lease.
    spec: Mutex<Arc<SessionSpec>>,
    /// The client's connection: events and server requests go there, and only there.
    client: Connection,
    turn: Mutex<Option<RunningTurn>>,
    /// Set, under the `turn` lock, once the session's turns were stopped for good (its
    /// client left, it was detached or deleted): a turn whose send was already on its way
    /// then starts stopped, aborted at once, instead of running with nobody to stop it.
    stopped: std::sync::atomic::AtomicBool,
    /// Set when the client asked to abort the running turn (`session.abort`), cleared as a
    /// turn starts: an aborted turn it did not ask for is explained to it.
    abort_asked: std::sync::atomic::AtomicBool,
    /// Prompts sent into the running turn (`session.send` while one runs goes to its
    /// process): their count since the pump last looked, and how many still wait for the
    /// runtime's answer. One may land as the runtime ends the turn, and start a turn of its
    /// own after the `session.idle` ([`SdkSession::runs_on`]).
    sent_into_turn: SentIntoTurn,
    /// Serializes what takes a lease for this session on this connection (an open holds
    /// it until its events are passed on, after its answer: [`AfterOpen`]).
    gate: Arc<tokio::sync::Mutex<()>>,
    /// The agent's work directory, once created (for a session that names no
    /// `workingDirectory`): created on its first lease, not on every call.
    work_dir: tokio::sync::OnceCell<PathBuf>,
    /// The client's last `session.model.switchTo` (its params) and the process that took it:
    /// the runtime's `session.resume` selects the model the session was created with
    /// (measured, 1.0.14: whatever the resume's own `model`), so a lease on another process
    /// applies the switch again before anything else.
    switched_model: Mutex<Option<(Value, u32)>>,
    /// The client's `session.options.update`s, merged (a later value of a field replaces an
    /// earlier one), and the process that took the last: a `session.resume` applies the
    /// config the session was created with, so a lease on another process applies them
    /// again, as the model switch.
    updated_options: Mutex<Option<(Value, u32)>>,
}

/// What an open passes on once its answer is out: the runtime answers `session.create` /
/// `session.resume` before it emits the open's own events (`session.start`,
/// `session.resume`, then what it loaded; measured on the runtime 1.0.14), and an SDK
/// client registers its handlers when the call returns, so here too they follow the
/// answer. The session's gate stays held until they are passed on: no call of the session
/// gets in between.
pub(super) struct AfterOpen {
    session: Arc<SdkSession>,
    updates: Vec<SessionUpdate>,
    /// Held while the open's own event is still to come (the runtime opened the session
    /// and its `session.start`/`session.resume` was not read with the answer).
    lease: Option<Lease>,
    _gate: tokio::sync::OwnedMutexGuard<()>,
}

/// How long a late open event is waited for after the answer (the runtime sends it at
/// once: 0.2-4 ms after its answer, measured through the Node SDK on 1.0.14).
const OPEN_EVENT_WAIT: Duration = Duration::from_secs(2);

/// Whether `update` is the event of a session's open.
fn is_open_event(update: &SessionUpdate) -> bool {
    matches!(
        update,
        SessionUpdate::Event(event)
            if matches!(event.kind, EventKind::SessionStart(_) | EventKind::SessionResume(_))
    )
}

impl AfterOpen {
    /// Passes the open's events on (call it once the answer is written), the open's own
    /// event included when it comes after the answer (within [`OPEN_EVENT_WAIT`]; what else
    /// reaches the session meanwhile is passed on too).
    pub(super) async fn forward(self) {
        let AfterOpen {
            session,
            updates,
            lease,
            _gate,
        } = self;
        for update in updates {
            session.forward_update(update);
        }
        let Some(mut lease) = lease else {
            return;
        };
        let Ok(opened) = lease.passthrough() else {
            return;
        };
        let deadline = tokio::time::Instant::now() + OPEN_EVENT_WAIT;
        while let Ok(Some(update)) = tokio::time::timeout_at(deadline, opened.next()).await {
            let done = is_open_event(&update);
            session.forward_update(update);
            if done {
                return;
            }
        }
    }
}

impl SdkSession {
    pub(super) fn new(
        shared: Arc<Shared>,
        agent: String,
        spec: SessionSpec,
        client: Connection,
    ) -> Self {
        Self {
            shared,
            agent,
            id: spec.id.clone(),
            spec: Mutex::new(Arc::new(spec)),
            client,
            turn: Mutex::new(None),
            stopped: std::sync::atomic::AtomicBool::new(false),
            abort_asked: std::sync::atomic::AtomicBool::new(false),
            sent_into_turn: SentIntoTurn::default(),
            gate: Arc::new(tokio::sync::Mutex::new(())),
            work_dir: tokio::sync::OnceCell::new(),
            switched_model: Mutex::new(None),
            updated_options: Mutex::new(None),
        }
    }

    pub(super) fn id(&self) -> CliSessionId {
        self.id.clone()
    }

    /// The pool's conversation of this session.
    pub(super) fn conversation(&self) -> ConversationId {
        conversation(&self.agent, self.id().as_str())
    }

    fn spec(&self) -> Arc<SessionSpec> {
        self.spec
            .lock()
            .map(|s| s.clone())
            .unwrap_or_else(|p| p.into_inner().clone())
    }

    fn running(&self) -> Option<(WorkerHandle, Answerer)> {
        self.turn
            .lock()
            .ok()
            .and_then(|t| t.as_ref().map(|t| (t.worker.clone(), t.answerer.clone())))
    }

    async fn lease(&self, method: &str, existing_only: bool) -> Result<Lease, CallError> {
        self.lease_for(method, existing_only, false).await
    }

    /// [`SdkSession::lease`], or with `to_delete` a lease only for deleting the session
    /// ([`crate::Pool::lease_to_delete`]: no credentials of its own needed).
    async fn lease_for(
        &self,
        method: &str,
        existing_only: bool,
        to_delete: bool,
    ) -> Result<Lease, CallError> {
        let mut req = self
            .spec()
            .lease_request(&self.shared, &self.agent, existing_only);
        if req.working_directory.as_os_str().is_empty() {
            // No directory of its own: the agent's work directory, as an HTTP turn gets (the
            // one a sandboxed worker may write), created off the async threads.
            let dir = self
                .work_dir
                .get_or_try_init(|| async {
                    let base = self.shared.pool.config().agents_base_dir.clone();
                    let agent = self.agent.clone();
                    tokio::task::spawn_blocking(move || {
                        let dir = crate::home::work_dir(&base, &agent)?;
                        crate::home::create_work_dir(&dir)?;
                        Ok::<_, crate::home::HomeError>(dir)
                    })
                    .await
                    .map_err(|e| pool_error(method, &PoolError::Internal(e.to_string())))?
                    .map_err(|e| pool_error(method, &PoolError::from(e)))
                })
                .await?;
            req.working_directory = dir.clone();
        }
        let leased = if to_delete {
            self.shared.pool.lease_to_delete(req).await
        } else {
            self.shared.pool.lease(req).await
        };
        // Stored, but its resumes crashed the runtime (`ResumeCrashedRepeatedly`): said as it
        // is, with when to retry.
        let mut lease = leased.map_err(|e| match e {
            PoolError::NoSuchConversation { .. } => no_stored_session(method, self.id().as_str()),
            other => pool_error(method, &other),
        })?;
        self.reapply(
            &mut lease,
            &self.switched_model,
            SWITCH_MODEL,
            "model switch",
        )
        .await;
        self.reapply(
            &mut lease,
            &self.updated_options,
            UPDATE_OPTIONS,
            "settings update",
        )
        .await;
        Ok(lease)
    }

    /// A lease on another process than the one that took the client's model switch or
    /// settings update (`setting`: its params and that process; a resume after a crash,
    /// recycling, a rotation, or a spare's resume ahead), or one that resumed the session on
    /// the same process: it is applied again with `method`, so the session keeps what its
    /// client chose.
    async fn reapply(
        &self,
        lease: &mut Lease,
        setting: &Mutex<Option<(Value, u32)>>,
        method: &str,
        what: &str,
    ) {
        let pid = lease.worker_pid();
        // Resumed here, on the same process too, the session has its create-time config.
        let resumed = lease.reason() == OpenReason::Resumed;
        let again = match setting.lock() {
            Ok(set) => set
                .as_ref()
                .filter(|(_, on)| *on != pid || resumed)
                .cloned(),
            Err(_) => None,
        };
        let Some((params, _)) = again else {
            return;
        };
        let Ok(session) = lease.passthrough() else {
            return;
        };
        let worker = session.worker().clone();
        let timeout = self.shared.config.request_timeout;
        match call(&worker, method, params.clone(), timeout).await {
            Ok(_) => {
                if let Ok(mut set) = setting.lock() {
                    *set = Some((params, pid));
                }
            }
            Err(error) => tracing::warn!(
                session = %self.id(),
                error = %error.message,
                "Could not apply the client's {what} again on the process the session moved \
                 to; it runs with the config it was created with."
            ),
        }
    }

    /// `session.options.update`: passed on as any call, then merged into the updates
    /// remembered with the process that took it ([`Self::reapply`]).
    pub(super) async fn update_options(&self, params: Value) -> Result<Value, CallError> {
        let (answer, pid) = self.call_on(UPDATE_OPTIONS, params.clone()).await?;
        if let Ok(mut updated) = self.updated_options.lock() {
            let mut merged = match updated.take() {
                Some((Value::Object(merged), _)) => merged,
                _ => Map::new(),
            };
            if let Value::Object(fields) = params {
                merged.extend(fields);
            }
            *updated = Some((Value::Object(merged), pid));
        }
        Ok(answer)
    }

    /// `session.model.switchTo`: passed on as any call, then remembered with the process
    /// that took it ([`Self::reapply`]).
    pub(super) async fn switch_model(&self, params: Value) -> Result<Value, CallError> {
        let (answer, pid) = self.call_on(SWITCH_MODEL, params.clone()).await?;
        if let Ok(mut switched) = self.switched_model.lock() {
            *switched = Some((params, pid));
        }
        Ok(answer)
    }

    /// `session.create` / `session.resume`: opens the session through the pool (creating
    /// it under the SDK's id, or resuming its stored state) and answers with the runtime's
    /// own answer. The events of the open follow the answer ([`AfterOpen::forward`]), as
    /// the runtime sends them.
    pub(super) async fn open(
        self: &Arc<Self>,
        method: &str,
        resume: bool,
    ) -> Result<(Value, AfterOpen), CallError> {
        let gate = self.gate.clone().lock_owned().await;
        let mut lease = self.lease(method, resume).await?;
        let opened_now = lease.reason() != OpenReason::Attached;
        let session = lease.passthrough().map_err(|e| pool_error(method, &e))?;
        let updates: Vec<SessionUpdate> = std::iter::from_fn(|| session.try_next()).collect();
        let answer = match session.opened() {
            Some(opened) => serde_json::to_value(opened).unwrap_or(Value::Null),
            None => json!({"sessionId": self.id().as_str()}),
        };
        // The runtime opened the session for this call: its own event follows the answer
        // on the runtime's output, usually read with it, and otherwise waited for.
        let late = opened_now && !updates.iter().any(is_open_event);
        let after = AfterOpen {
            session: self.clone(),
            updates,
            lease: late.then_some(lease),
            _gate: gate,
        };
        Ok((answer, after))
    }

    /// Replaces the session's config (a `session.resume` on a session this connection
    /// already holds).
    /// The client's config replaces what it switched or updated since the earlier open too:
    /// none of it is applied again over the config it resumes with.
    pub(super) fn set_spec(&self, spec: SessionSpec) {
        if let Ok(mut s) = self.spec.lock() {
            *s = Arc::new(spec);
        }
        for setting in [&self.switched_model, &self.updated_options] {
            if let Ok(mut set) = setting.lock() {
                *set = None;
            }
        }
    }

    /// `session.send`: leases the session (resuming it on a fresh process if its process
    /// died), sends the prompt, answers with the runtime's answer and passes the turn's
    /// events to the client until `session.idle`. A send during a running turn goes to the
    /// same process (the runtime queues it).
    pub(super) async fn send(self: &Arc<Self>, params: Value) -> Result<Value, CallError> {
        const METHOD: &str = "session.send";
        refuse_unguarded_call(METHOD, &params)?;
        self.refuse_if_let_go(METHOD)?;
        if let Some((worker, sending)) = self.sending_into_turn() {
            return self.send_into_turn(&worker, sending, params).await;
        }
        let _gate = self.gate.lock().await;
        self.refuse_if_let_go(METHOD)?;
        if let Some((worker, sending)) = self.sending_into_turn() {
            return self.send_into_turn(&worker, sending, params).await;
        }
        if self.shared.is_draining() {
            return Err(ErrorObject::new(
                INTERNAL_ERROR,
                "Request session.send failed with message: copilot-pool is draining (shutting \
                 down); no new turns start. Reconnect to another replica or retry after the \
                 restart",
            ));
        }
        let mut lease = self.lease(METHOD, false).await?;
        // Let go while the lease was waited for: the prompt is not sent at all.
        self.refuse_if_let_go(METHOD)?;
        let session = lease.passthrough().map_err(|e| pool_error(METHOD, &e))?;
        self.forward_waiting(session);
        let worker = session.worker().clone();
        let answerer = session.answerer();
        let answer = match call(&worker, METHOD, params, self.shared.config.request_timeout).await {
            Ok(answer) => answer,
            Err(error) => {
                if !session.is_alive() {
                    lease.set_lost();
                }
                return Err(error);
            }
        };
        let (stop_tx, stop_rx) = watch::channel(false);
        let (done_tx, done_rx) = watch::channel(false);
        if let Ok(mut turn) = self.turn.lock() {
            if self.stopped.load(std::sync::atomic::Ordering::SeqCst) {
                let _ = stop_tx.send(true);
            }
            self.abort_asked
                .store(false, std::sync::atomic::Ordering::SeqCst);
            *turn = Some(RunningTurn {
                worker,
                answerer,
                stop: stop_tx,
                done: done_rx,
            });
        }
        self.shared.turn_started();
        let me = self.clone();
        tokio::spawn(async move {
            // The pump clears the running turn itself, before the client can hear the turn
            // ended and before the lease goes back.
            me.pump(lease, stop_rx).await;
            let _ = done_tx.send(true);
            me.shared.turn_ended();
        });
        Ok(answer)
    }

    /// The running turn's process, with a send into it counted, under the `turn` lock (the
    /// pump ends a turn under it too: a send either is counted before the pump looks, or
    /// finds no turn and takes a lease of its own).
    fn sending_into_turn(&self) -> Option<(WorkerHandle, SendingIntoTurn<'_>)> {
        let turn = self.turn.lock().ok()?;
        let worker = turn.as_ref()?.worker.clone();
        Some((worker, self.sent_into_turn.sending()))
    }

    /// A prompt sent while a turn runs: to its process (the runtime queues it, or, when it
    /// lands as the turn ends, starts a turn with it), counted for the pump until answered.
    async fn send_into_turn(
        &self,
        worker: &WorkerHandle,
        _sending: SendingIntoTurn<'_>,
        params: Value,
    ) -> Result<Value, CallError> {
        call(
            worker,
            "session.send",
            params,
            self.shared.config.request_timeout,
        )
        .await
    }

    /// Ends the running turn at the `session.idle` the pump just read, unless the runtime
    /// runs on: a prompt sent into the turn may have reached it after it ended the turn, and
    /// started one. Whether any was sent is read, and the turn cleared when none was, under
    /// the `turn` lock; when some were, once they have their answers the runtime is asked
    /// (`session.metadata.isProcessing`; a runtime that cannot say within `ASK_LIMIT` counts
    /// as done), and asked again for any sent meanwhile. True when the turn ended.
    async fn turn_ends_here(&self, worker: &WorkerHandle) -> bool {
        loop {
            {
                let Ok(mut turn) = self.turn.lock() else {
                    return true;
                };
                if !self.sent_into_turn.take() {
                    *turn = None;
                    return true;
                }
            }
            let _ = tokio::time::timeout(ASK_LIMIT, self.sent_into_turn.answered()).await;
            let asked = call(
                worker,
                IS_PROCESSING,
                json!({"sessionId": self.id().as_str()}),
                ASK_LIMIT,
            )
            .await;
            if asked.is_ok_and(|answer| answer["processing"] == Value::Bool(true)) {
                return false;
            }
        }
    }

    /// Passes the running turn's updates to the client until `session.idle`; ends it with a
    /// `session.error` and `session.idle` of its own when the process dies; aborts and
    /// settles it when asked to stop or when it outlives the turn limit. Gives the lease back.
    async fn pump(&self, mut lease: Lease, mut stop: watch::Receiver<bool>) {
        let mut started = Instant::now();
        // Turns this lease ran before its last (a prompt sent into one as it ended).
        let mut lease_turns = 0;
        let limit = tokio::time::sleep(self.shared.config.max_turn_duration);
        let mut limit = std::pin::pin!(limit);
        let settle_limit = self.shared.pool.config().abort_settle_timeout;
        let mut failed = false;
        // Set when the limit, not the turn's own end, stopped it (the deadline may pass while
        // a turn's last events are read: that is no limit).
        let mut past_limit = false;
        let Ok(session) = lease.passthrough() else {
            return;
        };
        let (end, after) = loop {
            let next = tokio::select! {
                update = session.next() => Ok(update),
                _ = stop.wait_for(|s| *s) => Err("stopped"),
                () = limit.as_mut() => {
                    past_limit = true;
                    Err("turn limit")
                }
            };
            let update = match next {
                Ok(update) => update,
                Err(why) => break self.settle(session, settle_limit, why).await,
            };
            match update {
                Some(SessionUpdate::Event(event)) => {
                    let idle = match &event.kind {
                        EventKind::SessionIdle(idle) => Some(idle.aborted == Some(true)),
                        EventKind::SessionError(_) => {
                            failed = true;
                            None
                        }
                        _ => None,
                    };
                    // The client may send the next prompt as soon as it sees the idle: that
                    // send must take a new lease (queued behind this one's return), not join
                    // a turn that is over on a process it may be leaving. Unless a prompt sent
                    // into the turn as it ended started the next one: its events are this
                    // lease's to pass on, to its own idle, a turn of its own.
                    if idle.is_some() && !self.turn_ends_here(session.worker()).await {
                        self.forward_event(event);
                        lease_turns += 1;
                        crate::metrics::turn_finished(
                            if idle == Some(true) {
                                TurnEnd::Aborted
                            } else {
                                TurnEnd::Idle
                            },
                            started.elapsed(),
                        );
                        started = Instant::now();
                        limit.as_mut().reset(
                            tokio::time::Instant::now() + self.shared.config.max_turn_duration,
                        );
                        failed = false;
                        continue;
                    }
                    if idle == Some(true) && self.aborted_by_the_drain() {
                        self.notify_event(synthetic_event(
                            "session.error",
                            json!({"errorType": SHUTDOWN, "message": SHUT_DOWN_MESSAGE}),
                        ));
                    }
                    self.forward_event(event);
                    if let Some(aborted) = idle {
                        let end = if aborted {
                            TurnEnd::Aborted
                        } else if failed {
                            TurnEnd::Error
                        } else {
                            TurnEnd::Idle
                        };
                        break (end, After::Park);
                    }
                }
                Some(SessionUpdate::Ended(error)) => {
                    self.clear_turn();
                    self.crashed(&error);
                    break (TurnEnd::Crashed, After::Lost);
                }
                None => {
                    self.clear_turn();
                    self.crashed(&WorkerError::Stopped);
                    break (TurnEnd::Crashed, After::Lost);
                }
                Some(other) => self.forward_update(other),
            }
        };
        for _ in 0..lease_turns {
            lease.turn_passed();
        }
        match after {
            After::Park => lease.turn_passed(),
            After::Lost => lease.set_lost(),
            After::Unsettled => lease.set_unsettled(),
        }
        crate::metrics::turn_finished(end, started.elapsed());
        // No new turn can have started yet: it needs this lease.
        self.clear_turn();
        if past_limit {
            // The settle read the aborted turn's own events: the client, still there, hears
            // why its turn ended (once cleared: a send after the idle takes a lease of its own).
            self.past_limit(started.elapsed());
        }
        drop(lease);
    }

    /// Whether an aborted turn was aborted by the daemon's shutdown: the endpoint drains, and
    /// the client did not ask for the abort (the pool aborts what still runs at the end of
    /// the drain grace).
    fn aborted_by_the_drain(&self) -> bool {
        self.shared.is_draining() && !self.abort_asked.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// The turn ran past `max_turn_duration` and was aborted: the client gets a
    /// `session.error` saying so, then `session.idle`, so its `sendAndWait` ends now.
    fn past_limit(&self, ran: Duration) {
        let limit = self.shared.config.max_turn_duration;
        let message = format!(
            "copilot-pool aborted this turn after {ran:.1?}: it ran past the limit of \
             {limit:?} a turn may run ([turns] absolute_secs in copilot-pool serve's config, \
             SdkConfig::max_turn_duration in the library); split the work into shorter turns, \
             or raise the limit"
        );
        self.end_turn_with(TURN_LIMIT, message, true);
    }

    /// Tells the client its turn ended with `error_type`: a `session.error`, then the
    /// `session.idle` that ends its `sendAndWait`.
    fn end_turn_with(&self, error_type: &str, message: String, aborted: bool) {
        self.notify_event(synthetic_event(
            "session.error",
            json!({"errorType": error_type, "message": message}),
        ));
        let idle = if aborted {
            json!({"aborted": true})
        } else {
            json!({})
        };
        self.notify_event(synthetic_event("session.idle", idle));
    }

    /// The running turn is over: later calls take a lease of their own.
    fn clear_turn(&self) {
        if let Ok(mut turn) = self.turn.lock() {
            *turn = None;
        }
    }

    /// Aborts the running turn and reads it to `session.idle` (passing nothing on: the
    /// client is gone or let go of the session). A turn that does not settle stops its
    /// process when the lease is given back.
    async fn settle(&self, session: &mut Session, limit: Duration, why: &str) -> (TurnEnd, After) {
        tracing::info!(session = %self.id(), why, "Aborting an SDK turn.");
        let after = match session.abort_and_settle(limit).await {
            Settled::Idle => After::Park,
            Settled::WorkerEnded => After::Lost,
            Settled::Unsettled => {
                tracing::warn!(session = %self.id(), why, "An aborted SDK turn did not settle; its process is stopped.");
                After::Unsettled
            }
        };
        (TurnEnd::Aborted, after)
    }

    /// The process died during the turn: the client gets a `session.error` saying so, then
    /// `session.idle`, so its `sendAndWait` ends now. The next call resumes the session.
    fn crashed(&self, error: &WorkerError) {
        tracing::warn!(session = %self.id(), %error, "The process of an SDK session died mid-turn; the next call resumes it on a fresh process.");
        let message = format!(
            "The Copilot runtime process running this session died ({error}). copilot-pool \
             resumes the session on a fresh process at the next call; send again to go on."
        );
        self.end_turn_with(PROCESS_CRASHED, message, false);
    }

    /// Passes on what reached the session while no turn was pumped (late events of an
    /// earlier turn, notifications and requests of the runtime made between turns).
    fn forward_waiting(&self, session: &mut Session) {
        while let Some(update) = session.try_next() {
            self.forward_update(update);
        }
    }

    /// Passes one update to the client: events and notifications as they are, the runtime's
    /// requests for the client (`userInput.request`, `hooks.invoke`, `exitPlanMode.request`,
    /// `providerToken.getToken`, …) with their answers back to the process.
    fn forward_update(&self, update: SessionUpdate) {
        match update {
            SessionUpdate::Event(event) => self.forward_event(event),
            SessionUpdate::UserInput(request) => {
                self.forward_typed("userInput.request", request);
            }
            SessionUpdate::Hook(request) => self.forward_typed("hooks.invoke", request),
            SessionUpdate::Request(request) => {
                let method = request.params.method.clone();
                let params = request.params.params.clone();
                self.ask_client(method, params, request);
            }
            SessionUpdate::Notification(call) => {
                if let Err(error) = self.client.notify(&call.method, call.params) {
                    tracing::debug!(%error, "An SDK client left before a notification reached it.");
                }
            }
            // The pump handles the end of the process; between turns it is seen at the
            // next lease.
            SessionUpdate::Ended(_) => {}
        }
    }

    /// Passes a runtime event on as it came (moved, not copied).
    fn forward_event(&self, event: SessionEvent) {
        self.notify_event(event.into_raw());
    }

    fn notify_event(&self, event: impl serde::Serialize) {
        #[derive(serde::Serialize)]
        #[serde(rename_all = "camelCase")]
        struct Params<'a, E> {
            session_id: &'a str,
            event: E,
        }
        let id = self.id();
        let params = Params {
            session_id: id.as_str(),
            event,
        };
        if let Err(error) = self.client.notify("session.event", params) {
            tracing::debug!(%error, "An SDK client left before an event reached it.");
        }
    }

    /// Asks the client a typed request of the runtime (`userInput.request`, `hooks.invoke`).
    fn forward_typed<P>(&self, method: &'static str, request: ServerRequest<P>)
    where
        P: serde::Serialize + Send + 'static,
    {
        match serde_json::to_value(&request.params) {
            Ok(params) => self.ask_client(method.to_owned(), params, request),
            Err(e) => request.fail(format!("could not encode {method}: {e}")),
        }
    }

    /// Asks the client a request of the runtime and passes its answer back (the client's own
    /// error as it is), in a task of its own; no answer within the limit is an error.
    fn ask_client<P>(&self, method: String, params: Value, request: ServerRequest<P>)
    where
        P: Send + 'static,
    {
        let client = self.client.clone();
        let limit = self.shared.config.client_request_timeout;
        tokio::spawn(async move {
            match client.request(&method, params, Some(limit)).await {
                Ok(answer) => request.respond(answer),
                Err(crate::rpc::RpcError::Remote { error, .. }) => request.fail_with(error),
                Err(error) => {
                    request.fail(format!("the SDK client did not answer {method}: {error}"))
                }
            }
        });
    }

    /// `session.abort`: passed to the process running the turn; without a turn there is
    /// nothing to abort.
    pub(super) async fn abort(&self, params: Value) -> Result<Value, CallError> {
        // Noted under the turn lock, for the turn it finds running (a turn started after it
        // clears the note under the same lock).
        let running = self.turn.lock().ok().and_then(|t| {
            t.as_ref().map(|t| {
                self.abort_asked
                    .store(true, std::sync::atomic::Ordering::SeqCst);
                t.worker.clone()
            })
        });
        match running {
            Some(worker) => {
                call(
                    &worker,
                    "session.abort",
                    params,
                    self.shared.config.request_timeout,
                )
                .await
            }
            None => Ok(json!({"success": true})),
        }
    }

    /// `session.tools.handlePendingToolCall`: checked against the process's ledger (the
    /// request must be pending for this session), then passed on.
    pub(super) async fn answer_tool(&self, params: &Value) -> Result<Value, CallError> {
        const METHOD: &str = "session.tools.handlePendingToolCall";
        let request_id = request_id(params)?;
        let result = tool_result(params)?;
        let Some((_, answerer)) = self.running() else {
            return Err(no_pending(METHOD, request_id));
        };
        answerer
            .answer_tool_call(request_id, result)
            .await
            .map(|()| json!({"success": true}))
            .map_err(|e| worker_error(METHOD, &e))
    }

    /// `session.permissions.handlePendingPermissionRequest`: checked against the ledger like
    /// a tool answer.
    pub(super) async fn answer_permission(&self, params: &Value) -> Result<Value, CallError> {
        const METHOD: &str = "session.permissions.handlePendingPermissionRequest";
        let request_id = request_id(params)?;
        let Some((_, answerer)) = self.running() else {
            return Err(no_pending(METHOD, request_id));
        };
        let decision = params.get("result").cloned().unwrap_or(Value::Null);
        answerer
            .answer_permission(request_id, decision)
            .await
            .map(|()| json!({"success": true}))
            .map_err(|e| worker_error(METHOD, &e))
    }

    /// Any other call on the session: to the process running its turn, or, between turns,
    /// to the process the pool leases it on for the call.
    pub(super) async fn call(&self, method: &str, params: Value) -> Result<Value, CallError> {
        self.call_on(method, params).await.map(|(answer, _)| answer)
    }

    /// [`Self::call`], with the pid of the process that answered.
    async fn call_on(&self, method: &str, params: Value) -> Result<(Value, u32), CallError> {
        refuse_unguarded_call(method, &params)?;
        self.refuse_if_let_go(method)?;
        let timeout = self.shared.config.request_timeout;
        if let Some((worker, _)) = self.running() {
            let pid = worker.pid();
            return call(&worker, method, params, timeout)
                .await
                .map(|a| (a, pid));
        }
        let _gate = self.gate.lock().await;
        self.refuse_if_let_go(method)?;
        if let Some((worker, _)) = self.running() {
            let pid = worker.pid();
            return call(&worker, method, params, timeout)
                .await
                .map(|a| (a, pid));
        }
        let mut lease = self.lease(method, true).await?;
        // Let go while the lease was waited for (another connection may hold the session by
        // now): neither the call nor the session's waiting events go anywhere.
        self.refuse_if_let_go(method)?;
        let pid = lease.worker_pid();
        let session = lease.passthrough().map_err(|e| pool_error(method, &e))?;
        self.forward_waiting(session);
        let worker = session.worker().clone();
        let answer = call(&worker, method, params, timeout).await;
        self.forward_waiting(session);
        if answer.is_err() && !session.is_alive() {
            lease.set_lost();
        }
        answer.map(|a| (a, pid))
    }

    /// A call that waited while the session was let go (detached, deleted, or its
    /// connection closed) is refused: the session is no longer this connection's.
    fn refuse_if_let_go(&self, method: &str) -> Result<(), CallError> {
        if !self.stopped.load(std::sync::atomic::Ordering::SeqCst) {
            return Ok(());
        }
        Err(ErrorObject::new(
            INTERNAL_ERROR,
            format!(
                "Request {method} failed with message: the session was let go (detached, \
                 deleted, or its connection closed) while this call waited for it; resume the \
                 session to call it again"
            ),
        ))
    }

    /// What a process lease of this session's key asks for (a call naming no session).
    pub(super) fn process_request(&self) -> LeaseRequest {
        self.spec().lease_request(&self.shared, &self.agent, true)
    }

    /// `session.delete`: ends a running turn, then deletes the session and its binding: with
    /// `by_id_alone` (a session its connection has not opened, known by its id alone)
    /// through a lease that needs none of its credentials, else through its own lease.
    pub(super) async fn delete(&self, by_id_alone: bool) -> Result<Value, CallError> {
        const METHOD: &str = "session.delete";
        self.stop_turn().await;
        let _gate = self.gate.lock().await;
        let lease = self.lease_for(METHOD, true, by_id_alone).await?;
        lease
            .reset()
            .await
            .map(|()| json!({"success": true}))
            .map_err(|e| pool_error(METHOD, &e))
    }

    /// Aborts and settles the running turn, if any, and waits until its lease is back
    /// (bounded by the settle limit and a margin).
    pub(super) async fn stop_turn(&self) {
        let done = match self.turn.lock() {
            Ok(turn) => {
                self.stopped
                    .store(true, std::sync::atomic::Ordering::SeqCst);
                turn.as_ref().map(|t| {
                    let _ = t.stop.send(true);
                    t.done.clone()
                })
            }
            Err(_) => None,
        };
        if let Some(mut done) = done {
            let limit = self.shared.pool.config().abort_settle_timeout + Duration::from_secs(5);
            let _ = tokio::time::timeout(limit, done.wait_for(|d| *d)).await;
        }
    }
}

/// The answer a `session.tools.handlePendingToolCall` gives: its `result` (a string or an
/// `ExternalToolResult` object), else its `error` (a string), else an empty result (what the
/// official SDKs send for a handler that returned nothing). A value of another type is
/// refused, not passed on as an empty success.
fn tool_result(params: &Value) -> Result<ToolResult, CallError> {
    let given = |name: &str| params.get(name).filter(|v| !v.is_null());
    let wrong = |name: &str, expected: &str, value: &Value| {
        ErrorObject::new(
            INVALID_PARAMS,
            format!(
                "session.tools.handlePendingToolCall: `{name}` must be {expected}, not {}; \
                 send the tool's output as a string (or an ExternalToolResult object), or its \
                 failure as `error`",
                crate::session_options::json_type(value)
            ),
        )
    };
    match (given("result"), given("error")) {
        (Some(Value::String(text)), _) => Ok(ToolResult::Text(text.clone())),
        (Some(object @ Value::Object(_)), _) => Ok(ToolResult::Object(object.clone())),
        (Some(other), _) => Err(wrong("result", "a string or an object", other)),
        (None, Some(Value::String(message))) => Ok(ToolResult::Error(message.clone())),
        (None, Some(other)) => Err(wrong("error", "a string", other)),
        (None, None) => Ok(ToolResult::Text(String::new())),
    }
}

/// What a process lease for a connection of `agent` with no session asks for: the agent's
/// home, no session credentials, no provider.
pub(super) fn connection_request(shared: &Shared, agent: &str) -> LeaseRequest {
    let mut req = LeaseRequest::new(agent, SESSION_KEY_PREFIX, PathBuf::new());
    req.auth.forbid_logged_in_user = !shared.config.allow_logged_in_user;
    req.wait_timeout = shared.config.wait_timeout;
    req
}

/// The pool conversation of an SDK session of `agent`.
pub(super) fn conversation(agent: &str, session_id: &str) -> ConversationId {
    ConversationId::new(agent, format!("{SESSION_KEY_PREFIX}{session_id}"))
}

/// Session calls that would change the session's model endpoint outside the guard:
/// `session.provider.add`, and `session.options.update` with a provider, an endpoint or a
/// bearer-token provider.
fn refuse_unguarded_call(method: &str, params: &Value) -> Result<(), CallError> {
    let refusal = match (method, params.as_object()) {
        ("session.provider.add", _) => Some(Refusal::Refused("providers")),
        ("session.options.update", Some(fields)) => fields::check_update(fields).err(),
        ("session.send", Some(fields)) => fields::check_send(fields).err(),
        _ => None,
    };
    match refusal {
        Some(refusal) => Err(ErrorObject::new(INVALID_PARAMS, refusal.message(method))),
        None => Ok(()),
    }
}

/// Passes a client's call to a process as it is.
async fn call(
    worker: &WorkerHandle,
    method: &str,
    params: Value,
    timeout: Duration,
) -> Result<Value, CallError> {
    worker
        .call_raw(method, params, timeout)
        .await
        .map_err(|e| worker_error(method, &e))
}

fn request_id(params: &Value) -> Result<&str, CallError> {
    params
        .get("requestId")
        .and_then(Value::as_str)
        .ok_or_else(|| ErrorObject::new(INVALID_PARAMS, "requestId (a string) is required"))
}

fn no_pending(method: &str, request_id: &str) -> CallError {
    ErrorObject::new(
        INTERNAL_ERROR,
        format!(
            "Request {method} failed with message: no request {request_id} is pending for this \
             session (no turn is running)"
        ),
    )
}

/// An event copilot-pool adds to a session's stream, in the runtime's envelope.
fn synthetic_event(event_type: &str, data: Value) -> Value {
    json!({
        "id": uuid::Uuid::new_v4().to_string(),
        "timestamp": humantime::format_rfc3339_millis(std::time::SystemTime::now()).to_string(),
        "parentId": null,
        "ephemeral": true,
        "type": event_type,
        "data": data,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pool_error_reaches_an_sdk_client_in_its_terms() {
        let said = |error: PoolError| pool_error("session.create", &error);
        // The caller's to fix: invalid params, the refusal alone.
        let refused = said(PoolError::InvalidRequest("provider.base_url: no".into()));
        assert_eq!(refused.code, INVALID_PARAMS);
        assert!(
            !refused.message.contains("invalid lease request"),
            "{refused:?}"
        );
        // No credentials: the SDK's session options, not the HTTP API's fields.
        let none = said(PoolError::Auth(crate::auth::AuthError::NoCredentials));
        assert_eq!(none.code, INVALID_PARAMS);
        assert!(
            none.message.contains("gitHubToken") && !none.message.contains("resolved_token"),
            "{none:?}"
        );
        // A pool shutting down says so, as a drain does.
        let closed = said(PoolError::Closed);
        assert_eq!(closed.code, INTERNAL_ERROR);
        assert!(
            closed.message.contains("shutting down") && !closed.message.contains("new pool"),
            "{closed:?}"
        );
        // The machine's fault is not the caller's.
        let machine = said(
            crate::sandbox::SandboxError::TempDir {
                path: "/agents/a/tmp".into(),
                source: std::io::Error::other("read-only file system"),
            }
            .into(),
        );
        assert_eq!(machine.code, INTERNAL_ERROR, "{machine:?}");
        // An agent at its conversation cap: the pool's own code, the SDK's way out.
        let full = said(PoolError::AgentConversationsFull { max: 3 });
        assert_eq!(full.code, super::super::connection::CONVERSATION_LIMIT);
        assert!(
            full.message.contains("deleteSession") && !full.message.contains("/v1/"),
            "{full:?}"
        );
        assert_eq!(
            full.data.as_ref().map(|d| d["kind"].clone()),
            Some(json!("agent_conversations_full"))
        );
    }

    #[test]
    fn an_sdk_session_id_is_a_plain_name_that_cannot_leave_the_home() {
        assert!(validate_session_id("0b9c6a4e-8f7e-4c43-9d7b-1f0e2a3b4c5d").is_ok());
        let long = "x".repeat(129);
        // The message says what is wrong with it.
        for (bad, says) in [
            ("", "got 0 bytes"),
            (".", "names a directory"),
            ("..", "names a directory"),
            ("a/b", "holds '/'"),
            ("../x", "holds '/'"),
            ("a b", "holds ' '"),
            (long.as_str(), "got 129 bytes"),
        ] {
            let refused = validate_session_id(bad).expect_err(bad);
            assert!(
                refused.message.contains(says),
                "{bad:?}: {}",
                refused.message
            );
        }
    }

    #[test]
    fn create_params_go_on_the_wire_as_sent_with_the_token_kept_secret() {
        let params = json!({
            "sessionId": "s-1",
            "model": "m",
            "provider": {"type": "openai", "baseUrl": "http://127.0.0.1:9/v1", "apiKey": "k-secret", "hasBearerTokenProvider": false, "modelId": "x"},
            "tools": [{"name": "t", "description": "d", "parameters": {}, "defer": "auto"}],
            "requestPermission": true,
            "streaming": true,
            "gitHubToken": "ghu_secret",
            "continuePendingWork": true,
            "infiniteSessions": {"enabled": false, "newField": 1},
        });
        let spec = SessionSpec::from_params("session.create", &params).unwrap();
        assert_eq!(spec.id.as_str(), "s-1");
        assert_eq!(spec.model.as_deref(), Some("m"));
        assert_eq!(
            spec.provider.as_ref().map(|p| p.base_url.as_str()),
            Some("http://127.0.0.1:9/v1")
        );
        let mut wire = serde_json::to_value(&spec.wire).unwrap();
        wire["sessionId"] = json!("s-1");
        // Every field the client sent is there once, unchanged (the fields inside them this
        // crate does not model included); the flags it left out are false.
        let mut expected = params.clone();
        expected["requestUserInput"] = json!(false);
        expected["hooks"] = json!(false);
        assert_eq!(wire, expected);
        let debug = format!("{:?}", spec.wire);
        assert!(
            !debug.contains("ghu_secret") && !debug.contains("k-secret"),
            "{debug}"
        );
        assert!(format!("{:?}", spec.auth).contains("sdk-session-sha256:"));
    }

    #[test]
    fn create_params_without_a_session_id_or_with_a_bad_provider_are_refused() {
        assert!(SessionSpec::from_params("session.create", &json!({"model": "m"})).is_err());
        let bad = SessionSpec::from_params(
            "session.create",
            &json!({"sessionId": "s", "provider": {"baseUrl": "file:///etc"}}),
        )
        .unwrap_err();
        assert!(bad.message.contains("base_url"), "{}", bad.message);
    }

    #[test]
    fn a_tool_answer_is_its_result_or_its_error_and_a_value_of_another_type_is_refused() {
        let answer = |params: Value| tool_result(&params).map_err(|e| e.message);
        assert!(matches!(answer(json!({"result": "42"})), Ok(ToolResult::Text(t)) if t == "42"));
        assert!(matches!(
            answer(json!({"result": {"textResultForLlm": "x", "resultType": "success"}})),
            Ok(ToolResult::Object(_))
        ));
        assert!(
            matches!(answer(json!({"error": "boom"})), Ok(ToolResult::Error(m)) if m == "boom")
        );
        assert!(matches!(
            answer(json!({"result": null, "error": "boom"})),
            Ok(ToolResult::Error(_))
        ));
        assert!(matches!(answer(json!({})), Ok(ToolResult::Text(t)) if t.is_empty()));
        for (params, named) in [
            (
                json!({"result": 42}),
                "`result` must be a string or an object, not a number",
            ),
            (
                json!({"result": [1]}),
                "`result` must be a string or an object, not an array",
            ),
            (
                json!({"error": true}),
                "`error` must be a string, not a boolean",
            ),
        ] {
            let refused = answer(params.clone()).expect_err("refused");
            assert!(refused.contains(named), "{params}: {refused}");
        }
    }
}
