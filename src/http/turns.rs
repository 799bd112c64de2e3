//! `POST /v1/turns`: leases the conversation before answering (so its errors are real HTTP
//! errors), then runs the turn in a task and streams its events as SSE, ending with one
//! `turn.end` summary (or answers that summary alone with `?stream=false`). A gateway that
//! goes away, or stops reading for `SEND_TIMEOUT`, aborts its turn; the conversation stays
//! resumable.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::{Query, State};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use serde_json::json;
use tokio::sync::mpsc;

use super::AppState;
use super::attachments::{check_off_thread, write_off_thread};
use super::body::{TurnBody, create_work_dir, lease_request, parse, read_body};
use super::error::{error, pool_error};
use super::gateway::{Link, SseEvent};
use crate::kinds::TurnEnd;
use crate::pool::Lease;
use crate::turn::Message;

/// A gateway that does not read its event stream for this long is treated as gone (the
/// turn is aborted), so a stalled client cannot pin a conversation.
pub(super) const SEND_TIMEOUT: Duration = Duration::from_secs(30);

#[derive(Deserialize, Default)]
pub(super) struct TurnQuery {
    #[serde(default)]
    stream: Option<bool>,
}

pub(super) async fn post_turn(
    State(state): State<Arc<AppState>>,
    Query(query): Query<TurnQuery>,
    body: Body,
) -> Response {
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
    let (events_tx, events_rx) = mpsc::channel::<SseEvent>(256);
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
            if event.event == "turn.end" {
                return axum::Json(event.data).into_response();
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
        let last = event.event == "turn.end";
        let frame = format!("event: {}\ndata: {}\n\n", event.event, event.data);
        Some((Ok::<_, Infallible>(Bytes::from(frame)), (rx, last)))
    });
    Response::builder()
        .status(StatusCode::OK)
        .header(header::CONTENT_TYPE, "text/event-stream")
        .header(header::CACHE_CONTROL, "no-cache")
        .body(Body::from_stream(stream))
        .unwrap_or_else(|_| error(StatusCode::INTERNAL_SERVER_ERROR, "internal", "response"))
}

/// The `turn.end` summary: how it ended, how the conversation was opened (`open_reason`:
/// whether the runtime still had its context), the model calls, the final text, the error
/// with the failing model call's HTTP status and the runtime's error type, the token usage
/// and the runtime's `session.task_complete` data, if any.
fn turn_end(status: &str, lease: &Lease, error: Option<String>) -> SseEvent {
    let outcome = lease.outcome();
    SseEvent {
        event: "turn.end".to_owned(),
        data: json!({
            "status": status,
            "session_id": lease.cli_session_id(),
            "resumed": lease.reason().continued(),
            "open_reason": outcome.open_reason,
            "llm_calls": outcome.model_calls,
            "final_text": outcome.text,
            "error": error,
            "status_code": outcome.status_code,
            "error_type": outcome.error_type,
            "usage": outcome.usage,
            "task_complete": outcome.task_complete,
        }),
    }
}

/// Runs one turn and streams it; a gateway that goes away (or stops reading) aborts the
/// turn (dropping the lease does), and the conversation stays resumable.
async fn run_turn(
    _running: Running,
    mut lease: Lease,
    message: Message,
    events: mpsc::Sender<SseEvent>,
    agent_id: String,
) {
    let span = tracing::info_span!("turn", agent = %agent_id, session = %lease.cli_session_id());
    let summary = async {
        if let Err(e) = lease.send(message).await {
            return turn_end("error", &lease, Some(e.to_string()));
        }
        loop {
            tokio::select! {
                event = lease.next_event() => match event {
                    Some(Ok(event)) => {
                        let sse = SseEvent { event: event.event_type().to_owned(), data: event.to_value() };
                        if events.send_timeout(sse, SEND_TIMEOUT).await.is_err() {
                            // The gateway disconnected or stopped reading: dropping the lease
                            // aborts the turn.
                            return turn_end("aborted", &lease, None);
                        }
                    }
                    Some(Err(e)) => {
                        let status = lease.outcome().end.map_or("error", TurnEnd::label);
                        return turn_end(status, &lease, Some(e.to_string()));
                    }
                    None => {
                        let o = lease.outcome();
                        let status = o.end.map_or("error", TurnEnd::label);
                        return turn_end(status, &lease, o.error.clone());
                    }
                },
                _ = events.closed() => return turn_end("aborted", &lease, None),
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
