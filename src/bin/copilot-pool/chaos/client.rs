//! One chaos conversation, driven the way a gateway drives it: `POST /v1/turns` and the
//! turn's SSE stream read to its `turn.end`, with the client-side faults (abort, dropped
//! connection) it is told to make. Each prompt carries the conversation's and the turn's
//! marker, so the checks can find every turn in the model's requests.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::time::{Duration, Instant};

use eventsource_stream::Eventsource;
use futures_util::StreamExt;
use serde::Serialize;
use serde_json::{Value, json};

/// How a turn ended, as the client saw it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Ended {
    /// `turn.end` with this status (`idle`, `error`, `aborted`, `timeout`, `crashed`).
    Status(String),
    /// The daemon refused the turn with this HTTP status (e.g. 503 when a binding could not
    /// be written).
    Refused(u16),
    /// The SDK endpoint refused a call of the turn with this JSON-RPC error code.
    RpcRefused(i64),
    /// The client dropped its connection mid-stream on purpose.
    Dropped,
    /// The stream ended or failed without a `turn.end`.
    Broken(String),
    /// No end within the turn's limits: a hung turn.
    Hung,
}

/// One turn's record.
#[derive(Debug, Clone, Serialize)]
pub struct TurnRecord {
    pub turn: u32,
    pub ended: Ended,
    pub open_reason: Option<String>,
    pub millis: u64,
}

/// What the injector asks of a conversation's next turn.
#[derive(Debug, Default)]
pub struct ClientFaults {
    pub abort_next: AtomicBool,
    pub drop_next: AtomicBool,
}

impl ClientFaults {
    /// The faults the next turn makes, taken (each armed fault lands once): (abort, drop).
    /// An abort wins over a drop armed at the same time, which stays armed.
    pub fn take_next(&self) -> (bool, bool) {
        let abort = self.abort_next.swap(false, Ordering::SeqCst);
        let drop = !abort && self.drop_next.swap(false, Ordering::SeqCst);
        (abort, drop)
    }
}

/// How a conversation reaches the pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Via {
    /// `POST /v1/turns` and its SSE stream.
    Http,
    /// The SDK endpoint, as an official SDK attached by URL.
    Sdk,
}

/// A conversation's fixed parts.
pub struct Conversation {
    pub index: usize,
    pub via: Via,
    pub agent: String,
    pub key: String,
    pub faults: Arc<ClientFaults>,
    /// The agent's BYOK key version, bumped by a key rotation.
    pub key_version: Arc<AtomicU32>,
    /// The agent's GitHub token version (HTTP conversations), bumped by a token rotation:
    /// the token and its profile version change together, as a gateway's refresh does.
    pub token_version: Arc<AtomicU32>,
}

/// The marker of turn `turn` of conversation `index`, as it appears in the prompt.
pub fn marker(index: usize, turn: u32) -> String {
    format!("chaos-marker c{index}-t{turn}.")
}

/// The scripted model's instruction for a turn: a turn a client fault lands in streams for a
/// while (`slow`), so the fault meets it in flight.
pub fn scenario(slow: bool) -> &'static str {
    if slow {
        "SCENARIO:slow SLOW=12x100"
    } else {
        "REPLY=ok"
    }
}

/// Runs one turn; `limit` is the longest a turn may take before it counts as hung.
pub async fn run_turn(
    http: &reqwest::Client,
    addr: SocketAddr,
    model_url: &str,
    conversation: &Conversation,
    turn: u32,
    slow: bool,
    limit: Duration,
) -> TurnRecord {
    let (abort, drop) = conversation.faults.take_next();
    let scenario = scenario(slow || abort || drop);
    let version = conversation.key_version.load(Ordering::SeqCst);
    let token_version = conversation.token_version.load(Ordering::SeqCst);
    let body = json!({
        "agent_id": conversation.agent,
        "session_key": conversation.key,
        "prompt": format!("{}\n{scenario}", marker(conversation.index, turn)),
        "model": copilot_pool::scripted_model::ScriptedModel::MODEL_ID,
        "provider": {
            "type": "openai",
            "base_url": model_url,
            "api_key": format!("chaos-key-{}-v{version}", conversation.agent),
        },
        "auth": {
            "github_token": format!("ghu_chaos_{}_v{token_version}", conversation.agent),
            "profile_id": format!("chaos-{}", conversation.agent),
            "profile_version": format!("v{token_version}"),
        },
    });
    let started = Instant::now();
    let ended = tokio::time::timeout(
        limit,
        turn_stream(http, addr, conversation, body, abort, drop),
    )
    .await;
    let (ended, open_reason) = ended.unwrap_or((Ended::Hung, None));
    TurnRecord {
        turn,
        ended,
        open_reason,
        millis: started.elapsed().as_millis() as u64,
    }
}

async fn turn_stream(
    http: &reqwest::Client,
    addr: SocketAddr,
    conversation: &Conversation,
    body: Value,
    abort: bool,
    drop: bool,
) -> (Ended, Option<String>) {
    let response = match http
        .post(format!("http://{addr}/v1/turns"))
        .header(reqwest::header::CONTENT_TYPE, "application/json")
        .body(body.to_string())
        .send()
        .await
    {
        Ok(r) => r,
        Err(e) => return (Ended::Broken(format!("request: {e}")), None),
    };
    let status = response.status().as_u16();
    if status != 200 {
        return (Ended::Refused(status), None);
    }
    let mut events = response.bytes_stream().eventsource();
    let mut faulted = false;
    while let Some(event) = events.next().await {
        let event = match event {
            Ok(e) => e,
            Err(e) => return (Ended::Broken(format!("stream: {e}")), None),
        };
        if event.event == "turn.end" {
            let data: Value = serde_json::from_str(&event.data).unwrap_or(Value::Null);
            let status = data["status"].as_str().unwrap_or("unknown").to_owned();
            let reason = data["open_reason"].as_str().map(str::to_owned);
            return (Ended::Status(status), reason);
        }
        // The first streamed event shows the turn is in flight: the client fault lands now.
        if !faulted && event.event == "assistant.message_delta" {
            faulted = true;
            if drop {
                return (Ended::Dropped, None);
            }
            if abort {
                let path = format!(
                    "http://{addr}/v1/sessions/{}/{}/abort",
                    conversation.agent, conversation.key
                );
                if let Err(e) = http.post(path).send().await {
                    tracing::warn!(error = %e, "The chaos client's abort was not sent.");
                }
            }
        }
    }
    (
        Ended::Broken("the stream ended without turn.end".to_owned()),
        None,
    )
}
