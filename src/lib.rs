//! copilot-pool: supervises pools of GitHub Copilot CLI processes for multi-agent gateways.

pub mod process;
pub mod rpc;
pub mod runtime;
pub mod scripted_model;
pub mod secret;
pub mod tunnel;
pub mod worker;
