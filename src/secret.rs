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
        // `any`, so a number reaches the visitor (serde_json's `deserialize_string` builds
        // its "invalid type" error, value and all, itself).
        deserializer.deserialize_any(SecretVisitor)
    }
}

/// Reads a secret's string. Anything else is refused without its value: serde's own
/// "invalid type" error quotes it (`integer \`12345\``), and a token written unquoted
/// would reach the error, and the log or the answer that carries it.
struct SecretVisitor;

impl SecretVisitor {
    fn not_a_string<E: serde::de::Error>(kind: &str) -> E {
        E::custom(format_args!(
            "invalid type: {kind}, expected a string (a secret is written in quotes; its value \
             is not shown)"
        ))
    }
}

impl serde::de::Visitor<'_> for SecretVisitor {
    type Value = Secret;

    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("a string")
    }

    fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<Secret, E> {
        Ok(Secret(v.to_owned()))
    }

    fn visit_string<E: serde::de::Error>(self, v: String) -> Result<Secret, E> {
        Ok(Secret(v))
    }

    fn visit_bool<E: serde::de::Error>(self, _: bool) -> Result<Secret, E> {
        Err(Self::not_a_string("a boolean"))
    }

    fn visit_i64<E: serde::de::Error>(self, _: i64) -> Result<Secret, E> {
        Err(Self::not_a_string("an integer"))
    }

    fn visit_u64<E: serde::de::Error>(self, _: u64) -> Result<Secret, E> {
        Err(Self::not_a_string("an integer"))
    }

    fn visit_f64<E: serde::de::Error>(self, _: f64) -> Result<Secret, E> {
        Err(Self::not_a_string("a number"))
    }

    fn visit_bytes<E: serde::de::Error>(self, _: &[u8]) -> Result<Secret, E> {
        Err(Self::not_a_string("bytes"))
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

/// Formats a base URL for `Debug` without its query or user info, which may hold a key (an
/// Azure Functions `?code=`, a SAS signature under a name that does not look like one):
/// `https://host/path?[redacted]`. Works for `String` and `Option<String>`.
pub struct RedactedUrl<'a, U: ?Sized>(pub &'a U);

impl fmt::Debug for RedactedUrl<'_, str> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Read as the guard and the CLIs read it; what does not parse is not shown at all.
        let Ok(mut url) = url::Url::parse(self.0) else {
            return f.write_str("\"[redacted: not a URL]\"");
        };
        if url.query().is_some() {
            url.set_query(Some("[redacted]"));
        }
        if !url.username().is_empty() || url.password().is_some() {
            let _ = url.set_username("redacted");
            let _ = url.set_password(None);
        }
        url.set_fragment(None);
        write!(f, "{:?}", url.as_str())
    }
}

impl fmt::Debug for RedactedUrl<'_, String> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        RedactedUrl(self.0.as_str()).fmt(f)
    }
}

impl fmt::Debug for RedactedUrl<'_, Option<String>> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.0 {
            Some(url) => f
                .debug_tuple("Some")
                .field(&RedactedUrl(url.as_str()))
                .finish(),
            None => f.write_str("None"),
        }
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

/// A JSON decoding error's message without the value serde found where another was
/// expected: a field of the wrong type may hold a secret (`"auth": "ghp_…"` reads `invalid
/// type: string "ghp_…", expected struct AuthBody`). The kind of value stays (`invalid type:
/// string, expected struct AuthBody at line 1 column 20`), and so does everything else serde
/// says (a missing or unknown field, an unknown variant, where).
pub fn json_error_without_values(error: &serde_json::Error) -> String {
    without_found_value(&error.to_string())
}

/// `text` (a CLI's error message, its stderr) with every URL's user information and query
/// left out: `https://user:key@llm.example/v1?api-key=sk-1` reads `https://llm.example/v1?…`.
/// An endpoint's query may carry a key (Azure's `api-key`, the Codex profile's
/// `query_params`), and a CLI names the URL it failed on.
pub fn without_url_credentials(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(at) = rest.find("://") {
        let (before, after) = rest.split_at(at + 3);
        out.push_str(before);
        let end = after
            .find(|c: char| c.is_whitespace() || matches!(c, '"' | '\'' | '<' | '>' | '`'))
            .unwrap_or(after.len());
        let url = &after[..end];
        let authority_end = url.find(['/', '?', '#']).unwrap_or(url.len());
        let authority = &url[..authority_end];
        out.push_str(
            authority
                .rsplit_once('@')
                .map_or(authority, |(_, host)| host),
        );
        let path = &url[authority_end..];
        match path.find('?') {
            Some(query) => {
                out.push_str(&path[..query]);
                out.push_str("?…");
            }
            None => out.push_str(path),
        }
        rest = &after[end..];
    }
    out.push_str(rest);
    out
}

/// A value a caller gave, quoted when it is a short word (a mistyped choice: `"opnai"`),
/// else only its length: a long or unusual one may be a secret put in the wrong field.
pub fn shown_if_a_word(value: &str) -> String {
    let word = value.len() <= 24
        && value
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'));
    if word {
        format!("{value:?}")
    } else {
        format!(
            "(a value of {} characters, not shown)",
            value.chars().count()
        )
    }
}

fn without_found_value(message: &str) -> String {
    // serde's "unknown variant `…`": the value, shown only when it is a short word.
    if let Some(rest) = message.strip_prefix("unknown variant `")
        && let Some((value, after)) = rest.split_once("`, expected")
    {
        return format!(
            "unknown variant {}, expected{after}",
            shown_if_a_word(value)
        );
    }
    for lead in ["invalid type: ", "invalid value: "] {
        // Only serde's own lead, at the start: a value may itself hold the words.
        let Some(start) = message.starts_with(lead).then_some(lead.len()) else {
            continue;
        };
        // The value ends where serde's expectation begins (the last one: a string value
        // may itself contain ", expected ").
        let Some(end) = message[start..].rfind(", expected ").map(|at| start + at) else {
            return format!("{}[a value]", &message[..start]);
        };
        let kind = found_kind(&message[start..end]);
        return format!("{}{kind}{}", &message[..start], &message[end..]);
    }
    message.to_owned()
}

/// The kind of a value as serde's `Unexpected` prints it (`string "…"`, `integer `7``,
/// `floating point `1.5``, `boolean `true``, `character `c``, `unit value`, `map`, ...),
/// without the value itself.
fn found_kind(found: &str) -> &str {
    for kind in [
        "string",
        "integer",
        "floating point",
        "boolean",
        "character",
        "byte array",
    ] {
        if found.starts_with(kind) {
            return kind;
        }
    }
    if found.contains(['"', '`']) {
        "a value"
    } else {
        found
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_in_a_message_lose_their_user_information_and_query_and_nothing_else() {
        let said = "unexpected status 401 Unauthorized, url: \
                    http://codex:sk-1@127.0.0.1:4290/v1/responses?api-key=sk-2&x=1 (retry 1); \
                    see https://docs.example/errors#401 or \"https://a.example/?k=sk-3\"";
        let shown = without_url_credentials(said);
        for secret in ["sk-1", "sk-2", "sk-3", "codex:"] {
            assert!(!shown.contains(secret), "{secret} in {shown}");
        }
        assert_eq!(
            shown,
            "unexpected status 401 Unauthorized, url: \
             http://127.0.0.1:4290/v1/responses?… (retry 1); \
             see https://docs.example/errors#401 or \"https://a.example/?…\""
        );
        assert_eq!(without_url_credentials("no url here"), "no url here");
    }

    #[test]
    fn a_secret_that_is_not_a_string_is_refused_without_its_value() {
        for text in ["987654321", "-987654321", "9876.54321", "true"] {
            let err = serde_json::from_str::<Secret>(text)
                .unwrap_err()
                .to_string();
            assert!(err.contains("expected a string"), "{err}");
            let digits = text.trim_start_matches('-').replace('.', "");
            let start = digits.get(..6).unwrap_or(&digits);
            assert!(!err.contains(start) && !err.contains("true"), "{err}");
        }
        let read: Secret = serde_json::from_str("\"s3cret\"").unwrap();
        assert_eq!(read.expose(), "s3cret");
        let read: Option<Secret> = serde_json::from_str("null").unwrap();
        assert!(read.is_none());
    }

    #[test]
    fn a_base_url_prints_without_its_query_or_user_info() {
        let shown = |url: &str| format!("{:?}", RedactedUrl(url));
        assert_eq!(
            shown("https://fn.example/api/chat?code=k3y-4711"),
            "\"https://fn.example/api/chat?[redacted]\""
        );
        assert_eq!(
            shown("https://user:pw@llm.example:8443/v1#frag"),
            "\"https://redacted@llm.example:8443/v1\""
        );
        assert_eq!(
            shown("https://llm.example/v1"),
            "\"https://llm.example/v1\""
        );
        let some = Some("https://llm.example/v1?sv=2024&sig=s3cr3t".to_owned());
        let printed = format!("{:?}", RedactedUrl(&some));
        assert_eq!(printed, "Some(\"https://llm.example/v1?[redacted]\")");
        // Where it is used: a provider, a Claude and a one-shot CLI's configuration.
        let provider = crate::rpc::messages::ProviderConfig::openai(
            "https://fn.example/v1?code=k3y-4711",
            None,
        );
        let mut claude =
            crate::backend::claude_live::ClaudeLiveConfig::new("/bin/claude", "/h", "/w");
        claude.base_url = Some("https://fn.example/v1?code=k3y-4711".into());
        let mut codex = crate::backend::oneshot::OneshotConfig::new(
            "codex-cli",
            crate::backend::CliBackendConfig::codex_cli(),
            "/h",
            "/w",
        );
        codex.base_url = Some("https://fn.example/v1?code=k3y-4711".into());
        for printed in [
            format!("{provider:?}"),
            format!("{claude:?}"),
            format!("{codex:?}"),
        ] {
            assert!(!printed.contains("k3y-4711"), "{printed}");
        }
    }

    #[test]
    fn a_json_error_names_the_kind_of_value_found_never_the_value() {
        #[derive(Debug, serde::Deserialize)]
        #[allow(dead_code)]
        struct Body {
            auth: Auth,
            #[serde(default)]
            limit: Option<u32>,
            #[serde(default)]
            kind: Option<Kind>,
        }
        #[derive(Debug, serde::Deserialize)]
        #[allow(dead_code)]
        struct Auth {
            token: String,
        }
        #[derive(Debug, serde::Deserialize)]
        enum Kind {
            #[serde(rename = "openai")]
            OpenAi,
        }
        let message = |text: &str| {
            json_error_without_values(&serde_json::from_str::<Body>(text).expect_err(text))
        };
        let secret = "ghp_SECRET, expected here too";
        let found = message(&format!(r#"{{"auth": "{secret}"}}"#));
        assert!(!found.contains("SECRET"), "{found}");
        assert!(
            found.starts_with("invalid type: string, expected struct Auth at line 1"),
            "{found}"
        );
        let found = message(r#"{"auth": {"token": 12345678}}"#);
        assert!(!found.contains("12345678"), "{found}");
        assert!(
            found.starts_with("invalid type: integer, expected a string"),
            "{found}"
        );
        let found = message(r#"{"auth": {"token": "t"}, "limit": -5}"#);
        assert!(!found.contains("-5"), "{found}");
        assert!(
            found.starts_with("invalid value: integer, expected u32"),
            "{found}"
        );
        // What serde says besides a value stays: the missing field, the unknown variant.
        assert!(message("{}").starts_with("missing field `auth`"));
        let found = message(r#"{"auth": {"token": "t"}, "kind": "opnai"}"#);
        assert!(
            found.starts_with("unknown variant \"opnai\", expected `openai`"),
            "{found}"
        );
        // A long one in a choice's place (a key in the wrong field) is not shown.
        let found =
            message(r#"{"auth": {"token": "t"}, "kind": "sk-live-0123456789abcdefSECRET"}"#);
        assert!(!found.contains("SECRET"), "{found}");
        assert!(found.contains("expected `openai`"), "{found}");
        // A value holding serde's words does not move where the cut is made.
        let found = message(r#"{"auth": {"token": ["SECRET invalid type: x, expected y"]}}"#);
        assert!(!found.contains("SECRET"), "{found}");
    }

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
