//! `copilot-pool status`: asks a running daemon for its pool snapshot (`GET /v1/pool`,
//! through `reqwest` over plain HTTP) and prints it as a table.

use std::fmt::Write as _;
use std::time::Duration;

use anyhow::{Context, Result, anyhow, bail};
use clap::Args;
use reqwest::StatusCode;
use reqwest::header::{AUTHORIZATION, HeaderValue};

use copilot_pool::secret::Secret;

use crate::config::API_TOKEN_ENV;

/// The whole exchange (connect, send, read the body) must finish within this.
const TIMEOUT: Duration = Duration::from_secs(10);

/// Largest response body accepted.
const MAX_BODY_BYTES: usize = 16 << 20;

/// The daemon's address when `--url` is not given.
pub const DEFAULT_URL: &str = "http://127.0.0.1:7878";

#[derive(Args, Debug)]
pub struct StatusArgs {
    /// The daemon's base URL (plain http only).
    #[arg(long, default_value = DEFAULT_URL)]
    pub url: String,
    /// A file holding the bearer token for the daemon's API, readable by its owner only
    /// (default: the COPILOT_POOL_API_TOKEN environment variable).
    #[arg(long, value_name = "PATH")]
    pub api_token_file: Option<std::path::PathBuf>,
    /// Asks only `GET /healthz` (no token needed) and exits 0 when the daemon answers 200:
    /// a container's health check, whatever way the daemon was given its token.
    #[arg(long)]
    pub healthz: bool,
    /// Refused: a token on the command line is visible to every local user in `ps`.
    #[arg(long, hide = true, value_name = "TOKEN")]
    pub api_token: Option<String>,
}

/// What `GET /v1/pool` answers: the library's own status type, read back as it was sent.
/// Every field defaults, so a daemon that sends fewer or more fields still prints what both know.
pub type PoolSnapshot = copilot_pool::PoolStatus;

pub async fn status(args: StatusArgs) -> Result<()> {
    if args.api_token.is_some() {
        bail!("{}", crate::config::TOKEN_ON_ARGV);
    }
    if args.healthz {
        let (code, body) = get(&args.url, "/healthz", None).await?;
        if code != StatusCode::OK {
            bail!(
                "GET {}/healthz answered {}: {}",
                args.url.trim_end_matches('/'),
                code.as_u16(),
                body.trim()
            );
        }
        println!("ok");
        return Ok(());
    }
    let token = match &args.api_token_file {
        Some(path) => Some(crate::config::read_token_file(path)?),
        None => std::env::var(API_TOKEN_ENV)
            .ok()
            .filter(|t| !t.is_empty())
            .map(Secret::new),
    };
    let snapshot = fetch(&args.url, token.as_ref()).await?;
    print!("{}", render(&snapshot));
    Ok(())
}

/// `GET {base}/v1/pool`, with the bearer token when given, and the snapshot it answers.
/// Every failure says what to do: no daemon, a refused token, https, a non-2xx answer
/// (with its body), or a body that is not a snapshot.
pub async fn fetch(base: &str, token: Option<&Secret>) -> Result<PoolSnapshot> {
    let (code, body) = get(base, "/v1/pool", token).await?;
    match code {
        StatusCode::OK => {}
        StatusCode::UNAUTHORIZED => bail!(
            "the daemon needs an API token (--api-token-file PATH or {API_TOKEN_ENV}){}",
            if token.is_some() {
                "; the one given was refused"
            } else {
                ""
            }
        ),
        other => bail!(
            "GET {}/v1/pool answered {}: {}",
            base.trim_end_matches('/'),
            other.as_u16(),
            body.trim()
        ),
    }
    serde_json::from_str(&body).with_context(|| {
        format!(
            "GET {}/v1/pool answered 200 with an unexpected body: {body}",
            base.trim_end_matches('/')
        )
    })
}

/// `GET {base}{path}`, with the bearer token when given: the answer's status and body.
/// Every failure to get one says what to do: no daemon, https, a body too large.
async fn get(base: &str, path: &str, token: Option<&Secret>) -> Result<(StatusCode, String)> {
    let url = format!("{}{path}", base.trim_end_matches('/'));
    let parsed = reqwest::Url::parse(&url)
        .with_context(|| format!("{base}: not a URL; use http://host:port"))?;
    match parsed.scheme() {
        "http" => {}
        "https" => bail!(
            "{base}: https is not supported (`status` speaks plain HTTP only, without TLS, \
             like the daemon); use http:// to a local daemon"
        ),
        other => bail!("{base}: unsupported scheme {other:?}; use http://host:port"),
    }
    if !parsed.username().is_empty() || parsed.password().is_some() {
        bail!("{base}: credentials in the URL are not supported; use an API token");
    }
    let client = reqwest::Client::builder()
        .timeout(TIMEOUT)
        // The daemon is local: never through a proxy from the environment, never redirected.
        .no_proxy()
        .redirect(reqwest::redirect::Policy::none())
        .user_agent(concat!("copilot-pool/", env!("CARGO_PKG_VERSION")))
        .build()
        .context("building the HTTP client")?;
    let mut request = client
        .get(parsed)
        .header(reqwest::header::ACCEPT, "application/json");
    if let Some(token) = token {
        let mut value = HeaderValue::from_str(&format!("Bearer {}", token.expose())).map_err(|_| {
            anyhow!(
                "the API token holds a character not allowed in an HTTP header (a line break?); \
                 write the token alone on the first line of its file"
            )
        })?;
        value.set_sensitive(true);
        request = request.header(AUTHORIZATION, value);
    }
    let (code, body) = match exchange(request).await {
        Ok(answer) => answer,
        Err(err) if is_connection_refused(&err) => {
            bail!("no copilot-pool daemon at {base} (start one with `copilot-pool serve`)")
        }
        Err(err) if err.is_timeout() => bail!(
            "GET {url}: no complete answer within {TIMEOUT:?}; is the daemon at {base} stuck?"
        ),
        Err(err) => return Err(anyhow!(err).context(format!("GET {url}"))),
    };
    let Some(body) = body else {
        bail!(
            "GET {url} answered {} with more than {MAX_BODY_BYTES} bytes; is {base} a \
             copilot-pool daemon?",
            code.as_u16()
        );
    };
    Ok((code, String::from_utf8_lossy(&body).into_owned()))
}

/// Sends `request` and reads the answer's body; `None` for a body larger than
/// [`MAX_BODY_BYTES`] (no snapshot is that large).
async fn exchange(
    request: reqwest::RequestBuilder,
) -> reqwest::Result<(StatusCode, Option<Vec<u8>>)> {
    let mut response = request.send().await?;
    let code = response.status();
    let mut body = Vec::new();
    while let Some(chunk) = response.chunk().await? {
        if body.len() + chunk.len() > MAX_BODY_BYTES {
            return Ok((code, None));
        }
        body.extend_from_slice(&chunk);
    }
    Ok((code, Some(body)))
}

/// True when nothing listens at the address (the connection was refused).
fn is_connection_refused(err: &reqwest::Error) -> bool {
    let mut cause: Option<&(dyn std::error::Error + 'static)> = Some(err);
    while let Some(e) = cause {
        if e.downcast_ref::<std::io::Error>()
            .is_some_and(|io| io.kind() == std::io::ErrorKind::ConnectionRefused)
        {
            return true;
        }
        cause = e.source();
    }
    false
}

/// The snapshot as text: a summary line, a totals line, then one row per process.
pub fn render(s: &PoolSnapshot) -> String {
    let t = &s.totals;
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{} process{}, {} conversations ({} leased), {} waiting{}",
        s.workers.len(),
        if s.workers.len() == 1 { "" } else { "es" },
        s.conversations,
        s.leased,
        s.waiters,
        if s.closed { ", DRAINING" } else { "" }
    );
    let _ = writeln!(
        out,
        "totals: spawned {}, restarts {}, crashes {}, resumed {}, created {}, evicted {}, turns {}",
        t.processes_spawned, t.restarts, t.crashes, t.resumed, t.created, t.evicted, t.turns
    );
    // The process budget every backend shares (a daemon before it sent none).
    let b = &s.budget;
    if b.max_processes > 0 {
        let by: Vec<String> = b
            .by_backend
            .iter()
            .map(|(backend, n)| format!("{backend} {n}"))
            .collect();
        let _ = writeln!(
            out,
            "budget: {} of {} processes ({})",
            b.used,
            b.max_processes,
            by.join(", ")
        );
    }
    if s.workers.is_empty() {
        let _ = writeln!(out, "no runtime processes");
        return out;
    }
    let _ = writeln!(
        out,
        "{:>8}  {:<8}  {:>13}  {:>6}  {:>7}  {:>8}  {:>8}  KEY",
        "PID", "STATE", "CONVERSATIONS", "LEASES", "TURNS", "RESTARTS", "RSS MiB"
    );
    for p in &s.workers {
        let _ = writeln!(
            out,
            "{:>8}  {:<8}  {:>13}  {:>6}  {:>7}  {:>8}  {:>8.1}  {}",
            p.pid,
            p.state.as_str(),
            p.conversations,
            p.leases,
            p.turns,
            p.restarts,
            p.rss_bytes as f64 / f64::from(1u32 << 20),
            p.key_hash
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::Router;
    use axum::http::{HeaderMap, StatusCode as Code};
    use axum::routing::get;

    const SNAPSHOT: &str = r#"{"processes":[],"waiters":2,"conversations":3,"leased":1,"draining":true,"totals":{"turns":19}}"#;

    /// Serves `router` on a loopback port until the test ends; its base URL.
    async fn serve(router: Router) -> String {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr = listener.local_addr().expect("addr");
        tokio::spawn(async move { axum::serve(listener, router).await });
        format!("http://{addr}")
    }

    /// A daemon stand-in whose `/v1/pool` wants `Bearer s3cret`.
    async fn daemon_with_token() -> String {
        serve(Router::new().route(
            "/v1/pool",
            get(|headers: HeaderMap| async move {
                match headers.get("authorization").map(|v| v.as_bytes()) {
                    Some(b"Bearer s3cret") => (Code::OK, SNAPSHOT),
                    _ => (Code::UNAUTHORIZED, ""),
                }
            }),
        ))
        .await
    }

    /// A daemon stand-in whose `/v1/pool` answers `code` with `body`.
    async fn daemon_answering(code: Code, body: String) -> String {
        serve(Router::new().route("/v1/pool", get(move || async move { (code, body) }))).await
    }

    #[tokio::test]
    async fn fetches_the_snapshot_sending_the_bearer_token() {
        let base = daemon_with_token().await;
        // A trailing slash on the base URL is fine.
        let snapshot = fetch(&format!("{base}/"), Some(&Secret::new("s3cret".to_owned())))
            .await
            .expect("snapshot");
        assert_eq!(
            (snapshot.waiters, snapshot.conversations, snapshot.leased),
            (2, 3, 1)
        );
        assert!(snapshot.closed);
        assert_eq!(snapshot.totals.turns, 19);
    }

    #[tokio::test]
    async fn a_missing_or_refused_token_says_how_to_give_one() {
        let base = daemon_with_token().await;
        let missing = fetch(&base, None).await.unwrap_err().to_string();
        assert!(missing.contains("--api-token-file PATH"), "{missing}");
        assert!(missing.contains(API_TOKEN_ENV), "{missing}");
        assert!(!missing.contains("refused"), "{missing}");
        let wrong = fetch(&base, Some(&Secret::new("nope".to_owned())))
            .await
            .unwrap_err()
            .to_string();
        assert!(wrong.contains("the one given was refused"), "{wrong}");
        assert!(!wrong.contains("nope"), "{wrong}");
    }

    #[tokio::test]
    async fn a_token_that_is_no_header_value_is_refused_without_showing_it() {
        let base = daemon_with_token().await;
        let err = fetch(&base, Some(&Secret::new("s3cret\nX-Evil: 1".to_owned())))
            .await
            .unwrap_err()
            .to_string();
        assert!(err.contains("line break"), "{err}");
        assert!(!err.contains("s3cret"), "{err}");
    }

    #[tokio::test]
    async fn a_non_2xx_answer_is_an_error_with_its_status_and_body() {
        let base = daemon_answering(Code::SERVICE_UNAVAILABLE, "draining\n".to_owned()).await;
        let err = fetch(&base, None).await.unwrap_err().to_string();
        assert!(
            err.ends_with(&format!("GET {base}/v1/pool answered 503: draining")),
            "{err}"
        );
    }

    #[tokio::test]
    async fn a_body_that_is_no_snapshot_is_an_error_showing_it() {
        let base = daemon_answering(Code::OK, "<html>a proxy</html>".to_owned()).await;
        let err = format!("{:#}", fetch(&base, None).await.unwrap_err());
        assert!(
            err.contains("answered 200 with an unexpected body: <html>a proxy</html>"),
            "{err}"
        );
    }

    #[tokio::test]
    async fn an_oversized_body_is_refused_without_printing_it() {
        let base = daemon_answering(Code::OK, "x".repeat(MAX_BODY_BYTES + 1)).await;
        let err = format!("{:#}", fetch(&base, None).await.unwrap_err());
        assert!(err.contains("more than 16777216 bytes"), "{err}");
        assert!(err.len() < 500, "{} bytes of error", err.len());
    }

    #[tokio::test]
    async fn nothing_listening_says_how_to_start_a_daemon() {
        // Bind then drop, so the port is (very likely) closed.
        let port = {
            let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
            l.local_addr().expect("addr").port()
        };
        let base = format!("http://127.0.0.1:{port}");
        let err = fetch(&base, None).await.unwrap_err().to_string();
        assert_eq!(
            err,
            format!("no copilot-pool daemon at {base} (start one with `copilot-pool serve`)")
        );
    }

    #[tokio::test]
    async fn https_and_other_schemes_are_refused_with_a_reason() {
        let err = fetch("https://127.0.0.1:7878", None)
            .await
            .unwrap_err()
            .to_string();
        assert!(err.contains("without TLS"), "{err}");
        assert!(err.contains("http://"), "{err}");
        let err = fetch("ftp://127.0.0.1", None)
            .await
            .unwrap_err()
            .to_string();
        assert!(err.contains("unsupported scheme"), "{err}");
        let err = fetch("127.0.0.1:7878", None).await.unwrap_err().to_string();
        assert!(err.contains("use http://host:port"), "{err}");
        let err = fetch("http://user:pw@127.0.0.1:7878", None)
            .await
            .unwrap_err()
            .to_string();
        assert!(err.contains("credentials in the URL"), "{err}");
    }

    #[test]
    fn renders_the_daemon_snapshot() {
        let json = r#"{"processes":[{"key_hash":"ab12cd34","pid":4242,"state":"live","conversations":3,"leases":1,"turns":17,"restarts":0,"rss_bytes":157286400},{"key_hash":"ffee","pid":7,"state":"draining","conversations":0,"leases":0,"turns":2,"restarts":1,"rss_bytes":0}],"waiters":2,"conversations":3,"leased":1,"draining":false,"totals":{"processes_spawned":3,"restarts":1,"crashes":1,"resumed":4,"created":5,"evicted":0,"turns":19}}"#;
        let snapshot: PoolSnapshot = serde_json::from_str(json).unwrap();
        let text = render(&snapshot);
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(
            lines[0],
            "2 processes, 3 conversations (1 leased), 2 waiting"
        );
        assert_eq!(
            lines[1],
            "totals: spawned 3, restarts 1, crashes 1, resumed 4, created 5, evicted 0, turns 19"
        );
        assert!(lines[2].starts_with("     PID  STATE"), "{text}");
        let row: Vec<&str> = lines[3].split_whitespace().collect();
        assert_eq!(
            row,
            ["4242", "live", "3", "1", "17", "0", "150.0", "ab12cd34"]
        );
        let row: Vec<&str> = lines[4].split_whitespace().collect();
        assert_eq!(row, ["7", "draining", "0", "0", "2", "1", "0.0", "ffee"]);
        assert_eq!(lines.len(), 5);
    }

    #[test]
    fn renders_the_process_budget_every_backend_shares() {
        let json =
            r#"{"budget":{"max_processes":4,"used":3,"by_backend":{"claude-cli":1,"copilot":2}}}"#;
        let snapshot: PoolSnapshot = serde_json::from_str(json).unwrap();
        let text = render(&snapshot);
        assert_eq!(
            text.lines().nth(2),
            Some("budget: 3 of 4 processes (claude-cli 1, copilot 2)"),
            "{text}"
        );
    }

    #[test]
    fn empty_and_draining_pool() {
        let snapshot: PoolSnapshot = serde_json::from_str(r#"{"draining":true}"#).unwrap();
        let text = render(&snapshot);
        assert!(
            text.starts_with("0 processes, 0 conversations (0 leased), 0 waiting, DRAINING\n"),
            "{text}"
        );
        assert!(text.ends_with("no runtime processes\n"), "{text}");
    }
}
