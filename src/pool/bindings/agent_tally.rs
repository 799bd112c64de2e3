//! How many conversations each agent keeps in one binding store, what
//! `max_conversations_per_agent` is checked against: the bound session keys of each agent
//! (as SHA-256 digests: the keys are the callers', so no two can be made to collide; from
//! a listing when the store opens with a tally, then kept by its
//! `put` and `remove`) and the new conversations being opened, each held by its
//! [`Reservation`]s until its binding is written or its leases end. A key written again, or
//! leased twice while it opens, is counted once; a key naming no agent is not counted.

use std::collections::hash_map::Entry;
use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex, MutexGuard};

use sha2::{Digest, Sha256};

use crate::ids::ConversationId;

/// One agent's conversations.
#[derive(Debug, Default)]
struct Held {
    /// The digests of its bound session keys.
    bound: HashSet<Digest32>,
    /// New conversations being opened: their digests and how many reservations hold each.
    opening: HashMap<Digest32, usize>,
}

impl Held {
    /// Its conversations: bound, or being opened and not bound yet.
    fn count(&self) -> usize {
        let unbound = self.opening.keys().filter(|k| !self.bound.contains(*k));
        self.bound.len() + unbound.count()
    }
}

/// The conversations of every agent of one store. Shared by the store's clones.
#[derive(Debug, Default)]
pub(crate) struct AgentTally {
    agents: Mutex<HashMap<String, Held>>,
}

/// A session key's SHA-256.
type Digest32 = [u8; 32];

/// The agent a session key names and the key's digest; `None` for a key that names none.
fn agent_and_digest(session_key: &str) -> Option<(&str, Digest32)> {
    let (agent, _) = ConversationId::split_key(session_key)?;
    Some((agent, Sha256::digest(session_key.as_bytes()).into()))
}

impl AgentTally {
    /// The tally of the bound session keys `keys`.
    pub(crate) fn of<'a>(keys: impl IntoIterator<Item = &'a str>) -> Self {
        let tally = Self::default();
        for key in keys {
            tally.bound(key);
        }
        tally
    }

    fn agents(&self) -> MutexGuard<'_, HashMap<String, Held>> {
        // The counts stay consistent under a panic elsewhere (each change is one step).
        self.agents.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// `session_key` is bound now (written, perhaps again).
    pub(crate) fn bound(&self, session_key: &str) {
        if let Some((agent, digest)) = agent_and_digest(session_key) {
            self.agents()
                .entry(agent.to_owned())
                .or_default()
                .bound
                .insert(digest);
        }
    }

    /// `session_key`'s binding is gone.
    pub(crate) fn unbound(&self, session_key: &str) {
        let Some((agent, digest)) = agent_and_digest(session_key) else {
            return;
        };
        let mut agents = self.agents();
        if let Some(held) = agents.get_mut(agent) {
            held.bound.remove(&digest);
            if held.count() == 0 {
                agents.remove(agent);
            }
        }
    }

    /// Holds a place for the new conversation `session_key` while it is opened, if its agent
    /// keeps fewer than `max` conversations (bound or being opened) or this one is being
    /// opened already; else the number it keeps. A key already bound, or one naming no
    /// agent, needs no place (`Ok(None)`).
    pub(crate) fn reserve(
        self: &Arc<Self>,
        session_key: &str,
        max: usize,
    ) -> Result<Option<Reservation>, usize> {
        let Some((agent, digest)) = agent_and_digest(session_key) else {
            return Ok(None);
        };
        let mut agents = self.agents();
        let held = agents.entry(agent.to_owned()).or_default();
        if held.bound.contains(&digest) {
            return Ok(None);
        }
        if !held.opening.contains_key(&digest) && held.count() >= max {
            let count = held.count();
            if count == 0 {
                agents.remove(agent);
            }
            return Err(count);
        }
        *held.opening.entry(digest).or_default() += 1;
        Ok(Some(Reservation {
            tally: self.clone(),
            agent: agent.to_owned(),
            digest,
        }))
    }

    /// The conversations `agent` keeps: bound, and being opened.
    #[cfg(test)]
    fn count(&self, agent: &str) -> usize {
        self.agents().get(agent).map_or(0, Held::count)
    }
}

/// A new conversation's place in its agent's count while it is opened; given back when
/// dropped (by then its binding, if written, counts in its place).
#[derive(Debug)]
pub(crate) struct Reservation {
    tally: Arc<AgentTally>,
    agent: String,
    digest: Digest32,
}

impl Drop for Reservation {
    fn drop(&mut self) {
        let mut agents = self.tally.agents();
        if let Some(held) = agents.get_mut(&self.agent) {
            if let Entry::Occupied(mut holders) = held.opening.entry(self.digest) {
                *holders.get_mut() -= 1;
                if *holders.get() == 0 {
                    holders.remove();
                }
            }
            if held.count() == 0 {
                agents.remove(&self.agent);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_agent_at_its_cap_is_refused_a_new_conversation_but_not_one_it_keeps() {
        let tally = Arc::new(AgentTally::of(["a/one", "a/two", "b/one"]));
        assert_eq!(tally.count("a"), 2);
        assert_eq!(tally.reserve("a/three", 2).map(|r| r.is_some()), Err(2));
        // Its own conversations are no new ones; another agent's count is its own.
        assert!(matches!(tally.reserve("a/one", 2), Ok(None)));
        assert!(matches!(tally.reserve("b/two", 2), Ok(Some(_))));
        // A binding gone frees its place.
        tally.unbound("a/two");
        let place = tally.reserve("a/three", 2).expect("a place").expect("held");
        assert_eq!(tally.count("a"), 2);
        // Held while it opens: a second new one is refused meanwhile, a second lease of the
        // same one is not.
        assert_eq!(tally.reserve("a/four", 2).map(|r| r.is_some()), Err(2));
        let again = tally
            .reserve("a/three", 2)
            .expect("the same one")
            .expect("held");
        assert_eq!(tally.count("a"), 2);
        drop(again);
        assert_eq!(tally.count("a"), 2, "still held by the first");
        // Bound, then its reservation given back: counted once.
        tally.bound("a/three");
        drop(place);
        assert_eq!(tally.count("a"), 2);
    }

    #[test]
    fn an_open_that_fails_gives_its_place_back() {
        let tally = Arc::new(AgentTally::default());
        let place = tally.reserve("a/one", 1).expect("a place");
        assert_eq!(tally.count("a"), 1);
        drop(place);
        assert_eq!(tally.count("a"), 0);
        assert!(
            tally.agents().is_empty(),
            "nothing kept for an agent with none"
        );
    }

    #[test]
    fn a_key_written_again_counts_once_and_keys_naming_no_agent_not_at_all() {
        let tally = AgentTally::of(["a/one", "a/one", "no-agent"]);
        tally.bound("a/one");
        assert_eq!(tally.count("a"), 1);
        assert_eq!(tally.count("no-agent"), 0);
        tally.unbound("a/one");
        tally.unbound("a/one");
        assert_eq!(tally.count("a"), 0);
    }
}
