//! Gateway tools through the MCP bridge with the REAL Claude Code CLI and the scripted model:
//! the model calls `mcp__gateway__<tool>`, Claude calls the bridge with the run's token (from
//! its environment), the gateway's `ToolHandler` gets the arguments, its result (or its
//! error) reaches the model's next request, and the final text comes back. Also: a
//! conversation without tools gets no bridge, a conversation that asks permission puts the
//! call to its policy, and a bridge that expired after its idle TTL is replaced (the process
//! restarts resumed). One Claude process per test, at most two at once.

#![cfg(feature = "mcp-bridge")]

mod support;

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use copilot_pool::backend::claude_live::{ClaudeLive, ClaudeLiveConfig};
use copilot_pool::backend::mcp_bridge::McpGatewayTools;
use copilot_pool::backend::{BackendEvent, CliTurnOutcome};
use copilot_pool::scripted_model::{HttpEndpoint, RecordedRequest, ScriptedModel};
use copilot_pool::turn::{GatewayTool, ToolCall};
use copilot_pool::{Secret, TurnEnd};
use serde_json::{Value, json};
use tempfile::TempDir;

use support::agent_cli::claude_path;

/// Upper bound for one whole turn (a failure guard, not a wait).
const TURN_LIMIT: Duration = Duration::from_secs(90);

struct Fixture {
    model: ScriptedModel,
    endpoint: HttpEndpoint,
    dir: TempDir,
    calls: Arc<Mutex<Vec<ToolCall>>>,
}

impl Fixture {
    /// The `key` argument of every gateway tool call the handler got, in order.
    fn keys_called(&self) -> Vec<String> {
        self.calls
            .lock()
            .expect("calls")
            .iter()
            .map(|c| c.arguments["key"].as_str().unwrap_or("").to_owned())
            .collect()
    }

    async fn new() -> Self {
        let model = ScriptedModel::new();
        let endpoint = model.serve_http().await.expect("scripted model");
        Self {
            model,
            endpoint,
            dir: tempfile::tempdir().expect("tempdir"),
            calls: Arc::default(),
        }
    }

    /// `lookup` (answers `value of <key>`, recording the call) and `fails` (an error).
    fn tools(&self) -> Vec<GatewayTool> {
        let calls = self.calls.clone();
        vec![
            GatewayTool::new(
                "lookup",
                "Looks a key up in the gateway's table.",
                json!({"type": "object", "properties": {"key": {"type": "string"}},
                       "required": ["key"]}),
                move |call: ToolCall| {
                    let calls = calls.clone();
                    async move {
                        let key = call.arguments["key"].as_str().unwrap_or("?").to_owned();
                        calls.lock().expect("calls").push(call);
                        Ok(format!("value of {key}"))
                    }
                },
            ),
            GatewayTool::new(
                "fails",
                "Always fails.",
                json!({"type": "object", "properties": {}}),
                |_c: ToolCall| async { Err("the backing service said no".to_owned()) },
            ),
        ]
    }

    async fn config(&self, name: &str, tools: Option<McpGatewayTools>) -> ClaudeLiveConfig {
        let mut config = ClaudeLiveConfig::new(
            claude_path().await,
            self.dir.path().join(name).join("home"),
            self.dir.path().join(name).join("work"),
        );
        config.base_url = Some(format!("http://{}", self.endpoint.addr()));
        config.api_key = Some(Secret::new("sk-ant-FAKE-not-a-real-key"));
        config.gateway_tools = tools;
        config
    }

    fn messages_requests(&self) -> Vec<RecordedRequest> {
        self.model
            .requests()
            .into_iter()
            .filter(|r| r.path.ends_with("/messages"))
            .collect()
    }

    /// The `tool_result` block the model received for a call, with the request it came in.
    fn tool_result(&self) -> Option<Value> {
        self.messages_requests().iter().find_map(|r| {
            r.messages().last().and_then(|m| {
                m["content"]
                    .as_array()
                    .and_then(|blocks| blocks.iter().find(|b| b["type"] == "tool_result").cloned())
            })
        })
    }
}

async fn turn(live: &mut ClaudeLive, prompt: &str) -> (CliTurnOutcome, Vec<BackendEvent>) {
    let mut events = Vec::new();
    let outcome = tokio::time::timeout(TURN_LIMIT, live.run(prompt, |e| events.push(e.clone())))
        .await
        .expect("the turn ended in time")
        .expect("the turn started");
    (outcome, events)
}

/// The text of a `tool_result` block (a string or text blocks).
fn result_text(block: &Value) -> String {
    match &block["content"] {
        Value::String(text) => text.clone(),
        Value::Array(parts) => parts
            .iter()
            .filter_map(|p| p["text"].as_str())
            .collect::<Vec<_>>()
            .join("\n"),
        _ => String::new(),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claude_calls_a_gateway_tool_through_the_bridge_and_the_result_reaches_the_model() {
    let fx = Fixture::new().await;
    let config = fx
        .config("call", Some(McpGatewayTools::new(fx.tools())))
        .await;
    let cwd = config.cwd.clone();
    let mut live = ClaudeLive::new(config).expect("valid config");

    let started = Instant::now();
    let (outcome, events) = turn(
        &mut live,
        r#"SCENARIO:tool NAME=mcp__gateway__lookup ARGS={"key":"alpha"}"#,
    )
    .await;
    eprintln!(
        "measured: turn with one gateway tool call over MCP (spawn included) {:?}",
        started.elapsed()
    );
    assert_eq!(outcome.end, Some(TurnEnd::Idle), "{outcome:?} {events:?}");

    // The model was offered the tool with the gateway's schema.
    let first = fx.messages_requests();
    let offered = first
        .iter()
        .flat_map(|r| r.body["tools"].as_array().cloned().unwrap_or_default())
        .find(|t| t["name"] == "mcp__gateway__lookup")
        .unwrap_or_else(|| {
            let names: Vec<Vec<String>> = first
                .iter()
                .map(|r| {
                    r.body["tools"]
                        .as_array()
                        .map(|t| t.iter().map(|t| t["name"].to_string()).collect())
                        .unwrap_or_default()
                })
                .collect();
            panic!("mcp__gateway__lookup not offered: {names:?}; {outcome:?}; {events:?}")
        });
    assert_eq!(
        offered["input_schema"]["required"],
        json!(["key"]),
        "{offered}"
    );

    // The gateway's handler got the model's arguments, with the conversation's context.
    let calls = fx.calls.lock().expect("calls").clone();
    assert_eq!(calls.len(), 1, "{calls:?}");
    assert_eq!(calls[0].tool_name, "lookup");
    assert_eq!(calls[0].arguments, json!({"key": "alpha"}));
    assert_eq!(
        Some(calls[0].session_id.as_str()),
        outcome.session_id.as_deref(),
        "the call carries the CLI session id"
    );
    assert_eq!(
        calls[0].working_directory.as_deref(),
        Some(cwd.display().to_string().as_str())
    );

    // Its result reached the model's next request, and the final text came back.
    let result = fx.tool_result().expect("a tool_result reached the model");
    assert_eq!(result_text(&result), "value of alpha", "{result}");
    assert_ne!(result["is_error"], true, "{result}");
    assert_eq!(outcome.text, "tool said: value of alpha");
    assert!(
        events.iter().any(|e| matches!(e,
            BackendEvent::ToolCall { name, .. } if name == "mcp__gateway__lookup")),
        "{events:?}"
    );
    assert_eq!(
        outcome.permission_prompts, 0,
        "gateway tools run without asking"
    );

    // A handler error reaches the model as an error result; the process stays up.
    let pid = live.pid();
    let (outcome, _) = turn(&mut live, "SCENARIO:tool NAME=mcp__gateway__fails ARGS={}").await;
    assert_eq!(outcome.end, Some(TurnEnd::Idle), "{outcome:?}");
    let errored = fx
        .messages_requests()
        .iter()
        .filter_map(|r| r.messages().last().cloned())
        .flat_map(|m| m["content"].as_array().cloned().unwrap_or_default())
        .find(|b| b["type"] == "tool_result" && result_text(b).contains("backing service"))
        .expect("the failure reached the model");
    assert_eq!(errored["is_error"], true, "{errored}");
    assert!(
        outcome.text.contains("the backing service said no"),
        "{}",
        outcome.text
    );
    assert_eq!(live.pid(), pid, "same process");
    live.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_conversation_without_tools_gets_no_bridge_and_one_that_asks_puts_the_call_to_its_policy()
{
    let fx = Fixture::new().await;
    // No tools (an empty list counts as none): no bridge, no MCP tool offered.
    let mut live = ClaudeLive::new(
        fx.config("none", Some(McpGatewayTools::new(Vec::new())))
            .await,
    )
    .expect("valid");
    let (outcome, _) = turn(&mut live, "REPLY=plain").await;
    assert_eq!(outcome.text, "plain", "{outcome:?}");
    assert!(live.mcp_bridge().is_none());
    assert!(
        fx.messages_requests().iter().all(|r| {
            r.body["tools"].as_array().is_none_or(|t| {
                t.iter()
                    .all(|t| !t["name"].as_str().unwrap_or("").starts_with("mcp__"))
            })
        }),
        "no MCP tool offered"
    );
    live.close().await;

    // Asking: the default policy (reject all) denies the call; the handler never runs.
    let mut tools = McpGatewayTools::new(fx.tools());
    tools.ask_permission = true;
    let mut live = ClaudeLive::new(fx.config("ask", Some(tools)).await).expect("valid");
    let (outcome, events) = turn(
        &mut live,
        r#"SCENARIO:tool NAME=mcp__gateway__lookup ARGS={"key":"beta"}"#,
    )
    .await;
    assert_eq!(outcome.end, Some(TurnEnd::Idle), "{outcome:?}");
    let asked: Vec<_> = events
        .iter()
        .filter_map(|e| match e {
            BackendEvent::PermissionRequest {
                tool_name,
                approved,
                ..
            } => Some((tool_name.clone(), *approved)),
            _ => None,
        })
        .collect();
    assert_eq!(
        asked,
        [("mcp__gateway__lookup".to_owned(), false)],
        "{events:?}"
    );
    assert!(
        fx.calls.lock().expect("calls").is_empty(),
        "the handler did not run"
    );
    live.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bridge_stopped_by_its_idle_ttl_is_replaced_and_the_process_resumes() {
    let fx = Fixture::new().await;
    let mut tools = McpGatewayTools::new(fx.tools());
    tools.bridge.idle_ttl = Duration::from_secs(3);
    let mut live = ClaudeLive::new(fx.config("ttl", Some(tools)).await).expect("valid");
    let (first, _) = turn(
        &mut live,
        r#"SCENARIO:tool NAME=mcp__gateway__lookup ARGS={"key":"one"}"#,
    )
    .await;
    assert_eq!(first.text, "tool said: value of one", "{first:?}");
    let pid = live.pid().expect("running");
    let bridge = live.mcp_bridge().expect("a bridge");
    let old_url = bridge.url();
    tokio::time::timeout(TURN_LIMIT, bridge.stopped())
        .await
        .expect("the idle bridge stopped by itself");

    let (second, _) = turn(
        &mut live,
        r#"SCENARIO:tool NAME=mcp__gateway__lookup ARGS={"key":"two"}"#,
    )
    .await;
    assert_eq!(second.text, "tool said: value of two", "{second:?}");
    assert!(second.resumed, "the new process resumed the session");
    assert_eq!(second.session_id, first.session_id);
    assert_ne!(live.pid(), Some(pid), "a new process");
    let bridge = live.mcp_bridge().expect("a new bridge");
    assert!(bridge.is_running());
    assert_ne!(bridge.url(), old_url);
    let keys = fx.keys_called();
    assert_eq!(keys, ["one", "two"]);
    live.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn asked_about_under_a_policy_that_approves_all_the_tools_run_without_a_prompt() {
    let fx = Fixture::new().await;
    let mut tools = McpGatewayTools::new(fx.tools());
    tools.ask_permission = true;
    let mut config = fx.config("approve-all", Some(tools)).await;
    config.permission = Arc::new(copilot_pool::permission::ApproveAll);
    // As in a sandbox: Claude starts with bypassPermissions, and asks nothing.
    config
        .backend
        .env
        .insert("IS_SANDBOX".to_owned(), "1".to_owned());
    let mut live = ClaudeLive::new(config).expect("valid");
    let (outcome, _) = turn(
        &mut live,
        r#"SCENARIO:tool NAME=mcp__gateway__lookup ARGS={"key":"open"}"#,
    )
    .await;
    assert_eq!(outcome.text, "tool said: value of open", "{outcome:?}");
    assert_eq!(outcome.permission_prompts, 0, "{outcome:?}");
    live.close().await;
}

/// Approves every request, each after `wait` (a person who takes their time).
struct SlowApprover {
    wait: Duration,
}

impl copilot_pool::permission::PermissionPolicy for SlowApprover {
    fn decide(
        &self,
        _request: copilot_pool::permission::PermissionRequest,
    ) -> copilot_pool::permission::DecisionFuture {
        let wait = self.wait;
        Box::pin(async move {
            tokio::time::sleep(wait).await;
            Ok(copilot_pool::permission::PermissionDecision::Approve)
        })
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_turn_keeps_its_bridge_past_the_idle_ttl_until_its_tool_call_comes() {
    let fx = Fixture::new().await;
    let mut tools = McpGatewayTools::new(fx.tools());
    // The call waits for a permission longer than the bridge's TTL: Claude's last request
    // to the bridge (its tools/list at the start) is older than the TTL when the call comes.
    tools.bridge.idle_ttl = Duration::from_secs(1);
    tools.ask_permission = true;
    let mut config = fx.config("held", Some(tools)).await;
    config.permission = Arc::new(SlowApprover {
        wait: Duration::from_secs(3),
    });
    let mut live = ClaudeLive::new(config).expect("valid");
    let (outcome, _) = turn(
        &mut live,
        r#"SCENARIO:tool NAME=mcp__gateway__lookup ARGS={"key":"late"}"#,
    )
    .await;
    assert_eq!(outcome.end, Some(TurnEnd::Idle), "{outcome:?}");
    assert_eq!(outcome.text, "tool said: value of late", "{outcome:?}");
    let keys = fx.keys_called();
    assert_eq!(keys, ["late"]);
    // The turn over, the TTL counts again: the idle bridge stops by itself.
    let bridge = live.mcp_bridge().expect("a bridge");
    tokio::time::timeout(TURN_LIMIT, bridge.stopped())
        .await
        .expect("the idle bridge stopped once the turn ended");
    live.close().await;
}
