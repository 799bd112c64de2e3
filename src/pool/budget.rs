//! The one process budget (`max_processes`) shared by every backend of a pool (issue 17,
//! item 1): Copilot workers and CLI processes draw on it together. It owns the view each side
//! has of the other ([`Others`]: how many processes the other side holds, and when its best
//! idle victim was last used) and the rule that picks, when the pool is full, whose idle
//! process makes room ([`make_room`]: the older idle one, either side's). Pure: no locks, no
//! processes, no clock.
//!
//! How the two sides meet: the CLI side's bookkeeping (`cli::slots`) and the view of the
//! Copilot side live under one mutex (the CLI shell's). The pool actor takes that mutex around
//! every call into its placement core, so each core decides with the other side's exact count
//! and the cap holds across both. A core that wants the other side's idle process asks for it
//! once ([`Nudge::EvictIdle`] from the CLI side, a direct call from the actor) and waits in its
//! own FIFO; a side whose processes changed (fewer, or one newly idle) wakes the other
//! ([`Nudge::Changed`]).

use std::time::Instant;

/// What one side sees of the other side's processes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Others {
    /// Processes the other side holds (Copilot: workers and starts in flight; CLI: slots).
    pub held: usize,
    /// When the other side's idle process it would stop first was last used (`None`: it
    /// has none to give up).
    pub idle_since: Option<Instant>,
    /// The other side is stopping a process to make room for this side's lease: an ask here
    /// waits for that stop instead of stopping another process.
    pub making_room: bool,
}

/// Whose idle process makes room in a full pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Room {
    /// Stop the asking side's own idle process.
    Own,
    /// Ask the other side to stop its idle process.
    Other,
}

/// The oldest idle process goes, whichever side holds it; the asking side's own on a tie
/// (no message to the other side). `None`: neither side has an idle process.
pub(crate) fn make_room(own: Option<Instant>, other: Option<Instant>) -> Option<Room> {
    match (own, other) {
        (Some(own), Some(other)) if other < own => Some(Room::Other),
        (Some(_), _) => Some(Room::Own),
        (None, Some(_)) => Some(Room::Other),
        (None, None) => None,
    }
}

/// Whether a side holding `own` processes may hold one more beside `others`.
pub(crate) fn has_room(own: usize, others: &Others, max_processes: usize) -> bool {
    own + others.held < max_processes
}

/// What the CLI side tells the pool actor.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Nudge {
    /// The CLI side's processes changed (fewer, or one newly idle): serve the Copilot
    /// waiters.
    Changed,
    /// A CLI lease needs room: stop the Copilot side's idle worker (the oldest idle process
    /// of the pool), then tell the CLI side.
    EvictIdle,
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn the_older_idle_process_makes_room_whichever_side_holds_it() {
        let t0 = Instant::now();
        let t1 = t0 + Duration::from_secs(1);
        assert_eq!(make_room(Some(t1), Some(t0)), Some(Room::Other));
        assert_eq!(make_room(Some(t0), Some(t1)), Some(Room::Own));
        assert_eq!(
            make_room(Some(t0), Some(t0)),
            Some(Room::Own),
            "a tie stays home"
        );
        assert_eq!(make_room(None, Some(t1)), Some(Room::Other));
        assert_eq!(make_room(Some(t1), None), Some(Room::Own));
        assert_eq!(make_room(None, None), None);
    }

    #[test]
    fn the_other_sides_processes_count_against_the_cap() {
        let others = Others {
            held: 1,
            idle_since: None,
            making_room: false,
        };
        assert!(has_room(0, &others, 2));
        assert!(!has_room(1, &others, 2));
        assert!(!has_room(0, &others, 1));
        assert!(has_room(0, &Others::default(), 1));
    }
}
