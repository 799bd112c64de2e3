//! Tests of the placement core, with no process: a small simulator plays the actor (it keeps
//! the grants, spawns and detaches the core asked for and answers them when told to).

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use proptest::prelude::*;

use super::*;
use crate::auth::AuthMode;

/// A parked session in these tests: a number unique over a run.
type Token = u32;

fn key(n: u8) -> PoolKey {
    PoolKey {
        home: PathBuf::from(format!("/agents/{n}")),
        mode: AuthMode::Token,
        profile_id: Some(format!("profile-{n}")),
        profile_version: Some("v1".into()),
        byok: None,
    }
}

fn limits() -> Limits {
    Limits {
        max_processes: 4,
        max_processes_per_key: 2,
        max_sessions_per_process: 2,
        max_sessions: 100,
        max_waiters: 100,
        max_waiters_per_agent: 100,
        max_leases_per_agent: usize::MAX,
        idle_ttl: Duration::from_secs(300),
        max_rss_bytes: 1 << 30,
        max_turns_per_process: 1000,
        drain_grace: Duration::from_secs(30),
        restart: RestartPolicy::default(),
        busy_leases_per_process: 2,
        cpu_processes_per_key: 1,
        warm_spares: 0,
        warm_spare_window: Duration::from_secs(600),
    }
}

/// A grant the simulated caller holds.
struct Held {
    worker: WorkerId,
    /// The parked session the grant carried: (session, its worker, same worker).
    carried: Option<(Token, WorkerId, bool)>,
}

/// The actor's side, simulated.
struct Sim {
    core: Placement<(), Token>,
    now: Instant,
    next_request: RequestId,
    next_token: Token,
    next_pid: u32,
    /// Request id → the conversation it asked for.
    asked: HashMap<RequestId, String>,
    /// Requests queued and not yet answered.
    queued: Vec<RequestId>,
    /// Outstanding grants by conversation.
    leases: BTreeMap<String, Held>,
    /// Every grant in order: (request, conversation, worker).
    granted: Vec<(RequestId, String, WorkerId)>,
    failed: Vec<(RequestId, PoolError)>,
    /// Spawns asked for and not yet answered.
    spawns: Vec<PoolKey>,
    /// Whether each spawn asked for (in order) primes its process.
    primes: Vec<bool>,
    respawns: Vec<PoolKey>,
    /// Detaches asked for and not yet answered: (conversations, worker).
    detaches: Vec<(Vec<String>, WorkerId)>,
    /// Evictions whose stop has not been reported: (conversations, worker).
    stops: Vec<(Vec<String>, WorkerId)>,
    /// Conversations whose detach failed on a worker not yet stopped: (conversation, worker).
    failed_detaches: Vec<(String, WorkerId)>,
    evicted: Vec<(WorkerId, Eviction)>,
    workers: Vec<WorkerId>,
    /// Workers whose child exited and whose supervision event has not come yet.
    exited: Vec<WorkerId>,
    /// Process asks not yet answered.
    process_asks: std::collections::HashSet<RequestId>,
    /// Process leases held: (request, worker).
    processes: Vec<(RequestId, WorkerId)>,
    /// Requests for the CLI side's idle process.
    evict_other: usize,
    /// Quarantines reported.
    quarantines: usize,
}

impl Sim {
    fn new(limits: Limits) -> Self {
        Sim {
            core: Placement::new(limits),
            now: Instant::now() + Duration::from_secs(100_000),
            next_request: 1,
            next_token: 1,
            next_pid: 1000,
            asked: HashMap::new(),
            queued: Vec::new(),
            leases: BTreeMap::new(),
            granted: Vec::new(),
            failed: Vec::new(),
            spawns: Vec::new(),
            primes: Vec::new(),
            respawns: Vec::new(),
            detaches: Vec::new(),
            stops: Vec::new(),
            failed_detaches: Vec::new(),
            evicted: Vec::new(),
            workers: Vec::new(),
            exited: Vec::new(),
            process_asks: std::collections::HashSet::new(),
            processes: Vec::new(),
            evict_other: 0,
            quarantines: 0,
        }
    }

    /// Asks for a process of key `k` (a call naming no conversation).
    fn ask_process(&mut self, k: u8) -> RequestId {
        let id = self.next_request;
        self.next_request += 1;
        self.process_asks.insert(id);
        let ask = Ask {
            id,
            key: key(k),
            spec: (),
            conversation: String::new(),
            compat: String::new(),
            setup: String::new(),
            gateway_key: String::new(),
            fail_if_busy: false,
            wait: Duration::from_secs(60),
            process_only: true,
            any_setup: false,
            traffic: false,
        };
        let effects = self.core.acquire(ask, self.now);
        self.apply(effects);
        id
    }

    /// Ends the process lease granted to `request`.
    fn release_process(&mut self, request: RequestId) {
        let pos = self
            .processes
            .iter()
            .position(|(r, _)| *r == request)
            .expect("a held process lease");
        let (_, worker) = self.processes.remove(pos);
        let effects = self.core.released(worker, self.now);
        self.apply(effects);
    }

    fn process_of(&self, request: RequestId) -> Option<WorkerId> {
        self.processes
            .iter()
            .find(|(r, _)| *r == request)
            .map(|(_, w)| *w)
    }

    fn ask_with(
        &mut self,
        conversation: &str,
        k: u8,
        compat: &str,
        fail_if_busy: bool,
    ) -> RequestId {
        self.ask_full(conversation, k, compat, "", fail_if_busy, false)
    }

    fn ask_full(
        &mut self,
        conversation: &str,
        k: u8,
        compat: &str,
        setup: &str,
        fail_if_busy: bool,
        any_setup: bool,
    ) -> RequestId {
        self.submit(Ask {
            compat: compat.to_owned(),
            setup: setup.to_owned(),
            fail_if_busy,
            any_setup,
            ..ask_of(conversation, k)
        })
    }

    /// Makes `ask` (under the next request id).
    fn submit(&mut self, mut ask: Ask<()>) -> RequestId {
        let id = self.next_request;
        self.next_request += 1;
        self.asked.insert(id, ask.conversation.clone());
        ask.id = id;
        let effects = self.core.acquire(ask, self.now);
        self.apply(effects);
        id
    }

    fn ask(&mut self, conversation: &str, k: u8) -> RequestId {
        self.ask_with(conversation, k, "c", false)
    }

    /// The pool resumes `conversation` of key `k` ahead of its return, if placement lets it;
    /// returns the worker it was granted on (held like a lease, under request 0).
    fn warm_up(
        &mut self,
        conversation: &str,
        k: u8,
        compat: &str,
        setup: &str,
    ) -> Option<WorkerId> {
        let granted = self
            .core
            .warm_up(&key(k), conversation, compat, setup, self.now)?;
        let worker = granted.worker;
        self.asked.insert(granted.request, conversation.to_owned());
        self.apply(vec![Effect::Grant(granted)]);
        Some(worker)
    }

    /// Answers the oldest pending spawn with a started worker; returns its id.
    fn spawn_ok(&mut self) -> Option<WorkerId> {
        let key = self.spawns.first().cloned()?;
        self.spawns.remove(0);
        let pid = self.next_pid;
        self.next_pid += 1;
        let started = Ok(StartedWorker { pid, primed: None });
        let (id, effects) = self.core.spawned(key, started, self.now);
        self.workers.extend(id);
        self.apply(effects);
        id
    }

    fn give_back(&mut self, conversation: &str, settle: Settle, turns: u64) {
        let worker = self.leases.remove(conversation).expect("leased").worker;
        let token = self.next_token;
        self.next_token += 1;
        let effects = self.core.returned(
            conversation.to_owned(),
            worker,
            Some(token),
            settle,
            turns,
            self.now,
        );
        self.apply(effects);
    }

    fn confirm_all_detaches(&mut self) {
        while let Some((conversations, worker)) = self.detaches.pop() {
            let effects = self.core.detached(&conversations, worker, true, self.now);
            self.apply(effects);
        }
        while let Some((conversations, worker)) = self.stops.pop() {
            self.stop_done(conversations, worker);
        }
    }

    /// A detach of `conversations` from `worker` failed.
    fn fail_detach(&mut self, conversations: Vec<String>, worker: WorkerId) {
        let running =
            self.workers.contains(&worker) || self.stops.iter().any(|(_, w)| *w == worker);
        if running {
            self.failed_detaches
                .extend(conversations.iter().map(|c| (c.clone(), worker)));
        }
        let effects = self.core.detached(&conversations, worker, false, self.now);
        self.apply(effects);
    }

    /// An evicted worker's process is gone.
    fn stop_done(&mut self, conversations: Vec<String>, worker: WorkerId) {
        self.failed_detaches.retain(|(_, w)| *w != worker);
        let effects = self.core.eviction_done(&conversations, worker, self.now);
        self.apply(effects);
    }

    fn apply(&mut self, effects: Vec<Effect<(), Token>>) {
        for effect in effects {
            match effect {
                Effect::Grant(g) => {
                    assert_eq!(self.asked.get(&g.request), Some(&g.conversation));
                    assert!(
                        !self.leases.contains_key(&g.conversation),
                        "{} granted while leased",
                        g.conversation
                    );
                    assert!(
                        !self
                            .detaches
                            .iter()
                            .any(|(cs, _)| cs.contains(&g.conversation)),
                        "{} granted while being detached",
                        g.conversation
                    );
                    assert!(
                        !self
                            .stops
                            .iter()
                            .any(|(cs, _)| cs.contains(&g.conversation))
                            && !self
                                .failed_detaches
                                .iter()
                                .any(|(c, _)| *c == g.conversation),
                        "{} granted while a worker that may hold it is still stopping",
                        g.conversation
                    );
                    self.queued.retain(|r| *r != g.request);
                    let carried = g.carried.and_then(|c| {
                        let same = c.same_worker;
                        c.session.map(|t| (t, c.from, same))
                    });
                    self.leases.insert(
                        g.conversation.clone(),
                        Held {
                            worker: g.worker,
                            carried,
                        },
                    );
                    self.granted.push((g.request, g.conversation, g.worker));
                }
                Effect::GrantProcess { request, worker } => {
                    assert!(
                        self.process_asks.remove(&request),
                        "a process grant answers a process ask, once"
                    );
                    self.queued.retain(|r| *r != request);
                    self.processes.push((request, worker));
                }
                Effect::Fail { request, error } => {
                    self.queued.retain(|r| *r != request);
                    self.process_asks.remove(&request);
                    self.failed.push((request, error));
                }
                Effect::Queued { request, .. } => self.queued.push(request),
                Effect::Spawn { key, prime, .. } => {
                    self.spawns.push(key);
                    self.primes.push(prime);
                }
                Effect::RespawnAfter { key, .. } => self.respawns.push(key),
                Effect::Detach {
                    conversation,
                    worker,
                    ..
                } => self.detaches.push((vec![conversation], worker)),
                Effect::Evict {
                    worker,
                    reason,
                    attached,
                } => {
                    if matches!(reason, Eviction::Idle | Eviction::Full) {
                        assert!(
                            !self.processes.iter().any(|(_, w)| *w == worker),
                            "worker {worker} stopped ({reason:?}) under a process lease"
                        );
                    }
                    self.evicted.push((worker, reason));
                    self.stops.push((attached, worker));
                    self.workers.retain(|w| *w != worker);
                }
                Effect::Forget { worker } => self.workers.retain(|w| *w != worker),
                Effect::EvictOther => self.evict_other += 1,
                Effect::Event(PoolEvent::KeyQuarantined { .. }) => self.quarantines += 1,
                Effect::Event(_) => {}
            }
        }
        self.core.check_invariants();
        assert_eq!(self.core.leased_count(), self.leases.len());
        // A worker's lease count is its leased conversations plus its process leases.
        for (id, w) in &self.core.workers {
            let held = self.leases.values().filter(|h| h.worker == *id).count()
                + self.processes.iter().filter(|(_, p)| p == id).count();
            assert_eq!(w.leased, held, "worker {id}: leases counted wrong");
        }
    }

    fn granted_to(&self, request: RequestId) -> Option<WorkerId> {
        self.granted
            .iter()
            .find(|(r, _, _)| *r == request)
            .map(|(_, _, w)| *w)
    }
}

impl<Spec: Clone, S> Placement<Spec, S> {
    /// The caps and the bookkeeping agree with themselves.
    fn check_invariants(&self) {
        let spawning = self.keys.values().filter(|k| k.spawning).count();
        // Processes still stopping count: they are there until their stop is confirmed.
        let stopping = self.stopping.len();
        assert!(
            self.workers.len() + spawning + stopping + self.others.held
                <= self.limits.max_processes,
            "max_processes exceeded: {} workers, {spawning} starting, {stopping} stopping, \
             {} of the CLI side",
            self.workers.len(),
            self.others.held
        );
        assert!(self.conversations.len() <= self.limits.max_sessions);
        for (id, w) in &self.workers {
            assert!(w.attached.len() <= self.limits.max_sessions_per_process);
            let leased = w
                .attached
                .iter()
                .filter(|c| self.conversations.get(*c).is_some_and(|c| c.leased))
                .count();
            assert!(
                leased <= w.leased,
                "worker {id}: lease count below its leases"
            );
        }
        for (name, c) in &self.conversations {
            assert!(
                !(self.workers.contains_key(&c.worker) && self.former_keys.contains_key(name)),
                "{name} is on a process and remembered as gone from one at once"
            );
            if let Some(w) = self.workers.get(&c.worker) {
                assert!(
                    w.attached.contains(name),
                    "{name} not attached to its worker"
                );
            }
            assert!(
                !(c.leased && c.parked.is_some()),
                "{name} leased and parked"
            );
        }
        for ks in self.keys.values() {
            assert!(ks.workers.len() <= self.limits.max_processes_per_key);
        }
        assert!(self.waiters.len() <= self.limits.max_waiters);
        for w in self.workers.values() {
            assert!(
                self.leased_of(&w.key.home) <= self.limits.max_leases_per_agent,
                "max_leases_per_agent exceeded for {}",
                w.key.home.display()
            );
        }
        for w in &self.waiters {
            assert!(
                self.waiting_of(&w.key.home) <= self.limits.max_waiters_per_agent,
                "max_waiters_per_agent exceeded for {}",
                w.key.home.display()
            );
        }
    }
}

#[test]
fn a_conversation_crashing_its_resume_in_a_loop_keeps_its_count_however_many_others_crash_once() {
    let mut counts = HashMap::new();
    let start = Instant::now();
    let at = |n: u64| start + Duration::from_millis(n);
    count_resume_crash(&mut counts, "poison", at(0));
    for n in 1..RESUME_CRASHES_REMEMBERED as u64 {
        count_resume_crash(&mut counts, &format!("once-{n}"), at(n));
    }
    assert_eq!(counts.len(), RESUME_CRASHES_REMEMBERED);
    // Full: the loop's second crash is counted on top of its first.
    count_resume_crash(&mut counts, "poison", at(5000));
    assert_eq!(counts["poison"].count, 2);
    // A newcomer takes the place of the conversation whose last crash is oldest.
    count_resume_crash(&mut counts, "newcomer", at(5001));
    assert_eq!(counts.len(), RESUME_CRASHES_REMEMBERED);
    assert!(!counts.contains_key("once-1"));
    assert_eq!(counts["poison"].count, 2);
    assert_eq!(counts["newcomer"].count, 1);
}

#[test]
fn resume_crashes_count_for_a_window_after_the_last() {
    let mut counts = HashMap::new();
    let start = Instant::now();
    count_resume_crash(&mut counts, "c", start);
    count_resume_crash(&mut counts, "c", start + Duration::from_secs(60));
    let last = start + Duration::from_secs(60);
    assert_eq!(counts["c"].at(last + RESUME_CRASH_WINDOW / 2), 2);
    assert_eq!(counts["c"].at(last + RESUME_CRASH_WINDOW), 0);
    // A crash after the window starts a new count.
    count_resume_crash(&mut counts, "c", last + RESUME_CRASH_WINDOW);
    assert_eq!(counts["c"].count, 1);
}

#[test]
fn a_conversation_is_granted_on_the_worker_its_spawn_brings_and_reused_when_parked() {
    let mut sim = Sim::new(limits());
    let first = sim.ask("a/1", 1);
    assert_eq!(
        sim.spawns.len(),
        1,
        "the first lease of a key starts a worker"
    );
    assert!(sim.queued.contains(&first));
    let w = sim.spawn_ok().expect("kept");
    assert_eq!(sim.granted_to(first), Some(w));
    sim.give_back("a/1", Settle::Park, 1);
    let again = sim.ask("a/1", 1);
    assert_eq!(sim.granted_to(again), Some(w), "parked: the same worker");
    assert!(sim.spawns.is_empty());
}

#[test]
fn a_lease_that_runs_no_turn_uses_the_parked_session_whatever_it_was_opened_with() {
    let mut sim = Sim::new(limits());
    sim.ask_full("a/1", 1, "c", "with tools", false, false);
    let w = sim.spawn_ok().expect("kept");
    sim.give_back("a/1", Settle::Park, 1);
    // A compact (no tools, no handlers): the parked session as it is.
    let compact = sim.ask_full("a/1", 1, "c", "bare", true, true);
    assert_eq!(sim.granted_to(compact), Some(w));
    let held = sim.leases.get("a/1").expect("leased");
    assert!(
        held.carried.as_ref().is_some_and(|(_, _, same)| *same),
        "reused where it is parked, not moved"
    );
    sim.give_back("a/1", Settle::Park, 0);
    // The next turn finds it as its turns opened it; a turn with other settings does not.
    let turn = sim.ask_full("a/1", 1, "c", "with tools", false, false);
    assert!(
        sim.leases
            .get("a/1")
            .is_some_and(|h| h.carried.as_ref().is_some_and(|(_, _, same)| *same))
    );
    assert_eq!(sim.granted_to(turn), Some(w));
    sim.give_back("a/1", Settle::Park, 1);
    sim.ask_full("a/1", 1, "c", "bare", false, false);
    assert!(
        sim.leases
            .get("a/1")
            .is_some_and(|h| !h.carried.as_ref().is_some_and(|(_, _, same)| *same)),
        "a turn opened otherwise is moved"
    );
}

#[test]
fn a_leased_conversation_waits_for_its_return_or_is_refused_at_once_when_asked() {
    let mut sim = Sim::new(limits());
    sim.ask("a/1", 1);
    sim.spawn_ok();
    let second = sim.ask("a/1", 1);
    assert!(sim.queued.contains(&second), "queued behind the lease");
    let busy = sim.ask_with("a/1", 1, "c", true);
    assert!(matches!(
        sim.failed.last(),
        Some((r, PoolError::ConversationBusy { .. })) if *r == busy
    ));
    sim.give_back("a/1", Settle::Park, 1);
    assert!(sim.granted_to(second).is_some(), "served at the return");
}

#[test]
fn waiters_are_served_in_the_order_they_asked() {
    let mut sim = Sim::new(Limits {
        max_processes: 1,
        max_processes_per_key: 1,
        max_sessions_per_process: 1,
        ..limits()
    });
    sim.ask("a/0", 1);
    sim.spawn_ok();
    let order: Vec<RequestId> = (1..=4).map(|i| sim.ask(&format!("a/{i}"), 1)).collect();
    assert_eq!(sim.queued, order, "all wait: one process, one conversation");
    let mut served = Vec::new();
    let mut holder = "a/0".to_owned();
    for _ in 0..order.len() {
        sim.give_back(&holder, Settle::Park, 1);
        // The parked one is detached to make room; the next waiter gets the slot.
        let (request, conversation, _) = sim.granted.last().cloned().expect("a grant");
        served.push(request);
        holder = conversation;
        sim.confirm_all_detaches();
    }
    assert_eq!(served, order);
}

#[test]
fn one_agents_waiters_are_capped_and_another_agents_lease_still_queues() {
    let mut sim = Sim::new(Limits {
        max_processes: 1,
        max_processes_per_key: 1,
        max_sessions_per_process: 1,
        max_waiters: 10,
        max_waiters_per_agent: 2,
        ..limits()
    });
    sim.ask("a/0", 1);
    sim.spawn_ok();
    let queued: Vec<RequestId> = (1..=2).map(|i| sim.ask(&format!("a/{i}"), 1)).collect();
    assert_eq!(sim.queued, queued);
    let over = sim.ask("a/3", 1);
    assert!(
        matches!(
            sim.failed.last(),
            Some((r, PoolError::AgentWaitersFull { max: 2 })) if *r == over
        ),
        "{:?}",
        sim.failed
    );
    // The agent under another credential (a rotated token: another key, the same home)
    // is the same agent.
    let rotated = Ask {
        id: 99,
        key: PoolKey {
            profile_version: Some("v2".into()),
            ..key(1)
        },
        ..ask_of("a/4", 1)
    };
    let effects = sim.core.acquire(rotated, sim.now);
    sim.apply(effects);
    assert!(
        matches!(
            sim.failed.last(),
            Some((99, PoolError::AgentWaitersFull { max: 2 }))
        ),
        "{:?}",
        sim.failed
    );
    // Another agent's lease still waits for its place.
    let other = sim.ask("b/1", 2);
    assert!(sim.queued.contains(&other), "{:?}", sim.failed);
    assert_eq!(sim.failed.len(), 2);
}

#[test]
fn an_agent_at_its_lease_cap_waits_for_its_own_return_while_another_agent_is_granted() {
    let mut sim = Sim::new(Limits {
        max_processes: 4,
        max_processes_per_key: 4,
        max_leases_per_agent: 2,
        ..limits()
    });
    // Agent 1 holds two leases on two keys (a model of its own each: a process each).
    let rotated = |n: u8| PoolKey {
        profile_version: Some(format!("v{n}")),
        ..key(1)
    };
    for (n, conversation) in [(1, "a/1"), (2, "a/2")] {
        let mut ask = ask_of(conversation, 1);
        ask.key = rotated(n);
        sim.submit(ask);
        sim.spawn_ok();
        assert!(sim.leases.contains_key(conversation), "{conversation}");
    }
    // Its third waits, and starts nothing.
    let mut third = ask_of("a/3", 1);
    third.key = rotated(3);
    let waiting = sim.submit(third);
    assert!(sim.queued.contains(&waiting));
    assert!(
        sim.spawns.is_empty(),
        "no process started for it: {:?}",
        sim.spawns
    );
    // Another agent is granted meanwhile.
    sim.ask("b/1", 2);
    sim.spawn_ok();
    assert!(sim.leases.contains_key("b/1"));
    // Its own return lets it in.
    sim.give_back("a/1", Settle::Park, 1);
    assert_eq!(sim.spawns.len(), 1, "its process starts now");
    sim.spawn_ok();
    assert!(sim.leases.contains_key("a/3"));
    // A deletion's lease and a process lease (no turn) are not held back by the cap.
    let mut deletion = ask_of("a/1", 1);
    deletion.key = rotated(1);
    deletion.traffic = false;
    let deleting = sim.submit(deletion);
    assert!(
        !sim.queued.contains(&deleting),
        "a deletion is granted at the cap"
    );
    sim.give_back("a/1", Settle::Park, 0);
    let process = sim.ask_process(1);
    assert!(
        !sim.queued.contains(&process),
        "a process lease is granted at the cap"
    );
    sim.release_process(process);
    // At the cap for the whole wait: the error says so.
    let mut fourth = ask_of("a/4", 1);
    fourth.key = rotated(4);
    let expired = sim.submit(fourth);
    let effects = sim.core.expire(expired);
    sim.apply(effects);
    assert!(
        matches!(
            sim.failed.last(),
            Some((r, PoolError::AgentLeasesFull { max: 2, .. })) if *r == expired
        ),
        "{:?}",
        sim.failed
    );
}

#[test]
fn a_full_pool_stops_the_least_recently_used_idle_worker_of_another_key() {
    let mut sim = Sim::new(Limits {
        max_processes: 2,
        ..limits()
    });
    sim.ask("a/1", 1);
    let older = sim.spawn_ok().expect("kept");
    sim.give_back("a/1", Settle::Park, 1);
    sim.now += Duration::from_secs(5);
    sim.ask("b/1", 2);
    let newer = sim.spawn_ok().expect("kept");
    sim.give_back("b/1", Settle::Park, 1);
    sim.now += Duration::from_secs(5);

    sim.ask("c/1", 3);
    assert_eq!(sim.evicted, vec![(older, Eviction::Full)]);
    assert_ne!(older, newer);
    assert!(
        sim.spawns.is_empty(),
        "nothing starts beside a process still stopping: {:?}",
        sim.spawns
    );
    assert_eq!(sim.core.view().held, 2, "the stopping process still counts");
    sim.confirm_all_detaches();
    assert_eq!(
        sim.spawns,
        vec![key(3)],
        "the new key starts in the freed slot"
    );
}

#[test]
fn a_full_pool_with_every_worker_leased_makes_the_new_key_wait() {
    let mut sim = Sim::new(Limits {
        max_processes: 1,
        ..limits()
    });
    sim.ask("a/1", 1);
    sim.spawn_ok();
    let waiting = sim.ask("b/1", 2);
    assert!(
        sim.evicted.is_empty(),
        "a leased worker is never stopped for room"
    );
    assert!(sim.queued.contains(&waiting));
    sim.give_back("a/1", Settle::Park, 1);
    assert_eq!(sim.evicted.len(), 1, "now idle, it makes room");
    assert!(sim.spawns.is_empty(), "once it is gone");
    sim.confirm_all_detaches();
    assert_eq!(sim.spawns, vec![key(2)]);
}

#[test]
fn the_global_session_cap_detaches_the_least_recently_used_parked_conversation() {
    let mut sim = Sim::new(Limits {
        max_sessions: 2,
        max_sessions_per_process: 10,
        ..limits()
    });
    sim.ask("a/1", 1);
    sim.spawn_ok();
    sim.give_back("a/1", Settle::Park, 1);
    sim.now += Duration::from_secs(1);
    sim.ask("a/2", 1);
    sim.give_back("a/2", Settle::Park, 1);
    sim.now += Duration::from_secs(1);

    let third = sim.ask("a/3", 1);
    assert!(sim.granted_to(third).is_some());
    assert_eq!(sim.detaches.len(), 1);
    assert_eq!(
        sim.detaches[0].0,
        vec!["a/1".to_owned()],
        "the least recently used"
    );

    // Every conversation leased: the next new one waits.
    sim.confirm_all_detaches();
    let again = sim.ask("a/2", 1);
    assert!(sim.granted_to(again).is_some());
    let fourth = sim.ask("a/4", 1);
    assert!(
        sim.queued.contains(&fourth),
        "the cap holds while all are leased"
    );
}

#[test]
fn a_conversation_parked_on_a_full_worker_takes_its_own_slot_when_its_settings_change() {
    let mut sim = Sim::new(Limits {
        max_processes_per_key: 1,
        max_sessions_per_process: 1,
        ..limits()
    });
    sim.ask_with("a/1", 1, "old", false);
    let w = sim.spawn_ok().expect("kept");
    sim.give_back("a/1", Settle::Park, 1);
    let changed = sim.ask_with("a/1", 1, "new", false);
    assert_eq!(
        sim.granted_to(changed),
        Some(w),
        "no waiting for the idle TTL"
    );
    assert!(
        sim.detaches.is_empty(),
        "its parked session moves with the grant (the open detaches it), never detached beside it"
    );
    let held = &sim.leases["a/1"];
    assert!(matches!(held.carried, Some((_, from, false)) if from == w));
}

#[test]
fn a_conversation_being_detached_is_granted_only_after_the_confirmation() {
    let mut sim = Sim::new(limits());
    sim.ask("a/1", 1);
    sim.spawn_ok();
    // A lost session: it must be detached before anyone leases the conversation again.
    sim.give_back("a/1", Settle::Detach, 1);
    assert_eq!(sim.detaches.len(), 1);
    let next = sim.ask("a/1", 1);
    assert!(sim.queued.contains(&next));
    sim.confirm_all_detaches();
    assert!(sim.granted_to(next).is_some());
}

#[test]
fn a_failed_detach_stops_the_old_worker_before_the_conversation_moves() {
    let mut sim = Sim::new(limits());
    sim.ask("a/1", 1);
    let w = sim.spawn_ok().expect("kept");
    sim.give_back("a/1", Settle::Detach, 1);
    let (conversations, worker) = sim.detaches.pop().expect("a detach");
    sim.fail_detach(conversations, worker);
    assert_eq!(sim.evicted, vec![(w, Eviction::DetachFailed)]);
}

#[test]
fn a_conversation_whose_detach_failed_is_granted_only_once_its_old_worker_has_stopped() {
    let mut sim = Sim::new(limits());
    sim.ask("a/1", 1);
    let w = sim.spawn_ok().expect("kept");
    sim.give_back("a/1", Settle::Detach, 1);
    let (conversations, worker) = sim.detaches.pop().expect("a detach");
    // The detach failed (the process is dying, or did not answer): it may still hold the
    // session, so the conversation waits for that process to be gone, not just evicted.
    let effects = sim.core.detached(&conversations, worker, false, sim.now);
    sim.apply(effects);
    assert_eq!(sim.evicted, vec![(w, Eviction::DetachFailed)]);
    let next = sim.ask("a/1", 1);
    sim.spawn_ok();
    assert!(
        sim.granted_to(next).is_none(),
        "granted while its old process may still hold the session"
    );
    sim.confirm_all_detaches();
    if !sim.spawns.is_empty() {
        sim.spawn_ok();
    }
    assert!(sim.granted_to(next).is_some());
}

#[test]
fn a_detach_that_fails_on_a_worker_already_being_stopped_waits_for_that_stop() {
    let mut sim = Sim::new(limits());
    sim.ask("a/1", 1);
    let w = sim.spawn_ok().expect("kept");
    sim.give_back("a/1", Settle::Detach, 1);
    let (conversations, worker) = sim.detaches.pop().expect("a detach");
    // Before the detach answers, the worker is stopped for another reason (here an
    // unsettled return of a second conversation).
    sim.ask("a/2", 1);
    sim.give_back("a/2", Settle::Unsettled, 0);
    assert_eq!(sim.evicted, vec![(w, Eviction::Unsettled)]);
    sim.fail_detach(conversations, worker);
    let next = sim.ask("a/1", 1);
    sim.spawn_ok();
    assert!(
        sim.granted_to(next).is_none(),
        "granted while its old process may still hold the session"
    );
    sim.confirm_all_detaches();
    if !sim.spawns.is_empty() {
        sim.spawn_ok();
    }
    assert!(sim.granted_to(next).is_some());
}

#[test]
fn an_unsettled_return_stops_the_worker_and_holds_its_conversations_until_it_is_gone() {
    let mut sim = Sim::new(limits());
    sim.ask("a/1", 1);
    let w = sim.spawn_ok().expect("kept");
    sim.give_back("a/1", Settle::Unsettled, 0);
    assert_eq!(sim.evicted, vec![(w, Eviction::Unsettled)]);
    let next = sim.ask("a/1", 1);
    assert!(
        sim.granted_to(next).is_none(),
        "not before the process is gone"
    );
    sim.confirm_all_detaches();
    sim.spawn_ok();
    assert!(sim.granted_to(next).is_some());
}

#[test]
fn workers_are_recycled_by_turn_count_and_by_memory() {
    let mut sim = Sim::new(Limits {
        max_turns_per_process: 3,
        ..limits()
    });
    sim.ask("a/1", 1);
    let worn = sim.spawn_ok().expect("kept");
    sim.give_back("a/1", Settle::Park, 3);
    assert_eq!(
        sim.evicted,
        vec![(worn, Eviction::Drained)],
        "no lease left"
    );

    sim.confirm_all_detaches();
    sim.ask("a/1", 1);
    let heavy = sim.spawn_ok().expect("kept");
    let effects = sim.core.measured(&[(heavy, 2 << 30)], sim.now);
    sim.apply(effects);
    assert_eq!(sim.evicted.len(), 1, "draining waits for the lease");
    let next = sim.ask("a/2", 1);
    assert_eq!(
        sim.spawns,
        vec![key(1)],
        "a draining worker takes nothing new"
    );
    sim.give_back("a/1", Settle::Park, 1);
    assert_eq!(sim.evicted.last(), Some(&(heavy, Eviction::Drained)));
    sim.spawn_ok();
    assert!(sim.granted_to(next).is_some());
}

#[test]
fn a_crash_with_work_schedules_a_respawn_and_too_many_quarantine_the_key() {
    let policy = RestartPolicy {
        max_restarts: 2,
        ..RestartPolicy::default()
    };
    let mut sim = Sim::new(Limits {
        restart: policy,
        ..limits()
    });
    let mut quarantined = false;
    for _ in 0..4 {
        let r = sim.ask("a/1", 1);
        if sim
            .failed
            .iter()
            .any(|(id, e)| *id == r && matches!(e, PoolError::RestartIntensityExceeded { .. }))
        {
            quarantined = true;
            break;
        }
        let w = match sim.spawn_ok() {
            Some(w) => w,
            None => {
                let key = sim.respawns.pop().expect("a scheduled respawn");
                let effects = sim.core.respawn_due(&key, sim.now);
                sim.apply(effects);
                sim.spawn_ok().expect("respawned")
            }
        };
        let effects = sim.core.crashed(w, Death::Killed, sim.now);
        sim.apply(effects);
        sim.leases.remove("a/1");
        let effects = sim
            .core
            .returned("a/1".into(), w, None, Settle::Detach, 0, sim.now);
        sim.apply(effects);
    }
    assert!(quarantined, "the key is quarantined after too many crashes");
}

#[test]
fn a_restart_scheduled_before_its_key_was_quarantined_starts_nothing_inside_the_quarantine() {
    let mut sim = Sim::new(Limits {
        restart: RestartPolicy {
            max_restarts: 1,
            ..RestartPolicy::default()
        },
        max_sessions_per_process: 1,
        ..limits()
    });
    sim.ask("a/1", 1);
    let first = sim.spawn_ok().expect("a/1's");
    sim.ask("a/2", 1);
    let second = sim.spawn_ok().expect("a/2's");
    // The first crashes under its lease: a restart is scheduled after the backoff.
    let effects = sim.core.crashed(first, Death::Failed, sim.now);
    sim.apply(effects);
    sim.leases.remove("a/1");
    let effects = sim
        .core
        .returned("a/1".into(), first, None, Settle::Detach, 0, sim.now);
    sim.apply(effects);
    let key = sim.respawns.pop().expect("a scheduled restart");
    // The second crashes too: past the intensity, the key is quarantined.
    let effects = sim.core.crashed(second, Death::Failed, sim.now);
    sim.apply(effects);
    assert_eq!(sim.quarantines, 1);
    // The first's restart comes due inside the quarantine.
    sim.now += Duration::from_secs(1);
    let effects = sim.core.respawn_due(&key, sim.now);
    sim.apply(effects);
    assert!(sim.spawns.is_empty(), "started {:?}", sim.spawns);
}

#[test]
fn a_call_naming_no_conversation_gets_a_process_of_its_key_without_taking_a_conversation_slot() {
    let mut sim = Sim::new(limits());
    let first = sim.ask_process(1);
    assert_eq!(
        sim.spawns,
        vec![key(1)],
        "no worker of the key yet: one starts"
    );
    assert!(sim.queued.contains(&first));
    let w = sim.spawn_ok().expect("kept");
    assert_eq!(sim.process_of(first), Some(w));
    assert_eq!(sim.core.status(sim.now).conversations, 0, "no conversation");
    // The key's worker is full of conversations (2 per process): a call still gets it.
    sim.ask("a/1", 1);
    sim.ask("a/2", 1);
    assert_eq!(sim.granted.len(), 2);
    let second = sim.ask_process(1);
    assert_eq!(
        sim.process_of(second),
        Some(w),
        "answered at once, same process"
    );
    assert!(sim.spawns.is_empty(), "no new process for a call");
    // Another key's call never gets this key's process.
    let other = sim.ask_process(2);
    assert_eq!(sim.process_of(other), None);
    assert_eq!(sim.spawns, vec![key(2)]);
    sim.release_process(first);
    sim.release_process(second);
    assert_eq!(
        sim.core.workers[&w].leased, 2,
        "the conversations' leases remain"
    );
}

#[test]
fn a_worker_under_a_process_lease_is_not_stopped_when_idle_and_goes_once_released() {
    let mut sim = Sim::new(limits());
    let call = sim.ask_process(1);
    let w = sim.spawn_ok().expect("kept");
    assert_eq!(sim.process_of(call), Some(w));
    sim.tick(Duration::from_secs(400));
    assert!(sim.evicted.is_empty(), "held past the idle TTL: kept");
    sim.release_process(call);
    sim.tick(Duration::from_secs(400));
    assert_eq!(sim.evicted, vec![(w, Eviction::Idle)]);
}

#[test]
fn a_process_call_in_a_full_pool_stops_an_idle_worker_of_another_key_or_waits_for_one() {
    let mut sim = Sim::new(Limits {
        max_processes: 1,
        ..limits()
    });
    let held = sim.ask_process(1);
    let w1 = sim.spawn_ok().expect("kept");
    assert_eq!(sim.process_of(held), Some(w1));
    // The pool is full and its only worker is held: the other key waits.
    let waiting = sim.ask_process(2);
    assert!(sim.queued.contains(&waiting) && sim.spawns.is_empty());
    // Released, the idle worker makes room for the waiting key.
    sim.release_process(held);
    assert_eq!(sim.evicted, vec![(w1, Eviction::Full)]);
    sim.confirm_all_detaches();
    let w2 = sim.spawn_ok().expect("kept");
    assert_eq!(sim.process_of(waiting), Some(w2));
}

#[test]
fn a_conversation_abandoned_on_a_draining_worker_waits_for_that_process_to_be_gone() {
    let mut sim = Sim::new(limits());
    sim.ask("a/1", 1);
    let w = sim.spawn_ok().expect("kept");
    // Recycled by memory while the open runs: it drains.
    let effects = sim.core.measured(&[(w, 2 << 30)], sim.now);
    sim.apply(effects);
    // The open gives up (its resume timed out), the session maybe attached there: the
    // abandon ends the drain, and the process is stopped.
    let (name, held) = sim.take_lease(0).expect("the lease");
    let abandon = Abandon {
        conversation: name,
        worker: held.worker,
        carried: None,
        opened: None,
        maybe_attached: Some(CliSessionId::random()),
        resume_crashed: false,
    };
    let effects = sim.core.abandoned(abandon, sim.now);
    sim.failed_detaches.push(("a/1".to_owned(), w));
    sim.apply(effects);
    assert_eq!(sim.evicted, vec![(w, Eviction::Drained)]);
    let next = sim.ask("a/1", 1);
    sim.spawn_ok();
    assert!(
        sim.granted_to(next).is_none(),
        "not while the stopping process may still hold it"
    );
    sim.confirm_all_detaches();
    sim.spawn_ok();
    assert!(sim.granted_to(next).is_some());
}

#[test]
fn a_draining_worker_takes_no_process_call_and_finishes_its_drain_when_released() {
    let mut sim = Sim::new(limits());
    let call = sim.ask_process(1);
    let w = sim.spawn_ok().expect("kept");
    assert_eq!(sim.process_of(call), Some(w));
    // Recycled by memory while the call runs: it drains, and the next call starts another.
    let effects = sim.core.measured(&[(w, 2 << 30)], sim.now);
    sim.apply(effects);
    assert!(sim.evicted.is_empty(), "not stopped under its lease");
    let next = sim.ask_process(1);
    assert_eq!(sim.process_of(next), None);
    assert_eq!(sim.spawns, vec![key(1)]);
    sim.release_process(call);
    assert_eq!(sim.evicted, vec![(w, Eviction::Drained)]);
}

#[test]
fn a_worker_killed_after_serving_is_replaced_at_once_and_never_quarantines_its_key() {
    let mut sim = Sim::new(limits());
    let mut respawns = 0;
    for round in 0..20 {
        if round == 0 {
            sim.ask("a/1", 1);
        }
        let w = sim.spawn_ok().expect("a worker");
        let effects = sim
            .core
            .opened("a/1", w, CliSessionId::random(), OpenReason::Resumed);
        sim.apply(effects);
        // Killed from outside two seconds into its life, mid-turn.
        sim.killed_after(Duration::from_secs(2), w);
        assert!(
            sim.failed.is_empty(),
            "round {round}: {:?}",
            sim.failed.last()
        );
        sim.leases.remove("a/1");
        let effects = sim
            .core
            .returned("a/1".into(), w, None, Settle::Detach, 0, sim.now);
        sim.apply(effects);
        let key = sim.respawns.pop().expect("replaced");
        respawns += 1;
        let effects = sim.core.respawn_due(&key, sim.now);
        sim.apply(effects);
        sim.ask("a/1", 1);
    }
    assert_eq!(respawns, 20);
    assert!(sim.core.status(sim.now).quarantined_keys.is_empty());
}

#[test]
fn a_runtime_that_fails_by_itself_on_every_turn_is_quarantined_however_long_it_served() {
    let mut sim = Sim::new(limits());
    sim.ask("a/1", 1);
    let mut quarantined = false;
    for _ in 0..20 {
        let Some(w) = sim.spawn_ok() else {
            break;
        };
        let effects = sim
            .core
            .opened("a/1", w, CliSessionId::random(), OpenReason::Resumed);
        sim.apply(effects);
        // Two seconds in, mid-turn, it aborts (SIGABRT: a fault of its own, no kill).
        sim.died_after(Duration::from_secs(2), w, Death::Failed);
        if sim.crashed_lease_handed_back(w) {
            quarantined = true;
            break;
        }
        let key = sim.respawns.pop().expect("a restart before the quarantine");
        sim.now += Duration::from_secs(1);
        let effects = sim.core.respawn_due(&key, sim.now);
        sim.apply(effects);
        sim.ask("a/1", 1);
    }
    assert!(
        quarantined,
        "a runtime failing on every turn is a crash loop"
    );
}

#[test]
fn an_exit_status_tells_a_kill_from_outside_from_a_fault_of_the_runtimes_own() {
    use crate::process::ExitInfo;
    for killed in [
        None,
        Some(ExitInfo::Signal(9)),
        Some(ExitInfo::Signal(15)),
        Some(ExitInfo::Code(0)),
        Some(ExitInfo::Code(137)),
        Some(ExitInfo::Code(143)),
        Some(ExitInfo::Unknown),
    ] {
        assert_eq!(Death::of(killed), Death::Killed, "{killed:?}");
    }
    for failed in [
        Some(ExitInfo::Signal(11)),
        Some(ExitInfo::Signal(6)),
        Some(ExitInfo::Code(1)),
        Some(ExitInfo::Code(134)),
    ] {
        assert_eq!(Death::of(failed), Death::Failed, "{failed:?}");
    }
    // A runtime that hung or broke the protocol failed by itself, though the pool's own
    // SIGKILL ended it.
    use crate::worker::{ExitReason, WorkerExit};
    let ended = |reason| WorkerExit {
        reason,
        pid: 1,
        stderr_tail: String::new(),
    };
    for reason in [
        ExitReason::Hung {
            misses: 2,
            timeout: Duration::from_secs(5),
        },
        ExitReason::ProtocolViolation("not JSON".into()),
    ] {
        assert_eq!(Death::of_worker(Some(&ended(reason))), Death::Failed);
    }
    let killed = ended(ExitReason::ChildExited(ExitInfo::Signal(9)));
    assert_eq!(Death::of_worker(Some(&killed)), Death::Killed);
    assert_eq!(Death::of_worker(None), Death::Killed);
}

/// `a/1` opens on a process with room for four (so its key keeps no spare beside it) and is
/// parked; two seconds later the process is killed from outside, no spare races its
/// replacement, and the replacement's start is due (its `Spawn` pending).
fn killed_from_outside_and_replacement_due() -> Sim {
    let mut sim = Sim::new(Limits {
        max_sessions_per_process: 4,
        ..spares(1)
    });
    sim.ask("a/1", 1);
    let w = sim.spawn_ok().expect("a worker");
    let effects = sim
        .core
        .opened("a/1", w, CliSessionId::random(), OpenReason::New);
    sim.apply(effects);
    sim.give_back("a/1", Settle::Park, 1);
    assert!(
        sim.spawns.is_empty(),
        "room in the serving process: no spare"
    );
    sim.killed_after(Duration::from_secs(2), w);
    assert!(
        sim.spawns.is_empty(),
        "no spare races the replacement: {:?} (primed: {:?})",
        sim.spawns,
        sim.primes
    );
    let respawned = sim.respawns.pop().expect("replaced");
    let effects = sim.core.respawn_due(&respawned, sim.now);
    sim.apply(effects);
    assert_eq!(sim.spawns, vec![key(1)]);
    sim
}

#[test]
fn a_process_killed_from_outside_is_replaced_by_an_unprimed_start_not_by_a_primed_spare() {
    // Killed from outside while idle, its conversation parked on it: the conversation
    // comes back at once, so its replacement must not hold it up with a priming turn.
    let mut sim = killed_from_outside_and_replacement_due();
    assert_eq!(
        sim.primes.last(),
        Some(&false),
        "the replacement is not primed"
    );
    let back = sim.ask("a/1", 1);
    let replacement = sim.spawn_ok().expect("the replacement");
    assert_eq!(sim.granted_to(back), Some(replacement));
}

#[test]
fn a_key_whose_replacement_could_not_start_for_want_of_resources_gets_its_spare_later() {
    let mut sim = killed_from_outside_and_replacement_due();
    sim.spawns.clear();
    let failed = Err(WorkerError::ResourceExhausted("fork: EAGAIN".into()));
    let (id, effects) = sim.core.spawned(key(1), failed, sim.now);
    assert_eq!(id, None);
    sim.apply(effects);

    // The machine's resources are back by the next tick: the key, with traffic in its
    // window and no process, gets its spare as any such key does.
    sim.tick(Duration::from_secs(1));
    assert_eq!(
        sim.spawns,
        vec![key(1)],
        "a spare once the replacement is no longer due"
    );
    assert_eq!(sim.primes.last(), Some(&true));
}

#[test]
fn a_worker_that_dies_before_serving_still_quarantines_its_key() {
    let mut sim = Sim::new(limits());
    sim.ask("a/1", 1);
    let mut quarantined = false;
    for _ in 0..10 {
        let w = sim.spawn_ok().expect("a worker");
        // Dies long after its start, but never opened a conversation: a crash loop.
        sim.now += Duration::from_secs(5);
        let effects = sim.core.crashed(w, Death::Killed, sim.now);
        sim.apply(effects);
        if sim.crashed_lease_handed_back(w) {
            quarantined = true;
            break;
        }
        let key = sim.respawns.pop().expect("a respawn before the quarantine");
        let effects = sim.core.respawn_due(&key, sim.now);
        sim.apply(effects);
        sim.ask("a/1", 1);
    }
    assert!(quarantined, "a crash loop is quarantined");
}

/// `key(n)` with another credential version (same family).
fn key_version(n: u8, version: &str) -> PoolKey {
    PoolKey {
        profile_version: Some(version.to_owned()),
        ..key(n)
    }
}

impl Sim {
    fn ask_key(&mut self, conversation: &str, key: PoolKey) -> RequestId {
        self.submit(Ask {
            key,
            ..ask_of(conversation, 1)
        })
    }
}

#[test]
fn a_conversation_back_with_a_new_credential_version_drains_the_old_ones_workers() {
    let mut sim = Sim::new(limits());
    sim.ask_key("a/1", key_version(1, "v1"));
    let old = sim.spawn_ok().expect("v1 worker");
    sim.give_back("a/1", Settle::Park, 1);
    let rotated = sim.ask_key("a/1", key_version(1, "v2"));
    assert_eq!(
        sim.evicted,
        vec![(old, Eviction::Drained)],
        "no lease left on it"
    );
    sim.confirm_all_detaches();
    sim.spawn_ok().expect("v2 worker");
    assert!(sim.granted_to(rotated).is_some());
}

#[test]
fn a_rotated_away_credential_version_gets_no_warm_spare() {
    let mut sim = Sim::new(Limits {
        max_sessions_per_process: 2,
        ..spares(1)
    });
    sim.ask_key("a/1", key_version(1, "v1"));
    let old = sim.spawn_ok().expect("v1 worker");
    sim.give_back("a/1", Settle::Park, 1);
    assert!(
        sim.spawns.is_empty(),
        "room in the serving process: no spare"
    );
    let rotated = sim.ask_key("a/1", key_version(1, "v2"));
    assert_eq!(sim.evicted, vec![(old, Eviction::Drained)]);
    sim.confirm_all_detaches();
    assert_eq!(
        sim.spawns,
        vec![key_version(1, "v2")],
        "only the new version starts"
    );
    sim.new_version_serves_and_no_stale_spare(rotated);
}

impl Sim {
    /// The new version's process starts and serves `rotated` (a/1); once a/1 is handed
    /// back and a tick passed, nothing starts: the old version's traffic is over, its
    /// credentials stale, so no spare comes for them.
    fn new_version_serves_and_no_stale_spare(&mut self, rotated: RequestId) {
        self.spawn_ok().expect("v2 worker");
        assert!(self.granted_to(rotated).is_some());
        self.give_back("a/1", Settle::Park, 1);
        self.tick(Duration::from_secs(1));
        assert!(
            self.spawns.is_empty(),
            "no spare for the stale version: {:?}",
            self.spawns
        );
    }

    /// `by` passes and `worker`'s child dies (a SIGKILL from outside, say): its exit, then
    /// its crash.
    fn killed_after(&mut self, by: Duration, worker: WorkerId) {
        self.died_after(by, worker, Death::Killed);
    }

    /// a/1's lease on `worker`, whose process crashed, is handed back with nothing to park;
    /// returns whether a key is quarantined now.
    fn crashed_lease_handed_back(&mut self, worker: WorkerId) -> bool {
        self.leases.remove("a/1");
        let effects = self
            .core
            .returned("a/1".into(), worker, None, Settle::Detach, 0, self.now);
        self.apply(effects);
        !self.core.status(self.now).quarantined_keys.is_empty()
    }

    /// `by` passes and `worker`'s child dies as `death` says.
    fn died_after(&mut self, by: Duration, worker: WorkerId, death: Death) {
        self.now += by;
        self.core.exited(worker);
        let effects = self.core.crashed(worker, death, self.now);
        self.apply(effects);
    }
}

/// `a/1` of `key` opens on a process with room for four, is handed back, and the process
/// idles out and stops: a primed spare of `key` stands in its place. Returns the simulation,
/// the stopped process and the spare.
fn idled_out_into_a_spare(key: PoolKey) -> (Sim, WorkerId, WorkerId) {
    let mut sim = Sim::new(Limits {
        max_sessions_per_process: 4,
        ..spares(1)
    });
    sim.ask_key("a/1", key);
    let old = sim.spawn_ok().expect("a/1's process");
    sim.give_back("a/1", Settle::Park, 1);
    sim.tick(Duration::from_secs(61));
    assert_eq!(sim.evicted, vec![(old, Eviction::Idle)]);
    let (conversations, worker) = sim.stops.pop().expect("the eviction");
    sim.stop_done(conversations, worker);
    let spare = sim.spawn_ok().expect("the spare in its place");
    assert_eq!(sim.state_of(spare), Some(WorkerState::Spare));
    (sim, old, spare)
}

#[test]
fn a_conversation_back_with_a_new_version_after_its_process_idled_out_stops_the_old_versions_spare()
{
    let (mut sim, _, spare) = idled_out_into_a_spare(key_version(1, "v1"));

    // a/1 comes back with a new token: the spare holds the old one and nothing of a/1.
    let rotated = sim.ask_key("a/1", key_version(1, "v2"));
    assert_eq!(
        sim.evicted.last(),
        Some(&(spare, Eviction::Drained)),
        "the old version's spare is stopped with the rotation"
    );
    assert_eq!(sim.spawns, vec![key_version(1, "v2")]);
    sim.new_version_serves_and_no_stale_spare(rotated);
}

#[test]
fn a_conversation_back_with_a_new_version_after_its_process_died_mid_turn_drains_the_old_versions_replacement()
 {
    let mut sim = Sim::new(Limits {
        max_sessions_per_process: 4,
        ..spares(1)
    });
    sim.ask_key("a/1", key_version(1, "v1"));
    let w = sim.spawn_ok().expect("v1 worker");
    // Dies under the turn; the turn's lease comes back after the death.
    sim.killed_after(Duration::from_secs(2), w);
    sim.leases.remove("a/1");
    let effects = sim
        .core
        .returned("a/1".into(), w, None, Settle::Detach, 0, sim.now);
    sim.apply(effects);
    let respawned = sim.respawns.pop().expect("replaced");
    let effects = sim.core.respawn_due(&respawned, sim.now);
    sim.apply(effects);
    let replacement = sim.spawn_ok().expect("the v1 replacement");

    sim.ask_key("a/1", key_version(1, "v2"));
    assert_eq!(
        sim.evicted.last(),
        Some(&(replacement, Eviction::Drained)),
        "the stale version's replacement goes with the rotation"
    );
}

#[test]
fn a_new_conversation_on_another_version_of_the_family_leaves_the_first_versions_spare() {
    let (mut sim, old, spare) = idled_out_into_a_spare(key_version(1, "user-1"));
    sim.ask_key("a/2", key_version(1, "user-2"));
    sim.spawn_ok().expect("user-2's worker");
    assert_eq!(sim.evicted, vec![(old, Eviction::Idle)], "not the spare");
    assert_eq!(sim.state_of(spare), Some(WorkerState::Spare));
}

#[test]
fn two_conversations_on_two_versions_of_one_family_do_not_stop_each_others_workers() {
    let mut sim = Sim::new(limits());
    sim.ask_key("a/1", key_version(1, "user-1"));
    sim.spawn_ok().expect("first");
    sim.give_back("a/1", Settle::Park, 1);
    sim.ask_key("a/2", key_version(1, "user-2"));
    sim.spawn_ok().expect("second");
    sim.give_back("a/2", Settle::Park, 1);
    for _ in 0..3 {
        sim.ask_key("a/1", key_version(1, "user-1"));
        sim.give_back("a/1", Settle::Park, 1);
        sim.ask_key("a/2", key_version(1, "user-2"));
        sim.give_back("a/2", Settle::Park, 1);
    }
    assert!(sim.evicted.is_empty(), "{:?}", sim.evicted);
    assert!(
        sim.spawns.is_empty(),
        "each conversation stays on its worker"
    );
}

#[test]
fn a_queued_lease_that_expires_says_its_conversation_is_still_leased() {
    let mut sim = Sim::new(limits());
    sim.ask("a/1", 1);
    sim.spawn_ok();
    let second = sim.ask("a/1", 1);
    let effects = sim.core.expire(second);
    sim.apply(effects);
    assert!(matches!(
        sim.failed.last(),
        Some((r, PoolError::ConversationWaitTimeout { .. })) if *r == second
    ));
}

/// One step of the property test.
#[derive(Debug, Clone)]
enum Step {
    Ask {
        conversation: u8,
        key: u8,
        compat: u8,
        setup: u8,
        fail_if_busy: bool,
    },
    Opened {
        pick: usize,
    },
    Return {
        pick: usize,
        settle: u8,
        alive: bool,
        turns: u64,
    },
    Abandon {
        pick: usize,
        opened: bool,
        maybe_attached: bool,
        resume_crashed: bool,
    },
    GiveUp {
        pick: usize,
    },
    SpawnDone {
        pick: usize,
        ok: bool,
    },
    Confirm {
        pick: usize,
        ok: bool,
    },
    /// A child exits; its supervision event comes later (or not yet).
    Exit {
        pick: usize,
    },
    Crash {
        pick: usize,
    },
    Stop {
        pick: usize,
    },
    Respawn {
        pick: usize,
    },
    Expire {
        pick: usize,
    },
    Measure {
        pick: usize,
        heavy: bool,
    },
    Tick {
        secs: u64,
    },
    /// A call naming no conversation asks for a process of a key.
    AskProcess {
        key: u8,
    },
    /// The pool resumes a remembered conversation ahead of its return.
    WarmUp {
        conversation: u8,
        key: u8,
        compat: u8,
        setup: u8,
    },
    ReleaseProcess {
        pick: usize,
    },
    /// The CLI side's processes change (as many as the cap leaves it, one idle or none).
    CliSide {
        held: u8,
        idle: bool,
    },
    /// A CLI lease needs room: the oldest idle worker here is stopped for it.
    EvictForCli,
}

fn step() -> impl Strategy<Value = Step> {
    let pick = any::<usize>;
    prop_oneof![
        5 => (0u8..6, 0u8..3, 0u8..2, 0u8..2, any::<bool>()).prop_map(
            |(conversation, key, compat, setup, fail_if_busy)| Step::Ask {
                conversation, key, compat, setup, fail_if_busy
            }
        ),
        2 => pick().prop_map(|pick| Step::Opened { pick }),
        4 => (pick(), 0u8..3, prop::bool::weighted(0.8), 0u64..3).prop_map(
            |(pick, settle, alive, turns)| Step::Return { pick, settle, alive, turns }
        ),
        1 => (pick(), any::<bool>(), any::<bool>(), any::<bool>()).prop_map(
            |(pick, opened, maybe_attached, resume_crashed)| Step::Abandon {
                pick, opened, maybe_attached, resume_crashed
            }
        ),
        1 => pick().prop_map(|pick| Step::GiveUp { pick }),
        3 => (pick(), prop::bool::weighted(0.8)).prop_map(|(pick, ok)| Step::SpawnDone { pick, ok }),
        3 => (pick(), prop::bool::weighted(0.8)).prop_map(|(pick, ok)| Step::Confirm { pick, ok }),
        1 => pick().prop_map(|pick| Step::Exit { pick }),
        1 => pick().prop_map(|pick| Step::Crash { pick }),
        1 => pick().prop_map(|pick| Step::Stop { pick }),
        1 => pick().prop_map(|pick| Step::Respawn { pick }),
        1 => pick().prop_map(|pick| Step::Expire { pick }),
        1 => (pick(), any::<bool>()).prop_map(|(pick, heavy)| Step::Measure { pick, heavy }),
        1 => (0u64..400).prop_map(|secs| Step::Tick { secs }),
        2 => (0u8..3).prop_map(|key| Step::AskProcess { key }),
        2 => pick().prop_map(|pick| Step::ReleaseProcess { pick }),
        2 => (0u8..6, 0u8..3, 0u8..2, 0u8..2).prop_map(|(conversation, key, compat, setup)| {
            Step::WarmUp { conversation, key, compat, setup }
        }),
        1 => (0u8..3, any::<bool>()).prop_map(|(held, idle)| Step::CliSide { held, idle }),
        1 => Just(Step::EvictForCli),
    ]
}

impl Sim {
    /// Removes the `pick`-th outstanding lease (modulo their number).
    fn take_lease(&mut self, pick: usize) -> Option<(String, Held)> {
        let name = self
            .leases
            .keys()
            .nth(pick % self.leases.len().max(1))?
            .clone();
        let held = self.leases.remove(&name)?;
        Some((name, held))
    }

    fn pick_worker(&self, pick: usize) -> Option<WorkerId> {
        self.workers.get(pick % self.workers.len().max(1)).copied()
    }

    fn token(&mut self) -> Token {
        self.next_token += 1;
        self.next_token
    }

    fn play(&mut self, step: Step) {
        let now = self.now;
        match step {
            Step::Ask {
                conversation,
                key,
                compat,
                setup,
                fail_if_busy,
            } => {
                let name = format!("c/{conversation}");
                let (compat, setup) = (compat.to_string(), setup.to_string());
                self.ask_full(&name, key, &compat, &setup, fail_if_busy, false);
            }
            Step::WarmUp {
                conversation,
                key,
                compat,
                setup,
            } => {
                let name = format!("c/{conversation}");
                self.warm_up(&name, key, &compat.to_string(), &setup.to_string());
            }
            Step::Opened { pick } => {
                let Some(name) = self
                    .leases
                    .keys()
                    .nth(pick % self.leases.len().max(1))
                    .cloned()
                else {
                    return;
                };
                let worker = self.leases[&name].worker;
                let effects =
                    self.core
                        .opened(&name, worker, CliSessionId::random(), OpenReason::Resumed);
                self.apply(effects);
            }
            Step::Return {
                pick,
                settle,
                alive,
                turns,
            } => {
                let Some((name, held)) = self.take_lease(pick) else {
                    return;
                };
                let settle = [Settle::Park, Settle::Detach, Settle::Unsettled][settle as usize];
                let session = alive.then(|| self.token());
                let effects = self
                    .core
                    .returned(name, held.worker, session, settle, turns, now);
                self.apply(effects);
            }
            Step::Abandon {
                pick,
                opened,
                maybe_attached,
                resume_crashed,
            } => {
                let Some((name, held)) = self.take_lease(pick) else {
                    return;
                };
                // What the opener held when it gave up: the session it carried from another
                // worker (not yet detached), or one it opened (the carried one, on its own
                // worker).
                let (carried, reused) = match held.carried {
                    Some((token, from, false)) => (Some((token, from)), None),
                    Some((token, _, true)) => (None, Some(token)),
                    None => (None, None),
                };
                let opened = reused.or_else(|| opened.then(|| self.token()));
                let abandon = Abandon {
                    conversation: name.clone(),
                    worker: held.worker,
                    carried,
                    opened,
                    maybe_attached: maybe_attached.then(CliSessionId::random),
                    resume_crashed,
                };
                let effects = self.core.abandoned(abandon, now);
                // A session maybe left attached on a process that is stopping (or stopped by
                // this abandon) is held there until that process is gone.
                let stopping = effects
                    .iter()
                    .any(|e| matches!(e, Effect::Evict { worker, .. } if *worker == held.worker))
                    || self.stops.iter().any(|(_, w)| *w == held.worker);
                if maybe_attached && stopping {
                    self.failed_detaches.push((name, held.worker));
                }
                self.apply(effects);
            }
            Step::GiveUp { pick } => {
                if self.queued.is_empty() {
                    return;
                }
                let request = self.queued.remove(pick % self.queued.len());
                self.core.withdraw(request);
            }
            Step::SpawnDone { pick, ok } => {
                if self.spawns.is_empty() {
                    return;
                }
                let key = self.spawns.remove(pick % self.spawns.len());
                let started = if ok {
                    Ok(StartedWorker {
                        pid: self.token(),
                        primed: None,
                    })
                } else {
                    Err(WorkerError::Spawn("test".into()))
                };
                let (id, effects) = self.core.spawned(key, started, now);
                self.workers.extend(id);
                self.apply(effects);
            }
            Step::Confirm { pick, ok } => {
                // Evictions' stops are answered among the detaches.
                if !self.stops.is_empty() && (self.detaches.is_empty() || pick % 2 == 1) {
                    let (conversations, worker) = self.stops.remove(pick % self.stops.len());
                    self.stop_done(conversations, worker);
                    return;
                }
                if self.detaches.is_empty() {
                    return;
                }
                let (conversations, worker) = self.detaches.remove(pick % self.detaches.len());
                if ok {
                    let effects = self.core.detached(&conversations, worker, true, now);
                    self.apply(effects);
                } else {
                    self.fail_detach(conversations, worker);
                }
            }
            Step::Exit { pick } => {
                if let Some(worker) = self.pick_worker(pick) {
                    self.core.exited(worker);
                    self.exited.push(worker);
                }
            }
            Step::Crash { pick } => {
                let Some(worker) = self.pick_worker(pick) else {
                    return;
                };
                self.core.exited(worker);
                let effects = self.core.crashed(worker, Death::Killed, now);
                self.apply(effects);
            }
            Step::Stop { pick } => {
                let Some(worker) = self.pick_worker(pick) else {
                    return;
                };
                self.core.exited(worker);
                let (_, effects) = self.core.stopped(worker, now);
                self.apply(effects);
            }
            Step::Respawn { pick } => {
                if self.respawns.is_empty() {
                    return;
                }
                let key = self.respawns.remove(pick % self.respawns.len());
                let effects = self.core.respawn_due(&key, now);
                self.apply(effects);
            }
            Step::Expire { pick } => {
                let Some(&request) = self.queued.get(pick % self.queued.len().max(1)) else {
                    return;
                };
                let effects = self.core.expire(request);
                self.apply(effects);
            }
            Step::Measure { pick, heavy } => {
                let Some(worker) = self.pick_worker(pick) else {
                    return;
                };
                let rss = if heavy { 2 << 30 } else { 1 << 20 };
                let effects = self.core.measured(&[(worker, rss)], now);
                self.apply(effects);
            }
            Step::Tick { secs } => {
                self.now += Duration::from_secs(secs);
                let effects = self.core.maintain(self.now);
                self.apply(effects);
            }
            Step::AskProcess { key } => {
                self.ask_process(key);
            }
            Step::ReleaseProcess { pick } => {
                if let Some(&(request, _)) = self.processes.get(pick % self.processes.len().max(1))
                {
                    self.release_process(request);
                }
            }
            Step::CliSide { held, idle } => {
                // The CLI side keeps to the cap too: at most what this side leaves it.
                let room = self
                    .core
                    .limits
                    .max_processes
                    .saturating_sub(self.core.view().held);
                let held = usize::from(held).min(room);
                self.core.set_others(Others {
                    held,
                    idle_since: (idle && held > 0).then_some(now),
                    making_room: false,
                });
                let effects = self.core.others_changed(now);
                self.apply(effects);
            }
            Step::EvictForCli => {
                let effects = self.core.evict_for_other();
                self.apply(effects);
            }
        }
        // The actor serves, after every message, what a stop for the CLI side left.
        let effects = self.core.serve_owed(self.now);
        self.apply(effects);
    }

    /// Plays everything out with no more faults: every lease returns, every detach is
    /// confirmed, every spawn and respawn succeeds. At rest, nothing may be left waiting
    /// and nothing left being detached (a waiter that can never be served, or a detach
    /// count that leaks, fails here).
    fn come_to_rest(&mut self) {
        // The CLI side gives its processes up.
        self.core.set_others(Others::default());
        let effects = self.core.others_changed(self.now);
        self.apply(effects);
        let mut quiet_ticks = 0;
        for _ in 0..1000 {
            let now = self.now;
            if let Some(&(request, _)) = self.processes.first() {
                self.release_process(request);
            } else if let Some((name, held)) = self.take_lease(0) {
                let token = self.token();
                let effects =
                    self.core
                        .returned(name, held.worker, Some(token), Settle::Park, 1, now);
                self.apply(effects);
            } else if let Some((conversations, worker)) = self.detaches.pop() {
                let effects = self.core.detached(&conversations, worker, true, now);
                self.apply(effects);
            } else if let Some((conversations, worker)) = self.stops.pop() {
                self.stop_done(conversations, worker);
            } else if !self.spawns.is_empty() {
                self.play(Step::SpawnDone { pick: 0, ok: true });
            } else if let Some(worker) = self.exited.pop() {
                // The supervision event of an exit always comes.
                let effects = self.core.crashed(worker, Death::Killed, now);
                self.apply(effects);
            } else if let Some(key) = self.respawns.pop() {
                // Past any backoff.
                self.now += Duration::from_secs(11);
                let effects = self.core.respawn_due(&key, self.now);
                self.apply(effects);
            } else if quiet_ticks < 3 {
                // The maintenance tick (every second in the pool).
                quiet_ticks += 1;
                self.now += Duration::from_secs(1);
                let effects = self.core.maintain(self.now);
                self.apply(effects);
                continue;
            } else {
                break;
            }
            quiet_ticks = 0;
        }
        assert!(
            self.leases.is_empty()
                && self.detaches.is_empty()
                && self.stops.is_empty()
                && self.spawns.is_empty()
        );
        assert!(self.processes.is_empty());
        assert!(
            self.core.stopping.is_empty(),
            "stops never confirmed: {:?}",
            self.core.stopping.keys().collect::<Vec<_>>()
        );
        assert!(
            self.core.detaching.is_empty(),
            "detach counts leaked: {:?}",
            self.core.detaching
        );
        let stuck: Vec<_> = self
            .core
            .waiters
            .iter()
            .map(|w| (w.conversation.clone(), w.key.short_hash()))
            .collect();
        let quarantined = self
            .core
            .keys
            .values()
            .any(|k| k.restart.quarantined_until(self.now).is_some());
        assert!(
            stuck.is_empty() || quarantined,
            "waiters left with nothing in their way: {stuck:?}"
        );
    }
}

// ---- Packing and warm spares ----------------------------------------------------------------

/// An ask of `conversation` on key `k` (compat `c`, no setup, a turn's: traffic of its key,
/// none of the other flags), for a test to change before [`Sim::submit`].
fn ask_of(conversation: &str, k: u8) -> Ask<()> {
    Ask {
        id: 0,
        key: key(k),
        spec: (),
        conversation: conversation.to_owned(),
        compat: "c".to_owned(),
        setup: String::new(),
        gateway_key: conversation.to_owned(),
        fail_if_busy: false,
        wait: Duration::from_secs(60),
        process_only: false,
        any_setup: false,
        traffic: true,
    }
}

/// `n` warm spares, one conversation per process (so a key's second conversation outgrows
/// its first process, and a spare stands beside the full ones), three processes per key.
fn spares(n: usize) -> Limits {
    Limits {
        warm_spares: n,
        idle_ttl: Duration::from_secs(60),
        max_sessions_per_process: 1,
        max_processes_per_key: 3,
        ..limits()
    }
}

impl Sim {
    fn state_of(&self, worker: WorkerId) -> Option<WorkerState> {
        let w = self.core.workers.get(&worker)?;
        Some(self.core.state_of(worker, w, self.now))
    }

    /// `by` passes, then the maintenance tick runs (idle TTL, drains, spares).
    fn tick(&mut self, by: Duration) {
        self.now += by;
        let effects = self.core.maintain(self.now);
        self.apply(effects);
    }

    /// Key `k` outgrows its one-conversation process (`spares`' packing): `first` opens on
    /// a new process, `second` finds it full and waits for another; both are handed back, so
    /// the key is quiet. Returns the two processes.
    fn outgrow(&mut self, first: &str, second: &str, k: u8) -> (WorkerId, WorkerId) {
        self.ask(first, k);
        let one = self.spawn_ok().expect("the first process");
        let r = self.ask(second, k);
        assert!(
            self.queued.contains(&r),
            "{second} finds {first}'s process full"
        );
        let two = self.spawn_ok().expect("the second process");
        assert_eq!(self.granted_to(r), Some(two));
        self.give_back(first, Settle::Park, 1);
        self.give_back(second, Settle::Park, 1);
        (one, two)
    }
}

#[test]
fn a_key_fills_one_process_before_it_starts_another() {
    let mut sim = Sim::new(Limits {
        max_sessions_per_process: 3,
        ..limits()
    });
    sim.ask("a/1", 1);
    let first = sim.spawn_ok().expect("kept");
    for i in 2..=3 {
        let r = sim.ask(&format!("a/{i}"), 1);
        assert_eq!(
            sim.granted_to(r),
            Some(first),
            "a/{i} joins the running process"
        );
    }
    assert!(
        sim.spawns.is_empty(),
        "no second process while the first has room"
    );
    let fourth = sim.ask("a/4", 1);
    assert!(
        sim.queued.contains(&fourth),
        "full: the fourth waits for a start"
    );
    assert_eq!(sim.spawns, vec![key(1)]);
    let second = sim.spawn_ok().expect("kept");
    assert_eq!(sim.granted_to(fourth), Some(second));
}

#[test]
fn a_new_conversation_joins_a_serving_process_before_an_empty_one() {
    let mut sim = Sim::new(Limits {
        max_sessions_per_process: 2,
        ..limits()
    });
    sim.ask("a/1", 1);
    let w1 = sim.spawn_ok().expect("kept");
    sim.ask("a/2", 1);
    sim.give_back("a/1", Settle::Park, 1);
    sim.give_back("a/2", Settle::Park, 1);
    sim.ask("a/3", 1);
    let w2 = sim.spawn_ok().expect("kept");
    assert_ne!(w1, w2);
    // a/3 is detached (w2 is empty again) and a/1 too (w1 has room again).
    sim.give_back("a/3", Settle::Detach, 1);
    sim.ask("a/1", 1);
    sim.give_back("a/1", Settle::Detach, 1);
    sim.confirm_all_detaches();
    // A new conversation joins the serving w1, not the empty w2 (packing)…
    let r = sim.ask("a/4", 1);
    assert_eq!(sim.granted_to(r), Some(w1));
    // …and the empty w2 takes the next one once w1 is full, without a start.
    let r = sim.ask("a/5", 1);
    assert_eq!(sim.granted_to(r), Some(w2));
    assert!(sim.spawns.is_empty());
}

#[test]
fn a_busy_key_brings_one_more_process_into_play_below_its_cpu_share() {
    let mut sim = Sim::new(Limits {
        max_sessions_per_process: 10,
        busy_leases_per_process: 2,
        cpu_processes_per_key: 2,
        ..limits()
    });
    sim.ask("a/1", 1);
    let w1 = sim.spawn_ok().expect("kept");
    let r2 = sim.ask("a/2", 1);
    assert_eq!(sim.granted_to(r2), Some(w1));
    assert!(sim.spawns.is_empty(), "one lease: not busy yet");
    // Two leases run on w1: busy. The third joins w1 now (it has room) and one more
    // process is started for the next.
    let r3 = sim.ask("a/3", 1);
    assert_eq!(sim.granted_to(r3), Some(w1), "no wait for the start");
    assert_eq!(sim.spawns, vec![key(1)]);
    let w2 = sim.spawn_ok().expect("kept");
    let r4 = sim.ask("a/4", 1);
    assert_eq!(sim.granted_to(r4), Some(w2), "the busy key spreads");
    // Two processes hold conversations: the key's CPU share; no third one.
    sim.ask("a/5", 1);
    sim.ask("a/6", 1);
    sim.ask("a/7", 1);
    assert!(sim.spawns.is_empty(), "{:?}", sim.spawns);
}

#[test]
fn a_busy_keys_extra_process_is_not_stopped_as_an_unwanted_spare_while_the_key_has_traffic() {
    let mut sim = Sim::new(Limits {
        max_sessions_per_process: 10,
        busy_leases_per_process: 2,
        cpu_processes_per_key: 2,
        ..spares(1)
    });
    sim.ask("a/1", 1);
    sim.spawn_ok();
    sim.ask("a/2", 1);
    sim.ask("a/3", 1);
    let extra = sim.spawn_ok().expect("the busy key's extra process");
    sim.tick(Duration::from_secs(1));
    assert!(
        sim.evicted.is_empty(),
        "empty, but started for the busy key's next conversation: {:?}",
        sim.evicted
    );
    // Unused, it goes with the idle TTL like any idle process.
    sim.give_back("a/1", Settle::Park, 1);
    sim.give_back("a/2", Settle::Park, 1);
    sim.give_back("a/3", Settle::Park, 1);
    sim.tick(Duration::from_secs(61));
    assert!(
        sim.evicted.contains(&(extra, Eviction::Idle)),
        "{:?}",
        sim.evicted
    );
}

#[test]
fn only_a_conversation_new_to_the_key_that_finds_its_processes_full_outgrows_them() {
    let outgrown = |sim: &Sim| sim.core.keys.get(&key(1)).and_then(|ks| ks.outgrown);
    let mut sim = Sim::new(spares(1));
    sim.ask("a/1", 1);
    sim.spawn_ok();
    sim.give_back("a/1", Settle::Park, 1);
    // Back with other settings, a/1 finds its own process full: no sign of growth.
    sim.ask_with("a/1", 1, "other", false);
    assert_eq!(outgrown(&sim), None);
    let mut sim = Sim::new(spares(1));
    sim.ask("a/1", 1);
    sim.spawn_ok();
    sim.give_back("a/1", Settle::Park, 1);
    sim.ask("a/2", 1);
    assert_eq!(
        outgrown(&sim),
        Some(sim.now),
        "a/2 is one conversation more"
    );
}

#[test]
fn an_outgrowth_older_than_the_window_keeps_no_spare_beside_full_processes() {
    let mut sim = Sim::new(Limits {
        idle_ttl: Duration::from_secs(3600),
        ..spares(1)
    });
    sim.outgrow("a/1", "a/2", 1);
    let spare = sim.spawn_ok().expect("the spare");
    // Past the window the key's traffic goes on, on its two full processes only.
    sim.now += Duration::from_secs(601);
    sim.ask("a/1", 1);
    sim.give_back("a/1", Settle::Park, 1);
    sim.tick(Duration::ZERO);
    assert!(sim.spawns.is_empty(), "{:?}", sim.spawns);
    assert_eq!(
        sim.state_of(spare),
        Some(WorkerState::Live),
        "no longer kept as a spare: an idle process, gone with the idle TTL"
    );
}

#[test]
fn a_key_that_outgrew_its_processes_in_the_window_gets_a_warm_spare_beside_them() {
    let mut sim = Sim::new(spares(1));
    sim.ask("a/1", 1);
    assert_eq!(sim.spawns.len(), 1, "one start for the lease itself");
    let w1 = sim.spawn_ok().expect("kept");
    assert!(sim.spawns.is_empty(), "no spare while the key's lease runs");
    sim.ask("a/2", 1);
    assert_eq!(
        sim.spawns,
        vec![key(1)],
        "a/2 finds w1 full: a start it waits for"
    );
    sim.spawn_ok().expect("kept");
    sim.give_back("a/1", Settle::Park, 1);
    assert!(sim.spawns.is_empty(), "a/2's lease still runs");
    sim.give_back("a/2", Settle::Park, 1);
    assert_eq!(
        sim.spawns,
        vec![key(1)],
        "then a spare beside the full processes"
    );
    let spare = sim.spawn_ok().expect("kept");
    assert_eq!(sim.state_of(spare), Some(WorkerState::Spare));
    assert_eq!(sim.state_of(w1), Some(WorkerState::Live));
    assert!(sim.spawns.is_empty(), "one spare is enough");
    let status = sim.core.status(sim.now);
    assert_eq!(
        status
            .workers
            .iter()
            .filter(|w| w.state == WorkerState::Spare)
            .count(),
        1
    );
    assert_eq!(sim.core.gauges(sim.now).spare, 1);
}

#[test]
fn a_process_started_ahead_of_demand_is_primed_and_one_a_lease_waits_for_is_not() {
    let mut sim = Sim::new(spares(1));
    sim.outgrow("a/1", "a/2", 1);
    sim.spawn_ok().expect("the spare");
    assert_eq!(
        sim.primes,
        vec![false, false, true],
        "the leases' own starts go straight to them; the spare primes first"
    );
    let mut busy = Sim::new(Limits {
        max_sessions_per_process: 10,
        cpu_processes_per_key: 2,
        ..limits()
    });
    busy.ask("a/1", 1);
    busy.spawn_ok();
    busy.ask("a/2", 1);
    busy.ask("a/3", 1);
    assert_eq!(busy.primes, vec![false, true], "the busy key's extra start");
}

#[test]
fn a_key_keeps_no_spare_beside_a_serving_process_until_its_conversations_outgrow_it() {
    let mut sim = Sim::new(Limits {
        max_sessions_per_process: 2,
        ..spares(1)
    });
    sim.ask("a/1", 1);
    let w1 = sim.spawn_ok().expect("kept");
    sim.give_back("a/1", Settle::Park, 1);
    assert!(
        sim.spawns.is_empty(),
        "room for the next conversation in the serving process: no spare beside it"
    );
    let second = sim.ask("a/2", 1);
    assert_eq!(sim.granted_to(second), Some(w1));
    sim.give_back("a/2", Settle::Park, 1);
    assert!(
        sim.spawns.is_empty(),
        "full, but every conversation of the key fits: no spare beside it"
    );
    let third = sim.ask("a/3", 1);
    assert!(sim.queued.contains(&third), "a/3 finds w1 full");
    let w2 = sim.spawn_ok().expect("kept");
    assert_eq!(sim.granted_to(third), Some(w2));
    sim.give_back("a/3", Settle::Park, 1);
    assert!(sim.spawns.is_empty(), "w2 has room: no spare");
    sim.ask("a/4", 1);
    sim.give_back("a/4", Settle::Park, 1);
    assert_eq!(
        sim.spawns,
        vec![key(1)],
        "the key outgrew its processes and they are full again, the key quiet: a spare starts"
    );
    let spare = sim.spawn_ok().expect("the spare");
    assert_eq!(sim.state_of(spare), Some(WorkerState::Spare));
}

#[test]
fn a_key_whose_conversations_fit_gets_its_spare_once_its_serving_process_is_gone() {
    let mut sim = Sim::new(Limits {
        max_sessions_per_process: 2,
        ..spares(1)
    });
    sim.ask("a/1", 1);
    sim.spawn_ok().expect("kept");
    sim.ask("a/2", 1);
    sim.give_back("a/1", Settle::Park, 1);
    sim.give_back("a/2", Settle::Park, 1);
    assert!(sim.spawns.is_empty(), "full, but nothing outgrew it");
    sim.tick(Duration::from_secs(61));
    let (conversations, worker) = sim.stops.pop().expect("the idle eviction");
    assert!(
        sim.spawns.is_empty(),
        "not while that process is still stopping (the two would add up): {:?}",
        sim.spawns
    );
    sim.stop_done(conversations, worker);
    assert_eq!(
        sim.spawns,
        vec![key(1)],
        "its process idled out within the window: a spare stands in for it"
    );
}

#[test]
fn a_key_whose_only_lease_was_no_traffic_gets_no_spare_once_its_process_is_gone() {
    let mut sim = Sim::new(spares(1));
    // A deletion's lease (no traffic of its key) starts a process of its own key...
    sim.submit(Ask {
        any_setup: true,
        traffic: false,
        ..ask_of("a/1", 1)
    });
    sim.spawn_ok().expect("kept");
    sim.give_back("a/1", Settle::Park, 0);
    sim.tick(Duration::from_secs(61));
    let (conversations, worker) = sim.stops.pop().expect("the idle eviction");
    sim.stop_done(conversations, worker);
    // ...which no spare stands in for once it idled out: nothing predicts a turn of the key.
    assert!(sim.spawns.is_empty(), "{:?}", sim.spawns);
}

#[test]
fn a_cold_lease_takes_the_spare_without_a_spawn() {
    let mut sim = Sim::new(Limits {
        max_processes_per_key: 4,
        ..spares(1)
    });
    sim.outgrow("a/1", "a/2", 1);
    let spare = sim.spawn_ok().expect("the spare");
    let r = sim.ask("a/3", 1);
    assert_eq!(
        sim.granted_to(r),
        Some(spare),
        "granted at once on the spare"
    );
    assert!(!sim.queued.contains(&r));
    assert!(sim.spawns.is_empty(), "no start while a/3 runs");
    sim.give_back("a/3", Settle::Park, 1);
    assert_eq!(
        sim.spawns,
        vec![key(1)],
        "the only start is the next spare, once the key is quiet"
    );
}

#[test]
fn a_spare_counts_in_the_caps() {
    // Per key: three processes, the spare among them.
    let mut sim = Sim::new(spares(1));
    sim.outgrow("a/1", "a/2", 1);
    let spare = sim.spawn_ok().expect("the spare");
    let r = sim.ask("a/3", 1);
    assert_eq!(sim.granted_to(r), Some(spare));
    sim.give_back("a/3", Settle::Park, 1);
    assert!(sim.spawns.is_empty(), "the key is at its cap: no new spare");

    // Pool-wide: the spare fills the last slot, so no spare when the pool is full.
    let mut sim = Sim::new(Limits {
        max_processes: 3,
        ..spares(2)
    });
    sim.outgrow("a/1", "a/2", 1);
    sim.spawn_ok().expect("the first spare");
    assert!(sim.spawns.is_empty(), "no room for the second spare");
    assert_eq!(sim.core.workers.len(), 3);
}

#[test]
fn a_spare_is_the_first_stopped_when_the_pool_needs_room() {
    let mut sim = Sim::new(Limits {
        max_processes: 4,
        ..spares(1)
    });
    let (w_b, w_b2) = sim.outgrow("b/1", "b/2", 2);
    sim.now += Duration::from_secs(5);
    let spare = sim.spawn_ok().expect("b's spare");
    assert_eq!(sim.state_of(spare), Some(WorkerState::Spare));
    sim.now += Duration::from_secs(5);
    sim.ask("a/1", 1);
    let w_a = sim.spawn_ok().expect("kept");
    assert!(sim.spawns.is_empty(), "the pool is full: no spare for a");
    sim.give_back("a/1", Settle::Park, 1);
    sim.now += Duration::from_secs(5);
    // b's worker is the least recently used, but the spare goes first.
    sim.ask("c/1", 3);
    assert_eq!(sim.evicted, vec![(spare, Eviction::Full)]);
    assert!(
        [w_a, w_b, w_b2]
            .iter()
            .all(|w| sim.core.workers.contains_key(w))
    );
    sim.confirm_all_detaches();
    assert_eq!(
        sim.spawns,
        vec![key(3)],
        "no spare is started by stopping a worker"
    );
}

#[test]
fn a_spare_outlives_the_idle_ttl_within_the_window_and_is_stopped_after_it() {
    let mut sim = Sim::new(spares(1));
    let (w1, w2) = sim.outgrow("a/1", "a/2", 1);
    let spare = sim.spawn_ok().expect("the spare");
    sim.tick(Duration::from_secs(120));
    assert_eq!(
        sim.evicted,
        vec![(w1, Eviction::Idle), (w2, Eviction::Idle)],
        "the idle TTL (60 s) stops the workers, not the spare"
    );
    assert!(sim.spawns.is_empty(), "the spare is there already");
    sim.tick(Duration::from_secs(480));
    assert_eq!(
        sim.evicted.last(),
        Some(&(spare, Eviction::Idle)),
        "no lease for the window (600 s): the spare is stopped"
    );
    assert!(sim.core.workers.is_empty());
    assert!(sim.spawns.is_empty(), "and not replaced");
}

#[test]
fn a_returning_conversation_finds_itself_resumed_on_the_warm_spare_which_stays_a_spare_until_then()
{
    let mut sim = Sim::new(Limits {
        max_sessions_per_process: 4,
        ..spares(1)
    });
    sim.ask("a/1", 1);
    let w1 = sim.spawn_ok().expect("kept");
    sim.give_back("a/1", Settle::Park, 1);
    assert!(
        sim.spawns.is_empty(),
        "a/1's process has room: no spare yet"
    );
    assert_eq!(
        sim.warm_up("a/2", 1, "c", ""),
        None,
        "no spare, nothing to resume onto"
    );

    // The agent goes away: its process idles out and a spare takes its place.
    sim.tick(Duration::from_secs(61));
    assert_eq!(sim.evicted, vec![(w1, Eviction::Idle)]);
    assert_eq!(
        sim.warm_up("a/1", 1, "c", ""),
        None,
        "still held by the stopping process"
    );
    let (conversations, worker) = sim.stops.pop().expect("the eviction");
    sim.stop_done(conversations, worker);
    let spare = sim.spawn_ok().expect("the spare");
    assert_eq!(sim.warm_up("a/1", 2, "c", ""), None, "another key's spare");

    // Resumed onto the spare: still a spare, not another start, kept past the idle TTL.
    assert_eq!(sim.warm_up("a/1", 1, "c", ""), Some(spare));
    assert_eq!(sim.warm_up("a/1", 1, "c", ""), None, "once");
    assert_eq!(sim.state_of(spare), Some(WorkerState::Spare));
    let effects = sim
        .core
        .opened("a/1", spare, CliSessionId::random(), OpenReason::Resumed);
    sim.apply(effects);
    sim.give_back("a/1", Settle::Park, 0);
    assert_eq!(sim.state_of(spare), Some(WorkerState::Spare));
    assert!(sim.spawns.is_empty(), "the warm spare is the key's spare");
    sim.tick(Duration::from_secs(120));
    assert_eq!(sim.evicted.len(), 1, "the warm spare outlives the idle TTL");

    // The return takes it as attached: no resume, and the spare now serves.
    let r = sim.ask("a/1", 1);
    assert_eq!(sim.granted_to(r), Some(spare));
    assert!(
        sim.leases["a/1"]
            .carried
            .is_some_and(|(_, from, same)| same && from == spare),
        "granted with its parked session on the same worker"
    );
    assert_eq!(sim.state_of(spare), Some(WorkerState::Live));
}

#[test]
fn a_conversation_parked_or_leased_is_not_resumed_ahead_and_a_spare_keeps_a_slot_for_a_cold_one() {
    let mut sim = Sim::new(Limits {
        max_sessions_per_process: 2,
        max_processes_per_key: 3,
        ..spares(1)
    });
    sim.ask("a/1", 1);
    sim.spawn_ok().expect("kept");
    sim.ask("a/2", 1);
    assert_eq!(sim.warm_up("a/1", 1, "c", ""), None, "leased");
    sim.give_back("a/1", Settle::Park, 1);
    sim.give_back("a/2", Settle::Park, 1);
    // a/5 and a/6 outgrow the first process and fill a second.
    sim.ask("a/5", 1);
    sim.spawn_ok().expect("kept");
    sim.ask("a/6", 1);
    sim.give_back("a/5", Settle::Park, 1);
    sim.give_back("a/6", Settle::Park, 1);
    let spare = sim.spawn_ok().expect("the full processes' spare");
    assert_eq!(
        sim.warm_up("a/1", 1, "c", ""),
        None,
        "parked on its process"
    );
    assert_eq!(sim.warm_up("a/3", 1, "c", ""), Some(spare));
    assert_eq!(
        sim.warm_up("a/4", 1, "c", ""),
        None,
        "the spare's last slot stays for a cold conversation"
    );
}

/// A key whose process idled out, with `a/1` resumed ahead on its spare (the resume still
/// in flight, answered by the caller); returns the spare.
fn resuming_ahead_on_the_spare(sim: &mut Sim) -> WorkerId {
    sim.ask("a/1", 1);
    sim.spawn_ok().expect("kept");
    sim.give_back("a/1", Settle::Park, 1);
    sim.tick(Duration::from_secs(61));
    let (conversations, worker) = sim.stops.pop().expect("the idle eviction");
    sim.stop_done(conversations, worker);
    let spare = sim.spawn_ok().expect("the spare");
    assert_eq!(sim.warm_up("a/1", 1, "c", ""), Some(spare));
    spare
}

#[test]
fn a_lease_that_may_not_wait_waits_for_a_resume_ahead_instead_of_being_refused() {
    let mut sim = Sim::new(Limits {
        max_sessions_per_process: 4,
        ..spares(1)
    });
    let spare = resuming_ahead_on_the_spare(&mut sim);
    // Nobody's lease: `fail_if_busy` queues behind it.
    let r = sim.ask_with("a/1", 1, "c", true);
    assert!(sim.queued.contains(&r), "{:?}", sim.failed);
    sim.give_back("a/1", Settle::Park, 0);
    assert_eq!(sim.granted_to(r), Some(spare), "granted once it is parked");
}

#[test]
fn a_warm_spare_under_a_call_naming_no_conversation_is_not_stopped_when_its_window_lapses() {
    let mut sim = Sim::new(Limits {
        max_sessions_per_process: 4,
        ..spares(1)
    });
    let spare = resuming_ahead_on_the_spare(&mut sim);
    sim.give_back("a/1", Settle::Park, 0);
    let p = sim.ask_process(1);
    assert_eq!(sim.process_of(p), Some(spare));
    assert_eq!(sim.state_of(spare), Some(WorkerState::Spare), "still warm");
    sim.tick(Duration::from_secs(700));
    assert!(sim.core.workers.contains_key(&spare), "{:?}", sim.evicted);
    sim.release_process(p);
    sim.tick(Duration::ZERO);
    assert!(
        !sim.core.workers.contains_key(&spare),
        "stopped once released"
    );
}

#[test]
fn a_warm_spare_that_dies_is_no_demand_to_respawn_and_its_returning_conversation_starts_a_process()
{
    let mut sim = Sim::new(Limits {
        max_sessions_per_process: 4,
        ..spares(1)
    });
    let spare = resuming_ahead_on_the_spare(&mut sim);
    let effects = sim
        .core
        .opened("a/1", spare, CliSessionId::random(), OpenReason::Resumed);
    sim.apply(effects);
    sim.give_back("a/1", Settle::Park, 0);
    // Killed from outside while it only held a conversation resumed ahead of its return.
    sim.killed_after(Duration::ZERO, spare);
    assert!(
        sim.respawns.is_empty(),
        "a warm spare's conversations are nobody's work: no respawn"
    );
    assert!(sim.spawns.is_empty(), "{:?}", sim.spawns);
    // The returning conversation still gets a process: a start at its lease.
    let r = sim.ask("a/1", 1);
    assert!(sim.queued.contains(&r));
    let w = sim.spawn_ok().expect("kept");
    assert_eq!(sim.granted_to(r), Some(w));
}

#[test]
fn resumes_ahead_run_a_few_at_a_time_over_the_whole_pool() {
    let mut sim = Sim::new(Limits {
        max_processes: 8,
        max_sessions_per_process: 4,
        ..spares(1)
    });
    // Three keys go away together: each process idles out and a spare takes its place.
    for k in 1..=3u8 {
        sim.ask(&format!("a{k}/1"), k);
        sim.spawn_ok().expect("kept");
        sim.give_back(&format!("a{k}/1"), Settle::Park, 1);
    }
    sim.tick(Duration::from_secs(61));
    while let Some((conversations, worker)) = sim.stops.pop() {
        sim.stop_done(conversations, worker);
    }
    let mut spares = Vec::new();
    while !sim.spawns.is_empty() {
        spares.push(sim.spawn_ok().expect("a spare"));
    }
    assert_eq!(spares.len(), 3, "a spare per key");
    let ahead: Vec<Option<WorkerId>> = (1..=3u8)
        .map(|k| sim.warm_up(&format!("a{k}/1"), k, "c", ""))
        .collect();
    let started = ahead.iter().flatten().count();
    assert_eq!(started, RESUMES_AHEAD_AT_ONCE, "{ahead:?}");
    assert!(sim.core.resuming_ahead("a1/1"));
    // The first one parked: the third goes next.
    let first = ahead[0].expect("the first key's resume ran");
    let effects = sim
        .core
        .opened("a1/1", first, CliSessionId::random(), OpenReason::Resumed);
    sim.apply(effects);
    sim.give_back("a1/1", Settle::Park, 0);
    assert!(!sim.core.resuming_ahead("a1/1"), "parked");
    assert!(sim.warm_up("a3/1", 3, "c", "").is_some());
}

#[test]
fn a_key_never_leased_gets_no_spare() {
    let mut sim = Sim::new(spares(2));
    // A call naming no conversation starts a process, but is no conversation traffic.
    let r = sim.ask_process(1);
    sim.spawn_ok();
    assert!(sim.process_of(r).is_some());
    assert!(sim.spawns.is_empty(), "no spare for a key never leased");
    // And with spares off, a leased key gets none either.
    let mut off = Sim::new(spares(0));
    off.ask("a/1", 1);
    off.spawn_ok();
    assert!(off.spawns.is_empty());
}

#[test]
fn a_key_whose_processes_crashed_in_the_window_gets_no_spare() {
    let mut sim = Sim::new(spares(1));
    let (w1, _) = sim.outgrow("a/1", "a/2", 1);
    let spare = sim.spawn_ok().expect("the spare");
    // The spare dies before serving (a crash loop's shape): not started again at once.
    sim.killed_after(Duration::ZERO, spare);
    assert!(sim.spawns.is_empty(), "{:?}", sim.spawns);
    assert!(sim.core.workers.contains_key(&w1));
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    /// No sequence of events grants one conversation twice, or grants it while one of its
    /// sessions is still being detached (checked at every grant by `Sim::apply`); the caps
    /// hold throughout; and once the faults stop, every waiter is served and every detach
    /// count returns to zero.
    #[test]
    fn no_sequence_of_events_grants_one_conversation_twice(
        steps in prop::collection::vec(step(), 1..120),
        small in any::<bool>(),
        close_after in prop::option::weighted(0.1, 0usize..120),
        warm_spares in prop::option::weighted(0.5, 1usize..3),
        window_secs in 1u64..900,
        cpu_processes_per_key in 1usize..3,
        busy_leases_per_process in 1usize..3,
        lease_cap in prop::option::weighted(0.3, 1usize..3),
    ) {
        let limits = if small {
            Limits { max_processes: 2, max_processes_per_key: 1, max_sessions_per_process: 2, max_sessions: 3, max_turns_per_process: 4, max_waiters: 6, max_waiters_per_agent: 2, ..limits() }
        } else {
            limits()
        };
        let limits = Limits {
            warm_spares: warm_spares.unwrap_or(0),
            warm_spare_window: Duration::from_secs(window_secs),
            cpu_processes_per_key,
            busy_leases_per_process,
            max_leases_per_agent: lease_cap.unwrap_or(usize::MAX),
            ..limits
        };
        let mut sim = Sim::new(limits);
        for (i, step) in steps.into_iter().enumerate() {
            if close_after == Some(i) {
                let effects = sim.core.close();
                sim.apply(effects);
            }
            sim.play(step);
        }
        sim.come_to_rest();
    }
}

#[test]
fn a_full_pool_asks_the_cli_side_once_for_its_older_parked_process_and_starts_when_it_is_gone() {
    let mut sim = Sim::new(Limits {
        max_processes: 1,
        ..limits()
    });
    sim.core.set_others(Others {
        held: 1,
        idle_since: Some(sim.now - Duration::from_secs(5)),
        making_room: false,
    });
    let first = sim.ask("a/1", 1);
    let second = sim.ask("b/1", 2);
    assert_eq!(sim.evict_other, 1, "asked once until the CLI side answers");
    assert!(sim.spawns.is_empty(), "no start past the shared cap");
    assert!(sim.queued.contains(&first) && sim.queued.contains(&second));
    // The CLI side closed it: the first waiter's key starts its worker, FIFO.
    sim.core.set_others(Others::default());
    let effects = sim.core.others_changed(sim.now);
    sim.apply(effects);
    assert_eq!(sim.spawns, [key(1)]);
    let w = sim.spawn_ok().expect("kept");
    assert_eq!(sim.granted_to(first), Some(w));
    assert!(sim.queued.contains(&second));
}

#[test]
fn room_the_cli_side_gave_up_goes_to_the_waiters_before_a_lease_asked_for_after() {
    let mut sim = Sim::new(Limits {
        max_processes: 1,
        ..limits()
    });
    sim.core.set_others(Others {
        held: 1,
        idle_since: None,
        making_room: false,
    });
    let first = sim.ask("a/1", 1);
    assert!(sim.queued.contains(&first) && sim.spawns.is_empty());
    // The CLI side closed its process; the next message is a new lease of another key,
    // which the actor handles only after its first look at the CLI side.
    let effects = sim.core.look_at_others(Others::default(), sim.now);
    sim.apply(effects);
    let later = sim.ask("b/1", 2);
    assert_eq!(
        sim.spawns,
        [key(1)],
        "the waiter's start, not the newcomer's"
    );
    let w = sim.spawn_ok().expect("kept");
    assert_eq!(sim.granted_to(first), Some(w));
    assert!(sim.queued.contains(&later));
}

#[test]
fn a_full_pool_stops_its_own_idle_worker_when_the_cli_sides_parked_process_is_younger() {
    let mut sim = Sim::new(Limits {
        max_processes: 2,
        ..limits()
    });
    sim.ask("a/1", 1);
    sim.spawn_ok();
    sim.give_back("a/1", Settle::Park, 1);
    sim.core.set_others(Others {
        held: 1,
        idle_since: Some(sim.now + Duration::from_secs(1)),
        making_room: false,
    });
    sim.now += Duration::from_secs(2);
    sim.ask("b/1", 2);
    assert_eq!(sim.evict_other, 0);
    assert_eq!(sim.evicted.len(), 1, "its own idle worker went");
    sim.confirm_all_detaches();
    assert_eq!(sim.spawns, [key(2)]);
}

#[test]
fn busy_cli_processes_count_in_the_cap_and_the_cli_side_can_take_an_idle_worker() {
    let mut sim = Sim::new(Limits {
        max_processes: 2,
        ..limits()
    });
    sim.ask("a/1", 1);
    let w = sim.spawn_ok().expect("kept");
    // One CLI process, leased (nothing idle): the pool is full, nothing to stop.
    sim.core.set_others(Others {
        held: 1,
        idle_since: None,
        making_room: false,
    });
    let waiting = sim.ask("b/1", 2);
    assert!(sim.queued.contains(&waiting) && sim.spawns.is_empty());
    assert_eq!(sim.evict_other, 0);
    assert_eq!(
        sim.core.view(),
        Others {
            held: 1,
            idle_since: None,
            making_room: false,
        },
        "a leased worker is no victim"
    );
    assert!(sim.core.evict_for_other().is_empty());
    // The waiter gives up and the lease returns: the idle worker is the CLI side's to take.
    sim.core.withdraw(waiting);
    sim.give_back("a/1", Settle::Park, 1);
    assert_eq!(sim.core.view().idle_since, Some(sim.now));
    let effects = sim.core.evict_for_other();
    sim.apply(effects);
    assert_eq!(sim.evicted, [(w, Eviction::Full)]);
    assert_eq!(sim.core.view().held, 1, "until its process is gone");
    sim.confirm_all_detaches();
    assert_eq!(sim.core.view().held, 0);
}

#[test]
fn a_full_memory_of_former_keys_forgets_the_ones_used_longest_ago_not_all() {
    let mut core: Placement<(), Token> = Placement::new(limits());
    let start = Instant::now();
    // The agent whose conversation is remembered first, and most recently used.
    core.left_key("quiet/kept", &key(1), start + Duration::from_secs(3600));
    for n in 0..FORMER_KEYS_REMEMBERED {
        let used = start + Duration::from_millis(u64::try_from(n).expect("fits"));
        core.left_key(&format!("busy/{n}"), &key(2), used);
    }
    assert!(core.former_keys.len() <= FORMER_KEYS_REMEMBERED);
    assert!(
        core.former_keys.len() > FORMER_KEYS_REMEMBERED / 2,
        "most are kept: {}",
        core.former_keys.len()
    );
    assert!(core.former_keys.contains_key("quiet/kept"));
    assert!(!core.former_keys.contains_key("busy/0"), "the oldest went");
    assert!(
        core.former_keys
            .contains_key(&format!("busy/{}", FORMER_KEYS_REMEMBERED - 1))
    );
}

#[test]
fn an_ask_refused_for_a_full_queue_evicts_no_other_tenants_process_and_starts_none() {
    let mut sim = Sim::new(Limits {
        max_processes: 2,
        max_processes_per_key: 1,
        max_sessions_per_process: 1,
        max_waiters_per_agent: 1,
        warm_spares: 1,
        ..limits()
    });
    // Agent 2's process, idle: the oldest idle worker, the one a new process would evict.
    sim.ask("b/0", 2);
    let idle = sim.spawn_ok().expect("b's worker");
    sim.give_back("b/0", Settle::Park, 1);
    // Agent 1 holds its process and has one lease waiting: its queue is full.
    sim.ask("a/0", 1);
    sim.spawn_ok().expect("a's worker");
    let waiting = sim.ask("a/1", 1);
    assert_eq!(sim.queued, [waiting]);
    assert!(sim.spawns.is_empty() && sim.evicted.is_empty());
    // Another credential of agent 1: a new key, which would need a process of its own.
    let other_key = PoolKey {
        profile_id: Some("another-profile".into()),
        ..key(1)
    };
    let refused = sim.submit(Ask {
        key: other_key.clone(),
        ..ask_of("a/2", 1)
    });
    assert!(
        matches!(
            sim.failed.last(),
            Some((r, PoolError::AgentWaitersFull { max: 1 })) if *r == refused
        ),
        "{:?}",
        sim.failed
    );
    assert!(sim.evicted.is_empty(), "{:?}", sim.evicted);
    assert!(sim.spawns.is_empty(), "{:?}", sim.spawns);
    assert!(sim.workers.contains(&idle));
    // Nor is the refused key's traffic kept warm: the next tick starts no spare for it.
    sim.tick(Duration::from_secs(1));
    assert!(!sim.spawns.contains(&other_key), "{:?}", sim.spawns);
}

#[test]
fn a_dead_worker_full_of_parked_conversations_is_not_made_room_on() {
    let mut sim = Sim::new(Limits {
        max_processes_per_key: 1,
        max_sessions_per_process: 1,
        ..limits()
    });
    sim.ask("a/0", 1);
    let worker = sim.spawn_ok().expect("a worker");
    sim.give_back("a/0", Settle::Park, 1);
    // Its child exited; the supervision event has not come yet.
    sim.core.exited(worker);
    sim.ask("a/1", 1);
    assert!(
        !sim.granted
            .iter()
            .any(|(_, c, w)| c == "a/1" && *w == worker),
        "{:?}",
        sim.granted
    );
    assert!(sim.detaches.is_empty(), "{:?}", sim.detaches);
}

#[test]
fn a_backoff_as_long_as_a_duration_holds_does_not_panic_the_pool() {
    let mut sim = Sim::new(Limits {
        restart: RestartPolicy {
            first_retry: Duration::MAX,
            backoff_base: Duration::MAX,
            backoff_max: Duration::MAX,
            ..RestartPolicy::default()
        },
        ..limits()
    });
    sim.ask("a/1", 1);
    let w = sim.spawn_ok().expect("a worker");
    // It dies at once with its conversation leased: a crash, restarted after the backoff.
    sim.core.exited(w);
    let effects = sim.core.crashed(w, Death::Killed, sim.now);
    sim.apply(effects);
    assert_eq!(sim.respawns, [key(1)]);
}

#[test]
fn a_start_that_failed_is_not_retried_once_nobody_waits_for_it() {
    let mut sim = Sim::new(limits());
    let asked = sim.ask("a/1", 1);
    let key = sim.spawns.remove(0);
    let (id, effects) = sim.core.spawned(
        key.clone(),
        Err(WorkerError::Spawn("hung at its handshake".into())),
        sim.now,
    );
    assert_eq!(id, None);
    sim.apply(effects);
    assert_eq!(
        sim.respawns,
        std::slice::from_ref(&key),
        "a retry is scheduled for the waiter"
    );
    // The waiter gives up before the retry is due.
    let effects = sim.core.expire(asked);
    sim.apply(effects);
    sim.now += Duration::from_secs(70);
    let effects = sim.core.respawn_due(&key, sim.now);
    sim.apply(effects);
    assert!(
        sim.spawns.is_empty(),
        "started for nobody: {:?}",
        sim.spawns
    );

    // With the waiter still there, the retry starts.
    let mut sim = Sim::new(limits());
    sim.ask("a/1", 1);
    let key = sim.spawns.remove(0);
    let (_, effects) = sim.core.spawned(
        key.clone(),
        Err(WorkerError::Spawn("flaky".into())),
        sim.now,
    );
    sim.apply(effects);
    sim.now += Duration::from_secs(1);
    let effects = sim.core.respawn_due(&key, sim.now);
    sim.apply(effects);
    assert_eq!(sim.spawns, [key]);
}

#[test]
fn a_worker_stopped_for_the_cli_side_leaves_its_room_to_the_cli_lease_not_to_a_spare() {
    let mut sim = Sim::new(Limits {
        max_processes: 1,
        ..spares(1)
    });
    sim.ask("a/1", 1);
    let w = sim.spawn_ok().expect("kept");
    sim.give_back("a/1", Settle::Park, 1);
    // A CLI lease needs the one place: the idle worker is stopped for it.
    let effects = sim.core.evict_for_other();
    sim.apply(effects);
    assert_eq!(sim.evicted, [(w, Eviction::Full)]);
    assert_eq!(sim.core.view().held, 1, "until its process is gone");
    sim.confirm_all_detaches();
    assert_eq!(sim.core.view().held, 0, "the CLI side may take it");
    assert!(
        sim.spawns.is_empty(),
        "a's key had traffic, yet no spare takes the CLI lease's room: {:?}",
        sim.spawns
    );
}

#[test]
fn a_spare_of_the_old_version_still_starting_at_the_rotation_is_stopped_as_it_lands() {
    let mut sim = Sim::new(Limits {
        max_sessions_per_process: 4,
        ..spares(1)
    });
    sim.ask_key("a/1", key_version(1, "v1"));
    let old = sim.spawn_ok().expect("a/1's process");
    sim.give_back("a/1", Settle::Park, 1);
    sim.tick(Duration::from_secs(61));
    assert_eq!(sim.evicted, vec![(old, Eviction::Idle)]);
    let (conversations, worker) = sim.stops.pop().expect("the eviction");
    sim.stop_done(conversations, worker);
    assert_eq!(sim.spawns, [key_version(1, "v1")], "the spare is starting");

    // a/1 comes back with a new token while the old version's spare is still priming.
    let rotated = sim.ask_key("a/1", key_version(1, "v2"));
    let spare = sim.spawn_ok().expect("the old version's spare landed");
    assert_eq!(
        sim.evicted.last(),
        Some(&(spare, Eviction::Drained)),
        "the stale token's process goes at once"
    );
    sim.confirm_all_detaches();
    sim.new_version_serves_and_no_stale_spare(rotated);
}

#[test]
fn a_full_pool_makes_room_one_stop_at_a_time_however_often_its_waiter_is_served_again() {
    let (mut sim, idle) = full_of_idle_workers(3);
    sim.ask("d/1", 4);
    assert_eq!(sim.evicted, [(idle[0], Eviction::Full)]);
    // The stop takes its grace; meanwhile ticks serve the waiter again and again.
    for _ in 0..3 {
        sim.tick(Duration::from_secs(1));
    }
    assert_eq!(
        sim.evicted,
        [(idle[0], Eviction::Full)],
        "one stop makes the room: no other tenant's process goes for the same start"
    );
    assert!(sim.spawns.is_empty());
    sim.confirm_all_detaches();
    assert_eq!(sim.spawns, [key(4)]);
}

#[test]
fn new_conversations_of_one_key_on_a_full_pool_stop_one_other_tenants_process_not_one_each() {
    let (mut sim, idle) = full_of_idle_workers(3);
    let asks: Vec<RequestId> = (1..=3).map(|n| sim.ask(&format!("d/{n}"), 4)).collect();
    assert_eq!(
        sim.evicted,
        [(idle[0], Eviction::Full)],
        "the key starts one process: the other asks wait for its room"
    );
    sim.confirm_all_detaches();
    assert_eq!(sim.spawns, [key(4)]);
    let first = sim.spawn_ok().expect("the key's process");
    let on_first = asks
        .iter()
        .filter(|a| sim.granted_to(**a) == Some(first))
        .count();
    assert_eq!(on_first, 2, "as many as a process holds");
    // The third needs a second process of the key: its own room, one more stop.
    assert_eq!(sim.evicted.len(), 2);
}

#[test]
fn two_waiters_on_a_full_pool_make_room_at_once_each_with_its_own_stop() {
    let (mut sim, idle) = full_of_idle_workers(2);
    sim.ask("d/1", 3);
    sim.ask("e/1", 4);
    assert_eq!(
        sim.evicted,
        [(idle[0], Eviction::Full), (idle[1], Eviction::Full)],
        "the second waiter does not wait for the first one's stop"
    );
    sim.tick(Duration::from_secs(1));
    assert_eq!(sim.evicted.len(), 2, "and neither stops a third");
    sim.confirm_all_detaches();
    let mut started = sim.spawns.clone();
    started.sort_by_key(PoolKey::short_hash);
    let mut wanted = vec![key(3), key(4)];
    wanted.sort_by_key(PoolKey::short_hash);
    assert_eq!(started, wanted);
}

#[test]
fn room_stopped_for_the_cli_side_that_it_leaves_goes_to_a_waiter_here_once_it_has_seen_it() {
    let mut sim = Sim::new(Limits {
        max_processes: 1,
        ..limits()
    });
    sim.ask("a/1", 1);
    let w = sim.spawn_ok().expect("kept");
    sim.give_back("a/1", Settle::Park, 1);
    let effects = sim.core.evict_for_other();
    sim.apply(effects);
    assert!(sim.core.view().making_room);
    // A lease here waits meanwhile: the pool is full and the stop is the CLI side's.
    let waiting = sim.ask("b/1", 2);
    assert!(sim.queued.contains(&waiting));
    assert_eq!(sim.evicted, [(w, Eviction::Full)]);
    sim.confirm_all_detaches();
    assert!(sim.spawns.is_empty(), "the CLI side is told first");
    // The CLI lease went away meanwhile: nothing took the room, and the waiter here gets it.
    let effects = sim.core.serve_owed(sim.now);
    sim.apply(effects);
    assert_eq!(sim.spawns, [key(2)]);
    assert!(sim.core.serve_owed(sim.now).is_empty(), "owed once");
}

#[test]
fn a_quarantined_keys_other_worker_dying_is_no_second_quarantine() {
    let mut sim = Sim::new(Limits {
        max_sessions_per_process: 1,
        restart: RestartPolicy {
            max_restarts: 0,
            ..RestartPolicy::default()
        },
        ..limits()
    });
    sim.ask("a/1", 1);
    let first = sim.spawn_ok().expect("a/1's process");
    sim.ask("a/2", 1);
    let second = sim.spawn_ok().expect("a/2's process");
    sim.died_after(Duration::ZERO, first, Death::Failed);
    assert_eq!(sim.quarantines, 1);
    assert!(!sim.core.status(sim.now).quarantined_keys.is_empty());
    sim.died_after(Duration::ZERO, second, Death::Failed);
    assert_eq!(sim.quarantines, 1, "reported once");
}

/// A pool of `n` processes, full of idle workers of keys 1..=n (the oldest first), each
/// with one conversation parked.
fn full_of_idle_workers(n: u8) -> (Sim, Vec<WorkerId>) {
    let mut sim = Sim::new(Limits {
        max_processes: usize::from(n),
        ..limits()
    });
    let mut idle = Vec::new();
    for k in 1..=n {
        sim.ask(&format!("c/{k}"), k);
        idle.push(sim.spawn_ok().expect("kept"));
        sim.give_back(&format!("c/{k}"), Settle::Park, 1);
        sim.now += Duration::from_secs(1);
    }
    (sim, idle)
}
