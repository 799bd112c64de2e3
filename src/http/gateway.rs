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
use axum::extract::rejection::PathRejection;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use dashmap::DashMap;
use serde::Deserialize;
use serde_json::Value;
use tokio::sync::oneshot;
use utoipa::ToSchema;

use super::AppState;
use super::body::{parse, read_body};
use super::error::{ErrorBody, error, rejection};
use super::events::{
    HookNotificationEvent, HookRequestEvent, PermissionRequestEvent, ToolCallEvent, TurnEvent,
    UserInputRequestEvent,
};
use super::stream::TurnEvents;
use crate::kinds::HookName;
use crate::permission::{DecisionFuture, PermissionDecision, PermissionPolicy, PermissionRequest};
use crate::turn::hooks::HookFuture;
use crate::turn::user_input::AnswerFuture;
use crate::turn::{Answer, GatewayTool, Question, ToolCall, TurnHooks, UserInputHandler};

/// The gateway's answer to a request of a running turn (`tool.call`,
/// `permission.request`, `user_input.request`, `hook.request`), in the shape of its kind.
#[utoipa::path(
    post,
    path = "/v1/requests/{request_id}",
    tag = "turns",
    params(("request_id" = String, Path, description = "The `request_id` of the request event")),
    request_body(content = AnswerBody, content_type = "application/json"),
    responses(
        (status = 204, description = "Answered"),
        (status = 400, description = "Not JSON, or not the shape of the request's kind (`bad_request`, `bad_body`); the message shows the shape. For a `user_input.request`, also an answer that fits none of the question's answers (`bad_request`): a choice index past its choices, or a label or text that is none of its choices where it takes no free text (`allow_freeform: false`); the message names the answers it takes. The request stays pending: answer it again", body = ErrorBody),
        (status = 401, description = "Missing or wrong bearer token (when the daemon has one)", body = ErrorBody),
        (status = 403, description = "No token is set and the request is not from this machine: its Host is not a loopback name, or it came from a web page (Origin)", body = ErrorBody),
        (status = 404, description = "No pending request with this id: answered already, or its turn ended (`not_found`)", body = ErrorBody),
        (status = 408, description = "The body did not arrive in time (`body_timeout`)", body = ErrorBody),
        (status = 413, description = "The body exceeds `max_body_bytes`, or holds more JSON values than one per 32 bytes of it (at least 65,536) (`too_large`)", body = ErrorBody),
        (status = 503, description = "`too_many_connections`", body = ErrorBody),
    ),
    security((), ("api_token" = [])),
)]
pub(super) async fn post_answer(
    State(state): State<Arc<AppState>>,
    request_id: Result<Path<String>, PathRejection>,
    body: Body,
) -> Response {
    let Path(request_id) = match request_id {
        Ok(p) => p,
        Err(e) => return rejection(e),
    };
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

/// What kind of answer a pending request needs.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Kind {
    ToolCall,
    Permission,
    /// The question asked (its choices and whether it takes free text decide which
    /// answers fit).
    UserInput(Arc<Question>),
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
            .map(|p| p.kind.clone())
            .ok_or(AnswerError::Unknown)?;
        // A refused answer leaves the request pending: the gateway may answer it again.
        let answer = parse_answer(&kind, body).map_err(AnswerError::Shape)?;
        let (_, pending) = self.pending.remove(id).ok_or(AnswerError::Unknown)?;
        // The turn may have ended in between: then nobody waits any more.
        pending
            .answer
            .send(answer)
            .map_err(|_| AnswerError::Unknown)
    }
}

/// The body of `POST /v1/requests/{request_id}`: the answer of the request's kind.
#[derive(Deserialize, ToSchema)]
#[serde(untagged)]
#[allow(dead_code)] // Read per kind (`parse_answer`); this union is what the document shows.
pub(super) enum AnswerBody {
    ToolResult(ToolResult),
    ToolError(ToolError),
    Permission(PermissionAnswer),
    UserInputText(UserInputText),
    UserInputChoice(UserInputChoice),
    Hook(HookAnswer),
}

/// A `tool.call` answered with the tool's result.
#[derive(Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub(super) struct ToolResult {
    /// What the tool returned, as text for the model.
    result: String,
}

/// A `tool.call` answered with a failure.
#[derive(Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub(super) struct ToolError {
    /// Why the tool failed, for the model.
    error: String,
}

/// A gateway's decision on a `permission.request`: `approve-once`, `approve-for-session`
/// or `reject`. `approve-for-session` approves this request and has the Copilot runtime
/// remember the approval for the rest of the conversation's session: a shell request's
/// `commands[].identifier` (the runtime sends the whole line, so that exact line), every
/// file write, file reads, this MCP tool, this custom tool, memory writes, or the URL's
/// origin. Requests it covers then run without a `permission.request`. A request that names
/// none of these is approved once, as is any request of a CLI backend (Claude Code).
#[derive(Deserialize, ToSchema, Clone, Copy)]
#[serde(rename_all = "kebab-case")]
pub(super) enum Decision {
    ApproveOnce,
    /// Approve, and have the runtime remember it for the session (see the type).
    ApproveForSession,
    Reject,
}

/// A `permission.request` answer.
#[derive(Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub(super) struct PermissionAnswer {
    decision: Decision,
    /// Told to the model on a rejection.
    #[serde(default)]
    feedback: Option<String>,
}

/// A `user_input.request` answered with text: a free-form answer, or one of the choices by
/// its label (`was_freeform: false`).
#[derive(Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub(super) struct UserInputText {
    answer: String,
    /// Default `true`.
    #[serde(default)]
    was_freeform: Option<bool>,
}

/// A `user_input.request` answered with one of the choices, by index.
#[derive(Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub(super) struct UserInputChoice {
    choice: usize,
}

/// A `hook.request` answer: no output (`{}`, or `output: null`: the runtime's default) or the
/// hook's documented output fields.
#[derive(Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub(super) struct HookAnswer {
    #[serde(default)]
    #[schema(value_type = Option<Object>)]
    output: Option<Value>,
}

/// `body` read as a `T`, or `shape` (what the request's kind expects) with what was wrong:
/// serde's words, or, for an answer of several shapes (where serde says only that none
/// matched), the fields the body has (names only, never values).
fn typed<T: for<'de> Deserialize<'de>>(body: &Value, shape: &str) -> Result<T, String> {
    T::deserialize(body).map_err(|e| {
        let detail = crate::secret::json_error_without_values(&e);
        if !detail.contains("did not match any variant") {
            return format!("{shape} ({detail})");
        }
        const SHOWN: usize = 8;
        let fields: Vec<String> = body
            .as_object()
            .map(|o| {
                o.keys()
                    .take(SHOWN)
                    .map(|k| format!("`{}`", k.chars().take(64).collect::<String>()))
                    .collect()
            })
            .unwrap_or_default();
        match fields.len() {
            0 => format!("{shape}; this one has no field"),
            _ => format!(
                "{shape}, each field of the type shown and no other; this one has {}",
                fields.join(", ")
            ),
        }
    })
}

fn parse_answer(kind: &Kind, body: &Value) -> Result<GatewayAnswer, String> {
    if !body.is_object() {
        return Err("the answer must be a JSON object".to_owned());
    }
    match kind {
        Kind::ToolCall => {
            const SHAPE: &str =
                r#"a tool.call answer is {"result": "<text>"} or {"error": "<message>"}"#;
            #[derive(Deserialize)]
            #[serde(untagged)]
            enum Tool {
                Result(ToolResult),
                Error(ToolError),
            }
            match typed::<Tool>(body, SHAPE)? {
                Tool::Result(r) => Ok(GatewayAnswer::Tool(Ok(r.result))),
                Tool::Error(e) => Ok(GatewayAnswer::Tool(Err(e.error))),
            }
        }
        Kind::Permission => {
            const SHAPE: &str = r#"a permission.request answer is {"decision": "approve-once"|"approve-for-session"|"reject", "feedback"?: "..."}"#;
            let answer: PermissionAnswer = typed(body, SHAPE)?;
            Ok(GatewayAnswer::Permission(match answer.decision {
                Decision::ApproveOnce => PermissionDecision::Approve,
                Decision::ApproveForSession => PermissionDecision::ApproveForSession,
                Decision::Reject => PermissionDecision::Reject {
                    feedback: answer
                        .feedback
                        .unwrap_or_else(|| "rejected by the gateway".to_owned()),
                },
            }))
        }
        Kind::UserInput(question) => {
            const SHAPE: &str = r#"a user_input.request answer is {"answer": "...", "was_freeform": true|false} or {"choice": <non-negative index>}"#;
            #[derive(Deserialize)]
            #[serde(untagged)]
            enum UserInput {
                Text(UserInputText),
                Choice(UserInputChoice),
            }
            let answer = match typed::<UserInput>(body, SHAPE)? {
                UserInput::Text(t) if t.was_freeform.unwrap_or(true) => Answer::FreeText(t.answer),
                UserInput::Text(t) => Answer::Label(t.answer),
                UserInput::Choice(c) => Answer::Choice(c.choice),
            };
            // The runtime would be given an empty answer for one that does not fit.
            crate::turn::user_input::check(question, &answer).map_err(|e| {
                format!(
                    "{e} ({{\"choice\": <index>}}, {{\"answer\": \"<label>\", \"was_freeform\": \
                     false}}, or {{\"answer\": \"<text>\"}} where free text is taken); the \
                     request is still pending"
                )
            })?;
            Ok(GatewayAnswer::UserInput(answer))
        }
        Kind::Hook(hook) => {
            // The hook's own message lists its output fields.
            let hook = *hook;
            let answer: HookAnswer =
                typed(body, &hook_shape(hook)).map_err(|_| hook_shape(hook))?;
            parse_hook_output(hook, answer.output).map(GatewayAnswer::Hook)
        }
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

/// What a `hook.request` answer for `hook` looks like, with its documented output fields.
fn hook_shape(hook: HookName) -> String {
    let list: Vec<String> = hook_output_fields(hook)
        .iter()
        .map(|(name, t)| format!("{name}: {}", t.describe()))
        .collect();
    format!(
        "a hook.request answer for {hook} is {{}} (no output) or {{\"output\": {{{}}}}}",
        list.join(", ")
    )
}

/// No output (the runtime's default), or an object of the hook's documented fields.
fn parse_hook_output(hook: HookName, output: Option<Value>) -> Result<Option<Value>, String> {
    let output = match output {
        None | Some(Value::Null) => return Ok(None),
        Some(Value::Object(output)) => output,
        Some(_) => return Err(hook_shape(hook)),
    };
    let fields = hook_output_fields(hook);
    for (key, value) in &output {
        match fields.iter().find(|(name, _)| name == key) {
            Some((_, t)) if t.accepts(value) => {}
            _ => return Err(hook_shape(hook)),
        }
    }
    Ok(Some(Value::Object(output)))
}

/// The per-turn link to the gateway: where to send request events, and the registry.
#[derive(Clone)]
pub(super) struct Link {
    pub(super) events: TurnEvents,
    pub(super) registry: Arc<Registry>,
}

impl Link {
    /// Sends the event `event` builds with a new request id and waits for the gateway's
    /// answer (`None`: the gateway went away or the request was cancelled).
    async fn ask(
        &self,
        kind: Kind,
        event: impl FnOnce(String) -> TurnEvent,
    ) -> Option<GatewayAnswer> {
        let (id, rx) = self.registry.register(kind);
        // Removed however the wait ends (answered, cancelled with its task, or dropped).
        struct Forget<'a>(&'a Registry, String);
        impl Drop for Forget<'_> {
            fn drop(&mut self) {
                self.0.forget(&self.1);
            }
        }
        let _forget = Forget(&self.registry, id.clone());
        if !self.events.send(event(id.clone())).await {
            return None;
        }
        rx.await.ok()
    }

    /// Queues a `hook.notification` event (nothing to answer) at once, so it keeps its
    /// place among the turn's events (just before the event it is about); only when the
    /// stream's buffer is full does the returned future wait for room (a gateway that does
    /// not read its stream ends the turn the usual way).
    fn notify(&self, hook: HookName, input: Value) -> HookFuture {
        let sse = TurnEvent::HookNotification(HookNotificationEvent { hook, input });
        match self.events.send_now_or_later(sse) {
            None => Box::pin(async { Ok(None) }),
            Some(later) => Box::pin(async move {
                let _ = later.await;
                Ok(None)
            }),
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
                let event = |request_id| {
                    TurnEvent::ToolCall(ToolCallEvent {
                        request_id,
                        tool_name: call.tool_name,
                        tool_call_id: call.tool_call_id,
                        arguments: call.arguments,
                    })
                };
                match link.ask(Kind::ToolCall, event).await {
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
            let event = |request_id| {
                TurnEvent::HookRequest(HookRequestEvent {
                    request_id,
                    hook,
                    input,
                })
            };
            match link.ask(Kind::Hook(hook), event).await {
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
            let event = |request_id| {
                TurnEvent::PermissionRequest(PermissionRequestEvent {
                    request_id,
                    kind: request.kind,
                    command: request.command,
                    paths: request.paths,
                    url: request.url,
                    tool_name: request.tool_name,
                    request: request.raw,
                })
            };
            match link.ask(Kind::Permission, event).await {
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
            let kind = Kind::UserInput(Arc::new(question.clone()));
            let event = |request_id| {
                TurnEvent::UserInputRequest(UserInputRequestEvent {
                    request_id,
                    question: question.question,
                    choices: question.choices,
                    allow_freeform: question.allow_freeform,
                })
            };
            match Link::ask(&link, kind, event).await {
                Some(GatewayAnswer::UserInput(answer)) => Some(answer),
                _ => None,
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

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
    fn an_answer_of_no_shape_is_refused_naming_its_fields_never_serdes_enum() {
        let registry = Registry::default();
        let (tool, _rx) = registry.register(Kind::ToolCall);
        let (question, _qrx) = registry.register(user_input(&["red", "blue"], false));
        for (id, wrong, field) in [
            (&tool, json!({"result": "42", "extra": 1}), "`extra`"),
            (&question, json!({"choice": "blue"}), "`choice`"),
        ] {
            match registry.answer(id, &wrong) {
                Err(AnswerError::Shape(m)) => {
                    assert!(!m.contains("untagged"), "{m}");
                    assert!(m.contains(field) && m.contains(" answer is {"), "{m}");
                    // Names only: a value is never echoed.
                    assert!(!m.contains("blue\""), "{m}");
                }
                Err(AnswerError::Unknown) => panic!("{wrong}: unknown request"),
                Ok(()) => panic!("{wrong}: taken"),
            }
        }
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
        let (id, mut rx) = registry.register(user_input(&["red", "blue"], false));
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

    /// A pending `user_input.request`'s kind: a question with `choices`.
    fn user_input(choices: &[&str], allow_freeform: bool) -> Kind {
        Kind::UserInput(Arc::new(Question {
            question: "Which?".to_owned(),
            choices: choices.iter().map(|c| (*c).to_owned()).collect(),
            allow_freeform,
        }))
    }

    #[test]
    fn a_user_input_answer_that_fits_none_of_the_questions_answers_is_refused_and_the_request_stays_answerable()
     {
        let registry = Registry::default();
        let (id, mut rx) = registry.register(user_input(&["a", "b"], false));
        for wrong in [
            json!({"choice": 5}),
            json!({"answer": "c", "was_freeform": false}),
            json!({"answer": "some free text"}),
        ] {
            match registry.answer(&id, &wrong) {
                Err(AnswerError::Shape(m)) => assert!(
                    m.contains(r#""a", "b""#) && m.contains("0 to 1") && m.contains("no free text"),
                    "{wrong}: the message names the valid answers: {m}"
                ),
                Err(AnswerError::Unknown) => panic!("{wrong}: refused as unknown"),
                Ok(()) => panic!("{wrong} was taken"),
            }
            assert!(rx.try_recv().is_err(), "{wrong}: nothing reached the turn");
        }
        registry
            .answer(&id, &json!({"choice": 1}))
            .map_err(|_| "refused")
            .unwrap();
        assert!(matches!(
            rx.try_recv(),
            Ok(GatewayAnswer::UserInput(Answer::Choice(1)))
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
