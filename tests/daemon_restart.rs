//! End to end: the daemon dies (`kill -9`) and comes back. Every runtime child dies with
//! it (parent-death signal), and the restarted daemon kills the survivors its process-group
//! ledger names (and only those) before it resumes a conversation.

mod support;

use std::os::unix::process::CommandExt;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use copilot_pool::group_ledger::{GroupLedger, LEDGER_FILE};
use copilot_pool::scripted_model::ScriptedModel;
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use serde_json::json;
use support::api::{summary, turn};
use support::http::{Daemon, SseStream, call};

/// Processes whose COPILOT_HOME lies under `dir` (the daemon's runtime children).
fn children_under(dir: &std::path::Path) -> Vec<u32> {
    support::procs::with_env_prefix("COPILOT_HOME", &dir.display().to_string())
}

/// Fields 5 (pgrp), 6 (session) and 22 (start time) of `/proc/<pid>/stat`.
fn stat(pid: u32) -> (u32, u32, u64) {
    let text = std::fs::read_to_string(format!("/proc/{pid}/stat")).expect("stat");
    let rest = &text[text.rfind(')').expect("stat line") + 1..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    (
        fields[2].parse().unwrap(),
        fields[3].parse().unwrap(),
        fields[19].parse().unwrap(),
    )
}

fn boot_id() -> String {
    std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
        .expect("boot id")
        .trim()
        .to_owned()
}

/// A ledger entry as the daemon writes it, for `pgid` with `start_time`.
fn entry(pgid: u32, start_time: u64) -> serde_json::Value {
    let (_, sid, _) = stat(pgid);
    json!({"pgid": pgid, "start_time": start_time, "sid": sid, "boot_id": boot_id()})
}

fn write_ledger(path: &std::path::Path, groups: &[serde_json::Value]) {
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    let text = json!({"version": 1, "groups": groups}).to_string();
    std::fs::write(path, text).unwrap();
}

/// `sleep 300` leading its own process group, as the daemon starts a runtime.
fn group_leader(script: &str) -> Child {
    Command::new("/bin/sh")
        .args(["-c", script])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .process_group(0)
        .spawn()
        .expect("spawn")
}

/// Waits (bounded) for our child to end; `None` if it is still running after `limit`.
fn ended_within(child: &mut Child, limit: Duration) -> Option<std::process::ExitStatus> {
    let deadline = Instant::now() + limit;
    loop {
        if let Some(status) = child.try_wait().expect("try_wait") {
            return Some(status);
        }
        if Instant::now() >= deadline {
            return None;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

#[tokio::test]
async fn kill_9_of_the_daemon_mid_turn_takes_its_runtimes_along_and_the_restart_resumes_with_the_history()
 {
    let scratch = support::Scratch::new();
    let model = ScriptedModel::new();
    let endpoint = model.serve_http().await.expect("model");
    let url = endpoint.base_url();
    let daemon = Daemon::start(scratch.path(), "", &[]).await;
    let first = summary(
        daemon.addr,
        None,
        &turn(
            &url,
            "agent-r",
            "conv",
            "REPLY=first MARKER-before-the-crash",
        ),
    )
    .await;
    assert_eq!(first.json()["status"], "idle", "{}", first.json());
    // A second conversation is mid-turn when the daemon dies.
    let mut slow = SseStream::open(
        daemon.addr,
        "/v1/turns",
        None,
        &turn(&url, "agent-s", "conv", "SCENARIO:slow SLOW=200x100"),
    )
    .await;
    slow.until_event("assistant.message_delta").await;
    // The runtime writes a session's state in the background: a session killed before it
    // reached the disk has nothing to resume (the pool then says `not-found`, honestly). Wait
    // for it to be there, so the kill tests the pool's resume, not the runtime's flush.
    let state = scratch
        .path()
        .join("pool-home/agents/agent-s/copilot/session-state");
    let persisted = || {
        std::fs::read_dir(&state).is_ok_and(|d| {
            d.flatten().any(|e| {
                e.path().join("events.jsonl").is_file() && e.path().join("workspace.yaml").is_file()
            })
        })
    };
    let deadline = Instant::now() + Duration::from_secs(10);
    while !persisted() {
        assert!(
            Instant::now() < deadline,
            "the runtime never wrote the session's state under {}",
            state.display()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let runtimes = children_under(scratch.path());
    assert!(runtimes.len() >= 2, "one runtime per agent: {runtimes:?}");

    let killed_at = Instant::now();
    let mut daemon = daemon;
    daemon.child.start_kill().expect("kill -9 the daemon");
    daemon.child.wait().await.expect("reap the daemon");
    let left =
        support::procs::wait_none(|| children_under(scratch.path()), Duration::from_secs(5)).await;
    let gone_after = killed_at.elapsed();
    println!("kill -9 of the daemon -> its runtimes gone after {gone_after:?}");
    assert!(left.is_empty(), "runtimes outlived the daemon: {left:?}");
    drop(daemon);

    // The same state directory: the conversation resumes from its binding.
    let daemon = Daemon::start(scratch.path(), "", &[]).await;
    let after = summary(
        daemon.addr,
        None,
        &turn(&url, "agent-r", "conv", "REPLY=after"),
    )
    .await;
    let end = after.json();
    assert_eq!(end["status"], "idle", "{end}");
    assert_eq!(end["resumed"], true, "{end}");
    let last = model.requests().pop().expect("a model request");
    let history = serde_json::to_string(last.messages()).expect("json");
    assert!(
        history.contains("MARKER-before-the-crash"),
        "the resumed conversation lost its history: {history}"
    );
    // The conversation that was mid-turn when the daemon died resumes from its binding too.
    let after_slow = summary(
        daemon.addr,
        None,
        &turn(&url, "agent-s", "conv", "REPLY=after the crash"),
    )
    .await;
    let end = after_slow.json();
    assert_eq!(end["status"], "idle", "{end}");
    assert_eq!(end["resumed"], true, "{end}");
    let metrics = call(daemon.addr, "GET", "/metrics", None, None).await;
    assert!(
        metrics
            .body
            .contains("copilot_pool_ownership_violations_total 0"),
        "a session was attached twice:\n{}",
        metrics.body
    );
    daemon.terminate().await;
}

#[tokio::test]
async fn a_restarted_daemon_kills_the_recorded_groups_that_survived_and_spares_a_reused_pid() {
    let scratch = support::Scratch::new();
    // A survivor: a group leader of the "previous run", recorded with its own start time.
    let mut survivor = group_leader("exec sleep 300");
    let survivor_pid = survivor.id();
    let (_, _, survivor_start) = stat(survivor_pid);
    // A pid reused since: the process now at the recorded pid started at another time.
    let mut bystander = group_leader("exec sleep 300");
    let bystander_pid = bystander.id();
    let (_, _, bystander_start) = stat(bystander_pid);
    let ledger = scratch
        .path()
        .join("pool-home")
        .join("state")
        .join(LEDGER_FILE);
    write_ledger(
        &ledger,
        &[
            entry(survivor_pid, survivor_start),
            entry(bystander_pid, bystander_start.saturating_sub(1)),
        ],
    );

    // Reaped as soon as it dies: the takeover waits for the recorded processes to be gone,
    // zombies included.
    let survivor_reaped = std::thread::spawn(move || survivor.wait().expect("wait"));
    let daemon = Daemon::start(scratch.path(), "", &[]).await;
    // Killed before the daemon listened (the takeover comes before the pool).
    assert!(
        survivor_reaped.is_finished(),
        "the survivor still ran when the daemon was up"
    );
    let status = survivor_reaped.join().expect("reaper thread");
    use std::os::unix::process::ExitStatusExt;
    assert_eq!(status.signal(), Some(9), "{status:?}");
    assert!(
        ended_within(&mut bystander, Duration::from_millis(300)).is_none(),
        "a process at a reused pid was killed"
    );
    // The ledger now holds this run's groups only.
    let text = std::fs::read_to_string(&ledger).expect("ledger rewritten");
    assert!(
        !text.contains(&format!("\"pgid\":{survivor_pid},")),
        "{text}"
    );
    daemon.terminate().await;
    let _ = bystander.kill();
    let _ = bystander.wait();
}

/// The pid `child` prints on the first line of its stdout (`... & echo $!`).
fn first_line_pid(child: &mut std::process::Child) -> u32 {
    let mut line = String::new();
    let stdout = child.stdout.take().expect("piped stdout");
    std::io::BufRead::read_line(&mut std::io::BufReader::new(stdout), &mut line).expect("a line");
    line.trim().parse().expect("a pid")
}

#[tokio::test]
async fn the_takeover_kills_what_is_left_of_a_group_whose_leader_is_gone() {
    let scratch = support::Scratch::new();
    // The leader exits at once (as a runtime killed by its parent-death signal would); the
    // child it started (a tool process, say) stays in its group.
    let (pgid, member, recorded) = gone_leaders_group("run-a", "run-a");
    let (ledger, report) = taken_over(&scratch, recorded).await;
    assert_eq!(report.recorded, 1);
    assert_eq!(report.killed, vec![member]);
    // Not our child: gone or a zombie of init.
    let gone = support::procs::wait_none(
        || {
            support::procs::group_members(pgid)
                .into_iter()
                .filter(|(_, state)| *state != 'Z')
                .map(|(pid, _)| pid)
                .collect()
        },
        Duration::from_secs(5),
    )
    .await;
    assert!(gone.is_empty(), "{gone:?}");
    assert!(ledger.previous().is_empty());
    let _ = kill(Pid::from_raw(member as i32), Signal::SIGKILL);
}

/// A ledger holding `recorded` alone, opened and taken over (as a restarted daemon does).
async fn taken_over(
    scratch: &support::Scratch,
    recorded: serde_json::Value,
) -> (
    std::sync::Arc<GroupLedger>,
    copilot_pool::group_ledger::TakeOver,
) {
    let path = scratch.path().join(LEDGER_FILE);
    write_ledger(&path, &[recorded]);
    let ledger = GroupLedger::open(&path).expect("ledger");
    let report = ledger
        .take_over(Duration::from_secs(5))
        .await
        .expect("take over");
    (ledger, report)
}

/// A group whose leader (marked `marker` in its environment, as the daemon marks its
/// children) exited at once, leaving a child in the group (a tool process, say), as a
/// runtime killed by its parent-death signal would; and its ledger entry for the run
/// `recorded_run`. Returns the group, the member and the entry.
fn gone_leaders_group(marker: &str, recorded_run: &str) -> (u32, u32, serde_json::Value) {
    let mut leader = Command::new("/bin/sh")
        .args(["-c", "sleep 300 & echo $!"])
        .env(copilot_pool::process::RUN_MARKER_VAR, marker)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .process_group(0)
        .spawn()
        .expect("spawn");
    let pgid = leader.id();
    let (_, _, leader_start) = stat(pgid);
    let member = first_line_pid(&mut leader);
    let mut recorded = entry(pgid, leader_start);
    recorded["run"] = json!(recorded_run);
    assert!(leader.wait().expect("leader exits").success());
    assert_eq!(stat(member).0, pgid, "the member is still in the group");
    (pgid, member, recorded)
}

#[tokio::test]
async fn the_takeover_leaves_a_group_whose_leader_is_gone_when_its_members_are_not_of_the_recorded_run()
 {
    let scratch = support::Scratch::new();
    // The group's id handed out again (a restarted container numbers from 1 again): same
    // group, same session, a later start, but not the recorded run's processes.
    let (_, member, recorded) = gone_leaders_group("another-run", "run-a");
    let (_, report) = taken_over(&scratch, recorded).await;
    assert!(report.killed.is_empty(), "{:?}", report.killed);
    assert!(
        stat(member).2 > 0 && kill(Pid::from_raw(member as i32), None).is_ok(),
        "the process is left alone"
    );
    let _ = kill(Pid::from_raw(member as i32), Signal::SIGKILL);
}

#[tokio::test]
async fn the_takeover_kills_what_left_the_group_but_not_the_session_its_leader_made() {
    let scratch = support::Scratch::new();
    // A leader in a session of its own (as every runtime is) starts a tool that moves to a
    // process group of its own (GNU timeout does), then exits.
    // setsid(1) makes the session itself (our child leads no group, so it does not fork).
    let mut cmd = Command::new("setsid");
    cmd.args(["/bin/sh", "-c", "timeout 300 sleep 300 & echo $!"])
        .stdin(Stdio::null())
        .stdout(Stdio::piped());
    let mut leader = cmd.spawn().expect("spawn");
    let sid = leader.id();
    let (_, _, leader_start) = stat(sid);
    let escaped = first_line_pid(&mut leader);
    let recorded = entry(sid, leader_start);
    assert!(leader.wait().expect("leader exits").success());
    let deadline = Instant::now() + Duration::from_secs(10);
    while stat(escaped).0 != escaped {
        assert!(Instant::now() < deadline, "timeout never left the group");
        tokio::task::yield_now().await;
    }
    assert_eq!(stat(escaped).1, sid, "still in the leader's session");
    let (_, report) = taken_over(&scratch, recorded).await;
    assert!(report.killed.contains(&escaped), "{:?}", report.killed);
    let _ = kill(Pid::from_raw(escaped as i32), Signal::SIGKILL);
}

/// Pids of the runtime group leaders the daemon recorded in its ledger (`state_dir`).
fn recorded_leaders(state_dir: &std::path::Path) -> Vec<u32> {
    let text = std::fs::read_to_string(state_dir.join(LEDGER_FILE)).expect("ledger");
    let value: serde_json::Value = serde_json::from_str(&text).expect("ledger json");
    value["groups"]
        .as_array()
        .expect("groups")
        .iter()
        .map(|g| g["pgid"].as_u64().expect("pgid") as u32)
        .collect()
}

#[tokio::test]
async fn a_runtime_that_outlives_its_input_dies_with_the_daemon_and_what_it_left_in_its_group_dies_at_the_restart()
 {
    let scratch = support::Scratch::new();
    let model = ScriptedModel::new();
    let endpoint = model.serve_http().await.expect("model");
    let url = endpoint.base_url();
    // The real runtime ends at the end of its input. This one reads a FIFO that a process
    // left in its group (as a tool would be) keeps open, and ignores SIGHUP: only the
    // parent-death signal ends it when the daemon dies. The leftover lives on until the
    // restarted daemon's takeover.
    let real = support::runtime::runtime_path().await;
    let shim = scratch.path().join("runtime-shim.sh");
    std::fs::write(
        &shim,
        format!(
            "#!/bin/sh\ntrap '' HUP\nfifo=\"${{TMPDIR:-/tmp}}/in-$$\"\nmkfifo \"$fifo\" || exit 1\n\
             exec 3<&0\nsleep 300 > \"$fifo\" &\ncat <&3 > \"$fifo\" &\n\
             exec {} \"$@\" < \"$fifo\" 3<&-\n",
            real.display()
        ),
    )
    .expect("shim");
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&shim, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    // Unsandboxed (the sandbox lets a worker execute only its configured program's install),
    // so the API needs its token.
    let token = "restart-test-token";
    let config = format!(
        "cli_path = \"{}\"\nsandbox = \"off\"\napi_token = \"{token}\"\n",
        shim.display()
    );
    let state_dir = scratch.path().join("pool-home").join("state");

    let daemon = Daemon::start(scratch.path(), &config, &[]).await;
    let first = summary(
        daemon.addr,
        Some(token),
        &turn(&url, "agent-f", "conv", "REPLY=first MARKER-kept"),
    )
    .await;
    assert_eq!(first.json()["status"], "idle", "{}", first.json());
    let leaders = recorded_leaders(&state_dir);
    assert_eq!(leaders.len(), 1, "{leaders:?}");
    let leader = leaders[0];
    let leftovers: Vec<u32> = support::procs::group_members(leader)
        .into_iter()
        .map(|(pid, _)| pid)
        .filter(|pid| *pid != leader)
        .collect();
    assert!(
        !leftovers.is_empty(),
        "the shim's sleep and cat are in the group"
    );

    let killed_at = Instant::now();
    let mut daemon = daemon;
    daemon.child.start_kill().expect("kill -9 the daemon");
    daemon.child.wait().await.expect("reap the daemon");
    let alive = |pids: Vec<u32>| -> Vec<u32> {
        pids.into_iter()
            .filter(|p| {
                std::fs::read_to_string(format!("/proc/{p}/stat"))
                    .ok()
                    .and_then(|s| {
                        let state = s[s.rfind(')')? + 1..].split_whitespace().next()?.to_owned();
                        Some(state != "Z")
                    })
                    .unwrap_or(false)
            })
            .collect()
    };
    let left = support::procs::wait_none(|| alive(vec![leader]), Duration::from_secs(5)).await;
    println!(
        "kill -9 of the daemon -> a runtime blind to its input gone after {:?}",
        killed_at.elapsed()
    );
    assert!(left.is_empty(), "the runtime outlived the daemon: {left:?}");
    let sleep_left = alive(leftovers.clone());
    assert!(
        !sleep_left.is_empty(),
        "the leftover in the group should still run until the takeover"
    );
    drop(daemon);

    let daemon = Daemon::start(scratch.path(), &config, &[]).await;
    let left = alive(leftovers);
    assert!(left.is_empty(), "the takeover left {left:?} alive");
    let after = summary(
        daemon.addr,
        Some(token),
        &turn(&url, "agent-f", "conv", "REPLY=after"),
    )
    .await;
    assert_eq!(after.json()["status"], "idle", "{}", after.json());
    assert_eq!(after.json()["resumed"], true, "{}", after.json());
    let last = model.requests().pop().expect("a model request");
    assert!(
        serde_json::to_string(last.messages())
            .expect("json")
            .contains("MARKER-kept")
    );
    let metrics = call(daemon.addr, "GET", "/metrics", Some(token), None).await;
    assert!(
        metrics
            .body
            .contains("copilot_pool_ownership_violations_total 0"),
        "a session was attached twice"
    );
    daemon.terminate().await;
}
