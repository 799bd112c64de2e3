//! Priming a process started ahead of demand (a warm spare, or one more process for a busy
//! key) before placement hears of it. The runtime initialises itself on the first turn of a
//! process: a new conversation's first turn took 190–480 ms on a fresh process against
//! ~32 ms on one that had served a turn, and a `session.create` alone did not change it.
//! So the priming runs one turn of a throwaway session whose model endpoint refuses at once
//! (loopback port 1, a dummy key: no model is called, nothing leaves the machine, no
//! credential is used; through a BYOK worker's tunnel the guard answers it quietly), aborts it at the first failed model call (the runtime would retry for
//! ~23 s), and deletes the session. A priming that fails or runs past its limit leaves an
//! unprimed but healthy process.

use std::path::Path;
use std::time::Duration;

use crate::rpc::messages::{ProviderConfig, SessionConfig};
use crate::secret::Secret;
use crate::worker::{Session, SessionUpdate, WorkerError, WorkerHandle};

/// How long a priming may take in all (its abort included).
pub(crate) const PRIME_LIMIT: Duration = Duration::from_secs(5);

/// The model endpoint of the priming turn: nothing listens on loopback port 1 (and a
/// sandboxed worker may not connect to it), so the call fails at once; a BYOK worker's
/// tunnel answers it without a provider.
const REFUSING_ENDPOINT: &str = crate::model_guard::PRIMING_BASE_URL;

/// Why a priming stopped short.
#[derive(Debug, thiserror::Error)]
pub(crate) enum PrimeError {
    #[error("the priming session failed: {0}")]
    Worker(#[from] WorkerError),
    #[error("the priming turn ended before its model call")]
    Ended,
}

/// Runs the priming turn on `worker` (see the module doc), bounded by the caller.
pub(crate) async fn prime(
    worker: &WorkerHandle,
    working_directory: &Path,
) -> Result<(), PrimeError> {
    let config = SessionConfig {
        model: Some("copilot-pool-prime".to_owned()),
        provider: Some(ProviderConfig::openai(
            REFUSING_ENDPOINT,
            Some(Secret::new("copilot-pool-prime")),
        )),
        working_directory: Some(working_directory.display().to_string()),
        available_tools: Some(Vec::new()),
        streaming: false,
        ..Default::default()
    };
    let mut session = worker.create_session(config).await?;
    let ran = run_to_first_model_call(&mut session).await;
    // Whatever happened, the turn is stopped and the session removed (its state too).
    let _ = session.abort_and_settle(PRIME_LIMIT).await;
    session.delete().await?;
    ran
}

async fn run_to_first_model_call(session: &mut Session) -> Result<(), PrimeError> {
    session.send("copilot-pool priming turn").await?;
    while let Some(update) = session.next().await {
        match update {
            SessionUpdate::Event(event) => match event.event_type() {
                // The model path is initialised once a call was attempted.
                "model.call_failure" | "model.call_finished" | "session.error" => return Ok(()),
                "session.idle" => return Err(PrimeError::Ended),
                _ => {}
            },
            SessionUpdate::Ended(error) => return Err(PrimeError::Worker(error)),
            // Nothing is offered to the priming turn: requests are refused by their drop.
            _ => {}
        }
    }
    Err(PrimeError::Ended)
}
