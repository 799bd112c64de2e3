//! Name resolution for model requests: the [`Resolve`] trait the guard asks once per request
//! (the system resolver by default; tests give their own), and the resolver handed to
//! reqwest, which refuses every name: a client only ever connects to the addresses the guard
//! checked and pinned for it (`resolve_to_addrs`), or to an IP address host it checked.

use std::future::Future;
use std::io;
use std::net::{IpAddr, SocketAddr};
use std::pin::Pin;

/// The future a [`Resolve`] returns.
pub type ResolveFuture = Pin<Box<dyn Future<Output = io::Result<Vec<IpAddr>>> + Send>>;

/// Resolves a host name to its addresses.
pub trait Resolve: Send + Sync + 'static {
    /// Every address of `host` (the port is a hint for resolvers that want one).
    fn lookup(&self, host: &str, port: u16) -> ResolveFuture;
}

/// The operating system's resolver (`getaddrinfo`, on a blocking thread).
#[derive(Debug, Clone, Copy, Default)]
pub struct SystemResolver;

impl Resolve for SystemResolver {
    fn lookup(&self, host: &str, port: u16) -> ResolveFuture {
        let host = host.to_owned();
        Box::pin(async move {
            let addrs = tokio::net::lookup_host((host.as_str(), port)).await?;
            Ok(addrs.map(|a: SocketAddr| a.ip()).collect())
        })
    }
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
