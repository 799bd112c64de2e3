//! The session rules of CLI backends (issue 17, item 4) as pure decisions: which auth
//! identity a lease runs as ([`identity`]), which credential its process holds
//! ([`credential`]), and whether a lease resumes the stored CLI session, starts a fresh one,
//! or fails `transcript-missing` ([`decide`]). No file system, no clock: the caller says
//! whether the transcript exists.

use crate::auth::fingerprint;
use crate::secret::Secret;

/// What a CLI backend's lease authenticates with: the model endpoint, the key, and the
/// profile the key belongs to (a gateway auth profile: the key may be refreshed under it).
#[derive(Clone, Default)]
pub(crate) struct CliCredentials {
    /// The model endpoint (`ANTHROPIC_BASE_URL` for Claude), `None` for the CLI's default.
    pub base_url: Option<String>,
    /// The key (`ANTHROPIC_API_KEY` for Claude).
    pub api_key: Option<Secret>,
    /// The auth profile (account) the key belongs to, when the gateway named one.
    pub profile_id: Option<String>,
}

impl std::fmt::Debug for CliCredentials {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CliCredentials")
            .field("base_url", &crate::secret::RedactedUrl(&self.base_url))
            .field("api_key", &self.api_key)
            .field("profile_id", &self.profile_id)
            .finish()
    }
}

/// The auth identity of a lease: the endpoint and the profile when one is named (a token
/// refresh under the same profile keeps it), else the endpoint and the static key itself
/// (another key is another identity). A stored session is resumed only under the identity
/// that created it.
pub(crate) fn identity(creds: &CliCredentials) -> String {
    let base = creds.base_url.as_deref().unwrap_or("");
    let profile = creds.profile_id.as_deref().filter(|p| !p.is_empty());
    let key = creds.api_key.as_ref().filter(|k| !k.is_empty());
    match (profile, key) {
        (Some(profile), _) => fingerprint(&format!("profile\n{base}\n{profile}")),
        (None, Some(key)) => fingerprint(&format!("key\n{base}\n{}", key.expose())),
        (None, None) => fingerprint(&format!("none\n{base}")),
    }
}

/// The credential a CLI process is started with (endpoint, profile and key): a process holds
/// its key in its environment, so a refreshed key needs a new process (which resumes the
/// session when the identity is the same), and a process never serves another identity
/// (another profile with the same key is another process, whose open drops the session).
pub(crate) fn credential(creds: &CliCredentials) -> String {
    let base = creds.base_url.as_deref().unwrap_or("");
    let profile = creds.profile_id.as_deref().unwrap_or("");
    let key = creds.api_key.as_ref().map_or("", Secret::expose);
    fingerprint(&format!("{base}\n{profile}\n{key}"))
}

/// The stored CLI session of a (conversation, backend).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct StoredSession {
    /// The CLI's session id.
    pub session_id: String,
    /// The identity ([`identity`]) it was created under.
    pub identity: String,
}

/// How a lease opens its CLI session.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum SessionDecision {
    /// Resume the stored session (`--resume <id>`).
    Resume(String),
    /// No stored session: a new one.
    New,
    /// The auth identity changed: the stored session is dropped and a new one starts.
    IdentityChanged,
    /// The lease runs in another directory than the turns did, and the CLI filed the
    /// session by the directory they ran in (Claude Code, Gemini CLI): a new session starts
    /// here, as the Copilot runtime's conversation does when its directory changes.
    Moved,
}

/// The stored session's transcript is gone: resuming it would not carry the history.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct TranscriptMissing {
    /// The stored session id.
    pub session_id: String,
}

/// Decides how a lease under `identity` opens its session, given the stored one and
/// whether its transcript exists where the lease runs (asked only when it would be resumed)
/// and, when it is not found there, whether it is where the conversation's turns ran (`false`
/// when they ran where the lease runs: the binding recorded no other directory).
pub(crate) fn decide(
    stored: Option<&StoredSession>,
    identity: &str,
    transcript_exists: impl FnOnce(&str) -> bool,
    transcript_where_it_ran: impl FnOnce(&str) -> bool,
) -> Result<SessionDecision, TranscriptMissing> {
    let Some(stored) = stored else {
        return Ok(SessionDecision::New);
    };
    if stored.identity != identity {
        return Ok(SessionDecision::IdentityChanged);
    }
    if transcript_exists(&stored.session_id) {
        Ok(SessionDecision::Resume(stored.session_id.clone()))
    } else if transcript_where_it_ran(&stored.session_id) {
        Ok(SessionDecision::Moved)
    } else {
        Err(TranscriptMissing {
            session_id: stored.session_id.clone(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn creds(base: &str, key: &str, profile: Option<&str>) -> CliCredentials {
        CliCredentials {
            base_url: Some(base.to_owned()),
            api_key: Some(Secret::new(key)),
            profile_id: profile.map(str::to_owned),
        }
    }

    #[test]
    fn a_token_refresh_under_the_same_profile_keeps_the_identity_but_not_the_credential() {
        let before = creds("http://m", "key-1", Some("team-a"));
        let after = creds("http://m", "key-2", Some("team-a"));
        assert_eq!(identity(&before), identity(&after));
        assert_ne!(credential(&before), credential(&after));
    }

    #[test]
    fn another_identity_with_the_same_key_is_another_credential_so_no_process_is_shared() {
        let a = creds("http://m", "key-1", Some("team-a"));
        let b = creds("http://m", "key-1", Some("team-b"));
        assert_ne!(identity(&a), identity(&b));
        assert_ne!(credential(&a), credential(&b));
    }

    #[test]
    fn another_static_key_profile_or_endpoint_is_another_identity() {
        let base = identity(&creds("http://m", "key-1", None));
        assert_ne!(base, identity(&creds("http://m", "key-2", None)));
        assert_ne!(base, identity(&creds("http://other", "key-1", None)));
        let profile = identity(&creds("http://m", "key-1", Some("team-a")));
        assert_ne!(
            profile,
            identity(&creds("http://m", "key-1", Some("team-b")))
        );
        assert_ne!(base, profile);
    }

    #[test]
    fn the_identity_never_shows_the_key() {
        let id = identity(&creds("http://m", "sk-very-secret", None));
        assert!(!id.contains("very-secret"), "{id}");
        assert!(id.starts_with("sha256:"));
    }

    #[test]
    fn a_stored_session_is_resumed_only_under_its_identity_and_with_its_transcript() {
        let stored = StoredSession {
            session_id: "s1".into(),
            identity: "id-a".into(),
        };
        let nowhere = |_: &str| false;
        assert_eq!(
            decide(None, "id-a", |_| true, nowhere),
            Ok(SessionDecision::New)
        );
        assert_eq!(
            decide(Some(&stored), "id-a", |id| id == "s1", nowhere),
            Ok(SessionDecision::Resume("s1".into()))
        );
        // Never a silent fresh start when the transcript is gone.
        assert_eq!(
            decide(Some(&stored), "id-a", |_| false, nowhere),
            Err(TranscriptMissing {
                session_id: "s1".into()
            })
        );
        // Moved to another directory: resumed where the CLI finds it from there (Codex),
        // else a new session when it is filed where the turns ran, else still missing.
        let moved = stored.clone();
        assert_eq!(
            decide(Some(&moved), "id-a", |_| true, nowhere),
            Ok(SessionDecision::Resume("s1".into()))
        );
        assert_eq!(
            decide(Some(&moved), "id-a", |_| false, |id| id == "s1"),
            Ok(SessionDecision::Moved)
        );
        assert_eq!(
            decide(Some(&moved), "id-a", |_| false, nowhere),
            Err(TranscriptMissing {
                session_id: "s1".into()
            })
        );
        // Another identity drops the session, whatever is on disk.
        let mut asked = false;
        assert_eq!(
            decide(
                Some(&stored),
                "id-b",
                |_| {
                    asked = true;
                    true
                },
                nowhere
            ),
            Ok(SessionDecision::IdentityChanged)
        );
        assert!(
            !asked,
            "the transcript is not consulted for a dropped session"
        );
    }
}
