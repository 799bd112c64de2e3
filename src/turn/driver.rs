//! Runs one turn over a session: yields its events, and on the way answers everything the
//! runtime asks (gateway tools, permission prompts, ask_user, hooks), mirrors the transcript,
//! tallies the outcome, and enforces the timeouts. Every request is answered exactly once,
//! and no turn outlives its limits.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use serde_json::{Value, json};
use tokio::sync::{RwLock, mpsc};
use tokio::task::AbortHandle;
use tokio::time::Instant;

use crate::deadline;
use crate::kinds::TurnEnd;
use crate::metrics::{self, ToolOutcome};
use crate::panic_guard::{Guarded, call_guarded};
use crate::permission::{PermissionRequest, decide_safely};
use crate::rpc::events::ExternalToolRequestedData;
use crate::rpc::gate::UnreadGuard;
use crate::rpc::messages::{HookInvocation, UserInputRequest};
use crate::rpc::{EventKind, SessionEvent};
use crate::transcript::{Entry, EventEntry, Role, Transcript};
use crate::worker::{Answerer, ServerRequest, Session, SessionUpdate, Settled, ToolResult};

use super::hooks::{HookFuture, TurnHooks, for_hook_type};
use super::tools::{GatewayTool, ToolCall, ToolConcurrency};
use super::user_input::{Question, resolve};
use super::{TimeoutKind, TurnError, TurnHandlers, TurnOutcome};

enum Done {
    Request(String),
    Question(u64),
}

struct Pending {
    kind: TimeoutKind,
    deadline: Instant,
    limit: Duration,
    label: String,
    task: AbortHandle,
    /// Answers the request if it is cancelled, so the runtime never waits on it.
    answerer: Answerer,
}

/// The pending ask_user question: cancelling it answers it with an empty free-form answer.
struct PendingQuestion {
    id: u64,
    cancel: Option<tokio::sync::oneshot::Sender<()>>,
}

/// The per-conversation turn machinery (lives in the lease).
pub(crate) struct TurnDriver {
    handlers: TurnHandlers,
    /// The conversation's working directory: the permission policy takes relative paths
    /// against it.
    working_directory: PathBuf,
    tools: HashMap<String, GatewayTool>,
    sequential: Arc<RwLock<()>>,
    done_tx: mpsc::UnboundedSender<Done>,
    done_rx: mpsc::UnboundedReceiver<Done>,
    pending: HashMap<String, Pending>,
    question: Option<PendingQuestion>,
    next_question: u64,
    /// An aborted turn did not reach `session.idle`: the session must not be reused.
    poisoned: bool,
    /// Whether the caller falls behind the runtime (`TurnError::Backlog`).
    backlog: BacklogWatch,
    abort_drain: Duration,
    started: Instant,
    last_activity: Instant,
    in_flight: bool,
    async_shell: bool,
    outcome: TurnOutcome,
    hook_failures: Arc<AtomicU32>,
    transcript: Option<Transcript>,
    /// What an abort's drain read and did not mirror yet: kept here, not in the drain's
    /// future, so a drain cut short (its caller gone) loses none of it; the lease's drop
    /// mirrors it before its own drain's ([`TurnDriver::take_drained`]).
    drained: Vec<DrainedEntry>,
    /// The session's event types left unread ([`TurnHandlers::unread_events`]), registered
    /// with its connection for the lease's life.
    unread_registration: Option<UnreadGuard>,
}

impl TurnDriver {
    /// The conversation's working directory (its tools' and attachments').
    pub(crate) fn working_directory(&self) -> &std::path::Path {
        &self.working_directory
    }

    /// A driver for one conversation's turns; an aborted turn gets `abort_drain` to reach
    /// `session.idle` (the pool's `abort_settle_timeout`).
    pub(crate) fn new(
        handlers: TurnHandlers,
        working_directory: PathBuf,
        abort_drain: Duration,
    ) -> Self {
        let (done_tx, done_rx) = mpsc::unbounded_channel();
        let tools = handlers
            .tools
            .iter()
            .map(|t| (t.name.clone(), t.clone()))
            .collect();
        Self {
            handlers,
            working_directory,
            tools,
            sequential: Arc::new(RwLock::new(())),
            done_tx,
            done_rx,
            pending: HashMap::new(),
            question: None,
            next_question: 0,
            poisoned: false,
            backlog: BacklogWatch::default(),
            abort_drain,
            started: Instant::now(),
            last_activity: Instant::now(),
            in_flight: false,
            async_shell: false,
            outcome: TurnOutcome::default(),
            hook_failures: Arc::new(AtomicU32::new(0)),
            transcript: None,
            drained: Vec::new(),
            unread_registration: None,
        }
    }

    /// Registers the event types the caller leaves unread for `session` (once: the
    /// registration lives as long as the driver, the lease's).
    pub(crate) fn leave_unread(&mut self, session: &Session) {
        if self.unread_registration.is_none()
            && let Some(unread) = &self.handlers.unread_events
        {
            self.unread_registration = Some(
                session
                    .worker()
                    .leave_unread(session.id().as_str(), unread.clone()),
            );
        }
    }

    /// Ends the registration of the unread event types (the lease goes back: whoever
    /// leases the conversation next reads what it asks for from the start).
    pub(crate) fn forget_unread(&mut self) {
        self.unread_registration = None;
    }

    /// When the inactivity limit runs out: its length after the runtime was last heard
    /// from (an event dropped unread included).
    fn inactivity_deadline(&self) -> Instant {
        deadline::from(self.last_heard(), self.handlers.timeouts.inactivity)
    }

    /// The runtime's last sign of activity: the turn's last event, answer or start, or an
    /// event dropped unread after it.
    fn last_heard(&self) -> Instant {
        let dropped = self
            .unread_registration
            .as_ref()
            .and_then(UnreadGuard::last_dropped);
        match dropped.map(Instant::from_std) {
            Some(dropped) if dropped > self.last_activity => dropped,
            _ => self.last_activity,
        }
    }

    /// How long an aborted turn may take to reach `session.idle` before the session is
    /// given up as poisoned.
    pub(crate) fn abort_drain(&self) -> Duration {
        self.abort_drain
    }

    /// Takes the transcript mirror out of the driver, as the lease goes back: dropping it
    /// closes it (its cache entry goes back for the next lease); an aborted turn's drain
    /// mirrors on the way with [`mirror_drained`] first.
    pub(crate) fn take_transcript(&mut self) -> Option<Transcript> {
        self.transcript.take()
    }

    /// Takes in what the runtime produced outside a turn (read as the next turn starts, or
    /// as a compaction the caller asked for returns): a compaction's start and end (its hooks
    /// fire once it happened) and what the events add to the history, mirrored (a strict
    /// mirror's failure is returned, as in a turn).
    pub(crate) fn take_in(
        &mut self,
        session: &mut Session,
        events: Vec<SessionEvent>,
    ) -> Result<(), TurnError> {
        for event in &events {
            self.on_compaction(event, session);
            mirror_event(&mut self.transcript, event)?;
        }
        Ok(())
    }

    /// What an abort's drain cut short read and did not mirror (see `drained`).
    pub(crate) fn take_drained(&mut self) -> Vec<DrainedEntry> {
        std::mem::take(&mut self.drained)
    }

    /// Whether the lease keeps a transcript mirror (configured, and opened).
    pub(crate) fn mirrors_transcript(&self) -> bool {
        self.transcript.is_some()
    }

    /// Opens the transcript mirror of `session_id` (if configured), on a blocking thread and
    /// through the settings' cache (reading only what the file gained since the last lease).
    pub(crate) async fn open_transcript(&mut self, session_id: &str) -> Result<(), TurnError> {
        let Some(settings) = &self.handlers.transcript else {
            return Ok(());
        };
        match settings.open(session_id).await {
            Ok(t) => {
                self.transcript = Some(t);
                Ok(())
            }
            Err(e) if settings.mode == crate::transcript::TranscriptMode::Strict => {
                Err(TurnError::TranscriptPersistence(e.to_string()))
            }
            Err(e) => {
                tracing::warn!(error = %e, "Transcript mirror unavailable; continuing (best effort).");
                Ok(())
            }
        }
    }

    pub(crate) fn in_flight(&self) -> bool {
        self.in_flight
    }

    /// Whether the session is in an unknown state (an abort that never reached idle).
    pub(crate) fn poisoned(&self) -> bool {
        self.poisoned
    }

    /// Marks a turn started (after `session.send`).
    /// Clears the last turn's tally, before a new turn takes in what came since (whose hook
    /// failures are the new turn's) and is sent.
    pub(crate) fn prepare(&mut self) {
        // Completions of an earlier turn's tasks are not this turn's.
        while self.done_rx.try_recv().is_ok() {}
        self.outcome = TurnOutcome::default();
        self.hook_failures.store(0, Ordering::SeqCst);
    }

    /// The turn was sent: its clocks start.
    pub(crate) fn begin(&mut self) {
        self.started = Instant::now();
        self.last_activity = self.started;
        self.async_shell = false;
        self.backlog = BacklogWatch::default();
        self.in_flight = true;
    }

    /// The outcome tallied so far.
    pub(crate) fn outcome(&self) -> TurnOutcome {
        let mut o = self.outcome.clone();
        o.hook_failures = self.hook_failures.load(Ordering::SeqCst);
        o
    }

    /// The next event of the running turn; `None` once it ended or when none runs.
    pub(crate) async fn next(
        &mut self,
        session: &mut Session,
    ) -> Option<Result<SessionEvent, TurnError>> {
        if !self.in_flight {
            return None;
        }
        // A caller that reads slower than the runtime writes leaves the route holding what it
        // has not read: past the limit the turn ends (the abort drains it) at the call after
        // the event that showed it, so the caller gets that event first.
        if self.backlog.fell_behind() {
            let error = TurnError::Backlog {
                unread_bytes: session.unread_bytes(),
                limit: self.handlers.max_unread_event_bytes,
            };
            return Some(Err(self.abort_with(session, error).await));
        }
        loop {
            let (deadline, kind, label) = self.next_deadline();
            tokio::select! {
                // Queued events first: a caller that polls late must not see a false
                // inactivity timeout while events are waiting.
                biased;
                update = session.next() => {
                    self.last_activity = Instant::now();
                    match update {
                        Some(SessionUpdate::Event(event)) => {
                            self.backlog.took_event(
                                session.unread_bytes(),
                                self.handlers.max_unread_event_bytes,
                            );
                            match self.on_event(&event, session) {
                                Ok(()) => {}
                                Err(e) => return Some(Err(self.abort_with(session, e).await)),
                            }
                            if matches!(event.kind, EventKind::SessionIdle(_)) {
                                self.finish(self.idle_end());
                            }
                            return Some(Ok(event));
                        }
                        Some(SessionUpdate::UserInput(request)) => self.on_question(request),
                        Some(SessionUpdate::Hook(request)) => self.on_hook(request),
                        // Requests the turn API has no handler for are answered
                        // method-not-found by their drop; other notifications are not
                        // the turn's.
                        Some(SessionUpdate::Request(request)) => drop(request),
                        Some(SessionUpdate::Notification(_)) => {}
                        Some(SessionUpdate::Ended(error)) => {
                            self.finish(TurnEnd::Crashed);
                            return Some(Err(TurnError::Worker(error)));
                        }
                        None => {
                            self.finish(TurnEnd::Crashed);
                            return Some(Err(TurnError::State(
                                "the session's update stream ended without a reason; take a new lease (the conversation resumes)",
                            )));
                        }
                    }
                }
                Some(done) = self.done_rx.recv() => {
                    self.last_activity = Instant::now();
                    match done {
                        Done::Request(id) => { self.pending.remove(&id); }
                        Done::Question(id) => {
                            if self.question.as_ref().is_some_and(|q| q.id == id) {
                                self.question = None;
                            }
                        }
                    }
                }
                _ = tokio::time::sleep_until(deadline) => {
                    if kind == TimeoutKind::Permission {
                        // A policy that does not decide in time rejects (fail closed); the
                        // turn goes on.
                        self.reject_late_permission(&label);
                        continue;
                    }
                    // An event dropped unread since is the runtime's activity too.
                    if kind == TimeoutKind::Inactivity && self.inactivity_deadline() > Instant::now() {
                        continue;
                    }
                    let after = match kind {
                        TimeoutKind::Inactivity => self.handlers.timeouts.inactivity,
                        TimeoutKind::Absolute => self.handlers.timeouts.absolute,
                        _ => self.pending.get(&label).map(|p| p.limit).unwrap_or_default(),
                    };
                    let detail = self.timeout_detail(kind, &label);
                    let error = TurnError::Timeout { kind, after, detail };
                    return Some(Err(self.abort_with(session, error).await));
                }
            }
        }
    }

    /// The earliest limit: the absolute cap, the oldest pending item's own timeout, or the
    /// inactivity timeout (paused while something is pending on our side).
    fn next_deadline(&self) -> (Instant, TimeoutKind, String) {
        let t = &self.handlers.timeouts;
        let absolute = deadline::from(self.started, t.absolute);
        let mut best = (absolute, TimeoutKind::Absolute, String::new());
        // A pending item is named by its request id.
        let pending = self.pending.iter().min_by_key(|(_, p)| p.deadline);
        match pending {
            Some((id, p)) if p.deadline < best.0 => best = (p.deadline, p.kind, id.clone()),
            Some(_) => {}
            None if self.question.is_none() => {
                let idle = self.inactivity_deadline();
                if idle < best.0 {
                    best = (idle, TimeoutKind::Inactivity, String::new());
                }
            }
            None => {}
        }
        best
    }

    fn timeout_detail(&self, kind: TimeoutKind, request_id: &str) -> String {
        let async_note = if self.async_shell {
            "; the turn started an asynchronous shell command (bash mode \"async\"), which \
             keeps a turn open until the command ends"
        } else {
            ""
        };
        match kind {
            TimeoutKind::Tool => {
                let name = self
                    .pending
                    .get(request_id)
                    .map(|p| p.label.as_str())
                    .unwrap_or("?");
                format!("gateway tool {name:?} did not finish in time")
            }
            TimeoutKind::Permission => "the permission policy did not decide in time".to_owned(),
            TimeoutKind::Inactivity => format!("no event from the runtime{async_note}"),
            TimeoutKind::Absolute => format!("the turn exceeded its absolute limit{async_note}"),
        }
    }

    fn reject_late_permission(&mut self, request_id: &str) {
        if let Some(p) = self.pending.remove(request_id) {
            p.task.abort();
            let id = request_id.to_owned();
            tokio::spawn(async move {
                let decision = crate::permission::PermissionDecision::Reject {
                    feedback:
                        "the permission policy did not decide in time; rejected (fail closed)"
                            .to_owned(),
                };
                let _ = p.answerer.answer_permission(&id, decision.to_wire()).await;
            });
        }
    }

    /// Aborts the turn, waits (bounded by the abort drain, refusing stray requests) for its
    /// `session.idle`, and returns `error`. The conversation stays resumable.
    async fn abort_with(&mut self, session: &mut Session, error: TurnError) -> TurnError {
        tracing::warn!(%error, "Aborting a turn.");
        self.cancel_pending();
        // What the drain reads is mirrored once it is over (unless the strict mirror itself
        // failed: nothing is written after a gap).
        let mirror = !matches!(error, TurnError::TranscriptPersistence(_));
        let drained = &mut self.drained;
        let reached_idle = session
            .abort_and_settle_seeing(self.abort_drain, |event| {
                if mirror {
                    drained.extend(DrainedEntry::of(event));
                }
            })
            .await
            == Settled::Idle;
        mirror_drained(&mut self.transcript, std::mem::take(&mut self.drained));
        if !reached_idle {
            tracing::warn!(
                "An aborted turn did not reach session.idle; the session will not be reused."
            );
            self.poisoned = true;
        }
        self.finish(match &error {
            TurnError::Timeout { .. } => TurnEnd::Timeout,
            TurnError::Worker(_) => TurnEnd::Crashed,
            _ => TurnEnd::Error,
        });
        error
    }

    /// How a turn that reached `session.idle` ended.
    fn idle_end(&self) -> TurnEnd {
        if self.outcome.aborted {
            TurnEnd::Aborted
        } else if self.outcome.error.is_some() {
            TurnEnd::Error
        } else {
            TurnEnd::Idle
        }
    }

    /// Ends the running turn, recording how.
    fn finish(&mut self, end: TurnEnd) {
        if self.in_flight {
            self.outcome.end = Some(end);
            metrics::turn_finished(end, self.started.elapsed());
        }
        self.cancel_pending();
        self.in_flight = false;
    }

    /// Cancels everything pending on our side, answering each request so the runtime never
    /// waits on it: tool calls get a timeout failure, permissions a rejection, the question an
    /// empty answer.
    fn cancel_pending(&mut self) {
        for (id, p) in self.pending.drain() {
            if p.kind == TimeoutKind::Tool && !p.task.is_finished() {
                metrics::tool_call(ToolOutcome::Timeout);
            }
            p.task.abort();
            let kind = p.kind;
            tokio::spawn(async move {
                let _ = match kind {
                    TimeoutKind::Permission => {
                        let decision = crate::permission::PermissionDecision::Reject {
                            feedback: "the turn ended before the permission was decided".to_owned(),
                        };
                        p.answerer.answer_permission(&id, decision.to_wire()).await
                    }
                    _ => {
                        let result = ToolResult::Object(json!({
                            "textResultForLlm": "the tool call was cancelled (turn timeout or abort)",
                            "resultType": "timeout",
                        }));
                        p.answerer.answer_tool_call(&id, result).await
                    }
                };
            });
        }
        if let Some(mut q) = self.question.take()
            && let Some(cancel) = q.cancel.take()
        {
            let _ = cancel.send(());
        }
    }

    fn on_event(&mut self, event: &SessionEvent, session: &mut Session) -> Result<(), TurnError> {
        self.outcome.events += 1;
        // Asked only of the typed events below (an untyped one's envelope is read lazily).
        let main_agent = || event.agent_id().is_none();
        match &event.kind {
            EventKind::AssistantTurnStart(data) => {
                self.outcome.model_calls += 1;
                metrics::llm_call();
                self.fire_hook(|h| {
                    h.llm_input(json!({"turnId": data.turn_id, "model": data.model}))
                });
            }
            EventKind::AssistantMessage(m) => {
                if main_agent() && !m.content.is_empty() {
                    self.outcome.text = m.content.clone();
                }
                let (content, tools) = (m.content.clone(), m.tool_requests.len());
                self.fire_hook(move |h| {
                    h.llm_output(json!({"content": content, "toolRequests": tools}))
                });
            }
            EventKind::ToolExecutionStart(t) => {
                self.outcome.tool_calls += 1;
                if t.tool_name == "bash"
                    && t.arguments
                        .as_ref()
                        .and_then(|a| a.get("mode"))
                        .and_then(Value::as_str)
                        == Some("async")
                {
                    self.async_shell = true;
                }
            }
            EventKind::AssistantUsage(u) => {
                let mut call = super::Usage::default();
                call.add(u);
                for (kind, n) in call.by_kind() {
                    metrics::tokens(metrics::COPILOT_BACKEND, kind, n);
                }
                self.outcome.usage.add_usage(&call);
            }
            EventKind::SessionError(e) => {
                self.outcome.error = Some(e.message.clone());
                self.outcome.status_code = e.status_code;
                self.outcome.error_type = e.error_type.clone();
            }
            EventKind::SessionTaskComplete(raw) => {
                self.outcome.task_complete = Some(Value::Object(raw.0.clone()));
            }
            EventKind::SessionIdle(idle) => self.outcome.aborted = idle.aborted == Some(true),
            EventKind::CompactionStart(_) | EventKind::CompactionComplete(_) => {
                self.on_compaction(event, session)
            }
            EventKind::ExternalToolRequested(req) => self.on_tool_call(req, session.answerer()),
            EventKind::PermissionRequested(req) if req.resolved_by_hook != Some(true) => {
                self.on_permission(&req.request_id, &req.permission_request, session.answerer());
            }
            _ => {}
        }
        mirror_event(&mut self.transcript, event)
    }

    fn on_tool_call(&mut self, req: &ExternalToolRequestedData, answerer: Answerer) {
        let Some(tool) = self.tools.get(&req.tool_name).cloned() else {
            // Not ours to run: refuse, so the runtime never waits on it.
            let id = req.request_id.clone();
            let name = req.tool_name.clone();
            tokio::spawn(async move {
                let _ = answerer
                    .answer_tool_call(&id, ToolResult::Error(format!("unknown tool {name:?}")))
                    .await;
            });
            return;
        };
        self.outcome.gateway_tool_calls += 1;
        let timeout = tool.timeout.unwrap_or(self.handlers.timeouts.tool);
        let pending_answerer = answerer.clone();
        let call = ToolCall {
            tool_name: req.tool_name.clone(),
            tool_call_id: req.tool_call_id.clone(),
            arguments: req.arguments.clone(),
            session_id: req.session_id.clone(),
            working_directory: req.working_directory.clone(),
        };
        let request_id = req.request_id.clone();
        let lock = self.sequential.clone();
        let done = self.done_tx.clone();
        let handler = tool.handler();
        let concurrency = tool.concurrency;
        let id = request_id.clone();
        let task = tokio::spawn(async move {
            let result = {
                // Sequential tools take the lock exclusively, concurrent ones shared: a
                // sequential call waits for every earlier call and blocks later ones.
                let _guard = match concurrency {
                    ToolConcurrency::Sequential => Guard::Write(lock.write_owned().await),
                    ToolConcurrency::Concurrent => Guard::Read(lock.read_owned().await),
                };
                // A panicking handler (while building its future or while running) must still
                // produce an answer; the handler runs inside this task, so aborting the task
                // cancels it.
                match call_guarded(|| handler.call(call)).await {
                    Ok(Ok(text)) => ToolResult::Text(text),
                    Ok(Err(message)) => ToolResult::Error(message),
                    Err(panic) => ToolResult::Error(format!("the tool handler panicked: {panic}")),
                }
            };
            let outcome = match &result {
                ToolResult::Error(_) => ToolOutcome::Error,
                _ => ToolOutcome::Ok,
            };
            if let Err(error) = answerer.answer_tool_call(&id, result).await {
                tracing::warn!(%error, "Could not deliver a tool result.");
            }
            // Counted once answered: a call cancelled before that counts as a timeout.
            metrics::tool_call(outcome);
            let _ = done.send(Done::Request(id));
        });
        self.pending.insert(
            request_id,
            Pending {
                kind: TimeoutKind::Tool,
                deadline: deadline::from_now(timeout),
                limit: timeout,
                label: tool.name.clone(),
                task: task.abort_handle(),
                answerer: pending_answerer,
            },
        );
    }

    fn on_permission(&mut self, request_id: &str, request: &Value, answerer: Answerer) {
        self.outcome.permission_prompts += 1;
        let policy = self.handlers.permission_policy.clone();
        let request = PermissionRequest::from_wire(request)
            .with_working_directory(self.working_directory.clone());
        let id = request_id.to_owned();
        let done = self.done_tx.clone();
        let pending_answerer = answerer.clone();
        // What an approve-for-session has the runtime remember, read before the policy
        // takes the request.
        let session_approval = request.session_approval();
        let task = tokio::spawn(async move {
            let decision = decide_safely(policy.as_ref(), request).await;
            // Once decided, the answer goes out in a task of its own: aborting the policy
            // (its time is up, the turn ended) must not cut a delivery that has already
            // taken the ledger's entry, else nobody answers and the runtime waits. Whichever
            // of this answer and the abort's rejection takes the entry first is the one sent.
            let answer = decision.to_wire_with(session_approval);
            tokio::spawn(async move {
                if let Err(error) = answerer.answer_permission(&id, answer).await {
                    tracing::warn!(%error, "Could not deliver a permission decision.");
                }
                let _ = done.send(Done::Request(id));
            });
        });
        self.pending.insert(
            request_id.to_owned(),
            Pending {
                kind: TimeoutKind::Permission,
                deadline: deadline::from_now(self.handlers.timeouts.permission),
                limit: self.handlers.timeouts.permission,
                label: String::new(),
                task: task.abort_handle(),
                answerer: pending_answerer,
            },
        );
    }

    fn on_question(&mut self, request: ServerRequest<UserInputRequest>) {
        let Some(handler) = self.handlers.user_input.clone() else {
            request.fail("no ask_user handler is configured for this conversation");
            return;
        };
        // One pending question per conversation: a new one cancels the older, which gets
        // an empty free-form answer.
        if let Some(mut older) = self.question.take()
            && let Some(cancel) = older.cancel.take()
        {
            let _ = cancel.send(());
        }
        self.outcome.user_inputs += 1;
        let limit = self.handlers.timeouts.user_input;
        let done = self.done_tx.clone();
        let id = self.next_question;
        self.next_question += 1;
        let (cancel_tx, cancel_rx) = tokio::sync::oneshot::channel::<()>();
        tokio::spawn(async move {
            let question = Question::from_wire(&request.params);
            let ask = call_guarded(|| handler.ask(question.clone()));
            let answer = tokio::select! {
                answer = tokio::time::timeout(limit, ask) => match answer {
                    Ok(Ok(answer)) => answer,
                    Ok(Err(panic)) => {
                        tracing::warn!(%panic, "The ask_user handler panicked; answering empty.");
                        None
                    }
                    Err(_) => None,
                },
                _ = cancel_rx => None,
            };
            request.respond(resolve(&question, answer));
            let _ = done.send(Done::Question(id));
        });
        self.question = Some(PendingQuestion {
            id,
            cancel: Some(cancel_tx),
        });
    }

    fn on_hook(&mut self, request: ServerRequest<HookInvocation>) {
        let hooks = self.handlers.hooks.clone();
        let failures = self.hook_failures.clone();
        let limit = self.handlers.timeouts.hook;
        tokio::spawn(async move {
            let invocation = &request.params;
            let method = for_hook_type(&invocation.hook_type);
            let output = match (hooks.as_deref(), method) {
                (Some(hooks), Some(method)) => {
                    let input = invocation.input.clone();
                    run_hook(call_guarded(|| method(hooks, input)), limit, &failures).await
                }
                _ => None,
            };
            match output {
                Some(output) => request.respond(json!({"output": output})),
                None => request.respond(json!({})),
            }
        });
    }

    /// A compaction's start (held with the session until the compaction is known to have
    /// happened) or end (its hooks fire if it succeeded, with its start and what it was asked
    /// to keep as the input), read in a turn, between turns or as a compaction asked for
    /// returns: the one place a compaction is reported.
    fn on_compaction(&mut self, event: &SessionEvent, session: &mut Session) {
        match &event.kind {
            EventKind::CompactionStart(start) => session.compaction_started(start.clone()),
            EventKind::CompactionComplete(end) => {
                let start = session.compaction_ended().unwrap_or_default();
                if end.success {
                    let mut input =
                        json!({"trigger": start.trigger, "currentTokens": start.current_tokens});
                    if let Some(keep) = &end.custom_instructions {
                        input["customInstructions"] = json!(keep);
                    }
                    let output = json!({"success": end.success, "tokensRemoved": end.tokens_removed, "messagesRemoved": end.messages_removed});
                    self.fire_compaction_hooks(input, output);
                }
            }
            _ => {}
        }
    }

    /// `before_compaction` then `after_compaction`, in that order, for a compaction that
    /// happened.
    fn fire_compaction_hooks(&self, input: Value, output: Value) {
        let Some(hooks) = self.handlers.hooks.as_deref() else {
            return;
        };
        let before = call_guarded(|| hooks.before_compaction(input));
        let after = call_guarded(|| hooks.after_compaction(output));
        let failures = self.hook_failures.clone();
        let limit = self.handlers.timeouts.hook;
        tokio::spawn(async move {
            run_hook(before, limit, &failures).await;
            run_hook(after, limit, &failures).await;
        });
    }

    fn fire_hook(&self, call: impl FnOnce(&dyn TurnHooks) -> HookFuture) {
        let Some(hooks) = self.handlers.hooks.as_deref() else {
            return;
        };
        // Built now, in event order; run in a task.
        let future = call_guarded(|| call(hooks));
        let failures = self.hook_failures.clone();
        let limit = self.handlers.timeouts.hook;
        tokio::spawn(async move {
            run_hook(future, limit, &failures).await;
        });
    }
}

impl Drop for TurnDriver {
    fn drop(&mut self) {
        // A lease dropped mid-turn: the lease aborts the turn.
        if self.in_flight {
            metrics::turn_finished(TurnEnd::Aborted, self.started.elapsed());
        }
        // Nothing of ours may stay pending.
        if tokio::runtime::Handle::try_current().is_ok() {
            self.cancel_pending();
        }
    }
}

enum Guard {
    Write(#[allow(dead_code)] tokio::sync::OwnedRwLockWriteGuard<()>),
    Read(#[allow(dead_code)] tokio::sync::OwnedRwLockReadGuard<()>),
}

/// Runs a hook (guarded by [`call_guarded`]) with a time limit; a failure, panic or timeout is
/// logged and counted and yields no output.
pub(crate) async fn run_hook(
    hook: Guarded<HookFuture>,
    limit: Duration,
    failures: &AtomicU32,
) -> Option<Value> {
    // The hook runs inside the caller's task: a timeout drops (cancels) it.
    match tokio::time::timeout(limit, hook).await {
        Ok(Ok(Ok(output))) => output,
        Ok(Ok(Err(message))) => {
            tracing::warn!(error = %message, "A hook failed; answered with no output.");
            failures.fetch_add(1, Ordering::SeqCst);
            metrics::hook_failed();
            None
        }
        Ok(Err(panic)) => {
            tracing::warn!(%panic, "A hook panicked; answered with no output.");
            failures.fetch_add(1, Ordering::SeqCst);
            metrics::hook_failed();
            None
        }
        Err(_) => {
            tracing::warn!(?limit, "A hook timed out; answered with no output.");
            failures.fetch_add(1, Ordering::SeqCst);
            metrics::hook_failed();
            None
        }
    }
}

/// Appends what `event` adds to the transcript mirror ([`EventEntry::of`]), if one is open.
fn mirror_event(
    transcript: &mut Option<Transcript>,
    event: &SessionEvent,
) -> Result<(), TurnError> {
    if transcript.is_none() {
        return Ok(());
    }
    let Some(EventEntry {
        role,
        content,
        tool_call_id,
    }) = EventEntry::of(event)
    else {
        return Ok(());
    };
    let entry = Entry {
        event_id: Some(event.id()).filter(|id| !id.is_empty()),
        role,
        content: &content,
        tool_name: None,
        tool_call_id,
    };
    append(transcript, &entry)
}

/// What an event an aborted turn's drain read adds to the transcript mirror
/// ([`EventEntry::of`]), kept to be appended once the drain is over: each append fsyncs, and
/// the drain's time limit is for the runtime to settle, not for the disk.
pub(crate) struct DrainedEntry {
    event_id: String,
    role: Role,
    content: String,
    tool_call_id: Option<String>,
}

impl DrainedEntry {
    /// The entry `event` adds to the mirror, if any.
    pub(crate) fn of(event: &SessionEvent) -> Option<Self> {
        let EventEntry {
            role,
            content,
            tool_call_id,
        } = EventEntry::of(event)?;
        Some(DrainedEntry {
            event_id: event.id().to_owned(),
            role,
            content: content.into_owned(),
            tool_call_id: tool_call_id.map(str::to_owned),
        })
    }
}

/// Appends what an aborted turn's drain read: the runtime produced it and keeps it in its
/// own history, so the mirror keeps it too. The turn has already ended with its error, so a
/// failed append is logged, not returned, and closes the mirror (nothing is written after a
/// gap; the next lease reopens it).
pub(crate) fn mirror_drained(transcript: &mut Option<Transcript>, drained: Vec<DrainedEntry>) {
    for entry in &drained {
        let entry = Entry {
            event_id: Some(entry.event_id.as_str()).filter(|id| !id.is_empty()),
            role: entry.role,
            content: &entry.content,
            tool_name: None,
            tool_call_id: entry.tool_call_id.as_deref(),
        };
        if let Err(error) = append(transcript, &entry) {
            tracing::warn!(%error, "An aborted turn's events could not be mirrored to the transcript.");
            *transcript = None;
            return;
        }
    }
}

/// Appends `entry` to the transcript mirror, if one is open.
fn append(transcript: &mut Option<Transcript>, entry: &Entry<'_>) -> Result<(), TurnError> {
    let Some(transcript) = transcript.as_mut() else {
        return Ok(());
    };
    // The append fsyncs: on a multi-threaded runtime, hand this thread's other tasks to the
    // rest of the pool while it waits on the disk. Inline (and cancel-safe: the transcript
    // never leaves its owner) either way.
    let mut append = || transcript.append(entry);
    let appended = match tokio::runtime::Handle::try_current().map(|h| h.runtime_flavor()) {
        Ok(tokio::runtime::RuntimeFlavor::MultiThread) => tokio::task::block_in_place(append),
        _ => append(),
    };
    appended
        .map(|_| ())
        .map_err(|e| TurnError::TranscriptPersistence(e.to_string()))
}

/// Whether a caller falls behind the runtime (pure): what waits unread behind each event it
/// takes, not the event itself, and behind two in a row. One large event, or a small one and
/// a large one written together and read at once, is no backlog.
#[derive(Debug, Default)]
struct BacklogWatch {
    /// The events in a row taken with more than the limit unread behind each.
    over_limit_in_a_row: u8,
}

impl BacklogWatch {
    /// The caller took an event, with `unread` bytes waiting behind it.
    fn took_event(&mut self, unread: usize, limit: usize) {
        self.over_limit_in_a_row = if unread > limit {
            self.over_limit_in_a_row.saturating_add(1)
        } else {
            0
        };
    }

    /// Two events in a row had more than the limit behind them: the turn is aborted at the
    /// next call.
    fn fell_behind(&self) -> bool {
        self.over_limit_in_a_row >= 2
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_caller_falls_behind_when_more_than_the_limit_waits_behind_two_events_in_a_row() {
        const LIMIT: usize = 12 * 1024;
        let mut watch = BacklogWatch::default();
        // A large event read as it comes: nothing waits behind it.
        for unread in [0, 100, 0] {
            watch.took_event(unread, LIMIT);
            assert!(!watch.fell_behind());
        }
        // A small event and a large one written together: only the first has it behind.
        watch.took_event(20 * 1024, LIMIT);
        assert!(!watch.fell_behind(), "one event is no backlog");
        watch.took_event(0, LIMIT);
        assert!(!watch.fell_behind());
        // More than the limit behind two in a row.
        watch.took_event(LIMIT + 1, LIMIT);
        watch.took_event(40 * 1024, LIMIT);
        assert!(watch.fell_behind());
        // The limit itself is not over it.
        let mut at = BacklogWatch::default();
        at.took_event(LIMIT, LIMIT);
        at.took_event(LIMIT, LIMIT);
        assert!(!at.fell_behind());
    }

    struct Exploding;

    impl TurnHooks for Exploding {
        fn agent_end(&self, _input: Value) -> HookFuture {
            panic!("agent_end exploded while building")
        }
        fn before_tool_call(&self, _input: Value) -> HookFuture {
            Box::pin(async { panic!("before_tool_call exploded while running") })
        }
        fn after_tool_call(&self, input: Value) -> HookFuture {
            Box::pin(async move { Ok(Some(input)) })
        }
    }

    async fn run(hook_type: &str, failures: &AtomicU32) -> Option<Value> {
        let method = for_hook_type(hook_type).expect("a known hook type");
        let hook = call_guarded(|| method(&Exploding, json!({"n": 1})));
        run_hook(hook, Duration::from_secs(5), failures).await
    }

    #[tokio::test]
    async fn a_hook_that_panics_building_or_running_answers_nothing_and_counts_a_failure() {
        let failures = AtomicU32::new(0);
        assert_eq!(run("agentStop", &failures).await, None);
        assert_eq!(failures.load(Ordering::SeqCst), 1);
        assert_eq!(run("preToolUse", &failures).await, None);
        assert_eq!(failures.load(Ordering::SeqCst), 2);
        assert_eq!(run("postToolUse", &failures).await, Some(json!({"n": 1})));
        assert_eq!(failures.load(Ordering::SeqCst), 2);
    }

    #[tokio::test]
    async fn an_event_dropped_unread_after_the_last_one_heard_moves_the_inactivity_clock() {
        let gate = Arc::new(crate::rpc::gate::EventGate::default());
        let mut handlers = TurnHandlers::default();
        handlers.timeouts.inactivity = Duration::from_secs(1);
        let mut driver = TurnDriver::new(handlers, PathBuf::from("/"), Duration::from_secs(1));
        driver.begin();
        // The turn's last event a while ago.
        driver.last_activity = Instant::now() - Duration::from_secs(1);
        let started = driver.last_activity;
        assert_eq!(driver.last_heard(), started, "nothing registered");
        driver.unread_registration = Some(gate.leave_unread("s", Arc::new(|_: &str| true)));
        assert_eq!(driver.last_heard(), started, "nothing dropped yet");
        let frame = br#"{"jsonrpc":"2.0","method":"session.event","params":{"sessionId":"s","event":{"type":"model.call_start","data":{}}}}"#;
        assert!(gate.drop_if_unread(frame));
        let heard = driver.last_heard();
        assert!(heard > started, "the drop is heard");
        // The inactivity limit (1 s) counts from the drop, not from the last event.
        assert_eq!(driver.inactivity_deadline(), heard + Duration::from_secs(1));
        // An event heard after the drop counts from itself.
        driver.last_activity = Instant::now() + Duration::from_millis(5);
        assert_eq!(driver.last_heard(), driver.last_activity);
        driver.forget_unread();
        assert!(
            !gate.drop_if_unread(frame),
            "nothing registered once forgotten"
        );
    }
}
