//! Where managed runtime installs live: the cache directory and its precedence rules.

use std::ffi::OsString;
use std::path::PathBuf;

use super::non_empty;

/// Overrides the cache directory (used as is).
pub const CACHE_DIR_ENV: &str = "COPILOT_POOL_CACHE_DIR";

/// No cache directory could be derived from the environment.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "cannot choose a cache directory for the Copilot runtime: none of {CACHE_DIR_ENV}, \
     XDG_CACHE_HOME or HOME is set"
)]
pub struct CacheDirError;

/// Resolves the cache directory from an environment lookup:
/// `COPILOT_POOL_CACHE_DIR`, else `$XDG_CACHE_HOME/copilot-pool` (an absolute path only, as
/// the XDG spec says), else `$HOME/.cache/copilot-pool`. Empty values count as unset.
///
/// Pure: pass [`process_env`](super::process_env) for the real environment.
pub fn cache_dir(env: impl Fn(&str) -> Option<OsString>) -> Result<PathBuf, CacheDirError> {
    if let Some(dir) = non_empty(&env, CACHE_DIR_ENV) {
        return Ok(PathBuf::from(dir));
    }
    if let Some(xdg) = non_empty(&env, "XDG_CACHE_HOME").map(PathBuf::from)
        && xdg.is_absolute()
    {
        return Ok(xdg.join("copilot-pool"));
    }
    if let Some(home) = non_empty(&env, "HOME") {
        return Ok(PathBuf::from(home).join(".cache").join("copilot-pool"));
    }
    Err(CacheDirError)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn env(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<OsString> + use<> {
        let map: HashMap<String, OsString> = pairs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), OsString::from(v)))
            .collect();
        move |key| map.get(key).cloned()
    }

    #[test]
    fn explicit_override_wins() {
        let got = cache_dir(env(&[
            ("COPILOT_POOL_CACHE_DIR", "/srv/cache"),
            ("XDG_CACHE_HOME", "/x"),
            ("HOME", "/home/u"),
        ]));
        assert_eq!(got, Ok(PathBuf::from("/srv/cache")));
    }

    #[test]
    fn xdg_then_home() {
        let got = cache_dir(env(&[("XDG_CACHE_HOME", "/x"), ("HOME", "/home/u")]));
        assert_eq!(got, Ok(PathBuf::from("/x/copilot-pool")));
        let got = cache_dir(env(&[("HOME", "/home/u")]));
        assert_eq!(got, Ok(PathBuf::from("/home/u/.cache/copilot-pool")));
    }

    #[test]
    fn empty_and_relative_values_are_skipped() {
        let got = cache_dir(env(&[
            ("COPILOT_POOL_CACHE_DIR", ""),
            ("XDG_CACHE_HOME", "relative/cache"),
            ("HOME", "/home/u"),
        ]));
        assert_eq!(got, Ok(PathBuf::from("/home/u/.cache/copilot-pool")));
    }

    #[test]
    fn nothing_set_is_an_error() {
        let err = cache_dir(env(&[])).unwrap_err();
        assert!(err.to_string().contains("COPILOT_POOL_CACHE_DIR"), "{err}");
    }
}
