//! The guarded model path end to end: BYOK turns through the real runtime, its model
//! requests over the tunnel, the pool's client to the scripted model on loopback (HTTPS with
//! a certificate generated here and trusted as an extra CA). The real key never enters the
//! child; oversized bodies and refused providers never reach the model. Loopback only.

mod support;

use std::io::Read;
use std::net::SocketAddr;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use copilot_pool::kinds::ErrorKind;
use copilot_pool::model_guard::PLACEHOLDER_API_KEY;
use copilot_pool::pool::{Pool, PoolError};
use copilot_pool::rpc::messages::ProviderConfig;
use copilot_pool::scripted_model::Reply;
use copilot_pool::secret::Secret;
use copilot_pool::turn::TurnError;
use rustls_pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use support::pool_fixture::{Fixture, shutdown_leaves_nothing};
use support::procs;

/// A TLS front for the scripted model: a certificate for 127.0.0.1 signed by a CA made for
/// this test, every decrypted byte the client sent recorded.
struct TlsFront {
    addr: SocketAddr,
    ca_pem: String,
    received: Arc<Mutex<Vec<u8>>>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for TlsFront {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl TlsFront {
    async fn start(backend: SocketAddr) -> TlsFront {
        let ca_key = rcgen::KeyPair::generate().expect("CA key");
        let mut ca_params = rcgen::CertificateParams::new(Vec::<String>::new()).expect("CA");
        ca_params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        ca_params
            .distinguished_name
            .push(rcgen::DnType::CommonName, "copilot-pool test CA");
        let ca = rcgen::CertifiedIssuer::self_signed(ca_params, ca_key).expect("CA cert");
        let leaf_key = rcgen::KeyPair::generate().expect("leaf key");
        let leaf = rcgen::CertificateParams::new(vec!["127.0.0.1".to_owned()])
            .expect("leaf")
            .signed_by(&leaf_key, &ca)
            .expect("leaf cert");
        let provider = Arc::new(rustls::crypto::aws_lc_rs::default_provider());
        let config = rustls::ServerConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .expect("versions")
            .with_no_client_auth()
            .with_single_cert(
                vec![CertificateDer::from(leaf.der().to_vec())],
                PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(leaf_key.serialize_der())),
            )
            .expect("server config");
        let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(config));
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        let received = Arc::new(Mutex::new(Vec::new()));
        let log = received.clone();
        let task = tokio::spawn(async move {
            while let Ok((tcp, _)) = listener.accept().await {
                let (acceptor, log) = (acceptor.clone(), log.clone());
                tokio::spawn(async move {
                    let Ok(tls) = acceptor.accept(tcp).await else {
                        return;
                    };
                    let Ok(plain) = TcpStream::connect(backend).await else {
                        return;
                    };
                    pipe(tls, plain, log).await;
                });
            }
        });
        TlsFront {
            addr,
            ca_pem: ca.pem(),
            received,
            task,
        }
    }

    fn received(&self) -> String {
        String::from_utf8_lossy(&self.received.lock().expect("log")).into_owned()
    }
}

/// Copies both ways until either side closes, recording what the client sent.
async fn pipe(
    client: tokio_rustls::server::TlsStream<TcpStream>,
    backend: TcpStream,
    log: Arc<Mutex<Vec<u8>>>,
) {
    let (mut client_rx, mut client_tx) = tokio::io::split(client);
    let (mut backend_rx, mut backend_tx) = backend.into_split();
    let up = async {
        let mut buf = vec![0u8; 16 * 1024];
        while let Ok(n) = client_rx.read(&mut buf).await {
            if n == 0 || backend_tx.write_all(&buf[..n]).await.is_err() {
                break;
            }
            log.lock().expect("log").extend_from_slice(&buf[..n]);
        }
        let _ = backend_tx.shutdown().await;
    };
    let down = async {
        let _ = tokio::io::copy(&mut backend_rx, &mut client_tx).await;
        let _ = client_tx.shutdown().await;
    };
    tokio::join!(up, down);
}

/// Where each needle was found among what a process exposes: its environment, its command
/// line, its readable memory.
#[derive(Debug, Default)]
struct Exposure {
    environ: Vec<usize>,
    cmdline: Vec<usize>,
    memory: Vec<usize>,
    memory_bytes: u64,
}

/// Searches `/proc/<pid>/environ`, `cmdline` and every readable mapping of `/proc/<pid>/mem`
/// for each needle (as bytes and as UTF-16LE).
fn exposure(pid: u32, needles: &[&str]) -> Exposure {
    let forms: Vec<(usize, Vec<u8>)> = needles
        .iter()
        .enumerate()
        .flat_map(|(i, n)| {
            let utf16: Vec<u8> = n.encode_utf16().flat_map(u16::to_le_bytes).collect();
            [(i, n.as_bytes().to_vec()), (i, utf16)]
        })
        .collect();
    let found_in = |bytes: &[u8]| -> Vec<usize> {
        let mut hits: Vec<usize> = forms
            .iter()
            .filter(|(_, f)| memchr::memmem::find(bytes, f).is_some())
            .map(|(i, _)| *i)
            .collect();
        hits.dedup();
        hits
    };
    let mut out = Exposure {
        environ: found_in(&std::fs::read(format!("/proc/{pid}/environ")).unwrap_or_default()),
        cmdline: found_in(&std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default()),
        ..Default::default()
    };
    let maps = std::fs::read_to_string(format!("/proc/{pid}/maps")).expect("maps");
    let mem = std::fs::File::open(format!("/proc/{pid}/mem")).expect("open /proc/<pid>/mem");
    let longest = forms.iter().map(|(_, f)| f.len()).max().unwrap_or(1);
    let mut buf = vec![0u8; 8 << 20];
    for line in maps.lines() {
        let mut fields = line.split_whitespace();
        let (Some(range), Some(perms)) = (fields.next(), fields.next()) else {
            continue;
        };
        if !perms.starts_with('r') || line.ends_with("[vvar]") || line.ends_with("[vvar_vclock]") {
            continue;
        }
        let Some((start, end)) = range.split_once('-') else {
            continue;
        };
        let (Ok(start), Ok(end)) = (u64::from_str_radix(start, 16), u64::from_str_radix(end, 16))
        else {
            continue;
        };
        let mut at = start;
        while at < end {
            let len = ((end - at) as usize).min(buf.len());
            let Ok(n) = mem.read_at(&mut buf[..len], at) else {
                break;
            };
            if n == 0 {
                break;
            }
            out.memory_bytes += n as u64;
            for i in found_in(&buf[..n]) {
                if !out.memory.contains(&i) {
                    out.memory.push(i);
                }
            }
            // Overlap the next read so a needle across the boundary is found.
            if at + (n as u64) >= end {
                break;
            }
            at += (n - longest.min(n)).max(1) as u64;
        }
    }
    out
}

/// Files under `dir` whose content holds `needle`, and how many files were read.
fn files_containing(dir: &Path, needle: &str) -> (Vec<String>, usize) {
    let mut hits = Vec::new();
    let mut read = 0;
    let mut stack = vec![dir.to_path_buf()];
    while let Some(dir) = stack.pop() {
        let Ok(entries) = std::fs::read_dir(&dir) else {
            continue;
        };
        for entry in entries.flatten() {
            let path = entry.path();
            let Ok(meta) = entry.metadata() else {
                continue;
            };
            if meta.is_dir() {
                stack.push(path);
            } else if meta.is_file() {
                let mut content = Vec::new();
                if std::fs::File::open(&path)
                    .and_then(|mut f| f.read_to_end(&mut content))
                    .is_ok()
                {
                    read += 1;
                    if memchr::memmem::find(&content, needle.as_bytes()).is_some() {
                        hits.push(path.display().to_string());
                    }
                }
            }
        }
    }
    (hits, read)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_byok_turn_runs_over_tls_through_the_guard_and_the_real_key_never_enters_the_child() {
    let fx = Fixture::new().await;
    let front = TlsFront::start(fx.endpoint.addr()).await;
    let mut config = fx.config().await;
    config.model_guard.extra_root_certificates_pem = vec![front.ca_pem.clone().into_bytes()];
    let pool = Pool::start(config).await.expect("pool");
    let key = format!("sk-guard-{}", uuid::Uuid::new_v4().simple());
    let mut req = fx.request("agent-g", "conv-g");
    req.provider = Some(ProviderConfig::openai(
        format!("https://127.0.0.1:{}/v1", front.addr.port()),
        Some(Secret::new(key.clone())),
    ));

    // An upstream 500 first: the runtime retries it, as with a direct connection.
    fx.model.push_reply(Reply::Error { status: 500 });
    let mut lease = pool.lease(req).await.expect("lease");
    let outcome = lease.run("REPLY=guarded-hello").await.expect("turn");
    assert_eq!(outcome.text, "guarded-hello", "{outcome:?}");
    assert!(fx.model.requests().len() >= 2, "the 500 was not retried");

    // The provider got the real key, over TLS, from the pool.
    let upstream = front.received();
    assert!(upstream.contains(&format!("Bearer {key}")), "{upstream}");
    assert!(!upstream.contains(PLACEHOLDER_API_KEY));

    // The child (and anything in its group) never had it: not in its environment, its
    // command line or its memory, while it holds the placeholder it was given instead.
    let pid = lease.worker_pid();
    let members: Vec<u32> = procs::group_members(pid)
        .into_iter()
        .map(|(p, _)| p)
        .collect();
    assert!(members.contains(&pid), "{members:?}");
    for member in &members {
        let seen = exposure(*member, &[&key, PLACEHOLDER_API_KEY]);
        assert!(
            !seen.environ.contains(&0) && !seen.cmdline.contains(&0) && !seen.memory.contains(&0),
            "the key is in process {member}: {seen:?}"
        );
        if *member == pid {
            assert!(seen.memory_bytes > 10 << 20, "{seen:?}");
            assert!(
                seen.memory.contains(&1),
                "the scan did not find the placeholder the child holds: {seen:?}"
            );
        }
    }
    drop(lease);
    shutdown_leaves_nothing(&pool).await;

    // Nor in its home, its logs or anything else under the test's directory.
    let (hits, read) = files_containing(fx.scratch.path(), &key);
    assert!(hits.is_empty(), "the key is in {hits:?}");
    let (prompt, _) = files_containing(fx.scratch.path(), "guarded-hello");
    assert!(
        read > 0 && !prompt.is_empty(),
        "the walk found none of the session's files"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_body_over_the_limit_is_refused_before_any_upstream_call() {
    let fx = Fixture::new().await;
    let mut config = fx.config().await;
    // The runtime's first request (system prompt and all) is far above this.
    config.model_guard.max_request_body_bytes = 1024;
    let pool = Pool::start(config).await.expect("pool");
    let mut lease = pool
        .lease(fx.request("agent-b", "conv-b"))
        .await
        .expect("lease");
    match lease.run("REPLY=never").await {
        Err(PoolError::Turn(TurnError::Failed {
            status_code,
            message,
            ..
        })) => {
            assert_eq!(status_code, Some(413), "{message}");
        }
        other => panic!("the turn should fail with the runtime's 413: {other:?}"),
    }
    assert!(fx.model.requests().is_empty(), "the model was called");
    drop(lease);
    shutdown_leaves_nothing(&pool).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_provider_the_guard_refuses_fails_the_lease_before_any_process_starts() {
    let fx = Fixture::new().await;
    let mut config = fx.config().await;
    config.model_guard.allow_private_endpoints = false;
    let pool = Pool::start(config).await.expect("pool");
    for (base_url, says) in [
        // The scripted model itself: loopback and plain http need the switch.
        (fx.endpoint.base_url(), "allow_private_endpoints"),
        ("https://169.254.169.254/v1".to_owned(), "metadata"),
        ("https://10.0.0.1/v1".to_owned(), "allow_private_endpoints"),
        (
            "https://u:p@models.example/v1".to_owned(),
            "user name or password",
        ),
        (
            "https://models.example/v1?key=sk-1".to_owned(),
            "credential",
        ),
    ] {
        let mut req = fx.request("agent-r", "conv-r");
        req.provider = Some(ProviderConfig::openai(base_url.clone(), None));
        let error = pool.lease(req).await.expect_err(&base_url);
        assert_eq!(error.kind(), ErrorKind::Invalid, "{base_url}: {error}");
        assert!(error.to_string().contains(says), "{base_url}: {error}");
    }
    assert!(pool.status().await.expect("status").workers.is_empty());
    assert!(fx.model.requests().is_empty());
    shutdown_leaves_nothing(&pool).await;
}

/// The pool serves conversations one after the other through one guarded worker.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_conversations_with_one_provider_share_a_guarded_worker() {
    let fx = Fixture::new().await;
    let pool = Pool::start(fx.config().await).await.expect("pool");
    let mut first = pool
        .lease(fx.request("agent-s", "one"))
        .await
        .expect("lease");
    assert_eq!(first.run("REPLY=one").await.expect("turn").text, "one");
    let mut second = pool
        .lease(fx.request("agent-s", "two"))
        .await
        .expect("lease");
    assert_eq!(second.run("REPLY=two").await.expect("turn").text, "two");
    assert_eq!(first.worker_pid(), second.worker_pid());
    drop((first, second));
    tokio::time::timeout(Duration::from_secs(30), shutdown_leaves_nothing(&pool))
        .await
        .expect("shutdown");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_http_api_refuses_a_guarded_provider_with_a_400_and_creates_nothing() {
    let fx = Fixture::new().await;
    let mut config = fx.config().await;
    config.model_guard.allow_private_endpoints = false;
    let server = support::api::InProcess::start(config, Default::default()).await;
    for base_url in [
        fx.endpoint.base_url(),
        "https://169.254.169.254/v1".to_owned(),
        "https://[::ffff:10.0.0.1]/v1".to_owned(),
        "https://models.example/v1?api_key=sk-1".to_owned(),
    ] {
        let body = support::api::turn(&base_url, "agent-h", "conv-h", "REPLY=never");
        let answer = support::http::call(server.addr, "POST", "/v1/turns", None, Some(&body)).await;
        assert_eq!(answer.status, 400, "{base_url}: {}", answer.body);
        assert!(answer.body.contains("provider.base_url"), "{}", answer.body);
    }
    let work = copilot_pool::home::work_dir(&fx.scratch.path().join("agents"), "agent-h")
        .expect("work dir");
    assert!(!work.exists(), "{} was created", work.display());
    assert!(fx.model.requests().is_empty());
    server.stop().await;
}
