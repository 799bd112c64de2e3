//! The OpenAI responses API (`POST …/responses`): reading a request into the script's
//! [`ChatRequest`] and rendering a [`Decision`] as a `response` object or as its named SSE
//! events (`response.created`, `response.output_item.added`, `response.output_text.delta`,
//! …, `response.completed`), tool calls as `function_call` output items.

use serde_json::{Value, json};

use super::script::{ChatRequest, Decision, content_text, strip_datetime};
use super::stream::{StreamFormat, ToolCall, calls_of, named_event};

/// The per-request fields every response object repeats.
#[derive(Debug, Clone)]
pub struct ResponseMeta {
    /// `resp_scripted_<n>`.
    pub id: String,
    /// Unix seconds.
    pub created: u64,
    /// The model named in the request (or the scripted model's id).
    pub model: String,
}

/// Reads a responses-API body. Errors (a message for a 400) when the body is not an
/// object or its `input` is neither a string nor an array; everything else leniently.
pub fn parse(body: &Value) -> Result<ChatRequest, String> {
    let object = body
        .as_object()
        .ok_or_else(|| "request body must be a JSON object".to_owned())?;
    let items: Vec<Value> = match object.get("input") {
        Some(Value::String(text)) => vec![json!({"role": "user", "content": text})],
        Some(Value::Array(items)) => items.clone(),
        _ => return Err("`input` must be a string or an array".to_owned()),
    };
    let last = items.last();
    let last_is_output =
        last.and_then(|i| i.get("type")).and_then(Value::as_str) == Some("function_call_output");
    let last_user = items
        .iter()
        .rev()
        .find(|i| i.get("role").and_then(Value::as_str) == Some("user"));
    let tools = super::script::tool_names(object);
    Ok(ChatRequest {
        model: object
            .get("model")
            .and_then(Value::as_str)
            .map(str::to_owned),
        stream: object.get("stream").and_then(Value::as_bool) == Some(true),
        // A response always reports its usage.
        include_usage: true,
        last_role: if last_is_output {
            Some("tool".to_owned())
        } else {
            last.and_then(|i| i.get("role"))
                .and_then(Value::as_str)
                .map(str::to_owned)
        },
        last_text: match last {
            Some(item) if last_is_output => output_text(item.get("output")),
            Some(item) => content_text(item.get("content")),
            None => String::new(),
        },
        last_user_text: last_user
            .map(|m| strip_datetime(&content_text(m.get("content"))))
            .unwrap_or_default(),
        tools,
    })
}

/// A `function_call_output`'s `output`: a string, or content parts.
fn output_text(output: Option<&Value>) -> String {
    match output {
        Some(Value::String(text)) => text.clone(),
        other => content_text(other),
    }
}

/// The fixed usage, in the responses API's names.
fn usage() -> Value {
    use super::ScriptedModel as M;
    json!({
        "input_tokens": M::PROMPT_TOKENS,
        "input_tokens_details": {"cached_tokens": M::CACHED_PROMPT_TOKENS},
        "output_tokens": M::COMPLETION_TOKENS,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": M::PROMPT_TOKENS + M::COMPLETION_TOKENS,
    })
}

fn message_id(meta: &ResponseMeta) -> String {
    format!("msg_{}", meta.id)
}

fn message_item(meta: &ResponseMeta, text: &str, status: &str) -> Value {
    let content = if status == "completed" {
        json!([{"type": "output_text", "text": text, "annotations": []}])
    } else {
        json!([])
    };
    json!({
        "type": "message",
        "id": message_id(meta),
        "status": status,
        "role": "assistant",
        "content": content,
    })
}

/// A `function_call` output item; `arguments` is the JSON text so far.
fn call_item((id, name, _): &ToolCall, arguments: &str, status: &str) -> Value {
    let mut item = json!({
        "type": "function_call",
        "id": format!("fc_{id}"),
        "call_id": id,
        "name": name,
        "arguments": arguments,
        "status": status,
    });
    // A tool Codex offered inside a `namespace` (an MCP server's, `mcp__<server>`) is
    // called by its own name with the namespace beside it.
    if let Some(rest) = name.strip_prefix("mcp__")
        && let Some((server, tool)) = rest.split_once("__")
    {
        item["namespace"] = json!(format!("mcp__{server}"));
        item["name"] = json!(tool);
    }
    item
}

/// The `response` object with `output` and `status`.
fn response_object(meta: &ResponseMeta, output: Vec<Value>, status: &str) -> Value {
    let done = status == "completed";
    json!({
        "id": meta.id,
        "object": "response",
        "created_at": meta.created,
        "status": status,
        "error": null,
        "incomplete_details": null,
        "model": meta.model,
        "output": output,
        "parallel_tool_calls": true,
        "tool_choice": "auto",
        "tools": [],
        "usage": if done { usage() } else { Value::Null },
    })
}

/// The non-streaming `response` body for a text or tool-call decision.
pub fn response_body(meta: &ResponseMeta, decision: &Decision) -> String {
    let output = match calls_of(decision) {
        Some(calls) => calls
            .iter()
            .map(|call| call_item(call, &call.2.to_string(), "completed"))
            .collect(),
        None => vec![message_item(
            meta,
            &decision.text().unwrap_or_default(),
            "completed",
        )],
    };
    response_object(meta, output, "completed").to_string()
}

/// The OpenAI-style error body for a scripted failure with `status`.
pub fn error_body(status: u16) -> String {
    super::openai::error_body(status)
}

/// The streaming events of one response.
#[derive(Debug)]
pub struct ResponseStream {
    meta: ResponseMeta,
    sequence: u64,
    text: String,
}

impl ResponseStream {
    /// A stream for the response `meta`.
    pub fn new(meta: ResponseMeta) -> Self {
        Self {
            meta,
            sequence: 0,
            text: String::new(),
        }
    }

    fn event(&mut self, name: &str, mut data: Value) -> String {
        data["type"] = json!(name);
        data["sequence_number"] = json!(self.sequence);
        self.sequence += 1;
        named_event(name, &data)
    }

    fn opening(&mut self) -> Vec<String> {
        let created = response_object(&self.meta, Vec::new(), "in_progress");
        vec![
            self.event("response.created", json!({"response": created.clone()})),
            self.event("response.in_progress", json!({"response": created})),
        ]
    }

    fn completed(&mut self, output: Vec<Value>) -> String {
        let response = response_object(&self.meta, output, "completed");
        self.event("response.completed", json!({"response": response}))
    }
}

impl StreamFormat for ResponseStream {
    fn open_text(&mut self) -> Vec<String> {
        let mut events = self.opening();
        let item = message_item(&self.meta, "", "in_progress");
        let item_id = message_id(&self.meta);
        events.push(self.event(
            "response.output_item.added",
            json!({"output_index": 0, "item": item}),
        ));
        events.push(self.event(
            "response.content_part.added",
            json!({
                "item_id": item_id,
                "output_index": 0,
                "content_index": 0,
                "part": {"type": "output_text", "text": "", "annotations": []},
            }),
        ));
        events
    }

    fn text(&mut self, piece: &str) -> Vec<String> {
        self.text.push_str(piece);
        let item_id = message_id(&self.meta);
        vec![self.event(
            "response.output_text.delta",
            json!({"item_id": item_id, "output_index": 0, "content_index": 0, "delta": piece}),
        )]
    }

    fn close_text(&mut self) -> Vec<String> {
        let text = std::mem::take(&mut self.text);
        let item_id = message_id(&self.meta);
        let item = message_item(&self.meta, &text, "completed");
        vec![
            self.event(
                "response.output_text.done",
                json!({"item_id": item_id, "output_index": 0, "content_index": 0, "text": text}),
            ),
            self.event(
                "response.content_part.done",
                json!({
                    "item_id": item_id,
                    "output_index": 0,
                    "content_index": 0,
                    "part": {"type": "output_text", "text": text, "annotations": []},
                }),
            ),
            self.event(
                "response.output_item.done",
                json!({"output_index": 0, "item": item.clone()}),
            ),
            self.completed(vec![item]),
        ]
    }

    fn tool_calls(&mut self, calls: &[ToolCall]) -> Vec<String> {
        let mut events = self.opening();
        let mut output = Vec::with_capacity(calls.len());
        for (index, call) in calls.iter().enumerate() {
            let arguments = call.2.to_string();
            let item_id = format!("fc_{}", call.0);
            events.push(self.event(
                "response.output_item.added",
                json!({"output_index": index, "item": call_item(call, "", "in_progress")}),
            ));
            // The arguments in two halves, as a model streams them.
            let mut half = arguments.len() / 2;
            while !arguments.is_char_boundary(half) {
                half -= 1;
            }
            for piece in [&arguments[..half], &arguments[half..]] {
                events.push(self.event(
                    "response.function_call_arguments.delta",
                    json!({"item_id": item_id, "output_index": index, "delta": piece}),
                ));
            }
            events.push(self.event(
                "response.function_call_arguments.done",
                json!({"item_id": item_id, "output_index": index, "arguments": arguments}),
            ));
            let done = call_item(call, &arguments, "completed");
            events.push(self.event(
                "response.output_item.done",
                json!({"output_index": index, "item": done.clone()}),
            ));
            output.push(done);
        }
        events.push(self.completed(output));
        events
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_call_of_an_mcp_namespace_member_names_the_namespace_beside_the_tool() {
        let call = (
            "c1".to_owned(),
            "mcp__gateway__lookup".to_owned(),
            json!({}),
        );
        let item = call_item(&call, "{}", "completed");
        assert_eq!(item["namespace"], "mcp__gateway");
        assert_eq!(item["name"], "lookup");
        let plain = ("c2".to_owned(), "shell".to_owned(), json!({}));
        let item = call_item(&plain, "{}", "completed");
        assert_eq!(item["name"], "shell");
        assert!(item.get("namespace").is_none());
    }
    use crate::scripted_model::stream::{drain, parse_named, stream};

    fn meta() -> ResponseMeta {
        ResponseMeta {
            id: "resp_scripted_1".into(),
            created: 1,
            model: "scripted-model".into(),
        }
    }

    #[test]
    fn a_request_reads_its_last_user_text_tools_and_tool_outputs() {
        let body = json!({
            "model": "m",
            "instructions": "sys",
            "stream": true,
            "input": [
                {"role": "user", "content": [{"type": "input_text", "text": "<current_datetime>x</current_datetime>\nSCENARIO:tool"}]},
                {"type": "function_call", "call_id": "c1", "name": "t", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "c1", "output": "42"}
            ],
            "tools": [{"type": "function", "name": "t", "parameters": {}}]
        });
        let request = parse(&body).unwrap();
        assert!(request.stream && request.include_usage);
        assert_eq!(request.last_role.as_deref(), Some("tool"));
        assert_eq!(request.last_text, "42");
        assert_eq!(request.last_user_text, "SCENARIO:tool");
        assert_eq!(request.tools, ["t"]);
        assert_eq!(request.model.as_deref(), Some("m"));
        let plain = parse(&json!({"input": "hi"})).unwrap();
        assert_eq!(plain.last_user_text, "hi");
        assert!(parse(&json!({"input": 1})).is_err());
        assert!(parse(&json!([])).is_err());
    }

    #[test]
    fn non_streaming_bodies_carry_the_text_or_the_calls_and_the_usage() {
        let text: Value =
            serde_json::from_str(&response_body(&meta(), &Decision::Text("hi".into()))).unwrap();
        assert_eq!(text["status"], "completed");
        assert_eq!(text["output"][0]["content"][0]["text"], "hi");
        assert_eq!(text["usage"]["input_tokens"], 100);
        let call = Decision::ToolCall {
            id: "call_1".into(),
            name: "t".into(),
            arguments: json!({"k": "v"}),
        };
        let calls: Value = serde_json::from_str(&response_body(&meta(), &call)).unwrap();
        assert_eq!(calls["output"][0]["type"], "function_call");
        assert_eq!(calls["output"][0]["call_id"], "call_1");
        assert_eq!(calls["output"][0]["arguments"], r#"{"k":"v"}"#);
    }

    #[tokio::test]
    async fn a_streamed_text_adds_up_and_ends_with_the_completed_response() {
        let (_tx, shutdown) = watch_never();
        let body = drain(stream(
            ResponseStream::new(meta()),
            Decision::Text("one two three".into()),
            shutdown,
        ))
        .await;
        let events = parse_named(&body);
        let deltas: String = events
            .iter()
            .filter(|(n, _)| n == "response.output_text.delta")
            .filter_map(|(_, d)| d["delta"].as_str())
            .collect();
        assert_eq!(deltas, "one two three");
        let (last, data) = events.last().unwrap();
        assert_eq!(last, "response.completed");
        assert_eq!(
            data["response"]["output"][0]["content"][0]["text"],
            "one two three"
        );
        let numbers: Vec<u64> = events
            .iter()
            .map(|(_, d)| d["sequence_number"].as_u64().unwrap())
            .collect();
        assert_eq!(numbers, (0..events.len() as u64).collect::<Vec<_>>());
        assert!(events.iter().all(|(n, d)| d["type"] == n.as_str()));
    }

    #[tokio::test]
    async fn a_streamed_tool_call_adds_up_to_its_arguments() {
        let (_tx, shutdown) = watch_never();
        let decision = Decision::ToolCall {
            id: "call_7".into(),
            name: "lookup".into(),
            arguments: json!({"key": "alpha"}),
        };
        let events =
            parse_named(&drain(stream(ResponseStream::new(meta()), decision, shutdown)).await);
        let args: String = events
            .iter()
            .filter(|(n, _)| n == "response.function_call_arguments.delta")
            .filter_map(|(_, d)| d["delta"].as_str())
            .collect();
        assert_eq!(args, r#"{"key":"alpha"}"#);
        let (_, done) = events.last().unwrap();
        assert_eq!(done["response"]["output"][0]["name"], "lookup");
        assert_eq!(done["response"]["output"][0]["arguments"], args);
    }

    fn watch_never() -> (
        tokio::sync::watch::Sender<bool>,
        tokio::sync::watch::Receiver<bool>,
    ) {
        tokio::sync::watch::channel(false)
    }
}
