//! The placement rules, each a pure function of views: which worker takes a conversation,
//! when a key brings one more process into play (packing), which worker is a warm spare (empty,
//! or holding only conversations resumed ahead of their return) and how many a key keeps, which idle worker makes room when the pool is full, which parked
//! conversation is detached when a cap is reached, and what the maintenance tick does to each
//! worker (idle TTL, drain, recycling by memory and by turn count).

use std::time::{Duration, Instant};

use crate::kinds::Eviction;

/// A worker's id inside the pool (never reused).
pub(crate) type WorkerId = u64;

/// A worker as placement sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct WorkerView {
    pub(crate) id: WorkerId,
    /// Conversations attached to it.
    pub(crate) attached: usize,
    /// Leases it serves right now.
    pub(crate) leased: usize,
    /// On its way out (rotation, recycling): takes nothing new.
    pub(crate) draining: bool,
    /// Its child is still serving.
    pub(crate) alive: bool,
    /// When a lease last came or went.
    pub(crate) last_used: Instant,
    /// A spare holding conversations the pool resumed ahead of their return (no lease has
    /// landed on it since): still a spare.
    pub(crate) warm: bool,
}

/// The worker of a key that takes one more conversation: live, not draining, with room under
/// `max_sessions_per_process`, and the fewest conversations (the oldest worker on a tie).
pub(crate) fn least_loaded(
    workers: impl IntoIterator<Item = WorkerView>,
    max_sessions_per_process: usize,
) -> Option<WorkerId> {
    workers
        .into_iter()
        .filter(|w| !w.draining && w.alive && w.attached < max_sessions_per_process)
        .min_by_key(|w| (w.attached, w.id))
        .map(|w| w.id)
}

/// The worker of a key that answers a call naming no conversation (a process lease): live,
/// not draining, with the fewest leases, then the fewest conversations (the oldest on a
/// tie). It takes no conversation slot, so a worker full of conversations still answers.
pub(crate) fn least_busy(workers: impl IntoIterator<Item = WorkerView>) -> Option<WorkerId> {
    workers
        .into_iter()
        .filter(|w| !w.draining && w.alive)
        .min_by_key(|w| (w.leased, w.attached, w.id))
        .map(|w| w.id)
}

/// The worker to stop so another key can start one when the pool is full: a spare (empty,
/// or holding only conversations resumed ahead of their return) before any that serves
/// conversations, then the least recently used; never one with a lease, nor a dead one
/// (its end, a crash, is on its way: evicting it would count it as stopped) (`others` are
/// the workers of the other keys).
pub(crate) fn idle_victim(others: impl IntoIterator<Item = WorkerView>) -> Option<WorkerId> {
    others
        .into_iter()
        .filter(|w| w.leased == 0 && w.alive)
        .min_by_key(|w| (w.attached > 0 && !w.warm, w.last_used, w.id))
        .map(|w| w.id)
}

/// Whether a worker is a spare: live, not draining, and either empty (no conversation, no
/// lease) or warm (holding only conversations the pool resumed ahead of their return, some
/// perhaps still being resumed). A key's spare takes a cold lease without waiting for a
/// start.
pub(crate) fn is_spare(w: &WorkerView) -> bool {
    w.alive && !w.draining && (w.warm || (w.attached == 0 && w.leased == 0))
}

/// Whether a worker serves its key's conversations: live, not draining, holding at least one
/// conversation a lease put there (not a warm spare's resumed-ahead ones).
pub(crate) fn serves(w: &WorkerView) -> bool {
    w.alive && !w.draining && !w.warm && w.attached > 0
}

/// The spare a cold lease takes: the key's oldest spare.
pub(crate) fn spare(workers: impl IntoIterator<Item = WorkerView>) -> Option<WorkerId> {
    workers
        .into_iter()
        .filter(is_spare)
        .min_by_key(|w| w.id)
        .map(|w| w.id)
}

/// How a key spreads its conversations over processes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Packing {
    /// Leases running at once from which a process counts as busy (CPU-bound).
    pub(crate) busy_leases_per_process: usize,
    /// Processes of one key worth running for CPU (beyond them, only a full process makes
    /// the key start another).
    pub(crate) cpu_processes_per_key: usize,
}

/// Processes of one key worth running for CPU on a machine with `cores` cores: one runtime
/// process keeps up to ~1.5 cores busy when it is saturated (packing study §5: 146–174 %),
/// so `cores × 2 / 3`, at least one. On 2 cores: one (a second process costs a cold start
/// and ~105 MiB, and buys at most the last half core).
pub(crate) fn cpu_processes_for(cores: usize) -> usize {
    (cores.saturating_mul(2) / 3).max(1)
}

/// Whether a key whose processes still have room brings one more process into play for a new
/// conversation (its spare, or a start): only when every usable process of the key that
/// holds conversations is busy (`busy_leases_per_process` leases running) and fewer than
/// `cpu_processes_per_key` of them hold conversations. Otherwise the conversation joins a
/// process that already runs: one process per key until it is full or CPU-bound (an empty
/// spare waits for a lease that finds no room).
pub(crate) fn spread(workers: impl IntoIterator<Item = WorkerView>, packing: &Packing) -> bool {
    let mut occupied = 0;
    for w in workers
        .into_iter()
        .filter(|w| w.alive && !w.draining && w.attached > 0)
    {
        if w.leased < packing.busy_leases_per_process {
            return false;
        }
        occupied += 1;
    }
    occupied > 0 && occupied < packing.cpu_processes_per_key
}

/// How many spares a key keeps now: `warm_spares` while its last conversation lease is
/// within `window`, none for a key never leased or quiet for longer.
pub(crate) fn spares_wanted(
    last_lease: Option<Instant>,
    now: Instant,
    warm_spares: usize,
    window: Duration,
) -> usize {
    if within(last_lease, now, window) {
        warm_spares
    } else {
        0
    }
}

/// Whether `at` happened less than `window` before `now` (never, for `None`).
pub(crate) fn within(at: Option<Instant>, now: Instant, window: Duration) -> bool {
    at.is_some_and(|t| now.saturating_duration_since(t) < window)
}

/// A conversation as placement sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ConversationView<'a> {
    pub(crate) key: &'a str,
    pub(crate) leased: bool,
    pub(crate) last_used: Instant,
    /// Resumed ahead of its return and not leased since.
    pub(crate) ahead: bool,
}

/// The parked (not leased) conversation to detach to make room: one resumed ahead of its
/// return and never leased since first (a guess, not a use), then the least recently used.
pub(crate) fn lru_parked<'a>(
    conversations: impl IntoIterator<Item = ConversationView<'a>>,
) -> Option<&'a str> {
    conversations
        .into_iter()
        .filter(|c| !c.leased)
        .min_by_key(|c| (!c.ahead, c.last_used, c.key))
        .map(|c| c.key)
}

/// The limits the maintenance tick applies.
#[derive(Debug, Clone, Copy)]
pub(crate) struct UpkeepLimits {
    pub(crate) idle_ttl: Duration,
    pub(crate) max_rss_bytes: u64,
    pub(crate) max_turns_per_process: u64,
}

/// A worker as the maintenance tick sees it.
#[derive(Debug, Clone, Copy)]
pub(crate) struct UpkeepView {
    /// Its id (it picks the worker's own turn limit, [`turn_limit`]).
    pub(crate) id: WorkerId,
    pub(crate) leased: usize,
    pub(crate) last_used: Instant,
    pub(crate) draining: bool,
    pub(crate) drain_deadline: Option<Instant>,
    pub(crate) rss_bytes: u64,
    pub(crate) turns: u64,
}

/// Why a worker starts draining on its own.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Recycle {
    /// Its resident memory is above `max_rss_bytes`.
    Memory,
    /// It ran `max_turns_per_process` turns.
    Turns,
}

/// A worker's own turn limit: `max_turns_per_process` less up to a fifth of it, picked from
/// the worker's id (so fixed for its life), so that the processes of an evenly loaded pool
/// reach their limits at different times instead of all draining and restarting at once
/// (`bench scale` saw 50 processes recycle within seconds, every 2,500 turns). Never above
/// the configured limit; a limit under 5 is kept as it is.
pub(crate) fn turn_limit(max_turns_per_process: u64, id: WorkerId) -> u64 {
    let spread = max_turns_per_process / 5;
    if spread == 0 {
        return max_turns_per_process;
    }
    // splitmix64's finalizer: consecutive ids land far apart.
    let mut z = id.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^= z >> 31;
    max_turns_per_process - z % (spread + 1)
}

/// Whether a live worker should be recycled (drain, then stop): memory first, then turns
/// (its own [`turn_limit`]).
pub(crate) fn recycle(w: &UpkeepView, limits: &UpkeepLimits) -> Option<Recycle> {
    if w.draining {
        return None;
    }
    if w.rss_bytes > limits.max_rss_bytes {
        Some(Recycle::Memory)
    } else if w.turns >= turn_limit(limits.max_turns_per_process, w.id) {
        Some(Recycle::Turns)
    } else {
        None
    }
}

/// Whether the maintenance tick stops a worker now: idle past the TTL, or draining with no
/// lease left or past its drain deadline.
pub(crate) fn evict_now(now: Instant, w: &UpkeepView, limits: &UpkeepLimits) -> Option<Eviction> {
    if w.leased == 0 && now.saturating_duration_since(w.last_used) >= limits.idle_ttl {
        return Some(Eviction::Idle);
    }
    let drained = w.draining && (w.leased == 0 || w.drain_deadline.is_some_and(|d| now >= d));
    drained.then_some(Eviction::Drained)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn worker(id: WorkerId, attached: usize, leased: usize, age_secs: u64) -> WorkerView {
        WorkerView {
            id,
            attached,
            leased,
            draining: false,
            alive: true,
            last_used: base() - Duration::from_secs(age_secs),
            warm: false,
        }
    }

    fn base() -> Instant {
        // One fixed instant per test run, far enough from the clock's start to subtract.
        static BASE: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();
        *BASE.get_or_init(|| Instant::now() + Duration::from_secs(100_000))
    }

    #[test]
    fn a_conversation_goes_to_the_least_loaded_live_worker_with_room() {
        let workers = [worker(1, 3, 0, 0), worker(2, 1, 0, 0), worker(3, 1, 0, 0)];
        assert_eq!(least_loaded(workers, 4), Some(2), "fewest, then oldest");
        let full = [worker(1, 4, 0, 0), worker(2, 4, 1, 0)];
        assert_eq!(least_loaded(full, 4), None, "no room anywhere");
        let mut draining = worker(1, 0, 0, 0);
        draining.draining = true;
        let mut dead = worker(2, 0, 0, 0);
        dead.alive = false;
        assert_eq!(
            least_loaded([draining, dead, worker(3, 2, 0, 0)], 4),
            Some(3)
        );
    }

    #[test]
    fn a_call_naming_no_conversation_goes_to_the_least_busy_live_worker_even_a_full_one() {
        let workers = [worker(1, 4, 2, 0), worker(2, 4, 1, 0), worker(3, 0, 1, 0)];
        assert_eq!(
            least_busy(workers),
            Some(3),
            "fewest leases, then fewest conversations"
        );
        assert_eq!(
            least_busy([worker(1, 4, 0, 0)]),
            Some(1),
            "a worker with no room for a conversation still answers"
        );
        let mut draining = worker(1, 0, 0, 0);
        draining.draining = true;
        let mut dead = worker(2, 0, 0, 0);
        dead.alive = false;
        assert_eq!(least_busy([draining, dead]), None);
        assert_eq!(least_busy([draining, dead, worker(3, 2, 5, 0)]), Some(3));
    }

    #[test]
    fn a_full_pool_stops_an_empty_worker_of_another_key_first_then_the_least_recently_used_idle_one()
     {
        let others = [
            worker(1, 2, 1, 500), // oldest, but leased
            worker(2, 2, 0, 300),
            worker(3, 0, 0, 10), // empty (a spare): no conversation to move
        ];
        assert_eq!(idle_victim(others), Some(3));
        let others = [
            worker(1, 2, 1, 500),
            worker(2, 2, 0, 300),
            worker(3, 1, 0, 10),
        ];
        assert_eq!(
            idle_victim(others),
            Some(2),
            "none empty: least recently used"
        );
        assert_eq!(idle_victim([worker(1, 1, 1, 9), worker(2, 1, 2, 9)]), None);
        assert_eq!(idle_victim([]), None);
        // A dead worker is not stopped for room: its crash is on its way.
        let mut dead = worker(3, 0, 0, 10);
        dead.alive = false;
        assert_eq!(idle_victim([worker(2, 2, 0, 300), dead]), Some(2));
    }

    #[test]
    fn a_warm_spare_is_still_a_spare_and_the_first_stopped_for_room_while_a_lease_makes_it_live() {
        let warm = WorkerView {
            warm: true,
            ..worker(3, 2, 0, 10)
        };
        assert!(
            is_spare(&warm),
            "holding conversations resumed ahead: a spare"
        );
        let resuming = WorkerView { leased: 1, ..warm };
        assert!(
            is_spare(&resuming),
            "its own resumes in flight do not make it live"
        );
        assert!(
            !is_spare(&worker(3, 2, 0, 10)),
            "a served worker is no spare"
        );
        assert!(!is_spare(&WorkerView {
            draining: true,
            ..warm
        }));
        assert_eq!(spare([worker(1, 1, 0, 9), warm]), Some(3));
        // Stopped before an idle worker that serves, even a less recently used one.
        assert_eq!(idle_victim([worker(2, 1, 0, 300), warm]), Some(3));
    }

    #[test]
    fn the_global_session_cap_detaches_the_least_recently_used_parked_conversation() {
        let t = base();
        let conversations = [
            ConversationView {
                key: "a/1",
                leased: true,
                last_used: t - Duration::from_secs(90),
                ahead: false,
            },
            ConversationView {
                key: "a/2",
                leased: false,
                last_used: t - Duration::from_secs(60),
                ahead: false,
            },
            ConversationView {
                key: "b/1",
                leased: false,
                last_used: t - Duration::from_secs(5),
                ahead: false,
            },
        ];
        assert_eq!(lru_parked(conversations.clone()), Some("a/2"));
        let mut resumed_ahead = conversations.clone();
        resumed_ahead[2].ahead = true;
        assert_eq!(
            lru_parked(resumed_ahead),
            Some("b/1"),
            "one resumed ahead and never used goes first"
        );
        let all_leased = conversations.map(|c| ConversationView { leased: true, ..c });
        assert_eq!(lru_parked(all_leased), None);
    }

    #[test]
    fn each_worker_recycles_within_the_last_fifth_of_the_turn_limit_and_the_limits_spread() {
        let limits: Vec<u64> = (0..1000).map(|id| turn_limit(50, id)).collect();
        assert!(limits.iter().all(|l| (40..=50).contains(l)), "{limits:?}");
        let distinct: std::collections::BTreeSet<u64> = limits.iter().copied().collect();
        assert_eq!(
            distinct.len(),
            11,
            "every limit from 40 to 50 is used: {distinct:?}"
        );
        assert_eq!(turn_limit(50, 7), turn_limit(50, 7), "fixed for a worker");
        for small in 0..5 {
            assert_eq!(turn_limit(small, 3), small, "a limit under 5 is kept");
        }
        let mut w = upkeep(0, 0);
        w.turns = turn_limit(2000, w.id) - 1;
        assert_eq!(recycle(&w, &limits_of(2000)), None);
        w.turns += 1;
        assert_eq!(recycle(&w, &limits_of(2000)), Some(Recycle::Turns));
    }

    fn limits_of(max_turns_per_process: u64) -> UpkeepLimits {
        UpkeepLimits {
            max_turns_per_process,
            ..limits()
        }
    }

    fn limits() -> UpkeepLimits {
        UpkeepLimits {
            idle_ttl: Duration::from_secs(300),
            max_rss_bytes: 1 << 30,
            max_turns_per_process: 2000,
        }
    }

    fn upkeep(leased: usize, idle_secs: u64) -> UpkeepView {
        UpkeepView {
            id: 1,
            leased,
            last_used: base() - Duration::from_secs(idle_secs),
            draining: false,
            drain_deadline: None,
            rss_bytes: 100 << 20,
            turns: 10,
        }
    }

    #[test]
    fn an_empty_ready_worker_is_a_spare_and_the_oldest_is_taken() {
        let mut draining = worker(1, 0, 0, 0);
        draining.draining = true;
        let leased = worker(2, 0, 1, 0);
        let serving = worker(3, 1, 0, 0);
        assert_eq!(spare([draining, leased, serving]), None);
        assert_eq!(
            spare([serving, worker(7, 0, 0, 0), worker(5, 0, 0, 0)]),
            Some(5)
        );
    }

    fn packing(busy: usize, cpu: usize) -> Packing {
        Packing {
            busy_leases_per_process: busy,
            cpu_processes_per_key: cpu,
        }
    }

    #[test]
    fn a_key_spreads_only_when_every_serving_process_is_busy_and_below_its_cpu_share() {
        let p = packing(2, 2);
        assert!(!spread([worker(1, 5, 1, 0)], &p), "one lease: not busy");
        assert!(spread([worker(1, 5, 2, 0)], &p), "busy, one process of two");
        assert!(
            !spread([worker(1, 5, 2, 0), worker(2, 3, 1, 0)], &p),
            "another serving process is not busy"
        );
        assert!(
            !spread([worker(1, 5, 2, 0), worker(2, 3, 2, 0)], &p),
            "both busy, but the key's CPU share is reached"
        );
        assert!(
            spread([worker(1, 5, 2, 0), worker(2, 0, 0, 0)], &p),
            "an empty spare is not a serving process"
        );
        assert!(
            !spread([worker(1, 5, 9, 0)], &packing(2, 1)),
            "2 cores: never"
        );
        assert!(!spread([worker(1, 0, 0, 0)], &p), "nothing serving");
    }

    #[test]
    fn the_cpu_share_of_a_key_is_two_thirds_of_the_cores_and_at_least_one() {
        assert_eq!(cpu_processes_for(0), 1);
        assert_eq!(cpu_processes_for(1), 1);
        assert_eq!(cpu_processes_for(2), 1);
        assert_eq!(cpu_processes_for(3), 2);
        assert_eq!(cpu_processes_for(16), 10);
    }

    #[test]
    fn a_key_keeps_spares_only_within_the_window_after_its_last_lease() {
        let now = base();
        let window = Duration::from_secs(600);
        assert_eq!(spares_wanted(None, now, 2, window), 0, "never leased");
        assert_eq!(
            spares_wanted(Some(now - Duration::from_secs(599)), now, 2, window),
            2
        );
        assert_eq!(
            spares_wanted(Some(now - Duration::from_secs(600)), now, 2, window),
            0
        );
        assert_eq!(spares_wanted(Some(now), now, 0, window), 0, "off");
    }

    #[test]
    fn workers_are_recycled_by_memory_and_by_turn_count_once() {
        let l = limits();
        assert_eq!(recycle(&upkeep(1, 0), &l), None);
        let heavy = UpkeepView {
            rss_bytes: (1 << 30) + 1,
            ..upkeep(1, 0)
        };
        assert_eq!(recycle(&heavy, &l), Some(Recycle::Memory));
        let worn = UpkeepView {
            turns: 2000,
            ..upkeep(0, 0)
        };
        assert_eq!(recycle(&worn, &l), Some(Recycle::Turns));
        let already = UpkeepView {
            draining: true,
            ..heavy
        };
        assert_eq!(
            recycle(&already, &l),
            None,
            "a draining worker is not recycled again"
        );
    }

    #[test]
    fn idle_workers_are_stopped_after_the_ttl_and_drained_ones_when_free_or_late() {
        let l = limits();
        let now = base();
        assert_eq!(evict_now(now, &upkeep(0, 299), &l), None);
        assert_eq!(evict_now(now, &upkeep(0, 300), &l), Some(Eviction::Idle));
        assert_eq!(
            evict_now(now, &upkeep(1, 3000), &l),
            None,
            "a lease keeps it"
        );
        let draining = UpkeepView {
            draining: true,
            drain_deadline: Some(now + Duration::from_secs(60)),
            ..upkeep(1, 0)
        };
        assert_eq!(
            evict_now(now, &draining, &l),
            None,
            "leased, before the deadline"
        );
        assert_eq!(
            evict_now(now + Duration::from_secs(60), &draining, &l),
            Some(Eviction::Drained),
            "past the deadline even with a lease"
        );
        let free = UpkeepView {
            leased: 0,
            ..draining
        };
        assert_eq!(evict_now(now, &free, &l), Some(Eviction::Drained));
    }
}
