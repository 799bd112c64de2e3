//! The OpenAPI document: the committed `deploy/openapi.json` is what the code generates, the
//! router serves that very document on `GET /openapi.json`, and it says what a gateway
//! needs (every route, every status, the error body, the events of a turn).
//!
//! Run with `COPILOT_POOL_REGENERATE=1` to rewrite the committed file after changing the API.

mod support;

use std::collections::BTreeSet;
use std::path::PathBuf;

use copilot_pool::http::{self, ApiConfig};
use copilot_pool::pool::{Pool, PoolConfig};
use copilot_pool::worker::WorkerConfig;
use serde_json::Value;

fn committed_path() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("deploy/openapi.json")
}

fn generated() -> Value {
    let text = http::openapi_json().expect("the document serializes");
    serde_json::from_str(&text).expect("the document is JSON")
}

#[test]
fn the_committed_openapi_document_is_the_one_the_code_generates() {
    let generated = http::openapi_json().expect("the document serializes");
    let path = committed_path();
    if std::env::var_os("COPILOT_POOL_REGENERATE").is_some() {
        std::fs::write(&path, &generated).expect("write deploy/openapi.json");
    }
    let committed = std::fs::read_to_string(&path).unwrap_or_default();
    assert!(
        committed == generated,
        "{} differs from what the code generates (the API changed); run \
         `COPILOT_POOL_REGENERATE=1 cargo test --test openapi` and commit the file",
        path.display()
    );
}

#[test]
fn the_document_is_openapi_3_1_and_documents_every_route_of_the_router() {
    let doc = generated();
    assert_eq!(doc["openapi"], "3.1.0");
    let mut routes = BTreeSet::new();
    for (path, item) in doc["paths"].as_object().expect("paths") {
        for method in item.as_object().expect("path item").keys() {
            routes.insert(format!("{} {path}", method.to_uppercase()));
        }
    }
    let expected: BTreeSet<String> = [
        "POST /v1/turns",
        "POST /v1/requests/{request_id}",
        "POST /v1/sessions/{agent_id}/{session_key}/abort",
        "POST /v1/sessions/{agent_id}/{session_key}/compact",
        "DELETE /v1/sessions/{agent_id}/{session_key}",
        "GET /v1/pool",
        "GET /healthz",
        "GET /readyz",
        "GET /metrics",
        "GET /openapi.json",
    ]
    .into_iter()
    .map(str::to_owned)
    .collect();
    assert_eq!(routes, expected);
}

/// The status codes documented for `method path`.
fn statuses(doc: &Value, method: &str, path: &str) -> BTreeSet<u16> {
    doc["paths"][path][method]["responses"]
        .as_object()
        .unwrap_or_else(|| panic!("{method} {path} has responses"))
        .keys()
        .map(|k| k.parse().expect("a numeric status"))
        .collect()
}

#[test]
fn every_status_a_handler_answers_is_documented_with_the_error_body() {
    let doc = generated();
    let turn = statuses(&doc, "post", "/v1/turns");
    for status in [200, 400, 401, 404, 408, 409, 413, 500, 502, 503] {
        assert!(turn.contains(&status), "POST /v1/turns lacks {status}");
    }
    let answer = statuses(&doc, "post", "/v1/requests/{request_id}");
    for status in [204, 400, 401, 404, 408, 413] {
        assert!(answer.contains(&status), "POST /v1/requests lacks {status}");
    }
    let abort = statuses(&doc, "post", "/v1/sessions/{agent_id}/{session_key}/abort");
    for status in [204, 400, 401, 403, 404, 500, 503] {
        assert!(abort.contains(&status), "POST …/abort lacks {status}");
    }
    let error = &doc["components"]["schemas"]["ErrorBody"];
    assert_eq!(
        error["required"],
        serde_json::json!(["code", "message"]),
        "{error}"
    );
    // Every error status of a /v1 route answers the error body.
    for (path, item) in doc["paths"].as_object().expect("paths") {
        if !path.starts_with("/v1/") {
            continue;
        }
        for (method, op) in item.as_object().expect("item") {
            for (status, response) in op["responses"].as_object().expect("responses") {
                if status.starts_with('4') || status.starts_with('5') {
                    assert_eq!(
                        response["content"]["application/json"]["schema"]["$ref"],
                        "#/components/schemas/ErrorBody",
                        "{method} {path} {status}"
                    );
                }
            }
        }
    }
}

#[test]
fn a_turns_event_stream_documents_each_event_with_its_data_schema() {
    let doc = generated();
    let ok = &doc["paths"]["/v1/turns"]["post"]["responses"]["200"]["content"];
    assert_eq!(
        ok["application/json"]["schema"]["$ref"],
        "#/components/schemas/TurnEndEvent"
    );
    let stream = &ok["text/event-stream"]["schema"];
    let stream = match stream.get("$ref").and_then(Value::as_str) {
        Some(r) => &doc["components"]["schemas"][r.trim_start_matches("#/components/schemas/")],
        None => stream,
    };
    let mut events = Vec::new();
    for pair in stream["anyOf"].as_array().expect("anyOf of events") {
        let name = pair["properties"]["event"]["enum"][0]
            .as_str()
            .unwrap_or("<session event>")
            .to_owned();
        let data = &pair["properties"]["data"];
        assert_eq!(data["type"], "string");
        assert_eq!(data["contentMediaType"], "application/json");
        let data = data["contentSchema"]["$ref"]
            .as_str()
            .expect("a data schema")
            .trim_start_matches("#/components/schemas/")
            .to_owned();
        assert!(
            doc["components"]["schemas"][&data].is_object(),
            "{data} is in the components"
        );
        events.push((name, data));
    }
    let names: Vec<&str> = events.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(
        names,
        [
            "tool.call",
            "permission.request",
            "user_input.request",
            "hook.request",
            "hook.notification",
            "backend.fallback",
            "turn.end",
            "<session event>"
        ]
    );
    // The requests carry the id they are answered by.
    for (name, data) in &events[..4] {
        let required = &doc["components"]["schemas"][data]["required"];
        assert!(
            required
                .as_array()
                .is_some_and(|r| r.contains(&"request_id".into())),
            "{name}"
        );
    }
}

#[test]
fn the_documents_limits_are_the_librarys() {
    let doc = generated();
    let turn = &doc["components"]["schemas"]["TurnBody"]["properties"];
    assert_eq!(
        turn["agent_id"]["maxLength"],
        copilot_pool::home::MAX_AGENT_ID_LEN
    );
    assert_eq!(
        turn["session_key"]["maxLength"],
        copilot_pool::pool::MAX_SESSION_KEY_BYTES
    );
    assert_eq!(
        turn["fallback"]["maxItems"],
        copilot_pool::fallback::MAX_FALLBACKS
    );
    assert_eq!(
        turn["prelude_chars"]["maximum"],
        copilot_pool::fallback::MAX_PRELUDE_CHARS
    );
    // Unknown fields are refused, so the document says so.
    assert_eq!(
        doc["components"]["schemas"]["TurnBody"]["additionalProperties"],
        false
    );
}

/// A pool whose program is never started (no turn runs), and its API on loopback with the
/// token `s3cret`.
async fn idle_api(
    dir: &std::path::Path,
) -> (
    Pool,
    std::net::SocketAddr,
    tokio::sync::oneshot::Sender<()>,
    tokio::task::JoinHandle<()>,
) {
    let worker = WorkerConfig::new("/nonexistent".into(), PathBuf::new(), PathBuf::new());
    let mut config = PoolConfig::new(worker, dir.join("state"), dir.into());
    // Loopback providers (the tool-name test's) pass the guard.
    config.model_guard.allow_private_endpoints = true;
    let pool = Pool::start(config).await.expect("pool");
    let mut api = ApiConfig::default();
    api.api_token = Some("s3cret".into());
    let (addr, stop, server) = support::api::serve(http::router(pool.clone(), api)).await;
    (pool, addr, stop, server)
}

#[tokio::test]
async fn a_query_or_path_the_router_cannot_read_is_answered_with_the_error_body() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (pool, addr, stop, server) = idle_api(dir.path()).await;
    let body = serde_json::json!({"agent_id": "a", "session_key": "k", "prompt": "hi"});
    for (method, path, body) in [
        ("POST", "/v1/turns?stream=null", Some(&body)),
        ("POST", "/v1/turns?stream=1&stream=2", Some(&body)),
        // A parameter the route does not take (a typo of `stream` would stream silently).
        ("POST", "/v1/turns?steam=false", Some(&body)),
        ("DELETE", "/v1/sessions/a/k?backnd=codex-cli", None),
        // Routes that read no query at all refuse one too, never ignore it.
        ("GET", "/v1/pool?backnd=x", None),
        ("POST", "/v1/sessions/a/k/abort?backnd=x", None),
        ("POST", "/v1/sessions/a/k/compact?backnd=x", None),
        ("POST", "/v1/requests/r1?backnd=x", Some(&body)),
        ("GET", "/readyz?backnd=x", None),
        // Not UTF-8 once percent-decoded.
        ("POST", "/v1/sessions/%FF/k/abort", None),
        ("POST", "/v1/sessions/a/%FF/compact", None),
        ("DELETE", "/v1/sessions/%FF/k", None),
        ("POST", "/v1/requests/%FF", Some(&body)),
    ] {
        let response = support::http::call(addr, method, path, Some("s3cret"), body).await;
        assert_eq!(response.status, 400, "{method} {path}: {}", response.body);
        let error = response.json();
        assert_eq!(
            error["code"], "bad_request",
            "{method} {path}: {}",
            response.body
        );
        assert!(
            error["message"].as_str().is_some_and(|m| !m.is_empty()),
            "{method} {path}: {}",
            response.body
        );
        // An unknown parameter is what is named (not another fault of the request), with
        // the route and what it takes.
        for unknown in ["steam", "backnd"] {
            if path.contains(&format!("?{unknown}=")) {
                assert!(
                    error["message"]
                        .as_str()
                        .is_some_and(|m| m.contains(unknown) && m.contains("fix the URL")),
                    "{method} {path}: {}",
                    response.body
                );
            }
        }
    }
    let _ = stop.send(());
    let _ = server.await;
    pool.shutdown().await.expect("shutdown");
}

#[tokio::test]
async fn an_abort_naming_an_invalid_agent_id_or_session_key_is_a_400_naming_the_field() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (pool, addr, stop, server) = idle_api(dir.path()).await;
    let long_key = "k".repeat(513);
    for (path, field) in [
        ("/v1/sessions/Not-Lowercase/k/abort".to_owned(), "agent_id"),
        ("/v1/sessions/-dash-first/k/abort".to_owned(), "agent_id"),
        (format!("/v1/sessions/a/{long_key}/abort"), "session_key"),
    ] {
        let response = support::http::call(addr, "POST", &path, Some("s3cret"), None).await;
        assert_eq!(response.status, 400, "{path}: {}", response.body);
        let error = response.json();
        assert_eq!(error["code"], "bad_request", "{path}: {}", response.body);
        assert!(
            error["message"].as_str().is_some_and(|m| m.contains(field)),
            "{path}: the message names {field}: {}",
            response.body
        );
    }
    // A valid conversation without a running turn is still a 404.
    let response =
        support::http::call(addr, "POST", "/v1/sessions/a/k/abort", Some("s3cret"), None).await;
    assert_eq!(response.status, 404, "{}", response.body);
    let _ = stop.send(());
    let _ = server.await;
    pool.shutdown().await.expect("shutdown");
}

#[tokio::test]
async fn a_turns_tools_without_a_name_or_with_one_twice_are_refused_before_anything_runs() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (pool, addr, stop, server) = idle_api(dir.path()).await;
    let tool = |name: &str| serde_json::json!({"name": name, "parameters": {"type": "object"}});
    for tools in [
        serde_json::json!([tool("")]),
        serde_json::json!([tool("lookup"), tool("lookup")]),
        serde_json::json!([tool("catalog_search")]),
    ] {
        // A BYOK provider, so the credentials check passes and the tools are what is refused.
        let body = serde_json::json!({
            "agent_id": "a", "session_key": "k", "prompt": "hi", "tools": tools,
            "provider": {"type": "openai", "base_url": "http://127.0.0.1:9/v1"},
        });
        let response =
            support::http::call(addr, "POST", "/v1/turns", Some("s3cret"), Some(&body)).await;
        // Before: the lease was taken and the runtime refused the session (a 502), or here,
        // with no runtime at all, the spawn failed.
        assert_eq!(response.status, 400, "{tools}: {}", response.body);
        assert!(
            response.json()["message"]
                .as_str()
                .is_some_and(|m| m.contains("tools.")),
            "{}",
            response.body
        );
    }
    // Nothing was started for them.
    assert!(pool.status().await.expect("status").workers.is_empty());
    let _ = stop.send(());
    let _ = server.await;
    pool.shutdown().await.expect("shutdown");
}

#[tokio::test]
async fn the_router_serves_the_same_document_on_get_openapi_json() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (pool, addr, stop, server) = idle_api(dir.path()).await;
    // Outside /v1: served without the token.
    let response = support::http::call(addr, "GET", "/openapi.json", None, None).await;
    assert_eq!(response.status, 200);
    assert!(
        response
            .headers
            .iter()
            .any(|(k, v)| k == "content-type" && v == "application/json"),
        "{:?}",
        response.headers
    );
    assert_eq!(response.json(), generated());
    let _ = stop.send(());
    let _ = server.await;
    pool.shutdown().await.expect("shutdown");
}
