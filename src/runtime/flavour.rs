//! The two runtime flavours, their pinned npm packages and where their executable sits.
//!
//! The pinned versions are defined here and nowhere else.

use std::fmt;
use std::path::{Path, PathBuf};
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use super::platform::Platform;

/// Version of `@github/copilot-sdk-<platform>` installed for [`Flavour::Runtime`].
pub const RUNTIME_VERSION: &str = "1.0.14";
/// Version of `@github/copilot` installed for [`Flavour::Cli`].
pub const CLI_VERSION: &str = "1.0.102";

/// Which Copilot executable a managed install provides.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Flavour {
    /// `@github/copilot-sdk-<platform>`: the native `copilot-runtime` launcher, run in place
    /// from `prebuilds/<platform>/` where it loads `runtime.node`. Small and fast to start.
    #[default]
    Runtime,
    /// `@github/copilot`: the `copilot` single executable from its optional platform package
    /// `@github/copilot-<platform>`.
    Cli,
}

impl Flavour {
    /// Every flavour, the default first (the order [`locate`](super::locate) tries them in).
    pub const ALL: [Flavour; 2] = [Flavour::Runtime, Flavour::Cli];

    /// `runtime` or `cli`.
    pub fn as_str(self) -> &'static str {
        match self {
            Flavour::Runtime => "runtime",
            Flavour::Cli => "cli",
        }
    }

    /// The pinned version of this flavour's npm package.
    pub fn version(self) -> &'static str {
        match self {
            Flavour::Runtime => RUNTIME_VERSION,
            Flavour::Cli => CLI_VERSION,
        }
    }

    /// The npm package named on the `npm install` command line.
    pub fn package(self, platform: Platform) -> String {
        match self {
            Flavour::Runtime => format!("@github/copilot-sdk-{platform}"),
            Flavour::Cli => "@github/copilot".to_owned(),
        }
    }

    /// `<package>@<version>`, as passed to `npm install`.
    pub fn package_spec(self, platform: Platform) -> String {
        format!("{}@{}", self.package(platform), self.version())
    }

    /// The executable, relative to the install directory (the npm `--prefix`).
    pub fn executable_rel_path(self, platform: Platform) -> PathBuf {
        match self {
            Flavour::Runtime => Path::new("node_modules")
                .join(self.package(platform))
                .join("prebuilds")
                .join(platform.as_str())
                .join("copilot-runtime"),
            Flavour::Cli => Path::new("node_modules")
                .join(format!("@github/copilot-{platform}"))
                .join("copilot"),
        }
    }

    /// Files besides the executable that must exist for the install to be usable, relative
    /// to the install directory: `runtime.node` next to the launcher for [`Flavour::Runtime`].
    pub(crate) fn companion_rel_paths(self, platform: Platform) -> Vec<PathBuf> {
        match self {
            Flavour::Runtime => {
                let exe = self.executable_rel_path(platform);
                exe.parent()
                    .map(|dir| vec![dir.join("runtime.node")])
                    .unwrap_or_default()
            }
            Flavour::Cli => Vec::new(),
        }
    }

    /// This flavour as the npm package the shared installer installs.
    pub(crate) fn npm_package(self, platform: Platform) -> super::install::NpmPackage {
        super::install::NpmPackage {
            slot: self.as_str(),
            version: self.version(),
            name: self.package(platform),
            executable: self.executable_rel_path(platform),
            companions: self.companion_rel_paths(platform),
            // The `copilot` executable comes from an optional dependency.
            optional: if self == Flavour::Cli {
                super::install::OptionalDeps::Include
            } else {
                super::install::OptionalDeps::AsConfigured
            },
            override_hint: "set COPILOT_CLI_PATH to an existing copilot executable",
        }
    }

    /// `<cache_dir>/<flavour>/<version>`: the managed install of this flavour.
    pub fn install_dir(self, cache_dir: &Path) -> PathBuf {
        cache_dir.join(self.as_str()).join(self.version())
    }
}

impl fmt::Display for Flavour {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A flavour name that is neither `runtime` nor `cli`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown runtime flavour `{0}`: expected `runtime` or `cli`")]
pub struct ParseFlavourError(pub String);

impl FromStr for Flavour {
    type Err = ParseFlavourError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim().to_ascii_lowercase().as_str() {
            "runtime" => Ok(Flavour::Runtime),
            "cli" => Ok(Flavour::Cli),
            _ => Err(ParseFlavourError(s.to_owned())),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_and_displays() {
        assert_eq!("runtime".parse::<Flavour>(), Ok(Flavour::Runtime));
        assert_eq!("CLI".parse::<Flavour>(), Ok(Flavour::Cli));
        let err = "node".parse::<Flavour>().unwrap_err();
        assert!(err.to_string().contains("`node`"), "{err}");
        for flavour in Flavour::ALL {
            assert_eq!(flavour.to_string().parse::<Flavour>(), Ok(flavour));
        }
        assert_eq!(Flavour::default(), Flavour::Runtime);
    }

    #[test]
    fn packages_and_paths() {
        let p = Platform::LinuxX64;
        assert_eq!(
            Flavour::Runtime.package_spec(p),
            "@github/copilot-sdk-linux-x64@1.0.14"
        );
        assert_eq!(Flavour::Cli.package_spec(p), "@github/copilot@1.0.102");
        assert_eq!(
            Flavour::Runtime.executable_rel_path(p),
            Path::new(
                "node_modules/@github/copilot-sdk-linux-x64/prebuilds/linux-x64/copilot-runtime"
            )
        );
        assert_eq!(
            Flavour::Runtime.companion_rel_paths(p),
            vec![PathBuf::from(
                "node_modules/@github/copilot-sdk-linux-x64/prebuilds/linux-x64/runtime.node"
            )]
        );
        assert_eq!(
            Flavour::Cli.executable_rel_path(Platform::DarwinArm64),
            Path::new("node_modules/@github/copilot-darwin-arm64/copilot")
        );
        let cache = Path::new("/c");
        assert_eq!(
            Flavour::Runtime.install_dir(cache),
            Path::new("/c/runtime/1.0.14")
        );
        assert_eq!(
            Flavour::Cli.npm_package(p).lock_path(cache),
            Path::new("/c/cli-1.0.102.lock")
        );
    }
}
