//! A turn's attachments over HTTP. Files and directories by path must lie inside the agent's
//! work directory or under one of the daemon's `allowed_work_roots` once every symbolic link
//! and `..` is resolved (the runtime is given the resolved path). Inline content is base64,
//! at most [`AttachmentLimits::max_bytes`] decoded, of a media type in
//! [`AttachmentLimits::media_types`], and is written into the conversation's directory
//! `<work>/attachments/<hash of its key>/` (0600) and attached as that file, until the
//! conversation is deleted. Everything is checked before anything is written. A CLI backend's
//! turn takes images only ([`images_only`]), which its runner passes to the CLI.

use std::path::{Path, PathBuf};

use axum::http::StatusCode;
use axum::response::Response;
use base64::Engine;
use serde::Deserialize;

use super::error::error;
use crate::ids::ConversationId;
use crate::media_type::essence;
use crate::rpc::messages::{Attachment, LineRange};

/// Attachments one turn may carry.
pub(super) const MAX_ATTACHMENTS: usize = 32;

/// Where inline content is written, inside the agent's work directory.
const INLINE_DIR: &str = "attachments";

/// The media types accepted inline by default, with the file extension their content is
/// written under (the runtime tells an image by its extension).
const KNOWN_MEDIA_TYPES: &[(&str, &str)] = &[
    ("image/png", "png"),
    ("image/jpeg", "jpg"),
    ("image/gif", "gif"),
    ("image/webp", "webp"),
    ("text/plain", "txt"),
    ("text/markdown", "md"),
    ("text/csv", "csv"),
    ("application/json", "json"),
];

/// Limits of inline attachments.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct AttachmentLimits {
    /// Largest decoded inline attachment, in bytes (the request body must fit in
    /// `max_body_bytes` too; base64 is 4/3 of the size).
    pub max_bytes: usize,
    /// Media types accepted inline (lowercase, without parameters).
    pub media_types: Vec<String>,
    /// The inline attachments one conversation keeps at most, in bytes: they stay until the
    /// conversation is deleted, so a turn whose inline content would take the conversation
    /// past this is refused (413 `too_large`) before anything of it is written.
    pub max_conversation_bytes: u64,
}

impl Default for AttachmentLimits {
    /// 512 KiB; PNG, JPEG, GIF and WebP images, plain text, Markdown, CSV and JSON; 64 MiB
    /// a conversation.
    fn default() -> Self {
        Self {
            max_conversation_bytes: 64 << 20,
            max_bytes: 512 * 1024,
            media_types: KNOWN_MEDIA_TYPES
                .iter()
                .map(|(t, _)| (*t).to_owned())
                .collect(),
        }
    }
}

/// One attachment of a `POST /v1/turns` body.
#[derive(Debug, Deserialize, utoipa::ToSchema)]
#[serde(tag = "type", rename_all = "snake_case", deny_unknown_fields)]
pub(super) enum AttachmentBody {
    /// A file by path (relative paths are taken against the conversation's working
    /// directory: its `session.workingDirectory`, else the agent's work directory).
    File {
        #[schema(value_type = String)]
        path: PathBuf,
        #[serde(default)]
        display_name: Option<String>,
        #[serde(default, deserialize_with = "super::object::optional")]
        line_range: Option<LineRange>,
    },
    /// A directory by path.
    Directory {
        #[schema(value_type = String)]
        path: PathBuf,
        #[serde(default)]
        display_name: Option<String>,
    },
    /// Content in the body, base64.
    Inline {
        data: String,
        media_type: String,
        #[serde(default)]
        name: Option<String>,
    },
}

/// Attachments checked and decoded, nothing written yet, with the most inline content their
/// conversation may keep ([`AttachmentLimits::max_conversation_bytes`]).
#[derive(Debug, Default)]
pub(super) struct Checked {
    items: Vec<Item>,
    max_conversation_bytes: u64,
}

/// Why a turn's inline contents were not written.
#[derive(Debug)]
pub(super) enum WriteError {
    /// They would take the conversation's inline attachments past their limit.
    OverLimit {
        /// What the conversation keeps now, in bytes.
        kept: u64,
        /// What the turn adds.
        adding: u64,
        /// [`AttachmentLimits::max_conversation_bytes`].
        limit: u64,
    },
    /// The file system refused.
    Io(std::io::Error),
}

impl From<std::io::Error> for WriteError {
    fn from(e: std::io::Error) -> Self {
        WriteError::Io(e)
    }
}

#[derive(Debug)]
enum Item {
    /// A file or directory by its resolved path.
    Ready(Attachment),
    /// Content to write into the work directory first.
    Inline {
        bytes: Vec<u8>,
        file_name: String,
        display_name: String,
    },
}

/// Refuses what a CLI backend's turn does not take: every attachment must be an image, a
/// whole file named as one (`.png`, `.jpg`, `.jpeg`, `.gif`, `.webp`) or inline content of
/// an image media type. The error names the first other one and says what to do.
pub(super) fn images_only(list: &[AttachmentBody]) -> Result<(), String> {
    use crate::backend::image::{is_image_media_type, media_type_of};
    for (i, body) in list.iter().enumerate() {
        let what = match body {
            AttachmentBody::File {
                line_range: Some(_),
                ..
            } => "a line range of a file".to_owned(),
            AttachmentBody::File { path, .. } if media_type_of(path).is_none() => {
                format!("file {}, not an image by its name", path.display())
            }
            AttachmentBody::File { .. } => continue,
            AttachmentBody::Directory { path, .. } => format!("directory {}", path.display()),
            AttachmentBody::Inline { media_type, .. } => {
                let media_type = essence(media_type);
                if is_image_media_type(&media_type) {
                    continue;
                }
                format!("inline {media_type}")
            }
        };
        return Err(format!(
            "attachments[{i}] ({what}) is not offered to CLI backends: they take images only \
             (PNG, JPEG, GIF or WebP files by path, or inline with an image media_type)"
        ));
    }
    Ok(())
}

/// Checks `list` against the roots (the agent's `work` directory and `allowed_roots`) and
/// `limits`, resolving paths on the file system. The error names the attachment and says
/// what to change.
pub(super) fn check(
    list: Vec<AttachmentBody>,
    work: &Path,
    allowed_roots: &[PathBuf],
    limits: &AttachmentLimits,
) -> Result<Checked, String> {
    if list.len() > MAX_ATTACHMENTS {
        return Err(format!(
            "at most {MAX_ATTACHMENTS} attachments per turn ({} given)",
            list.len()
        ));
    }
    // Roots that do not exist (yet) hold nothing.
    let roots: Vec<PathBuf> = std::iter::once(work)
        .chain(allowed_roots.iter().map(PathBuf::as_path))
        .filter_map(|r| std::fs::canonicalize(r).ok())
        .collect();
    list.into_iter()
        .enumerate()
        .map(|(i, body)| {
            check_one(body, work, &roots, limits).map_err(|e| format!("attachments[{i}]: {e}"))
        })
        .collect::<Result<Vec<_>, _>>()
        .map(|items| Checked {
            items,
            max_conversation_bytes: limits.max_conversation_bytes,
        })
}

fn check_one(
    body: AttachmentBody,
    work: &Path,
    roots: &[PathBuf],
    limits: &AttachmentLimits,
) -> Result<Item, String> {
    match body {
        AttachmentBody::File {
            path,
            display_name,
            line_range,
        } => {
            let resolved = confine(&path, work, roots)?;
            if !resolved.is_file() {
                return Err(format!("{} is not a file", path.display()));
            }
            if let Some(LineRange { start, end }) = line_range
                && (start == 0 || end < start)
            {
                return Err(format!(
                    "line_range {start}..{end}: lines are 1-based and start <= end"
                ));
            }
            Ok(Item::Ready(Attachment::File {
                display_name: display_name.unwrap_or_else(|| file_name_of(&resolved)),
                path: utf8(resolved)?,
                line_range,
            }))
        }
        AttachmentBody::Directory { path, display_name } => {
            let resolved = confine(&path, work, roots)?;
            if !resolved.is_dir() {
                return Err(format!("{} is not a directory", path.display()));
            }
            Ok(Item::Ready(Attachment::Directory {
                display_name: display_name.unwrap_or_else(|| file_name_of(&resolved)),
                path: utf8(resolved)?,
            }))
        }
        AttachmentBody::Inline {
            data,
            media_type,
            name,
        } => {
            let media_type = essence(&media_type);
            if !limits.media_types.contains(&media_type) {
                return Err(format!(
                    "media_type {media_type:?} is not accepted; use one of {} (the daemon's \
                     [attachments] media_types)",
                    limits.media_types.join(", ")
                ));
            }
            // At most 4 base64 characters per 3 bytes: refuse before decoding.
            if data.len() / 4 * 3 > limits.max_bytes + 2 {
                return Err(too_large(limits));
            }
            let bytes = base64::engine::general_purpose::STANDARD
                .decode(data.trim())
                .map_err(|e| format!("data is not valid base64 ({e})"))?;
            if bytes.len() > limits.max_bytes {
                return Err(too_large(limits));
            }
            let display_name = name.clone().unwrap_or_else(|| "attachment".to_owned());
            Ok(Item::Inline {
                bytes,
                file_name: inline_file_name(name.as_deref(), &media_type),
                display_name,
            })
        }
    }
}

fn too_large(limits: &AttachmentLimits) -> String {
    format!(
        "inline content is larger than {} bytes (the daemon's [attachments] max_bytes)",
        limits.max_bytes
    )
}

/// `path` (relative ones against `work`) with every link and `..` resolved, if it lies in
/// one of `roots` (the one confinement of the crate, [`crate::confine`]).
fn confine(path: &Path, work: &Path, roots: &[PathBuf]) -> Result<PathBuf, String> {
    crate::confine::confine("path", &work.join(path), roots).map_err(|e| e.to_string())
}

fn utf8(path: PathBuf) -> Result<String, String> {
    path.into_os_string()
        .into_string()
        .map_err(|p| format!("{} is not UTF-8; rename it", PathBuf::from(p).display()))
}

fn file_name_of(path: &Path) -> String {
    path.file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| path.display().to_string())
}

/// `<uuid>-<name>` with the name cut to safe characters, ending in the media type's
/// extension.
fn inline_file_name(name: Option<&str>, media_type: &str) -> String {
    let base = name
        .map(|n| n.rsplit(['/', '\\']).next().unwrap_or_default())
        .unwrap_or_default();
    let mut safe: String = base
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || matches!(c, '.' | '-' | '_') {
                c
            } else {
                '_'
            }
        })
        .take(64)
        .collect::<String>()
        .trim_start_matches('.')
        .to_owned();
    if safe.is_empty() {
        safe = "attachment".to_owned();
    }
    if let Some((_, ext)) = KNOWN_MEDIA_TYPES.iter().find(|(t, _)| *t == media_type)
        && !safe.to_ascii_lowercase().ends_with(&format!(".{ext}"))
    {
        safe = format!("{safe}.{ext}");
    }
    format!("{}-{safe}", uuid::Uuid::new_v4())
}

/// The directories a turn's working directory may lie in (the agent's own work directory,
/// the daemon's `allowed_work_roots`), below which inline attachments are written without
/// following a link.
pub(super) fn work_roots(state: &super::AppState, agent_id: &str) -> Vec<PathBuf> {
    match crate::home::work_dir(&state.pool.config().agents_base_dir, agent_id) {
        Ok(work) => crate::home::conversation_roots(work, &state.config.allowed_work_roots),
        Err(_) => state.config.allowed_work_roots.clone(),
    }
}

/// Where a conversation's inline contents go, below its working directory:
/// `attachments/<SHA-256 of the conversation's key>/` (`<agent>/<session key>`: any key
/// makes a safe name, and two agents sharing a work root and a key do not share it), so
/// they are removed with the conversation ([`remove_conversation_files`]). They must
/// outlive the turn: the runtime embeds an image in the conversation, but names a text file
/// only by its path (`<tagged_files>`), for the model to read when it wants to, in a later
/// turn too. One directory for every backend of the conversation (a fallback's turn is
/// given the files its first backend's were).
fn conversation_dir(conversation: &ConversationId) -> PathBuf {
    Path::new(INLINE_DIR).join(crate::ids::sha256_hex(&conversation.key()))
}

/// `work` as a directory the pool resolved and a relative path below it: the one of `roots`
/// holding it (the agent's work directory, `allowed_work_roots`), below which nothing is
/// followed through a link (the agent's processes may write there and could swap a
/// directory on the way for a link elsewhere: `agent_files`). A root that is itself a link
/// (an operator's `allowed_work_roots` entry: the agent's own work directory is no root
/// when a link is in its place, `home::conversation_roots`) is followed once, to what it
/// points to; nothing below it is.
pub(super) fn root_and_below(work: &Path, roots: &[PathBuf]) -> (PathBuf, PathBuf) {
    // The roots as the confinement resolved the working directory (the folders above each
    // resolved; its last component kept, so a link there is still refused below), and a
    // root that is a link as what it points to.
    let resolved: Vec<PathBuf> = roots
        .iter()
        .map(|root| match (root.parent(), root.file_name()) {
            (Some(parent), Some(name)) => std::fs::canonicalize(parent)
                .map(|p| p.join(name))
                .unwrap_or_else(|_| root.clone()),
            _ => root.clone(),
        })
        .flat_map(|root| {
            let is_link = std::fs::symlink_metadata(&root).is_ok_and(|m| m.is_symlink());
            let target = is_link.then(|| std::fs::canonicalize(&root).ok()).flatten();
            std::iter::once(root).chain(target)
        })
        .collect();
    resolved
        .iter()
        .chain(roots)
        .filter_map(|root| Some((root.as_path(), work.strip_prefix(root).ok()?)))
        .max_by_key(|(root, _)| root.as_os_str().len())
        .map_or_else(
            || (work.to_path_buf(), PathBuf::new()),
            |(root, below)| (root.to_path_buf(), below.to_path_buf()),
        )
}

/// Writes the inline contents into the conversation's directory ([`conversation_dir`];
/// 0700, files 0600, never over an existing file) and returns the runtime's attachments, in
/// the body's order. Nothing is written when they would take what the conversation keeps
/// there past its limit (run while its lease is held: no other turn of it writes meanwhile).
pub(super) fn write(
    checked: Checked,
    work: &Path,
    roots: &[PathBuf],
    conversation: &ConversationId,
) -> Result<Vec<Attachment>, WriteError> {
    let (root, below) = root_and_below(work, roots);
    let dir = below.join(conversation_dir(conversation));
    let adding: u64 = checked
        .items
        .iter()
        .map(|item| match item {
            Item::Inline { bytes, .. } => bytes.len() as u64,
            Item::Ready(_) => 0,
        })
        .sum();
    if adding > 0 {
        let limit = checked.max_conversation_bytes;
        // A directory too crowded to list is over any limit.
        let kept = match crate::agent_files::flat_dir_bytes(&root, &dir) {
            Ok(kept) => kept,
            Err(e) if e.kind() == std::io::ErrorKind::InvalidData => u64::MAX,
            Err(e) => return Err(e.into()),
        };
        if kept.saturating_add(adding) > limit {
            return Err(WriteError::OverLimit {
                kept,
                adding,
                limit,
            });
        }
    }
    let mut out = Vec::with_capacity(checked.items.len());
    for item in checked.items {
        match item {
            Item::Ready(attachment) => out.push(attachment),
            Item::Inline {
                bytes,
                file_name,
                display_name,
            } => {
                crate::agent_files::create_dirs(&root, &dir, 0o700)?;
                let rel = dir.join(file_name);
                crate::agent_files::create_new(&root, &rel, &bytes, 0o600)?;
                let path = std::fs::canonicalize(&root)?.join(rel);
                out.push(Attachment::File {
                    path: utf8(path).map_err(std::io::Error::other)?,
                    display_name,
                    line_range: None,
                });
            }
        }
    }
    Ok(out)
}

/// Removes the inline contents of `conversation`, run in `work` (as its deletion asks:
/// the compatibility check makes it the directory its turns ran in), unless another backend
/// still stores the conversation. Call it while the conversation's lease is held, so no
/// turn writes there meanwhile. A failure is logged: the deletion goes on either way.
pub(super) async fn remove_conversation_files(
    state: &super::AppState,
    work: PathBuf,
    conversation: &ConversationId,
    backend: &str,
) {
    let roots = work_roots(state, &conversation.agent_id);
    let pool = state.pool.clone();
    let conversation = conversation.clone();
    let backend = backend.to_owned();
    // The bindings' lookups and the removal: file work, off the async threads.
    let removed = tokio::task::spawn_blocking(move || {
        if pool.stored_on_another_backend(&conversation, &backend)? {
            return Ok(None);
        }
        // Under none of the roots now (its root taken out of allowed_work_roots, or the
        // agent's home a deletion fell back to): the pool follows nothing there.
        if crate::confine::confine("workingDirectory", &work, &roots).is_err() {
            let left = std::fs::symlink_metadata(work.join(conversation_dir(&conversation)));
            return Ok(Some(Removal::Outside(work, left.is_ok())));
        }
        let (root, below) = root_and_below(&work, &roots);
        let dir = below.join(conversation_dir(&conversation));
        let all = crate::agent_files::remove_flat_dir(&root, &dir)
            .map_err(|e| crate::pool::PoolError::Internal(e.to_string()))?;
        Ok::<_, crate::pool::PoolError>(Some(Removal::Done(all, root.join(dir))))
    })
    .await;
    match removed {
        // Another backend keeps the conversation, and its files with it.
        Ok(Ok(None | Some(Removal::Done(true, _)))) => {}
        Ok(Ok(Some(Removal::Outside(_, false)))) => {}
        // The pool touches nothing outside the agents' roots, not even what it wrote there.
        Ok(Ok(Some(Removal::Outside(work, true)))) => tracing::warn!(
            dir = %work.display(),
            "A deleted conversation's working directory lies outside the agent's work \
             directory and allowed_work_roots now; its inline attachments there are left."
        ),
        Ok(Ok(Some(Removal::Done(false, dir)))) => tracing::warn!(
            dir = %dir.display(),
            "A deleted conversation's attachments directory holds a directory the pool did \
             not write; its files were removed, the directory was left."
        ),
        Ok(Err(error)) => tracing::warn!(
            %error,
            "Could not remove a deleted conversation's inline attachments; they are left."
        ),
        Err(error) => tracing::warn!(%error, "The removal of inline attachments failed."),
    }
}

/// What the removal of a conversation's attachments did.
enum Removal {
    /// Done: whether everything went (else a directory the pool did not write stayed), and
    /// the directory.
    Done(bool, PathBuf),
    /// Nothing: the working directory lies under none of the roots; whether the
    /// conversation's attachments directory is there (left).
    Outside(PathBuf, bool),
}

/// [`check`] off the async threads; a refusal is a 400.
pub(super) async fn check_off_thread(
    list: Vec<AttachmentBody>,
    work: PathBuf,
    allowed_roots: Vec<PathBuf>,
    limits: AttachmentLimits,
) -> Result<Checked, Response> {
    if list.is_empty() {
        return Ok(Checked::default());
    }
    match tokio::task::spawn_blocking(move || check(list, &work, &allowed_roots, &limits)).await {
        Ok(Ok(checked)) => Ok(checked),
        Ok(Err(message)) => Err(error(StatusCode::BAD_REQUEST, "bad_request", message)),
        Err(e) => Err(error(
            StatusCode::INTERNAL_SERVER_ERROR,
            "internal",
            e.to_string(),
        )),
    }
}

/// [`write`] off the async threads: past the conversation's limit a 413, another failure a
/// 500 naming the directory.
pub(super) async fn write_off_thread(
    checked: Checked,
    work: PathBuf,
    roots: Vec<PathBuf>,
    conversation: &ConversationId,
) -> Result<Vec<Attachment>, Response> {
    if checked.items.is_empty() {
        return Ok(Vec::new());
    }
    let dir = work.join(conversation_dir(conversation));
    let key = conversation.key();
    let conversation = conversation.clone();
    match tokio::task::spawn_blocking(move || write(checked, &work, &roots, &conversation)).await {
        Ok(Ok(list)) => Ok(list),
        Ok(Err(WriteError::OverLimit {
            kept,
            adding,
            limit,
        })) => Err(error(
            StatusCode::PAYLOAD_TOO_LARGE,
            "too_large",
            format!(
                "conversation {key:?} keeps {kept} bytes of inline attachments and this turn \
                 adds {adding}, over the {limit} one conversation may keep (the daemon's \
                 [attachments] max_conversation_bytes): attach files by path instead, or \
                 delete the conversation (DELETE /v1/sessions/<agent>/<key>) to start over"
            ),
        )),
        // What agent_files refuses to go through: a link or a file where a directory of
        // the pool's should be.
        Ok(Err(WriteError::Io(e))) if e.kind() == std::io::ErrorKind::InvalidInput => Err(error(
            StatusCode::INTERNAL_SERVER_ERROR,
            "io",
            format!(
                "could not write an inline attachment into {}: {e}; something the pool \
                     does not follow is in the way (the agent's processes may have put a link \
                     there): remove it",
                dir.display()
            ),
        )),
        Ok(Err(WriteError::Io(e))) => Err(error(
            StatusCode::INTERNAL_SERVER_ERROR,
            "io",
            format!(
                "could not write an inline attachment into {}: {e}; check that the directory \
                 is writable and the disk has room",
                dir.display()
            ),
        )),
        Err(e) => Err(error(
            StatusCode::INTERNAL_SERVER_ERROR,
            "internal",
            e.to_string(),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn conv() -> ConversationId {
        ConversationId::new("agent-a", "conv")
    }

    fn inline(data: &str, media_type: &str, name: Option<&str>) -> AttachmentBody {
        AttachmentBody::Inline {
            data: data.into(),
            media_type: media_type.into(),
            name: name.map(str::to_owned),
        }
    }

    fn file(path: impl Into<PathBuf>) -> AttachmentBody {
        AttachmentBody::File {
            path: path.into(),
            display_name: None,
            line_range: None,
        }
    }

    #[test]
    fn a_cli_turn_takes_image_files_and_inline_images_only() {
        assert!(
            images_only(&[
                file("a.PNG"),
                file("/w/b.jpeg"),
                inline("AA==", "Image/WebP; q=1", None)
            ])
            .is_ok()
        );
        let refused = [
            (file("notes.md"), "file notes.md, not an image"),
            (
                AttachmentBody::File {
                    path: "a.png".into(),
                    display_name: None,
                    line_range: Some(LineRange { start: 1, end: 1 }),
                },
                "a line range",
            ),
            (
                AttachmentBody::Directory {
                    path: "src".into(),
                    display_name: None,
                },
                "directory src",
            ),
            (inline("AA==", "text/plain", None), "inline text/plain"),
        ];
        for (body, needle) in refused {
            let error = images_only(&[file("a.png"), body]).expect_err("refused");
            assert!(error.starts_with("attachments[1] ("), "{error}");
            assert!(error.contains(needle), "{error}");
            assert!(error.contains("they take images only"), "{error}");
        }
    }

    #[test]
    fn paths_must_resolve_inside_the_work_directory_or_an_allowed_root() {
        let tmp = tempfile::tempdir().expect("tempdir");
        let work = tmp.path().join("work");
        let shared = tmp.path().join("shared");
        let outside = tmp.path().join("outside");
        for dir in [&work, &shared, &outside] {
            std::fs::create_dir_all(dir).expect("mkdir");
        }
        std::fs::write(work.join("in.txt"), "in").expect("write");
        std::fs::write(shared.join("doc.md"), "doc").expect("write");
        std::fs::write(outside.join("secret.txt"), "no").expect("write");
        std::os::unix::fs::symlink(outside.join("secret.txt"), work.join("link.txt"))
            .expect("symlink");
        let limits = AttachmentLimits::default();
        let roots = vec![shared.clone()];

        // Relative to the work directory, and under an allowed root.
        let ok = check(
            vec![file("in.txt"), file(shared.join("doc.md"))],
            &work,
            &roots,
            &limits,
        )
        .expect("inside");
        let paths: Vec<_> = ok
            .items
            .iter()
            .map(|i| match i {
                Item::Ready(Attachment::File { path, .. }) => path.clone(),
                other => panic!("{other:?}"),
            })
            .collect();
        let canon = |p: PathBuf| std::fs::canonicalize(p).expect("canonical");
        assert_eq!(
            paths,
            [
                canon(work.join("in.txt")).display().to_string(),
                canon(shared.join("doc.md")).display().to_string()
            ]
        );
        // Outside, by `..`, by a link, or with no allowed root: refused, naming the index.
        for (body, roots) in [
            (file(outside.join("secret.txt")), roots.clone()),
            (file("../outside/secret.txt"), roots.clone()),
            (file("link.txt"), roots.clone()),
            (file(shared.join("doc.md")), vec![]),
        ] {
            let err = check(vec![body], &work, &roots, &limits).expect_err("outside");
            assert!(
                err.starts_with("attachments[0]: ") && err.contains("allowed_work_roots"),
                "{err}"
            );
        }
        // A directory must be one, and missing files are named.
        let dir_as_file = check(vec![file(".")], &work, &[], &limits).expect_err("a dir");
        assert!(dir_as_file.contains("is not a file"), "{dir_as_file}");
        let missing = check(vec![file("nope.txt")], &work, &[], &limits).expect_err("missing");
        assert!(missing.contains("nope.txt"), "{missing}");
    }

    #[test]
    fn inline_content_is_checked_for_size_media_type_and_base64_then_written_privately() {
        let tmp = tempfile::tempdir().expect("tempdir");
        let work = tmp.path().join("work");
        let limits = AttachmentLimits {
            max_bytes: 4,
            ..Default::default()
        };
        let too_big = check(
            vec![inline("aGVsbG8=", "text/plain", None)],
            &work,
            &[],
            &limits,
        )
        .expect_err("5 bytes");
        assert!(too_big.contains("max_bytes"), "{too_big}");
        let bad_type = check(
            vec![inline("aGk=", "application/x-sh", None)],
            &work,
            &[],
            &limits,
        )
        .expect_err("type");
        assert!(bad_type.contains("image/png"), "{bad_type}");
        let bad_data = check(vec![inline("@@@", "text/plain", None)], &work, &[], &limits)
            .expect_err("base64");
        assert!(bad_data.contains("base64"), "{bad_data}");

        // Parameters and case of the media type do not matter; the name is made safe and
        // given the type's extension.
        let checked = check(
            vec![inline(
                "aGk=",
                "Text/Plain; charset=utf-8",
                Some("../../etc/pass wd"),
            )],
            &work,
            &[],
            &limits,
        )
        .expect("ok");
        std::fs::create_dir_all(&work).expect("work");
        let written = write(checked, &work, std::slice::from_ref(&work), &conv()).expect("written");
        let [
            Attachment::File {
                path, display_name, ..
            },
        ] = written.as_slice()
        else {
            panic!("{written:?}")
        };
        assert_eq!(display_name, "../../etc/pass wd");
        let path = Path::new(path);
        assert_eq!(
            path.parent(),
            Some(
                std::fs::canonicalize(
                    work.join("attachments")
                        .join(crate::ids::sha256_hex(&conv().key()))
                )
                .expect("dir")
                .as_path()
            )
        );
        let name = path
            .file_name()
            .and_then(|n| n.to_str())
            .unwrap_or_default();
        assert!(name.ends_with("-pass_wd.txt"), "{name}");
        assert_eq!(std::fs::read(path).expect("read"), b"hi");
        use std::os::unix::fs::PermissionsExt;
        let mode = |p: &Path| std::fs::metadata(p).expect("stat").permissions().mode() & 0o777;
        assert_eq!(mode(path), 0o600);
        assert_eq!(mode(&work.join("attachments")), 0o700);
    }

    #[test]
    fn a_turn_whose_inline_content_would_take_its_conversation_past_its_limit_writes_nothing() {
        let tmp = tempfile::tempdir().expect("tempdir");
        let work = tmp.path().join("work");
        std::fs::create_dir_all(&work).expect("work");
        let limits = AttachmentLimits {
            max_conversation_bytes: 5,
            ..Default::default()
        };
        let roots = std::slice::from_ref(&work);
        let turn = |data: &str| {
            let checked =
                check(vec![inline(data, "text/plain", None)], &work, &[], &limits).expect("ok");
            write(checked, &work, roots, &conv())
        };
        // 2 bytes, then 3: the conversation keeps 5.
        turn("aGk=").expect("the first");
        turn("aGV5").expect("the second");
        let dir = work
            .join("attachments")
            .join(crate::ids::sha256_hex(&conv().key()));
        let files = || std::fs::read_dir(&dir).expect("dir").count();
        assert_eq!(files(), 2);
        match turn("aGk=") {
            Err(WriteError::OverLimit {
                kept: 5,
                adding: 2,
                limit: 5,
            }) => {}
            other => panic!("{other:?}"),
        }
        assert_eq!(files(), 2, "nothing of the refused turn was written");
        // Another conversation keeps its own.
        let other = ConversationId::new("agent-a", "other");
        let checked = check(
            vec![inline("aGk=", "text/plain", None)],
            &work,
            &[],
            &limits,
        )
        .expect("ok");
        write(checked, &work, roots, &other).expect("another conversation's");
    }

    #[test]
    fn inline_content_is_never_written_through_a_link_the_agent_planted() {
        let tmp = tempfile::tempdir().expect("tempdir");
        let work = tmp.path().join("agent/work");
        let elsewhere = tmp.path().join("other-agent");
        std::fs::create_dir_all(work.join("deep")).expect("work");
        // Another agent's directory, with a `sub` folder a link could lead to.
        std::fs::create_dir_all(elsewhere.join("sub")).expect("elsewhere");
        let limits = AttachmentLimits::default();
        let write_one = |work: &Path, roots: &[PathBuf]| {
            let one = check(
                vec![inline("aGk=", "text/plain", Some("a.txt"))],
                work,
                &[],
                &limits,
            )
            .expect("ok");
            write(one, work, roots, &conv())
        };
        // `attachments` swapped for a link to another agent's directory.
        std::os::unix::fs::symlink(&elsewhere, work.join("attachments")).expect("link");
        let roots = [work.clone()];
        assert!(write_one(&work, &roots).is_err());
        // A session's working directory below the work directory, one of its folders on
        // the way swapped for a link after the turn was checked.
        std::fs::remove_file(work.join("attachments")).expect("unlink");
        std::fs::remove_dir(work.join("deep")).expect("rmdir");
        std::os::unix::fs::symlink(&elsewhere, work.join("deep")).expect("link");
        assert!(write_one(&work.join("deep/sub"), &roots).is_err());
        // The roots as configured may name the directory through a link of the operator's:
        // the folders below the root are still not followed.
        std::os::unix::fs::symlink(tmp.path().join("agent"), tmp.path().join("linked-agent"))
            .expect("operator's link");
        let configured = [tmp.path().join("linked-agent/work")];
        assert!(write_one(&work.join("deep/sub"), &configured).is_err());
        assert!(
            !elsewhere.join("attachments").exists() && !elsewhere.join("sub/attachments").exists(),
            "nothing was written outside the agent's directory"
        );
        // Without links the same writes land below the work directory.
        std::fs::remove_file(work.join("deep")).expect("unlink");
        std::fs::create_dir_all(work.join("deep/sub")).expect("sub");
        let written = write_one(&work.join("deep/sub"), &roots).expect("written");
        assert_eq!(written.len(), 1);
        assert!(work.join("deep/sub/attachments").is_dir());
    }

    #[test]
    fn the_body_shape_is_strict_and_the_count_is_capped() {
        let unknown: Result<AttachmentBody, _> =
            serde_json::from_str(r#"{"type": "file", "path": "a", "mode": 1}"#);
        assert!(unknown.is_err());
        let kind: Result<AttachmentBody, _> =
            serde_json::from_str(r#"{"type": "blob", "data": "aGk="}"#);
        assert!(kind.is_err());
        let many = (0..=MAX_ATTACHMENTS).map(|_| file("a")).collect();
        let err = check(
            many,
            Path::new("/nonexistent"),
            &[],
            &AttachmentLimits::default(),
        )
        .expect_err("too many");
        assert!(err.contains("at most 32"), "{err}");
    }
}
