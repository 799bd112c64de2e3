//! One BYOK worker's tunnel: every model request of its runtime is checked, resolved once,
//! sent with the real credentials over a connection pinned to the checked addresses, and
//! streamed back chunk by chunk; each request is counted in the model metrics.

use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures_util::StreamExt;
use reqwest::Url;
use reqwest::header::{HeaderMap, HeaderName, HeaderValue};
use tokio::sync::{Semaphore, mpsc};
use url::Host;

use super::resolve::RefuseNames;
use super::target::{self, Refusal};
use super::{GuardError, ModelGuard, PLACEHOLDER_API_KEY, PLACEHOLDER_BEARER_TOKEN, priming};
use crate::kinds::{BlockReason, ModelOutcome};
use crate::metrics::{self, ModelDirection};
use crate::rpc::messages::ProviderConfig;
use crate::tunnel::{BodyChunk, ModelRequest, ModelResponse, ModelTunnel, ServeFuture};

/// Pinned clients kept per worker (one per distinct DNS answer; the oldest goes first).
const CLIENT_CACHE: usize = 8;
/// Same-origin redirects followed; a redirect to another origin is answered as it is.
const MAX_REDIRECTS: usize = 5;
/// Body chunks buffered between the provider and the runtime.
const BODY_CHANNEL: usize = 16;

/// Request headers of the runtime passed on upstream (lowercase). Credentials are not in
/// this list: see [`AUTH_HEADERS`].
const FORWARDED_REQUEST_HEADERS: &[&str] = &[
    "content-type",
    "accept",
    "user-agent",
    "anthropic-version",
    "anthropic-beta",
    "openai-beta",
    "x-request-id",
    "idempotency-key",
];
/// Request header name prefixes passed on upstream (the SDKs' own metadata).
const FORWARDED_REQUEST_PREFIXES: &[&str] = &["x-stainless-"];
/// Headers the runtime puts the (placeholder) key in; passed on only with the placeholder
/// replaced by the real credential, never with anything else.
const AUTH_HEADERS: &[&str] = &["authorization", "api-key", "x-api-key"];
/// Response headers passed back to the runtime (lowercase).
const FORWARDED_RESPONSE_HEADERS: &[&str] = &[
    "content-type",
    "retry-after",
    "retry-after-ms",
    "x-request-id",
    "request-id",
    "apim-request-id",
    "x-should-retry",
    // OpenAI's timing and API version; not `openai-organization` or `openai-project`, which
    // name the provider's account to the tenant's agent.
    "openai-processing-ms",
    "openai-version",
];
/// Response header name prefixes passed back (rate limits).
const FORWARDED_RESPONSE_PREFIXES: &[&str] = &["x-ratelimit-", "anthropic-ratelimit-"];

/// Why a request got no upstream answer.
enum Failure {
    Blocked(Refusal),
    Connect(String),
    Timeout(String),
}

/// The tunnel of one worker: the guard and the one provider the worker serves.
pub(crate) struct GuardedTunnel {
    state: Arc<State>,
}

struct State {
    guard: ModelGuard,
    provider: ProviderConfig,
    base: Url,
    clients: Mutex<Vec<(PinKey, reqwest::Client)>>,
    /// The worker's lookups running at once ([`LOOKUPS_PER_WORKER`]).
    lookups: Arc<Semaphore>,
}

/// Lookups of one worker's provider host running at once. Each keeps its place until the
/// resolver returns, also past its request's timeout, so a provider host whose DNS never
/// answers holds at most this many of the resolver's places (the system resolver's are
/// shared by every worker, `MAX_SYSTEM_LOOKUPS`): it stalls its own worker's requests, not
/// the other tenants'.
pub(super) const LOOKUPS_PER_WORKER: usize = 4;

/// A host and the checked addresses its connections are pinned to.
type PinKey = (String, Vec<SocketAddr>);

impl GuardedTunnel {
    pub(crate) fn new(guard: ModelGuard, provider: ProviderConfig) -> Result<Self, GuardError> {
        let base = target::parse_base(&provider.base_url)?;
        Ok(Self {
            state: Arc::new(State {
                guard,
                provider,
                base,
                clients: Mutex::new(Vec::new()),
                lookups: Arc::new(Semaphore::new(LOOKUPS_PER_WORKER)),
            }),
        })
    }
}

impl ModelTunnel for GuardedTunnel {
    fn serve(&self, request: ModelRequest) -> ServeFuture {
        let state = self.state.clone();
        Box::pin(async move { state.serve(request).await })
    }

    fn max_request_body_bytes(&self) -> usize {
        self.state.guard.config().max_request_body_bytes
    }

    fn request_too_large(&self, request: &ModelRequest, limit: usize) -> ModelResponse {
        tracing::warn!(
            request_id = ?request.request_id,
            limit,
            "Model request body over the limit; answered 413 without calling the provider."
        );
        metrics::model_blocked(BlockReason::BodyTooLarge);
        metrics::model_request_finished(ModelOutcome::Blocked, Duration::ZERO);
        crate::tunnel::too_large_response(limit)
    }

    fn bodies_in_flight(&self, request: &ModelRequest, budget: usize) -> ModelResponse {
        tracing::warn!(
            request_id = ?request.request_id,
            budget,
            "Model request while this process's bodies in flight fill the budget; answered 503 \
             without calling the provider."
        );
        metrics::model_request_finished(ModelOutcome::Blocked, Duration::ZERO);
        crate::tunnel::bodies_in_flight_response(budget)
    }
}

/// Counts a request once, when it ends; a request dropped before (the runtime cancelled it,
/// the worker ended) counts as cancelled.
struct Record {
    started: Instant,
    done: bool,
}

impl Record {
    fn finish(&mut self, outcome: ModelOutcome) {
        if !self.done {
            self.done = true;
            metrics::model_request_finished(outcome, self.started.elapsed());
        }
    }
}

impl Drop for Record {
    fn drop(&mut self) {
        self.finish(ModelOutcome::Cancelled);
    }
}

impl State {
    async fn serve(self: Arc<Self>, request: ModelRequest) -> ModelResponse {
        if priming::is_priming(&request.url) {
            tracing::debug!(request_id = ?request.request_id, "A priming turn's model call; answered without a provider.");
            return priming::answer(&request).unwrap_or_else(|| {
                error_response(503, "priming", "a priming turn calls no model")
            });
        }
        let mut record = Record {
            started: Instant::now(),
            done: false,
        };
        let sent = request.body.len() as u64;
        let result = match self.prepare(&request).await {
            Ok(prepared) => self.send(prepared, request.body).await,
            Err(failure) => Err(failure),
        };
        let response = match result {
            Ok(response) => response,
            Err(failure) => {
                let (outcome, status, code, message) = match failure {
                    Failure::Blocked((reason, message)) => {
                        tracing::warn!(
                            request_id = ?request.request_id,
                            reason = reason.label(),
                            "Model request refused by the guard: {message}"
                        );
                        metrics::model_blocked(reason);
                        (ModelOutcome::Blocked, 403, reason.label(), message)
                    }
                    Failure::Connect(message) => {
                        tracing::warn!(request_id = ?request.request_id, "Model provider unreachable: {message}");
                        (ModelOutcome::ConnectError, 502, "connect_error", message)
                    }
                    Failure::Timeout(message) => {
                        tracing::warn!(request_id = ?request.request_id, "Model provider timed out: {message}");
                        (ModelOutcome::Timeout, 504, "timeout", message)
                    }
                };
                record.finish(outcome);
                return error_response(status, code, &message);
            }
        };
        metrics::model_bytes(ModelDirection::Sent, sent);
        metrics::model_first_byte(record.started.elapsed());
        let status = response.status().as_u16();
        tracing::debug!(request_id = ?request.request_id, status, "Model provider answered.");
        let headers = response_headers(response.headers());
        let (tx, rx) = mpsc::channel(BODY_CHANNEL);
        let idle = self.guard.config().idle_timeout;
        tokio::spawn(async move {
            let outcome = stream_body(response, tx, idle, status).await;
            record.finish(outcome);
        });
        ModelResponse {
            status,
            headers,
            body: rx,
        }
    }

    /// `domain`'s addresses by the guard's resolver, once one of the worker's places is free;
    /// the lookup runs in a task of its own that keeps the place until it returns.
    async fn lookup(&self, domain: &str, port: u16) -> std::io::Result<Vec<IpAddr>> {
        let resolver = &self.guard.config().resolver;
        super::resolve::holding_a_place(self.lookups.clone(), || resolver.lookup(domain, port))
            .await
    }

    /// Everything before a connection: the URL, its checks, one resolution, the checks of
    /// every address, the pinned client and the upstream headers.
    async fn prepare(&self, request: &ModelRequest) -> Result<Prepared, Failure> {
        let config = self.guard.config();
        let url = target::upstream_url(&request.url, &self.base).map_err(Failure::Blocked)?;
        let allow = config.allows_private(&url);
        target::check_url(&url, allow).map_err(Failure::Blocked)?;
        let port = url.port_or_known_default().unwrap_or(443);
        let (host, addresses) = match url.host() {
            Some(Host::Ipv4(ip)) => (ip.to_string(), vec![IpAddr::V4(ip)]),
            Some(Host::Ipv6(ip)) => (ip.to_string(), vec![IpAddr::V6(ip)]),
            Some(Host::Domain(domain)) => {
                let lookup = self.lookup(domain, port);
                let addresses = match tokio::time::timeout(config.connect_timeout, lookup).await {
                    Err(_) => {
                        return Err(Failure::Timeout(format!(
                            "resolving {domain} took longer than {:?}",
                            config.connect_timeout
                        )));
                    }
                    Ok(Err(e)) => {
                        return Err(Failure::Connect(format!("resolving {domain}: {e}")));
                    }
                    Ok(Ok(addresses)) => addresses,
                };
                (domain.to_owned(), addresses)
            }
            None => {
                return Err(Failure::Blocked((
                    BlockReason::Scheme,
                    "the URL has no host".to_owned(),
                )));
            }
        };
        if addresses.is_empty() {
            return Err(Failure::Connect(format!("{host} has no address")));
        }
        target::check_addresses(&url, &addresses, allow, &|| self.guard.host_addresses())
            .map_err(Failure::Blocked)?;
        let mut pinned: Vec<SocketAddr> = addresses
            .into_iter()
            .map(|ip| SocketAddr::new(ip, port))
            .collect();
        pinned.sort();
        pinned.dedup();
        let domain = matches!(url.host(), Some(Host::Domain(_)));
        let client = self.client(&host, pinned, domain)?;
        let method = reqwest::Method::from_bytes(request.method.as_bytes()).map_err(|_| {
            Failure::Blocked((
                BlockReason::ForeignUrl,
                format!("the HTTP method {:?} is not valid", request.method),
            ))
        })?;
        // A model call reads (GET: the models) or posts (completions, responses); any other
        // method (TRACE echoes the request, the real key with it) is not one.
        if method != reqwest::Method::POST && method != reqwest::Method::GET {
            return Err(Failure::Blocked((
                BlockReason::ForeignUrl,
                format!("the HTTP method {method} is not one a model call uses (POST or GET)"),
            )));
        }
        let headers = request_headers(&request.headers, &self.provider);
        Ok(Prepared {
            client,
            method,
            url,
            headers,
        })
    }

    /// A client whose connections to `host` go only to `pinned` (cached per DNS answer).
    fn client(
        &self,
        host: &str,
        pinned: Vec<SocketAddr>,
        domain: bool,
    ) -> Result<reqwest::Client, Failure> {
        let key = (host.to_owned(), pinned);
        let mut clients = self
            .clients
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some((_, client)) = clients.iter().find(|(k, _)| *k == key) {
            return Ok(client.clone());
        }
        let config = self.guard.config();
        let mut builder = reqwest::Client::builder()
            .tls_backend_preconfigured(self.guard.tls().clone())
            .no_proxy()
            .connect_timeout(config.connect_timeout)
            .referer(false)
            .redirect(same_origin_redirects())
            .dns_resolver(Arc::new(RefuseNames));
        if domain {
            builder = builder.resolve_to_addrs(host, &key.1);
        }
        let client = builder
            .build()
            .map_err(|e| Failure::Connect(format!("building the HTTP client: {}", chain(&e))))?;
        if clients.len() >= CLIENT_CACHE {
            clients.remove(0);
        }
        clients.push((key, client.clone()));
        Ok(client)
    }

    async fn send(&self, prepared: Prepared, body: Vec<u8>) -> Result<reqwest::Response, Failure> {
        let Prepared {
            client,
            method,
            url,
            headers,
        } = prepared;
        let host = url.host_str().unwrap_or_default().to_owned();
        let limit = self.guard.config().first_byte_timeout;
        let send = client
            .request(method, url)
            .headers(headers)
            .body(body)
            .send();
        match tokio::time::timeout(limit, send).await {
            Err(_) => Err(Failure::Timeout(format!(
                "{host} sent no response head within {limit:?}"
            ))),
            // Without the URL: its query may hold the provider's key, and the message goes
            // to the child and the log.
            Ok(Err(e)) if e.is_timeout() => Err(Failure::Timeout(format!(
                "connecting to {host}: {}",
                chain(&e.without_url())
            ))),
            Ok(Err(e)) => Err(Failure::Connect(format!(
                "{host}: {}",
                chain(&e.without_url())
            ))),
            Ok(Ok(response)) => Ok(response),
        }
    }
}

/// A request ready to send.
struct Prepared {
    client: reqwest::Client,
    method: reqwest::Method,
    url: Url,
    headers: HeaderMap,
}

/// Follows a redirect only to the same scheme, host and port (whose connections are
/// pinned to the same checked addresses), at most [`MAX_REDIRECTS`] times; any other
/// redirect is answered to the runtime as it came.
fn same_origin_redirects() -> reqwest::redirect::Policy {
    reqwest::redirect::Policy::custom(|attempt| {
        let same_origin = attempt.previous().last().is_some_and(|previous| {
            let next = attempt.url();
            previous.scheme() == next.scheme()
                && previous.host_str() == next.host_str()
                && previous.port_or_known_default() == next.port_or_known_default()
        });
        if same_origin && attempt.previous().len() <= MAX_REDIRECTS {
            attempt.follow()
        } else {
            attempt.stop()
        }
    })
}

/// The real credential for an auth header whose value is the placeholder alone, or `Bearer`
/// and the placeholder: the runtime's auth headers take one of those forms, and nothing a
/// child puts around the placeholder goes upstream with the key (a provider that echoes a
/// wrong key back would show it the real one inside its own text).
fn with_credential(value: &str, placeholder: &str, key: &crate::secret::Secret) -> Option<String> {
    let value = value.trim();
    if value == placeholder {
        return Some(key.expose().to_owned());
    }
    let (scheme, rest) = value.split_once(' ')?;
    (scheme.eq_ignore_ascii_case("bearer") && rest.trim() == placeholder)
        .then(|| format!("Bearer {}", key.expose()))
}

/// The upstream request headers: the runtime's allowlisted ones, its auth header with the
/// placeholder replaced by the real credential, then the provider's own headers.
pub(crate) fn request_headers(
    runtime: &[(String, String)],
    provider: &ProviderConfig,
) -> HeaderMap {
    let mut headers = HeaderMap::new();
    for (name, value) in runtime {
        let lower = name.to_ascii_lowercase();
        let value = if AUTH_HEADERS.contains(&lower.as_str()) {
            let real = provider
                .bearer_token
                .as_ref()
                .and_then(|key| with_credential(value, PLACEHOLDER_BEARER_TOKEN, key))
                .or_else(|| {
                    let key = provider.api_key.as_ref()?;
                    with_credential(value, PLACEHOLDER_API_KEY, key)
                });
            // A credential header without our placeholder (alone) is not ours to pass on.
            let Some(real) = real else { continue };
            real
        } else if FORWARDED_REQUEST_HEADERS.contains(&lower.as_str())
            || FORWARDED_REQUEST_PREFIXES
                .iter()
                .any(|p| lower.starts_with(p))
        {
            value.clone()
        } else {
            continue;
        };
        let sensitive = AUTH_HEADERS.contains(&lower.as_str());
        if let (Ok(name), Ok(mut value)) = (
            HeaderName::from_bytes(lower.as_bytes()),
            HeaderValue::from_str(&value),
        ) {
            value.set_sensitive(sensitive);
            headers.append(name, value);
        }
    }
    for (name, value) in provider.headers.iter().flatten() {
        if let (Ok(name), Ok(mut value)) = (
            HeaderName::from_bytes(name.to_ascii_lowercase().as_bytes()),
            HeaderValue::from_str(value),
        ) {
            value.set_sensitive(true);
            headers.insert(name, value);
        }
    }
    headers
}

/// The response headers passed back: the allowlisted ones only (no hop-by-hop header, no
/// length or encoding: the body is passed on as decoded text).
pub(crate) fn response_headers(upstream: &HeaderMap) -> Vec<(String, String)> {
    upstream
        .iter()
        .filter(|(name, _)| {
            let name = name.as_str();
            FORWARDED_RESPONSE_HEADERS.contains(&name)
                || FORWARDED_RESPONSE_PREFIXES
                    .iter()
                    .any(|p| name.starts_with(p))
        })
        .filter_map(|(name, value)| {
            Some((name.as_str().to_owned(), value.to_str().ok()?.to_owned()))
        })
        .collect()
}

/// Streams the provider's body to the runtime as it arrives; returns how it ended.
async fn stream_body(
    response: reqwest::Response,
    tx: mpsc::Sender<BodyChunk>,
    idle: Duration,
    status: u16,
) -> ModelOutcome {
    let mut stream = response.bytes_stream();
    let mut decoder = Utf8Decoder::default();
    loop {
        let next = tokio::select! {
            _ = tx.closed() => return ModelOutcome::Cancelled,
            next = tokio::time::timeout(idle, stream.next()) => next,
        };
        match next {
            Err(_) => {
                let _ = tx
                    .send(Err(format!("the model provider sent nothing for {idle:?}")))
                    .await;
                return ModelOutcome::Timeout;
            }
            Ok(None) => {
                if let Some(rest) = decoder.finish()
                    && tx.send(Ok(rest)).await.is_err()
                {
                    return ModelOutcome::Cancelled;
                }
                return ModelOutcome::of_status(status);
            }
            Ok(Some(Err(e))) => {
                let _ = tx
                    .send(Err(format!(
                        "the model provider's response broke off: {}",
                        chain(&e.without_url())
                    )))
                    .await;
                return ModelOutcome::StreamError;
            }
            Ok(Some(Ok(bytes))) => {
                metrics::model_bytes(ModelDirection::Received, bytes.len() as u64);
                let text = decoder.push(&bytes);
                if !text.is_empty() && tx.send(Ok(text)).await.is_err() {
                    return ModelOutcome::Cancelled;
                }
            }
        }
    }
}

/// Turns a byte stream into text without splitting a character across chunks; invalid
/// sequences become U+FFFD.
#[derive(Default)]
pub(crate) struct Utf8Decoder {
    pending: Vec<u8>,
}

impl Utf8Decoder {
    /// The text of `bytes` and what was held back, holding back an incomplete last character.
    pub(crate) fn push(&mut self, bytes: &[u8]) -> String {
        self.pending.extend_from_slice(bytes);
        let mut out = String::new();
        loop {
            match std::str::from_utf8(&self.pending) {
                Ok(text) => {
                    out.push_str(text);
                    self.pending.clear();
                    return out;
                }
                Err(e) => {
                    let valid = e.valid_up_to();
                    out.push_str(std::str::from_utf8(&self.pending[..valid]).unwrap_or_default());
                    match e.error_len() {
                        None => {
                            self.pending.drain(..valid);
                            return out;
                        }
                        Some(len) => {
                            out.push(char::REPLACEMENT_CHARACTER);
                            self.pending.drain(..valid + len);
                        }
                    }
                }
            }
        }
    }

    /// What is left at the end of the body (an incomplete character), if anything.
    pub(crate) fn finish(&mut self) -> Option<String> {
        if self.pending.is_empty() {
            return None;
        }
        let rest = String::from_utf8_lossy(&self.pending).into_owned();
        self.pending.clear();
        Some(rest)
    }
}

/// An error and its sources, for messages.
fn chain(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(e) = source {
        let next = e.to_string();
        if !text.contains(&next) {
            text.push_str(": ");
            text.push_str(&next);
        }
        source = e.source();
    }
    text
}

/// The answer to a request that got no upstream answer, as an OpenAI-style error body.
fn error_response(status: u16, code: &str, message: &str) -> ModelResponse {
    let body = serde_json::json!({
        "error": {
            "message": format!("copilot-pool model guard: {message}"),
            "type": "copilot_pool_guard",
            "code": code,
        }
    });
    ModelResponse::full(status, "application/json", body.to_string())
}
