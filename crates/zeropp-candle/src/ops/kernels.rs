//! The two ops with kernels of their own, forward and backward, where
//! candle-nn has none to reuse: the attention's causal softmax and SwiGLU's
//! product.

use candle_core::{CpuStorage, D, DType, Layout, Shape, Tensor};

type CResult<T> = candle_core::Result<T>;

/// `softmax(scale · x)` over the last dimension of attention scores `x`
/// (`[.., t_q, t_k]`) under the causal mask: row `i` sees keys `0..=i + t_k −
/// t_q` and gives the rest 0. One pass forward and one backward (dx = scale ·
/// y ⊙ (g − Σ g⊙y)), where the composite form (scale, add a −∞ mask,
/// softmax) makes three each. f32 on the CPU runs these kernels; other dtypes
/// the composite form.
///
/// ```
/// use candle_core::{D, Device, Tensor};
/// let x = Tensor::new(&[[1f32, 2.0, 3.0], [0.5, -1.0, 2.0], [0.0, 0.0, 0.0]], &Device::Cpu)?;
/// let y = zeropp_candle::ops::softmax_causal(&x, 0.5)?.to_vec2::<f32>()?;
/// assert_eq!(y[0], [1.0, 0.0, 0.0]);
/// assert!((y[1][0] - 1.0 / (1.0 + (-0.75f32).exp())).abs() < 1e-6 && y[1][2] == 0.0);
/// # Ok::<(), candle_core::Error>(())
/// ```
pub fn softmax_causal(x: &Tensor, scale: f64) -> CResult<Tensor> {
    let dims = x.dims();
    if dims.len() < 2 || dims[dims.len() - 2] > dims[dims.len() - 1] {
        candle_core::bail!("softmax_causal: scores {dims:?} must be [.., t_q, t_k] with t_q <= t_k");
    }
    if x.dtype() != DType::F32 || !x.device().is_cpu() {
        let (tq, tk) = (dims[dims.len() - 2], dims[dims.len() - 1]);
        let mask: Vec<f32> = (0..tq)
            .flat_map(|i| (0..tk).map(move |j| if j > i + tk - tq { f32::NEG_INFINITY } else { 0.0 }))
            .collect();
        let mask = Tensor::from_vec(mask, (tq, tk), x.device())?.to_dtype(x.dtype())?;
        return candle_nn::ops::softmax(&(x * scale)?.broadcast_add(&mask)?, D::Minus1);
    }
    x.contiguous()?.apply_op1(Causal { scale: scale as f32 })
}

/// The causal softmax's forward (one op with a backward).
struct Causal {
    scale: f32,
}

/// The causal softmax's backward: `(y, g)` → dx.
struct CausalBackward {
    scale: f32,
}

/// The contiguous f32 data of `s` under `l` (`op` names the kernel in errors).
fn flat<'a>(s: &'a CpuStorage, l: &Layout, op: &str) -> CResult<&'a [f32]> {
    let CpuStorage::F32(v) = s else { candle_core::bail!("{op}: f32 only") };
    let (a, b) =
        l.contiguous_offsets().ok_or_else(|| candle_core::Error::Msg(format!("{op}: not contiguous")))?;
    Ok(&v[a..b])
}

/// Rows of `[.., t_q, t_k]` data: (t_q, t_k, contiguous slice).
fn rows<'a>(s: &'a CpuStorage, l: &Layout, op: &str) -> CResult<(usize, usize, &'a [f32])> {
    let d = l.dims();
    Ok((d[d.len() - 2], d[d.len() - 1], flat(s, l, op)?))
}

impl candle_core::CustomOp1 for Causal {
    fn name(&self) -> &'static str {
        "zeropp-softmax-causal"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> CResult<(CpuStorage, Shape)> {
        let (tq, tk, x) = rows(s, l, "softmax_causal")?;
        let mut y = vec![0f32; x.len()];
        for (r, (xr, yr)) in x.chunks_exact(tk).zip(y.chunks_exact_mut(tk)).enumerate() {
            let seen = (r % tq + tk - tq + 1).min(tk);
            let (xr, yr) = (&xr[..seen], &mut yr[..seen]);
            let m = xr.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v * self.scale));
            let mut sum = 0f32;
            for (yv, &xv) in yr.iter_mut().zip(xr) {
                *yv = (xv * self.scale - m).exp();
                sum += *yv;
            }
            let inv = 1.0 / sum;
            yr.iter_mut().for_each(|v| *v *= inv);
        }
        Ok((CpuStorage::F32(y), l.shape().clone()))
    }

    fn bwd(&self, _x: &Tensor, y: &Tensor, g: &Tensor) -> CResult<Option<Tensor>> {
        Ok(Some(y.apply_op2_no_bwd(&g.contiguous()?, &CausalBackward { scale: self.scale })?))
    }
}

impl candle_core::CustomOp2 for CausalBackward {
    fn name(&self) -> &'static str {
        "zeropp-softmax-causal-backward"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> CResult<(CpuStorage, Shape)> {
        let (_, tk, y) = rows(s1, l1, "softmax_causal backward")?;
        let (_, _, g) = rows(s2, l2, "softmax_causal backward")?;
        if y.len() != g.len() {
            candle_core::bail!("softmax_causal backward: {} outputs, {} gradients", y.len(), g.len());
        }
        let mut dx = vec![0f32; y.len()];
        for ((yr, gr), dr) in y.chunks_exact(tk).zip(g.chunks_exact(tk)).zip(dx.chunks_exact_mut(tk)) {
            let dot: f32 = yr.iter().zip(gr).map(|(a, b)| a * b).sum();
            for ((d, &yv), &gv) in dr.iter_mut().zip(yr).zip(gr) {
                *d = self.scale * yv * (gv - dot);
            }
        }
        Ok((CpuStorage::F32(dx), l1.shape().clone()))
    }
}

/// `silu(gate) ⊙ up`, SwiGLU's product, in one pass forward and one per
/// input backward (d gate = g ⊙ up ⊙ σ(gate)(1 + gate(1 − σ(gate))), d up =
/// g ⊙ silu(gate)), where candle's composite form takes several of each.
/// f32 on the CPU with inputs of one shape runs these kernels; anything else
/// the composite form.
///
/// ```
/// use candle_core::{Device, Tensor};
/// let (g, u) = (Tensor::new(&[1f32, -2.0], &Device::Cpu)?, Tensor::new(&[3f32, 0.5], &Device::Cpu)?);
/// let y = zeropp_candle::ops::silu_mul(&g, &u)?.to_vec1::<f32>()?;
/// assert!((y[0] - 3.0 / (1.0 + (-1f32).exp())).abs() < 1e-6);
/// # Ok::<(), candle_core::Error>(())
/// ```
pub fn silu_mul(gate: &Tensor, up: &Tensor) -> CResult<Tensor> {
    if gate.dtype() != DType::F32
        || up.dtype() != DType::F32
        || gate.shape() != up.shape()
        || !gate.device().is_cpu()
    {
        return gate.silu()? * up;
    }
    gate.contiguous()?.apply_op2(&up.contiguous()?, SiluMul::Forward)
}

/// SwiGLU's kernels: the product, and the gradients of its two inputs.
#[derive(Debug, Clone, Copy)]
enum SiluMul {
    Forward,
    /// `(gate, up, g)` → d gate.
    GradGate,
    /// `(gate, g)` → d up.
    GradUp,
}

fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

impl candle_core::CustomOp2 for SiluMul {
    fn name(&self) -> &'static str {
        "zeropp-silu-mul"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> CResult<(CpuStorage, Shape)> {
        let (a, b) = (flat(s1, l1, "silu_mul")?, flat(s2, l2, "silu_mul")?);
        let y: Vec<f32> = match self {
            SiluMul::Forward => a.iter().zip(b).map(|(&x, &u)| x * sigmoid(x) * u).collect(),
            SiluMul::GradUp => a.iter().zip(b).map(|(&x, &g)| g * x * sigmoid(x)).collect(),
            SiluMul::GradGate => candle_core::bail!("silu_mul: the gate's gradient takes three inputs"),
        };
        Ok((CpuStorage::F32(y), l1.shape().clone()))
    }

    fn bwd(
        &self,
        gate: &Tensor,
        up: &Tensor,
        _y: &Tensor,
        g: &Tensor,
    ) -> CResult<(Option<Tensor>, Option<Tensor>)> {
        let g = g.contiguous()?;
        let dgate = gate.apply_op3_no_bwd(up, &g, &SiluMul::GradGate)?;
        let dup = gate.apply_op2_no_bwd(&g, &SiluMul::GradUp)?;
        Ok((Some(dgate), Some(dup)))
    }
}

impl candle_core::CustomOp3 for SiluMul {
    fn name(&self) -> &'static str {
        "zeropp-silu-mul-grad"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> CResult<(CpuStorage, Shape)> {
        let (x, u, g) = (flat(s1, l1, "silu_mul")?, flat(s2, l2, "silu_mul")?, flat(s3, l3, "silu_mul")?);
        let d: Vec<f32> = x
            .iter()
            .zip(u)
            .zip(g)
            .map(|((&x, &u), &g)| {
                let s = sigmoid(x);
                g * u * s * (1.0 + x * (1.0 - s))
            })
            .collect();
        Ok((CpuStorage::F32(d), l1.shape().clone()))
    }
}
