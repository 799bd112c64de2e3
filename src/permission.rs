//! Permission decisions for the runtime's built-in tools: parsing the `permissionRequest`
//! of a `permission.requested` event, the policies that answer it (fail closed by default)
//! and the decision object sent back with `session.permissions.handlePendingPermissionRequest`.
//!
//! A policy is asked through [`decide_safely`], which turns a policy error or panic into a
//! rejection: a broken policy must never approve anything.
//!
//! [`RulePolicy`] rules fail closed: an allow rule approves a request only when every path
//! (normalised lexically, submodule `path`) and every simple command of its shell line (split
//! as bash reads it, submodule `shell`) matches; a reject rule applies when any of them does,
//! or when the line cannot be split with confidence.

pub(crate) mod path;
mod shell;

use std::future::Future;
use std::path::{Path, PathBuf};
use std::pin::Pin;

use serde_json::{Value, json};

use crate::panic_guard::call_guarded;

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
    /// The conversation's working directory (set by the turn driver): relative paths are
    /// taken against it. Without one (or with a relative one), a relative path matches no
    /// allow rule and every reject rule with a path pattern.
    pub working_directory: Option<PathBuf>,
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
            working_directory: None,
        }
    }

    /// The same request, with relative paths taken against `dir`.
    pub fn with_working_directory(mut self, dir: impl Into<PathBuf>) -> Self {
        self.working_directory = Some(dir.into());
        self
    }

    /// What an `approve-for-session` of this request has the runtime remember, from the
    /// fields the runtime sent: a shell request's command identifiers (`commands[].identifier`;
    /// where the runtime says it cannot offer a session approval, `canOfferSessionApproval:
    /// false`, only when the one identifier is the whole line, so that exact line), file
    /// writes (unless `canOfferSessionApproval: false`), file reads, this MCP tool
    /// (`serverName`, `toolName`), this custom tool, memory writes, or a url request's origin.
    /// `None` when it names none of these (another kind, a field missing); such a request is
    /// approved once.
    pub fn session_approval(&self) -> Option<SessionApproval> {
        let raw = &self.raw;
        let text = |key: &str| {
            raw.get(key)
                .and_then(Value::as_str)
                .filter(|s| !s.is_empty())
                .map(str::to_owned)
        };
        let offered = raw.get("canOfferSessionApproval").and_then(Value::as_bool);
        match self.kind.as_str() {
            "shell" => {
                let mut identifiers: Vec<String> = Vec::new();
                for command in raw.get("commands").and_then(Value::as_array)? {
                    let identifier = command
                        .get("identifier")
                        .and_then(Value::as_str)
                        .filter(|s| !s.is_empty())?;
                    if !identifiers.iter().any(|known| known == identifier) {
                        identifiers.push(identifier.to_owned());
                    }
                }
                // Where the runtime offers no session approval for the line's commands, the
                // line itself (its only identifier, as runtime 1.0.14 sends every line) is
                // remembered and nothing wider: the runtime runs that exact line unasked.
                let exact_line = identifiers.len() == 1
                    && self.command.as_deref() == Some(identifiers[0].as_str());
                (!identifiers.is_empty() && (offered == Some(true) || exact_line))
                    .then_some(SessionApproval::Commands(identifiers))
            }
            "read" => Some(SessionApproval::Read),
            "write" => (offered != Some(false)).then_some(SessionApproval::Write),
            "mcp" => Some(SessionApproval::Mcp {
                server: text("serverName")?,
                tool: text("toolName")?,
            }),
            "custom-tool" => text("toolName").map(SessionApproval::CustomTool),
            "memory" => Some(SessionApproval::Memory),
            "url" => {
                let url = url::Url::parse(self.url.as_deref()?).ok()?;
                let origin = url.origin();
                origin
                    .is_tuple()
                    .then(|| SessionApproval::UrlOrigin(origin.ascii_serialization()))
            }
            _ => None,
        }
    }
}

/// The client's answer to a permission request.
#[derive(Debug, Clone, PartialEq)]
pub enum PermissionDecision {
    /// Allow this one use (`approve-once`).
    Approve,
    /// Allow this use and have the runtime remember the approval for the rest of the session
    /// (`approve-for-session`, with what [`PermissionRequest::session_approval`] names): the
    /// runtime then runs requests that approval covers without asking again, so no policy is
    /// asked about them either. A request that names nothing the runtime can remember (or
    /// that the runtime says cannot be approved for the session) is approved once. A CLI
    /// backend other than Copilot takes it as [`Approve`](Self::Approve).
    ApproveForSession,
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

    /// True for [`Approve`](Self::Approve) and [`ApproveForSession`](Self::ApproveForSession).
    pub fn approves(&self) -> bool {
        !matches!(self, Self::Reject { .. })
    }

    /// The wire shape without the request: `{"kind":"approve-once"}` or
    /// `{"kind":"reject","feedback":…}`. [`ApproveForSession`](Self::ApproveForSession) needs
    /// the request to name what the runtime is to remember, so here it is `approve-once`; use
    /// [`to_wire_for`](Self::to_wire_for) to answer a request.
    pub fn to_wire(&self) -> Value {
        self.to_wire_with(None)
    }

    /// The wire shape answering `request`: as [`to_wire`](Self::to_wire), except that
    /// [`ApproveForSession`](Self::ApproveForSession) is `{"kind":"approve-for-session",
    /// "approval":…}` (`"domain":…` for a url request) when the request names something the
    /// runtime can remember ([`PermissionRequest::session_approval`]), else `approve-once`.
    pub fn to_wire_for(&self, request: &PermissionRequest) -> Value {
        match self {
            Self::ApproveForSession => self.to_wire_with(request.session_approval()),
            _ => self.to_wire_with(None),
        }
    }

    /// The wire shape, `approval` being what an `approve-for-session` remembers.
    pub(crate) fn to_wire_with(&self, approval: Option<SessionApproval>) -> Value {
        match (self, approval) {
            (Self::ApproveForSession, Some(approval)) => approval.to_decision(),
            (Self::Approve | Self::ApproveForSession, _) => json!({ "kind": "approve-once" }),
            (Self::Reject { feedback }, _) => json!({ "kind": "reject", "feedback": feedback }),
        }
    }
}

/// What the runtime remembers for the rest of a session when a request is answered
/// `approve-for-session` (the decision's `approval`, or its `domain` for a url request):
/// later requests it covers run without a `permission.requested`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SessionApproval {
    /// Shell lines made of commands with these identifiers, the request's
    /// `commands[].identifier` (runtime 1.0.14 sends the whole line as the one identifier,
    /// so that exact line): `{"kind":"commands","commandIdentifiers":[…]}`.
    Commands(Vec<String>),
    /// File reads (`{"kind":"read"}`); a path outside the allowed directories is still asked
    /// for on its own (a `read` request per new path).
    Read,
    /// Every file write: `{"kind":"write"}`.
    Write,
    /// This tool of this MCP server (never the whole server): `{"kind":"mcp",…}`.
    Mcp {
        /// The request's `serverName`.
        server: String,
        /// The request's `toolName`.
        tool: String,
    },
    /// This custom tool: `{"kind":"custom-tool","toolName":…}`.
    CustomTool(String),
    /// Writes to long-term memory: `{"kind":"memory"}`.
    Memory,
    /// Fetching URLs of this origin (`https://example.com`, `http://127.0.0.1:8080`; another
    /// scheme, port or subdomain is asked again), sent as the decision's `domain`.
    UrlOrigin(String),
}

impl SessionApproval {
    /// The `approve-for-session` decision that has the runtime remember this.
    pub fn to_decision(&self) -> Value {
        let approval = match self {
            Self::Commands(identifiers) => {
                json!({ "kind": "commands", "commandIdentifiers": identifiers })
            }
            Self::Read => json!({ "kind": "read" }),
            Self::Write => json!({ "kind": "write" }),
            Self::Mcp { server, tool } => {
                json!({ "kind": "mcp", "serverName": server, "toolName": tool })
            }
            Self::CustomTool(name) => json!({ "kind": "custom-tool", "toolName": name }),
            Self::Memory => json!({ "kind": "memory" }),
            Self::UrlOrigin(origin) => {
                return json!({ "kind": "approve-for-session", "domain": origin });
            }
        };
        json!({ "kind": "approve-for-session", "approval": approval })
    }
}

/// The future a policy returns. `Err` (a message) is treated as a rejection.
pub type DecisionFuture = Pin<Box<dyn Future<Output = Result<PermissionDecision, String>> + Send>>;

/// Decides permission requests. Call it through [`decide_safely`].
pub trait PermissionPolicy: Send + Sync + 'static {
    /// Decides one request.
    fn decide(&self, request: PermissionRequest) -> DecisionFuture;

    /// Whether this policy approves every request without looking at it (the page's
    /// "YOLO" exec policy). A CLI backend that has its own approve-all mode may then skip
    /// asking (Claude Code's `--permission-mode bypassPermissions`). Default `false`: only
    /// [`ApproveAll`] says `true`; a policy that may ever reject must not.
    fn approves_all(&self) -> bool {
        false
    }
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

    fn approves_all(&self) -> bool {
        true
    }
}

/// One rule of a [`RulePolicy`]. It matches when its kind matches (`*` = any) and every
/// pattern it sets matches; patterns are [globs](glob_match). What "matches" means depends on
/// the rule's decision, so that a rule never approves more than it says:
///
/// - an **allow** rule ([`PermissionDecision::Approve`] or
///   [`PermissionDecision::ApproveForSession`]) matches a request's paths when EVERY path
///   matches after lexical normalisation, and its shell line when the line splits into
///   simple commands with confidence and EVERY one matches, its wildcards matching no
///   redirection operator;
/// - a **reject** rule matches a request's paths when ANY path matches (normalised or as
///   sent) or cannot be normalised, and its shell line when the whole line or any simple
///   command of it matches, or when the line cannot be split with confidence.
///
/// A line is split at unquoted `;`, `&`, `|`, `&&`, `||`, `|&` and newlines; a line with command
/// substitution or a here-document (anywhere), unquoted parentheses, a `${…}` with quotes or
/// operators, or an unterminated quote is approved by no allow rule. The README's "Permission
/// rules" section states it all.
///
/// An `ApproveForSession` rule approves what it matches as any allow rule does, but the
/// runtime then remembers the request's [`SessionApproval`] (a shell line's command names,
/// every write, …), which is wider than the rule's globs: later requests it covers are not
/// asked about, so no rule sees them. Use `Approve` where the globs must hold for every use.
#[derive(Debug, Clone, PartialEq)]
pub struct Rule {
    /// `"*"` or a request kind (`shell`, `write`, …), compared exactly.
    pub kind: String,
    /// Glob against each simple command of the shell line (see above); a request without a
    /// command does not match.
    pub command: Option<String>,
    /// Glob against the request's paths, normalised to absolute paths (write it absolute);
    /// a request without paths does not match.
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
        let approves = self.decision.approves();
        let url_matches = match &self.url {
            None => true,
            Some(pattern) => request
                .url
                .as_deref()
                .is_some_and(|u| glob_match(pattern, u)),
        };
        let command_matches = match &self.command {
            None => true,
            Some(pattern) => request.command.as_deref().is_some_and(|line| {
                if approves {
                    allows_command(pattern, line)
                } else {
                    hits_command(pattern, line)
                }
            }),
        };
        let path_matches = match &self.path {
            None => true,
            Some(_) if request.paths.is_empty() => false,
            Some(pattern) => {
                let cwd = request.working_directory.as_deref();
                if approves {
                    request.paths.iter().all(|p| allows_path(pattern, p, cwd))
                } else {
                    request.paths.iter().any(|p| hits_path(pattern, p, cwd))
                }
            }
        };
        url_matches && command_matches && path_matches
    }
}

/// Every simple command of `line` matches `pattern`, wildcards matching no redirection.
fn allows_command(pattern: &str, line: &str) -> bool {
    let Ok(commands) = shell::simple_commands(line) else {
        return false;
    };
    !commands.is_empty() && commands.iter().all(|c| glob_match_chars(pattern, &c.chars))
}

/// The whole line, any simple command of it, or a line that cannot be split matches.
fn hits_command(pattern: &str, line: &str) -> bool {
    if glob_match(pattern, line) {
        return true;
    }
    match shell::simple_commands(line) {
        Err(_) => true,
        Ok(commands) => commands.iter().any(|c| {
            glob_match(pattern, &c.text)
                || glob_match(pattern, &c.chars.iter().map(|c| c.ch).collect::<String>())
        }),
    }
}

fn allows_path(pattern: &str, path: &str, cwd: Option<&Path>) -> bool {
    path::normalize(path, cwd).is_some_and(|normal| glob_match(pattern, &normal))
}

fn hits_path(pattern: &str, path: &str, cwd: Option<&Path>) -> bool {
    glob_match(pattern, path)
        || path::normalize(path, cwd).is_none_or(|normal| glob_match(pattern, &normal))
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
    let outcome = call_guarded(|| policy.decide(request))
        .await
        .unwrap_or_else(|panic| Err(format!("panicked: {panic}")));
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

/// Whole-string glob match: `*` matches any run of characters (including `/`), `?` exactly
/// one character, everything else is literal. O(len(pattern) × len(text)) time, O(len(text))
/// memory.
pub fn glob_match(pattern: &str, text: &str) -> bool {
    let text: Vec<shell::Char> = text
        .chars()
        .map(|ch| shell::Char { ch, wild: true })
        .collect();
    glob_match_chars(pattern, &text)
}

/// [`glob_match`] over marked characters: `*` and `?` match only characters marked `wild`;
/// the others must be matched by the same literal character in the pattern.
fn glob_match_chars(pattern: &str, text: &[shell::Char]) -> bool {
    // matched[j]: the pattern so far matches text[..j].
    let mut matched = vec![false; text.len() + 1];
    matched[0] = true;
    for p in pattern.chars() {
        match p {
            '*' => {
                for j in 1..=text.len() {
                    matched[j] = matched[j] || (matched[j - 1] && text[j - 1].wild);
                }
            }
            _ => {
                for j in (1..=text.len()).rev() {
                    let t = text[j - 1];
                    let one = if p == '?' { t.wild } else { t.ch == p };
                    matched[j] = matched[j - 1] && one;
                }
                matched[0] = false;
            }
        }
    }
    matched[text.len()]
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
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

    /// A shell request as runtime 1.0.14 sends it: the whole line as its one identifier.
    fn shell_as_sent(line: &str, offered: bool) -> PermissionRequest {
        req(json!({
            "kind": "shell", "fullCommandText": line, "intention": "run it",
            "commands": [{"identifier": line, "readOnly": false}],
            "commandSegments": [{"fullCommandText": line, "identifier": "echo"}],
            "canOfferSessionApproval": offered, "possiblePaths": [], "possibleUrls": [],
            "hasWriteFileRedirection": false, "toolCallId": "c1",
        }))
    }

    #[test]
    fn approve_for_session_names_what_the_runtime_is_to_remember_for_each_kind() {
        let session = |request: &PermissionRequest| {
            PermissionDecision::ApproveForSession.to_wire_for(request)
        };
        let once = json!({"kind": "approve-once"});
        // The exact line, even where the runtime offers no pattern; never the segments'
        // command names (`echo`), which would cover every echo.
        assert_eq!(
            session(&shell_as_sent("echo hi", false)),
            json!({"kind": "approve-for-session",
                   "approval": {"kind": "commands", "commandIdentifiers": ["echo hi"]}})
        );
        // Identifiers wider than the line only where the runtime offers them.
        let wider = |offered: bool| {
            req(
                json!({"kind": "shell", "fullCommandText": "git status && git log",
                       "commands": [{"identifier": "git status"}, {"identifier": "git log"}],
                       "canOfferSessionApproval": offered}),
            )
        };
        assert_eq!(session(&wider(false)), once);
        assert_eq!(
            session(&wider(true)),
            json!({"kind": "approve-for-session", "approval":
                   {"kind": "commands", "commandIdentifiers": ["git status", "git log"]}})
        );
        // A shell request without identifiers, or with one that is not a string.
        assert_eq!(session(&shell("echo hi")), once);
        let odd = req(json!({"kind": "shell", "fullCommandText": "x",
                             "commands": [{"identifier": 5}], "canOfferSessionApproval": true}));
        assert_eq!(session(&odd), once);

        let write = |offered: bool| {
            req(json!({"kind": "write", "fileName": "/srv/a", "canOfferSessionApproval": offered}))
        };
        assert_eq!(
            session(&write(true)),
            json!({"kind": "approve-for-session", "approval": {"kind": "write"}})
        );
        assert_eq!(session(&write(false)), once);
        assert_eq!(
            session(&req(json!({"kind": "read", "path": "/etc/hostname"}))),
            json!({"kind": "approve-for-session", "approval": {"kind": "read"}})
        );
        assert_eq!(
            session(&req(
                json!({"kind": "mcp", "serverName": "gh", "toolName": "search"})
            )),
            json!({"kind": "approve-for-session",
                   "approval": {"kind": "mcp", "serverName": "gh", "toolName": "search"}})
        );
        // Never the whole server: no tool name, no session approval.
        assert_eq!(
            session(&req(json!({"kind": "mcp", "serverName": "gh"}))),
            once
        );
        assert_eq!(
            session(&req(json!({"kind": "custom-tool", "toolName": "lookup"}))),
            json!({"kind": "approve-for-session",
                   "approval": {"kind": "custom-tool", "toolName": "lookup"}})
        );
        assert_eq!(
            session(&req(json!({"kind": "memory", "action": "store"}))),
            json!({"kind": "approve-for-session", "approval": {"kind": "memory"}})
        );
        // A url: its origin, port included (a bare host is taken as https by the runtime).
        assert_eq!(
            session(&req(
                json!({"kind": "url", "url": "http://127.0.0.1:9/a?b"})
            )),
            json!({"kind": "approve-for-session", "domain": "http://127.0.0.1:9"})
        );
        assert_eq!(
            session(&req(json!({"kind": "url", "url": "https://Docs.rs/serde"}))),
            json!({"kind": "approve-for-session", "domain": "https://docs.rs"})
        );
        assert_eq!(
            session(&req(json!({"kind": "url", "url": "not a url"}))),
            once
        );
        assert_eq!(
            session(&req(json!({"kind": "url", "url": "data:text/plain,x"}))),
            once
        );
        // Kinds with nothing to remember are approved once.
        assert_eq!(
            session(&req(json!({"kind": "hook", "toolName": "bash"}))),
            once
        );
        assert_eq!(session(&req(json!({}))), once);

        // Without the request there is nothing to name: approve-once. Other decisions are
        // the same whatever the request.
        assert_eq!(PermissionDecision::ApproveForSession.to_wire(), once);
        assert_eq!(PermissionDecision::Approve.to_wire_for(&write(true)), once);
        assert_eq!(
            reject("no").to_wire_for(&write(true)),
            json!({"kind": "reject", "feedback": "no"})
        );
    }

    #[test]
    fn an_approve_for_session_rule_matches_as_narrowly_as_an_approve_rule() {
        let for_session = |pattern: &str| {
            RulePolicy::new(vec![Rule {
                command: Some(pattern.into()),
                path: None,
                ..rule("*", PermissionDecision::ApproveForSession)
            }])
        };
        let policy = for_session("echo *");
        assert_eq!(
            policy.decide_now(&shell("echo hi")),
            PermissionDecision::ApproveForSession
        );
        // As an allow rule: every simple command must match, not any.
        assert!(!policy.decide_now(&shell("echo hi; rm -rf /")).approves());
        assert!(!policy.decide_now(&shell("echo $(rm -rf /)")).approves());
        let paths = RulePolicy::new(vec![Rule {
            path: Some("/srv/*".into()),
            ..rule("write", PermissionDecision::ApproveForSession)
        }]);
        assert!(
            !paths
                .decide_now(&write(&["/srv/a", "/etc/passwd"]))
                .approves()
        );
        assert!(paths.decide_now(&write(&["/srv/a", "/srv/b"])).approves());
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

    fn write(paths: &[&str]) -> PermissionRequest {
        req(json!({"kind": "write", "paths": paths}))
    }

    fn allow_paths(pattern: &str) -> RulePolicy {
        RulePolicy::new(vec![Rule {
            path: Some(pattern.into()),
            ..rule("*", PermissionDecision::Approve)
        }])
    }

    fn allow_commands(pattern: &str) -> RulePolicy {
        RulePolicy::new(vec![Rule {
            command: Some(pattern.into()),
            ..rule("shell", PermissionDecision::Approve)
        }])
    }

    fn approves(policy: &RulePolicy, request: &PermissionRequest) -> bool {
        policy.decide_now(request) == PermissionDecision::Approve
    }

    #[test]
    fn an_allow_path_rule_approves_only_when_every_path_matches() {
        let policy = allow_paths("/srv/*");
        assert!(!approves(&policy, &write(&["/etc/passwd", "/srv/a/b.rs"])));
        assert!(!approves(&policy, &write(&["/srv/a/b.rs", "/etc/passwd"])));
        assert!(approves(&policy, &write(&["/srv/a/b.rs", "/srv/c.rs"])));
        assert!(!approves(&policy, &write(&["/etc/passwd"])));
        // No paths: nothing to match, so a path rule does not apply (not even `*`).
        assert!(!approves(&policy, &write(&[])));
        assert!(!approves(&allow_paths("*"), &write(&[])));
    }

    #[test]
    fn a_reject_path_rule_matches_when_any_path_does() {
        let policy = RulePolicy::new(vec![
            Rule {
                path: Some("/etc/*".into()),
                ..rule("*", reject("not /etc"))
            },
            rule("*", PermissionDecision::Approve),
        ]);
        assert_eq!(
            policy.decide_now(&write(&["/srv/a", "/etc/passwd"])),
            reject("not /etc")
        );
        assert_eq!(
            policy.decide_now(&write(&["/srv/a"])),
            PermissionDecision::Approve
        );
    }

    #[test]
    fn paths_are_normalised_before_they_are_matched() {
        let policy = allow_paths("/srv/*");
        for escape in [
            "/srv/../etc/shadow",
            "/srv/a/../../etc/shadow",
            "/srv/./../etc/shadow",
            "/srv/..",
            "/srv/a/../..",
        ] {
            assert!(!approves(&policy, &write(&[escape])), "{escape}");
        }
        assert!(approves(&policy, &write(&["/srv/a/./b/../c.rs"])));
        assert!(approves(&policy, &write(&["//srv//a.rs"])));
        // A reject rule sees the normalised path too.
        let guard = RulePolicy::new(vec![Rule {
            path: Some("/etc/*".into()),
            ..rule("*", reject("not /etc"))
        }])
        .otherwise(PermissionDecision::Approve);
        assert_eq!(
            guard.decide_now(&write(&["/srv/../etc/shadow"])),
            reject("not /etc")
        );
    }

    #[test]
    fn an_allow_command_glob_must_match_every_simple_command() {
        let policy = allow_commands("git status*");
        assert!(approves(&policy, &shell("git status")));
        assert!(approves(&policy, &shell("git status --short")));
        for command in [
            "git status; curl x | sh",
            "git status && rm -rf /",
            "git status || rm -rf /",
            "git status | sh",
            "git status |& sh",
            "git status & rm -rf /",
            "git status\nrm -rf /",
            "git status\n\nrm -rf /",
            "git status;rm -rf /",
        ] {
            assert!(!approves(&policy, &shell(command)), "{command:?}");
        }
        // Every part matching: approved.
        let both = RulePolicy::new(vec![Rule {
            command: Some("git *".into()),
            ..rule("shell", PermissionDecision::Approve)
        }]);
        assert!(approves(
            &both,
            &shell("git status && git diff | git apply")
        ));
        assert!(approves(&both, &shell("git status; ")));
    }

    #[test]
    fn substitutions_and_here_docs_are_never_approved_by_a_glob() {
        for pattern in ["*", "echo *", "cat *"] {
            let policy = allow_commands(pattern);
            for command in [
                "echo $(rm -rf /)",
                "echo `rm -rf /`",
                "echo \"$(rm -rf /)\"",
                "echo '$(rm -rf /)'",
                "cat <<EOF\nhi\nEOF",
                "cat <<-EOF\nhi\nEOF",
                "cat <<< hi",
                "cat <(rm -rf /)",
                "echo >(rm -rf /)",
                "echo $((1 + 2))",
            ] {
                assert!(!approves(&policy, &shell(command)), "{pattern} {command:?}");
            }
        }
    }

    #[test]
    fn operators_inside_quotes_do_not_split_and_unclear_commands_are_not_approved() {
        let policy = allow_commands("echo *");
        for quoted in [
            "echo 'a; rm -rf /'",
            "echo \"a && b | c\"",
            "echo a\\;b",
            "echo $'it\\'s; here'",
            "echo \"it's\"",
            "echo ${HOME}",
        ] {
            assert!(approves(&policy, &shell(quoted)), "{quoted:?}");
        }
        for unclear in [
            // Unterminated quotes and a trailing escape.
            "echo 'a; rm -rf /",
            "echo \"a; rm -rf /",
            "echo a\\",
            // ANSI-C quoting: `\'` does not close it, so the next lines are commands.
            "echo $'\\''\nrm -rf /\necho '",
            "echo $'\\'' ; rm -rf / ; echo ''",
            // Subshells, groups run commands that must match too.
            "(rm -rf /)",
            "echo a; (rm -rf /)",
            "echo a; { rm -rf /; }",
            // Parameter expansions that hide quotes or operators.
            "echo ${x:-'a;b'}; rm -rf /",
            "echo \"${x:-\"}\"; rm -rf /; echo \"\"",
        ] {
            assert!(!approves(&policy, &shell(unclear)), "{unclear:?}");
        }
    }

    #[test]
    fn comments_end_at_the_line_and_hide_nothing() {
        let policy = allow_commands("echo *");
        assert!(approves(&policy, &shell("echo hi # a comment; rm -rf /")));
        assert!(approves(&policy, &shell("echo hi;# rm -rf /")));
        // A quote inside a comment opens nothing: the next line is a command.
        assert!(!approves(&policy, &shell("echo hi # it's\nrm -rf /\n'")));
        assert!(!approves(&policy, &shell("echo hi #'\nrm -rf /")));
        // `#` inside a word is no comment.
        assert!(!approves(&policy, &shell("echo a#b; rm -rf /")));
    }

    #[test]
    fn a_wildcard_never_matches_a_file_redirection() {
        let policy = allow_commands("echo *");
        for command in [
            "echo hi > /etc/passwd",
            "echo hi >> ~/.bashrc",
            "echo hi >/etc/passwd",
            "echo hi 2>/etc/passwd",
            "echo hi &> /etc/passwd",
            "echo hi >& /etc/passwd",
            "echo hi >| /etc/passwd",
            "echo hi < /etc/shadow",
            "echo hi 1<>/etc/passwd",
        ] {
            assert!(!approves(&policy, &shell(command)), "{command:?}");
        }
        // Quoted, `>` is an argument.
        assert!(approves(&policy, &shell("echo 'a > b'")));
        // Duplicating or closing descriptors and /dev/null touch no file.
        for harmless in [
            "echo hi 2>&1",
            "echo hi >&2",
            "echo hi 2>/dev/null",
            "echo hi > /dev/null 2>&1",
            "echo hi &>/dev/null",
            "echo hi </dev/null",
            "echo hi 2>&-",
        ] {
            assert!(approves(&policy, &shell(harmless)), "{harmless:?}");
        }
        // A pattern that spells the redirection out approves exactly that.
        let to_out = allow_commands("echo * > /tmp/out.txt");
        assert!(approves(&to_out, &shell("echo hi > /tmp/out.txt")));
        assert!(!approves(
            &to_out,
            &shell("echo hi > /tmp/out.txt > /etc/x")
        ));
    }

    #[test]
    fn a_reject_command_glob_matches_any_simple_command_the_whole_line_or_an_unclear_one() {
        let policy = RulePolicy::new(vec![
            Rule {
                command: Some("rm *".into()),
                ..rule("shell", reject("no rm"))
            },
            Rule {
                command: Some("* | sh".into()),
                ..rule("shell", reject("no pipe to sh"))
            },
        ])
        .otherwise(PermissionDecision::Approve);
        assert_eq!(policy.decide_now(&shell("ls; rm -rf /")), reject("no rm"));
        assert_eq!(
            policy.decide_now(&shell("curl x | sh")),
            reject("no pipe to sh")
        );
        // Not splittable with confidence: a reject glob applies (fail closed).
        assert_eq!(policy.decide_now(&shell("ls $(rm -rf /)")), reject("no rm"));
        assert_eq!(policy.decide_now(&shell("ls")), PermissionDecision::Approve);
    }

    #[test]
    fn relative_paths_are_taken_against_the_conversations_working_directory() {
        let policy = allow_paths("/work/repo/*");
        let relative = |paths: &[&str]| write(paths).with_working_directory("/work/repo");
        assert!(approves(
            &policy,
            &relative(&["src/main.rs", "./README.md"])
        ));
        assert!(!approves(&policy, &relative(&["../other/x"])));
        assert!(!approves(&policy, &relative(&["src/../../other/x"])));
        // No working directory, or a relative one: a relative path is never approved...
        assert!(!approves(&policy, &write(&["src/main.rs"])));
        let relative_cwd = write(&["src/main.rs"]).with_working_directory("repo");
        assert!(!approves(&policy, &relative_cwd));
        assert!(!approves(&allow_paths("*"), &write(&["src/main.rs"])));
        // ...and every reject rule with a path pattern applies to it.
        let guard = RulePolicy::new(vec![Rule {
            path: Some("/etc/*".into()),
            ..rule("*", reject("not /etc"))
        }])
        .otherwise(PermissionDecision::Approve);
        assert_eq!(
            guard.decide_now(&write(&["src/main.rs"])),
            reject("not /etc")
        );
        assert_eq!(
            guard.decide_now(&relative(&["src/main.rs"])),
            PermissionDecision::Approve
        );
        assert_eq!(
            guard.decide_now(&write(&["../../etc/passwd"]).with_working_directory("/work/repo")),
            reject("not /etc")
        );
    }

    fn bare_word() -> impl Strategy<Value = String> {
        "[a-z0-9./_-]{1,6}"
    }

    /// A simple command: a name, then words (bare, quoted, escaped) and redirections.
    fn simple_command(names: Vec<&'static str>) -> impl Strategy<Value = String> {
        let argument = prop_oneof![
            bare_word(),
            "'[a-z ;&|#<>()\"]{0,6}'",
            "\"[a-z ;&|#<>()']{0,6}\"",
            prop::sample::select(vec!["\\;", "\\&", "\\|", "2>&1", ">/dev/null", "> /tmp/x"])
                .prop_map(str::to_owned),
        ];
        (
            prop::sample::select(names),
            prop::collection::vec(argument, 0..4),
        )
            .prop_map(|(name, args)| {
                std::iter::once(name.to_owned())
                    .chain(args)
                    .collect::<Vec<_>>()
                    .join(" ")
            })
    }

    fn operator() -> impl Strategy<Value = &'static str> {
        prop::sample::select(vec![
            ";", " ; ", "&&", " && ", "||", "|", " | ", "|&", "&", " & ", "\n", ";\n",
        ])
    }

    fn join(first: &str, rest: &[(&str, String)]) -> String {
        let mut line = first.to_owned();
        for (op, command) in rest {
            line.push_str(op);
            line.push_str(command);
        }
        line
    }

    const PATTERNS: [&str; 5] = ["echo *", "git status*", "*", "echo * > /tmp/x", "rm *"];

    fn path_component() -> impl Strategy<Value = &'static str> {
        prop::sample::select(vec!["a", "b", "srv", ".", "..", "", "etc"])
    }

    /// The glob by its definition, by brute force: the reference for [`glob_match_chars`].
    fn glob_reference(p: &[char], t: &[shell::Char]) -> bool {
        match p.split_first() {
            None => t.is_empty(),
            Some(('*', rest)) => (0..=t.len())
                .any(|k| t[..k].iter().all(|c| c.wild) && glob_reference(rest, &t[k..])),
            Some((&c, rest)) => t.split_first().is_some_and(|(first, tail)| {
                (if c == '?' { first.wild } else { first.ch == c }) && glob_reference(rest, tail)
            }),
        }
    }

    proptest! {
        /// `git status*` never approves a line where an operator is followed by a command
        /// that does not match it.
        #[test]
        fn an_allow_glob_never_approves_an_operator_followed_by_a_non_matching_command(
            first in simple_command(vec!["git status", "git status --short"]),
            op in operator(),
            other in simple_command(vec!["echo", "rm", "curl", "sh", "git", "gitstatus"]),
            tail in prop::collection::vec((operator(), simple_command(vec!["git status"])), 0..3),
        ) {
            let policy = allow_commands("git status*");
            let mut rest = vec![(op, other)];
            rest.extend(tail);
            let line = join(&first, &rest);
            prop_assert!(!approves(&policy, &shell(&line)), "{:?}", line);
        }

        /// A line is approved exactly when each of its simple commands alone is; a reject
        /// rule that matches one of them matches the line.
        #[test]
        fn a_line_is_approved_exactly_when_every_simple_command_is(
            first in simple_command(vec!["echo", "git status", "rm"]),
            rest in prop::collection::vec(
                (operator(), simple_command(vec!["echo", "git status", "rm"])),
                0..4,
            ),
        ) {
            let line = join(&first, &rest);
            let commands: Vec<&String> =
                std::iter::once(&first).chain(rest.iter().map(|(_, c)| c)).collect();
            for pattern in PATTERNS {
                let allow = allow_commands(pattern);
                let each = commands.iter().all(|c| approves(&allow, &shell(c)));
                prop_assert_eq!(approves(&allow, &shell(&line)), each, "{} {:?}", pattern, line);
                let deny = RulePolicy::new(vec![Rule {
                    command: Some(pattern.into()),
                    ..rule("shell", reject("no"))
                }])
                .otherwise(PermissionDecision::Approve);
                let denied = |l: &str| deny.decide_now(&shell(l)) != PermissionDecision::Approve;
                if commands.iter().any(|c| denied(c)) {
                    prop_assert!(denied(&line), "{} {:?}", pattern, line);
                }
            }
        }

        /// Whatever the line: a glob that approves it also rejects it as a reject rule, and a
        /// line with a substitution or a here-document is approved by no glob.
        #[test]
        fn allow_implies_reject_and_substitutions_are_never_approved(
            line in "[a ;&|<>()'\"\\\\$`{}#\n21@/*-]{0,30}",
        ) {
            for pattern in PATTERNS {
                let allow = allow_commands(pattern);
                let deny = RulePolicy::new(vec![Rule {
                    command: Some(pattern.into()),
                    ..rule("shell", reject("no"))
                }])
                .otherwise(PermissionDecision::Approve);
                if approves(&allow, &shell(&line)) {
                    prop_assert!(!approves(&deny, &shell(&line)), "{} {:?}", pattern, line);
                    prop_assert!(!line.contains("$(") && !line.contains('`') && !line.contains("<<"));
                }
            }
        }

        /// A path that climbs out of `/srv` with `..` is never approved by `/srv/*`; one that
        /// climbs less stays inside and is.
        #[test]
        fn a_path_escaping_the_allowed_prefix_is_never_approved(
            inside in prop::collection::vec(prop::sample::select(vec!["a", "b", "srv"]), 0..4),
            extra in 0usize..3,
            noise in prop::collection::vec(prop::sample::select(vec![".", ""]), 0..3),
            tail in prop::collection::vec(prop::sample::select(vec!["etc", "passwd", "a"]), 1..3),
        ) {
            let policy = allow_paths("/srv/*");
            let climb = |n: usize| {
                let mut parts: Vec<&str> = vec!["", "srv"];
                parts.extend(&inside);
                parts.extend(&noise);
                parts.extend(std::iter::repeat_n("..", n));
                parts.extend(&tail);
                parts.join("/")
            };
            let escape = climb(inside.len() + 1 + extra);
            prop_assert!(!approves(&policy, &write(&[&escape])), "{}", escape);
            let stay = climb(inside.len());
            prop_assert!(approves(&policy, &write(&[&stay])), "{}", stay);
            // Taken against a working directory inside /srv, the same climb escapes too.
            let relative = escape.trim_start_matches("/srv/");
            let from_srv = write(&[relative]).with_working_directory("/srv");
            prop_assert!(!approves(&policy, &from_srv), "{}", relative);
        }

        /// The glob agrees with its definition, marks included: wildcards match only wild
        /// characters, literals match their own character whatever its mark.
        #[test]
        fn the_glob_matches_by_its_definition(
            pattern in "[ab>*?]{0,8}",
            text in prop::collection::vec(
                (prop::sample::select(vec!['a', 'b', '>', '*']), any::<bool>()),
                0..10,
            ),
        ) {
            let text: Vec<shell::Char> =
                text.into_iter().map(|(ch, wild)| shell::Char { ch, wild }).collect();
            let p: Vec<char> = pattern.chars().collect();
            prop_assert_eq!(glob_match_chars(&pattern, &text), glob_reference(&p, &text));
            let plain: String = text.iter().map(|c| c.ch).collect();
            let all_wild: Vec<shell::Char> =
                text.iter().map(|c| shell::Char { ch: c.ch, wild: true }).collect();
            prop_assert_eq!(glob_match(&pattern, &plain), glob_reference(&p, &all_wild));
        }

        /// Approving several paths implies approving each alone, and the other way round; a
        /// reject rule matches several paths exactly when it matches one of them.
        #[test]
        fn several_paths_are_approved_exactly_when_each_is(
            paths in prop::collection::vec(
                (any::<bool>(), prop::collection::vec(path_component(), 0..5))
                    .prop_map(|(abs, parts)| format!("{}{}", if abs { "/" } else { "" }, parts.join("/"))),
                1..5,
            ),
            cwd in prop::option::of(prop::sample::select(vec!["/srv", "/srv/a", "/", "/etc", "srv"])),
        ) {
            let request = |paths: &[&str]| {
                let r = write(paths);
                match cwd {
                    Some(dir) => r.with_working_directory(dir),
                    None => r,
                }
            };
            let all: Vec<&str> = paths.iter().map(String::as_str).collect();
            for pattern in ["/srv/*", "/srv/a*", "*", "/etc/*"] {
                let allow = allow_paths(pattern);
                let each = all.iter().all(|p| approves(&allow, &request(&[p])));
                prop_assert_eq!(approves(&allow, &request(&all)), each, "{} {:?}", pattern, all);
                let deny = RulePolicy::new(vec![Rule {
                    path: Some(pattern.into()),
                    ..rule("*", reject("no"))
                }])
                .otherwise(PermissionDecision::Approve);
                let denied = |r: &PermissionRequest| !approves(&deny, r);
                let any = all.iter().any(|p| denied(&request(&[p])));
                prop_assert_eq!(denied(&request(&all)), any, "{} {:?}", pattern, all);
            }
        }
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
