//! Files in an agent's own directories (a CLI backend's home, the agent's work directory) as
//! the pool, which runs unsandboxed, reads and writes them. The agent's processes may write
//! there, so any entry may be a symbolic link to another agent's files or the daemon's, a FIFO
//! that blocks whoever opens it for reading, or a file too large to hold.
//!
//! Every path is a directory the pool resolved (`root`, whose last component must not be a
//! link; the agent cannot replace what lies above it) and a relative path below it. Each
//! component below `root` is opened relative to the one before, never following a link
//! (`O_NOFOLLOW`), so a link planted anywhere on the way, or swapped in between a check and a
//! use, is refused rather than followed. A file is opened without blocking (`O_NONBLOCK`: a
//! FIFO opens at once) and must be a regular file; reads stop at a bound. A write replaces its
//! file through a new one created beside it (exclusively, never through a link) and renamed
//! over it, so a link in its place is replaced, never written through.
//!
//! Blocking (file system calls): call these off the async threads.

use std::ffi::OsString;
use std::fs::File;
use std::io::{self, Read, Write};
use std::os::fd::OwnedFd;
use std::os::unix::ffi::OsStrExt;
use std::path::{Component, Path, PathBuf};

use nix::errno::Errno;
use nix::fcntl::{OFlag, open, openat, renameat};
use nix::sys::stat::{FileStat, Mode, SFlag, fstat, mkdirat};

/// What an entry of a directory is, as [`entries`] reports it (links are never followed).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum EntryKind {
    /// A directory.
    Dir,
    /// A regular file.
    File,
    /// Anything else: a link, a FIFO, a socket, a device.
    Other,
}

fn io_error(errno: Errno) -> io::Error {
    io::Error::from_raw_os_error(errno as i32)
}

/// The error for an entry that is there but not what the pool may open.
fn not_regular(rel: &Path) -> io::Error {
    io::Error::new(
        io::ErrorKind::InvalidInput,
        format!(
            "{} is not a regular file (a link, a FIFO or a device is never opened by the pool)",
            rel.display()
        ),
    )
}

/// The components of `rel`, each a plain name (no root, no `.` or `..`).
fn names(rel: &Path) -> io::Result<Vec<&std::ffi::OsStr>> {
    rel.components()
        .map(|c| match c {
            Component::Normal(name) => Ok(name),
            _ => Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("{} is not a plain relative path", rel.display()),
            )),
        })
        .collect()
}

const DIR_FLAGS: OFlag = OFlag::O_RDONLY
    .union(OFlag::O_DIRECTORY)
    .union(OFlag::O_NOFOLLOW)
    .union(OFlag::O_CLOEXEC);

/// `root` itself, opened as a directory that is not a link.
fn open_root(root: &Path) -> io::Result<OwnedFd> {
    open(root, DIR_FLAGS, Mode::empty()).map_err(|e| match e {
        Errno::ELOOP => io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("{} is a link; the pool does not follow it", root.display()),
        ),
        other => io_error(other),
    })
}

/// The directory `root/rel`, every component below `root` opened without following a link.
pub(crate) fn open_dir(root: &Path, rel: &Path) -> io::Result<OwnedFd> {
    let mut dir = open_root(root)?;
    for name in names(rel)? {
        dir = open_child_dir(&dir, name, root, rel)?;
    }
    Ok(dir)
}

/// The directory `name` in `dir`, not a link; `root` and `shown` name it in an error.
fn open_child_dir(
    dir: &OwnedFd,
    name: &std::ffi::OsStr,
    root: &Path,
    shown: &Path,
) -> io::Result<OwnedFd> {
    openat(dir, name, DIR_FLAGS, Mode::empty()).map_err(|e| match e {
        // A link with O_NOFOLLOW | O_DIRECTORY: ELOOP or ENOTDIR.
        Errno::ELOOP | Errno::ENOTDIR => io::Error::new(
            io::ErrorKind::InvalidInput,
            format!(
                "{} below {} is not a directory (a link is never followed)",
                shown.display(),
                root.display()
            ),
        ),
        other => io_error(other),
    })
}

/// The parent directory of `rel` below `root`, and `rel`'s last name.
fn parent_and_name<'a>(root: &Path, rel: &'a Path) -> io::Result<(OwnedFd, &'a std::ffi::OsStr)> {
    let all = names(rel)?;
    let Some((name, _)) = all.split_last() else {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "an empty path names no file",
        ));
    };
    let parent = rel.parent().unwrap_or(Path::new(""));
    Ok((open_dir(root, parent)?, name))
}

fn is_regular(stat: &FileStat) -> bool {
    SFlag::from_bits_truncate(stat.st_mode) & SFlag::S_IFMT == SFlag::S_IFREG
}

/// The regular file `root/rel`, opened for reading (never a link, never blocking on a FIFO).
pub(crate) fn open_regular(root: &Path, rel: &Path) -> io::Result<File> {
    let (dir, name) = parent_and_name(root, rel)?;
    let flags = OFlag::O_RDONLY
        | OFlag::O_NOFOLLOW
        | OFlag::O_NONBLOCK
        | OFlag::O_NOCTTY
        | OFlag::O_CLOEXEC;
    let fd = openat(&dir, name, flags, Mode::empty()).map_err(|e| match e {
        Errno::ELOOP => not_regular(rel),
        other => io_error(other),
    })?;
    let stat = fstat(&fd).map_err(io_error)?;
    if !is_regular(&stat) {
        return Err(not_regular(rel));
    }
    Ok(File::from(fd))
}

/// Whether `root/rel` is a regular file (reached without a link).
pub(crate) fn is_file(root: &Path, rel: &Path) -> bool {
    open_regular(root, rel).is_ok()
}

/// The whole of the regular file `root/rel`, refused (`InvalidData`) past `limit` bytes.
pub(crate) fn read(root: &Path, rel: &Path, limit: u64) -> io::Result<Vec<u8>> {
    read_opened(open_regular(root, rel)?, rel, limit)
}

/// The rest of `file` (opened by [`open_regular`]; `rel` names it in the error), refused
/// (`InvalidData`) past `limit` bytes.
pub(crate) fn read_opened(file: File, rel: &Path, limit: u64) -> io::Result<Vec<u8>> {
    let mut bytes = Vec::new();
    file.take(limit.saturating_add(1)).read_to_end(&mut bytes)?;
    if bytes.len() as u64 > limit {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("{} is larger than {limit} bytes", rel.display()),
        ));
    }
    Ok(bytes)
}

/// The most entries [`entries`] lists of one directory, and the most matches
/// [`entries_where`] keeps (the agent's processes can make millions; a listing past this is
/// refused rather than held).
const MAX_DIR_ENTRIES: usize = 100_000;

/// The entries of the directory `root/rel` (without `.` and `..`), each with what it is;
/// a link is reported as [`EntryKind::Other`], never followed. A directory of more than
/// [`MAX_DIR_ENTRIES`] is refused (`InvalidData`).
#[cfg(test)]
pub(crate) fn entries(root: &Path, rel: &Path) -> io::Result<Vec<(OsString, EntryKind)>> {
    entries_where(root, rel, |_, _| true)
}

/// The entries of the directory `root/rel` that `keep` picks, as [`entries`] reports them:
/// the directory is read through, only what is kept is held, so a directory of millions of
/// other names costs time, not memory. More than [`MAX_DIR_ENTRIES`] kept is refused
/// (`InvalidData`, logged).
pub(crate) fn entries_where(
    root: &Path,
    rel: &Path,
    keep: impl FnMut(&std::ffi::OsStr, EntryKind) -> bool,
) -> io::Result<Vec<(OsString, EntryKind)>> {
    let listed = entries_of(open_dir(root, rel)?, MAX_DIR_ENTRIES, keep);
    if let Err(error) = &listed
        && error.kind() == io::ErrorKind::InvalidData
    {
        tracing::warn!(
            dir = %root.join(rel).display(),
            %error,
            "A directory an agent's processes write holds too many entries to list; what the pool looks for there reads as missing. Remove old files from it."
        );
    }
    listed
}

/// The entries of the opened directory `fd` that `keep` picks, as [`entries`] reports them;
/// more than `max` kept is refused (`InvalidData`).
fn entries_of(
    fd: OwnedFd,
    max: usize,
    keep: impl FnMut(&std::ffi::OsStr, EntryKind) -> bool,
) -> io::Result<Vec<(OsString, EntryKind)>> {
    let dir_fd = fd.try_clone()?;
    let mut dir = nix::dir::Dir::from_fd(fd).map_err(io_error)?;
    let (out, more) = first_entries(&mut dir, &dir_fd, max, keep)?;
    if more {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("the directory has more than {max} entries; the pool does not list it"),
        ));
    }
    Ok(out)
}

/// The first `max` entries of `dir` (opened from `dir_fd`) that `keep` picks, and whether
/// there are more; the next listing of `dir` starts from its first entry again.
fn first_entries(
    dir: &mut nix::dir::Dir,
    dir_fd: &OwnedFd,
    max: usize,
    mut keep: impl FnMut(&std::ffi::OsStr, EntryKind) -> bool,
) -> io::Result<(Vec<(OsString, EntryKind)>, bool)> {
    let mut out = Vec::new();
    // The iterator rewinds the directory when it is dropped.
    for entry in dir.iter() {
        let entry = entry.map_err(io_error)?;
        let name = entry.file_name().to_bytes();
        if name == b"." || name == b".." {
            continue;
        }
        let kind = match entry.file_type() {
            Some(nix::dir::Type::Directory) => EntryKind::Dir,
            Some(nix::dir::Type::File) => EntryKind::File,
            Some(_) => EntryKind::Other,
            // The file system does not say: ask without following a link.
            None => match nix::sys::stat::fstatat(
                dir_fd,
                entry.file_name(),
                nix::fcntl::AtFlags::AT_SYMLINK_NOFOLLOW,
            ) {
                Ok(stat) if is_regular(&stat) => EntryKind::File,
                Ok(stat)
                    if SFlag::from_bits_truncate(stat.st_mode) & SFlag::S_IFMT
                        == SFlag::S_IFDIR =>
                {
                    EntryKind::Dir
                }
                _ => EntryKind::Other,
            },
        };
        let name = std::ffi::OsStr::from_bytes(name);
        if !keep(name, kind) {
            continue;
        }
        if out.len() == max {
            return Ok((out, true));
        }
        out.push((name.to_os_string(), kind));
    }
    Ok((out, false))
}

/// Creates the directories of `rel` below `root` that are missing (each with `mode`), never
/// through a link: an existing entry on the way must be a directory.
pub(crate) fn create_dirs(root: &Path, rel: &Path, mode: u32) -> io::Result<()> {
    let mut dir = open_root(root)?;
    let mut walked = PathBuf::new();
    for name in names(rel)? {
        walked.push(name);
        let made = match mkdirat(&dir, name, Mode::from_bits_truncate(mode)) {
            Ok(()) => true,
            Err(Errno::EEXIST) => false,
            Err(other) => return Err(io_error(other)),
        };
        dir = open_child_dir(&dir, name, root, &walked)?;
        if made {
            // `mode` whatever the umask (which `mkdirat` applies).
            nix::sys::stat::fchmod(&dir, Mode::from_bits_truncate(mode)).map_err(io_error)?;
        }
    }
    Ok(())
}

/// Removes the directory `root/rel` and the entries directly in it (files, links: a link is
/// removed, never followed), reached without following a link; a link (or anything else)
/// in place of `rel` itself is removed too. A directory inside it is left, and so is `rel`
/// then (`Ok(false)`); one already gone is `Ok(true)`.
#[cfg(any(feature = "http", test))]
pub(crate) fn remove_flat_dir(root: &Path, rel: &Path) -> io::Result<bool> {
    remove_flat_dir_in_batches(root, rel, MAX_DIR_ENTRIES)
}

/// [`remove_flat_dir`], holding at most `batch` names at once.
#[cfg(any(feature = "http", test))]
fn remove_flat_dir_in_batches(root: &Path, rel: &Path, batch: usize) -> io::Result<bool> {
    use nix::unistd::{UnlinkatFlags, unlinkat};
    let (parent, name) = match parent_and_name(root, rel) {
        Ok(found) => found,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(true),
        Err(e) => return Err(e),
    };
    let dir = match openat(&parent, name, DIR_FLAGS, Mode::empty()) {
        Ok(dir) => dir,
        Err(Errno::ENOENT) => return Ok(true),
        // Not a directory (a link planted in its place, say): the entry itself goes.
        Err(Errno::ELOOP | Errno::ENOTDIR) => {
            return match unlinkat(&parent, name, UnlinkatFlags::NoRemoveDir) {
                Ok(()) | Err(Errno::ENOENT) => Ok(true),
                Err(other) => Err(io_error(other)),
            };
        }
        Err(other) => return Err(io_error(other)),
    };
    let mut kept = false;
    // Listed through the directory opened above, not by its path again, and removed in
    // batches: an agent may have made millions of entries there, whose names are never all
    // held at once.
    let mut listing = nix::dir::Dir::from_fd(dir.try_clone()?).map_err(io_error)?;
    loop {
        let (names, more) = first_entries(&mut listing, &dir, batch, |_, kind| {
            kept |= kind == EntryKind::Dir;
            kind != EntryKind::Dir
        })?;
        for (entry, _) in names {
            match unlinkat(&dir, entry.as_os_str(), UnlinkatFlags::NoRemoveDir) {
                Ok(()) | Err(Errno::ENOENT) => {}
                Err(other) => return Err(io_error(other)),
            }
        }
        if !more {
            break;
        }
    }
    if kept {
        return Ok(false);
    }
    match unlinkat(&parent, name, UnlinkatFlags::RemoveDir) {
        Ok(()) | Err(Errno::ENOENT) => Ok(true),
        Err(Errno::ENOTEMPTY) => Ok(false),
        Err(other) => Err(io_error(other)),
    }
}

/// The bytes of the regular files directly in the directory `root/rel` (a link, a FIFO or a
/// directory in it counts nothing; one missing holds nothing), reached without following a
/// link. A directory of more than [`MAX_DIR_ENTRIES`] entries is refused (`InvalidData`).
#[cfg(any(feature = "http", test))]
pub(crate) fn flat_dir_bytes(root: &Path, rel: &Path) -> io::Result<u64> {
    let dir = match open_dir(root, rel) {
        Ok(dir) => dir,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(0),
        Err(e) => return Err(e),
    };
    let files = entries_of(dir.try_clone()?, MAX_DIR_ENTRIES, |_, kind| {
        kind == EntryKind::File
    })?;
    let mut bytes = 0u64;
    for (name, _) in files {
        if let Ok(stat) = nix::sys::stat::fstatat(
            &dir,
            name.as_os_str(),
            nix::fcntl::AtFlags::AT_SYMLINK_NOFOLLOW,
        ) && is_regular(&stat)
        {
            bytes = bytes.saturating_add(u64::try_from(stat.st_size).unwrap_or(0));
        }
    }
    Ok(bytes)
}

/// Removes the entry `root/rel` (a file or a link, never followed), reached without
/// following a link; one already gone is `Ok(())`.
pub(crate) fn remove_file(root: &Path, rel: &Path) -> io::Result<()> {
    use nix::unistd::{UnlinkatFlags, unlinkat};
    let (parent, name) = match parent_and_name(root, rel) {
        Ok(found) => found,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(e),
    };
    match unlinkat(&parent, name, UnlinkatFlags::NoRemoveDir) {
        Ok(()) | Err(Errno::ENOENT) => Ok(()),
        Err(other) => Err(io_error(other)),
    }
}

/// Removes the regular files directly in the directory `root/rel` whose name `pick` takes
/// and that were last modified at least `age` ago, the directory reached without following a
/// link (a link in it is no regular file, and stays). Returns how many went.
pub(crate) fn remove_old_files(
    root: &Path,
    rel: &Path,
    age: std::time::Duration,
    mut pick: impl FnMut(&std::ffi::OsStr) -> bool,
) -> io::Result<usize> {
    use nix::fcntl::AtFlags;
    use nix::unistd::{UnlinkatFlags, unlinkat};
    let dir = open_dir(root, rel)?;
    let listed = entries_of(dir.try_clone()?, MAX_DIR_ENTRIES, |name, kind| {
        kind == EntryKind::File && pick(name)
    })?;
    let now = std::time::SystemTime::now();
    let mut removed = 0;
    for (name, _) in listed {
        let Ok(stat) =
            nix::sys::stat::fstatat(&dir, name.as_os_str(), AtFlags::AT_SYMLINK_NOFOLLOW)
        else {
            continue;
        };
        // A time before 1970 reads as the epoch: old.
        let modified = std::time::UNIX_EPOCH
            + std::time::Duration::new(
                u64::try_from(stat.st_mtime).unwrap_or(0),
                u32::try_from(stat.st_mtime_nsec).unwrap_or(0),
            );
        let old = now
            .duration_since(modified)
            .is_ok_and(|elapsed| elapsed >= age);
        if is_regular(&stat) && old {
            match unlinkat(&dir, name.as_os_str(), UnlinkatFlags::NoRemoveDir) {
                Ok(()) => removed += 1,
                Err(Errno::ENOENT) => {}
                Err(other) => return Err(io_error(other)),
            }
        }
    }
    Ok(removed)
}

const CREATE_FLAGS: OFlag = OFlag::O_WRONLY
    .union(OFlag::O_CREAT)
    .union(OFlag::O_EXCL)
    .union(OFlag::O_NOFOLLOW)
    .union(OFlag::O_CLOEXEC);

/// Creates the file `root/rel` (it must not exist, not even as a link) with `mode`, writes
/// `bytes` into it and syncs it; a write that fails removes it. Its directory must exist.
pub(crate) fn create_new(root: &Path, rel: &Path, bytes: &[u8], mode: u32) -> io::Result<()> {
    let (dir, name) = parent_and_name(root, rel)?;
    let fd = openat(&dir, name, CREATE_FLAGS, Mode::from_bits_truncate(mode)).map_err(io_error)?;
    let mut file = File::from(fd);
    let written = file.write_all(bytes).and_then(|()| file.sync_all());
    if written.is_err() {
        // A part of it under its final name would read as the whole (an attachment).
        let _ = nix::unistd::unlinkat(&dir, name, nix::unistd::UnlinkatFlags::NoRemoveDir);
    }
    written
}

/// Replaces the file `root/rel` with `bytes` (mode `mode`): written into a new file beside
/// it, synced, and renamed over it, so a reader never sees half of it and a link in its
/// place is replaced, never written through. Its directory must exist.
pub(crate) fn replace(root: &Path, rel: &Path, bytes: &[u8], mode: u32) -> io::Result<()> {
    let (dir, name) = parent_and_name(root, rel)?;
    let mut tmp = name.to_os_string();
    tmp.push(format!(".tmp-{}", uuid::Uuid::new_v4().simple()));
    let fd = openat(
        &dir,
        tmp.as_os_str(),
        CREATE_FLAGS,
        Mode::from_bits_truncate(mode),
    )
    .map_err(io_error)?;
    let mut file = File::from(fd);
    let written = file
        .write_all(bytes)
        .and_then(|()| file.sync_all())
        .and_then(|()| renameat(&dir, tmp.as_os_str(), &dir, name).map_err(io_error));
    if written.is_err() {
        let _ = nix::unistd::unlinkat(
            &dir,
            tmp.as_os_str(),
            nix::unistd::UnlinkatFlags::NoRemoveDir,
        );
    }
    written
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::symlink;

    fn dirs() -> (tempfile::TempDir, PathBuf, PathBuf) {
        let tmp = tempfile::tempdir().expect("tempdir");
        let root = tmp.path().join("agent");
        let other = tmp.path().join("other");
        std::fs::create_dir_all(root.join("sub")).expect("root");
        std::fs::create_dir_all(&other).expect("other");
        std::fs::write(other.join("secret.txt"), "theirs").expect("secret");
        (tmp, root, other)
    }

    fn mkfifo(path: &Path) {
        nix::unistd::mkfifo(path, Mode::from_bits_truncate(0o600)).expect("mkfifo");
    }

    #[test]
    fn a_regular_file_below_the_root_is_read_whole() {
        let (_tmp, root, _) = dirs();
        std::fs::write(root.join("sub/a.json"), "{}").expect("write");
        let bytes = read(&root, Path::new("sub/a.json"), 10).expect("read");
        assert_eq!(bytes, b"{}");
        assert!(is_file(&root, Path::new("sub/a.json")));
    }

    #[test]
    fn a_link_in_place_of_the_file_is_refused_not_followed() {
        let (_tmp, root, other) = dirs();
        symlink(other.join("secret.txt"), root.join("sub/a.json")).expect("link");
        let error = read(&root, Path::new("sub/a.json"), 100).expect_err("a link");
        assert!(error.to_string().contains("not a regular file"), "{error}");
        assert!(!is_file(&root, Path::new("sub/a.json")));
    }

    #[test]
    fn a_link_in_place_of_a_directory_on_the_way_is_refused() {
        let (_tmp, root, other) = dirs();
        symlink(&other, root.join("via")).expect("link");
        let error = read(&root, Path::new("via/secret.txt"), 100).expect_err("a link");
        assert!(error.to_string().contains("not a directory"), "{error}");
        assert!(entries(&root, Path::new("via")).is_err());
        assert!(create_dirs(&root, Path::new("via/deeper"), 0o700).is_err());
        assert!(
            !other.join("deeper").exists(),
            "nothing made through the link"
        );
    }

    #[test]
    fn removing_a_flat_directory_removes_its_files_and_links_never_what_they_point_to() {
        let (_tmp, root, other) = dirs();
        std::fs::write(root.join("sub/a.png"), "png").expect("write");
        symlink(other.join("secret.txt"), root.join("sub/link.txt")).expect("link");
        assert!(remove_flat_dir(&root, Path::new("sub")).expect("removed"));
        assert!(!root.join("sub").exists());
        assert_eq!(
            std::fs::read_to_string(other.join("secret.txt")).expect("theirs"),
            "theirs",
            "a link's target is left alone"
        );
        // Gone already: nothing to do.
        assert!(remove_flat_dir(&root, Path::new("sub")).expect("gone"));
        // Through a link on the way: refused, the other side untouched; a link in its
        // place: the link goes, never what it points to.
        symlink(&other, root.join("via")).expect("link");
        assert!(remove_flat_dir(&root, Path::new("via/x")).is_err());
        assert!(remove_flat_dir(&root, Path::new("via")).expect("the link goes"));
        assert!(std::fs::symlink_metadata(root.join("via")).is_err());
        assert!(other.join("secret.txt").exists());
        // A directory inside is left, and so is the directory holding it.
        std::fs::create_dir_all(root.join("kept/inner")).expect("mkdir");
        std::fs::write(root.join("kept/b.txt"), "b").expect("write");
        assert!(!remove_flat_dir(&root, Path::new("kept")).expect("partly"));
        assert!(root.join("kept/inner").is_dir() && !root.join("kept/b.txt").exists());
    }

    #[test]
    fn a_flat_directory_of_more_entries_than_a_batch_is_removed_batch_by_batch() {
        let (_tmp, root, _other) = dirs();
        for i in 0..10 {
            std::fs::write(root.join(format!("sub/{i}.txt")), "x").expect("write");
        }
        assert!(remove_flat_dir_in_batches(&root, Path::new("sub"), 3).expect("removed"));
        assert!(!root.join("sub").exists());
        // With a directory inside, every file still goes, over as many batches.
        std::fs::create_dir_all(root.join("kept/inner")).expect("mkdir");
        for i in 0..7 {
            std::fs::write(root.join(format!("kept/{i}.txt")), "x").expect("write");
        }
        assert!(!remove_flat_dir_in_batches(&root, Path::new("kept"), 2).expect("partly"));
        let left: Vec<_> = std::fs::read_dir(root.join("kept"))
            .expect("kept")
            .filter_map(Result::ok)
            .map(|e| e.file_name())
            .collect();
        assert_eq!(left, ["inner"]);
        // What a directory's files take, links and directories counting nothing.
        std::fs::write(root.join("kept/a.txt"), "abc").expect("write");
        std::fs::write(root.join("kept/b.txt"), "de").expect("write");
        symlink(root.join("kept/a.txt"), root.join("kept/link")).expect("link");
        assert_eq!(flat_dir_bytes(&root, Path::new("kept")).expect("bytes"), 5);
        assert_eq!(
            flat_dir_bytes(&root, Path::new("none")).expect("missing"),
            0
        );
    }

    #[test]
    fn the_root_itself_must_not_be_a_link() {
        let (tmp, _root, other) = dirs();
        let linked = tmp.path().join("linked");
        symlink(&other, &linked).expect("link");
        assert!(read(&linked, Path::new("secret.txt"), 100).is_err());
    }

    #[test]
    fn a_fifo_is_refused_at_once_instead_of_blocking_the_reader() {
        let (_tmp, root, _) = dirs();
        mkfifo(&root.join("sub/pipe.json"));
        let (tx, rx) = std::sync::mpsc::channel();
        let reader = root.clone();
        std::thread::spawn(move || {
            let _ = tx.send(read(&reader, Path::new("sub/pipe.json"), 100));
        });
        let result = rx
            .recv_timeout(std::time::Duration::from_secs(10))
            .expect("the read came back instead of blocking on the FIFO");
        let error = result.expect_err("a FIFO");
        assert!(error.to_string().contains("not a regular file"), "{error}");
    }

    #[test]
    fn a_file_past_the_limit_is_refused() {
        let (_tmp, root, _) = dirs();
        std::fs::write(root.join("big"), "x".repeat(11)).expect("write");
        let error = read(&root, Path::new("big"), 10).expect_err("too large");
        assert_eq!(error.kind(), io::ErrorKind::InvalidData);
        assert_eq!(read(&root, Path::new("big"), 11).expect("read").len(), 11);
    }

    #[test]
    fn paths_that_climb_or_start_at_the_root_are_refused() {
        let (_tmp, root, _) = dirs();
        for rel in [
            "../other/secret.txt",
            "/etc/passwd",
            "sub/../../other/secret.txt",
        ] {
            assert!(read(&root, Path::new(rel), 100).is_err(), "{rel}");
        }
    }

    #[test]
    fn a_directory_of_more_entries_than_the_bound_is_refused_not_held() {
        let (_tmp, root, _other) = dirs();
        for n in 0..5 {
            std::fs::write(root.join(format!("sub/f{n}")), "").expect("file");
        }
        let all = |_: &std::ffi::OsStr, _| true;
        let listed = entries_of(open_dir(&root, Path::new("sub")).expect("open"), 5, all);
        assert_eq!(listed.expect("five fit").len(), 5);
        // Only what is kept counts.
        let one = |name: &std::ffi::OsStr, _| name == "f3";
        let kept = entries_of(open_dir(&root, Path::new("sub")).expect("open"), 1, one);
        assert_eq!(kept.expect("one kept").len(), 1);
        let refused = entries_of(open_dir(&root, Path::new("sub")).expect("open"), 4, all);
        assert_eq!(
            refused.expect_err("refused").kind(),
            io::ErrorKind::InvalidData
        );
    }

    #[test]
    fn entries_report_links_as_other_and_never_follow_them() {
        let (_tmp, root, other) = dirs();
        std::fs::write(root.join("sub/f"), "").expect("file");
        std::fs::create_dir(root.join("sub/d")).expect("dir");
        symlink(&other, root.join("sub/l")).expect("link");
        let mut found = entries(&root, Path::new("sub")).expect("entries");
        found.sort();
        assert_eq!(
            found,
            vec![
                (OsString::from("d"), EntryKind::Dir),
                (OsString::from("f"), EntryKind::File),
                (OsString::from("l"), EntryKind::Other),
            ]
        );
    }

    #[test]
    fn a_replace_over_a_link_replaces_the_link_and_leaves_its_target_alone() {
        let (_tmp, root, other) = dirs();
        symlink(other.join("secret.txt"), root.join("sub/settings.json")).expect("link");
        replace(&root, Path::new("sub/settings.json"), b"ours", 0o600).expect("replace");
        assert_eq!(
            std::fs::read_to_string(other.join("secret.txt")).expect("target"),
            "theirs"
        );
        let meta = std::fs::symlink_metadata(root.join("sub/settings.json")).expect("meta");
        assert!(meta.is_file(), "the link itself was replaced by a file");
        assert_eq!(
            read(&root, Path::new("sub/settings.json"), 10).expect("read"),
            b"ours"
        );
        let left: Vec<_> = std::fs::read_dir(root.join("sub"))
            .expect("list")
            .filter_map(Result::ok)
            .filter(|e| e.file_name().to_string_lossy().contains(".tmp-"))
            .collect();
        assert!(left.is_empty(), "no temporary file left: {left:?}");
    }

    #[test]
    fn create_new_never_writes_through_a_link() {
        let (_tmp, root, other) = dirs();
        symlink(other.join("secret.txt"), root.join("sub/x.md")).expect("link");
        assert!(create_new(&root, Path::new("sub/x.md"), b"ours", 0o600).is_err());
        assert_eq!(
            std::fs::read_to_string(other.join("secret.txt")).expect("target"),
            "theirs"
        );
        create_new(&root, Path::new("sub/y.md"), b"ours", 0o600).expect("create");
        assert_eq!(std::fs::read(root.join("sub/y.md")).expect("read"), b"ours");
    }

    #[test]
    fn create_dirs_makes_what_is_missing_with_its_mode() {
        use std::os::unix::fs::PermissionsExt;
        let (_tmp, root, _) = dirs();
        create_dirs(&root, Path::new("a/b"), 0o700).expect("create");
        create_dirs(&root, Path::new("a/b"), 0o700).expect("again");
        let mode = std::fs::metadata(root.join("a/b"))
            .expect("meta")
            .permissions()
            .mode();
        assert_eq!(mode & 0o077, 0, "{mode:o}");
    }
}
