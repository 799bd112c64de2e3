//! One chaos conversation driven through the SDK endpoint, the way a gateway built on an
//! official SDK drives it: a JSON-RPC connection authenticated with its agent's token,
//! `session.create` once and `session.resume` after every reconnect (a dropped connection, a
//! rotated key), then per turn `session.send` and the session's events read to `session.idle`,
//! with the client-side faults it is told to make (`session.abort` mid-turn, or the connection
//! dropped mid-turn).

use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use copilot_pool::rpc::{CloseCause, Connection, ConnectionOptions, Incoming, RpcError};
use copilot_pool::scripted_model::ScriptedModel;
use copilot_pool::sdk_endpoint::PROCESS_CRASHED;
use serde_json::{Value, json};
use tokio::sync::mpsc;

use super::client::{Conversation, Ended, TurnRecord, marker, scenario};

/// A conversation's client of the SDK endpoint; it keeps its connection between turns.
pub struct SdkClient {
    addr: SocketAddr,
    token: String,
    model_url: String,
    session_id: String,
    open: Option<Open>,
    /// Whether the next open is a resume (the session was created) or a create.
    created: bool,
}

/// A connection with the session open on it.
struct Open {
    conn: Connection,
    events: mpsc::UnboundedReceiver<Value>,
    /// The key version the session was opened with.
    version: u32,
}

impl Drop for Open {
    fn drop(&mut self) {
        self.conn.close(CloseCause::Local);
    }
}

impl SdkClient {
    pub fn new(addr: SocketAddr, token: String, model_url: String, index: usize) -> Self {
        SdkClient {
            addr,
            token,
            model_url,
            session_id: format!("chaos-sdk-{index}"),
            open: None,
            created: false,
        }
    }

    /// Runs one turn; `limit` is the longest a turn may take before it counts as hung.
    pub async fn run_turn(
        &mut self,
        conversation: &Conversation,
        turn: u32,
        slow: bool,
        limit: Duration,
    ) -> TurnRecord {
        let (abort, drop) = conversation.faults.take_next();
        let prompt = format!(
            "{}\n{}",
            marker(conversation.index, turn),
            scenario(slow || abort || drop)
        );
        let started = Instant::now();
        let ended = tokio::time::timeout(limit, self.turn(conversation, prompt, abort, drop))
            .await
            .unwrap_or(Ended::Hung);
        if !matches!(ended, Ended::Status(_)) {
            // Whatever broke, the next turn starts on a fresh connection.
            self.open = None;
        }
        TurnRecord {
            turn,
            ended,
            open_reason: None,
            millis: started.elapsed().as_millis() as u64,
        }
    }

    async fn turn(
        &mut self,
        conversation: &Conversation,
        prompt: String,
        abort: bool,
        drop: bool,
    ) -> Ended {
        let version = conversation.key_version.load(Ordering::SeqCst);
        // A rotated key is a reconnect that resumes with the new one.
        if self
            .open
            .as_ref()
            .is_some_and(|o| o.version != version || o.conn.close_cause().is_some())
        {
            self.open = None;
        }
        if self.open.is_none() {
            match self.reopen(conversation, version).await {
                Ok(open) => self.open = Some(open),
                Err(ended) => return ended,
            }
        }
        let Some(open) = self.open.as_mut() else {
            return Ended::Broken("no connection".to_owned());
        };
        // Late events of an earlier turn are not this turn's.
        while open.events.try_recv().is_ok() {}
        let sent = open
            .conn
            .request(
                "session.send",
                json!({"sessionId": self.session_id, "prompt": prompt}),
                None,
            )
            .await;
        if let Err(error) = sent {
            return refused_or_broken("session.send", error);
        }
        let (mut crashed, mut errored, mut faulted) = (false, false, false);
        while let Some(params) = open.events.recv().await {
            if params["sessionId"] != self.session_id.as_str() {
                continue;
            }
            let event = &params["event"];
            match event["type"].as_str().unwrap_or("") {
                "assistant.message_delta" if !faulted && (drop || abort) => {
                    faulted = true;
                    if drop {
                        self.open = None;
                        return Ended::Dropped;
                    }
                    let aborted = open
                        .conn
                        .request("session.abort", json!({"sessionId": self.session_id}), None)
                        .await;
                    if let Err(error) = aborted {
                        tracing::warn!(%error, "The chaos client's session.abort failed.");
                    }
                }
                "session.error" => {
                    if event["data"]["errorType"] == PROCESS_CRASHED {
                        crashed = true;
                    } else {
                        errored = true;
                    }
                }
                "session.idle" => {
                    let status = if event["data"]["aborted"] == true {
                        "aborted"
                    } else if crashed {
                        "crashed"
                    } else if errored {
                        "error"
                    } else {
                        "idle"
                    };
                    return Ended::Status(status.to_owned());
                }
                _ => {}
            }
        }
        Ended::Broken("the connection closed mid-turn".to_owned())
    }

    /// Connects, authenticates and opens the session: created the first time, resumed after.
    async fn reopen(&mut self, conversation: &Conversation, version: u32) -> Result<Open, Ended> {
        let stream = tokio::net::TcpStream::connect(self.addr)
            .await
            .map_err(|e| Ended::Broken(format!("connect: {e}")))?;
        let (read, write) = stream.into_split();
        let (events_tx, events) = mpsc::unbounded_channel();
        let sink = move |incoming| {
            if let Incoming::Notification { method, params } = incoming
                && method == "session.event"
            {
                let _ = events_tx.send(serde_json::from_str(params.get()).unwrap_or_default());
            }
        };
        let conn = Connection::start(read, write, ConnectionOptions::default(), Box::new(sink));
        let open = Open {
            conn,
            events,
            version,
        };
        open.conn
            .request("connect", json!({"token": self.token}), None)
            .await
            .map_err(|e| refused_or_broken("connect", e))?;
        let method = if self.created {
            "session.resume"
        } else {
            "session.create"
        };
        let params = json!({
            "sessionId": self.session_id,
            "model": ScriptedModel::MODEL_ID,
            "provider": {
                "type": "openai",
                "baseUrl": self.model_url,
                "apiKey": format!("chaos-key-{}-v{version}", conversation.agent),
            },
            "streaming": true,
        });
        match open.conn.request(method, params, None).await {
            Ok(_) => {
                self.created = true;
                Ok(open)
            }
            Err(error) => {
                // A create refused may still have made the session, a resume refused may
                // find none: the next open tries the other.
                self.created = !self.created;
                Err(refused_or_broken(method, error))
            }
        }
    }
}

/// An error answer is a refusal (the pool said no, e.g. a binding it could not write); a
/// transport failure is a broken stream.
fn refused_or_broken(method: &str, error: RpcError) -> Ended {
    match error {
        RpcError::Remote { error, .. } => {
            tracing::debug!(method, code = error.code, message = %error.message, "The SDK endpoint refused a chaos call.");
            Ended::RpcRefused(error.code)
        }
        other => Ended::Broken(format!("{method}: {other}")),
    }
}
