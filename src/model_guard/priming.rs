//! The priming turns' model calls (`pool::prime`) through a BYOK worker's tunnel: which
//! requests are one, and their answer. A priming call is answered, not refused: a chat
//! completion saying `ok` (streamed when the request asks), so the runtime initialises its
//! model path on its success path. A failed model call leaves the runtime (1.0.14) ~30 MiB
//! of heap bigger for good (anonymous memory 80 MiB after a refused priming turn against
//! 51 MiB after an answered one, measured with `/proc/<pid>/smaps_rollup`), while the next
//! real turn is as fast either way (57–78 ms against ~350 ms unprimed): every primed
//! process (a warm spare, one more process for a busy key) would carry it. Nothing leaves the
//! machine: no provider is called, no credential used, no model metric counted.

use serde_json::{Value, json};

use crate::chat_completion::{self, Completion};
use crate::tunnel::{ModelRequest, ModelResponse};

/// The model endpoint of the pool's priming turns (`pool::prime`): nothing listens on
/// loopback port 1, so a direct call fails at once; through a BYOK worker's tunnel the guard
/// answers it here, quietly (no warning, no model metric: it is no model call).
pub(crate) const PRIMING_BASE_URL: &str = "http://127.0.0.1:1/v1";

/// What a priming call's answer says.
const PRIMING_ANSWER: &str = "ok";

/// Whether `url` is under the priming turns' endpoint (exactly; the placeholder URL a BYOK
/// child gets never is).
pub(super) fn is_priming(url: &str) -> bool {
    url.strip_prefix(PRIMING_BASE_URL)
        .is_some_and(|rest| rest.is_empty() || rest.starts_with('/'))
}

/// The answer to a priming call: a chat completion with [`PRIMING_ANSWER`], as one JSON
/// object or (when the request's body asks for `"stream": true`) as server-sent events; a
/// call to any other path gets `None` (the caller refuses it).
pub(super) fn answer(request: &ModelRequest) -> Option<ModelResponse> {
    if !request.path().ends_with("/chat/completions") {
        return None;
    }
    let body: Value = serde_json::from_slice(&request.body).unwrap_or(Value::Null);
    let completion = Completion {
        id: "chatcmpl-copilot-pool-prime".to_owned(),
        created: 0,
        model: body
            .get("model")
            .and_then(Value::as_str)
            .unwrap_or("copilot-pool-prime")
            .to_owned(),
        include_usage: body
            .pointer("/stream_options/include_usage")
            .and_then(Value::as_bool)
            == Some(true),
        usage: json!({"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}),
    };
    if body.get("stream").and_then(Value::as_bool) != Some(true) {
        let message = json!({"role": "assistant", "content": PRIMING_ANSWER});
        return Some(ModelResponse::full(
            200,
            "application/json",
            chat_completion::body(&completion, message, "stop"),
        ));
    }
    let mut text = chat_completion::role_event(&completion);
    text.push_str(&chat_completion::content_event(&completion, PRIMING_ANSWER));
    text.extend(chat_completion::closing_events(&completion, "stop"));
    Some(ModelResponse::full(200, "text/event-stream", text))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request(url: &str, body: Value) -> ModelRequest {
        ModelRequest {
            request_id: "r-1".to_owned(),
            session_id: None,
            method: "POST".to_owned(),
            url: url.to_owned(),
            headers: Vec::new(),
            body: body.to_string().into_bytes(),
        }
    }

    fn body_of(mut response: ModelResponse) -> String {
        match response.body.try_recv() {
            Ok(Ok(text)) => text,
            other => panic!("one whole body chunk, got {other:?}"),
        }
    }

    #[test]
    fn only_a_call_under_the_priming_endpoint_is_a_priming_call() {
        assert!(is_priming("http://127.0.0.1:1/v1/chat/completions"));
        assert!(is_priming("http://127.0.0.1:1/v1"));
        assert!(!is_priming("http://127.0.0.1:1/v10/chat/completions"));
        assert!(!is_priming("http://127.0.0.1:10/v1/chat/completions"));
        assert!(!is_priming(
            "https://byok.copilot-pool.invalid/v1/chat/completions"
        ));
    }

    #[test]
    fn a_priming_chat_completion_is_answered_with_one_assistant_message() {
        let response = answer(&request(
            "http://127.0.0.1:1/v1/chat/completions",
            json!({"model": "copilot-pool-prime", "messages": [{"role": "user", "content": "x"}]}),
        ))
        .expect("answered");
        assert_eq!(response.status, 200);
        assert_eq!(
            response.headers,
            vec![("content-type".to_owned(), "application/json".to_owned())]
        );
        let body: Value = serde_json::from_str(&body_of(response)).expect("JSON");
        assert_eq!(body["object"], "chat.completion");
        assert_eq!(body["model"], "copilot-pool-prime");
        assert_eq!(body["choices"][0]["message"]["role"], "assistant");
        assert_eq!(body["choices"][0]["message"]["content"], PRIMING_ANSWER);
        assert_eq!(body["choices"][0]["finish_reason"], "stop");
    }

    #[test]
    fn a_streamed_priming_call_is_answered_with_events_that_end_in_done() {
        let response = answer(&request(
            "http://127.0.0.1:1/v1/chat/completions",
            json!({"model": "m", "stream": true, "stream_options": {"include_usage": true}}),
        ))
        .expect("answered");
        assert_eq!(response.status, 200);
        assert_eq!(response.headers[0].1, "text/event-stream");
        let text = body_of(response);
        let data: Vec<&str> = text
            .split("\n\n")
            .filter(|e| !e.is_empty())
            .map(|e| e.strip_prefix("data: ").expect("a data line"))
            .collect();
        assert_eq!(data.last(), Some(&"[DONE]"));
        let chunks: Vec<Value> = data[..data.len() - 1]
            .iter()
            .map(|d| serde_json::from_str(d).expect("a JSON chunk"))
            .collect();
        let content: String = chunks
            .iter()
            .filter_map(|c| c.pointer("/choices/0/delta/content")?.as_str())
            .collect();
        assert_eq!(content, PRIMING_ANSWER);
        assert!(
            chunks
                .iter()
                .any(|c| c["choices"][0]["finish_reason"] == "stop")
        );
        assert!(chunks.last().is_some_and(|c| c["usage"].is_object()));
    }

    #[test]
    fn a_priming_call_to_another_path_gets_no_answer_here() {
        assert!(
            answer(&request(
                "http://127.0.0.1:1/v1/responses",
                json!({"model": "m"})
            ))
            .is_none()
        );
        assert!(answer(&request("http://127.0.0.1:1/v1/models", Value::Null)).is_none());
    }
}
