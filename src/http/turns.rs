//! `POST /v1/turns`: leases the conversation before answering (so its errors are real HTTP
//! errors), then runs the turn in a task and streams its events as SSE, ending with one
//! `turn.end` summary (or answers that summary alone with `?stream=false`). A gateway that
//! goes away, or stops reading for `stream::SEND_TIMEOUT`, aborts its turn; the conversation stays
//! resumable. A turn naming `fallback` backends runs again on the next one when its backend
//! fails with a retryable class before streaming output (`crate::fallback`), seeded with a
//! prelude from the failed conversation's transcript, after a `backend.fallback` event.

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::extract::rejection::QueryRejection;
use axum::extract::{Query, State};
use axum::http::StatusCode;
use axum::response::Response;
use serde::Deserialize;

use super::AppState;
use super::attachments::{check_off_thread, images_only, work_roots, write_off_thread};
use super::body::{ToolBody, TurnBody, create_work_dir, lease_request, parse, read_body};
use super::error::ErrorBody;
use super::error::{error, pool_error, rejection};
use super::events::{
    EventFilter, SessionEventData, ToolCallEvent, TurnEndEvent, TurnEvent, TurnEventStream,
};
use super::gateway::Link;
use super::idempotency::{self, Claim, Pending};
use super::stream::{self, TurnEvents};
use crate::backend::BackendEvent;
use crate::fallback::{self, ChainEvent, ChainLease, ChainRequest, ChainSink};
use crate::kinds::{HookName, TurnEnd};
use crate::permission::{DecisionFuture, PermissionPolicy, PermissionRequest};
use crate::pool::{COPILOT_BACKEND, ConversationId, LeaseRequest};
use crate::turn::Message;

/// The query of `POST /v1/turns`. Any other parameter is refused (a typo of `stream` would
/// otherwise stream silently), as `ResetQuery` refuses one.
#[derive(Deserialize, Default, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
pub(super) struct TurnQuery {
    /// `false`: answer with the `turn.end` summary alone, as JSON (no tools, no hooks, no
    /// permission prompts: those need the stream). Default `true`.
    #[serde(default)]
    stream: Option<bool>,
}

/// Runs one turn of a conversation: the lease is taken before the answer, so its errors are
/// real HTTP errors; then the turn's events stream until `turn.end`.
#[utoipa::path(
    post,
    path = "/v1/turns",
    tag = "turns",
    params(
        TurnQuery,
        ("Idempotency-Key" = Option<String>, Header, nullable = false, max_length = 255,
            description = "One key per turn the gateway means to run (a UUID, say). A retry with the same key and the same body, after the turn ended, gets that turn's `turn.end` again (marked `Idempotent-Replayed: true`; as the stream's one event, or as JSON with `?stream=false`) instead of running the prompt twice; during the turn it gets 409. A turn whose gateway left before its end was aborted, and its retry runs. Kept in memory for `idempotency.ttl` (default one hour) per conversation"),
    ),
    request_body(content = TurnBody, content_type = "application/json"),
    responses(
        (status = 200, description = "The turn runs: its events (`text/event-stream`, ending with `turn.end`), or with `?stream=false` the `turn.end` summary alone",
            content(
                (TurnEventStream = "text/event-stream"),
                (TurnEndEvent = "application/json"),
            )),
        (status = 400, description = "The body or a field is wrong (`bad_request`, `bad_body`); the message names it", body = ErrorBody),
        (status = 401, description = "Missing or wrong bearer token (when the daemon has one)", body = ErrorBody),
        (status = 403, description = "No token is set and the request is not from this machine: its Host is not a loopback name, or it came from a web page (Origin)", body = ErrorBody),
        (status = 404, description = "A named resource does not exist (`not_found`)", body = ErrorBody),
        (status = 408, description = "The body did not arrive in time (`body_timeout`)", body = ErrorBody),
        (status = 409, description = "The conversation runs another turn, or the turn of this `Idempotency-Key` runs (`busy`), or its CLI backend's stored session has no transcript left (`transcript_missing`), or the conversation would be new and its agent keeps `max_conversations_per_agent` conversations already (`conversation_limit`: delete one first)", body = ErrorBody),
        (status = 413, description = "The body exceeds `max_body_bytes`, or holds more JSON values than one per 32 bytes of it (at least 65,536), or its inline attachments would take the conversation's past `[attachments] max_conversation_bytes` (`too_large`)", body = ErrorBody),
        (status = 422, description = "The `Idempotency-Key` was used for a turn with another body (`idempotency_key_reused`)", body = ErrorBody),
        (status = 500, description = "A fault of the daemon (`internal`, `io`)", body = ErrorBody),
        (status = 502, description = "The runtime failed to open the conversation (`runtime`)", body = ErrorBody),
        (status = 503, description = "No room or shutting down: `draining`, `no_capacity`, `quarantined`, `state_unwritable`, `resource_exhausted`, `too_many_connections`", body = ErrorBody),
    ),
    security((), ("api_token" = [])),
)]
pub(super) async fn post_turn(
    State(state): State<Arc<AppState>>,
    query: Result<Query<TurnQuery>, QueryRejection>,
    headers: axum::http::HeaderMap,
    body: Body,
) -> Response {
    let Query(query) = match query {
        Ok(q) => q,
        Err(e) => return rejection(e),
    };
    let idempotency_key = match idempotency::key_of(&headers) {
        Ok(key) => key,
        Err(message) => return error(StatusCode::BAD_REQUEST, "bad_request", message),
    };
    if state.draining() {
        return error(
            StatusCode::SERVICE_UNAVAILABLE,
            "draining",
            "the daemon is shutting down",
        );
    }
    let body = match read_body(&state, body).await {
        Ok(b) => b,
        Err(r) => return r,
    };
    // The key with what a retry must repeat: the body, as sent.
    let idempotency = idempotency_key.map(|key| (key, idempotency::body_hash(&body)));
    let mut body: TurnBody = match parse(&body) {
        Ok(b) => b,
        Err(r) => return r,
    };
    let conv = body.take_conversation();
    let backend = body.backend.take();
    if let Some(backend) = &backend
        && let Err(e) = state.pool.check_backend(backend)
    {
        return pool_error(&e);
    }
    let fallbacks = std::mem::take(&mut body.fallback);
    let primary = backend.as_deref().unwrap_or(COPILOT_BACKEND);
    if let Err(e) = fallback::check_chain(primary, &fallbacks) {
        return error(StatusCode::BAD_REQUEST, "bad_request", e.to_string());
    }
    for next in &fallbacks {
        if let Err(e) = state.pool.check_backend(next) {
            return pool_error(&e);
        }
    }
    let budget = match body.prelude_chars.map(fallback::check_budget).transpose() {
        Ok(b) => b.unwrap_or(fallback::DEFAULT_PRELUDE_CHARS),
        Err(e) => {
            return error(
                StatusCode::BAD_REQUEST,
                "bad_request",
                format!("prelude_chars: {e}"),
            );
        }
    };
    for cli in fallbacks.iter().filter(|b| *b != COPILOT_BACKEND) {
        if let Err(what) = images_only(&body.attachments) {
            return error(
                StatusCode::BAD_REQUEST,
                "bad_request",
                format!(
                    "{what}; `fallback` names CLI backend `{cli}`: drop the attachment, or \
                     drop `{cli}` from `fallback`"
                ),
            );
        }
        if let Err(what) = cli_refusal(&body, serves_tools(&state, cli)) {
            return error(
                StatusCode::BAD_REQUEST,
                "bad_request",
                format!(
                    "{what} are not offered to CLI backend `{cli}`, and `fallback` names it; \
                     drop them, or drop `{cli}` from `fallback`{}",
                    tools_hint(what)
                ),
            );
        }
    }
    if let Err(message) = check_tools(&body.tools) {
        return error(StatusCode::BAD_REQUEST, "bad_request", message);
    }
    let omitted = match EventFilter::parse(&body.omit_events) {
        Ok(filter) => filter,
        Err(message) => return error(StatusCode::BAD_REQUEST, "bad_request", message),
    };
    let mut req = match lease_request(&state, &body.agent_id, &body.session_key, conv).await {
        Ok(r) => r,
        Err(r) => return r,
    };
    // Checked for every backend: a body the document refuses is refused whatever it names.
    if let Some(ms) = body.timeout_ms {
        // A turn may ask for less time than the daemon's absolute limit, never more.
        let limit = state.config.timeouts.absolute;
        let asked = Duration::from_millis(ms);
        if ms == 0 || asked > limit {
            return error(
                StatusCode::BAD_REQUEST,
                "bad_request",
                format!(
                    "timeout_ms must be above 0 and at most the daemon's absolute turn timeout \
                     ({} ms; raise it in the daemon's config to allow longer turns)",
                    limit.as_millis()
                ),
            );
        }
        req.handlers.timeouts.absolute = asked;
    }
    let streaming = query.stream != Some(false);
    let conversation = ConversationId::new(&body.agent_id, &body.session_key).key();
    // Everything checked: a key is claimed for a turn that would run.
    let pending = match idempotency {
        Some((key, hash)) => {
            match state
                .replays
                .claim(conversation.clone(), key, hash, Instant::now())
            {
                Claim::Run(pending) => Some(pending),
                Claim::Running => {
                    return error(
                        StatusCode::CONFLICT,
                        "busy",
                        "a turn with this Idempotency-Key is running; its answer goes to the \
                         request that started it. Retry once it has ended to get its turn.end",
                    );
                }
                Claim::Ended(summary) => return stream::replayed(streaming, &summary),
                Claim::OtherBody => {
                    return error(
                        StatusCode::UNPROCESSABLE_ENTITY,
                        "idempotency_key_reused",
                        "this Idempotency-Key was used for a turn with another body; send a \
                         new key for a new turn (a retry must repeat its body exactly)",
                    );
                }
            }
        }
        None => None,
    };
    let stop = state.turn_stop(conversation);
    let sink = StreamSink {
        state: state.clone(),
        stop,
        events: None,
        streaming,
        tools: std::mem::take(&mut body.tools),
        hooks: std::mem::take(&mut body.hooks),
        omitted: Arc::new(omitted),
    };
    let mut chain = ChainRequest::new(req, Message::new(body.prompt.clone()));
    chain.fallbacks = fallbacks;
    chain.prelude_chars = budget;
    match backend.filter(|b| b != COPILOT_BACKEND) {
        Some(backend) => {
            chain.lease.backend = backend;
            post_cli_turn(state, body, chain, sink, pending).await
        }
        None => post_copilot_turn(state, body, chain, sink, pending).await,
    }
}

/// A turn whose first backend is Copilot: its attachments checked, the lease taken, the
/// inline ones written, then its events streamed.
async fn post_copilot_turn(
    state: Arc<AppState>,
    mut body: TurnBody,
    chain: ChainRequest,
    mut sink: StreamSink,
    pending: Option<Pending>,
) -> Response {
    if !sink.streaming && !sink.tools.is_empty() {
        return error(
            StatusCode::BAD_REQUEST,
            "bad_request",
            "tools need the event stream (their calls are answered from it); drop ?stream=false",
        );
    }
    if !sink.streaming && !sink.hooks.is_empty() {
        return error(
            StatusCode::BAD_REQUEST,
            "bad_request",
            "hooks need the event stream (they are sent and answered there); drop ?stream=false",
        );
    }
    let (attachments, work) =
        match checked_attachments_and_work_dir(&state, &mut body, &chain).await {
            Ok(checked) => checked,
            Err(r) => return r,
        };
    let (events_tx, events_rx) = stream::channel();
    sink.events = Some(events_tx);
    let streaming = sink.streaming;
    // The lease is taken before answering, so its errors are real HTTP errors.
    let mut lease = match ChainLease::start(&state.pool, chain, sink).await {
        Ok(l) => l,
        Err(e) => return pool_error(&e),
    };
    // Inline content is written only for a turn that runs (dropping the lease on a failed
    // write returns the conversation).
    let message = lease.message_mut();
    message.attachments = match write_inline(attachments, work, &body).await {
        Ok(a) => a,
        Err(r) => return r,
    };
    message.mode = body.mode;
    message.agent_mode = body.agent_mode;
    let keepalive = state.config.sse_keepalive;
    spawn_run(state, lease, pending);
    stream::respond(streaming, keepalive, events_rx).await
}

/// The turn's checked attachments as the runtime takes them, its inline contents written
/// into the conversation's directory of its working directory.
async fn write_inline(
    attachments: super::attachments::Checked,
    work: WorkDir,
    body: &TurnBody,
) -> Result<Vec<crate::rpc::messages::Attachment>, Response> {
    let conversation = ConversationId::new(&body.agent_id, &body.session_key);
    write_off_thread(attachments, work.path, work.roots, &conversation).await
}

/// What a CLI backend's turn refuses in a body, if the body has it (attachments other than
/// images are [`images_only`]'s); `tools_served`: the backend takes gateway tools (through
/// the MCP bridge).
fn cli_refusal(body: &TurnBody, tools_served: bool) -> Result<(), &'static str> {
    if !body.tools.is_empty() && !tools_served {
        return Err(GATEWAY_TOOLS);
    }
    if !body.hooks.is_empty() {
        return Err("hooks");
    }
    if body.mode.is_some() || body.agent_mode.is_some() {
        return Err("`mode` and `agent_mode`");
    }
    Ok(())
}

/// What [`cli_refusal`] names for a body's `tools`.
const GATEWAY_TOOLS: &str = "gateway tools";

/// Where gateway tools are taken, after a refusal of them.
fn tools_hint(what: &str) -> &'static str {
    if what == GATEWAY_TOOLS {
        " (its CLI gets no MCP bridge for them: `claude-cli` and `codex-cli` take them)"
    } else {
        ""
    }
}

/// A turn's attachments checked (paths resolved and confined, inline content decoded:
/// nothing is written yet), then, everything being checked and the request running a turn,
/// its working directory created. Either refusal is the answer.
async fn checked_attachments_and_work_dir(
    state: &AppState,
    body: &mut TurnBody,
    chain: &ChainRequest,
) -> Result<(super::attachments::Checked, WorkDir), Response> {
    // Relative paths are taken against the conversation's working directory; a path may
    // lie anywhere in the agent's work directory or an allowed root (a session's own
    // `workingDirectory` may be a folder of the work directory).
    let roots = work_roots(state, &chain.lease.agent_id);
    let attachments = check_off_thread(
        std::mem::take(&mut body.attachments),
        chain.lease.working_directory.clone(),
        roots.clone(),
        state.config.attachments.clone(),
    )
    .await?;
    let work = chain.lease.working_directory.clone();
    create_conversation_dir(&work, &roots).await?;
    Ok((attachments, WorkDir { path: work, roots }))
}

/// Creates the conversation's working directory (mode 0700). Below one of `roots` (the
/// agent's work directory, `allowed_work_roots`), its missing part is made
/// without following a link: the agent's processes may write there, and a directory on the
/// way swapped for a link after the path was confined would have the daemon make
/// directories wherever the link points. The agent's own work directory, and a directory
/// under no root the pool resolved (below a root that is itself a link), as
/// [`create_work_dir`] makes them.
async fn create_conversation_dir(
    work: &std::path::Path,
    roots: &[std::path::PathBuf],
) -> Result<(), Response> {
    // A root itself (the agent's work directory, every turn that names no other): no
    // resolving of the roots on a warm turn.
    if roots.iter().any(|root| root == work) {
        return create_work_dir(work).await;
    }
    let (root, below) = super::attachments::root_and_below(work, roots);
    if below.as_os_str().is_empty() {
        return create_work_dir(work).await;
    }
    // The root itself is the pool's to make (the agent's work directory before its first
    // turn), as before.
    if std::fs::symlink_metadata(&root).is_err() {
        create_work_dir(&root).await?;
    }
    crate::agent_files::create_dirs(&root, &below, 0o700).map_err(|e| {
        error(
            StatusCode::INTERNAL_SERVER_ERROR,
            "io",
            format!(
                "could not make the conversation's working directory {}: {e}; something the \
                 pool does not follow may be in the way (the agent's processes may have put a \
                 link there): remove it",
                work.display()
            ),
        )
    })
}

/// A turn's working directory and the directories it may lie in.
struct WorkDir {
    path: std::path::PathBuf,
    roots: Vec<std::path::PathBuf>,
}

/// Whether `backend` takes gateway tools (an unknown one was refused before).
fn serves_tools(state: &AppState, backend: &str) -> bool {
    state.pool.serves_gateway_tools(backend).unwrap_or(false)
}

/// A turn whose first backend is a CLI backend (`backend` names one): its image
/// attachments checked, the lease taken, the inline ones written, then its events in the
/// same vocabulary, ending with `turn.end`.
async fn post_cli_turn(
    state: Arc<AppState>,
    mut body: TurnBody,
    chain: ChainRequest,
    mut sink: StreamSink,
    pending: Option<Pending>,
) -> Response {
    let backend = chain.lease.backend.clone();
    // The body's tools and hooks moved to the sink: refused from there.
    let refusal = if !sink.tools.is_empty() && !serves_tools(&state, &backend) {
        Err(GATEWAY_TOOLS)
    } else if !sink.hooks.is_empty() {
        Err("hooks")
    } else {
        cli_refusal(&body, true)
    };
    if let Err(what) = refusal {
        return error(
            StatusCode::BAD_REQUEST,
            "bad_request",
            format!(
                "{what} are not offered to CLI backend `{backend}`; drop them, or run the \
                 conversation on `copilot`{}",
                tools_hint(what)
            ),
        );
    }
    if let Err(what) = images_only(&body.attachments) {
        return error(
            StatusCode::BAD_REQUEST,
            "bad_request",
            format!("{what}; drop it, or run the conversation on `copilot` (backend `{backend}`)"),
        );
    }
    if !sink.streaming && !sink.tools.is_empty() {
        return error(
            StatusCode::BAD_REQUEST,
            "bad_request",
            "tools need the event stream (their calls are answered from it); drop ?stream=false",
        );
    }
    let (attachments, work) =
        match checked_attachments_and_work_dir(&state, &mut body, &chain).await {
            Ok(checked) => checked,
            Err(r) => return r,
        };
    let (events_tx, events_rx) = stream::channel();
    sink.events = Some(events_tx);
    let streaming = sink.streaming;
    let mut lease = match ChainLease::start(&state.pool, chain, sink).await {
        Ok(l) => l,
        Err(e) => return pool_error(&e),
    };
    // Inline images are written only for a turn that runs (dropping the lease on a failed
    // write returns the conversation); the runner passes them to the CLI.
    lease.message_mut().attachments = match write_inline(attachments, work, &body).await {
        Ok(a) => a,
        Err(r) => return r,
    };
    let keepalive = state.config.sse_keepalive;
    spawn_run(state, lease, pending);
    stream::respond(streaming, keepalive, events_rx).await
}

/// Runs a leased turn's chain in a task, counted in `AppState::running` until its
/// `turn.end` is sent (not sent when the gateway is gone).
fn spawn_run(state: Arc<AppState>, lease: ChainLease<StreamSink>, pending: Option<Pending>) {
    let running = Running::start(state);
    // Boxed: a turn's future is ~20 KB, which a spawn would move before boxing it itself.
    let run = Box::pin(async move {
        let events = lease.sink().events.clone();
        let outcome = lease.run().await;
        // A turn its gateway left was aborted: its key is forgotten (the retry runs it).
        // One that ran to its end (its gateway still there, or gone only as its last events
        // went out) answers a retry with its summary, recorded before it is sent (a retry
        // may follow the first answer at once).
        let ran_whole = !outcome.caller_gone || outcome.summary.status != TurnEnd::Aborted;
        if ran_whole && let Some(pending) = pending {
            pending.ended(&outcome.summary);
        }
        if !outcome.caller_gone
            && let Some(events) = events
        {
            let _ = events.send(TurnEvent::TurnEnd(outcome.summary)).await;
        }
        drop(running);
    });
    tokio::spawn(run);
}

/// A turn's side of the chain: sets each backend's gateway-facing handlers (when the turn
/// streams) and turns the chain's events into SSE events on the turn's stream.
struct StreamSink {
    state: Arc<AppState>,
    /// Set by an abort of the conversation, from the turn's request until its end.
    stop: super::TurnStop,
    /// The turn's event stream (set once the body is checked).
    events: Option<TurnEvents>,
    /// Whether the turn streams (else nobody could answer: permissions are rejected,
    /// ask_user is off, and tools and hooks were refused).
    streaming: bool,
    /// The turn's gateway tools, for every backend's lease.
    tools: Vec<ToolBody>,
    /// The hooks the gateway answers (Copilot only: a chain with a CLI backend refuses
    /// them).
    hooks: Vec<HookName>,
    /// The session events the turn leaves out of its stream (`omit_events`).
    omitted: Arc<EventFilter>,
}

impl ChainSink for StreamSink {
    /// The gateway-facing handlers of a lease on `req.backend`: the turn's gateway `tools`,
    /// answered over the stream (`tool.call` with a `request_id`; a CLI backend's calls come
    /// through its MCP bridge); a Copilot conversation's permission prompts, ask_user and
    /// hooks over the stream; a CLI backend's permission prompts with the permission time
    /// limit.
    fn prepare(&self, req: &mut LeaseRequest) {
        // What the gateway leaves out of its stream is not read at all where the pool does
        // not read it either (the runtime's `model.*` events and `system.message`).
        req.handlers.unread_events = self.omitted.unread_events();
        let Some(events) = self.events.as_ref().filter(|_| self.streaming) else {
            return;
        };
        let link = Link {
            events: events.clone(),
            registry: self.state.registry.clone(),
        };
        req.handlers.tools = self
            .tools
            .iter()
            .map(|t| link.tool(t.name.clone(), t.description.clone(), t.parameters.clone()))
            .collect();
        if req.backend == COPILOT_BACKEND {
            req.handlers.permission_policy = Arc::new(link.clone());
            if !self.hooks.is_empty() {
                req.handlers.hooks = Some(Arc::new(link.hooks(self.hooks.iter().copied())));
            }
            req.handlers.user_input = Some(Arc::new(link));
        } else {
            // The CLI's permission prompts go to the gateway as `permission.request`, denied
            // when unanswered within the permission timeout (the CLI waits on the answer).
            req.handlers.permission_policy = Arc::new(TimedPermission {
                link,
                limit: self.state.config.timeouts.permission,
            });
        }
    }

    async fn deliver(&self, event: ChainEvent) -> bool {
        let Some(events) = &self.events else {
            return false;
        };
        // A turn that does not stream answers its `turn.end` alone (sent by `spawn_run`):
        // its other events are neither framed nor queued.
        if !self.streaming {
            return true;
        }
        let sse = match event {
            ChainEvent::Session(event) => TurnEvent::Runtime(Box::new(event)),
            ChainEvent::Cli(event) => match cli_event(event) {
                Some(sse) => sse,
                None => return true,
            },
            ChainEvent::Fallback(notice) => TurnEvent::BackendFallback(notice),
        };
        if !self.omitted.streams(&sse) {
            return true;
        }
        events.send(sse).await
    }

    async fn gone(&self) {
        match &self.events {
            Some(events) => events.closed().await,
            None => std::future::pending().await,
        }
    }

    fn stop_requested(&self) -> bool {
        self.stop.requested()
    }

    async fn stopped(&self) {
        self.stop.asked().await;
    }
}

/// The gateway's permission answers with a time limit: the Copilot path's turn driver
/// enforces `permission` itself; a CLI backend's turn has no driver, so the policy does.
struct TimedPermission {
    link: Link,
    limit: Duration,
}

impl PermissionPolicy for TimedPermission {
    fn decide(&self, request: PermissionRequest) -> DecisionFuture {
        let asked = self.link.decide(request);
        let limit = self.limit;
        Box::pin(async move {
            tokio::time::timeout(limit, asked)
                .await
                .unwrap_or_else(|_| Err("the gateway did not decide in time".to_owned()))
        })
    }
}

/// The runtime's own built-in that a gateway tool may not define.
const RESERVED_TOOL: &str = "catalog_search";

/// A turn's tools as the runtime takes them: each with a name, none twice, none the reserved
/// built-in (the runtime would refuse the session after the lease: a 502 for a bad request).
pub(super) fn check_tools(tools: &[ToolBody]) -> Result<(), String> {
    let mut seen = std::collections::HashSet::new();
    for (i, tool) in tools.iter().enumerate() {
        if tool.name.is_empty() {
            return Err(format!("tools.{i}.name is empty; give every tool a name"));
        }
        if tool.name == RESERVED_TOOL {
            return Err(format!(
                "tools.{i}.name {RESERVED_TOOL:?} is the runtime's own built-in; rename the tool"
            ));
        }
        if !seen.insert(tool.name.as_str()) {
            return Err(format!(
                "tools.{i}.name {:?} is given twice; each tool needs its own name",
                tool.name
            ));
        }
        // Every model API takes a function's parameters as a JSON Schema object: anything
        // else fails at the model call, on every turn.
        if !tool.parameters.is_object() {
            return Err(format!(
                "tools.{i}.parameters must be a JSON Schema object (e.g. {{\"type\": \
                 \"object\", \"properties\": {{}}}}); leave it out for a tool without arguments"
            ));
        }
    }
    Ok(())
}

/// A CLI backend's event in the daemon's vocabulary; `None` for a permission decision (the
/// gateway's own `permission.request` was streamed when it was asked). The CLI's report of
/// a call of a gateway tool served through its MCP bridge never gets here (the chain drops
/// it: the bridge's handler streams that call as the `tool.call` with a `request_id`).
fn cli_event(event: BackendEvent) -> Option<TurnEvent> {
    let session = |event: &BackendEvent, ephemeral: bool| {
        TurnEvent::Session(SessionEventData {
            id: uuid::Uuid::new_v4().to_string(),
            timestamp: None,
            parent_id: None,
            ephemeral,
            agent_id: None,
            event_type: event.name().to_owned(),
            data: event.data(),
        })
    };
    match event {
        BackendEvent::MessageDelta { .. } => Some(session(&event, true)),
        BackendEvent::Message { .. } => Some(session(&event, false)),
        BackendEvent::ToolCall { id, name, input } => Some(TurnEvent::ToolCall(ToolCallEvent {
            request_id: String::new(),
            tool_name: name,
            tool_call_id: id,
            arguments: input,
        })),
        _ => None,
    }
}

/// One turn counted in `AppState::running` from its lease until its summary is sent (or
/// its task ends otherwise), for the drain.
struct Running(Arc<AppState>);

impl Running {
    fn start(state: Arc<AppState>) -> Self {
        state.running.send_modify(|n| *n += 1);
        Self(state)
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        self.0.running.send_modify(|n| *n = n.saturating_sub(1));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_conversation_dir_is_made_below_its_root_never_through_a_link_on_the_way() {
        let tmp = tempfile::tempdir().expect("tempdir");
        let work = tmp.path().join("agent/work");
        let elsewhere = tmp.path().join("state");
        std::fs::create_dir_all(&elsewhere).expect("mkdir");
        let roots = vec![work.clone()];
        // The agent's work directory, missing before its first turn, is made with it.
        let fresh = work.join("project/x");
        assert!(create_conversation_dir(&fresh, &roots).await.is_ok());
        assert!(fresh.is_dir());
        // A directory on the way swapped for a link after the path was confined.
        std::os::unix::fs::symlink(&elsewhere, work.join("linked")).expect("link");
        let through = work.join("linked/x");
        assert!(create_conversation_dir(&through, &roots).await.is_err());
        assert!(
            !elsewhere.join("x").exists(),
            "nothing was made where the link points"
        );
        // Below an operator's root that is itself a link (followed once, nothing below it).
        let target = tmp.path().join("data-work");
        std::fs::create_dir_all(&target).expect("mkdir");
        let linked_root = tmp.path().join("srv-work");
        std::os::unix::fs::symlink(&target, &linked_root).expect("the root's link");
        let roots = vec![work.clone(), linked_root];
        let fresh = target.join("project/y");
        assert!(create_conversation_dir(&fresh, &roots).await.is_ok());
        assert!(fresh.is_dir());
        std::os::unix::fs::symlink(&elsewhere, target.join("swapped")).expect("link");
        let through = target.join("swapped/y");
        assert!(create_conversation_dir(&through, &roots).await.is_err());
        assert!(!elsewhere.join("y").exists());
    }
}
