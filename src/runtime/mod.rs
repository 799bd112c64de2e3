//! Finding and installing the Copilot runtime (placeholder; being written).
