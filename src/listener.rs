//! Accepting HTTP connections (the API, or any router, such as a daemon's metrics
//! listener) on TCP or a Unix socket ([`Acceptor`]): the connection cap, the header-read and
//! idle timeouts, and the graceful stop. Owns nothing of the API itself: every accepted
//! connection is served by the router it is given.
//!
//! - Over `max_connections`, a connection is answered `503 too_many_connections` and
//!   closed at once, without reading it and without reaching the router or the pool.
//! - hyper's header-read timer bounds the wait for a complete request head, from the
//!   accept and again from the end of each response.
//! - A connection on which no byte moves either way for the idle timeout is closed: at
//!   once if it never completed a request head, else gracefully (hyper closes it if it is
//!   between requests, or after the response in progress, which is never cut).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use axum::Router;
use hyper::body::Incoming;
use hyper::service::Service as _;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream, UnixListener, UnixStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore, watch};

use crate::low_latency::QuickAck;
use tokio::time::Instant;

/// A listening socket [`serve`] accepts connections on: a [`TcpListener`], or a
/// [`UnixListener`] for a gateway on the same host (no TCP on either side of the loopback:
/// each write is a copy into the peer's queue, where on TCP the sender's CPU also runs the
/// receiver's protocol work).
pub trait Acceptor: Send + 'static {
    /// A connection as accepted.
    type Accepted: Send + 'static;
    /// The connection as served (a TCP one tuned for small exchanges).
    type Io: AsyncRead + AsyncWrite + Unpin + Send + 'static;

    /// The next connection.
    fn accept_next(&self) -> impl Future<Output = std::io::Result<Self::Accepted>> + Send;

    /// Writes `answer` to a connection not served, without blocking (what does not fit in
    /// the socket's buffer is dropped); the connection closes when it is dropped after.
    fn try_answer(accepted: &Self::Accepted, answer: &[u8]);

    /// The connection as served.
    fn io(accepted: Self::Accepted) -> Self::Io;
}

impl Acceptor for TcpListener {
    type Accepted = TcpStream;
    type Io = QuickAck;

    async fn accept_next(&self) -> std::io::Result<TcpStream> {
        self.accept().await.map(|(stream, _)| stream)
    }

    fn try_answer(accepted: &TcpStream, answer: &[u8]) {
        let _ = accepted.try_write(answer);
    }

    fn io(accepted: TcpStream) -> QuickAck {
        QuickAck::new(accepted, "an HTTP connection")
    }
}

impl Acceptor for UnixListener {
    type Accepted = UnixStream;
    type Io = UnixStream;

    async fn accept_next(&self) -> std::io::Result<UnixStream> {
        self.accept().await.map(|(stream, _)| stream)
    }

    fn try_answer(accepted: &UnixStream, answer: &[u8]) {
        let _ = accepted.try_write(answer);
    }

    fn io(accepted: UnixStream) -> UnixStream {
        accepted
    }
}

/// The limits of one listener.
#[derive(Debug, Clone, Copy)]
#[non_exhaustive]
pub struct ConnectionLimits {
    /// A request head must be complete this long after the accept, and again after each
    /// response (default 30 s).
    pub header_read_timeout: Duration,
    /// A connection on which no byte moves either way for this long is closed; a response
    /// in progress is finished first (default 10 s).
    pub idle_timeout: Duration,
    /// Open connections at most (default 4096); one more is answered 503
    /// `too_many_connections` and closed without being read.
    pub max_connections: usize,
    /// What raises `max_connections`, as the refusal and the log name it (default
    /// `max_connections`, the daemon's setting).
    pub setting: &'static str,
}

impl Default for ConnectionLimits {
    fn default() -> Self {
        Self {
            header_read_timeout: Duration::from_secs(30),
            idle_timeout: Duration::from_secs(10),
            max_connections: 4096,
            setting: "max_connections",
        }
    }
}

/// After a failed `accept` (descriptors exhausted, for example) the loop waits this long:
/// the listener stays readable, so retrying at once would spin.
const ACCEPT_BACKOFF: Duration = Duration::from_millis(100);

/// Serves `router` on `listener` until `shutdown` resolves, then tells every open
/// connection to finish (responses in progress complete, idle connections close) and returns
/// when all are closed. The caller bounds the wait (a running event stream keeps its
/// connection open until its turn ends).
pub async fn serve<L: Acceptor>(
    listener: L,
    router: Router,
    limits: ConnectionLimits,
    shutdown: impl Future<Output = ()>,
) {
    let (stop_tx, stop) = watch::channel(false);
    let mut shutdown = std::pin::pin!(shutdown);
    let permits = Arc::new(Semaphore::new(limits.max_connections));
    let mut builder = hyper::server::conn::http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_read_timeout);
    let service = TowerToHyperService::new(router);
    let mut refused: u64 = 0;
    loop {
        let accepted = tokio::select! {
            accepted = listener.accept_next() => accepted,
            () = shutdown.as_mut() => break,
        };
        let stream = match accepted {
            Ok(stream) => stream,
            Err(e) => {
                tracing::warn!(error = %e, "Accepting a connection failed; retrying.");
                tokio::select! {
                    _ = tokio::time::sleep(ACCEPT_BACKOFF) => continue,
                    () = shutdown.as_mut() => break,
                }
            }
        };
        let Ok(permit) = permits.clone().try_acquire_owned() else {
            refused += 1;
            if refused == 1 || refused.is_multiple_of(1024) {
                tracing::warn!(
                    refused,
                    max_connections = limits.max_connections,
                    setting = limits.setting,
                    "Connections over the cap are answered 503 and closed; raise the setting named if they are wanted."
                );
            }
            L::try_answer(&stream, too_many_connections(&limits).as_bytes());
            continue;
        };
        let activity = Arc::new(Activity::new());
        let io = TokioIo::new(Tracked {
            inner: L::io(stream),
            activity: activity.clone(),
        });
        let counted = {
            let activity = activity.clone();
            let service = service.clone();
            hyper::service::service_fn(move |req: hyper::Request<Incoming>| {
                activity.request_started();
                service.call(req)
            })
        };
        let conn = builder.serve_connection(io, counted);
        tokio::spawn(connection(
            conn,
            activity,
            limits.idle_timeout,
            stop.clone(),
            permit,
        ));
    }
    // No more accepts: every open connection finishes.
    stop_tx.send_replace(true);
    // Every connection holds a permit until it is closed.
    let all = u32::try_from(limits.max_connections).unwrap_or(u32::MAX);
    let _ = permits.acquire_many(all).await;
}

/// Drives one connection with the idle timeout and the stop signal; the permit is given
/// back when it ends.
async fn connection<C>(
    conn: C,
    activity: Arc<Activity>,
    idle: Duration,
    mut stop: watch::Receiver<bool>,
    _permit: OwnedSemaphorePermit,
) where
    C: std::future::Future<Output = Result<(), hyper::Error>> + GracefulShutdown,
{
    let mut conn = std::pin::pin!(conn);
    let mut closing = false;
    loop {
        let idle_at = activity.last() + idle;
        // A response the peer stopped reading (a write waiting on its full window) for as
        // long as the idle timeout: the connection is dropped, graceful close or not (a
        // quiet response, no write waiting, is left to go on).
        let stalled_at = activity.blocked_since().map(|since| since + idle);
        tokio::select! {
            done = conn.as_mut() => {
                if let Err(e) = done {
                    tracing::debug!(error = %e, "HTTP connection ended with an error.");
                }
                return;
            }
            _ = tokio::time::sleep_until(stalled_at.unwrap_or(idle_at)), if stalled_at.is_some() => {
                if activity.blocked_since().is_some_and(|since| since + idle <= Instant::now()) {
                    tracing::debug!("An HTTP client stopped reading a response; its connection is dropped.");
                    return;
                }
            }
            _ = tokio::time::sleep_until(idle_at), if !closing => {
                if activity.last() + idle > Instant::now() {
                    continue;
                }
                if activity.requests() == 0 {
                    // Nothing was ever asked on it, so nothing is in progress.
                    return;
                }
                conn.as_mut().shut_down_gracefully();
                closing = true;
            }
            _ = stop.wait_for(|s| *s), if !closing => {
                if activity.requests() == 0 {
                    return;
                }
                conn.as_mut().shut_down_gracefully();
                closing = true;
            }
        }
    }
}

/// hyper's graceful shutdown, named so `connection` can take any connection future.
trait GracefulShutdown {
    fn shut_down_gracefully(self: std::pin::Pin<&mut Self>);
}

impl<I, S> GracefulShutdown for hyper::server::conn::http1::Connection<I, S>
where
    S: hyper::service::HttpService<Incoming>,
    S::ResBody: 'static,
    <S::ResBody as hyper::body::Body>::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
    I: hyper::rt::Read + hyper::rt::Write + Unpin,
{
    fn shut_down_gracefully(self: std::pin::Pin<&mut Self>) {
        self.graceful_shutdown();
    }
}

/// The answer to a connection over the cap, written once into its empty socket buffer
/// before it is closed; the request (if one was sent already) is not read.
fn too_many_connections(limits: &ConnectionLimits) -> String {
    let body = serde_json::json!({
        "code": "too_many_connections",
        "message": format!(
            "{} connections are open already (the cap); retry later or raise {}",
            limits.max_connections, limits.setting
        ),
    })
    .to_string();
    format!(
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n\
         connection: close\r\nretry-after: 1\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    )
}

/// When a byte last moved on a connection, how many requests it has carried, and since when
/// a write has waited for the peer to read.
struct Activity {
    start: Instant,
    last_ms: AtomicU64,
    requests: AtomicU64,
    /// Milliseconds after `start` (plus one; 0: no write waiting) when a write first found
    /// the peer's window full.
    blocked_ms: AtomicU64,
}

impl Activity {
    fn new() -> Self {
        Self {
            start: Instant::now(),
            last_ms: AtomicU64::new(0),
            requests: AtomicU64::new(0),
            blocked_ms: AtomicU64::new(0),
        }
    }

    /// A write found the peer not reading (kept from the first such write until one goes).
    fn write_blocked(&self) {
        let ms = u64::try_from(self.start.elapsed().as_millis()).unwrap_or(u64::MAX - 1);
        let _ = self
            .blocked_ms
            .compare_exchange(0, ms + 1, Ordering::Relaxed, Ordering::Relaxed);
    }

    fn write_went(&self) {
        self.blocked_ms.store(0, Ordering::Relaxed);
    }

    /// Since when a write has waited for the peer to read, if one is waiting.
    fn blocked_since(&self) -> Option<Instant> {
        match self.blocked_ms.load(Ordering::Relaxed) {
            0 => None,
            ms => Some(self.start + Duration::from_millis(ms - 1)),
        }
    }

    fn touch(&self) {
        let ms = u64::try_from(self.start.elapsed().as_millis()).unwrap_or(u64::MAX);
        self.last_ms.store(ms, Ordering::Relaxed);
    }

    fn last(&self) -> Instant {
        self.start + Duration::from_millis(self.last_ms.load(Ordering::Relaxed))
    }

    fn request_started(&self) {
        self.requests.fetch_add(1, Ordering::Relaxed);
    }

    fn requests(&self) -> u64 {
        self.requests.load(Ordering::Relaxed)
    }
}

/// A connection that records when bytes move.
struct Tracked<S> {
    inner: S,
    activity: Arc<Activity>,
}

impl<S> Tracked<S> {
    fn wrote(&self, polled: &std::task::Poll<std::io::Result<usize>>) {
        match polled {
            std::task::Poll::Ready(Ok(n)) if *n > 0 => {
                self.activity.touch();
                self.activity.write_went();
            }
            std::task::Poll::Pending => self.activity.write_blocked(),
            _ => {}
        }
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for Tracked<S> {
    fn poll_read(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        let this = self.get_mut();
        let before = buf.filled().len();
        let polled = std::pin::Pin::new(&mut this.inner).poll_read(cx, buf);
        if buf.filled().len() > before {
            this.activity.touch();
        }
        polled
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Tracked<S> {
    fn poll_write(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        let this = self.get_mut();
        let polled = std::pin::Pin::new(&mut this.inner).poll_write(cx, buf);
        this.wrote(&polled);
        polled
    }

    fn poll_write_vectored(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> std::task::Poll<std::io::Result<usize>> {
        let this = self.get_mut();
        let polled = std::pin::Pin::new(&mut this.inner).poll_write_vectored(cx, bufs);
        this.wrote(&polled);
        polled
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.get_mut().inner).poll_flush(cx)
    }

    fn poll_shutdown(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.get_mut().inner).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::sync::oneshot;

    /// Upper bound for what should happen at once (a failure guard, not a wait).
    const LIMIT: Duration = Duration::from_secs(10);

    struct Server {
        addr: std::net::SocketAddr,
        stop: oneshot::Sender<()>,
        task: tokio::task::JoinHandle<()>,
    }

    async fn start(router: Router, limits: ConnectionLimits) -> Server {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (stop, stopped) = oneshot::channel::<()>();
        let task = tokio::spawn(serve(listener, router, limits, async move {
            let _ = stopped.await;
        }));
        Server { addr, stop, task }
    }

    /// Everything the peer sends until it closes (bounded by `LIMIT`).
    async fn read_until_closed<S: AsyncRead + Unpin>(stream: &mut S) -> String {
        let mut all = Vec::new();
        tokio::time::timeout(LIMIT, stream.read_to_end(&mut all))
            .await
            .expect("the server neither answered nor closed")
            .unwrap_or_default();
        String::from_utf8_lossy(&all).into_owned()
    }

    /// A server of `counting_router` with these timeouts.
    async fn with_timeouts(header_read_timeout: Duration, idle_timeout: Duration) -> Server {
        let limits = ConnectionLimits {
            header_read_timeout,
            idle_timeout,
            ..ConnectionLimits::default()
        };
        start(counting_router(Arc::default()), limits).await
    }

    fn counting_router(hits: Arc<AtomicUsize>) -> Router {
        Router::new().route(
            "/",
            axum::routing::get(move || {
                hits.fetch_add(1, Ordering::SeqCst);
                async { "hello" }
            }),
        )
    }

    /// Two connections served and held, then a third over the cap of two answered 503 and
    /// closed, never reaching the router (`hits`).
    async fn the_cap_of_two_holds<S, F>(connect: impl Fn() -> F, hits: &AtomicUsize)
    where
        S: AsyncRead + AsyncWrite + Unpin,
        F: Future<Output = S>,
    {
        let mut held = Vec::new();
        for _ in 0..2 {
            let mut c = connect().await;
            // A complete exchange proves the server accepted (and counted) it.
            c.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
                .await
                .unwrap();
            let mut buf = [0u8; 256];
            let n = tokio::time::timeout(LIMIT, c.read(&mut buf))
                .await
                .unwrap()
                .unwrap();
            assert!(buf[..n].starts_with(b"HTTP/1.1 200"));
            held.push(c);
        }
        let mut third = connect().await;
        third
            .write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            .await
            .unwrap();
        let refusal = read_until_closed(&mut third).await;
        assert!(refusal.starts_with("HTTP/1.1 503"), "{refusal}");
        assert!(refusal.contains("too_many_connections"), "{refusal}");
        assert_eq!(hits.load(Ordering::SeqCst), 2);
    }

    #[tokio::test]
    async fn a_connection_over_the_cap_is_answered_503_without_reaching_the_router() {
        let hits = Arc::new(AtomicUsize::new(0));
        let limits = ConnectionLimits {
            max_connections: 2,
            ..ConnectionLimits::default()
        };
        let server = start(counting_router(hits.clone()), limits).await;
        let addr = server.addr;
        the_cap_of_two_holds(
            || async move { TcpStream::connect(addr).await.unwrap() },
            &hits,
        )
        .await;
        let _ = server.stop.send(());
    }

    #[tokio::test]
    async fn a_unix_socket_is_served_under_the_same_cap() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("api.sock");
        let listener = UnixListener::bind(&path).unwrap();
        let hits = Arc::new(AtomicUsize::new(0));
        let limits = ConnectionLimits {
            max_connections: 2,
            ..ConnectionLimits::default()
        };
        let (stop, stopped) = oneshot::channel::<()>();
        let task = tokio::spawn(serve(
            listener,
            counting_router(hits.clone()),
            limits,
            async {
                let _ = stopped.await;
            },
        ));
        let connect = || {
            let path = path.clone();
            async move { UnixStream::connect(path).await.unwrap() }
        };
        the_cap_of_two_holds(connect, &hits).await;
        let _ = stop.send(());
        tokio::time::timeout(LIMIT, task).await.unwrap().unwrap();
    }

    #[tokio::test]
    async fn an_incomplete_request_head_is_closed_by_the_header_read_timeout() {
        let server = with_timeouts(Duration::from_millis(300), Duration::from_secs(600)).await;
        let mut c = TcpStream::connect(server.addr).await.unwrap();
        c.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n").await.unwrap();
        let answer = read_until_closed(&mut c).await;
        assert!(!answer.contains("hello"), "{answer}");
        let _ = server.stop.send(());
    }

    #[tokio::test]
    async fn a_silent_connection_is_closed_by_the_idle_timeout() {
        let server = with_timeouts(Duration::from_secs(600), Duration::from_millis(300)).await;
        let mut silent = TcpStream::connect(server.addr).await.unwrap();
        assert_eq!(read_until_closed(&mut silent).await, "");
        // After a request too: closed once nothing moves.
        let mut used = TcpStream::connect(server.addr).await.unwrap();
        used.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            .await
            .unwrap();
        let answer = read_until_closed(&mut used).await;
        assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
        let _ = server.stop.send(());
    }

    #[tokio::test]
    async fn a_client_that_stops_reading_a_response_is_dropped_after_the_idle_timeout() {
        const BODY: usize = 32 << 20;
        let router = Router::new().route("/big", axum::routing::get(|| async { "x".repeat(BODY) }));
        let limits = ConnectionLimits {
            idle_timeout: Duration::from_millis(300),
            ..ConnectionLimits::default()
        };
        let server = start(router, limits).await;
        let mut c = TcpStream::connect(server.addr).await.unwrap();
        c.write_all(b"GET /big HTTP/1.1\r\nHost: x\r\n\r\n")
            .await
            .unwrap();
        // Not reading for longer than the idle timeout twice over (the time itself is
        // what is tested): the server gives up on the response.
        tokio::time::sleep(Duration::from_secs(2)).await;
        let mut got = Vec::new();
        let _ = tokio::time::timeout(LIMIT, c.read_to_end(&mut got))
            .await
            .expect("the server closed the connection");
        assert!(
            got.len() < BODY,
            "the whole response ({} bytes) was kept for a reader that stopped",
            got.len()
        );
        let _ = server.stop.send(());
    }

    #[tokio::test]
    async fn shutdown_finishes_the_response_in_progress_then_returns() {
        let (release_tx, release_rx) = oneshot::channel::<()>();
        let (started_tx, started_rx) = oneshot::channel::<()>();
        let gates = Arc::new(std::sync::Mutex::new(Some((started_tx, release_rx))));
        let router = Router::new().route(
            "/slow",
            axum::routing::get(move || {
                let gates = gates.lock().unwrap().take();
                async move {
                    if let Some((started, release)) = gates {
                        let _ = started.send(());
                        let _ = release.await;
                    }
                    "finished"
                }
            }),
        );
        let server = start(router, ConnectionLimits::default()).await;
        let mut c = TcpStream::connect(server.addr).await.unwrap();
        c.write_all(b"GET /slow HTTP/1.1\r\nHost: x\r\n\r\n")
            .await
            .unwrap();
        tokio::time::timeout(LIMIT, started_rx)
            .await
            .unwrap()
            .unwrap();
        server.stop.send(()).unwrap();
        // No new connection is served once the shutdown began (refused, or closed unread).
        let late = TcpStream::connect(server.addr).await;
        if let Ok(mut late) = late {
            let _ = late
                .write_all(b"GET /slow HTTP/1.1\r\nHost: x\r\n\r\n")
                .await;
            let mut buf = [0u8; 64];
            let read = tokio::time::timeout(Duration::from_millis(300), late.read(&mut buf)).await;
            assert!(
                !matches!(read, Ok(Ok(n)) if n > 0),
                "a late connection was served"
            );
        }
        release_tx.send(()).unwrap();
        let answer = read_until_closed(&mut c).await;
        assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
        assert!(answer.ends_with("finished"), "{answer}");
        tokio::time::timeout(LIMIT, server.task)
            .await
            .expect("serve returned once its connections closed")
            .unwrap();
    }
}
