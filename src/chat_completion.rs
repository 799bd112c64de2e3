//! The OpenAI chat-completions wire format, rendered: one `chat.completion` body, or the
//! `data:` events of a streamed answer (a `chat.completion.chunk` each, a usage chunk when
//! asked for, then `data: [DONE]`). What to answer is the caller's (the scripted model's
//! decisions, the model guard's answer to a priming call); the shape is here once.

use serde_json::{Value, json};

/// The per-answer fields every completion object repeats.
#[derive(Debug, Clone)]
pub struct Completion {
    /// The answer's id (`chatcmpl-…`).
    pub id: String,
    /// Unix seconds.
    pub created: u64,
    /// The model named in the request.
    pub model: String,
    /// Whether a streamed answer ends with a usage chunk.
    pub include_usage: bool,
    /// The `usage` object the answer reports.
    pub usage: Value,
}

/// The non-streaming `chat.completion` body: one choice with `message` and `finish`.
pub fn body(completion: &Completion, message: Value, finish: &str) -> String {
    json!({
        "id": completion.id,
        "object": "chat.completion",
        "created": completion.created,
        "model": completion.model,
        "choices": [{"index": 0, "message": message, "finish_reason": finish}],
        "usage": completion.usage,
    })
    .to_string()
}

/// One SSE event carrying a `chat.completion.chunk` with `delta` and `finish_reason`.
pub fn chunk_event(completion: &Completion, delta: Value, finish: Option<&str>) -> String {
    sse(&json!({
        "id": completion.id,
        "object": "chat.completion.chunk",
        "created": completion.created,
        "model": completion.model,
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
    }))
}

/// `data: <json>` plus the blank line that ends an SSE event.
fn sse(value: &Value) -> String {
    format!("data: {value}\n\n")
}

/// The role chunk that opens a text answer.
pub fn role_event(completion: &Completion) -> String {
    chunk_event(
        completion,
        json!({"role": "assistant", "content": ""}),
        None,
    )
}

/// One content delta.
pub fn content_event(completion: &Completion, content: &str) -> String {
    chunk_event(completion, json!({"content": content}), None)
}

/// The events after the answer itself: finish chunk, the usage chunk when asked for,
/// `[DONE]`.
pub fn closing_events(completion: &Completion, finish: &str) -> Vec<String> {
    let mut events = vec![chunk_event(completion, json!({}), Some(finish))];
    if completion.include_usage {
        events.push(sse(&json!({
            "id": completion.id,
            "object": "chat.completion.chunk",
            "created": completion.created,
            "model": completion.model,
            "choices": [],
            "usage": completion.usage,
        })));
    }
    events.push("data: [DONE]\n\n".to_owned());
    events
}
