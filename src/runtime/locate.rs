//! Finding the Copilot executable to run, without ever installing anything.
//!
//! Order: an explicit configured path, then `COPILOT_CLI_PATH`, then the managed installs in
//! the cache directory (the default [`Flavour::Runtime`] first, then [`Flavour::Cli`]), then
//! `copilot` on `PATH`. An explicit path or `COPILOT_CLI_PATH` that is unusable is an error
//! of its own: it never silently falls through to the next source.

use std::ffi::OsString;
use std::fmt;
use std::path::{Path, PathBuf};

use super::cache::cache_dir;
use super::flavour::Flavour;
use super::install::is_complete;
use super::platform::Platform;
use super::{find_on_path, is_executable_file, non_empty};

/// Environment variable naming the executable to use (as in the Copilot SDK).
pub const CLI_PATH_ENV: &str = "COPILOT_CLI_PATH";
/// Code at the start of the "nothing found" error, for scripts and docs to match on.
pub const MISSING_CODE: &str = "COPILOT_CLI_MISSING";
/// The command that installs the pinned runtime.
pub const INSTALL_COMMAND: &str = "copilot-pool install-cli";

/// Where a [`Located`] executable came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum LocatedBy {
    /// The path passed to [`locate`] (configuration or command line).
    Explicit,
    /// The `COPILOT_CLI_PATH` environment variable.
    EnvVar,
    /// A managed install of this flavour in the cache directory.
    Managed(Flavour),
    /// `copilot` found on `PATH`.
    Path,
}

impl fmt::Display for LocatedBy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            LocatedBy::Explicit => f.write_str("the configured Copilot CLI path"),
            LocatedBy::EnvVar => f.write_str(CLI_PATH_ENV),
            LocatedBy::Managed(flavour) => {
                write!(f, "the managed {flavour} install ({})", flavour.version())
            }
            LocatedBy::Path => f.write_str("`copilot` on PATH"),
        }
    }
}

/// The executable to spawn and how it was found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Located {
    /// The executable.
    pub path: PathBuf,
    /// Which source supplied it.
    pub source: LocatedBy,
}

/// Why [`locate`] found nothing usable.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LocateError {
    /// The explicit path or `COPILOT_CLI_PATH` names something that cannot be run.
    #[error("{origin} is {}, which {problem}", path.display())]
    Unusable {
        /// The path as given.
        path: PathBuf,
        /// [`LocatedBy::Explicit`] or [`LocatedBy::EnvVar`].
        origin: LocatedBy,
        /// `does not exist`, `is not a file` or `is not executable`.
        problem: &'static str,
    },
    /// A managed install another user could have changed: the daemon would run what they
    /// put there.
    #[error(
        "the managed install at {} is not safe to run: {why}; another user could have \
         replaced the runtime there. Make the cache directory and everything in it owned by \
         this user and writable by nobody else (chown -R, chmod -R o-w), or install into a \
         cache only this user can write (COPILOT_POOL_CACHE_DIR) with `{INSTALL_COMMAND}`",
        dir.display()
    )]
    UnsafeInstall {
        /// The install's directory.
        dir: PathBuf,
        /// Which path, and what about it.
        why: String,
    },
    /// No source had an executable.
    #[error(
        "{MISSING_CODE}: no Copilot runtime found (looked at: {}). Install the pinned runtime \
         with `{INSTALL_COMMAND}`, or set {CLI_PATH_ENV} to an existing copilot or \
         copilot-runtime executable.",
        looked_at.join("; ")
    )]
    Missing {
        /// One entry per place looked at, with why it did not qualify.
        looked_at: Vec<String>,
    },
}

/// Finds the Copilot executable: `explicit`, else `COPILOT_CLI_PATH`, else the managed installs
/// under [`cache_dir`](super::cache_dir), else `copilot` on `PATH`. Never installs.
///
/// `env` looks variables up (`COPILOT_CLI_PATH`, the cache variables, `PATH`); pass
/// [`process_env`](super::process_env) for the real environment.
pub fn locate(
    explicit: Option<&Path>,
    env: impl Fn(&str) -> Option<OsString>,
) -> Result<Located, LocateError> {
    locate_on(explicit, &env, Platform::current().ok())
}

/// [`locate`] for a given platform (`None`: unsupported, managed installs are skipped).
fn locate_on(
    explicit: Option<&Path>,
    env: &impl Fn(&str) -> Option<OsString>,
    platform: Option<Platform>,
) -> Result<Located, LocateError> {
    if let Some(path) = explicit {
        return usable(path, LocatedBy::Explicit);
    }
    if let Some(path) = non_empty(env, CLI_PATH_ENV) {
        return usable(Path::new(&path), LocatedBy::EnvVar);
    }

    let mut looked_at = vec![format!("{CLI_PATH_ENV} (not set)")];
    match (cache_dir(env), platform) {
        (Ok(cache), Some(platform)) => {
            for flavour in Flavour::ALL {
                let dir = flavour.install_dir(&cache);
                if is_complete(flavour, platform, &dir) {
                    let path = dir.join(flavour.executable_rel_path(platform));
                    if let Some(why) = changeable_by_others(&cache, &path) {
                        return Err(LocateError::UnsafeInstall { dir, why });
                    }
                    tracing::debug!(path = %path.display(), %flavour, "using managed runtime");
                    return Ok(Located {
                        path,
                        source: LocatedBy::Managed(flavour),
                    });
                }
                looked_at.push(format!("{} (not installed)", dir.display()));
            }
        }
        (Err(err), _) => looked_at.push(format!("managed installs ({err})")),
        (Ok(_), None) => looked_at.push("managed installs (unsupported platform)".to_owned()),
    }

    if let Some(path) = find_on_path("copilot", env("PATH")) {
        tracing::debug!(path = %path.display(), "using copilot from PATH");
        return Ok(Located {
            path,
            source: LocatedBy::Path,
        });
    }
    looked_at.push("`copilot` on PATH (not found)".to_owned());
    Err(LocateError::Missing { looked_at })
}

/// Why `exe` under the cache directory `cache` could have been changed by another user: the
/// cache directory, a directory between it and `exe`, or `exe` itself owned by someone other
/// than this user or root, or writable by every user (a directory with the sticky bit, whose
/// entries only their owners may replace, excepted). `None` when nothing is.
fn changeable_by_others(cache: &Path, exe: &Path) -> Option<String> {
    use std::os::unix::fs::MetadataExt;
    let me = nix::unistd::geteuid().as_raw();
    let below = exe
        .ancestors()
        .take_while(|p| p.starts_with(cache) && *p != cache)
        .collect::<Vec<_>>();
    std::iter::once(cache)
        .chain(below.into_iter().rev())
        .find_map(|path| {
            let meta = std::fs::metadata(path).ok()?;
            let owner = meta.uid();
            if owner != me && owner != 0 {
                return Some(format!("{} is owned by uid {owner}", path.display()));
            }
            let sticky_dir = meta.is_dir() && meta.mode() & 0o1000 != 0;
            (meta.mode() & 0o002 != 0 && !sticky_dir)
                .then(|| format!("{} is writable by every user", path.display()))
        })
}

fn usable(path: &Path, origin: LocatedBy) -> Result<Located, LocateError> {
    let problem = match std::fs::metadata(path) {
        Err(_) => Some("does not exist"),
        Ok(meta) if !meta.is_file() => Some("is not a file"),
        Ok(_) if !is_executable_file(path) => Some("is not executable"),
        Ok(_) => None,
    };
    match problem {
        Some(problem) => Err(LocateError::Unusable {
            path: path.to_path_buf(),
            origin,
            problem,
        }),
        None => Ok(Located {
            path: path.to_path_buf(),
            source: origin,
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::runtime::install::MARKER_FILE;
    use std::collections::HashMap;
    use std::os::unix::fs::PermissionsExt;

    const P: Platform = Platform::LinuxX64;

    struct Fixture {
        _root: tempfile::TempDir,
        cache: PathBuf,
        bin: PathBuf,
        other: PathBuf,
    }

    fn fixture() -> Fixture {
        let root = tempfile::tempdir().unwrap();
        let cache = root.path().join("cache");
        let bin = root.path().join("bin");
        std::fs::create_dir_all(&bin).unwrap();
        let other = root.path().join("elsewhere/copilot-runtime");
        write_exe(&other);
        Fixture {
            cache,
            bin,
            other,
            _root: root,
        }
    }

    fn write_exe(path: &Path) {
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(path, "#!/bin/sh\n").unwrap();
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o755)).unwrap();
    }

    /// Lays out a complete managed install of `flavour` the way `install` leaves it.
    fn fake_install(cache: &Path, flavour: Flavour) -> PathBuf {
        let dir = flavour.install_dir(cache);
        let exe = dir.join(flavour.executable_rel_path(P));
        write_exe(&exe);
        for rel in flavour.companion_rel_paths(P) {
            std::fs::write(dir.join(rel), "lib").unwrap();
        }
        std::fs::write(dir.join(MARKER_FILE), "{}").unwrap();
        exe
    }

    fn env_of(pairs: Vec<(&'static str, OsString)>) -> impl Fn(&str) -> Option<OsString> {
        let map: HashMap<&str, OsString> = pairs.into_iter().collect();
        move |key| map.get(key).cloned()
    }

    fn base_env(f: &Fixture) -> Vec<(&'static str, OsString)> {
        vec![
            ("COPILOT_POOL_CACHE_DIR", f.cache.clone().into_os_string()),
            ("PATH", f.bin.clone().into_os_string()),
        ]
    }

    #[test]
    fn a_managed_install_another_user_could_change_is_refused_naming_the_path() {
        let f = fixture();
        let exe = fake_install(&f.cache, Flavour::Runtime);
        let env = env_of(base_env(&f));
        assert!(locate_on(None, &env, Some(P)).is_ok());
        let version_dir = Flavour::Runtime.install_dir(&f.cache);
        for writable in [version_dir.clone(), exe.clone(), f.cache.clone()] {
            let mode = std::fs::metadata(&writable).unwrap().permissions().mode();
            std::fs::set_permissions(&writable, std::fs::Permissions::from_mode(mode | 0o002))
                .unwrap();
            let refused = locate_on(None, &env, Some(P)).unwrap_err();
            assert!(
                matches!(&refused, LocateError::UnsafeInstall { why, .. }
                    if why.contains(&writable.display().to_string())),
                "{refused}"
            );
            assert!(refused.to_string().contains("chmod -R o-w"), "{refused}");
            std::fs::set_permissions(&writable, std::fs::Permissions::from_mode(mode)).unwrap();
        }
        assert!(locate_on(None, &env, Some(P)).is_ok());
    }

    #[test]
    fn order_explicit_env_managed_path() {
        let f = fixture();
        let runtime_exe = fake_install(&f.cache, Flavour::Runtime);
        let cli_exe = fake_install(&f.cache, Flavour::Cli);
        let path_exe = f.bin.join("copilot");
        write_exe(&path_exe);
        let explicit = f.bin.join("explicit-copilot");
        write_exe(&explicit);

        let mut vars = base_env(&f);
        vars.push(("COPILOT_CLI_PATH", f.other.clone().into_os_string()));
        let env = env_of(vars);
        let got = locate_on(Some(&explicit), &env, Some(P)).unwrap();
        assert_eq!((got.path, got.source), (explicit, LocatedBy::Explicit));

        let got = locate_on(None, &env, Some(P)).unwrap();
        assert_eq!((got.path, got.source), (f.other.clone(), LocatedBy::EnvVar));

        let env = env_of(base_env(&f));
        let got = locate_on(None, &env, Some(P)).unwrap();
        assert_eq!(
            (got.path, got.source),
            (runtime_exe.clone(), LocatedBy::Managed(Flavour::Runtime))
        );

        std::fs::remove_file(Flavour::Runtime.install_dir(&f.cache).join(MARKER_FILE)).unwrap();
        let got = locate_on(None, &env, Some(P)).unwrap();
        assert_eq!(
            (got.path, got.source),
            (cli_exe, LocatedBy::Managed(Flavour::Cli))
        );

        std::fs::remove_dir_all(&f.cache).unwrap();
        let got = locate_on(None, &env, Some(P)).unwrap();
        assert_eq!((got.path, got.source), (path_exe.clone(), LocatedBy::Path));

        // Unsupported platform: managed installs are skipped, PATH still works.
        let got = locate_on(None, &env, None).unwrap();
        assert_eq!(got.source, LocatedBy::Path);
    }

    #[test]
    fn nothing_found_is_copilot_cli_missing() {
        let f = fixture();
        // A non-executable `copilot` on PATH does not count.
        std::fs::write(f.bin.join("copilot"), "text").unwrap();
        let env = env_of(base_env(&f));
        let err = locate_on(None, &env, Some(P)).unwrap_err();
        let text = err.to_string();
        assert!(text.starts_with("COPILOT_CLI_MISSING: "), "{text}");
        assert!(text.contains("`copilot-pool install-cli`"), "{text}");
        assert!(text.contains("COPILOT_CLI_PATH"), "{text}");
        assert!(
            text.contains(&f.cache.join("runtime/1.0.14").display().to_string()),
            "{text}"
        );
        assert!(
            text.contains(&f.cache.join("cli/1.0.102").display().to_string()),
            "{text}"
        );
        assert!(text.contains("on PATH"), "{text}");

        // Also when no cache directory can be chosen at all.
        let env = env_of(vec![]);
        let err = locate_on(None, &env, Some(P)).unwrap_err();
        assert!(
            err.to_string().starts_with("COPILOT_CLI_MISSING: "),
            "{err}"
        );
    }

    #[test]
    fn broken_explicit_or_env_path_does_not_fall_through() {
        let f = fixture();
        fake_install(&f.cache, Flavour::Runtime);
        let missing = f.bin.join("nope/copilot");

        let env = env_of(base_env(&f));
        let err = locate_on(Some(&missing), &env, Some(P)).unwrap_err();
        assert_eq!(
            err,
            LocateError::Unusable {
                path: missing.clone(),
                origin: LocatedBy::Explicit,
                problem: "does not exist",
            }
        );
        let text = err.to_string();
        assert!(text.contains(&missing.display().to_string()), "{text}");
        assert!(text.contains("configured"), "{text}");

        let mut vars = base_env(&f);
        vars.push(("COPILOT_CLI_PATH", missing.clone().into_os_string()));
        let env = env_of(vars);
        let err = locate_on(None, &env, Some(P)).unwrap_err();
        assert!(
            matches!(
                &err,
                LocateError::Unusable {
                    origin: LocatedBy::EnvVar,
                    ..
                }
            ),
            "{err:?}"
        );
        assert!(err.to_string().starts_with("COPILOT_CLI_PATH is "), "{err}");

        let err = locate_on(Some(&f.bin), &env, Some(P)).unwrap_err();
        assert!(err.to_string().ends_with("is not a file"), "{err}");
    }

    #[test]
    fn empty_env_path_counts_as_unset() {
        let f = fixture();
        let exe = fake_install(&f.cache, Flavour::Runtime);
        let mut vars = base_env(&f);
        vars.push(("COPILOT_CLI_PATH", OsString::new()));
        let got = locate_on(None, &env_of(vars), Some(P)).unwrap();
        assert_eq!(got.path, exe);
    }
}
