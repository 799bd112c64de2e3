//! Who may call `/v1`: with a token, a request carrying it (compared in constant time, the
//! scheme in any case); without one, only this machine's own clients: the request names a
//! loopback host and comes from no web page of another origin, so a page the operator opens
//! cannot drive the API (a cross-site request, or DNS rebinding a name onto 127.0.0.1).

use std::net::IpAddr;
use std::sync::Arc;

use axum::extract::State;
use axum::http::{HeaderMap, StatusCode, header};
use axum::middleware::Next;
use axum::response::Response;
use sha2::{Digest, Sha256};

use super::AppState;
use super::error::error;

/// Lets a `/v1` request through when it carries the configured token, or, with none set,
/// when it comes from this machine ([`from_this_machine`]).
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
        None => {
            let host = headers
                .get(header::HOST)
                .and_then(|v| v.to_str().ok())
                .or_else(|| request.uri().authority().map(|a| a.as_str()));
            let origin = headers
                .get(header::ORIGIN)
                .map(|v| v.to_str().unwrap_or(""));
            if !from_this_machine(host, origin) {
                return error(
                    StatusCode::FORBIDDEN,
                    "forbidden",
                    "without an API token the API answers this machine's clients only: the \
                     request must name localhost, 127.0.0.1 or [::1] as its host and come from \
                     no web page of another origin; set an API token to call it otherwise",
                );
            }
        }
    }
    next.run(request).await
}

/// Whether a request without a token may pass: its host (`Host`, else the URI's authority)
/// is a loopback name or address, and its `Origin`, if any, is an `http` origin on one.
/// A browser sends `Origin` with a cross-site request and the page's own host as `Host`
/// after DNS rebinding, so neither reaches the API.
fn from_this_machine(host: Option<&str>, origin: Option<&str>) -> bool {
    let Some(host) = host else {
        return false;
    };
    let origin_ok = match origin {
        None => true,
        Some(origin) => origin
            .strip_prefix("http://")
            .is_some_and(|rest| !rest.contains('/') && is_loopback_authority(rest)),
    };
    is_loopback_authority(host) && origin_ok
}

/// `localhost`, `127.x.y.z` or `[::1]`, with or without a port.
fn is_loopback_authority(authority: &str) -> bool {
    let host = if let Some(rest) = authority.strip_prefix('[') {
        match rest.split_once(']') {
            Some((inside, after)) if after.is_empty() || is_port(after) => inside,
            _ => return false,
        }
    } else {
        match authority.rsplit_once(':') {
            Some((name, port)) if is_port(&format!(":{port}")) => name,
            Some(_) => return false,
            None => authority,
        }
    };
    host.eq_ignore_ascii_case("localhost")
        || host.parse::<IpAddr>().is_ok_and(|ip| ip.is_loopback())
}

/// `:<digits>`.
fn is_port(text: &str) -> bool {
    text.strip_prefix(':')
        .is_some_and(|p| !p.is_empty() && p.len() <= 5 && p.bytes().all(|b| b.is_ascii_digit()))
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
            assert!(from_this_machine(Some(host), None), "{host}");
            assert!(
                from_this_machine(Some(host), Some("http://127.0.0.1:7878")),
                "{host}"
            );
        }
        // DNS rebinding: the page's own name, resolved to 127.0.0.1.
        for host in [
            "evil.example:7878",
            "evil.example",
            "10.0.0.1:7878",
            "[::2]",
            "localhost.evil.example",
            "127.0.0.1:port",
            "[::1]x",
            "",
        ] {
            assert!(!from_this_machine(Some(host), None), "{host}");
        }
        assert!(!from_this_machine(None, None));
        // A web page of another origin (a cross-site request keeps the target's Host).
        for origin in [
            "https://evil.example",
            "http://evil.example:7878",
            "null",
            "",
            "http://127.0.0.1/x",
            "https://localhost",
        ] {
            assert!(
                !from_this_machine(Some("127.0.0.1:7878"), Some(origin)),
                "{origin}"
            );
        }
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
