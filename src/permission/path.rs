//! Lexical path normalisation, for the permission rules and for an agent's directory
//! (`home`): `.` and empty components dropped, `..` resolved against the components before
//! it (never above `/`), relative paths taken against the conversation's working directory.
//! Nothing touches the file system, so symbolic links are not resolved.

use std::path::{Component, Path, PathBuf};

/// The absolute, lexically normal form of `path`, or `None` when it cannot be had: a relative
/// path without an absolute, UTF-8 working directory to take it against.
pub(crate) fn normalize(path: &str, working_directory: Option<&Path>) -> Option<String> {
    let absolute = if path.starts_with('/') {
        PathBuf::from(path)
    } else {
        let base = working_directory?;
        if !base.is_absolute() {
            return None;
        }
        base.join(path)
    };
    lexically_normal(&absolute)
        .into_os_string()
        .into_string()
        .ok()
}

/// `path` with `.` and empty components dropped and each `..` taking away the component
/// before it (never above the root), without looking at the file system.
pub(crate) fn lexically_normal(path: &Path) -> PathBuf {
    let mut normal = PathBuf::new();
    for component in path.components() {
        match component {
            Component::CurDir => {}
            Component::ParentDir => {
                normal.pop();
            }
            other => normal.push(other),
        }
    }
    normal
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn dots_and_empty_components_are_resolved() {
        let cases = [
            ("/", "/"),
            ("/srv/a/./b/../c.rs", "/srv/a/c.rs"),
            ("//srv//a/", "/srv/a"),
            ("/srv/../etc/shadow", "/etc/shadow"),
            ("/..", "/"),
            ("/../../etc", "/etc"),
            ("/srv/a/..", "/srv"),
            ("/srv/...", "/srv/..."),
            ("/srv/..a/.b", "/srv/..a/.b"),
        ];
        for (path, normal) in cases {
            assert_eq!(normalize(path, None).as_deref(), Some(normal), "{path}");
        }
    }

    #[test]
    fn relative_paths_are_taken_against_the_working_directory() {
        let cwd = Path::new("/work/repo");
        assert_eq!(
            normalize("src/main.rs", Some(cwd)).as_deref(),
            Some("/work/repo/src/main.rs")
        );
        assert_eq!(
            normalize("./a/../../other/x", Some(cwd)).as_deref(),
            Some("/work/other/x")
        );
        assert_eq!(
            normalize("..", Some(Path::new("/w/../x/y"))).as_deref(),
            Some("/x")
        );
        assert_eq!(normalize("", Some(cwd)).as_deref(), Some("/work/repo"));
        // Nothing absolute to take it against: no normal form.
        assert_eq!(normalize("src/main.rs", None), None);
        assert_eq!(normalize("src/main.rs", Some(Path::new("work"))), None);
        // An absolute path ignores the working directory.
        assert_eq!(normalize("/etc/x", Some(cwd)).as_deref(), Some("/etc/x"));
    }

    fn component() -> impl Strategy<Value = &'static str> {
        prop::sample::select(vec!["a", "b", "srv", "etc", ".", "..", "", "...", ".x"])
    }

    fn path() -> impl Strategy<Value = String> {
        (any::<bool>(), prop::collection::vec(component(), 0..10)).prop_map(|(absolute, parts)| {
            format!("{}{}", if absolute { "/" } else { "" }, parts.join("/"))
        })
    }

    proptest! {
        #[test]
        fn normalisation_is_idempotent_and_leaves_no_dot_components(
            path in path(),
            cwd in path().prop_map(|p| format!("/{p}")),
        ) {
            let cwd = Path::new(&cwd);
            let Some(normal) = normalize(&path, Some(cwd)) else {
                return Err(TestCaseError::fail("an absolute working directory always gives a normal form"));
            };
            prop_assert!(normal.starts_with('/'));
            prop_assert_eq!(normalize(&normal, None), Some(normal.clone()));
            prop_assert_eq!(normalize(&normal, Some(Path::new("/elsewhere"))), Some(normal.clone()));
            if normal != "/" {
                for part in normal[1..].split('/') {
                    prop_assert!(!matches!(part, "" | "." | ".."), "{normal}");
                }
            }
        }

        #[test]
        fn a_relative_path_is_the_same_as_the_joined_absolute_one(
            path in path().prop_map(|p| p.trim_start_matches('/').to_owned()),
            cwd in path().prop_map(|p| format!("/{p}")),
        ) {
            prop_assert_eq!(
                normalize(&path, Some(Path::new(&cwd))),
                normalize(&format!("{cwd}/{path}"), None)
            );
        }
    }
}
