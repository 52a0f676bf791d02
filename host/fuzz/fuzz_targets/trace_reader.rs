//! Fuzzes the v1 trace reader: any input either reads or gives an error, and
//! whatever it reads, the writer accepts and reproduces exactly.
#![no_main]

use libfuzzer_sys::fuzz_target;
use wasmem::trace::{ReadOptions, TraceReader, TraceWriter};

fuzz_target!(|data: &[u8]| {
    let opts = ReadOptions {
        max_line_len: 1 << 16,
    };
    let Ok(reader) = TraceReader::with_options(data, "fuzz", opts) else {
        return;
    };
    let header = reader.header().clone();
    let Ok(events) = reader.collect::<Result<Vec<_>, _>>() else {
        return;
    };
    let mut w = TraceWriter::new(Vec::new(), "rt", &header).expect("header writes");
    for e in &events {
        w.write(e).expect("the writer accepts what the reader accepted");
    }
    let text = w.finish().expect("flush to a Vec");
    let again = TraceReader::new(&text[..], "rt").expect("written header reads");
    assert_eq!(again.header(), &header);
    let again: Vec<_> = again.collect::<Result<_, _>>().expect("written events read");
    assert_eq!(again, events);
});
