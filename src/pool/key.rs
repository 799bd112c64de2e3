//! The keys the pool decides with: which process a lease runs on ([`PoolKey`]), which
//! processes are the same account on rotated credentials ([`PoolKey::family`]), and whether a
//! stored conversation may be resumed ([`compat_key`]).
//!
//! Only fingerprints of secrets enter a key (128-bit, non-reversible); `Debug` of a key
//! shows no token.
//!
//! A BYOK provider enters the key as a [`ByokFingerprint`]: the endpoint (type, base URL,
//! wire API, Azure API version, headers, model names, limits) and, apart, its credential.
//! A new credential for the same endpoint is a rotation, like a new GitHub token version:
//! a new worker key of the same family (the old workers drain) and the same conversation.
//! Any other change is a new family and a new CLI session.

use std::fmt;
use std::path::{Path, PathBuf};

use serde_json::json;

use crate::auth::{AuthMode, ResolvedAuth, fingerprint};
use crate::kinds::WireApi;
use crate::rpc::messages::ProviderConfig;
use crate::session_options::SessionOptions;

/// Which worker processes may serve a lease: normalized COPILOT_HOME, auth mode, profile id,
/// profile version and the BYOK fingerprint. Leases with equal keys share processes.
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PoolKey {
    /// Normalized (canonical) COPILOT_HOME.
    pub home: PathBuf,
    /// Logged-in user or token.
    pub mode: AuthMode,
    /// The account/profile identity (`env:GH_TOKEN`, a gateway profile id, …).
    pub profile_id: Option<String>,
    /// The credential version (a fingerprint, or the caller's version).
    pub profile_version: Option<String>,
    /// Fingerprint of the BYOK provider and model, if any.
    pub byok: Option<ByokFingerprint>,
}

/// The fingerprint of a BYOK provider and the session's model: what the endpoint is and,
/// apart, which credential it is called with (so a key rotation stays in the family).
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ByokFingerprint {
    /// Type, base URL, wire API, Azure API version, headers, model, `modelId`, `wireModel`
    /// and the token limits.
    pub endpoint: String,
    /// The API key and bearer token; `None` for a provider without either.
    pub key: Option<String>,
}

impl fmt::Debug for ByokFingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Fingerprints are not secrets, but they are long: show a prefix.
        let short = |fp: &str| {
            fp.trim_start_matches("sha256:")
                .chars()
                .take(12)
                .collect::<String>()
        };
        f.debug_struct("ByokFingerprint")
            .field("endpoint", &short(&self.endpoint))
            .field("key", &self.key.as_deref().map(short))
            .finish()
    }
}

impl PoolKey {
    /// The key for a lease.
    pub fn new(
        home: &Path,
        auth: &ResolvedAuth,
        provider: Option<&ProviderConfig>,
        model: Option<&str>,
    ) -> Self {
        Self {
            home: home.to_path_buf(),
            mode: auth.mode,
            profile_id: auth.profile_id.clone(),
            profile_version: auth.profile_version.clone(),
            byok: provider.map(|p| byok_fingerprint(p, model)),
        }
    }

    /// The key without the credential versions (the GitHub token's and the BYOK key's): two
    /// keys of one family are the same account and endpoint before and after a rotation.
    pub fn family(&self) -> PoolKey {
        PoolKey {
            profile_version: None,
            byok: self.byok.as_ref().map(|b| ByokFingerprint {
                endpoint: b.endpoint.clone(),
                key: None,
            }),
            ..self.clone()
        }
    }

    /// A short stable hash for status output and logs (no secret, no path).
    pub fn short_hash(&self) -> String {
        let text = json!([
            self.home.display().to_string(),
            self.mode.as_str(),
            self.profile_id,
            self.profile_version,
            self.byok.as_ref().map(|b| &b.endpoint),
            self.byok.as_ref().map(|b| &b.key),
        ])
        .to_string();
        fingerprint(&text)
            .trim_start_matches("sha256:")
            .chars()
            .take(12)
            .collect()
    }
}

impl fmt::Debug for PoolKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "PoolKey({})", self.short_hash())
    }
}

/// The fingerprint of everything about a BYOK provider that changes what the model sees or
/// who pays, over [`byok_endpoint_text`] and the credential (the API key and bearer token).
pub fn byok_fingerprint(provider: &ProviderConfig, model: Option<&str>) -> ByokFingerprint {
    ByokFingerprint {
        endpoint: fingerprint(&byok_endpoint_text(provider, model)),
        key: byok_key_text(provider).map(|text| fingerprint(&text)),
    }
}

/// The stable serialization of a provider's endpoint and the session's model: a JSON array
/// of `[name, value]` pairs in a fixed order, defaults resolved the way the runtime
/// resolves them (no type is `openai`, no wire API is `completions` for openai and azure),
/// header names lower-cased and the headers sorted. Changing this text restarts every
/// BYOK conversation (a new compat key): the golden test below holds it.
pub fn byok_endpoint_text(provider: &ProviderConfig, model: Option<&str>) -> String {
    let mut headers: Vec<(String, &str)> = provider
        .headers
        .iter()
        .flatten()
        .map(|(name, value)| (name.to_ascii_lowercase(), value.as_str()))
        .collect();
    headers.sort();
    json!([
        ["type", provider.kind_or_default().as_str()],
        ["baseUrl", provider.base_url],
        [
            "wireApi",
            provider.wire_api_or_default().map(WireApi::as_str)
        ],
        [
            "azureApiVersion",
            provider
                .azure
                .as_ref()
                .and_then(|a| a.api_version.as_deref())
        ],
        ["headers", headers],
        ["model", model],
        ["modelId", provider.model_id],
        ["wireModel", provider.wire_model],
        ["maxPromptTokens", provider.max_prompt_tokens],
        ["maxOutputTokens", provider.max_output_tokens],
        ["maxContextWindowTokens", provider.max_context_window_tokens],
    ])
    .to_string()
}

/// The stable serialization of a provider's credential (`[apiKey, bearerToken]`), `None`
/// when it has neither. It holds the secrets: only its fingerprint may leave this module.
fn byok_key_text(provider: &ProviderConfig) -> Option<String> {
    let api_key = provider.api_key.as_ref().map(|k| k.expose());
    let bearer = provider.bearer_token.as_ref().map(|k| k.expose());
    (api_key.is_some() || bearer.is_some()).then(|| json!([api_key, bearer]).to_string())
}

/// Whether a stored conversation may be resumed for a lease: model, provider fingerprint,
/// working directory, COPILOT_HOME, account identity (mode and profile id) and the session
/// options that change what the conversation means ([`SessionOptions::meaning`]: system
/// message, tool filters, agents, MCP servers, …; not reasoning effort or streaming). The
/// credential version is deliberately left out, so a token rotation keeps the conversation.
/// Without such options the key is what it was before options existed, so stored
/// conversations keep resuming across the upgrade.
pub fn compat_key(
    key: &PoolKey,
    model: Option<&str>,
    working_directory: &Path,
    options: &SessionOptions,
) -> String {
    let mut text = json!({
        "model": model,
        "byok": key.byok.as_ref().map(|b| &b.endpoint),
        "cwd": working_directory.display().to_string(),
        "home": key.home.display().to_string(),
        "mode": key.mode.as_str(),
        "profile": key.profile_id,
    });
    let meaning = options.meaning();
    if !meaning.is_empty() {
        text["session"] = serde_json::Value::Object(meaning);
    }
    fingerprint(&text.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::auth::AuthSource;
    use crate::secret::Secret;

    fn token(version: &str) -> ResolvedAuth {
        ResolvedAuth {
            mode: AuthMode::Token,
            profile_id: Some("p1".into()),
            profile_version: Some(version.into()),
            token: Some(Secret::new("ghu_secret_value")),
            source: AuthSource::ExplicitToken,
        }
    }

    #[test]
    fn rotation_keeps_the_family_and_the_compat_key() {
        let home = Path::new("/h");
        let p = ProviderConfig::openai("http://m/v1", Some("k".into()));
        let a = PoolKey::new(home, &token("v1"), Some(&p), Some("m"));
        let b = PoolKey::new(home, &token("v2"), Some(&p), Some("m"));
        assert_ne!(a, b);
        assert_eq!(a.family(), b.family());
        let cwd = Path::new("/w");
        let none = SessionOptions::new();
        assert_eq!(
            compat_key(&a, Some("m"), cwd, &none),
            compat_key(&b, Some("m"), cwd, &none)
        );
    }

    #[test]
    fn every_endpoint_field_changes_the_family_and_the_compat_key() {
        use crate::kinds::ProviderType;
        use crate::rpc::messages::AzureOptions;
        let home = Path::new("/h");
        let cwd = Path::new("/w");
        let base = ProviderConfig::openai("http://m/v1", Some("k".into()));
        let key = |p: &ProviderConfig, m: &str| PoolKey::new(home, &token("v"), Some(p), Some(m));
        let compat = |k: &PoolKey, m: &str| compat_key(k, Some(m), cwd, &SessionOptions::new());
        let k0 = key(&base, "m");
        let changed: Vec<(&str, ProviderConfig, &str)> = vec![
            (
                "type",
                ProviderConfig {
                    kind: Some(ProviderType::Azure),
                    ..base.clone()
                },
                "m",
            ),
            (
                "base url",
                ProviderConfig {
                    base_url: "http://n/v1".into(),
                    ..base.clone()
                },
                "m",
            ),
            (
                "wire api",
                ProviderConfig {
                    wire_api: Some(WireApi::Responses),
                    ..base.clone()
                },
                "m",
            ),
            (
                "azure api version",
                ProviderConfig {
                    azure: Some(AzureOptions {
                        api_version: Some("2024-10-21".into()),
                    }),
                    ..base.clone()
                },
                "m",
            ),
            (
                "headers",
                ProviderConfig {
                    headers: Some([("x".to_owned(), "y".to_owned())].into()),
                    ..base.clone()
                },
                "m",
            ),
            ("model", base.clone(), "m2"),
            (
                "model id",
                ProviderConfig {
                    model_id: Some("gpt-4o".into()),
                    ..base.clone()
                },
                "m",
            ),
            (
                "wire model",
                ProviderConfig {
                    wire_model: Some("d".into()),
                    ..base.clone()
                },
                "m",
            ),
            (
                "max prompt",
                ProviderConfig {
                    max_prompt_tokens: Some(9),
                    ..base.clone()
                },
                "m",
            ),
            (
                "max output",
                ProviderConfig {
                    max_output_tokens: Some(9),
                    ..base.clone()
                },
                "m",
            ),
            (
                "max window",
                ProviderConfig {
                    max_context_window_tokens: Some(9),
                    ..base.clone()
                },
                "m",
            ),
        ];
        for (what, provider, model) in changed {
            let k = key(&provider, model);
            assert_ne!(k0, k, "{what}");
            assert_ne!(k0.family(), k.family(), "{what}");
            assert_ne!(compat(&k0, "m"), compat(&k, model), "{what}");
        }
    }

    #[test]
    fn a_new_key_for_the_same_endpoint_is_a_rotation_in_the_family() {
        let home = Path::new("/h");
        let cwd = Path::new("/w");
        let base = ProviderConfig::openai("http://m/v1", Some("k".into()));
        let key = |p: &ProviderConfig| PoolKey::new(home, &token("v"), Some(p), Some("m"));
        let compat = |k: &PoolKey| compat_key(k, Some("m"), cwd, &SessionOptions::new());
        let k0 = key(&base);
        let rotated = [
            ProviderConfig {
                api_key: Some("k2".into()),
                ..base.clone()
            },
            ProviderConfig {
                bearer_token: Some("t".into()),
                ..base.clone()
            },
            ProviderConfig {
                api_key: None,
                ..base.clone()
            },
        ];
        for provider in rotated {
            let k = key(&provider);
            assert_ne!(k0, k, "{provider:?}");
            assert_eq!(k0.family(), k.family(), "{provider:?}");
            assert_eq!(compat(&k0), compat(&k), "{provider:?}");
        }
    }

    #[test]
    fn the_endpoint_serialization_is_stable_and_resolves_defaults() {
        // Holding this text holds every stored BYOK conversation's compat key.
        let mut p = ProviderConfig::openai("https://m/v1", Some("sk-secret".into()));
        p.headers = Some(
            [
                ("X-B".to_owned(), "2".to_owned()),
                ("x-a".to_owned(), "1".to_owned()),
            ]
            .into(),
        );
        p.max_output_tokens = Some(512);
        assert_eq!(
            byok_endpoint_text(&p, Some("gpt")),
            r#"[["type","openai"],["baseUrl","https://m/v1"],["wireApi","completions"],["azureApiVersion",null],["headers",[["x-a","1"],["x-b","2"]]],["model","gpt"],["modelId",null],["wireModel",null],["maxPromptTokens",null],["maxOutputTokens",512],["maxContextWindowTokens",null]]"#
        );
        // What the runtime defaults to fingerprints like the default spelled out.
        let bare = ProviderConfig {
            kind: None,
            wire_api: None,
            ..p.clone()
        };
        assert_eq!(
            byok_fingerprint(&bare, Some("gpt")),
            byok_fingerprint(&p, Some("gpt"))
        );
        // Header names are case-insensitive.
        let mut upper = p.clone();
        upper.headers = Some(
            [
                ("X-A".to_owned(), "1".to_owned()),
                ("X-B".to_owned(), "2".to_owned()),
            ]
            .into(),
        );
        assert_eq!(
            byok_fingerprint(&upper, Some("gpt")),
            byok_fingerprint(&p, Some("gpt"))
        );
        // Anthropic has no wire API.
        let anthropic = ProviderConfig::anthropic("https://a", None);
        assert!(byok_endpoint_text(&anthropic, None).contains(r#"["wireApi",null]"#));
        assert!(byok_fingerprint(&anthropic, None).key.is_none());
        assert!(!byok_endpoint_text(&p, None).contains("sk-secret"));
    }

    #[test]
    fn options_that_change_what_a_conversation_means_change_the_compat_key_and_others_do_not() {
        let key = PoolKey::new(Path::new("/h"), &token("v"), None, None);
        let cwd = Path::new("/w");
        let compat = |options: serde_json::Value| {
            let options = SessionOptions::from_value(options).unwrap();
            compat_key(&key, Some("m"), cwd, &options)
        };
        let base = compat(json!({}));
        // Without options the key is the one stored before options existed.
        let before = fingerprint(
            &json!({
                "model": Some("m"),
                "byok": key.byok.as_ref().map(|b| &b.endpoint),
                "cwd": "/w",
                "home": "/h",
                "mode": key.mode.as_str(),
                "profile": key.profile_id,
            })
            .to_string(),
        );
        assert_eq!(base, before);
        for meaning in [
            json!({"systemMessage": {"mode": "replace", "content": "Be terse."}}),
            json!({"excludedTools": ["builtin:bash"]}),
            json!({"customAgents": [{"name": "r", "prompt": "p"}]}),
            json!({"mcpServers": {"w": {"type": "http", "url": "https://m/"}}}),
            json!({"additionalDirectories": ["/w/more"]}),
        ] {
            assert_ne!(compat(meaning.clone()), base, "{meaning}");
        }
        assert_ne!(
            compat(json!({"systemMessage": {"content": "a"}})),
            compat(json!({"systemMessage": {"content": "b"}}))
        );
        for running in [
            json!({"reasoningSummary": "concise"}),
            json!({"streaming": false}),
            json!({"infiniteSessions": {"enabled": false}}),
            json!({"enableCitations": true}),
            json!({"sessionLimits": {}}),
        ] {
            assert_eq!(compat(running.clone()), base, "{running}");
        }
    }

    #[test]
    fn keys_show_no_secret() {
        let p = ProviderConfig::openai("http://m/v1", Some("sk-very-secret".into()));
        let k = PoolKey::new(Path::new("/h"), &token("v1"), Some(&p), None);
        let text = format!("{k:?} {}", k.short_hash());
        assert!(!text.contains("sk-very-secret") && !text.contains("ghu_secret_value"));
        assert_eq!(k.short_hash().len(), 12);
        let fp = byok_fingerprint(&p, None);
        let text = format!("{fp:?} {} {:?}", fp.endpoint, fp.key);
        assert!(!text.contains("sk-very"), "{text}");
    }
}
