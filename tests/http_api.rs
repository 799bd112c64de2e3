//! The library's HTTP API (`copilot_pool::http`) driven in-process: its router over a real
//! pool of runtime processes on the scripted model, served on loopback by `http::serve`,
//! called with a gateway's HTTP client. What only the binary does (signals and the drain,
//! the token from a file or the environment, the Prometheus text, connection floods) is in
//! `daemon.rs`.

mod support;

use std::time::{Duration, Instant};

use copilot_pool::http::{self, ApiConfig};
use copilot_pool::scripted_model::ScriptedModel;
use copilot_pool::secret::Secret;
use serde_json::json;
use support::api::{InProcess, answer, lookup_turn, request_id, settings, summary, turn};
use support::http::{SseStream, call, request, send};
use support::pool_fixture::{Fixture, until_a_lease_waits};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_api_mounted_in_a_foreign_axum_app_runs_a_turn_beside_the_apps_own_routes() {
    let fx = Fixture::new().await;
    let url = fx.endpoint.base_url();
    let pool = copilot_pool::Pool::start(fx.config().await)
        .await
        .expect("pool");
    let (api, handle) = http::router_with_handle(pool.clone(), ApiConfig::default());
    // The gateway's own app: its route, and the pool's API under a prefix.
    let app = axum::Router::new()
        .route("/gateway/hello", axum::routing::get(|| async { "gateway" }))
        .nest("/pool", api);
    let (addr, stop, server) = support::api::serve(app).await;

    let own = call(addr, "GET", "/gateway/hello", None, None).await;
    assert_eq!((own.status, own.body.as_str()), (200, "gateway"));
    assert_eq!(
        call(addr, "GET", "/pool/healthz", None, None).await.status,
        200
    );
    // A streamed turn with a gateway tool, answered under the prefix too.
    let body = lookup_turn(&url, "agent-m", "conv", "alpha");
    let mut stream = SseStream::open(addr, "/pool/v1/turns", None, &body).await;
    assert_eq!(stream.status, 200);
    let id = request_id(&stream.until_event("tool.call").await);
    let answered = call(
        addr,
        "POST",
        &format!("/pool/v1/requests/{id}"),
        None,
        Some(&json!({"result": "forty-two"})),
    )
    .await;
    assert_eq!(answered.status, 204, "{}", answered.body);
    let (_, end) = stream.until_end().await;
    assert_eq!(end["status"], "idle", "{end}");
    assert_eq!(end["final_text"], "tool said: forty-two", "{end}");
    // The turn is counted until its summary is sent.
    tokio::time::timeout(Duration::from_secs(10), handle.turns_finished())
        .await
        .expect("the finished turn is no longer counted");
    assert_eq!(handle.running_turns(), 0);
    let status = call(addr, "GET", "/pool/v1/pool", None, None).await.json();
    assert_eq!(
        status["processes"].as_array().map(Vec::len),
        Some(1),
        "{status}"
    );
    // The embedder drains the API; its own routes are untouched.
    handle.set_draining();
    let refused = call(
        addr,
        "POST",
        "/pool/v1/turns?stream=false",
        None,
        Some(&turn(&url, "agent-m", "conv", "REPLY=late")),
    )
    .await;
    assert_eq!(refused.status, 503, "{}", refused.body);
    assert_eq!(refused.json()["code"], "draining");
    assert_eq!(
        call(addr, "GET", "/pool/readyz", None, None).await.status,
        503
    );
    assert_eq!(
        call(addr, "GET", "/gateway/hello", None, None).await.status,
        200
    );

    let _ = stop.send(());
    support::pool_fixture::shutdown_leaves_nothing(&pool).await;
    tokio::time::timeout(Duration::from_secs(10), server)
        .await
        .expect("the listener stopped")
        .expect("the listener task");
}
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ten_agents_stream_turns_at_once_and_a_tool_call_is_answered_over_http() {
    let fx = Fixture::new().await;
    let url = fx.endpoint.base_url();
    let server = InProcess::start(fx.config().await, ApiConfig::default()).await;
    let addr = server.addr;

    let runs = (0..10).map(|i| {
        let body = turn(
            &url,
            &format!("agent-{i}"),
            "conv",
            &format!("REPLY=hello agent {i}"),
        );
        async move {
            let mut stream = SseStream::open(addr, "/v1/turns", None, &body).await;
            assert_eq!(stream.status, 200);
            let (events, end) = stream.until_end().await;
            (i, events, end)
        }
    });
    for (i, events, end) in futures_util::future::join_all(runs).await {
        assert_eq!(end["status"], "idle", "{end}");
        assert_eq!(end["final_text"], format!("hello agent {i}"));
        assert_eq!(end["llm_calls"], 1);
        assert!(events.iter().any(|e| e.event == "assistant.message"));
        assert!(events.iter().any(|e| e.event == "session.idle"));
    }

    // A gateway tool: the call arrives as an event and is answered with POST /v1/requests.
    let body = lookup_turn(&url, "agent-0", "tools", "alpha");
    let mut stream = SseStream::open(addr, "/v1/turns", None, &body).await;
    let call_event = stream.until_event("tool.call").await;
    assert_eq!(call_event.data["tool_name"], "lookup");
    assert_eq!(call_event.data["arguments"]["key"], "alpha");
    let id = request_id(&call_event);
    let wrong = answer(addr, &id, &json!({"decision": "reject"})).await;
    assert_eq!(wrong.status, 400, "{}", wrong.body);
    let ok = answer(addr, &id, &json!({"result": "forty-two"})).await;
    assert_eq!(ok.status, 204, "{}", ok.body);
    let again = answer(addr, &id, &json!({"result": "x"})).await;
    assert_eq!(again.status, 404);
    let (_, end) = stream.until_end().await;
    assert_eq!(end["final_text"], "tool said: forty-two", "{end}");

    // Non-streaming: the summary alone.
    let summary = summary(addr, None, &turn(&url, "agent-1", "conv", "REPLY=again")).await;
    assert_eq!(summary.status, 200);
    assert_eq!(summary.json()["final_text"], "again");
    assert_eq!(summary.json()["resumed"], true, "{}", summary.body);

    let pool = call(addr, "GET", "/v1/pool", None, None).await.json();
    assert!(
        pool["processes"].as_array().is_some_and(|p| p.len() >= 10),
        "{pool}"
    );
    // Every runtime process is stopped with the pool.
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_abort_stops_a_turn_still_waiting_for_room_before_its_prompt_is_sent() {
    let fx = Fixture::new().await;
    let url = fx.endpoint.base_url();
    let server = InProcess::over_pool(&fx, |config| config.max_processes = 1).await;
    let addr = server.addr;
    // Another agent's turn holds the only process...
    let mut running = SseStream::open(
        addr,
        "/v1/turns",
        None,
        &turn(&url, "agent-r", "conv", "SCENARIO:slow SLOW=200x100"),
    )
    .await;
    running.until_event("assistant.turn_start").await;
    // ...so this agent's turn waits for room.
    let waiting_body = turn(&url, "agent-s", "conv", "REPLY=never MARKER-waiting");
    let waiting = tokio::spawn(async move { summary(addr, None, &waiting_body).await });
    until_a_lease_waits(&server.pool, "the second agent's turn waits for room").await;
    // The user presses stop on it: it ends aborted now, still waiting, its prompt never sent
    // (the other agent's turn runs on).
    let aborted = call(addr, "POST", "/v1/sessions/agent-s/conv/abort", None, None).await;
    assert_eq!(aborted.status, 204, "{}", aborted.body);
    let waited = tokio::time::timeout(Duration::from_secs(10), waiting)
        .await
        .expect("the aborted turn stops waiting for room")
        .expect("the waiting turn's request");
    let other = call(addr, "POST", "/v1/sessions/agent-r/conv/abort", None, None).await;
    assert_eq!(other.status, 204, "{}", other.body);
    let (_, end) = running.until_end().await;
    assert_eq!(end["status"], "aborted", "{end}");
    assert_eq!(waited.json()["status"], "aborted", "{}", waited.body);
    assert!(
        waited.json()["error"]
            .as_str()
            .is_some_and(|e| e.contains("before the prompt was sent")),
        "{}",
        waited.body
    );
    assert!(
        fx.model
            .requests()
            .iter()
            .all(|r| !serde_json::to_string(r.messages())
                .unwrap_or_default()
                .contains("MARKER-waiting")),
        "the waiting turn's prompt reached the model"
    );
    // A turn asked for after an abort runs as usual.
    let next = summary(addr, None, &turn(&url, "agent-s", "conv", "REPLY=after")).await;
    assert_eq!(next.json()["status"], "idle", "{}", next.body);
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_quiet_turn_keeps_its_stream_alive_with_comments_a_proxy_sees() {
    let fx = Fixture::new().await;
    let url = fx.endpoint.base_url();
    let mut config = ApiConfig::default();
    config.sse_keepalive = Duration::from_millis(100);
    let server = InProcess::start(fx.config().await, config).await;
    // The model answers in three chunks 400 ms apart: quiet stretches on the stream.
    let started = std::time::Instant::now();
    let answer = call(
        server.addr,
        "POST",
        "/v1/turns",
        None,
        Some(&turn(&url, "agent-q", "quiet", "SCENARIO:slow SLOW=3x400")),
    )
    .await;
    assert_eq!(answer.status, 200, "{}", answer.body);
    assert!(
        answer
            .headers
            .iter()
            .any(|(name, value)| name == "x-accel-buffering" && value == "no"),
        "{:?}",
        answer.headers
    );
    assert!(
        answer.body.contains("\n: keep-alive\n\n"),
        "{}",
        answer.body
    );
    // One after each quiet 100 ms at most: the timer starts again after each chunk.
    let comments = answer.body.matches(": keep-alive\n\n").count();
    let most = started.elapsed().as_millis() / 100;
    assert!(
        comments as u128 <= most,
        "{comments} keep-alives in {most} x 100 ms"
    );
    // Comments only: the events and the summary are whole.
    assert!(
        answer.body.contains("event: turn.end") && answer.body.contains("\"status\":\"idle\""),
        "{}",
        answer.body
    );
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_token_the_api_answers_this_machines_clients_and_no_web_page() {
    let fx = Fixture::new().await;
    let server = InProcess::start(fx.config().await, ApiConfig::default()).await;
    let addr = server.addr;
    // A client of this machine (curl, a gateway on loopback).
    assert_eq!(call(addr, "GET", "/v1/pool", None, None).await.status, 200);
    // A page another local server serves (an agent's dev server on an ephemeral port).
    let local_page =
        send(request(addr, "GET", "/v1/pool").header("origin", "http://127.0.0.1:41234")).await;
    assert_eq!(local_page.status, 403, "{}", local_page.body);
    // A page that rebound its own name onto 127.0.0.1: the browser sends that name as Host.
    let rebound = send(request(addr, "GET", "/v1/pool").header("host", "evil.example:7878")).await;
    assert_eq!(rebound.status, 403, "{}", rebound.body);
    assert!(
        rebound.body.contains("set an API token"),
        "{}",
        rebound.body
    );
    // A cross-site request (a form or `fetch` with text/plain needs no preflight).
    let cross_site = send(
        request(addr, "POST", "/v1/turns")
            .header("origin", "https://evil.example")
            .header("content-type", "text/plain")
            .body(json!({"agent_id": "a", "session_key": "k", "prompt": "hi"}).to_string()),
    )
    .await;
    assert_eq!(cross_site.status, 403, "{}", cross_site.body);
    // The open routes stay open.
    let health = send(request(addr, "GET", "/healthz").header("host", "evil.example")).await;
    assert_eq!(health.status, 200);
    server.stop().await;

    // An empty token would match a request without one: refused as a misconfiguration.
    let mut config = ApiConfig::default();
    config.api_token = Some(Secret::new(""));
    let server = InProcess::start(fx.config().await, config).await;
    let empty = call(server.addr, "GET", "/v1/pool", None, None).await;
    assert_eq!(empty.status, 500, "{}", empty.body);
    assert!(
        empty.body.contains("the API token is empty"),
        "{}",
        empty.body
    );
    server.stop().await;

    // An app that authenticates before the router lets anyone through.
    let mut config = ApiConfig::default();
    config.tokenless_access = http::TokenlessAccess::Anyone;
    let server = InProcess::start(fx.config().await, config).await;
    let behind_an_app =
        send(request(server.addr, "GET", "/v1/pool").header("host", "gateway.example")).await;
    assert_eq!(behind_an_app.status, 200, "{}", behind_an_app.body);
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_dense_with_values_is_refused_before_it_is_parsed_however_few_its_bytes() {
    let fx = Fixture::new().await;
    let mut config = ApiConfig::default();
    config.api_token = Some(Secret::new("s3cret-token"));
    let server = InProcess::start(fx.config().await, config).await;
    // 140 KB, far under the 1 MiB limit, but 70,000 values: parsed, 2 MiB and more.
    let dense = json!({"agent_id": "a", "session_key": "k", "prompt": "hi",
        "unknown": vec![0; 70_000]});
    for path in ["/v1/turns", "/v1/sessions/agent-a/k/compact"] {
        let refused = call(
            server.addr,
            "POST",
            path,
            Some("s3cret-token"),
            Some(&dense),
        )
        .await;
        assert_eq!(refused.status, 413, "{path}: {}", refused.body);
        assert!(
            refused.body.contains("more than 65536 JSON values")
                && refused.body.contains("too_large"),
            "{path}: {}",
            refused.body
        );
    }
    // Under the count, the same body is read (and refused for its unknown field).
    let sparse = json!({"agent_id": "a", "session_key": "k", "prompt": "hi",
        "unknown": vec![0; 60_000]});
    let read = call(
        server.addr,
        "POST",
        "/v1/turns",
        Some("s3cret-token"),
        Some(&sparse),
    )
    .await;
    assert_eq!(read.status, 400, "{}", read.body);
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_token_is_required_and_bad_input_is_refused_without_harm() {
    let fx = Fixture::new().await;
    let url = fx.endpoint.base_url();
    let mut config = ApiConfig::default();
    config.api_token = Some(Secret::new("s3cret-token"));
    config.max_body_bytes = 4096;
    let server = InProcess::start(fx.config().await, config).await;
    let addr = server.addr;
    assert_eq!(call(addr, "GET", "/v1/pool", None, None).await.status, 401);
    assert_eq!(
        call(addr, "GET", "/v1/pool", Some("wrong"), None)
            .await
            .status,
        401
    );
    assert_eq!(
        call(addr, "GET", "/v1/pool", Some("s3cret-token"), None)
            .await
            .status,
        200
    );
    assert_eq!(call(addr, "GET", "/healthz", None, None).await.status, 200);
    assert_eq!(call(addr, "GET", "/readyz", None, None).await.status, 200);
    assert_eq!(call(addr, "GET", "/nope", None, None).await.status, 404);
    // A route asked with a method it lacks: 405 with the error body and where to look.
    let wrong_method = call(addr, "GET", "/v1/turns", Some("s3cret-token"), None).await;
    assert_eq!(wrong_method.status, 405, "{}", wrong_method.body);
    assert_eq!(
        wrong_method.json()["code"],
        "method_not_allowed",
        "{}",
        wrong_method.body
    );
    assert!(
        wrong_method.body.contains("/openapi.json"),
        "{}",
        wrong_method.body
    );

    let garbage = send(
        request(addr, "POST", "/v1/turns")
            .bearer_auth("s3cret-token")
            .body("{garbage!"),
    )
    .await;
    assert_eq!(garbage.status, 400, "{}", garbage.body);
    assert!(garbage.json()["code"].is_string());
    let missing = call(
        addr,
        "POST",
        "/v1/turns",
        Some("s3cret-token"),
        Some(&json!({"agent_id": "a"})),
    )
    .await;
    assert_eq!(missing.status, 400);
    assert!(
        missing.json()["message"]
            .as_str()
            .unwrap_or("")
            .contains("session_key"),
        "{}",
        missing.body
    );
    let bad_agent = call(
        addr,
        "POST",
        "/v1/turns",
        Some("s3cret-token"),
        Some(&turn(&url, "Bad Agent", "k", "hi")),
    )
    .await;
    assert_eq!(bad_agent.status, 400);
    // Enum-like fields are parsed: a wrong value is a 400 that lists the allowed ones.
    for (field, value, allowed) in [
        (
            "provider.type",
            json!({"type": "gemini"}),
            "openai, azure, anthropic",
        ),
        (
            "provider.wire_api",
            json!({"wire_api": "chat"}),
            "completions, responses",
        ),
    ] {
        let mut body = turn(&url, "agent-a", "k", "hi");
        for (k, v) in value.as_object().into_iter().flatten() {
            body["provider"][k] = v.clone();
        }
        let refused = call(addr, "POST", "/v1/turns", Some("s3cret-token"), Some(&body)).await;
        assert_eq!(refused.status, 400, "{field}: {}", refused.body);
        let message = refused.json()["message"].as_str().unwrap_or("").to_owned();
        assert!(message.contains(allowed), "{field}: {message}");
    }
    let mut effort = turn(&url, "agent-a", "k", "hi");
    effort["reasoning_effort"] = json!("extreme");
    let refused = call(
        addr,
        "POST",
        "/v1/turns",
        Some("s3cret-token"),
        Some(&effort),
    )
    .await;
    assert_eq!(refused.status, 400, "{}", refused.body);
    assert!(
        refused.json()["message"]
            .as_str()
            .unwrap_or("")
            .contains("low, medium, high, xhigh"),
        "{}",
        refused.body
    );
    let mut schemaless = turn(&url, "agent-z", "c", "REPLY=no");
    schemaless["tools"] = json!([{"name": "lookup", "parameters": "a string"}]);
    let refused = call(
        addr,
        "POST",
        "/v1/turns",
        Some("s3cret-token"),
        Some(&schemaless),
    )
    .await;
    assert_eq!(refused.status, 400, "{}", refused.body);
    assert!(
        refused.body.contains("tools.0.parameters"),
        "{}",
        refused.body
    );
    // An array where the document says object (serde's structs would read one as their
    // fields in order): a 400 at every level, and for compact and reset too.
    let whole = json!(["agent-a", "k", "hi"]);
    let mut as_arrays = vec![("body", whole.clone())];
    for (field, value) in [
        ("auth", json!([])),
        ("provider", json!([url.clone()])),
        ("tools", json!([["lookup"]])),
        ("attachments", json!([["file", "/tmp/x"]])),
        (
            "attachments",
            json!([{"type": "file", "path": "/tmp/x", "line_range": [1, 2]}]),
        ),
    ] {
        let mut body = turn(&url, "agent-a", "k", "hi");
        body[field] = value;
        as_arrays.push((field, body));
    }
    for (field, body) in &as_arrays {
        let refused = call(addr, "POST", "/v1/turns", Some("s3cret-token"), Some(body)).await;
        assert_eq!(refused.status, 400, "{field}: {}", refused.body);
        assert!(
            refused.body.contains("expected a JSON object"),
            "{field}: {}",
            refused.body
        );
    }
    for (method, path) in [
        ("POST", "/v1/sessions/agent-a/k/compact"),
        ("DELETE", "/v1/sessions/agent-a/k"),
    ] {
        let refused = call(addr, method, path, Some("s3cret-token"), Some(&json!([]))).await;
        assert_eq!(refused.status, 400, "{method} {path}: {}", refused.body);
    }
    let big = json!({"agent_id": "a", "session_key": "k", "prompt": "x".repeat(10_000)});
    let oversized = call(addr, "POST", "/v1/turns", Some("s3cret-token"), Some(&big)).await;
    assert_eq!(oversized.status, 413, "{}", oversized.body);
    assert!(
        oversized.body.contains("attachments by path"),
        "{}",
        oversized.body
    );
    // A body shorter than announced: the connection closes, the server survives.
    // The client half-closes after the short body.
    let sent = Instant::now();
    let truncated = support::http::raw_then_close(addr, b"POST /v1/turns HTTP/1.1\r\nHost: x\r\nConnection: close\r\nAuthorization: Bearer s3cret-token\r\nContent-Length: 500\r\n\r\n{\"agent_id\":").await;
    assert!(
        truncated.status == 400 || truncated.status == 0,
        "{truncated:?}"
    );
    assert!(
        sent.elapsed() < Duration::from_secs(10),
        "a truncated body held the connection"
    );
    let answer = call(
        addr,
        "POST",
        "/v1/requests/unknown-id",
        Some("s3cret-token"),
        Some(&json!({"result": "x"})),
    )
    .await;
    assert_eq!(answer.status, 404);
    // Still serving turns.
    let ok = summary(
        addr,
        Some("s3cret-token"),
        &turn(&url, "agent-a", "k", "REPLY=alive"),
    )
    .await;
    assert_eq!(ok.json()["final_text"], "alive", "{}", ok.body);
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gateway_that_disconnects_aborts_its_turn_and_the_conversation_continues() {
    let fx = Fixture::new().await;
    let url = fx.endpoint.base_url();
    let mut pool_config = fx.config().await;
    pool_config.wait_timeout = Duration::from_secs(2);
    let server = InProcess::start(pool_config, ApiConfig::default()).await;
    let addr = server.addr;
    let mut body = turn(&url, "agent-d", "conv", "SCENARIO:slow SLOW=100x100");
    body["provider"]["api_key"] = json!("scripted-key");
    let mut stream = SseStream::open(addr, "/v1/turns", None, &body).await;
    while let Some(e) = stream.next().await {
        if e.event == "assistant.turn_start" {
            break;
        }
    }
    drop(stream);
    // The next turn on the conversation runs (the aborted one released it).
    let next = summary(addr, None, &turn(&url, "agent-d", "conv", "REPLY=back")).await;
    assert_eq!(next.json()["status"], "idle", "{}", next.body);
    assert_eq!(next.json()["final_text"], "back");
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retried_turn_with_its_idempotency_key_gets_its_end_again_instead_of_running_twice() {
    let fx = Fixture::new().await;
    let url = fx.endpoint.base_url();
    let server = InProcess::start(fx.config().await, ApiConfig::default()).await;
    let addr = server.addr;
    let keyed = |key: &str, body: &serde_json::Value, path: &str| {
        request(addr, "POST", path)
            .header("idempotency-key", key)
            .header("content-type", "application/json")
            .body(body.to_string())
    };
    let replayed = |r: &support::http::Response| {
        r.headers
            .iter()
            .any(|(k, v)| k == "idempotent-replayed" && v == "true")
    };
    // A turn whose answer was lost on the way: its retry gets the same end, the prompt
    // is not run again.
    let body = turn(&url, "agent-i", "conv", "REPLY=once");
    let first = send(keyed("key-1", &body, "/v1/turns?stream=false")).await;
    assert_eq!(first.json()["final_text"], "once", "{}", first.body);
    assert!(!replayed(&first));
    let asked = fx.model.requests().len();
    let again = send(keyed("key-1", &body, "/v1/turns?stream=false")).await;
    assert_eq!(again.status, 200, "{}", again.body);
    assert!(replayed(&again), "{:?}", again.headers);
    assert_eq!(again.json(), first.json());
    let mut streamed = SseStream::from_request(keyed("key-1", &body, "/v1/turns")).await;
    let (events, end) = streamed.until_end().await;
    assert_eq!(
        events.len(),
        1,
        "the stream of a replay is its turn.end: {events:?}"
    );
    assert_eq!(end, first.json());
    assert_eq!(fx.model.requests().len(), asked, "the prompt ran once");
    // The key with another body: refused, saying so.
    let other = turn(&url, "agent-i", "conv", "REPLY=other");
    let refused = send(keyed("key-1", &other, "/v1/turns?stream=false")).await;
    assert_eq!(refused.status, 422, "{}", refused.body);
    assert_eq!(refused.json()["code"], "idempotency_key_reused");

    // During its turn a retry is told the turn runs; after it, it gets the end.
    let slow = turn(&url, "agent-i", "conv", "SCENARIO:slow SLOW=5x100");
    let mut running = SseStream::from_request(keyed("key-2", &slow, "/v1/turns")).await;
    running.until_event("assistant.turn_start").await;
    let during = send(keyed("key-2", &slow, "/v1/turns?stream=false")).await;
    assert_eq!(during.status, 409, "{}", during.body);
    assert!(during.body.contains("Idempotency-Key"), "{}", during.body);
    let (_, ended) = running.until_end().await;
    let after = send(keyed("key-2", &slow, "/v1/turns?stream=false")).await;
    assert!(replayed(&after), "{}", after.body);
    assert_eq!(after.json(), ended);

    // A turn whose gateway left was aborted: its retry runs it (once the abort settled).
    let left = turn(&url, "agent-i", "conv", "SCENARIO:slow SLOW=100x100");
    let mut stream = SseStream::from_request(keyed("key-3", &left, "/v1/turns")).await;
    stream.until_event("assistant.turn_start").await;
    drop(stream);
    let asked = fx.model.requests().len();
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut retry = loop {
        let retry = SseStream::from_request(keyed("key-3", &left, "/v1/turns")).await;
        if retry.status != 409 {
            break retry;
        }
        assert!(Instant::now() < deadline, "the aborted turn kept its key");
        // The abort settles within moments: poll, not spin.
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(retry.status, 200);
    retry.until_event("assistant.turn_start").await;
    // The retry of an aborted turn runs it: its model call comes.
    tokio::time::timeout(
        Duration::from_secs(20),
        fx.model.wait_for_requests(asked + 1),
    )
    .await
    .expect("the retry of an aborted turn calls the model");
    drop(retry);
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_compact_or_reset_during_a_conversations_first_turn_is_busy_not_unknown() {
    let fx = Fixture::new().await;
    let url = fx.endpoint.base_url();
    let server = InProcess::over_pool(&fx, |config| config.warm_spares = 0).await;
    let addr = server.addr;
    // The conversation's first turn waits for its process to start (no binding yet).
    let first_body = turn(&url, "agent-f", "fresh", "REPLY=first");
    let first = tokio::spawn(async move { summary(addr, None, &first_body).await });
    until_a_lease_waits(&server.pool, "the first turn waits for its process").await;
    let settings = settings(&url);
    for (method, path, body) in [
        (
            "POST",
            "/v1/sessions/agent-f/fresh/compact",
            Some(&settings),
        ),
        ("DELETE", "/v1/sessions/agent-f/fresh", Some(&settings)),
        // By its name alone: busy too.
        ("DELETE", "/v1/sessions/agent-f/fresh", None),
    ] {
        let answer = call(addr, method, path, None, body).await;
        assert_eq!(answer.status, 409, "{method} {path}: {}", answer.body);
        assert_eq!(answer.json()["code"], "busy", "{}", answer.body);
    }
    let first = first.await.expect("the first turn's request");
    assert_eq!(first.json()["final_text"], "first", "{}", first.body);
    // Never started at all: still unknown.
    let unknown = call(
        addr,
        "POST",
        "/v1/sessions/agent-f/never/compact",
        None,
        Some(&settings),
    )
    .await;
    assert_eq!(unknown.status, 404, "{}", unknown.body);
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_child_ends_the_streamed_turn_as_crashed_and_the_next_turn_resumes() {
    let fx = Fixture::new().await;
    let url = fx.endpoint.base_url();
    // The next turn resumes the conversation itself: the crashed process's replacement, a
    // spare while empty, could resume it ahead ("attached").
    let server = InProcess::over_pool(&fx, |config| config.warm_spares = 0).await;
    let addr = server.addr;
    let first = summary(
        addr,
        None,
        &turn(&url, "agent-k", "conv", "REPLY=ok MARKER-daemon-6"),
    )
    .await;
    assert_eq!(first.json()["status"], "idle");
    // The summary says how the conversation was opened, and what the turn cost.
    assert_eq!(first.json()["open_reason"], "new", "{}", first.body);
    assert!(
        first.json()["usage"]["input_tokens"].as_u64() > Some(0),
        "{}",
        first.body
    );
    // The scripted model reports 40 cached prompt tokens per call.
    let calls = first.json()["llm_calls"].as_u64().unwrap_or(0);
    assert_eq!(
        first.json()["usage"]["cache_read_tokens"],
        40 * calls,
        "{}",
        first.body
    );
    let mut stream = SseStream::open(
        addr,
        "/v1/turns",
        None,
        &turn(&url, "agent-k", "conv", "SCENARIO:slow SLOW=100x100"),
    )
    .await;
    while let Some(e) = stream.next().await {
        if e.event == "assistant.message_delta" || e.event == "assistant.turn_start" {
            break;
        }
    }
    let pool = call(addr, "GET", "/v1/pool", None, None).await.json();
    let pid = pool["processes"][0]["pid"].as_u64().expect("pid") as i32;
    let killed = Instant::now();
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(pid),
        nix::sys::signal::Signal::SIGKILL,
    )
    .expect("kill");
    let (_, end) = stream.until_end().await;
    assert!(
        killed.elapsed() < Duration::from_secs(1),
        "{:?}",
        killed.elapsed()
    );
    assert_eq!(end["status"], "crashed", "{end}");
    let next = summary(addr, None, &turn(&url, "agent-k", "conv", "the marker?")).await;
    assert_eq!(next.json()["status"], "idle", "{}", next.body);
    assert_eq!(next.json()["resumed"], true);
    assert_eq!(next.json()["open_reason"], "resumed", "{}", next.body);
    let last = fx.model.requests().pop().expect("request");
    assert!(
        serde_json::to_string(last.messages())
            .unwrap_or_default()
            .contains("MARKER-daemon-6")
    );
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn abort_compact_and_reset_a_conversation_over_http() {
    let fx = Fixture::new().await;
    let url = fx.endpoint.base_url();
    let server = InProcess::start(fx.config().await, ApiConfig::default()).await;
    let addr = server.addr;
    let conv = |key: &str| json!({"model": ScriptedModel::MODEL_ID, "provider": {"type": "openai", "base_url": url, "api_key": key}});

    // Abort a running turn.
    let mut stream = SseStream::open(
        addr,
        "/v1/turns",
        None,
        &turn(&url, "agent-c", "conv", "SCENARIO:slow SLOW=200x100"),
    )
    .await;
    while let Some(e) = stream.next().await {
        if e.event == "assistant.message_delta" || e.event == "assistant.turn_start" {
            break;
        }
    }
    // A compact or a reset of a conversation running a turn is a 409 at once, not a wait.
    for (method, path) in [
        ("POST", "/v1/sessions/agent-c/conv/compact"),
        ("DELETE", "/v1/sessions/agent-c/conv"),
    ] {
        let asked = Instant::now();
        let busy = call(addr, method, path, None, Some(&conv("scripted-key"))).await;
        assert_eq!(busy.status, 409, "{path}: {}", busy.body);
        // Refused as busy, not after waiting out the lease wait ("stayed leased ... for").
        assert!(
            busy.body.contains("is in use by another caller"),
            "{}",
            busy.body
        );
        println!(
            "{method} {path} during a turn: 409 after {:?}",
            asked.elapsed()
        );
    }
    let aborted = call(addr, "POST", "/v1/sessions/agent-c/conv/abort", None, None).await;
    assert_eq!(aborted.status, 204, "{}", aborted.body);
    let (_, end) = stream.until_end().await;
    assert_eq!(end["status"], "aborted", "{end}");
    let session_id = end["session_id"].as_str().unwrap_or_default().to_owned();
    let again = call(addr, "POST", "/v1/sessions/agent-c/conv/abort", None, None).await;
    assert_eq!(again.status, 404);

    // A few turns, then compaction with the conversation's settings.
    for i in 0..3 {
        let body = turn(&url, "agent-c", "conv", &format!("REPLY=turn {i}"));
        let r = summary(addr, None, &body).await;
        assert_eq!(r.json()["status"], "idle", "{}", r.body);
    }
    let compacted = call(
        addr,
        "POST",
        "/v1/sessions/agent-c/conv/compact",
        None,
        Some(&conv("scripted-key")),
    )
    .await;
    assert_eq!(compacted.status, 200, "{}", compacted.body);
    assert_eq!(compacted.json()["success"], true);
    // Other settings name no existing conversation: nothing is created or overwritten. (A
    // new key for the same endpoint would be a rotation of this conversation: another
    // endpoint header is another one.)
    let mut other_settings = conv("scripted-key");
    other_settings["provider"]["headers"] = json!({"X-Other": "1"});
    let other = call(
        addr,
        "POST",
        "/v1/sessions/agent-c/conv/compact",
        None,
        Some(&other_settings),
    )
    .await;
    assert_eq!(other.status, 404, "{}", other.body);
    let unknown = call(
        addr,
        "POST",
        "/v1/sessions/agent-c/never/compact",
        None,
        Some(&conv("scripted-key")),
    )
    .await;
    assert_eq!(unknown.status, 404, "{}", unknown.body);

    // Reset, even with settings other than the conversation's (a compact with them is
    // refused above): the next turn starts a new session.
    let reset = call(
        addr,
        "DELETE",
        "/v1/sessions/agent-c/conv",
        None,
        Some(&other_settings),
    )
    .await;
    assert_eq!(reset.status, 204, "{}", reset.body);
    let fresh_body = turn(&url, "agent-c", "conv", "REPLY=fresh");
    let fresh = summary(addr, None, &fresh_body).await;
    assert_eq!(fresh.json()["resumed"], false, "{}", fresh.body);
    assert_ne!(
        fresh.json()["session_id"].as_str().unwrap_or_default(),
        session_id
    );
    // Tools need the stream.
    let mut with_tools = turn(&url, "agent-c", "conv", "hi");
    with_tools["tools"] = json!([{"name": "t"}]);
    let refused = summary(addr, None, &with_tools).await;
    assert_eq!(refused.status, 400);
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_work_directory_is_made_for_a_rejected_request_a_compact_or_a_reset() {
    let fx = Fixture::new().await;
    let url = fx.endpoint.base_url();
    let mut config = ApiConfig::default();
    config.api_token = Some(Secret::new("tok"));
    let server = InProcess::start(fx.config().await, config).await;
    let addr = server.addr;
    let agents = server.pool.config().agents_base_dir.clone();
    let work = |agent: &str| copilot_pool::home::work_dir(&agents, agent).expect("agent id");
    let unauthorized = summary(addr, None, &turn(&url, "agent-x", "c", "REPLY=no")).await;
    assert_eq!(unauthorized.status, 401);
    let mut zero = turn(&url, "agent-z", "c", "REPLY=no");
    zero["timeout_ms"] = json!(0);
    let bad = call(addr, "POST", "/v1/turns", Some("tok"), Some(&zero)).await;
    assert_eq!(bad.status, 400, "{}", bad.body);
    // Longer than the daemon allows (the default absolute limit is 30 min).
    let mut long = turn(&url, "agent-z", "c", "REPLY=no");
    long["timeout_ms"] = json!(u64::MAX);
    let bad = call(addr, "POST", "/v1/turns", Some("tok"), Some(&long)).await;
    assert_eq!(bad.status, 400, "{}", bad.body);
    assert!(bad.body.contains("1800000 ms"), "{}", bad.body);
    let unnamed = turn(&url, "agent-z", "", "REPLY=no");
    let bad = call(addr, "POST", "/v1/turns", Some("tok"), Some(&unnamed)).await;
    assert_eq!(bad.status, 400, "{}", bad.body);
    assert!(bad.body.contains("session_key"), "{}", bad.body);
    let conv = json!({"model": ScriptedModel::MODEL_ID, "provider": {"type": "openai", "base_url": url, "api_key": "k"}});
    let compact = call(
        addr,
        "POST",
        "/v1/sessions/agent-y/c/compact",
        Some("tok"),
        Some(&conv),
    )
    .await;
    assert_eq!(compact.status, 404, "{}", compact.body);
    let reset = call(
        addr,
        "DELETE",
        "/v1/sessions/agent-y/c",
        Some("tok"),
        Some(&conv),
    )
    .await;
    assert_eq!(reset.status, 404, "{}", reset.body);
    for agent in ["agent-x", "agent-y", "agent-z"] {
        assert!(
            !work(agent).exists(),
            "{} was created",
            work(agent).display()
        );
        // Nor its home: a compact or a reset of a conversation that was never started is
        // refused before anything is made for it.
        let home = work(agent).with_file_name("copilot");
        assert!(!home.exists(), "{} was created", home.display());
    }
    let status = server.pool.status().await.expect("status");
    assert!(
        status.workers.is_empty(),
        "no runtime started for a refused compact or reset: {status:?}"
    );
    // A turn that runs gets it, private.
    let ran = summary(addr, Some("tok"), &turn(&url, "agent-w", "c", "REPLY=yes")).await;
    assert_eq!(ran.json()["status"], "idle", "{}", ran.body);
    use std::os::unix::fs::PermissionsExt;
    let mode = std::fs::metadata(work("agent-w"))
        .expect("work dir")
        .permissions()
        .mode();
    assert_eq!(mode & 0o777, 0o700);
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_state_directory_that_cannot_record_the_conversation_is_a_503_naming_it() {
    let fx = Fixture::new().await;
    let url = fx.endpoint.base_url();
    let server = InProcess::start(fx.config().await, ApiConfig::default()).await;
    let addr = server.addr;
    let first = summary(addr, None, &turn(&url, "agent-s", "conv-1", "REPLY=ok")).await;
    assert_eq!(first.json()["status"], "idle", "{}", first.body);
    // The state directory is replaced by a file between two turns.
    let state = server.pool.config().state_dir.clone();
    std::fs::rename(&state, fx.scratch.path().join("state-aside")).expect("move");
    std::fs::write(&state, b"not a directory").expect("file");
    let second = summary(addr, None, &turn(&url, "agent-s", "conv-2", "REPLY=never")).await;
    assert_eq!(second.status, 503, "{}", second.body);
    assert_eq!(second.json()["code"], "state_unwritable", "{}", second.body);
    let message = second.json()["message"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    assert!(message.contains(&state.display().to_string()), "{message}");
    assert!(message.contains("Not a directory"), "{message}");
    server.stop().await;
}

/// Streams one turn of `body`, answering each `permission.request` with `decision`; returns
/// how many were asked and the turn's `turn.end`.
async fn turn_answering(
    addr: std::net::SocketAddr,
    body: &serde_json::Value,
    decision: &str,
) -> (usize, serde_json::Value) {
    let mut stream = SseStream::open(addr, "/v1/turns", None, body).await;
    assert_eq!(stream.status, 200);
    let mut asked = 0;
    while let Some(event) = stream.next().await {
        match event.event.as_str() {
            "permission.request" => {
                asked += 1;
                let body = json!({"decision": decision});
                let answered = answer(addr, &request_id(&event), &body).await;
                assert_eq!(answered.status, 204, "{}", answered.body);
            }
            "turn.end" => return (asked, event.data),
            _ => {}
        }
    }
    panic!("the turn's stream ended without turn.end");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn approve_for_session_over_http_lets_the_same_shell_line_and_later_writes_run_unasked() {
    let fx = Fixture::new().await;
    let url = fx.endpoint.base_url();
    let server = InProcess::start(fx.config().await, ApiConfig::default()).await;
    let addr = server.addr;
    let dir = fx.scratch.path().to_path_buf();
    let bash = |command: &str| {
        let args = json!({"command": command, "description": "run it", "mode": "sync", "initial_wait": 10});
        format!("SCENARIO:tool NAME=bash ARGS={args}")
    };
    let create = |name: &str| {
        let args = json!({"path": dir.join(name), "file_text": "written"});
        format!("SCENARIO:tool NAME=create ARGS={args}")
    };
    for (decision, key, expected) in [
        ("approve-for-session", "session", [1, 0, 1, 0]),
        ("approve-once", "once", [1, 1, 1, 1]),
    ] {
        let prompts = [
            bash("echo asked-once"),
            bash("echo asked-once"),
            create(&format!("{key}-a.txt")),
            create(&format!("{key}-b.txt")),
        ];
        let mut asked = Vec::new();
        for prompt in &prompts {
            let (n, end) =
                turn_answering(addr, &turn(&url, "agent-p", key, prompt), decision).await;
            assert_eq!(end["status"], "idle", "{end}");
            asked.push(n);
            if prompt.contains("echo") {
                let text = end["final_text"].as_str().unwrap_or_default();
                assert!(text.contains("asked-once\n"), "the line ran: {end}");
            }
        }
        assert_eq!(asked, expected, "{decision}");
        for name in ["a", "b"] {
            let path = dir.join(format!("{key}-{name}.txt"));
            assert_eq!(std::fs::read_to_string(&path).expect("written"), "written");
        }
    }
    server.stop().await;
}
