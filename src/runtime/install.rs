//! Installing a pinned flavour from npm into the cache: idempotent, locked, atomic.
//!
//! Layout for one flavour and version (`<dir>` = `<cache>/<flavour>/<version>`):
//!
//! ```text
//! <cache>/<flavour>-<version>.lock        exclusive flock held while checking / installing
//! <cache>/<flavour>/.<version>.tmp-<uuid>/ npm --prefix target while installing
//! <cache>/<flavour>/<version>/             renamed into place once complete
//!     node_modules/...                     the npm packages, layout untouched
//!     .copilot-pool-installed              completion marker, written last before the rename
//! ```
//!
//! A crash leaves at most a `.tmp-` folder, which the next install removes under the lock;
//! a `<version>` folder without the marker or the executable is treated as absent and replaced.
//!
//! The whole install (waiting for the lock, then npm) is bounded by one deadline
//! ([`DEFAULT_INSTALL_TIMEOUT`] unless [`install_with_timeout`] says otherwise). npm runs in its
//! own process group, which is killed (SIGKILL) when the deadline passes or when the install
//! future is dropped.

use std::ffi::OsString;
use std::fs::File;
use std::io;
use std::path::{Path, PathBuf};
use std::process::{ExitStatus, Output, Stdio};
use std::time::Duration;

use nix::errno::Errno;
use nix::fcntl::{Flock, FlockArg};
use tokio::process::Command;
use tokio::time::Instant;

use crate::process::GroupLeader;

use super::flavour::Flavour;
use super::platform::{Platform, PlatformError};

/// Name of the completion marker inside an install directory.
pub const MARKER_FILE: &str = ".copilot-pool-installed";

/// How much of npm's stderr a failure keeps (its end).
const STDERR_TAIL_BYTES: usize = 4096;

/// How long [`install`] may take in all (waiting for the install lock, then running npm)
/// before it gives up with [`InstallError::LockTimeout`] or [`InstallError::Timeout`].
pub const DEFAULT_INSTALL_TIMEOUT: Duration = Duration::from_secs(10 * 60);

/// First and longest pause between two attempts at the install lock.
const LOCK_RETRY_MIN: Duration = Duration::from_millis(50);
const LOCK_RETRY_MAX: Duration = Duration::from_millis(500);

/// How long to wait for npm to be reaped after its process group was sent SIGKILL.
const REAP_AFTER_KILL: Duration = Duration::from_secs(5);

/// A complete managed install.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Installed {
    /// Which flavour this is.
    pub flavour: Flavour,
    /// Its pinned package version.
    pub version: &'static str,
    /// The executable to spawn (inside `dir`, used in place).
    pub executable: PathBuf,
    /// The install directory, `<cache>/<flavour>/<version>`.
    pub dir: PathBuf,
    /// `true` when this call ran npm; `false` when the install was already complete.
    pub fresh: bool,
}

/// Why [`install`] failed.
#[derive(Debug, thiserror::Error)]
pub enum InstallError {
    /// The host is not a supported platform.
    #[error(transparent)]
    Platform(#[from] PlatformError),
    /// `npm` is not on `PATH`.
    #[error(
        "npm was not found on PATH; install Node.js with npm (https://nodejs.org), \
         then run `copilot-pool install-cli` again"
    )]
    NpmMissing,
    /// A filesystem operation failed.
    #[error("could not {action} {}: {error}", path.display())]
    Io {
        /// What was being done, e.g. `create directory`.
        action: &'static str,
        /// The path it was done to.
        path: PathBuf,
        /// The underlying error.
        error: io::Error,
    },
    /// Taking the install lock failed.
    #[error("could not lock {}: {error}", path.display())]
    Lock {
        /// The lock file.
        path: PathBuf,
        /// The `flock` error.
        error: Errno,
    },
    /// The install lock was still held by someone else when the install's deadline passed.
    #[error(
        "gave up waiting for the install lock after {after:?}: another install holds {} \
         (the lock goes with the process that holds it: `fuser -v {}` names it; never delete \
         the file, which would let a second install run beside it); let that install finish \
         and run again, or raise the install timeout if installs take this long here",
        path.display(),
        path.display()
    )]
    LockTimeout {
        /// The lock file.
        path: PathBuf,
        /// The install's overall timeout.
        after: Duration,
    },
    /// npm did not finish before the install's deadline; its process group was killed.
    #[error(
        "`npm install {package}` did not finish within {after:?} and was killed; check network \
         access to the npm registry and npm's proxy settings (`npm config get registry`, \
         `npm config get proxy`, `npm config get https-proxy`), or {instead}"
    )]
    Timeout {
        /// The `<package>@<version>` that was being installed.
        package: String,
        /// The install's overall timeout.
        after: Duration,
        /// What to set instead of installing (e.g. an executable path variable).
        instead: &'static str,
    },
    /// `npm install` exited unsuccessfully (or could not be started).
    #[error("`npm install {package}` failed ({status}); the end of npm's output:\n{output_tail}")]
    NpmFailed {
        /// The `<package>@<version>` that was being installed.
        package: String,
        /// npm's exit status (displays as e.g. `exit status: 1`).
        status: ExitStatus,
        /// The last ~4 KiB of npm's stderr (its stdout when stderr was empty).
        output_tail: String,
    },
    /// npm succeeded but a file the flavour needs is not there.
    #[error(
        "`npm install {package}` succeeded but {} is missing (is the package published for \
         this platform, and are optional dependencies enabled?)",
        path.display()
    )]
    MissingFile {
        /// The `<package>@<version>` that was installed.
        package: String,
        /// The expected file.
        path: PathBuf,
    },
}

/// Installs `flavour` at its pinned version into `cache_dir` (see [`cache_dir`](super::cache_dir)),
/// unless a complete install is already there, and returns where its executable is.
///
/// Safe to call concurrently from several tasks, threads or processes: all of them wait on
/// `<cache_dir>/<flavour>-<version>.lock`, and only the first one runs npm.
///
/// Gives up after [`DEFAULT_INSTALL_TIMEOUT`]; see [`install_with_timeout`].
pub async fn install(flavour: Flavour, cache_dir: &Path) -> Result<Installed, InstallError> {
    install_with_timeout(flavour, cache_dir, DEFAULT_INSTALL_TIMEOUT).await
}

/// [`install`], giving up once `timeout` has passed since the call: with
/// [`InstallError::LockTimeout`] while still waiting for the install lock, or with
/// [`InstallError::Timeout`] (after killing npm's process group) while npm runs.
///
/// Dropping the returned future kills npm's process group too.
pub async fn install_with_timeout(
    flavour: Flavour,
    cache_dir: &Path,
    timeout: Duration,
) -> Result<Installed, InstallError> {
    let platform = Platform::current()?;
    install_with(flavour, platform, cache_dir, timeout, || {
        super::find_on_path("npm", super::process_env("PATH")).map(NpmCommand::program)
    })
    .await
}

/// How to start npm: a program and arguments placed before `install ...`.
#[derive(Debug, Clone)]
struct NpmCommand {
    program: PathBuf,
    pre_args: Vec<OsString>,
}

impl NpmCommand {
    fn program(program: PathBuf) -> Self {
        NpmCommand {
            program,
            pre_args: Vec::new(),
        }
    }
}

/// [`install_with_timeout`] for a given platform, with the npm lookup injected (tests use a
/// fake npm).
async fn install_with(
    flavour: Flavour,
    platform: Platform,
    cache_dir: &Path,
    timeout: Duration,
    find_npm: impl FnOnce() -> Option<NpmCommand>,
) -> Result<Installed, InstallError> {
    let package = flavour.npm_package(platform);
    let done = install_package_with(&package, cache_dir, timeout, find_npm).await?;
    Ok(Installed {
        flavour,
        version: flavour.version(),
        executable: done.executable,
        dir: done.dir,
        fresh: done.fresh,
    })
}

/// One pinned npm package installed into the cache: what [`install_package`] needs to know.
/// The Copilot flavours and the agent CLIs of [`super::AgentCli`] both describe themselves
/// this way, so they share one installer (lock, deadline, atomic rename, marker).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct NpmPackage {
    /// The cache subfolder (`runtime`, `cli`, `claude-code`, ...).
    pub(crate) slot: &'static str,
    /// The pinned version.
    pub(crate) version: &'static str,
    /// The npm package name.
    pub(crate) name: String,
    /// The executable, relative to the install directory.
    pub(crate) executable: PathBuf,
    /// Other files that must exist, relative to the install directory.
    pub(crate) companions: Vec<PathBuf>,
    /// What npm does with optional dependencies.
    pub(crate) optional: OptionalDeps,
    /// What the user can set instead of installing (named in the timeout error).
    pub(crate) override_hint: &'static str,
}

/// What `npm install` does with a package's optional dependencies.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum OptionalDeps {
    /// As the user's npm config says (npm's default installs them).
    AsConfigured,
    /// `--include=optional`: the executable comes from an optional platform dependency, which
    /// a user config with `omit=optional` would otherwise silently drop.
    Include,
    /// `--omit=optional`: they are not needed (the Node SDK's bundled runtime: the pool names
    /// the runtime by path).
    Omit,
}

impl NpmPackage {
    /// `<name>@<version>`.
    fn spec(&self) -> String {
        format!("{}@{}", self.name, self.version)
    }

    /// `<cache_dir>/<slot>/<version>`.
    pub(crate) fn install_dir(&self, cache_dir: &Path) -> PathBuf {
        cache_dir.join(self.slot).join(self.version)
    }

    /// `<cache_dir>/<slot>-<version>.lock`: serialises installs of this package.
    pub(crate) fn lock_path(&self, cache_dir: &Path) -> PathBuf {
        cache_dir.join(format!("{}-{}.lock", self.slot, self.version))
    }

    /// Whether `dir` holds a complete install: the marker, the executable and its companions.
    pub(crate) fn is_complete(&self, dir: &Path) -> bool {
        dir.join(MARKER_FILE).is_file()
            && dir.join(&self.executable).is_file()
            && self.companions.iter().all(|rel| dir.join(rel).is_file())
    }
}

/// Where a finished [`install_package`] put things.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct PackageInstall {
    /// The executable to spawn.
    pub(crate) executable: PathBuf,
    /// The install directory.
    pub(crate) dir: PathBuf,
    /// Whether npm ran.
    pub(crate) fresh: bool,
}

/// Installs `package` into `cache_dir` with the `npm` on `PATH`, unless it is complete there.
pub(crate) async fn install_package(
    package: &NpmPackage,
    cache_dir: &Path,
    timeout: Duration,
) -> Result<PackageInstall, InstallError> {
    install_package_with(package, cache_dir, timeout, || {
        super::find_on_path("npm", super::process_env("PATH")).map(NpmCommand::program)
    })
    .await
}

/// [`install_package`] with the npm lookup injected.
async fn install_package_with(
    package: &NpmPackage,
    cache_dir: &Path,
    timeout: Duration,
    find_npm: impl FnOnce() -> Option<NpmCommand>,
) -> Result<PackageInstall, InstallError> {
    let deadline = crate::deadline::from_now(timeout);
    create_dir_all(cache_dir).await?;
    let lock_path = package.lock_path(cache_dir);
    if let Some(parent) = lock_path.parent() {
        // A slot may be nested (`tools/node-sdk`): its lock sits in `tools/`.
        create_dir_all(parent).await?;
    }
    tracing::debug!(lock = %lock_path.display(), "waiting for the install lock");
    let _lock = lock_exclusive(lock_path, deadline, timeout).await?;

    let dir = package.install_dir(cache_dir);
    let installed = |fresh| PackageInstall {
        executable: dir.join(&package.executable),
        dir: dir.clone(),
        fresh,
    };
    if package.is_complete(&dir) {
        tracing::debug!(dir = %dir.display(), "already installed");
        return Ok(installed(false));
    }

    let npm = find_npm().ok_or(InstallError::NpmMissing)?;
    let parent = dir.parent().unwrap_or(cache_dir).to_path_buf();
    create_dir_all(&parent).await?;
    let tmp_prefix = format!(".{}.tmp-", package.version);
    remove_stale_tmp_dirs(&parent, &tmp_prefix).await;
    let tmp = parent.join(format!("{tmp_prefix}{}", uuid::Uuid::new_v4().simple()));
    create_dir_all(&tmp).await?;

    let result = populate(package, &npm, &tmp, deadline, timeout).await;
    // A complete install found in place now is kept, never replaced: one that is there is
    // in use (the lock keeps two installs apart, unless its file was deleted meanwhile).
    if result.is_ok() && package.is_complete(&dir) {
        let _ = tokio::fs::remove_dir_all(&tmp).await;
        return Ok(installed(false));
    }
    let result = match result {
        Ok(()) => move_into_place(&tmp, &dir).await,
        Err(err) => Err(err),
    };
    if let Err(err) = result {
        // Best effort: the next install removes leftovers under the lock anyway.
        let _ = tokio::fs::remove_dir_all(&tmp).await;
        return Err(err);
    }
    tracing::debug!(dir = %dir.display(), "installed");
    Ok(installed(true))
}

/// Whether `dir` holds a complete install of `flavour`: the marker, the executable and its
/// companion files are all there. Used by [`locate`](super::locate) too.
pub(crate) fn is_complete(flavour: Flavour, platform: Platform, dir: &Path) -> bool {
    flavour.npm_package(platform).is_complete(dir)
}

/// Runs npm into `tmp` (killing it at `deadline`), checks the result, makes the executable
/// executable, writes the marker.
async fn populate(
    package: &NpmPackage,
    npm: &NpmCommand,
    tmp: &Path,
    deadline: Instant,
    timeout: Duration,
) -> Result<(), InstallError> {
    let spec = package.spec();
    let run = NpmRun {
        prefix: tmp,
        spec: &spec,
        optional: package.optional,
        override_hint: package.override_hint,
        deadline,
        timeout,
    };
    run_npm(npm, run).await?;

    let executable = tmp.join(&package.executable);
    let required = std::iter::once(executable.clone())
        .chain(package.companions.iter().map(|rel| tmp.join(rel)));
    for path in required {
        let is_file = tokio::fs::metadata(&path)
            .await
            .map(|meta| meta.is_file())
            .unwrap_or(false);
        if !is_file {
            return Err(InstallError::MissingFile {
                package: spec,
                path,
            });
        }
    }
    make_executable(&executable).await?;

    let marker = serde_json::json!({
        "slot": package.slot,
        "version": package.version,
        "package": spec,
        "executable": package.executable,
    });
    let marker_path = tmp.join(MARKER_FILE);
    tokio::fs::write(&marker_path, format!("{marker}\n"))
        .await
        .map_err(io_err("write", &marker_path))
}

/// One `npm install` to run.
struct NpmRun<'a> {
    /// The `--prefix` folder (also the working directory).
    prefix: &'a Path,
    /// The `<package>@<version>` to install.
    spec: &'a str,
    /// What npm does with optional dependencies.
    optional: OptionalDeps,
    /// What the user can set instead (for the timeout error).
    override_hint: &'static str,
    /// When to kill npm.
    deadline: Instant,
    /// The install's overall timeout, for the error message.
    timeout: Duration,
}

/// Runs `npm install` in its own process group, draining its output, and kills the whole group
/// at the deadline (or when this future is dropped).
async fn run_npm(npm: &NpmCommand, run: NpmRun<'_>) -> Result<(), InstallError> {
    let timed_out = || InstallError::Timeout {
        package: run.spec.to_owned(),
        after: run.timeout,
        instead: run.override_hint,
    };
    if Instant::now() >= run.deadline {
        return Err(timed_out());
    }
    let mut command = Command::new(&npm.program);
    command
        .args(&npm.pre_args)
        .args([
            "install",
            "--no-save",
            "--no-audit",
            "--no-fund",
            "--ignore-scripts",
            "--no-package-lock",
        ])
        .arg("--prefix")
        .arg(run.prefix);
    match run.optional {
        OptionalDeps::AsConfigured => {}
        OptionalDeps::Include => {
            command.arg("--include=optional");
        }
        OptionalDeps::Omit => {
            command.arg("--omit=optional");
        }
    }
    command
        .arg(run.spec)
        .current_dir(run.prefix)
        .env("npm_config_update_notifier", "false")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    tracing::debug!(?command, "running npm");
    // Its own group, so that a kill reaches the processes npm starts too.
    let npm_process = GroupLeader::spawn(command).map_err(|error| {
        if error.kind() == io::ErrorKind::NotFound {
            InstallError::NpmMissing
        } else {
            InstallError::Io {
                action: "start npm",
                path: npm.program.clone(),
                error,
            }
        }
    })?;
    let finished = npm_process
        .output_until(run.deadline, REAP_AFTER_KILL)
        .await;
    let Ok(output) = finished else {
        tracing::warn!(
            package = run.spec,
            timeout = ?run.timeout,
            "npm install timed out; its process group was killed"
        );
        return Err(timed_out());
    };
    let Output {
        status,
        stdout,
        stderr,
    } = output.map_err(io_err("wait for npm", &npm.program))?;
    if status.success() {
        return Ok(());
    }
    let source = if stderr.iter().all(u8::is_ascii_whitespace) {
        &stdout
    } else {
        &stderr
    };
    Err(InstallError::NpmFailed {
        package: run.spec.to_owned(),
        status,
        output_tail: tail(source, STDERR_TAIL_BYTES),
    })
}

/// The last `max` bytes of `bytes` as text (lossy), trimmed.
fn tail(bytes: &[u8], max: usize) -> String {
    let start = bytes.len().saturating_sub(max);
    String::from_utf8_lossy(&bytes[start..]).trim().to_owned()
}

/// Replaces `dir` (absent, or an incomplete leftover) with the finished `tmp` in one rename.
async fn move_into_place(tmp: &Path, dir: &Path) -> Result<(), InstallError> {
    if tokio::fs::symlink_metadata(dir).await.is_ok() {
        tracing::debug!(dir = %dir.display(), "removing an incomplete install");
        tokio::fs::remove_dir_all(dir)
            .await
            .map_err(io_err("remove incomplete install", dir))?;
    }
    // Everything npm wrote reaches the disk before the rename makes it look complete: after
    // a power cut a renamed folder with an empty executable would pass `is_complete`, and
    // every spawn would fail until someone wiped the cache.
    let synced = tmp.to_path_buf();
    tokio::task::spawn_blocking(move || {
        let folder = std::fs::File::open(&synced)?;
        nix::unistd::syncfs(&folder).map_err(std::io::Error::from)
    })
    .await
    .map_err(|e| std::io::Error::other(e.to_string()))
    .and_then(|synced| synced)
    .map_err(io_err("sync the finished install in", tmp))?;
    tokio::fs::rename(tmp, dir)
        .await
        .map_err(io_err("move the finished install into place at", dir))?;
    if let Some(parent) = dir.parent() {
        let parent = parent.to_path_buf();
        let _ = tokio::task::spawn_blocking(move || {
            std::fs::File::open(&parent).and_then(|folder| folder.sync_all())
        })
        .await;
    }
    Ok(())
}

/// Removes `<parent>/<prefix>*` folders left by crashed installs (call with the lock held).
async fn remove_stale_tmp_dirs(parent: &Path, prefix: &str) {
    let Ok(mut entries) = tokio::fs::read_dir(parent).await else {
        return;
    };
    while let Ok(Some(entry)) = entries.next_entry().await {
        if entry.file_name().to_string_lossy().starts_with(prefix) {
            tracing::debug!(path = %entry.path().display(), "removing a stale install folder");
            let _ = tokio::fs::remove_dir_all(entry.path()).await;
        }
    }
}

async fn make_executable(path: &Path) -> Result<(), InstallError> {
    use std::os::unix::fs::PermissionsExt;
    let meta = tokio::fs::metadata(path)
        .await
        .map_err(io_err("read metadata of", path))?;
    let mut permissions = meta.permissions();
    let mode = permissions.mode();
    if mode & 0o111 != 0o111 {
        permissions.set_mode(mode | 0o111);
        tokio::fs::set_permissions(path, permissions)
            .await
            .map_err(io_err("make executable", path))?;
    }
    Ok(())
}

async fn create_dir_all(path: &Path) -> Result<(), InstallError> {
    tokio::fs::create_dir_all(path)
        .await
        .map_err(io_err("create directory", path))
}

/// Opens (creating) `path` and takes an exclusive `flock` on it, giving up at `deadline` with
/// [`InstallError::LockTimeout`]. The lock is released when the returned guard is dropped (or
/// the process dies).
///
/// flock(2) offers no event to wait for, and a blocking flock cannot be bounded or cancelled
/// (it would pin a pool thread until the holder lets go), so this retries a non-blocking
/// attempt with a short backoff (50 ms, doubling up to 500 ms) until the deadline.
pub async fn lock_exclusive(
    path: PathBuf,
    deadline: Instant,
    timeout: Duration,
) -> Result<Flock<File>, InstallError> {
    let mut file = tokio::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&path)
        .await
        .map_err(io_err("open lock file", &path))?
        .into_std()
        .await;
    let mut backoff = LOCK_RETRY_MIN;
    loop {
        match Flock::lock(file, FlockArg::LockExclusiveNonblock) {
            Ok(guard) => return Ok(guard),
            Err((returned, Errno::EINTR)) => file = returned,
            Err((returned, Errno::EWOULDBLOCK)) => {
                file = returned;
                let now = Instant::now();
                if now >= deadline {
                    return Err(InstallError::LockTimeout {
                        path,
                        after: timeout,
                    });
                }
                tokio::time::sleep_until((now + backoff).min(deadline)).await;
                backoff = (backoff * 2).min(LOCK_RETRY_MAX);
            }
            Err((_, error)) => return Err(InstallError::Lock { path, error }),
        }
    }
}

fn io_err(action: &'static str, path: &Path) -> impl FnOnce(io::Error) -> InstallError + use<> {
    let path = path.to_path_buf();
    move |error| InstallError::Io {
        action,
        path,
        error,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A fake npm (a shell script run by /bin/sh, so no exec of a freshly written file) that
    /// records each run in `<dir>/runs` and creates the flavour's files under `--prefix`,
    /// or fails with `fail_status` after printing a lot to stderr.
    fn fake_npm(dir: &Path, flavour: Flavour, platform: Platform, fail: Option<u8>) -> NpmCommand {
        let files: Vec<String> = std::iter::once(flavour.executable_rel_path(platform))
            .chain(flavour.companion_rel_paths(platform))
            .map(|p| p.display().to_string())
            .collect();
        let runs = dir.join("runs");
        let mut script = String::from("prefix=\nwhile [ $# -gt 0 ]; do\n");
        script += "  if [ \"$1\" = --prefix ]; then prefix=$2; shift; fi\n  shift\ndone\n";
        script += &format!("echo run >> '{}'\n", runs.display());
        script += "sleep 0.2\n";
        match fail {
            Some(code) => {
                script +=
                    "i=0; while [ $i -lt 300 ]; do echo \"noise line $i\" >&2; i=$((i+1)); done\n";
                script += "echo 'npm error 404 Not Found - final line' >&2\n";
                script += &format!("exit {code}\n");
            }
            None => {
                for file in &files {
                    script += &format!(
                        "mkdir -p \"$prefix/$(dirname '{file}')\" && echo x > \"$prefix/{file}\"\n"
                    );
                }
            }
        }
        sh_npm(dir, &script)
    }

    /// An npm that runs `script` with /bin/sh (written to `<dir>/fake-npm.sh`).
    fn sh_npm(dir: &Path, script: &str) -> NpmCommand {
        let script_path = dir.join("fake-npm.sh");
        std::fs::write(&script_path, script).unwrap();
        NpmCommand {
            program: PathBuf::from("/bin/sh"),
            pre_args: vec![script_path.into_os_string()],
        }
    }

    /// A fake npm that writes its pid (= its process group id) to `<dir>/pid`, then hangs in
    /// a background and a foreground child that both ignore SIGTERM.
    fn hanging_npm(dir: &Path) -> NpmCommand {
        let pid_file = dir.join("pid");
        let script = format!(
            "trap '' TERM\nsleep 1000 &\necho $$ > '{0}.tmp' && mv '{0}.tmp' '{0}'\n\
             sleep 1000\nwait\n",
            pid_file.display()
        );
        sh_npm(dir, &script)
    }

    /// Waits (up to 5 s) for `<dir>/pid` written by [`hanging_npm`].
    async fn read_pid(dir: &Path) -> i32 {
        let path = dir.join("pid");
        for _ in 0..100 {
            if let Ok(text) = std::fs::read_to_string(&path) {
                return text.trim().parse().unwrap();
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        panic!("the fake npm never wrote {}", path.display());
    }

    /// The live (not zombie) processes whose process group id is `group`, from /proc.
    fn group_members(group: i32) -> Vec<String> {
        let mut members = Vec::new();
        for entry in std::fs::read_dir("/proc").unwrap().filter_map(|e| e.ok()) {
            let Ok(stat) = std::fs::read_to_string(entry.path().join("stat")) else {
                continue;
            };
            // `pid (comm) state ppid pgrp ...`; comm may contain spaces and parentheses.
            let Some((_, rest)) = stat.rsplit_once(')') else {
                continue;
            };
            let fields: Vec<&str> = rest.split_whitespace().collect();
            if fields.len() > 2 && fields[2] == group.to_string() && fields[0] != "Z" {
                members.push(stat);
            }
        }
        members
    }

    /// Asserts that the process group `group` has no live member within 5 s (SIGKILL is
    /// delivered asynchronously; orphaned grandchildren are left as zombies for init).
    async fn assert_group_gone(group: i32) {
        for _ in 0..100 {
            if group_members(group).is_empty() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        panic!(
            "process group {group} still has members: {:?}",
            group_members(group)
        );
    }

    fn runs(dir: &Path) -> usize {
        std::fs::read_to_string(dir.join("runs"))
            .map(|s| s.lines().count())
            .unwrap_or(0)
    }

    const P: Platform = Platform::LinuxX64;

    /// The runtime installed into `cache` by `npm`, within the default timeout.
    async fn install_runtime(cache: &Path, npm: &NpmCommand) -> Installed {
        install_with(Flavour::Runtime, P, cache, DEFAULT_INSTALL_TIMEOUT, || {
            Some(npm.clone())
        })
        .await
        .unwrap()
    }

    #[tokio::test]
    async fn an_install_that_finds_a_complete_one_in_place_when_it_ends_keeps_that_one() {
        let tools = tempfile::tempdir().unwrap();
        let cache = tempfile::tempdir().unwrap();
        let dir = cache.path().join("runtime/1.0.14");
        // A second installer beside this one (its lock file deleted meanwhile) finishes
        // first, while this one's npm runs: its install is complete and in use.
        let package = Flavour::Runtime.npm_package(P);
        let mut script = String::from("prefix=\nwhile [ $# -gt 0 ]; do\n");
        script += "  if [ \"$1\" = --prefix ]; then prefix=$2; shift; fi\n  shift\ndone\n";
        for file in std::iter::once(&package.executable).chain(&package.companions) {
            for root in ["$prefix", &dir.display().to_string()] {
                script += &format!(
                    "mkdir -p \"{root}/$(dirname '{f}')\" && echo x > \"{root}/{f}\"\n",
                    f = file.display()
                );
            }
        }
        script += &format!("echo other > '{}'\n", dir.join(MARKER_FILE).display());
        let npm = sh_npm(tools.path(), &script);
        let installed = install_runtime(cache.path(), &npm).await;
        assert!(!installed.fresh);
        assert_eq!(installed.dir, dir);
        assert_eq!(
            std::fs::read_to_string(dir.join(MARKER_FILE)).unwrap(),
            "other\n",
            "the complete install in place was replaced"
        );
        let left: Vec<_> = std::fs::read_dir(cache.path().join("runtime"))
            .unwrap()
            .filter_map(|e| e.ok())
            .map(|e| e.file_name())
            .collect();
        assert_eq!(left, vec![OsString::from("1.0.14")], "its own folder goes");
    }

    #[tokio::test]
    async fn installs_once_then_reuses_the_marked_install() {
        let tools = tempfile::tempdir().unwrap();
        let cache = tempfile::tempdir().unwrap();
        let npm = fake_npm(tools.path(), Flavour::Runtime, P, None);

        let first = install_runtime(cache.path(), &npm).await;
        assert!(first.fresh);
        assert_eq!(first.version, "1.0.14");
        assert_eq!(first.dir, cache.path().join("runtime/1.0.14"));
        assert!(first.executable.is_file());
        assert!(super::super::is_executable_file(&first.executable));
        assert!(first.dir.join(MARKER_FILE).is_file());
        assert!(cache.path().join("runtime-1.0.14.lock").is_file());

        // Second call: no npm at all is needed.
        let second = install_with(
            Flavour::Runtime,
            P,
            cache.path(),
            DEFAULT_INSTALL_TIMEOUT,
            || None,
        )
        .await
        .unwrap();
        assert!(!second.fresh);
        assert_eq!(second.executable, first.executable);
        assert_eq!(runs(tools.path()), 1);
        // No temporary folders are left behind.
        let leftovers: Vec<_> = std::fs::read_dir(cache.path().join("runtime"))
            .unwrap()
            .filter_map(|e| e.ok())
            .map(|e| e.file_name())
            .collect();
        assert_eq!(leftovers, vec![OsString::from("1.0.14")]);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn concurrent_installs_run_npm_once() {
        let tools = tempfile::tempdir().unwrap();
        let cache = tempfile::tempdir().unwrap();
        let npm = fake_npm(tools.path(), Flavour::Cli, P, None);
        let tasks: Vec<_> = (0..4)
            .map(|_| {
                let npm = npm.clone();
                let cache = cache.path().to_path_buf();
                tokio::spawn(async move {
                    install_with(Flavour::Cli, P, &cache, DEFAULT_INSTALL_TIMEOUT, || {
                        Some(npm)
                    })
                    .await
                })
            })
            .collect();
        let mut fresh = 0;
        for task in tasks {
            let installed = task.await.unwrap().unwrap();
            assert!(
                installed
                    .executable
                    .ends_with("@github/copilot-linux-x64/copilot")
            );
            fresh += usize::from(installed.fresh);
        }
        assert_eq!(fresh, 1);
        assert_eq!(runs(tools.path()), 1);
    }

    #[tokio::test]
    async fn incomplete_folders_are_replaced_and_stale_temps_removed() {
        let tools = tempfile::tempdir().unwrap();
        let cache = tempfile::tempdir().unwrap();
        let dir = Flavour::Runtime.install_dir(cache.path());
        // A folder with the executable but no marker (and no runtime.node) is not complete.
        let exe = dir.join(Flavour::Runtime.executable_rel_path(P));
        std::fs::create_dir_all(exe.parent().unwrap()).unwrap();
        std::fs::write(&exe, "half").unwrap();
        let stale = cache.path().join("runtime/.1.0.14.tmp-deadbeef");
        std::fs::create_dir_all(stale.join("node_modules")).unwrap();
        assert!(!is_complete(Flavour::Runtime, P, &dir));

        let npm = fake_npm(tools.path(), Flavour::Runtime, P, None);
        let installed = install_with(
            Flavour::Runtime,
            P,
            cache.path(),
            DEFAULT_INSTALL_TIMEOUT,
            || Some(npm),
        )
        .await
        .unwrap();
        assert!(installed.fresh);
        assert!(is_complete(Flavour::Runtime, P, &dir));
        assert_eq!(std::fs::read_to_string(&exe).unwrap().trim(), "x");
        assert!(!stale.exists());

        // A marker without runtime.node is not complete either.
        std::fs::remove_file(exe.with_file_name("runtime.node")).unwrap();
        assert!(!is_complete(Flavour::Runtime, P, &dir));
    }

    #[tokio::test]
    async fn missing_npm_is_a_typed_error() {
        let cache = tempfile::tempdir().unwrap();
        let err = install_with(
            Flavour::Runtime,
            P,
            cache.path(),
            DEFAULT_INSTALL_TIMEOUT,
            || None,
        )
        .await
        .unwrap_err();
        assert!(matches!(err, InstallError::NpmMissing), "{err:?}");
        assert!(
            err.to_string().contains("install Node.js with npm"),
            "{err}"
        );
        // A program that does not exist is reported the same way.
        let err = install_with(
            Flavour::Runtime,
            P,
            cache.path(),
            DEFAULT_INSTALL_TIMEOUT,
            || Some(NpmCommand::program(cache.path().join("no-such-npm"))),
        )
        .await
        .unwrap_err();
        assert!(matches!(err, InstallError::NpmMissing), "{err:?}");
    }

    #[tokio::test]
    async fn npm_failure_reports_status_and_stderr_tail() {
        let tools = tempfile::tempdir().unwrap();
        let cache = tempfile::tempdir().unwrap();
        let npm = fake_npm(tools.path(), Flavour::Runtime, P, Some(7));
        let err = install_with(
            Flavour::Runtime,
            P,
            cache.path(),
            DEFAULT_INSTALL_TIMEOUT,
            || Some(npm),
        )
        .await
        .unwrap_err();
        let InstallError::NpmFailed {
            package,
            status,
            output_tail,
        } = &err
        else {
            panic!("expected NpmFailed, got {err:?}");
        };
        assert_eq!(package, "@github/copilot-sdk-linux-x64@1.0.14");
        assert_eq!(status.code(), Some(7), "{status}");
        assert!(output_tail.ends_with("final line"), "{output_tail}");
        assert!(output_tail.len() <= STDERR_TAIL_BYTES);
        assert!(!output_tail.contains("noise line 0\n"));
        assert!(err.to_string().contains("final line"));
        // Nothing that looks installed, and no temporary folder left.
        let dir = Flavour::Runtime.install_dir(cache.path());
        assert!(!dir.exists());
        let entries = std::fs::read_dir(cache.path().join("runtime"))
            .unwrap()
            .count();
        assert_eq!(entries, 0);
    }

    #[tokio::test]
    async fn npm_success_without_the_executable_is_reported() {
        let tools = tempfile::tempdir().unwrap();
        let cache = tempfile::tempdir().unwrap();
        // A fake npm that installs the Cli files is wrong for the Runtime flavour.
        let npm = fake_npm(tools.path(), Flavour::Cli, P, None);
        let err = install_with(
            Flavour::Runtime,
            P,
            cache.path(),
            DEFAULT_INSTALL_TIMEOUT,
            || Some(npm),
        )
        .await
        .unwrap_err();
        assert!(matches!(err, InstallError::MissingFile { .. }), "{err:?}");
        assert!(err.to_string().contains("copilot-runtime"), "{err}");
    }

    #[tokio::test]
    async fn npm_past_the_deadline_is_killed_with_its_whole_group() {
        let tools = tempfile::tempdir().unwrap();
        let cache = tempfile::tempdir().unwrap();
        let npm = hanging_npm(tools.path());
        let timeout = Duration::from_secs(1);
        let started = std::time::Instant::now();
        let err = install_with(Flavour::Runtime, P, cache.path(), timeout, || Some(npm))
            .await
            .unwrap_err();
        let elapsed = started.elapsed();
        let InstallError::Timeout { package, after, .. } = &err else {
            panic!("expected Timeout, got {err:?}");
        };
        assert_eq!(package, "@github/copilot-sdk-linux-x64@1.0.14");
        assert_eq!(*after, timeout);
        assert!(elapsed >= timeout, "{elapsed:?}");
        assert!(elapsed < Duration::from_secs(4), "{elapsed:?}");
        let message = err.to_string();
        assert!(message.contains("did not finish within 1s"), "{message}");
        assert!(
            message.contains("network access to the npm registry"),
            "{message}"
        );
        assert!(message.contains("proxy"), "{message}");
        assert!(message.contains("COPILOT_CLI_PATH"), "{message}");

        let pid = read_pid(tools.path()).await;
        assert_group_gone(pid).await;
        // Nothing that looks installed, and no temporary folder left.
        assert!(!Flavour::Runtime.install_dir(cache.path()).exists());
        let entries = std::fs::read_dir(cache.path().join("runtime"))
            .unwrap()
            .count();
        assert_eq!(entries, 0);
        // The lock was released: the next install gets it at once.
        let fresh = fake_npm(tools.path(), Flavour::Runtime, P, None);
        let installed = install_with(
            Flavour::Runtime,
            P,
            cache.path(),
            Duration::from_secs(30),
            || Some(fresh),
        )
        .await
        .unwrap();
        assert!(installed.fresh);
    }

    #[tokio::test]
    async fn dropping_the_install_kills_npm_and_its_group() {
        let tools = tempfile::tempdir().unwrap();
        let cache = tempfile::tempdir().unwrap();
        let npm = hanging_npm(tools.path());
        let install = install_with(
            Flavour::Runtime,
            P,
            cache.path(),
            DEFAULT_INSTALL_TIMEOUT,
            || Some(npm),
        );
        let pid = tokio::select! {
            result = install => panic!("the install finished: {result:?}"),
            pid = read_pid(tools.path()) => pid,
        };
        // `select!` has dropped the install future.
        assert_group_gone(pid).await;
    }

    #[tokio::test]
    async fn a_held_lock_times_out_with_its_path() {
        let cache = tempfile::tempdir().unwrap();
        let lock_path = Flavour::Runtime.npm_package(P).lock_path(cache.path());
        let _held = Flock::lock(File::create(&lock_path).unwrap(), FlockArg::LockExclusive)
            .map_err(|(_, errno)| errno)
            .unwrap();
        let timeout = Duration::from_millis(300);
        let started = std::time::Instant::now();
        let err = install_with(Flavour::Runtime, P, cache.path(), timeout, || {
            panic!("npm must not be looked up without the lock")
        })
        .await
        .unwrap_err();
        let elapsed = started.elapsed();
        let InstallError::LockTimeout { path, after } = &err else {
            panic!("expected LockTimeout, got {err:?}");
        };
        assert_eq!(path, &lock_path);
        assert_eq!(*after, timeout);
        assert!(elapsed >= timeout, "{elapsed:?}");
        assert!(elapsed < Duration::from_secs(3), "{elapsed:?}");
        let message = err.to_string();
        assert!(
            message.contains(&format!("another install holds {}", lock_path.display())),
            "{message}"
        );
        assert!(
            message.contains("fuser -v") && message.contains("never delete the file"),
            "{message}"
        );
    }

    #[tokio::test]
    async fn a_lock_released_before_the_deadline_is_taken() {
        let tools = tempfile::tempdir().unwrap();
        let cache = tempfile::tempdir().unwrap();
        let lock_path = Flavour::Runtime.npm_package(P).lock_path(cache.path());
        let held = Flock::lock(File::create(&lock_path).unwrap(), FlockArg::LockExclusive)
            .map_err(|(_, errno)| errno)
            .unwrap();
        let release = tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(300)).await;
            drop(held);
        });
        let npm = fake_npm(tools.path(), Flavour::Runtime, P, None);
        let installed = install_with(
            Flavour::Runtime,
            P,
            cache.path(),
            Duration::from_secs(30),
            || Some(npm),
        )
        .await
        .unwrap();
        assert!(installed.fresh);
        release.await.unwrap();
    }

    #[test]
    fn tail_keeps_the_end() {
        assert_eq!(tail(b"  abc  ", 10), "abc");
        assert_eq!(tail(b"0123456789", 4), "6789");
    }

    /// Really installs the Runtime flavour from the npm registry (about 40 MB compressed),
    /// twice concurrently and once more, into a private cache. npm on PATH (and access to the
    /// npm registry) is a requirement of the test suite: this fails without it.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn real_npm_install_is_idempotent_and_locked() {
        let Ok(platform) = Platform::current() else {
            return;
        };
        assert!(
            super::super::find_on_path("npm", std::env::var_os("PATH")).is_some(),
            "npm is not on PATH; the test suite needs Node.js with npm (https://nodejs.org) \
             and access to the npm registry"
        );
        let cache = tempfile::tempdir().unwrap();
        let (a, b) = tokio::join!(
            tokio::spawn({
                let cache = cache.path().to_path_buf();
                async move { install(Flavour::Runtime, &cache).await }
            }),
            tokio::spawn({
                let cache = cache.path().to_path_buf();
                async move { install(Flavour::Runtime, &cache).await }
            }),
        );
        let (a, b) = (a.unwrap().unwrap(), b.unwrap().unwrap());
        assert_eq!(
            usize::from(a.fresh) + usize::from(b.fresh),
            1,
            "{a:?} {b:?}"
        );
        assert_eq!(a.executable, b.executable);
        assert!(super::super::is_executable_file(&a.executable));
        assert!(a.executable.with_file_name("runtime.node").is_file());
        assert!(is_complete(Flavour::Runtime, platform, &a.dir));

        let again = install(Flavour::Runtime, cache.path()).await.unwrap();
        assert!(!again.fresh);
        assert_eq!(again.executable, a.executable);
    }
}
