//! Fuzz target: `copilot_pool::fuzzing::transcript_reader` (see that function for what it
//! checks), in one scratch directory for the whole run.
#![no_main]

use std::sync::OnceLock;

static DIR: OnceLock<tempfile::TempDir> = OnceLock::new();

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let dir = DIR.get_or_init(|| match tempfile::tempdir() {
        Ok(dir) => dir,
        Err(e) => panic!("cannot create a scratch directory (set TMPDIR to a writable one): {e}"),
    });
    copilot_pool::fuzzing::transcript_reader(dir.path(), data);
});
