//! The closed sets of values of the crate, each an enum with `ALL` (what metrics registration
//! and error messages iterate) so a value is spelled in one place:
//!
//! * what the crate reports to callers, dashboards and HTTP clients: how a conversation was
//!   opened ([`OpenReason`]), how a turn ended ([`TurnEnd`]), what kind of failure a pool
//!   error is ([`ErrorKind`]), how a model request through the tunnel ended
//!   ([`ModelOutcome`]), why the model guard refused one ([`BlockReason`]) and how a process
//!   started ahead of demand was primed ([`Priming`]);
//! * what a caller chooses for a conversation's model: [`ReasoningEffort`], and a BYOK
//!   provider's [`ProviderType`] and [`WireApi`]; for a turn: [`SendMode`], [`AgentMode`]
//!   and the [`HookName`]s it wants; and the [`TokenKind`]s its usage counts. These parse from their wire spelling
//!   (`FromStr` and serde), so an unknown value fails where it is read, with an
//!   [`UnknownValue`] error that lists the allowed ones.
//!
//! This module depends on nothing else in the crate but `secret` (an unknown value is shown
//! only when it is a word, never a key pasted into the wrong field); `metrics`, `rpc`, `pool`,
//! `turn` and the HTTP layer all map from it.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// How a lease's CLI session was opened: whether the runtime still had the conversation's
/// context (`Attached`, `Resumed`) or started without it (every other value).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[cfg_attr(feature = "http", derive(utoipa::ToSchema))]
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
    /// Resuming the stored session crashed the runtime `max_resume_crashes` times in a row
    /// (the last within ten minutes): a new session, so the conversation stops taking its
    /// process down.
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
#[cfg_attr(feature = "http", derive(utoipa::ToSchema))]
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

/// How a process started ahead of demand (a warm spare, one more process for a busy key) was
/// primed: what became of its throwaway turn's model call (`pool::prime`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[cfg_attr(feature = "http", derive(utoipa::ToSchema))]
#[serde(rename_all = "snake_case")]
pub enum Priming {
    /// The model guard answered it (a BYOK worker's tunnel): the runtime initialised its model
    /// path on its success path.
    Answered,
    /// No tunnel to answer it: the turn was stopped as it began, and the runtime initialised
    /// its model path up to the call, which the stop dropped before it could fail.
    Stopped,
    /// It failed (nothing listens where it went, or the guard refused it): primed, but the
    /// runtime's failure path leaves it ~30 MiB bigger.
    Refused,
    /// The priming turn failed or ended before its model call: the process serves unprimed.
    Failed,
    /// The priming ran past its limit: the process serves unprimed.
    TimedOut,
}

impl Priming {
    /// Every value, in a stable order.
    pub const ALL: [Priming; 5] = [
        Priming::Answered,
        Priming::Stopped,
        Priming::Refused,
        Priming::Failed,
        Priming::TimedOut,
    ];

    /// The value as serialized.
    pub fn label(self) -> &'static str {
        match self {
            Priming::Answered => "answered",
            Priming::Stopped => "stopped",
            Priming::Refused => "refused",
            Priming::Failed => "failed",
            Priming::TimedOut => "timed_out",
        }
    }
}

/// Why the pool stopped a process on its own.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Eviction {
    /// Unused for the idle TTL.
    Idle,
    /// The pool was full: the least recently used idle process made room.
    Full,
    /// Draining (rotation, turn budget, memory) and done, or past its drain grace.
    Drained,
    /// Detaching a conversation from it failed: it may still hold the session.
    DetachFailed,
    /// A turn did not end after its abort, or a reset's delete failed: it may still run it.
    Unsettled,
}

impl Eviction {
    /// Every value, in a stable order.
    pub const ALL: [Eviction; 5] = [
        Eviction::Idle,
        Eviction::Full,
        Eviction::Drained,
        Eviction::DetachFailed,
        Eviction::Unsettled,
    ];

    /// The label (`copilot_pool_evictions_total{reason}`, as serialized).
    pub fn label(self) -> &'static str {
        match self {
            Eviction::Idle => "idle",
            Eviction::Full => "full",
            Eviction::Drained => "drained",
            Eviction::DetachFailed => "detach_failed",
            Eviction::Unsettled => "unsettled",
        }
    }

    /// What it means, for logs and the demo.
    pub fn describe(self) -> &'static str {
        match self {
            Eviction::Idle => "idle",
            Eviction::Full => "pool full: least recently used idle worker",
            Eviction::Drained => "drained",
            Eviction::DetachFailed => "a detach failed",
            Eviction::Unsettled => "a turn did not end after its abort",
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
    /// Too many leases of the agent are waiting already; other agents' still queue.
    AgentWaitersFull,
    /// The agent ran `max_leases_per_agent` conversations for the whole wait.
    AgentLeasesFull,
    /// The agent keeps `max_conversations_per_agent` conversations; a new one is refused.
    AgentConversationsFull,
    /// The key crashed too often; retry after the cool-down.
    Quarantined,
    /// The pool is shut down or draining.
    Closed,
    /// The machine ran out of file descriptors, processes or memory.
    ResourceExhausted,
    /// The state directory cannot record the conversation.
    StateUnwritable,
    /// The runtime or the turn failed (a crash, a timeout, an error answer, a caller that read
    /// the turn's events too slowly).
    Runtime,
    /// A bug.
    Internal,
}

impl ErrorKind {
    /// Every value, in a stable order.
    pub const ALL: [ErrorKind; 15] = [
        ErrorKind::Invalid,
        ErrorKind::NotFound,
        ErrorKind::Busy,
        ErrorKind::BusyTimeout,
        ErrorKind::NoCapacity,
        ErrorKind::WaitersFull,
        ErrorKind::AgentWaitersFull,
        ErrorKind::AgentLeasesFull,
        ErrorKind::AgentConversationsFull,
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
            ErrorKind::AgentWaitersFull => "agent_waiters_full",
            ErrorKind::AgentLeasesFull => "agent_leases_full",
            ErrorKind::AgentConversationsFull => "agent_conversations_full",
            ErrorKind::Quarantined => "quarantined",
            ErrorKind::Closed => "closed",
            ErrorKind::ResourceExhausted => "resource_exhausted",
            ErrorKind::StateUnwritable => "state_unwritable",
            ErrorKind::Runtime | ErrorKind::Internal => "error",
        }
    }
}

/// A value read from a caller (an HTTP body, a config, a string) that is not in its closed
/// set.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "{what} {} is not allowed; use one of {allowed}",
    crate::secret::shown_if_a_word(value)
)]
pub struct UnknownValue {
    /// What was read, e.g. `provider.type`.
    pub what: &'static str,
    /// The value as given.
    pub value: String,
    /// The allowed values, comma-separated.
    pub allowed: String,
}

/// A closed set spelled on the wire as lowercase words: the enum, `ALL`, `as_str`, `Display`,
/// `FromStr` (an [`UnknownValue`] lists the allowed values) and serde through those.
macro_rules! wire_enum {
    (
        $(#[$meta:meta])*
        pub enum $name:ident as $what:literal {
            $( $(#[$vmeta:meta])* $variant:ident = $label:literal, )+
        }
    ) => {
        $(#[$meta])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        pub enum $name {
            $( $(#[$vmeta])* $variant, )+
        }

        impl $name {
            /// Every value, in a stable order.
            pub const ALL: [$name; [$($label),+].len()] = [$($name::$variant),+];

            /// The wire spelling.
            pub fn as_str(self) -> &'static str {
                match self {
                    $( $name::$variant => $label, )+
                }
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(self.as_str())
            }
        }

        impl FromStr for $name {
            type Err = UnknownValue;

            fn from_str(value: &str) -> Result<Self, UnknownValue> {
                Self::ALL
                    .into_iter()
                    .find(|v| v.as_str() == value)
                    .ok_or_else(|| UnknownValue {
                        what: $what,
                        value: value.to_owned(),
                        allowed: Self::ALL.map($name::as_str).join(", "),
                    })
            }
        }

        impl Serialize for $name {
            fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
                serializer.serialize_str(self.as_str())
            }
        }

        impl<'de> Deserialize<'de> for $name {
            fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
                let value = String::deserialize(deserializer)?;
                value.parse().map_err(serde::de::Error::custom)
            }
        }

        /// The HTTP API's document: a string, one of `ALL`'s spellings.
        #[cfg(feature = "http")]
        impl utoipa::PartialSchema for $name {
            fn schema() -> utoipa::openapi::RefOr<utoipa::openapi::schema::Schema> {
                utoipa::openapi::ObjectBuilder::new()
                    .schema_type(utoipa::openapi::schema::Type::String)
                    .enum_values(Some(Self::ALL.map($name::as_str)))
                    .into()
            }
        }

        #[cfg(feature = "http")]
        impl utoipa::ToSchema for $name {}
    };
}

wire_enum! {
    /// How hard the model thinks (`reasoningEffort` of `session.create`/`session.resume`).
    pub enum ReasoningEffort as "reasoning_effort" {
        /// `low`.
        Low = "low",
        /// `medium`.
        Medium = "medium",
        /// `high`.
        High = "high",
        /// `xhigh`.
        XHigh = "xhigh",
    }
}

wire_enum! {
    /// Which API family a BYOK provider speaks (`provider.type`; the runtime's default is
    /// `openai`).
    pub enum ProviderType as "provider.type" {
        /// OpenAI or an OpenAI-compatible endpoint.
        OpenAi = "openai",
        /// Azure OpenAI.
        Azure = "azure",
        /// Anthropic.
        Anthropic = "anthropic",
    }
}

wire_enum! {
    /// Which OpenAI wire API a BYOK provider is called with (`provider.wireApi`; the
    /// runtime's default is `completions`).
    pub enum WireApi as "provider.wire_api" {
        /// `/chat/completions`.
        Completions = "completions",
        /// `/responses`.
        Responses = "responses",
    }
}

wire_enum! {
    /// How a turn's message is delivered (`mode` of `session.send`; the runtime's default is
    /// `enqueue`).
    pub enum SendMode as "mode" {
        /// Appended to the session's message queue.
        Enqueue = "enqueue",
        /// Interjected into the turn in progress.
        Immediate = "immediate",
    }
}

wire_enum! {
    /// The agent mode a turn's message is sent in (`agentMode` of `session.send`; the
    /// runtime's default is the session's current mode).
    pub enum AgentMode as "agent_mode" {
        /// Responding interactively.
        Interactive = "interactive",
        /// Preparing a plan before changing anything.
        Plan = "plan",
        /// Working autonomously towards task completion.
        Autopilot = "autopilot",
        /// Shell-focused.
        Shell = "shell",
    }
}

wire_enum! {
    /// A [`crate::turn::TurnHooks`] method, by name: what an HTTP turn's `hooks` list asks
    /// for.
    pub enum HookName as "hooks" {
        /// `before_prompt_build` (`hooks.invoke userPromptSubmitted`).
        BeforePromptBuild = "before_prompt_build",
        /// `llm_input` (`assistant.turn_start`).
        LlmInput = "llm_input",
        /// `llm_output` (`assistant.message`).
        LlmOutput = "llm_output",
        /// `agent_end` (`hooks.invoke agentStop`).
        AgentEnd = "agent_end",
        /// `before_compaction` (`session.compaction_start`).
        BeforeCompaction = "before_compaction",
        /// `after_compaction` (`session.compaction_complete`).
        AfterCompaction = "after_compaction",
        /// `before_tool_call` (`hooks.invoke preToolUse`).
        BeforeToolCall = "before_tool_call",
        /// `after_tool_call` (`hooks.invoke postToolUse` / `postToolUseFailure`).
        AfterToolCall = "after_tool_call",
    }
}

wire_enum! {
    /// Whether workers run in a sandbox (`sandbox` in the daemon's config).
    pub enum SandboxMode as "sandbox" {
        /// Enforce what the kernel supports, log and report what it does not.
        Auto = "auto",
        /// Refuse to start unless every wall is enforced.
        Required = "required",
        /// No sandbox: workers run with the daemon's own rights.
        Off = "off",
    }
}

wire_enum! {
    /// One wall of a worker's sandbox (`copilot_pool_sandbox_enforced{rule}`).
    #[non_exhaustive]
    pub enum SandboxRule as "rule" {
        /// Files: read and write only in the agent's own directories, read and execute in
        /// the system and runtime directories, of `/proc` only its own entry.
        Filesystem = "filesystem",
        /// TCP connect only to the allowed ports (Landlock ABI 4+).
        TcpConnect = "tcp_connect",
        /// TCP bind only to an ephemeral port (port 0: the kernel picks a free one) or a
        /// configured fixed one, so no agent takes a port another party needs (ABI 4+).
        TcpBind = "tcp_bind",
        /// No signal to a process outside the worker's own sandbox (ABI 6+).
        Signals = "signals",
        /// No connection to an abstract Unix socket made outside it (ABI 6+).
        AbstractUnixSockets = "abstract_unix_sockets",
        /// Every capability dropped before the runtime starts (root included).
        Capabilities = "capabilities",
    }
}

wire_enum! {
    /// The kinds of tokens a turn's usage counts (`copilot_pool_tokens_total{kind}`).
    pub enum TokenKind as "kind" {
        /// Prompt tokens.
        Input = "input",
        /// Completion tokens.
        Output = "output",
        /// Prompt tokens read from the provider's prompt cache.
        CacheRead = "cache_read",
        /// Prompt tokens written to the provider's prompt cache.
        CacheWrite = "cache_write",
    }
}

/// Why the model guard refused a model request before any connection was made: a
/// tunnelled request, or a CLI backend's provider at its lease (the `reason` label of
/// `copilot_pool_model_blocked_total`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum BlockReason {
    /// Not `https` (plain `http` only to loopback with `allow_private_endpoints`).
    Scheme,
    /// A user name or password in the URL.
    Userinfo,
    /// A query parameter that looks like a credential (`key`, `token`, `sig`, …).
    CredentialQuery,
    /// The request was not for the worker's provider (another host or path).
    ForeignUrl,
    /// The request body exceeds the limit.
    BodyTooLarge,
    /// A loopback address.
    Loopback,
    /// An RFC 1918 private address.
    Private,
    /// A shared (carrier-grade NAT) address.
    Shared,
    /// A link-local address.
    LinkLocal,
    /// An IPv6 unique local address.
    UniqueLocal,
    /// A cloud metadata service.
    Metadata,
    /// A multicast or broadcast address.
    Multicast,
    /// The unspecified address.
    Unspecified,
    /// A documentation range.
    Documentation,
    /// Another special-purpose or reserved range.
    Reserved,
    /// A port a CLI backend's provider may not name.
    Port,
    /// An address of this machine's own interfaces (its public address).
    ThisHost,
}

impl BlockReason {
    /// Every value, in a stable order.
    pub const ALL: [BlockReason; 17] = [
        BlockReason::Scheme,
        BlockReason::Userinfo,
        BlockReason::CredentialQuery,
        BlockReason::ForeignUrl,
        BlockReason::BodyTooLarge,
        BlockReason::Loopback,
        BlockReason::Private,
        BlockReason::Shared,
        BlockReason::LinkLocal,
        BlockReason::UniqueLocal,
        BlockReason::Metadata,
        BlockReason::Multicast,
        BlockReason::Unspecified,
        BlockReason::Documentation,
        BlockReason::Reserved,
        BlockReason::Port,
        BlockReason::ThisHost,
    ];

    /// The label, as serialized.
    pub fn label(self) -> &'static str {
        match self {
            BlockReason::Scheme => "scheme",
            BlockReason::Userinfo => "userinfo",
            BlockReason::CredentialQuery => "credential_query",
            BlockReason::ForeignUrl => "foreign_url",
            BlockReason::BodyTooLarge => "body_too_large",
            BlockReason::Loopback => "loopback",
            BlockReason::Private => "private",
            BlockReason::Shared => "shared",
            BlockReason::LinkLocal => "link_local",
            BlockReason::UniqueLocal => "unique_local",
            BlockReason::Metadata => "metadata",
            BlockReason::Multicast => "multicast",
            BlockReason::Unspecified => "unspecified",
            BlockReason::Documentation => "documentation",
            BlockReason::Reserved => "reserved",
            BlockReason::Port => "port",
            BlockReason::ThisHost => "this_host",
        }
    }
}

/// How one model request through the tunnel ended (the `outcome` label of
/// `copilot_pool_model_requests_total`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ModelOutcome {
    /// A 2xx or 3xx answer, streamed to its end.
    Ok,
    /// The provider answered 4xx.
    ClientError,
    /// The provider answered 5xx.
    ServerError,
    /// Refused by the guard before any connection.
    Blocked,
    /// No connection: DNS, TCP or TLS failed.
    ConnectError,
    /// The connect, first-byte or idle timeout expired.
    Timeout,
    /// The response body broke off.
    StreamError,
    /// The runtime cancelled the request, or the worker ended.
    Cancelled,
}

impl ModelOutcome {
    /// Every value, in a stable order.
    pub const ALL: [ModelOutcome; 8] = [
        ModelOutcome::Ok,
        ModelOutcome::ClientError,
        ModelOutcome::ServerError,
        ModelOutcome::Blocked,
        ModelOutcome::ConnectError,
        ModelOutcome::Timeout,
        ModelOutcome::StreamError,
        ModelOutcome::Cancelled,
    ];

    /// The label, as serialized.
    pub fn label(self) -> &'static str {
        match self {
            ModelOutcome::Ok => "ok",
            ModelOutcome::ClientError => "client_error",
            ModelOutcome::ServerError => "server_error",
            ModelOutcome::Blocked => "blocked",
            ModelOutcome::ConnectError => "connect_error",
            ModelOutcome::Timeout => "timeout",
            ModelOutcome::StreamError => "stream_error",
            ModelOutcome::Cancelled => "cancelled",
        }
    }

    /// The outcome of an answer with this status that streamed to its end.
    pub fn of_status(status: u16) -> Self {
        match status {
            500.. => ModelOutcome::ServerError,
            400..=499 => ModelOutcome::ClientError,
            _ => ModelOutcome::Ok,
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
    fn every_eviction_serializes_as_its_metric_label() {
        for reason in Eviction::ALL {
            assert_eq!(
                serde_json::to_value(reason).expect("serialize"),
                reason.label()
            );
        }
    }

    #[test]
    fn every_priming_serializes_as_its_label() {
        for priming in Priming::ALL {
            assert_eq!(
                serde_json::to_value(priming).expect("serialize"),
                priming.label()
            );
        }
    }

    #[test]
    fn every_turn_end_serializes_as_its_label() {
        for end in TurnEnd::ALL {
            assert_eq!(serde_json::to_value(end).expect("serialize"), end.label());
        }
    }

    #[test]
    fn every_caller_choice_round_trips_through_its_wire_spelling() {
        fn check<T>(all: &[T])
        where
            T: Copy + PartialEq + fmt::Debug + fmt::Display + FromStr + Serialize,
            T: for<'de> Deserialize<'de>,
            <T as FromStr>::Err: fmt::Debug,
        {
            for v in all {
                let label = v.to_string();
                assert_eq!(serde_json::to_value(v).expect("serialize"), label.as_str());
                assert_eq!(label.parse::<T>().expect("parse"), *v);
                let back: T = serde_json::from_value(label.clone().into()).expect("deserialize");
                assert_eq!(back, *v);
            }
        }
        check(&ReasoningEffort::ALL);
        check(&ProviderType::ALL);
        check(&WireApi::ALL);
        check(&SendMode::ALL);
        check(&AgentMode::ALL);
        check(&HookName::ALL);
        check(&TokenKind::ALL);
        check(&SandboxMode::ALL);
        check(&SandboxRule::ALL);
        assert_eq!(ReasoningEffort::XHigh.as_str(), "xhigh");
        assert_eq!(ProviderType::OpenAi.as_str(), "openai");
    }

    #[test]
    fn an_unknown_choice_is_refused_with_the_field_and_the_allowed_values() {
        let err = "extreme".parse::<ReasoningEffort>().unwrap_err();
        assert_eq!(
            err.to_string(),
            "reasoning_effort \"extreme\" is not allowed; use one of low, medium, high, xhigh"
        );
        let err = serde_json::from_str::<ProviderType>("\"gemini\"").unwrap_err();
        assert!(
            err.to_string().contains(
                "provider.type \"gemini\" is not allowed; use one of openai, azure, anthropic"
            ),
            "{err}"
        );
        let err = serde_json::from_str::<WireApi>("\"chat\"").unwrap_err();
        assert!(
            err.to_string().contains(
                "provider.wire_api \"chat\" is not allowed; use one of completions, responses"
            ),
            "{err}"
        );
        // Named as the HTTP API spells the field.
        let err = serde_json::from_str::<AgentMode>("\"yolo\"").unwrap_err();
        assert!(
            err.to_string()
                .starts_with("agent_mode \"yolo\" is not allowed"),
            "{err}"
        );
        // Case matters on the wire, as in the runtime.
        assert!("High".parse::<ReasoningEffort>().is_err());
    }
}
