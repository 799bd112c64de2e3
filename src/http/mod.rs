//! The pool's HTTP API as a library module (feature `http`): the routes a gateway in any
//! language calls (`/v1/turns` with its event stream, answers to the requests a turn asks
//! the gateway, abort, compact, reset, `/v1/pool`, health and metrics), and a listener that
//! serves them with connection limits. `copilot-pool serve` is this module plus a config
//! file, a Prometheus recorder, signals and logging; a Rust gateway mounts the same router
//! in its own axum app:
//!
//! ```no_run
//! # async fn mount(pool: copilot_pool::Pool) {
//! use copilot_pool::http::{self, ApiConfig};
//!
//! let app = axum::Router::new()
//!     .route("/", axum::routing::get(|| async { "the gateway" }))
//!     .nest("/pool", http::router(pool, ApiConfig::default()));
//! // Without an API token, the router answers `/v1` for this machine's clients only (a
//! // loopback `Host`, no `Origin`); an app that authenticates every request before it
//! // reaches the router says so with `TokenlessAccess::Anyone`.
//! # let _ = app;
//! # }
//! ```
//!
//! Like the rest of the crate it installs nothing global: `/metrics` renders whatever
//! [`ApiConfig::metrics`] gives it, and the caller decides when to drain
//! ([`ApiHandle::set_draining`]) and when to stop serving ([`serve`]'s `shutdown`).
//!
//! - `attachments` — a turn's attachments: paths confined to the agent's work directory or
//!   the allowed roots, inline content checked and written into the work directory.
//! - `auth` — who may call `/v1`: the bearer token, or without one this machine's clients
//!   ([`TokenlessAccess`]).
//! - `body` — reading and parsing request bodies into lease requests.
//! - `error` — `{code, message}` answers and the status of each pool error kind.
//! - `events` — the SSE events of a turn, typed (what the document shows is what is sent).
//! - `openapi` — the OpenAPI 3.1 document, from the handlers' `#[utoipa::path]` and the
//!   types' `ToSchema`, served on `/openapi.json`.
//! - `gateway` — requests the gateway answers over HTTP (tool calls, permissions, ask_user,
//!   hooks).
//! - `health` — `/healthz`, `/readyz`, `/metrics`, `/v1/pool`.
//! - `sessions` — abort, compact and reset of a conversation.
//! - `turns` — `POST /v1/turns` and its event stream.
//! - `serve`, `ConnectionLimits`, `Acceptor` (from the crate's `listener`, which the MCP
//!   bridge shares) — accepting connections with a cap, timeouts and a graceful stop.
//! - `object` — request bodies' objects read from JSON objects only (never from arrays).

// Early returns carry the HTTP response itself; boxing every one would only add noise.
#![allow(clippy::result_large_err)]

mod attachments;
mod auth;
mod body;
mod error;
mod events;
mod gateway;
mod health;
mod idempotency;
mod object;
mod openapi;
mod query_check;
mod sessions;
mod stream;
mod turns;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use tokio_util::sync::CancellationToken;

use axum::Router;
use axum::http::StatusCode;
use axum::middleware;
use tokio::sync::watch;

use crate::pool::Pool;
use crate::secret::Secret;
use crate::turn::{TranscriptSettings, TurnTimeouts};

pub use crate::listener::{Acceptor, ConnectionLimits, serve};
pub use attachments::AttachmentLimits;
pub use auth::TokenlessAccess;
pub(crate) use body::fuzz_request_bodies;
pub use idempotency::IdempotencyLimits;
pub use openapi::{document as openapi_document, document_json as openapi_json};

/// Renders the metrics text `/metrics` answers with (for example a Prometheus recorder's
/// `render`); the caller owns the recorder.
#[derive(Clone)]
pub struct MetricsRender(Arc<dyn Fn() -> String + Send + Sync>);

impl MetricsRender {
    /// `/metrics` answers with what `render` returns, called on every scrape.
    pub fn new(render: impl Fn() -> String + Send + Sync + 'static) -> Self {
        Self(Arc::new(render))
    }

    fn render(&self) -> String {
        (self.0)()
    }
}

impl std::fmt::Debug for MetricsRender {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("MetricsRender(..)")
    }
}

/// What the API needs besides the pool.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct ApiConfig {
    /// Bearer token every `/v1` call must carry; `None` leaves `/v1` to whom
    /// [`ApiConfig::tokenless_access`] says. An empty token is refused as a misconfiguration
    /// (every `/v1` call answers 500).
    pub api_token: Option<Secret>,
    /// Who may call `/v1` without a token (when `api_token` is `None`): this machine's
    /// clients only (the default: a request must name `localhost`, `127.x.y.z` or `[::1]` as
    /// its host and carry no `Origin`, so no web page can drive it), or anyone (an embedding
    /// app that authenticates every request before it reaches the router).
    pub tokenless_access: TokenlessAccess,
    /// The timeouts of every turn (a request's `timeout_ms` overrides the absolute one).
    pub timeouts: TurnTimeouts,
    /// A turn whose gateway leaves more than this many bytes of its events unread (an SSE
    /// stream read too slowly) is aborted
    /// ([`crate::turn::TurnHandlers::max_unread_event_bytes`]; default
    /// [`crate::turn::DEFAULT_MAX_UNREAD_EVENT_BYTES`]).
    pub max_unread_event_bytes: usize,
    /// Mirror every conversation's transcript, if set.
    pub transcript: Option<TranscriptSettings>,
    /// Largest accepted request body, in bytes (larger ones are answered 413, and so are
    /// bodies holding more JSON values than one per 32 bytes of it, at least 65,536).
    pub max_body_bytes: usize,
    /// `/metrics` answers with this; `None` answers 404 (metrics served elsewhere, or not
    /// at all).
    pub metrics: Option<MetricsRender>,
    /// Directories a conversation's `session.workingDirectory` and
    /// `session.additionalDirectories`, and a turn's attachments by path, may lie under,
    /// besides the agent's own working directory (`<agents base>/agents/<agent_id>/work`).
    /// Default: none.
    pub allowed_work_roots: Vec<std::path::PathBuf>,
    /// Accept `session.mcpServers` entries that start a local command (default `false`:
    /// only remote `http`/`sse` servers).
    pub allow_local_mcp_servers: bool,
    /// Inline attachments: the size limit and the media types accepted.
    pub attachments: AttachmentLimits,
    /// The environment level of the credentials: token variables (`OPENCLAW_GITHUB_TOKEN`,
    /// `COPILOT_GITHUB_TOKEN`, `GH_TOKEN`, `GITHUB_TOKEN`; the first non-empty one wins,
    /// profile `env:<NAME>`) that a request with no token of its own runs with. Empty (the
    /// default) turns the level off. The library never reads the process environment: the
    /// caller fills this (`copilot-pool serve` from its own environment at start, when its
    /// config says `[auth] env_fallback = true`).
    pub env_tokens: BTreeMap<String, Secret>,
    /// Let requests run as the user logged in to the Copilot CLI on this machine (default
    /// `false`). When `false`, `use_logged_in_user` is a 400 and a request with no token
    /// runs with no GitHub identity, which only a BYOK provider can serve (without one it
    /// is a 400 that says which credentials to send).
    pub allow_logged_in_user: bool,
    /// What the workers' sandbox enforces, reported as `sandbox` in `GET /v1/pool` (the
    /// daemon fills it from its probe; `None` leaves the field out).
    pub sandbox: Option<crate::sandbox::SandboxStatus>,
    /// A turn's event stream sends an SSE comment (`: keep-alive`) after this long without an
    /// event (default 15 s; zero: never), so a proxy between the gateway and the daemon
    /// (nginx's and most load balancers' 60 s idle limit) does not cut a turn that waits
    /// quietly on a tool, a permission or the model, which would abort it.
    pub sse_keepalive: std::time::Duration,
    /// How long, and within how many bytes, a turn asked with an `Idempotency-Key` header
    /// answers the gateway's retry of it with its `turn.end` instead of running again.
    pub idempotency: IdempotencyLimits,
}

impl Default for ApiConfig {
    fn default() -> Self {
        Self {
            api_token: None,
            tokenless_access: TokenlessAccess::ThisMachine,
            timeouts: TurnTimeouts::default(),
            max_unread_event_bytes: crate::turn::DEFAULT_MAX_UNREAD_EVENT_BYTES,
            transcript: None,
            max_body_bytes: 1 << 20,
            metrics: None,
            allowed_work_roots: Vec::new(),
            allow_local_mcp_servers: false,
            attachments: AttachmentLimits::default(),
            env_tokens: BTreeMap::new(),
            allow_logged_in_user: false,
            sandbox: None,
            sse_keepalive: std::time::Duration::from_secs(15),
            idempotency: IdempotencyLimits::default(),
        }
    }
}

/// Everything the handlers share.
struct AppState {
    pool: Pool,
    config: ApiConfig,
    registry: Arc<gateway::Registry>,
    draining: AtomicBool,
    /// Turns running now (for the drain), published on every change.
    running: watch::Sender<usize>,
    /// The OpenAPI document of this router, as JSON.
    openapi: axum::body::Bytes,
    /// The stop flags of the turns asked for and not yet over, by conversation key: an
    /// abort stops them wherever they are (waiting for their lease, between backends,
    /// about to send), not only one whose prompt the runtime already has.
    stops: std::sync::Mutex<std::collections::HashMap<String, Vec<Arc<CancellationToken>>>>,
    /// The turns asked with an `Idempotency-Key`, for their retries.
    replays: Arc<idempotency::Replays>,
}

impl AppState {
    fn draining(&self) -> bool {
        self.draining.load(Ordering::SeqCst)
    }

    /// Registers a turn of `conversation` (its key) that an abort may stop until the
    /// returned guard drops.
    fn turn_stop(self: &Arc<Self>, conversation: String) -> TurnStop {
        let token = Arc::new(CancellationToken::new());
        if let Ok(mut stops) = self.stops.lock() {
            stops
                .entry(conversation.clone())
                .or_default()
                .push(token.clone());
        }
        TurnStop {
            state: self.clone(),
            conversation,
            token,
        }
    }

    /// Asks the conversation's earliest registered turn to stop (the one running, or the
    /// one waiting for its lease: a conversation's leases are granted in order), not those
    /// asked for after it (a gateway may send its next message, then stop the current one);
    /// whether there was one.
    fn stop_turn(&self, conversation: &str) -> bool {
        let Ok(stops) = self.stops.lock() else {
            return false;
        };
        match stops.get(conversation).and_then(|tokens| tokens.first()) {
            Some(token) => {
                token.cancel();
                true
            }
            None => false,
        }
    }
}

/// A turn's stop, registered with the router until it drops (with the turn's sink).
struct TurnStop {
    state: Arc<AppState>,
    conversation: String,
    token: Arc<CancellationToken>,
}

impl TurnStop {
    /// Whether an abort asked this turn to stop.
    fn requested(&self) -> bool {
        self.token.is_cancelled()
    }

    /// Resolves once an abort asks this turn to stop.
    async fn asked(&self) {
        self.token.cancelled().await;
    }
}

impl Drop for TurnStop {
    fn drop(&mut self) {
        if let Ok(mut stops) = self.state.stops.lock()
            && let Some(flags) = stops.get_mut(&self.conversation)
        {
            flags.retain(|t| !Arc::ptr_eq(t, &self.token));
            if flags.is_empty() {
                stops.remove(&self.conversation);
            }
        }
    }
}

/// The caller's hold on a router's state: drain it, and see its turns finish.
#[derive(Clone)]
pub struct ApiHandle {
    state: Arc<AppState>,
}

impl ApiHandle {
    /// From now on `/readyz` is 503 and new turns are refused with 503 `draining`; running
    /// turns go on, and their requests are still answered. Does not close the pool (call
    /// [`Pool::shutdown`] for that).
    pub fn set_draining(&self) {
        self.state.draining.store(true, Ordering::SeqCst);
    }

    /// Whether [`set_draining`](Self::set_draining) was called.
    pub fn is_draining(&self) -> bool {
        self.state.draining()
    }

    /// Turns running through this router now (their summary not yet sent).
    pub fn running_turns(&self) -> usize {
        *self.state.running.borrow()
    }

    /// Resolves once no turn is running through this router.
    pub async fn turns_finished(&self) {
        let mut running = self.state.running.subscribe();
        // The sender lives in the state this handle holds, so the wait cannot fail.
        let _ = running.wait_for(|n| *n == 0).await;
    }
}

/// The API's router over `pool`: `/v1` behind the token, `/healthz`, `/readyz` and
/// `/metrics` outside it. Mount it anywhere (`nest`, `merge`) or serve it with [`serve`].
pub fn router(pool: Pool, config: ApiConfig) -> Router {
    router_with_handle(pool, config).0
}

/// Like [`router`], with the handle that drains it and observes its turns.
pub fn router_with_handle(pool: Pool, config: ApiConfig) -> (Router, ApiHandle) {
    // The routes come with their documentation: what is served is what is documented.
    let (v1, v1_doc) = openapi::v1_routes().split_for_parts();
    let (open, open_doc) = openapi::open_routes().split_for_parts();
    let mut doc = v1_doc;
    doc.merge(open_doc);
    let queries = Arc::new(query_check::RouteQueries::of(&doc));
    let openapi = match openapi::pretty(&openapi::with_info(doc)) {
        Ok(text) => axum::body::Bytes::from(text),
        // Serializing plain strings and maps does not fail; should it, say so.
        Err(e) => axum::body::Bytes::from(
            serde_json::json!({"code": "internal", "message": e.to_string()}).to_string(),
        ),
    };
    let replays = idempotency::Replays::new(config.idempotency);
    let state = Arc::new(AppState {
        pool,
        config,
        registry: Arc::default(),
        draining: AtomicBool::new(false),
        running: watch::Sender::new(0),
        openapi,
        stops: std::sync::Mutex::default(),
        replays,
    });
    let v1 = v1.route_layer(middleware::from_fn_with_state(
        state.clone(),
        auth::require_token,
    ));
    let router = Router::new()
        .merge(v1)
        .merge(open)
        // Before the token check: what a route takes is public (`/openapi.json`).
        .route_layer(middleware::from_fn_with_state(
            queries,
            query_check::refuse_unknown,
        ))
        .fallback(|| async { error::error(StatusCode::NOT_FOUND, "not_found", "no such route") })
        .method_not_allowed_fallback(|method: axum::http::Method| async move {
            error::error(
                StatusCode::METHOD_NOT_ALLOWED,
                "method_not_allowed",
                format!(
                    "{method} is not a method of this route; GET /openapi.json lists each \
                     route's methods"
                ),
            )
        })
        .with_state(state.clone());
    (router, ApiHandle { state })
}
