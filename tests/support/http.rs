//! A small HTTP/1.1 client for the daemon tests (raw bytes over TCP: the test talks to the
//! daemon the way any gateway would, with no client library in between), and a handle on a
//! running `copilot-pool serve`.

#![allow(dead_code)]

use std::net::SocketAddr;
use std::path::Path;
use std::process::Stdio;
use std::time::Duration;

use serde_json::Value;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpStream;

/// A response read to its end.
#[derive(Debug)]
pub struct Response {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: String,
}

impl Response {
    pub fn json(&self) -> Value {
        serde_json::from_str(&self.body).unwrap_or(Value::Null)
    }
}

fn request_bytes(method: &str, path: &str, token: Option<&str>, body: Option<&[u8]>) -> Vec<u8> {
    let mut head = format!("{method} {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n");
    if let Some(t) = token {
        head.push_str(&format!("Authorization: Bearer {t}\r\n"));
    }
    if let Some(b) = body {
        head.push_str(&format!(
            "Content-Type: application/json\r\nContent-Length: {}\r\n",
            b.len()
        ));
    }
    head.push_str("\r\n");
    let mut bytes = head.into_bytes();
    if let Some(b) = body {
        bytes.extend_from_slice(b);
    }
    bytes
}

/// Sends raw bytes and reads the whole response.
pub async fn raw(addr: SocketAddr, bytes: &[u8]) -> Response {
    let mut stream = TcpStream::connect(addr).await.expect("connect");
    stream.write_all(bytes).await.expect("write");
    let mut reader = BufReader::new(stream);
    let (status, headers) = read_head(&mut reader).await;
    let chunked = headers
        .iter()
        .any(|(k, v)| k == "transfer-encoding" && v.contains("chunked"));
    let mut body = Vec::new();
    if chunked {
        while let Some(chunk) = read_chunk(&mut reader).await {
            body.extend_from_slice(&chunk);
        }
    } else {
        let _ = tokio::time::timeout(Duration::from_secs(60), reader.read_to_end(&mut body)).await;
    }
    Response {
        status,
        headers,
        body: String::from_utf8_lossy(&body).into_owned(),
    }
}

/// Sends raw bytes, closes the write side (the peer sees the end of the body), and reads
/// whatever comes back (status 0 when the server just closes).
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

pub async fn call(
    addr: SocketAddr,
    method: &str,
    path: &str,
    token: Option<&str>,
    body: Option<&Value>,
) -> Response {
    let body = body.map(|b| serde_json::to_vec(b).expect("json"));
    raw(addr, &request_bytes(method, path, token, body.as_deref())).await
}

async fn read_head(reader: &mut BufReader<TcpStream>) -> (u16, Vec<(String, String)>) {
    let mut line = String::new();
    reader.read_line(&mut line).await.expect("status line");
    let status = line
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    let mut headers = Vec::new();
    loop {
        line.clear();
        reader.read_line(&mut line).await.expect("header");
        let l = line.trim_end();
        if l.is_empty() {
            break;
        }
        if let Some((k, v)) = l.split_once(':') {
            headers.push((k.trim().to_ascii_lowercase(), v.trim().to_owned()));
        }
    }
    (status, headers)
}

async fn read_chunk(reader: &mut BufReader<TcpStream>) -> Option<Vec<u8>> {
    let mut line = String::new();
    if reader.read_line(&mut line).await.ok()? == 0 {
        return None;
    }
    let size = usize::from_str_radix(line.trim(), 16).ok()?;
    if size == 0 {
        return None;
    }
    let mut chunk = vec![0; size + 2];
    reader.read_exact(&mut chunk).await.ok()?;
    chunk.truncate(size);
    Some(chunk)
}

/// One server-sent event.
#[derive(Debug, Clone)]
pub struct Sse {
    pub event: String,
    pub data: Value,
}

/// A streaming response read event by event.
pub struct SseStream {
    pub status: u16,
    reader: BufReader<TcpStream>,
    buffer: String,
    chunked: bool,
}

impl SseStream {
    pub async fn open(
        addr: SocketAddr,
        path: &str,
        token: Option<&str>,
        body: &Value,
    ) -> SseStream {
        let body = serde_json::to_vec(body).expect("json");
        let mut stream = TcpStream::connect(addr).await.expect("connect");
        stream
            .write_all(&request_bytes("POST", path, token, Some(&body)))
            .await
            .expect("write");
        let mut reader = BufReader::new(stream);
        let (status, headers) = read_head(&mut reader).await;
        let chunked = headers
            .iter()
            .any(|(k, v)| k == "transfer-encoding" && v.contains("chunked"));
        SseStream {
            status,
            reader,
            buffer: String::new(),
            chunked,
        }
    }

    /// The next event, or `None` at the end of the stream.
    pub async fn next(&mut self) -> Option<Sse> {
        loop {
            if let Some(end) = self.buffer.find("\n\n") {
                let frame: String = self.buffer.drain(..end + 2).collect();
                let mut event = String::new();
                let mut data = String::new();
                for line in frame.lines() {
                    if let Some(v) = line.strip_prefix("event: ") {
                        event = v.to_owned();
                    } else if let Some(v) = line.strip_prefix("data: ") {
                        data.push_str(v);
                    }
                }
                return Some(Sse {
                    event,
                    data: serde_json::from_str(&data).unwrap_or(Value::Null),
                });
            }
            let more = if self.chunked {
                read_chunk(&mut self.reader).await?
            } else {
                let mut buf = vec![0; 4096];
                let n = self.reader.read(&mut buf).await.ok()?;
                if n == 0 {
                    return None;
                }
                buf.truncate(n);
                buf
            };
            self.buffer.push_str(&String::from_utf8_lossy(&more));
        }
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
        let runtime = super::runtime::runtime_path().await;
        let config_path = dir.join("serve.toml");
        std::fs::write(&config_path, config).expect("config");
        // It may hold the API token: private, as serve requires.
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&config_path, std::fs::Permissions::from_mode(0o600))
            .expect("chmod the config");
        let bin = env!("CARGO_BIN_EXE_copilot-pool");
        let mut cmd = match soft_nofile {
            Some(n) => {
                let mut cmd = tokio::process::Command::new("sh");
                cmd.arg("-c")
                    .arg(format!("ulimit -S -n {n} && exec \"$0\" \"$@\""))
                    .arg(bin);
                cmd
            }
            None => tokio::process::Command::new(bin),
        };
        cmd.arg("serve")
            .arg("--config")
            .arg(&config_path)
            .args(["--listen", "127.0.0.1:0"])
            .args(extra)
            .env("COPILOT_CLI_PATH", runtime)
            .env("COPILOT_POOL_HOME", dir.join("pool-home"))
            .env_remove("COPILOT_POOL_API_TOKEN")
            .envs(env.iter().copied())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        let mut child = cmd.spawn().expect("spawn serve");
        let stdout = child.stdout.take().expect("stdout");
        let mut lines = BufReader::new(stdout).lines();
        let mut addr = None;
        let mut metrics_addr = None;
        let read = async {
            while let Ok(Some(line)) = lines.next_line().await {
                if let Some(a) = line.strip_prefix("metrics on http://") {
                    metrics_addr = a.parse().ok();
                }
                if let Some(a) = line.strip_prefix("listening on http://") {
                    addr = a.parse().ok();
                    break;
                }
            }
        };
        tokio::time::timeout(Duration::from_secs(60), read)
            .await
            .expect("daemon started");
        // Keep draining stdout so the daemon never blocks on it.
        tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
        Daemon {
            child,
            addr: addr.expect("listen address"),
            metrics_addr,
        }
    }

    pub fn pid(&self) -> u32 {
        self.child.id().unwrap_or(0)
    }

    /// SIGTERM and wait for the exit status.
    pub async fn terminate(mut self) -> std::process::ExitStatus {
        let pid = nix::unistd::Pid::from_raw(self.pid() as i32);
        let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM);
        tokio::time::timeout(Duration::from_secs(60), self.child.wait())
            .await
            .expect("daemon exits after SIGTERM")
            .expect("wait")
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        if let Some(pid) = self.child.id() {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(pid as i32),
                nix::sys::signal::Signal::SIGTERM,
            );
        }
    }
}
