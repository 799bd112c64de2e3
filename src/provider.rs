//! BYOK provider shapes: which combinations of [`ProviderConfig`] fields the runtime can
//! serve, and the checks that refuse the rest before anything runs, each naming the field
//! and how to fix it.
//!
//! The shapes (the runtime's `provider` object; `README.md` has the table):
//! * `openai` with `wireApi` `completions` (`POST <base>/chat/completions`) or `responses`
//!   (`POST <base>/responses`), which is also how OpenAI-compatible local servers (ollama,
//!   vLLM, llama.cpp) are reached: `type` openai, no key, a `wireModel`;
//! * `azure` (`azure.apiVersion`: the versioned deployment route, else the `/openai/v1`
//!   route), with `completions` or `responses`;
//! * `anthropic` (`POST <base>/v1/messages`), which has no `wireApi`.
//!
//! The base URL's policy (scheme, address) is `pool::validate_provider`'s; this module
//! checks everything else. It reads no environment and talks to no network.

use crate::kinds::ProviderType;
use crate::rpc::messages::ProviderConfig;

/// The largest token limit a provider may declare (`maxPromptTokens`,
/// `maxOutputTokens`, `maxContextWindowTokens`): far above any model's window, so it only
/// catches a unit mistake (bytes for tokens).
pub const MAX_TOKEN_LIMIT: u64 = 100_000_000;

/// At most this many custom headers.
pub const MAX_HEADERS: usize = 64;

/// A header value, a key, a model name or an API version longer than this is refused.
pub const MAX_VALUE_BYTES: usize = 8 * 1024;

/// Model names (`modelId`, `wireModel`) longer than this are refused.
pub const MAX_MODEL_BYTES: usize = 256;

/// Headers the transport owns (framing, connection, host) or that carry the credential,
/// which belongs in `api_key`/`bearer_token` (kept secret, fingerprinted, never logged).
const RESERVED_HEADERS: [&str; 13] = [
    "host",
    "content-length",
    "transfer-encoding",
    "connection",
    "keep-alive",
    "upgrade",
    "te",
    "trailer",
    "proxy-authorization",
    "proxy-connection",
    "authorization",
    "api-key",
    "x-api-key",
];

/// A provider field the runtime cannot serve as given.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{field} {problem}")]
pub struct ProviderShapeError {
    /// The field, as the HTTP API spells it (`provider.azure.api_version`).
    pub field: String,
    /// What is wrong and how to fix it.
    pub problem: String,
}

impl ProviderShapeError {
    fn new(field: impl Into<String>, problem: impl Into<String>) -> Self {
        Self {
            field: field.into(),
            problem: problem.into(),
        }
    }
}

/// Checks every field of `provider` but its base URL.
pub fn check_shape(provider: &ProviderConfig) -> Result<(), ProviderShapeError> {
    let kind = provider.kind_or_default();
    if kind == ProviderType::Anthropic && provider.wire_api.is_some() {
        return Err(ProviderShapeError::new(
            "provider.wire_api",
            "applies to openai and azure providers only; anthropic has one wire API \
             (messages): remove it",
        ));
    }
    if let Some(azure) = &provider.azure {
        if kind != ProviderType::Azure {
            return Err(ProviderShapeError::new(
                "provider.azure",
                format!(
                    "applies to type azure only (this provider is {}); remove it or set \
                     provider.type to azure",
                    kind.as_str()
                ),
            ));
        }
        if let Some(version) = &azure.api_version {
            check_api_version(version)?;
        }
    }
    for (field, secret) in [
        ("provider.api_key", &provider.api_key),
        ("provider.bearer_token", &provider.bearer_token),
    ] {
        if let Some(secret) = secret {
            check_credential(field, secret.expose())?;
        }
    }
    if let Some(headers) = &provider.headers {
        check_headers(headers)?;
    }
    for (field, name) in [
        ("provider.model_id", &provider.model_id),
        ("provider.wire_model", &provider.wire_model),
    ] {
        if let Some(name) = name {
            check_model_name(field, name, kind)?;
        }
    }
    for (field, limit) in [
        ("provider.max_prompt_tokens", provider.max_prompt_tokens),
        ("provider.max_output_tokens", provider.max_output_tokens),
        (
            "provider.max_context_window_tokens",
            provider.max_context_window_tokens,
        ),
    ] {
        if let Some(limit) = limit {
            check_token_limit(field, limit)?;
        }
    }
    if let (Some(window), Some(prompt)) = (
        provider.max_context_window_tokens,
        provider.max_prompt_tokens,
    ) && prompt > window
    {
        return Err(ProviderShapeError::new(
            "provider.max_prompt_tokens",
            format!(
                "({prompt}) exceeds provider.max_context_window_tokens ({window}); a prompt \
                 must fit the context window"
            ),
        ));
    }
    Ok(())
}

/// A token limit: a whole number from 1 to [`MAX_TOKEN_LIMIT`].
pub fn check_token_limit(field: &str, limit: u64) -> Result<(), ProviderShapeError> {
    if limit == 0 || limit > MAX_TOKEN_LIMIT {
        return Err(ProviderShapeError::new(
            field,
            format!("must be a whole number of tokens from 1 to {MAX_TOKEN_LIMIT} (it is {limit})"),
        ));
    }
    Ok(())
}

fn check_api_version(version: &str) -> Result<(), ProviderShapeError> {
    let field = "provider.azure.api_version";
    if version.is_empty() {
        return Err(ProviderShapeError::new(
            field,
            "is empty; leave it out for the versionless /openai/v1 route, or give a version \
             such as 2024-10-21",
        ));
    }
    let fine = |c: char| c.is_ascii_alphanumeric() || matches!(c, '-' | '.' | '_');
    if version.len() > 64 || !version.chars().all(fine) {
        return Err(ProviderShapeError::new(
            field,
            "must be an Azure API version such as 2024-10-21 or 2025-01-01-preview \
             (letters, digits, '-', '.', '_'; at most 64)",
        ));
    }
    Ok(())
}

fn check_credential(field: &str, value: &str) -> Result<(), ProviderShapeError> {
    if value.is_empty() {
        return Err(ProviderShapeError::new(
            field,
            "is empty; leave it out for a server that needs no key",
        ));
    }
    if value.len() > MAX_VALUE_BYTES || !is_header_value(value) {
        return Err(ProviderShapeError::new(
            field,
            format!(
                "must be printable text without line breaks, at most {MAX_VALUE_BYTES} bytes \
                 (it is sent as a header)"
            ),
        ));
    }
    Ok(())
}

fn check_headers(
    headers: &std::collections::BTreeMap<String, String>,
) -> Result<(), ProviderShapeError> {
    if headers.len() > MAX_HEADERS {
        return Err(ProviderShapeError::new(
            "provider.headers",
            format!(
                "has {} entries; at most {MAX_HEADERS} are allowed",
                headers.len()
            ),
        ));
    }
    let mut seen = std::collections::HashSet::new();
    for (name, value) in headers {
        let field = format!("provider.headers.{name}");
        // Header names are case-insensitive: two spellings of one would be one header,
        // whose value depends on which the client sends last.
        if !seen.insert(name.to_ascii_lowercase()) {
            return Err(ProviderShapeError::new(
                "provider.headers",
                format!(
                    "names the header {name:?} more than once (header names are \
                     case-insensitive); keep one"
                ),
            ));
        }
        if name.is_empty() || !name.bytes().all(is_token_byte) {
            return Err(ProviderShapeError::new(
                "provider.headers",
                format!(
                    "has the name {name:?}, which is not an HTTP header name (letters, digits \
                     and !#$%&'*+-.^_`|~ only)"
                ),
            ));
        }
        let lower = name.to_ascii_lowercase();
        if RESERVED_HEADERS.contains(&lower.as_str()) {
            let fix = if matches!(lower.as_str(), "authorization" | "api-key" | "x-api-key") {
                "put the credential in provider.api_key or provider.bearer_token instead"
            } else {
                "the HTTP client sets it; remove it"
            };
            return Err(ProviderShapeError::new(
                field,
                format!("may not be set: {fix}"),
            ));
        }
        if value.len() > MAX_VALUE_BYTES || !is_header_value(value) {
            return Err(ProviderShapeError::new(
                field,
                format!(
                    "must be printable text without line breaks, at most {MAX_VALUE_BYTES} \
                     bytes"
                ),
            ));
        }
    }
    Ok(())
}

fn check_model_name(field: &str, name: &str, kind: ProviderType) -> Result<(), ProviderShapeError> {
    if name.is_empty() || name.len() > MAX_MODEL_BYTES {
        return Err(ProviderShapeError::new(
            field,
            format!(
                "must be 1 to {MAX_MODEL_BYTES} bytes; leave it out to use the session's model"
            ),
        ));
    }
    if name.chars().any(|c| c.is_whitespace() || c.is_control()) {
        return Err(ProviderShapeError::new(
            field,
            "may not contain spaces or control characters",
        ));
    }
    // An Azure wire model is a deployment name: one path segment of the request URL.
    if kind == ProviderType::Azure
        && field == "provider.wire_model"
        && name.contains(['/', '?', '#', '%'])
    {
        return Err(ProviderShapeError::new(
            field,
            "is an Azure deployment name and may not contain '/', '?', '#' or '%'",
        ));
    }
    Ok(())
}

/// RFC 9110 `tchar`.
fn is_token_byte(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b)
}

/// Visible ASCII, spaces and tabs: what a header value may hold without encoding.
fn is_header_value(value: &str) -> bool {
    value
        .bytes()
        .all(|b| b == b'\t' || (0x20..0x7f).contains(&b))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kinds::WireApi;
    use crate::rpc::messages::AzureOptions;
    use crate::secret::Secret;

    fn refused(provider: &ProviderConfig) -> String {
        check_shape(provider)
            .expect_err("the shape must be refused")
            .to_string()
    }

    #[test]
    fn every_supported_shape_passes() {
        let shapes = [
            ProviderConfig::openai("https://api.openai.com/v1", Some(Secret::new("sk-1"))),
            ProviderConfig::openai_responses("https://api.openai.com/v1", Some("sk-1".into())),
            ProviderConfig::azure(
                "https://r.openai.azure.com",
                Some("k".into()),
                "gpt-4o-prod",
                Some("2024-10-21".into()),
            ),
            ProviderConfig::azure("https://r.openai.azure.com", None, "gpt-4o", None),
            ProviderConfig::anthropic("https://api.anthropic.com", Some("k".into())),
            ProviderConfig::openai_compatible("http://127.0.0.1:11434/v1", "llama3.2:1b"),
            ProviderConfig::openai_compatible("http://127.0.0.1:8000/v1", "meta-llama/Llama-3-8B"),
            ProviderConfig {
                bearer_token: Some("t".into()),
                headers: Some([("X-Tenant".to_owned(), "a b".to_owned())].into()),
                model_id: Some("gpt-4o".into()),
                max_prompt_tokens: Some(1000),
                max_output_tokens: Some(100),
                max_context_window_tokens: Some(2000),
                ..ProviderConfig::openai("https://m/v1", Some("k".into()))
            },
        ];
        for shape in shapes {
            assert_eq!(check_shape(&shape), Ok(()), "{shape:?}");
        }
    }

    #[test]
    fn fields_that_do_not_fit_the_type_are_refused_with_the_field() {
        let mut anthropic = ProviderConfig::anthropic("https://a", None);
        anthropic.wire_api = Some(WireApi::Responses);
        assert!(refused(&anthropic).starts_with("provider.wire_api applies to openai and azure"));
        let mut openai = ProviderConfig::openai("https://o/v1", None);
        openai.azure = Some(AzureOptions::default());
        assert!(refused(&openai).starts_with("provider.azure applies to type azure only"));
    }

    #[test]
    fn bad_azure_versions_keys_headers_models_and_limits_are_refused_with_the_field() {
        let base = ProviderConfig::azure("https://r", Some("k".into()), "d", None);
        let cases: Vec<(ProviderConfig, &str)> = vec![
            (
                ProviderConfig {
                    azure: Some(AzureOptions {
                        api_version: Some(String::new()),
                    }),
                    ..base.clone()
                },
                "provider.azure.api_version is empty",
            ),
            (
                ProviderConfig {
                    azure: Some(AzureOptions {
                        api_version: Some("2024&x=1".into()),
                    }),
                    ..base.clone()
                },
                "provider.azure.api_version must be",
            ),
            (
                ProviderConfig {
                    api_key: Some("".into()),
                    ..base.clone()
                },
                "provider.api_key is empty",
            ),
            (
                ProviderConfig {
                    bearer_token: Some("t\r\nX-Injected: 1".into()),
                    ..base.clone()
                },
                "provider.bearer_token must be printable",
            ),
            (
                ProviderConfig {
                    headers: Some([("Bad Name".to_owned(), "v".to_owned())].into()),
                    ..base.clone()
                },
                "provider.headers has the name \"Bad Name\"",
            ),
            (
                ProviderConfig {
                    headers: Some([("X-A".to_owned(), "v\nw".to_owned())].into()),
                    ..base.clone()
                },
                "provider.headers.X-A must be printable",
            ),
            (
                ProviderConfig {
                    headers: Some(
                        [
                            ("X-Org".to_owned(), "a".to_owned()),
                            ("x-org".to_owned(), "b".to_owned()),
                        ]
                        .into(),
                    ),
                    ..base.clone()
                },
                "provider.headers names the header \"x-org\" more than once",
            ),
            (
                ProviderConfig {
                    headers: Some([("Authorization".to_owned(), "Bearer x".to_owned())].into()),
                    ..base.clone()
                },
                "provider.headers.Authorization may not be set: put the credential in",
            ),
            (
                ProviderConfig {
                    headers: Some([("Content-Length".to_owned(), "1".to_owned())].into()),
                    ..base.clone()
                },
                "provider.headers.Content-Length may not be set",
            ),
            (
                ProviderConfig {
                    wire_model: Some("a/b".into()),
                    ..base.clone()
                },
                "provider.wire_model is an Azure deployment name",
            ),
            (
                ProviderConfig {
                    model_id: Some(String::new()),
                    ..base.clone()
                },
                "provider.model_id must be 1 to 256 bytes",
            ),
            (
                ProviderConfig {
                    wire_model: Some("two words".into()),
                    ..base.clone()
                },
                "provider.wire_model may not contain spaces",
            ),
            (
                ProviderConfig {
                    max_output_tokens: Some(0),
                    ..base.clone()
                },
                "provider.max_output_tokens must be a whole number of tokens from 1",
            ),
            (
                ProviderConfig {
                    max_context_window_tokens: Some(MAX_TOKEN_LIMIT + 1),
                    ..base.clone()
                },
                "provider.max_context_window_tokens must be",
            ),
            (
                ProviderConfig {
                    max_prompt_tokens: Some(10),
                    max_context_window_tokens: Some(5),
                    ..base.clone()
                },
                "provider.max_prompt_tokens (10) exceeds provider.max_context_window_tokens (5)",
            ),
        ];
        for (provider, expected) in cases {
            let text = refused(&provider);
            assert!(text.starts_with(expected), "{text:?} vs {expected:?}");
            assert!(!text.contains("X-Injected"), "no secret in {text}");
        }
        let many: std::collections::BTreeMap<String, String> = (0..=MAX_HEADERS)
            .map(|i| (format!("x-{i}"), "v".to_owned()))
            .collect();
        let text = refused(&ProviderConfig {
            headers: Some(many),
            ..base
        });
        assert!(
            text.starts_with("provider.headers has 65 entries"),
            "{text}"
        );
    }
}
