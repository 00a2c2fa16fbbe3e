//! Feeds arbitrary bytes to the CMF reader: open (all validation), then everything a caller can
//! do with an opened file: look tensors up, decode every one, read vocab and header, verify.
//! Any panic, abort, out-of-bounds access or runaway allocation is a bug.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(file) = cmf_format::CmfFile::from_bytes("fuzz.cmf", data.to_vec()) else {
        return;
    };
    let _ = (file.header_json(), file.vocab(), file.header());
    for t in file.tensors() {
        assert!(file.tensor(t.name).is_some());
        let _ = t.to_f32();
    }
    let _ = file.verify();
});
