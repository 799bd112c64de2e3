//! The gateway's hold on one conversation: a [`Lease`] on an attached CLI session with the
//! turn API (send, events, wait for `session.idle`, abort, compact). Tools, permission
//! prompts, ask_user and hooks are answered by the conversation's handlers while events
//! are pulled; the pool's timeouts end any turn that would hang. Dropping a lease returns
//! the conversation to the pool; dropping it with a turn in flight aborts that turn first.

use std::fmt;

use ractor::ActorRef;

use crate::ids::CliSessionId;
use crate::rpc::messages::CompactResult;
use crate::rpc::{EventKind, RpcError, SessionEvent};
use crate::transcript::Transcript;
use crate::turn::driver::{DrainedEntry, TurnDriver, mirror_drained};
use crate::turn::{Message, TurnError, TurnOutcome};
use crate::worker::{Session, Settled, WorkerError};

pub use crate::kinds::OpenReason;

use super::WhileHeld;
use super::actor::{PoolMsg, Settle, WorkerId};
use super::error::PoolError;

/// Exclusive use of one conversation until dropped.
pub struct Lease {
    pub(crate) session: Option<Session>,
    /// The pool's conversation id (`<agent_id>/<session_key>`).
    pub(crate) conversation: String,
    /// The gateway's session key.
    pub(crate) session_key: String,
    pub(crate) cli_session_id: CliSessionId,
    pub(crate) worker_id: WorkerId,
    pub(crate) worker_pid: u32,
    pub(crate) reason: OpenReason,
    pub(crate) pool: ActorRef<PoolMsg>,
    pub(crate) driver: TurnDriver,
    pub(crate) turns: u64,
    /// Turns started on this lease (the first one reports the lease's open reason).
    pub(crate) sent: u64,
    pub(crate) lost: bool,
    /// The session may still be busy or attached in its process and cannot be detached with
    /// confirmation (a delete that failed): the pool stops the process.
    pub(crate) unsettled: bool,
    /// A `session.send` is written or on its way and its answer not in: the runtime may have
    /// started the turn, so a lease dropped meanwhile aborts it as a running one.
    pub(crate) sending: bool,
    /// The pool's binding store (for `reset`).
    pub(crate) bindings: std::sync::Arc<super::bindings::BindingStore>,
    /// The conversation's `COPILOT_HOME` (canonical).
    pub(crate) copilot_home: std::path::PathBuf,
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
    pub fn cli_session_id(&self) -> &CliSessionId {
        &self.cli_session_id
    }

    /// The pid of the process serving the conversation.
    pub fn worker_pid(&self) -> u32 {
        self.worker_pid
    }

    /// The actor of the worker serving the conversation, e.g. to kill it in a fault test
    /// (ractor plumbing, out of the documented surface, as [`crate::worker::WorkerHandle::actor`]).
    #[doc(hidden)]
    pub fn worker_actor(&self) -> Option<ractor::ActorCell> {
        self.session.as_ref().map(|s| s.worker().actor())
    }

    /// How the session was opened.
    pub fn reason(&self) -> OpenReason {
        self.reason
    }

    /// Whether the lease keeps a transcript mirror: configured, and opened (a best-effort
    /// mirror whose open failed keeps none).
    pub(crate) fn mirrors_transcript(&self) -> bool {
        self.driver.mirrors_transcript()
    }

    /// The conversation's `COPILOT_HOME` (canonical): where the runtime keeps its own state
    /// of the session (`session-state/<session id>/events.jsonl`).
    pub fn copilot_home(&self) -> &std::path::Path {
        &self.copilot_home
    }

    /// The directory the session was opened in: the conversation's working directory (for a
    /// lease to delete it, the one its binding recorded when it did, and the agent's home
    /// when that is gone or no longer allowed), where its inline attachments are.
    pub(crate) fn working_directory(&self) -> &std::path::Path {
        self.driver.working_directory()
    }

    /// Whether a stored session was resumed for this lease.
    pub fn resumed(&self) -> bool {
        self.reason == OpenReason::Resumed
    }

    /// Whether the runtime reported, when this lease's session was opened, that another
    /// process still had it attached (`alreadyInUse`). The pool's one-owner rule keeps this
    /// false; true would mean two processes append to one history.
    pub fn already_in_use(&self) -> bool {
        self.session.as_ref().is_some_and(Session::already_in_use)
    }

    /// Starts a turn with `message` (a prompt, or a [`Message`] with attachments, delivery
    /// mode and agent mode). Its events follow through [`Lease::next_event`]. A message
    /// [`Message::validate`] refuses is `PoolError::InvalidRequest`, and nothing is sent. A
    /// send that got no answer in time (or one the pool could not read) is an error, but the
    /// runtime may run the turn all the same: it counts as running, so read it to its end
    /// with [`Lease::wait_idle`] or drop the lease (which aborts it).
    pub async fn send(&mut self, message: impl Into<Message>) -> Result<(), PoolError> {
        if self.driver.in_flight() {
            return Err(state_error("a turn is already running on this lease"));
        }
        let message = message.into();
        message
            .validate()
            .map_err(|e| PoolError::InvalidRequest(e.to_string()))?;
        if let Some(session) = &self.session {
            self.driver.leave_unread(session);
        }
        // Leftovers of earlier activity (late events of an aborted turn, a compaction the
        // runtime finished between turns) are not this turn's: requests among them are
        // refused so the runtime never waits on them, what they add to the history is
        // mirrored, and a compaction that ended among them fires its hooks.
        self.driver.prepare();
        let session = self.session_mut()?;
        let between = session.take_waiting();
        self.take_in(between)?;
        self.sending = true;
        let sent = match self.session_mut() {
            Ok(session) => session.send_message(message.into_params()).await,
            Err(error) => {
                self.sending = false;
                return Err(error);
            }
        };
        self.sending = false;
        if let Err(error) = sent {
            // No answer in time, or one the pool could not read: the runtime may run the
            // turn all the same, so it is treated as running (a drop aborts it).
            if matches!(
                error,
                WorkerError::Rpc(RpcError::Timeout { .. } | RpcError::Decode { .. })
            ) {
                self.driver.begin();
            }
            return Err(self.lose(error));
        }
        self.driver.begin();
        self.sent += 1;
        Ok(())
    }

    /// The next event of the running turn; `None` once the turn ended (after its
    /// `session.idle`) or when no turn runs. While events are pulled, gateway tools,
    /// permission prompts, ask_user and hooks are answered and the timeouts enforced; a
    /// timeout, a dead worker or a strict transcript failure yields one `Err`.
    pub async fn next_event(&mut self) -> Option<Result<SessionEvent, PoolError>> {
        let session = self.session.as_mut()?;
        let item = self.driver.next(session).await?;
        match item {
            Ok(event) => {
                if matches!(event.kind, EventKind::SessionIdle(_)) {
                    self.turns += 1;
                }
                Some(Ok(event))
            }
            Err(TurnError::Worker(e)) => Some(Err(self.lose(e))),
            Err(e) => {
                // A turn ended by a timeout or a transcript failure still counts as a turn.
                self.turns += 1;
                if self.driver.poisoned() {
                    self.lost = true;
                }
                Some(Err(PoolError::Turn(e)))
            }
        }
    }

    /// Sends `message` (a prompt, or a [`Message`]) and waits for the turn to end.
    pub async fn run(&mut self, message: impl Into<Message>) -> Result<TurnOutcome, PoolError> {
        self.send(message).await?;
        self.wait_idle().await
    }

    /// Waits for the running turn to end. A turn the runtime reports failed
    /// (`session.error`) is `Err(TurnFailed)` with its status code; an aborted turn is `Ok`
    /// with `aborted` set.
    pub async fn wait_idle(&mut self) -> Result<TurnOutcome, PoolError> {
        while let Some(event) = self.next_event().await {
            event?;
        }
        let outcome = self.outcome();
        if outcome.end == Some(crate::kinds::TurnEnd::Error) {
            return Err(PoolError::Turn(TurnError::Failed {
                message: outcome.error.clone().unwrap_or_default(),
                status_code: outcome.status_code,
                error_type: outcome.error_type.clone(),
            }));
        }
        Ok(outcome)
    }

    /// The bytes of the conversation's events waiting to be read ([`Lease::next_event`]):
    /// how far the caller is behind the runtime. Past the lease's
    /// [`crate::turn::TurnHandlers::max_unread_event_bytes`] the running turn is aborted.
    pub fn unread_event_bytes(&self) -> usize {
        self.session.as_ref().map_or(0, |s| s.unread_bytes())
    }

    /// The outcome of the current or last turn, as tallied so far.
    pub fn outcome(&self) -> TurnOutcome {
        let mut outcome = self.driver.outcome();
        outcome.open_reason = Some(if self.sent <= 1 {
            self.reason
        } else {
            OpenReason::Attached
        });
        outcome
    }

    /// Aborts the running turn; it still ends with `session.idle {aborted: true}` through
    /// [`Lease::next_event`], and a pending ask_user question is cancelled with it.
    pub async fn abort(&mut self) -> Result<(), PoolError> {
        let session = self.session_mut()?;
        session.abort().await.map_err(|e| self.lose(e))
    }

    /// Compacts the conversation (`session.history.compact`), focused by
    /// `custom_instructions`. The runtime reports the compaction in its events, as it does a
    /// background one: before this returns, the `before_compaction` and `after_compaction`
    /// hooks are started, in that order, once the compaction happened (`success`; one that
    /// did not, with nothing to compact or a failure, fires neither), and its summary is
    /// mirrored (role `summary`). A conversation with nothing to compact (no turn yet, or
    /// right after an abort), which the runtime refuses as an error, is `success: false`
    /// with nothing removed: not a failure of the runtime.
    pub async fn compact(
        &mut self,
        custom_instructions: Option<String>,
    ) -> Result<CompactResult, PoolError> {
        if self.driver.in_flight() {
            return Err(state_error("compact between turns, not during one"));
        }
        let session = self.session_mut()?;
        let result = match session.compact(custom_instructions).await {
            Ok(result) => result,
            Err(e) if nothing_to_compact(&e) => {
                return Ok(CompactResult {
                    success: false,
                    tokens_removed: Some(0),
                    messages_removed: Some(0),
                    summary_content: None,
                });
            }
            Err(e) => return Err(self.lose(e)),
        };
        // The runtime reports the compaction in events sent before its answer: routed once
        // the worker is flushed, and taken in as any (the hooks fire once, the summary is
        // mirrored; the fallback prelude starts from it, `crate::fallback`). Events routed
        // late are taken in as the next turn starts.
        let session = self.session_mut()?;
        if session.worker().flush().await.is_ok() {
            let events = session.take_waiting();
            self.take_in(events)?;
        }
        Ok(result)
    }

    /// Forgets the conversation: deletes the CLI session and the binding. The next lease of
    /// this `session_key` starts a new session. When the runtime refuses the deletion, the
    /// binding stays (its process is stopped): a retry finds the conversation and deletes it,
    /// where a binding removed first left the runtime's session files for good.
    ///
    /// The deletion runs to its end in a task of its own, even when the caller stops waiting
    /// (a client that hangs up mid-DELETE): cut off between the runtime's delete and the
    /// binding's removal, the lease's drop would hand the conversation on while the runtime
    /// still deleted it (another process could resume what is being deleted) and leave the
    /// binding of a deleted session behind.
    pub async fn reset(self) -> Result<(), PoolError> {
        self.reset_then(None).await
    }

    /// [`Lease::reset`], with the caller's own clean-up of the conversation's working
    /// directory (its inline attachments) run once the runtime's session is gone, while the
    /// conversation is still held: never when the runtime refused the deletion (the
    /// conversation stays, and a retry finds what its turns were given), and before a turn
    /// let in after the deletion could write its own there.
    pub(crate) async fn reset_then(self, while_held: Option<WhileHeld>) -> Result<(), PoolError> {
        let deleting = tracing::Instrument::instrument(
            self.reset_to_its_end(while_held),
            tracing::Span::current(),
        );
        match tokio::spawn(deleting).await {
            Ok(result) => result,
            Err(join) => Err(PoolError::Internal(format!(
                "the conversation's deletion failed: {join}"
            ))),
        }
    }

    async fn reset_to_its_end(mut self, while_held: Option<WhileHeld>) -> Result<(), PoolError> {
        if self.driver.in_flight() {
            return Err(state_error("reset between turns, not during one"));
        }
        let session = self
            .session
            .take()
            .ok_or(state_error("this lease has no session"))?;
        // The conversation is not parked again: the return gives no session back.
        self.lost = true;
        let worker = session.worker().clone();
        // A process that went (or finished stopping) during the deletion holds nothing: the
        // binding goes as after a deletion (a retry would resume what may be half deleted).
        let deleted = session.delete().await;
        if let Err(error) = super::holds_nothing_after(deleted, &worker).await {
            // The runtime may still hold the session: its process is stopped on drop, and
            // the binding stays for a retry.
            self.unsettled = true;
            return Err(PoolError::Worker(error));
        }
        if let Some(while_held) = while_held {
            while_held(self.working_directory().to_path_buf()).await;
        }
        let store = self.bindings.clone();
        let key = self.conversation.clone();
        let removed = tokio::task::spawn_blocking(move || store.remove(&key))
            .await
            .map_err(|e| e.to_string())
            .and_then(|removed| removed.map_err(|e| e.to_string()));
        // The runtime's session is gone already: the caller is told so, and that a retry
        // (once the state directory is writable) removes what is left.
        removed.map_err(|error| {
            PoolError::Bindings(format!(
                "the conversation's session was deleted, but its binding could not be \
                 removed: {error}; make the state directory writable and delete the \
                 conversation again"
            ))
        })
    }

    /// The session itself, for a caller that passes every update on to its own client
    /// instead of running turns through the driver (the SDK endpoint). Such a caller counts
    /// its turns with [`Lease::turn_passed`] and reports an aborted turn that did not settle
    /// with [`Lease::set_unsettled`].
    #[cfg(feature = "sdk-endpoint")]
    pub(crate) fn passthrough(&mut self) -> Result<&mut Session, PoolError> {
        self.session_mut()
    }

    /// A turn run through [`Lease::passthrough`] reached `session.idle` (counts towards the
    /// process's turn limit).
    #[cfg(feature = "sdk-endpoint")]
    pub(crate) fn turn_passed(&mut self) {
        self.turns += 1;
    }

    /// A turn run through [`Lease::passthrough`] was aborted and did not settle: the pool
    /// stops the process when the lease is dropped.
    #[cfg(feature = "sdk-endpoint")]
    pub(crate) fn set_unsettled(&mut self) {
        self.unsettled = true;
    }

    /// The worker is gone (or the session must not be reused): the lease's drop detaches
    /// what is left instead of parking it.
    #[cfg(feature = "sdk-endpoint")]
    pub(crate) fn set_lost(&mut self) {
        self.lost = true;
    }

    /// [`TurnDriver::take_in`] of `events`, read outside a turn from this lease's session.
    fn take_in(&mut self, events: Vec<SessionEvent>) -> Result<(), PoolError> {
        let Some(session) = self.session.as_mut() else {
            return Ok(());
        };
        self.driver
            .take_in(session, events)
            .map_err(PoolError::Turn)
    }

    fn session_mut(&mut self) -> Result<&mut Session, PoolError> {
        if self.lost {
            return Err(state_error(
                "this lease's worker is gone; take a new lease (the conversation resumes)",
            ));
        }
        self.session
            .as_mut()
            .ok_or(state_error("this lease has no session"))
    }

    fn lose(&mut self, error: WorkerError) -> PoolError {
        if matches!(error, WorkerError::Died(_) | WorkerError::Stopped) {
            self.lost = true;
        }
        PoolError::Worker(error)
    }
}

/// A turn call in the wrong state (the message says which).
fn state_error(message: &'static str) -> PoolError {
    PoolError::Turn(TurnError::State(message))
}

impl Drop for Lease {
    fn drop(&mut self) {
        // What this lease left unread is read again before the conversation goes back.
        self.driver.forget_unread();
        if self.sending {
            // Dropped while its `session.send` was out: the runtime may be running the turn.
            self.driver.begin();
        }
        let session = self.session.take();
        let mut ret = ReturnTicket {
            pool: self.pool.clone(),
            conversation: std::mem::take(&mut self.conversation),
            worker_id: self.worker_id,
            turns: self.turns,
            transcript: self.driver.take_transcript(),
        };
        if self.unsettled || self.driver.poisoned() {
            // A turn that did not reach `session.idle` after its abort (a timeout), or a
            // reset whose delete failed: the process may still run or hold the session, so
            // the pool stops it before the conversation moves.
            return ret.send(session, Settle::Unsettled);
        }
        let Some(mut session) = session else {
            return ret.send(None, Settle::Detach);
        };
        if self.lost {
            // Its worker is gone, or the conversation must not be reused (a failed strict
            // transcript): the pool detaches what is left with confirmation.
            return ret.send(Some(session), Settle::Detach);
        }
        if !self.driver.in_flight() {
            return ret.send(Some(session), Settle::Park);
        }
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            // No runtime to abort the turn on: the process is stopped instead.
            return ret.send(Some(session), Settle::Unsettled);
        };
        // A turn is running: abort it and wait for its end before returning. A turn that
        // does not end in time leaves the process in an unknown state: the pool stops it
        // before the conversation is granted anywhere else.
        // What the runtime produced and the caller never read is mirrored on the way.
        let wait = self.driver.abort_drain();
        // What a drain cut short (the caller gone mid-abort) already read comes first.
        let mut drained = self.driver.take_drained();
        rt.spawn(async move {
            let seen = |event: &SessionEvent| drained.extend(DrainedEntry::of(event));
            let settle = match session.abort_and_settle_seeing(wait, seen).await {
                Settled::Idle => Settle::Park,
                Settled::WorkerEnded | Settled::Unsettled => Settle::Unsettled,
            };
            mirror_drained(&mut ret.transcript, drained);
            ret.send(Some(session), settle);
        });
    }
}

/// Everything needed to give a conversation back to the pool.
struct ReturnTicket {
    pool: ActorRef<PoolMsg>,
    conversation: String,
    worker_id: WorkerId,
    turns: u64,
    /// The lease's transcript mirror, kept through an aborted turn's drain (which mirrors
    /// what the caller never read) and closed before the conversation goes back, so the
    /// next lease finds its cache entry (and reads only what is new).
    transcript: Option<Transcript>,
}

impl ReturnTicket {
    fn send(self, session: Option<Session>, settle: Settle) {
        drop(self.transcript);
        let _ = self.pool.cast(PoolMsg::Return {
            conversation: self.conversation,
            worker_id: self.worker_id,
            session,
            settle,
            turns: self.turns,
        });
        // The conversation stays leased in the actor until it handles this return; the next
        // lease of it waits there until then.
    }
}

/// The runtime's refusal of a compaction with nothing to compact (its words: "Nothing to
/// compact."; `session.history.compact` has no error code of its own for it).
fn nothing_to_compact(error: &WorkerError) -> bool {
    matches!(
        error,
        WorkerError::Rpc(crate::rpc::RpcError::Remote { error, .. })
            if error.message.to_ascii_lowercase().contains("nothing to compact")
    )
}
