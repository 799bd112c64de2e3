//! A turn's event stream: the sending side every producer of a turn's events shares
//! ([`TurnEvents`]: the chain's runtime and CLI events, the gateway's requests and hook
//! notifications, the `turn.end`), each event framed as SSE as it is queued, and the answer
//! that streams them ([`respond`]). What the stream holds unsent is bounded twice: 256
//! places, and [`SSE_BACKLOG_BYTES`] of frames ([`Backlog`]: the runtime's frames go up to
//! 64 MiB, and its `model.*` events carry the whole conversation). A producer waits for room
//! while its reader makes progress, and gives up (the turn is aborted for its reader) after
//! [`SEND_TIMEOUT`] without any; a stream that ends without its `turn.end` is cut, never
//! ended cleanly.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use tokio::sync::mpsc;

use super::error::error;
use super::events::{TurnEndEvent, TurnEvent};

/// How long a turn's producer waits for its reader to make room before the turn is aborted
/// for it (gone, or reading too slowly).
pub(super) const SEND_TIMEOUT: Duration = Duration::from_secs(30);

/// Events a turn's stream holds unsent at most.
const PLACES: usize = 256;

/// The bytes of frames a turn's stream holds unsent at most.
const SSE_BACKLOG_BYTES: usize = 16 << 20;

/// One event as the stream sends it: its SSE frame, and the summary when it is `turn.end`
/// (the answer of a turn that does not stream).
pub(super) struct Framed {
    bytes: Vec<u8>,
    end: Option<TurnEndEvent>,
}

impl Framed {
    fn of(event: TurnEvent) -> Self {
        let mut bytes = Vec::new();
        event.frame_into(&mut bytes);
        let end = match event {
            TurnEvent::TurnEnd(end) => Some(end),
            _ => None,
        };
        Self { bytes, end }
    }
}

/// The sending side of a turn's event stream.
#[derive(Clone)]
pub(super) struct TurnEvents {
    tx: mpsc::Sender<Framed>,
    backlog: Backlog,
}

/// The receiving side: what [`respond`] streams.
pub(super) struct TurnEventsRx {
    rx: mpsc::Receiver<Framed>,
    backlog: Backlog,
}

/// A new turn's event stream.
pub(super) fn channel() -> (TurnEvents, TurnEventsRx) {
    channel_of(PLACES, SSE_BACKLOG_BYTES)
}

fn channel_of(places: usize, bytes: usize) -> (TurnEvents, TurnEventsRx) {
    let (tx, rx) = mpsc::channel(places);
    let backlog = Backlog::of(bytes);
    (
        TurnEvents {
            tx,
            backlog: backlog.clone(),
        },
        TurnEventsRx { rx, backlog },
    )
}

impl TurnEvents {
    /// Queues `event`, waiting for room while the reader makes progress; `false` once the
    /// reader is gone or made none for [`SEND_TIMEOUT`].
    pub(super) async fn send(&self, event: TurnEvent) -> bool {
        let framed = Framed::of(event);
        self.backlog.take(framed.bytes.len()).await
            && self.tx.send_timeout(framed, SEND_TIMEOUT).await.is_ok()
    }

    /// Queues `event` now if there is room for it, else hands back a future that waits for
    /// room (as [`TurnEvents::send`] does): an event queued now keeps its place before what
    /// its caller does next.
    pub(super) fn send_now_or_later(
        &self,
        event: TurnEvent,
    ) -> Option<impl std::future::Future<Output = bool> + Send + 'static> {
        let framed = Framed::of(event);
        let len = framed.bytes.len();
        let framed = if self.backlog.try_take(len) {
            match self.tx.try_send(framed) {
                Ok(()) | Err(mpsc::error::TrySendError::Closed(_)) => return None,
                Err(mpsc::error::TrySendError::Full(framed)) => {
                    // The bytes are held; the place is waited for.
                    let tx = self.tx.clone();
                    return Some(futures_util::future::Either::Left(async move {
                        tx.send_timeout(framed, SEND_TIMEOUT).await.is_ok()
                    }));
                }
            }
        } else {
            framed
        };
        let this = self.clone();
        Some(futures_util::future::Either::Right(async move {
            this.backlog.take(len).await && this.tx.send_timeout(framed, SEND_TIMEOUT).await.is_ok()
        }))
    }

    /// Resolves once the reader is gone.
    pub(super) async fn closed(&self) {
        self.tx.closed().await;
    }
}

/// What a turn's queued frames hold in bytes, bounded: taken before a frame is queued,
/// given back once it is written into the body; `progress` counts the give-backs, so a
/// producer waiting for room can tell a slow reader from one that reads nothing.
#[derive(Clone)]
struct Backlog {
    room: Arc<tokio::sync::Semaphore>,
    bytes: usize,
    progress: Arc<AtomicU64>,
}

impl Backlog {
    fn of(bytes: usize) -> Self {
        Self {
            room: Arc::new(tokio::sync::Semaphore::new(bytes)),
            bytes,
            progress: Arc::new(AtomicU64::new(0)),
        }
    }

    /// What a frame of `len` bytes holds against the bound (a larger one takes all of it).
    fn charge(&self, len: usize) -> u32 {
        u32::try_from(len.min(self.bytes)).unwrap_or(u32::MAX)
    }

    /// Takes room for a frame of `len` bytes if there is some now.
    fn try_take(&self, len: usize) -> bool {
        match self.room.try_acquire_many(self.charge(len)) {
            Ok(permit) => {
                permit.forget();
                true
            }
            Err(_) => false,
        }
    }

    /// Waits for room for a frame of `len` bytes while the reader makes progress; `false`
    /// after [`SEND_TIMEOUT`] without any, or once there will be none.
    async fn take(&self, len: usize) -> bool {
        let acquire = self.room.acquire_many(self.charge(len));
        tokio::pin!(acquire);
        loop {
            let seen = self.progress.load(Ordering::SeqCst);
            tokio::select! {
                permit = &mut acquire => {
                    return match permit {
                        Ok(permit) => {
                            permit.forget();
                            true
                        }
                        Err(_) => false,
                    };
                }
                () = tokio::time::sleep(SEND_TIMEOUT) => {
                    if self.progress.load(Ordering::SeqCst) == seen {
                        return false;
                    }
                }
            }
        }
    }

    /// Gives back what a frame of `len` bytes held, once it left the queue.
    fn give_back(&self, len: usize) {
        self.room.add_permits(self.charge(len) as usize);
        self.progress.fetch_add(1, Ordering::SeqCst);
    }
}

/// The answer to a retry of a turn that ended (same `Idempotency-Key`, same body): its
/// `turn.end` again, as the stream's one event or as JSON, marked `Idempotent-Replayed`.
pub(super) fn replayed(streaming: bool, summary: &TurnEndEvent) -> Response {
    let mut response = if streaming {
        let mut frames = Vec::new();
        TurnEvent::TurnEnd(summary.clone()).frame_into(&mut frames);
        event_stream(Body::from(frames))
    } else {
        axum::Json(summary).into_response()
    };
    response.headers_mut().insert(
        "idempotent-replayed",
        axum::http::HeaderValue::from_static("true"),
    );
    response
}

/// An SSE comment: no event, bytes on the connection so a proxy sees it alive.
const SSE_KEEPALIVE: &[u8] = b": keep-alive\n\n";

/// The answer of a running turn: its events as SSE ending with `turn.end` (with a comment
/// after `keepalive` without one, unless zero), or (without the stream) the `turn.end`
/// summary alone as JSON.
pub(super) async fn respond(
    streaming: bool,
    keepalive: Duration,
    events: TurnEventsRx,
) -> Response {
    let TurnEventsRx { mut rx, backlog } = events;
    if !streaming {
        // Only the final summary, as JSON.
        while let Some(framed) = rx.recv().await {
            backlog.give_back(framed.bytes.len());
            if let Some(end) = framed.end {
                return axum::Json(end).into_response();
            }
        }
        return error(
            StatusCode::INTERNAL_SERVER_ERROR,
            "internal",
            "the turn ended without a summary",
        );
    }
    // The stream ends with `turn.end`: nothing the turn still emits comes after it. One
    // timer for the keep-alive, moved on after each chunk (not one made and dropped for each).
    let quiet = (!keepalive.is_zero()).then(|| Box::pin(tokio::time::sleep(keepalive)));
    let stream =
        futures_util::stream::unfold((rx, quiet, false), move |(mut rx, mut quiet, ended)| {
            let backlog = backlog.clone();
            async move {
                if ended {
                    return None;
                }
                // `next_frames` waits only in its first `recv`, which loses nothing when
                // dropped.
                let chunk = match quiet.as_mut() {
                    None => next_frames(&mut rx, &backlog).await,
                    Some(sleep) => {
                        let chunk = tokio::select! {
                            next = next_frames(&mut rx, &backlog) => next,
                            () = sleep.as_mut() => Some((SSE_KEEPALIVE.to_vec(), false)),
                        };
                        sleep
                            .as_mut()
                            .reset(tokio::time::Instant::now() + keepalive);
                        chunk
                    }
                };
                let Some((frames, last)) = chunk else {
                    // Over without `turn.end`: the turn was aborted for its reader (gone, or
                    // reading too slowly). The transfer is cut, not ended: a client that is
                    // still there sees a broken stream, never a clean end short of its turn.
                    return Some((Err(StreamCut), (rx, quiet, true)));
                };
                Some((Ok(Bytes::from(frames)), (rx, quiet, last)))
            }
        });
    event_stream(Body::from_stream(stream))
}

/// Why a turn's event stream was cut before its `turn.end`.
#[derive(Debug)]
struct StreamCut;

impl std::fmt::Display for StreamCut {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(
            "the turn was aborted before its turn.end: its events were not read for 30 s \
             (read the stream as it comes) or its reader went away",
        )
    }
}

impl std::error::Error for StreamCut {}

/// A turn's `200 text/event-stream` answer with `body` as its events.
fn event_stream(body: Body) -> Response {
    Response::builder()
        .status(StatusCode::OK)
        .header(header::CONTENT_TYPE, "text/event-stream")
        .header(header::CACHE_CONTROL, "no-cache")
        // nginx would otherwise hold the events back in its buffer.
        .header("x-accel-buffering", "no")
        .body(body)
        .unwrap_or_else(|_| error(StatusCode::INTERNAL_SERVER_ERROR, "internal", "response"))
}

/// Bytes of SSE frames put into one write at most (beyond the first frame).
const SSE_BATCH_BYTES: usize = 64 * 1024;

/// The next event's SSE frame, followed by those of the events already waiting behind it
/// (the runtime sends events in bursts): one body chunk, so one socket write, where each
/// frame was a write (and a wake-up of the connection) of its own. Nothing waits for a
/// batch to fill. `None` once the turn's events are over; `true` with the `turn.end` frame.
async fn next_frames(
    rx: &mut mpsc::Receiver<Framed>,
    backlog: &Backlog,
) -> Option<(Vec<u8>, bool)> {
    let mut frames = Vec::new();
    let mut framed = rx.recv().await?;
    loop {
        frames.extend_from_slice(&framed.bytes);
        backlog.give_back(framed.bytes.len());
        if framed.end.is_some() {
            return Some((frames, true));
        }
        if frames.len() >= SSE_BATCH_BYTES {
            return Some((frames, false));
        }
        match rx.try_recv() {
            Ok(next) => framed = next,
            Err(_) => return Some((frames, false)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::http::events::tests::every_event;
    use futures_util::FutureExt;

    #[tokio::test]
    async fn events_already_waiting_go_out_in_one_chunk_and_the_stream_ends_with_turn_end() {
        let events = every_event();
        let count = events.len();
        let expected: Vec<u8> = events.iter().flat_map(|e| e.frame().into_bytes()).collect();
        let (tx, TurnEventsRx { mut rx, backlog }) = channel();
        // One event waiting: it goes alone, at once.
        let mut events = events.into_iter();
        assert!(tx.send(events.next().expect("an event")).await);
        let (first, last) = next_frames(&mut rx, &backlog).await.expect("a frame");
        assert!(!last);
        assert_eq!(first.as_slice(), every_event()[0].frame().as_bytes());
        // The rest waiting together, `turn.end` last: one chunk, and the end.
        for event in events {
            assert!(tx.send(event).await);
        }
        let (rest, last) = next_frames(&mut rx, &backlog).await.expect("frames");
        assert!(last, "the chunk ends the stream");
        assert_eq!([first, rest].concat(), expected, "{count} frames in order");
        drop(tx);
        assert!(next_frames(&mut rx, &backlog).await.is_none());
    }

    fn message(n: usize) -> TurnEvent {
        let data = format!(
            r#"{{"type":"assistant.message","data":{{"content":"{}"}}}}"#,
            "x".repeat(n)
        );
        TurnEvent::Runtime(Box::new(crate::rpc::SessionEvent::from_value(
            serde_json::from_str(&data).expect("json"),
        )))
    }

    #[tokio::test]
    async fn events_wait_for_room_once_their_unsent_bytes_reach_the_bound() {
        // Room for two frames and a half.
        let frame = Framed::of(message(400)).bytes.len();
        let bound = frame * 5 / 2;
        let (tx, TurnEventsRx { mut rx, backlog }) = channel_of(64, bound);
        assert!(tx.send(message(400)).await);
        assert!(tx.send(message(400)).await);
        // A third would pass the bound: it waits, however many places the channel has.
        let third = tx.send(message(400));
        tokio::pin!(third);
        assert!(
            third.as_mut().now_or_never().is_none(),
            "queued past the bound"
        );
        // Writing the queued frames into the body gives their bytes back.
        let (_, last) = next_frames(&mut rx, &backlog).await.expect("frames");
        assert!(!last);
        assert_eq!(third.as_mut().now_or_never(), Some(true));
        // One larger than the bound takes all of it, once the rest has gone.
        let huge = tx.send(message(bound * 2));
        tokio::pin!(huge);
        assert!(huge.as_mut().now_or_never().is_none());
        next_frames(&mut rx, &backlog).await.expect("frames");
        assert_eq!(huge.as_mut().now_or_never(), Some(true));
        // Queued now when there is room (a hook notification keeps its place), else later.
        let (tx, TurnEventsRx { mut rx, backlog }) = channel_of(64, bound);
        assert!(
            tx.send_now_or_later(message(400)).is_none(),
            "queued at once"
        );
        assert!(
            tx.send_now_or_later(message(400)).is_none(),
            "queued at once"
        );
        let later = tx.send_now_or_later(message(400)).expect("no room now");
        next_frames(&mut rx, &backlog).await.expect("frames");
        assert!(later.await);
    }

    #[tokio::test(start_paused = true)]
    async fn a_producer_waits_while_its_reader_makes_progress_and_gives_up_when_it_makes_none() {
        let backlog = Backlog::of(1000);
        assert!(backlog.try_take(1000));
        let waiting = tokio::spawn({
            let backlog = backlog.clone();
            async move { backlog.take(500).await }
        });
        // The reader gives back a little, not enough, within each limit: the producer
        // waits on past the limit...
        tokio::time::sleep(SEND_TIMEOUT - Duration::from_secs(10)).await;
        backlog.give_back(100);
        tokio::time::sleep(Duration::from_secs(20)).await;
        assert!(
            !waiting.is_finished(),
            "gave up on a reader making progress"
        );
        // ...until there is room.
        backlog.give_back(400);
        assert!(waiting.await.expect("joined"));
        // A reader that makes none: the producer gives up after the limit.
        let started = tokio::time::Instant::now();
        assert!(!backlog.take(1).await);
        assert_eq!(started.elapsed(), SEND_TIMEOUT);
    }

    #[tokio::test]
    async fn a_stream_whose_turn_was_aborted_for_its_reader_is_cut_not_ended() {
        use http_body_util::BodyExt;
        let (tx, rx) = channel();
        let events = every_event();
        assert!(tx.send(events[0].clone()).await);
        // The turn's task gives up on its reader and drops its sender, sending no turn.end.
        drop(tx);
        let mut body = respond(true, Duration::ZERO, rx).await.into_body();
        let first = body.frame().await.expect("a frame").expect("data");
        assert_eq!(
            first.into_data().expect("data").as_ref(),
            events[0].frame().as_bytes()
        );
        let cut = body.frame().await.expect("the end").expect_err("cut");
        assert!(
            cut.to_string().contains("read the stream as it comes"),
            "{cut}"
        );
    }
}
