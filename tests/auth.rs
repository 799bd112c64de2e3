//! Credentials end to end, with fake tokens and no account: the real runtime in token mode
//! talks to the scripted model's GitHub/Copilot API stand-in on loopback
//! (`COPILOT_API_URL`/`COPILOT_DEBUG_GITHUB_API_URL` in its environment), so a test sees
//! what the runtime lets it see — its auth status, the process's environment and argv, and
//! the credential of every request it makes — for each of the five levels over HTTP, in
//! the library's router and in the daemon. The last test runs one real turn with a real
//! token, only when `COPILOT_POOL_LIVE_TOKEN` is set.

mod support;

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use copilot_pool::auth::{AuthMode, AuthSource, ResolvedAuth, fingerprint};
use copilot_pool::http::{self, ApiConfig};
use copilot_pool::kinds::Priming;
use copilot_pool::pool::{Pool, PoolConfig, PoolEvent, PoolKey};
use copilot_pool::rpc::messages::{AuthGetStatus, Empty, ProviderConfig, SessionConfig};
use copilot_pool::sandbox::Sandbox;
use copilot_pool::scripted_model::{CopilotApiStandIn, ScriptedModel};
use copilot_pool::secret::Secret;
use copilot_pool::worker::{AUTH_TOKEN_ENV, TOKEN_VARIABLES, WorkerHandle};
use serde_json::{Value, json};
use support::api::summary;
use support::http::{Daemon, call};
use support::pool_fixture::{Fixture, shutdown_leaves_nothing, token, wait_event};
use support::procs::{environ, group_members};

/// The command line of a live process.
fn cmdline(pid: u32) -> Vec<String> {
    std::fs::read(format!("/proc/{pid}/cmdline"))
        .unwrap_or_default()
        .split(|b| *b == 0)
        .filter(|a| !a.is_empty())
        .map(|a| String::from_utf8_lossy(a).into_owned())
        .collect()
}

/// Checks every process of the worker's group: `token` is in the environment only as the
/// value of `COPILOT_SDK_AUTH_TOKEN` (or nowhere, for `None`), no token variable is set,
/// and no secret in `never` appears anywhere in the environment or on a command line.
fn assert_token_only_in_the_sdk_variable(pid: u32, token: Option<&str>, never: &[&str]) {
    let members = group_members(pid);
    assert!(!members.is_empty(), "worker {pid} is not running");
    for (member, _) in members {
        let env = environ(member);
        let argv = cmdline(member).join(" ");
        let sdk = env
            .iter()
            .find(|(k, _)| k == AUTH_TOKEN_ENV)
            .map(|(_, v)| v.as_str());
        if member == pid {
            assert_eq!(sdk, token, "{AUTH_TOKEN_ENV} of worker {pid}");
        }
        for (name, value) in &env {
            assert!(
                name == AUTH_TOKEN_ENV || !TOKEN_VARIABLES.contains(&name.as_str()),
                "{name} is set in process {member}"
            );
            for secret in token.iter().chain(never) {
                assert!(
                    name == AUTH_TOKEN_ENV && Some(*secret) == token || !value.contains(secret),
                    "a token is in {name} of process {member}"
                );
            }
        }
        for secret in token.iter().chain(never) {
            assert!(
                !argv.contains(secret),
                "a token is on the command line of {member}"
            );
        }
    }
}

/// The fixture's pool config, its runtimes pointed at `stand_in`.
async fn config_with(fx: &Fixture, stand_in: &CopilotApiStandIn) -> PoolConfig {
    let mut config = fx.config().await;
    config.worker.extra_env.extend(stand_in.runtime_env());
    config
}

/// A token-mode turn on the scripted model: no provider, so the runtime's Copilot API
/// (the stand-in) answers.
fn token_turn(agent: &str, key: &str, reply: &str, auth: Option<Value>) -> Value {
    let mut body = json!({
        "agent_id": agent,
        "session_key": key,
        "prompt": format!("REPLY={reply}"),
        "model": ScriptedModel::MODEL_ID,
    });
    if let Some(auth) = auth {
        body["auth"] = auth;
    }
    body
}

/// A BYOK turn on the fixture's scripted model endpoint.
fn byok_turn(fx: &Fixture, agent: &str, key: &str, auth: Option<Value>) -> Value {
    let mut body = support::api::turn(&fx.endpoint.base_url(), agent, key, "REPLY=byok");
    if let Some(auth) = auth {
        body["auth"] = auth;
    }
    body
}

fn token_auth(profile_id: &str, version: String, token: &str, source: AuthSource) -> ResolvedAuth {
    ResolvedAuth {
        mode: AuthMode::Token,
        profile_id: Some(profile_id.to_owned()),
        profile_version: Some(version),
        token: Some(Secret::new(token)),
        source,
    }
}

fn no_token(mode: AuthMode, source: AuthSource) -> ResolvedAuth {
    ResolvedAuth {
        mode,
        profile_id: None,
        profile_version: None,
        token: None,
        source,
    }
}

/// The short hash of the key a lease of `agent` with `auth` must land on.
fn expected_key(
    agents_base: &Path,
    agent: &str,
    auth: &ResolvedAuth,
    provider: Option<&ProviderConfig>,
) -> String {
    let home = copilot_pool::home::resolve_copilot_home(None, None, agents_base, agent)
        .expect("the agent's home");
    PoolKey::new(&home, auth, provider, Some(ScriptedModel::MODEL_ID)).short_hash()
}

/// The pid of the one process of the key `key_hash` in `GET /v1/pool`.
async fn pid_of(addr: SocketAddr, key_hash: &str) -> u32 {
    let status = call(addr, "GET", "/v1/pool", None, None).await.json();
    let pids: Vec<u64> = status["processes"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|p| p["key_hash"] == key_hash)
        .filter_map(|p| p["pid"].as_u64())
        .collect();
    assert_eq!(pids.len(), 1, "one process of key {key_hash}: {status}");
    u32::try_from(pids[0]).expect("a pid")
}

/// Runs a turn and checks it ended idle with `reply`, and that every chat completion the
/// stand-in got during it carried `bearer`.
async fn run_token_turn(
    addr: SocketAddr,
    stand_in: &CopilotApiStandIn,
    body: &Value,
    bearer: &str,
) -> Value {
    let before = chats(stand_in).len();
    let answer = summary(addr, None, body).await;
    assert_eq!(answer.status, 200, "{}", answer.body);
    let end = answer.json();
    assert_eq!(end["status"], "idle", "{end}");
    let reply = body["prompt"]
        .as_str()
        .and_then(|p| p.strip_prefix("REPLY="));
    assert_eq!(end["final_text"].as_str(), reply, "{end}");
    let new: Vec<Option<String>> = chats(stand_in).split_off(before);
    assert!(
        !new.is_empty(),
        "the turn reached the stand-in's chat completions"
    );
    assert!(
        new.iter().all(|b| b.as_deref() == Some(bearer)),
        "every model call of the turn carries its conversation's token"
    );
    end
}

/// The bearer of every chat completion the stand-in received, oldest first.
fn chats(stand_in: &CopilotApiStandIn) -> Vec<Option<String>> {
    stand_in
        .requests()
        .iter()
        .filter(|r| r.path == "/chat/completions")
        .map(|r| r.bearer().map(str::to_owned))
        .collect()
}

/// Starts `config`'s pool with a short idle TTL and a warm spare, runs one token-mode turn
/// of `agent-a` in `work` (no provider: no tunnel answers its process's calls), and returns
/// how the spare its key then starts (once that process idled out) was primed.
async fn token_spare_priming(
    fx: &Fixture,
    mut config: PoolConfig,
    work: PathBuf,
) -> Option<Priming> {
    // The key's process idles out a second after its turn; the spare stands in for it.
    config.idle_ttl = std::time::Duration::from_secs(1);
    config.warm_spares = 1;
    let pool = Pool::start(config).await.expect("pool");
    let mut events = pool.subscribe();
    let mut req = fx.request("agent-a", "conv-1");
    req.working_directory = work;
    req.provider = None;
    req.auth = token("v1");
    let mut lease = pool.lease(req).await.expect("lease");
    let first_pid = lease.worker_pid();
    let outcome = lease.run("REPLY=one").await.expect("turn");
    assert_eq!(outcome.text, "one");
    drop(lease);
    let primed = match wait_event(
        &mut events,
        |e| matches!(e, PoolEvent::WorkerStarted { pid, .. } if *pid != first_pid),
    )
    .await
    {
        PoolEvent::WorkerStarted { primed, .. } => primed,
        other => unreachable!("{other:?}"),
    };
    shutdown_leaves_nothing(&pool).await;
    primed
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_token_keys_warm_spare_is_primed_by_a_turn_stopped_before_its_model_call_can_fail() {
    let fx = Fixture::new().await;
    let stand_in = fx.model.serve_copilot_api().await.expect("stand-in");
    let config = config_with(&fx, &stand_in).await;
    let primed = token_spare_priming(&fx, config, fx.scratch.work()).await;
    // Its spare's priming turn went up to its model call and was stopped there: the call
    // never failed (a failed call leaves the runtime ~30 MiB bigger) and reached no model.
    assert_eq!(primed, Some(Priming::Stopped));
    assert_eq!(chats(&stand_in).len(), 1, "only the real turn's model call");
}

/// As above, the worker in its sandbox (TCP connect to its template's ports only): the pool
/// lets it reach the priming sink, so its priming is still stopped before the call fails.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sandboxed_token_keys_spare_reaches_the_priming_sink_too() {
    let fx = Fixture::new().await;
    let stand_in = fx.model.serve_copilot_api().await.expect("stand-in");
    let mut config = config_with(&fx, &stand_in).await;
    let mut sandbox = Sandbox::new(
        PathBuf::from(env!("CARGO_BIN_EXE_copilot-pool")),
        vec!["sandbox-exec".into()],
    );
    sandbox.required = true;
    if let Some(dir) = config.worker.program.parent() {
        sandbox.read_exec.push(dir.to_path_buf());
    }
    if let Some(ports) = sandbox.tcp_connect.as_mut() {
        ports.extend(stand_in.runtime_env().iter().filter_map(|(_, url)| {
            url.rsplit(':')
                .next()?
                .trim_end_matches('/')
                .parse::<u16>()
                .ok()
        }));
    }
    config.worker.sandbox = Some(sandbox);
    // The work directory inside the agent's, where the sandbox lets it write.
    let work = fx.scratch.path().join("agents/agents/agent-a/work");
    std::fs::create_dir_all(&work).expect("work dir");
    let primed = token_spare_priming(&fx, config, work).await;
    assert_eq!(primed, Some(Priming::Stopped));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_token_process_is_authenticated_and_a_session_token_is_that_sessions_identity() {
    let fx = Fixture::new().await;
    let stand_in = fx.model.serve_copilot_api().await.expect("stand-in");
    let scratch = &fx.scratch;
    let mut config = support::worker_config(scratch).await;
    config.extra_env.extend(stand_in.runtime_env());

    // Without a token the process has no identity, even with the stand-in reachable.
    let anonymous = WorkerHandle::start(config.clone()).await.expect("worker");
    let status = anonymous
        .call::<AuthGetStatus>(&Empty {})
        .await
        .expect("auth.getStatus");
    assert!(!status.is_authenticated, "{status:?}");
    support::shutdown_and_check(&anonymous).await;

    // The process token authenticates the process (the runtime checked it with the stand-in).
    config.auth_token = Some(Secret::new("ghu_process_token_A"));
    let worker = WorkerHandle::start(config).await.expect("worker");
    let status = worker
        .call::<AuthGetStatus>(&Empty {})
        .await
        .expect("auth.getStatus");
    assert!(status.is_authenticated, "{status:?}");
    assert_eq!(status.auth_type.as_deref(), Some("token"), "{status:?}");
    assert!(
        stand_in.requests().iter().any(
            |r| r.path == "/copilot_internal/user" && r.bearer() == Some("ghu_process_token_A")
        ),
        "the runtime checked the process token with the stand-in"
    );

    // A session with its own gitHubToken: its model calls carry that token, not the
    // process's.
    let mut session = worker
        .create_session(SessionConfig {
            model: Some(ScriptedModel::MODEL_ID.to_owned()),
            git_hub_token: Some(Secret::new("ghu_session_token_B")),
            working_directory: Some(scratch.work().display().to_string()),
            available_tools: Some(Vec::new()),
            env_value_mode: Some("direct".to_owned()),
            ..Default::default()
        })
        .await
        .expect("a token-mode session");
    session
        .send("REPLY=as the session's own identity")
        .await
        .expect("send");
    let events = support::collect_turn(&mut session).await;
    assert_eq!(
        support::final_text(&events),
        "as the session's own identity"
    );
    let bearers = chats(&stand_in);
    assert!(!bearers.is_empty());
    assert!(
        bearers
            .iter()
            .all(|b| b.as_deref() == Some("ghu_session_token_B")),
        "model calls carry the session's token"
    );
    assert!(
        stand_in.requests().iter().any(
            |r| r.path == "/copilot_internal/user" && r.bearer() == Some("ghu_session_token_B")
        ),
        "the runtime resolved the session's own identity"
    );
    // The process holds the process token in COPILOT_SDK_AUTH_TOKEN only; the session
    // token never reaches an environment or a command line.
    assert_token_only_in_the_sdk_variable(
        worker.pid(),
        Some("ghu_process_token_A"),
        &["ghu_session_token_B"],
    );
    drop(session);
    support::shutdown_and_check(&worker).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_auth_level_over_http_selects_its_key_and_process_and_its_token_reaches_the_model() {
    let fx = Fixture::new().await;
    let stand_in = fx.model.serve_copilot_api().await.expect("stand-in");
    let config = config_with(&fx, &stand_in).await;
    let agents = config.agents_base_dir.clone();
    let pool = Pool::start(config).await.expect("pool");
    // The daemon's own token variables (as `serve` reads them with `[auth] env_fallback`).
    let mut with_env = ApiConfig::default();
    with_env.env_tokens = BTreeMap::from([
        ("GH_TOKEN".to_owned(), Secret::new("ghu_env_first")),
        ("GITHUB_TOKEN".to_owned(), Secret::new("ghu_env_second")),
    ]);
    let (addr, stop, server) = support::api::serve(http::router(pool.clone(), with_env)).await;
    let (plain, stop_plain, server_plain) =
        support::api::serve(http::router(pool.clone(), ApiConfig::default())).await;
    let mut allowing = ApiConfig::default();
    allowing.allow_logged_in_user = true;
    let (allowed, stop_allowed, server_allowed) =
        support::api::serve(http::router(pool.clone(), allowing)).await;

    // Explicit token with its profile id and version.
    let explicit = json!({"github_token": "ghu_explicit_one", "profile_id": "gw:explicit", "profile_version": "v1"});
    run_token_turn(
        addr,
        &stand_in,
        &token_turn("agent-a", "explicit", "explicit", Some(explicit.clone())),
        "ghu_explicit_one",
    )
    .await;
    let explicit_key = expected_key(
        &agents,
        "agent-a",
        &token_auth(
            "gw:explicit",
            "v1".into(),
            "ghu_explicit_one",
            AuthSource::ExplicitToken,
        ),
        None,
    );
    let explicit_pid = pid_of(addr, &explicit_key).await;
    assert_token_only_in_the_sdk_variable(
        explicit_pid,
        Some("ghu_explicit_one"),
        &["ghu_env_first", "ghu_env_second"],
    );
    assert!(cmdline(explicit_pid).contains(&"--no-auto-login".to_owned()));

    // The gateway-resolved token: its profile id, the token's fingerprint as the version.
    let resolved =
        json!({"resolved_token": "ghu_resolved_one", "auth_profile_id": "github-copilot:work"});
    run_token_turn(
        addr,
        &stand_in,
        &token_turn("agent-a", "resolved", "resolved", Some(resolved)),
        "ghu_resolved_one",
    )
    .await;
    let resolved_key = expected_key(
        &agents,
        "agent-a",
        &token_auth(
            "github-copilot:work",
            fingerprint("ghu_resolved_one"),
            "ghu_resolved_one",
            AuthSource::ResolvedProfile,
        ),
        None,
    );
    let resolved_pid = pid_of(addr, &resolved_key).await;
    assert_token_only_in_the_sdk_variable(
        resolved_pid,
        Some("ghu_resolved_one"),
        &["ghu_explicit_one"],
    );

    // No token in the request: the daemon's variables, GH_TOKEN before GITHUB_TOKEN.
    run_token_turn(
        addr,
        &stand_in,
        &token_turn("agent-a", "env", "env", None),
        "ghu_env_first",
    )
    .await;
    let env_key = expected_key(
        &agents,
        "agent-a",
        &token_auth(
            "env:GH_TOKEN",
            fingerprint("ghu_env_first"),
            "ghu_env_first",
            AuthSource::Env("GH_TOKEN"),
        ),
        None,
    );
    let env_pid = pid_of(addr, &env_key).await;
    assert_token_only_in_the_sdk_variable(env_pid, Some("ghu_env_first"), &["ghu_env_second"]);

    // The explicit token wins over a resolved one, on the explicit level's process.
    let both = json!({"github_token": "ghu_explicit_one", "profile_id": "gw:explicit", "profile_version": "v1",
                      "resolved_token": "ghu_resolved_two", "auth_profile_id": "github-copilot:work"});
    run_token_turn(
        addr,
        &stand_in,
        &token_turn("agent-a", "both", "both", Some(both)),
        "ghu_explicit_one",
    )
    .await;
    // The same profile id and version with another token share the process (the caller's
    // key), yet the conversation's model calls carry its own token (the session identity).
    let same_version = json!({"github_token": "ghu_explicit_two", "profile_id": "gw:explicit", "profile_version": "v1"});
    run_token_turn(
        addr,
        &stand_in,
        &token_turn(
            "agent-a",
            "same-version",
            "same version",
            Some(same_version.clone()),
        ),
        "ghu_explicit_two",
    )
    .await;
    assert_eq!(pid_of(addr, &explicit_key).await, explicit_pid);
    // The same level again reuses its process.
    run_token_turn(
        addr,
        &stand_in,
        &token_turn("agent-a", "env-2", "env again", None),
        "ghu_env_first",
    )
    .await;
    assert_eq!(pid_of(addr, &env_key).await, env_pid);
    let distinct: std::collections::BTreeSet<u32> = [explicit_pid, resolved_pid, env_pid].into();
    assert_eq!(distinct.len(), 3, "each level has its own process");

    // Two agents with different tokens never share a process — not even with the same
    // profile id and version.
    run_token_turn(
        addr,
        &stand_in,
        &token_turn("agent-b", "explicit", "agent b", Some(same_version.clone())),
        "ghu_explicit_two",
    )
    .await;
    let b_key = expected_key(
        &agents,
        "agent-b",
        &token_auth(
            "gw:explicit",
            "v1".into(),
            "ghu_explicit_two",
            AuthSource::ExplicitToken,
        ),
        None,
    );
    let b_pid = pid_of(addr, &b_key).await;
    assert!(
        !distinct.contains(&b_pid),
        "agent-b runs in its own process"
    );
    assert_token_only_in_the_sdk_variable(b_pid, Some("ghu_explicit_two"), &["ghu_explicit_one"]);

    // Conversations resumed on a new process keep their own tokens as their session
    // identities (`gitHubToken` goes with session.resume as with session.create): the
    // same-version conversation resumes on the process its neighbour's token started. The
    // replacement (started at once, unprimed) may have resumed a conversation ahead of its
    // lease with what its last open used: it is then `attached` there, its token the same.
    let mut events = pool.subscribe();
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(i32::try_from(explicit_pid).expect("a pid")),
        nix::sys::signal::Signal::SIGKILL,
    )
    .expect("kill the explicit level's process");
    wait_event(
        &mut events,
        |e| matches!(e, PoolEvent::WorkerCrashed { pid, .. } if *pid == explicit_pid),
    )
    .await;
    for (key, reply, auth, bearer) in [
        ("explicit", "explicit again", explicit, "ghu_explicit_one"),
        (
            "same-version",
            "same version again",
            same_version,
            "ghu_explicit_two",
        ),
    ] {
        let body = token_turn("agent-a", key, reply, Some(auth));
        let end = run_token_turn(addr, &stand_in, &body, bearer).await;
        assert!(
            end["open_reason"] == "resumed" || end["open_reason"] == "attached",
            "{end}"
        );
    }
    let restarted = pid_of(addr, &explicit_key).await;
    assert_ne!(restarted, explicit_pid);
    assert_token_only_in_the_sdk_variable(
        restarted,
        Some("ghu_explicit_one"),
        &["ghu_explicit_two"],
    );

    // The logged-in user, not allowed (the default): asking for it is a 400 with the fix,
    // and so is a request with no token and no provider; neither creates anything.
    let asked = summary(
        addr,
        None,
        &byok_turn(
            &fx,
            "agent-c",
            "c",
            Some(json!({"use_logged_in_user": true})),
        ),
    )
    .await;
    assert_eq!(asked.status, 400, "{}", asked.body);
    assert_eq!(asked.json()["code"], "bad_request");
    let message = asked.json()["message"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    assert!(message.contains("allow_logged_in_user"), "{message}");
    let nothing = summary(plain, None, &token_turn("agent-c", "c", "no", None)).await;
    assert_eq!(nothing.status, 400, "{}", nothing.body);
    let message = nothing.json()["message"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    for fix in [
        "github_token",
        "resolved_token",
        "BYOK",
        "env_fallback",
        "allow_logged_in_user",
    ] {
        assert!(message.contains(fix), "{fix} missing: {message}");
    }
    assert!(
        !agents.join("agents/agent-c/work").exists(),
        "a refused request creates nothing"
    );

    // BYOK with no token (the existing contract) still runs: with no GitHub identity at
    // all, no token and no stored login.
    let byok = summary(plain, None, &byok_turn(&fx, "agent-c", "byok", None)).await;
    assert_eq!(byok.status, 200, "{}", byok.body);
    assert_eq!(byok.json()["final_text"], "byok", "{}", byok.body);
    let provider =
        ProviderConfig::openai(fx.endpoint.base_url(), Some(Secret::new("scripted-key")));
    let none_key = expected_key(
        &agents,
        "agent-c",
        &no_token(AuthMode::NoIdentity, AuthSource::NoCredentials),
        Some(&provider),
    );
    let none_pid = pid_of(plain, &none_key).await;
    assert_token_only_in_the_sdk_variable(none_pid, None, &["ghu_env_first"]);
    let argv = cmdline(none_pid);
    assert!(argv.contains(&"--no-auto-login".to_owned()), "{argv:?}");
    assert!(!argv.contains(&"--auth-token-env".to_owned()), "{argv:?}");

    // Allowed by the config: the logged-in user, its own key, stored logins allowed.
    let logged_in = summary(
        allowed,
        None,
        &byok_turn(
            &fx,
            "agent-c",
            "logged-in",
            Some(json!({"use_logged_in_user": true})),
        ),
    )
    .await;
    assert_eq!(logged_in.status, 200, "{}", logged_in.body);
    let logged_in_key = expected_key(
        &agents,
        "agent-c",
        &no_token(AuthMode::LoggedInUser, AuthSource::ExplicitLoggedInUser),
        Some(&provider),
    );
    let logged_in_pid = pid_of(allowed, &logged_in_key).await;
    assert_ne!(logged_in_pid, none_pid);
    let argv = cmdline(logged_in_pid);
    assert!(!argv.contains(&"--no-auto-login".to_owned()), "{argv:?}");
    assert_token_only_in_the_sdk_variable(logged_in_pid, None, &[]);

    for stop in [stop, stop_plain, stop_allowed] {
        let _ = stop.send(());
    }
    shutdown_leaves_nothing(&pool).await;
    for server in [server, server_plain, server_allowed] {
        tokio::time::timeout(std::time::Duration::from_secs(10), server)
            .await
            .expect("the listener stopped once its connections closed")
            .expect("the listener task");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_daemon_uses_its_token_variables_only_with_env_fallback_and_refuses_the_logged_in_user_by_default()
 {
    let fx = Fixture::new().await;
    let provider =
        ProviderConfig::openai(fx.endpoint.base_url(), Some(Secret::new("scripted-key")));
    let env = [
        ("OPENCLAW_GITHUB_TOKEN", ""),
        ("COPILOT_GITHUB_TOKEN", ""),
        ("GH_TOKEN", "ghu_daemon_one"),
        ("GITHUB_TOKEN", "ghu_daemon_two"),
    ];
    let secrets = ["ghu_daemon_one", "ghu_daemon_two"];

    // With env_fallback: a request with no token runs with the daemon's GH_TOKEN (an empty
    // variable counts as absent), which reaches the process in COPILOT_SDK_AUTH_TOKEN only.
    let dir = fx.scratch.path().join("with-fallback");
    std::fs::create_dir_all(&dir).expect("dir");
    let daemon = Daemon::start_with(&dir, "[auth]\nenv_fallback = true\n", &[], &env, None).await;
    let answer = summary(daemon.addr, None, &byok_turn(&fx, "agent-d", "c", None)).await;
    assert_eq!(answer.status, 200, "{}", answer.body);
    assert_eq!(answer.json()["status"], "idle", "{}", answer.body);
    let key = expected_key(
        &dir.join("pool-home"),
        "agent-d",
        &token_auth(
            "env:GH_TOKEN",
            fingerprint("ghu_daemon_one"),
            "ghu_daemon_one",
            AuthSource::Env("GH_TOKEN"),
        ),
        Some(&provider),
    );
    let pid = pid_of(daemon.addr, &key).await;
    assert_token_only_in_the_sdk_variable(pid, Some("ghu_daemon_one"), &["ghu_daemon_two"]);
    let asked = summary(
        daemon.addr,
        None,
        &byok_turn(
            &fx,
            "agent-d",
            "c",
            Some(json!({"use_logged_in_user": true})),
        ),
    )
    .await;
    assert_eq!(asked.status, 400, "{}", asked.body);
    assert!(
        asked.body.contains("allow_logged_in_user"),
        "{}",
        asked.body
    );
    assert!(daemon.terminate().await.success());
    let left = support::procs::wait_group_gone(pid, std::time::Duration::from_secs(5)).await;
    assert!(left.is_empty(), "the daemon left {left:?}");

    // Without it (the default) the daemon's variables reach nothing: a BYOK request runs
    // with no identity, and one without a provider is refused with the fix.
    let dir = fx.scratch.path().join("default");
    std::fs::create_dir_all(&dir).expect("dir");
    let daemon = Daemon::start_with(&dir, "", &[], &env, None).await;
    let answer = summary(daemon.addr, None, &byok_turn(&fx, "agent-d", "c", None)).await;
    assert_eq!(answer.status, 200, "{}", answer.body);
    let key = expected_key(
        &dir.join("pool-home"),
        "agent-d",
        &no_token(AuthMode::NoIdentity, AuthSource::NoCredentials),
        Some(&provider),
    );
    let pid = pid_of(daemon.addr, &key).await;
    assert_token_only_in_the_sdk_variable(pid, None, &secrets);
    assert!(cmdline(pid).contains(&"--no-auto-login".to_owned()));
    let refused = summary(daemon.addr, None, &token_turn("agent-d", "t", "no", None)).await;
    assert_eq!(refused.status, 400, "{}", refused.body);
    assert!(refused.body.contains("env_fallback"), "{}", refused.body);
    assert!(daemon.terminate().await.success());
    let left = support::procs::wait_group_gone(pid, std::time::Duration::from_secs(5)).await;
    assert!(left.is_empty(), "the daemon left {left:?}");
}

/// One real turn with a real token (`COPILOT_POOL_LIVE_TOKEN`), through the HTTP API's
/// explicit-token level, with every other token variable cleared for the child. Skipped
/// (passes without doing anything) when the variable is not set.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn live_a_real_token_runs_one_real_turn_when_copilot_pool_live_token_is_set() {
    let Some(token) = std::env::var("COPILOT_POOL_LIVE_TOKEN")
        .ok()
        .filter(|t| !t.is_empty())
    else {
        eprintln!(
            "skipped: set COPILOT_POOL_LIVE_TOKEN to a GitHub token with Copilot access to run it"
        );
        return;
    };
    let fx = Fixture::new().await;
    let mut config = fx.config().await;
    config.worker.base_env = Some(
        std::env::vars_os()
            .filter(|(k, _)| {
                k.to_str()
                    .is_none_or(|k| !TOKEN_VARIABLES.contains(&k) && k != "COPILOT_POOL_LIVE_TOKEN")
            })
            .collect(),
    );
    let server = support::api::InProcess::start(config, ApiConfig::default()).await;
    let body = json!({
        "agent_id": "live",
        "session_key": "live",
        "prompt": "Reply with the single word: pong",
        "auth": {"github_token": token, "profile_id": "live", "profile_version": fingerprint(&token)},
    });
    let answer = summary(server.addr, None, &body).await;
    assert_eq!(
        answer.status,
        200,
        "{}",
        answer.body.replace(&token, "<token>")
    );
    let end = answer.json();
    assert_eq!(
        end["status"],
        "idle",
        "{}",
        answer.body.replace(&token, "<token>")
    );
    assert!(end["llm_calls"].as_u64() >= Some(1), "{end}");
    assert!(
        !end["final_text"].as_str().unwrap_or_default().is_empty(),
        "{end}"
    );
    let status = call(server.addr, "GET", "/v1/pool", None, None)
        .await
        .json();
    if let Some(pid) = status["processes"][0]["pid"]
        .as_u64()
        .and_then(|p| u32::try_from(p).ok())
    {
        assert_token_only_in_the_sdk_variable(pid, Some(&token), &[]);
    }
    server.stop().await;
}
