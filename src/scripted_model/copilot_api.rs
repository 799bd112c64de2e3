//! A loopback stand-in for the GitHub API and the Copilot API, so a runtime in token mode
//! (a GitHub token, no BYOK provider) runs whole turns offline with fake tokens. Point the
//! runtime at it with [`CopilotApiStandIn::runtime_env`] (`COPILOT_API_URL` and
//! `COPILOT_DEBUG_GITHUB_API_URL` in its environment, e.g. through
//! `WorkerConfig::extra_env`).
//!
//! What the runtime calls, found by logging its requests (runtime 1.0.85 of the pinned
//! package): `GET /copilot_internal/user` on the GitHub API with `Authorization: Bearer
//! <GitHub token>`, once for the process token at start and once per session that brings
//! its own `gitHubToken`; then, on the Copilot API, `GET /models` and `POST
//! /chat/completions` with the same bearer (no token exchange: the GitHub token is the
//! Copilot API credential), and `POST /mcp/readonly` for its built-in GitHub MCP server
//! (answered 404 here; the runtime reports that server failed and carries on).
//!
//! Chat completions are the [`ScriptedModel`]'s (same directives, same request log); the
//! stand-in itself records the method, path and credential of every request it gets
//! ([`CopilotApiStandIn::requests`]), so a test sees which token reached which endpoint.
//! A request without a bearer is answered 401, as GitHub does.

use std::sync::Arc;

use axum::Router;
use axum::extract::Request;
use axum::http::{StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use serde_json::{Value, json};
use tokio::sync::watch;

use super::error::ScriptedModelError;
use super::http::{Endpoint, HttpEndpoint, handle, serve_app};
use super::model::ScriptedModel;
use crate::secret::Secret;

/// The runtime variable naming the Copilot API's base URL.
pub const COPILOT_API_URL_ENV: &str = "COPILOT_API_URL";

/// The runtime variable naming the GitHub API's base URL.
pub const GITHUB_API_URL_ENV: &str = "COPILOT_DEBUG_GITHUB_API_URL";

/// The login the stand-in reports for every token.
pub const STAND_IN_LOGIN: &str = "stand-in-user";

/// One request the stand-in received.
#[derive(Debug, Clone)]
pub struct StandInRequest {
    /// HTTP method.
    pub method: String,
    /// Path, without query.
    pub path: String,
    /// The `Authorization` header, if any.
    pub authorization: Option<Secret>,
}

impl StandInRequest {
    /// The bearer token of the `Authorization` header, if it is one.
    pub fn bearer(&self) -> Option<&str> {
        let value = self.authorization.as_ref()?.expose();
        let (scheme, token) = value.split_once(' ')?;
        scheme
            .eq_ignore_ascii_case("bearer")
            .then_some(token.trim())
    }
}

/// A running stand-in; stops when dropped.
#[derive(Debug)]
pub struct CopilotApiStandIn {
    endpoint: HttpEndpoint,
    log: Arc<watch::Sender<Vec<StandInRequest>>>,
}

impl CopilotApiStandIn {
    /// Its base URL, `http://127.0.0.1:<port>` (the GitHub API and the Copilot API both).
    pub fn url(&self) -> String {
        format!("http://{}", self.endpoint.addr())
    }

    /// The variables that point a runtime at the stand-in, for its environment.
    pub fn runtime_env(&self) -> Vec<(String, String)> {
        vec![
            (COPILOT_API_URL_ENV.to_owned(), self.url()),
            (GITHUB_API_URL_ENV.to_owned(), self.url()),
        ]
    }

    /// Every request so far, oldest first.
    pub fn requests(&self) -> Vec<StandInRequest> {
        self.log.borrow().clone()
    }

    /// Waits until `done` holds for the requests so far; returns them all.
    pub async fn wait_until(
        &self,
        mut done: impl FnMut(&[StandInRequest]) -> bool,
    ) -> Vec<StandInRequest> {
        let mut rx = self.log.subscribe();
        match rx.wait_for(|requests| done(requests)).await {
            Ok(requests) => requests.clone(),
            // Cannot happen: `self` holds the sender.
            Err(_) => self.requests(),
        }
    }

    /// Stops the server and waits until it has finished.
    pub async fn shutdown(self) {
        self.endpoint.shutdown().await;
    }
}

impl ScriptedModel {
    /// Serves a GitHub API and Copilot API stand-in on `127.0.0.1:<ephemeral port>` whose
    /// chat completions are this model's. Must be called inside a Tokio runtime.
    pub async fn serve_copilot_api(&self) -> Result<CopilotApiStandIn, ScriptedModelError> {
        let log = Arc::new(watch::Sender::new(Vec::new()));
        let model = self.clone();
        let recorder = log.clone();
        let user_url = Arc::new(std::sync::OnceLock::<String>::new());
        let user_url_route = user_url.clone();
        let endpoint = serve_app(move |stop| {
            Router::new()
                .route(
                    "/copilot_internal/user",
                    get(move || {
                        let url = user_url_route.clone();
                        async move { user_body(url.get().map(String::as_str).unwrap_or("")) }
                    }),
                )
                .route("/models", get(|| async { models_body() }))
                .route("/chat/completions", post(handle))
                .fallback(|| async {
                    (
                        StatusCode::NOT_FOUND,
                        axum::Json(json!({"message": "Not Found"})),
                    )
                })
                .with_state(Endpoint { model, stop })
                .layer(middleware::from_fn(move |request, next| {
                    record(recorder.clone(), request, next)
                }))
        })
        .await?;
        // The user record names the stand-in as the Copilot API, like GitHub names its own.
        let _ = user_url.set(format!("http://{}", endpoint.addr()));
        Ok(CopilotApiStandIn { endpoint, log })
    }
}

/// Records the request, then answers 401 without a bearer (as GitHub does) or passes it on.
async fn record(
    log: Arc<watch::Sender<Vec<StandInRequest>>>,
    request: Request,
    next: Next,
) -> Response {
    let entry = StandInRequest {
        method: request.method().as_str().to_owned(),
        path: request.uri().path().to_owned(),
        authorization: request
            .headers()
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .map(Secret::new),
    };
    let authorized = entry.bearer().is_some_and(|t| !t.is_empty());
    log.send_modify(|requests| requests.push(entry));
    if !authorized {
        return (
            StatusCode::UNAUTHORIZED,
            axum::Json(json!({"message": "Requires authentication"})),
        )
            .into_response();
    }
    next.run(request).await
}

/// `GET /copilot_internal/user`: an individual Copilot user whose API is the stand-in.
fn user_body(url: &str) -> axum::Json<Value> {
    axum::Json(json!({
        "login": STAND_IN_LOGIN,
        "access_type_sku": "free_limited_copilot",
        "analytics_tracking_id": "stand-in",
        "assigned_date": null,
        "can_signup_for_limited": false,
        "chat_enabled": true,
        "copilot_plan": "individual",
        "organization_login_list": [],
        "organization_list": [],
        "endpoints": {"api": url, "origin-tracker": url, "proxy": url, "telemetry": url},
    }))
}

/// `GET /models` in the Copilot API's shape: the scripted model, chat only.
fn models_body() -> axum::Json<Value> {
    axum::Json(json!({
        "object": "list",
        "data": [{
            "id": ScriptedModel::MODEL_ID,
            "name": "Scripted model",
            "object": "model",
            "vendor": "copilot-pool",
            "version": "1",
            "model_picker_enabled": true,
            "preview": false,
            "is_chat_default": true,
            "is_chat_fallback": true,
            "policy": {"state": "enabled", "terms": ""},
            "supported_endpoints": ["/chat/completions"],
            "capabilities": {
                "family": "scripted",
                "type": "chat",
                "object": "model_capabilities",
                "tokenizer": "o200k_base",
                "limits": {
                    "max_context_window_tokens": 128000,
                    "max_output_tokens": 4096,
                    "max_prompt_tokens": 100000,
                },
                "supports": {"streaming": true, "tool_calls": true, "parallel_tool_calls": true},
            },
        }],
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn the_stand_in_answers_the_token_mode_endpoints_and_records_each_credential() {
        let model = ScriptedModel::new();
        let stand_in = model.serve_copilot_api().await.unwrap();
        let client = reqwest::Client::builder().no_proxy().build().unwrap();
        let url = stand_in.url();
        let get = |path: &str, token: Option<&str>| {
            let mut request = client.get(format!("{url}{path}"));
            if let Some(token) = token {
                request = request.bearer_auth(token);
            }
            request.send()
        };
        let user = get("/copilot_internal/user", Some("ghu_a")).await.unwrap();
        assert_eq!(user.status(), 200);
        let user: Value = serde_json::from_slice(&user.bytes().await.unwrap()).unwrap();
        assert_eq!(user["login"], STAND_IN_LOGIN);
        assert_eq!(user["endpoints"]["api"], url.as_str());
        let models = get("/models", Some("ghu_b")).await.unwrap();
        let models: Value = serde_json::from_slice(&models.bytes().await.unwrap()).unwrap();
        assert_eq!(models["data"][0]["id"], ScriptedModel::MODEL_ID);
        assert_eq!(get("/models", None).await.unwrap().status(), 401);
        assert_eq!(
            get("/mcp/readonly", Some("ghu_c")).await.unwrap().status(),
            404
        );
        let chat = client
            .post(format!("{url}/chat/completions"))
            .bearer_auth("ghu_d")
            .header("content-type", "application/json")
            .body(r#"{"model":"scripted-model","messages":[{"role":"user","content":"REPLY=hi"}]}"#)
            .send()
            .await
            .unwrap();
        assert_eq!(chat.status(), 200);
        let chat: Value = serde_json::from_slice(&chat.bytes().await.unwrap()).unwrap();
        assert_eq!(chat["choices"][0]["message"]["content"], "hi");
        let seen: Vec<(String, Option<String>)> = stand_in
            .requests()
            .iter()
            .map(|r| (r.path.clone(), r.bearer().map(str::to_owned)))
            .collect();
        assert_eq!(
            seen,
            [
                ("/copilot_internal/user", Some("ghu_a")),
                ("/models", Some("ghu_b")),
                ("/models", None),
                ("/mcp/readonly", Some("ghu_c")),
                ("/chat/completions", Some("ghu_d")),
            ]
            .map(|(p, t)| (p.to_owned(), t.map(str::to_owned)))
        );
        assert_eq!(model.requests().len(), 1, "only the chat reached the model");
        assert!(!format!("{:?}", stand_in.requests()).contains("ghu_a"));
        assert_eq!(
            stand_in.runtime_env(),
            [
                ("COPILOT_API_URL".to_owned(), url.clone()),
                ("COPILOT_DEBUG_GITHUB_API_URL".to_owned(), url.clone()),
            ]
        );
        stand_in.shutdown().await;
    }
}
