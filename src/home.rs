//! The `COPILOT_HOME` of an agent: validating agent ids, finding the pool's base directory,
//! and choosing, creating (mode 0700) and canonicalizing the directory a CLI child keeps
//! its state in, so that equal directories always key the same.

use std::ffi::OsString;
use std::io;
use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
use std::path::{Path, PathBuf};

/// The longest agent id accepted.
pub const MAX_AGENT_ID_LEN: usize = 64;

/// How many characters of a rejected agent id an error shows.
const SHOWN_ID_CHARS: usize = 80;

/// Why an agent's `COPILOT_HOME` could not be found or made.
#[derive(Debug, thiserror::Error)]
pub enum HomeError {
    /// The agent id does not match `^[a-z0-9][a-z0-9_-]{0,63}$`.
    #[error(
        "invalid agent id {shown:?}: it must match ^[a-z0-9][a-z0-9_-]{{0,63}}$ (1 to 64 \
         lowercase letters, digits, '_' or '-', starting with a letter or digit); pass an id \
         of that form"
    )]
    InvalidAgentId {
        /// The rejected id, truncated to 80 characters.
        shown: String,
    },
    /// A path that must be absolute is relative.
    #[error("the {what} {path:?} must be absolute; pass an absolute path")]
    NotAbsolute {
        /// Which path: "explicit COPILOT_HOME", "agent directory" or "base directory".
        what: &'static str,
        /// The relative path.
        path: PathBuf,
    },
    /// The directory could not be created, is not a directory, or could not be resolved.
    #[error(
        "could not create or open the COPILOT_HOME directory {path:?}: {source}; make sure \
         it is a directory (or can be created) and that its parent is writable, or pass \
         another directory"
    )]
    Create {
        /// The directory.
        path: PathBuf,
        /// The underlying error.
        source: io::Error,
    },
    /// The agent's `copilot` directory in the pool's layout, or a CLI backend's home (in
    /// the agent's directory, or in an explicit `COPILOT_HOME`), is a symbolic link (or not
    /// a directory). Its parent is the agent's own directory, which the agent's processes
    /// may write: a link there would point the agent at another agent's home, and its
    /// sandbox at that agent's directory.
    #[error(
        "the agent's home directory {path:?} is a symbolic link or not a directory; it must \
         be a plain directory, and the agent's own processes may have put the link there (it \
         could point one agent at another's home): check what it points to, then remove it \
         so the pool makes the directory again"
    )]
    NotPlainDirectory {
        /// The directory.
        path: PathBuf,
    },
    /// The agent's working directory could not be created.
    #[error(
        "could not create the agent's working directory {path:?}: {source}; make the agents \
         directory writable by this user"
    )]
    CreateWorkDir {
        /// The directory.
        path: PathBuf,
        /// The underlying error.
        source: io::Error,
    },
    /// Neither `COPILOT_POOL_HOME` nor `HOME` is set.
    #[error(
        "no base directory for copilot-pool: neither COPILOT_POOL_HOME nor HOME is set; set \
         COPILOT_POOL_HOME to an absolute directory"
    )]
    NoBaseDir,
}

impl HomeError {
    /// Whether the caller can fix it by asking differently (an agent id or a path it gave);
    /// otherwise the machine's directories are at fault (full, read-only, a link where a
    /// directory belongs, no base directory): the operator's to fix.
    pub fn is_callers(&self) -> bool {
        matches!(
            self,
            HomeError::InvalidAgentId { .. } | HomeError::NotAbsolute { .. }
        )
    }
}

/// Checks that `agent_id` matches `^[a-z0-9][a-z0-9_-]{0,63}$`, so it is safe as a path
/// component.
pub fn validate_agent_id(agent_id: &str) -> Result<(), HomeError> {
    let bytes = agent_id.as_bytes();
    let valid = match bytes.split_first() {
        None => false,
        Some((first, rest)) => {
            bytes.len() <= MAX_AGENT_ID_LEN
                && (first.is_ascii_lowercase() || first.is_ascii_digit())
                && rest.iter().all(|b| {
                    b.is_ascii_lowercase() || b.is_ascii_digit() || *b == b'_' || *b == b'-'
                })
        }
    };
    if valid {
        Ok(())
    } else {
        Err(HomeError::InvalidAgentId {
            shown: agent_id.chars().take(SHOWN_ID_CHARS).collect(),
        })
    }
}

/// The pool's base directory: `$COPILOT_POOL_HOME` if set and non-empty, else
/// `$HOME/.copilot-pool`. `env` looks a variable up (pass `std::env::var_os` in production).
pub fn default_base_dir(env: impl Fn(&str) -> Option<OsString>) -> Result<PathBuf, HomeError> {
    if let Some(dir) = env("COPILOT_POOL_HOME").filter(|v| !v.is_empty()) {
        return Ok(PathBuf::from(dir));
    }
    if let Some(home) = env("HOME").filter(|v| !v.is_empty()) {
        return Ok(PathBuf::from(home).join(".copilot-pool"));
    }
    Err(HomeError::NoBaseDir)
}

/// The `COPILOT_HOME` of `agent_id`: `explicit` if given, else `<agent_dir>/copilot`, else
/// `<base>/agents/<agent_id>/copilot`. The chosen path must be absolute. The directory is
/// created (with its parents) if missing and then has mode 0700; an existing directory keeps
/// its mode. Returns the canonical path, so spellings of one directory compare equal.
pub fn resolve_copilot_home(
    explicit: Option<&Path>,
    agent_dir: Option<&Path>,
    base: &Path,
    agent_id: &str,
) -> Result<PathBuf, HomeError> {
    let path = chosen_home(explicit, agent_dir, base, agent_id)?;
    let create_error = |source| HomeError::Create {
        path: path.clone(),
        source,
    };
    if let Err(error) = ensure_private_dir(&path) {
        if explicit.is_none() {
            // A dangling link is refused for what it is, not as a failed create.
            not_a_link(&path)?;
        }
        return Err(create_error(error));
    }
    if explicit.is_some() {
        return std::fs::canonicalize(&path).map_err(create_error);
    }
    // The layout's `copilot` lies in the agent's own directory, which its worker may write:
    // only the directory above it is resolved, and it must be a plain directory, so the
    // home (and the sandbox root, its parent) stays the agent's whatever links appear.
    let parent = path.parent().unwrap_or(&path);
    let home = std::fs::canonicalize(parent)
        .map_err(create_error)?
        .join("copilot");
    plain_directory(home)
}

/// The `COPILOT_HOME` path [`resolve_copilot_home`] starts from: `explicit`, else
/// `<agent_dir>/copilot` (`..` taken lexically), else `<base>/agents/<agent_id>/copilot`;
/// absolute, the agent id valid. Nothing is looked at on disk.
fn chosen_home(
    explicit: Option<&Path>,
    agent_dir: Option<&Path>,
    base: &Path,
    agent_id: &str,
) -> Result<PathBuf, HomeError> {
    validate_agent_id(agent_id)?;
    let (what, path) = match (explicit, agent_dir) {
        (Some(path), _) => ("explicit COPILOT_HOME", path.to_path_buf()),
        // `..` taken lexically: the kernel would take it after following a link, and a
        // link inside an agent's directory may be the agent's own doing.
        (None, Some(dir)) => (
            "agent directory",
            crate::permission::path::lexically_normal(dir).join("copilot"),
        ),
        (None, None) => (
            "base directory",
            base.join("agents").join(agent_id).join("copilot"),
        ),
    };
    if !path.is_absolute() {
        return Err(HomeError::NotAbsolute { what, path });
    }
    Ok(path)
}

/// The home of an agent's CLI backend `backend` (its `HOME`): `<agent's directory>/<backend>`,
/// created (mode 0700) if missing. The agent's directory is where its sandbox is rooted: in
/// the pool's layout (`in_layout`: no explicit `COPILOT_HOME`) the parent of
/// `copilot_home` (from [`resolve_copilot_home`]), beside the `copilot` directory; with an
/// explicit `COPILOT_HOME` the home itself, since the gateway's layout names no directory
/// of the agent's around it (its parent, e.g. `/var/lib/gw/homes`, holds every agent's
/// home, and a backend's home there would be shared by all of them). Either way the
/// directory lies in one the agent's processes may write, so it must be a plain directory
/// as the `COPILOT_HOME` must: the pool itself (unsandboxed) writes the backend's settings
/// there and reads its transcripts, and a link would make those another agent's.
pub fn backend_home(
    copilot_home: &Path,
    backend: &str,
    in_layout: bool,
) -> Result<PathBuf, HomeError> {
    let agent_dir = if in_layout {
        copilot_home.parent().unwrap_or(copilot_home)
    } else {
        copilot_home
    };
    let home = agent_dir.join(backend);
    if let Err(source) = ensure_private_dir(&home) {
        // A dangling link is refused for what it is, not as a failed create.
        not_a_link(&home)?;
        return Err(HomeError::Create { path: home, source });
    }
    plain_directory(home)
}

/// The home [`backend_home`] gives `agent_id`'s CLI backend `backend` (its `COPILOT_HOME`
/// chosen as [`resolve_copilot_home`] chooses it), found without creating anything:
/// `Ok(None)` when it does not exist. The same rule: it must be a plain directory. For a
/// deletion, which must leave nothing behind.
pub fn find_backend_home(
    explicit: Option<&Path>,
    agent_dir: Option<&Path>,
    base: &Path,
    agent_id: &str,
    backend: &str,
) -> Result<Option<PathBuf>, HomeError> {
    let path = chosen_home(explicit, agent_dir, base, agent_id)?;
    // The directory the backend's home sits in, as a lease resolves it: the explicit home
    // itself (resolved), or the agent's directory around its `copilot`.
    let above = match explicit {
        Some(_) => std::fs::canonicalize(&path),
        None => path
            .parent()
            .map_or_else(|| Ok(path.clone()), std::fs::canonicalize),
    };
    let above = match above {
        Ok(dir) => dir,
        Err(err) if err.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(source) => return Err(HomeError::Create { path, source }),
    };
    let home = above.join(backend);
    match std::fs::symlink_metadata(&home) {
        Err(err) if err.kind() == io::ErrorKind::NotFound => Ok(None),
        Err(source) => Err(HomeError::Create { path: home, source }),
        Ok(meta) if meta.is_dir() => Ok(Some(home)),
        Ok(_) => Err(HomeError::NotPlainDirectory { path: home }),
    }
}

/// `path` if it is a directory and not a symbolic link (else `NotPlainDirectory`).
fn plain_directory(path: PathBuf) -> Result<PathBuf, HomeError> {
    match std::fs::symlink_metadata(&path) {
        Ok(meta) if meta.is_dir() => Ok(path),
        Ok(_) => Err(HomeError::NotPlainDirectory { path }),
        Err(source) => Err(HomeError::Create { path, source }),
    }
}

/// Refuses `path` if it is a symbolic link (dangling or not); missing is fine.
fn not_a_link(path: &Path) -> Result<(), HomeError> {
    match std::fs::symlink_metadata(path) {
        Ok(meta) if meta.file_type().is_symlink() => Err(HomeError::NotPlainDirectory {
            path: path.to_path_buf(),
        }),
        _ => Ok(()),
    }
}

/// An agent's default working directory, beside its home: `<base>/agents/<agent_id>/work`.
/// Not created here (see [`create_work_dir`]).
pub fn work_dir(base: &Path, agent_id: &str) -> Result<PathBuf, HomeError> {
    validate_agent_id(agent_id)?;
    Ok(base.join("agents").join(agent_id).join("work"))
}

/// The directories a conversation's paths may lie in: the agent's own work directory `work`
/// (unless a link or anything but a directory is in its place: the agent's processes may
/// have put it there, and followed it would widen the roots to wherever it points), then the
/// operator's `allowed` roots (which may be links: the operator's).
pub fn conversation_roots(work: PathBuf, allowed: &[PathBuf]) -> Vec<PathBuf> {
    let replaced = std::fs::symlink_metadata(&work).is_ok_and(|meta| !meta.is_dir());
    (!replaced)
        .then_some(work)
        .into_iter()
        .chain(allowed.iter().cloned())
        .collect()
}

/// Creates an agent's working directory (and missing parents) with mode 0700. Call it only
/// for a turn that will run, so rejected requests leave nothing behind.
pub fn create_work_dir(path: &Path) -> Result<(), HomeError> {
    ensure_private_dir(path).map_err(|source| HomeError::CreateWorkDir {
        path: path.to_path_buf(),
        source,
    })?;
    // It lies in a directory the agent's processes may write: a link put in its place
    // would take the turn (and what the pool writes there) elsewhere.
    plain_directory(path.to_path_buf())
        .map(|_| ())
        .map_err(|_| HomeError::CreateWorkDir {
            path: path.to_path_buf(),
            source: io::Error::new(
                io::ErrorKind::InvalidInput,
                "it is a symbolic link or not a directory, which the agent's own processes may \
                 have put there (it could lead elsewhere): check what it points to, then \
                 remove it so the pool makes the directory again",
            ),
        })
}

/// Creates `path` (and missing parents, mode 0700) if it does not exist, setting the final
/// directory to 0700 regardless of the umask; leaves an existing directory alone.
pub(crate) fn ensure_private_dir(path: &Path) -> io::Result<()> {
    if let Some(parent) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(parent)?;
    }
    match std::fs::DirBuilder::new().mode(0o700).create(path) {
        Ok(()) => std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o700)),
        Err(err) if err.kind() == io::ErrorKind::AlreadyExists => {
            if std::fs::metadata(path)?.is_dir() {
                Ok(())
            } else {
                Err(io::Error::new(
                    io::ErrorKind::AlreadyExists,
                    "it exists and is not a directory",
                ))
            }
        }
        Err(err) => Err(err),
    }
}

/// [`ensure_private_dir`] for each of `dirs` in turn, off the async threads; the first that
/// fails is returned with its error.
pub(crate) async fn ensure_private_dirs(dirs: Vec<PathBuf>) -> Result<(), (PathBuf, io::Error)> {
    let first = dirs.first().cloned().unwrap_or_default();
    tokio::task::spawn_blocking(move || {
        dirs.iter()
            .try_for_each(|dir| ensure_private_dir(dir).map_err(|error| (dir.clone(), error)))
    })
    .await
    .unwrap_or_else(|e| Err((first, io::Error::other(e.to_string()))))
}

/// Makes sure of `root` ([`ensure_private_dir`]: the pool resolved it) and of each of
/// `below` in it, made private (0700, whatever the umask) without following a link the
/// agent's processes may have planted there (`agent_files::create_dirs`): a CLI's `tmp`
/// and its config folder in its backend's home. Off the async threads.
pub(crate) async fn ensure_private_dirs_below(
    root: PathBuf,
    below: Vec<&'static str>,
) -> Result<(), (PathBuf, io::Error)> {
    let shown = root.clone();
    tokio::task::spawn_blocking(move || {
        ensure_private_dir(&root).map_err(|error| (root.clone(), error))?;
        below.iter().try_for_each(|rel| {
            crate::agent_files::create_dirs(&root, Path::new(rel), 0o700)
                .map_err(|error| (root.join(rel), error))
        })
    })
    .await
    .unwrap_or_else(|e| Err((shown, io::Error::other(e.to_string()))))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_link_planted_below_a_backends_home_is_refused_never_followed() {
        let base = tempfile::tempdir().unwrap();
        let home = base.path().join("agent/claude-cli");
        let elsewhere = base.path().join("elsewhere");
        std::fs::create_dir_all(&elsewhere).unwrap();
        ensure_private_dirs_below(home.clone(), vec!["tmp", ".claude"])
            .await
            .unwrap();
        assert_eq!(mode(&home.join("tmp")), 0o700);
        std::fs::remove_dir(home.join("tmp")).unwrap();
        std::os::unix::fs::symlink(&elsewhere, home.join("tmp")).unwrap();
        let (path, _) = ensure_private_dirs_below(home.clone(), vec!["tmp"])
            .await
            .unwrap_err();
        assert_eq!(path, home.join("tmp"));
        assert!(std::fs::read_dir(&elsewhere).unwrap().next().is_none());
    }

    fn mode(path: &Path) -> u32 {
        std::fs::metadata(path).unwrap().permissions().mode() & 0o777
    }

    #[test]
    fn the_agents_work_directory_is_a_root_only_while_no_link_is_in_its_place() {
        let tmp = tempfile::tempdir().unwrap();
        let work = tmp.path().join("agents/a/work");
        let allowed = vec![tmp.path().join("shared")];
        // Missing (before the first turn) or a directory: a root.
        assert_eq!(conversation_roots(work.clone(), &allowed)[0], work);
        std::fs::create_dir_all(&work).unwrap();
        assert_eq!(conversation_roots(work.clone(), &allowed).len(), 2);
        // A link the agent's processes put in its place: no root (followed, it would make
        // wherever it points one).
        std::fs::remove_dir(&work).unwrap();
        std::os::unix::fs::symlink("/", &work).unwrap();
        assert_eq!(conversation_roots(work, &allowed), allowed);
    }

    #[test]
    fn the_work_directory_sits_beside_the_home_and_is_created_private_on_demand() {
        let base = tempfile::tempdir().unwrap();
        let work = work_dir(base.path(), "agent-1").unwrap();
        assert_eq!(work, base.path().join("agents/agent-1/work"));
        assert!(!work.exists(), "only named, not created");
        assert!(work_dir(base.path(), "../etc").is_err());
        create_work_dir(&work).unwrap();
        assert_eq!(mode(&work), 0o700);
        assert_eq!(mode(&base.path().join("agents/agent-1")), 0o700);
    }

    #[test]
    fn valid_agent_ids() {
        for id in [
            "a",
            "0",
            "main",
            "agent-1",
            "a_b-c",
            &"a".repeat(64),
            "9lives",
        ] {
            validate_agent_id(id).unwrap_or_else(|e| panic!("{id}: {e}"));
        }
    }

    #[test]
    fn invalid_agent_ids() {
        let long = "a".repeat(65);
        for id in [
            "", "Main", "-a", "_a", "../x", "a/b", "a.b", "a b", &long, "é", "a\n",
        ] {
            let err = validate_agent_id(id).unwrap_err();
            let text = err.to_string();
            assert!(matches!(err, HomeError::InvalidAgentId { .. }), "{id}");
            assert!(text.contains("^[a-z0-9][a-z0-9_-]{0,63}$"), "{text}");
            if id.len() <= 80 {
                assert!(text.contains(&format!("{id:?}")), "{text}");
            }
        }
    }

    #[test]
    fn invalid_agent_id_is_truncated_in_the_error() {
        let id = format!("X{}", "y".repeat(200));
        let text = validate_agent_id(&id).unwrap_err().to_string();
        let shown: String = id.chars().take(80).collect();
        assert!(text.contains(&format!("{shown:?}")), "{text}");
        assert!(!text.contains(&"y".repeat(80)), "{text}");
    }

    #[test]
    fn base_dir_from_env() {
        let env = |pairs: &'static [(&'static str, &'static str)]| {
            move |name: &str| {
                pairs
                    .iter()
                    .find(|(k, _)| *k == name)
                    .map(|(_, v)| OsString::from(v))
            }
        };
        assert_eq!(
            default_base_dir(env(&[("COPILOT_POOL_HOME", "/p"), ("HOME", "/h")])).unwrap(),
            PathBuf::from("/p")
        );
        assert_eq!(
            default_base_dir(env(&[("COPILOT_POOL_HOME", ""), ("HOME", "/h")])).unwrap(),
            PathBuf::from("/h/.copilot-pool")
        );
        assert_eq!(
            default_base_dir(env(&[("HOME", "/h")])).unwrap(),
            PathBuf::from("/h/.copilot-pool")
        );
        let err = default_base_dir(env(&[("HOME", "")])).unwrap_err();
        assert!(matches!(err, HomeError::NoBaseDir));
        assert!(err.to_string().contains("COPILOT_POOL_HOME"), "{err}");
        assert!(matches!(
            default_base_dir(env(&[])),
            Err(HomeError::NoBaseDir)
        ));
    }

    #[test]
    fn precedence() {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path().canonicalize().unwrap();
        let base = root.join("base");
        let agent_dir = root.join("agentdir");
        let explicit = root.join("explicit");

        let got = resolve_copilot_home(Some(&explicit), Some(&agent_dir), &base, "a1").unwrap();
        assert_eq!(got, explicit);
        let got = resolve_copilot_home(None, Some(&agent_dir), &base, "a1").unwrap();
        assert_eq!(got, agent_dir.join("copilot"));
        let got = resolve_copilot_home(None, None, &base, "a1").unwrap();
        assert_eq!(got, base.join("agents").join("a1").join("copilot"));
        assert!(got.is_dir());
    }

    #[test]
    fn invalid_id_is_rejected_even_with_explicit_path() {
        let tmp = tempfile::tempdir().unwrap();
        let explicit = tmp.path().join("explicit");
        let err = resolve_copilot_home(Some(&explicit), None, tmp.path(), "../x").unwrap_err();
        assert!(matches!(err, HomeError::InvalidAgentId { .. }));
        assert!(!explicit.exists());
    }

    #[test]
    fn created_directory_is_private_existing_is_left_alone() {
        let tmp = tempfile::tempdir().unwrap();
        let fresh = tmp.path().join("fresh").join("home");
        let got = resolve_copilot_home(Some(&fresh), None, tmp.path(), "a").unwrap();
        assert_eq!(mode(&got), 0o700);

        let existing = tmp.path().join("existing");
        std::fs::create_dir(&existing).unwrap();
        std::fs::set_permissions(&existing, std::fs::Permissions::from_mode(0o755)).unwrap();
        let got = resolve_copilot_home(Some(&existing), None, tmp.path(), "a").unwrap();
        assert_eq!(mode(&got), 0o755);
    }

    #[test]
    fn spellings_of_one_directory_key_the_same() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path();
        let messy = PathBuf::from(format!("{}/x/../copilot/", dir.display()));
        let clean = dir.join("copilot");
        let a = resolve_copilot_home(Some(&messy), None, dir, "a").unwrap();
        let b = resolve_copilot_home(Some(&clean), None, dir, "a").unwrap();
        assert_eq!(a, b);
        let c = resolve_copilot_home(None, Some(&dir.join("y/..")), dir, "a").unwrap();
        assert_eq!(a, c);
    }

    #[test]
    fn a_deletion_finds_the_backend_home_a_lease_makes_for_each_way_of_naming_the_home() {
        let tmp = tempfile::tempdir().unwrap();
        let base = tmp.path().canonicalize().unwrap();
        let gateway_dir = base.join("gw/agent-x");
        let explicit = base.join("explicit/home");
        let ways: [(Option<&Path>, Option<&Path>); 3] = [
            (None, None),
            (None, Some(&gateway_dir)),
            (Some(&explicit), None),
        ];
        for (explicit, agent_dir) in ways {
            let find = || find_backend_home(explicit, agent_dir, &base, "agent-x", "codex-cli");
            assert_eq!(
                find().unwrap(),
                None,
                "nothing yet: {explicit:?} {agent_dir:?}"
            );
            let home = resolve_copilot_home(explicit, agent_dir, &base, "agent-x").unwrap();
            let made = backend_home(&home, "codex-cli", explicit.is_none()).unwrap();
            assert!(made.is_dir());
            assert_eq!(
                find().unwrap(),
                Some(made.clone()),
                "{explicit:?} {agent_dir:?}"
            );
            // An explicit home removed since: nothing of its backend's is left to find.
            if let Some(explicit) = explicit {
                std::fs::remove_dir_all(explicit).unwrap();
                assert_eq!(find().unwrap(), None);
            }
        }
    }

    #[test]
    fn agents_with_explicit_sibling_homes_get_cli_backend_homes_of_their_own() {
        let tmp = tempfile::tempdir().unwrap();
        let base = tmp.path().canonicalize().unwrap();
        let homes = base.join("gw/homes");
        // A gateway's layout: one explicit COPILOT_HOME per agent, side by side; one agent
        // named as a backend is.
        let resolve = |agent: &str| {
            let explicit = homes.join(agent);
            resolve_copilot_home(Some(&explicit), None, &base, agent).unwrap()
        };
        let (a, b, named) = (resolve("a"), resolve("b"), resolve("claude-cli"));
        let of_a = backend_home(&a, "claude-cli", false).unwrap();
        let of_b = backend_home(&b, "claude-cli", false).unwrap();
        let of_named = backend_home(&named, "claude-cli", false).unwrap();
        assert_ne!(of_a, of_b);
        for (mine, own_home, others) in [
            (&of_a, &a, [&b, &named]),
            (&of_b, &b, [&a, &named]),
            (&of_named, &named, [&a, &b]),
        ] {
            // Inside the agent's own home (its sandbox root), so no other agent reaches it.
            assert!(mine.starts_with(own_home), "{mine:?} in {own_home:?}");
            for other in others {
                assert!(!mine.starts_with(other), "{mine:?} under {other:?}");
                assert!(!other.starts_with(mine), "{other:?} under {mine:?}");
            }
            assert_eq!(mode(mine), 0o700);
        }
        // Found again for a deletion where a lease made it.
        let found = find_backend_home(Some(&homes.join("a")), None, &base, "a", "claude-cli");
        assert_eq!(found.unwrap(), Some(of_a.clone()));
        // The agent's own processes may write its explicit home: a link put in place of the
        // backend's home (to another agent's) is refused, as in the pool's layout.
        std::fs::remove_dir(&of_a).unwrap();
        std::os::unix::fs::symlink(&of_b, &of_a).unwrap();
        let err = backend_home(&a, "claude-cli", false).unwrap_err();
        assert!(matches!(err, HomeError::NotPlainDirectory { .. }), "{err}");
        let found = find_backend_home(Some(&homes.join("a")), None, &base, "a", "claude-cli");
        assert!(matches!(found, Err(HomeError::NotPlainDirectory { .. })));
    }

    #[test]
    fn a_work_directory_turned_into_a_link_is_refused_with_the_fix() {
        let tmp = tempfile::tempdir().unwrap();
        let base = tmp.path().canonicalize().unwrap();
        let work = work_dir(&base, "agent-w").unwrap();
        create_work_dir(&work).unwrap();
        create_work_dir(&work).unwrap();
        std::fs::remove_dir(&work).unwrap();
        std::os::unix::fs::symlink(base.join("elsewhere"), &work).unwrap();
        std::fs::create_dir(base.join("elsewhere")).unwrap();
        let err = create_work_dir(&work).unwrap_err();
        assert!(matches!(err, HomeError::CreateWorkDir { .. }), "{err}");
        assert!(
            err.to_string().contains("symbolic link") && err.to_string().contains("remove it"),
            "{err}"
        );
    }

    #[test]
    fn a_cli_backends_home_turned_into_a_link_to_another_agents_is_refused() {
        let tmp = tempfile::tempdir().unwrap();
        let base = tmp.path().canonicalize().unwrap();
        let victim = resolve_copilot_home(None, None, &base, "victim").unwrap();
        let mine = resolve_copilot_home(None, None, &base, "mine").unwrap();
        let theirs = backend_home(&victim, "gemini-cli", true).unwrap();
        assert_eq!(theirs, base.join("agents/victim/gemini-cli"));
        assert_eq!(mode(&theirs), 0o700);
        let own = backend_home(&mine, "gemini-cli", true).unwrap();
        assert_eq!(own, base.join("agents/mine/gemini-cli"));
        // What a process allowed to write its own agent directory could do.
        std::fs::remove_dir(&own).unwrap();
        std::os::unix::fs::symlink(&theirs, &own).unwrap();
        let err = backend_home(&mine, "gemini-cli", true).unwrap_err();
        assert!(matches!(err, HomeError::NotPlainDirectory { .. }), "{err}");
        assert!(err.to_string().contains("remove it"), "{err}");
        // Found for a deletion without making anything; the link refused there too.
        let find =
            |agent: &str, backend: &str| find_backend_home(None, None, &base, agent, backend);
        assert_eq!(find("victim", "gemini-cli").unwrap(), Some(theirs.clone()));
        assert!(matches!(
            find("mine", "gemini-cli"),
            Err(HomeError::NotPlainDirectory { .. })
        ));
        assert_eq!(find("victim", "codex-cli").unwrap(), None);
        assert_eq!(find("nobody", "codex-cli").unwrap(), None);
        assert!(
            !base.join("agents/nobody").exists() && !base.join("agents/victim/codex-cli").exists()
        );
        // A dangling link is refused for what it is.
        std::fs::remove_file(&own).unwrap();
        std::os::unix::fs::symlink(base.join("gone"), &own).unwrap();
        let err = backend_home(&mine, "gemini-cli", true).unwrap_err();
        assert!(matches!(err, HomeError::NotPlainDirectory { .. }), "{err}");
    }

    #[test]
    fn an_agents_home_turned_into_a_link_to_another_agents_home_is_refused() {
        let tmp = tempfile::tempdir().unwrap();
        let base = tmp.path().canonicalize().unwrap();
        let victim = resolve_copilot_home(None, None, &base, "victim").unwrap();
        let mine = resolve_copilot_home(None, None, &base, "mine").unwrap();
        assert_eq!(mine, base.join("agents/mine/copilot"));
        // What a worker allowed to write its own agent directory could do.
        std::fs::rename(&mine, base.join("agents/mine/copilot.old")).unwrap();
        std::os::unix::fs::symlink(&victim, &mine).unwrap();
        let err = resolve_copilot_home(None, None, &base, "mine").unwrap_err();
        assert!(matches!(err, HomeError::NotPlainDirectory { .. }), "{err}");
        let text = err.to_string();
        assert!(
            text.contains("symbolic link") && text.contains("remove it"),
            "{text}"
        );
        // The same through the gateway's agent directory.
        let agent_dir = base.join("agents/mine");
        let err = resolve_copilot_home(None, Some(&agent_dir), &base, "mine").unwrap_err();
        assert!(matches!(err, HomeError::NotPlainDirectory { .. }), "{err}");
        // A `..` in the gateway's agent directory is not taken after a link the agent put
        // in its directory (`work` -> the victim's directory, then `work/..`).
        let theirs = base.join("agents/theirs");
        resolve_copilot_home(None, Some(&theirs), &base, "theirs").unwrap();
        std::os::unix::fs::symlink(base.join("agents/victim"), theirs.join("work")).unwrap();
        let through = theirs.join("work/..");
        assert_eq!(
            resolve_copilot_home(None, Some(&through), &base, "theirs").unwrap(),
            theirs.join("copilot")
        );
        // A file where the directory should be is refused too.
        std::fs::remove_file(&mine).unwrap();
        std::fs::write(&mine, b"x").unwrap();
        let err = resolve_copilot_home(None, None, &base, "mine").unwrap_err();
        assert!(matches!(err, HomeError::Create { .. }), "{err}");
        // A dangling link is refused as a link, not as a failed create.
        std::fs::remove_file(&mine).unwrap();
        std::os::unix::fs::symlink(base.join("gone"), &mine).unwrap();
        let err = resolve_copilot_home(None, None, &base, "mine").unwrap_err();
        assert!(matches!(err, HomeError::NotPlainDirectory { .. }), "{err}");
        std::fs::remove_file(&mine).unwrap();
        std::fs::write(&mine, b"x").unwrap();
        // An explicit home is the gateway's choice: a link there is followed.
        let link = base.join("explicit-link");
        std::os::unix::fs::symlink(&victim, &link).unwrap();
        assert_eq!(
            resolve_copilot_home(Some(&link), None, &base, "mine").unwrap(),
            victim
        );
    }

    #[test]
    fn relative_paths_are_errors() {
        let tmp = tempfile::tempdir().unwrap();
        for (explicit, agent_dir, base) in [
            (Some(Path::new("rel/home")), None, tmp.path()),
            (None, Some(Path::new("rel")), tmp.path()),
            (None, None, Path::new("rel-base")),
        ] {
            let err = resolve_copilot_home(explicit, agent_dir, base, "a").unwrap_err();
            assert!(matches!(err, HomeError::NotAbsolute { .. }), "{err}");
            assert!(err.to_string().contains("must be absolute"), "{err}");
        }
    }

    #[test]
    fn a_file_in_the_way_is_an_error() {
        let tmp = tempfile::tempdir().unwrap();
        let file = tmp.path().join("file");
        std::fs::write(&file, b"x").unwrap();
        let err = resolve_copilot_home(Some(&file), None, tmp.path(), "a").unwrap_err();
        assert!(matches!(err, HomeError::Create { .. }), "{err}");
        assert!(err.to_string().contains("not a directory"), "{err}");
    }
}
