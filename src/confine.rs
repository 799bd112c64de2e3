//! Where a path a caller names may lie: inside one of a list of roots (the daemon passes the
//! agent's own working directory and its `allowed_work_roots`, for a conversation's
//! directories and for a turn's attachments by path), and which session fields and which
//! attachments name paths (one list each, for the HTTP API and the SDK endpoint). A path is resolved
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

use serde_json::{Map, Value};

/// Session fields (the runtime's `session.create` names) naming one path the runtime works
/// in, reads or writes: its working directory, where it writes the session's event log, and
/// the file it writes a trajectory to.
const PATH_FIELDS: &[&str] = &["workingDirectory", "eventsLogDirectory", "trajectoryFile"];

/// Session fields naming directories the runtime reads (skills, plugins, agents and hooks
/// from there are code it runs).
const DIRECTORY_LIST_FIELDS: &[&str] = &[
    "additionalDirectories",
    "skillDirectories",
    "pluginDirectories",
    "instructionDirectories",
    "agentDirectories",
    "hookDirectories",
];

/// Paths inside a session field's object: the directory the runtime writes large tool
/// outputs to (`largeOutput.outputDir`, the SDKs' `outputDirectory` on the wire).
const NESTED_PATH_FIELDS: &[(&str, &str)] = &[("largeOutput", "outputDir")];

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
         daemon's allowed_work_roots (symlinks and `..` are resolved first); use a path \
         inside them, or add a root to allowed_work_roots in the daemon's config"
    )]
    Outside {
        /// What named the path.
        field: String,
        /// The path as given.
        path: PathBuf,
    },
    /// A directory field whose value is not a path (or, for a list, not a list of paths).
    #[error("{field} must be {expected}")]
    Shape {
        /// The field.
        field: String,
        /// What it must be.
        expected: &'static str,
    },
    /// The path cannot be resolved (a dangling symlink, a `..` past a missing directory, a
    /// component that cannot be read).
    #[error(
        "{field}: {path:?} cannot be resolved ({why}); pass an existing path, or one \
         whose missing part is plain names"
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
    resolve_reaching(path).map_err(|(why, _)| why)
}

/// [`resolve`], and on failure also where the resolution had got to (the deepest ancestor
/// that canonicalized, and the plain names after it), if anywhere: a failure there is
/// described only when that place lies inside a root, so a refusal cannot tell whether a
/// name exists in another agent's directory.
fn resolve_reaching(path: &Path) -> Result<PathBuf, (String, Option<PathBuf>)> {
    if !path.is_absolute() {
        return Err(("not absolute".to_owned(), None));
    }
    // A failure other than a missing name (a permission, a file where a directory was
    // named, a link loop): kept while the walk goes on to the place it got to.
    let mut failed: Option<String> = None;
    for existing in path.ancestors() {
        match std::fs::canonicalize(existing) {
            Ok(canonical) => {
                let rest = path
                    .strip_prefix(existing)
                    .map_err(|e| (format!("internal: {e}"), None))?;
                if let Some(why) = failed {
                    // Failed past a symlink: where it points, not here, is where it failed.
                    let reached = (!first_is_symlink(&canonical, rest)).then_some(canonical);
                    return Err((why, reached));
                }
                let mut resolved = canonical;
                for (i, component) in rest.components().enumerate() {
                    let Component::Normal(name) = component else {
                        return Err((
                            "`..` past a directory that does not exist".to_owned(),
                            Some(resolved),
                        ));
                    };
                    // The first missing name could not be canonicalized: it must not exist in
                    // any form (a dangling symlink would be followed once its target appears).
                    // Where it got to is unknown: its target may lie anywhere.
                    if i == 0 && std::fs::symlink_metadata(resolved.join(name)).is_ok() {
                        return Err(("a dangling symlink or an unreadable entry".to_owned(), None));
                    }
                    resolved.push(name);
                }
                return Ok(resolved);
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => continue,
            Err(e) => {
                failed.get_or_insert_with(|| e.to_string());
            }
        }
    }
    Err((
        failed.unwrap_or_else(|| "no part of it exists".to_owned()),
        None,
    ))
}

/// Whether the first name of `rest` is a symlink in `dir`.
fn first_is_symlink(dir: &Path, rest: &Path) -> bool {
    match rest.components().next() {
        Some(Component::Normal(name)) => std::fs::symlink_metadata(dir.join(name))
            .is_ok_and(|meta| meta.file_type().is_symlink()),
        _ => false,
    }
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
    let resolved_roots: Vec<PathBuf> = roots.iter().filter_map(|root| resolve(root).ok()).collect();
    let resolved = match resolve_reaching(path) {
        Ok(resolved) => resolved,
        // Why a path cannot be resolved is said only where the resolution got to inside a
        // root: elsewhere, a dangling symlink, `..` past a missing directory or a permission
        // error would tell a caller whether a name exists in another agent's directory (also
        // through a symlink inside a root that points there).
        Err((why, Some(reached)))
            if resolved_roots.iter().any(|root| reached.starts_with(root)) =>
        {
            return Err(ConfineError::Unresolvable {
                field: field.to_owned(),
                path: path.to_path_buf(),
                why,
            });
        }
        Err(_) => {
            return Err(ConfineError::Outside {
                field: field.to_owned(),
                path: path.to_path_buf(),
            });
        }
    };
    // `Path::starts_with` compares whole components: `/work2` is not under `/work`.
    let inside = resolved_roots.iter().any(|root| resolved.starts_with(root));
    if inside {
        Ok(resolved)
    } else {
        Err(ConfineError::Outside {
            field: field.to_owned(),
            path: path.to_path_buf(),
        })
    }
}

/// Whether a session's `fields` name any directory: confining them is file work, which a
/// caller may then move off its async threads.
pub fn names_directories(fields: &Map<String, Value>) -> bool {
    PATH_FIELDS
        .iter()
        .chain(DIRECTORY_LIST_FIELDS)
        .any(|name| fields.get(*name).is_some_and(|v| !v.is_null()))
        || NESTED_PATH_FIELDS
            .iter()
            .any(|(outer, inner)| nested(fields, outer, inner).is_some())
}

/// `fields[outer][inner]`, when set.
fn nested<'a>(fields: &'a Map<String, Value>, outer: &str, inner: &str) -> Option<&'a Value> {
    fields
        .get(outer)
        .and_then(|o| o.get(inner))
        .filter(|v| !v.is_null())
}

/// Confines every path a session's `fields` name (`workingDirectory`, `eventsLogDirectory`,
/// `trajectoryFile`, `largeOutput.outputDir`, `additionalDirectories`, skill, plugin,
/// instruction, agent and hook directories) with
/// [`confine`], and
/// replaces each by its resolved path, which is what the runtime must get. `prefix` goes
/// before each field's name in an error (`session.` where the fields are a request's
/// `session` object). The one list of those fields, for the HTTP API and the SDK endpoint.
pub fn confine_session_directories(
    fields: &mut Map<String, Value>,
    prefix: &str,
    roots: &[PathBuf],
) -> Result<(), ConfineError> {
    let confined = |field: String, dir: &Value| -> Result<Value, ConfineError> {
        let Some(dir) = dir.as_str() else {
            return Err(ConfineError::Shape {
                field,
                expected: "a directory's absolute path",
            });
        };
        let resolved = confine(&field, Path::new(dir), roots)?;
        Ok(Value::String(resolved.to_string_lossy().into_owned()))
    };
    for name in PATH_FIELDS {
        if let Some(dir) = fields.get(*name).filter(|v| !v.is_null()) {
            let resolved = confined(format!("{prefix}{name}"), dir)?;
            fields.insert((*name).to_owned(), resolved);
        }
    }
    for (outer, inner) in NESTED_PATH_FIELDS {
        if let Some(dir) = nested(fields, outer, inner) {
            let resolved = confined(format!("{prefix}{outer}.{inner}"), dir)?;
            if let Some(Value::Object(o)) = fields.get_mut(*outer) {
                o.insert((*inner).to_owned(), resolved);
            }
        }
    }
    for name in DIRECTORY_LIST_FIELDS {
        let Some(dirs) = fields.get(*name).filter(|v| !v.is_null()) else {
            continue;
        };
        let Some(dirs) = dirs.as_array() else {
            return Err(ConfineError::Shape {
                field: format!("{prefix}{name}"),
                expected: "an array of directories' absolute paths",
            });
        };
        let resolved = dirs
            .iter()
            .enumerate()
            .map(|(i, dir)| confined(format!("{prefix}{name}.{i}"), dir))
            .collect::<Result<Vec<_>, _>>()?;
        fields.insert((*name).to_owned(), Value::Array(resolved));
    }
    Ok(())
}

/// Confines the local paths a message's `attachments` name, as the runtime's `session.send`
/// takes them (a `file`'s or a `directory`'s `path`, a `selection`'s `filePath`: absolute),
/// with [`confine`], and replaces each by its resolved path. Other attachments (GitHub
/// references, blobs, extension context) name no local path and pass as they are.
pub fn confine_attachment_paths(
    params: &mut Map<String, Value>,
    roots: &[PathBuf],
) -> Result<(), ConfineError> {
    let Some(attachments) = params.get_mut("attachments").filter(|v| !v.is_null()) else {
        return Ok(());
    };
    let Some(attachments) = attachments.as_array_mut() else {
        return Err(ConfineError::Shape {
            field: "attachments".to_owned(),
            expected: "an array of attachments",
        });
    };
    for (i, attachment) in attachments.iter_mut().enumerate() {
        let Some(attachment) = attachment.as_object_mut() else {
            return Err(ConfineError::Shape {
                field: format!("attachments.{i}"),
                expected: "an attachment object",
            });
        };
        let name = match attachment.get("type").and_then(Value::as_str) {
            Some("file" | "directory") => "path",
            Some("selection") => "filePath",
            _ => continue,
        };
        let field = format!("attachments.{i}.{name}");
        let Some(path) = attachment.get(name).filter(|v| !v.is_null()) else {
            continue;
        };
        let Some(path) = path.as_str() else {
            return Err(ConfineError::Shape {
                field,
                expected: "a file's or a directory's path",
            });
        };
        let resolved = confine(&field, Path::new(path), roots)?;
        attachment.insert(
            name.to_owned(),
            Value::String(resolved.to_string_lossy().into_owned()),
        );
    }
    Ok(())
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
    fn a_messages_attachments_by_path_are_confined_and_the_others_pass() {
        let l = layout();
        let roots = [l.root.clone()];
        let project = std::fs::canonicalize(l.root.join("project")).unwrap();
        let mut params = serde_json::json!({"attachments": [
            {"type": "file", "path": l.root.join("project/notes.md")},
            {"type": "selection", "filePath": l.root.join("project/../project/a.rs")},
            {"type": "github_reference", "number": 1, "url": "/etc/passwd"},
            {"type": "blob", "data": "aGk="},
        ]});
        let fields = params.as_object_mut().unwrap();
        confine_attachment_paths(fields, &roots).unwrap();
        assert_eq!(
            fields["attachments"][0]["path"],
            project.join("notes.md").to_string_lossy().as_ref()
        );
        assert_eq!(
            fields["attachments"][1]["filePath"],
            project.join("a.rs").to_string_lossy().as_ref()
        );
        assert_eq!(
            fields["attachments"][2]["url"], "/etc/passwd",
            "no local path"
        );
        let refused = |params: serde_json::Value| {
            let mut params = params;
            let fields = params.as_object_mut().unwrap();
            confine_attachment_paths(fields, &roots)
                .unwrap_err()
                .to_string()
        };
        let outside = l.outside.join("x");
        let e = refused(serde_json::json!({"attachments": [
            {"type": "file", "path": l.root.join("project/x")},
            {"type": "directory", "path": outside},
        ]}));
        assert!(e.starts_with("attachments.1.path:"), "{e}");
        assert!(e.contains("allowed_work_roots"), "{e}");
        let e =
            refused(serde_json::json!({"attachments": [{"type": "file", "path": "../outside"}]}));
        assert!(e.starts_with("attachments.0.path:"), "{e}");
        assert!(e.contains("must be an absolute path"), "{e}");
        let e = refused(serde_json::json!({"attachments": "x"}));
        assert_eq!(e, "attachments must be an array of attachments");
        let e = refused(serde_json::json!({"attachments": [1]}));
        assert_eq!(e, "attachments.0 must be an attachment object");
        let e = refused(serde_json::json!({"attachments": [{"type": "file", "path": 5}]}));
        assert_eq!(
            e,
            "attachments.0.path must be a file's or a directory's path"
        );
    }

    #[test]
    fn every_directory_a_session_names_is_confined_and_passed_on_resolved() {
        let l = layout();
        let roots = [l.root.clone()];
        let inside = l
            .root
            .join("project/../project")
            .to_string_lossy()
            .into_owned();
        let resolved = std::fs::canonicalize(l.root.join("project")).unwrap();
        let resolved = Value::String(resolved.to_string_lossy().into_owned());
        let outside = l.outside.to_string_lossy().into_owned();
        let mut fields = Map::new();
        fields.insert("workingDirectory".into(), inside.clone().into());
        fields.insert("model".into(), outside.clone().into());
        for name in DIRECTORY_LIST_FIELDS {
            fields.insert((*name).into(), Value::from(vec![inside.clone()]));
        }
        assert!(names_directories(&fields));
        confine_session_directories(&mut fields, "session.", &roots).unwrap();
        assert_eq!(fields["workingDirectory"], resolved);
        for name in DIRECTORY_LIST_FIELDS {
            assert_eq!(fields[*name], Value::from(vec![resolved.clone()]), "{name}");
        }
        // Not a directory field: left as it is.
        assert_eq!(fields["model"], Value::String(outside.clone()));
        // Each list field is confined, its entry named by index.
        for name in DIRECTORY_LIST_FIELDS {
            let mut fields = Map::new();
            fields.insert(
                (*name).into(),
                Value::from(vec![inside.clone(), outside.clone()]),
            );
            let e = confine_session_directories(&mut fields, "session.", &roots).unwrap_err();
            assert!(matches!(e, ConfineError::Outside { .. }), "{e}");
            assert!(
                e.to_string().starts_with(&format!("session.{name}.1:")),
                "{e}"
            );
        }
        // A path inside a field's object: confined, resolved, its siblings kept.
        let mut fields = Map::new();
        fields.insert(
            "largeOutput".into(),
            serde_json::json!({"enabled": true, "outputDir": inside.clone()}),
        );
        assert!(names_directories(&fields));
        confine_session_directories(&mut fields, "", &roots).unwrap();
        assert_eq!(
            fields["largeOutput"],
            serde_json::json!({"enabled": true, "outputDir": resolved.clone()})
        );
        fields.insert(
            "largeOutput".into(),
            serde_json::json!({"outputDir": outside.clone()}),
        );
        let e = confine_session_directories(&mut fields, "", &roots).unwrap_err();
        assert!(e.to_string().starts_with("largeOutput.outputDir:"), "{e}");
        // A value of the wrong shape is refused by name, never passed on.
        let mut fields = Map::new();
        fields.insert("skillDirectories".into(), outside.clone().into());
        let e = confine_session_directories(&mut fields, "", &roots).unwrap_err();
        assert_eq!(
            e.to_string(),
            "skillDirectories must be an array of directories' absolute paths"
        );
        let mut fields = Map::new();
        fields.insert("workingDirectory".into(), Value::from(7));
        let e = confine_session_directories(&mut fields, "", &roots).unwrap_err();
        assert!(matches!(e, ConfineError::Shape { .. }), "{e}");
        // Nothing named (a null is nothing): no file work needed.
        let mut fields = Map::new();
        fields.insert("workingDirectory".into(), Value::Null);
        assert!(!names_directories(&fields));
        confine_session_directories(&mut fields, "", &roots).unwrap();
    }

    #[test]
    fn dot_dot_out_of_a_root_is_refused() {
        let l = layout();
        let roots = [l.root.clone()];
        let e = confine("workingDirectory", &l.root.join("../outside"), &roots).unwrap_err();
        assert!(matches!(e, ConfineError::Outside { .. }), "{e}");
        assert!(e.to_string().contains("allowed_work_roots"), "{e}");
        // Inside a root, why it cannot be resolved is said.
        let e = confine("w", &l.root.join("missing/../../outside"), &roots).unwrap_err();
        assert!(matches!(e, ConfineError::Unresolvable { .. }), "{e}");
        let e = confine("w", &l.root.join("missing/../project"), &roots).unwrap_err();
        assert!(matches!(e, ConfineError::Unresolvable { .. }), "{e}");
    }

    #[test]
    fn a_path_outside_every_root_is_refused_alike_whether_or_not_its_names_exist() {
        // Another agent's directory: whether a name exists there must not show in the refusal.
        let l = layout();
        let roots = [l.root.clone()];
        std::fs::create_dir_all(l.outside.join("exists")).unwrap();
        symlink(l.outside.join("later"), l.outside.join("dangling")).unwrap();
        std::fs::write(l.outside.join("file"), "x").unwrap();
        std::fs::create_dir_all(l.outside.join("closed")).unwrap();
        // Named directly, or through a symlink inside the root that points there.
        symlink(&l.outside, l.root.join("link")).unwrap();
        for base in [l.outside.clone(), l.root.join("link")] {
            let refusals: Vec<String> = [
                "exists/..",
                "missing/..",
                "dangling",
                "dangling/sub",
                "exists",
                "file/sub",
            ]
            .into_iter()
            .map(|probe| {
                let path = base.join(probe);
                let e = confine("w", &path, &roots).unwrap_err();
                assert!(matches!(e, ConfineError::Outside { .. }), "{probe}: {e}");
                e.to_string().replace(&*path.to_string_lossy(), "<probe>")
            })
            .collect();
            assert!(
                refusals.windows(2).all(|pair| pair[0] == pair[1]),
                "{refusals:#?}"
            );
        }
        // A symlink the agent makes in its root, probing a name outside: a missing target, a
        // file where a directory is named, one in a directory it may not read. Each refused
        // as the same symlink to an existing directory is.
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(
            l.outside.join("closed"),
            std::fs::Permissions::from_mode(0o000),
        )
        .unwrap();
        let probes = [
            l.outside.join("exists"),
            l.outside.join("missing"),
            l.outside.join("file/sub"),
            l.outside.join("closed/x"),
        ];
        let refusals: Vec<String> = probes
            .iter()
            .enumerate()
            .map(|(i, target)| {
                let link = l.root.join(format!("probe{i}"));
                symlink(target, &link).unwrap();
                let e = confine("w", &link, &roots).unwrap_err();
                assert!(matches!(e, ConfineError::Outside { .. }), "{target:?}: {e}");
                e.to_string().replace(&*link.to_string_lossy(), "<probe>")
            })
            .collect();
        std::fs::set_permissions(
            l.outside.join("closed"),
            std::fs::Permissions::from_mode(0o700),
        )
        .unwrap();
        assert!(
            refusals.windows(2).all(|pair| pair[0] == pair[1]),
            "{refusals:#?}"
        );
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
        // A dangling symlink: its target could appear later, outside. Refused as outside:
        // whether its target exists is not said.
        symlink(l.outside.join("later"), l.root.join("dangling")).unwrap();
        let e = confine("w", &l.root.join("dangling"), &roots).unwrap_err();
        assert!(matches!(e, ConfineError::Outside { .. }), "{e}");
        let e = confine("w", &l.root.join("dangling/sub"), &roots).unwrap_err();
        assert!(matches!(e, ConfineError::Outside { .. }), "{e}");
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
