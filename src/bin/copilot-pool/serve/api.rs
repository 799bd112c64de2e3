//! The HTTP API: routes, authentication, JSON errors, and the turn stream. Everything here
//! translates HTTP to the library's pool and lease API; nothing re-implements pool logic.

// Early returns carry the HTTP response itself; boxing every one would only add noise.
#![allow(clippy::result_large_err)]

use std::collections::BTreeMap;
use std::convert::Infallible;
#[cfg(test)]
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::{DefaultBodyLimit, Path, Query, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use copilot_pool::auth::LeaseAuth;
use copilot_pool::kinds::{ErrorKind, TurnEnd};
use copilot_pool::pool::{LeaseRequest, Pool, PoolError};
use copilot_pool::rpc::messages::ProviderConfig;
use copilot_pool::secret::Secret;
use copilot_pool::turn::{TranscriptSettings, TurnTimeouts};
use serde::Deserialize;
use serde_json::{Value, json};
use tokio::sync::{mpsc, watch};

use super::gateway::{AnswerError, Link, Registry, SseEvent};

/// Everything the handlers share.
pub struct AppState {
    pub pool: Pool,
    pub registry: Arc<Registry>,
    pub api_token: Option<Secret>,
    pub draining: AtomicBool,
    /// Turns running now (for the drain), published on every change.
    pub running: watch::Sender<usize>,
    pub timeouts: TurnTimeouts,
    pub transcript: Option<TranscriptSettings>,
    pub metrics: Option<metrics_exporter_prometheus::PrometheusHandle>,
    /// Largest accepted request body.
    pub max_body_bytes: usize,
}

/// A gateway that does not read its event stream for this long is treated as gone (the
/// turn is aborted), so a stalled client cannot pin a conversation.
pub const SEND_TIMEOUT: Duration = Duration::from_secs(30);

/// A request body must arrive within this long; a client that announces more than it sends
/// cannot hold a connection open.
const BODY_TIMEOUT: Duration = Duration::from_secs(30);

/// Reads a request body with the size limit and the time limit.
async fn read_body(state: &AppState, body: Body) -> Result<Bytes, Response> {
    match tokio::time::timeout(
        BODY_TIMEOUT,
        axum::body::to_bytes(body, state.max_body_bytes),
    )
    .await
    {
        Ok(Ok(bytes)) => Ok(bytes),
        Ok(Err(e)) => {
            let too_large = std::error::Error::source(&e)
                .is_some_and(|s| s.to_string().contains("length limit"))
                || e.to_string().contains("length limit");
            if too_large {
                Err(error(
                    StatusCode::PAYLOAD_TOO_LARGE,
                    "too_large",
                    format!(
                        "the body exceeds max_body_bytes ({} bytes)",
                        state.max_body_bytes
                    ),
                ))
            } else {
                Err(error(
                    StatusCode::BAD_REQUEST,
                    "bad_body",
                    format!("could not read the body: {e}"),
                ))
            }
        }
        Err(_) => Err(error(
            StatusCode::REQUEST_TIMEOUT,
            "body_timeout",
            "the body did not arrive in time",
        )),
    }
}

/// The router: `/v1` behind the token, health and metrics outside it.
pub fn router(state: Arc<AppState>, max_body_bytes: usize) -> Router {
    let v1 = Router::new()
        .route("/v1/turns", post(post_turn))
        .route("/v1/requests/{request_id}", post(post_answer))
        .route(
            "/v1/sessions/{agent_id}/{session_key}/abort",
            post(post_abort),
        )
        .route(
            "/v1/sessions/{agent_id}/{session_key}/compact",
            post(post_compact),
        )
        .route(
            "/v1/sessions/{agent_id}/{session_key}",
            axum::routing::delete(delete_session),
        )
        .route("/v1/pool", get(get_pool))
        .route_layer(middleware::from_fn_with_state(state.clone(), require_token));
    Router::new()
        .merge(v1)
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .route("/metrics", get(get_metrics))
        .fallback(|| async { error(StatusCode::NOT_FOUND, "not_found", "no such route") })
        .layer(DefaultBodyLimit::max(max_body_bytes))
        .with_state(state)
}

/// A JSON error `{code, message}`.
pub fn error(status: StatusCode, code: &str, message: impl Into<String>) -> Response {
    (
        status,
        axum::Json(json!({"code": code, "message": message.into()})),
    )
        .into_response()
}

async fn require_token(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    request: axum::extract::Request,
    next: Next,
) -> Response {
    if let Some(token) = &state.api_token {
        let given = headers
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(bearer_token)
            .unwrap_or("");
        if !constant_time_eq(given.as_bytes(), token.expose().as_bytes()) {
            return error(
                StatusCode::UNAUTHORIZED,
                "unauthorized",
                "missing or wrong bearer token (Authorization: Bearer <api token>)",
            );
        }
    }
    next.run(request).await
}

/// The token of an `Authorization: Bearer <token>` value; the scheme is case-insensitive
/// (RFC 9110 §11.1).
fn bearer_token(value: &str) -> Option<&str> {
    let (scheme, token) = value.trim_start().split_once(' ')?;
    scheme
        .eq_ignore_ascii_case("bearer")
        .then(|| token.trim_matches(' '))
}

fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// How long `/healthz` waits for the pool actor to answer.
const HEALTH_TIMEOUT: Duration = Duration::from_secs(2);

/// Alive while the pool actor answers (a status call within `HEALTH_TIMEOUT`); a dead or
/// stuck pool makes it 503, so an orchestrator restarts the daemon. Draining is still alive.
async fn healthz(State(state): State<Arc<AppState>>) -> Response {
    match tokio::time::timeout(HEALTH_TIMEOUT, state.pool.status()).await {
        Ok(Ok(_)) => (StatusCode::OK, "ok\n").into_response(),
        Ok(Err(e)) => {
            (StatusCode::SERVICE_UNAVAILABLE, format!("pool down: {e}\n")).into_response()
        }
        Err(_) => (StatusCode::SERVICE_UNAVAILABLE, "pool not answering\n").into_response(),
    }
}

async fn readyz(State(state): State<Arc<AppState>>) -> Response {
    if state.draining.load(Ordering::SeqCst) {
        return (StatusCode::SERVICE_UNAVAILABLE, "draining\n").into_response();
    }
    match state.pool.status().await {
        Ok(s) if !s.closed => (StatusCode::OK, "ready\n").into_response(),
        _ => (StatusCode::SERVICE_UNAVAILABLE, "not ready\n").into_response(),
    }
}

async fn get_metrics(State(state): State<Arc<AppState>>) -> Response {
    match &state.metrics {
        Some(handle) => (
            [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
            handle.render(),
        )
            .into_response(),
        None => error(
            StatusCode::NOT_FOUND,
            "not_found",
            "metrics are served on metrics_listen",
        ),
    }
}

async fn get_pool(State(state): State<Arc<AppState>>) -> Response {
    match state.pool.status().await {
        Ok(mut status) => {
            // The daemon drains a moment before its pool closes.
            status.closed |= state.draining.load(Ordering::SeqCst);
            axum::Json(status).into_response()
        }
        Err(e) => error(
            StatusCode::SERVICE_UNAVAILABLE,
            "pool_closed",
            e.to_string(),
        ),
    }
}

/// Parses a JSON body; the error names the field serde complained about.
fn parse<T: for<'de> Deserialize<'de>>(body: &Bytes) -> Result<T, Response> {
    serde_json::from_slice(body).map_err(|e| {
        error(
            StatusCode::BAD_REQUEST,
            "bad_request",
            format!("invalid JSON body: {e}"),
        )
    })
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ProviderBody {
    #[serde(rename = "type", default)]
    kind: Option<copilot_pool::ProviderType>,
    base_url: String,
    #[serde(default)]
    api_key: Option<Secret>,
    #[serde(default)]
    bearer_token: Option<Secret>,
    #[serde(default)]
    wire_api: Option<copilot_pool::WireApi>,
    #[serde(default)]
    headers: Option<BTreeMap<String, String>>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct AuthBody {
    #[serde(default)]
    use_logged_in_user: bool,
    #[serde(default)]
    github_token: Option<Secret>,
    #[serde(default)]
    profile_id: Option<String>,
    #[serde(default)]
    profile_version: Option<String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ToolBody {
    name: String,
    #[serde(default)]
    description: String,
    #[serde(default = "empty_schema")]
    parameters: Value,
}

fn empty_schema() -> Value {
    json!({"type": "object", "properties": {}})
}

/// What identifies and configures a conversation (shared by turns, compact and reset).
#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct ConversationBody {
    #[serde(default)]
    auth: Option<AuthBody>,
    #[serde(default)]
    model: Option<String>,
    #[serde(default)]
    provider: Option<ProviderBody>,
    #[serde(default)]
    reasoning_effort: Option<copilot_pool::ReasoningEffort>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct TurnBody {
    agent_id: String,
    session_key: String,
    prompt: String,
    #[serde(default)]
    auth: Option<AuthBody>,
    #[serde(default)]
    model: Option<String>,
    #[serde(default)]
    provider: Option<ProviderBody>,
    #[serde(default)]
    reasoning_effort: Option<copilot_pool::ReasoningEffort>,
    #[serde(default)]
    tools: Vec<ToolBody>,
    #[serde(default)]
    timeout_ms: Option<u64>,
}

#[derive(Deserialize, Default)]
struct TurnQuery {
    #[serde(default)]
    stream: Option<bool>,
}

fn provider_config(p: ProviderBody) -> Result<ProviderConfig, Response> {
    let provider = ProviderConfig {
        kind: p.kind,
        wire_api: p.wire_api,
        base_url: p.base_url,
        api_key: p.api_key,
        bearer_token: p.bearer_token,
        headers: p.headers,
    };
    // The library's checks: a Rust embedder gets the same errors.
    copilot_pool::pool::validate_provider(&provider).map_err(|e| pool_error(&e))?;
    Ok(provider)
}

/// The agent's working directory (the library's layout, beside its home).
fn work_dir(state: &AppState, agent_id: &str) -> Result<std::path::PathBuf, Response> {
    copilot_pool::home::work_dir(&state.pool.config().agents_base_dir, agent_id)
        .map_err(|e| error(StatusCode::BAD_REQUEST, "bad_request", e.to_string()))
}

/// Creates the agent's working directory, mode 0700. Called only for a request that passed
/// authentication and validation and is about to run a turn.
fn create_work_dir(work: &std::path::Path) -> Result<(), Response> {
    copilot_pool::home::create_work_dir(work)
        .map_err(|e| error(StatusCode::INTERNAL_SERVER_ERROR, "io", e.to_string()))
}

/// The lease request for a conversation; the working directory is the agent's own (not
/// created here: compact and reset must not create it).
fn lease_request(
    state: &AppState,
    agent_id: &str,
    session_key: &str,
    conv: ConversationBody,
) -> Result<LeaseRequest, Response> {
    if session_key.is_empty() || session_key.len() > 512 {
        return Err(error(
            StatusCode::BAD_REQUEST,
            "bad_request",
            "session_key must be 1 to 512 characters",
        ));
    }
    copilot_pool::home::validate_agent_id(agent_id).map_err(|e| {
        error(
            StatusCode::BAD_REQUEST,
            "bad_request",
            format!("agent_id: {e}"),
        )
    })?;
    let mut req = LeaseRequest::new(agent_id, session_key, work_dir(state, agent_id)?);
    if let Some(auth) = conv.auth {
        req.auth = LeaseAuth {
            use_logged_in_user: auth.use_logged_in_user,
            github_token: auth.github_token,
            profile_id: auth.profile_id,
            profile_version: auth.profile_version,
            ..Default::default()
        };
    }
    req.model = conv.model;
    req.provider = conv.provider.map(provider_config).transpose()?;
    req.reasoning_effort = conv.reasoning_effort;
    req.handlers.timeouts = state.timeouts;
    req.handlers.transcript = state.transcript.clone();
    Ok(req)
}

/// The HTTP status and code for a pool error before a turn starts.
fn pool_error(e: &PoolError) -> Response {
    let (status, code) = match e.kind() {
        ErrorKind::Invalid => (StatusCode::BAD_REQUEST, "bad_request"),
        ErrorKind::NotFound => (StatusCode::NOT_FOUND, "not_found"),
        ErrorKind::Busy | ErrorKind::BusyTimeout => (StatusCode::CONFLICT, "busy"),
        ErrorKind::NoCapacity | ErrorKind::WaitersFull => {
            (StatusCode::SERVICE_UNAVAILABLE, "no_capacity")
        }
        ErrorKind::Quarantined => (StatusCode::SERVICE_UNAVAILABLE, "quarantined"),
        ErrorKind::Closed => (StatusCode::SERVICE_UNAVAILABLE, "draining"),
        ErrorKind::StateUnwritable => (StatusCode::SERVICE_UNAVAILABLE, "state_unwritable"),
        ErrorKind::ResourceExhausted => (StatusCode::SERVICE_UNAVAILABLE, "resource_exhausted"),
        ErrorKind::Internal => (StatusCode::INTERNAL_SERVER_ERROR, "internal"),
        ErrorKind::Runtime => (StatusCode::BAD_GATEWAY, "runtime"),
    };
    error(status, code, e.to_string())
}

async fn post_turn(
    State(state): State<Arc<AppState>>,
    Query(query): Query<TurnQuery>,
    body: Body,
) -> Response {
    if state.draining.load(Ordering::SeqCst) {
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
    let body: TurnBody = match parse(&body) {
        Ok(b) => b,
        Err(r) => return r,
    };
    let conv = ConversationBody {
        auth: body.auth,
        model: body.model,
        provider: body.provider,
        reasoning_effort: body.reasoning_effort,
    };
    let mut req = match lease_request(&state, &body.agent_id, &body.session_key, conv) {
        Ok(r) => r,
        Err(r) => return r,
    };
    if let Some(ms) = body.timeout_ms {
        if ms == 0 {
            return error(
                StatusCode::BAD_REQUEST,
                "bad_request",
                "timeout_ms must be above 0",
            );
        }
        req.handlers.timeouts.absolute = Duration::from_millis(ms);
    }
    let streaming = query.stream != Some(false);
    if !streaming && !body.tools.is_empty() {
        return error(
            StatusCode::BAD_REQUEST,
            "bad_request",
            "tools need the event stream (their calls are answered from it); drop ?stream=false",
        );
    }
    let (events_tx, events_rx) = mpsc::channel::<SseEvent>(256);
    if streaming {
        let link = Link {
            events: events_tx.clone(),
            registry: state.registry.clone(),
        };
        req.handlers.tools = body
            .tools
            .into_iter()
            .map(|t| link.tool(t.name, t.description, t.parameters))
            .collect();
        req.handlers.permission_policy = Arc::new(link.clone());
        req.handlers.user_input = Some(Arc::new(link));
    }
    // Without the stream nobody could answer: permissions are rejected, ask_user is off.

    // Everything is checked: this request runs a turn, so its working directory may exist.
    if let Err(r) = create_work_dir(&req.working_directory) {
        return r;
    }
    // The lease is taken before answering, so its errors are real HTTP errors.
    let lease = match state.pool.lease(req).await {
        Ok(l) => l,
        Err(e) => return pool_error(&e),
    };
    state.running.send_modify(|n| *n += 1);
    tokio::spawn(run_turn(
        state.clone(),
        lease,
        body.prompt,
        events_tx,
        body.agent_id.clone(),
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
/// whether the runtime still had its context), the model calls, the final text, the token
/// usage and the runtime's `session.task_complete` data, if any.
fn turn_end(status: &str, lease: &copilot_pool::pool::Lease, error: Option<String>) -> SseEvent {
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
            "usage": outcome.usage,
            "task_complete": outcome.task_complete,
        }),
    }
}

/// Runs one turn and streams it; a gateway that goes away (or stops reading) aborts the
/// turn (dropping the lease does), and the conversation stays resumable.
async fn run_turn(
    state: Arc<AppState>,
    mut lease: copilot_pool::pool::Lease,
    prompt: String,
    events: mpsc::Sender<SseEvent>,
    agent_id: String,
) {
    let span = tracing::info_span!("turn", agent = %agent_id, session = %lease.cli_session_id());
    let summary = async {
        if let Err(e) = lease.send(prompt).await {
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
    state.running.send_modify(|n| *n = n.saturating_sub(1));
}

async fn post_answer(
    State(state): State<Arc<AppState>>,
    Path(request_id): Path<String>,
    body: Body,
) -> Response {
    let body = match read_body(&state, body).await {
        Ok(b) => b,
        Err(r) => return r,
    };
    let body: Value = match parse(&body) {
        Ok(b) => b,
        Err(r) => return r,
    };
    match state.registry.answer(&request_id, &body) {
        Ok(()) => StatusCode::NO_CONTENT.into_response(),
        Err(AnswerError::Unknown) => error(
            StatusCode::NOT_FOUND,
            "not_found",
            "no pending request with this id (answered already, or its turn ended)",
        ),
        Err(AnswerError::Shape(message)) => error(StatusCode::BAD_REQUEST, "bad_request", message),
    }
}

async fn post_abort(
    State(state): State<Arc<AppState>>,
    Path((agent_id, session_key)): Path<(String, String)>,
) -> Response {
    let conversation = copilot_pool::pool::ConversationId::new(agent_id, session_key);
    match state.pool.abort(&conversation).await {
        Ok(true) => StatusCode::NO_CONTENT.into_response(),
        Ok(false) => error(
            StatusCode::NOT_FOUND,
            "not_found",
            "no running turn for this conversation",
        ),
        Err(e) => pool_error(&e),
    }
}

/// The body of compact/reset: the conversation's settings (they must match its turns, or a
/// new session would be opened), optional.
fn conversation_body(body: &Bytes) -> Result<ConversationBody, Response> {
    if body.iter().all(|b| b.is_ascii_whitespace()) {
        return Ok(ConversationBody::default());
    }
    parse(body)
}

/// The lease of an existing conversation for compact and reset (never a new session).
async fn existing_lease(
    state: &AppState,
    agent_id: &str,
    session_key: &str,
    body: Body,
) -> Result<copilot_pool::pool::Lease, Response> {
    let body = read_body(state, body).await?;
    let conv = conversation_body(&body)?;
    let mut req = lease_request(state, agent_id, session_key, conv)?;
    req.existing_only = true;
    state.pool.lease(req).await.map_err(|e| pool_error(&e))
}

async fn post_compact(
    State(state): State<Arc<AppState>>,
    Path((agent_id, session_key)): Path<(String, String)>,
    body: Body,
) -> Response {
    let mut lease = match existing_lease(&state, &agent_id, &session_key, body).await {
        Ok(l) => l,
        Err(r) => return r,
    };
    match lease.compact(None).await {
        Ok(r) => axum::Json(json!({
            "success": r.success,
            "tokens_removed": r.tokens_removed,
            "messages_removed": r.messages_removed,
        }))
        .into_response(),
        Err(e) => pool_error(&e),
    }
}

async fn delete_session(
    State(state): State<Arc<AppState>>,
    Path((agent_id, session_key)): Path<(String, String)>,
    body: Body,
) -> Response {
    let lease = match existing_lease(&state, &agent_id, &session_key, body).await {
        Ok(l) => l,
        Err(r) => return r,
    };
    match lease.reset().await {
        Ok(()) => StatusCode::NO_CONTENT.into_response(),
        Err(e) => pool_error(&e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use copilot_pool::pool::PoolConfig;
    use copilot_pool::worker::WorkerConfig;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    async fn get(addr: std::net::SocketAddr, path: &str) -> String {
        let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
        let request = format!("GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
        stream.write_all(request.as_bytes()).await.unwrap();
        let mut answer = String::new();
        stream.read_to_string(&mut answer).await.unwrap();
        answer
    }

    #[tokio::test]
    async fn healthz_is_503_once_the_pool_actor_is_gone() {
        let dir = tempfile::tempdir().unwrap();
        // No lease is taken, so the program is never started.
        let worker = WorkerConfig::new("/nonexistent".into(), PathBuf::new(), PathBuf::new());
        let config = PoolConfig::new(worker, dir.path().join("state"), dir.path().into());
        let pool = Pool::start(config).await.unwrap();
        let (running, _) = watch::channel(0);
        let state = Arc::new(AppState {
            pool: pool.clone(),
            registry: Arc::default(),
            api_token: None,
            draining: AtomicBool::new(false),
            running,
            timeouts: TurnTimeouts::default(),
            transcript: None,
            metrics: None,
            max_body_bytes: 1024,
        });
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let server = tokio::spawn(axum::serve(listener, router(state, 1024)).into_future());

        let alive = get(addr, "/healthz").await;
        assert!(alive.starts_with("HTTP/1.1 200"), "{alive}");
        // The pool's actor stops at the end of its shutdown.
        pool.shutdown().await.unwrap();
        let dead = get(addr, "/healthz").await;
        assert!(dead.starts_with("HTTP/1.1 503"), "{dead}");
        server.abort();
    }

    #[test]
    fn the_bearer_scheme_is_case_insensitive() {
        assert_eq!(bearer_token("Bearer abc"), Some("abc"));
        assert_eq!(bearer_token("bearer abc"), Some("abc"));
        assert_eq!(bearer_token("BEARER  abc "), Some("abc"));
        assert_eq!(bearer_token("Basic abc"), None);
        assert_eq!(bearer_token("Bearerabc"), None);
    }
}
