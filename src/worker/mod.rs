//! One worker per CLI child: spawn, handshake, health, session routing, and failing all
//! in-flight work at once when the child dies.
//!
//! * [`WorkerConfig`] — what a worker runs (program, home, token, timeouts) and the child's
//!   argv and allowlisted environment.
//! * [`WorkerHandle`] — start a worker, call the runtime, open or resume sessions, stop it.
//! * [`Session`] — one conversation on a worker: its [`SessionUpdate`] stream and answers.
//! * [`WorkerError`], [`WorkerExit`] — typed failures; an exit carries the status or signal
//!   and the tail of stderr.
//!
//! The worker never chooses which worker serves a conversation (that is the pool's job).

mod actor;
mod config;
mod dispatch;
mod error;
mod handle;
mod health;
mod mailbox;
mod session;

pub use config::{
    AUTH_TOKEN_ENV, DEFAULT_HEALTH_MISSES, DEFAULT_MAX_UNREAD_ROUTE_BYTES, ENV_ALLOWLIST,
    TOKEN_VARIABLES, WorkerConfig,
};
pub use error::{ExitReason, WorkerError, WorkerExit};
pub use handle::{PendingKind, WorkerHandle, WorkerInfo};
pub use session::{
    Answerer, ClientCall, ServerRequest, Session, SessionUpdate, Settled, ToolResult,
};
