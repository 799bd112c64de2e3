//! The turn API a gateway programs against: the handlers a conversation brings (tools,
//! permission policy, ask_user, hooks), the timeouts the pool owns, the transcript mirror
//! settings, and what a turn produced. `driver` runs one turn over a session.
//!
//! * [`tools`] — [`GatewayTool`]: name, schema, async handler, sequential or concurrent.
//! * [`user_input`] — [`UserInputHandler`] and how answers map onto the wire.
//! * [`hooks`] — [`TurnHooks`], fed from `hooks.invoke` and the event stream.
//! * [`message`] — [`Message`]: what a turn sends (prompt, attachments, mode, agent mode).
//! * [`TurnError`] — why a turn failed (the pool carries it as `PoolError::Turn`).
//! * `crate::permission` — the permission policy (fail closed by default).
//! * `crate::transcript` — the JSONL mirror.

pub(crate) mod driver;
mod error;
pub mod hooks;
pub mod message;
pub mod tools;
pub mod user_input;

use std::fmt;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use serde::Serialize;
use serde_json::Value;

use crate::faults::SharedDiskFaults;
use crate::kinds::TokenKind;
use crate::permission::{PermissionPolicy, RejectAll};
use crate::transcript::{
    Transcript, TranscriptCache, TranscriptError, TranscriptMode, transcript_path,
};

pub use error::TurnError;
pub use hooks::TurnHooks;
pub use message::{Message, MessageError};
pub use tools::{GatewayTool, ToolCall, ToolConcurrency, ToolHandler};
pub use user_input::{Answer, Question, UserInputHandler};

/// Timeouts the pool owns for every turn. The runtime waits forever for an unanswered tool
/// call; with these no turn can hang.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TurnTimeouts {
    /// No event for this long (while nothing is pending on our side) ends the turn.
    pub inactivity: Duration,
    /// A turn never runs longer than this.
    pub absolute: Duration,
    /// A gateway tool call (unless the tool sets its own).
    pub tool: Duration,
    /// A permission decision of the policy.
    pub permission: Duration,
    /// An ask_user question; on expiry the question gets an empty free-form answer.
    pub user_input: Duration,
    /// A hook; on expiry the runtime gets `{}`.
    pub hook: Duration,
}

impl Default for TurnTimeouts {
    /// Inactivity 2 min, absolute 30 min, tool 10 min, permission 1 min, ask_user 15 min,
    /// hook 30 s.
    fn default() -> Self {
        Self {
            inactivity: Duration::from_secs(120),
            absolute: Duration::from_secs(1800),
            tool: Duration::from_secs(600),
            permission: Duration::from_secs(60),
            user_input: Duration::from_secs(900),
            hook: Duration::from_secs(30),
        }
    }
}

/// Where and how a conversation's transcript is mirrored, and what has been read of its
/// files so far.
///
/// Clones share one [`TranscriptCache`]: give every lease a clone of the same settings, and
/// a lease reads only the lines its conversation's file gained since the previous lease
/// (nothing, when that lease wrote them) instead of the whole file. Equality compares `dir`
/// and `mode` only.
#[derive(Debug, Clone)]
pub struct TranscriptSettings {
    /// Directory of the `copilot-<sessionId>.jsonl` files.
    pub dir: PathBuf,
    /// Best effort or strict.
    pub mode: TranscriptMode,
    cache: TranscriptCache,
    /// Writes this plan fails on purpose (chaos runs); `None`: none.
    disk_faults: Option<SharedDiskFaults>,
}

impl TranscriptSettings {
    /// Mirrors into `dir` in `mode`, with a new, empty cache.
    pub fn new(dir: impl Into<PathBuf>, mode: TranscriptMode) -> Self {
        TranscriptSettings {
            dir: dir.into(),
            mode,
            cache: TranscriptCache::new(),
            disk_faults: None,
        }
    }

    /// Fails the transcript writes `plan` says to fail, as a failing disk would (chaos runs).
    pub fn with_disk_faults(mut self, plan: SharedDiskFaults) -> Self {
        self.disk_faults = Some(plan);
        self
    }

    /// The cache shared by these settings and their clones.
    pub fn cache(&self) -> &TranscriptCache {
        &self.cache
    }

    /// Opens the transcript of `session_id` through the cache
    /// ([`Transcript::open_cached`]) on a blocking thread, so the disk never holds up an
    /// async worker thread. What a lease does before its first turn.
    pub async fn open(&self, session_id: &str) -> Result<Transcript, TranscriptError> {
        let path = transcript_path(&self.dir, session_id)?;
        let (dir, mode, cache) = (self.dir.clone(), self.mode, self.cache.clone());
        let faults = self.disk_faults.clone();
        let session_id = session_id.to_owned();
        tokio::task::spawn_blocking(move || {
            let mut transcript = Transcript::open_cached(&dir, &session_id, mode, &cache)?;
            transcript.set_disk_faults(faults);
            Ok(transcript)
        })
        .await
        .unwrap_or_else(|join_error| {
            Err(TranscriptError::Open {
                path,
                source: std::io::Error::other(format!(
                    "the blocking task opening it did not finish: {join_error}"
                )),
            })
        })
        // A mirror that cannot be opened loses every write of the lease: counted like a
        // failed write (in best-effort mode the lease goes on without it).
        .inspect_err(|_| crate::metrics::storage_write_failed(crate::faults::Store::Transcript))
    }
}

impl PartialEq for TranscriptSettings {
    fn eq(&self, other: &Self) -> bool {
        self.dir == other.dir && self.mode == other.mode
    }
}

impl Eq for TranscriptSettings {}

/// Everything a conversation brings to its turns.
#[derive(Clone)]
pub struct TurnHandlers {
    /// Gateway tools (sent on create and resume).
    pub tools: Vec<GatewayTool>,
    /// Decides the runtime's permission prompts (default: reject everything).
    pub permission_policy: Arc<dyn PermissionPolicy>,
    /// Answers ask_user (without it the model is not offered ask_user).
    pub user_input: Option<Arc<dyn UserInputHandler>>,
    /// Hooks (with them the runtime sends `hooks.invoke`).
    pub hooks: Option<Arc<dyn TurnHooks>>,
    /// Timeouts.
    pub timeouts: TurnTimeouts,
    /// The transcript mirror, if any.
    pub transcript: Option<TranscriptSettings>,
    /// The session event types the caller never reads (a gateway's `omit_events`). Those
    /// the pool does not read either ([`crate::rpc::unread_by_the_pool`]: the runtime's
    /// internal `model.*` events and `system.message`, over half of a tool turn's bytes) are
    /// dropped where the runtime's output is read, never parsed or handed on:
    /// [`crate::Lease::next_event`] does not yield them. `None`: every event comes.
    pub unread_events: Option<crate::rpc::UnreadEvents>,
    /// The most bytes of events (their JSON text) that may wait in the conversation's route
    /// while the caller reads slower than the runtime writes (a gateway that reads its event
    /// stream slowly): when more waits behind each of two events in a row the caller takes,
    /// the turn is aborted at its next call with [`TurnError::Backlog`] (even when the
    /// turn's `session.idle` is among what waits), and the waiting events are drained (into
    /// the transcript mirror, not to the caller). Default [`DEFAULT_MAX_UNREAD_EVENT_BYTES`].
    /// What the daemon holds is this plus what the runtime writes while the caller is on one
    /// event (over HTTP, at most 30 s for each). Keep it well under the worker's
    /// [`crate::worker::WorkerConfig::max_unread_route_bytes`] (256 MiB by default), past
    /// which the runtime itself is stopped as flooding the pool.
    pub max_unread_event_bytes: usize,
}

/// The default [`TurnHandlers::max_unread_event_bytes`]: 32 MiB, far above what a reader
/// that keeps up leaves waiting (an event or two), and a bound on what one that does not can
/// make the daemon hold.
pub const DEFAULT_MAX_UNREAD_EVENT_BYTES: usize = 32 << 20;

impl Default for TurnHandlers {
    fn default() -> Self {
        Self {
            tools: Vec::new(),
            permission_policy: Arc::new(RejectAll::default()),
            user_input: None,
            hooks: None,
            timeouts: TurnTimeouts::default(),
            transcript: None,
            unread_events: None,
            max_unread_event_bytes: DEFAULT_MAX_UNREAD_EVENT_BYTES,
        }
    }
}

impl fmt::Debug for TurnHandlers {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TurnHandlers")
            .field("tools", &self.tools)
            .field("user_input", &self.user_input.is_some())
            .field("hooks", &self.hooks.is_some())
            .field("timeouts", &self.timeouts)
            .field("transcript", &self.transcript)
            .field("unread_events", &self.unread_events.is_some())
            .field("max_unread_event_bytes", &self.max_unread_event_bytes)
            .finish_non_exhaustive()
    }
}

/// Which limit ended a turn.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum TimeoutKind {
    /// No event for the inactivity timeout.
    Inactivity,
    /// The absolute turn cap.
    Absolute,
    /// A gateway tool call did not finish.
    Tool,
    /// The permission policy did not decide.
    Permission,
}

/// Token usage summed over a turn's model calls.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
#[cfg_attr(feature = "http", derive(utoipa::ToSchema))]
#[non_exhaustive]
pub struct Usage {
    /// Input tokens.
    pub input_tokens: u64,
    /// Output tokens.
    pub output_tokens: u64,
    /// Input tokens read from the provider's prompt cache.
    pub cache_read_tokens: u64,
    /// Input tokens written to the provider's prompt cache.
    pub cache_write_tokens: u64,
}

impl Usage {
    /// Adds one model call's `assistant.usage`.
    pub(crate) fn add(&mut self, call: &crate::rpc::events::UsageData) {
        self.add_usage(&Usage {
            input_tokens: call.input_tokens.unwrap_or(0),
            output_tokens: call.output_tokens.unwrap_or(0),
            cache_read_tokens: call.cache_read_tokens.unwrap_or(0),
            cache_write_tokens: call.cache_write_tokens.unwrap_or(0),
        });
    }

    /// Adds `other`'s tokens (saturating).
    pub(crate) fn add_usage(&mut self, other: &Usage) {
        for (kind, n) in other.by_kind() {
            let total = match kind {
                TokenKind::Input => &mut self.input_tokens,
                TokenKind::Output => &mut self.output_tokens,
                TokenKind::CacheRead => &mut self.cache_read_tokens,
                TokenKind::CacheWrite => &mut self.cache_write_tokens,
            };
            *total = total.saturating_add(n);
        }
    }

    /// The tokens of each kind (`copilot_pool_tokens_total{kind}`).
    pub fn by_kind(&self) -> [(TokenKind, u64); 4] {
        [
            (TokenKind::Input, self.input_tokens),
            (TokenKind::Output, self.output_tokens),
            (TokenKind::CacheRead, self.cache_read_tokens),
            (TokenKind::CacheWrite, self.cache_write_tokens),
        ]
    }
}

/// What one turn produced.
#[derive(Debug, Clone, Default, Serialize)]
#[non_exhaustive]
pub struct TurnOutcome {
    /// The final assistant message of the main agent.
    pub text: String,
    /// The turn was aborted.
    pub aborted: bool,
    /// The turn's `session.error` message, if it failed; `Lease::wait_idle` turns it into `TurnError::Failed`.
    pub error: Option<String>,
    /// The `session.error` status code (e.g. 500 from the provider).
    pub status_code: Option<u16>,
    /// The `session.error` type.
    pub error_type: Option<String>,
    /// Model calls (`assistant.turn_start` events).
    pub model_calls: u32,
    /// Tool executions (`tool.execution_start` events).
    pub tool_calls: u32,
    /// Gateway tool calls answered by a handler.
    pub gateway_tool_calls: u32,
    /// Permission prompts decided by the policy.
    pub permission_prompts: u32,
    /// ask_user questions answered (or timed out to an empty answer).
    pub user_inputs: u32,
    /// Hooks that failed or timed out (answered `{}`).
    pub hook_failures: u32,
    /// Token usage.
    pub usage: Usage,
    /// `session.task_complete` data, when the runtime sent one (best effort).
    pub task_complete: Option<Value>,
    /// How the turn ended, once it has (computed once, by the turn driver; `None` while it
    /// runs).
    pub end: Option<crate::kinds::TurnEnd>,
    /// How the conversation's CLI session was opened for this turn: whether the runtime
    /// still had its context (`attached`, `resumed`) or started without it (`new`,
    /// `compat-changed`, `transcript-missing`, `not-found`, `resume-failed`), so a gateway
    /// knows when to re-seed it. Set by the lease; later turns of one lease are `attached`.
    pub open_reason: Option<crate::kinds::OpenReason>,
    /// Events seen (not those left unread: [`TurnHandlers::unread_events`]).
    pub events: usize,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_mirror_that_cannot_be_opened_counts_as_a_failed_transcript_write() {
        use metrics_util::debugging::DebugValue;
        let dir = tempfile::tempdir().expect("tempdir");
        // Its directory is a file: nothing can be opened under it.
        let not_a_dir = dir.path().join("file");
        std::fs::write(&not_a_dir, "").expect("file");
        let settings = TranscriptSettings::new(&not_a_dir, TranscriptMode::BestEffort);
        let runtime = tokio::runtime::Builder::new_current_thread()
            .build()
            .expect("runtime");
        let counted =
            crate::metrics::recorded(crate::metrics::STORAGE_WRITE_FAILURES_TOTAL, || {
                assert!(runtime.block_on(settings.open("session-1")).is_err());
            });
        assert_eq!(counted, [DebugValue::Counter(1)]);
    }

    #[test]
    fn a_turns_usage_sums_every_model_calls_tokens_including_the_prompt_cache() {
        let calls = [
            r#"{"model":"m","inputTokens":100,"outputTokens":10,"cacheReadTokens":40,"cacheWriteTokens":5}"#,
            r#"{"model":"m","inputTokens":120,"outputTokens":7,"cacheReadTokens":100}"#,
            r#"{"model":"m"}"#,
        ];
        let mut usage = Usage::default();
        for call in calls {
            let data: crate::rpc::events::UsageData =
                serde_json::from_str(call).expect("assistant.usage data");
            usage.add(&data);
        }
        assert_eq!(
            usage,
            Usage {
                input_tokens: 220,
                output_tokens: 17,
                cache_read_tokens: 140,
                cache_write_tokens: 5,
            }
        );
    }
}
