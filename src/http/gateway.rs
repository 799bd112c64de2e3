//! Requests the gateway must answer over HTTP: gateway tool calls, permission prompts,
//! ask_user questions and the hooks a turn asked for become SSE events with a `request_id`,
//! and wait for `POST /v1/requests/{request_id}`. A request nobody answers resolves as "no
//! answer" when its turn ends or its timeout expires (the turn driver then fails closed; a
//! hook gets the runtime's default, no output). Hooks the runtime does not wait for
//! (`llm_input`, `llm_output`, the compaction pair) are `hook.notification` events without
//! a `request_id`.

use std::collections::HashSet;
use std::sync::Arc;

use axum::body::Body;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use dashmap::DashMap;
use serde_json::{Value, json};
use tokio::sync::{mpsc, oneshot};

use super::AppState;
use super::body::{parse, read_body};
use super::error::error;
use super::turns::SEND_TIMEOUT;
use crate::kinds::HookName;
use crate::permission::{DecisionFuture, PermissionDecision, PermissionPolicy, PermissionRequest};
use crate::turn::hooks::HookFuture;
use crate::turn::user_input::AnswerFuture;
use crate::turn::{Answer, GatewayTool, Question, ToolCall, TurnHooks, UserInputHandler};

/// `POST /v1/requests/{request_id}`: the gateway's answer to a request of a running turn.
pub(super) async fn post_answer(
    State(state): State<Arc<AppState>>,
    Path(request_id): Path<String>,
    body: Body,
) -> Response {
    let body = match read_body(&state, body).await {
        Ok(b) => b,
        Err(r) => return r,
    };
    let body: Value = match parse(&body) {
        Ok(b) => b,
        Err(r) => return r,
    };
    match state.registry.answer(&request_id, &body) {
        Ok(()) => StatusCode::NO_CONTENT.into_response(),
        Err(AnswerError::Unknown) => error(
            StatusCode::NOT_FOUND,
            "not_found",
            "no pending request with this id (answered already, or its turn ended)",
        ),
        Err(AnswerError::Shape(message)) => error(StatusCode::BAD_REQUEST, "bad_request", message),
    }
}

/// One SSE event for the gateway.
#[derive(Debug, Clone)]
pub(super) struct SseEvent {
    pub(super) event: String,
    pub(super) data: Value,
}

/// What kind of answer a pending request needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    ToolCall,
    Permission,
    UserInput,
    Hook(HookName),
}

/// A validated answer.
#[derive(Debug)]
enum GatewayAnswer {
    Tool(Result<String, String>),
    Permission(PermissionDecision),
    UserInput(Answer),
    /// The hook's output (`None`: the runtime's default).
    Hook(Option<Value>),
}

struct Pending {
    kind: Kind,
    answer: oneshot::Sender<GatewayAnswer>,
}

/// Every request waiting for the gateway, by request id.
#[derive(Default)]
pub(super) struct Registry {
    pending: DashMap<String, Pending>,
}

/// Why an answer was refused.
pub(super) enum AnswerError {
    /// No such request, or it was answered already.
    Unknown,
    /// The body does not fit the request's kind; the message says what was expected.
    Shape(String),
}

impl Registry {
    fn register(&self, kind: Kind) -> (String, oneshot::Receiver<GatewayAnswer>) {
        let id = uuid::Uuid::new_v4().to_string();
        let (tx, rx) = oneshot::channel();
        self.pending
            .insert(id.clone(), Pending { kind, answer: tx });
        (id, rx)
    }

    fn forget(&self, id: &str) {
        self.pending.remove(id);
    }

    /// Answers request `id` with `body` (validated for its kind).
    pub(super) fn answer(&self, id: &str, body: &Value) -> Result<(), AnswerError> {
        let kind = self
            .pending
            .get(id)
            .map(|p| p.kind)
            .ok_or(AnswerError::Unknown)?;
        let answer = parse_answer(kind, body).map_err(AnswerError::Shape)?;
        let (_, pending) = self.pending.remove(id).ok_or(AnswerError::Unknown)?;
        // The turn may have ended in between: then nobody waits any more.
        pending
            .answer
            .send(answer)
            .map_err(|_| AnswerError::Unknown)
    }
}

fn parse_answer(kind: Kind, body: &Value) -> Result<GatewayAnswer, String> {
    let obj = body.as_object().ok_or("the answer must be a JSON object")?;
    match kind {
        Kind::ToolCall => match (obj.get("result"), obj.get("error")) {
            (Some(Value::String(text)), None) => Ok(GatewayAnswer::Tool(Ok(text.clone()))),
            (None, Some(Value::String(message))) => Ok(GatewayAnswer::Tool(Err(message.clone()))),
            _ => Err(r#"a tool.call answer is {"result": "<text>"} or {"error": "<message>"}"#.to_owned()),
        },
        Kind::Permission => {
            let decision = obj.get("decision").and_then(Value::as_str);
            let feedback = obj.get("feedback").and_then(Value::as_str).unwrap_or("rejected by the gateway");
            match decision {
                Some("approve-once" | "approve-for-session") => Ok(GatewayAnswer::Permission(PermissionDecision::Approve)),
                Some("reject") => Ok(GatewayAnswer::Permission(PermissionDecision::Reject {
                    feedback: feedback.to_owned(),
                })),
                _ => Err(r#"a permission.request answer is {"decision": "approve-once"|"approve-for-session"|"reject", "feedback"?: "..."}"#.to_owned()),
            }
        }
        Kind::UserInput => match (obj.get("answer"), obj.get("choice")) {
            (Some(Value::String(answer)), None) => {
                let freeform = obj.get("was_freeform").and_then(Value::as_bool).unwrap_or(true);
                Ok(GatewayAnswer::UserInput(if freeform {
                    Answer::FreeText(answer.clone())
                } else {
                    Answer::Label(answer.clone())
                }))
            }
            (None, Some(choice)) => choice
                .as_u64()
                .map(|i| GatewayAnswer::UserInput(Answer::Choice(i as usize)))
                .ok_or_else(|| "choice must be a non-negative integer".to_owned()),
            _ => Err(r#"a user_input.request answer is {"answer": "...", "was_freeform": true|false} or {"choice": <index>}"#.to_owned()),
        },
        Kind::Hook(hook) => parse_hook_answer(hook, obj).map(GatewayAnswer::Hook),
    }
}

/// The output fields a hook's answer may carry (the runtime's documented output of the
/// hook type behind it) and what each must be.
fn hook_output_fields(hook: HookName) -> &'static [(&'static str, FieldType)] {
    use FieldType::*;
    match hook {
        // userPromptSubmitted
        HookName::BeforePromptBuild => &[
            ("modifiedPrompt", Text),
            ("additionalContext", Text),
            ("suppressOutput", Bool),
        ],
        // preToolUse
        HookName::BeforeToolCall => &[
            ("permissionDecision", OneOf(&["allow", "deny", "ask"])),
            ("permissionDecisionReason", Text),
            ("modifiedArgs", Any),
            ("additionalContext", Text),
            ("suppressOutput", Bool),
        ],
        // postToolUse (postToolUseFailure reads additionalContext only)
        HookName::AfterToolCall => &[
            ("modifiedResult", Object),
            ("additionalContext", Text),
            ("suppressOutput", Bool),
        ],
        // agentStop
        HookName::AgentEnd => &[("decision", OneOf(&["block"])), ("reason", Text)],
        // Notifications: nothing goes back.
        HookName::LlmInput
        | HookName::LlmOutput
        | HookName::BeforeCompaction
        | HookName::AfterCompaction => &[],
    }
}

#[derive(Clone, Copy)]
enum FieldType {
    Text,
    Bool,
    Object,
    Any,
    OneOf(&'static [&'static str]),
}

impl FieldType {
    fn accepts(self, value: &Value) -> bool {
        match self {
            FieldType::Text => value.is_string(),
            FieldType::Bool => value.is_boolean(),
            FieldType::Object => value.is_object(),
            FieldType::Any => true,
            FieldType::OneOf(allowed) => value.as_str().is_some_and(|v| allowed.contains(&v)),
        }
    }

    fn describe(self) -> String {
        match self {
            FieldType::Text => "a string".to_owned(),
            FieldType::Bool => "a boolean".to_owned(),
            FieldType::Object => "an object".to_owned(),
            FieldType::Any => "any JSON".to_owned(),
            FieldType::OneOf(allowed) => format!("one of {}", allowed.join(", ")),
        }
    }
}

/// `{}` or `{"output": null}` (the runtime's default), or `{"output": {...}}` with the
/// hook's documented fields.
fn parse_hook_answer(
    hook: HookName,
    obj: &serde_json::Map<String, Value>,
) -> Result<Option<Value>, String> {
    let fields = hook_output_fields(hook);
    let shape = || {
        let list: Vec<String> = fields
            .iter()
            .map(|(name, t)| format!("{name}: {}", t.describe()))
            .collect();
        format!(
            "a hook.request answer for {hook} is {{}} (no output) or {{\"output\": {{{}}}}}",
            list.join(", ")
        )
    };
    if obj.keys().any(|k| k != "output") {
        return Err(shape());
    }
    let output = match obj.get("output") {
        None | Some(Value::Null) => return Ok(None),
        Some(Value::Object(output)) => output,
        Some(_) => return Err(shape()),
    };
    for (key, value) in output {
        match fields.iter().find(|(name, _)| name == key) {
            Some((_, t)) if t.accepts(value) => {}
            _ => return Err(shape()),
        }
    }
    Ok(Some(Value::Object(output.clone())))
}

/// The per-turn link to the gateway: where to send request events, and the registry.
#[derive(Clone)]
pub(super) struct Link {
    pub(super) events: mpsc::Sender<SseEvent>,
    pub(super) registry: Arc<Registry>,
}

impl Link {
    /// Sends `event` with a new request id and waits for the gateway's answer (`None`: the
    /// gateway went away or the request was cancelled).
    async fn ask(&self, kind: Kind, event: &str, mut data: Value) -> Option<GatewayAnswer> {
        let (id, rx) = self.registry.register(kind);
        // Removed however the wait ends (answered, cancelled with its task, or dropped).
        struct Forget<'a>(&'a Registry, String);
        impl Drop for Forget<'_> {
            fn drop(&mut self) {
                self.0.forget(&self.1);
            }
        }
        let _forget = Forget(&self.registry, id.clone());
        if let Some(obj) = data.as_object_mut() {
            obj.insert("request_id".to_owned(), Value::String(id.clone()));
        }
        let sse = SseEvent {
            event: event.to_owned(),
            data,
        };
        if self.events.send_timeout(sse, SEND_TIMEOUT).await.is_err() {
            return None;
        }
        rx.await.ok()
    }

    /// Queues a `hook.notification` event (nothing to answer) at once, so it keeps its
    /// place among the turn's events (just before the event it is about); only when the
    /// stream's buffer is full does the returned future wait for room (a gateway that does
    /// not read its stream ends the turn the usual way).
    fn notify(&self, hook: HookName, input: Value) -> HookFuture {
        let sse = SseEvent {
            event: "hook.notification".to_owned(),
            data: json!({"hook": hook, "input": input}),
        };
        match self.events.try_send(sse) {
            Ok(()) | Err(mpsc::error::TrySendError::Closed(_)) => Box::pin(async { Ok(None) }),
            Err(mpsc::error::TrySendError::Full(sse)) => {
                let events = self.events.clone();
                Box::pin(async move {
                    let _ = events.send_timeout(sse, SEND_TIMEOUT).await;
                    Ok(None)
                })
            }
        }
    }

    /// The turn's hooks: those in `wanted` go to the gateway, the others answer nothing.
    pub(super) fn hooks(&self, wanted: impl IntoIterator<Item = HookName>) -> HttpHooks {
        HttpHooks {
            link: self.clone(),
            wanted: wanted.into_iter().collect(),
        }
    }

    /// A gateway tool whose calls are answered over HTTP.
    pub(super) fn tool(&self, name: String, description: String, parameters: Value) -> GatewayTool {
        let link = self.clone();
        GatewayTool::new(name, description, parameters, move |call: ToolCall| {
            let link = link.clone();
            async move {
                let data = json!({
                    "tool_name": call.tool_name,
                    "tool_call_id": call.tool_call_id,
                    "arguments": call.arguments,
                });
                match link.ask(Kind::ToolCall, "tool.call", data).await {
                    Some(GatewayAnswer::Tool(result)) => result,
                    _ => Err("the gateway did not answer the tool call".to_owned()),
                }
            }
        })
    }
}

/// The hooks of an HTTP turn (see [`Link::hooks`]).
pub(super) struct HttpHooks {
    link: Link,
    wanted: HashSet<HookName>,
}

impl HttpHooks {
    /// A hook the runtime waits for: asked over HTTP when wanted; the driver's hook timeout
    /// gives the runtime its default when nobody answers.
    fn ask(&self, hook: HookName, input: Value) -> HookFuture {
        if !self.wanted.contains(&hook) {
            return Box::pin(async { Ok(None) });
        }
        let link = self.link.clone();
        Box::pin(async move {
            let data = json!({"hook": hook, "input": input});
            match link.ask(Kind::Hook(hook), "hook.request", data).await {
                Some(GatewayAnswer::Hook(output)) => Ok(output),
                _ => Err(format!("the gateway did not answer the {hook} hook")),
            }
        })
    }

    /// A hook the runtime does not wait for: told when wanted, in event order.
    fn tell(&self, hook: HookName, input: Value) -> HookFuture {
        if !self.wanted.contains(&hook) {
            return Box::pin(async { Ok(None) });
        }
        self.link.notify(hook, input)
    }
}

impl TurnHooks for HttpHooks {
    fn before_prompt_build(&self, input: Value) -> HookFuture {
        self.ask(HookName::BeforePromptBuild, input)
    }
    fn llm_input(&self, input: Value) -> HookFuture {
        self.tell(HookName::LlmInput, input)
    }
    fn llm_output(&self, output: Value) -> HookFuture {
        self.tell(HookName::LlmOutput, output)
    }
    fn agent_end(&self, input: Value) -> HookFuture {
        self.ask(HookName::AgentEnd, input)
    }
    fn before_compaction(&self, input: Value) -> HookFuture {
        self.tell(HookName::BeforeCompaction, input)
    }
    fn after_compaction(&self, output: Value) -> HookFuture {
        self.tell(HookName::AfterCompaction, output)
    }
    fn before_tool_call(&self, input: Value) -> HookFuture {
        self.ask(HookName::BeforeToolCall, input)
    }
    fn after_tool_call(&self, input: Value) -> HookFuture {
        self.ask(HookName::AfterToolCall, input)
    }
}

impl PermissionPolicy for Link {
    fn decide(&self, request: PermissionRequest) -> DecisionFuture {
        let link = self.clone();
        Box::pin(async move {
            let data = json!({
                "kind": request.kind,
                "command": request.command,
                "paths": request.paths,
                "url": request.url,
                "tool_name": request.tool_name,
                "request": request.raw,
            });
            match link.ask(Kind::Permission, "permission.request", data).await {
                Some(GatewayAnswer::Permission(decision)) => Ok(decision),
                _ => Err("the gateway did not decide".to_owned()),
            }
        })
    }
}

impl UserInputHandler for Link {
    fn ask(&self, question: Question) -> AnswerFuture {
        let link = self.clone();
        Box::pin(async move {
            let data = json!({
                "question": question.question,
                "choices": question.choices,
                "allow_freeform": question.allow_freeform,
            });
            match Link::ask(&link, Kind::UserInput, "user_input.request", data).await {
                Some(GatewayAnswer::UserInput(answer)) => Some(answer),
                _ => None,
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_answer_must_fit_its_requests_kind_and_is_taken_once() {
        let registry = Registry::default();
        let (tool, mut tool_rx) = registry.register(Kind::ToolCall);
        assert!(matches!(
            registry.answer(&tool, &json!({"decision": "reject"})),
            Err(AnswerError::Shape(m)) if m.contains("tool.call")
        ));
        // A refused shape leaves the request waiting.
        assert!(tool_rx.try_recv().is_err());
        assert!(registry.answer(&tool, &json!({"result": "42"})).is_ok());
        assert!(matches!(
            tool_rx.try_recv(),
            Ok(GatewayAnswer::Tool(Ok(text))) if text == "42"
        ));
        assert!(matches!(
            registry.answer(&tool, &json!({"result": "again"})),
            Err(AnswerError::Unknown)
        ));
        assert!(matches!(
            registry.answer("no-such-id", &json!({"result": "x"})),
            Err(AnswerError::Unknown)
        ));
    }

    #[test]
    fn permission_and_user_input_answers_map_onto_the_librarys_types() {
        let registry = Registry::default();
        let (id, mut rx) = registry.register(Kind::Permission);
        registry
            .answer(&id, &json!({"decision": "reject", "feedback": "no"}))
            .map_err(|_| "refused")
            .unwrap();
        assert!(matches!(
            rx.try_recv(),
            Ok(GatewayAnswer::Permission(PermissionDecision::Reject { feedback })) if feedback == "no"
        ));
        let (id, mut rx) = registry.register(Kind::UserInput);
        assert!(matches!(
            registry.answer(&id, &json!({"choice": -1})),
            Err(AnswerError::Shape(_))
        ));
        registry
            .answer(&id, &json!({"answer": "blue", "was_freeform": false}))
            .map_err(|_| "refused")
            .unwrap();
        assert!(matches!(
            rx.try_recv(),
            Ok(GatewayAnswer::UserInput(Answer::Label(label))) if label == "blue"
        ));
    }

    #[test]
    fn a_hook_answer_is_no_output_or_the_hooks_documented_output() {
        let registry = Registry::default();
        let (id, mut rx) = registry.register(Kind::Hook(HookName::BeforeToolCall));
        for wrong in [
            json!({"output": {"permissionDecision": "maybe"}}),
            json!({"output": {"decision": "block"}}),
            json!({"output": "allow"}),
            json!({"result": "x"}),
        ] {
            assert!(
                matches!(registry.answer(&id, &wrong), Err(AnswerError::Shape(m)) if m.contains("permissionDecision")),
                "{wrong}"
            );
        }
        registry
            .answer(
                &id,
                &json!({"output": {"permissionDecision": "deny", "permissionDecisionReason": "no"}}),
            )
            .map_err(|_| "refused")
            .unwrap();
        assert!(matches!(
            rx.try_recv(),
            Ok(GatewayAnswer::Hook(Some(output))) if output["permissionDecision"] == "deny"
        ));
        let (id, mut rx) = registry.register(Kind::Hook(HookName::AgentEnd));
        registry
            .answer(&id, &json!({}))
            .map_err(|_| "refused")
            .unwrap();
        assert!(matches!(rx.try_recv(), Ok(GatewayAnswer::Hook(None))));
    }

    #[test]
    fn a_request_whose_turn_ended_cannot_be_answered() {
        let registry = Registry::default();
        let (id, rx) = registry.register(Kind::ToolCall);
        drop(rx);
        assert!(matches!(
            registry.answer(&id, &json!({"result": "late"})),
            Err(AnswerError::Unknown)
        ));
    }
}
