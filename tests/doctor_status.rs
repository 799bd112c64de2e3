//! End-to-end: `copilot-pool doctor` and `copilot-pool status` as an operator runs them.

mod support;

use std::path::Path;
use std::process::{Command, Output};
use std::time::Duration;

use support::procs;

/// The binary with an environment that cannot reach real homes, tokens or runtimes.
fn bin(scratch: &Path) -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_copilot-pool"));
    cmd.env_remove("COPILOT_CLI_PATH")
        .env_remove("COPILOT_POOL_API_TOKEN")
        .env("COPILOT_POOL_HOME", scratch.join("pool-home"))
        // The doctor's throwaway runtime home goes here, so we can see it is removed.
        .env("TMPDIR", scratch.join("tmp"));
    std::fs::create_dir_all(scratch.join("tmp")).expect("tmp");
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

/// A config file with the state and agents directories inside `scratch`.
fn write_config(scratch: &Path, state_dir: &Path) -> std::path::PathBuf {
    let path = scratch.join("copilot-pool.toml");
    let agents = scratch.join("agents");
    std::fs::write(
        &path,
        format!(
            "state_dir = {:?}\nagents_dir = {:?}\n",
            state_dir.display().to_string(),
            agents.display().to_string()
        ),
    )
    .expect("config");
    path
}

/// `copilot-pool doctor --config <config>` with the runtime at `runtime`, run to its end.
async fn doctor_with(scratch: &Path, runtime: &Path, config: &Path) -> Output {
    let mut cmd = bin(scratch);
    cmd.env("COPILOT_CLI_PATH", runtime)
        .args(["doctor", "--config"])
        .arg(config);
    output(cmd).await
}

/// Puts `line` first in the config file at `config`.
fn prepend(config: &Path, line: &str) {
    let text = std::fs::read_to_string(config).expect("config");
    std::fs::write(config, format!("{line}\n{text}")).expect("config");
}

/// [`doctor_with`], given an API token file (0600) as `serve` would be.
async fn doctor_with_token_file(scratch: &Path, runtime: &Path, config: &Path) -> Output {
    let token = scratch.join("api-token");
    std::fs::write(&token, "a-long-api-token-for-the-doctor").expect("token");
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&token, std::fs::Permissions::from_mode(0o600)).expect("chmod");
    let mut cmd = bin(scratch);
    cmd.env("COPILOT_CLI_PATH", runtime)
        .args(["doctor", "--config"])
        .arg(config)
        .arg("--api-token-file")
        .arg(&token);
    output(cmd).await
}

/// Nothing the doctor started or created is left behind.
async fn assert_nothing_left(scratch: &Path) {
    let left = procs::wait_none(
        || procs::with_env_prefix("COPILOT_HOME", &scratch.display().to_string()),
        Duration::from_secs(5),
    )
    .await;
    assert!(left.is_empty(), "runtime processes left: {left:?}");
    let leftovers: Vec<_> = std::fs::read_dir(scratch.join("tmp"))
        .expect("tmp")
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|name| name.starts_with("copilot-pool-doctor-"))
        .collect();
    assert!(leftovers.is_empty(), "doctor left {leftovers:?} in TMPDIR");
}

#[tokio::test]
async fn doctor_passes_on_a_good_setup() {
    let runtime = support::runtime::runtime_path().await;
    let scratch = tempfile::tempdir().expect("scratch");
    let config = write_config(scratch.path(), &scratch.path().join("state"));
    let out = doctor_with(scratch.path(), &runtime, &config).await;
    let stdout = text(&out.stdout);
    assert!(
        out.status.success(),
        "stdout:\n{stdout}\nstderr:\n{}",
        text(&out.stderr)
    );
    let lines: Vec<&str> = stdout.lines().collect();
    for check in [
        "config",
        "runtime",
        "runtime start",
        "state dir",
        "agents dir",
        "bindings",
    ] {
        assert!(
            lines
                .iter()
                .any(|l| l.starts_with(&format!("ok   {check}: "))),
            "no ok line for {check}:\n{stdout}"
        );
    }
    // A bundled CLI backend left at its default whose CLI is not installed here is skipped.
    assert!(
        lines
            .iter()
            .all(|l| l.starts_with("ok ") || l.starts_with("skip backend ")),
        "not every check passed:\n{stdout}"
    );
    assert!(stdout.contains("protocol 3"), "{stdout}");
    // It created the directories, private.
    use std::os::unix::fs::PermissionsExt;
    for dir in ["state", "agents", "state/bindings"] {
        let mode = std::fs::metadata(scratch.path().join(dir))
            .unwrap_or_else(|e| panic!("{dir}: {e}"))
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o700, "{dir}");
    }
    assert_nothing_left(scratch.path()).await;
}

#[tokio::test]
async fn doctor_counts_the_cli_backends_bindings_and_fails_on_a_directory_others_can_read() {
    use std::os::unix::fs::PermissionsExt;
    let runtime = support::runtime::runtime_path().await;
    let scratch = tempfile::tempdir().expect("scratch");
    let state = scratch.path().join("state");
    let cli = state.join("cli-bindings");
    std::fs::create_dir_all(&cli).expect("cli bindings");
    std::fs::write(cli.join(format!("{}.json", "a".repeat(64))), "{}").expect("binding");
    std::fs::set_permissions(&state, std::fs::Permissions::from_mode(0o700)).expect("chmod");
    std::fs::set_permissions(&cli, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    let config = write_config(scratch.path(), &state);
    let out = doctor_with(scratch.path(), &runtime, &config).await;
    let stdout = text(&out.stdout);
    let fail = stdout
        .lines()
        .find(|l| l.starts_with("FAIL cli bindings: "))
        .unwrap_or_else(|| panic!("no FAIL line for the CLI bindings:\n{stdout}"));
    assert!(fail.contains("chmod 700"), "{fail}");
    std::fs::set_permissions(&cli, std::fs::Permissions::from_mode(0o700)).expect("chmod");
    let out = doctor_with(scratch.path(), &runtime, &config).await;
    let stdout = text(&out.stdout);
    assert!(
        stdout
            .lines()
            .any(|l| l.starts_with("ok   cli bindings: 1 CLI backend conversation bound in ")),
        "{stdout}"
    );
    assert_nothing_left(scratch.path()).await;
}

#[tokio::test]
async fn doctor_counts_a_token_file_for_a_listener_off_loopback_as_serve_does() {
    let runtime = support::runtime::runtime_path().await;
    let scratch = tempfile::tempdir().expect("scratch");
    let config = write_config(scratch.path(), &scratch.path().join("state"));
    prepend(&config, "listen = \"0.0.0.0:0\"");
    let out = doctor_with_token_file(scratch.path(), &runtime, &config).await;
    let stdout = text(&out.stdout);
    assert!(
        stdout.lines().any(|l| l.starts_with("ok   config: ")),
        "the token file is the token serve would use:\n{stdout}"
    );
    assert!(!stdout.contains("a-long-api-token"), "{stdout}");
    assert_nothing_left(scratch.path()).await;
}

#[tokio::test]
async fn doctor_reads_the_token_file_even_with_a_token_in_the_environment_as_serve_does() {
    let runtime = support::runtime::runtime_path().await;
    let scratch = tempfile::tempdir().expect("scratch");
    let config = write_config(scratch.path(), &scratch.path().join("state"));
    // A token file every local user can read: serve refuses it whatever else gives a token.
    let token = scratch.path().join("shared-token");
    std::fs::write(&token, "a-long-api-token-others-can-read").expect("token");
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&token, std::fs::Permissions::from_mode(0o644)).expect("chmod");
    let mut cmd = bin(scratch.path());
    cmd.env("COPILOT_CLI_PATH", &runtime)
        .env("COPILOT_POOL_API_TOKEN", "a-token-from-the-environment")
        .args(["doctor", "--config"])
        .arg(&config)
        .arg("--api-token-file")
        .arg(&token);
    let out = output(cmd).await;
    let stdout = text(&out.stdout);
    assert!(!out.status.success(), "{stdout}");
    assert!(
        stdout
            .lines()
            .any(|l| l.starts_with("FAIL api token file: ")),
        "{stdout}"
    );
    assert_nothing_left(scratch.path()).await;
}

#[tokio::test]
async fn doctor_fails_as_serve_refuses_an_api_without_a_token_that_unsandboxed_workers_can_reach() {
    let runtime = support::runtime::runtime_path().await;
    let scratch = tempfile::tempdir().expect("scratch");
    let config = write_config(scratch.path(), &scratch.path().join("state"));
    prepend(&config, "sandbox = \"off\"");
    let out = doctor_with(scratch.path(), &runtime, &config).await;
    let stdout = text(&out.stdout);
    assert!(!out.status.success(), "{stdout}");
    assert!(
        stdout
            .lines()
            .any(|l| l.starts_with("FAIL api token: refusing to serve without an API token")),
        "{stdout}"
    );
    // With the token serve would use, that check passes.
    let out = doctor_with_token_file(scratch.path(), &runtime, &config).await;
    let stdout = text(&out.stdout);
    assert!(!stdout.contains("api token"), "{stdout}");
    assert_nothing_left(scratch.path()).await;
}

#[tokio::test]
async fn doctor_fails_on_a_backend_table_or_a_model_setting_serve_would_refuse_at_start() {
    let runtime = support::runtime::runtime_path().await;
    let scratch = tempfile::tempdir().expect("scratch");
    let config = write_config(scratch.path(), &scratch.path().join("state"));
    let good = std::fs::read_to_string(&config).expect("config");
    let not_pem = scratch.path().join("not-a-certificate.pem");
    std::fs::write(&not_pem, "hello").expect("file");
    let cases = [
        (
            "[backends.copilot]\ncommand = \"claude\"\n".to_owned(),
            "the Copilot runtime's own",
        ),
        (
            format!(
                "[model]\nextra_ca_files = [{:?}]\n",
                not_pem.display().to_string()
            ),
            "BEGIN CERTIFICATE",
        ),
    ];
    for (table, says) in cases {
        std::fs::write(&config, format!("{good}{table}")).expect("config");
        let out = doctor_with(scratch.path(), &runtime, &config).await;
        let stdout = text(&out.stdout);
        assert!(!out.status.success(), "{table}: {stdout}");
        let fail = stdout
            .lines()
            .find(|l| l.starts_with("FAIL pool settings: "))
            .unwrap_or_else(|| panic!("{table}: no FAIL line for the pool settings:\n{stdout}"));
        assert!(fail.contains(says) && fail.contains(" — fix: "), "{fail}");
    }
    // A backend table whose command is not installed: serve would start, and its turns
    // fail, so the doctor says so, with the command, where it looked and the fix.
    let table = "[backends.codex-cli]\ncommand = \"codex-not-installed-here\"\n";
    std::fs::write(&config, format!("{good}{table}")).expect("config");
    let out = doctor_with(scratch.path(), &runtime, &config).await;
    let stdout = text(&out.stdout);
    assert!(!out.status.success(), "{stdout}");
    let fail = stdout
        .lines()
        .find(|l| l.starts_with("FAIL backend codex-cli: "))
        .unwrap_or_else(|| panic!("no FAIL line for the missing command:\n{stdout}"));
    assert!(
        fail.contains("codex-not-installed-here") && fail.contains("PATH"),
        "{fail}"
    );
    assert!(
        fail.contains(" — fix: ") && fail.contains("[backends.codex-cli]"),
        "{fail}"
    );
    // The bundled backends and the default guard pass, and are named.
    std::fs::write(&config, good).expect("config");
    let out = doctor_with(scratch.path(), &runtime, &config).await;
    let stdout = text(&out.stdout);
    assert!(
        stdout
            .lines()
            .any(|l| l.starts_with("ok   pool settings: CLI backends: claude-cli")),
        "{stdout}"
    );
    assert_nothing_left(scratch.path()).await;
}

#[tokio::test]
async fn doctor_fails_when_the_state_dir_is_a_file() {
    let runtime = support::runtime::runtime_path().await;
    let scratch = tempfile::tempdir().expect("scratch");
    let state = scratch.path().join("state-file");
    std::fs::write(&state, "not a directory").expect("file");
    let config = write_config(scratch.path(), &state);
    let out = doctor_with(scratch.path(), &runtime, &config).await;
    let stdout = text(&out.stdout);
    let stderr = text(&out.stderr);
    assert_eq!(
        out.status.code(),
        Some(1),
        "stdout:\n{stdout}\nstderr:\n{stderr}"
    );
    let fail = stdout
        .lines()
        .find(|l| l.starts_with("FAIL ") && l.contains("state"))
        .unwrap_or_else(|| panic!("no FAIL line about the state dir:\n{stdout}"));
    assert!(fail.contains("not a directory"), "{fail}");
    assert!(fail.contains(" — fix: "), "{fail}");
    assert!(
        stderr.contains("check failed") || stderr.contains("checks failed"),
        "{stderr}"
    );
    assert_nothing_left(scratch.path()).await;
}

#[tokio::test]
async fn doctor_fails_when_the_agents_homes_lie_where_every_agent_may_read() {
    let runtime = support::runtime::runtime_path().await;
    let scratch = tempfile::tempdir().expect("scratch");
    let shared = scratch.path().join("shared");
    let config = scratch.path().join("copilot-pool.toml");
    std::fs::write(
        &config,
        format!(
            "state_dir = {:?}\nagents_dir = {:?}\nsandbox_read_paths = [{:?}]\n",
            scratch.path().join("state").display().to_string(),
            shared.join("agents").display().to_string(),
            shared.display().to_string(),
        ),
    )
    .expect("config");
    let out = doctor_with(scratch.path(), &runtime, &config).await;
    let stdout = text(&out.stdout);
    assert_eq!(out.status.code(), Some(1), "{stdout}");
    let fail = stdout
        .lines()
        .find(|l| l.starts_with("FAIL sandbox places"))
        .unwrap_or_else(|| panic!("no FAIL line about the sandbox places:\n{stdout}"));
    assert!(
        fail.contains("agents_dir") && fail.contains("which every sandboxed agent may read"),
        "{fail}"
    );
    assert_nothing_left(scratch.path()).await;
}

#[tokio::test]
async fn doctor_fails_on_a_missing_runtime() {
    let scratch = tempfile::tempdir().expect("scratch");
    let config = write_config(scratch.path(), &scratch.path().join("state"));
    let mut cmd = bin(scratch.path());
    cmd.args(["doctor", "--cli", "/nonexistent", "--config"])
        .arg(&config);
    let out = output(cmd).await;
    let stdout = text(&out.stdout);
    assert_eq!(
        out.status.code(),
        Some(1),
        "stdout:\n{stdout}\nstderr:\n{}",
        text(&out.stderr)
    );
    let fail = stdout
        .lines()
        .find(|l| l.starts_with("FAIL runtime: "))
        .unwrap_or_else(|| panic!("no FAIL line for the runtime:\n{stdout}"));
    assert!(fail.contains("/nonexistent"), "{fail}");
    assert!(fail.contains("copilot-pool install-cli"), "{fail}");
    // The other checks still ran.
    assert!(stdout.contains("ok   state dir: "), "{stdout}");
}

#[tokio::test]
async fn status_without_a_daemon_says_how_to_start_one() {
    let scratch = tempfile::tempdir().expect("scratch");
    let mut cmd = bin(scratch.path());
    cmd.args(["status", "--url", "http://127.0.0.1:1"]);
    let out = output(cmd).await;
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("no copilot-pool daemon at http://127.0.0.1:1"),
        "{stderr}"
    );
    assert!(stderr.contains("copilot-pool serve"), "{stderr}");
}

/// Directories under `root` (itself included), recursively, with their permission bits;
/// `skip` names directories whose insides belong to someone else (the runtime's homes).
fn dir_modes(root: &Path, skip: &dyn Fn(&Path) -> bool) -> Vec<(std::path::PathBuf, u32)> {
    use std::os::unix::fs::PermissionsExt;
    let mut out = Vec::new();
    let mut todo = vec![root.to_path_buf()];
    while let Some(dir) = todo.pop() {
        let mode = std::fs::metadata(&dir)
            .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
            .permissions()
            .mode()
            & 0o7777;
        out.push((dir.clone(), mode));
        if skip(&dir) {
            continue;
        }
        for entry in std::fs::read_dir(&dir).expect("read_dir").flatten() {
            if entry.file_type().map(|t| t.is_dir()).unwrap_or(false) {
                todo.push(entry.path());
            }
        }
    }
    out
}

#[tokio::test]
async fn doctor_passes_after_serve_ran_a_turn_and_every_directory_serve_made_is_private() {
    use copilot_pool::scripted_model::ScriptedModel;
    use serde_json::json;
    let runtime = support::runtime::runtime_path().await;
    let scratch = tempfile::tempdir().expect("scratch");
    let model = ScriptedModel::new();
    let endpoint = model.serve_http().await.expect("model");
    // The daemon's home is `<scratch>/pool-home`, the same one `bin` gives the doctor.
    let daemon = support::http::Daemon::start(scratch.path(), "", &[]).await;
    let body = json!({
        "agent_id": "agent-d", "session_key": "conv", "prompt": "REPLY=hi",
        "model": ScriptedModel::MODEL_ID,
        "provider": {"type": "openai", "base_url": endpoint.base_url(), "api_key": "k"},
    });
    let done = support::http::call(
        daemon.addr,
        "POST",
        "/v1/turns?stream=false",
        None,
        Some(&body),
    )
    .await;
    assert_eq!(done.json()["status"], "idle", "{}", done.body);
    assert!(daemon.terminate().await.success());

    let home = scratch.path().join("pool-home");
    let agent = home.join("agents/agent-d");
    for dir in [
        home.clone(),
        home.join("state"),
        home.join("agents"),
        agent.clone(),
        agent.join("work"),
        agent.join("copilot"),
    ] {
        assert!(dir.is_dir(), "serve did not create {}", dir.display());
    }
    // What the runtime makes inside its COPILOT_HOME and working directory is its own.
    let runtime_owned = |d: &Path| d.ends_with("copilot") || d.ends_with("work");
    let open: Vec<_> = dir_modes(&home, &runtime_owned)
        .into_iter()
        .filter(|(_, mode)| mode & 0o077 != 0)
        .collect();
    assert!(open.is_empty(), "directories serve left open: {open:?}");

    let mut cmd = bin(scratch.path());
    cmd.env("COPILOT_CLI_PATH", &runtime).arg("doctor");
    let out = output(cmd).await;
    let stdout = text(&out.stdout);
    assert!(
        out.status.success(),
        "doctor failed after serve:\nstdout:\n{stdout}\nstderr:\n{}",
        text(&out.stderr)
    );
    assert_nothing_left(scratch.path()).await;
}
