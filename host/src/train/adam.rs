//! AdamW over flat fp32 slices, on all cores.
//!
//! Element-wise, so the result does not depend on how the slice is split
//! into chunks or shards: a shard updated on its own rank equals the same
//! elements of a full update.

use rayon::prelude::*;

/// AdamW hyper-parameters.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamW {
    /// Learning rate.
    pub lr: f32,
    /// First-moment decay.
    pub beta1: f32,
    /// Second-moment decay.
    pub beta2: f32,
    /// Denominator epsilon.
    pub eps: f32,
    /// Decoupled weight decay.
    pub weight_decay: f32,
}

impl Default for AdamW {
    fn default() -> Self {
        AdamW { lr: 3e-3, beta1: 0.9, beta2: 0.95, eps: 1e-8, weight_decay: 0.01 }
    }
}

/// Elements per parallel chunk (keeps small groups on one thread).
const CHUNK: usize = 16 * 1024;

impl AdamW {
    /// One step (`t` counts from 1) on `master`, `m`, `v` with gradient
    /// `grad × scale`.
    pub fn step(&self, t: u64, master: &mut [f32], m: &mut [f32], v: &mut [f32], grad: &[f32], scale: f32) {
        let (b1, b2) = (self.beta1, self.beta2);
        let bc1 = 1.0 - b1.powi(t as i32);
        let bc2 = 1.0 - b2.powi(t as i32);
        let (lr, eps, wd) = (self.lr, self.eps, self.weight_decay);
        master
            .par_chunks_mut(CHUNK)
            .zip(m.par_chunks_mut(CHUNK))
            .zip(v.par_chunks_mut(CHUNK))
            .zip(grad.par_chunks(CHUNK))
            .for_each(|(((p, m), v), g)| {
                for i in 0..p.len() {
                    let gi = g[i] * scale;
                    m[i] = b1 * m[i] + (1.0 - b1) * gi;
                    v[i] = b2 * v[i] + (1.0 - b2) * gi * gi;
                    let mh = m[i] / bc1;
                    let vh = v[i] / bc2;
                    p[i] -= lr * (mh / (vh.sqrt() + eps) + wd * p[i]);
                }
            });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shards_equal_the_full_update() {
        let n = 40_000;
        let grad: Vec<f32> = (0..n).map(|i| ((i * 7919) % 1000) as f32 / 500.0 - 1.0).collect();
        let mut full = (vec![0.5f32; n], vec![0.0; n], vec![0.0; n]);
        let a = AdamW::default();
        for t in 1..=3 {
            a.step(t, &mut full.0, &mut full.1, &mut full.2, &grad, 0.25);
        }
        let mut parts = Vec::new();
        for s in 0..4 {
            let r = s * n / 4..(s + 1) * n / 4;
            let mut p = (vec![0.5f32; r.len()], vec![0.0; r.len()], vec![0.0; r.len()]);
            for t in 1..=3 {
                a.step(t, &mut p.0, &mut p.1, &mut p.2, &grad[r.clone()], 0.25);
            }
            parts.extend(p.0);
        }
        assert_eq!(parts, full.0);
        assert!(full.0.iter().any(|&x| x != 0.5));
    }
}
