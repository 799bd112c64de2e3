//! copilot-pool supervises GitHub Copilot CLI processes ("the runtime") for multi-agent
//! gateways: one actor per child process, which owns the process group, the JSON-RPC
//! connection and health, and fails all in-flight work the instant the child dies.
//!
//! # A gateway's view
//!
//! Start one [`Pool`] per process and [`Pool::lease`] a conversation (an agent id and the
//! gateway's session key) for each turn. The pool picks or starts the runtime process,
//! attaches or resumes the conversation's CLI session, and gives back a [`Lease`]; its
//! [`Lease::run`] answers gateway tools, permission prompts and questions through the
//! conversation's [`TurnHandlers`] and returns a [`TurnOutcome`] (its text, how the turn
//! ended, how the conversation was opened, token usage). Dropping the lease returns the
//! conversation. Errors are [`PoolError`]s; [`PoolError::kind`] says what to do about one.
//!
//! Configs, requests, errors, events and outcomes are `#[non_exhaustive]`: start a config
//! from its constructor or `Default` ([`PoolConfig::new`], [`LeaseRequest::new`],
//! `http::ApiConfig::default()`) and set the public fields you need, as below, so a field
//! added later never breaks a caller.
//!
//! ```
//! # #[tokio::main(flavor = "multi_thread", worker_threads = 2)]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! use copilot_pool::rpc::messages::ProviderConfig;
//! use copilot_pool::scripted_model::ScriptedModel;
//! use copilot_pool::{LeaseRequest, OpenReason, Pool, PoolConfig, TurnEnd, runtime, worker};
//!
//! // The pinned runtime (installed with npm into the cache once) and a model to talk to:
//! // here the scripted one this crate ships for tests; a gateway passes its provider.
//! let cache = runtime::cache_dir(runtime::process_env)?;
//! let installed = runtime::install(runtime::Flavour::Runtime, &cache).await?;
//! let model = ScriptedModel::new();
//! let endpoint = model.serve_http().await?;
//!
//! let dir = tempfile::tempdir()?;
//! let worker = worker::WorkerConfig::new(installed.executable, "".into(), "".into());
//! let mut config = PoolConfig::new(worker, dir.path().join("state"), dir.path().join("agents"));
//! // The scripted model listens on loopback: let the guarded model path reach it.
//! config.model_guard.allow_private_endpoints = true;
//! let pool = Pool::start(config).await?;
//!
//! let mut request = LeaseRequest::new("agent-1", "conversation-1", dir.path().to_path_buf());
//! request.model = Some(ScriptedModel::MODEL_ID.to_owned());
//! request.provider = Some(ProviderConfig::openai(endpoint.base_url(), None));
//! let mut lease = pool.lease(request).await?;
//! let outcome = lease.run("REPLY=hello").await?;
//! assert_eq!(outcome.text, "hello");
//! assert_eq!(outcome.end, Some(TurnEnd::Idle));
//! assert_eq!(outcome.open_reason, Some(OpenReason::New));
//! drop(lease);
//! pool.shutdown().await?;
//! # Ok(())
//! # }
//! ```
//!
//! # Layout
//!
//! * [`pool`] — keyed leasing of conversations across workers: caps, waiters, crash
//!   restart, durable bindings, rotation, eviction. [`pool::Pool::lease`] is the entry point.
//! * [`turn`] — what a conversation brings to a turn: gateway tools, permission policy,
//!   ask_user, hooks, timeouts, the transcript mirror; and what a turn produced.
//! * [`ids`] — [`ConversationId`] (agent + the gateway's session key) and [`CliSessionId`]
//!   (the runtime's id of the CLI session holding a conversation's history).
//! * [`kinds`] — the closed sets of values the crate reports (open reasons, turn ends,
//!   error kinds), each spelled once.
//! * [`backend`] — agent CLIs other than Copilot as backends: the backend kinds, the CLI
//!   backend configuration, the events every backend's turn speaks, and the two runners:
//!   Claude Code as one live stdio process per conversation ([`backend::claude_live`]) and a
//!   process per turn for Codex and Gemini CLI ([`backend::oneshot`]). The pool leases their
//!   conversations ([`pool::Pool::lease_cli`]).
//! * [`fallback`] — a turn that runs on the next backend of its chain when one fails with a
//!   retryable class, seeded with a prelude from the failed conversation's transcript:
//!   [`fallback::ChainLease::start`], then [`fallback::ChainLease::run`].
//! * [`replica`] — which of N `serve` replicas an agent goes to (rendezvous hashing).
//! * [`auth`] — which credentials a lease runs with (precedence, fingerprints).
//! * [`home`] — each agent's COPILOT_HOME.
//! * [`confine`] — paths a caller names, kept inside allowed roots (links and `..` resolved).
//! * `agent_files` — files in an agent's own directories as the unsandboxed pool opens them:
//!   never through a link the agent planted, never blocking on a FIFO, reads bounded.
//! * [`worker`] — one supervised CLI child: [`worker::WorkerHandle`] starts it and opens
//!   [`worker::Session`]s whose update streams carry events and server requests.
//! * [`rpc`] — the wire: `Content-Length` framing, the JSON-RPC 2.0 connection, typed
//!   messages and session events.
//! * [`process`] — a child in its own process group: stderr tail, reaping, TERM→grace→KILL.
//!   Runtimes die with the daemon (a parent-death signal), and [`group_ledger`] records their
//!   groups so a restarted daemon kills the survivors of its previous life first.
//! * [`runtime`] — the pinned runtime: install with npm, locate at run time.
//! * [`tunnel`] — serving the runtime's model HTTP requests over the pipe: the
//!   [`tunnel::ModelTunnel`] trait, its request/response shapes and the `llmInference.*` frames.
//! * [`model_guard`] — the guarded model path of BYOK workers: the pool's own HTTP client
//!   behind the tunnel (SSRF checks, DNS pinning, the real key kept out of the child).
//! * `http` — the HTTP API (`router`, `serve`) that `copilot-pool serve` runs, for a Rust
//!   gateway to mount in its own axum app (feature `http`, on by default through `cli`).
//! * `sdk_endpoint` — the runtime's own JSON-RPC protocol on TCP or a Unix socket, so an
//!   official Copilot SDK attaches to the pool by URL (feature `sdk-endpoint`, on by default
//!   through `cli`).
//! * `chat_completion` — the OpenAI chat-completions wire format rendered once, for the
//!   scripted model and the guard's answer to a priming call.
//! * `scripted_model` — the OpenAI-compatible model we own, for tests and the demo
//!   (feature `scripted-model`, on by default through `cli`).
//! * [`faults`] — faults injected on purpose (failing durable writes) for chaos runs.
//! * [`secret`] — a redacting wrapper for tokens and keys.
//! * [`permission`] — the runtime's permission prompts parsed, the policies that answer them
//!   (fail closed, reject-all by default) and the decision sent back.
//! * [`provider`] — BYOK provider shapes: which `provider` objects the runtime can serve,
//!   and the checks that refuse the rest before anything runs.
//! * [`transcript`] — the transcript mirror: each conversation's append-only JSONL record,
//!   de-duplicated across re-emissions and restarts.
//! * [`metrics`] — every Prometheus metric the pool records (names, labels, units), through
//!   the `metrics` facade; the daemon installs the recorder.
//! * [`sandbox`] — the walls around a worker, as a description its wrapper enforces.
//! * [`session_options`] — the runtime's `session.create` fields a caller may set, checked
//!   against the runtime's schema, and where their directories may lie.
//! * [`listener`] (features `http`, `mcp-bridge`) — HTTP connections accepted with a cap,
//!   timeouts and a graceful stop: the API's (also `http::serve`) and each MCP bridge's.
//!
//! Also: `low_latency` (TCP tuning of the accepted connections of both surfaces),
//! `json_values` (how many JSON values a peer's message holds, counted before it is parsed),
//! `media_type` (a media type's essence, for the attachments and the tunnel), `deadline`
//! (deadlines that never overflow), `panic_guard` (a gateway's handler that panics becomes
//! an answer, never a runtime left waiting) and a hidden `fuzzing` module (entry points for
//! `tests/fuzz`).
//!
//! The library installs nothing global: no tracing subscriber, metrics recorder, signal
//! handler or registered actor name. See `ARCHITECTURE.md` for the invariants.

mod agent_files;
pub mod auth;
pub mod backend;
mod chat_completion;
pub mod confine;
mod deadline;
pub mod fallback;
pub mod faults;
#[doc(hidden)]
pub mod fuzzing;
pub mod group_ledger;
pub mod home;
#[cfg(feature = "http")]
pub mod http;
pub mod ids;
mod json_values;
pub mod kinds;
#[cfg(any(feature = "http", feature = "mcp-bridge"))]
pub mod listener;
#[cfg(any(feature = "http", feature = "sdk-endpoint", feature = "mcp-bridge"))]
mod low_latency;
mod media_type;
pub mod metrics;
pub mod model_guard;
mod panic_guard;
pub mod permission;
pub mod pool;
pub mod process;
pub mod provider;
pub mod replica;
pub mod rpc;
pub mod runtime;
pub mod sandbox;
#[cfg(feature = "scripted-model")]
pub mod scripted_model;
#[cfg(feature = "sdk-endpoint")]
pub mod sdk_endpoint;
pub mod secret;
pub mod session_options;
pub mod transcript;
pub mod tunnel;
pub mod turn;
pub mod worker;

// What a gateway uses, at the root.
pub use auth::LeaseAuth;
pub use ids::{CliSessionId, ConversationId};
pub use kinds::{ErrorKind, OpenReason, ProviderType, ReasoningEffort, TurnEnd, WireApi};
pub use pool::{Lease, LeaseRequest, Pool, PoolConfig, PoolError, PoolEvent, PoolStatus};
pub use secret::Secret;
pub use session_options::SessionOptions;
pub use turn::{TranscriptSettings, TurnHandlers, TurnOutcome, TurnTimeouts};
pub use worker::WorkerError;
