//! The scripted model's error type.

/// Why the scripted model could not start serving.
#[derive(Debug, thiserror::Error)]
pub enum ScriptedModelError {
    /// Binding the loopback listener failed.
    #[error("cannot bind the scripted model's loopback listener: {0}")]
    Bind(#[source] std::io::Error),
    /// The bound listener could not report its address.
    #[error("cannot read the scripted model listener's address: {0}")]
    LocalAddr(#[source] std::io::Error),
}
