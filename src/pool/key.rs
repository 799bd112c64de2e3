//! The keys the pool decides with: which process a lease runs on ([`PoolKey`]), which
//! processes are the same account on rotated credentials ([`PoolKey::family`]), and whether a
//! stored conversation may be resumed ([`compat_key`]).
//!
//! Only fingerprints of secrets enter a key (128-bit, non-reversible); `Debug` of a key
//! shows no token.

use std::fmt;
use std::path::{Path, PathBuf};

use serde_json::json;

use crate::auth::{AuthMode, ResolvedAuth, fingerprint};
use crate::kinds::{ProviderType, WireApi};
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
    pub byok: Option<String>,
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

    /// The key without the credential version: two keys of one family are the same account
    /// before and after a token rotation.
    pub fn family(&self) -> PoolKey {
        PoolKey {
            profile_version: None,
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
            self.byok,
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

/// A stable fingerprint of everything about a BYOK provider that changes what the model sees
/// or who pays: type, base URL, wire API, headers, key, bearer token and model.
pub fn byok_fingerprint(provider: &ProviderConfig, model: Option<&str>) -> String {
    let headers: Vec<(&String, &String)> = provider
        .headers
        .as_ref()
        .map(|h| h.iter().collect())
        .unwrap_or_default();
    let text = json!({
        "type": provider.kind.unwrap_or(ProviderType::OpenAi).as_str(),
        "baseUrl": provider.base_url,
        "wireApi": provider.wire_api.unwrap_or(WireApi::Completions).as_str(),
        "headers": headers,
        "apiKey": provider.api_key.as_ref().map(|k| k.expose()),
        "bearerToken": provider.bearer_token.as_ref().map(|k| k.expose()),
        "model": model,
    })
    .to_string();
    fingerprint(&text)
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
        "byok": key.byok,
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
    fn byok_changes_change_the_key_and_the_compat_key() {
        let home = Path::new("/h");
        let cwd = Path::new("/w");
        let base = ProviderConfig::openai("http://m/v1", Some("k".into()));
        let key = |p: &ProviderConfig, m: &str| PoolKey::new(home, &token("v"), Some(p), Some(m));
        let k0 = key(&base, "m");
        let mut other_key = base.clone();
        other_key.api_key = Some("k2".into());
        let mut other_url = base.clone();
        other_url.base_url = "http://n/v1".into();
        let mut other_headers = base.clone();
        other_headers.headers = Some([("x".to_owned(), "y".to_owned())].into());
        for k in [
            key(&other_key, "m"),
            key(&other_url, "m"),
            key(&other_headers, "m"),
            key(&base, "m2"),
        ] {
            assert_ne!(k0, k);
            assert_ne!(k0.family(), k.family());
            assert_ne!(
                compat_key(&k0, Some("m"), cwd, &SessionOptions::new()),
                compat_key(&k, Some("m2"), cwd, &SessionOptions::new())
            );
        }
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
                "byok": key.byok,
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
        assert!(!byok_fingerprint(&p, None).contains("sk-very"));
    }
}
