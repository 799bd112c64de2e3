//! Which agent a connection token belongs to. The table holds SHA-256 hashes only, so the
//! daemon's config never stores a client's token; a presented token is hashed and looked up.

use std::collections::HashMap;

use crate::home::validate_agent_id;
use crate::secret::Secret;

/// A connection-token table entry that cannot be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TokenError {
    /// Not 64 hexadecimal digits.
    #[error(
        "the token hash for agent {agent:?} is not a SHA-256 in hex (64 hex digits); compute \
         it with `printf %s \"$TOKEN\" | sha256sum`"
    )]
    NotAHash {
        /// The agent it was given for.
        agent: String,
    },
    /// The hash of the empty string: the hash `printf %s "$TOKEN" | sha256sum` prints with
    /// `$TOKEN` unset, which a client sending no token at all would match.
    #[error(
        "the token hash for agent {agent:?} is the SHA-256 of an empty token (was $TOKEN unset \
         when it was computed?), which a client sending no token would match; give the agent \
         a real token and list its hash"
    )]
    EmptyToken {
        /// The agent it was given for.
        agent: String,
    },
    /// The agent id is not valid.
    #[error("connection token for agent {agent:?}: {reason}")]
    BadAgent {
        /// The agent id as given.
        agent: String,
        /// Why it is refused.
        reason: String,
    },
    /// Two agents were given the same token.
    #[error(
        "agents {first:?} and {second:?} have the same connection token; give every agent a \
         token of its own (a token names exactly one agent)"
    )]
    Shared {
        /// The agent listed first.
        first: String,
        /// The agent listed second.
        second: String,
    },
}

/// Connection tokens (as SHA-256 hashes) and the agent each one names.
#[derive(Clone, Default)]
pub struct AgentTokens {
    by_hash: HashMap<String, String>,
}

impl std::fmt::Debug for AgentTokens {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut agents: Vec<&String> = self.by_hash.values().collect();
        agents.sort();
        f.debug_struct("AgentTokens")
            .field("agents", &agents)
            .finish()
    }
}

impl AgentTokens {
    /// An empty table (every `connect` fails).
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds `agent`'s token by its SHA-256 in hex (upper or lower case).
    pub fn add_hash(&mut self, agent: &str, sha256_hex: &str) -> Result<(), TokenError> {
        validate_agent_id(agent).map_err(|e| TokenError::BadAgent {
            agent: agent.to_owned(),
            reason: e.to_string(),
        })?;
        let hash = sha256_hex.trim().to_ascii_lowercase();
        if hash.len() != 64 || !hash.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Err(TokenError::NotAHash {
                agent: agent.to_owned(),
            });
        }
        if hash == self::sha256_hex("") {
            return Err(TokenError::EmptyToken {
                agent: agent.to_owned(),
            });
        }
        if let Some(first) = self.by_hash.get(&hash)
            && first != agent
        {
            return Err(TokenError::Shared {
                first: first.clone(),
                second: agent.to_owned(),
            });
        }
        self.by_hash.insert(hash, agent.to_owned());
        Ok(())
    }

    /// Adds `agent`'s token itself (hashed at once; the token is not kept).
    pub fn add_token(&mut self, agent: &str, token: &Secret) -> Result<(), TokenError> {
        self.add_hash(agent, &sha256_hex(token.expose()))
    }

    /// The agent a presented token names, if any (an empty token names none).
    pub fn agent_for(&self, token: &str) -> Option<&str> {
        if token.is_empty() {
            return None;
        }
        self.by_hash.get(&sha256_hex(token)).map(String::as_str)
    }

    /// How many tokens the table holds.
    pub fn len(&self) -> usize {
        self.by_hash.len()
    }

    /// Whether the table is empty.
    pub fn is_empty(&self) -> bool {
        self.by_hash.is_empty()
    }
}

pub use crate::ids::sha256_hex;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_token_names_the_agent_its_hash_was_given_for_and_no_other() {
        let mut tokens = AgentTokens::new();
        tokens.add_token("agent-a", &Secret::new("tok-a")).unwrap();
        tokens
            .add_hash("agent-b", &sha256_hex("tok-b").to_ascii_uppercase())
            .unwrap();
        assert_eq!(tokens.agent_for("tok-a"), Some("agent-a"));
        // The hash of an empty token (`$TOKEN` unset when it was computed) is refused: a
        // client sending no token would match it.
        for hash in [sha256_hex(""), sha256_hex("").to_ascii_uppercase()] {
            assert!(matches!(
                tokens.add_hash("agent-c", &hash),
                Err(TokenError::EmptyToken { .. })
            ));
        }
        assert!(tokens.add_token("agent-c", &Secret::new("")).is_err());
        assert_eq!(tokens.agent_for(""), None);
        assert_eq!(tokens.agent_for("tok-b"), Some("agent-b"));
        assert_eq!(tokens.agent_for("tok-c"), None);
        assert_eq!(tokens.agent_for(""), None);
        // Debug names agents, never hashes.
        let debug = format!("{tokens:?}");
        assert!(!debug.contains(&sha256_hex("tok-a")), "{debug}");
    }

    #[test]
    fn a_malformed_hash_a_bad_agent_or_a_shared_token_is_refused_with_the_fix() {
        let mut tokens = AgentTokens::new();
        let bad = tokens.add_hash("agent-a", "abc").unwrap_err().to_string();
        assert!(bad.contains("sha256sum"), "{bad}");
        assert!(matches!(
            tokens.add_hash("Bad Agent", &sha256_hex("x")),
            Err(TokenError::BadAgent { .. })
        ));
        tokens.add_hash("agent-a", &sha256_hex("same")).unwrap();
        assert!(matches!(
            tokens.add_hash("agent-b", &sha256_hex("same")),
            Err(TokenError::Shared { .. })
        ));
    }
}
