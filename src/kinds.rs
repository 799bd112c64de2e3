//! The closed sets of values the crate reports to callers, dashboards and HTTP clients: how
//! a conversation was opened, how a turn ended, and what kind of failure a pool error is.
//! Each is an enum with `ALL` (what metrics registration iterates) and one `label()`, so a
//! value is spelled in one place. This module depends on nothing else in the crate; `metrics`,
//! `pool`, `turn` and the HTTP layer all map from it.

use serde::Serialize;

/// How a lease's CLI session was opened: whether the runtime still had the conversation's
/// context (`Attached`, `Resumed`) or started without it (every other value).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum OpenReason {
    /// Still attached to the same worker since the last lease: nothing to resume.
    Attached,
    /// Resumed a stored session (new worker, crash, rotation, restart, new handlers).
    Resumed,
    /// No binding: a new session.
    New,
    /// The binding's session state is gone from disk: a new session.
    TranscriptMissing,
    /// The runtime did not know the bound session: a new session.
    NotFound,
    /// Model, provider, working directory, home or account changed: a new session.
    CompatChanged,
    /// Resuming the stored session crashed the runtime `max_resume_crashes` times in a row:
    /// a new session, so the conversation stops taking its process down.
    ResumeFailed,
}

impl OpenReason {
    /// Every value, in a stable order.
    pub const ALL: [OpenReason; 7] = [
        OpenReason::Attached,
        OpenReason::Resumed,
        OpenReason::New,
        OpenReason::TranscriptMissing,
        OpenReason::NotFound,
        OpenReason::CompatChanged,
        OpenReason::ResumeFailed,
    ];

    /// Whether the conversation continued an existing CLI session.
    pub fn continued(self) -> bool {
        matches!(self, OpenReason::Attached | OpenReason::Resumed)
    }

    /// The wire and log spelling (`resume-failed`, …), as serialized.
    pub fn as_str(self) -> &'static str {
        match self {
            OpenReason::Attached => "attached",
            OpenReason::Resumed => "resumed",
            OpenReason::New => "new",
            OpenReason::TranscriptMissing => "transcript-missing",
            OpenReason::NotFound => "not-found",
            OpenReason::CompatChanged => "compat-changed",
            OpenReason::ResumeFailed => "resume-failed",
        }
    }
}

/// How a turn ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum TurnEnd {
    /// `session.idle` without an error.
    Idle,
    /// `session.error`, or a strict transcript failure.
    Error,
    /// Aborted (`session.idle {aborted: true}`, or the lease dropped mid-turn).
    Aborted,
    /// One of the turn's limits expired.
    Timeout,
    /// The worker died or the session's stream ended.
    Crashed,
}

impl TurnEnd {
    /// Every value, in a stable order.
    pub const ALL: [TurnEnd; 5] = [
        TurnEnd::Idle,
        TurnEnd::Error,
        TurnEnd::Aborted,
        TurnEnd::Timeout,
        TurnEnd::Crashed,
    ];

    /// The label (`copilot_pool_turns_total{outcome}`, `turn.end.status`).
    pub fn label(self) -> &'static str {
        match self {
            TurnEnd::Idle => "idle",
            TurnEnd::Error => "error",
            TurnEnd::Aborted => "aborted",
            TurnEnd::Timeout => "timeout",
            TurnEnd::Crashed => "crashed",
        }
    }
}

/// What kind of failure a pool error is: what the caller can do about it. Metrics count
/// rejected leases by [`ErrorKind::rejection_label`]; the HTTP layer maps it to a status.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ErrorKind {
    /// The request (credentials, agent id, home, options) is unusable: fix it.
    Invalid,
    /// `existing_only` and no such conversation.
    NotFound,
    /// The conversation is leased by another caller and the request asked not to queue.
    Busy,
    /// Another caller held the conversation for the whole wait.
    BusyTimeout,
    /// No capacity became free within the wait.
    NoCapacity,
    /// Too many leases are waiting already.
    WaitersFull,
    /// The key crashed too often; retry after the cool-down.
    Quarantined,
    /// The pool is shut down or draining.
    Closed,
    /// The machine ran out of file descriptors, processes or memory.
    ResourceExhausted,
    /// The state directory cannot record the conversation.
    StateUnwritable,
    /// The runtime or the turn failed (a crash, a timeout, an error answer).
    Runtime,
    /// A bug.
    Internal,
}

impl ErrorKind {
    /// Every value, in a stable order.
    pub const ALL: [ErrorKind; 12] = [
        ErrorKind::Invalid,
        ErrorKind::NotFound,
        ErrorKind::Busy,
        ErrorKind::BusyTimeout,
        ErrorKind::NoCapacity,
        ErrorKind::WaitersFull,
        ErrorKind::Quarantined,
        ErrorKind::Closed,
        ErrorKind::ResourceExhausted,
        ErrorKind::StateUnwritable,
        ErrorKind::Runtime,
        ErrorKind::Internal,
    ];

    /// The `reason` label of `copilot_pool_lease_rejections_total`.
    pub fn rejection_label(self) -> &'static str {
        match self {
            ErrorKind::Invalid | ErrorKind::NotFound => "invalid",
            ErrorKind::Busy => "busy",
            ErrorKind::BusyTimeout | ErrorKind::NoCapacity => "wait_timeout",
            ErrorKind::WaitersFull => "waiters_full",
            ErrorKind::Quarantined => "quarantined",
            ErrorKind::Closed => "closed",
            ErrorKind::ResourceExhausted => "resource_exhausted",
            ErrorKind::StateUnwritable => "state_unwritable",
            ErrorKind::Runtime | ErrorKind::Internal => "error",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

    #[test]
    fn every_open_reason_serializes_as_its_label() {
        for reason in OpenReason::ALL {
            let json = serde_json::to_value(reason).expect("serialize");
            assert_eq!(json, reason.as_str());
        }
        let labels: HashSet<_> = OpenReason::ALL.iter().map(|r| r.as_str()).collect();
        assert_eq!(labels.len(), OpenReason::ALL.len());
    }

    #[test]
    fn every_turn_end_serializes_as_its_label() {
        for end in TurnEnd::ALL {
            assert_eq!(serde_json::to_value(end).expect("serialize"), end.label());
        }
    }
}
