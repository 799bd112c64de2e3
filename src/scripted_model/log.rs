//! The scripted model's request log: every request it received and how it was answered.
//!
//! Tests read it with `ScriptedModel::requests` and wait on it with
//! `ScriptedModel::wait_for_requests` / `ScriptedModel::wait_until`, which are woken by a
//! [`tokio::sync::watch`] channel on every new entry (no polling, no sleeps).

use serde_json::Value;
use tokio::sync::watch;

use super::script::Decision;

/// How a request reached the model.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Transport {
    /// The loopback HTTP endpoint.
    Http,
    /// The JSON-RPC model tunnel (`ModelTunnel::serve`).
    Tunnel,
}

/// How the model answered a request.
#[derive(Debug, Clone, PartialEq)]
pub enum Answer {
    /// A chat-completions request, answered as decided (request number `n`, 1-based).
    Chat {
        /// The request's number among the chat requests this model served.
        number: u64,
        /// What was answered.
        decision: Decision,
    },
    /// `GET …/models`.
    ModelList,
    /// `HEAD` or `GET …/api/hello`: the reachability probe Claude Code sends first (200,
    /// empty body).
    Reachable,
    /// No such route (404).
    NotFound,
    /// A malformed chat-completions body (400), with the reason.
    BadRequest(String),
}

/// One request the model received.
#[derive(Debug, Clone, PartialEq)]
pub struct RecordedRequest {
    /// HTTP endpoint or tunnel.
    pub transport: Transport,
    /// HTTP method, as received.
    pub method: String,
    /// Path, without query.
    pub path: String,
    /// The query (after `?`), if any.
    pub query: Option<String>,
    /// The session id the tunnel reported, if any (always `None` over HTTP).
    pub session_id: Option<String>,
    /// The request's headers, names lower-cased, in the order received (the test keys of
    /// the scripted model's callers are in here: it is never on a production path).
    pub headers: Vec<(String, String)>,
    /// The body parsed as JSON; `Value::Null` when empty or not JSON.
    pub body: Value,
    /// How it was answered.
    pub answer: Answer,
}

impl RecordedRequest {
    /// The chat `messages` of the body (empty when there are none).
    pub fn messages(&self) -> &[Value] {
        self.body
            .get("messages")
            .and_then(Value::as_array)
            .map(Vec::as_slice)
            .unwrap_or(&[])
    }

    /// The values of header `name` (case-insensitive).
    pub fn header(&self, name: &str) -> Vec<&str> {
        self.headers
            .iter()
            .filter(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
            .collect()
    }

    /// The decision, when this was a chat-completions request.
    pub fn decision(&self) -> Option<&Decision> {
        match &self.answer {
            Answer::Chat { decision, .. } => Some(decision),
            _ => None,
        }
    }
}

/// The log itself: an append-only list behind a watch channel.
#[derive(Debug)]
pub struct RequestLog {
    entries: watch::Sender<Vec<RecordedRequest>>,
}

impl RequestLog {
    /// An empty log.
    pub fn new() -> Self {
        Self {
            entries: watch::Sender::new(Vec::new()),
        }
    }

    /// Appends one entry and wakes every waiter.
    pub fn push(&self, request: RecordedRequest) {
        self.entries.send_modify(|entries| entries.push(request));
    }

    /// A copy of every entry so far, oldest first.
    pub fn snapshot(&self) -> Vec<RecordedRequest> {
        self.entries.borrow().clone()
    }

    /// Every entry so far, oldest first, leaving the log empty.
    pub fn take(&self) -> Vec<RecordedRequest> {
        let mut taken = Vec::new();
        self.entries.send_if_modified(|entries| {
            taken = std::mem::take(entries);
            false
        });
        taken
    }

    /// Waits until `done` holds for the entries, then returns a copy of them.
    pub async fn wait_until(
        &self,
        done: impl FnMut(&[RecordedRequest]) -> bool,
    ) -> Vec<RecordedRequest> {
        let mut done = done;
        let mut rx = self.entries.subscribe();
        match rx.wait_for(|entries| done(entries)).await {
            Ok(entries) => entries.clone(),
            // Cannot happen: `self` owns the sender. Report what there is.
            Err(_) => self.snapshot(),
        }
    }
}

impl Default for RequestLog {
    fn default() -> Self {
        Self::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(path: &str) -> RecordedRequest {
        RecordedRequest {
            transport: Transport::Http,
            method: "GET".into(),
            path: path.into(),
            query: None,
            session_id: None,
            headers: Vec::new(),
            body: Value::Null,
            answer: Answer::NotFound,
        }
    }

    #[tokio::test]
    async fn waiters_wake_on_push() {
        let log = std::sync::Arc::new(RequestLog::new());
        let waiter = tokio::spawn({
            let log = log.clone();
            async move { log.wait_until(|e| e.len() >= 2).await }
        });
        log.push(entry("/a"));
        log.push(entry("/b"));
        let seen = waiter.await.unwrap();
        assert_eq!(
            seen.iter().map(|e| e.path.as_str()).collect::<Vec<_>>(),
            ["/a", "/b"]
        );
        assert_eq!(log.snapshot().len(), 2);
        assert!(log.snapshot()[0].messages().is_empty());
    }
}
