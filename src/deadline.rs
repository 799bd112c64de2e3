//! Deadlines that never overflow: a limit too large to add to an instant (such as
//! `Duration::MAX` for "no limit") gives a deadline far in the future instead of a panic.

use std::time::Duration;

use tokio::time::Instant;

/// "Far in the future": about 30 years, as tokio's own timers use.
const FAR_FUTURE: Duration = Duration::from_secs(30 * 365 * 24 * 60 * 60);

/// `limit` after `start`, or far in the future when that is not representable.
pub(crate) fn from(start: Instant, limit: Duration) -> Instant {
    start
        .checked_add(limit)
        .or_else(|| start.checked_add(FAR_FUTURE))
        .unwrap_or(start)
}

/// [`from`] for a `std::time::Instant` (the pool actor's and the restart policy's clocks).
pub(crate) fn from_std(start: std::time::Instant, limit: Duration) -> std::time::Instant {
    from(Instant::from_std(start), limit).into_std()
}

/// `limit` from now, or far in the future when that is not representable.
pub(crate) fn from_now(limit: Duration) -> Instant {
    from(Instant::now(), limit)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_representable_limit_is_added_exactly() {
        let start = Instant::now();
        assert_eq!(
            from(start, Duration::from_secs(90)),
            start + Duration::from_secs(90)
        );
        assert_eq!(from(start, Duration::ZERO), start);
    }

    #[test]
    fn an_unrepresentable_limit_is_far_in_the_future_instead_of_a_panic() {
        let start = Instant::now();
        let deadline = from(start, Duration::MAX);
        assert!(deadline >= start + Duration::from_secs(10 * 365 * 24 * 60 * 60));
        let deadline = from_now(Duration::MAX);
        assert!(deadline > Instant::now() + Duration::from_secs(10 * 365 * 24 * 60 * 60));
    }
}
