//! Where a path a caller names may lie: inside one of a list of roots (the daemon passes the
//! agent's own working directory and its `allowed_work_roots`, for a conversation's
//! directories and for a turn's attachments by path). A path is resolved
//! the way the kernel will resolve it (symlinks followed, `..` applied to what it reaches), so
//! no spelling of a path outside the roots passes: not `..`, not a symlink that points out,
//! not a dangling symlink whose target may appear later.
//!
//! A path may end in directories that do not exist yet (the agent's working directory is
//! created for its first turn): its existing part is resolved, and the missing rest must be
//! plain names. What someone with write access inside a root does after the check (replace
//! a directory by a symlink) is not prevented.

use std::io;
use std::path::{Component, Path, PathBuf};

/// Why a path was refused.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConfineError {
    /// A relative path.
    #[error("{field}: {path:?} must be an absolute path")]
    NotAbsolute {
        /// What named the path (`session.workingDirectory`, `attachments.0.path`).
        field: String,
        /// The path as given.
        path: PathBuf,
    },
    /// The path resolves outside every root.
    #[error(
        "{field}: {path:?} lies outside the agent's working directory and the \
         daemon's allowed_work_roots (symlinks and `..` are resolved first); use a directory \
         inside them, or add a root to allowed_work_roots in the daemon's config"
    )]
    Outside {
        /// What named the path.
        field: String,
        /// The path as given.
        path: PathBuf,
    },
    /// The path cannot be resolved (a dangling symlink, a `..` past a missing directory, a
    /// component that cannot be read).
    #[error(
        "{field}: {path:?} cannot be resolved ({why}); pass an existing directory, or \
         one whose missing part is plain names"
    )]
    Unresolvable {
        /// What named the path.
        field: String,
        /// The path as given.
        path: PathBuf,
        /// What failed.
        why: String,
    },
}

/// Resolves `path` (absolute) to the path the kernel would reach: its longest existing
/// ancestor canonicalized, followed by the missing rest, which must be plain names.
pub fn resolve(path: &Path) -> Result<PathBuf, String> {
    if !path.is_absolute() {
        return Err("not absolute".to_owned());
    }
    for existing in path.ancestors() {
        match std::fs::canonicalize(existing) {
            Ok(canonical) => {
                let rest = path
                    .strip_prefix(existing)
                    .map_err(|e| format!("internal: {e}"))?;
                let mut resolved = canonical;
                for (i, component) in rest.components().enumerate() {
                    let Component::Normal(name) = component else {
                        return Err("`..` past a directory that does not exist".to_owned());
                    };
                    // The first missing name could not be canonicalized: it must not exist in
                    // any form (a dangling symlink would be followed once its target appears).
                    if i == 0 && std::fs::symlink_metadata(resolved.join(name)).is_ok() {
                        return Err("a dangling symlink or an unreadable entry".to_owned());
                    }
                    resolved.push(name);
                }
                return Ok(resolved);
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => continue,
            Err(e) => return Err(e.to_string()),
        }
    }
    Err("no part of it exists".to_owned())
}

/// Checks that `path` (the option `field`) resolves inside one of `roots` (each resolved the
/// same way), and returns the resolved path: pass that on, not the spelling given.
pub fn confine(field: &str, path: &Path, roots: &[PathBuf]) -> Result<PathBuf, ConfineError> {
    if !path.is_absolute() {
        return Err(ConfineError::NotAbsolute {
            field: field.to_owned(),
            path: path.to_path_buf(),
        });
    }
    let resolved = resolve(path).map_err(|why| ConfineError::Unresolvable {
        field: field.to_owned(),
        path: path.to_path_buf(),
        why,
    })?;
    // `Path::starts_with` compares whole components: `/work2` is not under `/work`.
    let inside = roots
        .iter()
        .filter_map(|root| resolve(root).ok())
        .any(|root| resolved.starts_with(&root));
    if inside {
        Ok(resolved)
    } else {
        Err(ConfineError::Outside {
            field: field.to_owned(),
            path: path.to_path_buf(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::symlink;

    struct Layout {
        _dir: tempfile::TempDir,
        root: PathBuf,
        outside: PathBuf,
    }

    fn layout() -> Layout {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().join("root");
        let outside = dir.path().join("outside");
        std::fs::create_dir_all(root.join("project")).unwrap();
        std::fs::create_dir_all(&outside).unwrap();
        Layout {
            root,
            outside,
            _dir: dir,
        }
    }

    #[test]
    fn a_directory_inside_a_root_passes_resolved() {
        let l = layout();
        let roots = [l.root.clone()];
        let got = confine("workingDirectory", &l.root.join("project"), &roots).unwrap();
        assert_eq!(got, std::fs::canonicalize(l.root.join("project")).unwrap());
        // The root itself, and a missing directory below it (created later).
        assert!(confine("workingDirectory", &l.root, &roots).is_ok());
        let missing = confine("workingDirectory", &l.root.join("new/deeper"), &roots).unwrap();
        assert!(missing.ends_with("root/new/deeper"));
        // `..` that stays inside is fine.
        assert!(confine("w", &l.root.join("project/../project"), &roots).is_ok());
    }

    #[test]
    fn dot_dot_out_of_a_root_is_refused() {
        let l = layout();
        let roots = [l.root.clone()];
        let e = confine("workingDirectory", &l.root.join("../outside"), &roots).unwrap_err();
        assert!(matches!(e, ConfineError::Outside { .. }), "{e}");
        assert!(e.to_string().contains("allowed_work_roots"), "{e}");
        let e = confine("w", &l.root.join("missing/../../outside"), &roots).unwrap_err();
        assert!(matches!(e, ConfineError::Unresolvable { .. }), "{e}");
    }

    #[test]
    fn a_symlink_out_of_a_root_is_refused() {
        let l = layout();
        let roots = [l.root.clone()];
        symlink(&l.outside, l.root.join("escape")).unwrap();
        let e = confine(
            "session.additionalDirectories.0",
            &l.root.join("escape"),
            &roots,
        )
        .unwrap_err();
        assert!(matches!(e, ConfineError::Outside { .. }), "{e}");
        assert!(
            e.to_string()
                .starts_with("session.additionalDirectories.0:")
        );
        // Below the symlink, existing or not.
        assert!(confine("w", &l.root.join("escape/sub"), &roots).is_err());
        // A dangling symlink: its target could appear later, outside.
        symlink(l.outside.join("later"), l.root.join("dangling")).unwrap();
        let e = confine("w", &l.root.join("dangling"), &roots).unwrap_err();
        assert!(matches!(e, ConfineError::Unresolvable { .. }), "{e}");
        let e = confine("w", &l.root.join("dangling/sub"), &roots).unwrap_err();
        assert!(matches!(e, ConfineError::Unresolvable { .. }), "{e}");
    }

    #[test]
    fn a_symlink_into_a_root_passes_and_a_sibling_prefix_does_not() {
        let l = layout();
        let link = l.outside.join("to-project");
        symlink(l.root.join("project"), &link).unwrap();
        assert!(confine("w", &link, std::slice::from_ref(&l.root)).is_ok());
        let sibling = l.root.with_file_name("root2");
        std::fs::create_dir_all(&sibling).unwrap();
        assert!(confine("w", &sibling, std::slice::from_ref(&l.root)).is_err());
    }

    #[test]
    fn a_relative_path_or_no_root_is_refused() {
        let l = layout();
        let e = confine("w", Path::new("project"), std::slice::from_ref(&l.root)).unwrap_err();
        assert!(matches!(e, ConfineError::NotAbsolute { .. }), "{e}");
        assert!(confine("w", &l.root, &[]).is_err());
    }
}
