//! The event stream of a turn (`POST /v1/turns`, `text/event-stream`): every SSE event the
//! daemon sends, as one typed enum whose payloads are the very types the OpenAPI document
//! describes (`ToSchema`), so the stream and its documentation cannot drift. Each event is
//! `event: <name>` and `data: <one line of JSON>`; the stream ends with one `turn.end`.
//!
//! The requests the gateway answers (`tool.call`, `permission.request`,
//! `user_input.request`, `hook.request`) carry a `request_id` for
//! `POST /v1/requests/{request_id}`; `hook.notification` needs no answer; every other event
//! is the runtime's own session event, passed through under its own type as the name.

use std::sync::Arc;

use serde::Serialize;
use serde_json::Value;
use utoipa::ToSchema;
use utoipa::openapi::RefOr;
use utoipa::openapi::schema::{AnyOfBuilder, ObjectBuilder, Ref, Schema, Type};

use crate::kinds::HookName;
use crate::rpc::SessionEvent;

/// One SSE event of a turn.
#[derive(Debug, Clone)]
pub(super) enum TurnEvent {
    ToolCall(ToolCallEvent),
    PermissionRequest(PermissionRequestEvent),
    UserInputRequest(UserInputRequestEvent),
    HookRequest(HookRequestEvent),
    HookNotification(HookNotificationEvent),
    /// A runtime session event, named by its own `type`: sent as [`SessionEventData`],
    /// serialized from the event as it came ([`RuntimeEventFrame`]), not copied into one.
    Runtime(Box<SessionEvent>),
    /// A CLI backend's event in the same shape.
    Session(SessionEventData),
    BackendFallback(BackendFallbackEvent),
    TurnEnd(TurnEndEvent),
}

/// The names of the events the daemon itself defines, with the schema of each one's data
/// (the document's `TurnEventStream` lists these, then the pass-through events).
pub(super) const TOOL_CALL: &str = "tool.call";
pub(super) const PERMISSION_REQUEST: &str = "permission.request";
pub(super) const USER_INPUT_REQUEST: &str = "user_input.request";
pub(super) const HOOK_REQUEST: &str = "hook.request";
pub(super) const HOOK_NOTIFICATION: &str = "hook.notification";
pub(super) const BACKEND_FALLBACK: &str = "backend.fallback";
pub(super) const TURN_END: &str = "turn.end";

impl TurnEvent {
    /// The SSE event name.
    pub(super) fn name(&self) -> &str {
        match self {
            TurnEvent::ToolCall(_) => TOOL_CALL,
            TurnEvent::PermissionRequest(_) => PERMISSION_REQUEST,
            TurnEvent::UserInputRequest(_) => USER_INPUT_REQUEST,
            TurnEvent::HookRequest(_) => HOOK_REQUEST,
            TurnEvent::HookNotification(_) => HOOK_NOTIFICATION,
            TurnEvent::Runtime(e) => e.event_type(),
            TurnEvent::Session(e) => &e.event_type,
            TurnEvent::BackendFallback(_) => BACKEND_FALLBACK,
            TurnEvent::TurnEnd(_) => TURN_END,
        }
    }

    /// The SSE frame: `event: <name>`, `data: <JSON>`, a blank line. The JSON is one line
    /// (serde_json escapes newlines inside strings), so one `data:` line carries it.
    #[cfg(test)]
    pub(super) fn frame(&self) -> String {
        let mut frame = Vec::new();
        self.frame_into(&mut frame);
        String::from_utf8(frame).unwrap_or_default()
    }

    /// Appends the SSE frame (see [`frame`](Self::frame)) to `out`, serialized straight from
    /// the typed event into it: no intermediate `Value` or string (a copy of the whole
    /// payload per event).
    pub(super) fn frame_into(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(b"event: ");
        out.extend_from_slice(self.name().as_bytes());
        out.extend_from_slice(b"\ndata: ");
        let start = out.len();
        let written = match self {
            TurnEvent::ToolCall(e) => serde_json::to_writer(&mut *out, e),
            TurnEvent::PermissionRequest(e) => serde_json::to_writer(&mut *out, e),
            TurnEvent::UserInputRequest(e) => serde_json::to_writer(&mut *out, e),
            TurnEvent::HookRequest(e) => serde_json::to_writer(&mut *out, e),
            TurnEvent::HookNotification(e) => serde_json::to_writer(&mut *out, e),
            TurnEvent::Runtime(e) => serde_json::to_writer(&mut *out, &RuntimeEventFrame(e)),
            TurnEvent::Session(e) => serde_json::to_writer(&mut *out, e),
            TurnEvent::BackendFallback(e) => serde_json::to_writer(&mut *out, e),
            TurnEvent::TurnEnd(e) => serde_json::to_writer(&mut *out, e),
        };
        // Plain structs of strings, numbers and JSON values: serializing cannot fail.
        if written.is_err() {
            out.truncate(start);
            out.extend_from_slice(b"null");
        }
        out.extend_from_slice(b"\n\n");
    }
}

/// `tool.call`: the model called a gateway tool of the turn. Answer with
/// `{"result": "<text>"}` or `{"error": "<message>"}`. On a CLI backend's turn it tells of a
/// tool of the CLI itself (the CLI runs it, after a `permission.request` where its rules
/// ask): its `request_id` is empty and nothing is answered.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub(super) struct ToolCallEvent {
    /// Answer on `POST /v1/requests/{request_id}` (empty: a CLI backend's own tool).
    pub request_id: String,
    /// The tool's name (one of the turn's `tools`).
    pub tool_name: String,
    /// The model's id for this call.
    pub tool_call_id: String,
    /// The arguments, as the model produced them.
    pub arguments: Value,
}

/// `permission.request`: the runtime asks whether it may do something. Answer with
/// `{"decision": "approve-once" | "approve-for-session" | "reject", "feedback"?: "..."}`
/// (`approve-for-session` also has the Copilot runtime remember the approval for the rest of
/// the session: this exact shell line, file writes, file reads, this MCP or custom tool,
/// memory writes, or this URL's origin; what it covers then runs without a
/// `permission.request`); without an answer it is rejected.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub(super) struct PermissionRequestEvent {
    /// Answer on `POST /v1/requests/{request_id}`.
    pub request_id: String,
    /// `shell`, `write`, `read`, `mcp`, `url`, `memory`, `custom-tool`, … (empty if absent).
    pub kind: String,
    /// The full command text of a shell request.
    pub command: Option<String>,
    /// Paths the request touches.
    pub paths: Vec<String>,
    /// The URL of a url request.
    pub url: Option<String>,
    /// The tool name of an mcp or custom-tool request.
    pub tool_name: Option<String>,
    /// The runtime's whole `permissionRequest`, as received.
    pub request: Value,
}

/// `user_input.request`: the agent asks the user a question (ask_user). Answer with
/// `{"answer": "...", "was_freeform"?: bool}` or `{"choice": <index>}`: an index of
/// `choices`, a label of `choices`, or free text where `allow_freeform` is true; any other
/// answer is a 400 naming the valid ones, and the request stays pending.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub(super) struct UserInputRequestEvent {
    /// Answer on `POST /v1/requests/{request_id}`.
    pub request_id: String,
    /// The question.
    pub question: String,
    /// Offered answers (may be empty).
    pub choices: Vec<String>,
    /// Whether a free-text answer is allowed.
    pub allow_freeform: bool,
}

/// `hook.request`: a hook the turn's `hooks` asked for, which the runtime waits for. Answer
/// with `{}` (no output) or `{"output": {...}}` with the hook's documented output fields; an
/// unanswered hook times out to the runtime's default.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub(super) struct HookRequestEvent {
    /// Answer on `POST /v1/requests/{request_id}`.
    pub request_id: String,
    /// Which hook.
    pub hook: HookName,
    /// The runtime's hook input, as received.
    pub input: Value,
}

/// `hook.notification`: a hook the turn's `hooks` asked for that the runtime does not wait
/// for (`llm_input`, `llm_output`, `before_compaction`, `after_compaction`); nothing to
/// answer.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub(super) struct HookNotificationEvent {
    /// Which hook.
    pub hook: HookName,
    /// The hook's input (or output), as received.
    pub input: Value,
}

/// Any other event: the runtime's session event as it sent it (`assistant.message`,
/// `assistant.message_delta`, `tool.execution_start`, `session.idle`, …; see the pinned
/// runtime's `session-events.schema.json`), named by its `type`.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub(super) struct SessionEventData {
    /// Event id.
    pub id: String,
    /// ISO 8601 timestamp.
    pub timestamp: Option<String>,
    /// The previous event of the session (`null` for the first).
    #[serde(rename = "parentId")]
    pub parent_id: Option<String>,
    /// Streamed but not persisted (deltas, `session.idle`, …).
    pub ephemeral: bool,
    /// The sub-agent that emitted it (`null` for the main agent).
    #[serde(rename = "agentId")]
    pub agent_id: Option<String>,
    /// The event type (also the SSE event name).
    #[serde(rename = "type")]
    pub event_type: String,
    /// The event's payload, as the runtime sent it.
    pub data: Value,
}

/// A runtime event serialized as [`SessionEventData`] straight from the event: the
/// envelope's fields as decoded, `data` from the event as the runtime sent it (every field,
/// not only those this crate reads; the decoded payload only when the event had no `data`).
/// No copy of the payload is made.
struct RuntimeEventFrame<'a>(&'a SessionEvent);

impl Serialize for RuntimeEventFrame<'_> {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeStruct;
        let e = self.0;
        let mut frame = serializer.serialize_struct("SessionEventData", 7)?;
        frame.serialize_field("id", &e.id())?;
        frame.serialize_field("timestamp", &e.timestamp())?;
        frame.serialize_field("parentId", &e.parent_id())?;
        frame.serialize_field("ephemeral", &e.ephemeral())?;
        frame.serialize_field("agentId", &e.agent_id())?;
        frame.serialize_field("type", e.event_type())?;
        match e.data() {
            // As sent, unless it spans lines (JSON may have line breaks between its
            // tokens, and an SSE `data:` line may not): then compacted.
            Some(data) if memchr::memchr2(b'\n', b'\r', data.get().as_bytes()).is_none() => {
                frame.serialize_field("data", data)?
            }
            _ => frame.serialize_field("data", &e.data_value())?,
        }
        frame.end()
    }
}

#[cfg(test)]
impl From<&SessionEvent> for SessionEventData {
    fn from(event: &SessionEvent) -> Self {
        Self {
            id: event.id().to_owned(),
            timestamp: event.timestamp().map(str::to_owned),
            parent_id: event.parent_id().map(str::to_owned),
            ephemeral: event.ephemeral(),
            agent_id: event.agent_id().map(str::to_owned),
            event_type: event.event_type().to_owned(),
            data: event.data_value(),
        }
    }
}

/// `backend.fallback`: the library's notice of a fallback, as it is on the wire.
pub(super) type BackendFallbackEvent = crate::fallback::FallbackNotice;

/// `turn.end`: the library's summary of a turn, as it is on the wire.
pub(super) type TurnEndEvent = crate::fallback::TurnSummary;

/// Whether a session event's type may go out as an SSE event name: 1 to 128 letters, digits,
/// `.`, `_` or `-`, and not one of the names the daemon defines itself ([`DAEMON_EVENTS`]).
fn is_pass_through_name(event_type: &str) -> bool {
    (1..=128).contains(&event_type.len())
        && event_type
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
        && !DAEMON_EVENTS.contains(&event_type)
}

/// The names of the events the daemon defines itself; any other name is a pass-through
/// session event.
const DAEMON_EVENTS: [&str; 7] = [
    TOOL_CALL,
    PERMISSION_REQUEST,
    USER_INPUT_REQUEST,
    HOOK_REQUEST,
    HOOK_NOTIFICATION,
    BACKEND_FALLBACK,
    TURN_END,
];

/// The document's schema of a turn's `text/event-stream` (OpenAPI 3.1 has `schema` describe
/// each event of a stream): each SSE event as the pair of its name (`event:`) and its data
/// (`data:`, a string of `application/json` whose `contentSchema` is the event's data type).
pub(super) struct TurnEventStream;

impl utoipa::PartialSchema for TurnEventStream {
    fn schema() -> RefOr<Schema> {
        fn pair(name: Schema, data: RefOr<Schema>, description: &str) -> Schema {
            ObjectBuilder::new()
                .description(Some(description))
                .property("event", name)
                .required("event")
                .property("data", data)
                .required("data")
                .into()
        }
        fn named(name: &str) -> Schema {
            ObjectBuilder::new()
                .schema_type(Type::String)
                .enum_values(Some([name]))
                .into()
        }
        // The `data:` field is text: one line of JSON of the event's data type.
        fn data<T: ToSchema>() -> RefOr<Schema> {
            ObjectBuilder::new()
                .schema_type(Type::String)
                .content_media_type("application/json")
                .content_schema(Some(Ref::from_schema_name(T::name())))
                .into()
        }
        let others = ObjectBuilder::new()
            .schema_type(Type::String)
            .description(Some(
                "the runtime's event type (any name but the daemon's own)",
            ))
            .into();
        // Each pair in the order of `DAEMON_EVENTS`, then the pass-through events.
        let pairs = [
            pair(
                named(TOOL_CALL),
                data::<ToolCallEvent>(),
                "A gateway tool call to answer.",
            ),
            pair(
                named(PERMISSION_REQUEST),
                data::<PermissionRequestEvent>(),
                "A permission prompt to answer.",
            ),
            pair(
                named(USER_INPUT_REQUEST),
                data::<UserInputRequestEvent>(),
                "An ask_user question to answer.",
            ),
            pair(
                named(HOOK_REQUEST),
                data::<HookRequestEvent>(),
                "A hook to answer.",
            ),
            pair(
                named(HOOK_NOTIFICATION),
                data::<HookNotificationEvent>(),
                "A hook to know about (no answer).",
            ),
            pair(
                named(BACKEND_FALLBACK),
                data::<BackendFallbackEvent>(),
                "The backend failed with a retryable class; the next one runs the turn.",
            ),
            pair(
                named(TURN_END),
                data::<TurnEndEvent>(),
                "The turn's summary: the last event.",
            ),
            pair(
                others,
                data::<SessionEventData>(),
                "A runtime session event, named by its type.",
            ),
        ];
        // `anyOf`: a pass-through event's name is any string, so the pairs do not exclude
        // each other by name alone.
        let mut any_of = AnyOfBuilder::new().description(Some(
            "A turn's event stream: SSE events `event: <name>` / `data: <one line of JSON>`, \
             ending with one `turn.end`. Each event is one of these name and data pairs.",
        ));
        for p in pairs {
            any_of = any_of.item(p);
        }
        any_of.into()
    }
}

impl ToSchema for TurnEventStream {
    fn schemas(schemas: &mut Vec<(String, RefOr<Schema>)>) {
        fn add<T: ToSchema>(schemas: &mut Vec<(String, RefOr<Schema>)>) {
            schemas.push((T::name().into_owned(), T::schema()));
            T::schemas(schemas);
        }
        add::<ToolCallEvent>(schemas);
        add::<PermissionRequestEvent>(schemas);
        add::<UserInputRequestEvent>(schemas);
        add::<HookRequestEvent>(schemas);
        add::<HookNotificationEvent>(schemas);
        add::<BackendFallbackEvent>(schemas);
        add::<TurnEndEvent>(schemas);
        add::<SessionEventData>(schemas);
    }
}

/// The session events a turn leaves out of its stream (`omit_events`): types named exactly,
/// and prefixes (a pattern ending in `*`). The daemon's own events always go out.
#[derive(Debug, Default)]
pub(super) struct EventFilter {
    types: Vec<String>,
    prefixes: Vec<String>,
}

/// Patterns one turn may name at most.
const MAX_OMITTED: usize = 32;

impl EventFilter {
    /// Reads `omit_events`; an `Err` says which pattern is wrong and how to write it.
    pub(super) fn parse(patterns: &[String]) -> Result<Self, String> {
        if patterns.len() > MAX_OMITTED {
            return Err(format!(
                "omit_events names {} patterns, at most {MAX_OMITTED}: use a prefix such as \
                 `model.*` for a family of events",
                patterns.len()
            ));
        }
        let mut filter = EventFilter::default();
        for (i, pattern) in patterns.iter().enumerate() {
            let (name, prefix) = match pattern.strip_suffix('*') {
                Some(name) => (name, true),
                None => (pattern.as_str(), false),
            };
            let valid = (prefix || !name.is_empty())
                && name.len() <= 128
                && name
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'));
            if !valid {
                return Err(format!(
                    "omit_events[{i}] is {pattern:?}: write a session event type (letters, \
                     digits, `.`, `_`, `-`; at most 128), or a prefix ending in `*` such as \
                     `model.*`"
                ));
            }
            match prefix {
                true => filter.prefixes.push(name.to_owned()),
                false => filter.types.push(name.to_owned()),
            }
        }
        Ok(filter)
    }

    /// Whether `event` goes out on the stream: the daemon's own always; a pass-through
    /// session event when its type is a plain event name (not one of the daemon's, no
    /// character that would end the `event:` line: the type is the runtime's, which the
    /// pool does not trust) and the caller does not omit it.
    pub(super) fn streams(&self, event: &TurnEvent) -> bool {
        let event_type = match event {
            TurnEvent::Runtime(e) => e.event_type(),
            TurnEvent::Session(e) => &e.event_type,
            _ => return true,
        };
        if !is_pass_through_name(event_type) {
            tracing::warn!(
                len = event_type.len(),
                "A session event whose type is not a plain event name (or is one of the \
                 daemon's own) was not passed on to the gateway."
            );
            return false;
        }
        !self.omits(event_type)
    }

    /// Whether session events of `event_type` are left out.
    pub(super) fn omits(&self, event_type: &str) -> bool {
        self.types.iter().any(|t| t == event_type)
            || self
                .prefixes
                .iter()
                .any(|p| event_type.starts_with(p.as_str()))
    }

    /// The types a lease's caller leaves unread for this filter (`None` when it leaves
    /// nothing out): those the pool does not read either are then not read at all.
    pub(super) fn unread_events(self: &Arc<Self>) -> Option<crate::rpc::UnreadEvents> {
        if self.types.is_empty() && self.prefixes.is_empty() {
            return None;
        }
        let filter = self.clone();
        Some(Arc::new(move |event_type: &str| filter.omits(event_type)))
    }
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;
    use crate::fallback::FallbackClass;
    use crate::kinds::{OpenReason, TurnEnd};
    use crate::turn::Usage;
    use serde_json::json;

    pub(in crate::http) fn every_event() -> Vec<TurnEvent> {
        let usage = Usage::default();
        vec![
            TurnEvent::ToolCall(ToolCallEvent {
                request_id: "r".into(),
                tool_name: "t".into(),
                tool_call_id: "c".into(),
                arguments: json!({}),
            }),
            TurnEvent::PermissionRequest(PermissionRequestEvent {
                request_id: "r".into(),
                kind: "shell".into(),
                command: None,
                paths: Vec::new(),
                url: None,
                tool_name: None,
                request: json!({}),
            }),
            TurnEvent::UserInputRequest(UserInputRequestEvent {
                request_id: "r".into(),
                question: "q".into(),
                choices: Vec::new(),
                allow_freeform: true,
            }),
            TurnEvent::HookRequest(HookRequestEvent {
                request_id: "r".into(),
                hook: HookName::AgentEnd,
                input: json!({}),
            }),
            TurnEvent::HookNotification(HookNotificationEvent {
                hook: HookName::LlmInput,
                input: json!({}),
            }),
            TurnEvent::BackendFallback(BackendFallbackEvent {
                from: "copilot".into(),
                to: "claude-cli".into(),
                class: FallbackClass::Auth,
                error: None,
                status_code: Some(401),
                prelude_chars: 0,
            }),
            TurnEvent::Session(SessionEventData {
                id: "e".into(),
                timestamp: None,
                parent_id: None,
                ephemeral: false,
                agent_id: None,
                event_type: "assistant.message".into(),
                data: json!({"content": "hi"}),
            }),
            TurnEvent::TurnEnd(TurnEndEvent {
                status: TurnEnd::Idle,
                backend: "copilot".into(),
                session_id: "s".into(),
                resumed: false,
                open_reason: Some(OpenReason::New),
                llm_calls: 1,
                final_text: String::new(),
                error: None,
                status_code: None,
                error_type: None,
                usage,
                task_complete: None,
                fallback_from: None,
            }),
        ]
    }

    #[test]
    fn every_daemon_event_is_documented_and_a_session_event_keeps_its_own_name() {
        let names: Vec<String> = every_event().iter().map(|e| e.name().to_owned()).collect();
        for name in &names[..names.len() - 2] {
            assert!(DAEMON_EVENTS.contains(&name.as_str()), "{name}");
        }
        assert_eq!(names[names.len() - 2], "assistant.message");
        assert_eq!(names[names.len() - 1], TURN_END);
        let distinct: std::collections::HashSet<_> = names.iter().collect();
        assert_eq!(distinct.len(), DAEMON_EVENTS.len() + 1);
    }

    #[test]
    fn the_omitted_types_are_left_unread_and_an_empty_filter_leaves_nothing_unread() {
        let filter = Arc::new(
            EventFilter::parse(&["model.*".into(), "system.message".into()]).expect("valid"),
        );
        let unread = filter.unread_events().expect("something is left out");
        assert!(unread("model.messages_snapshot"));
        assert!(unread("system.message"));
        assert!(!unread("assistant.message"));
        assert!(!unread("system.messages"));
        assert!(Arc::new(EventFilter::default()).unread_events().is_none());
    }

    #[test]
    fn omitted_events_are_types_and_prefixes_of_session_events_and_the_daemons_own_always_go_out() {
        let filter =
            EventFilter::parse(&["model.*".into(), "session.usage_info".into()]).expect("valid");
        let runtime = |t: &str| {
            TurnEvent::Runtime(Box::new(SessionEvent::from_value(
                json!({"id": "e", "type": t, "data": {}}),
            )))
        };
        assert!(!filter.streams(&runtime("model.messages_snapshot")));
        assert!(!filter.streams(&runtime("session.usage_info")));
        assert!(filter.streams(&runtime("session.usage_info_v2")), "exact");
        assert!(filter.streams(&runtime("assistant.message")));
        let everything = EventFilter::parse(&["*".into()]).expect("valid");
        assert!(!everything.streams(&runtime("assistant.message")));
        for daemon in every_event() {
            if !matches!(daemon, TurnEvent::Session(_)) {
                assert!(everything.streams(&daemon), "{}", daemon.name());
            }
        }
        for bad in ["", "model*x", "a b", "model.**", &"x".repeat(129)] {
            let error = EventFilter::parse(&[bad.to_owned()]).expect_err(bad);
            assert!(error.contains("omit_events[0]"), "{error}");
        }
        let many: Vec<String> = (0..33).map(|i| format!("t{i}")).collect();
        assert!(EventFilter::parse(&many).is_err());
    }

    #[test]
    fn a_frame_is_the_name_and_one_line_of_json_data() {
        let event = TurnEvent::HookNotification(HookNotificationEvent {
            hook: HookName::LlmOutput,
            input: json!({"text": "two\nlines"}),
        });
        let frame = event.frame();
        assert_eq!(frame.matches('\n').count(), 3, "{frame:?}");
        let data = frame
            .strip_prefix("event: hook.notification\ndata: ")
            .and_then(|rest| rest.strip_suffix("\n\n"))
            .expect("event and data lines");
        let parsed: Value = serde_json::from_str(data).expect("JSON data");
        assert_eq!(
            parsed,
            json!({"hook": "llm_output", "input": {"text": "two\nlines"}})
        );
    }

    /// The `data:` line of a frame, parsed.
    fn frame_data(event: TurnEvent) -> (String, Value) {
        let frame = event.frame();
        let (head, data) = frame
            .trim_end()
            .split_once("\ndata: ")
            .expect("event and data lines");
        let name = head.strip_prefix("event: ").expect("event line").to_owned();
        (name, serde_json::from_str(data).expect("JSON data"))
    }

    #[test]
    fn a_runtime_event_cannot_pass_as_the_daemons_own_or_end_its_event_line() {
        let filter = EventFilter::default();
        let runtime = |event_type: &str| {
            TurnEvent::Runtime(Box::new(SessionEvent::from_value(
                json!({"id": "e", "type": event_type, "data": {}}),
            )))
        };
        // A type with a line break would add a forged event after its own `event:` line;
        // the daemon's own names are the daemon's.
        for forged in [
            "a\n\nevent: turn.end\ndata: {\"status\":\"idle\"}",
            "x\revent: tool.call",
            "turn.end",
            "tool.call",
            "permission.request",
            "",
        ] {
            assert!(!filter.streams(&runtime(forged)), "{forged:?}");
        }
        for plain in [
            "assistant.message",
            "session.idle",
            "model.call_start",
            "a_b-c.9",
        ] {
            assert!(filter.streams(&runtime(plain)), "{plain:?}");
        }
    }

    #[test]
    fn a_runtime_event_goes_out_with_its_data_as_the_runtime_sent_it_every_field_included() {
        // A typed event with a field this crate does not read, and an unknown event.
        for sent in [
            json!({"id": "e1", "timestamp": "2026-12-02T00:00:00Z", "parentId": "e0",
                   "ephemeral": false, "agentId": null, "type": "assistant.message",
                   "data": {"messageId": "m", "content": "hi", "newerField": {"a": [1, 2]}}}),
            json!({"id": "e2", "timestamp": null, "parentId": null, "ephemeral": true,
                   "agentId": "sub", "type": "runtime.future_event", "data": {"x": 1}}),
        ] {
            let event = SessionEvent::from_value(sent.clone());
            let (name, data) = frame_data(TurnEvent::Runtime(Box::new(event)));
            assert_eq!(Some(name.as_str()), sent["type"].as_str());
            assert_eq!(data, sent);
        }
        // An untyped event as the runtime writes it (type first: its envelope read only now).
        let text = r#"{"type":"model.call_start","data":{"turnId":"0","a":"\"q\""},"id":"e5","timestamp":"2026-12-04T00:00:00.000Z","parentId":"e4","ephemeral":true,"agentId":null}"#;
        let raw = serde_json::value::RawValue::from_string(text.to_owned()).expect("JSON");
        let (name, data) = frame_data(TurnEvent::Runtime(Box::new(SessionEvent::from_raw(raw))));
        assert_eq!(name, "model.call_start");
        assert_eq!(data, serde_json::from_str::<Value>(text).expect("JSON"));
        // Data that spans lines goes out on one line, the same JSON.
        let pretty =
            "{\"id\": \"e4\", \"type\": \"model.x\",\n \"data\": {\n  \"a\": [1,\r\n 2]\n}}";
        let raw = serde_json::value::RawValue::from_string(pretty.to_owned()).expect("JSON");
        let frame = TurnEvent::Runtime(Box::new(SessionEvent::from_raw(raw))).frame();
        assert_eq!(frame.matches('\n').count(), 3, "{frame:?}");
        assert!(frame.ends_with("\"data\":{\"a\":[1,2]}}\n\n"), "{frame:?}");
        // An event without data: its envelope normalised, its decoded payload, as before.
        let event = SessionEvent::from_value(json!({"id": "e3", "type": "session.idle"}));
        let before = serde_json::to_value(SessionEventData::from(&event)).expect("json");
        let (_, data) = frame_data(TurnEvent::Runtime(Box::new(event)));
        assert_eq!(data, before);
    }
}
