//! Session events (`session.event` notifications) as a typed enum with an `Unknown` arm.
//!
//! Decoding never fails for an event that has an envelope: a type this crate does not model,
//! or a known type whose data does not match (a newer runtime), becomes
//! [`EventKind::Unknown`] (its data is the event's [`SessionEvent::data`], kept once, in the
//! event as it was sent: the runtime's internal `model.*` events carry tens of KiB each, and a
//! copy per event was a tenth of the pool's CPU), so one odd event never breaks a stream. The
//! runtime also streams internal `model.*` events that are in no schema; they land there too.

use serde::{Deserialize, Serialize};
use serde_json::Value;
use serde_json::value::RawValue;
use std::sync::OnceLock;

use super::connection::read_as_a_value_reads;

/// One session event with its envelope.
///
/// Its type and typed payload ([`SessionEvent::kind`]) are decoded when the event is made. The
/// rest of the envelope (id, timestamp, parent, `ephemeral`, sub-agent, `data`) is read from
/// the event's text then for a type this crate models, and on first use for any other: the
/// runtime's internal `model.*` events, tens of KiB each, are mostly passed on or dropped
/// unread (a gateway's `omit_events`), and their envelope was a pass over every byte.
#[derive(Debug, Clone)]
pub struct SessionEvent {
    /// The typed payload.
    pub kind: EventKind,
    /// The event exactly as the runtime sent it (for passing it on unchanged).
    raw: Box<RawValue>,
    /// The envelope, read from `raw` when first asked for (or with the kind).
    envelope: OnceLock<Envelope>,
}

impl PartialEq for SessionEvent {
    fn eq(&self, other: &Self) -> bool {
        // Everything else is read from the event as sent.
        self.raw.get() == other.raw.get() && self.kind == other.kind
    }
}

/// `params` of a `session.event` notification, read without copying the event: an object
/// with `sessionId` (a string; `""` when missing) and `event` (any JSON; none when missing).
/// A member given twice is an error; any other member is read as JSON text and dropped, so
/// that it is checked as the text of the whole params would be (its strings valid UTF-8),
/// whether the params are read here or in the frame's own pass.
pub(crate) struct EventParams<'a> {
    pub(crate) session_id: String,
    pub(crate) event: Option<&'a RawValue>,
}

impl<'de> Deserialize<'de> for EventParams<'de> {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(field_identifier, rename_all = "camelCase")]
        enum Member {
            SessionId,
            Event,
            #[serde(other)]
            Other,
        }
        struct Params;
        impl<'de> serde::de::Visitor<'de> for Params {
            type Value = EventParams<'de>;

            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("session.event params (an object with sessionId and event)")
            }

            fn visit_map<A: serde::de::MapAccess<'de>>(
                self,
                mut map: A,
            ) -> Result<EventParams<'de>, A::Error> {
                use serde::de::Error;
                let mut session_id: Option<String> = None;
                let mut event: Option<&'de RawValue> = None;
                while let Some(member) = map.next_key::<Member>()? {
                    match member {
                        Member::SessionId if session_id.is_some() => {
                            return Err(A::Error::duplicate_field("sessionId"));
                        }
                        Member::SessionId => session_id = Some(map.next_value()?),
                        Member::Event if event.is_some() => {
                            return Err(A::Error::duplicate_field("event"));
                        }
                        Member::Event => event = Some(map.next_value()?),
                        Member::Other => {
                            map.next_value::<&RawValue>()?;
                        }
                    }
                }
                Ok(EventParams {
                    session_id: session_id.unwrap_or_default(),
                    event,
                })
            }
        }
        d.deserialize_map(Params)
    }
}

impl EventParams<'_> {
    /// The event they carry (`null`, an `Unknown` event with no type, when they carry none).
    pub(crate) fn event(&self) -> SessionEvent {
        SessionEvent::from_raw(self.event.unwrap_or(RawValue::NULL).to_owned())
    }
}

impl Envelope {
    /// The envelope of the event whose text is `raw`: as serde's derive reads it, else as a
    /// `Value` reads it (a member given twice: the last counts); an event that is not an
    /// object has none (an empty type, the whole event as its `data`).
    fn read(raw: &RawValue) -> Self {
        // A struct also reads from an array: only an object has an envelope.
        let read = match raw.get().trim_start().starts_with('{') {
            true => serde_json::from_str::<Self>(raw.get()).ok().or_else(|| {
                let text = read_as_a_value_reads(raw.get().as_bytes())?;
                serde_json::from_slice(&text).ok()
            }),
            false => None,
        };
        read.unwrap_or_else(|| Self {
            data: Some(raw.to_owned()),
            ..Self::default()
        })
    }
}

/// The type of the event whose text is `text`, when the type is its first member, as the
/// runtime writes events (`{"type":"…","data":…}`), and a plain string (no escapes); `None`
/// otherwise. A type given twice is read as its first here, where a full read takes the last
/// (the runtime never sends one twice; see [`SessionEvent::from_raw`]).
pub(crate) fn leading_type(text: &[u8]) -> Option<&str> {
    let rest = text.strip_prefix(b"{\"type\":\"")?;
    plain_string(rest).map(|(event_type, _)| event_type)
}

/// A JSON string's text up to its closing quote, `text` starting just after its opening
/// one, when it has no escape (as the runtime writes types and session ids), and what follows
/// the closing quote; `None` otherwise.
pub(crate) fn plain_string(text: &[u8]) -> Option<(&str, &[u8])> {
    let end = memchr::memchr2(b'"', b'\\', text)?;
    if text[end] != b'"' {
        return None;
    }
    Some((std::str::from_utf8(&text[..end]).ok()?, &text[end + 1..]))
}

/// An event's envelope as it was sent.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
struct Envelope {
    #[serde(default)]
    id: String,
    #[serde(default)]
    timestamp: Option<String>,
    #[serde(default)]
    parent_id: Option<String>,
    #[serde(default)]
    ephemeral: Option<bool>,
    #[serde(default)]
    agent_id: Option<String>,
    /// Taken into the event's kind when the envelope is read with it; an envelope read
    /// later keeps it, unused (the kind's type is the event's).
    #[serde(rename = "type", default)]
    event_type: String,
    /// `data` as sent, `None` when the event had none.
    #[serde(default)]
    data: Option<Box<RawValue>>,
}

impl SessionEvent {
    /// Decodes an event from its JSON text, kept as it is. Unknown or unexpected shapes
    /// become [`EventKind::Unknown`]; a value that is not even an object yields an `Unknown`
    /// event with an empty type. Nothing is built but what is asked for: a typed event's
    /// envelope and payload are read from their place in the text, in one pass; an event of
    /// a type this crate does not model, whose text starts with its type as the runtime
    /// writes it, costs a look at that type until its envelope is asked for (a runtime's
    /// internal event of tens of KiB that is only passed on or dropped is not read). Such an
    /// event keeps the type it starts with where a full read would give it another or none
    /// (neither of which the runtime sends): given a type twice, it takes the first, where a
    /// full read takes the last; with an envelope that does not read (an `id` that is not a
    /// string, say), it keeps its type and has the whole event as its data, where a full
    /// read gives it an empty type.
    pub fn from_raw(raw: Box<RawValue>) -> Self {
        if let Some(event_type) =
            leading_type(raw.get().as_bytes()).filter(|t| !EventKind::models(t))
        {
            return Self {
                kind: EventKind::Unknown {
                    event_type: event_type.to_owned(),
                },
                raw,
                envelope: OnceLock::new(),
            };
        }
        let mut envelope = Envelope::read(&raw);
        let kind = EventKind::decode(
            std::mem::take(&mut envelope.event_type),
            envelope.data.as_deref().map_or("null", RawValue::get),
        );
        Self {
            kind,
            raw,
            envelope: OnceLock::from(envelope),
        }
    }

    /// The envelope's fields, read from the event's text the first time they are asked for.
    fn envelope(&self) -> &Envelope {
        self.envelope.get_or_init(|| Envelope::read(&self.raw))
    }

    /// The event id (a uuid; `""` when the event had none).
    pub fn id(&self) -> &str {
        &self.envelope().id
    }

    /// The ISO 8601 timestamp.
    pub fn timestamp(&self) -> Option<&str> {
        self.envelope().timestamp.as_deref()
    }

    /// The previous event of the session, `None` for the first.
    pub fn parent_id(&self) -> Option<&str> {
        self.envelope().parent_id.as_deref()
    }

    /// Streamed but not persisted (deltas, `session.idle`, …).
    pub fn ephemeral(&self) -> bool {
        self.envelope().ephemeral.unwrap_or(false)
    }

    /// The sub-agent that emitted it; `None` for the main agent.
    pub fn agent_id(&self) -> Option<&str> {
        self.envelope().agent_id.as_deref()
    }

    /// Decodes an event from a JSON value (see [`from_raw`](Self::from_raw)).
    pub fn from_value(value: Value) -> Self {
        // A `Value` always serializes.
        let raw =
            serde_json::value::to_raw_value(&value).unwrap_or_else(|_| RawValue::NULL.to_owned());
        Self::from_raw(raw)
    }

    /// The event exactly as the runtime sent it, every field included (what
    /// [`SessionEvent::to_value`] does not model is kept here).
    pub fn raw(&self) -> &RawValue {
        &self.raw
    }

    /// The event exactly as the runtime sent it, taken (no copy).
    pub fn into_raw(self) -> Box<RawValue> {
        self.raw
    }

    /// The wire type, e.g. `assistant.message`.
    pub fn event_type(&self) -> &str {
        self.kind.event_type()
    }

    /// `data` exactly as the runtime sent it, `None` when the event had none.
    pub fn data(&self) -> Option<&RawValue> {
        self.envelope().data.as_deref()
    }

    /// The data as JSON: what this crate read of a typed event; all of an unknown one's.
    pub fn data_value(&self) -> Value {
        match &self.kind {
            EventKind::Unknown { .. } => self
                .data()
                .and_then(|raw| serde_json::from_str(raw.get()).ok())
                .unwrap_or(Value::Null),
            kind => kind.typed_data_value(),
        }
    }

    /// The event as JSON, in the wire's envelope shape (`id`, `timestamp`, `parentId`,
    /// `ephemeral`, `agentId`, `type`, `data`).
    pub fn to_value(&self) -> Value {
        serde_json::json!({
            "id": self.id(),
            "timestamp": self.timestamp(),
            "parentId": self.parent_id(),
            "ephemeral": self.ephemeral(),
            "agentId": self.agent_id(),
            "type": self.event_type(),
            "data": self.data_value(),
        })
    }
}

macro_rules! events {
    ($($name:literal => $variant:ident($data:ident)),* $(,)?) => {
        /// The payload of a session event, by type.
        #[derive(Debug, Clone, PartialEq)]
        #[non_exhaustive]
        pub enum EventKind {
            $(
                #[doc = concat!("`", $name, "`")]
                $variant($data),
            )*
            /// A type this crate does not model (or whose data did not match): its data is
            /// the event's [`SessionEvent::data`].
            Unknown {
                /// The wire type.
                event_type: String,
            },
        }

        impl EventKind {
            fn decode(event_type: String, data: &str) -> Self {
                match event_type.as_str() {
                    $(
                        $name => match serde_json::from_str::<$data>(data).or_else(|error| {
                            read_as_a_value_reads(data.as_bytes())
                                .and_then(|text| serde_json::from_slice::<$data>(&text).ok())
                                .ok_or(error)
                        }) {
                            Ok(d) => EventKind::$variant(d),
                            Err(error) => {
                                tracing::debug!(event_type = $name, %error, "Event data did not match its type; kept raw.");
                                EventKind::Unknown { event_type }
                            }
                        },
                    )*
                    _ => EventKind::Unknown { event_type },
                }
            }

            /// Whether `event_type` is one this crate decodes into a typed payload.
            fn models(event_type: &str) -> bool {
                matches!(event_type, $( $name )|*)
            }

            /// A typed event's data as JSON (what this crate read of it); `null` for
            /// [`EventKind::Unknown`], whose data only its event holds.
            fn typed_data_value(&self) -> Value {
                match self {
                    $( EventKind::$variant(d) => serde_json::to_value(d).unwrap_or(Value::Null), )*
                    EventKind::Unknown { .. } => Value::Null,
                }
            }

            /// The wire type.
            pub fn event_type(&self) -> &str {
                match self {
                    $( EventKind::$variant(_) => $name, )*
                    EventKind::Unknown { event_type, .. } => event_type,
                }
            }
        }

        /// Every typed event: its wire type and the data fields this crate reads (for the
        /// schema check against the runtime's `session-events.schema.json`).
        pub fn typed_events() -> Vec<(&'static str, Vec<&'static str>)> {
            vec![ $( ($name, crate::rpc::introspect::field_names::<$data>()), )* ]
        }
    };
}

events! {
    "session.start" => SessionStart(SessionStartData),
    "session.resume" => SessionResume(SessionResumeData),
    "session.idle" => SessionIdle(SessionIdleData),
    "session.error" => SessionError(SessionErrorData),
    "session.warning" => SessionWarning(SessionNoticeData),
    "session.info" => SessionInfo(SessionInfoData),
    "session.title_changed" => SessionTitleChanged(TitleChangedData),
    "session.shutdown" => SessionShutdown(ShutdownData),
    "session.usage_info" => SessionUsageInfo(UsageInfoData),
    "session.compaction_start" => CompactionStart(CompactionStartData),
    "session.compaction_complete" => CompactionComplete(CompactionCompleteData),
    "session.truncation" => SessionTruncation(Raw),
    "session.model_change" => SessionModelChange(Raw),
    "session.task_complete" => SessionTaskComplete(Raw),
    "user.message" => UserMessage(UserMessageData),
    "system.message" => SystemMessage(SystemMessageData),
    "assistant.turn_start" => AssistantTurnStart(TurnStartData),
    "assistant.turn_end" => AssistantTurnEnd(TurnEndData),
    "assistant.turn_retry" => AssistantTurnRetry(TurnRetryData),
    "assistant.message" => AssistantMessage(AssistantMessageData),
    "assistant.message_start" => AssistantMessageStart(MessageStartData),
    "assistant.message_delta" => AssistantMessageDelta(MessageDeltaData),
    "assistant.streaming_delta" => AssistantStreamingDelta(StreamingDeltaData),
    "assistant.tool_call_delta" => AssistantToolCallDelta(ToolCallDeltaData),
    "assistant.reasoning" => AssistantReasoning(ReasoningData),
    "assistant.reasoning_delta" => AssistantReasoningDelta(ReasoningDeltaData),
    "assistant.usage" => AssistantUsage(UsageData),
    "assistant.idle" => AssistantIdle(AssistantIdleData),
    "abort" => Abort(AbortData),
    "agent.interrupted" => AgentInterrupted(InterruptedData),
    "tool.execution_start" => ToolExecutionStart(ToolStartData),
    "tool.execution_partial_result" => ToolPartialResult(ToolPartialData),
    "tool.execution_progress" => ToolProgress(Raw),
    "tool.execution_complete" => ToolExecutionComplete(ToolCompleteData),
    "external_tool.requested" => ExternalToolRequested(ExternalToolRequestedData),
    "external_tool.completed" => ExternalToolCompleted(RequestIdData),
    "permission.requested" => PermissionRequested(PermissionRequestedData),
    "permission.completed" => PermissionCompleted(PermissionCompletedData),
    "user_input.requested" => UserInputRequested(Raw),
    "user_input.completed" => UserInputCompleted(Raw),
    "hook.start" => HookStart(HookStartData),
    "hook.end" => HookEnd(HookEndData),
}

/// Data of events this crate passes on without reading (any JSON object).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(transparent)]
pub struct Raw(pub serde_json::Map<String, Value>);

macro_rules! data {
    ($(#[$doc:meta])* $name:ident { $($(#[$fdoc:meta])* $field:ident : $ty:ty),* $(,)? }) => {
        $(#[$doc])*
        #[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
        #[serde(rename_all = "camelCase")]
        pub struct $name {
            $( $(#[$fdoc])* #[serde(default)] pub $field: $ty, )*
        }
    };
}

data!(
    /// `session.start`.
    SessionStartData {
        session_id: Option<String>,
        version: Option<Value>,
        producer: Option<String>,
        copilot_version: Option<String>,
        start_time: Option<String>,
        selected_model: Option<String>,
        /// Another process has this session attached (the runtime only reports it).
        already_in_use: Option<bool>,
    }
);
data!(
    /// `session.resume`.
    SessionResumeData {
        resume_time: Option<String>,
        event_count: Option<u64>,
        selected_model: Option<String>,
        /// Another process has this session attached (split brain risk).
        already_in_use: Option<bool>,
        session_was_active: Option<bool>,
    }
);
data!(
    /// `session.idle`: the end-of-work signal of a turn.
    SessionIdleData {
        /// The turn was aborted.
        aborted: Option<bool>,
    }
);
data!(
    /// `session.error`: the turn failed (precedes `session.idle`).
    SessionErrorData {
        error_type: Option<String>,
        message: String,
        error_code: Option<String>,
        status_code: Option<u16>,
    }
);
data!(
    /// `session.warning`.
    SessionNoticeData { warning_type: Option<String>, message: String }
);
data!(
    /// `session.info`.
    SessionInfoData { info_type: Option<String>, message: String }
);
data!(
    /// `session.title_changed`.
    TitleChangedData { title: String }
);
data!(
    /// `session.shutdown`.
    ShutdownData { shutdown_type: Option<String>, total_premium_requests: Option<f64>, total_api_duration_ms: Option<f64> }
);
data!(
    /// `session.usage_info`.
    UsageInfoData { token_limit: Option<u64>, current_tokens: Option<u64>, messages_length: Option<u64> }
);
data!(
    /// `session.compaction_start`.
    CompactionStartData { current_tokens: Option<u64>, trigger: Option<String> }
);
data!(
    /// `session.compaction_complete`.
    CompactionCompleteData {
        success: bool,
        messages_removed: Option<u64>,
        // Negative when the summary is longer than what it replaced (seen with short
        // histories).
        tokens_removed: Option<i64>,
        summary_content: Option<String>,
        /// What a compaction asked for (`session.history.compact`) was told to keep.
        custom_instructions: Option<String>,
    }
);
data!(
    /// `user.message`.
    UserMessageData { content: String, transformed_content: Option<String>, source: Option<String>, interaction_id: Option<String> }
);
data!(
    /// `system.message`.
    SystemMessageData { content: String, role: Option<String> }
);
data!(
    /// `assistant.turn_start`: one model call begins.
    TurnStartData { turn_id: String, model: Option<String>, interaction_id: Option<String> }
);
data!(
    /// `assistant.turn_end`: one model call ended.
    TurnEndData { turn_id: String, model: Option<String> }
);
data!(
    /// `assistant.turn_retry`.
    TurnRetryData { turn_id: Option<String>, model: Option<String>, reason: Option<String> }
);
data!(
    /// `assistant.message`: a complete assistant message.
    AssistantMessageData {
        message_id: String,
        content: String,
        tool_requests: Vec<ToolRequest>,
        model: Option<String>,
        interaction_id: Option<String>,
        turn_id: Option<String>,
        output_tokens: Option<u64>,
        reasoning_text: Option<String>,
    }
);
data!(
    /// A tool call inside an assistant message.
    ToolRequest { tool_call_id: String, name: String, arguments: Value, r#type: Option<String> }
);
data!(
    /// `assistant.message_start`.
    MessageStartData { message_id: String }
);
data!(
    /// `assistant.message_delta`.
    MessageDeltaData { message_id: String, delta_content: String }
);
data!(
    /// `assistant.streaming_delta`.
    StreamingDeltaData { total_response_size_bytes: Option<u64> }
);
data!(
    /// `assistant.tool_call_delta`.
    ToolCallDeltaData { tool_call_id: String, tool_name: Option<String>, input_delta: Option<String> }
);
data!(
    /// `assistant.reasoning`.
    ReasoningData { reasoning_id: String, content: String }
);
data!(
    /// `assistant.reasoning_delta`.
    ReasoningDeltaData { reasoning_id: String, delta_content: String }
);
data!(
    /// `assistant.usage`.
    UsageData {
        model: Option<String>,
        input_tokens: Option<u64>,
        output_tokens: Option<u64>,
        cache_read_tokens: Option<u64>,
        cache_write_tokens: Option<u64>,
        cost: Option<f64>,
        duration: Option<f64>,
    }
);
data!(
    /// `assistant.idle`.
    AssistantIdleData { aborted: Option<bool> }
);
data!(
    /// `abort`.
    AbortData { reason: Option<String> }
);
data!(
    /// `agent.interrupted`.
    InterruptedData { activity: Option<String>, elapsed_ms: Option<f64>, cancel_phase: Option<String>, tool_call_ids: Option<Vec<String>> }
);
data!(
    /// `tool.execution_start`.
    ToolStartData { tool_call_id: String, tool_name: String, arguments: Option<Value>, turn_id: Option<String> }
);
data!(
    /// `tool.execution_partial_result`.
    ToolPartialData { tool_call_id: String, partial_output: Option<String> }
);
data!(
    /// `tool.execution_complete`.
    ToolCompleteData { tool_call_id: String, success: bool, result: Option<Value>, error: Option<Value> }
);
data!(
    /// `external_tool.requested`: the model called a client tool; answer with
    /// `session.tools.handlePendingToolCall`.
    ExternalToolRequestedData {
        request_id: String,
        session_id: String,
        tool_call_id: String,
        tool_name: String,
        arguments: Value,
        working_directory: Option<String>,
    }
);
data!(
    /// `external_tool.completed` and other `{requestId}` events.
    RequestIdData { request_id: String }
);
data!(
    /// `permission.requested`: answer with `handlePendingPermissionRequest` unless resolved by a hook.
    PermissionRequestedData { request_id: String, permission_request: Value, resolved_by_hook: Option<bool> }
);
data!(
    /// `permission.completed`.
    PermissionCompletedData { request_id: String, tool_call_id: Option<String>, result: Option<Value> }
);
data!(
    /// `hook.start`.
    HookStartData { hook_invocation_id: String, hook_type: String }
);
data!(
    /// `hook.end`.
    HookEndData { hook_invocation_id: String, hook_type: String, success: Option<bool> }
);

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn decodes_known_events() {
        let ev = SessionEvent::from_value(json!({
            "id": "e1", "timestamp": "2026-01-01T00:00:00Z", "parentId": null, "type": "assistant.message",
            "data": {"messageId": "m1", "content": "hi", "toolRequests": [
                {"toolCallId": "c1", "name": "get", "arguments": {"k": 1}, "type": "function"}], "newField": 5}
        }));
        assert_eq!(ev.id(), "e1");
        assert_eq!(ev.event_type(), "assistant.message");
        let EventKind::AssistantMessage(m) = ev.kind else {
            panic!("{ev:?}")
        };
        assert_eq!(m.content, "hi");
        assert_eq!(m.tool_requests[0].name, "get");
        assert_eq!(m.tool_requests[0].arguments, json!({"k": 1}));
    }

    #[test]
    fn an_event_keeps_every_field_as_sent_for_passing_it_on() {
        let sent = json!({
            "id": "e1", "timestamp": "2026-01-01T00:00:00Z", "parentId": null, "type": "assistant.message",
            "data": {"messageId": "m1", "content": "hi", "newField": 5}, "newEnvelopeField": true
        });
        let ev = SessionEvent::from_value(sent.clone());
        assert_eq!(
            serde_json::from_str::<Value>(ev.raw().get()).expect("JSON"),
            sent
        );
        // What the crate models drops the unknown field; the raw event does not.
        assert!(ev.to_value()["data"].get("newField").is_none());
    }

    /// An event as the runtime writes it: `type` first, then `data`, then the rest.
    fn as_the_runtime_writes(event_type: &str, data: &str) -> Box<RawValue> {
        let text = format!(
            r#"{{"type":"{event_type}","data":{data},"id":"e7","timestamp":"2026-12-04T00:00:00.000Z","parentId":"e6","ephemeral":true,"agentId":"sub-1"}}"#
        );
        RawValue::from_string(text).expect("JSON")
    }

    #[test]
    fn an_untyped_event_as_the_runtime_writes_it_is_not_read_until_its_envelope_is_asked_for() {
        let ev = SessionEvent::from_raw(as_the_runtime_writes(
            "model.messages_snapshot",
            r#"{"messages":[{"role":"system","content":"a \"long\" prompt\n"}]}"#,
        ));
        assert_eq!(ev.event_type(), "model.messages_snapshot");
        assert!(ev.envelope.get().is_none(), "read too early: {ev:?}");
        // Asked for, it is what a full read gives.
        assert_eq!(ev.id(), "e7");
        assert_eq!(ev.timestamp(), Some("2026-12-04T00:00:00.000Z"));
        assert_eq!(ev.parent_id(), Some("e6"));
        assert!(ev.ephemeral());
        assert_eq!(ev.agent_id(), Some("sub-1"));
        assert_eq!(
            ev.data().map(RawValue::get),
            Some(r#"{"messages":[{"role":"system","content":"a \"long\" prompt\n"}]}"#)
        );
        let full = SessionEvent::from_value(serde_json::from_str(ev.raw().get()).expect("JSON"));
        assert_eq!(ev.to_value(), full.to_value());
    }

    #[test]
    fn a_typed_event_as_the_runtime_writes_it_is_read_whole_at_once() {
        let ev =
            SessionEvent::from_raw(as_the_runtime_writes("session.idle", r#"{"aborted":true}"#));
        assert_eq!(
            ev.kind,
            EventKind::SessionIdle(SessionIdleData {
                aborted: Some(true)
            })
        );
        assert!(ev.envelope.get().is_some());
        assert_eq!(ev.agent_id(), Some("sub-1"));
    }

    #[test]
    fn a_type_that_is_not_a_plain_string_first_is_read_whole() {
        // An escape in the type, the type not first, a typed event: each read in full.
        for text in [
            r#"{"type":"model.\u0063all","data":{},"id":"e"}"#,
            r#"{"id":"e","type":"model.call","data":{}}"#,
            r#"{ "type":"model.call","data":{},"id":"e"}"#,
        ] {
            let ev = SessionEvent::from_raw(RawValue::from_string(text.to_owned()).expect("JSON"));
            assert_eq!(ev.event_type(), "model.call", "{text}");
            assert!(ev.envelope.get().is_some(), "{text}");
            assert_eq!(ev.id(), "e");
        }
    }

    #[test]
    fn an_untyped_event_given_its_type_twice_takes_the_first_where_a_full_read_takes_the_last() {
        let text = r#"{"type":"model.call","data":{},"type":"session.idle"}"#;
        let ev = SessionEvent::from_raw(RawValue::from_string(text.to_owned()).expect("JSON"));
        assert_eq!(ev.event_type(), "model.call");
        assert_eq!(ev.to_value()["type"], "model.call");
        let typed = r#"{"type":"session.idle","data":{},"type":"model.call"}"#;
        let ev = SessionEvent::from_raw(RawValue::from_string(typed.to_owned()).expect("JSON"));
        assert_eq!(ev.event_type(), "model.call");
    }

    #[test]
    fn an_untyped_event_whose_envelope_does_not_read_keeps_its_type_and_its_text_as_data() {
        let text = r#"{"type":"model.call","data":{"x":1},"id":5}"#;
        let ev = SessionEvent::from_raw(RawValue::from_string(text.to_owned()).expect("JSON"));
        assert_eq!(ev.event_type(), "model.call");
        assert_eq!(ev.id(), "");
        assert_eq!(ev.data().map(RawValue::get), Some(text));
        // Its wire form reads the same way.
        let again = SessionEvent::from_value(ev.to_value());
        assert_eq!(
            (again.event_type(), &again.kind),
            (ev.event_type(), &ev.kind)
        );
    }

    #[test]
    fn idle_carries_aborted() {
        let ev = SessionEvent::from_value(
            json!({"id": "e", "type": "session.idle", "ephemeral": true, "data": {"aborted": true}}),
        );
        assert!(ev.ephemeral());
        assert_eq!(
            ev.kind,
            EventKind::SessionIdle(SessionIdleData {
                aborted: Some(true)
            })
        );
    }

    #[test]
    fn unknown_and_mismatched_events_are_kept_raw() {
        let ev = SessionEvent::from_value(
            json!({"id": "e", "type": "model.call_start", "data": {"x": 1}}),
        );
        assert_eq!(
            ev.kind,
            EventKind::Unknown {
                event_type: "model.call_start".into(),
            }
        );
        assert_eq!(ev.data().map(RawValue::get), Some(r#"{"x":1}"#));
        assert_eq!(ev.data_value(), json!({"x": 1}));
        assert_eq!(ev.to_value()["data"], json!({"x": 1}));
        // A known type with data of the wrong shape does not break decoding.
        let ev = SessionEvent::from_value(
            json!({"id": "e", "type": "assistant.message", "data": {"content": 5}}),
        );
        assert!(
            matches!(ev.kind, EventKind::Unknown { ref event_type, .. } if event_type == "assistant.message")
        );
        // Not even an object.
        let ev = SessionEvent::from_value(json!(17));
        assert!(
            matches!(ev.kind, EventKind::Unknown { ref event_type, .. } if event_type.is_empty())
        );
    }

    #[test]
    fn a_key_twice_counts_once_the_last_time_as_a_value_reads_it() {
        // In the data only (a tool request's `type`), then in the envelope too; the text is
        // kept as sent.
        let data = r#""data": {"messageId": "m", "content": "hi", "toolRequests": [{"toolCallId":
            "c", "name": "n", "type": "bash", "arguments": {}, "type": "function"}]}"#;
        for sent in [
            format!(r#"{{"id": "e", "type": "assistant.message", {data}}}"#),
            format!(
                r#"{{"id": "e", "type": "session.idle", "type": "assistant.message", {data}}}"#
            ),
        ] {
            let raw = RawValue::from_string(sent.clone()).expect("JSON");
            let ev = SessionEvent::from_raw(raw);
            let EventKind::AssistantMessage(message) = &ev.kind else {
                panic!("{sent}: {:?}", ev.kind)
            };
            assert_eq!(message.tool_requests[0].r#type.as_deref(), Some("function"));
            assert_eq!(ev.raw().get(), sent);
            assert_eq!(SessionEvent::from_value(ev.to_value()).kind, ev.kind);
        }
    }

    #[test]
    fn typed_event_list_has_field_names() {
        let events = typed_events();
        let (_, fields) = events
            .iter()
            .find(|(t, _)| *t == "external_tool.requested")
            .unwrap();
        assert!(
            fields.contains(&"requestId") && fields.contains(&"toolName"),
            "{fields:?}"
        );
    }
}
