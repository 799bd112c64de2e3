//! `POST /v1/turns`: leases the conversation before answering (so its errors are real HTTP
//! errors), then runs the turn in a task and streams its events as SSE, ending with one
//! `turn.end` summary (or answers that summary alone with `?stream=false`). A gateway that
//! goes away, or stops reading for `SEND_TIMEOUT`, aborts its turn; the conversation stays
//! resumable.

use std::convert::Infallible;
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
use super::events::{SessionEventData, TurnEndEvent, TurnEvent, TurnEventStream};
use super::gateway::Link;
use crate::kinds::TurnEnd;
use crate::pool::Lease;
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
        (status = 409, description = "The conversation runs another turn (`busy`)", body = ErrorBody),
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
    let mut req = match lease_request(&state, &body.agent_id, &body.session_key, conv).await {
        Ok(r) => r,
        Err(r) => return r,
    };
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
    if let Err(message) = check_tools(&body.tools) {
        return error(StatusCode::BAD_REQUEST, "bad_request", message);
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
    // The lease is taken before answering, so its errors are real HTTP errors.
    let lease = match state.pool.lease(req).await {
        Ok(l) => l,
        Err(e) => return pool_error(&e),
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
    tokio::spawn(run_turn(
        Running::start(state.clone()),
        lease,
        message,
        events_tx,
        body.agent_id,
    ));

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
fn turn_end(status: TurnEnd, lease: &Lease, error: Option<String>) -> TurnEvent {
    let outcome = lease.outcome();
    TurnEvent::TurnEnd(TurnEndEvent {
        status,
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
    })
}

/// Runs one turn and streams it; a gateway that goes away (or stops reading) aborts the
/// turn (dropping the lease does), and the conversation stays resumable.
async fn run_turn(
    _running: Running,
    mut lease: Lease,
    message: Message,
    events: mpsc::Sender<TurnEvent>,
    agent_id: String,
) {
    let span = tracing::info_span!("turn", agent = %agent_id, session = %lease.cli_session_id());
    let summary = async {
        if let Err(e) = lease.send(message).await {
            return turn_end(TurnEnd::Error, &lease, Some(e.to_string()));
        }
        loop {
            tokio::select! {
                event = lease.next_event() => match event {
                    Some(Ok(event)) => {
                        let sse = TurnEvent::Session(SessionEventData::from(&event));
                        if events.send_timeout(sse, SEND_TIMEOUT).await.is_err() {
                            // The gateway disconnected or stopped reading: dropping the lease
                            // aborts the turn.
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
                _ = events.closed() => return turn_end(TurnEnd::Aborted, &lease, None),
            }
        }
    };
    let summary = tracing::Instrument::instrument(summary, span).await;
    drop(lease);
    let _ = events.send_timeout(summary, SEND_TIMEOUT).await;
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
