//! Anthropic messages (`POST …/v1/messages`): reading a request into the script's
//! [`ChatRequest`] and rendering a [`Decision`] as a `message` object or as its named SSE
//! events (`message_start`, `content_block_start`, `content_block_delta`,
//! `content_block_stop`, `message_delta`, `message_stop`), tool calls as `tool_use`
//! blocks, failures as Anthropic's `{"type":"error","error":{…}}`.

use serde_json::{Value, json};

use super::script::{ChatRequest, Decision, content_text, strip_datetime};
use super::stream::{StreamFormat, ToolCall, calls_of, named_event};

/// The per-request fields every message object repeats.
#[derive(Debug, Clone)]
pub struct MessageMeta {
    /// `msg_scripted_<n>`.
    pub id: String,
    /// The model named in the request (or the scripted model's id).
    pub model: String,
}

/// Reads a messages body. Errors (a message for a 400) when the body is not an object or
/// has no `messages` array; everything else leniently. A last user message made of
/// `tool_result` blocks reads as a tool answer.
pub fn parse(body: &Value) -> Result<ChatRequest, String> {
    let object = body
        .as_object()
        .ok_or_else(|| "request body must be a JSON object".to_owned())?;
    let messages = object
        .get("messages")
        .and_then(Value::as_array)
        .ok_or_else(|| "`messages` must be an array".to_owned())?;
    let last = messages.last();
    let results = last.map(tool_results).unwrap_or_default();
    let last_user = messages.iter().rev().find(|m| {
        m.get("role").and_then(Value::as_str) == Some("user") && tool_results(m).is_empty()
    });
    let tools = super::script::tool_names(object);
    Ok(ChatRequest {
        model: object
            .get("model")
            .and_then(Value::as_str)
            .map(str::to_owned),
        stream: object.get("stream").and_then(Value::as_bool) == Some(true),
        // A message always reports its usage.
        include_usage: true,
        last_role: if results.is_empty() {
            last.and_then(|m| m.get("role"))
                .and_then(Value::as_str)
                .map(str::to_owned)
        } else {
            Some("tool".to_owned())
        },
        last_text: if results.is_empty() {
            last.map(|m| content_text(m.get("content")))
                .unwrap_or_default()
        } else {
            results.join("\n")
        },
        last_user_text: last_user
            .map(|m| strip_datetime(&content_text(m.get("content"))))
            .unwrap_or_default(),
        tools,
    })
}

/// The texts of a message's `tool_result` blocks (empty when it has none).
fn tool_results(message: &Value) -> Vec<String> {
    message
        .get("content")
        .and_then(Value::as_array)
        .map(|blocks| {
            blocks
                .iter()
                .filter(|b| b.get("type").and_then(Value::as_str) == Some("tool_result"))
                .map(|b| match b.get("content") {
                    Some(Value::String(text)) => text.clone(),
                    other => content_text(other),
                })
                .collect()
        })
        .unwrap_or_default()
}

/// The fixed usage, in Anthropic's names (`input_tokens` excludes the cache reads).
fn usage() -> Value {
    use super::ScriptedModel as M;
    json!({
        "input_tokens": M::PROMPT_TOKENS - M::CACHED_PROMPT_TOKENS,
        "cache_read_input_tokens": M::CACHED_PROMPT_TOKENS,
        "cache_creation_input_tokens": 0,
        "output_tokens": M::COMPLETION_TOKENS,
    })
}

fn message_object(meta: &MessageMeta, content: Vec<Value>, stop: Option<&str>) -> Value {
    json!({
        "id": meta.id,
        "type": "message",
        "role": "assistant",
        "model": meta.model,
        "content": content,
        "stop_reason": stop,
        "stop_sequence": null,
        "usage": usage(),
    })
}

/// The non-streaming `message` body for a text or tool-call decision.
pub fn message_body(meta: &MessageMeta, decision: &Decision) -> String {
    let (content, stop) = match calls_of(decision) {
        Some(calls) => (
            calls
                .iter()
                .map(|(id, name, input)| {
                    json!({"type": "tool_use", "id": id, "name": name, "input": input})
                })
                .collect(),
            "tool_use",
        ),
        None => (
            vec![json!({"type": "text", "text": decision.text().unwrap_or_default()})],
            "end_turn",
        ),
    };
    message_object(meta, content, Some(stop)).to_string()
}

/// Anthropic's error body for a scripted failure with `status`.
pub fn error_body(status: u16) -> String {
    let kind = match status {
        429 => "rate_limit_error",
        529 => "overloaded_error",
        400..=499 => "invalid_request_error",
        _ => "api_error",
    };
    json!({"type": "error", "error": {"type": kind, "message": "scripted upstream failure"}})
        .to_string()
}

/// Anthropic's error body for a request it cannot read.
pub fn invalid_request_body(message: &str) -> String {
    json!({"type": "error", "error": {"type": "invalid_request_error", "message": message}})
        .to_string()
}

/// The streaming events of one message.
#[derive(Debug)]
pub struct MessageStream {
    meta: MessageMeta,
}

impl MessageStream {
    /// A stream for the message `meta`.
    pub fn new(meta: MessageMeta) -> Self {
        Self { meta }
    }

    fn event(name: &str, mut data: Value) -> String {
        data["type"] = json!(name);
        named_event(name, &data)
    }

    fn start(&self) -> String {
        let mut message = message_object(&self.meta, Vec::new(), None);
        message["usage"]["output_tokens"] = json!(1);
        Self::event("message_start", json!({"message": message}))
    }

    fn stop(stop_reason: &str) -> Vec<String> {
        use super::ScriptedModel as M;
        vec![
            Self::event(
                "message_delta",
                json!({
                    "delta": {"stop_reason": stop_reason, "stop_sequence": null},
                    "usage": {"output_tokens": M::COMPLETION_TOKENS},
                }),
            ),
            Self::event("message_stop", json!({})),
        ]
    }
}

impl StreamFormat for MessageStream {
    fn open_text(&mut self) -> Vec<String> {
        vec![
            self.start(),
            Self::event(
                "content_block_start",
                json!({"index": 0, "content_block": {"type": "text", "text": ""}}),
            ),
            Self::event("ping", json!({})),
        ]
    }

    fn text(&mut self, piece: &str) -> Vec<String> {
        vec![Self::event(
            "content_block_delta",
            json!({"index": 0, "delta": {"type": "text_delta", "text": piece}}),
        )]
    }

    fn close_text(&mut self) -> Vec<String> {
        let mut events = vec![Self::event("content_block_stop", json!({"index": 0}))];
        events.extend(Self::stop("end_turn"));
        events
    }

    fn tool_calls(&mut self, calls: &[ToolCall]) -> Vec<String> {
        let mut events = vec![self.start()];
        for (index, (id, name, input)) in calls.iter().enumerate() {
            events.push(Self::event(
                "content_block_start",
                json!({
                    "index": index,
                    "content_block": {"type": "tool_use", "id": id, "name": name, "input": {}},
                }),
            ));
            // The input JSON in two halves, as the model streams it.
            let text = input.to_string();
            let mut half = text.len() / 2;
            while !text.is_char_boundary(half) {
                half -= 1;
            }
            for piece in [&text[..half], &text[half..]] {
                events.push(Self::event(
                    "content_block_delta",
                    json!({"index": index, "delta": {"type": "input_json_delta", "partial_json": piece}}),
                ));
            }
            events.push(Self::event("content_block_stop", json!({"index": index})));
        }
        events.extend(Self::stop("tool_use"));
        events
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::scripted_model::stream::{drain, parse_named, stream};

    fn meta() -> MessageMeta {
        MessageMeta {
            id: "msg_scripted_1".into(),
            model: "scripted-model".into(),
        }
    }

    #[test]
    fn a_request_reads_its_last_user_text_tools_and_tool_results() {
        let body = json!({
            "model": "m",
            "max_tokens": 100,
            "system": "sys",
            "messages": [
                {"role": "user", "content": [{"type": "text", "text": "SCENARIO:tool"}]},
                {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "t", "input": {}}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": [{"type": "text", "text": "42"}]}]}
            ],
            "tools": [{"name": "t", "input_schema": {}}]
        });
        let request = parse(&body).unwrap();
        assert_eq!(request.last_role.as_deref(), Some("tool"));
        assert_eq!(request.last_text, "42");
        assert_eq!(request.last_user_text, "SCENARIO:tool");
        assert_eq!(request.tools, ["t"]);
        let plain =
            parse(&json!({"messages": [{"role": "user", "content": "hi"}], "stream": true}))
                .unwrap();
        assert!(plain.stream);
        assert_eq!(plain.last_role.as_deref(), Some("user"));
        assert_eq!(plain.last_user_text, "hi");
        assert!(parse(&json!({"model": "m"})).is_err());
    }

    #[test]
    fn non_streaming_bodies_carry_the_text_or_the_tool_use_and_errors_their_type() {
        let text: Value =
            serde_json::from_str(&message_body(&meta(), &Decision::Text("hi".into()))).unwrap();
        assert_eq!(text["content"][0]["text"], "hi");
        assert_eq!(text["stop_reason"], "end_turn");
        let call = Decision::ToolCall {
            id: "call_1".into(),
            name: "t".into(),
            arguments: json!({"k": "v"}),
        };
        let tool: Value = serde_json::from_str(&message_body(&meta(), &call)).unwrap();
        assert_eq!(tool["content"][0]["type"], "tool_use");
        assert_eq!(tool["content"][0]["input"]["k"], "v");
        assert_eq!(tool["stop_reason"], "tool_use");
        let error: Value = serde_json::from_str(&error_body(500)).unwrap();
        assert_eq!(error["error"]["type"], "api_error");
        let error: Value = serde_json::from_str(&error_body(429)).unwrap();
        assert_eq!(error["error"]["type"], "rate_limit_error");
    }

    #[tokio::test]
    async fn streams_add_up_to_the_text_and_the_tool_input() {
        let (_keep, shutdown) = tokio::sync::watch::channel(false);
        let text = parse_named(
            &drain(stream(
                MessageStream::new(meta()),
                Decision::Text("a b c".into()),
                shutdown.clone(),
            ))
            .await,
        );
        let names: Vec<&str> = text.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(names.first(), Some(&"message_start"));
        assert_eq!(names.last(), Some(&"message_stop"));
        let joined: String = text
            .iter()
            .filter_map(|(_, d)| d["delta"]["text"].as_str())
            .collect();
        assert_eq!(joined, "a b c");
        let call = Decision::ToolCall {
            id: "call_2".into(),
            name: "lookup".into(),
            arguments: json!({"key": "alpha"}),
        };
        let tool = parse_named(&drain(stream(MessageStream::new(meta()), call, shutdown)).await);
        let input: String = tool
            .iter()
            .filter_map(|(_, d)| d["delta"]["partial_json"].as_str())
            .collect();
        assert_eq!(input, r#"{"key":"alpha"}"#);
        assert!(
            tool.iter()
                .any(|(n, d)| n == "message_delta" && d["delta"]["stop_reason"] == "tool_use")
        );
        assert!(tool.iter().all(|(n, d)| d["type"] == n.as_str()));
    }
}
