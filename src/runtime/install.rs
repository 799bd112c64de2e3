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

use std::ffi::OsString;
use std::fs::{File, OpenOptions};
use std::io;
use std::path::{Path, PathBuf};
use std::process::{ExitStatus, Stdio};

use nix::errno::Errno;
use nix::fcntl::{Flock, FlockArg};
use tokio::process::Command;

use super::flavour::Flavour;
use super::platform::{Platform, PlatformError};

/// Name of the completion marker inside an install directory.
pub const MARKER_FILE: &str = ".copilot-pool-installed";

/// How much of npm's stderr a failure keeps (its end).
const STDERR_TAIL_BYTES: usize = 4096;

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
pub async fn install(flavour: Flavour, cache_dir: &Path) -> Result<Installed, InstallError> {
    let platform = Platform::current()?;
    install_with(flavour, platform, cache_dir, || {
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

/// [`install`] for a given platform, with the npm lookup injected (tests use a fake npm).
async fn install_with(
    flavour: Flavour,
    platform: Platform,
    cache_dir: &Path,
    find_npm: impl FnOnce() -> Option<NpmCommand>,
) -> Result<Installed, InstallError> {
    create_dir_all(cache_dir).await?;
    let lock_path = flavour.lock_path(cache_dir);
    tracing::debug!(lock = %lock_path.display(), "waiting for the runtime install lock");
    let _lock = lock_exclusive(lock_path).await?;

    let dir = flavour.install_dir(cache_dir);
    let installed = |fresh| Installed {
        flavour,
        version: flavour.version(),
        executable: dir.join(flavour.executable_rel_path(platform)),
        dir: dir.clone(),
        fresh,
    };
    if is_complete(flavour, platform, &dir) {
        tracing::debug!(dir = %dir.display(), "runtime already installed");
        return Ok(installed(false));
    }

    let npm = find_npm().ok_or(InstallError::NpmMissing)?;
    let parent = dir.parent().unwrap_or(cache_dir).to_path_buf();
    create_dir_all(&parent).await?;
    let tmp_prefix = format!(".{}.tmp-", flavour.version());
    remove_stale_tmp_dirs(&parent, &tmp_prefix).await;
    let tmp = parent.join(format!("{tmp_prefix}{}", uuid::Uuid::new_v4().simple()));
    create_dir_all(&tmp).await?;

    let result = populate(flavour, platform, &npm, &tmp).await;
    let result = match result {
        Ok(()) => move_into_place(&tmp, &dir).await,
        Err(err) => Err(err),
    };
    if let Err(err) = result {
        // Best effort: the next install removes leftovers under the lock anyway.
        let _ = tokio::fs::remove_dir_all(&tmp).await;
        return Err(err);
    }
    tracing::debug!(dir = %dir.display(), "runtime installed");
    Ok(installed(true))
}

/// Whether `dir` holds a complete install of `flavour`: the marker, the executable and its
/// companion files are all there. Used by [`locate`](super::locate) too.
pub(crate) fn is_complete(flavour: Flavour, platform: Platform, dir: &Path) -> bool {
    dir.join(MARKER_FILE).is_file()
        && dir.join(flavour.executable_rel_path(platform)).is_file()
        && flavour
            .companion_rel_paths(platform)
            .iter()
            .all(|rel| dir.join(rel).is_file())
}

/// Runs npm into `tmp`, checks the result, makes the executable executable, writes the marker.
async fn populate(
    flavour: Flavour,
    platform: Platform,
    npm: &NpmCommand,
    tmp: &Path,
) -> Result<(), InstallError> {
    let spec = flavour.package_spec(platform);
    run_npm(npm, tmp, &spec, flavour == Flavour::Cli).await?;

    let executable = tmp.join(flavour.executable_rel_path(platform));
    let required = std::iter::once(executable.clone()).chain(
        flavour
            .companion_rel_paths(platform)
            .into_iter()
            .map(|rel| tmp.join(rel)),
    );
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
        "flavour": flavour.as_str(),
        "version": flavour.version(),
        "platform": platform.as_str(),
        "package": spec,
        "executable": flavour.executable_rel_path(platform),
    });
    let marker_path = tmp.join(MARKER_FILE);
    tokio::fs::write(&marker_path, format!("{marker}\n"))
        .await
        .map_err(io_err("write", &marker_path))
}

async fn run_npm(
    npm: &NpmCommand,
    prefix: &Path,
    spec: &str,
    include_optional: bool,
) -> Result<(), InstallError> {
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
        .arg(prefix);
    if include_optional {
        // The `copilot` executable comes from an optional dependency; a user config with
        // `omit=optional` would otherwise silently drop it.
        command.arg("--include=optional");
    }
    command
        .arg(spec)
        .current_dir(prefix)
        .env("npm_config_update_notifier", "false")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true);
    tracing::debug!(?command, "running npm");
    let output = command.output().await.map_err(|error| {
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
    if output.status.success() {
        return Ok(());
    }
    let source = if output.stderr.iter().all(u8::is_ascii_whitespace) {
        &output.stdout
    } else {
        &output.stderr
    };
    Err(InstallError::NpmFailed {
        package: spec.to_owned(),
        status: output.status,
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
    tokio::fs::rename(tmp, dir)
        .await
        .map_err(io_err("move the finished install into place at", dir))
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

/// Opens (creating) `path` and takes an exclusive `flock` on it, blocking on a pool thread.
/// The lock is released when the returned guard is dropped (or the process dies).
async fn lock_exclusive(path: PathBuf) -> Result<Flock<File>, InstallError> {
    let join_path = path.clone();
    tokio::task::spawn_blocking(move || {
        let mut file = OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&path)
            .map_err(io_err("open lock file", &path))?;
        loop {
            match Flock::lock(file, FlockArg::LockExclusive) {
                Ok(guard) => return Ok(guard),
                Err((returned, Errno::EINTR)) => file = returned,
                Err((_, error)) => return Err(InstallError::Lock { path, error }),
            }
        }
    })
    .await
    .map_err(|join| InstallError::Io {
        action: "wait for the install lock",
        path: join_path,
        error: io::Error::other(join.to_string()),
    })?
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
        let script_path = dir.join("fake-npm.sh");
        std::fs::write(&script_path, script).unwrap();
        NpmCommand {
            program: PathBuf::from("/bin/sh"),
            pre_args: vec![script_path.into_os_string()],
        }
    }

    fn runs(dir: &Path) -> usize {
        std::fs::read_to_string(dir.join("runs"))
            .map(|s| s.lines().count())
            .unwrap_or(0)
    }

    const P: Platform = Platform::LinuxX64;

    #[tokio::test]
    async fn installs_once_then_reuses_the_marked_install() {
        let tools = tempfile::tempdir().unwrap();
        let cache = tempfile::tempdir().unwrap();
        let npm = fake_npm(tools.path(), Flavour::Runtime, P, None);

        let first = install_with(Flavour::Runtime, P, cache.path(), || Some(npm.clone()))
            .await
            .unwrap();
        assert!(first.fresh);
        assert_eq!(first.version, "1.0.14");
        assert_eq!(first.dir, cache.path().join("runtime/1.0.14"));
        assert!(first.executable.is_file());
        assert!(super::super::is_executable_file(&first.executable));
        assert!(first.dir.join(MARKER_FILE).is_file());
        assert!(cache.path().join("runtime-1.0.14.lock").is_file());

        // Second call: no npm at all is needed.
        let second = install_with(Flavour::Runtime, P, cache.path(), || None)
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
                tokio::spawn(
                    async move { install_with(Flavour::Cli, P, &cache, || Some(npm)).await },
                )
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
        let installed = install_with(Flavour::Runtime, P, cache.path(), || Some(npm))
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
        let err = install_with(Flavour::Runtime, P, cache.path(), || None)
            .await
            .unwrap_err();
        assert!(matches!(err, InstallError::NpmMissing), "{err:?}");
        assert!(
            err.to_string().contains("install Node.js with npm"),
            "{err}"
        );
        // A program that does not exist is reported the same way.
        let err = install_with(Flavour::Runtime, P, cache.path(), || {
            Some(NpmCommand::program(cache.path().join("no-such-npm")))
        })
        .await
        .unwrap_err();
        assert!(matches!(err, InstallError::NpmMissing), "{err:?}");
    }

    #[tokio::test]
    async fn npm_failure_reports_status_and_stderr_tail() {
        let tools = tempfile::tempdir().unwrap();
        let cache = tempfile::tempdir().unwrap();
        let npm = fake_npm(tools.path(), Flavour::Runtime, P, Some(7));
        let err = install_with(Flavour::Runtime, P, cache.path(), || Some(npm))
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
        let err = install_with(Flavour::Runtime, P, cache.path(), || Some(npm))
            .await
            .unwrap_err();
        assert!(matches!(err, InstallError::MissingFile { .. }), "{err:?}");
        assert!(err.to_string().contains("copilot-runtime"), "{err}");
    }

    #[test]
    fn tail_keeps_the_end() {
        assert_eq!(tail(b"  abc  ", 10), "abc");
        assert_eq!(tail(b"0123456789", 4), "6789");
    }

    /// Really installs the Runtime flavour from the npm registry (about 40 MB compressed),
    /// twice concurrently and once more, into a private cache. Skipped when npm is not on
    /// PATH or COPILOT_POOL_SKIP_NPM_TESTS is set.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn real_npm_install_is_idempotent_and_locked() {
        if std::env::var_os("COPILOT_POOL_SKIP_NPM_TESTS").is_some() {
            return;
        }
        let Ok(platform) = Platform::current() else {
            return;
        };
        if super::super::find_on_path("npm", std::env::var_os("PATH")).is_none() {
            return;
        }
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
