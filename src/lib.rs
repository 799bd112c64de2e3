//! copilot-pool supervises GitHub Copilot CLI processes ("the runtime") for multi-agent
//! gateways: one actor per child process, which owns the process group, the JSON-RPC
//! connection and health, and fails all in-flight work the instant the child dies.
//!
//! # Layout
//!
//! * [`pool`] — keyed leasing of conversations across workers: caps, waiters, crash
//!   restart, durable bindings, rotation, eviction. [`pool::Pool::lease`] is the entry point.
//! * [`routing`] — which of N `serve` replicas an agent goes to (rendezvous hashing).
//! * [`auth`] — which credentials a lease runs with (precedence, fingerprints).
//! * [`home`] — each agent's COPILOT_HOME.
//! * [`worker`] — one supervised CLI child: [`worker::WorkerHandle`] starts it and opens
//!   [`worker::Session`]s whose update streams carry events and server requests.
//! * [`rpc`] — the wire: `Content-Length` framing, the JSON-RPC 2.0 connection, typed
//!   messages and session events.
//! * [`process`] — a child in its own process group: stderr tail, reaping, TERM→grace→KILL.
//! * [`runtime`] — the pinned runtime: install with npm, locate at run time.
//! * [`tunnel`] — serving the runtime's model HTTP requests over the pipe.
//! * `scripted_model` — the OpenAI-compatible model we own, for tests and the demo
//!   (feature `scripted-model`, on by default through `cli`).
//! * [`secret`] — a redacting wrapper for tokens and keys.
//!
//! The library installs nothing global: no tracing subscriber, metrics recorder, signal
//! handler or registered actor name. See `ARCHITECTURE.md` for the invariants.

pub mod auth;
mod deadline;
pub mod home;
pub mod metrics;
mod panic_guard;
pub mod permission;
pub mod pool;
pub mod process;
pub mod routing;
pub mod rpc;
pub mod runtime;
#[cfg(feature = "scripted-model")]
pub mod scripted_model;
pub mod secret;
pub mod transcript;
pub mod tunnel;
pub mod turn;
pub mod worker;
