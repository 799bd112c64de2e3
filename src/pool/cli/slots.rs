//! The pure core of the CLI backends' placement: which conversation holds a CLI process
//! slot, the caps (processes in all, per key), one lease per conversation at a time, the
//! FIFO waiters, the LRU idle victim that makes room (its own, or the Copilot side's idle
//! worker when that one is older: `max_processes` is one budget, [`crate::pool::budget`]),
//! and each key's restart intensity
//! ([`RestartTracker`]: past it the key is quarantined). Events in, effects out; no
//! processes, no awaiting, the clock passed in.
//!
//! A slot is a conversation that holds a CLI process (parked between turns or leased). Its
//! key is (agent home, credential fingerprint, backend id): a conversation that comes back
//! with another key (a refreshed key) gives up its old slot first. A conversation parked
//! without a process (a `cli-oneshot` one between turns, one whose process died) is held,
//! so it is reused, but takes no slot: it counts in no cap and is no victim for room; its
//! next lease takes a slot as a new one does. Such conversations are at most
//! `max_processes` (each keeps its runner: its session, a Codex conversation's tools
//! bridge); past it the least recently used is closed.

use std::collections::{HashMap, HashSet, VecDeque};
use std::time::{Duration, Instant};

use crate::pool::budget::{Others, Room, has_room, make_room};
use crate::pool::restart::{RestartDecision, RestartPolicy, RestartTracker};

/// Which processes may serve a CLI lease.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(crate) struct CliKey {
    /// The agent's home for this backend.
    pub home: String,
    /// [`super::session::credential`] of the lease.
    pub credential: String,
    /// The backend id.
    pub backend: String,
    /// The backend's `serialize`: one lease at a time in its lane (this home and backend,
    /// any credential or conversation), the others waiting FIFO.
    pub serialize: bool,
}

impl CliKey {
    /// Whether `other` runs in the same serialized lane as this key.
    fn same_lane(&self, other: &CliKey) -> bool {
        self.serialize
            && other.serialize
            && self.home == other.home
            && self.backend == other.backend
    }
}

/// The caps.
#[derive(Clone, Debug)]
pub(crate) struct Caps {
    /// Processes in all, of every backend: the Copilot side's count in this budget too.
    pub max_processes: usize,
    /// Processes of one key.
    pub max_per_key: usize,
    /// Leases waiting at once.
    pub max_waiters: usize,
    /// Leases of one agent (every CLI backend's) waiting at once.
    pub max_waiters_per_agent: usize,
}

/// Why an ask failed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Refusal {
    /// The conversation is leased and the ask would not queue.
    Busy,
    /// `max` waiters wait already.
    WaitersFull { max: usize },
    /// `max` waiters of the ask's agent wait already.
    AgentWaitersFull { max: usize },
    /// The key crashed too often; this long is left of the cool-down.
    Quarantined(Duration),
    /// The pool is closing.
    Closed,
}

/// What the shell must do.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Effect {
    /// Hand ask `id` its conversation; `reuse`: the conversation parked under the same key
    /// (with or without its process) is still there to take.
    Grant {
        id: u64,
        conversation: String,
        reuse: bool,
    },
    /// Fail ask `id`.
    Fail { id: u64, why: Refusal },
    /// Close the parked process of this conversation (a victim, or an old key's process).
    Close { conversation: String },
    /// The pool is full and the Copilot side's idle worker is the oldest idle process: ask
    /// it to stop that worker (once until the Copilot side's view changes).
    EvictOther,
}

#[derive(Debug)]
struct Held {
    key: CliKey,
    leased: bool,
    /// Parked with its process (a leased conversation counts as holding one: its turn may
    /// start one).
    process: bool,
    last_used: Instant,
}

impl Held {
    /// Whether it takes a slot (a process in the caps).
    fn takes_slot(&self) -> bool {
        self.leased || self.process
    }
}

/// What a lease gave back with its conversation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Kept {
    /// The conversation with its process, parked.
    Process,
    /// The conversation without a process (a `cli-oneshot` one between turns, one whose
    /// process died), parked: reused by its next lease, in no cap meanwhile.
    Conversation,
    /// Nothing: the conversation was closed.
    Nothing,
}

#[derive(Debug)]
struct Waiter {
    id: u64,
    conversation: String,
    key: CliKey,
}

/// The agent of a conversation (`<agent>/<session key>#<backend>`).
fn agent_of(conversation: &str) -> &str {
    crate::ids::ConversationId::split_key(conversation).map_or(conversation, |(agent, _)| agent)
}

/// The whole bookkeeping.
#[derive(Debug)]
pub(crate) struct Slots {
    caps: Caps,
    policy: RestartPolicy,
    held: HashMap<String, Held>,
    waiters: VecDeque<Waiter>,
    restarts: HashMap<CliKey, RestartTracker>,
    closed: bool,
    /// The Copilot side's processes, in the shared budget.
    others: Others,
    /// The ask whose [`Effect::EvictOther`] is outstanding (until the Copilot side's view
    /// changes).
    asked_by: Option<u64>,
    /// Conversations being deleted ([`Slots::delete`]): held like a lease, without a
    /// process, until [`Slots::deleted`].
    deleting: HashSet<String>,
}

impl Slots {
    pub(crate) fn new(caps: Caps, policy: RestartPolicy) -> Self {
        Self {
            caps,
            policy,
            held: HashMap::new(),
            waiters: VecDeque::new(),
            restarts: HashMap::new(),
            closed: false,
            others: Others::default(),
            asked_by: None,
            deleting: HashSet::new(),
        }
    }

    #[cfg(test)]
    /// Processes held in all (parked or leased), as the shared budget counts them.
    pub(crate) fn processes(&self) -> usize {
        self.slots_taken()
    }

    /// Slots taken: conversations leased, or parked with their process.
    fn slots_taken(&self) -> usize {
        self.held.values().filter(|h| h.takes_slot()).count()
    }

    /// Leases of every backend waiting now.
    pub(crate) fn waiting(&self) -> usize {
        self.waiters.len()
    }

    /// The least recently used conversation parked with its process (the victim of a full
    /// pool).
    fn lru_parked(&self, of_key: Option<&CliKey>) -> Option<(&String, &Held)> {
        self.held
            .iter()
            .filter(|(_, h)| !h.leased && h.process && of_key.is_none_or(|k| &h.key == k))
            .min_by_key(|(_, h)| h.last_used)
    }

    /// Whether the ask that asked the Copilot side for its idle worker still waits for the
    /// room (a stale request, its ask served meanwhile or gone, is not carried out).
    pub(crate) fn wants_other(&self) -> bool {
        self.asked_by
            .is_some_and(|id| self.waiters.iter().any(|w| w.id == id))
    }

    /// What the Copilot side sees of this side: its processes and its oldest parked one.
    pub(crate) fn view(&self) -> Others {
        Others {
            held: self.slots_taken(),
            idle_since: self.lru_parked(None).map(|(_, h)| h.last_used),
            making_room: false,
        }
    }

    /// The Copilot side's processes changed: a new view of them (set under the same lock
    /// as every decision here), and the waiters are served (room it gave up is taken; a
    /// changed view lets a waiter ask for its idle worker again).
    pub(crate) fn others_changed(&mut self, others: Others, now: Instant) -> Vec<Effect> {
        if others == self.others {
            return Vec::new();
        }
        self.asked_by = None;
        self.others = others;
        let mut effects = Vec::new();
        self.serve_waiters(now, &mut effects);
        effects
    }

    #[cfg(test)]
    /// Sets the Copilot side's view without serving anyone (the actor's own decisions).
    pub(crate) fn set_others(&mut self, others: Others) {
        if others != self.others {
            self.asked_by = None;
        }
        self.others = others;
    }

    /// The Copilot side needs room and this side holds the oldest idle process: its least
    /// recently used parked process closes (true), its waiters left waiting (the room is
    /// the asker's).
    pub(crate) fn evict_for_other(&mut self) -> (bool, Vec<Effect>) {
        let Some(victim) = self.lru_parked(None).map(|(c, _)| c.clone()) else {
            return (false, Vec::new());
        };
        self.held.remove(&victim);
        (
            true,
            vec![Effect::Close {
                conversation: victim,
            }],
        )
    }

    /// Processes held per backend id.
    pub(crate) fn processes_of(&self, backend: &str) -> usize {
        self.held
            .values()
            .filter(|h| h.takes_slot() && h.key.backend == backend)
            .count()
    }

    /// Conversations of backend `backend` leased now.
    pub(crate) fn leased_of(&self, backend: &str) -> usize {
        self.held
            .values()
            .filter(|h| h.leased && h.key.backend == backend)
            .count()
    }

    /// Leases of backend `backend` waiting now.
    pub(crate) fn waiting_of(&self, backend: &str) -> usize {
        self.waiters
            .iter()
            .filter(|w| w.key.backend == backend)
            .count()
    }

    /// Conversations leased now.
    pub(crate) fn leased(&self) -> usize {
        self.held.values().filter(|h| h.leased).count()
    }

    /// Conversations leased or being deleted now: what a shutdown waits for.
    pub(crate) fn in_use(&self) -> usize {
        self.leased() + self.deleting.len()
    }

    fn of_key(&self, key: &CliKey) -> usize {
        self.held
            .values()
            .filter(|h| h.takes_slot() && &h.key == key)
            .count()
    }

    /// The refusal of a lease of `key` while the key is quarantined, for how long is left.
    fn quarantined(&self, key: &CliKey, now: Instant) -> Option<Refusal> {
        self.restarts
            .get(key)
            .and_then(|t| t.quarantined_until(now))
            .map(|until| Refusal::Quarantined(until - now))
    }

    /// A lease asks for `conversation` under `key`.
    pub(crate) fn ask(
        &mut self,
        id: u64,
        conversation: &str,
        key: CliKey,
        fail_if_busy: bool,
        now: Instant,
    ) -> Vec<Effect> {
        if self.closed {
            return vec![Effect::Fail {
                id,
                why: Refusal::Closed,
            }];
        }
        if let Some(why) = self.quarantined(&key, now) {
            return vec![Effect::Fail { id, why }];
        }
        let leased = self.held.get(conversation).is_some_and(|h| h.leased)
            || self.deleting.contains(conversation)
            || self.waiters.iter().any(|w| w.conversation == conversation);
        if leased && fail_if_busy {
            return vec![Effect::Fail {
                id,
                why: Refusal::Busy,
            }];
        }
        // A serialized lane keeps its order: behind an earlier waiter of the lane.
        let lane_queued = self.waiters.iter().any(|w| key.same_lane(&w.key));
        let mut effects = Vec::new();
        if !leased && !lane_queued && self.try_grant(id, conversation, &key, now, &mut effects) {
            return effects;
        }
        if self.waiters.len() >= self.caps.max_waiters {
            effects.push(Effect::Fail {
                id,
                why: Refusal::WaitersFull {
                    max: self.caps.max_waiters,
                },
            });
            return effects;
        }
        let agent = agent_of(conversation);
        let agents = self
            .waiters
            .iter()
            .filter(|w| agent_of(&w.conversation) == agent);
        if agents.count() >= self.caps.max_waiters_per_agent {
            effects.push(Effect::Fail {
                id,
                why: Refusal::AgentWaitersFull {
                    max: self.caps.max_waiters_per_agent,
                },
            });
            return effects;
        }
        self.waiters.push_back(Waiter {
            id,
            conversation: conversation.to_owned(),
            key,
        });
        effects
    }

    /// Grants when it can (pushing the effects); false when the ask must wait.
    fn try_grant(
        &mut self,
        id: u64,
        conversation: &str,
        key: &CliKey,
        now: Instant,
        effects: &mut Vec<Effect>,
    ) -> bool {
        if self.deleting.contains(conversation) {
            return false;
        }
        // A serialized lane runs one lease at a time.
        if self
            .held
            .iter()
            .any(|(c, h)| h.leased && c != conversation && key.same_lane(&h.key))
        {
            return false;
        }
        let reused = match self.held.get(conversation) {
            Some(held) if held.leased => return false,
            Some(held) if &held.key == key => Some(held.process),
            Some(_) => {
                // Another key (a refreshed credential): its process goes first.
                self.held.remove(conversation);
                effects.push(Effect::Close {
                    conversation: conversation.to_owned(),
                });
                None
            }
            None => None,
        };
        // Its own process parked: its slot is taken already.
        if reused == Some(true) || self.room_for(id, key, effects) {
            self.held.insert(
                conversation.to_owned(),
                Held {
                    key: key.clone(),
                    leased: true,
                    process: true,
                    last_used: now,
                },
            );
            effects.push(Effect::Grant {
                id,
                conversation: conversation.to_owned(),
                reuse: reused.is_some(),
            });
            return true;
        }
        false
    }

    /// Whether a slot of `key` is free, or is made free (the least recently used parked
    /// process closed) for ask `id`.
    fn room_for(&mut self, id: u64, key: &CliKey, effects: &mut Vec<Effect>) -> bool {
        let key_full = self.of_key(key) >= self.caps.max_per_key;
        let pool_full = !has_room(self.slots_taken(), &self.others, self.caps.max_processes);
        // The Copilot side is stopping a worker for this side's lease: wait for that stop
        // rather than stop another process (its end changes the view, which serves the
        // waiters again).
        if pool_full && !key_full && self.others.making_room {
            return false;
        }
        if key_full || pool_full {
            // The least recently used parked process makes room: of this key when the key
            // is full; otherwise of any key, or the Copilot side's idle worker when that one
            // is older (asked for once; this ask waits until it is gone).
            let own = self.lru_parked(key_full.then_some(key));
            let room = if key_full {
                own.map(|_| Room::Own)
            } else {
                make_room(own.map(|(_, h)| h.last_used), self.others.idle_since)
            };
            let victim = match room {
                Some(Room::Own) => own.map(|(c, _)| c.clone()),
                Some(Room::Other) => {
                    if !self.wants_other() {
                        self.asked_by = Some(id);
                        effects.push(Effect::EvictOther);
                    }
                    None
                }
                None => None,
            };
            let Some(victim) = victim else {
                return false;
            };
            self.held.remove(&victim);
            effects.push(Effect::Close {
                conversation: victim,
            });
        }
        true
    }

    /// A lease returned its conversation: `kept` what of it is parked, `crashed` whether its
    /// process died during the lease. Waiters that can now be served are.
    pub(crate) fn returned(
        &mut self,
        conversation: &str,
        kept: Kept,
        crashed: bool,
        now: Instant,
    ) -> Vec<Effect> {
        let key = self.held.get(conversation).map(|h| h.key.clone());
        if let Some(key) = &key {
            let tracker = self.restarts.entry(key.clone()).or_default();
            if crashed {
                // A crash while quarantined already is no new quarantine to count.
                let already = tracker.quarantined_until(now).is_some();
                if let RestartDecision::Quarantine { .. } = tracker.record_crash(now, &self.policy)
                    && !already
                {
                    crate::metrics::quarantined(&key.backend);
                }
            } else {
                tracker.record_stable();
            }
        }
        let parked = kept != Kept::Nothing && !self.closed;
        match self.held.get_mut(conversation) {
            Some(held) if parked => {
                held.leased = false;
                held.process = kept == Kept::Process;
                held.last_used = now;
            }
            _ => {
                self.held.remove(conversation);
            }
        }
        let mut effects = Vec::new();
        if kept == Kept::Nothing && self.closed {
            return effects;
        }
        if parked && kept == Kept::Conversation {
            self.bound_parked_without_process(&mut effects);
        }
        self.serve_waiters(now, &mut effects);
        effects
    }

    /// Closes the least recently used conversations parked without a process past
    /// `max_processes` of them.
    fn bound_parked_without_process(&mut self, effects: &mut Vec<Effect>) {
        let mut without: Vec<(Instant, String)> = self
            .held
            .iter()
            .filter(|(_, h)| !h.takes_slot())
            .map(|(c, h)| (h.last_used, c.clone()))
            .collect();
        let past = without.len().saturating_sub(self.caps.max_processes);
        if past == 0 {
            return;
        }
        without.sort();
        for (_, conversation) in without.into_iter().take(past) {
            self.held.remove(&conversation);
            effects.push(Effect::Close { conversation });
        }
    }

    /// Whether `conversation` is held (leased, or parked with or without its process), is
    /// being deleted, or is waited for.
    pub(crate) fn holds(&self, conversation: &str) -> bool {
        self.held.contains_key(conversation)
            || self.deleting.contains(conversation)
            || self.waiters.iter().any(|w| w.conversation == conversation)
    }

    /// A deletion asks for `conversation`: refused while the conversation is leased or waited
    /// for (`Busy`), or the pool closes; else the conversation is held for the deletion (no
    /// lease is granted it until [`Slots::deleted`]) and its parked process, if any, is let
    /// go: `true` when the shell must close it (waiters the room serves are granted).
    pub(crate) fn delete(
        &mut self,
        conversation: &str,
        now: Instant,
    ) -> Result<(bool, Vec<Effect>), Refusal> {
        if self.closed {
            return Err(Refusal::Closed);
        }
        let busy = self.held.get(conversation).is_some_and(|h| h.leased)
            || self.deleting.contains(conversation)
            || self.waiters.iter().any(|w| w.conversation == conversation);
        if busy {
            return Err(Refusal::Busy);
        }
        self.deleting.insert(conversation.to_owned());
        let parked = self.held.remove(conversation).is_some();
        let mut effects = Vec::new();
        if parked {
            self.serve_waiters(now, &mut effects);
        }
        Ok((parked, effects))
    }

    /// The deletion of `conversation` is over: its leases may be granted again.
    pub(crate) fn deleted(&mut self, conversation: &str, now: Instant) -> Vec<Effect> {
        self.deleting.remove(conversation);
        let mut effects = Vec::new();
        self.serve_waiters(now, &mut effects);
        effects
    }

    /// A waiter gave up (its wait ran out, or its caller went away).
    pub(crate) fn abandon(&mut self, id: u64, now: Instant) -> Vec<Effect> {
        self.waiters.retain(|w| w.id != id);
        // It may have held the ones behind it back: an earlier waiter of the same
        // conversation or lane goes first, and it may be the one that asked the Copilot side
        // for room (a request that is stale now; the next waiter asks again).
        let mut effects = Vec::new();
        self.serve_waiters(now, &mut effects);
        effects
    }

    /// A parked conversation's process was closed from outside the leases (idle).
    pub(crate) fn forget(&mut self, conversation: &str, now: Instant) -> Vec<Effect> {
        if self.held.get(conversation).is_some_and(|h| !h.leased) {
            self.held.remove(conversation);
        }
        let mut effects = Vec::new();
        self.serve_waiters(now, &mut effects);
        effects
    }

    /// Forgets the restart records of keys with nothing left to remember: not quarantined,
    /// no crash within the restart window, no conversation held and no lease waiting under
    /// them. Every lease's return makes its key a record, and a key changes with each
    /// rotated credential, so without this the records of every key ever seen would stay
    /// for the daemon's life.
    pub(crate) fn forget_quiet_keys(&mut self, now: Instant) {
        let Slots {
            policy,
            held,
            waiters,
            restarts,
            ..
        } = self;
        let in_use: HashSet<&CliKey> = held
            .values()
            .map(|h| &h.key)
            .chain(waiters.iter().map(|w| &w.key))
            .collect();
        restarts.retain(|key, tracker| {
            in_use.contains(key)
                || tracker.quarantined_until(now).is_some()
                || tracker.restarts_in_window(now, policy) > 0
        });
    }

    /// Parked conversations unused for `ttl`.
    pub(crate) fn idle(&self, now: Instant, ttl: Duration) -> Vec<String> {
        self.held
            .iter()
            .filter(|(_, h)| !h.leased && now.saturating_duration_since(h.last_used) >= ttl)
            .map(|(c, _)| c.clone())
            .collect()
    }

    /// The pool closes: every waiter fails, every parked process closes; leased ones close
    /// when they come back.
    pub(crate) fn close(&mut self) -> Vec<Effect> {
        self.closed = true;
        let mut effects: Vec<Effect> = self
            .waiters
            .drain(..)
            .map(|w| Effect::Fail {
                id: w.id,
                why: Refusal::Closed,
            })
            .collect();
        let parked: Vec<String> = self
            .held
            .iter()
            .filter(|(_, h)| !h.leased)
            .map(|(c, _)| c.clone())
            .collect();
        for conversation in parked {
            self.held.remove(&conversation);
            effects.push(Effect::Close { conversation });
        }
        effects
    }

    fn serve_waiters(&mut self, now: Instant, effects: &mut Vec<Effect>) {
        let mut i = 0;
        while i < self.waiters.len() {
            let waiter = &self.waiters[i];
            let (id, conversation, key) =
                (waiter.id, waiter.conversation.clone(), waiter.key.clone());
            // A key quarantined while its waiters waited (a crash inside `returned`) fails
            // them as it fails a new ask: each would start a process into the crash loop.
            if let Some(why) = self.quarantined(&key, now) {
                self.waiters.remove(i);
                effects.push(Effect::Fail { id, why });
                continue;
            }
            // An earlier waiter of the same conversation, or of the same serialized lane,
            // goes first (one lease at a time, in order).
            let earlier = self
                .waiters
                .iter()
                .take(i)
                .any(|w| w.conversation == conversation || key.same_lane(&w.key));
            if !earlier && self.try_grant(id, &conversation, &key, now, effects) {
                self.waiters.remove(i);
            } else {
                i += 1;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(n: &str) -> CliKey {
        CliKey {
            home: format!("/h/{n}"),
            credential: "c".into(),
            backend: "claude-cli".into(),
            serialize: false,
        }
    }

    fn serialized(n: &str) -> CliKey {
        CliKey {
            serialize: true,
            ..key(n)
        }
    }

    #[test]
    fn a_serialized_backend_runs_one_lease_per_home_at_a_time_and_its_waiters_in_order() {
        let now = Instant::now();
        let mut s = slots(8, 8);
        s.caps.max_waiters = 8;
        assert!(granted(&s.ask(1, "a/1", serialized("a"), false, now), 1));
        // Another conversation of the same home and backend waits, in order.
        assert!(s.ask(2, "a/2", serialized("a"), false, now).is_empty());
        assert!(s.ask(3, "a/3", serialized("a"), false, now).is_empty());
        // Another home's lane, and the same home on a backend that does not serialize, run.
        assert!(granted(&s.ask(4, "b/1", serialized("b"), false, now), 4));
        assert!(granted(&s.ask(5, "a/9", key("a"), false, now), 5));
        // A later ask of a leased conversation's lane queues behind the earlier waiters.
        let effects = s.returned("a/1", Kept::Process, false, now);
        assert_eq!(
            effects,
            [Effect::Grant {
                id: 2,
                conversation: "a/2".into(),
                reuse: false
            }]
        );
        assert!(s.ask(6, "a/1", serialized("a"), false, now).is_empty());
        assert!(granted(&s.returned("a/2", Kept::Process, false, now), 3));
        assert!(granted(&s.returned("a/3", Kept::Process, false, now), 6));
    }

    #[test]
    fn a_deleted_conversation_is_refused_while_leased_and_holds_off_its_leases_until_deleted() {
        let now = Instant::now();
        let mut s = slots(1, 1);
        assert!(granted(&s.ask(1, "a/1", key("a"), false, now), 1));
        // A turn runs: the deletion is refused.
        assert_eq!(s.delete("a/1", now), Err(Refusal::Busy));
        s.returned("a/1", Kept::Process, false, now);
        // Parked: its process is let go (the shell closes it), its room free.
        let (close, effects) = s.delete("a/1", now).unwrap();
        assert!(close);
        assert!(effects.is_empty());
        assert_eq!(s.processes(), 0);
        assert!(granted(&s.ask(2, "b/1", key("a"), false, now), 2));
        // While it is deleted, a lease of it is busy, or waits when it may.
        assert_eq!(s.delete("a/1", now), Err(Refusal::Busy));
        assert!(matches!(
            s.ask(3, "a/1", key("a"), true, now).as_slice(),
            [Effect::Fail {
                why: Refusal::Busy,
                ..
            }]
        ));
        assert!(s.ask(4, "a/1", key("a"), false, now).is_empty());
        // Deleted: the waiter is granted once there is room, with a process of its own.
        assert!(s.deleted("a/1", now).is_empty());
        assert!(granted(&s.returned("b/1", Kept::Nothing, false, now), 4));
        // A conversation with no process is deleted with nothing to close.
        s.returned("a/1", Kept::Nothing, false, now);
        assert_eq!(s.delete("c/1", now).map(|(close, _)| close), Ok(false));
        assert!(s.deleted("c/1", now).is_empty());
    }

    #[test]
    fn a_conversation_parked_without_a_process_takes_no_slot_until_its_next_lease() {
        let now = Instant::now();
        let mut s = slots(2, 2);
        // Two one-shot conversations between turns: parked, with no process.
        for (id, c) in [(1, "a/1"), (2, "a/2")] {
            assert!(granted(&s.ask(id, c, key("a"), false, now), id));
            s.returned(c, Kept::Conversation, false, now);
        }
        assert_eq!(s.processes(), 0);
        assert_eq!(s.view().held, 0, "the Copilot side sees no process held");
        assert_eq!(s.view().idle_since, None, "nor one to ask for");
        // A full pool's worth of new conversations is granted without closing either.
        assert_eq!(
            s.ask(3, "b/1", key("b"), false, now),
            [Effect::Grant {
                id: 3,
                conversation: "b/1".into(),
                reuse: false
            }]
        );
        assert!(granted(&s.ask(4, "b/2", key("b"), false, now), 4));
        // A parked one's next lease takes a slot as a new one would: it waits for room (none
        // of the leased ones is parked), then reuses its conversation.
        assert!(s.ask(5, "a/1", key("a"), false, now).is_empty());
        assert_eq!(s.processes(), 2);
        assert_eq!(
            s.returned("b/1", Kept::Process, false, now),
            [
                Effect::Close {
                    conversation: "b/1".into()
                },
                Effect::Grant {
                    id: 5,
                    conversation: "a/1".into(),
                    reuse: true
                }
            ]
        );
        assert_eq!(s.processes(), 2);
    }

    #[test]
    fn conversations_parked_without_a_process_are_at_most_max_processes() {
        let start = Instant::now();
        let mut s = slots(2, 2);
        for (n, c) in ["a/1", "a/2", "a/3"].into_iter().enumerate() {
            let now = start + Duration::from_secs(n as u64);
            assert!(granted(&s.ask(n as u64, c, key("a"), false, now), n as u64));
            let effects = s.returned(c, Kept::Conversation, false, now);
            if n < 2 {
                assert!(effects.is_empty(), "{c}: {effects:?}");
            } else {
                // The least recently used goes.
                assert_eq!(
                    effects,
                    [Effect::Close {
                        conversation: "a/1".into()
                    }]
                );
            }
        }
        assert!(s.holds("a/2") && s.holds("a/3") && !s.holds("a/1"));
    }

    #[test]
    fn a_deletion_is_in_use_until_it_is_done_as_a_lease_is_until_it_returns() {
        let now = Instant::now();
        let mut s = slots(4, 4);
        assert!(granted(&s.ask(1, "a/1", key("a"), false, now), 1));
        assert_eq!(s.in_use(), 1);
        s.returned("a/1", Kept::Process, false, now);
        assert_eq!(s.in_use(), 0, "a parked conversation is not in use");
        s.delete("a/1", now).expect("deleting");
        s.delete("b/1", now).expect("deleting");
        assert_eq!(s.in_use(), 2);
        s.close();
        assert_eq!(s.in_use(), 2, "a close leaves the deletions running");
        s.deleted("a/1", now);
        s.deleted("b/1", now);
        assert_eq!(s.in_use(), 0);
    }

    fn slots(max_processes: usize, max_per_key: usize) -> Slots {
        Slots::new(
            Caps {
                max_processes,
                max_per_key,
                max_waiters: 2,
                max_waiters_per_agent: 2,
            },
            RestartPolicy {
                max_restarts: 1,
                ..RestartPolicy::default()
            },
        )
    }

    fn granted(effects: &[Effect], want: u64) -> bool {
        effects
            .iter()
            .any(|e| matches!(e, Effect::Grant { id, .. } if *id == want))
    }

    #[test]
    fn a_conversation_is_leased_once_at_a_time_and_its_next_lease_reuses_its_process() {
        let now = Instant::now();
        let mut s = slots(4, 4);
        assert!(granted(&s.ask(1, "a/1", key("a"), false, now), 1));
        assert_eq!(
            s.ask(2, "a/1", key("a"), true, now),
            [Effect::Fail {
                id: 2,
                why: Refusal::Busy
            }]
        );
        assert!(s.ask(3, "a/1", key("a"), false, now).is_empty(), "queued");
        let effects = s.returned("a/1", Kept::Process, false, now);
        assert_eq!(
            effects,
            [Effect::Grant {
                id: 3,
                conversation: "a/1".into(),
                reuse: true
            }]
        );
        assert_eq!(s.processes(), 1);
    }

    #[test]
    fn one_agents_waiters_are_capped_and_another_agents_ask_still_queues() {
        let now = Instant::now();
        let mut s = slots(1, 1);
        s.caps.max_waiters = 8;
        s.caps.max_waiters_per_agent = 1;
        assert!(granted(&s.ask(1, "a/1", key("a"), false, now), 1));
        assert!(s.ask(2, "a/2", key("a"), false, now).is_empty());
        assert_eq!(
            s.ask(3, "a/3", key("a"), false, now),
            [Effect::Fail {
                id: 3,
                why: Refusal::AgentWaitersFull { max: 1 }
            }]
        );
        // Its conversations on another backend count in the same share.
        let codex = CliKey {
            backend: "codex-cli".into(),
            ..key("a-codex")
        };
        assert_eq!(
            s.ask(4, "a/4", codex, false, now),
            [Effect::Fail {
                id: 4,
                why: Refusal::AgentWaitersFull { max: 1 }
            }]
        );
        assert!(s.ask(5, "b/1", key("b"), false, now).is_empty(), "queued");
    }

    #[test]
    fn at_the_cap_the_least_recently_used_parked_process_makes_room_and_a_leased_one_never_does() {
        let t0 = Instant::now();
        let t1 = t0 + Duration::from_secs(1);
        let mut s = slots(2, 2);
        assert!(granted(&s.ask(1, "a/1", key("a"), false, t0), 1));
        assert!(granted(&s.ask(2, "b/1", key("b"), false, t0), 2));
        s.returned("a/1", Kept::Process, false, t0);
        // b/1 stays leased: a/1 (parked) is the victim.
        let effects = s.ask(3, "c/1", key("c"), false, t1);
        assert_eq!(
            effects[0],
            Effect::Close {
                conversation: "a/1".into()
            }
        );
        assert!(granted(&effects, 3));
        assert_eq!(s.processes(), 2);
        // Both leased now: the next one waits for a return, FIFO.
        assert!(s.ask(4, "d/1", key("d"), false, t1).is_empty());
        assert!(s.ask(5, "e/1", key("e"), false, t1).is_empty());
        assert_eq!(
            s.ask(6, "f/1", key("f"), false, t1),
            [Effect::Fail {
                id: 6,
                why: Refusal::WaitersFull { max: 2 }
            }]
        );
        let effects = s.returned("b/1", Kept::Nothing, false, t1);
        assert!(granted(&effects, 4) && !granted(&effects, 5), "{effects:?}");
        assert!(s.processes() <= 2);
    }

    #[test]
    fn a_key_at_its_own_cap_takes_room_only_from_its_own_parked_processes() {
        let now = Instant::now();
        let mut s = slots(8, 1);
        assert!(granted(&s.ask(1, "a/1", key("a"), false, now), 1));
        s.returned("a/1", Kept::Process, false, now);
        assert!(granted(&s.ask(2, "b/1", key("b"), false, now), 2));
        let effects = s.ask(3, "a/2", key("a"), false, now);
        assert_eq!(
            effects[0],
            Effect::Close {
                conversation: "a/1".into()
            }
        );
        assert!(granted(&effects, 3));
        assert_eq!(s.processes_of("claude-cli"), 2);
        assert_eq!(s.leased_of("claude-cli"), 2);
        s.returned("a/2", Kept::Process, false, now);
        assert_eq!(s.processes_of("claude-cli"), 2);
        assert_eq!(s.leased_of("claude-cli"), 1);
        assert_eq!(s.leased_of("codex-cli"), 0);
    }

    #[test]
    fn a_refreshed_credential_closes_the_old_process_before_the_new_one() {
        let now = Instant::now();
        let mut s = slots(4, 4);
        assert!(granted(&s.ask(1, "a/1", key("a"), false, now), 1));
        s.returned("a/1", Kept::Process, false, now);
        let mut refreshed = key("a");
        refreshed.credential = "c2".into();
        let effects = s.ask(2, "a/1", refreshed, false, now);
        assert_eq!(
            effects,
            [
                Effect::Close {
                    conversation: "a/1".into()
                },
                Effect::Grant {
                    id: 2,
                    conversation: "a/1".into(),
                    reuse: false
                }
            ]
        );
        assert_eq!(s.processes(), 1);
    }

    #[test]
    fn crashes_past_the_intensity_quarantine_the_key() {
        let now = Instant::now();
        let mut s = slots(4, 4);
        for id in 1..=2 {
            assert!(granted(&s.ask(id, "a/1", key("a"), false, now), id));
            s.returned("a/1", Kept::Nothing, true, now);
        }
        assert!(matches!(
            s.ask(9, "a/1", key("a"), false, now).as_slice(),
            [Effect::Fail {
                why: Refusal::Quarantined(_),
                ..
            }]
        ));
        // Another key is unaffected.
        assert!(granted(&s.ask(10, "b/1", key("b"), false, now), 10));
    }

    #[test]
    fn a_crash_while_the_key_is_quarantined_is_no_second_quarantine_counted() {
        use metrics_util::debugging::DebugValue;
        let now = Instant::now();
        let mut s = slots(4, 4);
        // Two conversations of a key leased at once; the first crash (max_restarts 1: the
        // second) quarantines the key, the third lease comes back crashed during it.
        assert!(granted(&s.ask(1, "a/1", key("a"), false, now), 1));
        assert!(granted(&s.ask(2, "a/2", key("a"), false, now), 2));
        assert!(granted(&s.ask(3, "a/3", key("a"), false, now), 3));
        let counted = crate::metrics::recorded(crate::metrics::QUARANTINES_TOTAL, || {
            for conversation in ["a/1", "a/2", "a/3"] {
                s.returned(conversation, Kept::Nothing, true, now);
            }
        });
        assert_eq!(counted, [DebugValue::Counter(1)]);
    }

    #[test]
    fn a_key_quarantined_while_its_waiters_wait_fails_them_instead_of_starting_each() {
        let now = Instant::now();
        let mut s = slots(4, 4);
        assert!(granted(&s.ask(1, "a/1", key("a"), false, now), 1));
        s.returned("a/1", Kept::Nothing, true, now);
        assert!(granted(&s.ask(2, "a/1", key("a"), false, now), 2));
        // Waiting behind the lease that is about to crash into quarantine.
        assert!(s.ask(3, "a/1", key("a"), false, now).is_empty());
        let effects = s.returned("a/1", Kept::Nothing, true, now);
        assert!(
            matches!(
                effects.as_slice(),
                [Effect::Fail {
                    id: 3,
                    why: Refusal::Quarantined(_)
                }]
            ),
            "{effects:?}"
        );
        assert!(!s.holds("a/1"));
    }

    #[test]
    fn the_restart_records_of_quiet_keys_are_forgotten_and_a_quarantine_is_kept() {
        let now = Instant::now();
        let mut s = slots(4, 4);
        for i in 0..100 {
            let conversation = format!("a{i}/1");
            assert!(granted(
                &s.ask(i, &conversation, key(&format!("a{i}")), false, now),
                i
            ));
            s.returned(&conversation, Kept::Nothing, false, now);
        }
        // One key still holds a parked conversation, one crashed into quarantine.
        assert!(granted(&s.ask(200, "held/1", key("held"), false, now), 200));
        s.returned("held/1", Kept::Process, false, now);
        for id in 300..=301 {
            assert!(granted(&s.ask(id, "q/1", key("q"), false, now), id));
            s.returned("q/1", Kept::Nothing, true, now);
        }
        assert_eq!(s.restarts.len(), 102);

        let later = now + s.policy.window + Duration::from_secs(1);
        s.forget_quiet_keys(later);
        let mut kept: Vec<&str> = s.restarts.keys().map(|k| k.home.as_str()).collect();
        kept.sort_unstable();
        assert_eq!(
            kept,
            ["/h/held", "/h/q"],
            "the held key and the quarantined one"
        );
        assert!(matches!(
            s.ask(9, "q/1", key("q"), false, later).as_slice(),
            [Effect::Fail {
                why: Refusal::Quarantined(_),
                ..
            }]
        ));
    }

    #[test]
    fn closing_fails_the_waiters_closes_the_parked_and_refuses_new_asks() {
        let now = Instant::now();
        let mut s = slots(1, 1);
        assert!(granted(&s.ask(1, "a/1", key("a"), false, now), 1));
        assert!(s.ask(2, "b/1", key("b"), false, now).is_empty());
        let effects = s.close();
        assert_eq!(
            effects,
            [Effect::Fail {
                id: 2,
                why: Refusal::Closed
            }]
        );
        assert!(s.returned("a/1", Kept::Process, false, now).is_empty());
        assert_eq!(
            s.processes(),
            0,
            "a lease returned after the close is not parked"
        );
        assert!(matches!(
            s.ask(3, "a/1", key("a"), false, now).as_slice(),
            [Effect::Fail {
                why: Refusal::Closed,
                ..
            }]
        ));
    }

    /// A pool of two: `a/1` parked at the returned instant, and one Copilot worker idle since
    /// before it (the oldest idle process).
    fn full_beside_an_older_copilot_worker() -> (Slots, Instant) {
        let t0 = Instant::now();
        let t1 = t0 + Duration::from_secs(1);
        let mut s = slots(2, 2);
        assert!(granted(&s.ask(1, "a/1", key("a"), false, t1), 1));
        s.returned("a/1", Kept::Process, false, t1);
        s.set_others(Others {
            held: 1,
            idle_since: Some(t0),
            making_room: false,
        });
        (s, t1)
    }

    #[test]
    fn a_full_pool_asks_the_copilot_side_once_for_its_older_idle_worker_and_grants_when_it_is_gone()
    {
        let (mut s, t1) = full_beside_an_older_copilot_worker();
        assert_eq!(s.ask(2, "b/1", key("b"), false, t1), [Effect::EvictOther]);
        assert!(
            s.ask(3, "c/1", key("c"), false, t1).is_empty(),
            "asked once until the Copilot side answers"
        );
        assert!(s.wants_other());
        assert_eq!(s.processes(), 1, "a/1 stays parked");
        // The worker is gone: the first waiter takes its room, the next one a/1's.
        let effects = s.others_changed(Others::default(), t1);
        assert!(granted(&effects, 2), "{effects:?}");
        assert!(effects.contains(&Effect::Close {
            conversation: "a/1".into()
        }));
        assert!(granted(&effects, 3), "{effects:?}");
        assert_eq!(s.processes(), 2);
    }

    #[test]
    fn while_the_copilot_side_stops_a_worker_for_room_an_ask_waits_for_it_and_stops_nothing() {
        let t0 = Instant::now();
        let t1 = t0 + Duration::from_secs(1);
        let mut s = slots(2, 2);
        assert!(granted(&s.ask(1, "a/1", key("a"), false, t1), 1));
        let parked = s.returned("a/1", Kept::Process, false, t1);
        assert!(parked.is_empty(), "{parked:?}");
        // The Copilot side holds the other place and is stopping a worker (the one it
        // stopped for this side, or for a start of its own); its next idle one is older
        // than this side's parked process.
        s.set_others(Others {
            held: 1,
            idle_since: Some(t0),
            making_room: true,
        });
        assert!(
            s.ask(2, "b/1", key("b"), false, t1).is_empty(),
            "neither another Copilot worker nor this side's parked process is stopped"
        );
        assert!(!s.wants_other());
        // The stop is done: the place is there.
        let effects = s.others_changed(
            Others {
                held: 0,
                idle_since: Some(t0),
                making_room: false,
            },
            t1,
        );
        assert!(granted(&effects, 2), "{effects:?}");
    }

    #[test]
    fn a_waiter_that_gives_up_lets_the_one_behind_it_ask_the_copilot_side_for_room() {
        let (mut s, t1) = full_beside_an_older_copilot_worker();
        // Two waiters of one conversation: the first asks for the Copilot worker, the second
        // waits behind it.
        assert_eq!(s.ask(2, "b/1", key("b"), false, t1), [Effect::EvictOther]);
        assert!(s.ask(3, "b/1", key("b"), false, t1).is_empty());
        // The first gives up: the second asks in its place, not after its own timeout.
        assert_eq!(s.abandon(2, t1), [Effect::EvictOther]);
        assert!(s.wants_other());
    }

    #[test]
    fn a_request_for_the_copilot_worker_goes_stale_once_its_ask_is_served_and_the_next_asks_again()
    {
        let t0 = Instant::now();
        let t1 = t0 + Duration::from_secs(1);
        let mut s = slots(2, 2);
        assert!(granted(&s.ask(1, "a/1", key("a"), false, t1), 1));
        s.set_others(Others {
            held: 1,
            idle_since: Some(t0),
            making_room: false,
        });
        assert_eq!(s.ask(2, "b/1", key("b"), false, t1), [Effect::EvictOther]);
        assert!(s.wants_other());
        // a/1's process ends before the Copilot side acts: b/1 takes its room.
        assert!(granted(&s.returned("a/1", Kept::Nothing, false, t1), 2));
        assert!(
            !s.wants_other(),
            "the request is stale: nothing to stop for it"
        );
        // A later ask that needs room asks again.
        assert_eq!(s.ask(3, "c/1", key("c"), false, t1), [Effect::EvictOther]);
        assert!(s.wants_other());
    }

    #[test]
    fn a_full_pool_closes_its_own_parked_process_when_the_copilot_worker_idled_later() {
        let t0 = Instant::now();
        let t1 = t0 + Duration::from_secs(1);
        let mut s = slots(2, 2);
        assert!(granted(&s.ask(1, "a/1", key("a"), false, t0), 1));
        s.returned("a/1", Kept::Process, false, t0);
        s.set_others(Others {
            held: 1,
            idle_since: Some(t1),
            making_room: false,
        });
        let effects = s.ask(2, "b/1", key("b"), false, t1);
        assert_eq!(
            effects[0],
            Effect::Close {
                conversation: "a/1".into()
            }
        );
        assert!(granted(&effects, 2));
    }

    #[test]
    fn busy_copilot_workers_count_in_the_cap_and_their_release_wakes_the_waiter() {
        let t0 = Instant::now();
        let mut s = slots(1, 1);
        s.set_others(Others {
            held: 1,
            idle_since: None,
            making_room: false,
        });
        assert!(s.ask(1, "a/1", key("a"), false, t0).is_empty(), "waits");
        assert_eq!(s.waiting(), 1);
        assert!(granted(&s.others_changed(Others::default(), t0), 1));
    }

    #[test]
    fn the_copilot_side_takes_the_oldest_parked_process_and_no_waiter_takes_its_room() {
        let t0 = Instant::now();
        let t1 = t0 + Duration::from_secs(1);
        let mut s = slots(2, 2);
        assert!(granted(&s.ask(1, "a/1", key("a"), false, t0), 1));
        assert!(granted(&s.ask(2, "b/1", key("b"), false, t1), 2));
        s.returned("a/1", Kept::Process, false, t0);
        s.returned("b/1", Kept::Process, false, t1);
        assert_eq!(
            s.view(),
            Others {
                held: 2,
                idle_since: Some(t0),
                making_room: false,
            }
        );
        let (evicted, effects) = s.evict_for_other();
        assert!(evicted);
        assert_eq!(
            effects,
            [Effect::Close {
                conversation: "a/1".into()
            }]
        );
        assert_eq!(s.view().held, 1);
        // Nothing parked is left to give once b/1 is leased again.
        assert!(granted(&s.ask(3, "b/1", key("b"), false, t1), 3));
        assert_eq!(s.evict_for_other(), (false, Vec::new()));
    }

    #[test]
    fn idle_parked_conversations_are_found_by_their_ttl() {
        let t0 = Instant::now();
        let mut s = slots(4, 4);
        assert!(granted(&s.ask(1, "a/1", key("a"), false, t0), 1));
        s.returned("a/1", Kept::Process, false, t0);
        assert!(s.idle(t0, Duration::from_secs(5)).is_empty());
        assert_eq!(
            s.idle(t0 + Duration::from_secs(5), Duration::from_secs(5)),
            ["a/1"]
        );
        s.forget("a/1", t0);
        assert_eq!(s.processes(), 0);
    }
}
