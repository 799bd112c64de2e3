//! What the tests of CLI backends through the daemon share: the scripted model on loopback
//! with a scratch directory for the daemon's state and the agents' homes ([`CliFixture`];
//! each test file adds its own daemon configuration and turn bodies in an `impl` of its
//! own), a streamed turn ([`streamed_turn`]), the user text of a model request
//! ([`user_text`]) and the refusal of a conversation whose CLI transcript is gone
//! ([`CliFixture::assert_transcript_missing`]).

use std::time::Duration;

use copilot_pool::scripted_model::{HttpEndpoint, RecordedRequest, ScriptedModel};
use serde_json::Value;

use super::Scratch;
use super::http::{Daemon, Sse, SseStream, call};

/// The scripted model, its endpoint, and a scratch directory.
pub struct CliFixture {
    pub model: ScriptedModel,
    pub endpoint: HttpEndpoint,
    pub scratch: Scratch,
}

impl CliFixture {
    pub async fn new() -> Self {
        let model = ScriptedModel::new();
        let endpoint = model.serve_http().await.expect("scripted model");
        Self {
            model,
            endpoint,
            scratch: Scratch::new(),
        }
    }
}

/// The user messages of a model request (text content, or its text blocks), joined: where
/// earlier turns and a prelude show up.
pub fn user_text(request: &RecordedRequest) -> String {
    request
        .messages()
        .iter()
        .filter(|m| m["role"] == "user")
        .map(|m| match &m["content"] {
            Value::String(text) => text.clone(),
            Value::Array(blocks) => blocks
                .iter()
                .filter_map(|b| b["text"].as_str())
                .collect::<Vec<_>>()
                .join("\n"),
            _ => String::new(),
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// Runs a streamed turn on `daemon`: its events and its `turn.end`, within `limit` (a
/// failure guard, not a wait).
pub async fn streamed_turn(daemon: &Daemon, body: &Value, limit: Duration) -> (Vec<Sse>, Value) {
    let run = async {
        let mut stream = SseStream::open(daemon.addr, "/v1/turns", None, body).await;
        assert_eq!(stream.status, 200, "the turn was accepted");
        stream.until_end().await
    };
    tokio::time::timeout(limit, run)
        .await
        .expect("the turn ended in time")
}

/// The events' names, in order.
pub fn event_names(events: &[Sse]) -> Vec<String> {
    events.iter().map(|e| e.event.clone()).collect()
}

/// Runs a streamed turn whose gateway tools the test answers: each `tool.call` with a
/// `request_id` is answered on `POST /v1/requests/{id}` with `answer(event data)`. Its
/// events and its `turn.end`, within `limit` (a failure guard, not a wait).
pub async fn streamed_tool_turn(
    daemon: &Daemon,
    body: &Value,
    answer: impl Fn(&Value) -> Value,
    limit: Duration,
) -> (Vec<Sse>, Value) {
    let run = async {
        let mut stream = SseStream::open(daemon.addr, "/v1/turns", None, body).await;
        assert_eq!(stream.status, 200, "the turn was accepted");
        let mut events = Vec::new();
        while let Some(event) = stream.next().await {
            if event.event == "turn.end" {
                let end = event.data.clone();
                events.push(event);
                return (events, end);
            }
            if event.event == "tool.call"
                && let Some(id) = event.data["request_id"]
                    .as_str()
                    .filter(|id| !id.is_empty())
            {
                let answered = super::http::call(
                    daemon.addr,
                    "POST",
                    &format!("/v1/requests/{id}"),
                    None,
                    Some(&answer(&event.data)),
                )
                .await;
                assert_eq!(answered.status, 204, "{}", answered.body);
            }
            events.push(event);
        }
        panic!("the stream ended without turn.end: {events:?}");
    };
    tokio::time::timeout(limit, run)
        .await
        .expect("the turn ended in time")
}

/// The `tool.call` events of a turn.
pub fn tool_calls(events: &[Sse]) -> Vec<Value> {
    events
        .iter()
        .filter(|e| e.event == "tool.call")
        .map(|e| e.data.clone())
        .collect()
}

impl CliFixture {
    /// A turn `body` on a conversation whose CLI transcript was deleted: refused with 409
    /// `transcript_missing` naming `session`, and its prompt never reached the model (never a
    /// silent fresh start).
    pub async fn assert_transcript_missing(&self, daemon: &Daemon, body: &Value, session: &str) {
        let refused = call(daemon.addr, "POST", "/v1/turns", None, Some(body)).await;
        assert_eq!(refused.status, 409, "{}", refused.body);
        assert_eq!(
            refused.json()["code"],
            "transcript_missing",
            "{}",
            refused.body
        );
        assert!(refused.body.contains(session), "{}", refused.body);
        let prompt = body["prompt"].as_str().expect("a prompt");
        assert!(
            !self
                .model
                .requests()
                .iter()
                .any(|r| r.body.to_string().contains(prompt)),
            "never a silent fresh start"
        );
    }
}
