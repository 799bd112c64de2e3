//! Priming a process started ahead of demand (a warm spare, or one more process for a busy
//! key) before placement hears of it. The runtime initialises itself on the first turn of a
//! process: a new conversation's first turn took 190–480 ms on a fresh process against
//! ~32 ms on one that had served a turn, and a `session.create` alone did not change it.
//! So the priming runs one turn of a throwaway session and deletes the session; its model
//! call reaches no model, and how it ends matters, because a failed model call leaves the
//! runtime (1.0.14) ~30 MiB of heap bigger for good (see `model_guard::priming`):
//!
//! * through a BYOK worker's tunnel the guard answers the call itself with a one-word
//!   completion (no provider, no credential, nothing leaves the machine) and the turn ends
//!   on its own ([`Priming::Answered`]);
//! * without a tunnel the call goes to the pool's [`PrimingSink`], a loopback listener that
//!   takes the request and never answers, and the turn is stopped at the call's start: the
//!   runtime has initialised its model path, and the stop drops the call before it could
//!   fail ([`Priming::Stopped`]; the next real turn 39–64 ms against ~350 ms unprimed).
//!   Where the sink cannot be reached (no sink, or a sandbox that allows no such port) the
//!   call fails at once and the turn is stopped at that failure, as the runtime would retry
//!   for ~23 s ([`Priming::Refused`]: primed too, at the failure's cost). A stop sent any
//!   earlier is a race: at the turn's `user.message` it ended the turn before its call in 5
//!   of 12 runs (not primed); against an endpoint that refuses at once, even at
//!   `model.turn_started` the call failed first in 7 of 10 runs on a loaded machine.
//!
//! A priming that fails or runs past its limit leaves an unprimed but healthy process.

use std::net::{Ipv4Addr, SocketAddr};
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use tokio::net::TcpListener;
use tokio::sync::Semaphore;
use tokio::task::JoinHandle;

use crate::kinds::Priming;
use crate::rpc::messages::{ProviderConfig, SessionConfig};
use crate::secret::Secret;
use crate::worker::{Session, SessionUpdate, WorkerError, WorkerHandle};

/// How long a priming may take in all (its abort included).
pub(crate) const PRIME_LIMIT: Duration = Duration::from_secs(5);

/// The model endpoint of a tunnelled priming turn (the guard answers it) and of one with no
/// sink: nothing listens on loopback port 1, so a direct call fails at once.
const PRIMING_ENDPOINT: &str = crate::model_guard::PRIMING_BASE_URL;

/// Connections the sink holds at once; more are closed as they come (a priming holds one,
/// for well under [`PRIME_LIMIT`]).
const SINK_CONNECTIONS: usize = 16;

/// A loopback listener that takes a priming turn's model call and never answers it (each
/// connection read to its end, for at most [`PRIME_LIMIT`], at most [`SINK_CONNECTIONS`] at
/// once), so the turn can be stopped at its call's start before the call fails. It holds
/// no state and sends nothing; its task ends when it is dropped.
#[derive(Debug)]
pub(crate) struct PrimingSink {
    addr: SocketAddr,
    task: JoinHandle<()>,
}

impl PrimingSink {
    /// Listens on an ephemeral loopback port.
    pub(crate) async fn bind() -> std::io::Result<Self> {
        let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).await?;
        let addr = listener.local_addr()?;
        let permits = Arc::new(Semaphore::new(SINK_CONNECTIONS));
        let task = tokio::spawn(async move {
            loop {
                let Ok((mut stream, _)) = listener.accept().await else {
                    continue;
                };
                let Ok(permit) = permits.clone().try_acquire_owned() else {
                    continue;
                };
                tokio::spawn(async move {
                    let _ = tokio::time::timeout(
                        PRIME_LIMIT,
                        tokio::io::copy(&mut stream, &mut tokio::io::sink()),
                    )
                    .await;
                    drop(permit);
                });
            }
        });
        Ok(Self { addr, task })
    }

    /// The base URL a priming session's provider gets.
    pub(crate) fn base_url(&self) -> String {
        format!("http://{}/v1", self.addr)
    }
}

impl Drop for PrimingSink {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Where a priming turn's model call goes.
#[derive(Debug, Clone)]
pub(crate) enum PrimeVia {
    /// The worker's tunnel: the guard answers it.
    Tunnel,
    /// The pool's sink at this base URL.
    Sink(String),
    /// Nowhere that listens: the call fails at once.
    Nothing,
}

/// Why a priming stopped short.
#[derive(Debug, thiserror::Error)]
pub(crate) enum PrimeError {
    #[error("the priming session failed: {0}")]
    Worker(#[from] WorkerError),
    #[error("the priming turn ended before its model call")]
    Ended,
}

/// Runs the priming turn on `worker` (see the module doc), its model call going `via`,
/// bounded by the caller. Returns how its model call went, or why it stopped short.
pub(crate) async fn prime(
    worker: &WorkerHandle,
    working_directory: &Path,
    via: &PrimeVia,
) -> Result<Priming, PrimeError> {
    let endpoint = match via {
        PrimeVia::Sink(url) => url.as_str(),
        PrimeVia::Tunnel | PrimeVia::Nothing => PRIMING_ENDPOINT,
    };
    let config = SessionConfig {
        model: Some("copilot-pool-prime".to_owned()),
        provider: Some(ProviderConfig::openai(
            endpoint,
            Some(Secret::new("copilot-pool-prime")),
        )),
        working_directory: Some(working_directory.display().to_string()),
        available_tools: Some(Vec::new()),
        streaming: false,
        ..Default::default()
    };
    let mut session = worker.create_session(config).await?;
    let ran = run_priming_turn(&mut session, matches!(via, PrimeVia::Tunnel)).await;
    // A turn that got as far as its `session.idle` is over; one cut short by the worker is
    // stopped, if it still runs. Either way the session is removed (its state too).
    if matches!(ran, Err(PrimeError::Worker(_))) {
        let _ = session.abort_and_settle(PRIME_LIMIT).await;
    }
    session.delete().await?;
    ran
}

/// Sends the priming turn and follows it to its `session.idle`: when `tunnelled`, to the
/// end of its answered call; otherwise it is stopped at its call's start. A call that
/// fails stops it too (the runtime would retry for ~23 s).
async fn run_priming_turn(session: &mut Session, tunnelled: bool) -> Result<Priming, PrimeError> {
    session.send("copilot-pool priming turn").await?;
    let (mut called, mut answered, mut failed, mut stopped) = (false, false, false, false);
    while let Some(update) = session.next().await {
        let event = match update {
            SessionUpdate::Event(event) => event,
            SessionUpdate::Ended(error) => return Err(PrimeError::Worker(error)),
            // Nothing is offered to the priming turn: requests are refused by their drop.
            _ => continue,
        };
        let stop = match event.event_type() {
            "model.call_start" => {
                called = true;
                !tunnelled
            }
            "assistant.message" => {
                answered = true;
                false
            }
            "model.call_failure" | "session.error" => {
                failed = true;
                true
            }
            "session.idle" => {
                return match (failed, answered, called && stopped) {
                    (true, _, _) => Ok(Priming::Refused),
                    (false, true, _) => Ok(Priming::Answered),
                    (false, false, true) => Ok(Priming::Stopped),
                    (false, false, false) => Err(PrimeError::Ended),
                };
            }
            _ => false,
        };
        if stop && !stopped {
            stopped = true;
            session.abort().await?;
        }
    }
    Err(PrimeError::Ended)
}

#[cfg(test)]
mod tests {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpStream;

    use super::*;

    const REQUEST: &[u8] =
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 2\r\n\r\n{}";

    #[tokio::test]
    async fn the_sink_takes_a_request_and_never_answers_it() {
        let sink = PrimingSink::bind().await.expect("bind");
        assert!(sink.base_url().starts_with("http://127.0.0.1:"));
        let mut stream = TcpStream::connect(sink.addr).await.expect("connect");
        stream.write_all(REQUEST).await.expect("the request");
        // The caller gives up (as a stopped turn's call does): the sink has sent nothing and
        // closes its side once it has read the whole request.
        stream.shutdown().await.expect("shutdown");
        let mut answer = Vec::new();
        stream.read_to_end(&mut answer).await.expect("read");
        assert!(answer.is_empty(), "the sink sent {answer:?}");
    }

    #[tokio::test]
    async fn the_sink_holds_at_most_sixteen_connections_and_closes_the_rest_at_once() {
        let sink = PrimingSink::bind().await.expect("bind");
        let mut held = Vec::new();
        for _ in 0..SINK_CONNECTIONS {
            let mut stream = TcpStream::connect(sink.addr).await.expect("connect");
            stream.write_all(REQUEST).await.expect("the request");
            held.push(stream);
        }
        // The sink takes connections one at a time, so this one is accepted after the others:
        // with no permit left it is closed unread.
        let mut over = TcpStream::connect(sink.addr).await.expect("connect");
        let mut byte = [0u8; 1];
        let read = tokio::time::timeout(Duration::from_secs(10), over.read(&mut byte)).await;
        assert!(
            matches!(read, Ok(Ok(0))),
            "the seventeenth connection is closed at once: {read:?}"
        );
        drop(held);
    }

    #[tokio::test]
    async fn a_dropped_sink_stops_listening() {
        let sink = PrimingSink::bind().await.expect("bind");
        let addr = sink.addr;
        drop(sink);
        // The aborted task drops the listener on its way out.
        let mut refused = false;
        for _ in 0..100 {
            if TcpStream::connect(addr).await.is_err() {
                refused = true;
                break;
            }
            tokio::task::yield_now().await;
        }
        assert!(refused, "the sink's port still accepts connections");
    }
}
