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
pub fn figures() -> Option<HeapFigures> {
    use tikv_jemalloc_ctl::{epoch, stats};
    epoch::advance().ok()?;
    Some(HeapFigures {
        live_bytes: stats::allocated::read().ok()? as u64,
        resident_bytes: stats::resident::read().ok()? as u64,
    })
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
