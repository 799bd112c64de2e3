//! The scripted model's loopback HTTP endpoint (axum, HTTP/1.1, `127.0.0.1:0` only).
//!
//! Routes (decided by `ScriptedModel::respond`, shared with the tunnel, by the path's
//! `WireFormat`): OpenAI chat completions and responses, Anthropic messages, the Gemini API's
//! `generateContent` and `streamGenerateContent`, `GET …/models`; anything else a 404 JSON
//! error. Bodies stream
//! straight from the model's chunk receiver, so SSE events reach the client as they are
//! produced; accepted sockets get `TCP_NODELAY` so small events are not held back.
//!
//! [`HttpEndpoint`] owns the server: dropping it (or [`HttpEndpoint::shutdown`]) stops
//! accepting, cuts bodies still streaming, and lets the server task finish.

use std::net::{Ipv4Addr, SocketAddr};

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::{DefaultBodyLimit, State};
use axum::http::{HeaderMap, HeaderName, HeaderValue, Method, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use axum::serve::ListenerExt;
use tokio::net::TcpListener;
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;

use super::error::ScriptedModelError;
use super::log::Transport;
use super::model::{Incoming, ScriptedModel};
use crate::tunnel::{BodyChunk, ModelResponse};

/// Request bodies up to this size are accepted (conversations with many tools get large).
const MAX_BODY_BYTES: usize = 64 * 1024 * 1024;

/// The message a streaming body ends with when the endpoint shuts down.
const ENDPOINT_CLOSED: &str = "scripted model endpoint shut down";

/// A running HTTP endpoint for a [`ScriptedModel`]; shuts down when dropped.
#[derive(Debug)]
pub struct HttpEndpoint {
    addr: SocketAddr,
    stop: watch::Sender<bool>,
    server: Option<JoinHandle<std::io::Result<()>>>,
}

impl HttpEndpoint {
    /// The OpenAI base URL to give the runtime: `http://127.0.0.1:<port>/v1`.
    pub fn base_url(&self) -> String {
        format!("http://{}/v1", self.addr)
    }

    /// The bound loopback address.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Stops the server and waits until it has finished (listener closed, bodies cut).
    pub async fn shutdown(mut self) {
        self.stop.send_replace(true);
        if let Some(server) = self.server.take() {
            match server.await {
                Ok(Ok(())) => {}
                Ok(Err(error)) => tracing::warn!(%error, "scripted model endpoint failed"),
                Err(error) => tracing::warn!(%error, "scripted model endpoint task failed"),
            }
        }
    }
}

impl Drop for HttpEndpoint {
    fn drop(&mut self) {
        // The server task sees the flag, stops accepting and ends open bodies; it then
        // finishes on its own.
        self.stop.send_replace(true);
    }
}

/// What every request handler gets.
#[derive(Debug, Clone)]
pub(super) struct Endpoint {
    pub(super) model: ScriptedModel,
    pub(super) stop: watch::Receiver<bool>,
}

impl ScriptedModel {
    /// Serves this model over HTTP on `127.0.0.1:<ephemeral port>` until the returned
    /// endpoint is dropped. Must be called inside a Tokio runtime.
    pub async fn serve_http(&self) -> Result<HttpEndpoint, ScriptedModelError> {
        let model = self.clone();
        serve_app(move |stop| {
            Router::new()
                .fallback(handle)
                .with_state(Endpoint { model, stop })
        })
        .await
    }
}

/// Serves the router `app` builds (given the stop flag its streaming bodies watch) on
/// `127.0.0.1:<ephemeral port>`, with the body limit and `TCP_NODELAY`, until the returned
/// endpoint is dropped.
pub(super) async fn serve_app(
    app: impl FnOnce(watch::Receiver<bool>) -> Router,
) -> Result<HttpEndpoint, ScriptedModelError> {
    let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
        .await
        .map_err(ScriptedModelError::Bind)?;
    let addr = listener
        .local_addr()
        .map_err(ScriptedModelError::LocalAddr)?;
    let listener = listener.tap_io(|stream| {
        if let Err(error) = stream.set_nodelay(true) {
            tracing::debug!(%error, "could not set TCP_NODELAY on a scripted model connection");
        }
    });
    let (stop, stop_rx) = watch::channel(false);
    let app = app(stop_rx.clone()).layer(DefaultBodyLimit::max(MAX_BODY_BYTES));
    let server = tokio::spawn(async move {
        let mut stop_rx = stop_rx;
        axum::serve(listener, app)
            .with_graceful_shutdown(async move { stopped(&mut stop_rx).await })
            .await
    });
    tracing::debug!(%addr, "scripted model listening");
    Ok(HttpEndpoint {
        addr,
        stop,
        server: Some(server),
    })
}

/// Resolves once the endpoint is told to stop (or its handle is gone).
async fn stopped(stop: &mut watch::Receiver<bool>) {
    let _ = stop.wait_for(|stop| *stop).await;
}

/// The only handler: hands the request to the model and converts its answer.
pub(super) async fn handle(
    State(endpoint): State<Endpoint>,
    method: Method,
    uri: Uri,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let mut stop = endpoint.stop.clone();
    let answer = endpoint.model.respond(Incoming {
        transport: Transport::Http,
        method: method.as_str(),
        path: uri.path(),
        query: uri.query(),
        session_id: None,
        headers: headers
            .iter()
            .map(|(n, v)| {
                (
                    n.as_str().to_owned(),
                    String::from_utf8_lossy(v.as_bytes()).into_owned(),
                )
            })
            .collect(),
        body: &body,
    });
    tokio::select! {
        response = answer => into_http(response, endpoint.stop),
        () = stopped(&mut stop) => StatusCode::SERVICE_UNAVAILABLE.into_response(),
    }
}

/// A model response as an HTTP response whose body streams until the chunks end or the
/// endpoint stops.
fn into_http(response: ModelResponse, stop: watch::Receiver<bool>) -> Response {
    let status = StatusCode::from_u16(response.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    let mut http = Response::new(Body::from_stream(body_stream(response.body, stop)));
    *http.status_mut() = status;
    for (name, value) in response.headers {
        match (
            HeaderName::try_from(name.as_str()),
            HeaderValue::try_from(value.as_str()),
        ) {
            (Ok(name), Ok(value)) => {
                http.headers_mut().append(name, value);
            }
            _ => tracing::warn!(%name, "scripted model produced an invalid header"),
        }
    }
    http
}

/// The body chunks, cut with an error when the endpoint stops.
fn body_stream(
    body: mpsc::Receiver<BodyChunk>,
    stop: watch::Receiver<bool>,
) -> impl futures_util::Stream<Item = BodyChunk> + Send + 'static {
    futures_util::stream::unfold(Some((body, stop)), |state| async move {
        let (mut body, mut stop) = state?;
        tokio::select! {
            chunk = body.recv() => chunk.map(|chunk| (chunk, Some((body, stop)))),
            () = stopped(&mut stop) => Some((Err(ENDPOINT_CLOSED.to_owned()), None)),
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::scripted_model::Reply;
    use serde_json::{Value, json};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpStream;

    /// A parsed HTTP/1.1 response: status, headers (lower-case names), de-chunked body.
    struct RawResponse {
        status: u16,
        headers: Vec<(String, String)>,
        body: String,
    }

    impl RawResponse {
        fn header(&self, name: &str) -> Option<&str> {
            self.headers
                .iter()
                .find(|(n, _)| n == name)
                .map(|(_, v)| v.as_str())
        }
    }

    /// Sends one hand-written request with `Connection: close` and reads the whole answer.
    async fn exchange(addr: SocketAddr, method: &str, path: &str, body: &str) -> RawResponse {
        let mut stream = TcpStream::connect(addr).await.unwrap();
        let request = format!(
            "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\n\
             Authorization: Bearer test-key\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
            body.len()
        );
        stream.write_all(request.as_bytes()).await.unwrap();
        let mut raw = Vec::new();
        stream.read_to_end(&mut raw).await.unwrap();
        parse_response(&String::from_utf8(raw).unwrap())
    }

    fn parse_response(raw: &str) -> RawResponse {
        let (head, rest) = raw.split_once("\r\n\r\n").unwrap();
        let mut lines = head.split("\r\n");
        let status = lines
            .next()
            .unwrap()
            .split(' ')
            .nth(1)
            .unwrap()
            .parse()
            .unwrap();
        let headers: Vec<(String, String)> = lines
            .map(|line| {
                let (name, value) = line.split_once(':').unwrap();
                (name.trim().to_ascii_lowercase(), value.trim().to_owned())
            })
            .collect();
        let chunked = headers
            .iter()
            .any(|(n, v)| n == "transfer-encoding" && v.contains("chunked"));
        let body = if chunked {
            dechunk(rest)
        } else {
            rest.to_owned()
        };
        RawResponse {
            status,
            headers,
            body,
        }
    }

    fn dechunk(mut rest: &str) -> String {
        let mut body = String::new();
        loop {
            let (size, after) = rest.split_once("\r\n").unwrap();
            let size = usize::from_str_radix(size.trim(), 16).unwrap();
            if size == 0 {
                return body;
            }
            body.push_str(&after[..size]);
            rest = after[size..].strip_prefix("\r\n").unwrap();
        }
    }

    fn chat(text: &str, stream: bool) -> String {
        json!({
            "model": "scripted-model",
            "stream": stream,
            "stream_options": {"include_usage": true},
            "messages": [
                {"role": "system", "content": "you are a test"},
                {"role": "user", "content": text}
            ],
            "tools": [{"type": "function", "function": {"name": "get_secret_number", "parameters": {}}}]
        })
        .to_string()
    }

    #[tokio::test]
    async fn non_streaming_round_trip() {
        let model = ScriptedModel::new();
        let endpoint = model.serve_http().await.unwrap();
        assert_eq!(
            endpoint.base_url(),
            format!("http://127.0.0.1:{}/v1", endpoint.addr().port())
        );
        let response = exchange(
            endpoint.addr(),
            "POST",
            "/v1/chat/completions",
            &chat("REPLY=over the wire", false),
        )
        .await;
        assert_eq!(response.status, 200);
        assert_eq!(response.header("content-type"), Some("application/json"));
        let body: Value = serde_json::from_str(&response.body).unwrap();
        assert_eq!(body["choices"][0]["message"]["content"], "over the wire");
        assert_eq!(body["id"], "chatcmpl-scripted-1");

        let requests = model.wait_for_requests(1).await;
        assert_eq!(requests[0].transport, Transport::Http);
        assert_eq!(requests[0].path, "/v1/chat/completions");
        assert_eq!(requests[0].messages().len(), 2);

        let models = exchange(endpoint.addr(), "GET", "/v1/models", "").await;
        assert_eq!(models.status, 200);
        let models: Value = serde_json::from_str(&models.body).unwrap();
        assert_eq!(models["data"][0]["id"], ScriptedModel::MODEL_ID);
    }

    #[tokio::test]
    async fn a_rate_limited_reply_is_a_429_whose_retry_after_ms_header_says_the_wait() {
        let model = ScriptedModel::new();
        let endpoint = model.serve_http().await.unwrap();
        model.push_reply(Reply::RateLimited {
            retry_after: std::time::Duration::from_millis(25),
        });
        let response = exchange(
            endpoint.addr(),
            "POST",
            "/v1/chat/completions",
            &chat("REPLY=never sent", true),
        )
        .await;
        assert_eq!(response.status, 429);
        assert_eq!(response.header("retry-after-ms"), Some("25"));
        let body: Value = serde_json::from_str(&response.body).unwrap();
        assert!(body["error"].is_object(), "{body}");
    }

    #[tokio::test]
    async fn streaming_round_trip_with_tool_call() {
        let model = ScriptedModel::new();
        let endpoint = model.serve_http().await.unwrap();
        let response = exchange(
            endpoint.addr(),
            "POST",
            "/chat/completions",
            &chat("<current_datetime>x</current_datetime>SCENARIO:tool", true),
        )
        .await;
        assert_eq!(response.status, 200);
        assert_eq!(response.header("content-type"), Some("text/event-stream"));
        let events: Vec<&str> = response
            .body
            .split("\n\n")
            .filter(|e| !e.is_empty())
            .map(|e| e.strip_prefix("data: ").unwrap())
            .collect();
        assert_eq!(events.last(), Some(&"[DONE]"));
        let chunks: Vec<Value> = events[..events.len() - 1]
            .iter()
            .map(|e| serde_json::from_str(e).unwrap())
            .collect();
        let call = &chunks[0]["choices"][0]["delta"]["tool_calls"][0];
        assert_eq!(call["id"], "call_scripted_1");
        assert_eq!(call["function"]["name"], "get_secret_number");
        let args: String = chunks
            .iter()
            .filter_map(|c| {
                c["choices"][0]["delta"]["tool_calls"][0]["function"]["arguments"].as_str()
            })
            .collect();
        assert_eq!(
            serde_json::from_str::<Value>(&args).unwrap(),
            json!({"key": "alpha"})
        );
        assert_eq!(chunks.last().unwrap()["usage"]["total_tokens"], 110);

        // A queued reply wins over the directive on the next request.
        model.push_reply(Reply::Text("queued text".into()));
        let response = exchange(
            endpoint.addr(),
            "POST",
            "/v1/chat/completions",
            &chat("SCENARIO:tool", true),
        )
        .await;
        let content: String = response
            .body
            .split("\n\n")
            .filter_map(|e| e.strip_prefix("data: "))
            .filter(|e| *e != "[DONE]")
            .filter_map(|e| {
                serde_json::from_str::<Value>(e).unwrap()["choices"][0]["delta"]["content"]
                    .as_str()
                    .map(str::to_owned)
            })
            .collect();
        assert_eq!(content, "queued text");
    }

    #[tokio::test]
    async fn unknown_route_is_404_and_bad_body_is_400() {
        let model = ScriptedModel::new();
        let endpoint = model.serve_http().await.unwrap();
        let response = exchange(endpoint.addr(), "POST", "/v1/embeddings", "{}").await;
        assert_eq!(response.status, 404);
        let body: Value = serde_json::from_str(&response.body).unwrap();
        assert_eq!(body["error"]["type"], "invalid_request_error");

        let response = exchange(endpoint.addr(), "POST", "/v1/chat/completions", "{oops").await;
        assert_eq!(response.status, 400);
        let body: Value = serde_json::from_str(&response.body).unwrap();
        assert!(
            body["error"]["message"]
                .as_str()
                .unwrap()
                .contains("not JSON")
        );

        let response = exchange(
            endpoint.addr(),
            "POST",
            "/v1/chat/completions",
            &chat("SCENARIO:error STATUS=503", true),
        )
        .await;
        assert_eq!(response.status, 503);
        let body: Value = serde_json::from_str(&response.body).unwrap();
        assert_eq!(body["error"]["code"], "scripted_503");
    }

    #[tokio::test]
    async fn shutdown_cuts_hanging_bodies_and_closes_the_listener() {
        let model = ScriptedModel::new();
        let endpoint = model.serve_http().await.unwrap();
        let addr = endpoint.addr();
        model.push_reply(Reply::Hang);
        let mut stream = TcpStream::connect(addr).await.unwrap();
        let body = chat("hang", true);
        let request = format!(
            "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        );
        stream.write_all(request.as_bytes()).await.unwrap();
        // Read until the response head arrived: the request is accepted and hanging.
        let mut head = Vec::new();
        let mut byte = [0u8; 1];
        while !head.ends_with(b"\r\n\r\n") {
            assert_eq!(stream.read(&mut byte).await.unwrap(), 1);
            head.push(byte[0]);
        }
        assert!(String::from_utf8(head).unwrap().starts_with("HTTP/1.1 200"));
        // A guard, not synchronization: a body that is not cut would block the shutdown.
        tokio::time::timeout(std::time::Duration::from_secs(10), endpoint.shutdown())
            .await
            .expect("shutdown did not cut the hanging body");
        // The hanging body was cut: the connection ends without a final chunk.
        let mut rest = Vec::new();
        let _ = stream.read_to_end(&mut rest).await;
        assert!(!String::from_utf8_lossy(&rest).contains("0\r\n\r\n"));
        assert!(TcpStream::connect(addr).await.is_err());
    }
}
