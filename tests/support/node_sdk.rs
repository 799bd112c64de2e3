//! The official Node SDK for the tests that attach it to the SDK endpoint: the library's
//! installer (`copilot_pool::runtime::find_or_install_node_sdk`, shared with `copilot-pool
//! bench`), memoized per test binary, panicking with the library's message (which names the
//! manual fix) when the SDK is neither configured, cached nor installable, or (first) when the
//! `node` on `PATH` is older than the SDK's `engines` (`tool_install::require_node`).

#![allow(dead_code)]

use std::path::PathBuf;

use copilot_pool::runtime;
use tokio::sync::OnceCell;

/// The SDK version the tests attach (the one whose runtime the pool runs).
pub const VERSION: &str = runtime::NODE_SDK_VERSION;

static SDK: OnceCell<PathBuf> = OnceCell::const_new();

/// The package directory of the SDK (`…/node_modules/@github/copilot-sdk`).
pub async fn sdk_dir() -> PathBuf {
    SDK.get_or_init(|| async {
        super::tool_install::require_node("the official Node SDK").await;
        runtime::find_or_install_node_sdk(runtime::process_env, runtime::NODE_SDK_INSTALL_TIMEOUT)
            .await
            .unwrap_or_else(|error| {
                panic!("cannot find or install the Node SDK for tests: {error}")
            })
    })
    .await
    .clone()
}
