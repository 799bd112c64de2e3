//! A scripted model that we own, for tests and the `copilot-pool run` demo. It is never on
//! a production path.
//!
//! It speaks every wire format a BYOK provider shape uses, chosen by the path a model call
//! is posted to ([`WireFormat`]): OpenAI chat completions (`…/chat/completions`: `openai`,
//! azure, OpenAI-compatible local servers), the OpenAI responses API (`…/responses`),
//! Anthropic messages (`…/messages`) and the Gemini API (`…/models/<m>:generateContent`,
//! `:streamGenerateContent`), each as one JSON document or as server-sent events, tool calls
//! included. Real Copilot CLI processes reach it either over HTTP — a BYOK
//! provider whose base URL points at [`ScriptedModel::serve_http`] — or through the
//! JSON-RPC model tunnel, for which [`ScriptedModel`] implements
//! [`crate::tunnel::ModelTunnel`]. Both transports share one decision function and the same
//! renderers, so they answer identically. A runtime in token mode reaches it as the Copilot
//! API, through [`ScriptedModel::serve_copilot_api`].
//!
//! What it answers is scripted by directives in the last user message (`SCENARIO:tool`,
//! `SCENARIO:slow`, `SCENARIO:error`, `SCENARIO:flood`, `REPLY=`; see [`script`]) or by
//! replies queued with [`ScriptedModel::push_reply`]. Every request is recorded with its
//! headers and query ([`ScriptedModel::requests`]) and tests can await the log
//! ([`ScriptedModel::wait_for_requests`]) instead of sleeping.
//!
//! Modules, one job each:
//! * [`script`] — deciding the answer from a request (pure);
//! * `openai` — rendering an answer as `chat.completion` JSON or SSE chunks;
//! * `responses` — reading a responses-API request, rendering a `response` or its events;
//! * `anthropic` — reading a messages request, rendering a `message` or its events;
//! * `gemini` — reading a `generateContent` request, rendering a `GenerateContentResponse`
//!   or its SSE chunks, and answering Gemini CLI's JSON-mode router calls from their schema;
//! * `stream` — the timing of the responses, messages and Gemini streams (slow, flood, hang);
//! * `model` — the shared state and the request router;
//! * `log` — the request log;
//! * `http` — the loopback axum endpoint;
//! * [`copilot_api`] — a GitHub API and Copilot API stand-in around the model, for a runtime
//!   in token mode (GitHub tokens, no BYOK provider) with fake tokens;
//! * `tunnel` — the [`crate::tunnel::ModelTunnel`] implementation;
//! * `error` — [`ScriptedModelError`].

mod anthropic;
pub mod copilot_api;
mod error;
mod gemini;
mod http;
mod log;
mod model;
mod openai;
mod responses;
pub mod script;
mod stream;
mod tunnel;

pub use copilot_api::{CopilotApiStandIn, StandInRequest};
pub use error::ScriptedModelError;
pub use http::HttpEndpoint;
pub use log::{Answer, RecordedRequest, Transport};
pub use model::{ScriptedModel, WireFormat};
pub use script::{Decision, Reply};
