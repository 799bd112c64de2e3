//! End to end through the binary: `copilot-pool serve` runs each agent's runtime in its own
//! Landlock sandbox. An agent's real `bash` tool call (the scripted model asks for it, the
//! test approves it as a gateway would) tries every escape of issue 14: another agent's home,
//! transcript and work directory, the daemon's and a sibling worker's `/proc/<pid>/environ`,
//! a signal to the sibling worker, a connection to the daemon's API port. With the sandbox
//! every one fails and the agent's own directories work; with `sandbox = "off"` the same
//! script escapes (so the walls are what stops it). The daemon is not dumpable either way.
//! And a conversation whose recorded directory the sandbox no longer allows is still deleted.

mod support;

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::Path;

use copilot_pool::scripted_model::ScriptedModel;
use serde_json::{Value, json};
use support::api::turn;
use support::http::{Daemon, SseStream, call};

const TOKEN: &str = "sandbox-test-api-token";

/// The bash tool call the scripted model makes.
fn bash(command: &str) -> String {
    let args =
        json!({"command": command, "description": "probe", "mode": "sync", "initial_wait": 30});
    format!("SCENARIO:tool NAME=bash ARGS={args}")
}

/// Runs one streamed turn, approving every permission request, and returns `turn.end`.
async fn run_approved(addr: SocketAddr, body: &Value) -> Value {
    let mut stream = SseStream::open(addr, "/v1/turns", Some(TOKEN), body).await;
    assert_eq!(stream.status, 200);
    while let Some(event) = stream.next().await {
        match event.event.as_str() {
            "permission.request" => {
                let id = event.data["request_id"].as_str().expect("request_id");
                let answered = call(
                    addr,
                    "POST",
                    &format!("/v1/requests/{id}"),
                    Some(TOKEN),
                    Some(&json!({"decision": "approve-once"})),
                )
                .await;
                assert_eq!(answered.status, 204, "{}", answered.body);
            }
            "turn.end" => return event.data,
            _ => {}
        }
    }
    panic!("the turn's stream ended without turn.end");
}

/// What each probe of the intruder's script found: `open` (it worked) or `shut`.
fn outcomes(end: &Value) -> BTreeMap<String, String> {
    let text = end["final_text"].as_str().unwrap_or_default();
    text.split_whitespace()
        .filter_map(|word| word.split_once('='))
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect()
}

struct Setup {
    scratch: support::Scratch,
    daemon: Daemon,
    _endpoint: copilot_pool::scripted_model::HttpEndpoint,
    url: String,
}

/// Starts the daemon with `sandbox`; `capless` starts it without any capability (as root:
/// through `setpriv`), so only its non-dumpable flag keeps a child of the same user out of
/// its environment (a root daemon's capabilities alone would, by the kernel's superset rule).
async fn start(sandbox: &str, capless: bool) -> Setup {
    let scratch = support::Scratch::new();
    let model = ScriptedModel::new();
    let endpoint = model.serve_http().await.expect("model");
    let url = endpoint.base_url();
    let transcripts = scratch.path().join("transcripts");
    let config = format!(
        "sandbox = \"{sandbox}\"\napi_token = \"{TOKEN}\"\n[turns]\ntranscript_dir = \"{}\"\n",
        transcripts.display()
    );
    let prefix: Vec<String> = if capless && nix::unistd::geteuid().is_root() {
        [
            "setpriv",
            "--inh-caps=-all",
            "--ambient-caps=-all",
            "--bounding-set=-all",
            "--",
        ]
        .map(String::from)
        .to_vec()
    } else {
        Vec::new()
    };
    let daemon = Daemon::start_through(scratch.path(), &config, &prefix).await;
    Setup {
        scratch,
        daemon,
        _endpoint: endpoint,
        url,
    }
}

/// The victim's turn (its home, work directory, transcript and worker exist afterwards),
/// then the intruder's probes; returns what they found and the victim's worker pid.
async fn escapes(setup: &Setup) -> (BTreeMap<String, String>, u32) {
    let addr = setup.daemon.addr;
    let agents = setup.scratch.path().join("pool-home/agents");
    let victim = agents.join("victim");
    let end = run_approved(addr, &turn(&setup.url, "victim", "c", "REPLY=hello")).await;
    assert_eq!(end["status"], "idle", "{end}");
    std::fs::create_dir_all(victim.join("work")).expect("victim work");
    std::fs::write(victim.join("copilot/secret.txt"), "victim-secret").expect("secret");
    let pool = call(addr, "GET", "/v1/pool", Some(TOKEN), None)
        .await
        .json();
    let sibling = pool["processes"][0]["pid"]
        .as_u64()
        .expect("the victim's worker") as u32;

    let own = agents.join("intruder");
    let script = probe_script(
        &victim,
        &setup.scratch.path().join("transcripts"),
        &own,
        setup.daemon.pid(),
        sibling,
        addr.port(),
    );
    let end = run_approved(addr, &turn(&setup.url, "intruder", "c", &bash(&script))).await;
    assert_eq!(end["status"], "idle", "{end}");
    (outcomes(&end), sibling)
}

/// One bash line per escape, each printing `<name>=open` or `<name>=shut`.
fn probe_script(
    victim: &Path,
    transcripts: &Path,
    own: &Path,
    daemon: u32,
    sibling: u32,
    api_port: u16,
) -> String {
    let v = victim.display();
    let t = transcripts.display();
    let o = own.display();
    [
        "p(){ if eval \"$2\" >/dev/null 2>&1; then echo \"$1=open\"; else echo \"$1=shut\"; fi; }"
            .to_owned(),
        format!("p home 'cat {v}/copilot/secret.txt'"),
        format!("p transcript 'cat {t}/*.jsonl'"),
        format!("p work 'echo x > {v}/work/planted'"),
        format!("p daemon 'cat /proc/{daemon}/environ'"),
        format!("p sibling 'cat /proc/{sibling}/environ'"),
        format!("p api 'exec 3<>/dev/tcp/127.0.0.1/{api_port}'"),
        format!("p own_home 'echo x > {o}/copilot/probe && cat {o}/copilot/probe'"),
        format!("p own_work 'mkdir -p {o}/work && echo x > {o}/work/probe && cat {o}/work/probe'"),
        "p own_tmp 'echo x > \"${TMPDIR:-/tmp}/probe\"'".to_owned(),
        format!("p kill 'kill -KILL {sibling}'"),
    ]
    .join("\n")
}

/// The sandbox's walls, by rule, as the daemon's `/metrics` reports them.
const RULES: [&str; 6] = [
    "filesystem",
    "tcp_connect",
    "tcp_bind",
    "signals",
    "abstract_unix_sockets",
    "capabilities",
];

/// `"wanted <rule>"` and `"enforced <rule>"` to their values in `/metrics`.
async fn wall_metrics(addr: SocketAddr) -> BTreeMap<String, String> {
    let body = call(addr, "GET", "/metrics", None, None).await.body;
    let mut walls = BTreeMap::new();
    for line in body.lines() {
        for (metric, name) in [
            ("copilot_pool_sandbox_wanted{rule=\"", "wanted"),
            ("copilot_pool_sandbox_enforced{rule=\"", "enforced"),
        ] {
            if let Some((rule, value)) = line
                .strip_prefix(metric)
                .and_then(|rest| rest.split_once("\"} "))
            {
                walls.insert(format!("{name} {rule}"), value.to_owned());
            }
        }
    }
    walls
}

#[tokio::test]
async fn a_tcp_bind_wall_left_open_on_purpose_is_not_wanted() {
    let scratch = support::Scratch::new();
    let config =
        format!("sandbox = \"auto\"\nsandbox_tcp_bind = \"any\"\napi_token = \"{TOKEN}\"\n");
    let daemon = Daemon::start_through(scratch.path(), &config, &[]).await;
    let metrics = wall_metrics(daemon.addr).await;
    for rule in RULES {
        let wanted = if rule == "tcp_bind" { "0" } else { "1" };
        assert_eq!(metrics[&format!("wanted {rule}")], wanted, "{metrics:?}");
    }
    // Not enforced, since it is not asked for (the wrapper gets --any-tcp-bind).
    assert_eq!(metrics["enforced tcp_bind"], "0", "{metrics:?}");
    daemon.terminate().await;
}

fn alive(pid: u32) -> bool {
    Path::new(&format!("/proc/{pid}")).exists()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sandboxed_agents_bash_cannot_reach_other_agents_the_daemon_or_its_api_but_works_at_home()
{
    let setup = start("auto", false).await;
    let pool = call(setup.daemon.addr, "GET", "/v1/pool", Some(TOKEN), None)
        .await
        .json();
    assert_eq!(pool["sandbox"]["mode"], "auto", "{pool}");
    assert_eq!(pool["sandbox"]["filesystem"], true, "{pool}");
    // Every wall is asked for; each is enforced as far as this kernel goes.
    let metrics = wall_metrics(setup.daemon.addr).await;
    for rule in RULES {
        assert_eq!(metrics[&format!("wanted {rule}")], "1", "{metrics:?}");
        let enforced = if pool["sandbox"][rule] == true {
            "1"
        } else {
            "0"
        };
        assert_eq!(
            metrics[&format!("enforced {rule}")],
            enforced,
            "{metrics:?}"
        );
    }
    let (found, sibling) = escapes(&setup).await;
    for escape in [
        "home",
        "transcript",
        "work",
        "daemon",
        "sibling",
        "api",
        "kill",
    ] {
        assert_eq!(
            found.get(escape).map(String::as_str),
            Some("shut"),
            "{escape}: {found:?}"
        );
    }
    for inside in ["own_home", "own_work", "own_tmp"] {
        assert_eq!(
            found.get(inside).map(String::as_str),
            Some("open"),
            "{inside}: {found:?}"
        );
    }
    let victim = setup.scratch.path().join("pool-home/agents/victim");
    assert!(!victim.join("work/planted").exists());
    assert!(alive(sibling), "the sibling worker was killed");
    setup.daemon.terminate().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_the_sandbox_the_same_bash_escapes_but_the_daemon_stays_unreadable() {
    let setup = start("off", true).await;
    let pool = call(setup.daemon.addr, "GET", "/v1/pool", Some(TOKEN), None)
        .await
        .json();
    assert_eq!(pool["sandbox"]["mode"], "off", "{pool}");
    // Off on purpose: no wall asked for, none enforced (no alert reads this as a fault).
    let metrics = wall_metrics(setup.daemon.addr).await;
    for rule in RULES {
        assert_eq!(metrics[&format!("wanted {rule}")], "0", "{metrics:?}");
        assert_eq!(metrics[&format!("enforced {rule}")], "0", "{metrics:?}");
    }
    let (found, sibling) = escapes(&setup).await;
    for escape in ["home", "transcript", "work", "sibling", "api", "kill"] {
        assert_eq!(
            found.get(escape).map(String::as_str),
            Some("open"),
            "{escape}: {found:?}"
        );
    }
    // Non-dumpable: without CAP_SYS_PTRACE no child reads the daemon's environment (the
    // sibling's, read the same way, shows that the read itself works).
    assert_eq!(
        found.get("daemon").map(String::as_str),
        Some("shut"),
        "{found:?}"
    );
    let victim = setup.scratch.path().join("pool-home/agents/victim");
    assert!(victim.join("work/planted").exists());
    let gone = support::procs::wait_none(
        || {
            if alive(sibling) {
                vec![sibling]
            } else {
                vec![]
            }
        },
        std::time::Duration::from_secs(5),
    )
    .await;
    assert!(gone.is_empty(), "the sibling worker survived its kill");
    setup.daemon.terminate().await;
}

/// What a worker's shell tool sees of tokens: its own process token (runtime 1.0.14 hands
/// its whole environment, `COPILOT_SDK_AUTH_TOKEN` included, to the shell: ARCHITECTURE.md
/// says so), never the parent's token variables, the API token or another agent's token.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_shell_tool_sees_its_own_workers_token_and_no_other_secret() {
    use copilot_pool::permission::ApproveAll;
    use copilot_pool::pool::Pool;
    let fx = support::pool_fixture::Fixture::new().await;
    let mut config = fx.config().await;
    config.worker.base_env = Some(vec![
        ("PATH".into(), std::env::var_os("PATH").unwrap_or_default()),
        ("GH_TOKEN".into(), "ghu_parent_token".into()),
        ("COPILOT_POOL_API_TOKEN".into(), "api_token_value".into()),
    ]);
    let pool = Pool::start(config).await.expect("pool");
    // Another agent's worker, with its own token, alive beside ours.
    let mut other = fx.request("agent-other", "c");
    other.auth = support::pool_fixture::token("other");
    let mut other = pool.lease(other).await.expect("lease");
    other.run("REPLY=hi").await.expect("turn");

    let mut req = fx.request("agent-token", "c");
    req.auth = support::pool_fixture::token("v1");
    req.available_tools = None;
    req.handlers.permission_policy = std::sync::Arc::new(ApproveAll);
    let mut lease = pool.lease(req).await.expect("lease");
    let outcome = lease
        .run(bash(
            "echo own=$COPILOT_SDK_AUTH_TOKEN; env | grep -q -e ghu_token_other -e \
             ghu_parent_token -e api_token_value && echo leak=yes || echo leak=no",
        ))
        .await
        .expect("turn");
    drop((lease, other));
    support::pool_fixture::shutdown_leaves_nothing(&pool).await;
    assert!(outcome.text.contains("leak=no"), "{}", outcome.text);
    assert!(
        outcome.text.contains("own=ghu_token_v1"),
        "{}",
        outcome.text
    );
}

/// With the sandbox off, a tool call could reach the API on loopback: no token, no daemon.
#[tokio::test]
async fn with_the_sandbox_off_serve_refuses_to_start_without_an_api_token() {
    let scratch = support::Scratch::new();
    let config = scratch.path().join("serve.toml");
    std::fs::write(&config, "sandbox = \"off\"\n").expect("config");
    let output = tokio::time::timeout(
        std::time::Duration::from_secs(60),
        tokio::process::Command::new(env!("CARGO_BIN_EXE_copilot-pool"))
            .args(["serve", "--listen", "127.0.0.1:0", "--config"])
            .arg(&config)
            .env("COPILOT_CLI_PATH", support::runtime::runtime_path().await)
            .env("COPILOT_POOL_HOME", scratch.path().join("pool-home"))
            .env_remove("COPILOT_POOL_API_TOKEN")
            .kill_on_drop(true)
            .output(),
    )
    .await
    .expect("serve exits")
    .expect("serve runs");
    // A configuration refused (EX_CONFIG): a supervisor's restart would not help.
    assert_eq!(output.status.code(), Some(78));
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("refusing to serve without an API token")
            && stderr.contains("COPILOT_POOL_API_TOKEN"),
        "{stderr}"
    );
}

#[tokio::test]
async fn serve_refuses_to_keep_its_state_or_token_where_every_agent_may_read() {
    let scratch = support::Scratch::new();
    let shared = scratch.path().join("shared");
    std::fs::create_dir_all(&shared).expect("shared");
    let token_file = shared.join("api-token");
    std::fs::write(&token_file, "a-token").expect("token");
    std::fs::set_permissions(
        &token_file,
        std::os::unix::fs::PermissionsExt::from_mode(0o600),
    )
    .expect("chmod");
    let config = scratch.path().join("serve.toml");
    std::fs::write(
        &config,
        format!("sandbox_read_paths = [\"{}\"]\n", shared.display()),
    )
    .expect("config");
    let serve = |config: std::path::PathBuf, extra: Vec<std::ffi::OsString>| {
        let home = scratch.path().join("pool-home");
        async move {
            let runtime = support::runtime::runtime_path().await;
            tokio::time::timeout(
                std::time::Duration::from_secs(60),
                tokio::process::Command::new(env!("CARGO_BIN_EXE_copilot-pool"))
                    .args(["serve", "--listen", "127.0.0.1:0", "--config"])
                    .arg(&config)
                    .args(extra)
                    .env("COPILOT_CLI_PATH", runtime)
                    .env("COPILOT_POOL_HOME", home)
                    .env("COPILOT_POOL_API_TOKEN", "a-token")
                    .kill_on_drop(true)
                    .output(),
            )
            .await
            .expect("serve exits")
            .expect("serve runs")
        }
    };
    // The state directory below a directory every agent may read (through a link too).
    std::os::unix::fs::symlink(&shared, scratch.path().join("linked")).expect("link");
    for state in [shared.join("state"), scratch.path().join("linked/state")] {
        let output = serve(config.clone(), vec!["--state-dir".into(), state.into()]).await;
        assert_eq!(
            output.status.code(),
            Some(78),
            "{}",
            String::from_utf8_lossy(&output.stderr)
        );
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(
            stderr.contains("state_dir") && stderr.contains("which every sandboxed agent may read"),
            "{stderr}"
        );
    }
    // The API token's file there.
    let output = serve(
        config.clone(),
        vec!["--api-token-file".into(), token_file.into()],
    )
    .await;
    assert_eq!(
        output.status.code(),
        Some(78),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("api_token_file"), "{stderr}");

    // A config file there that holds the token is refused; one without it (the container
    // image's `/etc/copilot-pool/serve.toml`, the token in the environment) is not.
    let shared_config = shared.join("serve.toml");
    let with_token = format!(
        "sandbox_read_paths = [\"{}\"]\napi_token = \"a-token\"\n",
        shared.display()
    );
    std::fs::write(&shared_config, with_token).expect("config");
    std::fs::set_permissions(
        &shared_config,
        std::os::unix::fs::PermissionsExt::from_mode(0o600),
    )
    .expect("chmod");
    let output = serve(shared_config.clone(), vec![]).await;
    assert_eq!(
        output.status.code(),
        Some(78),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("the config file (it holds api_token)"),
        "{stderr}"
    );
    // Started by the tests' own launcher: the config is written into `shared`, the state and
    // the agents' homes kept elsewhere, the token in the environment.
    let config = format!(
        "sandbox_read_paths = [{:?}]\nstate_dir = {:?}\nagents_dir = {:?}\n",
        shared.display().to_string(),
        scratch.path().join("state").display().to_string(),
        scratch.path().join("agents").display().to_string(),
    );
    let daemon = Daemon::start_with(
        &shared,
        &config,
        &[],
        &[("COPILOT_POOL_API_TOKEN", "a-token")],
        None,
    )
    .await;
    assert!(daemon.terminate().await.success());
}

/// Runs `node` inside `copilot-pool sandbox-exec <rules>`, listening on port 0 and then on
/// `fixed`; returns its `ephemeral=<ok|code> fixed=<ok|code>` line.
async fn binds_in_the_wrapper(rules: &[&str], fixed: u16) -> String {
    let script = "const net = require('net');\
        const tryListen = (port) => new Promise((resolve) => {\
          const s = net.createServer();\
          s.once('error', (e) => resolve(e.code));\
          s.listen(port, '127.0.0.1', () => { s.close(); resolve('ok'); });\
        });\
        (async () => { console.log(`ephemeral=${await tryListen(0)} \
        fixed=${await tryListen(Number(process.argv[1]))}`); })();";
    let output = tokio::process::Command::new(env!("CARGO_BIN_EXE_copilot-pool"))
        .arg("sandbox-exec")
        .args(rules)
        .args(["--rx", "/", "--", "node", "-e", script, &fixed.to_string()])
        .kill_on_drop(true)
        .output()
        .await
        .expect("run the wrapper (Node.js on PATH, as the README asks)");
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8_lossy(&output.stdout).trim().to_owned()
}

#[tokio::test]
async fn a_sandboxed_tool_listens_on_an_ephemeral_port_but_never_takes_a_fixed_one() {
    // A port free now, which a sandboxed process must not take.
    let fixed = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port();
    let probe = tokio::process::Command::new(env!("CARGO_BIN_EXE_copilot-pool"))
        .args(["sandbox-exec", "--probe", "--rx", "/"])
        .output()
        .await
        .expect("probe");
    let status: Value = serde_json::from_slice(&probe.stdout).expect("the probe's JSON");
    // Another process may take the freed port meanwhile: then a bind the walls let through
    // fails `EADDRINUSE`, never `EACCES`.
    let let_through =
        |line: &str| ["ephemeral=ok fixed=ok", "ephemeral=ok fixed=EADDRINUSE"].contains(&line);
    let confined = binds_in_the_wrapper(&[], fixed).await;
    if status["tcp_bind"] == true {
        assert_eq!(confined, "ephemeral=ok fixed=EACCES", "{status}");
    } else {
        // A kernel without Landlock's TCP rules (before ABI 4) says so, and binds freely.
        assert!(status["landlock_abi"].as_u64() < Some(4), "{status}");
        assert!(let_through(&confined), "{confined} {status}");
    }
    // A fixed port the operator lists (`sandbox_tcp_bind`), or any with `"any"`; TCP
    // connect left open does not open bind.
    let listed = binds_in_the_wrapper(&["--tcp-bind", &fixed.to_string()], fixed).await;
    assert!(let_through(&listed), "{listed}");
    let any = binds_in_the_wrapper(&["--any-tcp-bind"], fixed).await;
    assert!(let_through(&any), "{any}");
    if status["tcp_bind"] == true {
        assert_eq!(
            binds_in_the_wrapper(&["--any-tcp"], fixed).await,
            "ephemeral=ok fixed=EACCES"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deletion_by_name_whose_recorded_directory_the_sandbox_no_longer_allows_runs_in_the_agents_home()
 {
    let scratch = support::Scratch::new();
    let model = ScriptedModel::new();
    let endpoint = model.serve_http().await.expect("model");
    let url = endpoint.base_url();
    let roots = scratch.path().join("projects");
    let project = roots.join("mover");
    std::fs::create_dir_all(&project).expect("the project");
    let config = |roots: &str| {
        format!("sandbox = \"auto\"\napi_token = \"{TOKEN}\"\nallowed_work_roots = [{roots}]\n")
    };

    // A conversation whose turns ran in an allowed root: its binding records the directory.
    let daemon = Daemon::start(
        scratch.path(),
        &config(&format!("\"{}\"", roots.display())),
        &[],
    )
    .await;
    let mut body = turn(&url, "mover", "k", "REPLY=in the project");
    body["session"] = json!({"workingDirectory": project});
    let end = run_approved(daemon.addr, &body).await;
    assert_eq!(end["status"], "idle", "{end}");
    let session = end["session_id"]
        .as_str()
        .expect("the session id")
        .to_owned();
    let state = scratch
        .path()
        .join("pool-home/agents/mover/copilot/session-state")
        .join(&session);
    assert!(state.exists(), "{} is the session's state", state.display());
    daemon.terminate().await;

    // The roots changed: the recorded directory is outside the agent's sandbox now. A
    // DELETE by name still deletes the conversation (its session resumed in the agent's
    // home), where the runtime would refuse the directory.
    let daemon = Daemon::start(scratch.path(), &config(""), &[]).await;
    // The fallback is the sandbox's: without one the directory would still be used.
    let pool = call(daemon.addr, "GET", "/v1/pool", Some(TOKEN), None)
        .await
        .json();
    assert_eq!(pool["sandbox"]["filesystem"], true, "{pool}");
    let path = "/v1/sessions/mover/k";
    let deleted = call(daemon.addr, "DELETE", path, Some(TOKEN), None).await;
    assert_eq!(deleted.status, 204, "{}", deleted.body);
    let again = call(daemon.addr, "DELETE", path, Some(TOKEN), None).await;
    assert_eq!(again.status, 404, "{}", again.body);
    assert!(!state.exists(), "{} is left", state.display());
    assert!(project.is_dir(), "the project itself is not touched");
    daemon.terminate().await;
}

#[tokio::test]
async fn an_agent_directory_swapped_for_a_link_to_another_agents_is_refused_before_the_process_starts()
 {
    let tmp = tempfile::tempdir().expect("tempdir");
    let root = tmp.path().canonicalize().expect("resolved");
    let agent = root.join("alice").join("codex-cli");
    let bob = root.join("bob");
    std::fs::create_dir_all(&agent).expect("alice's directory");
    std::fs::create_dir_all(&bob).expect("bob's directory");
    let run = |dir: &Path| {
        let dir = dir.to_owned();
        async move {
            tokio::process::Command::new(env!("CARGO_BIN_EXE_copilot-pool"))
                .arg("sandbox-exec")
                .arg("--agent-dir")
                .arg(&dir)
                .args([
                    "--rx",
                    "/",
                    "--",
                    "/bin/sh",
                    "-c",
                    "echo mine > \"$0/planted\"",
                ])
                .arg(&dir)
                .kill_on_drop(true)
                .output()
                .await
                .expect("run the wrapper")
        }
    };
    let plain = run(&agent).await;
    assert!(
        plain.status.success(),
        "{}",
        String::from_utf8_lossy(&plain.stderr)
    );
    assert!(agent.join("planted").exists());

    // The agent's own processes may write its parent (an explicit COPILOT_HOME holds each
    // backend's home): they put a link to bob's home where the backend's home was.
    std::fs::rename(&agent, root.join("alice").join("moved")).expect("move it away");
    std::os::unix::fs::symlink(&bob, &agent).expect("plant the link");
    let swapped = run(&agent).await;
    let stderr = String::from_utf8_lossy(&swapped.stderr);
    assert!(!swapped.status.success(), "the process ran: {stderr}");
    assert!(
        stderr.contains("is not the directory the pool checked"),
        "{stderr}"
    );
    assert!(!bob.join("planted").exists(), "bob's home was written");
}

#[tokio::test]
async fn a_root_the_wrapper_cannot_read_is_skipped_saying_so() {
    let tmp = tempfile::tempdir().expect("tempdir");
    // A link to itself: ELOOP, neither there nor missing.
    let looped = tmp.path().join("loop");
    std::os::unix::fs::symlink(&looped, &looped).expect("link");
    let missing = tmp.path().join("missing");
    let output = tokio::process::Command::new(env!("CARGO_BIN_EXE_copilot-pool"))
        .arg("sandbox-exec")
        .arg("--ro")
        .arg(&looped)
        .arg("--ro")
        .arg(&missing)
        .args(["--rx", "/", "--", "/bin/true"])
        .kill_on_drop(true)
        .output()
        .await
        .expect("run the wrapper");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "{stderr}");
    assert!(
        stderr.contains(&format!("not granting {}", looped.display())),
        "{stderr}"
    );
    assert!(
        !stderr.contains("missing"),
        "a missing path is skipped quietly: {stderr}"
    );
}
