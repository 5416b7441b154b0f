//! Arbitrary bytes never panic the record, key and index decoders, and
//! whatever decodes as a record re-encodes to the same bytes.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    idemstore_testkit::codec::record_decode(data);
});
