//! The model tunnel: how a model HTTP request the runtime wants to make is served by the
//! client over the JSON-RPC pipe (`llmInference.*`, protocol reference §6.2 and §10.5).
//!
//! This module owns the whole mechanism, and nothing that answers a request:
//! * here — the shape of a tunnelled request and response and the [`ModelTunnel`] trait a
//!   model server implements;
//! * `frames` — the wire side: reassembling `llmInference.httpRequestStart`/`httpRequestChunk`
//!   frames into a [`ModelRequest`], serving it with the configured [`ModelTunnel`] and
//!   streaming the answer back with `httpResponseStart`/`httpResponseChunk` calls (the worker
//!   feeds it the frames it dispatches).
//!
//! Implementors live with the model they serve (the scripted model's is in
//! `scripted_model`). Nothing here talks to a network.

pub(crate) mod frames;

use std::future::Future;
use std::pin::Pin;

use tokio::sync::mpsc;

/// One model HTTP request, reassembled from its start frame and body chunks. Its `Debug`
/// redacts credential headers (the runtime sends the provider key as `Authorization`).
#[derive(Clone)]
pub struct ModelRequest {
    /// The runtime's id for this request (unique per connection).
    pub request_id: String,
    /// The session that made the call, when the runtime says so.
    pub session_id: Option<String>,
    /// HTTP method, e.g. `POST`.
    pub method: String,
    /// Full URL the runtime would have called, e.g. `http://127.0.0.1:9/v1/chat/completions`.
    pub url: String,
    /// Request headers, one entry per value, names as sent.
    pub headers: Vec<(String, String)>,
    /// The request body (UTF-8 JSON for the OpenAI wire APIs).
    pub body: Vec<u8>,
}

impl std::fmt::Debug for ModelRequest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ModelRequest")
            .field("request_id", &self.request_id)
            .field("session_id", &self.session_id)
            .field("method", &self.method)
            .field("url", &self.url)
            .field("headers", &crate::secret::RedactedHeaders(&self.headers))
            .field("body_bytes", &self.body.len())
            .finish()
    }
}

impl ModelRequest {
    /// The path part of [`ModelRequest::url`] (no scheme, host or query).
    pub fn path(&self) -> &str {
        let rest = self
            .url
            .split_once("://")
            .map(|(_, rest)| rest)
            .unwrap_or(&self.url);
        let path = rest.find('/').map(|i| &rest[i..]).unwrap_or("/");
        path.split('?').next().unwrap_or(path)
    }
}

/// One piece of a response body, or the reason the body broke off.
pub type BodyChunk = Result<String, String>;

/// The answer to a [`ModelRequest`]: a status line and headers, then a body that may stream.
#[derive(Debug)]
pub struct ModelResponse {
    /// HTTP status code.
    pub status: u16,
    /// Response headers, one entry per value.
    pub headers: Vec<(String, String)>,
    /// Body chunks in order; the body ends when the channel closes. An `Err` ends the body
    /// with that error message (sent to the runtime as a failed chunk). A body whose
    /// `content-type` is `application/json` reaches the runtime only once the channel has
    /// closed (whole, in one chunk, up to 8 MiB); any other goes on as it arrives.
    pub body: mpsc::Receiver<BodyChunk>,
}

impl ModelResponse {
    /// A complete response with a body that is already known.
    pub fn full(status: u16, content_type: &str, body: String) -> Self {
        let (tx, rx) = mpsc::channel(1);
        // The channel has room for exactly this one chunk, so this cannot fail.
        let _ = tx.try_send(Ok(body));
        Self {
            status,
            headers: vec![("content-type".to_owned(), content_type.to_owned())],
            body: rx,
        }
    }
}

/// The future a [`ModelTunnel`] returns.
pub type ServeFuture = Pin<Box<dyn Future<Output = ModelResponse> + Send + 'static>>;

/// The largest request body a tunnel accepts unless it says otherwise (32 MiB).
pub const DEFAULT_MAX_REQUEST_BODY_BYTES: usize = 32 << 20;

/// Something that answers model HTTP requests on behalf of the runtime.
pub trait ModelTunnel: Send + Sync + 'static {
    /// Serve one request. The response head is sent as soon as the future resolves; the body
    /// streams from [`ModelResponse::body`].
    fn serve(&self, request: ModelRequest) -> ServeFuture;

    /// The largest request body this tunnel is given: a larger one is dropped as it arrives
    /// and answered with [`ModelTunnel::request_too_large`] instead of being served.
    fn max_request_body_bytes(&self) -> usize {
        DEFAULT_MAX_REQUEST_BODY_BYTES
    }

    /// The answer to a request whose body exceeded the limit (`request.body` is empty):
    /// 413 by default.
    fn request_too_large(&self, request: &ModelRequest, limit: usize) -> ModelResponse {
        let _ = request;
        too_large_response(limit)
    }

    /// The answer to a request within the limit that arrived while the process's other
    /// bodies, arriving or not yet sent, held `budget` bytes together (`request.body` is
    /// empty): 503 by default, saying to retry.
    fn bodies_in_flight(&self, request: &ModelRequest, budget: usize) -> ModelResponse {
        let _ = request;
        bodies_in_flight_response(budget)
    }
}

/// A 503 answer for a request whose body would take its process's model request bodies in
/// flight past `budget` bytes together, as an OpenAI-style error.
pub fn bodies_in_flight_response(budget: usize) -> ModelResponse {
    let body = serde_json::json!({
        "error": {
            "message": format!(
                "copilot-pool: with this one, the model request bodies of this process in \
                 flight (arriving or not yet sent) would pass {budget} bytes together, twice \
                 max_request_body_bytes; retry once one has been sent"
            ),
            "type": "server_error",
            "code": "bodies_in_flight",
        }
    });
    ModelResponse::full(503, "application/json", body.to_string())
}

/// A 413 answer for a request body over `limit` bytes, as an OpenAI-style error.
pub fn too_large_response(limit: usize) -> ModelResponse {
    let body = serde_json::json!({
        "error": {
            "message": format!(
                "copilot-pool: the model request body exceeds {limit} bytes; shorten the \
                 conversation (compact it) or raise max_request_body_bytes"
            ),
            "type": "request_too_large",
            "code": "body_too_large",
        }
    });
    ModelResponse::full(413, "application/json", body.to_string())
}
