//! `scripts/make-venv.sh`, which gives the tests' Python tools (the official Python SDK,
//! schemathesis) their virtual environments, on a machine without a Python: Debian's Python,
//! unpacked into the cache with the libraries it links, makes an environment whose pip runs. (With a `python3` on `PATH`
//! the script uses it, so on most machines only this test takes the other path; it needs a
//! Debian-like system: apt-get, apt-cache and dpkg-deb, and package lists or root.)

mod support;

use std::time::Duration;

use copilot_pool::runtime;
use tokio::process::Command;
use tokio::time::Instant;

/// A failure guard for one command (the first run downloads ~20 MB of packages).
const LIMIT: Duration = Duration::from_secs(5 * 60);

/// Runs `program args` to its end in its own process group; its stdout, or a panic with what
/// it printed.
async fn run(program: &str, args: &[&str]) -> String {
    let mut command = Command::new(program);
    command.args(args);
    let what = format!("{program} {args:?}");
    support::step::run(&what, command, Instant::now() + LIMIT, "a failure guard")
        .await
        .unwrap_or_else(|error| panic!("{error}"))
}

#[tokio::test]
async fn without_a_python_on_path_debians_python_makes_a_virtual_environment_whose_pip_runs() {
    let dir = tempfile::tempdir().expect("a temporary directory");
    let dest = dir.path().join("venv");
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/scripts/make-venv.sh");
    let dest_text = dest.to_str().expect("a UTF-8 path");
    let printed = run("bash", &[script, "--no-system", dest_text]).await;
    let python = dest.join("bin/python");
    assert_eq!(printed.trim(), python.display().to_string());

    // The environment stands on the Python unpacked into the cache, not on any other.
    let cache = runtime::cache_dir(runtime::process_env).expect("the cache directory");
    let unpacked = std::fs::canonicalize(cache.join("tools/debian-python")).expect("unpacked");
    let python_text = python.to_str().expect("a UTF-8 path");
    let base = run(python_text, &["-c", "import sys; print(sys.base_prefix)"]).await;
    let base = std::fs::canonicalize(base.trim()).expect("the base prefix exists");
    assert!(
        base.starts_with(&unpacked),
        "{} is not under {}",
        base.display(),
        unpacked.display()
    );
    // The libraries a minimal Debian lacks (libexpat, libssl) come from the unpack too, not
    // from this machine: what the interpreter maps, after importing what pip needs.
    let maps = run(
        python_text,
        &[
            "-c",
            "import ssl, pyexpat\n\
             print('\\n'.join({l.split()[-1] for l in open('/proc/self/maps') \
             if 'libexpat' in l or 'libssl' in l}))",
        ],
    )
    .await;
    let libraries: Vec<&str> = maps.lines().collect();
    assert_eq!(libraries.len(), 2, "libexpat and libssl mapped: {maps}");
    for library in libraries {
        let library = std::fs::canonicalize(library).expect("a mapped library exists");
        assert!(
            library.starts_with(&unpacked),
            "{} is not under {}",
            library.display(),
            unpacked.display()
        );
    }
    // Its pip is its own, and runs.
    let pip = run(python_text, &["-m", "pip", "--version"]).await;
    assert!(pip.contains(dest_text), "{pip}");
}
