//! Priming a process started ahead of demand (a warm spare, or one more process for a busy
//! key) before placement hears of it. The runtime initialises itself on the first turn of a
//! process: a new conversation's first turn took 190–480 ms on a fresh process against
//! ~32 ms on one that had served a turn, and a `session.create` alone did not change it.
//! So the priming runs one turn of a throwaway session whose model endpoint is the guard's
//! priming endpoint and deletes the session. Through a BYOK worker's tunnel the guard
//! answers the call itself with a one-word completion (no model is called, nothing leaves
//! the machine, no credential is used) and the turn ends on its own
//! ([`Priming::Answered`]); without a tunnel nothing listens there (loopback port 1), the
//! call fails at once and the turn is aborted at that failure, as the runtime would retry
//! for ~23 s ([`Priming::Refused`]: primed as well, but a failed model call leaves the
//! runtime ~30 MiB bigger, see `model_guard::priming`). A priming that fails or runs past
//! its limit leaves an unprimed but healthy process.

use std::path::Path;
use std::time::Duration;

use crate::kinds::Priming;
use crate::rpc::messages::{ProviderConfig, SessionConfig};
use crate::secret::Secret;
use crate::worker::{Session, SessionUpdate, WorkerError, WorkerHandle};

/// How long a priming may take in all (its abort included).
pub(crate) const PRIME_LIMIT: Duration = Duration::from_secs(5);

/// The model endpoint of the priming turn: a BYOK worker's tunnel answers it without a
/// provider; nothing listens on loopback port 1 (and a sandboxed worker may not connect to
/// it), so a direct call fails at once.
const PRIMING_ENDPOINT: &str = crate::model_guard::PRIMING_BASE_URL;

/// Why a priming stopped short.
#[derive(Debug, thiserror::Error)]
pub(crate) enum PrimeError {
    #[error("the priming session failed: {0}")]
    Worker(#[from] WorkerError),
    #[error("the priming turn ended before its model call")]
    Ended,
}

/// Runs the priming turn on `worker` (see the module doc), bounded by the caller: how its
/// model call went, or why it stopped short.
pub(crate) async fn prime(
    worker: &WorkerHandle,
    working_directory: &Path,
) -> Result<Priming, PrimeError> {
    let config = SessionConfig {
        model: Some("copilot-pool-prime".to_owned()),
        provider: Some(ProviderConfig::openai(
            PRIMING_ENDPOINT,
            Some(Secret::new("copilot-pool-prime")),
        )),
        working_directory: Some(working_directory.display().to_string()),
        available_tools: Some(Vec::new()),
        streaming: false,
        ..Default::default()
    };
    let mut session = worker.create_session(config).await?;
    let ran = run_priming_turn(&mut session).await;
    // Whatever happened, a turn still running is stopped and the session removed (its
    // state too); an answered turn has ended by itself.
    if !matches!(ran, Ok(Priming::Answered)) {
        let _ = session.abort_and_settle(PRIME_LIMIT).await;
    }
    session.delete().await?;
    ran
}

/// Sends the priming turn and follows it: to its end once its model call was answered, to
/// the failed call otherwise.
async fn run_priming_turn(session: &mut Session) -> Result<Priming, PrimeError> {
    session.send("copilot-pool priming turn").await?;
    let mut answered = false;
    while let Some(update) = session.next().await {
        match update {
            SessionUpdate::Event(event) => match event.event_type() {
                "model.call_finished" => answered = true,
                // The model path is initialised once a call was attempted.
                "model.call_failure" | "session.error" => return Ok(Priming::Refused),
                "session.idle" if answered => return Ok(Priming::Answered),
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
