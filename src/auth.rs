//! Which credentials a lease runs with: the precedence between the logged-in user, an
//! explicit token, a token the gateway resolved from an auth profile, and the caller's
//! environment; whether the logged-in user may be used at all (a lease may forbid it, and
//! then runs with no GitHub identity, which only a BYOK provider can use); plus a
//! non-reversible fingerprint that lets tokens key pools without ever appearing in a key, a
//! log line or a file.

use std::collections::BTreeMap;

use sha2::{Digest, Sha256};

use crate::secret::Secret;

/// The marker in [`AuthError::TokenProfile`]'s message, for callers that match on text.
pub const TOKEN_PROFILE_ERROR: &str = "COPILOT_TOKEN_PROFILE_ERROR";

/// Environment variables that may carry a GitHub token, in precedence order.
pub const ENV_TOKEN_VARIABLES: [&str; 4] = [
    "OPENCLAW_GITHUB_TOKEN",
    "COPILOT_GITHUB_TOKEN",
    "GH_TOKEN",
    "GITHUB_TOKEN",
];

/// The credentials a caller asks a lease to run with. Every secret is a [`Secret`], so the
/// derived `Debug` never shows a token.
#[derive(Clone, Debug, Default)]
pub struct LeaseAuth {
    /// Run as the user logged in to the CLI, ignoring every token.
    pub use_logged_in_user: bool,
    /// An explicit GitHub token; requires `profile_id` and `profile_version`.
    pub github_token: Option<Secret>,
    /// The profile the explicit token belongs to.
    pub profile_id: Option<String>,
    /// The version of that profile (changes when the token changes).
    pub profile_version: Option<String>,
    /// A token the gateway resolved from an auth profile.
    pub resolved_api_key: Option<Secret>,
    /// The auth profile `resolved_api_key` came from.
    pub auth_profile_id: Option<String>,
    /// The environment the caller passes (never this process's environment).
    pub env: BTreeMap<String, Secret>,
    /// Never use the user logged in to the CLI on this machine: `use_logged_in_user` is
    /// refused, and a lease with no token runs with no GitHub identity at all
    /// ([`AuthMode::NoIdentity`]), which only a BYOK provider can serve. The HTTP API sets
    /// this unless its config allows the logged-in user.
    pub forbid_logged_in_user: bool,
}

/// How the CLI authenticates.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum AuthMode {
    /// The user logged in to the CLI (`copilot login`).
    LoggedInUser,
    /// A GitHub token handed to the CLI.
    Token,
    /// No GitHub identity: no token and no stored login (`--no-auto-login`); only a BYOK
    /// provider can serve such a lease.
    NoIdentity,
}

impl AuthMode {
    /// `"logged-in-user"`, `"token"` or `"none"`.
    pub fn as_str(self) -> &'static str {
        match self {
            AuthMode::LoggedInUser => "logged-in-user",
            AuthMode::Token => "token",
            AuthMode::NoIdentity => "none",
        }
    }
}

/// Which rung of the precedence produced a [`ResolvedAuth`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AuthSource {
    /// `use_logged_in_user: true`.
    ExplicitLoggedInUser,
    /// `github_token` with its profile id and version.
    ExplicitToken,
    /// `resolved_api_key`.
    ResolvedProfile,
    /// The named variable of the caller's environment.
    Env(&'static str),
    /// Nothing was given: the logged-in user.
    DefaultLoggedInUser,
    /// Nothing was given and the logged-in user is forbidden: no GitHub identity.
    NoCredentials,
}

/// The credentials a lease runs with.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ResolvedAuth {
    /// Logged-in user or token.
    pub mode: AuthMode,
    /// The profile the token belongs to (`None` for the logged-in user).
    pub profile_id: Option<String>,
    /// The profile's version (`None` for the logged-in user).
    pub profile_version: Option<String>,
    /// The token (`None` for the logged-in user).
    pub token: Option<Secret>,
    /// Where the credentials came from.
    pub source: AuthSource,
}

/// Why credentials could not be resolved.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AuthError {
    /// An explicit token without a profile id and version.
    #[error(
        "{TOKEN_PROFILE_ERROR}: an explicit github_token needs a non-empty profile_id and \
         profile_version (missing: {missing}); pass both so leases with different tokens \
         never share a pool key, or use resolved_token with auth_profile_id instead \
         (`LeaseAuth::resolved_api_key` in the library)"
    )]
    TokenProfile {
        /// Which of the two fields are missing or empty.
        missing: &'static str,
    },
    /// `use_logged_in_user` on a lease that forbids the logged-in user.
    #[error(
        "use_logged_in_user is not allowed: it would run as the account logged in to the \
         Copilot CLI on the pool's machine. Send a GitHub token instead (github_token with \
         profile_id and profile_version, or resolved_token with auth_profile_id), or allow \
         the logged-in user (the daemon's `[auth] allow_logged_in_user = true`, \
         ApiConfig::allow_logged_in_user for an embedded API)"
    )]
    LoggedInUserNotAllowed,
    /// No token, the logged-in user forbidden, and no BYOK provider: nothing could answer.
    #[error(
        "no GitHub credentials for this request: it carries no token, the environment \
         fallback gave none, and the logged-in user is not allowed. Send a GitHub token \
         (github_token with profile_id and profile_version, or resolved_token with \
         auth_profile_id) or a BYOK provider; or, on the daemon, turn on `[auth] \
         env_fallback = true` with a token variable in its environment, or `[auth] \
         allow_logged_in_user = true`"
    )]
    NoCredentials,
}

/// Resolves the credentials of a lease. Precedence: the logged-in user when asked for;
/// an explicit token (with its profile id and version); a token resolved from an auth
/// profile (its version is the token's fingerprint); the first non-empty variable of
/// [`ENV_TOKEN_VARIABLES`] in the caller's `env` (profile `env:<NAME>`, version the token's
/// fingerprint); otherwise the logged-in user — or, when the lease forbids it, no GitHub
/// identity. Empty tokens count as absent.
pub fn resolve(auth: &LeaseAuth) -> Result<ResolvedAuth, AuthError> {
    if auth.use_logged_in_user {
        if auth.forbid_logged_in_user {
            return Err(AuthError::LoggedInUserNotAllowed);
        }
        return Ok(logged_in(AuthSource::ExplicitLoggedInUser));
    }

    if let Some(token) = non_empty_secret(auth.github_token.as_ref()) {
        let profile_id = non_empty_str(auth.profile_id.as_deref());
        let profile_version = non_empty_str(auth.profile_version.as_deref());
        return match (profile_id, profile_version) {
            (Some(id), Some(version)) => Ok(ResolvedAuth {
                mode: AuthMode::Token,
                profile_id: Some(id.to_owned()),
                profile_version: Some(version.to_owned()),
                token: Some(token.clone()),
                source: AuthSource::ExplicitToken,
            }),
            (None, Some(_)) => Err(AuthError::TokenProfile {
                missing: "profile_id",
            }),
            (Some(_), None) => Err(AuthError::TokenProfile {
                missing: "profile_version",
            }),
            (None, None) => Err(AuthError::TokenProfile {
                missing: "profile_id and profile_version",
            }),
        };
    }

    if let Some(key) = non_empty_secret(auth.resolved_api_key.as_ref()) {
        let profile_id = non_empty_str(auth.auth_profile_id.as_deref()).unwrap_or("resolved");
        return Ok(token_auth(
            key,
            profile_id.to_owned(),
            AuthSource::ResolvedProfile,
        ));
    }

    for name in ENV_TOKEN_VARIABLES {
        if let Some(token) = non_empty_secret(auth.env.get(name)) {
            return Ok(token_auth(
                token,
                format!("env:{name}"),
                AuthSource::Env(name),
            ));
        }
    }

    if auth.forbid_logged_in_user {
        return Ok(ResolvedAuth {
            mode: AuthMode::NoIdentity,
            ..logged_in(AuthSource::NoCredentials)
        });
    }
    Ok(logged_in(AuthSource::DefaultLoggedInUser))
}

/// [`resolve`], then checks that something can serve the lease: with no GitHub identity
/// only a BYOK provider (`byok`) can. The pool and the HTTP API both call this, so they
/// refuse the same requests with the same message.
pub fn resolve_for_lease(auth: &LeaseAuth, byok: bool) -> Result<ResolvedAuth, AuthError> {
    let resolved = resolve(auth)?;
    if resolved.mode == AuthMode::NoIdentity && !byok {
        return Err(AuthError::NoCredentials);
    }
    Ok(resolved)
}

/// A non-reversible fingerprint of a secret: `"sha256:"` followed by the first 32
/// lowercase hex digits (128 bits) of its SHA-256.
pub fn fingerprint(secret: &str) -> String {
    let digest = Sha256::digest(secret.as_bytes());
    format!("sha256:{}", crate::ids::hex(&digest[..16]))
}

fn logged_in(source: AuthSource) -> ResolvedAuth {
    ResolvedAuth {
        mode: AuthMode::LoggedInUser,
        profile_id: None,
        profile_version: None,
        token: None,
        source,
    }
}

fn token_auth(token: &Secret, profile_id: String, source: AuthSource) -> ResolvedAuth {
    ResolvedAuth {
        mode: AuthMode::Token,
        profile_id: Some(profile_id),
        profile_version: Some(fingerprint(token.expose())),
        token: Some(token.clone()),
        source,
    }
}

fn non_empty_secret(secret: Option<&Secret>) -> Option<&Secret> {
    secret.filter(|s| !s.is_empty())
}

fn non_empty_str(value: Option<&str>) -> Option<&str> {
    value.filter(|s| !s.is_empty())
}

#[cfg(test)]
mod tests {
    use super::*;

    const TOKEN: &str = "ghp_topsecret_value_123";

    fn env(pairs: &[(&str, &str)]) -> BTreeMap<String, Secret> {
        pairs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), Secret::new(*v)))
            .collect()
    }

    fn everything() -> LeaseAuth {
        LeaseAuth {
            use_logged_in_user: false,
            github_token: Some(Secret::new(TOKEN)),
            profile_id: Some("p1".into()),
            profile_version: Some("v1".into()),
            resolved_api_key: Some(Secret::new("resolved-key")),
            auth_profile_id: Some("gw-profile".into()),
            env: env(&[("GH_TOKEN", "env-token")]),
            forbid_logged_in_user: false,
        }
    }

    #[test]
    fn logged_in_user_wins_over_everything() {
        let auth = LeaseAuth {
            use_logged_in_user: true,
            ..everything()
        };
        let r = resolve(&auth).unwrap();
        assert_eq!(r.mode, AuthMode::LoggedInUser);
        assert_eq!(r.source, AuthSource::ExplicitLoggedInUser);
        assert_eq!(
            (r.profile_id, r.profile_version, r.token),
            (None, None, None)
        );
    }

    #[test]
    fn explicit_token_with_profile() {
        let r = resolve(&everything()).unwrap();
        assert_eq!(r.mode, AuthMode::Token);
        assert_eq!(r.source, AuthSource::ExplicitToken);
        assert_eq!(r.profile_id.as_deref(), Some("p1"));
        assert_eq!(r.profile_version.as_deref(), Some("v1"));
        assert_eq!(r.token.as_ref().map(Secret::expose), Some(TOKEN));
    }

    #[test]
    fn explicit_token_without_profile_is_an_error() {
        for (id, version, missing) in [
            (None, Some("v"), "profile_id"),
            (Some("p"), None, "profile_version"),
            (None, None, "profile_id and profile_version"),
            (Some(""), Some("v"), "profile_id"),
            (Some("p"), Some(""), "profile_version"),
        ] {
            let auth = LeaseAuth {
                profile_id: id.map(str::to_owned),
                profile_version: version.map(str::to_owned),
                ..everything()
            };
            let err = resolve(&auth).unwrap_err();
            let text = err.to_string();
            assert!(text.contains(TOKEN_PROFILE_ERROR), "{text}");
            assert!(text.contains("profile_id"), "{text}");
            assert!(text.contains("profile_version"), "{text}");
            assert!(text.contains(&format!("missing: {missing})")), "{text}");
            assert!(!text.contains(TOKEN), "{text}");
        }
    }

    #[test]
    fn empty_explicit_token_counts_as_absent() {
        let auth = LeaseAuth {
            github_token: Some(Secret::new("")),
            profile_id: None,
            profile_version: None,
            ..everything()
        };
        let r = resolve(&auth).unwrap();
        assert_eq!(r.source, AuthSource::ResolvedProfile);
    }

    #[test]
    fn resolved_profile_key() {
        let auth = LeaseAuth {
            github_token: None,
            ..everything()
        };
        let r = resolve(&auth).unwrap();
        assert_eq!(r.mode, AuthMode::Token);
        assert_eq!(r.source, AuthSource::ResolvedProfile);
        assert_eq!(r.profile_id.as_deref(), Some("gw-profile"));
        assert_eq!(r.profile_version, Some(fingerprint("resolved-key")));
        assert_eq!(r.token.as_ref().map(Secret::expose), Some("resolved-key"));

        let auth = LeaseAuth {
            github_token: None,
            auth_profile_id: None,
            ..everything()
        };
        assert_eq!(
            resolve(&auth).unwrap().profile_id.as_deref(),
            Some("resolved")
        );
        let auth = LeaseAuth {
            github_token: None,
            auth_profile_id: Some(String::new()),
            ..everything()
        };
        assert_eq!(
            resolve(&auth).unwrap().profile_id.as_deref(),
            Some("resolved")
        );
    }

    #[test]
    fn empty_resolved_key_counts_as_absent() {
        let auth = LeaseAuth {
            github_token: None,
            resolved_api_key: Some(Secret::new("")),
            ..everything()
        };
        assert_eq!(resolve(&auth).unwrap().source, AuthSource::Env("GH_TOKEN"));
    }

    #[test]
    fn env_in_precedence_order() {
        let all = env(&[
            ("GITHUB_TOKEN", "t4"),
            ("GH_TOKEN", "t3"),
            ("COPILOT_GITHUB_TOKEN", "t2"),
            ("OPENCLAW_GITHUB_TOKEN", "t1"),
            ("UNRELATED", "x"),
        ]);
        let mut auth = LeaseAuth {
            env: all,
            ..LeaseAuth::default()
        };
        for (name, value) in ENV_TOKEN_VARIABLES.iter().zip(["t1", "t2", "t3", "t4"]) {
            let r = resolve(&auth).unwrap();
            assert_eq!(r.mode, AuthMode::Token);
            assert_eq!(r.source, AuthSource::Env(name));
            assert_eq!(r.profile_id, Some(format!("env:{name}")));
            assert_eq!(r.profile_version, Some(fingerprint(value)));
            assert_eq!(r.token.as_ref().map(Secret::expose), Some(value));
            // An empty value counts as absent: the next variable wins.
            auth.env.insert((*name).to_owned(), Secret::new(""));
        }
        let r = resolve(&auth).unwrap();
        assert_eq!(r.source, AuthSource::DefaultLoggedInUser);
    }

    #[test]
    fn nothing_means_logged_in_user() {
        let r = resolve(&LeaseAuth::default()).unwrap();
        assert_eq!(r.mode, AuthMode::LoggedInUser);
        assert_eq!(r.source, AuthSource::DefaultLoggedInUser);
        assert_eq!(r.token, None);
        let r = resolve(&LeaseAuth {
            env: env(&[("UNRELATED_TOKEN", "x")]),
            ..LeaseAuth::default()
        })
        .unwrap();
        assert_eq!(r.source, AuthSource::DefaultLoggedInUser);
    }

    #[test]
    fn a_lease_that_forbids_the_logged_in_user_refuses_asking_for_it_and_otherwise_runs_without_identity()
     {
        // Asking for the logged-in user is refused, even with a token beside it.
        let asked = LeaseAuth {
            use_logged_in_user: true,
            forbid_logged_in_user: true,
            ..everything()
        };
        let err = resolve(&asked).unwrap_err();
        assert_eq!(err, AuthError::LoggedInUserNotAllowed);
        let text = err.to_string();
        assert!(text.contains("allow_logged_in_user"), "{text}");
        assert!(text.contains("resolved_token"), "{text}");
        assert!(!text.contains(TOKEN), "{text}");
        // Every token level still works.
        let forbid = |auth: LeaseAuth| LeaseAuth {
            forbid_logged_in_user: true,
            ..auth
        };
        assert_eq!(
            resolve(&forbid(everything())).unwrap().source,
            AuthSource::ExplicitToken
        );
        let env_only = forbid(LeaseAuth {
            env: env(&[("GITHUB_TOKEN", "t4")]),
            ..LeaseAuth::default()
        });
        assert_eq!(
            resolve(&env_only).unwrap().source,
            AuthSource::Env("GITHUB_TOKEN")
        );
        // Nothing given: no identity at all (no token, no stored login), for BYOK only.
        let nothing = forbid(LeaseAuth {
            env: env(&[("GH_TOKEN", "")]),
            ..LeaseAuth::default()
        });
        let r = resolve(&nothing).unwrap();
        assert_eq!(r.mode, AuthMode::NoIdentity);
        assert_eq!(r.source, AuthSource::NoCredentials);
        assert_eq!(
            (r.profile_id, r.profile_version, r.token),
            (None, None, None)
        );
        assert_eq!(
            resolve_for_lease(&nothing, true).unwrap().mode,
            AuthMode::NoIdentity
        );
        let err = resolve_for_lease(&nothing, false).unwrap_err();
        assert_eq!(err, AuthError::NoCredentials);
        let text = err.to_string();
        for fix in ["github_token", "resolved_token", "BYOK", "env_fallback"] {
            assert!(text.contains(fix), "{fix} missing: {text}");
        }
        // Without the ban nothing changes: the logged-in user, with or without BYOK.
        for byok in [false, true] {
            let r = resolve_for_lease(&LeaseAuth::default(), byok).unwrap();
            assert_eq!(r.source, AuthSource::DefaultLoggedInUser);
        }
    }

    #[test]
    fn mode_strings() {
        assert_eq!(AuthMode::LoggedInUser.as_str(), "logged-in-user");
        assert_eq!(AuthMode::Token.as_str(), "token");
        assert_eq!(AuthMode::NoIdentity.as_str(), "none");
    }

    #[test]
    fn fingerprint_shape_stability_and_difference() {
        let a = fingerprint(TOKEN);
        assert!(a.starts_with("sha256:"), "{a}");
        assert_eq!(a.len(), "sha256:".len() + 32);
        assert!(
            a["sha256:".len()..]
                .chars()
                .all(|c| c.is_ascii_digit() || ('a'..='f').contains(&c)),
            "{a}"
        );
        assert_eq!(a, fingerprint(TOKEN));
        assert_ne!(a, fingerprint("ghp_other"));
        assert!(!a.contains(TOKEN));
        // Known vector: sha256("abc") = ba7816bf8f01cfea414140de5dae2223...
        assert_eq!(
            fingerprint("abc"),
            "sha256:ba7816bf8f01cfea414140de5dae2223"
        );
    }

    #[test]
    fn debug_never_shows_tokens() {
        let mut auth = everything();
        auth.env = env(&[("GH_TOKEN", TOKEN), ("OTHER", TOKEN)]);
        auth.resolved_api_key = Some(Secret::new(TOKEN));
        let text = format!("{auth:?}");
        assert!(!text.contains(TOKEN), "{text}");
        for auth in [
            auth.clone(),
            LeaseAuth {
                github_token: None,
                ..auth.clone()
            },
            LeaseAuth {
                github_token: None,
                resolved_api_key: None,
                ..auth.clone()
            },
        ] {
            let resolved = resolve(&auth).unwrap();
            assert!(resolved.token.is_some());
            let text = format!("{resolved:?}");
            assert!(!text.contains(TOKEN), "{text}");
        }
    }
}
