//! The `provider` of a turn over HTTP: every field of each shape reaches the runtime's
//! `provider` object (seen in what the runtime then sends the scripted model), and bad
//! input is a 400 whose message names the field, before anything runs.

mod support;

use copilot_pool::http::ApiConfig;
use serde_json::{Value, json};
use support::api::{InProcess, summary};
use support::http::call;
use support::pool_fixture::Fixture;

fn with_provider(agent: &str, provider: Value) -> Value {
    json!({
        "agent_id": agent,
        "session_key": "conv",
        "prompt": "REPLY=shaped",
        "model": "gpt-4o",
        "provider": provider,
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_provider_field_over_http_reaches_the_runtime() {
    let fx = Fixture::new().await;
    let origin = format!("http://{}", fx.endpoint.addr());
    let server = InProcess::start(fx.config().await, ApiConfig::default()).await;
    let azure = json!({
        "type": "azure",
        "base_url": origin,
        "api_key": "azure-http-key",
        "azure": {"api_version": "2025-01-01-preview"},
        "headers": {"X-Tenant": "t-9"},
        "model_id": "gpt-4o",
        "wire_model": "http-deployment",
        "max_prompt_tokens": 90000,
        "max_output_tokens": 2048,
        "max_context_window_tokens": 128000,
    });
    let done = summary(server.addr, None, &with_provider("agent-z", azure)).await;
    assert_eq!(done.status, 200, "{}", done.body);
    assert_eq!(done.json()["final_text"], "shaped", "{}", done.body);
    let anthropic = json!({
        "type": "anthropic",
        "base_url": origin,
        "bearer_token": "anthropic-oauth",
        "api_key": "anthropic-key",
    });
    let done = summary(server.addr, None, &with_provider("agent-y", anthropic)).await;
    assert_eq!(done.json()["final_text"], "shaped", "{}", done.body);
    let responses = json!({
        "type": "openai",
        "wire_api": "responses",
        "base_url": fx.endpoint.base_url(),
    });
    let done = summary(server.addr, None, &with_provider("agent-x", responses)).await;
    assert_eq!(done.json()["final_text"], "shaped", "{}", done.body);

    let requests = fx.model.requests();
    let [azure, anthropic, responses] = requests.as_slice() else {
        panic!("three model calls, got {requests:?}");
    };
    assert_eq!(
        azure.path,
        "/openai/deployments/http-deployment/chat/completions"
    );
    assert_eq!(
        azure.query.as_deref(),
        Some("api-version=2025-01-01-preview")
    );
    assert_eq!(azure.header("api-key"), ["azure-http-key"]);
    assert_eq!(azure.header("x-tenant"), ["t-9"]);
    assert_eq!(azure.body["model"], "http-deployment");
    assert_eq!(anthropic.path, "/v1/messages");
    // The bearer token goes out as `Authorization`; for anthropic the runtime (1.0.14) sends
    // the key as `x-api-key` beside it.
    assert_eq!(
        anthropic.header("authorization"),
        ["Bearer anthropic-oauth"]
    );
    assert_eq!(anthropic.header("x-api-key"), ["anthropic-key"]);
    assert_eq!(responses.path, "/v1/responses");
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bad_provider_field_is_a_400_naming_it() {
    let fx = Fixture::new().await;
    let url = fx.endpoint.base_url();
    let server = InProcess::start(fx.config().await, ApiConfig::default()).await;
    let openai = json!({"type": "openai", "base_url": url, "api_key": "k"});
    let cases: Vec<(Value, &str)> = vec![
        (json!({"api_key": ""}), "provider.api_key is empty"),
        (
            json!({"azure": {"api_version": "2024-10-21"}}),
            "provider.azure applies to type azure only",
        ),
        (
            json!({"type": "anthropic", "wire_api": "responses"}),
            "provider.wire_api applies to openai and azure",
        ),
        (
            json!({"type": "azure", "azure": {"api_version": "v 1"}}),
            "provider.azure.api_version must be",
        ),
        (
            json!({"type": "azure", "azure": {"version": "1"}}),
            "unknown field `version`",
        ),
        (
            json!({"headers": {"Bad Name": "v"}}),
            "provider.headers has the name",
        ),
        (
            json!({"headers": {"Authorization": "Bearer x"}}),
            "provider.headers.Authorization may not be set",
        ),
        (
            json!({"headers": {"X-A": "a\r\nb"}}),
            "provider.headers.X-A must be printable",
        ),
        (
            json!({"wire_model": "two words"}),
            "provider.wire_model may not contain spaces",
        ),
        (
            json!({"model_id": ""}),
            "provider.model_id must be 1 to 256 bytes",
        ),
        (
            json!({"max_prompt_tokens": -1}),
            "provider.max_prompt_tokens must be a whole number",
        ),
        (
            json!({"max_output_tokens": 1.5}),
            "provider.max_output_tokens must be a whole number",
        ),
        (
            json!({"max_context_window_tokens": "lots"}),
            "provider.max_context_window_tokens must be a whole number",
        ),
        (
            json!({"max_output_tokens": 0}),
            "provider.max_output_tokens must be a whole number",
        ),
        (
            json!({"max_prompt_tokens": 200, "max_context_window_tokens": 100}),
            "provider.max_prompt_tokens (200) exceeds provider.max_context_window_tokens (100)",
        ),
        (
            json!({"transport": "websockets"}),
            "unknown field `transport`",
        ),
    ];
    for (change, expected) in cases {
        let mut provider = openai.clone();
        for (k, v) in change.as_object().into_iter().flatten() {
            provider[k] = v.clone();
        }
        let refused = call(
            server.addr,
            "POST",
            "/v1/turns",
            None,
            Some(&with_provider("agent-b", provider)),
        )
        .await;
        assert_eq!(refused.status, 400, "{change}: {}", refused.body);
        let message = refused.json()["message"].as_str().unwrap_or("").to_owned();
        assert!(message.contains(expected), "{change}: {message}");
    }
    assert!(fx.model.requests().is_empty(), "nothing reached the model");
    let status = call(server.addr, "GET", "/v1/pool", None, None)
        .await
        .json();
    assert_eq!(status["processes"], json!([]), "nothing started: {status}");
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cli_backends_provider_on_a_port_its_sandbox_would_open_everywhere_is_a_400() {
    let fx = Fixture::new().await;
    let server = InProcess::over_pool(&fx, |config| {
        config.model_guard.allow_private_endpoints = false;
    })
    .await;
    // Claude Code calls its model itself, and its sandbox opens the port it calls on every
    // address to the agent's tools: port 80 would open the cloud metadata service.
    let mut body = with_provider(
        "agent-c",
        json!({"type": "anthropic", "base_url": "https://llm.example.com:80/", "api_key": "k"}),
    );
    body["backend"] = json!("claude-cli");
    let refused = call(server.addr, "POST", "/v1/turns", None, Some(&body)).await;
    assert_eq!(refused.status, 400, "{}", refused.body);
    let message = refused.json()["message"].as_str().unwrap_or("").to_owned();
    assert!(
        message.contains("port 80") && message.contains("cli_provider_ports"),
        "{message}"
    );
    let status = call(server.addr, "GET", "/v1/pool", None, None)
        .await
        .json();
    assert_eq!(status["processes"], json!([]), "nothing started: {status}");
    server.stop().await;
}
