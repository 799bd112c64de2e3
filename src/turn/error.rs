//! Why a turn did not end well: the turn layer's own errors, so `turn` depends on nothing
//! above it. The pool carries them as `PoolError::Turn`, except a dead worker, which it
//! reports as `PoolError::Worker`.

use std::time::Duration;

use crate::worker::WorkerError;

use super::TimeoutKind;

/// Why a turn failed or could not be started.
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum TurnError {
    /// `send` while a turn is running, a turn call without one, or a stream that ended.
    #[error("{0}")]
    State(&'static str),
    /// The turn hit one of the pool's timeouts; it was aborted and the conversation stays
    /// resumable (take the next turn on the same lease or a new one).
    #[error(
        "turn timed out ({kind:?} after {after:?}): {detail}; the turn was aborted, the conversation can continue"
    )]
    Timeout {
        /// Which limit.
        kind: TimeoutKind,
        /// The limit.
        after: Duration,
        /// What was going on.
        detail: String,
    },
    /// The runtime reported the turn failed (`session.error`), e.g. the provider answered 500.
    #[error("the turn failed{}: {message}", .status_code.map(|c| format!(" with status {c}")).unwrap_or_default())]
    Failed {
        /// The runtime's message.
        message: String,
        /// The HTTP status of the failing model call, if any.
        status_code: Option<u16>,
        /// The runtime's error type.
        error_type: Option<String>,
    },
    /// The strict transcript mirror could not be written; the turn was aborted.
    #[error(
        "transcript mirror write failed (strict mode): {0}; fix the transcript directory or use best-effort mode"
    )]
    TranscriptPersistence(String),
    /// The caller read the turn's events slower than the runtime wrote them: more than
    /// [`super::TurnHandlers::max_unread_event_bytes`] waited unread behind each of two
    /// events in a row it took. The turn was aborted (what waited was drained, and is in the
    /// transcript mirror), the conversation stays resumable.
    #[error(
        "the turn's events were read too slowly: {unread_bytes} bytes of them waited unread, over the limit of {limit} (max_unread_event_bytes); the turn was aborted, the conversation can continue. Read the events as they come (over HTTP, the SSE response as it streams)"
    )]
    Backlog {
        /// The bytes waiting when the turn was aborted.
        unread_bytes: usize,
        /// The limit.
        limit: usize,
    },
    /// The worker died or stopped under the turn.
    #[error(transparent)]
    Worker(WorkerError),
}
