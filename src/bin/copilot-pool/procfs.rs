//! `/proc/<pid>/stat`, read once for every command that looks at processes (the demo's and
//! the chaos run's orphan and zombie checks, the chaos injector's group members, the load
//! run's CPU counts): one parser, so the field numbering is written once.

/// What the commands read of one process's `stat`.
#[derive(Debug, Clone, PartialEq)]
pub struct Stat {
    pub pid: u32,
    /// The command name (`comm`).
    pub name: String,
    /// `R`, `S`, `Z`, `T`, …
    pub state: char,
    pub ppid: u32,
    pub pgid: u32,
    /// User and system CPU of the process itself, and of its reaped children, in clock ticks.
    pub cpu_ticks: u64,
    pub children_cpu_ticks: u64,
}

/// Parses one `stat` line (`None` if it is not one).
pub fn parse(pid: u32, stat: &str) -> Option<Stat> {
    let open = stat.find('(')?;
    let close = stat.rfind(')')?;
    let name = stat.get(open + 1..close)?.to_owned();
    // After the name: field 3 (state) is index 0, so field n is index n - 3.
    let fields: Vec<&str> = stat.get(close + 1..)?.split_whitespace().collect();
    let n = |field: usize| fields.get(field - 3).and_then(|f| f.parse::<u64>().ok());
    Some(Stat {
        pid,
        name,
        state: fields.first()?.chars().next()?,
        ppid: n(4)? as u32,
        pgid: n(5)? as u32,
        cpu_ticks: n(14)? + n(15)?,
        children_cpu_ticks: n(16)? + n(17)?,
    })
}

/// The `stat` of `pid`, if it is still there.
pub fn stat(pid: u32) -> Option<Stat> {
    parse(
        pid,
        &std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?,
    )
}

/// The `stat` of every process now.
pub fn all() -> Vec<Stat> {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    dir.flatten()
        .filter_map(|e| e.file_name().to_string_lossy().parse::<u32>().ok())
        .filter_map(stat)
        .collect()
}

/// Clock ticks per second (`CLK_TCK`).
pub fn ticks_per_second() -> f64 {
    nix::unistd::sysconf(nix::unistd::SysconfVar::CLK_TCK)
        .ok()
        .flatten()
        .unwrap_or(100) as f64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_name_with_spaces_and_parentheses_is_read_whole() {
        let line = "42 (a (b) c) Z 7 42 42 0 -1 0 0 0 0 0 3 4 5 6 20 0 1 0";
        let stat = parse(42, line).expect("a stat line");
        assert_eq!(stat.name, "a (b) c");
        assert_eq!((stat.state, stat.ppid, stat.pgid), ('Z', 7, 42));
        assert_eq!((stat.cpu_ticks, stat.children_cpu_ticks), (7, 11));
        assert_eq!(parse(1, "garbage"), None);
    }
}
