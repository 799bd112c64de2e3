//! Why a lease or a pool operation failed.

use std::sync::Arc;
use std::time::Duration;

use crate::auth::AuthError;
use crate::home::HomeError;
use crate::kinds::ErrorKind;
use crate::turn::TurnError;
use crate::worker::WorkerError;

use super::bindings::BindingError;

/// Why a pool operation failed.
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum PoolError {
    /// The lease's credentials are unusable.
    #[error(transparent)]
    Auth(#[from] AuthError),
    /// The agent id or home is unusable.
    #[error(transparent)]
    Home(Arc<HomeError>),
    /// The request is malformed; the message says what to change.
    #[error("invalid lease request: {0}")]
    InvalidRequest(String),
    /// The worker's sandbox cannot hold this lease (its working directory lies outside what
    /// the agent's runtime may write) or could not be prepared.
    #[error(transparent)]
    Sandbox(Arc<crate::sandbox::SandboxError>),
    /// `existing_only` was set and there is no such conversation with these settings.
    #[error(
        "no existing conversation {session_key:?} with these settings ({why}); pass the same \
         model, provider and auth as its turns"
    )]
    NoSuchConversation {
        /// The conversation.
        session_key: String,
        /// Why it does not continue.
        why: &'static str,
    },
    /// The binding store failed.
    #[error("session bindings: {0}")]
    Bindings(String),
    /// The conversation's binding could not be recorded, so the turn did not run: after a
    /// restart or an eviction the conversation could not be found again. Nothing was left
    /// attached.
    #[error(
        "could not record the conversation in the state directory {dir:?}: {error}; the turn \
         did not run. Make the state directory writable (check its owner, mode and free \
         space) and retry"
    )]
    StateUnwritable {
        /// The bindings directory.
        dir: std::path::PathBuf,
        /// The OS error.
        error: String,
    },
    /// A CLI backend's stored session has no transcript left where its CLI keeps it:
    /// resuming would silently lose the conversation's history, so nothing ran.
    #[error(
        "the stored `{backend}` session {session_id} of this conversation has no transcript \
         at {path:?}, so it cannot be resumed with its history and the turn did not run; \
         restore the file, or start over: a new session_key, or delete the conversation \
         (over HTTP `DELETE /v1/sessions/{{agent_id}}/{{session_key}}?backend={backend}`; in \
         Rust `Pool::delete_cli_conversation`) and run the turn again"
    )]
    TranscriptMissing {
        /// The backend id.
        backend: String,
        /// The stored CLI session id.
        session_id: String,
        /// Where the transcript was expected.
        path: std::path::PathBuf,
    },
    /// Deleting a CLI backend's conversation could not remove a file its CLI keeps of the
    /// session; its stored session is kept (its process may be ended already).
    #[error(
        "could not remove {path:?}, kept by the conversation's CLI session: {error}; the \
         conversation is partly deleted (its process ended, its stored session kept). Make \
         the agent's home writable by the daemon's user and delete it again"
    )]
    TranscriptUnremovable {
        /// The file or folder.
        path: std::path::PathBuf,
        /// The OS error.
        error: String,
    },
    /// The pool is shut down (or shutting down).
    #[error("the pool is shut down; start a new pool to lease again")]
    Closed,
    /// No capacity became free in time.
    #[error(
        "no capacity within {after:?} (raise max_processes / max_sessions or the wait timeout)"
    )]
    WaitTimeout {
        /// How long the lease waited.
        after: Duration,
    },
    /// Too many leases are already waiting.
    #[error("{max} leases are already waiting for capacity (max_waiters)")]
    WaitersFull {
        /// The configured limit.
        max: usize,
    },
    /// The agent held `max_leases_per_agent` leases for the whole wait: its lease waited for
    /// one of its own conversations to return, and none did.
    #[error(
        "this agent already runs {max} conversations at once (max_leases_per_agent), and none \
         returned within {after:?}; wait for one of its turns to end, or raise \
         max_leases_per_agent"
    )]
    AgentLeasesFull {
        /// The configured limit.
        max: usize,
        /// How long the lease waited.
        after: Duration,
    },
    /// The agent keeps `max_conversations_per_agent` conversations: a new one is refused
    /// until one is deleted.
    #[error(
        "this agent already keeps or is opening {max} conversations \
         (max_conversations_per_agent); delete one it no longer needs (over HTTP \
         DELETE /v1/sessions/{{agent_id}}/{{session_key}}; through the SDK endpoint \
         deleteSession; in the library Lease::reset) and start this one again, or raise \
         max_conversations_per_agent"
    )]
    AgentConversationsFull {
        /// The configured limit.
        max: usize,
    },
    /// Too many leases of this agent are already waiting; other agents' still queue.
    #[error(
        "{max} leases of this agent are already waiting for capacity (max_waiters_per_agent); \
         retry when some are served, or raise max_waiters_per_agent"
    )]
    AgentWaitersFull {
        /// The configured limit.
        max: usize,
    },
    /// Another lease holds this conversation and the request asked not to queue.
    #[error(
        "conversation {session_key:?} is in use by another caller (one turn at a time); \
         retry when that is done (over HTTP: when its turn ends), or, in the library, lease \
         without fail_if_busy to wait in line"
    )]
    ConversationBusy {
        /// The conversation.
        session_key: String,
    },
    /// Another lease held this conversation for the whole wait.
    #[error(
        "conversation {session_key:?} stayed leased by another caller for {after:?}; drop \
         that lease (or end its turn) first, or raise the wait timeout"
    )]
    ConversationWaitTimeout {
        /// The conversation.
        session_key: String,
        /// How long the lease waited.
        after: Duration,
    },
    /// Resuming the session a caller pinned crashed the runtime repeatedly (and a pinned
    /// session cannot be started anew under its id): it is not resumed for a while.
    #[error(
        "resuming conversation {session_key:?} crashed its runtime repeatedly; it is not \
         resumed again for up to {window:?} after its last crash: retry then, or delete the \
         conversation to start it over"
    )]
    ResumeCrashedRepeatedly {
        /// The conversation.
        session_key: String,
        /// How long after the last crash resumes count as crashing.
        window: Duration,
    },
    /// The key's workers crashed too often; leases fail until the cool-down ends.
    #[error(
        "the workers of key {key_hash} crashed more than the restart intensity allows; \
         leases fail for another {retry_after:?} ({})",
        last_error.as_deref().map_or_else(
            || "the runtime's stderr is in the daemon's log, with its exit status".to_owned(),
            |e| format!("the last start failed: {e}")
        )
    )]
    RestartIntensityExceeded {
        /// The key's short hash.
        key_hash: String,
        /// Time left in the cool-down.
        retry_after: Duration,
        /// Why the key's last start failed, when a start failed.
        last_error: Option<String>,
    },
    /// A worker could not be started, or failed while serving the lease.
    #[error(transparent)]
    Worker(#[from] WorkerError),
    /// A CLI backend's turn could not start its process (its command missing, the OS
    /// refusing, its configuration, the agent's home): the backend's to fix, not the
    /// request's. The message says how.
    #[error("backend `{backend}` could not start the turn: {error}")]
    CliStart {
        /// The backend id.
        backend: String,
        /// What went wrong, and the fix.
        error: String,
    },
    /// A CLI backend's provider could not be checked before its turn (its host did not
    /// resolve in time): not the request's fault for certain, so a retry or a fallback may
    /// do. The message says what failed.
    #[error("{0}")]
    ProviderUnchecked(String),
    /// The turn failed, timed out, or was asked for in the wrong state.
    #[error(transparent)]
    Turn(TurnError),
    /// A bug: an internal task failed. The message says which.
    #[error("internal error: {0}; this is a bug, please report it")]
    Internal(String),
}

impl PoolError {
    /// What kind of failure this is: what the caller can do about it. Metrics and the HTTP
    /// layer both map from this.
    pub fn kind(&self) -> ErrorKind {
        match self {
            PoolError::Home(home) if !home.is_callers() => ErrorKind::StateUnwritable,
            // The agent's temporary directory could not be made: the machine's, not the
            // request's.
            PoolError::Sandbox(sandbox)
                if matches!(**sandbox, crate::sandbox::SandboxError::TempDir { .. }) =>
            {
                ErrorKind::StateUnwritable
            }
            PoolError::Auth(_)
            | PoolError::Home(_)
            | PoolError::InvalidRequest(_)
            | PoolError::Sandbox(_) => ErrorKind::Invalid,
            PoolError::NoSuchConversation { .. } | PoolError::TranscriptMissing { .. } => {
                ErrorKind::NotFound
            }
            PoolError::ConversationBusy { .. } => ErrorKind::Busy,
            PoolError::ConversationWaitTimeout { .. } => ErrorKind::BusyTimeout,
            PoolError::WaitTimeout { .. } => ErrorKind::NoCapacity,
            PoolError::AgentLeasesFull { .. } => ErrorKind::AgentLeasesFull,
            PoolError::AgentConversationsFull { .. } => ErrorKind::AgentConversationsFull,
            PoolError::WaitersFull { .. } => ErrorKind::WaitersFull,
            PoolError::AgentWaitersFull { .. } => ErrorKind::AgentWaitersFull,
            PoolError::RestartIntensityExceeded { .. }
            | PoolError::ResumeCrashedRepeatedly { .. } => ErrorKind::Quarantined,
            PoolError::Closed => ErrorKind::Closed,
            PoolError::Worker(WorkerError::ResourceExhausted(_)) => ErrorKind::ResourceExhausted,
            PoolError::StateUnwritable { .. }
            | PoolError::TranscriptUnremovable { .. }
            | PoolError::Bindings(_) => ErrorKind::StateUnwritable,
            PoolError::Internal(_) => ErrorKind::Internal,
            PoolError::Worker(_)
            | PoolError::Turn(_)
            | PoolError::CliStart { .. }
            | PoolError::ProviderUnchecked(_) => ErrorKind::Runtime,
        }
    }
}

impl From<crate::session_options::SessionOptionsError> for PoolError {
    /// Refused options are the caller's to fix; a broken embedded schema is a bug.
    fn from(e: crate::session_options::SessionOptionsError) -> Self {
        match e {
            crate::session_options::SessionOptionsError::Schema(_) => {
                PoolError::Internal(e.to_string())
            }
            e => PoolError::InvalidRequest(e.to_string()),
        }
    }
}

impl From<TurnError> for PoolError {
    /// A dead worker stays a worker error (the conversation resumes on a new lease); the rest
    /// are turn errors.
    fn from(e: TurnError) -> Self {
        match e {
            TurnError::Worker(e) => PoolError::Worker(e),
            e => PoolError::Turn(e),
        }
    }
}

impl From<crate::sandbox::SandboxError> for PoolError {
    fn from(e: crate::sandbox::SandboxError) -> Self {
        PoolError::Sandbox(Arc::new(e))
    }
}

impl From<HomeError> for PoolError {
    fn from(e: HomeError) -> Self {
        PoolError::Home(Arc::new(e))
    }
}

impl From<BindingError> for PoolError {
    fn from(e: BindingError) -> Self {
        PoolError::Bindings(e.to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_quarantine_says_why_the_last_start_failed_when_one_did() {
        let with = PoolError::RestartIntensityExceeded {
            key_hash: "h".into(),
            retry_after: Duration::from_secs(30),
            last_error: Some("cannot start the copilot runtime: no such file".into()),
        };
        assert!(
            with.to_string()
                .contains("the last start failed: cannot start the copilot runtime"),
            "{with}"
        );
        let without = PoolError::RestartIntensityExceeded {
            key_hash: "h".into(),
            retry_after: Duration::from_secs(30),
            last_error: None,
        };
        assert!(without.to_string().contains("daemon's log"), "{without}");
    }

    #[test]
    fn each_error_has_the_kind_a_caller_acts_on() {
        let home = |e: HomeError| PoolError::from(e);
        let cases = [
            (PoolError::InvalidRequest("x".into()), ErrorKind::Invalid),
            (
                home(HomeError::InvalidAgentId { shown: "A".into() }),
                ErrorKind::Invalid,
            ),
            // The machine's directories, not the request: the operator's to fix.
            (
                home(HomeError::Create {
                    path: "/x".into(),
                    source: std::io::Error::from_raw_os_error(28),
                }),
                ErrorKind::StateUnwritable,
            ),
            (
                PoolError::Bindings("EIO".into()),
                ErrorKind::StateUnwritable,
            ),
            (
                PoolError::NoSuchConversation {
                    session_key: "k".into(),
                    why: "w",
                },
                ErrorKind::NotFound,
            ),
            (
                PoolError::ConversationBusy {
                    session_key: "k".into(),
                },
                ErrorKind::Busy,
            ),
            (
                PoolError::ConversationWaitTimeout {
                    session_key: "k".into(),
                    after: Duration::ZERO,
                },
                ErrorKind::BusyTimeout,
            ),
            (
                PoolError::WaitTimeout {
                    after: Duration::ZERO,
                },
                ErrorKind::NoCapacity,
            ),
            (PoolError::WaitersFull { max: 1 }, ErrorKind::WaitersFull),
            (
                PoolError::AgentWaitersFull { max: 1 },
                ErrorKind::AgentWaitersFull,
            ),
            (
                PoolError::RestartIntensityExceeded {
                    key_hash: "h".into(),
                    retry_after: Duration::ZERO,
                    last_error: None,
                },
                ErrorKind::Quarantined,
            ),
            (PoolError::Closed, ErrorKind::Closed),
            (
                PoolError::Worker(WorkerError::ResourceExhausted("EMFILE".into())),
                ErrorKind::ResourceExhausted,
            ),
            (
                PoolError::StateUnwritable {
                    dir: "/s".into(),
                    error: "e".into(),
                },
                ErrorKind::StateUnwritable,
            ),
            (
                PoolError::TranscriptUnremovable {
                    path: "/h/t.jsonl".into(),
                    error: "e".into(),
                },
                ErrorKind::StateUnwritable,
            ),
            (PoolError::Worker(WorkerError::Stopped), ErrorKind::Runtime),
            (PoolError::Internal("x".into()), ErrorKind::Internal),
            (
                crate::sandbox::SandboxError::TempDir {
                    path: "/agents/a/tmp".into(),
                    source: std::io::Error::other("read-only file system"),
                }
                .into(),
                ErrorKind::StateUnwritable,
            ),
            (
                crate::sandbox::SandboxError::WorkingDirectoryOutside {
                    path: "/elsewhere".into(),
                    allowed: "/agents/a".into(),
                }
                .into(),
                ErrorKind::Invalid,
            ),
            (
                PoolError::ProviderUnchecked("x did not resolve".into()),
                ErrorKind::Runtime,
            ),
        ];
        for (error, kind) in cases {
            assert_eq!(error.kind(), kind, "{error:?}");
        }
        assert_eq!(
            ErrorKind::BusyTimeout.rejection_label(),
            "wait_timeout",
            "metrics keep their labels"
        );
    }
}
