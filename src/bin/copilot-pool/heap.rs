//! The binary's allocator and its figures. The binary runs on jemalloc (a long-lived daemon
//! with many threads keeps far less freed memory resident than under glibc's per-thread
//! arenas), and reads the allocator's own statistics: the live heap (bytes the program holds
//! now) is what `chaos` and `load` compare with their baseline, because a process's resident
//! size also counts pages the allocator keeps for reuse after a burst.
//!
//! The library never sets an allocator; this module is the binary's alone.

#[global_allocator]
static ALLOCATOR: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

/// The allocator's view of this process now.
#[derive(Debug, Clone, Copy, Default, serde::Serialize)]
pub struct HeapFigures {
    /// Bytes allocated and not yet freed (the live heap).
    pub live_bytes: u64,
    /// Bytes in pages the allocator holds resident (live data, its metadata, and freed pages
    /// kept for reuse).
    pub resident_bytes: u64,
}

/// Reads the allocator's statistics (refreshed first: jemalloc caches them per epoch);
/// `None` if the allocator does not answer.
///
/// jemalloc counts the blocks each thread keeps in its cache for its next allocations as
/// allocated; they are not the program's, and how many there are depends on how many threads
/// ran lately, so they are taken off (`tcache_bytes` of the merged arenas, read from the
/// statistics report: the typed API has no key for it, and the raw one is `unsafe`).
pub fn figures() -> Option<HeapFigures> {
    use tikv_jemalloc_ctl::{epoch, stats};
    epoch::advance().ok()?;
    let allocated = stats::allocated::read().ok()? as u64;
    Some(HeapFigures {
        live_bytes: allocated.saturating_sub(thread_cache_bytes().unwrap_or(0)),
        resident_bytes: stats::resident::read().ok()? as u64,
    })
}

/// The bytes held in the threads' caches, from jemalloc's JSON statistics report (merged
/// arenas only: about 25 KiB of text, a millisecond).
fn thread_cache_bytes() -> Option<u64> {
    use tikv_jemalloc_ctl::stats_print::{Options, stats_print};
    let mut options = Options::default();
    options.json_format = true;
    options.skip_constants = true;
    options.skip_per_arena = true;
    options.skip_bin_size_classes = true;
    options.skip_large_size_classes = true;
    options.skip_mutex_statistics = true;
    let mut report = Vec::new();
    stats_print(&mut report, options).ok()?;
    let report: serde_json::Value = serde_json::from_slice(&report).ok()?;
    report["jemalloc"]["stats.arenas"]["merged"]["tcache_bytes"].as_u64()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_live_heap_grows_by_what_is_held_and_falls_back_when_it_is_freed() {
        let before = figures().expect("jemalloc answers").live_bytes;
        let held: Vec<u8> = vec![7; 64 << 20];
        let during = figures().expect("jemalloc answers").live_bytes;
        assert!(
            during >= before + (60 << 20),
            "{before} -> {during} with 64 MiB held"
        );
        drop(held);
        let after = figures().expect("jemalloc answers").live_bytes;
        assert!(
            after < during - (60 << 20),
            "{during} -> {after} after the free"
        );
    }
}
