//! The tunnel's wire side: reassembling `llmInference.httpRequest*` frames into requests,
//! serving them with the configured [`ModelTunnel`], and streaming the answer back with
//! `llmInference.httpResponse*` calls. The worker owns one [`TunnelRequests`] per child and
//! feeds it the frames it dispatches; nothing here knows which model answers.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use tokio::task::AbortHandle;

use super::{ModelRequest, ModelResponse, ModelTunnel};
use crate::rpc::Connection;
use crate::rpc::messages::{
    HttpRequestChunk, HttpRequestStart, HttpResponseChunk, HttpResponseChunkParams,
    HttpResponseStart, HttpResponseStartParams,
};

/// Requests being received and responses being streamed, by the runtime's request id.
#[derive(Default)]
pub(crate) struct TunnelRequests {
    receiving: HashMap<String, Receiving>,
    serving: HashMap<String, AbortHandle>,
}

/// A request whose body is still arriving.
struct Receiving {
    request: ModelRequest,
    /// The body passed the tunnel's limit: what arrived was dropped, and the request is
    /// answered with `request_too_large` instead of being served.
    oversized: bool,
}

impl TunnelRequests {
    /// A request head arrived.
    pub(crate) fn start(&mut self, head: HttpRequestStart) {
        let headers = head
            .headers
            .into_iter()
            .flat_map(|(name, values)| values.into_iter().map(move |v| (name.clone(), v)))
            .collect();
        self.receiving.insert(
            head.request_id.clone(),
            Receiving {
                request: ModelRequest {
                    request_id: head.request_id,
                    session_id: head.session_id,
                    method: head.method,
                    url: head.url,
                    headers,
                    body: Vec::new(),
                },
                oversized: false,
            },
        );
    }

    /// A body chunk arrived. On the last chunk the request is served (or, past the tunnel's
    /// body limit, answered with its `request_too_large` without being served); `on_done`
    /// runs when the response has been streamed (or failed). Returns false for an unknown
    /// request id.
    pub(crate) fn chunk(
        &mut self,
        chunk: HttpRequestChunk,
        conn: &Connection,
        tunnel: &Arc<dyn ModelTunnel>,
        on_done: impl FnOnce(String) + Send + 'static,
    ) -> bool {
        if chunk.cancel == Some(true) {
            self.receiving.remove(&chunk.request_id);
            if let Some(task) = self.serving.remove(&chunk.request_id) {
                task.abort();
            }
            return true;
        }
        let Some(receiving) = self.receiving.get_mut(&chunk.request_id) else {
            return false;
        };
        if chunk.binary == Some(true) {
            tracing::warn!(request_id = %chunk.request_id, "Binary model request bodies are not supported; passing the data on as text.");
        }
        let limit = tunnel.max_request_body_bytes();
        let body = &mut receiving.request.body;
        if !receiving.oversized && body.len().saturating_add(chunk.data.len()) > limit {
            receiving.oversized = true;
            *body = Vec::new();
        }
        if !receiving.oversized {
            body.extend_from_slice(chunk.data.as_bytes());
        }
        if chunk.end != Some(true) {
            return true;
        }
        let Some(Receiving { request, oversized }) = self.receiving.remove(&chunk.request_id)
        else {
            return false;
        };
        let id = request.request_id.clone();
        let conn = conn.clone();
        let tunnel = tunnel.clone();
        let done_id = id.clone();
        let task = tokio::spawn(async move {
            if oversized {
                let response = tunnel.request_too_large(&request, limit);
                answer(conn, request.request_id, response).await;
            } else {
                serve(conn, tunnel, request).await;
            }
            on_done(done_id);
        });
        self.serving.insert(id, task.abort_handle());
        true
    }

    /// A response finished streaming.
    pub(crate) fn done(&mut self, request_id: &str) {
        self.serving.remove(request_id);
    }

    /// Stops every response still streaming.
    pub(crate) fn abort_all(&mut self) {
        self.receiving.clear();
        for (_, task) in self.serving.drain() {
            task.abort();
        }
    }
}

async fn serve(conn: Connection, tunnel: Arc<dyn ModelTunnel>, request: ModelRequest) {
    let request_id = request.request_id.clone();
    let response = tunnel.serve(request).await;
    answer(conn, request_id, response).await;
}

/// Streams `response` to the runtime as the answer to `request_id`.
async fn answer(conn: Connection, request_id: String, mut response: ModelResponse) {
    let mut headers: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for (name, value) in response.headers {
        headers.entry(name).or_default().push(value);
    }
    let head = HttpResponseStartParams {
        request_id: request_id.clone(),
        status: response.status,
        headers,
    };
    if let Err(error) = conn.call::<HttpResponseStart>(&head).await {
        tracing::debug!(%error, %request_id, "Tunnelled response head not delivered.");
        return;
    }
    let chunk = |data: String, end: bool, error: Option<String>| HttpResponseChunkParams {
        request_id: request_id.clone(),
        data,
        end,
        error,
    };
    while let Some(piece) = response.body.recv().await {
        let params = match piece {
            Ok(data) => chunk(data, false, None),
            Err(message) => chunk(String::new(), true, Some(message)),
        };
        let last = params.end;
        if let Err(error) = conn.call::<HttpResponseChunk>(&params).await {
            tracing::debug!(%error, %request_id, "Tunnelled response chunk not delivered.");
            return;
        }
        if last {
            return;
        }
    }
    if let Err(error) = conn
        .call::<HttpResponseChunk>(&chunk(String::new(), true, None))
        .await
    {
        tracing::debug!(%error, %request_id, "Tunnelled response end not delivered.");
    }
}
