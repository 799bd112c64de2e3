//! Which URLs a model request may go to, and the mapping of the child's placeholder URL onto
//! the provider's.
//!
//! URLs are parsed once with the WHATWG parser reqwest uses (`url`), so the host checked is
//! the host connected to: decimal (`2130706433`), octal (`0177.0.0.1`), hex (`0x7f.1`) and
//! short IPv4 spellings are normalised to the address they mean before any check.

use std::net::IpAddr;
use std::sync::Arc;

use reqwest::Url;
use url::Host;

use super::address;
use super::{GuardError, PLACEHOLDER_HOST};
use crate::kinds::BlockReason;

/// A refusal: its metric label and what to tell the caller.
pub(crate) type Refusal = (BlockReason, String);

/// Query parameter names that carry credentials (compared lowercased, `-` as `_`).
const CREDENTIAL_PARAMS: &[&str] = &[
    "key",
    "apikey",
    "api_key",
    "x_api_key",
    "token",
    "access_token",
    "id_token",
    "refresh_token",
    "session_token",
    "auth",
    "authorization",
    "bearer",
    "jwt",
    "password",
    "passwd",
    "pwd",
    "secret",
    "client_secret",
    "credential",
    "credentials",
    "sig",
    "signature",
    "x_amz_signature",
    "x_amz_security_token",
    "x_amz_credential",
    "x_goog_signature",
    "x_goog_credential",
];

/// Whether a query parameter name looks like a credential.
pub fn credential_query(name: &str) -> bool {
    let name = name.to_ascii_lowercase().replace('-', "_");
    CREDENTIAL_PARAMS.contains(&name.as_str())
        || ["_key", "_token", "_secret", "_password", "_signature"]
            .iter()
            .any(|suffix| name.ends_with(suffix))
}

/// Checks what can be checked of a URL without resolving it: `https` (or `http` with
/// `allow_private_endpoints`, whose addresses must then all be loopback), a host, no
/// userinfo, no credential-looking query parameter.
pub fn check_url(url: &Url, allow_private_endpoints: bool) -> Result<(), Refusal> {
    match url.scheme() {
        "https" => {}
        "http" if allow_private_endpoints => {}
        "http" => {
            return Err((
                BlockReason::Scheme,
                "plain http:// is refused; use an https:// endpoint (plain http is allowed \
                 only to loopback, with allow_private_endpoints: [model] in the daemon's \
                 config, PoolConfig::model_guard in the library)"
                    .to_owned(),
            ));
        }
        other => {
            return Err((
                BlockReason::Scheme,
                format!("the scheme {other:?} is refused; use an https:// endpoint"),
            ));
        }
    }
    if url.host().is_none() {
        return Err((BlockReason::Scheme, "the URL has no host".to_owned()));
    }
    if !url.username().is_empty() || url.password().is_some() {
        return Err((
            BlockReason::Userinfo,
            "a user name or password in the URL is refused; put the key in api_key or \
             bearer_token"
                .to_owned(),
        ));
    }
    if let Some((name, _)) = url.query_pairs().find(|(name, _)| credential_query(name)) {
        return Err((
            BlockReason::CredentialQuery,
            format!(
                "the query parameter {name:?} looks like a credential and is refused; put \
                 the key in api_key, bearer_token or headers"
            ),
        ));
    }
    Ok(())
}

/// Checks the addresses a request to `url` would connect to: every one must be allowed, and
/// with plain `http` every one must be loopback.
pub(crate) fn check_addresses(
    url: &Url,
    addresses: &[IpAddr],
    allow_private_endpoints: bool,
    host_addresses: &dyn Fn() -> Arc<Vec<IpAddr>>,
) -> Result<(), Refusal> {
    let host = url.host_str().unwrap_or_default();
    // This machine's own addresses, asked for once a global address needs them.
    let mut this_host: Option<Arc<Vec<IpAddr>>> = None;
    for ip in addresses {
        let allowed = address::allowed(*ip, allow_private_endpoints).and_then(|()| {
            if allow_private_endpoints || address::classify(*ip).is_some() {
                return Ok(());
            }
            let own = this_host.get_or_insert_with(host_addresses);
            match address::is_this_host(*ip, own) {
                true => Err(address::AddressClass::ThisHost),
                false => Ok(()),
            }
        });
        if let Err(class) = allowed {
            let fix = if class.private_endpoint() {
                " (for a local model, have the operator list its origin in [model] \
                 private_endpoints, or turn on allow_private_endpoints: [model] in the \
                 daemon's config, PoolConfig::model_guard in the library)"
            } else {
                ""
            };
            let what = match class {
                address::AddressClass::ThisHost => "an address of this machine".to_owned(),
                _ => format!("a {} address", class.reason().label().replace('_', " ")),
            };
            return Err((
                class.reason(),
                format!("{host} is {what}, which model requests may not reach{fix}"),
            ));
        }
        if url.scheme() == "http" && address::classify(*ip) != Some(address::AddressClass::Loopback)
        {
            return Err((
                BlockReason::Scheme,
                format!(
                    "plain http:// is allowed only to loopback and {host} is not; use https://"
                ),
            ));
        }
    }
    Ok(())
}

/// The host of `url` when it is an IP address.
pub(crate) fn ip_host(url: &Url) -> Option<IpAddr> {
    match url.host()? {
        Host::Ipv4(ip) => Some(IpAddr::V4(ip)),
        Host::Ipv6(ip) => Some(IpAddr::V6(ip)),
        Host::Domain(_) => None,
    }
}

/// Parses a provider's base URL.
pub(crate) fn parse_base(base_url: &str) -> Result<Url, GuardError> {
    Url::parse(base_url).map_err(|e| GuardError::Refused {
        reason: BlockReason::Scheme,
        // Not echoed: a URL that does not parse may still carry a key.
        message: format!("the provider's base URL is not a URL ({e}); give an https:// URL"),
    })
}

/// The child's base URL for a provider's: scheme `https`, host [`PLACEHOLDER_HOST`], no
/// port, userinfo or query, the same path. The query stays with the guard, which adds it to
/// each upstream request ([`upstream_url`]): a key in a parameter no name check knows
/// (Azure Functions' `code`, say) never reaches the child. An unparsable URL (refused before
/// this is used) maps to the bare placeholder.
pub(crate) fn placeholder_base(base_url: &str) -> String {
    let bare = format!("https://{PLACEHOLDER_HOST}");
    let Ok(url) = Url::parse(base_url) else {
        return bare;
    };
    let mut child = bare;
    let path = url.path();
    if path != "/" || base_url.trim_end().ends_with('/') {
        child.push_str(path);
    }
    child
}

/// Whether a request's path below the base path (lowercased) could climb out of it on a
/// server that decodes it otherwise than the URL parser does: a separator spelled encoded
/// (`%2f`, `%5c`), a segment that is `.` or `..` once decoded and cut at its first `;` (a
/// path parameter, which some Java servers drop: `..;`, `%2e%2e;x=1`), anything encoded
/// twice (`%25`), a `%` that is no escape (`%%32%66` and `%2%66` are `%2f` once decoded;
/// IIS's `%u002f`), or escapes that are not UTF-8 once decoded (an overlong `/`,
/// `%c0%af`). No model API's path holds any of them.
fn could_climb(below: &str) -> bool {
    if ["%2f", "%5c", "%25"]
        .iter()
        .any(|spelling| below.contains(spelling))
    {
        return true;
    }
    let dot_segment = below.split('/').any(|segment| {
        let decoded = percent_encoding::percent_decode_str(segment).decode_utf8_lossy();
        let name = decoded.split(';').next().unwrap_or_default();
        name == "." || name == ".."
    });
    if dot_segment {
        return true;
    }
    let bytes = below.as_bytes();
    let not_an_escape = bytes.iter().enumerate().any(|(at, byte)| {
        *byte == b'%'
            && !(bytes.get(at + 1).is_some_and(u8::is_ascii_hexdigit)
                && bytes.get(at + 2).is_some_and(u8::is_ascii_hexdigit))
    });
    not_an_escape
        || percent_encoding::percent_decode_str(below)
            .decode_utf8()
            .is_err()
}

/// The upstream URL of a request the child made to `requested`: the provider's scheme, host
/// and port with the request's path and query, and the base URL's query parameters the
/// request does not give itself. Refused unless the request is for the placeholder host and
/// under the base URL's path (no encoded separator, percent sign encoded again, or `..;` below
/// it).
pub(crate) fn upstream_url(requested: &str, base: &Url) -> Result<Url, Refusal> {
    let foreign = || {
        (
            BlockReason::ForeignUrl,
            "the runtime asked for a URL outside its provider's base URL".to_owned(),
        )
    };
    let mut url = Url::parse(requested).map_err(|_| foreign())?;
    if url.host_str() != Some(PLACEHOLDER_HOST) || url.port().is_some() || url.scheme() != "https" {
        return Err(foreign());
    }
    let prefix = base.path().trim_end_matches('/');
    let path = url.path();
    let under = path == prefix
        || (path.starts_with(prefix) && path[prefix.len()..].starts_with('/'))
        || prefix.is_empty();
    // `..` is applied by the parse, but not a separator spelled encoded (`..%2F`, `..%5C`),
    // a `..;` segment (`..` to some Java servers), or anything encoded twice (`%252F`,
    // `%252e%252e`: `/` and `..` to a server, or a proxy before it, that decodes twice): a
    // server that reads them so would climb out of the base path. Below the base path no
    // model API's path holds one (the base path itself is the operator's, and may).
    let below = path
        .get(prefix.len()..)
        .unwrap_or_default()
        .to_ascii_lowercase();
    let climbs = could_climb(&below);
    if !under && !climbs {
        // A path outside the base path: what an operator needs to correct a base URL whose
        // path is not the one the runtime calls under (the query left out: it may hold a key).
        return Err((
            BlockReason::ForeignUrl,
            format!(
                "the runtime asked for the path {path:?}, which is not under the provider's \
                 base path {:?}; if the provider serves that API there, correct the path in \
                 provider.base_url",
                base.path()
            ),
        ));
    }
    if !under || climbs || !url.username().is_empty() || url.password().is_some() {
        return Err(foreign());
    }
    url.set_scheme(base.scheme()).map_err(|_| foreign())?;
    url.set_host(base.host_str()).map_err(|_| foreign())?;
    url.set_port(base.port()).map_err(|_| foreign())?;
    // The base URL's parameters as they are written (no decoding and encoding again), after
    // the request's own; one the request gives itself is not given twice.
    let name = |segment: &str| segment.split('=').next().unwrap_or_default().to_owned();
    let given: Vec<String> = url
        .query()
        .unwrap_or_default()
        .split('&')
        .filter(|s| !s.is_empty())
        .map(name)
        .collect();
    let mut query = url.query().unwrap_or_default().to_owned();
    for segment in base.query().unwrap_or_default().split('&') {
        if segment.is_empty() || given.contains(&name(segment)) {
            continue;
        }
        if !query.is_empty() {
            query.push('&');
        }
        query.push_str(segment);
    }
    url.set_query((!query.is_empty()).then_some(query.as_str()));
    Ok(url)
}
