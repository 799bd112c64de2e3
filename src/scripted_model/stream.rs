//! Streaming a [`Decision`] as server-sent events in a wire format that is not chat
//! completions (the OpenAI responses API, Anthropic messages): the format says which events
//! open the answer, carry a piece of text or the tool calls, and close it
//! ([`StreamFormat`]); [`stream`] runs the timing (slow chunks, floods, hangs) and stops
//! when the receiver is dropped or the model shuts down, as the chat-completions stream
//! does.

use std::time::Duration;

use serde_json::Value;
use tokio::sync::{mpsc, watch};

use super::openai::{SHUTDOWN_MESSAGE, hold_open, send_all, shut_down};
use super::script::{Decision, slow_chunk};
use crate::tunnel::BodyChunk;

/// Chunks buffered between a producing task and the transport.
const CHANNEL_CAPACITY: usize = 32;

/// One tool call of an answer: `(id, name, arguments)`.
pub type ToolCall = (String, String, Value);

/// The events of one wire format. Implementors keep what they need to close the answer
/// (the text so far) in `self`.
pub trait StreamFormat: Send + 'static {
    /// The events that open a text answer.
    fn open_text(&mut self) -> Vec<String>;
    /// The events of one piece of text.
    fn text(&mut self, piece: &str) -> Vec<String>;
    /// The events that close a text answer.
    fn close_text(&mut self) -> Vec<String>;
    /// Every event of an answer that calls `calls`.
    fn tool_calls(&mut self, calls: &[ToolCall]) -> Vec<String>;
}

/// An SSE event with a name: `event: <name>`, `data: <json>`, a blank line.
pub fn named_event(name: &str, data: &Value) -> String {
    format!("event: {name}\ndata: {data}\n\n")
}

/// The tool calls of a decision, if it calls tools.
pub fn calls_of(decision: &Decision) -> Option<Vec<ToolCall>> {
    match decision {
        Decision::ToolCall {
            id,
            name,
            arguments,
        } => Some(vec![(id.clone(), name.clone(), arguments.clone())]),
        Decision::ParallelToolCalls { calls } => Some(calls.clone()),
        _ => None,
    }
}

/// Streams `decision` in `format`. `Error` decisions are not streamed (the caller answers
/// them with a status); rendered here they produce an empty body.
pub fn stream<F: StreamFormat>(
    format: F,
    decision: Decision,
    shutdown: watch::Receiver<bool>,
) -> mpsc::Receiver<BodyChunk> {
    let (tx, rx) = mpsc::channel(CHANNEL_CAPACITY);
    tokio::spawn(produce(tx, format, decision, shutdown));
    rx
}

async fn produce<F: StreamFormat>(
    tx: mpsc::Sender<BodyChunk>,
    mut format: F,
    decision: Decision,
    mut shutdown: watch::Receiver<bool>,
) {
    if let Some(calls) = calls_of(&decision) {
        send_all(&tx, format.tool_calls(&calls)).await;
        return;
    }
    let sent = match decision {
        Decision::Text(text) => {
            let mut events = format.open_text();
            for (i, word) in text.split(' ').enumerate() {
                let piece = if i == 0 {
                    word.to_owned()
                } else {
                    format!(" {word}")
                };
                events.extend(format.text(&piece));
            }
            send_all(&tx, events).await
        }
        Decision::Flood { words } => {
            let opening = format.open_text();
            let mut events = Vec::with_capacity(words as usize + opening.len());
            events.extend(opening);
            for i in 0..words {
                let piece = if i == 0 {
                    "w0".to_owned()
                } else {
                    format!(" w{i}")
                };
                events.extend(format.text(&piece));
            }
            send_all(&tx, events).await
        }
        Decision::Slow { chunks, interval } => {
            send_slow(&tx, &mut format, chunks, interval, &mut shutdown).await
        }
        Decision::Hang => return hold_open(&tx, &mut shutdown).await,
        Decision::Error { .. }
        | Decision::RateLimited { .. }
        | Decision::ToolCall { .. }
        | Decision::ParallelToolCalls { .. } => {
            return;
        }
    };
    if sent {
        send_all(&tx, format.close_text()).await;
    }
}

/// One `slow-chunk <i> ` per `interval`; `false` when the receiver went away or the model
/// shut down (the body then ends with an error).
async fn send_slow<F: StreamFormat>(
    tx: &mpsc::Sender<BodyChunk>,
    format: &mut F,
    chunks: u32,
    interval: Duration,
    shutdown: &mut watch::Receiver<bool>,
) -> bool {
    if !send_all(tx, format.open_text()).await {
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
        if !send_all(tx, format.text(&slow_chunk(i))).await {
            return false;
        }
    }
    true
}

/// Parses a body of named SSE events (`event:` then `data:`) into `(name, data)` pairs;
/// for the format tests.
#[cfg(test)]
pub fn parse_named(body: &str) -> Vec<(String, Value)> {
    body.split("\n\n")
        .filter(|e| !e.is_empty())
        .map(|event| {
            let mut name = String::new();
            let mut data = Value::Null;
            for line in event.lines() {
                if let Some(n) = line.strip_prefix("event: ") {
                    name = n.to_owned();
                } else if let Some(d) = line.strip_prefix("data: ") {
                    data = serde_json::from_str(d).unwrap_or_else(|e| panic!("{d}: {e}"));
                }
            }
            (name, data)
        })
        .collect()
}

/// Drains a body into one string; for the format tests.
#[cfg(test)]
pub async fn drain(mut rx: mpsc::Receiver<BodyChunk>) -> String {
    let mut out = String::new();
    while let Some(chunk) = rx.recv().await {
        match chunk {
            Ok(text) => out.push_str(&text),
            Err(e) => panic!("body ended with an error: {e}"),
        }
    }
    out
}
