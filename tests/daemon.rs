//! End to end through the binary: `copilot-pool serve` with real runtime processes, for what
//! only the daemon does: signals and the drain, the Prometheus text, the API token from a
//! file or the environment, its listeners under connection floods, and the API on a Unix
//! socket. The API itself is
//! driven in-process in `http_api.rs`.

mod support;

use std::process::Stdio;

use std::time::{Duration, Instant};

use copilot_pool::scripted_model::ScriptedModel;
use serde_json::json;
use support::api::{answer, lookup_turn, request_id, summary, turn};
use support::http::{Daemon, SocketDaemon, SseStream, call, request, send};

/// Processes whose COPILOT_HOME lies under `dir` (the daemon's children).
fn children_under(dir: &std::path::Path) -> Vec<u32> {
    let needle = dir.display().to_string();
    support::procs::with_env_prefix("COPILOT_HOME", &needle)
}

/// Starts `n` slow streamed turns (agents `<prefix>0..n`), each past its first model call.
async fn slow_turns_started(
    addr: std::net::SocketAddr,
    url: &str,
    prefix: &str,
    n: usize,
    slow: &str,
) -> Vec<SseStream> {
    let mut streams = Vec::new();
    for i in 0..n {
        let body = turn(
            url,
            &format!("{prefix}{i}"),
            "c",
            &format!("SCENARIO:slow SLOW={slow}"),
        );
        let mut s = SseStream::open(addr, "/v1/turns", None, &body).await;
        s.until_event("assistant.turn_start").await;
        streams.push(s);
    }
    streams
}

/// A running turn the drain ended: aborted past the grace (or its process stopped under it).
fn assert_ended_by_the_drain(end: &serde_json::Value) {
    assert!(
        end["status"] == "aborted" || end["status"] == "crashed" || end["status"] == "error",
        "{end}"
    );
}

/// The daemon, stopping, exits 0 within a minute and leaves no child under `dir`.
async fn exits_cleanly_leaving_no_process(mut daemon: Daemon, dir: &std::path::Path) {
    let status = tokio::time::timeout(Duration::from_secs(60), daemon.child.wait())
        .await
        .expect("exit")
        .expect("wait");
    assert!(status.success(), "{status:?}");
    let left = support::procs::wait_none(|| children_under(dir), Duration::from_secs(5)).await;
    assert!(left.is_empty(), "children left: {left:?}");
}

#[tokio::test]
async fn sigterm_during_turns_drains_and_leaves_no_process() {
    let scratch = support::Scratch::new();
    let model = ScriptedModel::new();
    let endpoint = model.serve_http().await.expect("model");
    let url = endpoint.base_url();
    let daemon = Daemon::start(scratch.path(), "drain_grace_secs = 1\n", &[]).await;
    let addr = daemon.addr;
    let streams = slow_turns_started(addr, &url, "agent-s", 3, "200x100").await;
    assert!(!children_under(scratch.path()).is_empty());
    let pid = nix::unistd::Pid::from_raw(daemon.pid() as i32);
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM).expect("SIGTERM");
    // Draining: not ready (as a load balancer sees it, by polling), no new turns.
    let deadline = Instant::now() + Duration::from_secs(5);
    let ready = loop {
        let ready = call(addr, "GET", "/readyz", None, None).await;
        if ready.status == 503 || Instant::now() > deadline {
            break ready;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert_eq!(ready.status, 503);
    let refused = summary(addr, None, &turn(&url, "agent-new", "c", "hi")).await;
    assert_eq!(refused.status, 503);
    for mut s in streams {
        let (_, end) = s.until_end().await;
        assert_ended_by_the_drain(&end);
    }
    exits_cleanly_leaving_no_process(daemon, scratch.path()).await;
}

#[tokio::test]
async fn a_second_signal_cuts_the_drain_short_and_aborts_the_running_turn() {
    let scratch = support::Scratch::new();
    let model = ScriptedModel::new();
    let endpoint = model.serve_http().await.expect("model");
    let url = endpoint.base_url();
    // A grace far longer than the test waits, and a turn that would outlast the test.
    let daemon = Daemon::start(scratch.path(), "drain_grace_secs = 600\n", &[]).await;
    let addr = daemon.addr;
    let mut streams = slow_turns_started(addr, &url, "agent-h", 1, "2000x100").await;
    let pid = nix::unistd::Pid::from_raw(daemon.pid() as i32);
    // SIGHUP drains like SIGTERM: the daemon turns unready.
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGHUP).expect("SIGHUP");
    let draining = async {
        while call(addr, "GET", "/readyz", None, None).await.status != 503 {
            tokio::task::yield_now().await;
        }
    };
    tokio::time::timeout(Duration::from_secs(10), draining)
        .await
        .expect("draining after SIGHUP");
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGINT).expect("SIGINT");
    let (_, end) = tokio::time::timeout(Duration::from_secs(60), streams[0].until_end())
        .await
        .expect("the turn ends within the test, not after the grace");
    assert_ended_by_the_drain(&end);
    exits_cleanly_leaving_no_process(daemon, scratch.path()).await;
}

#[tokio::test]
async fn a_daemon_whose_stderr_reader_is_gone_still_drains_and_exits_cleanly_on_sigterm() {
    let scratch = support::Scratch::new();
    // The log reader died: every write to stderr fails with EPIPE.
    let (reader, writer) = std::io::pipe().expect("a pipe");
    drop(reader);
    let daemon = Daemon::start_with_stderr(scratch.path(), "", Stdio::from(writer)).await;
    let status = daemon.terminate().await;
    assert_eq!(status.code(), Some(0), "{status:?}");
}

#[tokio::test]
async fn metrics_are_valid_prometheus_text_with_the_documented_names() {
    let scratch = support::Scratch::new();
    let model = ScriptedModel::new();
    let endpoint = model.serve_http().await.expect("model");
    let url = endpoint.base_url();
    let daemon = Daemon::start(scratch.path(), "", &[]).await;
    let addr = daemon.addr;
    for i in 0..3 {
        let mut body = turn(&url, "agent-m", &format!("c{i}"), "REPLY=m");
        if i == 2 {
            // The runtime's system prompt, once a turn: left out, and so never read.
            body["omit_events"] = json!(["system.message"]);
        }
        let r = summary(addr, None, &body).await;
        assert_eq!(r.json()["status"], "idle");
    }
    let metrics = call(addr, "GET", "/metrics", None, None).await;
    assert_eq!(metrics.status, 200);
    for name in [
        "copilot_pool_processes",
        "copilot_pool_process_spawns_total",
        "copilot_pool_process_start_seconds_bucket",
        "copilot_pool_process_resident_memory_bytes",
        "copilot_pool_conversations_attached",
        "copilot_pool_session_resumes_total",
        "copilot_pool_leases_active",
        "copilot_pool_lease_waiters",
        "copilot_pool_lease_wait_seconds_bucket",
        "copilot_pool_turns_total",
        "copilot_pool_turn_duration_seconds_bucket",
        "copilot_pool_llm_calls_total",
        "copilot_pool_rpc_duration_seconds_bucket",
        "copilot_pool_tokens_total",
    ] {
        assert!(
            metrics.body.contains(name),
            "{name} missing from:\n{}",
            metrics.body
        );
    }
    // The gauges follow the pool (set when they change): three conversations parked on one
    // live process, no lease held, none waiting.
    for series in [
        "copilot_pool_conversations_attached 3",
        "copilot_pool_processes{state=\"live\",backend=\"copilot\"} 1",
        "copilot_pool_leases_active{backend=\"copilot\"} 0",
        "copilot_pool_lease_waiters{backend=\"copilot\"} 0",
        "copilot_pool_session_events_unread_total 1",
    ] {
        support::http::assert_has_series(&metrics.body, series);
    }
    // Three turns of one model call each, at the scripted model's usage per call.
    for (kind, per_call) in [
        ("input", ScriptedModel::PROMPT_TOKENS),
        ("output", ScriptedModel::COMPLETION_TOKENS),
        ("cache_read", ScriptedModel::CACHED_PROMPT_TOKENS),
        ("cache_write", 0),
    ] {
        let series = format!(
            "copilot_pool_tokens_total{{kind=\"{kind}\",backend=\"copilot\"}} {}",
            3 * per_call
        );
        support::http::assert_has_series(&metrics.body, &series);
    }
    // Every ordered pair of backends (`copilot` and the bundled `claude-cli`) and class is
    // at zero before any fallback.
    // And the counters the alerts read with increase(): at zero from the start, so their
    // first event after a start is seen.
    for series in [
        "copilot_pool_fallbacks_total{from=\"copilot\",to=\"claude-cli\",class=\"auth\"} 0",
        "copilot_pool_fallbacks_total{from=\"claude-cli\",to=\"copilot\",class=\"crash\"} 0",
        "copilot_pool_quarantines_total{backend=\"copilot\"} 0",
        "copilot_pool_quarantines_total{backend=\"claude-cli\"} 0",
        "copilot_pool_storage_write_failures_total{store=\"bindings\"} 0",
        "copilot_pool_storage_write_failures_total{store=\"transcript\"} 0",
        "copilot_pool_storage_write_failures_total{store=\"process_groups\"} 0",
        "copilot_pool_ownership_violations_total 0",
    ] {
        support::http::assert_has_series(&metrics.body, series);
    }
    for forbidden in ["session_id=", "agent_id=", "pid="] {
        assert!(
            !metrics.body.contains(forbidden),
            "unbounded label {forbidden}"
        );
    }
    // Found or installed by the test support (PROMTOOL, the cache, PATH, else
    // scripts/install-promtool.sh under the cache's lock).
    let promtool = support::promtool::promtool_path().await;
    let mut check = tokio::process::Command::new(&promtool)
        .args(["check", "metrics"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap_or_else(|e| panic!("cannot run {}: {e}", promtool.display()));
    use tokio::io::AsyncWriteExt;
    let mut stdin = check.stdin.take().expect("stdin");
    // A failure guard (it takes well under a second); on the timeout the dropped child is
    // killed.
    let limit = Duration::from_secs(60);
    let out = tokio::time::timeout(limit, async move {
        stdin
            .write_all(metrics.body.as_bytes())
            .await
            .expect("write");
        drop(stdin);
        check.wait_with_output().await.expect("promtool")
    })
    .await
    .unwrap_or_else(|_| {
        panic!(
            "{p} check metrics did not finish within {limit:?} and was killed; see whether \
             `{p} --version` hangs too, or set PROMTOOL to another promtool",
            p = promtool.display()
        )
    });
    assert!(
        out.status.success(),
        "promtool check metrics failed:\n{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(daemon.terminate().await.success());
}

/// `command`'s output, killed (and an error) if it has not ended within a minute: a command
/// expected to exit at once must not hang the test, nor outlive it.
async fn within_a_minute(
    command: &mut tokio::process::Command,
) -> std::io::Result<std::process::Output> {
    let output = command.kill_on_drop(true).output();
    tokio::time::timeout(Duration::from_secs(60), output)
        .await
        .unwrap_or_else(|_| {
            Err(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                "did not end within a minute (killed)",
            ))
        })
}

#[tokio::test]
async fn an_empty_api_token_does_not_open_the_api() {
    let scratch = support::Scratch::new();
    let config = scratch.path().join("open.toml");
    std::fs::write(&config, "listen = \"0.0.0.0:0\"\napi_token = \"\"\n").expect("config");
    let out = within_a_minute(
        tokio::process::Command::new(env!("CARGO_BIN_EXE_copilot-pool"))
            .arg("serve")
            .arg("--config")
            .arg(&config)
            .env_remove("COPILOT_POOL_API_TOKEN"),
    )
    .await
    .expect("run serve");
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("API token"), "{stderr}");
}

/// Raises this test process's soft `RLIMIT_NOFILE` to its hard limit and returns the hard
/// limit (the test holds thousands of sockets).
fn raise_own_nofile() -> u64 {
    use nix::sys::resource::{Resource, getrlimit, setrlimit};
    let (_, hard) = getrlimit(Resource::RLIMIT_NOFILE).expect("getrlimit");
    setrlimit(Resource::RLIMIT_NOFILE, hard, hard).expect("raise the test's own NOFILE");
    hard
}

/// Opens up to `n` loopback connections that never send a byte (stops at the first one
/// that cannot connect within 2 s).
async fn open_silent(addr: std::net::SocketAddr, n: usize) -> Vec<tokio::net::TcpStream> {
    let mut conns = Vec::with_capacity(n);
    for _ in 0..n {
        match tokio::time::timeout(Duration::from_secs(2), tokio::net::TcpStream::connect(addr))
            .await
        {
            Ok(Ok(c)) => conns.push(c),
            _ => break,
        }
    }
    conns
}

/// Waits until the daemon closes each connection (EOF or reset) or `limit` passes; returns
/// how many are still open.
async fn still_open(conns: Vec<tokio::net::TcpStream>, limit: Duration) -> usize {
    use tokio::io::AsyncReadExt;
    let reads = conns.into_iter().map(|mut c| async move {
        let mut buf = [0u8; 512];
        loop {
            match tokio::time::timeout(limit, c.read(&mut buf)).await {
                Ok(Ok(0)) | Ok(Err(_)) => return false,
                Ok(Ok(_)) => continue,
                Err(_) => return true,
            }
        }
    });
    futures_util::future::join_all(reads)
        .await
        .into_iter()
        .filter(|open| *open)
        .count()
}

#[tokio::test]
async fn two_thousand_idle_connections_leave_health_turns_and_spawns_working() {
    let hard = raise_own_nofile();
    // Thousands of silent sockets on both ends: keep them under the hard limit, with room
    // for the daemon's reserve (its runtime processes).
    let count = 2000usize.min(hard.saturating_sub(1024) as usize);
    assert!(
        count >= 500,
        "this test needs a hard NOFILE limit of at least 1524 (`ulimit -Hn`), it is {hard}"
    );
    let scratch = support::Scratch::new();
    let model = ScriptedModel::new();
    let endpoint = model.serve_http().await.expect("model");
    let url = endpoint.base_url();
    // The daemon starts with a soft NOFILE of 1024, a common default: unless it raises
    // the limit, ~1000 silent connections exhaust its descriptors. Its connection cap is the
    // default (4096); silent connections are closed by the header-read timeout.
    let daemon = Daemon::start_with(
        scratch.path(),
        "header_read_timeout_secs = 40\nidle_timeout_secs = 600\n",
        &[],
        &[],
        Some(1024.min(hard)),
    )
    .await;
    let addr = daemon.addr;
    let streams = slow_turns_started(addr, &url, "agent-f", 2, "60x100").await;

    let silent = open_silent(addr, count).await;
    let opened = silent.len();
    // The daemon holds them all (polling /proc: there is no event for another process's
    // accepts).
    let fds = || {
        std::fs::read_dir(format!("/proc/{}/fd", daemon.pid()))
            .map(|d| d.count())
            .unwrap_or(0)
    };
    // Bounded generously: the other daemon tests run beside this one on two cores, and
    // accepting 2,000 connections then takes seconds (the header-read timeout, 40 s here,
    // must not close the first ones before the last are in).
    let deadline = Instant::now() + Duration::from_secs(30);
    while fds() < opened && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(fds() >= opened, "the daemon holds {} descriptors", fds());

    let health = tokio::time::timeout(
        Duration::from_secs(10),
        call(addr, "GET", "/healthz", None, None),
    )
    .await
    .expect("/healthz did not answer during the flood");
    assert_eq!(health.status, 200, "{health:?}");
    // A turn that needs a new runtime process (a spawn) during the flood.
    let fresh = tokio::time::timeout(
        Duration::from_secs(60),
        summary(addr, None, &turn(&url, "agent-new", "c", "REPLY=spawned")),
    )
    .await
    .expect("a new turn did not finish during the flood");
    assert_eq!(fresh.json()["status"], "idle", "{}", fresh.body);
    for mut s in streams {
        let (_, end) = s.until_end().await;
        assert_eq!(end["status"], "idle", "{end}");
    }
    let pool = call(addr, "GET", "/v1/pool", None, None).await.json();
    assert_eq!(pool["quarantined_keys"], json!([]), "{pool}");
    assert_eq!(pool["totals"]["crashes"], 0, "{pool}");
    assert_eq!(opened, count, "only {opened} of {count} connections opened");
    // The daemon closes them itself (header-read timeout of 40 s).
    let open = still_open(silent, Duration::from_secs(90)).await;
    assert_eq!(open, 0, "{open} silent connections were never closed");
    assert!(daemon.terminate().await.success());
}

#[tokio::test]
async fn connections_over_the_cap_get_503_and_idle_ones_close_without_cutting_a_stream() {
    use tokio::io::AsyncReadExt;
    let scratch = support::Scratch::new();
    let model = ScriptedModel::new();
    let endpoint = model.serve_http().await.expect("model");
    let url = endpoint.base_url();
    let daemon = Daemon::start(
        scratch.path(),
        "max_connections = 16\nheader_read_timeout_secs = 600\nidle_timeout_secs = 2\n",
        &[],
    )
    .await;
    let addr = daemon.addr;
    let held = open_silent(addr, 16).await;
    assert_eq!(held.len(), 16);
    // The 17th is answered at once, and closed.
    let mut excess = tokio::net::TcpStream::connect(addr).await.expect("connect");
    let mut refusal = Vec::new();
    tokio::time::timeout(Duration::from_secs(5), excess.read_to_end(&mut refusal))
        .await
        .expect("the connection over the cap was neither answered nor closed")
        .expect("read");
    let refusal = String::from_utf8_lossy(&refusal);
    assert!(refusal.starts_with("HTTP/1.1 503"), "{refusal}");
    assert!(refusal.contains("too_many_connections"), "{refusal}");
    // Silent connections are closed by the idle timeout (2 s here).
    let open = still_open(held, Duration::from_secs(15)).await;
    assert_eq!(open, 0, "{open} idle connections were never closed");
    // Nothing reached the pool.
    let pool = call(addr, "GET", "/v1/pool", None, None).await.json();
    assert_eq!(pool["processes"], json!([]), "{pool}");

    // A stream that is silent longer than the idle timeout (a tool call waiting for the
    // gateway) is not cut.
    let body = lookup_turn(&url, "agent-i", "c", "k");
    let mut stream = SseStream::open(addr, "/v1/turns", None, &body).await;
    let id = request_id(&stream.until_event("tool.call").await);
    // The passing of time is what is tested here: twice the idle timeout with no byte.
    tokio::time::sleep(Duration::from_secs(5)).await;
    let ok = answer(addr, &id, &json!({"result": "late"})).await;
    assert_eq!(ok.status, 204, "{}", ok.body);
    let (_, end) = stream.until_end().await;
    assert_eq!(end["final_text"], "tool said: late", "{end}");
    assert!(daemon.terminate().await.success());
}

/// A token file with `mode`.
fn token_file(dir: &std::path::Path, name: &str, text: &str, mode: u32) -> std::path::PathBuf {
    use std::os::unix::fs::PermissionsExt;
    let path = dir.join(name);
    std::fs::write(&path, text).expect("token file");
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode)).expect("chmod");
    path
}

/// `serve` with `args` run to its exit (on a free loopback port unless `args` say where).
async fn serve_output(args: &[&str]) -> std::process::Output {
    let listen: &[&str] = if args.contains(&"--listen") {
        &[]
    } else {
        &["--listen", "127.0.0.1:0"]
    };
    tokio::time::timeout(
        Duration::from_secs(30),
        tokio::process::Command::new(env!("CARGO_BIN_EXE_copilot-pool"))
            .arg("serve")
            .args(listen)
            .args(args)
            .env_remove("COPILOT_POOL_API_TOKEN")
            .stdin(std::process::Stdio::null())
            .kill_on_drop(true)
            .output(),
    )
    .await
    .expect("serve exits")
    .expect("run serve")
}

#[tokio::test]
async fn the_api_token_never_comes_from_the_command_line_and_bearer_is_any_case() {
    let scratch = support::Scratch::new();
    // On the command line: refused, and the message names the alternatives (not the token).
    let out = serve_output(&["--api-token", "argv-token-123"]).await;
    // A refused configuration exits 78 (EX_CONFIG): a supervisor need not restart it.
    assert_eq!(out.status.code(), Some(78));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("COPILOT_POOL_API_TOKEN"), "{stderr}");
    assert!(stderr.contains("--api-token-file"), "{stderr}");
    assert!(!stderr.contains("argv-token-123"), "{stderr}");
    // A file others can read: refused with the fix.
    let open = token_file(scratch.path(), "open-token", "t0k\n", 0o644);
    let out = serve_output(&["--api-token-file", &open.display().to_string()]).await;
    assert_eq!(out.status.code(), Some(78));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains(&format!("chmod 600 {}", open.display())),
        "{stderr}"
    );
    // An empty file: refused.
    let empty = token_file(scratch.path(), "empty-token", "\n", 0o600);
    let out = serve_output(&["--api-token-file", &empty.display().to_string()]).await;
    assert_eq!(out.status.code(), Some(78));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("empty"), "{stderr}");
    // Pool settings Pool::start would refuse: a configuration too. A runtime that is not
    // there is not: 1.
    let config = scratch.path().join("reserved-backend.toml");
    std::fs::write(&config, "[backends.copilot]\ncommand = \"claude\"\n").expect("config");
    let out = serve_output(&["--config", &config.display().to_string()]).await;
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(78), "{stderr}");
    assert!(stderr.contains("the Copilot runtime's own"), "{stderr}");
    let out = serve_output(&["--cli", "/nonexistent/copilot"]).await;
    assert_eq!(out.status.code(), Some(1));
    // A flag's value serve cannot read is a configuration it refuses too.
    for flag in [&["--listen", "notanaddr"][..], &["--log-format", "xml"][..]] {
        let out = serve_output(flag).await;
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(78), "{flag:?}: {stderr}");
        assert!(stderr.contains(flag[1]), "{stderr}");
    }

    // A private file: its trailing newline is not part of the token.
    let file = token_file(scratch.path(), "token", "file-token\n", 0o600);
    let daemon = Daemon::start(
        scratch.path(),
        "",
        &["--api-token-file", &file.display().to_string()],
    )
    .await;
    let addr = daemon.addr;
    let get = |auth: &'static str| async move {
        send(request(addr, "GET", "/v1/pool").header("authorization", auth))
            .await
            .status
    };
    assert_eq!(get("Bearer file-token").await, 200);
    assert_eq!(get("bearer file-token").await, 200);
    assert_eq!(get("BEARER file-token").await, 200);
    assert_eq!(get("Bearer file-token-x").await, 401);
    assert_eq!(get("Basic file-token").await, 401);
    // `status` reads the same file.
    let status = within_a_minute(
        tokio::process::Command::new(env!("CARGO_BIN_EXE_copilot-pool"))
            .args(["status", "--url", &format!("http://{addr}")])
            .arg("--api-token-file")
            .arg(&file)
            .env_remove("COPILOT_POOL_API_TOKEN"),
    )
    .await
    .expect("status");
    assert!(
        status.status.success(),
        "{}",
        String::from_utf8_lossy(&status.stderr)
    );
    // A container's health check knows no token: `--healthz` needs none, the snapshot does.
    let status_without_token = |extra: &'static [&'static str]| {
        let mut command = tokio::process::Command::new(env!("CARGO_BIN_EXE_copilot-pool"));
        command
            .args(["status", "--url", &format!("http://{addr}")])
            .args(extra)
            .env_remove("COPILOT_POOL_API_TOKEN");
        async move { within_a_minute(&mut command).await }
    };
    let health = status_without_token(&["--healthz"]).await.expect("status");
    let said = String::from_utf8_lossy(&health.stderr);
    assert!(health.status.success(), "{said}");
    assert_eq!(String::from_utf8_lossy(&health.stdout), "ok\n");
    let refused = status_without_token(&[]).await.expect("status");
    let said = String::from_utf8_lossy(&refused.stderr);
    assert!(!refused.status.success());
    assert!(said.contains("needs an API token"), "{said}");
    assert!(daemon.terminate().await.success());

    // From the environment.
    let daemon = Daemon::start_with(
        scratch.path(),
        "",
        &[],
        &[("COPILOT_POOL_API_TOKEN", "env-token")],
        None,
    )
    .await;
    assert_eq!(
        call(daemon.addr, "GET", "/v1/pool", Some("env-token"), None)
            .await
            .status,
        200
    );
    assert_eq!(
        call(daemon.addr, "GET", "/v1/pool", None, None)
            .await
            .status,
        401
    );
    assert!(daemon.terminate().await.success());
}

#[tokio::test]
async fn the_daemon_runs_one_async_thread_per_eight_cpus_unless_its_config_says_otherwise() {
    let cpus = std::thread::available_parallelism().map_or(1, usize::from);
    for (config, expected) in [("", (cpus / 8).max(1)), ("worker_threads = 3\n", 3)] {
        let scratch = support::Scratch::new();
        let log_path = scratch.path().join("serve.log");
        let log = std::fs::File::create(&log_path).expect("log file");
        let config = format!("log_format = \"json\"\n{config}");
        let daemon = Daemon::start_logged(scratch.path(), &config, &[], log).await;
        assert!(daemon.terminate().await.success());
        let text = std::fs::read_to_string(&log_path).expect("the log");
        let up = text
            .lines()
            .filter_map(|line| serde_json::from_str::<serde_json::Value>(line).ok())
            .find(|line| line["fields"]["message"] == "copilot-pool serve is up.")
            .unwrap_or_else(|| panic!("no start line in:\n{text}"));
        assert_eq!(up["fields"]["worker_threads"], expected, "{config}: {up}");
    }
}

#[tokio::test]
async fn a_gateway_on_the_same_host_runs_turns_over_the_apis_unix_socket_which_needs_a_token() {
    use std::os::unix::fs::{FileTypeExt, PermissionsExt};
    let scratch = support::Scratch::new();
    let model = ScriptedModel::new();
    let endpoint = model.serve_http().await.expect("model");
    let socket = scratch.path().join("api.sock");
    let listen = format!("unix:{}", socket.display());
    // Without an API token: refused, with the fix, and no socket is left behind.
    let out = serve_output(&["--listen", &listen]).await;
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(78), "{stderr}");
    assert!(stderr.contains("COPILOT_POOL_API_TOKEN"), "{stderr}");
    assert!(stderr.contains("--api-token-file"), "{stderr}");
    assert!(!socket.exists());

    // A socket file an earlier run left (no one answers on it) is replaced.
    drop(std::os::unix::net::UnixListener::bind(&socket).expect("a stale socket"));
    let token = "unix-socket-token";
    let daemon = SocketDaemon::start(
        scratch.path(),
        &format!("api_token = \"{token}\"\n"),
        &socket,
    )
    .await;
    assert_eq!(daemon.socket, socket);
    let meta = std::fs::symlink_metadata(&socket).expect("the socket");
    assert!(meta.file_type().is_socket());
    assert_eq!(meta.permissions().mode() & 0o777, 0o600, "owner-only");

    // A second daemon on the same socket is refused while the first answers on it.
    let config = token_file(
        scratch.path(),
        "second.toml",
        &format!("api_token = \"{token}\"\n"),
        0o600,
    );
    let out = serve_output(&[
        "--listen",
        &listen,
        "--config",
        &config.display().to_string(),
    ])
    .await;
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(stderr.contains("is in use"), "{stderr}");

    // A start that fails after its socket was bound (the metrics port is taken) leaves no
    // socket file behind.
    let taken = std::net::TcpListener::bind("127.0.0.1:0").expect("a port to take");
    let other = scratch.path().join("other.sock");
    let config = token_file(
        scratch.path(),
        "metrics.toml",
        &format!(
            "api_token = \"{token}\"\nmetrics_listen = \"{}\"\n",
            taken.local_addr().expect("its address")
        ),
        0o600,
    );
    let out = serve_output(&[
        "--listen",
        &format!("unix:{}", other.display()),
        "--config",
        &config.display().to_string(),
    ])
    .await;
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(stderr.contains("binding 127.0.0.1:"), "{stderr}");
    assert!(!other.exists(), "the socket of a failed start is removed");

    let client = daemon.client();
    let body = turn(
        &endpoint.base_url(),
        "agent-u",
        "over-the-socket",
        "REPLY=through the socket",
    );
    let post = |token: Option<&str>| {
        let request = client
            .post("http://localhost/v1/turns")
            .header(reqwest::header::CONTENT_TYPE, "application/json")
            .body(body.to_string());
        match token {
            Some(token) => request.bearer_auth(token),
            None => request,
        }
    };
    let refused = SseStream::from_request(post(None)).await;
    assert_eq!(refused.status, 401);
    for _ in 0..2 {
        let mut events = SseStream::from_request(post(Some(token))).await;
        assert_eq!(events.status, 200);
        let (_, end) = events.until_end().await;
        assert_eq!(end["status"], "idle", "{end}");
        assert_eq!(end["final_text"], "through the socket");
    }

    let status = daemon.terminate().await;
    assert!(status.success(), "{status:?}");
    assert!(
        !socket.exists(),
        "the socket is removed when the daemon stops"
    );
}
