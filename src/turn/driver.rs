//! Runs one turn over a session: yields its events, and on the way answers everything the
//! runtime asks (gateway tools, permission prompts, ask_user, hooks), mirrors the transcript,
//! tallies the outcome, and enforces the timeouts. Every request is answered exactly once,
//! and no turn outlives its limits.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use serde_json::{Value, json};
use tokio::sync::{RwLock, mpsc};
use tokio::task::AbortHandle;
use tokio::time::Instant;

use crate::permission::{PermissionRequest, decide_safely};
use crate::pool::PoolError;
use crate::rpc::events::ExternalToolRequestedData;
use crate::rpc::messages::{HookInvocation, UserInputRequest};
use crate::rpc::{EventKind, SessionEvent};
use crate::transcript::{Entry, Role, Transcript};
use crate::worker::{Answerer, ServerRequest, Session, SessionUpdate, ToolResult};

use super::hooks::{HookFuture, TurnHooks, for_hook_type};
use super::tools::{GatewayTool, ToolCall, ToolConcurrency};
use super::user_input::{Question, resolve};
use super::{TimeoutKind, TurnHandlers, TurnOutcome};

/// How long an aborted turn may take to reach `session.idle`.
const ABORT_DRAIN: Duration = Duration::from_secs(10);

enum Done {
    Request(String),
    Question,
}

struct Pending {
    kind: TimeoutKind,
    deadline: Instant,
    label: String,
    task: AbortHandle,
}

/// The per-conversation turn machinery (lives in the lease).
pub(crate) struct TurnDriver {
    handlers: TurnHandlers,
    tools: HashMap<String, GatewayTool>,
    sequential: Arc<RwLock<()>>,
    done_tx: mpsc::UnboundedSender<Done>,
    done_rx: mpsc::UnboundedReceiver<Done>,
    pending: HashMap<String, Pending>,
    question: Option<AbortHandle>,
    started: Instant,
    last_activity: Instant,
    in_flight: bool,
    async_shell: bool,
    outcome: TurnOutcome,
    hook_failures: Arc<AtomicU32>,
    transcript: Option<Transcript>,
}

impl TurnDriver {
    pub(crate) fn new(handlers: TurnHandlers) -> Self {
        let (done_tx, done_rx) = mpsc::unbounded_channel();
        let tools = handlers
            .tools
            .iter()
            .map(|t| (t.name.clone(), t.clone()))
            .collect();
        Self {
            handlers,
            tools,
            sequential: Arc::new(RwLock::new(())),
            done_tx,
            done_rx,
            pending: HashMap::new(),
            question: None,
            started: Instant::now(),
            last_activity: Instant::now(),
            in_flight: false,
            async_shell: false,
            outcome: TurnOutcome::default(),
            hook_failures: Arc::new(AtomicU32::new(0)),
            transcript: None,
        }
    }

    /// Opens the transcript mirror of `session_id` (if configured).
    pub(crate) fn open_transcript(&mut self, session_id: &str) -> Result<(), PoolError> {
        let Some(settings) = &self.handlers.transcript else {
            return Ok(());
        };
        match Transcript::open(&settings.dir, session_id, settings.mode) {
            Ok(t) => {
                self.transcript = Some(t);
                Ok(())
            }
            Err(e) if settings.mode == crate::transcript::TranscriptMode::Strict => {
                Err(PoolError::TranscriptPersistenceFailed(e.to_string()))
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

    pub(crate) fn hooks(&self) -> Option<Arc<dyn TurnHooks>> {
        self.handlers.hooks.clone()
    }

    pub(crate) fn hook_timeout(&self) -> Duration {
        self.handlers.timeouts.hook
    }

    /// Marks a turn started (after `session.send`).
    pub(crate) fn begin(&mut self) {
        self.outcome = TurnOutcome::default();
        self.hook_failures.store(0, Ordering::SeqCst);
        self.started = Instant::now();
        self.last_activity = self.started;
        self.async_shell = false;
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
    ) -> Option<Result<SessionEvent, PoolError>> {
        if !self.in_flight {
            return None;
        }
        loop {
            let (deadline, kind, label) = self.next_deadline();
            tokio::select! {
                update = session.next() => {
                    self.last_activity = Instant::now();
                    match update {
                        Some(SessionUpdate::Event(event)) => {
                            match self.on_event(&event, session) {
                                Ok(()) => {}
                                Err(e) => return Some(Err(self.abort_with(session, e).await)),
                            }
                            if matches!(event.kind, EventKind::SessionIdle(_)) {
                                self.end();
                            }
                            return Some(Ok(event));
                        }
                        Some(SessionUpdate::UserInput(request)) => self.on_question(request),
                        Some(SessionUpdate::Hook(request)) => self.on_hook(request),
                        Some(SessionUpdate::Ended(error)) => {
                            self.end();
                            return Some(Err(PoolError::Worker(error)));
                        }
                        None => {
                            self.end();
                            return Some(Err(PoolError::TurnState("the session stream ended")));
                        }
                    }
                }
                Some(done) = self.done_rx.recv() => {
                    self.last_activity = Instant::now();
                    match done {
                        Done::Request(id) => { self.pending.remove(&id); }
                        Done::Question => self.question = None,
                    }
                }
                _ = tokio::time::sleep_until(deadline) => {
                    let after = match kind {
                        TimeoutKind::Inactivity => self.handlers.timeouts.inactivity,
                        TimeoutKind::Absolute => self.handlers.timeouts.absolute,
                        _ => deadline.saturating_duration_since(self.started),
                    };
                    let detail = self.timeout_detail(kind, &label);
                    let error = PoolError::TurnTimeout { kind, after, detail };
                    return Some(Err(self.abort_with(session, error).await));
                }
            }
        }
    }

    /// The earliest limit: the absolute cap, the oldest pending item's own timeout, or the
    /// inactivity timeout (paused while something is pending on our side).
    fn next_deadline(&self) -> (Instant, TimeoutKind, String) {
        let t = &self.handlers.timeouts;
        let mut best = (
            self.started + t.absolute,
            TimeoutKind::Absolute,
            String::new(),
        );
        let pending = self.pending.values().min_by_key(|p| p.deadline);
        match pending {
            Some(p) if p.deadline < best.0 => best = (p.deadline, p.kind, p.label.clone()),
            Some(_) => {}
            None if self.question.is_none() => {
                let idle = self.last_activity + t.inactivity;
                if idle < best.0 {
                    best = (idle, TimeoutKind::Inactivity, String::new());
                }
            }
            None => {}
        }
        best
    }

    fn timeout_detail(&self, kind: TimeoutKind, label: &str) -> String {
        match kind {
            TimeoutKind::Tool => format!("gateway tool {label:?} did not finish in time"),
            TimeoutKind::Permission => "the permission policy did not decide in time".to_owned(),
            TimeoutKind::Inactivity if self.async_shell => {
                "no event from the runtime; the turn is still waiting for an asynchronous shell \
                 command (bash mode \"async\") it started, which keeps a turn open until the \
                 command ends"
                    .to_owned()
            }
            TimeoutKind::Inactivity => "no event from the runtime".to_owned(),
            TimeoutKind::Absolute => "the turn exceeded its absolute limit".to_owned(),
        }
    }

    /// Aborts the turn, waits (bounded) for its `session.idle`, and returns `error`. The
    /// conversation stays resumable.
    async fn abort_with(&mut self, session: &mut Session, error: PoolError) -> PoolError {
        tracing::warn!(%error, "Aborting a turn.");
        self.cancel_pending();
        if session.abort().await.is_ok() {
            let drained = tokio::time::timeout(ABORT_DRAIN, async {
                while let Some(update) = session.next().await {
                    match update {
                        SessionUpdate::Event(e) if matches!(e.kind, EventKind::SessionIdle(_)) => {
                            return;
                        }
                        SessionUpdate::Ended(_) => return,
                        // Requests still arriving are answered by their drop.
                        _ => {}
                    }
                }
            })
            .await;
            if drained.is_err() {
                tracing::warn!("An aborted turn did not reach session.idle in time.");
            }
        }
        self.end();
        error
    }

    fn end(&mut self) {
        self.cancel_pending();
        self.in_flight = false;
    }

    fn cancel_pending(&mut self) {
        for (_, p) in self.pending.drain() {
            p.task.abort();
        }
        if let Some(q) = self.question.take() {
            q.abort();
        }
    }

    fn on_event(&mut self, event: &SessionEvent, session: &Session) -> Result<(), PoolError> {
        self.outcome.events += 1;
        let main_agent = event.agent_id.is_none();
        match &event.kind {
            EventKind::AssistantTurnStart(data) => {
                self.outcome.model_calls += 1;
                self.fire_hook(|h| {
                    h.llm_input(json!({"turnId": data.turn_id, "model": data.model}))
                });
            }
            EventKind::AssistantMessage(m) => {
                if main_agent && !m.content.is_empty() {
                    self.outcome.text = m.content.clone();
                }
                let (content, tools) = (m.content.clone(), m.tool_requests.len());
                self.fire_hook(move |h| {
                    h.llm_output(json!({"content": content, "toolRequests": tools}))
                });
                if main_agent && !m.content.is_empty() {
                    self.mirror(Some(&event.id), Role::Assistant, &m.content, None, None)?;
                }
            }
            EventKind::UserMessage(m) if main_agent => {
                self.mirror(Some(&event.id), Role::User, &m.content, None, None)?;
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
            EventKind::ToolExecutionComplete(t) if main_agent => {
                let content = t
                    .result
                    .as_ref()
                    .and_then(|r| r.get("content"))
                    .and_then(Value::as_str)
                    .map(str::to_owned)
                    .or_else(|| t.error.as_ref().map(|e| e.to_string()))
                    .unwrap_or_default();
                self.mirror(
                    Some(&event.id),
                    Role::Tool,
                    &content,
                    None,
                    Some(&t.tool_call_id),
                )?;
            }
            EventKind::AssistantUsage(u) => {
                self.outcome.usage.input_tokens += u.input_tokens.unwrap_or(0);
                self.outcome.usage.output_tokens += u.output_tokens.unwrap_or(0);
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
            EventKind::CompactionStart(c) => {
                let input = json!({"trigger": c.trigger, "currentTokens": c.current_tokens});
                self.fire_hook(move |h| h.before_compaction(input));
            }
            EventKind::CompactionComplete(c) => {
                let output = json!({"success": c.success, "tokensRemoved": c.tokens_removed, "messagesRemoved": c.messages_removed});
                self.fire_hook(move |h| h.after_compaction(output));
            }
            EventKind::ExternalToolRequested(req) => self.on_tool_call(req, session.answerer()),
            EventKind::PermissionRequested(req) if req.resolved_by_hook != Some(true) => {
                self.on_permission(&req.request_id, &req.permission_request, session.answerer());
            }
            _ => {}
        }
        Ok(())
    }

    fn mirror(
        &mut self,
        event_id: Option<&str>,
        role: Role,
        content: &str,
        tool_name: Option<&str>,
        tool_call_id: Option<&str>,
    ) -> Result<(), PoolError> {
        let Some(transcript) = self.transcript.as_mut() else {
            return Ok(());
        };
        let entry = Entry {
            event_id: event_id.filter(|id| !id.is_empty()),
            role,
            content,
            tool_name,
            tool_call_id,
        };
        transcript
            .append(&entry)
            .map(|_| ())
            .map_err(|e| PoolError::TranscriptPersistenceFailed(e.to_string()))
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
                // A panicking handler must still produce an answer.
                match tokio::spawn(handler.call(call)).await {
                    Ok(Ok(text)) => ToolResult::Text(text),
                    Ok(Err(message)) => ToolResult::Error(message),
                    Err(join) => ToolResult::Error(format!("the tool handler failed: {join}")),
                }
            };
            if let Err(error) = answerer.answer_tool_call(&id, result).await {
                tracing::warn!(%error, "Could not deliver a tool result.");
            }
            let _ = done.send(Done::Request(id));
        });
        self.pending.insert(
            request_id,
            Pending {
                kind: TimeoutKind::Tool,
                deadline: Instant::now() + timeout,
                label: tool.name.clone(),
                task: task.abort_handle(),
            },
        );
    }

    fn on_permission(&mut self, request_id: &str, request: &Value, answerer: Answerer) {
        self.outcome.permission_prompts += 1;
        let policy = self.handlers.permission_policy.clone();
        let request = PermissionRequest::from_wire(request);
        let id = request_id.to_owned();
        let done = self.done_tx.clone();
        let task = tokio::spawn(async move {
            let decision = decide_safely(policy.as_ref(), request).await;
            if let Err(error) = answerer.answer_permission(&id, decision.to_wire()).await {
                tracing::warn!(%error, "Could not deliver a permission decision.");
            }
            let _ = done.send(Done::Request(id));
        });
        self.pending.insert(
            request_id.to_owned(),
            Pending {
                kind: TimeoutKind::Permission,
                deadline: Instant::now() + self.handlers.timeouts.permission,
                label: String::new(),
                task: task.abort_handle(),
            },
        );
    }

    fn on_question(&mut self, request: ServerRequest<UserInputRequest>) {
        let Some(handler) = self.handlers.user_input.clone() else {
            request.fail("no ask_user handler is configured for this conversation");
            return;
        };
        // One pending question per conversation: a new one cancels the older (its request
        // is answered with an error by its drop).
        if let Some(older) = self.question.take() {
            older.abort();
        }
        self.outcome.user_inputs += 1;
        let limit = self.handlers.timeouts.user_input;
        let done = self.done_tx.clone();
        let task = tokio::spawn(async move {
            let question = Question::from_wire(&request.params);
            let answer = tokio::time::timeout(limit, handler.ask(question.clone()))
                .await
                .unwrap_or(None);
            request.respond(resolve(&question, answer));
            let _ = done.send(Done::Question);
        });
        self.question = Some(task.abort_handle());
    }

    fn on_hook(&mut self, request: ServerRequest<HookInvocation>) {
        let hooks = self.handlers.hooks.clone();
        let failures = self.hook_failures.clone();
        let limit = self.handlers.timeouts.hook;
        tokio::spawn(async move {
            let invocation = &request.params;
            let future = hooks
                .as_deref()
                .and_then(|h| for_hook_type(h, &invocation.hook_type, invocation.input.clone()));
            let output = match future {
                Some(future) => run_hook(future, limit, &failures).await,
                None => None,
            };
            match output {
                Some(output) => request.respond(json!({"output": output})),
                None => request.respond(json!({})),
            }
        });
    }

    fn fire_hook(&self, call: impl FnOnce(&dyn TurnHooks) -> HookFuture) {
        let Some(hooks) = self.handlers.hooks.as_deref() else {
            return;
        };
        let future = call(hooks);
        let failures = self.hook_failures.clone();
        let limit = self.handlers.timeouts.hook;
        tokio::spawn(async move {
            run_hook(future, limit, &failures).await;
        });
    }
}

enum Guard {
    Write(#[allow(dead_code)] tokio::sync::OwnedRwLockWriteGuard<()>),
    Read(#[allow(dead_code)] tokio::sync::OwnedRwLockReadGuard<()>),
}

/// Runs a hook with a time limit; a failure, panic or timeout is logged and counted and
/// yields no output.
pub(crate) async fn run_hook(
    future: HookFuture,
    limit: Duration,
    failures: &AtomicU32,
) -> Option<Value> {
    match tokio::time::timeout(limit, tokio::spawn(future)).await {
        Ok(Ok(Ok(output))) => output,
        Ok(Ok(Err(message))) => {
            tracing::warn!(error = %message, "A hook failed; answered with no output.");
            failures.fetch_add(1, Ordering::SeqCst);
            None
        }
        Ok(Err(join)) => {
            tracing::warn!(error = %join, "A hook panicked; answered with no output.");
            failures.fetch_add(1, Ordering::SeqCst);
            None
        }
        Err(_) => {
            tracing::warn!(?limit, "A hook timed out; answered with no output.");
            failures.fetch_add(1, Ordering::SeqCst);
            None
        }
    }
}
