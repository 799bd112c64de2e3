//! Name resolution for model requests: the [`Resolve`] trait the guard asks once per request
//! (the system resolver by default; tests give their own), and the resolver handed to
//! reqwest, which refuses every name: a client only ever connects to the addresses the guard
//! checked and pinned for it (`resolve_to_addrs`), or to an IP address host it checked.

use std::future::Future;
use std::io;
use std::net::{IpAddr, SocketAddr};
use std::pin::Pin;
use std::sync::Arc;

use tokio::sync::Semaphore;

/// The future a [`Resolve`] returns.
pub type ResolveFuture = Pin<Box<dyn Future<Output = io::Result<Vec<IpAddr>>> + Send>>;

/// Resolves a host name to its addresses, and knows this machine's own.
pub trait Resolve: Send + Sync + 'static {
    /// Every address of `host` (the port is a hint for resolvers that want one).
    fn lookup(&self, host: &str, port: u16) -> ResolveFuture;

    /// The addresses of this machine's own network interfaces (by default read from the
    /// system, `getifaddrs`, each time): a request to one reaches the daemon's host, whose
    /// services may trust it, whatever range the address is in.
    fn host_addresses(&self) -> io::Result<Vec<IpAddr>> {
        this_machine_addresses()
    }
}

/// The addresses of this machine's network interfaces, as `getifaddrs` lists them now.
pub fn this_machine_addresses() -> io::Result<Vec<IpAddr>> {
    let interfaces = nix::ifaddrs::getifaddrs().map_err(io::Error::from)?;
    Ok(interfaces
        .filter_map(|interface| {
            let address = interface.address?;
            if let Some(v4) = address.as_sockaddr_in() {
                Some(IpAddr::V4(v4.ip()))
            } else {
                address.as_sockaddr_in6().map(|v6| IpAddr::V6(v6.ip()))
            }
        })
        .collect())
}

/// Lookups of a [`SystemResolver`] running at once (by default). `getaddrinfo` cannot be
/// cancelled: a lookup that outlives its caller's timeout (a name whose DNS server does not
/// answer) keeps its blocking thread until the C library gives up, so without a bound a
/// tenant's base URL on such a name could take every blocking thread the daemon's file work
/// needs. Past the bound a lookup waits for a place, within its caller's timeout. One
/// worker holds at most a few of them (the guard's `LOOKUPS_PER_WORKER`), so a tenant whose
/// provider host never answers stalls its own requests, not the others'.
pub const MAX_SYSTEM_LOOKUPS: usize = 64;

/// The operating system's resolver (`getaddrinfo`, on a blocking thread), at most
/// [`MAX_SYSTEM_LOOKUPS`] at once.
#[derive(Debug, Clone)]
pub struct SystemResolver {
    in_flight: Arc<Semaphore>,
}

impl Default for SystemResolver {
    fn default() -> Self {
        Self::with_limit(MAX_SYSTEM_LOOKUPS)
    }
}

impl SystemResolver {
    /// A resolver running at most `lookups` lookups at once (at least one).
    pub fn with_limit(lookups: usize) -> Self {
        Self {
            in_flight: Arc::new(Semaphore::new(lookups.max(1))),
        }
    }
}

impl Resolve for SystemResolver {
    fn lookup(&self, host: &str, port: u16) -> ResolveFuture {
        let host = host.to_owned();
        // `getaddrinfo` on a blocking thread.
        Box::pin(holding_a_place(
            self.in_flight.clone(),
            move || async move {
                tokio::task::spawn_blocking(move || {
                    use std::net::ToSocketAddrs;
                    Ok((host.as_str(), port)
                        .to_socket_addrs()?
                        .map(|a: SocketAddr| a.ip())
                        .collect())
                })
                .await
                .map_err(io::Error::other)?
            },
        ))
    }
}

/// Starts `lookup` once `in_flight` has a place, in a task of its own that holds the place
/// until the lookup returns, also when its caller stopped waiting (a lookup cannot be
/// cancelled: `getaddrinfo` runs on).
pub(super) async fn holding_a_place<F>(
    in_flight: Arc<Semaphore>,
    lookup: impl FnOnce() -> F,
) -> io::Result<Vec<IpAddr>>
where
    F: std::future::Future<Output = io::Result<Vec<IpAddr>>> + Send + 'static,
{
    let place = in_flight
        .acquire_owned()
        .await
        .map_err(|_| io::Error::other("the resolver's places are closed"))?;
    let lookup = lookup();
    tokio::spawn(async move {
        let addresses = lookup.await;
        drop(place);
        addresses
    })
    .await
    .map_err(io::Error::other)?
}

/// reqwest's resolver: refuses every name, so nothing but a pinned address is connected to.
#[derive(Debug, Clone, Copy)]
pub(crate) struct RefuseNames;

impl reqwest::dns::Resolve for RefuseNames {
    fn resolve(&self, name: reqwest::dns::Name) -> reqwest::dns::Resolving {
        let name = name.as_str().to_owned();
        Box::pin(async move {
            Err(format!("{name} was not checked by the model guard; refusing to resolve it").into())
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures_util::FutureExt;
    use std::sync::atomic::{AtomicBool, Ordering};

    #[tokio::test]
    async fn a_lookup_its_caller_gave_up_on_keeps_its_place_until_it_returns() {
        let in_flight = Arc::new(Semaphore::new(1));
        let (release, stuck) = tokio::sync::oneshot::channel::<()>();
        let (started, running) = tokio::sync::oneshot::channel();
        let first = tokio::spawn(holding_a_place(in_flight.clone(), move || async move {
            let _ = started.send(());
            let _ = stuck.await;
            Ok(Vec::new())
        }));
        running.await.expect("the first lookup runs");
        // Its caller's timeout: the lookup itself cannot be stopped, and keeps its place.
        first.abort();
        assert!(first.await.is_err_and(|e| e.is_cancelled()));
        assert_eq!(in_flight.available_permits(), 0);
        let ran = Arc::new(AtomicBool::new(false));
        let second = holding_a_place(in_flight.clone(), {
            let ran = ran.clone();
            move || {
                ran.store(true, Ordering::SeqCst);
                async { Ok(vec![IpAddr::from([127, 0, 0, 1])]) }
            }
        });
        let mut second = Box::pin(second);
        assert!((&mut second).now_or_never().is_none(), "waits for a place");
        assert!(!ran.load(Ordering::SeqCst), "no second lookup meanwhile");
        release.send(()).expect("release the first");
        let addresses = second.await.expect("the second lookup");
        assert_eq!(addresses, vec![IpAddr::from([127, 0, 0, 1])]);
    }

    #[test]
    fn this_machines_addresses_hold_its_loopback() {
        let addresses = this_machine_addresses().expect("getifaddrs");
        assert!(
            addresses.contains(&IpAddr::from([127, 0, 0, 1])),
            "{addresses:?}"
        );
    }

    #[tokio::test]
    async fn the_system_resolver_finds_localhost() {
        let addresses = SystemResolver::default()
            .lookup("localhost", 443)
            .await
            .expect("localhost");
        assert!(addresses.iter().all(IpAddr::is_loopback), "{addresses:?}");
        assert!(!addresses.is_empty());
    }
}
