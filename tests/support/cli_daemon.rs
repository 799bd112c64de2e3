//! What the tests of CLI backends through the daemon share: the scripted model on loopback
//! with a scratch directory for the daemon's state and the agents' homes ([`CliFixture`];
//! each test file adds its own daemon configuration and turn bodies in an `impl` of its
//! own), a streamed turn ([`streamed_turn`]), the user text of a model request
//! ([`user_text`]), a turn's fallback from one backend to the next ([`FellBack`])
//! and the refusal of a conversation whose CLI transcript is gone
//! ([`CliFixture::assert_transcript_missing`]).

use std::time::Duration;

use copilot_pool::scripted_model::{HttpEndpoint, RecordedRequest, ScriptedModel};
use serde_json::Value;

use super::Scratch;
use super::http::{Daemon, Sse, SseStream, call};

/// The scripted model, its endpoint, and a scratch directory.
pub struct CliFixture {
    pub model: ScriptedModel,
    pub endpoint: HttpEndpoint,
    pub scratch: Scratch,
}

impl CliFixture {
    pub async fn new() -> Self {
        let model = ScriptedModel::new();
        let endpoint = model.serve_http().await.expect("scripted model");
        Self {
            model,
            endpoint,
            scratch: Scratch::new(),
        }
    }
}

/// The user messages of a model request (text content, or its text blocks), joined: where
/// earlier turns and a prelude show up.
pub fn user_text(request: &RecordedRequest) -> String {
    request
        .messages()
        .iter()
        .filter(|m| m["role"] == "user")
        .map(|m| match &m["content"] {
            Value::String(text) => text.clone(),
            Value::Array(blocks) => blocks
                .iter()
                .filter_map(|b| b["text"].as_str())
                .collect::<Vec<_>>()
                .join("\n"),
            _ => String::new(),
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// How a turn fell back: from the backend that failed to the one that answered, and the
/// class of the failure.
pub struct FellBack<'a> {
    pub from: &'a str,
    pub to: &'a str,
    pub class: &'a str,
}

impl FellBack<'_> {
    /// Checks that `events` hold one `backend.fallback` from [`FellBack::from`] to
    /// [`FellBack::to`] as [`FellBack::class`], and that the turn ended idle on `to` with
    /// `final_text`, falling back from `from`; returns the notice's data.
    pub fn assert(&self, events: &[Sse], end: &Value, final_text: &str) -> Value {
        let names: Vec<&str> = events.iter().map(|e| e.event.as_str()).collect();
        let notice = events
            .iter()
            .find(|e| e.event == "backend.fallback")
            .map(|e| e.data.clone())
            .unwrap_or_else(|| panic!("no backend.fallback in {names:?}; turn.end {end}"));
        assert_eq!(notice["from"], self.from, "{notice}");
        assert_eq!(notice["to"], self.to, "{notice}");
        assert_eq!(notice["class"], self.class, "{notice}");
        assert_eq!(end["status"], "idle", "{end}");
        assert_eq!(end["backend"], self.to, "{end}");
        assert_eq!(end["fallback_from"], self.from, "{end}");
        assert_eq!(end["final_text"], final_text, "{end}");
        notice
    }
}

/// Runs a streamed turn on `daemon`: its events and its `turn.end`, within `limit` (a
/// failure guard, not a wait).
pub async fn streamed_turn(daemon: &Daemon, body: &Value, limit: Duration) -> (Vec<Sse>, Value) {
    let run = async {
        let mut stream = SseStream::open(daemon.addr, "/v1/turns", None, body).await;
        assert_eq!(stream.status, 200, "the turn was accepted");
        stream.until_end().await
    };
    tokio::time::timeout(limit, run)
        .await
        .expect("the turn ended in time")
}

/// The events' names, in order.
pub fn event_names(events: &[Sse]) -> Vec<String> {
    events.iter().map(|e| e.event.clone()).collect()
}

/// Runs a streamed turn whose gateway tools the test answers: each `tool.call` with a
/// `request_id` is answered on `POST /v1/requests/{id}` with `answer(event data)`. Its
/// events and its `turn.end`, within `limit` (a failure guard, not a wait).
pub async fn streamed_tool_turn(
    daemon: &Daemon,
    body: &Value,
    answer: impl Fn(&Value) -> Value,
    limit: Duration,
) -> (Vec<Sse>, Value) {
    let run = async {
        let mut stream = SseStream::open(daemon.addr, "/v1/turns", None, body).await;
        assert_eq!(stream.status, 200, "the turn was accepted");
        let mut events = Vec::new();
        while let Some(event) = stream.next().await {
            if event.event == "turn.end" {
                let end = event.data.clone();
                events.push(event);
                return (events, end);
            }
            if event.event == "tool.call"
                && let Some(id) = event.data["request_id"]
                    .as_str()
                    .filter(|id| !id.is_empty())
            {
                let answered = super::http::call(
                    daemon.addr,
                    "POST",
                    &format!("/v1/requests/{id}"),
                    None,
                    Some(&answer(&event.data)),
                )
                .await;
                assert_eq!(answered.status, 204, "{}", answered.body);
            }
            events.push(event);
        }
        panic!("the stream ended without turn.end: {events:?}");
    };
    tokio::time::timeout(limit, run)
        .await
        .expect("the turn ended in time")
}

/// The `tool.call` events of a turn.
pub fn tool_calls(events: &[Sse]) -> Vec<Value> {
    events
        .iter()
        .filter(|e| e.event == "tool.call")
        .map(|e| e.data.clone())
        .collect()
}

impl CliFixture {
    /// A turn `body` on a conversation whose CLI transcript was deleted: refused with 409
    /// `transcript_missing` naming `session`, and its prompt never reached the model (never a
    /// silent fresh start).
    pub async fn assert_transcript_missing(&self, daemon: &Daemon, body: &Value, session: &str) {
        let refused = call(daemon.addr, "POST", "/v1/turns", None, Some(body)).await;
        assert_eq!(refused.status, 409, "{}", refused.body);
        assert_eq!(
            refused.json()["code"],
            "transcript_missing",
            "{}",
            refused.body
        );
        assert!(refused.body.contains(session), "{}", refused.body);
        let prompt = body["prompt"].as_str().expect("a prompt");
        assert!(
            !self
                .model
                .requests()
                .iter()
                .any(|r| r.body.to_string().contains(prompt)),
            "never a silent fresh start"
        );
    }
}

/// A 1x1 PNG, base64.
pub const PNG: &str = "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNk+M9QDwADhgGAWjR9awAAAABJRU5ErkJggg==";

/// Another PNG (2x2, red), base64: a second turn's image, told apart from the first one in
/// the conversation's history.
pub const RED_PNG: &str = "iVBORw0KGgoAAAANSUhEUgAAAAIAAAACCAIAAAD91JpzAAAAEElEQVR4nGP4z8AARAwQCgAf7gP9i18U1AAAAABJRU5ErkJggg==";

/// Writes base64 `png` to `path`.
pub fn write_png(path: &std::path::Path, png: &str) {
    use base64::Engine;
    let bytes = base64::engine::general_purpose::STANDARD
        .decode(png)
        .expect("a PNG");
    std::fs::write(path, bytes).expect("write the image");
}

/// The CLI-backend image turn the daemon tests share: an inline PNG (written into the
/// agent's work directory by the daemon), then a PNG by its path relative to that directory
/// on the next turn, each reaching the model call answered `REPLY=<answer>` (told by
/// `answered`) as the same image; then a directory and an inline text attachment refused
/// with a 400 that says what CLI backends take, and the model not asked. `body(prompt)` is
/// a turn body of one conversation on the backend.
pub async fn image_turns(
    fx: &CliFixture,
    daemon: &Daemon,
    backend: &str,
    body: impl Fn(&str) -> Value,
    answered: impl Fn(&str) -> RecordedRequest,
    limit: Duration,
) {
    let png = |data: &str| ("image/png".to_owned(), data.to_owned());
    let mut first = body(&format!("REPLY={backend} saw a dot"));
    first["attachments"] = serde_json::json!([
        {"type": "inline", "data": PNG, "media_type": "image/png", "name": "dot.png"}
    ]);
    let (_, end) = streamed_turn(daemon, &first, limit).await;
    assert_eq!(end["status"], "idle", "{end}");
    assert_eq!(end["backend"], backend, "{end}");
    let images = images_in(&answered(&format!("{backend} saw a dot")));
    assert!(images.contains(&png(PNG)), "{backend}: {images:?}");

    // The inline image was written under `<work>/attachments/<conversation hash>/`; the
    // next turn names a file of that work directory by its relative path.
    let key = copilot_pool::ids::sha256_hex(&format!(
        "{}/{}",
        first["agent_id"].as_str().unwrap_or_default(),
        first["session_key"].as_str().unwrap_or_default()
    ));
    let written = files_named(fx.scratch.path(), "-dot.png");
    let conversation_files = written
        .iter()
        .filter_map(|f| f.parent())
        .find(|dir| dir.ends_with(&key))
        .map(std::path::Path::to_path_buf)
        .unwrap_or_else(|| panic!("the inline image was written: {written:?}"));
    let work = conversation_files
        .parent()
        .and_then(|d| d.parent())
        .unwrap_or_else(|| panic!("the inline image was written: {written:?}"))
        .to_path_buf();
    write_png(&work.join("red.png"), RED_PNG);
    let mut second = body(&format!("REPLY={backend} saw red"));
    second["attachments"] = serde_json::json!([{"type": "file", "path": "red.png"}]);
    let (_, end) = streamed_turn(daemon, &second, limit).await;
    assert_eq!(end["status"], "idle", "{end}");
    let images = images_in(&answered(&format!("{backend} saw red")));
    assert!(images.contains(&png(RED_PNG)), "{backend}: {images:?}");

    // Anything else is refused before the turn, saying what to do.
    let asked = fx.model.requests().len();
    for (attachment, needle) in [
        (
            serde_json::json!({"type": "directory", "path": "."}),
            "attachments[0] (directory",
        ),
        (
            serde_json::json!({"type": "inline", "data": "aGk=", "media_type": "text/plain"}),
            "attachments[0] (inline text/plain)",
        ),
    ] {
        let mut refused = body("REPLY=never");
        refused["attachments"] = serde_json::json!([attachment]);
        let answer = call(daemon.addr, "POST", "/v1/turns", None, Some(&refused)).await;
        assert_eq!(answer.status, 400, "{}", answer.body);
        let message = answer.json()["message"]
            .as_str()
            .unwrap_or_default()
            .to_owned();
        assert!(
            message.contains(needle)
                && message.contains("they take images only")
                && message.contains(backend),
            "{message}"
        );
    }
    assert_eq!(fx.model.requests().len(), asked, "the model was not asked");

    // Deleting the conversation removes its inline images.
    let path = format!(
        "/v1/sessions/{}/{}?backend={backend}",
        first["agent_id"].as_str().unwrap_or_default(),
        first["session_key"].as_str().unwrap_or_default()
    );
    let deleted = call(daemon.addr, "DELETE", &path, None, None).await;
    assert_eq!(deleted.status, 204, "DELETE {path}: {}", deleted.body);
    assert!(
        !conversation_files.exists(),
        "the deleted conversation's inline images are gone"
    );
}

/// Every file under `dir` whose name ends with `suffix`.
pub fn files_named(dir: &std::path::Path, suffix: &str) -> Vec<std::path::PathBuf> {
    let mut found = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(at) = stack.pop() {
        for entry in std::fs::read_dir(&at).into_iter().flatten().flatten() {
            let path = entry.path();
            if path.is_dir() {
                stack.push(path);
            } else if path
                .file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.ends_with(suffix))
            {
                found.push(path);
            }
        }
    }
    found
}

/// The images a model request carries, as (media type, base64 data), in each wire shape the
/// scripted model receives: Anthropic's `image` block (`source`), the Responses API's
/// `input_image` (a `data:` URL), Gemini's `inlineData`, Chat Completions' `image_url`.
pub fn images_in(request: &RecordedRequest) -> Vec<(String, String)> {
    fn data_url(url: &str) -> Option<(String, String)> {
        let (media, data) = url.strip_prefix("data:")?.split_once(";base64,")?;
        Some((media.to_owned(), data.to_owned()))
    }
    fn walk(value: &Value, found: &mut Vec<(String, String)>) {
        match value {
            Value::Object(map) => {
                let text = |v: &Value| v.as_str().unwrap_or_default().to_owned();
                match map.get("type").and_then(Value::as_str) {
                    Some("image") if map["source"]["type"] == "base64" => found.push((
                        text(&map["source"]["media_type"]),
                        text(&map["source"]["data"]),
                    )),
                    Some("input_image") => {
                        found.extend(map["image_url"].as_str().and_then(data_url))
                    }
                    Some("image_url") => {
                        found.extend(map["image_url"]["url"].as_str().and_then(data_url))
                    }
                    _ => {}
                }
                if let Some(inline) = map.get("inlineData") {
                    found.push((text(&inline["mimeType"]), text(&inline["data"])));
                }
                map.values().for_each(|v| walk(v, found));
            }
            Value::Array(items) => items.iter().for_each(|v| walk(v, found)),
            _ => {}
        }
    }
    let mut found = Vec::new();
    walk(&request.body, &mut found);
    found
}
