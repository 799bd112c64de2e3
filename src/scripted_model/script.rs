//! Deciding what the scripted model answers to one chat-completions request.
//!
//! Everything here is pure: no I/O, no clock, no shared state. The caller parses the body
//! with [`ChatRequest::from_json`], supplies the request's 1-based number and the next
//! queued [`Reply`] (if any), and gets a [`Decision`] back from [`decide`].
//!
//! Rules, first match wins:
//! 1. a queued [`Reply`] (pushed with `ScriptedModel::push_reply`);
//! 2. the last message has role `tool` → text `tool said: <content>` (content cut to 500 chars);
//! 3. directives in the last *user* message text:
//!    * `SCENARIO:error [STATUS=<code>]` → that HTTP status (default 500);
//!    * `SCENARIO:slow [SLOW=<chunks>x<ms>]` → slow text, `slow-chunk <i> ` (default 60x500);
//!    * `SCENARIO:flood [FLOOD=<n>]` → `n` one-word chunks (default 2000), `w0 w1 …`;
//!    * `SCENARIO:tool [NAME=<tool> ARGS=<json to end of line>]` → call that tool when the
//!      request offers it (without `NAME`: `get_secret_number {"key":"alpha"}`);
//!    * `REPLY=<text to end of line>` → exactly that text;
//! 4. otherwise → text `scripted reply #<n>: <first 200 chars of the last user text>`.
//!
//! The runtime prepends `<current_datetime>…</current_datetime>` to user content; such blocks
//! are removed (and the rest trimmed) before the text is read.

use std::time::Duration;

use serde_json::{Value, json};

/// How many characters of a tool result the `tool said:` answer repeats.
const TOOL_RESULT_CHARS: usize = 500;
/// How many characters of the user text the default answer echoes.
const ECHO_CHARS: usize = 200;
/// `SCENARIO:slow` without `SLOW=`: 60 chunks …
const DEFAULT_SLOW_CHUNKS: u32 = 60;
/// … half a second apart.
const DEFAULT_SLOW_MS: u64 = 500;
/// `SCENARIO:flood` without `FLOOD=`.
const DEFAULT_FLOOD_WORDS: u32 = 2000;
/// `SCENARIO:error` without `STATUS=`, and the status used for out-of-range codes.
const DEFAULT_ERROR_STATUS: u16 = 500;
/// The client tool `SCENARIO:tool` calls when no `NAME=` is given.
const DEFAULT_TOOL: &str = "get_secret_number";

/// A scripted answer queued with `ScriptedModel::push_reply`; it wins over every directive.
#[derive(Debug, Clone, PartialEq)]
pub enum Reply {
    /// Answer with this text.
    Text(String),
    /// Call this tool with these arguments, whether or not the request offers it.
    ToolCall {
        /// Tool (function) name.
        name: String,
        /// Arguments object; sent JSON-encoded, as OpenAI does.
        arguments: Value,
    },
    /// Fail with this HTTP status and an OpenAI-style error body (400..=599, else 500).
    Error {
        /// HTTP status code.
        status: u16,
    },
    /// Fail with 429, the wire format's error body and a `retry-after-ms` header, as OpenAI's
    /// and Anthropic's rate limiters answer: clients that read it (the runtime's, measured;
    /// the OpenAI and Anthropic SDKs') wait that long before the next try instead of their
    /// own backoff (about a minute over the runtime's five retries). Gemini CLI reads its
    /// wait from the body instead, which this reply does not carry.
    RateLimited {
        /// The wait the header asks for.
        retry_after: Duration,
    },
    /// Text `slow-chunk 0 slow-chunk 1 …`, one chunk per `interval` when streaming; when not
    /// streaming the whole text after `chunks * interval`.
    Slow {
        /// Number of chunks.
        chunks: u32,
        /// Pause between chunks.
        interval: Duration,
    },
    /// Accept the request and never finish the body until the model is shut down or dropped.
    Hang,
}

/// What the model answers to one chat-completions request.
#[derive(Debug, Clone, PartialEq)]
pub enum Decision {
    /// A final assistant text.
    Text(String),
    /// One tool call; `id` is `call_scripted_<n>`.
    ToolCall {
        /// Tool-call id.
        id: String,
        /// Tool (function) name.
        name: String,
        /// Arguments object.
        arguments: Value,
    },
    /// Several tool calls in one answer (`SCENARIO:tool … COUNT=<n>`); the runtime runs
    /// them in one turn. Each is `(id, name, arguments)`.
    ParallelToolCalls {
        /// The calls.
        calls: Vec<(String, String, Value)>,
    },
    /// Text `slow-chunk 0 slow-chunk 1 …` delivered slowly.
    Slow {
        /// Number of chunks.
        chunks: u32,
        /// Pause between chunks.
        interval: Duration,
    },
    /// `words` one-word chunks `w0`, ` w1`, … streamed as fast as possible.
    Flood {
        /// Number of words.
        words: u32,
    },
    /// An HTTP error status with an OpenAI-style error body.
    Error {
        /// HTTP status code.
        status: u16,
    },
    /// 429 with the wire format's error body and a `retry-after-ms` header.
    RateLimited {
        /// The wait the header asks for.
        retry_after: Duration,
    },
    /// The body never completes (until the model shuts down).
    Hang,
}

impl Decision {
    /// The full assistant text this decision produces, if it is a text-like answer.
    pub fn text(&self) -> Option<String> {
        match self {
            Decision::Text(text) => Some(text.clone()),
            Decision::Slow { chunks, .. } => Some((0..*chunks).map(slow_chunk).collect()),
            Decision::Flood { words } => Some(
                (0..*words)
                    .map(|i| format!("w{i}"))
                    .collect::<Vec<_>>()
                    .join(" "),
            ),
            Decision::ToolCall { .. }
            | Decision::ParallelToolCalls { .. }
            | Decision::Error { .. }
            | Decision::RateLimited { .. }
            | Decision::Hang => None,
        }
    }
}

/// The text of slow chunk `i`.
pub fn slow_chunk(i: u32) -> String {
    format!("slow-chunk {i} ")
}

/// The tool-call id of request number `n`.
pub fn tool_call_id(n: u64) -> String {
    format!("call_scripted_{n}")
}

/// The parts of a chat-completions request body the script looks at.
#[derive(Debug, Clone, PartialEq)]
pub struct ChatRequest {
    /// `model`, when present.
    pub model: Option<String>,
    /// `stream: true`.
    pub stream: bool,
    /// `stream_options.include_usage: true`.
    pub include_usage: bool,
    /// Role of the last message (`None` when there are no messages).
    pub last_role: Option<String>,
    /// Text of the last message's content.
    pub last_text: String,
    /// Text of the last `user` message, `<current_datetime>` blocks removed, trimmed.
    pub last_user_text: String,
    /// Names of the offered tools.
    pub tools: Vec<String>,
}

impl ChatRequest {
    /// Reads a chat-completions body. Errors (a message for a 400) when the body is not an
    /// object or has no `messages` array; everything else is read leniently.
    pub fn from_json(body: &Value) -> Result<Self, String> {
        let object = body
            .as_object()
            .ok_or_else(|| "request body must be a JSON object".to_owned())?;
        let messages = object
            .get("messages")
            .and_then(Value::as_array)
            .ok_or_else(|| "`messages` must be an array".to_owned())?;
        let last = messages.last();
        let last_user = messages
            .iter()
            .rev()
            .find(|m| m.get("role").and_then(Value::as_str) == Some("user"));
        let tools = tool_names(object);
        Ok(Self {
            model: object
                .get("model")
                .and_then(Value::as_str)
                .map(str::to_owned),
            stream: object.get("stream").and_then(Value::as_bool) == Some(true),
            include_usage: object
                .get("stream_options")
                .and_then(|o| o.get("include_usage"))
                .and_then(Value::as_bool)
                == Some(true),
            last_role: last
                .and_then(|m| m.get("role"))
                .and_then(Value::as_str)
                .map(str::to_owned),
            last_text: last
                .map(|m| content_text(m.get("content")))
                .unwrap_or_default(),
            last_user_text: last_user
                .map(|m| strip_datetime(&content_text(m.get("content"))))
                .unwrap_or_default(),
            tools,
        })
    }

    fn offers(&self, tool: &str) -> bool {
        self.tools.iter().any(|t| t == tool)
    }
}

/// The names of a request body's `tools` (every wire format's shape).
pub(super) fn tool_names(body: &serde_json::Map<String, Value>) -> Vec<String> {
    body.get("tools")
        .and_then(Value::as_array)
        .map(|tools| tools.iter().flat_map(tool_names_of).collect())
        .unwrap_or_default()
}

/// The names one entry of `tools` offers: its own, or for a Responses `namespace` (how
/// Codex offers an MCP server's tools) each member as `<namespace>__<tool>`.
fn tool_names_of(tool: &Value) -> Vec<String> {
    if tool.get("type").and_then(Value::as_str) == Some("namespace")
        && let Some(namespace) = tool.get("name").and_then(Value::as_str)
    {
        return tool
            .get("tools")
            .and_then(Value::as_array)
            .map(|members| {
                members
                    .iter()
                    .filter_map(tool_name)
                    .map(|name| format!("{namespace}__{name}"))
                    .collect()
            })
            .unwrap_or_default();
    }
    tool_name(tool).into_iter().collect()
}

/// The name of one entry of `tools` (`{type:"function", function:{name}}` or `{name}`).
fn tool_name(tool: &Value) -> Option<String> {
    tool.get("function")
        .and_then(|f| f.get("name"))
        .or_else(|| tool.get("name"))
        .and_then(Value::as_str)
        .map(str::to_owned)
}

/// The text of a message `content`: a string, or an array of parts (`{type:"text", text}`)
/// joined with newlines.
pub fn content_text(content: Option<&Value>) -> String {
    match content {
        Some(Value::String(text)) => text.clone(),
        Some(Value::Array(parts)) => parts
            .iter()
            .filter_map(|part| match part {
                Value::String(text) => Some(text.as_str()),
                other => other
                    .get("text")
                    .or_else(|| other.get("content"))
                    .and_then(Value::as_str),
            })
            .collect::<Vec<_>>()
            .join("\n"),
        _ => String::new(),
    }
}

/// Removes every `<current_datetime>…</current_datetime>` block and trims the rest. An
/// unclosed block is left alone.
pub fn strip_datetime(text: &str) -> String {
    const OPEN: &str = "<current_datetime>";
    const CLOSE: &str = "</current_datetime>";
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(start) = rest.find(OPEN) {
        let Some(len) = rest[start..].find(CLOSE) else {
            break;
        };
        out.push_str(&rest[..start]);
        rest = &rest[start + len + CLOSE.len()..];
    }
    out.push_str(rest);
    out.trim().to_owned()
}

/// Decides the answer to request number `n` (1-based), given the next queued reply.
pub fn decide(request: &ChatRequest, n: u64, queued: Option<Reply>) -> Decision {
    if let Some(reply) = queued {
        return from_reply(reply, n);
    }
    if request.last_role.as_deref() == Some("tool") {
        return Decision::Text(format!(
            "tool said: {}",
            first_chars(&request.last_text, TOOL_RESULT_CHARS)
        ));
    }
    let text = request.last_user_text.as_str();
    if let Some(rest) = after_directive(text, "SCENARIO:error") {
        let status = value_after(rest, "STATUS")
            .and_then(|s| s.parse().ok())
            .unwrap_or(DEFAULT_ERROR_STATUS);
        return Decision::Error {
            status: error_status(status),
        };
    }
    if let Some(rest) = after_directive(text, "SCENARIO:slow") {
        let (chunks, ms) = value_after(rest, "SLOW")
            .and_then(parse_slow)
            .unwrap_or((DEFAULT_SLOW_CHUNKS, DEFAULT_SLOW_MS));
        return Decision::Slow {
            chunks,
            interval: Duration::from_millis(ms),
        };
    }
    if let Some(rest) = after_directive(text, "SCENARIO:flood") {
        let words = value_after(rest, "FLOOD")
            .and_then(|s| s.parse().ok())
            .unwrap_or(DEFAULT_FLOOD_WORDS);
        return Decision::Flood { words };
    }
    if let Some(rest) = after_directive(text, "SCENARIO:tool")
        && let Some(decision) = scripted_tool_call(request, rest, n)
    {
        return decision;
    }
    if let Some(reply) = line_after(text, "REPLY") {
        return Decision::Text(reply.to_owned());
    }
    Decision::Text(format!(
        "scripted reply #{n}: {}",
        first_chars(text, ECHO_CHARS)
    ))
}

/// A queued reply as a decision for request number `n`.
fn from_reply(reply: Reply, n: u64) -> Decision {
    match reply {
        Reply::Text(text) => Decision::Text(text),
        Reply::ToolCall { name, arguments } => Decision::ToolCall {
            id: tool_call_id(n),
            name,
            arguments,
        },
        Reply::Error { status } => Decision::Error {
            status: error_status(status),
        },
        Reply::RateLimited { retry_after } => Decision::RateLimited { retry_after },
        Reply::Slow { chunks, interval } => Decision::Slow { chunks, interval },
        Reply::Hang => Decision::Hang,
    }
}

/// The tool call `SCENARIO:tool` asks for, if the tool is offered and the arguments parse.
fn scripted_tool_call(request: &ChatRequest, rest: &str, n: u64) -> Option<Decision> {
    let (name, arguments) = match value_after(rest, "NAME") {
        Some(name) => {
            let arguments = match line_after(rest, "ARGS") {
                Some(args) => serde_json::from_str(args.trim()).ok()?,
                None => json!({}),
            };
            (name.to_owned(), arguments)
        }
        None => (DEFAULT_TOOL.to_owned(), json!({"key": "alpha"})),
    };
    if !request.offers(&name) {
        return None;
    }
    let count: usize = value_after(rest, "COUNT")
        .and_then(|c| c.parse().ok())
        .unwrap_or(1)
        .clamp(1, 16);
    if count > 1 {
        let calls = (0..count)
            .map(|i| {
                (
                    format!("{}_{i}", tool_call_id(n)),
                    name.clone(),
                    arguments.clone(),
                )
            })
            .collect();
        return Some(Decision::ParallelToolCalls { calls });
    }
    Some(Decision::ToolCall {
        id: tool_call_id(n),
        name,
        arguments,
    })
}

/// Error statuses outside 400..=599 become 500.
fn error_status(status: u16) -> u16 {
    if (400..=599).contains(&status) {
        status
    } else {
        DEFAULT_ERROR_STATUS
    }
}

/// `SLOW=<chunks>x<ms>`.
fn parse_slow(value: &str) -> Option<(u32, u64)> {
    let (chunks, ms) = value.split_once('x')?;
    Some((chunks.parse().ok()?, ms.parse().ok()?))
}

/// The first `n` characters of `text`.
fn first_chars(text: &str, n: usize) -> &str {
    text.char_indices()
        .nth(n)
        .map(|(i, _)| &text[..i])
        .unwrap_or(text)
}

/// Where `needle` occurs in `text` as a whole word (not preceded or followed by a word
/// character), scanning left to right.
fn find_word(text: &str, needle: &str) -> Option<usize> {
    let is_word = |c: char| c.is_alphanumeric() || c == '_';
    let mut from = 0;
    while let Some(found) = text[from..].find(needle) {
        let start = from + found;
        let end = start + needle.len();
        let before_ok = !text[..start].chars().next_back().is_some_and(is_word);
        let after_ok = !text[end..].chars().next().is_some_and(is_word);
        if before_ok && after_ok {
            return Some(start);
        }
        from = end;
    }
    None
}

/// The text after the directive `word` (e.g. `SCENARIO:tool`), if it occurs.
fn after_directive<'a>(text: &'a str, word: &str) -> Option<&'a str> {
    find_word(text, word).map(|start| &text[start + word.len()..])
}

/// The text after `KEY=` (whole-word `KEY`), if it occurs.
fn after_key<'a>(text: &'a str, key: &str) -> Option<&'a str> {
    let mut from = 0;
    loop {
        let start = from + find_word(&text[from..], key)?;
        let after = &text[start + key.len()..];
        if let Some(value) = after.strip_prefix('=') {
            return Some(value);
        }
        from = start + key.len();
    }
}

/// `KEY=<value>`: the value up to the next whitespace (never empty).
fn value_after<'a>(text: &'a str, key: &str) -> Option<&'a str> {
    let value = after_key(text, key)?;
    let value = value.split(char::is_whitespace).next().unwrap_or(value);
    (!value.is_empty()).then_some(value)
}

/// `KEY=<rest of line>`: everything after `=` up to the end of that line (no `\r`).
fn line_after<'a>(text: &'a str, key: &str) -> Option<&'a str> {
    let value = after_key(text, key)?;
    let line = value.split('\n').next().unwrap_or(value);
    Some(line.strip_suffix('\r').unwrap_or(line))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_responses_namespace_offers_each_member_under_the_namespaces_prefix() {
        let body = json!({"tools": [
            {"type": "function", "name": "shell"},
            {"type": "namespace", "name": "mcp__gateway", "tools": [
                {"type": "function", "name": "lookup"},
                {"type": "function", "name": "store"}
            ]}
        ]});
        let body = body.as_object().cloned().unwrap_or_default();
        assert_eq!(
            tool_names(&body),
            ["shell", "mcp__gateway__lookup", "mcp__gateway__store"]
        );
    }

    fn request(messages: Value, tools: &[&str]) -> ChatRequest {
        let tools: Vec<Value> = tools
            .iter()
            .map(|name| json!({"type": "function", "function": {"name": name, "parameters": {}}}))
            .collect();
        ChatRequest::from_json(&json!({"model": "m", "messages": messages, "tools": tools}))
            .unwrap()
    }

    fn user(text: &str, tools: &[&str]) -> ChatRequest {
        request(
            json!([{"role": "system", "content": "sys"}, {"role": "user", "content": text}]),
            tools,
        )
    }

    #[test]
    fn default_reply_echoes_user_text_and_counts() {
        let d = decide(&user("hello there", &[]), 7, None);
        assert_eq!(d, Decision::Text("scripted reply #7: hello there".into()));
    }

    #[test]
    fn default_reply_cuts_echo_to_200_chars() {
        let long = "é".repeat(300);
        let Decision::Text(text) = decide(&user(&long, &[]), 1, None) else {
            panic!("expected text");
        };
        assert_eq!(text, format!("scripted reply #1: {}", "é".repeat(200)));
    }

    #[test]
    fn datetime_block_is_stripped_from_string_and_parts() {
        let text = "<current_datetime>2025-01-01T00:00:00Z</current_datetime>\n\nhi model";
        assert_eq!(
            decide(&user(text, &[]), 2, None),
            Decision::Text("scripted reply #2: hi model".into())
        );
        let parts = request(
            json!([{"role": "user", "content": [
                {"type": "text", "text": "<current_datetime>now</current_datetime>"},
                {"type": "text", "text": "REPLY=from parts"}
            ]}]),
            &[],
        );
        assert_eq!(parts.last_user_text, "REPLY=from parts");
        assert_eq!(decide(&parts, 1, None), Decision::Text("from parts".into()));
    }

    #[test]
    fn reply_directive_takes_rest_of_line() {
        let d = decide(
            &user("please\nREPLY=exactly this text\nnot this", &[]),
            1,
            None,
        );
        assert_eq!(d, Decision::Text("exactly this text".into()));
    }

    #[test]
    fn tool_result_is_repeated_and_truncated() {
        let result = "x".repeat(600);
        let r = request(
            json!([
                {"role": "user", "content": "SCENARIO:tool"},
                {"role": "assistant", "content": null, "tool_calls": []},
                {"role": "tool", "tool_call_id": "call_scripted_1", "content": result}
            ]),
            &["get_secret_number"],
        );
        assert_eq!(
            decide(&r, 2, None),
            Decision::Text(format!("tool said: {}", "x".repeat(500)))
        );
    }

    #[test]
    fn scenario_tool_defaults_to_get_secret_number() {
        let d = decide(
            &user("SCENARIO:tool", &["bash", "get_secret_number"]),
            3,
            None,
        );
        assert_eq!(
            d,
            Decision::ToolCall {
                id: "call_scripted_3".into(),
                name: "get_secret_number".into(),
                arguments: json!({"key": "alpha"}),
            }
        );
    }

    #[test]
    fn scenario_tool_with_name_and_args() {
        let text =
            "do it SCENARIO:tool NAME=bash ARGS={\"command\": \"echo hi\", \"n\": [1, 2]}\nbye";
        let d = decide(&user(text, &["bash"]), 4, None);
        assert_eq!(
            d,
            Decision::ToolCall {
                id: "call_scripted_4".into(),
                name: "bash".into(),
                arguments: json!({"command": "echo hi", "n": [1, 2]}),
            }
        );
    }

    #[test]
    fn scenario_tool_not_offered_falls_back_to_text() {
        let d = decide(&user("SCENARIO:tool NAME=bash ARGS={}", &["view"]), 5, None);
        assert_eq!(
            d,
            Decision::Text("scripted reply #5: SCENARIO:tool NAME=bash ARGS={}".into())
        );
        let d = decide(&user("SCENARIO:tool", &[]), 6, None);
        assert!(matches!(d, Decision::Text(t) if t.starts_with("scripted reply #6")));
        // Bad JSON arguments also fall back.
        let d = decide(
            &user("SCENARIO:tool NAME=bash ARGS={nope", &["bash"]),
            7,
            None,
        );
        assert!(matches!(d, Decision::Text(_)));
    }

    #[test]
    fn slow_error_flood_directives() {
        assert_eq!(
            decide(&user("SCENARIO:slow", &[]), 1, None),
            Decision::Slow {
                chunks: 60,
                interval: Duration::from_millis(500)
            }
        );
        assert_eq!(
            decide(&user("SCENARIO:slow SLOW=3x20", &[]), 1, None),
            Decision::Slow {
                chunks: 3,
                interval: Duration::from_millis(20)
            }
        );
        assert_eq!(
            decide(&user("SCENARIO:error", &[]), 1, None),
            Decision::Error { status: 500 }
        );
        assert_eq!(
            decide(&user("SCENARIO:error STATUS=429", &[]), 1, None),
            Decision::Error { status: 429 }
        );
        assert_eq!(
            decide(&user("SCENARIO:flood FLOOD=5", &[]), 1, None),
            Decision::Flood { words: 5 }
        );
        assert_eq!(
            Decision::Flood { words: 3 }.text().as_deref(),
            Some("w0 w1 w2")
        );
        assert_eq!(
            Decision::Slow {
                chunks: 2,
                interval: Duration::ZERO
            }
            .text()
            .as_deref(),
            Some("slow-chunk 0 slow-chunk 1 ")
        );
    }

    #[test]
    fn directive_must_be_a_whole_word() {
        let d = decide(
            &user("SCENARIO:toolbox and XREPLY=no", &["get_secret_number"]),
            1,
            None,
        );
        assert!(matches!(d, Decision::Text(t) if t.starts_with("scripted reply #1")));
    }

    #[test]
    fn queued_reply_takes_precedence() {
        let tool_result = request(
            json!([{"role": "user", "content": "REPLY=x"}, {"role": "tool", "content": "42"}]),
            &[],
        );
        assert_eq!(
            decide(&tool_result, 9, Some(Reply::Text("queued".into()))),
            Decision::Text("queued".into())
        );
        // Tool calls from the queue are sent even when the tool is not offered.
        assert_eq!(
            decide(
                &user("SCENARIO:error", &[]),
                2,
                Some(Reply::ToolCall {
                    name: "nope".into(),
                    arguments: json!({"a": 1})
                })
            ),
            Decision::ToolCall {
                id: "call_scripted_2".into(),
                name: "nope".into(),
                arguments: json!({"a": 1})
            }
        );
        assert_eq!(
            decide(&user("hi", &[]), 1, Some(Reply::Hang)),
            Decision::Hang
        );
        assert_eq!(
            decide(&user("hi", &[]), 1, Some(Reply::Error { status: 200 })),
            Decision::Error { status: 500 }
        );
    }

    #[test]
    fn malformed_bodies_are_rejected() {
        assert!(ChatRequest::from_json(&json!([1, 2])).is_err());
        assert!(ChatRequest::from_json(&json!({"model": "m"})).is_err());
        assert!(ChatRequest::from_json(&json!({"messages": "hi"})).is_err());
        let ok = ChatRequest::from_json(&json!({
            "messages": [],
            "stream": true,
            "stream_options": {"include_usage": true}
        }))
        .unwrap();
        assert!(ok.stream && ok.include_usage && ok.last_role.is_none());
    }
}
