//! `POST /v1/turns`: leases the conversation before answering (so its errors are real HTTP
//! errors), then runs the turn in a task and streams its events as SSE, ending with one
//! `turn.end` summary (or answers that summary alone with `?stream=false`). A gateway that
//! goes away, or stops reading for `SEND_TIMEOUT`, aborts its turn; the conversation stays
//! resumable. A turn naming `fallback` backends runs again on the next one when its backend
//! fails with a retryable class before streaming output (`crate::fallback`), seeded with a
//! prelude from the failed conversation's transcript, after a `backend.fallback` event.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::rejection::QueryRejection;
use axum::extract::{Query, State};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use tokio::sync::mpsc;

use super::AppState;
use super::attachments::{check_off_thread, write_off_thread};
use super::body::{ToolBody, TurnBody, create_work_dir, lease_request, parse, read_body};
use super::error::ErrorBody;
use super::error::{error, pool_error, rejection};
use super::events::{
    BackendFallbackEvent, SessionEventData, ToolCallEvent, TurnEndEvent, TurnEvent, TurnEventStream,
};
use super::gateway::Link;
use crate::backend::{BackendEvent, CliTurnOutcome};
use crate::fallback::{self, FallbackClass};
use crate::kinds::{OpenReason, TurnEnd};
use crate::permission::{DecisionFuture, PermissionPolicy, PermissionRequest};
use crate::pool::{COPILOT_BACKEND, CliLease, Lease, LeaseRequest};
use crate::turn::Message;

/// A gateway that does not read its event stream for this long is treated as gone (the
/// turn is aborted), so a stalled client cannot pin a conversation.
pub(super) const SEND_TIMEOUT: Duration = Duration::from_secs(30);

#[derive(Deserialize, Default, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
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
    params(TurnQuery),
    request_body(content = TurnBody, content_type = "application/json"),
    responses(
        (status = 200, description = "The turn runs: its events (`text/event-stream`, ending with `turn.end`), or with `?stream=false` the `turn.end` summary alone",
            content(
                (TurnEventStream = "text/event-stream"),
                (TurnEndEvent = "application/json"),
            )),
        (status = 400, description = "The body or a field is wrong (`bad_request`, `bad_body`); the message names it", body = ErrorBody),
        (status = 401, description = "Missing or wrong bearer token (when the daemon has one)", body = ErrorBody),
        (status = 404, description = "A named resource does not exist (`not_found`)", body = ErrorBody),
        (status = 408, description = "The body did not arrive in time (`body_timeout`)", body = ErrorBody),
        (status = 409, description = "The conversation runs another turn (`busy`), or its CLI backend's stored session has no transcript left (`transcript_missing`)", body = ErrorBody),
        (status = 413, description = "The body exceeds `max_body_bytes` (`too_large`)", body = ErrorBody),
        (status = 500, description = "A fault of the daemon (`internal`, `io`)", body = ErrorBody),
        (status = 502, description = "The runtime failed to open the conversation (`runtime`)", body = ErrorBody),
        (status = 503, description = "No room or shutting down: `draining`, `no_capacity`, `quarantined`, `state_unwritable`, `resource_exhausted`, `too_many_connections`", body = ErrorBody),
    ),
    security((), ("api_token" = [])),
)]
pub(super) async fn post_turn(
    State(state): State<Arc<AppState>>,
    query: Result<Query<TurnQuery>, QueryRejection>,
    body: Body,
) -> Response {
    let Query(query) = match query {
        Ok(q) => q,
        Err(e) => return rejection(e),
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
    // What a fallback needs to lease the next backend: the request before any backend's
    // handlers are set.
    let chain = Chain {
        rest: fallbacks.into(),
        template: req.clone(),
        prompt: body.prompt.clone(),
        budget,
        streaming: query.stream != Some(false),
        tools: body.tools.clone(),
    };
    if let Some(backend) = backend.filter(|b| b != COPILOT_BACKEND) {
        req.backend = backend;
        return post_cli_turn(state, query, body, req, chain).await;
    }
    let streaming = query.stream != Some(false);
    if !streaming && !body.tools.is_empty() {
        return error(
            StatusCode::BAD_REQUEST,
            "bad_request",
            "tools need the event stream (their calls are answered from it); drop ?stream=false",
        );
    }
    if !streaming && !body.hooks.is_empty() {
        return error(
            StatusCode::BAD_REQUEST,
            "bad_request",
            "hooks need the event stream (they are sent and answered there); drop ?stream=false",
        );
    }
    // Paths resolved and confined, inline content decoded: nothing is written yet.
    let attachments = match check_off_thread(
        std::mem::take(&mut body.attachments),
        req.working_directory.clone(),
        state.config.allowed_work_roots.clone(),
        state.config.attachments.clone(),
    )
    .await
    {
        Ok(a) => a,
        Err(r) => return r,
    };
    let (events_tx, events_rx) = mpsc::channel::<TurnEvent>(256);
    if streaming {
        let link = Link {
            events: events_tx.clone(),
            registry: state.registry.clone(),
        };
        req.handlers.tools = std::mem::take(&mut body.tools)
            .into_iter()
            .map(|t| link.tool(t.name, t.description, t.parameters))
            .collect();
        req.handlers.permission_policy = Arc::new(link.clone());
        if !body.hooks.is_empty() {
            req.handlers.hooks = Some(Arc::new(link.hooks(body.hooks.iter().copied())));
        }
        req.handlers.user_input = Some(Arc::new(link));
    }
    // Without the stream nobody could answer: permissions are rejected, ask_user is off.

    // Everything is checked: this request runs a turn, so its working directory may exist.
    if let Err(r) = create_work_dir(&req.working_directory).await {
        return r;
    }
    let work = req.working_directory.clone();
    let transcript_dir = req.handlers.transcript.as_ref().map(|t| t.dir.clone());
    // The lease is taken before answering, so its errors are real HTTP errors.
    let lease = match state.pool.lease(req).await {
        Ok(l) => l,
        Err(e) => return first_lease_failed(state, e, COPILOT_BACKEND, chain, body.agent_id).await,
    };
    // Inline content is written only for a turn that runs (dropping the lease on a failed
    // write returns the conversation).
    let mut message = Message::new(body.prompt);
    message.attachments = match write_off_thread(attachments, work).await {
        Ok(a) => a,
        Err(r) => return r,
    };
    message.mode = body.mode;
    message.agent_mode = body.agent_mode;
    let running = Running::start(state.clone());
    tokio::spawn(async move {
        let first = run_turn(lease, message, transcript_dir, &events_tx, &body.agent_id).await;
        run_chain(running, first, chain, events_tx, body.agent_id).await;
    });

    respond(streaming, events_rx).await
}

/// What a CLI backend's turn refuses in a body, if the body has it; `tools_served`: the
/// backend takes gateway tools (through the MCP bridge).
fn cli_refusal(body: &TurnBody, tools_served: bool) -> Result<(), &'static str> {
    if !body.tools.is_empty() && !tools_served {
        return Err(GATEWAY_TOOLS);
    }
    if !body.hooks.is_empty() {
        return Err("hooks");
    }
    if !body.attachments.is_empty() {
        return Err("attachments");
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

/// Whether `backend` takes gateway tools (an unknown one was refused before).
fn serves_tools(state: &AppState, backend: &str) -> bool {
    state.pool.serves_gateway_tools(backend).unwrap_or(false)
}

/// A CLI backend's turn (`backend` names one): its lease, then its events in the same
/// vocabulary, ending with `turn.end`.
async fn post_cli_turn(
    state: Arc<AppState>,
    query: TurnQuery,
    body: TurnBody,
    mut req: LeaseRequest,
    chain: Chain,
) -> Response {
    if let Err(what) = cli_refusal(&body, serves_tools(&state, &req.backend)) {
        return error(
            StatusCode::BAD_REQUEST,
            "bad_request",
            format!(
                "{what} are not offered to CLI backend `{}`; drop them, or run the \
                 conversation on `copilot`{}",
                req.backend,
                tools_hint(what)
            ),
        );
    }
    let streaming = query.stream != Some(false);
    if !streaming && !body.tools.is_empty() {
        return error(
            StatusCode::BAD_REQUEST,
            "bad_request",
            "tools need the event stream (their calls are answered from it); drop ?stream=false",
        );
    }
    let (events_tx, events_rx) = mpsc::channel::<TurnEvent>(256);
    set_handlers(&state, &mut req, streaming, &events_tx, &body.tools);
    let bridged = !req.handlers.tools.is_empty();
    if let Err(r) = create_work_dir(&req.working_directory).await {
        return r;
    }
    let backend = req.backend.clone();
    let lease = match state.pool.lease_cli(req).await {
        Ok(l) => l,
        Err(e) => return first_lease_failed(state, e, &backend, chain, body.agent_id).await,
    };
    let running = Running::start(state.clone());
    tokio::spawn(async move {
        let first = run_cli_turn(lease, &body.prompt, &events_tx, &body.agent_id, bridged).await;
        run_chain(running, first, chain, events_tx, body.agent_id).await;
    });
    respond(streaming, events_rx).await
}

/// The turn's first backend could not be leased. With a backend left in the chain and a
/// retryable class ([`fallback::classify_lease`]: its processes cannot start, or its key is
/// quarantined), the turn's stream starts and the chain runs on, as after a run that failed
/// before any output (`backend.fallback` names the lease's error; no prelude, since no run
/// left a transcript to read); otherwise the lease's error is the answer, as without a chain.
async fn first_lease_failed(
    state: Arc<AppState>,
    e: crate::pool::PoolError,
    backend: &str,
    chain: Chain,
    agent_id: String,
) -> Response {
    let class = fallback::classify_lease(e.kind());
    if class.is_none() || chain.rest.is_empty() {
        return pool_error(&e);
    }
    tracing::warn!(%e, backend, "the turn's backend could not be leased; falling back");
    let end = StepEnd {
        summary: TurnEndEvent {
            status: TurnEnd::Error,
            backend: backend.to_owned(),
            session_id: String::new(),
            resumed: false,
            open_reason: None,
            llm_calls: 0,
            final_text: String::new(),
            error: Some(e.to_string()),
            status_code: None,
            error_type: None,
            usage: crate::turn::Usage::default(),
            task_complete: None,
            fallback_from: None,
        },
        class,
        streamed: false,
        transcript: None,
        gone: false,
    };
    let streaming = chain.streaming;
    let (events_tx, events_rx) = mpsc::channel::<TurnEvent>(256);
    let running = Running::start(state);
    tokio::spawn(run_chain(running, end, chain, events_tx, agent_id));
    respond(streaming, events_rx).await
}

/// The gateway-facing handlers of a lease on `req.backend` (when the turn streams): the
/// turn's gateway `tools`, answered over the stream (`tool.call` with a `request_id`; a CLI
/// backend's calls come through its MCP bridge); a CLI backend's permission prompts with
/// the permission time limit; a Copilot conversation's permission prompts and ask_user over
/// the stream (a fallback turn has no hooks: a chain with a CLI backend refuses them).
fn set_handlers(
    state: &Arc<AppState>,
    req: &mut LeaseRequest,
    streaming: bool,
    events: &mpsc::Sender<TurnEvent>,
    tools: &[ToolBody],
) {
    if !streaming {
        return;
    }
    let link = Link {
        events: events.clone(),
        registry: state.registry.clone(),
    };
    req.handlers.tools = tools
        .iter()
        .map(|t| link.tool(t.name.clone(), t.description.clone(), t.parameters.clone()))
        .collect();
    if req.backend == COPILOT_BACKEND {
        req.handlers.permission_policy = Arc::new(link.clone());
        req.handlers.user_input = Some(Arc::new(link));
    } else {
        // The CLI's permission prompts go to the gateway as `permission.request`, denied
        // when unanswered within the permission timeout (the CLI waits on the answer).
        req.handlers.permission_policy = Arc::new(TimedPermission {
            link,
            limit: state.config.timeouts.permission,
        });
    }
}

/// The backends a turn may still fall back to, and what the next one's lease needs.
struct Chain {
    /// The backends not tried yet, in order.
    rest: VecDeque<String>,
    /// The turn's lease request before any backend's handlers were set.
    template: LeaseRequest,
    /// The user's message.
    prompt: String,
    /// The prelude's budget in characters.
    budget: usize,
    /// Whether the turn streams (handlers that answer over the stream).
    streaming: bool,
    /// The turn's gateway tools, for the next backend's lease.
    tools: Vec<ToolBody>,
}

/// How one backend's run of the turn ended.
struct StepEnd {
    /// Its `turn.end` summary (sent only if no fallback follows).
    summary: TurnEndEvent,
    /// The retryable class of its failure, if it failed with one.
    class: Option<FallbackClass>,
    /// Whether any of its output (assistant text, a tool call) reached the gateway: then the
    /// turn does not fall back (the gateway has seen part of an answer; running the prompt
    /// again could repeat what its tools did).
    streamed: bool,
    /// Where the prelude of a failure is read from.
    transcript: Option<PreludeSource>,
    /// The gateway left or stopped reading: nothing more is sent.
    gone: bool,
}

/// The transcript a failed backend's conversation left, for the prelude.
enum PreludeSource {
    /// The Copilot transcript mirror (`<dir>/copilot-<session id>.jsonl`).
    Copilot(PathBuf),
    /// A CLI backend's own transcript, located when it is read (a directory search for a
    /// Codex rollout or a Gemini CLI chat file): Claude Code's, Codex's or Gemini CLI's, by
    /// `fallback::TranscriptFormat::of_cli`; a generic one-shot CLI leaves none the pool can
    /// read, so its failure gives no prelude.
    Cli {
        /// The backend id (the one-shot dialect follows it).
        backend: String,
        /// The backend's kind.
        kind: crate::backend::BackendKind,
        /// The agent's home for the backend.
        home: PathBuf,
        /// The conversation's working directory.
        cwd: PathBuf,
        /// The CLI session id.
        session_id: String,
    },
}

impl PreludeSource {
    /// The newest entries of this transcript (none when there is none to read). Blocking.
    fn read(self, budget: usize) -> Result<fallback::TranscriptTail, fallback::FallbackError> {
        match self {
            PreludeSource::Copilot(path) => fallback::read_transcript_tail(&path, budget),
            PreludeSource::Cli {
                backend,
                kind,
                home,
                cwd,
                session_id,
            } => {
                let Some(format) = fallback::TranscriptFormat::of_cli(&backend, kind) else {
                    return Ok(fallback::TranscriptTail::default());
                };
                match crate::backend::CliConversation::find_transcript(
                    &backend,
                    kind,
                    &home,
                    &cwd,
                    &session_id,
                ) {
                    Ok(Some(path)) => fallback::read_tail_of(format, &path, budget),
                    Ok(None) => Ok(fallback::TranscriptTail::default()),
                    Err(searched) => {
                        tracing::warn!(
                            backend = %backend,
                            searched = %searched.display(),
                            "no fallback prelude: the failed conversation's transcript is not there"
                        );
                        Ok(fallback::TranscriptTail::default())
                    }
                }
            }
        }
    }
}

/// Runs the rest of a turn's chain after its first backend ended with `end`: while the last
/// run failed with a retryable class before streaming output and a backend is left, the next
/// one is leased, `backend.fallback` is sent, and it runs the prompt after the prelude from
/// the failed conversation's transcript. Then the last run's `turn.end` is sent.
async fn run_chain(
    running: Running,
    mut end: StepEnd,
    mut chain: Chain,
    events: mpsc::Sender<TurnEvent>,
    agent_id: String,
) {
    // The prelude of the last failed conversation with a transcript: kept across a lease
    // that fails and across a failed backend without one.
    let mut prelude: Option<String> = None;
    while !end.gone && !end.streamed {
        let Some(class) = end.class else { break };
        let Some(next) = chain.rest.pop_front() else {
            break;
        };
        let from = end.summary.backend.clone();
        if let Some(source) = end.transcript.take()
            && let Some(fresh) = prelude_from(source, &from, &chain).await
        {
            prelude = Some(fresh);
        }
        let mut req = chain.template.clone();
        req.backend = next.clone();
        let state = running.0.clone();
        set_handlers(&state, &mut req, chain.streaming, &events, &chain.tools);
        let bridged = !req.handlers.tools.is_empty();
        let lease = match lease_next(&state, req).await {
            Ok(lease) => lease,
            Err(e) => {
                tracing::warn!(%e, backend = %next, "the fallback backend could not be leased");
                let note = format!("; the fallback to `{next}` could not be leased: {e}");
                let error = end.summary.error.get_or_insert_with(String::new);
                error.push_str(&note);
                continue;
            }
        };
        crate::metrics::fallback(&from, &next, class.label());
        let notice = TurnEvent::BackendFallback(BackendFallbackEvent {
            from: from.clone(),
            to: next.clone(),
            class,
            error: end.summary.error.clone(),
            status_code: end.summary.status_code,
            prelude_chars: prelude.as_deref().map_or(0, |p| p.chars().count()),
        });
        if events.send_timeout(notice, SEND_TIMEOUT).await.is_err() {
            // The gateway left: dropping the lease returns the conversation.
            return;
        }
        let prompt = fallback::seeded_prompt(prelude.as_deref(), &chain.prompt);
        end = match lease {
            NextLease::Copilot(lease, transcript_dir) => {
                let message = Message::new(prompt);
                run_turn(*lease, message, transcript_dir, &events, &agent_id).await
            }
            NextLease::Cli(lease) => {
                run_cli_turn(lease, &prompt, &events, &agent_id, bridged).await
            }
        };
        end.summary.fallback_from = Some(from);
    }
    if !end.gone {
        let _ = events
            .send_timeout(TurnEvent::TurnEnd(end.summary), SEND_TIMEOUT)
            .await;
    }
}

/// The lease of a fallback backend.
enum NextLease {
    /// A Copilot conversation (boxed: a `Lease` is large), with its transcript mirror's
    /// directory.
    Copilot(Box<Lease>, Option<PathBuf>),
    /// A CLI backend's conversation.
    Cli(CliLease),
}

/// Leases `req.backend` for a fallback.
async fn lease_next(
    state: &AppState,
    req: LeaseRequest,
) -> Result<NextLease, crate::pool::PoolError> {
    if req.backend == COPILOT_BACKEND {
        let transcript_dir = req.handlers.transcript.as_ref().map(|t| t.dir.clone());
        Ok(NextLease::Copilot(
            Box::new(state.pool.lease(req).await?),
            transcript_dir,
        ))
    } else {
        Ok(NextLease::Cli(state.pool.lease_cli(req).await?))
    }
}

/// The prelude from the failed conversation's transcript (`source`, read on a blocking
/// thread); `None` when there is nothing to carry or it cannot be read (logged: the next
/// backend still runs the prompt).
async fn prelude_from(source: PreludeSource, from: &str, chain: &Chain) -> Option<String> {
    let budget = chain.budget;
    let read = tokio::task::spawn_blocking(move || source.read(budget));
    let tail = match read.await {
        Ok(Ok(tail)) => tail,
        Ok(Err(e)) => {
            tracing::warn!(%e, "no fallback prelude");
            return None;
        }
        Err(e) => {
            tracing::warn!(%e, "no fallback prelude: the reading task did not finish");
            return None;
        }
    };
    let entries = fallback::without_failed_turn(tail.entries, &chain.prompt);
    fallback::build_prelude(from, tail.summary.as_deref(), &entries, budget)
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

/// The answer of a running turn: its events as SSE ending with `turn.end`, or (without the
/// stream) the `turn.end` summary alone as JSON.
async fn respond(streaming: bool, events_rx: mpsc::Receiver<TurnEvent>) -> Response {
    if !streaming {
        // Only the final summary, as JSON.
        let mut rx = events_rx;
        while let Some(event) = rx.recv().await {
            if let Some(end) = event.as_turn_end() {
                return axum::Json(end).into_response();
            }
        }
        return error(
            StatusCode::INTERNAL_SERVER_ERROR,
            "internal",
            "the turn ended without a summary",
        );
    }
    // The stream ends with `turn.end`: nothing the turn still emits comes after it.
    let stream = futures_util::stream::unfold((events_rx, false), |(mut rx, ended)| async move {
        if ended {
            return None;
        }
        let event = rx.recv().await?;
        let last = event.as_turn_end().is_some();
        Some((Ok::<_, Infallible>(Bytes::from(event.frame())), (rx, last)))
    });
    Response::builder()
        .status(StatusCode::OK)
        .header(header::CONTENT_TYPE, "text/event-stream")
        .header(header::CACHE_CONTROL, "no-cache")
        .body(Body::from_stream(stream))
        .unwrap_or_else(|_| error(StatusCode::INTERNAL_SERVER_ERROR, "internal", "response"))
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
    }
    Ok(())
}

/// The `turn.end` summary: how it ended, how the conversation was opened (`open_reason`:
/// whether the runtime still had its context), the model calls, the final text, the error
/// with the failing model call's HTTP status and the runtime's error type, the token usage
/// and the runtime's `session.task_complete` data, if any.
fn turn_end(status: TurnEnd, lease: &Lease, error: Option<String>) -> TurnEndEvent {
    let outcome = lease.outcome();
    TurnEndEvent {
        status,
        backend: COPILOT_BACKEND.to_owned(),
        session_id: lease.cli_session_id().to_string(),
        resumed: lease.reason().continued(),
        open_reason: outcome.open_reason,
        llm_calls: outcome.model_calls,
        final_text: outcome.text.clone(),
        error,
        status_code: outcome.status_code,
        error_type: outcome.error_type.clone(),
        usage: outcome.usage,
        task_complete: outcome.task_complete.clone(),
        fallback_from: None,
    }
}

/// Whether a session event streamed to the gateway is output of the turn (assistant text
/// or a tool at work): after it, the turn does not fall back.
fn is_output(event_type: &str) -> bool {
    event_type.starts_with("assistant.message") || event_type.starts_with("tool.")
}

/// Runs one Copilot turn and streams its events; a gateway that goes away (or stops
/// reading) aborts the turn (dropping the lease does), and the conversation stays
/// resumable. Returns its summary for the chain; `transcript_dir` is the mirror's directory.
async fn run_turn(
    mut lease: Lease,
    message: Message,
    transcript_dir: Option<PathBuf>,
    events: &mpsc::Sender<TurnEvent>,
    agent_id: &str,
) -> StepEnd {
    let span = tracing::info_span!("turn", agent = %agent_id, session = %lease.cli_session_id());
    let mut streamed = false;
    let mut gone = false;
    let summary = async {
        if let Err(e) = lease.send(message).await {
            return turn_end(TurnEnd::Error, &lease, Some(e.to_string()));
        }
        loop {
            tokio::select! {
                event = lease.next_event() => match event {
                    Some(Ok(event)) => {
                        let sse = SessionEventData::from(&event);
                        streamed |= is_output(&sse.event_type);
                        if events.send_timeout(TurnEvent::Session(sse), SEND_TIMEOUT).await.is_err() {
                            // The gateway disconnected or stopped reading: dropping the lease
                            // aborts the turn.
                            gone = true;
                            return turn_end(TurnEnd::Aborted, &lease, None);
                        }
                    }
                    Some(Err(e)) => {
                        let status = lease.outcome().end.unwrap_or(TurnEnd::Error);
                        return turn_end(status, &lease, Some(e.to_string()));
                    }
                    None => {
                        let o = lease.outcome();
                        let status = o.end.unwrap_or(TurnEnd::Error);
                        return turn_end(status, &lease, o.error.clone());
                    }
                },
                _ = events.closed() => {
                    gone = true;
                    return turn_end(TurnEnd::Aborted, &lease, None);
                }
            }
        }
    };
    let summary = tracing::Instrument::instrument(summary, span).await;
    let transcript = transcript_dir.and_then(|dir| {
        crate::transcript::transcript_path(&dir, lease.cli_session_id().as_str())
            .ok()
            .map(PreludeSource::Copilot)
    });
    drop(lease);
    let class = fallback::classify_copilot(
        Some(summary.status),
        summary.status_code,
        summary.error_type.as_deref(),
    );
    StepEnd {
        summary,
        class,
        streamed,
        transcript,
        gone,
    }
}

/// A CLI backend's `turn.end`.
fn cli_turn_end(
    lease: &CliLease,
    reason: OpenReason,
    outcome: Option<CliTurnOutcome>,
    status: TurnEnd,
    error: Option<String>,
) -> TurnEndEvent {
    let outcome = outcome.unwrap_or_default();
    let error = error.or_else(|| outcome.failure.as_ref().map(|f| f.to_string()));
    let status_code = fallback::cli_status_code(&outcome);
    TurnEndEvent {
        status: outcome.end.unwrap_or(status),
        backend: lease.backend().to_owned(),
        session_id: outcome
            .session_id
            .clone()
            .or_else(|| lease.session_id().map(str::to_owned))
            .unwrap_or_default(),
        resumed: reason.continued(),
        open_reason: Some(reason),
        llm_calls: 0,
        final_text: outcome.text,
        error,
        status_code,
        error_type: None,
        usage: outcome.usage,
        task_complete: None,
        fallback_from: None,
    }
}

/// A CLI backend's event in the daemon's vocabulary; `None` for a permission decision (the
/// gateway's own `permission.request` was streamed when it was asked) and, when the turn's
/// gateway tools are `bridged`, for the CLI's own report of a call of one of them (the
/// bridge's handler streams that call as the `tool.call` with a `request_id` to answer).
fn cli_event(event: BackendEvent, bridged: bool) -> Option<TurnEvent> {
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
        BackendEvent::ToolCall { name, .. } if bridged && is_bridged_call(&name) => None,
        BackendEvent::ToolCall { id, name, input } => Some(TurnEvent::ToolCall(ToolCallEvent {
            request_id: String::new(),
            tool_name: name,
            tool_call_id: id,
            arguments: input,
        })),
        _ => None,
    }
}

/// Whether a CLI's tool call is one of the gateway's, through the MCP bridge.
fn is_bridged_call(name: &str) -> bool {
    #[cfg(feature = "mcp-bridge")]
    {
        crate::backend::mcp_bridge::gateway_tool_name(name).is_some()
    }
    #[cfg(not(feature = "mcp-bridge"))]
    {
        let _ = name;
        false
    }
}

/// Runs one CLI backend turn and streams its events; a gateway that goes away (or stops
/// reading) ends the turn (its process is killed; the next turn resumes the session).
/// `bridged`: the lease carries the turn's gateway tools. Returns its summary for the chain.
async fn run_cli_turn(
    mut lease: CliLease,
    prompt: &str,
    events: &mpsc::Sender<TurnEvent>,
    agent_id: &str,
    bridged: bool,
) -> StepEnd {
    let reason = lease.reason();
    let span = tracing::info_span!("cli_turn", agent = %agent_id, backend = %lease.backend());
    // Output that reached the gateway: deltas and tool calls, and whole messages (kept to
    // tell a CLI's own error message, which Claude sends as an assistant message, from an
    // answer).
    let mut streamed = false;
    let mut messages: Vec<String> = Vec::new();
    let summary = async {
        let mut turn = match lease.start_turn(prompt).await {
            Ok(turn) => turn,
            Err(e) => return Err((TurnEnd::Error, Some(e.to_string()))),
        };
        loop {
            tokio::select! {
                event = turn.next() => match event {
                    Some(BackendEvent::TurnEnd(outcome)) => return Ok(outcome),
                    Some(event) => {
                        match &event {
                            BackendEvent::Message { text } => messages.push(text.clone()),
                            BackendEvent::MessageDelta { .. } | BackendEvent::ToolCall { .. } => {
                                streamed = true;
                            }
                            _ => {}
                        }
                        let Some(sse) = cli_event(event, bridged) else { continue };
                        if events.send_timeout(sse, SEND_TIMEOUT).await.is_err() {
                            // Dropping the turn before its end kills the process.
                            return Err((TurnEnd::Aborted, None));
                        }
                    }
                    None => return Err((TurnEnd::Error, Some("the turn ended without turn.end".into()))),
                },
                _ = events.closed() => return Err((TurnEnd::Aborted, None)),
            }
        }
    };
    let result = tracing::Instrument::instrument(summary, span).await;
    let (summary, class, gone) = match result {
        Ok(outcome) => {
            let class = fallback::classify_cli(&outcome);
            // A message that is the CLI's own error is no answer.
            let error_text = match &outcome.failure {
                Some(crate::backend::TurnFailure::Cli { message, .. }) => Some(message.as_str()),
                _ => None,
            };
            streamed |= messages
                .iter()
                .any(|m| Some(m.trim()) != error_text.map(str::trim));
            let summary = cli_turn_end(&lease, reason, Some(outcome), TurnEnd::Idle, None);
            (summary, class, false)
        }
        Err((status, error)) => {
            let gone = status == TurnEnd::Aborted;
            streamed |= !messages.is_empty();
            (
                cli_turn_end(&lease, reason, None, status, error),
                None,
                gone,
            )
        }
    };
    let transcript = Some(summary.session_id.as_str())
        .filter(|id| !id.is_empty())
        .map(|id| PreludeSource::Cli {
            backend: lease.backend().to_owned(),
            kind: lease.kind(),
            home: lease.home().to_path_buf(),
            cwd: lease.working_directory().to_path_buf(),
            session_id: id.to_owned(),
        });
    drop(lease);
    StepEnd {
        summary,
        class,
        streamed,
        transcript,
        gone,
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
