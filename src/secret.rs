//! A wrapper for tokens and API keys whose `Debug` and `Display` never show the value.
//!
//! The value is reachable only through [`Secret::expose`] and through `Serialize`, which
//! exists so the secret can be put on the wire to the CLI (a BYOK `apiKey`, a session
//! `gitHubToken`) — the only place it is needed. Never serialize a `Secret` into a log line,
//! a metric label or a file.

use std::fmt;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// A secret string (token, API key). Prints as `[redacted]`.
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(String);

impl Secret {
    /// Wraps a secret value.
    pub fn new(value: impl Into<String>) -> Self {
        Self(value.into())
    }

    /// The secret value, for the one place that must hand it on (the CLI's input).
    pub fn expose(&self) -> &str {
        &self.0
    }

    /// True when the secret is empty (treated as absent by callers).
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Secret([redacted])")
    }
}

impl fmt::Display for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("[redacted]")
    }
}

impl From<String> for Secret {
    fn from(value: String) -> Self {
        Self(value)
    }
}

impl From<&str> for Secret {
    fn from(value: &str) -> Self {
        Self(value.to_owned())
    }
}

impl Serialize for Secret {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(&self.0)
    }
}

impl<'de> Deserialize<'de> for Secret {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        String::deserialize(deserializer).map(Secret)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn debug_and_display_redact() {
        let s = Secret::new("ghp_supersecret");
        assert!(!format!("{s:?}").contains("supersecret"));
        assert!(!format!("{s}").contains("supersecret"));
        assert!(!format!("{:?}", Some(&s)).contains("supersecret"));
        assert_eq!(s.expose(), "ghp_supersecret");
    }

    #[test]
    fn serializes_the_value_for_the_wire() {
        let s = Secret::new("k");
        assert_eq!(serde_json::to_string(&s).unwrap(), "\"k\"");
    }
}
