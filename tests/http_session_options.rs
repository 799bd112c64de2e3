//! A conversation's `session` object over the HTTP API, against the real runtime on the
//! scripted model (the library's router in-process, as in `http_api.rs`): the runtime's own
//! `session.create` fields reach the model (system message, tool filters), options that
//! change what the conversation means start a new CLI session while the others do not, and
//! what the pool refuses is a 400 naming the field before anything runs (a wrong type, a
//! field the pool owns, a local MCP server, a directory outside the allowed roots), and hook
//! files in a conversation's directory run nothing.

mod support;

use copilot_pool::http::ApiConfig;
use copilot_pool::scripted_model::RecordedRequest;
use serde_json::{Value, json};
use support::api::{InProcess, summary, turn};
use support::hook_files::PlantedHooks;
use support::http::{SseStream, call};
use support::pool_fixture::Fixture;

/// The names of the tools a model request offered.
fn offered_tools(request: &RecordedRequest) -> Vec<String> {
    request.body["tools"]
        .as_array()
        .map(|tools| {
            tools
                .iter()
                .filter_map(|t| t["function"]["name"].as_str().map(str::to_owned))
                .collect()
        })
        .unwrap_or_default()
}

/// The system message of a model request.
fn system_text(request: &RecordedRequest) -> String {
    request
        .messages()
        .iter()
        .filter(|m| m["role"] == "system")
        .map(|m| m["content"].to_string())
        .collect()
}

/// A streamed turn with two gateway tools (`lookup`, `hidden`) and `session`; the
/// scripted model answers `reply` without calling a tool. Returns the summary and the
/// model's request.
async fn tools_turn(
    server: &InProcess,
    fx: &Fixture,
    key: &str,
    session: Value,
) -> (Value, RecordedRequest) {
    let before = fx.model.requests().len();
    let mut body = turn(&fx.endpoint.base_url(), "agent-o", key, "REPLY=done");
    body["tools"] = json!([
        {"name": "lookup", "description": "Looks up a number", "parameters": {"type": "object"}},
        {"name": "hidden", "description": "Must not be offered", "parameters": {"type": "object"}},
    ]);
    body["session"] = session;
    let mut stream = SseStream::open(server.addr, "/v1/turns", None, &body).await;
    assert_eq!(stream.status, 200);
    let (_, end) = stream.until_end().await;
    assert_eq!(end["status"], "idle", "{end}");
    let request = fx
        .model
        .requests()
        .into_iter()
        .nth(before)
        .expect("the turn's model request");
    (end, request)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_system_message_reaches_the_model_and_tools_filtered_out_are_not_offered() {
    let fx = Fixture::new().await;
    let server = InProcess::start(fx.config().await, ApiConfig::default()).await;

    // Without options both gateway tools are offered, and no marker is in the prompt.
    let (_, plain) = tools_turn(&server, &fx, "plain", json!({})).await;
    let tools = offered_tools(&plain);
    assert!(
        tools.contains(&"lookup".to_owned()) && tools.contains(&"hidden".to_owned()),
        "{tools:?}"
    );
    assert!(!system_text(&plain).contains("MARKER-7f3a"));

    let (_, shaped) = tools_turn(
        &server,
        &fx,
        "shaped",
        json!({
            "systemMessage": {"mode": "replace", "content": "You are MARKER-7f3a. Answer briefly."},
            "excludedTools": ["hidden"],
        }),
    )
    .await;
    assert!(
        system_text(&shaped).contains("MARKER-7f3a"),
        "the system message did not reach the model: {:.400}",
        system_text(&shaped)
    );
    let tools = offered_tools(&shaped);
    assert!(tools.contains(&"lookup".to_owned()), "{tools:?}");
    assert!(!tools.contains(&"hidden".to_owned()), "{tools:?}");

    // An allowlist: of the runtime's built-in tools only what it names is offered (runtime
    // 1.0.14 applies `availableTools` to built-in tools only; gateway tools are filtered by
    // `excludedTools`).
    let (_, all) = tools_turn(
        &server,
        &fx,
        "all",
        json!({"availableTools": ["builtin:*"]}),
    )
    .await;
    let tools = offered_tools(&all);
    assert!(
        tools.contains(&"bash".to_owned()) && tools.contains(&"view".to_owned()),
        "{tools:?}"
    );
    let (_, allowed) =
        tools_turn(&server, &fx, "allowed", json!({"availableTools": ["view"]})).await;
    let tools = offered_tools(&allowed);
    assert!(tools.contains(&"view".to_owned()), "{tools:?}");
    assert!(!tools.contains(&"bash".to_owned()), "{tools:?}");
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_changed_system_message_starts_a_new_session_and_a_changed_reasoning_summary_does_not() {
    let fx = Fixture::new().await;
    let server = InProcess::start(fx.config().await, ApiConfig::default()).await;
    let url = fx.endpoint.base_url();
    let with = |session: Value| {
        let mut body = turn(&url, "agent-k", "conv", "REPLY=ok");
        body["session"] = session;
        body
    };
    let first = summary(
        server.addr,
        None,
        &with(json!({"systemMessage": {"content": "One."}})),
    )
    .await
    .json();
    assert_eq!(first["status"], "idle", "{first}");
    let id = first["session_id"].clone();
    // How the turn runs changes: the same CLI session continues.
    let same = summary(
        server.addr,
        None,
        &with(json!({"systemMessage": {"content": "One."}, "reasoningSummary": "concise"})),
    )
    .await
    .json();
    assert_eq!(same["session_id"], id, "{same}");
    // What the conversation means changes: a new CLI session, and the summary says why.
    let changed = summary(
        server.addr,
        None,
        &with(json!({"systemMessage": {"content": "Two."}})),
    )
    .await
    .json();
    assert_ne!(changed["session_id"], id, "{changed}");
    assert_eq!(changed["open_reason"], "compat-changed", "{changed}");
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refused_session_options_are_a_400_naming_the_field_before_anything_runs() {
    let fx = Fixture::new().await;
    let server = InProcess::start(fx.config().await, ApiConfig::default()).await;
    let url = fx.endpoint.base_url();
    let refused = |session: Value| {
        let mut body = turn(&url, "agent-r", "conv", "REPLY=never");
        body["session"] = session;
        let addr = server.addr;
        async move {
            let answer = summary(addr, None, &body).await;
            assert_eq!(answer.status, 400, "{}", answer.body);
            assert_eq!(answer.json()["code"], "bad_request", "{}", answer.body);
            answer.json()["message"]
                .as_str()
                .unwrap_or_default()
                .to_owned()
        }
    };
    let wrong_type = refused(json!({"systemMessage": 5})).await;
    assert!(wrong_type.contains("session.systemMessage"), "{wrong_type}");
    let nested = refused(json!({"infiniteSessions": {"enabled": "yes"}})).await;
    assert!(
        nested.contains("session.infiniteSessions.enabled"),
        "{nested}"
    );
    let unknown = refused(json!({"systemPrompt": "x"})).await;
    assert!(unknown.contains("session.systemPrompt"), "{unknown}");
    for owned in [
        "gitHubToken",
        "sessionId",
        "configDir",
        "requestPermission",
        "hooks",
        "provider",
    ] {
        let message = refused(json!({ owned: "x" })).await;
        assert!(
            message.contains(&format!("session.{owned} is set by the pool")),
            "{message}"
        );
    }
    let local = refused(json!({"mcpServers": {"git": {"command": "git-mcp"}}})).await;
    assert!(local.contains("session.mcpServers.git"), "{local}");
    assert!(local.contains("allow_local_mcp_servers"), "{local}");
    // A model given twice must agree.
    let twice = refused(json!({"model": "another-model"})).await;
    assert!(twice.contains("session.model"), "{twice}");
    // Nothing ran: no process, no model request, no working directory.
    let pool = call(server.addr, "GET", "/v1/pool", None, None)
        .await
        .json();
    assert_eq!(pool["processes"], json!([]), "{pool}");
    assert!(fx.model.requests().is_empty());
    let agents = server.pool.config().agents_base_dir.clone();
    let work = copilot_pool::home::work_dir(&agents, "agent-r").expect("agent id");
    assert!(!work.exists(), "{} was created", work.display());
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn working_directories_outside_the_agents_own_and_the_allowed_roots_are_refused() {
    let fx = Fixture::new().await;
    let roots = fx.scratch.path().join("repos");
    let outside = fx.scratch.path().join("private");
    std::fs::create_dir_all(roots.join("project")).expect("root");
    std::fs::create_dir_all(&outside).expect("outside");
    std::os::unix::fs::symlink(&outside, roots.join("escape")).expect("symlink");
    let mut config = ApiConfig::default();
    config.allowed_work_roots = vec![roots.clone()];
    let server = InProcess::start(fx.config().await, config).await;
    let url = fx.endpoint.base_url();
    let agents = server.pool.config().agents_base_dir.clone();
    let own = copilot_pool::home::work_dir(&agents, "agent-d").expect("agent id");
    let with = |session: Value| {
        let mut body = turn(&url, "agent-d", "conv", "REPLY=ok");
        body["session"] = session;
        body
    };
    for (session, field) in [
        (json!({"workingDirectory": outside}), "workingDirectory"),
        (
            json!({"workingDirectory": roots.join("../private")}),
            "workingDirectory",
        ),
        (
            json!({"workingDirectory": roots.join("escape")}),
            "workingDirectory",
        ),
        (
            json!({"workingDirectory": own.join("../copilot")}),
            "workingDirectory",
        ),
        (
            json!({"additionalDirectories": [roots.join("project"), "/etc"]}),
            "additionalDirectories.1",
        ),
        (
            json!({"workingDirectory": "relative/dir"}),
            "workingDirectory",
        ),
    ] {
        let answer = summary(server.addr, None, &with(session.clone())).await;
        assert_eq!(answer.status, 400, "{session}: {}", answer.body);
        let message = answer.json()["message"].to_string();
        assert!(
            message.contains(&format!("session.{field}")),
            "{session}: {message}"
        );
    }
    assert!(fx.model.requests().is_empty(), "nothing ran");
    // Inside an allowed root, and inside the agent's own directory: the turn runs there.
    let project = std::fs::canonicalize(roots.join("project")).expect("project");
    let inside = summary(
        server.addr,
        None,
        &with(json!({"workingDirectory": project, "additionalDirectories": [own.join("notes")]})),
    )
    .await;
    assert_eq!(inside.json()["status"], "idle", "{}", inside.body);
    let request = fx.model.requests().pop().expect("a model request");
    assert!(
        system_text(&request).contains(&project.display().to_string()),
        "the runtime was not told its working directory: {}",
        system_text(&request)
    );
    let own_dir = summary(
        server.addr,
        None,
        &with(json!({"workingDirectory": own.join("sub")})),
    )
    .await;
    assert_eq!(own_dir.json()["status"], "idle", "{}", own_dir.body);
    assert!(own.join("sub").is_dir(), "the turn's directory was created");
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hook_files_in_a_conversations_working_directory_run_no_command() {
    let fx = Fixture::new().await;
    let server = InProcess::start(fx.config().await, ApiConfig::default()).await;
    let agents = server.pool.config().agents_base_dir.clone();
    // The agent's own work directory: a turn with no workingDirectory runs there.
    let own = copilot_pool::home::work_dir(&agents, "agent-h").expect("agent id");
    let hooks = PlantedHooks::plant(&own, fx.scratch.path());
    let body = turn(&fx.endpoint.base_url(), "agent-h", "conv", "REPLY=ok");
    for _ in 0..2 {
        let answer = summary(server.addr, None, &body).await;
        assert_eq!(answer.json()["status"], "idle", "{}", answer.body);
    }
    assert_eq!(hooks.ran(), None, "a hook file's command ran");
    server.stop().await;
}
