//! What a turn carries in and out over the HTTP API, end to end against the real runtime and
//! the scripted model: attachments (inline and by path, confined to the agent's work
//! directory and the allowed roots), the agent mode, hooks answered over
//! `/v1/requests/{id}`, compaction with custom instructions, and the `turn.end` summary's
//! usage, model calls, error status and `session.task_complete`, and the session events a turn
//! leaves out of its stream (`omit_events`).

mod support;

use std::time::Duration;

use copilot_pool::http::ApiConfig;
use copilot_pool::scripted_model::{Answer, ScriptedModel};
use serde_json::{Value, json};
use support::api::{
    InProcess, answer, answered_tool_turn, lookup_turn, request_id, settings, summary, turn,
};
use support::http::{Sse, SseStream, call};
use support::pool_fixture::Fixture;

/// A 1x1 PNG.
const PNG: &str = "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNk+M9QDwADhgGAWjR9awAAAABJRU5ErkJggg==";

/// The content parts of the last user message of the model's last request.
fn last_user_parts(fx: &Fixture) -> Vec<Value> {
    let last = fx.model.requests().pop().expect("a model request");
    let user = last
        .messages()
        .iter()
        .rev()
        .find(|m| m["role"] == "user")
        .cloned()
        .expect("a user message");
    match &user["content"] {
        Value::Array(parts) => parts.clone(),
        text => vec![json!({"type": "text", "text": text})],
    }
}

/// The names of the tools the model's last request offered.
fn offered_tools(fx: &Fixture) -> Vec<String> {
    let last = fx.model.requests().pop().expect("a model request");
    last.body["tools"]
        .as_array()
        .map(|tools| {
            tools
                .iter()
                .filter_map(|t| t["function"]["name"].as_str().map(str::to_owned))
                .collect()
        })
        .unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_image_attachment_reaches_the_model_and_paths_outside_the_roots_are_refused() {
    let fx = Fixture::new().await;
    let url = fx.endpoint.base_url();
    let shared = fx.scratch.path().join("shared");
    let outside = fx.scratch.path().join("outside");
    for dir in [&shared, &outside] {
        std::fs::create_dir_all(dir).expect("mkdir");
    }
    std::fs::write(shared.join("notes.md"), "# notes").expect("write");
    std::fs::write(outside.join("secret.txt"), "no").expect("write");
    let mut config = ApiConfig::default();
    config.allowed_work_roots = vec![shared.clone()];
    config.attachments.max_bytes = 1024;
    let server = InProcess::start(fx.config().await, config).await;
    let addr = server.addr;

    // Inline content: written into the work directory, read by the runtime, and sent to
    // the model as an image.
    let mut body = turn(&url, "agent-a", "conv", "REPLY=seen");
    body["attachments"] =
        json!([{"type": "inline", "data": PNG, "media_type": "image/png", "name": "dot.png"}]);
    let done = summary(addr, None, &body).await;
    assert_eq!(done.status, 200, "{}", done.body);
    assert_eq!(done.json()["status"], "idle", "{}", done.body);
    let parts = last_user_parts(&fx);
    let image = format!("data:image/png;base64,{PNG}");
    assert!(
        parts
            .iter()
            .any(|p| p["image_url"]["url"] == image.as_str()),
        "{parts:?}"
    );
    // In the conversation's own directory (its agent's and key's hash), which outlives the
    // turn.
    let conversation_files = fx
        .scratch
        .path()
        .join("agents/agents/agent-a/work/attachments")
        .join(copilot_pool::ids::sha256_hex("agent-a/conv"));
    let written: Vec<_> = std::fs::read_dir(&conversation_files)
        .expect("the attachments directory")
        .filter_map(Result::ok)
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    assert!(
        written.len() == 1 && written[0].ends_with("-dot.png"),
        "{written:?}"
    );

    // A file under an allowed root, by its path: the runtime names it to the model.
    let mut body = turn(&url, "agent-a", "conv", "REPLY=read it");
    body["attachments"] = json!([{"type": "file", "path": shared.join("notes.md")}]);
    let done = summary(addr, None, &body).await;
    assert_eq!(done.json()["status"], "idle", "{}", done.body);
    let text = serde_json::to_string(&last_user_parts(&fx)).expect("json");
    assert!(text.contains("notes.md"), "{text}");
    // A conversation working in a folder of the agent's work directory may name any file of
    // the work directory, by a path relative to its folder too.
    let agent_work = fx.scratch.path().join("agents/agents/agent-a/work");
    std::fs::create_dir_all(agent_work.join("project")).expect("mkdir");
    std::fs::write(agent_work.join("plan.md"), "# plan").expect("write");
    for path in [json!(agent_work.join("plan.md")), json!("../plan.md")] {
        let mut body = turn(&url, "agent-a", "in-project", "REPLY=read it");
        body["session"] = json!({"workingDirectory": agent_work.join("project")});
        body["attachments"] = json!([{"type": "file", "path": path}]);
        let done = summary(addr, None, &body).await;
        assert_eq!(done.json()["status"], "idle", "{path}: {}", done.body);
    }

    // Outside every root, directly, through `..`, or through a link in the work
    // directory: refused before the turn, naming the attachment; the model is not asked.
    let work = fx.scratch.path().join("agents/agents/agent-a/work");
    std::os::unix::fs::symlink(outside.join("secret.txt"), work.join("link.txt")).expect("symlink");
    let asked = fx.model.requests().len();
    for attachment in [
        json!({"type": "file", "path": outside.join("secret.txt")}),
        json!({"type": "file", "path": "../../../../outside/secret.txt"}),
        json!({"type": "file", "path": "link.txt"}),
        json!({"type": "directory", "path": outside}),
    ] {
        let mut body = turn(&url, "agent-a", "conv", "REPLY=no");
        body["attachments"] = json!([attachment]);
        let refused = summary(addr, None, &body).await;
        assert_eq!(refused.status, 400, "{attachment}: {}", refused.body);
        let message = refused.json()["message"]
            .as_str()
            .unwrap_or_default()
            .to_owned();
        assert!(
            message.starts_with("attachments[0]: path: ") && message.contains("allowed_work_roots"),
            "{message}"
        );
    }
    // Inline content over the size limit, of a type not allowed, or not base64.
    for (attachment, says) in [
        (
            json!({"type": "inline", "data": "A".repeat(2000), "media_type": "text/plain"}),
            "max_bytes",
        ),
        (
            json!({"type": "inline", "data": "aGk=", "media_type": "application/x-sh"}),
            "media_type",
        ),
        (
            json!({"type": "inline", "data": "@@", "media_type": "text/plain"}),
            "base64",
        ),
    ] {
        let mut body = turn(&url, "agent-a", "conv", "REPLY=no");
        body["attachments"] = json!([attachment]);
        let refused = summary(addr, None, &body).await;
        assert_eq!(refused.status, 400, "{}", refused.body);
        assert!(refused.body.contains(says), "{}", refused.body);
    }
    assert_eq!(fx.model.requests().len(), asked);

    // Deleting the conversation removes its inline contents; another conversation's stay,
    // another agent's of the same key in a shared working directory too.
    let mut body = turn(&url, "agent-a", "other", "REPLY=seen");
    body["attachments"] =
        json!([{"type": "inline", "data": "aGk=", "media_type": "text/plain", "name": "a.txt"}]);
    let done = summary(addr, None, &body).await;
    assert_eq!(done.json()["status"], "idle", "{}", done.body);
    let in_shared = |agent: &str| {
        let mut body = turn(&url, agent, "same-key", "REPLY=seen");
        body["session"] = json!({"workingDirectory": shared.clone()});
        body["attachments"] =
            json!([{"type": "inline", "data": "aGk=", "media_type": "text/plain"}]);
        body
    };
    let mut shared_sessions = Vec::new();
    for agent in ["agent-a", "agent-b"] {
        let done = summary(addr, None, &in_shared(agent)).await;
        assert_eq!(done.json()["status"], "idle", "{}", done.body);
        shared_sessions.push(
            done.json()["session_id"]
                .as_str()
                .unwrap_or_default()
                .to_owned(),
        );
    }
    let mut reset_shared = settings(&url);
    reset_shared["session"] = json!({"workingDirectory": shared.clone()});
    let deleted = call(
        addr,
        "DELETE",
        "/v1/sessions/agent-a/same-key",
        None,
        Some(&reset_shared),
    )
    .await;
    assert_eq!(deleted.status, 204, "{}", deleted.body);
    let shared_files = |agent: &str| {
        shared
            .join("attachments")
            .join(copilot_pool::ids::sha256_hex(&format!("{agent}/same-key")))
    };
    assert!(!shared_files("agent-a").exists());
    assert_eq!(
        std::fs::read_dir(shared_files("agent-b"))
            .expect("agent-b's stay")
            .count(),
        1
    );
    // By its name alone (no body: no credentials, no settings): agent-b's conversation is
    // deleted, its runtime session and its attachments in the directory its binding recorded
    // (not the agent's own, which a DELETE naming none would mean).
    let deleted = call(addr, "DELETE", "/v1/sessions/agent-b/same-key", None, None).await;
    assert_eq!(deleted.status, 204, "{}", deleted.body);
    assert!(
        !shared_files("agent-b").exists(),
        "agent-b's attachments are gone"
    );
    let state_of_b = fx
        .scratch
        .path()
        .join("agents/agents/agent-b/copilot/session-state")
        .join(&shared_sessions[1]);
    assert!(!state_of_b.exists(), "{} is left", state_of_b.display());
    // On a process with no identity, never as the logged-in user the daemon does not allow:
    // each runtime of agent-b's home runs with `--no-auto-login`.
    let home_of_b = fx.scratch.path().join("agents/agents/agent-b/copilot");
    let runtimes_of_b: Vec<String> =
        support::procs::with_env_prefix("COPILOT_HOME", &home_of_b.display().to_string())
            .into_iter()
            .filter_map(|pid| std::fs::read(format!("/proc/{pid}/cmdline")).ok())
            .map(|argv| String::from_utf8_lossy(&argv).replace('\0', " "))
            .filter(|argv| argv.contains("--stdio"))
            .collect();
    assert!(
        runtimes_of_b.len() >= 2,
        "its own and the deletion's: {runtimes_of_b:?}"
    );
    assert!(
        runtimes_of_b
            .iter()
            .all(|argv| argv.contains("--no-auto-login")),
        "{runtimes_of_b:?}"
    );
    let again = call(addr, "DELETE", "/v1/sessions/agent-b/same-key", None, None).await;
    assert_eq!(again.status, 404, "{}", again.body);
    let fresh = summary(addr, None, &in_shared("agent-b")).await;
    assert_eq!(fresh.json()["resumed"], false, "{}", fresh.body);
    assert_ne!(fresh.json()["session_id"], shared_sessions[1].as_str());
    // Also when the directory its turns ran in is gone since (a project removed).
    let project = shared.join("project");
    std::fs::create_dir_all(&project).expect("mkdir");
    let mut body = turn(&url, "agent-c", "in-project", "REPLY=seen");
    body["session"] = json!({"workingDirectory": project.clone()});
    let done = summary(addr, None, &body).await;
    assert_eq!(done.json()["status"], "idle", "{}", done.body);
    std::fs::remove_dir_all(&project).expect("rm -r the project");
    let deleted = call(
        addr,
        "DELETE",
        "/v1/sessions/agent-c/in-project",
        None,
        None,
    )
    .await;
    assert_eq!(deleted.status, 204, "{}", deleted.body);
    let state_of_c = fx
        .scratch
        .path()
        .join("agents/agents/agent-c/copilot/session-state")
        .join(done.json()["session_id"].as_str().unwrap_or_default());
    assert!(!state_of_c.exists(), "{} is left", state_of_c.display());
    let reset = settings(&url);
    let deleted = call(
        addr,
        "DELETE",
        "/v1/sessions/agent-a/conv",
        None,
        Some(&reset),
    )
    .await;
    assert_eq!(deleted.status, 204, "{}", deleted.body);
    assert!(
        !conversation_files.exists(),
        "the deleted conversation's attachments are gone"
    );
    let others = conversation_files.with_file_name(copilot_pool::ids::sha256_hex("agent-a/other"));
    assert_eq!(
        std::fs::read_dir(&others)
            .expect("the other conversation's")
            .count(),
        1
    );
    // And when its stored state is gone already (its process gone, the agent's home cleaned
    // by hand): what is left of it, its binding and its attachments, goes.
    let done = summary(addr, None, &in_shared("agent-d")).await;
    assert_eq!(done.json()["status"], "idle", "{}", done.body);
    let state_of_d = fx
        .scratch
        .path()
        .join("agents/agents/agent-d/copilot/session-state")
        .join(done.json()["session_id"].as_str().unwrap_or_default());
    server.stop().await;
    std::fs::remove_dir_all(&state_of_d).expect("the stored state removed");
    assert!(shared_files("agent-d").exists());
    let mut config = ApiConfig::default();
    config.allowed_work_roots = vec![shared.clone()];
    let server = InProcess::start(fx.config().await, config).await;
    let path = "/v1/sessions/agent-d/same-key";
    let deleted = call(server.addr, "DELETE", path, None, None).await;
    assert_eq!(deleted.status, 204, "{}", deleted.body);
    assert!(
        !shared_files("agent-d").exists(),
        "its attachments are gone"
    );
    assert!(!state_of_d.exists(), "{} is back", state_of_d.display());
    let again = call(server.addr, "DELETE", path, None, None).await;
    assert_eq!(again.status, 404, "its binding is gone: {}", again.body);
    // A conversation whose directory's root was taken out of allowed_work_roots since: it
    // is deleted, and the pool touches nothing there, not even the attachments it wrote.
    let done = summary(server.addr, None, &in_shared("agent-e")).await;
    assert_eq!(done.json()["status"], "idle", "{}", done.body);
    server.stop().await;
    let server = InProcess::start(fx.config().await, ApiConfig::default()).await;
    let path = "/v1/sessions/agent-e/same-key";
    let deleted = call(server.addr, "DELETE", path, None, None).await;
    assert_eq!(deleted.status, 204, "{}", deleted.body);
    assert!(shared_files("agent-e").exists(), "left outside the roots");
    let again = call(server.addr, "DELETE", path, None, None).await;
    assert_eq!(again.status, 404, "{}", again.body);
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_inline_attachment_under_a_root_that_is_a_link_is_written_and_deleted_there() {
    let fx = Fixture::new().await;
    let url = fx.endpoint.base_url();
    // `allowed_work_roots` names a link (`/srv/work` → `/data/work`, say).
    let target = fx.scratch.path().join("data-work");
    let linked = fx.scratch.path().join("srv-work");
    std::fs::create_dir_all(target.join("project")).expect("mkdir");
    std::os::unix::fs::symlink(&target, &linked).expect("the root's link");
    let mut config = ApiConfig::default();
    config.allowed_work_roots = vec![linked.clone()];
    let server = InProcess::start(fx.config().await, config).await;
    let mut body = turn(&url, "agent-l", "linked", "REPLY=seen");
    body["session"] = json!({"workingDirectory": linked.join("project")});
    body["attachments"] =
        json!([{"type": "inline", "data": "aGk=", "media_type": "text/plain", "name": "a.txt"}]);
    let done = summary(server.addr, None, &body).await;
    assert_eq!(done.status, 200, "{}", done.body);
    assert_eq!(done.json()["status"], "idle", "{}", done.body);
    let files = target
        .join("project/attachments")
        .join(copilot_pool::ids::sha256_hex("agent-l/linked"));
    assert_eq!(std::fs::read_dir(&files).expect("written").count(), 1);
    let deleted = call(
        server.addr,
        "DELETE",
        "/v1/sessions/agent-l/linked",
        None,
        None,
    )
    .await;
    assert_eq!(deleted.status, 204, "{}", deleted.body);
    assert!(!files.exists(), "{} is left", files.display());
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deletion_the_runtime_refuses_keeps_the_attachments_until_the_retry_deletes_them() {
    // A fake runtime: the real one cannot be told to refuse a deletion.
    let fx = Fixture::new().await;
    let url = fx.endpoint.base_url();
    let config = fx.fake_runtime_config("delete-fails-once").await;
    let server = InProcess::start(config, ApiConfig::default()).await;
    let mut body = turn(&url, "agent-r", "refused", "hello");
    body["attachments"] =
        json!([{"type": "inline", "data": "aGk=", "media_type": "text/plain", "name": "a.txt"}]);
    let done = summary(server.addr, None, &body).await;
    assert_eq!(done.json()["status"], "idle", "{}", done.body);
    let files = fx
        .scratch
        .path()
        .join("agents/agents/agent-r/work/attachments")
        .join(copilot_pool::ids::sha256_hex("agent-r/refused"));
    assert_eq!(std::fs::read_dir(&files).expect("written").count(), 1);
    let path = "/v1/sessions/agent-r/refused";
    let refused = call(server.addr, "DELETE", path, None, None).await;
    assert_eq!(refused.status, 502, "{}", refused.body);
    // The conversation stays (a retry finds it), and so does what its turns were given.
    assert_eq!(
        std::fs::read_dir(&files).map(|d| d.count()).ok(),
        Some(1),
        "{} is gone with the conversation kept",
        files.display()
    );
    let deleted = call(server.addr, "DELETE", path, None, None).await;
    assert_eq!(deleted.status, 204, "{}", deleted.body);
    assert!(!files.exists(), "{} is left", files.display());
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_turn_whose_inline_attachments_would_take_its_conversation_past_its_limit_gets_413() {
    let fx = Fixture::new().await;
    let url = fx.endpoint.base_url();
    let mut config = ApiConfig::default();
    config.attachments.max_conversation_bytes = 4;
    let server = InProcess::start(fx.config().await, config).await;
    let with_inline = || {
        let mut body = turn(&url, "agent-q", "quota", "REPLY=seen");
        body["attachments"] =
            json!([{"type": "inline", "data": "aGk=", "media_type": "text/plain"}]);
        body
    };
    let first = summary(server.addr, None, &with_inline()).await;
    assert_eq!(first.json()["status"], "idle", "{}", first.body);
    let second = summary(server.addr, None, &with_inline()).await;
    assert_eq!(second.json()["status"], "idle", "{}", second.body);
    let third = summary(server.addr, None, &with_inline()).await;
    assert_eq!(third.status, 413, "{}", third.body);
    assert_eq!(third.json()["code"], "too_large", "{}", third.body);
    let message = third.json()["message"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    assert!(message.contains("max_conversation_bytes"), "{message}");
    // The conversation goes on without inline content.
    let plain = summary(
        server.addr,
        None,
        &turn(&url, "agent-q", "quota", "REPLY=on"),
    )
    .await;
    assert_eq!(plain.json()["status"], "idle", "{}", plain.body);
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_agent_mode_reaches_the_runtime_and_task_complete_ends_up_in_turn_end() {
    let fx = Fixture::new().await;
    let url = fx.endpoint.base_url();
    let server = InProcess::start(fx.config().await, ApiConfig::default()).await;
    let addr = server.addr;

    // The runtime's default mode offers no task_complete tool.
    let plain = summary(addr, None, &turn(&url, "agent-m", "conv", "REPLY=hi")).await;
    assert_eq!(plain.json()["task_complete"], Value::Null, "{}", plain.body);
    assert!(!offered_tools(&fx).iter().any(|t| t == "task_complete"));

    // Autopilot does; the model calls it and the runtime's summary is in turn.end.
    let mut body = turn(
        &url,
        "agent-m",
        "conv",
        r#"SCENARIO:tool NAME=task_complete ARGS={"summary":"all done"}"#,
    );
    body["agentMode"] = json!("autopilot");
    body["mode"] = json!("enqueue");
    let done = summary(addr, None, &body).await;
    assert_eq!(done.json()["status"], "idle", "{}", done.body);
    assert!(offered_tools(&fx).iter().any(|t| t == "task_complete"));
    assert_eq!(
        done.json()["task_complete"],
        json!({"success": true, "summary": "all done"}),
        "{}",
        done.body
    );

    // Unknown values are refused with the allowed ones.
    for (field, value, allowed) in [
        ("agent_mode", "yolo", "interactive, plan, autopilot, shell"),
        ("mode", "later", "enqueue, immediate"),
    ] {
        let mut body = turn(&url, "agent-m", "conv", "REPLY=no");
        body[field] = json!(value);
        let refused = summary(addr, None, &body).await;
        assert_eq!(refused.status, 400, "{}", refused.body);
        assert!(refused.body.contains(allowed), "{}", refused.body);
    }
    server.stop().await;
}

/// Reads `stream` to its `turn.end`, answering each `hook.request` with `reply(hook)`
/// (`None`: leave it unanswered); returns the events and the summary.
async fn run_answering_hooks(
    addr: std::net::SocketAddr,
    stream: &mut SseStream,
    reply: impl Fn(&str) -> Option<Value>,
) -> (Vec<Sse>, Value) {
    let mut events = Vec::new();
    while let Some(event) = stream.next().await {
        if event.event == "turn.end" {
            let end = event.data.clone();
            events.push(event);
            return (events, end);
        }
        if event.event == "hook.request"
            && let Some(body) = reply(event.data["hook"].as_str().unwrap_or_default())
        {
            let answered = answer(addr, &request_id(&event), &body).await;
            assert_eq!(answered.status, 204, "{}", answered.body);
        }
        events.push(event);
    }
    panic!("the stream ended without turn.end");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hooks_are_answered_over_http_and_an_unanswered_hook_gets_the_default() {
    let fx = Fixture::new().await;
    let url = fx.endpoint.base_url();
    let mut config = ApiConfig::default();
    config.timeouts.hook = Duration::from_secs(1);
    let server = InProcess::start(fx.config().await, config).await;
    let addr = server.addr;

    // preToolUse answered with a denial: the tool never runs and the model hears why.
    let mut body = lookup_turn(&url, "agent-h", "conv", "alpha");
    body["hooks"] = json!(["before_tool_call", "llm_input"]);
    let mut stream = SseStream::open(addr, "/v1/turns", None, &body).await;
    assert_eq!(stream.status, 200);
    let mut events = Vec::new();
    let request = loop {
        let event = stream.next().await.expect("a hook.request");
        if event.event == "hook.request" {
            break event;
        }
        events.push(event);
    };
    assert_eq!(request.data["hook"], "before_tool_call", "{}", request.data);
    assert_eq!(request.data["input"]["toolName"], "lookup");
    let id = request_id(&request);
    let wrong = answer(addr, &id, &json!({"output": {"decision": "block"}})).await;
    assert_eq!(wrong.status, 400, "{}", wrong.body);
    assert!(wrong.body.contains("permissionDecision"), "{}", wrong.body);
    let deny =
        json!({"output": {"permissionDecision": "deny", "permissionDecisionReason": "not today"}});
    assert_eq!(answer(addr, &id, &deny).await.status, 204);
    let (rest, end) = run_answering_hooks(addr, &mut stream, |_| Some(json!({}))).await;
    events.extend(rest);
    assert_eq!(end["status"], "idle", "{end}");
    assert_eq!(
        end["final_text"], "tool said: Denied by preToolUse hook: not today",
        "{end}"
    );
    assert!(!events.iter().any(|e| e.event == "tool.call"));
    // llm_input is a notification: one per model call, nothing to answer.
    let notices: Vec<_> = events
        .iter()
        .filter(|e| e.event == "hook.notification")
        .collect();
    assert_eq!(notices.len() as u64, end["llm_calls"].as_u64().unwrap_or(0));
    assert!(
        notices
            .iter()
            .all(|n| n.data["hook"] == "llm_input" && n.data.get("request_id").is_none())
    );
    // Each comes just before the event it is about.
    for (i, event) in events.iter().enumerate() {
        if event.event == "hook.notification" {
            let next = events[i + 1..]
                .iter()
                .find(|e| e.event != "hook.notification");
            assert_eq!(next.map(|e| e.event.as_str()), Some("assistant.turn_start"));
        }
    }

    // userPromptSubmitted answered with a new prompt: the model gets that one.
    let mut body = turn(&url, "agent-h", "conv", "REPLY=original");
    body["hooks"] = json!(["before_prompt_build"]);
    let mut stream = SseStream::open(addr, "/v1/turns", None, &body).await;
    let (_, end) = run_answering_hooks(addr, &mut stream, |hook| {
        (hook == "before_prompt_build")
            .then(|| json!({"output": {"modifiedPrompt": "REPLY=rewritten"}}))
    })
    .await;
    assert_eq!(end["final_text"], "rewritten", "{end}");

    // Nobody answers: after the hook timeout the runtime gets the default (no output) and
    // the turn goes on with the original prompt; the late answer finds nothing.
    let mut body = turn(&url, "agent-h", "conv", "REPLY=unanswered");
    body["hooks"] = json!(["before_prompt_build"]);
    let mut stream = SseStream::open(addr, "/v1/turns", None, &body).await;
    let request = stream.until_event("hook.request").await;
    let (_, end) = run_answering_hooks(addr, &mut stream, |_| None).await;
    assert_eq!(end["status"], "idle", "{end}");
    assert_eq!(end["final_text"], "unanswered", "{end}");
    let late = answer(addr, &request_id(&request), &json!({})).await;
    assert_eq!(late.status, 404, "{}", late.body);

    // Hooks need the stream; an unknown hook is named with the allowed ones.
    let mut body = turn(&url, "agent-h", "conv", "REPLY=no");
    body["hooks"] = json!(["before_prompt_build"]);
    assert_eq!(summary(addr, None, &body).await.status, 400);
    body["hooks"] = json!(["on_everything"]);
    let unknown = call(addr, "POST", "/v1/turns", None, Some(&body)).await;
    assert_eq!(unknown.status, 400, "{}", unknown.body);
    assert!(
        unknown.body.contains("before_tool_call"),
        "{}",
        unknown.body
    );
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn usage_adds_up_to_what_the_model_reported_and_a_failed_model_call_carries_its_status() {
    let fx = Fixture::new().await;
    let url = fx.endpoint.base_url();
    let server = InProcess::start(fx.config().await, ApiConfig::default()).await;
    let addr = server.addr;

    // A turn with a tool call: two model calls.
    let before = fx.model.requests().len();
    let body = lookup_turn(&url, "agent-u", "conv", "alpha");
    let end = answered_tool_turn(addr, &body, "42").await;
    let served = fx.model.requests()[before..]
        .iter()
        .filter(|r| matches!(r.answer, Answer::Chat { .. }))
        .count() as u64;
    assert_eq!(served, 2);
    assert_eq!(end["llm_calls"], served, "{end}");
    assert_eq!(
        end["usage"],
        json!({
            "input_tokens": served * ScriptedModel::PROMPT_TOKENS,
            "output_tokens": served * ScriptedModel::COMPLETION_TOKENS,
            "cache_read_tokens": served * ScriptedModel::CACHED_PROMPT_TOKENS,
            "cache_write_tokens": 0,
        }),
        "{end}"
    );
    assert_eq!(end["status_code"], Value::Null, "{end}");

    // The provider answers 400 (not retried): the summary says so, with the status.
    let failed = summary(
        addr,
        None,
        &turn(&url, "agent-u", "conv", "SCENARIO:error STATUS=400"),
    )
    .await;
    let end = failed.json();
    assert_eq!(end["status"], "error", "{end}");
    assert_eq!(end["status_code"], 400, "{end}");
    assert_eq!(end["error_type"], "query", "{end}");
    assert!(
        end["error"].as_str().unwrap_or_default().contains("400"),
        "{end}"
    );
    assert!(end["open_reason"].is_string(), "{end}");
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn compaction_over_http_takes_custom_instructions() {
    let fx = Fixture::new().await;
    let url = fx.endpoint.base_url();
    let server = InProcess::start(fx.config().await, ApiConfig::default()).await;
    let addr = server.addr;
    let done = summary(addr, None, &turn(&url, "agent-c", "conv", "REPLY=one")).await;
    assert_eq!(done.json()["status"], "idle", "{}", done.body);
    let settings = |instructions: Value| {
        let mut body = settings(&url);
        body["custom_instructions"] = instructions;
        body
    };
    let wrong = call(
        addr,
        "POST",
        "/v1/sessions/agent-c/conv/compact",
        None,
        Some(&settings(json!(7))),
    )
    .await;
    assert_eq!(wrong.status, 400, "{}", wrong.body);
    let compacted = call(
        addr,
        "POST",
        "/v1/sessions/agent-c/conv/compact",
        None,
        Some(&settings(json!("KEEP-THE-ZEBRA"))),
    )
    .await;
    assert_eq!(compacted.status, 200, "{}", compacted.body);
    assert_eq!(compacted.json()["success"], true, "{}", compacted.body);
    // The summary request the runtime made carries the instructions.
    let last = fx.model.requests().pop().expect("the summary request");
    let text = serde_json::to_string(last.messages()).expect("json");
    assert!(text.contains("KEEP-THE-ZEBRA"), "{text}");
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_compaction_between_tool_turns_keeps_the_session_attached_as_it_was_opened() {
    let fx = Fixture::new().await;
    let url = fx.endpoint.base_url();
    // No spare resumes anything ahead: every resume counted is the leases'.
    let server = InProcess::over_pool(&fx, |config| config.warm_spares = 0).await;
    let addr = server.addr;
    answered_tool_turn(addr, &lookup_turn(&url, "agent-t", "conv", "alpha"), "42").await;
    let settings = settings(&url);
    let compacted = call(
        addr,
        "POST",
        "/v1/sessions/agent-t/conv/compact",
        None,
        Some(&settings),
    )
    .await;
    assert_eq!(compacted.status, 200, "{}", compacted.body);
    let end = answered_tool_turn(addr, &lookup_turn(&url, "agent-t", "conv", "beta"), "42").await;
    // The compaction used the session as its turns opened it (their tools and handlers),
    // and the next turn found it so: no detach and resume for either.
    assert_eq!(end["open_reason"], "attached", "{end}");
    assert_eq!(
        server.pool.status().await.expect("status").totals.resumed,
        0
    );
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn omitted_event_types_stay_off_the_stream_and_a_bad_pattern_is_refused_naming_it() {
    let fx = Fixture::new().await;
    let url = fx.endpoint.base_url();
    let server = InProcess::start(fx.config().await, ApiConfig::default()).await;
    let addr = server.addr;
    let types =
        |events: &[Sse]| -> Vec<String> { events.iter().map(|e| e.event.clone()).collect() };

    // The same turn twice: every event, then without the runtime's internal ones.
    let body = turn(&url, "agent-o", "conv", "REPLY=first");
    let (all, end) = SseStream::open(addr, "/v1/turns", None, &body)
        .await
        .until_end()
        .await;
    assert_eq!(end["status"], "idle", "{end}");
    let all = types(&all);
    assert!(
        all.iter().any(|t| t.starts_with("model.")),
        "the runtime streams internal model.* events: {all:?}"
    );
    let mut body = turn(&url, "agent-o", "conv", "REPLY=second");
    body["omit_events"] = json!(["model.*", "session.usage_info"]);
    let (some, end) = SseStream::open(addr, "/v1/turns", None, &body)
        .await
        .until_end()
        .await;
    assert_eq!(end["status"], "idle", "{end}");
    assert_eq!(end["final_text"], "second", "{end}");
    let some = types(&some);
    assert!(
        !some
            .iter()
            .any(|t| t.starts_with("model.") || t == "session.usage_info"),
        "{some:?}"
    );
    assert!(some.contains(&"assistant.message".to_owned()), "{some:?}");
    assert_eq!(some.last().map(String::as_str), Some("turn.end"));

    let mut bad = turn(&url, "agent-o", "conv", "REPLY=x");
    bad["omit_events"] = json!(["model.*", "model*x"]);
    let refused = call(addr, "POST", "/v1/turns", None, Some(&bad)).await;
    assert_eq!(refused.status, 400, "{}", refused.body);
    assert!(refused.body.contains("omit_events[1]"), "{}", refused.body);
    server.stop().await;
}
