//! The gateway's hold on one conversation: a [`Lease`] on an attached CLI session, with the
//! basic turn API (send, events, wait for `session.idle`, abort). Dropping a lease returns
//! the conversation to the pool; dropping it with a turn in flight aborts that turn first.

use std::fmt;
use std::time::Duration;

use ractor::ActorRef;
use tokio::sync::OwnedMutexGuard;

use crate::rpc::{EventKind, SessionEvent};
use crate::worker::{Session, SessionUpdate};

use super::actor::{PoolMsg, WorkerId};
use super::error::PoolError;

/// How long a dropped lease waits for its aborted turn to reach `session.idle`.
const ABORT_ON_DROP_WAIT: Duration = Duration::from_secs(10);

/// How the lease's CLI session was opened.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum OpenReason {
    /// Still attached to the same worker since the last lease: nothing to resume.
    Attached,
    /// Resumed a stored session (new worker, crash, rotation, restart).
    Resumed,
    /// No binding: a new session.
    New,
    /// The binding's session state is gone from disk: a new session.
    TranscriptMissing,
    /// The runtime did not know the bound session: a new session.
    NotFound,
    /// Model, provider, working directory, home or account changed: a new session.
    CompatChanged,
}

impl OpenReason {
    /// Whether the conversation continued an existing CLI session.
    pub fn continued(self) -> bool {
        matches!(self, OpenReason::Attached | OpenReason::Resumed)
    }
}

/// What one turn produced.
#[derive(Debug, Clone, Default)]
pub struct TurnOutcome {
    /// The final assistant message of the main agent.
    pub text: String,
    /// The turn was aborted.
    pub aborted: bool,
    /// The turn's `session.error` message, if it failed.
    pub error: Option<String>,
    /// Events seen in the turn.
    pub events: usize,
}

/// Exclusive use of one conversation until dropped.
pub struct Lease {
    pub(crate) session: Option<Session>,
    pub(crate) session_key: String,
    pub(crate) cli_session_id: String,
    pub(crate) worker_id: WorkerId,
    pub(crate) worker_pid: u32,
    pub(crate) reason: OpenReason,
    pub(crate) pool: ActorRef<PoolMsg>,
    pub(crate) turn_in_flight: bool,
    pub(crate) turns: u64,
    pub(crate) lost: bool,
    /// One turn at a time per conversation: held for the lease's life.
    pub(crate) guard: Option<OwnedMutexGuard<()>>,
}

impl fmt::Debug for Lease {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Lease")
            .field("cli_session_id", &self.cli_session_id)
            .field("worker_pid", &self.worker_pid)
            .field("reason", &self.reason)
            .finish_non_exhaustive()
    }
}

impl Lease {
    /// The gateway's conversation key.
    pub fn session_key(&self) -> &str {
        &self.session_key
    }

    /// The CLI session id.
    pub fn cli_session_id(&self) -> &str {
        &self.cli_session_id
    }

    /// The pid of the process serving the conversation.
    pub fn worker_pid(&self) -> u32 {
        self.worker_pid
    }

    /// How the session was opened.
    pub fn reason(&self) -> OpenReason {
        self.reason
    }

    /// Whether a stored session was resumed for this lease.
    pub fn resumed(&self) -> bool {
        self.reason == OpenReason::Resumed
    }

    /// Starts a turn. Its events follow through [`Lease::next_event`].
    pub async fn send(&mut self, prompt: impl Into<String>) -> Result<(), PoolError> {
        if self.turn_in_flight {
            return Err(PoolError::TurnState(
                "a turn is already running on this lease",
            ));
        }
        let session = self.session_mut()?;
        // Leftovers of earlier activity (late events of an aborted turn) are not this turn's.
        while session.try_next().is_some() {}
        session.send(prompt).await.map_err(|e| self.lose(e))?;
        self.turn_in_flight = true;
        Ok(())
    }

    /// The next event of the running turn; `None` once the turn ended (after its
    /// `session.idle`) or when no turn runs. A dead worker yields one `Err`.
    pub async fn next_event(&mut self) -> Option<Result<SessionEvent, PoolError>> {
        if !self.turn_in_flight {
            return None;
        }
        let session = self.session.as_mut()?;
        loop {
            match session.next().await {
                Some(SessionUpdate::Event(event)) => {
                    if matches!(event.kind, EventKind::SessionIdle(_)) {
                        self.turn_in_flight = false;
                        self.turns += 1;
                    }
                    return Some(Ok(event));
                }
                // Hooks get the SDK default; nobody answers questions yet (the turn API of
                // the next issue adds handlers).
                Some(SessionUpdate::Hook(hook)) => drop(hook),
                Some(SessionUpdate::UserInput(request)) => {
                    request.fail("this lease has no user-input handler")
                }
                Some(SessionUpdate::Ended(error)) => {
                    self.turn_in_flight = false;
                    return Some(Err(self.lose(error)));
                }
                None => {
                    self.turn_in_flight = false;
                    self.lost = true;
                    return Some(Err(PoolError::TurnState("the session stream ended")));
                }
            }
        }
    }

    /// Sends `prompt` and waits for the turn to end.
    pub async fn run(&mut self, prompt: impl Into<String>) -> Result<TurnOutcome, PoolError> {
        self.send(prompt).await?;
        self.wait_idle().await
    }

    /// Waits for the running turn to end and summarises it.
    pub async fn wait_idle(&mut self) -> Result<TurnOutcome, PoolError> {
        let mut outcome = TurnOutcome::default();
        while let Some(event) = self.next_event().await {
            let event = event?;
            outcome.events += 1;
            match event.kind {
                EventKind::AssistantMessage(m)
                    if event.agent_id.is_none() && !m.content.is_empty() =>
                {
                    outcome.text = m.content;
                }
                EventKind::SessionError(e) => outcome.error = Some(e.message),
                EventKind::SessionIdle(idle) => outcome.aborted = idle.aborted == Some(true),
                _ => {}
            }
        }
        Ok(outcome)
    }

    /// Aborts the running turn; it still ends with `session.idle {aborted: true}`.
    pub async fn abort(&mut self) -> Result<(), PoolError> {
        let session = self.session_mut()?;
        session.abort().await.map_err(|e| self.lose(e))
    }

    fn session_mut(&mut self) -> Result<&mut Session, PoolError> {
        if self.lost {
            return Err(PoolError::TurnState(
                "this lease's worker is gone; take a new lease",
            ));
        }
        self.session
            .as_mut()
            .ok_or(PoolError::TurnState("this lease has no session"))
    }

    fn lose(&mut self, error: crate::worker::WorkerError) -> PoolError {
        if matches!(
            error,
            crate::worker::WorkerError::Died(_) | crate::worker::WorkerError::Stopped
        ) {
            self.lost = true;
        }
        PoolError::Worker(error)
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        let session = if self.lost { None } else { self.session.take() };
        let ret = ReturnTicket {
            pool: self.pool.clone(),
            session_key: std::mem::take(&mut self.session_key),
            worker_id: self.worker_id,
            turns: self.turns,
            guard: self.guard.take(),
        };
        match (
            self.turn_in_flight,
            session,
            tokio::runtime::Handle::try_current(),
        ) {
            (true, Some(mut session), Ok(rt)) => {
                // A turn is running: abort it and wait for its end before returning.
                rt.spawn(async move {
                    let ended = tokio::time::timeout(ABORT_ON_DROP_WAIT, async {
                        if session.abort().await.is_err() {
                            return false;
                        }
                        while let Some(update) = session.next().await {
                            match update {
                                SessionUpdate::Event(e)
                                    if matches!(e.kind, EventKind::SessionIdle(_)) =>
                                {
                                    return true;
                                }
                                SessionUpdate::Ended(_) => return false,
                                _ => {}
                            }
                        }
                        false
                    })
                    .await;
                    ret.send(if matches!(ended, Ok(true)) {
                        Some(session)
                    } else {
                        None
                    });
                });
            }
            (true, _, _) => ret.send(None),
            (false, session, _) => ret.send(session),
        }
    }
}

/// Everything needed to give a conversation back to the pool.
struct ReturnTicket {
    pool: ActorRef<PoolMsg>,
    session_key: String,
    worker_id: WorkerId,
    turns: u64,
    guard: Option<OwnedMutexGuard<()>>,
}

impl ReturnTicket {
    fn send(self, session: Option<Session>) {
        let _ = self.pool.cast(PoolMsg::Return {
            session_key: self.session_key,
            worker_id: self.worker_id,
            session,
            turns: self.turns,
        });
        // The conversation lock is released only after the return is queued, so the next
        // lease of this conversation is handled after it.
        drop(self.guard);
    }
}
