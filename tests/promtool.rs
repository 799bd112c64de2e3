//! The test support's promtool install (tests/support/promtool.rs) with fake installers: one
//! install per cache under the lock, one deadline that kills the installer's process group, and
//! errors that name the manual install command. The real install (Debian's package) runs in
//! `daemon::metrics_are_valid_prometheus_text_with_the_documented_names` when promtool is
//! neither cached nor on PATH.

mod support;

use std::path::{Path, PathBuf};
use std::time::Duration;

use nix::fcntl::{Flock, FlockArg};
use support::promtool::{INSTALL_COMMAND, PromtoolError, install, lock_path, tools_dir};

/// A fake installer script in `dir`: appends a line to `<dir>/runs`, runs `body`, then puts an
/// executable `promtool` into the `--dir` it is given (with one rename) and prints its path.
fn fake_installer(dir: &Path, body: &str) -> PathBuf {
    let script = dir.join("install.sh");
    let text = format!(
        "set -eu\n\
         out=\"$2\"\n\
         echo run >> '{runs}'\n\
         {body}\n\
         mkdir -p \"$out\"\n\
         printf '#!/bin/sh\\n' > \"$out/.promtool.part\"\n\
         chmod 755 \"$out/.promtool.part\"\n\
         mv \"$out/.promtool.part\" \"$out/promtool\"\n\
         echo \"$out/promtool\"\n",
        runs = dir.join("runs").display(),
    );
    std::fs::write(&script, text).expect("write the fake installer");
    script
}

fn runs(dir: &Path) -> usize {
    std::fs::read_to_string(dir.join("runs"))
        .map(|s| s.lines().count())
        .unwrap_or(0)
}

/// Waits (bounded) for `<dir>/pid`, written by a fake installer's body.
async fn read_pid(dir: &Path) -> u32 {
    let path = dir.join("pid");
    for _ in 0..200 {
        if let Ok(text) = std::fs::read_to_string(&path)
            && let Ok(pid) = text.trim().parse()
        {
            return pid;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    panic!("the fake installer never wrote {}", path.display());
}

/// A body that starts a long child in the installer's group, records the group, and waits.
fn hanging_body(dir: &Path) -> String {
    format!(
        "sleep 600 &\necho $$ > '{}'\nwait\n",
        dir.join("pid").display()
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_installs_into_one_cache_run_the_installer_once_and_agree() {
    let tools = tempfile::tempdir().expect("tempdir");
    let cache = tempfile::tempdir().expect("tempdir");
    // Long enough that two unlocked installs would both see no promtool and both run.
    let script = fake_installer(tools.path(), "sleep 0.5");
    let timeout = Duration::from_secs(30);
    let (a, b) = tokio::join!(
        tokio::spawn({
            let (script, cache) = (script.clone(), cache.path().to_path_buf());
            async move { install(&script, &cache, timeout).await }
        }),
        tokio::spawn({
            let (script, cache) = (script.clone(), cache.path().to_path_buf());
            async move { install(&script, &cache, timeout).await }
        }),
    );
    let a = a.expect("join").expect("first install");
    let b = b.expect("join").expect("second install");
    assert_eq!(a, b);
    assert_eq!(a, tools_dir(cache.path()).join("promtool"));
    assert_eq!(runs(tools.path()), 1, "the installer ran more than once");
    // A later install finds it in the cache.
    let again = install(&script, cache.path(), timeout)
        .await
        .expect("again");
    assert_eq!(again, a);
    assert_eq!(runs(tools.path()), 1);
}

#[tokio::test]
async fn an_installer_past_the_deadline_is_killed_with_its_process_group() {
    let tools = tempfile::tempdir().expect("tempdir");
    let cache = tempfile::tempdir().expect("tempdir");
    let script = fake_installer(tools.path(), &hanging_body(tools.path()));
    let timeout = Duration::from_secs(1);
    let err = install(&script, cache.path(), timeout)
        .await
        .expect_err("a hanging installer must time out");
    assert!(
        matches!(err, PromtoolError::Timeout { after, .. } if after == timeout),
        "{err:?}"
    );
    let message = err.to_string();
    assert!(message.contains(INSTALL_COMMAND), "{message}");
    assert!(message.contains("PROMTOOL"), "{message}");
    let group = read_pid(tools.path()).await;
    let left = support::procs::wait_group_gone(group, Duration::from_secs(5)).await;
    assert!(left.is_empty(), "installer group {group} left: {left:?}");
    // The lock was let go: the next install runs at once.
    let good = fake_installer(tools.path(), "true");
    let installed = install(&good, cache.path(), Duration::from_secs(30))
        .await
        .expect("install after a timeout");
    assert_eq!(installed, tools_dir(cache.path()).join("promtool"));
}

#[tokio::test]
async fn dropping_an_install_kills_the_installer_and_its_process_group() {
    let tools = tempfile::tempdir().expect("tempdir");
    let cache = tempfile::tempdir().expect("tempdir");
    let script = fake_installer(tools.path(), &hanging_body(tools.path()));
    let group = tokio::select! {
        result = install(&script, cache.path(), Duration::from_secs(600)) => {
            panic!("the install finished: {result:?}")
        }
        group = read_pid(tools.path()) => group,
    };
    // `select!` has dropped the install future.
    let left = support::procs::wait_group_gone(group, Duration::from_secs(5)).await;
    assert!(left.is_empty(), "installer group {group} left: {left:?}");
}

#[tokio::test]
async fn a_held_install_lock_times_out_naming_the_lock_and_the_manual_fix() {
    let tools = tempfile::tempdir().expect("tempdir");
    let cache = tempfile::tempdir().expect("tempdir");
    let script = fake_installer(tools.path(), "true");
    let lock = lock_path(cache.path());
    let file = std::fs::File::create(&lock).expect("lock file");
    let _held = Flock::lock(file, FlockArg::LockExclusive)
        .map_err(|(_, errno)| errno)
        .expect("hold the lock");
    let timeout = Duration::from_millis(300);
    let err = install(&script, cache.path(), timeout)
        .await
        .expect_err("the lock is held");
    let PromtoolError::LockTimeout { path, after, .. } = &err else {
        panic!("expected LockTimeout, got {err:?}");
    };
    assert_eq!(path, &lock);
    assert_eq!(*after, timeout);
    let message = err.to_string();
    assert!(message.contains(&lock.display().to_string()), "{message}");
    assert!(message.contains(INSTALL_COMMAND), "{message}");
    assert_eq!(runs(tools.path()), 0, "the installer ran without the lock");
}

#[tokio::test]
async fn a_failing_installer_reports_the_end_of_its_output_and_the_manual_fix() {
    let tools = tempfile::tempdir().expect("tempdir");
    let cache = tempfile::tempdir().expect("tempdir");
    let script = fake_installer(
        tools.path(),
        "echo 'E: Unable to locate package prometheus' >&2\nexit 100",
    );
    let err = install(&script, cache.path(), Duration::from_secs(30))
        .await
        .expect_err("the installer fails");
    let PromtoolError::Failed { status, .. } = &err else {
        panic!("expected Failed, got {err:?}");
    };
    assert_eq!(status.code(), Some(100));
    let message = err.to_string();
    assert!(
        message.contains("Unable to locate package prometheus"),
        "{message}"
    );
    assert!(message.contains(INSTALL_COMMAND), "{message}");
    assert!(!tools_dir(cache.path()).join("promtool").exists());
}
