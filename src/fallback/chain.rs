//! Running one turn across a chain of backends (issue 17, item 6): the thin shell over the
//! pure core in [`crate::fallback`]. Owns leasing each backend of a [`ChainRequest`]
//! through the [`Pool`], running the turn on it, handing its events to the caller's
//! [`ChainSink`], and, when a run fails with a retryable class before any output reached the
//! caller, leasing the next backend and running the prompt again after the prelude read
//! from the failed conversation's transcript. Its answer is one [`TurnSummary`], the
//! daemon's `turn.end`.
//!
//! The daemon's `POST /v1/turns` is one caller (its sink streams SSE); a Rust gateway is
//! another ([`ChainLease::start`], then [`ChainLease::run`]). It owns no policy: which
//! failures fall back, the chain's shape and the prelude are the parent module's.

use std::collections::VecDeque;
use std::future::Future;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Serialize;
use serde_json::Value;

use super::{FallbackClass, FallbackError, TranscriptFormat, TranscriptTail};
use crate::backend::oneshot::Dialect;
use crate::backend::{BackendEvent, BackendKind, CliConversation, CliTurnOutcome, TurnFailure};
use crate::kinds::{OpenReason, TurnEnd};
use crate::pool::{COPILOT_BACKEND, CliLease, Lease, LeaseRequest, Pool, PoolError};
use crate::rpc::SessionEvent;
use crate::turn::{Message, Usage};

/// One turn that may run on several backends: the first backend's lease request (its
/// `backend`, `copilot` by default), the backends to fall back to in order, the message and
/// the prelude's budget.
#[derive(Clone)]
#[non_exhaustive]
pub struct ChainRequest {
    /// The first backend's lease, and the template of every fallback's (the same
    /// conversation, credentials, working directory and timeouts; `backend` replaced). Its
    /// gateway-facing handlers are set per backend by [`ChainSink::prepare`].
    pub lease: LeaseRequest,
    /// The backends that run the turn when the one before fails with a retryable class, in
    /// order: each once, none the first, at most [`super::MAX_FALLBACKS`].
    pub fallbacks: Vec<String>,
    /// The message. The first backend gets it whole; a fallback gets its prompt after the
    /// prelude, with the same attachments. A chain naming a CLI backend takes image files
    /// only as attachments (each CLI backend gets them as its runner passes images, Copilot
    /// as attachments; [`crate::backend::image::images_of`]) and refuses modes.
    pub message: Message,
    /// The prelude's budget in characters (at most [`super::MAX_PRELUDE_CHARS`]).
    pub prelude_chars: usize,
    /// How long one [`ChainSink::deliver`] may take (default [`DEFAULT_DELIVER_TIMEOUT`]):
    /// a sink that has not answered by then counts as a caller gone (the turn is aborted,
    /// `caller_gone`, nothing falls back), so a sink that never returns cannot hold the
    /// chain, its lease and its process forever.
    pub deliver_timeout: Duration,
}

/// The default bound on one [`ChainSink::deliver`] (the daemon's own SSE sink gives a
/// client 30 s to take an event too).
pub const DEFAULT_DELIVER_TIMEOUT: Duration = Duration::from_secs(30);

impl std::fmt::Debug for ChainRequest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChainRequest")
            .field("backend", &self.lease.backend)
            .field("fallbacks", &self.fallbacks)
            .field("prelude_chars", &self.prelude_chars)
            .field("deliver_timeout", &self.deliver_timeout)
            .finish_non_exhaustive()
    }
}

impl ChainRequest {
    /// A turn of `lease` with `message`, without fallbacks, and the default prelude budget.
    pub fn new(lease: LeaseRequest, message: impl Into<Message>) -> Self {
        Self {
            lease,
            fallbacks: Vec::new(),
            message: message.into(),
            prelude_chars: super::DEFAULT_PRELUDE_CHARS,
            deliver_timeout: DEFAULT_DELIVER_TIMEOUT,
        }
    }

    /// Refuses a chain the pool cannot run, before anything is leased: an unknown backend,
    /// a backend named twice or too many, a budget out of range, or, with a CLI backend in
    /// the chain, session options only the Copilot runtime takes, attachments other than
    /// image files, or modes (a CLI takes the prompt, images and an appended system
    /// message).
    pub fn check(&self, pool: &Pool) -> Result<(), PoolError> {
        let invalid = |e: FallbackError| PoolError::InvalidRequest(e.to_string());
        pool.check_backend(&self.lease.backend)?;
        super::check_chain(&self.lease.backend, &self.fallbacks).map_err(invalid)?;
        for next in &self.fallbacks {
            pool.check_backend(next)?;
        }
        super::check_budget(self.prelude_chars)
            .map_err(|e| PoolError::InvalidRequest(format!("prelude_chars: {e}")))?;
        for cli in std::iter::once(&self.lease.backend)
            .chain(&self.fallbacks)
            .filter(|b| b.as_str() != COPILOT_BACKEND)
        {
            pool.check_cli_options(cli, &self.lease)?;
        }
        let first = std::iter::once(&self.lease.backend);
        let Some(cli) = first
            .chain(&self.fallbacks)
            .find(|b| b.as_str() != COPILOT_BACKEND)
        else {
            return Ok(());
        };
        if self.message.mode.is_some() || self.message.agent_mode.is_some() {
            return Err(PoolError::InvalidRequest(format!(
                "`mode` and `agent_mode` are not offered to CLI backend `{cli}`; drop them, or \
                 drop `{cli}` from the chain"
            )));
        }
        if let Err(e) = crate::backend::image::images_of(&self.message.attachments) {
            return Err(PoolError::InvalidRequest(format!(
                "{e} (CLI backend `{cli}` is in the chain; or drop `{cli}` from it)"
            )));
        }
        Ok(())
    }
}

/// What a running chain tells its caller, in order: the events of each backend's run, and
/// a [`FallbackNotice`] before each fallback's.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub enum ChainEvent {
    /// An event of a Copilot conversation's turn.
    Session(SessionEvent),
    /// An event of a CLI backend's turn: never its `TurnEnd` (the [`TurnSummary`] carries
    /// it), nor the CLI's own report of a call of a gateway tool served through the MCP
    /// bridge (the tool's handler has the call).
    Cli(BackendEvent),
    /// The run before failed with a retryable class; the turn runs on the next backend.
    Fallback(FallbackNotice),
}

/// Where a running chain's events go, and what each backend's lease answers with.
pub trait ChainSink: Send + Sync {
    /// Sets the gateway-facing handlers of a lease of `request.backend` before it is taken
    /// (for the first backend and for each fallback): gateway tools, the permission policy,
    /// ask_user, hooks. The default keeps the request's own.
    fn prepare(&self, request: &mut LeaseRequest) {
        let _ = request;
    }

    /// Takes one event; `false` when the caller is gone: the run is aborted (dropping its
    /// lease) and nothing falls back. The chain waits for it at most
    /// [`ChainRequest::deliver_timeout`] (and never past [`ChainSink::gone`]): one that
    /// takes longer counts as `false`, and is dropped (cancelled) where it was.
    fn deliver(&self, event: ChainEvent) -> impl Future<Output = bool> + Send;

    /// Resolves when the caller is gone, aborting the run. The default never resolves.
    fn gone(&self) -> impl Future<Output = ()> + Send {
        std::future::pending()
    }

    /// Whether the caller asked to stop the turn (an abort, which may come before its prompt
    /// was sent or between backends): the chain sends nothing more, aborts what it sent, and
    /// ends `aborted` with its summary. Read before and after each backend's prompt goes
    /// out; an abort asked for while a backend's turn runs reaches it through
    /// [`ChainSink::stopped`], which a sink that can be stopped then implements too. The
    /// default never stops.
    fn stop_requested(&self) -> bool {
        false
    }

    /// Resolves once the caller asks to stop the turn ([`ChainSink::stop_requested`]): a
    /// wait for a backend's lease ends there, the turn `aborted`. The default never resolves.
    fn stopped(&self) -> impl Future<Output = ()> + Send {
        std::future::pending()
    }
}

/// A shared sink (the caller keeps a clone to read what it gathered).
impl<T: ChainSink> ChainSink for std::sync::Arc<T> {
    fn prepare(&self, request: &mut LeaseRequest) {
        T::prepare(self, request);
    }

    fn deliver(&self, event: ChainEvent) -> impl Future<Output = bool> + Send {
        T::deliver(self, event)
    }

    fn gone(&self) -> impl Future<Output = ()> + Send {
        T::gone(self)
    }

    fn stop_requested(&self) -> bool {
        T::stop_requested(self)
    }

    fn stopped(&self) -> impl Future<Output = ()> + Send {
        T::stopped(self)
    }
}

/// The daemon's `backend.fallback` event: the turn's backend failed with a retryable class
/// before any output reached the caller, and the turn runs again on the next backend;
/// that backend's events follow, then one `turn.end` (naming it in `backend`).
#[derive(Debug, Clone, PartialEq, Serialize)]
#[cfg_attr(feature = "http", derive(utoipa::ToSchema))]
#[cfg_attr(feature = "http", schema(as = BackendFallbackEvent))]
#[non_exhaustive]
pub struct FallbackNotice {
    /// The backend that failed.
    pub from: String,
    /// The backend that runs the turn now.
    pub to: String,
    /// Why the failure is retryable: `auth`, `rate_limit`, `timeout` or `crash`.
    pub class: FallbackClass,
    /// The failed turn's error.
    pub error: Option<String>,
    /// The failing model call's HTTP status, when the model failed.
    pub status_code: Option<u16>,
    /// Characters of the prelude (summary and newest messages of the failed conversation)
    /// put before the prompt (0: none, e.g. the failed conversation had no earlier turns).
    pub prelude_chars: usize,
}

/// How a turn ended on the backend that ran it last: the daemon's `turn.end` event, the
/// last of every turn's stream (and the whole answer of `?stream=false`).
#[derive(Debug, Clone, PartialEq, Serialize)]
#[cfg_attr(feature = "http", derive(utoipa::ToSchema))]
#[cfg_attr(feature = "http", schema(as = TurnEndEvent))]
#[non_exhaustive]
pub struct TurnSummary {
    /// How the turn ended.
    pub status: TurnEnd,
    /// The backend that ran the turn: `copilot` or a configured CLI backend id.
    pub backend: String,
    /// The runtime's session id of the conversation.
    pub session_id: String,
    /// Whether the runtime still had the conversation's context (`open_reason` is
    /// `attached` or `resumed`).
    pub resumed: bool,
    /// How the conversation's session was opened for this turn (`null` if it was not).
    pub open_reason: Option<OpenReason>,
    /// Model calls.
    pub llm_calls: u32,
    /// The final assistant message.
    pub final_text: String,
    /// Why the turn failed, if it did.
    pub error: Option<String>,
    /// The failing model call's HTTP status, when the model failed (for a CLI backend, the
    /// status its failure message or error code reports).
    pub status_code: Option<u16>,
    /// The runtime's error type, when the turn failed.
    pub error_type: Option<String>,
    /// Tokens summed over the turn's model calls.
    pub usage: Usage,
    /// The runtime's `session.task_complete` data, if it sent one.
    pub task_complete: Option<Value>,
    /// The backend whose retryable failure made this turn run on `backend` (the last one,
    /// when several failed); `null` when the turn's first backend answered.
    pub fallback_from: Option<String>,
}

impl TurnSummary {
    /// An empty summary (a failed turn with no session), for tests to fill in.
    #[cfg(test)]
    pub(crate) fn for_tests() -> Self {
        Self::unleased(COPILOT_BACKEND, String::new())
    }

    /// The summary of a turn whose `backend` could not be leased (`error`): no session.
    fn unleased(backend: &str, error: String) -> Self {
        Self {
            status: TurnEnd::Error,
            backend: backend.to_owned(),
            session_id: String::new(),
            resumed: false,
            open_reason: None,
            llm_calls: 0,
            final_text: String::new(),
            error: Some(error),
            status_code: None,
            error_type: None,
            usage: Usage::default(),
            task_complete: None,
            fallback_from: None,
        }
    }

    /// A Copilot turn's summary from its lease: how it ended (`status`), how the
    /// conversation was opened, the model calls, the final text, the error with the failing
    /// model call's HTTP status and the runtime's error type, usage and task_complete data.
    fn of_copilot(status: TurnEnd, lease: &Lease, error: Option<String>) -> Self {
        let outcome = lease.outcome();
        Self {
            status,
            backend: COPILOT_BACKEND.to_owned(),
            session_id: lease.cli_session_id().to_string(),
            resumed: lease.reason().continued(),
            open_reason: outcome.open_reason,
            llm_calls: outcome.model_calls,
            final_text: outcome.text,
            error,
            status_code: outcome.status_code,
            error_type: outcome.error_type,
            usage: outcome.usage,
            task_complete: outcome.task_complete,
            fallback_from: None,
        }
    }

    /// A CLI backend's turn's summary: its outcome when it reached one, else `status` and
    /// `error`.
    fn of_cli(
        lease: &CliLease,
        reason: OpenReason,
        outcome: Option<CliTurnOutcome>,
        status: TurnEnd,
        error: Option<String>,
    ) -> Self {
        let outcome = outcome.unwrap_or_default();
        // A CLI names the URL it failed on, whose query may carry a key.
        let error = error
            .or_else(|| outcome.failure.as_ref().map(|f| f.to_string()))
            .map(|e| crate::secret::without_url_credentials(&e));
        let status_code = super::cli_status_code(&outcome);
        Self {
            status: outcome.end.unwrap_or(status),
            backend: lease.backend().to_owned(),
            session_id: outcome
                .session_id
                .clone()
                .or_else(|| lease.session_id().map(str::to_owned))
                .unwrap_or_default(),
            resumed: reason.continued(),
            open_reason: Some(reason),
            llm_calls: 0,
            final_text: outcome.text,
            error,
            status_code,
            error_type: None,
            usage: outcome.usage,
            task_complete: None,
            fallback_from: None,
        }
    }
}

/// How a chain ended: the last run's summary, and whether the caller went away (then no
/// summary is owed to it).
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct ChainOutcome {
    /// The last run's summary (`fallback_from` names the backend that failed before it).
    pub summary: TurnSummary,
    /// The sink refused an event or resolved [`ChainSink::gone`]: the turn was aborted
    /// (`summary.status` then says `aborted`), unless its backend had ended it already with
    /// no fallback due (its caller left as its last events were passed on: `summary` is how
    /// it ended).
    pub caller_gone: bool,
}

/// A chain whose first backend is leased (or could not be, with a backend left to fall
/// back to): [`ChainLease::run`] runs it. Dropping it returns the lease.
pub struct ChainLease<S> {
    pool: Pool,
    sink: S,
    first: FirstRun,
    rest: VecDeque<String>,
    template: LeaseRequest,
    message: Message,
    budget: usize,
    deliver_timeout: Duration,
}

/// A sink whose every delivery is bounded by `limit` and by the caller going away: the
/// chain runs its backends through this, never the caller's sink directly.
struct Bounded<'a, S> {
    sink: &'a S,
    limit: Duration,
}

impl<S: ChainSink> ChainSink for Bounded<'_, S> {
    fn prepare(&self, request: &mut LeaseRequest) {
        self.sink.prepare(request);
    }

    async fn deliver(&self, event: ChainEvent) -> bool {
        tokio::select! {
            delivered = tokio::time::timeout(self.limit, self.sink.deliver(event)) => {
                delivered.unwrap_or_else(|_| {
                    tracing::warn!(
                        limit_ms = self.limit.as_millis() as u64,
                        "the chain's sink took no event within its deliver timeout; the turn \
                         ends as if the caller were gone"
                    );
                    false
                })
            }
            () = self.sink.gone() => false,
        }
    }

    fn gone(&self) -> impl Future<Output = ()> + Send {
        self.sink.gone()
    }

    fn stop_requested(&self) -> bool {
        self.sink.stop_requested()
    }

    fn stopped(&self) -> impl Future<Output = ()> + Send {
        self.sink.stopped()
    }
}

/// The first backend's lease, or why it could not be leased.
enum FirstRun {
    Copilot(Box<Lease>, Option<PathBuf>),
    Cli(Box<CliLease>, bool),
    /// Not leased, with a retryable class; the next backend runs without a prelude.
    Unleased(TurnSummary, FallbackClass),
    /// Stopped by the caller while its lease was waited for: nothing runs.
    Stopped(TurnSummary),
}

impl<S: ChainSink> ChainLease<S> {
    /// Checks `request` ([`ChainRequest::check`]) and leases its first backend, with the
    /// handlers `sink` prepares. A lease that fails is the error, unless its class is
    /// retryable ([`super::classify_lease`]: the backend's processes cannot start, or its
    /// key is quarantined) and a fallback is named: then [`ChainLease::run`] starts with the
    /// fallback (its notice names the lease's error).
    pub async fn start(pool: &Pool, request: ChainRequest, sink: S) -> Result<Self, PoolError> {
        request.check(pool)?;
        let ChainRequest {
            lease: template,
            fallbacks,
            message,
            prelude_chars,
            deliver_timeout,
        } = request;
        let mut req = template.clone();
        sink.prepare(&mut req);
        let backend = req.backend.clone();
        let leased = tokio::select! {
            leased = lease(pool, req) => leased,
            () = sink.stopped() => {
                let mut summary = TurnSummary::unleased(&backend, STOPPED_BEFORE_START.to_owned());
                summary.status = TurnEnd::Aborted;
                return Ok(Self {
                    pool: pool.clone(),
                    sink,
                    first: FirstRun::Stopped(summary),
                    rest: fallbacks.into(),
                    template,
                    message,
                    budget: prelude_chars,
                    deliver_timeout,
                });
            }
        };
        let first = match leased {
            Ok(NextLease::Copilot(lease, dir)) => FirstRun::Copilot(lease, dir),
            Ok(NextLease::Cli(lease, bridged)) => FirstRun::Cli(lease, bridged),
            Err(e) => match super::classify_lease(e.kind()) {
                Some(class) if !fallbacks.is_empty() => {
                    tracing::warn!(%e, %backend, "the turn's backend could not be leased; falling back");
                    FirstRun::Unleased(TurnSummary::unleased(&backend, e.to_string()), class)
                }
                _ => return Err(e),
            },
        };
        Ok(Self {
            pool: pool.clone(),
            sink,
            first,
            rest: fallbacks.into(),
            template,
            message,
            budget: prelude_chars,
            deliver_timeout,
        })
    }

    /// The first backend's lease, when it was leased (e.g. to name its session id before
    /// the turn runs).
    pub fn leased_backend(&self) -> Option<&str> {
        match &self.first {
            FirstRun::Copilot(..) => Some(COPILOT_BACKEND),
            FirstRun::Cli(lease, _) => Some(lease.backend()),
            FirstRun::Unleased(..) | FirstRun::Stopped(..) => None,
        }
    }

    /// The message the first backend runs, to complete once the lease is taken (the
    /// daemon writes a turn's inline attachments only for a turn that runs).
    pub fn message_mut(&mut self) -> &mut Message {
        &mut self.message
    }

    /// The sink the chain's events go to.
    pub fn sink(&self) -> &S {
        &self.sink
    }

    /// Runs the turn on the first backend, then, while the last run failed with a
    /// retryable class before any output reached the sink and a backend is left, leases
    /// the next one (a lease that fails adds its error to the summary and the one after is
    /// tried), sends [`ChainEvent::Fallback`] and runs the prompt after the prelude of the
    /// last failed conversation with a transcript. Returns the last run's summary.
    pub async fn run(self) -> ChainOutcome {
        let Self {
            pool,
            sink,
            first,
            mut rest,
            template,
            message,
            budget,
            deliver_timeout,
        } = self;
        let sink = Bounded {
            sink: &sink,
            limit: deliver_timeout,
        };
        let prompt = message.prompt.clone();
        // Every backend gets the attachments: Copilot as they are, a CLI backend its images
        // (checked again: the message may have been completed after the lease).
        let attachments = message.attachments.clone();
        let images = crate::backend::image::images_of(&attachments);
        let images = images.as_deref();
        let agent = template.agent_id.as_str();
        let mut end = match first {
            FirstRun::Copilot(lease, dir) => run_copilot(*lease, message, dir, agent, &sink).await,
            FirstRun::Cli(lease, bridged) => {
                run_cli(*lease, &prompt, images, bridged, agent, &sink).await
            }
            FirstRun::Unleased(summary, class) => RunEnd {
                summary,
                class: Some(class),
                streamed: false,
                transcript: None,
                gone: false,
            },
            FirstRun::Stopped(summary) => RunEnd {
                summary,
                class: None,
                streamed: false,
                transcript: None,
                gone: false,
            },
        };
        // The prelude of the last failed conversation with a transcript: kept across a
        // lease that fails and across a failed backend without one.
        let mut prelude: Option<String> = None;
        // The text the last run was given: the prompt, or after a fallback the prelude and
        // the prompt. Its transcript's entry of it (and what follows: the failure) is the
        // failed turn, not carried again (else a second fallback would nest the first
        // prelude and carry the prompt twice).
        let mut ran = prompt.clone();
        while !end.gone && !end.streamed {
            let Some(class) = end.class else { break };
            let Some(next) = rest.pop_front() else { break };
            if sink.stop_requested() {
                // Asked to stop: no backend after this one runs the prompt.
                end.summary.status = TurnEnd::Aborted;
                let note =
                    format!("; the fallback to `{next}` was not tried: the turn was aborted");
                end.summary
                    .error
                    .get_or_insert_with(String::new)
                    .push_str(&note);
                break;
            }
            let from = end.summary.backend.clone();
            // Reading the prelude and waiting for the next backend's lease (its capacity, a
            // spawn) end when the caller leaves: a waiter must not stay queued for nobody.
            let source = end.transcript.take();
            let mut req = template.clone();
            req.backend = next.clone();
            sink.prepare(&mut req);
            let prelude_then_lease = async {
                if let Some(source) = source
                    && let Some(fresh) = prelude_from(source, &from, &ran, budget).await
                {
                    prelude = Some(fresh);
                }
                lease(&pool, req).await
            };
            let leased = tokio::select! {
                leased = prelude_then_lease => leased,
                () = sink.gone() => {
                    end.abandon();
                    break;
                }
                () = sink.stopped() => {
                    end.summary.status = TurnEnd::Aborted;
                    break;
                }
            };
            let lease = match leased {
                Ok(lease) => lease,
                Err(e) => {
                    tracing::warn!(%e, backend = %next, "the fallback backend could not be leased");
                    let note = format!("; the fallback to `{next}` could not be leased: {e}");
                    end.summary
                        .error
                        .get_or_insert_with(String::new)
                        .push_str(&note);
                    continue;
                }
            };
            crate::metrics::fallback(&from, &next, class.label());
            let notice = FallbackNotice {
                from: from.clone(),
                to: next.clone(),
                class,
                error: end.summary.error.clone(),
                status_code: end.summary.status_code,
                prelude_chars: prelude.as_deref().map_or(0, |p| p.chars().count()),
            };
            if !sink.deliver(ChainEvent::Fallback(notice)).await {
                // The caller left: dropping the lease returns the conversation.
                end.abandon();
                break;
            }
            let seeded = super::seeded_prompt(prelude.as_deref(), &prompt);
            ran.clone_from(&seeded);
            end = match lease {
                NextLease::Copilot(lease, dir) => {
                    let mut message = Message::new(seeded);
                    message.attachments = attachments.clone();
                    run_copilot(*lease, message, dir, agent, &sink).await
                }
                NextLease::Cli(lease, bridged) => {
                    run_cli(*lease, &seeded, images, bridged, agent, &sink).await
                }
            };
            end.summary.fallback_from = Some(from);
        }
        // A caller that left as its backend failed with a fallback still due.
        if end.gone && !end.streamed && end.class.is_some() && !rest.is_empty() {
            end.abandon();
        }
        ChainOutcome {
            summary: end.summary,
            caller_gone: end.gone,
        }
    }
}

/// The summary of a Copilot turn whose caller left: how it ended when the runtime had ended
/// it already (its caller left as its last events were passed on: it ran whole), else
/// aborted (dropping the lease aborts it).
fn ended_or_aborted(lease: &Lease) -> TurnSummary {
    let outcome = lease.outcome();
    match outcome.end {
        Some(end) => TurnSummary::of_copilot(end, lease, outcome.error),
        None => TurnSummary::of_copilot(TurnEnd::Aborted, lease, None),
    }
}

/// A backend's lease.
enum NextLease {
    /// A Copilot conversation (boxed, as the CLI one: a lease is large), with its transcript
    /// mirror's directory.
    Copilot(Box<Lease>, Option<PathBuf>),
    /// A CLI backend's conversation, and whether the lease carries gateway tools (served
    /// through its MCP bridge).
    Cli(Box<CliLease>, bool),
}

/// Leases `req.backend`.
async fn lease(pool: &Pool, req: LeaseRequest) -> Result<NextLease, PoolError> {
    if req.backend == COPILOT_BACKEND {
        let transcript_dir = req.handlers.transcript.as_ref().map(|t| t.dir.clone());
        Ok(NextLease::Copilot(
            Box::new(pool.lease(req).await?),
            transcript_dir,
        ))
    } else {
        let bridged = !req.handlers.tools.is_empty();
        Ok(NextLease::Cli(
            Box::new(pool.lease_cli(req).await?),
            bridged,
        ))
    }
}

/// How one backend's run of the turn ended.
struct RunEnd {
    /// Its summary.
    summary: TurnSummary,
    /// The retryable class of its failure, if it failed with one.
    class: Option<FallbackClass>,
    /// Whether any of its output (assistant text, a tool call) reached the caller: then the
    /// turn does not fall back (the caller has seen part of an answer; running the prompt
    /// again could repeat what its tools did).
    streamed: bool,
    /// Where the prelude of a failure is read from.
    transcript: Option<PreludeSource>,
    /// The caller left or stopped reading: nothing more is sent.
    gone: bool,
}

impl RunEnd {
    /// The caller left with the turn's fallback not run: the turn did not end (the next
    /// backend was to run it), it was abandoned.
    fn abandon(&mut self) {
        self.gone = true;
        self.summary.status = TurnEnd::Aborted;
    }
}

/// Whether a Copilot session event is output of the turn (assistant text or a tool at
/// work): after it, the turn does not fall back.
fn is_output(event_type: &str) -> bool {
    event_type.starts_with("assistant.message") || event_type.starts_with("tool.")
}

/// Runs one Copilot turn, handing its events to `sink`; a caller that goes away aborts the
/// turn (dropping the lease does), and the conversation stays resumable. `transcript_dir`
/// is the mirror's directory, for the prelude of a failure.
async fn run_copilot<S: ChainSink>(
    mut lease: Lease,
    message: Message,
    transcript_dir: Option<PathBuf>,
    agent: &str,
    sink: &S,
) -> RunEnd {
    let span = tracing::info_span!("turn", agent = %agent, session = %lease.cli_session_id());
    let mut streamed = false;
    let mut gone = false;
    let summary = async {
        if sink.stop_requested() {
            let error = Some(STOPPED_BEFORE_START.to_owned());
            return TurnSummary::of_copilot(TurnEnd::Aborted, &lease, error);
        }
        if let Err(e) = lease.send(message).await {
            return TurnSummary::of_copilot(TurnEnd::Error, &lease, Some(e.to_string()));
        }
        // The turn aborts its own lease when its caller asks it to stop (an abort of the
        // conversation by key would reach whichever turn holds the conversation then: a later
        // one, while this one is between backends). Once: the aborted turn's end follows.
        // An abort asked for while the prompt went out may have found no turn to abort (a
        // sink that says so only through `stop_requested` too).
        let mut abort_asked = sink.stop_requested();
        if abort_asked {
            let _ = lease.abort().await;
        }
        let stopped = sink.stopped();
        tokio::pin!(stopped);
        loop {
            tokio::select! {
                () = &mut stopped, if !abort_asked => {
                    abort_asked = true;
                    let _ = lease.abort().await;
                }
                event = lease.next_event() => match event {
                    Some(Ok(event)) => {
                        streamed |= is_output(event.event_type());
                        if !sink.deliver(ChainEvent::Session(event)).await {
                            // The caller left or stopped reading: dropping the lease aborts
                            // the turn, unless it had ended (its end was the event refused).
                            gone = true;
                            return ended_or_aborted(&lease);
                        }
                    }
                    Some(Err(e)) => {
                        let status = lease.outcome().end.unwrap_or(TurnEnd::Error);
                        return TurnSummary::of_copilot(status, &lease, Some(e.to_string()));
                    }
                    None => {
                        let o = lease.outcome();
                        let status = o.end.unwrap_or(TurnEnd::Error);
                        return TurnSummary::of_copilot(status, &lease, o.error);
                    }
                },
                _ = sink.gone() => {
                    gone = true;
                    return ended_or_aborted(&lease);
                }
            }
        }
    };
    let summary = tracing::Instrument::instrument(summary, span).await;
    // The pool's mirror when it keeps one (configured and opened: a best-effort mirror
    // whose open failed has no file), else the runtime's own event log of the session.
    let id = lease.cli_session_id().as_str();
    let transcript = match transcript_dir {
        Some(dir) if lease.mirrors_transcript() => crate::transcript::transcript_path(&dir, id)
            .ok()
            .map(PreludeSource::Copilot),
        _ => super::copilot_events_file(lease.copilot_home(), id).map(PreludeSource::CopilotEvents),
    };
    drop(lease);
    let class = super::classify_copilot(
        Some(summary.status),
        summary.status_code,
        summary.error_type.as_deref(),
    );
    RunEnd {
        summary,
        class,
        streamed,
        transcript,
        gone,
    }
}

/// The error of a CLI turn stopped before its prompt went out.
const STOPPED_BEFORE_START: &str = "aborted before the prompt was sent";

/// Whether a CLI's tool call is one of the gateway's, through the MCP bridge.
fn is_bridged_call(name: &str) -> bool {
    #[cfg(feature = "mcp-bridge")]
    {
        crate::backend::mcp_bridge::gateway_tool_name(name).is_some()
    }
    #[cfg(not(feature = "mcp-bridge"))]
    {
        let _ = name;
        false
    }
}

/// Runs one CLI backend turn with the message's `images` (or the reason its attachments
/// are not images: the turn fails to start), handing its events to `sink`; a caller that
/// goes away ends the turn (its process is killed; the next turn resumes the session).
/// `bridged`: the lease's gateway tools are served through the MCP bridge, so the CLI's own
/// report of a call of one is not passed on (the tool's handler has the call).
async fn run_cli<S: ChainSink>(
    mut lease: CliLease,
    prompt: &str,
    images: Result<&[PathBuf], &crate::backend::image::ImageError>,
    bridged: bool,
    agent: &str,
    sink: &S,
) -> RunEnd {
    let reason = lease.reason();
    let span = tracing::info_span!("cli_turn", agent = %agent, backend = %lease.backend());
    // Output that reached the caller: deltas and tool calls, and whole messages (kept to
    // tell a CLI's own error message, which Claude sends as an assistant message, from an
    // answer).
    let mut streamed = false;
    let mut messages: Vec<String> = Vec::new();
    // The latest whole message, held until the next event or the turn's end: Claude Code
    // sends its own error (`API Error: 401 …`) as an assistant message, which must not
    // reach the caller as an answer when the turn falls back over it.
    let mut held: Option<BackendEvent> = None;
    let result = async {
        let images = match images {
            Ok(images) => images,
            Err(e) => {
                let error = format!("backend `{}`: {e}", lease.backend());
                return Err((TurnEnd::Error, Some(error), None));
            }
        };
        if sink.stop_requested() {
            return Err((
                TurnEnd::Aborted,
                Some(STOPPED_BEFORE_START.to_owned()),
                None,
            ));
        }
        let mut turn = match lease.start_turn_with_images(prompt, images).await {
            Ok(turn) => turn,
            // A backend whose process cannot start (its command missing, a spawn that
            // fails) falls back as a Copilot runtime that cannot start does; a refusal of
            // the turn's own input does not ([`super::classify_lease`]).
            Err(e) => {
                let class = super::classify_lease(e.kind());
                return Err((TurnEnd::Error, Some(e.to_string()), class));
            }
        };
        // The turn aborts itself when its caller asks it to stop (see `run_copilot`); once.
        // An abort asked for while the turn started may have found no turn to abort.
        let mut abort_asked = sink.stop_requested();
        if abort_asked {
            turn.abort_handle().abort();
        }
        let stopped = sink.stopped();
        tokio::pin!(stopped);
        loop {
            tokio::select! {
                () = &mut stopped, if !abort_asked => {
                    abort_asked = true;
                    turn.abort_handle().abort();
                }
                event = turn.next() => match event {
                    Some(BackendEvent::TurnEnd(outcome)) => return Ok(outcome),
                    Some(event) => {
                        match &event {
                            BackendEvent::Message { text } => messages.push(text.clone()),
                            BackendEvent::MessageDelta { .. } | BackendEvent::ToolCall { .. } => {
                                streamed = true;
                            }
                            _ => {}
                        }
                        if let BackendEvent::ToolCall { name, .. } = &event
                            && bridged
                            && is_bridged_call(name)
                        {
                            continue;
                        }
                        // A message waits for what follows it; what it held back goes now.
                        let event = match event {
                            BackendEvent::Message { .. } => match held.replace(event) {
                                Some(before) => before,
                                None => continue,
                            },
                            other => match held.take() {
                                Some(before) => {
                                    if !sink.deliver(ChainEvent::Cli(before)).await {
                                        return Err((TurnEnd::Aborted, None, None));
                                    }
                                    other
                                }
                                None => other,
                            },
                        };
                        if !sink.deliver(ChainEvent::Cli(event)).await {
                            // Dropping the turn before its end kills the process.
                            return Err((TurnEnd::Aborted, None, None));
                        }
                    }
                    None => return Err((TurnEnd::Error, Some("the turn ended without turn.end".into()), None)),
                },
                _ = sink.gone() => {
                    // Ended already, only its binding's write under way: it ran to its end.
                    if let Some(outcome) = turn.take_ended() {
                        return Ok(outcome);
                    }
                    return Err((TurnEnd::Aborted, None, None));
                }
            }
        }
    };
    let result = tracing::Instrument::instrument(result, span).await;
    let (summary, class, gone) = match result {
        Ok(outcome) => {
            let class = super::classify_cli(&outcome);
            // A message that is the CLI's own error is no answer.
            let error_text = match &outcome.failure {
                Some(TurnFailure::Cli { message, .. }) => Some(message.as_str()),
                _ => None,
            };
            let is_error_text =
                |text: &str| error_text.is_some_and(|error| text.trim() == error.trim());
            streamed |= messages.iter().any(|m| !is_error_text(m));
            // The last message goes out unless it is the error the turn falls back over.
            let mut gone = false;
            if let Some(last) = held.take() {
                let over = matches!(&last, BackendEvent::Message { text } if is_error_text(text))
                    && class.is_some()
                    && !streamed;
                if !over {
                    // The CLI's error as it said it, but for the URLs' credentials.
                    let last = match last {
                        BackendEvent::Message { text } if is_error_text(&text) => {
                            BackendEvent::Message {
                                text: crate::secret::without_url_credentials(&text),
                            }
                        }
                        other => other,
                    };
                    gone = !sink.deliver(ChainEvent::Cli(last)).await;
                }
            }
            let summary = TurnSummary::of_cli(&lease, reason, Some(outcome), TurnEnd::Idle, None);
            (summary, class, gone)
        }
        Err((status, error, class)) => {
            // Aborted because the caller left, not because it asked to stop (it still
            // reads the summary).
            let mut gone = status == TurnEnd::Aborted && !sink.stop_requested();
            streamed |= !messages.is_empty();
            if let Some(last) = held.take()
                && !gone
            {
                gone = !sink.deliver(ChainEvent::Cli(last)).await;
            }
            (
                TurnSummary::of_cli(&lease, reason, None, status, error),
                class,
                gone,
            )
        }
    };
    let transcript = Some(summary.session_id.as_str())
        .filter(|id| !id.is_empty())
        .map(|id| PreludeSource::Cli {
            backend: lease.backend().to_owned(),
            kind: lease.kind(),
            dialect: lease.dialect(),
            home: lease.home().to_path_buf(),
            cwd: lease.working_directory().to_path_buf(),
            session_id: id.to_owned(),
        });
    drop(lease);
    RunEnd {
        summary,
        class,
        streamed,
        transcript,
        gone,
    }
}

/// The transcript a failed backend's conversation left, for the prelude.
enum PreludeSource {
    /// The Copilot transcript mirror (`<dir>/copilot-<session id>.jsonl`).
    Copilot(PathBuf),
    /// The Copilot runtime's own event log of the session, when no mirror is kept
    /// (`super::copilot_events_file`: below the agent's home, no link followed).
    CopilotEvents(super::TranscriptFile),
    /// A CLI backend's own transcript, located when it is read (a directory search for a
    /// Codex rollout or a Gemini CLI chat file): Claude Code's, Codex's or Gemini CLI's, by
    /// [`TranscriptFormat::of_cli`]; a generic one-shot CLI leaves none the pool can read,
    /// so its failure gives no prelude.
    Cli {
        /// The backend id (for the logs).
        backend: String,
        /// The backend's kind.
        kind: BackendKind,
        /// The backend's dialect (which transcript it leaves).
        dialect: Dialect,
        /// The agent's home for the backend.
        home: PathBuf,
        /// The conversation's working directory.
        cwd: PathBuf,
        /// The CLI session id.
        session_id: String,
    },
}

impl PreludeSource {
    /// The newest entries of this transcript (none when there is none to read). Blocking.
    fn read(self, budget: usize) -> Result<TranscriptTail, FallbackError> {
        match self {
            PreludeSource::Copilot(path) => super::read_transcript_tail(&path, budget),
            PreludeSource::CopilotEvents(file) => super::read_copilot_events_tail(file, budget),
            PreludeSource::Cli {
                backend,
                kind,
                dialect,
                home,
                cwd,
                session_id,
            } => read_cli_tail(&backend, kind, dialect, &home, &cwd, &session_id, budget),
        }
    }
}

/// The newest entries of a CLI backend conversation's own transcript (none when the
/// backend's format is unknown or its transcript is not there). Blocking.
fn read_cli_tail(
    backend: &str,
    kind: BackendKind,
    dialect: Dialect,
    home: &Path,
    cwd: &Path,
    session_id: &str,
    budget: usize,
) -> Result<TranscriptTail, FallbackError> {
    let Some(format) = TranscriptFormat::of_cli(dialect, kind) else {
        return Ok(TranscriptTail::default());
    };
    match CliConversation::find_transcript(dialect, kind, home, cwd, session_id) {
        // Read below the agent's home: a link its processes planted on the way is refused.
        Ok(Some(path)) => match path.strip_prefix(home) {
            Ok(rel) => super::read_tail_of(format, super::TranscriptFile::below(home, rel), budget),
            Err(_) => {
                tracing::warn!(
                    backend,
                    path = %path.display(),
                    "no fallback prelude: the transcript is not below the agent's home"
                );
                Ok(TranscriptTail::default())
            }
        },
        Ok(None) => Ok(TranscriptTail::default()),
        Err(searched) => {
            tracing::warn!(
                backend,
                searched = %searched.display(),
                "no fallback prelude: the failed conversation's transcript is not there"
            );
            Ok(TranscriptTail::default())
        }
    }
}

/// Prelude reads running at once, at most.
const MAX_PRELUDE_READS: usize = 4;

/// What bounds the prelude reads running at once.
static PRELUDE_READS: tokio::sync::Semaphore = tokio::sync::Semaphore::const_new(MAX_PRELUDE_READS);

/// The prelude from the failed conversation's transcript (`source`, read on a blocking
/// thread) without the failed turn, found by the `prompt` that run was given (after an
/// earlier fallback: that prelude and the user's message); `None` when there is nothing to
/// carry or it cannot be read (logged: the next backend still runs the prompt).
async fn prelude_from(
    source: PreludeSource,
    from: &str,
    prompt: &str,
    budget: usize,
) -> Option<String> {
    // A few at once: in an outage every turn of every tenant falls back together, and each
    // read holds up to a line of 16 MiB and its parse.
    let Ok(_reading) = PRELUDE_READS.acquire().await else {
        return None;
    };
    let read = tokio::task::spawn_blocking(move || source.read(budget));
    let tail = match read.await {
        Ok(Ok(tail)) => tail,
        Ok(Err(e)) => {
            tracing::warn!(%e, "no fallback prelude");
            return None;
        }
        Err(e) => {
            tracing::warn!(%e, "no fallback prelude: the reading task did not finish");
            return None;
        }
    };
    let entries = super::without_failed_turn(tail.entries, prompt);
    super::build_prelude(
        from,
        tail.summary.as_deref(),
        &entries,
        budget,
        &super::new_boundary(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// A sink whose `deliver` never returns (a caller that stopped reading but holds on).
    #[derive(Default)]
    struct Stuck {
        asked: AtomicUsize,
    }

    impl ChainSink for Stuck {
        async fn deliver(&self, _event: ChainEvent) -> bool {
            self.asked.fetch_add(1, Ordering::SeqCst);
            std::future::pending().await
        }
    }

    /// A sink that takes every event, but whose caller is gone after `gone` resolves.
    struct Leaving(tokio::sync::watch::Receiver<bool>);

    impl ChainSink for Leaving {
        async fn deliver(&self, _event: ChainEvent) -> bool {
            std::future::pending().await
        }

        async fn gone(&self) {
            let _ = self.0.clone().wait_for(|g| *g).await;
        }
    }

    fn event() -> ChainEvent {
        ChainEvent::Cli(BackendEvent::MessageDelta {
            delta: "x".to_owned(),
        })
    }

    #[tokio::test]
    async fn a_sink_whose_deliver_never_returns_counts_as_gone_after_the_deliver_timeout() {
        let stuck = Stuck::default();
        let bounded = Bounded {
            sink: &stuck,
            limit: Duration::from_millis(50),
        };
        let started = std::time::Instant::now();
        let delivered = tokio::time::timeout(Duration::from_secs(10), bounded.deliver(event()))
            .await
            .expect("the bound ended the wait");
        assert!(!delivered, "an event not taken in time is a caller gone");
        assert!(started.elapsed() >= Duration::from_millis(50));
        assert_eq!(stuck.asked.load(Ordering::SeqCst), 1);
    }

    #[tokio::test]
    async fn a_deliver_waiting_on_a_caller_that_leaves_ends_at_once() {
        let (leave, rx) = tokio::sync::watch::channel(false);
        let sink = Leaving(rx);
        let bounded = Bounded {
            sink: &sink,
            limit: Duration::from_secs(3600),
        };
        let delivering = bounded.deliver(event());
        leave.send_replace(true);
        let delivered = tokio::time::timeout(Duration::from_secs(10), delivering)
            .await
            .expect("gone ended the wait");
        assert!(!delivered);
    }

    #[test]
    fn a_chain_request_bounds_each_delivery_by_default() {
        let request = ChainRequest::new(LeaseRequest::new("a", "k", PathBuf::from("/tmp")), "hi");
        assert_eq!(request.deliver_timeout, DEFAULT_DELIVER_TIMEOUT);
    }
}
