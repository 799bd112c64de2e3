//! Accepting SDK clients on a TCP or Unix-socket listener: the connection cap (a connection
//! over it is counted, its first request answered with `TOO_MANY_CONNECTIONS` naming the
//! setting (16 at a time, each within 2 s; past that closed unread), then closed), the room for connections not
//! authenticated yet (`admission`: a new one past it closes the oldest), and the stop (no more accepts; every
//! open connection is closed, its turns aborted and its sessions parked, and every one being
//! refused closed, before the call returns).

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite};

use crate::low_latency::QuickAck;
use tokio::net::{TcpListener, UnixListener};
use tokio::sync::{Semaphore, watch};

use super::admission::Admission;
use super::{SdkEndpoint, connection};

/// After a failed `accept` (descriptors exhausted, for example) the loop waits this long:
/// the listener stays readable, so retrying at once would spin.
const ACCEPT_BACKOFF: Duration = Duration::from_millis(100);

/// Connections over `max_connections` told why at once (their first request answered with
/// [`connection::TOO_MANY_CONNECTIONS`]); past these, closed unread.
const REFUSALS_AT_ONCE: usize = 16;

/// How long a refused connection has to send its first request before it is closed unread.
const REFUSAL_READ_LIMIT: Duration = Duration::from_secs(2);

/// Serves SDK clients on a TCP listener until `shutdown` resolves; then closes every open
/// connection and returns once all are closed. Bind it to loopback or a private network:
/// the connection token is the only authentication, and the stream is not encrypted.
pub async fn serve_tcp(
    endpoint: &SdkEndpoint,
    listener: TcpListener,
    shutdown: impl Future<Output = ()>,
) {
    serve(endpoint, shutdown, || accept_client(&listener)).await;
}

/// The next client of `listener`, its socket probed ([`keep_alive`]) and tuned for small
/// frames ([`QuickAck`]).
async fn accept_client(listener: &TcpListener) -> std::io::Result<QuickAck> {
    let (stream, _) = listener.accept().await?;
    keep_alive(&stream);
    Ok(QuickAck::new(stream, "an SDK connection"))
}

/// A client's connection silent this long is probed by the kernel...
const KEEPALIVE_IDLE: Duration = Duration::from_secs(60);
/// ...this often...
const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(10);
/// ...and counts as dead after this many probes go unanswered.
const KEEPALIVE_PROBES: u32 = 3;

/// Turns on TCP keepalive for an accepted client: a client whose host vanished without
/// closing (rebooted, its NAT forgot the flow) is found within ~90 s, and its connection
/// closed, so its seat and its sessions go back to the agent's next connection (a session is
/// open on one connection at a time).
fn keep_alive(stream: &tokio::net::TcpStream) {
    let probes = socket2::TcpKeepalive::new()
        .with_time(KEEPALIVE_IDLE)
        .with_interval(KEEPALIVE_INTERVAL)
        .with_retries(KEEPALIVE_PROBES);
    if let Err(error) = socket2::SockRef::from(stream).set_tcp_keepalive(&probes) {
        tracing::debug!(%error, "Could not turn on TCP keepalive for an SDK connection.");
    }
}

/// [`serve_tcp`] on a Unix socket (give the socket file owner-only permissions: anyone who
/// can connect may try tokens).
pub async fn serve_unix(
    endpoint: &SdkEndpoint,
    listener: UnixListener,
    shutdown: impl Future<Output = ()>,
) {
    serve(endpoint, shutdown, || async {
        listener.accept().await.map(|(stream, _)| stream)
    })
    .await;
}

async fn serve<S, A, F>(endpoint: &SdkEndpoint, shutdown: impl Future<Output = ()>, accept: A)
where
    S: AsyncRead + AsyncWrite + Send + 'static,
    A: Fn() -> F,
    F: Future<Output = std::io::Result<S>>,
{
    let shared = endpoint.shared.clone();
    let max = shared.config.max_connections;
    let permits = Arc::new(Semaphore::new(max));
    let admission = Admission::new(shared.config.max_unauthenticated_connections);
    let mut displaced: u64 = 0;
    let (stop_tx, stop) = watch::channel(false);
    let mut shutdown = std::pin::pin!(shutdown);
    let mut refused: u64 = 0;
    let refusals = Arc::new(Semaphore::new(REFUSALS_AT_ONCE));
    loop {
        let accepted = tokio::select! {
            accepted = accept() => accepted,
            () = shutdown.as_mut() => break,
        };
        let stream = match accepted {
            Ok(stream) => stream,
            Err(error) => {
                tracing::warn!(%error, "Accepting an SDK connection failed; retrying.");
                tokio::select! {
                    _ = tokio::time::sleep(ACCEPT_BACKOFF) => continue,
                    () = shutdown.as_mut() => break,
                }
            }
        };
        let Ok(permit) = permits.clone().try_acquire_owned() else {
            refused += 1;
            crate::metrics::sdk_connection(crate::metrics::SdkConnection::Refused);
            if refused == 1 || refused.is_multiple_of(1024) {
                tracing::warn!(
                    refused,
                    max_connections = max,
                    "SDK connections over max_connections are closed at once; raise \
                     max_connections or spread the clients over replicas."
                );
            }
            // Told why, while few are: an SDK would otherwise see only a reset connection.
            // A stop closes them at once, unanswered (they hold nothing to keep).
            if let Ok(refusal) = refusals.clone().try_acquire_owned() {
                let mut stop = stop.clone();
                tokio::spawn(async move {
                    tokio::select! {
                        () = refuse_over_the_cap(stream, max) => {}
                        _ = stop.wait_for(|stopped| *stopped) => {}
                    }
                    drop(refusal);
                });
            }
            continue;
        };
        crate::metrics::sdk_connection(crate::metrics::SdkConnection::Accepted);
        let (slot, displaced_one) = admission.admit();
        if displaced_one {
            displaced += 1;
            if displaced == 1 || displaced.is_multiple_of(1024) {
                tracing::warn!(
                    displaced,
                    max_unauthenticated_connections = shared.config.max_unauthenticated_connections,
                    "More SDK connections wait to authenticate than \
                     max_unauthenticated_connections: each new one closes the oldest (a client \
                     that connects and sends no connect)."
                );
            }
        }
        let shared = shared.clone();
        let stop = stop.clone();
        tokio::spawn(async move {
            connection::run(shared, stream, stop, slot).await;
            drop(permit);
        });
    }
    stop_tx.send_replace(true);
    // Every connection holds a permit until it is closed, and so does every connection
    // being refused.
    let all = u32::try_from(max).unwrap_or(u32::MAX);
    let _ = permits.acquire_many(all).await;
    let _ = refusals
        .acquire_many(u32::try_from(REFUSALS_AT_ONCE).unwrap_or(u32::MAX))
        .await;
}

/// Answers the first request of a connection over the cap (the SDK's `connect`) with
/// [`connection::TOO_MANY_CONNECTIONS`] naming the setting, then closes it; a connection that
/// sends nothing readable within [`REFUSAL_READ_LIMIT`] is closed unread.
async fn refuse_over_the_cap<S>(stream: S, max: usize)
where
    S: AsyncRead + AsyncWrite + Send,
{
    use futures_util::{SinkExt, StreamExt};
    use tokio_util::codec::Framed;
    let codec = crate::rpc::FrameCodec::new(connection::UNAUTHENTICATED_MAX_FRAME_BYTES);
    let mut framed = std::pin::pin!(Framed::new(stream, codec));
    let Ok(Some(Ok(frame))) = tokio::time::timeout(REFUSAL_READ_LIMIT, framed.next()).await else {
        return;
    };
    let id = serde_json::from_slice::<serde_json::Value>(&frame)
        .ok()
        .and_then(|request| request.get("id").cloned())
        .unwrap_or(serde_json::Value::Null);
    let answer = serde_json::json!({
        "jsonrpc": "2.0",
        "id": id,
        "error": {
            "code": connection::TOO_MANY_CONNECTIONS,
            "message": format!(
                "TOO_MANY_CONNECTIONS: this daemon's SDK endpoint holds its max_connections \
                 ({max}) connections; retry later, raise [sdk] max_connections, or spread the \
                 clients over replicas"
            ),
        },
    });
    let _ = tokio::time::timeout(
        REFUSAL_READ_LIMIT,
        framed.send(bytes::Bytes::from(answer.to_string())),
    )
    .await;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn an_accepted_client_is_probed_so_a_vanished_one_is_found() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let _client = tokio::net::TcpStream::connect(addr).await.unwrap();
        let accepted = accept_client(&listener).await.unwrap();
        let socket = socket2::SockRef::from(accepted.stream());
        assert!(socket.tcp_nodelay().unwrap());
        assert!(socket.keepalive().unwrap());
        assert_eq!(socket.tcp_keepalive_time().unwrap(), KEEPALIVE_IDLE);
        assert_eq!(socket.tcp_keepalive_interval().unwrap(), KEEPALIVE_INTERVAL);
        assert_eq!(socket.tcp_keepalive_retries().unwrap(), KEEPALIVE_PROBES);
    }
}
