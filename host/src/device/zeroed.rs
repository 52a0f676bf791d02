//! Zeroed host buffers that may fail: the memory of a host-backed simulated
//! device, whose size a workload chooses. `vec![0; n]` aborts the process
//! when the host cannot provide `n` bytes; this returns `None` instead. The
//! pages are zeroed by the allocator (`calloc`), so untouched ones cost no
//! resident memory, as with `vec![0; n]`.

use std::alloc::{alloc_zeroed, Layout};

/// `len` zero bytes, or `None` when the host cannot provide them.
pub(crate) fn zeroed_bytes(len: usize) -> Option<Vec<u8>> {
    if len == 0 {
        return Some(Vec::new());
    }
    let layout = Layout::array::<u8>(len).ok()?;
    // SAFETY: `layout` has a non-zero size (checked above).
    let ptr = unsafe { alloc_zeroed(layout) };
    if ptr.is_null() {
        return None;
    }
    // SAFETY: `ptr` was allocated by the global allocator with the layout of
    // `[u8; len]` (size `len`, alignment 1), which is what a `Vec<u8>` of
    // capacity `len` frees with; its `len` bytes are initialized (zeroed).
    Some(unsafe { Vec::from_raw_parts(ptr, len, len) })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn zeroed_or_none() {
        let v = zeroed_bytes(4096).unwrap();
        assert!(v.len() == 4096 && v.iter().all(|&b| b == 0));
        assert_eq!(zeroed_bytes(0), Some(Vec::new()));
        // More than any machine has: refused, not aborted.
        assert_eq!(zeroed_bytes(isize::MAX as usize - 4096), None);
    }
}
