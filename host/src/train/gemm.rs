//! Safe matrix multiplication over row-major f32 slices (`matrixmultiply`).

/// `c = a·b + beta·c` where `a` is `m×k` (stored `k×m` when `ta`), `b` is
/// `k×n` (stored `n×k` when `tb`) and `c` is `m×n`, all row-major.
///
/// # Panics
/// When a slice is shorter than its shape; callers pass buffers sized from
/// the same dimensions.
#[allow(clippy::too_many_arguments)]
pub fn matmul(a: &[f32], ta: bool, b: &[f32], tb: bool, c: &mut [f32], m: usize, k: usize, n: usize, beta: f32) {
    assert!(a.len() >= m * k && b.len() >= k * n && c.len() >= m * n, "matmul: slices shorter than {m}×{k}×{n}");
    if m == 0 || n == 0 {
        return;
    }
    let (rsa, csa) = if ta { (1, m as isize) } else { (k as isize, 1) };
    let (rsb, csb) = if tb { (1, k as isize) } else { (n as isize, 1) };
    // SAFETY: the assertion above guarantees that every index the strides
    // reach lies inside the slices (a: m·k, b: k·n, c: m·n elements); `c` is
    // borrowed mutably and cannot alias `a` or `b`.
    unsafe {
        matrixmultiply::sgemm(
            m,
            k,
            n,
            1.0,
            a.as_ptr(),
            rsa,
            csa,
            b.as_ptr(),
            rsb,
            csb,
            beta,
            c.as_mut_ptr(),
            n as isize,
            1,
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn transposes_agree_with_the_definition() {
        let (m, k, n) = (3, 4, 5);
        let a: Vec<f32> = (0..m * k).map(|i| i as f32 * 0.5 - 2.0).collect();
        let b: Vec<f32> = (0..k * n).map(|i| (i % 7) as f32 - 3.0).collect();
        let mut want = vec![0.0f32; m * n];
        for i in 0..m {
            for j in 0..n {
                want[i * n + j] = (0..k).map(|p| a[i * k + p] * b[p * n + j]).sum();
            }
        }
        let at: Vec<f32> = (0..k * m).map(|x| a[(x % m) * k + x / m]).collect();
        let bt: Vec<f32> = (0..n * k).map(|x| b[(x % k) * n + x / k]).collect();
        for (ta, tb) in [(false, false), (true, false), (false, true), (true, true)] {
            let mut c = vec![1.0f32; m * n];
            matmul(if ta { &at } else { &a }, ta, if tb { &bt } else { &b }, tb, &mut c, m, k, n, 0.0);
            assert_eq!(c, want, "ta={ta} tb={tb}");
        }
    }
}
