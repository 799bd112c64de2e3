//! `copilot-pool install-cli`: install the pinned runtime and print its executable.

use anyhow::{Context, Result};
use clap::Args;
use copilot_pool::runtime::{self, Flavour};

#[derive(Args)]
pub struct InstallArgs {
    /// Which runtime: `runtime` (the SDK's native launcher, default) or `cli` (the `copilot`
    /// single executable).
    #[arg(long, default_value = "runtime")]
    flavour: Flavour,
}

pub async fn install_cli(args: InstallArgs) -> Result<()> {
    let cache = runtime::cache_dir(runtime::process_env)?;
    let installed = runtime::install(args.flavour, &cache)
        .await
        .with_context(|| {
            format!(
                "installing the {} flavour into {}",
                args.flavour,
                cache.display()
            )
        })?;
    if installed.fresh {
        eprintln!(
            "installed {} {} into {}",
            installed.flavour,
            installed.version,
            installed.dir.display()
        );
    } else {
        eprintln!(
            "{} {} already installed",
            installed.flavour, installed.version
        );
    }
    println!("{}", installed.executable.display());
    Ok(())
}
