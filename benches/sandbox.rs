//! Prints what the sandbox wrapper (`copilot-pool sandbox-exec`: drop capabilities, apply the
//! Landlock ruleset, exec) adds to a worker's start: `/bin/true` run directly and through
//! the wrapper, and a real runtime worker started (spawn + `connect`) without and with the
//! sandbox, alternating so both see the same machine.
//!
//! Run with `cargo bench --bench sandbox`. Numbers are wall-clock on this machine; they are
//! printed, never asserted.

#[path = "../tests/support/runtime.rs"]
mod runtime;
#[path = "support/summary.rs"]
mod summary;

use std::path::{Path, PathBuf};
use std::time::Instant;

use copilot_pool::sandbox::Sandbox;
use copilot_pool::worker::{WorkerConfig, WorkerHandle};
use summary::summary;

const EXECS: usize = 50;
const STARTS: usize = 10;

fn sandbox() -> Sandbox {
    let wrapper = PathBuf::from(env!("CARGO_BIN_EXE_copilot-pool"));
    Sandbox::new(wrapper, vec!["sandbox-exec".into()])
}

fn run(program: &Path, args: &[std::ffi::OsString]) {
    let status = std::process::Command::new(program)
        .args(args)
        .status()
        .expect("run");
    assert!(status.success(), "{}: {status}", program.display());
}

#[tokio::main]
async fn main() {
    let truth = Path::new("/bin/true");
    let (wrapper, argv) = sandbox().command(truth, &[]);
    let (mut direct, mut wrapped) = (Vec::new(), Vec::new());
    for _ in 0..EXECS {
        let t = Instant::now();
        run(truth, &[]);
        direct.push(t.elapsed());
        let t = Instant::now();
        run(&wrapper, &argv);
        wrapped.push(t.elapsed());
    }
    summary("/bin/true", direct);
    summary("/bin/true through sandbox-exec", wrapped);

    let program = runtime::runtime_path().await;
    let scratch = tempfile::tempdir().expect("tempdir");
    let config = |i: usize, sandboxed: bool| {
        let agent = scratch.path().join(format!("agent-{i}"));
        let home = agent.join("copilot");
        std::fs::create_dir_all(&home).expect("home");
        let mut c = WorkerConfig::new(program.clone(), home.clone(), home);
        if sandboxed {
            c.sandbox = Some(sandbox().for_agent(&agent, &[]).expect("sandbox"));
        } else {
            c.extra_env = vec![("HOME".into(), agent.display().to_string())];
        }
        c
    };
    let (mut plain, mut walled) = (Vec::new(), Vec::new());
    for i in 0..STARTS {
        for (sandboxed, samples) in [(false, &mut plain), (true, &mut walled)] {
            let t = Instant::now();
            let worker = WorkerHandle::start(config(2 * i + usize::from(sandboxed), sandboxed))
                .await
                .expect("start");
            samples.push(t.elapsed());
            worker.shutdown().await;
        }
    }
    summary("worker start", plain);
    summary("worker start in the sandbox", walled);
}
