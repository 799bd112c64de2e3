//! The guard against loopback upstreams it is allowed (or refused) to reach, and a test
//! resolver. No test here reaches anything but loopback: every other address is in a table
//! of refusals, checked before any connection.

use std::collections::VecDeque;
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures_util::future::BoxFuture;
use metrics_util::debugging::{DebugValue, DebuggingRecorder};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Notify;

use super::forward::{GuardedTunnel, LOOKUPS_PER_WORKER, Utf8Decoder};
use super::*;
use crate::tunnel::{ModelRequest, ModelResponse};

/// A resolver that answers from a script, one answer per query (the last one repeats),
/// and counts the queries.
struct ScriptedResolver {
    answers: Mutex<VecDeque<Vec<IpAddr>>>,
    queries: AtomicUsize,
    /// This machine's addresses, as the test has them, and how often they were read.
    host: Vec<IpAddr>,
    host_reads: AtomicUsize,
}

impl ScriptedResolver {
    fn new(answers: &[&[&str]]) -> Arc<Self> {
        Self::on_host(answers, &[])
    }

    fn on_host(answers: &[&[&str]], host: &[&str]) -> Arc<Self> {
        let ips = |a: &[&str]| a.iter().map(|ip| ip.parse().expect("ip")).collect();
        Arc::new(Self {
            answers: Mutex::new(answers.iter().map(|a| ips(a)).collect()),
            queries: AtomicUsize::new(0),
            host: ips(host),
            host_reads: AtomicUsize::new(0),
        })
    }
}

impl Resolve for ScriptedResolver {
    fn lookup(&self, host: &str, _port: u16) -> ResolveFuture {
        assert_eq!(host, "model.test", "only the test host is resolved");
        self.queries.fetch_add(1, Ordering::SeqCst);
        let mut answers = self.answers.lock().expect("answers");
        let answer = if answers.len() > 1 {
            answers.pop_front().unwrap_or_default()
        } else {
            answers.front().cloned().unwrap_or_default()
        };
        Box::pin(async move { Ok(answer) })
    }

    fn host_addresses(&self) -> std::io::Result<Vec<IpAddr>> {
        self.host_reads.fetch_add(1, Ordering::SeqCst);
        Ok(self.host.clone())
    }
}

type Handler = Arc<dyn Fn(TcpStream) -> BoxFuture<'static, ()> + Send + Sync>;

/// A loopback HTTP/1.1 server: counts connections, records each request (head and body),
/// and answers with `handler`.
struct Upstream {
    addr: SocketAddr,
    accepted: Arc<AtomicUsize>,
    requests: Arc<Mutex<Vec<String>>>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Upstream {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Upstream {
    async fn start(ip: &str, port: u16, handler: Handler) -> Upstream {
        let listener = TcpListener::bind((ip, port)).await.expect("bind loopback");
        let addr = listener.local_addr().expect("addr");
        let accepted = Arc::new(AtomicUsize::new(0));
        let requests = Arc::new(Mutex::new(Vec::new()));
        let (count, log) = (accepted.clone(), requests.clone());
        let task = tokio::spawn(async move {
            while let Ok((mut stream, _)) = listener.accept().await {
                count.fetch_add(1, Ordering::SeqCst);
                let (log, handler) = (log.clone(), handler.clone());
                tokio::spawn(async move {
                    let Some(request) = read_request(&mut stream).await else {
                        return;
                    };
                    log.lock().expect("log").push(request);
                    handler(stream).await;
                });
            }
        });
        Upstream {
            addr,
            accepted,
            requests,
            task,
        }
    }

    /// A server that answers every request with `raw` (a whole HTTP response).
    async fn answering(ip: &str, port: u16, raw: &'static str) -> Upstream {
        Upstream::start(
            ip,
            port,
            Arc::new(move |mut stream: TcpStream| {
                Box::pin(async move {
                    let _ = stream.write_all(raw.as_bytes()).await;
                    let _ = stream.shutdown().await;
                })
            }),
        )
        .await
    }

    fn accepted(&self) -> usize {
        self.accepted.load(Ordering::SeqCst)
    }

    fn requests(&self) -> Vec<String> {
        self.requests.lock().expect("log").clone()
    }
}

/// Reads one request: the head, then `content-length` bytes of body (bounded in size and
/// time).
async fn read_request(stream: &mut TcpStream) -> Option<String> {
    let read = async {
        let mut buf = Vec::new();
        let mut chunk = [0u8; 4096];
        loop {
            if let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                let head = String::from_utf8_lossy(&buf[..end]).to_ascii_lowercase();
                let length: usize = head
                    .lines()
                    .find_map(|l| l.strip_prefix("content-length:"))
                    .and_then(|v| v.trim().parse().ok())
                    .unwrap_or(0);
                if buf.len() >= end + 4 + length {
                    return Some(String::from_utf8_lossy(&buf).into_owned());
                }
            }
            if buf.len() > 1 << 20 {
                return None;
            }
            let n = stream.read(&mut chunk).await.ok()?;
            if n == 0 {
                return None;
            }
            buf.extend_from_slice(&chunk[..n]);
        }
    };
    tokio::time::timeout(Duration::from_secs(10), read)
        .await
        .ok()
        .flatten()
}

fn config(allow_private_endpoints: bool, resolver: Arc<dyn Resolve>) -> ModelGuardConfig {
    ModelGuardConfig {
        allow_private_endpoints,
        resolver,
        connect_timeout: Duration::from_secs(5),
        first_byte_timeout: Duration::from_secs(10),
        idle_timeout: Duration::from_secs(10),
        ..Default::default()
    }
}

fn provider(base_url: &str) -> ProviderConfig {
    ProviderConfig::openai(base_url, Some(Secret::new("sk-real-key-4711")))
}

/// The tunnel of a worker for `base_url`, built without the lease-time check (so the
/// per-request checks can be seen on their own).
fn tunnel(guard: &ModelGuard, base_url: &str) -> GuardedTunnel {
    GuardedTunnel::new(guard.clone(), provider(base_url)).expect("tunnel")
}

/// A model request the child would send for `path` under its placeholder base URL.
fn request(base_url: &str, path: &str) -> ModelRequest {
    ModelRequest {
        request_id: "r1".into(),
        session_id: Some("s1".into()),
        method: "POST".into(),
        url: format!("{}{path}", target::placeholder_base(base_url)),
        headers: vec![
            (
                "Authorization".into(),
                format!("Bearer {PLACEHOLDER_API_KEY}"),
            ),
            ("Content-Type".into(), "application/json".into()),
        ],
        body: br#"{"model":"m","messages":[]}"#.to_vec(),
    }
}

/// The whole body of a response (bounded in time), or the error it broke off with.
async fn body(response: &mut ModelResponse) -> Result<String, String> {
    let mut text = String::new();
    loop {
        match tokio::time::timeout(Duration::from_secs(20), response.body.recv()).await {
            Ok(Some(Ok(piece))) => text.push_str(&piece),
            Ok(Some(Err(e))) => return Err(e),
            Ok(None) => return Ok(text),
            Err(_) => panic!("the body did not end; so far: {text}"),
        }
    }
}

/// The error code of a guard's refusal.
async fn refusal_code(response: &mut ModelResponse) -> String {
    let text = body(response).await.expect("refusal body");
    let json: serde_json::Value = serde_json::from_str(&text).expect("json");
    json["error"]["code"]
        .as_str()
        .unwrap_or_default()
        .to_owned()
}

/// The counters recorded so far, as (name, label value, count); taking them resets them.
fn counters(recorder: &DebuggingRecorder) -> Vec<(String, String, u64)> {
    recorder
        .snapshotter()
        .snapshot()
        .into_vec()
        .into_iter()
        .filter_map(|(k, _, _, v)| match v {
            DebugValue::Counter(n) => {
                let label = k.key().labels().next().map(|l| l.value().to_owned());
                Some((k.key().name().to_owned(), label.unwrap_or_default(), n))
            }
            _ => None,
        })
        .collect()
}

/// The count of `name{label}` in `counters`.
fn count(counters: &[(String, String, u64)], name: &str, label: &str) -> u64 {
    counters
        .iter()
        .filter(|(n, l, _)| n == name && l == label)
        .map(|(.., c)| c)
        .sum()
}

#[tokio::test]
async fn every_ssrf_target_is_refused_before_a_connection_is_made() {
    let recorder = DebuggingRecorder::new();
    let _local = ::metrics::set_default_local_recorder(&recorder);
    // A listener on loopback that every loopback spelling below would reach.
    let upstream = Upstream::answering(
        "127.0.0.1",
        0,
        "HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n",
    )
    .await;
    let p = upstream.addr.port();
    let url = |s: &str| s.replace("{P}", &p.to_string());
    // IP address hosts, in every spelling the URL parser normalises, v4 and v6.
    let literal: &[(&str, &str)] = &[
        ("https://127.0.0.1:{P}/v1", "loopback"),
        ("https://127.1:{P}/v1", "loopback"),
        ("https://2130706433:{P}/v1", "loopback"),
        ("https://0x7f000001:{P}/v1", "loopback"),
        ("https://0x7f.0.0.1:{P}/v1", "loopback"),
        ("https://0177.0.0.1:{P}/v1", "loopback"),
        ("https://017700000001:{P}/v1", "loopback"),
        ("https://[::1]:{P}/v1", "loopback"),
        ("https://[::ffff:127.0.0.1]:{P}/v1", "loopback"),
        ("https://[::ffff:7f00:1]:{P}/v1", "loopback"),
        ("https://[::127.0.0.1]:{P}/v1", "loopback"),
        ("https://[2002:7f00:1::]:{P}/v1", "loopback"),
        ("https://[64:ff9b::7f00:1]:{P}/v1", "loopback"),
        ("https://0.0.0.0:{P}/v1", "unspecified"),
        ("https://0:{P}/v1", "unspecified"),
        ("https://[::]:{P}/v1", "unspecified"),
        ("https://169.254.169.254/latest", "metadata"),
        ("https://2852039166/latest", "metadata"),
        ("https://0xa9.0xfe.0xa9.0xfe/latest", "metadata"),
        ("https://[::ffff:169.254.169.254]/latest", "metadata"),
        ("https://[fd00:ec2::254]/latest", "metadata"),
        ("https://100.100.100.200/latest", "metadata"),
        ("https://10.0.0.1/v1", "private"),
        ("https://012.0.0.1/v1", "private"),
        ("https://172.16.0.1/v1", "private"),
        ("https://192.168.1.1/v1", "private"),
        ("https://[64:ff9b::a00:1]/v1", "private"),
        ("https://[2002:c0a8:101::]/v1", "private"),
        ("https://100.64.0.1/v1", "shared"),
        ("https://169.254.1.1/v1", "link_local"),
        ("https://[fe80::1]/v1", "link_local"),
        ("https://[fd12:3456::1]/v1", "unique_local"),
        ("https://224.0.0.1/v1", "multicast"),
        ("https://255.255.255.255/v1", "multicast"),
        ("https://[ff02::1]/v1", "multicast"),
        ("https://192.0.2.1/v1", "documentation"),
        ("https://[2001:db8::1]/v1", "documentation"),
        ("https://240.0.0.1/v1", "reserved"),
        ("https://198.18.0.1/v1", "reserved"),
    ];
    let guard = ModelGuard::new(config(false, ScriptedResolver::new(&[&[]]))).expect("guard");
    for (base, reason) in literal {
        let base = url(base);
        let lease_time = guard.check_provider(&provider(&base)).unwrap_err();
        assert!(
            matches!(&lease_time, GuardError::Refused { reason: r, .. } if r.label() == *reason),
            "{base}: {lease_time:?}"
        );
        let mut response = tunnel(&guard, &base)
            .serve(request(&base, "/chat/completions"))
            .await;
        assert_eq!(response.status, 403, "{base}");
        assert_eq!(refusal_code(&mut response).await, *reason, "{base}");
    }
    // URLs refused for what they are, whatever they resolve to.
    let shaped: &[(&str, &str)] = &[
        ("http://model.test:{P}/v1", "scheme"),
        ("ftp://model.test/v1", "scheme"),
        ("file:///etc/passwd", "scheme"),
        ("https://user:pw@model.test/v1", "userinfo"),
        ("https://user@model.test/v1", "userinfo"),
        ("https://model.test/v1?api_key=sk-1", "credential_query"),
        (
            "https://model.test/v1?api-version=1&Key=sk-1",
            "credential_query",
        ),
        ("https://model.test/v1?access_token=t", "credential_query"),
        ("https://model.test/v1?sig=abc", "credential_query"),
        (
            "https://model.test/v1?X-Amz-Signature=abc",
            "credential_query",
        ),
        ("https://model.test/v1?github_token=abc", "credential_query"),
    ];
    for (base, reason) in shaped {
        let base = url(base);
        let lease_time = guard.check_provider(&provider(&base)).unwrap_err();
        assert!(
            matches!(&lease_time, GuardError::Refused { reason: r, .. } if r.label() == *reason),
            "{base}: {lease_time:?}"
        );
    }
    // Host names: every address of the answer is checked, once per request.
    let answers: &[(&[&str], &str)] = &[
        (&["127.0.0.1"], "loopback"),
        (&["::1"], "loopback"),
        (&["::ffff:127.0.0.1"], "loopback"),
        (&["10.1.2.3"], "private"),
        (&["169.254.169.254"], "metadata"),
        (&["::ffff:169.254.169.254"], "metadata"),
        (&["64:ff9b::169.254.169.254"], "metadata"),
        (&["192.0.2.7", "127.0.0.1"], "documentation"),
        (&["0.0.0.0"], "unspecified"),
    ];
    let base = url("https://model.test:{P}/v1");
    for (answer, reason) in answers {
        let resolver = ScriptedResolver::new(&[answer]);
        let guard = ModelGuard::new(config(false, resolver.clone())).expect("guard");
        let tunnel = guard
            .tunnel_for(&provider(&base))
            .expect("a host name passes at lease time");
        let mut response = tunnel.serve(request(&base, "/chat/completions")).await;
        assert_eq!(response.status, 403, "{answer:?}");
        assert_eq!(refusal_code(&mut response).await, *reason, "{answer:?}");
        assert_eq!(resolver.queries.load(Ordering::SeqCst), 1, "{answer:?}");
    }
    // With allow_private_endpoints, metadata, unspecified and documentation stay refused.
    for (answer, reason) in [
        (["169.254.169.254"], "metadata"),
        (["0.0.0.0"], "unspecified"),
        (["192.0.2.1"], "documentation"),
    ] {
        let guard =
            ModelGuard::new(config(true, ScriptedResolver::new(&[&answer]))).expect("guard");
        let tunnel = guard.tunnel_for(&provider(&base)).expect("tunnel");
        let mut response = tunnel.serve(request(&base, "/chat/completions")).await;
        assert_eq!(response.status, 403);
        assert_eq!(refusal_code(&mut response).await, reason);
    }
    assert_eq!(
        upstream.accepted(),
        0,
        "a refused request reached the listener"
    );
    let refused = literal.len() + answers.len() + 3;
    let recorded = counters(&recorder);
    let blocked: u64 = BlockReason::ALL
        .iter()
        .map(|r| count(&recorded, crate::metrics::MODEL_BLOCKED_TOTAL, r.label()))
        .sum();
    assert_eq!(blocked, refused as u64);
    let requests = crate::metrics::MODEL_REQUESTS_TOTAL;
    assert_eq!(count(&recorded, requests, "blocked"), refused as u64);
    assert_eq!(
        count(&recorded, crate::metrics::MODEL_BLOCKED_TOTAL, "metadata"),
        10
    );
    assert_eq!(
        count(&recorded, crate::metrics::MODEL_BLOCKED_TOTAL, "loopback"),
        16
    );
}

#[tokio::test]
async fn a_dns_answer_that_changes_after_the_check_cannot_redirect_the_request() {
    // Two loopback servers on one port: the checked address and the one a second query
    // would give. Each request is resolved once and connected to what was checked.
    let a = Upstream::answering(
        "127.0.0.1",
        0,
        "HTTP/1.1 200 OK\r\ncontent-length: 1\r\n\r\nA",
    )
    .await;
    let port = a.addr.port();
    let Ok(b_listener) = TcpListener::bind(("127.0.0.2", port)).await else {
        panic!("127.0.0.2:{port} is taken; rerun");
    };
    drop(b_listener);
    let b = Upstream::answering(
        "127.0.0.2",
        port,
        "HTTP/1.1 200 OK\r\ncontent-length: 1\r\n\r\nB",
    )
    .await;
    let resolver = ScriptedResolver::new(&[&["127.0.0.1"], &["127.0.0.2"]]);
    let guard = ModelGuard::new(config(true, resolver.clone())).expect("guard");
    let base = format!("http://model.test:{port}/v1");
    let tunnel = guard.tunnel_for(&provider(&base)).expect("tunnel");

    let mut first = tunnel.serve(request(&base, "/chat/completions")).await;
    assert_eq!(first.status, 200);
    assert_eq!(body(&mut first).await.as_deref(), Ok("A"));
    assert_eq!(
        resolver.queries.load(Ordering::SeqCst),
        1,
        "resolved more than once"
    );
    assert_eq!((a.accepted(), b.accepted()), (1, 0));

    // The next request gets the next answer, checks it, and goes there: one query each.
    let mut second = tunnel.serve(request(&base, "/chat/completions")).await;
    assert_eq!(body(&mut second).await.as_deref(), Ok("B"));
    assert_eq!(resolver.queries.load(Ordering::SeqCst), 2);
    assert_eq!((a.accepted(), b.accepted()), (1, 1));
    // The upstream saw the name it was asked for, not the address.
    assert!(
        b.requests()[0]
            .to_ascii_lowercase()
            .contains(&format!("host: model.test:{port}"))
    );
}

#[tokio::test]
async fn the_real_key_replaces_the_placeholder_and_only_allowlisted_headers_pass() {
    let upstream = Upstream::answering(
        "127.0.0.1",
        0,
        "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\nset-cookie: s=1\r\n\
         x-ratelimit-remaining-requests: 9\r\nretry-after: 3\r\nserver: internal-proxy\r\n\
         openai-organization: org-acme\r\nopenai-project: proj_1\r\nopenai-processing-ms: 42\r\n\
         connection: close\r\ncontent-length: 2\r\n\r\n{}",
    )
    .await;
    let base = format!("http://127.0.0.1:{}/v1", upstream.addr.port());
    let guard = ModelGuard::new(config(true, ScriptedResolver::new(&[&[]]))).expect("guard");
    let mut with_headers = provider(&base);
    with_headers.headers = Some([("X-Tenant".to_owned(), "t-9".to_owned())].into());
    let tunnel = guard.tunnel_for(&with_headers).expect("tunnel");
    let mut req = request(&base, "/chat/completions?api-version=2024-10-21");
    req.headers.extend([
        ("Connection".to_owned(), "x-internal".to_owned()),
        (
            "Proxy-Authorization".to_owned(),
            "Basic c2VjcmV0".to_owned(),
        ),
        ("X-Api-Key".to_owned(), "someone-elses-key".to_owned()),
        ("Cookie".to_owned(), "c=1".to_owned()),
        ("X-Forwarded-For".to_owned(), "10.0.0.1".to_owned()),
        ("Accept".to_owned(), "text/event-stream".to_owned()),
        ("X-Stainless-Lang".to_owned(), "js".to_owned()),
    ]);
    let mut response = tunnel.serve(req).await;
    assert_eq!(response.status, 200);
    let mut names: Vec<&str> = response.headers.iter().map(|(n, _)| n.as_str()).collect();
    names.sort();
    assert_eq!(
        names,
        [
            "content-type",
            "openai-processing-ms",
            "retry-after",
            "x-ratelimit-remaining-requests"
        ]
    );
    assert_eq!(body(&mut response).await.as_deref(), Ok("{}"));
    let sent = upstream.requests().remove(0);
    let head = sent.to_ascii_lowercase();
    assert!(
        sent.starts_with("POST /v1/chat/completions?api-version=2024-10-21 HTTP/1.1\r\n"),
        "{sent}"
    );
    assert!(sent.contains("Bearer sk-real-key-4711"), "{sent}");
    assert!(!sent.contains(PLACEHOLDER_API_KEY), "{sent}");
    assert!(head.contains("x-tenant: t-9"), "{sent}");
    assert!(head.contains("accept: text/event-stream"), "{sent}");
    assert!(head.contains("x-stainless-lang: js"), "{sent}");
    for dropped in [
        "x-internal",
        "proxy-authorization",
        "someone-elses-key",
        "cookie",
        "x-forwarded-for",
    ] {
        assert!(!head.contains(dropped), "{dropped} was forwarded: {sent}");
    }
    assert!(sent.ends_with(r#"{"model":"m","messages":[]}"#), "{sent}");
}

#[tokio::test]
async fn a_response_streams_through_chunk_by_chunk_without_waiting_for_its_end() {
    let go_on = Arc::new(Notify::new());
    let release = go_on.clone();
    let upstream = Upstream::start(
        "127.0.0.1",
        0,
        Arc::new(move |mut stream: TcpStream| {
            let release = release.clone();
            Box::pin(async move {
                let head = "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n";
                let first = "data: {\"n\":1}\n\n";
                let second = "data: [DONE]\n\n";
                let _ = stream.write_all(head.as_bytes()).await;
                let _ = stream.write_all(format!("{:x}\r\n{first}\r\n", first.len()).as_bytes()).await;
                // The second event only after the test has seen the first one.
                release.notified().await;
                let _ = stream.write_all(format!("{:x}\r\n{second}\r\n0\r\n\r\n", second.len()).as_bytes()).await;
            })
        }),
    )
    .await;
    let base = format!("http://127.0.0.1:{}/v1", upstream.addr.port());
    let guard = ModelGuard::new(config(true, ScriptedResolver::new(&[&[]]))).expect("guard");
    let tunnel = guard.tunnel_for(&provider(&base)).expect("tunnel");
    let mut response = tunnel.serve(request(&base, "/chat/completions")).await;
    assert_eq!(response.status, 200);
    let first = tokio::time::timeout(Duration::from_secs(10), response.body.recv())
        .await
        .expect("the first event arrives before the body ends");
    assert_eq!(first, Some(Ok("data: {\"n\":1}\n\n".to_owned())));
    go_on.notify_one();
    assert_eq!(body(&mut response).await.as_deref(), Ok("data: [DONE]\n\n"));
}

#[tokio::test]
async fn upstream_errors_reach_the_runtime_with_their_status_and_retry_headers() {
    let upstream = Upstream::answering(
        "127.0.0.1",
        0,
        "HTTP/1.1 429 Too Many Requests\r\nretry-after: 7\r\ncontent-type: application/json\r\ncontent-length: 11\r\n\r\n{\"error\":1}",
    )
    .await;
    let failing = Upstream::answering(
        "127.0.0.1",
        0,
        "HTTP/1.1 500 Internal Server Error\r\ncontent-length: 4\r\n\r\noops",
    )
    .await;
    let recorder = DebuggingRecorder::new();
    let _local = ::metrics::set_default_local_recorder(&recorder);
    let guard = ModelGuard::new(config(true, ScriptedResolver::new(&[&[]]))).expect("guard");
    for (upstream, status, outcome) in [
        (&upstream, 429, "client_error"),
        (&failing, 500, "server_error"),
    ] {
        let base = format!("http://127.0.0.1:{}/v1", upstream.addr.port());
        let tunnel = guard.tunnel_for(&provider(&base)).expect("tunnel");
        let mut response = tunnel.serve(request(&base, "/chat/completions")).await;
        assert_eq!(response.status, status);
        body(&mut response).await.expect("body");
        // The body task records the outcome after the last chunk.
        tokio::task::yield_now().await;
        let recorded = counters(&recorder);
        assert_eq!(
            count(&recorded, crate::metrics::MODEL_REQUESTS_TOTAL, outcome),
            1
        );
        assert_eq!(
            count(&recorded, crate::metrics::MODEL_BYTES_TOTAL, "sent"),
            27
        );
    }
    let base = format!("http://127.0.0.1:{}/v1", upstream.addr.port());
    let tunnel = guard.tunnel_for(&provider(&base)).expect("tunnel");
    let response = tunnel.serve(request(&base, "/chat/completions")).await;
    assert!(
        response
            .headers
            .contains(&("retry-after".to_owned(), "7".to_owned()))
    );
    // Nothing listens: the runtime gets a 502 it retries like a connection error.
    let closed = {
        let l = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        l.local_addr().expect("addr").port()
    };
    // Its base URL's query holds a key: the answer the child gets does not.
    let base = format!("http://127.0.0.1:{closed}/v1?code=fn-key-in-query");
    let tunnel = guard.tunnel_for(&provider(&base)).expect("tunnel");
    let mut response = tunnel.serve(request(&base, "/chat/completions")).await;
    assert_eq!(response.status, 502);
    let text = body(&mut response).await.unwrap_or_else(|e| e);
    assert!(text.contains("connect_error"), "{text}");
    assert!(!text.contains("fn-key-in-query"), "{text}");
}

#[tokio::test]
async fn a_silent_provider_times_out_before_its_head_and_while_its_body_stalls() {
    let hang = Upstream::start(
        "127.0.0.1",
        0,
        Arc::new(|stream: TcpStream| {
            Box::pin(async move {
                // Never answers; holds the connection until the test ends.
                std::future::pending::<()>().await;
                drop(stream);
            })
        }),
    )
    .await;
    let stall = Upstream::start(
        "127.0.0.1",
        0,
        Arc::new(|mut stream: TcpStream| {
            Box::pin(async move {
                let _ = stream
                    .write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\npartial")
                    .await;
                std::future::pending::<()>().await;
            })
        }),
    )
    .await;
    let mut cfg = config(true, ScriptedResolver::new(&[&[]]));
    cfg.first_byte_timeout = Duration::from_millis(300);
    cfg.idle_timeout = Duration::from_millis(300);
    let guard = ModelGuard::new(cfg).expect("guard");

    let base = format!("http://127.0.0.1:{}/v1", hang.addr.port());
    let tunnel = guard.tunnel_for(&provider(&base)).expect("tunnel");
    let mut response = tunnel.serve(request(&base, "/chat/completions")).await;
    assert_eq!(response.status, 504);
    assert_eq!(refusal_code(&mut response).await, "timeout");

    let base = format!("http://127.0.0.1:{}/v1", stall.addr.port());
    let tunnel = guard.tunnel_for(&provider(&base)).expect("tunnel");
    let mut response = tunnel.serve(request(&base, "/chat/completions")).await;
    assert_eq!(response.status, 200);
    assert_eq!(response.body.recv().await, Some(Ok("partial".to_owned())));
    let broke = body(&mut response).await.unwrap_err();
    assert!(broke.contains("sent nothing"), "{broke}");
}

#[tokio::test]
async fn redirects_are_followed_on_the_same_origin_only() {
    let other = Upstream::answering(
        "127.0.0.2",
        0,
        "HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nOTHER",
    )
    .await;
    let elsewhere: &'static str = Box::leak(
        format!(
            "HTTP/1.1 307 Temporary Redirect\r\nlocation: http://127.0.0.2:{}/v1/chat/completions\r\ncontent-length: 0\r\n\r\n",
            other.addr.port()
        )
        .into_boxed_str(),
    );
    let cross = Upstream::answering("127.0.0.1", 0, elsewhere).await;
    let calls = Arc::new(AtomicUsize::new(0));
    let seen = calls.clone();
    let same = Upstream::start(
        "127.0.0.1",
        0,
        Arc::new(move |mut stream: TcpStream| {
            let n = seen.fetch_add(1, Ordering::SeqCst);
            Box::pin(async move {
                let raw: &[u8] = if n == 0 {
                    b"HTTP/1.1 307 Temporary Redirect\r\nlocation: /v1/moved\r\ncontent-length: 0\r\n\r\n"
                } else {
                    b"HTTP/1.1 200 OK\r\ncontent-length: 4\r\n\r\nSAME"
                };
                let _ = stream.write_all(raw).await;
            })
        }),
    )
    .await;
    let guard = ModelGuard::new(config(true, ScriptedResolver::new(&[&[]]))).expect("guard");

    let base = format!("http://127.0.0.1:{}/v1", same.addr.port());
    let tunnel = guard.tunnel_for(&provider(&base)).expect("tunnel");
    let mut response = tunnel.serve(request(&base, "/chat/completions")).await;
    assert_eq!(response.status, 200);
    assert_eq!(body(&mut response).await.as_deref(), Ok("SAME"));
    assert!(
        same.requests()[1].starts_with("POST /v1/moved "),
        "{:?}",
        same.requests()
    );

    let base = format!("http://127.0.0.1:{}/v1", cross.addr.port());
    let tunnel = guard.tunnel_for(&provider(&base)).expect("tunnel");
    let mut response = tunnel.serve(request(&base, "/chat/completions")).await;
    assert_eq!(
        response.status, 307,
        "a redirect to another host is answered as it came"
    );
    body(&mut response).await.expect("body");
    assert_eq!(other.accepted(), 0);
}

/// An upstream on loopback answering every request 200 with no body, its base URL, and the
/// tunnel of a provider there under a guard that allows private endpoints.
async fn loopback_tunnel() -> (Upstream, String, Arc<dyn ModelTunnel>) {
    let upstream = Upstream::answering(
        "127.0.0.1",
        0,
        "HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n",
    )
    .await;
    let base = format!("http://127.0.0.1:{}/v1", upstream.addr.port());
    let guard = ModelGuard::new(config(true, ScriptedResolver::new(&[&[]]))).expect("guard");
    let tunnel = guard.tunnel_for(&provider(&base)).expect("tunnel");
    (upstream, base, tunnel)
}

#[tokio::test]
async fn a_request_with_a_method_no_model_call_uses_is_refused_before_a_connection() {
    let (upstream, base, tunnel) = loopback_tunnel().await;
    for method in ["TRACE", "PUT", "DELETE", "CONNECT", "OPTIONS"] {
        let mut req = request(&base, "/chat/completions");
        req.method = method.into();
        let mut response = tunnel.serve(req).await;
        assert_eq!(response.status, 403, "{method}");
        assert_eq!(refusal_code(&mut response).await, "foreign_url", "{method}");
    }
    assert_eq!(upstream.accepted(), 0);
    // The methods model calls use still go through.
    for method in ["POST", "GET"] {
        let mut req = request(&base, "/chat/completions");
        req.method = method.into();
        let mut response = tunnel.serve(req).await;
        assert_eq!(response.status, 200, "{method}");
        body(&mut response).await.expect("body");
    }
}

#[tokio::test]
async fn this_machines_own_public_address_is_refused_unless_private_endpoints_are_allowed() {
    let host = ["8.8.8.8", "127.0.0.1"];
    let resolver = ScriptedResolver::on_host(&[&["8.8.8.8"]], &host);
    let guard = ModelGuard::new(config(false, resolver.clone())).expect("guard");
    // By its address, at the lease, and the IPv4 address inside an IPv6 one as itself.
    for base in ["https://8.8.8.8/v1", "https://[::ffff:8.8.8.8]/v1"] {
        let refused = guard.check_provider(&provider(base)).unwrap_err();
        assert!(
            matches!(&refused, GuardError::Refused { reason: BlockReason::ThisHost, message }
                if message.contains("an address of this machine")
                    && message.contains("private_endpoints")),
            "{base}: {refused:?}"
        );
    }
    // By a name that resolves to it, on each request.
    let base = "https://model.test/v1";
    let mut response = tunnel(&guard, base)
        .serve(request(base, "/chat/completions"))
        .await;
    assert_eq!(response.status, 403);
    assert_eq!(refusal_code(&mut response).await, "this_host");
    // Another machine's address is not refused.
    assert!(
        guard
            .check_provider(&provider("https://8.8.4.4/v1"))
            .is_ok()
    );
    // Read once for all these checks: not a round trip to the kernel a request.
    assert_eq!(resolver.host_reads.load(Ordering::SeqCst), 1);
    // A local model on this machine's address, where private endpoints are allowed.
    let resolver = ScriptedResolver::on_host(&[&[]], &host);
    let guard = ModelGuard::new(config(true, resolver)).expect("guard");
    assert!(
        guard
            .check_provider(&provider("https://8.8.8.8/v1"))
            .is_ok()
    );
}

#[tokio::test]
async fn a_request_outside_the_providers_base_url_is_refused() {
    let (upstream, base, tunnel) = loopback_tunnel().await;
    for url in [
        "https://api.githubcopilot.com/chat/completions".to_owned(),
        format!("https://{PLACEHOLDER_HOST}/v2/chat/completions"),
        format!("https://{PLACEHOLDER_HOST}/v1x"),
        format!("https://{PLACEHOLDER_HOST}/v1/../admin"),
        // Separators spelled encoded: a server that decodes them climbs out of the base.
        format!("https://{PLACEHOLDER_HOST}/v1/..%2F..%2Fadmin"),
        format!("https://{PLACEHOLDER_HOST}/v1/%2e%2e%2fadmin"),
        format!("https://{PLACEHOLDER_HOST}/v1/..%5Cadmin"),
        format!("https://{PLACEHOLDER_HOST}/v1/..;/admin"),
        // Dots spelled encoded before a `;` (no dot segment to the URL parser, `..` to a
        // server that drops the parameter and decodes).
        format!("https://{PLACEHOLDER_HOST}/v1/%2e%2e;/admin"),
        format!("https://{PLACEHOLDER_HOST}/v1/.%2e;x=1/admin"),
        format!("https://{PLACEHOLDER_HOST}/v1/%2E.;/admin"),
        // Encoded twice: a server (or a proxy before it) that decodes twice climbs too.
        format!("https://{PLACEHOLDER_HOST}/v1/..%252F..%252Fadmin"),
        format!("https://{PLACEHOLDER_HOST}/v1/%252e%252e/admin"),
        // A `%` that is no escape, decoded once, becomes one; an overlong `/`.
        format!("https://{PLACEHOLDER_HOST}/v1/..%%32%66admin"),
        format!("https://{PLACEHOLDER_HOST}/v1/..%2%66admin"),
        format!("https://{PLACEHOLDER_HOST}/v1/..%u002fadmin"),
        format!("https://{PLACEHOLDER_HOST}/v1/..%c0%afadmin"),
        format!("https://{PLACEHOLDER_HOST}:8443/v1/chat/completions"),
        format!("http://{PLACEHOLDER_HOST}/v1/chat/completions"),
        format!("https://user@{PLACEHOLDER_HOST}/v1/chat/completions"),
    ] {
        let mut req = request(&base, "");
        req.url = url.clone();
        let mut response = tunnel.serve(req).await;
        assert_eq!(response.status, 403, "{url}");
        assert_eq!(refusal_code(&mut response).await, "foreign_url", "{url}");
    }
    // A path outside the base path is named, with the base path and the fix.
    let mut req = request(&base, "");
    req.url = format!("https://{PLACEHOLDER_HOST}/v2/chat/completions?key=k");
    let mut response = tunnel.serve(req).await;
    let text = body(&mut response).await.expect("refusal body");
    assert!(
        text.contains("/v2/chat/completions")
            && text.contains("provider.base_url")
            && !text.contains("key=k"),
        "{text}"
    );
    assert_eq!(upstream.accepted(), 0);
}

#[test]
fn the_child_gets_placeholders_for_the_key_the_token_the_url_and_no_headers() {
    let mut real =
        provider("https://models.example:8443/openai/v1?api-version=2024-10-21&code=fn-key-0815");
    real.bearer_token = Some(Secret::new("bearer-real-99"));
    real.headers = Some([("x-secret-header".to_owned(), "hidden".to_owned())].into());
    let child = ModelGuard::placeholder(&real);
    // The query stays with the guard: a key in a parameter no check knows never reaches the
    // child; the guard puts the query on each upstream request.
    assert_eq!(
        child.base_url,
        format!("https://{PLACEHOLDER_HOST}/openai/v1")
    );
    let base = url::Url::parse(&real.base_url).expect("base");
    let upstream = target::upstream_url(
        &format!("https://{PLACEHOLDER_HOST}/openai/v1/chat/completions"),
        &base,
    )
    .expect("upstream");
    assert_eq!(
        upstream.as_str(),
        "https://models.example:8443/openai/v1/chat/completions?api-version=2024-10-21&code=fn-key-0815"
    );
    // A parameter the request gives itself is not given twice.
    let upstream = target::upstream_url(
        &format!("https://{PLACEHOLDER_HOST}/openai/v1/chat/completions?api-version=2025-01-01"),
        &base,
    )
    .expect("upstream");
    assert_eq!(
        upstream.query(),
        Some("api-version=2025-01-01&code=fn-key-0815")
    );
    // Written as the operator wrote them: nothing decoded and encoded again.
    let spaced = url::Url::parse("https://models.example/v1?q=a%20b&flag").expect("base");
    let upstream = target::upstream_url(&format!("https://{PLACEHOLDER_HOST}/v1/x"), &spaced)
        .expect("upstream");
    assert_eq!(upstream.query(), Some("q=a%20b&flag"));
    // An encoded separator in the operator's own base path is the operator's: passed.
    let encoded = url::Url::parse("https://models.example/proxy%2Fopenai/v1").expect("base");
    let upstream = target::upstream_url(
        &format!("https://{PLACEHOLDER_HOST}/proxy%2Fopenai/v1/chat/completions"),
        &encoded,
    )
    .expect("upstream");
    assert_eq!(upstream.path(), "/proxy%2Fopenai/v1/chat/completions");
    assert_eq!(
        child.api_key.as_ref().map(Secret::expose),
        Some(PLACEHOLDER_API_KEY)
    );
    assert_eq!(
        child.bearer_token.as_ref().map(Secret::expose),
        Some(PLACEHOLDER_BEARER_TOKEN)
    );
    assert_eq!(child.headers, None);
    let wire = serde_json::to_string(&child).expect("json");
    for secret in [
        "sk-real-key-4711",
        "bearer-real-99",
        "hidden",
        "models.example",
        "fn-key-0815",
    ] {
        assert!(!wire.contains(secret), "{secret} in {wire}");
    }
    // Without a key the child gets none either; a bare host keeps no path.
    let keyless = ProviderConfig::openai("https://models.example", None);
    let child = ModelGuard::placeholder(&keyless);
    assert_eq!(child.api_key, None);
    assert_eq!(child.base_url, format!("https://{PLACEHOLDER_HOST}"));
}

#[test]
fn the_bearer_token_wins_and_a_credential_header_without_the_placeholder_is_dropped() {
    let mut p = provider("https://models.example/v1");
    p.bearer_token = Some(Secret::new("bearer-real-99"));
    let headers = forward::request_headers(
        &[
            (
                "authorization".into(),
                format!("Bearer {PLACEHOLDER_BEARER_TOKEN}"),
            ),
            ("api-key".into(), PLACEHOLDER_API_KEY.into()),
            ("x-api-key".into(), "not-ours".into()),
        ],
        &p,
    );
    assert_eq!(headers["authorization"], "Bearer bearer-real-99");
    assert_eq!(headers["api-key"], "sk-real-key-4711");
    assert!(headers.get("x-api-key").is_none());
    assert!(headers["authorization"].is_sensitive());
    // The placeholder inside other text is not replaced: the header is dropped.
    let headers = forward::request_headers(
        &[
            (
                "authorization".into(),
                format!("Bearer echo-{PLACEHOLDER_BEARER_TOKEN}"),
            ),
            (
                "api-key".into(),
                format!("{PLACEHOLDER_API_KEY} {PLACEHOLDER_API_KEY}"),
            ),
            ("x-api-key".into(), format!(" {PLACEHOLDER_API_KEY} ")),
        ],
        &p,
    );
    assert!(headers.get("authorization").is_none(), "{headers:?}");
    assert!(headers.get("api-key").is_none(), "{headers:?}");
    assert_eq!(headers["x-api-key"], "sk-real-key-4711");
    assert!(headers["x-api-key"].is_sensitive());
}

#[test]
fn text_split_inside_a_character_is_passed_on_whole() {
    let text = "é→🦀 data";
    let bytes = text.as_bytes();
    for cut in 1..bytes.len() {
        let mut decoder = Utf8Decoder::default();
        let mut out = decoder.push(&bytes[..cut]);
        out.push_str(&decoder.push(&bytes[cut..]));
        assert_eq!(decoder.finish(), None);
        assert_eq!(out, text, "cut at {cut}");
    }
    let mut decoder = Utf8Decoder::default();
    assert_eq!(decoder.push(b"a\xffb"), "a\u{fffd}b");
    assert_eq!(decoder.push(b"\xf0\x9f"), "");
    assert_eq!(decoder.finish().as_deref(), Some("\u{fffd}"));
}

#[test]
fn bad_extra_certificates_are_refused_with_the_fix() {
    let config = ModelGuardConfig {
        extra_root_certificates_pem: vec![b"not a certificate".to_vec()],
        ..Default::default()
    };
    let error = ModelGuard::new(config).unwrap_err().to_string();
    assert!(error.contains("BEGIN CERTIFICATE"), "{error}");
}

#[tokio::test]
async fn an_operator_listed_private_endpoint_passes_and_no_other_private_one_does() {
    let upstream = Upstream::answering(
        "127.0.0.1",
        0,
        "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\nconnection: close\r\n\
         content-length: 2\r\n\r\n{}",
    )
    .await;
    let port = upstream.addr.port();
    let base = format!("http://127.0.0.1:{port}/v1");
    let mut listed = config(false, ScriptedResolver::new(&[&[]]));
    listed.private_endpoints = vec![
        ModelGuardConfig::private_endpoint(&format!("http://127.0.0.1:{port}")).expect("origin"),
    ];
    let guard = ModelGuard::new(listed).expect("guard");
    let tunnel = guard
        .tunnel_for(&provider(&base))
        .expect("the listed origin");
    let mut response = tunnel.serve(request(&base, "/chat/completions")).await;
    assert_eq!(response.status, 200);
    assert_eq!(body(&mut response).await.as_deref(), Ok("{}"));

    // Another port of loopback, or https on the same host, is another origin: refused.
    for other in [
        format!("http://127.0.0.1:{}/v1", port.wrapping_add(1)),
        format!("https://127.0.0.1:{port}/v1"),
        "http://10.0.0.7:8080/v1".to_owned(),
    ] {
        let refused = guard.check_provider(&provider(&other));
        assert!(
            matches!(refused, Err(GuardError::Refused { .. })),
            "{other}: {refused:?}"
        );
    }
    // Without the list the same provider is refused.
    let unlisted = ModelGuard::new(config(false, ScriptedResolver::new(&[&[]]))).expect("guard");
    assert!(unlisted.check_provider(&provider(&base)).is_err());
    // Only origins are entries.
    for bad in [
        "http://127.0.0.1:11434/v1",
        "ftp://127.0.0.1",
        "http://user:pw@127.0.0.1",
        "http://127.0.0.1/?key=1",
        "127.0.0.1:11434",
    ] {
        let error = ModelGuardConfig::private_endpoint(bad).expect_err(bad);
        assert!(error.to_string().contains("is not an origin"), "{error}");
    }
    // Plain http:// only where model requests may go over it: loopback.
    // (A name is judged by the addresses it resolves to, at each request.)
    for good in [
        "http://127.0.0.1:11434",
        "http://[::1]:8080",
        "http://[::ffff:127.0.0.1]:8080",
        "http://localhost:11434",
        "http://ollama.localhost:11434",
        "https://10.0.0.7:8443",
        "https://llm.internal",
    ] {
        ModelGuardConfig::private_endpoint(good).expect(good);
    }
    for never_reached in ["http://10.0.0.7:11434", "http://[fd00::7]:11434"] {
        let error = ModelGuardConfig::private_endpoint(never_reached).expect_err(never_reached);
        assert!(
            error.to_string().contains("not loopback") && error.to_string().contains("https://"),
            "{error}"
        );
    }
}

/// A resolver whose lookups of `stuck.test` never return until released (a DNS server that
/// does not answer), and whose `model.test` is loopback.
struct StuckResolver {
    started: AtomicUsize,
    release: Arc<Notify>,
}

impl Resolve for StuckResolver {
    fn lookup(&self, host: &str, _port: u16) -> ResolveFuture {
        if host != "stuck.test" {
            return Box::pin(async { Ok(vec![IpAddr::from([127, 0, 0, 1])]) });
        }
        self.started.fetch_add(1, Ordering::SeqCst);
        let release = self.release.clone();
        Box::pin(async move {
            release.notified().await;
            Err(std::io::Error::other("released"))
        })
    }
}

#[tokio::test]
async fn a_provider_host_whose_dns_never_answers_holds_a_few_lookups_and_stalls_no_other_worker() {
    let upstream = Upstream::answering(
        "127.0.0.1",
        0,
        "HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok",
    )
    .await;
    let port = upstream.addr.port();
    let resolver = Arc::new(StuckResolver {
        started: AtomicUsize::new(0),
        release: Arc::new(Notify::new()),
    });
    let mut config = config(true, resolver.clone());
    // The bound the test waits out: each stuck request gives up after it.
    config.connect_timeout = Duration::from_secs(1);
    let guard = ModelGuard::new(config).expect("guard");
    let stuck_base = format!("http://stuck.test:{port}/v1");
    let stuck = tunnel(&guard, &stuck_base);
    let answers = futures_util::future::join_all(
        (0..LOOKUPS_PER_WORKER + 2).map(|_| stuck.serve(request(&stuck_base, "/chat/completions"))),
    )
    .await;
    assert!(answers.iter().all(|a| a.status != 200));
    assert_eq!(
        resolver.started.load(Ordering::SeqCst),
        LOOKUPS_PER_WORKER,
        "the requests past the worker's places waited for one and gave up without a lookup"
    );
    // Their requests gave up, but the lookups still run and keep their places: the next
    // request of the worker waits for one and gives up too, starting no lookup.
    let later = stuck.serve(request(&stuck_base, "/chat/completions")).await;
    assert_ne!(later.status, 200);
    assert_eq!(
        resolver.started.load(Ordering::SeqCst),
        LOOKUPS_PER_WORKER,
        "a lookup that outlived its request still holds its place"
    );
    // Another worker's provider resolves meanwhile.
    let other_base = format!("http://model.test:{port}/v1");
    let mut other = tunnel(&guard, &other_base)
        .serve(request(&other_base, "/chat/completions"))
        .await;
    assert_eq!(other.status, 200);
    assert_eq!(body(&mut other).await.as_deref(), Ok("ok"));
    // The stuck lookups return: their places are free for the worker's next request.
    resolver.release.notify_waiters();
    let next = stuck.serve(request(&stuck_base, "/chat/completions")).await;
    assert_ne!(next.status, 200);
    assert_eq!(
        resolver.started.load(Ordering::SeqCst),
        LOOKUPS_PER_WORKER + 1
    );
}

/// The reason a CLI provider check refused `base_url` for, or `None` when it passed.
async fn cli_refusal(guard: &ModelGuard, base_url: &str) -> Option<(BlockReason, String)> {
    match guard
        .check_cli_provider(&provider(base_url), "agent-a")
        .await
    {
        Ok(()) => None,
        Err(GuardError::Refused { reason, message }) => Some((reason, message)),
        Err(other) => panic!("{base_url}: {other}"),
    }
}

#[tokio::test]
async fn a_cli_backends_provider_must_name_an_allowed_port_and_a_host_outside_the_network() {
    let public = || ScriptedResolver::new(&[&["93.184.216.34"]]);
    let guard = ModelGuard::new(config(false, public())).expect("guard");
    for allowed in ["https://model.test/v1", "https://model.test:443/v1"] {
        assert_eq!(cli_refusal(&guard, allowed).await, None, "{allowed}");
    }
    // Any other port would open on every address to the agent's tools (the metadata
    // service's 80, a kubelet's 10250): refused for a CLI, naming the setting; a tunnelled
    // Copilot provider may use it (its child opens no port for it).
    for port in [80, 8443, 10250] {
        let base = format!("https://model.test:{port}/v1");
        let (reason, message) = cli_refusal(&guard, &base).await.expect("refused");
        assert_eq!(reason, BlockReason::Port, "{message}");
        assert!(
            message.contains(&format!("port {port}")) && message.contains("cli_provider_ports"),
            "{message}"
        );
        guard.check_provider(&provider(&base)).expect("tunnelled");
    }
    let mut listed = config(false, public());
    listed.cli_provider_ports = vec![443, 8443];
    let listed = ModelGuard::new(listed).expect("guard");
    assert_eq!(
        cli_refusal(&listed, "https://model.test:8443/v1").await,
        None
    );

    // A name that resolves inside the network is refused as its address is; so is the
    // metadata service even where private endpoints are allowed.
    let inside =
        ModelGuard::new(config(false, ScriptedResolver::new(&[&["10.0.0.7"]]))).expect("guard");
    let (reason, _) = cli_refusal(&inside, "https://model.test/v1")
        .await
        .expect("refused");
    assert_eq!(reason, BlockReason::Private);
    let private =
        ModelGuard::new(config(true, ScriptedResolver::new(&[&["10.0.0.7"]]))).expect("guard");
    assert_eq!(
        cli_refusal(&private, "https://model.test:8080/v1").await,
        None
    );
    // Private endpoints allowed open any port to a local model only: a public host on :80
    // would open the metadata service's port to the tools.
    let allowed_public = ModelGuard::new(config(true, public())).expect("guard");
    let (reason, _) = cli_refusal(&allowed_public, "https://model.test:80/v1")
        .await
        .expect("refused");
    assert_eq!(reason, BlockReason::Port);
    // The port the guard reads is the one the sandbox opens and the CLI connects to: a
    // backslash ends the host, so `\:80` is part of the path and the port is 443.
    let backslash = "https://model.test\\:80/v1";
    assert_eq!(cli_refusal(&guard, backslash).await, None);
    assert_eq!(crate::sandbox::url_port(backslash), Some(443));
    let metadata = ModelGuard::new(config(true, ScriptedResolver::new(&[&["169.254.169.254"]])))
        .expect("guard");
    let (reason, _) = cli_refusal(&metadata, "http://model.test:80/latest")
        .await
        .expect("refused");
    assert_eq!(reason, BlockReason::Metadata);

    // A name with no address cannot be checked: refused, saying so.
    let nowhere = ModelGuard::new(config(false, ScriptedResolver::new(&[&[]]))).expect("guard");
    let error = nowhere
        .check_cli_provider(&provider("https://model.test/v1"), "agent-a")
        .await
        .expect_err("unresolved");
    assert!(
        matches!(error, GuardError::Unresolved { .. }) && error.to_string().contains("model.test"),
        "{error}"
    );
}

#[tokio::test]
async fn an_agent_whose_cli_provider_host_never_answers_stalls_no_other_agents_cli_turns() {
    let resolver = Arc::new(StuckResolver {
        started: AtomicUsize::new(0),
        release: Arc::new(Notify::new()),
    });
    let mut config = config(true, resolver.clone());
    // The bound the test waits out: each stuck check gives up after it.
    config.connect_timeout = Duration::from_secs(1);
    let stuck_provider = provider("https://stuck.test/v1");
    let guard = ModelGuard::new(config).expect("guard");
    // Agent a asks for as many checks as the pool has places, all on a name that never
    // answers: it holds its own places only, the rest wait for one and give up.
    let stuck = futures_util::future::join_all(
        (0..CLI_LOOKUPS).map(|_| guard.check_cli_provider(&stuck_provider, "agent-a")),
    )
    .await;
    assert!(
        stuck
            .iter()
            .all(|c| matches!(c, Err(GuardError::Unresolved { .. }))),
        "{stuck:?}"
    );
    assert_eq!(
        resolver.started.load(Ordering::SeqCst),
        CLI_LOOKUPS_PER_AGENT,
        "the agent's checks past its places started no lookup"
    );
    // Another agent's provider resolves meanwhile (its lookups still running).
    guard
        .check_cli_provider(&provider("https://model.test:8080/v1"), "agent-b")
        .await
        .expect("agent b's local model");
    resolver.release.notify_waiters();
}
