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
//!   (A sandboxed worker is allowed the sink's port.) Where there is no sink (it could not
//!   be bound) the call fails at once and the turn is stopped at that failure, as the
//!   runtime would retry for ~23 s ([`Priming::Refused`]: primed too, at the failure's
//!   cost). A stop sent any
//!   earlier is a race: at the turn's `user.message` it ended the turn before its call in 5
//!   of 12 runs (not primed); against an endpoint that refuses at once, even at
//!   `model.turn_started` the call failed first in 7 of 10 runs on a loaded machine.
//!
//! A priming that fails or runs past its limit leaves an unprimed but healthy process.

use std::net::{Ipv4Addr, SocketAddr};
use std::path::Path;
use std::time::Duration;

use tokio::net::TcpListener;
use tokio::task::{JoinHandle, JoinSet};

use crate::kinds::Priming;
use crate::rpc::messages::{ProviderConfig, SessionConfig};
use crate::secret::Secret;
use crate::worker::{Session, SessionUpdate, WorkerError, WorkerHandle};

/// How long the priming turn may run, from its send to its `session.idle`.
const TURN_LIMIT: Duration = Duration::from_secs(4);
/// How long a priming turn that did not end may take to settle after its abort.
const SETTLE_LIMIT: Duration = Duration::from_secs(1);
/// A bound on a whole priming (its session's create and delete included), for the caller.
pub(crate) const PRIME_LIMIT: Duration = Duration::from_secs(7);

/// The model endpoint of a tunnelled priming turn (the guard answers it) and of one with no
/// sink: nothing listens on loopback port 1, so a direct call fails at once.
const PRIMING_ENDPOINT: &str = crate::model_guard::PRIMING_BASE_URL;

/// Connections the sink holds at once; more are closed as they come (a priming holds one,
/// for well under [`TURN_LIMIT`]).
const SINK_CONNECTIONS: usize = 16;

/// How long the sink waits after a failed accept (out of file descriptors, say) before the
/// next, so a failure that persists does not spin.
const SINK_ACCEPT_BACKOFF: Duration = Duration::from_millis(100);

/// A loopback listener that takes a priming turn's model call and never answers it: each
/// connection is read to its end, for at most [`TURN_LIMIT`], at most [`SINK_CONNECTIONS`]
/// at once (any local process may connect; one that holds them all only makes primings
/// fail, as without the sink), so the turn can be stopped at its call's start before the
/// call fails. It holds no state and sends nothing; its listener and every connection it
/// holds are closed when it is dropped.
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
        let task = tokio::spawn(async move {
            // The connections' tasks live in the accept task: its abort drops them all.
            let mut held = JoinSet::new();
            loop {
                while held.try_join_next().is_some() {}
                let mut stream = match listener.accept().await {
                    Ok((stream, _)) => stream,
                    Err(_) => {
                        tokio::time::sleep(SINK_ACCEPT_BACKOFF).await;
                        continue;
                    }
                };
                if held.len() >= SINK_CONNECTIONS {
                    continue;
                }
                held.spawn(async move {
                    let _ = tokio::time::timeout(
                        TURN_LIMIT,
                        tokio::io::copy(&mut stream, &mut tokio::io::sink()),
                    )
                    .await;
                });
            }
        });
        Ok(Self { addr, task })
    }

    /// The port it listens on (a sandboxed worker is allowed to connect to it).
    pub(crate) fn port(&self) -> u16 {
        self.addr.port()
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
    #[error("the priming turn ended without an answer to its model call")]
    Unanswered,
    #[error("the priming turn did not end within {TURN_LIMIT:?}")]
    TimedOut,
    #[error("the priming task panicked: {0}")]
    Panicked(String),
}

/// Runs the priming turn on `worker` (see the module doc), its model call going `via`.
/// Returns how its model call went, or why it stopped short; the throwaway session is
/// deleted either way, also when this future is dropped before its end (a failed delete is
/// logged: it leaves that session's state behind).
pub(crate) async fn prime(
    worker: &WorkerHandle,
    working_directory: &Path,
    via: &PrimeVia,
) -> Result<Priming, PrimeError> {
    let endpoint = match via {
        PrimeVia::Sink(url) => url.as_str(),
        PrimeVia::Tunnel | PrimeVia::Nothing => PRIMING_ENDPOINT,
    };
    let mut config = SessionConfig {
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
    // No hook from a file in the agent's directory runs for a session nobody asked for.
    super::without_command_files(&mut config.extra);
    // The session is created, used and deleted in a task of its own, so that it is deleted
    // even when the caller stops waiting (its [`PRIME_LIMIT`] drops this future): dropped
    // in the middle of its create or its turn, the session would stay in the agent's home
    // (`session-state/<id>`; `Session`'s drop only detaches). The task ends within the
    // worker's request timeout, [`TURN_LIMIT`] and [`SETTLE_LIMIT`].
    let worker = worker.clone();
    let tunnelled = matches!(via, PrimeVia::Tunnel);
    let task = tokio::spawn(async move {
        let mut session = worker.create_session(config).await?;
        let ran = run_turn(&mut session, tunnelled).await;
        if let Err(error) = session.delete().await {
            tracing::info!(%error, "The priming session could not be deleted; its state stays in the agent's home.");
        }
        ran
    });
    task.await
        .unwrap_or_else(|error| Err(PrimeError::Panicked(error.to_string())))
}

/// Sends the priming turn and follows it to its end, stopping it where it has to.
async fn run_turn(session: &mut Session, tunnelled: bool) -> Result<Priming, PrimeError> {
    session.send("copilot-pool priming turn").await?;
    let followed = tokio::time::timeout(TURN_LIMIT, follow(session, PrimingTurn::new(tunnelled)))
        .await
        .unwrap_or(Err(PrimeError::TimedOut));
    // A turn that got to its `session.idle` is over; any other may still run.
    if !matches!(
        followed,
        Ok(_) | Err(PrimeError::Ended | PrimeError::Unanswered)
    ) {
        let _ = session.abort_and_settle(SETTLE_LIMIT).await;
    }
    followed
}

/// Follows the sent priming turn to its `session.idle`, stopping it when `turn` says so.
async fn follow(session: &mut Session, mut turn: PrimingTurn) -> Result<Priming, PrimeError> {
    while let Some(update) = session.next().await {
        match update {
            SessionUpdate::Event(event) => match turn.on_event(event.event_type()) {
                Step::Go => {}
                Step::Stop => {
                    session.abort().await?;
                }
                Step::Done(outcome) => return outcome,
            },
            SessionUpdate::Ended(error) => return Err(PrimeError::Worker(error)),
            // Nothing is offered to the priming turn: requests are refused by their drop.
            _ => {}
        }
    }
    Err(PrimeError::Ended)
}

/// What the priming turn's next event calls for.
#[derive(Debug)]
enum Step {
    Go,
    /// Abort the turn (once).
    Stop,
    /// The turn is over: how its model call went.
    Done(Result<Priming, PrimeError>),
}

/// The priming turn as its events tell it (state in, decisions out): tunnelled, it runs to
/// the end of its answered call; otherwise it is stopped at its call's start. A call that
/// fails stops it too (the runtime would retry for ~23 s).
#[derive(Debug)]
struct PrimingTurn {
    tunnelled: bool,
    called: bool,
    answered: bool,
    failed: bool,
    stopped: bool,
}

impl PrimingTurn {
    fn new(tunnelled: bool) -> Self {
        Self {
            tunnelled,
            called: false,
            answered: false,
            failed: false,
            stopped: false,
        }
    }

    fn on_event(&mut self, event_type: &str) -> Step {
        let stop = match event_type {
            "model.call_start" => {
                self.called = true;
                !self.tunnelled
            }
            "assistant.message" => {
                self.answered = true;
                false
            }
            "model.call_failure" | "session.error" => {
                self.failed = true;
                true
            }
            "session.idle" => return Step::Done(self.outcome()),
            _ => false,
        };
        if stop && !self.stopped {
            self.stopped = true;
            Step::Stop
        } else {
            Step::Go
        }
    }

    /// How the turn went, at its end. Without a model call's start the process is not
    /// primed, whatever else happened.
    fn outcome(&self) -> Result<Priming, PrimeError> {
        match (self.called, self.failed, self.answered, self.stopped) {
            (false, ..) => Err(PrimeError::Ended),
            (true, true, _, _) => Ok(Priming::Refused),
            (true, false, true, _) => Ok(Priming::Answered),
            (true, false, false, true) => Ok(Priming::Stopped),
            (true, false, false, false) => Err(PrimeError::Unanswered),
        }
    }
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
        // While the caller waits, nothing comes back and the connection stays open.
        let mut byte = [0u8; 1];
        let waited = tokio::time::timeout(Duration::from_millis(200), stream.read(&mut byte)).await;
        assert!(waited.is_err(), "the sink answered or closed: {waited:?}");
        // The caller gives up (as a stopped turn's call does): the sink, at the end of what
        // it reads, closes its side having sent nothing.
        stream.shutdown().await.expect("shutdown");
        let mut answer = Vec::new();
        stream.read_to_end(&mut answer).await.expect("read");
        assert!(answer.is_empty(), "the sink sent {answer:?}");
    }

    #[tokio::test]
    async fn the_sink_holds_at_most_sixteen_connections_and_closes_the_rest_at_once() {
        let sink = PrimingSink::bind().await.expect("bind");
        let held = fill(&sink).await;
        // The sixteen are still open (nothing to read, no end).
        let mut byte = [0u8; 1];
        for stream in &held {
            let open = stream.try_read(&mut byte);
            assert!(
                matches!(&open, Err(e) if e.kind() == std::io::ErrorKind::WouldBlock),
                "a held connection was answered or closed: {open:?}"
            );
        }
    }

    /// Connects `SINK_CONNECTIONS` callers that each sent a request, and returns them once
    /// the sink holds them all (the next connection, accepted after them, is closed unread).
    async fn fill(sink: &PrimingSink) -> Vec<TcpStream> {
        let mut held = Vec::new();
        for _ in 0..SINK_CONNECTIONS {
            let mut stream = TcpStream::connect(sink.addr).await.expect("connect");
            stream.write_all(REQUEST).await.expect("the request");
            held.push(stream);
        }
        let mut over = TcpStream::connect(sink.addr).await.expect("connect");
        let mut byte = [0u8; 1];
        let read = tokio::time::timeout(Duration::from_secs(10), over.read(&mut byte)).await;
        assert!(
            matches!(read, Ok(Ok(0))),
            "the seventeenth connection is closed at once: {read:?}"
        );
        held
    }

    #[tokio::test]
    async fn a_dropped_sink_closes_its_listener_and_the_connections_it_held() {
        let sink = PrimingSink::bind().await.expect("bind");
        let addr = sink.addr;
        let held = fill(&sink).await;
        drop(sink);
        for mut stream in held {
            // Well before the sink's own limit on a connection would close it.
            let mut byte = [0u8; 1];
            let read = tokio::time::timeout(TURN_LIMIT / 2, stream.read(&mut byte)).await;
            assert!(
                matches!(read, Ok(Ok(0))),
                "a held connection is closed with the sink: {read:?}"
            );
        }
        // The aborted task dropped the listener on its way out.
        assert!(TcpStream::connect(addr).await.is_err());
    }

    /// The real runtime (`COPILOT_CLI_PATH`, else the pinned one in the cache).
    async fn runtime() -> std::path::PathBuf {
        if let Some(path) = std::env::var_os(crate::runtime::CLI_PATH_ENV) {
            return path.into();
        }
        let cache = crate::runtime::cache_dir(crate::runtime::process_env).expect("cache dir");
        crate::runtime::install(crate::runtime::Flavour::default(), &cache)
            .await
            .expect("the runtime is installed")
            .executable
    }

    /// The session directories in a runtime home.
    fn stored_sessions(home: &Path) -> Vec<std::path::PathBuf> {
        std::fs::read_dir(home.join("session-state"))
            .map(|dir| dir.flatten().map(|e| e.path()).collect())
            .unwrap_or_default()
    }

    #[tokio::test]
    async fn a_priming_dropped_by_its_callers_limit_still_deletes_its_throwaway_session() {
        let scratch = tempfile::tempdir().expect("scratch");
        let home = scratch.path().join("copilot");
        let work = scratch.path().join("work");
        std::fs::create_dir_all(&home).expect("home");
        std::fs::create_dir_all(&work).expect("work");
        let mut config =
            crate::worker::WorkerConfig::new(runtime().await, home.clone(), work.clone());
        config.extra_env = vec![("HOME".to_owned(), scratch.path().display().to_string())];
        config.kill_grace = Duration::from_secs(2);
        let worker = WorkerHandle::start(config).await.expect("worker");

        // The caller's limit fires mid-way: as soon as the throwaway session is stored (the
        // runtime writes it while it answers the create), long before the priming is over.
        let priming = prime(&worker, &work, &PrimeVia::Nothing);
        let stored = async {
            while stored_sessions(&home).is_empty() {
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
        };
        tokio::select! {
            outcome = priming => panic!("the priming ended before it was dropped: {outcome:?}"),
            () = stored => {}
        }
        // The dropped priming's session is deleted, from its home too.
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        while !stored_sessions(&home).is_empty() && tokio::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let left = stored_sessions(&home);
        worker.shutdown().await;
        assert!(left.is_empty(), "the throwaway session stayed: {left:?}");
    }

    /// Feeds `events` to a priming turn; returns the stops it asked for and its outcome.
    fn run(tunnelled: bool, events: &[&str]) -> (usize, Option<Result<Priming, PrimeError>>) {
        let mut turn = PrimingTurn::new(tunnelled);
        let mut stops = 0;
        for event in events {
            match turn.on_event(event) {
                Step::Go => {}
                Step::Stop => stops += 1,
                Step::Done(outcome) => return (stops, Some(outcome)),
            }
        }
        (stops, None)
    }

    #[test]
    fn a_tunnelled_priming_runs_to_the_end_of_its_answered_call() {
        let (stops, outcome) = run(
            true,
            &[
                "user.message",
                "model.call_start",
                "model.call_finished",
                "assistant.message",
                "session.idle",
            ],
        );
        assert_eq!(stops, 0);
        assert!(
            matches!(outcome, Some(Ok(Priming::Answered))),
            "{outcome:?}"
        );
    }

    #[test]
    fn a_priming_without_a_tunnel_is_stopped_once_at_its_calls_start() {
        let (stops, outcome) = run(
            false,
            &[
                "user.message",
                "model.turn_started",
                "model.call_start",
                "model.call_start",
                "agent.interrupted",
                "model.turn_failed",
                "session.idle",
            ],
        );
        assert_eq!(stops, 1);
        assert!(matches!(outcome, Some(Ok(Priming::Stopped))), "{outcome:?}");
    }

    #[test]
    fn a_failed_call_stops_the_turn_and_primes_at_its_cost() {
        for tunnelled in [true, false] {
            let (stops, outcome) = run(
                tunnelled,
                &[
                    "model.call_start",
                    "model.call_failure",
                    "session.error",
                    "session.idle",
                ],
            );
            assert_eq!(stops, 1);
            assert!(matches!(outcome, Some(Ok(Priming::Refused))), "{outcome:?}");
        }
    }

    #[test]
    fn a_turn_that_ends_before_its_call_leaves_the_process_unprimed() {
        // An error before any call (the model's setup failed), or an early end.
        let (_, outcome) = run(false, &["user.message", "session.error", "session.idle"]);
        assert!(
            matches!(outcome, Some(Err(PrimeError::Ended))),
            "{outcome:?}"
        );
        let (_, outcome) = run(true, &["user.message", "session.idle"]);
        assert!(
            matches!(outcome, Some(Err(PrimeError::Ended))),
            "{outcome:?}"
        );
        // A tunnelled call that got no answer and no failure.
        let (_, outcome) = run(true, &["model.call_start", "session.idle"]);
        assert!(
            matches!(outcome, Some(Err(PrimeError::Unanswered))),
            "{outcome:?}"
        );
        // No end yet: nothing decided.
        assert!(run(false, &["model.call_start"]).1.is_none());
    }
}
