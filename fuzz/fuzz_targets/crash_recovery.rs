//! Power loss under the real `RedbStore`: the fuzzer chooses the steps, the
//! crash points and which unsynced writes survive each crash; every crash
//! image is reopened and checked (acknowledged writes present, the write in
//! flight all or nothing, record and expiry index agreeing, no panic).
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    idemstore_testkit::crash::crash_recovery(data);
});
