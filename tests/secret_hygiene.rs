//! Secret hygiene, searched everywhere a secret could surface: a real `copilot-pool serve`
//! child logging at TRACE level runs turns for three agents, each with its own fake but
//! distinctive GitHub token (explicit or gateway-resolved) and BYOK provider key, behind an
//! API token; then its log, `/metrics`, `/v1/pool`, a streamed turn, the error bodies of
//! refused requests, `/proc/<pid>/environ` and `cmdline` of every process under the daemon,
//! the bindings store, the transcripts and the agents' homes on disk, the `Debug` output of
//! the public types that hold secrets and the panic messages of unwrapped errors that carry
//! them are searched for every secret (whole, its random core alone, and base64).
//!
//! The SDK endpoint is searched the same way: an agent's connection token (the config holds
//! only its SHA-256) connects, runs a turn whose notifications are searched, and a refused
//! connect's error is searched too.
//!
//! A secret may appear in one place only: an agent's GitHub token in the environment of that
//! agent's own runtime process (and what it starts), which needs it. BYOK keys reach no child
//! at all (the guarded model path adds them to the model request itself), and neither the
//! API token nor an SDK connection token reaches any. Positive checks keep the search honest: each token is found in its own
//! child's environment, each key in the model's `authorization` header, and the log holds
//! TRACE lines.

mod support;

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::{Arc, Mutex};

use base64::Engine;
use copilot_pool::auth::LeaseAuth;
use copilot_pool::pool::LeaseRequest;
use copilot_pool::rpc::messages::{ConnectParams, HttpRequestStart, ProviderConfig};
use copilot_pool::scripted_model::ScriptedModel;
use copilot_pool::secret::Secret;
use copilot_pool::worker::WorkerConfig;
use serde_json::{Value, json};
use support::http::{Daemon, call};

/// One agent's credentials; every secret carries a random core of its own.
struct Agent {
    id: &'static str,
    token: String,
    key: String,
    /// The token comes as the gateway-resolved level (`resolved_token`), not `github_token`.
    resolved: bool,
}

/// A raw JSON-RPC connection to the SDK endpoint and the notifications it receives.
async fn sdk_connection(
    addr: std::net::SocketAddr,
) -> (
    copilot_pool::rpc::Connection,
    tokio::sync::mpsc::UnboundedReceiver<Value>,
) {
    use copilot_pool::rpc::{Connection, ConnectionOptions, Incoming};
    let stream = tokio::net::TcpStream::connect(addr)
        .await
        .expect("connect to the SDK endpoint");
    let (read, write) = stream.into_split();
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    let sink = move |incoming| {
        if let Incoming::Notification { params, .. } = incoming {
            let _ = tx.send(serde_json::from_str(params.get()).expect("JSON params"));
        }
    };
    let conn = Connection::start(read, write, ConnectionOptions::default(), Box::new(sink));
    (conn, rx)
}

/// Connects with `token`, creates a session with the BYOK `key`, runs one turn to its
/// `session.idle`; returns every answer and notification as text.
async fn sdk_turn(addr: std::net::SocketAddr, token: &str, model_url: &str, key: &str) -> String {
    let (conn, mut events) = sdk_connection(addr).await;
    let mut seen = Vec::new();
    let connected = conn
        .request("connect", json!({"token": token}), None)
        .await
        .expect("connect with the agent's token");
    seen.push(connected.to_string());
    let created = conn
        .request(
            "session.create",
            json!({
                "sessionId": "hyg-sdk",
                "model": ScriptedModel::MODEL_ID,
                "provider": {"type": "openai", "baseUrl": model_url, "apiKey": key},
            }),
            None,
        )
        .await
        .expect("session.create");
    seen.push(created.to_string());
    let sent = conn
        .request(
            "session.send",
            json!({"sessionId": "hyg-sdk", "prompt": "REPLY=through the endpoint"}),
            None,
        )
        .await
        .expect("session.send");
    seen.push(sent.to_string());
    let idle = async {
        while let Some(params) = events.recv().await {
            let done = params["event"]["type"] == "session.idle";
            seen.push(params.to_string());
            if done {
                return;
            }
        }
    };
    tokio::time::timeout(std::time::Duration::from_secs(60), idle)
        .await
        .expect("the SDK turn ends idle");
    seen.join("\n")
}

/// The error a connect with a wrong `token` gets, as text.
async fn sdk_connect_error(addr: std::net::SocketAddr, token: &str) -> String {
    let (conn, _events) = sdk_connection(addr).await;
    match conn.request("connect", json!({"token": token}), None).await {
        Ok(answer) => panic!("a wrong token connected: {answer}"),
        Err(error) => format!("{error} {error:?}"),
    }
}

/// A fake secret `<prefix><random hex>`: the hex core alone is searched too, so a secret
/// printed cut short is still found.
fn fake_secret(prefix: &str) -> (String, String) {
    let core = uuid::Uuid::new_v4().simple().to_string();
    (format!("{prefix}{core}"), core)
}

/// Every form a secret is searched in, with its name for the message.
struct Needles(Vec<(String, String)>);

impl Needles {
    fn add(&mut self, name: &str, secret: &str, core: &str) {
        let b64 = base64::engine::general_purpose::STANDARD.encode(secret);
        self.0.push((name.to_owned(), secret.to_owned()));
        self.0.push((format!("{name} (core)"), core.to_owned()));
        self.0.push((format!("{name} (base64)"), b64));
    }

    /// The names of the secrets found in `haystack`, except those in `allowed`.
    fn found(&self, haystack: &str, allowed: &[&str]) -> Vec<String> {
        self.0
            .iter()
            .filter(|(name, _)| !allowed.iter().any(|a| name.starts_with(a)))
            .filter(|(_, needle)| haystack.contains(needle.as_str()))
            .map(|(name, _)| name.clone())
            .collect()
    }
}

/// What was searched and what was found where.
#[derive(Default)]
struct Findings {
    places: usize,
    leaks: Vec<String>,
}

impl Findings {
    fn search(&mut self, needles: &Needles, place: &str, text: &str, allowed: &[&str]) {
        self.places += 1;
        for name in needles.found(text, allowed) {
            self.leaks.push(format!("{name} in {place}"));
        }
    }
}

/// Every regular file under `dir`, with its contents (lossy text).
fn files_under(dir: &Path) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(at) = stack.pop() {
        let Ok(entries) = std::fs::read_dir(&at) else {
            continue;
        };
        for entry in entries.flatten() {
            let path = entry.path();
            let Ok(kind) = entry.file_type() else {
                continue;
            };
            if kind.is_dir() {
                stack.push(path);
            } else if kind.is_file() {
                let bytes = std::fs::read(&path).unwrap_or_default();
                out.push((
                    path.display().to_string(),
                    String::from_utf8_lossy(&bytes).into_owned(),
                ));
            }
        }
    }
    out
}

/// The message of the panic `f` raises, caught (with the default hook silenced for it).
fn panic_message(f: impl FnOnce() + std::panic::UnwindSafe) -> String {
    let seen = Arc::new(Mutex::new(String::new()));
    let keep = seen.clone();
    let previous = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        if let Ok(mut text) = keep.lock() {
            *text = info.to_string();
        }
    }));
    let outcome = std::panic::catch_unwind(f);
    std::panic::set_hook(previous);
    assert!(outcome.is_err(), "the closure was meant to panic");
    let text = seen.lock().expect("panic text").clone();
    assert!(!text.is_empty(), "the panic hook saw no message");
    text
}

fn turn_body(model_url: &str, agent: &Agent, key: &str, prompt: &str) -> Value {
    let mut body = json!({
        "agent_id": agent.id,
        "session_key": key,
        "prompt": prompt,
        "model": ScriptedModel::MODEL_ID,
        "provider": {"type": "openai", "base_url": model_url, "api_key": agent.key},
    });
    body["auth"] = if agent.resolved {
        json!({"resolved_token": agent.token, "auth_profile_id": format!("profile-{}", agent.id)})
    } else {
        json!({"github_token": agent.token, "profile_id": format!("profile-{}", agent.id), "profile_version": "v1"})
    };
    body
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_secret_surfaces_anywhere_but_its_own_childs_environment() {
    let scratch = support::Scratch::new();
    let model = ScriptedModel::new();
    let endpoint = model.serve_http().await.expect("model");
    let model_url = endpoint.base_url();

    let mut needles = Needles(Vec::new());
    let (api_token, api_core) = fake_secret("cpt_HYGIENE_api_token_");
    needles.add("the API token", &api_token, &api_core);
    let (sdk_token, sdk_core) = fake_secret("cps_HYGIENE_sdk_token_");
    needles.add("the SDK connection token", &sdk_token, &sdk_core);
    let mut agents = Vec::new();
    for (i, id) in ["hyg-a", "hyg-b", "hyg-c"].into_iter().enumerate() {
        let (token, token_core) = fake_secret(&format!("ghu_HYGIENE_{}_token_", i));
        let (key, key_core) = fake_secret(&format!("sk-HYGIENE-{}-key-", i));
        needles.add(&format!("token of {id}"), &token, &token_core);
        needles.add(&format!("key of {id}"), &key, &key_core);
        agents.push(Agent {
            id,
            token,
            key,
            resolved: i == 2,
        });
    }
    let mut findings = Findings::default();

    // The daemon, its log at TRACE level into a file.
    let transcripts = scratch.path().join("transcripts");
    let sdk_sha256 = {
        use sha2::Digest;
        let digest = sha2::Sha256::digest(sdk_token.as_bytes());
        digest
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect::<String>()
    };
    let config = format!(
        "[turns]\ntranscript_dir = \"{}\"\n\n[sdk]\nlisten = \"127.0.0.1:0\"\n[[sdk.tokens]]\nagent = \"hyg-a\"\nsha256 = \"{sdk_sha256}\"\n",
        transcripts.display()
    );
    let log_path = scratch.path().join("serve.log");
    let log = std::fs::File::create(&log_path).expect("log file");
    let daemon = Daemon::start_logged(
        scratch.path(),
        &config,
        &[
            ("COPILOT_POOL_LOG", "trace"),
            ("COPILOT_POOL_API_TOKEN", api_token.as_str()),
        ],
        log,
    )
    .await;
    let addr = daemon.addr;
    let bearer = Some(api_token.as_str());

    // A turn per agent, each on a process of its own (its own token), twice for the first so
    // a conversation resumes; one streamed, so its events are searched too.
    for agent in &agents {
        let body = turn_body(&model_url, agent, "conv-1", "REPLY=hello");
        let answer = call(addr, "POST", "/v1/turns?stream=false", bearer, Some(&body)).await;
        assert_eq!(answer.status, 200, "{}", answer.body);
        findings.search(
            &needles,
            &format!("the turn answer of {}", agent.id),
            &answer.body,
            &[],
        );
    }
    let body = turn_body(&model_url, &agents[0], "conv-1", "REPLY=again");
    let stream = call(addr, "POST", "/v1/turns", bearer, Some(&body)).await;
    assert_eq!(stream.status, 200, "{}", stream.body);
    assert!(stream.body.contains("turn.end"), "{}", stream.body);
    findings.search(&needles, "a streamed turn", &stream.body, &[]);

    // A turn through the SDK endpoint, as an official SDK attached by URL runs it; and a
    // connect with a wrong token (another agent's GitHub token), refused.
    let sdk_addr: std::net::SocketAddr = daemon
        .sdk_addr
        .as_deref()
        .and_then(|a| a.parse().ok())
        .expect("serve printed its SDK endpoint's address");
    let sdk_seen = sdk_turn(sdk_addr, &sdk_token, &model_url, &agents[0].key).await;
    assert!(sdk_seen.contains("session.idle"), "{sdk_seen}");
    findings.search(&needles, "the SDK endpoint's turn", &sdk_seen, &[]);
    let refused_connect = sdk_connect_error(sdk_addr, &agents[1].token).await;
    findings.search(
        &needles,
        "the SDK endpoint's refused connect",
        &refused_connect,
        &[],
    );

    // Refused requests: their error bodies.
    let a = &agents[0];
    let mut refused = Vec::new();
    let wrong_token = call(addr, "GET", "/v1/pool", Some(a.token.as_str()), None).await;
    assert_eq!(wrong_token.status, 401, "{}", wrong_token.body);
    refused.push(("a request with an agent's token as API token", wrong_token));
    let mut no_profile = turn_body(&model_url, a, "conv-2", "REPLY=x");
    no_profile["auth"] = json!({"github_token": a.token});
    refused.push((
        "a token without its profile",
        call(
            addr,
            "POST",
            "/v1/turns?stream=false",
            bearer,
            Some(&no_profile),
        )
        .await,
    ));
    let mut metadata = turn_body(&model_url, a, "conv-3", "REPLY=x");
    metadata["provider"]["base_url"] = json!("http://169.254.169.254/latest");
    refused.push((
        "a provider on the metadata address",
        call(
            addr,
            "POST",
            "/v1/turns?stream=false",
            bearer,
            Some(&metadata),
        )
        .await,
    ));
    let mut bad_agent = turn_body(&model_url, a, "conv-4", "REPLY=x");
    bad_agent["agent_id"] = json!("Not An Agent!");
    refused.push((
        "an invalid agent id",
        call(
            addr,
            "POST",
            "/v1/turns?stream=false",
            bearer,
            Some(&bad_agent),
        )
        .await,
    ));
    let mut bad_limit = turn_body(&model_url, a, "conv-5", "REPLY=x");
    bad_limit["provider"]["max_output_tokens"] = json!(-1);
    refused.push((
        "a negative token limit",
        call(
            addr,
            "POST",
            "/v1/turns?stream=false",
            bearer,
            Some(&bad_limit),
        )
        .await,
    ));
    let mut outside = turn_body(&model_url, a, "conv-6", "REPLY=x");
    outside["session"] = json!({"workingDirectory": "/etc"});
    refused.push((
        "a working directory outside the roots",
        call(
            addr,
            "POST",
            "/v1/turns?stream=false",
            bearer,
            Some(&outside),
        )
        .await,
    ));
    let mut unknown = turn_body(&model_url, a, "conv-7", "REPLY=x");
    unknown["api_key"] = json!(a.key);
    refused.push((
        "an unknown field holding a key",
        call(
            addr,
            "POST",
            "/v1/turns?stream=false",
            bearer,
            Some(&unknown),
        )
        .await,
    ));
    // A secret where an object belongs: serde's message names the value it found.
    for (what, field, value) in [
        ("a token given as the auth object", "auth", json!(a.token)),
        ("a key given as the provider", "provider", json!(a.key)),
    ] {
        let mut wrong = turn_body(&model_url, a, "conv-8", "REPLY=x");
        wrong[field] = value;
        let answer = call(addr, "POST", "/v1/turns?stream=false", bearer, Some(&wrong)).await;
        refused.push((what, answer));
    }
    let mut unparsable = turn_body(&model_url, a, "conv-9", "REPLY=x");
    unparsable["provider"]["base_url"] = json!(format!("https://[::1/v1?api-key={}", a.key));
    refused.push((
        "a key in a base URL that does not parse",
        call(
            addr,
            "POST",
            "/v1/turns?stream=false",
            bearer,
            Some(&unparsable),
        )
        .await,
    ));
    for (what, answer) in &refused {
        assert!(
            (400..500).contains(&answer.status),
            "{what}: expected a refusal, got {} {}",
            answer.status,
            answer.body
        );
        findings.search(
            &needles,
            &format!("the error body of {what}"),
            &answer.body,
            &[],
        );
    }

    // What the daemon reports.
    let pool = call(addr, "GET", "/v1/pool", bearer, None).await;
    assert_eq!(pool.status, 200, "{}", pool.body);
    findings.search(&needles, "/v1/pool", &pool.body, &[]);
    let metrics = call(addr, "GET", "/metrics", bearer, None).await;
    assert_eq!(metrics.status, 200, "{}", metrics.body);
    assert!(metrics.body.contains("copilot_pool_"), "{}", metrics.body);
    findings.search(&needles, "/metrics", &metrics.body, &[]);

    // Every process under the daemon, while the workers are alive.
    let children = support::procs::descendants(daemon.pid());
    assert!(
        children.len() >= agents.len(),
        "expected a runtime process per agent under the daemon, found {children:?}"
    );
    let mut holds_own_token: BTreeMap<&str, usize> = BTreeMap::new();
    for pid in &children {
        let environ = std::fs::read(format!("/proc/{pid}/environ")).unwrap_or_default();
        let environ = String::from_utf8_lossy(&environ).replace('\0', "\n");
        let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
        let cmdline = String::from_utf8_lossy(&cmdline).replace('\0', " ");
        // Whose process this is: its COPILOT_HOME lies in that agent's home.
        let owner = agents.iter().find(|agent| {
            environ
                .lines()
                .any(|l| l.starts_with("COPILOT_HOME=") && l.contains(&format!("/{}/", agent.id)))
        });
        let own = owner.map(|agent| format!("token of {}", agent.id));
        let allowed: Vec<&str> = own.iter().map(String::as_str).collect();
        findings.search(
            &needles,
            &format!("/proc/{pid}/environ ({cmdline})"),
            &environ,
            &allowed,
        );
        findings.search(&needles, &format!("/proc/{pid}/cmdline"), &cmdline, &[]);
        if let Some(agent) = owner
            && environ.contains(&agent.token)
        {
            *holds_own_token.entry(agent.id).or_default() += 1;
        }
    }
    for agent in &agents {
        assert!(
            holds_own_token.contains_key(agent.id),
            "no process of {} holds its own token: the environment search reads the wrong \
             processes ({children:?})",
            agent.id
        );
    }

    // Each key went where it belongs: on the model request, added by the daemon's guard.
    let requests = model.requests();
    for agent in &agents {
        let bearer = format!("Bearer {}", agent.key);
        assert!(
            requests
                .iter()
                .any(|r| r.header("authorization").contains(&bearer.as_str())),
            "the key of {} never reached the model",
            agent.id
        );
    }

    let status = daemon.terminate().await;
    assert!(status.success(), "serve exited with {status}");

    // The log, at TRACE level.
    let log = std::fs::read_to_string(&log_path).expect("the daemon's log");
    assert!(
        log.contains("TRACE") && log.len() > 10_000,
        "expected a TRACE-level log, got {} bytes",
        log.len()
    );
    findings.search(&needles, "the daemon's log", &log, &[]);

    // On disk: the bindings, the transcripts, the agents' homes and everything else under
    // the daemon's directories (a token may sit only in its own agent's home, where its
    // runtime keeps its state; the daemon's log was searched above, as a whole).
    let files = files_under(scratch.path());
    let transcripts_prefix = transcripts.display().to_string();
    assert!(
        files
            .iter()
            .any(|(path, _)| path.starts_with(&transcripts_prefix)),
        "no transcript was written"
    );
    assert!(
        files.iter().any(|(path, _)| path.contains("/bindings/")),
        "no binding was written"
    );
    for (path, text) in &files {
        if Path::new(path) == log_path {
            continue;
        }
        let owner = agents
            .iter()
            .find(|agent| path.contains(&format!("/agents/{}/", agent.id)));
        let own = owner.map(|agent| format!("token of {}", agent.id));
        let allowed: Vec<&str> = own.iter().map(String::as_str).collect();
        findings.search(&needles, path, text, &allowed);
    }

    // Debug of the public types that hold secrets, filled with every one of them.
    let token = Secret::new(agents[0].token.clone());
    let key = Secret::new(agents[0].key.clone());
    let mut provider = ProviderConfig::openai(model_url.clone(), Some(key.clone()));
    provider.bearer_token = Some(Secret::new(agents[1].key.clone()));
    let env: BTreeMap<String, Secret> =
        [("GH_TOKEN".to_owned(), Secret::new(agents[2].token.clone()))].into();
    let auth = LeaseAuth {
        github_token: Some(token.clone()),
        profile_id: Some("p".into()),
        profile_version: Some("v".into()),
        resolved_api_key: Some(Secret::new(agents[1].token.clone())),
        auth_profile_id: Some("q".into()),
        env: env.clone(),
        ..Default::default()
    };
    let mut request = LeaseRequest::new("hyg-a", "conv", scratch.work());
    request.provider = Some(provider.clone());
    request.auth = auth.clone();
    let mut worker = WorkerConfig::new("/bin/true".into(), "".into(), "".into());
    worker.auth_token = Some(token.clone());
    let mut api = copilot_pool::http::ApiConfig::default();
    api.api_token = Some(Secret::new(api_token.clone()));
    api.env_tokens = env.clone();
    let resolved = copilot_pool::auth::resolve(&auth).expect("resolves");
    let start: HttpRequestStart = serde_json::from_value(json!({
        "requestId": "r", "method": "POST", "url": model_url,
        "headers": {"authorization": [format!("Bearer {}", agents[0].key)],
                    "x-api-key": [agents[1].key.clone()]},
    }))
    .expect("a request start");
    let connect: ConnectParams =
        serde_json::from_value(json!({"token": api_token})).expect("connect params");
    let mut tokens = copilot_pool::sdk_endpoint::AgentTokens::default();
    tokens.add_token("hyg-a", &token).expect("sdk token");
    let debug = [
        format!("{token:?} {token:#?}"),
        format!("{provider:?} {provider:#?}"),
        format!("{auth:?} {auth:#?}"),
        format!("{request:?} {request:#?}"),
        format!("{worker:?} {worker:#?}"),
        format!("{api:?} {api:#?}"),
        format!("{resolved:?} {resolved:#?}"),
        format!("{start:?} {start:#?}"),
        format!("{connect:?} {connect:#?}"),
        format!("{tokens:?} {tokens:#?}"),
    ];
    for text in &debug {
        findings.search(&needles, &format!("Debug output {text}"), text, &[]);
    }

    // Panics of a caller that unwraps the library's errors about secrets.
    let mut no_profile = auth.clone();
    no_profile.profile_id = None;
    no_profile.resolved_api_key = None;
    let panics = [
        panic_message(move || {
            copilot_pool::auth::resolve(&no_profile).unwrap();
        }),
        panic_message({
            let mut provider = provider.clone();
            provider.base_url = "ftp://nowhere".into();
            move || copilot_pool::pool::validate_provider(&provider).unwrap()
        }),
        panic_message(move || {
            let mut tokens = copilot_pool::sdk_endpoint::AgentTokens::default();
            tokens.add_token("Not An Agent!", &key).unwrap();
        }),
    ];
    for text in &panics {
        findings.search(&needles, &format!("a panic message ({text})"), text, &[]);
    }

    assert!(
        findings.places > 30,
        "searched only {} places",
        findings.places
    );
    assert!(
        findings.leaks.is_empty(),
        "{} secrets found in the {} places searched:\n{}",
        findings.leaks.len(),
        findings.places,
        findings.leaks.join("\n")
    );
    println!(
        "secret hygiene: {} needles searched in {} places ({} processes, {} log bytes): 0 found",
        needles.0.len(),
        findings.places,
        children.len(),
        log.len()
    );
}
