//! End-to-end: the `copilot-pool` binary as a newcomer uses it.

mod support;

use support::procs;

use std::process::{Command, Output};

fn bin() -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_copilot-pool"));
    cmd.env_remove("COPILOT_CLI_PATH");
    cmd
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

async fn output(mut cmd: Command) -> Output {
    tokio::task::spawn_blocking(move || cmd.output().expect("run copilot-pool"))
        .await
        .expect("join")
}

#[tokio::test]
async fn run_prints_a_reply_from_the_embedded_model() {
    let runtime = support::runtime::runtime_path().await;
    for extra in [&[][..], &["--tunnel"][..]] {
        let home = tempfile::tempdir().expect("home");
        let mut cmd = bin();
        cmd.env("COPILOT_CLI_PATH", &runtime)
            .args(["run", "--prompt", "hi", "--home"])
            .arg(home.path())
            .args(extra);
        let out = output(cmd).await;
        let stdout = text(&out.stdout);
        assert!(
            out.status.success(),
            "{extra:?}: {}\n{stdout}",
            text(&out.stderr)
        );
        assert_eq!(stdout.trim(), "scripted reply #1: hi", "{extra:?}");
        // The runtime it started is gone with it.
        let home = home.path().display().to_string();
        assert!(procs::with_env("COPILOT_HOME", &home).is_empty());
    }
}

#[tokio::test]
async fn run_stops_cleanly_on_sigterm_mid_turn() {
    use std::io::Read;
    let runtime = support::runtime::runtime_path().await;
    let home = tempfile::tempdir().expect("home");
    let mut child = bin()
        .env("COPILOT_CLI_PATH", &runtime)
        .args(["run", "--prompt", "SCENARIO:slow SLOW=300x100 go", "--home"])
        .arg(home.path())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("spawn run");
    let mut stdout = child.stdout.take().expect("stdout");
    // The reply is streaming once the first chunk is printed.
    let first = tokio::task::spawn_blocking(move || {
        let mut buf = [0u8; 10];
        let n = stdout.read(&mut buf).expect("read");
        (String::from_utf8_lossy(&buf[..n]).into_owned(), stdout)
    })
    .await
    .expect("join");
    assert!(first.0.starts_with("slow-chunk"), "{:?}", first.0);
    let home_text = home.path().display().to_string();
    assert_eq!(procs::with_env("COPILOT_HOME", &home_text).len(), 1);
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(child.id() as i32),
        nix::sys::signal::Signal::SIGTERM,
    )
    .expect("SIGTERM");
    let out = tokio::task::spawn_blocking(move || child.wait_with_output())
        .await
        .expect("join")
        .expect("wait");
    assert!(!out.status.success());
    assert!(
        text(&out.stderr).contains("interrupted by SIGTERM"),
        "{}",
        text(&out.stderr)
    );
    let left = procs::wait_none(
        || procs::with_env("COPILOT_HOME", &home_text),
        std::time::Duration::from_secs(5),
    )
    .await;
    assert!(left.is_empty(), "runtime left behind: {left:?}");
}

#[tokio::test]
async fn run_fails_with_the_error_when_the_turn_fails() {
    let runtime = support::runtime::runtime_path().await;
    let mut cmd = bin();
    cmd.env("COPILOT_CLI_PATH", &runtime)
        .args(["run", "--prompt", "SCENARIO:error STATUS=400 go"]);
    let out = output(cmd).await;
    assert!(!out.status.success());
    let stderr = text(&out.stderr);
    assert!(
        stderr.contains("the turn failed") && stderr.contains("400"),
        "{stderr}"
    );
}

#[tokio::test]
async fn run_refuses_a_plain_http_model_off_the_guard_naming_its_own_flag() {
    let runtime = support::runtime::runtime_path().await;
    let mut cmd = bin();
    // Nothing listens there: the guard refuses before any call.
    cmd.env("COPILOT_CLI_PATH", &runtime).args([
        "run",
        "--prompt",
        "hi",
        "--provider-url",
        "http://127.0.0.1:9/v1",
    ]);
    let out = output(cmd).await;
    assert!(!out.status.success());
    let stderr = text(&out.stderr);
    assert!(stderr.contains("--allow-private-endpoints"), "{stderr}");
}

#[tokio::test]
async fn run_without_any_runtime_says_how_to_install_one() {
    let empty = tempfile::tempdir().expect("tempdir");
    let mut cmd = bin();
    cmd.env("COPILOT_POOL_CACHE_DIR", empty.path())
        .env("PATH", empty.path())
        .args(["run", "--prompt", "hi"]);
    let out = output(cmd).await;
    assert!(!out.status.success());
    let stderr = text(&out.stderr);
    assert!(stderr.contains("COPILOT_CLI_MISSING"), "{stderr}");
    assert!(stderr.contains("copilot-pool install-cli"), "{stderr}");
    // `run` never installs implicitly.
    assert_eq!(std::fs::read_dir(empty.path()).expect("dir").count(), 0);
}

#[tokio::test]
async fn install_cli_twice_succeeds_and_prints_the_same_executable() {
    // The test suite's own install put the runtime in the cache: both runs reuse it.
    support::runtime::runtime_path().await;
    let first = output({
        let mut c = bin();
        c.arg("install-cli");
        c
    })
    .await;
    let second = output({
        let mut c = bin();
        c.args(["install-cli", "--flavour", "runtime"]);
        c
    })
    .await;
    assert!(first.status.success(), "{}", text(&first.stderr));
    assert!(second.status.success(), "{}", text(&second.stderr));
    assert_eq!(first.stdout, second.stdout);
    let exe = text(&first.stdout);
    assert!(exe.trim().ends_with("copilot-runtime"), "{exe}");
    assert!(text(&second.stderr).contains("already installed"));
}

#[tokio::test]
async fn install_cli_refuses_an_unknown_flavour() {
    let out = output({
        let mut c = bin();
        c.args(["install-cli", "--flavour", "nightly"]);
        c
    })
    .await;
    assert!(!out.status.success());
    let stderr = text(&out.stderr);
    assert!(
        stderr.contains("runtime") && stderr.contains("cli"),
        "{stderr}"
    );
}

#[tokio::test]
async fn demo_runs_every_turn_survives_a_kill_and_a_rotation_and_leaves_no_orphans() {
    let runtime = support::runtime::runtime_path().await;
    let mut cmd = demo_on(&runtime, 2, 2, 3);
    cmd.arg("--json");
    let out = output(cmd).await;
    let stdout = text(&out.stdout);
    let stderr = text(&out.stderr);
    assert!(out.status.success(), "{stderr}\n{stdout}");
    let last = stdout.lines().last().expect("a summary line");
    let summary: serde_json::Value = serde_json::from_str(last).expect("JSON summary");
    let n = |k: &str| {
        summary[k]
            .as_u64()
            .unwrap_or_else(|| panic!("{k} in {summary}"))
    };
    assert_eq!(n("turns_ok") + n("turns_failed"), 2 * 2 * 3, "{summary}");
    assert_eq!(n("orphans"), 0);
    assert!(
        n("restarts") >= 1,
        "a killed worker is restarted: {summary}"
    );
    assert!(n("resumed") >= 1, "conversations resume: {summary}");
    assert!(
        n("evicted") >= 1,
        "the rotated-away worker is evicted: {summary}"
    );
    assert!(
        stderr.contains("SIGKILL") && stderr.contains("rotating"),
        "{stderr}"
    );
    for key in ["tool_calls", "user_inputs", "compactions", "timeouts"] {
        assert_eq!(n(key), 1, "{key}: {summary}");
    }
    assert_eq!(n("transcript_duplicates"), 0);
}

#[tokio::test]
async fn the_demo_installs_the_pinned_runtime_instead_of_running_a_copilot_found_on_path() {
    let scratch = tempfile::tempdir().expect("scratch");
    // A `copilot` on PATH that says so when it runs.
    let bin_dir = scratch.path().join("bin");
    std::fs::create_dir(&bin_dir).expect("bin");
    let ran = scratch.path().join("ran");
    let copilot = bin_dir.join("copilot");
    std::fs::write(
        &copilot,
        format!("#!/bin/sh\ntouch {:?}\nexit 1\n", ran.display().to_string()),
    )
    .expect("script");
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&copilot, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    // An empty cache, and a registry that refuses at once: the install is tried, and fails.
    let registry = support::refusing_port::RefusingPort::new();
    let path = format!(
        "{}:{}",
        bin_dir.display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let mut cmd = bin();
    cmd.env("PATH", path)
        .env("COPILOT_POOL_CACHE_DIR", scratch.path().join("cache"))
        .env(
            "npm_config_registry",
            format!("http://127.0.0.1:{}/", registry.port()),
        )
        .env("npm_config_fetch_retries", "0")
        .args([
            "demo",
            "--agents",
            "1",
            "--conversations",
            "1",
            "--turns",
            "1",
        ]);
    let out = output(cmd).await;
    let stderr = text(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(
        stderr.contains("installing the pinned Copilot runtime")
            && stderr.contains(&format!("{} on PATH is not used", copilot.display())),
        "{stderr}"
    );
    assert!(!ran.exists(), "the copilot on PATH was run: {stderr}");
}

/// `copilot-pool demo` of `agents` x `conversations` x `turns` on the runtime at `cli`.
fn demo_on(cli: &std::path::Path, agents: u32, conversations: u32, turns: u32) -> Command {
    let mut cmd = bin();
    cmd.env("COPILOT_CLI_PATH", cli).arg("demo");
    for (flag, n) in [
        ("--agents", agents),
        ("--conversations", conversations),
        ("--turns", turns),
    ] {
        cmd.arg(flag).arg(n.to_string());
    }
    cmd
}

/// Runs `cmd` to its end, failing the test after `limit` (the process is killed).
async fn output_within(cmd: Command, limit: std::time::Duration) -> Output {
    let mut cmd = tokio::process::Command::from(cmd);
    cmd.kill_on_drop(true);
    tokio::time::timeout(limit, cmd.output())
        .await
        .unwrap_or_else(|_| panic!("{cmd:?} did not end within {limit:?}"))
        .expect("run copilot-pool")
}

#[tokio::test]
async fn the_smallest_demo_finishes_and_a_runtime_that_never_starts_fails_it() {
    let runtime = support::runtime::runtime_path().await;
    let scratch = tempfile::tempdir().expect("scratch");
    let broken = scratch.path().join("copilot");
    std::fs::write(&broken, "#!/bin/sh\nexit 1\n").expect("script");
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&broken, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    let limit = std::time::Duration::from_secs(120);
    // One agent, one turn: the turn that waits for the token rotation is the only one, and
    // the worker to kill never comes before it (the demo waited for both, forever).
    let mut cmd = demo_on(&runtime, 1, 1, 1);
    cmd.arg("--json");
    let out = output_within(cmd, limit).await;
    let stdout = text(&out.stdout);
    assert!(out.status.success(), "{}\n{stdout}", text(&out.stderr));
    let summary: serde_json::Value =
        serde_json::from_str(stdout.lines().last().expect("a summary")).expect("JSON");
    assert_eq!(summary["turns_ok"], 1, "{summary}");
    // A runtime that exits at once: every turn fails, and so does the demo, saying so.
    let out = output_within(demo_on(&broken, 2, 1, 2), limit).await;
    let stderr = text(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(
        stderr.contains("no turn succeeded") && stderr.contains("copilot-pool doctor"),
        "{stderr}"
    );
}
