//! OTP-style restart intensity and backoff for one pool key: how many crashes a window may
//! hold before the key is quarantined for a cool-down, and how long to wait before each
//! restart (a quick first retry, then jittered exponential backoff). Pure apart from the
//! jitter: every method takes `now`.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

/// How restarts of one key are limited and spaced.
#[derive(Clone, Debug)]
pub struct RestartPolicy {
    /// The most crashes the window may hold; one more quarantines the key.
    pub max_restarts: u32,
    /// How long a crash counts against `max_restarts`.
    pub window: Duration,
    /// How long a quarantined key refuses restarts.
    pub cooldown: Duration,
    /// The delay before the first consecutive restart.
    pub first_retry: Duration,
    /// The delay before the second consecutive restart; it doubles for each after.
    pub backoff_base: Duration,
    /// The longest delay before a restart, jitter included.
    pub backoff_max: Duration,
    /// A worker that opened a conversation and then lived at least this long before it died
    /// was killed from outside (the OOM killer, an operator), not by a crash loop: it is
    /// replaced at once and its death counts toward no quarantine (default 1 s). Deaths
    /// during the handshake, before serving, or within this period still count.
    pub healthy_after: Duration,
}

impl Default for RestartPolicy {
    fn default() -> Self {
        Self {
            max_restarts: 5,
            window: Duration::from_secs(30),
            cooldown: Duration::from_secs(60),
            first_retry: Duration::from_millis(10),
            backoff_base: Duration::from_millis(100),
            backoff_max: Duration::from_secs(10),
            healthy_after: Duration::from_secs(1),
        }
    }
}

/// What to do after a crash.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RestartDecision {
    /// Restart the worker after this delay.
    Restart {
        /// The delay before restarting.
        after: Duration,
    },
    /// Too many crashes: refuse restarts until this instant.
    Quarantine {
        /// The end of the cool-down.
        until: Instant,
    },
}

/// The crash history of one key.
#[derive(Debug, Default)]
pub struct RestartTracker {
    /// Crash times within the window, oldest first.
    crashes: VecDeque<Instant>,
    /// Restarts since the last stable service (or quarantine).
    consecutive: u32,
    /// The end of the current quarantine, if any.
    quarantine_until: Option<Instant>,
    /// Restarts granted over the tracker's life.
    total: u64,
}

impl RestartTracker {
    /// A tracker with no history.
    pub fn new() -> Self {
        Self::default()
    }

    /// Records a crash at `now` and decides what to do. Crashes older than the window are
    /// forgotten; more than `max_restarts` crashes in the window quarantine the key until
    /// `now + cooldown` and clear the window, so the key starts fresh afterwards. A crash
    /// reported while the key is still quarantined is not counted and returns the current
    /// quarantine.
    ///
    /// Restart delays: the first consecutive restart waits `first_retry`; restart `k >= 2`
    /// waits `backoff_base * 2^(k-2)`; each delay gets ±25 % jitter and is capped at
    /// `backoff_max`.
    pub fn record_crash(&mut self, now: Instant, policy: &RestartPolicy) -> RestartDecision {
        if let Some(until) = self.quarantined_until(now) {
            return RestartDecision::Quarantine { until };
        }
        self.quarantine_until = None;
        self.forget_old(now, policy);
        self.crashes.push_back(now);

        let limit = usize::try_from(policy.max_restarts).unwrap_or(usize::MAX);
        if self.crashes.len() > limit {
            // An unrepresentable cool-down is "for good", never "none".
            let until = crate::deadline::from_std(now, policy.cooldown);
            self.quarantine_until = Some(until);
            self.crashes.clear();
            self.consecutive = 0;
            return RestartDecision::Quarantine { until };
        }

        self.consecutive = self.consecutive.saturating_add(1);
        self.total = self.total.saturating_add(1);
        let delay = nominal_delay(self.consecutive, policy);
        let after = jitter(delay, random_bits()).min(policy.backoff_max);
        RestartDecision::Restart { after }
    }

    /// The end of the quarantine while `now` is before it.
    pub fn quarantined_until(&self, now: Instant) -> Option<Instant> {
        self.quarantine_until.filter(|until| now < *until)
    }

    /// A worker that had served was killed from outside: it is replaced at once, the death
    /// counts toward no quarantine, and the backoff starts over (as after healthy uptime).
    /// A quarantine already running still holds.
    pub fn record_outside_kill(&mut self, now: Instant) -> RestartDecision {
        if let Some(until) = self.quarantined_until(now) {
            return RestartDecision::Quarantine { until };
        }
        self.consecutive = 0;
        self.total = self.total.saturating_add(1);
        RestartDecision::Restart {
            after: Duration::ZERO,
        }
    }

    /// A restarted worker served successfully: the next crash gets the quick first retry
    /// again. The window is kept, so crash loops are still caught.
    pub fn record_stable(&mut self) {
        self.consecutive = 0;
    }

    /// How many crashes at `now` still count against `max_restarts`.
    pub fn restarts_in_window(&self, now: Instant, policy: &RestartPolicy) -> usize {
        self.crashes
            .iter()
            .filter(|crash| in_window(**crash, now, policy))
            .count()
    }

    /// Restarts granted over the tracker's life.
    pub fn total_restarts(&self) -> u64 {
        self.total
    }

    fn forget_old(&mut self, now: Instant, policy: &RestartPolicy) {
        while let Some(oldest) = self.crashes.front() {
            if in_window(*oldest, now, policy) {
                break;
            }
            self.crashes.pop_front();
        }
    }
}

/// Whether a crash at `crash` still counts at `now`.
fn in_window(crash: Instant, now: Instant, policy: &RestartPolicy) -> bool {
    now.saturating_duration_since(crash) <= policy.window
}

/// The delay before consecutive restart `attempt` (1-based), before jitter and cap.
fn nominal_delay(attempt: u32, policy: &RestartPolicy) -> Duration {
    if attempt <= 1 {
        return policy.first_retry;
    }
    let exponent = attempt - 2;
    if exponent >= 32 {
        return policy.backoff_max;
    }
    policy
        .backoff_base
        .saturating_mul(1u32 << exponent)
        .min(policy.backoff_max)
}

/// `delay` moved by up to ±25 %, chosen by `random`.
fn jitter(delay: Duration, random: u64) -> Duration {
    let nanos = delay.as_nanos();
    let spread = nanos / 4;
    let offset = u128::from(random) % (2 * spread + 1);
    // nanos - spread + offset lies in [0.75 * nanos, 1.25 * nanos].
    from_nanos_u128(nanos - spread + offset)
}

fn from_nanos_u128(nanos: u128) -> Duration {
    const NANOS_PER_SEC: u128 = 1_000_000_000;
    let secs = u64::try_from(nanos / NANOS_PER_SEC).unwrap_or(u64::MAX);
    // The remainder is below 10^9 and fits in u32.
    let sub = u32::try_from(nanos % NANOS_PER_SEC).unwrap_or(0);
    Duration::new(secs, sub)
}

/// 62 random bits from a v4 UUID (its low 62 bits carry no version or variant bits).
fn random_bits() -> u64 {
    let bits = uuid::Uuid::new_v4().as_u128() & ((1u128 << 62) - 1);
    u64::try_from(bits).unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    /// Whether `after` is `nominal` ±25 % (integer nanoseconds), capped at `max`.
    fn within(after: Duration, nominal: Duration, max: Duration) -> bool {
        let (n, a) = (nominal.as_nanos(), after.as_nanos());
        a >= (n - n / 4).min(max.as_nanos()) && a <= (n + n / 4).min(max.as_nanos())
    }

    fn restart_delay(decision: &RestartDecision) -> Duration {
        match decision {
            RestartDecision::Restart { after } => *after,
            other => panic!("expected a restart, got {other:?}"),
        }
    }

    #[test]
    fn defaults() {
        let p = RestartPolicy::default();
        assert_eq!(p.max_restarts, 5);
        assert_eq!(p.window, Duration::from_secs(30));
        assert_eq!(p.cooldown, Duration::from_secs(60));
        assert_eq!(p.first_retry, ms(10));
        assert_eq!(p.backoff_base, ms(100));
        assert_eq!(p.backoff_max, Duration::from_secs(10));
    }

    #[test]
    fn five_crashes_restart_the_sixth_quarantines() {
        let p = RestartPolicy::default();
        let t0 = Instant::now();
        let mut tracker = RestartTracker::new();
        for i in 0..5 {
            let decision = tracker.record_crash(t0 + Duration::from_secs(i * 5), &p);
            assert!(
                matches!(decision, RestartDecision::Restart { .. }),
                "{decision:?}"
            );
        }
        let now = t0 + Duration::from_secs(29);
        assert_eq!(tracker.restarts_in_window(now, &p), 5);
        assert_eq!(tracker.total_restarts(), 5);
        assert_eq!(
            tracker.record_crash(now, &p),
            RestartDecision::Quarantine {
                until: now + p.cooldown
            }
        );
        assert_eq!(tracker.restarts_in_window(now, &p), 0);
        assert_eq!(tracker.total_restarts(), 5);
    }

    #[test]
    fn crashes_spread_beyond_the_window_never_quarantine() {
        let p = RestartPolicy::default();
        let t0 = Instant::now();
        let mut tracker = RestartTracker::new();
        // One crash every 7 s: at most 5 fall in any 30 s window.
        for i in 0..100 {
            let now = t0 + Duration::from_secs(i * 7);
            let decision = tracker.record_crash(now, &p);
            assert!(
                matches!(decision, RestartDecision::Restart { .. }),
                "crash {i}: {decision:?}"
            );
            assert!(tracker.restarts_in_window(now, &p) <= 5);
        }
        assert_eq!(tracker.total_restarts(), 100);
        let later = t0 + Duration::from_secs(10_000);
        assert_eq!(tracker.restarts_in_window(later, &p), 0);
    }

    #[test]
    fn backoff_grows_and_caps() {
        let p = RestartPolicy {
            max_restarts: 1000,
            ..RestartPolicy::default()
        };
        let t0 = Instant::now();
        let mut tracker = RestartTracker::new();
        let mut previous = Duration::ZERO;
        for k in 1..=20u32 {
            let nominal = nominal_delay(k, &p);
            let after = restart_delay(&tracker.record_crash(t0, &p));
            assert!(within(after, nominal, p.backoff_max), "k={k}: {after:?}");
            if k == 1 {
                assert_eq!(nominal, ms(10));
            } else {
                let expected = (ms(100) * 2u32.pow((k - 2).min(10))).min(p.backoff_max);
                assert_eq!(nominal, expected, "k={k}");
                assert!(nominal >= previous);
            }
            assert!(after <= p.backoff_max);
            previous = nominal;
        }
        assert_eq!(nominal_delay(2, &p), ms(100));
        assert_eq!(nominal_delay(3, &p), ms(200));
        assert_eq!(nominal_delay(8, &p), ms(6400));
        assert_eq!(nominal_delay(9, &p), p.backoff_max);
        assert_eq!(nominal_delay(u32::MAX, &p), p.backoff_max);
    }

    #[test]
    fn record_stable_resets_backoff_not_window() {
        let p = RestartPolicy::default();
        let t0 = Instant::now();
        let mut tracker = RestartTracker::new();
        for _ in 0..4 {
            tracker.record_crash(t0, &p);
        }
        tracker.record_stable();
        let after = restart_delay(&tracker.record_crash(t0, &p));
        assert!(within(after, p.first_retry, p.backoff_max), "{after:?}");
        assert_eq!(tracker.restarts_in_window(t0, &p), 5);
        tracker.record_stable();
        assert!(matches!(
            tracker.record_crash(t0, &p),
            RestartDecision::Quarantine { .. }
        ));
    }

    #[test]
    fn jitter_stays_within_bounds() {
        let p = RestartPolicy::default();
        for nominal in [ms(0), ms(1), ms(10), ms(100), ms(6400), p.backoff_max] {
            for _ in 0..100 {
                let after = jitter(nominal, random_bits()).min(p.backoff_max);
                assert!(
                    within(after, nominal, p.backoff_max),
                    "{nominal:?}: {after:?}"
                );
            }
        }
        assert_eq!(jitter(ms(100), 0), ms(75));
        assert_eq!(jitter(ms(100), 50_000_000), ms(125));
        assert_eq!(jitter(Duration::ZERO, 12345), Duration::ZERO);
        // Through the tracker too: 100 third restarts.
        let t0 = Instant::now();
        for _ in 0..100 {
            let mut tracker = RestartTracker::new();
            tracker.record_crash(t0, &p);
            tracker.record_crash(t0, &p);
            let after = restart_delay(&tracker.record_crash(t0, &p));
            assert!(within(after, ms(200), p.backoff_max), "{after:?}");
        }
    }

    #[test]
    fn jitter_never_exceeds_the_cap() {
        let p = RestartPolicy {
            max_restarts: 1000,
            ..RestartPolicy::default()
        };
        let t0 = Instant::now();
        let mut tracker = RestartTracker::new();
        for _ in 0..20 {
            tracker.record_crash(t0, &p);
        }
        for _ in 0..100 {
            let after = restart_delay(&tracker.record_crash(t0, &p));
            assert!(within(after, p.backoff_max, p.backoff_max), "{after:?}");
        }
    }

    #[test]
    fn an_unrepresentable_cool_down_quarantines_for_good_instead_of_not_at_all() {
        let p = RestartPolicy {
            cooldown: Duration::MAX,
            ..RestartPolicy::default()
        };
        let t0 = Instant::now();
        let mut tracker = RestartTracker::new();
        for _ in 0..5 {
            tracker.record_crash(t0, &p);
        }
        assert!(matches!(
            tracker.record_crash(t0, &p),
            RestartDecision::Quarantine { .. }
        ));
        let a_year = Duration::from_secs(365 * 24 * 60 * 60);
        assert!(tracker.quarantined_until(t0 + a_year).is_some());
    }

    #[test]
    fn quarantine_deadline_and_fresh_start_after_cooldown() {
        let p = RestartPolicy::default();
        let t0 = Instant::now();
        let mut tracker = RestartTracker::new();
        assert_eq!(tracker.quarantined_until(t0), None);
        for _ in 0..5 {
            tracker.record_crash(t0, &p);
        }
        let until = match tracker.record_crash(t0, &p) {
            RestartDecision::Quarantine { until } => until,
            other => panic!("{other:?}"),
        };
        assert_eq!(until, t0 + p.cooldown);
        assert_eq!(tracker.quarantined_until(t0), Some(until));
        assert_eq!(
            tracker.quarantined_until(until - Duration::from_nanos(1)),
            Some(until)
        );
        assert_eq!(tracker.quarantined_until(until), None);
        assert_eq!(tracker.quarantined_until(until + ms(1)), None);

        // A crash during the quarantine is not counted and keeps the deadline.
        assert_eq!(
            tracker.record_crash(t0 + ms(5), &p),
            RestartDecision::Quarantine { until }
        );

        // After the cool-down the key starts fresh: quick first retry, then five more allowed.
        let after_cooldown = until + ms(1);
        let after = restart_delay(&tracker.record_crash(after_cooldown, &p));
        assert!(within(after, p.first_retry, p.backoff_max), "{after:?}");
        assert_eq!(tracker.restarts_in_window(after_cooldown, &p), 1);
        for _ in 0..4 {
            assert!(matches!(
                tracker.record_crash(after_cooldown, &p),
                RestartDecision::Restart { .. }
            ));
        }
        assert!(matches!(
            tracker.record_crash(after_cooldown, &p),
            RestartDecision::Quarantine { .. }
        ));
    }

    #[test]
    fn zero_max_restarts_quarantines_at_once() {
        let p = RestartPolicy {
            max_restarts: 0,
            ..RestartPolicy::default()
        };
        let t0 = Instant::now();
        let mut tracker = RestartTracker::new();
        assert!(matches!(
            tracker.record_crash(t0, &p),
            RestartDecision::Quarantine { .. }
        ));
        assert_eq!(tracker.total_restarts(), 0);
    }
}
