//! The causal attention's CPU kernels: per (sequence, head), six small
//! matrix products in register tiles (4 rows × 8 lanes), compiled for the
//! CPU's SIMD level at run time by `pulp` (safe code; every call inside the
//! dispatched loop is `#[inline(always)]` so it takes the dispatched
//! target features).
//!
//! Forward: S = scale · Q Kᵀ, P = causal softmax(S), O = P V.
//! Backward (P as the forward kept it, or recomputed): dP = dO Vᵀ, dS = scale · P ⊙ (dP − rowsum(dO ⊙ O)),
//! dQ = dS K, dK += dSᵀ Q, dV += Pᵀ dO (the sums run over the query heads that
//! share a key/value head).

/// The sizes of one attention call: `q` `[b, tq, h, d]`, `k` and `v`
/// `[b, tk, kv, d]`, all contiguous.
#[derive(Debug, Clone, Copy)]
pub(super) struct Dims {
    pub b: usize,
    pub tq: usize,
    pub tk: usize,
    pub h: usize,
    pub kv: usize,
    pub d: usize,
}

impl Dims {
    /// The offset of query row `(bi, 0, head)`; rows step by `h · d`.
    #[inline(always)]
    fn q0(&self, bi: usize, head: usize) -> usize {
        (bi * self.tq * self.h + head) * self.d
    }

    /// The offset of key/value row `(bi, 0, head's group)`; rows step by `kv · d`.
    #[inline(always)]
    fn kv0(&self, bi: usize, head: usize) -> usize {
        (bi * self.tk * self.kv + head / (self.h / self.kv)) * self.d
    }
}

/// How far a tile's products run, for the tile's rows `r0..r1`: everything,
/// or up to the last key the tile's last query sees (`r1 − 1 + off`), along
/// the output columns (`N`, for products over keys) or the inner dimension
/// (`K`, for products that sum over keys).
#[derive(Clone, Copy)]
enum Limit {
    None,
    N(usize),
    K(usize),
}

/// A row-major operand `x[r · rs + c · cs]`.
#[derive(Clone, Copy)]
struct Mat<'a> {
    x: &'a [f32],
    rs: usize,
    cs: usize,
}

const MR: usize = 4;
const NR: usize = 16;

/// `c[r · c_rs + j] (+)= Σ_x a[r, x] · b[x · b_rs + j]` for `r < m`, `j < n`,
/// `x < k` (narrowed by `lim`); `add` accumulates, otherwise it overwrites.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn mm(
    c: &mut [f32],
    c_rs: usize,
    a: Mat<'_>,
    b: &[f32],
    b_rs: usize,
    m: usize,
    k: usize,
    n: usize,
    lim: Limit,
    add: bool,
) {
    for r0 in (0..m).step_by(MR) {
        let rows = MR.min(m - r0);
        let last = r0 + rows - 1;
        let (kx, nx) = match lim {
            Limit::None => (k, n),
            Limit::N(off) => (k, n.min(last + off + 1)),
            Limit::K(off) => (k.min(last + off + 1), n),
        };
        // Rows past m read row m − 1 (harmless; never stored).
        let row = |r: usize| (r0 + r).min(m - 1);
        for n0 in (0..nx).step_by(NR) {
            let w = NR.min(nx - n0);
            let mut acc = [[0f32; NR]; MR];
            let a_rows = [row(0) * a.rs, row(1) * a.rs, row(2) * a.rs, row(3) * a.rs];
            if w == NR {
                for x in 0..kx {
                    let bv: &[f32; NR] = b[x * b_rs + n0..][..NR].try_into().unwrap_or(&[0.0; NR]);
                    tile_step(&mut acc, a, &a_rows, x, bv);
                }
            } else {
                for x in 0..kx {
                    let mut bv = [0f32; NR];
                    bv[..w].copy_from_slice(&b[x * b_rs + n0..][..w]);
                    tile_step(&mut acc, a, &a_rows, x, &bv);
                }
            }
            for (r, acc_r) in acc.iter().enumerate().take(rows) {
                let out = &mut c[(r0 + r) * c_rs + n0..][..w];
                if add {
                    out.iter_mut().zip(acc_r).for_each(|(o, &v)| *o += v);
                } else {
                    out.copy_from_slice(&acc_r[..w]);
                }
            }
            // Columns the limit skipped are zero (overwrite mode).
        }
        if !add && nx < n {
            for r in 0..rows {
                c[(r0 + r) * c_rs + nx..][..n - nx].iter_mut().for_each(|v| *v = 0.0);
            }
        }
    }
}

/// One inner-dimension step of a 4 × 8 tile: `acc[r] += a[r, x] · b`.
#[inline(always)]
fn tile_step(acc: &mut [[f32; NR]; MR], a: Mat<'_>, a_rows: &[usize; MR], x: usize, b: &[f32; NR]) {
    for (acc_r, &ar) in acc.iter_mut().zip(a_rows) {
        let av = a.x[ar + x * a.cs];
        for l in 0..NR {
            acc_r[l] = av.mul_add(b[l], acc_r[l]);
        }
    }
}

/// Per-call scratch: one key/value head transposed (`[d, tk]`), and the
/// `[tq, tk]` probabilities and their gradient.
struct Scratch {
    kt: Vec<f32>,
    vt: Vec<f32>,
    p: Vec<f32>,
    ds: Vec<f32>,
}

impl Scratch {
    fn new(n: &Dims) -> Self {
        Self {
            kt: vec![0.0; n.d * n.tk],
            vt: vec![0.0; n.d * n.tk],
            p: vec![0.0; n.tq * n.tk],
            ds: vec![0.0; n.tq * n.tk],
        }
    }

    /// `dst[l · tk + j] = src[kv0 + j · kv · d + l]`.
    #[inline(always)]
    fn transpose(dst: &mut [f32], src: &[f32], n: &Dims, kv0: usize) {
        for j in 0..n.tk {
            let row = &src[kv0 + j * n.kv * n.d..][..n.d];
            for (l, &x) in row.iter().enumerate() {
                dst[l * n.tk + j] = x;
            }
        }
    }

    /// P for `(bi, head)`: scores `Q Kᵀ`, scaled in the softmax, under the
    /// causal mask; zero past each row's last key.
    #[inline(always)]
    fn probabilities(&mut self, n: &Dims, scale: f32, q: &[f32], bi: usize, head: usize) {
        let off = n.tk - n.tq;
        let qa = Mat { x: &q[n.q0(bi, head)..], rs: n.h * n.d, cs: 1 };
        mm(&mut self.p, n.tk, qa, &self.kt, n.tk, n.tq, n.d, n.tk, Limit::N(off), false);
        for (i, row) in self.p.chunks_exact_mut(n.tk).enumerate() {
            let (seen, rest) = row.split_at_mut(i + off + 1);
            softmax_row(seen, scale);
            rest.iter_mut().for_each(|x| *x = 0.0);
        }
    }
}

/// `x ← softmax(scale · x)`, in 8-lane steps the compiler vectorises.
#[inline(always)]
fn softmax_row(x: &mut [f32], scale: f32) {
    let mut lanes = [f32::NEG_INFINITY; NR];
    for c in x.chunks_mut(NR) {
        for (l, v) in c.iter_mut().enumerate() {
            *v *= scale;
            lanes[l] = if *v > lanes[l] { *v } else { lanes[l] };
        }
    }
    let max = lanes.iter().fold(f32::NEG_INFINITY, |m, &v| if v > m { v } else { m });
    let mut sums = [0f32; NR];
    for c in x.chunks_mut(NR) {
        for (l, v) in c.iter_mut().enumerate() {
            *v = exp(*v - max);
            sums[l] += *v;
        }
    }
    let inv = 1.0 / sums.iter().sum::<f32>();
    x.iter_mut().for_each(|v| *v *= inv);
}

/// `eˣ` for `x ≤ 0` (softmax's shifted scores), branch-free and with no
/// float-to-int conversion so that it vectorises: `x = n ln 2 + r` with `n`
/// rounded by adding 1.5 · 2²³ (which leaves `n` in the low mantissa bits),
/// `|r| ≤ ln 2 / 2`, a degree-6 Taylor polynomial for `eʳ` (truncation
/// below 1.3e-7 relative, f32's rounding), and `2ⁿ` built in the exponent
/// bits. Below −87 it returns about 1e-38.
#[inline(always)]
pub(super) fn exp(x: f32) -> f32 {
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    const ROUND: f32 = 12_582_912.0;
    let x = x.clamp(-87.0, 88.0);
    let z = x * std::f32::consts::LOG2_E + ROUND;
    let n = z - ROUND;
    let r = x - n * LN2_HI - n * LN2_LO;
    let p = 1.0
        + r * (1.0 + r * (0.5 + r * (1.0 / 6.0 + r * (1.0 / 24.0 + r * (1.0 / 120.0 + r * (1.0 / 720.0))))));
    // z's bits are 0x4B40_0000 + n (two's complement) for |n| < 2²²; 2ⁿ has exponent field n + 127.
    p * f32::from_bits(z.to_bits().wrapping_sub(0x4B40_0000).wrapping_add(127) << 23)
}

/// The forward kernel's SIMD-dispatched body.
pub(super) struct Forward<'a> {
    pub n: Dims,
    pub scale: f32,
    pub q: &'a [f32],
    pub k: &'a [f32],
    pub v: &'a [f32],
    pub o: &'a mut [f32],
    /// Where to keep P (`[b, h, tq, tk]`) for the backward, if anywhere.
    pub keep: Option<&'a mut [f32]>,
}

impl pulp::WithSimd for Forward<'_> {
    type Output = ();

    #[inline(always)]
    fn with_simd<S: pulp::Simd>(mut self, _: S) {
        let n = self.n;
        let (off, hd) = (n.tk - n.tq, n.h * n.d);
        let mut sc = Scratch::new(&n);
        for bi in 0..n.b {
            for head in 0..n.h {
                if head % (n.h / n.kv) == 0 {
                    Scratch::transpose(&mut sc.kt, self.k, &n, n.kv0(bi, head));
                }
                sc.probabilities(&n, self.scale, self.q, bi, head);
                if let Some(keep) = self.keep.as_deref_mut() {
                    keep[(bi * n.h + head) * n.tq * n.tk..][..n.tq * n.tk].copy_from_slice(&sc.p);
                }
                let pa = Mat { x: &sc.p, rs: n.tk, cs: 1 };
                let (o0, v0) = (n.q0(bi, head), n.kv0(bi, head));
                mm(
                    &mut self.o[o0..],
                    hd,
                    pa,
                    &self.v[v0..],
                    n.kv * n.d,
                    n.tq,
                    n.tk,
                    n.d,
                    Limit::K(off),
                    false,
                );
            }
        }
    }
}

/// The backward kernel's SIMD-dispatched body; `dq`, `dk`, `dv` start at zero.
pub(super) struct Backward<'a> {
    pub n: Dims,
    pub scale: f32,
    pub q: &'a [f32],
    pub k: &'a [f32],
    pub v: &'a [f32],
    pub o: &'a [f32],
    pub g: &'a [f32],
    pub dq: &'a mut [f32],
    pub dk: &'a mut [f32],
    pub dv: &'a mut [f32],
    /// P as the forward kept it, or `None` to recompute it from `q` and `k`.
    pub kept: Option<&'a [f32]>,
}

impl pulp::WithSimd for Backward<'_> {
    type Output = ();

    #[inline(always)]
    fn with_simd<S: pulp::Simd>(self, _: S) {
        let n = self.n;
        let (off, hd, kvd) = (n.tk - n.tq, n.h * n.d, n.kv * n.d);
        let mut sc = Scratch::new(&n);
        for bi in 0..n.b {
            for head in 0..n.h {
                let (q0, kv0) = (n.q0(bi, head), n.kv0(bi, head));
                let first_of_group = head % (n.h / n.kv) == 0;
                if first_of_group {
                    Scratch::transpose(&mut sc.vt, self.v, &n, kv0);
                }
                match self.kept {
                    Some(kept) => {
                        sc.p.copy_from_slice(&kept[(bi * n.h + head) * n.tq * n.tk..][..n.tq * n.tk])
                    }
                    None => {
                        if first_of_group {
                            Scratch::transpose(&mut sc.kt, self.k, &n, kv0);
                        }
                        sc.probabilities(&n, self.scale, self.q, bi, head);
                    }
                }
                // dP = dO Vᵀ into ds, then dS = scale · P ⊙ (dP − dO_i · O_i).
                let ga = Mat { x: &self.g[q0..], rs: hd, cs: 1 };
                mm(&mut sc.ds, n.tk, ga, &sc.vt, n.tk, n.tq, n.d, n.tk, Limit::N(off), false);
                for i in 0..n.tq {
                    let at = q0 + i * hd;
                    let di: f32 =
                        self.g[at..][..n.d].iter().zip(&self.o[at..][..n.d]).map(|(a, b)| a * b).sum();
                    let row = i * n.tk;
                    for (s, &p) in sc.ds[row..][..n.tk].iter_mut().zip(&sc.p[row..][..n.tk]) {
                        *s = self.scale * p * (*s - di);
                    }
                }
                let dsa = Mat { x: &sc.ds, rs: n.tk, cs: 1 };
                mm(&mut self.dq[q0..], hd, dsa, &self.k[kv0..], kvd, n.tq, n.tk, n.d, Limit::K(off), false);
                let dst = Mat { x: &sc.ds, rs: 1, cs: n.tk };
                mm(&mut self.dk[kv0..], kvd, dst, &self.q[q0..], hd, n.tk, n.tq, n.d, Limit::None, true);
                let pt = Mat { x: &sc.p, rs: 1, cs: n.tk };
                mm(&mut self.dv[kv0..], kvd, pt, &self.g[q0..], hd, n.tk, n.tq, n.d, Limit::None, true);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    /// The vectorisable exp agrees with f64's within f32 rounding over
    /// softmax's whole range.
    #[test]
    fn exp_is_accurate_to_f32_rounding() {
        let mut worst = 0f64;
        for i in 0..=870_000 {
            let x = -(i as f32) * 1e-4;
            let (ours, exact) = (super::exp(x) as f64, (x as f64).exp());
            worst = worst.max((ours - exact).abs() / exact);
        }
        assert!(worst < 4e-7, "relative error {worst}");
        assert!(super::exp(-1000.0) < 1e-37 && super::exp(0.0) == 1.0);
    }
}
