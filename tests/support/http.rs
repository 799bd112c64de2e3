//! The daemon tests' HTTP client: requests and SSE streams through `reqwest` (the test talks
//! to the daemon the way a gateway's HTTP client would), raw bytes over TCP only for the
//! hostile-client tests that a client library cannot send, and a handle on a running
//! `copilot-pool serve`.

#![allow(dead_code)]

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::process::Stdio;
use std::time::Duration;

use eventsource_stream::{Event, EventStreamError, Eventsource};
use futures_util::{Stream, StreamExt};
use serde_json::Value;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpStream;

/// A response read to its end.
#[derive(Debug)]
pub struct Response {
    pub status: u16,
    /// Names in lower case.
    pub headers: Vec<(String, String)>,
    pub body: String,
}

impl Response {
    pub fn json(&self) -> Value {
        serde_json::from_str(&self.body).unwrap_or(Value::Null)
    }
}

/// A client for one request: no pooled connection outlives it (each request has its own
/// connection, closed after it), no proxy from the environment, and a failure guard on every
/// read (a whole non-streamed turn answers after at most `TURN_LIMIT`).
fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .no_proxy()
        .pool_max_idle_per_host(0)
        .connect_timeout(Duration::from_secs(10))
        .read_timeout(2 * super::TURN_LIMIT)
        .build()
        .expect("an HTTP client")
}

/// Asserts that the Prometheus text `metrics` has `series` (name, labels and value) as one
/// whole line, and prints the text when it has not.
pub fn assert_has_series(metrics: &str, series: &str) {
    assert!(
        metrics.lines().any(|l| l == series),
        "{series} missing from:\n{metrics}"
    );
}

/// A request to the daemon at `addr`, to send with [`send`] (for headers or bodies that
/// [`call`] does not write).
pub fn request(addr: SocketAddr, method: &str, path: &str) -> reqwest::RequestBuilder {
    let method = reqwest::Method::from_bytes(method.as_bytes()).expect("an HTTP method");
    client().request(method, format!("http://{addr}{path}"))
}

/// Sends `request` and reads the whole response.
pub async fn send(request: reqwest::RequestBuilder) -> Response {
    let response = request.send().await.expect("the daemon answers");
    let status = response.status().as_u16();
    let headers = response
        .headers()
        .iter()
        .map(|(k, v)| {
            (
                k.as_str().to_owned(),
                String::from_utf8_lossy(v.as_bytes()).into_owned(),
            )
        })
        .collect();
    let body = response.bytes().await.expect("the whole body");
    Response {
        status,
        headers,
        body: String::from_utf8_lossy(&body).into_owned(),
    }
}

/// `method path` with an optional bearer token and JSON body, read to its end.
pub async fn call(
    addr: SocketAddr,
    method: &str,
    path: &str,
    token: Option<&str>,
    body: Option<&Value>,
) -> Response {
    send(with_token_and_body(
        request(addr, method, path),
        token,
        body,
    ))
    .await
}

fn with_token_and_body(
    mut request: reqwest::RequestBuilder,
    token: Option<&str>,
    body: Option<&Value>,
) -> reqwest::RequestBuilder {
    if let Some(token) = token {
        request = request.bearer_auth(token);
    }
    if let Some(body) = body {
        // As reqwest's `json` would (its `json` feature is left off: the tests' build then
        // shares every crate with the binary's).
        request = request
            .header(reqwest::header::CONTENT_TYPE, "application/json")
            .body(body.to_string());
    }
    request
}

/// Sends raw bytes (a request no client library would send: a truncated body), closes the
/// write side (the peer sees the end of the body), and reads whatever comes back (status 0
/// when the server just closes).
pub async fn raw_then_close(addr: SocketAddr, bytes: &[u8]) -> Response {
    let mut stream = TcpStream::connect(addr).await.expect("connect");
    stream.write_all(bytes).await.expect("write");
    let _ = stream.shutdown().await;
    let mut all = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(30), stream.read_to_end(&mut all)).await;
    let text = String::from_utf8_lossy(&all).into_owned();
    let status = text
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    Response {
        status,
        headers: Vec::new(),
        body: text,
    }
}

/// One server-sent event.
#[derive(Debug, Clone)]
pub struct Sse {
    pub event: String,
    pub data: Value,
}

type Events = Pin<Box<dyn Stream<Item = Result<Event, EventStreamError<reqwest::Error>>> + Send>>;

/// A streaming response read event by event.
pub struct SseStream {
    pub status: u16,
    events: Events,
}

impl SseStream {
    /// `POST path` with `body` (and the bearer token when given); the events follow.
    pub async fn open(
        addr: SocketAddr,
        path: &str,
        token: Option<&str>,
        body: &Value,
    ) -> SseStream {
        let response = with_token_and_body(request(addr, "POST", path), token, Some(body))
            .send()
            .await
            .expect("the daemon answers");
        SseStream {
            status: response.status().as_u16(),
            events: Box::pin(response.bytes_stream().eventsource()),
        }
    }

    /// Sends `request` (a `POST /v1/turns` with whatever headers the test adds); the events
    /// follow.
    pub async fn from_request(request: reqwest::RequestBuilder) -> SseStream {
        let response = request.send().await.expect("the daemon answers");
        SseStream {
            status: response.status().as_u16(),
            events: Box::pin(response.bytes_stream().eventsource()),
        }
    }

    /// The next event, or `None` at the end of the stream (or when the connection breaks).
    pub async fn next(&mut self) -> Option<Sse> {
        let event = self.events.next().await?.ok()?;
        Some(Sse {
            event: event.event,
            data: serde_json::from_str(&event.data).unwrap_or(Value::Null),
        })
    }

    /// The first event named `name`, skipping those before it.
    pub async fn until_event(&mut self, name: &str) -> Sse {
        while let Some(e) = self.next().await {
            if e.event == name {
                return e;
            }
        }
        panic!("stream ended before a {name} event");
    }

    /// Events up to and including `turn.end` (its data is the summary).
    pub async fn until_end(&mut self) -> (Vec<Sse>, Value) {
        let mut events = Vec::new();
        while let Some(e) = self.next().await {
            if e.event == "turn.end" {
                let data = e.data.clone();
                events.push(e);
                return (events, data);
            }
            events.push(e);
        }
        panic!("stream ended without turn.end: {events:?}");
    }
}

/// A running `copilot-pool serve`; sent SIGTERM on drop (it then drains and stops its
/// children itself; SIGKILL would orphan them).
pub struct Daemon {
    pub child: tokio::process::Child,
    pub addr: SocketAddr,
    pub metrics_addr: Option<SocketAddr>,
    /// The SDK endpoint's address, when the config asked for one (`sdk on …`).
    pub sdk_addr: Option<String>,
}

impl Daemon {
    /// Starts the daemon with `config` (TOML text) in `dir`; `extra` are more flags.
    pub async fn start(dir: &Path, config: &str, extra: &[&str]) -> Daemon {
        Self::start_with(dir, config, extra, &[], None).await
    }

    /// Like `start`, with more environment variables, and with the daemon's soft
    /// `RLIMIT_NOFILE` lowered to `soft_nofile` (through `sh -c 'ulimit -S -n N; exec ...'`,
    /// so no `pre_exec` is needed) when given.
    pub async fn start_with(
        dir: &Path,
        config: &str,
        extra: &[&str],
        env: &[(&str, &str)],
        soft_nofile: Option<u64>,
    ) -> Daemon {
        let prefix: Vec<String> = match soft_nofile {
            Some(n) => vec![
                "sh".into(),
                "-c".into(),
                format!("ulimit -S -n {n} && exec \"$0\" \"$@\""),
            ],
            None => Vec::new(),
        };
        Self::launch(dir, config, extra, env, &prefix, Stdio::inherit()).await
    }

    /// Like `start_with`, with the daemon's stderr (its log) written to `log` instead of
    /// the test's own stderr.
    pub async fn start_logged(
        dir: &Path,
        config: &str,
        env: &[(&str, &str)],
        log: std::fs::File,
    ) -> Daemon {
        Self::launch(dir, config, &[], env, &[], Stdio::from(log)).await
    }

    /// Like `start`, with the daemon's stderr going to `stderr` (a pipe closed at once, say).
    pub async fn start_with_stderr(dir: &Path, config: &str, stderr: Stdio) -> Daemon {
        Self::launch(dir, config, &[], &[], &[], stderr).await
    }

    /// Like `start`, with the daemon started through `prefix` (a program and its
    /// arguments that exec the rest of the command line, such as `setpriv …`).
    pub async fn start_through(dir: &Path, config: &str, prefix: &[String]) -> Daemon {
        Self::launch(dir, config, &[], &[], prefix, Stdio::inherit()).await
    }

    async fn launch(
        dir: &Path,
        config: &str,
        extra: &[&str],
        env: &[(&str, &str)],
        prefix: &[String],
        stderr: Stdio,
    ) -> Daemon {
        let (child, announced) =
            spawn_serve(dir, config, "127.0.0.1:0", extra, env, prefix, stderr).await;
        Daemon {
            child,
            addr: announced.addr.expect("listen address"),
            metrics_addr: announced.metrics_addr,
            sdk_addr: announced.sdk_addr,
        }
    }

    pub fn pid(&self) -> u32 {
        self.child.id().unwrap_or(0)
    }

    /// SIGTERM and wait for the exit status.
    pub async fn terminate(mut self) -> std::process::ExitStatus {
        terminate(&mut self.child).await
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        sigterm(&self.child);
    }
}

/// A running `copilot-pool serve` whose API listens on a Unix socket; sent SIGTERM on drop.
pub struct SocketDaemon {
    pub child: tokio::process::Child,
    /// The API's socket, as the daemon announced it.
    pub socket: PathBuf,
}

impl SocketDaemon {
    /// Starts the daemon with `config` (TOML text, which must set the API token) in `dir`,
    /// its API on the Unix socket `socket`.
    pub async fn start(dir: &Path, config: &str, socket: &Path) -> SocketDaemon {
        let listen = format!("unix:{}", socket.display());
        let (child, announced) =
            spawn_serve(dir, config, &listen, &[], &[], &[], Stdio::inherit()).await;
        SocketDaemon {
            child,
            socket: announced.socket.expect("the API's socket"),
        }
    }

    /// SIGTERM and wait for the exit status.
    pub async fn terminate(mut self) -> std::process::ExitStatus {
        terminate(&mut self.child).await
    }

    /// A client whose every connection goes to the API's socket (any `http://` URL).
    pub fn client(&self) -> reqwest::Client {
        reqwest::Client::builder()
            .unix_socket(self.socket.clone())
            .build()
            .expect("reqwest client")
    }
}

impl Drop for SocketDaemon {
    fn drop(&mut self) {
        sigterm(&self.child);
    }
}

/// SIGTERM to a daemon still running (it then drains and stops its children itself).
fn sigterm(child: &tokio::process::Child) {
    if let Some(pid) = child.id() {
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(pid as i32),
            nix::sys::signal::Signal::SIGTERM,
        );
    }
}

/// SIGTERM to a daemon, and its exit status.
async fn terminate(child: &mut tokio::process::Child) -> std::process::ExitStatus {
    sigterm(child);
    tokio::time::timeout(Duration::from_secs(60), child.wait())
        .await
        .expect("daemon exits after SIGTERM")
        .expect("wait")
}

/// What a starting `serve` printed on its stdout: where it listens.
#[derive(Default)]
struct Announced {
    addr: Option<SocketAddr>,
    socket: Option<PathBuf>,
    metrics_addr: Option<SocketAddr>,
    sdk_addr: Option<String>,
}

/// Starts `copilot-pool serve` with `config` (TOML text) in `dir`, its API on `listen`, and
/// reads what it announces up to where its API listens.
async fn spawn_serve(
    dir: &Path,
    config: &str,
    listen: &str,
    extra: &[&str],
    env: &[(&str, &str)],
    prefix: &[String],
    stderr: Stdio,
) -> (tokio::process::Child, Announced) {
    let runtime = super::runtime::runtime_path().await;
    let config_path = dir.join("serve.toml");
    // The scripted model listens on loopback: the daemon's BYOK turns go through the
    // guarded model path with private endpoints allowed (unless the test says otherwise).
    let config = if config.contains("[model]") {
        config.to_owned()
    } else {
        format!("{config}\n[model]\nallow_private_endpoints = true\n")
    };
    std::fs::write(&config_path, config).expect("config");
    // It may hold the API token: private, as serve requires.
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&config_path, std::fs::Permissions::from_mode(0o600))
        .expect("chmod the config");
    let bin = env!("CARGO_BIN_EXE_copilot-pool");
    let mut cmd = match prefix.split_first() {
        Some((program, args)) => {
            let mut cmd = tokio::process::Command::new(program);
            cmd.args(args).arg(bin);
            cmd
        }
        None => tokio::process::Command::new(bin),
    };
    cmd.arg("serve")
        .arg("--config")
        .arg(&config_path)
        .args(["--listen", listen])
        .args(extra)
        .env("COPILOT_CLI_PATH", runtime)
        .env("COPILOT_POOL_HOME", dir.join("pool-home"))
        .env_remove("COPILOT_POOL_API_TOKEN")
        .envs(env.iter().copied())
        .stdout(Stdio::piped())
        .stderr(stderr);
    let mut child = cmd.spawn().expect("spawn serve");
    let stdout = child.stdout.take().expect("stdout");
    let mut lines = BufReader::new(stdout).lines();
    let mut announced = Announced::default();
    let read = async {
        while let Ok(Some(line)) = lines.next_line().await {
            if let Some(a) = line.strip_prefix("sdk on ") {
                announced.sdk_addr = Some(a.to_owned());
            }
            if let Some(a) = line.strip_prefix("metrics on http://") {
                announced.metrics_addr = a.parse().ok();
            }
            if let Some(a) = line.strip_prefix("listening on http://") {
                announced.addr = a.parse().ok();
                break;
            }
            if let Some(path) = line.strip_prefix("listening on unix:") {
                announced.socket = Some(PathBuf::from(path));
                break;
            }
        }
    };
    tokio::time::timeout(Duration::from_secs(60), read)
        .await
        .expect("daemon started");
    // Keep draining stdout so the daemon never blocks on it.
    tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
    (child, announced)
}
