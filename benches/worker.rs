//! Prints how long the worker takes for the things a gateway waits on, against the real
//! runtime and the scripted model: start (spawn + `connect`), session create, one plain turn,
//! and the time from `kill -9` of the child to the typed error reaching an open turn.
//!
//! Run with `cargo bench --bench worker`. Numbers are wall-clock on this machine; they are
//! printed, never asserted.

#[path = "../tests/support/runtime.rs"]
mod runtime;
#[path = "support/summary.rs"]
mod summary;

use std::time::Instant;

use copilot_pool::rpc::EventKind;
use copilot_pool::rpc::messages::{ProviderConfig, SessionConfig};
use copilot_pool::scripted_model::ScriptedModel;
use copilot_pool::worker::{Session, SessionUpdate, WorkerConfig, WorkerHandle};
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use summary::summary;

const STARTS: usize = 20;
const TURNS: usize = 50;
const KILLS: usize = 10;

async fn idle(session: &mut Session) {
    while let Some(update) = session.next().await {
        match update {
            SessionUpdate::Event(e) if matches!(e.kind, EventKind::SessionIdle(_)) => return,
            SessionUpdate::Ended(err) => panic!("worker ended: {err}"),
            _ => {}
        }
    }
}

#[tokio::main]
async fn main() {
    let program = runtime::runtime_path().await;
    let model = ScriptedModel::new();
    let endpoint = model.serve_http().await.expect("model");
    let scratch = tempfile::tempdir().expect("tempdir");
    let config = |i: usize| {
        let home = scratch.path().join(format!("home-{i}"));
        std::fs::create_dir_all(&home).expect("home");
        let mut c = WorkerConfig::new(program.clone(), home.clone(), scratch.path().to_path_buf());
        c.extra_env = vec![("HOME".into(), home.display().to_string())];
        c
    };
    let session_config = || SessionConfig {
        model: Some(ScriptedModel::MODEL_ID.into()),
        provider: Some(ProviderConfig::openai(
            endpoint.base_url(),
            Some("k".into()),
        )),
        available_tools: Some(vec![]),
        streaming: true,
        ..Default::default()
    };
    println!("runtime: {}", program.display());

    let mut starts = Vec::new();
    let mut creates = Vec::new();
    for i in 0..STARTS {
        let t = Instant::now();
        let worker = WorkerHandle::start(config(i)).await.expect("start");
        starts.push(t.elapsed());
        let t = Instant::now();
        let session = worker
            .create_session(session_config())
            .await
            .expect("create");
        creates.push(t.elapsed());
        drop(session);
        worker.shutdown().await;
    }
    summary("start (spawn + connect)", starts);
    summary("session.create", creates);

    let worker = WorkerHandle::start(config(1000)).await.expect("start");
    let mut session = worker
        .create_session(session_config())
        .await
        .expect("create");
    let mut turns = Vec::new();
    for i in 0..TURNS {
        let t = Instant::now();
        session.send(format!("REPLY=turn {i}")).await.expect("send");
        idle(&mut session).await;
        turns.push(t.elapsed());
    }
    summary("plain turn (send → idle)", turns);
    drop(session);
    worker.shutdown().await;

    let mut kills = Vec::new();
    for i in 0..KILLS {
        let worker = WorkerHandle::start(config(2000 + i)).await.expect("start");
        let mut session = worker
            .create_session(session_config())
            .await
            .expect("create");
        session
            .send("SCENARIO:slow SLOW=100x100")
            .await
            .expect("send");
        loop {
            match session.next().await {
                Some(SessionUpdate::Event(e))
                    if matches!(e.kind, EventKind::AssistantMessageDelta(_)) =>
                {
                    break;
                }
                Some(SessionUpdate::Ended(err)) => panic!("{err}"),
                Some(_) => {}
                None => panic!("stream ended"),
            }
        }
        let t = Instant::now();
        kill(Pid::from_raw(worker.pid() as i32), Signal::SIGKILL).expect("kill");
        loop {
            match session.next().await {
                Some(SessionUpdate::Ended(_)) => break,
                Some(_) => {}
                None => panic!("stream ended without Ended"),
            }
        }
        kills.push(t.elapsed());
    }
    summary("kill -9 → typed error", kills);
}
