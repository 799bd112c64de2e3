//! `/proc/<pid>/stat`, read once for every command that looks at processes (the demo's and
//! the chaos run's orphan and zombie checks, the chaos injector's group members, the load
//! run's CPU counts, the bench's CPU and memory of a process tree): one parser, so the field
//! numbering is written once. Beside it, one process's CPU to the nanosecond from its
//! CPU-time clock ([`cpu_seconds_exact`]), where `stat`'s clock ticks are too coarse, and
//! the binary's other reads of `/proc`: a process's PSS, environment variable and open
//! descriptors, this process's RSS, the load average. The commands read `/proc` nowhere
//! else (the sandbox wrapper names paths under it for its ruleset, and reads none).

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

/// Every descendant of `root` in `all` (children, their children, …), not `root` itself.
pub fn descendants(all: &[Stat], root: u32) -> Vec<&Stat> {
    let mut found: Vec<&Stat> = Vec::new();
    let mut frontier = vec![root];
    while let Some(parent) = frontier.pop() {
        for p in all.iter().filter(|p| p.ppid == parent && p.pid != root) {
            if !found.iter().any(|f| f.pid == p.pid) {
                found.push(p);
                frontier.push(p.pid);
            }
        }
    }
    found
}

/// The proportional set size of `pid` in bytes (`Pss:` of `smaps_rollup`), if it is there:
/// its private memory plus its share of what it shares, so that the sum over processes
/// counts shared pages once.
pub fn pss_bytes(pid: u32) -> Option<u64> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/smaps_rollup")).ok()?;
    parse_pss(&text)
}

fn parse_pss(smaps_rollup: &str) -> Option<u64> {
    let line = smaps_rollup.lines().find(|l| l.starts_with("Pss:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// The value of the variable `name` in the environment `pid` started with.
pub fn environ_var(pid: u32, name: &str) -> Option<String> {
    let environ = std::fs::read(format!("/proc/{pid}/environ")).ok()?;
    let prefix = format!("{name}=");
    environ.split(|b| *b == 0).find_map(|kv| {
        let kv = String::from_utf8_lossy(kv);
        kv.strip_prefix(&prefix).map(str::to_owned)
    })
}

/// The open descriptors of `pid` (`/proc/<pid>/fd`; 0 once it is gone or unreadable).
pub fn fd_count(pid: u32) -> u64 {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .map(|d| d.count() as u64)
        .unwrap_or(0)
}

/// This process's resident memory in bytes (`VmRSS:` of `/proc/self/status`; 0 if unread).
pub fn own_rss_bytes() -> u64 {
    copilot_pool::process::rss_bytes(std::process::id()).unwrap_or(0)
}

/// The load average over 1, 5 and 15 minutes (`/proc/loadavg`; empty if unread).
pub fn load_average() -> Vec<f64> {
    std::fs::read_to_string("/proc/loadavg")
        .unwrap_or_default()
        .split_whitespace()
        .take(3)
        .filter_map(|v| v.parse().ok())
        .collect()
}

/// CPU seconds (user + system) of `pid` itself, and of everything under it: its live
/// descendants' own and their reaped children's, plus what the children `pid` reaped left in
/// its children's counts. (0, 0) once `pid` is gone.
pub fn tree_cpu_seconds(pid: u32) -> (f64, f64) {
    tree_cpu_seconds_in(&all(), pid)
}

/// [`tree_cpu_seconds`] in a snapshot taken by [`all`] (one scan for several trees).
pub fn tree_cpu_seconds_in(all: &[Stat], pid: u32) -> (f64, f64) {
    let Some(root) = all.iter().find(|p| p.pid == pid) else {
        return (0.0, 0.0);
    };
    let below: u64 = descendants(all, pid)
        .iter()
        .map(|p| p.cpu_ticks + p.children_cpu_ticks)
        .sum();
    let ticks = ticks_per_second();
    (
        root.cpu_ticks as f64 / ticks,
        (root.children_cpu_ticks + below) as f64 / ticks,
    )
}

/// One above the largest pid the kernel hands out (`PID_MAX_LIMIT` on 64-bit).
const PID_CEILING: u32 = 1 << 22;

/// CPU seconds (user + system, every thread, ended ones included) one process has used, to
/// the nanosecond: its CPU-time clock (`clock_getcpuclockid`). `stat`'s figures are clock
/// ticks (10 ms here), too coarse for a daemon that uses ~80 ms over a whole bench load (one
/// tick either way was 12 % of it). `None` if the process is gone or its clock is not readable.
pub fn cpu_seconds_exact(pid: u32) -> Option<f64> {
    // Pid 0 names the caller, and glibc encodes a pid from 2^28 up into a clock id that
    // overflows into the caller's own process clock: both would read the wrong process. No
    // pid reaches 2^22 (the kernel's `pid_max` ceiling).
    if pid == 0 || pid >= PID_CEILING {
        return None;
    }
    let pid = nix::unistd::Pid::from_raw(i32::try_from(pid).ok()?);
    let clock = nix::time::clock_getcpuclockid(pid).ok()?;
    let spent = nix::time::clock_gettime(clock).ok()?;
    Some(spent.tv_sec() as f64 + spent.tv_nsec() as f64 / 1e9)
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

    /// Whether `seconds` is a whole number of clock ticks (as `stat`'s figures are), to
    /// within floating-point error.
    fn whole_ticks(seconds: f64) -> bool {
        let ticks = seconds * ticks_per_second();
        (ticks - ticks.round()).abs() < 1e-6
    }

    #[tokio::test]
    async fn another_process_cpu_is_read_to_below_a_tick_and_agrees_with_its_stat() {
        // A child that only burns CPU, leading its own group: killed with it on every exit
        // path, a failed assertion's included.
        let mut command = tokio::process::Command::new("/bin/sh");
        command.args(["-c", "while :; do :; done"]);
        let mut child =
            copilot_pool::process::GroupLeader::spawn(command).expect("spawning /bin/sh");
        let pid = child.pid().expect("not reaped yet");
        // Until its clock has counted 50 ms (five ticks at 100 Hz): a loaded machine only
        // makes that take longer, within the bound.
        let bound = std::time::Instant::now() + std::time::Duration::from_secs(30);
        let mut spent = 0.0;
        while spent < 0.05 && std::time::Instant::now() < bound {
            tokio::time::sleep(std::time::Duration::from_millis(5)).await;
            spent = cpu_seconds_exact(pid).expect("a live child's CPU clock is readable");
        }
        let exact = cpu_seconds_exact(pid).expect("still readable");
        let ticks = stat(pid).expect("its stat").cpu_ticks as f64 / ticks_per_second();
        child.group().kill();
        let _ = child.wait().await;
        assert!(exact >= 0.05, "the clock counted {exact} s within 30 s");
        assert!(!whole_ticks(exact), "{exact} s: a whole number of ticks");
        // `stat` was read after the clock: it may be up to a tick per field past it.
        let tick = 1.0 / ticks_per_second();
        assert!(
            ticks <= exact + 2.0 * tick + 0.05 && ticks >= exact - 2.0 * tick,
            "the clock says {exact} s, stat {ticks} s"
        );
        assert_eq!(cpu_seconds_exact(pid), None, "reaped: no clock");
    }

    #[test]
    fn pids_no_process_can_have_read_nothing_not_the_callers_clock() {
        for pid in [0, PID_CEILING, 1 << 28, i32::MAX as u32, u32::MAX] {
            assert_eq!(cpu_seconds_exact(pid), None, "pid {pid}");
        }
        assert!(cpu_seconds_exact(std::process::id()).is_some());
    }

    #[test]
    fn a_name_with_spaces_and_parentheses_is_read_whole() {
        let line = "42 (a (b) c) Z 7 42 42 0 -1 0 0 0 0 0 3 4 5 6 20 0 1 0";
        let stat = parse(42, line).expect("a stat line");
        assert_eq!(stat.name, "a (b) c");
        assert_eq!((stat.state, stat.ppid, stat.pgid), ('Z', 7, 42));
        assert_eq!((stat.cpu_ticks, stat.children_cpu_ticks), (7, 11));
        assert_eq!(parse(1, "garbage"), None);
    }

    #[test]
    fn descendants_are_found_through_every_generation_and_nothing_else() {
        let p = |pid, ppid| Stat {
            pid,
            name: String::new(),
            state: 'S',
            ppid,
            pgid: pid,
            cpu_ticks: 0,
            children_cpu_ticks: 0,
        };
        let all = vec![p(1, 0), p(10, 1), p(11, 10), p(12, 11), p(13, 1), p(20, 13)];
        let mut found: Vec<u32> = descendants(&all, 10).iter().map(|s| s.pid).collect();
        found.sort();
        assert_eq!(found, vec![11, 12]);
        assert!(descendants(&all, 12).is_empty());
    }

    #[test]
    fn pss_is_read_in_bytes_from_smaps_rollup() {
        let text = "00400000-7ffd [rollup]\nRss:  2048 kB\nPss:  1500 kB\nPss_Anon: 1000 kB\n";
        assert_eq!(parse_pss(text), Some(1500 * 1024));
        assert_eq!(parse_pss("Rss: 1 kB\n"), None);
    }
}
