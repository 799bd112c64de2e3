//! End-to-end: a worker drives the real Copilot runtime through full turns against the
//! scripted model: event order, client tools, abort, resume in a fresh process, the model
//! tunnel, and the child's environment.

mod support;

use std::sync::Arc;

use copilot_pool::rpc::EventKind;
use copilot_pool::rpc::messages::SessionConfig;
use copilot_pool::scripted_model::{ScriptedModel, Transport};
use copilot_pool::worker::{ToolResult, WorkerError, WorkerHandle};
use support::{
    Scratch, collect_turn, event_where, final_text, next_event, position, secret_tool,
    session_config, worker_config,
};

#[tokio::test]
async fn a_turn_emits_the_documented_events_in_order() {
    let (scratch, model, endpoint, worker) = support::worker_and_model().await;
    assert_eq!(worker.info().protocol_version, 3);

    let mut session = worker
        .create_session(session_config(&endpoint.base_url(), &scratch))
        .await
        .expect("session");
    session
        .send("REPLY=hello from the scripted model")
        .await
        .expect("send");
    let events = collect_turn(&mut session).await;
    let types: Vec<&str> = events.iter().map(|e| e.event_type()).collect();

    let user = position(&events, "user.message").expect("user.message");
    let start = position(&events, "assistant.turn_start").expect("turn_start");
    let message = position(&events, "assistant.message").expect("assistant.message");
    let end = position(&events, "assistant.turn_end").expect("turn_end");
    let idle = position(&events, "session.idle").expect("session.idle");
    assert!(
        user < start && start < message && message < end && end < idle,
        "{types:?}"
    );
    assert_eq!(final_text(&events), "hello from the scripted model");
    assert!(
        !events.iter().any(|e| e.event_type() == "session.error"),
        "{types:?}"
    );
    let EventKind::SessionIdle(idle) = &events[idle].kind else {
        unreachable!()
    };
    assert_ne!(idle.aborted, Some(true));

    // The model really was asked, over HTTP.
    let requests = model.requests();
    assert!(requests.iter().any(|r| r.transport == Transport::Http));
    support::shutdown_and_check(&worker).await;
}

/// Sends a turn whose model calls `get_secret_number` with key `alpha`, and waits for the
/// runtime to ask the client for it.
async fn secret_tool_requested(
    session: &mut copilot_pool::worker::Session,
) -> copilot_pool::rpc::events::ExternalToolRequestedData {
    session
        .send(r#"SCENARIO:tool NAME=get_secret_number ARGS={"key":"alpha"}"#)
        .await
        .expect("send");
    event_where(session, |kind| match kind {
        EventKind::ExternalToolRequested(req) => Some(req),
        _ => None,
    })
    .await
}

#[tokio::test]
async fn a_client_tool_round_trip_and_answers_only_from_the_owning_session() {
    let (scratch, model, endpoint, worker) = support::worker_and_model().await;
    let with_tool = |scratch: &Scratch| SessionConfig {
        tools: vec![secret_tool()],
        ..session_config(&endpoint.base_url(), scratch)
    };
    let mut owner = worker
        .create_session(with_tool(&scratch))
        .await
        .expect("session");
    let other = worker
        .create_session(with_tool(&scratch))
        .await
        .expect("session 2");

    let request = secret_tool_requested(&mut owner).await;
    assert_eq!(request.tool_name, "get_secret_number");
    assert_eq!(request.arguments["key"], "alpha");
    assert_eq!(request.session_id, owner.id().as_str());

    // The runtime would accept this answer from the wrong conversation; the worker does not.
    let err = other
        .answer_tool_call(&request.request_id, ToolResult::Text("stolen".into()))
        .await
        .expect_err("cross-session answer refused");
    assert!(
        matches!(err, WorkerError::NoSuchPendingRequest { .. }),
        "{err}"
    );

    owner
        .answer_tool_call(&request.request_id, ToolResult::Text("42".into()))
        .await
        .expect("answer");
    let events = collect_turn(&mut owner).await;
    assert!(position(&events, "external_tool.completed").is_some());
    assert_eq!(final_text(&events), "tool said: 42");
    // The follow-up model call carried the tool result.
    let last = model.requests().pop().expect("requests");
    assert!(
        last.messages()
            .iter()
            .any(|m| m["role"] == "tool" && m["content"] == "42"),
        "{:?}",
        last.messages()
    );
    // Answers cannot bypass the ledger through the raw call either.
    let bypass = worker
        .call::<copilot_pool::rpc::messages::HandlePendingToolCall>(
            &copilot_pool::rpc::messages::ToolCallAnswer {
                session_id: owner.id().to_string(),
                request_id: request.request_id.clone(),
                result: Some(serde_json::json!("sneaky")),
                error: None,
            },
        )
        .await;
    assert!(matches!(bypass, Err(WorkerError::Config(_))), "{bypass:?}");
    // A second answer to the same request is refused too.
    let again = owner
        .answer_tool_call(&request.request_id, ToolResult::Text("43".into()))
        .await;
    assert!(matches!(
        again,
        Err(WorkerError::NoSuchPendingRequest { .. })
    ));
    support::shutdown_and_check(&worker).await;
}

#[tokio::test]
async fn a_tool_answer_whose_caller_stops_waiting_is_still_delivered() {
    let (scratch, _model, endpoint, worker) = support::worker_and_model().await;
    let mut session = worker
        .create_session(SessionConfig {
            tools: vec![secret_tool()],
            ..session_config(&endpoint.base_url(), &scratch)
        })
        .await
        .expect("session");
    let request = secret_tool_requested(&mut session).await;
    // Polled once (the request taken from the worker's ledger by then), then dropped, as a
    // turn's tool task aborted as its turn ends is.
    {
        let answer = session.answer_tool_call(&request.request_id, ToolResult::Text("42".into()));
        let mut answer = std::pin::pin!(answer);
        let mut once = std::task::Context::from_waker(std::task::Waker::noop());
        let polled = answer.as_mut().poll(&mut once);
        assert!(polled.is_pending(), "answered within its first poll");
    }
    let events = collect_turn(&mut session).await;
    assert_eq!(final_text(&events), "tool said: 42");
    support::shutdown_and_check(&worker).await;
}

#[tokio::test]
async fn abort_mid_turn_ends_with_an_aborted_idle() {
    let (scratch, _model, endpoint, worker) = support::worker_and_model().await;
    let mut session = worker
        .create_session(SessionConfig {
            streaming: true,
            ..session_config(&endpoint.base_url(), &scratch)
        })
        .await
        .expect("session");
    session
        .send("SCENARIO:slow SLOW=200x100")
        .await
        .expect("send");
    // Wait until the answer is streaming, then abort.
    event_where(&mut session, |kind| {
        matches!(kind, EventKind::AssistantMessageDelta(_)).then_some(())
    })
    .await;
    session.abort().await.expect("abort");
    let events = collect_turn(&mut session).await;
    let Some(EventKind::SessionIdle(idle)) = events.last().map(|e| &e.kind) else {
        panic!("turn did not end with session.idle")
    };
    assert_eq!(idle.aborted, Some(true));
    // The runtime acknowledges the abort with `abort` and `agent.interrupted` (protocol
    // reference §8); under heavy load one full run saw the idle without `abort`, so either
    // acknowledgement counts, and the events are named if neither came.
    let names: Vec<&str> = events.iter().map(|e| e.event_type()).collect();
    assert!(
        position(&events, "abort").is_some() || position(&events, "agent.interrupted").is_some(),
        "no acknowledgement of the abort among {names:?}"
    );
    support::shutdown_and_check(&worker).await;
}

#[tokio::test]
async fn a_resumed_session_in_a_fresh_worker_carries_the_history() {
    let scratch = Scratch::new();
    let model = ScriptedModel::new();
    let endpoint = model.serve_http().await.expect("model endpoint");
    let first = WorkerHandle::start(worker_config(&scratch).await)
        .await
        .expect("worker starts");
    let mut session = first
        .create_session(session_config(&endpoint.base_url(), &scratch))
        .await
        .expect("session");
    let id = session.id().to_owned();
    session
        .send("REPLY=noted MARKER-7f3a remember this")
        .await
        .expect("send");
    collect_turn(&mut session).await;
    session.detach().await.expect("detach");
    support::shutdown_and_check(&first).await;

    let second = WorkerHandle::start(worker_config(&scratch).await)
        .await
        .expect("second worker starts");
    assert_ne!(first.pid(), second.pid());
    let (mut resumed, answer) = second
        .resume_session(SessionConfig {
            session_id: id.to_string(),
            ..session_config(&endpoint.base_url(), &scratch)
        })
        .await
        .expect("resume");
    assert_eq!(resumed.id(), &id);
    // The session keeps the runtime's answer (as text) and gives it back whole.
    let kept = serde_json::to_value(resumed.opened().expect("the answer is kept")).expect("json");
    assert_eq!(kept, serde_json::to_value(&answer).expect("json"));
    assert!(kept.get("capabilities").is_some(), "{kept}");
    resumed
        .send("what did I ask you to remember?")
        .await
        .expect("send");
    let events = collect_turn(&mut resumed).await;
    assert!(
        final_text(&events).starts_with("scripted reply"),
        "{}",
        final_text(&events)
    );
    let last = model.requests().pop().expect("request");
    let history = serde_json::to_string(last.messages()).expect("json");
    assert!(
        history.contains("MARKER-7f3a"),
        "history not carried: {history}"
    );
    assert!(
        history.contains("noted"),
        "earlier answer not carried: {history}"
    );
    support::shutdown_and_check(&second).await;
}

#[tokio::test]
async fn the_model_can_be_served_over_the_json_rpc_tunnel() {
    let scratch = Scratch::new();
    let model = ScriptedModel::new();
    let mut config = worker_config(&scratch).await;
    config.model_tunnel = Some(Arc::new(model.clone()));
    let worker = WorkerHandle::start(config).await.expect("worker starts");
    // Nothing listens on port 9: every model call must come through the pipe.
    let mut session = worker
        .create_session(SessionConfig {
            streaming: true,
            ..session_config("http://127.0.0.1:9/v1", &scratch)
        })
        .await
        .expect("session");
    session
        .send("REPLY=through the tunnel")
        .await
        .expect("send");
    let events = collect_turn(&mut session).await;
    assert_eq!(final_text(&events), "through the tunnel");
    assert!(position(&events, "assistant.message_delta").is_some());
    let requests = model.requests();
    assert!(!requests.is_empty());
    assert!(requests.iter().all(|r| r.transport == Transport::Tunnel));
    assert_eq!(
        requests[0].session_id.as_deref(),
        Some(session.id().as_str())
    );
    support::shutdown_and_check(&worker).await;
}

#[tokio::test]
async fn parent_tokens_never_reach_the_child() {
    let scratch = Scratch::new();
    let mut config = worker_config(&scratch).await;
    let mut parent: Vec<(std::ffi::OsString, std::ffi::OsString)> = std::env::vars_os().collect();
    parent.push(("GH_TOKEN".into(), "ghp_parent_secret".into()));
    parent.push(("GITHUB_TOKEN".into(), "ghp_parent_secret".into()));
    parent.push(("COPILOT_GITHUB_TOKEN".into(), "ghp_parent_secret".into()));
    config.base_env = Some(parent);
    config.auth_token = Some("ghu_worker_token".into());
    let worker = WorkerHandle::start(config).await.expect("worker starts");
    let env = support::procs::environ(worker.pid());
    assert!(!env.is_empty(), "could not read the child's environment");
    assert!(env.iter().all(|(_, v)| v != "ghp_parent_secret"), "{env:?}");
    let get = |k: &str| env.iter().find(|(n, _)| n == k).map(|(_, v)| v.clone());
    assert_eq!(
        get("COPILOT_SDK_AUTH_TOKEN").as_deref(),
        Some("ghu_worker_token")
    );
    assert_eq!(
        get("COPILOT_HOME").map(std::path::PathBuf::from),
        Some(scratch.copilot_home())
    );
    let cmdline = std::fs::read(format!("/proc/{}/cmdline", worker.pid())).unwrap_or_default();
    let cmdline = String::from_utf8_lossy(&cmdline).replace('\0', " ");
    assert!(
        cmdline.contains("--auth-token-env COPILOT_SDK_AUTH_TOKEN"),
        "{cmdline}"
    );
    assert!(
        !cmdline.contains("ghu_worker_token"),
        "token on the command line: {cmdline}"
    );
    support::shutdown_and_check(&worker).await;
}

#[tokio::test]
async fn a_permission_prompt_is_answered_before_the_tool_runs() {
    let (scratch, _model, endpoint, worker) = support::worker_and_model().await;
    let mut tool = secret_tool();
    tool.skip_permission = Some(false);
    let mut session = worker
        .create_session(SessionConfig {
            tools: vec![tool],
            request_permission: true,
            ..session_config(&endpoint.base_url(), &scratch)
        })
        .await
        .expect("session");
    session
        .send(r#"SCENARIO:tool NAME=get_secret_number ARGS={"key":"beta"}"#)
        .await
        .expect("send");
    let permission = loop {
        let event = next_event(&mut session).await.expect("event");
        match event.kind {
            EventKind::PermissionRequested(req) => break req,
            EventKind::ExternalToolRequested(_) => panic!("tool ran before the permission"),
            _ => {}
        }
    };
    assert_eq!(permission.permission_request["kind"], "custom-tool");
    session
        .answer_permission(
            &permission.request_id,
            serde_json::json!({"kind": "approve-once"}),
        )
        .await
        .expect("approve");
    let request = event_where(&mut session, |kind| match kind {
        EventKind::ExternalToolRequested(req) => Some(req),
        _ => None,
    })
    .await;
    session
        .answer_tool_call(&request.request_id, ToolResult::Text("7".into()))
        .await
        .expect("answer");
    let events = collect_turn(&mut session).await;
    assert_eq!(final_text(&events), "tool said: 7");
    support::shutdown_and_check(&worker).await;
}

#[tokio::test]
async fn an_open_cancelled_midway_leaves_no_stale_route_and_the_session_opens_again() {
    let (scratch, _model, endpoint, worker) = support::worker_and_model().await;
    let config = session_config(&endpoint.base_url(), &scratch);
    let mut session = worker
        .create_session(config.clone())
        .await
        .expect("session");
    session.send("REPLY=first").await.expect("send");
    collect_turn(&mut session).await;
    let id = session.id().to_owned();
    session.detach().await.expect("detach");

    let resume = SessionConfig {
        session_id: id.to_string(),
        ..config
    };
    // Cancelled at every await of the open: after one poll the route is being opened,
    // after more the resume is on its way or answered.
    for polls in 1..=4 {
        let mut opening = Box::pin(worker.resume_session(resume.clone()));
        for _ in 0..polls {
            if futures_util::poll!(&mut opening).is_ready() {
                break;
            }
            tokio::task::yield_now().await;
        }
        drop(opening);
        // The next open of the same id on the same worker is not refused.
        let (mut session, _) = worker
            .resume_session(resume.clone())
            .await
            .unwrap_or_else(|e| panic!("after {polls} polls: {e}"));
        session.send("REPLY=again").await.expect("send");
        assert_eq!(final_text(&collect_turn(&mut session).await), "again");
        session.detach().await.expect("detach");
    }
    worker.shutdown().await;
}
