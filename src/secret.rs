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

/// Whether an HTTP header may carry a credential (its value must not be printed).
pub fn is_sensitive_header(name: &str) -> bool {
    let name = name.to_ascii_lowercase();
    matches!(
        name.as_str(),
        "authorization" | "proxy-authorization" | "cookie" | "set-cookie"
    ) || ["key", "token", "secret", "auth", "password", "signature"]
        .iter()
        .any(|word| name.contains(word))
}

/// Formats headers for `Debug` with credential values replaced by `[redacted]`. Works for
/// `Vec<(String, String)>` and maps of name to value(s).
pub struct RedactedHeaders<'a, I: ?Sized>(pub &'a I);

impl<'a, I, T> fmt::Debug for RedactedHeaders<'a, I>
where
    I: ?Sized,
    &'a I: IntoIterator<Item = T>,
    T: HeaderPair,
{
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut list = f.debug_list();
        for pair in self.0 {
            let (name, value) = pair.parts();
            if is_sensitive_header(name) {
                list.entry(&(name, "[redacted]"));
            } else {
                list.entry(&(name, value));
            }
        }
        list.finish()
    }
}

/// A header entry seen through [`RedactedHeaders`].
pub trait HeaderPair {
    /// The name and a printable value.
    fn parts(&self) -> (&str, &dyn fmt::Debug);
}

impl HeaderPair for &(String, String) {
    fn parts(&self) -> (&str, &dyn fmt::Debug) {
        (&self.0, &self.1)
    }
}

impl<V: fmt::Debug> HeaderPair for (&String, &V) {
    fn parts(&self) -> (&str, &dyn fmt::Debug) {
        (self.0, self.1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sensitive_headers_are_redacted() {
        let headers = vec![
            ("Authorization".to_owned(), "Bearer sk-live".to_owned()),
            ("x-api-key".to_owned(), "k1".to_owned()),
            ("content-type".to_owned(), "application/json".to_owned()),
        ];
        let text = format!("{:?}", RedactedHeaders(&headers));
        assert!(!text.contains("sk-live") && !text.contains("k1"), "{text}");
        assert!(text.contains("application/json"), "{text}");
    }

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
