//! Fuzzes the PyTorch snapshot importer (bounded pickle reader and walk):
//! any input either imports or gives an error, within the limits, and an
//! import is always a valid event stream.
#![no_main]

use libfuzzer_sys::fuzz_target;
use wasmem::trace::snapshot::{import_bytes, ImportLimits, ImportOptions};
use wasmem::trace::TraceWriter;

fuzz_target!(|data: &[u8]| {
    let opts = ImportOptions {
        device: 0,
        limits: ImportLimits {
            max_input_bytes: 1 << 20,
            max_values: 1 << 20,
            max_walk_steps: 1 << 22,
            ..ImportLimits::default()
        },
    };
    let Ok(snapshot) = import_bytes(data, "fuzz", &opts) else {
        return;
    };
    let mut w = TraceWriter::new(std::io::sink(), "check", &snapshot.header).expect("header");
    for e in &snapshot.events {
        w.write(e).expect("imported events form a valid trace");
    }
});
