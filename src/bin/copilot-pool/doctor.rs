//! `copilot-pool doctor`: checks what `serve` needs — the config, the runtime (located and
//! actually started in a throwaway home), the state and agents directories, the bindings —
//! and prints one line per check with the fix for each failure.

use std::fs;
use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Result, bail};
use clap::Args;
use copilot_pool::pool::BindingStore;
use copilot_pool::rpc::PROTOCOL_VERSION;
use copilot_pool::runtime::{self, CLI_PATH_ENV, INSTALL_COMMAND, LocateError};
use copilot_pool::worker::{WorkerConfig, WorkerHandle};

use crate::config::ServeConfig;
use copilot_pool::kinds::SandboxMode;

#[derive(Args, Debug)]
pub struct DoctorArgs {
    /// The config file `serve` uses (TOML; default: built-in defaults).
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// The runtime executable to check (default: `cli_path` from the config,
    /// COPILOT_CLI_PATH, the managed install, `copilot` on PATH).
    #[arg(long)]
    pub cli: Option<PathBuf>,
    /// The API token's file `serve` is given (checked for where it lies; not read).
    #[arg(long, value_name = "PATH")]
    pub api_token_file: Option<PathBuf>,
}

/// Prints check results as they come and counts the failures.
#[derive(Default)]
struct Report {
    failed: usize,
}

impl Report {
    fn ok(&mut self, check: &str, detail: impl std::fmt::Display) {
        println!("ok   {check}: {detail}");
    }

    fn fail(&mut self, check: &str, problem: impl std::fmt::Display, fix: impl std::fmt::Display) {
        self.failed += 1;
        println!("FAIL {check}: {problem} — fix: {fix}");
    }

    fn skip(&mut self, check: &str, why: impl std::fmt::Display) {
        println!("skip {check}: {why}");
    }
}

pub async fn doctor(args: DoctorArgs) -> Result<()> {
    let mut report = Report::default();

    // config
    let config = match ServeConfig::load(args.config.as_deref()) {
        Ok(mut config) => {
            // The token `serve` would read from --api-token-file, read as it reads it (an
            // unreadable, empty or shared file fails here as it fails there).
            // Over the config's and the environment's, as serve takes it.
            if let Some(path) = &args.api_token_file {
                match crate::config::read_token_file(path) {
                    Ok(token) => config.api_token = Some(token),
                    Err(e) => report.fail(
                        "api token file",
                        format!("{e:#}"),
                        "make it a private (0600) file holding the token",
                    ),
                }
            }
            let source = match &args.config {
                Some(path) => format!("{} loaded", path.display()),
                None => "no --config, using the defaults".to_owned(),
            };
            match config.validate() {
                Ok(()) => report.ok(
                    "config",
                    format!(
                        "{source}; listen {}, API token {}",
                        config.listen,
                        if config.api_token.is_some() {
                            "set"
                        } else {
                            "not set"
                        }
                    ),
                ),
                Err(err) => report.fail(
                    "config",
                    format!("{source} but it cannot work: {err:#}"),
                    "change the setting named in the message",
                ),
            }
            Some(config)
        }
        Err(err) => {
            report.fail(
                "config",
                format!("{err:#}"),
                "correct the file (every field is listed in the README) or leave out --config \
                 to use the defaults",
            );
            None
        }
    };

    // pool settings: what the pool refuses at start ([backends.*], [model])
    if let Some(config) = &config {
        check_pool_settings(&mut report, config);
    }

    // runtime
    let explicit = args
        .cli
        .clone()
        .or_else(|| config.as_ref().and_then(|c| c.cli_path.clone()));
    let mut runtime_path = None;
    match runtime::locate(explicit.as_deref(), runtime::process_env) {
        Ok(located) => {
            runtime_path = Some(located.path.clone());
            report.ok(
                "runtime",
                format!("{} (from {})", located.path.display(), located.source),
            );
            check_runtime_start(&mut report, located.path).await;
        }
        Err(err) => {
            let fix = match &err {
                LocateError::Missing { .. } => format!(
                    "run `{INSTALL_COMMAND}` to install the pinned runtime, or set \
                     {CLI_PATH_ENV} (or --cli, or cli_path in the config) to an existing \
                     copilot or copilot-runtime executable"
                ),
                LocateError::Unusable { .. } => format!(
                    "point --cli, cli_path or {CLI_PATH_ENV} at an existing executable, or \
                     drop it and run `{INSTALL_COMMAND}`"
                ),
                LocateError::UnsafeInstall { .. } => "make the cache directory writable by \
                    this user alone, as the error says, or point {CLI_PATH_ENV} at a runtime \
                    only this user can change"
                    .replace("{CLI_PATH_ENV}", CLI_PATH_ENV),
            };
            report.fail("runtime", err, fix);
            report.skip("runtime start", "no runtime to start");
        }
    }

    // sandbox
    if let Some(config) = &config {
        check_sandbox(
            &mut report,
            config,
            args.config.as_deref(),
            args.api_token_file.as_deref(),
            runtime_path.as_deref(),
        )
        .await;
    }

    // directories and bindings
    match &config {
        Some(config) => {
            let state_ok = match config.state_dir() {
                Ok(dir) => check_private_dir(&mut report, "state dir", "state_dir", &dir),
                Err(err) => {
                    report.fail(
                        "state dir",
                        format!("{err:#}"),
                        "set state_dir in the config, or COPILOT_POOL_HOME",
                    );
                    false
                }
            };
            match config.agents_dir() {
                Ok(dir) => {
                    check_private_dir(&mut report, "agents dir", "agents_dir", &dir);
                }
                Err(err) => report.fail(
                    "agents dir",
                    format!("{err:#}"),
                    "set agents_dir in the config, or COPILOT_POOL_HOME",
                ),
            }
            match (state_ok, config.state_dir()) {
                (true, Ok(dir)) => {
                    check_bindings(&mut report, &dir);
                    check_cli_bindings(&mut report, &dir);
                }
                _ => report.skip("bindings", "the state dir is not usable"),
            }
        }
        None => {
            for check in ["state dir", "agents dir", "bindings"] {
                report.skip(check, "the config did not load");
            }
        }
    }

    if report.failed > 0 {
        bail!(
            "{} check{} failed",
            report.failed,
            if report.failed == 1 { "" } else { "s" }
        );
    }
    Ok(())
}

/// Builds the pool's config as `serve` does (`[backends.*]` tables over their bundled
/// defaults, the model guard's endpoints and extra root certificates read) and checks what
/// `Pool::start` would refuse, without starting it.
fn check_pool_settings(report: &mut Report, config: &ServeConfig) {
    const CHECK: &str = "pool settings";
    // The runtime's path plays no part in the check.
    let pool = config.pool_config(PathBuf::from("copilot"));
    match pool {
        Ok(pool) => {
            check_cli_commands(report, config, &pool.cli_backends);
            let backends: Vec<&str> = pool.cli_backends.keys().map(String::as_str).collect();
            report.ok(
                CHECK,
                format!(
                    "CLI backends: {}; model guard: {} private endpoint(s) allowed, {} extra \
                     root certificate file(s)",
                    if backends.is_empty() {
                        "none".to_owned()
                    } else {
                        backends.join(", ")
                    },
                    pool.model_guard.private_endpoints.len(),
                    pool.model_guard.extra_root_certificates_pem.len(),
                ),
            )
        }
        Err(err) => report.fail(
            CHECK,
            format!("{err:#}"),
            "change the setting the message names (serve refuses to start with it)",
        ),
    }
}

/// Each CLI backend's `command` where its processes would look for it (the daemon's `PATH`):
/// one the config's `[backends.<id>]` names must be there (a FAIL); a bundled one left at its
/// default that is not installed is skipped, named (its turns fail until it is installed).
fn check_cli_commands(
    report: &mut Report,
    config: &ServeConfig,
    backends: &std::collections::BTreeMap<String, copilot_pool::backend::CliBackendConfig>,
) {
    let path_var = std::env::var_os("PATH");
    for (id, backend) in backends {
        let check = format!("backend {id}");
        match backend.check_installed(id, path_var.as_deref()) {
            Ok(()) => report.ok(&check, format!("command {:?}", backend.command)),
            Err(err) if config.backends.contains_key(id) => report.fail(
                &check,
                &err.problem,
                format!(
                    "install the CLI, or set `command` in [backends.{id}] to its full path \
                     (serve starts without it; its turns fail with this message)"
                ),
            ),
            Err(_) => report.skip(
                &check,
                format!(
                    "the bundled default's command {:?} is not on PATH: turns naming {id} \
                     fail until it is installed (or set `command` in [backends.{id}])",
                    backend.command
                ),
            ),
        }
    }
}

/// A directory removed on drop.
struct TempDir(PathBuf);

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.0);
    }
}

/// Starts one worker on `program` in a throwaway home, checks the handshake, stops it.
async fn check_runtime_start(report: &mut Report, program: PathBuf) {
    const CHECK: &str = "runtime start";
    let scratch =
        TempDir(std::env::temp_dir().join(format!("copilot-pool-doctor-{}", uuid::Uuid::new_v4())));
    let home = scratch.0.join("copilot");
    let work = scratch.0.join("work");
    for dir in [&home, &work] {
        if let Err(err) = fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)
        {
            report.fail(
                CHECK,
                format!(
                    "cannot create the scratch directory {}: {err}",
                    dir.display()
                ),
                "make the temporary directory (TMPDIR) writable",
            );
            return;
        }
    }
    let mut config = WorkerConfig::new(program.clone(), home, work);
    // Keep the runtime away from the real home as well as from any real COPILOT_HOME.
    config.extra_env = vec![("HOME".to_owned(), scratch.0.display().to_string())];
    config.start_timeout = Duration::from_secs(60);
    config.kill_grace = Duration::from_secs(2);
    let worker = match WorkerHandle::start(config).await {
        Ok(worker) => worker,
        Err(err) => {
            report.fail(
                CHECK,
                format!("{} did not start: {err}", program.display()),
                format!(
                    "make sure it is a working copilot or copilot-runtime executable \
                     (reinstall the pinned one with `{INSTALL_COMMAND}`)"
                ),
            );
            return;
        }
    };
    let info = worker.info().clone();
    let exit = worker.shutdown().await;
    drop(worker);
    if info.protocol_version != PROTOCOL_VERSION {
        report.fail(
            CHECK,
            format!(
                "runtime {} speaks protocol {}, copilot-pool needs {PROTOCOL_VERSION}",
                info.runtime_version, info.protocol_version
            ),
            format!("install the pinned runtime with `{INSTALL_COMMAND}`"),
        );
    } else if !exit.is_shutdown() {
        report.fail(
            CHECK,
            format!("the runtime did not stop cleanly: {exit}"),
            "check the stderr tail above; reinstall the runtime if it keeps crashing",
        );
    } else {
        report.ok(
            CHECK,
            format!(
                "runtime {} speaks protocol {PROTOCOL_VERSION}; started (pid {}) and stopped",
                info.runtime_version, info.pid
            ),
        );
    }
}

/// Checks that `dir` is (or can be made) a directory we can write and nobody else can read.
/// Returns true when it passed.
fn check_private_dir(report: &mut Report, check: &str, setting: &str, dir: &Path) -> bool {
    let shown = dir.display();
    let mut created = false;
    match fs::metadata(dir) {
        Ok(meta) if !meta.is_dir() => {
            report.fail(
                check,
                format!("{shown} exists but is not a directory"),
                format!("remove or rename it, or set {setting} in the config to a directory"),
            );
            return false;
        }
        Ok(_) => {}
        Err(err) if err.kind() == std::io::ErrorKind::NotFound => {
            let made = fs::DirBuilder::new()
                .recursive(true)
                .mode(0o700)
                .create(dir)
                .and_then(|()| fs::set_permissions(dir, fs::Permissions::from_mode(0o700)));
            if let Err(err) = made {
                report.fail(
                    check,
                    format!("{shown} does not exist and cannot be created: {err}"),
                    format!(
                        "create it with `mkdir -p -m 700 {shown}`, or set {setting} in the \
                         config to a directory this user can create"
                    ),
                );
                return false;
            }
            created = true;
        }
        Err(err) => {
            report.fail(
                check,
                format!("cannot inspect {shown}: {err}"),
                format!("make it reachable by this user, or set {setting} in the config"),
            );
            return false;
        }
    }

    let probe = dir.join(format!(".copilot-pool-doctor-{}", uuid::Uuid::new_v4()));
    let written = fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(&probe)
        .and_then(|mut file| std::io::Write::write_all(&mut file, b"probe"));
    let removed = if written.is_ok() {
        fs::remove_file(&probe)
    } else {
        Ok(())
    };
    if let Err(err) = written.and(removed) {
        let _ = fs::remove_file(&probe);
        report.fail(
            check,
            format!("{shown} is not writable: {err}"),
            format!("give this user write access (`chmod u+rwx {shown}`, or chown it)"),
        );
        return false;
    }

    let mode = match fs::metadata(dir) {
        Ok(meta) => meta.permissions().mode() & 0o7777,
        Err(err) => {
            report.fail(
                check,
                format!("cannot inspect {shown}: {err}"),
                format!("make it reachable by this user, or set {setting} in the config"),
            );
            return false;
        }
    };
    if mode & 0o077 != 0 {
        report.fail(
            check,
            format!("{shown} has mode {mode:04o}; other users can reach what is inside"),
            format!("chmod 700 {shown}"),
        );
        return false;
    }
    report.ok(
        check,
        format!(
            "{shown} ({}directory, writable, mode {mode:04o})",
            if created { "created " } else { "" }
        ),
    );
    true
}

/// Opens the binding store in `state_dir` and counts what it holds.
fn check_bindings(report: &mut Report, state_dir: &Path) {
    const CHECK: &str = "bindings";
    // Beside a running daemon nothing of its store is touched: read it as it is.
    let existing = state_dir.join("bindings").is_dir();
    let opened = if existing {
        Ok(BindingStore::open_to_read(state_dir))
    } else {
        BindingStore::open(state_dir)
    };
    let store = match opened {
        Ok(store) => store,
        Err(err) => {
            report.fail(
                CHECK,
                err,
                "make the state dir writable by this user, or set state_dir in the config",
            );
            return;
        }
    };
    match store.list() {
        Ok(bindings) => {
            report_bindings(report, CHECK, store.dir(), bindings.len(), "conversation");
        }
        Err(err) => report.fail(
            CHECK,
            err,
            "fix the permissions of the bindings directory, or move unreadable files out of it",
        ),
    }
}

/// The CLI backends' bindings (`<state_dir>/cli-bindings`), when there are any: counted and
/// their directory's mode checked, read only (the daemon makes the directory, and moves
/// into it what earlier versions kept among the Copilot runtime's bindings).
fn check_cli_bindings(report: &mut Report, state_dir: &Path) {
    const CHECK: &str = "cli bindings";
    let dir = state_dir.join(copilot_pool::pool::CLI_BINDINGS_DIR);
    let entries = match fs::read_dir(&dir) {
        Ok(entries) => entries,
        Err(err) if err.kind() == std::io::ErrorKind::NotFound => return,
        Err(err) => {
            report.fail(
                CHECK,
                format!("cannot list {}: {err}", dir.display()),
                format!("fix the permissions of {}", dir.display()),
            );
            return;
        }
    };
    let count = entries
        .filter_map(Result::ok)
        .filter(|e| e.path().extension().is_some_and(|x| x == "json"))
        .count();
    report_bindings(report, CHECK, &dir, count, "CLI backend conversation");
}

/// A bindings directory's line: a failure when others may read it (it names sessions),
/// else how many `what`s it binds.
fn report_bindings(report: &mut Report, check: &str, dir: &Path, count: usize, what: &str) {
    let mode = fs::metadata(dir)
        .map(|m| m.permissions().mode() & 0o7777)
        .unwrap_or(0o700);
    if mode & 0o077 != 0 {
        report.fail(
            check,
            format!(
                "{} has mode {mode:04o}; other users can read the bindings",
                dir.display()
            ),
            format!("chmod 700 {}", dir.display()),
        );
    } else {
        report.ok(
            check,
            format!(
                "{count} {what}{} bound in {}",
                if count == 1 { "" } else { "s" },
                dir.display()
            ),
        );
    }
}

/// Fails as `serve` refuses to start: no API token while the workers' sandbox does not keep
/// them off the daemon's ports (`status`: the probe's finding, `None` when it did not run).
fn refuse_unguarded_api(
    report: &mut Report,
    config: &ServeConfig,
    status: Option<&copilot_pool::sandbox::SandboxStatus>,
) {
    if config.api_token.is_none() && !status.is_some_and(|s| s.tcp_connect) {
        report.fail(
            "api token",
            crate::serve::api_unguarded_message(config.sandbox, status),
            "set the token (COPILOT_POOL_API_TOKEN or --api-token-file PATH)",
        );
    }
}

/// What the workers' sandbox enforces on this machine (the wrapper probed as `serve` probes
/// it): a failure only when `sandbox = "required"` and something is missing.
async fn check_sandbox(
    report: &mut Report,
    config: &ServeConfig,
    config_file: Option<&std::path::Path>,
    api_token_file: Option<&std::path::Path>,
    runtime: Option<&std::path::Path>,
) {
    const CHECK: &str = "sandbox";
    let mut own_ports: Vec<u16> = config.listen.tcp_port().into_iter().collect();
    own_ports.extend(config.metrics_listen.map(|a| a.port()));
    let template = match crate::sandbox::template(
        config.sandbox,
        &config.allowed_work_roots,
        &config.sandbox_read_paths,
        &config.sandbox_tcp_ports,
        config.sandbox_tcp_bind.ports(),
        &own_ports,
    ) {
        Ok(Some(template)) => template,
        Ok(None) => {
            report.skip(
                CHECK,
                "sandbox = \"off\": workers run with the daemon's own rights; serve needs an \
                 API token",
            );
            refuse_unguarded_api(report, config, None);
            return;
        }
        Err(e) => {
            report.fail(
                CHECK,
                format!("{e:#}"),
                "run copilot-pool from a readable file",
            );
            return;
        }
    };
    let required = config.sandbox == SandboxMode::Required;
    let probed = crate::sandbox::probe(&template).await;
    // What serve refuses to start with, where it runs its workers sandboxed: its own places
    // where every agent may read.
    if (probed.is_ok() || required)
        && let Err(e) = crate::sandbox::refuse_shared_daemon_places(
            &template,
            runtime,
            config,
            config_file,
            api_token_file,
        )
    {
        report.fail(
            "sandbox places",
            format!("{e:#}"),
            "put it outside that root (the defaults live under $COPILOT_POOL_HOME; the API \
             token belongs in --api-token-file), or take the root out of sandbox_read_paths \
             or allowed_work_roots",
        );
    }
    refuse_unguarded_api(report, config, probed.as_ref().ok());
    match probed {
        Ok(status) if crate::sandbox::unmet_by(&template, &status).is_empty() => {
            report.ok(CHECK, status.summary())
        }
        Ok(status) if required => report.fail(
            CHECK,
            format!("sandbox = \"required\" but {}", status.summary()),
            "run on Linux 6.12+ with Landlock enabled, or set sandbox = \"auto\"",
        ),
        Ok(status) => report.ok(CHECK, format!("best effort: {}", status.summary())),
        Err(e) if required => report.fail(
            CHECK,
            format!("{e:#}"),
            "run on a kernel with Landlock, or set sandbox = \"auto\"",
        ),
        Err(e) => report.ok(
            CHECK,
            format!("no sandbox ({e:#}); serve runs its workers without one"),
        ),
    }
}
