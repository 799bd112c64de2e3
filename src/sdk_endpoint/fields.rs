//! Which session fields an SDK client may set through the endpoint (pure: a call's params
//! in, the first field refused out). The runtime takes more than the SDKs offer (its own
//! shell's init scripts, plugins by host path, other model endpoints), and every release adds
//! some, so the endpoint passes on the fields it lists, not everything it does not refuse:
//!
//! * `session.create` and `session.resume`: the fields the official SDKs send
//!   ([`OPEN_FIELDS`], those of the Node SDK 1.0.14 and the Python SDK 1.0.27 the tests drive);
//! * `session.options.update`: what the SDKs' "empty" mode sends after an open, and the
//!   session's own settings ([`UPDATE_FIELDS`]);
//! * on all three, [`REFUSED`] fields are refused set (anything but absent, `null`, `false`,
//!   `[]` for a list, `"off"` for `remoteSession`), each with what to do instead;
//! * any other field is refused unless absent or `null`;
//! * on create and resume without `allow_local_mcp_servers`, the connection also refuses
//!   the fields that run commands from files ([`local_command_source`]) (left unset, the
//!   pool turns file hooks off: `pool::without_command_files`).
//!
//! A field named here is passed on as the client wrote it, except the paths, which
//! `confine` confines ([`crate::confine::confine_session_directories`]).

use serde_json::{Map, Value};

/// `session.create`/`session.resume` fields passed on (besides `sessionId`).
const OPEN_FIELDS: &[&str] = &[
    "additionalDirectories",
    "agent",
    "agentDirectories",
    "allowTranscriptRecovery",
    "askUserVariant",
    "authClientIdMetadataUrl",
    "autopilot",
    "availableTools",
    "canvasProvider",
    "canvases",
    "clientName",
    "commands",
    "contextTier",
    "continuePendingWork",
    "customAgents",
    "customAgentsLocalOnly",
    "defaultAgent",
    "diagnostics",
    "disableResume",
    "disabledMcpServers",
    "disabledSkills",
    "embeddingCacheStorage",
    "enableCitations",
    "enableConfigDiscovery",
    "enableFileChangeTracking",
    "enableFileHooks",
    "enableGitHubTelemetryForwarding",
    "enableHostGitOperations",
    "enableManagedSettings",
    "enableOnDemandInstructionDiscovery",
    "enableSessionStore",
    "enableSessionTelemetry",
    "enableSkills",
    "enforceManagedModelDefaults",
    "envValueMode",
    "excludedBuiltinAgents",
    "excludedManagedSettings",
    "excludedTools",
    "expAssignments",
    "extensionInfo",
    "featureFlags",
    "gitHubToken",
    "githubMcpToolConfig",
    "hasSkillProvider",
    "hookDirectories",
    "hooks",
    "imageGeneration",
    "includeSubAgentStreamingEvents",
    "infiniteSessions",
    "instructionDirectories",
    "interactiveUser",
    "isExperimentalMode",
    "largeOutput",
    "managedSettings",
    "mcpOAuthTokenStorage",
    "mcpServers",
    "memory",
    "model",
    "modelCapabilities",
    "name",
    "openCanvases",
    "organizationCustomInstructions",
    "pluginDirectories",
    "provider",
    "reasoningEffort",
    "reasoningSummary",
    "refreshCustomInstructions",
    "requestAutoModeSwitch",
    "requestCanvasRenderer",
    "requestElicitation",
    "requestExitPlanMode",
    "requestExtensions",
    "requestMcpApps",
    "requestPermission",
    "requestUserInput",
    "sessionLimits",
    "skillDirectories",
    "skipEmbeddingRetrieval",
    "streaming",
    "systemMessage",
    "toolFilterPrecedence",
    "toolSearch",
    "tools",
    // W3C trace context, when the client's telemetry gives one.
    "traceparent",
    "tracestate",
    "trustWorkingDirectory",
    "workingDirectory",
];

/// `session.options.update` fields passed on (besides `sessionId`): the SDKs' own patch
/// after an open, the session's directories (confined), tools, skills, instructions and
/// limits. Not the model (`session.model.switchTo`, which the endpoint carries to the next
/// process), the provider or endpoints, nor the runtime's shell.
const UPDATE_FIELDS: &[&str] = &[
    "additionalContentExclusionPolicies",
    "additionalDirectories",
    "askUserDisabled",
    "availableTools",
    "coauthorEnabled",
    "continueOnAutoMode",
    "customAgentsLocalOnly",
    "disabledInstructionSources",
    "disabledMcpServers",
    "disabledSkills",
    "enableCitations",
    "enableOnDemandInstructionDiscovery",
    "enableSkills",
    "enableStreaming",
    "eventsLogDirectory",
    "eventsLogIncludesSubagents",
    "excludedBuiltinAgents",
    "excludedTools",
    "includedBuiltinAgents",
    "includedBuiltinSkills",
    "maxInlineBinaryBytes",
    "memory",
    "refreshCustomInstructions",
    "sessionLimits",
    "skillDirectories",
    "skipCustomInstructions",
    "trajectoryFile",
    "workingDirectory",
];

/// Fields refused set, on create, resume and update: providers and endpoints besides the
/// session's one `provider` (their credentials would reach the child outside the guard), a
/// bearer-token provider whose token the runtime would ask the client for, another GitHub
/// identity than the session's `gitHubToken`, the agent's config directory, scheduled turns,
/// code or commands from the daemon's host (extensions, installed plugins, the shell's init
/// scripts and flags), sessions run or steered from elsewhere (`cloud`, `remoteSession` other
/// than `"off"`), and the runtime's own sandbox settings (its credential helpers are the
/// daemon host's).
const REFUSED: &[&str] = &[
    "providers",
    "models",
    "capi",
    "copilotUrl",
    "hasBearerTokenProvider",
    "configDir",
    "gitHubTokenProviderRegistrationId",
    "authInfo",
    "manageScheduleEnabled",
    "extensionSdkPath",
    "installedPlugins",
    "shell",
    "shellInitProfile",
    "shellProcessFlags",
    "cloud",
    "remoteSession",
    "sandboxConfig",
];

/// `session.send` fields passed on (besides `sessionId`): what the official SDKs send (the
/// prompt, its display text, attachments, modes, the message's source, per-turn model request
/// headers, which the guarded model path filters as any, and trace context) and the message's
/// own shape (`prepend`, `responseFormat`, `requiredTool`).
const SEND_FIELDS: &[&str] = &[
    "prompt",
    "displayPrompt",
    "attachments",
    "mode",
    "agentMode",
    "source",
    "requestHeaders",
    "traceparent",
    "tracestate",
    "prepend",
    "responseFormat",
    "requiredTool",
];

/// Fields checked for being set that are lists: `[]` turns them off.
const LIST_FIELDS: &[&str] = &[
    "providers",
    "models",
    "installedPlugins",
    "shellProcessFlags",
    "hookDirectories",
    "pluginDirectories",
    "agentDirectories",
];

/// What to do instead of setting one of [`REFUSED`]; `None` for the model endpoints and
/// providers, whose reason is the caller's (the guarded model path).
pub(super) fn refused_because(field: &str) -> Option<&'static str> {
    match field {
        "configDir" => Some("every agent has its own COPILOT_HOME, chosen by the pool"),
        "manageScheduleEnabled" => Some(
            "scheduled turns would run outside the turns the pool supervises; schedule them \
             from the gateway, each a session.send",
        ),
        "gitHubTokenProviderRegistrationId" | "authInfo" => Some(
            "give the session its own GitHub identity with `gitHubToken` (the pool runs it on \
             processes of that token)",
        ),
        "extensionSdkPath" | "installedPlugins" => Some(
            "it loads code from a path on the daemon's host; give plugins as \
             pluginDirectories inside the agent's work directory or an allowed root",
        ),
        "shell" | "shellInitProfile" | "shellProcessFlags" => Some(
            "the agent's shell would run the daemon host's init scripts or flags; the pool \
             starts the runtime's shell as it is",
        ),
        "cloud" | "remoteSession" => Some(
            "its turns would run or be steered outside the pool (in the cloud, from \
             github.com), where no lease supervises them; run them through the pool",
        ),
        "wait" => Some(
            "the endpoint answers a send at once and streams the turn's events, as the SDKs \
             expect (a send held to the turn's end would outlast the call's time limit); wait \
             for session.idle instead",
        ),
        "sandboxConfig" => Some(
            "the runtime's sandbox would reach the daemon host's credential helpers; the pool \
             sandboxes every worker itself (its [sandbox] settings)",
        ),
        _ => None,
    }
}

/// Why a call's params were refused.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Refusal {
    /// One of [`REFUSED`], set.
    Refused(&'static str),
    /// A field not on the method's list.
    Unknown(String),
}

impl Refusal {
    /// The message of the call's invalid-params error.
    pub(super) fn message(&self, method: &str) -> String {
        match self {
            Refusal::Refused(field) => format!(
                "{field} is not accepted through copilot-pool (in {method}): {}",
                refused_because(field).unwrap_or(
                    "a session's one model endpoint is the `provider` it is created with, \
                     which the pool serves through its guarded model path"
                )
            ),
            Refusal::Unknown(field) => format!(
                "{field} is not a {method} field copilot-pool passes on: it passes the session \
                 fields the official SDKs send (Node 1.0.14, Python 1.0.27) and refuses others, \
                 which may reach past the agent's directories; remove it, or ask for it to be \
                 added"
            ),
        }
    }
}

/// The first field of a `session.create`/`session.resume` refused.
pub(super) fn check_open(params: &Map<String, Value>) -> Result<(), Refusal> {
    check(params, OPEN_FIELDS)
}

/// The first field of a `session.options.update` refused (a session's `provider` is the one
/// it was created with).
pub(super) fn check_update(params: &Map<String, Value>) -> Result<(), Refusal> {
    if params.get("provider").is_some_and(|v| !v.is_null()) {
        return Err(Refusal::Refused("provider"));
    }
    check(params, UPDATE_FIELDS)
}

/// The first field of a `session.send` refused: `wait` set, or a field not in
/// [`SEND_FIELDS`] (`billable` among them: a message's billing is the runtime's to decide).
pub(super) fn check_send(params: &Map<String, Value>) -> Result<(), Refusal> {
    if params.get("wait").is_some_and(|v| is_set("wait", v)) {
        return Err(Refusal::Refused("wait"));
    }
    match params.iter().find(|(name, value)| {
        *name != "sessionId"
            && *name != "wait"
            && !value.is_null()
            && !SEND_FIELDS.contains(&name.as_str())
    }) {
        Some((name, _)) => Err(Refusal::Unknown(name.clone())),
        None => Ok(()),
    }
}

fn check(params: &Map<String, Value>, passed: &[&str]) -> Result<(), Refusal> {
    if let Some(field) = REFUSED
        .iter()
        .find(|f| params.get(**f).is_some_and(|v| is_set(f, v)))
    {
        return Err(Refusal::Refused(field));
    }
    match params.iter().find(|(name, value)| {
        *name != "sessionId"
            && !value.is_null()
            && !passed.contains(&name.as_str())
            && !REFUSED.contains(&name.as_str())
    }) {
        Some((name, _)) => Err(Refusal::Unknown(name.clone())),
        None => Ok(()),
    }
}

/// Session fields that have the runtime run commands from files in the agent's directories
/// (hooks from `.github/hooks/` or named directories, configuration it discovers there,
/// plugins and custom agent files, which may bring hooks and name local MCP servers).
const LOCAL_COMMAND_FIELDS: &[&str] = &[
    "agentDirectories",
    "enableConfigDiscovery",
    "enableFileHooks",
    "hookDirectories",
    "pluginDirectories",
];

/// The first field of a create or resume that would start local commands from files: refused
/// where the daemon does not allow local commands (`allow_local_mcp_servers`), as an
/// `mcpServers` entry that starts one is.
pub(super) fn local_command_source(params: &Map<String, Value>) -> Option<&'static str> {
    LOCAL_COMMAND_FIELDS
        .iter()
        .copied()
        .find(|field| params.get(*field).is_some_and(|v| is_set(field, v)))
}

/// Whether a field checked for being set ([`REFUSED`], [`LOCAL_COMMAND_FIELDS`]) is set:
/// anything but `null`, `false`, `[]` for a list (which
/// the SDKs send to turn a feature off: `manageScheduleEnabled: false`, `installedPlugins:
/// []`) and `remoteSession: "off"`.
fn is_set(field: &str, value: &Value) -> bool {
    match value {
        Value::Null | Value::Bool(false) => false,
        Value::Array(items) if LIST_FIELDS.contains(&field) => !items.is_empty(),
        Value::String(mode) if field == "remoteSession" => mode != "off",
        _ => true,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn map(value: Value) -> Map<String, Value> {
        value.as_object().cloned().unwrap_or_default()
    }

    #[test]
    fn what_the_sdks_send_on_open_and_after_it_passes() {
        let open = map(json!({
            "sessionId": "s", "model": "m", "requestPermission": true, "hooks": false,
            "envValueMode": "direct", "includeSubAgentStreamingEvents": true,
            "hookDirectories": ["/w/hooks"], "largeOutput": {"outputDir": "/w/out"},
            "installedPlugins": [], "manageScheduleEnabled": false, "configDir": null,
        }));
        assert_eq!(check_open(&open), Ok(()));
        let empty_mode = map(json!({
            "sessionId": "s", "skipCustomInstructions": true, "customAgentsLocalOnly": true,
            "coauthorEnabled": false, "manageScheduleEnabled": false, "installedPlugins": [],
            "includedBuiltinSkills": [],
        }));
        assert_eq!(check_update(&empty_mode), Ok(()));
    }

    #[test]
    fn hooks_discovered_configuration_plugins_and_agent_files_are_sources_of_local_commands_when_set()
     {
        assert_eq!(
            local_command_source(&map(
                json!({"enableFileHooks": false, "hookDirectories": [],
                                              "enableConfigDiscovery": null})
            )),
            None
        );
        for field in ["enableConfigDiscovery", "enableFileHooks"] {
            assert_eq!(
                local_command_source(&map(json!({field: true}))),
                Some(field)
            );
        }
        for field in ["hookDirectories", "pluginDirectories", "agentDirectories"] {
            assert_eq!(local_command_source(&map(json!({field: []}))), None);
            assert_eq!(
                local_command_source(&map(json!({field: ["/w/dir"]}))),
                Some(field)
            );
        }
    }

    #[test]
    fn a_send_passes_what_the_sdks_send_and_refuses_a_held_answer_and_unlisted_fields() {
        // What the Node SDK 1.0.14's `send` writes.
        let sdk = map(json!({
            "sessionId": "s", "prompt": "hi", "source": null, "displayPrompt": "hi",
            "attachments": [], "mode": "enqueue", "agentMode": null, "requestHeaders": {},
            "traceparent": "00-abc-def-01", "wait": false,
        }));
        assert_eq!(check_send(&sdk), Ok(()));
        let held = map(json!({"sessionId": "s", "prompt": "hi", "wait": true}));
        assert_eq!(check_send(&held), Err(Refusal::Refused("wait")));
        assert!(
            Refusal::Refused("wait")
                .message("session.send")
                .contains("wait for session.idle"),
        );
        for field in ["billable", "newRuntimeField"] {
            let unlisted = map(json!({"sessionId": "s", "prompt": "hi", field: false}));
            assert_eq!(
                check_send(&unlisted),
                Err(Refusal::Unknown(field.to_owned()))
            );
        }
    }

    #[test]
    fn host_code_other_endpoints_and_unlisted_fields_are_refused_naming_the_field() {
        for (params, refusal) in [
            (
                json!({"extensionSdkPath": "/opt/sdk"}),
                Refusal::Refused("extensionSdkPath"),
            ),
            (
                json!({"installedPlugins": [{"name": "p", "cache_path": "/root/p"}]}),
                Refusal::Refused("installedPlugins"),
            ),
            (
                json!({"copilotUrl": "https://10.0.0.7"}),
                Refusal::Refused("copilotUrl"),
            ),
            (
                json!({"shellProcessFlags": ["-l"]}),
                Refusal::Refused("shellProcessFlags"),
            ),
        ] {
            let params = map(params);
            assert_eq!(check_open(&params).as_ref(), Err(&refusal));
            assert_eq!(check_update(&params), Err(refusal));
        }
        for (params, refusal) in [
            (json!({"cloud": {}}), Refusal::Refused("cloud")),
            (
                json!({"remoteSession": "on"}),
                Refusal::Refused("remoteSession"),
            ),
            (
                json!({"sandboxConfig": {"auth": {"git": true}}}),
                Refusal::Refused("sandboxConfig"),
            ),
            // `[]` turns off a list, not another field.
            (json!({"capi": []}), Refusal::Refused("capi")),
        ] {
            assert_eq!(check_open(&map(params)), Err(refusal));
        }
        assert_eq!(check_open(&map(json!({"remoteSession": "off"}))), Ok(()));
        let shell =
            map(json!({"shell": {"initScripts": [{"path": "/etc/x.sh", "shell": "bash"}]}}));
        assert_eq!(check_update(&shell), Err(Refusal::Refused("shell")));
        let unlisted = map(json!({"sessionId": "s", "agentContext": "x"}));
        let refusal = check_open(&unlisted).expect_err("unlisted");
        assert_eq!(refusal, Refusal::Unknown("agentContext".into()));
        assert!(
            refusal
                .message("session.create")
                .contains("agentContext is not a session.create field")
        );
        // The model changes by session.model.switchTo, which the endpoint carries over.
        let model = map(json!({"model": "other"}));
        assert_eq!(check_update(&model), Err(Refusal::Unknown("model".into())));
    }
}
