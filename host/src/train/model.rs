//! The small GPT's kernels on host f32 slices: LayerNorm, linear layers,
//! causal attention (saving the log-sum-exp and recomputing the
//! probabilities in backward, as flash attention does), tanh-GELU,
//! embeddings and cross-entropy. Forward and backward of each; the trainer
//! moves the operands in and out of the engine's buffers.

use super::gemm::matmul;

/// Rounds every element to the nearest bf16 (the precision activations and
/// weights are stored in).
pub fn round_bf16(v: &mut [f32]) {
    for x in v {
        *x = half::bf16::from_f32(*x).to_f32();
    }
}

/// Dimensions of one micro-batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Dims {
    /// Sequences.
    pub batch: usize,
    /// Tokens per sequence.
    pub seq: usize,
    /// Hidden size.
    pub hidden: usize,
    /// Attention heads.
    pub heads: usize,
    /// MLP width.
    pub inter: usize,
    /// Vocabulary.
    pub vocab: usize,
}

impl Dims {
    /// Tokens of a micro-batch.
    pub fn tokens(&self) -> usize {
        self.batch * self.seq
    }
}

const LN_EPS: f32 = 1e-5;

/// LayerNorm forward over rows of `h`: returns (y, mean, rstd).
pub fn layernorm(x: &[f32], g: &[f32], b: &[f32], h: usize) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let rows = x.len() / h;
    let (mut y, mut mean, mut rstd) = (vec![0.0; x.len()], vec![0.0; rows], vec![0.0; rows]);
    for r in 0..rows {
        let row = &x[r * h..(r + 1) * h];
        let mu = row.iter().sum::<f32>() / h as f32;
        let var = row.iter().map(|v| (v - mu) * (v - mu)).sum::<f32>() / h as f32;
        let rs = 1.0 / (var + LN_EPS).sqrt();
        for i in 0..h {
            y[r * h + i] = (row[i] - mu) * rs * g[i] + b[i];
        }
        mean[r] = mu;
        rstd[r] = rs;
    }
    (y, mean, rstd)
}

/// LayerNorm backward: returns dx and adds into dg, db.
pub fn layernorm_bwd(
    dy: &[f32],
    x: &[f32],
    mean: &[f32],
    rstd: &[f32],
    g: &[f32],
    dg: &mut [f32],
    db: &mut [f32],
) -> Vec<f32> {
    let h = g.len();
    let rows = x.len() / h;
    let mut dx = vec![0.0; x.len()];
    for r in 0..rows {
        let (xr, dyr) = (&x[r * h..(r + 1) * h], &dy[r * h..(r + 1) * h]);
        let (mu, rs) = (mean[r], rstd[r]);
        let (mut s1, mut s2) = (0.0f32, 0.0f32);
        for i in 0..h {
            let xhat = (xr[i] - mu) * rs;
            let dxhat = dyr[i] * g[i];
            dg[i] += dyr[i] * xhat;
            db[i] += dyr[i];
            s1 += dxhat;
            s2 += dxhat * xhat;
        }
        for i in 0..h {
            let xhat = (xr[i] - mu) * rs;
            let dxhat = dyr[i] * g[i];
            dx[r * h + i] = rs * (dxhat - s1 / h as f32 - xhat * s2 / h as f32);
        }
    }
    dx
}

/// `y = x·w + b` with `x` rows×`i`, `w` `i`×`o`.
pub fn linear(x: &[f32], w: &[f32], b: &[f32], i: usize, o: usize) -> Vec<f32> {
    let rows = x.len() / i;
    let mut y: Vec<f32> = (0..rows).flat_map(|_| b.iter().copied()).collect();
    matmul(x, false, w, false, &mut y, rows, i, o, 1.0);
    y
}

/// Linear backward: returns dx; writes dw (`i`×`o`) and db (`o`).
pub fn linear_bwd(dy: &[f32], x: &[f32], w: &[f32], i: usize, o: usize, dw: &mut [f32], db: &mut [f32]) -> Vec<f32> {
    let rows = x.len() / i;
    matmul(x, true, dy, false, dw, i, rows, o, 0.0);
    db.iter_mut().for_each(|v| *v = 0.0);
    for r in 0..rows {
        for (d, &v) in db.iter_mut().zip(&dy[r * o..(r + 1) * o]) {
            *d += v;
        }
    }
    let mut dx = vec![0.0; rows * i];
    matmul(dy, false, w, true, &mut dx, rows, o, i, 0.0);
    dx
}

const GELU_C: f32 = 0.797_884_6; // sqrt(2/π)

/// tanh-approximated GELU.
pub fn gelu(x: &[f32]) -> Vec<f32> {
    x.iter().map(|&v| 0.5 * v * (1.0 + (GELU_C * (v + 0.044715 * v * v * v)).tanh())).collect()
}

/// GELU backward: `dy ⊙ gelu'(x)`.
pub fn gelu_bwd(dy: &[f32], x: &[f32]) -> Vec<f32> {
    dy.iter()
        .zip(x)
        .map(|(&d, &v)| {
            let u = GELU_C * (v + 0.044715 * v * v * v);
            let t = u.tanh();
            let du = GELU_C * (1.0 + 3.0 * 0.044715 * v * v);
            d * (0.5 * (1.0 + t) + 0.5 * v * (1.0 - t * t) * du)
        })
        .collect()
}

// The attention kernels index rows of q, k, v and the probabilities by the
// same position; iterator chains would obscure the formulas.
/// Causal multi-head attention over `qkv` (tokens × 3h, per token q|k|v):
/// returns (output tokens × h, log-sum-exp batch × heads × seq).
#[allow(clippy::needless_range_loop)]
pub fn attention(qkv: &[f32], d: &Dims) -> (Vec<f32>, Vec<f32>) {
    let (s, h, nh) = (d.seq, d.hidden, d.heads);
    let hd = h / nh;
    let scale = 1.0 / (hd as f32).sqrt();
    let mut out = vec![0.0; d.tokens() * h];
    let mut lse = vec![0.0; d.batch * nh * s];
    let mut p = vec![0.0f32; s];
    for b in 0..d.batch {
        for head in 0..nh {
            let q = |t: usize| &qkv[(b * s + t) * 3 * h + head * hd..][..hd];
            let k = |t: usize| &qkv[(b * s + t) * 3 * h + h + head * hd..][..hd];
            let v = |t: usize| &qkv[(b * s + t) * 3 * h + 2 * h + head * hd..][..hd];
            for i in 0..s {
                let mut mx = f32::NEG_INFINITY;
                for j in 0..=i {
                    p[j] = q(i).iter().zip(k(j)).map(|(a, b)| a * b).sum::<f32>() * scale;
                    mx = mx.max(p[j]);
                }
                let mut sum = 0.0;
                for pj in p.iter_mut().take(i + 1) {
                    *pj = (*pj - mx).exp();
                    sum += *pj;
                }
                let o = &mut out[(b * s + i) * h + head * hd..][..hd];
                for j in 0..=i {
                    let w = p[j] / sum;
                    for (oo, vv) in o.iter_mut().zip(v(j)) {
                        *oo += w * vv;
                    }
                }
                lse[(b * nh + head) * s + i] = mx + sum.ln();
            }
        }
    }
    (out, lse)
}

/// Attention backward from the output gradient `dout`, recomputing the
/// probabilities from `qkv` and `lse`; returns dqkv.
#[allow(clippy::needless_range_loop)]
pub fn attention_bwd(dout: &[f32], qkv: &[f32], lse: &[f32], d: &Dims) -> Vec<f32> {
    let (s, h, nh) = (d.seq, d.hidden, d.heads);
    let hd = h / nh;
    let scale = 1.0 / (hd as f32).sqrt();
    let mut dqkv = vec![0.0; qkv.len()];
    let mut p = vec![0.0f32; s];
    let mut dp = vec![0.0f32; s];
    for b in 0..d.batch {
        for head in 0..nh {
            let at = |t: usize, part: usize| (b * s + t) * 3 * h + part * h + head * hd;
            for i in 0..s {
                let l = lse[(b * nh + head) * s + i];
                let dout_i = &dout[(b * s + i) * h + head * hd..][..hd];
                let mut dot = 0.0f32;
                for j in 0..=i {
                    let sc = qkv[at(i, 0)..][..hd].iter().zip(&qkv[at(j, 1)..][..hd]).map(|(a, b)| a * b).sum::<f32>();
                    p[j] = (sc * scale - l).exp();
                    dp[j] = dout_i.iter().zip(&qkv[at(j, 2)..][..hd]).map(|(a, b)| a * b).sum::<f32>();
                    dot += p[j] * dp[j];
                }
                for j in 0..=i {
                    // dv_j += p_ij · dout_i
                    for x in 0..hd {
                        dqkv[at(j, 2) + x] += p[j] * dout_i[x];
                    }
                    let ds = p[j] * (dp[j] - dot) * scale;
                    for x in 0..hd {
                        dqkv[at(i, 0) + x] += ds * qkv[at(j, 1) + x];
                        dqkv[at(j, 1) + x] += ds * qkv[at(i, 0) + x];
                    }
                }
            }
        }
    }
    dqkv
}

/// Cross-entropy of `logits` (tokens × vocab) against `targets`: returns the
/// mean loss and writes the gradient of the mean into `logits`.
pub fn cross_entropy(logits: &mut [f32], targets: &[u32], vocab: usize) -> f32 {
    let n = targets.len();
    let mut total = 0.0f64;
    for (t, &y) in targets.iter().enumerate() {
        let row = &mut logits[t * vocab..(t + 1) * vocab];
        let mx = row.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
        let sum: f32 = row.iter().map(|v| (v - mx).exp()).sum();
        let lse = mx + sum.ln();
        total += (lse - row[y as usize]) as f64;
        for v in row.iter_mut() {
            *v = (*v - lse).exp() / n as f32;
        }
        row[y as usize] -= 1.0 / n as f32;
    }
    (total / n as f64) as f32
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dims() -> Dims {
        Dims { batch: 2, seq: 5, hidden: 8, heads: 2, inter: 16, vocab: 11 }
    }

    fn data(n: usize, k: u32) -> Vec<f32> {
        let mut r = oorandom::Rand32::new(k as u64);
        (0..n).map(|_| r.rand_float() - 0.5).collect()
    }

    /// Finite differences of `f` at `x` against the analytic gradient `g`.
    fn check(f: &dyn Fn(&[f32]) -> f32, x: &[f32], g: &[f32]) {
        for i in (0..x.len()).step_by(x.len() / 13 + 1) {
            let eps = 1e-2;
            let (mut a, mut b) = (x.to_vec(), x.to_vec());
            a[i] += eps;
            b[i] -= eps;
            let num = (f(&a) - f(&b)) / (2.0 * eps);
            assert!((num - g[i]).abs() < 2e-2 * (1.0 + num.abs()), "element {i}: numeric {num}, analytic {}", g[i]);
        }
    }

    #[test]
    fn attention_gradient_matches_finite_differences() {
        let d = dims();
        let qkv = data(d.tokens() * 3 * d.hidden, 1);
        let w = data(d.tokens() * d.hidden, 2);
        let loss = |q: &[f32]| attention(q, &d).0.iter().zip(&w).map(|(a, b)| a * b).sum::<f32>();
        let (_, lse) = attention(&qkv, &d);
        let g = attention_bwd(&w, &qkv, &lse, &d);
        check(&loss, &qkv, &g);
    }

    #[test]
    fn layernorm_gelu_linear_gradients() {
        let d = dims();
        let h = d.hidden;
        let x = data(d.tokens() * h, 3);
        let g = data(h, 4).iter().map(|v| v + 1.0).collect::<Vec<_>>();
        let b = data(h, 5);
        let w = data(h * d.inter, 6);
        let bias = data(d.inter, 7);
        let up = data(d.tokens() * d.inter, 8);
        let f = |x: &[f32]| {
            let (y, _, _) = layernorm(x, &g, &b, h);
            gelu(&linear(&y, &w, &bias, h, d.inter)).iter().zip(&up).map(|(a, b)| a * b).sum::<f32>()
        };
        let (y, mean, rstd) = layernorm(&x, &g, &b, h);
        let pre = linear(&y, &w, &bias, h, d.inter);
        let dpre = gelu_bwd(&up, &pre);
        let (mut dw, mut db) = (vec![0.0; h * d.inter], vec![0.0; d.inter]);
        let dy = linear_bwd(&dpre, &y, &w, h, d.inter, &mut dw, &mut db);
        let (mut dg, mut dbb) = (vec![0.0; h], vec![0.0; h]);
        let dx = layernorm_bwd(&dy, &x, &mean, &rstd, &g, &mut dg, &mut dbb);
        check(&f, &x, &dx);
    }

    #[test]
    fn cross_entropy_gradient() {
        let d = dims();
        let logits = data(d.tokens() * d.vocab, 9);
        let targets: Vec<u32> = (0..d.tokens() as u32).map(|t| t % d.vocab as u32).collect();
        let f = |l: &[f32]| cross_entropy(&mut l.to_vec(), &targets, d.vocab);
        let mut g = logits.clone();
        let loss = cross_entropy(&mut g, &targets, d.vocab);
        assert!(loss > 0.0 && loss.is_finite());
        check(&f, &logits, &g);
    }
}
