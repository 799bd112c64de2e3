//! Fuzz target: `copilot_pool::fuzzing::json_rpc` (see that function for what it checks).
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| copilot_pool::fuzzing::json_rpc(data));
