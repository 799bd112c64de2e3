//! The tunnel's wire side: reassembling `llmInference.httpRequest*` frames into requests,
//! serving them with the configured [`ModelTunnel`], and streaming the answer back with
//! `llmInference.httpResponse*` calls. The worker owns one [`TunnelRequests`] per child and
//! feeds it the frames it dispatches; nothing here knows which model answers.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use tokio::sync::mpsc::error::TryRecvError;
use tokio::task::AbortHandle;

use super::{BodyChunk, ModelRequest, ModelResponse, ModelTunnel};
use crate::media_type::essence;
use crate::rpc::Connection;
use crate::rpc::messages::{
    HttpRequestChunk, HttpRequestStart, HttpResponseChunk, HttpResponseChunkParams,
    HttpResponseStart, HttpResponseStartParams,
};

/// The most body text one `httpResponseChunk` carries when pieces that arrived together are
/// sent as one (a piece larger than this still goes whole).
const MAX_COALESCED_BYTES: usize = 64 << 10;
/// The most body text of a JSON document held back to go in one chunk with the end (at
/// most an eighth of the connection's frame limit, too); past it, what was held goes as a
/// chunk of its own, overshooting the limit by at most the piece that crossed it.
const MAX_WHOLE_BODY_BYTES: usize = 8 << 20;

/// The most JSON document text one process's answers hold back together to send whole:
/// past it, an answer sends what it holds as a chunk of its own and goes on as its body
/// arrives (a provider that sends a large document slowly, piece by piece, cannot make the
/// daemon hold a document per request of the process).
const MAX_HELD_DOCUMENT_BYTES: usize = 32 << 20;

/// Requests being received and responses being streamed, by the runtime's request id.
#[derive(Default)]
pub(crate) struct TunnelRequests {
    receiving: HashMap<String, Receiving>,
    serving: HashMap<String, Serving>,
    held: Arc<HeldDocuments>,
    /// The serial the next serving gets.
    next_serial: u64,
}

/// What the process's answers hold back of their JSON documents, together.
pub(crate) struct HeldDocuments {
    bytes: AtomicUsize,
    budget: usize,
}

impl Default for HeldDocuments {
    fn default() -> Self {
        Self {
            bytes: AtomicUsize::new(0),
            budget: MAX_HELD_DOCUMENT_BYTES,
        }
    }
}

/// One answer's share of [`HeldDocuments`], given back when dropped.
struct Holding<'a> {
    held: &'a HeldDocuments,
    mine: usize,
}

impl Holding<'_> {
    /// Holds `bytes` now (instead of what it held); whether the process's answers hold no
    /// more than their budget together.
    fn hold(&mut self, bytes: usize) -> bool {
        if bytes >= self.mine {
            self.held
                .bytes
                .fetch_add(bytes - self.mine, Ordering::SeqCst);
        } else {
            self.held
                .bytes
                .fetch_sub(self.mine - bytes, Ordering::SeqCst);
        }
        self.mine = bytes;
        self.held.bytes.load(Ordering::SeqCst) <= self.held.budget
    }
}

impl Drop for Holding<'_> {
    fn drop(&mut self) {
        self.held.bytes.fetch_sub(self.mine, Ordering::SeqCst);
    }
}

/// Requests of one process receiving their body or being served, at most: a start past it is
/// refused (the runtime's model call fails at once). A runtime has one model call in flight
/// per session and subagent; a runtime that opens more (and never ends them, or ends each at
/// once against a slow provider) must not make the daemon, which every tenant shares, hold
/// them.
pub(crate) const MAX_IN_FLIGHT: usize = 256;

/// The largest request head (its id, method, URL, session id and headers together): the
/// runtime's are under a few KiB; the frame limit alone would let 256 heads hold GiBs.
pub(crate) const MAX_HEAD_BYTES: usize = 64 << 10;

/// The longest request id (the runtime's are UUIDs): it is logged.
const MAX_REQUEST_ID_BYTES: usize = 256;

/// Why a request head was refused.
#[derive(Debug, thiserror::Error)]
pub(crate) enum StartRefused {
    #[error(
        "copilot-pool: {MAX_IN_FLIGHT} model requests of this process are receiving their \
         body or being served; end or cancel one first"
    )]
    TooMany,
    #[error(
        "copilot-pool: a model request's head (its id, URL and headers) is over \
         {MAX_HEAD_BYTES} bytes, or its id over {MAX_REQUEST_ID_BYTES}"
    )]
    TooLarge,
    #[error("copilot-pool: a model request of this process with this id is being served")]
    IdInUse,
}

/// A request being served: its task, and the bytes of the body it holds until the tunnel
/// has sent it (zeroed when the tunnel's answer, or its failure, is in).
struct Serving {
    task: AbortHandle,
    body_bytes: Arc<AtomicUsize>,
    /// Which serving of its id this is: the end of an earlier one (cancelled, then the id
    /// used again) must not end this one.
    serial: u64,
}

/// A request's serving ended (streamed, failed, panicked or stopped), for the worker to hand
/// back to [`TunnelRequests::done`].
#[derive(Debug)]
pub(crate) struct ServingEnded {
    request_id: String,
    serial: u64,
}

/// Hands its [`ServingEnded`] on when dropped, however the serving task ends: a task that
/// panics or is aborted still gives its place back.
struct EndsServing<F: FnOnce(ServingEnded)> {
    on_done: Option<F>,
    ended: Option<ServingEnded>,
}

impl<F: FnOnce(ServingEnded)> Drop for EndsServing<F> {
    fn drop(&mut self) {
        if let (Some(on_done), Some(ended)) = (self.on_done.take(), self.ended.take()) {
            on_done(ended);
        }
    }
}

/// A request whose body is still arriving.
struct Receiving {
    request: ModelRequest,
    /// Why it will be answered without being served (what arrived was dropped), if so.
    refused: Option<Refusal>,
}

/// Why a request is answered without being served.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Refusal {
    /// Its body passed the tunnel's limit: `request_too_large` (413).
    TooLarge,
    /// The process's bodies in flight passed twice that together: `bodies_in_flight` (503,
    /// retry).
    Busy,
}

/// What a request head's header costs beyond its text: a header of empty names and values
/// still takes a place in the map the request keeps.
const HEADER_ENTRY_BYTES: usize = 64;

impl TunnelRequests {
    /// A request head arrived; refused past [`MAX_IN_FLIGHT`] requests receiving their body
    /// or being served, past [`MAX_HEAD_BYTES`], or under the id of one being served (its
    /// task could no longer be stopped).
    pub(crate) fn start(&mut self, head: HttpRequestStart) -> Result<(), StartRefused> {
        let head_bytes = head.request_id.len()
            + head.method.len()
            + head.url.len()
            + head.session_id.as_ref().map_or(0, String::len)
            + head
                .headers
                .iter()
                .map(|(name, values)| {
                    name.len()
                        + HEADER_ENTRY_BYTES
                        + values
                            .iter()
                            .map(|v| name.len() + v.len() + HEADER_ENTRY_BYTES)
                            .sum::<usize>()
                })
                .sum::<usize>();
        if head_bytes > MAX_HEAD_BYTES || head.request_id.len() > MAX_REQUEST_ID_BYTES {
            return Err(StartRefused::TooLarge);
        }
        if self.serving.contains_key(&head.request_id) {
            return Err(StartRefused::IdInUse);
        }
        if self.receiving.len() + self.serving.len() >= MAX_IN_FLIGHT
            && !self.receiving.contains_key(&head.request_id)
        {
            return Err(StartRefused::TooMany);
        }
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
                refused: None,
            },
        );
        Ok(())
    }

    /// A body chunk arrived. On the last chunk the request is served (or, past the tunnel's
    /// body limit, answered with its `request_too_large` without being served; past the
    /// process's budget of bodies in flight, with its `bodies_in_flight`); `on_done`
    /// runs when its serving ends, however it ends (streamed, failed, panicked, stopped).
    /// Returns false for an unknown request id.
    pub(crate) fn chunk(
        &mut self,
        chunk: HttpRequestChunk,
        conn: &Connection,
        tunnel: &Arc<dyn ModelTunnel>,
        on_done: impl FnOnce(ServingEnded) + Send + 'static,
    ) -> bool {
        if chunk.cancel == Some(true) {
            self.receiving.remove(&chunk.request_id);
            if let Some(serving) = self.serving.remove(&chunk.request_id) {
                serving.task.abort();
            }
            return true;
        }
        // The bodies still arriving or not yet sent, all requests together (at most
        // MAX_IN_FLIGHT of them).
        let buffered: usize = self
            .receiving
            .values()
            .map(|r| r.request.body.len())
            .chain(
                self.serving
                    .values()
                    .map(|s| s.body_bytes.load(Ordering::SeqCst)),
            )
            .sum();
        let Some(receiving) = self.receiving.get_mut(&chunk.request_id) else {
            return false;
        };
        if chunk.binary == Some(true) {
            tracing::warn!(request_id = ?chunk.request_id, "Binary model request bodies are not supported; passing the data on as text.");
        }
        let limit = tunnel.max_request_body_bytes();
        let body = &mut receiving.request.body;
        // Past the body limit (too large), or past twice that for every body still arriving
        // or not yet sent together (one request at the limit still passes beside a few
        // ordinary ones; past it, a retry will pass once one has been sent).
        if receiving.refused.is_none() {
            if body.len().saturating_add(chunk.data.len()) > limit {
                receiving.refused = Some(Refusal::TooLarge);
            } else if buffered.saturating_add(chunk.data.len()) > limit.saturating_mul(2) {
                receiving.refused = Some(Refusal::Busy);
            }
            if receiving.refused.is_some() {
                *body = Vec::new();
            }
        }
        if receiving.refused.is_none() {
            if body.is_empty() {
                // The first (often the only) chunk becomes the body without a copy.
                *body = chunk.data.into_bytes();
            } else {
                body.extend_from_slice(chunk.data.as_bytes());
            }
        }
        if chunk.end != Some(true) {
            return true;
        }
        let Some(Receiving { request, refused }) = self.receiving.remove(&chunk.request_id) else {
            return false;
        };
        let id = request.request_id.clone();
        let body_bytes = Arc::new(AtomicUsize::new(request.body.len()));
        let conn = conn.clone();
        let tunnel = tunnel.clone();
        let serial = self.next_serial;
        self.next_serial = self.next_serial.wrapping_add(1);
        let ends = EndsServing {
            on_done: Some(on_done),
            ended: Some(ServingEnded {
                request_id: id.clone(),
                serial,
            }),
        };
        let sent = body_bytes.clone();
        let held = self.held.clone();
        let task = tokio::spawn(async move {
            let _ends = ends;
            let request_id = request.request_id.clone();
            let response = match refused {
                Some(Refusal::TooLarge) => tunnel.request_too_large(&request, limit),
                Some(Refusal::Busy) => tunnel.bodies_in_flight(&request, limit.saturating_mul(2)),
                None => tunnel.serve(request).await,
            };
            // The answer is in: the body was sent (or never will be), and is let go.
            sent.store(0, Ordering::SeqCst);
            answer(conn, request_id, response, &held).await;
        });
        self.serving.insert(
            id,
            Serving {
                task: task.abort_handle(),
                body_bytes,
                serial,
            },
        );
        true
    }

    /// A serving ended: its entry goes, unless its id is already being served anew.
    pub(crate) fn done(&mut self, ended: &ServingEnded) {
        if self
            .serving
            .get(&ended.request_id)
            .is_some_and(|serving| serving.serial == ended.serial)
        {
            self.serving.remove(&ended.request_id);
        }
    }

    /// Stops every response still streaming.
    pub(crate) fn abort_all(&mut self) {
        self.receiving.clear();
        for (_, serving) in self.serving.drain() {
            serving.task.abort();
        }
    }
}

/// Streams `response` to the runtime as the answer to `request_id`: the head, then the body
/// in as few `httpResponseChunk` calls as it allows, the last piece carrying `end` when the
/// body is known to be over (no call of its own).
async fn answer(
    conn: Connection,
    request_id: String,
    mut response: ModelResponse,
    held: &HeldDocuments,
) {
    let mut headers: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for (name, value) in response.headers {
        headers.entry(name).or_default().push(value);
    }
    // A JSON document is of no use to the runtime before it is whole: it goes in one chunk
    // with the end. Anything else (an event stream, NDJSON, no content type) may be a
    // stream and goes on as it arrives.
    let whole = is_json_document(&headers);
    let head = HttpResponseStartParams {
        request_id: request_id.clone(),
        status: response.status,
        headers,
    };
    if let Err(error) = conn.call::<HttpResponseStart>(&head).await {
        tracing::debug!(%error, ?request_id, "Tunnelled response head not delivered.");
        return;
    }
    let chunk = |data: String, end: bool, error: Option<String>| HttpResponseChunkParams {
        request_id: request_id.clone(),
        data,
        end,
        error,
    };
    // Escaped for JSON, text can grow several times over: a whole body stays well inside
    // the frame limit.
    let limit = if whole {
        MAX_WHOLE_BODY_BYTES.min(conn.max_frame_bytes() / 8)
    } else {
        MAX_COALESCED_BYTES
    };
    // A piece that ended a chunk's reading and is sent next.
    let mut held_piece: Option<BodyChunk> = None;
    // What this answer holds of its document, within the process's budget.
    let mut holding = Holding { held, mine: 0 };
    loop {
        let piece = match held_piece.take() {
            Some(piece) => piece,
            None => match response.body.recv().await {
                Some(piece) => piece,
                None => break,
            },
        };
        let params = match piece {
            Ok(mut data) => {
                let mut over = false;
                // The pieces that arrived while the previous chunk's call was out go as one
                // chunk: one round trip with the runtime instead of one each.
                while data.len() < limit {
                    let next = match response.body.try_recv() {
                        Ok(next) => Some(next),
                        Err(TryRecvError::Disconnected) => None,
                        // A document waits for its next piece while the process's answers
                        // hold no more than their budget; past it, it goes as it is.
                        Err(TryRecvError::Empty) if whole && holding.hold(data.len()) => {
                            response.body.recv().await
                        }
                        Err(TryRecvError::Empty) => break,
                    };
                    match next {
                        Some(Ok(more)) => data.push_str(&more),
                        Some(Err(message)) => {
                            held_piece = Some(Err(message));
                            break;
                        }
                        None => {
                            over = true;
                            break;
                        }
                    }
                }
                holding.hold(0);
                chunk(data, over, None)
            }
            Err(message) => chunk(String::new(), true, Some(message)),
        };
        let last = params.end;
        if let Err(error) = conn.call::<HttpResponseChunk>(&params).await {
            tracing::debug!(%error, ?request_id, "Tunnelled response chunk not delivered.");
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
        tracing::debug!(%error, ?request_id, "Tunnelled response end not delivered.");
    }
}

/// Whether the response's content type is `application/json` (in any case, with any
/// parameters).
fn is_json_document(headers: &BTreeMap<String, Vec<String>>) -> bool {
    headers
        .iter()
        .filter(|(name, _)| name.eq_ignore_ascii_case("content-type"))
        .flat_map(|(_, values)| values)
        .any(|value| essence(value) == "application/json")
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use serde_json::{Value, json};
    use tokio::io::{AsyncReadExt, AsyncWriteExt, DuplexStream, duplex};
    use tokio::sync::mpsc;

    use super::*;
    use crate::rpc::ConnectionOptions;

    /// Reads one frame the pool wrote and answers it as the runtime does; returns its params.
    async fn answer_one(peer: &mut DuplexStream) -> Value {
        let mut header = Vec::new();
        while !header.ends_with(b"\r\n\r\n") {
            header.push(peer.read_u8().await.expect("a frame header"));
        }
        let text = String::from_utf8(header).expect("ASCII header");
        let n: usize = text
            .trim()
            .strip_prefix("Content-Length: ")
            .and_then(|n| n.parse().ok())
            .expect("a Content-Length");
        let mut body = vec![0; n];
        peer.read_exact(&mut body).await.expect("a frame body");
        let frame: Value = serde_json::from_slice(&body).expect("JSON");
        let reply =
            json!({"jsonrpc": "2.0", "id": frame["id"], "result": {"accepted": true}}).to_string();
        peer.write_all(format!("Content-Length: {}\r\n\r\n{reply}", reply.len()).as_bytes())
            .await
            .expect("an answer");
        frame["params"].clone()
    }

    /// Streams a response of `content_type` whose body comes from `body` (its sender, the
    /// test's), and returns the chunk params the runtime's side received after the head.
    async fn chunks_of(
        content_type: &str,
        body: mpsc::Receiver<BodyChunk>,
        between_calls: impl Fn(usize) + Send + 'static,
    ) -> Vec<Value> {
        chunks_held_within(&Arc::default(), content_type, body, between_calls).await
    }

    /// As [`chunks_of`], the answer holding its document within `held`.
    async fn chunks_held_within(
        held: &Arc<HeldDocuments>,
        content_type: &str,
        body: mpsc::Receiver<BodyChunk>,
        between_calls: impl Fn(usize) + Send + 'static,
    ) -> Vec<Value> {
        let (ours, mut theirs) = duplex(1 << 20);
        let (r, w) = tokio::io::split(ours);
        let options = ConnectionOptions {
            max_frame_bytes: 1 << 20,
            default_timeout: Duration::from_secs(5),
            ..ConnectionOptions::default()
        };
        let conn = Connection::start(r, w, options, Box::new(|_| {}));
        let response = ModelResponse {
            status: 200,
            headers: vec![("content-type".to_owned(), content_type.to_owned())],
            body,
        };
        let held = held.clone();
        let streaming =
            tokio::spawn(async move { answer(conn, "r1".to_owned(), response, &held).await });
        // The limits are failure guards: a chunk that never comes fails the test.
        let limit = Duration::from_secs(10);
        let head = tokio::time::timeout(limit, answer_one(&mut theirs))
            .await
            .expect("the head in time");
        assert_eq!(head["status"], 200);
        let mut chunks = Vec::new();
        loop {
            between_calls(chunks.len());
            let params = tokio::time::timeout(limit, answer_one(&mut theirs))
                .await
                .unwrap_or_else(|_| panic!("a chunk in time after {chunks:?}"));
            let end = params["end"] == true;
            chunks.push(params);
            if end {
                break;
            }
        }
        streaming.await.expect("the stream ends");
        chunks
    }

    /// The chunks of an event stream whose pieces were all queued, and the body closed,
    /// before the first call went out.
    async fn chunks_for(pieces: Vec<BodyChunk>) -> Vec<Value> {
        let (tx, body) = mpsc::channel(16);
        for piece in pieces {
            tx.send(piece).await.expect("queued");
        }
        drop(tx);
        chunks_of("text/event-stream", body, |_| {}).await
    }

    #[tokio::test]
    async fn pieces_that_arrived_together_go_to_the_runtime_as_one_chunk_with_the_end() {
        let pieces = ["data: a\n\n", "data: b\n\n", "data: c\n\n"];
        let chunks = chunks_for(pieces.iter().map(|p| Ok(p.to_string())).collect()).await;
        assert_eq!(chunks.len(), 1, "one chunk, the last: {chunks:?}");
        assert_eq!(chunks[0]["data"], pieces.concat());
        assert_eq!(chunks[0]["end"], true);
    }

    /// The chunks of a body of `content_type` whose first piece is queued, whose second comes
    /// only after the first chunk reached the runtime, and which ends after the second.
    async fn chunks_of_a_slow_body(content_type: &str) -> Vec<Value> {
        let (tx, body) = mpsc::channel(16);
        tx.send(Ok("data: a\n\n".to_owned())).await.expect("queued");
        let tx = std::sync::Mutex::new(Some(tx));
        chunks_of(content_type, body, move |sent| {
            let mut tx = tx.lock().expect("the test's sender");
            match sent {
                1 => {
                    let _ = tx
                        .as_ref()
                        .expect("open")
                        .try_send(Ok("data: b\n\n".to_owned()));
                }
                2 => *tx = None,
                _ => {}
            }
        })
        .await
    }

    #[tokio::test]
    async fn a_body_that_may_stream_goes_on_as_it_arrives_and_ends_with_a_chunk_of_its_own() {
        for content_type in [
            "text/event-stream",
            "Text/Event-Stream; charset=utf-8",
            "application/x-ndjson",
            "",
        ] {
            let chunks = chunks_of_a_slow_body(content_type).await;
            let data: Vec<_> = chunks.iter().map(|c| c["data"].clone()).collect();
            assert_eq!(
                data,
                ["data: a\n\n", "data: b\n\n", ""],
                "{content_type:?}: {chunks:?}"
            );
            assert_eq!(chunks[2]["end"], true);
        }
    }

    #[tokio::test]
    async fn a_json_document_waits_to_go_whole_with_the_end() {
        for content_type in ["application/json", "Application/JSON; charset=utf-8"] {
            // Room for one piece: the second is sent only once the first was taken, so the
            // answer has read the first before the rest of the body exists.
            let (tx, body) = mpsc::channel(1);
            let sender = tokio::spawn(async move {
                for piece in ["{\"choices\":", "[]}"] {
                    tx.send(Ok(piece.to_owned())).await.expect("queued");
                }
            });
            let chunks = chunks_of(content_type, body, |_| {}).await;
            sender.await.expect("sent");
            assert_eq!(chunks.len(), 1, "{content_type:?}: {chunks:?}");
            assert_eq!(chunks[0]["data"], "{\"choices\":[]}");
            assert_eq!(chunks[0]["end"], true);
        }
    }

    #[tokio::test]
    async fn a_json_document_goes_on_as_it_arrives_once_the_processs_answers_hold_their_budget() {
        // The process's other answers hold the budget already: this one holds nothing back.
        let held = Arc::new(HeldDocuments {
            bytes: AtomicUsize::new(4),
            budget: 4,
        });
        let (tx, body) = mpsc::channel(16);
        tx.send(Ok("{\"choices\":".to_owned()))
            .await
            .expect("queued");
        let tx = std::sync::Mutex::new(Some(tx));
        // The rest of the document exists only once its first piece reached the runtime.
        let chunks = chunks_held_within(&held, "application/json", body, move |sent| {
            let mut tx = tx.lock().expect("the test's sender");
            if sent == 1 {
                let _ = tx.as_ref().expect("open").try_send(Ok("[]}".to_owned()));
                *tx = None;
            }
        })
        .await;
        let data: Vec<_> = chunks.iter().map(|c| c["data"].clone()).collect();
        assert_eq!(data, ["{\"choices\":", "[]}"], "{chunks:?}");
        assert_eq!(chunks[1]["end"], true);
        assert_eq!(held.bytes.load(Ordering::SeqCst), 4, "its own given back");
    }

    #[tokio::test]
    async fn an_error_after_coalesced_pieces_still_follows_their_data() {
        let chunks = chunks_for(vec![
            Ok("data: a\n\n".to_owned()),
            Ok("data: b\n\n".to_owned()),
            Err("upstream reset".to_owned()),
        ])
        .await;
        assert_eq!(chunks.len(), 2, "{chunks:?}");
        assert_eq!(chunks[0]["data"], "data: a\n\ndata: b\n\n");
        assert_eq!(chunks[0]["end"], false);
        assert_eq!(chunks[1]["end"], true);
        assert_eq!(chunks[1]["error"], "upstream reset");
    }

    /// A tunnel that hands each request it is given to the test, and answers 200.
    struct Capturing {
        requests: mpsc::UnboundedSender<ModelRequest>,
        limit: usize,
    }

    impl ModelTunnel for Capturing {
        fn serve(&self, request: ModelRequest) -> crate::tunnel::ServeFuture {
            let _ = self.requests.send(request);
            Box::pin(async { ModelResponse::full(200, "application/json", "{}".to_owned()) })
        }

        fn max_request_body_bytes(&self) -> usize {
            self.limit
        }
    }

    /// A connection whose runtime side is `theirs`, and a [`Capturing`] tunnel with a body
    /// limit of `limit` whose served requests come out of the receiver.
    fn capturing(
        limit: usize,
    ) -> (
        Connection,
        DuplexStream,
        Arc<dyn ModelTunnel>,
        mpsc::UnboundedReceiver<ModelRequest>,
    ) {
        let (ours, theirs) = duplex(1 << 20);
        let (r, w) = tokio::io::split(ours);
        let conn = Connection::start(r, w, ConnectionOptions::default(), Box::new(|_| {}));
        let (tx, served) = mpsc::unbounded_channel();
        let tunnel: Arc<dyn ModelTunnel> = Arc::new(Capturing {
            requests: tx,
            limit,
        });
        (conn, theirs, tunnel, served)
    }

    /// The body the tunnel is given for a request sent in `pieces`, or `None` when the
    /// request was answered without being served; and the status the runtime's side got.
    async fn body_served(pieces: &[&str], limit: usize) -> (Option<Vec<u8>>, Value) {
        let (conn, mut theirs, tunnel, mut served) = capturing(limit);
        let mut requests = TunnelRequests::default();
        requests.start(head("r1")).expect("started");
        for (i, piece) in pieces.iter().enumerate() {
            let chunk = HttpRequestChunk {
                request_id: "r1".to_owned(),
                data: (*piece).to_owned(),
                binary: None,
                end: Some(i + 1 == pieces.len()),
                cancel: None,
            };
            assert!(requests.chunk(chunk, &conn, &tunnel, |_| {}));
        }
        // A failure guard: an answer that never comes fails the test.
        let head = tokio::time::timeout(Duration::from_secs(10), answer_one(&mut theirs))
            .await
            .expect("the answer's head in time");
        (
            served.try_recv().ok().map(|r| r.body),
            head["status"].clone(),
        )
    }

    fn head(id: &str) -> HttpRequestStart {
        HttpRequestStart {
            request_id: id.to_owned(),
            method: "POST".to_owned(),
            url: "http://127.0.0.1:9/v1/chat/completions".to_owned(),
            headers: BTreeMap::new(),
            session_id: None,
        }
    }

    fn piece(id: &str, data: &str, end: bool) -> HttpRequestChunk {
        HttpRequestChunk {
            request_id: id.to_owned(),
            data: data.to_owned(),
            binary: None,
            end: Some(end),
            cancel: None,
        }
    }

    #[tokio::test]
    async fn a_runtime_cannot_make_the_daemon_hold_unended_requests_without_bound() {
        let (conn, mut theirs, tunnel, mut served) = capturing(1000);
        let mut requests = TunnelRequests::default();
        // Requests whose body never ends: past the count, a start is refused.
        for i in 0..MAX_IN_FLIGHT {
            requests.start(head(&format!("open-{i}"))).expect("room");
        }
        assert!(matches!(
            requests.start(head("one-more")),
            Err(StartRefused::TooMany)
        ));
        requests.abort_all();
        // Bodies still arriving hold at most twice the body limit together: the request
        // whose piece would pass it is answered 503 (retry), not served, and the others are.
        for id in ["a", "b", "c"] {
            requests.start(head(id)).expect("room");
            assert!(requests.chunk(piece(id, &"x".repeat(900), false), &conn, &tunnel, |_| {}));
        }
        for id in ["a", "b", "c"] {
            assert!(requests.chunk(piece(id, "", true), &conn, &tunnel, |_| {}));
        }
        let mut statuses = Vec::new();
        for _ in 0..3 {
            let answer = tokio::time::timeout(Duration::from_secs(10), answer_one(&mut theirs))
                .await
                .expect("an answer in time");
            statuses.push(answer["status"].as_u64().unwrap_or_default());
        }
        statuses.sort_unstable();
        assert_eq!(statuses, [200, 200, 503], "{statuses:?}");
        let mut bodies = Vec::new();
        while let Ok(request) = served.try_recv() {
            bodies.push(request.body.len());
        }
        assert_eq!(bodies, [900, 900]);
        assert!(requests.receiving.is_empty());
    }

    #[tokio::test]
    async fn requests_being_served_count_towards_the_bounds_and_so_does_a_head() {
        // This side never answers a response's head: every request served stays in flight.
        let (conn, _theirs, tunnel, _served) = capturing(1000);
        let mut requests = TunnelRequests::default();
        for i in 0..MAX_IN_FLIGHT {
            let id = format!("served-{i}");
            requests.start(head(&id)).expect("room");
            assert!(requests.chunk(piece(&id, "", true), &conn, &tunnel, |_| {}));
        }
        assert_eq!(requests.serving.len(), MAX_IN_FLIGHT);
        assert!(matches!(
            requests.start(head("one-more")),
            Err(StartRefused::TooMany)
        ));
        // An id being served is not started again: its task could no longer be stopped.
        let ended = ServingEnded {
            request_id: "served-1".to_owned(),
            serial: requests.serving["served-1"].serial,
        };
        requests.done(&ended);
        assert!(!requests.serving.contains_key("served-1"));
        assert!(matches!(
            requests.start(head("served-0")),
            Err(StartRefused::IdInUse)
        ));
        requests.abort_all();
        // A head past its bound, or an overlong id.
        let mut large = head("large");
        large.url = format!("https://{}/", "a".repeat(MAX_HEAD_BYTES));
        assert!(matches!(requests.start(large), Err(StartRefused::TooLarge)));
        let mut headers = head("headers");
        headers
            .headers
            .insert("x-pad".to_owned(), vec!["p".repeat(1 << 10); 64]);
        assert!(matches!(
            requests.start(headers),
            Err(StartRefused::TooLarge)
        ));
        assert!(matches!(
            requests.start(head(&"i".repeat(300))),
            Err(StartRefused::TooLarge)
        ));
        // Headers of empty names and values take room too: 1,024 of them pass the bound.
        let mut empty = head("empty");
        empty
            .headers
            .insert(String::new(), vec![String::new(); 1024]);
        assert!(matches!(requests.start(empty), Err(StartRefused::TooLarge)));
    }

    /// A tunnel that never answers: every body it is given stays unsent.
    struct Unanswering;

    impl ModelTunnel for Unanswering {
        fn serve(&self, _request: ModelRequest) -> crate::tunnel::ServeFuture {
            Box::pin(std::future::pending())
        }

        fn max_request_body_bytes(&self) -> usize {
            1000
        }
    }

    /// A tunnel whose serving panics (a bug in it).
    struct Panicking;

    impl ModelTunnel for Panicking {
        fn serve(&self, _request: ModelRequest) -> crate::tunnel::ServeFuture {
            Box::pin(async { panic!("a tunnel bug (this test's)") })
        }
    }

    #[tokio::test]
    async fn a_servings_end_comes_however_it_ends_and_ends_only_its_own_entry() {
        let (conn, _theirs, _, _) = capturing(1000);
        let unanswering: Arc<dyn ModelTunnel> = Arc::new(Unanswering);
        let (tx, mut ends) = mpsc::unbounded_channel();
        let on_done = |tx: &mpsc::UnboundedSender<ServingEnded>| {
            let tx = tx.clone();
            move |ended| {
                let _ = tx.send(ended);
            }
        };
        let mut requests = TunnelRequests::default();
        requests.start(head("r1")).expect("room");
        assert!(requests.chunk(piece("r1", "{}", true), &conn, &unanswering, on_done(&tx)));
        // The runtime cancels it and uses its id again.
        let cancel = HttpRequestChunk {
            cancel: Some(true),
            ..piece("r1", "", false)
        };
        assert!(requests.chunk(cancel, &conn, &unanswering, on_done(&tx)));
        requests.start(head("r1")).expect("the id is free again");
        assert!(requests.chunk(piece("r1", "{}", true), &conn, &unanswering, on_done(&tx)));
        // The stopped serving's end comes, and leaves the new one alone.
        let stopped = tokio::time::timeout(Duration::from_secs(10), ends.recv())
            .await
            .expect("the stopped serving's end")
            .expect("sent");
        requests.done(&stopped);
        assert!(
            requests.serving.contains_key("r1"),
            "the new serving was ended"
        );
        requests.abort_all();
        // A serving whose tunnel panics still ends, and gives its place back.
        let panicking: Arc<dyn ModelTunnel> = Arc::new(Panicking);
        requests.start(head("r2")).expect("room");
        assert!(requests.chunk(piece("r2", "{}", true), &conn, &panicking, on_done(&tx)));
        let ended = loop {
            let ended = tokio::time::timeout(Duration::from_secs(10), ends.recv())
                .await
                .expect("the panicked serving's end")
                .expect("sent");
            if ended.request_id == "r2" {
                break ended;
            }
        };
        requests.done(&ended);
        assert!(requests.serving.is_empty());
    }

    #[tokio::test]
    async fn bodies_count_in_the_budget_until_sent_and_one_over_it_is_told_to_retry() {
        let (conn, mut theirs, _, _) = capturing(1000);
        let unanswering: Arc<dyn ModelTunnel> = Arc::new(Unanswering);
        let mut requests = TunnelRequests::default();
        // Bodies not yet sent count in the byte budget (twice the body limit): two of 900
        // being served, a third's piece would pass it and is refused as busy.
        for id in ["a", "b"] {
            requests.start(head(id)).expect("room");
            assert!(requests.chunk(
                piece(id, &"x".repeat(900), true),
                &conn,
                &unanswering,
                |_| {}
            ));
        }
        requests.start(head("c")).expect("room");
        assert!(requests.chunk(
            piece("c", &"x".repeat(900), true),
            &conn,
            &unanswering,
            |_| {}
        ));
        let answer = tokio::time::timeout(Duration::from_secs(10), answer_one(&mut theirs))
            .await
            .expect("c answered in time");
        assert_eq!(answer["status"], 503, "{answer}");
        let retry = answer_one(&mut theirs).await;
        assert!(
            retry["data"]
                .as_str()
                .is_some_and(|d| d.contains("retry once one has been sent")),
            "{retry}"
        );
        requests.abort_all();

        // Bodies the tunnel has sent (its answer is in) no longer count: a third passes.
        let (conn, mut theirs, tunnel, mut served) = capturing(1000);
        let mut requests = TunnelRequests::default();
        for id in ["a", "b"] {
            requests.start(head(id)).expect("room");
            assert!(requests.chunk(piece(id, &"x".repeat(900), true), &conn, &tunnel, |_| {}));
        }
        // Their heads reached the runtime's side: the tunnel had answered, the bodies let go.
        async fn heads(theirs: &mut DuplexStream, n: usize) -> Vec<u64> {
            let mut statuses = Vec::new();
            while statuses.len() < n {
                let params = answer_one(theirs).await;
                if let Some(status) = params["status"].as_u64() {
                    statuses.push(status);
                }
            }
            statuses
        }
        let statuses = tokio::time::timeout(Duration::from_secs(10), heads(&mut theirs, 2))
            .await
            .expect("answers in time");
        assert_eq!(statuses, [200, 200]);
        requests.start(head("c")).expect("room");
        assert!(requests.chunk(piece("c", &"x".repeat(900), true), &conn, &tunnel, |_| {}));
        let statuses = tokio::time::timeout(Duration::from_secs(10), heads(&mut theirs, 1))
            .await
            .expect("c answered in time");
        assert_eq!(statuses, [200]);
        let mut bodies = Vec::new();
        while let Ok(request) = served.try_recv() {
            bodies.push(request.body.len());
        }
        assert_eq!(bodies, [900, 900, 900]);
    }

    #[tokio::test]
    async fn a_request_body_sent_in_pieces_reaches_the_tunnel_whole() {
        let (body, status) =
            body_served(&[r#"{"model":"#, r#""m","#, r#""messages":[]}"#], 1 << 20).await;
        assert_eq!(
            body.as_deref(),
            Some(br#"{"model":"m","messages":[]}"#.as_slice())
        );
        assert_eq!(status, 200);
        let (body, _) = body_served(&["whole"], 1 << 20).await;
        assert_eq!(body.as_deref(), Some(b"whole".as_slice()));
    }

    #[tokio::test]
    async fn a_request_body_over_the_limit_is_answered_413_without_being_served() {
        let (body, status) = body_served(&["12345", "6789"], 8).await;
        assert_eq!(body, None);
        assert_eq!(status, 413);
        // Over it with its first piece alone, too.
        let (body, status) = body_served(&["123456789", "0"], 8).await;
        assert_eq!(body, None);
        assert_eq!(status, 413);
    }
}
