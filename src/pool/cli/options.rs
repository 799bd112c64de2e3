//! What a CLI backend's conversation takes of a lease's session options (issue 17, item 2):
//! `systemMessage` in mode `append` becomes the CLI's system prompt, passed by the
//! backend's own route (`systemPromptArg`, `systemPromptFileArg`,
//! `systemPromptFileConfigArg`+`Key`, when `systemPromptWhen` says). Every other option is
//! the Copilot runtime's and is refused with what to do instead, never dropped silently.
//! Pure: the request's options in, the prompt or the refusal out.

use crate::backend::{CliBackendConfig, SystemPromptWhen};
use crate::pool::PoolError;
use crate::session_options::SessionOptions;

/// Whether `config` gives its CLI a system prompt: a route, and a `systemPromptWhen` other
/// than `never`.
fn has_route(config: &CliBackendConfig) -> bool {
    let route = config.system_prompt_arg.is_some()
        || config.system_prompt_file_arg.is_some()
        || config.system_prompt_file_config_arg.is_some();
    route && config.system_prompt_when != SystemPromptWhen::Never
}

/// The system prompt a lease on CLI backend `backend` (configured as `config`) gives its
/// conversation: the content of `systemMessage` (mode `append` or none). `options` are the
/// lease's after `LeaseRequest::apply_session_options` moved the fields it has its own field
/// for (`model`, `workingDirectory`, `streaming`, `reasoningEffort`, `availableTools`).
/// Refused: `systemMessage` in mode `replace` or `customize`, or for a backend with no
/// system-prompt route, and any session option the Copilot runtime alone knows.
pub(crate) fn system_prompt(
    backend: &str,
    config: &CliBackendConfig,
    options: &SessionOptions,
) -> Result<Option<String>, PoolError> {
    let others: Vec<&str> = options
        .fields()
        .keys()
        .map(String::as_str)
        .filter(|f| *f != "systemMessage")
        .collect();
    if !others.is_empty() {
        return Err(PoolError::InvalidRequest(format!(
            "session option(s) {} are the Copilot runtime's; CLI backend `{backend}` takes only \
             `systemMessage` (mode `append`), `model` and `workingDirectory`: drop the others, or \
             run the conversation on `copilot`",
            others
                .iter()
                .map(|f| format!("`{f}`"))
                .collect::<Vec<_>>()
                .join(", ")
        )));
    }
    let Some(message) = options.get("systemMessage") else {
        return Ok(None);
    };
    let mode = message["mode"].as_str().unwrap_or("append");
    if mode != "append" {
        return Err(PoolError::InvalidRequest(format!(
            "systemMessage mode `{mode}` is the Copilot runtime's; CLI backend `{backend}` adds \
             its system prompt to the CLI's own: use mode `append`, or run the conversation on \
             `copilot`"
        )));
    }
    if !has_route(config) {
        return Err(PoolError::InvalidRequest(format!(
            "CLI backend `{backend}` has no system-prompt route (`systemPromptArg`, \
             `systemPromptFileArg` or `systemPromptFileConfigArg`+`Key`, and `systemPromptWhen` \
             other than `never`): configure one, or put the instructions in the prompt"
        )));
    }
    Ok(message["content"]
        .as_str()
        .filter(|c| !c.trim().is_empty())
        .map(str::to_owned))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pool::LeaseRequest;
    use serde_json::json;

    fn claude() -> CliBackendConfig {
        CliBackendConfig::claude_cli()
    }

    /// A request's options as a lease leaves them: the fields it has its own field for
    /// moved onto it.
    fn request(options: serde_json::Value) -> SessionOptions {
        let mut req = LeaseRequest::new("a", "s", std::path::PathBuf::from("/tmp"));
        let options = SessionOptions::from_value(options).expect("valid options");
        req.apply_session_options(options).expect("applied");
        req.session_options
    }

    #[test]
    fn an_appended_system_message_is_the_clis_system_prompt() {
        let req = request(json!({"systemMessage": {"mode": "append", "content": "Be terse."}}));
        assert_eq!(
            system_prompt("claude-cli", &claude(), &req)
                .expect("taken")
                .as_deref(),
            Some("Be terse.")
        );
        let req = request(json!({"systemMessage": {"content": "No mode."}}));
        assert_eq!(
            system_prompt("codex-cli", &CliBackendConfig::codex_cli(), &req)
                .expect("taken")
                .as_deref(),
            Some("No mode.")
        );
        assert_eq!(
            system_prompt(
                "codex-cli",
                &CliBackendConfig::codex_cli(),
                &request(json!({}))
            )
            .expect("taken"),
            None
        );
    }

    #[test]
    fn options_the_copilot_runtime_alone_knows_are_refused_with_what_to_do() {
        let req = request(json!({"systemMessage": {"mode": "replace", "content": "x"}}));
        let e = system_prompt("claude-cli", &claude(), &req).expect_err("refused");
        assert!(e.to_string().contains("use mode `append`"), "{e}");
        let req = request(json!({"excludedTools": ["bash"]}));
        let e = system_prompt("claude-cli", &claude(), &req).expect_err("refused");
        assert!(
            e.to_string().contains("`excludedTools`") && e.to_string().contains("claude-cli"),
            "{e}"
        );
    }

    #[test]
    fn a_backend_without_a_system_prompt_route_refuses_a_system_message() {
        let req = request(json!({"systemMessage": {"content": "x"}}));
        let gemini = CliBackendConfig::google_gemini_cli();
        let e = system_prompt("google-gemini-cli", &gemini, &req).expect_err("refused");
        assert!(e.to_string().contains("no system-prompt route"), "{e}");
        let mut never = claude();
        never.system_prompt_when = SystemPromptWhen::Never;
        assert!(system_prompt("claude-cli", &never, &req).is_err());
        // Without a system message, no route is needed.
        assert_eq!(
            system_prompt("google-gemini-cli", &gemini, &request(json!({}))).expect("ok"),
            None
        );
    }

    #[test]
    fn options_the_lease_has_fields_for_are_not_refused() {
        let req = request(json!({"streaming": true, "workingDirectory": "/tmp/w"}));
        assert_eq!(
            system_prompt("claude-cli", &claude(), &req).expect("taken"),
            None
        );
    }
}
