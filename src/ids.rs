//! The identifiers a gateway handles, each its own type so one cannot stand in for another:
//!
//! * [`ConversationId`] — one conversation: an agent and the gateway's `session_key` for it.
//! * [`CliSessionId`] — the id the runtime gives the CLI session that holds a conversation's
//!   history (what bindings store and `session.resume` takes).
//!
//! The wire (`rpc::messages`) keeps the protocol's plain `sessionId` strings; these types
//! are what the library's own API speaks. [`sha256_hex`] turns a key into a file name.

use std::fmt;

use serde::{Deserialize, Serialize};

/// The lowercase hex SHA-256 of `text` (64 characters): a file name for a key that may hold
/// any character (a binding's, a conversation's attachments directory), and a token's hash.
pub fn sha256_hex(text: &str) -> String {
    use sha2::{Digest, Sha256};
    hex(&Sha256::digest(text.as_bytes()))
}

/// `bytes` as lowercase hex, two digits each (a digest, or the first bytes of one).
pub(crate) fn hex(bytes: &[u8]) -> String {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut out = String::with_capacity(bytes.len() * 2);
    for byte in bytes {
        out.push(char::from(DIGITS[usize::from(byte >> 4)]));
        out.push(char::from(DIGITS[usize::from(byte & 0x0f)]));
    }
    out
}

/// The prefix of the session keys of the SDK endpoint's sessions: an SDK session is the
/// conversation `(agent, "sdk:<session id>")`. The HTTP API refuses keys with this prefix, so
/// a conversation is either an HTTP conversation or an SDK session, never both.
pub const SDK_SESSION_KEY_PREFIX: &str = "sdk:";

/// One conversation: an agent and the gateway's key for it (two agents may use one key).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct ConversationId {
    /// The agent.
    pub agent_id: String,
    /// The gateway's key of the conversation.
    pub session_key: String,
}

impl ConversationId {
    /// The conversation of `agent_id` named `session_key`.
    pub fn new(agent_id: impl Into<String>, session_key: impl Into<String>) -> Self {
        Self {
            agent_id: agent_id.into(),
            session_key: session_key.into(),
        }
    }

    /// The pool's internal key (`<agent_id>/<session_key>`; agent ids contain no `/`).
    pub(crate) fn key(&self) -> String {
        self.to_string()
    }

    /// The agent id and the rest of a [`ConversationId::key`] (a CLI conversation's slot or
    /// binding key too: its session key is followed by its backend); `None` for text that
    /// is no such key.
    pub(crate) fn split_key(key: &str) -> Option<(&str, &str)> {
        key.split_once('/')
    }
}

impl fmt::Display for ConversationId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.agent_id, self.session_key)
    }
}

/// The runtime's id of a CLI session (a UUID when the pool creates it). Serialized as the
/// bare string, so binding files and JSON answers carry it exactly as before.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(transparent)]
pub struct CliSessionId(String);

impl CliSessionId {
    /// The id `id`, as the runtime spells it.
    pub fn new(id: impl Into<String>) -> Self {
        Self(id.into())
    }

    /// A fresh id for a session we create (ids are chosen by the client, so a route and a
    /// detach can name a session before the runtime answers).
    pub fn random() -> Self {
        Self(uuid::Uuid::new_v4().to_string())
    }

    /// The id as a string (for the wire and file names).
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The id as an owned string.
    pub fn into_string(self) -> String {
        self.0
    }
}

impl fmt::Display for CliSessionId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl AsRef<str> for CliSessionId {
    fn as_ref(&self) -> &str {
        &self.0
    }
}

impl From<String> for CliSessionId {
    fn from(id: String) -> Self {
        Self(id)
    }
}

impl From<&str> for CliSessionId {
    fn from(id: &str) -> Self {
        Self(id.to_owned())
    }
}

impl From<CliSessionId> for String {
    fn from(id: CliSessionId) -> Self {
        id.0
    }
}

impl PartialEq<str> for CliSessionId {
    fn eq(&self, other: &str) -> bool {
        self.0 == other
    }
}

impl PartialEq<&str> for CliSessionId {
    fn eq(&self, other: &&str) -> bool {
        self.0 == *other
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cli_session_id_serializes_as_the_bare_string() {
        let id = CliSessionId::new("0f1e-2d3c");
        assert_eq!(serde_json::to_value(&id).unwrap(), "0f1e-2d3c");
        let back: CliSessionId = serde_json::from_str("\"0f1e-2d3c\"").unwrap();
        assert_eq!(back, id);
        assert_eq!(id.to_string(), "0f1e-2d3c");
        assert_eq!(id, "0f1e-2d3c");
    }

    #[test]
    fn a_conversation_id_displays_as_agent_slash_key() {
        let id = ConversationId::new("agent-1", "chat/42");
        assert_eq!(id.to_string(), "agent-1/chat/42");
        assert_eq!(id.key(), "agent-1/chat/42");
    }
}
