//! The SDK endpoint (`copilot_pool::sdk_endpoint`) over a real pool of runtime processes on
//! the scripted model, served on loopback: its handshake checked with the crate's own
//! JSON-RPC client, and the official Node SDK (`@github/copilot-sdk`, installed by the test
//! support) attached by URL running the scenarios of `tests/support/sdk_client.mjs`, and the
//! official Python SDK (`github-copilot-sdk`, installed the same way) running
//! `tests/support/sdk_client.py`.

mod support;

use std::path::Path;
use std::process::Stdio;
use std::time::{Duration, Instant};

use bytes::{BufMut, Bytes, BytesMut};
use copilot_pool::Pool;
use copilot_pool::rpc::FrameCodec;
use copilot_pool::rpc::connection::{Connection, ConnectionOptions, ErrorObject, RpcError};
use copilot_pool::scripted_model::ScriptedModel;
use copilot_pool::sdk_endpoint::{self, AgentTokens, SdkConfig, SdkEndpoint};
use copilot_pool::secret::Secret;
use serde_json::{Value, json};
use support::hook_files::PlantedHooks;
use support::pool_fixture::Fixture;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpStream;
use tokio::sync::watch;
use tokio_util::codec::{Decoder, Encoder};

/// Bound of one Node scenario (a failure guard, not a wait).
const SCENARIO_LIMIT: Duration = Duration::from_secs(180);

struct Served {
    pool: Pool,
    endpoint: SdkEndpoint,
    addr: std::net::SocketAddr,
    stop: watch::Sender<bool>,
    server: tokio::task::JoinHandle<()>,
}

impl Served {
    async fn start(fx: &Fixture) -> Served {
        Served::start_with(fx, |_| {}).await
    }

    async fn start_with(
        fx: &Fixture,
        change: impl FnOnce(&mut copilot_pool::PoolConfig),
    ) -> Served {
        Served::start_with_endpoint(fx, change, |_| {}).await
    }

    /// An endpoint (agent-a's token `token-a`, agent-b's `token-b`) over a pool, each
    /// config changed first.
    async fn start_with_endpoint(
        fx: &Fixture,
        change: impl FnOnce(&mut copilot_pool::PoolConfig),
        change_endpoint: impl FnOnce(&mut SdkConfig),
    ) -> Served {
        let mut config = fx.config().await;
        change(&mut config);
        let pool = Pool::start(config).await.expect("pool");
        let mut tokens = AgentTokens::new();
        tokens
            .add_token("agent-a", &Secret::new("token-a"))
            .expect("token a");
        tokens
            .add_hash("agent-b", &sdk_endpoint::sha256_hex("token-b"))
            .expect("token b");
        let mut sdk_config = SdkConfig::new(tokens);
        change_endpoint(&mut sdk_config);
        let endpoint = SdkEndpoint::new(pool.clone(), sdk_config);
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr = listener.local_addr().expect("addr");
        let (stop, mut stopped) = watch::channel(false);
        let served = endpoint.clone();
        let server = tokio::spawn(async move {
            sdk_endpoint::serve_tcp(&served, listener, async move {
                let _ = stopped.wait_for(|s| *s).await;
            })
            .await;
        });
        Served {
            pool,
            endpoint,
            addr,
            stop,
            server,
        }
    }

    /// Stops the listener and the pool, and checks that no process of the pool is left.
    async fn shut_down(self) {
        let pids: Vec<u32> = self
            .pool
            .status()
            .await
            .map(|s| s.workers.iter().map(|w| w.pid).collect())
            .unwrap_or_default();
        self.stop.send_replace(true);
        tokio::time::timeout(Duration::from_secs(20), self.server)
            .await
            .expect("the listener stops with its connections")
            .expect("listener task");
        self.pool.shutdown().await.expect("shutdown");
        for pid in pids {
            let left = support::procs::wait_group_gone(pid, Duration::from_secs(10)).await;
            assert!(left.is_empty(), "processes left in group {pid}: {left:?}");
        }
    }
}

/// A raw JSON-RPC client on the endpoint (the crate's own connection).
async fn raw_client(addr: std::net::SocketAddr) -> Connection {
    let stream = TcpStream::connect(addr).await.expect("connect");
    let (read, write) = stream.into_split();
    Connection::start(read, write, ConnectionOptions::default(), Box::new(|_| {}))
}

/// The error of a `session.create` of session `id` with `field` set to `value`.
async fn create_refused(
    conn: &Connection,
    fx: &Fixture,
    id: &str,
    field: &str,
    value: Value,
) -> ErrorObject {
    let mut params = create_params(fx, id);
    params[field] = value;
    remote_error(conn.request("session.create", params, None).await)
}

fn remote_error(result: Result<Value, RpcError>) -> ErrorObject {
    match result {
        Err(RpcError::Remote { error, .. }) => error,
        other => panic!("expected an error answer, got {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_before_connect_is_minus_32001_and_a_wrong_token_minus_32002_each_closing_the_connection()
 {
    let fx = Fixture::new().await;
    let served = Served::start(&fx).await;
    // Any call first is answered -32001, and the connection is closed (one answer for a
    // client that has not authenticated, however many calls it sends).
    for method in ["ping", "session.create"] {
        let conn = raw_client(served.addr).await;
        let early = remote_error(conn.request(method, json!({"sessionId": "s"}), None).await);
        assert_eq!(early.code, -32001, "{early:?}");
        let after = conn
            .request("connect", json!({"token": "token-a"}), None)
            .await;
        assert!(matches!(after, Err(RpcError::Closed { .. })), "{after:?}");
    }
    let conn = raw_client(served.addr).await;
    let wrong = remote_error(
        conn.request("connect", json!({"token": "token-c"}), None)
            .await,
    );
    assert_eq!(wrong.code, -32002, "{wrong:?}");
    assert!(wrong.message.contains("sha256") || wrong.message.contains("SHA-256"));
    // A connection that failed to authenticate is closed.
    let after = conn.request("ping", json!({}), None).await;
    assert!(matches!(after, Err(RpcError::Closed { .. })), "{after:?}");
    let missing = raw_client(served.addr).await;
    let none = remote_error(missing.request("connect", json!({}), None).await);
    assert_eq!(none.code, -32002, "{none:?}");
    // Told it gave none, and how the SDKs pass one (not that a token was wrong).
    assert!(
        none.message.contains("no connection token") && none.message.contains("connectionToken"),
        "{}",
        none.message
    );
    // Before `connect` a frame over 64 KiB closes the connection unread; after it, the same
    // frame is read (and answered).
    let big = json!({"message": "x".repeat(100 * 1024)});
    let early = raw_client(served.addr).await;
    let refused = early.request("ping", big.clone(), None).await;
    assert!(
        matches!(refused, Err(RpcError::Closed { .. })),
        "{refused:?}"
    );
    let late = raw_client(served.addr).await;
    late.request("connect", json!({"token": "token-a"}), None)
        .await
        .expect("connect");
    let pong = late.request("ping", big, None).await.expect("ping");
    assert!(
        pong["message"]
            .as_str()
            .is_some_and(|m| m.len() > 100 * 1024)
    );
    served.shut_down().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_over_the_connection_cap_is_told_why_before_it_is_closed() {
    let fx = Fixture::new().await;
    let served = Served::start_with_endpoint(
        &fx,
        |_| {},
        |config| {
            config.max_connections = 1;
        },
    )
    .await;
    let inside = raw_client(served.addr).await;
    inside
        .request("connect", json!({"token": "token-a"}), None)
        .await
        .expect("the first client gets in");
    let over = raw_client(served.addr).await;
    let refused = remote_error(
        over.request("connect", json!({"token": "token-a"}), None)
            .await,
    );
    assert_eq!(
        refused.code,
        sdk_endpoint::TOO_MANY_CONNECTIONS,
        "{refused:?}"
    );
    assert!(
        refused.message.contains("max_connections (1)"),
        "{}",
        refused.message
    );
    // And it is closed: nothing more is read from it.
    let closed = over.request("ping", json!({}), None).await;
    assert!(matches!(closed, Err(RpcError::Closed { .. })), "{closed:?}");
    inside.request("ping", json!({}), None).await.expect("ping");

    // A connection still being refused (it has 2 s to send its first request) when the
    // endpoint stops is closed before the stop returns, not left to its time limit.
    let mut waiting = TcpStream::connect(served.addr).await.expect("connect");
    // The listener takes connections in order: once a later one's refusal is answered, the
    // waiting one is being refused.
    let later = raw_client(served.addr).await;
    let refused = remote_error(
        later
            .request("connect", json!({"token": "token-a"}), None)
            .await,
    );
    assert_eq!(
        refused.code,
        sdk_endpoint::TOO_MANY_CONNECTIONS,
        "{refused:?}"
    );
    let Served {
        pool, stop, server, ..
    } = served;
    stop.send_replace(true);
    tokio::time::timeout(Duration::from_secs(20), server)
        .await
        .expect("the listener stops with its connections")
        .expect("listener task");
    // Closed already: its end of stream is there within a second (half its time limit).
    let mut rest = Vec::new();
    let read = tokio::time::timeout(Duration::from_secs(1), waiting.read_to_end(&mut rest)).await;
    assert!(
        matches!(read, Ok(Ok(0))),
        "the refused connection outlived the stop: {read:?}"
    );
    pool.shutdown().await.expect("shutdown");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clients_that_never_authenticate_make_way_for_new_ones_and_cannot_keep_the_agents_out() {
    let fx = Fixture::new().await;
    let served = Served::start_with_endpoint(
        &fx,
        |_| {},
        |config| {
            config.max_connections = 8;
            config.max_unauthenticated_connections = 2;
        },
    )
    .await;
    let addr = served.addr;
    // Two clients wait without authenticating; a third takes the oldest one's slot, and the
    // oldest is closed.
    let first = raw_client(addr).await;
    let second = raw_client(addr).await;
    let third = raw_client(addr).await;
    third
        .request("connect", json!({"token": "token-a"}), None)
        .await
        .expect("the newest client gets in");
    let closed = first
        .request("connect", json!({"token": "token-a"}), None)
        .await;
    assert!(matches!(closed, Err(RpcError::Closed { .. })), "{closed:?}");
    // Clients that are gone (a wrong token, a client that left) never keep two new ones from
    // getting in (their slots are given back as they close, or taken first).
    let wrong = remote_error(
        second
            .request("connect", json!({"token": "nope"}), None)
            .await,
    );
    assert_eq!(wrong.code, -32002, "{wrong:?}");
    let leaving = raw_client(addr).await;
    drop(leaving);
    let fourth = raw_client(addr).await;
    let fifth = raw_client(addr).await;
    for client in [&fourth, &fifth] {
        client
            .request("connect", json!({"token": "token-a"}), None)
            .await
            .expect("a slot was free");
    }
    third.request("ping", json!({}), None).await.expect("ping");

    // A client made way for is let go of even though it never closes its side: its socket
    // is closed, so what it goes on sending fails (a reader left running would keep taking
    // it, and the socket would outlive the connection's slot).
    let mut silent = TcpStream::connect(addr).await.expect("connect");
    let _newer = raw_client(addr).await;
    let _newest = raw_client(addr).await;
    let mut rest = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), silent.read_to_end(&mut rest))
        .await
        .expect("the oldest waiting client is closed")
        .expect("read to the end");
    let ping = frame(r#"{"jsonrpc":"2.0","id":1,"method":"ping","params":{}}"#);
    let sending = async {
        loop {
            silent.write_all(&ping).await?;
            tokio::task::yield_now().await;
        }
    };
    let sent: Result<std::io::Result<()>, _> =
        tokio::time::timeout(Duration::from_secs(5), sending).await;
    assert!(
        matches!(sent, Ok(Err(_))),
        "the closed client's frames were still read: {sent:?}"
    );
    served.shut_down().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_agents_clients_cannot_take_more_than_its_share_of_connections() {
    let fx = Fixture::new().await;
    let served =
        Served::start_with_endpoint(&fx, |_| {}, |config| config.max_connections_per_agent = 2)
            .await;
    let addr = served.addr;
    let connect = |token: &'static str| async move {
        let client = raw_client(addr).await;
        let answer = client
            .request("connect", json!({"token": token}), None)
            .await;
        (client, answer)
    };
    let (first, answer) = connect("token-a").await;
    answer.expect("agent-a's first client");
    let (second, answer) = connect("token-a").await;
    answer.expect("agent-a's second client");
    let (third, answer) = connect("token-a").await;
    let refused = remote_error(answer);
    assert_eq!(
        refused.code,
        sdk_endpoint::TOO_MANY_CONNECTIONS,
        "{refused:?}"
    );
    assert!(
        refused.message.contains("max_connections_per_agent"),
        "the refusal names the setting: {refused:?}"
    );
    let closed = third.request("ping", json!({}), None).await;
    assert!(matches!(closed, Err(RpcError::Closed { .. })), "{closed:?}");
    // The other agent has room of its own, and agent-a's clients go on.
    let (_b, answer) = connect("token-b").await;
    answer.expect("agent-b's client");
    second
        .request("ping", json!({}), None)
        .await
        .expect("agent-a's open clients go on");
    // A client that leaves gives its seat back (once the endpoint has seen it go).
    drop(first);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        let (_again, answer) = connect("token-a").await;
        match answer {
            Ok(_) => break,
            Err(error) => assert!(
                tokio::time::Instant::now() < deadline,
                "the seat was never given back: {error:?}"
            ),
        }
    }
    served.shut_down().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connect_ping_and_status_answer_protocol_3_and_the_pools_version() {
    let fx = Fixture::new().await;
    let served = Served::start(&fx).await;
    let conn = raw_client(served.addr).await;
    let connected = conn
        .request("connect", json!({"token": "token-b"}), None)
        .await
        .expect("connect");
    let version = env!("CARGO_PKG_VERSION");
    assert_eq!(connected["ok"], true);
    // Connected again with another agent's token or with none of this daemon's: one answer,
    // so a client never learns which strings are some agent's token.
    let mut refusals = Vec::new();
    for token in ["token-a", "not-a-token"] {
        let refused = conn.request("connect", json!({"token": token}), None).await;
        refusals.push(remote_error(refused).message);
    }
    assert_eq!(refusals[0], refusals[1], "{refusals:?}");
    assert!(
        refusals[0].contains("AUTHENTICATION_FAILED"),
        "{refusals:?}"
    );
    assert_eq!(connected["protocolVersion"], 3);
    assert_eq!(connected["version"], version);
    let ping = conn
        .request("ping", json!({"message": "hi"}), None)
        .await
        .expect("ping");
    assert_eq!(
        (ping["message"].as_str(), ping["protocolVersion"].as_u64()),
        (Some("pong: hi"), Some(3))
    );
    let status = conn
        .request("status.get", json!({}), None)
        .await
        .expect("status");
    assert_eq!(status, json!({"version": version, "protocolVersion": 3}));
    // A session this connection never opened is unknown to it, as to the runtime.
    let unknown = remote_error(
        conn.request(
            "session.send",
            json!({"sessionId": "nope", "prompt": "x"}),
            None,
        )
        .await,
    );
    assert!(unknown.message.contains("Session not found"), "{unknown:?}");
    // Calls that would change a process other clients share are refused.
    let shared = remote_error(conn.request("runtime.shutdown", json!({}), None).await);
    assert!(shared.message.contains("other clients share"), "{shared:?}");
    served.shut_down().await;
}

#[tokio::test]
async fn an_sdk_client_cannot_reach_around_the_guard_or_into_the_agents_home() {
    let fx = Fixture::new().await;
    let allowed = fx.scratch.path().join("repos/project");
    std::fs::create_dir_all(&allowed).expect("repos");
    let roots = vec![fx.scratch.path().join("repos")];
    let served =
        Served::start_with_endpoint(&fx, |_| {}, move |config| config.allowed_work_roots = roots)
            .await;
    let conn = raw_client(served.addr).await;
    conn.request("connect", json!({"token": "token-a"}), None)
        .await
        .expect("connect");
    // Providers and endpoints besides the session's one guarded provider are refused at
    // create, before any process starts.
    for (field, value) in [
        (
            "providers",
            json!([{"id": "p", "type": "openai", "baseUrl": "https://10.0.0.7/v1", "apiKey": "real"}]),
        ),
        ("capi", json!({"url": "https://10.0.0.7"})),
        ("copilotUrl", json!("https://10.0.0.7")),
        ("hasBearerTokenProvider", json!(true)),
        ("configDir", json!("/tmp")),
        ("gitHubTokenProviderRegistrationId", json!("registration-1")),
        (
            "authInfo",
            json!({"type": "token", "host": "https://github.com", "token": "other"}),
        ),
        ("manageScheduleEnabled", json!(true)),
        // Code from the daemon's host, and a field no SDK sends (which may reach past the
        // agent's directories: the runtime takes more than the SDKs offer).
        ("extensionSdkPath", json!("/opt/copilot-sdk")),
        (
            "shell",
            json!({"initScripts": [{"path": "/etc/profile", "shell": "bash"}]}),
        ),
        ("agentContext", json!("from elsewhere")),
        // Turns run or steered outside the pool; the runtime's own sandbox settings.
        ("cloud", json!({"repository": {"owner": "o", "name": "r"}})),
        ("remoteSession", json!("on")),
        ("sandboxConfig", json!({"auth": {"git": true}})),
    ] {
        let refused = create_refused(&conn, &fx, "guarded-1", field, value).await;
        assert!(
            refused.message.contains(field) && refused.message.contains("copilot-pool"),
            "{field}: {refused:?}"
        );
    }
    // A local MCP server is refused as over HTTP (the daemon's allow_local_mcp_servers).
    let local = json!({"local": {"command": "/bin/sh", "args": ["-c", "true"]}});
    let refused = create_refused(&conn, &fx, "guarded-1", "mcpServers", local).await;
    assert!(
        refused.message.contains("mcpServers.local")
            && refused.message.contains("allow_local_mcp_servers"),
        "{refused:?}"
    );
    // So are hooks, discovered configuration, plugins and custom agent files, which run
    // commands from files (a plugin or an agent file may bring hooks or a local MCP server).
    for (field, value) in [
        ("enableFileHooks", json!(true)),
        ("enableConfigDiscovery", json!(true)),
        ("hookDirectories", json!([allowed.display().to_string()])),
        ("pluginDirectories", json!([allowed.display().to_string()])),
        ("agentDirectories", json!([allowed.display().to_string()])),
    ] {
        let refused = create_refused(&conn, &fx, "guarded-1", field, value).await;
        assert!(
            refused.message.contains(field) && refused.message.contains("allow_local_mcp_servers"),
            "{field}: {refused:?}"
        );
    }
    // Directories outside the agent's work directory and the allowed roots are refused, as
    // over HTTP (another agent's directory among them: `..` and symlinks resolved first).
    let another_agents = fx.scratch.path().join("agents/agents/agent-b");
    for (field, value) in [
        ("workingDirectory", json!("/")),
        (
            "workingDirectory",
            json!(
                allowed
                    .join("../../agents/agents/agent-b")
                    .display()
                    .to_string()
            ),
        ),
        (
            "additionalDirectories",
            json!([allowed.display().to_string(), "/etc"]),
        ),
        (
            "skillDirectories",
            json!([another_agents.display().to_string()]),
        ),
        ("instructionDirectories", json!(["/root"])),
        (
            "eventsLogDirectory",
            json!(another_agents.join("events").display().to_string()),
        ),
        ("trajectoryFile", json!("/etc/trajectory.json")),
        ("hookDirectories", json!(["/etc"])),
        (
            "agentDirectories",
            json!([another_agents.display().to_string()]),
        ),
        ("largeOutput", json!({"enabled": true, "outputDir": "/tmp"})),
    ] {
        let refused = create_refused(&conn, &fx, "guarded-1", field, value).await;
        assert!(
            refused.message.contains(field) && refused.message.contains("allowed_work_roots"),
            "{field}: {refused:?}"
        );
    }
    assert!(
        pool_processes(&served).await == 0,
        "a refused create starts nothing"
    );
    // One inside an allowed root is taken.
    let mut params = create_params(&fx, "guarded-1");
    params["workingDirectory"] = json!(allowed.display().to_string());
    params["additionalDirectories"] = json!([allowed.display().to_string()]);
    conn.request("session.create", params, None)
        .await
        .expect("create");
    // A message's attachments by path are confined the same way (absolute), before
    // anything is sent.
    let escape = allowed.join("../../agents/agents/agent-b/notes.md");
    for (attachment, why) in [
        (
            json!({"type": "file", "path": "/etc/hostname"}),
            "allowed_work_roots",
        ),
        (
            json!({"type": "directory", "path": another_agents.display().to_string()}),
            "allowed_work_roots",
        ),
        // `..` out of the allowed root, resolved before the check.
        (
            json!({"type": "file", "path": escape.display().to_string()}),
            "allowed_work_roots",
        ),
        (
            json!({"type": "file", "path": "../../agents/agents/agent-b/notes.md"}),
            "must be an absolute path",
        ),
        (
            json!({"type": "selection", "filePath": "/etc/passwd", "displayName": "p", "text": "",
                   "selection": {"start": {"line": 0, "character": 0}, "end": {"line": 0, "character": 0}}}),
            "allowed_work_roots",
        ),
    ] {
        let inside =
            json!({"type": "file", "path": allowed.join("notes.md").display().to_string()});
        let params = json!({"sessionId": "guarded-1", "prompt": "read it",
                            "attachments": [inside, attachment.clone()]});
        let refused = remote_error(conn.request("session.send", params, None).await);
        assert!(
            refused.message.contains("attachments.1.") && refused.message.contains(why),
            "{attachment}: {refused:?}"
        );
    }
    // What the SDKs' "empty" mode sends after an open passes; host code, the runtime's shell
    // and fields no SDK sends do not.
    conn.request(
        "session.options.update",
        json!({"sessionId": "guarded-1", "skipCustomInstructions": true,
               "customAgentsLocalOnly": true, "coauthorEnabled": false,
               "manageScheduleEnabled": false, "installedPlugins": [],
               "includedBuiltinSkills": []}),
        None,
    )
    .await
    .expect("the empty mode's options");
    for (field, value) in [
        (
            "installedPlugins",
            json!([{"name": "p", "marketplace": "m", "cache_path": "/root/plugins/p"}]),
        ),
        (
            "shell",
            json!({"initScripts": [{"path": "/etc/profile", "shell": "bash"}]}),
        ),
        ("shellProcessFlags", json!(["--rcfile", "/etc/profile"])),
        ("agentContext", json!("from elsewhere")),
    ] {
        let mut params = json!({"sessionId": "guarded-1"});
        params[field] = value;
        let refused = remote_error(conn.request("session.options.update", params, None).await);
        assert!(
            refused.message.contains(field) && refused.message.contains("copilot-pool"),
            "{field}: {refused:?}"
        );
    }
    // Moving the session's directory out afterwards is refused too.
    let refused = remote_error(
        conn.request(
            "session.options.update",
            json!({"sessionId": "guarded-1", "workingDirectory": "/"}),
            None,
        )
        .await,
    );
    assert!(
        refused.message.contains("workingDirectory")
            && refused.message.contains("allowed_work_roots"),
        "{refused:?}"
    );
    // Changing the session's provider or endpoint afterwards is refused too.
    for (method, params) in [
        (
            "session.options.update",
            json!({"sessionId": "guarded-1", "provider": {"type": "openai", "baseUrl": "https://10.0.0.7/v1", "apiKey": "real"}}),
        ),
        (
            "session.options.update",
            json!({"sessionId": "guarded-1", "copilotUrl": "https://10.0.0.7"}),
        ),
        (
            "session.provider.add",
            json!({"sessionId": "guarded-1", "providers": []}),
        ),
    ] {
        let refused = remote_error(conn.request(method, params, None).await);
        assert!(
            refused.message.contains("guarded model path"),
            "{method}: {refused:?}"
        );
    }
    // A session's calls are its reads, its own settings and answers: one that would run work
    // outside a supervised turn, widen what the session may touch or change its identity is
    // refused before it reaches the runtime.
    for (method, extra) in [
        (
            "session.sendMessages",
            json!({"messages": [{"role": "user", "content": "hi"}]}),
        ),
        (
            "session.schedule.add",
            json!({"interval": "10s", "prompt": "again"}),
        ),
        (
            "session.metadata.setWorkingDirectory",
            json!({"workingDirectory": "/etc"}),
        ),
        ("session.permissions.paths.add", json!({"path": "/usr"})),
        (
            "session.permissions.setApproveAll",
            json!({"enabled": true}),
        ),
        (
            "session.gitHubAuth.setCredentials",
            json!({"token": "other"}),
        ),
        ("session.shell.exec", json!({"command": "id"})),
        ("session.sandbox.disableForSession", json!({})),
        ("session.mcp.startServer", json!({"name": "x"})),
        ("session.tools.execute", json!({"toolName": "bash"})),
    ] {
        let mut params = extra;
        params["sessionId"] = json!("guarded-1");
        let refused = remote_error(conn.request(method, params, None).await);
        assert!(
            refused.message.contains(method)
                && refused
                    .message
                    .contains("not available through copilot-pool"),
            "{method}: {refused:?}"
        );
    }
    // Its reads and own settings still reach the runtime.
    conn.request(
        "session.name.set",
        json!({"sessionId": "guarded-1", "name": "renamed"}),
        None,
    )
    .await
    .expect("session.name.set");
    conn.request("session.mode.get", json!({"sessionId": "guarded-1"}), None)
        .await
        .expect("session.mode.get");
    // Calls naming no session may only read: writes to the agent's home or to a shared
    // process are refused, reads are answered.
    for method in [
        "sessions.bulkDelete",
        "sessions.open",
        "mcp.config.add",
        "user.settings.set",
        "plugins.install",
        "account.login",
    ] {
        let refused = remote_error(conn.request(method, json!({}), None).await);
        assert!(
            refused.message.contains("may only read"),
            "{method}: {refused:?}"
        );
    }
    // Naming a session this connection holds does not make a call outside the session's
    // own (`session.*`) one of its calls: opening, forking or deleting sessions outside the
    // pool, or account and MCP changes, stay refused.
    for (method, params) in [
        (
            "sessions.open",
            json!({"kind": "resume", "sessionId": "guarded-1", "options": {"provider": {"type": "openai", "baseUrl": "https://10.0.0.7/v1", "apiKey": "real"}}}),
        ),
        ("sessions.fork", json!({"sessionId": "guarded-1"})),
        ("sessions.delete", json!({"sessionId": "guarded-1"})),
        ("account.getAllUsers", json!({"sessionId": "guarded-1"})),
        (
            "mcp.config.add",
            json!({"sessionId": "guarded-1", "name": "x"}),
        ),
    ] {
        let refused = remote_error(conn.request(method, params, None).await);
        assert!(
            refused
                .message
                .contains("not one of the session's own calls"),
            "{method}: {refused:?}"
        );
    }
    let listed = conn
        .request("session.list", json!({}), None)
        .await
        .expect("session.list");
    assert!(listed["sessions"].is_array(), "{listed}");
    // A pool process has no foreground session to read or set, and says so.
    for (method, params) in [
        ("session.getForeground", json!({})),
        ("session.setForeground", json!({"sessionId": "guarded-1"})),
    ] {
        let refused = remote_error(conn.request(method, params, None).await);
        assert!(
            refused.message.contains("no foreground session"),
            "{method}: {refused:?}"
        );
    }
    // A refused open speaks the SDK's terms: invalid params naming the fix, not the
    // library's "invalid lease request" or the HTTP API's fields.
    let plain_http = create_refused(
        &conn,
        &fx,
        "refused-1",
        "provider",
        json!({"type": "openai", "baseUrl": "http://10.0.0.7/v1", "apiKey": "k"}),
    )
    .await;
    assert_eq!(plain_http.code, -32602, "{plain_http:?}");
    assert!(
        plain_http.message.contains("plain http://")
            && !plain_http.message.contains("invalid lease request"),
        "{plain_http:?}"
    );
    let mut no_credentials = create_params(&fx, "refused-2");
    no_credentials
        .as_object_mut()
        .expect("an object")
        .remove("provider");
    let no_credentials = remote_error(conn.request("session.create", no_credentials, None).await);
    assert_eq!(no_credentials.code, -32602, "{no_credentials:?}");
    assert!(
        no_credentials.message.contains("gitHubToken")
            && no_credentials.message.contains("provider")
            && !no_credentials.message.contains("resolved_token"),
        "{no_credentials:?}"
    );
    // The SDKs' lookup of a stored session (a read of the agent's home, as the list is;
    // `a_stored_sessions_metadata_is_read_on_any_connection_of_its_agent`) is never made for an id that is not one.
    let refused = remote_error(
        conn.request(
            "session.getMetadata",
            json!({"sessionId": "../agent-b"}),
            None,
        )
        .await,
    );
    assert_eq!(refused.code, -32602, "{refused:?}");
    served.shut_down().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stored_sessions_metadata_is_read_on_any_connection_of_its_agent() {
    let fx = Fixture::new().await;
    let served = Served::start(&fx).await;
    let (holder, mut events) = connected(served.addr, "token-a").await;
    holder
        .request("session.create", create_params(&fx, "stored-1"), None)
        .await
        .expect("create");
    turn_to_idle(&holder, &mut events, &served, "stored-1", "kept").await;
    // The SDKs' getSessionMetadata: its metadata, or none for an id the agent has none of,
    // also on a connection that does not hold the session (was "create or resume it on this
    // connection first").
    let (reader, _reader_events) = connected(served.addr, "token-a").await;
    for conn in [&holder, &reader] {
        let found = conn
            .request(
                "session.getMetadata",
                json!({"sessionId": "stored-1"}),
                None,
            )
            .await
            .expect("session.getMetadata");
        assert_eq!(found["session"]["sessionId"], "stored-1", "{found}");
    }
    let none = reader
        .request(
            "session.getMetadata",
            json!({"sessionId": "never-made-here"}),
            None,
        )
        .await
        .expect("session.getMetadata of an unknown id");
    assert!(none["session"].is_null(), "{none}");
    // Another agent's connection reads its own home only.
    let (stranger, _stranger_events) = connected(served.addr, "token-b").await;
    let elsewhere = stranger
        .request(
            "session.getMetadata",
            json!({"sessionId": "stored-1"}),
            None,
        )
        .await
        .expect("session.getMetadata of another agent's id");
    assert!(elsewhere["session"].is_null(), "{elsewhere}");
    served.shut_down().await;
}

/// The number of runtime processes of the served pool.
async fn pool_processes(served: &Served) -> usize {
    served
        .pool
        .status()
        .await
        .map(|s| s.workers.len())
        .unwrap_or(0)
}

/// A running Node scenario: its JSON lines as they come.
struct Scenario {
    child: tokio::process::Child,
    lines: tokio::io::Lines<BufReader<tokio::process::ChildStdout>>,
}

impl Scenario {
    async fn start(name: &str, fx: &Fixture, served: &Served) -> Scenario {
        let sdk = support::node_sdk::sdk_dir().await;
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/support/sdk_client.mjs");
        let mut command = tokio::process::Command::new("node");
        command
            .arg(script)
            .env("SDK_DIR", sdk)
            .env("SDK_URL", served.addr.to_string())
            .env("SDK_TOKEN", "token-a")
            .env("SDK_TOKEN_B", "token-b")
            .env("MODEL_URL", fx.endpoint.base_url())
            .env("MODEL_ID", ScriptedModel::MODEL_ID)
            .env("SCENARIO", name)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .process_group(0)
            .kill_on_drop(true);
        let child = command.spawn().expect("node (Node.js must be installed)");
        Scenario::from_child(child)
    }

    /// The same with the official Python SDK running `tests/support/sdk_client.py`.
    async fn start_python(name: &str, fx: &Fixture, served: &Served) -> Scenario {
        let python = support::python_sdk::python().await;
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/support/sdk_client.py");
        let mut command = tokio::process::Command::new(python);
        command
            .arg(script)
            .env("SDK_URL", served.addr.to_string())
            .env("SDK_TOKEN", "token-a")
            .env("MODEL_URL", fx.endpoint.base_url())
            .env("MODEL_ID", ScriptedModel::MODEL_ID)
            .env("SCENARIO", name)
            .env("PYTHONUNBUFFERED", "1")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .process_group(0)
            .kill_on_drop(true);
        let child = command.spawn().expect("the Python SDK's python");
        Scenario::from_child(child)
    }

    fn from_child(mut child: tokio::process::Child) -> Scenario {
        let stdout = child.stdout.take().expect("stdout");
        Scenario {
            child,
            lines: BufReader::new(stdout).lines(),
        }
    }

    /// The next line of the scenario, which must be the step `step`.
    async fn step(&mut self, step: &str) -> Value {
        let line = tokio::time::timeout(SCENARIO_LIMIT, self.lines.next_line())
            .await
            .unwrap_or_else(|_| panic!("no step {step} within {SCENARIO_LIMIT:?}"))
            .expect("read")
            .unwrap_or_else(|| panic!("the scenario ended before step {step}"));
        let value: Value = serde_json::from_str(&line).expect("a JSON line");
        assert_eq!(value["step"], step, "{value}");
        value
    }

    async fn done(mut self) {
        let line = tokio::time::timeout(SCENARIO_LIMIT, self.lines.next_line())
            .await
            .expect("the scenario ends")
            .expect("read")
            .expect("a last line");
        assert_eq!(line, r#"{"done":true}"#);
        let status = tokio::time::timeout(Duration::from_secs(30), self.child.wait())
            .await
            .expect("node exits")
            .expect("wait");
        assert!(status.success(), "{status}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_node_sdk_runs_a_tool_turn_streams_deltas_and_aborts_through_the_pool() {
    let fx = Fixture::new().await;
    let served = Served::start(&fx).await;
    let mut node = Scenario::start("turns", &fx, &served).await;

    let status = node.step("status").await;
    assert_eq!(status["protocolVersion"], 3, "{status}");
    assert_eq!(status["version"], env!("CARGO_PKG_VERSION"), "{status}");
    assert_eq!(status["ping"]["message"], "pong: hello", "{status}");

    let tool = node.step("tool").await;
    assert_eq!(
        tool["content"], "tool said: secret number for alpha is 42",
        "{tool}"
    );
    assert_eq!(
        (
            tool["toolRequested"].as_bool(),
            tool["toolCompleted"].as_bool()
        ),
        (Some(true), Some(true)),
        "{tool}"
    );
    // The session runs under the SDK's own id in the agent's home.
    let id = tool["sessionId"].as_str().expect("session id").to_owned();
    let home = fx
        .scratch
        .path()
        .join("agents/agents/agent-a/copilot/session-state");
    assert!(home.join(&id).is_dir(), "{} has no {id}", home.display());

    let streaming = node.step("streaming").await;
    let content = streaming["content"].as_str().expect("content");
    assert!(content.starts_with("slow-chunk 0"), "{streaming}");
    assert_eq!(
        streaming["deltas"], content,
        "the deltas add up to the message"
    );

    let abort = node.step("abort").await;
    assert_eq!(abort["idle"]["aborted"], true, "{abort}");
    let after = node.step("after-abort").await;
    assert_eq!(after["content"], "still here", "{after}");
    let messages = node.step("messages").await;
    assert!(messages["count"].as_u64().unwrap_or(0) > 0, "{messages}");
    let stopped = node.step("stopped").await;
    assert_eq!(stopped["errors"], json!([]), "{stopped}");
    node.done().await;

    // The turns ran on one pooled process and the session is parked there.
    let status = served.pool.status().await.expect("status");
    assert_eq!(status.workers.len(), 1, "{status:?}");
    assert_eq!(served.endpoint.running_turns(), 0);
    served.shut_down().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_process_ends_the_sdk_turn_within_a_second_and_the_session_goes_on_with_its_history()
 {
    let fx = Fixture::new().await;
    let served = Served::start(&fx).await;
    let node = Scenario::start("crash", &fx, &served).await;
    kill_mid_turn_and_go_on(node, &fx, &served).await;
    served.shut_down().await;
}

/// The crash scenario of either SDK: a kill -9 of the session's process mid-turn ends the
/// SDK's wait within a second with `process_crashed` (`session.error`, then `session.idle`),
/// and the next wait on the same session object succeeds on a fresh process that resumed it
/// (the model saw the turn before the crash).
async fn kill_mid_turn_and_go_on(mut sdk: Scenario, fx: &Fixture, served: &Served) {
    let first = sdk.step("first").await;
    assert_eq!(first["content"], "first answer", "{first}");
    sdk.step("streaming").await;
    let status = served.pool.status().await.expect("status");
    assert_eq!(status.workers.len(), 1, "{status:?}");
    let pid = status.workers[0].pid;
    let killed_at = Instant::now();
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(pid as i32),
        nix::sys::signal::Signal::SIGKILL,
    )
    .expect("kill -9");
    let rejected = sdk.step("rejected").await;
    let after_kill = killed_at.elapsed();
    assert!(
        after_kill < Duration::from_secs(1),
        "the SDK's wait rejected {after_kill:?} after the kill"
    );
    assert_eq!(rejected["outcome"]["ok"], false, "{rejected}");
    assert_eq!(
        rejected["errors"][0]["errorType"],
        sdk_endpoint::PROCESS_CRASHED,
        "{rejected}"
    );
    let idle = sdk.step("idle").await;
    assert!(idle["idle"]["aborted"].is_null(), "{idle}");
    assert_eq!(
        idle["order"],
        json!(["session.error", "session.idle"]),
        "{idle}"
    );
    let after = sdk.step("after").await;
    assert_eq!(after["content"], "after the crash", "{after}");
    let status = served.pool.status().await.expect("status");
    assert!(status.workers.iter().all(|w| w.pid != pid), "{status:?}");
    assert!(
        fx.last_model_request().contains("first answer"),
        "{}",
        fx.last_model_request()
    );
    sdk.done().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_agents_with_their_own_tokens_never_see_each_others_sessions() {
    let fx = Fixture::new().await;
    let served = Served::start(&fx).await;
    let mut node = Scenario::start("isolation", &fx, &served).await;
    let seen = node.step("isolation").await;
    let (a, b) = (
        seen["a"].as_str().expect("a"),
        seen["b"].as_str().expect("b"),
    );
    let listed =
        |who: &str| -> Vec<String> { serde_json::from_value(seen[who].clone()).expect("ids") };
    assert!(listed("listedByA").contains(&a.to_owned()), "{seen}");
    assert!(!listed("listedByA").contains(&b.to_owned()), "{seen}");
    assert!(listed("listedByB").contains(&b.to_owned()), "{seen}");
    assert!(!listed("listedByB").contains(&a.to_owned()), "{seen}");
    for attempt in ["resumeByB", "sendByB", "messagesByB"] {
        let said = seen[attempt].as_str().unwrap_or("ok");
        assert!(said.contains("Session not found"), "{attempt}: {seen}");
    }
    // A resume says why there is nothing to resume (not "resume it first").
    let said = seen["resumeByB"].as_str().unwrap_or("ok");
    assert!(said.contains("another agent's token"), "{seen}");
    assert!(
        seen["wrongToken"]
            .as_str()
            .is_some_and(|s| s.contains("AUTHENTICATION_FAILED")),
        "{seen}"
    );
    assert_eq!(seen["seenByB"], json!([b]), "{seen}");
    assert_eq!(seen["again"], "agent a again", "{seen}");
    node.done().await;
    // Each agent ran in its own home.
    for (agent, id) in [("agent-a", a), ("agent-b", b)] {
        let state = fx
            .scratch
            .path()
            .join("agents/agents")
            .join(agent)
            .join("copilot/session-state");
        assert!(state.join(id).is_dir(), "{} has no {id}", state.display());
    }
    served.shut_down().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_runs_the_sdk_endpoint_on_a_unix_socket_and_removes_it_after_the_drain() {
    let fx = Fixture::new().await;
    let dir = fx.scratch.path();
    let socket = dir.join("sdk.sock");
    let config = format!(
        "drain_grace_secs = 1\n[[sdk.tokens]]\nagent = \"agent-u\"\nsha256 = \"{}\"\n",
        sdk_endpoint::sha256_hex("token-u")
    );
    let listen = format!("unix:{}", socket.display());
    let daemon = support::http::Daemon::start(dir, &config, &["--sdk-listen", &listen]).await;
    use std::os::unix::fs::PermissionsExt;
    let mode = std::fs::metadata(&socket)
        .expect("socket")
        .permissions()
        .mode()
        & 0o777;
    assert_eq!(mode, 0o600, "the socket is owner-only");

    let stream = tokio::net::UnixStream::connect(&socket)
        .await
        .expect("connect");
    let (read, write) = stream.into_split();
    let (events_tx, mut events) = tokio::sync::mpsc::unbounded_channel();
    let sink = move |incoming| {
        if let copilot_pool::rpc::Incoming::Notification { method, params } = incoming {
            let params: Value = serde_json::from_str(params.get()).expect("JSON params");
            let _ = events_tx.send((method, params));
        }
    };
    let conn = Connection::start(read, write, ConnectionOptions::default(), Box::new(sink));
    let connected = conn
        .request("connect", json!({"token": "token-u"}), None)
        .await
        .expect("connect");
    assert_eq!(connected["protocolVersion"], 3);
    let created = conn
        .request(
            "session.create",
            json!({
                "sessionId": "daemon-session-1",
                "model": ScriptedModel::MODEL_ID,
                "provider": {"type": "openai", "baseUrl": fx.endpoint.base_url(), "apiKey": "k"},
                "availableTools": ["custom:*"],
                "requestPermission": true,
            }),
            None,
        )
        .await
        .expect("create");
    assert_eq!(created["sessionId"], "daemon-session-1", "{created}");
    assert!(
        created.get("capabilities").is_some(),
        "the runtime's whole answer: {created}"
    );
    conn.request(
        "session.send",
        json!({"sessionId": "daemon-session-1", "prompt": "REPLY=from the daemon"}),
        None,
    )
    .await
    .expect("send");
    let mut text = None;
    let mut lifecycle = Vec::new();
    let turn = async {
        while let Some((method, params)) = events.recv().await {
            assert_eq!(
                params["sessionId"], "daemon-session-1",
                "{method}: {params}"
            );
            if method == "session.lifecycle" {
                lifecycle.push(params["type"].clone());
                continue;
            }
            assert_eq!(method, "session.event");
            let event = &params["event"];
            if event["type"] == "assistant.message" {
                text = event["data"]["content"].as_str().map(str::to_owned);
            }
            if event["type"] == "session.idle" {
                break;
            }
        }
    };
    tokio::time::timeout(SCENARIO_LIMIT, turn)
        .await
        .expect("the turn ends");
    assert_eq!(text.as_deref(), Some("from the daemon"));
    // The runtime's session.lifecycle notifications reach the session's connection too.
    assert!(!lifecycle.is_empty(), "no session.lifecycle notification");

    // A second daemon configured on the same socket refuses to start, and leaves the first
    // one's socket alone (it used to remove it as stale first).
    let second = tokio::process::Command::new(env!("CARGO_BIN_EXE_copilot-pool"))
        .arg("serve")
        .arg("--config")
        .arg(dir.join("serve.toml"))
        .args(["--listen", "127.0.0.1:0", "--sdk-listen", &listen])
        .env("COPILOT_CLI_PATH", support::runtime::runtime_path().await)
        .env("COPILOT_POOL_HOME", dir.join("pool-home"))
        .env_remove("COPILOT_POOL_API_TOKEN")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .output();
    let second = tokio::time::timeout(SCENARIO_LIMIT, second)
        .await
        .expect("the second daemon is refused in time")
        .expect("it ran");
    let stderr = String::from_utf8_lossy(&second.stderr);
    assert!(!second.status.success(), "{stderr}");
    assert!(
        stderr.contains("socket") && stderr.contains("in use"),
        "{stderr}"
    );
    tokio::net::UnixStream::connect(&socket)
        .await
        .expect("the first daemon's socket still answers");

    // A turn still running when the drain's grace ends is aborted, and the client is told
    // why before its idle (it did not ask for the abort).
    conn.request(
        "session.send",
        json!({"sessionId": "daemon-session-1", "prompt": "SCENARIO:slow SLOW=200x100"}),
        None,
    )
    .await
    .expect("send the slow turn");
    let stopping = tokio::spawn(daemon.terminate());
    let mut shutdown_error = None;
    let mut abort_reason = None;
    let drained = async {
        while let Some((method, params)) = events.recv().await {
            let event = &params["event"];
            if method == "session.event" && event["type"] == "session.error" {
                shutdown_error = Some(event["data"].clone());
            }
            if method == "session.event" && event["type"] == "abort" {
                abort_reason = Some(event["data"]["reason"].clone());
            }
            if method == "session.event" && event["type"] == "session.idle" {
                assert_eq!(event["data"]["aborted"], true, "{event}");
                break;
            }
        }
    };
    tokio::time::timeout(SCENARIO_LIMIT, drained)
        .await
        .expect("the slow turn ends with the drain");
    let error = shutdown_error.expect("a session.error before the idle");
    assert_eq!(error["errorType"], sdk_endpoint::SHUTDOWN, "{error}");
    // The abort event's reason is one of the runtime's AbortReason values, which the SDKs
    // read as an enum (the Python SDK dropped the event for "pool shutdown").
    assert_eq!(
        abort_reason,
        Some(json!("remote_command")),
        "the abort event's reason"
    );
    assert!(
        error["message"]
            .as_str()
            .is_some_and(|m| m.contains("drain_grace_secs")),
        "{error}"
    );
    let status = stopping.await.expect("join");
    assert!(status.success(), "{status}");
    assert!(
        !socket.exists(),
        "the socket file is removed after the drain"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hook_files_in_an_sdk_sessions_working_directory_run_no_command() {
    let fx = Fixture::new().await;
    let project = fx.scratch.path().join("repos/project");
    std::fs::create_dir_all(&project).expect("project");
    let hooks = PlantedHooks::plant(&project, fx.scratch.path());
    let roots = vec![fx.scratch.path().join("repos")];
    let served =
        Served::start_with_endpoint(&fx, |_| {}, move |config| config.allowed_work_roots = roots)
            .await;
    let (conn, mut events) = connected(served.addr, "token-a").await;
    // As the SDKs' default mode sends it: enableFileHooks left out.
    let mut params = create_params(&fx, "hooked-1");
    params["workingDirectory"] = json!(project.display().to_string());
    conn.request("session.create", params, None)
        .await
        .expect("create");
    turn_to_idle(&conn, &mut events, &served, "hooked-1", "ok").await;
    assert_eq!(hooks.ran(), None, "a hook file's command ran");
    drop(conn);
    served.shut_down().await;
}

/// A raw client authenticated as `token`, with the notifications it receives.
async fn connected(
    addr: std::net::SocketAddr,
    token: &str,
) -> (Connection, tokio::sync::mpsc::UnboundedReceiver<Value>) {
    let stream = TcpStream::connect(addr).await.expect("connect");
    let (read, write) = stream.into_split();
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    let sink = move |incoming| {
        if let copilot_pool::rpc::Incoming::Notification { params, .. } = incoming {
            let _ = tx.send(serde_json::from_str(params.get()).expect("JSON params"));
        }
    };
    let conn = Connection::start(read, write, ConnectionOptions::default(), Box::new(sink));
    conn.request("connect", json!({"token": token}), None)
        .await
        .expect("connect");
    (conn, rx)
}

fn create_params(fx: &Fixture, id: &str) -> Value {
    json!({
        "sessionId": id,
        "model": ScriptedModel::MODEL_ID,
        // The HTTP turns' key (support::api::turn): one key per endpoint and agent, since a
        // second key for the same endpoint is a rotation that drains the first one's process.
        "provider": {"type": "openai", "baseUrl": fx.endpoint.base_url(), "apiKey": "scripted-key"},
        "availableTools": ["custom:*"],
        "streaming": true,
    })
}

/// Runs one turn of session `id` on `conn` (the model answers `reply`) to its
/// `session.idle`, and until the pool has its lease back.
async fn turn_to_idle(
    conn: &Connection,
    events: &mut tokio::sync::mpsc::UnboundedReceiver<Value>,
    served: &Served,
    id: &str,
    reply: &str,
) {
    conn.request(
        "session.send",
        json!({"sessionId": id, "prompt": format!("REPLY={reply}")}),
        None,
    )
    .await
    .expect("send");
    until_event(events, "session.idle").await;
    tokio::time::timeout(Duration::from_secs(15), served.endpoint.turns_finished())
        .await
        .expect("the turn ends in the pool");
}

/// An endpoint over a pool of one session, whose leases wait `wait` for room.
async fn one_room(fx: &Fixture, wait: Duration) -> Served {
    Served::start_with(fx, |config| {
        config.max_sessions = 1;
        config.wait_timeout = wait;
    })
    .await
}

/// Takes the pool's room: session `busy` of `conn` runs a slow turn (30 s), until its
/// `session.detach`.
async fn take_the_room(conn: &Connection, fx: &Fixture) {
    conn.request("session.create", create_params(fx, "busy"), None)
        .await
        .expect("create");
    let slow = json!({"sessionId": "busy", "prompt": "SCENARIO:slow SLOW=300x100"});
    conn.request("session.send", slow, None)
        .await
        .expect("send");
}

/// Reads notifications until an event of `event_type`.
async fn until_event(events: &mut tokio::sync::mpsc::UnboundedReceiver<Value>, event_type: &str) {
    let found = async {
        while let Some(params) = events.recv().await {
            if params["event"]["type"] == event_type {
                return;
            }
        }
        panic!("the connection closed before {event_type}");
    };
    tokio::time::timeout(SCENARIO_LIMIT, found)
        .await
        .unwrap_or_else(|_| panic!("no {event_type}"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_open_event_the_runtime_sends_after_its_answer_reaches_the_client_without_another_call()
{
    let fx = Fixture::new().await;
    // The fake runtime sends `session.start` 300 ms after its answer to `session.create`.
    let late = fx.fake_runtime_config("late-open-event").await;
    let served = Served::start_with(&fx, move |config| *config = late).await;
    let (conn, mut events) = connected(served.addr, "token-a").await;
    conn.request("session.create", create_params(&fx, "late"), None)
        .await
        .expect("create");
    let first = tokio::time::timeout(Duration::from_secs(5), events.recv())
        .await
        .expect("an event without another call")
        .expect("the connection stays open");
    assert_eq!(first["event"]["type"], "session.start", "{first}");
    assert_eq!(first["sessionId"], "late", "{first}");
    drop(conn);
    served.shut_down().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_leaves_while_its_calls_wait_for_a_slot_gives_its_seat_back_at_once() {
    let fx = Fixture::new().await;
    // One session in the pool, one call of a connection handled at a time, one connection
    // per agent; a call waits up to 60 s for room.
    let served = Served::start_with_endpoint(
        &fx,
        |config| {
            config.max_sessions = 1;
            config.wait_timeout = Duration::from_secs(60);
        },
        |config| {
            config.max_connections_per_agent = 1;
            config.max_requests_per_connection = 1;
        },
    )
    .await;
    // A raw client, so the order of its frames and its end on the wire is exact.
    let mut first = TcpStream::connect(served.addr).await.expect("connect");
    let call = |id: u64, method: &str, params: Value| json!({"jsonrpc": "2.0", "id": id, "method": method, "params": params});
    write_raw_frame(&mut first, &call(1, "connect", json!({"token": "token-a"}))).await;
    write_raw_frame(
        &mut first,
        &call(2, "session.create", create_params(&fx, "busy")),
    )
    .await;
    let slow = json!({"sessionId": "busy", "prompt": "SCENARIO:slow SLOW=300x100"});
    write_raw_frame(&mut first, &call(3, "session.send", slow)).await;
    until_answer(&mut first, 3).await;
    // A second session's create waits for room (the slow turn holds the pool's only
    // session), holding the connection's only call slot...
    write_raw_frame(
        &mut first,
        &call(4, "session.create", create_params(&fx, "waiting")),
    )
    .await;
    eventually("the second create waits for room in the pool", || async {
        served.pool.status().await.expect("status").waiters == 1
    })
    .await;
    // ...and a call behind it waits for that slot when the client leaves.
    write_raw_frame(&mut first, &call(5, "ping", json!({}))).await;
    first.shutdown().await.expect("shutdown");
    drop(first);
    // The endpoint sees the client go at once (its seat back well inside the 60 s wait).
    let deadline = tokio::time::Instant::now() + Duration::from_secs(15);
    let next = loop {
        let client = raw_client(served.addr).await;
        match client
            .request("connect", json!({"token": "token-a"}), None)
            .await
        {
            Ok(_) => break client,
            Err(error) => assert!(
                tokio::time::Instant::now() < deadline,
                "the connection that left kept its seat while its calls waited: {error:?}"
            ),
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    // Its waiting create went with it: the room its slow turn left goes to the agent's next
    // client, and no session was opened for nobody (it would have had the room first).
    next.request("session.create", create_params(&fx, "next"), None)
        .await
        .expect("the next client's create");
    let created = served.pool.status().await.expect("status").totals.created;
    assert_eq!(
        created, 2,
        "busy and next, not the create of the client that left, which would have run on"
    );
    served.shut_down().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_byok_session_another_connection_left_is_deleted_by_its_id_alone() {
    let fx = Fixture::new().await;
    let served = Served::start(&fx).await;
    let (first, mut first_events) = connected(served.addr, "token-a").await;
    let (second, _) = connected(served.addr, "token-a").await;
    for id in ["parked", "stored"] {
        first
            .request("session.create", create_params(&fx, id), None)
            .await
            .expect("create");
        turn_to_idle(&first, &mut first_events, &served, id, "kept").await;
        first
            .request("session.detach", json!({"sessionId": id}), None)
            .await
            .expect("detach");
    }
    // The official SDKs' deleteSession names the id alone: no provider, no token. A session
    // parked on its BYOK process is deleted, and gone for good...
    let gone = |id: &'static str| {
        let second = second.clone();
        let params = create_params(&fx, id);
        async move {
            let error = remote_error(second.request("session.resume", params, None).await);
            assert!(
                error
                    .message
                    .contains(&format!("Session not found for sessionId: {id}")),
                "{id}: {error:?}"
            );
        }
    };
    let deleted = second
        .request("session.delete", json!({"sessionId": "parked"}), None)
        .await
        .expect("an answer");
    assert_eq!(deleted["success"], true, "{deleted}");
    gone("parked").await;
    // ...and so is one no process holds (its BYOK process killed).
    let status = served.pool.status().await.expect("status");
    let holder = status
        .workers
        .iter()
        .find(|w| w.conversations > 0)
        .unwrap_or_else(|| panic!("the process holding \"stored\": {status:?}"))
        .pid;
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(holder as i32),
        nix::sys::signal::Signal::SIGKILL,
    )
    .expect("kill -9");
    eventually("the pool sees its process gone", || async {
        let status = served.pool.status().await.expect("status");
        status.workers.iter().all(|w| w.pid != holder)
    })
    .await;
    let deleted = second
        .request("session.delete", json!({"sessionId": "stored"}), None)
        .await
        .expect("an answer");
    assert_eq!(deleted["success"], true, "{deleted}");
    gone("stored").await;
    drop((first, second));
    served.shut_down().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prompt_that_lands_as_its_turn_ends_runs_a_turn_whose_events_reach_the_client() {
    let fx = Fixture::new().await;
    // The fake runtime ends the running turn as the second prompt lands and starts a turn
    // with it (the real one does so only in a race).
    let fake = fx.fake_runtime_config("idle-as-a-send-lands").await;
    let served = Served::start_with(&fx, move |config| *config = fake).await;
    let (conn, mut events) = connected(served.addr, "token-a").await;
    conn.request("session.create", create_params(&fx, "landing"), None)
        .await
        .expect("create");
    for prompt in ["first", "second"] {
        conn.request(
            "session.send",
            json!({"sessionId": "landing", "prompt": prompt}),
            None,
        )
        .await
        .expect("send");
    }
    // The second prompt's turn is passed on to its end, not left unread on a parked lease.
    let answered = tokio::time::timeout(Duration::from_secs(10), async {
        let mut idles = 0;
        loop {
            let params = events.recv().await.expect("an event");
            let event = &params["event"];
            match event["type"].as_str() {
                Some("assistant.message") => {
                    assert_eq!(event["data"]["content"], "REPLY-TO-second", "{event}");
                    return idles;
                }
                Some("session.idle") => idles += 1,
                _ => {}
            }
        }
    })
    .await
    .expect("the second prompt's answer reached the client");
    assert_eq!(answered, 1, "the first turn's idle came first");
    until_event(&mut events, "session.idle").await;
    served.shut_down().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deletion_by_id_the_runtime_refuses_leaves_the_binding_its_turns_wrote() {
    let fx = Fixture::new().await;
    // The fake runtime refuses the first session.delete (a fault the real one cannot give).
    let refusing = fx.fake_runtime_config("delete-fails-once").await;
    let served = Served::start_with(&fx, move |config| *config = refusing).await;
    let (first, _first_events) = connected(served.addr, "token-a").await;
    let (second, _second_events) = connected(served.addr, "token-a").await;
    first
        .request("session.create", create_params(&fx, "kept"), None)
        .await
        .expect("create");
    first
        .request("session.detach", json!({"sessionId": "kept"}), None)
        .await
        .expect("detach");
    let bound = || {
        served
            .pool
            .bindings()
            .get("agent-a/sdk:kept")
            .expect("bindings")
            .expect("bound")
    };
    let before = bound();
    let refused = second
        .request("session.delete", json!({"sessionId": "kept"}), None)
        .await
        .expect("an answer");
    assert_eq!(refused["success"], false, "{refused}");
    // Still bound as its turns left it (not under the deletion's key, which has no identity).
    let after = bound();
    assert_eq!(after.compat_key, before.compat_key);
    assert_eq!(after.cli_session_id, before.cli_session_id);
    drop((first, second));
    served.shut_down().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_being_deleted_stays_claimed_when_its_own_open_fails_meanwhile() {
    let fx = Fixture::new().await;
    let served = one_room(&fx, Duration::from_secs(2)).await;
    let (first, _first_events) = connected(served.addr, "token-a").await;
    let (second, _second_events) = connected(served.addr, "token-a").await;
    take_the_room(&second, &fx).await;
    // A create that waits for room, and its deletion on the same connection behind it.
    let asked = tokio::time::Instant::now();
    let create = tokio::spawn({
        let (first, params) = (first.clone(), create_params(&fx, "contested"));
        async move { first.request("session.create", params, None).await }
    });
    eventually("the create waits for room in the pool", || async {
        served.pool.status().await.expect("status").waiters == 1
    })
    .await;
    // Not a wait for an event: both wait the pool's 2 s for room, so the deletion asks a
    // second after the create to give up a second after it, leaving the resume below that
    // second whatever the machine's load (asked at once, it had a few milliseconds).
    tokio::time::sleep_until(asked + Duration::from_secs(1)).await;
    let delete = tokio::spawn({
        let first = first.clone();
        async move {
            first
                .request("session.delete", json!({"sessionId": "contested"}), None)
                .await
        }
    });
    // The create gives up (no room within 2 s) while the deletion still runs: the session
    // stays the deleting connection's, so another connection's resume is refused (it was
    // claimed, then deleted under it).
    remote_error(create.await.expect("the create's task"));
    let refused = remote_error(
        second
            .request("session.resume", create_params(&fx, "contested"), None)
            .await,
    );
    assert!(
        refused.message.contains("open on another connection"),
        "{refused:?}"
    );
    second
        .request("session.detach", json!({"sessionId": "busy"}), None)
        .await
        .expect("detach");
    delete.await.expect("the delete's task").expect("an answer");
    drop((first, second));
    served.shut_down().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_being_deleted_is_not_opened_on_the_same_connection_until_the_delete_answers() {
    let fx = Fixture::new().await;
    let served = one_room(&fx, Duration::from_secs(60)).await;
    let (first, mut first_events) = connected(served.addr, "token-a").await;
    let (second, _second_events) = connected(served.addr, "token-a").await;
    first
        .request("session.create", create_params(&fx, "doomed"), None)
        .await
        .expect("create");
    // A turn, so the runtime stores the session when its room is taken.
    turn_to_idle(&first, &mut first_events, &served, "doomed", "stored").await;
    // Another session's slow turn takes the pool's only room...
    take_the_room(&second, &fx).await;
    // ...so the deletion waits for room, and a resume of the same id on its connection
    // meanwhile is refused at once (it would wait behind it, then be deleted under the
    // client or dropped from the connection by the deletion's end).
    let delete = tokio::spawn({
        let first = first.clone();
        async move {
            first
                .request("session.delete", json!({"sessionId": "doomed"}), None)
                .await
        }
    });
    eventually("the deletion waits for room in the pool", || async {
        served.pool.status().await.expect("status").waiters == 1
    })
    .await;
    let refused = remote_error(
        tokio::time::timeout(
            Duration::from_secs(10),
            first.request("session.resume", create_params(&fx, "doomed"), None),
        )
        .await
        .expect("the resume is answered while the deletion waits"),
    );
    assert!(
        refused
            .message
            .contains("session doomed is being deleted on this connection"),
        "{refused:?}"
    );
    // Nor is it let go meanwhile (its claim would go to another connection mid-deletion).
    let kept = remote_error(
        first
            .request("session.detach", json!({"sessionId": "doomed"}), None)
            .await,
    );
    assert!(
        kept.message
            .contains("session doomed is being deleted on this connection"),
        "{kept:?}"
    );
    // Room again: the deletion runs, and once it has answered the id is no longer refused
    // as being deleted (it is gone).
    second
        .request("session.detach", json!({"sessionId": "busy"}), None)
        .await
        .expect("detach");
    let answered = delete.await.expect("the delete's task").expect("an answer");
    assert_eq!(answered["success"], true, "{answered}");
    let gone = remote_error(
        first
            .request("session.resume", create_params(&fx, "doomed"), None)
            .await,
    );
    assert!(
        gone.message
            .contains("Session not found for sessionId: doomed"),
        "{gone:?}"
    );
    drop((first, second));
    served.shut_down().await;
}

// One thread: the call's handler reaches the session's gate before the detach runs.
#[tokio::test]
async fn a_call_waiting_when_its_session_is_let_go_does_not_reach_the_session() {
    let fx = Fixture::new().await;
    // The open holds the session's gate until its late `session.start` (300 ms).
    let late = fx.fake_runtime_config("late-open-event").await;
    let served = Served::start_with(&fx, move |config| *config = late).await;
    let (conn, _events) = connected(served.addr, "token-a").await;
    conn.request("session.create", create_params(&fx, "let-go"), None)
        .await
        .expect("create");
    let rename = tokio::spawn({
        let conn = conn.clone();
        async move {
            conn.request(
                "session.name.set",
                json!({"sessionId": "let-go", "name": "after the detach"}),
                None,
            )
            .await
        }
    });
    tokio::task::yield_now().await;
    let detached = conn
        .request("session.detach", json!({"sessionId": "let-go"}), None)
        .await
        .expect("detach");
    assert_eq!(detached["success"], true, "{detached}");
    let error = remote_error(rename.await.expect("rename task"));
    assert!(
        error.message.contains("let go"),
        "a call that waited while its session was let go must not run on it: {error:?}"
    );
    drop(conn);
    served.shut_down().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prompt_sent_during_a_turn_runs_in_it_and_its_events_reach_the_client_before_the_idle() {
    let fx = Fixture::new().await;
    let served = Served::start(&fx).await;
    let (conn, mut events) = connected(served.addr, "token-a").await;
    conn.request("session.create", create_params(&fx, "queued"), None)
        .await
        .expect("create");
    conn.request(
        "session.send",
        json!({"sessionId": "queued", "prompt": "SCENARIO:slow SLOW=5x100"}),
        None,
    )
    .await
    .expect("send");
    until_event(&mut events, "assistant.message_delta").await;
    // The SDK's enqueue: a second prompt while the first turn runs. The runtime (measured,
    // 1.0.14) runs it in the same agent loop, after the first's `assistant.turn_end`, and
    // sends one `session.idle` after both: the pump passes both on until then.
    conn.request(
        "session.send",
        json!({"sessionId": "queued", "prompt": "REPLY=the queued answer", "mode": "enqueue"}),
        None,
    )
    .await
    .expect("a send during the turn");
    let until_idle = async {
        let mut replied = false;
        while let Some(params) = events.recv().await {
            match params["event"]["type"].as_str() {
                Some("assistant.message") => {
                    replied |= params["event"]["data"]["content"] == "the queued answer";
                }
                Some("session.idle") => return replied,
                _ => {}
            }
        }
        panic!("the connection closed before the idle");
    };
    let replied = tokio::time::timeout(SCENARIO_LIMIT, until_idle)
        .await
        .expect("the turn ends");
    assert!(
        replied,
        "the queued prompt's answer reached the client before the idle"
    );
    tokio::time::timeout(Duration::from_secs(15), served.endpoint.turns_finished())
        .await
        .expect("the turn ends in the pool");
    // The next send takes the session again.
    conn.request(
        "session.send",
        json!({"sessionId": "queued", "prompt": "REPLY=third"}),
        None,
    )
    .await
    .expect("a third send");
    until_event(&mut events, "session.idle").await;
    served.shut_down().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_dense_with_values_is_refused_unread_and_the_connection_goes_on() {
    let fx = Fixture::new().await;
    let served = Served::start_with_endpoint(&fx, |_| {}, |_| {}).await;
    let (conn, _events) = connected(served.addr, "token-a").await;
    // 1.2 MB, under the 16 MiB frame limit, but 600,000 values: parsed, 19 MiB and more.
    let refused = remote_error(
        conn.request("ping", json!({"message": vec![0; 600_000]}), None)
            .await,
    );
    assert_eq!(refused.code, -32600, "{refused:?}");
    assert!(
        refused.message.contains("more than 524288 JSON values")
            && refused.message.contains("one string"),
        "{refused:?}"
    );
    conn.request("ping", json!({"message": vec![0; 1000]}), None)
        .await
        .expect("a ping after");
    served.shut_down().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connections_waiting_calls_hold_at_most_twice_the_largest_frame() {
    let fx = Fixture::new().await;
    let served = Served::start_with_endpoint(
        &fx,
        |_| {},
        |config| {
            config.max_frame_bytes = 64 * 1024;
            config.max_requests_per_connection = 1;
        },
    )
    .await;
    let (conn, _events) = connected(served.addr, "token-a").await;
    // The create holds the one slot while its process starts; the pings behind it wait,
    // each holding its 50 KB frame: the third would pass 128 KiB and is refused at once.
    let big = || json!({"message": "x".repeat(50_000)});
    let (created, first, second, third) = tokio::join!(
        conn.request("session.create", create_params(&fx, "bounded"), None),
        conn.request("ping", big(), None),
        conn.request("ping", big(), None),
        conn.request("ping", big(), None),
    );
    created.expect("create");
    first.expect("the first waiting ping");
    second.expect("the second waiting ping");
    assert!(third.is_err(), "the third waiting ping was taken");
    let refused = remote_error(third);
    assert!(
        refused.message.contains("twice") && refused.message.contains("max_frame_bytes"),
        "{refused:?}"
    );
    // Once answered, their bytes are given back: the same pings pass again.
    for _ in 0..3 {
        conn.request("ping", big(), None)
            .await
            .expect("a ping after");
    }
    served.shut_down().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_holds_at_most_its_share_of_sessions_until_it_lets_one_go() {
    let fx = Fixture::new().await;
    let served =
        Served::start_with_endpoint(&fx, |_| {}, |config| config.max_sessions_per_connection = 2)
            .await;
    let (conn, _events) = connected(served.addr, "token-a").await;
    for id in ["held-1", "held-2"] {
        conn.request("session.create", create_params(&fx, id), None)
            .await
            .expect("create");
    }
    let refused = remote_error(
        conn.request("session.create", create_params(&fx, "held-3"), None)
            .await,
    );
    assert!(
        refused.message.contains("max_sessions_per_connection"),
        "{refused:?}"
    );
    // Letting one go makes room; reopening one it holds needs none.
    conn.request("session.resume", create_params(&fx, "held-2"), None)
        .await
        .expect("a session it holds reopens");
    conn.request("session.detach", json!({"sessionId": "held-1"}), None)
        .await
        .expect("detach");
    conn.request("session.create", create_params(&fx, "held-3"), None)
        .await
        .expect("create after letting one go");
    // A send the endpoint would have to hold to the turn's end is refused with the fix, and
    // so is a field no SDK sends.
    for (field, said) in [
        ("wait", "wait for session.idle"),
        ("billable", "not a session.send field"),
    ] {
        let params = json!({"sessionId": "held-3", "prompt": "REPLY=x", field: true});
        let refused = remote_error(conn.request("session.send", params, None).await);
        assert!(refused.message.contains(said), "{field}: {refused:?}");
    }
    served.shut_down().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_switched_model_stays_switched_when_the_session_resumes_on_another_process() {
    let fx = Fixture::new().await;
    // A warm spare (the default) may resume the session ahead, with its create-time config.
    let served = Served::start(&fx).await;
    let (conn, mut events) = connected(served.addr, "token-a").await;
    conn.request("session.create", create_params(&fx, "switched"), None)
        .await
        .expect("create");
    conn.request(
        "session.model.switchTo",
        json!({"sessionId": "switched", "modelId": "scripted-model-2"}),
        None,
    )
    .await
    .expect("switchTo");
    let model_of_last_call =
        || fx.model.requests().pop().expect("a model call").body["model"].clone();
    conn.request(
        "session.send",
        json!({"sessionId": "switched", "prompt": "REPLY=one"}),
        None,
    )
    .await
    .expect("send");
    until_event(&mut events, "session.idle").await;
    assert_eq!(model_of_last_call(), "scripted-model-2");
    // The process goes (an OOM kill, say): the next call resumes the session elsewhere, and
    // the runtime's resume selects the create-time model.
    kill_the_process(&served).await;
    conn.request(
        "session.send",
        json!({"sessionId": "switched", "prompt": "REPLY=two"}),
        None,
    )
    .await
    .expect("send after the kill");
    until_event(&mut events, "session.idle").await;
    assert_eq!(
        model_of_last_call(),
        "scripted-model-2",
        "the switch was lost with the process"
    );
    served.shut_down().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn updated_settings_stay_when_the_session_resumes_on_another_process() {
    let fx = Fixture::new().await;
    let served = Served::start(&fx).await;
    let (conn, mut events) = connected(served.addr, "token-a").await;
    // Created with the client's tools only (none here); a built-in one offered by an update.
    conn.request("session.create", create_params(&fx, "updated"), None)
        .await
        .expect("create");
    conn.request(
        "session.options.update",
        json!({"sessionId": "updated", "availableTools": ["custom:*", "view"]}),
        None,
    )
    .await
    .expect("update");
    // The tools of the turn's model call (the one carrying its prompt: the runtime may make
    // calls of its own between turns).
    let tools_of_call_with = |prompt: &str| {
        let body = fx
            .model
            .requests()
            .into_iter()
            .rev()
            .find(|r| r.body["messages"].to_string().contains(prompt))
            .expect("the turn's model call")
            .body;
        body["tools"]
            .as_array()
            .map(|tools| {
                tools
                    .iter()
                    .filter_map(|t| t["function"]["name"].as_str().map(str::to_owned))
                    .collect::<Vec<_>>()
            })
            .unwrap_or_default()
    };
    turn_to_idle(&conn, &mut events, &served, "updated", "one").await;
    assert_eq!(tools_of_call_with("REPLY=one"), ["view"], "the update took");
    // The process goes: the next turn resumes the session elsewhere with its create-time
    // config, and the update is applied again.
    kill_the_process(&served).await;
    turn_to_idle(&conn, &mut events, &served, "updated", "two").await;
    assert_eq!(
        tools_of_call_with("REPLY=two"),
        ["view"],
        "the update was lost with the process"
    );
    served.shut_down().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_turn_past_the_endpoints_limit_is_aborted_and_its_client_told_why() {
    let fx = Fixture::new().await;
    let served = Served::start_with_endpoint(
        &fx,
        |_| {},
        |config| config.max_turn_duration = Duration::from_millis(600),
    )
    .await;
    let (conn, mut events) = connected(served.addr, "token-a").await;
    conn.request("session.create", create_params(&fx, "long"), None)
        .await
        .expect("create");
    conn.request(
        "session.send",
        json!({"sessionId": "long", "prompt": "SCENARIO:slow SLOW=100x100"}),
        None,
    )
    .await
    .expect("send");
    // The client hears why, then the idle that ends its `sendAndWait`.
    let told = async {
        let mut error = None;
        while let Some(params) = events.recv().await {
            match params["event"]["type"].as_str() {
                Some("session.error") => error = Some(params["event"]["data"].clone()),
                Some("session.idle") => return (error, params["event"]["data"].clone()),
                _ => {}
            }
        }
        panic!("the connection closed before the idle");
    };
    let (error, idle) = tokio::time::timeout(SCENARIO_LIMIT, told)
        .await
        .expect("the client is told its turn ended");
    let error = error.expect("a session.error before the idle");
    assert_eq!(
        error["errorType"],
        copilot_pool::sdk_endpoint::TURN_LIMIT,
        "{error}"
    );
    assert!(
        error["message"]
            .as_str()
            .is_some_and(|m| m.contains("max_turn_duration")),
        "{error}"
    );
    assert_eq!(idle["aborted"], true, "{idle}");
    // The session goes on: the next turn runs.
    conn.request(
        "session.send",
        json!({"sessionId": "long", "prompt": "REPLY=after the limit"}),
        None,
    )
    .await
    .expect("a send after the limit");
    until_event(&mut events, "session.idle").await;
    served.shut_down().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_leaves_mid_turn_has_its_turn_aborted_and_the_agent_resumes_the_session_later()
 {
    let fx = Fixture::new().await;
    let served = Served::start(&fx).await;
    let (first, mut events) = connected(served.addr, "token-a").await;
    first
        .request("session.create", create_params(&fx, "leaver"), None)
        .await
        .expect("create");
    first
        .request(
            "session.send",
            json!({"sessionId": "leaver", "prompt": "SCENARIO:slow SLOW=300x100"}),
            None,
        )
        .await
        .expect("send");
    until_event(&mut events, "assistant.message_delta").await;
    assert_eq!(served.endpoint.running_turns(), 1);

    // Another connection of the same agent cannot take the session while it is held.
    let (second, mut second_events) = connected(served.addr, "token-a").await;
    let held = remote_error(
        second
            .request("session.resume", create_params(&fx, "leaver"), None)
            .await,
    );
    assert!(held.message.contains("another connection"), "{held:?}");

    first.close(copilot_pool::rpc::CloseCause::Local);
    drop(first);
    tokio::time::timeout(Duration::from_secs(15), served.endpoint.turns_finished())
        .await
        .expect("the turn of the client that left is aborted");

    // The same agent takes the session up again and goes on with its history.
    second
        .request("session.resume", create_params(&fx, "leaver"), None)
        .await
        .expect("resume after the first client left");
    second
        .request(
            "session.send",
            json!({"sessionId": "leaver", "prompt": "REPLY=back again"}),
            None,
        )
        .await
        .expect("send");
    until_event(&mut second_events, "session.idle").await;
    assert!(
        fx.last_model_request().contains("SCENARIO:slow"),
        "{}",
        fx.last_model_request()
    );
    // Still one process: the session was parked, not moved.
    assert_eq!(served.pool.status().await.expect("status").workers.len(), 1);
    served.shut_down().await;
}

/// One JSON-RPC frame, as the endpoint reads them (`rpc::FrameCodec`).
fn frame(message: &str) -> BytesMut {
    let mut frame = BytesMut::new();
    FrameCodec::default()
        .encode(Bytes::copy_from_slice(message.as_bytes()), &mut frame)
        .expect("a frame");
    frame
}

#[test]
fn the_raw_frames_are_the_wire_format_the_sdks_speak() {
    // Pinned here, not only by the codec both sides of these tests share.
    assert_eq!(&frame("{}")[..], b"Content-Length: 2\r\n\r\n{}");
}

/// Writes one JSON-RPC frame on a raw stream.
async fn write_raw_frame(stream: &mut TcpStream, message: &Value) {
    let frame = frame(&message.to_string());
    stream.write_all(&frame).await.expect("write");
}

/// Reads one JSON-RPC frame from a raw stream, and not a byte more (what follows is the
/// next read's).
async fn read_raw_frame(stream: &mut TcpStream) -> Value {
    let (mut codec, mut read) = (FrameCodec::default(), BytesMut::new());
    loop {
        if let Some(body) = codec.decode(&mut read).expect("a frame") {
            return serde_json::from_slice(&body).expect("JSON");
        }
        read.put_u8(stream.read_u8().await.expect("a frame's next byte"));
    }
}

/// Reads frames until the answer to call `id` (events and requests on the way are skipped).
async fn until_answer(stream: &mut TcpStream, id: u64) -> Value {
    loop {
        let frame = read_raw_frame(stream).await;
        if frame["id"] == id && frame.get("method").is_none() {
            return frame;
        }
    }
}

/// SIGKILLs the pool's (first) process, and waits until its group is gone and the pool has
/// seen it go (a turn sent in the moment between a process's death and the pool hearing of
/// it ends crashed; the next one resumes).
async fn kill_the_process(served: &Served) {
    let pid = served.pool.status().await.expect("status").workers[0].pid;
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(pid as i32),
        nix::sys::signal::Signal::SIGKILL,
    )
    .expect("kill -9");
    assert!(
        support::procs::wait_group_gone(pid, Duration::from_secs(10))
            .await
            .is_empty()
    );
    eventually("the pool saw the killed process go", || async {
        served
            .pool
            .status()
            .await
            .is_ok_and(|status| status.workers.iter().all(|w| w.pid != pid))
    })
    .await;
}

/// Polls `check` (each an RPC round trip) until it holds, for at most 10 s.
async fn eventually<F, Fut>(what: &str, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = Instant::now() + Duration::from_secs(10);
    while !check().await {
        assert!(Instant::now() < deadline, "{what}");
        tokio::task::yield_now().await;
    }
}

// One thread: the endpoint reads the call and the client's end together, and runs the
// client's close before the call's handler (as a busy endpoint may).
#[tokio::test]
async fn a_session_opened_as_its_client_leaves_is_not_left_held_by_the_gone_connection() {
    let fx = Fixture::new().await;
    let served = Served::start(&fx).await;
    let (second, _second_events) = connected(served.addr, "token-a").await;
    for round in 0..3 {
        // The create and the client's end reach the endpoint together (one thread: it reads
        // both before the create's handler runs, and closes the client first).
        let mut first = TcpStream::connect(served.addr).await.expect("connect");
        write_raw_frame(&mut first, &json!({"jsonrpc": "2.0", "id": 1, "method": "connect", "params": {"token": "token-a"}})).await;
        let answer = read_raw_frame(&mut first).await;
        assert_eq!(answer["result"]["ok"], true, "{answer}");
        let id = format!("leaving-{round}");
        let create = json!({"jsonrpc": "2.0", "id": 2, "method": "session.create", "params": create_params(&fx, &id)});
        write_raw_frame(&mut first, &create).await;
        first.shutdown().await.expect("shutdown");
        let mut rest = Vec::new();
        let _ = first.read_to_end(&mut rest).await;
        // Another connection of the agent may then take the session (deleting it here):
        // the gone connection holds nothing.
        eventually(
            &format!("{id} stays held by the connection that left"),
            || async {
                match second
                    .request("session.delete", json!({"sessionId": id}), None)
                    .await
                {
                    Err(RpcError::Remote { error, .. }) => {
                        !error.message.contains("another connection")
                    }
                    _ => true,
                }
            },
        )
        .await;
    }
    served.shut_down().await;
}

// One thread: the endpoint reads the call and the client's end together, and runs the
// client's close before the call's handler (as a busy endpoint may).
#[tokio::test]
async fn a_deletion_whose_client_leaves_before_the_answer_still_deletes_the_session() {
    let fx = Fixture::new().await;
    let served = Served::start(&fx).await;
    let (first, mut first_events) = connected(served.addr, "token-a").await;
    first
        .request("session.create", create_params(&fx, "left-behind"), None)
        .await
        .expect("create");
    turn_to_idle(&first, &mut first_events, &served, "left-behind", "kept").await;
    first
        .request("session.detach", json!({"sessionId": "left-behind"}), None)
        .await
        .expect("detach");
    let state = fx
        .scratch
        .path()
        .join("agents/agents/agent-a/copilot/session-state/left-behind");
    assert!(state.is_dir(), "{}", state.display());
    // The delete, and the client's end right behind it, unanswered.
    let mut leaving = TcpStream::connect(served.addr).await.expect("connect");
    write_raw_frame(
        &mut leaving,
        &json!({"jsonrpc": "2.0", "id": 1, "method": "connect", "params": {"token": "token-a"}}),
    )
    .await;
    let answer = read_raw_frame(&mut leaving).await;
    assert_eq!(answer["result"]["ok"], true, "{answer}");
    let delete = json!({"jsonrpc": "2.0", "id": 2, "method": "session.delete", "params": {"sessionId": "left-behind"}});
    write_raw_frame(&mut leaving, &delete).await;
    leaving.shutdown().await.expect("shutdown");
    drop(leaving);
    eventually(
        "the deletion of the client that left was cut off",
        || async { !state.exists() },
    )
    .await;
    drop(first);
    served.shut_down().await;
}

// One thread: the endpoint reads the call and the client's end together, and runs the
// client's close before the call's handler (as a busy endpoint may).
#[tokio::test]
async fn a_turn_sent_as_its_client_leaves_does_not_run_on_with_nobody_to_stop_it() {
    let fx = Fixture::new().await;
    let served = Served::start(&fx).await;
    let (first, _events) = connected(served.addr, "token-a").await;
    first
        .request("session.create", create_params(&fx, "orphan"), None)
        .await
        .expect("create");
    // A slow turn (30 s) sent, and the client gone right behind it.
    let send = tokio::spawn({
        let first = first.clone();
        async move {
            first
                .request(
                    "session.send",
                    json!({"sessionId": "orphan", "prompt": "SCENARIO:slow SLOW=300x100"}),
                    None,
                )
                .await
        }
    });
    tokio::task::yield_now().await;
    first.close(copilot_pool::rpc::CloseCause::Local);
    drop(first);
    let _ = send.await;
    // Its lease comes back within the abort's settling, not when the 30 s turn ends.
    eventually(
        "the turn of the client that left still holds its lease",
        || async {
            let status = served.pool.status().await.expect("status");
            status.leased == 0 && served.endpoint.running_turns() == 0
        },
    )
    .await;
    served.shut_down().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn calls_naming_no_session_are_answered_by_a_process_of_the_agent_before_any_session() {
    let fx = Fixture::new().await;
    let served = Served::start(&fx).await;
    let (conn, mut events) = connected(served.addr, "token-a").await;
    // No session yet: a process of the agent's home answers, and no conversation is opened.
    let listed = conn
        .request("session.list", json!({}), None)
        .await
        .expect("session.list before any session");
    assert_eq!(listed["sessions"], json!([]), "{listed}");
    conn.request("session.getLastId", json!({}), None)
        .await
        .expect("session.getLastId before any session");
    let status = served.pool.status().await.expect("status");
    assert_eq!(
        (status.workers.len(), status.conversations, status.leased),
        (1, 0, 0),
        "{status:?}"
    );
    assert_eq!(status.workers[0].leases, 0, "the process was given back");
    let idle_pid = status.workers[0].pid;

    // After a session, the calls go to a process of that session's key, which lists it
    // (the runtime lists a session once it has a turn).
    conn.request("session.create", create_params(&fx, "listed-1"), None)
        .await
        .expect("create");
    turn_to_idle(&conn, &mut events, &served, "listed-1", "listed").await;
    let listed = conn
        .request("session.list", json!({}), None)
        .await
        .expect("session.list");
    let ids: Vec<&str> = listed["sessions"]
        .as_array()
        .expect("sessions")
        .iter()
        .filter_map(|s| s["sessionId"].as_str())
        .collect();
    assert_eq!(ids, ["listed-1"], "{listed}");
    let status = served.pool.status().await.expect("status");
    assert_eq!(status.conversations, 1, "{status:?}");
    assert!(
        status.workers.iter().any(|w| w.pid != idle_pid),
        "the session's key has its own process: {status:?}"
    );
    served.shut_down().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_node_sdks_own_handlers_answer_permission_ask_user_hooks_plan_mode_and_transforms() {
    let fx = Fixture::new().await;
    let served = Served::start(&fx).await;
    let mut node = Scenario::start("requests", &fx, &served).await;
    let permission = node.step("permission").await;
    assert_eq!(
        permission["content"], "tool said: colour of the day is teal",
        "{permission}"
    );
    assert_eq!(
        permission["permissions"],
        json!(["custom-tool"]),
        "{permission}"
    );
    // systemMessage.transform reached the SDK's callback, and its result the model.
    assert!(
        permission["transforms"].as_u64().unwrap_or(0) >= 1,
        "{permission}"
    );
    assert!(
        fx.last_model_request().contains("TRANSFORMED-BY-THE-SDK"),
        "the transformed section reaches the model"
    );
    let ask = node.step("ask_user").await;
    assert_eq!(
        ask["questions"],
        json!([{"question": "Pick a colour", "choices": ["red", "blue"]}]),
        "{ask}"
    );
    assert!(
        ask["content"].as_str().is_some_and(|c| c.contains("blue")),
        "{ask}"
    );
    let hook = node.step("hook").await;
    assert_eq!(hook["content"], "rewritten by the hook", "{hook}");
    assert!(
        hook["prompts"]
            .as_array()
            .is_some_and(|p| p.iter().any(|p| p == "HOOK-ME please")),
        "{hook}"
    );
    let plan = node.step("plan").await;
    assert_eq!(plan["plans"], json!(["the plan is ready"]), "{plan}");
    // The SDK's answer reached the runtime: the tool's result carries its feedback.
    assert!(
        plan["content"]
            .as_str()
            .is_some_and(|c| c.contains("keep planning, said the SDK")),
        "{plan}"
    );
    node.done().await;
    served.shut_down().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_sdk_session_moves_to_a_fresh_process_between_turns_when_its_process_is_recycled() {
    let fx = Fixture::new().await;
    let served = Served::start_with(&fx, |config| config.max_turns_per_process = 1).await;
    let mut node = Scenario::start("moved", &fx, &served).await;
    assert_eq!(node.step("first").await["content"], "first of three");
    assert_eq!(node.step("second").await["content"], "second of three");
    assert_eq!(node.step("third").await["content"], "third of three");
    node.done().await;
    // Each turn ran on a process of its own, the session resumed on the next one, and the
    // model saw the earlier turns.
    let status = served.pool.status().await.expect("status");
    assert!(status.totals.processes_spawned >= 3, "{status:?}");
    assert!(status.totals.resumed >= 2, "{status:?}");
    let request = fx.last_model_request();
    assert!(
        request.contains("first of three") && request.contains("second of three"),
        "{request}"
    );
    served.shut_down().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_node_sdk_client_of_the_agent_resumes_a_session_another_client_left() {
    let fx = Fixture::new().await;
    // One session a process, one process: the second client's own session detaches the first.
    let served = Served::start_with(&fx, |config| {
        config.max_sessions_per_process = 1;
        config.max_processes_per_key = 1;
    })
    .await;
    let mut node = Scenario::start("resume", &fx, &served).await;
    let resumed = node.step("resumed").await;
    assert_eq!(resumed["content"], "resumed fine", "{resumed}");
    assert_eq!(resumed["earlier"], true, "{resumed}");
    // The open's own event reaches a handler registered when the call returned, as the
    // runtime sends it: after its answer.
    assert_eq!(resumed["firstAfterCreate"], "session.start", "{resumed}");
    assert_eq!(resumed["firstAfterResume"], "session.resume", "{resumed}");
    assert!(
        fx.last_model_request().contains("kumquat"),
        "the model saw the turn of the first client"
    );
    node.done().await;
    served.shut_down().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http_and_sdk_clients_share_the_pool_and_neither_reaches_the_others_conversations() {
    let fx = Fixture::new().await;
    let served = Served::start(&fx).await;
    let router = copilot_pool::http::router(
        served.pool.clone(),
        copilot_pool::http::ApiConfig::default(),
    );
    let (http_addr, http_stop, http_server) = support::api::serve(router).await;
    let model = fx.endpoint.base_url();

    // An HTTP conversation of agent-a, and its CLI session id.
    let first = support::api::summary(
        http_addr,
        None,
        &support::api::turn(&model, "agent-a", "http-1", "REPLY=from http"),
    )
    .await;
    assert_eq!(first.status, 200, "{}", first.body);
    let http_session = first.json()["session_id"]
        .as_str()
        .expect("session_id")
        .to_owned();

    // The SDK side cannot open the HTTP conversation's session, by resume or by create.
    let (conn, mut events) = connected(served.addr, "token-a").await;
    for method in ["session.resume", "session.create"] {
        let refused = remote_error(
            conn.request(method, create_params(&fx, &http_session), None)
                .await,
        );
        assert!(
            refused.message.contains("HTTP conversation") && refused.message.contains("http-1"),
            "{method}: {refused:?}"
        );
    }

    // Both at once: an SDK turn and an HTTP turn on the same pool.
    conn.request("session.create", create_params(&fx, "mixed-1"), None)
        .await
        .expect("create");
    let sdk_turn = async {
        conn.request(
            "session.send",
            json!({"sessionId": "mixed-1", "prompt": "SCENARIO:slow SLOW=10x50"}),
            None,
        )
        .await
        .expect("send");
        until_event(&mut events, "session.idle").await;
    };
    let body = support::api::turn(&model, "agent-a", "http-2", "REPLY=at the same time");
    let http_turn = support::api::summary(http_addr, None, &body);
    let ((), second) = tokio::join!(sdk_turn, http_turn);
    assert_eq!(second.status, 200, "{}", second.body);
    assert_eq!(
        second.json()["final_text"],
        "at the same time",
        "{}",
        second.body
    );

    // The HTTP side cannot run, abort, compact or reset the SDK session.
    let refused = support::api::summary(
        http_addr,
        None,
        &support::api::turn(&model, "agent-a", "sdk:mixed-1", "REPLY=intruder"),
    )
    .await;
    assert_eq!(refused.status, 400, "{}", refused.body);
    assert!(refused.body.contains("SDK endpoint"), "{}", refused.body);
    for (method, path) in [
        ("POST", "/v1/sessions/agent-a/sdk:mixed-1/abort"),
        ("POST", "/v1/sessions/agent-a/sdk:mixed-1/compact"),
        ("DELETE", "/v1/sessions/agent-a/sdk:mixed-1"),
    ] {
        let response = support::http::call(http_addr, method, path, None, None).await;
        assert_eq!(response.status, 400, "{method} {path}: {}", response.body);
    }
    // Neither side disturbed the other: both go on.
    let again = support::api::summary(
        http_addr,
        None,
        &support::api::turn(&model, "agent-a", "http-1", "REPLY=http again"),
    )
    .await;
    assert_eq!(again.json()["open_reason"], "attached", "{}", again.body);
    conn.request(
        "session.send",
        json!({"sessionId": "mixed-1", "prompt": "REPLY=sdk again"}),
        None,
    )
    .await
    .expect("send");
    until_event(&mut events, "session.idle").await;

    drop(conn);
    let _ = http_stop.send(());
    let _ = tokio::time::timeout(Duration::from_secs(10), http_server).await;
    served.shut_down().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_python_sdk_runs_tools_permissions_ask_user_hooks_streaming_and_abort_through_the_pool()
{
    let fx = Fixture::new().await;
    let served = Served::start(&fx).await;
    let mut py = Scenario::start_python("turns", &fx, &served).await;
    let tool = py.step("tool").await;
    assert_eq!(
        tool["content"], "tool said: secret number for alpha is 42",
        "{tool}"
    );
    assert_eq!(tool["toolRequested"], true, "{tool}");
    let id = tool["sessionId"].as_str().expect("session id").to_owned();
    let home = fx
        .scratch
        .path()
        .join("agents/agents/agent-a/copilot/session-state");
    assert!(home.join(&id).is_dir(), "{} has no {id}", home.display());
    let permission = py.step("permission").await;
    assert_eq!(
        permission["content"], "tool said: colour of the day is teal",
        "{permission}"
    );
    assert_eq!(
        permission["permissions"],
        json!(["custom-tool"]),
        "{permission}"
    );
    let ask = py.step("ask_user").await;
    assert_eq!(
        ask["questions"],
        json!([{"question": "Pick a colour", "choices": ["red", "blue"]}]),
        "{ask}"
    );
    assert!(
        ask["content"].as_str().is_some_and(|c| c.contains("blue")),
        "{ask}"
    );
    let hook = py.step("hook").await;
    assert_eq!(hook["content"], "rewritten by the hook", "{hook}");
    let streaming = py.step("streaming").await;
    let content = streaming["content"].as_str().expect("content");
    assert!(content.starts_with("slow-chunk 0"), "{streaming}");
    assert_eq!(
        streaming["deltas"], content,
        "the deltas add up to the message"
    );
    let abort = py.step("abort").await;
    assert_eq!(abort["aborted"], true, "{abort}");
    let after = py.step("after-abort").await;
    assert_eq!(after["content"], "still here", "{after}");
    py.done().await;
    let status = served.pool.status().await.expect("status");
    assert_eq!(status.workers.len(), 1, "{status:?}");
    served.shut_down().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_process_ends_the_python_sdk_turn_within_a_second_and_the_session_goes_on() {
    let fx = Fixture::new().await;
    let served = Served::start(&fx).await;
    let python = Scenario::start_python("crash", &fx, &served).await;
    kill_mid_turn_and_go_on(python, &fx, &served).await;
    served.shut_down().await;
}
