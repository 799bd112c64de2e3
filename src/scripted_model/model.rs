//! [`ScriptedModel`]: the shared state (reply queue, request counter, request log, shutdown
//! flag) and the one place that routes a request and turns a [`Decision`] into a response.
//! The HTTP endpoint and the tunnel are thin adapters around [`ScriptedModel::respond`].

use std::collections::VecDeque;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{SystemTime, UNIX_EPOCH};

use serde_json::Value;
use tokio::sync::watch;

use super::log::{Answer, RecordedRequest, RequestLog, Transport};
use super::openai::{self, Completion};
use super::script::{self, ChatRequest, Decision, Reply};
use super::{anthropic, gemini, responses, stream};
use crate::tunnel::ModelResponse;

/// A scripted model for tests and the demo: OpenAI chat completions, the OpenAI responses
/// API, Anthropic messages and the Gemini API.
///
/// Cheap to clone (all clones share one state). Answers are decided by
/// [`script`](super::script) rules or by replies queued with [`ScriptedModel::push_reply`].
/// Dropping the last clone (or calling [`ScriptedModel::shutdown`]) ends hanging and slow
/// bodies with an error.
#[derive(Debug, Clone, Default)]
pub struct ScriptedModel {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    state: Mutex<State>,
    log: RequestLog,
    /// `true` once shut down; dropping it (with the last clone) also counts as shut down.
    shutdown: watch::Sender<bool>,
}

impl Default for Inner {
    fn default() -> Self {
        Self {
            state: Mutex::default(),
            log: RequestLog::new(),
            shutdown: watch::Sender::new(false),
        }
    }
}

#[derive(Debug, Default)]
struct State {
    /// Model calls served so far (every wire format).
    served: u64,
    /// Replies that win over the directives, oldest first.
    queue: VecDeque<Reply>,
}

/// One request as the transports hand it to [`ScriptedModel::respond`].
#[derive(Debug)]
pub(crate) struct Incoming<'a> {
    pub transport: Transport,
    pub method: &'a str,
    /// Path without query.
    pub path: &'a str,
    /// The query (after `?`), if any.
    pub query: Option<&'a str>,
    pub session_id: Option<String>,
    /// Request headers, names lower-cased.
    pub headers: Vec<(String, String)>,
    pub body: &'a [u8],
}

const JSON: &str = "application/json";

/// The wire format of a model call, by the path it is posted to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WireFormat {
    /// OpenAI chat completions: `POST …/chat/completions`.
    ChatCompletions,
    /// The OpenAI responses API: `POST …/responses`.
    Responses,
    /// Anthropic messages: `POST …/messages`.
    AnthropicMessages,
    /// The Gemini API, one document: `POST …/models/<model>:generateContent`.
    GeminiGenerateContent,
    /// The Gemini API, SSE: `POST …/models/<model>:streamGenerateContent` (`?alt=sse`).
    GeminiStreamGenerateContent,
}

impl WireFormat {
    /// The format a `POST` to `path` (no query, no trailing slash) speaks, if any.
    pub fn of_path(path: &str) -> Option<Self> {
        if let Some((_, method)) = gemini::route(path) {
            Some(match method {
                gemini::Method::Generate => Self::GeminiGenerateContent,
                gemini::Method::Stream => Self::GeminiStreamGenerateContent,
            })
        } else if path.ends_with("/chat/completions") {
            Some(Self::ChatCompletions)
        } else if path.ends_with("/responses") {
            Some(Self::Responses)
        } else if path.ends_with("/messages") {
            Some(Self::AnthropicMessages)
        } else {
            None
        }
    }

    fn parse(self, body: &Value, path: &str) -> Result<ChatRequest, String> {
        match self {
            Self::ChatCompletions => ChatRequest::from_json(body),
            Self::Responses => responses::parse(body),
            Self::AnthropicMessages => anthropic::parse(body),
            Self::GeminiGenerateContent | Self::GeminiStreamGenerateContent => {
                let (model, method) = gemini::route(path)
                    .ok_or_else(|| format!("`{path}` names no model and method"))?;
                gemini::parse(body, model, method)
            }
        }
    }

    /// The answer to a side call that the script does not decide (Gemini's JSON-mode
    /// calls, answered from their schema), if this is one.
    fn side_answer(self, body: &Value) -> Option<String> {
        match self {
            Self::GeminiGenerateContent | Self::GeminiStreamGenerateContent => {
                gemini::json_mode_answer(body)
            }
            Self::ChatCompletions | Self::Responses | Self::AnthropicMessages => None,
        }
    }

    fn error_body(self, status: u16) -> String {
        match self {
            Self::ChatCompletions => openai::error_body(status),
            Self::Responses => responses::error_body(status),
            Self::AnthropicMessages => anthropic::error_body(status),
            Self::GeminiGenerateContent | Self::GeminiStreamGenerateContent => {
                gemini::error_body(status)
            }
        }
    }

    fn invalid_request_body(self, reason: &str) -> String {
        match self {
            Self::ChatCompletions | Self::Responses => {
                openai::invalid_request_body(reason, "bad_request")
            }
            Self::AnthropicMessages => anthropic::invalid_request_body(reason),
            Self::GeminiGenerateContent | Self::GeminiStreamGenerateContent => {
                gemini::invalid_request_body(reason)
            }
        }
    }
}

/// What an answer is rendered with: its format and the fields its objects repeat.
struct Rendering {
    format: WireFormat,
    number: u64,
    created: u64,
    model: String,
    include_usage: bool,
}

impl Rendering {
    fn completion(&self) -> Completion {
        Completion {
            id: format!("chatcmpl-scripted-{}", self.number),
            created: self.created,
            model: self.model.clone(),
            include_usage: self.include_usage,
            usage: openai::usage(),
        }
    }

    fn response(&self) -> responses::ResponseMeta {
        responses::ResponseMeta {
            id: format!("resp_scripted_{}", self.number),
            created: self.created,
            model: self.model.clone(),
        }
    }

    fn message(&self) -> anthropic::MessageMeta {
        anthropic::MessageMeta {
            id: format!("msg_scripted_{}", self.number),
            model: self.model.clone(),
        }
    }

    fn content(&self) -> gemini::ContentMeta {
        gemini::ContentMeta {
            response_id: format!("scripted-{}", self.number),
            model: self.model.clone(),
        }
    }

    /// The whole body of a text or tool-call answer.
    fn body(&self, decision: &Decision) -> String {
        match self.format {
            WireFormat::ChatCompletions => openai::completion_body(&self.completion(), decision),
            WireFormat::Responses => responses::response_body(&self.response(), decision),
            WireFormat::AnthropicMessages => anthropic::message_body(&self.message(), decision),
            WireFormat::GeminiGenerateContent | WireFormat::GeminiStreamGenerateContent => {
                gemini::response_body(&self.content(), decision)
            }
        }
    }

    /// The answer as server-sent events.
    fn stream(
        &self,
        decision: Decision,
        shutdown: watch::Receiver<bool>,
    ) -> tokio::sync::mpsc::Receiver<crate::tunnel::BodyChunk> {
        match self.format {
            WireFormat::ChatCompletions => openai::stream(self.completion(), decision, shutdown),
            WireFormat::Responses => stream::stream(
                responses::ResponseStream::new(self.response()),
                decision,
                shutdown,
            ),
            WireFormat::AnthropicMessages => stream::stream(
                anthropic::MessageStream::new(self.message()),
                decision,
                shutdown,
            ),
            WireFormat::GeminiGenerateContent | WireFormat::GeminiStreamGenerateContent => {
                stream::stream(
                    gemini::ContentStream::new(self.content()),
                    decision,
                    shutdown,
                )
            }
        }
    }
}

impl ScriptedModel {
    /// The model id the scripted model lists and reports.
    pub const MODEL_ID: &'static str = "scripted-model";
    /// Prompt tokens every answer reports (`usage.prompt_tokens`).
    pub const PROMPT_TOKENS: u64 = 100;
    /// Completion tokens every answer reports (`usage.completion_tokens`).
    pub const COMPLETION_TOKENS: u64 = 10;
    /// Cached prompt tokens every answer reports (`usage.prompt_tokens_details.cached_tokens`).
    pub const CACHED_PROMPT_TOKENS: u64 = 40;

    /// A fresh model: empty queue, empty log, request counter at zero.
    pub fn new() -> Self {
        Self::default()
    }

    /// Queues `reply` for the next chat request; queued replies are used first-in
    /// first-out and take precedence over every directive.
    pub fn push_reply(&self, reply: Reply) {
        self.lock().queue.push_back(reply);
    }

    /// Queued replies not used yet.
    pub fn pending_replies(&self) -> usize {
        self.lock().queue.len()
    }

    /// Every request received so far (all routes, both transports), oldest first.
    pub fn requests(&self) -> Vec<RecordedRequest> {
        self.inner.log.snapshot()
    }

    /// Every request received so far, oldest first, leaving the log empty: for long runs
    /// that check the requests as they come instead of keeping them all (counts that
    /// [`wait_for_requests`](Self::wait_for_requests) waits for start again from zero).
    pub fn take_requests(&self) -> Vec<RecordedRequest> {
        self.inner.log.take()
    }

    /// Waits until at least `n` requests have been received; returns them all.
    pub async fn wait_for_requests(&self, n: usize) -> Vec<RecordedRequest> {
        self.wait_until(|requests| requests.len() >= n).await
    }

    /// Waits until `done` holds for the requests received so far; returns them all.
    pub async fn wait_until(
        &self,
        done: impl FnMut(&[RecordedRequest]) -> bool,
    ) -> Vec<RecordedRequest> {
        self.inner.log.wait_until(done).await
    }

    /// Ends every hanging or slow body with an error, now and for later requests.
    pub fn shutdown(&self) {
        self.inner.shutdown.send_replace(true);
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        // The state stays consistent even if a holder panicked (single push/pop updates).
        self.inner
            .state
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// Routes and answers one request: a model call in one of the [`WireFormat`]s, `GET
    /// …/models`, Claude Code's reachability probe (`HEAD …/api/hello`), else 404.
    pub(crate) async fn respond(&self, request: Incoming<'_>) -> ModelResponse {
        let path = request.path.trim_end_matches('/');
        let method = request.method;
        if method.eq_ignore_ascii_case("POST")
            && let Some(format) = WireFormat::of_path(path)
        {
            return self.model_call(format, request).await;
        }
        let body = serde_json::from_slice(request.body).unwrap_or(Value::Null);
        if path.ends_with("/models") && method.eq_ignore_ascii_case("GET") {
            self.record(&request, body, Answer::ModelList);
            return ModelResponse::full(200, JSON, openai::models_body(Self::MODEL_ID));
        }
        if path.ends_with("/api/hello")
            && (method.eq_ignore_ascii_case("HEAD") || method.eq_ignore_ascii_case("GET"))
        {
            self.record(&request, body, Answer::Reachable);
            return ModelResponse::full(200, JSON, String::new());
        }
        self.record(&request, body, Answer::NotFound);
        let message = format!("no route {method} {}", request.path);
        ModelResponse::full(
            404,
            JSON,
            openai::invalid_request_body(&message, "not_found"),
        )
    }

    async fn model_call(&self, format: WireFormat, request: Incoming<'_>) -> ModelResponse {
        let parsed = serde_json::from_slice::<Value>(request.body)
            .map_err(|e| (Value::Null, format!("request body is not JSON: {e}")))
            .and_then(|body| match format.parse(&body, request.path) {
                Ok(chat) => Ok((body, chat)),
                Err(reason) => Err((body, reason)),
            });
        let (body, chat) = match parsed {
            Ok(parsed) => parsed,
            Err((body, reason)) => {
                let answer = format.invalid_request_body(&reason);
                self.record(&request, body, Answer::BadRequest(reason));
                return ModelResponse::full(400, JSON, answer);
            }
        };
        let side = format.side_answer(&body);
        let (number, queued) = {
            let mut state = self.lock();
            state.served += 1;
            // A side call never takes a reply queued for the conversation.
            let queued = if side.is_none() {
                state.queue.pop_front()
            } else {
                None
            };
            (state.served, queued)
        };
        let decision = match side {
            Some(text) => Decision::Text(text),
            None => script::decide(&chat, number, queued),
        };
        self.record(
            &request,
            body,
            Answer::Chat {
                number,
                decision: decision.clone(),
            },
        );
        let answer = Rendering {
            format,
            number,
            created: SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map(|d| d.as_secs())
                .unwrap_or(0),
            model: chat.model.unwrap_or_else(|| Self::MODEL_ID.to_owned()),
            include_usage: chat.include_usage,
        };
        self.render(answer, decision, chat.stream).await
    }

    async fn render(&self, answer: Rendering, decision: Decision, stream: bool) -> ModelResponse {
        let shutdown = self.inner.shutdown.subscribe();
        match decision {
            Decision::Error { status } => {
                ModelResponse::full(status, JSON, answer.format.error_body(status))
            }
            Decision::RateLimited { retry_after } => {
                let mut response = ModelResponse::full(429, JSON, answer.format.error_body(429));
                response.headers.push((
                    "retry-after-ms".to_owned(),
                    retry_after.as_millis().to_string(),
                ));
                response
            }
            Decision::Hang => {
                let content_type = if stream { "text/event-stream" } else { JSON };
                opened(content_type, openai::hang(shutdown))
            }
            decision if stream => sse(answer.stream(decision, shutdown)),
            decision => {
                if let Decision::Slow { chunks, interval } = &decision {
                    let mut shutdown = shutdown;
                    tokio::select! {
                        () = tokio::time::sleep(interval.saturating_mul(*chunks)) => {}
                        () = openai::shut_down(&mut shutdown) => {
                            return ModelResponse::full(
                                503,
                                JSON,
                                answer.format.error_body(503),
                            );
                        }
                    }
                }
                ModelResponse::full(200, JSON, answer.body(&decision))
            }
        }
    }

    fn record(&self, request: &Incoming<'_>, body: Value, answer: Answer) {
        self.inner.log.push(RecordedRequest {
            transport: request.transport,
            method: request.method.to_owned(),
            path: request.path.to_owned(),
            query: request.query.map(str::to_owned),
            session_id: request.session_id.clone(),
            headers: request.headers.clone(),
            body,
            answer,
        });
    }
}

/// A 200 whose body streams from `body`.
fn opened(
    content_type: &str,
    body: tokio::sync::mpsc::Receiver<crate::tunnel::BodyChunk>,
) -> ModelResponse {
    ModelResponse {
        status: 200,
        headers: vec![("content-type".to_owned(), content_type.to_owned())],
        body,
    }
}

/// A 200 server-sent-events stream.
fn sse(body: tokio::sync::mpsc::Receiver<crate::tunnel::BodyChunk>) -> ModelResponse {
    let mut response = opened("text/event-stream", body);
    response
        .headers
        .push(("cache-control".to_owned(), "no-cache".to_owned()));
    response
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn incoming<'a>(method: &'a str, path: &'a str, body: &'a [u8]) -> Incoming<'a> {
        Incoming {
            transport: Transport::Tunnel,
            method,
            path,
            query: None,
            session_id: Some("s1".into()),
            headers: Vec::new(),
            body,
        }
    }

    async fn body_text(response: ModelResponse) -> String {
        let mut body = response.body;
        let mut out = String::new();
        while let Some(chunk) = body.recv().await {
            out.push_str(&chunk.unwrap());
        }
        out
    }

    fn chat_body(text: &str) -> Vec<u8> {
        serde_json::to_vec(&json!({"messages": [{"role": "user", "content": text}]})).unwrap()
    }

    #[tokio::test]
    async fn counts_queues_and_logs() {
        let model = ScriptedModel::new();
        model.push_reply(Reply::Text("first queued".into()));
        let body = chat_body("hi");
        let r1 = model
            .respond(incoming("POST", "/v1/chat/completions", &body))
            .await;
        let r2 = model
            .clone()
            .respond(incoming("POST", "/v1/chat/completions", &body))
            .await;
        let v1: Value = serde_json::from_str(&body_text(r1).await).unwrap();
        let v2: Value = serde_json::from_str(&body_text(r2).await).unwrap();
        assert_eq!(v1["choices"][0]["message"]["content"], "first queued");
        assert_eq!(
            v2["choices"][0]["message"]["content"],
            "scripted reply #2: hi"
        );
        assert_eq!(v2["model"], ScriptedModel::MODEL_ID);
        let log = model.wait_for_requests(2).await;
        assert_eq!(log.len(), 2);
        assert_eq!(log[1].session_id.as_deref(), Some("s1"));
        assert_eq!(log[1].messages().len(), 1);
        assert_eq!(
            log[0].answer,
            Answer::Chat {
                number: 1,
                decision: Decision::Text("first queued".into())
            }
        );
        assert_eq!(model.pending_replies(), 0);
    }

    #[tokio::test]
    async fn routes_errors_and_bad_requests() {
        let model = ScriptedModel::new();
        let r = model
            .respond(incoming("GET", "/v1/chat/completions", b""))
            .await;
        assert_eq!(r.status, 404);
        let r = model
            .respond(incoming("POST", "/v1/chat/completions", b"{not json"))
            .await;
        assert_eq!(r.status, 400);
        let r = model
            .respond(incoming("POST", "/chat/completions", b"{\"model\":1}"))
            .await;
        assert_eq!(r.status, 400);
        let r = model
            .respond(incoming(
                "POST",
                "/v1/chat/completions",
                &chat_body("SCENARIO:error STATUS=502"),
            ))
            .await;
        assert_eq!(r.status, 502);
        let error: Value = serde_json::from_str(&body_text(r).await).unwrap();
        assert_eq!(error["error"]["code"], "scripted_502");
        let r = model.respond(incoming("GET", "/models", b"")).await;
        let list: Value = serde_json::from_str(&body_text(r).await).unwrap();
        assert_eq!(list["data"][0]["id"], "scripted-model");
        let answers: Vec<_> = model.requests().into_iter().map(|r| r.answer).collect();
        assert!(matches!(answers[0], Answer::NotFound));
        assert!(matches!(answers[1], Answer::BadRequest(_)));
        assert!(matches!(answers[2], Answer::BadRequest(_)));
        // The 400s did not count: the error request is number 1.
        assert!(matches!(answers[3], Answer::Chat { number: 1, .. }));
        assert_eq!(answers[4], Answer::ModelList);
    }

    #[tokio::test]
    async fn claude_codes_request_shape_is_answered_probe_system_entries_and_beta_query_included() {
        let model = ScriptedModel::new();
        let r = model.respond(incoming("HEAD", "/api/hello", b"")).await;
        assert_eq!(r.status, 200, "the reachability probe is answered");
        // What Claude Code 2.1.332 posts: `?beta=true`, `role: "system"` entries among the
        // messages, system reminders as extra text blocks of the user message.
        let body = serde_json::to_vec(&json!({
            "model": "claude-opus-5-5",
            "stream": false,
            "system": [{"type": "text", "text": "You are Claude Code."}],
            "messages": [
                {"role": "system", "content": "<env>cwd: /w</env>"},
                {"role": "user", "content": [
                    {"type": "text", "text": "<system-reminder>be brief</system-reminder>"},
                    {"type": "text", "text": "REPLY=pong"}
                ]},
                {"role": "system", "content": "deferred tools: none"}
            ]
        }))
        .unwrap();
        let mut request = incoming("POST", "/v1/messages", &body);
        request.query = Some("beta=true");
        let r = model.respond(request).await;
        assert_eq!(r.status, 200);
        let message: Value = serde_json::from_str(&body_text(r).await).unwrap();
        assert_eq!(message["content"][0]["text"], "pong");
        let log = model.requests();
        assert_eq!(log[0].answer, Answer::Reachable);
        assert_eq!(log[1].query.as_deref(), Some("beta=true"));
    }

    #[tokio::test]
    async fn gemini_calls_are_routed_by_path_and_the_router_call_leaves_queued_replies_alone() {
        let model = ScriptedModel::new();
        model.push_reply(Reply::Text("queued for the turn".into()));
        let router = serde_json::to_vec(&json!({
            "contents": [{"role": "user", "parts": [{"text": "hi"}]}],
            "generationConfig": {
                "responseMimeType": "application/json",
                "responseJsonSchema": {"type": "OBJECT", "properties": {
                    "complexity_score": {"type": "INTEGER"}
                }}
            }
        }))
        .unwrap();
        let mut request = incoming(
            "POST",
            "/v1beta/models/gemini-3.5-flash-lite:generateContent",
            &router,
        );
        request.headers = vec![("x-goog-api-key".into(), "AIza-FAKE".into())];
        let r = model.respond(request).await;
        assert_eq!(r.status, 200);
        let answer: Value = serde_json::from_str(&body_text(r).await).unwrap();
        let text = answer["candidates"][0]["content"]["parts"][0]["text"]
            .as_str()
            .unwrap();
        assert_eq!(text, r#"{"complexity_score":1}"#);
        assert_eq!(model.pending_replies(), 1, "the router call took no reply");

        let turn = serde_json::to_vec(&json!({
            "contents": [{"role": "user", "parts": [{"text": "hello"}]}]
        }))
        .unwrap();
        let mut request = incoming(
            "POST",
            "/v1beta/models/gemini-2.5-pro:streamGenerateContent",
            &turn,
        );
        request.query = Some("alt=sse");
        let r = model.respond(request).await;
        assert_eq!(r.status, 200);
        assert!(
            r.headers
                .iter()
                .any(|(n, v)| n == "content-type" && v == "text/event-stream")
        );
        let body = body_text(r).await;
        assert!(body.starts_with("data: {"), "{body}");
        let text: String = body
            .split("\n\n")
            .filter_map(|event| event.strip_prefix("data: "))
            .map(|data| serde_json::from_str::<Value>(data).unwrap())
            .filter_map(|chunk| {
                chunk["candidates"][0]["content"]["parts"][0]["text"]
                    .as_str()
                    .map(str::to_owned)
            })
            .collect();
        assert_eq!(text, "queued for the turn", "{body}");

        let failing = serde_json::to_vec(&json!({
            "contents": [{"role": "user", "parts": [{"text": "SCENARIO:error STATUS=503"}]}]
        }))
        .unwrap();
        let r = model
            .respond(incoming(
                "POST",
                "/v1beta/models/gemini-2.5-pro:streamGenerateContent",
                &failing,
            ))
            .await;
        assert_eq!(r.status, 503);
        let error: Value = serde_json::from_str(&body_text(r).await).unwrap();
        assert_eq!(error["error"]["status"], "UNAVAILABLE");

        let log = model.requests();
        assert_eq!(log[0].header("x-goog-api-key"), ["AIza-FAKE"]);
        assert_eq!(log[1].query.as_deref(), Some("alt=sse"));
        assert_eq!(
            log[1].decision(),
            Some(&Decision::Text("queued for the turn".into()))
        );
    }

    #[tokio::test]
    async fn hang_is_released_by_shutdown() {
        let model = ScriptedModel::new();
        model.push_reply(Reply::Hang);
        let r = model
            .respond(incoming("POST", "/v1/chat/completions", &chat_body("x")))
            .await;
        assert_eq!(r.status, 200);
        let mut body = r.body;
        assert!(body.try_recv().is_err());
        model.shutdown();
        assert_eq!(
            body.recv().await,
            Some(Err(openai::SHUTDOWN_MESSAGE.to_owned()))
        );
    }

    #[tokio::test]
    async fn hang_is_released_when_model_dropped() {
        let model = ScriptedModel::new();
        model.push_reply(Reply::Hang);
        let r = model
            .respond(incoming("POST", "/v1/chat/completions", &chat_body("x")))
            .await;
        drop(model);
        let mut body = r.body;
        assert_eq!(
            body.recv().await,
            Some(Err(openai::SHUTDOWN_MESSAGE.to_owned()))
        );
    }

    #[tokio::test]
    async fn non_streaming_slow_waits_then_answers() {
        let model = ScriptedModel::new();
        let started = tokio::time::Instant::now();
        let r = model
            .respond(incoming(
                "POST",
                "/v1/chat/completions",
                &chat_body("SCENARIO:slow SLOW=4x25"),
            ))
            .await;
        // At least the four chunks' wait (a lower bound: a slow machine only adds to it).
        let waited = started.elapsed();
        assert!(
            waited >= std::time::Duration::from_millis(100),
            "{waited:?}"
        );
        let v: Value = serde_json::from_str(&body_text(r).await).unwrap();
        assert_eq!(
            v["choices"][0]["message"]["content"],
            "slow-chunk 0 slow-chunk 1 slow-chunk 2 slow-chunk 3 "
        );
    }
}
