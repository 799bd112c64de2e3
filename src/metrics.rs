//! Prometheus metrics of the pool, recorded through the [`metrics`] facade.
//!
//! The library only records: it never installs a recorder (the daemon installs one, e.g.
//! `metrics-exporter-prometheus`, and then calls [`describe`] once). Without a recorder every
//! call here is a no-op.
//!
//! Every metric name is a `pub const` of this module and nowhere else. Names follow the
//! Prometheus conventions: the `copilot_pool_` prefix, base units (`_seconds`, `_bytes`) and
//! `_total` for counters. Labels take values from small fixed sets only (never an agent id,
//! session key, CLI session id, pid or key hash), so the number of series is bounded.
//! In names, *conversation* is the gateway's (agent, session key) and *session* is the
//! runtime's CLI session; [`CONVERSATIONS_ATTACHED`] counts conversations attached to a
//! process (each holds exactly one CLI session there).
//!
//! | metric | kind | labels |
//! |---|---|---|
//! | [`PROCESSES`] | gauge | `state`: `live`, `draining`, `spare`; `backend`: `copilot` or a configured CLI backend id |
//! | [`PROCESS_SPAWNS_TOTAL`] | counter | `result`: `ok`, `error`, `resource_exhausted`; `backend` |
//! | [`PROCESS_EXITS_TOTAL`] | counter | `reason`: `ProcessExit::label` (`crash`, `evicted`, `shutdown`, `recycled`, `completed`); `backend` |
//! | [`PROCESS_START_SECONDS`] | histogram | `backend` |
//! | [`PROCESS_RESIDENT_MEMORY_BYTES`] | gauge | — |
//! | [`CONVERSATIONS_ATTACHED`] | gauge | — |
//! | [`SESSION_RESUMES_TOTAL`] | counter | `result`: the label of each [`OpenReason`] but `attached`; `backend` |
//! | [`LEASES_ACTIVE`], [`LEASE_WAITERS`] | gauge | `backend` |
//! | [`LEASE_WAIT_SECONDS`] | histogram | `backend` |
//! | [`LEASE_REJECTIONS_TOTAL`] | counter | `reason`: [`ErrorKind::rejection_label`]; `backend` (or `unknown`: a lease naming no configured backend) |
//! | [`TURNS_TOTAL`] | counter | `outcome`: [`TurnEnd::label`]; `backend` |
//! | [`TURN_DURATION_SECONDS`] | histogram | `backend` |
//! | [`FALLBACKS_TOTAL`] | counter | `from`, `to`: backend ids (`backend` label's set); `class`: `auth`, `rate_limit`, `timeout`, `crash` (`crate::fallback::FallbackClass::label`) |
//! | [`LLM_CALLS_TOTAL`] | counter | — |
//! | [`TOOL_CALLS_TOTAL`] | counter | `outcome`: `ok`, `error`, `timeout` |
//! | [`EVICTIONS_TOTAL`] | counter | `reason`: `idle`, `full`, `drained`, `detach_failed`, `unsettled`; `backend` |
//! | [`QUARANTINES_TOTAL`] | counter | `backend` |
//! | [`RPC_DURATION_SECONDS`] | histogram | `method`: [`RPC_METHODS`] or `other` |
//! | [`HOOK_FAILURES_TOTAL`] | counter | — |
//! | [`SESSION_EVENTS_UNREAD_TOTAL`] | counter | — |
//! | [`TOKENS_TOTAL`] | counter | `kind`: [`TokenKind::as_str`] (`input`, `output`, `cache_read`, `cache_write`); `backend` |
//! | [`SDK_CONNECTIONS`] | gauge | — |
//! | [`SDK_CONNECTIONS_TOTAL`] | counter | `result`: `accepted`, `refused`, `unauthenticated`, `agent_limit` |
//! | [`MODEL_REQUESTS_TOTAL`] | counter | `outcome`: [`ModelOutcome::label`] |
//! | [`MODEL_REQUEST_SECONDS`] | histogram | `phase`: `first_byte`, `total` |
//! | [`MODEL_BYTES_TOTAL`] | counter | `direction`: `sent`, `received` |
//! | [`MODEL_BLOCKED_TOTAL`] | counter | `reason`: [`BlockReason::label`] |
//! | [`STORAGE_WRITE_FAILURES_TOTAL`] | counter | `store`: [`Store::as_str`] (`bindings`, `transcript`, `process_groups`) |
//! | [`OWNERSHIP_VIOLATIONS_TOTAL`] | counter | — |
//! | [`DAEMON_TASKS`] | gauge | — (set by the daemon at each scrape) |
//! | [`DAEMON_HEAP_BYTES`] | gauge | — (set by the daemon at each scrape) |
//! | [`SANDBOX_ENFORCED`] | gauge | `rule`: [`SandboxRule::as_str`] (`filesystem`, `tcp_connect`, `tcp_bind`, `signals`, `abstract_unix_sockets`, `capabilities`) |
//! | [`SANDBOX_WANTED`] | gauge | `rule`, as [`SANDBOX_ENFORCED`] |
//!
//! The `backend` label takes `copilot` or one of the pool's configured CLI backend ids
//! (`PoolConfig::cli_backends`, the daemon's `[backends.<id>]`): a bounded set fixed at start.
//! A lease naming an id outside it is rejected under [`UNKNOWN_BACKEND`], never its own id.
//! For a CLI backend a *process* is the CLI's: a live one (Claude Code) per conversation,
//! started on its first turn and kept between leases; a one-shot one (Codex, Gemini CLI) per
//! turn, which leaves with its turn (`completed`). Its start time is the spawn alone (a CLI
//! has no handshake before its first prompt).
//!
//! The gauges are absolute values set by the pool actor: with more than one pool in a
//! process they overwrite each other (the daemon runs one).

use std::time::Duration;

use ::metrics::{
    Unit, counter, describe_counter, describe_gauge, describe_histogram, gauge, histogram,
};

use crate::faults::Store;
use crate::kinds::{
    BlockReason, ErrorKind, Eviction, ModelOutcome, OpenReason, SandboxRule, TokenKind, TurnEnd,
};

/// CLI processes of the pool by `state` (`live`, `draining`, `spare`) and `backend`.
pub const PROCESSES: &str = "copilot_pool_processes";
/// Process starts (spawn + handshake) by `result` (`ok`, `error`, `resource_exhausted`)
/// and `backend`.
pub const PROCESS_SPAWNS_TOTAL: &str = "copilot_pool_process_spawns_total";
/// Processes that left the pool by `reason` (`ProcessExit::label`) and `backend`.
pub const PROCESS_EXITS_TOTAL: &str = "copilot_pool_process_exits_total";
/// Time of a successful process start: spawn and handshake.
pub const PROCESS_START_SECONDS: &str = "copilot_pool_process_start_seconds";
/// Resident memory (VmRSS) summed over the pool's processes, as of the last maintenance tick.
pub const PROCESS_RESIDENT_MEMORY_BYTES: &str = "copilot_pool_process_resident_memory_bytes";
/// Conversations attached to a process (leased or parked), each with its one CLI session.
pub const CONVERSATIONS_ATTACHED: &str = "copilot_pool_conversations_attached";
/// CLI sessions opened for a conversation on a process it was not attached to (resumed or
/// started anew), by `result`.
pub const SESSION_RESUMES_TOTAL: &str = "copilot_pool_session_resumes_total";
/// Leases currently held.
pub const LEASES_ACTIVE: &str = "copilot_pool_leases_active";
/// Leases waiting for capacity.
pub const LEASE_WAITERS: &str = "copilot_pool_lease_waiters";
/// Time `Pool::lease` spent until it had a grant (conversation lock and capacity).
pub const LEASE_WAIT_SECONDS: &str = "copilot_pool_lease_wait_seconds";
/// Leases that failed, by `reason`.
pub const LEASE_REJECTIONS_TOTAL: &str = "copilot_pool_lease_rejections_total";
/// Turns that ended, by `outcome`.
pub const TURNS_TOTAL: &str = "copilot_pool_turns_total";
/// Turns that ran again on the next backend of their chain, by `from`, `to` and `class`.
pub const FALLBACKS_TOTAL: &str = "copilot_pool_fallbacks_total";
/// Time from `session.send` to the end of the turn.
pub const TURN_DURATION_SECONDS: &str = "copilot_pool_turn_duration_seconds";
/// Model calls (`assistant.turn_start` events).
pub const LLM_CALLS_TOTAL: &str = "copilot_pool_llm_calls_total";
/// Gateway tool calls answered by a handler, by `outcome` (`ok`, `error`, `timeout`).
pub const TOOL_CALLS_TOTAL: &str = "copilot_pool_tool_calls_total";
/// Processes the pool stopped on its own, by `reason`.
pub const EVICTIONS_TOTAL: &str = "copilot_pool_evictions_total";
/// Keys quarantined after exceeding the restart intensity.
pub const QUARANTINES_TOTAL: &str = "copilot_pool_quarantines_total";
/// JSON-RPC request latency to the runtime, by `method`.
pub const RPC_DURATION_SECONDS: &str = "copilot_pool_rpc_duration_seconds";
/// Hooks that failed, panicked or timed out (answered with no output).
pub const HOOK_FAILURES_TOTAL: &str = "copilot_pool_hook_failures_total";
/// Runtime session events dropped unread where the runtime's output is read: their lease's
/// caller left their type out (a turn's `omit_events`) and the pool reads none of them
/// (`model.*`, `system.message`).
pub const SESSION_EVENTS_UNREAD_TOTAL: &str = "copilot_pool_session_events_unread_total";
/// Tokens of the model calls of every backend's turns (Copilot: `assistant.usage`), by `kind` and
/// `backend`.
pub const TOKENS_TOTAL: &str = "copilot_pool_tokens_total";
/// Model HTTP requests of the runtime served through the tunnel, by `outcome`.
pub const MODEL_REQUESTS_TOTAL: &str = "copilot_pool_model_requests_total";
/// Time of a tunnelled model request, by `phase`: to the response head (`first_byte`) and to
/// the end of its body (`total`).
pub const MODEL_REQUEST_SECONDS: &str = "copilot_pool_model_request_seconds";
/// Body bytes of tunnelled model requests, by `direction` (`sent` upstream, `received` back).
pub const MODEL_BYTES_TOTAL: &str = "copilot_pool_model_bytes_total";
/// Model requests the guard refused before any connection, by `reason`.
pub const MODEL_BLOCKED_TOTAL: &str = "copilot_pool_model_blocked_total";

/// Client connections open on the SDK endpoint.
pub const SDK_CONNECTIONS: &str = "copilot_pool_sdk_connections";
/// SDK endpoint connections by `result`: `accepted`, `refused` (over the connection cap),
/// `unauthenticated` (a wrong token, no `connect` in time, or closed to make way for a newer
/// connection not authenticated yet).
pub const SDK_CONNECTIONS_TOTAL: &str = "copilot_pool_sdk_connections_total";

/// Whether each wall of the workers' sandbox is enforced (1) or not (0), by `rule`.
pub const SANDBOX_ENFORCED: &str = "copilot_pool_sandbox_enforced";
/// Whether the configuration asks for each wall of the workers' sandbox (1) or leaves it
/// open on purpose (0: every rule with `sandbox = "off"`, `tcp_bind` with
/// `sandbox_tcp_bind = "any"`), by `rule`: a wall wanted and not enforced is what an alert
/// reads.
pub const SANDBOX_WANTED: &str = "copilot_pool_sandbox_wanted";
/// Opens whose session the runtime reported attached to another process (`alreadyInUse`):
/// the one-owner rule broken. Should stay 0; alert on any increase.
pub const OWNERSHIP_VIOLATIONS_TOTAL: &str = "copilot_pool_ownership_violations_total";
/// Tasks alive on the daemon's async runtime, set by the daemon at each scrape (the library
/// never sets it: it owns no runtime).
pub const DAEMON_TASKS: &str = "copilot_pool_daemon_tasks";
/// The daemon's live heap (bytes allocated and not freed, as its allocator counts them), set
/// by the daemon at each scrape (the library never sets it: it sets no allocator).
pub const DAEMON_HEAP_BYTES: &str = "copilot_pool_daemon_heap_bytes";
/// Durable writes (a binding, a transcript line) that failed, by `store`.
pub const STORAGE_WRITE_FAILURES_TOTAL: &str = "copilot_pool_storage_write_failures_total";

/// Every counter.
pub const COUNTERS: &[&str] = &[
    PROCESS_SPAWNS_TOTAL,
    PROCESS_EXITS_TOTAL,
    SESSION_RESUMES_TOTAL,
    LEASE_REJECTIONS_TOTAL,
    TURNS_TOTAL,
    LLM_CALLS_TOTAL,
    TOOL_CALLS_TOTAL,
    EVICTIONS_TOTAL,
    QUARANTINES_TOTAL,
    HOOK_FAILURES_TOTAL,
    SESSION_EVENTS_UNREAD_TOTAL,
    TOKENS_TOTAL,
    SDK_CONNECTIONS_TOTAL,
    MODEL_REQUESTS_TOTAL,
    MODEL_BYTES_TOTAL,
    MODEL_BLOCKED_TOTAL,
    STORAGE_WRITE_FAILURES_TOTAL,
    OWNERSHIP_VIOLATIONS_TOTAL,
    FALLBACKS_TOTAL,
];

/// Every gauge.
pub const GAUGES: &[&str] = &[
    PROCESSES,
    PROCESS_RESIDENT_MEMORY_BYTES,
    CONVERSATIONS_ATTACHED,
    LEASES_ACTIVE,
    LEASE_WAITERS,
    SDK_CONNECTIONS,
    SANDBOX_ENFORCED,
    SANDBOX_WANTED,
    DAEMON_TASKS,
    DAEMON_HEAP_BYTES,
];

/// Every histogram (all in seconds): give each [`SECONDS_BUCKETS`] in the exporter.
pub const HISTOGRAMS: &[&str] = &[
    PROCESS_START_SECONDS,
    LEASE_WAIT_SECONDS,
    TURN_DURATION_SECONDS,
    RPC_DURATION_SECONDS,
    MODEL_REQUEST_SECONDS,
];

/// Suggested histogram buckets: 1 ms to 60 s for requests, lease waits and process starts,
/// then up to 30 min, the default absolute turn limit.
pub const SECONDS_BUCKETS: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
    120.0, 300.0, 600.0, 1800.0,
];

/// The methods [`RPC_DURATION_SECONDS`] names; any other is `other`.
pub const RPC_METHODS: &[&str] = &[
    "connect",
    "ping",
    "session.create",
    "session.resume",
    "session.send",
    "session.abort",
    "session.detach",
    "session.history.compact",
    "session.tools.handlePendingToolCall",
    "session.permissions.handlePendingPermissionRequest",
];

/// The `method` label of a method outside [`RPC_METHODS`].
pub const RPC_OTHER: &str = "other";

/// Registers every counter series with value 0 (every label value of the fixed sets), so
/// `increase()`/`rate()` see the first event after a start and dashboards have a series
/// before anything happened. Call it once, after installing the recorder.
pub fn register_zeroes() {
    for name in [
        LLM_CALLS_TOTAL,
        HOOK_FAILURES_TOTAL,
        SESSION_EVENTS_UNREAD_TOTAL,
        OWNERSHIP_VIOLATIONS_TOTAL,
    ] {
        counter!(name).absolute(0);
    }
    for store in [Store::Bindings, Store::Transcript, Store::ProcessGroups] {
        counter!(STORAGE_WRITE_FAILURES_TOTAL, "store" => store.as_str()).absolute(0);
    }
    register_backend_zeroes(COPILOT_BACKEND);
    for outcome in ["ok", "error", "timeout"] {
        counter!(TOOL_CALLS_TOTAL, "outcome" => outcome).absolute(0);
    }
    for result in SdkConnection::ALL {
        counter!(SDK_CONNECTIONS_TOTAL, "result" => result.label()).absolute(0);
    }
    for outcome in ModelOutcome::ALL {
        counter!(MODEL_REQUESTS_TOTAL, "outcome" => outcome.label()).absolute(0);
    }
    for direction in ModelDirection::ALL {
        counter!(MODEL_BYTES_TOTAL, "direction" => direction.label()).absolute(0);
    }
    for reason in BlockReason::ALL {
        counter!(MODEL_BLOCKED_TOTAL, "reason" => reason.label()).absolute(0);
    }
}

/// The `backend` label of the Copilot runtime's workers.
pub const COPILOT_BACKEND: &str = "copilot";

/// Registers the series of one backend id (`copilot`, or a configured CLI backend) at zero.
/// [`register_zeroes`] does `copilot`; the daemon calls this for each configured CLI id.
pub fn register_backend_zeroes(backend: &str) {
    for end in TurnEnd::ALL {
        counter!(TURNS_TOTAL, "outcome" => end.label(), "backend" => backend.to_owned())
            .absolute(0);
    }
    for kind in TokenKind::ALL {
        counter!(TOKENS_TOTAL, "kind" => kind.as_str(), "backend" => backend.to_owned())
            .absolute(0);
    }
    for result in SpawnResult::ALL {
        counter!(PROCESS_SPAWNS_TOTAL, "result" => result.label(), "backend" => backend.to_owned())
            .absolute(0);
    }
    for why in ProcessExit::ALL {
        counter!(PROCESS_EXITS_TOTAL, "reason" => why.label(), "backend" => backend.to_owned())
            .absolute(0);
    }
    for result in OpenReason::ALL.into_iter().filter_map(resume_result) {
        counter!(SESSION_RESUMES_TOTAL, "result" => result, "backend" => backend.to_owned())
            .absolute(0);
    }
    for reason in ErrorKind::ALL.map(ErrorKind::rejection_label) {
        counter!(LEASE_REJECTIONS_TOTAL, "reason" => reason, "backend" => backend.to_owned())
            .absolute(0);
    }
    for reason in Eviction::ALL {
        counter!(EVICTIONS_TOTAL, "reason" => reason.label(), "backend" => backend.to_owned())
            .absolute(0);
    }
    counter!(QUARANTINES_TOTAL, "backend" => backend.to_owned()).absolute(0);
    gauge!(LEASES_ACTIVE, "backend" => backend.to_owned()).set(0.0);
    gauge!(LEASE_WAITERS, "backend" => backend.to_owned()).set(0.0);
    if backend != COPILOT_BACKEND {
        gauge!(PROCESSES, "state" => "live", "backend" => backend.to_owned()).set(0.0);
    }
}

/// The `backend` label of a lease rejected for naming no configured backend (so a caller
/// cannot grow the label set).
pub const UNKNOWN_BACKEND: &str = "unknown";

/// `labels` joined for a help text, each once, in their order: derived from the closed sets
/// the labels come from, so the help cannot fall behind them.
fn one_of(labels: impl IntoIterator<Item = &'static str>) -> String {
    let mut seen: Vec<&str> = Vec::new();
    for label in labels {
        if !seen.contains(&label) {
            seen.push(label);
        }
    }
    seen.join(", ")
}

/// Describes every metric (unit and help) to the installed recorder. Call it once, after
/// installing the recorder.
pub fn describe() {
    describe_gauge!(
        PROCESSES,
        Unit::Count,
        "CLI processes of the pool, by state (live, draining, spare: a warm spare) and \
         backend."
    );
    describe_counter!(
        PROCESS_SPAWNS_TOTAL,
        Unit::Count,
        "CLI process starts (spawn and handshake), by result (ok, error, resource_exhausted) \
         and backend."
    );
    describe_counter!(
        PROCESS_EXITS_TOTAL,
        Unit::Count,
        "CLI processes that left the pool, by reason (crash, evicted, shutdown, recycled, \
         completed: a one-shot CLI's process ended with its turn) and backend."
    );
    describe_histogram!(
        PROCESS_START_SECONDS,
        Unit::Seconds,
        "Time to start a CLI process: spawn and the connect handshake (a CLI backend's: the \
         spawn alone), by backend."
    );
    describe_gauge!(
        PROCESS_RESIDENT_MEMORY_BYTES,
        Unit::Bytes,
        "Resident memory (VmRSS) summed over the pool's Copilot runtime processes, as of the \
         last maintenance tick (CLI backends' processes are not counted)."
    );
    describe_gauge!(
        CONVERSATIONS_ATTACHED,
        Unit::Count,
        "Conversations attached to a Copilot runtime process (leased or parked; CLI \
         backends' conversations are not counted)."
    );
    describe_counter!(
        SESSION_RESUMES_TOTAL,
        Unit::Count,
        format!(
            "Conversations opened on a process, by result (resumed, or a new session: {}) and \
             backend.",
            one_of(
                OpenReason::ALL
                    .into_iter()
                    .filter_map(resume_result)
                    .filter(|r| *r != "resumed")
            )
        )
    );
    describe_gauge!(
        LEASES_ACTIVE,
        Unit::Count,
        "Leases currently held, by backend."
    );
    describe_gauge!(
        LEASE_WAITERS,
        Unit::Count,
        "Leases waiting for capacity, by backend."
    );
    describe_histogram!(
        LEASE_WAIT_SECONDS,
        Unit::Seconds,
        "Time a lease waited for its conversation and for capacity until it was granted."
    );
    describe_counter!(
        LEASE_REJECTIONS_TOTAL,
        Unit::Count,
        format!(
            "Leases that failed, by reason ({}) and backend.",
            one_of(ErrorKind::ALL.map(ErrorKind::rejection_label))
        )
    );
    describe_counter!(
        TURNS_TOTAL,
        Unit::Count,
        format!(
            "Turns that ended, by outcome ({}) and backend.",
            one_of(TurnEnd::ALL.map(TurnEnd::label))
        )
    );
    describe_counter!(
        FALLBACKS_TOTAL,
        Unit::Count,
        "Turns whose backend failed with a retryable class and ran again on the next backend \
         of their chain, by from, to and class (auth, rate_limit, timeout, crash)."
    );
    describe_histogram!(
        TURN_DURATION_SECONDS,
        Unit::Seconds,
        "Time from sending a prompt to the end of its turn."
    );
    describe_counter!(
        LLM_CALLS_TOTAL,
        Unit::Count,
        "Model calls of the runtime (assistant.turn_start events)."
    );
    describe_counter!(
        TOOL_CALLS_TOTAL,
        Unit::Count,
        "Gateway tool calls answered by a handler, by outcome (ok, error, timeout)."
    );
    describe_counter!(
        EVICTIONS_TOTAL,
        Unit::Count,
        format!(
            "CLI processes the pool stopped on its own, by reason ({}) and backend.",
            one_of(Eviction::ALL.map(Eviction::label))
        )
    );
    describe_counter!(
        OWNERSHIP_VIOLATIONS_TOTAL,
        Unit::Count,
        "Opens whose session the runtime reported attached to another process (should stay 0)."
    );
    describe_gauge!(
        DAEMON_TASKS,
        Unit::Count,
        "Tasks alive on the daemon's async runtime (set at each scrape)."
    );
    describe_gauge!(
        DAEMON_HEAP_BYTES,
        Unit::Bytes,
        "The daemon's live heap: bytes allocated and not freed (set at each scrape)."
    );
    describe_counter!(
        STORAGE_WRITE_FAILURES_TOTAL,
        Unit::Count,
        "Durable writes that failed (a full or failing disk), by store (bindings, transcript, process_groups)."
    );
    describe_counter!(
        QUARANTINES_TOTAL,
        Unit::Count,
        "Pool keys quarantined after their processes exceeded the restart intensity, by backend."
    );
    describe_histogram!(
        RPC_DURATION_SECONDS,
        Unit::Seconds,
        "JSON-RPC request latency to the runtime, by method (other for unlisted methods)."
    );
    describe_counter!(
        HOOK_FAILURES_TOTAL,
        Unit::Count,
        "Hooks that failed, panicked or timed out (answered with no output)."
    );
    describe_counter!(
        SESSION_EVENTS_UNREAD_TOTAL,
        Unit::Count,
        "Runtime session events dropped unread: their caller omitted them and the pool reads none of them (model.*, system.message)."
    );
    describe_counter!(
        TOKENS_TOTAL,
        Unit::Count,
        format!(
            "Tokens of the model calls, by kind ({}) and backend.",
            one_of(TokenKind::ALL.map(TokenKind::as_str))
        )
    );
    describe_gauge!(
        SDK_CONNECTIONS,
        Unit::Count,
        "Client connections open on the SDK endpoint."
    );
    describe_counter!(
        SDK_CONNECTIONS_TOTAL,
        Unit::Count,
        "SDK endpoint connections, by result (accepted, refused over the cap, \
         unauthenticated, agent_limit: refused at connect over the agent's cap)."
    );
    describe_counter!(
        MODEL_REQUESTS_TOTAL,
        Unit::Count,
        "Model HTTP requests of the runtime served through the tunnel, by outcome (ok, \
         client_error, server_error, blocked, connect_error, timeout, stream_error, cancelled)."
    );
    describe_histogram!(
        MODEL_REQUEST_SECONDS,
        Unit::Seconds,
        "Time of a tunnelled model request, by phase: to the response head (first_byte) and \
         to the end of its body (total)."
    );
    describe_counter!(
        MODEL_BYTES_TOTAL,
        Unit::Bytes,
        "Body bytes of tunnelled model requests, by direction (sent upstream, received back)."
    );
    describe_counter!(
        MODEL_BLOCKED_TOTAL,
        Unit::Count,
        format!(
            "Model requests the guard refused before any connection (a tunnelled request, or a \
             CLI backend's provider at its lease), by reason ({}).",
            one_of(BlockReason::ALL.map(BlockReason::label))
        )
    );
    describe_gauge!(
        SANDBOX_ENFORCED,
        Unit::Count,
        "Whether each wall of the workers' sandbox is enforced (1) or not (0), by rule \
         (filesystem, tcp_connect, tcp_bind, signals, abstract_unix_sockets, capabilities)."
    );
    describe_gauge!(
        SANDBOX_WANTED,
        Unit::Count,
        "Whether the configuration asks for each wall of the workers' sandbox (1) or leaves \
         it open on purpose (0: sandbox = off, or tcp_bind with sandbox_tcp_bind = any), by rule."
    );
}

/// What became of one SDK endpoint connection (the `result` label of
/// [`SDK_CONNECTIONS_TOTAL`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum SdkConnection {
    /// Accepted under the cap.
    Accepted,
    /// Over the connection cap: closed at once.
    Refused,
    /// A wrong token, no `connect` in time, or closed before `connect` to make way for a
    /// newer connection (`max_unauthenticated_connections`).
    Unauthenticated,
    /// A right token whose agent holds `max_connections_per_agent` connections already:
    /// `connect` refused, the connection closed.
    AgentLimit,
}

impl SdkConnection {
    /// Every value, in a stable order.
    pub(crate) const ALL: [SdkConnection; 4] = [
        SdkConnection::Accepted,
        SdkConnection::Refused,
        SdkConnection::Unauthenticated,
        SdkConnection::AgentLimit,
    ];

    /// The `result` label.
    pub(crate) fn label(self) -> &'static str {
        match self {
            SdkConnection::Accepted => "accepted",
            SdkConnection::Refused => "refused",
            SdkConnection::Unauthenticated => "unauthenticated",
            SdkConnection::AgentLimit => "agent_limit",
        }
    }
}

/// An SDK endpoint connection was accepted, refused, or failed to authenticate.
#[cfg_attr(not(feature = "sdk-endpoint"), allow(dead_code))]
pub(crate) fn sdk_connection(result: SdkConnection) {
    counter!(SDK_CONNECTIONS_TOTAL, "result" => result.label()).increment(1);
}

/// An SDK endpoint connection, counted in [`SDK_CONNECTIONS`] while this lives: however its
/// task ends (closed, panicked, aborted at shutdown), the drop takes it off the gauge.
#[cfg_attr(not(feature = "sdk-endpoint"), allow(dead_code))]
pub(crate) struct OpenSdkConnection(());

#[cfg_attr(not(feature = "sdk-endpoint"), allow(dead_code))]
impl OpenSdkConnection {
    /// A connection opened.
    pub(crate) fn counted() -> Self {
        gauge!(SDK_CONNECTIONS).increment(1.0);
        Self(())
    }
}

impl Drop for OpenSdkConnection {
    fn drop(&mut self) {
        gauge!(SDK_CONNECTIONS).decrement(1.0);
    }
}

/// Sets [`SANDBOX_ENFORCED`] for every rule: 1 where `enforced` says so, else 0 (the daemon
/// calls it once, after probing its sandbox; all 0 when the sandbox is off).
pub fn sandbox_enforced(enforced: impl Fn(SandboxRule) -> bool) {
    for rule in SandboxRule::ALL {
        gauge!(SANDBOX_ENFORCED, "rule" => rule.as_str()).set(if enforced(rule) {
            1.0
        } else {
            0.0
        });
    }
}

/// Sets [`SANDBOX_WANTED`] for every rule: 1 where `wanted` says the configuration asks
/// for the wall, else 0 (the daemon calls it once, beside [`sandbox_enforced`]).
pub fn sandbox_wanted(wanted: impl Fn(SandboxRule) -> bool) {
    for rule in SandboxRule::ALL {
        gauge!(SANDBOX_WANTED, "rule" => rule.as_str()).set(if wanted(rule) { 1.0 } else { 0.0 });
    }
}

/// The `method` label of a JSON-RPC method: itself if listed in [`RPC_METHODS`], else
/// [`RPC_OTHER`].
pub fn rpc_method_label(method: &str) -> &'static str {
    RPC_METHODS
        .iter()
        .find(|m| **m == method)
        .copied()
        .unwrap_or(RPC_OTHER)
}

/// Which way model request bytes went (the `direction` label of [`MODEL_BYTES_TOTAL`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ModelDirection {
    /// The request body, to the provider.
    Sent,
    /// The response body, back to the runtime.
    Received,
}

impl ModelDirection {
    pub(crate) const ALL: [ModelDirection; 2] = [ModelDirection::Sent, ModelDirection::Received];

    pub(crate) fn label(self) -> &'static str {
        match self {
            ModelDirection::Sent => "sent",
            ModelDirection::Received => "received",
        }
    }
}

/// A tunnelled model request's response head arrived `elapsed` after the request was whole.
pub(crate) fn model_first_byte(elapsed: Duration) {
    histogram!(MODEL_REQUEST_SECONDS, "phase" => "first_byte").record(elapsed.as_secs_f64());
}

/// A tunnelled model request ended (its body streamed, failed or was cancelled).
pub(crate) fn model_request_finished(outcome: ModelOutcome, elapsed: Duration) {
    counter!(MODEL_REQUESTS_TOTAL, "outcome" => outcome.label()).increment(1);
    histogram!(MODEL_REQUEST_SECONDS, "phase" => "total").record(elapsed.as_secs_f64());
}

/// Body bytes of a tunnelled model request went `direction`.
pub(crate) fn model_bytes(direction: ModelDirection, n: u64) {
    counter!(MODEL_BYTES_TOTAL, "direction" => direction.label()).increment(n);
}

/// The guard refused a model request.
pub(crate) fn model_blocked(reason: BlockReason) {
    counter!(MODEL_BLOCKED_TOTAL, "reason" => reason.label()).increment(1);
}

/// One JSON-RPC request to the runtime took `elapsed` (answered or not).
pub(crate) fn rpc_finished(method: &str, elapsed: Duration) {
    histogram!(RPC_DURATION_SECONDS, "method" => rpc_method_label(method))
        .record(elapsed.as_secs_f64());
}

/// How a process start ended (the `result` label of [`PROCESS_SPAWNS_TOTAL`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum SpawnResult {
    /// Started and handshaken.
    Ok,
    /// The runtime failed to start or to handshake (counts towards the restart intensity).
    Error,
    /// The OS had no file descriptors, processes or memory left (never a crash).
    ResourceExhausted,
}

impl SpawnResult {
    /// The `result` label.
    pub(crate) fn label(self) -> &'static str {
        match self {
            SpawnResult::Ok => "ok",
            SpawnResult::Error => "error",
            SpawnResult::ResourceExhausted => "resource_exhausted",
        }
    }
}

impl SpawnResult {
    /// Every value, in a stable order.
    pub(crate) const ALL: [SpawnResult; 3] = [
        SpawnResult::Ok,
        SpawnResult::Error,
        SpawnResult::ResourceExhausted,
    ];
}

/// A process start of `backend` finished; `elapsed` (spawn + handshake) is recorded when it
/// succeeded.
pub(crate) fn process_started(backend: &str, result: SpawnResult, elapsed: Duration) {
    counter!(PROCESS_SPAWNS_TOTAL, "result" => result.label(), "backend" => backend.to_owned())
        .increment(1);
    if result == SpawnResult::Ok {
        histogram!(PROCESS_START_SECONDS, "backend" => backend.to_owned())
            .record(elapsed.as_secs_f64());
    }
}

/// Why a process left the pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ProcessExit {
    /// It died, hung or was killed by someone else.
    Crash,
    /// The pool stopped it (idle, full, drained, a failed detach).
    Evicted,
    /// The pool shut down, or the process ended in an orderly way.
    Shutdown,
    /// A CLI backend's process stopped to start again at once with other settings (its
    /// gateway tools changed, or its MCP bridge expired); the session resumes.
    Recycled,
    /// A one-shot CLI backend's process ended with its turn (any outcome but a crash).
    Completed,
}

impl ProcessExit {
    /// Every value, in a stable order.
    pub(crate) const ALL: [ProcessExit; 5] = [
        ProcessExit::Crash,
        ProcessExit::Evicted,
        ProcessExit::Shutdown,
        ProcessExit::Recycled,
        ProcessExit::Completed,
    ];

    /// The `reason` label.
    pub(crate) fn label(self) -> &'static str {
        match self {
            ProcessExit::Crash => "crash",
            ProcessExit::Evicted => "evicted",
            ProcessExit::Shutdown => "shutdown",
            ProcessExit::Recycled => "recycled",
            ProcessExit::Completed => "completed",
        }
    }
}

/// A process of `backend` left the pool.
pub(crate) fn process_exited(backend: &str, why: ProcessExit) {
    counter!(PROCESS_EXITS_TOTAL, "reason" => why.label(), "backend" => backend.to_owned())
        .increment(1);
}

/// The pool stopped a process of `backend` on its own.
pub(crate) fn evicted(backend: &str, why: Eviction) {
    counter!(EVICTIONS_TOTAL, "reason" => why.label(), "backend" => backend.to_owned())
        .increment(1);
    process_exited(backend, ProcessExit::Evicted);
}

pub(crate) fn storage_write_failed(store: Store) {
    counter!(STORAGE_WRITE_FAILURES_TOTAL, "store" => store.as_str()).increment(1);
}

pub(crate) fn ownership_violated() {
    counter!(OWNERSHIP_VIOLATIONS_TOTAL).increment(1);
}

/// A key of `backend` was quarantined.
pub(crate) fn quarantined(backend: &str) {
    counter!(QUARANTINES_TOTAL, "backend" => backend.to_owned()).increment(1);
}

/// The pool's gauges, set together by the pool actor.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct PoolGauges {
    pub(crate) live: usize,
    pub(crate) draining: usize,
    pub(crate) spare: usize,
    pub(crate) rss_bytes: u64,
    pub(crate) conversations: usize,
    pub(crate) leases: usize,
    pub(crate) waiters: usize,
}

impl PoolGauges {
    pub(crate) fn publish(&self) {
        let copilot = COPILOT_BACKEND;
        gauge!(PROCESSES, "state" => "live", "backend" => copilot).set(self.live as f64);
        gauge!(PROCESSES, "state" => "draining", "backend" => copilot).set(self.draining as f64);
        gauge!(PROCESSES, "state" => "spare", "backend" => copilot).set(self.spare as f64);
        gauge!(PROCESS_RESIDENT_MEMORY_BYTES).set(self.rss_bytes as f64);
        gauge!(CONVERSATIONS_ATTACHED).set(self.conversations as f64);
        leases(copilot, self.leases, self.waiters);
    }
}

/// The leases of `backend` held now and those waiting.
pub(crate) fn leases(backend: &str, active: usize, waiters: usize) {
    gauge!(LEASES_ACTIVE, "backend" => backend.to_owned()).set(active as f64);
    gauge!(LEASE_WAITERS, "backend" => backend.to_owned()).set(waiters as f64);
}

/// The `result` label of a conversation opened for `reason`; `None` for one that was
/// still attached (nothing was resumed or created).
pub(crate) fn resume_result(reason: OpenReason) -> Option<&'static str> {
    Some(match reason {
        OpenReason::Attached => return None,
        OpenReason::Resumed => "resumed",
        OpenReason::New => "new",
        OpenReason::TranscriptMissing => "transcript_missing",
        OpenReason::NotFound => "not_found",
        OpenReason::CompatChanged => "compat_changed",
        OpenReason::ResumeFailed => "resume_failed",
    })
}

/// A conversation of `backend` was opened for `reason`.
pub(crate) fn session_opened(backend: &str, reason: OpenReason) {
    if let Some(result) = resume_result(reason) {
        counter!(SESSION_RESUMES_TOTAL, "result" => result, "backend" => backend.to_owned())
            .increment(1);
    }
}

/// A lease of `backend` was granted after waiting `waited`.
pub(crate) fn lease_granted(backend: &str, waited: Duration) {
    histogram!(LEASE_WAIT_SECONDS, "backend" => backend.to_owned()).record(waited.as_secs_f64());
}

/// A lease of `backend` (a configured id, or [`UNKNOWN_BACKEND`]) failed with an error of
/// `kind`.
pub(crate) fn lease_rejected(backend: &str, kind: ErrorKind) {
    counter!(LEASE_REJECTIONS_TOTAL, "reason" => kind.rejection_label(), "backend" => backend.to_owned())
        .increment(1);
}

pub(crate) fn turn_finished(end: TurnEnd, elapsed: Duration) {
    cli_turn_finished(COPILOT_BACKEND, end, elapsed);
}

/// A turn of backend `backend` (`copilot` or a configured CLI id) ended.
pub(crate) fn cli_turn_finished(backend: &str, end: TurnEnd, elapsed: Duration) {
    counter!(TURNS_TOTAL, "outcome" => end.label(), "backend" => backend.to_owned()).increment(1);
    histogram!(TURN_DURATION_SECONDS, "backend" => backend.to_owned())
        .record(elapsed.as_secs_f64());
}

/// Registers `copilot_pool_fallbacks_total` at zero for every ordered pair of distinct
/// `backends` and every class in `classes` (`crate::fallback::FallbackClass::label` of each),
/// so a first fallback is a rate from zero rather than a series appearing. The daemon calls
/// it with its backend ids: n backends give n(n-1) x 4 series.
pub fn register_fallback_zeroes(backends: &[String], classes: &[&'static str]) {
    for from in backends {
        for to in backends.iter().filter(|to| *to != from) {
            for class in classes {
                counter!(FALLBACKS_TOTAL, "from" => from.clone(), "to" => to.clone(), "class" => *class)
                    .absolute(0);
            }
        }
    }
}

/// A turn failed on backend `from` with retryable `class` (a
/// `crate::fallback::FallbackClass` label) and runs again on `to`. Both are backend ids, so
/// the series are bounded like the `backend` label's.
pub fn fallback(from: &str, to: &str, class: &'static str) {
    counter!(FALLBACKS_TOTAL, "from" => from.to_owned(), "to" => to.to_owned(), "class" => class)
        .increment(1);
}

/// The live processes of CLI backend `backend` (conversations holding one).
pub(crate) fn cli_processes(backend: &str, n: usize) {
    gauge!(PROCESSES, "state" => "live", "backend" => backend.to_owned()).set(n as f64);
}

pub(crate) fn llm_call() {
    counter!(LLM_CALLS_TOTAL).increment(1);
}

/// How a gateway tool call was answered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ToolOutcome {
    Ok,
    Error,
    /// Cancelled by a timeout or the end of the turn before the handler answered.
    Timeout,
}

pub(crate) fn tool_call(outcome: ToolOutcome) {
    let label = match outcome {
        ToolOutcome::Ok => "ok",
        ToolOutcome::Error => "error",
        ToolOutcome::Timeout => "timeout",
    };
    counter!(TOOL_CALLS_TOTAL, "outcome" => label).increment(1);
}

pub(crate) fn hook_failed() {
    counter!(HOOK_FAILURES_TOTAL).increment(1);
}

/// A runtime session event was dropped unread (`rpc::gate`).
pub(crate) fn session_event_unread() {
    counter!(SESSION_EVENTS_UNREAD_TOTAL).increment(1);
}

/// One model call used `n` tokens of `kind`.
pub(crate) fn tokens(backend: &str, kind: TokenKind, n: u64) {
    counter!(TOKENS_TOTAL, "kind" => kind.as_str(), "backend" => backend.to_owned()).increment(n);
}

/// Runs `f` with a recorder of its own (this thread only) and returns what it recorded under
/// `name`, every series' value (tests).
#[cfg(test)]
pub(crate) fn recorded(name: &str, f: impl FnOnce()) -> Vec<metrics_util::debugging::DebugValue> {
    let recorder = metrics_util::debugging::DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    ::metrics::with_local_recorder(&recorder, f);
    snapshotter
        .snapshot()
        .into_vec()
        .into_iter()
        .filter(|(k, ..)| k.key().name() == name)
        .map(|(.., value)| value)
        .collect()
}

#[cfg(test)]
mod tests {
    use std::collections::{HashMap, HashSet};

    use ::metrics::{Key, Label};
    use metrics_util::debugging::{DebugValue, DebuggingRecorder, Snapshotter};
    use metrics_util::{CompositeKey, MetricKind};

    use super::*;

    fn all_names() -> Vec<&'static str> {
        COUNTERS
            .iter()
            .chain(GAUGES)
            .chain(HISTOGRAMS)
            .copied()
            .collect()
    }

    type Entry = (Option<Unit>, Option<String>, DebugValue);

    fn snapshot(snapshotter: &Snapshotter) -> HashMap<CompositeKey, Entry> {
        snapshotter
            .snapshot()
            .into_vec()
            .into_iter()
            .map(|(k, unit, help, value)| (k, (unit, help.map(|h| h.to_string()), value)))
            .collect()
    }

    fn key(
        kind: MetricKind,
        name: &'static str,
        labels: &[(&'static str, &'static str)],
    ) -> CompositeKey {
        let labels: Vec<Label> = labels.iter().map(|(k, v)| Label::new(*k, *v)).collect();
        CompositeKey::new(kind, Key::from_parts(name, labels))
    }

    #[test]
    fn names_follow_the_prometheus_conventions() {
        let names = all_names();
        let unique: HashSet<_> = names.iter().collect();
        assert_eq!(unique.len(), names.len(), "a name is listed twice");
        for name in &names {
            assert!(name.starts_with("copilot_pool_"), "{name}");
            assert!(
                name.chars()
                    .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_'),
                "{name}"
            );
        }
        for name in COUNTERS {
            assert!(name.ends_with("_total"), "{name}");
        }
        for name in HISTOGRAMS {
            assert!(name.ends_with("_seconds"), "{name}");
        }
        for name in GAUGES {
            assert!(!name.ends_with("_total"), "{name}");
        }
        assert!(SECONDS_BUCKETS.windows(2).all(|w| w[0] < w[1]));
        assert_eq!(SECONDS_BUCKETS.first(), Some(&0.001));
        assert!(SECONDS_BUCKETS.contains(&60.0));
    }

    #[test]
    fn the_sandbox_gauge_has_one_series_per_rule() {
        let recorder = DebuggingRecorder::new();
        let snapshotter = recorder.snapshotter();
        ::metrics::with_local_recorder(&recorder, || {
            sandbox_enforced(|rule| rule != SandboxRule::TcpConnect);
            sandbox_wanted(|rule| rule != SandboxRule::TcpBind);
        });
        let snap = snapshot(&snapshotter);
        for (name, open) in [
            (SANDBOX_ENFORCED, SandboxRule::TcpConnect),
            (SANDBOX_WANTED, SandboxRule::TcpBind),
        ] {
            for rule in SandboxRule::ALL {
                let (_, _, value) = snap
                    .get(&key(MetricKind::Gauge, name, &[("rule", rule.as_str())]))
                    .unwrap_or_else(|| panic!("{name} {rule} not recorded"));
                let expected = if rule == open { 0.0 } else { 1.0 };
                assert_eq!(*value, DebugValue::Gauge(expected.into()), "{name} {rule}");
            }
        }
        assert_eq!(snap.len(), 2 * SandboxRule::ALL.len());
    }

    #[test]
    fn an_sdk_connection_leaves_the_gauge_however_its_task_ends() {
        let recorder = DebuggingRecorder::new();
        let snapshotter = recorder.snapshotter();
        ::metrics::with_local_recorder(&recorder, || {
            let _closed = OpenSdkConnection::counted();
            // A task that panics drops what it holds on the way out.
            let panicked = std::panic::catch_unwind(|| {
                let _held = OpenSdkConnection::counted();
                panic!("the connection's task panicked");
            });
            assert!(panicked.is_err());
            let open = OpenSdkConnection::counted();
            drop(open);
        });
        let snap = snapshot(&snapshotter);
        let (_, _, value) = snap
            .get(&key(MetricKind::Gauge, SDK_CONNECTIONS, &[]))
            .expect("recorded");
        assert_eq!(*value, DebugValue::Gauge(0.0.into()));
    }

    #[test]
    fn describe_gives_every_metric_a_unit_and_help() {
        let recorder = DebuggingRecorder::new();
        let snapshotter = recorder.snapshotter();
        ::metrics::with_local_recorder(&recorder, || {
            describe();
            // The debugging recorder reports only registered metrics: touch each once.
            for name in COUNTERS {
                counter!(*name).increment(0);
            }
            for name in GAUGES {
                gauge!(*name).set(0.0);
            }
            for name in HISTOGRAMS {
                histogram!(*name).record(0.0);
            }
        });
        let snap = snapshot(&snapshotter);
        let kinds = [
            (MetricKind::Counter, COUNTERS),
            (MetricKind::Gauge, GAUGES),
            (MetricKind::Histogram, HISTOGRAMS),
        ];
        for (kind, names) in kinds {
            for name in names {
                let (unit, help, _) = snap
                    .get(&key(kind, name, &[]))
                    .unwrap_or_else(|| panic!("{name} was not recorded"));
                let help = help.as_deref().unwrap_or_default();
                assert!(!help.is_empty(), "{name} has no help text");
                let expected = if name.ends_with("_seconds") {
                    Unit::Seconds
                } else if name.ends_with("_bytes") || name.ends_with("_bytes_total") {
                    Unit::Bytes
                } else {
                    Unit::Count
                };
                assert_eq!(unit.as_ref(), Some(&expected), "{name}");
            }
        }
        assert_eq!(snap.len(), all_names().len());
        // A help that lists a label's values lists every value the label takes (what an
        // on-call engineer reads in `# HELP`).
        let help_of = |kind, name| {
            snap.get(&key(kind, name, &[]))
                .and_then(|(_, help, _)| help.as_deref().map(str::to_owned))
                .unwrap_or_default()
        };
        let listed: [(MetricKind, &str, Vec<&str>); 7] = [
            (
                MetricKind::Counter,
                MODEL_BLOCKED_TOTAL,
                BlockReason::ALL.map(BlockReason::label).to_vec(),
            ),
            (
                MetricKind::Gauge,
                PROCESSES,
                vec!["live", "draining", "spare", "backend"],
            ),
            (
                MetricKind::Counter,
                PROCESS_SPAWNS_TOTAL,
                vec!["ok", "error", "resource_exhausted"],
            ),
            (
                MetricKind::Counter,
                LEASE_REJECTIONS_TOTAL,
                ErrorKind::ALL.map(ErrorKind::rejection_label).to_vec(),
            ),
            (
                MetricKind::Counter,
                SESSION_RESUMES_TOTAL,
                OpenReason::ALL
                    .into_iter()
                    .filter_map(resume_result)
                    .collect(),
            ),
            (
                MetricKind::Counter,
                TURNS_TOTAL,
                TurnEnd::ALL.map(TurnEnd::label).to_vec(),
            ),
            (
                MetricKind::Counter,
                EVICTIONS_TOTAL,
                Eviction::ALL.map(Eviction::label).to_vec(),
            ),
        ];
        for (kind, name, values) in listed {
            let help = help_of(kind, name);
            for value in values {
                assert!(help.contains(value), "{name}'s help lacks {value}: {help}");
            }
        }
    }

    #[test]
    fn rpc_method_labels_are_bounded() {
        for method in RPC_METHODS {
            assert_eq!(rpc_method_label(method), *method);
        }
        for method in [
            "llmInference.httpResponseChunk",
            "session.delete",
            "",
            "x".repeat(100).as_str(),
        ] {
            assert_eq!(rpc_method_label(method), RPC_OTHER);
        }
        // The names match the wire types we speak.
        use crate::rpc::messages::*;
        for name in [
            Connect::NAME,
            Ping::NAME,
            SessionCreate::NAME,
            SessionResume::NAME,
            SessionSend::NAME,
            SessionAbort::NAME,
            SessionDetach::NAME,
            SessionCompact::NAME,
            HandlePendingToolCall::NAME,
            HandlePendingPermission::NAME,
        ] {
            assert_eq!(rpc_method_label(name), name);
        }

        let recorder = DebuggingRecorder::new();
        let snapshotter = recorder.snapshotter();
        ::metrics::with_local_recorder(&recorder, || {
            rpc_finished("session.send", Duration::from_millis(250));
            rpc_finished("some.future.method", Duration::from_millis(5));
            rpc_finished("another.one", Duration::from_millis(5));
        });
        let snap = snapshot(&snapshotter);
        assert_eq!(snap.len(), 2);
        let send = &snap[&key(
            MetricKind::Histogram,
            RPC_DURATION_SECONDS,
            &[("method", "session.send")],
        )];
        assert!(matches!(&send.2, DebugValue::Histogram(v) if v.len() == 1 && v[0] == 0.25));
        let other = &snap[&key(
            MetricKind::Histogram,
            RPC_DURATION_SECONDS,
            &[("method", "other")],
        )];
        assert!(matches!(&other.2, DebugValue::Histogram(v) if v.len() == 2));
    }

    #[test]
    fn every_label_set_is_small_distinct_and_in_snake_case() {
        let sets: [(&str, Vec<&str>); 9] = [
            (
                "model outcomes",
                ModelOutcome::ALL.map(ModelOutcome::label).to_vec(),
            ),
            (
                "model block reasons",
                BlockReason::ALL.map(BlockReason::label).to_vec(),
            ),
            (
                "model directions",
                ModelDirection::ALL.map(ModelDirection::label).to_vec(),
            ),
            (
                "resume results",
                OpenReason::ALL
                    .into_iter()
                    .filter_map(resume_result)
                    .collect(),
            ),
            ("turn outcomes", TurnEnd::ALL.map(TurnEnd::label).to_vec()),
            ("evictions", Eviction::ALL.map(Eviction::label).to_vec()),
            (
                "spawn results",
                SpawnResult::ALL.map(SpawnResult::label).to_vec(),
            ),
            (
                "lease rejections",
                ErrorKind::ALL.map(ErrorKind::rejection_label).to_vec(),
            ),
            (
                "token kinds",
                TokenKind::ALL.map(TokenKind::as_str).to_vec(),
            ),
        ];
        for (name, labels) in sets {
            // Small: each label set is a closed enum of at most 20 values (the model guard's
            // block reasons, one per address range and URL check, are the largest).
            assert!(
                !labels.is_empty() && labels.len() <= 20,
                "{name}: {labels:?}"
            );
            for label in &labels {
                assert!(
                    label.bytes().all(|b| b.is_ascii_lowercase() || b == b'_'),
                    "{name}: {label}"
                );
            }
            if name != "lease rejections" {
                let distinct: HashSet<_> = labels.iter().collect();
                assert_eq!(distinct.len(), labels.len(), "{name}: {labels:?}");
            }
        }
        assert_eq!(resume_result(OpenReason::Attached), None);
        assert_eq!(
            resume_result(OpenReason::ResumeFailed),
            Some("resume_failed")
        );
    }

    #[test]
    fn helpers_record_what_they_say() {
        let recorder = DebuggingRecorder::new();
        let snapshotter = recorder.snapshotter();
        ::metrics::with_local_recorder(&recorder, || {
            process_started(COPILOT_BACKEND, SpawnResult::Ok, Duration::from_secs(2));
            process_started(COPILOT_BACKEND, SpawnResult::Error, Duration::from_secs(60));
            process_started("claude-cli", SpawnResult::Ok, Duration::from_millis(30));
            evicted(COPILOT_BACKEND, Eviction::Idle);
            process_exited(COPILOT_BACKEND, ProcessExit::Crash);
            process_exited("claude-cli", ProcessExit::Completed);
            lease_rejected(COPILOT_BACKEND, ErrorKind::WaitersFull);
            lease_rejected(UNKNOWN_BACKEND, ErrorKind::Invalid);
            lease_granted("claude-cli", Duration::from_millis(5));
            quarantined("claude-cli");
            turn_finished(TurnEnd::Timeout, Duration::from_secs(3));
            session_opened(COPILOT_BACKEND, OpenReason::Attached);
            session_opened("claude-cli", OpenReason::Resumed);
            leases("claude-cli", 1, 2);
            tool_call(ToolOutcome::Timeout);
            tokens(COPILOT_BACKEND, TokenKind::Input, 100);
            tokens(COPILOT_BACKEND, TokenKind::Input, 20);
            tokens("claude-cli", TokenKind::Input, 7);
            tokens(COPILOT_BACKEND, TokenKind::CacheRead, 40);
            model_first_byte(Duration::from_millis(500));
            model_request_finished(ModelOutcome::ServerError, Duration::from_secs(2));
            model_bytes(ModelDirection::Sent, 300);
            model_bytes(ModelDirection::Received, 70);
            model_blocked(BlockReason::Metadata);
            PoolGauges {
                live: 3,
                draining: 1,
                spare: 2,
                rss_bytes: 1 << 20,
                conversations: 7,
                leases: 2,
                waiters: 4,
            }
            .publish();
        });
        let snap = snapshot(&snapshotter);
        let counter_of = |name, labels: &[(&'static str, &'static str)]| match snap
            .get(&key(MetricKind::Counter, name, labels))
            .map(|e| &e.2)
        {
            Some(DebugValue::Counter(n)) => *n,
            other => panic!("{name} {labels:?}: {other:?}"),
        };
        let gauge_of = |name, labels: &[(&'static str, &'static str)]| match snap
            .get(&key(MetricKind::Gauge, name, labels))
            .map(|e| &e.2)
        {
            Some(DebugValue::Gauge(v)) => v.into_inner(),
            other => panic!("{name} {labels:?}: {other:?}"),
        };
        let copilot = ("backend", COPILOT_BACKEND);
        let claude = ("backend", "claude-cli");
        assert_eq!(
            counter_of(PROCESS_SPAWNS_TOTAL, &[("result", "ok"), copilot]),
            1
        );
        assert_eq!(
            counter_of(PROCESS_SPAWNS_TOTAL, &[("result", "ok"), claude]),
            1
        );
        assert_eq!(
            counter_of(PROCESS_SPAWNS_TOTAL, &[("result", "error"), copilot]),
            1
        );
        assert_eq!(
            counter_of(EVICTIONS_TOTAL, &[("reason", "idle"), copilot]),
            1
        );
        assert_eq!(
            counter_of(PROCESS_EXITS_TOTAL, &[("reason", "evicted"), copilot]),
            1
        );
        assert_eq!(
            counter_of(PROCESS_EXITS_TOTAL, &[("reason", "crash"), copilot]),
            1
        );
        assert_eq!(
            counter_of(PROCESS_EXITS_TOTAL, &[("reason", "completed"), claude]),
            1
        );
        assert_eq!(
            counter_of(
                LEASE_REJECTIONS_TOTAL,
                &[("reason", "waiters_full"), copilot]
            ),
            1
        );
        assert_eq!(
            counter_of(
                LEASE_REJECTIONS_TOTAL,
                &[("reason", "invalid"), ("backend", "unknown")]
            ),
            1
        );
        assert_eq!(counter_of(QUARANTINES_TOTAL, &[claude]), 1);
        assert_eq!(gauge_of(LEASES_ACTIVE, &[claude]), 1.0);
        assert_eq!(gauge_of(LEASE_WAITERS, &[claude]), 2.0);
        assert!(matches!(
            &snap[&key(MetricKind::Histogram, LEASE_WAIT_SECONDS, &[claude])].2,
            DebugValue::Histogram(v) if v.len() == 1
        ));
        assert_eq!(
            counter_of(
                TURNS_TOTAL,
                &[("outcome", "timeout"), ("backend", "copilot")]
            ),
            1
        );
        assert_eq!(
            counter_of(SESSION_RESUMES_TOTAL, &[("result", "resumed"), claude]),
            1
        );
        assert_eq!(counter_of(TOOL_CALLS_TOTAL, &[("outcome", "timeout")]), 1);
        assert_eq!(counter_of(TOKENS_TOTAL, &[("kind", "input"), copilot]), 120);
        assert_eq!(
            counter_of(
                TOKENS_TOTAL,
                &[("kind", "input"), ("backend", "claude-cli")]
            ),
            7
        );
        assert_eq!(
            counter_of(TOKENS_TOTAL, &[("kind", "cache_read"), copilot]),
            40
        );
        assert_eq!(
            counter_of(MODEL_REQUESTS_TOTAL, &[("outcome", "server_error")]),
            1
        );
        assert_eq!(counter_of(MODEL_BYTES_TOTAL, &[("direction", "sent")]), 300);
        assert_eq!(
            counter_of(MODEL_BYTES_TOTAL, &[("direction", "received")]),
            70
        );
        assert_eq!(
            counter_of(MODEL_BLOCKED_TOTAL, &[("reason", "metadata")]),
            1
        );
        let phase = |p: &'static str| match &snap[&key(
            MetricKind::Histogram,
            MODEL_REQUEST_SECONDS,
            &[("phase", p)],
        )]
            .2
        {
            DebugValue::Histogram(v) => v.iter().map(|x| x.into_inner()).collect::<Vec<_>>(),
            other => panic!("{other:?}"),
        };
        assert_eq!(phase("first_byte"), [0.5]);
        assert_eq!(phase("total"), [2.0]);
        // Only the successful start is timed; an attached conversation is not a resume.
        let starts = &snap[&key(MetricKind::Histogram, PROCESS_START_SECONDS, &[copilot])].2;
        assert!(matches!(starts, DebugValue::Histogram(v) if v.len() == 1 && v[0] == 2.0));
        assert_eq!(
            snap.keys()
                .filter(|k| k.key().name() == SESSION_RESUMES_TOTAL)
                .count(),
            1
        );
        assert_eq!(gauge_of(PROCESSES, &[("state", "live"), copilot]), 3.0);
        assert_eq!(gauge_of(PROCESSES, &[("state", "spare"), copilot]), 2.0);
        assert_eq!(gauge_of(PROCESSES, &[("state", "draining"), copilot]), 1.0);
        assert_eq!(gauge_of(PROCESS_RESIDENT_MEMORY_BYTES, &[]), 1048576.0);
        assert_eq!(gauge_of(CONVERSATIONS_ATTACHED, &[]), 7.0);
        assert_eq!(gauge_of(LEASES_ACTIVE, &[copilot]), 2.0);
        assert_eq!(gauge_of(LEASE_WAITERS, &[copilot]), 4.0);
    }
}
