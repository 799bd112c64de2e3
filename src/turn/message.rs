//! What one turn sends (`session.send`): the prompt, its attachments (files and directories
//! by absolute path, inline blobs), how it is delivered (`mode`) and the agent mode. A
//! `&str` or a `String` is a message with the prompt alone.

use std::path::Path;

use base64::Engine;

use crate::kinds::{AgentMode, SendMode};
use crate::rpc::messages::{Attachment, LineRange, SendParams};

/// A turn's user message.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Message {
    /// The prompt.
    pub prompt: String,
    /// Sent with the prompt; the runtime reads files and directories itself.
    pub attachments: Vec<Attachment>,
    /// `enqueue` (the runtime's default) or `immediate`.
    pub mode: Option<SendMode>,
    /// The agent mode (default: the session's current mode).
    pub agent_mode: Option<AgentMode>,
}

/// Why a message cannot be sent.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MessageError {
    /// A file or directory attachment's path is not absolute, or not UTF-8.
    #[error(
        "attachment path {0:?} must be absolute and UTF-8 (the runtime reads it as given; resolve it against the conversation's working directory first)"
    )]
    Path(String),
    /// A line range that is empty or starts at 0.
    #[error("line range {start}..={end} is not allowed: lines are 1-based and start <= end")]
    LineRange {
        /// First line.
        start: u32,
        /// Last line.
        end: u32,
    },
    /// A blob whose data is not base64.
    #[error("blob attachment data is not valid base64: {0}")]
    Blob(String),
}

impl Message {
    /// A message with `prompt` alone.
    pub fn new(prompt: impl Into<String>) -> Self {
        Self {
            prompt: prompt.into(),
            ..Default::default()
        }
    }

    /// Adds a file attachment (an absolute path; its file name is shown).
    pub fn with_file(mut self, path: impl AsRef<Path>) -> Self {
        let path = path.as_ref();
        self.attachments.push(Attachment::File {
            path: path.to_string_lossy().into_owned(),
            display_name: display_name(path),
            line_range: None,
        });
        self
    }

    /// Adds a directory attachment (an absolute path).
    pub fn with_directory(mut self, path: impl AsRef<Path>) -> Self {
        let path = path.as_ref();
        self.attachments.push(Attachment::Directory {
            path: path.to_string_lossy().into_owned(),
            display_name: display_name(path),
        });
        self
    }

    /// Adds inline content of media type `mime_type`.
    pub fn with_blob(mut self, bytes: &[u8], mime_type: impl Into<String>) -> Self {
        self.attachments.push(Attachment::Blob {
            data: base64::engine::general_purpose::STANDARD.encode(bytes),
            mime_type: mime_type.into(),
            display_name: None,
        });
        self
    }

    /// Sets the delivery mode.
    pub fn with_mode(mut self, mode: SendMode) -> Self {
        self.mode = Some(mode);
        self
    }

    /// Sets the agent mode.
    pub fn with_agent_mode(mut self, agent_mode: AgentMode) -> Self {
        self.agent_mode = Some(agent_mode);
        self
    }

    /// Checks what the runtime would otherwise refuse mid-turn or misread: paths are
    /// absolute (and were UTF-8), line ranges 1-based and ordered, blobs base64.
    pub fn validate(&self) -> Result<(), MessageError> {
        for attachment in &self.attachments {
            match attachment {
                Attachment::File {
                    path, line_range, ..
                } => {
                    check_path(path)?;
                    if let Some(LineRange { start, end }) = *line_range
                        && (start == 0 || end < start)
                    {
                        return Err(MessageError::LineRange { start, end });
                    }
                }
                Attachment::Directory { path, .. } => check_path(path)?,
                Attachment::Blob { data, .. } => {
                    base64::engine::general_purpose::STANDARD
                        .decode(data)
                        .map_err(|e| MessageError::Blob(e.to_string()))?;
                }
            }
        }
        Ok(())
    }

    /// The `session.send` params (the session id is the session's to fill in).
    pub(crate) fn into_params(self) -> SendParams {
        SendParams {
            session_id: String::new(),
            prompt: self.prompt,
            attachments: self.attachments,
            mode: self.mode,
            agent_mode: self.agent_mode,
        }
    }
}

fn display_name(path: &Path) -> String {
    path.file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| path.to_string_lossy().into_owned())
}

fn check_path(path: &str) -> Result<(), MessageError> {
    // A lossy conversion put U+FFFD where the path was not UTF-8: the runtime would read
    // another file.
    if !Path::new(path).is_absolute() || path.contains(char::REPLACEMENT_CHARACTER) {
        return Err(MessageError::Path(path.to_owned()));
    }
    Ok(())
}

impl From<String> for Message {
    fn from(prompt: String) -> Self {
        Message::new(prompt)
    }
}

impl From<&str> for Message {
    fn from(prompt: &str) -> Self {
        Message::new(prompt)
    }
}

impl From<&String> for Message {
    fn from(prompt: &String) -> Self {
        Message::new(prompt.as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_message_serializes_to_the_runtimes_send_params() {
        let message = Message::new("look")
            .with_file("/work/a/cat.png")
            .with_directory("/work/a/src")
            .with_blob(b"hi", "text/plain")
            .with_mode(SendMode::Immediate)
            .with_agent_mode(AgentMode::Plan);
        message.validate().expect("valid");
        let wire = serde_json::to_value(message.into_params()).expect("json");
        assert_eq!(
            wire,
            serde_json::json!({
                "sessionId": "",
                "prompt": "look",
                "attachments": [
                    {"type": "file", "path": "/work/a/cat.png", "displayName": "cat.png"},
                    {"type": "directory", "path": "/work/a/src", "displayName": "src"},
                    {"type": "blob", "data": "aGk=", "mimeType": "text/plain"},
                ],
                "mode": "immediate",
                "agentMode": "plan",
            })
        );
        // A plain prompt sends none of the optional fields.
        let plain = serde_json::to_value(Message::from("hi").into_params()).expect("json");
        assert_eq!(plain, serde_json::json!({"sessionId": "", "prompt": "hi"}));
    }

    #[test]
    fn relative_paths_bad_line_ranges_and_bad_base64_are_refused() {
        let relative = Message::new("x").with_file("cat.png");
        assert!(matches!(relative.validate(), Err(MessageError::Path(p)) if p == "cat.png"));
        let mut ranged = Message::new("x").with_file("/a/b.rs");
        if let Some(Attachment::File { line_range, .. }) = ranged.attachments.first_mut() {
            *line_range = Some(LineRange { start: 5, end: 2 });
        }
        assert_eq!(
            ranged.validate(),
            Err(MessageError::LineRange { start: 5, end: 2 })
        );
        let blob = Message {
            attachments: vec![Attachment::Blob {
                data: "not base64!".into(),
                mime_type: "text/plain".into(),
                display_name: None,
            }],
            ..Message::new("x")
        };
        assert!(matches!(blob.validate(), Err(MessageError::Blob(_))));
    }
}
