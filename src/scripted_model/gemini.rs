//! The Gemini API (`POST …/models/<model>:generateContent` and
//! `…:streamGenerateContent?alt=sse`), as Gemini CLI calls it: reading a request into the
//! script's [`ChatRequest`] and rendering a [`Decision`] as one `GenerateContentResponse`
//! or as SSE `data:` chunks of them (`candidates[].content.parts[]` with `text` or
//! `functionCall`, `finishReason` and `usageMetadata` on the last chunk), failures as
//! Google's `{"error":{"code","message","status"}}`.
//!
//! Gemini CLI also makes JSON-mode side calls (the model router asks for an object matching
//! `generationConfig.responseJsonSchema`, e.g. `complexity_score` 1–100): those are answered
//! with an object filled from the schema ([`json_mode_answer`]), not by the script, and do
//! not take a queued reply. The CLI's own scaffolding in user content
//! (`<session_context>…</session_context>`) is not part of the user text the script reads.

use serde_json::{Map, Value, json};

use super::script::{ChatRequest, Decision};
use super::stream::{StreamFormat, ToolCall, calls_of};

/// The scaffolding block Gemini CLI puts in front of the first prompt of a session.
const SESSION_CONTEXT: (&str, &str) = ("<session_context>", "</session_context>");

/// What a string field of a JSON-mode answer holds.
const JSON_MODE_STRING: &str = "scripted";

/// Which Gemini method a path calls.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Method {
    /// `:generateContent`: one JSON document.
    Generate,
    /// `:streamGenerateContent`: SSE chunks with `?alt=sse` (the only way Gemini CLI asks).
    Stream,
}

/// The model and method of a `…/models/<model>:<method>` path, if it is one.
pub fn route(path: &str) -> Option<(&str, Method)> {
    let (before, method) = path.rsplit_once(':')?;
    let method = match method {
        "generateContent" => Method::Generate,
        "streamGenerateContent" => Method::Stream,
        _ => return None,
    };
    let (_, model) = before.rsplit_once("/models/")?;
    (!model.is_empty() && !model.contains('/')).then_some((model, method))
}

/// The per-request fields every response repeats.
#[derive(Debug, Clone)]
pub struct ContentMeta {
    /// `scripted-<n>`.
    pub response_id: String,
    /// The model named in the path.
    pub model: String,
}

/// Reads a `generateContent` body. Errors (a message for a 400) when the body is not an
/// object or has no `contents` array; everything else leniently. A last content made of
/// `functionResponse` parts reads as a tool answer.
pub fn parse(body: &Value, model: &str, method: Method) -> Result<ChatRequest, String> {
    let object = body
        .as_object()
        .ok_or_else(|| "request body must be a JSON object".to_owned())?;
    let contents = object
        .get("contents")
        .and_then(Value::as_array)
        .ok_or_else(|| "`contents` must be an array".to_owned())?;
    let last = contents.last();
    let responses = last.map(function_responses).unwrap_or_default();
    let last_user = contents
        .iter()
        .rev()
        .filter(|c| role(c) == "user" && function_responses(c).is_empty())
        .map(user_text)
        .find(|text| !text.is_empty());
    Ok(ChatRequest {
        model: Some(model.to_owned()),
        stream: method == Method::Stream,
        // A response always reports its usage.
        include_usage: true,
        last_role: if responses.is_empty() {
            last.map(|c| role(c).to_owned())
        } else {
            Some("tool".to_owned())
        },
        last_text: if responses.is_empty() {
            last.map(user_text).unwrap_or_default()
        } else {
            responses.join("\n")
        },
        last_user_text: last_user.unwrap_or_default(),
        tools: tool_names(object),
    })
}

/// A content's role (`user` when absent, as the API reads it).
fn role(content: &Value) -> &str {
    content
        .get("role")
        .and_then(Value::as_str)
        .unwrap_or("user")
}

fn parts(content: &Value) -> &[Value] {
    content
        .get("parts")
        .and_then(Value::as_array)
        .map(Vec::as_slice)
        .unwrap_or(&[])
}

/// The text parts of a content, `<session_context>` blocks removed, joined with newlines.
fn user_text(content: &Value) -> String {
    parts(content)
        .iter()
        .filter_map(|p| p.get("text").and_then(Value::as_str))
        .map(strip_session_context)
        .filter(|t| !t.is_empty())
        .collect::<Vec<_>>()
        .join("\n")
}

/// `text` without its `<session_context>…</session_context>` blocks, trimmed (an unclosed
/// block is left alone).
fn strip_session_context(text: &str) -> String {
    let (open, close) = SESSION_CONTEXT;
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(start) = rest.find(open) {
        let Some(len) = rest[start..].find(close) else {
            break;
        };
        out.push_str(&rest[..start]);
        rest = &rest[start + len + close.len()..];
    }
    out.push_str(rest);
    out.trim().to_owned()
}

/// What the content's `functionResponse` parts said: `response.output` (or `error`) when it
/// is a string, else the whole `response` as JSON. Empty when it has none.
fn function_responses(content: &Value) -> Vec<String> {
    parts(content)
        .iter()
        .filter_map(|p| p.get("functionResponse"))
        .map(|r| {
            let response = r.get("response").unwrap_or(&Value::Null);
            ["output", "error"]
                .iter()
                .find_map(|k| response.get(k).and_then(Value::as_str))
                .map(str::to_owned)
                .unwrap_or_else(|| response.to_string())
        })
        .collect()
}

/// The names of `tools[].functionDeclarations[]`.
fn tool_names(body: &Map<String, Value>) -> Vec<String> {
    body.get("tools")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .filter_map(|t| t.get("functionDeclarations").and_then(Value::as_array))
        .flatten()
        .filter_map(|d| d.get("name").and_then(Value::as_str))
        .map(str::to_owned)
        .collect()
}

/// The answer to a JSON-mode call (`generationConfig.responseMimeType` is
/// `application/json`, or a `responseJsonSchema` / `responseSchema` is given): an object
/// filled from the schema, as JSON text. `None` for an ordinary call.
pub fn json_mode_answer(body: &Value) -> Option<String> {
    let config = body.get("generationConfig")?;
    let schema = config
        .get("responseJsonSchema")
        .or_else(|| config.get("responseSchema"));
    let json_mime =
        config.get("responseMimeType").and_then(Value::as_str) == Some("application/json");
    if schema.is_none() && !json_mime {
        return None;
    }
    Some(fill_from_schema(schema.unwrap_or(&Value::Null)).to_string())
}

/// A value that matches `schema` (JSON Schema or the API's OpenAPI subset, type names in
/// either case): the first enum value; every property of an object; an empty array; `false`;
/// the lowest allowed number (1 when unbounded, so a 1–100 score is in range); a fixed string.
fn fill_from_schema(schema: &Value) -> Value {
    if let Some(first) = schema
        .get("enum")
        .and_then(Value::as_array)
        .and_then(|e| e.first())
    {
        return first.clone();
    }
    if let Some(first) = ["anyOf", "oneOf"].iter().find_map(|k| {
        schema
            .get(k)
            .and_then(Value::as_array)
            .and_then(|a| a.first())
    }) {
        return fill_from_schema(first);
    }
    let kind = schema
        .get("type")
        .and_then(Value::as_str)
        .map(str::to_ascii_lowercase)
        .unwrap_or_else(|| {
            if schema.get("properties").is_some() {
                "object".to_owned()
            } else {
                String::new()
            }
        });
    match kind.as_str() {
        "object" => Value::Object(
            schema
                .get("properties")
                .and_then(Value::as_object)
                .map(|props| {
                    props
                        .iter()
                        .map(|(k, v)| (k.clone(), fill_from_schema(v)))
                        .collect()
                })
                .unwrap_or_default(),
        ),
        "array" => json!([]),
        "boolean" => json!(false),
        "integer" => json!(schema.get("minimum").and_then(Value::as_i64).unwrap_or(1)),
        "number" => json!(schema.get("minimum").and_then(Value::as_f64).unwrap_or(1.0)),
        "null" => Value::Null,
        _ => json!(JSON_MODE_STRING),
    }
}

/// The fixed usage, in the API's names (`promptTokenCount` includes the cached tokens).
fn usage() -> Value {
    use super::ScriptedModel as M;
    json!({
        "promptTokenCount": M::PROMPT_TOKENS,
        "cachedContentTokenCount": M::CACHED_PROMPT_TOKENS,
        "candidatesTokenCount": M::COMPLETION_TOKENS,
        "totalTokenCount": M::PROMPT_TOKENS + M::COMPLETION_TOKENS,
    })
}

/// One `GenerateContentResponse` with `parts`; the last of an answer carries `finishReason`
/// and the usage.
fn response(meta: &ContentMeta, parts: Vec<Value>, last: bool) -> Value {
    let mut candidate = json!({
        "content": {"role": "model", "parts": parts},
        "index": 0,
    });
    let mut out = json!({
        "candidates": [],
        "modelVersion": meta.model,
        "responseId": meta.response_id,
    });
    if last {
        candidate["finishReason"] = json!("STOP");
        out["usageMetadata"] = usage();
    }
    out["candidates"] = json!([candidate]);
    out
}

fn call_parts(calls: &[ToolCall]) -> Vec<Value> {
    calls
        .iter()
        .map(|(id, name, args)| json!({"functionCall": {"id": id, "name": name, "args": args}}))
        .collect()
}

/// The non-streaming body for a text or tool-call decision.
pub fn response_body(meta: &ContentMeta, decision: &Decision) -> String {
    let parts = match calls_of(decision) {
        Some(calls) => call_parts(&calls),
        None => vec![json!({"text": decision.text().unwrap_or_default()})],
    };
    response(meta, parts, true).to_string()
}

/// Google's status name for an HTTP status.
fn status_name(status: u16) -> &'static str {
    match status {
        400 => "INVALID_ARGUMENT",
        401 => "UNAUTHENTICATED",
        403 => "PERMISSION_DENIED",
        404 => "NOT_FOUND",
        429 => "RESOURCE_EXHAUSTED",
        499 => "CANCELLED",
        503 => "UNAVAILABLE",
        504 => "DEADLINE_EXCEEDED",
        402 | 405..=428 | 430..=498 => "FAILED_PRECONDITION",
        _ => "INTERNAL",
    }
}

fn error_object(status: u16, message: &str) -> String {
    json!({"error": {"code": status, "message": message, "status": status_name(status)}})
        .to_string()
}

/// The error body for a scripted failure with `status`.
pub fn error_body(status: u16) -> String {
    error_object(status, "scripted upstream failure")
}

/// The error body for a request it cannot read (400).
pub fn invalid_request_body(message: &str) -> String {
    error_object(400, message)
}

/// The streaming chunks of one answer: SSE `data:` lines without event names. The last
/// piece of text is held back until the answer closes, so that the closing chunk carries
/// text together with `finishReason` and the usage (Gemini CLI drops chunks whose only part
/// is empty text).
#[derive(Debug)]
pub struct ContentStream {
    meta: ContentMeta,
    pending: Option<String>,
}

impl ContentStream {
    /// A stream for the answer `meta`.
    pub fn new(meta: ContentMeta) -> Self {
        Self {
            meta,
            pending: None,
        }
    }

    fn chunk(&self, parts: Vec<Value>, last: bool) -> String {
        format!("data: {}\n\n", response(&self.meta, parts, last))
    }
}

impl StreamFormat for ContentStream {
    fn open_text(&mut self) -> Vec<String> {
        Vec::new()
    }

    fn text(&mut self, piece: &str) -> Vec<String> {
        match self.pending.replace(piece.to_owned()) {
            Some(previous) => vec![self.chunk(vec![json!({"text": previous})], false)],
            None => Vec::new(),
        }
    }

    fn close_text(&mut self) -> Vec<String> {
        let last = self.pending.take().unwrap_or_default();
        vec![self.chunk(vec![json!({"text": last})], true)]
    }

    fn tool_calls(&mut self, calls: &[ToolCall]) -> Vec<String> {
        vec![self.chunk(call_parts(calls), true)]
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::scripted_model::stream::{drain, stream};

    fn meta() -> ContentMeta {
        ContentMeta {
            response_id: "scripted-1".into(),
            model: "gemini-2.5-pro".into(),
        }
    }

    /// The `data:` objects of an SSE body.
    fn data(body: &str) -> Vec<Value> {
        body.split("\n\n")
            .filter(|e| !e.is_empty())
            .map(|e| {
                let line = e.strip_prefix("data: ").expect("a data line");
                serde_json::from_str(line).expect("JSON")
            })
            .collect()
    }

    #[test]
    fn paths_name_the_model_and_the_method() {
        assert_eq!(
            route("/v1beta/models/gemini-2.5-pro:streamGenerateContent"),
            Some(("gemini-2.5-pro", Method::Stream))
        );
        assert_eq!(
            route("/v1beta/models/gemini-3.5-flash-lite:generateContent"),
            Some(("gemini-3.5-flash-lite", Method::Generate))
        );
        assert_eq!(route("/v1beta/models/m:countTokens"), None);
        assert_eq!(route("/v1/chat/completions"), None);
        assert_eq!(route("/v1beta/models/:generateContent"), None);
    }

    #[test]
    fn a_request_reads_the_prompt_without_the_session_context_and_the_offered_tools() {
        // The shape Gemini CLI 0.61.0 posts on a first turn.
        let body = json!({
            "contents": [{"role": "user", "parts": [
                {"text": "<session_context>\nThis is the Gemini CLI.\n</session_context>"},
                {"text": "REPLY=pong"}
            ]}],
            "systemInstruction": {"parts": [{"text": "You are Gemini CLI"}]},
            "tools": [{"functionDeclarations": [{"name": "read_file"}, {"name": "glob"}]}],
            "generationConfig": {"temperature": 1}
        });
        let request = parse(&body, "gemini-2.5-pro", Method::Stream).unwrap();
        assert_eq!(request.last_user_text, "REPLY=pong");
        assert_eq!(request.last_role.as_deref(), Some("user"));
        assert_eq!(request.tools, ["read_file", "glob"]);
        assert_eq!(request.model.as_deref(), Some("gemini-2.5-pro"));
        assert!(request.stream);
        assert!(parse(&json!({"contents": {}}), "m", Method::Generate).is_err());
        assert!(parse(&json!([]), "m", Method::Generate).is_err());
    }

    #[test]
    fn a_function_response_reads_as_the_tool_answer_and_the_prompt_before_it_stays_the_user_text() {
        let body = json!({"contents": [
            {"role": "user", "parts": [{"text": "SCENARIO:tool NAME=read_file"}]},
            {"role": "model", "parts": [{"functionCall": {"name": "read_file", "args": {}}}]},
            {"role": "user", "parts": [{"functionResponse": {
                "id": "c1", "name": "read_file", "response": {"output": "file body"}
            }}]}
        ]});
        let request = parse(&body, "m", Method::Generate).unwrap();
        assert_eq!(request.last_role.as_deref(), Some("tool"));
        assert_eq!(request.last_text, "file body");
        assert_eq!(request.last_user_text, "SCENARIO:tool NAME=read_file");
        assert!(!request.stream);
    }

    #[test]
    fn the_routers_json_mode_call_gets_an_object_filled_from_its_schema() {
        // The router call of Gemini CLI 0.61.0 (schema in the API's upper-case type names).
        let body = json!({
            "contents": [{"role": "user", "parts": [{"text": "hi"}]}],
            "generationConfig": {
                "responseMimeType": "application/json",
                "responseJsonSchema": {
                    "type": "OBJECT",
                    "properties": {
                        "complexity_reasoning": {"type": "STRING"},
                        "complexity_score": {"type": "INTEGER", "description": "1-100"},
                        "mode": {"type": "STRING", "enum": ["fast", "slow"]},
                        "flags": {"type": "ARRAY", "items": {"type": "STRING"}}
                    },
                    "required": ["complexity_reasoning", "complexity_score"]
                }
            }
        });
        let answer: Value = serde_json::from_str(&json_mode_answer(&body).unwrap()).unwrap();
        let score = answer["complexity_score"].as_i64().unwrap();
        assert!((1..=100).contains(&score), "{answer}");
        assert_eq!(answer["complexity_reasoning"], JSON_MODE_STRING);
        assert_eq!(answer["mode"], "fast");
        assert_eq!(answer["flags"], json!([]));
        let bounded = json!({"generationConfig": {"responseSchema": {
            "type": "object", "properties": {"n": {"type": "integer", "minimum": 5}}
        }}});
        assert_eq!(json_mode_answer(&bounded).unwrap(), r#"{"n":5}"#);
        let plain = json!({"generationConfig": {"temperature": 1}});
        assert_eq!(json_mode_answer(&plain), None);
        assert_eq!(json_mode_answer(&json!({})), None);
    }

    #[test]
    fn non_streaming_bodies_carry_the_text_or_the_function_call_and_errors_their_status() {
        let text: Value =
            serde_json::from_str(&response_body(&meta(), &Decision::Text("hi".into()))).unwrap();
        assert_eq!(text["candidates"][0]["content"]["parts"][0]["text"], "hi");
        assert_eq!(text["candidates"][0]["content"]["role"], "model");
        assert_eq!(text["candidates"][0]["finishReason"], "STOP");
        assert_eq!(text["usageMetadata"]["promptTokenCount"], 100);
        assert_eq!(text["usageMetadata"]["cachedContentTokenCount"], 40);
        let call = Decision::ToolCall {
            id: "call_1".into(),
            name: "read_file".into(),
            arguments: json!({"file_path": "a"}),
        };
        let tool: Value = serde_json::from_str(&response_body(&meta(), &call)).unwrap();
        let function = &tool["candidates"][0]["content"]["parts"][0]["functionCall"];
        assert_eq!(function["name"], "read_file");
        assert_eq!(function["args"]["file_path"], "a");
        let error: Value = serde_json::from_str(&error_body(429)).unwrap();
        assert_eq!(error["error"]["code"], 429);
        assert_eq!(error["error"]["status"], "RESOURCE_EXHAUSTED");
        let error: Value = serde_json::from_str(&error_body(500)).unwrap();
        assert_eq!(error["error"]["status"], "INTERNAL");
        let error: Value = serde_json::from_str(&error_body(418)).unwrap();
        assert_eq!(error["error"]["status"], "FAILED_PRECONDITION");
    }

    #[tokio::test]
    async fn a_stream_adds_up_to_the_text_and_only_its_last_chunk_finishes_with_the_usage() {
        let (_keep, shutdown) = tokio::sync::watch::channel(false);
        let chunks = data(
            &drain(stream(
                ContentStream::new(meta()),
                Decision::Text("a b c".into()),
                shutdown.clone(),
            ))
            .await,
        );
        assert_eq!(chunks.len(), 3, "{chunks:?}");
        let joined: String = chunks
            .iter()
            .filter_map(|c| c["candidates"][0]["content"]["parts"][0]["text"].as_str())
            .collect();
        assert_eq!(joined, "a b c");
        let (last, earlier) = chunks.split_last().unwrap();
        assert_eq!(last["candidates"][0]["finishReason"], "STOP");
        assert!(last["usageMetadata"].is_object());
        for chunk in earlier {
            assert!(chunk["candidates"][0].get("finishReason").is_none());
            assert!(chunk.get("usageMetadata").is_none());
        }
        let call = Decision::ToolCall {
            id: "call_2".into(),
            name: "glob".into(),
            arguments: json!({"pattern": "*"}),
        };
        let tool = data(&drain(stream(ContentStream::new(meta()), call, shutdown)).await);
        assert_eq!(tool.len(), 1);
        assert_eq!(
            tool[0]["candidates"][0]["content"]["parts"][0]["functionCall"]["args"]["pattern"],
            "*"
        );
        assert_eq!(tool[0]["candidates"][0]["finishReason"], "STOP");
    }
}
