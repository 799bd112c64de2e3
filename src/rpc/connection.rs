//! A JSON-RPC 2.0 connection over a framed byte stream, with requests in both directions.
//!
//! The connection owns two tasks: a reader that cuts frames, parses messages and routes them
//! (responses to their waiting caller, requests and notifications to the owner's sink), and a
//! writer that serializes outgoing frames. It owns id correlation, per-request timeouts and
//! the rule that every pending request fails at once when the transport closes. It knows
//! nothing about sessions, workers or what the methods mean, with one exception an owner asks
//! for ([`ConnectionOptions::split_session_events`]): the shape of `session.event`'s params,
//! read in the same pass over the frame, so that an event's text is read once fewer on its
//! way to the session it names.

use std::collections::HashMap;
use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use futures_util::{FutureExt, SinkExt, StreamExt};
use serde::{Deserialize, Serialize};
use serde_json::value::RawValue;
use serde_json::{Value, json};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::sync::{mpsc, oneshot};
use tokio_util::codec::{FramedRead, FramedWrite};

use super::codec::{FrameCodec, FrameError};
use super::events::EventParams;
use super::gate::{EventGate, UnreadEvents, UnreadGuard};
use super::messages::Method;

/// JSON-RPC error code: the method does not exist.
pub const METHOD_NOT_FOUND: i64 = -32601;
/// JSON-RPC error code: invalid params.
pub const INVALID_PARAMS: i64 = -32602;
/// JSON-RPC error code: internal error.
pub const INTERNAL_ERROR: i64 = -32603;
/// JSON-RPC error code: the message is not a valid request (here: one holding more values
/// than [`ConnectionOptions::max_frame_values`]).
pub const INVALID_REQUEST: i64 = -32600;

/// Settings of one connection.
#[derive(Debug, Clone)]
pub struct ConnectionOptions {
    /// Largest accepted frame body in either direction.
    pub max_frame_bytes: usize,
    /// Timeout applied to requests that do not name their own.
    pub default_timeout: Duration,
    /// A `session.event` notification comes as [`Incoming::SessionEvent`] (the session it
    /// names and the event's text, read in the one pass over the frame) instead of
    /// [`Incoming::Notification`], whose params an owner routing events by session reads
    /// again. A `session.event` whose params are not an event's (`sessionId` not a string,
    /// none at all, …) still comes as a notification. Off by default.
    pub split_session_events: bool,
    /// Frames read above this size close the connection until
    /// [`Connection::lift_read_limit`] (then `max_frame_bytes` holds): for a peer that must
    /// first authenticate with a small call, so one that has not cannot make the reader
    /// parse a large frame. `None` (the default): `max_frame_bytes` from the start.
    pub read_limit_until_lifted: Option<usize>,
    /// Limits for a peer that may stop reading (a network client, not a child's pipe): what
    /// is queued for it and how long a write waits for it are bounded. `None` (the default):
    /// unbounded. Either way our close lets go of the peer's input at once.
    pub peer_limits: Option<PeerLimits>,
    /// For a peer whose messages are parsed into values it may shape (a network client): a
    /// frame holding more JSON values than this (counted by `crate::json_values`, before
    /// parsing) is not parsed. A request gets an [`INVALID_REQUEST`] answer saying so, an
    /// answer fails the call that waits for it the same way, and a notification is
    /// dropped; the connection goes on. `None` (the default): no bound beyond
    /// `max_frame_bytes`.
    pub max_frame_values: Option<usize>,
}

impl Default for ConnectionOptions {
    fn default() -> Self {
        Self {
            max_frame_bytes: super::codec::DEFAULT_MAX_FRAME_BYTES,
            default_timeout: Duration::from_secs(60),
            split_session_events: false,
            read_limit_until_lifted: None,
            peer_limits: None,
            max_frame_values: None,
        }
    }
}

/// Bounds on a peer that may stop reading ([`ConnectionOptions::peer_limits`]). Past
/// either, the connection closes ([`CloseCause::Io`], the owner told as for any close),
/// and the peer's socket is let go whether or not it ever closes its side.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PeerLimits {
    /// Bytes queued for the peer and not yet written, at most: a frame past it is dropped
    /// and the connection closes.
    pub max_queued_bytes: usize,
    /// How long one write may wait for the peer to read.
    pub write_stall_timeout: Duration,
}

/// A JSON-RPC error object as it travels on the wire.
#[derive(Debug, Clone, PartialEq, Serialize, serde::Deserialize)]
pub struct ErrorObject {
    /// Numeric error code (`-32601` method not found, `-32603` internal error, …).
    pub code: i64,
    /// Human-readable message.
    pub message: String,
    /// Extra data the peer attached, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub data: Option<Value>,
}

impl ErrorObject {
    /// An error with a code and message and no data.
    pub fn new(code: i64, message: impl Into<String>) -> Self {
        Self {
            code,
            message: message.into(),
            data: None,
        }
    }
}

/// Why the transport under a connection ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CloseCause {
    /// The peer closed its output (end of file between frames).
    Eof,
    /// The peer sent something that is not a valid frame or JSON-RPC message; the stream
    /// cannot be trusted any more.
    ProtocolViolation(String),
    /// Reading or writing the pipe failed.
    Io(String),
    /// The owner closed the connection.
    Local,
}

impl fmt::Display for CloseCause {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CloseCause::Eof => f.write_str("the peer closed the stream"),
            CloseCause::ProtocolViolation(d) => write!(f, "protocol violation: {d}"),
            CloseCause::Io(d) => write!(f, "i/o error: {d}"),
            CloseCause::Local => f.write_str("closed locally"),
        }
    }
}

/// Why a request did not produce a result.
#[derive(Debug, Clone, thiserror::Error)]
pub enum RpcError {
    /// The peer answered with a JSON-RPC error.
    #[error("{method} failed: error {} from the runtime: {}", .error.code, .error.message)]
    Remote { method: String, error: ErrorObject },
    /// No answer arrived in time. The request is forgotten; a late answer is dropped.
    #[error("{method} timed out after {after:?}")]
    Timeout { method: String, after: Duration },
    /// The transport closed before the answer arrived (or before the request was sent).
    #[error("{method} failed: connection closed ({cause})")]
    Closed { method: String, cause: CloseCause },
    /// The params could not be serialized.
    #[error("{method}: cannot encode params: {detail}")]
    Encode { method: String, detail: String },
    /// The result did not have the expected shape.
    #[error("{method}: unexpected result shape: {detail}")]
    Decode { method: String, detail: String },
}

impl RpcError {
    /// The JSON-RPC error code when the peer answered with an error.
    pub fn code(&self) -> Option<i64> {
        match self {
            RpcError::Remote { error, .. } => Some(error.code),
            _ => None,
        }
    }
}

/// `params` of a notification that had none.
fn null_params() -> Box<RawValue> {
    RawValue::NULL.to_owned()
}

/// The id of a request. The runtime numbers its own requests; ids may be numbers or strings.
pub type RequestId = Value;

/// Something the peer sent that is not an answer to one of our requests.
#[derive(Debug)]
pub enum Incoming {
    /// A notification (no answer expected); `params` as the JSON text they came as (`null`
    /// when absent), for the receiver to read what it needs of them.
    Notification {
        method: String,
        params: Box<RawValue>,
    },
    /// A `session.event` notification, with [`ConnectionOptions::split_session_events`]
    /// only: the session its params name and the event as the JSON text it came as (`null`
    /// when the params carried none).
    SessionEvent {
        session_id: String,
        event: Box<RawValue>,
    },
    /// A request the owner must answer through its [`Responder`].
    Request(IncomingRequest),
    /// The transport ended; nothing more will arrive. Sent exactly once.
    Closed(CloseCause),
}

/// A request from the peer, with the means to answer it exactly once.
#[derive(Debug)]
pub struct IncomingRequest {
    /// The method name.
    pub method: String,
    /// The params (`null` when absent).
    pub params: Value,
    /// Answers the request; dropping it unanswered sends an internal error.
    pub responder: Responder,
    /// What holding it costs, about: the size of the frame it came in, in bytes, or, where
    /// the connection counts values ([`ConnectionOptions::max_frame_values`]), 32 bytes per
    /// JSON value it holds when that is more.
    pub frame_bytes: usize,
}

/// Answers one incoming request. If it is dropped without an answer, the peer gets an
/// internal error, so no request is ever left without a reply.
pub struct Responder {
    id: Option<RequestId>,
    method: String,
    out: Outbox,
    max_frame_bytes: usize,
}

impl fmt::Debug for Responder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Responder")
            .field("id", &self.id)
            .field("method", &self.method)
            .finish()
    }
}

impl Responder {
    /// The responder of the peer's request `id` of `method` on this connection.
    fn to(shared: &Shared, id: RequestId, method: String) -> Self {
        Self {
            id: Some(id),
            method,
            out: shared.out.clone(),
            max_frame_bytes: shared.options.max_frame_bytes,
        }
    }

    /// The id the peer gave this request.
    pub fn id(&self) -> Option<&RequestId> {
        self.id.as_ref()
    }

    /// Send a successful result.
    pub fn ok(mut self, result: impl Serialize) {
        let result = serde_json::to_value(result).unwrap_or(Value::Null);
        let id = self.id.take();
        self.send(json!({"jsonrpc": "2.0", "id": id, "result": result}));
    }

    /// Send an error.
    pub fn err(mut self, error: ErrorObject) {
        let id = self.id.take();
        self.send(json!({"jsonrpc": "2.0", "id": id, "error": error}));
    }

    /// Send `method not found`.
    pub fn method_not_found(self) {
        let message = format!("Unhandled method {}", self.method);
        self.err(ErrorObject::new(METHOD_NOT_FOUND, message));
    }

    fn send(&mut self, message: Value) {
        let Ok(mut bytes) = serde_json::to_vec(&message) else {
            return;
        };
        if bytes.len() > self.max_frame_bytes {
            // The answer cannot be sent; the peer still gets one, so it never waits forever.
            let error = ErrorObject::new(
                INTERNAL_ERROR,
                format!(
                    "the answer to {} ({} bytes) exceeds the frame limit of {} bytes",
                    self.method,
                    bytes.len(),
                    self.max_frame_bytes
                ),
            );
            let id = message.get("id").cloned().unwrap_or(Value::Null);
            match serde_json::to_vec(&json!({"jsonrpc": "2.0", "id": id, "error": error})) {
                Ok(b) => bytes = b,
                Err(_) => return,
            }
        }
        // A closed writer means the peer is gone; there is nobody left to answer.
        self.out.frame(Bytes::from(bytes));
    }
}

impl Drop for Responder {
    fn drop(&mut self) {
        if self.id.is_some() {
            let error = ErrorObject::new(
                INTERNAL_ERROR,
                format!(
                    "{} was dropped by the client without an answer",
                    self.method
                ),
            );
            let id = self.id.take();
            self.send(json!({"jsonrpc": "2.0", "id": id, "error": error}));
        }
    }
}

enum Outgoing {
    Frame(Bytes),
    /// Close our write half (the peer sees end of file on its input).
    Close,
}

/// The writer's queue, as everything that sends holds it: with [`PeerLimits`], the bytes
/// in it are counted, and a frame past the limit is dropped and stops the writer.
#[derive(Clone)]
struct Outbox {
    tx: mpsc::UnboundedSender<Outgoing>,
    backlog: Option<Arc<Backlog>>,
}

/// The bytes queued for a peer that may stop reading.
struct Backlog {
    queued: AtomicUsize,
    max: usize,
    /// Wakes the writer to give up: a frame did not fit.
    overflowed: tokio::sync::Notify,
}

impl Outbox {
    /// Queues a frame for the writer; false when the writer is gone or the frame does not
    /// fit in the peer's backlog (the writer then closes the connection).
    fn frame(&self, bytes: Bytes) -> bool {
        if let Some(backlog) = &self.backlog {
            let len = bytes.len();
            let queued = backlog.queued.fetch_add(len, Ordering::SeqCst) + len;
            if queued > backlog.max {
                backlog.queued.fetch_sub(len, Ordering::SeqCst);
                backlog.overflowed.notify_one();
                return false;
            }
        }
        self.tx.send(Outgoing::Frame(bytes)).is_ok()
    }

    /// Asks the writer to close our write half once what is queued before is written.
    fn close(&self) {
        let _ = self.tx.send(Outgoing::Close);
    }
}

type Pending = oneshot::Sender<Result<Value, ErrorObject>>;

struct Shared {
    next_id: AtomicU64,
    pending: Mutex<HashMap<u64, (String, Pending)>>,
    closed: Mutex<Option<CloseCause>>,
    close_reported: AtomicBool,
    out: Outbox,
    options: ConnectionOptions,
    /// Sessions whose callers leave some event types unread (read only with
    /// `split_session_events`).
    gate: Arc<EventGate>,
    /// The largest frame the reader takes now (`read_limit_until_lifted` until lifted),
    /// read by its codec at each header.
    read_limit: Arc<AtomicUsize>,
    /// The reader task, stopped at our close: a peer may never close its side (a network
    /// client, a runtime's descendant that escaped its group holding the pipe).
    reader: Mutex<Option<tokio::task::AbortHandle>>,
}

impl Shared {
    /// Stops the reader: the peer's input is let go now, read no more.
    fn stop_reading(&self) {
        if let Ok(mut reader) = self.reader.lock()
            && let Some(reader) = reader.take()
        {
            reader.abort();
        }
    }

    fn closed_cause(&self) -> Option<CloseCause> {
        self.closed
            .lock()
            .map(|c| c.clone())
            .unwrap_or(Some(CloseCause::Local))
    }

    /// Marks the connection closed and fails every pending request with `cause`.
    fn close(&self, cause: CloseCause) {
        if let Ok(mut closed) = self.closed.lock()
            && closed.is_none()
        {
            *closed = Some(cause.clone());
        }
        let drained: Vec<(String, Pending)> = match self.pending.lock() {
            Ok(mut pending) => pending.drain().map(|(_, v)| v).collect(),
            Err(_) => Vec::new(),
        };
        // Dropping the senders wakes every waiter; they read the cause from `closed`.
        drop(drained);
    }
}

/// The callback that receives everything the peer sends besides responses. It runs on the
/// reader task, so it must be quick (typically: forward into a channel or an actor mailbox).
pub type IncomingSink = Box<dyn Fn(Incoming) + Send + Sync + 'static>;

/// The callback of [`Connection::start_batched`]: what arrived together, in order, in one
/// call (one wake-up of the owner instead of one per message).
pub type IncomingBatchSink = Box<dyn Fn(Vec<Incoming>) + Send + Sync + 'static>;

/// The most messages handed on in one batch.
const MAX_BATCH: usize = 64;

/// Closes our write half when the last [`Connection`] clone is dropped, so the writer task
/// ends and the peer sees end of file.
struct CloseOnDrop(Arc<Shared>);

impl Drop for CloseOnDrop {
    fn drop(&mut self) {
        self.0.out.close();
        self.0.stop_reading();
    }
}

/// A cloneable handle to one JSON-RPC connection. Dropping the last clone closes the
/// connection's output and stops its reader, as [`Connection::close`] does.
#[derive(Clone)]
pub struct Connection {
    shared: Arc<Shared>,
    _close_on_drop: Arc<CloseOnDrop>,
}

impl fmt::Debug for Connection {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Connection")
            .field("closed", &self.shared.closed_cause())
            .finish()
    }
}

impl Connection {
    /// Leaves the event types `unread` names of session `session_id` unread while the guard
    /// lives: those the pool does not read either ([`super::gate::unread_by_the_pool`]) are
    /// dropped at their frame's head, never parsed or handed on (with
    /// [`ConnectionOptions::split_session_events`]; without it nothing is dropped).
    pub(crate) fn leave_unread(&self, session_id: &str, unread: UnreadEvents) -> UnreadGuard {
        self.shared.gate.leave_unread(session_id, unread)
    }

    /// Starts a connection over `reader`/`writer`; everything that is not a response goes to
    /// `sink`. Must be called inside a tokio runtime.
    pub fn start<R, W>(reader: R, writer: W, options: ConnectionOptions, sink: IncomingSink) -> Self
    where
        R: AsyncRead + Unpin + Send + 'static,
        W: AsyncWrite + Unpin + Send + 'static,
    {
        let sink: IncomingBatchSink = Box::new(move |batch| batch.into_iter().for_each(&sink));
        Self::start_batched(reader, writer, options, sink)
    }

    /// [`Connection::start`], with the messages that were read together (already in the
    /// reader's buffer, or in the pipe, when one was read) passed on in one call, in order.
    pub fn start_batched<R, W>(
        reader: R,
        writer: W,
        options: ConnectionOptions,
        sink: IncomingBatchSink,
    ) -> Self
    where
        R: AsyncRead + Unpin + Send + 'static,
        W: AsyncWrite + Unpin + Send + 'static,
    {
        let (out_tx, out_rx) = mpsc::unbounded_channel();
        let backlog = options.peer_limits.map(|limits| {
            Arc::new(Backlog {
                queued: AtomicUsize::new(0),
                max: limits.max_queued_bytes,
                overflowed: tokio::sync::Notify::new(),
            })
        });
        let read_limit = options
            .read_limit_until_lifted
            .map_or(options.max_frame_bytes, |limit| {
                limit.min(options.max_frame_bytes)
            });
        let shared = Arc::new(Shared {
            next_id: AtomicU64::new(1),
            pending: Mutex::new(HashMap::new()),
            closed: Mutex::new(None),
            close_reported: AtomicBool::new(false),
            out: Outbox {
                tx: out_tx,
                backlog: backlog.clone(),
            },
            options,
            gate: Arc::default(),
            read_limit: Arc::new(AtomicUsize::new(read_limit)),
            reader: Mutex::new(None),
        });
        let sink: Arc<IncomingBatchSink> = Arc::new(sink);
        // The writer holds the shared state weakly: it must not keep its own channel open.
        tokio::spawn(write_loop(
            writer,
            out_rx,
            Arc::downgrade(&shared),
            sink.clone(),
            backlog,
        ));
        let reading = tokio::spawn(read_loop(reader, shared.clone(), sink));
        if let Ok(mut slot) = shared.reader.lock() {
            *slot = Some(reading.abort_handle());
        }
        let close_on_drop = Arc::new(CloseOnDrop(shared.clone()));
        Self {
            shared,
            _close_on_drop: close_on_drop,
        }
    }

    /// Sends a typed request and waits for its typed result, with the method's default timeout.
    pub async fn call<M: Method>(&self, params: &M::Params) -> Result<M::Result, RpcError> {
        self.call_with_timeout::<M>(params, None).await
    }

    /// Sends a typed request with an explicit timeout (`None`: the connection default).
    pub async fn call_with_timeout<M: Method>(
        &self,
        params: &M::Params,
        timeout: Option<Duration>,
    ) -> Result<M::Result, RpcError> {
        let params = serde_json::to_value(params).map_err(|e| RpcError::Encode {
            method: M::NAME.to_owned(),
            detail: e.to_string(),
        })?;
        let value = self.request(M::NAME, params, timeout).await?;
        serde_json::from_value(value).map_err(|e| RpcError::Decode {
            method: M::NAME.to_owned(),
            detail: e.to_string(),
        })
    }

    /// Sends a request with raw params and waits for the raw result.
    pub async fn request(
        &self,
        method: &str,
        params: Value,
        timeout: Option<Duration>,
    ) -> Result<Value, RpcError> {
        let closed = |cause| RpcError::Closed {
            method: method.to_owned(),
            cause,
        };
        if let Some(cause) = self.shared.closed_cause() {
            return Err(closed(cause));
        }
        let id = self.shared.next_id.fetch_add(1, Ordering::Relaxed);
        let frame = serde_json::to_vec(&json!({
            "jsonrpc": "2.0", "id": id, "method": method, "params": params,
        }))
        .map_err(|e| RpcError::Encode {
            method: method.to_owned(),
            detail: e.to_string(),
        })?;
        self.check_size(method, frame.len())?;
        let (tx, rx) = oneshot::channel();
        match self.shared.pending.lock() {
            Ok(mut pending) => {
                pending.insert(id, (method.to_owned(), tx));
            }
            Err(_) => return Err(closed(CloseCause::Local)),
        }
        // Whatever ends the call (an answer, a timeout, the close, or the caller dropping
        // it), its entry goes: one the peer never answers is not held for the connection's
        // life.
        let _forget = ForgetOnDrop { conn: self, id };
        // The close may have happened between the check above and the insert.
        if let Some(cause) = self.shared.closed_cause() {
            return Err(closed(cause));
        }
        if !self.shared.out.frame(Bytes::from(frame)) {
            return Err(closed(
                self.shared.closed_cause().unwrap_or(CloseCause::Local),
            ));
        }
        let after = timeout.unwrap_or(self.shared.options.default_timeout);
        match tokio::time::timeout(after, rx).await {
            Ok(Ok(Ok(result))) => Ok(result),
            Ok(Ok(Err(error))) => Err(RpcError::Remote {
                method: method.to_owned(),
                error,
            }),
            Ok(Err(_)) => Err(closed(
                self.shared.closed_cause().unwrap_or(CloseCause::Local),
            )),
            Err(_) => Err(RpcError::Timeout {
                method: method.to_owned(),
                after,
            }),
        }
    }

    /// Sends a notification (no answer); `params` serialized straight into the frame.
    pub fn notify(&self, method: &str, params: impl Serialize) -> Result<(), RpcError> {
        let closed = |cause| RpcError::Closed {
            method: method.to_owned(),
            cause,
        };
        if let Some(cause) = self.shared.closed_cause() {
            return Err(closed(cause));
        }
        #[derive(Serialize)]
        struct Notification<'a, P> {
            jsonrpc: &'static str,
            method: &'a str,
            params: P,
        }
        let frame = serde_json::to_vec(&Notification {
            jsonrpc: "2.0",
            method,
            params,
        })
        .map_err(|e| RpcError::Encode {
            method: method.to_owned(),
            detail: e.to_string(),
        })?;
        self.check_size(method, frame.len())?;
        if self.shared.out.frame(Bytes::from(frame)) {
            Ok(())
        } else {
            Err(closed(
                self.shared.closed_cause().unwrap_or(CloseCause::Local),
            ))
        }
    }

    /// Closes the connection: pending requests fail with `cause`, and our write half is
    /// closed once the frames queued before it are written (with
    /// [`ConnectionOptions::peer_limits`], the writer within the write stall timeout), and
    /// the reader stops at once.
    pub fn close(&self, cause: CloseCause) {
        self.shared.close(cause);
        self.shared.out.close();
        self.shared.stop_reading();
    }

    /// Why the connection closed, if it has.
    pub fn close_cause(&self) -> Option<CloseCause> {
        self.shared.closed_cause()
    }

    /// The largest frame this connection sends or reads.
    pub(crate) fn max_frame_bytes(&self) -> usize {
        self.shared.options.max_frame_bytes
    }

    /// Lifts [`ConnectionOptions::read_limit_until_lifted`]: frames up to `max_frame_bytes`
    /// are read from now on (the peer authenticated).
    pub fn lift_read_limit(&self) {
        self.shared
            .read_limit
            .store(self.shared.options.max_frame_bytes, Ordering::SeqCst);
    }

    /// Number of our requests still waiting for an answer.
    pub fn pending_requests(&self) -> usize {
        self.shared.pending.lock().map(|p| p.len()).unwrap_or(0)
    }

    fn check_size(&self, method: &str, len: usize) -> Result<(), RpcError> {
        let max = self.shared.options.max_frame_bytes;
        if len > max {
            return Err(RpcError::Encode {
                method: method.to_owned(),
                detail: format!("message of {len} bytes exceeds the frame limit of {max} bytes"),
            });
        }
        Ok(())
    }

    fn forget(&self, id: u64) {
        if let Ok(mut pending) = self.shared.pending.lock() {
            pending.remove(&id);
        }
    }
}

/// Removes a request's entry from the pending ones when its call ends, however it ends.
struct ForgetOnDrop<'a> {
    conn: &'a Connection,
    id: u64,
}

impl Drop for ForgetOnDrop<'_> {
    fn drop(&mut self) {
        self.conn.forget(self.id);
    }
}

fn report_close(shared: &Shared, sink: &IncomingBatchSink, cause: CloseCause) {
    shared.close(cause.clone());
    if !shared.close_reported.swap(true, Ordering::SeqCst) {
        sink(vec![Incoming::Closed(cause)]);
    }
}

async fn write_loop<W>(
    writer: W,
    mut rx: mpsc::UnboundedReceiver<Outgoing>,
    shared: std::sync::Weak<Shared>,
    sink: Arc<IncomingBatchSink>,
    backlog: Option<Arc<Backlog>>,
) where
    W: AsyncWrite + Unpin + Send + 'static,
{
    let (max, limits) = shared
        .upgrade()
        .map(|s| (s.options.max_frame_bytes, s.options.peer_limits))
        .unwrap_or((super::codec::DEFAULT_MAX_FRAME_BYTES, None));
    let guard = limits.zip(backlog).map(|(limits, backlog)| WriteGuard {
        stall: limits.write_stall_timeout,
        backlog,
    });
    let mut framed = FramedWrite::new(writer, FrameCodec::new(max));
    let mut closing = false;
    while !closing && let Some(first) = rx.recv().await {
        // What was queued together is written together: every frame already waiting goes
        // into the buffer (which writes itself out past its backpressure boundary), then one
        // flush, so a burst (a response with the next request, several conversations' sends)
        // is one write and one wake-up of the peer, not one each.
        let mut next = Some(first);
        while let Some(item) = next.take() {
            match item {
                Outgoing::Frame(bytes) => {
                    match guarded(feed_one(&mut framed, bytes, guard.as_ref()), guard.as_ref())
                        .await
                    {
                        Ok(()) => {}
                        Err(FrameError::TooLarge { announced, max }) => {
                            // Only our own oversized message is lost; the stream stays in sync.
                            tracing::warn!(
                                announced,
                                max,
                                "Dropped an outgoing frame over the size limit."
                            );
                        }
                        Err(error) => {
                            close_on_write_error(&shared, &sink, error);
                            return;
                        }
                    }
                }
                Outgoing::Close => {
                    closing = true;
                    break;
                }
            }
            next = rx.try_recv().ok();
        }
        if let Err(error) = guarded(framed.flush(), guard.as_ref()).await {
            close_on_write_error(&shared, &sink, error);
            return;
        }
    }
    let _ = guarded(framed.close(), guard.as_ref()).await;
}

/// Feeds one frame into the writer's buffer; once it is in, its bytes leave the backlog.
async fn feed_one<W>(
    framed: &mut FramedWrite<W, FrameCodec>,
    bytes: Bytes,
    guard: Option<&WriteGuard>,
) -> Result<(), FrameError>
where
    W: AsyncWrite + Unpin,
{
    let len = bytes.len();
    let fed = framed.feed(bytes).await;
    if let Some(guard) = guard {
        guard.backlog.queued.fetch_sub(len, Ordering::SeqCst);
    }
    fed
}

/// What bounds the writer for a peer that may stop reading ([`PeerLimits`]).
struct WriteGuard {
    stall: Duration,
    backlog: Arc<Backlog>,
}

/// `io` (a frame fed into the writer's buffer, a flush, the close), with a guard bounded by
/// the write stall timeout and given up when a frame overflowed the backlog.
async fn guarded<F>(io: F, guard: Option<&WriteGuard>) -> Result<(), FrameError>
where
    F: std::future::Future<Output = Result<(), FrameError>>,
{
    let Some(guard) = guard else {
        return io.await;
    };
    tokio::select! {
        done = io => done,
        () = tokio::time::sleep(guard.stall) => Err(FrameError::Io(std::io::Error::new(
            std::io::ErrorKind::TimedOut,
            format!(
                "the peer read nothing for {} s while a write waited for it",
                guard.stall.as_secs_f64()
            ),
        ))),
        () = guard.backlog.overflowed.notified() => Err(FrameError::Io(std::io::Error::other(
            format!(
                "the peer stopped reading: more than {} bytes were queued for it",
                guard.backlog.max
            ),
        ))),
    }
}

/// The writer failed: the connection is closed, and its owner told why.
fn close_on_write_error(
    shared: &std::sync::Weak<Shared>,
    sink: &Arc<IncomingBatchSink>,
    error: FrameError,
) {
    if let Some(shared) = shared.upgrade() {
        report_close(&shared, sink, CloseCause::Io(error.to_string()));
        shared.stop_reading();
    }
}

async fn read_loop<R>(reader: R, shared: Arc<Shared>, sink: Arc<IncomingBatchSink>)
where
    R: AsyncRead + Unpin + Send + 'static,
{
    let mut framed = FramedRead::new(
        reader,
        FrameCodec::with_read_max(shared.options.max_frame_bytes, shared.read_limit.clone()),
    );
    // What was read together goes on together: the frames the reader can give without
    // waiting are dispatched into one batch, handed on when it would wait (or is full).
    let mut batch = Vec::new();
    let cause = loop {
        let next = if batch.is_empty() {
            framed.next().await
        } else {
            match framed.next().now_or_never() {
                Some(next) => next,
                None => {
                    sink(std::mem::take(&mut batch));
                    continue;
                }
            }
        };
        match next {
            None => break CloseCause::Eof,
            Some(Err(FrameError::Io(e))) => break CloseCause::Io(e.to_string()),
            Some(Err(e)) => break CloseCause::ProtocolViolation(e.to_string()),
            Some(Ok(frame)) => {
                if let Err(violation) = dispatch(&frame, &shared, &mut batch, &sink) {
                    break CloseCause::ProtocolViolation(violation);
                }
                if batch.len() >= MAX_BATCH {
                    sink(std::mem::take(&mut batch));
                }
            }
        }
    };
    if !batch.is_empty() {
        sink(batch);
    }
    tracing::debug!(%cause, "JSON-RPC transport closed.");
    report_close(&shared, &sink, cause);
    // Nothing more can be exchanged: let the writer finish and close our output.
    shared.out.close();
}

/// Hands an answer to the call waiting for it, after what was read before it (so its caller
/// wakes to find those handed on).
fn deliver_answer(
    shared: &Shared,
    batch: &mut Vec<Incoming>,
    sink: &IncomingBatchSink,
    id: &Value,
    outcome: Result<Value, ErrorObject>,
) {
    if !batch.is_empty() {
        sink(std::mem::take(batch));
    }
    let waiter = id
        .as_u64()
        .and_then(|n| shared.pending.lock().ok().and_then(|mut p| p.remove(&n)));
    match waiter {
        Some((_, tx)) => {
            let _ = tx.send(outcome);
        }
        None => tracing::debug!(%id, "Dropped a response nobody waits for (timed out?)."),
    }
}

/// A frame holding more values than [`ConnectionOptions::max_frame_values`], read no
/// further than its `id` and `method` (unknown members are skipped, never built): a request
/// is answered [`INVALID_REQUEST`], an answer fails its waiting call with that error, a
/// notification is dropped. A frame whose head cannot be read that way (not JSON, a member
/// twice, an id that is not a number or a string) breaks the protocol.
fn refuse_too_many_values(
    frame: &[u8],
    limit: usize,
    shared: &Shared,
    batch: &mut Vec<Incoming>,
    sink: &IncomingBatchSink,
) -> Result<(), String> {
    #[derive(serde::Deserialize)]
    struct Head<'a> {
        #[serde(borrow)]
        id: Option<&'a RawValue>,
        method: Option<String>,
    }
    let head: Head = serde_json::from_slice(frame).map_err(|e| {
        format!(
            "frame of {} bytes holds more than {limit} JSON values and its head does not read \
             ({e})",
            frame.len()
        )
    })?;
    let error = ErrorObject::new(
        INVALID_REQUEST,
        format!(
            "copilot-pool: this message of {} bytes holds more than {limit} JSON values \
             (elements, members and keys: one per {} bytes of the largest frame allowed); it \
             was not read. Send large data as one string (a file attachment by path, base64 \
             text), or split it",
            frame.len(),
            crate::json_values::BYTES_PER_VALUE
        ),
    );
    let id = match head.id {
        Some(raw) if raw.get() != "null" => match serde_json::from_str::<Value>(raw.get()) {
            Ok(id @ (Value::Number(_) | Value::String(_))) => Some(id),
            _ => return Err("message id is neither a number nor a string".to_owned()),
        },
        _ => None,
    };
    match (head.method, id) {
        (Some(method), Some(id)) => Responder::to(shared, id, method).err(error),
        (Some(method), None) => {
            tracing::debug!(%method, limit, "Dropped a notification holding too many values.");
        }
        (None, Some(id)) => deliver_answer(shared, batch, sink, &id, Err(error)),
        (None, None) => {
            return Err("message is neither request, notification nor response".to_owned());
        }
    }
    Ok(())
}

/// The members of a JSON-RPC message, read in one pass over the frame: a request's params
/// are read as a value when its id and method come first (as the runtime writes them), a
/// `session.event`'s as an event's when asked for; other params and a result stay the JSON
/// text they came as (parsed, if at all, by whoever takes them). A member that
/// is there is `Some`, `null` included (`"result": null` is an answer, and an error answered
/// with `"id": null` is a response nobody waits for, not a broken stream); a member given
/// twice is an error, as serde's derive has it (the caller then reads the text as a `Value`
/// reads it).
struct Members<'a> {
    method: Option<Value>,
    id: Option<Value>,
    params: Option<Params<'a>>,
    result: Option<&'a RawValue>,
    error: Option<Value>,
}

/// A message's `params` as the pass over the frame left them.
enum Params<'a> {
    /// Their JSON text.
    Text(&'a RawValue),
    /// A `session.event`'s, read as such (asked for, and its `method` came first).
    Event(EventParams<'a>),
    /// A request's, read as a `Value` (its `id` and `method` came first, as the runtime
    /// writes them: read once, where the text would be read again to build the value).
    Value(Value),
}

impl<'a> Params<'a> {
    /// Whether they were read as a `session.event`'s.
    fn split(params: &Option<Params<'a>>) -> bool {
        matches!(params, Some(Params::Event(_)))
    }
}

/// The names of the members [`Members`] reads; any other is skipped.
#[derive(Deserialize)]
#[serde(field_identifier, rename_all = "lowercase")]
enum Member {
    Method,
    Id,
    Params,
    Result,
    Error,
    #[serde(other)]
    Other,
}

/// Reads a message's [`Members`]; with `values`, the params of a request whose non-null `id`
/// and `method` come before them are read as a `Value` on the way; with `split_events`, the
/// params of a `session.event` notification whose `method` comes before them are read as
/// [`EventParams`] (the runtime writes `id` and `method` first; params that come first stay
/// text here).
#[derive(Clone, Copy)]
struct MembersSeed {
    split_events: bool,
    values: bool,
}

impl MembersSeed {
    /// Every params kept as text.
    const TEXT: Self = Self {
        split_events: false,
        values: false,
    };

    /// A request's params read as a value, and a `session.event`'s as an event's when
    /// `split_events`.
    fn one_pass(split_events: bool) -> Self {
        Self {
            split_events,
            values: true,
        }
    }
}

impl<'de> serde::de::DeserializeSeed<'de> for MembersSeed {
    type Value = Members<'de>;

    fn deserialize<D: serde::Deserializer<'de>>(self, d: D) -> Result<Members<'de>, D::Error> {
        d.deserialize_map(self)
    }
}

impl<'de> serde::de::Visitor<'de> for MembersSeed {
    type Value = Members<'de>;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a JSON-RPC message object")
    }

    fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<Members<'de>, A::Error> {
        // A member given twice is refused at its name, as serde's derive does.
        fn vacant<T, E: serde::de::Error>(slot: &Option<T>, name: &'static str) -> Result<(), E> {
            match slot {
                Some(_) => Err(E::duplicate_field(name)),
                None => Ok(()),
            }
        }
        let mut m = Members {
            method: None,
            id: None,
            params: None,
            result: None,
            error: None,
        };
        while let Some(member) = map.next_key::<Member>()? {
            match member {
                Member::Method => {
                    vacant(&m.method, "method")?;
                    m.method = Some(map.next_value()?);
                }
                Member::Id => {
                    vacant(&m.id, "id")?;
                    m.id = Some(map.next_value()?);
                }
                Member::Params => {
                    vacant(&m.params, "params")?;
                    let request = self.values
                        && m.id.as_ref().is_some_and(|id| !id.is_null())
                        && matches!(&m.method, Some(Value::String(_)));
                    let event = self.split_events
                        && matches!(&m.method, Some(Value::String(s)) if s == "session.event");
                    m.params = Some(if request {
                        Params::Value(map.next_value()?)
                    } else if event {
                        Params::Event(map.next_value()?)
                    } else {
                        Params::Text(map.next_value()?)
                    });
                }
                Member::Result => {
                    vacant(&m.result, "result")?;
                    m.result = Some(map.next_value()?);
                }
                Member::Error => {
                    vacant(&m.error, "error")?;
                    m.error = Some(map.next_value()?);
                }
                Member::Other => {
                    map.next_value::<serde::de::IgnoredAny>()?;
                }
            }
        }
        Ok(m)
    }
}

/// `text`'s members as `seed` reads them, the whole text read (nothing may follow the
/// message).
fn read_members(text: &[u8], seed: MembersSeed) -> serde_json::Result<Members<'_>> {
    use serde::de::DeserializeSeed;
    let mut de = serde_json::Deserializer::from_slice(text);
    let members = seed.deserialize(&mut de)?;
    de.end()?;
    Ok(members)
}

/// JSON text that serde's derive refuses but a `Value` reads (a key given twice: the last one
/// counts), written again as a `Value` reads it; `None` when it is not JSON. The one-pass
/// readers of frames and events fall back on it, so such text means what it meant when
/// everything was read into a `Value`.
pub(crate) fn read_as_a_value_reads(text: &[u8]) -> Option<Vec<u8>> {
    let value: Value = serde_json::from_slice(text).ok()?;
    serde_json::to_vec(&value).ok()
}

/// Routes one frame: a response to its waiting caller, anything else onto `batch`. What the
/// batch holds is handed to `sink` before a response wakes its caller, so the owner sees
/// everything the peer sent before the response first, as when each went on alone. An
/// `Err` means the frame is not JSON-RPC and the stream is broken.
fn dispatch(
    frame: &[u8],
    shared: &Shared,
    batch: &mut Vec<Incoming>,
    sink: &IncomingBatchSink,
) -> Result<(), String> {
    // Its length, never its text: a frame may carry a token (an SDK client's `connect`).
    let not_json =
        |e: &dyn fmt::Display| format!("frame of {} bytes is not JSON ({e})", frame.len());
    // A struct also reads from an array: only an object is a message.
    if frame.iter().find(|b| !b.is_ascii_whitespace()) != Some(&b'{') {
        return match serde_json::from_slice::<serde::de::IgnoredAny>(frame) {
            Ok(_) => Err("frame is not a JSON-RPC object".to_owned()),
            Err(e) => Err(not_json(&e)),
        };
    }
    // What holding the frame parsed costs, about: its bytes, or a value's size per value it
    // holds when that is more (`[0,0,…]` takes 16 times its bytes parsed).
    let mut holding_bytes = frame.len();
    if let Some(limit) = shared.options.max_frame_values {
        match crate::json_values::values_within(frame, limit) {
            None => return refuse_too_many_values(frame, limit, shared, batch, sink),
            Some(values) => {
                holding_bytes =
                    holding_bytes.max(values.saturating_mul(crate::json_values::BYTES_PER_VALUE));
            }
        }
    }
    let split = shared.options.split_session_events;
    // An event nobody reads goes no further than its head.
    if split && shared.gate.drop_if_unread(frame) {
        return Ok(());
    }
    let read_again;
    let message = match read_members(frame, MembersSeed::one_pass(split)) {
        // A request's params are read whole (a `session.event` request, which no runtime
        // sends, included; its `id` after its params).
        Ok(message)
            if message.id.as_ref().is_some_and(|id| !id.is_null())
                && Params::split(&message.params) =>
        {
            read_members(frame, MembersSeed::TEXT).map_err(|e| not_json(&e))?
        }
        Ok(message) => message,
        // Params that do not read as an event's or a value go on as the text they are (a
        // request's are read as a value below, one level less deep, as before the one pass);
        // what is wrong with a frame is said by the reading that keeps them text.
        Err(_) => match read_members(frame, MembersSeed::TEXT) {
            Ok(message) => message,
            Err(e) => {
                read_again = read_as_a_value_reads(frame).ok_or_else(|| not_json(&e))?;
                read_members(&read_again, MembersSeed::TEXT).map_err(|e| not_json(&e))?
            }
        },
    };
    match (message.method, message.id) {
        (Some(Value::String(method)), Some(id)) if !id.is_null() => {
            let params = match message.params {
                Some(Params::Value(value)) => value,
                Some(Params::Text(raw)) => {
                    serde_json::from_str(raw.get()).map_err(|e| not_json(&e))?
                }
                Some(Params::Event(_)) | None => Value::Null,
            };
            let responder = Responder::to(shared, id, method.clone());
            batch.push(Incoming::Request(IncomingRequest {
                method,
                params,
                responder,
                frame_bytes: holding_bytes,
            }));
            Ok(())
        }
        (Some(Value::String(method)), _) => {
            // Params that came before the method are read as an event's now (a second pass,
            // which the runtime's order of members spares).
            let params = match message.params {
                Some(Params::Text(text)) if split && method == "session.event" => {
                    match serde_json::from_str::<EventParams>(text.get()) {
                        Ok(params) => Some(Params::Event(params)),
                        Err(_) => Some(Params::Text(text)),
                    }
                }
                params => params,
            };
            batch.push(match params {
                Some(Params::Event(params)) => Incoming::SessionEvent {
                    session_id: params.session_id,
                    event: params.event.unwrap_or(RawValue::NULL).to_owned(),
                },
                Some(Params::Text(params)) => Incoming::Notification {
                    method,
                    params: params.to_owned(),
                },
                // Not reached: only a request's params (a non-null id) are read as a value.
                Some(Params::Value(params)) => Incoming::Notification {
                    method,
                    params: serde_json::value::to_raw_value(&params)
                        .unwrap_or_else(|_| null_params()),
                },
                None => Incoming::Notification {
                    method,
                    params: null_params(),
                },
            });
            Ok(())
        }
        (Some(_), _) => Err("method is not a string".to_owned()),
        (None, Some(id)) => {
            let outcome =
                if let Some(error) = message.error {
                    let error = serde_json::from_value::<ErrorObject>(error.clone())
                        .unwrap_or_else(|_| ErrorObject {
                            code: INTERNAL_ERROR,
                            message: "malformed error object".to_owned(),
                            data: Some(error),
                        });
                    Err(error)
                } else if let Some(result) = message.result {
                    Ok(serde_json::from_str(result.get()).map_err(|e| not_json(&e))?)
                } else {
                    return Err("response without result or error".to_owned());
                };
            deliver_answer(shared, batch, sink, &id, outcome);
            Ok(())
        }
        (None, None) => Err("message is neither request, notification nor response".to_owned()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt, DuplexStream, duplex};

    /// A connection whose peer is driven by hand through raw bytes.
    fn pair() -> (Connection, DuplexStream, mpsc::UnboundedReceiver<Incoming>) {
        pair_with(ConnectionOptions {
            max_frame_bytes: 1024,
            default_timeout: Duration::from_secs(5),
            split_session_events: false,
            read_limit_until_lifted: None,
            peer_limits: None,
            max_frame_values: None,
        })
    }

    fn pair_with(
        options: ConnectionOptions,
    ) -> (Connection, DuplexStream, mpsc::UnboundedReceiver<Incoming>) {
        let (ours, theirs) = duplex(1 << 16);
        let (r, w) = tokio::io::split(ours);
        let (tx, rx) = mpsc::unbounded_channel();
        let conn = Connection::start(
            r,
            w,
            options,
            Box::new(move |m| {
                let _ = tx.send(m);
            }),
        );
        (conn, theirs, rx)
    }

    /// A connection with [`PeerLimits`] over a pipe of `pipe` bytes, whose peer is driven by
    /// hand.
    fn limited(
        pipe: usize,
        limits: PeerLimits,
    ) -> (Connection, DuplexStream, mpsc::UnboundedReceiver<Incoming>) {
        let (ours, theirs) = duplex(pipe);
        let (r, w) = tokio::io::split(ours);
        let (tx, rx) = mpsc::unbounded_channel();
        let options = ConnectionOptions {
            peer_limits: Some(limits),
            ..ConnectionOptions::default()
        };
        let conn = Connection::start(
            r,
            w,
            options,
            Box::new(move |m| {
                let _ = tx.send(m);
            }),
        );
        (conn, theirs, rx)
    }

    /// The close the owner is told of, skipping what came before it.
    async fn closed_cause(rx: &mut mpsc::UnboundedReceiver<Incoming>) -> CloseCause {
        loop {
            match tokio::time::timeout(Duration::from_secs(5), rx.recv()).await {
                Ok(Some(Incoming::Closed(cause))) => return cause,
                Ok(Some(_)) => {}
                Ok(None) => panic!("the sink went away before the close"),
                Err(_) => panic!("no close reported"),
            }
        }
    }

    #[tokio::test]
    async fn with_peer_limits_our_close_lets_go_of_a_peer_that_keeps_sending_and_never_closes() {
        let limits = PeerLimits {
            max_queued_bytes: 1 << 20,
            write_stall_timeout: Duration::from_secs(60),
        };
        let (conn, peer, _rx) = limited(1 << 16, limits);
        our_close_lets_go_of(conn, peer).await;
    }

    #[tokio::test]
    async fn without_peer_limits_our_close_lets_go_of_a_peer_that_keeps_sending_too() {
        // A runtime's descendant that left its group may hold the pipe open for good.
        let (conn, peer, _rx) = pair();
        our_close_lets_go_of(conn, peer).await;
    }

    async fn our_close_lets_go_of(conn: Connection, mut peer: DuplexStream) {
        conn.close(CloseCause::Local);
        // The peer goes on sending valid frames: once our reader has let go of its input
        // (and our writer of its output), its writes fail.
        let note = r#"{"jsonrpc":"2.0","method":"still.here"}"#;
        let frame = format!("Content-Length: {}\r\n\r\n{note}", note.len());
        let sending = async {
            loop {
                peer.write_all(frame.as_bytes()).await?;
                tokio::task::yield_now().await;
            }
        };
        let ended: Result<std::io::Result<()>, _> =
            tokio::time::timeout(Duration::from_secs(3), sending).await;
        match ended {
            Ok(Err(e)) => assert_eq!(e.kind(), std::io::ErrorKind::BrokenPipe, "{e}"),
            other => panic!("the peer's input was still read after our close: {other:?}"),
        }
    }

    #[tokio::test]
    async fn a_peer_that_stops_reading_closes_the_connection_once_its_backlog_is_full() {
        let limits = PeerLimits {
            max_queued_bytes: 8 * 1024,
            write_stall_timeout: Duration::from_secs(600),
        };
        // A pipe of 1 KiB the peer never reads: the writer blocks at once, and what is
        // sent after queues up.
        let (conn, _peer, mut rx) = limited(1024, limits);
        let big = "x".repeat(1024);
        let mut sent = 0;
        while conn.notify("n", json!({ "big": big })).is_ok() {
            sent += 1;
            assert!(
                sent < 1000,
                "every notification was queued: nothing bounds the backlog"
            );
        }
        assert!(sent >= 4, "only {sent} were queued");
        let CloseCause::Io(why) = closed_cause(&mut rx).await else {
            panic!("not an i/o close");
        };
        assert!(why.contains("stopped reading"), "{why}");
        assert!(matches!(
            conn.notify("n", json!({})),
            Err(RpcError::Closed { .. })
        ));
    }

    #[tokio::test]
    async fn a_peer_that_reads_is_never_closed_by_its_backlog_however_much_it_gets() {
        let limits = PeerLimits {
            max_queued_bytes: 8 * 1024,
            write_stall_timeout: Duration::from_secs(600),
        };
        let (conn, mut peer, _rx) = limited(1 << 16, limits);
        let big = "x".repeat(1024);
        // Twelve times the backlog in all, each frame read before the next is sent: what was
        // written leaves the count.
        for i in 0..100 {
            conn.notify("n", json!({ "i": i, "big": big }))
                .expect("a reading peer's frame is queued");
            assert_eq!(read_frame(&mut peer).await["params"]["i"], i);
        }
    }

    #[tokio::test]
    async fn a_write_the_peer_does_not_read_within_the_stall_timeout_closes_the_connection() {
        let limits = PeerLimits {
            max_queued_bytes: 1 << 20,
            write_stall_timeout: Duration::from_millis(100),
        };
        let (conn, _peer, mut rx) = limited(64, limits);
        conn.notify("n", json!({ "big": "x".repeat(1024) }))
            .expect("queued");
        let CloseCause::Io(why) = closed_cause(&mut rx).await else {
            panic!("not an i/o close");
        };
        assert!(why.contains("read nothing for 0.1 s"), "{why}");
    }

    /// A frame of `n` zeros in an array as its `params` (or `result`), two bytes a value.
    fn dense(head: &str, n: usize) -> String {
        let zeros = vec!["0"; n].join(",");
        format!(r#"{{"jsonrpc":"2.0",{head},"params":[{zeros}]}}"#)
    }

    #[tokio::test]
    async fn a_request_holding_more_values_than_allowed_is_refused_unread_and_the_next_is_read() {
        let (_conn, mut peer, mut rx) = pair_with(ConnectionOptions {
            max_frame_values: Some(100),
            ..ConnectionOptions::default()
        });
        write_frame(&mut peer, &dense(r#""id":7,"method":"big""#, 100)).await;
        let answer = tokio::time::timeout(Duration::from_secs(5), read_frame(&mut peer))
            .await
            .expect("the request was not answered");
        assert_eq!(answer["id"], 7);
        assert_eq!(answer["error"]["code"], INVALID_REQUEST);
        let message = answer["error"]["message"].as_str().unwrap_or_default();
        assert!(
            message.contains("more than 100 JSON values") && message.contains("one string"),
            "{message}"
        );
        // A notification past the limit is dropped; within it, requests are read as ever.
        write_frame(&mut peer, &dense(r#""method":"note""#, 100)).await;
        write_frame(&mut peer, &dense(r#""id":8,"method":"small""#, 90)).await;
        let Some(Incoming::Request(request)) = rx.recv().await else {
            panic!("the next request was not handed on");
        };
        assert_eq!(request.method, "small");
        assert_eq!(request.params.as_array().map(Vec::len), Some(90));
        // What holding it costs is its values', parsed, not its ~230 bytes: 90 elements, the
        // params and the other three members.
        let values = crate::json_values::values_within(
            dense(r#""id":8,"method":"small""#, 90).as_bytes(),
            usize::MAX,
        )
        .expect("counted");
        assert!(values >= 90, "{values}");
        assert_eq!(
            request.frame_bytes,
            values * crate::json_values::BYTES_PER_VALUE
        );
    }

    #[tokio::test]
    async fn an_answer_holding_more_values_than_allowed_fails_its_call_and_the_connection_goes_on()
    {
        let (conn, mut peer, _rx) = pair_with(ConnectionOptions {
            max_frame_values: Some(100),
            ..ConnectionOptions::default()
        });
        let call = tokio::spawn({
            let conn = conn.clone();
            async move { conn.request("asks", json!({}), None).await }
        });
        let id = read_frame(&mut peer).await["id"].clone();
        let zeros = vec!["0"; 200].join(",");
        write_frame(
            &mut peer,
            &format!(r#"{{"jsonrpc":"2.0","id":{id},"result":[{zeros}]}}"#),
        )
        .await;
        match call.await.expect("joined") {
            Err(RpcError::Remote { error, .. }) => {
                assert_eq!(error.code, INVALID_REQUEST);
                assert!(
                    error.message.contains("more than 100 JSON values"),
                    "{error:?}"
                );
            }
            other => panic!("the call did not fail for its answer's values: {other:?}"),
        }
        let next = tokio::spawn({
            let conn = conn.clone();
            async move { conn.request("again", json!({}), None).await }
        });
        let id = read_frame(&mut peer).await["id"].clone();
        write_frame(
            &mut peer,
            &format!(r#"{{"jsonrpc":"2.0","id":{id},"result":[1,2]}}"#),
        )
        .await;
        assert_eq!(
            next.await.expect("joined").expect("answered"),
            json!([1, 2])
        );
    }

    async fn write_frame(peer: &mut DuplexStream, body: &str) {
        let frame = format!("Content-Length: {}\r\n\r\n{}", body.len(), body);
        peer.write_all(frame.as_bytes()).await.unwrap();
    }

    async fn read_frame(peer: &mut DuplexStream) -> Value {
        let mut header = Vec::new();
        while !header.ends_with(b"\r\n\r\n") {
            header.push(peer.read_u8().await.unwrap());
        }
        let text = String::from_utf8(header).unwrap();
        let n: usize = text
            .trim()
            .strip_prefix("Content-Length: ")
            .unwrap()
            .parse()
            .unwrap();
        let mut body = vec![0; n];
        peer.read_exact(&mut body).await.unwrap();
        serde_json::from_slice(&body).unwrap()
    }

    #[tokio::test]
    async fn what_was_read_together_goes_on_in_one_batch_and_before_a_response_wakes_its_caller() {
        let (ours, mut peer) = duplex(1 << 16);
        let (r, w) = tokio::io::split(ours);
        let (batches, mut handed_on) = mpsc::unbounded_channel::<Vec<String>>();
        let conn = Connection::start_batched(
            r,
            w,
            ConnectionOptions::default(),
            Box::new(move |batch| {
                let names = batch
                    .into_iter()
                    .map(|incoming| match incoming {
                        Incoming::Notification { method, .. } => method,
                        Incoming::SessionEvent { .. } => "session.event".to_owned(),
                        Incoming::Request(request) => request.method.clone(),
                        Incoming::Closed(_) => "closed".to_owned(),
                    })
                    .collect();
                let _ = batches.send(names);
            }),
        );
        let call = tokio::spawn({
            let conn = conn.clone();
            async move { conn.request("a", json!({}), None).await }
        });
        let request = read_frame(&mut peer).await;
        let frame = |body: String| format!("Content-Length: {}\r\n\r\n{body}", body.len());
        let note = |method: &str| frame(format!(r#"{{"jsonrpc":"2.0","method":"{method}"}}"#));
        let mut bytes = [note("n1"), note("n2"), note("n3")].concat();
        bytes += &frame(format!(
            r#"{{"jsonrpc":"2.0","id":{},"result":"A"}}"#,
            request["id"]
        ));
        bytes += &note("n4");
        peer.write_all(bytes.as_bytes()).await.expect("written");
        assert_eq!(call.await.expect("joined").expect("answered"), json!("A"));
        // When the answer woke its caller, what came before it had gone on, in one batch.
        assert_eq!(
            handed_on.try_recv().ok(),
            Some(vec!["n1".to_owned(), "n2".to_owned(), "n3".to_owned()])
        );
        drop(peer);
        let mut rest = Vec::new();
        while let Some(batch) = handed_on.recv().await {
            rest.push(batch);
        }
        assert_eq!(rest, [vec!["n4".to_owned()], vec!["closed".to_owned()]]);
    }

    /// A writer that hands on what each of its write calls was given.
    struct Writes(mpsc::UnboundedSender<Vec<u8>>);

    impl AsyncWrite for Writes {
        fn poll_write(
            self: std::pin::Pin<&mut Self>,
            _: &mut std::task::Context<'_>,
            buf: &[u8],
        ) -> std::task::Poll<std::io::Result<usize>> {
            let _ = self.0.send(buf.to_vec());
            std::task::Poll::Ready(Ok(buf.len()))
        }

        fn poll_flush(
            self: std::pin::Pin<&mut Self>,
            _: &mut std::task::Context<'_>,
        ) -> std::task::Poll<std::io::Result<()>> {
            std::task::Poll::Ready(Ok(()))
        }

        fn poll_shutdown(
            self: std::pin::Pin<&mut Self>,
            _: &mut std::task::Context<'_>,
        ) -> std::task::Poll<std::io::Result<()>> {
            std::task::Poll::Ready(Ok(()))
        }
    }

    #[tokio::test]
    async fn frames_queued_together_go_out_in_one_write() {
        let (writes, mut written) = mpsc::unbounded_channel();
        let (reader, _peer) = duplex(64);
        let conn = Connection::start(
            reader,
            Writes(writes),
            ConnectionOptions::default(),
            Box::new(|_| {}),
        );
        // Queued before the writer runs: this test's runtime has one thread, busy here.
        for method in ["a", "b", "c"] {
            conn.notify(method, json!({})).expect("queued");
        }
        let first = String::from_utf8(written.recv().await.expect("a write")).expect("text");
        let methods: Vec<&str> = ["\"a\"", "\"b\"", "\"c\""]
            .into_iter()
            .filter(|m| first.contains(m))
            .collect();
        assert_eq!(methods.len(), 3, "one write held all three frames: {first}");
        conn.notify("d", json!({})).expect("queued");
        let second = String::from_utf8(written.recv().await.expect("a write")).expect("text");
        assert!(
            second.contains("\"d\"") && !second.contains("\"c\""),
            "{second}"
        );
    }

    #[tokio::test]
    async fn a_batch_holds_at_most_max_batch_messages() {
        let (ours, mut peer) = duplex(1 << 16);
        let (r, w) = tokio::io::split(ours);
        let (batches, mut handed_on) = mpsc::unbounded_channel::<usize>();
        let _conn = Connection::start_batched(
            r,
            w,
            ConnectionOptions::default(),
            Box::new(move |batch| {
                let _ = batches.send(batch.len());
            }),
        );
        let note = r#"{"jsonrpc":"2.0","method":"n"}"#;
        let bytes = format!("Content-Length: {}\r\n\r\n{note}", note.len()).repeat(MAX_BATCH + 1);
        peer.write_all(bytes.as_bytes()).await.expect("written");
        drop(peer);
        let mut sizes = Vec::new();
        while let Some(size) = handed_on.recv().await {
            sizes.push(size);
        }
        // Everything was in the buffer at once: one full batch, the rest, and the close.
        assert_eq!(sizes, [MAX_BATCH, 1, 1]);
    }

    #[tokio::test]
    async fn correlates_responses_out_of_order() {
        let (conn, mut peer, _rx) = pair();
        let a = tokio::spawn({
            let conn = conn.clone();
            async move { conn.request("a", json!({}), None).await }
        });
        let first = read_frame(&mut peer).await;
        let b = tokio::spawn({
            let conn = conn.clone();
            async move { conn.request("b", json!({"x": 1}), None).await }
        });
        let second = read_frame(&mut peer).await;
        assert_eq!(first["method"], "a");
        assert_eq!(second["params"]["x"], 1);
        write_frame(
            &mut peer,
            &format!(r#"{{"jsonrpc":"2.0","id":{},"result":"B"}}"#, second["id"]),
        )
        .await;
        write_frame(
            &mut peer,
            &format!(r#"{{"jsonrpc":"2.0","id":{},"error":{{"code":-32603,"message":"boom","data":{{"k":1}}}}}}"#, first["id"]),
        )
        .await;
        assert_eq!(b.await.unwrap().unwrap(), json!("B"));
        let err = a.await.unwrap().unwrap_err();
        match err {
            RpcError::Remote { method, error } => {
                assert_eq!(method, "a");
                assert_eq!(error.code, -32603);
                assert_eq!(error.message, "boom");
                assert_eq!(error.data, Some(json!({"k": 1})));
            }
            other => panic!("unexpected {other:?}"),
        }
        assert_eq!(conn.pending_requests(), 0);
    }

    #[tokio::test]
    async fn every_pending_request_fails_when_the_peer_goes_away() {
        let (conn, mut peer, mut rx) = pair();
        let calls: Vec<_> = (0..5)
            .map(|i| {
                let conn = conn.clone();
                tokio::spawn(async move { conn.request(&format!("m{i}"), Value::Null, None).await })
            })
            .collect();
        for _ in 0..5 {
            read_frame(&mut peer).await;
        }
        drop(peer);
        for call in calls {
            let err = call.await.unwrap().unwrap_err();
            assert!(
                matches!(
                    err,
                    RpcError::Closed {
                        cause: CloseCause::Eof,
                        ..
                    }
                ),
                "{err:?}"
            );
        }
        assert!(matches!(
            rx.recv().await,
            Some(Incoming::Closed(CloseCause::Eof))
        ));
        // Later requests fail at once instead of waiting for their timeout.
        let err = conn.request("late", Value::Null, None).await.unwrap_err();
        assert!(matches!(err, RpcError::Closed { .. }));
    }

    #[tokio::test]
    async fn request_times_out_and_late_answer_is_ignored() {
        let (conn, mut peer, _rx) = pair();
        let err = conn
            .request("slow", Value::Null, Some(Duration::from_millis(50)))
            .await
            .unwrap_err();
        assert!(matches!(err, RpcError::Timeout { .. }), "{err:?}");
        late_answer_then_the_next_call(&conn, &mut peer).await;
    }

    /// The peer answers the call it read last, whose caller is gone; the connection ignores
    /// the answer and goes on: the next call is answered.
    async fn late_answer_then_the_next_call(conn: &Connection, peer: &mut DuplexStream) {
        let sent = read_frame(peer).await;
        write_frame(
            peer,
            &format!(r#"{{"jsonrpc":"2.0","id":{},"result":1}}"#, sent["id"]),
        )
        .await;
        let next = tokio::spawn({
            let conn = conn.clone();
            async move { conn.request("next", Value::Null, None).await }
        });
        let sent = read_frame(peer).await;
        write_frame(
            peer,
            &format!(r#"{{"jsonrpc":"2.0","id":{},"result":2}}"#, sent["id"]),
        )
        .await;
        assert_eq!(next.await.unwrap().unwrap(), json!(2));
    }

    #[tokio::test]
    async fn a_call_dropped_before_its_answer_leaves_no_pending_entry() {
        let (conn, mut peer, _rx) = pair();
        {
            let call = conn.request("never-answered", Value::Null, None);
            let mut call = std::pin::pin!(call);
            let mut once = std::task::Context::from_waker(std::task::Waker::noop());
            assert!(call.as_mut().poll(&mut once).is_pending());
            assert_eq!(conn.pending_requests(), 1);
        }
        assert_eq!(conn.pending_requests(), 0);
        late_answer_then_the_next_call(&conn, &mut peer).await;
    }

    #[tokio::test]
    async fn incoming_requests_are_answered_even_when_dropped() {
        let (_conn, mut peer, mut rx) = pair();
        write_frame(
            &mut peer,
            r#"{"jsonrpc":"2.0","id":7,"method":"x.y","params":{"a":1}}"#,
        )
        .await;
        write_frame(
            &mut peer,
            r#"{"jsonrpc":"2.0","id":"s8","method":"unknown.thing"}"#,
        )
        .await;
        write_frame(
            &mut peer,
            r#"{"jsonrpc":"2.0","method":"note","params":[1]}"#,
        )
        .await;
        let Some(Incoming::Request(first)) = rx.recv().await else {
            panic!()
        };
        assert_eq!(first.method, "x.y");
        assert_eq!(first.params["a"], 1);
        first.responder.ok(json!({"fine": true}));
        let Some(Incoming::Request(second)) = rx.recv().await else {
            panic!()
        };
        drop(second);
        let Some(Incoming::Notification { method, params }) = rx.recv().await else {
            panic!()
        };
        assert_eq!((method.as_str(), params.get()), ("note", "[1]"));
        let answer = read_frame(&mut peer).await;
        assert_eq!(
            answer,
            json!({"jsonrpc":"2.0","id":7,"result":{"fine":true}})
        );
        let answer = read_frame(&mut peer).await;
        assert_eq!(answer["id"], "s8");
        assert_eq!(answer["error"]["code"], INTERNAL_ERROR);
    }

    #[test]
    fn a_requests_params_are_read_as_a_value_in_the_frames_pass_when_its_id_and_method_come_first()
    {
        let read = |frame: &str| match read_members(frame.as_bytes(), MembersSeed::one_pass(true))
            .expect("a message")
            .params
        {
            Some(Params::Value(_)) => "value",
            Some(Params::Text(_)) => "text",
            Some(Params::Event(_)) => "event",
            None => "none",
        };
        assert_eq!(read(r#"{"id":1,"method":"m","params":{"a":1}}"#), "value");
        assert_eq!(
            read(r#"{"method":"m","params":{"a":1},"id":1}"#),
            "text",
            "id after"
        );
        assert_eq!(
            read(r#"{"id":null,"method":"m","params":{"a":1}}"#),
            "text",
            "null id"
        );
        assert_eq!(
            read(r#"{"method":"session.event","params":{"event":{}}}"#),
            "event"
        );
        let text = read_members(
            br#"{"id":1,"method":"m","params":{"a":1}}"#,
            MembersSeed::TEXT,
        );
        assert!(matches!(
            text.expect("a message").params,
            Some(Params::Text(_))
        ));
    }

    #[tokio::test]
    async fn a_requests_params_are_the_same_value_whatever_the_order_of_its_members() {
        // The runtime writes id and method first (the params are then read in the frame's
        // pass); any other order, a key twice, and a session.event request read the same.
        let (_conn, mut peer, mut rx) = pair_with(ConnectionOptions {
            split_session_events: true,
            ..ConnectionOptions::default()
        });
        let params = r#"{"data":"{\"a\":\"\\u00e9\\n\"}","n":[1,2.5,null],"k":1,"k":2}"#;
        let expected = json!({"data": "{\"a\":\"\\u00e9\\n\"}", "n": [1, 2.5, null], "k": 2});
        for (frame, method) in [
            (
                format!(r#"{{"jsonrpc":"2.0","id":1,"method":"m","params":{params}}}"#),
                "m",
            ),
            (
                format!(r#"{{"params":{params},"method":"m","id":2,"jsonrpc":"2.0"}}"#),
                "m",
            ),
            (format!(r#"{{"method":"m","params":{params},"id":3}}"#), "m"),
            (
                format!(r#"{{"id":4,"method":"m","params":{params},"method":"last"}}"#),
                "last",
            ),
            (
                format!(r#"{{"id":5,"method":"session.event","params":{params}}}"#),
                "session.event",
            ),
        ] {
            write_frame(&mut peer, &frame).await;
            let Some(Incoming::Request(request)) = rx.recv().await else {
                panic!("{frame}")
            };
            assert_eq!(
                (request.method.as_str(), &request.params),
                (method, &expected),
                "{frame}"
            );
        }
        // Params as deep as a value may be read on its own (127 levels, under serde_json's
        // limit) are one level too deep to read inside the frame: they are read apart, as
        // before the one pass.
        let deep = format!("{}{}", "[".repeat(127), "]".repeat(127));
        write_frame(
            &mut peer,
            &format!(r#"{{"id":6,"method":"deep","params":{deep}}}"#),
        )
        .await;
        let Some(Incoming::Request(request)) = rx.recv().await else {
            panic!("the connection broke on params 127 levels deep")
        };
        assert_eq!(
            request.params,
            serde_json::from_str::<Value>(&deep).expect("JSON")
        );
        // A null id is no request: its params stay text.
        write_frame(
            &mut peer,
            &format!(r#"{{"id":null,"method":"m","params":{params}}}"#),
        )
        .await;
        let Some(Incoming::Notification { params: text, .. }) = rx.recv().await else {
            panic!()
        };
        assert_eq!(text.get(), params);
    }

    #[tokio::test]
    async fn frames_above_the_first_limit_close_the_connection_until_it_is_lifted() {
        let small = || ConnectionOptions {
            read_limit_until_lifted: Some(64),
            ..ConnectionOptions::default()
        };
        let big = format!(
            r#"{{"jsonrpc":"2.0","method":"n","params":"{}"}}"#,
            "x".repeat(100)
        );
        // Not lifted: the large frame closes the connection unread.
        let (_conn, mut peer, mut rx) = pair_with(small());
        write_frame(&mut peer, &big).await;
        let Some(Incoming::Closed(CloseCause::ProtocolViolation(detail))) = rx.recv().await else {
            panic!("the connection stays open")
        };
        assert!(detail.contains("exceeds"), "{detail}");
        // Lifted after a small first call: the same frame is read.
        let (conn, mut peer, mut rx) = pair_with(small());
        write_frame(&mut peer, r#"{"jsonrpc":"2.0","method":"hello"}"#).await;
        assert!(matches!(
            rx.recv().await,
            Some(Incoming::Notification { .. })
        ));
        conn.lift_read_limit();
        write_frame(&mut peer, &big).await;
        let Some(Incoming::Notification { method, .. }) = rx.recv().await else {
            panic!("the frame was not read")
        };
        assert_eq!(method, "n");
    }

    #[tokio::test]
    async fn malformed_json_breaks_the_connection() {
        let (conn, mut peer, mut rx) = pair();
        let call = tokio::spawn({
            let conn = conn.clone();
            async move { conn.request("m", Value::Null, None).await }
        });
        read_frame(&mut peer).await;
        // A broken `connect` frame: its token never reaches the close reason (it is logged).
        write_frame(
            &mut peer,
            r#"{"jsonrpc":"2.0","id":1,"method":"connect","params":{"token":"tok-SECRET"#,
        )
        .await;
        let Some(Incoming::Closed(CloseCause::ProtocolViolation(detail))) = rx.recv().await else {
            panic!()
        };
        assert!(detail.contains("not JSON"), "{detail}");
        assert!(!detail.contains("tok-"), "{detail}");
        let err = call.await.unwrap().unwrap_err();
        assert!(matches!(
            err,
            RpcError::Closed {
                cause: CloseCause::ProtocolViolation(_),
                ..
            }
        ));
    }

    #[tokio::test]
    async fn null_results_and_ids_are_answers_params_keep_their_text_and_an_array_breaks_the_connection()
     {
        let (conn, mut peer, mut rx) = pair();
        let call = tokio::spawn({
            let conn = conn.clone();
            async move { conn.request("m", Value::Null, None).await }
        });
        let sent = read_frame(&mut peer).await;
        write_frame(
            &mut peer,
            &format!(r#"{{"jsonrpc":"2.0","id":{},"result":null}}"#, sent["id"]),
        )
        .await;
        assert_eq!(call.await.unwrap().unwrap(), Value::Null);
        write_frame(
            &mut peer,
            r#"{"jsonrpc":"2.0","method":"n","params":{"b": [1, "\u00e9"]}}"#,
        )
        .await;
        let Some(Incoming::Notification { method, params }) = rx.recv().await else {
            panic!()
        };
        assert_eq!(
            (method.as_str(), params.get()),
            ("n", r#"{"b": [1, "\u00e9"]}"#)
        );
        write_frame(&mut peer, r#"{"jsonrpc":"2.0","method":"n"}"#).await;
        let Some(Incoming::Notification { params, .. }) = rx.recv().await else {
            panic!()
        };
        assert_eq!(params.get(), "null", "no params");
        // An error the peer could not tie to a request: dropped, the stream goes on.
        write_frame(
            &mut peer,
            r#"{"jsonrpc":"2.0","id":null,"error":{"code":-32700,"message":"parse error"}}"#,
        )
        .await;
        write_frame(&mut peer, r#"{"jsonrpc":"2.0","method":"after"}"#).await;
        let Some(Incoming::Notification { method, .. }) = rx.recv().await else {
            panic!("the connection broke on an error with a null id")
        };
        assert_eq!(method, "after");
        // A key twice: the last one counts, as a `Value` reads it.
        write_frame(
            &mut peer,
            r#"{"jsonrpc":"2.0","method":"a","params":1,"method":"b"}"#,
        )
        .await;
        let Some(Incoming::Notification { method, params }) = rx.recv().await else {
            panic!("the connection broke on a key given twice")
        };
        assert_eq!((method.as_str(), params.get()), ("b", "1"));
        write_frame(&mut peer, r#"["n", 1]"#).await;
        let Some(Incoming::Closed(CloseCause::ProtocolViolation(detail))) = rx.recv().await else {
            panic!()
        };
        assert!(detail.contains("not a JSON-RPC object"), "{detail}");
    }

    #[tokio::test]
    async fn session_events_split_off_in_the_pass_over_the_frame_come_with_their_session_and_text()
    {
        let (_conn, mut peer, mut rx) = pair_with(ConnectionOptions {
            split_session_events: true,
            ..ConnectionOptions::default()
        });
        let event = r#"{"type":"user.message","data":{"content":"a \"quoted\" \u00e9"},"id":"e1"}"#;
        write_frame(
            &mut peer,
            &format!(
                r#"{{"jsonrpc":"2.0","method":"session.event","params":{{"sessionId":"s1","event":{event}}}}}"#
            ),
        )
        .await;
        let Some(Incoming::SessionEvent {
            session_id,
            event: text,
        }) = rx.recv().await
        else {
            panic!("a session.event did not come split")
        };
        assert_eq!((session_id.as_str(), text.get()), ("s1", event));
        // Params before the method: read as text, then as an event's all the same.
        write_frame(
            &mut peer,
            r#"{"params":{"event":{"type":"x"},"sessionId":"s2"},"method":"session.event"}"#,
        )
        .await;
        let Some(Incoming::SessionEvent { session_id, event }) = rx.recv().await else {
            panic!("params before the method did not come split")
        };
        assert_eq!(
            (session_id.as_str(), event.get()),
            ("s2", r#"{"type":"x"}"#)
        );
        // No event in them: `null`, as a notification's missing params are.
        write_frame(
            &mut peer,
            r#"{"method":"session.event","params":{"sessionId":"s3"}}"#,
        )
        .await;
        let Some(Incoming::SessionEvent { event, .. }) = rx.recv().await else {
            panic!()
        };
        assert_eq!(event.get(), "null");
        // Params that are not an event's go on as a notification, the stream unbroken.
        for params in [r#"[1,2]"#, r#"{"sessionId":7,"event":{}}"#, "null"] {
            comes_as_a_notification(&mut peer, &mut rx, params).await;
        }
        // A null id is a notification's; a member twice (the last counts) and an escaped
        // member name are read as before, and the event still comes split.
        for frame in [
            r#"{"id":null,"method":"session.event","params":{"sessionId":"s4","event":{}}}"#,
            r#"{"method":"x","params":{"sessionId":"s4","event":{}},"method":"session.event"}"#,
            r#"{"\u006dethod":"session.event","params":{"sessionId":"s4","event":{}}}"#,
        ] {
            write_frame(&mut peer, frame).await;
            let Some(Incoming::SessionEvent { session_id, event }) = rx.recv().await else {
                panic!("{frame} did not come split")
            };
            assert_eq!((session_id.as_str(), event.get()), ("s4", "{}"), "{frame}");
        }
        // What is wrong with a broken frame is said as without the option.
        write_frame(
            &mut peer,
            r#"{"method":"session.event","params":{"sessionId":7},"x":}"#,
        )
        .await;
        let Some(Incoming::Closed(CloseCause::ProtocolViolation(detail))) = rx.recv().await else {
            panic!("a broken frame did not break the connection")
        };
        assert!(detail.contains("expected value"), "{detail}");
        let (_conn, mut peer, mut rx) = pair_with(ConnectionOptions {
            split_session_events: true,
            ..ConnectionOptions::default()
        });
        // Other notifications, and a request named session.event, are as they always were.
        write_frame(&mut peer, r#"{"method":"n","params":{"sessionId":"s1"}}"#).await;
        assert!(
            matches!(rx.recv().await, Some(Incoming::Notification { method, .. }) if method == "n")
        );
        write_frame(
            &mut peer,
            r#"{"id":9,"method":"session.event","params":{"sessionId":"s1","event":{}}}"#,
        )
        .await;
        let Some(Incoming::Request(request)) = rx.recv().await else {
            panic!("a request came split")
        };
        assert_eq!(request.params, json!({"sessionId": "s1", "event": {}}));
        write_frame(
            &mut peer,
            r#"{"id":10,"method":"session.event","params":[1]}"#,
        )
        .await;
        let Some(Incoming::Request(request)) = rx.recv().await else {
            panic!("a request with params not an event's did not come")
        };
        assert_eq!(request.params, json!([1]));
        // Without the option, an event is a notification, its params as they came.
        let (_conn, mut peer, mut rx) = pair();
        comes_as_a_notification(&mut peer, &mut rx, r#"{"sessionId":"s1","event":{}}"#).await;
    }

    /// Sends a `session.event` with `params` and expects it as a notification with them.
    async fn comes_as_a_notification(
        peer: &mut DuplexStream,
        rx: &mut mpsc::UnboundedReceiver<Incoming>,
        params: &str,
    ) {
        write_frame(
            peer,
            &format!(r#"{{"method":"session.event","params":{params}}}"#),
        )
        .await;
        let Some(Incoming::Notification {
            method,
            params: text,
        }) = rx.recv().await
        else {
            panic!("a session.event with params {params} did not come as a notification")
        };
        assert_eq!((method.as_str(), text.get()), ("session.event", params));
    }

    #[tokio::test]
    async fn oversized_frame_breaks_the_connection() {
        let (_conn, mut peer, mut rx) = pair();
        peer.write_all(b"Content-Length: 4096\r\n\r\n")
            .await
            .unwrap();
        let Some(Incoming::Closed(CloseCause::ProtocolViolation(detail))) = rx.recv().await else {
            panic!()
        };
        assert!(detail.contains("exceeds the maximum"), "{detail}");
    }

    #[tokio::test]
    async fn oversized_outgoing_messages_fail_at_once_and_answers_still_go_out() {
        let (conn, mut peer, mut rx) = pair();
        let big = "x".repeat(2048);
        let err = conn
            .request("big", json!({"blob": big}), None)
            .await
            .unwrap_err();
        assert!(matches!(err, RpcError::Encode { .. }), "{err:?}");
        assert_eq!(conn.pending_requests(), 0);
        assert!(
            conn.notify("big", json!({"blob": "x".repeat(2048)}))
                .is_err()
        );
        // An oversized answer becomes an error answer: the peer is never left waiting.
        write_frame(&mut peer, r#"{"jsonrpc":"2.0","id":3,"method":"q"}"#).await;
        let Some(Incoming::Request(req)) = rx.recv().await else {
            panic!()
        };
        req.responder.ok(json!({"blob": "y".repeat(2048)}));
        let answer = read_frame(&mut peer).await;
        assert_eq!(answer["id"], 3);
        assert_eq!(answer["error"]["code"], INTERNAL_ERROR);
        assert!(
            answer["error"]["message"]
                .as_str()
                .unwrap()
                .contains("frame limit")
        );
    }

    #[tokio::test]
    async fn dropping_the_last_handle_closes_our_output() {
        let (conn, mut peer, _rx) = pair();
        let clone = conn.clone();
        drop(conn);
        clone.notify("still-open", Value::Null).unwrap();
        drop(clone);
        assert_eq!(read_frame(&mut peer).await["method"], "still-open");
        let mut rest = Vec::new();
        peer.read_to_end(&mut rest).await.unwrap();
        assert!(rest.is_empty());
    }

    #[tokio::test]
    async fn local_close_ends_our_output() {
        let (conn, mut peer, _rx) = pair();
        conn.notify("bye", Value::Null).unwrap();
        conn.close(CloseCause::Local);
        assert_eq!(read_frame(&mut peer).await["method"], "bye");
        let mut rest = Vec::new();
        peer.read_to_end(&mut rest).await.unwrap();
        assert!(rest.is_empty());
    }
}
