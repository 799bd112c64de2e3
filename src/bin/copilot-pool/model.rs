//! `copilot-pool scripted-model`: serves the embedded scripted model on loopback HTTP, for
//! workloads against `serve` in tests and CI (never a production path).

use anyhow::{Context, Result};
use clap::Args;
use copilot_pool::scripted_model::ScriptedModel;

#[derive(Args)]
pub struct ModelArgs {}

pub async fn scripted_model(_args: ModelArgs) -> Result<()> {
    let model = ScriptedModel::new();
    let endpoint = model
        .serve_http()
        .await
        .context("starting the scripted model")?;
    println!("model on {}", endpoint.base_url());
    tokio::signal::ctrl_c()
        .await
        .context("waiting for Ctrl-C")?;
    endpoint.shutdown().await;
    Ok(())
}
