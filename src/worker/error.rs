//! Why a worker operation failed, and why a worker ended.

use std::fmt;
use std::time::Duration;

use crate::process::{ExitInfo, SpawnError};
use crate::rpc::RpcError;

/// How much of the stderr tail goes into an error's message (the full tail is in the field).
const STDERR_IN_MESSAGE: usize = 2048;

/// What of a child's stderr tail goes into an error's message: its last
/// [`STDERR_IN_MESSAGE`] bytes, trimmed, with any credentials in URLs taken out.
pub(crate) fn stderr_in_message(tail: &str) -> String {
    let tail = tail.trim();
    let start = tail.len().saturating_sub(STDERR_IN_MESSAGE);
    let start = (start..tail.len())
        .find(|i| tail.is_char_boundary(*i))
        .unwrap_or(tail.len());
    crate::secret::without_url_credentials(&tail[start..])
}

/// Why a worker ended.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum ExitReason {
    /// The child exited on its own or was killed from outside.
    ChildExited(ExitInfo),
    /// The child closed its stdout; `exit` is how it ended, if it did in time.
    TransportClosed(Option<ExitInfo>),
    /// The child sent something that is not a valid frame or JSON-RPC message.
    ProtocolViolation(String),
    /// The child missed `misses` health pings in a row (none answered within `timeout`) and
    /// was killed.
    Hung {
        /// Pings in a row that went unanswered.
        misses: u32,
        /// How long each of them was given.
        timeout: Duration,
    },
    /// The worker actor was killed or panicked; its child was killed with it.
    Killed,
    /// The worker was asked to stop.
    Shutdown,
}

impl fmt::Display for ExitReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ExitReason::ChildExited(info) => write!(f, "the runtime exited ({info})"),
            ExitReason::TransportClosed(Some(info)) => {
                write!(f, "the runtime closed its output and exited ({info})")
            }
            ExitReason::TransportClosed(None) => f.write_str("the runtime closed its output"),
            ExitReason::ProtocolViolation(d) => write!(f, "the runtime broke the protocol: {d}"),
            ExitReason::Hung { misses, timeout } => {
                let pings = if *misses == 1 {
                    "ping"
                } else {
                    "pings in a row"
                };
                write!(
                    f,
                    "the runtime was hung: it did not answer {misses} health {pings} within \
                     {timeout:?} each (stopped, deadlocked or starved), so it was killed; if \
                     the machine is only overloaded, raise the health timeout or misses"
                )
            }
            ExitReason::Killed => f.write_str("the worker actor was killed or panicked"),
            ExitReason::Shutdown => f.write_str("the worker was shut down"),
        }
    }
}

/// The end of a worker: why, which process, and what it last wrote to stderr.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub struct WorkerExit {
    /// Why it ended.
    pub reason: ExitReason,
    /// The child's pid (also its process group).
    pub pid: u32,
    /// The last bytes of the child's stderr (up to 64 KiB).
    pub stderr_tail: String,
}

impl WorkerExit {
    /// The child's exit status, when known.
    pub fn exit_info(&self) -> Option<ExitInfo> {
        match &self.reason {
            ExitReason::ChildExited(info) => Some(*info),
            ExitReason::TransportClosed(info) => *info,
            _ => None,
        }
    }

    /// True for a requested stop, false for a crash, hang or protocol failure.
    pub fn is_shutdown(&self) -> bool {
        self.reason == ExitReason::Shutdown
    }
}

impl fmt::Display for WorkerExit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "copilot worker (pid {}) ended: {}",
            self.pid, self.reason
        )?;
        let tail = stderr_in_message(&self.stderr_tail);
        if !tail.is_empty() {
            write!(f, "; stderr tail: {tail}")?;
        }
        Ok(())
    }
}

/// Why a worker operation failed.
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum WorkerError {
    /// The configuration cannot work; the message says what to change.
    #[error("invalid worker configuration: {0}")]
    Config(String),
    /// The runtime could not be started.
    #[error("cannot start the copilot runtime: {0}")]
    Spawn(String),
    /// The runtime could not be started because the machine or this process ran out of a
    /// resource (file descriptors, processes, memory). Not the runtime's fault: it is never
    /// counted as a crash.
    #[error(
        "cannot start the copilot runtime, out of resources: {0}; raise the open-file limit \
         (ulimit -n / RLIMIT_NOFILE) or the process and memory limits, or lower max_processes"
    )]
    ResourceExhausted(String),
    /// The runtime started but the `connect` handshake failed.
    #[error("handshake with the copilot runtime failed: {0}")]
    Handshake(String),
    /// The runtime speaks another protocol version.
    #[error(
        "the copilot runtime {runtime_version} speaks protocol version {got}; copilot-pool \
         speaks {supported} only. Install the pinned runtime with `copilot-pool install-cli`"
    )]
    ProtocolVersion {
        /// What the runtime reported.
        got: u32,
        /// What we speak.
        supported: u32,
        /// The runtime's version string.
        runtime_version: String,
    },
    /// The worker's child is gone: crashed, killed, hung or broke the protocol.
    #[error(transparent)]
    Died(WorkerExit),
    /// The worker was shut down while the operation was in flight.
    #[error("the worker was shut down")]
    Stopped,
    /// A request to the runtime failed (error answer, timeout).
    #[error(transparent)]
    Rpc(RpcError),
    /// The session is already open on this worker.
    #[error("session {0} is already open on this worker")]
    SessionAlreadyOpen(String),
    /// An answer named a pending request this conversation does not have.
    #[error("session {session_id} has no pending {kind} request {request_id}")]
    NoSuchPendingRequest {
        /// `tool call` or `permission`.
        kind: &'static str,
        /// The session that tried to answer.
        session_id: String,
        /// The request id it named.
        request_id: String,
    },
}

impl From<SpawnError> for WorkerError {
    fn from(e: SpawnError) -> Self {
        if e.is_resource_exhaustion() {
            WorkerError::ResourceExhausted(e.to_string())
        } else {
            WorkerError::Spawn(e.to_string())
        }
    }
}
