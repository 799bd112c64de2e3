//! The health verdict of one runtime: counts health pings missed in a row and says when the
//! runtime is hung. Pure bookkeeping; the worker actor sends the pings and kills.

use std::time::Duration;

use super::error::ExitReason;

/// Missed pings in a row, against a limit.
#[derive(Debug, Clone)]
pub(crate) struct HealthMisses {
    limit: u32,
    timeout: Duration,
    misses: u32,
}

impl HealthMisses {
    /// Hung after `limit` missed pings in a row (0 is taken as 1), each given `timeout`.
    pub(crate) fn new(limit: u32, timeout: Duration) -> Self {
        HealthMisses {
            limit: limit.max(1),
            timeout,
            misses: 0,
        }
    }

    /// Any answer (even an error answer) proves the runtime alive: the count starts over.
    pub(crate) fn answered(&mut self) {
        self.misses = 0;
    }

    /// A ping was not answered in time. Returns the reason to kill the runtime once the
    /// limit is reached, `None` while it may still be only slow.
    pub(crate) fn missed(&mut self) -> Option<ExitReason> {
        self.misses = self.misses.saturating_add(1);
        (self.misses >= self.limit).then_some(ExitReason::Hung {
            misses: self.misses,
            timeout: self.timeout,
        })
    }

    /// Pings missed in a row so far.
    pub(crate) fn misses(&self) -> u32 {
        self.misses
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const T: Duration = Duration::from_millis(300);

    #[test]
    fn one_missed_ping_then_an_answer_starts_the_count_over() {
        let mut health = HealthMisses::new(2, T);
        assert_eq!(health.missed(), None, "one slow ping is not a hang");
        health.answered();
        assert_eq!(health.misses(), 0);
        assert_eq!(health.missed(), None, "the count started over");
        assert_eq!(
            health.missed(),
            Some(ExitReason::Hung {
                misses: 2,
                timeout: T
            })
        );
    }

    #[test]
    fn a_limit_of_one_declares_a_hang_at_the_first_miss_and_zero_means_one() {
        for limit in [0, 1] {
            let mut health = HealthMisses::new(limit, T);
            assert_eq!(
                health.missed(),
                Some(ExitReason::Hung {
                    misses: 1,
                    timeout: T
                }),
                "limit {limit}"
            );
        }
    }

    #[test]
    fn the_hang_message_says_how_many_pings_were_missed_and_what_to_tune() {
        let text = ExitReason::Hung {
            misses: 2,
            timeout: Duration::from_secs(5),
        }
        .to_string();
        assert!(text.contains("2 health pings in a row within 5s"), "{text}");
        assert!(
            text.contains("raise the health timeout or misses"),
            "{text}"
        );
    }
}
