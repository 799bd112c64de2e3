//! Rendering a [`Decision`] in the OpenAI chat-completions wire format.
//!
//! Non-streaming answers are one `chat.completion` JSON document. Streaming answers are a
//! sequence of SSE `data:` events produced by a spawned task into a
//! [`mpsc::Receiver<BodyChunk>`](crate::tunnel::BodyChunk), shared by the HTTP endpoint
//! and the JSON-RPC tunnel: a role chunk, one chunk per word of text (or the tool call split
//! in three deltas), a finish chunk, a usage chunk when asked for, then `data: [DONE]`. The
//! shape mirrors the `fake_openai.py` reference that was validated against the real runtime.
//!
//! Producing tasks stop as soon as the receiver is dropped (the client went away) and end
//! the body with an error when the model shuts down.

use std::time::Duration;

use serde_json::{Value, json};
use tokio::sync::{mpsc, watch};

use super::script::{Decision, slow_chunk};
use crate::tunnel::BodyChunk;

/// Chunks buffered between a producing task and the transport.
const CHANNEL_CAPACITY: usize = 32;

/// The message a body ends with when the model shuts down mid-answer.
pub const SHUTDOWN_MESSAGE: &str = "scripted model shut down";

pub use crate::chat_completion::Completion;
use crate::chat_completion::{chunk_event, closing_events, content_event, role_event};

/// The fixed token usage every answer reports.
pub(super) fn usage() -> Value {
    use super::ScriptedModel as M;
    json!({
        "prompt_tokens": M::PROMPT_TOKENS,
        "completion_tokens": M::COMPLETION_TOKENS,
        "total_tokens": M::PROMPT_TOKENS + M::COMPLETION_TOKENS,
        "prompt_tokens_details": {"cached_tokens": M::CACHED_PROMPT_TOKENS},
    })
}

/// The non-streaming `chat.completion` body for a text or tool-call decision. Errors and
/// hangs have no completion body; they render as an empty assistant message.
pub fn completion_body(completion: &Completion, decision: &Decision) -> String {
    let (message, finish) = match decision {
        Decision::ToolCall {
            id,
            name,
            arguments,
        } => (
            json!({
                "role": "assistant",
                "content": null,
                "tool_calls": [{
                    "id": id,
                    "type": "function",
                    "function": {"name": name, "arguments": arguments.to_string()},
                }],
            }),
            "tool_calls",
        ),
        Decision::ParallelToolCalls { calls } => (
            json!({
                "role": "assistant",
                "content": null,
                "tool_calls": calls.iter().map(|(id, name, arguments)| json!({
                    "id": id,
                    "type": "function",
                    "function": {"name": name, "arguments": arguments.to_string()},
                })).collect::<Vec<_>>(),
            }),
            "tool_calls",
        ),
        other => (
            json!({"role": "assistant", "content": other.text()}),
            "stop",
        ),
    };
    crate::chat_completion::body(completion, message, finish)
}

/// The OpenAI-style error body for a scripted failure with `status`.
pub fn error_body(status: u16) -> String {
    json!({"error": {
        "message": "scripted upstream failure",
        "type": "server_error",
        "code": format!("scripted_{status}"),
    }})
    .to_string()
}

/// An OpenAI-style client error body (`invalid_request_error`).
pub fn invalid_request_body(message: &str, code: &str) -> String {
    json!({"error": {"message": message, "type": "invalid_request_error", "code": code}})
        .to_string()
}

/// The `GET /models` list: one model, `model_id`.
pub fn models_body(model_id: &str) -> String {
    json!({
        "object": "list",
        "data": [{"id": model_id, "object": "model", "created": 0, "owned_by": "copilot-pool"}],
    })
    .to_string()
}

/// The text answer as content deltas, one per word (`w`, ` w`, …).
fn word_events(completion: &Completion, text: &str) -> Vec<String> {
    text.split(' ')
        .enumerate()
        .map(|(i, word)| {
            if i == 0 {
                content_event(completion, word)
            } else {
                content_event(completion, &format!(" {word}"))
            }
        })
        .collect()
}

/// The tool call as three deltas: id and name with empty arguments, then the arguments
/// JSON in two halves.
fn tool_call_events(
    completion: &Completion,
    id: &str,
    name: &str,
    arguments: &Value,
) -> Vec<String> {
    let args = arguments.to_string();
    let mut half = args.len() / 2;
    while !args.is_char_boundary(half) {
        half -= 1;
    }
    let (first, second) = args.split_at(half);
    let part = |piece: &str| {
        chunk_event(
            completion,
            json!({"tool_calls": [{"index": 0, "function": {"arguments": piece}}]}),
            None,
        )
    };
    vec![
        chunk_event(
            completion,
            json!({
                "role": "assistant",
                "content": null,
                "tool_calls": [{
                    "index": 0,
                    "id": id,
                    "type": "function",
                    "function": {"name": name, "arguments": ""},
                }],
            }),
            None,
        ),
        part(first),
        part(second),
    ]
}

/// Resolves once the model shuts down (flag set, or every sender dropped).
pub async fn shut_down(shutdown: &mut watch::Receiver<bool>) {
    // An error means the sender (the model) is gone: that is a shutdown too.
    let _ = shutdown.wait_for(|down| *down).await;
}

/// Streams `decision` as SSE events. `Error` decisions are not streamed (the caller answers
/// them with a status); rendered here they produce an empty body.
pub fn stream(
    completion: Completion,
    decision: Decision,
    shutdown: watch::Receiver<bool>,
) -> mpsc::Receiver<BodyChunk> {
    let (tx, rx) = mpsc::channel(CHANNEL_CAPACITY);
    tokio::spawn(produce(tx, completion, decision, shutdown));
    rx
}

/// A body that never yields and stays open until the model shuts down (then it ends with an
/// error) or the receiver is dropped.
pub fn hang(shutdown: watch::Receiver<bool>) -> mpsc::Receiver<BodyChunk> {
    let (tx, rx) = mpsc::channel(1);
    tokio::spawn(async move {
        let mut shutdown = shutdown;
        hold_open(&tx, &mut shutdown).await;
    });
    rx
}

/// Keeps the body open until the receiver is dropped or the model shuts down (then the
/// body ends with an error).
pub(super) async fn hold_open(tx: &mpsc::Sender<BodyChunk>, shutdown: &mut watch::Receiver<bool>) {
    tokio::select! {
        () = tx.closed() => {}
        () = shut_down(shutdown) => {
            let _ = tx.send(Err(SHUTDOWN_MESSAGE.to_owned())).await;
        }
    }
}

/// Sends every event in order; `false` when the receiver is gone.
pub(super) async fn send_all(
    tx: &mpsc::Sender<BodyChunk>,
    events: impl IntoIterator<Item = String>,
) -> bool {
    for event in events {
        if tx.send(Ok(event)).await.is_err() {
            return false;
        }
    }
    true
}

/// The producing task behind [`stream`].
async fn produce(
    tx: mpsc::Sender<BodyChunk>,
    completion: Completion,
    decision: Decision,
    mut shutdown: watch::Receiver<bool>,
) {
    let c = &completion;
    let (sent, finish) = match &decision {
        Decision::ToolCall {
            id,
            name,
            arguments,
        } => (
            send_all(&tx, tool_call_events(c, id, name, arguments)).await,
            "tool_calls",
        ),
        Decision::ParallelToolCalls { calls } => {
            let events: Vec<String> = calls
                .iter()
                .enumerate()
                .map(|(i, (id, name, arguments))| {
                    chunk_event(
                        c,
                        json!({
                            "role": "assistant",
                            "content": null,
                            "tool_calls": [{
                                "index": i,
                                "id": id,
                                "type": "function",
                                "function": {"name": name, "arguments": arguments.to_string()},
                            }],
                        }),
                        None,
                    )
                })
                .collect();
            (send_all(&tx, events).await, "tool_calls")
        }
        Decision::Text(text) => (
            send_all(
                &tx,
                std::iter::once(role_event(c)).chain(word_events(c, text)),
            )
            .await,
            "stop",
        ),
        Decision::Flood { words } => {
            let events = (0..*words).map(|i| {
                if i == 0 {
                    content_event(c, "w0")
                } else {
                    content_event(c, &format!(" w{i}"))
                }
            });
            (
                send_all(&tx, std::iter::once(role_event(c)).chain(events)).await,
                "stop",
            )
        }
        Decision::Slow { chunks, interval } => (
            send_slow(&tx, c, *chunks, *interval, &mut shutdown).await,
            "stop",
        ),
        Decision::Error { .. } | Decision::RateLimited { .. } => return,
        Decision::Hang => return hold_open(&tx, &mut shutdown).await,
    };
    if sent {
        send_all(&tx, closing_events(c, finish)).await;
    }
}

/// The slow text: one `slow-chunk <i> ` per `interval`. `false` when the receiver went
/// away or the model shut down (the body then ends with an error).
async fn send_slow(
    tx: &mpsc::Sender<BodyChunk>,
    completion: &Completion,
    chunks: u32,
    interval: Duration,
    shutdown: &mut watch::Receiver<bool>,
) -> bool {
    if !send_all(tx, [role_event(completion)]).await {
        return false;
    }
    for i in 0..chunks {
        if i > 0 {
            tokio::select! {
                () = tokio::time::sleep(interval) => {}
                () = tx.closed() => return false,
                () = shut_down(shutdown) => {
                    let _ = tx.send(Err(SHUTDOWN_MESSAGE.to_owned())).await;
                    return false;
                }
            }
        }
        if !send_all(tx, [content_event(completion, &slow_chunk(i))]).await {
            return false;
        }
    }
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    fn completion(include_usage: bool) -> Completion {
        Completion {
            id: "chatcmpl-scripted-1".into(),
            created: 1,
            model: "scripted-model".into(),
            include_usage,
            usage: usage(),
        }
    }

    /// Drains the body and parses every event; returns the JSON chunks and whether the
    /// last event was `[DONE]`.
    async fn drain(mut rx: mpsc::Receiver<BodyChunk>) -> (Vec<Value>, bool) {
        let mut chunks = Vec::new();
        let mut done = false;
        while let Some(event) = rx.recv().await {
            let event = event.unwrap();
            assert!(!done, "event after [DONE]: {event}");
            let data = event
                .strip_prefix("data: ")
                .and_then(|e| e.strip_suffix("\n\n"))
                .unwrap_or_else(|| panic!("not an SSE data event: {event:?}"));
            if data == "[DONE]" {
                done = true;
            } else {
                chunks.push(serde_json::from_str(data).unwrap());
            }
        }
        (chunks, done)
    }

    fn content_of(chunks: &[Value]) -> String {
        chunks
            .iter()
            .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
            .collect()
    }

    fn never_shut() -> watch::Receiver<bool> {
        let (tx, rx) = watch::channel(false);
        // Keep the sender alive for the whole test.
        std::mem::forget(tx);
        rx
    }

    #[tokio::test]
    async fn streamed_text_concatenates_to_the_text() {
        let text = "hello streaming  world, done.";
        let rx = stream(completion(true), Decision::Text(text.into()), never_shut());
        let (chunks, done) = drain(rx).await;
        assert!(done);
        assert_eq!(content_of(&chunks), text);
        assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
        // role + 5 words + finish + usage
        assert_eq!(chunks.len(), 8);
        assert_eq!(chunks[6]["choices"][0]["finish_reason"], "stop");
        assert_eq!(chunks[7]["usage"]["total_tokens"], 110);
        assert_eq!(chunks[7]["choices"], json!([]));
        assert!(
            chunks
                .iter()
                .all(|c| c["object"] == "chat.completion.chunk")
        );
    }

    #[tokio::test]
    async fn no_usage_chunk_unless_asked() {
        let (chunks, done) = drain(stream(
            completion(false),
            Decision::Text("a b".into()),
            never_shut(),
        ))
        .await;
        assert!(done);
        assert!(chunks.iter().all(|c| c.get("usage").is_none()));
        assert_eq!(chunks.len(), 4);
    }

    #[tokio::test]
    async fn streamed_tool_call_arguments_concatenate_to_json() {
        let arguments = json!({"command": "echo héllo", "list": [1, 2, 3]});
        let (chunks, done) = drain(stream(
            completion(false),
            Decision::ToolCall {
                id: "call_scripted_1".into(),
                name: "bash".into(),
                arguments: arguments.clone(),
            },
            never_shut(),
        ))
        .await;
        assert!(done);
        assert_eq!(chunks.len(), 4);
        let first = &chunks[0]["choices"][0]["delta"]["tool_calls"][0];
        assert_eq!(first["id"], "call_scripted_1");
        assert_eq!(first["function"]["name"], "bash");
        let args: String = chunks
            .iter()
            .filter_map(|c| {
                c["choices"][0]["delta"]["tool_calls"][0]["function"]["arguments"].as_str()
            })
            .collect();
        assert_eq!(serde_json::from_str::<Value>(&args).unwrap(), arguments);
        assert_eq!(chunks[3]["choices"][0]["finish_reason"], "tool_calls");
    }

    #[tokio::test]
    async fn flood_and_slow_stream_their_words() {
        let (chunks, _) = drain(stream(
            completion(false),
            Decision::Flood { words: 100 },
            never_shut(),
        ))
        .await;
        assert_eq!(
            content_of(&chunks),
            Decision::Flood { words: 100 }.text().unwrap()
        );
        let slow = Decision::Slow {
            chunks: 3,
            interval: Duration::from_millis(1),
        };
        let (chunks, done) = drain(stream(completion(false), slow.clone(), never_shut())).await;
        assert!(done);
        assert_eq!(
            content_of(&chunks),
            "slow-chunk 0 slow-chunk 1 slow-chunk 2 "
        );
        assert_eq!(content_of(&chunks), slow.text().unwrap());
    }

    #[tokio::test]
    async fn slow_stream_stops_with_error_on_shutdown() {
        let (down, rx) = watch::channel(false);
        let mut body = stream(
            completion(false),
            Decision::Slow {
                chunks: 1000,
                interval: Duration::from_secs(3600),
            },
            rx,
        );
        // role chunk and first slow chunk arrive right away
        assert!(body.recv().await.unwrap().unwrap().contains("\"role\""));
        assert!(
            body.recv()
                .await
                .unwrap()
                .unwrap()
                .contains("slow-chunk 0 ")
        );
        down.send_replace(true);
        assert_eq!(body.recv().await, Some(Err(SHUTDOWN_MESSAGE.to_owned())));
        assert_eq!(body.recv().await, None);
    }

    #[tokio::test]
    async fn hang_ends_when_model_is_dropped() {
        let (down, rx) = watch::channel(false);
        let mut body = hang(rx);
        assert!(body.try_recv().is_err());
        drop(down);
        assert_eq!(body.recv().await, Some(Err(SHUTDOWN_MESSAGE.to_owned())));
    }

    #[test]
    fn completion_bodies() {
        let text: Value = serde_json::from_str(&completion_body(
            &completion(false),
            &Decision::Text("hi there".into()),
        ))
        .unwrap();
        assert_eq!(text["object"], "chat.completion");
        assert_eq!(text["choices"][0]["message"]["content"], "hi there");
        assert_eq!(text["choices"][0]["finish_reason"], "stop");
        let tool: Value = serde_json::from_str(&completion_body(
            &completion(false),
            &Decision::ToolCall {
                id: "call_scripted_9".into(),
                name: "t".into(),
                arguments: json!({"k": "v"}),
            },
        ))
        .unwrap();
        let call = &tool["choices"][0]["message"]["tool_calls"][0];
        assert_eq!(call["id"], "call_scripted_9");
        assert_eq!(call["function"]["arguments"], "{\"k\":\"v\"}");
        assert_eq!(tool["choices"][0]["finish_reason"], "tool_calls");
        let error: Value = serde_json::from_str(&error_body(503)).unwrap();
        assert_eq!(error["error"]["code"], "scripted_503");
        assert_eq!(error["error"]["message"], "scripted upstream failure");
    }
}
