//! The guarded model path: every model HTTP request of a BYOK worker's runtime comes over
//! the JSON-RPC tunnel (`llmInference.*`, see [`crate::tunnel`]) and the pool makes the real
//! request with its own HTTP client, so the provider's key never enters the child and a
//! tenant's base URL cannot reach the gateway's own network.
//!
//! * here — [`ModelGuardConfig`] (the pool's switches and limits), [`ModelGuard`] (built once
//!   per pool: TLS roots, resolver) with [`ModelGuard::check_provider`] (what a lease is
//!   refused for before anything runs) and [`ModelGuard::tunnel_for`] (one worker's tunnel
//!   and the placeholder provider its child gets);
//! * `address` — which IP addresses may be connected to (every special-purpose range of
//!   IPv4 and IPv6, embedded IPv4 forms included, and this machine's own addresses);
//! * `target` — which URLs may be requested (scheme, userinfo, credential-looking query
//!   parameters, the mapping of the placeholder URL onto the provider's);
//! * `resolve` — the [`Resolve`] trait (the system resolver, or a test's) and the resolver
//!   reqwest gets, which refuses every name (connections go only to checked addresses);
//! * `tls` — the client's rustls config (compiled-in Mozilla roots plus extra CAs);
//! * `forward` — the tunnel itself: check, resolve once, pin, send, stream back, metrics;
//! * `priming` — the pool's priming turns' model calls, answered here without a provider.
//!
//! The mechanism that keeps the key out of the child: a BYOK lease's `session.create` gets
//! [`ModelGuard::placeholder`] (placeholder key, bearer token and base URL, no headers);
//! the worker is started with `llmInference.setProvider`, so the runtime sends each model
//! request to us with the placeholder in its auth header; the worker's tunnel holds the real
//! provider and puts the real key in the upstream request only. One worker serves one
//! provider: the pool key holds the BYOK fingerprint (type, URL, wire API, headers, key,
//! model), so every conversation on a worker has the provider its tunnel was built with.

mod address;
mod forward;
mod priming;
mod resolve;
mod target;
mod tls;

use std::net::IpAddr;
use std::sync::Arc;
use std::time::Duration;

use crate::kinds::BlockReason;
use crate::rpc::messages::ProviderConfig;
use crate::secret::Secret;
use crate::tunnel::ModelTunnel;

pub use address::{AddressClass, allowed, classify, embedded_v4};
pub use resolve::{MAX_SYSTEM_LOOKUPS, Resolve, ResolveFuture, SystemResolver};
pub use target::{check_url, credential_query};

/// The largest model request body the guard forwards by default (32 MiB).
pub const DEFAULT_MAX_REQUEST_BODY_BYTES: usize = 32 << 20;

/// How long the model guard keeps this machine's addresses before reading them again.
pub const HOST_ADDRESSES_TTL: Duration = Duration::from_secs(30);

/// The host of the placeholder base URL a BYOK child gets (`.invalid` never resolves).
pub const PLACEHOLDER_HOST: &str = "byok.copilot-pool.invalid";
/// The API key a BYOK child gets instead of the real one.
pub const PLACEHOLDER_API_KEY: &str = "copilot-pool-placeholder-api-key";
/// The bearer token a BYOK child gets instead of the real one.
pub const PLACEHOLDER_BEARER_TOKEN: &str = "copilot-pool-placeholder-bearer-token";

pub(crate) use priming::PRIMING_BASE_URL;

/// The guard's switches and limits (part of [`crate::pool::PoolConfig`]; the daemon's
/// `[model]` section). Nothing here comes from a request.
#[derive(Clone)]
#[non_exhaustive]
pub struct ModelGuardConfig {
    /// Allow loopback, private, shared (CGNAT), link-local and unique-local addresses and
    /// this machine's own, and plain `http://` to loopback (default false): for local models and tests. Metadata,
    /// unspecified, multicast, documentation and reserved addresses stay refused.
    pub allow_private_endpoints: bool,
    /// Providers allowed on private addresses even when `allow_private_endpoints` is off:
    /// their base URLs' origins (`http://127.0.0.1:11434`, `https://llm.internal:8443`), set
    /// by the operator (the daemon's `[model] private_endpoints`), never by a request.
    pub private_endpoints: Vec<url::Url>,
    /// Extra trusted root certificates, PEM (each may hold several), on top of the
    /// compiled-in Mozilla roots.
    pub extra_root_certificates_pem: Vec<Vec<u8>>,
    /// Request bodies above this are answered 413 before any upstream call (default 32 MiB).
    pub max_request_body_bytes: usize,
    /// Resolving the host and establishing TCP and TLS (default 10 s).
    pub connect_timeout: Duration,
    /// From the request being sent to the response head (default 300 s: a non-streaming
    /// completion arrives whole).
    pub first_byte_timeout: Duration,
    /// Between two pieces of the response body (default 120 s).
    pub idle_timeout: Duration,
    /// Who resolves host names (default: the system resolver). Tests give their own.
    pub resolver: Arc<dyn Resolve>,
    /// The ports a request's provider may name for a CLI backend (default `[443]`). A CLI
    /// calls its model itself, and its sandbox opens the port it calls on every address to
    /// the agent's tools (Landlock walls ports, not addresses), so a tenant who names
    /// `:80` would open the cloud metadata service to its tools. A local model may name any
    /// port: a provider whose every address is private (loopback, RFC 1918, …) where
    /// private endpoints are allowed for it (`allow_private_endpoints`, or its origin in
    /// `private_endpoints`).
    pub cli_provider_ports: Vec<u16>,
}

impl ModelGuardConfig {
    /// Parses an entry of [`ModelGuardConfig::private_endpoints`]: an `http` or `https`
    /// origin (scheme, host, optional port; no user, path, query or fragment).
    pub fn private_endpoint(text: &str) -> Result<url::Url, GuardError> {
        let bad = || GuardError::PrivateEndpoint(text.to_owned());
        let url = url::Url::parse(text).map_err(|_| bad())?;
        let origin_only = matches!(url.scheme(), "http" | "https")
            && url.host().is_some()
            && url.username().is_empty()
            && url.password().is_none()
            && url.path() == "/"
            && url.query().is_none()
            && url.fragment().is_none();
        if !origin_only {
            return Err(bad());
        }
        // Model requests go over plain http:// to loopback only (`target::check_addresses`,
        // on the addresses a name resolves to): an http origin at another address would be
        // listed and never reached. (A name is judged by what it resolves to, per request.)
        let elsewhere = match url.host() {
            Some(url::Host::Ipv4(ip)) => address::classify(IpAddr::V4(ip)),
            Some(url::Host::Ipv6(ip)) => address::classify(IpAddr::V6(ip)),
            _ => Some(AddressClass::Loopback),
        } != Some(AddressClass::Loopback);
        if url.scheme() == "http" && elsewhere {
            return Err(GuardError::PlainHttpPrivateEndpoint(text.to_owned()));
        }
        Ok(url)
    }

    /// Whether `url` may be on a private address: everywhere with `allow_private_endpoints`,
    /// else only on the origin of one of `private_endpoints`.
    pub fn allows_private(&self, url: &url::Url) -> bool {
        self.allow_private_endpoints
            || self
                .private_endpoints
                .iter()
                .any(|endpoint| endpoint.origin() == url.origin())
    }
}

impl Default for ModelGuardConfig {
    fn default() -> Self {
        Self {
            allow_private_endpoints: false,
            private_endpoints: Vec::new(),
            extra_root_certificates_pem: Vec::new(),
            max_request_body_bytes: DEFAULT_MAX_REQUEST_BODY_BYTES,
            connect_timeout: Duration::from_secs(10),
            first_byte_timeout: Duration::from_secs(300),
            idle_timeout: Duration::from_secs(120),
            resolver: Arc::new(SystemResolver::default()),
            cli_provider_ports: vec![crate::sandbox::HTTPS_PORT],
        }
    }
}

impl std::fmt::Debug for ModelGuardConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ModelGuardConfig")
            .field("allow_private_endpoints", &self.allow_private_endpoints)
            .field("private_endpoints", &self.private_endpoints.len())
            .field(
                "extra_root_certificates",
                &self.extra_root_certificates_pem.len(),
            )
            .field("max_request_body_bytes", &self.max_request_body_bytes)
            .field("connect_timeout", &self.connect_timeout)
            .field("first_byte_timeout", &self.first_byte_timeout)
            .field("idle_timeout", &self.idle_timeout)
            .field("cli_provider_ports", &self.cli_provider_ports)
            .finish_non_exhaustive()
    }
}

/// Why the guard cannot be built, or refuses a provider.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum GuardError {
    /// An extra root certificate is not usable PEM.
    #[error(
        "extra_root_certificates (the daemon's [model] extra_ca_files): {0}; give PEM files \
         with one or more `-----BEGIN CERTIFICATE-----` blocks"
    )]
    Certificate(String),
    /// An entry of `private_endpoints` is not an origin.
    #[error(
        "private_endpoints (the daemon's [model] private_endpoints): {0:?} is not an origin; \
         give scheme, host and port only, as `http://127.0.0.1:11434` or \
         `https://llm.internal:8443`"
    )]
    PrivateEndpoint(String),
    /// An entry of `private_endpoints` is plain `http://` to an IP address other than
    /// loopback, which model requests never go to.
    #[error(
        "private_endpoints (the daemon's [model] private_endpoints): {0:?} is plain http:// \
         to an address that is not loopback, and model requests go over plain http:// only \
         to loopback (the provider's key would cross the network in clear); serve the model \
         over https:// and list that origin, or list a loopback address"
    )]
    PlainHttpPrivateEndpoint(String),
    /// A CLI backend's provider host did not resolve, so its addresses could not be checked.
    #[error(
        "provider.base_url: {host} did not resolve ({error}); a CLI backend calls its model \
         itself, so its host's addresses are checked before the turn: check the host name, \
         or retry if the daemon's DNS is failing"
    )]
    Unresolved {
        /// The host name.
        host: String,
        /// What the resolver said.
        error: String,
    },
    /// The provider's base URL is refused.
    #[error("provider.base_url: {message}")]
    Refused {
        /// The metric label of the refusal.
        reason: BlockReason,
        /// What is wrong and how to fix it.
        message: String,
    },
}

/// The guard of one pool: its config, the TLS config every client shares, the resolver.
/// Cheap to clone.
#[derive(Clone, Debug)]
pub struct ModelGuard {
    inner: Arc<Inner>,
}

struct Inner {
    config: ModelGuardConfig,
    /// This machine's addresses and when they were read ([`ModelGuard::host_addresses`]).
    host_addresses: std::sync::Mutex<Option<(std::time::Instant, Arc<Vec<IpAddr>>)>>,
    tls: rustls::ClientConfig,
    /// The places of CLI providers' lookups over the pool ([`CLI_LOOKUPS`]).
    cli_lookups: Arc<tokio::sync::Semaphore>,
    /// Each agent's places among them ([`CLI_LOOKUPS_PER_AGENT`]), while it has lookups.
    agent_lookups: std::sync::Mutex<std::collections::HashMap<String, Arc<tokio::sync::Semaphore>>>,
}

/// Lookups of CLI backends' provider hosts running at once over the pool: tenants whose
/// provider hosts never answer hold at most these of the resolver's places, not the ones
/// the tunnels' model calls need.
pub const CLI_LOOKUPS: usize = 16;

/// Of [`CLI_LOOKUPS`], one agent's at once: an agent whose provider host never answers
/// stalls its own CLI turns' checks, not the other agents'.
pub const CLI_LOOKUPS_PER_AGENT: usize = 2;

impl std::fmt::Debug for Inner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.config.fmt(f)
    }
}

impl ModelGuard {
    /// Builds the guard: parses the extra root certificates.
    pub fn new(config: ModelGuardConfig) -> Result<Self, GuardError> {
        let tls = tls::client_config(&config.extra_root_certificates_pem)?;
        Ok(Self {
            inner: Arc::new(Inner {
                config,
                tls,
                cli_lookups: Arc::new(tokio::sync::Semaphore::new(CLI_LOOKUPS)),
                agent_lookups: std::sync::Mutex::default(),
                host_addresses: std::sync::Mutex::default(),
            }),
        })
    }

    /// The guard's config.
    pub fn config(&self) -> &ModelGuardConfig {
        &self.inner.config
    }

    /// This machine's own addresses ([`Resolve::host_addresses`]), read again at most every
    /// [`HOST_ADDRESSES_TTL`]: interfaces change rarely, and reading them is a round trip to
    /// the kernel a model request to a public provider would otherwise make each time. When
    /// they cannot be read, none (warned once a read): a request to this machine's public
    /// address is not refused meanwhile.
    pub(crate) fn host_addresses(&self) -> Arc<Vec<IpAddr>> {
        let now = std::time::Instant::now();
        let mut cached = self
            .inner
            .host_addresses
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some((read, addresses)) = cached.as_ref()
            && now.saturating_duration_since(*read) < HOST_ADDRESSES_TTL
        {
            return addresses.clone();
        }
        let addresses = Arc::new(self.inner.config.resolver.host_addresses().unwrap_or_else(
            |error| {
                tracing::warn!(
                    %error,
                    "This machine's own addresses could not be read; a model request to its \
                     public address is not refused meanwhile."
                );
                Vec::new()
            },
        ));
        *cached = Some((now, addresses.clone()));
        addresses
    }

    /// Checks a provider before anything runs with it: its base URL parses, is `https`
    /// (plain `http` only to loopback, with `allow_private_endpoints`), has no userinfo, no
    /// credential-looking query parameter, and an IP address host is allowed. A host name
    /// is resolved and checked on every request.
    pub fn check_provider(&self, provider: &ProviderConfig) -> Result<(), GuardError> {
        let url = target::parse_base(&provider.base_url)?;
        let allow = self.inner.config.allows_private(&url);
        check_url(&url, allow).map_err(refused)?;
        if let Some(ip) = target::ip_host(&url) {
            target::check_addresses(&url, &[ip], allow, &|| self.host_addresses())
                .map_err(refused)?;
        }
        Ok(())
    }

    /// Checks a provider a CLI backend calls itself, with no tunnel between (Claude Code,
    /// Codex, Gemini CLI get the base URL): [`ModelGuard::check_provider`], then its port
    /// (one of [`ModelGuardConfig::cli_provider_ports`] unless private endpoints are allowed
    /// for it: the CLI's sandbox opens that port on every address to the agent's tools), then
    /// every address its host resolves to now, by the same rules as a tunnelled request's,
    /// within `connect_timeout`. The CLI resolves the name again itself, so this refuses a
    /// name that points inside the network, not one whose answer changes after the check
    /// (the tunnel's pinning does that for the Copilot runtime). A name that does not
    /// resolve is refused: the check cannot be made. A refusal counts in
    /// `copilot_pool_model_blocked_total` (the model requests the CLI would have made).
    pub async fn check_cli_provider(
        &self,
        provider: &ProviderConfig,
        agent: &str,
    ) -> Result<(), GuardError> {
        let checked = self.check_cli_provider_uncounted(provider, agent).await;
        if let Err(GuardError::Refused { reason, message }) = &checked {
            tracing::warn!(
                reason = reason.label(),
                "Model request refused by the guard: a CLI backend's provider at its lease: \
                 {message}"
            );
            crate::metrics::model_blocked(*reason);
        }
        checked
    }

    async fn check_cli_provider_uncounted(
        &self,
        provider: &ProviderConfig,
        agent: &str,
    ) -> Result<(), GuardError> {
        self.check_provider(provider)?;
        let url = target::parse_base(&provider.base_url)?;
        let config = &self.inner.config;
        let allow = config.allows_private(&url);
        let port = url
            .port_or_known_default()
            .unwrap_or(crate::sandbox::HTTPS_PORT);
        let port_refused = || {
            refused((
                BlockReason::Port,
                format!(
                    "port {port} is not one a CLI backend's provider may use ({:?}): a CLI \
                     calls its model itself and its sandbox opens that port on every address \
                     to the agent's tools; use the provider's https port, or have the \
                     operator list the port in [model] cli_provider_ports \
                     (ModelGuardConfig::cli_provider_ports in the library)",
                    config.cli_provider_ports
                ),
            ))
        };
        let listed = config.cli_provider_ports.contains(&port);
        if !listed && !allow {
            return Err(port_refused());
        }
        let addresses = match target::ip_host(&url) {
            Some(ip) => vec![ip],
            None => self.resolve_for_cli(&url, port, agent).await?,
        };
        target::check_addresses(&url, &addresses, allow, &|| self.host_addresses())
            .map_err(refused)?;
        // A port not listed only for a local model (every address private, where private
        // endpoints are allowed): a public host on :80 would open the metadata service's port.
        let local = addresses
            .iter()
            .all(|ip| address::classify(*ip).is_some_and(AddressClass::private_endpoint));
        if !listed && !local {
            return Err(port_refused());
        }
        Ok(())
    }

    /// The addresses of `url`'s host name, for a CLI backend's provider of `agent`: at most
    /// [`CLI_LOOKUPS`] at once over the pool and [`CLI_LOOKUPS_PER_AGENT`] of the agent's
    /// (each holds its places until the resolver returns, as a tunnel's do), within
    /// `connect_timeout`.
    async fn resolve_for_cli(
        &self,
        url: &url::Url,
        port: u16,
        agent: &str,
    ) -> Result<Vec<IpAddr>, GuardError> {
        let host = url.host_str().unwrap_or_default();
        let agent_places = self.agent_places(agent);
        let pool_places = self.inner.cli_lookups.clone();
        let resolver = &self.inner.config.resolver;
        // Both places are waited for here (a check that gives up meanwhile starts nothing);
        // once held, the lookup runs in a task that keeps them until the resolver returns.
        let lookup = async {
            let closed = |_| std::io::Error::other("the lookup places are closed");
            let agent_place = agent_places.acquire_owned().await.map_err(closed)?;
            let pool_place = pool_places.acquire_owned().await.map_err(closed)?;
            let lookup = resolver.lookup(host, port);
            tokio::spawn(async move {
                let addresses = lookup.await;
                drop((agent_place, pool_place));
                addresses
            })
            .await
            .map_err(std::io::Error::other)?
        };
        match tokio::time::timeout(self.inner.config.connect_timeout, lookup).await {
            Ok(Ok(addresses)) if !addresses.is_empty() => Ok(addresses),
            Ok(Ok(_)) => Err(unresolved(host, "no address")),
            Ok(Err(error)) => Err(unresolved(host, &error.to_string())),
            Err(_) => Err(unresolved(host, "no answer in time")),
        }
    }

    /// `agent`'s lookup places; the places of agents with no lookup left are let go.
    fn agent_places(&self, agent: &str) -> Arc<tokio::sync::Semaphore> {
        let Ok(mut places) = self.inner.agent_lookups.lock() else {
            // A poisoned map: a place of its own (the pool's bound still holds).
            return Arc::new(tokio::sync::Semaphore::new(CLI_LOOKUPS_PER_AGENT));
        };
        places.retain(|_, held| Arc::strong_count(held) > 1);
        places
            .entry(agent.to_owned())
            .or_insert_with(|| Arc::new(tokio::sync::Semaphore::new(CLI_LOOKUPS_PER_AGENT)))
            .clone()
    }

    /// The tunnel for a worker serving `provider`, after [`ModelGuard::check_provider`].
    pub fn tunnel_for(
        &self,
        provider: &ProviderConfig,
    ) -> Result<Arc<dyn ModelTunnel>, GuardError> {
        self.check_provider(provider)?;
        let tunnel = forward::GuardedTunnel::new(self.clone(), provider.clone())?;
        Ok(Arc::new(tunnel))
    }

    /// What the child gets instead of `provider`: the placeholder base URL (same path, no
    /// query, host [`PLACEHOLDER_HOST`]), placeholder key and bearer token where the real
    /// ones are set, and no headers (the guard adds them and the base URL's query upstream).
    /// Every other field is kept.
    pub fn placeholder(provider: &ProviderConfig) -> ProviderConfig {
        let mut child = provider.clone();
        child.base_url = target::placeholder_base(&provider.base_url);
        child.api_key = provider
            .api_key
            .as_ref()
            .map(|_| Secret::new(PLACEHOLDER_API_KEY));
        child.bearer_token = provider
            .bearer_token
            .as_ref()
            .map(|_| Secret::new(PLACEHOLDER_BEARER_TOKEN));
        child.headers = None;
        child
    }

    fn tls(&self) -> &rustls::ClientConfig {
        &self.inner.tls
    }
}

fn refused((reason, message): (BlockReason, String)) -> GuardError {
    GuardError::Refused { reason, message }
}

/// The refusal of a CLI backend's provider whose host did not resolve.
fn unresolved(host: &str, why: &str) -> GuardError {
    GuardError::Unresolved {
        host: host.to_owned(),
        error: why.to_owned(),
    }
}

#[cfg(test)]
mod tests;
