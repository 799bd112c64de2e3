//! The MCP bridge with a plain HTTP client, speaking MCP streamable HTTP by hand: the bearer
//! token (401 without it), `initialize`, `tools/list` from the gateway tools, `tools/call`
//! through the gateway's handler, handler failures as `isError` results, and the server
//! stopping by itself after its idle TTL and when its handle is dropped.

#![cfg(feature = "mcp-bridge")]

use std::sync::{Arc, Mutex};
use std::time::Duration;

use copilot_pool::backend::mcp_bridge::{McpBridge, McpBridgeConfig};
use copilot_pool::turn::{GatewayTool, ToolCall};
use serde_json::{Value, json};

/// A failure guard for waits that an event ends.
const LIMIT: Duration = Duration::from_secs(20);

const PROTOCOL: &str = "2025-06-18";

/// Posts one JSON-RPC message; returns the HTTP status and the JSON-RPC answer (if any).
async fn post(url: &str, token: Option<&str>, body: Value) -> (u16, Option<Value>) {
    let client = reqwest::Client::new();
    let mut request = client
        .post(url)
        .header("content-type", "application/json")
        .header("accept", "application/json, text/event-stream")
        .header("mcp-protocol-version", PROTOCOL)
        .body(body.to_string());
    if let Some(token) = token {
        request = request.header("authorization", format!("Bearer {token}"));
    }
    let response = tokio::time::timeout(LIMIT, request.send())
        .await
        .expect("answered in time")
        .expect("the bridge answers");
    let status = response.status().as_u16();
    let text = response.text().await.expect("body");
    // JSON (json_response) or, should the server choose a stream, its `data:` lines.
    let value = serde_json::from_str::<Value>(&text).ok().or_else(|| {
        text.lines()
            .filter_map(|l| l.strip_prefix("data:"))
            .filter_map(|d| serde_json::from_str::<Value>(d.trim()).ok())
            .find(|v| v.get("id").is_some())
    });
    (status, value)
}

async fn rpc(bridge: &McpBridge, id: u64, method: &str, params: Value) -> Value {
    let (status, answer) = post(
        &bridge.url(),
        Some(bridge.token().expose()),
        json!({"jsonrpc": "2.0", "id": id, "method": method, "params": params}),
    )
    .await;
    assert_eq!(status, 200, "{method}: {answer:?}");
    let answer = answer.unwrap_or_else(|| panic!("{method}: no JSON-RPC answer"));
    assert_eq!(answer["id"], id, "{answer}");
    answer
}

fn initialize_params() -> Value {
    json!({
        "protocolVersion": PROTOCOL,
        "capabilities": {},
        "clientInfo": {"name": "plain-http-test", "version": "0"},
    })
}

/// A `lookup` tool that records its calls and answers `value of <key>`, a `fails` tool
/// that returns an error, a `panics` tool, and a `slow` tool over its own 200 ms limit.
fn tools(calls: Arc<Mutex<Vec<ToolCall>>>) -> Vec<GatewayTool> {
    vec![
        GatewayTool::new(
            "lookup",
            "Looks a key up in the gateway's table.",
            json!({"type": "object", "properties": {"key": {"type": "string"}}, "required": ["key"]}),
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
            json!({"type": "object"}),
            |_c: ToolCall| async { Err("the backing service said no".to_owned()) },
        ),
        GatewayTool::new(
            "panics",
            "Panics.",
            json!({"type": "object"}),
            |_c: ToolCall| async {
                if true {
                    panic!("handler bug");
                }
                Ok(String::new())
            },
        ),
        GatewayTool::new(
            "slow",
            "Never answers in time.",
            json!({"type": "object"}),
            |_c: ToolCall| async {
                std::future::pending::<()>().await;
                Ok(String::new())
            },
        )
        .with_timeout(Duration::from_millis(200)),
    ]
}

async fn bridge(calls: Arc<Mutex<Vec<ToolCall>>>, config: McpBridgeConfig) -> McpBridge {
    McpBridge::start(tools(calls), config)
        .await
        .expect("the bridge starts")
}

#[tokio::test]
async fn a_request_without_this_runs_bearer_token_gets_401_and_one_with_it_initializes() {
    let bridge = bridge(Arc::default(), McpBridgeConfig::default()).await;
    let init =
        json!({"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": initialize_params()});
    let url = bridge.url();
    assert!(url.starts_with("http://127.0.0.1:"), "{url}");

    let (status, _) = post(&url, None, init.clone()).await;
    assert_eq!(status, 401, "no token");
    let (status, _) = post(&url, Some("not-the-token"), init.clone()).await;
    assert_eq!(status, 401, "a wrong token");
    let other = McpBridge::start(Vec::new(), McpBridgeConfig::default())
        .await
        .expect("a second bridge");
    let (status, _) = post(&url, Some(other.token().expose()), init.clone()).await;
    assert_eq!(status, 401, "another run's token");

    let answer = rpc(&bridge, 1, "initialize", initialize_params()).await;
    let result = &answer["result"];
    assert!(result["capabilities"]["tools"].is_object(), "{answer}");
    assert_eq!(
        result["serverInfo"]["name"], "copilot-pool-gateway",
        "{answer}"
    );
    assert!(result["protocolVersion"].is_string(), "{answer}");
}

#[tokio::test]
async fn tools_list_gives_each_gateway_tool_with_its_description_and_schema() {
    let bridge = bridge(Arc::default(), McpBridgeConfig::default()).await;
    rpc(&bridge, 1, "initialize", initialize_params()).await;
    let answer = rpc(&bridge, 2, "tools/list", json!({})).await;
    let listed = answer["result"]["tools"].as_array().expect("tools").clone();
    let names: Vec<&str> = listed.iter().filter_map(|t| t["name"].as_str()).collect();
    assert_eq!(names.len(), 4, "{answer}");
    for name in ["lookup", "fails", "panics", "slow"] {
        assert!(names.contains(&name), "{name} in {names:?}");
    }
    let lookup = listed
        .iter()
        .find(|t| t["name"] == "lookup")
        .expect("lookup");
    assert_eq!(
        lookup["description"],
        "Looks a key up in the gateway's table."
    );
    assert_eq!(
        lookup["inputSchema"]["required"],
        json!(["key"]),
        "{lookup}"
    );
    assert_eq!(
        lookup["inputSchema"]["properties"]["key"]["type"], "string",
        "{lookup}"
    );
}

#[tokio::test]
async fn tools_call_runs_the_gateway_handler_with_the_arguments_and_returns_its_text() {
    let calls: Arc<Mutex<Vec<ToolCall>>> = Arc::default();
    let mut config = McpBridgeConfig::default();
    config.working_directory = Some("/w/agent".to_owned());
    let bridge = bridge(calls.clone(), config).await;
    bridge.set_session_id("session-42");
    rpc(&bridge, 1, "initialize", initialize_params()).await;
    let started = std::time::Instant::now();
    let answer = rpc(
        &bridge,
        2,
        "tools/call",
        json!({"name": "lookup", "arguments": {"key": "alpha"},
               "_meta": {"claudecode/toolUseId": "toolu_7"}}),
    )
    .await;
    eprintln!(
        "measured: one tools/call over loopback HTTP (new connection) {:?}",
        started.elapsed()
    );
    let result = &answer["result"];
    assert_eq!(result["isError"], false, "{answer}");
    assert_eq!(result["content"][0]["type"], "text", "{answer}");
    assert_eq!(result["content"][0]["text"], "value of alpha", "{answer}");

    let calls = calls.lock().expect("calls");
    assert_eq!(calls.len(), 1);
    let call = &calls[0];
    assert_eq!(call.tool_name, "lookup");
    assert_eq!(call.arguments, json!({"key": "alpha"}));
    assert_eq!(call.tool_call_id, "toolu_7");
    assert_eq!(call.session_id, "session-42");
    assert_eq!(call.working_directory.as_deref(), Some("/w/agent"));
}

#[tokio::test]
async fn with_calls_needing_approval_only_an_approved_call_runs_and_only_once() {
    let calls: Arc<Mutex<Vec<ToolCall>>> = Arc::default();
    let mut config = McpBridgeConfig::default();
    config.calls_need_approval = true;
    let bridge = bridge(calls.clone(), config).await;
    rpc(&bridge, 1, "initialize", initialize_params()).await;
    let call = |id: u64, key: &'static str| {
        let bridge = &bridge;
        async move {
            let params = json!({"name": "lookup", "arguments": {"key": key}});
            rpc(bridge, id, "tools/call", params).await["result"].clone()
        }
    };
    // Never asked about (a shell tool's call with the token from the CLI's environment).
    let unasked = call(2, "alpha").await;
    assert_eq!(unasked["isError"], true, "{unasked}");
    let text = unasked["content"][0]["text"].as_str().unwrap_or_default();
    assert!(text.contains("not approved"), "{text}");
    bridge.approve("lookup", &json!({"key": "beta"}));
    // Other arguments than the approved call's.
    assert_eq!(call(3, "alpha").await["isError"], true);
    let approved = call(4, "beta").await;
    assert_eq!(approved["isError"], false, "{approved}");
    assert_eq!(approved["content"][0]["text"], "value of beta");
    // One call per approval.
    assert_eq!(call(5, "beta").await["isError"], true);
    bridge.approve("lookup", &json!({"key": "gamma"}));
    bridge.forget_approvals();
    assert_eq!(call(6, "gamma").await["isError"], true);
    let keys: Vec<Value> = calls
        .lock()
        .expect("calls")
        .iter()
        .map(|c| c.arguments["key"].clone())
        .collect();
    assert_eq!(keys, [json!("beta")]);
}

#[tokio::test]
async fn a_handler_error_a_panic_a_timeout_and_an_unknown_tool_are_is_error_results() {
    let bridge = bridge(Arc::default(), McpBridgeConfig::default()).await;
    rpc(&bridge, 1, "initialize", initialize_params()).await;
    let cases = [
        ("fails", "the backing service said no"),
        ("panics", "the tool handler panicked: handler bug"),
        ("slow", "did not answer within"),
        ("nope", "unknown tool \"nope\""),
    ];
    for (n, (name, expected)) in cases.into_iter().enumerate() {
        let answer = rpc(
            &bridge,
            10 + n as u64,
            "tools/call",
            json!({"name": name, "arguments": {}}),
        )
        .await;
        let result = &answer["result"];
        assert!(answer.get("error").is_none(), "{name}: {answer}");
        assert_eq!(result["isError"], true, "{name}: {answer}");
        let text = result["content"][0]["text"].as_str().unwrap_or("");
        assert!(text.contains(expected), "{name}: {text:?}");
    }
    // The server is still serving after all that.
    let answer = rpc(&bridge, 20, "tools/list", json!({})).await;
    assert!(answer["result"]["tools"].is_array());
}

#[tokio::test]
async fn the_bridge_stops_by_itself_after_its_idle_ttl_and_when_its_handle_is_dropped() {
    let ttl = Duration::from_millis(400);
    let mut config = McpBridgeConfig::default();
    config.idle_ttl = ttl;
    let bridge = bridge(Arc::default(), config.clone()).await;
    let started = tokio::time::Instant::now();
    rpc(&bridge, 1, "initialize", initialize_params()).await;
    assert!(bridge.is_running());
    tokio::time::timeout(LIMIT, bridge.stopped())
        .await
        .expect("the bridge stopped by itself");
    let after = started.elapsed();
    eprintln!("measured: idle stop {after:?} after the last request (ttl {ttl:?})");
    assert!(after >= ttl, "not before its TTL: {after:?}");
    assert!(!bridge.is_running());
    let refused = reqwest::Client::new().post(bridge.url()).send().await;
    assert!(refused.is_err(), "nothing listens any more: {refused:?}");

    // Dropping the handle stops a fresh one at once.
    let bridge = McpBridge::start(Vec::new(), McpBridgeConfig::default())
        .await
        .expect("bridge");
    let url = bridge.url();
    let (status, _) = post(
        &url,
        Some(bridge.token().expose()),
        json!({"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": initialize_params()}),
    )
    .await;
    assert_eq!(status, 200);
    let stopped = bridge.stop_signal();
    drop(bridge);
    tokio::time::timeout(LIMIT, stopped.wait())
        .await
        .expect("the server stopped after the drop");
    let refused = reqwest::Client::new().post(&url).send().await;
    assert!(
        refused.is_err(),
        "nothing listens after the drop: {refused:?}"
    );
}

#[tokio::test]
async fn a_held_bridge_outlives_its_idle_ttl_until_the_hold_is_dropped() {
    let ttl = Duration::from_millis(300);
    let mut config = McpBridgeConfig::default();
    config.idle_ttl = ttl;
    let bridge = bridge(Arc::default(), config).await;
    rpc(&bridge, 1, "initialize", initialize_params()).await;
    // A turn holds its bridge: the CLI may call a tool long after its last request.
    let hold = bridge.hold();
    let held = tokio::time::timeout(ttl * 4, bridge.stopped()).await;
    assert!(held.is_err(), "the held bridge stopped");
    assert!(bridge.is_running());
    let answer = rpc(&bridge, 2, "tools/list", json!({})).await;
    assert!(answer["result"]["tools"].is_array());
    // The turn ends: the TTL counts from there.
    let released = tokio::time::Instant::now();
    drop(hold);
    tokio::time::timeout(LIMIT, bridge.stopped())
        .await
        .expect("the bridge stopped once let go");
    assert!(released.elapsed() >= ttl, "not before its TTL");
}

/// `lookup` with the listed schema, answering `<who>: <key>` (another lease's handler).
fn lookup_answering(who: &'static str) -> GatewayTool {
    GatewayTool::new(
        "lookup",
        "Looks a key up in the gateway's table.",
        json!({"type": "object", "properties": {"key": {"type": "string"}}, "required": ["key"]}),
        move |call: ToolCall| async move {
            Ok(format!(
                "{who}: {}",
                call.arguments["key"].as_str().unwrap_or("?")
            ))
        },
    )
}

async fn call_lookup(bridge: &McpBridge, id: u64) -> Value {
    let answer = rpc(
        bridge,
        id,
        "tools/call",
        json!({"name": "lookup", "arguments": {"key": "k"}}),
    )
    .await;
    answer["result"].clone()
}

#[tokio::test]
async fn installed_handlers_answer_until_taken_out_and_then_a_call_is_refused_at_once() {
    let bridge = McpBridge::start(vec![lookup_answering("first")], McpBridgeConfig::default())
        .await
        .expect("the bridge starts");
    rpc(&bridge, 1, "initialize", initialize_params()).await;
    let result = call_lookup(&bridge, 2).await;
    assert_eq!(result["content"][0]["text"], "first: k", "{result}");

    // Another lease's handlers for the same listed tool answer from now on.
    assert!(bridge.lists(&[lookup_answering("second")]));
    bridge
        .install(vec![lookup_answering("second")])
        .expect("the same list is installed");
    let result = call_lookup(&bridge, 3).await;
    assert_eq!(result["content"][0]["text"], "second: k", "{result}");

    // Between leases: refused at once, never a wait for a handler.
    bridge.uninstall();
    let started = std::time::Instant::now();
    let result = call_lookup(&bridge, 4).await;
    assert_eq!(result["isError"], true, "{result}");
    let text = result["content"][0]["text"].as_str().unwrap_or("");
    assert!(text.contains("no lease holds this conversation"), "{text}");
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "answered at once"
    );
    // The list stays what the CLI was given.
    let listed = rpc(&bridge, 5, "tools/list", json!({})).await;
    assert_eq!(listed["result"]["tools"][0]["name"], "lookup", "{listed}");

    // Other tools (here another schema) are refused: the CLI would see a stale list.
    let mut other = lookup_answering("third");
    other.parameters = json!({"type": "object", "properties": {"id": {"type": "integer"}}});
    assert!(!bridge.lists(std::slice::from_ref(&other)));
    let refused = bridge.install(vec![other]).expect_err("another list");
    assert!(
        refused.to_string().contains("start the CLI again"),
        "{refused}"
    );
    let result = call_lookup(&bridge, 6).await;
    assert_eq!(result["isError"], true, "still none installed: {result}");
}
