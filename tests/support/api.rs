//! The HTTP API served in-process, as a Rust gateway would serve it: the library's router
//! over a real `Pool` (the fixture's runtime and scripted model) on a loopback listener,
//! through `copilot_pool::http::serve`.

#![allow(dead_code)]

use std::net::SocketAddr;
use std::time::Duration;

use copilot_pool::http::{self, ApiConfig, ApiHandle, ConnectionLimits};
use copilot_pool::pool::{Pool, PoolConfig};
use copilot_pool::scripted_model::ScriptedModel;
use serde_json::{Value, json};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

use super::pool_fixture::{Fixture, shutdown_leaves_nothing};

/// A router served on loopback over its own pool.
pub struct InProcess {
    pub addr: SocketAddr,
    pub pool: Pool,
    pub api: ApiHandle,
    stop: oneshot::Sender<()>,
    server: JoinHandle<()>,
}

impl InProcess {
    /// The API with its defaults over a pool of `fx`'s config as `change` leaves it.
    pub async fn over_pool(fx: &Fixture, change: impl FnOnce(&mut PoolConfig)) -> InProcess {
        let mut config = fx.config().await;
        change(&mut config);
        InProcess::start(config, ApiConfig::default()).await
    }

    /// Starts a pool with `pool_config` and serves the API over it with `api_config`.
    pub async fn start(pool_config: PoolConfig, api_config: ApiConfig) -> InProcess {
        let pool = Pool::start(pool_config).await.expect("pool");
        let (router, api) = http::router_with_handle(pool.clone(), api_config);
        let (addr, stop, server) = serve(router).await;
        InProcess {
            addr,
            pool,
            api,
            stop,
            server,
        }
    }

    /// Stops serving, then shuts the pool down and checks no process is left.
    pub async fn stop(self) {
        let _ = self.stop.send(());
        shutdown_leaves_nothing(&self.pool).await;
        tokio::time::timeout(Duration::from_secs(10), self.server)
            .await
            .expect("the listener stopped once its connections closed")
            .expect("the listener task");
    }
}

/// Serves `router` on a loopback port with the default limits, until the sender fires.
pub async fn serve(router: axum::Router) -> (SocketAddr, oneshot::Sender<()>, JoinHandle<()>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind loopback");
    let addr = listener.local_addr().expect("local address");
    let (stop, stopped) = oneshot::channel::<()>();
    let server = tokio::spawn(http::serve(
        listener,
        router,
        ConnectionLimits::default(),
        async move {
            let _ = stopped.await;
        },
    ));
    (addr, stop, server)
}

/// A `POST /v1/turns` body on the scripted model at `model_url`.
pub fn turn(model_url: &str, agent: &str, key: &str, prompt: &str) -> Value {
    let mut body = settings(model_url);
    body["agent_id"] = json!(agent);
    body["session_key"] = json!(key);
    body["prompt"] = json!(prompt);
    body
}

/// The conversation's settings as [`turn`] sends them (the model and its provider): what a
/// compact or a reset of that conversation names.
pub fn settings(model_url: &str) -> Value {
    json!({
        "model": ScriptedModel::MODEL_ID,
        "provider": {"type": "openai", "base_url": model_url, "api_key": "scripted-key"},
    })
}

/// A `POST /v1/turns` body whose turn calls the gateway tool `lookup` with `{"key": key}`
/// (the scripted model then replies `tool said: <result>`).
pub fn lookup_turn(model_url: &str, agent: &str, session_key: &str, key: &str) -> Value {
    let prompt = format!(r#"SCENARIO:tool NAME=lookup ARGS={{"key":"{key}"}}"#);
    let mut body = turn(model_url, agent, session_key, &prompt);
    body["tools"] = json!([{"name": "lookup", "description": "Looks up a number", "parameters": {"type": "object"}}]);
    body
}

/// The `request_id` a request event (`tool.call`, `permission.request`, …) is answered by.
pub fn request_id(event: &super::http::Sse) -> String {
    event.data["request_id"]
        .as_str()
        .expect("request_id")
        .to_owned()
}

/// `POST /v1/turns?stream=false` with `body`: the turn's `turn.end` summary alone.
pub async fn summary(addr: SocketAddr, token: Option<&str>, body: &Value) -> super::http::Response {
    super::http::call(addr, "POST", "/v1/turns?stream=false", token, Some(body)).await
}

/// Answers a pending tool call or permission request of a streamed turn.
pub async fn answer(addr: SocketAddr, id: &str, body: &Value) -> super::http::Response {
    super::http::call(
        addr,
        "POST",
        &format!("/v1/requests/{id}"),
        None,
        Some(body),
    )
    .await
}

/// Runs a `lookup_turn` body over SSE, answers its tool call with `result`, and returns
/// the `turn.end` summary of a turn that ended `idle`.
pub async fn answered_tool_turn(addr: SocketAddr, body: &Value, result: &str) -> Value {
    let mut stream = super::http::SseStream::open(addr, "/v1/turns", None, body).await;
    let id = request_id(&stream.until_event("tool.call").await);
    let answered = answer(addr, &id, &serde_json::json!({ "result": result })).await;
    assert_eq!(answered.status, 204, "{}", answered.body);
    let (_, end) = stream.until_end().await;
    assert_eq!(end["status"], "idle", "{end}");
    end
}
