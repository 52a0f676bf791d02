//! The kind of the next allocations: a thread-local *current kind* (set
//! around the code whose allocations it names: `with wasmem.torch.kind(…)`,
//! an optimizer step) over a process-wide *default kind* (what every other
//! allocation is: `other`, or `temp` once `wasmem.torch.track` runs).
//!
//! On the C side a kind is its [`TensorKind::index`] (0 `param`, 1 `grad`,
//! 2 `optim`, 3 `activation`, 4 `temp`, 5 `other`); -1 means "no current
//! kind" (the default applies).

use std::cell::Cell;
use std::sync::atomic::{AtomicU8, Ordering};

use wasmem::types::TensorKind;

thread_local! {
    static CURRENT: Cell<Option<TensorKind>> = const { Cell::new(None) };
}

static DEFAULT: AtomicU8 = AtomicU8::new(TensorKind::Other as u8);

/// The kind of C code `code`: `Ok(None)` for -1, an error naming the code for
/// anything that is not a kind.
pub fn from_code(code: i32) -> Result<Option<TensorKind>, String> {
    if code == -1 {
        return Ok(None);
    }
    usize::try_from(code).ok().and_then(|i| TensorKind::ALL.get(i).copied()).map(Some).ok_or_else(|| {
        format!("kind code {code} is not a kind (0 param, 1 grad, 2 optim, 3 activation, 4 temp, 5 other; -1 none)")
    })
}

/// The C code of `kind` (-1 for `None`).
pub fn code(kind: Option<TensorKind>) -> i32 {
    kind.map_or(-1, |k| k.index() as i32)
}

/// Sets this thread's current kind; returns the previous one.
pub fn set_current(kind: Option<TensorKind>) -> Option<TensorKind> {
    CURRENT.with(|c| c.replace(kind))
}

/// Sets the process-wide default kind; returns the previous one.
pub fn set_default(kind: TensorKind) -> TensorKind {
    TensorKind::ALL[DEFAULT.swap(kind as u8, Ordering::Relaxed) as usize]
}

/// The kind of an allocation made now on this thread.
pub fn for_next_allocation() -> TensorKind {
    CURRENT.with(Cell::get).unwrap_or_else(|| TensorKind::ALL[DEFAULT.load(Ordering::Relaxed) as usize])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_round_trip_and_bad_codes_are_named() {
        for k in TensorKind::ALL {
            assert_eq!(from_code(code(Some(k))).unwrap(), Some(k));
        }
        assert_eq!(from_code(-1).unwrap(), None);
        assert!(from_code(6).unwrap_err().contains("kind code 6"));
        assert!(from_code(-2).is_err());
    }

    #[test]
    fn the_current_kind_is_per_thread_over_the_default() {
        assert_eq!(set_current(Some(TensorKind::Param)), None);
        assert_eq!(for_next_allocation(), TensorKind::Param);
        std::thread::spawn(|| {
            assert_eq!(for_next_allocation(), TensorKind::ALL[DEFAULT.load(Ordering::Relaxed) as usize])
        })
        .join()
        .unwrap();
        assert_eq!(set_current(None), Some(TensorKind::Param));
    }
}
