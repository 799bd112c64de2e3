//! Permission decisions for the runtime's built-in tools: parsing the `permissionRequest`
//! of a `permission.requested` event, the policies that answer it (fail closed by default)
//! and the decision object sent back with `session.permissions.handlePendingPermissionRequest`.
//!
//! A policy is asked through [`decide_safely`], which turns a policy error or panic into a
//! rejection: a broken policy must never approve anything.

use std::any::Any;
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::pin::Pin;

use futures_util::FutureExt;
use serde_json::{Value, json};

/// What the runtime asks permission for (parsed leniently from `permissionRequest`).
#[derive(Debug, Clone, PartialEq)]
pub struct PermissionRequest {
    /// `shell`, `write`, `read`, `mcp`, `url`, `memory`, `custom-tool`, … (empty if absent).
    pub kind: String,
    /// The full command text of a shell request (`fullCommandText`, else `command`).
    pub command: Option<String>,
    /// Paths the request touches (`path`, `fileName`, `filePath`, `paths`), in that order.
    pub paths: Vec<String>,
    /// The URL of a url request.
    pub url: Option<String>,
    /// The tool name of an mcp / custom-tool request (`toolName`).
    pub tool_name: Option<String>,
    /// The whole `permissionRequest` as received.
    pub raw: Value,
}

impl PermissionRequest {
    /// Parses a `permissionRequest` object. Never fails: missing or mistyped fields are
    /// left empty and the original value is kept in `raw`.
    pub fn from_wire(value: &Value) -> Self {
        let string = |key: &str| value.get(key).and_then(Value::as_str).map(str::to_owned);

        let mut paths: Vec<String> = Vec::new();
        let mut push = |p: &str| {
            if !paths.iter().any(|existing| existing == p) {
                paths.push(p.to_owned());
            }
        };
        for key in ["path", "fileName", "filePath"] {
            if let Some(p) = value.get(key).and_then(Value::as_str) {
                push(p);
            }
        }
        if let Some(list) = value.get("paths").and_then(Value::as_array) {
            for p in list.iter().filter_map(Value::as_str) {
                push(p);
            }
        }

        Self {
            kind: string("kind").unwrap_or_default(),
            command: string("fullCommandText").or_else(|| string("command")),
            paths,
            url: string("url"),
            tool_name: string("toolName"),
            raw: value.clone(),
        }
    }
}

/// The client's answer to a permission request.
#[derive(Debug, Clone, PartialEq)]
pub enum PermissionDecision {
    /// Allow this one use (`approve-once`).
    Approve,
    /// Refuse; the feedback is shown to the model.
    Reject { feedback: String },
}

impl PermissionDecision {
    /// A rejection with the given feedback.
    pub fn reject(feedback: impl Into<String>) -> Self {
        Self::Reject {
            feedback: feedback.into(),
        }
    }

    /// The wire shape: `{"kind":"approve-once"}` or `{"kind":"reject","feedback":…}`.
    pub fn to_wire(&self) -> Value {
        match self {
            Self::Approve => json!({ "kind": "approve-once" }),
            Self::Reject { feedback } => json!({ "kind": "reject", "feedback": feedback }),
        }
    }
}

/// The future a policy returns. `Err` (a message) is treated as a rejection.
pub type DecisionFuture = Pin<Box<dyn Future<Output = Result<PermissionDecision, String>> + Send>>;

/// Decides permission requests. Call it through [`decide_safely`].
pub trait PermissionPolicy: Send + Sync + 'static {
    /// Decides one request.
    fn decide(&self, request: PermissionRequest) -> DecisionFuture;
}

/// The default feedback of [`RejectAll`].
const DEFAULT_REJECT_FEEDBACK: &str = "copilot-pool rejects built-in tool use by default (fail closed); configure a permission policy to allow it.";

/// Rejects every request (the default policy: fail closed).
#[derive(Debug, Clone, PartialEq)]
pub struct RejectAll {
    /// Shown to the model with every rejection.
    pub feedback: String,
}

impl Default for RejectAll {
    fn default() -> Self {
        Self {
            feedback: DEFAULT_REJECT_FEEDBACK.to_owned(),
        }
    }
}

impl PermissionPolicy for RejectAll {
    fn decide(&self, _request: PermissionRequest) -> DecisionFuture {
        let decision = PermissionDecision::reject(self.feedback.clone());
        Box::pin(std::future::ready(Ok(decision)))
    }
}

/// Approves every request. Only for trusted, sandboxed runtimes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ApproveAll;

impl PermissionPolicy for ApproveAll {
    fn decide(&self, _request: PermissionRequest) -> DecisionFuture {
        Box::pin(std::future::ready(Ok(PermissionDecision::Approve)))
    }
}

/// One rule of a [`RulePolicy`]. It matches when its kind matches (`*` = any) and every
/// pattern it sets matches; patterns are [globs](glob_match).
#[derive(Debug, Clone, PartialEq)]
pub struct Rule {
    /// `"*"` or a request kind (`shell`, `write`, …), compared exactly.
    pub kind: String,
    /// Glob against the command text; a request without one does not match.
    pub command: Option<String>,
    /// Glob against ANY of the request's paths; a request without paths does not match.
    pub path: Option<String>,
    /// Glob against the url; a request without one does not match.
    pub url: Option<String>,
    /// The decision when this rule matches.
    pub decision: PermissionDecision,
}

impl Rule {
    /// True when this rule applies to the request.
    pub fn matches(&self, request: &PermissionRequest) -> bool {
        if self.kind != "*" && self.kind != request.kind {
            return false;
        }
        let optional = |pattern: &Option<String>, value: &Option<String>| match pattern {
            None => true,
            Some(pattern) => value.as_deref().is_some_and(|v| glob_match(pattern, v)),
        };
        if !optional(&self.command, &request.command) || !optional(&self.url, &request.url) {
            return false;
        }
        match &self.path {
            None => true,
            Some(pattern) => request.paths.iter().any(|p| glob_match(pattern, p)),
        }
    }
}

/// Ordered rules; the first matching rule decides, else `otherwise` (default: reject).
#[derive(Debug, Clone, PartialEq)]
pub struct RulePolicy {
    rules: Vec<Rule>,
    otherwise: PermissionDecision,
}

impl RulePolicy {
    /// A policy with these rules that rejects whatever no rule matches.
    pub fn new(rules: Vec<Rule>) -> Self {
        Self {
            rules,
            otherwise: PermissionDecision::reject(DEFAULT_REJECT_FEEDBACK),
        }
    }

    /// Sets the decision for requests no rule matches.
    pub fn otherwise(mut self, decision: PermissionDecision) -> Self {
        self.otherwise = decision;
        self
    }

    /// The decision for a request, synchronously.
    pub fn decide_now(&self, request: &PermissionRequest) -> PermissionDecision {
        self.rules
            .iter()
            .find(|rule| rule.matches(request))
            .map_or_else(|| self.otherwise.clone(), |rule| rule.decision.clone())
    }
}

impl PermissionPolicy for RulePolicy {
    fn decide(&self, request: PermissionRequest) -> DecisionFuture {
        let decision = self.decide_now(&request);
        Box::pin(std::future::ready(Ok(decision)))
    }
}

/// Runs a policy safely: an Err or a panic inside `decide` becomes a Reject whose feedback says the policy failed.
pub async fn decide_safely(
    policy: &dyn PermissionPolicy,
    request: PermissionRequest,
) -> PermissionDecision {
    let kind = request.kind.clone();
    // `decide` itself may panic before returning a future; the future may panic when polled.
    let outcome = match std::panic::catch_unwind(AssertUnwindSafe(|| policy.decide(request))) {
        Ok(future) => match AssertUnwindSafe(future).catch_unwind().await {
            Ok(result) => result,
            Err(payload) => Err(panic_message(payload.as_ref())),
        },
        Err(payload) => Err(panic_message(payload.as_ref())),
    };
    match outcome {
        Ok(decision) => decision,
        Err(message) => {
            tracing::warn!(kind = %kind, error = %message, "permission policy failed; rejecting");
            PermissionDecision::reject(format!(
                "permission policy failed: {message}; rejected (fail closed)"
            ))
        }
    }
}

fn panic_message(payload: &(dyn Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        format!("panicked: {s}")
    } else if let Some(s) = payload.downcast_ref::<String>() {
        format!("panicked: {s}")
    } else {
        "panicked".to_owned()
    }
}

/// Whole-string glob match: `*` matches any run of characters (including `/`), `?` exactly
/// one character, everything else is literal. Iterative, O(len(pattern) × len(text)) worst
/// case: only the most recent `*` is ever backtracked to.
pub fn glob_match(pattern: &str, text: &str) -> bool {
    let p: Vec<char> = pattern.chars().collect();
    let t: Vec<char> = text.chars().collect();
    let (mut pi, mut ti) = (0usize, 0usize);
    // Position after the last `*` seen, and the text position it is currently matched up to.
    let mut star: Option<(usize, usize)> = None;
    while ti < t.len() {
        if pi < p.len() && p[pi] == '*' {
            star = Some((pi + 1, ti));
            pi += 1;
        } else if pi < p.len() && (p[pi] == '?' || p[pi] == t[ti]) {
            pi += 1;
            ti += 1;
        } else if let Some((after_star, matched)) = star {
            // Let the last `*` absorb one more character and retry from after it.
            star = Some((after_star, matched + 1));
            pi = after_star;
            ti = matched + 1;
        } else {
            return false;
        }
    }
    p[pi..].iter().all(|&c| c == '*')
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::{Duration, Instant};

    fn req(value: Value) -> PermissionRequest {
        PermissionRequest::from_wire(&value)
    }

    fn shell(command: &str) -> PermissionRequest {
        req(json!({"kind": "shell", "fullCommandText": command, "toolCallId": "c1"}))
    }

    fn rule(kind: &str, decision: PermissionDecision) -> Rule {
        Rule {
            kind: kind.to_owned(),
            command: None,
            path: None,
            url: None,
            decision,
        }
    }

    fn reject(feedback: &str) -> PermissionDecision {
        PermissionDecision::reject(feedback)
    }

    async fn ask(policy: &dyn PermissionPolicy, request: PermissionRequest) -> PermissionDecision {
        decide_safely(policy, request).await
    }

    #[test]
    fn parses_shell_request() {
        let value = json!({
            "kind": "shell",
            "fullCommandText": "echo hello-from-bash",
            "toolCallId": "call_1",
            "intention": "say hello"
        });
        let r = PermissionRequest::from_wire(&value);
        assert_eq!(r.kind, "shell");
        assert_eq!(r.command.as_deref(), Some("echo hello-from-bash"));
        assert!(r.paths.is_empty());
        assert_eq!(r.url, None);
        assert_eq!(r.tool_name, None);
        assert_eq!(r.raw, value);
    }

    #[test]
    fn parses_shell_command_fallback() {
        let r = req(json!({"kind": "shell", "command": "ls"}));
        assert_eq!(r.command.as_deref(), Some("ls"));
    }

    #[test]
    fn parses_write_and_read_paths() {
        let r = req(json!({"kind": "write", "fileName": "/tmp/a.txt", "diff": "+x"}));
        assert_eq!(r.kind, "write");
        assert_eq!(r.paths, vec!["/tmp/a.txt".to_owned()]);

        let r =
            req(json!({"kind": "read", "path": "/a", "filePath": "/b", "paths": ["/c", "/a", 7]}));
        assert_eq!(r.paths, vec!["/a", "/b", "/c"]);
    }

    #[test]
    fn parses_url_and_tool_requests() {
        let r = req(json!({"kind": "url", "url": "https://example.com/x"}));
        assert_eq!(r.kind, "url");
        assert_eq!(r.url.as_deref(), Some("https://example.com/x"));

        let r = req(json!({"kind": "custom-tool", "toolName": "get_secret_number"}));
        assert_eq!(r.tool_name.as_deref(), Some("get_secret_number"));
    }

    #[test]
    fn parses_unknown_and_malformed_leniently() {
        let value = json!({"kind": "something-new", "extra": {"a": 1}});
        let r = req(value.clone());
        assert_eq!(r.kind, "something-new");
        assert_eq!(r.command, None);
        assert!(r.paths.is_empty());
        assert_eq!(r.raw, value);

        let r = req(json!("not an object"));
        assert_eq!(r.kind, "");
        assert!(r.paths.is_empty());

        let r = req(json!({"kind": 5, "fullCommandText": ["x"], "paths": "nope"}));
        assert_eq!(r.kind, "");
        assert_eq!(r.command, None);
        assert!(r.paths.is_empty());
    }

    #[test]
    fn to_wire_shapes() {
        assert_eq!(
            PermissionDecision::Approve.to_wire(),
            json!({"kind": "approve-once"})
        );
        assert_eq!(
            reject("no").to_wire(),
            json!({"kind": "reject", "feedback": "no"})
        );
    }

    #[tokio::test]
    async fn reject_all_rejects_everything_with_its_feedback() {
        let policy = RejectAll::default();
        assert!(policy.feedback.contains("fail closed"));
        for r in [
            shell("echo hi"),
            req(json!({"kind": "write", "path": "/x"})),
            req(json!({})),
        ] {
            assert_eq!(ask(&policy, r).await, reject(&policy.feedback));
        }
        let custom = RejectAll {
            feedback: "nope".into(),
        };
        assert_eq!(ask(&custom, shell("ls")).await, reject("nope"));
    }

    #[tokio::test]
    async fn approve_all_approves() {
        assert_eq!(
            ask(&ApproveAll, shell("rm -rf /")).await,
            PermissionDecision::Approve
        );
        assert_eq!(
            ask(&ApproveAll, req(json!({"kind": "url"}))).await,
            PermissionDecision::Approve
        );
    }

    #[test]
    fn rule_kind_match() {
        let policy = RulePolicy::new(vec![rule("read", PermissionDecision::Approve)]);
        let read = req(json!({"kind": "read", "path": "/a"}));
        assert_eq!(policy.decide_now(&read), PermissionDecision::Approve);
        assert!(matches!(
            policy.decide_now(&shell("ls")),
            PermissionDecision::Reject { .. }
        ));

        let any = RulePolicy::new(vec![rule("*", PermissionDecision::Approve)]);
        assert_eq!(any.decide_now(&shell("ls")), PermissionDecision::Approve);
        assert_eq!(any.decide_now(&req(json!({}))), PermissionDecision::Approve);
    }

    #[test]
    fn rule_command_glob() {
        let policy = RulePolicy::new(vec![Rule {
            command: Some("echo *".into()),
            ..rule("shell", PermissionDecision::Approve)
        }]);
        assert_eq!(
            policy.decide_now(&shell("echo hi")),
            PermissionDecision::Approve
        );
        assert!(matches!(
            policy.decide_now(&shell("rm -rf /")),
            PermissionDecision::Reject { .. }
        ));
        // A command pattern never matches a request without a command.
        assert!(matches!(
            policy.decide_now(&req(json!({"kind": "shell"}))),
            PermissionDecision::Reject { .. }
        ));
    }

    #[test]
    fn rule_path_glob_matches_any_path() {
        let policy = RulePolicy::new(vec![Rule {
            path: Some("/work/*".into()),
            ..rule("write", PermissionDecision::Approve)
        }]);
        let one_inside = req(json!({"kind": "write", "paths": ["/etc/passwd", "/work/a/b.rs"]}));
        assert_eq!(policy.decide_now(&one_inside), PermissionDecision::Approve);
        let outside = req(json!({"kind": "write", "path": "/etc/passwd"}));
        assert!(matches!(
            policy.decide_now(&outside),
            PermissionDecision::Reject { .. }
        ));
        let no_paths = req(json!({"kind": "write"}));
        assert!(matches!(
            policy.decide_now(&no_paths),
            PermissionDecision::Reject { .. }
        ));
        // Even `*` needs at least one path.
        let star = RulePolicy::new(vec![Rule {
            path: Some("*".into()),
            ..rule("*", PermissionDecision::Approve)
        }]);
        assert!(matches!(
            star.decide_now(&no_paths),
            PermissionDecision::Reject { .. }
        ));
    }

    #[test]
    fn rule_url_glob() {
        let policy = RulePolicy::new(vec![Rule {
            url: Some("https://docs.rs/*".into()),
            ..rule("url", PermissionDecision::Approve)
        }]);
        let ok = req(json!({"kind": "url", "url": "https://docs.rs/serde/latest"}));
        let bad = req(json!({"kind": "url", "url": "http://evil.example/https://docs.rs/"}));
        assert_eq!(policy.decide_now(&ok), PermissionDecision::Approve);
        assert!(matches!(
            policy.decide_now(&bad),
            PermissionDecision::Reject { .. }
        ));
    }

    #[test]
    fn rule_all_set_patterns_must_match() {
        let r = Rule {
            command: Some("*".into()),
            url: Some("*".into()),
            ..rule("*", PermissionDecision::Approve)
        };
        assert!(!r.matches(&shell("ls")));
        let mut both = shell("ls");
        both.url = Some("https://x".into());
        assert!(r.matches(&both));
    }

    #[tokio::test]
    async fn first_match_wins_and_otherwise() {
        let policy = RulePolicy::new(vec![
            Rule {
                command: Some("rm *".into()),
                ..rule("shell", reject("no rm"))
            },
            rule("shell", PermissionDecision::Approve),
            rule("*", reject("second")),
        ]);
        assert_eq!(policy.decide_now(&shell("rm -rf /")), reject("no rm"));
        assert_eq!(policy.decide_now(&shell("ls")), PermissionDecision::Approve);
        assert_eq!(
            policy.decide_now(&req(json!({"kind": "read"}))),
            reject("second")
        );
        assert_eq!(ask(&policy, shell("ls")).await, PermissionDecision::Approve);

        let empty = RulePolicy::new(vec![]);
        assert_eq!(
            empty.decide_now(&shell("ls")),
            reject(DEFAULT_REJECT_FEEDBACK)
        );
        let open = RulePolicy::new(vec![]).otherwise(PermissionDecision::Approve);
        assert_eq!(open.decide_now(&shell("ls")), PermissionDecision::Approve);
    }

    #[test]
    fn glob_edge_cases() {
        assert!(glob_match("", ""));
        assert!(!glob_match("", "a"));
        assert!(glob_match("*", ""));
        assert!(glob_match("*", "anything/at all"));
        assert!(glob_match("**", "x"));
        assert!(glob_match("?", "a"));
        assert!(glob_match("?", "é"));
        assert!(!glob_match("?", ""));
        assert!(!glob_match("?", "ab"));
        assert!(glob_match("a?c", "abc"));
        assert!(!glob_match("a?c", "ac"));
        assert!(glob_match("abc", "abc"));
        assert!(!glob_match("abc", "abcd"));
        assert!(!glob_match("abc", "xabc"));
        assert!(glob_match("a*", "a/b/c"));
        assert!(glob_match("*c", "abc"));
        assert!(glob_match("a*b*c", "aXXbYYc"));
        assert!(!glob_match("a*b*c", "aXXbYY"));
        assert!(glob_match("*ab", "aab"));
        assert!(glob_match("*a*", "ba"));
        // Literal special characters (no classes, no escapes).
        assert!(glob_match("[a].txt", "[a].txt"));
        assert!(!glob_match("[a].txt", "a.txt"));
        assert!(glob_match("a.b", "a.b"));
        assert!(!glob_match("a.b", "axb"));
        assert!(glob_match(r"a\*", r"a\xyz"));
        assert!(glob_match("{x,y}+$^()|", "{x,y}+$^()|"));
    }

    #[test]
    fn glob_adversarial_is_fast() {
        let text = "a".repeat(20_000);
        let start = Instant::now();
        assert!(!glob_match("*a*a*a*a*b", &text));
        assert!(!glob_match("*a*a*a*a*a*a*a*a*a*a*a*a*b", &text));
        assert!(glob_match("*a*a*a*a*", &text));
        assert!(
            start.elapsed() < Duration::from_secs(1),
            "{:?}",
            start.elapsed()
        );
    }

    struct Failing;
    impl PermissionPolicy for Failing {
        fn decide(&self, _request: PermissionRequest) -> DecisionFuture {
            Box::pin(async { Err("backend unreachable".to_owned()) })
        }
    }

    struct PanicsWhenPolled;
    impl PermissionPolicy for PanicsWhenPolled {
        fn decide(&self, _request: PermissionRequest) -> DecisionFuture {
            Box::pin(async {
                tokio::task::yield_now().await;
                panic!("policy exploded")
            })
        }
    }

    struct PanicsInDecide;
    impl PermissionPolicy for PanicsInDecide {
        fn decide(&self, _request: PermissionRequest) -> DecisionFuture {
            panic!("decide exploded")
        }
    }

    #[tokio::test]
    async fn decide_safely_rejects_on_err() {
        let d = ask(&Failing, shell("ls")).await;
        assert_eq!(
            d,
            reject("permission policy failed: backend unreachable; rejected (fail closed)")
        );
    }

    #[tokio::test]
    async fn decide_safely_rejects_on_panic() {
        match ask(&PanicsWhenPolled, shell("ls")).await {
            PermissionDecision::Reject { feedback } => {
                assert!(
                    feedback.starts_with("permission policy failed: "),
                    "{feedback}"
                );
                assert!(feedback.contains("policy exploded"), "{feedback}");
                assert!(feedback.ends_with("; rejected (fail closed)"), "{feedback}");
            }
            other => panic!("expected reject, got {other:?}"),
        }
        match ask(&PanicsInDecide, shell("ls")).await {
            PermissionDecision::Reject { feedback } => {
                assert!(feedback.contains("decide exploded"), "{feedback}");
            }
            other => panic!("expected reject, got {other:?}"),
        }
    }
}
