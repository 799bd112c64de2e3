//! `McpBridge::codex_overrides` against the REAL Codex CLI (0.171.0, installed from npm by
//! the tests' installer, `support::agent_cli`) and the scripted model (Responses API):
//! `codex exec` with the bridge's `mcp_servers.gateway` overrides and the token in its
//! environment offers the gateway tools to the model as the `mcp__gateway` namespace, and a
//! namespaced call the model makes reaches the gateway's handler through the bridge, its
//! result going back to the model. (A model name Codex has no metadata for is used: for a
//! known one Codex defers MCP tools behind its client-side `tool_search`.)

#![cfg(feature = "mcp-bridge")]

mod support;

use std::process::Stdio;
use std::time::Duration;

use copilot_pool::backend::mcp_bridge::{McpBridge, McpBridgeConfig};
use copilot_pool::process::GroupLeader;
use copilot_pool::scripted_model::ScriptedModel;
use copilot_pool::turn::{GatewayTool, ToolCall};
use serde_json::json;

/// Upper bound for the whole `codex exec` (a failure guard, not a wait).
const RUN_LIMIT: Duration = Duration::from_secs(120);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn codex_calls_a_gateway_tool_through_the_bridge_with_the_token_from_its_environment() {
    let codex = support::agent_cli::codex_path().await;
    let tool = GatewayTool::new(
        "lookup",
        "Looks a key up in the gateway's table.",
        json!({"type": "object", "properties": {"key": {"type": "string"}}, "required": ["key"]}),
        |call: ToolCall| async move { Ok(format!("value of {}", call.arguments["key"])) },
    );
    let bridge = McpBridge::start(vec![tool], McpBridgeConfig::default())
        .await
        .expect("bridge");
    let model = ScriptedModel::new();
    let endpoint = model.serve_http().await.expect("model");
    let dir = tempfile::tempdir().expect("tempdir");
    let home = dir.path().join("codex-home");
    let work = dir.path().join("work");
    std::fs::create_dir_all(&home).expect("home");
    std::fs::create_dir_all(&work).expect("work");

    let provider = format!(
        "model_providers.fake={{name=\"fake\",base_url=\"http://{}/v1\",env_key=\"FAKE_OPENAI_KEY\",\
         wire_api=\"responses\",request_max_retries=1,stream_max_retries=1}}",
        endpoint.addr()
    );
    let overrides = bridge.codex_overrides(true);
    let mut command = tokio::process::Command::new(&codex);
    command
        .args([
            "exec",
            "--json",
            "--color",
            "never",
            "--skip-git-repo-check",
        ])
        .args(["-c", "model_provider=\"fake\"", "-c", &provider])
        .args([
            "-c",
            "model=\"fake-model\"",
            "-c",
            "analytics.enabled=false",
        ])
        .args(["-c", "features.plugins=false"])
        .args(["-c", "features.unbounded_connection_retries=false"])
        .args(&overrides.args)
        .arg(r#"SCENARIO:tool NAME=mcp__gateway__lookup ARGS={"key":"alpha"}"#)
        .env_clear()
        .env("PATH", std::env::var_os("PATH").unwrap_or_default())
        .env("HOME", dir.path())
        .env("CODEX_HOME", &home)
        .env("FAKE_OPENAI_KEY", "sk-FAKE-not-a-real-key")
        .envs(overrides.env.iter().map(|(k, v)| (k, v.expose())))
        .current_dir(&work)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let leader = GroupLeader::spawn(command).expect("codex starts");
    let output = leader
        .output_until(
            tokio::time::Instant::now() + RUN_LIMIT,
            Duration::from_secs(5),
        )
        .await
        .expect("codex finished in time")
        .expect("codex output");
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    // Codex lists an MCP server's tools as a Responses `namespace` named `mcp__<server>`.
    // It reached the bridge's tools/list only with the token from `bearer_token_env_var`.
    let namespace = model
        .requests()
        .iter()
        .flat_map(|r| r.body["tools"].as_array().cloned().unwrap_or_default())
        .find(|t| t["type"] == "namespace" && t["name"] == "mcp__gateway")
        .unwrap_or_else(|| {
            panic!("no mcp__gateway namespace offered\nstdout {stdout}\nstderr {stderr}")
        });
    let tools = namespace["tools"].as_array().cloned().unwrap_or_default();
    assert_eq!(tools.len(), 1, "{namespace}");
    assert_eq!(tools[0]["name"], "lookup", "{namespace}");
    assert_eq!(
        tools[0]["description"],
        "Looks a key up in the gateway's table."
    );
    assert_eq!(
        tools[0]["parameters"]["required"],
        json!(["key"]),
        "{namespace}"
    );
    assert_the_call_went_through(&model, &stdout);
}

/// The same run goes on: the namespaced call the scripted model makes is Codex's
/// `mcp_tool_call` item, served by the gateway's handler through the bridge, and its
/// result is in the model's next request as the call's output.
fn assert_the_call_went_through(model: &ScriptedModel, stdout: &str) {
    let calls: Vec<serde_json::Value> = stdout
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|e| e["type"] == "item.completed" && e["item"]["type"] == "mcp_tool_call")
        .map(|e| e["item"].clone())
        .collect();
    assert_eq!(calls.len(), 1, "one gateway call in:\n{stdout}");
    assert_eq!(calls[0]["server"], "gateway", "{}", calls[0]);
    assert_eq!(calls[0]["tool"], "lookup", "{}", calls[0]);
    assert_eq!(calls[0]["status"], "completed", "{}", calls[0]);
    let output = model
        .requests()
        .iter()
        .flat_map(|r| r.body["input"].as_array().cloned().unwrap_or_default())
        .find(|item| item["type"] == "function_call_output")
        .unwrap_or_else(|| panic!("no call output reached the model\n{stdout}"));
    assert!(
        output.to_string().contains("value of \\\"alpha\\\""),
        "the handler's result: {output}"
    );
}
