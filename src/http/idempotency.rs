//! `Idempotency-Key` on `POST /v1/turns`: a gateway that retries a turn whose answer it lost
//! (its connection dropped after the turn ended) gets that turn's `turn.end` again instead of
//! running the prompt a second time.
//!
//! * [`Replays`] — the keys seen, per conversation: the body's hash and the turn's state
//!   (running, or ended with its summary). An ended turn's summary is kept for
//!   [`IdempotencyLimits::ttl`] and within [`IdempotencyLimits::max_bytes`] (past the bytes,
//!   the oldest of the agent holding the most is forgotten first, so one busy agent's turns
//!   push out its own replays, not a quiet agent's); a running one for as long as it runs. In memory: a restart of the
//!   daemon, or another replica, does not know the key (the retry runs).
//! * [`Claim`] — what a request with a key gets: to run (holding a [`Pending`] that records
//!   the turn's end), or the running turn's refusal, or the ended turn's summary, or the
//!   refusal of a key used before for another body.
//!
//! A turn that ends without its summary (its lease failed, or its gateway went away and it
//! was aborted) forgets its key when its [`Pending`] drops, so the gateway's retry runs it.
//! No I/O: a claim is given the time, and a turn's end reads the clock.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::fallback::TurnSummary;

/// The longest `Idempotency-Key` taken (as Stripe's: 255 characters).
pub(super) const MAX_KEY_CHARS: usize = 255;

/// What an ended entry takes besides its summary's JSON and its scope: the map's and the
/// order's slots, the hash, the counters.
const ENTRY_OVERHEAD: usize = 160;

/// How long, and within how many bytes, the ends of turns asked with an `Idempotency-Key`
/// are kept for their retries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct IdempotencyLimits {
    /// How long after its end a turn's summary answers a retry (default one hour; zero
    /// keeps none: a retry after the end runs again).
    pub ttl: Duration,
    /// Bytes of ended turns kept at most, each counted as its summary's JSON and its keys
    /// (default 16 MiB); past it the oldest of the agent holding the most bytes are
    /// forgotten first, and a summary larger than the whole bound is not kept.
    pub max_bytes: usize,
}

impl Default for IdempotencyLimits {
    fn default() -> Self {
        Self {
            ttl: Duration::from_secs(3600),
            max_bytes: 16 << 20,
        }
    }
}

/// What a request carrying a key gets.
pub(super) enum Claim {
    /// First seen: run the turn, and record its end with the [`Pending`].
    Run(Pending),
    /// A turn with this key is running now (its answer goes to the request that started it).
    Running,
    /// The turn with this key ended: its summary.
    Ended(Arc<TurnSummary>),
    /// The key was used for another body.
    OtherBody,
}

/// The conversation (its key) and the gateway's `Idempotency-Key`.
type Scope = (String, String);

enum State {
    Running,
    Ended(Arc<TurnSummary>),
}

struct Entry {
    body: [u8; 32],
    /// Tells this entry from an earlier one of the same scope (a [`Pending`] acts only on
    /// its own).
    generation: u64,
    state: State,
}

/// An ended turn's place in the order of forgetting.
struct Ended {
    scope: Scope,
    generation: u64,
    at: Instant,
    bytes: usize,
}

#[derive(Default)]
struct Core {
    entries: HashMap<Scope, Entry>,
    /// The ended entries, oldest first.
    ended: VecDeque<Ended>,
    bytes: usize,
    /// The bytes of the ended entries of each agent (none at 0).
    agent_bytes: HashMap<String, usize>,
    next_generation: u64,
}

/// The agent of a conversation's key (`agent/session key`).
fn agent_of(scope: &Scope) -> &str {
    crate::ids::ConversationId::split_key(&scope.0).map_or(scope.0.as_str(), |(agent, _)| agent)
}

/// The keys seen (see the module's documentation).
pub(super) struct Replays {
    limits: IdempotencyLimits,
    core: Mutex<Core>,
}

impl Replays {
    pub(super) fn new(limits: IdempotencyLimits) -> Arc<Self> {
        Arc::new(Self {
            limits,
            core: Mutex::new(Core::default()),
        })
    }

    /// Claims `key` of `conversation` for a request whose body hashes to `body`.
    pub(super) fn claim(
        self: &Arc<Self>,
        conversation: String,
        key: String,
        body: [u8; 32],
        now: Instant,
    ) -> Claim {
        let Ok(mut core) = self.core.lock() else {
            // A poisoned map answers no replay: the turn runs, as without a key.
            return Claim::Run(Pending::detached());
        };
        core.forget_old(now, &self.limits);
        let scope = (conversation, key);
        match core.entries.get(&scope) {
            Some(entry) if entry.body != body => Claim::OtherBody,
            Some(Entry {
                state: State::Running,
                ..
            }) => Claim::Running,
            Some(Entry {
                state: State::Ended(summary),
                ..
            }) => Claim::Ended(summary.clone()),
            None => {
                core.next_generation += 1;
                let generation = core.next_generation;
                core.entries.insert(
                    scope.clone(),
                    Entry {
                        body,
                        generation,
                        state: State::Running,
                    },
                );
                Claim::Run(Pending {
                    replays: Some(self.clone()),
                    scope,
                    generation,
                })
            }
        }
    }

    fn end(&self, scope: &Scope, generation: u64, summary: Option<&TurnSummary>, now: Instant) {
        let Ok(mut core) = self.core.lock() else {
            return;
        };
        if core
            .entries
            .get(scope)
            .is_none_or(|e| e.generation != generation)
        {
            return;
        }
        // What an ended entry holds: the summary as its JSON would be, and its scope twice
        // (the map's key, the order's).
        let bytes = summary.map(|s| {
            serde_json::to_vec(s)
                .map_or(usize::MAX, |json| json.len())
                .saturating_add(2 * (scope.0.len() + scope.1.len()) + ENTRY_OVERHEAD)
        });
        // None kept (no summary, no TTL, or one larger than the whole bound): forgotten.
        let (Some(summary), Some(bytes)) = (summary, bytes) else {
            core.entries.remove(scope);
            return;
        };
        if self.limits.ttl.is_zero() || bytes > self.limits.max_bytes {
            core.entries.remove(scope);
            return;
        }
        if let Some(entry) = core.entries.get_mut(scope) {
            entry.state = State::Ended(Arc::new(summary.clone()));
        }
        core.bytes += bytes;
        *core
            .agent_bytes
            .entry(agent_of(scope).to_owned())
            .or_default() += bytes;
        core.ended.push_back(Ended {
            scope: scope.clone(),
            generation,
            at: now,
            bytes,
        });
        core.forget_old(now, &self.limits);
    }

    #[cfg(test)]
    fn keys(&self) -> usize {
        self.core.lock().map(|c| c.entries.len()).unwrap_or(0)
    }
}

impl Core {
    /// Forgets the ended turns past the time limit, then, while past the bytes, the oldest
    /// of the agent holding the most bytes.
    fn forget_old(&mut self, now: Instant, limits: &IdempotencyLimits) {
        while self
            .ended
            .front()
            .is_some_and(|oldest| now.saturating_duration_since(oldest.at) >= limits.ttl)
        {
            self.forget_at(0);
        }
        while self.bytes > limits.max_bytes {
            let Some(heaviest) = self
                .agent_bytes
                .iter()
                .max_by_key(|(_, bytes)| **bytes)
                .map(|(agent, _)| agent.clone())
            else {
                break;
            };
            let Some(at) = self
                .ended
                .iter()
                .position(|e| agent_of(&e.scope) == heaviest)
            else {
                break;
            };
            self.forget_at(at);
        }
    }

    /// Forgets the ended entry at `at` of the order.
    fn forget_at(&mut self, at: usize) {
        let Some(ended) = self.ended.remove(at) else {
            return;
        };
        self.bytes -= ended.bytes;
        let agent = agent_of(&ended.scope);
        if let Some(held) = self.agent_bytes.get_mut(agent) {
            *held -= ended.bytes;
            if *held == 0 {
                self.agent_bytes.remove(agent);
            }
        }
        if self
            .entries
            .get(&ended.scope)
            .is_some_and(|e| e.generation == ended.generation)
        {
            self.entries.remove(&ended.scope);
        }
    }
}

/// A claimed key whose turn runs: [`Pending::ended`] records its summary; dropped without
/// it, the key is forgotten (the retry runs the turn).
pub(super) struct Pending {
    replays: Option<Arc<Replays>>,
    scope: Scope,
    generation: u64,
}

impl Pending {
    /// A claim that records nothing (no key, or a map that cannot be used).
    pub(super) fn detached() -> Self {
        Self {
            replays: None,
            scope: (String::new(), String::new()),
            generation: 0,
        }
    }

    /// The turn ran to its end with `summary` (its gateway still there): a retry gets it.
    pub(super) fn ended(mut self, summary: &TurnSummary) {
        if let Some(replays) = self.replays.take() {
            replays.end(&self.scope, self.generation, Some(summary), Instant::now());
        }
    }
}

impl Drop for Pending {
    fn drop(&mut self) {
        if let Some(replays) = self.replays.take() {
            replays.end(&self.scope, self.generation, None, Instant::now());
        }
    }
}

/// The key of a request's `Idempotency-Key` header: `None` without one; refused (with what
/// to send) when empty, longer than [`MAX_KEY_CHARS`], or not visible ASCII.
pub(super) fn key_of(headers: &axum::http::HeaderMap) -> Result<Option<String>, String> {
    let Some(value) = headers.get("idempotency-key") else {
        return Ok(None);
    };
    let key = value
        .to_str()
        .ok()
        .filter(|k| !k.is_empty() && k.len() <= MAX_KEY_CHARS)
        .filter(|k| k.bytes().all(|b| b.is_ascii_graphic()));
    match key {
        Some(key) => Ok(Some(key.to_owned())),
        None => Err(format!(
            "Idempotency-Key must be 1 to {MAX_KEY_CHARS} visible ASCII characters (a UUID, \
             say), one per turn the gateway means to run"
        )),
    }
}

/// The SHA-256 of a request body, what a retry must repeat with its key.
pub(super) fn body_hash(body: &[u8]) -> [u8; 32] {
    use sha2::{Digest, Sha256};
    Sha256::digest(body).into()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn summary(text: &str) -> TurnSummary {
        let mut summary = crate::fallback::TurnSummary::for_tests();
        summary.final_text = text.to_owned();
        summary
    }

    fn claim(replays: &Arc<Replays>, key: &str, body: &[u8], now: Instant) -> Claim {
        replays.claim(
            "agent/conv".to_owned(),
            key.to_owned(),
            body_hash(body),
            now,
        )
    }

    #[test]
    fn a_retry_gets_the_ended_turns_summary_and_a_retry_during_it_is_told_it_runs() {
        let replays = Replays::new(IdempotencyLimits::default());
        let now = Instant::now();
        let Claim::Run(pending) = claim(&replays, "k1", b"body", now) else {
            panic!("first claim runs");
        };
        assert!(matches!(
            claim(&replays, "k1", b"body", now),
            Claim::Running
        ));
        assert!(matches!(
            claim(&replays, "k1", b"other body", now),
            Claim::OtherBody
        ));
        pending.ended(&summary("done"));
        match claim(&replays, "k1", b"body", now) {
            Claim::Ended(s) => assert_eq!(s.final_text, "done"),
            _ => panic!("the retry gets the summary"),
        }
        // Another conversation's same key is its own.
        assert!(matches!(
            replays.claim("agent/other".into(), "k1".into(), body_hash(b"body"), now),
            Claim::Run(_)
        ));
    }

    #[test]
    fn a_turn_that_ends_without_its_summary_forgets_its_key_so_the_retry_runs() {
        let replays = Replays::new(IdempotencyLimits::default());
        let now = Instant::now();
        let Claim::Run(pending) = claim(&replays, "k", b"body", now) else {
            panic!("runs");
        };
        drop(pending);
        assert_eq!(replays.keys(), 0);
        assert!(matches!(claim(&replays, "k", b"body", now), Claim::Run(_)));
    }

    #[test]
    fn ended_turns_are_forgotten_after_the_ttl_and_oldest_first_past_the_bytes() {
        let limits = IdempotencyLimits {
            ttl: Duration::from_secs(60),
            max_bytes: 3100,
        };
        let replays = Replays::new(limits);
        let start = Instant::now();
        for (key, text) in [("a", "x".repeat(1000)), ("b", "y".repeat(1000))] {
            let Claim::Run(pending) = claim(&replays, key, b"body", start) else {
                panic!("runs");
            };
            pending.ended(&summary(&text));
        }
        // Both fit (2 x ~1.5 KB); a third pushes the oldest out.
        assert!(matches!(
            claim(&replays, "a", b"body", start),
            Claim::Ended(_)
        ));
        let Claim::Run(pending) = claim(&replays, "c", b"body", start) else {
            panic!("runs");
        };
        pending.ended(&summary(&"z".repeat(1000)));
        assert!(matches!(
            claim(&replays, "a", b"body", start),
            Claim::Run(_)
        ));
        assert!(matches!(
            claim(&replays, "b", b"body", start),
            Claim::Ended(_)
        ));
        // One larger than the whole bound is not kept (nor does it push the others out).
        let Claim::Run(pending) = claim(&replays, "huge", b"body", start) else {
            panic!("runs");
        };
        pending.ended(&summary(&"h".repeat(5000)));
        assert!(matches!(
            claim(&replays, "huge", b"body", start),
            Claim::Run(_)
        ));
        assert!(matches!(
            claim(&replays, "c", b"body", start),
            Claim::Ended(_)
        ));
        // Past the TTL nothing ended is kept.
        let later = start + Duration::from_secs(61);
        assert!(matches!(
            claim(&replays, "b", b"body", later),
            Claim::Run(_)
        ));
        assert!(matches!(
            claim(&replays, "c", b"body", later),
            Claim::Run(_)
        ));
    }

    #[test]
    fn past_the_bytes_a_busy_agents_replays_go_before_a_quiet_agents() {
        let replays = Replays::new(IdempotencyLimits {
            ttl: Duration::from_secs(60),
            max_bytes: 4700,
        });
        let now = Instant::now();
        let end = |conversation: &str, key: &str| {
            let Claim::Run(pending) = replays.claim(
                conversation.to_owned(),
                key.to_owned(),
                body_hash(b"body"),
                now,
            ) else {
                panic!("runs");
            };
            pending.ended(&summary(&"x".repeat(1000)));
        };
        let replayed = |conversation: &str, key: &str| {
            matches!(
                replays.claim(
                    conversation.to_owned(),
                    key.to_owned(),
                    body_hash(b"body"),
                    now
                ),
                Claim::Ended(_)
            )
        };
        // The quiet agent's turn ended first; then the busy one's, more than fit.
        end("quiet/c", "q1");
        for key in ["b1", "b2", "b3", "b4"] {
            end("busy/c", key);
        }
        assert!(replayed("quiet/c", "q1"), "the quiet agent's oldest stays");
        assert!(!replayed("busy/c", "b1"), "the busy agent's oldest went");
        assert!(replayed("busy/c", "b4"));
    }

    #[test]
    fn a_running_turn_is_kept_past_the_ttl_and_a_zero_ttl_keeps_no_summary() {
        let replays = Replays::new(IdempotencyLimits {
            ttl: Duration::ZERO,
            max_bytes: 1 << 20,
        });
        let start = Instant::now();
        let Claim::Run(pending) = claim(&replays, "k", b"body", start) else {
            panic!("runs");
        };
        let later = start + Duration::from_secs(7200);
        assert!(matches!(
            claim(&replays, "k", b"body", later),
            Claim::Running
        ));
        pending.ended(&summary("done"));
        assert!(matches!(
            claim(&replays, "k", b"body", later),
            Claim::Run(_)
        ));
    }

    #[test]
    fn a_key_is_visible_ascii_of_at_most_255_characters() {
        let headers = |value: &str| {
            let mut h = axum::http::HeaderMap::new();
            h.insert(
                "idempotency-key",
                axum::http::HeaderValue::from_str(value).expect("header"),
            );
            h
        };
        assert_eq!(key_of(&axum::http::HeaderMap::new()), Ok(None));
        assert_eq!(
            key_of(&headers("3f1c-…".replace('…', "x").as_str())),
            Ok(Some("3f1c-x".into()))
        );
        for bad in ["", "has space", &"k".repeat(256)] {
            let refused = key_of(&headers(bad)).expect_err(bad);
            assert!(refused.contains("Idempotency-Key must be"), "{refused}");
        }
    }
}
