//! The host platform, as the npm platform suffix of the Copilot packages (`linux-x64`, ...).

use std::fmt;
use std::path::Path;

/// A platform the pinned Copilot packages are published for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Platform {
    /// `linux-x64` (glibc).
    LinuxX64,
    /// `linux-arm64` (glibc).
    LinuxArm64,
    /// `linuxmusl-x64` (Alpine and other musl hosts).
    LinuxMuslX64,
    /// `linuxmusl-arm64`.
    LinuxMuslArm64,
    /// `darwin-x64`.
    DarwinX64,
    /// `darwin-arm64`.
    DarwinArm64,
}

/// The host is not one the Copilot packages are published for.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "unsupported platform {os}-{arch}: the Copilot runtime is published for \
     linux-x64, linux-arm64, linuxmusl-x64, linuxmusl-arm64, darwin-x64 and darwin-arm64 \
     only"
)]
pub struct PlatformError {
    /// `std::env::consts::OS` of the host.
    pub os: String,
    /// `std::env::consts::ARCH` of the host.
    pub arch: String,
}

impl Platform {
    /// The host platform (musl is detected on Linux from the dynamic loaders present).
    pub fn current() -> Result<Platform, PlatformError> {
        let musl = std::env::consts::OS == "linux"
            && host_is_musl(std::env::consts::ARCH, |path| path.exists());
        Platform::from_os_arch(std::env::consts::OS, std::env::consts::ARCH, musl)
    }

    /// Maps `std::env::consts::{OS, ARCH}` to a platform. `musl` only matters on Linux.
    pub fn from_os_arch(os: &str, arch: &str, musl: bool) -> Result<Platform, PlatformError> {
        match (os, arch) {
            ("linux", "x86_64") if musl => Ok(Platform::LinuxMuslX64),
            ("linux", "x86_64") => Ok(Platform::LinuxX64),
            ("linux", "aarch64") if musl => Ok(Platform::LinuxMuslArm64),
            ("linux", "aarch64") => Ok(Platform::LinuxArm64),
            ("macos", "x86_64") => Ok(Platform::DarwinX64),
            ("macos", "aarch64") => Ok(Platform::DarwinArm64),
            _ => Err(PlatformError {
                os: os.to_owned(),
                arch: arch.to_owned(),
            }),
        }
    }

    /// The npm platform suffix, e.g. `linux-x64`.
    pub fn as_str(self) -> &'static str {
        match self {
            Platform::LinuxX64 => "linux-x64",
            Platform::LinuxArm64 => "linux-arm64",
            Platform::LinuxMuslX64 => "linuxmusl-x64",
            Platform::LinuxMuslArm64 => "linuxmusl-arm64",
            Platform::DarwinX64 => "darwin-x64",
            Platform::DarwinArm64 => "darwin-arm64",
        }
    }
}

impl fmt::Display for Platform {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A Linux host of `arch` is musl when it has musl's loader and not glibc's (a glibc host
/// may have the `musl` package installed too, so glibc's loader wins).
fn host_is_musl(arch: &str, exists: impl Fn(&Path) -> bool) -> bool {
    let (glibc, musl): (&[&str], &str) = match arch {
        "x86_64" => (
            &[
                "/lib64/ld-linux-x86-64.so.2",
                "/lib/x86_64-linux-gnu/libc.so.6",
            ],
            "/lib/ld-musl-x86_64.so.1",
        ),
        "aarch64" => (
            &[
                "/lib/ld-linux-aarch64.so.1",
                "/lib/aarch64-linux-gnu/libc.so.6",
            ],
            "/lib/ld-musl-aarch64.so.1",
        ),
        _ => return false,
    };
    !glibc.iter().any(|path| exists(Path::new(path))) && exists(Path::new(musl))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn maps_supported_hosts() {
        let cases = [
            ("linux", "x86_64", false, "linux-x64"),
            ("linux", "x86_64", true, "linuxmusl-x64"),
            ("linux", "aarch64", false, "linux-arm64"),
            ("linux", "aarch64", true, "linuxmusl-arm64"),
            ("macos", "x86_64", false, "darwin-x64"),
            ("macos", "aarch64", false, "darwin-arm64"),
        ];
        for (os, arch, musl, want) in cases {
            let got = Platform::from_os_arch(os, arch, musl).map(Platform::as_str);
            assert_eq!(got, Ok(want), "{os}-{arch} musl={musl}");
        }
    }

    #[test]
    fn rejects_other_hosts_naming_the_supported_ones() {
        for (os, arch) in [
            ("windows", "x86_64"),
            ("linux", "riscv64"),
            ("freebsd", "x86_64"),
        ] {
            let err = Platform::from_os_arch(os, arch, false).unwrap_err();
            let text = err.to_string();
            assert!(text.contains(&format!("{os}-{arch}")), "{text}");
            assert!(
                text.contains("linux-x64") && text.contains("darwin-arm64"),
                "{text}"
            );
        }
    }

    #[test]
    fn musl_detection_prefers_glibc() {
        let only = |present: &'static [&'static str]| {
            move |p: &Path| present.iter().any(|q| Path::new(q) == p)
        };
        assert!(host_is_musl("x86_64", only(&["/lib/ld-musl-x86_64.so.1"])));
        assert!(!host_is_musl(
            "x86_64",
            only(&["/lib/ld-musl-x86_64.so.1", "/lib64/ld-linux-x86-64.so.2"])
        ));
        assert!(!host_is_musl("x86_64", only(&[])));
        // Alpine on arm64, published for as linuxmusl-arm64.
        assert!(host_is_musl(
            "aarch64",
            only(&["/lib/ld-musl-aarch64.so.1"])
        ));
        assert!(!host_is_musl(
            "aarch64",
            only(&["/lib/ld-musl-aarch64.so.1", "/lib/ld-linux-aarch64.so.1"])
        ));
        assert!(!host_is_musl(
            "aarch64",
            only(&["/lib/ld-musl-x86_64.so.1"])
        ));
    }

    #[test]
    fn current_host_is_supported_here() {
        // The machines this crate is developed and tested on are linux-x64 or darwin.
        if cfg!(any(target_os = "linux", target_os = "macos"))
            && cfg!(any(target_arch = "x86_64", target_arch = "aarch64"))
        {
            assert!(Platform::current().is_ok());
        }
    }
}
