//! Fuzz target: `copilot_pool::fuzzing::session_event` (see that function for what it checks).
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| copilot_pool::fuzzing::session_event(data));
