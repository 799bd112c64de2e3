//! Who may call `/v1`: with a token, a request carrying it (compared in constant time, the
//! scheme in any case); without one, by default only this machine's own clients: the request
//! names a loopback host and comes from no web page (no `Origin`: the API serves no page),
//! so a page the operator opens cannot drive the API (a cross-site request, a page another
//! local server serves, or DNS rebinding a name onto 127.0.0.1).

use std::net::IpAddr;
use std::sync::Arc;

use axum::extract::State;
use axum::http::{HeaderMap, StatusCode, header};
use axum::middleware::Next;
use axum::response::Response;
use sha2::{Digest, Sha256};

use super::AppState;
use super::error::error;

/// Who may call `/v1` when no API token is set ([`super::ApiConfig::tokenless_access`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum TokenlessAccess {
    /// This machine's clients only: a loopback `Host` and no `Origin` (the default).
    #[default]
    ThisMachine,
    /// Anyone: the embedding app authenticates every request before it reaches the router.
    Anyone,
}

/// Lets a `/v1` request through when it carries the configured token, or, with none set,
/// as [`TokenlessAccess`] says ([`from_this_machine`] by default).
pub(super) async fn require_token(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    request: axum::extract::Request,
    next: Next,
) -> Response {
    match &state.config.api_token {
        Some(token) if token.expose().is_empty() => {
            return error(
                StatusCode::INTERNAL_SERVER_ERROR,
                "misconfigured",
                "the API token is empty, which any request would match: set a token (or none, \
                 for this machine's clients only)",
            );
        }
        Some(token) => {
            let given = headers
                .get(header::AUTHORIZATION)
                .and_then(|v| v.to_str().ok())
                .and_then(bearer_token)
                .unwrap_or("");
            if !tokens_match(given, token.expose()) {
                return error(
                    StatusCode::UNAUTHORIZED,
                    "unauthorized",
                    "missing or wrong bearer token (Authorization: Bearer <api token>)",
                );
            }
        }
        None if state.config.tokenless_access == TokenlessAccess::Anyone => {}
        None => {
            // An absolute-form target's authority is the request's host (RFC 9112 §3.2.2).
            let host = request
                .uri()
                .authority()
                .map(|a| a.as_str())
                .or_else(|| headers.get(header::HOST).and_then(|v| v.to_str().ok()));
            let from_a_page = headers.contains_key(header::ORIGIN);
            if !from_this_machine(host, from_a_page) {
                return error(
                    StatusCode::FORBIDDEN,
                    "forbidden",
                    "without an API token the API answers this machine's clients only: the \
                     request must name localhost, 127.0.0.1 or [::1] as its host and come from \
                     no web page (no Origin header); set an API token to call it otherwise",
                );
            }
        }
    }
    next.run(request).await
}

/// Whether a request without a token may pass: its host is a loopback name or address and
/// it comes from no web page (`from_a_page`: it has an `Origin`). A browser sends `Origin`
/// with a cross-site request (also from a page another local server serves, on another
/// port), and the page's own name as `Host` after DNS rebinding: neither reaches the API,
/// which serves no page of its own.
fn from_this_machine(host: Option<&str>, from_a_page: bool) -> bool {
    host.is_some_and(is_loopback_authority) && !from_a_page
}

/// `localhost`, `127.x.y.z` or `[::1]`, with or without a port (parsed as an HTTP
/// authority: no user, nothing after the port).
fn is_loopback_authority(authority: &str) -> bool {
    let Ok(parsed) = authority.parse::<axum::http::uri::Authority>() else {
        return false;
    };
    let host = parsed.host();
    // No user before the host; a port, if any, a number.
    if authority.len() != host.len() && parsed.port_u16().is_none() || authority.contains('@') {
        return false;
    }
    let host = host
        .strip_prefix('[')
        .and_then(|h| h.strip_suffix(']'))
        .unwrap_or(host);
    host.eq_ignore_ascii_case("localhost")
        || host.parse::<IpAddr>().is_ok_and(|ip| ip.is_loopback())
}

/// The token of an `Authorization: Bearer <token>` value; the scheme is case-insensitive
/// (RFC 9110 §11.1).
fn bearer_token(value: &str) -> Option<&str> {
    let (scheme, token) = value.trim_start().split_once(' ')?;
    scheme
        .eq_ignore_ascii_case("bearer")
        .then(|| token.trim_matches(' '))
}

/// Whether the presented token is the configured one: their SHA-256 digests compared in
/// constant time, so the time taken tells nothing of the token, its length included.
fn tokens_match(given: &str, token: &str) -> bool {
    constant_time_eq(&Sha256::digest(given), &Sha256::digest(token))
}

fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_bearer_scheme_is_case_insensitive() {
        assert_eq!(bearer_token("Bearer abc"), Some("abc"));
        assert_eq!(bearer_token("bearer abc"), Some("abc"));
        assert_eq!(bearer_token("BEARER  abc "), Some("abc"));
        assert_eq!(bearer_token("Basic abc"), None);
        assert_eq!(bearer_token("Bearerabc"), None);
    }

    #[test]
    fn without_a_token_only_this_machines_clients_pass() {
        for host in [
            "127.0.0.1:7878",
            "localhost",
            "LOCALHOST:80",
            "[::1]:7878",
            "127.1.2.3",
        ] {
            assert!(from_this_machine(Some(host), false), "{host}");
            // Any web page, a local one on another port included.
            assert!(!from_this_machine(Some(host), true), "{host}");
        }
        // DNS rebinding: the page's own name, resolved to 127.0.0.1.
        for host in [
            "evil.example:7878",
            "evil.example",
            "10.0.0.1:7878",
            "[::2]",
            "[::ffff:127.0.0.1]",
            "0.0.0.0",
            "localhost.evil.example",
            "127.0.0.1:port",
            "[::1]x",
            "",
        ] {
            assert!(!from_this_machine(Some(host), false), "{host}");
        }
        assert!(!from_this_machine(None, false));
    }

    #[test]
    fn tokens_compare_equal_only_when_every_byte_matches() {
        assert!(tokens_match("s3cret", "s3cret"));
        assert!(!tokens_match("s3cret", "s3creT"));
        assert!(!tokens_match("s3cret", "s3cret-longer"));
        assert!(!tokens_match("", "x"));
        assert!(constant_time_eq(b"s3cret", b"s3cret"));
        assert!(!constant_time_eq(b"s3cret", b"s3creT"));
        assert!(!constant_time_eq(b"s3cret", b"s3cret-longer"));
        assert!(!constant_time_eq(b"", b"x"));
    }
}
