//! Checks on live processes through /proc: process-group members, zombies, environments.

use std::time::Duration;

/// The fields of `/proc/<pid>/stat` after the command name: state, ppid, pgrp, ...
fn stat_fields(pid: u32) -> Option<Vec<String>> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let (_, rest) = stat.rsplit_once(')')?;
    Some(rest.split_whitespace().map(str::to_owned).collect())
}

/// Pids of processes (any state) whose process group is `pgid`.
pub fn group_members(pgid: u32) -> Vec<(u32, char)> {
    let pgid = pgid.to_string();
    all_pids()
        .into_iter()
        .filter_map(|pid| {
            let fields = stat_fields(pid)?;
            (fields.get(2) == Some(&pgid)).then(|| (pid, fields[0].chars().next().unwrap_or('?')))
        })
        .collect()
}

/// Pids of every process under `root` (children, grandchildren, ...).
pub fn descendants(root: u32) -> Vec<u32> {
    let parent_of: std::collections::HashMap<u32, u32> = all_pids()
        .into_iter()
        .filter_map(|pid| Some((pid, stat_fields(pid)?.get(1)?.parse().ok()?)))
        .collect();
    parent_of
        .keys()
        .copied()
        .filter(|pid| {
            let mut at = *pid;
            while let Some(&parent) = parent_of.get(&at) {
                if parent == root {
                    return true;
                }
                if parent <= 1 {
                    return false;
                }
                at = parent;
            }
            false
        })
        .collect()
}

/// Waits (polling /proc: there is no exit event for processes we did not spawn directly)
/// until no process of group `pgid` exists, not even a zombie, and returns what is left
/// after `limit`.
pub async fn wait_group_gone(pgid: u32, limit: Duration) -> Vec<(u32, char)> {
    let deadline = tokio::time::Instant::now() + limit;
    loop {
        let left = group_members(pgid);
        if left.is_empty() || tokio::time::Instant::now() >= deadline {
            return left;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The environment of a live process.
pub fn environ(pid: u32) -> Vec<(String, String)> {
    let raw = std::fs::read(format!("/proc/{pid}/environ")).unwrap_or_default();
    raw.split(|b| *b == 0)
        .filter(|kv| !kv.is_empty())
        .filter_map(|kv| {
            let kv = String::from_utf8_lossy(kv);
            kv.split_once('=')
                .map(|(k, v)| (k.to_owned(), v.to_owned()))
        })
        .collect()
}

/// Live (non-zombie) processes whose environment has `key=value`.
pub fn with_env(key: &str, value: &str) -> Vec<u32> {
    all_pids()
        .into_iter()
        .filter(|pid| !is_zombie(*pid))
        .filter(|pid| environ(*pid).iter().any(|(k, v)| k == key && v == value))
        .collect()
}

/// Live (non-zombie) processes whose command line contains `needle`.
pub fn with_cmdline_containing(needle: &str) -> Vec<u32> {
    all_pids()
        .into_iter()
        .filter(|pid| !is_zombie(*pid))
        .filter(|pid| {
            std::fs::read(format!("/proc/{pid}/cmdline"))
                .map(|c| String::from_utf8_lossy(&c).contains(needle))
                .unwrap_or(false)
        })
        .collect()
}

/// Polls `find` until it returns nothing or `limit` passes; returns what is left.
pub async fn wait_none(find: impl Fn() -> Vec<u32>, limit: Duration) -> Vec<u32> {
    poll(find, true, limit).await
}

/// Polls `find` until it returns something or `limit` passes; returns what it found (empty
/// past `limit`).
pub async fn wait_some(find: impl Fn() -> Vec<u32>, limit: Duration) -> Vec<u32> {
    poll(find, false, limit).await
}

/// Polls /proc through `find` (no event says a process we did not spawn started or ended)
/// until its answer is empty (`until_empty`) or not, or `limit` passes.
async fn poll(find: impl Fn() -> Vec<u32>, until_empty: bool, limit: Duration) -> Vec<u32> {
    let deadline = tokio::time::Instant::now() + limit;
    loop {
        let found = find();
        if found.is_empty() == until_empty || tokio::time::Instant::now() >= deadline {
            return found;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn all_pids() -> Vec<u32> {
    std::fs::read_dir("/proc")
        .map(|dir| {
            dir.flatten()
                .filter_map(|e| e.file_name().to_string_lossy().parse::<u32>().ok())
                .collect()
        })
        .unwrap_or_default()
}

fn is_zombie(pid: u32) -> bool {
    stat_fields(pid).is_none_or(|fields| fields.first().is_none_or(|state| state == "Z"))
}

/// Live (non-zombie) processes whose environment has `key=<value starting with prefix>`.
pub fn with_env_prefix(key: &str, prefix: &str) -> Vec<u32> {
    all_pids()
        .into_iter()
        .filter(|pid| !is_zombie(*pid))
        .filter(|pid| {
            environ(*pid)
                .iter()
                .any(|(k, v)| k == key && v.starts_with(prefix))
        })
        .collect()
}

/// Those of `pids` still alive (present and not a zombie).
pub fn alive(pids: &[u32]) -> Vec<u32> {
    pids.iter()
        .copied()
        .filter(|pid| !is_zombie(*pid))
        .collect()
}
