//! Causal scaled dot-product attention as one op with its own backward: the
//! scores, the scale, the causal mask, the softmax and the weighted sum of
//! the values, in the `[batch, seq, heads, head_dim]` layout that a linear
//! projection gives after a reshape, so no head transpose is ever made
//! contiguous.

use std::sync::{Mutex, PoisonError};

use candle_core::{CpuStorage, D, DType, Layout, Shape, Storage, Tensor};

use super::attention_kernel::{Backward, Dims, Forward};

type CResult<T> = candle_core::Result<T>;

/// `softmax(scale · q kᵀ, causal) v` per head, for `q` `[b, t_q, h, d]` and
/// `k`, `v` `[b, t_k, h_kv, d]`, giving `[b, t_q, h, d]`.
///
/// - **Causal:** query `i` sees keys `0..=i + t_k − t_q` (so `t_q ≤ t_k`;
///   with `t_q = t_k` it is the usual lower triangle).
/// - **Grouped-query attention:** `h` must be a multiple of `h_kv`; query
///   head `j` uses key/value head `j / (h / h_kv)`, as candle-transformers'
///   `repeat_kv` lays them out.
/// - **Backward:** closed form, with the probabilities recomputed from `q`
///   and `k` rather than kept (dV = Pᵀ dO, dS = P ⊙ (dO Vᵀ − rowsum(dO ⊙ O)),
///   dQ = scale · dS K, dK = scale · dSᵀ Q), so nothing of size `t_q × t_k`
///   outlives the op.
///
/// It replaces, forward and backward, the three head transposes, the
/// key/value repeat, two batched matmuls, the mask and the softmax of the
/// composite form. f32 on the CPU runs this kernel; other dtypes and devices
/// run the composite form, with the same values.
///
/// ```
/// use candle_core::{Device, Tensor};
/// let dev = Device::Cpu;
/// // One sequence of 2 tokens, one head of size 2.
/// let q = Tensor::new(&[[[[1f32, 0.0]], [[0.0, 1.0]]]], &dev)?;
/// let k = q.clone();
/// let v = Tensor::new(&[[[[10f32, 0.0]], [[0.0, 20.0]]]], &dev)?;
/// let y = zeropp_candle::ops::causal_attention(&q, &k, &v, 1.0)?.flatten_all()?.to_vec1::<f32>()?;
/// // Token 0 sees only itself.
/// assert_eq!(&y[..2], &[10.0, 0.0]);
/// // Token 1 weighs the two values by softmax([0, 1]).
/// let p1 = 1.0 / (1.0 + (-1f32).exp());
/// assert!((y[2] - 10.0 * (1.0 - p1)).abs() < 1e-5 && (y[3] - 20.0 * p1).abs() < 1e-5);
/// # Ok::<(), candle_core::Error>(())
/// ```
pub fn causal_attention(q: &Tensor, k: &Tensor, v: &Tensor, scale: f64) -> CResult<Tensor> {
    let dims = dims_of(q, k, v)?;
    let f32_cpu = [q, k, v].iter().all(|t| t.dtype() == DType::F32 && t.device().is_cpu());
    if !f32_cpu {
        return causal_attention_composite(q, k, v, scale);
    }
    let (q, k, v) = (q.contiguous()?, k.contiguous()?, v.contiguous()?);
    // A tracked call keeps its probabilities for the backward, which then
    // skips recomputing them (b · h · t_q · t_k floats, held until then).
    let keep = q.track_op() || k.track_op() || v.track_op();
    q.apply_op3(&k, &v, Attention { dims, scale: scale as f32, keep, kept: Mutex::new(None) })
}

/// [`causal_attention`] written with candle's composite ops (head transposes,
/// the key/value repeat, matmuls, a −∞ mask and the softmax): the reference
/// the kernel is checked against, and the path for dtypes other than f32.
pub fn causal_attention_composite(q: &Tensor, k: &Tensor, v: &Tensor, scale: f64) -> CResult<Tensor> {
    let Dims { b, tq, tk, h, kv, d } = dims_of(q, k, v)?;
    let heads = |x: &Tensor, n: usize, t: usize| -> CResult<Tensor> {
        let x = x.transpose(1, 2)?.contiguous()?;
        if n == h {
            return Ok(x);
        }
        x.unsqueeze(2)?.broadcast_as((b, n, h / n, t, d))?.reshape((b, h, t, d))
    };
    let (qh, kh, vh) = (heads(q, h, tq)?, heads(k, kv, tk)?, heads(v, kv, tk)?);
    let mask: Vec<f32> = (0..tq)
        .flat_map(|i| (0..tk).map(move |j| if j > i + tk - tq { f32::NEG_INFINITY } else { 0.0 }))
        .collect();
    let mask = Tensor::from_vec(mask, (tq, tk), q.device())?.to_dtype(q.dtype())?;
    let scores = (qh.matmul(&kh.t()?)? * scale)?.broadcast_add(&mask)?;
    let p = candle_nn::ops::softmax(&scores, D::Minus1)?;
    p.matmul(&vh)?.transpose(1, 2)?.contiguous()
}

fn dims_of(q: &Tensor, k: &Tensor, v: &Tensor) -> CResult<Dims> {
    let bad = || {
        candle_core::Error::Msg(format!(
            "causal_attention: q {:?}, k {:?}, v {:?} must be [b, t_q, h, d] and [b, t_k, h_kv, d] \
             with t_q <= t_k and h a multiple of h_kv",
            q.dims(),
            k.dims(),
            v.dims()
        ))
    };
    let (b, tq, h, d) = q.dims4().map_err(|_| bad())?;
    let (kb, tk, kv, kd) = k.dims4().map_err(|_| bad())?;
    if v.dims() != k.dims() || kb != b || kd != d || tq > tk || kv == 0 || !h.is_multiple_of(kv) {
        return Err(bad());
    }
    Ok(Dims { b, tq, tk, h, kv, d })
}

/// The contiguous f32 data of a kernel input.
fn data<'a>(s: &'a CpuStorage, l: &Layout) -> CResult<&'a [f32]> {
    let CpuStorage::F32(v) = s else { candle_core::bail!("causal_attention: f32 only") };
    let (a, b) = l
        .contiguous_offsets()
        .ok_or_else(|| candle_core::Error::Msg("causal_attention: not contiguous".into()))?;
    Ok(&v[a..b])
}

/// The forward op.
struct Attention {
    dims: Dims,
    scale: f32,
    /// Keep P for the backward (the call is tracked).
    keep: bool,
    kept: Mutex<Option<Vec<f32>>>,
}

impl candle_core::CustomOp3 for Attention {
    fn name(&self) -> &'static str {
        "zeropp-causal-attention"
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
        let (q, k, v) = (data(s1, l1)?, data(s2, l2)?, data(s3, l3)?);
        let n = self.dims;
        if q.len() != n.b * n.tq * n.h * n.d || k.len() != n.b * n.tk * n.kv * n.d || v.len() != k.len() {
            candle_core::bail!("causal_attention: inputs do not match their shapes");
        }
        let mut o = vec![0f32; q.len()];
        let mut p = if self.keep { vec![0f32; n.b * n.h * n.tq * n.tk] } else { Vec::new() };
        let keep = self.keep.then_some(&mut p[..]);
        pulp::Arch::new().dispatch(Forward { n, scale: self.scale, q, k, v, o: &mut o, keep });
        if self.keep {
            *self.kept.lock().unwrap_or_else(PoisonError::into_inner) = Some(p);
        }
        Ok((CpuStorage::F32(o), l1.shape().clone()))
    }

    fn bwd(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        o: &Tensor,
        g: &Tensor,
    ) -> CResult<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let back = AttentionBackward {
            dims: self.dims,
            scale: self.scale,
            q: q.clone(),
            k: k.clone(),
            v: v.clone(),
            o: o.clone(),
            kept: self.kept.lock().unwrap_or_else(PoisonError::into_inner).take(),
        };
        // One flat buffer [dq | dk | dv], split into views.
        let flat = g.contiguous()?.apply_op1_no_bwd(&back)?;
        let (nq, nk) = (q.elem_count(), k.elem_count());
        let dq = flat.narrow(0, 0, nq)?.reshape(q.shape())?;
        let dk = flat.narrow(0, nq, nk)?.reshape(k.shape())?;
        let dv = flat.narrow(0, nq + nk, nk)?.reshape(v.shape())?;
        Ok((Some(dq), Some(dk), Some(dv)))
    }
}

/// The backward op: upstream gradient → `[dq | dk | dv]`, with the forward's
/// inputs and output held (all contiguous f32 on the CPU).
struct AttentionBackward {
    dims: Dims,
    scale: f32,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    o: Tensor,
    /// The forward's probabilities, if it kept them.
    kept: Option<Vec<f32>>,
}

/// Runs `f` on the contiguous f32 data of four CPU tensors.
fn with_data<R>(ts: [&Tensor; 4], f: impl FnOnce([&[f32]; 4]) -> CResult<R>) -> CResult<R> {
    let guards = ts.map(|t| t.storage_and_layout());
    let mut out: [&[f32]; 4] = [&[]; 4];
    for (slot, (storage, layout)) in out.iter_mut().zip(&guards) {
        let Storage::Cpu(s) = &**storage else { candle_core::bail!("causal_attention: CPU only") };
        *slot = data(s, layout)?;
    }
    f(out)
}

impl candle_core::CustomOp1 for AttentionBackward {
    fn name(&self) -> &'static str {
        "zeropp-causal-attention-backward"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> CResult<(CpuStorage, Shape)> {
        let g = data(s, l)?;
        let n = self.dims;
        with_data([&self.q, &self.k, &self.v, &self.o], |[q, k, v, o]| {
            let (nq, nk) = (q.len(), k.len());
            if g.len() != nq || o.len() != nq || v.len() != nk {
                candle_core::bail!("causal_attention backward: inconsistent sizes");
            }
            let mut out = vec![0f32; nq + 2 * nk];
            let (dq, dkv) = out.split_at_mut(nq);
            let (dk, dv) = dkv.split_at_mut(nk);
            let scale = self.scale;
            let kept = self.kept.as_deref().filter(|p| p.len() == n.b * n.h * n.tq * n.tk);
            pulp::Arch::new().dispatch(Backward { n, scale, q, k, v, o, g, dq, dk, dv, kept });
            Ok((CpuStorage::F32(out), Shape::from(nq + 2 * nk)))
        })
    }
}
