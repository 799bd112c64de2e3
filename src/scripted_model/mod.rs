//! A scripted OpenAI-compatible model for tests and the demo (placeholder; being written).
