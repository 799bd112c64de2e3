//! A conversation attached to a worker: its update stream and the calls that act on it.
//!
//! A [`Session`] is the caller's side of one CLI session on one worker. It receives every
//! event and server request of that session, in order, and ends with
//! [`SessionUpdate::Ended`] if the worker dies or stops. Answers to tool calls and
//! permission prompts go through the worker's ledger of pending requests, so a session can
//! only answer its own requests.

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use serde::Serialize;
use serde_json::Value;
use tokio::sync::mpsc;

use crate::ids::CliSessionId;
use crate::permission::PermissionDecision;

use crate::rpc::connection::{ErrorObject, INTERNAL_ERROR};
use crate::rpc::events::CompactionStartData;
use crate::rpc::messages::{
    AbortParams, CompactParams, CompactResult, HandlePendingPermission, HandlePendingToolCall,
    HookInvocation, PermissionAnswer, SendParams, SessionAbort, SessionCompact, SessionDetach,
    SessionGetMessages, SessionIdParams, SessionOpened, SessionSend, ToolCallAnswer,
    UserInputRequest, UserInputResponse,
};
use crate::rpc::{EventKind, Responder, SessionEvent};

use super::error::WorkerError;
use super::handle::{PendingKind, WorkerHandle};

/// Something that happened in a session.
#[derive(Debug)]
pub enum SessionUpdate {
    /// A session event (`session.event` notification).
    Event(SessionEvent),
    /// The model asked the user (`userInput.request`); answer it or drop it (drop = error).
    UserInput(ServerRequest<UserInputRequest>),
    /// A hook fired (`hooks.invoke`); answer it or drop it (drop = `{}`, the SDK default).
    Hook(ServerRequest<HookInvocation>),
    /// Another request the runtime makes of the session's client, which this crate has no
    /// type for (`exitPlanMode.request`, `autoModeSwitch.request`, `systemMessage.transform`,
    /// `providerToken.getToken`, `gitHubToken.getToken`, and newer ones): any request whose
    /// params name the session. Answer it or drop it (drop = "method not found", what the
    /// runtime gets from a client without a handler for it).
    Request(ServerRequest<ClientCall>),
    /// A notification about the session other than its events (`session.lifecycle`, and
    /// newer ones), as the runtime sent it; nothing to answer.
    Notification(ClientCall),
    /// The worker ended; nothing more will arrive. Carries why.
    Ended(WorkerError),
}

/// What an update counts for in its route's [`Unread`] bytes, at the least: the size of what
/// the runtime sent (an event's JSON text, a request's frame, a notification's params) is
/// what the worker weighs it at when it routes it; an update that holds nothing the runtime
/// sent (the end) counts for nothing.
pub(crate) const LEAST_UNREAD_WEIGHT: usize = 64;

/// The bytes a session's route holds that its reader has not taken yet
/// (each update weighed as it is routed): added as the worker routes an update, taken off as the
/// session's reader takes it. A reader that falls behind (a gateway reading its events slower
/// than the runtime writes them) shows here; the turn driver aborts a turn past its limit.
#[derive(Debug, Clone, Default)]
pub(crate) struct Unread(Arc<AtomicUsize>);

impl Unread {
    pub(crate) fn add(&self, bytes: usize) {
        self.0.fetch_add(bytes, Ordering::Relaxed);
    }

    pub(crate) fn take(&self, bytes: usize) {
        self.0.fetch_sub(bytes, Ordering::Relaxed);
    }

    pub(crate) fn bytes(&self) -> usize {
        self.0.load(Ordering::Relaxed)
    }
}

/// What a session's route carries: one update, boxed. A tokio channel allocates its slots 32
/// at a time (the first block when it is made, a second once 32 updates have passed, and
/// keeps both for reuse), so with whole updates (hundreds of bytes each) every attached
/// session held ~20 KiB of slots while idle; with boxes it holds ~0.5 KiB.
/// The update and what it counts for in the route's [`Unread`] bytes (taken off as it is read).
pub(crate) type Routed = Box<(SessionUpdate, usize)>;

/// A request or notification of the runtime for a session's client, by method name.
#[derive(Debug, Clone, Serialize)]
pub struct ClientCall {
    /// The JSON-RPC method (`exitPlanMode.request`, `session.lifecycle`, …).
    pub method: String,
    /// Its params as the runtime sent them (they name the session).
    pub params: Value,
}

/// What a [`ServerRequest`] dropped unanswered answers.
#[derive(Debug)]
enum OnDrop {
    /// An internal error (the responder's own drop).
    Error,
    /// This result.
    Result(Value),
    /// "Method not found".
    MethodNotFound,
}

/// A request from the runtime that this session must answer exactly once.
pub struct ServerRequest<P> {
    /// The request's params.
    pub params: P,
    responder: Option<Responder>,
    on_drop: OnDrop,
}

impl<P: fmt::Debug> fmt::Debug for ServerRequest<P> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ServerRequest")
            .field("params", &self.params)
            .finish_non_exhaustive()
    }
}

impl<P> ServerRequest<P> {
    pub(crate) fn new(params: P, responder: Responder, default_on_drop: Option<Value>) -> Self {
        Self {
            params,
            responder: Some(responder),
            on_drop: match default_on_drop {
                Some(default) => OnDrop::Result(default),
                None => OnDrop::Error,
            },
        }
    }

    /// A request that, dropped unanswered, is answered "method not found".
    pub(crate) fn unhandled_on_drop(params: P, responder: Responder) -> Self {
        Self {
            params,
            responder: Some(responder),
            on_drop: OnDrop::MethodNotFound,
        }
    }

    /// Answers with a JSON-RPC error as it is (a client's own error passed on).
    pub fn fail_with(mut self, error: ErrorObject) {
        if let Some(r) = self.responder.take() {
            r.err(error);
        }
    }

    /// Answers with a result.
    pub fn respond(mut self, result: impl Serialize) {
        if let Some(r) = self.responder.take() {
            r.ok(result);
        }
    }

    /// Answers with an error message.
    pub fn fail(mut self, message: impl Into<String>) {
        if let Some(r) = self.responder.take() {
            r.err(ErrorObject::new(INTERNAL_ERROR, message));
        }
    }
}

impl ServerRequest<UserInputRequest> {
    /// Answers the question.
    pub fn answer(self, answer: impl Into<String>, was_freeform: bool) {
        self.respond(UserInputResponse {
            answer: answer.into(),
            was_freeform,
        });
    }
}

impl<P> Drop for ServerRequest<P> {
    fn drop(&mut self) {
        if let Some(r) = self.responder.take() {
            match std::mem::replace(&mut self.on_drop, OnDrop::Error) {
                OnDrop::Result(default) => r.ok(default),
                OnDrop::MethodNotFound => r.method_not_found(),
                // The responder's own drop answers with an internal error.
                OnDrop::Error => drop(r),
            }
        }
    }
}

/// The result of a client tool, as the model will see it.
#[derive(Debug, Clone)]
pub enum ToolResult {
    /// Success with text for the model.
    Text(String),
    /// A full result object (`{textResultForLlm, resultType, …}`).
    Object(Value),
    /// The tool failed with this message.
    Error(String),
}

/// How [`Session::abort_and_settle`] ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Settled {
    /// The aborted turn reached `session.idle`: the session is free for the next turn.
    Idle,
    /// The worker ended (or the update stream closed) before `session.idle`.
    WorkerEnded,
    /// The abort was refused, or `session.idle` did not come within the limit: the
    /// session's state in the runtime is unknown (it may still run the turn).
    Unsettled,
}

/// One conversation on one worker.
pub struct Session {
    id: CliSessionId,
    /// Which open of this id on its worker this is (its route's generation).
    generation: u64,
    worker: WorkerHandle,
    updates: mpsc::UnboundedReceiver<Routed>,
    /// What the route holds unread (the updates in `opening` too).
    unread: Unread,
    /// Updates that arrived while the session was being opened, read back first.
    opening: std::collections::VecDeque<Routed>,
    /// The runtime reported the session attached to another process when it was opened.
    already_in_use: bool,
    /// The runtime's answer to the open (`session.create` / `session.resume`) as JSON
    /// text: parsed (nested maps) it takes several KiB, every parked session keeps it, and
    /// only the SDK endpoint reads it, through [`Session::opened`], which parses it once.
    opened_json: Option<Box<str>>,
    opened: std::sync::OnceLock<Option<SessionOpened>>,
    detached: bool,
    /// The `session.compaction_start` of a compaction the runtime has not finished: kept
    /// with the session, which outlives a lease (a compaction started in one lease's turn
    /// may end after it, read by the next lease).
    compaction_start: Option<CompactionStartData>,
}

impl fmt::Debug for Session {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Session")
            .field("id", &self.id)
            .field("worker_pid", &self.worker.pid())
            .finish()
    }
}

impl Session {
    pub(crate) fn new(
        id: CliSessionId,
        generation: u64,
        worker: WorkerHandle,
        mut updates: mpsc::UnboundedReceiver<Routed>,
        unread: Unread,
    ) -> Self {
        // What the runtime said while opening (`session.start` / `session.resume`) is
        // already routed (the caller flushed the worker's mailbox): look at it, keep it.
        let mut opening = std::collections::VecDeque::new();
        let mut already_in_use = false;
        while let Ok(update) = updates.try_recv() {
            if let SessionUpdate::Event(event) = &update.0 {
                let in_use = match &event.kind {
                    EventKind::SessionStart(d) => d.already_in_use,
                    EventKind::SessionResume(d) => d.already_in_use,
                    _ => None,
                };
                already_in_use |= in_use == Some(true);
            }
            opening.push_back(update);
        }
        Self {
            id,
            generation,
            worker,
            updates,
            unread,
            opening,
            already_in_use,
            opened_json: None,
            opened: std::sync::OnceLock::new(),
            detached: false,
            compaction_start: None,
        }
    }

    pub(crate) fn set_opened(&mut self, opened: &SessionOpened) {
        self.opened_json = serde_json::to_string(opened)
            .ok()
            .map(String::into_boxed_str);
        self.opened = std::sync::OnceLock::new();
    }

    /// The runtime's answer when this session was opened (`session.create` or
    /// `session.resume`: workspace path, capabilities, …).
    pub fn opened(&self) -> Option<&SessionOpened> {
        self.opened
            .get_or_init(|| {
                let json = self.opened_json.as_deref()?;
                serde_json::from_str(json).ok()
            })
            .as_ref()
    }

    /// Whether the runtime reported, when this session was opened, that another process
    /// still had it attached (`alreadyInUse`): two owners append to one history. The pool
    /// never lets that happen; a caller of the worker API must detach elsewhere first.
    pub fn already_in_use(&self) -> bool {
        self.already_in_use
    }

    /// The CLI session id.
    pub fn id(&self) -> &CliSessionId {
        &self.id
    }

    /// The worker this session is attached to.
    pub fn worker(&self) -> &WorkerHandle {
        &self.worker
    }

    /// The next update; `None` after [`SessionUpdate::Ended`] has been delivered.
    pub async fn next(&mut self) -> Option<SessionUpdate> {
        let routed = match self.take_opening() {
            Some(routed) => routed,
            None => self.updates.recv().await?,
        };
        let (update, weight) = *routed;
        self.unread.take(weight);
        Some(update)
    }

    /// The bytes of updates waiting in the session's route, not read yet.
    pub fn unread_bytes(&self) -> usize {
        self.unread.bytes()
    }

    /// The next update that arrived while the session was being opened; the queue's memory
    /// is freed once it is empty (a parked session holds none).
    fn take_opening(&mut self) -> Option<Routed> {
        let update = self.opening.pop_front();
        if self.opening.is_empty() && self.opening.capacity() > 0 {
            self.opening = std::collections::VecDeque::new();
        }
        update
    }

    /// The next update if one is already waiting, without waiting.
    pub fn try_next(&mut self) -> Option<SessionUpdate> {
        let routed = self
            .take_opening()
            .or_else(|| self.updates.try_recv().ok())?;
        let (update, weight) = *routed;
        self.unread.take(weight);
        Some(update)
    }

    /// Whether the session's worker is still serving (false once it ended or stopped).
    pub fn is_alive(&self) -> bool {
        self.worker.exit().is_none()
    }

    /// Starts a turn with `prompt`; returns the user message id at once. The turn's events
    /// follow through [`Session::next`] and end with `session.idle`.
    pub async fn send(&self, prompt: impl Into<String>) -> Result<String, WorkerError> {
        self.send_message(SendParams {
            prompt: prompt.into(),
            ..Default::default()
        })
        .await
    }

    /// Sends a user message with its attachments, delivery mode and agent mode (`params`'
    /// session id is this session's); returns the message id like [`Session::send`].
    pub async fn send_message(&self, mut params: SendParams) -> Result<String, WorkerError> {
        params.session_id = self.id.to_string();
        Ok(self.worker.call::<SessionSend>(&params).await?.message_id)
    }

    /// Aborts the running turn (also releases unanswered tool calls and permission prompts).
    pub async fn abort(&self) -> Result<(), WorkerError> {
        let params = AbortParams {
            session_id: self.id.to_string(),
            reason: None,
        };
        self.worker.call::<SessionAbort>(&params).await.map(|_| ())
    }

    /// Aborts the running turn and reads its updates until its `session.idle`, all within
    /// `limit`. Tool calls and permission prompts that arrive meanwhile are refused (nobody
    /// will run them), other server requests are answered by their drop; the updates read
    /// are not kept.
    pub async fn abort_and_settle(&mut self, limit: Duration) -> Settled {
        self.abort_and_settle_seeing(limit, |_| {}).await
    }

    /// [`Session::abort_and_settle`], showing each event read on the way to `seen` first
    /// (the turn driver mirrors the transcript's among them: the runtime produced them and
    /// keeps them in its history).
    pub(crate) async fn abort_and_settle_seeing(
        &mut self,
        limit: Duration,
        mut seen: impl FnMut(&SessionEvent),
    ) -> Settled {
        let answerer = self.answerer();
        let settled = tokio::time::timeout(limit, async {
            if self.abort().await.is_err() {
                return if self.is_alive() {
                    Settled::Unsettled
                } else {
                    Settled::WorkerEnded
                };
            }
            while let Some(update) = self.next().await {
                if let SessionUpdate::Event(e) = &update {
                    seen(e);
                }
                match update {
                    SessionUpdate::Event(e) if matches!(e.kind, EventKind::SessionIdle(_)) => {
                        return Settled::Idle;
                    }
                    SessionUpdate::Event(e) => answerer.refuse_stray(&e),
                    SessionUpdate::Ended(_) => return Settled::WorkerEnded,
                    // Server requests still arriving are answered by their drop.
                    SessionUpdate::UserInput(_)
                    | SessionUpdate::Hook(_)
                    | SessionUpdate::Request(_)
                    | SessionUpdate::Notification(_) => {}
                }
            }
            Settled::WorkerEnded
        })
        .await;
        settled.unwrap_or(Settled::Unsettled)
    }

    /// Takes the updates already waiting (late events of an earlier, aborted turn, what the
    /// runtime did between turns or for a compaction asked of it), refusing the tool calls
    /// and permission prompts among them so the runtime never waits on them, and returns
    /// their events: still the runtime's history.
    pub fn take_waiting(&mut self) -> Vec<SessionEvent> {
        let answerer = self.answerer();
        let mut events = Vec::new();
        while let Some(update) = self.try_next() {
            if let SessionUpdate::Event(event) = update {
                answerer.refuse_stray(&event);
                events.push(event);
            }
        }
        events
    }

    /// Notes the start of a compaction the runtime began (its `session.compaction_start`).
    pub(crate) fn compaction_started(&mut self, start: CompactionStartData) {
        self.compaction_start = Some(start);
    }

    /// The start of the compaction that just ended, if it was seen.
    pub(crate) fn compaction_ended(&mut self) -> Option<CompactionStartData> {
        self.compaction_start.take()
    }

    /// Answers a client tool call of this session (`external_tool.requested`).
    pub async fn answer_tool_call(
        &self,
        request_id: &str,
        result: ToolResult,
    ) -> Result<(), WorkerError> {
        self.answerer().answer_tool_call(request_id, result).await
    }

    /// Answers a permission prompt of this session (`permission.requested`), e.g. with
    /// `{"kind":"approve-once"}` or `{"kind":"reject"}`.
    pub async fn answer_permission(
        &self,
        request_id: &str,
        decision: Value,
    ) -> Result<(), WorkerError> {
        self.answerer()
            .answer_permission(request_id, decision)
            .await
    }

    /// A handle that answers this session's pending requests from any task.
    pub fn answerer(&self) -> Answerer {
        Answerer {
            id: self.id.clone(),
            worker: self.worker.clone(),
        }
    }

    /// Compacts the conversation history, optionally focused by `custom_instructions`.
    pub async fn compact(
        &self,
        custom_instructions: Option<String>,
    ) -> Result<CompactResult, WorkerError> {
        let params = CompactParams {
            session_id: self.id.to_string(),
            custom_instructions,
        };
        self.worker.call::<SessionCompact>(&params).await
    }

    /// The persisted events of this session.
    pub async fn messages(&self) -> Result<Vec<Value>, WorkerError> {
        let params = SessionIdParams {
            session_id: self.id.to_string(),
        };
        Ok(self
            .worker
            .call::<SessionGetMessages>(&params)
            .await?
            .events)
    }

    /// Deletes the session from the runtime (and its state from disk).
    pub async fn delete(mut self) -> Result<(), WorkerError> {
        self.detached = true;
        self.worker
            .close_route(self.id.as_str(), Some(self.generation), false);
        let params = SessionIdParams {
            session_id: self.id.to_string(),
        };
        self.worker
            .call::<crate::rpc::messages::SessionDelete>(&params)
            .await
            .map(|_| ())
    }

    /// Detaches the session from its process; its state stays on disk for a later resume.
    pub async fn detach(mut self) -> Result<(), WorkerError> {
        self.detached = true;
        self.worker
            .close_route(self.id.as_str(), Some(self.generation), false);
        let params = SessionIdParams {
            session_id: self.id.to_string(),
        };
        self.worker.call::<SessionDetach>(&params).await.map(|_| ())
    }
}

/// Answers one session's pending tool calls and permission prompts, from any task. The
/// worker's ledger checks that each request belongs to this session.
#[derive(Clone, Debug)]
pub struct Answerer {
    id: CliSessionId,
    worker: WorkerHandle,
}

impl Answerer {
    /// Answers a client tool call of the session (`external_tool.requested`). The answer
    /// runs to its end even when the caller stops waiting (`to_its_end`).
    pub async fn answer_tool_call(
        &self,
        request_id: &str,
        result: ToolResult,
    ) -> Result<(), WorkerError> {
        let answerer = self.clone();
        let request_id = request_id.to_owned();
        to_its_end(async move { answerer.answer_tool_call_now(&request_id, result).await }).await
    }

    async fn answer_tool_call_now(
        &self,
        request_id: &str,
        result: ToolResult,
    ) -> Result<(), WorkerError> {
        self.worker
            .take_pending(PendingKind::ToolCall, self.id.as_str(), request_id)
            .await?;
        let (result, error) = match result {
            ToolResult::Text(text) => (Some(Value::String(text)), None),
            ToolResult::Object(value) => (Some(value), None),
            // A failure result the model can read (the bare `error` field reaches the model
            // only as a generic "Tool execution failed").
            ToolResult::Error(message) => (
                Some(serde_json::json!({
                    "textResultForLlm": message,
                    "resultType": "failure",
                    "error": message,
                })),
                None,
            ),
        };
        let params = ToolCallAnswer {
            session_id: self.id.to_string(),
            request_id: request_id.to_owned(),
            result,
            error,
        };
        let sent = self
            .worker
            .call_unchecked::<HandlePendingToolCall>(&params, self.worker.request_timeout())
            .await;
        self.restore_if_undelivered(PendingKind::ToolCall, request_id, &sent);
        sent.map(|_| ())
    }

    /// Refuses, in the background, a tool call or permission prompt that arrived outside a
    /// running turn (nobody will run it); any other event is ignored.
    pub fn refuse_stray(&self, event: &SessionEvent) {
        let answerer = self.clone();
        match &event.kind {
            EventKind::ExternalToolRequested(req) => {
                let id = req.request_id.clone();
                tokio::spawn(async move {
                    let result = ToolResult::Error(
                        "the tool call arrived outside a running turn".to_owned(),
                    );
                    let _ = answerer.answer_tool_call(&id, result).await;
                });
            }
            EventKind::PermissionRequested(req) if req.resolved_by_hook != Some(true) => {
                let id = req.request_id.clone();
                tokio::spawn(async move {
                    let decision = PermissionDecision::Reject {
                        feedback: "the permission prompt arrived outside a running turn".to_owned(),
                    };
                    let _ = answerer.answer_permission(&id, decision.to_wire()).await;
                });
            }
            _ => {}
        }
    }

    /// After a failed answer the runtime is still waiting: keep the request answerable.
    fn restore_if_undelivered<T>(
        &self,
        kind: PendingKind,
        request_id: &str,
        sent: &Result<T, WorkerError>,
    ) {
        if let Err(WorkerError::Rpc(_)) = sent {
            self.worker
                .restore_pending(kind, self.id.as_str(), request_id);
        }
    }

    /// Answers a permission prompt of this session (`permission.requested`), e.g. with
    /// `{"kind":"approve-once"}` or `{"kind":"reject"}`. The answer runs to its end even when
    /// the caller stops waiting (`to_its_end`).
    pub async fn answer_permission(
        &self,
        request_id: &str,
        decision: Value,
    ) -> Result<(), WorkerError> {
        let answerer = self.clone();
        let request_id = request_id.to_owned();
        to_its_end(async move { answerer.answer_permission_now(&request_id, decision).await }).await
    }

    async fn answer_permission_now(
        &self,
        request_id: &str,
        decision: Value,
    ) -> Result<(), WorkerError> {
        self.worker
            .take_pending(PendingKind::Permission, self.id.as_str(), request_id)
            .await?;
        let params = PermissionAnswer {
            session_id: self.id.to_string(),
            request_id: request_id.to_owned(),
            result: decision,
        };
        let sent = self
            .worker
            .call_unchecked::<HandlePendingPermission>(&params, self.worker.request_timeout())
            .await;
        self.restore_if_undelivered(PendingKind::Permission, request_id, &sent);
        let answer = sent?;
        if !answer.success {
            return Err(WorkerError::NoSuchPendingRequest {
                kind: PendingKind::Permission.as_str(),
                session_id: self.id.to_string(),
                request_id: request_id.to_owned(),
            });
        }
        Ok(())
    }
}

/// Runs an answer in a task of its own and waits for it. Its request is taken from the
/// worker's ledger before the answer is sent: cut off between the two (a turn's tool task
/// aborted as the turn ends, an SDK client that left), the request would be neither
/// answered nor answerable, and the runtime would wait on it until the session is aborted.
/// A runtime shutting down meanwhile answers [`WorkerError::Stopped`]; a panic goes on.
async fn to_its_end(
    answer: impl Future<Output = Result<(), WorkerError>> + Send + 'static,
) -> Result<(), WorkerError> {
    match tokio::spawn(answer).await {
        Ok(answered) => answered,
        Err(join) if join.is_panic() => std::panic::resume_unwind(join.into_panic()),
        Err(_) => Err(WorkerError::Stopped),
    }
}

impl Drop for Session {
    fn drop(&mut self) {
        if !self.detached {
            // Frees the route and detaches in the background, so the session id does not
            // stay attached to this process.
            self.worker
                .close_route(self.id.as_str(), Some(self.generation), true);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_route_carries_updates_as_pointers_so_an_idle_session_holds_little() {
        // A tokio channel keeps up to two blocks of 32 slots per attached session (the one
        // in use and one kept for reuse): with boxed updates that is half a KiB; with whole
        // updates (hundreds of bytes each) it was ~20 KiB, the most of a session's cost.
        let slots = 2 * 32 * std::mem::size_of::<Routed>();
        assert!(
            slots <= 1024,
            "an idle route would hold {slots} bytes of slots; keep the routed type a pointer"
        );
    }
}
