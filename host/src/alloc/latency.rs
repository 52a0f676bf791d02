//! What a policy call costs: a log-bucketed histogram of call durations.
//!
//! Buckets: values below 16 ns have one bucket each; above, every power of
//! two `[2^e, 2^(e+1))` is split into 4 equal sub-buckets, so a quantile is
//! reported within 12.5 % of the true value (the bucket's midpoint). 256
//! counters cover every `u64`. Recording is a few integer operations and no
//! allocation; histograms add and subtract bucket by bucket (the second half
//! of a split replay is `now − at the split`).
//!
//! Durations are wall-clock: they depend on the machine and its load, so
//! they are never compared by tests, and the metric keys built from them
//! (`policy_call_p50_ns`, `policy_call_p99_ns`) are timing keys like
//! `wall_seconds`.

/// Sub-buckets per power of two.
const SUB: u32 = 4;
/// Values below this have a bucket each.
const LINEAR: u64 = 16;
/// Number of buckets.
const BUCKETS: usize = LINEAR as usize + (64 - 4) * SUB as usize;

/// A histogram of durations in nanoseconds (see the module documentation).
#[derive(Clone, PartialEq, Eq)]
pub struct LatencyHistogram {
    counts: Box<[u64; BUCKETS]>,
    total: u64,
}

impl Default for LatencyHistogram {
    fn default() -> Self {
        LatencyHistogram { counts: Box::new([0; BUCKETS]), total: 0 }
    }
}

impl std::fmt::Debug for LatencyHistogram {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LatencyHistogram")
            .field("count", &self.total)
            .field("p50_ns", &self.quantile(0.5))
            .field("p99_ns", &self.quantile(0.99))
            .finish()
    }
}

fn bucket(ns: u64) -> usize {
    if ns < LINEAR {
        return ns as usize;
    }
    let e = 63 - ns.leading_zeros(); // ≥ 4
    let sub = ((ns >> (e - 2)) & (SUB as u64 - 1)) as usize;
    LINEAR as usize + (e as usize - 4) * SUB as usize + sub
}

/// The midpoint of bucket `b` (its only value below [`LINEAR`]).
fn midpoint(b: usize) -> u64 {
    if b < LINEAR as usize {
        return b as u64;
    }
    let i = b - LINEAR as usize;
    let e = (i / SUB as usize) as u32 + 4;
    let sub = (i % SUB as usize) as u64;
    let width = 1u64 << (e - 2);
    let low = (1u64 << e) + sub * width;
    low + width / 2
}

impl LatencyHistogram {
    /// Records one duration of `ns` nanoseconds, counted `weight` times
    /// (a sampled call stands for the calls it was sampled from).
    #[inline]
    pub fn record(&mut self, ns: u64, weight: u64) {
        self.counts[bucket(ns)] += weight;
        self.total += weight;
    }

    /// Records a duration.
    #[inline]
    pub fn record_duration(&mut self, d: std::time::Duration, weight: u64) {
        self.record(u64::try_from(d.as_nanos()).unwrap_or(u64::MAX), weight);
    }

    /// Calls recorded (with their weights).
    pub fn count(&self) -> u64 {
        self.total
    }

    /// The `q`-quantile (0 ≤ q ≤ 1) in nanoseconds, within 12.5 %; 0 when empty.
    pub fn quantile(&self, q: f64) -> u64 {
        if self.total == 0 {
            return 0;
        }
        let q = if q.is_nan() { 0.5 } else { q.clamp(0.0, 1.0) };
        // The smallest value with at least ⌈q·n⌉ recorded values at or below it.
        let rank = ((q * self.total as f64).ceil() as u64).clamp(1, self.total);
        let mut seen = 0;
        for (b, &c) in self.counts.iter().enumerate() {
            seen += c;
            if seen >= rank {
                return midpoint(b);
            }
        }
        midpoint(BUCKETS - 1)
    }

    /// Adds `other`'s counts.
    pub fn add(&mut self, other: &LatencyHistogram) {
        for (a, b) in self.counts.iter_mut().zip(other.counts.iter()) {
            *a += b;
        }
        self.total += other.total;
    }

    /// The counts recorded since `earlier` (a copy of this histogram taken
    /// before): bucket by bucket, saturating at 0.
    pub fn since(&self, earlier: &LatencyHistogram) -> LatencyHistogram {
        let mut h = self.clone();
        for (a, b) in h.counts.iter_mut().zip(earlier.counts.iter()) {
            *a = a.saturating_sub(*b);
        }
        h.total = h.counts.iter().sum();
        h
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_cover_u64_in_order_within_an_eighth() {
        let mut last = 0;
        for ns in (0..20_000u64).chain([1 << 40, (1 << 40) + 12345, u64::MAX / 3, u64::MAX]) {
            let b = bucket(ns);
            assert!(b < BUCKETS && b >= last || ns >= 20_000, "{ns}");
            last = last.max(b);
            let m = midpoint(b) as f64;
            assert!((m - ns as f64).abs() <= ns as f64 / 8.0 + 0.5, "{ns} → bucket {b} midpoint {m}");
        }
    }

    #[test]
    fn quantiles_weights_and_differences() {
        let mut h = LatencyHistogram::default();
        assert_eq!(h.quantile(0.5), 0);
        for ns in 1..=100u64 {
            h.record(ns * 100, 1);
        }
        let p50 = h.quantile(0.5) as f64;
        assert!((p50 - 5000.0).abs() <= 5000.0 / 8.0, "{p50}");
        let p99 = h.quantile(0.99) as f64;
        assert!((p99 - 9900.0).abs() <= 9900.0 / 8.0, "{p99}");
        let before = h.clone();
        h.record(1_000_000, 1000);
        assert_eq!(h.count(), 1100);
        let d = h.since(&before);
        assert_eq!(d.count(), 1000);
        assert!((d.quantile(0.5) as f64 - 1e6).abs() <= 1e6 / 8.0);
        let mut sum = before.clone();
        sum.add(&d);
        assert_eq!(sum, h);
    }
}
