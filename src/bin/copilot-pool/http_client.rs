//! A minimal HTTP/1.1 client for talking to a local `copilot-pool serve`: plain `http://`
//! only (no TLS), one `GET` per connection (`Connection: close`), the whole response read
//! into memory (`Content-Length`, chunked, or until the peer closes), all within 10 s.

use std::time::Duration;

use anyhow::{Context, Result, anyhow, bail};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// The whole exchange (connect, send, read) must finish within this.
pub const TIMEOUT: Duration = Duration::from_secs(10);

/// Largest response accepted (headers and body).
const MAX_RESPONSE_BYTES: usize = 16 << 20;

/// `http://host[:port][/path]`, split.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Target {
    /// As given, for the `Host` header and messages (`[::1]` keeps its brackets).
    host: String,
    /// What to connect to (`::1` without brackets).
    connect_host: String,
    port: u16,
    /// Path and query, starting with `/`.
    path: String,
}

fn parse_url(url: &str) -> Result<Target> {
    let rest = match url.split_once("://") {
        Some((scheme, rest)) if scheme.eq_ignore_ascii_case("http") => rest,
        Some((scheme, _)) if scheme.eq_ignore_ascii_case("https") => bail!(
            "{url}: https is not supported (this client speaks plain HTTP only, without TLS); \
             use http:// to a local daemon, or put a TLS-terminating proxy in front"
        ),
        Some((scheme, _)) => bail!("{url}: unsupported scheme {scheme:?}; use http://host:port"),
        None => bail!("{url}: not a URL; use http://host:port"),
    };
    let (authority, path) = match rest.find(['/', '?']) {
        Some(i) if rest.as_bytes()[i] == b'/' => (&rest[..i], rest[i..].to_owned()),
        Some(i) => (&rest[..i], format!("/{}", &rest[i..])),
        None => (rest, "/".to_owned()),
    };
    let path = match path.split_once('#') {
        Some((p, _)) => p.to_owned(),
        None => path,
    };
    if authority.contains('@') {
        bail!("{url}: credentials in the URL are not supported; use an API token");
    }
    let (host, port) = if let Some(after) = authority.strip_prefix('[') {
        let (inner, tail) = after
            .split_once(']')
            .ok_or_else(|| anyhow!("{url}: unterminated IPv6 address"))?;
        let port = match tail {
            "" => None,
            t => Some(
                t.strip_prefix(':')
                    .ok_or_else(|| anyhow!("{url}: bad host:port"))?,
            ),
        };
        (format!("[{inner}]"), port)
    } else {
        match authority.rsplit_once(':') {
            Some((h, p)) => (h.to_owned(), Some(p)),
            None => (authority.to_owned(), None),
        }
    };
    if host.is_empty() || host == "[]" {
        bail!("{url}: missing host");
    }
    let port = match port {
        Some(p) => p
            .parse::<u16>()
            .map_err(|_| anyhow!("{url}: bad port {p:?}"))?,
        None => 80,
    };
    let connect_host = host
        .strip_prefix('[')
        .and_then(|h| h.strip_suffix(']'))
        .unwrap_or(&host)
        .to_owned();
    Ok(Target {
        host,
        connect_host,
        port,
        path,
    })
}

/// `GET url` with an optional bearer token. Returns the status code and the body (decoded
/// lossily as UTF-8). Fails on connection errors, timeouts and malformed responses; a non-2xx
/// status is not an error.
pub async fn get(url: &str, token: Option<&str>) -> Result<(u16, String)> {
    let target = parse_url(url)?;
    match tokio::time::timeout(TIMEOUT, exchange(&target, token)).await {
        Ok(result) => result.with_context(|| format!("GET {url}")),
        Err(_) => Err(anyhow!(
            "GET {url}: no complete response within {TIMEOUT:?}"
        )),
    }
}

/// True when `err` was caused by the peer refusing the connection (nothing listening).
pub fn is_connection_refused(err: &anyhow::Error) -> bool {
    err.chain().any(|cause| {
        cause
            .downcast_ref::<std::io::Error>()
            .is_some_and(|io| io.kind() == std::io::ErrorKind::ConnectionRefused)
    })
}

async fn exchange(target: &Target, token: Option<&str>) -> Result<(u16, String)> {
    let mut stream = TcpStream::connect((target.connect_host.as_str(), target.port))
        .await
        .with_context(|| format!("connecting to {}:{}", target.host, target.port))?;
    let host_header = if target.port == 80 {
        target.host.clone()
    } else {
        format!("{}:{}", target.host, target.port)
    };
    let mut request = format!(
        "GET {} HTTP/1.1\r\nHost: {host_header}\r\nUser-Agent: copilot-pool/{}\r\n\
         Accept: application/json\r\nConnection: close\r\n",
        target.path,
        env!("CARGO_PKG_VERSION"),
    );
    if let Some(token) = token {
        if token.contains(['\r', '\n']) {
            bail!("the API token contains a line break");
        }
        request.push_str("Authorization: Bearer ");
        request.push_str(token);
        request.push_str("\r\n");
    }
    request.push_str("\r\n");
    stream
        .write_all(request.as_bytes())
        .await
        .context("sending the request")?;

    let mut raw = Vec::new();
    let mut buf = [0u8; 16 * 1024];
    loop {
        let n = match stream.read(&mut buf).await {
            Ok(n) => n,
            // Some servers reset after sending everything; parse what we have.
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset && !raw.is_empty() => 0,
            Err(e) => return Err(e).context("reading the response"),
        };
        if n == 0 {
            break;
        }
        raw.extend_from_slice(&buf[..n]);
        if raw.len() > MAX_RESPONSE_BYTES {
            bail!("response larger than {MAX_RESPONSE_BYTES} bytes");
        }
    }
    let (status, body) = parse_response(&raw)?;
    Ok((status, String::from_utf8_lossy(&body).into_owned()))
}

/// Parses a complete HTTP/1.x response (the connection was closed after it).
fn parse_response(raw: &[u8]) -> Result<(u16, Vec<u8>)> {
    let head_end = find(raw, b"\r\n\r\n").ok_or_else(|| {
        anyhow!(
            "malformed response: no end of headers ({} bytes)",
            raw.len()
        )
    })?;
    let head = std::str::from_utf8(&raw[..head_end])
        .map_err(|_| anyhow!("malformed response: headers are not UTF-8"))?;
    let body = &raw[head_end + 4..];
    let mut lines = head.split("\r\n");
    let status_line = lines.next().unwrap_or_default();
    let mut parts = status_line.splitn(3, ' ');
    let version = parts.next().unwrap_or_default();
    if !version.starts_with("HTTP/1.") {
        bail!("malformed response: status line {status_line:?}");
    }
    let status: u16 = parts
        .next()
        .and_then(|s| s.parse().ok())
        .filter(|s| (100..1000).contains(s))
        .ok_or_else(|| anyhow!("malformed response: status line {status_line:?}"))?;

    let mut content_length: Option<usize> = None;
    let mut chunked = false;
    for line in lines {
        let Some((name, value)) = line.split_once(':') else {
            bail!("malformed response: header line {line:?}");
        };
        let value = value.trim();
        if name.eq_ignore_ascii_case("content-length") {
            content_length = Some(
                value
                    .parse()
                    .map_err(|_| anyhow!("malformed response: Content-Length {value:?}"))?,
            );
        } else if name.eq_ignore_ascii_case("transfer-encoding") {
            chunked = value
                .rsplit(',')
                .next()
                .is_some_and(|last| last.trim().eq_ignore_ascii_case("chunked"));
        }
    }
    // 1xx, 204 and 304 have no body.
    if status < 200 || status == 204 || status == 304 {
        return Ok((status, Vec::new()));
    }
    let body = if chunked {
        decode_chunked(body)?
    } else if let Some(len) = content_length {
        if body.len() < len {
            bail!(
                "truncated response: Content-Length {len} but only {} bytes arrived",
                body.len()
            );
        }
        body[..len].to_vec()
    } else {
        body.to_vec()
    };
    Ok((status, body))
}

fn decode_chunked(mut data: &[u8]) -> Result<Vec<u8>> {
    let mut out = Vec::new();
    loop {
        let line_end =
            find(data, b"\r\n").ok_or_else(|| anyhow!("truncated chunked body: no chunk size"))?;
        let line = std::str::from_utf8(&data[..line_end])
            .map_err(|_| anyhow!("malformed chunk size line"))?;
        let size_text = line.split(';').next().unwrap_or_default().trim();
        let size = usize::from_str_radix(size_text, 16)
            .map_err(|_| anyhow!("malformed chunk size {size_text:?}"))?;
        data = &data[line_end + 2..];
        if size == 0 {
            // Trailers (ignored) up to the final empty line; tolerate a peer that stops early.
            return Ok(out);
        }
        // A hostile size must not overflow: anything beyond the data is just incomplete.
        if size.checked_add(2).is_none_or(|needed| data.len() < needed) {
            bail!("truncated chunked body: chunk of {size} bytes is incomplete");
        }
        out.extend_from_slice(&data[..size]);
        if &data[size..size + 2] != b"\r\n" {
            bail!("malformed chunked body: chunk not followed by CRLF");
        }
        data = &data[size + 2..];
    }
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack.windows(needle.len()).position(|w| w == needle)
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::net::TcpListener;

    /// Serves `response` to one connection and returns the request it read.
    async fn serve_once(response: &'static [u8]) -> (String, tokio::task::JoinHandle<String>) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let task = tokio::spawn(async move {
            let (mut sock, _) = listener.accept().await.unwrap();
            let mut request = Vec::new();
            let mut buf = [0u8; 1024];
            while find(&request, b"\r\n\r\n").is_none() {
                let n = sock.read(&mut buf).await.unwrap();
                assert!(n > 0, "client closed before the end of its request");
                request.extend_from_slice(&buf[..n]);
            }
            // Write in pieces, to exercise reassembly.
            for piece in response.chunks(7) {
                sock.write_all(piece).await.unwrap();
                sock.flush().await.unwrap();
            }
            sock.shutdown().await.unwrap();
            String::from_utf8(request).unwrap()
        });
        (url, task)
    }

    #[tokio::test]
    async fn content_length_response_and_request_headers() {
        let (url, server) = serve_once(
            b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 11\r\n\r\n{\"a\":[1,2]}",
        )
        .await;
        let (status, body) = get(&format!("{url}/v1/pool"), Some("s3cret"))
            .await
            .unwrap();
        assert_eq!(status, 200);
        assert_eq!(body, "{\"a\":[1,2]}");
        let request = server.await.unwrap();
        assert!(
            request.starts_with("GET /v1/pool HTTP/1.1\r\n"),
            "{request}"
        );
        assert!(request.contains("\r\nConnection: close\r\n"), "{request}");
        assert!(
            request.contains("\r\nAuthorization: Bearer s3cret\r\n"),
            "{request}"
        );
        let host = url.trim_start_matches("http://");
        assert!(
            request.contains(&format!("\r\nHost: {host}\r\n")),
            "{request}"
        );
    }

    #[tokio::test]
    async fn chunked_response() {
        let (url, server) = serve_once(
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n\
              5\r\nhello\r\n7;ext=1\r\n, world\r\n0\r\nX-Trailer: y\r\n\r\n",
        )
        .await;
        let (status, body) = get(&url, None).await.unwrap();
        assert_eq!((status, body.as_str()), (200, "hello, world"));
        let request = server.await.unwrap();
        assert!(request.starts_with("GET / HTTP/1.1\r\n"), "{request}");
        assert!(!request.contains("Authorization"), "{request}");
    }

    #[tokio::test]
    async fn error_status_and_body_until_close() {
        let (url, _server) =
            serve_once(b"HTTP/1.1 401 Unauthorized\r\nContent-Type: text/plain\r\n\r\nno token")
                .await;
        let (status, body) = get(&url, None).await.unwrap();
        assert_eq!((status, body.as_str()), (401, "no token"));
    }

    #[tokio::test]
    async fn truncated_body_is_an_error() {
        let (url, _server) =
            serve_once(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nshort").await;
        let err = get(&url, None).await.unwrap_err();
        assert!(format!("{err:#}").contains("truncated"), "{err:#}");
    }

    #[tokio::test]
    async fn refused_connection_is_recognised() {
        // Bind then drop, so the port is (very likely) closed.
        let port = {
            let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            l.local_addr().unwrap().port()
        };
        let err = get(&format!("http://127.0.0.1:{port}/v1/pool"), None)
            .await
            .unwrap_err();
        assert!(is_connection_refused(&err), "{err:#}");
    }

    #[tokio::test]
    async fn https_is_refused_with_a_reason() {
        let err = get("https://example.com/v1/pool", None).await.unwrap_err();
        assert!(err.to_string().contains("without TLS"), "{err}");
    }

    #[test]
    fn url_parsing() {
        let t = parse_url("http://127.0.0.1:7878/v1/pool").unwrap();
        assert_eq!(
            (t.host.as_str(), t.port, t.path.as_str()),
            ("127.0.0.1", 7878, "/v1/pool")
        );
        let t = parse_url("http://localhost").unwrap();
        assert_eq!(
            (t.host.as_str(), t.port, t.path.as_str()),
            ("localhost", 80, "/")
        );
        let t = parse_url("http://[::1]:9/x?y=1#frag").unwrap();
        assert_eq!(
            (
                t.host.as_str(),
                t.connect_host.as_str(),
                t.port,
                t.path.as_str()
            ),
            ("[::1]", "::1", 9, "/x?y=1")
        );
        let t = parse_url("HTTP://h:1?q").unwrap();
        assert_eq!(t.path, "/?q");
        assert!(parse_url("h:1").is_err());
        assert!(parse_url("ftp://h").is_err());
        assert!(parse_url("http://h:99999").is_err());
        assert!(parse_url("http://:80").is_err());
    }
}
