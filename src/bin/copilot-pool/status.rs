//! `copilot-pool status`: asks a running daemon for its pool snapshot (`GET /v1/pool`) and
//! prints it as a table.

use std::fmt::Write as _;

use anyhow::{Context, Result, bail};
use clap::Args;
use serde::Deserialize;

use copilot_pool::secret::Secret;

use crate::config::API_TOKEN_ENV;
use crate::http_client;

/// The daemon's address when `--url` is not given.
pub const DEFAULT_URL: &str = "http://127.0.0.1:7878";

#[derive(Args, Debug)]
pub struct StatusArgs {
    /// The daemon's base URL (plain http only).
    #[arg(long, default_value = DEFAULT_URL)]
    pub url: String,
    /// A file holding the bearer token for the daemon's API, readable by its owner only
    /// (default: the COPILOT_POOL_API_TOKEN environment variable).
    #[arg(long, value_name = "PATH")]
    pub api_token_file: Option<std::path::PathBuf>,
    /// Refused: a token on the command line is visible to every local user in `ps`.
    #[arg(long, hide = true, value_name = "TOKEN")]
    pub api_token: Option<String>,
}

/// The snapshot `GET /v1/pool` returns. Every field defaults, so an older or newer daemon
/// still prints what both know.
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub struct PoolSnapshot {
    #[serde(alias = "workers")]
    pub processes: Vec<ProcessRow>,
    pub waiters: u64,
    pub conversations: u64,
    pub leased: u64,
    #[serde(alias = "closed")]
    pub draining: bool,
    pub totals: Totals,
}

/// One runtime process.
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub struct ProcessRow {
    pub key_hash: String,
    pub pid: u32,
    pub state: String,
    pub sessions: u64,
    pub leases: u64,
    pub turns: u64,
    pub restarts: u64,
    pub rss_bytes: u64,
}

/// Counters since the daemon started.
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub struct Totals {
    pub processes_spawned: u64,
    pub restarts: u64,
    pub crashes: u64,
    pub resumed: u64,
    pub created: u64,
    pub evicted: u64,
    pub turns: u64,
}

pub async fn status(args: StatusArgs) -> Result<()> {
    let base = args.url.trim_end_matches('/');
    let url = format!("{base}/v1/pool");
    if args.api_token.is_some() {
        bail!("{}", crate::config::TOKEN_ON_ARGV);
    }
    let token = match &args.api_token_file {
        Some(path) => Some(crate::config::read_token_file(path)?),
        None => std::env::var(API_TOKEN_ENV)
            .ok()
            .filter(|t| !t.is_empty())
            .map(Secret::new),
    };
    let token = token.as_ref().map(|t| t.expose());
    let (code, body) = match http_client::get(&url, token).await {
        Ok(response) => response,
        Err(err) if http_client::is_connection_refused(&err) => bail!(
            "no copilot-pool daemon at {} (start one with `copilot-pool serve`)",
            args.url
        ),
        Err(err) => return Err(err),
    };
    match code {
        200 => {}
        401 => bail!(
            "the daemon needs an API token (--api-token-file PATH or {API_TOKEN_ENV}){}",
            if token.is_some() {
                "; the one given was refused"
            } else {
                ""
            }
        ),
        other => bail!("GET {url} answered {other}: {}", body.trim()),
    }
    let snapshot: PoolSnapshot = serde_json::from_str(&body)
        .with_context(|| format!("GET {url} answered 200 with an unexpected body: {body}"))?;
    print!("{}", render(&snapshot));
    Ok(())
}

/// The snapshot as text: a summary line, a totals line, then one row per process.
pub fn render(s: &PoolSnapshot) -> String {
    let t = &s.totals;
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{} process{}, {} conversations ({} leased), {} waiting{}",
        s.processes.len(),
        if s.processes.len() == 1 { "" } else { "es" },
        s.conversations,
        s.leased,
        s.waiters,
        if s.draining { ", DRAINING" } else { "" }
    );
    let _ = writeln!(
        out,
        "totals: spawned {}, restarts {}, crashes {}, resumed {}, created {}, evicted {}, turns {}",
        t.processes_spawned, t.restarts, t.crashes, t.resumed, t.created, t.evicted, t.turns
    );
    if s.processes.is_empty() {
        let _ = writeln!(out, "no runtime processes");
        return out;
    }
    let _ = writeln!(
        out,
        "{:>8}  {:<8}  {:>8}  {:>6}  {:>7}  {:>8}  {:>8}  KEY",
        "PID", "STATE", "SESSIONS", "LEASES", "TURNS", "RESTARTS", "RSS MiB"
    );
    for p in &s.processes {
        let _ = writeln!(
            out,
            "{:>8}  {:<8}  {:>8}  {:>6}  {:>7}  {:>8}  {:>8.1}  {}",
            p.pid,
            p.state,
            p.sessions,
            p.leases,
            p.turns,
            p.restarts,
            p.rss_bytes as f64 / f64::from(1u32 << 20),
            p.key_hash
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_the_daemon_snapshot() {
        let json = r#"{"processes":[{"key_hash":"ab12cd34","pid":4242,"state":"live","sessions":3,"leases":1,"turns":17,"restarts":0,"rss_bytes":157286400},{"key_hash":"ffee","pid":7,"state":"draining","sessions":0,"leases":0,"turns":2,"restarts":1,"rss_bytes":0}],"waiters":2,"conversations":3,"leased":1,"draining":false,"totals":{"processes_spawned":3,"restarts":1,"crashes":1,"resumed":4,"created":5,"evicted":0,"turns":19}}"#;
        let snapshot: PoolSnapshot = serde_json::from_str(json).unwrap();
        let text = render(&snapshot);
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(
            lines[0],
            "2 processes, 3 conversations (1 leased), 2 waiting"
        );
        assert_eq!(
            lines[1],
            "totals: spawned 3, restarts 1, crashes 1, resumed 4, created 5, evicted 0, turns 19"
        );
        assert!(lines[2].starts_with("     PID  STATE"), "{text}");
        let row: Vec<&str> = lines[3].split_whitespace().collect();
        assert_eq!(
            row,
            ["4242", "live", "3", "1", "17", "0", "150.0", "ab12cd34"]
        );
        let row: Vec<&str> = lines[4].split_whitespace().collect();
        assert_eq!(row, ["7", "draining", "0", "0", "2", "1", "0.0", "ffee"]);
        assert_eq!(lines.len(), 5);
    }

    #[test]
    fn empty_and_draining_pool() {
        let snapshot: PoolSnapshot = serde_json::from_str(r#"{"draining":true}"#).unwrap();
        let text = render(&snapshot);
        assert!(
            text.starts_with("0 processes, 0 conversations (0 leased), 0 waiting, DRAINING\n"),
            "{text}"
        );
        assert!(text.ends_with("no runtime processes\n"), "{text}");
    }
}
