//! The binary's allocator and its figure. The binary runs on the system allocator wrapped in
//! a byte counter ([`cap::Cap`]), so the live heap (bytes the program holds now) is known
//! exactly: it is what `chaos` and `load` compare with their baseline, because a process's
//! resident size also counts pages an allocator keeps for reuse after a burst.
//!
//! The library never sets an allocator; this module is the binary's alone.

use std::alloc::System;

use cap::Cap;

#[global_allocator]
static ALLOCATOR: Cap<System> = Cap::new(System, usize::MAX);

/// The allocator's view of this process now.
#[derive(Debug, Clone, Copy, Default, serde::Serialize)]
pub struct HeapFigures {
    /// Bytes allocated and not yet freed (the live heap).
    pub live_bytes: u64,
}

/// The live heap now (`Option` so a build without the counter could say "unknown").
pub fn figures() -> Option<HeapFigures> {
    Some(HeapFigures {
        live_bytes: ALLOCATOR.allocated() as u64,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_live_heap_grows_by_what_is_held_and_falls_back_when_it_is_freed() {
        let before = figures().expect("counted").live_bytes;
        let held: Vec<u8> = vec![7; 64 << 20];
        let during = figures().expect("counted").live_bytes;
        assert!(
            during >= before + (60 << 20),
            "{before} -> {during} with 64 MiB held"
        );
        drop(held);
        let after = figures().expect("counted").live_bytes;
        assert!(
            after < during - (60 << 20),
            "{during} -> {after} after the free"
        );
    }
}
