//! The images of a CLI backend's turn (issue 17, item 2). Owns which attachments a CLI turn
//! takes ([`images_of`]: image files by absolute path; PNG, JPEG, GIF and WebP, told by
//! their extension as the Copilot runtime tells them), the checks of a turn's image paths
//! ([`check_paths`], [`check_files`]), and an image read as the base64 `image` content block Claude Code's
//! stream-json input takes ([`content_block`]: its media type from its content, not its
//! name, bounded by [`MAX_IMAGE_BYTES`]).
//!
//! Each runner passes the images its own way: the one-shot runner with `imageArg` /
//! `imageMode`, or appended to the prompt (Gemini CLI as `@path` references, which it only
//! reads inside its workspace); the live Claude Code runner as content blocks of the user
//! message. The caller confines the paths (the daemon resolves them inside the agent's work
//! directory or an allowed root); nothing here decides where an image may live. What the pool
//! reads itself it opens through `crate::agent_files` from `/`: a link the agent put on the
//! checked path since (to a file only the daemon may read) is refused, never followed, and a
//! FIFO never holds a thread.

use std::io::Read;
use std::path::{Path, PathBuf};

use base64::Engine;
use serde_json::{Value, json};

use crate::rpc::messages::Attachment;

/// The image formats a CLI turn takes: file extension (lowercase) and media type.
pub const IMAGE_TYPES: &[(&str, &str)] = &[
    ("png", "image/png"),
    ("jpg", "image/jpeg"),
    ("jpeg", "image/jpeg"),
    ("gif", "image/gif"),
    ("webp", "image/webp"),
];

/// The largest image file read into a Claude message (Anthropic's limit per image is 5 MB).
pub const MAX_IMAGE_BYTES: u64 = 5 * 1024 * 1024;

/// What a CLI backend's turn takes, in words for error messages.
const TAKES: &str = "CLI backends take image attachments only (PNG, JPEG, GIF or WebP files)";

/// Why a turn's images cannot go to a CLI backend. Each message says what to change.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ImageError {
    /// An attachment that is not an image file (a directory, a selection of lines, another
    /// file, an inline blob).
    #[error(
        "attachments[{index}] ({what}) is not offered to CLI backends: {TAKES}; drop it, or \
         run the turn on `copilot`"
    )]
    NotOffered {
        /// The attachment's index in the message.
        index: usize,
        /// What it is.
        what: String,
    },
    /// A path that is not absolute (the CLI runs in the conversation's working directory).
    #[error(
        "image {} is not an absolute path; resolve it against the conversation's working \
         directory first",
        path.display()
    )]
    NotAbsolute {
        /// The path.
        path: PathBuf,
    },
    /// A path whose extension names no image format.
    #[error(
        "{} is not an image by its name: {TAKES}, named .png, .jpg, .jpeg, .gif or .webp",
        path.display()
    )]
    NotImageName {
        /// The path.
        path: PathBuf,
    },
    /// The file could not be read (or is not a regular file).
    #[error("image {} cannot be read: {error}; attach an existing, readable file", path.display())]
    Unreadable {
        /// The path.
        path: PathBuf,
        /// The error.
        #[source]
        error: std::io::Error,
    },
    /// A link, a FIFO or a device on the path or in the image's place: the pool, which runs
    /// unsandboxed, opens an image from `/` without following a link (the agent may have put
    /// one on the path since it was checked) and reads regular files only.
    #[error(
        "image {} was not read: {error}; attach the image file itself by its resolved path \
         (std::fs::canonicalize, realpath): the pool follows no link to an image",
        path.display()
    )]
    NotPlainFile {
        /// The path.
        path: PathBuf,
        /// What was found.
        #[source]
        error: std::io::Error,
    },
    /// The file's content is not a PNG, JPEG, GIF or WebP image.
    #[error(
        "{} is not a PNG, JPEG, GIF or WebP image by its content; attach the image itself",
        path.display()
    )]
    NotImageContent {
        /// The path.
        path: PathBuf,
    },
    /// The file is larger than [`MAX_IMAGE_BYTES`].
    #[error(
        "image {} has {bytes} bytes, over the {max} a Claude message takes per image; scale \
         it down",
        path.display()
    )]
    TooLarge {
        /// The path.
        path: PathBuf,
        /// Its size.
        bytes: u64,
        /// The limit.
        max: u64,
    },
    /// Gemini CLI in the pool's sandbox reads no `@path` reference (seen with Gemini CLI
    /// 0.61.0: it skips them without a word), so its images would be lost.
    #[error(
        "Gemini CLI runs in the pool's sandbox here, where it does not read `@` image \
         references and would drop the image without a word: send images to `claude-cli` or \
         `codex-cli`, or run the daemon with sandbox = \"off\""
    )]
    GeminiSandboxed,
    /// Gemini CLI reads `@path` references only inside its workspace (the conversation's
    /// working directory); it would skip this one silently.
    #[error(
        "image {} lies outside the conversation's working directory {}: Gemini CLI reads \
         images only inside its workspace; put the image under the working directory",
        path.display(),
        cwd.display()
    )]
    OutsideWorkspace {
        /// The image (resolved).
        path: PathBuf,
        /// The working directory (resolved).
        cwd: PathBuf,
    },
}

/// The media type of an image file by its extension (case-insensitive), if it names one of
/// [`IMAGE_TYPES`].
pub fn media_type_of(path: &Path) -> Option<&'static str> {
    let ext = path.extension()?.to_str()?.to_ascii_lowercase();
    IMAGE_TYPES
        .iter()
        .find(|(e, _)| *e == ext)
        .map(|(_, media)| *media)
}

/// Whether `media_type` (lowercase, without parameters) is one of [`IMAGE_TYPES`]'.
pub fn is_image_media_type(media_type: &str) -> bool {
    IMAGE_TYPES.iter().any(|(_, m)| *m == media_type)
}

/// The media type of image `bytes` by their signature (PNG, JPEG, GIF, WebP).
pub fn sniff(bytes: &[u8]) -> Option<&'static str> {
    if bytes.starts_with(b"\x89PNG\r\n\x1a\n") {
        Some("image/png")
    } else if bytes.starts_with(&[0xFF, 0xD8, 0xFF]) {
        Some("image/jpeg")
    } else if bytes.starts_with(b"GIF87a") || bytes.starts_with(b"GIF89a") {
        Some("image/gif")
    } else if bytes.len() >= 12 && &bytes[..4] == b"RIFF" && &bytes[8..12] == b"WEBP" {
        Some("image/webp")
    } else {
        None
    }
}

/// The image paths of a message's attachments, in order, when every one is an image file a
/// CLI backend takes (a file by path, whole, named as an image); otherwise the first one
/// that is not, with what to do. Inline blobs are refused: write them to a file in the
/// working directory and attach it by path (the daemon does this with `inline`
/// attachments).
pub fn images_of(attachments: &[Attachment]) -> Result<Vec<PathBuf>, ImageError> {
    attachments
        .iter()
        .enumerate()
        .map(|(index, attachment)| {
            let refuse = |what: String| ImageError::NotOffered { index, what };
            match attachment {
                Attachment::File {
                    line_range: Some(_),
                    path,
                    ..
                } => Err(refuse(format!("a line range of {path}"))),
                Attachment::File { path, .. } => {
                    let path = PathBuf::from(path);
                    if media_type_of(&path).is_some() {
                        Ok(path)
                    } else {
                        Err(refuse(format!("file {}, not an image", path.display())))
                    }
                }
                Attachment::Directory { path, .. } => Err(refuse(format!("directory {path}"))),
                Attachment::Blob { mime_type, .. } => Err(refuse(format!(
                    "an inline {mime_type} blob; write it to a file under the working \
                     directory and attach that file"
                ))),
            }
        })
        .collect()
}

/// Checks a turn's image paths without reading them: absolute, and named as an image.
pub fn check_paths(images: &[PathBuf]) -> Result<(), ImageError> {
    for path in images {
        if !path.is_absolute() {
            return Err(ImageError::NotAbsolute { path: path.clone() });
        }
        if media_type_of(path).is_none() {
            return Err(ImageError::NotImageName { path: path.clone() });
        }
    }
    Ok(())
}

/// [`check_paths`], then that each path is a readable regular file whose content starts
/// like a PNG, JPEG, GIF or WebP image ([`sniff`]). Each is opened as [`content_block`] opens
/// it (no link followed, no FIFO waited on).
pub async fn check_files(images: &[PathBuf]) -> Result<(), ImageError> {
    check_paths(images)?;
    for path in images {
        let owned = path.clone();
        let head = tokio::task::spawn_blocking(move || -> Result<Vec<u8>, ImageError> {
            let file = open_image(&owned)?;
            let mut head = Vec::with_capacity(SIGNATURE_BYTES);
            file.take(SIGNATURE_BYTES as u64)
                .read_to_end(&mut head)
                .map_err(|error| unreadable(&owned, error))?;
            Ok(head)
        })
        .await
        .map_err(|e| unreadable(path, std::io::Error::other(e)))??;
        if sniff(&head).is_none() {
            return Err(ImageError::NotImageContent { path: path.clone() });
        }
    }
    Ok(())
}

/// Opens image `path` for reading as the pool, which runs unsandboxed, must open a file the
/// agent may have written: every component from `/` without following a link, without
/// waiting on a FIFO, a regular file only ([`crate::agent_files::open_regular`]). The daemon
/// checked the path resolved inside the agent's work directory or an allowed root when the
/// turn was requested; the agent's processes may since have put a link in its place (to a
/// file only the daemon may read) or a FIFO (which would hold a thread), and neither is
/// followed. Blocking.
fn open_image(path: &Path) -> Result<std::fs::File, ImageError> {
    let relative = path
        .strip_prefix("/")
        .map_err(|_| ImageError::NotAbsolute {
            path: path.to_path_buf(),
        })?;
    crate::agent_files::open_regular(Path::new("/"), relative).map_err(|error| {
        // `agent_files` refuses a link, a FIFO or a device as invalid input.
        if error.kind() == std::io::ErrorKind::InvalidInput {
            ImageError::NotPlainFile {
                path: path.to_path_buf(),
                error,
            }
        } else {
            unreadable(path, error)
        }
    })
}

fn unreadable(path: &Path, error: std::io::Error) -> ImageError {
    ImageError::Unreadable {
        path: path.to_path_buf(),
        error,
    }
}

/// How much of a file [`sniff`] needs (WebP's `RIFF....WEBP`).
const SIGNATURE_BYTES: usize = 12;

/// Reads image `path` into the Anthropic content block Claude Code's stream-json input
/// takes: `{"type":"image","source":{"type":"base64","media_type":…,"data":…}}`, the media
/// type told by the content. At most [`MAX_IMAGE_BYTES`]. `path` must be resolved: it is
/// opened from `/` without following a link ([`ImageError::NotPlainFile`] otherwise).
pub async fn content_block(path: &Path) -> Result<Value, ImageError> {
    let owned = path.to_path_buf();
    let bytes = tokio::task::spawn_blocking(move || -> Result<Vec<u8>, ImageError> {
        let file = open_image(&owned)?;
        let too_large = |bytes| ImageError::TooLarge {
            path: owned.clone(),
            bytes,
            max: MAX_IMAGE_BYTES,
        };
        let size = file
            .metadata()
            .map_err(|error| unreadable(&owned, error))?
            .len();
        if size > MAX_IMAGE_BYTES {
            return Err(too_large(size));
        }
        // The file may have grown since it was measured.
        crate::agent_files::read_opened(file, &owned, MAX_IMAGE_BYTES).map_err(|error| {
            if error.kind() == std::io::ErrorKind::InvalidData {
                too_large(MAX_IMAGE_BYTES + 1)
            } else {
                unreadable(&owned, error)
            }
        })
    })
    .await
    .map_err(|e| unreadable(path, std::io::Error::other(e)))??;
    let media_type = sniff(&bytes).ok_or_else(|| ImageError::NotImageContent {
        path: path.to_path_buf(),
    })?;
    Ok(json!({
        "type": "image",
        "source": {
            "type": "base64",
            "media_type": media_type,
            "data": base64::engine::general_purpose::STANDARD.encode(&bytes),
        },
    }))
}

/// `path` as a Gemini CLI `@` reference: `@` then the path with every character that could
/// end or change the reference (blanks, punctuation, quotes, backslashes) escaped with a
/// backslash, which Gemini CLI removes again.
pub(crate) fn gemini_reference(path: &Path) -> String {
    let mut out = String::from("@");
    for c in path.to_string_lossy().chars() {
        if !(c.is_alphanumeric() || matches!(c, '/' | '-' | '_' | '.')) {
            out.push('\\');
        }
        out.push(c);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rpc::messages::LineRange;

    const PNG: &[u8] = b"\x89PNG\r\n\x1a\n\0\0\0\rIHDR";

    fn file(path: &str) -> Attachment {
        Attachment::File {
            path: path.to_owned(),
            display_name: "x".to_owned(),
            line_range: None,
        }
    }

    #[test]
    fn image_files_are_told_by_extension_and_content() {
        assert_eq!(media_type_of(Path::new("/a/b.PNG")), Some("image/png"));
        assert_eq!(media_type_of(Path::new("/a/b.jpeg")), Some("image/jpeg"));
        assert_eq!(media_type_of(Path::new("/a/b.txt")), None);
        assert_eq!(media_type_of(Path::new("/a/png")), None);
        assert_eq!(sniff(PNG), Some("image/png"));
        assert_eq!(sniff(b"\xFF\xD8\xFF\xE0"), Some("image/jpeg"));
        assert_eq!(sniff(b"GIF89a.."), Some("image/gif"));
        assert_eq!(sniff(b"RIFF\0\0\0\0WEBPVP8 "), Some("image/webp"));
        assert_eq!(sniff(b"hello"), None);
        assert!(is_image_media_type("image/webp"));
        assert!(!is_image_media_type("text/plain"));
    }

    #[test]
    fn only_whole_image_files_are_a_cli_turns_attachments_and_a_refusal_says_what_to_do() {
        let images = images_of(&[file("/w/a.png"), file("/w/b.jpg")]).expect("images");
        assert_eq!(
            images,
            [PathBuf::from("/w/a.png"), PathBuf::from("/w/b.jpg")]
        );
        let refused = [
            (file("/w/notes.txt"), "not an image"),
            (
                Attachment::Directory {
                    path: "/w/src".into(),
                    display_name: "src".into(),
                },
                "directory /w/src",
            ),
            (
                Attachment::File {
                    path: "/w/a.png".into(),
                    display_name: "a".into(),
                    line_range: Some(LineRange { start: 1, end: 2 }),
                },
                "a line range",
            ),
            (
                Attachment::Blob {
                    data: "AA==".into(),
                    mime_type: "image/png".into(),
                    display_name: None,
                },
                "write it to a file",
            ),
        ];
        for (attachment, needle) in refused {
            let error = images_of(&[file("/w/a.png"), attachment])
                .expect_err("refused")
                .to_string();
            assert!(error.starts_with("attachments[1] ("), "{error}");
            assert!(error.contains(needle), "{error}");
            assert!(error.contains("run the turn on `copilot`"), "{error}");
        }
    }

    #[test]
    fn image_paths_must_be_absolute_and_named_as_images() {
        assert!(check_paths(&[PathBuf::from("/w/a.gif")]).is_ok());
        let relative = check_paths(&[PathBuf::from("a.png")]).expect_err("relative");
        assert!(relative.to_string().contains("absolute"), "{relative}");
        let named = check_paths(&[PathBuf::from("/w/a.pdf")]).expect_err("not an image");
        assert!(named.to_string().contains(".webp"), "{named}");
    }

    #[tokio::test]
    async fn an_image_is_read_as_claudes_base64_block_by_its_content_and_bounded() {
        let dir = tempfile::tempdir().expect("tempdir");
        // Named as a JPEG, but a PNG: the content decides.
        let path = dir.path().join("dot.jpg");
        std::fs::write(&path, PNG).expect("write");
        let block = content_block(&path).await.expect("read");
        assert_eq!(block["type"], "image");
        assert_eq!(block["source"]["type"], "base64");
        assert_eq!(block["source"]["media_type"], "image/png");
        assert_eq!(
            block["source"]["data"],
            base64::engine::general_purpose::STANDARD.encode(PNG)
        );

        let text = dir.path().join("fake.png");
        std::fs::write(&text, "not an image").expect("write");
        let error = content_block(&text).await.expect_err("not an image");
        assert!(
            matches!(error, ImageError::NotImageContent { .. }),
            "{error}"
        );

        let big = dir.path().join("big.png");
        let file = std::fs::File::create(&big).expect("create");
        file.set_len(MAX_IMAGE_BYTES + 1).expect("grow");
        let error = content_block(&big).await.expect_err("too large");
        assert!(error.to_string().contains("scale it down"), "{error}");

        assert!(check_files(std::slice::from_ref(&path)).await.is_ok());
        assert!(matches!(
            check_files(std::slice::from_ref(&text)).await,
            Err(ImageError::NotImageContent { .. })
        ));
        assert!(matches!(
            check_files(&[dir.path().join("gone.png")]).await,
            Err(ImageError::Unreadable { .. })
        ));
        let missing = content_block(&dir.path().join("gone.png"))
            .await
            .expect_err("missing");
        assert!(
            matches!(missing, ImageError::Unreadable { .. }),
            "{missing}"
        );
        let folder = dir.path().join("folder.png");
        std::fs::create_dir(&folder).expect("mkdir");
        assert!(matches!(
            content_block(&folder).await,
            Err(ImageError::NotPlainFile { .. })
        ));
    }

    #[tokio::test]
    async fn an_image_is_never_read_through_a_link_or_a_fifo_the_agent_planted() {
        let dir = tempfile::tempdir().expect("tempdir");
        let root = dir.path().canonicalize().expect("resolve");
        // What only the daemon may read, and the agent's links to it: in the image's place,
        // and as a folder on the image's way.
        let secret = root.join("secret");
        std::fs::create_dir(&secret).expect("mkdir");
        std::fs::write(secret.join("token.png"), PNG).expect("write");
        let work = root.join("work");
        std::fs::create_dir(&work).expect("mkdir");
        let linked = work.join("linked.png");
        std::os::unix::fs::symlink(secret.join("token.png"), &linked).expect("link");
        let folder = work.join("shots");
        std::os::unix::fs::symlink(&secret, &folder).expect("link");
        for path in [linked, folder.join("token.png")] {
            let error = content_block(&path)
                .await
                .expect_err("a link is not followed");
            assert!(
                matches!(error, ImageError::NotPlainFile { .. })
                    && error.to_string().contains("follows no link"),
                "{error}"
            );
            assert!(
                matches!(
                    check_files(std::slice::from_ref(&path)).await,
                    Err(ImageError::NotPlainFile { .. })
                ),
                "{}",
                path.display()
            );
        }
        // A FIFO in an image's place is refused at once (opening it to read would wait for
        // a writer for ever).
        let fifo = work.join("pipe.png");
        nix::unistd::mkfifo(&fifo, nix::sys::stat::Mode::S_IRWXU).expect("mkfifo");
        let read = tokio::time::timeout(std::time::Duration::from_secs(10), async {
            (
                content_block(&fifo).await,
                check_files(std::slice::from_ref(&fifo)).await,
            )
        })
        .await
        .expect("a FIFO does not hold the read");
        assert!(
            matches!(read.0, Err(ImageError::NotPlainFile { .. })),
            "{:?}",
            read.0
        );
        assert!(
            matches!(read.1, Err(ImageError::NotPlainFile { .. })),
            "{:?}",
            read.1
        );
        // The image itself, by its resolved path, is read.
        std::fs::write(work.join("real.png"), PNG).expect("write");
        assert!(content_block(&work.join("real.png")).await.is_ok());
    }

    #[test]
    fn a_gemini_reference_escapes_what_would_end_the_path() {
        assert_eq!(
            gemini_reference(Path::new("/w/attachments/a-b_c.png")),
            "@/w/attachments/a-b_c.png"
        );
        assert_eq!(
            gemini_reference(Path::new("/w/my pics/(1),x!.png")),
            r"@/w/my\ pics/\(1\)\,x\!.png"
        );
    }
}
